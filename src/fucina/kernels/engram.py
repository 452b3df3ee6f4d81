"""The Engram layer's inference forward as one native call (csrc/engram_module.cpp).

`forward` takes one memory layer's rows for a step: it compresses the step's token ids
into the sequence's id history, hashes each row's n-grams, gathers the table rows, runs
both projections, the gate, the value and the ShortConv over the normed value history,
and adds the layer's output to the residual rows in place. `fucina.models.engram` calls
it for every step that needs no gradient; the torch layer (models/engram/layer.py) stays
the reference it is tested against and the training path.

The ISA section follows `fucina.kernels.isa()` (AVX-512, AVX2 + FMA, or scalar), so
`fucina.kernels.set_isa` moves it too; FUCINA_KERNELS=0 turns it off with the rest.
"""
from __future__ import annotations

from fucina import kernels

try:
    from fucina.kernels import _engram
except ImportError:     # a source checkout whose extensions are not built
    _engram = None

LEVELS = {"scalar": 0, "avx2": 1, "avx2vnni": 1, "avx512": 2}


def available() -> bool:
    return _engram is not None and kernels.available()


def level() -> int:
    """The section the kernels' ISA maps to (0 scalar, 1 AVX2 + FMA, 2 AVX-512)."""
    return LEVELS.get(kernels.isa(), 0)


def forward(*args) -> None:
    """_engram.forward's arguments after the level (see csrc/engram_module.cpp); raises
    IndexError on a token id out of range, ValueError on inconsistent geometry."""
    _engram.forward(level(), *args)


def rows(*args) -> None:
    _engram.rows(*args)


def willneed(table_ptr: int, row_bytes: int, table_rows: int, rows_ptr: int, n: int) -> int:
    """Start reading the pages of `n` rows of a mapped table; the rows advised."""
    return _engram.willneed(table_ptr, row_bytes, table_rows, rows_ptr, n)
