"""fucina.kernels: native kernels and their thin Python wrappers.

`attach(weight)` gives a LinearWeight a fast `kernel` callable when a native route
exists for its format; otherwise the weight keeps the reference path
(`fucina.quant` dequantize + torch matmul), which every kernel is tested against.

The native module (`_native`, built from csrc/ by `pip install -e .`) computes
y = x @ W.T straight off the resident GGML blocks: weights are decoded a few rows at
a time into per-thread L1/L2 scratch, activations are quantized to int8 per 32
values, and the dot products run as u8 x s8 integer dots (AVX-512 VNNI, AVX2, or
scalar, picked from CPUID at import). F16/BF16/F32 weights run f32 FMA tiles.

Threads: the kernels run OpenMP regions on the same libgomp torch loaded, so torch
and the kernels share one pool; `set_threads(n)` sets both.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, NamedTuple

import numpy as np
import torch  # first: loads torch's libgomp, which the native module then shares

from fucina.errors import FucinaError
from fucina.gguf import TYPE_SIZES, GGMLType

try:
    from fucina.kernels import _native
    _native_error: str | None = None
except ImportError as e:  # not built (a source checkout without the extension), or a broken build
    _native = None
    _native_error = str(e) or type(e).__name__


class KernelError(FucinaError):
    """A kernel was called with shapes, dtypes or buffers it cannot take."""


#: GGML types with a native matmul route
NATIVE_TYPES = frozenset({
    GGMLType.F32, GGMLType.F16, GGMLType.BF16,
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4,
    GGMLType.TQ1_0, GGMLType.TQ2_0,
    GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ1_S,
    GGMLType.IQ1_M,
})

#: the i-quants whose codebooks the native module takes at first use (load_iq_tables)
IQ_TYPES = frozenset({GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S,
                      GGMLType.IQ1_S, GGMLType.IQ1_M})
_iq_tables_set = False


def load_iq_tables() -> bool:
    """Give the native module the IQ1-IQ3 codebooks (from the gguf package, ~0.1 s, once);
    False when the module is absent."""
    global _iq_tables_set
    if not _iq_tables_set and _native is not None:
        from fucina.quant.tables import iq_codebook_bytes
        _native.set_iq_tables(iq_codebook_bytes())
        _iq_tables_set = True
    return _iq_tables_set

# FUCINA_KERNELS=0 keeps every weight on the reference path (A/B timing, debugging)
_enabled = os.environ.get("FUCINA_KERNELS", "1") != "0"


def available() -> bool:
    """True when the native extension is built and enabled."""
    return _native is not None and _enabled


def unavailable_reason() -> str | None:
    """Why the weights run on the torch reference path instead of the native kernels
    (None when the kernels are in use)."""
    if _native is None:
        return f"the native extension did not load: {_native_error}"
    if not _enabled:
        return "FUCINA_KERNELS=0"
    return None


_warned_missing = False


def warn_if_missing() -> None:
    """Once per process, when the extension failed to import (FUCINA_KERNELS=0 is a
    choice, not a fault): without it every matmul runs the torch reference path, tens
    of times slower, which a user would otherwise see only as a slow model."""
    global _warned_missing
    if _native is None and not _warned_missing:
        _warned_missing = True
        import warnings
        warnings.warn(f"fucina: {unavailable_reason()}; every matmul runs on the torch reference "
                      "path, tens of times slower. Rebuild it in this environment: `pip install -e .` "
                      "in a source checkout, or reinstall fucina.", RuntimeWarning, stacklevel=3)


def status() -> str:
    """The kernels in use, for reports: the ISA level ('+amx' where the prefill kernel uses the
    AMX tiles), or 'reference (why)'."""
    why = unavailable_reason()
    if why is not None:
        return f"reference ({why})"
    return isa() + ("+amx" if amx() and isa() == "avx512" else "")


def set_enabled(on: bool) -> None:
    """Turn the native routes on/off for weights attached from now on (tests, A/B timing)."""
    global _enabled
    _enabled = bool(on)


def _configure(setter: str, value) -> None:
    if _native is None:
        raise KernelError("native kernels are not built")
    try:
        getattr(_native, setter)(value)
    except ValueError as e:
        raise KernelError(str(e)) from None


def isa() -> str:
    """The instruction set the kernels run with: 'avx512', 'avx2vnni', 'avx2', 'scalar' (or 'none')."""
    return _native.get_isa() if _native is not None else "none"


def supported_isas() -> list[str]:
    return list(_native.supported_isas()) if _native is not None else []


def set_isa(name: str) -> None:
    """Force an ISA level this CPU supports (tests run every level this way)."""
    _configure("set_isa", name)


def amx() -> bool:
    """Whether the AVX-512 prefill kernel runs 16 activation rows at a time on the AMX tiles
    (on by default where the CPU has AMX-INT8 and the OS enables it; FUCINA_AMX=0 turns it off).
    The results are the same bits either way."""
    return bool(_native.get_amx()) if _native is not None else False


def set_amx(on: bool) -> None:
    """Use (True) or not (False) the AMX tiles in the AVX-512 prefill kernel."""
    _configure("set_amx", bool(on))


def prefill_route() -> str:
    """The matmul route family: 'canon' (the default: one batch-invariant arithmetic for every
    m, so a row's result never depends on the rows computed with it), or a legacy opt-out
    (FUCINA_INVARIANT=0): 'int8' (per-m GEMV / int8 tiles) or 'bf16' (as 'int8', and for
    m >= prefill_min_m() AVX512_BF16 dots on weights decoded to bf16)."""
    return _native.get_prefill() if _native is not None else "none"


def batch_invariant() -> bool:
    """True when the native routes promise that a row's result never depends on the rows
    computed with it (m rows at once == m single rows, bitwise, every chunking): the
    native kernels are built and enabled and the canonical route is on. Speculation's
    batched verify and the server's exactness rely on it."""
    return available() and prefill_route() == "canon"


def prefill_min_m() -> int:
    return _native.prefill_min_m() if _native is not None else 0


def set_prefill_route(name: str) -> None:
    _configure("set_prefill", name)


def route(m: int, qtype: GGMLType | None = None) -> str:
    """Which arithmetic serves an m-row call now: 'canon', 'bf16', or 'int8' (quantized
    formats; F32/F16 weights always keep f32 arithmetic there)."""
    if prefill_route() == "canon":
        return "canon"
    if qtype in (GGMLType.F32, GGMLType.F16):
        return "int8"
    if m >= prefill_min_m() and prefill_route() == "bf16" and isa() == "avx512":
        return "bf16"
    return "int8"


def _configure_from_env() -> None:
    """FUCINA_ISA=avx2vnni|avx2|scalar forces an ISA level (A/B timing of the AVX2 paths on
    an AVX-512 CPU); FUCINA_AMX=0 keeps the AVX-512 prefill off the AMX tiles;
    FUCINA_INVARIANT=0 opts out of batch invariance for the legacy routes (bf16 where the CPU
    has AVX512_BF16)."""
    if _native is None:
        return
    name = os.environ.get("FUCINA_ISA", "")
    if name:
        set_isa(name)
    if os.environ.get("FUCINA_AMX", "1") == "0":
        set_amx(False)
    if os.environ.get("FUCINA_INVARIANT", "1") == "0":
        try:
            _native.set_prefill("bf16")
        except ValueError:
            _native.set_prefill("int8")


_configure_from_env()


def set_threads(n: int) -> None:
    """Threads for both torch and the native kernels (one pool: torch's OpenMP)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KernelError(f"threads must be a positive integer, got {n!r}")
    torch.set_num_threads(n)
    if _native is not None:
        _native.set_threads(n)


def get_threads() -> int:
    return _native.get_threads() if _native is not None else torch.get_num_threads()


def _row_bytes(qtype: GGMLType, k: int) -> int:
    block, size = TYPE_SIZES[qtype]
    if k <= 0 or k % block:
        raise KernelError(f"{qtype.name}: row length {k} is not a positive multiple of the block {block}")
    return k // block * size


def _check_raw(raw: torch.Tensor, qtype: GGMLType, n: int, k: int) -> int:
    if qtype not in NATIVE_TYPES:
        raise KernelError(f"no native route for {getattr(qtype, 'name', qtype)}")
    if qtype in IQ_TYPES:
        load_iq_tables()
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        raise KernelError("weight bytes must be a CPU uint8 tensor")
    if n <= 0:
        raise KernelError(f"weight must have at least one row, got {n}")
    rb = _row_bytes(qtype, k)
    if raw.dim() != 2 or tuple(raw.shape) != (n, rb) or not raw.is_contiguous():
        raise KernelError(f"{qtype.name} weight bytes must be contiguous [{n}, {rb}], got "
                          f"{tuple(raw.shape)}{'' if raw.is_contiguous() else ' (strided)'}")
    return rb


def _prep_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        raise KernelError("input must be a CPU tensor")
    if x.dim() == 0 or x.shape[-1] != k:
        raise KernelError(f"input has shape {tuple(x.shape)}, expected [..., {k}]")
    if x.dtype is not torch.float32:
        if not x.is_floating_point():
            raise KernelError(f"input dtype {x.dtype} is not floating point")
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return x


def matmul(raw: torch.Tensor, qtype: GGMLType, n: int, k: int, x: torch.Tensor) -> torch.Tensor:
    """y[..., n] = x[..., k] @ W.T for W [n, k] given as GGML bytes raw [n, row_bytes]."""
    if _native is None:
        raise KernelError("native kernels are not built")
    qtype = GGMLType(qtype)
    rb = _check_raw(raw, qtype, n, k)
    x = _prep_x(x, k)
    m = x.numel() // k
    y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    if m:
        _native.matmul(int(qtype), raw.data_ptr(), rb, n, k, x.data_ptr(), m, y.data_ptr(), n)
    return y


def _native_f32(t: torch.Tensor, dim: int) -> bool:
    """Whether the native scans can read `t` in place: a non-empty contiguous float32 CPU
    tensor of `dim` dimensions."""
    return _native is not None and t.is_cpu and t.dtype == torch.float32 and t.dim() == dim \
        and t.is_contiguous() and t.numel() > 0


def first_max(row: torch.Tensor) -> tuple[int, float]:
    """The first maximum of a 1-D float32 CPU row and its value, in numpy's argmax order (a
    NaN ranks highest, ties go to the lowest index): torch.argmax's and llama.cpp's greedy
    choice. Native on a contiguous row: right after a step (its code and the row cold)
    numpy's scan of a 49k-vocabulary row took 50-84 us and 100-155 at 262k, the native one
    17-27 and 67-106 (benchmarks/greedy_pick.py)."""
    if _native_f32(row, 1):
        return _native.argmax_rows(row.data_ptr(), 1, row.numel())[0]
    a = row.detach().reshape(-1).float().numpy()
    i = int(np.argmax(a))
    return i, float(a[i])


def first_max_rows(rows: torch.Tensor) -> list[int]:
    """`first_max`'s index for each row of a 2-D float32 CPU tensor."""
    if _native_f32(rows, 2):
        return [i for i, _ in _native.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1])]
    return [int(i) for i in np.argmax(rows.detach().float().numpy(), axis=-1)]


def act_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The activations as the integer kernels see them (quantized per 32, dequantized)."""
    if _native is None:
        raise KernelError("native kernels are not built")
    x = _prep_x(x, x.shape[-1]).reshape(-1)
    if x.numel() % 32:
        raise KernelError("act_roundtrip needs a multiple of 32 values")
    out = torch.empty_like(x)
    _native.act_roundtrip(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row over an f16 KV cache: q [1, n_head, d] f32, k/v [n, kv_heads, d] f16
    (contiguous rows, e.g. a window slice of the cache) -> [1, n_head * d] f32.

    Query head h attends with kv head h // (n_head // kv_heads); online softmax in f32."""
    if _native is None:
        raise KernelError("native kernels are not built")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 3:
            raise KernelError(f"decode_attention: {name} must be a 3-d CPU tensor")
    if q.dtype is not torch.float32 or k.dtype is not torch.float16 or v.dtype is not torch.float16:
        raise KernelError(f"decode_attention: needs f32 q and f16 k/v, got {q.dtype}, {k.dtype}, {v.dtype}")
    _, n_head, d = q.shape
    n, kvh, dk = k.shape
    if q.shape[0] != 1 or tuple(v.shape) != (n, kvh, d) or dk != d:
        raise KernelError(f"decode_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if n < 1 or kvh < 1 or n_head % kvh or n_head // kvh > 64 or d % 16 or d > 1024:
        raise KernelError(f"decode_attention: unsupported n={n}, heads {n_head}/{kvh}, head_dim {d}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise KernelError("decode_attention: k and v must be contiguous rows")
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty(1, n_head * d, dtype=torch.float32)
    _native.attn_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, kvh * d,
                        n_head, kvh, d, float(scale))
    return out


def decode_attention_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when decode_attention takes these inputs (cheap: the decode hot path asks per layer)."""
    return (_native is not None and _enabled and k.dtype is torch.float16 and v.dtype is torch.float16
            and q.dtype is torch.float32 and q.shape[-1] % 16 == 0 and k.is_contiguous()
            and v.is_contiguous() and not (q.requires_grad and torch.is_grad_enabled()))


def delta_step_ok() -> bool:
    """Whether the native Gated DeltaNet decode step is there (and kernels are enabled)."""
    return _native is not None and _enabled and hasattr(_native, "delta_step")


def delta_step(qkv, z, b, a, window, conv_w, dt_bias, ssm_a, state, norm_w, hk: int, dk: int,
               eps: float) -> torch.Tensor:
    """One DeltaNet decode token (csrc/fk_delta.cpp): updates `window` and `state` in
    place, returns the gated, normed output [hv * dv]. Every tensor f32 and contiguous."""
    ts = (qkv, z, b, a, window, conv_w, dt_bias, ssm_a, state, norm_w)
    if state.dim() != 3 or window.dim() != 2 or conv_w.dim() != 2:
        raise KernelError("delta_step: state [hv, dk, dv], window [d_conv - 1, conv_dim], conv_w [conv_dim, d_conv]")
    hv, dv = state.shape[0], state.shape[2]
    if any(t.dtype is not torch.float32 or not t.is_contiguous() for t in ts) or state.shape[1] != dk \
            or qkv.numel() != 2 * hk * dk + hv * dv or window.shape[1] != qkv.numel() or z.numel() != hv * dv \
            or any(t.numel() != hv for t in (b, a, dt_bias, ssm_a)) or norm_w.numel() != dv \
            or conv_w.shape != (qkv.numel(), window.shape[0] + 1):
        raise KernelError("delta_step: tensors must be f32, contiguous and of one layer's geometry")
    out = torch.empty(hv * dv)
    _native.delta_step(*(t.data_ptr() for t in ts), out.data_ptr(), hk, hv, dk, dv, conv_w.shape[1], float(eps))
    return out


class _Backward(torch.autograd.Function):
    """Gradient w.r.t. the input through the frozen weight (LoRA training)."""

    @staticmethod
    def forward(ctx, x, kernel):
        ctx.kernel = kernel
        return kernel.run(x)

    @staticmethod
    def backward(ctx, g):
        w = ctx.kernel.weight.dequantize()
        return g.float() @ w, None


class QuantKernel:
    """The callable `attach` puts on a LinearWeight: validated once, cheap per call."""

    __slots__ = ("weight", "raw", "qtype", "n", "k", "rb", "ptr")

    def __init__(self, weight):
        self.weight = weight
        self.raw = weight.raw
        self.qtype = int(weight.qtype)
        self.n = weight.out_features
        self.k = weight.in_features
        self.rb = _check_raw(self.raw, GGMLType(weight.qtype), self.n, self.k)
        self.ptr = self.raw.data_ptr()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k
        if (x.dtype is not torch.float32 or not x.is_contiguous() or x.device.type != "cpu"
                or x.dim() == 0 or x.shape[-1] != k):
            x = _prep_x(x, k)
        y = torch.empty(*x.shape[:-1], self.n, dtype=torch.float32)  # varargs: cheaper than a tuple
        m = x.numel() // k
        if m:
            _native.matmul(self.qtype, self.ptr, self.rb, self.n, k, x.data_ptr(), m, y.data_ptr(), self.n)
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, checked in range here and in C) as f32 [len(ids), k]."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).contiguous()
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        qtype, raw, n, sel = self.qtype, self.raw, self.n, ids
        if qtype in _GROUPED:   # the ids' row groups back to rows, then the rows as any
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise KernelError(f"dequant_rows: a row out of range [0, {n})")
            fmt, lay = _GROUPED[qtype]
            qtype, gr = int(fmt), lay.group
            groups = raw.view(-1, gr * self.rb)[ids // gr]
            raw = lay.unpack(groups.reshape(-1, self.rb), gr * ids.numel())
            n, sel = max(gr * ids.numel(), 1), torch.arange(ids.numel()) * gr + ids % gr
        try:
            _native.dequant_rows(qtype, raw.data_ptr(), self.rb, n, self.k, sel.data_ptr(), sel.numel(),
                                 out.data_ptr())
        except ValueError as e:
            raise KernelError(str(e)) from None
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _Backward.apply(x, self)
        return self.run(x)


def direct_kernel(weight) -> "QuantKernel | None":
    """The weight's kernel when a fused native call may read its rows directly: attached, and
    no unmerged LoRA beside it (that update runs in the weight's own call)."""
    return None if getattr(weight, "lora", None) is not None else getattr(weight, "kernel", None)


def attach(weight) -> None:
    """Give `weight` a native kernel when its format has one (else keep the reference path)."""
    weight.kernel = None
    if not available() or weight.qtype not in NATIVE_TYPES:
        return
    raw = weight.raw
    if raw.device.type != "cpu" or not raw.is_contiguous():
        return
    weight.kernel = QuantKernel(weight)


#: the kernels' pseudo type of K stacked TQ2_0 PTQTP planes is PTQTP_BASE + K (csrc/fk_common.h)
PTQTP_BASE = 1000
#: and of a scale-tied K=2 pair folded to one plane of 9-level codes (130 bytes a 256-group)
PTQTP_FOLD = PTQTP_BASE + 16


def attach_ptqtp(weight) -> None:
    """Give a PtqtpWeight (K planes stacked in `weight.stacked`, a TQ2_0 LinearWeight
    [K n, k]) the fused native kernel: one call, x quantized once, the K plane outputs
    summed in plane order in C (csrc/generic/ptqtp_impl.inc); the layer step takes it like
    any weight. A tied weight's folded plane gets the one-pass kernel (PTQTP_FOLD). Without
    native kernels the weight keeps its reference path."""
    weight.kernel = None
    if weight.tied:
        raw, n, kk = weight.folded, weight.out_features, weight.in_features
        if not available() or kk % 256 or not raw.is_contiguous() or tuple(raw.shape) != (n, kk // 256 * 130):
            return
        k = QuantKernel.__new__(QuantKernel)
        k.weight, k.raw, k.qtype, k.n, k.k = weight, raw, PTQTP_FOLD, n, kk
        k.rb, k.ptr = kk // 256 * 130, raw.data_ptr()
        weight.kernel = k
        return
    stacked = weight.stacked
    if not available() or stacked.kernel is None:
        return
    k = QuantKernel(stacked)
    k.weight, k.qtype, k.n = weight, PTQTP_BASE + weight.k, weight.out_features
    weight.kernel = k


#: the kernels' pseudo type of TQ2_0 rows repacked in 8-row groups (csrc/generic/tq2x8_impl.inc)
TQ2_X8 = PTQTP_BASE + 32
#: the ISA levels whose decode GEMV reads that layout (AVX-512's reads TQ2_0 rows as they are)
_X8_ISAS = ("avx2", "avx2vnni")
_TQ2_BYTES = 66


_HUGE_PAGE = 1 << 21     # x86-64 Linux's transparent huge page
_MADV_HUGEPAGE = 14


def _madvise():
    """libc's madvise where transparent huge pages can be asked for (Linux), else None."""
    if not sys.platform.startswith("linux") or os.environ.get("FUCINA_HUGEPAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()


def hugepages() -> bool:
    """Whether huge_empty asks for transparent huge pages here (Linux, not FUCINA_HUGEPAGES=0)."""
    return _MADVISE is not None


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes whose whole 2 MB pages Linux is asked, before
    anything touches them, to back with transparent huge pages (madvise MADV_HUGEPAGE; hosts
    whose THP setting is "madvise" give them only when asked). The decode GEMVs stream the
    repacked weights once a token, one 4 KB page walk every 64 lines on plain pages: in huge
    pages 1.7B Q4_K_M decode read 4-8% more a second on the Intel Xeon (BENCHMARK.md "The
    decode GEMV's prefetch in short bursts, and huge pages"). Plain pages where the kernel
    refuses, off Linux, or with FUCINA_HUGEPAGES=0."""
    if _MADVISE is None or nbytes < _HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)   # a fresh mapping: no page touched yet
    off = -buf.data_ptr() % _HUGE_PAGE
    _MADVISE(buf.data_ptr() + off, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)   # a refusal costs nothing
    return buf[off:off + nbytes]


def _group_rows(raw: torch.Tensor, n: int, unit: int, group: int, fmt: str, caller: str) -> torch.Tensor:
    """raw as [ceil(n / group) * group, rb] rows of `fmt` (`unit` bytes a superblock), the
    added rows zero; a typed error naming `caller` when raw is not such rows."""
    rb = raw.shape[-1]
    if raw.dtype != torch.uint8 or rb % unit or raw.numel() != n * rb:
        raise KernelError(f"{caller}: {tuple(raw.shape)} {raw.dtype} is not {fmt} rows")
    rows, pad = raw.reshape(n, rb), -n % group
    return torch.cat([rows, rows.new_zeros(pad, rb)]) if pad else rows


def tq2_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """TQ2_0 rows [n, rb] -> their 8-row groups (csrc/generic/tq2x8_impl.inc), [ceil8(n), rb]
    uint8: per group, superblock s's 16 qs dwords of the 8 rows (dword e of row r at 512 s +
    32 e + 4 r), then the 8 rows' f16 scales of each superblock (at 512 nsb + 16 s + 2 r).
    The rows past n are zeros. A byte permutation: tq2_deinterleave undoes it."""
    rows = _group_rows(raw, n, _TQ2_BYTES, 8, "TQ2_0", "tq2_interleave")
    rb = rows.shape[-1]
    nsb, groups = rb // _TQ2_BYTES, rows.shape[0] // 8
    b = rows.view(groups, 8, nsb, _TQ2_BYTES)
    qs = b[..., :64].reshape(groups, 8, nsb, 16, 4).permute(0, 2, 3, 1, 4).reshape(groups, nsb * 512)
    d = b[..., 64:].permute(0, 2, 1, 3).reshape(groups, nsb * 16)
    return torch.cat([qs, d], dim=1, out=huge_empty(rows.numel()).view(groups, 8 * rb)).reshape(groups * 8, rb)


def tq2_deinterleave(x8: torch.Tensor, n: int) -> torch.Tensor:
    """tq2_interleave's inverse: the first n TQ2_0 rows [n, rb] of 8-row groups [ceil8(n), rb]."""
    rb = x8.shape[-1]
    nsb, groups = rb // _TQ2_BYTES, x8.numel() // (8 * rb)
    if x8.dtype != torch.uint8 or rb % _TQ2_BYTES or x8.numel() != groups * 8 * rb or n > groups * 8:
        raise KernelError(f"tq2_deinterleave: {tuple(x8.shape)} {x8.dtype} does not hold {n} rows in 8-row groups")
    b = x8.reshape(groups, 8 * rb)
    qs = b[:, :nsb * 512].reshape(groups, nsb, 16, 8, 4).permute(0, 3, 1, 2, 4).reshape(groups, 8, nsb, 64)
    d = b[:, nsb * 512:].reshape(groups, nsb, 8, 2).permute(0, 2, 1, 3)
    return torch.cat([qs, d], dim=-1).reshape(groups * 8, rb)[:n].contiguous()


#: the kernels' pseudo types of Q4_K, Q6_K, Q5_0, Q8_0, Q4_0, Q4_1, Q5_1, Q5_K, IQ4_XS, Q2_K,
#: Q3_K, MXFP4 and IQ4_NL rows repacked in 16-row groups (csrc/generic/q4kx16_impl.inc,
#: q6kx16_impl.inc, x16n_impl.inc, q80x16_impl.inc, iq4xsx16_impl.inc, k23x16_impl.inc)
Q4K_X16 = PTQTP_BASE + 33
Q6K_X16 = PTQTP_BASE + 34
Q50_X16 = PTQTP_BASE + 35
Q80_X16 = PTQTP_BASE + 36
Q40_X16 = PTQTP_BASE + 37
Q41_X16 = PTQTP_BASE + 38
Q51_X16 = PTQTP_BASE + 39
Q5K_X16 = PTQTP_BASE + 40
IQ4XS_X16 = PTQTP_BASE + 41
Q2K_X16 = PTQTP_BASE + 42
Q3K_X16 = PTQTP_BASE + 43
MXFP4_X16 = PTQTP_BASE + 44
IQ4NL_X16 = PTQTP_BASE + 45
#: the ISA levels whose decode GEMV reads those layouts (the scalar unit reads them through panels)
_X16_ISAS = ("avx512", "avx2", "avx2vnni")
_X16_UNIT = {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210, GGMLType.IQ4_XS: 136, GGMLType.Q2_K: 84,
             GGMLType.Q3_K: 110}


def _x16_interleave(raw: torch.Tensor, n: int, fmt: GGMLType, caller: str) -> torch.Tensor:
    """K-quant rows [n, rb] -> 16-row groups [ceil16(n), rb] uint8: per group and superblock
    (16 x its bytes) the superblock's whole dwords of the 16 rows as columns (dword e of row r
    at 64 e + 4 r), then the bytes past them (Q6_K's f16 d) row by row. The rows past n are
    zeros. A byte permutation: _x16_deinterleave undoes it."""
    unit = _X16_UNIT[fmt]
    rows = _group_rows(raw, n, unit, 16, fmt.name, caller)
    rb = rows.shape[-1]
    nsb, groups, ncol = rb // unit, rows.shape[0] // 16, unit // 4
    b = rows.view(groups, 16, nsb, unit)
    out = huge_empty(rows.numel()).view(groups, nsb, 16 * unit)   # each byte copied once (a load-time pass)
    out[..., :64 * ncol].unflatten(-1, (ncol, 16, 4)).copy_(b[..., :4 * ncol].unflatten(-1, (ncol, 4)).permute(0, 2, 3, 1, 4))
    if unit > 4 * ncol:
        out[..., 64 * ncol:].unflatten(-1, (16, unit - 4 * ncol)).copy_(b[..., 4 * ncol:].permute(0, 2, 1, 3))
    return out.view(groups * 16, rb)


def _x16_deinterleave(x16: torch.Tensor, n: int, fmt: GGMLType, caller: str) -> torch.Tensor:
    """_x16_interleave's inverse: the first n rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    unit, rb = _X16_UNIT[fmt], x16.shape[-1]
    nsb, groups, ncol = rb // unit, x16.numel() // (16 * rb), unit // 4
    if x16.dtype != torch.uint8 or rb % unit or x16.numel() != groups * 16 * rb or n > groups * 16:
        raise KernelError(f"{caller}: {tuple(x16.shape)} {x16.dtype} does not hold {n} rows in 16-row groups")
    b = x16.reshape(groups, nsb, 16 * unit)
    out = x16.new_empty(groups, 16, nsb, unit)
    out[..., :4 * ncol].unflatten(-1, (ncol, 4)).copy_(b[..., :64 * ncol].unflatten(-1, (ncol, 16, 4)).permute(0, 3, 1, 2, 4))
    if unit > 4 * ncol:
        out[..., 4 * ncol:].copy_(b[..., 64 * ncol:].unflatten(-1, (16, unit - 4 * ncol)).permute(0, 2, 1, 3))
    return out.view(groups * 16, rb)[:n]


def q4k_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q4_K rows [n, rb] -> their 16-row groups (csrc/generic/q4kx16_impl.inc), [ceil16(n), rb]
    uint8: per group and superblock (2304 bytes) the 36 dwords of the 16 rows as columns (the
    d | dmin dwords, the three scale dwords, then the 32 qs dwords: dword e of row r at 64 e +
    4 r). The rows past n are zeros; q4k_deinterleave undoes it."""
    return _x16_interleave(raw, n, GGMLType.Q4_K, "q4k_interleave")


def q4k_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q4k_interleave's inverse: the first n Q4_K rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.Q4_K, "q4k_deinterleave")


def q5k_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q5_K rows [n, rb] -> their 16-row groups (csrc/generic/q4kx16_impl.inc), [ceil16(n), rb]
    uint8: per group and superblock (2816 bytes) the 44 dwords of the 16 rows as columns (the
    d | dmin dwords, the three scale dwords, the 8 qh dwords, then the 32 qs dwords: dword e of
    row r at 64 e + 4 r). The rows past n are zeros; q5k_deinterleave undoes it."""
    return _x16_interleave(raw, n, GGMLType.Q5_K, "q5k_interleave")


def q5k_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q5k_interleave's inverse: the first n Q5_K rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.Q5_K, "q5k_deinterleave")


def iq4xs_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """IQ4_XS rows [n, rb] -> their 16-row groups (csrc/generic/iq4xsx16_impl.inc), [ceil16(n),
    rb] uint8: per group and superblock (2176 bytes) the 34 dwords of the 16 rows as columns (d
    | scales_h, scales_l, then the 32 qs dwords: dword e of row r at 64 e + 4 r). The rows past
    n are zeros; iq4xs_deinterleave undoes it."""
    return _x16_interleave(raw, n, GGMLType.IQ4_XS, "iq4xs_interleave")


def iq4xs_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """iq4xs_interleave's inverse: the first n IQ4_XS rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.IQ4_XS, "iq4xs_deinterleave")


def q2k_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q2_K rows [n, rb] -> their 16-row groups (csrc/generic/k23x16_impl.inc), [ceil16(n), rb]
    uint8: per group and superblock (1344 bytes) the 21 dwords of the 16 rows as columns (the 4
    scale dwords, the 16 qs dwords, d | dmin: dword e of row r at 64 e + 4 r). The rows past n
    are zeros; q2k_deinterleave undoes it."""
    return _x16_interleave(raw, n, GGMLType.Q2_K, "q2k_interleave")


def q2k_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q2k_interleave's inverse: the first n Q2_K rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.Q2_K, "q2k_deinterleave")


def q3k_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q3_K rows [n, rb] -> their 16-row groups (csrc/generic/k23x16_impl.inc), [ceil16(n), rb]
    uint8: per group and superblock (1760 bytes) the first 27 dwords of the 16 rows as columns
    (the 8 hmask dwords, the 16 qs dwords, the 3 scale dwords: dword e of row r at 64 e + 4 r),
    then the 16 rows' f16 d (at 1728 + 2 r). The rows past n are zeros; q3k_deinterleave undoes
    it."""
    return _x16_interleave(raw, n, GGMLType.Q3_K, "q3k_interleave")


def q3k_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q3k_interleave's inverse: the first n Q3_K rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.Q3_K, "q3k_deinterleave")


def q6k_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q6_K rows [n, rb] -> their 16-row groups (csrc/generic/q6kx16_impl.inc), [ceil16(n), rb]
    uint8: per group and superblock (3360 bytes), the first 208 bytes of the 16 rows as 52
    dword columns (dword e of row r at 64 e + 4 r: ql, qh, the int8 scales), then the 16 rows'
    f16 d (at 3328 + 2 r). The rows past n are zeros; q6k_deinterleave undoes it."""
    return _x16_interleave(raw, n, GGMLType.Q6_K, "q6k_interleave")


def q6k_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q6k_interleave's inverse: the first n Q6_K rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _x16_deinterleave(x16, n, GGMLType.Q6_K, "q6k_deinterleave")


def _q50_bit_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Per qh byte j (0..3) and value v: the bits v sets in the transposed word (the fifth bit
    of element e = 16 s + 4 i + t at bit 8 t + 4 s + i), and the inverse."""
    def dest(e: int) -> int:
        s, i, t = e // 16, e % 16 // 4, e % 4
        return 8 * t + 4 * s + i
    src = {dest(e): e for e in range(32)}

    def table(move) -> torch.Tensor:
        return torch.tensor([[sum(1 << move(8 * j + bit) for bit in range(8) if v >> bit & 1) for v in range(256)]
                             for j in range(4)], dtype=torch.int64)
    return table(dest), table(src.__getitem__)


_Q50_BITS = None


def _q50_transpose(qh: torch.Tensor, inverse: bool) -> torch.Tensor:
    """qh bytes [..., 4] -> the transposed (or, inverse, the file's) qh bytes [..., 4]"""
    global _Q50_BITS
    if _Q50_BITS is None:
        _Q50_BITS = _q50_bit_tables()
    table = _Q50_BITS[1 if inverse else 0]
    word = table[0][qh[..., 0].long()] | table[1][qh[..., 1].long()] | table[2][qh[..., 2].long()] | table[3][qh[..., 3].long()]
    return torch.stack([(word >> (8 * j)) & 255 for j in range(4)], dim=-1).to(torch.uint8)


#: the layouts of two-block units: block bytes; whether column 0 holds the two blocks' f16 d
#: side by side (else each block's [d | m] dword is a field of its own); then per field of a
#: block its byte offset, dword count, first column in block 0, column step to block 1 and
#: transform (csrc/generic/x16n_impl.inc, q80x16_impl.inc)
_PAIR_FIELDS = {GGMLType.Q4_0: (18, True, ((2, 4, 1, 4, None),)),
                GGMLType.IQ4_NL: (18, True, ((2, 4, 1, 4, None),)),
                GGMLType.Q4_1: (20, False, ((0, 1, 0, 1, None), (4, 4, 2, 4, None))),
                GGMLType.Q5_0: (22, True, ((2, 1, 1, 1, "qh"), (6, 4, 3, 4, None))),
                GGMLType.Q5_1: (24, False, ((0, 1, 0, 1, None), (4, 1, 2, 1, "qh"), (8, 4, 4, 4, None))),
                GGMLType.Q8_0: (34, True, ((2, 8, 1, 8, "x80"),))}


def _pair_transform(kind: str | None, x: torch.Tensor, inverse: bool) -> torch.Tensor:
    if kind == "qh":
        return _q50_transpose(x, inverse)
    return x ^ 0x80 if kind == "x80" else x


def _pair_interleave(raw: torch.Tensor, n: int, fmt: GGMLType, caller: str) -> torch.Tensor:
    """rows of two-block units -> 16-row groups: per unit the two blocks' f16 d side by side in
    column 0 (Q4_1, Q5_1: each block's [d | m] a field), then each field's dwords as columns of
    the 16 rows (dword e of row r at 64 e + 4 r)"""
    bb, dpair, fields = _PAIR_FIELDS[fmt]
    rows = _group_rows(raw, n, 2 * bb, 16, fmt.name, caller)
    rb = rows.shape[-1]
    nu, groups = rb // (2 * bb), rows.shape[0] // 16
    b = rows.view(groups, 16, nu, 2 * bb).permute(0, 2, 1, 3)     # [groups, units, 16 rows, unit bytes]
    out = huge_empty(rows.numel()).view(groups, nu, bb // 2, 16, 4)
    if dpair:
        out[:, :, 0, :, :2].copy_(b[..., 0:2])
        out[:, :, 0, :, 2:].copy_(b[..., bb:bb + 2])
    for h in range(2):
        for off, nc, c0, step, kind in fields:
            src = b[..., h * bb + off:h * bb + off + 4 * nc].unflatten(-1, (nc, 4)).permute(0, 1, 3, 2, 4)
            out[:, :, c0 + step * h:c0 + step * h + nc].copy_(_pair_transform(kind, src, inverse=False))
    return out.view(groups * 16, rb)


def _pair_deinterleave(x16: torch.Tensor, n: int, fmt: GGMLType, caller: str) -> torch.Tensor:
    """_pair_interleave's inverse: the first n rows [n, rb] of 16-row groups [ceil16(n), rb]"""
    bb, dpair, fields = _PAIR_FIELDS[fmt]
    rb = x16.shape[-1]
    nu, groups = rb // (2 * bb), x16.numel() // (16 * rb)
    if x16.dtype != torch.uint8 or rb % (2 * bb) or x16.numel() != groups * 16 * rb or n > groups * 16:
        raise KernelError(f"{caller}: {tuple(x16.shape)} {x16.dtype} does not hold {n} rows in 16-row groups")
    g = x16.reshape(groups, nu, bb // 2, 16, 4)
    out = x16.new_empty(groups, 16, nu, 2 * bb)
    b = out.permute(0, 2, 1, 3)
    if dpair:
        b[..., 0:2].copy_(g[:, :, 0, :, :2])
        b[..., bb:bb + 2].copy_(g[:, :, 0, :, 2:])
    for h in range(2):
        for off, nc, c0, step, kind in fields:
            src = g[:, :, c0 + step * h:c0 + step * h + nc].permute(0, 1, 3, 2, 4)
            b[..., h * bb + off:h * bb + off + 4 * nc].unflatten(-1, (nc, 4)).copy_(_pair_transform(kind, src, True))
    return out.view(groups * 16, rb)[:n]


def q50_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q5_0 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/x16n_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (704
    bytes) 11 dword columns of the 16 rows (dword e of row r at 64 e + 4 r): the two blocks'
    f16 d side by side, each block's qh with its bits transposed, then the first block's 4 qs
    dwords and the second's. The rows past n are zeros; q50_deinterleave undoes it."""
    return _pair_interleave(raw, n, GGMLType.Q5_0, "q50_interleave")


def q50_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q50_interleave's inverse: the first n Q5_0 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.Q5_0, "q50_deinterleave")


def q80_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q8_0 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/q80x16_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (1088
    bytes) 17 dword columns of the 16 rows (dword e of row r at 64 e + 4 r): the two blocks'
    f16 d side by side, then the first block's 8 quant dwords and the second's, each quant
    stored as q + 128 (q ^ 0x80). The rows past n are zeros; q80_deinterleave undoes it."""
    return _pair_interleave(raw, n, GGMLType.Q8_0, "q80_interleave")


def q80_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q80_interleave's inverse: the first n Q8_0 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.Q8_0, "q80_deinterleave")


def q40_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q4_0 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/x16n_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (576
    bytes) 9 dword columns of the 16 rows: the two blocks' f16 d side by side, then the first
    block's 4 qs dwords and the second's. q40_deinterleave undoes it."""
    return _pair_interleave(raw, n, GGMLType.Q4_0, "q40_interleave")


def q40_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q40_interleave's inverse: the first n Q4_0 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.Q4_0, "q40_deinterleave")


def iq4nl_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """IQ4_NL rows [n, rb] (an even number of blocks) -> their 16-row groups, Q4_0's places
    (csrc/generic/x16n_impl.inc): per group and pair of blocks (576 bytes) the two blocks' f16 d
    side by side, then the first block's 4 code dwords and the second's. iq4nl_deinterleave
    undoes it."""
    return _pair_interleave(raw, n, GGMLType.IQ4_NL, "iq4nl_interleave")


def iq4nl_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """iq4nl_interleave's inverse: the first n IQ4_NL rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.IQ4_NL, "iq4nl_deinterleave")


def q41_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q4_1 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/x16n_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (640
    bytes) 10 dword columns of the 16 rows: each block's [d | m] dword, then the first block's
    4 qs dwords and the second's. q41_deinterleave undoes it."""
    return _pair_interleave(raw, n, GGMLType.Q4_1, "q41_interleave")


def q41_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q41_interleave's inverse: the first n Q4_1 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.Q4_1, "q41_deinterleave")


def q51_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """Q5_1 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/x16n_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (768
    bytes) 12 dword columns of the 16 rows: each block's [d | m] dword, each block's qh
    bit-transposed as Q5_0's, then the first block's 4 qs dwords and the second's.
    q51_deinterleave undoes it."""
    return _pair_interleave(raw, n, GGMLType.Q5_1, "q51_interleave")


def q51_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """q51_interleave's inverse: the first n Q5_1 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    return _pair_deinterleave(x16, n, GGMLType.Q5_1, "q51_deinterleave")


_MXFP4_BLOCK = 17   # E8M0 byte, then 16 qs bytes


def mxfp4_interleave(raw: torch.Tensor, n: int) -> torch.Tensor:
    """MXFP4 rows [n, rb] (an even number of blocks) -> their 16-row groups
    (csrc/generic/x16n_impl.inc), [ceil16(n), rb] uint8: per group and pair of blocks (544
    bytes) the 16 rows' E8M0 bytes (row r's first block at 2 r, its second at 2 r + 1), then
    the first block's 4 qs dwords and the second's as columns of the 16 rows (dword e of row r
    at 32 + 64 e + 4 r). The rows past n are zeros; mxfp4_deinterleave undoes it."""
    bb = _MXFP4_BLOCK
    rows = _group_rows(raw, n, 2 * bb, 16, "MXFP4", "mxfp4_interleave")
    rb = rows.shape[-1]
    nu, groups = rb // (2 * bb), rows.shape[0] // 16
    b = rows.view(groups, 16, nu, 2, bb).permute(0, 2, 3, 1, 4)   # [groups, units, block, 16 rows, 17]
    out = huge_empty(rows.numel()).view(groups, nu, 16 * 2 * bb)
    out[..., :32].unflatten(-1, (16, 2)).copy_(b[..., 0].transpose(-1, -2))
    out[..., 32:].unflatten(-1, (2, 4, 16, 4)).copy_(b[..., 1:].unflatten(-1, (4, 4)).transpose(-3, -2))
    return out.view(groups * 16, rb)


def mxfp4_deinterleave(x16: torch.Tensor, n: int) -> torch.Tensor:
    """mxfp4_interleave's inverse: the first n MXFP4 rows [n, rb] of 16-row groups [ceil16(n), rb]."""
    bb, rb = _MXFP4_BLOCK, x16.shape[-1]
    nu, groups = rb // (2 * bb), x16.numel() // (16 * rb)
    if x16.dtype != torch.uint8 or rb % (2 * bb) or x16.numel() != groups * 16 * rb or n > groups * 16:
        raise KernelError(f"mxfp4_deinterleave: {tuple(x16.shape)} {x16.dtype} does not hold {n} rows in 16-row groups")
    g = x16.reshape(groups, nu, 16 * 2 * bb)
    out = x16.new_empty(groups, 16, nu, 2, bb)
    b = out.permute(0, 2, 3, 1, 4)
    b[..., 0].copy_(g[..., :32].unflatten(-1, (16, 2)).transpose(-1, -2))
    b[..., 1:].unflatten(-1, (4, 4)).copy_(g[..., 32:].unflatten(-1, (2, 4, 16, 4)).transpose(-3, -2))
    return out.view(groups * 16, rb)[:n]


class _Layout(NamedTuple):
    pseudo: int          # the kernels' type of the repacked bytes
    group: int           # rows a group
    unit: int            # bytes a row's unit (a superblock; Q4_0 .. Q8_0: two blocks): rows of whole units only
    levels: tuple        # the ISA levels whose decode GEMV reads the groups
    env: str             # "0" keeps the rows
    pack: Callable[[torch.Tensor, int], torch.Tensor]
    unpack: Callable[[torch.Tensor, int], torch.Tensor]


#: GGML type -> its row-group layout
_LAYOUTS = {GGMLType.TQ2_0: _Layout(TQ2_X8, 8, _TQ2_BYTES, _X8_ISAS, "FUCINA_TQ2_X8", tq2_interleave, tq2_deinterleave),
            **{fmt: _Layout(pseudo, 16, _X16_UNIT[fmt], _X16_ISAS, env, pack, unpack)
               for fmt, pseudo, env, pack, unpack in (
                   (GGMLType.Q4_K, Q4K_X16, "FUCINA_Q4K_X16", q4k_interleave, q4k_deinterleave),
                   (GGMLType.Q6_K, Q6K_X16, "FUCINA_Q6K_X16", q6k_interleave, q6k_deinterleave),
                   (GGMLType.Q5_K, Q5K_X16, "FUCINA_Q5K_X16", q5k_interleave, q5k_deinterleave),
                   (GGMLType.IQ4_XS, IQ4XS_X16, "FUCINA_IQ4XS_X16", iq4xs_interleave, iq4xs_deinterleave),
                   (GGMLType.Q2_K, Q2K_X16, "FUCINA_Q2K_X16", q2k_interleave, q2k_deinterleave),
                   (GGMLType.Q3_K, Q3K_X16, "FUCINA_Q3K_X16", q3k_interleave, q3k_deinterleave))},
            **{fmt: _Layout(pseudo, 16, 2 * _PAIR_FIELDS[fmt][0], _X16_ISAS, env, pack, unpack)
               for fmt, pseudo, env, pack, unpack in (
                   (GGMLType.Q5_0, Q50_X16, "FUCINA_Q50_X16", q50_interleave, q50_deinterleave),
                   (GGMLType.Q8_0, Q80_X16, "FUCINA_Q80_X16", q80_interleave, q80_deinterleave),
                   (GGMLType.Q4_0, Q40_X16, "FUCINA_Q40_X16", q40_interleave, q40_deinterleave),
                   (GGMLType.Q4_1, Q41_X16, "FUCINA_Q41_X16", q41_interleave, q41_deinterleave),
                   (GGMLType.Q5_1, Q51_X16, "FUCINA_Q51_X16", q51_interleave, q51_deinterleave),
                   (GGMLType.IQ4_NL, IQ4NL_X16, "FUCINA_IQ4NL_X16", iq4nl_interleave, iq4nl_deinterleave))},
            GGMLType.MXFP4: _Layout(MXFP4_X16, 16, 2 * _MXFP4_BLOCK, _X16_ISAS, "FUCINA_MXFP4_X16", mxfp4_interleave,
                                    mxfp4_deinterleave)}
#: pseudo type -> (the GGML type of the rows, its layout)
_GROUPED = {lay.pseudo: (fmt, lay) for fmt, lay in _LAYOUTS.items()}


def deinterleave(kernel) -> torch.Tensor:
    """The GGML rows of a kernel whose bytes are in groups (TQ2_X8 and the _X16 types)."""
    if kernel.qtype not in _GROUPED:
        raise KernelError(f"deinterleave: kernel type {kernel.qtype} holds rows, not groups")
    return _GROUPED[kernel.qtype][1].unpack(kernel.raw, kernel.n)


def layout_group(weight) -> int | None:
    """Rows a group of the layout `interleave` would give this weight's kernel at the ISA in
    force; None where it would keep the rows."""
    k = getattr(weight, "kernel", None)
    lay = _LAYOUTS.get(k.qtype) if type(k) is QuantKernel else None
    if lay is None or isa() not in lay.levels or os.environ.get(lay.env, "1") == "0" or k.rb % lay.unit:
        return None
    return lay.group


def group_rows(kernel) -> int | None:
    """Rows a group of the kernel's bytes when they are in row groups; None for rows."""
    return _GROUPED[kernel.qtype][1].group if kernel is not None and kernel.qtype in _GROUPED else None


def group_view(kernel, lo: int, n: int, weight) -> "QuantKernel":
    """Rows [lo, lo + n) of a kernel whose bytes are in row groups, as a kernel of their own
    over the same bytes (lo a multiple of the group; the view's last group may hold rows past
    n, which it never reads as its own): a fused expert stack's gate or up half."""
    g = group_rows(kernel)
    if g is None:
        raise KernelError(f"group_view: kernel type {kernel.qtype} holds rows, not groups")
    if lo < 0 or n < 1 or lo % g or lo + n > kernel.n:
        raise KernelError(f"group_view: rows [{lo}, {lo + n}) are not whole {g}-row groups of {kernel.n} rows")
    k = QuantKernel.__new__(QuantKernel)
    k.weight, k.qtype, k.n, k.k, k.rb = weight, kernel.qtype, n, kernel.k, kernel.rb
    k.raw = kernel.raw[lo:lo + -(-n // g) * g]
    k.ptr = k.raw.data_ptr()
    return k


def interleave(weight) -> bool:
    """Give a weight's kernel its bytes in row groups where the ISA in force has a decode GEMV
    that reads them with plain loads: TQ2_0 in 8-row groups at an AVX2 level (it shuffled 48
    times a superblock: BENCHMARK.md "TQ2_0 decode at AVX2: 8-row groups"), Q4_K and Q6_K in
    16-row groups at AVX-512 and the AVX2 levels (no add tree and no scale copies: "Q4_K and
    Q6_K decode: 16-row groups"; Q5_K, IQ4_XS, Q2_K and Q3_K likewise: "Q5_K decode: 16-row
    groups", "IQ4_XS, Q2_K and Q3_K decode: 16-row groups"), and Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, MXFP4 and IQ4_NL rows of an even block count likewise (no add tree: "Q5_0 and Q8_0
    decode: 16-row groups", "Q4_0, Q4_1 and Q5_1 decode: 16-row groups", "MXFP4 and IQ4_NL
    decode: 16-row groups"). Every route (prefill panels,
    verify, the other ISA units) reads the layouts too and gives the same bits as the rows they
    came from. The kernel holds the copy (weight.raw keeps the rows: the reference path,
    training and the file's pages read those); True when repacked. A layout's variable set to 0 keeps the rows
    (FUCINA_TQ2_X8, FUCINA_Q4K_X16, FUCINA_Q50_X16 and the like: _LAYOUTS names them)."""
    if layout_group(weight) is None:
        return False
    k = weight.kernel
    lay = _LAYOUTS[k.qtype]   # an IntEnum key: k.qtype is an int
    k.raw = _pack16(k.raw, k.n, lay) if lay.group == 16 else lay.pack(k.raw, k.n)
    k.qtype, k.ptr = lay.pseudo, k.raw.data_ptr()
    return True


def _pack16(raw: torch.Tensor, n: int, lay: "_Layout") -> torch.Tensor:
    """raw's n rows in the layout's 16-row groups [ceil16(n), rb], the last group's missing rows
    zeros: the bytes of lay.pack (the torch reference) from `pack_groups`' native pass."""
    rows = raw.reshape(n, -1)
    rb, full = rows.shape[1], n - n % 16
    out = huge_empty(-(-n // 16) * 16 * rb).view(-1, rb)   # each byte written once
    if full:
        pack_groups(rows[:full].reshape(-1), out[:full].reshape(-1), full, lay.pseudo)
    if full < n:
        tail = rows.new_zeros(16, rb)
        tail[:n - full] = rows[full:]
        pack_groups(tail.reshape(-1), out[full:].reshape(-1), 16, lay.pseudo)
    return out


def stream_layout(weight, rows: int) -> int | None:
    """The row-group type an expert store keeps this stack's experts in (`rows` rows each),
    packing each one natively as it reads it (`read_into`): the 16-row groups, where
    `interleave` would group the stack and each expert is whole groups. None: the store keeps
    the file's rows."""
    g = layout_group(weight)
    if g != 16 or rows % g:
        return None
    return _LAYOUTS[weight.kernel.qtype].pseudo


def pack_groups(src: torch.Tensor, dst: torch.Tensor, n: int, pseudo: int) -> None:
    """n rows (a multiple of 16) of the GGML type behind `pseudo` in src -> dst in its 16-row
    groups, the bytes its `_LAYOUTS` pack writes, in one native pass (csrc/module.cpp
    group_pack: 15-31 GB/s over two threads in cache, where the torch copies run at 0.4-1.6).
    src and dst: contiguous uint8, n x row bytes each, not overlapping."""
    fmt = _group16_type(pseudo, "pack_groups")
    for t in (src, dst):
        if t.dtype != torch.uint8 or not t.is_contiguous() or t.device.type != "cpu" or n <= 0 or t.numel() % n:
            raise KernelError(f"pack_groups: {tuple(t.shape)} {t.dtype} is not {n} rows of bytes")
    if src.numel() != dst.numel():
        raise KernelError(f"pack_groups: {src.numel()} bytes in, {dst.numel()} out")
    try:
        _native.group_pack(fmt, src.data_ptr(), dst.data_ptr(), n, src.numel() // n)
    except ValueError as e:
        raise KernelError(str(e)) from None


def _group16_type(pseudo: int, caller: str) -> int:
    """The GGML type behind a 16-row group layout's pseudo type."""
    fmt, lay = _GROUPED.get(pseudo, (None, None))
    if lay is None or lay.group != 16:
        raise KernelError(f"{caller}: type {pseudo} is not a 16-row group layout")
    return int(fmt)


def read_into(reads: list[tuple[int, int, int, int | None, int, int]], stage: torch.Tensor, stages: int) -> list[int]:
    """Each read (fd, offset, size, pseudo or None, rows, address): `size` bytes of the file at
    `offset` to `address`, packed into the pseudo type's 16-row groups (`rows` rows, as
    `pack_groups`) where one is named; all of them over the kernels' threads (csrc/module.cpp
    read_experts: the expert store's misses). `stage`: `stages` buffers, one a thread, of
    stage.numel() // stages bytes each, for the packed reads. Returns each read's bytes read,
    or -errno; every read is tried."""
    if stage.dtype != torch.uint8 or not stage.is_contiguous() or stages < 1:
        raise KernelError("read_into: the stage must be contiguous uint8 buffers")
    args = [(fd, off, size, -1 if p is None else _group16_type(p, "read_into"), n, at)
            for fd, off, size, p, n, at in reads]
    cols = torch.tensor(args, dtype=torch.int64).T.contiguous() if args else torch.zeros(6, 0, dtype=torch.int64)
    status = torch.zeros(len(args), dtype=torch.int64)
    try:
        _native.read_experts(len(args), *(cols[i].data_ptr() for i in range(6)), stage.data_ptr(),
                             stage.numel() // stages, stages, status.data_ptr())
    except ValueError as e:
        raise KernelError(str(e)) from None
    return status.tolist()


def read_groups(weight, pseudo: int) -> None:
    """Attach to `weight` a kernel that reads its bytes as `pseudo`'s row groups (bytes that
    `read_into` packed: the expert store's slots)."""
    fmt, lay = _GROUPED[pseudo]
    if int(weight.qtype) != int(fmt) or weight.out_features % lay.group:
        raise KernelError(f"read_groups: {weight.name} is not {lay.group}-row groups of {fmt.name}")
    weight.kernel = QuantKernel(weight)
    weight.kernel.qtype = pseudo


class StoredKernel(QuantKernel):
    """An expert stack's kernel while an expert store holds its experts (models/expert_store.py):
    it names the type of their bytes in the store's slots, where the native step reads them
    through the store's table. The stack's own bytes are never computed with: a call is an
    error."""

    __slots__ = ()

    def __init__(self, weight, qtype: int):
        super().__init__(weight)
        self.qtype = qtype

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise KernelError(f"{self.weight.name}: the expert store holds these experts; run them through the store")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.run(ids)


# -- the decoder layer step ---------------------------------------------------------------

_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2, "situ": 3, "swiglu_clamp": 4}
# "none": a layer with its ffn only; a plan of such layers serves DecoderPlan.ffn, never run
_MIXERS = {"attention": 0, "delta_net": 1, "mla": 2, "kda": 3, "none": 4}
_FFNS = {"dense": 0, "moe": 1}
# a MoE ffn's shared-expert and routed-norm vectors (fk_plan.h FK_MOE_SHARED_FIELDS)
_MOE_SHARED_VECTORS = ("shexp_gate", "shexp_norm", "moe_in_norm", "router_norm", "moe_out_norm", "exp_scale")
# kimi-k3's vectors (fk_plan.h FK_K3_FIELDS): the latent experts' norm, the residual scores
_K3_VECTORS = ("routed_norm", "attn_res_score", "ffn_res_score", "out_res_score")
_SLOTS = {"I": 1, "F": 1, "V": 1, "W": 8}


def _delta_sizes(L: dict) -> dict[str, int]:
    """A DeltaNet (or KDA) layer's vector lengths (fk_plan.h FK_DELTA_FIELDS, FK_KDA_FIELDS)."""
    hk, hv, dk, dv = (int(L.get(k) or 0) for k in ("ssm_hk", "ssm_hv", "ssm_dk", "ssm_dv"))
    dt = hv * dk if L.get("mixer") == _MIXERS["kda"] else hv    # KDA: one bias per key channel
    return dict(conv_w=(2 * hk * dk + hv * dv) * int(L.get("d_conv") or 0), dt_bias=dt, ssm_a=hv, ssm_norm=dv)


def _gptoss_sizes(L: dict, n_embd: int) -> dict[str, int]:
    """gpt-oss's vector lengths (fk_plan.h FK_GPTOSS_FIELDS)."""
    ne, nf = int(L.get("n_expert") or 0), int(L.get("n_ff_exp") or 0)
    return dict(attn_sinks=L["n_head"], wo_bias=n_embd, gate_inp_b=ne, gate_exps_b=ne * nf, up_exps_b=ne * nf,
                down_exps_b=ne * n_embd)


def _delta_geometry(L: dict) -> tuple[str, int, int]:
    """What a DeltaNet layer's cache entry points at, as KVCache.geometry says it."""
    return ("recur", (L["d_conv"] - 1) * _delta_sizes(L)["conv_w"] // L["d_conv"],
            L["ssm_hv"] * L["ssm_dk"] * L["ssm_dv"])


class KVPointers:
    """A cache's native table (per layer k, v, base, rows as int64; the cache's memories keep
    `base` current), its capacity and per-layer geometry (kv_heads, head_dim)."""

    __slots__ = ("ptrs", "capacity", "geometry")

    def __init__(self, ptrs: torch.Tensor, capacity: int, geometry: list[tuple[int, int, int]]):
        self.ptrs, self.capacity, self.geometry = ptrs, capacity, geometry

    def layer_range(self, lo: int, hi: int) -> "KVPointers":
        """The entries of layers lo..hi-1 (what a plan over those layers reads)."""
        return KVPointers(self.ptrs[4 * lo:4 * hi], self.capacity, self.geometry[lo:hi])


def plan_schema() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The plan's and one layer's (name, kind) fields as csrc/fk_plan.h defines them."""
    if _native is None:
        raise KernelError("native kernels are not built")
    return _native.plan_schema()


def _lora_slots(name: str, weight, keep: list) -> list[int]:
    """A weight's unmerged LoRA as the plan holds it (fk_plan.h fk_lin): `weight.lora` is
    None or (A f32 [r, k], Bt f32 [r, n]), the adapters' scales folded into Bt."""
    lora = getattr(weight, "lora", None)
    if lora is None:
        return [0, 0, 0]
    a, bt = lora
    n, k = weight.out_features, weight.in_features
    r = a.shape[0] if a.dim() == 2 else -1
    if (not 1 <= r <= 1024 or any(t.dtype is not torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
                                  for t in (a, bt)) or tuple(a.shape) != (r, k) or tuple(bt.shape) != (r, n)):
        raise KernelError(f"plan: {name}'s LoRA must be contiguous f32 A [r, {k}] and B^T [r, {n}], 1 <= r <= 1024")
    keep += [a, bt]
    return [a.data_ptr(), bt.data_ptr(), r]


class DecoderPlan:
    """Every layer of a decoder as one native call (csrc/generic/step_impl.inc): per layer a
    mixer (attention: norm -> QKV (+ bias) -> q/k norms -> RoPE -> f16 KV memory -> attention
    -> O) and an ffn (dense: norm -> gate/up -> act * up -> down), with optional post-norms.
    The fields are csrc/fk_plan.h's schema, filled by name; each shape is checked here and
    again in C, and the plan keeps every tensor it points at alive. `run` updates the
    residual stream x [m, n_embd] in place.
    """

    def __init__(self, capsule, layers: list[dict], n_embd: int, n_rot: int, keep: list, n_ple: int = 0):
        self._capsule, self.n_layer, self.n_embd, self.n_rot = capsule, len(layers), n_embd, n_rot
        self.x_width = n_embd + len(layers) * n_ple   # gemma4: per-layer inputs trail each row
        # a shared-KV layer (kv_from) has no rows of its own, as its cache memory says
        self.geometry = [(0, 0) if L.get("kv_from") else _delta_geometry(L)
                         if L["mixer"] in (_MIXERS["delta_net"], _MIXERS["kda"])
                         else (1, L["mla_rank"]) if L["mixer"] == _MIXERS["mla"]   # a LatentKV's rows
                         else (L["n_kv"], L["head_dim"]) for L in layers]
        widths = {(L["rope"], L["layer_rot"] or n_rot) for L in layers}   # gemma4: a table per width
        if len({t for t, _ in widths}) != len(widths):
            raise KernelError("plan: layers sharing a RoPE table rotate different widths")
        self.table_rot = [dict(widths).get(t) for t in (0, 1)]   # None: no layer reads it
        self._keep = keep

    @classmethod
    def build(cls, *, n_embd: int, n_ff: int, n_rot: int, neox: bool, act: str, eps: float, scale: float,
              layers: list[dict], n_head: int = 0, n_kv: int = 0, head_dim: int = 0,
              n_ple: int = 0) -> "DecoderPlan | None":
        """None when some weight has no native route (the caller keeps its torch path).
        A layer dict holds the schema's layer fields by name: vectors (f32 1-d; attn_norm and
        ffn_norm required), weights (LinearWeight: wqkv or wq/wk/wv, wo, gate_up or gate/up,
        down), mixer/ffn kinds by name, n_head/n_kv/head_dim (default: the keyword
        arguments), window (0 = all), rope (table 0/1)."""
        if not available() or act not in _ACTS:
            return None
        plan_fields, layer_fields = plan_schema()
        head = dict(n_layer=len(layers), n_embd=n_embd, n_ff=n_ff, n_rot=n_rot, neox=int(neox),
                    act=_ACTS[act], eps=eps, scale=scale, n_ple=n_ple)
        slots, keep, full = cls._fill(plan_fields, head, keep=None), [], []
        for L in layers:
            L = dict(dict(n_head=n_head, n_kv=n_kv, head_dim=head_dim, window=0, rope=0, layer_rot=0, out_scale=0.0),
                     **L)
            L["mixer"], L["ffn"] = _MIXERS.get(L.get("mixer", "attention"), -1), _FFNS.get(L.get("ffn", "dense"), -1)
            cls._check_vectors(L, n_embd)
            table = L.get("tid2eid")
            if table is not None:   # deepseek4's hash routing (fk_plan.h FK_DSV4_FIELDS): kept alive here
                if (not isinstance(table, torch.Tensor) or table.dtype is not torch.int32 or table.dim() != 2
                        or not table.is_contiguous() or table.shape[1] != L.get("n_expert_used")):
                    raise KernelError("plan: tid2eid must be a contiguous int32 table [vocab, n_expert_used]")
                keep.append(table)
                L = dict(L, tid2eid=table.data_ptr(), tid_vocab=table.shape[0])
            row = cls._fill(layer_fields, L, keep)
            if row is None:
                return None
            slots += row
            full.append(L)
        try:
            capsule = _native.plan_new(np.asarray(slots, dtype=np.int64).tobytes())
        except ValueError as e:
            raise KernelError(str(e)) from None
        plan = cls(capsule, full, n_embd, n_rot, keep, n_ple)
        plan._spec = dict(n_embd=n_embd, n_ff=n_ff, n_rot=n_rot, neox=neox, act=act, eps=eps, scale=scale,
                          n_head=n_head, n_kv=n_kv, head_dim=head_dim, n_ple=n_ple, layers=list(layers))
        return plan

    def layer_range(self, lo: int, hi: int) -> "DecoderPlan | None":
        """A plan over layers lo..hi-1 alone (run it with `KVPointers.layer_range(lo, hi)`):
        running the ranges in turn over the same x is bitwise one run of every layer. None
        when the layers cannot be cut (per-layer inputs, KV shared across layers, or a
        residual bank that spans the layers)."""
        spec = self._spec
        if (not 0 <= lo < hi <= self.n_layer or spec["n_ple"]
                or any(L.get("kv_from") or L.get("attn_res_score") is not None for L in spec["layers"])):
            return None
        return DecoderPlan.build(**dict(spec, layers=spec["layers"][lo:hi]))

    def with_hooks(self, hooks: dict[int, tuple[int, int]]) -> "DecoderPlan | None":
        """This plan with native residual hooks: {layer: (fk_res_hook address, its context)},
        each called by the step on the residual rows entering its layer (csrc/fk_plan.h
        res_hook). The caller keeps what the addresses point at alive as long as the plan.
        None when the rows carry per-layer inputs (the hooks' rows are n_embd wide)."""
        spec = self._spec
        if spec["n_ple"] or any(not 0 <= i < self.n_layer for i in hooks):
            return None
        layers = [dict(L, res_hook=hooks[i][0], res_hook_ctx=hooks[i][1]) if i in hooks else L
                  for i, L in enumerate(spec["layers"])]
        return DecoderPlan.build(**dict(spec, layers=layers))

    @staticmethod
    def _check_vectors(L: dict, n_embd: int) -> None:
        d, nq, nkv = L["head_dim"], L["n_head"] * L["head_dim"], L["n_kv"] * L["head_dim"]
        gptoss = _gptoss_sizes(L, n_embd)
        sizes = dict(q_norm=d, k_norm=d, v_norm=d, qkv_bias=nq + 2 * nkv, exp_scale=L.get("n_expert", 0),
                     exp_probs_b=L.get("n_expert", 0), kv_a_norm=L.get("mla_rank", 0),
                     q_a_norm=getattr(L.get("q_a"), "out_features", 0),
                     routed_norm=getattr(L.get("routed_down"), "out_features", 0), **_delta_sizes(L), **gptoss)
        for name in ("attn_norm", "q_norm", "k_norm", "v_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm",
                     "qkv_bias", "conv_w", "dt_bias", "ssm_a", "ssm_norm", "ple_norm", "exp_probs_b", "kv_a_norm", "q_a_norm",
                     *gptoss,
                     *_MOE_SHARED_VECTORS, *_K3_VECTORS):
            v, size = L.get(name), sizes.get(name, n_embd)
            if v is not None and (v.dtype is not torch.float32 or v.dim() != 1 or not v.is_contiguous()
                                  or v.numel() != size):
                raise KernelError(f"plan: {name} must be a contiguous f32 vector of {size}")

    @staticmethod
    def _fill(schema, values: dict, keep: list | None) -> list[int] | None:
        """The int64 slots of one schema row; None when a weight has no native kernel."""
        out = []
        for name, kind in schema:
            v = values.get(name)
            if kind == "F":   # an absent setting is 0 (a field of another layer kind)
                out.append(int(np.float64(v or 0).view(np.int64)))
            elif kind == "I":
                out.append(int(v or 0))
            elif kind == "V":
                out.append(0 if v is None else v.data_ptr())
                if v is not None:
                    keep.append(v)
            elif v is None:
                out += [0] * _SLOTS["W"]
            else:
                k = getattr(v, "kernel", None)
                if not isinstance(k, QuantKernel):
                    return None
                keep.append(k.raw)
                out += [k.qtype, k.ptr, k.rb, k.n, k.k] + _lora_slots(name, v, keep)
        return out

    def fits(self, kv: "KVPointers") -> bool:
        """True when the cache's layers have the geometry this plan's layers write."""
        return isinstance(kv, KVPointers) and kv.geometry == self.geometry

    def _check_kv(self, kv: "KVPointers") -> None:
        if not isinstance(kv, KVPointers) or kv.ptrs.numel() != 4 * self.n_layer or not self.fits(kv):
            raise KernelError("plan: cache pointers do not match the layers")

    def run(self, x: torch.Tensor, kv: "KVPointers", pos0: int, tables: list[torch.Tensor]) -> None:
        """x [m, n_embd] f32 contiguous, updated in place; K/V rows written at pos0..;
        tables: RoPE (cos, sin) tables [len, n_rot / 2, 2] f32, one or two."""
        if (x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != self.x_width
                or not x.is_contiguous()):
            raise KernelError(f"plan: x must be contiguous f32 [m, {self.x_width}]")
        self._check_kv(kv)
        if pos0 + x.shape[0] > kv.capacity:
            raise KernelError(f"plan: positions {pos0}..{pos0 + x.shape[0] - 1} exceed the cache's {kv.capacity}")
        t0, t1 = self._tables(tables)
        try:
            _native.step(self._capsule, x.data_ptr(), x.shape[0], pos0, kv.ptrs.data_ptr(),
                         t0.data_ptr(), t0.shape[0], t1.data_ptr(), t1.shape[0])
        except ValueError as e:
            raise KernelError(str(e)) from None

    def run_batch(self, x: torch.Tensor, kvs: list["KVPointers"], positions: list[int],
                  tables: list[torch.Tensor]) -> None:
        """One token per stream: row i of x at positions[i] of the cache kvs[i]; x updated
        in place."""
        m = len(kvs)
        if (x.dtype is not torch.float32 or x.dim() != 2 or tuple(x.shape) != (m, self.x_width)
                or not x.is_contiguous() or len(positions) != m):
            raise KernelError(f"plan: x must be contiguous f32 [{m}, {self.x_width}], one row per cache")
        for kv, p in zip(kvs, positions):
            self._check_kv(kv)
            if not 0 <= p < kv.capacity:
                raise KernelError(f"plan: position {p} is outside a cache of {kv.capacity}")
        rows = torch.cat([kv.ptrs for kv in kvs])
        pos = torch.tensor(positions, dtype=torch.int64)
        t0, t1 = self._tables(tables)
        try:
            _native.step_batch(self._capsule, x.data_ptr(), m, rows.data_ptr(), pos.data_ptr(),
                               t0.data_ptr(), t0.shape[0], t1.data_ptr(), t1.shape[0])
        except ValueError as e:
            raise KernelError(str(e)) from None

    def ffn(self, layer: int, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer`'s ffn alone over x [m, n_embd] (a plan of "none" mixers: deepseek4's
        routed ffn between its hyper-connection mixers); ids int64 [m], the rows' token ids,
        for a hash-routed layer. A new [m, n_embd] tensor."""
        m = x.shape[0] if x.dim() == 2 else 0
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != self.n_embd or not x.is_contiguous() or not m:
            raise KernelError(f"plan: ffn rows must be contiguous f32 [m >= 1, {self.n_embd}]")
        if ids is not None and (ids.dtype is not torch.int64 or not ids.is_contiguous() or ids.numel() != m):
            raise KernelError(f"plan: ffn ids must be contiguous int64 [{m}]")
        out = torch.empty_like(x)
        try:
            _native.ffn(self._capsule, layer, x.data_ptr(), m, out.data_ptr(), 0 if ids is None else ids.data_ptr())
        except ValueError as e:
            raise KernelError(str(e)) from None
        return out

    def _tables(self, tables: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = tables[0]
        t1 = tables[1] if len(tables) > 1 else t0
        for t, rot in zip((t0, t1), self.table_rot):
            if (t.dtype is not torch.float32 or t.dim() != 3 or not t.is_contiguous()
                    or (rot is not None and t.shape[1] * 2 != rot) or t.shape[2] != 2):
                raise KernelError("plan: RoPE tables must be contiguous f32 [len, n_rot/2, 2]")
        return t0, t1
