/* AVX2 + FMA + F16C (Haswell / Zen 1 and later): u8 x s8 products go through vpmaddubsw (kept
 * from saturating, see tile_q_part) and vpmaddwd. isa/avx2vnni.cpp compiles this same unit
 * again with FK_AVX2_VNNI and AVX-VNNI on (Alder Lake, Zen 5): dot4 is then one vpdpbusd. */
#include <immintrin.h>
#include <type_traits>

#include "fk_common.h"
#include "fk_delta.h"   /* fk_delta_layer: the DeltaNet mixer of the step */
#include "fk_kda.h"     /* fk_kda_layer: the KDA mixer of the step */
#include "fk_dsv4.h"    /* fk_swiglu_clamp: deepseek4's ffn act in the step */

#pragma GCC push_options
#if FK_AVX2_VNNI
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
namespace fk_avx2vnni_ns {
#else
#define FK_AVX2_VNNI 0
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace fk_avx2_ns {
#endif

static inline float fk_h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* per dword the sum of its four u8 x s8 products: vpmaddubsw + vpmaddwd, or one vpdpbusd.
 * The same int32 as long as no vpmaddubsw pair sum saturates, which every caller keeps
 * (u <= 127 against s8, or |w| <= 128 against s8 in -127..127). */
static inline __m256i dot4(__m256i u, __m256i s) {
#if FK_AVX2_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#define FK_VBITS 256 /* generic/x86_hooks.inc: 8 lanes */
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
                const __m256i d = dot4(aw[r], WIDE ? _mm256_sign_epi8(xv, w[r]) : xv);
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

#include "generic/x86_hooks.inc"
#undef FK_C
static inline float pb_hsum(pbv v) { return hsum8(v); }

#define CB_NP 8
#define CB_MR 4
/* the low (h 0) or high (h 1) f16 halves of CB_NP dwords at col -> f32 (x16u_halves: the scales of the two-block units' groups) */
static inline void cb_f16_halves(const uint8_t *col, int h, float *dst) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)col);
    const __m256i v = h ? _mm256_srli_epi32(c, 16) : _mm256_and_si256(c, _mm256_set1_epi32(0xFFFF));   /* packus saturates */
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);   /* the 8 halves in order */
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm256_castsi256_si128(w)));
}
#define CB_F16_HALVES cb_f16_halves
/* cbg_prep's bytes: FK_TQ2_X8's activation dwords broadcast 8 times (avx2_ternary.inc) */
#define CB_GEMV_PREP_BYTES(qt, m, kp) ((size_t)(m) * (size_t)(kp) * ((qt) == FK_TQ2_X8 ? 8 : 1) + 64)
#include "generic/matmul_impl.inc"
#include "avx2_decode.inc"
#include "avx2_gemv.inc"

/* ---- the canonical kernel (matmul_impl.inc): 8 weight rows in the lanes -----------------
 * Per block the dots of all MR activation rows at once, dword outer: the row's dword broadcast
 * against dword i of the 8 rows, vpmaddubsw (u8 x s8 pairs -> int16) and vpmaddwd with ones (->
 * int32 per row), or vpdpbusd. Row by row, the frame's order kept all 8 weight dwords live (16
 * ymm with the sign trick's |w|: every register AVX2 has) beside the rows' float sums, and the
 * block loop spilled; here one dword is live against MR running int32 sums. Integer sums are
 * exact: the same I, the same bits. Per call at m = 64: Q8_0 / IQ4_NL ~0.87x, Q4_K / Q5_K /
 * Q4_1 ~0.81x the time of the rows (avx2vnni 0.86x / 0.74x). Every format takes such dots
 * (pb_dots, pb_dots_n16, pb_dots_g16), so this unit has no row-by-row pb_dot. */
#define PB_DOTS_MR 1
#define PB_U16_RUNS (!FK_AVX2_VNNI)  /* int16 runs of vpmaddubsw sums, not vpdpbusd */

/* dwords [i0, i1) of a panel block against MR activation rows, added to the running sums S:
 * vpdpbusd with VNNI, else RUN dwords' vpmaddubsw sums in int16 (cb_u16_run; RUN a divisor
 * of i0), then one vpmaddwd into S (one thread, m = 128, against pairs (RUN 2): Q4_K 1.07x
 * (groups) / 1.08x (rows), Q5_K 1.06x, Q4_0 1.06x); RUN 0: S itself int16 */
template <int MR, int RUN>
static inline void pb_dword_dots(const uint8_t *pb, const int32_t *const *xq, int64_t b, int i0, int i1, __m256i S[MR]) {
#if !FK_AVX2_VNNI
    __m256i T[MR];
#endif
#pragma GCC unroll 8
    for (int i = i0; i < i1; i++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(pb + 32 * i));
#pragma GCC unroll 4
        for (int c = 0; c < MR; c++) {
            const __m256i x = _mm256_set1_epi32(xq[c][8 * b + i]);
#if FK_AVX2_VNNI
            S[c] = _mm256_dpbusd_avx_epi32(S[c], w, x);
            __asm__("" : "+x"(S[c]));  /* a running sum: GCC would reassociate the adds into a tree and spill */
#else
            const __m256i p = _mm256_maddubs_epi16(w, x);
            if (RUN == 0) {
                S[c] = _mm256_add_epi16(S[c], p);
                __asm__("" : "+x"(S[c]));
            } else {
                T[c] = i % RUN ? _mm256_add_epi16(T[c], p) : p;
                if (i % RUN == RUN - 1) S[c] = _mm256_add_epi32(S[c], _mm256_madd_epi16(T[c], _mm256_set1_epi16(1)));
                __asm__("" : "+x"(T[c]), "+x"(S[c]));
            }
#endif
        }
    }
}

/* Every format but the 16-group ones, from zi; zero point 128 formats (bytes up to 255) without
 * VNNI as w = u - 128 with the sign trick (|w| against sign(x, w)), which leaves -128 sum q out
 * of the sum already (so those start from 0, not zi) */
template <int MR, bool WIDE, int RUN>
static inline void pb_dots(const uint8_t *pb, const int32_t *const *xq, const int32_t *const *zi, int64_t b, __m256i I[MR]) {
    constexpr bool SIGNED = WIDE && !FK_AVX2_VNNI;   /* PB_WIDE: no VNNI */
    for (int c = 0; c < MR; c++) I[c] = SIGNED ? _mm256_setzero_si256() : _mm256_set1_epi32(zi[c][b]);
    if constexpr (!SIGNED) {
        pb_dword_dots<MR, RUN>(pb, xq, b, 0, 8, I);
    } else {
        for (int i = 0; i < 8; i++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(pb + 32 * i)), _mm256_set1_epi8((char)0x80));
            const __m256i v = _mm256_abs_epi8(w);
            for (int c = 0; c < MR; c++) {
                I[c] = _mm256_add_epi32(I[c], dot4(v, _mm256_sign_epi8(_mm256_set1_epi32(xq[c][8 * b + i]), w)));
                __asm__("" : "+x"(I[c]));
            }
        }
    }
}
/* Q2_K and Q3_K (u <= 7, z <= 4): a 16-group's sum (u - z) q fits int16 (|.| <= 16 * 4 * 127),
 * as do their group scales, so the group scale multiplies in vpmaddwd, not vpmulld (2 uops,
 * 10 cycles on Intel). Without VNNI the group's vpmaddubsw sums stay int16 (the low half starts
 * at zi; at most 8128 + 8 * 7 * 127) and vpmaddwd against the scale in both halves adds them;
 * with VNNI the two groups' int32 sums pack into one dword's halves against the two scales.
 * One thread, m = 128, groups of 3072 x 1024 in cache: Q2_K 80 -> 106 GFLOP/s, Q3_K 124 -> 142
 * (avx2vnni 108 -> 130, 140 -> 165); the frame's Q2_K min term takes one vpmaddwd likewise.
 * IQ1_M (u - z within +-9, scales to 15; matmul_impl.inc's cb_n16 bounds its halves by 25400)
 * came here from pb_dots_g16: one thread, m = 16 / 128, 0.94-1.00x the time (avx2vnni
 * 0.92-0.97x). */
#define PB_DOTS_N16 1
template <int MR>
static inline void pb_dots_n16(const uint8_t *pb, const int32_t *const *xq, const int32_t *const *zi, int64_t b, __m256i I[MR]) {
    __m256i T[MR];  /* this group's sums */
#if FK_AVX2_VNNI
    __m256i L[MR];  /* the first group's */
#endif
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 4
        for (int c = 0; c < MR; c++) T[c] = _mm256_set1_epi32(FK_AVX2_VNNI ? zi[c][2 * b + h] : zi[c][2 * b + h] & 0xFFFF);
        pb_dword_dots<MR, 0>(pb, xq, b, 4 * h, 4 * h + 4, T);
        const __m256i sc = _mm256_loadu_si256((const __m256i *)(pb + 320 + 32 * h));
#if FK_AVX2_VNNI
        if (h == 0) {
            for (int c = 0; c < MR; c++) L[c] = T[c];
        } else {
            const __m256i cp = pb_halves(_mm256_loadu_si256((const __m256i *)(pb + 320)), sc);
            for (int c = 0; c < MR; c++) I[c] = _mm256_madd_epi16(pb_halves(L[c], T[c]), cp);
        }
#else
        const __m256i s2 = pb_halves(sc, sc);  /* the scale in both halves */
        for (int c = 0; c < MR; c++) {
            const __m256i p = _mm256_madd_epi16(T[c], s2);
            I[c] = h ? _mm256_add_epi32(I[c], p) : p;
        }
#endif
    }
}
/* The other 16-group formats (Q6_K, IQ2_XS, IQ2_S): each half's int32 dot from its zi,
 * then times the half's group scale (vpmulld, or in floats where V is __m256); without VNNI
 * in runs of cb_u16_run dwords (IQ2_XS's and IQ2_S's codes to 87 one). Row by row these had
 * each dword's vpmaddubsw pairs widened alone (IQ2_XS, IQ2_S) and spilled as above: one
 * thread, m = 16-128, Q6_K 0.95-0.97x, IQ1_M (here then, in runs of four) 0.92-0.96x, IQ2_XS
 * 0.98x the time (avx2vnni 0.92-0.94x, 0.93x, 0.93-0.96x). */
#define PB_DOTS_G16 1
template <int MR, int RUN, typename V>
static inline void pb_dots_g16(const uint8_t *pb, const int32_t *const *xq, const int32_t *const *zi, int64_t b, V I[MR]) {
    static_assert(RUN > 0 && 4 % RUN == 0, "runs within a 16-group");
    constexpr bool FLOATS = std::is_same<V, __m256>::value;
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i H[MR];  /* this half's sums */
#pragma GCC unroll 4
        for (int c = 0; c < MR; c++) H[c] = _mm256_set1_epi32(zi[c][2 * b + h]);
        pb_dword_dots<MR, RUN>(pb, xq, b, 4 * h, 4 * h + 4, H);
        const __m256i sc = _mm256_loadu_si256((const __m256i *)(pb + 320 + 32 * h));
        if constexpr (FLOATS) {
            const __m256 sf = _mm256_cvtepi32_ps(sc);
            for (int c = 0; c < MR; c++) {
                const __m256 p = _mm256_cvtepi32_ps(H[c]);
                I[c] = h ? _mm256_fmadd_ps(p, sf, I[c]) : _mm256_mul_ps(p, sf);
            }
        } else {
            for (int c = 0; c < MR; c++) {
                const __m256i p = _mm256_mullo_epi32(H[c], sc);
                I[c] = h ? _mm256_add_epi32(I[c], p) : p;
            }
        }
    }
}
/* With VNNI the two half sums and their scales go to floats instead (exact, as the AVX-512
 * unit's pb_dots_g16f), a multiply and an FMA in place of the vpmulld pair: one thread, m = 16
 * / 128, IQ2_XS, IQ2_S and Q6_K 0.94-0.99x the time. Without VNNI the same measured 1.05-1.10x
 * (slower), so plain AVX2 keeps vpmulld. */
#if FK_AVX2_VNNI
#define PB_DOTS_G16F 1
template <int MR, int RUN>
static inline void pb_dots_g16f(const uint8_t *pb, const int32_t *const *xq, const int32_t *const *zi, int64_t b, __m256 F[MR]) {
    pb_dots_g16<MR, RUN>(pb, xq, zi, b, F);
}
#endif

/* ---- panel builders straight off the GGML blocks (the common formats) --------------------
 * As the AVX-512 unit's, 8 rows at a time: block bytes transposed into dword order (rows past
 * nr repeat the last row), scale fields gathered one dword per row; the same panel bytes as
 * the generic way for every field the kernel reads. */

PB_INLINE void pb_rows32(const uint8_t *const *rp, int64_t off, pbi z[8]) {
    for (int j = 0; j < 8; j++) z[j] = _mm256_loadu_si256((const __m256i *)(rp[j] + off));
}
PB_INLINE void pb_rows16(const uint8_t *const *rp, int64_t off, pbi z[4]) {
    for (int j = 0; j < 4; j++)
        z[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rp[j] + off))),
                                       _mm_loadu_si128((const __m128i *)(rp[j + 4] + off)), 1);
}
static inline void pb_rows_decoded(const uint8_t *tmp, size_t ts, int nr, int64_t off, pbi z[8]) {
    for (int j = 0; j < 8; j++) z[j] = j < nr ? _mm256_loadu_si256((const __m256i *)(tmp + j * ts + off)) : _mm256_setzero_si256();
}
PB_INLINE void pb_tr_last(pbi a, pbi b, pbi &lo, pbi &hi) {
    lo = _mm256_permute2x128_si256(a, b, 0x20);
    hi = _mm256_permute2x128_si256(a, b, 0x31);
}

PB_INLINE __m256 pb_h2f_lo(__m256i g) {
    const __m256i lo = _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08)));
}
PB_INLINE __m256 pb_h2f_hi(__m256i g) { return pb_h2f_lo(_mm256_srli_epi32(g, 16)); }

/* the shim of generic/x86_panel.inc: 8 rows, one ymm dword each */
PB_INLINE pbi pb_gather(pbi vidx, const uint8_t *base) {
    return _mm256_i32gather_epi32((const int *)(const void *)base, vidx, 1);
}
PB_INLINE pbv pb_h16(const uint8_t *const *rp, pbi vidx, int64_t off) { return pb_h2f_lo(pb_gather(vidx, rp[0] + off)); }
PB_INLINE void pb_h16_dm(const uint8_t *const *rp, pbi vidx, int64_t off, pbv &d, pbv &m) {
    const pbi g = pb_gather(vidx, rp[0] + off);
    d = pb_h2f_lo(g);
    m = pb_h2f_hi(g);
}
static inline pbi pb_lut16(const uint8_t *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)); }
static inline pbi pb_index(const int32_t *off) { return _mm256_load_si256((const __m256i *)off); }
/* bytes past 127 would saturate vpmaddubsw: their own dot; vpdpbusd takes every unsigned
 * byte, and sum u q + zi (-128 sum q) is the sign trick's integer exactly */
#define PB_WIDE (!FK_AVX2_VNNI)
/* TQ1_0's leading trit of each byte w read as a base-3 fraction, (w * 3) >> 8 = (w >= 86) +
 * (w >= 171), from s = w ^ 0x80 through signed compares (pb_build_tq, cbg2_tq) */
PB_INLINE pbi pb_trit(pbi s) {
    const pbi a = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(85 - 128)), b = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(42));
    return _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_add_epi8(a, b));
}
#include "generic/x86_panel.inc"

#include "avx2_cbgemv.inc"

/* attention and the layer step on the same vectors */
namespace attn {

#include "generic/x86_attn.inc"  /* over the operations below */
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

}  // namespace attn
}  // namespace fk_avx2_ns / fk_avx2vnni_ns

#pragma GCC pop_options

#if FK_AVX2_VNNI
FK_ISA_TABLE(avx2vnni)
#else
FK_ISA_TABLE(avx2)
#endif
