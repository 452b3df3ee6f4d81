/* fucina native kernels: declarations shared by the module and the per-ISA units.
 *
 * Every quantized format is handled through one intermediate form, decoded a few
 * weight rows at a time into a small per-thread buffer that stays in L1/L2:
 *
 *   w[i] = s[g] * u[i] + o[g]        u: uint8, s/o: float, g: group of 16 or 32
 *
 * and activations are quantized per 32-element block to int8 (x[i] ~ d * q[i]).
 * Then  sum_i w[i] x[i] = sum_lanes s*d*dot4(u, q)  +  sum_g16 o * (d * sum q).
 * The integer part is one u8 x s8 dot (AVX-512 VNNI vpdpbusd: 64 MACs per op);
 * the offset part is a short float dot over 16-element group sums.
 *
 * Layout of a decoded weight row / quantized activation row, kp = k rounded up to 64:
 *   uint8/int8 q[kp] | float ls[kp/4] (scale of each 4-element lane) | float off[kp/16]
 * (for activations `off` holds d * sum(q) over each 16 elements).
 */
#ifndef FK_COMMON_H
#define FK_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>   /* sysconf: the L2 size */
#include <omp.h>

/* GGML type ids (ggml.h) of the formats with a native route. */
enum {
    FK_F32 = 0, FK_F16 = 1, FK_Q4_0 = 2, FK_Q4_1 = 3, FK_Q5_0 = 6, FK_Q5_1 = 7,
    FK_Q8_0 = 8, FK_Q2_K = 10, FK_Q3_K = 11, FK_Q4_K = 12, FK_Q5_K = 13, FK_Q6_K = 14,
    FK_IQ2_XXS = 16, FK_IQ2_XS = 17, FK_IQ3_XXS = 18, FK_IQ1_S = 19, FK_IQ4_NL = 20, FK_IQ3_S = 21, FK_IQ2_S = 22,
    FK_IQ4_XS = 23, FK_IQ1_M = 29, FK_BF16 = 30,
    FK_TQ1_0 = 34, FK_TQ2_0 = 35,
    FK_MXFP4 = 39,
};
/* The IQ1-IQ3 codebooks (generic/iq_impl.inc): ggml's grids and sign table, copied once at
 * import from the gguf package (fucina.kernels, set_iq_tables), which checks every entry's
 * range; until then those formats have no native route (fk_iq.ready). */
typedef struct {
    uint8_t iq2xxs[256][8];   /* 8, 25 or 43 */
    uint8_t iq3xxs[256][4];   /* 4 .. 62, even; halved when set (2 .. 31) */
    uint8_t iq3s[512][4];     /* 1 .. 15, odd */
    int8_t iq1s[2048][8];     /* -1, 0 or 1 */
    uint8_t ksigns[128];      /* 7 sign bits and their parity bit */
    uint8_t iq2xs[512][8];    /* 8, 25 or 43 */
    uint8_t iq2s[1024][8];    /* 8, 25 or 43 */
    /* derived when set: each byte 0xFF where bit j of the index is set (a sign mask) */
    uint64_t sign_mask[256];
    /* derived: an IQ2_XS word (9 bits of grid index, 7 of signs) -> its 8 signed values
     * (512 KB: one gather a block where the sign bytes took a lookup each) */
    int8_t iq2xs_v[65536][8];
    /* derived: an IQ2_XXS group's grid byte and 7 sign bits (byte | signs << 8) -> its 8
     * signed values (256 KB, as iq2xs_v) */
    int8_t iq2xxs_v[32768][8];
    /* derived: an IQ1 group's 11-bit grid index and its delta's sign (bit 11: minus) -> its 8
     * codes 16 + 8 g +- 1 (32 KB: the gather gives the codes, where a blend added the delta) */
    uint8_t iq1s_u[4096][8];
    int ready;
} fk_iq_tables;
extern fk_iq_tables fk_iq;
/* bytes of a 256-value superblock of those formats (module.cpp's row checks, iq_impl.inc) */
static inline int fk_iq_bytes(int qt) {
    switch (qt) {
    case FK_IQ2_XXS: return 66;
    case FK_IQ2_XS: return 74;
    case FK_IQ2_S: return 82;
    case FK_IQ3_XXS: return 98;
    case FK_IQ3_S: return 110;
    case FK_IQ1_S: return 50;
    case FK_IQ1_M: return 56;
    }
    return 0;
}

/* PTQTP (generic/ptqtp_impl.inc): FK_PTQTP_BASE + K (K = 1..3) names K stacked TQ2_0
 * trit-planes of one matrix; not a GGML type, never read from a file's type field */
enum { FK_PTQTP_BASE = 1000 };
/* a scale-tied K=2 PTQTP matrix (plane scales 3s and s) folded to one plane of 9-level codes
 * c = 3 t0 + t1 (generic/ternary_impl.inc): its own format, not a GGML type */
enum { FK_PTQTP_FOLD = FK_PTQTP_BASE + 16 };
/* TQ2_0 rows repacked in groups of 8 for the AVX2 decode GEMV (generic/tq2x8_impl.inc):
 * the same bytes as TQ2_0 per 8 rows, row_bytes TQ2_0's; not a GGML type */
enum { FK_TQ2_X8 = FK_PTQTP_BASE + 32 };
/* Q4_K rows repacked in groups of 16 for the AVX-512 and AVX2 decode GEMVs (generic/q4kx16_impl.inc):
 * the same bytes as Q4_K per 16 rows, row_bytes Q4_K's; not a GGML type */
enum { FK_Q4K_X16 = FK_PTQTP_BASE + 33 };
/* Q6_K rows repacked in groups of 16 likewise (generic/q6kx16_impl.inc) */
enum { FK_Q6K_X16 = FK_PTQTP_BASE + 34 };
/* Q5_0 rows repacked in groups of 16, field by field per two blocks (generic/x16n_impl.inc) */
enum { FK_Q50_X16 = FK_PTQTP_BASE + 35 };
/* Q8_0 rows likewise, the quants stored as q + 128 (generic/q80x16_impl.inc) */
enum { FK_Q80_X16 = FK_PTQTP_BASE + 36 };
/* Q4_0, Q4_1 and Q5_1 rows likewise, as Q5_0's (generic/x16n_impl.inc) */
enum { FK_Q40_X16 = FK_PTQTP_BASE + 37, FK_Q41_X16 = FK_PTQTP_BASE + 38, FK_Q51_X16 = FK_PTQTP_BASE + 39 };
/* Q5_K rows repacked in groups of 16 as Q4_K's, the qh dwords columns too (generic/q4kx16_impl.inc) */
enum { FK_Q5K_X16 = FK_PTQTP_BASE + 40 };
/* IQ4_XS rows likewise, its 34 dwords as columns (generic/iq4xsx16_impl.inc) */
enum { FK_IQ4XS_X16 = FK_PTQTP_BASE + 41 };
/* Q2_K rows likewise, its 21 dwords as columns (generic/k23x16_impl.inc) */
enum { FK_Q2K_X16 = FK_PTQTP_BASE + 42 };
/* Q3_K rows likewise, its 27 dwords as columns, then the 16 d (generic/k23x16_impl.inc) */
enum { FK_Q3K_X16 = FK_PTQTP_BASE + 43 };
/* MXFP4 rows likewise in two-block units, the 16 rows' E8M0 byte pairs first (generic/x16n_impl.inc) */
enum { FK_MXFP4_X16 = FK_PTQTP_BASE + 44 };
/* IQ4_NL rows likewise, Q4_0's places (generic/x16n_impl.inc) */
enum { FK_IQ4NL_X16 = FK_PTQTP_BASE + 45 };
/* a layout of superblocks in 16-row groups, their dwords as columns (Q2_K .. Q6_K, IQ4_XS) */
static inline bool fk_x16s(int qtype) {
    return qtype == FK_Q4K_X16 || qtype == FK_Q5K_X16 || qtype == FK_Q6K_X16 || qtype == FK_IQ4XS_X16 || qtype == FK_Q2K_X16 ||
           qtype == FK_Q3K_X16;
}
/* a layout of two-block units in 16-row groups (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL) */
static inline bool fk_x16u(int qtype) {
    return qtype == FK_Q40_X16 || qtype == FK_Q41_X16 || qtype == FK_Q50_X16 || qtype == FK_Q51_X16 || qtype == FK_Q80_X16 ||
           qtype == FK_MXFP4_X16 || qtype == FK_IQ4NL_X16;
}
/* rows a group of a row-group layout above; 0 for a format in plain rows */
static inline int fk_group_rows(int qtype) {
    return fk_x16s(qtype) || fk_x16u(qtype) ? 16 : qtype == FK_TQ2_X8 ? 8 : 0;
}

/* One matmul: y[m, n] = x[m, k] @ W[n, k]^T, W in GGML blocks, row_bytes per row. */
typedef struct {
    int qtype;
    const uint8_t *w;
    size_t row_bytes;
    int64_t n, k, m;
    const float *x;
    float *y;
    int64_t ldy;      /* row stride of y in floats (>= n) */
    int nthreads;
    int prefill;      /* FK_PREFILL_*: the route family (canonical, or a legacy opt-out) */
} fk_matmul_args;

/* Read bytes [p, p + n) in address order, one load a cache line, before a decode GEMV
 * computes on them: its tile of 16 (AVX2: 8) weight rows, one contiguous span. The GEMV
 * walks the tile's rows side by side, as many short streams, which the hardware prefetcher
 * does not follow, and its dots fill the out-of-order window, so only about one step's
 * lines are in flight at a time: on Zen 4 that access order alone, with no arithmetic, reads
 * DRAM at 5.5 GB/s a core against 18-22 in address order. A tight loop of loads keeps many
 * misses in flight, as a sequential read does; the dots then run on bytes in L1/L2. It
 * replaced the per-row software prefetches, which gained ~nothing beside it and cancelled its
 * gain (they filled the miss buffers with the next tile's lines); BENCHMARK.md, "The decode
 * GEMV reads each tile in address order". A span past FK_TOUCH_MAX (more than L2
 * holds beside the rest) is left to the kernel's own reads. Now only a run's first tile is
 * touched: the others are prefetched during the previous tile's dots (fk_pf below). */
#define FK_TOUCH_MAX (256 * 1024)
/* The next tile's span, prefetched a slice per kernel step in address order while this
 * tile's dots run (fk_pf_step once per step, fk_pf_rest after the tile), into L2 (the
 * locality-2 hint: into L1 it evicted the tile being read and halved the rate). The touch
 * alone left the core idle while it read and the memory idle while the dots ran: with the
 * next tile read during the dots, 1.7B Q4_K_M's layer GEMVs went from 16-19 to 23-28 GB/s at
 * 2 threads on Zen 4 (BENCHMARK.md "The decode GEMV prefetches the next tile"). */
typedef struct {
    const char *p, *end;
    size_t slice;
} fk_pf;
static inline void fk_pf_set(fk_pf *f, const uint8_t *p, size_t n, int64_t steps) {
    f->end = (const char *)p + n;
    f->p = n ? (const char *)((uintptr_t)p & ~(uintptr_t)63) : f->end;   /* the last tile: nothing ahead */
    const size_t per = (size_t)(f->end - f->p) / (size_t)(steps > 0 ? steps : 1);
    f->slice = (per + 63) & ~(size_t)63;
}
static inline void fk_pf_step(fk_pf *f) {
    const char *e = f->p + f->slice < f->end ? f->p + f->slice : f->end;
    for (; f->p < e; f->p += 64) __builtin_prefetch(f->p, 0, 2);
}
static inline void fk_pf_rest(fk_pf *f) {
    for (; f->p < f->end; f->p += 64) __builtin_prefetch(f->p, 0, 2);
}
/* Bytes the prefetch runs ahead of the tile being computed: at least the next tile, and for
 * short rows FK_PF_AHEAD (a 16-row tile of a 512-wide MXFP4 expert is 4 KB, computed in less
 * time than a DRAM miss takes: one tile ahead its lines had not arrived when its dots
 * started, and a quarter of the GEMV's time was that stall; 8, 16 and 24 KB measured alike) */
#define FK_PF_AHEAD ((size_t)16384)
/* the span from the frontier `front` to FK_PF_AHEAD (at least `tile`) past the current
 * tile's end `end`, stopping at `stop` (all byte offsets into w), prefetched over the tile's
 * `steps` kernel steps; returns the new frontier */
static inline size_t fk_pf_ahead(fk_pf *f, const uint8_t *w, size_t front, size_t end, size_t tile, size_t stop,
                                 int64_t steps) {
    size_t to = end + (tile > FK_PF_AHEAD ? tile : FK_PF_AHEAD);
    if (to > stop) to = stop;
    if (to < front) to = front;
    fk_pf_set(f, w + front, to - front, steps);
    return to;
}
/* Every row count the decode GEMV takes (1..8) touches and prefetches so. Before 317f509, 6-8
 * rows (a verify pass) kept per-row software prefetches instead, from when the touch read
 * every tile (8 rows: SmolLM2 +10%, Gemma-3 +4-14%); with the next-tile prefetch a 6-row pass
 * cost 2.6-2.7 plain steps there against 1.9-2.0 now (Qwen2.5-Coder-0.5B at AVX2; BENCHMARK.md
 * "Verify passes of 6-8 rows prefetch too") */
static inline void fk_touch(const uint8_t *p, size_t n) {
    if (n == 0 || n > FK_TOUCH_MAX) return;
    uint32_t acc = p[n - 1];
    for (size_t i = 0; i < n; i += 64) {
        acc |= p[i];
        __asm__("" : "+r"(acc));    /* one plain load a line (no vectorised gather of them) */
    }
    __asm__ volatile("" : : "r"(acc));   /* the loads must happen: their result is kept */
}

/* One thread's share of a decode GEMV's tiles [t0, t1), claimed a tile at a time: by its owner
 * from the front (one contiguous stream it prefetches ahead of itself), and by a thread whose
 * own share is done from the back (stealing evens out a slow core a tile at a time). The two
 * ends share one word, so a claim is one compare-and-swap; padded to a line of its own. */
#define FK_GEMV_SHARES 256   /* the most threads a decode GEMV runs on */
typedef struct {
    uint64_t v;   /* front | back << 32 */
    char pad[56];
} fk_claim;
static inline void fk_claim_set(fk_claim *c, int64_t t0, int64_t t1) {
    __atomic_store_n(&c->v, (uint64_t)t0 | (uint64_t)t1 << 32, __ATOMIC_RELAXED);
}
/* the front tile (the owner's next), or -1 when the share is taken */
static inline int64_t fk_claim_front(fk_claim *c) {
    uint64_t v = __atomic_load_n(&c->v, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t f = v & 0xffffffffu, b = v >> 32;
        if (f >= b) return -1;
        if (__atomic_compare_exchange_n(&c->v, &v, v + 1, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return (int64_t)f;
    }
}
/* the back tile (a thief's), or -1 */
static inline int64_t fk_claim_back(fk_claim *c) {
    uint64_t v = __atomic_load_n(&c->v, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t f = v & 0xffffffffu, b = v >> 32;
        if (f >= b) return -1;
        if (__atomic_compare_exchange_n(&c->v, &v, v - ((uint64_t)1 << 32), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)b - 1;
    }
}

/* FK_PREFILL_CANON (the default): every m takes the canonical arithmetic of generic/matmul_impl.inc
 * (batch invariant: a row's result never depends on the rows computed with it).
 * INT8 / BF16: the legacy routes (FUCINA_INVARIANT=0): per-m GEMV / tiles, and for
 * m >= FK_PREFILL_MIN_M the int8 tiles or the AVX512_BF16 GEMM. */
enum { FK_PREFILL_INT8 = 0, FK_PREFILL_BF16 = 1, FK_PREFILL_CANON = 2 };
#define FK_PREFILL_MIN_M 8

/* Decode attention (generic/attn_impl.inc): out[h*d..] = softmax(scale * q[h] . K_kvh^T) @ V_kvh for one
 * query row, K/V rows f16 [n, kv_heads, d] with row_stride halves between rows, query
 * head h served by kv head h / (n_head / kv_heads). q and out are [n_head, d] f32. */
typedef struct {
    const float *q;
    const uint16_t *k, *v;
    float *out;
    int64_t n, row_stride;
    int n_head, kv_heads, d;
    float scale;
    int nthreads;
    int64_t pos0;     /* absolute position of key 0: blocks and chunks align to positions */
    const float *sinks;   /* [n_head] or NULL: one more logit per head in the softmax (gpt-oss) */
} fk_attn_args;

#define FK_ATTN_MAX_GROUP 64
#define FK_ATTN_MAX_D 1024

#include "fk_plan.h"   /* the decoder plan: its schema, structs and step arguments */

/* The one dispatch table: every per-ISA entry of the module, one table per unit
 * (isa/scalar.cpp, isa/avx2.cpp, isa/avx2vnni.cpp, isa/avx512.cpp). module.cpp holds the table in force
 * (set_isa), so one switch moves the matmul, the attention and the step together. */
typedef struct {
    const char *name;
    void (*matmul)(const fk_matmul_args *a);
    /* test hook: quantize activations exactly as matmul does and dequantize back */
    void (*act_roundtrip)(const float *x, int64_t k, float *out);
    /* one row of k values of a weight back to f32 (embedding lookup) */
    void (*dequant_row)(int qtype, const uint8_t *src, int64_t k, float *out);
    /* one query row over the f16 cache (generic/attn_impl.inc) */
    void (*attn_decode)(const fk_attn_args *a);
    /* every layer of the plan over m rows (generic/step_impl.inc); its matmuls go through
     * a->matmul, which module.cpp sets to this table's */
    void (*step)(fk_step_args *a);
    /* one layer's ffn over m rows of an ffn-only plan (generic/step_impl.inc fk_ffn_impl) */
    void (*ffn)(fk_step_args *a);
    /* test probe: the most activation rows (0..8) the canonical decode GEMV takes for a format */
    int (*gemv_rows)(int qtype);
} fk_isa;

#ifdef __cplusplus
extern "C" {
#endif
extern const fk_isa fk_isa_scalar;
extern const fk_isa fk_isa_avx2;
extern const fk_isa fk_isa_avx2vnni;
extern const fk_isa fk_isa_avx512;
/* 1 when the AVX-512 unit's canonical prefill kernel runs 16 activation rows at a time on the
 * AMX tile unit (module.cpp: the CPU has AMX-INT8 and the OS granted the tile state) */
extern int fk_amx_on;
#ifdef __cplusplus
}
#endif

/* a unit's table: its namespace fk_<level>_ns, attention and the step in its ::attn */
#define FK_ISA_TABLE(level)                                                                                  \
    extern "C" const fk_isa fk_isa_##level = {#level, fk_##level##_ns::fk_matmul, fk_##level##_ns::fk_act_roundtrip, \
                                              fk_##level##_ns::fk_dequant_row, fk_##level##_ns::attn::fk_attn_decode_impl, \
                                              fk_##level##_ns::attn::fk_step_impl, fk_##level##_ns::attn::fk_ffn_impl, \
                                              fk_##level##_ns::fk_gemv_rows};

/* MXFP4's E8M0 scale byte -> 2^(e - 127) / 2 (ggml_e8m0_to_fp32_half): exact in f32, e < 2
 * subnormal. The block's values are the doubled E2M1 codes, so this is their scale. */
static inline float fk_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* f16 -> f32 without F16C (scalar units) */
static inline float fk_h2f_portable(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* f32 -> f16, round to nearest even (scalar units; matches torch's .half()) */
static inline uint16_t fk_f2h_portable(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);   /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                      /* half subnormal or zero */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)__builtin_nearbyintf(a * 16777216.0f));
    }
    uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7FFFFFu) >> 13));
    const uint32_t rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

#endif
