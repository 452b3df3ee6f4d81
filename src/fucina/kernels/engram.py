"""The Engram layer's inference forward as one native call (csrc/engram_module.cpp).

`forward` takes one memory layer's rows for a step: it compresses the step's token ids
into the sequence's id history, hashes each row's n-grams, gathers the table rows, runs
both projections, the gate, the value and the ShortConv over the normed value history,
and adds the layer's output to the residual rows in place. `fucina.models.engram` calls
it for every step that needs no gradient and is not run inside the decoder step; the torch layer (models/engram/layer.py) stays
the reference it is tested against and the training path.

Inside the decoder step: `graft_new` makes a context for a graft's memory layers,
`graft_layer` gives a layer its fixed arguments and returns its hook context, which the
step's plan calls through `hook_address()` (`DecoderPlan.with_hooks`); `graft_bind`, before
each step, checks and compresses the step's ids, reads mapped tables' rows ahead and arms
every layer for that step. One native call a token then runs the whole model.

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


def hook_address() -> int:
    """The decoder step's residual hook (fk_res_hook) that runs a graft layer."""
    return _engram.hook_address()


def graft_new(n_layers: int, d: int, n_vocab: int, lookup_ptr: int):
    return _engram.graft_new(n_layers, d, n_vocab, lookup_ptr)


def graft_layer(graft, j: int, fixed: tuple, mapped_row_bytes: int) -> int:
    """Layer j's fixed arguments (forward's, max_ngram .. dilation); its hook context."""
    return _engram.graft_layer(graft, j, *fixed, mapped_row_bytes)


def graft_bind(graft, ids_ptr: int, m: int, sids_ptr: int, pos0: int, capacity: int, conv_ptr: int) -> int:
    """Bind the next step's m rows (ids at ids_ptr, positions pos0..) to the stream's
    history; the mapped tables' rows read ahead. Raises IndexError / ValueError as forward."""
    return _engram.graft_bind(graft, level(), ids_ptr, m, sids_ptr, pos0, capacity, conv_ptr)
