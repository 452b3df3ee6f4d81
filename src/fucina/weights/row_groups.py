"""Weights in row groups for the decode GEMV, made once when a model loads.

`interleave_model(model)` gives each weight the model computes with (the fused QKV /
gate-up, not the parts they were stacked from; the head; the expert stacks) its kernel's bytes in row groups
where the ISA in force reads them faster (`fucina.kernels.interleave`: TQ2_0 in 8-row groups
at an AVX2 level, Q4_K, Q6_K, Q5_0 and Q8_0 in 16-row groups at AVX-512 and AVX2), then
rebuilds the native layer plan on them. Every route gives the bits of the rows they came from, so the
model's output is unchanged; the decode is faster (BENCHMARK.md "TQ2_0 decode at AVX2: 8-row
groups", "Q4_K and Q6_K decode: 16-row groups", "Q5_0 and Q8_0 decode: 16-row groups"). Memory: the groups replace the rows. A weight read from the file has its
mapped pages dropped after the copy (a later read of `weight.raw` faults them back); a fused
weight (its rows already a copy) drops that copy and becomes a `GroupedWeight`, whose `raw`
gives the rows back from the groups on each read.
"""
from __future__ import annotations

from fucina import kernels
from fucina.errors import FucinaError
from fucina.weights.experts import ExpertStack
from fucina.weights.linear import LinearWeight
from fucina.weights.lora import weight_owners, weight_slots
from fucina.weights.ram import available_ram


class GroupedWeight(LinearWeight):
    """A LinearWeight whose one copy of the bytes is its kernel's row groups: `raw` is the
    rows rebuilt from them, a new tensor on each read (the reference path, a
    dequantize, a LoRA merge read it; the hot path never does). Writing to it would not reach
    the kernel, so assigning `raw` is an error: build a LinearWeight from new bytes instead."""

    @property
    def raw(self):
        return kernels.deinterleave(self.kernel)

    @raw.setter
    def raw(self, value):
        raise FucinaError(f"{self.name}: the bytes of a weight in row groups are its kernel's; "
                          "make a new LinearWeight from the new bytes")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.kernel.rb


def _drop_rows(w: LinearWeight) -> None:
    """w's own copy of its rows gone: w becomes a GroupedWeight (same attributes)."""
    del w.__dict__["raw"]
    w.__class__ = GroupedWeight


def as_grouped(w: LinearWeight) -> GroupedWeight:
    """w, whose bytes are its kernel's row groups (kernels.read_groups), as the GroupedWeight
    it is: `raw` then gives the rows back (an expert store's slot)."""
    if kernels.group_rows(getattr(w, "kernel", None)) is None:
        raise FucinaError(f"{w.name}: its kernel does not read row groups")
    _drop_rows(w)
    return w


def expert_stacks(layer) -> list[ExpertStack]:
    """The layer's expert stacks, a fused stack read as two halves (gemma4) once."""
    found = {}
    for o in weight_owners(layer):
        for v in vars(o).values():
            s = v if isinstance(v, ExpertStack) else getattr(v, "pairs", None)
            if isinstance(s, ExpertStack):
                found[id(s)] = s
    return list(found.values())


def row_view(whole: LinearWeight, lo: int, n: int, name: str) -> LinearWeight:
    """Rows [lo, lo + n) of `whole` as a weight of their own (a fused expert stack's gate or up
    half, which the native plan reads with a stride): `raw` the rows, the kernel a view of
    whole's row groups where those are its bytes and the span starts on a group, else its own
    over the rows."""
    w = LinearWeight(whole.raw[lo:lo + n], whole.qtype, n, whole.in_features, name)
    k = getattr(whole, "kernel", None)
    g = kernels.group_rows(k)
    if g and lo % g == 0:
        w.kernel = kernels.group_view(k, lo, n, w)
    else:
        kernels.attach(w)
    return w


def interleave_model(model, experts: bool = True) -> int:
    """Repack the model's weights in place (see the module); the count repacked. `experts`:
    the expert stacks too, where each expert's rows are whole groups, so a group never spans
    two experts and expert e's rows stay at e x rows x row bytes (the MoE step's offsets).
    False when an expert store will stream them: it reads the file's rows and packs each
    expert itself (kernels.stream_layout). The stacks stay
    on the file's rows too when they are more than half the memory available now
    (`ram.available_ram`): their copy is the process's own memory, where the mapped pages
    can be evicted, so a model near the machine's RAM still loads as it did."""
    layers = getattr(model, "layers", [])
    ws = [w for L in layers for _, _, w in weight_slots(L)]
    if experts:
        stacks = [s.whole for L in layers for s in expert_stacks(L)
                  if (g := kernels.layout_group(s.whole)) and s.out_features % g == 0]
        room = available_ram()
        if room is None or sum(w.nbytes for w in stacks) <= room // 2:
            ws += stacks
    out = getattr(model, "output", None)
    if isinstance(out, LinearWeight):
        ws.append(out)
    parts = {p for w in ws if "+" in w.name for p in w.name.split("+")}
    f = getattr(model, "gguf", None)
    seen, done = set(), 0
    for w in ws:
        if id(w) in seen or w.name in parts:
            continue
        seen.add(id(w))
        if kernels.interleave(w):
            done += 1
            if f is not None and w.name in getattr(f, "tensors", {}):
                f.release(f.tensors[w.name])   # the file's pages
            elif "+" in w.name:
                _drop_rows(w)                  # a fused weight's stacked copy
    if done and hasattr(model, "refresh_plans"):
        model.refresh_plans()   # the native plans point at the weights they were built from
    return done
