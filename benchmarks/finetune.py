"""LoRA SFT on SmolLM2-135M-Instruct (Q4_1): held-out accuracy before/after, loss curve,
training tokens/s and peak RSS, fucina (quantized weights) vs torch autograd on the same
model dequantized to f32 (the peer), each in its own process so peak RSS is its own.

The task is a fixed answer format the base model lacks: a sentence mentions a person and a
city (invented words); the reply must be exactly {"name": "<person>", "city": "<city>"}.
Held-out examples use names, cities and sentence templates never seen in training (so it
must copy, not memorise).

    python benchmarks/finetune.py all [--model M] [--steps 60] [--threads 1] [--out DIR]
    python benchmarks/finetune.py data --out DIR
    python benchmarks/finetune.py train --mode quant|dense --out DIR   # one trainer, JSON out
    python benchmarks/finetune.py eval --out DIR [--adapter A.gguf]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

_ONSET = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "ch", "sh"]
_VOWEL = ["a", "e", "i", "o", "u", "ai", "ou"]


def invented_words(seed: int, n: int, syllables: int) -> list[str]:
    """Capitalised made-up words (no model has seen them as names: the reply must copy)."""
    rnd, out = random.Random(seed), set()
    while len(out) < n:
        out.add("".join(rnd.choice(_ONSET) + rnd.choice(_VOWEL) for _ in range(syllables)).capitalize())
    return sorted(out)


TEMPLATES = [
    "Yesterday {n} took a train to {c} to visit old friends.",
    "{n} has lived in {c} for almost ten years now.",
    "After the conference in {c}, {n} flew back home.",
    "Last summer {n} opened a small bakery in {c}.",
    "The package for {n} was shipped from {c} on Monday.",
    "{n} is studying architecture at a university in {c}.",
    "Our new colleague {n} just moved here from {c}.",
    "In {c}, {n} met the mayor at a charity dinner.",
    "{n} wrote a novel set in the old streets of {c}.",
    "It rained the whole week {n} spent in {c}.",
    "{n} keeps a photo of {c} on the office wall.",
    "The marathon in {c} was won by {n} this year.",
]
INSTRUCTION = "Extract the person and the city from this sentence: "


def make_split(seed: int, names, cities, templates, n: int) -> list[dict]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        nm, ct, tp = rnd.choice(names), rnd.choice(cities), rnd.choice(templates)
        if nm == ct:
            continue
        out.append({"messages": [
            {"role": "user", "content": INSTRUCTION + tp.format(n=nm, c=ct)},
            {"role": "assistant", "content": json.dumps({"name": nm, "city": ct})}]})
    return out


def cmd_data(out: str, n_train: int = 200, n_test: int = 40) -> None:
    os.makedirs(out, exist_ok=True)
    # invented names (2 syllables) and cities (3), disjoint between the splits, and
    # held-out sentence templates never seen in training
    names, cities = invented_words(1, 300, 2), invented_words(2, 300, 3)
    train = make_split(1, names[::2], cities[::2], TEMPLATES[:9], n_train)
    test = make_split(2, names[1::2], cities[1::2], TEMPLATES[9:], n_test)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        with open(os.path.join(out, name), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


def cmd_eval(model: str, out: str, adapter: str | None, threads: int) -> dict:
    import fucina
    import fucina.kernels as K

    K.set_threads(threads)
    llm = fucina.load(model, n_ctx=256, lora=adapter)
    rows = [json.loads(line) for line in open(os.path.join(out, "test.jsonl"))]
    hits, samples = 0, []
    for r in rows:
        want = r["messages"][1]["content"]
        got = llm.chat(max_tokens=32).send(r["messages"][0]["content"]).strip()
        hits += got == want
        if len(samples) < 3:
            samples.append(got)
    return dict(accuracy=hits / len(rows), n=len(rows), samples=samples)


def cmd_train(model: str, out: str, mode: str, steps: int, threads: int, lr: float,
              targets: str, rank: int) -> dict:
    import fucina.kernels as K
    from fucina.models import load_model
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.tokenizer import Tokenizer
    from fucina.train.data import read_jsonl
    from fucina.train.lora import LoRAConfig
    from fucina.train.trainer import TrainConfig, Trainer, peak_rss_mb

    K.set_threads(threads)
    m = load_model(model)
    tok = Tokenizer.from_metadata(m.gguf.metadata)
    tpl = ChatTemplate.from_metadata(m.gguf.metadata, tok)
    train = read_jsonl(os.path.join(out, "train.jsonl"), tok, tpl, 256)
    rss_loaded = peak_rss_mb()
    # the peer keeps activations; quant = the default (auto)
    ckpt = {"quant": True, "quant-full": "full", "quant-keep": "keep-matmul"}.get(mode, "off")
    cfg = TrainConfig(steps=steps, lr=lr, batch=8, grad_accum=1, ctx=256, seed=0, warmup=5,
                      grad_checkpoint=ckpt)
    tr = Trainer(m, LoRAConfig(rank=rank, alpha=2 * rank, targets=targets), cfg, train, None,
                 os.path.join(out, f"run-{mode}"), dense=(mode == "dense"), progress=False)
    t0, c0 = time.perf_counter(), time.process_time()
    s = tr.fit()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # tokens per CPU-second: on a shared box the wall clock counts other processes' time too
    return dict(mode=mode, steps=s["steps"], tokens=s["tokens"], train_s=s["train_s"], wall_s=wall,
                tok_s=s["tok_s"], cpu_s=cpu, tok_cpu_s=s["tokens"] / cpu, peak_rss_mb=s["peak_rss_mb"], rss_after_load_mb=rss_loaded,
                losses=[round(h["loss"], 4) for h in tr.history], adapter=s["adapter"])


def cmd_llamacpp(model: str, out: str, adapter: str, n: int = 10) -> dict:
    """Greedy replies of llama.cpp (`llama-completion --lora`, and on our merged export) to the
    first n held-out prompts, beside fucina's with the adapter merged."""
    import fucina
    from fucina.train.adapters import read_adapter
    from fucina.train.export import export_merged

    bin_dir = os.environ["FUCINA_LLAMA_CPP_RUN"]   # a runnable copy (tests/oracle.py oracle_dir())
    llm = fucina.load(model, n_ctx=256, lora=adapter)
    merged = os.path.join(out, "merged.gguf")
    export_merged(model, fucina.load(model).model, [(read_adapter(adapter), 1.0)], merged, "keep")
    rows = [json.loads(line) for line in open(os.path.join(out, "test.jsonl"))][:n]
    agree = dict(lora=0, merged=0)
    for r in rows:
        prompt = llm.template.render(r["messages"][:1], add_generation_prompt=True)
        ours = llm.chat(max_tokens=32).send(r["messages"][0]["content"]).strip()
        for key, extra in (("lora", ["-m", model, "--lora", adapter]), ("merged", ["-m", merged])):
            cp = subprocess.run([os.path.join(bin_dir, "llama-completion"), *extra, "-p", prompt, "-n", "24",
                                 "--temp", "0", "-no-cnv", "-t", "1", "--no-warmup"], capture_output=True,
                                text=True, env=dict(os.environ, LD_LIBRARY_PATH=bin_dir), timeout=300)
            text = cp.stdout.split("assistant\n")[-1].split("<|im_end|>")[0]
            text = text.replace("[end of text]", "").strip()
            agree[key] += text == ours == r["messages"][1]["content"]
    return dict(n=len(rows), **agree)


def _sub(args: list[str]) -> dict:
    env = dict(os.environ)
    r = subprocess.run([sys.executable, __file__] + args, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"{args[0]} failed")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("all", "data", "train", "eval", "speed", "llamacpp"))
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default="/tmp/fucina-ft-bench")
    ap.add_argument("--mode", default="quant", choices=("quant", "quant-full", "quant-keep", "quant-nockpt", "dense"),
                    help="quant: the default checkpointing (auto); -full: recompute every layer; "
                         "-keep: keep-matmul; -nockpt: none")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--peer-steps", type=int, default=8, help="steps timed for the dense peer")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adapter")
    ap.add_argument("--targets", default="all")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2, help="rounds of paired speed runs")
    a = ap.parse_args()
    if a.cmd == "data":
        cmd_data(a.out)
    elif a.cmd == "train":
        print(json.dumps(cmd_train(a.model, a.out, a.mode, a.steps, a.threads, a.lr, a.targets, a.rank)))
    elif a.cmd == "llamacpp":
        print(json.dumps(cmd_llamacpp(a.model, a.out, a.adapter)))
    elif a.cmd == "eval":
        print(json.dumps(cmd_eval(a.model, a.out, a.adapter, a.threads)))
    else:
        cmd_data(a.out)
        common = ["--model", a.model, "--out", a.out, "--threads", str(a.threads)]
        tcfg = ["--targets", a.targets, "--rank", str(a.rank), "--lr", str(a.lr)]
        res = dict(config=dict(targets=a.targets, rank=a.rank, lr=a.lr, steps=a.steps, threads=a.threads))
        # paired speed runs (A B C D A B C D ..., the same first steps each)
        for rep in range(a.reps):
            for mode in ("dense", "quant-keep", "quant-full", "quant-nockpt"):
                r = _sub(["train", "--mode", mode, "--steps", str(a.peer_steps)] + tcfg + common)
                res.setdefault("speed", []).append({k: v for k, v in r.items() if k != "adapter"})
                print(mode, {k: v for k, v in r.items() if k != "losses"}, file=sys.stderr)
        if a.cmd == "speed":
            with open(os.path.join(a.out, "speed.json"), "w") as fh:
                json.dump(res, fh, indent=1)
            return
        res["base"] = _sub(["eval"] + common)
        print("base", res["base"], file=sys.stderr)
        res["quant"] = _sub(["train", "--mode", "quant", "--steps", str(a.steps)] + tcfg + common)
        print("quant", {k: v for k, v in res["quant"].items() if k != "losses"}, file=sys.stderr)
        res["tuned"] = _sub(["eval", "--adapter", res["quant"]["adapter"]] + common)
        print("tuned", res["tuned"], file=sys.stderr)
        with open(os.path.join(a.out, "results.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        print(json.dumps(res))


if __name__ == "__main__":
    main()
