"""The q8_0 KV cache and the cache-type switch. The storage lives in
fucina.models.cache.rows (Q8Rows); any memory kind can hold q8_0 rows, and the
native step keeps f16 (a q8_0 cache is a capacity lever, not a speed lever)."""
from __future__ import annotations

from fucina.errors import KVCacheError
from fucina.models.cache import Q8Cache
from fucina.models.cache.rows import QK8_0, dequantize_q8_0, quantize_q8_0

__all__ = ["CACHE_TYPES", "QK8_0", "Q8Cache", "dequantize_q8_0", "make_cache", "quantize_q8_0"]

CACHE_TYPES = ("f16", "q8_0")


def make_cache(model, capacity: int | None = None, cache_type: str = "f16"):
    """A cache for `model` of the given storage type ("f16" or "q8_0"); the model's
    `init_cache` owns the geometry and the choice."""
    if cache_type in ("f16", None):
        return model.init_cache(capacity)
    if cache_type not in CACHE_TYPES:
        raise KVCacheError(f"unknown cache type {cache_type!r} (expected one of {', '.join(CACHE_TYPES)})")
    return model.init_cache(capacity, cache_type=cache_type)
