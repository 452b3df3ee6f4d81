"""diffusion-gemma: Gemma 4's transformer (this module reuses gemma4's layers and blocks)
as a block text-diffusion model. One weight set, two passes:

- `encode_step(cache, ids, pos0)`: the causal pass over the prompt, then over every
  committed canvas. It exists for its K/V: the rows are appended and the cache
  advanced, no logits are computed; each layer's output is scaled by its
  `enc_layer_output_scale`.
- `canvas_forward(cache, ids, sc)`: one bidirectional denoiser pass over a canvas of C
  positions at [P, P + C), P = cache.len. The canvas's K/V are written into the cache
  past its length WITHOUT advancing it (the next pass overwrites them; the cache is
  read-only to the caller); every canvas row attends to keys [lo, P + C) with lo = 0 on
  global layers and P + 1 - window on sliding-window layers (the last window - 1 prompt
  positions and the whole canvas); each layer's output is scaled by its
  `layer_output_scale`; logits for every row (soft-capped). The canvas embedding is
  rms_norm(embed * sqrt(n_embd) + SC) without a weight, SC the self-conditioning
  signal: the previous step's softmax(logits / t) as a probability-weighted sum of
  embedding rows (times sqrt(n_embd)) through the `self_cond_*` GeGLU MLP; zero on the
  first step (the norm still applies). An SC signal on a file without that MLP is an
  InvalidArgument.

The loop that drives them (the entropy-bound sampler, block-autoregressive commit) is
fucina.text.diffusion_gemma. The passes run the torch blocks (no native plan: the two
passes scale the layers differently and the canvas attends to a range of its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fucina.errors import ContextFull, FucinaError, InvalidArgument
from fucina.gguf import GGUFFile
from fucina.models import gemma4, llama
from fucina.models.base import Tensors, as_ids, linear, rms_norm, vector
from fucina.models.cache import KVCache
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.diffusion_gemma import Config, EbParams, Schema  # noqa: F401


@dataclass
class ScSignal:
    """Sparse per-row probabilities for the next step's self-conditioning: row r's
    candidates are ids/probs[offsets[r]:offsets[r + 1]] (renormalized over the kept mass)."""
    ids: np.ndarray       # int64 [N]
    probs: np.ndarray     # float32 [N]
    offsets: np.ndarray   # int64 [C + 1]

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


class Model(gemma4.Model):
    schema = Schema
    diffusion = True           # no next-token step: fucina.text routes it to its own loop
    block_diffusion = True     # ... and it is this family's loop, not dream/llada's
    supports_batch = False

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        super().__init__(f, checked)
        t, c = self.checked, self.config
        self.enc_scale = [float(vector(t[f"blk.{i}.enc_layer_output_scale.weight"])) for i in range(c.n_layer)]
        self.sc_mlp = None
        if "self_cond_pre_norm.weight" in t:
            self.sc_mlp = (vector(t["self_cond_pre_norm.weight"]), linear(t["self_cond_gate.weight"]),
                           linear(t["self_cond_up.weight"]), linear(t["self_cond_down.weight"]))
        self._canvas = False    # which pass the blocks are running

    def build_plan(self):
        return None

    @property
    def has_self_conditioning(self) -> bool:
        return self.sc_mlp is not None

    # -- the two passes ----------------------------------------------------------------
    @torch.inference_mode()
    def encode_step(self, cache: KVCache, tokens, pos0: int) -> None:
        """Append `tokens` (the prompt or a committed canvas) at pos0 == cache.len, causally;
        the cache advances, nothing is returned."""
        ids = as_ids(tokens, self.config.n_vocab)
        if pos0 != cache.len:
            raise InvalidArgument(f"encode_step at position {pos0}, but the cache holds {cache.len}")
        cache.check_room(ids.numel())
        self._canvas = False
        self.run_layers(cache, self.embed(ids), pos0, ids)

    @torch.inference_mode()
    def canvas_forward(self, cache: KVCache, tokens, sc: ScSignal | None = None) -> torch.Tensor:
        """Logits [C, n_vocab] of one bidirectional pass over the canvas at [cache.len,
        cache.len + C); cache.len is unchanged on return."""
        c = self.config
        ids = as_ids(tokens, c.n_vocab)
        C, P = ids.numel(), cache.len
        if P + C > cache.capacity:
            raise ContextFull(f"{P} cached + a canvas of {C} exceed the cache's {cache.capacity} positions")
        if C > cache.step_limit():
            raise FucinaError(f"a canvas of {C} exceeds what one pass may write ({cache.step_limit()} rows)")
        if sc is not None and self.sc_mlp is None:
            raise InvalidArgument("this diffusion-gemma file has no self-conditioning MLP (self_cond_*): "
                                  "pass no signal")
        if sc is not None and sc.rows != C:
            raise InvalidArgument(f"the self-conditioning signal has {sc.rows} rows for a canvas of {C}")
        x = self.tok_embd.rows(ids).float() * self.embed_scale
        if sc is not None:
            x = x + self._self_condition(sc)
        x = rms_norm(x, None, c.rms_eps)
        cache.reserve(C)
        self._canvas = True
        try:
            for i in range(c.n_layer):
                x = self.block(i, x, cache, P)
        finally:
            self._canvas = False
        return self.head(x)

    def _self_condition(self, sc: ScSignal) -> torch.Tensor:
        pre, gate, up, down = self.sc_mlp
        counts = torch.from_numpy(np.diff(sc.offsets))
        rows = self.tok_embd.rows(torch.from_numpy(sc.ids)).float() * torch.from_numpy(sc.probs)[:, None]
        soft = torch.zeros(sc.rows, self.config.n_embd).index_add_(
            0, torch.repeat_interleave(torch.arange(sc.rows), counts), rows) * self.embed_scale
        h = rms_norm(soft, pre, self.config.rms_eps)
        return down(llama.ACTS[self.act](gate(h)) * up(h))

    # -- the blocks: gemma4's, scaled per pass; the canvas's own attention ---------------
    def block(self, i: int, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        L = self.layers[i]
        h = llama.Model.block(self, i, x, cache, pos0) if L.experts is None else self._moe_block(i, L, x, cache, pos0)
        return h * (L.out_scale if self._canvas else self.enc_scale[i])

    def mixer(self, i: int, L, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        if not self._canvas:
            return super().mixer(i, L, x, cache, pos0)
        c, s, m = self.config, self.config.layers[i], x.shape[0]
        q, k, v = L.project(x)
        rope = self.rope_tables()[s.rope]
        q = rope(rms_norm(q.reshape(m, s.n_head, s.head_dim), L.q_norm, c.rms_eps), pos0)
        if k is not None:
            k = rms_norm(k.reshape(m, s.n_head_kv, s.head_dim), L.k_norm, c.rms_eps)
            v = rms_norm(v.reshape(m, s.n_head_kv, s.head_dim), None, c.rms_eps)
            cache.append(i, rope(k, pos0), v)       # at cache.len == pos0, not advanced
        lo = max(0, pos0 + 1 - s.window) if s.window else 0
        keys, vals = cache.span(c.kv_source(i), lo, pos0 + m)
        return L.wo(bidirectional(q, keys, vals))

    # -- no next-token step ---------------------------------------------------------------
    def _autoregressive(self, *_a, **_k):
        raise FucinaError(f"{self.config.arch} is a block text-diffusion model: it denoises canvases "
                          "(fucina run MODEL, llm.generate), it has no next-token step")

    forward_step = forward_step_all_logits = forward_step_batch = forward_last_logits = _autoregressive


def bidirectional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every query row [m, heads, d] over every key row [n, kv_heads, d], unscaled (Gemma 4
    attends with scale 1), GQA by groups; [m, heads * d]."""
    m, n_head, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], scale=1.0,
                                         enable_gqa=k.shape[1] != n_head)[0]
    return out.transpose(0, 1).reshape(m, n_head * d)
