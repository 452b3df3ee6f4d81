"""MoE expert streaming (issue 15): tok/s and peak RSS at expert budgets, a run under a
memory cgroup below the file's size, and the logits bitwise against the resident run.

    PYTHONPATH=src python benchmarks/moe_stream.py qwen3moe-a0.3b-Q4_K_M.gguf \
        --budgets none,100%,50%,25% --rounds 3 --pp 128 --tg 32 --cgroup-mb 800

Each configuration is one `fucina bench --json` process (its own peak RSS), the budgets
interleaved round by round (A B C A B C ...) so the shared machine's drift hits them alike;
medians are printed, with each process's CPU seconds (user + sys: load, warm-up and reps),
which a loaded machine disturbs less than tok/s. --cgroup-mb runs the 25% budget and the resident model inside a cgroup v1
memory child limited to that many MiB (root and a writable /sys/fs/cgroup/memory needed),
the file's unmapped page cache dropped first so its reads are charged to that cgroup.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CGROUP = "/sys/fs/cgroup/memory"


def bench(model: str, budget: str, a, cgroup: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "fucina", "bench", model, "--pp", str(a.pp), "--tg", str(a.tg),
           "--reps", str(a.reps), "--threads", str(a.threads), "--json"]
    if budget != "none":
        cmd += ["--moe-ram", budget]
    if cgroup:   # join the cgroup before exec: the whole run is charged to it
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] + cmd
    t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return dict(budget=budget, rc="timeout", wall_s=time.perf_counter() - t)
    if p.returncode:
        return dict(budget=budget, rc=p.returncode, wall_s=time.perf_counter() - t, stderr=p.stderr[-400:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)   # CPU seconds: steadier than tok/s on a loaded box
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return dict(out, budget=budget, rc=0, wall_s=time.perf_counter() - t, cpu_s=cpu,
                sys_s=after.ru_stime - before.ru_stime)


def bitwise(model: str, budget: str, n: int = 48) -> bool:
    """Teacher-forced logits of n tokens (a prefill chunk, then one at a time): resident == streamed."""
    import torch

    from fucina.models import load_model
    from fucina.models.expert_store import stream_experts

    ids = [(7 * i * i + 3 * i + 5) % 5000 + 1 for i in range(n)]

    def run(m):
        cache = m.init_cache(n + 1)
        out = [m.forward_step_all_logits(cache, ids[:n // 2], 0)]
        out += [m.forward_step_all_logits(cache, ids[p:p + 1], p) for p in range(n // 2, n)]
        return torch.cat(out)

    want = run(load_model(model))
    m = load_model(model)
    stream_experts(m, budget)
    return torch.equal(run(m), want)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--budgets", default="none,100%,50%,25%")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cgroup-mb", type=int, default=0)
    p.add_argument("--skip-bitwise", action="store_true")
    p.add_argument("--timeout", type=float, default=900, help="seconds per bench process")
    a = p.parse_args()
    size = os.path.getsize(a.model)
    print(f"# {os.path.basename(a.model)}: {size / 2**20:.0f} MiB file")
    if not a.skip_bitwise:
        print(f"# logits bitwise equal to resident at 25%: {bitwise(a.model, '25%')}", flush=True)
    budgets = a.budgets.split(",")
    runs: dict[str, list[dict]] = {b: [] for b in budgets}
    for r in range(a.rounds):
        for b in budgets:
            res = bench(a.model, b, a)
            runs[b].append(res)
            print(json.dumps(res), file=sys.stderr, flush=True)
    print("| expert budget | slots (MiB) | prefill tok/s | decode tok/s | CPU s (sys) | peak RSS MiB | expert reads MiB "
          "| hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for b, rs in runs.items():
        ok = [x for x in rs if x["rc"] == 0]
        if not ok:
            print(f"| {b} | failed rc={rs[0]['rc']} | | | | | | |")
            continue
        med = lambda k: statistics.median(x[k] for x in ok)   # noqa: E731
        st = ok[-1].get("moe_store")
        slots = f"{st['budget'] / 2**20:.0f}" if st else "-"
        reads = f"{statistics.median(x['moe_store']['read_bytes'] for x in ok) / 2**20:.0f}" if st else "-"
        hit = f"{st['hits'] / max(1, st['hits'] + st['misses']):.2f}" if st else "-"
        print(f"| {b if b != 'none' else 'resident (no store)'} | {slots} | {med('prefill_tok_s'):.1f} | "
              f"{med('decode_tok_s'):.2f} | {med('cpu_s'):.1f} ({med('sys_s'):.1f}) | {med('peak_rss_mb'):.0f} | {reads} "
              f"| {hit} |")
    if a.cgroup_mb:
        cg = os.path.join(CGROUP, f"fucina_moe_{os.getpid()}")
        os.mkdir(cg)
        try:
            with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as fh:
                fh.write(str(a.cgroup_mb << 20))
            for b in ("25%", "none"):
                with open(os.path.join(cg, "memory.max_usage_in_bytes"), "w") as fh:
                    fh.write("0")
                # drop the file's unmapped page cache, so this run's reads are charged to the cgroup
                fd = os.open(a.model, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                res = bench(a.model, b, a, cgroup=cg)
                with open(os.path.join(cg, "memory.max_usage_in_bytes")) as fh:
                    peak = int(fh.read()) / 2**20
                with open(os.path.join(cg, "memory.failcnt")) as fh:
                    fails = fh.read().strip()
                print(f"# cgroup memory.limit_in_bytes {a.cgroup_mb} MiB < file {size / 2**20:.0f} MiB "
                      f"(page cache of the file dropped first), budget {b}: rc {res['rc']}, prefill {res.get('prefill_tok_s', 0):.1f} tok/s, decode "
                      f"{res.get('decode_tok_s', 0):.2f} tok/s, peak RSS {res.get('peak_rss_mb', 0):.0f} MiB, "
                      f"cgroup peak (RSS + page cache) {peak:.0f} MiB, limit hits {fails}, wall {res['wall_s']:.0f} s")
        finally:
            os.rmdir(cg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
