/* Attention over the f16 KV cache (fk_attn_impl.inc) and the decoder layer step that
 * uses it (fk_step_impl.inc), compiled once per ISA:
 * scalar everywhere, AVX2+F16C and AVX-512 on x86. fk_module.cpp picks one from the
 * matmul ISA in force, so set_isa() selects the attention level too. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fk_common.h"
#include "fk_delta.h"   /* fk_delta_layer: the DeltaNet mixer of the step */

namespace fk_attn_scalar {

#define VW 1
typedef float vf;
static inline float h2f(uint16_t h) { return fk_h2f_portable(h); }
static inline vf vzero() { return 0.0f; }
static inline vf vset1(float x) { return x; }
static inline vf vloadf(const float *p) { return *p; }
static inline void vstoref(float *p, vf v) { *p = v; }
static inline vf vloadh(const uint16_t *p) { return h2f(*p); }
static inline vf vfmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline float vhadd(vf v) { return v; }
static inline float vhmax(vf v) { return v; }
static inline vf vexp(vf x) { return expf(x < -87.0f ? -87.0f : x); }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vblend_neg(vf z, vf a, vf b) { return z >= 0.0f ? a : b; }
static inline void vstoreh(uint16_t *p, vf v) { *p = fk_f2h_portable(v); }
#include "fk_attn_impl.inc"
#include "fk_step_impl.inc"
#undef VW
#undef FK_AB

}  // namespace fk_attn_scalar

extern "C" void fk_attn_decode_scalar(const fk_attn_args *a) { fk_attn_scalar::fk_attn_decode_impl(a); }
extern "C" void fk_step_scalar(fk_step_args *a) { fk_attn_scalar::fk_step_impl(a); }

#ifdef FK_X86
#include <immintrin.h>

/* GCC 12 flags the undefined source operand inside _mm512_cvtph_ps (a false positive) */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

/* exp for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor
 * (relative error ~2e-7, below f32 rounding of the sums it feeds) */
#define FK_EXP_CONSTS                                                                     \
    const float l2e = 1.44269504088896341f, ln2hi = 0.693359375f, ln2lo = -2.12194440e-4f; \
    const float c2 = 0.5f, c3 = 1.0f / 6, c4 = 1.0f / 24, c5 = 1.0f / 120, c6 = 1.0f / 720;

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fk_attn_avx2 {

#define VW 8
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vloadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vloadh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
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
static inline vf vexp(vf x) {
    FK_EXP_CONSTS
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(l2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ln2hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ln2lo), r);
    vf p = _mm256_fmadd_ps(_mm256_set1_ps(c6), r, _mm256_set1_ps(c5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vblend_neg(vf z, vf a, vf b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ)); }
static inline void vstoreh(uint16_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "fk_attn_impl.inc"
#include "fk_step_impl.inc"
#undef VW
#undef FK_AB

}  // namespace fk_attn_avx2
#pragma GCC pop_options

extern "C" void fk_attn_decode_avx2(const fk_attn_args *a) { fk_attn_avx2::fk_attn_decode_impl(a); }
extern "C" void fk_step_avx2(fk_step_args *a) { fk_attn_avx2::fk_step_impl(a); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace fk_attn_avx512 {

#define VW 16
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vloadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoref(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vloadh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vhadd(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vexp(vf x) {
    FK_EXP_CONSTS
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(l2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2lo), r);
    vf p = _mm512_fmadd_ps(_mm512_set1_ps(c6), r, _mm512_set1_ps(c5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vblend_neg(vf z, vf a, vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
}
static inline void vstoreh(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "fk_attn_impl.inc"
#include "fk_step_impl.inc"
#undef VW
#undef FK_AB

}  // namespace fk_attn_avx512
#pragma GCC pop_options

extern "C" void fk_attn_decode_avx512(const fk_attn_args *a) { fk_attn_avx512::fk_attn_decode_impl(a); }
extern "C" void fk_step_avx512(fk_step_args *a) { fk_attn_avx512::fk_step_impl(a); }
#else
extern "C" void fk_attn_decode_avx2(const fk_attn_args *a) { fk_attn_decode_scalar(a); }
extern "C" void fk_attn_decode_avx512(const fk_attn_args *a) { fk_attn_decode_scalar(a); }
extern "C" void fk_step_avx2(fk_step_args *a) { fk_step_scalar(a); }
extern "C" void fk_step_avx512(fk_step_args *a) { fk_step_scalar(a); }
#endif
