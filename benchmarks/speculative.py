"""Speculative vs plain decoding, paired in one run (A B A B), on five chat workloads.

    python benchmarks/speculative.py [MODEL.gguf ...] [--reps 2] [--max-tokens 160] [--threads 2]
                                     [--json OUT] [--exact] [--costs] [--ragged-costs] [--llama-server DIR]
                                     [--serve 1,4] [--priced]

Workloads: verbatim copy of a given text, an edit of a given function, a grounded answer
about a given document, a multi-turn chat whose last turn quotes the first, a free-form
story, and a JSON-schema-constrained answer about the document (grammar-aware drafting).
Greedy decoding. For each: decode tokens/s (first streamed piece to the end, so
the identical prefill is left out; on one thread in process CPU time) plain and
speculative, their ratio (median over reps), draft acceptance, tokens per forward pass, and whether the two token streams
were identical. `--exact` verifies row by row (bitwise single steps on any kernels: the
streams must be identical; no speedup expected). `--costs` prints the measured cost of a
verify pass of 1 + k rows in plain steps (the CostGate's table); `--ragged-costs` that of
a server-style ragged pass by rows per cache. `--serve 1,4` measures
the server instead (the engine and its worker thread in process, no HTTP): aggregate
completion tokens/s with 1 and with 4 requests at once, plain against `--spec` (the
speculative streams' verify rows riding the ragged batch pass). `--priced` measures the
verify cost table first, then runs each workload once with the gate deciding on that
table and prices every pass by it: the speedup those decisions give on these kernels,
reproducible on a shared box whose clock swings +-10% between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import fucina
from fucina import kernels
from fucina.text.speculative import CostGate, Speculation, Stats, table_cost

PASSAGE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
           "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
           "was the season of Light, it was the season of Darkness, it was the spring of hope, it was "
           "the winter of despair, we had everything before us, we had nothing before us, we were all "
           "going direct to Heaven, we were all going direct the other way.")

CODE = '''def mean(values):
    """Return the arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean() needs at least one value")
    total = 0.0
    for v in values:
        total += v
    return total / len(values)'''

DOC = ("The KV cache stores the keys and values of every position so that each new token only "
       "attends to what is already there. The --cache-type flag chooses how it is stored: f16 keeps "
       "two bytes per value and is the default, while q8_0 stores blocks of 32 values as 8-bit "
       "integers with one scale, which halves the memory the cache needs. The cache is allocated "
       "once for the whole context, and a rewind only moves its length back.")

POEM = ("The fog comes\non little cat feet.\nIt sits looking\nover harbor and city\n"
        "on silent haunches\nand then moves on.")

WORKLOADS = {
    "copy": ["Repeat the following text exactly, word for word, and nothing else:\n\n" + PASSAGE],
    "edit": ["Here is a Python function:\n\n```python\n" + CODE + "\n```\n\nRename the variable `total` "
             "to `acc`. Reply with the whole function in a code block, otherwise unchanged."],
    "summary": [DOC + "\n\nUsing only the text above, explain what the --cache-type flag does and which "
                "values it takes. Quote the relevant sentences."],
    "multiturn": ["Here is a short poem:\n\n" + POEM + "\n\nPlease remember it.",
                  "Now quote the poem back to me exactly, line by line."],
    "story": ["Write a short story about a lighthouse keeper who befriends a seagull."],
    "json": [DOC + "\n\nDescribe the --cache-type flag as JSON: its name, its values, the default "
             "and one sentence quoted from the text."],
}
# a workload's constraint (grammar-aware drafting: forced spans, drafts cut by the grammar)
CACHE_FLAG_SCHEMA = {"type": "object", "properties": {
    "flag": {"type": "string", "maxLength": 24},
    "values": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "default": {"type": "string", "maxLength": 12}, "quote": {"type": "string", "maxLength": 240}},
    "required": ["flag", "values", "default", "quote"], "additionalProperties": False}
OPTIONS = {"json": {"json_schema": CACHE_FLAG_SCHEMA}}


def decode_clock():
    """Wall clock; on one thread the process's CPU time (a shared box's waits for a core
    are left out, so paired ratios survive a loaded machine)."""
    return time.process_time if kernels.get_threads() == 1 else time.perf_counter


def one_run(llm, turns, spec: bool, max_tokens: int, options=None, priced=None):
    """One chat through `turns`, the last one timed. `priced` (a measured cost table):
    the gate decides on that table, untimed, and the reply's passes are priced by it."""
    clock = decode_clock()
    conv = llm.chat(speculative=spec, max_tokens=max_tokens, temperature=0,   # greedy: comparable streams
                    **(options or {}))
    if spec and priced is not None:
        dec = conv.spec.decoder
        dec.gate = CostGate(max_draft=dec.max_draft, min_draft=dec.min_draft, cost_table=priced, timed=False)
    for t in turns[:-1]:
        conv.send(t)
    before = {k: v for k, v in conv.spec.stats.__dict__.items() if isinstance(v, int)} if spec else None
    before_passes = dict(conv.spec.stats.by_draft) if spec else None
    first = []
    t0 = clock()
    conv.send(turns[-1], on_piece=lambda p: first or first.append(clock()))
    t1 = clock()
    n = len(conv.last.tokens)
    row = {"tokens": n, "total_s": t1 - t0,
           "decode_tok_s": (n - 1) / (t1 - first[0]) if first and n > 1 and t1 > first[0] else 0.0,
           "ids": list(conv.last.tokens)}
    if spec:
        st = conv.spec.stats
        d = {k: getattr(st, k) - v for k, v in before.items()}
        row.update(acceptance=d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
                   tokens_per_step=d["committed"] / d["steps"] if d["steps"] else 0.0,
                   drafted=d["drafted"], accepted=d["accepted"], verify_steps=d["spec_steps"])
        if priced is not None:    # this reply's passes priced by the measured table
            turn = Stats(steps=d["steps"], spec_steps=d["spec_steps"], committed=d["committed"],
                         by_draft={k: n - before_passes.get(k, 0) for k, n in st.by_draft.items()})
            row["priced_speedup"] = turn.priced_speedup(lambda k: table_cost(priced, k))
    return row


def bench_model(path: str, reps: int, max_tokens: int, names, priced: bool = False) -> list[dict]:
    llm = fucina.load(path)
    one_run(llm, ["Hello!"], True, 8)        # warm-up: both paths' first calls
    if priced:
        return priced_model(llm, path, max_tokens, names)
    out = []
    for name in names:
        runs = {False: [], True: []}
        for _ in range(reps):
            for spec in (False, True):       # A B A B
                runs[spec].append(one_run(llm, WORKLOADS[name], spec, max_tokens, OPTIONS.get(name)))
        p, s = runs[False], runs[True]
        ratio = statistics.median(b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(p, s)
                                  if a["decode_tok_s"])
        out.append({
            "model": os.path.basename(path), "workload": name, "tokens": s[-1]["tokens"],
            "plain_tok_s": statistics.median(r["decode_tok_s"] for r in p),
            "spec_tok_s": statistics.median(r["decode_tok_s"] for r in s),
            "speedup": ratio, "acceptance": s[-1]["acceptance"],
            "tokens_per_step": s[-1]["tokens_per_step"], "verify_steps": s[-1]["verify_steps"],
            "identical": all(a["ids"] == b["ids"] for a, b in zip(p, s)),
        })
        r = out[-1]
        print(f"{r['model']:<36} {name:<10} {r['tokens']:>4} tok  plain {r['plain_tok_s']:6.1f}  "
              f"spec {r['spec_tok_s']:6.1f} tok/s  x{r['speedup']:.2f}  accept {r['acceptance']:.0%}  "
              f"{r['tokens_per_step']:.2f} tok/step  identical {r['identical']}", flush=True)
    return out


def priced_model(llm, path: str, max_tokens: int, names) -> list[dict]:
    """Each workload once, speculative, its verify passes priced by this model's cost
    table measured first in the same process (`costs`): a speedup free of the box's
    noise, for comparing gate and drafting decisions (it leaves out the per-token
    bookkeeping, ~1% of a SmolLM2 step)."""
    measured = costs(path, llm=llm)
    table, top = [(0, 1.0)], 1.0
    for k, c in sorted(measured.items()):   # more rows never cost less: a loaded box's
        top = max(top, c)                    # clock can say so, the kernels cannot
        table.append((k, top))
    out = []
    for name in names:
        r = one_run(llm, WORKLOADS[name], True, max_tokens, OPTIONS.get(name), priced=table)
        out.append({"model": os.path.basename(path), "workload": name, "tokens": r["tokens"],
                    "priced_speedup": r["priced_speedup"], "acceptance": r["acceptance"],
                    "tokens_per_step": r["tokens_per_step"], "cost_table": measured})
        print(f"{out[-1]['model']:<36} {name:<10} {r['tokens']:>4} tok  priced x{r['priced_speedup']:.3f}  "
              f"accept {r['acceptance']:.0%}  {r['tokens_per_step']:.2f} tok/step", flush=True)
    return out


def costs(path: str, ks=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16), reps: int = 9, llm=None) -> dict:
    """Median time of a verify pass of 1 + k rows over a plain step, paired per rep. On one
    thread the clock is the process's CPU time (a shared box's waits for a core left out)."""
    clock = time.process_time if kernels.get_threads() == 1 else time.perf_counter
    m = (llm or fucina.load(path)).model
    cache = m.init_cache(1024)
    m.forward_step(cache, list(range(100, 400)), 0)
    base = cache.len
    ratios = {k: [] for k in ks}
    for _ in range(reps):
        for k in ks:
            t = clock()
            m.forward_step(cache, [5], base)
            plain = clock() - t
            cache.truncate(base)
            t = clock()
            m.forward_step_all_logits(cache, list(range(5, 6 + k)), base)
            ratios[k].append((clock() - t) / plain)
            cache.truncate(base)
    res = {k: round(statistics.median(v), 2) for k, v in ratios.items()}
    print(os.path.basename(path), "verify cost (plain steps) by draft length:", res, flush=True)
    return res


RAGGED_SHAPES = ((1,), (4,), (5,), (8,), (1, 1), (2, 2), (4, 4), (1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 2, 2))


def ragged_costs(path: str, reps: int = 9) -> dict:
    """Median time of a server-style ragged pass (`ragged_step`, every row's logits) over a
    plain step, by rows per cache (e.g. (2, 1, 1, 1): one stream verifying a 1-token draft
    beside 3 single rows), paired per rep; process CPU time on one thread."""
    from fucina.text.batch import ragged_step

    clock = decode_clock()
    m = fucina.load(path).model
    caches = [m.init_cache(1024) for _ in range(max(len(sh) for sh in RAGGED_SHAPES))]
    for i, c in enumerate(caches):
        m.forward_step(c, list(range(100 + i, 400 + i)), 0)
    base = [c.len for c in caches]
    times: dict[tuple, list[float]] = {sh: [] for sh in RAGGED_SHAPES}
    for _ in range(reps):
        for sh in RAGGED_SHAPES:
            t = clock()
            ragged_step(m, caches[:len(sh)], [list(range(5, 5 + r)) for r in sh], [True] * len(sh),
                        [True] * len(sh))
            times[sh].append(clock() - t)
            for c, b in zip(caches, base):
                c.truncate(b)
    plain = statistics.median(times[(1,)])
    res = {"+".join(map(str, sh)): round(statistics.median(v) / plain, 2) for sh, v in times.items()}
    print(os.path.basename(path), "ragged pass cost (plain steps) by rows per cache:", res, flush=True)
    return res


def serve_once(llm, prompts, spec: bool, max_tokens: int, batch: int) -> dict:
    """All `prompts` submitted at once to an in-process engine (`--batch batch`, the
    scheduler's worker thread: the server minus HTTP), greedy; aggregate completion
    tokens over the run's time (process CPU time on one thread)."""
    from fucina.serve.engine import Engine, Finished, GenRequest, Job, Scheduler
    from fucina.text.sampler import SamplingConfig

    clock = decode_clock()
    eng = Engine(llm.model, llm.tokenizer, llm.template, n_ctx=1024, slots=batch, batch=batch, spec=spec)
    sched = Scheduler(eng)
    done, replies = threading.Semaphore(0), [None] * len(prompts)

    def sink_for(i):
        def sink(ev):
            if isinstance(ev, Finished):
                replies[i] = ev.reply
                done.release()
        return sink
    sched.start()
    t0 = clock()
    for i, ids in enumerate(prompts):
        sched.submit(Job(GenRequest(ids, max_tokens, SamplingConfig(temperature=0.0),
                                    stop_ids=eng.stop_ids), sink_for(i)))
    for _ in prompts:
        done.acquire()
    t1 = clock()
    sched.stop()
    n = sum(len(r.tokens) for r in replies)
    row = {"tokens": n, "tok_s": n / (t1 - t0), "ids": [list(r.tokens) for r in replies]}
    if spec:
        st = [s.spec.stats for s in eng.pool.slots if getattr(s, "spec", None) is not None]
        drafted, acc = sum(x.drafted for x in st), sum(x.accepted for x in st)
        row.update(acceptance=acc / drafted if drafted else 0.0,
                   tokens_per_step=sum(x.committed for x in st) / max(1, sum(x.steps for x in st)))
    return row


def bench_serve(path: str, reps: int, max_tokens: int, names, widths) -> list[dict]:
    """Server throughput, plain against --spec, paired (A B A B), with 1 and N requests
    at once: N requests cycle through the workloads (single-turn ones)."""
    from fucina.serve.prompt import render_chat

    llm = fucina.load(path)
    single = [n for n in names if len(WORKLOADS[n]) == 1 and n not in OPTIONS]

    class _E:             # render_chat reads the engine's template and tokenizer
        template, tokenizer = llm.template, llm.tokenizer
    ids = {n: render_chat(_E, [{"role": "user", "content": WORKLOADS[n][0]}]).ids for n in single}
    serve_once(llm, [ids[single[0]]], True, 8, 1)       # warm-up
    out = []
    for width in widths:
        for start in range(len(single) if width == 1 else 1):
            prompts = [ids[single[(start + j) % len(single)]] for j in range(width)]
            runs = {False: [], True: []}
            for _ in range(reps):
                for spec in (False, True):
                    runs[spec].append(serve_once(llm, prompts, spec, max_tokens, width))
            p, s = runs[False], runs[True]
            label = single[start] if width == 1 else "+".join(single[:width] if width <= len(single)
                                                                else single) + f" x{width}"
            out.append({"model": os.path.basename(path), "requests": width, "workload": label,
                        "tokens": s[-1]["tokens"],
                        "plain_tok_s": statistics.median(r["tok_s"] for r in p),
                        "spec_tok_s": statistics.median(r["tok_s"] for r in s),
                        "speedup": statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(p, s)),
                        "acceptance": s[-1]["acceptance"], "tokens_per_step": s[-1]["tokens_per_step"],
                        "identical": all(a["ids"] == b["ids"] for a, b in zip(p, s))})
            r = out[-1]
            print(f"serve {r['model']:<32} {width} req {label:<34} {r['tokens']:>4} tok  plain "
                  f"{r['plain_tok_s']:6.1f}  spec {r['spec_tok_s']:6.1f} tok/s  x{r['speedup']:.2f}  "
                  f"accept {r['acceptance']:.0%}  identical {r['identical']}", flush=True)
    return out


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def llama_server(bin_dir: str, path: str, threads: int, max_tokens: int, names,
                 types=("none", "ngram-simple", "ngram-mod")) -> list[dict]:
    """llama.cpp's own draft-free speculation on the same prompts: llama-server per
    --spec-type, greedy; decode tok/s is the server's `timings.predicted_per_second`
    (wall), and per CPU-second: the server process's CPU time over the request, times
    the decode's share of the request's wall time (comparable to our one-thread figure)."""
    import socket
    import subprocess

    import httpx

    out = []
    env = dict(os.environ, LD_LIBRARY_PATH=bin_dir)
    for kind in types:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        cmd = [os.path.join(bin_dir, "llama-server"), "-m", path, "-t", str(threads), "--port", str(port),
               "-tb", str(threads), "-c", "4096", "--spec-type", kind, "--log-disable"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            for name in names:
                msgs = []
                for turn in WORKLOADS[name]:
                    msgs.append({"role": "user", "content": turn})
                    cpu0 = proc_cpu_seconds(proc.pid)
                    body = {"messages": msgs, "temperature": 0, "max_tokens": max_tokens}
                    if "json_schema" in OPTIONS.get(name, {}):
                        body["response_format"] = {"type": "json_schema", "json_schema": {
                            "name": name, "schema": OPTIONS[name]["json_schema"]}}
                    r = httpx.post(url + "/v1/chat/completions", timeout=600, json=body).json()
                    cpu = proc_cpu_seconds(proc.pid) - cpu0
                    msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
                t = r.get("timings", {})
                drafted, acc = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
                n, pred_ms, prompt_ms = t.get("predicted_n", 0), t.get("predicted_ms", 0.0), t.get("prompt_ms", 0.0)
                # the decode's share of the request's CPU time, by its share of the wall time
                dec_cpu = cpu * pred_ms / (pred_ms + prompt_ms) if pred_ms + prompt_ms else 0.0
                out.append({"model": os.path.basename(path), "workload": name, "llama_spec": kind,
                            "tokens": n, "tok_s": t.get("predicted_per_second"),
                            "cpu_tok_s": (n - 1) / dec_cpu if dec_cpu and n > 1 else 0.0,
                            "acceptance": acc / drafted if drafted else 0.0})
                r = out[-1]
                print(f"llama.cpp {kind:<13} {r['model']:<34} {name:<10} {r['tokens']} tok "
                      f"{r['tok_s']:.1f} tok/s (per CPU-second {r['cpu_tok_s']:.1f}) "
                      f"accept {r['acceptance']:.0%}", flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    home = os.path.expanduser(os.environ.get("FUCINA_CACHE", "~/.cache/fucina"))
    ap.add_argument("models", nargs="*", default=[os.path.join(home, "SmolLM2-135M-Instruct.Q4_1.gguf"),
                                                  os.path.join(home, "gemma-3-270m-q4_k_m.gguf")])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json")
    ap.add_argument("--exact", action="store_true", help="row-by-row verify (bitwise; no speedup)")
    ap.add_argument("--costs", action="store_true", help="measure the verify cost table instead")
    ap.add_argument("--priced", action="store_true", help="instead: measure the cost table, then run each "
                    "workload once with the gate on that table and price its passes by it (a speedup "
                    "free of the clock's noise)")
    ap.add_argument("--ragged-costs", action="store_true", help="instead: the cost of a server-style "
                    "ragged pass by rows per cache (e.g. 2+1+1+1: a 1-token draft beside 3 streams)")
    ap.add_argument("--llama-server", metavar="DIR", help="instead: llama.cpp's llama-server from DIR "
                    "(runnable copy, e.g. tests/oracle.py's oracle_dir()) with --spec-type none / "
                    "ngram-simple / ngram-mod on the same prompts")
    ap.add_argument("--serve", metavar="N,...", help="instead: server throughput (in-process engine, "
                    "--batch N) plain vs --spec with N requests at once, for each N (e.g. 1,4)")
    ap.add_argument("--llama-types", default="none,ngram-simple,ngram-mod",
                    help="the --spec-type values to run with --llama-server (comma-separated)")
    a = ap.parse_args(argv)
    kernels.set_threads(a.threads)
    if a.costs or a.ragged_costs:
        for path in a.models:
            (costs if a.costs else ragged_costs)(path)
        return 0
    if a.llama_server:
        rows = []
        for path in a.models:
            rows += llama_server(a.llama_server, path, a.threads, a.max_tokens, a.workloads.split(","),
                                 tuple(a.llama_types.split(",")))
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return 0
    Speculation.pin_rows_default = a.exact
    rows = []
    for path in a.models:
        if a.serve:
            rows += bench_serve(path, a.reps, a.max_tokens, a.workloads.split(","),
                                [int(w) for w in a.serve.split(",")])
        else:
            rows += bench_model(path, a.reps, a.max_tokens, a.workloads.split(","), a.priced)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
