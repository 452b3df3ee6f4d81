"""Writing LoRA adapters in llama.cpp's format (reading, checking and merging them at
inference lives in `fucina.weights.lora`, below the text layer that loads models)."""
from __future__ import annotations

import os

import torch

from fucina.weights.lora import (Adapter, LoRAError, apply_adapters, check, load_adapters,
                                 model_weights, read_adapter)

__all__ = ["Adapter", "LoRAError", "apply_adapters", "check", "load_adapters", "model_weights",
           "read_adapter", "write_adapter"]


def write_adapter(path: str | os.PathLike, arch: str, alpha: float,
                  pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str = "") -> str:
    import gguf

    tmp = str(path) + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    if name:
        w.add_name(name)
    for base, (a, b) in pairs.items():
        w.add_tensor(base + ".lora_a", a.detach().float().contiguous().numpy())
        w.add_tensor(base + ".lora_b", b.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return str(path)
