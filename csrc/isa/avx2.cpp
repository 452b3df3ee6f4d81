/* AVX2 + FMA + F16C (Haswell / Zen 1 and later). No VNNI here: u8 x s8 products go through
 * vpmaddubsw (kept from saturating, see tile_q_part) and vpmaddwd. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "fk_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")

namespace fk_avx2_ns {

static inline float fk_h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define FK_C 4
/* R x C block of int8 dots, 32 values a step: vpmaddubsw (u8 x s8 pairs -> int16), vpmaddwd
 * with ones (-> int32 per 4-value lane), then one FMA with the lane scales (weight x act).
 * Decoded weights u <= 127 go in as they are (2 * 127 * 127 < 32767). Wider rows (Q8_0,
 * IQ4_*: bytes up to 255) go in as w = u - 128 (s8) with the sign trick (|w| x sign(x, w),
 * at most 2 * 128 * 127), and the 128 * ls * sum(x) that leaves out joins the row's offsets:
 * off + 128 * ls, which is exactly 0 for those formats (off = -128 * d, ls = d). */
template <int R, int C, bool WIDE>
static inline void tile_q_part(const uint8_t *wt, const uint8_t *xt, size_t rowsz, int64_t kp, float out[][FK_C], int c0) {
    __m256 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (size_t i = 0; i < (size_t)kp; i += 32) {
        __m256i w[R], aw[R];
        for (int r = 0; r < R; r++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(wt + r * rowsz + i));
            w[r] = WIDE ? _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)) : u;
            aw[r] = WIDE ? _mm256_abs_epi8(w[r]) : u;
        }
        for (int c = 0; c < C; c++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xt + c * rowsz + i));
            const __m256 xs = _mm256_loadu_ps((const float *)(xt + c * rowsz + kp) + i / 4);
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_maddubs_epi16(aw[r], WIDE ? _mm256_sign_epi8(xv, w[r]) : xv);
                const __m256i d = _mm256_madd_epi16(p, ones);
                const __m256 ws = _mm256_loadu_ps((const float *)(wt + r * rowsz + kp) + i / 4);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, xs), acc[r][c]);
            }
        }
    }
    const int64_t n16 = kp / 16; /* a multiple of 4 */
    for (int r = 0; r < R; r++) {
        const float *wo = (const float *)(wt + r * rowsz + 2 * kp), *wl = (const float *)(wt + r * rowsz + kp);
        __m128 s[C];
        for (int c = 0; c < C; c++) s[c] = _mm_setzero_ps();
        for (int64_t j0 = 0; j0 < n16; j0 += 64) {
            const int64_t nj = n16 - j0 < 64 ? n16 - j0 : 64;
            alignas(16) float o[64];
            const float *op = wo + j0;
            if (WIDE) {
                for (int64_t j = 0; j < nj; j++) o[j] = fmaf(wl[4 * (j0 + j)], 128.0f, wo[j0 + j]);
                op = o;
            }
            for (int c = 0; c < C; c++) {
                const float *xo = (const float *)(xt + c * rowsz + 2 * kp) + j0;
                for (int64_t j = 0; j < nj; j += 4) s[c] = _mm_fmadd_ps(_mm_loadu_ps(op + j), _mm_loadu_ps(xo + j), s[c]);
            }
        }
        for (int c = 0; c < C; c++) {
            __m128 t = _mm_add_ps(s[c], _mm_movehl_ps(s[c], s[c]));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            out[r][c0 + c] = hsum8(acc[r][c]) + _mm_cvtss_f32(t);
        }
    }
}

template <int R, int C>
static inline void tile_q(const uint8_t *wt, const uint8_t *xt, size_t rowsz, int64_t kp, float out[][FK_C]) {
    static_assert(R % 2 == 0, "rows in pairs");
    __m256i any = _mm256_setzero_si256(); /* a decoded byte >= 128 anywhere in the tile? */
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < kp; i += 32) any = _mm256_or_si256(any, _mm256_loadu_si256((const __m256i *)(wt + r * rowsz + i)));
    const bool wide = _mm256_movemask_epi8(any) != 0;
    for (int r = 0; r < R; r += 2) { /* two rows a pass: 2 x C accumulators stay in registers */
        if (!wide) {
            tile_q_part<2, C, false>(wt + r * rowsz, xt, rowsz, kp, out + r, 0);
        } else {
            tile_q_part<2, C, true>(wt + r * rowsz, xt, rowsz, kp, out + r, 0);
        }
    }
}

template <int R, int C>
static inline void tile_f(const float *wt, int64_t ldw, const float *xt, int64_t ldx, int64_t kp, float out[][FK_C]) {
    __m256 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kp; i += 8) {
        __m256 w[R];
        for (int r = 0; r < R; r++) w[r] = _mm256_loadu_ps(wt + r * ldw + i);
        for (int c = 0; c < C; c++) {
            const __m256 xv = _mm256_loadu_ps(xt + c * ldx + i);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(w[r], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = hsum8(acc[r][c]);
}
#undef FK_C

static bool fast_decode(int qt, const uint8_t *__restrict src, int64_t k, int64_t kp, uint8_t *__restrict dst);
#define FK_FAST_DECODE fast_decode
static bool gemv_ok(int qt);
static void gemv_rows(int qt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                      const uint8_t *g, float *y);
static const uint8_t *gemv_prep(int qt, const uint8_t *act, int64_t k, int64_t kp, int slot);
#define FK_FAST_GEMV_OK gemv_ok
#define FK_FAST_GEMV gemv_rows
#define FK_FAST_GEMV_PREP gemv_prep
static bool fast_quant_act(const float *__restrict x, int64_t k, int64_t kp, uint8_t *__restrict dst);
#define FK_FAST_QUANT_ACT fast_quant_act

#define CB_NP 8
#define CB_MR 4
static void cb_kernel_avx2(int qt, const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow,
                           int64_t kp, int mr, float *acc, float *macc);
static void cb_panel_u_avx2(const uint8_t *tmp, size_t ts, int nr, int64_t nblk, uint8_t *pan);
static bool cb_fast_panel_avx2(int qt, const uint8_t *w, size_t rb, int64_t n0, int nr, int64_t b0, int64_t b1,
                               uint8_t *pan);
#define CB_HAS_GEMV  /* the unit defines cbg_ok / cbg_prep / cbg_gemv (matmul_impl.inc) */
#define CB_KERNEL cb_kernel_avx2
#define CB_PANEL_U cb_panel_u_avx2
#define CB_FAST_PANEL cb_fast_panel_avx2

#include "generic/matmul_impl.inc"
#include "avx2_decode.inc"
#include "avx2_gemv.inc"

/* ---- the canonical kernel (matmul_impl.inc): 8 weight rows in the lanes -----------------
 * Per block and activation row: the row's dword broadcast against dword i of the 8 rows,
 * vpmaddubsw (u8 x s8 pairs -> int16) and vpmaddwd with ones (-> int32 per row). Values
 * up to 63 go in as they are, two products added in int16 (2 * 2 * 63 * 127 < 32767);
 * zero point 128 formats (bytes up to 255) as w = u - 128 with the sign trick, which
 * leaves -128 sum q out of the sum already (so those start from 0, not zi). */
template <int MR, bool WIDE, bool G16, bool MIN, bool Q2K>
static inline void cb_kern(const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow, int64_t kp,
                           float *acc, float *macc) {
    const int64_t nbp = kp / 32;
    const int32_t *xq[MR], *zi[MR], *sq[MR];
    const float *dx[MR], *jf[MR];
    __m256 A[MR], Mc[MR];
    for (int c = 0; c < MR; c++) {
        const uint8_t *x = act + c * arow;
        xq[c] = (const int32_t *)x;
        dx[c] = (const float *)(x + 2 * kp + kp / 4);
        jf[c] = dx[c] + nbp;
        zi[c] = (const int32_t *)(jf[c] + nbp);
        sq[c] = zi[c] + 2 * nbp;
        A[c] = _mm256_loadu_ps(acc + 8 * c);
        Mc[c] = _mm256_loadu_ps(macc + 8 * c);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *pb = pan + (b - b0) * CB_BLOCK;
        __m256i w[8], aw[8];
        for (int i = 0; i < 8; i++) {
            w[i] = _mm256_loadu_si256((const __m256i *)(pb + 32 * i));
            if (WIDE) {
                w[i] = _mm256_xor_si256(w[i], _mm256_set1_epi8((char)0x80));
                aw[i] = _mm256_abs_epi8(w[i]);
            }
        }
        const __m256 ws = _mm256_loadu_ps((const float *)(pb + 256));
        for (int c = 0; c < MR; c++) {
            const int32_t *xd = xq[c] + 8 * b;
            __m256i I;
            if (WIDE) {
                I = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++) {
                    const __m256i p = _mm256_maddubs_epi16(aw[i], _mm256_sign_epi8(_mm256_set1_epi32(xd[i]), w[i]));
                    I = _mm256_add_epi32(I, _mm256_madd_epi16(p, ones));
                }
            } else {
                __m256i s[4];
                for (int i = 0; i < 4; i++)
                    s[i] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w[2 * i], _mm256_set1_epi32(xd[2 * i])),
                                                              _mm256_maddubs_epi16(w[2 * i + 1], _mm256_set1_epi32(xd[2 * i + 1]))),
                                             ones);
                if (G16) {
                    const __m256i lo = _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_set1_epi32(zi[c][2 * b]));
                    const __m256i hi = _mm256_add_epi32(_mm256_add_epi32(s[2], s[3]), _mm256_set1_epi32(zi[c][2 * b + 1]));
                    I = _mm256_add_epi32(_mm256_mullo_epi32(lo, _mm256_loadu_si256((const __m256i *)(pb + 320))),
                                         _mm256_mullo_epi32(hi, _mm256_loadu_si256((const __m256i *)(pb + 352))));
                } else {
                    I = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])),
                                         _mm256_set1_epi32(zi[c][b]));
                }
            }
            const __m256 d = _mm256_set1_ps(dx[c][b]);
            A[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(ws, d), A[c]);
            if (MIN) {
                const __m256 wm = _mm256_loadu_ps((const float *)(pb + 288));
                __m256 J;
                if (Q2K) {
                    const __m256i mlo = _mm256_loadu_si256((const __m256i *)(pb + 384)), mhi = _mm256_loadu_si256((const __m256i *)(pb + 416));
                    J = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(mlo, _mm256_set1_epi32(sq[c][2 * b])),
                                                            _mm256_mullo_epi32(mhi, _mm256_set1_epi32(sq[c][2 * b + 1])))));
                } else {
                    J = _mm256_set1_ps(jf[c][b]);
                }
                Mc[c] = _mm256_fmadd_ps(wm, J, Mc[c]);
            }
        }
    }
    for (int c = 0; c < MR; c++) {
        _mm256_storeu_ps(acc + 8 * c, A[c]);
        _mm256_storeu_ps(macc + 8 * c, Mc[c]);
    }
}

template <bool WIDE, bool G16, bool MIN, bool Q2K>
static void cb_kern_mr(int mr, const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow, int64_t kp,
                       float *acc, float *macc) {
    switch (mr) {
    case 1: cb_kern<1, WIDE, G16, MIN, Q2K>(pan, b0, b1, act, arow, kp, acc, macc); break;
    case 2: cb_kern<2, WIDE, G16, MIN, Q2K>(pan, b0, b1, act, arow, kp, acc, macc); break;
    case 3: cb_kern<3, WIDE, G16, MIN, Q2K>(pan, b0, b1, act, arow, kp, acc, macc); break;
    default: cb_kern<4, WIDE, G16, MIN, Q2K>(pan, b0, b1, act, arow, kp, acc, macc); break;
    }
}

static void cb_kernel_avx2(int qt, const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow,
                           int64_t kp, int mr, float *acc, float *macc) {
    if (cb_z(qt) == 128) cb_kern_mr<true, false, false, false>(mr, pan, b0, b1, act, arow, kp, acc, macc);
    else if (qt == FK_Q2_K) cb_kern_mr<false, true, true, true>(mr, pan, b0, b1, act, arow, kp, acc, macc);
    else if (cb_g16(qt)) cb_kern_mr<false, true, false, false>(mr, pan, b0, b1, act, arow, kp, acc, macc);
    else if (cb_min(qt)) cb_kern_mr<false, false, true, false>(mr, pan, b0, b1, act, arow, kp, acc, macc);
    else cb_kern_mr<false, false, false, false>(mr, pan, b0, b1, act, arow, kp, acc, macc);
}

/* ---- panel builders straight off the GGML blocks (the common formats) --------------------
 * As the AVX-512 unit's, 8 rows at a time: block bytes transposed into dword order (rows past
 * nr repeat the last row), scale fields gathered one dword per row; the same panel bytes as
 * the generic way for every field the kernel reads. */

/* an 8 x 8 dword transpose: z[j] = row j's 8 dwords -> out[i] = dword i of rows 0..7
 * (z is clobbered) */
static inline void tr8x8(__m256i z[8], __m256i out[8]) {
    __m256i t[8];
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(z[j], z[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(z[j], z[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        z[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
        z[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
        z[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
        z[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2x128_si256(z[j], z[4 + j], 0x20);
        out[4 + j] = _mm256_permute2x128_si256(z[j], z[4 + j], 0x31);
    }
}

static inline void tr8x8_rows(const uint8_t *const *rp, int64_t off, __m256i out[8]) {
    __m256i z[8];
    for (int j = 0; j < 8; j++) z[j] = _mm256_loadu_si256((const __m256i *)(rp[j] + off));
    tr8x8(z, out);
}

static inline void tr8x4_rows(const uint8_t *const *rp, int64_t off, __m256i out[4]) {
    __m256i z[4];
    for (int j = 0; j < 4; j++)
        z[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rp[j] + off))),
                                       _mm_loadu_si128((const __m128i *)(rp[j + 4] + off)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

static inline __m256 h2f_lo8(__m256i g) {
    const __m256i lo = _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08)));
}
static inline __m256 h2f_hi8(__m256i g) { return h2f_lo8(_mm256_srli_epi32(g, 16)); }

static inline __m256i bits4_to_b4_8(__m256i t) {
    const __m256i spread = _mm256_mullo_epi32(_mm256_and_si256(t, _mm256_set1_epi32(15)), _mm256_set1_epi32(0x00204081));
    return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(0x01010101)), 4);
}

static inline __m256i gather8(__m256i vidx, const uint8_t *base) {
    return _mm256_i32gather_epi32((const int *)(const void *)base, vidx, 1);
}

template <int QT>
static void cb_build32_avx2(const uint8_t *const *rp, __m256i vidx, int64_t b0, int64_t b1, uint8_t *pan) {
    const int bs = QT == FK_Q4_0 || QT == FK_IQ4_NL ? 18 : QT == FK_Q4_1 ? 20 : QT == FK_Q5_0 ? 22 : QT == FK_Q5_1 ? 24 : 34;
    const int qo = QT == FK_Q4_1 ? 4 : QT == FK_Q5_0 ? 6 : QT == FK_Q5_1 ? 8 : 2;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4_u8));
    for (int64_t b = b0; b < b1; b++) {
        uint8_t *pb = pan + (b - b0) * CB_BLOCK;
        const int64_t o = b * bs;
        const __m256i g0 = gather8(vidx, rp[0] + o);
        _mm256_storeu_ps((float *)(pb + 256), h2f_lo8(g0));
        if (QT == FK_Q4_1 || QT == FK_Q5_1) _mm256_storeu_ps((float *)(pb + 288), h2f_hi8(g0));
        if (QT == FK_Q8_0) {
            __m256i v[8];
            tr8x8_rows(rp, o + 2, v);
            for (int i = 0; i < 8; i++)
                _mm256_storeu_si256((__m256i *)(pb + 32 * i), _mm256_xor_si256(v[i], _mm256_set1_epi8((char)0x80)));
            continue;
        }
        __m256i v[4];
        tr8x4_rows(rp, o + qo, v);
        __m256i qh = _mm256_setzero_si256();
        if (QT == FK_Q5_0 || QT == FK_Q5_1) qh = gather8(vidx, rp[0] + o + qo - 4);
        for (int i = 0; i < 4; i++) {
            __m256i a = _mm256_and_si256(v[i], m4), c = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), m4);
            if (QT == FK_IQ4_NL) {
                a = _mm256_shuffle_epi8(lut, a);
                c = _mm256_shuffle_epi8(lut, c);
            }
            if (QT == FK_Q5_0 || QT == FK_Q5_1) {
                a = _mm256_or_si256(a, bits4_to_b4_8(_mm256_srli_epi32(qh, 4 * i)));
                c = _mm256_or_si256(c, bits4_to_b4_8(_mm256_srli_epi32(qh, 16 + 4 * i)));
            }
            _mm256_storeu_si256((__m256i *)(pb + 32 * i), a);
            _mm256_storeu_si256((__m256i *)(pb + 32 * (4 + i)), c);
        }
    }
}

template <int QT>
static void cb_build_q45k_avx2(const uint8_t *const *rp, __m256i vidx, int64_t b0, int64_t b1, uint8_t *pan) {
    const int bs = QT == FK_Q4_K ? 144 : 176, qo = QT == FK_Q4_K ? 16 : 48;
    const __m256i m4 = _mm256_set1_epi8(15), m6 = _mm256_set1_epi32(63), m2 = _mm256_set1_epi32(3), mf = _mm256_set1_epi32(15);
    for (int64_t sb = b0 / 8; sb < b1 / 8; sb++) {
        const int64_t o = sb * bs;
        uint8_t *ps = pan + (sb * 8 - b0) * CB_BLOCK;
        const __m256i g = gather8(vidx, rp[0] + o), u0 = gather8(vidx, rp[0] + o + 4);
        const __m256i u1 = gather8(vidx, rp[0] + o + 8), u2 = gather8(vidx, rp[0] + o + 12);
        const __m256 d = h2f_lo8(g), nm = _mm256_sub_ps(_mm256_setzero_ps(), h2f_hi8(g));
        for (int j = 0; j < 8; j++) {
            __m256i sc, mn;
            if (j < 4) {
                sc = _mm256_and_si256(_mm256_srli_epi32(u0, 8 * j), m6);
                mn = _mm256_and_si256(_mm256_srli_epi32(u1, 8 * j), m6);
            } else {
                const int sh = 8 * (j - 4);
                sc = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, sh), mf),
                                     _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, sh + 6), m2), 4));
                mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, sh + 4), mf),
                                     _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, sh + 6), m2), 4));
            }
            uint8_t *pb = ps + j * CB_BLOCK;
            _mm256_storeu_ps((float *)(pb + 256), _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
            _mm256_storeu_ps((float *)(pb + 288), _mm256_mul_ps(nm, _mm256_cvtepi32_ps(mn)));
        }
        __m256i h[8];
        if (QT == FK_Q5_K) tr8x8_rows(rp, o + 16, h);
        for (int c = 0; c < 4; c++) {
            __m256i v[8];
            tr8x8_rows(rp, o + qo + 32 * c, v);
            uint8_t *pa = ps + 2 * c * CB_BLOCK, *pz = pa + CB_BLOCK;
            for (int i = 0; i < 8; i++) {
                __m256i a = _mm256_and_si256(v[i], m4), z = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), m4);
                if (QT == FK_Q5_K) {
                    const __m256i b16 = _mm256_set1_epi8(16);
                    a = _mm256_or_si256(a, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h[i], 2 * c), 4), b16));
                    z = _mm256_or_si256(z, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h[i], 2 * c + 1), 4), b16));
                }
                _mm256_storeu_si256((__m256i *)(pa + 32 * i), a);
                _mm256_storeu_si256((__m256i *)(pz + 32 * i), z);
            }
        }
    }
}

static void cb_build_q6k_avx2(const uint8_t *const *rp, __m256i vidx, int64_t b0, int64_t b1, uint8_t *pan) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), mc = _mm256_set1_epi8(12), m30 = _mm256_set1_epi8(0x30);
    for (int64_t sb = b0 / 8; sb < b1 / 8; sb++) {
        const int64_t o = sb * 210;
        uint8_t *ps = pan + (sb * 8 - b0) * CB_BLOCK;
        const __m256 d = h2f_hi8(gather8(vidx, rp[0] + o + 206));
        __m256i sc[4];
        for (int q = 0; q < 4; q++) sc[q] = gather8(vidx, rp[0] + o + 192 + 4 * q);
        for (int j = 0; j < 8; j++) {
            uint8_t *pb = ps + j * CB_BLOCK;
            _mm256_storeu_ps((float *)(pb + 256), d);
            for (int hh = 0; hh < 2; hh++) {
                const int g = 2 * j + hh;
                _mm256_storeu_si256((__m256i *)(pb + 320 + 32 * hh), _mm256_srai_epi32(_mm256_slli_epi32(sc[g / 4], 24 - 8 * (g % 4)), 24));
            }
        }
        for (int n = 0; n < 2; n++) {
            __m256i A[8], B[8], H[8];
            tr8x8_rows(rp, o + 64 * n, A);
            tr8x8_rows(rp, o + 64 * n + 32, B);
            tr8x8_rows(rp, o + 128 + 32 * n, H);
            uint8_t *p0 = ps + 4 * n * CB_BLOCK;
            for (int i = 0; i < 8; i++) {
                const __m256i e0 = _mm256_or_si256(_mm256_and_si256(A[i], m4), _mm256_slli_epi16(_mm256_and_si256(H[i], m3), 4));
                const __m256i e1 = _mm256_or_si256(_mm256_and_si256(B[i], m4), _mm256_slli_epi16(_mm256_and_si256(H[i], mc), 2));
                const __m256i e2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A[i], 4), m4), _mm256_and_si256(H[i], m30));
                const __m256i e3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B[i], 4), m4),
                                                   _mm256_and_si256(_mm256_srli_epi16(H[i], 2), m30));
                _mm256_storeu_si256((__m256i *)(p0 + 32 * i), e0);
                _mm256_storeu_si256((__m256i *)(p0 + CB_BLOCK + 32 * i), e1);
                _mm256_storeu_si256((__m256i *)(p0 + 2 * CB_BLOCK + 32 * i), e2);
                _mm256_storeu_si256((__m256i *)(p0 + 3 * CB_BLOCK + 32 * i), e3);
            }
        }
    }
}

static bool cb_fast_panel_avx2(int qt, const uint8_t *w, size_t rb, int64_t n0, int nr, int64_t b0, int64_t b1,
                               uint8_t *pan) {
    const uint8_t *rp[8];
    alignas(32) int32_t off[8];
    for (int r = 0; r < 8; r++) {
        const int rr = r < nr ? r : nr - 1;
        rp[r] = w + (n0 + rr) * rb;
        off[r] = (int32_t)(rr * rb);
    }
    const __m256i vidx = _mm256_load_si256((const __m256i *)off);
    switch (qt) {
    case FK_Q4_0: cb_build32_avx2<FK_Q4_0>(rp, vidx, b0, b1, pan); return true;
    case FK_Q4_1: cb_build32_avx2<FK_Q4_1>(rp, vidx, b0, b1, pan); return true;
    case FK_IQ4_NL: cb_build32_avx2<FK_IQ4_NL>(rp, vidx, b0, b1, pan); return true;
    case FK_Q5_0: cb_build32_avx2<FK_Q5_0>(rp, vidx, b0, b1, pan); return true;
    case FK_Q5_1: cb_build32_avx2<FK_Q5_1>(rp, vidx, b0, b1, pan); return true;
    case FK_Q8_0: cb_build32_avx2<FK_Q8_0>(rp, vidx, b0, b1, pan); return true;
    case FK_Q4_K: cb_build_q45k_avx2<FK_Q4_K>(rp, vidx, b0, b1, pan); return true;
    case FK_Q5_K: cb_build_q45k_avx2<FK_Q5_K>(rp, vidx, b0, b1, pan); return true;
    case FK_Q6_K: cb_build_q6k_avx2(rp, vidx, b0, b1, pan); return true;
    }
    return false;
}

/* 8 decoded rows (row j at tmp + j * ts) -> the panel's dword order: an 8 x 8 dword transpose */
static void cb_panel_u_avx2(const uint8_t *tmp, size_t ts, int nr, int64_t nblk, uint8_t *pan) {
    for (int64_t b = 0; b < nblk; b++) {
        __m256i z[8], out[8];
        for (int j = 0; j < 8; j++)
            z[j] = j < nr ? _mm256_loadu_si256((const __m256i *)(tmp + j * ts + 32 * b)) : _mm256_setzero_si256();
        tr8x8(z, out);
        uint8_t *o = pan + b * CB_BLOCK;
        for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(o + 32 * i), out[i]);
    }
}

#include "avx2_cbgemv.inc"

}  // namespace fk_avx2_ns

#pragma GCC pop_options

/* attention and the layer step on 8-lane ymm (the target the attention was written for) */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fk_avx2_attn {

#define VW 8
#define FK_VP _mm256
typedef __m256 vf;
static inline vf vloadh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void vstoreh(uint16_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline float vhadd(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vblend_neg(vf z, vf a, vf b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ)); }
#include "generic/simd_ops.inc"
#include "generic/attn_impl.inc"
#include "generic/step_impl.inc"
#undef VW
#undef FK_VP
#undef FK_AB

}  // namespace fk_avx2_attn
#pragma GCC pop_options

extern "C" const fk_isa fk_isa_avx2 = {"avx2", fk_avx2_ns::fk_matmul, fk_avx2_ns::fk_act_roundtrip,
                                       fk_avx2_ns::fk_dequant_row, fk_avx2_attn::fk_attn_decode_impl,
                                       fk_avx2_attn::fk_step_impl};
