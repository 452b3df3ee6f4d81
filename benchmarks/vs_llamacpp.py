#!/usr/bin/env python3
"""fucina against llama.cpp on the same GGUF, same threads, paired in one run.

    python benchmarks/vs_llamacpp.py MODEL.gguf [MODEL.gguf ...] [--pp 1,16,128,512] [--tg 64]
           [--depth 0] [--reps 3] [--rounds 2] [--threads 2] [--isa native,avx2]
    python benchmarks/vs_llamacpp.py --sweep [--shapes 0.6b,1.7b] [--quants Q4_K_M,Q8_0]
           [--dir ~/.cache/fucina/bench] [--vocab VOCAB.gguf] [--markdown OUT.md] [--json OUT.json]

llama.cpp is found through FUCINA_LLAMA_CPP (the folder holding llama-bench and its
libraries) or on PATH; without it the script prints a skip and exits 0. Each round runs
`fucina bench` then `llama-bench` with the same tests (prompt lengths as prefill tests at
depth 0, decode of --tg tokens at each depth), and each figure is the median over rounds
of each side and of the per-round ratio fucina / llama.cpp (> 1: fucina is faster).
Absolute tokens/s drift on a shared machine; the paired ratio is the figure to quote.

--isa avx2 runs both engines at the AVX2 level on an AVX-512 host: fucina with
FUCINA_ISA=avx2 (and torch's own ops with ATEN_CPU_CAPABILITY=avx2, unless set), llama.cpp
from a folder holding only its AVX2 (haswell) CPU backend.

--sweep writes (once, into --dir) Qwen3-shaped models with random weights, F16, and
quantizes them with llama-quantize: the 0.6B shape (28 layers, 1024 wide, FFN 3072,
16/8 heads of 128) and the 1.7B shape (28 layers, 2048 wide, FFN 6144); the vocabulary is
a synthetic byte-level one of Qwen3's 151,936 ids unless --vocab copies a real one. The
types llama-quantize writes only with an importance matrix (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ2_M, Q2_K_S) get a uniform one: the files time kernels, not quality.
Then it times prompt lengths 1, 4, 16, 32, 64, 128, 256, 512 and decode at depths 0, 512
and 2048 on each, at both ISA levels, and prints every figure, then the scoreboard grid
BENCHMARK.md shows (a line per model and ISA, the ratios, losses in bold), with the CPU, the
date and the commit. Decode also gets GB/s: the bytes a token reads
(every tensor but the embedding rows; the tied output matrix counts once; of a MoE's
stacked expert tensors, the routed share) times tokens/s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP_PP = [1, 4, 16, 32, 64, 128, 256, 512]
SWEEP_DEPTHS = [0, 512, 2048]
SHAPES = {"0.6b": dict(layers=28, hidden=1024, ffn=3072, heads=16, kv_heads=8, head_dim=128),
          "1.7b": dict(layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128)}
N_VOCAB = 151936


# -- finding llama.cpp -------------------------------------------------------------------

def find_llama_bench() -> Path | None:
    home = os.environ.get("FUCINA_LLAMA_CPP")
    if home and (Path(home) / "llama-bench").is_file():
        return Path(home) / "llama-bench"
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def llama_env(bench: Path) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(bench.parent), env.get("LD_LIBRARY_PATH")]))
    return env


def avx2_llama(bench: Path, into: Path) -> Path:
    """A folder where llama.cpp can load only its AVX2 CPU backend: its tools and
    libraries linked in, the CPU variants but haswell left out."""
    into.mkdir(parents=True, exist_ok=True)
    for f in bench.parent.iterdir():
        if f.name.startswith("libggml-cpu-") and "haswell" not in f.name:
            continue
        dst = into / f.name
        if not dst.exists():
            if f.name == bench.name:       # a copy: llama.cpp looks for backends beside the real executable
                shutil.copy2(f, dst)
            else:
                dst.symlink_to(f.resolve())
    return into / bench.name


# -- the two sides -----------------------------------------------------------------------

def run(cmd: list[str], env: dict, timeout: int, cwd: str | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        sys.stderr.write(f"command failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr[-3000:]}\n")
        sys.exit(2)
    return p.stdout


def tests_of(a) -> list[tuple[str, int]]:
    return [(f"pp{p}", 0) for p in a.pp] + [(f"tg{a.tg}", d) for d in a.depth if a.tg > 0]


def fucina_side(a, model: str, isa: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if isa != "native":
        env["FUCINA_ISA"] = isa
        if isa in ("avx2", "avx512"):   # torch's glue at the same level as our kernels
            env.setdefault("ATEN_CPU_CAPABILITY", isa)
    fucina = shlex.split(a.fucina) if a.fucina else [sys.executable, "-m", "fucina"]
    got = {}
    common = ["--reps", str(a.reps), "--threads", str(a.threads), "--json"]
    if a.pp:
        out = run(fucina + ["bench", model, "--pp", ",".join(map(str, a.pp)), "--tg", "0", "-d", "0"] + common,
                  env, a.timeout)
        got.update({(r["test"], r["depth"]): r["tok_s"] for r in _last_json(out)["results"]})
    if a.tg > 0:
        out = run(fucina + ["bench", model, "--pp", "0", "--tg", str(a.tg),
                            "-d", ",".join(map(str, a.depth))] + common, env, a.timeout)
        d = _last_json(out)
        got.update({(r["test"], r["depth"]): r["tok_s"] for r in d["results"]})
        got["kernels"] = d.get("kernels")
    return got


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.strip().splitlines() if ln.startswith("{")][-1])


def llama_side(a, model: str, bench: Path) -> dict:
    env = llama_env(bench)
    base = [str(bench), "-m", model, "-t", str(a.threads), "-r", str(a.reps), "-o", "json"]
    rows = []
    if a.pp:
        rows += json.loads(run(base + ["-p", ",".join(map(str, a.pp)), "-n", "0", "-d", "0"], env, a.timeout,
                               cwd=str(bench.parent)))
    if a.tg > 0:
        rows += json.loads(run(base + ["-p", "0", "-n", str(a.tg), "-d", ",".join(map(str, a.depth))], env,
                               a.timeout, cwd=str(bench.parent)))
    got = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r.get("n_prompt", 0) > 0 else f"tg{r['n_gen']}"
        got[(test, int(r.get("n_depth", 0)))] = float(r["avg_ts"])
    return got


def read_bytes(model: str) -> int:
    """Bytes one decoded token reads: every tensor but the embedding table, whose one
    row is negligible, unless it is also the output matrix (tied)."""
    sys.path.insert(0, str(ROOT / "src"))
    from fucina.gguf import GGUFFile

    f = GGUFFile(model)
    names = {t.name: t.nbytes for t in f.tensors.values()}
    tied = "output.weight" not in names
    arch = f.metadata.get("general.architecture", "")
    used, count = f.metadata.get(f"{arch}.expert_used_count"), f.metadata.get(f"{arch}.expert_count")
    # a MoE token reads only its routed experts' slices of the stacked "_exps" tensors
    share = used / count if used and count else 1.0
    return int(sum(n * (share if "_exps." in k else 1.0) for k, n in names.items()
                   if k != "token_embd.weight" or tied))


def compare(a, model: str, isa: str, bench: Path) -> list[dict]:
    pairs: dict = {}
    kernels = None
    for _ in range(a.rounds):
        f = fucina_side(a, model, isa)
        kernels = f.pop("kernels", kernels)
        ll = llama_side(a, model, bench)
        for key in tests_of(a):
            if key in f and key in ll:
                pairs.setdefault(key, []).append((f[key], ll[key]))
    nbytes = read_bytes(model) if a.tg > 0 else 0
    rows = []
    for (test, depth), v in pairs.items():
        row = {"model": os.path.basename(model), "isa": isa, "fucina_kernels": kernels, "test": test,
               "depth": depth, "fucina": statistics.median(x for x, _ in v),
               "llama_cpp": statistics.median(y for _, y in v), "ratio": statistics.median(x / y for x, y in v)}
        if test.startswith("tg"):
            row["fucina_gb_s"] = row["fucina"] * nbytes / 1e9
            row["llama_cpp_gb_s"] = row["llama_cpp"] * nbytes / 1e9
        rows.append(row)
        print(f"{row['model']:34} {isa:7} {test:6} d{depth:<5} {row['fucina']:9.2f} {row['llama_cpp']:9.2f} "
              f"{row['ratio']:6.2f}x", flush=True)
    return rows


# -- the sweep's models ------------------------------------------------------------------

def _byte_vocab_writer(w, n_vocab: int) -> None:
    """A GPT-2-style byte-level vocabulary padded with plain tokens to `n_vocab` ids,
    loadable by both engines (random weights need no real text)."""
    from synth import byte_tokens

    byte_tok = byte_tokens()
    tokens = [byte_tok[b] for b in range(256)] + ["ab"]
    tokens += [f"tok{i}" for i in range(len(tokens), n_vocab - 3)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (n_vocab - 3) + [3, 3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(n_vocab - 3)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)


def sweep_models(a, bench: Path) -> list[str]:
    import gguf

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    from oracle import NEEDS_IMATRIX, write_uniform_imatrix
    from synth import write_model

    d = Path(os.path.expanduser(a.dir))
    d.mkdir(parents=True, exist_ok=True)
    vocab = a.vocab
    if vocab is None:
        vocab = str(d / f"vocab-bytes-{N_VOCAB}.gguf")
        if not os.path.exists(vocab):
            w = gguf.GGUFWriter(vocab, "qwen3")
            _byte_vocab_writer(w, N_VOCAB)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
    out = []
    quantize = bench.parent / "llama-quantize"
    for shape in a.shapes:
        f16 = d / f"qwen3-{shape}-shaped-F16.gguf"
        for q in a.quants:
            target = d / f"qwen3-{shape}-shaped-{q}.gguf"
            if not target.exists():
                if not f16.exists():
                    print(f"writing {f16} ...", flush=True)
                    write_model(f16, "qwen3", vocab=vocab, qtype=gguf.GGMLQuantizationType.F16, seed=1,
                                ctx=40960, **SHAPES[shape])
                print(f"quantizing {target.name} ...", flush=True)
                imatrix = []
                if q in NEEDS_IMATRIX:   # uniform: these files time kernels, not quality
                    imatrix = ["--imatrix", str(write_uniform_imatrix(f16, d / f"qwen3-{shape}-uniform.imatrix.dat"))]
                run([str(quantize), *imatrix, str(f16), str(target), q], llama_env(bench), a.timeout)
            out.append(str(target))
    return out


# -- the report --------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def markdown(rows: list[dict], a) -> str:
    head = (f"{cpu_name()}, {a.threads} threads, {datetime.date.today().isoformat()}, commit {commit()}; "
            f"median of {a.rounds} paired rounds of {a.reps} reps; tokens/s, ratio = fucina / llama.cpp")
    lines = [head, "", "| model | ISA | test | fucina | llama.cpp | ratio | decode GB/s (fucina / llama.cpp) |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        test = r["test"] + (f" @ d{r['depth']}" if r["depth"] else "")
        gbs = f"{r['fucina_gb_s']:.1f} / {r['llama_cpp_gb_s']:.1f}" if "fucina_gb_s" in r else ""
        lines.append(f"| {r['model'].removesuffix('.gguf')} | {r['isa']} | {test} | {r['fucina']:.1f} | "
                     f"{r['llama_cpp']:.1f} | {r['ratio']:.2f} | {gbs} |")
    return "\n".join(lines) + "\n" + grid(rows)


def grid(rows: list[dict]) -> str:
    """The scoreboard's grid: a line per model and ISA, a column per prompt length and decode
    depth, the paired ratios, losses in bold (empty where the rows hold a single test)."""
    def column(r: dict) -> str:
        return r["test"] if r["test"].startswith("pp") else f"tg d{r['depth']}"

    cols = list(dict.fromkeys(column(r) for r in rows))
    if len(cols) < 2:
        return ""
    cells: dict[tuple, dict] = {}
    for r in rows:
        ratio = f"{r['ratio']:.2f}"
        cells.setdefault((r["model"].removesuffix(".gguf"), r["isa"]), {})[column(r)] = \
            f"**{ratio}**" if r["ratio"] < 1.0 else ratio
    lines = ["", "| model | ISA | " + " | ".join(cols) + " |", "| --- | --- |" + " ---: |" * len(cols)]
    for (model, isa), row in cells.items():
        lines.append(f"| {model} | {isa} | " + " | ".join(row.get(c, "") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--sweep", action="store_true", help="the scoreboard sweep on Qwen3-shaped models")
    ap.add_argument("--pp", type=counts, default=None, help="prompt lengths (default 128; sweep: 1..512)")
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--depth", type=counts, default=None, help="decode depths (default 0; sweep: 0,512,2048)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=None, help="native and/or avx2, comma-separated (default native; "
                                                "sweep: native,avx2 on an AVX-512 host)")
    ap.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    ap.add_argument("--quants", type=lambda s: s.split(","), default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--dir", default="~/.cache/fucina/bench", help="where the sweep's models are written")
    ap.add_argument("--vocab", help="copy this GGUF's tokenizer into the sweep's models")
    ap.add_argument("--fucina", default=None, help="the fucina command (default: this tree's, via python -m)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--markdown", dest="md_out")
    a = ap.parse_args()

    bench = find_llama_bench()
    if bench is None:
        print("skip: llama.cpp's llama-bench not found (set FUCINA_LLAMA_CPP to its folder or put it on PATH)")
        return 0
    if not a.sweep and not a.models:
        ap.error("give MODEL.gguf files or --sweep")
    a.pp = a.pp if a.pp is not None else (SWEEP_PP if a.sweep else [128])
    a.depth = a.depth if a.depth is not None else (SWEEP_DEPTHS if a.sweep else [0])
    avx512 = "avx512f" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
    isas = a.isa.split(",") if a.isa else (["native", "avx2"] if a.sweep and avx512 else ["native"])
    models = sweep_models(a, bench) + a.models if a.sweep else a.models

    rows = []
    print(f"{'model':34} {'isa':7} {'test':6} {'depth':6} {'fucina':>9} {'llama.cpp':>9} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for isa in isas:
                side = bench if isa == "native" else avx2_llama(bench, Path(tmp) / "avx2")
                rows += compare(a, model, isa, side)
    table = markdown(rows, a)
    print()
    print(table)
    if a.md_out:
        Path(a.md_out).write_text(table)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"cpu": cpu_name(), "commit": commit(), "threads": a.threads,
                                                "date": datetime.date.today().isoformat(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
