/* DeepSeek-V4's small per-row ops (fucina.models.deepseek4): the hyper-connection mixers
 * after their 24-mix projection, in the order of ggml's fused CPU ops (dsv4_hc_comb,
 * dsv4_hc_pre, dsv4_hc_post; four streams), the RMS norm and the clamped SwiGLU as ggml
 * computes them. Rows independent; f32 throughout. */
#pragma once
#include <stdint.h>

/* m rows: mix [m, 24] (hc_fn of the RMS-normed streams), x [m, 4, n] the streams, scale [3]
 * (pre, post, comb), base [24]. Writes h [m, n] = sum_s pre[s] x[s] with pre = sigmoid(.) +
 * eps, post [m, 4] = 2 sigmoid(.), comb [m, 4 src, 4 dst] = the Sinkhorn-normalised softmax
 * (iters >= 1 column passes, iters - 1 row passes between them). */
void fk_hc_pre(const float *mix, const float *x, const float *scale, const float *base, int64_t m, int64_t n,
               int iters, float eps, float *h, float *post, float *comb);

/* m rows: out [m, 4, n], out[d] = y post[d] + sum_s comb[s][d] x[s] (sources in order) */
void fk_hc_post(const float *y, const float *x, const float *post, const float *comb, int64_t m, int64_t n,
                float *out);

/* m rows of n: out = x / sqrt(mean(x^2) + eps) (the squares summed in double, in order),
 * then times w when w is not NULL (ggml_rms_norm, then ggml_mul) */
void fk_rms_norm(const float *x, const float *w, int64_t m, int64_t n, float eps, float *out);

/* n values: out = silu(min(g, limit)) * clamp(u, -limit, limit), or silu(g) * u when limit
 * <= 1e-6 (ggml's swiglu_clamp CPU op) */
void fk_swiglu_clamp(const float *g, const float *u, int64_t n, float limit, float *out);

/* m rows of `heads` heads of d: the last n_rot values of each head rotated in adjacent pairs
 * (GGML's NORM mode) by row r's (cos, sin) pairs cs [m, n_rot / 2, 2], in place; inverse:
 * the rotation back (sin negated) */
void fk_rope_tail(float *x, int64_t m, int64_t heads, int64_t d, const float *cs, int64_t n_rot, int inverse);


/* DeepSeek-V4's grouped output projection with Q8_0 weights and f32 activations (the
 * arithmetic of the dequantized weight, not llama.cpp's q8_0 activations): for each of m rows
 * and g groups, y[r, j, :] = W_j x[r, j, :] with W_j rows j * rank .. of w (Q8_0 blocks,
 * in / 32 per row), x [m, g, in], y [m, g, rank]; rows split over nthreads; simd 0: the
 * portable loop (the same bits as the AVX2 one) */
void fk_q8_0_grouped(const uint8_t *w, int64_t g, int64_t rank, int64_t in, const float *x, int64_t m, float *y,
                     int nthreads, int simd);
