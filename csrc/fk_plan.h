/* The native decoder plan's schema: the one list of its fields, for C and for Python.
 *
 * C gets the structs (fk_plan, fk_layer) and the descriptor parser from these lists;
 * Python asks the module for them (plan_schema()) and fills a descriptor by name
 * (kernels.DecoderPlan.build), so neither side holds a positional offset. Kinds:
 *   I  an int64 setting          F  a double, as its int64 bit pattern
 *   V  an f32 vector address     W  a weight: qtype, address, row_bytes, n, k, lora_a,
 *                                   lora_b, lora_r (8 slots)
 * A V or W left 0 is absent. Adding a field = one line here (+ its use in the step). */
#ifndef FK_PLAN_H
#define FK_PLAN_H

#include <stdint.h>

/* A weight as the layer step sees it: GGML blocks [n, row_bytes], y = x @ W^T, and an
 * optional unmerged LoRA applied after it in f32, y += B (A x): lora_a = A f32 [lora_r, k],
 * lora_b = B^T f32 [lora_r, n] (rows: the update is a sum of scaled rows, no reductions;
 * the adapters' scales folded in); lora_r 0 = none. */
#define FK_LORA_MAX_R 1024
typedef struct {
    int qtype;
    const uint8_t *w;
    int64_t rb, n, k;
    const float *lora_a, *lora_b;
    int64_t lora_r;
} fk_lin;

#define FK_PLAN_FIELDS(X) \
    X(I, n_layer) X(I, n_embd) X(I, n_ff) X(I, n_rot) X(I, neox) X(I, act) X(F, eps) X(F, scale) \
    X(I, n_ple)
/* n_ple (gemma4's per-layer embeddings): each row of x carries n_layer * n_ple trailing
 * columns after its n_embd, layer l's input at n_embd + l * n_ple (0: none) */

/* one layer: a mixer (attention today) and an ffn (dense today) with their norms */
#define FK_LAYER_FIELDS(X)                                                                    \
    X(I, mixer) X(I, ffn) X(I, n_head) X(I, n_kv) X(I, head_dim) X(I, window) X(I, rope)      \
    X(V, attn_norm) X(V, q_norm) X(V, k_norm) X(V, post_attn_norm) X(V, ffn_norm)             \
    X(V, post_ffn_norm) X(V, qkv_bias)                                                        \
    X(W, wqkv) X(W, wq) X(W, wk) X(W, wv) X(W, wo) X(W, gate_up) X(W, gate) X(W, up) X(W, down)     \
    X(I, layer_rot) X(V, v_norm) X(F, out_scale)                                                  \
    X(I, bidir)                                                                                   \
    FK_MOE_FIELDS(X)                                                                              \
    FK_DELTA_FIELDS(X)                                                                            \
    FK_GEMMA4_FIELDS(X)                                                                           \
    FK_GPTOSS_FIELDS(X)                                                                           \
    FK_MOE_SHARED_FIELDS(X)                                                                       \
    FK_MOE_SIGMOID_FIELDS(X)                                                                      \
    FK_MLA_FIELDS(X)                                                                              \
    FK_KDA_FIELDS(X)                                                                              \
    FK_K3_FIELDS(X)                                                                               \
    FK_DSV4_FIELDS(X)                                                                             \
    X(I, res_hook) X(I, res_hook_ctx)
/* layer_rot, v_norm, out_scale (gemma4): own rotary width (0: n_rot), V norm, x *= s;
 * bidir (a diffusion canvas): every row of a call reads keys up to the call's last position */

/* a MoE ffn (moe_impl.inc): router gate_inp [n_expert, n_embd]; expert stacks as one
 * weight each, expert e's rows at e * rows-per-expert: gate_exps/up_exps [n_expert * n_ff_exp,
 * n_embd], down_exps [n_expert * n_embd, n_ff_exp] (GGML rows, or row groups where every expert
 * starts on a group: module.cpp stack_ok); moe_norm renormalises the chosen weights,
 * moe_scale (0 or 1: none) scales them. The expert store (models/expert_store.py): moe_hook
 * (0: none) is an fk_moe_hook the layer calls with moe_hook_ctx and its chosen experts before
 * it reads them; then expert e's rows of gate/up/down are at moe_table (int64 [3, n_expert]),
 * not in the stacks (an entry 0: not resident, the step fails) */
#define FK_MOE_FIELDS(X)                                                                      \
    X(I, n_expert) X(I, n_expert_used) X(I, n_ff_exp) X(I, moe_norm) X(F, moe_scale)          \
    X(W, gate_inp) X(W, gate_exps) X(W, up_exps) X(W, down_exps) X(I, moe_hook) X(I, moe_hook_ctx) \
    X(I, moe_table)
typedef int (*fk_moe_hook)(int64_t ctx, const int32_t *experts, int64_t n);   /* 0: go on */

/* a MoE ffn's shared expert and its routed part's own norms (moe_shared_impl.inc; all
 * optional): the shared expert is the layer's dense ffn fields (gate_up or gate/up, down,
 * layer_ff) over the ffn_norm rows h, its output RMS-normed by shexp_norm and scaled per
 * row by sigmoid(h . shexp_gate) (qwen35moe), added to the routed mix after moe_out_norm;
 * moe_in_norm: the experts read rms_norm(x, moe_in_norm) instead of h, router_norm: the
 * router reads rms_norm(x, router_norm) instead of the experts' rows; exp_scale [n_expert]
 * multiplies each chosen expert's weight (gemma4's MoE layers); exps_stride (0: n_ff_exp):
 * rows from one expert's gate (up) rows to the next's, gate_exps/up_exps then spanning
 * (n_expert - 1) * exps_stride + n_ff_exp rows (gemma4's fused gate_up stack: 2 n_ff_exp,
 * up_exps the stack from row n_ff_exp; not with the expert store's table) */
#define FK_MOE_SHARED_FIELDS(X) \
    X(V, shexp_gate) X(V, shexp_norm) X(V, moe_in_norm) X(V, router_norm) X(V, moe_out_norm) X(V, exp_scale) \
    X(I, exps_stride)

/* sigmoid routing and a selection bias (glm4moe; moe_impl.inc): moe_sigmoid 1: each router
 * logit's sigmoid is its expert's weight (0: softmax); exp_probs_b [n_expert] (0: none): the
 * top k of weight + bias choose, the unbiased weights weigh; then moe_norm and moe_scale
 * (llama.cpp's build_moe_ffn with exp_probs_b) */
#define FK_MOE_SIGMOID_FIELDS(X) X(I, moe_sigmoid) X(V, exp_probs_b)

/* an MLA mixer (deepseek2; mla_impl.inc): n_head heads of mla_nope + mla_rope query values
 * (wq, or q_a -> q_a_norm -> q_b), kv_a [mla_rank + mla_rope, n_embd] (the latent, normed by
 * kv_a_norm, and the shared rope key), k_b [n_head * mla_rank, mla_nope] and v_b [n_head *
 * mla_v, mla_rank] each head's rows stacked, wo [n_embd, n_head * mla_v]; mla_rope is the
 * rotary width. Its cache entry: latent rows (mla_rank f16) as k, rope key rows as v. */
#define FK_MLA_FIELDS(X)                                                                      \
    X(I, mla_rank) X(I, mla_nope) X(I, mla_rope) X(I, mla_v) X(W, q_a) X(V, q_a_norm) X(W, q_b) \
    X(W, kv_a) X(V, kv_a_norm) X(W, k_b) X(W, v_b)

/* a Gated DeltaNet mixer (qwen35, fk_delta.h): hk key / hv value heads of dk / dv, a causal
 * conv of d_conv taps (conv_w [conv_dim, d_conv], conv_dim = 2 hk dk + hv dv); the input
 * projection ssm_in = [qkv (conv_dim) | z (hv dv) | beta (hv) | alpha (hv)] fused or as its
 * four parts, ssm_out [n_embd, hv dv]. Its cache entry: window, state, snapshot slots, keep.
 * q_gate (an attention mixer, qwen35): attn_q rows are per head [q | gate], and the
 * attention output is multiplied by sigmoid(gate) before wo. */
#define FK_DELTA_FIELDS(X)                                                                    \
    X(I, q_gate) X(I, ssm_hk) X(I, ssm_hv) X(I, ssm_dk) X(I, ssm_dv) X(I, d_conv)             \
    X(V, conv_w) X(V, dt_bias) X(V, ssm_a) X(V, ssm_norm)                                     \
    X(W, ssm_in) X(W, ssm_qkv) X(W, ssm_z) X(W, ssm_beta) X(W, ssm_alpha) X(W, ssm_out)

/* a KDA mixer (kimi-linear, fk_kda.h): the DeltaNet fields with hk = hv = H heads of dk = dv,
 * dt_bias [H dk] (one per key channel), ssm_a [H], ssm_in = [qkv (3 H dk) | f_a (rf) | g_a (rg) |
 * beta (H)] fused or as ssm_qkv, ssm_f_a, ssm_g_a, ssm_beta; the decay input ssm_f_b [H dk, rf]
 * and the output gate ssm_g_b [H dk, rg] read f_a's and g_a's rows; kda_gate the form of the
 * log-decay (fk_kda.h FK_KDA_GATE_*). Its cache entry is a DeltaNet layer's. */
#define FK_KDA_FIELDS(X) X(I, kda_gate) X(W, ssm_f_a) X(W, ssm_f_b) X(W, ssm_g_a) X(W, ssm_g_b)

/* kimi-k3's pieces (0: absent): kda_bound (kda_gate FK_KDA_GATE_LOWER_BOUND) the decay's lower
 * bound; mla_gate [n_head * mla_v, n_embd]: the MLA output times sigmoid(h mla_gate) before wo;
 * a latent MoE: the routed experts read routed_down h [latent] (their stacks latent wide),
 * their mix is RMS-normed by routed_norm (optional) and mapped back by routed_up [n_embd,
 * latent]; situ_beta / situ_lbeta the SiTU activation's (act FK_ACT_SITU); the residual bank
 * (step_impl.inc): with attn_res_score / ffn_res_score the rows entering the mixer and the
 * ffn are the softmax-weighted mix of the banked raw layer inputs and the stream, res_bank 1
 * banks this layer's input and restarts the stream from its mixer's output, out_res_score
 * (the last layer) mixes the stream once more after its ffn. */
#define FK_RES_MAX 256   /* the most banked layers a plan may hold */
#define FK_K3_FIELDS(X)                                                                       \
    X(F, kda_bound) X(W, mla_gate) X(W, routed_down) X(W, routed_up) X(V, routed_norm)        \
    X(F, situ_beta) X(F, situ_lbeta) X(I, res_bank) X(V, attn_res_score) X(V, ffn_res_score)  \
    X(V, out_res_score)

/* deepseek4's routed ffn (moe_impl.inc; its layers are FK_MIXER_NONE: the hyper-connection
 * mixers around the ffn stay in Python, the plan serves `ffn` calls): moe_sqrt_softplus 1:
 * each expert's weight is sqrt(softplus(logit)) (selection bias, renormalisation by the sum's
 * quotient and scale as llama.cpp's build_moe_ffn); tid2eid (0: none) an int32 table
 * [tid_vocab, n_expert_used] choosing a hash-routed layer's experts by the row's token id
 * (the step's ids); clamp_exp / clamp_shexp (act FK_ACT_SWIGLU_CLAMP) the routed and the
 * shared experts' SwiGLU limits (<= 1e-6: none) */
#define FK_DSV4_FIELDS(X) \
    X(I, moe_sqrt_softplus) X(I, tid2eid) X(I, tid_vocab) X(F, clamp_exp) X(F, clamp_shexp)

/* gemma4's E-model layers: kv_from = 1 + the earlier layer whose K/V rows this layer reads
 * (shared KV: only wq, nothing written; 0: its own); layer_ff its FFN width (0: n_ff, the
 * widest); with n_ple, x += ple_norm((act(x ple_gate) * input) ple_proj) after the FFN */
#define FK_GEMMA4_FIELDS(X) \
    X(I, kv_from) X(I, layer_ff) X(W, ple_gate) X(W, ple_proj) X(V, ple_norm)

/* gpt-oss's attention and MoE pieces (0: absent): attn_sinks [n_head] a learned logit per head
 * joining each row's softmax (probability mass, no value); wo_bias [n_embd] added after wo;
 * gate_inp_b [n_expert] added to the router logits; moe_weight_softmax 1: the top k of the
 * (biased) logits choose and their softmax among themselves weighs (llama.cpp's SOFTMAX_WEIGHT
 * gating; 0: softmax over every expert, then top k); gate_exps_b / up_exps_b [n_expert *
 * n_ff_exp] and down_exps_b [n_expert * n_embd]: expert e's biases at e * their width */
#define FK_GPTOSS_FIELDS(X)                                                                   \
    X(V, attn_sinks) X(V, wo_bias) X(V, gate_inp_b) X(I, moe_weight_softmax)                  \
    X(V, gate_exps_b) X(V, up_exps_b) X(V, down_exps_b)

/* res_hook (0: none): an fk_res_hook the step calls with res_hook_ctx on the residual rows
 * entering the layer, before its norm (a residual hook run inside the step: Engram's memory
 * layer, fucina.kernels._engram). pos0 is -1 in batch mode; nonzero refuses the call and
 * the step stops (status -2). */
typedef int (*fk_res_hook)(int64_t ctx, float *x, int64_t m, int64_t ldx, int64_t pos0, int nthreads);

/* FK_MIXER_NONE: a layer with its ffn only; a plan holding one serves `ffn` calls, never a step */
enum { FK_MIXER_ATTENTION = 0, FK_MIXER_DELTA = 1, FK_MIXER_MLA = 2, FK_MIXER_KDA = 3, FK_MIXER_NONE = 4 };
enum { FK_FFN_DENSE = 0, FK_FFN_MOE = 1 };
/* swiglu_oai (gpt-oss): min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1);
 * situ (kimi-k3): beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb) (lb <= 0: u), per layer's betas;
 * swiglu_clamp (deepseek4): silu(min(g, l)) clamp(u, -l, l), l the layer's clamp_exp or clamp_shexp */
enum { FK_ACT_SILU = 0, FK_ACT_GELU_TANH = 1, FK_ACT_SWIGLU_OAI = 2, FK_ACT_SITU = 3, FK_ACT_SWIGLU_CLAMP = 4 };

#define FK_FIELD_I(name) int64_t name;
#define FK_FIELD_F(name) double name;
#define FK_FIELD_V(name) const float *name;
#define FK_FIELD_W(name) fk_lin name;
#define FK_DECLARE(kind, name) FK_FIELD_##kind(name)

/* One decoder layer (step_impl.inc):
 *   h = norm(x); q,k,v = h W_qkv (+ bias); q/k head norms; RoPE; K/V -> f16 cache;
 *   attention; x += post_norm(att W_o); h = norm(x); x += post_norm(act(h W_gate) * (h W_up) W_down)
 * qkv is one fused weight [q|k|v] or three; gate/up one fused [gate|up] or two. */
typedef struct {
    FK_LAYER_FIELDS(FK_DECLARE)
} fk_layer;

typedef struct {
    FK_PLAN_FIELDS(FK_DECLARE)
    int64_t max_q, max_qkv;   /* widest layer: the step's scratch */
    int64_t ffn_only;         /* a layer is FK_MIXER_NONE: `ffn` calls only */
    fk_layer *layers;
} fk_plan;

/* a cache's pointer table: per layer k, v (f16 [rows, n_kv, head_dim]), base, rows;
 * position p lives in row p - base (base > 0 only in a sliding-window memory) */
#define FK_KV_ENTRY 4

/* One call: run every layer of `plan` over x[m, n_embd] (updated in place) at positions
 * pos0.., writing K/V rows into the cache whose table is kv. cis[t]: RoPE table t as
 * (cos, sin) pairs [cis_len[t], n_rot / 2, 2]. */
typedef struct {
    const fk_plan *plan;
    float *x;
    int64_t m, pos0;
    const int64_t *kv;
    const float *cis[2];
    int64_t cis_len[2];
    int nthreads, prefill;
    void (*matmul)(const fk_matmul_args *a);
    /* batch mode (row_pos != NULL): row i is one token of its own stream, at position
     * row_pos[i] of the cache whose table is row_kv + i * n_layer * FK_KV_ENTRY */
    const int64_t *row_pos;
    const int64_t *row_kv;
    int status;  /* out: 0 ok, -1 out of memory, -2 a residual hook refused */
    /* an `ffn` call (step_impl.inc fk_ffn_impl): layer `layer`'s ffn over the m rows at x,
     * written to out [m, n_embd]; ids (NULL: none) the rows' token ids, in [0, tid_vocab) */
    const int64_t *ids;
    int64_t layer;
    float *out;
} fk_step_args;

#endif
