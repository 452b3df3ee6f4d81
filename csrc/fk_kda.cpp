/* KDA's decay gate, then the DeltaNet rows with a vector gate (fk_kda.h). */
#include <math.h>
#include <string.h>

#include "fk_delta.h"
#include "fk_kda.h"

static inline float kda_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* the decay factors exp(g) of rows [m, ld] in place, g by the layer's gate form */
static void fk_kda_gate(const fk_layer *L, float *f, int64_t m, int64_t ld, int nthreads) {
    const int64_t H = L->ssm_hv, dk = L->ssm_dk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m >= 4)
    for (int64_t t = 0; t < m; t++) {
        float *r = f + t * ld;
        for (int64_t h = 0; h < H; h++) {
            const float a = L->ssm_a[h];
            if (L->kda_gate == FK_KDA_GATE_LOWER_BOUND) {   /* torch's order: -(pre * a), sigmoid, * bound */
                const float lb = (float)L->kda_bound;
                for (int64_t c = h * dk; c < (h + 1) * dk; c++) {
                    const float z = -((r[c] + L->dt_bias[c]) * a), e = expf(-fabsf(z));
                    r[c] = expf((z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * lb);
                }
                continue;
            }
            for (int64_t c = h * dk; c < (h + 1) * dk; c++) r[c] = expf(kda_softplus(r[c] + L->dt_bias[c]) * a);
        }
    }
}

int fk_kda_layer(const fk_layer *L, float *in, int64_t m, int64_t ld, float *out, const int64_t *entry,
                 int nthreads, float eps) {
    int64_t ob, og, od, w;
    fk_kda_layout(L, &ob, &og, &od, &w);
    fk_kda_gate(L, in + od, m, ld, nthreads);
    fk_delta_args a;
    fk_delta_of_layer(L, entry, out, nthreads, eps, &a);
    a.qkv = in;
    a.z = in + og;
    a.b = in + ob;
    a.decay = in + od;
    a.out_sigmoid = 1;
    const int64_t keep = entry[3] < m ? entry[3] : m;
    return fk_delta_rows(&a, m, ld, L->ssm_hv * L->ssm_dk, (float *const *)(uintptr_t)entry[2], keep);
}
