"""Where a cold `fucina run --prompt Hi --gen 16` spends its time, phase by phase.

    python benchmarks/startup.py [MODEL] [--runs 7] [--threads 1] [--api]

Each run is a fresh interpreter (imports are the point) that times, in order, under the
tree's CLI start-up GC pause when it has one (`fucina.cli.main.resume_gc` ends it): `import
torch`; fucina's own imports on top of it (what `fucina run` imports); the GGUF parse
and model build (`load_model`); the tokenizer build; the prompt and 16 greedy tokens.
Prints the median and range of each phase in wall and CPU seconds (CPU is the figure
to read on a shared machine). Interpreter start-up and exit are outside the phases:
time the whole process (`/usr/bin/time`, any A/B timer) for the goal itself. `--src`
points the child at another tree's `src` (A/B against a checkout of main).

`--api` times the Python API instead: `import fucina` + `fucina.load()`; the first
streamed piece of a greedy reply to "Hi" (a lazy load builds the decoder here: torch is
imported on the first compute); the other 15 tokens. Threads come from OMP_NUM_THREADS
(setting them through fucina.kernels would import torch before the load).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
import gc
from fucina.cli import main as cli
if hasattr(cli, "pause_gc"):       # the tree's CLI start-up GC pause, as main() holds it
    cli.pause_gc()
elif hasattr(cli, "resume_gc"):    # older trees kept the pause's state in main
    cli._gc_was_enabled = gc.isenabled()
    gc.disable()
marks = [clock()]
import torch
marks.append(clock())
import fucina.kernels as kernels
from fucina.cli import chat, finetune, grammar_args, main, progress
from fucina.models import load_model, resolve_model
from fucina.text.api import LLM, one_thread
from fucina.text.tokenizer import Tokenizer
marks.append(clock())
kernels.set_threads(int(sys.argv[2]))
with one_thread():
    model = load_model(resolve_model(sys.argv[1]))
marks.append(clock())
tok = Tokenizer.from_metadata(model.gguf.metadata)
marks.append(clock())
getattr(cli, "resume_gc", lambda: None)()
llm = LLM(model, tok, n_ctx=32)
out = "".join(llm.stream(tok.encode("Hi"), 16, temperature=0))
marks.append(clock())
print(json.dumps([[b[0] - a[0], b[1] - a[1]] for a, b in zip(marks, marks[1:])]))
"""
PHASES = ("import torch", "fucina imports", "load_model", "tokenizer", "prompt + 16 tokens")

API_CHILD = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
marks = [clock()]
import fucina
llm = fucina.load(sys.argv[1])
marks.append(clock())
pieces = llm.stream("Hi", 16, temperature=0)
next(pieces)
marks.append(clock())
rest = "".join(pieces)
marks.append(clock())
print(json.dumps([[b[0] - a[0], b[1] - a[1]] for a, b in zip(marks, marks[1:])]))
"""
API_PHASES = ("import fucina + load()", "first piece (build + prefill)", "15 more tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--api", action="store_true", help="time fucina.load() and the first token instead")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    args = ap.parse_args()
    src = args.src
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child, phases = (API_CHILD, API_PHASES) if args.api else (CHILD, PHASES)
    if args.api:
        env["OMP_NUM_THREADS"] = str(args.threads)
    rows = []
    for _ in range(args.runs + 1):                      # the first run warms the page cache
        r = subprocess.run([sys.executable, "-c", child, args.model, str(args.threads)],
                           capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    rows = rows[1:]
    print("| phase | wall s median (min-max) | cpu s median |\n| --- | --- | --- |")
    for i, name in enumerate(phases + ("total",)):
        wall = [sum(p[0] for p in r) if i == len(phases) else r[i][0] for r in rows]
        cpu = [sum(p[1] for p in r) if i == len(phases) else r[i][1] for r in rows]
        print(f"| {name} | {statistics.median(wall):.3f} ({min(wall):.3f}-{max(wall):.3f}) | "
              f"{statistics.median(cpu):.3f} |")


if __name__ == "__main__":
    main()
