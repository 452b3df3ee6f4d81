"""Progress bars for the long parts of a command (tqdm, on stderr).

Quiet unless stderr is a terminal (pipes, logs and tests get no bar), so a bar never
mixes into output a script reads; FUCINA_PROGRESS=1 forces bars on, =0 off.
"""
from __future__ import annotations

import sys


def enabled() -> bool:
    from fucina.models.hub import progress_enabled

    return progress_enabled()


def bar(total: int | None, desc: str, unit: str = "it", **kw):
    """A tqdm bar on stderr (disabled when not a terminal); use as a context manager."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled(),
                leave=False, dynamic_ncols=True, **kw)


#: prompts longer than this get a prefill bar in `run` (chunks of llama.cpp's ubatch)
PREFILL_CHUNK = 512


def prefill_with_progress(llm, ids: list[int]) -> None:
    """Prefill all but the last token of a long prompt chunk by chunk with a bar; the
    generation that follows reuses it as a cached prefix. Short prompts, and runs
    without a terminal, prefill in one call as before (no bar, identical numerics)."""
    if len(ids) <= PREFILL_CHUNK or not enabled():
        return
    from fucina.models.cache_q8 import make_cache
    from fucina.text.generate import prefill

    if llm._cache is None:
        llm._cache = make_cache(llm.model, llm.n_ctx, llm.cache_type)
    with bar(len(ids) - 1, "prefill", unit="tok") as b:
        for end in range(PREFILL_CHUNK, len(ids), PREFILL_CHUNK):
            prefill(llm.model, llm._cache, llm._history, ids[:end])
            b.update(end - b.n)
