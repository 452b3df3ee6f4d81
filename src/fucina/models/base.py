"""The decoder contract every generic layer relies on, and the math families share.

A family module (llama.py, qwen3.py, gemma3.py) defines `Config.from_gguf` and a
`Model` meeting `Decoder`. Blocks read like the math; everything here is plain torch
so it is also the reference the native kernels are checked against.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.errors import FucinaError, GGUFError, KVCacheError
from fucina.gguf import GGUFFile
from fucina.models.cache import KVCache
from fucina.weights import LinearWeight

Tokens = Sequence[int] | torch.Tensor


@runtime_checkable
class Decoder(Protocol):
    config: "BaseConfig"
    supports_batch: bool

    def init_cache(self, capacity: int | None = None) -> KVCache: ...

    def forward_step(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        """Append `tokens` at positions pos0.. (requires cache.len == pos0); last logits [n_vocab]."""

    def forward_step_all_logits(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        """As forward_step, returning logits for every new position [m, n_vocab]."""

    def forward_last_logits(self, tokens: Tokens) -> torch.Tensor:
        """Cacheless: logits of the last position of `tokens`."""


@dataclass
class BaseConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    n_rot: int


# -- shared math --------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim (one torch op: ~25% cheaper per
    call than the five-op spelling on the decode path, same values)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Rope:
    """Rotary embedding tables for one (n_rot, base); `neox` rotates halves, otherwise
    adjacent pairs (GGML's NORM mode, which llama-family converters permute Q/K for)."""

    def __init__(self, n_rot: int, base: float, neox: bool, scale: float = 1.0):
        self.n_rot, self.neox = n_rot, neox
        inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
        self.inv_freq = (inv * scale)
        self.cis = torch.empty(0, n_rot // 2, dtype=torch.complex64)

    def _table(self, end: int) -> torch.Tensor:
        """cos + i sin of every (position, frequency) up to `end`, grown geometrically."""
        if self.cis.shape[0] < end:
            n = max(end, 2 * self.cis.shape[0], 256)
            ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            self.cis = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)
        return self.cis

    def table(self, end: int) -> torch.Tensor:
        """(cos, sin) of every (position, frequency) up to `end` as f32 [n >= end, n_rot/2, 2]."""
        return torch.view_as_real(self._table(end))

    def __call__(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """x: [m, heads, head_dim] at positions pos0..pos0+m-1."""
        m = x.shape[0]
        return self._rotate(x, self._table(pos0 + m)[pos0:pos0 + m, None, :])

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [m, heads, head_dim], row r at positions[r] (ragged batches)."""
        return self._rotate(x, self._table(int(positions.max()) + 1)[positions, None, :])

    def _rotate(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        # each rotated pair as one complex number: a single complex multiply per call
        r = self.n_rot
        xr, rest = x[..., :r], x[..., r:]
        if self.neox:   # pairs (i, i + r/2)
            xc = torch.view_as_complex(xr.unflatten(-1, (2, r // 2)).transpose(-1, -2).contiguous())
            out = torch.view_as_real(xc * cis).transpose(-1, -2).flatten(-2)
        else:           # adjacent pairs (2i, 2i + 1)
            xc = torch.view_as_complex(xr.contiguous().unflatten(-1, (r // 2, 2)))
            out = torch.view_as_real(xc * cis).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def attention(q: torch.Tensor, cache: KVCache, layer: int, pos0: int, scale: float,
              window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [m, heads, d] at positions pos0.. over cache rows [0, pos0+m).

    `window` > 0 masks keys with q_pos - k_pos >= window (llama.cpp's standard SWA)."""
    m, n_head, d = q.shape
    n = pos0 + m
    k = cache.keys(layer, n)
    v = cache.values(layer, n)
    start = 0
    if window > 0:
        start = max(0, pos0 - window + 1)  # no query in this step sees keys before this
        k, v = k[start:], v[start:]
    if m == 1 and not softcap:
        return _decode_attention(q, k, v, scale)
    k = k.float().transpose(0, 1)  # [kv_heads, n, d]
    v = v.float().transpose(0, 1)
    qh = q.transpose(0, 1)         # [heads, m, d]
    group = n_head // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    qpos = torch.arange(pos0, pos0 + m)[:, None]
    kpos = torch.arange(start, n)[None, :]
    mask = kpos <= qpos
    if window > 0:
        mask &= (qpos - kpos) < window
    if softcap:
        s = (qh @ k.transpose(1, 2)) * scale
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.softmax(s, dim=-1) @ v
    else:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(m, n_head * d)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row: every cached key is visible, so no mask. An f16 cache goes to the
    native kernel (one pass over the rows, online softmax); otherwise, and as the kernel's
    reference, GQA as a grouped bmm instead of repeating K/V per head."""
    if kernels.decode_attention_ok(q, k, v):
        return kernels.decode_attention(q, k, v, scale)
    _, n_head, d = q.shape
    kvh = k.shape[1]
    qg = q.view(kvh, n_head // kvh, d)
    s = torch.bmm(qg, k.permute(1, 2, 0).float()) * scale      # [kvh, group, n]
    out = torch.bmm(torch.softmax(s, dim=-1), v.transpose(0, 1).float())
    return out.reshape(1, n_head * d)


class Ragged:
    """N streams advanced together by one token each: row r belongs to caches[r] at
    position caches[r].len. Blocks pass it where a single cache would go."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)
        self.pos0s = [c.len for c in self.caches]
        self.positions = torch.tensor(self.pos0s)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | Ragged, layer: int,
           pos0: int, rope: "Rope", scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """RoPE q/k, append k/v to the cache, attend. With a Ragged batch each row is rotated at
    its own position and attends over its own cache."""
    if not isinstance(cache, Ragged):
        q, k = rope(q, pos0), rope(k, pos0)
        cache.append(layer, k, v)
        return attention(q, cache, layer, pos0, scale, window, softcap)
    q, k = rope.at(q, cache.positions), rope.at(k, cache.positions)
    out = []
    for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s)):
        c.append(layer, k[r:r + 1], v[r:r + 1])
        out.append(attention(q[r:r + 1], c, layer, p, scale, window, softcap))
    return torch.cat(out)


def load_linear(f: GGUFFile, name: str, required: bool = True) -> LinearWeight | None:
    t = f.tensors.get(name)
    if t is None:
        if required:
            raise GGUFError(f"{f.path}: missing tensor {name!r}")
        return None
    return LinearWeight.from_tensor(t)


def load_vector(f: GGUFFile, name: str, size: int, required: bool = True) -> torch.Tensor | None:
    w = load_linear(f, name, required)
    if w is None:
        return None
    v = w.dequantize().reshape(-1)
    if v.numel() != size:
        raise GGUFError(f"{f.path}: tensor {name!r} has {v.numel()} elements, expected {size}")
    return v


def check_shape(w: LinearWeight, out_f: int, in_f: int) -> LinearWeight:
    if w.shape != (out_f, in_f):
        raise GGUFError(f"tensor {w.name!r} has shape {w.shape}, expected {(out_f, in_f)}")
    return w


def as_ids(tokens: Tokens, n_vocab: int) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise FucinaError("no tokens to process")
    if int(ids.min()) < 0 or int(ids.max()) >= n_vocab:
        raise FucinaError(f"token id out of range [0, {n_vocab})")
    return ids


class DecoderBase:
    """The contract's generic half: cache handling and the step entry points.
    A family implements `embed`, `block(i, x, cache, pos0)` and `head`."""

    config: BaseConfig
    supports_batch = False   # families whose blocks route attention through `attend` set True

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        c = self.config
        return [c.n_head_kv] * c.n_layer, [c.head_dim] * c.n_layer

    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16") -> KVCache:
        """A cache for up to `capacity` positions; `cache_type` "f16" (default) or "q8_0"."""
        heads, dims = self.kv_geometry()
        cap = capacity or min(self.config.n_ctx_train, 4096)
        if cache_type == "q8_0":
            from fucina.models.cache_q8 import Q8Cache
            return Q8Cache(self.config.n_layer, heads, dims, cap)
        if cache_type != "f16":
            raise KVCacheError(f"unknown cache type {cache_type!r} (f16 or q8_0)")
        return KVCache(self.config.n_layer, heads, dims, cap, dtype)

    @torch.inference_mode()
    def forward_step_batch(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Advance N caches by one token each in one weight pass; logits [N, n_vocab]."""
        if len(caches) != len(tokens) or not caches:
            raise FucinaError(f"forward_step_batch: {len(caches)} caches for {len(tokens)} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise KVCacheError("forward_step_batch: the same cache appears twice")
        for c in caches:
            c.check_room(1)
        x = self.embed(as_ids(tokens, self.config.n_vocab))
        ptrs = [self._native_cache(c) for c in caches]
        if all(p is not None for p in ptrs):
            x = x.float().contiguous()
            end = max(c.len for c in caches) + 1
            self.native_plan.run_batch(x, ptrs, [c.len for c in caches],
                                       [t.table(end) for t in self.rope_tables()])
        else:
            batch = Ragged(caches)
            for i in range(self.config.n_layer):
                x = self.block(i, x, batch, 0)
        for c in caches:
            c.advance(1)
        return self.head(x)

    def _hidden(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        if cache.len != pos0:
            raise FucinaError(f"forward_step: cache holds {cache.len} positions, pos0 is {pos0}")
        ids = as_ids(tokens, self.config.n_vocab)
        m = ids.numel()
        cache.check_room(m)
        x = self.embed(ids)
        ptrs = self._native_cache(cache)
        if ptrs is not None:
            x = x.float().contiguous()
            tables = [t.table(pos0 + m) for t in self.rope_tables()]
            # chunks bound the step's scratch (~70 KB a row on Qwen3-0.6B) on long prompts;
            # each chunk attends to the cache the previous ones wrote
            for s in range(0, m, self.native_chunk):
                self.native_plan.run(x[s:s + self.native_chunk], ptrs, pos0 + s, tables)
        else:
            for i in range(self.config.n_layer):
                x = self.block(i, x, cache, pos0)
        cache.advance(m)
        return x

    # -- the native layer step (kernels.DecoderPlan): every block in one call ---------------

    native_plan: "kernels.DecoderPlan | None" = None   # set by families that can build one
    native_chunk = 512                                  # rows per native call on long prompts
    # False: the torch blocks (reference, A/B); FUCINA_NATIVE_STEP=0 sets it for a process
    use_native_step = os.environ.get("FUCINA_NATIVE_STEP", "1") != "0"

    def rope_tables(self) -> list["Rope"]:
        """The RoPE tables the plan's layers index (families with two override this)."""
        return [self.rope]

    def _native_cache(self, cache: KVCache) -> "kernels.KVPointers | None":
        """The cache's pointer table when the native step serves this call, else None.
        Only a plain f16 KVCache qualifies (the q8_0 cache keeps the torch path)."""
        if self.native_plan is None or not self.use_native_step or type(cache) is not KVCache \
                or cache.dtype is not torch.float16:
            return None
        ptrs = getattr(cache, "_native_ptrs", None)
        if ptrs is None:
            c = self.config
            ptrs = kernels.DecoderPlan.cache_pointers(cache.k, cache.v, c.n_head_kv, c.head_dim)
            cache._native_ptrs = ptrs
        return ptrs

    @torch.inference_mode()
    def forward_step(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        x = self._hidden(cache, tokens, pos0)
        return self.head(x[-1:])[0]

    @torch.inference_mode()
    def forward_step_all_logits(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        return self.head(self._hidden(cache, tokens, pos0))

    def forward_last_logits(self, tokens: Tokens) -> torch.Tensor:
        n = len(tokens)
        return self.forward_step(self.init_cache(max(n, 1)), tokens, 0)


def attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
