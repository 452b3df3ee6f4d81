/* The Gated DeltaNet decode step (fk_delta.h): one token, heads in parallel. Plain loops
 * over contiguous rows the compiler vectorizes; the state row S[i][:] is read and
 * written once per pass. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fk_delta.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void fk_delta_step(const fk_delta_args *a) {
    const int hk = a->hk, hv = a->hv, dk = a->dk, dv = a->dv, dc = a->d_conv;
    const int kd = hk * dk, conv_dim = 2 * kd + hv * dv;
    float *conv = (float *)malloc(sizeof(float) * (size_t)conv_dim);
    if (!conv) return;
    /* conv + SiLU, then shift the window by one input */
#pragma omp parallel for num_threads(a->nthreads) schedule(static) if (conv_dim >= 4096)
    for (int c = 0; c < conv_dim; c++) {
        const float *w = a->conv_w + (size_t)c * dc;
        float s = 0.0f;
        for (int t = 0; t < dc - 1; t++) s += a->window[(size_t)t * conv_dim + c] * w[t];
        s += a->qkv[c] * w[dc - 1];
        conv[c] = silu(s);
        for (int t = 0; t + 1 < dc - 1; t++) a->window[(size_t)t * conv_dim + c] = a->window[(size_t)(t + 1) * conv_dim + c];
        a->window[(size_t)(dc - 2) * conv_dim + c] = a->qkv[c];
    }
    /* L2-normalize q and k per key head: x / sqrt(sum x^2 + eps) */
    for (int h = 0; h < 2 * hk; h++) {
        float *x = conv + (size_t)h * dk;
        float ss = 0.0f;
        for (int i = 0; i < dk; i++) ss += x[i] * x[i];
        const float r = 1.0f / sqrtf(ss + a->eps);
        for (int i = 0; i < dk; i++) x[i] *= r;
    }
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for num_threads(a->nthreads) schedule(static)
    for (int h = 0; h < hv; h++) {
        const float *q = conv + (size_t)(h % hk) * dk, *k = conv + kd + (size_t)(h % hk) * dk;
        const float *v = conv + 2 * kd + (size_t)h * dv;
        float *S = a->state + (size_t)h * dk * dv, *o = a->out + (size_t)h * dv;
        const float decay = expf(softplus(a->a[h] + a->dt_bias[h]) * a->ssm_a[h]);
        const float beta = 1.0f / (1.0f + expf(-a->b[h]));
        float u[1024];
        for (int j = 0; j < dv; j++) u[j] = 0.0f;
        for (int i = 0; i < dk; i++) {               /* decay, and S^T k */
            float *row = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) { row[j] *= decay; u[j] += row[j] * k[i]; }
        }
        for (int j = 0; j < dv; j++) { u[j] = (v[j] - u[j]) * beta; o[j] = 0.0f; }
        for (int i = 0; i < dk; i++) {               /* S += k u^T, and S^T q */
            float *row = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) { row[j] += k[i] * u[j]; o[j] += row[j] * q[i]; }
        }
        float ss = 0.0f;                              /* RMSNorm(o) * norm_w * SiLU(z) */
        for (int j = 0; j < dv; j++) { o[j] *= scale; ss += o[j] * o[j]; }
        const float r = 1.0f / sqrtf(ss / dv + a->eps);
        const float *z = a->z + (size_t)h * dv;
        for (int j = 0; j < dv; j++) o[j] = o[j] * r * a->norm_w[j] * silu(z[j]);
    }
    free(conv);
}
