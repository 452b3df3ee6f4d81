/* fucina native kernels: declarations shared by the module and the per-ISA units.
 *
 * Every quantized format is handled through one intermediate form, decoded a few
 * weight rows at a time into a small per-thread buffer that stays in L1/L2:
 *
 *   w[i] = s[g] * u[i] + o[g]        u: uint8, s/o: float, g: group of 16 or 32
 *
 * and activations are quantized per 32-element block to int8 (x[i] ~ d * q[i]).
 * Then  sum_i w[i] x[i] = sum_lanes s*d*dot4(u, q)  +  sum_g16 o * (d * sum q).
 * The integer part is one u8 x s8 dot (AVX-512 VNNI vpdpbusd: 64 MACs per op);
 * the offset part is a short float dot over 16-element group sums.
 *
 * Layout of a decoded weight row / quantized activation row, kp = k rounded up to 64:
 *   uint8/int8 q[kp] | float ls[kp/4] (scale of each 4-element lane) | float off[kp/16]
 * (for activations `off` holds d * sum(q) over each 16 elements).
 */
#ifndef FK_COMMON_H
#define FK_COMMON_H

#include <stddef.h>
#include <stdint.h>

/* GGML type ids (ggml.h) of the formats with a native route. */
enum {
    FK_F32 = 0, FK_F16 = 1, FK_Q4_0 = 2, FK_Q4_1 = 3, FK_Q5_0 = 6, FK_Q5_1 = 7,
    FK_Q8_0 = 8, FK_Q2_K = 10, FK_Q3_K = 11, FK_Q4_K = 12, FK_Q5_K = 13, FK_Q6_K = 14,
    FK_IQ4_NL = 20, FK_IQ4_XS = 23, FK_BF16 = 30,
};

/* One matmul: y[m, n] = x[m, k] @ W[n, k]^T, W in GGML blocks, row_bytes per row. */
typedef struct {
    int qtype;
    const uint8_t *w;
    size_t row_bytes;
    int64_t n, k, m;
    const float *x;
    float *y;
    int64_t ldy;      /* row stride of y in floats (>= n) */
    int nthreads;
    int prefill;      /* FK_PREFILL_*: which route serves m >= FK_PREFILL_MIN_M */
} fk_matmul_args;

enum { FK_PREFILL_INT8 = 0, FK_PREFILL_BF16 = 1 };
#define FK_PREFILL_MIN_M 8

typedef struct {
    const char *name;
    void (*matmul)(const fk_matmul_args *a);
    /* test hook: quantize activations exactly as matmul does and dequantize back */
    void (*act_roundtrip)(const float *x, int64_t k, float *out);
} fk_isa;

#ifdef __cplusplus
extern "C" {
#endif
extern const fk_isa fk_isa_scalar;
extern const fk_isa fk_isa_avx2;
extern const fk_isa fk_isa_avx512;
#ifdef __cplusplus
}
#endif

#endif
