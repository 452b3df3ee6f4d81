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
#define CB_KERNEL cb_kernel_avx2
#define CB_PANEL_U cb_panel_u_avx2

#include "fk_impl.inc"
#include "fk_decode_avx2.inc"
#include "fk_gemv_avx2.inc"

/* ---- the canonical kernel (fk_impl.inc): 8 weight rows in the lanes -----------------
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
                    J = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(mlo, _mm256_set1_epi32(sq[c][2 * b])),
                                                            _mm256_mullo_epi32(mhi, _mm256_set1_epi32(sq[c][2 * b + 1]))));
                } else {
                    J = _mm256_set1_ps(jf[c][b]);
                }
                Mc[c] = _mm256_fmadd_ps(J, _mm256_mul_ps(wm, d), Mc[c]);
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

/* 8 decoded rows (row j at tmp + j * ts) -> the panel's dword order: an 8 x 8 dword transpose */
static void cb_panel_u_avx2(const uint8_t *tmp, size_t ts, int nr, int64_t nblk, uint8_t *pan) {
    for (int64_t b = 0; b < nblk; b++) {
        __m256i z[8], t[8];
        for (int j = 0; j < 8; j++)
            z[j] = j < nr ? _mm256_loadu_si256((const __m256i *)(tmp + j * ts + 32 * b)) : _mm256_setzero_si256();
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
        /* z[j] (j < 4): dword j of rows 0-3 | dword j + 4 of rows 0-3; z[4 + j]: rows 4-7 */
        uint8_t *o = pan + b * CB_BLOCK;
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_si256((__m256i *)(o + 32 * j), _mm256_permute2x128_si256(z[j], z[4 + j], 0x20));
            _mm256_storeu_si256((__m256i *)(o + 32 * (4 + j)), _mm256_permute2x128_si256(z[j], z[4 + j], 0x31));
        }
    }
}

}  // namespace fk_avx2_ns

#pragma GCC pop_options

extern "C" const fk_isa fk_isa_avx2 = {"avx2", fk_avx2_ns::fk_matmul, fk_avx2_ns::fk_act_roundtrip, fk_avx2_ns::fk_dequant_row};
