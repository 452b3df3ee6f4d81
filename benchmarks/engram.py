"""Engram on a frozen model: perplexity of the arms, and the decode cost of a graft.

    python benchmarks/engram.py ppl MODEL --train TEXT --held TEXT [--steps 60] [--layers 24,27]
        [--ctx 128] [--lr 1e-2] [--arms bare,cap1,full,lora] [--threads 2]
    python benchmarks/engram.py speed MODEL [--layers 24,27] [--gen 64] [--reps 5] [--threads 2]
        [--arms bare,cut,torch,split,native] [--clock wall|cpu]
    python benchmarks/engram.py layer MODEL [--layers 24] [--calls 400] [--reps 5] [--threads 1]

`ppl`: four arms on the same training windows and steps: bare (no training), cap1 (the
graft with one-row tables: what extra parameters without a memory buy), full (the graft),
lora (LoRA on every projection of the layers from the first memory layer up, rank chosen so
its parameters match the graft's), each scored as `fucina perplexity` scores (chunks of
--eval-ctx, second halves) on the training text and on held-out text.
`speed`: greedy single-token decode steps with and without a graft attached, alternated
per repetition in one process (the box's load moves every arm alike); the ratios of
medians to bare, and the median of each repetition's ratio to its own bare run (on a
loaded box, use many short repetitions and read the paired ratio). Arms: bare; cut (the native step cut at the memory layers by hooks that
change nothing: the cut's own cost); torch (the graft's torch layer); split (the step cut
at the memory layers, each one native call between the pieces); native (the memory
layers inside the one native step, what inference runs).
`layer`: one memory layer's decode call alone (process CPU time): the torch layer, the
native hook, the kernel.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fucina.models import load_model
from fucina.models.engram import Engram
from fucina.text.evaluate import perplexity
from fucina.text.tokenizer import Tokenizer
from fucina.train.engram import compress_table, fit, train, trainable_parameters


def _setup(args):
    import fucina.kernels as kernels
    from fucina.models.hub import resolve_model as resolve

    kernels.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    model = load_model(resolve(args.model))
    return model, Tokenizer.from_metadata(model.gguf.metadata)


def _ppl(model, tok, text: str, ctx: int) -> float:
    ids = tok.encode(text)
    return perplexity(model, ids, ctx, tok.bos_id if tok.add_bos else None)[0]


def _train_lora(model, ids, eng_params: int, start: int, steps: int, ctx: int, lr: float, seed: int):
    from fucina.train.lora import LoRAConfig, LoRAModel

    def trained(lm):   # parameters of the layers that get gradients (start and above)
        return sum(t.numel() for name, t in lm.named_params().items() if int(name.split(".")[1]) >= start)

    probe = LoRAModel(model, LoRAConfig(rank=1, alpha=2.0, targets="all"), seed=seed)
    per_rank = trained(probe)
    probe.detach()
    rank = max(1, round(eng_params / per_rank))
    lm = LoRAModel(model, LoRAConfig(rank=rank, alpha=2.0 * rank, targets="all"), seed=seed)
    fit(model, lm.params(), ids, start, steps=steps, lr=lr, ctx=ctx, seed=seed)
    return lm, rank, trained(lm)


def cmd_ppl(args) -> None:
    model, tok = _setup(args)
    train_text, held_text = open(args.train).read(), open(args.held).read()
    ids = tok.encode(train_text)
    layers = [int(x) for x in args.layers.split(",")]
    lookup = compress_table(tok)
    rows, eng_params = [], 0
    print(f"# {args.model}: training text {len(ids)} tokens, held-out {len(tok.encode(held_text))} tokens, "
          f"layers {layers}, {args.steps} steps of {args.ctx} tokens, lr {args.lr}")
    for arm in args.arms.split(","):
        t = time.perf_counter()
        extra, lm = {}, None
        if arm in ("cap1", "full"):
            eng = Engram.for_model(model, layers, capacity=1 if arm == "cap1" else args.capacity, seed=args.seed,
                                   lookup=lookup, pad_id=tok.bos_id or 0)
            losses = train(model, eng, ids, steps=args.steps, lr=args.lr, ctx=args.ctx, seed=args.seed)
            extra = dict(params=trainable_parameters(eng), first_loss=round(losses[0], 3),
                         last_loss=round(losses[-1], 3))
            if arm == "full":
                eng_params = trainable_parameters(eng)
            eng.attach(model)
        elif arm == "lora":
            lm, rank, n = _train_lora(model, ids, eng_params or 10_000_000, min(layers), args.steps, args.ctx,
                                      args.lr / 10, args.seed)
            extra = dict(params=n, rank=rank)
        seconds = time.perf_counter() - t
        p_train = _ppl(model, tok, train_text, args.eval_ctx)
        p_held = _ppl(model, tok, held_text, args.eval_ctx)
        if arm in ("cap1", "full"):
            eng.detach()
        if lm is not None:
            lm.detach()
        row = dict(arm=arm, ppl_train=round(p_train, 4), ppl_held=round(p_held, 4), train_s=round(seconds, 1),
                   **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in rows if r["arm"] == "bare"), None)
    if base:
        for r in rows:
            print(f"{r['arm']:5s}  train ppl {r['ppl_train']:8.3f} ({r['ppl_train'] / base['ppl_train']:.3f}x bare)"
                  f"  held-out ppl {r['ppl_held']:8.3f} ({r['ppl_held'] / base['ppl_held']:.3f}x bare)")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _decode(model, ids, gen: int, clock: str = "wall", steps: list | None = None) -> float:
    """Tokens a second of `clock`: wall, or the process's CPU time (on a box shared with
    other work the CPU time a token takes moves far less than its wall time; with one
    thread it is the work done, with more it also counts the threads' waits). `steps`
    collects each step's own time."""
    now = CLOCKS[clock]
    cache = model.init_cache(len(ids) + gen + 1)
    logits = model.forward_step(cache, ids, 0)
    t = now()
    for _ in range(gen):
        nxt = int(torch.argmax(logits))
        s = now()
        logits = model.forward_step(cache, [nxt], cache.len)
        if steps is not None:
            steps.append(now() - s)
    return gen / (now() - t)


def _identity_hook(layer, x, ids, pos0, cache):
    return x


def cmd_speed(args) -> None:
    """Arms, alternated per repetition: bare (one native step a token); cut (the step cut at
    the memory layers by hooks that return the residual unchanged: what cutting costs);
    torch (the graft's torch layer); split (the step cut, a native call a memory layer);
    native (the memory layers inside the one native step)."""
    model, tok = _setup(args)
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it keeps running")
    layers = [int(x) for x in args.layers.split(",")]
    eng = Engram.for_model(model, layers, capacity=args.capacity, lookup=compress_table(tok))
    with torch.no_grad():      # a trained graft's cost: nonzero value path
        for p in eng.parameters():
            p.add_(0.01)

    def arm(name):
        if name == "cut":
            for lid in layers:
                model.add_residual_hook(lid, _identity_hook)
        elif name in ("torch", "split", "native"):
            eng.native, eng.in_step = name != "torch", name == "native"
            eng.attach(model)
        try:
            return _decode(model, ids, args.gen, args.clock, step_times[name])
        finally:
            model.remove_residual_hooks(_identity_hook)
            if eng._attached is not None:
                eng.detach()

    arms = args.arms.split(",")
    times = {a: [] for a in arms}
    step_times = {a: [] for a in arms}
    _decode(model, ids, 8)
    for r in range(args.reps):
        # the order reversed every other repetition (A B, B A, ...): an arm is not always the
        # one that runs first after the other's cache and graft set-up
        for a in (arms if r % 2 == 0 else arms[::-1]):
            times[a].append(arm(a))
    med = {a: statistics.median(v) for a, v in times.items()}
    b = med.get("bare")
    out = dict(model=args.model, layers=layers, threads=args.threads, gen=args.gen, reps=args.reps, clock=args.clock,
               tok_s={a: round(v, 1) for a, v in med.items()})
    if b:
        out["ratio"] = {a: round(v / b, 3) for a, v in med.items()}
        # each repetition's arm against the bare run next to it in time, then the median: a
        # load that moves between repetitions moves both sides of a pair alike
        out["paired_ratio"] = {a: round(statistics.median(x / y for x, y in zip(v, times["bare"])), 3)
                               for a, v in times.items()}
        out["added_ms_per_token"] = {a: round(1e3 / v - 1e3 / b, 3) for a, v in med.items()}
        # the median single step of each arm over every repetition: a step the host
        # preempted is an outlier here, where in a repetition's rate it is averaged in
        step = {a: statistics.median(v) for a, v in step_times.items()}
        out["step_ms"] = {a: round(1e3 * v, 3) for a, v in step.items()}
        out["step_ratio"] = {a: round(step["bare"] / v, 3) for a, v in step.items()}
    out["runs"] = {a: [round(x, 1) for x in v] for a, v in times.items()}
    print(json.dumps(out))


def cmd_layer(args) -> None:
    """One memory layer's decode call, process CPU time a call (median of --reps rounds of
    --calls calls): the torch layer, the graft's native hook (its Python path and the
    kernel), and the kernel alone (one `_engram.forward`)."""
    from fucina.kernels import engram as native_engram

    model, tok = _setup(args)
    lid = int(args.layers.split(",")[0])
    eng = Engram.for_model(model, [lid], capacity=args.capacity, lookup=compress_table(tok))
    with torch.no_grad():
        for p in eng.parameters():
            p.add_(0.01)
    cache, d = model.init_cache(args.calls + 1), model.config.n_embd
    x, ids = torch.randn(1, d), torch.tensor([123])

    def timed(call) -> float:
        rounds = []
        for _ in range(args.reps):
            eng._streams.clear()
            with torch.inference_mode():
                eng(lid, x, ids, 0, cache)
                t = time.process_time()
                for pos in range(1, args.calls + 1):
                    call(pos)
            rounds.append((time.process_time() - t) / args.calls * 1e6)
        return statistics.median(rounds)

    out = {}
    for name, native in (("torch_layer_us", False), ("native_hook_us", True)):
        eng.native = native
        out[name] = round(timed(lambda pos: eng(lid, x, ids, pos, cache)), 1)
    fixed, y = eng._native_args(lid, eng.layers[str(lid)]), x.clone()
    lookup = eng.plan.lookup.ctypes.data

    def raw(pos):
        s = eng._streams[cache]
        native_engram.forward(y.data_ptr(), 1, d, ids.data_ptr(), eng.plan.n_vocab, lookup, s.ids_ptr, pos,
                              s.ids.shape[0], *fixed, s.conv_ptr[lid])

    out["kernel_us"] = round(timed(raw), 1)
    print(json.dumps(dict(model=args.model, layer=lid, threads=args.threads, isa=native_engram.level(), **out)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ppl")
    s.add_argument("model")
    s.add_argument("--train", required=True)
    s.add_argument("--held", required=True)
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--layers", default="24,27")
    s.add_argument("--ctx", type=int, default=128)
    s.add_argument("--eval-ctx", type=int, default=256)
    s.add_argument("--lr", type=float, default=1e-2)
    s.add_argument("--capacity", type=int, default=20011)
    s.add_argument("--arms", default="bare,cap1,full,lora")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(func=cmd_ppl)
    s = sub.add_parser("speed")
    s.add_argument("model")
    s.add_argument("--layers", default="24,27")
    s.add_argument("--capacity", type=int, default=20011)
    s.add_argument("--gen", type=int, default=64)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--arms", default="bare,cut,torch,split,native")
    s.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    s.set_defaults(func=cmd_speed)
    s = sub.add_parser("layer")
    s.add_argument("model")
    s.add_argument("--layers", default="24")
    s.add_argument("--capacity", type=int, default=20011)
    s.add_argument("--calls", type=int, default=400)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--threads", type=int, default=1)
    s.set_defaults(func=cmd_layer)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
