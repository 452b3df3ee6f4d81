"""Bounded load test of an OpenAI-compatible server on loopback.

    python benchmarks/serve_load.py --server fucina --clients 32 --duration 60 --runs 2
    python benchmarks/serve_load.py --server llama --clients 32 --duration 60 --runs 2
    python benchmarks/serve_load.py --server both --clients 32 --duration 60 --runs 2 --slots 32

Starts the server itself (fucina: `python -m fucina serve`; llama: the reference
`llama-server`, laid out runnable as tests/oracle.py does) on 127.0.0.1 only, then
N clients each send streaming chat completions back to back until the deadline
(requests in flight then are finished and counted). Per run: requests/s, p50/p99
time to first token (first content delta), aggregate completion tokens/s, refusals
(429/503), errors, the server's resident memory after the run, and for fucina the
slot state from /health (no busy slot may remain). One JSON object per run on
stdout. Loopback only: the URL is always 127.0.0.1.

`--profile` (fucina only) runs the server under a sampling profiler (every 2 ms, each
thread's stack is classified: model pass, lm head, sampling, detokenize, engine Python,
template, tokenize, SSE/JSON, HTTP, idle) and prints the split as one more JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TOPICS = ["the sea", "mountains", "a city at night", "coffee", "rain", "a library", "trains", "winter",
          "gardens", "the moon", "bread", "rivers", "music", "bicycles", "clocks", "the desert"]


def llama_dir() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    shared = next((d for d in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if d.is_dir()), ROOT.parent)
    os.environ.setdefault("FUCINA_LLAMA_CPP", str(shared / "reference" / "bin"))
    from oracle import oracle_dir

    d = oracle_dir()
    if d is None or not (d / "llama-server").exists():
        raise SystemExit("llama-server not found (set FUCINA_LLAMA_CPP to the reference bin/)")
    return d


def start(args) -> subprocess.Popen:
    model = args.model
    if model is None:
        from fucina.models import resolve_model
        model = str(resolve_model(None))
    log = open(Path(tempfile.gettempdir()) / f"serve_load_{args.server}.log", "w")
    if args.server == "fucina":
        boot = ["-m", "fucina"] if not args.profile else [str(Path(__file__).resolve()), "--_profiled",
                                                           args.profile]
        cmd = [sys.executable, *boot, "serve", model, "--host", HOST, "--port", str(args.port),
               "--ctx", str(args.ctx), "--slots", str(args.slots),
               *(["--batch", str(args.batch)] if args.batch else []),
               *(["--chunk", str(args.chunk)] if args.chunk else []), "--threads", str(args.threads),
               "--queue", str(args.queue), "--log-level", "warning"]
        env = dict(os.environ)
    else:
        d = llama_dir()
        cmd = [str(d / "llama-server"), "-m", model, "--host", HOST, "--port", str(args.port),
               "-c", str(args.ctx * args.slots), "-np", str(args.slots), "-t", str(args.threads),
               "-tb", str(args.threads), "--no-webui", "--log-disable"]
        env = dict(os.environ, LD_LIBRARY_PATH=str(d))
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://{HOST}:{args.port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"server exited ({p.returncode}); see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.kill()
    raise SystemExit("server did not become healthy")


# -- the sampling profiler (runs inside the server process) ---------------------------------

# (category, substrings of "file:function" any frame of the stack may match), first match wins
CATEGORIES = [
    ("sse_json", ("json/encoder", "json/__init__.py:dumps", "openai.py:sse", "anthropic.py:sse")),
    ("template", ("chat_template", "jinja2")),
    ("tokenize", ("tokenizer/core.py:encode", "tokenizer/bpe", "pretokenize")),
    ("detokenize", ("generate.py:push", "generate.py:feed", "token_to_piece", "StopScanner")),
    ("sampling", ("sampler.py", "logit_processor")),
    ("lm_head", (":head",)),
    ("model_pass", ("run_batch", "plan.py:run", "kernels/__init__.py:run", "forward_step", ":block",
                    "forward_ragged")),
    ("engine_python", ("serve/engine.py", "text/batch.py", "generate.py")),
    ("http", ("uvicorn", "starlette", "h11", "httptools", "serve/turn.py", "serve/app.py", "openai.py",
              "parsing.py", "asyncio")),
]
IDLE = ("selectors.py:select", "threading.py:wait", "queue.py:get", "base_events.py:_run_once")


def classify(frame) -> str:
    names = []
    while frame is not None:
        co = frame.f_code
        names.append(f"{co.co_filename}:{co.co_name}")
        frame = frame.f_back
    if names and any(k in names[0] for k in IDLE):
        return "idle"
    for cat, keys in CATEGORIES:
        if any(k in n for n in names for k in keys):
            return cat
    return "other"


def profiled_server(out: str, argv: list[str]) -> int:
    """Run `fucina <argv>` while a thread samples every thread's stack each 2 ms;
    on exit write {thread name: {category: samples}} to `out`."""
    import collections
    import threading

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    stop = threading.Event()

    def sample():
        me = threading.get_ident()
        while not stop.wait(0.002):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    counts[names.get(ident, "?")][classify(frame)] += 1

    threading.Thread(target=sample, daemon=True).start()
    from fucina.cli.main import main as fucina_main
    try:
        return fucina_main(argv)
    finally:
        stop.set()
        Path(out).write_text(json.dumps({k: dict(v) for k, v in counts.items()}))


def profile_split(path: str) -> dict:
    raw = json.loads(Path(path).read_text())
    split = {}
    for thread, c in raw.items():
        total = sum(c.values())
        if total:
            split[thread] = {k: round(v / total, 3) for k, v in sorted(c.items(), key=lambda kv: -kv[1])}
    return split


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def client(i: int, url: str, args, deadline: float, out: list) -> None:
    n = 0
    async with httpx.AsyncClient(timeout=600) as h:
        while time.monotonic() < deadline:
            topic = TOPICS[(i + n * 7) % len(TOPICS)]
            body = {"model": "m", "stream": True, "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "seed": i * 1000 + n, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"Write a few sentences about {topic}."}]}
            n += 1
            t0 = time.monotonic()
            rec = {"status": None, "ttft": None, "tokens": 0, "chunks": 0}
            try:
                async with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        await r.aread()
                        if r.status_code in (429, 503):
                            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if ev.get("usage"):
                                rec["tokens"] = ev["usage"].get("completion_tokens", 0)
                            for ch in ev.get("choices") or []:
                                if (ch.get("delta") or {}).get("content"):
                                    rec["chunks"] += 1
                                    if rec["ttft"] is None:
                                        rec["ttft"] = time.monotonic() - t0
            except httpx.HTTPError as e:
                rec["status"] = f"error: {type(e).__name__}"
            rec["latency"] = time.monotonic() - t0
            out.append(rec)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def one_run(url: str, args) -> dict:
    recs: list[dict] = []
    t0 = time.monotonic()
    await asyncio.gather(*(client(i, url, args, t0 + args.duration, recs) for i in range(args.clients)))
    wall = time.monotonic() - t0
    ok = [r for r in recs if r["status"] == 200]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] or r["chunks"] for r in ok)
    return {"requests": len(recs), "ok": len(ok),
            "refused": sum(1 for r in recs if r["status"] in (429, 503)),
            "errors": sum(1 for r in recs if r["status"] not in (200, 429, 503)),
            "error_kinds": sorted({str(r["status"]) for r in recs if r["status"] not in (200, 429, 503)}),
            "wall_s": round(wall, 1), "req_s": round(len(ok) / wall, 3),
            "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
            "ttft_p99_s": round(pct(ttft, 0.99), 3) if ttft else None,
            "latency_p50_s": round(statistics.median([r["latency"] for r in ok]), 3) if ok else None,
            "tok_s": round(tokens / wall, 1), "completion_tokens": tokens}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--_profiled":
        return profiled_server(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("fucina", "llama", "both"), default="fucina",
                    help="both: llama-server and fucina paired, one fresh server per run, order A B then B A")
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--slots", type=int, default=4, help="fucina --slots; llama-server -np (and -c ctx * slots)")
    ap.add_argument("--batch", type=int, default=None, help="fucina --batch (default: the server's)")
    ap.add_argument("--queue", type=int, default=256, help="fucina --queue")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="fucina: sample the server's threads, write the raw counts to FILE")
    ap.add_argument("--chunk", type=int, default=None, help="fucina --chunk (default: the server's)")
    args = ap.parse_args()
    servers = ["llama", "fucina"] if args.server == "both" else [args.server]
    for run in range(args.runs if args.server == "both" else 1):
        for name in servers if run % 2 == 0 else servers[::-1]:     # both: A B, then B A
            serve_runs(argparse.Namespace(**{**vars(args), "server": name}),
                       1 if args.server == "both" else args.runs, run)
    if args.profile and Path(args.profile).exists():
        print(json.dumps({"profile": profile_split(args.profile)}), flush=True)
    return 0


def serve_runs(args, runs: int, first: int) -> None:
    """Start one server, run the load `runs` times against it (one JSON line each), stop it."""
    p = start(args)
    url = f"http://{HOST}:{args.port}"
    try:
        for run in range(first, first + runs):
            rss0 = rss_mib(p.pid)
            res = asyncio.run(one_run(url, args))
            res.update(server=args.server, run=run + 1, clients=args.clients, max_tokens=args.max_tokens,
                       threads=args.threads, slots=args.slots, batch=args.batch if args.server == "fucina" else None,
                       rss_mib_before=round(rss0, 1), rss_mib=round(rss_mib(p.pid), 1),
                       load_avg=round(os.getloadavg()[0], 2))
            if args.server == "fucina":
                time.sleep(0.5)
                h = httpx.get(url + "/health", timeout=10).json()
                res["busy_slots_after"] = sum(s["busy"] for s in h["slots"])
                res["queue_after"] = h["queue"]
                res["streams"] = h["batch"]
                m = httpx.get(url + "/metrics", timeout=10).text
                res["prefix_hit_ratio"] = next((float(line.split()[-1]) for line in m.splitlines()
                                                if line.startswith("fucina_prefix_cache_hit_ratio")), None)
            print(json.dumps(res), flush=True)
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    raise SystemExit(main())
