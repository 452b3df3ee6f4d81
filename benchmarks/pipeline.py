"""Pipeline stages on loopback: what the hop between stages costs per token, and each
rank's resident memory against its share of the file.

    python benchmarks/pipeline.py MODEL.gguf [MODEL2.gguf ...] --stages 2,3 --rounds 3

Each configuration is one `fucina bench --json` run: one process, or `torchrun
--nproc-per-node N ... --pipeline` with one thread per rank; the one-process run also uses
one thread, so the difference per token is the pipeline's (the stages of one stream run
one after the other: a pipeline buys capacity, not single-stream speed). Configurations
alternate round by round (A B C A B C ...) so a shared machine's drift hits them alike;
medians are printed. Each rank's peak resident memory is read from /proc while it runs
(VmHWM) and printed again less the runtime's own memory (the one process's peak less the
file's size: interpreter, torch, caches), beside the bytes of the layers it holds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _peak_rss(pids: list[int], peaks: dict) -> None:
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                status = f.read()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"fucina" not in cmd or b"torch.distributed.run" in cmd:
            continue
        env_rank = "0"
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            env_rank = env.get(b"RANK", b"0").decode()
        except OSError:
            pass
        for line in status.splitlines():
            if line.startswith("VmHWM:"):     # peak resident set
                peaks[("VmHWM", env_rank)] = max(peaks.get(("VmHWM", env_rank), 0), int(line.split()[1]))


def run(model: str, stages: int, a) -> dict:
    bench = ["-m", "fucina", "bench", model, "--pp", str(a.pp), "--tg", str(a.tg), "--reps", str(a.reps),
             "--threads", "1", "--json"]
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}"]
                              + bench + ["--pipeline"] if stages > 1 else bench)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peaks: dict[str, int] = {}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = threading.Event()

    def watch():
        while not done.is_set():
            _peak_rss([p.pid] + _children(p.pid), peaks)
            time.sleep(0.1)
    w = threading.Thread(target=watch, daemon=True)
    w.start()
    out, err = p.communicate(timeout=a.timeout)
    done.set()
    w.join()
    if p.returncode:
        return dict(stages=stages, rc=p.returncode, stderr=err[-600:])
    res = json.loads(out.strip().splitlines()[-1])
    return dict(res, stages=stages, rc=0,
                rss_mb={r: kb / 1024 for (k, r), kb in sorted(peaks.items()) if k == "VmHWM"})


def shares(model: str, stages: int) -> list[float]:
    """MB of the layers (and the head on the last rank) each rank holds under the default split."""
    from fucina.gguf import GGUFFile
    from fucina.models.pipeline import layer_bytes, plan_split
    from fucina.models.registry import check
    f = GGUFFile(model)
    c = check(f).config
    sizes = layer_bytes(f, c.n_layer)
    head = f.tensors.get("output.weight") or f.tensors.get("token_embd.weight")
    ranges = plan_split(sizes, stages, head_bytes=head.data.nbytes)
    out = [sum(sizes[lo:hi]) / 2 ** 20 for lo, hi in ranges]
    out[-1] += head.data.nbytes / 2 ** 20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--stages", default="2,3", help="stage counts to compare with one process")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    counts = [1] + [int(s) for s in a.stages.split(",")]
    for model in a.models:
        runs: dict[int, list[dict]] = {n: [] for n in counts}
        for _ in range(a.rounds):
            for n in counts:
                r = run(model, n, a)
                if r["rc"]:
                    sys.exit(f"{n} stages failed: {r.get('stderr')}")
                runs[n].append(r)
        print(f"\n{os.path.basename(model)}: pp{a.pp} / tg{a.tg}, one thread per rank, "
              f"medians of {a.rounds} rounds")
        print("| stages | prefill tok/s | decode tok/s | decode ms/token | hop ms/token (decode) | "
              "prefill ms/token | peak RSS per rank (MB) | RSS above the runtime per rank (MB) | "
              "layers + head per rank (MB) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        base_tg = statistics.median(1000 / r["decode_tok_s"] for r in runs[1])
        for n in counts:
            pp = statistics.median(r["prefill_tok_s"] for r in runs[n])
            tg = statistics.median(r["decode_tok_s"] for r in runs[n])
            ms = statistics.median(1000 / r["decode_tok_s"] for r in runs[n])
            rss = {k: statistics.median(r["rss_mb"].get(k, 0) for r in runs[n]) for k in runs[n][0]["rss_mb"]}
            # the runtime's own memory (interpreter, torch, caches): the one process's peak less the file
            runtime = statistics.median(r["rss_mb"]["0"] for r in runs[1]) - os.path.getsize(model) / 2 ** 20
            mapped = {k: v - runtime for k, v in rss.items()}
            share = f"{os.path.getsize(model) / 2 ** 20:.0f} (file)" if n == 1 else \
                ", ".join(f"{s:.0f}" for s in shares(model, n))
            print(f"| {n} | {pp:.1f} | {tg:.1f} | {ms:.2f} | {ms - base_tg:+.2f} | {1000 / pp:.2f} | "
                  f"{', '.join(f'{v:.0f}' for _, v in sorted(rss.items()))} | "
                  f"{', '.join(f'{v:.0f}' for _, v in sorted(mapped.items()))} | {share} |")


if __name__ == "__main__":
    main()
