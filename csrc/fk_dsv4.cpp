/* DeepSeek-V4's small per-row ops (fk_dsv4.h). Plain loops over contiguous rows the compiler
 * vectorizes, cloned per x86-64 level; no contraction to FMA and no reassociation, so
 * every clone (and the numpy reference in tests/test_deepseek4.py) gives the same bits. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <string.h>

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
