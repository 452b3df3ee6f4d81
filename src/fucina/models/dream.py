"""Dream: Qwen2's block (Q, K, V biases, NEOX RoPE) as a bidirectional text-diffusion
denoiser (models/diffusion.py); position p reads row p - 1's logits (shift_logits)."""
from __future__ import annotations

from fucina.models import llama
from fucina.models.diffusion import Denoiser
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.dream import TENSORS, Config, Schema  # noqa: F401


class Model(Denoiser, llama.Model):
    schema = Schema
