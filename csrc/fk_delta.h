/* Gated DeltaNet (qwen35) rows after their input projections: causal conv (the window
 * shifts in place) -> SiLU -> q, k L2-norm -> gated delta rule on the per-head state (in
 * place) -> RMSNorm(norm_w) * SiLU(z). The math of fucina.models.delta_net (sequential)
 * and ggml's gated_delta_net op; f32 throughout. */
#pragma once
#include <stdint.h>

struct fk_delta_args {
    const float *qkv;      /* [conv_dim] = [q (hk*dk) | k (hk*dk) | v (hv*dv)], before the conv */
    const float *z;        /* [hv*dv] output gate */
    const float *b;        /* [hv] beta logits */
    const float *a;        /* [hv] decay logits */
    float *window;         /* [d_conv - 1, conv_dim] previous inputs, oldest first (updated) */
    const float *conv_w;   /* [conv_dim, d_conv]; tap d_conv - 1 is the current input */
    const float *dt_bias;  /* [hv] */
    const float *ssm_a;    /* [hv] (negative) */
    float *state;          /* [hv, dk, dv] (updated) */
    const float *norm_w;   /* [dv] */
    float *out;            /* [hv*dv] */
    int hk, hv, dk, dv, d_conv, nthreads;
    float eps;
    /* KDA (fk_kda.h; zero for qwen35): decay [hv*dk] per row at ld, the per-key-channel
     * decay factors exp(g) that replace the scalar gate from a (S[i][:] *= decay[h*dk + i]);
     * out_sigmoid 1: the output gate is sigmoid(z), not SiLU(z) */
    const float *decay;
    int out_sigmoid;
};

/* one token (the m = 1 case of fk_delta_rows, no snapshots) */
void fk_delta_step(const fk_delta_args *a);

/* m tokens of one stream in order. Row t of the inputs is at qkv/z/b/a + t * ld; row t of
 * the output at out + t * ldo. The last `keep` rows also leave a snapshot: slot j
 * (snaps[j], floats [window (d_conv - 1) * conv_dim | state hv * dk * dv]) holds the
 * window and state after row m - keep + j. Heads run in parallel, each over all m rows
 * with its state matrix hot; every row takes the same arithmetic whatever m is (so m rows
 * equal m single calls bit for bit). Returns 0, or -1 when out of memory. */
int fk_delta_rows(const fk_delta_args *a, int64_t m, int64_t ld, int64_t ldo, float *const *snaps, int64_t keep);

#include "fk_common.h"   /* fk_layer (fk_plan.h) */

/* A plan's DeltaNet layer (FK_MIXER_DELTA) over m rows of one stream: in [m, ld] the
 * ssm_in projection, out [m, hv * dv] before ssm_out; entry = the cache's (window, state,
 * snapshot slot table, keep). module.cpp checked the layer and the entry. */
int fk_delta_layer(const fk_layer *L, const float *in, int64_t m, int64_t ld, float *out, const int64_t *entry,
                   int nthreads, float eps);
/* a's fields from a DeltaNet or KDA layer and its cache entry (window, state; the rest zero:
 * the caller points qkv, z, b and a or decay into its rows) */
void fk_delta_of_layer(const fk_layer *L, const int64_t *entry, float *out, int nthreads, float eps, fk_delta_args *a);
