"""LoRA adapter files in llama.cpp's format, and applying them at inference.

The file (what llama.cpp's `--lora` loads, src/llama-adapter.cpp): `general.type =
adapter`, `general.architecture` = the base's, `adapter.type = lora`, `adapter.lora.alpha`
(f32); for each adapted weight `<name>.lora_a` with GGML ne [in, r] and `<name>.lora_b`
with ne [r, out] (numpy [r, in] and [out, r]: PEFT's A and B). llama.cpp scales by
alpha / r, r read from lora_b — and silently by 1.0 when alpha is absent, which is why
reading one without alpha is an error here.

At inference (this module sits below `text`, so `fucina.load(lora=...)` can use it) an
adapter is merged: each adapted weight becomes a Q8_0 copy of W + scale * (alpha / r) * B A
(F16 with FUCINA_LORA_MERGE=F16), every other weight stays in its GGUF type, and the
model's native layer plan is rebuilt over the result, so the native step keeps running.
Unmerged application would need a LoRA hook in the native step (csrc/, not ours to edit).
Q8_0, not F16, because the F16 route decodes ~6x slower than Q4_1 on SmolLM2 with every
projection adapted (12.5 vs 80 tok/s, 1 thread) while Q8_0 stays close and keeps the
adapter's effect (the same held-out accuracy as F16 in BENCHMARK.md); llama.cpp applies
adapters unmerged in f32, so Q8_0 merging is a small, measured approximation of that.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fucina.errors import FucinaError
from fucina.gguf import GGMLType, GGUFFile
from fucina.weights.experts import ExpertStack
from fucina.weights.linear import LinearWeight


class LoRAError(FucinaError):
    """Bad LoRA configuration, or an adapter that does not fit the model."""


def layer_weights(layer) -> dict[str, LinearWeight]:
    """The layer's LinearWeight attributes by attribute name."""
    return {k: v for k, v in vars(layer).items() if isinstance(v, LinearWeight)}


def weight_owners(layer) -> list[object]:
    """The layer and the objects one attribute down that hold its weights (deepseek2's MLA
    weights sit in `layer.attn`, a MoE layer's expert stacks in `layer.experts`). An expert
    stack is a weight, not an owner: its `whole` is the same bytes as its experts."""
    return [layer] + [v for v in vars(layer).values()
                      if hasattr(v, "__dict__") and not isinstance(v, (LinearWeight, ExpertStack, torch.Tensor, type))]


def weight_slots(layer) -> list[tuple[object, str, LinearWeight]]:
    """(owner, attribute, weight) for every LinearWeight of the layer's `weight_owners`."""
    return [(o, k, v) for o in weight_owners(layer) for k, v in vars(o).items() if isinstance(v, LinearWeight)]


@dataclass
class Adapter:
    arch: str
    alpha: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]   # base tensor name -> (A, B)
    path: str = ""

    def delta(self, name: str, scale: float = 1.0) -> torch.Tensor:
        a, b = self.pairs[name]
        return (b @ a) * (scale * self.alpha / a.shape[0])


def read_adapter(path: str | os.PathLike) -> Adapter:
    """Read and validate the file on its own (read against a model with `check`)."""
    try:
        f = GGUFFile(path)
    except OSError as e:
        raise LoRAError(f"cannot read adapter {path}: {e}") from e
    m = f.metadata
    where = str(path)
    if m.get("general.type") != "adapter":
        raise LoRAError(f"{where}: general.type is {m.get('general.type')!r}, not 'adapter' "
                        "(is this a model rather than a LoRA adapter?)")
    if m.get("adapter.type") != "lora":
        raise LoRAError(f"{where}: adapter.type is {m.get('adapter.type')!r}, not 'lora'")
    alpha = m.get("adapter.lora.alpha")
    if alpha is None:
        raise LoRAError(f"{where}: adapter.lora.alpha is missing; its strength is unknown "
                        "(llama.cpp would silently apply it at scale 1.0)")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tname, t in f.tensors.items():
        for suffix in (".lora_a", ".lora_b"):
            if tname.endswith(suffix):
                if len(t.ne) != 2:
                    raise LoRAError(f"{where}: {tname} is not a matrix")
                mat = LinearWeight.from_tensor(t).dequantize().clone()
                halves.setdefault(tname[:-len(suffix)], {})[suffix] = mat
                break
        else:
            raise LoRAError(f"{where}: unexpected tensor {tname!r} (only .lora_a/.lora_b)")
    pairs = {}
    for base, h in halves.items():
        if set(h) != {".lora_a", ".lora_b"}:
            raise LoRAError(f"{where}: {base} has only {', '.join(h)}")
        a, b = h[".lora_a"], h[".lora_b"]
        if a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: {base}: lora_a rank {a.shape[0]} != lora_b rank {b.shape[1]} "
                            "(A and B transposed?)")
        pairs[base] = (a, b)
    if not pairs:
        raise LoRAError(f"{where}: no LoRA tensors")
    arch = f.architecture
    f.close()
    return Adapter(arch, float(alpha), pairs, where)


def model_weights(model) -> dict[str, LinearWeight]:
    """Every unfused per-layer LinearWeight of the model by GGUF tensor name."""
    out = {}
    for L in model.layers:
        for _, _, w in weight_slots(L):
            if "+" not in w.name:
                out[w.name] = w
    return out


def check(adapter: Adapter, model) -> dict[str, LinearWeight]:
    """The model weights the adapter changes; a clear error when it was made for another model."""
    arch = model.config.arch
    if adapter.arch != arch:
        raise LoRAError(f"{adapter.path}: adapter is for architecture {adapter.arch!r}, "
                        f"the model is {arch!r}")
    weights = model_weights(model)
    out = {}
    for name, (a, b) in adapter.pairs.items():
        w = weights.get(name)
        if w is None:
            hint = " (token embeddings / output adapters are not supported)" \
                if name in ("token_embd.weight", "output.weight") else " (wrong base model?)"
            raise LoRAError(f"{adapter.path}: {name} is not a weight of this model{hint}")
        if a.shape[1] != w.in_features or b.shape[0] != w.out_features:
            raise LoRAError(f"{adapter.path}: {name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not "
                            f"fit the weight [{w.out_features}, {w.in_features}] (wrong base model?)")
        out[name] = w
    return out


def merged_weight(w: LinearWeight, delta: torch.Tensor, qtype: GGMLType = GGMLType.F16) -> LinearWeight:
    from fucina.quant import quantize

    raw = quantize(w.dequantize() + delta, int(qtype)).reshape(-1)
    out = LinearWeight(raw, qtype, w.out_features, w.in_features, w.name)
    from fucina.kernels import attach
    attach(out)
    return out


#: the type merged weights are kept in at inference; FUCINA_LORA_MERGE=F16 for the closer one
MERGE_TYPE = GGMLType[os.environ.get("FUCINA_LORA_MERGE", "Q8_0")]


def apply_adapters(model, adapters: list[tuple[Adapter, float]], qtype: GGMLType | None = None) -> int:
    """Merge adapters (each with its --lora-scale) into Q8_0 (or `qtype`) copies of the weights
    they change; rebuild fused weights and the native plan. Returns the number of weights changed."""
    deltas: dict[str, torch.Tensor] = {}
    for adapter, scale in adapters:
        for name in check(adapter, model):
            d = adapter.delta(name, scale)
            deltas[name] = deltas[name] + d if name in deltas else d
    if not deltas:
        return 0
    for L in model.layers:
        slots = weight_slots(L)
        changed = {}
        for owner, attr, w in slots:
            if w.name in deltas:
                qt = qtype if qtype is not None else MERGE_TYPE   # F32 is 0: not `or`
                changed[w.name] = merged_weight(w, deltas[w.name], qt if w.in_features % 32 == 0
                                                else GGMLType.F16)
                setattr(owner, attr, changed[w.name])
        if not changed:
            continue
        by_name = {w.name: w for _, _, w in weight_slots(L) if "+" not in w.name}
        for owner, attr, w in slots:   # fused weights that contain a changed part
            parts = w.name.split("+")
            if len(parts) > 1 and any(p in changed for p in parts):
                group = [by_name[p] for p in parts]
                same = len({g.qtype for g in group}) == 1
                setattr(owner, attr, LinearWeight.fuse(group) if same else None)
    if getattr(model, "native_plan", None) is not None:
        model.native_plan = model.build_plan()
    return len(deltas)


def with_scales(paths: list[str], scales: list[float] | None) -> list[tuple[str, float]]:
    """Pair each adapter path with its scale (default 1.0; one scale applies to all)."""
    scales = list(scales or [])
    if len(scales) == 1 and len(paths) > 1:
        scales = scales * len(paths)
    if scales and len(scales) != len(paths):
        raise FucinaError(f"{len(scales)} --lora-scale values for {len(paths)} adapters")
    return list(zip(paths, scales or [1.0] * len(paths)))


def load_adapters(model, paths: list[str], scales: list[float] | None = None) -> int:
    """Read, check and merge `paths` into `model`; returns the number of weights changed."""
    return apply_adapters(model, [(read_adapter(p), s) for p, s in with_scales(paths, scales)])
