"""--moe-ram / --moe-policy for run, chat, serve and bench: a MoE model's experts streamed
from the file under a RAM budget (models/expert_store.py)."""
from __future__ import annotations


def add_moe_args(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--moe-ram", metavar="GiB|N%", default=None,
                   help="MoE models: keep at most this much of the experts in RAM (GiB, or a share of the "
                        "experts' bytes like 50%%), reading the others from the file when chosen; the output "
                        "is the same. At least one layer's experts")
    g.add_argument("--moe-cache-mb", metavar="MiB", type=float, default=None,
                   help="the same budget in MiB (the original fucina's spelling)")
    p.add_argument("--moe-policy", choices=("heat", "lru"), default="heat",
                   help="which resident expert --moe-ram gives up first: heat (least used lately, default) or lru")


def apply_moe_args(model, args) -> None:
    budget = moe_budget(args)
    if budget is not None:
        from fucina.models.expert_store import stream_experts
        stream_experts(model, budget, policy=getattr(args, "moe_policy", "heat"))


def moe_budget(args):
    """--moe-ram as given, or --moe-cache-mb as GiB; None: no budget."""
    mb = getattr(args, "moe_cache_mb", None)
    return mb / 1024 if mb is not None else getattr(args, "moe_ram", None)
