"""MoE expert stacks in the file's rows against 16-row groups, paired in one process.

    python benchmarks/expert_groups.py MODEL.gguf [...] [--threads 2] [--rounds 7] [--steps 160] [--pp 128]
        [--moe-ram 100%]

Loads each model twice (`load_model(path, group_experts=False)`: the stacks on the file's
rows; the default: the stacks in 16-row groups where the ISA's decode GEMV reads them,
`fucina.weights.row_groups`) and alternates the two round by round: a `--pp`-token
prefill, then `--steps` greedy decode steps. Prints the medians, the median of the rounds'
paired ratios (groups / rows) with their range, and whether the two gave the same logits
bitwise (they must: every route reads the groups as the rows they came from). FUCINA_ISA
picks the level. `--moe-ram BUDGET` puts both under an expert store of that budget: the
slots on the file's rows (`stream_experts(..., groups=False)`) against the slots packed
into groups as they are read, with the resident grouped model as a third column.

A file with experts of a real model's shape (Qwen3-30B-A3B's 768 x 2048 experts; 4 layers
of 32 experts, 8 used), from the test writer and llama.cpp's quantizer:

    cd tests && python -c "import gguf; from synth import write_model; write_model('q3moe-f16.gguf', \\
        'qwen3moe', qtype=gguf.GGMLQuantizationType.F16, hidden=2048, heads=16, kv_heads=4, head_dim=128, \\
        ffn=6144, layers=4, experts=32, experts_used=8, moe_ffn=768, seed=5)"
    llama-quantize q3moe-f16.gguf q3moe-q4km.gguf Q4_K_M
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def run(model, ids: torch.Tensor, steps: int) -> tuple[float, float, torch.Tensor]:
    """(prefill tok/s, decode tok/s, the logits of every step) for one pass."""
    c = model.init_cache(len(ids) + steps + 8)
    t = time.perf_counter()
    last = model.forward_step(c, ids, 0)
    pp = len(ids) / (time.perf_counter() - t)
    tok, out = int(last.argmax()), []
    t = time.perf_counter()
    for p in range(len(ids), len(ids) + steps):
        logits = model.forward_step(c, torch.tensor([tok]), p)
        out.append(logits)
        tok = int(logits.argmax())
    return pp, steps / (time.perf_counter() - t), torch.stack(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--moe-ram", default=None, help="stream both under an expert store of this budget")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import fucina.kernels as K
    from fucina.models import load_model
    from fucina.models.expert_store import stream_experts
    from fucina.weights.row_groups import expert_stacks

    K.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    ids = torch.randint(5, 200, (args.pp,), generator=torch.Generator().manual_seed(0))
    for path in args.models:
        pair = {"rows": load_model(path, group_experts=False), "groups": load_model(path)}
        if args.moe_ram:
            for name, model in pair.items():
                stream_experts(model, args.moe_ram, groups=name == "groups")
            pair["resident"] = load_model(path)
        stacks = [s for L in pair["groups"].layers for s in expert_stacks(L)]
        grouped = [s for s in stacks if K.group_rows(s.whole.kernel) or isinstance(s.whole.kernel, K.StoredKernel)]
        pp = {k: [] for k in pair}
        tg = {k: [] for k in pair}
        logits = {}
        for _ in range(args.rounds):
            for name, model in pair.items():
                a, b, logits[name] = run(model, ids, args.steps)
                pp[name].append(a)
                tg[name].append(b)
        same = all(torch.equal(logits["rows"], x) for x in logits.values())
        where = f", streamed under --moe-ram {args.moe_ram}" if args.moe_ram else ""
        print(f"{Path(path).name} ({K.isa()}, {args.threads} threads{where}): {len(grouped)} of {len(stacks)} "
              f"expert stacks in groups; logits equal: {same}")
        for label, r in (("pp", pp), ("tg", tg)):
            ratios = [g / w for w, g in zip(r["rows"], r["groups"])]
            line = (f"  {label}{args.pp if label == 'pp' else args.steps}: rows {statistics.median(r['rows']):.1f} "
                    f"tok/s, groups {statistics.median(r['groups']):.1f} tok/s, paired {statistics.median(ratios):.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f})")
            if "resident" in r:
                line += (f"; resident {statistics.median(r['resident']):.1f} tok/s, groups / resident "
                         f"{statistics.median([g / x for g, x in zip(r['groups'], r['resident'])]):.2f}")
            print(line, flush=True)
        del pair
    return 0


if __name__ == "__main__":
    sys.exit(main())
