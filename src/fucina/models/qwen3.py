"""Qwen3 (dense): the llama block with per-head q/k RMSNorm and NEOX RoPE; the output
projection is usually tied to the embeddings."""
from __future__ import annotations

from fucina.models import llama
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen3 import TENSORS, Config, Schema  # noqa: F401


class Model(llama.Model):
    schema = Schema
