"""DeepSeek-V4's small per-row ops as native calls (csrc/fk_dsv4.cpp): the hyper-connection
mixers, the RMS norm, the clamped SwiGLU, the RoPE of each head's tail and the decode
attention row (the raw window and the compressed keys, V = K, with sinks), and the grouped
output projection on Q8_0 rows with f32 activations.

`pre` takes a step's 24 mixes per row (hc_fn of the RMS-normed streams) and the four
streams, and returns the sublayer's input (the streams weighed by sigmoid(.) + eps), the
post weights (2 sigmoid(.)) and the Sinkhorn-normalised 4x4 comb; `post` spreads the
sublayer's output back over the streams and mixes the old ones by the comb. Each is one
call for all rows in the order of ggml's fused CPU ops (llama.cpp's dsv4_hc_pre /
dsv4_hc_comb / dsv4_hc_post). `rms_norm` and `swiglu_clamp` compute as ggml's CPU ops do
(the squares summed in double). `fucina.models.deepseek4` keeps the torch spelling as the
path without native kernels.
"""
from __future__ import annotations

import torch

from fucina import kernels
from fucina.kernels import KernelError

try:
    from fucina.kernels import _native
except ImportError:     # a source checkout whose extensions are not built
    _native = None

HC = 4
MIX = (2 + HC) * HC


def available() -> bool:
    return _native is not None and kernels.available() and hasattr(_native, "hc_pre")


def _f32(*ts: torch.Tensor) -> bool:
    for t in ts:   # a loop, not all(generator): these checks run ~200 times a decode token
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def pre(mix: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [m, 24], x [m, 4 n], scale [3], base [24] -> h [m, n], post [m, 4], comb [m, 4, 4]."""
    m = mix.shape[0]
    if (not _f32(mix, x, scale, base) or mix.shape != (m, MIX) or x.dim() != 2 or x.shape[0] != m
            or x.shape[1] % HC or x.shape[1] == 0 or scale.numel() != 3 or base.numel() != MIX or iters < 1):
        raise KernelError("hc.pre: mix [m, 24], x [m, 4 n], scale [3] and base [24], f32 and contiguous; "
                          "iters >= 1")
    n = x.shape[1] // HC
    h, post_w, comb = torch.empty(m, n), torch.empty(m, HC), torch.empty(m, HC, HC)
    _native.hc_pre(mix.data_ptr(), x.data_ptr(), scale.data_ptr(), base.data_ptr(), h.data_ptr(),
                   post_w.data_ptr(), comb.data_ptr(), m, n, iters, float(eps))
    return h, post_w, comb


def pre_full(x: torch.Tensor, fn, scale: torch.Tensor, base: torch.Tensor, iters: int, norm_eps: float,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pre` with its mixes made in the same call: the streams x [m, 4 n] RMS-normed (norm_eps,
    no weight), projected by fn (a QuantKernel of [24, 4 n]), then `pre`."""
    m = x.shape[0]
    if (not _f32(x, scale, base) or x.dim() != 2 or x.shape[1] % HC or x.shape[1] == 0 or m == 0
            or scale.numel() != 3 or base.numel() != MIX or iters < 1 or fn.n != MIX or fn.k != x.shape[1]):
        raise KernelError("hc.pre_full: x [m, 4 n] f32 contiguous, fn [24, 4 n], scale [3], base [24]; iters >= 1")
    n = x.shape[1] // HC
    h, post_w, comb = torch.empty(m, n), torch.empty(m, HC), torch.empty(m, HC, HC)
    try:
        _native.hc_pre_full(x.data_ptr(), fn.qtype, fn.ptr, fn.rb, scale.data_ptr(), base.data_ptr(), h.data_ptr(),
                            post_w.data_ptr(), comb.data_ptr(), m, n, iters, float(norm_eps), float(eps))
    except ValueError as e:
        raise KernelError(str(e)) from None
    return h, post_w, comb


def post(y: torch.Tensor, x: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [m, n], x [m, 4 n], post [m, 4], comb [m, 4, 4] -> the new streams [m, 4 n]."""
    m, n = y.shape[0], y.shape[-1]
    if (not _f32(y, x, post_w, comb) or y.dim() != 2 or x.shape != (m, HC * n) or post_w.shape != (m, HC)
            or comb.shape != (m, HC, HC) or n == 0):
        raise KernelError("hc.post: y [m, n], x [m, 4 n], post [m, 4], comb [m, 4, 4], f32 and contiguous")
    out = torch.empty(m, HC * n)
    _native.hc_post(y.data_ptr(), x.data_ptr(), post_w.data_ptr(), comb.data_ptr(), out.data_ptr(), m, n)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] / sqrt(mean(x^2) + eps) over the last dim, times w [n] when given."""
    n = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if w is not None and not w.is_contiguous():
        w = w.contiguous()
    if not _f32(x) or n == 0 or (w is not None and (not _f32(w) or w.numel() != n)):
        raise KernelError("dsv4.rms_norm: x [..., n] and w [n] (or None), f32")
    out = torch.empty(x.shape)
    _native.rms_norm(x.data_ptr(), 0 if w is None else w.data_ptr(), out.data_ptr(), x.numel() // n, n, float(eps))
    return out


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit); silu(g) * u when limit <= 1e-6."""
    if not g.is_contiguous():
        g = g.contiguous()
    if not u.is_contiguous():
        u = u.contiguous()
    if not _f32(g, u) or g.shape != u.shape:
        raise KernelError("dsv4.swiglu_clamp: g and u of one shape, f32")
    out = torch.empty(g.shape)
    _native.swiglu_clamp(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel(), float(limit))
    return out


def rope_tail_(x: torch.Tensor, cs: torch.Tensor, n_rot: int, inverse: bool = False) -> torch.Tensor:
    """x [m, heads, d] rotated in place on each head's last n_rot values (adjacent pairs, GGML's
    NORM mode) by row r's (cos, sin) pairs cs [m, n_rot / 2, 2]; `inverse` rotates back."""
    if (not _f32(x, cs) or x.dim() != 3 or x.shape[0] == 0 or n_rot < 2 or n_rot % 2 or n_rot > x.shape[2]
            or cs.shape != (x.shape[0], n_rot // 2, 2)):
        raise KernelError("dsv4.rope_tail: x [m, heads, d] and cs [m, n_rot / 2, 2], f32 and contiguous")
    _native.rope_tail(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], cs.data_ptr(), n_rot, int(inverse))
    return x


def attend_row_ok(heads: int, d: int) -> bool:
    """Whether attend_row takes this geometry (the decode attention's: d a multiple of 16 up
    to 1024, at most 64 heads over the one K=V row)."""
    return available() and 1 <= heads <= 64 and d % 16 == 0 and 16 <= d <= 1024


def attend_row(q: torch.Tensor, raw: torch.Tensor, comp: torch.Tensor | None, rows: torch.Tensor | None,
               sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row q [H, d] over the raw window rows raw [n, d] (f16, contiguous) and the
    compressed rows comp[rows] (comp [cap, d] f16, rows int64), V = K, each head's softmax
    with its sink sinks [H] -> [H, d]: the keys gathered into one block for the decode
    attention kernel (kernels.decode_attention's, with gpt-oss's sinks)."""
    H, d = q.shape
    n_comp = 0 if rows is None else rows.numel()
    if (not attend_row_ok(H, d) or not _f32(q, sinks) or sinks.numel() != H or raw.dtype is not torch.float16
            or not raw.is_contiguous()
            or raw.dim() != 2 or raw.shape[1] != d or (n_comp and (comp is None or comp.dtype is not torch.float16
                                                                 or not comp.is_contiguous() or comp.shape[1] != d
                                                                 or rows.dtype is not torch.int64
                                                                 or not rows.is_contiguous()))):
        raise KernelError("dsv4.attend_row: q [H, d] f32, raw [n, d] and comp [cap, d] f16, rows int64, sinks [H]")
    out = torch.empty(H, d)
    try:   # the module checks every row index against comp's length before reading a key
        _native.dsv4_attend(q.data_ptr(), H, d, raw.data_ptr(), raw.shape[0], comp.data_ptr() if n_comp else 0,
                            comp.shape[0] if n_comp else 0, rows.data_ptr() if n_comp else 0, n_comp,
                            sinks.data_ptr(), out.data_ptr(), float(scale))
    except ValueError as e:
        raise KernelError(str(e)) from None
    return out


def q8_0_grouped(w: torch.Tensor, groups: int, rank: int, x: torch.Tensor) -> torch.Tensor:
    """The grouped output projection on Q8_0 rows: w the bytes of groups * rank Q8_0 rows of
    `in` values, x [m, groups * in] f32 -> [m, groups * rank], group j's rows times its slice
    of x, in f32 (the dequantized weight's arithmetic)."""
    m = x.shape[0]
    if not x.is_contiguous():
        x = x.contiguous()
    width = x.shape[1] // groups if x.dim() == 2 and groups > 0 else 0
    if (not _f32(x) or width < 32 or width % 32 or x.shape[1] != groups * width or rank < 1 or m < 1
            or w.dtype is not torch.uint8 or not w.is_contiguous() or w.numel() != groups * rank * width // 32 * 34):
        raise KernelError("dsv4.q8_0_grouped: x [m, groups * in] f32 (in a multiple of 32) and the Q8_0 bytes of "
                          "groups * rank rows of in")
    y = torch.empty(m, groups * rank)
    _native.q8_0_grouped(w.data_ptr(), groups, rank, width, x.data_ptr(), m, y.data_ptr())
    return y


def qkv_row(ys0: torch.Tensor, ys1: torch.Tensor, q_a_norm: torch.Tensor, kv_norm: torch.Tensor, q_b, cs: torch.Tensor,
            heads: int, n_rot: int, eps: float, raw_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row's query and K=V row in one call: qr = rms_norm(ys0, q_a_norm); q = q_b(qr)
    per head RMS-normed, its tail RoPE'd by cs [n_rot / 2, 2]; kv = rms_norm(ys1, kv_norm), its
    tail RoPE'd, written into raw_row (f16 [hd]). Returns qr [1, rank] and q [1, heads, hd]."""
    rank, hd = ys0.shape[-1], ys1.shape[-1]
    if (not _f32(ys0, ys1, q_a_norm, kv_norm, cs) or ys0.numel() != rank or ys1.numel() != hd
            or q_a_norm.numel() != rank or kv_norm.numel() != hd or cs.shape != (n_rot // 2, 2)
            or q_b.k != rank or q_b.n != heads * hd or raw_row.dtype is not torch.float16
            or not raw_row.is_contiguous() or raw_row.numel() != hd):
        raise KernelError("dsv4.qkv_row: ys0 [rank], ys1 [hd], their norms, cs [n_rot / 2, 2] f32; q_b [heads hd, "
                          "rank]; raw_row f16 [hd]")
    qr, q = torch.empty(1, rank), torch.empty(1, heads, hd)
    try:
        _native.dsv4_qkv(ys0.data_ptr(), ys1.data_ptr(), q_a_norm.data_ptr(), kv_norm.data_ptr(), q_b.qtype, q_b.ptr,
                         q_b.rb, cs.data_ptr(), qr.data_ptr(), q.data_ptr(), raw_row.data_ptr(), rank, heads, hd,
                         n_rot, float(eps))
    except ValueError as e:
        raise KernelError(str(e)) from None
    return qr, q


def _row_ok(t: torch.Tensor | None, n: int, dtype: torch.dtype = torch.float32) -> bool:
    return t is not None and t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.numel() == n


def attn_in(x: torch.Tensor, w_in, split: list[int], q_a_norm: torch.Tensor, kv_norm: torch.Tensor, q_b,
            cs: torch.Tensor, heads: int, n_rot: int, eps: float, raw_row: torch.Tensor,
            st: tuple | None = None, lid: tuple | None = None):
    """A decode row's attention input in one call: ys = w_in(x) split as `split` (q_a | kv [|
    compressor kv | score [| indexer compressor kv | score | indexer head weights]]); qkv_row on
    the first two parts (raw_row written); `st` = (kv_row, score_row, ape_row) and `lid` likewise
    receive the compressor state rows (score + ape). Returns qr [1, rank], q [1, heads, hd] and
    the indexer's head weights [1, n_idx] (None without `lid`). Bit for bit the separate calls."""
    rank, hd = split[0], split[1]
    st_w = split[2] if st is not None else 0
    lid_w = split[4] if lid is not None else 0
    n_idx = split[6] if lid is not None else 0
    want = [rank, hd] + ([st_w, st_w] if st is not None else []) + ([lid_w, lid_w, n_idx] if lid is not None else [])
    if (list(split) != want or lid is not None and st is None or not _row_ok(x, w_in.k) or w_in.n != sum(split)
            or not _row_ok(q_a_norm, rank) or not _row_ok(kv_norm, hd) or not _f32(cs) or cs.shape != (n_rot // 2, 2)
            or q_b.k != rank or q_b.n != heads * hd or not _row_ok(raw_row, hd, torch.float16)
            or (st is not None and not all(_row_ok(t, st_w) for t in st))
            or (lid is not None and not all(_row_ok(t, lid_w) for t in lid))):
        raise KernelError("dsv4.attn_in: x [1, k], the fused input weight of rows `split`, the norms, cs [n_rot / 2, "
                          "2], q_b [heads hd, rank], an f16 raw row and f32 state rows of the split's widths")
    qr, q = torch.empty(1, rank), torch.empty(1, heads, hd)
    idx = torch.empty(1, n_idx) if n_idx else None
    z = (0, 0, 0)
    sk, ss, sa = (t.data_ptr() for t in st) if st is not None else z
    lk, ls, la = (t.data_ptr() for t in lid) if lid is not None else z
    try:
        _native.dsv4_attn_in(x.data_ptr(), w_in.qtype, w_in.ptr, w_in.rb, w_in.k, rank, hd, q_a_norm.data_ptr(),
                             kv_norm.data_ptr(), q_b.qtype, q_b.ptr, q_b.rb, cs.data_ptr(), heads, n_rot,
                             raw_row.data_ptr(), st_w, sk, ss, sa, lid_w, lk, ls, la, n_idx,
                             0 if idx is None else idx.data_ptr(), qr.data_ptr(), q.data_ptr(), float(eps))
    except ValueError as e:
        raise KernelError(str(e)) from None
    return qr, q, idx


def attn_out(q: torch.Tensor, raw: torch.Tensor, comp: torch.Tensor | None, ratio: int, n_vis: int,
             blocks: torch.Tensor | None, sinks: torch.Tensor, cs: torch.Tensor, n_rot: int, wo_a: torch.Tensor,
             groups: int, o_rank: int, wo_b, scale: float) -> torch.Tensor:
    """A decode row's attention and output projections in one call: attend_row over the raw
    window rows raw [n, d] and the compressed keys (the chosen `blocks`, else all n_vis visible;
    block b's key at comp row (b + 1) ratio - 1), the inverse RoPE of the heads' tails by cs,
    q8_0_grouped(wo_a) and wo_b -> [1, n_embd]. Bit for bit the separate calls."""
    H, d = q.shape[-2], q.shape[-1]
    if blocks is not None and blocks.numel() == 0:   # the indexer kept no block: the raw window alone
        blocks, n_vis = None, 0
    n_comp = 0 if not ratio else (n_vis if blocks is None else blocks.numel())
    width = H * d // groups if groups > 0 else 0
    if (not attend_row_ok(H, d) or not _row_ok(q, H * d) or not _row_ok(sinks, H) or raw.dtype is not torch.float16
            or not raw.is_contiguous() or raw.dim() != 2 or raw.shape[1] != d
            or (n_comp and (comp is None or comp.dtype is not torch.float16 or not comp.is_contiguous()
                            or comp.dim() != 2 or comp.shape[1] != d))
            or (blocks is not None and (blocks.dtype is not torch.int64 or not blocks.is_contiguous()))
            or not _f32(cs) or cs.shape != (n_rot // 2, 2) or groups < 1 or H * d != groups * width or width % 32
            or wo_a.dtype is not torch.uint8 or not wo_a.is_contiguous()
            or wo_a.numel() != groups * o_rank * width // 32 * 34 or wo_b.k != groups * o_rank):
        raise KernelError("dsv4.attn_out: q [H, d] f32, raw [n, d] and comp [cap, d] f16, int64 blocks, sinks [H], "
                          "cs [n_rot / 2, 2], Q8_0 wo_a of groups * o_rank rows, wo_b [n_embd, groups * o_rank]")
    out = torch.empty(1, wo_b.n)
    try:   # the module checks every block against n_vis and comp's length before reading a key
        _native.dsv4_attn_out(q.data_ptr(), H, d, raw.data_ptr(), raw.shape[0], comp.data_ptr() if n_comp else 0,
                              comp.shape[0] if n_comp else 0, ratio, n_vis,
                              0 if blocks is None else blocks.data_ptr(), 0 if blocks is None else blocks.numel(),
                              sinks.data_ptr(), cs.data_ptr(), n_rot, wo_a.data_ptr(), groups, o_rank, wo_b.qtype,
                              wo_b.ptr, wo_b.rb, wo_b.n, out.data_ptr(), float(scale))
    except ValueError as e:
        raise KernelError(str(e)) from None
    return out
