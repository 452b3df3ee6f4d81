"""Ternary formats: kernel timings against Q4_K, and how close TQ files are to the exact model.

    python benchmarks/ternary.py kernels [--isa avx512 --isa avx2]   # per-call time, TQ2_0 / TQ1_0 / Q4_K
    python benchmarks/ternary.py kl MODEL.gguf [--tokens 64]          # mean KL to the exact model, ours and llama.cpp's
    python benchmarks/ternary.py ptqtp SRC.gguf --planes 1 2 3 [--against Q.gguf ...]   # decorate, KL, decode speed
    python benchmarks/ternary.py speedfile SRC.gguf OUT.gguf --planes 2 [--tie]   # PTQTP layout (speed only)
    python benchmarks/ternary.py decode A.gguf B.gguf ... [--rows]     # paired greedy decode tok/s, ratios to A
    python benchmarks/ternary.py groups [--isa avx2]                  # TQ2_0 rows vs 8-row groups, per call

`kernels`: the Qwen3-0.6B ffn shape (3072 x 1024) at m = 1 (decode), 4 (a verify pass) and
128 (prefill), one thread, the three formats and PTQTP K = 1, 2, 3 (K stacked TQ2_0 planes, one
fused call) and PTQTP2-tied (the scale-tied pair folded: one pass) alternated A B C A B C in one
process, process CPU time per call, median of --rounds. `ptqtp`: `fucina quantize --ptqtp K`
of SRC for each K (wall time, the share decorated), then for SRC, each decorated file and
each --against file: mean KL to SRC over --tokens teacher-forced ids, and greedy decode
tokens/s (one token a step, the models alternated per round, median of --rounds), with the
decode ratio to the first --against.
`kl`: teacher-forced logits over --tokens ids of a fixed text from fucina (native kernels),
from llama.cpp (llama-logits, $FUCINA_LLAMA_CPP) and from the exact model (the same file on
fucina's reference path: every weight widened to f32, f32 arithmetic); mean over positions
of KL(exact || each). Speed figures on a shared box are loaded: quote the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T

FORMATS = (T.Q4_K, T.TQ2_0, T.TQ1_0)


def rand_raw(qt: T, n: int, k: int, rng) -> torch.Tensor:
    from fucina.quant import quantize
    return torch.as_tensor(quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qt)))


def _ptqtp_weights(n: int, k: int, rng) -> dict:
    """PTQTP K = 1..3 fitted to one random matrix's first 256 rows, tiled to n rows (the
    solver is slow; the kernel's time does not depend on the values)."""
    from fucina.quant.ptqtp import fit, plane_bytes
    from fucina.weights.ptqtp import PtqtpWeight

    W = rng.standard_normal((256, k)).astype(np.float32) * 0.05
    out = {}
    for planes in (1, 2, 3):
        f = fit(W, planes)
        out[f"PTQTP{planes}"] = PtqtpWeight([np.tile(plane_bytes(f, p), (n // 256, 1)) for p in range(planes)], n, k)
    f = fit(W, 2, tie=True)   # scale-tied K=2: one folded plane, one dot pass
    out["PTQTP2-tied"] = PtqtpWeight([np.tile(plane_bytes(f, p), (n // 256, 1)) for p in range(2)], n, k, tied=True)
    return out


def kernels(args) -> None:
    K.set_threads(1)
    n, k = 3072, 1024
    rng = np.random.default_rng(0)
    raws = {qt: rand_raw(qt, n, k, rng) for qt in FORMATS}
    ptqtp = _ptqtp_weights(n, k, rng)
    calls = {qt.name: (lambda x, qt=qt: K.matmul(raws[qt], qt, n, k, x)) for qt in FORMATS}
    calls.update(ptqtp)
    for isa in args.isa or K.supported_isas():
        if isa not in K.supported_isas():
            continue
        K.set_isa(isa)
        for m in (1, 4, 128):
            x = torch.randn(m, k)
            reps = max(1, 64 // m)
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    call(x)
                    t = time.process_time()
                    for _ in range(reps):
                        call(x)
                    times[name].append((time.process_time() - t) / reps)
            med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
            q4 = med["Q4_K"]
            print(f"{isa:8s} m={m:<4d} " + "  ".join(f"{name} {med[name]:8.1f} us ({q4 / med[name]:.2f}x Q4_K)"
                                                    for name in calls), flush=True)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def kl(args) -> None:
    from fucina.models import load_model
    from fucina.text.evaluate import teacher_forced_logits

    text = ("The history of the city goes back more than two thousand years. In the Middle Ages it was a "
            "busy market town on the river, and merchants came from far away to trade wool, salt and wine. ") * 4
    model = load_model(args.model)
    from fucina.text.tokenizer import Tokenizer
    ids = Tokenizer.from_gguf(args.model).encode(text)[: args.tokens]
    ours = teacher_forced_logits(model, ids).numpy()
    K.set_enabled(False)
    try:
        exact = teacher_forced_logits(load_model(args.model), ids).numpy()
    finally:
        K.set_enabled(True)
    line = f"{os.path.basename(args.model)}: {len(ids)} tokens, mean KL to exact: fucina {_kl(exact, ours):.3e}"
    bin_dir = os.environ.get("FUCINA_LLAMA_CPP")
    if bin_dir:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        import oracle
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "ref.f32")
            oracle.run("llama-logits", args.model, ",".join(map(str, ids)), out, "--threads", "2")
            ref = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
        line += f", llama.cpp {_kl(exact, ref):.3e}; top-1 agreement with llama.cpp {(ref.argmax(1) == ours.argmax(1)).mean():.3f}"
    print(line, flush=True)


def _decode_tps(models: dict, steps: int, rounds: int) -> dict:
    """Greedy decode tokens/s of each model (one token a step after a 4-token prompt), the
    models alternated per round, median of the rounds."""
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            cache = model.init_cache(steps + 8)
            logits = model.forward_step(cache, [1, 2, 3, 4], 0)
            t = time.perf_counter()
            for i in range(steps):
                logits = model.forward_step(cache, [int(logits.argmax())], 4 + i)
            times[name].append(steps / (time.perf_counter() - t))
    return {name: statistics.median(v) for name, v in times.items()}


def ptqtp(args) -> None:
    from fucina.cli.quantize import decorate, shares
    from fucina.models import load_model
    from fucina.text.evaluate import teacher_forced_logits

    K.set_threads(args.threads)
    ids = list(range(100, 100 + args.tokens))
    if args.text:
        from fucina.text.tokenizer import Tokenizer
        with open(args.text) as fh:
            ids = Tokenizer.from_gguf(args.src).encode(fh.read())[: args.tokens]
    paths = {}
    os.makedirs(args.out, exist_ok=True)
    for planes, tie in [(p, False) for p in args.planes] + ([(2, True)] if args.tie else []):
        label = f"{planes}{'-tied' if tie else ''}"
        out = os.path.join(args.out, f"{os.path.basename(args.src)[:-5]}-ptqtp{label}.gguf")
        if not os.path.exists(out):
            t = time.perf_counter()
            report = decorate(args.src, out, planes, tie=tie)
            sh = shares(report)
            took = time.perf_counter() - t
            print(f"PTQTP K={label}: decorated {sh['decorated']:.1%} of the weights in {took:.0f} s "
                  f"(kept: {', '.join(f'{w} {v:.1%}' for w, v in sh.items() if w != 'decorated')})", flush=True)
        paths[f"PTQTP{label}"] = out
    for q in args.against:
        paths[os.path.basename(q)] = q
    ref = teacher_forced_logits(load_model(args.src), ids).numpy()
    models = {name: load_model(p) for name, p in paths.items()}
    for name, m in models.items():
        print(f"{name}: mean KL to {os.path.basename(args.src)} over {len(ids)} tokens "
              f"{_kl(ref, teacher_forced_logits(m, ids).numpy()):.4e}", flush=True)
    tps = _decode_tps(models, args.steps, args.rounds)
    base = tps[os.path.basename(args.against[0])] if args.against else None
    for name, v in tps.items():
        print(f"{name}: decode {v:.1f} tok/s" + (f" ({v / base:.2f}x {os.path.basename(args.against[0])})"
                                                 if base else ""), flush=True)


def groups(args) -> None:
    """TQ2_0 on its rows against the same weights in 8-row groups (kernels.tq2_interleave),
    m = 1, 4, 128, two Qwen3-0.6B shapes, one thread, wall time per call, median of --rounds."""
    K.set_threads(1)
    K.set_isa(args.isa)
    for m in (1, 4, 128):
        for n, k in ((3072, 1024), (1024, 3072)):
            raw = rand_raw(T.TQ2_0, n, k, np.random.default_rng(0))
            x8 = K.tq2_interleave(raw, n)
            x, y, rb = torch.randn(m, k), torch.empty(m, n), k // 256 * 66
            calls = {"rows": (int(T.TQ2_0), raw), "groups": (K.TQ2_X8, x8)}
            reps, times = max(2, 50 // m), {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, (qt, w) in calls.items():
                    K._native.matmul(qt, w.data_ptr(), rb, n, k, x.data_ptr(), m, y.data_ptr(), n)
                    t = time.perf_counter()
                    for _ in range(reps):
                        K._native.matmul(qt, w.data_ptr(), rb, n, k, x.data_ptr(), m, y.data_ptr(), n)
                    times[name].append((time.perf_counter() - t) / reps * 1e6)
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{K.isa()} m={m} {n}x{k}: rows {med['rows']:.1f} us, groups {med['groups']:.1f} us "
                  f"({med['rows'] / med['groups']:.2f}x)", flush=True)


def _layer_weights(model) -> list:
    from fucina.weights.lora import weight_slots
    return [w for L in model.layers for _, _, w in weight_slots(L)]


def decode(args) -> None:
    """Greedy decode tokens/s of each file, alternated per round, ratios to the first."""
    from fucina.models import load_model

    K.set_threads(args.threads)
    models = {os.path.basename(p): load_model(p) for p in args.models}
    if args.rows:   # each file whose TQ2_0 weights went to 8-row groups, also on its rows
        for p in args.models:
            if any(getattr(w.kernel, "qtype", None) == K.TQ2_X8 for w in _layer_weights(models[os.path.basename(p)])):
                os.environ["FUCINA_TQ2_X8"] = "0"
                models[os.path.basename(p) + " [rows]"] = load_model(p)
                del os.environ["FUCINA_TQ2_X8"]
    tps = _decode_tps(models, args.steps, args.rounds)
    base = tps[os.path.basename(args.models[0])]
    for name, v in tps.items():
        print(f"{name}: decode {v:.1f} tok/s ({v / base:.2f}x {os.path.basename(args.models[0])})", flush=True)


def speedfile(args) -> None:
    """A PTQTP-layout file for speed runs only: each eligible projection as K planes from
    ggml's TQ2_0 encoder on the running residual (seconds, where the solver takes hours on a
    0.6B model); the kernels' time does not depend on the values, its closeness is not PTQTP's.
    --tie: the scale-tied layout (2 planes, served folded), from one uniform 9-level code a
    weight at s = max |w| / 4 a group (tie-rounded) in place of the tied solver."""
    import gguf

    from fucina.cli.quantize import _rel_err, _rewrite, ptqtp_eligible
    from fucina.gguf.ptqtp import PLANES_KEY, VERSION, VERSION_KEY, plane_name
    from fucina.gguf.ptqtp import TIE_KEY
    from fucina.quant import dequantize, quantize
    from fucina.quant.ptqtp import GROUP, Fit, plane_bytes, tie_round

    if args.tie and args.planes != 2:
        raise SystemExit("--tie takes --planes 2")

    def encode_tied(w, name, t, rows):
        g = rows.reshape(-1, GROUP)
        s = tie_round(g.abs().amax(-1) / 4).clamp_min(2 ** -14)
        c = torch.clamp(torch.round(g / s.unsqueeze(-1)), -4, 4)
        t0 = torch.div(c + 4, 3, rounding_mode="floor") - 1
        trits = torch.stack([t0, c - 3 * t0]).to(torch.int8).reshape(2, *rows.shape)
        f = Fit(trits, torch.stack([3 * s, s]).reshape(2, rows.shape[0], -1), 0, 0, True)
        for p in range(2):
            q = plane_bytes(f, p)
            w.add_tensor(plane_name(name, p), q, raw_shape=tuple(q.shape), raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        return dict(dst="PTQTP2-tied", rel_err=_rel_err(f.weight(), rows))

    def encode(w, name, t, rows):
        if args.tie:
            return encode_tied(w, name, t, rows)
        res = rows.clone()
        for p in range(args.planes):
            q = quantize(res, int(T.TQ2_0))
            res -= dequantize(q.reshape(-1), T.TQ2_0, res.numel()).reshape(res.shape)
            w.add_tensor(plane_name(name, p), q.numpy(), raw_shape=tuple(q.shape),
                         raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        return dict(dst=f"PTQTP{args.planes}", rel_err=_rel_err(rows - res, rows))

    def keys(w):
        w.add_uint32(VERSION_KEY, VERSION)
        w.add_uint32(PLANES_KEY, args.planes)
        if args.tie:
            w.add_uint32(TIE_KEY, 1)

    report = _rewrite(args.src, args.out, None, lambda t, asked: ptqtp_eligible(t), encode, "", keys)
    print(f"{sum(r['kept'] is None for r in report)} tensors as {args.planes} "
          f"{'scale-tied' if args.tie else 'residual TQ2_0'} planes -> {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("kernels")
    s.add_argument("--isa", action="append")
    s.add_argument("--rounds", type=int, default=9)
    s = sub.add_parser("kl")
    s.add_argument("model")
    s.add_argument("--tokens", type=int, default=64)
    s = sub.add_parser("ptqtp")
    s.add_argument("src")
    s.add_argument("--planes", type=int, nargs="+", default=[1, 2, 3])
    s.add_argument("--tie", action="store_true", help="also the scale-tied K=2 file")
    s.add_argument("--against", nargs="*", default=[], help="other encodings of SRC (first: the decode baseline)")
    s.add_argument("--out", default="ptqtp-out", help="folder for the decorated files (kept: reruns reuse them)")
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--text", help="a text file to take the ids from (default: ids 100..)")
    s.add_argument("--steps", type=int, default=32)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("decode")
    s.add_argument("models", nargs="+")
    s.add_argument("--steps", type=int, default=32)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rows", action="store_true",
                   help="also each file whose TQ2_0 weights took 8-row groups, on its rows (FUCINA_TQ2_X8=0)")
    s = sub.add_parser("groups")
    s.add_argument("--isa", default="avx2")
    s.add_argument("--rounds", type=int, default=9)
    s = sub.add_parser("speedfile")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--planes", type=int, default=2)
    s.add_argument("--tie", action="store_true", help="the scale-tied layout (--planes 2), served folded")
    a = ap.parse_args()
    {"kernels": kernels, "kl": kl, "ptqtp": ptqtp, "decode": decode, "speedfile": speedfile,
     "groups": groups}[a.cmd](a)


if __name__ == "__main__":
    main()
