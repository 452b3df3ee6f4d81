"""LLaDA: llama's block (NORM RoPE, no biases) as a bidirectional text-diffusion denoiser
(models/diffusion.py); position p reads its own row's logits."""
from __future__ import annotations

from fucina.models import llama
from fucina.models.diffusion import Denoiser
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.llada import TENSORS, Config, Schema  # noqa: F401


class Model(Denoiser, llama.Model):
    schema = Schema
