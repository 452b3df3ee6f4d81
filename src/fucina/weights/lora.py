"""LoRA adapter files in llama.cpp's format, and applying them at inference.

The file (what llama.cpp's `--lora` loads, src/llama-adapter.cpp): `general.type =
adapter`, `general.architecture` = the base's, `adapter.type = lora`, `adapter.lora.alpha`
(f32); for each adapted weight `<name>.lora_a` with GGML ne [in, r] and `<name>.lora_b`
with ne [r, out] (numpy [r, in] and [out, r]: PEFT's A and B). llama.cpp scales by
alpha / r, r read from lora_b — and silently by 1.0 when alpha is absent, which is why
reading one without alpha is an error here.

At inference (this module sits below `text`, so `fucina.load(lora=...)` can use it) an
adapter is applied unmerged, as llama.cpp does: each adapted weight becomes a `LoRALinear`
over the frozen one (its GGUF type and kernel unchanged) with A [r, in] and
Bt = (scale * alpha / r * B)^T [r, out] in f32, and y = x W^T + (x A^T) Bt. The native
step reads them from the plan (csrc/fk_plan.h fk_lin lora_a/lora_b/lora_r) and adds the
update per row after the weight's matmul (step_impl.inc step_lora: batch-invariant);
a fused QKV / gate-up weight gets its parts' A stacked and each part's Bt in its own
rank rows and output columns; several adapters on one weight concatenate along r.
FUCINA_LORA_MERGE=Q8_0|F16|F32 (or apply_adapters' `qtype`) merges instead: each adapted
weight becomes a copy of W + scale * (alpha / r) * B A in that type (Q8_0 rounds the
adapter a little; F16 decodes ~2.5x slower). Unmerged decodes as fast as merged Q8_0 on
SmolLM2 with all seven projections at r 16 and prefills ~25% slower (BENCHMARK.md,
"Unmerged LoRA in the native step").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from fucina.errors import FucinaError
from fucina.gguf import GGMLType, GGUFFile
from fucina.weights.experts import ExpertStack
from fucina.weights.linear import LinearWeight
from fucina.weights.ptqtp import PtqtpWeight


class LoRAError(FucinaError):
    """Bad LoRA configuration, or an adapter that does not fit the model."""


def layer_weights(layer) -> dict[str, LinearWeight]:
    """The layer's LinearWeight attributes by attribute name."""
    return {k: v for k, v in vars(layer).items() if isinstance(v, LinearWeight)}


def weight_owners(layer) -> list[object]:
    """The layer and the objects one attribute down that hold its weights (deepseek2's MLA
    weights sit in `layer.attn`, a MoE layer's expert stacks in `layer.experts`). An expert
    stack is a weight, not an owner: its `whole` is the same bytes as its experts; so is a
    PTQTP weight (its `stacked` planes are one weight, not one to adapt)."""
    return [layer] + [v for v in vars(layer).values()
                      if hasattr(v, "__dict__")
                      and not isinstance(v, (LinearWeight, ExpertStack, PtqtpWeight, torch.Tensor, type))]


def ptqtp_names(layer) -> list[str]:
    """The layer's PTQTP-decorated weights (fucina quantize --ptqtp), by name."""
    return [v.name for o in weight_owners(layer) for v in vars(o).values() if isinstance(v, PtqtpWeight)]


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


#: FUCINA_LORA_MERGE=Q8_0|F16|F32 merges adapters into copies of that type; unset: unmerged
MERGE_TYPES = ("Q8_0", "F16", "F32")


def env_merge_type() -> GGMLType | None:
    """FUCINA_LORA_MERGE: the type adapters are merged into (unset: unmerged)."""
    name = os.environ.get("FUCINA_LORA_MERGE", "")
    if name and name not in MERGE_TYPES:
        raise LoRAError(f"FUCINA_LORA_MERGE={name!r}: expected one of {', '.join(MERGE_TYPES)} (or unset: unmerged)")
    return GGMLType[name] if name else None
MAX_RANK = 1024   # csrc/fk_plan.h FK_LORA_MAX_R: the adapters' ranks summed per weight


class LoRALinear(LinearWeight):
    """A frozen weight (any GGUF type, its kernel unchanged) plus an unmerged LoRA:
    y = x W^T + (x A^T) Bt, A [r, in] and Bt = (scale B)^T [r, out] in f32. The native plan
    reads `lora` (kernels.DecoderPlan); `dequantize` gives the adapted matrix."""

    def __init__(self, base: LinearWeight, a: torch.Tensor, bt: torch.Tensor):
        self.__dict__.update(vars(base))
        self.base = base
        self.lora = (a.float().contiguous(), bt.float().contiguous())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        a, bt = self.lora
        return self.base.linear(x) + (x.float() @ a.T) @ bt

    __call__ = linear

    def dequantize(self) -> torch.Tensor:
        a, bt = self.lora
        return self.base.dequantize() + bt.T @ a


def with_lora(w: LinearWeight, a: torch.Tensor, bt: torch.Tensor, where: str = "") -> LinearWeight:
    """w with the LoRA (a, bt) added; one already on w is kept (ranks concatenate)."""
    if isinstance(w, LoRALinear):
        a, bt, w = torch.cat([w.lora[0], a]), torch.cat([w.lora[1], bt]), w.base
    if a.shape[0] > MAX_RANK:
        raise LoRAError(f"{where or w.name}: adapters of total rank {a.shape[0]} > {MAX_RANK} on one weight; "
                        "merge them instead (FUCINA_LORA_MERGE=Q8_0)")
    return LoRALinear(w, a, bt)


def fused_lora(parts: list[LinearWeight]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The parts' LoRAs as one over their fused weight: A stacked along r, each part's Bt in
    its rank rows and output columns, zeros elsewhere; None when no part has one."""
    loras = [(getattr(p, "lora", None), p.out_features) for p in parts]
    if all(lo is None for lo, _ in loras):
        return None
    k, n = parts[0].in_features, sum(p.out_features for p in parts)
    r = sum(lo[0].shape[0] for lo, _ in loras if lo is not None)
    a, bt = torch.zeros(r, k), torch.zeros(r, n)
    r0 = c0 = 0
    for lo, width in loras:
        if lo is not None:
            ra = lo[0].shape[0]
            a[r0:r0 + ra] = lo[0]
            bt[r0:r0 + ra, c0:c0 + width] = lo[1]
            r0 += ra
        c0 += width
    return a, bt


def apply_adapters(model, adapters: list[tuple[Adapter, float]], qtype: GGMLType | None = None) -> int:
    """Apply adapters (each with its --lora-scale) to the weights they change: unmerged (the
    frozen weight stays in its type, the step adds B (A x) in f32) unless `qtype` or
    FUCINA_LORA_MERGE names a type to merge them into; rebuild fused weights and the native
    plan. Returns the number of weights changed."""
    merge = qtype if qtype is not None else env_merge_type()
    if merge is None:
        return _apply_unmerged(model, adapters)
    deltas: dict[str, torch.Tensor] = {}
    for adapter, scale in adapters:
        for name in check(adapter, model):
            d = adapter.delta(name, scale)
            deltas[name] = deltas[name] + d if name in deltas else d
    if not deltas:
        return 0

    def fuse(group, fused):   # one type: re-fuse; mixed: None, the parts run separately
        return LinearWeight.fuse(group) if len({g.qtype for g in group}) == 1 else None
    _rewrite(model, deltas, lambda w: merged_weight(w, deltas[w.name], merge if w.in_features % 32 == 0
                                                     else GGMLType.F16), fuse)
    return len(deltas)


def _apply_unmerged(model, adapters: list[tuple[Adapter, float]]) -> int:
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # name -> (A, Bt), ranks concatenated
    for adapter, scale in adapters:
        for name in check(adapter, model):
            a, b = adapter.pairs[name]
            bt = (b * (scale * adapter.alpha / a.shape[0])).T
            old = factors.get(name)
            factors[name] = (a, bt) if old is None else (torch.cat([old[0], a]), torch.cat([old[1], bt]))

    def fuse(group, fused):   # the parts' LoRAs over the fused weight; past MAX_RANK the parts run
        a, bt = fused_lora(group)
        base = fused.base if isinstance(fused, LoRALinear) else fused
        return LoRALinear(base, a, bt) if a.shape[0] <= MAX_RANK else None
    _rewrite(model, factors, lambda w: with_lora(w, *factors[w.name], where=w.name), fuse)
    return len(factors)


def _rewrite(model, names, replace: Callable[[LinearWeight], LinearWeight], fuse) -> None:
    """Swap each weight named in `names` for replace(weight), and each fused weight holding
    one of them for fuse(its parts, the fused weight) (None: the block runs the parts);
    then rebuild the native plan over the result."""
    for L in model.layers:
        slots = weight_slots(L)
        changed = set()
        for owner, attr, w in slots:
            if w.name in names:
                setattr(owner, attr, replace(w))
                changed.add(w.name)
        if not changed:
            continue
        by_name = {w.name: w for _, _, w in weight_slots(L) if "+" not in w.name}
        for owner, attr, w in slots:
            parts = w.name.split("+")
            if len(parts) > 1 and changed.intersection(parts):
                setattr(owner, attr, fuse([by_name[p] for p in parts], w))
    if names and hasattr(model, "refresh_plans"):
        model.refresh_plans()   # the native plans point at the weights they were built from


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
