"""Typed metadata helpers with the seed's zero policy (§13.3).

`meta_int(f, arch, suffix, zero)` reads "<arch>.<suffix>". Missing keys, negative
integers and - under REJECT_ZERO - zero are invalid: the `_opt` forms return None,
the strict forms raise. Families disagree about zero on purpose (qwen3 treats zero
as missing; gemma reads legitimately-zero keys), hence the policy argument.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np

from fucina.errors import InvalidConfig, MissingMetadata


class Zero(enum.Enum):
    REJECT = "reject_zero"
    ACCEPT = "accept_zero"


def _key(arch: str, suffix: str) -> str:
    return f"{arch}.{suffix}" if arch else suffix


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def meta_int_opt(meta: dict, arch: str, suffix: str, zero: Zero = Zero.REJECT) -> int | None:
    v = _as_int(meta.get(_key(arch, suffix)))
    if v is None or v < 0 or (v == 0 and zero is Zero.REJECT):
        return None
    return v


def meta_int(meta: dict, arch: str, suffix: str, zero: Zero = Zero.REJECT) -> int:
    key = _key(arch, suffix)
    if key not in meta:
        raise MissingMetadata(f"missing metadata key {key}")
    v = meta_int_opt(meta, arch, suffix, zero)
    if v is None:
        raise InvalidConfig(f"metadata {key} = {meta[key]!r} is not a valid "
                            f"{'positive' if zero is Zero.REJECT else 'non-negative'} integer")
    return v


def meta_float_opt(meta: dict, arch: str, suffix: str) -> float | None:
    v = meta.get(_key(arch, suffix))
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    return float(v)


def meta_float(meta: dict, arch: str, suffix: str) -> float:
    key = _key(arch, suffix)
    v = meta_float_opt(meta, arch, suffix)
    if v is None:
        if key in meta:
            raise InvalidConfig(f"metadata {key} = {meta[key]!r} is not a number")
        raise MissingMetadata(f"missing metadata key {key}")
    return v


def meta_per_layer(meta: dict, key: str, n_layer: int, default: Any = None) -> list:
    """A per-layer key that may be a scalar (broadcast) or an array (llama.cpp's get_key_or_arr)."""
    v = meta.get(key, default)
    if v is None:
        raise MissingMetadata(f"missing metadata key {key}")
    if isinstance(v, (list, np.ndarray)):
        vals = [x.item() if hasattr(x, "item") else x for x in v]
        if len(vals) != n_layer:
            raise InvalidConfig(f"metadata {key} has {len(vals)} entries for {n_layer} layers")
        return vals
    return [v] * n_layer
