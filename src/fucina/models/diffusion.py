"""Text diffusion on a dense block (dream: Qwen2's, llada: llama's): the model reads a
whole canvas at once, every row attending to every row, and returns logits for the rows
asked for; the denoising loop (fucina.text.diffusion) decides which masked rows to fill.

A canvas pass is one forward over positions 0..n-1 into a scratch cache of n rows (the
cache is rewritten every pass, never advanced), in one native call: the native step's
attention takes the layer's `bidir` flag (every query row reads keys 0..m-1), so no chunk
boundary may split a canvas. The autoregressive entry points raise: a denoiser has no
next token.
"""
from __future__ import annotations

import torch

from fucina.errors import FucinaError, KVCacheError
from fucina.models.base import Tokens, as_ids
from fucina.models.cache import KVCache


class Denoiser:
    """Mixed into a llama-skeleton Model before it: non-causal attention, `forward_canvas`."""

    causal = False
    diffusion = True
    supports_batch = False

    def canvas_cache(self, n: int) -> KVCache:
        if n > self.config.n_ctx_train:
            raise KVCacheError(f"a canvas of {n} positions exceeds the model's context of {self.config.n_ctx_train}")
        return self.init_cache(n)

    @torch.inference_mode()
    def forward_canvas(self, tokens: Tokens, cache: KVCache | None = None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(rows), n_vocab] (every row when None) of the canvas `tokens` at
        positions 0..n-1, attending both ways. `cache`: scratch of capacity >= n (reused
        across passes; its contents are overwritten)."""
        ids = as_ids(tokens, self.config.n_vocab)
        n = ids.numel()
        if cache is None or cache.capacity < n:
            cache = self.canvas_cache(n)
        cache.reset()
        x = self.embed(ids)
        ptrs = self._native_cache(cache)
        if ptrs is not None:
            x = x.float().contiguous()
            self.native_plan.run(x, ptrs, 0, [t.table(n) for t in self.rope_tables(cache.capacity)])
        else:
            for i in range(self.config.n_layer):
                x = self.block(i, x, cache, 0)
        if rows is not None:
            x = x[rows]
        return self.head(x)

    def _autoregressive(self, *_a, **_k):
        raise FucinaError(f"{self.config.arch} is a diffusion model: it denoises a canvas "
                          "(fucina run MODEL --canvas N --diffusion-steps S ...), it has no next-token step")

    forward_step = forward_step_all_logits = forward_step_batch = forward_last_logits = _autoregressive
