"""The decoder contract every generic layer relies on, and the math families share.

A family module (llama.py, qwen3.py, gemma3.py) re-exports its torch-free schema
(models/schema/<family>.py: `Config`, `Schema`, the tensor lists) and defines a `Model`
meeting `Decoder`, built from the tensors `Schema.check` lists and checks. Blocks read
like the math; everything here is plain torch so it is also the reference the native
kernels are checked against.
"""
from __future__ import annotations

import math
import os
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.errors import FucinaError, KVCacheError
from fucina.gguf import TensorInfo
from fucina.models.cache import KVCache, KVMemory, WindowKV, cache_capacity
# the config reader and the tensor schemas are torch-free (models/schema/base.py): re-exported here
from fucina.models.schema.base import (REQUIRED, BaseConfig, LayerSpec, Tensors, TensorSpec,  # noqa: F401
                                       meta_field, tensor_dims)
from fucina.weights import ExpertStack, LinearWeight

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


def linear(t: TensorInfo | None) -> LinearWeight | None:
    """A checked tensor (a `Tensors` entry) as a LinearWeight; None stays None."""
    return LinearWeight.from_tensor(t) if t is not None else None


def vector(t: TensorInfo | None) -> torch.Tensor | None:
    """A checked vector tensor dequantized (f32, 1-d); None stays None."""
    return LinearWeight.from_tensor(t).dequantize().reshape(-1) if t is not None else None


def layer_tensors(t: Tensors, i: int, schema: Sequence[TensorSpec]) -> dict:
    """The schema's tensors of layer i from the checked table, by spec key: vectors
    dequantized, expert stacks [n_expert, out, in] as ExpertStacks, matrices as
    LinearWeights (absent optional ones are None)."""
    out = {}
    for s in schema:
        info = t[s.gguf_name(i)]
        if info is None or len(s.shape) == 2:
            out[s.key] = linear(info)
        elif len(s.shape) == 1:
            out[s.key] = vector(info)
        else:
            out[s.key] = ExpertStack.from_tensor(info)
    return out


# -- shared math --------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim (one torch op: ~25% cheaper per
    call than the five-op spelling on the decode path, same values)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Rope:
    """Rotary embedding tables for one (n_rot, base); `neox` rotates halves, otherwise
    adjacent pairs (GGML's NORM mode, which llama-family converters permute Q/K for)."""

    def __init__(self, n_rot: int, base: float, neox: bool, scale: float = 1.0, mscale: float = 1.0):
        self.n_rot, self.neox, self.mscale = n_rot, neox, mscale   # mscale: cos/sin magnitude
        inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
        self.inv_freq = (inv * scale)
        self.cis = torch.empty(0, n_rot // 2, dtype=torch.complex64)

    def _table(self, end: int) -> torch.Tensor:
        """cos + i sin of every (position, frequency) up to `end`, grown geometrically."""
        # a table made under inference_mode cannot enter autograd: training after inference remakes it
        if self.cis.shape[0] < end or (self.cis.is_inference() and not torch.is_inference_mode_enabled()):
            n = max(end, 2 * self.cis.shape[0], 256)
            with torch.inference_mode(False):   # grown during inference, read by training too
                ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
                self.cis = torch.polar(torch.full_like(ang, self.mscale), ang).to(torch.complex64)
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


# Steps of at most this many rows run their attention row by row on the torch blocks, each
# row the one-row decode call over its own keys: a speculative verify block (1 + k rows) is
# then bitwise the decode steps it stands for, and so is a prompt fed in chunks this small.
# Longer chunks take one SDPA call, whose rows can differ from the same rows split (up to
# 4.7e-4 in an F32 model's logits, 1.9e-6 in Q8_0): row by row, SmolLM2's torch-block
# prefill ran pp128 806 -> 452 tok/s and a gpt-oss file's 2414 -> 690 (Zen 4, 2 threads).
ROWWISE_MAX = 16


def rowwise(m: int, cache, x: torch.Tensor) -> bool:
    """Whether a step of m rows (inputs x) runs row by row: 2..ROWWISE_MAX rows at inference
    (training's stand-in cache and autograd keep the m-row forms, which have a backward)."""
    return 1 < m <= ROWWISE_MAX and not cache.training and not (x.requires_grad and torch.is_grad_enabled())


def attention(q: torch.Tensor, cache: KVCache, layer: int, pos0: int, scale: float,
              window: int = 0, softcap: float = 0.0, causal: bool = True) -> torch.Tensor:
    """Causal attention of q [m, heads, d] at positions pos0.. over cache rows [0, pos0+m).

    `window` > 0 masks keys with q_pos - k_pos >= window (llama.cpp's standard SWA);
    `causal` False: every query sees every row [0, pos0+m) (a diffusion canvas)."""
    m, n_head, d = q.shape
    n = pos0 + m
    if not causal:
        return _full_attention(q, *cache.span(layer, 0, n), scale)
    start = max(0, pos0 - window + 1) if window > 0 else 0  # no query in this step sees keys before this
    k, v = cache.span(layer, start, n)
    if m == 1 and not softcap:
        return _decode_attention(q, k, v, scale)
    if rowwise(m, cache, q) and not softcap:
        return _rows_attention(q, k, v, scale, pos0 - start, window)
    k = k.float().transpose(0, 1)  # [kv_heads, n, d]
    v = v.float().transpose(0, 1)
    qh = q.transpose(0, 1)         # [heads, m, d]
    group = n_head // k.shape[0]
    if cache.training and not softcap:   # train.forward's stand-in cache
        causal = start == 0 and pos0 == 0 and (window <= 0 or window >= m)
        return train_attention(qh, k, v, scale, None if causal else causal_mask(pos0, m, start, window))
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    mask = causal_mask(pos0, m, start, window)
    if softcap:
        s = (qh @ k.transpose(1, 2)) * scale
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.softmax(s, dim=-1) @ v
    else:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(m, n_head * d)


def causal_mask(pos0: int, m: int, start: int, window: int = 0) -> torch.Tensor:
    """[m, pos0 + m - start] bool: query pos0 + i sees key start + j (causal, within `window`)."""
    qpos = torch.arange(pos0, pos0 + m)[:, None]
    kpos = torch.arange(start, pos0 + m)[None, :]
    mask = kpos <= qpos
    if window > 0:
        mask &= (qpos - kpos) < window
    return mask


def train_attention(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Training's attention (heads-first q [H, m, d], k/v [kv_heads, n, d]; mask None =
    plain causal from position 0): torch's flash kernel, which has a backward and keeps no
    [H, m, n] probabilities; 4-D (the 3-D call takes the math path), GQA without repeating
    K/V, is_causal rather than a mask where it can (the blocks above the diagonal are
    skipped): ~8% faster forward + backward than the repeated, masked call."""
    out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=k.shape[0] != qh.shape[0])[0]
    return out.transpose(0, 1).reshape(qh.shape[1], -1)


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


def _rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first: int,
                    window: int) -> torch.Tensor:
    """m query rows, row i at key index first + i of k/v [n, kv_heads, d]: each row attends
    exactly as a one-row decode at its position does (the same call over the same keys), so
    a row's output never depends on the chunk, batch or verify block it was computed in.
    One causal SDPA over the m rows reduces in an order that depends on m (4.7e-4 apart
    between chunkings on a 3-layer F32 model): the torch blocks, which the families without
    a native step serve from, would break batch invariance and lossless speculation."""
    m, n_head, d = q.shape
    out = torch.empty(m, n_head * d, dtype=torch.float32)
    for i in range(m):
        end = first + i + 1
        lo = max(0, end - window) if window > 0 else 0
        out[i] = _decode_attention(q[i:i + 1], k[lo:end], v[lo:end], scale)[0]
    return out


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every query row over every key row, no mask (GQA as grouped heads)."""
    m, n_head, d = q.shape
    kvh = k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], scale=scale,
                                         enable_gqa=kvh != n_head)[0]
    return out.transpose(0, 1).reshape(m, n_head * d)


class Ragged:
    """N streams advanced together by one token each: row r belongs to caches[r] at
    position caches[r].len. Blocks pass it where a single cache would go."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)
        self.capacity = max(c.capacity for c in self.caches)   # picks RoPE variants (phi3)
        self.pos0s = [c.len for c in self.caches]
        self.positions = torch.tensor(self.pos0s)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | Ragged, layer: int,
           pos0: int, rope: "Rope", scale: float, window: int = 0, softcap: float = 0.0,
           causal: bool = True) -> torch.Tensor:
    """RoPE q/k, append k/v to the cache, attend. With a Ragged batch each row is rotated at
    its own position and attends over its own cache."""
    if not isinstance(cache, Ragged):
        q, k = rope(q, pos0), rope(k, pos0)
        cache.append(layer, k, v)
        return attention(q, cache, layer, pos0, scale, window, softcap, causal)
    q, k = rope.at(q, cache.positions), rope.at(k, cache.positions)
    out = []
    for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s)):
        c.append(layer, k[r:r + 1], v[r:r + 1])
        out.append(attention(q[r:r + 1], c, layer, p, scale, window, softcap))
    return torch.cat(out)


class FusedParts:
    """A layer whose projections of one input run as one fused weight, each part kept as a
    weight slot of its own beside it (the parts' pages released): LoRA trains and serves
    each by its tensor name, and a part swapped re-fuses from `parts`. `part_attrs` names
    the slots in fused order."""

    part_attrs: list[str]

    @property
    def parts(self) -> list:
        return [getattr(self, a) for a in self.part_attrs]


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

    # rows a window memory holds beyond its window: a step may append slack + 1 rows and
    # a rewind reach back slack positions. As large as native_chunk because a native
    # call's cost is mostly per call at prefill (the bf16 route decodes each weight once
    # per call): Gemma-3 1536-token prefill in 257-row chunks 71 tok/s, in 512-row 166
    window_slack = 512 + 16   # one native chunk (512 rows) fits after a move that keeps the window from a 16-aligned row

    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """A cache for up to `capacity` positions, one memory per layer as its spec says
        (a sliding-window layer keeps only its window + window_slack rows); `cache_type`
        "f16" or "q8_0"; `rewindable`: every layer keeps every position, so any rewind
        works (benchmarks that rewind past a window)."""
        from fucina.models.cache import Q8Cache
        cap = cache_capacity(capacity, self.config.n_ctx_train, cache_type)
        mems = []
        for s in self.config.layers:
            geo = (cap, s.n_head_kv, s.head_dim, s.v_dim, cache_type, dtype)
            windowed = s.window and not rewindable
            mems.append(WindowKV(*geo, window=s.window, slack=self.window_slack) if windowed else KVMemory(*geo))
        return self.keep_hidden((Q8Cache if cache_type == "q8_0" else KVCache).of(mems, cap))

    mtp = None   # a multi-token-prediction head (models/mtp.py) drafting for this model, when attached

    def keep_hidden(self, cache: KVCache) -> KVCache:
        """With an MTP head attached, `cache` keeps every position's last hidden row (f32,
        n_embd a position): the head drafts from the trunk's state at the last position."""
        if self.mtp is not None:
            cache.hidden_rows = torch.zeros(cache.capacity, self.config.n_embd)
        return cache

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        """Per layer (kv_heads, head_dim) (an all-positions estimate; kv_bytes is exact)."""
        return [s.n_head_kv for s in self.config.layers], [s.head_dim for s in self.config.layers]

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        """What init_cache(capacity, cache_type=...) allocates, without allocating it."""
        per_value = 2.0 if cache_type == "f16" else 34 / 32
        total = 0.0
        for s in self.config.layers:
            rows = min(capacity, s.window + self.window_slack) if s.window else capacity
            total += rows * s.n_head_kv * (s.head_dim + s.v_dim) * per_value
        return int(total)

    @torch.inference_mode()
    def forward_step_batch(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Advance N caches by one token each in one weight pass; logits [N, n_vocab]."""
        if len(caches) != len(tokens) or not caches:
            raise FucinaError(f"forward_step_batch: {len(caches)} caches for {len(tokens)} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise KVCacheError("forward_step_batch: the same cache appears twice")
        for c in caches:
            c.reserve(1)
        x = self.embed(as_ids(tokens, self.config.n_vocab))
        ptrs = [self._native_cache(c) for c in caches]
        if self.residual_hooks:
            return self._hooked_batch(caches, tokens, x, ptrs)
        if all(p is not None for p in ptrs):
            x = x.float().contiguous()
            end = max(c.len for c in caches) + 1
            self.native_plan.run_batch(x, ptrs, [c.len for c in caches],
                                       [t.table(end) for t in self.rope_tables(max(c.capacity for c in caches))])
        else:
            batch = Ragged(caches)
            for i in range(self.config.n_layer):
                x = self.block(i, x, batch, 0)
        for r, c in enumerate(caches):
            if c.hidden_rows is not None:
                c.hidden_rows[c.len] = x[r]
            c.advance(1)
        return self.head(x)

    def _hidden(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        if cache.len != pos0:
            raise FucinaError(f"forward_step: cache holds {cache.len} positions, pos0 is {pos0}")
        ids = as_ids(tokens, self.config.n_vocab)
        cache.check_room(ids.numel())
        return self.run_layers(cache, self.embed(ids), pos0, ids)

    def run_layers(self, cache: KVCache, x: torch.Tensor, pos0: int,
                   ids: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over the embedded rows x [m, n_embd] at positions pos0.. (the cache
        at pos0, with room); the last layer's rows, also kept in `cache.hidden_rows` when
        the cache keeps them (a multi-token-prediction head drafts from them). `ids`, the
        rows' token ids, are what residual hooks (Engram) look up."""
        m = x.shape[0]
        ptrs = self._native_cache(cache)
        tables = [t.table(pos0 + m) for t in self.rope_tables(cache.capacity)] if ptrs is not None else None
        if ptrs is not None:
            x = x.float().contiguous()
        # chunks bound the step's scratch (~70 KB a row on Qwen3-0.6B) on long prompts and
        # fit a window memory's spare rows; each chunk attends to what the previous wrote
        step, outs = min(self.native_chunk, cache.step_limit()), []
        for s in range(0, m, step):
            n = min(step, m - s)
            cache.reserve(n)
            h = x[s:s + n]
            if self.residual_hooks:
                if ids is None:
                    raise FucinaError("a residual hook needs the rows' token ids (run_layers(..., ids=))")
                h = self._hooked_rows(h, ids[s:s + n], cache, pos0 + s, ptrs, tables)
            elif ptrs is not None:
                self.native_plan.run(h, ptrs, pos0 + s, tables)    # in place
            else:
                for i in range(self.config.n_layer):
                    h = self.block(i, h, cache, pos0 + s)
            outs.append(h)
            cache.advance(n)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if cache.hidden_rows is not None:
            cache.hidden_rows[pos0:pos0 + m] = out
        return out

    # -- residual hooks: systems that add to the residual stream entering a layer ----------
    # {layer: (hook, ...)}; a hook(layer, x [m, n_embd], ids [m], pos0, cache) returns the
    # residual to continue with (x + its contribution). Empty (the class default): no hook
    # is looked up and the native step runs every layer in one call, as without the seam.
    # With hooks the native step runs the layer ranges between hooked layers (one plan each,
    # `DecoderPlan.layer_range`) and the hooks run in torch between them; the torch blocks
    # (and the training forward) call them before the hooked block. A hook that also runs
    # natively (`native_hook(layer)` -> (fk_res_hook address, context) | None, and
    # `bind(ids, pos0, cache)` -> bool before each step) runs inside the one native step
    # instead (`DecoderPlan.with_hooks`): one call a token, the same bits as the cut step.
    residual_hooks: dict[int, tuple] = {}

    def add_residual_hook(self, layer: int, hook) -> None:
        if not 0 <= layer < self.config.n_layer:
            raise FucinaError(f"residual hook: layer {layer} out of range [0, {self.config.n_layer})")
        hooks = dict(self.residual_hooks)
        hooks[layer] = hooks.get(layer, ()) + (hook,)
        self.residual_hooks, self._hook_plans, self._hook_step = hooks, None, None

    def remove_residual_hooks(self, hook=None) -> None:
        """Remove `hook` from every layer (None: every hook)."""
        hooks = {i: tuple(h for h in hs if hook is not None and h is not hook)
                 for i, hs in self.residual_hooks.items()}
        self.residual_hooks, self._hook_plans = {i: hs for i, hs in hooks.items() if hs}, None
        self._hook_step = None

    def bind_ids(self, pos0: int, ids: torch.Tensor) -> None:
        """The step's token ids at positions pos0.., for a family whose blocks route by them
        (deepseek4's hash-routed layers): its run_layers binds them, and so does the trainer,
        which calls the blocks itself."""

    def run_hooks(self, layer: int, x: torch.Tensor, ids: torch.Tensor, pos0: int, cache) -> torch.Tensor:
        for hook in self.residual_hooks.get(layer, ()):
            x = hook(layer, x, ids, pos0, cache)
        return x

    def _hook_ranges(self) -> "list[tuple[int, int, kernels.DecoderPlan]] | None":
        """(lo, hi, plan over lo..hi-1) between the hooked layers; None: no cut plans."""
        plans = getattr(self, "_hook_plans", None)
        if plans is None:
            cuts = sorted({0, *self.residual_hooks, self.config.n_layer})
            plans = [(lo, hi, self.native_plan.layer_range(lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
            plans = self._hook_plans = plans if all(p is not None for _, _, p in plans) else []
        return plans or None

    def _in_step_plan(self) -> "tuple[kernels.DecoderPlan, tuple] | None":
        """(one plan over every layer with the hooks inside it, the hooks to bind before each
        step); None when some hooked layer has a hook that does not run natively (now: asked
        again next step, a hook may turn native) or the plan cannot take hooks (kept)."""
        got = getattr(self, "_hook_step", None)
        if got is None:
            native = {}
            for i, hs in self.residual_hooks.items():
                nh = getattr(hs[0], "native_hook", None) if len(hs) == 1 else None   # one hook slot a layer
                native[i] = nh(i) if nh is not None else None
                if native[i] is None:
                    return None
            plan = self.native_plan.with_hooks(native)
            hooks = tuple(dict.fromkeys(h for hs in self.residual_hooks.values() for h in hs))
            got = self._hook_step = (plan, hooks) if plan is not None else ()
        return got or None

    def prefetch_hooks(self, ids: torch.Tensor, pos0: int, cache) -> None:
        """Hand a step's ids, before layer 0 runs, to the hooks that read ahead (an Engram
        table in a mapped file starts reading the step's rows)."""
        for hook in dict.fromkeys(h for hs in self.residual_hooks.values() for h in hs):
            if hasattr(hook, "prefetch"):
                hook.prefetch(ids, pos0, cache)

    def _hooked_rows(self, h, ids, cache, pos0, ptrs, tables) -> torch.Tensor:
        inner = self._in_step_plan() if ptrs is not None else None
        if inner is not None and all(hook.bind(ids, pos0, cache) for hook in inner[1]):
            inner[0].run(h, ptrs, pos0, tables)     # in place, the hooks inside
            return h
        self.prefetch_hooks(ids, pos0, cache)
        ranges = self._hook_ranges() if ptrs is not None else None
        if ranges is None:
            for i in range(self.config.n_layer):
                h = self.block(i, self.run_hooks(i, h, ids, pos0, cache), cache, pos0)
            return h
        for lo, hi, plan in ranges:
            h = self.run_hooks(lo, h, ids, pos0, cache).float().contiguous()
            plan.run(h, ptrs.layer_range(lo, hi), pos0, tables)
        return h

    def _hooked_batch(self, caches, tokens, x, ptrs) -> torch.Tensor:
        """forward_step_batch with residual hooks: each row's hooks see its own cache."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        pos = [c.len for c in caches]

        def hooks(i, x):
            if i not in self.residual_hooks:
                return x
            return torch.cat([self.run_hooks(i, x[j:j + 1], ids[j:j + 1], pos[j], c) for j, c in enumerate(caches)])

        ranges = self._hook_ranges() if all(p is not None for p in ptrs) else None
        if ranges is not None:
            end = max(pos) + 1
            tables = [t.table(end) for t in self.rope_tables(max(c.capacity for c in caches))]
            x = x.float().contiguous()
            for lo, hi, plan in ranges:
                x = hooks(lo, x).float().contiguous()
                plan.run_batch(x, [p.layer_range(lo, hi) for p in ptrs], pos, tables)
        else:
            batch = Ragged(caches)
            for i in range(self.config.n_layer):
                x = self.block(i, hooks(i, x), batch, 0)
        for c in caches:
            c.advance(1)
        return self.head(x)

    # -- the native layer step (kernels.DecoderPlan): every block in one call ---------------

    native_plan: "kernels.DecoderPlan | None" = None   # set by families that can build one
    native_chunk = 512                                  # rows per native call on long prompts
    # False: the torch blocks (reference, A/B); FUCINA_NATIVE_STEP=0 sets it for a process
    use_native_step = os.environ.get("FUCINA_NATIVE_STEP", "1") != "0"

    def refresh_plans(self) -> None:
        """Rebuild the native plans this model holds after its weights changed (a LoRA merged,
        an expert store attached, weights laid out anew); a family holding more overrides."""
        if self.native_plan is not None:
            self.native_plan = self.build_plan()

    def rope_tables(self, capacity: int = 0) -> list["Rope"]:
        """The RoPE tables the plan's layers index (families with two override this; a
        family whose variant depends on the context length reads `capacity`)."""
        return [self.rope]

    def _native_cache(self, cache: KVCache) -> "kernels.KVPointers | None":
        """The cache's pointer table when the native step serves this call, else None
        (a q8_0 cache, or any layer without a native memory, keeps the torch path)."""
        if self.native_plan is None or not self.use_native_step:
            return None
        table = cache.native_table()
        if table is None or not self.native_plan.fits(table):
            return None
        return table

    @torch.inference_mode()
    def forward_step(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        x = self._hidden(cache, tokens, pos0)
        return self.head(x[-1:])[0]

    @torch.inference_mode()
    def forward_step_all_logits(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        return self.head(self._hidden(cache, tokens, pos0))

    @torch.inference_mode()
    def forward_hidden(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        """As forward_step, returning every new position's last-layer row [m, n_embd]
        (before the final norm): what embeddings pool (text.retrieval)."""
        return self._hidden(cache, tokens, pos0)

    def forward_last_logits(self, tokens: Tokens) -> torch.Tensor:
        n = len(tokens)
        return self.forward_step(self.init_cache(max(n, 1)), tokens, 0)


def attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
