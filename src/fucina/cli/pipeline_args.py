"""--pipeline for run, chat, serve and bench: the model's layers split over the ranks of a
torchrun group (models/pipeline.py). Every rank runs the same command line; rank 0 does
what the command does, the other ranks serve its steps and exit when it is done."""
from __future__ import annotations


def add_pipeline_args(p) -> None:
    g = p.add_argument_group("pipeline stages (under torchrun)")
    g.add_argument("--pipeline", action="store_true",
                   help="split the layers over the ranks of this torchrun group (torchrun --nproc-per-node N "
                        "-m fucina ... --pipeline); rank 0 answers, the others compute their layers")
    g.add_argument("--split", metavar="N,N,...", default=None,
                   help="layers per rank, in rank order (default: balanced by bytes)")
    g.add_argument("--pipeline-timeout", metavar="SECONDS", type=float, default=None,
                   help="how long a stage may take to answer before the group is declared failed "
                        "(default $FUCINA_PIPELINE_TIMEOUT or 20)")


def pipeline_kwargs(args) -> dict:
    """fucina.load()'s pipeline keywords from the command line ({} without --pipeline)."""
    if not getattr(args, "pipeline", False):
        for flag in ("split", "pipeline_timeout"):
            if getattr(args, flag, None) is not None:
                from fucina.errors import InvalidArgument
                raise InvalidArgument(f"--{flag.replace('_', '-')} needs --pipeline")
        return {}
    from fucina.models.pipeline import parse_split
    return dict(pipeline=True, split=parse_split(args.split), pipeline_timeout=args.pipeline_timeout)


def stage_threads(args) -> int | None:
    """Threads per rank under --pipeline when --threads is not given: the host's cores shared
    by the ranks torchrun started on it (LOCAL_WORLD_SIZE), so they do not oversubscribe."""
    import os
    if not getattr(args, "pipeline", False):
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
