/* One decode token of a Gated DeltaNet layer (qwen35), after its input projections:
 * causal conv (the window shifts in place) -> SiLU -> q, k L2-norm -> gated delta rule on
 * the per-head state (in place) -> RMSNorm(norm_w) * SiLU(z). The math of
 * fucina.models.delta_net (sequential) and ggml's gated_delta_net op; f32 throughout. */
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
};

void fk_delta_step(const fk_delta_args *a);
