"""Pieces every command module shares, below them all: the argparse types for counts
and the start-up pause of the cyclic GC. `fucina.cli.main` imports the command modules;
they import this, never main (no import circle)."""
from __future__ import annotations

import argparse
import gc

_gc_was_enabled: bool | None = None
_gc_froze = False


def pause_gc() -> None:
    """Start main()'s pause of the cyclic GC: off until the model is loaded (resume_gc)."""
    global _gc_was_enabled
    _gc_was_enabled = gc.isenabled()
    gc.disable()


def resume_gc() -> None:
    """End main()'s start-up pause of the cyclic GC (once the model is loaded). Start-up
    allocates torch's modules and the vocabulary, hundreds of thousands of long-lived
    objects; collections re-scanning them cost ~0.25 s CPU of a 1.4 s `run --gen 16`.
    They are frozen (gc.freeze) so the first collections after do not scan them either;
    end_gc() unfreezes them when the command ends (an in-process caller loses nothing)."""
    global _gc_was_enabled, _gc_froze
    if _gc_was_enabled and not gc.get_freeze_count():     # a caller's own freeze is left alone
        gc.freeze()
        _gc_froze = True
    if _gc_was_enabled:
        gc.enable()
    _gc_was_enabled = None


def end_gc() -> None:
    """Undo what the pause froze (the command ended; resume_gc has run)."""
    global _gc_froze
    if _gc_froze:
        gc.unfreeze()
        _gc_froze = False


def count(text: str) -> int:
    """argparse type for token counts and sizes: a non-negative integer."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive(text: str) -> int:
    v = count(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return v


def counts(text: str) -> list[int]:
    """argparse type for a comma list of counts (llama-bench's `-p 1,16,128`)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}")
    return [count(p) for p in parts]
