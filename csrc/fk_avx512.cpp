/* AVX-512 (F, BW, VL, DQ) + VNNI: vpdpbusd does 64 u8 x s8 MACs per instruction.
 * Compiled with a target pragma, chosen at run time only when the CPU has these. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "fk_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")

namespace fk_avx512_ns {

static inline float fk_h2f(uint16_t h) { return _cvtsh_ss(h); }

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

template <int R, int C>
static inline void tile_f(const float *wt, int64_t ldw, const float *xt, int64_t ldx, int64_t kp, float out[][FK_C]) {
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i += 16) {
        __m512 w[R];
        for (int r = 0; r < R; r++) w[r] = _mm512_loadu_ps(wt + r * ldw + i);
        for (int c = 0; c < C; c++) {
            const __m512 xv = _mm512_loadu_ps(xt + c * ldx + i);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(w[r], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#undef FK_C

#include "fk_impl.inc"

}  // namespace fk_avx512_ns

#pragma GCC pop_options

extern "C" const fk_isa fk_isa_avx512 = {"avx512", fk_avx512_ns::fk_matmul, fk_avx512_ns::fk_act_roundtrip};
