"""Merge LoRA adapters into a base GGUF and write a standalone model.

Every adapted weight becomes W + scale * (alpha / r) * B A (dequantized, merged in f32) and
is re-encoded with `fucina.quant.quantize`. `keep`: every tensor the adapters do not touch
keeps its bytes, the merged ones are written F16 (or `merged_type` Q8_0, or "base" = the
base tensor's own type); F16, Q8_0, Q4_K_M: every matrix re-encoded to that type
(llama.cpp's Q4_K_M mix). Metadata (tokenizer, chat template, hyperparameters) is copied key
for key.

The encoders follow ggml's reference quantizers (gguf-py's for Q4_0/1, Q5_0/1, Q8_0;
quantize_row_*_ref for the K-quants), i.e. what llama-quantize writes without an
importance matrix; tests/test_train_export.py checks Q8_0 and Q4_K against llama-quantize.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from fucina.errors import FucinaError
from fucina.gguf import TYPE_SIZES, GGMLType, GGUFFile, TensorInfo
from fucina.train.adapters import Adapter, check
from fucina.weights import LinearWeight

T = GGMLType
EXPORT_TYPES = ("keep", "F16", "Q8_0", "Q4_K_M")
# Under `keep`, merged tensors default to F16: re-encoding W + dW to a 4-bit base's own grid
# rounds a LoRA's small dW back onto W's old values (SmolLM2 Q4_1, the BENCHMARK.md SFT task:
# held-out accuracy 65% merged as F16 or Q8_0, 0% re-encoded to Q4_1); "base" does it anyway.
MERGED_TYPES = ("F16", "Q8_0", "base")
_FILE_TYPE = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15}     # llama_ftype, general.file_type
# llama.cpp's fallback when a row does not split into 256-value super-blocks
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


class ExportError(FucinaError):
    """The export cannot be written as asked."""


def _q4_k_m_type(name: str, n_layer: int) -> GGMLType:
    """llama.cpp's Q4_K_M choice for one tensor (no imatrix): Q6_K for the output and, in
    the layers use_more_bits picks, attn_v and ffn_down; Q4_K elsewhere."""
    if name == "output.weight":
        return T.Q6_K
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i, n = int(parts[1]), n_layer
        if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2:
            return T.Q6_K
    return T.Q4_K


def target_type(t: TensorInfo, kind: str, n_layer: int) -> GGMLType:
    if kind == "keep" or len(t.ne) < 2 or t.name.endswith("_norm.weight"):
        return t.ggml_type
    want = {"F16": T.F16, "Q8_0": T.Q8_0}.get(kind) or _q4_k_m_type(t.name, n_layer)
    while t.ne[0] % TYPE_SIZES[want][0]:
        want = _FALLBACK.get(want, T.F16)
    return want


def _copy_metadata(src: str, w, file_type: int | None) -> None:
    import gguf

    r = gguf.GGUFReader(src)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type" and file_type is not None:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    if file_type is not None:
        w.add_file_type(file_type)


def export_merged(base_path: str | os.PathLike, model, adapters: list[tuple[Adapter, float]],
                  out: str | os.PathLike, kind: str = "keep", merged_type: str = "F16") -> dict:
    """Write `out`: the base with `adapters` merged, tensors typed per `kind`; under `keep`
    the merged tensors take `merged_type` ("F16", "Q8_0", or "base" = the base's own type)."""
    import gguf

    if kind not in EXPORT_TYPES:
        raise ExportError(f"unknown --type {kind!r} (choose from {', '.join(EXPORT_TYPES)})")
    if merged_type not in MERGED_TYPES:
        raise ExportError(f"unknown --merged-type {merged_type!r} (choose from {', '.join(MERGED_TYPES)})")
    if os.path.abspath(out) == os.path.abspath(base_path):
        raise ExportError("--out would overwrite the base model")
    deltas: dict[str, torch.Tensor] = {}
    for adapter, scale in adapters:
        for name in check(adapter, model):
            d = adapter.delta(name, scale)
            deltas[name] = deltas[name] + d if name in deltas else d
    f = GGUFFile(base_path)
    n_layer = model.config.n_layer
    tmp = str(out) + ".tmp"
    w = gguf.GGUFWriter(tmp, f.architecture)
    _copy_metadata(str(base_path), w, _FILE_TYPE.get(kind))
    stats = dict(merged=0, requantized=0, copied=0)
    for name, t in f.tensors.items():
        qt = target_type(t, kind, n_layer)
        if name in deltas and kind == "keep" and merged_type != "base":
            qt = target_type(t, merged_type, n_layer)
        if name not in deltas and qt is t.ggml_type:
            rows = t.n_elements // t.ne[0]
            if t.ggml_type in (T.F32, T.F16):
                arr = t.data.view(np.float32 if t.ggml_type is T.F32 else np.float16).reshape(t.shape)
                w.add_tensor(name, arr)
            else:
                w.add_tensor(name, t.data.reshape(rows, -1), raw_shape=(rows, t.data.size // rows),
                             raw_dtype=gguf.GGMLQuantizationType(int(t.ggml_type)))
            stats["copied"] += 1
            continue
        dense = LinearWeight.from_tensor(t).dequantize().reshape(t.shape)
        if name in deltas:
            dense = dense + deltas[name].reshape(t.shape)
            stats["merged"] += 1
        else:
            stats["requantized"] += 1
        _add_encoded(w, name, dense, qt)
    f.close()
    write_and_move(w, tmp, out)
    return stats


def write_replaced(base_path: str | os.PathLike, replace: dict[str, torch.Tensor], out) -> None:
    """Write `out`: the base file with the named tensors' bytes swapped for `replace`'s (same
    type and size: e.g. trained TQ2_0 blocks), every other tensor and the metadata verbatim."""
    import gguf

    if os.path.abspath(out) == os.path.abspath(base_path):
        raise ExportError("--out would overwrite the base model")
    f = GGUFFile(base_path)
    missing = sorted(set(replace) - set(f.tensors))
    if missing:
        f.close()
        raise ExportError(f"{base_path}: no tensor {missing[0]} to replace")
    tmp = str(out) + ".tmp"
    w = gguf.GGUFWriter(tmp, f.architecture)
    _copy_metadata(str(base_path), w, None)
    for name, t in f.tensors.items():
        rows = t.n_elements // t.ne[0]
        data = t.data
        if name in replace:
            new = replace[name].detach().contiguous().view(torch.uint8).reshape(-1).numpy()
            if new.size != data.size:
                f.close()
                raise ExportError(f"{name}: {new.size} bytes do not replace its {data.size}")
            data = new
        if t.ggml_type in (T.F32, T.F16):
            w.add_tensor(name, data.view(np.float32 if t.ggml_type is T.F32 else np.float16).reshape(t.shape))
        else:
            w.add_tensor(name, data.reshape(rows, -1), raw_shape=(rows, data.size // rows),
                         raw_dtype=gguf.GGMLQuantizationType(int(t.ggml_type)))
    write_and_move(w, tmp, out)
    f.close()


def write_and_move(w, tmp: str, out) -> None:
    """Finish writer w (at tmp) and move the file to out in one step."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def _add_encoded(w, name: str, dense: torch.Tensor, qt: GGMLType) -> None:
    import gguf

    if qt is T.F32:
        w.add_tensor(name, dense.numpy())
    elif qt is T.F16:
        w.add_tensor(name, dense.half().numpy())
    else:
        from fucina.quant import quantize
        q = quantize(dense.reshape(-1, dense.shape[-1]).numpy(), int(qt))
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType(int(qt)))
