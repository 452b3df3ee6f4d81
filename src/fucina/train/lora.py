"""LoRA over frozen LinearWeights kept in their own GGUF formats.

y = W x + (alpha / r) * B (A dropout(x)), with A [r, in] and B [out, r] f32 and W the frozen
weight in whatever type the file has (Q4_1, Q4_K, F16, ...):

- forward: W's own matmul (the native kernel when its format has one);
- backward w.r.t. x: dx = dy @ W through the native int8 GEMM over a Q8_0 copy of W^T
  (`Frozen`, mode "q8": 1.06 bytes per weight, encoded from row chunks; ~4x the f32 GEMM on
  VNNI), or mode "exact": W's rows decoded in ~4 MB f32 chunks by the native row decoder
  (`LinearWeight.rows`) and an f32 GEMM. Either way no f32 copy of the model is resident.
  A dedicated kernel (the transposed GEMM straight off W's own blocks) would drop the Q8_0
  copy and its 0.5% gradient noise;
- no gradient for W at all.

The model is not edited: `LoRAModel` swaps each layer's LinearWeight attributes (separate or
fused, found by their GGUF names) for wrappers with the same call signature; `detach()`
puts the originals back. The families' torch blocks (`model.block`) then run unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fucina.weights import ExpertStack, LinearWeight
from fucina.weights.lora import LoRAError, ptqtp_names, weight_owners

#: short target name -> the GGUF tensor stem inside "blk.N.<stem>.weight"
TARGETS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
           "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
#: the other families' projections each target also covers: MLA's low-rank q path and the
#: joint K/V latent (deepseek2; its k_b/v_b head maps are small f32 tensors, not adapted),
#: DeltaNet's output projection (qwen35; its attn_qkv is split into q/k/v like phi3's).
#: Routed experts (and deepseek2's shared experts) stay frozen: a pair per expert would
#: multiply the adapter by n_expert, and routing already specializes them.
EXTRA_STEMS = {"attn_q_a": "q", "attn_q_b": "q", "attn_kv_a_mqa": "k", "ssm_out": "o",
               "attn_kv": "k", "attn_output_b": "o"}   # deepseek4: its joint K=V row, its grouped output's second factor
_STEM_TARGET = {**{v: k for k, v in TARGETS.items()}, **EXTRA_STEMS}
_ROW_CHUNK_BYTES = 4 << 20   # f32 rows decoded per backward chunk


def parse_targets(spec: str | list[str]) -> list[str]:
    names = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [t for t in names if t]
    if names == ["all"]:
        return list(TARGETS)
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise LoRAError(f"unknown LoRA target(s) {bad or names} (choose from {', '.join(TARGETS)}, or all)")
    return [t for t in TARGETS if t in names]   # canonical order


@dataclass
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q", "v"])

    def __post_init__(self):
        self.targets = parse_targets(self.targets)
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAError(f"rank must be a positive integer, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"dropout must be in [0, 1), got {self.dropout}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise LoRAError(f"alpha must be positive, got {self.alpha}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def mix64(*words: int) -> int:
    """splitmix64 over the words: a seed that is a pure function of (seed, step, layer, ...)."""
    m, z = (1 << 64) - 1, 0
    for w in words:
        z = (z + (int(w) & m) + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
    return z & ((1 << 63) - 1)


# -- the frozen matmul ----------------------------------------------------------------------

BACKWARD_MODES = ("q8", "exact")


class Frozen:
    """A frozen weight as training sees it: forward on W's own blocks; dx = dy @ W either
    `exact` (W's rows decoded natively in ~4 MB f32 chunks, then f32 GEMM) or `q8` (the
    native int8 GEMM over a Q8_0 copy of W^T, made on first use: 1.06 bytes per weight,
    ~4x faster than the f32 GEMM on VNNI; dy is quantized per 32 values as every int8
    matmul input is, so dx carries that ~0.5% noise)."""

    def __init__(self, w: LinearWeight, backward: str = "q8"):
        if backward not in BACKWARD_MODES:
            raise LoRAError(f"unknown backward mode {backward!r} ({', '.join(BACKWARD_MODES)})")
        self.w, self.name = w, w.name
        self.out_features, self.in_features = w.out_features, w.in_features
        self.mode = backward if (w.kernel is not None and w.out_features % 32 == 0) else "exact"
        self.wt: LinearWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _FrozenMatmul.apply(x, self)
        return _memo_or(self.w.linear, x)

    def transposed(self) -> LinearWeight:
        """W^T as Q8_0, encoded 1024 rows of W at a time: a Q8_0 block is 32 consecutive
        values of a W^T row, i.e. 32 consecutive rows of W, so row chunks that are multiples
        of 32 encode independently (no f32 copy of W, nor of the head, is ever whole)."""
        if self.wt is None:
            from fucina.gguf import GGMLType
            from fucina.kernels import attach
            from fucina.quant import quantize
            n, k = self.out_features, self.in_features
            raw = torch.empty(k, n // 32 * 34, dtype=torch.uint8)
            for r0 in range(0, n, 1024):
                r1 = min(r0 + 1024, n)
                cols = self.w.rows(torch.arange(r0, r1)).T.contiguous()     # [k, r1 - r0]
                raw[:, r0 // 32 * 34:r1 // 32 * 34] = quantize(cols, int(GGMLType.Q8_0))
            self.wt = LinearWeight(raw.reshape(-1), GGMLType.Q8_0, k, n, self.name + ".T")
            attach(self.wt)
        return self.wt

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        if self.mode == "q8":
            return self.transposed().linear(dy.float())
        return input_grad(self.w, dy)


class _FrozenMatmul(torch.autograd.Function):
    """y = x @ W.T on W's own blocks; no gradient for W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: Frozen) -> torch.Tensor:
        ctx.f = f
        with torch.no_grad():
            return _memo_or(f.w.kernel.run if f.w.kernel is not None else f.w.linear, x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return ctx.f.input_grad(dy), None


class MatmulMemo:
    """The frozen matmul outputs of one checkpointed segment. Its first run (the forward)
    records every output; the recompute during backward takes them back in the same order
    instead of re-running the quantized matmuls (their inputs are the same values: same
    weights, same LoRA parameters, the same dropout masks). Costs 4 bytes per output value
    held from forward to the segment's backward; each is dropped once taken back."""

    def __init__(self):
        self.outs: list[torch.Tensor | None] = []
        self.replay, self.i = False, 0

    def take(self, run, x: torch.Tensor) -> torch.Tensor:
        if not self.replay:
            self.outs.append(run(x))
            return self.outs[-1]
        i, self.i = self.i, self.i + 1
        out = self.outs[i] if i < len(self.outs) else None
        if out is None or out.shape[:-1] != x.shape[:-1]:
            return run(x)   # a second recompute (or a mismatch): run it again
        self.outs[i] = None
        return out


_MEMO: MatmulMemo | None = None


class recording:
    """`with recording(memo):` routes the frozen matmuls of a segment run through `memo`;
    the first entry records, later entries replay."""

    def __init__(self, memo: MatmulMemo):
        self.memo = memo

    def __enter__(self):
        global _MEMO
        self.prev, _MEMO = _MEMO, self.memo
        self.memo.i = 0

    def __exit__(self, *exc):
        global _MEMO
        _MEMO = self.prev
        self.memo.replay = True


def _memo_or(run, x: torch.Tensor) -> torch.Tensor:
    return run(x) if _MEMO is None else _MEMO.take(run, x)


def input_grad(w: LinearWeight, dy: torch.Tensor) -> torch.Tensor:
    """dy [..., out] @ W [out, in] without materialising W: W's rows in ~4 MB f32 chunks."""
    lead = dy.shape[:-1]
    dy = dy.reshape(-1, w.out_features).float()
    dx = torch.zeros(dy.shape[0], w.in_features)
    chunk = max(1, _ROW_CHUNK_BYTES // (4 * w.in_features))
    for r0 in range(0, w.out_features, chunk):
        r1 = min(r0 + chunk, w.out_features)
        dx.addmm_(dy[:, r0:r1], w.rows(torch.arange(r0, r1)))
    return dx.reshape(*lead, w.in_features)


class DenseBase:
    """The peer: W dequantized to an f32 tensor (on first use, so only the weights the blocks
    call are expanded), torch autograd through x @ W.T — what training on a dequantized model
    costs; also the gradient reference."""

    def __init__(self, w: LinearWeight):
        self.w, self.weight = w, None
        self.out_features, self.in_features = w.out_features, w.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            self.weight = self.w.dequantize().contiguous()
        return x @ self.weight.T


# -- adapters and the wrappers that carry them ----------------------------------------------

class LoRAPair:
    """One adapted projection: A [r, in], B [out, r] (PEFT's and llama.cpp's layout)."""

    def __init__(self, name: str, a: torch.Tensor, b: torch.Tensor, scale: float, layer: int,
                 proj: int, dropout: float = 0.0):
        self.name, self.layer, self.proj = name, layer, proj
        self.a, self.b = a, b
        self.scale, self.dropout = scale, dropout

    def delta(self, x: torch.Tensor, state: "DropoutState") -> torch.Tensor:
        if self.dropout and state.training:
            g = torch.Generator().manual_seed(mix64(state.seed, state.step, state.micro, self.layer,
                                                    self.proj))
            keep = torch.rand(x.shape, generator=g) >= self.dropout
            x = x * keep / (1.0 - self.dropout)
        return (x @ self.a.T) @ self.b.T * self.scale


@dataclass
class DropoutState:
    """What the dropout masks are a function of; the trainer advances step/micro."""
    seed: int = 0
    step: int = 0
    micro: int = 0
    training: bool = False


class Adapted:
    """Stands where a LinearWeight stood: the frozen matmul plus the LoRA deltas of its parts
    (one part for a plain weight, q/k/v or gate/up for a fused one; None = not adapted)."""

    def __init__(self, base, sizes: list[int], pairs: list[LoRAPair | None], state: DropoutState):
        self.base, self.sizes, self.pairs, self.state = base, sizes, pairs, state
        self.out_features = sum(sizes)
        self.in_features = base.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        live = [p for p in self.pairs if p is not None]
        if not live:
            return y
        if (self.state.training and any(p.dropout for p in live)) or \
                any(p.scale != live[0].scale for p in live):   # per-part masks or strengths
            return self._per_part(x, y)
        # x @ [A_1; A_2; ...]^T in one GEMM; then each part's B on its r columns (a
        # block-diagonal B would multiply its zero blocks too: 2-3x the FLOPs on the fused
        # qkv and gate_up), the parts' deltas side by side, added to y in one pass
        lead, x2, y2 = y.shape[:-1], x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        a = live[0].a if len(live) == 1 else torch.cat([p.a for p in live])
        xa = x2 @ a.T
        if len(self.pairs) == 1:
            return torch.addmm(y2, xa, live[0].b.T, alpha=live[0].scale).reshape(*lead, y.shape[-1])
        parts, at = [], 0
        for p, n in zip(self.pairs, self.sizes):
            if p is None:
                parts.append(y2.new_zeros(y2.shape[0], n))
                continue
            r = p.a.shape[0]
            parts.append(xa[:, at:at + r] @ p.b.T)
            at += r
        return torch.add(y2, torch.cat(parts, dim=-1), alpha=live[0].scale).reshape(*lead, y.shape[-1])

    def _per_part(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.pairs) == 1:
            return y + self.pairs[0].delta(x, self.state)
        parts = y.split(self.sizes, dim=-1)
        return torch.cat([yp if p is None else yp + p.delta(x, self.state)
                          for yp, p in zip(parts, self.pairs)], dim=-1)

    linear = __call__

    @property
    def name(self) -> str:
        return getattr(self.base, "name", "")


def _stem(tensor_name: str) -> str:
    # "blk.3.attn_q.weight" -> "attn_q"
    parts = tensor_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else ""


def _file_parts(L, w: LinearWeight, layer: int) -> list[tuple[str, int]] | None:
    """The projections inside a weight the file stores fused, named as if separate
    ("blk.N.attn_q.weight", ...), with their output sizes; None for a plain weight:
    phi3's attn_qkv (split_qkv) and [gate | up] ffn_up, qwen35 DeltaNet's attn_qkv
    ([q | k | v] before the conv: q and k of equal width, v as wide as attn_gate)."""
    stem = _stem(w.name)
    qkv = None
    if stem == "attn_qkv" and sum(getattr(L, "split_qkv", [])) == w.out_features:
        qkv = L.split_qkv
    elif stem == "attn_qkv" and isinstance(getattr(L, "attn_gate", None), LinearWeight):
        v = L.attn_gate.out_features
        qkv = [(w.out_features - v) // 2] * 2 + [v]
    if qkv is not None and min(qkv) > 0 and sum(qkv) == w.out_features:
        stems = ("attn_q", "attn_k", "attn_v")
        return [(f"blk.{layer}.{st}.weight", n) for st, n in zip(stems, qkv)]
    if stem == "ffn_up" and getattr(L, "gate", 0) is None and getattr(L, "w_gate_up", None) is w \
            and w.out_features % 2 == 0:   # [gate | up] in one ffn_up
        half = w.out_features // 2
        return [(f"blk.{layer}.ffn_gate.weight", half), (f"blk.{layer}.ffn_up.weight", half)]
    return None


def _slots(L) -> list[tuple[object, str, object]]:
    """Every frozen weight a layer's block calls, as (owner, attribute, value): the
    LinearWeights, lists of them (deepseek2's per-expert views, shared experts) and expert
    stacks of the layer and of the objects one attribute down (MLA's weights, Experts)."""
    out = []
    for owner in weight_owners(L):
        for attr, v in vars(owner).items():
            if isinstance(v, (LinearWeight, ExpertStack)) or \
                    (isinstance(v, list) and v and all(isinstance(x, LinearWeight) for x in v)):
                out.append((owner, attr, v))
    return out


class _TrainStack:
    """An ExpertStack as training sees it: each expert's view wrapped (Frozen or dense)."""

    def __init__(self, stack: ExpertStack, wrap):
        self.stack, self.wrap = stack, wrap
        self.n_expert, self.whole, self.name = stack.n_expert, stack.whole, stack.name
        self.out_features, self.in_features = stack.out_features, stack.in_features
        self._experts: dict[int, object] = {}

    def expert(self, e: int):
        if e not in self._experts:
            self._experts[e] = self.wrap(self.stack.expert(e))
        return self._experts[e]


# the families whose torch blocks the trainer's gradient tests verify (tests/test_train_lora.py:
# autograd on the dequantized model and finite differences, every target); a family outside
# it is refused rather than trained wrong
TRAINABLE = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen35", "qwen35moe", "gemma4", "qwen3moe", "deepseek2",
             "bitnet", "glm4moe", "gpt-oss", "kimi-linear", "kimi-k3", "deepseek4")


class LoRAModel:
    """LoRA attached to a loaded model. `params()` are the trainable tensors; `detach()`
    restores the model. `dense=True` swaps every weight for an f32 copy (the peer).
    `frozen_only=True`: every weight frozen and no adapter (gradients flow through the
    model to inputs that are trained elsewhere: a cartridge's rows)."""

    def __init__(self, model, config: LoRAConfig, seed: int = 0, dense: bool = False,
                 backward: str = "q8", frozen_only: bool = False):
        if not hasattr(model, "layers") or not hasattr(model, "block"):
            raise LoRAError(f"{type(model).__name__} has no per-layer blocks to adapt")
        arch = getattr(getattr(model, "config", None), "arch", None)
        if arch not in TRAINABLE:
            raise LoRAError(f"fine-tuning {arch!r} models is not supported yet "
                            f"(trainable architectures: {', '.join(TRAINABLE)})")
        decorated = [n for L in model.layers for n in ptqtp_names(L)]
        if decorated and not frozen_only:
            raise LoRAError(f"{len(decorated)} projections of this model are PTQTP trit-planes ({decorated[0]}, ...): "
                            "LoRA on them is not supported yet; fine-tune the file they were decorated from, "
                            "then decorate the merged export (fucina quantize --ptqtp K)")
        self.model, self.config, self.seed, self.backward = model, config, seed, backward
        self.frozen_only = frozen_only
        self.state = DropoutState(seed=seed)
        self.pairs: dict[str, LoRAPair] = {}
        self.file_parts: dict[str, list[tuple[str, int]]] = {}   # fused in the file: parts
        self._saved: list[tuple[object, str, object]] = []
        self._saved_native = getattr(model, "use_native_step", None)
        model.use_native_step = False   # training runs the families' torch blocks
        g = torch.Generator().manual_seed(mix64(seed, 0x10A))
        for i, L in enumerate(model.layers):
            self._attach_layer(i, L, g, dense)
        head = model.output
        self._swap(model, "output", self._frozen(head, dense))
        if not self.pairs and not frozen_only:
            self.detach()
            raise LoRAError(f"no weight of this {arch} model is a {','.join(config.targets)} projection "
                            "(MoE layers' routed experts stay frozen: target the attention)")

    def _attach_layer(self, i: int, L, g: torch.Generator, dense: bool) -> None:
        slots = _slots(L)
        by_name = {v.name: v for _, _, v in slots if isinstance(v, LinearWeight)}
        new = []   # every wrapper made before any is swapped in: _file_parts reads the originals
        for owner, attr, w in slots:
            if isinstance(w, ExpertStack):
                new.append(_TrainStack(w, lambda e: self._frozen(e, dense)))
            elif isinstance(w, list):
                new.append([self._frozen(e, dense) for e in w])
            else:
                new.append(self._adapted(L, w, by_name, i, g, dense))
        for (owner, attr, _), wrapped in zip(slots, new):
            self._swap(owner, attr, wrapped)

    def _frozen(self, w: LinearWeight, dense: bool):
        return Adapted(DenseBase(w) if dense else Frozen(w, self.backward), [w.out_features], [None],
                       self.state)

    def _adapted(self, L, w: LinearWeight, by_name: dict, i: int, g: torch.Generator, dense: bool) -> "Adapted":
        names = w.name.split("+")
        if len(names) > 1 and any(n not in by_name for n in names):
            raise LoRAError(f"{w.name}: fused weight whose parts are not on the layer")
        parts = []
        for part in [by_name[n] for n in names] if len(names) > 1 else [w]:
            inner = _file_parts(L, part, i)   # one the file itself stores fused (phi3, qwen35)
            if inner:
                self.file_parts[part.name] = inner
            parts += inner or [(part.name, part.out_features)]
        pairs = [self._pair(n, w.in_features, size, i, g) for n, size in parts]
        base = DenseBase(w) if dense else Frozen(w, self.backward)
        return Adapted(base, [size for _, size in parts], pairs, self.state)

    def _pair(self, tensor_name: str, n_in: int, n_out: int, layer: int, g: torch.Generator
              ) -> LoRAPair | None:
        target = _STEM_TARGET.get(_stem(tensor_name))
        if target not in self.config.targets or self.frozen_only:
            return None
        pair = self.pairs.get(tensor_name)
        if pair is None:   # the same projection may appear separate and fused: one pair
            r = self.config.rank
            bound = 1.0 / math.sqrt(n_in)   # kaiming-uniform(a=sqrt(5)), as PEFT's A
            a = (torch.rand(r, n_in, generator=g) * 2 - 1) * bound
            b = torch.zeros(n_out, r)
            pair = self.pairs[tensor_name] = LoRAPair(
                tensor_name, a.requires_grad_(), b.requires_grad_(), self.config.scale, layer,
                list(TARGETS).index(target), self.config.dropout)
        return pair

    def file_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapters by the file's own tensor names (what the adapter GGUF holds). A
        weight the file stores fused (phi3's attn_qkv, ffn_up) gets one pair of rank
        r * (adapted parts): A = [A_1; A_2; ...], B = blockdiag(B_1, B_2, ...) * parts, the
        factor keeping llama.cpp's alpha / rank(file) equal to ours, alpha / r."""
        inner = {n for parts in self.file_parts.values() for n, _ in parts}
        out = {n: (p.a, p.b) for n, p in self.pairs.items() if n not in inner}
        for name, parts in self.file_parts.items():
            live = [self.pairs.get(n) for n, _ in parts]
            if not any(live):
                continue
            k = sum(p is not None for p in live)
            a = torch.cat([p.a for p in live if p is not None])
            b = torch.block_diag(*[p.b if p is not None else torch.zeros(size, 0)
                                   for p, (_, size) in zip(live, parts)]) * k
            out[name] = (a.detach(), b.detach())
        return out

    def _swap(self, obj, attr: str, new) -> None:
        self._saved.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        setattr(obj, attr, new)

    def params(self) -> list[torch.Tensor]:
        return [t for p in self.pairs.values() for t in (p.a, p.b)]

    def named_params(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.pairs.items():
            out[name + ".lora_a"], out[name + ".lora_b"] = p.a, p.b
        return out

    def detach(self) -> None:
        for obj, attr, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
        self._saved.clear()
        if self._saved_native is not None:
            self.model.use_native_step = self._saved_native


_MISSING = object()

