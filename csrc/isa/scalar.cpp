/* The portable unit: plain C++, no target-specific instructions (every CPU, and the
 * reference the SIMD units match bit for bit on the canonical route). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fk_common.h"
#include "fk_delta.h"   /* fk_delta_layer: the DeltaNet mixer of the step */
#include "fk_kda.h"     /* fk_kda_layer: the KDA mixer of the step */
#include "fk_dsv4.h"    /* fk_swiglu_clamp: deepseek4's ffn act in the step */

namespace fk_scalar_ns {

static inline float fk_h2f(uint16_t h) { return fk_h2f_portable(h); }

#define FK_C 4
template <int R, int C>
static inline void tile_q(const uint8_t *wt, const uint8_t *xt, size_t rowsz, int64_t kp, float out[][FK_C]) {
    for (int r = 0; r < R; r++) {
        const uint8_t *wq = wt + r * rowsz;
        const float *wls = (const float *)(wq + kp), *woff = (const float *)(wq + 2 * kp);
        for (int c = 0; c < C; c++) {
            const int8_t *xq = (const int8_t *)(xt + c * rowsz);
            const float *xls = (const float *)(xt + c * rowsz + kp), *xs16 = (const float *)(xt + c * rowsz + 2 * kp);
            float acc = 0.0f;
            for (int64_t g = 0; g < kp / 16; g++) {
                int32_t s = 0;
                for (int i = 0; i < 16; i++) s += (int32_t)wq[g * 16 + i] * (int32_t)xq[g * 16 + i];
                acc += (float)s * wls[g * 4] * xls[g * 4] + woff[g] * xs16[g];
            }
            out[r][c] = acc;
        }
    }
}

template <int R, int C>
static inline void tile_f(const float *wt, int64_t ldw, const float *xt, int64_t ldx, int64_t kp, float out[][FK_C]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < kp; i++) acc += wt[r * ldw + i] * xt[c * ldx + i];
            out[r][c] = acc;
        }
}
#undef FK_C

#define CB_NP 8
#define CB_MR 4
#include "generic/matmul_impl.inc"

/* attention and the layer step on plain floats (VW = 1) */
namespace attn {

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
#include "generic/attn_impl.inc"
#include "generic/step_impl.inc"
#undef VW
#undef FK_AB

}  // namespace attn
}  // namespace fk_scalar_ns

FK_ISA_TABLE(scalar)
