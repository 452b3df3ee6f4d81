/* Kimi Delta Attention (KDA, kimi-linear) as a mixer of the layer step (FK_MIXER_KDA, fields in
 * fk_plan.h FK_KDA_FIELDS): the gated delta rule with one decay per key channel, the math of
 * fucina.models.kimi_linear (Model._kda) and models/kda.py (sequential).
 *
 * A KDA row after its projections (generic/kda_impl.inc writes it), ld floats apart:
 *   [q|k|v (3 H dk, before the conv) | f_a x (rf) | g_a x (rg) | beta logits (H) |
 *    output gate g_b(g_a x) (H dk) | decay input f_b(f_a x) (H dk)]
 * fk_kda_layer turns the last part into the decay factors exp(g) in place (the gate form
 * below) and runs fk_delta_rows (fk_delta.h) with that vector gate and a sigmoid output gate:
 * the conv, SiLU, q/k L2 norms, the recurrence heads in parallel, the snapshots and the
 * per-head RMSNorm(ssm_norm) * sigmoid(gate) are the DeltaNet kernel's. */
#pragma once
#include <stdint.h>

#include "fk_common.h"   /* fk_layer (fk_plan.h) */

/* how a KDA layer's log-decay g [H dk] comes from its decay input f (fk_plan.h kda_gate):
 *   FK_KDA_GATE_SOFTPLUS (kimi-linear): g = ssm_a[h] * softplus(f + dt_bias), ssm_a = -exp(A_log).
 * A second form (e.g. g = bound * sigmoid(exp(A_log) (f + dt_bias))) is one more enum value,
 * its case in fk_kda_gate (fk_kda.cpp) and its check in module.cpp's kda_ok (a scalar such
 * as the bound: one more F field in FK_KDA_FIELDS). A full-rank output gate in place of the
 * g_a/g_b pair is a layout where ssm_g_a is [H dk, n_embd] and writes the gate part directly
 * (fk_kda_layout and kda_impl.inc skip g_b when it is absent). */
/*   FK_KDA_GATE_LOWER_BOUND (kimi-k3): g = kda_bound * sigmoid(-ssm_a[h] (f + dt_bias)), kda_bound < 0.
 * kimi-k3's full-rank output gate: ssm_g_b absent (rank 0), ssm_g_a [H dk, n_embd] writes the
 * gate part itself, the fused projection then [qkv | f_a x | beta | gate] (the same row). */
enum { FK_KDA_GATE_SOFTPLUS = 0, FK_KDA_GATE_LOWER_BOUND = 1 };

/* the row layout's offsets (floats into a row) and width for layer L */
static inline void fk_kda_layout(const fk_layer *L, int64_t *beta, int64_t *gate, int64_t *decay, int64_t *width) {
    const int64_t di = L->ssm_hv * L->ssm_dk;
    *beta = 3 * di + L->ssm_f_b.k + L->ssm_g_b.k;
    *gate = *beta + L->ssm_hv;
    *decay = *gate + di;
    *width = *decay + di;
}

/* m rows of one stream: in [m, ld] as above (its decay part overwritten), out [m, H dk]
 * before ssm_out; entry = the cache's (window, state, snapshot slot table, keep), as a
 * DeltaNet layer's (module.cpp checked the layer and the entry). 0, or -1 out of memory. */
int fk_kda_layer(const fk_layer *L, float *in, int64_t m, int64_t ld, float *out, const int64_t *entry,
                 int nthreads, float eps);
