/* DeepSeek-V4's small per-row ops (fk_dsv4.h). Plain loops over contiguous rows the compiler
 * vectorizes, cloned per x86-64 level; no contraction to FMA and no reassociation, so
 * every clone (and the numpy reference in tests/test_deepseek4.py) gives the same bits. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <string.h>

#include "fk_common.h"   /* fk_h2f_portable */
#include "fk_dsv4.h"

#if defined(FK_X86) && defined(__GNUC__) && !defined(__clang__)
#define FK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FK_CLONES
#endif

enum { HC = 4, MIX = (2 + HC) * HC };

static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* one row's 4x4 comb from its mixes: softmax over dst per src, + eps, then Sinkhorn */
static void comb_row(const float *mix, float scale, const float *base, int iters, float eps, float *c) {
    for (int s = 0; s < HC; s++) {
        float *r = c + s * HC, mx = -INFINITY;
        for (int d = 0; d < HC; d++) {
            r[d] = mix[2 * HC + s * HC + d] * scale + base[2 * HC + s * HC + d];
            mx = r[d] > mx ? r[d] : mx;
        }
        float sum = 0.0f;
        for (int d = 0; d < HC; d++) {
            r[d] = expf(r[d] - mx);
            sum += r[d];
        }
        const float inv = 1.0f / sum;
        for (int d = 0; d < HC; d++) r[d] = r[d] * inv + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it) {   /* rows (over dst) */
            for (int s = 0; s < HC; s++) {
                float sum = eps;
                for (int d = 0; d < HC; d++) sum += c[s * HC + d];
                const float inv = 1.0f / sum;
                for (int d = 0; d < HC; d++) c[s * HC + d] *= inv;
            }
        }
        for (int d = 0; d < HC; d++) {   /* columns (over src) */
            float sum = eps;
            for (int s = 0; s < HC; s++) sum += c[s * HC + d];
            const float inv = 1.0f / sum;
            for (int s = 0; s < HC; s++) c[s * HC + d] *= inv;
        }
    }
}

FK_CLONES static void weigh(const float *x, const float *w, int64_t n, float *h) {
    const float *x0 = x, *x1 = x + n, *x2 = x + 2 * n, *x3 = x + 3 * n;
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    for (int64_t i = 0; i < n; i++) {
        float s = x0[i] * w0;
        s += x1[i] * w1;
        s += x2[i] * w2;
        s += x3[i] * w3;
        h[i] = s;
    }
}

FK_CLONES static void mix_row(const float *y, const float *x, const float *post, const float *c, int64_t n,
                              float *out) {
    for (int d = 0; d < HC; d++) {
        const float p = post[d], c0 = c[d], c1 = c[HC + d], c2 = c[2 * HC + d], c3 = c[3 * HC + d];
        const float *x0 = x, *x1 = x + n, *x2 = x + 2 * n, *x3 = x + 3 * n;
        float *o = out + d * n;
        for (int64_t i = 0; i < n; i++) {
            float s = y[i] * p;
            s += x0[i] * c0;
            s += x1[i] * c1;
            s += x2[i] * c2;
            s += x3[i] * c3;
            o[i] = s;
        }
    }
}

void fk_hc_pre(const float *mix, const float *x, const float *scale, const float *base, int64_t m, int64_t n,
               int iters, float eps, float *h, float *post, float *comb) {
    for (int64_t r = 0; r < m; r++) {
        const float *z = mix + r * MIX;
        float pre[HC];
        for (int s = 0; s < HC; s++) {
            pre[s] = sigmoid(z[s] * scale[0] + base[s]) + eps;
            post[r * HC + s] = 2.0f * sigmoid(z[HC + s] * scale[1] + base[HC + s]);
        }
        comb_row(z, scale[2], base, iters, eps, comb + r * HC * HC);
        weigh(x + r * HC * n, pre, n, h + r * n);
    }
}

void fk_hc_post(const float *y, const float *x, const float *post, const float *comb, int64_t m, int64_t n,
                float *out) {
    for (int64_t r = 0; r < m; r++)
        mix_row(y + r * n, x + r * HC * n, post + r * HC, comb + r * HC * HC, n, out + r * HC * n);
}

FK_CLONES static void scale_row(const float *x, const float *w, int64_t n, float scale, float *out) {
    if (w) {
        for (int64_t i = 0; i < n; i++) out[i] = (x[i] * scale) * w[i];
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale;
    }
}

void fk_rms_norm(const float *x, const float *w, int64_t m, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        scale_row(xr, w, n, 1.0f / sqrtf(mean + eps), out + r * n);
    }
}

FK_CLONES void fk_swiglu_clamp(const float *g, const float *u, int64_t n, float limit, float *out) {
    if (limit <= 1e-6f) {
        for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float gv = g[i] < limit ? g[i] : limit;
        const float uv = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
        out[i] = gv / (1.0f + expf(-gv)) * uv;
    }
}

void fk_rope_tail(float *x, int64_t m, int64_t heads, int64_t d, const float *cs, int64_t n_rot, int inverse) {
    const float sign = inverse ? -1.0f : 1.0f;
    for (int64_t r = 0; r < m; r++) {
        const float *c = cs + r * n_rot;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (r * heads + h) * d + d - n_rot;
            for (int64_t i = 0; i < n_rot / 2; i++) {   /* (a + ib)(cos + i sin), as torch's complex multiply */
                const float a = v[2 * i], b = v[2 * i + 1], co = c[2 * i], si = sign * c[2 * i + 1];
                v[2 * i] = a * co - b * si;
                v[2 * i + 1] = a * si + b * co;
            }
        }
    }
}

/* one Q8_0 row (in / 32 blocks of an f16 scale and 32 int8) against x: per block, eight lane
 * sums of its products, lane l = (q[l] x[l] + q[l+8] x[l+8]) + (q[l+16] x[l+16] + q[l+24] x[l+24]),
 * times its scale, join eight running sums, added pairwise at the end. The AVX2 form and the
 * portable one compute exactly that (no FMA), so both give the same bits. */
static inline float f16_value(const uint8_t *p) {   /* a block's little-endian f16 scale */
    uint16_t h;
    memcpy(&h, p, 2);
    return fk_h2f_portable(h);
}

static float lanes_sum(const float a[8]) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static float q8_0_dot_portable(const uint8_t *row, const float *x, int64_t in) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < in / 32; b++) {
        const uint8_t *blk = row + b * 34;
        const int8_t *q = (const int8_t *)(blk + 2);
        const float *xb = x + b * 32, d = f16_value(blk);
        for (int l = 0; l < 8; l++) {
            const float s = ((float)q[l] * xb[l] + (float)q[l + 8] * xb[l + 8]) +
                            ((float)q[l + 16] * xb[l + 16] + (float)q[l + 24] * xb[l + 24]);
            acc[l] += d * s;
        }
    }
    return lanes_sum(acc);
}

#if defined(FK_X86) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2,f16c"))) static float q8_0_dot_avx2(const uint8_t *row, const float *x, int64_t in) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < in / 32; b++) {
        const uint8_t *blk = row + b * 34;
        const __m128i lo = _mm_loadu_si128((const __m128i *)(blk + 2)), hi = _mm_loadu_si128((const __m128i *)(blk + 18));
        const float *xb = x + b * 32;
        const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(xb));
        const __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                                        _mm256_loadu_ps(xb + 8));
        const __m256 p2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(xb + 16));
        const __m256 p3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                                        _mm256_loadu_ps(xb + 24));
        const __m256 s = _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3));
        uint16_t h;
        memcpy(&h, blk, 2);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), s));
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    return lanes_sum(a);
}
#endif

static float q8_0_dot(const uint8_t *row, const float *x, int64_t in, int avx2) {
#if defined(FK_X86) && defined(__GNUC__)
    if (avx2) return q8_0_dot_avx2(row, x, in);
#endif
    (void)avx2;
    return q8_0_dot_portable(row, x, in);
}

void fk_q8_0_grouped(const uint8_t *w, int64_t g, int64_t rank, int64_t in, const float *x, int64_t m, float *y,
                     int nthreads, int simd) {
    const int64_t rb = in / 32 * 34, n = m * g * rank;
#if defined(FK_X86) && defined(__GNUC__)
    const int avx2 = simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    const int avx2 = 0;
    (void)simd;
#endif
#pragma omp parallel for collapse(3) num_threads(nthreads) if (nthreads > 1 && n >= 256) schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < g; j++)
            for (int64_t o = 0; o < rank; o++)
                y[(r * g + j) * rank + o] = q8_0_dot(w + (j * rank + o) * rb, x + (r * g + j) * in, in, avx2);
}
