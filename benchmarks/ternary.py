"""Ternary formats: kernel timings against Q4_K, and how close TQ files are to the exact model.

    python benchmarks/ternary.py kernels [--isa avx512 --isa avx2]   # per-call time, TQ2_0 / TQ1_0 / Q4_K
    python benchmarks/ternary.py kl MODEL.gguf [--tokens 64]          # mean KL to the exact model, ours and llama.cpp's

`kernels`: the Qwen3-0.6B ffn shape (3072 x 1024) at m = 1 (decode), 4 (a verify pass) and
128 (prefill), one thread, the three formats alternated A B C A B C in one process, process
CPU time per call, median of --rounds. `kl`: teacher-forced logits over --tokens ids of a
fixed text from fucina (native kernels), from llama.cpp (llama-logits, $FUCINA_LLAMA_CPP)
and from the exact model (the same file on fucina's reference path: every weight widened
to f32, f32 arithmetic); mean over positions of KL(exact || each). Speed figures on a
shared box are loaded: quote the ratios.
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


def kernels(args) -> None:
    K.set_threads(1)
    n, k = 3072, 1024
    rng = np.random.default_rng(0)
    raws = {qt: rand_raw(qt, n, k, rng) for qt in FORMATS}
    for isa in args.isa or K.supported_isas():
        if isa not in K.supported_isas():
            continue
        K.set_isa(isa)
        for m in (1, 4, 128):
            x = torch.randn(m, k)
            reps = max(1, 64 // m)
            times = {qt: [] for qt in FORMATS}
            for _ in range(args.rounds):
                for qt in FORMATS:
                    K.matmul(raws[qt], qt, n, k, x)
                    t = time.process_time()
                    for _ in range(reps):
                        K.matmul(raws[qt], qt, n, k, x)
                    times[qt].append((time.process_time() - t) / reps)
            med = {qt: statistics.median(v) * 1e6 for qt, v in times.items()}
            q4 = med[T.Q4_K]
            print(f"{isa:8s} m={m:<4d} " + "  ".join(f"{qt.name} {med[qt]:8.1f} us ({q4 / med[qt]:.2f}x Q4_K)"
                                                    for qt in FORMATS), flush=True)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("kernels")
    s.add_argument("--isa", action="append")
    s.add_argument("--rounds", type=int, default=9)
    s = sub.add_parser("kl")
    s.add_argument("model")
    s.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    {"kernels": kernels, "kl": kl}[a.cmd](a)


if __name__ == "__main__":
    main()
