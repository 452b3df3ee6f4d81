"""Paired per-call kernel timings on a loaded box: two sides alternate A B A B in one process,
process CPU time per call at one thread, median over rounds.

    python benchmarks/kernel_pairs.py routes                 # canonical vs legacy int8 route
    python benchmarks/kernel_pairs.py builds BASE.so NEW.so  # two builds of fucina.kernels._native
    python benchmarks/kernel_pairs.py isas --isa avx2 --isa avx2vnni  # two ISA levels, canonical route
    python benchmarks/kernel_pairs.py builds BASE.so NEW.so --cases prefill  # Qwen3 pp128 shapes
    python benchmarks/kernel_pairs.py layouts --weights Q4_K,Q5_K --rows 1,4,8  # rows vs 16-row groups

The last column is the second side's time over the first's (new / base, canon / legacy,
groups / rows).
--rows 1,5,8 times each distinct weight of the table at those m instead (the decode
GEMV's reach is 1-8 rows); --weights Q4_1,Q8_0 keeps those formats; --shapes
Q8_0:65536x640,Q4_1:49152x576 times those weights instead (fewer calls a round for big ones). `builds` loads both
extension files side by side (one shared libgomp) and checks that they return the same bits
(so do `isas` and `layouts`); `builds --groups` times both on the weights' row-group layout
(as a model load repacks them at the ISA in force). `layouts` times a format's rows against
its row groups; formats that keep their rows at that ISA are left out. --rounds (default 15), --isa (default: every
level this CPU has).
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import time

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T
from fucina.weights import LinearWeight

from kernels import rand_raw

CASES = [("Q4_K", 3072, 1024, 1), ("Q4_K", 3072, 1024, 3), ("Q4_K", 3072, 1024, 64), ("Q6_K", 1024, 3072, 1),
         ("Q6_K", 1024, 3072, 4), ("Q6_K", 1024, 3072, 64), ("Q4_1", 1536, 576, 1), ("Q4_1", 1536, 576, 64),
         ("Q8_0", 3072, 1024, 64), ("Q5_K", 1024, 3072, 64), ("IQ4_NL", 1024, 1024, 64)]
# --cases prefill: the Qwen3-0.6B Q4_K_M matmuls of a pp128 step (q | k, gate | up, o, down in
# both formats, v in Q6_K), at m = 128 and at a speculative verify's m = 8
PREFILL = [(f, n, k, m) for f, n, k in [("Q4_K", 4096, 1024), ("Q4_K", 6144, 1024), ("Q4_K", 1024, 2048),
                                        ("Q4_K", 1024, 3072), ("Q6_K", 1024, 3072), ("Q6_K", 1024, 1024)]
           for m in (8, 128)]


def load_build(path: str):
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_file_location("_native", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def paired(a, b, reps: int, rounds: int) -> tuple[float, float]:
    """median seconds per call of a() and b(), alternating which goes first"""
    ta, tb = [], []
    for r in range(rounds):
        for fn, acc in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            fn()
            t = time.process_time()
            for _ in range(reps):
                fn()
            acc.append((time.process_time() - t) / reps)
    return float(np.median(ta)), float(np.median(tb))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["routes", "builds", "isas", "layouts"])
    ap.add_argument("so", nargs="*", help="builds: BASE.so NEW.so")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--isa", action="append")
    ap.add_argument("--cases", choices=["default", "prefill"], default="default")
    ap.add_argument("--rows", help="comma-separated m for every distinct weight (default: the table's)")
    ap.add_argument("--weights", help="comma-separated formats to keep (default: all)")
    ap.add_argument("--shapes", help="comma-separated FORMAT:NxK weights instead of the table's (with --rows)")
    ap.add_argument("--groups", action="store_true", help="builds: the weights in their row-group layout")
    args = ap.parse_args()
    mods = [load_build(p) for p in args.so] if args.mode == "builds" else [K._native]
    if args.mode == "builds":   # the IQ1-IQ3 codebooks, which each module holds (K.load_iq_tables sets K's)
        from fucina.quant.tables import iq_codebook_bytes
        for mod in mods:
            if hasattr(mod, "set_iq_tables"):   # builds before the i-quants have none
                mod.set_iq_tables(iq_codebook_bytes())
    else:
        K.load_iq_tables()
    names = {"builds": ("base", "new"), "routes": ("legacy int8", "canon"), "isas": tuple(args.isa or ()),
             "layouts": ("rows", "groups")}[args.mode]
    if args.mode == "isas" and len(names) != 2:
        ap.error("isas: name two levels with --isa A --isa B")
    cases = PREFILL if args.cases == "prefill" else CASES
    if args.shapes:
        cases = [(f, *map(int, nk.split("x")), 1) for f, nk in (sh.split(":") for sh in args.shapes.split(","))]
    if args.rows:
        shapes = dict.fromkeys((f, n, k) for f, n, k, _ in cases)
        cases = [(f, n, k, int(m)) for f, n, k in shapes for m in args.rows.split(",")]
    if args.weights:
        cases = [c for c in cases if c[0] in args.weights.split(",")]
    grouped = args.mode == "layouts" or args.groups
    rng = np.random.default_rng(0)
    print(f"| isa | weight | m | {names[0]} µs | {names[1]} µs | {names[1]} / {names[0]} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for isa in ["+".join(names)] if args.mode == "isas" else args.isa or K.supported_isas():
        for mod in mods:
            mod.set_isa(names[0] if args.mode == "isas" else isa)
            mod.set_threads(1)
        if grouped:   # the level whose layouts K.interleave applies
            K.set_isa(isa)
        for f, n, k, m in cases:
            qt = T[f]
            raw, x = rand_raw(qt, n, k, rng), torch.randn(m, k)
            ys = [torch.empty(m, n), torch.empty(m, n)]
            rb = raw.numel() // n
            weights = [(int(qt), raw)] * 2
            if grouped:   # repacked as a model load repacks it at the ISA in force, or left out
                lw = LinearWeight(raw, qt, n, k, "w")
                K.attach(lw)
                if not K.interleave(lw):
                    continue
                g = (lw.kernel.qtype, lw.kernel.raw)
                weights = [(int(qt), raw), g] if args.mode == "layouts" else [g, g]

            def side(i):
                mod = mods[i] if args.mode == "builds" else mods[0]
                route = ("int8", "canon")[i] if args.mode == "routes" else "canon"
                wt, w = weights[i]

                def call():
                    if args.mode == "isas":
                        mod.set_isa(names[i])
                    mod.set_prefill(route)
                    mod.matmul(wt, w.data_ptr(), rb, n, k, x.data_ptr(), m, ys[i].data_ptr(), n)
                return call
            reps = 200 if m == 1 else (60 if m <= 8 else 6)
            if args.shapes:  # about 0.2 GB of weights read per side and round
                reps = max(2, min(reps, int(2e8 / raw.numel())))
            ta, tb = paired(side(0), side(1), reps, args.rounds)
            if args.mode != "routes":
                assert torch.equal(ys[0], ys[1]), f"{f} m={m}: the two sides' bits differ"
            print(f"| {isa} | {f} {n}x{k} | {m} | {ta * 1e6:.0f} | {tb * 1e6:.0f} | {tb / ta:.3f} |", flush=True)
    for mod in mods:
        mod.set_prefill("canon")


if __name__ == "__main__":
    main()
