"""Paired CPU-time throughput, fucina vs llama.cpp, for a loaded machine: each side runs its
bench at reps=1 and reps=R in separate processes; (R-1) * tokens / (CPU(R) - CPU(1)) cancels
load and warm-up. Threads 1 by default (no barrier spinning in the CPU time). For a box
too loaded for wall clock (vs_llamacpp.py is the figure on a quiet one).
usage: LLAMA_BENCH=<oracle copy>/llama-bench [THREADS=1] [REPS=3] [ROUNDS=2] \
       python benchmarks/cpu_pair.py MODEL.gguf [MODEL.gguf ...]   (fucina from PYTHONPATH)"""
import json, os, resource, statistics, subprocess, sys
models = [a for a in sys.argv[1:] if a.endswith(".gguf")]
T = os.environ.get("THREADS", "1"); R = int(os.environ.get("REPS", "3")); ROUNDS = int(os.environ.get("ROUNDS", "2"))
PP, TG = 128, 32
LB = os.environ["LLAMA_BENCH"]
def cpu(cmd):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, capture_output=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
def fuc(m, pp, tg, reps):
    return [sys.executable, "-m", "fucina", "bench", m, "--pp", str(pp), "--tg", str(tg), "--reps", str(reps), "--threads", T, "--json"]
def lla(m, pp, tg, reps):
    return [LB, "-m", m, "-t", T, "-p", str(pp), "-n", str(tg), "-r", str(reps), "-o", "json"]
for m in models:
    res = {k: [] for k in ("f_pp", "l_pp", "f_tg", "l_tg")}
    for r in range(ROUNDS):
        for side, mk in (("f", fuc), ("l", lla)):
            for fig, pp, tg, n in (("pp", PP, 0, PP), ("tg", 0, TG, TG)):
                c1, cR = cpu(mk(m, pp, tg, 1)), cpu(mk(m, pp, tg, R))
                res[f"{side}_{fig}"].append((R - 1) * n / max(cR - c1, 1e-6))
        print(m.split("/")[-1], "round", r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(m.split("/")[-1], "MEDIAN tok/CPU-s", {k: round(v, 1) for k, v in med.items()},
          "ratio pp %.2f tg %.2f" % (med["f_pp"] / med["l_pp"], med["f_tg"] / med["l_tg"]), flush=True)
