/* AVX-512 (F, BW, VL, DQ) + VNNI: vpdpbusd does 64 u8 x s8 MACs per instruction.
 * Compiled with a target pragma, chosen at run time only when the CPU has these. */
#include <immintrin.h>

#include "fk_common.h"
#include "fk_delta.h"   /* fk_delta_layer: the DeltaNet mixer of the step */
#include "fk_kda.h"     /* fk_kda_layer: the KDA mixer of the step */
#include "fk_dsv4.h"    /* fk_swiglu_clamp: deepseek4's ffn act in the step */

/* GCC 12 flags the undefined source operand inside _mm512_cvtph_ps (a false positive) */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,bmi2")

namespace fk_avx512_ns {

static inline float fk_h2f(uint16_t h) { return _cvtsh_ss(h); }

#define FK_VBITS 512 /* generic/x86_hooks.inc: 16 lanes */
#define FK_C 4
template <int R, int C>
static inline void tile_q(const uint8_t *wt, const uint8_t *xt, size_t rowsz, int64_t kp, float out[][FK_C]) {
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i += 64) {
        __m512i w[R];
        __m512 ws[R];
        for (int r = 0; r < R; r++) {
            w[r] = _mm512_loadu_si512((const void *)(wt + r * rowsz + i));
            ws[r] = _mm512_loadu_ps((const float *)(wt + r * rowsz + kp) + i / 4);
        }
        for (int c = 0; c < C; c++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xt + c * rowsz + i));
            const __m512 xs = _mm512_loadu_ps((const float *)(xt + c * rowsz + kp) + i / 4);
            for (int r = 0; r < R; r++) {
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xv);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], xs), acc[r][c]);
            }
        }
    }
    const int64_t n16 = kp / 16;
    for (int64_t j = 0; j < n16; j += 16) {
        const __mmask16 mk = n16 - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n16 - j)) - 1);
        __m512 wo[R];
        for (int r = 0; r < R; r++) wo[r] = _mm512_maskz_loadu_ps(mk, (const float *)(wt + r * rowsz + 2 * kp) + j);
        for (int c = 0; c < C; c++) {
            const __m512 xo = _mm512_maskz_loadu_ps(mk, (const float *)(xt + c * rowsz + 2 * kp) + j);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(wo[r], xo, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#include "generic/x86_hooks.inc"
#undef FK_C

static inline float pb_hsum(pbv v) { return _mm512_reduce_add_ps(v); }

static bool gemv_m_ok(int qt, int64_t m);
static void gemv_rows_multi(int qt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                            const uint8_t *const *g, int64_t m, float *y, int64_t ldy);
#define FK_FAST_GEMV_M_OK gemv_m_ok
#define FK_FAST_GEMV_M gemv_rows_multi

static bool fast_decode_f32(int qt, const uint8_t *__restrict src, int64_t k, int64_t kp, float *__restrict dst) {
    if (qt == FK_F32) {
        memcpy(dst, src, (size_t)k * 4);
    } else {
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
            _mm512_storeu_ps(dst + i, qt == FK_F16 ? _mm512_cvtph_ps(h)
                                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        for (; i < k; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            if (qt == FK_F16) {
                dst[i] = _cvtsh_ss(h);
            } else {
                const uint32_t v = (uint32_t)h << 16;
                memcpy(dst + i, &v, 4);
            }
        }
    }
    for (int64_t i = k; i < kp; i++) dst[i] = 0.0f;
    return true;
}
#define FK_FAST_DECODE_F32 fast_decode_f32

/* m = 1 over F32 / F16 / BF16 rows; x is zero-padded to a multiple of 16 */
static float gemv_float(int qt, const uint8_t *__restrict w, int64_t k, const float *__restrict x) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < k; i += 16) {
        const __mmask16 mk = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
        __m512 wv;
        if (qt == FK_F32) {
            wv = _mm512_maskz_loadu_ps(mk, (const float *)w + i);
        } else {
            const __m256i h = _mm256_maskz_loadu_epi16(mk, (const void *)(w + 2 * i));
            wv = qt == FK_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        if ((i >> 4) & 1) acc1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), acc1);
        else acc0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#define FK_FAST_GEMV_F gemv_float
static void matmul_bf16(const fk_matmul_args *a);
#define FK_MATMUL_BF16 matmul_bf16

#define CB_NP 16
#define CB_MR 4
/* the low (h 0) or high (h 1) f16 halves of CB_NP dwords at col -> f32 (x16u_halves: the scales of the two-block units' groups) */
static inline void cb_f16_halves(const uint8_t *col, int h, float *dst) {
    const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512((const void *)col), 16 * h);
    _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
}
#define CB_F16_HALVES cb_f16_halves
#define CB_PREFETCH_W(p) __asm__ volatile("prefetchw %0" : : "m"(*(const char *)(p)))  /* every AVX-512 CPU has it */
static bool cb_fast_quant_act(const float *__restrict x, int64_t k, int64_t kp, int z, bool g16,
                              uint8_t *__restrict dst);
#define CB_FAST_QUANT_ACT cb_fast_quant_act
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
/* the canonical kernel on the AMX tile unit, 16 activation rows at a time (below) */
#define FK_AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,amx-tile,amx-int8")))
static bool amx_kernel_ok(int qt, int64_t m);
static void amx_kernel(int qt, const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow, int64_t kp,
                       float *acc, float *macc);
#define CB_KERNEL_16_OK amx_kernel_ok
#define CB_KERNEL_16 amx_kernel
#endif

#include "generic/matmul_impl.inc"

/* ---- the canonical kernel (matmul_impl.inc): 16 weight rows in the lanes ----------------
 * Per block: 8 vpdpbusd per activation row (the row's dword broadcast against dword i of
 * the 16 rows), so each lane holds its row's exact block dot; then the block's one FMA. */
struct pb_wblock {
    __m512i w[8];
};
template <bool WIDE>  /* no WIDE variant: vpdpbusd takes the unsigned bytes as they are */
static inline void pb_wload(const uint8_t *pb, pb_wblock &k) {
    for (int i = 0; i < 8; i++) k.w[i] = _mm512_loadu_si512((const void *)(pb + 64 * i));
}
template <bool WIDE, bool G16>
static inline __m512i pb_dot(const pb_wblock &k, const uint8_t *, const int32_t *xd, const int32_t *zi, int64_t b) {
    static_assert(!G16, "the 16-group formats take pb_dots_g16f");
    __m512i i0 = _mm512_set1_epi32(zi[b]), i1 = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        i0 = _mm512_dpbusd_epi32(i0, k.w[i], _mm512_set1_epi32(xd[i]));
        i1 = _mm512_dpbusd_epi32(i1, k.w[4 + i], _mm512_set1_epi32(xd[4 + i]));
    }
    return _mm512_add_epi32(i0, i1);
}

/* Every 16-group format: the two group sums and the block's two scales go to floats, and one
 * multiply and one FMA, which both 512-bit ports serve, give the block's I exactly: each product
 * and I are integers under 2^24 (Q6_K's reach: 2 x 128 x 16 x 32 x 127 = 16646144). The scales
 * convert once a block, for all MR rows (converted row by row, the same form measured 1.00-1.04x).
 * Scaling the sums with two vpmulld (2 uops each on port 0, which the vpdpbusd also need) cost
 * IQ2_XS 1.31-1.34x IQ2_XXS's time; against it, one thread, m = 16 / 128 / 512: IQ2_XS
 * 0.94-0.96 / 0.84-0.88 / 0.92x, IQ2_S 0.92-0.93 / 0.89-0.90 / 0.89x, Q6_K 0.88-0.90 /
 * 0.85-0.87 / 0.87x. Q2_K, Q3_K and IQ1_M, whose sums fit int16, had packed both into one
 * dword's halves for one vpmaddwd (a shift and a blend more, the shift on port 0): in floats
 * m = 128 / 512 IQ1_M 0.94-0.97 / 0.89-0.94x, Q3_K 0.93-0.98 / 0.94x, Q2_K 0.99-1.00 / 0.91-0.99x. */
#define PB_DOTS_G16F 1
template <int MR, int RUN>   /* RUN: vpdpbusd takes every dword as it is */
static inline void pb_dots_g16f(const uint8_t *pb, const int32_t *const *xq, const int32_t *const *zi, int64_t b, __m512 F[MR]) {
    __m512i w[8];
    for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512((const void *)(pb + 64 * i));
    const __m512 clo = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(pb + 640)));
    const __m512 chi = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(pb + 704)));
    for (int c = 0; c < MR; c++) {   /* each group's sum (u - z) q from its zero-point term */
        const int32_t *xd = xq[c] + 8 * b;
        __m512i lo = _mm512_set1_epi32(zi[c][2 * b]), hi = _mm512_set1_epi32(zi[c][2 * b + 1]);
        for (int i = 0; i < 4; i++) {
            lo = _mm512_dpbusd_epi32(lo, w[i], _mm512_set1_epi32(xd[i]));
            hi = _mm512_dpbusd_epi32(hi, w[4 + i], _mm512_set1_epi32(xd[4 + i]));
        }
        F[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), chi, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), clo));
    }
}

/* ---- panel builders straight off the GGML blocks (the common formats) --------------------
 * 16 rows are read at once: the block bytes of each row transposed into dword order (rows
 * past nr repeat the last row: their lanes are never stored), the scale fields gathered one
 * dword per row. They write exactly what the generic way (decode_row + cb_row_scales +
 * transpose) writes, field for field, for the fields the kernel reads. */

/* rows j and j + 8 share a zmm: the 8 x 8 transpose runs in each 256-bit half */
static inline void pb_rows32(const uint8_t *const *rp, int64_t off, pbi z[8]) {
    for (int j = 0; j < 8; j++)
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rp[j] + off))),
                                  _mm256_loadu_si256((const __m256i *)(rp[j + 8] + off)), 1);
}
static inline void pb_rows16(const uint8_t *const *rp, int64_t off, pbi z[4]) {
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[j] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[j + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[j + 8] + off)), 2);
        z[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[j + 12] + off)), 3);
    }
}
static inline void pb_rows_decoded(const uint8_t *tmp, size_t ts, int nr, int64_t off, pbi z[8]) {
    for (int j = 0; j < 8; j++) {
        const __m256i a = j < nr ? _mm256_loadu_si256((const __m256i *)(tmp + j * ts + off)) : _mm256_setzero_si256();
        const __m256i c = j + 8 < nr ? _mm256_loadu_si256((const __m256i *)(tmp + (j + 8) * ts + off)) : _mm256_setzero_si256();
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
    }
}
static inline void pb_tr_last(pbi a, pbi b, pbi &lo, pbi &hi) {
    lo = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), b);
    hi = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), b);
}

/* the f16 at off of 16 rows -> f32 (vpinsrw from memory: cheaper here than a gather) */
static inline __m512 h16_rows(const uint8_t *const *rp, int64_t off) {
    __m128i a = _mm_cvtsi32_si128(rd16(rp[0] + off)), b = _mm_cvtsi32_si128(rd16(rp[8] + off));
#define FK_INS(i)                                   \
    a = _mm_insert_epi16(a, rd16(rp[i] + off), i);  \
    b = _mm_insert_epi16(b, rd16(rp[8 + i] + off), i);
    FK_INS(1) FK_INS(2) FK_INS(3) FK_INS(4) FK_INS(5) FK_INS(6) FK_INS(7)
#undef FK_INS
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

static inline __m512 pb_h2f_lo(__m512i g) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)); }
static inline __m512 pb_h2f_hi(__m512i g) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))); }

/* the shim of generic/x86_panel.inc: 16 rows, one zmm dword each */
static inline pbi pb_gather(pbi vidx, const uint8_t *base) { return _mm512_i32gather_epi32(vidx, (const void *)base, 1); }
static inline pbv pb_h16(const uint8_t *const *rp, pbi, int64_t off) { return h16_rows(rp, off); }
static inline void pb_h16_dm(const uint8_t *const *rp, pbi, int64_t off, pbv &d, pbv &m) {
    d = h16_rows(rp, off);
    m = h16_rows(rp, off + 2);
}
static inline pbi pb_lut16(const uint8_t *p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)); }
static inline pbi pb_index(const int32_t *off) { return _mm512_load_si512((const void *)off); }
#define PB_WIDE 0  /* vpdpbusd takes every unsigned byte */
/* TQ1_0's leading trit of each byte w read as a base-3 fraction, (w * 3) >> 8 = (w >= 86) +
 * (w >= 171), from s = w ^ 0x80 through signed compares (pb_build_tq, cbg_tq) */
static inline pbi pb_trit(pbi s) {
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i t = _mm512_maskz_mov_epi8(_mm512_cmpgt_epi8_mask(s, _mm512_set1_epi8(85 - 128)), one);
    return _mm512_mask_add_epi8(t, _mm512_cmpgt_epi8_mask(s, _mm512_set1_epi8(42)), t, one);
}
#include "generic/x86_panel.inc"

#ifdef CB_KERNEL_16
/* ---- the canonical kernel on AMX: 16 activation rows x 16 weight rows a tile -------------
 * The panel's block (8 dwords of 4 values, 16 rows each: 64 bytes a dword) is already the
 * tile unit's B layout (K/4 rows of 16 columns x 4 bytes), and 16 activation rows of quant_act
 * bytes, arow apart, are its A operand. tdpbsud gives each (activation, weight) row pair its
 * exact int32 block dot, the same integer the vpdpbusd kernel builds in a lane; the dots go
 * through memory four blocks at a time and each row then takes cb_kern's float chain in
 * block order, so the result is the vector kernel's bit for bit (batch invariance holds
 * whichever kernel a row meets). The chain's four vector operations a block and row (cvt,
 * scale product, FMA, min FMA) are what is left: on the Xeon that measured it they bound the
 * kernel (BENCHMARK.md "AMX tiles for the prefill dots"). The tile configuration is loaded
 * on every call: torch's oneDNN uses the same threads and may leave its own. */
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tmm0-3: 16 x 16 int32 dots; tmm4, tmm5: A, 16 rows of a block's 32 activation bytes;
 * tmm6, tmm7: B, 8 rows of 16 weight rows x 4 bytes */
FK_AMX_FN static inline void amx_configure(void) {
    alignas(64) amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    for (int t = 4; t < 6; t++) cfg.colsb[t] = 32, cfg.rows[t] = 16;
    for (int t = 6; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 8;
    _tile_loadconfig(&cfg);
}

/* from 32 rows a call (at 16, one tile group a call, Qwen3-0.6B Q4_K_M pp16 read 0.98x), and
 * not the 16-element sub-scale formats (Q6_K, Q3_K, Q2_K): with two K = 16 dots a block and
 * two integer scalings in the chain, Q6_K ran at 0.78x the vector kernel's speed (2048 x 2048,
 * m = 256, one thread), so they keep it */
static bool amx_kernel_ok(int qt, int64_t m) { return fk_amx_on && m >= 32 && !cb_g16(qt); }

#define AMX_GROUP 4   /* blocks a group: four dots on four accumulator tiles, all issued before
                         the first is stored (a dot's latency is several issue intervals) */
typedef int32_t amx_dots[16][16];

/* the dots of blocks [g, g + nbk) into d */
FK_AMX_FN static inline void amx_tiles(const uint8_t *pan, int64_t b0, int64_t g, int nbk, const uint8_t *act,
                                       size_t arow, amx_dots *d) {
#define AMX_DOT(j, ta, tb)                                                \
    if (j < nbk) {                                                        \
        _tile_loadd(ta, act + 32 * (g + j), (long)arow);                  \
        _tile_loadd(tb, pan + (g + j - b0) * CB_BLOCK, 64);               \
        _tile_zero(j);                                                    \
        _tile_dpbsud(j, ta, tb);                                          \
    }
    AMX_DOT(0, 4, 6) AMX_DOT(1, 5, 7) AMX_DOT(2, 4, 6) AMX_DOT(3, 5, 7)
#undef AMX_DOT
    _tile_stored(0, d[0], 64);
    if (nbk > 1) _tile_stored(1, d[1], 64);
    if (nbk > 2) _tile_stored(2, d[2], 64);
    if (nbk > 3) _tile_stored(3, d[3], 64);
}

/* cb_kern's float chain for 16 activation rows over blocks [g, g + nbk), from their dots */
template <bool Z, bool MIN>
FK_AMX_FN static inline void amx_chain(const uint8_t *pan, int64_t b0, int64_t g, int nbk, const uint8_t *act,
                                       size_t arow, int64_t kp, const amx_dots *d, float *acc, float *macc) {
    const int64_t nbp = kp / 32;
    for (int c = 0; c < 16; c++) {
        const float *dx = (const float *)(act + c * arow + 2 * kp + kp / 4), *jf = dx + nbp;
        const int32_t *zi = (const int32_t *)(jf + nbp);
        __m512 A = _mm512_loadu_ps(acc + 16 * c), M = _mm512_setzero_ps();
        if (MIN) M = _mm512_loadu_ps(macc + 16 * c);
        for (int j = 0; j < nbk; j++) {
            const int64_t b = g + j;
            const uint8_t *pb = pan + (b - b0) * CB_BLOCK;
            __m512i I = _mm512_load_si512((const void *)d[j][c]);
            if (Z) I = _mm512_add_epi32(I, _mm512_set1_epi32(zi[b]));
            const __m512 ws = _mm512_loadu_ps((const float *)(pb + 32 * CB_NP));
            A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(ws, _mm512_set1_ps(dx[b])), A);
            if (MIN) M = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(pb + 36 * CB_NP)), _mm512_set1_ps(jf[b]), M);
        }
        _mm512_storeu_ps(acc + 16 * c, A);
        if (MIN) _mm512_storeu_ps(macc + 16 * c, M);
    }
}

/* software-pipelined: the next group's dots are issued before this group's chain reads its
 * dots back, so the tile stores are done by the time the vector loads want them */
template <bool Z, bool MIN>
FK_AMX_FN static void amx_kern(const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow, int64_t kp,
                               float *acc, float *macc) {
    alignas(64) amx_dots d[2][AMX_GROUP];
    amx_configure();
    int64_t g = b0;
    int nbk = (int)(b1 - g < AMX_GROUP ? b1 - g : AMX_GROUP);
    amx_tiles(pan, b0, g, nbk, act, arow, d[0]);
    for (int h = 0; g < b1; h ^= 1) {
        const int64_t gn = g + AMX_GROUP;
        const int nbn = (int)(b1 - gn < AMX_GROUP ? b1 - gn : AMX_GROUP);
        if (gn < b1) amx_tiles(pan, b0, gn, nbn, act, arow, d[h ^ 1]);
        amx_chain<Z, MIN>(pan, b0, g, nbk, act, arow, kp, d[h], acc, macc);
        g = gn;
        nbk = nbn;
    }
}

static void amx_kernel(int qt, const uint8_t *pan, int64_t b0, int64_t b1, const uint8_t *act, size_t arow, int64_t kp,
                       float *acc, float *macc) {
    const bool z = cb_z(qt) != 0, mins = cb_min(qt);
    if (mins && z) amx_kern<true, true>(pan, b0, b1, act, arow, kp, acc, macc);
    else if (mins) amx_kern<false, true>(pan, b0, b1, act, arow, kp, acc, macc);
    else if (z) amx_kern<true, false>(pan, b0, b1, act, arow, kp, acc, macc);
    else amx_kern<false, false>(pan, b0, b1, act, arow, kp, acc, macc);
}
#endif

/* ---- AVX-512 row decoders for the formats real models carry ------------------------ */

static inline __m512 two_scales(float a, float b) {  /* [a x8, b x8] */
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

static inline __m256i nibbles32(const uint8_t *qs) {  /* 16 bytes -> 32 values: lo then hi */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* 32-element formats: Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1, Q8_0 */
static inline __m256i block32(int qt, const uint8_t *p) {
    switch (qt) {
    case FK_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), _mm256_set1_epi8((char)0x80));
    case FK_Q4_0: return nibbles32(p + 2);
    case FK_Q4_1: return nibbles32(p + 4);
    case FK_IQ4_NL: {
        const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4_u8));
        return _mm256_shuffle_epi8(t, nibbles32(p + 2));
    }
    default: { /* Q5_0 / Q5_1 */
        const int ho = qt == FK_Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, p + ho, 4);
        const __m256i hi = _mm256_and_si256(_mm256_movm_epi8((__mmask32)qh), _mm256_set1_epi8(16));
        return _mm256_or_si256(nibbles32(p + ho + 4), hi);
    }
    }
}

static inline void scale32(int qt, const uint8_t *p, float *s, float *o) {
    const float d = rdh(p);
    *s = d;
    switch (qt) {
    case FK_Q4_0: *o = -8.0f * d; break;
    case FK_Q5_0: *o = -16.0f * d; break;
    case FK_Q4_1: case FK_Q5_1: *o = rdh(p + 2); break;
    default: *o = -128.0f * d; break; /* Q8_0, IQ4_NL */
    }
}

template <int QT>
static void decode32(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp, int bs) {
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const int64_t nb = k / 32;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *p0 = src + b * bs, *p1 = p0 + bs;
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(block32(QT, p0)), block32(QT, p1), 1);
        _mm512_storeu_si512((void *)(dst + b * 32), v);
        float s0, o0, s1, o1;
        scale32(QT, p0, &s0, &o0);
        scale32(QT, p1, &s1, &o1);
        _mm512_storeu_ps(ls + b * 8, two_scales(s0, s1));
        _mm_storeu_ps(off + b * 2, _mm_setr_ps(o0, o0, o1, o1));
    }
    if (b < nb) {
        const uint8_t *p0 = src + b * bs;
        _mm256_storeu_si256((__m256i *)(dst + b * 32), block32(QT, p0));
        float s0, o0;
        scale32(QT, p0, &s0, &o0);
        _mm256_storeu_ps(ls + b * 8, _mm256_set1_ps(s0));
        off[b * 2] = off[b * 2 + 1] = o0;
    }
}

static const int32_t kDup2[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const int32_t kPairLin[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};

/* Q4_K / Q5_K pieces: the 8 group scales and offsets, and 64 values [lo nibbles, hi nibbles] */
static inline void q45k_scales(const uint8_t *p, __m512 &S, __m512 &O) {
    /* 12 bytes -> 8 six-bit scales and 8 six-bit mins, four at a time in 32-bit words */
    uint32_t u[3];
    memcpy(u, p + 4, 12);
    const uint64_t sc = (uint64_t)(u[0] & 0x3f3f3f3fu) |
                        (uint64_t)((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mn = (uint64_t)(u[1] & 0x3f3f3f3fu) |
                        (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
    S = _mm512_mul_ps(_mm512_set1_ps(rdh(p)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    O = _mm512_mul_ps(_mm512_set1_ps(-rdh(p + 2)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
}

/* lane scales of chunk j (groups 2j, 2j+1) from the 8 group scales in S */
static inline __m512 q45k_lanes(const __m512 S, int j) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_loadu_si512((const void *)kPairLin), _mm512_set1_epi32(2 * j)), S);
}

template <int QT>
static inline __m512i q45k_chunk(const uint8_t *qs, int j, __m256i &qh) {
    const __m256i m4 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (QT == FK_Q5_K) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), b16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), b16));
        qh = _mm256_srli_epi16(qh, 2);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Q6_K pieces: the 16 group scales, and the 128 values of half n as two zmm */
static inline __m512 q6k_scales(const uint8_t *p) {
    return _mm512_mul_ps(_mm512_set1_ps(rdh(p + 208)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))));
}

static inline void q6k_half(const uint8_t *p, int n, __m512i &v0, __m512i &v1) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * n));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
    const __m256i e0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    const __m256i e1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    const __m256i e2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
    const __m256i e3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
    v0 = _mm512_inserti64x4(_mm512_castsi256_si512(e0), e1, 1);
    v1 = _mm512_inserti64x4(_mm512_castsi256_si512(e2), e3, 1);
}

/* Q4_K / Q5_K: 8 groups of 32 per 256, 6-bit scales and mins */
template <int QT>
static void decode_q45k(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp) {
    const int bs = QT == FK_Q4_K ? 144 : 176;
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const __m512i dup2 = _mm512_loadu_si512((const void *)kDup2);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * bs, *qs = p + (QT == FK_Q4_K ? 16 : 48);
        __m512 S, O;
        q45k_scales(p, S, O);
        __m256i qh = QT == FK_Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            _mm512_storeu_si512((void *)(dst + b * 256 + 64 * j), q45k_chunk<QT>(qs, j, qh));
            _mm512_storeu_ps(ls + b * 64 + 16 * j, q45k_lanes(S, j));
        }
        _mm512_storeu_ps(off + b * 16, _mm512_permutexvar_ps(dup2, O));
    }
}

static const int32_t kQuad[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* Q6_K: 16 groups of 16 per 256, int8 scales */
static void decode_q6k(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp) {
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const __m512i quad = _mm512_loadu_si512((const void *)kQuad);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 210;
        const __m512 S = q6k_scales(p);
        _mm512_storeu_ps(off + b * 16, _mm512_mul_ps(S, _mm512_set1_ps(-32.0f)));
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(ls + b * 64 + 16 * c,
                             _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(4 * c)), S));
        for (int n = 0; n < 2; n++) {
            __m512i v0, v1;
            q6k_half(p, n, v0, v1);
            _mm512_storeu_si512((void *)(dst + b * 256 + n * 128), v0);
            _mm512_storeu_si512((void *)(dst + b * 256 + n * 128 + 64), v1);
        }
    }
}

/* Q2_K / Q3_K: 16 groups of 16 per 256; group g covers elements 16g..16g+15 */
static inline void store_group16(float *ls, float *off, const __m512 S, const __m512 O) {
    const __m512i quad = _mm512_loadu_si512((const void *)kQuad);
    _mm512_storeu_ps(off, O);
    for (int c = 0; c < 4; c++)
        _mm512_storeu_ps(ls + 16 * c, _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(4 * c)), S));
}

static void decode_q2k(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp) {
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 84;
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512 S = _mm512_mul_ps(_mm512_set1_ps(rdh(p + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
        const __m512 O = _mm512_mul_ps(_mm512_set1_ps(-rdh(p + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
        store_group16(ls + b * 64, off + b * 16, S, O);
        for (int n = 0; n < 2; n++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * n));
            uint8_t *u = dst + b * 256 + n * 128;
            _mm256_storeu_si256((__m256i *)u, _mm256_and_si256(q, m3));
            _mm256_storeu_si256((__m256i *)(u + 32), _mm256_and_si256(_mm256_srli_epi16(q, 2), m3));
            _mm256_storeu_si256((__m256i *)(u + 64), _mm256_and_si256(_mm256_srli_epi16(q, 4), m3));
            _mm256_storeu_si256((__m256i *)(u + 96), _mm256_and_si256(_mm256_srli_epi16(q, 6), m3));
        }
    }
}

static void decode_q3k(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp) {
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 110, *s = p + 96;
        int32_t sc[16];
        for (int j = 0; j < 16; j++) {
            const int lo = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
            const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
            sc[j] = (lo | (hi << 4)) - 32;
        }
        const __m512 S = _mm512_mul_ps(_mm512_set1_ps(rdh(p + 108)), _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)sc)));
        store_group16(ls + b * 64, off + b * 16, S, _mm512_mul_ps(S, _mm512_set1_ps(-4.0f)));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)p);
        for (int n = 0; n < 2; n++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * n));
            uint8_t *u = dst + b * 256 + n * 128;
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j)), m3);
                const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * n + j)), one);
                _mm256_storeu_si256((__m256i *)(u + 32 * j), _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)));
            }
        }
    }
}

static void decode_iq4xs(const uint8_t *__restrict src, int64_t k, uint8_t *__restrict dst, int64_t kp) {
    float *ls = (float *)(dst + kp), *off = (float *)(dst + 2 * kp);
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4_u8));
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 136;
        const float d = rdh(p);
        const uint16_t sh = rd16(p + 2);
        float sv[8];
        for (int ib = 0; ib < 8; ib++)
            sv[ib] = d * (float)((((p[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32);
        for (int j = 0; j < 4; j++) {
            const __m256i v0 = _mm256_shuffle_epi8(t, nibbles32(p + 8 + 32 * j));
            const __m256i v1 = _mm256_shuffle_epi8(t, nibbles32(p + 8 + 32 * j + 16));
            _mm512_storeu_si512((void *)(dst + b * 256 + 64 * j), _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1));
            _mm512_storeu_ps(ls + b * 64 + 16 * j, two_scales(sv[2 * j], sv[2 * j + 1]));
        }
        const __m512i dup2 = _mm512_loadu_si512((const void *)kDup2);
        _mm512_storeu_ps(off + b * 16, _mm512_mul_ps(_mm512_set1_ps(-128.0f),
                                                     _mm512_permutexvar_ps(dup2, _mm512_castps256_ps512(_mm256_loadu_ps(sv)))));
    }
}

static bool fast_decode(int qt, const uint8_t *__restrict src, int64_t k, int64_t kp, uint8_t *__restrict dst) {
    switch (qt) {
    case FK_Q2_K: decode_q2k(src, k, dst, kp); return true;
    case FK_Q3_K: decode_q3k(src, k, dst, kp); return true;
    case FK_IQ4_XS: decode_iq4xs(src, k, dst, kp); return true;
    case FK_Q4_0: decode32<FK_Q4_0>(src, k, dst, kp, 18); return true;
    case FK_Q4_1: decode32<FK_Q4_1>(src, k, dst, kp, 20); return true;
    case FK_IQ4_NL: decode32<FK_IQ4_NL>(src, k, dst, kp, 18); return true;
    case FK_Q5_0: decode32<FK_Q5_0>(src, k, dst, kp, 22); return true;
    case FK_Q5_1: decode32<FK_Q5_1>(src, k, dst, kp, 24); return true;
    case FK_Q8_0: decode32<FK_Q8_0>(src, k, dst, kp, 34); return true;
    case FK_Q4_K: decode_q45k<FK_Q4_K>(src, k, dst, kp); return true;
    case FK_Q5_K: decode_q45k<FK_Q5_K>(src, k, dst, kp); return true;
    case FK_Q6_K: decode_q6k(src, k, dst, kp); return true;
    }
    return false;
}

/* ---- fused GEMV (m = 1): decode in registers, never through memory ------------------- */

/* 32-element formats. The activations are rearranged once per call to match how two
 * blocks unpack into one zmm ([b0 lo16 | b1 lo16 | b0 hi16 | b1 hi16] for the nibble
 * formats), and the constant offsets (Q4_0: -8, Q5_0: -16, Q8_0 / IQ4_NL: -128) are
 * folded into the integer accumulator's start value (-C * lane sums of the activations),
 * so one block pair costs an unpack, one vpdpbusd, one convert and one FMA. */

static inline bool nibble_order(int qt) { return qt != FK_Q8_0; }
static inline int offset_c(int qt) {
    return qt == FK_Q4_0 ? 8 : qt == FK_Q5_0 ? 16 : (qt == FK_Q8_0 || qt == FK_IQ4_NL || qt == FK_IQ4_XS) ? 128 : 0;
}

/* prepared activations: q'[kp] | ls'[kp/4] f32 | init[kp/4] i32 | x32[kp/32] f32 */
static const uint8_t *gemv_prep_k23(int qt, const uint8_t *act, int64_t k, int64_t kp);

static inline bool prep_needed(int qt) {
    return qt == FK_Q4_0 || qt == FK_Q4_1 || qt == FK_Q5_0 || qt == FK_Q5_1 || qt == FK_Q8_0 || qt == FK_IQ4_NL ||
           qt == FK_IQ4_XS || qt == FK_Q4_K || qt == FK_Q5_K;
}
/* the activation row `act` rearranged for qt's fused GEMV, in row slot `slot` of the
 * scratch (one size for every slot: no realloc between the rows of a call) */
static const uint8_t *gemv_prep(int qt, const uint8_t *act, int64_t k, int64_t kp, int slot) {
    if (qt == FK_Q2_K || qt == FK_Q3_K) return gemv_prep_k23(qt, act, k, kp);   /* m = 1 only */
    if (!prep_needed(qt)) return act;
    const size_t sz = (size_t)(3 * kp + kp / 4) + 64;
    uint8_t *g = scratch(1, FK_GEMV_MAX_ROWS * sz);
    if (!g) return NULL;
    g += slot * sz;
    const bool k45 = qt == FK_Q4_K || qt == FK_Q5_K;
    const int8_t *q = (const int8_t *)act;
    const float *ls = (const float *)(act + kp), *s16 = (const float *)(act + 2 * kp);
    int8_t *q2 = (int8_t *)g;
    float *ls2 = (float *)(g + kp), *x32 = (float *)(g + 3 * kp);
    int32_t *init = (int32_t *)(g + 2 * kp);
    const int c = offset_c(qt);
    const __m512i perm = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);     /* 16-byte quarters 0,2,1,3 */
    const __m512i permf = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const bool nib = nibble_order(qt);
    float *d32 = (float *)(g + 3 * kp + kp / 8);
    for (int64_t b = 0; b < kp / 32; b++) d32[b] = ls[b * 8];
    if (k45) { /* per 128: [0-31, 64-95, 32-63, 96-127], how 64 bytes of Q4_K qs unpack */
        for (int64_t i = 0; i < kp; i += 128) {
            memcpy(q2 + i, q + i, 32);
            memcpy(q2 + i + 32, q + i + 64, 32);
            memcpy(q2 + i + 64, q + i + 32, 32);
            memcpy(q2 + i + 96, q + i + 96, 32);
        }
        for (int64_t b = 0; b < kp / 32; b++) x32[b] = s16[2 * b] + s16[2 * b + 1];
        return g;
    }
    for (int64_t i = 0; i < kp; i += 64) {
        __m512i v = _mm512_loadu_si512((const void *)(q + i));
        __m512 l = _mm512_loadu_ps(ls + i / 4);
        if (nib) {
            v = _mm512_permutexvar_epi64(perm, v);
            l = _mm512_permutexvar_ps(permf, l);
        }
        _mm512_storeu_si512((void *)(q2 + i), v);
        _mm512_storeu_ps(ls2 + i / 4, l);
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), v);
        _mm512_storeu_si512((void *)(init + i / 4), _mm512_mullo_epi32(sums, _mm512_set1_epi32(-c)));
    }
    for (int64_t b = 0; b < kp / 32; b++) x32[b] = s16[2 * b] + s16[2 * b + 1];
    return g;
}

static inline uint64_t gather4_u16(const uint8_t *p, int stride) {
    return (uint64_t)rd16(p) | (uint64_t)rd16(p + stride) << 16 | (uint64_t)rd16(p + 2 * stride) << 32 |
           (uint64_t)rd16(p + 3 * stride) << 48;
}

/* two blocks (p1 may be NULL: zeros) as one zmm in the prepared order */
template <int QT>
static inline __m512i unpack2(const uint8_t *p0, const uint8_t *p1) {
    if (QT == FK_Q8_0) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(p0 + 2));
        const __m256i b = p1 ? _mm256_loadu_si256((const __m256i *)(p1 + 2)) : _mm256_set1_epi8((char)0x80);
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), _mm512_set1_epi8((char)0x80));
    }
    const int qo = (QT == FK_Q4_1) ? 4 : (QT == FK_Q5_0) ? 6 : (QT == FK_Q5_1) ? 8 : (QT == FK_MXFP4) ? 1 : 2;
    const __m128i a = _mm_loadu_si128((const __m128i *)(p0 + qo));
    const __m128i b = p1 ? _mm_loadu_si128((const __m128i *)(p1 + qo)) : _mm_setzero_si128();
    const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1),
                                 _mm512_set1_epi8(15));
    if (QT == FK_Q5_0 || QT == FK_Q5_1) {
        const int ho = QT == FK_Q5_1 ? 4 : 2;
        uint32_t h0, h1 = 0;
        memcpy(&h0, p0 + ho, 4);
        if (p1) memcpy(&h1, p1 + ho, 4);
        const uint64_t mk = (uint64_t)(h0 & 0xFFFF) | (uint64_t)(h1 & 0xFFFF) << 16 | (uint64_t)(h0 >> 16) << 32 |
                            (uint64_t)(h1 >> 16) << 48;
        z = _mm512_or_si512(z, _mm512_maskz_mov_epi8((__mmask64)mk, _mm512_set1_epi8(16)));
    }
    if (QT == FK_IQ4_NL || QT == FK_MXFP4)
        z = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(QT == FK_MXFP4 ? kv_mxfp4_u8 : kv_iq4_u8))), z);
    return z;
}

static const int32_t kPairNib[16] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};

/* M activation rows (1..3) against one weight row: the unpacked blocks and their scales
 * are shared, each row adds its own integer dots and rescale (m = 2..3 is the decode
 * route of small batches and speculation). */
template <int QT, int M>
static void gemv32(const uint8_t *__restrict p, int64_t k, const uint8_t *const *g, int64_t kp, float *out) {
    const int bs = QT == FK_Q4_0 || QT == FK_IQ4_NL ? 18 : QT == FK_Q4_1 ? 20 : QT == FK_Q5_0 ? 22 : QT == FK_Q5_1 ? 24 : 34;
    const bool mins = QT == FK_Q4_1 || QT == FK_Q5_1;
    const int8_t *xq[M];
    const float *xls[M], *x32[M];
    const int32_t *init[M];
    __m512 acc0[M], acc1[M];
    __m128 oacc[M];
    for (int j = 0; j < M; j++) {
        xq[j] = (const int8_t *)g[j];
        xls[j] = (const float *)(g[j] + kp);
        x32[j] = (const float *)(g[j] + 3 * kp);
        init[j] = (const int32_t *)(g[j] + 2 * kp);
        acc0[j] = acc1[j] = _mm512_setzero_ps();
        oacc[j] = _mm_setzero_ps();
    }
    const __m512i ia = _mm512_loadu_si512((const void *)(QT == FK_Q8_0 ? kPairLin : kPairNib));
    const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(2));
    const int64_t nb = k / 32;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *p0 = p + b * bs;
        _mm_prefetch((const char *)p0 + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)p0 + 1088, _MM_HINT_T0);
        const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)gather4_u16(p0, bs))));
        const __m512 da = _mm512_permutexvar_ps(ia, d4), db = _mm512_permutexvar_ps(ib, d4);
        const __m512i v0 = unpack2<QT>(p0, p0 + bs), v1 = unpack2<QT>(p0 + 2 * bs, p0 + 3 * bs);
        __m128 m4 = _mm_setzero_ps();
        if (mins) m4 = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)gather4_u16(p0 + 2, bs)));
        for (int j = 0; j < M; j++) {
            const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(init[j] + b * 8)), v0,
                                                   _mm512_loadu_si512((const void *)(xq[j] + b * 32)));
            const __m512i i1 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(init[j] + b * 8 + 16)), v1,
                                                   _mm512_loadu_si512((const void *)(xq[j] + b * 32 + 64)));
            acc0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(da, _mm512_loadu_ps(xls[j] + b * 8)), acc0[j]);
            acc1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(db, _mm512_loadu_ps(xls[j] + b * 8 + 16)), acc1[j]);
            if (mins) oacc[j] = _mm_fmadd_ps(m4, _mm_loadu_ps(x32[j] + b), oacc[j]);
        }
    }
    for (; b < nb; b += 2) { /* 1..3 blocks left: pairs, the last maybe alone */
        const uint8_t *p0 = p + b * bs, *p1 = b + 1 < nb ? p0 + bs : NULL;
        const float d0 = rdh(p0), d1 = p1 ? rdh(p1) : 0.0f;
        const __m512 da = _mm512_permutexvar_ps(ia, _mm512_castps128_ps512(_mm_setr_ps(d0, d1, 0.0f, 0.0f)));
        const __m512i v = unpack2<QT>(p0, p1);
        const float m0 = mins ? rdh(p0 + 2) : 0.0f, m1 = mins && p1 ? rdh(p1 + 2) : 0.0f;
        for (int j = 0; j < M; j++) {
            const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(init[j] + b * 8)), v,
                                                   _mm512_loadu_si512((const void *)(xq[j] + b * 32)));
            acc0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(da, _mm512_loadu_ps(xls[j] + b * 8)), acc0[j]);
            if (mins) oacc[j] = _mm_add_ss(oacc[j], _mm_set_ss(m0 * x32[j][b] + (p1 ? m1 * x32[j][b + 1] : 0.0f)));
        }
    }
    for (int j = 0; j < M; j++) {
        __m128 o = _mm_add_ps(oacc[j], _mm_movehl_ps(oacc[j], oacc[j]));
        o = _mm_add_ss(o, _mm_movehdup_ps(o));
        out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])) + _mm_cvtss_f32(o);
    }
}

static const int32_t kSpanLo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};

/* Q4_K / Q5_K, m = 1: 64 bytes of qs per step (groups 4h..4h+3 of a superblock), the
 * activations pre-arranged to match; group scale x activation scale taken once per
 * superblock (both are per 32 values), offsets as one 8-wide FMA per superblock. */
template <int QT, int M>
static void gemv_q45k(const uint8_t *__restrict src, int64_t k, int64_t kp, const uint8_t *const *g, float *out) {
    const int bs = QT == FK_Q4_K ? 144 : 176;
    const int8_t *xq[M];
    const float *x32[M], *d32[M];
    __m512 acc0[M], acc1[M];
    __m256 oacc[M];
    for (int j = 0; j < M; j++) {
        xq[j] = (const int8_t *)g[j];
        x32[j] = (const float *)(g[j] + 3 * kp);
        d32[j] = (const float *)(g[j] + 3 * kp + kp / 8);
        acc0[j] = acc1[j] = _mm512_setzero_ps();
        oacc[j] = _mm256_setzero_ps();
    }
    const __m512i lo_idx = _mm512_loadu_si512((const void *)kSpanLo);
    const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * bs, *qs = p + (QT == FK_Q4_K ? 16 : 48);
        for (int l = 0; l < 3; l++) _mm_prefetch((const char *)p + 2048 + 64 * l, _MM_HINT_T0);
        __m512 S, O;
        q45k_scales(p, S, O);
        __m512 C[M];
        for (int j = 0; j < M; j++) {
            C[j] = _mm512_mul_ps(S, _mm512_castps256_ps512(_mm256_loadu_ps(d32[j] + 8 * b)));
            oacc[j] = _mm256_fmadd_ps(_mm512_castps512_ps256(O), _mm256_loadu_ps(x32[j] + 8 * b), oacc[j]);
        }
        __m512i qh2 = _mm512_setzero_si512();
        if (QT == FK_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
            qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        }
        for (int h = 0; h < 2; h++) {
            const __m512i z = _mm512_loadu_si512((const void *)(qs + 64 * h));
            __m512i lo = _mm512_and_si512(z, m4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            if (QT == FK_Q5_K) {
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh2, _mm_cvtsi32_si128(4 * h)), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh2, _mm_cvtsi32_si128(4 * h + 1)), one), 4));
            }
            const __m512i idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(4 * h));
            const __m512i idx1 = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            for (int j = 0; j < M; j++) {
                const int8_t *x = xq[j] + b * 256;
                const __m512i il = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(x + 128 * h)));
                const __m512i ih = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512((const void *)(x + 128 * h + 64)));
                acc0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il), _mm512_permutexvar_ps(idx, C[j]), acc0[j]);
                acc1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih), _mm512_permutexvar_ps(idx1, C[j]), acc1[j]);
            }
        }
    }
    for (int j = 0; j < M; j++) {
        __m128 o = _mm_add_ps(_mm256_castps256_ps128(oacc[j]), _mm256_extractf128_ps(oacc[j], 1));
        o = _mm_add_ps(o, _mm_movehl_ps(o, o));
        o = _mm_add_ss(o, _mm_movehdup_ps(o));
        out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])) + _mm_cvtss_f32(o);
    }
}

template <int M>
static void gemv_q6k(const uint8_t *__restrict src, int64_t k, int64_t kp, const uint8_t *const *act, float *out) {
    const int8_t *xq[M];
    const float *xls[M], *s16[M];
    __m512 acc[M], oacc[M];
    for (int j = 0; j < M; j++) {
        xq[j] = (const int8_t *)act[j];
        xls[j] = (const float *)(act[j] + kp);
        s16[j] = (const float *)(act[j] + 2 * kp);
        acc[j] = oacc[j] = _mm512_setzero_ps();
    }
    const __m512i quad = _mm512_loadu_si512((const void *)kQuad);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 210;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)p + 2048 + 64 * l, _MM_HINT_T0);
        const __m512 S = q6k_scales(p);
        const __m512 So = _mm512_mul_ps(S, _mm512_set1_ps(-32.0f));
        for (int j = 0; j < M; j++) oacc[j] = _mm512_fmadd_ps(So, _mm512_loadu_ps(s16[j] + b * 16), oacc[j]);
        for (int n = 0; n < 2; n++) {
            __m512i v0, v1;
            q6k_half(p, n, v0, v1);
            const __m512 s0 = _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(8 * n)), S);
            const __m512 s1 = _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(8 * n + 4)), S);
            for (int j = 0; j < M; j++) {
                const int8_t *x = xq[j] + b * 256;
                const float *xl = xls[j] + b * 64;
                const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0, _mm512_loadu_si512((const void *)(x + 128 * n)));
                const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v1, _mm512_loadu_si512((const void *)(x + 128 * n + 64)));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, _mm512_loadu_ps(xl + 32 * n)), acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, _mm512_loadu_ps(xl + 32 * n + 16)), acc[j]);
            }
        }
    }
    for (int j = 0; j < M; j++) out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j], oacc[j]));
}

/* Q2_K / Q3_K, m = 1. The 64 bytes of qs hold 2-bit field j (bits 2j, 2j+1) of elements
 * 32j + i (byte i < 32) and 128 + 32j + i - 32 (byte i >= 32): one zmm load and an AND
 * (and a shift) per field give the 64 values of chunk j = elements [32j, +32) and
 * [128 + 32j, +32), scaled by 4^f (the field left where it lies, or moved to bits 2-3).
 * The prepared activations put the matching 32-byte chunks side by side. Each 128-bit lane
 * L of chunk j is one 16-group, g = 2j + (L & 1) + 8 (L >> 1); a block's 16 group scales are
 * kept in lane order t = 4L + j (group kK23Order[t]), so the lane scales of chunk j are one
 * in-lane shuffle (vpermilps imm) of them.
 *   Q2_K: f = j. Per chunk: AND, vpdpbusd, convert, shuffle, FMA against d * sc * d_x / 4^f.
 *         The mins go per block as a 16-bit pair dot min x sum(q) (vpmaddwd), scaled per
 *         32-block by d_x and per block by -dmin.
 *   Q3_K: f = 0, 1, 1, 1 (high bit at bit 2 + 2f, set by a masked add from the hmask test);
 *         the four vpdpbusd results (4 partial sums per group) are reduced to the 16 group
 *         sums in lane order t by three vpackssdw + vpmaddwd, the last one (vpdpwssd)
 *         starting from the -4 offset (-4 * 4^f * sum(q)), so the float work is one convert
 *         and one FMA per block. 16-bit headroom: 2 * 4 * 28 * 128 < 32768.
 * Prepared activations (slot 1 of the scratch, 3 kp / 2 bytes):
 *   q'[kp]         per 256, the 32-byte chunks of quant_act's row in the order 0, 4, 1, 5, 2, 6, 3, 7
 *   c16[kp/16]     f32, per block in lane order t: the activation scale of the group's 32-block / 4^f
 *   Q2_K: isum[kp/16] i16, natural group order: sum(q) per 16-group; x32[kp/32] f32: d_x per 32
 *   Q3_K: init[kp/16] i32, lane order t: -4 * 4^f * sum(q) of the group
 * A group costs (integer dot of 4^f u and q) * (d_x / 4^f) * (d * sc): the tile route's integer
 * dot and scale products (the power of two exact), summed in another order. */
static const int8_t kK23Order[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

static inline int k23_fold(int qt, int j) { return qt == FK_Q2_K ? j : j > 0; }

/* a fresh zero (vpxord, a zero idiom) to start each vpdpbusd: otherwise GCC copies one
 * zeroed register per use, a real move */
static inline __m512i zmm_zero() {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z));
    return z;
}

/* 4 x 16 lanes of partial sums (lane L of r[j]: 4 sums of group 2j + (L & 1) + 8 (L >> 1),
 * each |sum| < 2^14) -> the 16 group sums in lane order t, plus init */
static inline __m512i k23_reduce(const __m512i r[4], __m512i init) {
    const __m512i one16 = _mm512_set1_epi16(1);
    const __m512i r01 = _mm512_madd_epi16(_mm512_packs_epi32(r[0], r[1]), one16);
    const __m512i r23 = _mm512_madd_epi16(_mm512_packs_epi32(r[2], r[3]), one16);
    return _mm512_dpwssd_epi32(init, _mm512_packs_epi32(r01, r23), one16);
}

static const uint8_t *gemv_prep_k23(int qt, const uint8_t *act, int64_t k, int64_t kp) {
    uint8_t *g = scratch(1, (size_t)(kp + kp / 2) + 64);
    if (!g) return NULL;
    const float *ls = (const float *)(act + kp);
    float *c16 = (float *)(g + kp), *x32 = (float *)(g + kp + kp / 4 + kp / 8);
    int16_t *isum = (int16_t *)(g + kp + kp / 4);
    int32_t *init = (int32_t *)(g + kp + kp / 4);
    int32_t pair[16], natural[16], fold[16];
    float scale[16];
    for (int t = 0; t < 16; t++) {
        const int f = k23_fold(qt, t & 3);
        pair[t] = kK23Order[t] >> 1; /* the group's 32-block */
        natural[kK23Order[t]] = t;
        fold[t] = -4 << (2 * f);
        scale[t] = 1.0f / (float)(1 << (2 * f));
    }
    const __m512i vpair = _mm512_loadu_si512((const void *)pair), vnat = _mm512_loadu_si512((const void *)natural);
    const __m512i vfold = _mm512_loadu_si512((const void *)fold);
    const __m512 vscale = _mm512_loadu_ps(scale);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *x = act + 256 * b;
        uint8_t *q = g + 256 * b;
        __m512i r[4];
        for (int j = 0; j < 4; j++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(x + 32 * j)), hi = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * j));
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512((void *)(q + 64 * j), v);
            r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), v);
        }
        const __m512i sums = k23_reduce(r, _mm512_setzero_si512()); /* sum(q) per group, lane order t */
        float d8[8];
        for (int a = 0; a < 8; a++) d8[a] = ls[64 * b + 8 * a];
        const __m512 d = _mm512_castps256_ps512(_mm256_loadu_ps(d8));
        _mm512_storeu_ps(c16 + 16 * b, _mm512_mul_ps(_mm512_permutexvar_ps(vpair, d), vscale));
        if (qt == FK_Q3_K) {
            _mm512_storeu_si512((void *)(init + 16 * b), _mm512_mullo_epi32(sums, vfold));
        } else {
            _mm256_storeu_si256((__m256i *)(isum + 16 * b), _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(vnat, sums)));
            _mm256_storeu_ps(x32 + 8 * b, _mm256_loadu_ps(d8));
        }
    }
    return g;
}

static float gemv_q2k(const uint8_t *__restrict src, int64_t k, int64_t kp, const uint8_t *__restrict g) {
    const int8_t *xq = (const int8_t *)g;
    const float *c16 = (const float *)(g + kp), *x32 = (const float *)(g + kp + kp / 4 + kp / 8);
    const int16_t *isum = (const int16_t *)(g + kp + kp / 4);
    const __m128i order = _mm_loadu_si128((const __m128i *)kK23Order), m4 = _mm_set1_epi8(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m256 oacc = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 84;
        _mm_prefetch((const char *)p + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)p + 2048 + 64, _MM_HINT_T0);
        const __m128i sc = _mm_loadu_si128((const __m128i *)p);
        uint32_t dd;
        memcpy(&dd, p + 80, 4);
        const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd)); /* d, dmin */
        const __m512 S = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_and_si128(sc, m4), order)));
        const __m512 C = _mm512_mul_ps(S, _mm512_mul_ps(_mm512_broadcastss_ps(d2), _mm512_loadu_ps(c16 + 16 * b)));
        const __m256i mi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), m4)),
                                             _mm256_loadu_si256((const __m256i *)(isum + 16 * b)));
        oacc = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mi), _mm256_loadu_ps(x32 + 8 * b)),
                                _mm256_broadcastss_ps(_mm_movehdup_ps(d2)), oacc);
        const __m512i z = _mm512_loadu_si512((const void *)(p + 16));
        const int8_t *x = xq + 256 * b;
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_and_si512(z, _mm512_set1_epi8((char)(3 << (2 * j))));
            const __m512i i0 = _mm512_dpbusd_epi32(zmm_zero(), v, _mm512_loadu_si512((const void *)(x + 64 * j)));
            if (j & 1) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permute_ps(C, 0x55 * j), acc1);
            else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permute_ps(C, 0x55 * j), acc0);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_castps256_ps512(oacc)));
}

static float gemv_q3k(const uint8_t *__restrict src, int64_t k, int64_t kp, const uint8_t *__restrict g) {
    const int8_t *xq = (const int8_t *)g;
    const float *c16 = (const float *)(g + kp);
    const int32_t *init = (const int32_t *)(g + kp + kp / 4);
    const __m128i order = _mm_loadu_si128((const __m128i *)kK23Order);
    const __m512i m3 = _mm512_set1_epi8(3), m12 = _mm512_set1_epi8(12), b4 = _mm512_set1_epi8(4), b16 = _mm512_set1_epi8(16);
    __m512i hsel[4];
    for (int j = 0; j < 4; j++) /* the high bit of chunk j: bit j of hmask (bytes 0-31), bit 4 + j (32-63) */
        hsel[j] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)), _mm256_set1_epi8((char)(1 << (4 + j))), 1);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 110;
        _mm_prefetch((const char *)p + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)p + 2048 + 64, _MM_HINT_T0);
        /* 16 six-bit scales: low nibbles in bytes 0-7 (j < 8: low, j >= 8: high nibble of
         * byte j - 8), high 2 bits of j at bits 2(j >> 2) of byte 8 + (j & 3) */
        uint64_t a;
        uint32_t h;
        memcpy(&a, p + 96, 8);
        memcpy(&h, p + 104, 4);
        const uint32_t m2 = 0x03030303u;
        const uint64_t h0 = (uint64_t)(h & m2) | (uint64_t)((h >> 2) & m2) << 32;
        const uint64_t h1 = (uint64_t)((h >> 4) & m2) | (uint64_t)((h >> 6) & m2) << 32;
        const uint64_t s0 = (a & 0x0F0F0F0F0F0F0F0Full) | h0 << 4, s1 = ((a >> 4) & 0x0F0F0F0F0F0F0F0Full) | h1 << 4;
        const __m128i sc = _mm_sub_epi8(_mm_shuffle_epi8(_mm_set_epi64x((long long)s1, (long long)s0), order), _mm_set1_epi8(32));
        const __m512 C = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                                       _mm512_mul_ps(_mm512_set1_ps(rdh(p + 108)), _mm512_loadu_ps(c16 + 16 * b)));
        const __m512i z = _mm512_loadu_si512((const void *)(p + 32));
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
        const int8_t *x = xq + 256 * b;
        __m512i v[4] = {_mm512_and_si512(z, m3), _mm512_and_si512(z, m12), _mm512_and_si512(_mm512_srli_epi16(z, 2), m12),
                        _mm512_and_si512(_mm512_srli_epi16(z, 4), m12)};
        __m512i r[4];
        for (int j = 0; j < 4; j++) {
            v[j] = _mm512_mask_add_epi8(v[j], _mm512_test_epi8_mask(hm, hsel[j]), v[j], j ? b16 : b4);
            r[j] = _mm512_dpbusd_epi32(zmm_zero(), v[j], _mm512_loadu_si512((const void *)(x + 64 * j)));
        }
        const __m512i dot = k23_reduce(r, _mm512_loadu_si512((const void *)(init + 16 * b)));
        if (b & 1) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), C, acc1);
        else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), C, acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* IQ4_XS: each 32-value group unpacks like an IQ4_NL block, so it shares that
 * prepared activation order and the folded -128 offset; the group scale is per 32. */
static float gemv_iq4xs(const uint8_t *__restrict src, int64_t k, const uint8_t *__restrict g, int64_t kp) {
    const int8_t *xq = (const int8_t *)g;
    const float *xls = (const float *)(g + kp);
    const int32_t *init = (const int32_t *)(g + 2 * kp);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_iq4_u8));
    const __m512i pair = _mm512_loadu_si512((const void *)kPairNib);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *p = src + b * 136;
        for (int l = 0; l < 3; l++) _mm_prefetch((const char *)p + 2048 + 64 * l, _MM_HINT_T0);
        uint32_t sl;
        memcpy(&sl, p + 4, 4);
        /* group ib: low 4 bits at nibble ib of scales_l, high 2 bits at bits 2ib of scales_h */
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(p + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        const __m256i lsv = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        const __m512 S = _mm512_mul_ps(_mm512_set1_ps(rdh(p)), _mm512_cvtepi32_ps(_mm512_castsi256_si512(lsv)));
        for (int j = 0; j < 4; j++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(p + 8 + 32 * j));
            __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1),
                                         _mm512_set1_epi8(15));
            z = _mm512_shuffle_epi8(lut, z);
            const int64_t e = b * 256 + 64 * j;
            const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(init + e / 4)), z,
                                                   _mm512_loadu_si512((const void *)(xq + e)));
            const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * j)), S),
                                            _mm512_loadu_ps(xls + e / 4));
            if (j & 1) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), sc, acc1);
            else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), sc, acc0);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

static bool gemv_ok(int qt) {
    switch (qt) {
    case FK_Q4_0: case FK_Q4_1: case FK_IQ4_NL: case FK_Q5_0: case FK_Q5_1: case FK_Q8_0:
    case FK_Q2_K: case FK_Q3_K: case FK_Q4_K: case FK_Q5_K: case FK_Q6_K: case FK_IQ4_XS:
        return true;
    }
    return false;
}

/* rows [r0, r1) of the weight against M prepared activation rows g[0..M) -> y[j * ldy + r] */
template <int M, typename F>
static inline void rows_loop(F dot, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        float o[M];
        dot(w + r * rb, o);
        for (int j = 0; j < M; j++) y[j * ldy + r] = o[j];
    }
}

template <int M>
static void gemv_rows_m(int qt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                        const uint8_t *const *g, float *y, int64_t ldy) {
#define FK_ROWS(call) rows_loop<M>([&](const uint8_t *wr, float *o) { call; }, w, rb, r0, r1, y, ldy)
    switch (qt) {
    case FK_Q4_0: FK_ROWS((gemv32<FK_Q4_0, M>(wr, k, g, kp, o))); break;
    case FK_Q4_1: FK_ROWS((gemv32<FK_Q4_1, M>(wr, k, g, kp, o))); break;
    case FK_IQ4_NL: FK_ROWS((gemv32<FK_IQ4_NL, M>(wr, k, g, kp, o))); break;
    case FK_Q5_0: FK_ROWS((gemv32<FK_Q5_0, M>(wr, k, g, kp, o))); break;
    case FK_Q5_1: FK_ROWS((gemv32<FK_Q5_1, M>(wr, k, g, kp, o))); break;
    case FK_Q8_0: FK_ROWS((gemv32<FK_Q8_0, M>(wr, k, g, kp, o))); break;
    case FK_Q4_K: FK_ROWS((gemv_q45k<FK_Q4_K, M>(wr, k, kp, g, o))); break;
    case FK_Q5_K: FK_ROWS((gemv_q45k<FK_Q5_K, M>(wr, k, kp, g, o))); break;
    case FK_Q6_K: FK_ROWS((gemv_q6k<M>(wr, k, kp, g, o))); break;
    /* one activation row only (gemv_m_ok keeps them out of M > 1) */
    case FK_Q2_K: FK_ROWS((o[0] = gemv_q2k(wr, k, kp, g[0]))); break;
    case FK_Q3_K: FK_ROWS((o[0] = gemv_q3k(wr, k, kp, g[0]))); break;
    case FK_IQ4_XS: FK_ROWS((o[0] = gemv_iq4xs(wr, k, g[0], kp))); break;
    }
#undef FK_ROWS
}

static void gemv_rows(int qt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                      const uint8_t *act, float *y) {
    gemv_rows_m<1>(qt, w, rb, r0, r1, k, kp, &act, y, 0);
}

/* formats with a fused route for 2..4 activation rows */
static bool gemv_m_ok(int qt, int64_t m) {
    if (m < 2 || m > 4) return false;
    switch (qt) {
    case FK_Q4_0: case FK_Q4_1: case FK_IQ4_NL: case FK_Q5_0: case FK_Q5_1: case FK_Q8_0:
    case FK_Q4_K: case FK_Q5_K: case FK_Q6_K:
        return true;
    }
    return false;
}

static void gemv_rows_multi(int qt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                            const uint8_t *const *g, int64_t m, float *y, int64_t ldy) {
    if (m == 2) gemv_rows_m<2>(qt, w, rb, r0, r1, k, kp, g, y, ldy);
    else if (m == 3) gemv_rows_m<3>(qt, w, rb, r0, r1, k, kp, g, y, ldy);
    else gemv_rows_m<4>(qt, w, rb, r0, r1, k, kp, g, y, ldy);
}

/* ---- prefill route: weights decoded to bf16, AVX-512 BF16 outer-product GEMM --------
 * vdpbf16ps does 32 MACs per instruction with f32 accumulation and no per-block
 * rescaling, about twice the useful work per instruction of the int8 route. Only
 * used when the CPU has AVX512_BF16 (the module checks). */

static inline void store_bf16(uint16_t *dst, __m512 lo, __m512 hi) {
    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* one BF16 (or F16 / F32) weight row -> bf16[kp32], through the f32 row `f` */
static void decode_row_bf16(int qt, const uint8_t *src, int64_t k, int64_t kp32, float *f, uint16_t *out) {
    decode_row_f32(qt, src, k, kp32, f);
    for (int64_t i = 0; i < kp32; i += 32) store_bf16(out + i, _mm512_loadu_ps(f + i), _mm512_loadu_ps(f + i + 16));
}

/* ---- outer-product GEMM: packed panels of NR weight rows ------------------------------
 * A panel of NR = 32 weight rows is decoded once and packed in the VNNI bf16 layout
 * [kp/2][32][2]: the 32-bit element (p, j) holds the bf16 pair (w[j][2p], w[j][2p+1]).
 * Activations are packed per tile of up to MR rows as [kp/2][mr][2]. The microkernel
 * keeps acc[2][MR] zmm (16 output features each); per k-pair it loads the two panel
 * zmm and issues one vdpbf16ps per activation row with the row's pair broadcast, so
 * there is no horizontal reduction: lanes are output features, stored straight to y. */

#define GB_NR 32
#define GB_MR 12

/* 16x16 transpose of 32-bit elements */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4i + j]: lane L holds column 4L + j of rows 4i..4i+3; at the end r[j] is column j */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* row-major bf16 rows [32][kp] -> packed [kp/2][32] pairs */
static void pack_panel(const uint16_t *rm, int64_t kp, uint32_t *out) {
    for (int64_t c = 0; c < kp / 32; c++) {
        for (int h = 0; h < 2; h++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(rm + (h * 16 + i) * kp + 32 * c));
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(out + (16 * c + j) * GB_NR + 16 * h), r[j]);
        }
    }
}

/* quantized rows [0, nr) of a panel -> packed [kp/2][32] pairs, via the int layout of
 * 16 rows at a time in `tmp` (16 * rowsz bytes); rows nr..31 pack as zeros. Every
 * format's groups span 16 or 32 aligned elements, so one lane scale serves 16. */
static inline size_t panel_rowsz(int64_t k) { return (size_t)fk_round_up(k, 64) * 9 / 4 + 64; }

static void pack_panel_q(int qt, const uint8_t *w, size_t row_bytes, int nr, int64_t k, int64_t kp, uint8_t *tmp,
                         uint32_t *out) {
    const int64_t kq = fk_round_up(k, 64);
    const size_t rowsz = panel_rowsz(k);
    for (int h = 0; h < 2; h++) {
        const int rows = nr - 16 * h < 0 ? 0 : nr - 16 * h > 16 ? 16 : nr - 16 * h;
        for (int j = 0; j < rows; j++) decode_row(qt, w + (16 * h + j) * row_bytes, k, kq, tmp + j * rowsz);
        for (int64_t e = 0; e < kp; e += 32) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                if (j >= rows) {
                    r[j] = _mm512_setzero_si512();
                    continue;
                }
                const uint8_t *q = tmp + j * rowsz;
                const float *ls = (const float *)(q + kq), *off = (const float *)(q + 2 * kq);
                __m512 v[2];
                for (int i = 0; i < 2; i++) {
                    const int64_t f = e + 16 * i;
                    const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + f))));
                    v[i] = _mm512_fmadd_ps(u, _mm512_set1_ps(ls[f / 4]), _mm512_set1_ps(off[f / 16]));
                }
                r[j] = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(out + (e / 2 + j) * GB_NR + 16 * h), r[j]);
        }
    }
}

template <int MR>
static inline void gemm_kern(const uint32_t *__restrict wp, const uint32_t *__restrict xp, int64_t np, float *y,
                             int64_t ldy, __mmask16 k0, __mmask16 k1) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; r++) a0[r] = a1[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t p = 0; p < np; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + p * GB_NR));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wp + p * GB_NR + 16));
        _mm_prefetch((const char *)(xp + (p + 32) * MR), _MM_HINT_T0); /* activations from L2/L3 */
        for (int r = 0; r < MR; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[p * MR + r]);
            a0[r] = _mm512_dpbf16_ps(a0[r], w0, xb);
            a1[r] = _mm512_dpbf16_ps(a1[r], w1, xb);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, a0[r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, a1[r]);
    }
}

static void gemm_tile(int mr, const uint32_t *wp, const uint32_t *xp, int64_t np, float *y, int64_t ldy,
                      __mmask16 k0, __mmask16 k1) {
    switch (mr) {
    case 1: gemm_kern<1>(wp, xp, np, y, ldy, k0, k1); break;
    case 2: gemm_kern<2>(wp, xp, np, y, ldy, k0, k1); break;
    case 3: gemm_kern<3>(wp, xp, np, y, ldy, k0, k1); break;
    case 4: gemm_kern<4>(wp, xp, np, y, ldy, k0, k1); break;
    case 5: gemm_kern<5>(wp, xp, np, y, ldy, k0, k1); break;
    case 6: gemm_kern<6>(wp, xp, np, y, ldy, k0, k1); break;
    case 7: gemm_kern<7>(wp, xp, np, y, ldy, k0, k1); break;
    case 8: gemm_kern<8>(wp, xp, np, y, ldy, k0, k1); break;
    case 9: gemm_kern<9>(wp, xp, np, y, ldy, k0, k1); break;
    case 10: gemm_kern<10>(wp, xp, np, y, ldy, k0, k1); break;
    case 11: gemm_kern<11>(wp, xp, np, y, ldy, k0, k1); break;
    default: gemm_kern<12>(wp, xp, np, y, ldy, k0, k1); break;
    }
}

/* activation rows [0, mr) of x (mr <= 16) -> bf16 pairs packed [kp/2][mr] */
static void pack_act(const float *x, int64_t k, int64_t kp, int mr, uint32_t *out) {
    const __mmask16 keep = (__mmask16)((1u << mr) - 1);
    for (int64_t i = 0; i < kp; i += 32) {
        const __mmask16 m0 = i + 16 <= k ? (__mmask16)0xFFFF : i < k ? (__mmask16)((1u << (k - i)) - 1) : 0;
        const __mmask16 m1 = i + 32 <= k ? (__mmask16)0xFFFF : i + 16 < k ? (__mmask16)((1u << (k - i - 16)) - 1) : 0;
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            if (j < mr) {
                const float *xr = x + j * k + i;
                r[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, xr + 16), _mm512_maskz_loadu_ps(m0, xr));
            } else {
                r[j] = _mm512_setzero_si512();
            }
        }
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_mask_storeu_epi32((void *)(out + (i / 2 + j) * mr), keep, r[j]);
    }
}

static void matmul_bf16(const fk_matmul_args *a) {
    const int64_t n = a->n, k = a->k, m = a->m;
    const int64_t kp = fk_round_up(k, 32), np = kp / 2;
    uint32_t *act = (uint32_t *)scratch(0, (size_t)(m * kp) * 2);
    if (!act) return;
    const int64_t npanels = (n + GB_NR - 1) / GB_NR, mtiles = (m + GB_MR - 1) / GB_MR;
    int nt = a->nthreads;
    if (nt > npanels) nt = (int)npanels;
    if (nt < 1) nt = 1;
    /* per-thread scratch (slot 1): staging, then the packed panel. Float rows stage as
     * one f32 row and 32 row-major bf16 rows; quantized rows as the int layout of 16 */
    const bool fl = a->qtype == FK_F32 || a->qtype == FK_F16 || a->qtype == FK_BF16;
    const size_t psz = (size_t)(GB_NR * kp) * 2, fsz = (size_t)(kp * 4 + 64);
    const size_t tmpsz = fl ? fsz + psz : 16 * panel_rowsz(k);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        uint8_t *buf = scratch(1, tmpsz + psz + 64);
        uint16_t *rm = buf ? (uint16_t *)(buf + fsz) : NULL;
        uint32_t *pk = buf ? (uint32_t *)(buf + tmpsz) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mtiles; t++) {
            const int mr = (int)(m - t * GB_MR < GB_MR ? m - t * GB_MR : GB_MR);
            pack_act(a->x + t * GB_MR * k, k, kp, mr, act + t * GB_MR * np);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t pn = 0; pn < npanels; pn++) {
            if (!buf) continue;
            const int64_t n0 = pn * GB_NR;
            const int nr = (int)(n - n0 < GB_NR ? n - n0 : GB_NR);
            if (fl) {
                for (int r = 0; r < nr; r++)
                    decode_row_bf16(a->qtype, a->w + (n0 + r) * a->row_bytes, k, kp, (float *)buf, rm + r * kp);
                if (nr < GB_NR) memset(rm + nr * kp, 0, (size_t)((GB_NR - nr) * kp) * 2);
                pack_panel(rm, kp, pk);
            } else {
                pack_panel_q(a->qtype, a->w + n0 * a->row_bytes, a->row_bytes, nr, k, kp, buf, pk);
            }
            const __mmask16 k0 = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
            const __mmask16 k1 = nr >= 32 ? (__mmask16)0xFFFF : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0;
            for (int64_t t = 0; t < mtiles; t++) {
                const int mr = (int)(m - t * GB_MR < GB_MR ? m - t * GB_MR : GB_MR);
                gemm_tile(mr, pk, act + t * GB_MR * np, np, a->y + t * GB_MR * a->ldy + n0, a->ldy, k0, k1);
            }
        }
    }
}

/* ---- activations ------------------------------------------------------------------ */

/* one block of 32 activations -> int8 at q (round to nearest even, d = amax / 127); returns d,
 * the sums of the two halves' int8 in s0, s1 */
static inline float quant_block32(const float *__restrict x, int8_t *__restrict q, int *s0, int *s1) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
    *s0 = _mm512_reduce_add_epi32(q0);
    *s1 = _mm512_reduce_add_epi32(q1);
    return d;
}

/* quant_act's layout: q[kp] | ls[kp / 4] (d per 4 values) | s16[kp / 16] (d * sum q per 16);
 * the canonical rows (extras) add dx, jf, zi, sq after it (matmul_impl.inc) */
static void quant_rows_act(const float *__restrict x, int64_t k, int64_t kp, uint8_t *__restrict dst, bool extras,
                           int z, bool g16) {
    int8_t *q = (int8_t *)dst;
    float *ls = (float *)(dst + kp), *s16 = (float *)(dst + 2 * kp);
    for (int64_t b = 0; b < kp / 32; b++) {
        const int64_t e0 = b * 32;
        float d = 0.0f;
        int s0 = 0, s1 = 0;
        if (e0 < k) d = quant_block32(x + e0, q + e0, &s0, &s1);
        else _mm256_storeu_si256((__m256i *)(q + e0), _mm256_setzero_si256());
        _mm256_storeu_ps(ls + b * 8, _mm256_set1_ps(d));
        s16[2 * b] = d * (float)s0;
        s16[2 * b + 1] = d * (float)s1;
        if (extras) cb_extras(dst, kp, b, d, s0, s1, z, g16);
    }
}

static bool fast_quant_act(const float *__restrict x, int64_t k, int64_t kp, uint8_t *__restrict dst) {
    quant_rows_act(x, k, kp, dst, false, 0, false);
    return true;
}

/* matmul_impl.inc's cb_quant_act in one pass: the extras from the block sums the
 * quantization already has in registers (the generic way re-sums every block) */
static bool cb_fast_quant_act(const float *__restrict x, int64_t k, int64_t kp, int z, bool g16,
                              uint8_t *__restrict dst) {
    quant_rows_act(x, k, kp, dst, true, z, g16);
    return true;
}

#include "avx512_cbgemv.inc"

/* attention and the layer step on the same vectors */
namespace attn {

#include "generic/x86_attn.inc"  /* over the operations below */
static inline float vhadd(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vloadh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vstoreh(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline vf vblend_neg(vf z, vf a, vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
}

}  // namespace attn
}  // namespace fk_avx512_ns

#pragma GCC pop_options

FK_ISA_TABLE(avx512)
