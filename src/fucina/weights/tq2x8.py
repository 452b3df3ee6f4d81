"""TQ2_0 weights in 8-row groups for the AVX2 decode GEMV, made once when a model loads.

`interleave_model(model)` gives each TQ2_0 weight the model computes with (the fused QKV /
gate-up, not the parts they were stacked from; the head) its kernel's bytes in the layout
of `fucina.kernels.tq2_interleave` when the kernels run an AVX2 level, then rebuilds the
native layer plan on them. Every route gives the bits of the rows they came from, so the
model's output is unchanged; the decode is faster (BENCHMARK.md "TQ2_0 decode at AVX2:
8-row groups"). Memory: a weight read from the file has its mapped pages dropped after the
copy (a later read of `weight.raw` faults them back); a fused weight's stacked rows (already
a copy) stay beside the groups, so those weights are held twice.
"""
from __future__ import annotations

from fucina import kernels
from fucina.weights.linear import LinearWeight
from fucina.weights.lora import weight_slots


def interleave_model(model) -> int:
    """Repack the model's TQ2_0 weights in place (see the module); the count repacked."""
    ws = [w for L in getattr(model, "layers", []) for _, _, w in weight_slots(L)]
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
                f.release(f.tensors[w.name])
    if done and getattr(model, "native_plan", None) is not None:
        model.native_plan = model.build_plan()
    return done
