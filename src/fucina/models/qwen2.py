"""Qwen2 / Qwen2.5 (dense): the llama block with biases on Q, K and V and NEOX RoPE."""
from __future__ import annotations

from fucina.models import llama
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen2 import TENSORS, Config, Schema  # noqa: F401


class Model(llama.Model):
    schema = Schema
