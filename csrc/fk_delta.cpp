/* The Gated DeltaNet rows (fk_delta.h). Plain loops over contiguous rows the compiler
 * vectorizes, cloned per x86-64 level (v3 and v4 contract to the same FMAs, and no loop
 * is reassociated, so both give the same bits; the baseline clone has no FMA); a head's
 * state row S[i][:] is read and written once per pass, and a head runs all its rows with
 * its 64 KB state matrix hot. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fk_delta.h"

#if defined(FK_X86) && defined(__GNUC__) && !defined(__clang__)
#define FK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FK_CLONES
#endif

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static thread_local float *dn_buf;
static thread_local size_t dn_cap;

static float *conv_scratch(size_t floats) {
    if (floats > dn_cap) {
        free(dn_buf);
        dn_buf = (float *)malloc(floats * sizeof(float));
        dn_cap = dn_buf ? floats : 0;
    }
    return dn_buf;
}

/* input row r of the conv: r < 0 reads the window (its row d_conv - 1 + r) */
static inline const float *conv_input(const fk_delta_args *a, int64_t ld, int64_t r, int cd) {
    return r < 0 ? a->window + (size_t)(a->d_conv - 1 + r) * cd : a->qkv + r * ld;
}

/* out[c0..c1) of row t: SiLU(sum of the d_conv taps), oldest tap first */
FK_CLONES static void conv_row(const fk_delta_args *a, int64_t ld, int64_t t, int cd, int c0, int c1, float *out) {
    const int dc = a->d_conv;
    for (int c = c0; c < c1; c++) out[c] = 0.0f;
    for (int j = 0; j < dc; j++) {
        const float *x = conv_input(a, ld, t - (dc - 1) + j, cd);
        for (int c = c0; c < c1; c++) out[c] += x[c] * a->conv_w[(size_t)c * dc + j];
    }
    for (int c = c0; c < c1; c++) out[c] = silu(out[c]);
}

/* one head over rows 0..m-1: decay, S^T k, the delta update, S^T q, then the gated norm */
FK_CLONES static void head_rows(const fk_delta_args *a, int h, int64_t m, int64_t ld, int64_t ldo, const float *cv,
                                int cd, float *const *snaps, int64_t keep) {
    const int hk = a->hk, dk = a->dk, dv = a->dv, kd = hk * dk;
    const size_t win = (size_t)(a->d_conv - 1) * cd;
    const float scale = 1.0f / sqrtf((float)dk);
    float *S = a->state + (size_t)h * dk * dv;
    float u[1024];
    for (int64_t t = 0; t < m; t++) {
        const float *row_cv = cv + t * cd;
        const float *q = row_cv + (h % hk) * dk, *k = row_cv + kd + (h % hk) * dk, *v = row_cv + 2 * kd + h * dv;
        const float *dvec = a->decay ? a->decay + t * ld + (size_t)h * dk : NULL;   /* KDA: one per key channel */
        const float decay = dvec ? 0.0f : expf(softplus(a->a[t * ld + h] + a->dt_bias[h]) * a->ssm_a[h]);
        const float beta = 1.0f / (1.0f + expf(-a->b[t * ld + h]));
        float *o = a->out + t * ldo + (size_t)h * dv;
        for (int j = 0; j < dv; j++) u[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *r = S + (size_t)i * dv;
            const float di = dvec ? dvec[i] : decay;
            for (int j = 0; j < dv; j++) {
                r[j] *= di;
                u[j] += r[j] * k[i];
            }
        }
        for (int j = 0; j < dv; j++) {
            u[j] = (v[j] - u[j]) * beta;
            o[j] = 0.0f;
        }
        float *snap = t >= m - keep ? snaps[t - (m - keep)] + win + (size_t)h * dk * dv : NULL;
        for (int i = 0; i < dk; i++) {
            float *r = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) {
                r[j] += k[i] * u[j];
                o[j] += r[j] * q[i];
            }
            if (snap) memcpy(snap + (size_t)i * dv, r, sizeof(float) * dv);
        }
        float ss = 0.0f;
        for (int j = 0; j < dv; j++) {
            o[j] *= scale;
            ss += o[j] * o[j];
        }
        const float rn = 1.0f / sqrtf(ss / dv + a->eps);
        const float *z = a->z + t * ld + (size_t)h * dv;
        if (a->out_sigmoid)
            for (int j = 0; j < dv; j++) o[j] = o[j] * rn * a->norm_w[j] * (1.0f / (1.0f + expf(-z[j])));
        else
            for (int j = 0; j < dv; j++) o[j] = o[j] * rn * a->norm_w[j] * silu(z[j]);
    }
}

int fk_delta_rows(const fk_delta_args *a, int64_t m, int64_t ld, int64_t ldo, float *const *snaps, int64_t keep) {
    const int hk = a->hk, hv = a->hv, dk = a->dk, dc = a->d_conv;
    const int kd = hk * dk, cd = 2 * kd + hv * a->dv;
    float *cv = conv_scratch((size_t)m * cd);
    if (!cv) return -1;
    /* conv + SiLU in tasks of (row, 512 channels); the window is only read here */
    const int per = 512, nblk = (cd + per - 1) / per;
    const int64_t tasks = m * nblk;
#pragma omp parallel for num_threads(a->nthreads) schedule(static) if (tasks > 4)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t t = task / nblk;
        const int c0 = (int)(task % nblk) * per, c1 = c0 + per < cd ? c0 + per : cd;
        conv_row(a, ld, t, cd, c0, c1, cv + t * cd);
    }
    /* L2-normalize q and k per key head: x / sqrt(sum x^2 + eps) */
#pragma omp parallel for num_threads(a->nthreads) schedule(static) if (m >= 4)
    for (int64_t t = 0; t < m; t++)
        for (int h = 0; h < 2 * hk; h++) {
            float *x = cv + t * cd + (size_t)h * dk;
            float ss = 0.0f;
            for (int i = 0; i < dk; i++) ss += x[i] * x[i];
            const float r = 1.0f / sqrtf(ss + a->eps);
            for (int i = 0; i < dk; i++) x[i] *= r;
        }
    /* the snapshots' windows (inputs m - keep + j - d_conv + 2 .. m - keep + j), then the window */
    const size_t win = (size_t)(dc - 1) * cd;
    for (int64_t j = 0; j < keep; j++) {
        const int64_t r = m - keep + j;
        for (int w = 0; w < dc - 1; w++) memcpy(snaps[j] + (size_t)w * cd, conv_input(a, ld, r - (dc - 2) + w, cd), sizeof(float) * cd);
    }
    if (m >= dc - 1) {
        for (int w = 0; w < dc - 1; w++) memcpy(a->window + (size_t)w * cd, a->qkv + (m - (dc - 1) + w) * ld, sizeof(float) * cd);
    } else {   /* keep the newest d_conv - 1 - m old rows, then the m new ones */
        memmove(a->window, a->window + (size_t)m * cd, sizeof(float) * (win - (size_t)m * cd));
        for (int64_t t = 0; t < m; t++) memcpy(a->window + (size_t)(dc - 1 - m + t) * cd, a->qkv + t * ld, sizeof(float) * cd);
    }
#pragma omp parallel for num_threads(a->nthreads) schedule(static)
    for (int h = 0; h < hv; h++) head_rows(a, h, m, ld, ldo, cv, cd, snaps, keep);
    return 0;
}

void fk_delta_step(const fk_delta_args *a) { fk_delta_rows(a, 1, 0, 0, NULL, 0); }

void fk_delta_of_layer(const fk_layer *L, const int64_t *entry, float *out, int nthreads, float eps, fk_delta_args *a) {
    memset(a, 0, sizeof(*a));
    a->window = (float *)(uintptr_t)entry[0];
    a->state = (float *)(uintptr_t)entry[1];
    a->conv_w = L->conv_w;
    a->dt_bias = L->dt_bias;
    a->ssm_a = L->ssm_a;
    a->norm_w = L->ssm_norm;
    a->out = out;
    a->hk = (int)L->ssm_hk;
    a->hv = (int)L->ssm_hv;
    a->dk = (int)L->ssm_dk;
    a->dv = (int)L->ssm_dv;
    a->d_conv = (int)L->d_conv;
    a->nthreads = nthreads;
    a->eps = eps;
}

int fk_delta_layer(const fk_layer *L, const float *in, int64_t m, int64_t ld, float *out, const int64_t *entry,
                   int nthreads, float eps) {
    const int64_t cd = 2 * L->ssm_hk * L->ssm_dk + L->ssm_hv * L->ssm_dv, dz = L->ssm_hv * L->ssm_dv;
    fk_delta_args a;
    fk_delta_of_layer(L, entry, out, nthreads, eps, &a);
    a.qkv = in;
    a.z = in + cd;
    a.b = in + cd + dz;
    a.a = in + cd + dz + L->ssm_hv;
    const int64_t keep = entry[3] < m ? entry[3] : m;
    return fk_delta_rows(&a, m, ld, dz, (float *const *)(uintptr_t)entry[2], keep);
}
