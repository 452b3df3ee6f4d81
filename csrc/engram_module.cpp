/* fucina.kernels._engram: an Engram layer's inference forward as one native call per memory
 * layer and step (docs/ENGRAM.md). The call compresses the step's token ids into the
 * sequence's id history, hashes each row's n-grams, gathers the table rows, runs both
 * projections, the gate, the value, the ShortConv over the normed value history, and adds
 * the result to the residual in place: what ~25 small torch ops a token did before.
 *
 * One unit, three sections (scalar, AVX2 + FMA, AVX-512), each compiling
 * generic/engram_impl.inc over its own eg_dot2; the caller picks the section by number
 * (fucina.kernels.engram follows the ISA fucina.kernels runs), refused when the CPU lacks it.
 * Every pointer and size is checked here before anything is read or written.
 *
 * Inside the decoder step: a graft context (graft_new / graft_layer) holds each memory
 * layer's fixed arguments; its layers are residual hooks of the step's plan (fk_res_hook in
 * fk_plan.h: hook_address() and the layer's context address in the plan's res_hook fields).
 * Before each step, graft_bind checks and compresses the step's ids into the history, reads
 * mapped tables' rows ahead and arms every layer once; the step then calls each layer's hook
 * at its layer with the residual rows, and the hook runs the same forward as `forward`,
 * its projections over the step's threads. So a token is one native call for the whole
 * model, memory layers included. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EG_F32_EPS FLT_EPSILON   /* torch's RMSNorm default for f32 (the gate's norms) */
#define EG_CONV_EPS 1e-5f        /* the ShortConv's RMSNorm */
#define EG_MAX_NGRAM 64

typedef struct {
    float *x;                  /* residual rows [m, d], updated in place */
    int64_t m, d;
    const int64_t *sids;       /* compressed ids by position, filled up to pos0 + m */
    int64_t pos0;
    int max_ngram, n_head;
    int64_t pad;               /* the compressed pad id (positions before the first) */
    const int64_t *mult, *mods, *offs;   /* [max_ngram] odd multipliers, [heads] primes and row offsets */
    const float *table;        /* [table_rows, head_dim] */
    int64_t table_rows, head_dim;
    const float *key_w, *key_b, *key_norm, *query_norm, *value_w, *value_b, *conv_norm, *conv_w;
    int kernel, dilation;
    float *conv;               /* normed value rows by position [capacity, d] */
    void *scratch;             /* rows [heads] (int64) | e [E] | key [d] | value [d] (f32) */
    int nthreads;              /* the projections' threads (OpenMP, the pool torch loaded) */
} eg_layer_args;

/* the heads' table rows of position pos (the reference's hash, plan.py): order n mixes
 * ids[pos - k] * mult[k] for k < n by XOR in wrapping int64, head j's row is the mix
 * floored mod its prime, plus its offset; positions before 0 read the pad */
static void eg_rows(const int64_t *sids, int64_t pos, int max_ngram, int n_head, int64_t pad, const int64_t *mult,
                    const int64_t *mods, const int64_t *offs, int64_t *out) {
    uint64_t mix = (uint64_t)sids[pos] * (uint64_t)mult[0];
    for (int n = 2; n <= max_ngram; n++) {
        const int64_t p = pos - (n - 1);
        mix ^= (uint64_t)(p >= 0 ? sids[p] : pad) * (uint64_t)mult[n - 1];
        const int64_t sm = (int64_t)mix;
        for (int h = 0; h < n_head; h++) {
            const int j = (n - 2) * n_head + h;
            int64_t r = sm % mods[j];
            if (r < 0) r += mods[j];
            out[j] = r + offs[j];
        }
    }
}

namespace eg_scalar {
/* eight partial sums a weight, so the loop is not one long dependency chain */
static inline void eg_dot2(const float *wa, const float *wb, const float *e, int64_t n, float *da, float *db) {
    float a[8] = {0}, b[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            a[l] += wa[i + l] * e[i + l];
            b[l] += wb[i + l] * e[i + l];
        }
    float ta = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    float tb = ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
    for (; i < n; i++) {
        ta += wa[i] * e[i];
        tb += wb[i] * e[i];
    }
    *da = ta;
    *db = tb;
}
#include "generic/engram_impl.inc"
}  // namespace eg_scalar

#ifdef FK_X86
#include <immintrin.h>

/* GCC 12 flags the undefined half inside _mm512_reduce_add_ps (a false positive) */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace eg_avx2 {
#include "isa/avx2_engram.inc"
#include "generic/engram_impl.inc"
}  // namespace eg_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace eg_avx512 {
#include "isa/avx512_engram.inc"
#include "generic/engram_impl.inc"
}  // namespace eg_avx512
#pragma GCC pop_options

static int eg_cpu(int level) {
    __builtin_cpu_init();
    if (level == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && eg_cpu(1);
}
#else
static int eg_cpu(int level) { return level == 0; }
#endif

typedef void (*eg_fn)(const eg_layer_args *);

static eg_fn eg_pick(long level) {
    if (level == 0) return eg_scalar::eg_forward;
#ifdef FK_X86
    if (level == 1 && eg_cpu(1)) return eg_avx2::eg_forward;
    if (level == 2 && eg_cpu(2)) return eg_avx512::eg_forward;
#endif
    return NULL;
}

static int eg_ints(const char *fn, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *v) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", fn, want);
        return 0;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return 0;
    }
    return 1;
}

#define EG_PTR(i) ((void *)(uintptr_t)v[i])

/* the hash geometry shared by forward and rows: sizes in range, every head's rows inside
 * [0, table_rows) (rows == -1: not checked against a table) */
static int eg_check_plan(int64_t max_ngram, int64_t n_head, const int64_t *mult, const int64_t *mods, const int64_t *offs,
                         int64_t table_rows) {
    if (max_ngram < 2 || max_ngram > EG_MAX_NGRAM || n_head < 1 || n_head > 4096 || !mult || !mods || !offs) {
        PyErr_SetString(PyExc_ValueError, "engram: max_ngram in 2..64, n_head in 1..4096 and the plan's arrays");
        return 0;
    }
    for (int64_t j = 0; j < (max_ngram - 1) * n_head; j++)
        if (mods[j] < 1 || offs[j] < 0 || (table_rows >= 0 && offs[j] > table_rows - mods[j])) {
            PyErr_Format(PyExc_ValueError, "engram: head %lld's rows [%lld, %lld + %lld) fall outside the table of %lld",
                         (long long)j, (long long)offs[j], (long long)offs[j], (long long)mods[j], (long long)table_rows);
            return 0;
        }
    return 1;
}

/* a layer's fixed arguments, v[0..18] = (max_ngram, n_head, pad, mult, mods, offs, table,
 * table_rows, head_dim, key_w, key_b, key_norm, query_norm, value_w, value_b, conv_norm, conv_w,
 * kernel, dilation), into a; checked (width d) */
static int eg_fixed(const long long *v, int64_t d, eg_layer_args *a) {
    a->d = d;
    a->max_ngram = (int)v[0];
    a->n_head = (int)v[1];
    a->pad = v[2];
    a->mult = (const int64_t *)EG_PTR(3);
    a->mods = (const int64_t *)EG_PTR(4);
    a->offs = (const int64_t *)EG_PTR(5);
    a->table = (const float *)EG_PTR(6);
    a->table_rows = v[7];
    a->head_dim = v[8];
    a->key_w = (const float *)EG_PTR(9);
    a->key_b = (const float *)EG_PTR(10);
    a->key_norm = (const float *)EG_PTR(11);
    a->query_norm = (const float *)EG_PTR(12);
    a->value_w = (const float *)EG_PTR(13);
    a->value_b = (const float *)EG_PTR(14);
    a->conv_norm = (const float *)EG_PTR(15);
    a->conv_w = (const float *)EG_PTR(16);
    a->kernel = (int)v[17];
    a->dilation = (int)v[18];
    a->nthreads = 1;
    if (!a->table || !a->key_w || !a->key_b || !a->key_norm || !a->query_norm || !a->value_w || !a->value_b ||
        !a->conv_norm || !a->conv_w) {
        PyErr_SetString(PyExc_ValueError, "engram: null pointer");
        return 0;
    }
    if (d < 1 || d > (1 << 20) || a->table_rows < 1 || a->head_dim < 1 || a->head_dim > 65536 || v[17] < 1 ||
        v[17] > 64 || v[18] < 1 || v[18] > 4096) {
        PyErr_SetString(PyExc_ValueError, "engram: inconsistent sizes (rows, width, positions past the capacity, "
                                          "table, head width, conv kernel or dilation)");
        return 0;
    }
    return eg_check_plan(v[0], v[1], a->mult, a->mods, a->offs, a->table_rows);
}

/* a layer's scratch (eg_layer_args.scratch) */
static void *eg_scratch(const eg_layer_args *a) {
    const int64_t nh = (int64_t)(a->max_ngram - 1) * a->n_head;
    return malloc((size_t)nh * 8 + (size_t)(nh * a->head_dim + 2 * a->d) * 4);
}

/* forward(level, x, m, d, ids, n_vocab, lookup, sids, pos0, capacity, max_ngram, n_head, pad,
 *         mult, mods, offs, table, table_rows, head_dim, key_w, key_b, key_norm, query_norm,
 *         value_w, value_b, conv_norm, conv_w, kernel, dilation, conv)
 * ids: the step's raw token ids (int64 [m]); lookup: int64 [n_vocab] compression or 0;
 * sids: int64 [capacity] the compressed id history (ids written at pos0..); conv: f32
 * [capacity, d] the normed value history. x: f32 [m, d], updated in place. */
static PyObject *py_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[30];
    if (!eg_ints("forward", args, nargs, 30, v)) return NULL;
    const eg_fn fn = eg_pick((long)v[0]);
    if (!fn) {
        PyErr_Format(PyExc_ValueError, "engram: ISA level %lld is unknown or not supported by this CPU", v[0]);
        return NULL;
    }
    eg_layer_args a;
    if (!eg_fixed(v + 10, v[3], &a)) return NULL;
    a.x = (float *)EG_PTR(1);
    a.m = v[2];
    const int64_t *ids = (const int64_t *)EG_PTR(4), *lookup = (const int64_t *)EG_PTR(6);
    const int64_t n_vocab = v[5], cap = v[9];
    int64_t *sids = (int64_t *)EG_PTR(7);
    a.sids = sids;
    a.pos0 = v[8];
    a.conv = (float *)EG_PTR(29);
    if (!a.x || !ids || !sids || !a.conv) {
        PyErr_SetString(PyExc_ValueError, "engram: null pointer");
        return NULL;
    }
    if (a.m < 1 || n_vocab < 1 || a.pos0 < 0 || cap < 1 || a.pos0 > cap - a.m) {
        PyErr_SetString(PyExc_ValueError, "engram: inconsistent sizes (rows, width, positions past the capacity, "
                                          "table, head width, conv kernel or dilation)");
        return NULL;
    }
    for (int64_t t = 0; t < a.m; t++)
        if (ids[t] < 0 || ids[t] >= n_vocab) {
            PyErr_Format(PyExc_IndexError, "engram: token id %lld out of range [0, %lld)", (long long)ids[t],
                         (long long)n_vocab);
            return NULL;
        }
    for (int64_t t = 0; t < a.m; t++) sids[a.pos0 + t] = lookup ? lookup[ids[t]] : ids[t];
    const int64_t nh = (int64_t)(a.max_ngram - 1) * a.n_head;
    a.scratch = eg_scratch(&a);
    if (!a.scratch) return PyErr_NoMemory();
    if (a.m * a.d * nh * a.head_dim > (1 << 22)) {
        Py_BEGIN_ALLOW_THREADS fn(&a);
        Py_END_ALLOW_THREADS
    } else {
        fn(&a);
    }
    free(a.scratch);
    Py_RETURN_NONE;
}

/* rows(sids, pos0, m, max_ngram, n_head, pad, mult, mods, offs, out): int64 [m, heads] the
 * table rows (offsets included) of positions pos0.. from the compressed id history */
static PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[10];
    if (!eg_ints("rows", args, nargs, 10, v)) return NULL;
    const int64_t *sids = (const int64_t *)EG_PTR(0), pos0 = v[1], m = v[2];
    int64_t *out = (int64_t *)EG_PTR(9);
    if (!sids || !out || pos0 < 0 || m < 0) {
        PyErr_SetString(PyExc_ValueError, "engram rows: null pointer or negative position");
        return NULL;
    }
    if (!eg_check_plan(v[3], v[4], (const int64_t *)EG_PTR(6), (const int64_t *)EG_PTR(7),
                       (const int64_t *)EG_PTR(8), -1))
        return NULL;
    const int64_t nh = (v[3] - 1) * v[4];
    for (int64_t t = 0; t < m; t++)
        eg_rows(sids, pos0 + t, (int)v[3], (int)v[4], v[5], (const int64_t *)EG_PTR(6), (const int64_t *)EG_PTR(7),
                (const int64_t *)EG_PTR(8), out + t * nh);
    Py_RETURN_NONE;
}

/* willneed(table, row_bytes, table_rows, rows, n): ask the kernel to read the pages of these
 * rows of a mapped table ahead (MADV_WILLNEED starts the reads and returns); rows outside
 * the table are refused. Returns the number of rows advised. */
static PyObject *py_willneed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (!eg_ints("willneed", args, nargs, 5, v)) return NULL;
    const uintptr_t base = (uintptr_t)v[0];
    const int64_t row_bytes = v[1], table_rows = v[2], n = v[4];
    const int64_t *rows = (const int64_t *)EG_PTR(3);
    if (!base || !rows || row_bytes < 1 || table_rows < 1 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "engram willneed: null pointer or bad sizes");
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= table_rows) {
            PyErr_Format(PyExc_IndexError, "engram willneed: row %lld outside the table of %lld", (long long)rows[i],
                         (long long)table_rows);
            return NULL;
        }
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    long advised = 0;
    for (int64_t i = 0; i < n; i++) {
        const uintptr_t b = base + (uintptr_t)rows[i] * (uintptr_t)row_bytes, lo = b & ~(page - 1);
        if (madvise((void *)lo, b + (uintptr_t)row_bytes - lo, MADV_WILLNEED) == 0) advised++;
    }
    return PyLong_FromLong(advised);
}

/* ---- the graft context: the memory layers as residual hooks of the decoder step ---------- */
static const char *kGraftCapsule = "fucina.kernels.engram.graft";

typedef struct eg_graft eg_graft;
typedef struct {
    eg_graft *g;
    int index;                 /* the layer's place in the graft (its history's slot) */
    int set, armed;            /* fixed arguments given; bound to the next step, not yet run */
    int64_t mapped_row_bytes;  /* a table mapped from its file: its rows are read ahead (0: in RAM) */
    eg_layer_args a;           /* the fixed arguments and the scratch */
} eg_hook;

struct eg_graft {
    int n_layers;
    int64_t d, n_vocab;
    const int64_t *lookup;     /* int64 [n_vocab] compression or NULL */
    /* the binding (graft_bind): the step's rows, the stream's history */
    eg_fn fn;
    int64_t m, pos0;
    int64_t *sids;
    float **conv;              /* [n_layers] each layer's normed value history */
    eg_hook *layers;           /* [n_layers] */
};

/* fk_res_hook (fk_plan.h): the layer's forward over the step's rows, once per binding */
static int eg_step_hook(int64_t ctx, float *x, int64_t m, int64_t ldx, int64_t pos0, int nthreads) {
    eg_hook *h = (eg_hook *)(uintptr_t)ctx;
    eg_graft *g = h->g;
    if (!h->armed || !x || m != g->m || pos0 != g->pos0 || ldx != g->d) return 1;
    h->armed = 0;
    eg_layer_args a = h->a;
    a.x = x;
    a.m = m;
    a.sids = g->sids;
    a.pos0 = pos0;
    a.conv = g->conv[h->index];
    a.nthreads = nthreads > 1 ? nthreads : 1;
    g->fn(&a);
    return 0;
}

static void graft_free(PyObject *cap) {
    eg_graft *g = (eg_graft *)PyCapsule_GetPointer(cap, kGraftCapsule);
    if (!g) return;
    for (int j = 0; j < g->n_layers; j++) free(g->layers[j].a.scratch);
    free(g->layers);
    free(g->conv);
    free(g);
}

static eg_graft *graft_of(PyObject *cap) { return (eg_graft *)PyCapsule_GetPointer(cap, kGraftCapsule); }

/* graft_new(n_layers, d, n_vocab, lookup) -> capsule; lookup: int64 [n_vocab] or 0 (the
 * caller keeps the array alive as long as the capsule) */
static PyObject *py_graft_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[4];
    if (!eg_ints("graft_new", args, nargs, 4, v)) return NULL;
    if (v[0] < 1 || v[0] > 4096 || v[1] < 1 || v[1] > (1 << 20) || v[2] < 1) {
        PyErr_SetString(PyExc_ValueError, "engram graft_new: layers in 1..4096, a width and a vocabulary");
        return NULL;
    }
    eg_graft *g = (eg_graft *)calloc(1, sizeof(eg_graft));
    if (g) {
        g->layers = (eg_hook *)calloc((size_t)v[0], sizeof(eg_hook));
        g->conv = (float **)calloc((size_t)v[0], sizeof(float *));
    }
    if (!g || !g->layers || !g->conv) {
        if (g) {
            free(g->layers);
            free(g->conv);
        }
        free(g);
        return PyErr_NoMemory();
    }
    g->n_layers = (int)v[0];
    g->d = v[1];
    g->n_vocab = v[2];
    g->lookup = (const int64_t *)EG_PTR(3);
    for (int j = 0; j < g->n_layers; j++) {
        g->layers[j].g = g;
        g->layers[j].index = j;
    }
    PyObject *cap = PyCapsule_New(g, kGraftCapsule, graft_free);
    if (!cap) {
        free(g->layers);
        free(g->conv);
        free(g);
    }
    return cap;
}

/* graft_layer(graft, j, max_ngram, ..., dilation (forward's 19 fixed arguments), mapped_row_bytes)
 * -> the layer's hook context (an address for the plan's res_hook_ctx); the caller keeps every
 * array alive; a layer given again replaces its arguments (a parameter that moved) */
static PyObject *py_graft_layer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 22) {
        PyErr_SetString(PyExc_TypeError, "graft_layer takes 22 arguments");
        return NULL;
    }
    eg_graft *g = graft_of(args[0]);
    if (!g) return NULL;
    long long v[21];
    if (!eg_ints("graft_layer", args + 1, nargs - 1, 21, v)) return NULL;
    if (v[0] < 0 || v[0] >= g->n_layers || v[20] < 0) {
        PyErr_SetString(PyExc_ValueError, "engram graft_layer: layer index out of range or negative row bytes");
        return NULL;
    }
    eg_layer_args a;
    if (!eg_fixed(v + 1, g->d, &a)) return NULL;
    a.scratch = eg_scratch(&a);
    if (!a.scratch) return PyErr_NoMemory();
    eg_hook *h = g->layers + v[0];
    free(h->a.scratch);
    h->a = a;
    h->mapped_row_bytes = v[20];
    h->set = 1;
    h->armed = 0;
    return PyLong_FromVoidPtr(h);
}

/* graft_bind(graft, level, ids, m, sids, pos0, capacity, conv) -> rows read ahead: the next
 * step's m rows at pos0..: ids int64 [m] checked against the vocabulary and compressed into
 * the history sids int64 [capacity]; conv int64 [n_layers] the layers' normed value
 * histories (f32 [capacity, d] each); mapped tables' rows advised (MADV_WILLNEED); every
 * layer armed for one call */
static PyObject *py_graft_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "graft_bind takes 8 arguments");
        return NULL;
    }
    eg_graft *g = graft_of(args[0]);
    if (!g) return NULL;
    long long v[7];
    if (!eg_ints("graft_bind", args + 1, nargs - 1, 7, v)) return NULL;
    const eg_fn fn = eg_pick((long)v[0]);
    if (!fn) {
        PyErr_Format(PyExc_ValueError, "engram: ISA level %lld is unknown or not supported by this CPU", v[0]);
        return NULL;
    }
    const int64_t *ids = (const int64_t *)EG_PTR(1), m = v[2], pos0 = v[4], cap = v[5];
    int64_t *sids = (int64_t *)EG_PTR(3);
    const int64_t *conv = (const int64_t *)EG_PTR(6);
    if (!ids || !sids || !conv) {
        PyErr_SetString(PyExc_ValueError, "engram: null pointer");
        return NULL;
    }
    if (m < 1 || pos0 < 0 || cap < 1 || pos0 > cap - m) {
        PyErr_SetString(PyExc_ValueError, "engram: inconsistent sizes (rows, positions past the capacity)");
        return NULL;
    }
    for (int j = 0; j < g->n_layers; j++)
        if (!g->layers[j].set || !conv[j]) {
            PyErr_Format(PyExc_ValueError, "engram: memory layer %d has no arguments or no history", j);
            return NULL;
        }
    for (int64_t t = 0; t < m; t++)
        if (ids[t] < 0 || ids[t] >= g->n_vocab) {
            PyErr_Format(PyExc_IndexError, "engram: token id %lld out of range [0, %lld)", (long long)ids[t],
                         (long long)g->n_vocab);
            return NULL;
        }
    for (int64_t t = 0; t < m; t++) sids[pos0 + t] = g->lookup ? g->lookup[ids[t]] : ids[t];
    long advised = 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int j = 0; j < g->n_layers; j++) {
        eg_hook *h = g->layers + j;
        g->conv[j] = (float *)(uintptr_t)conv[j];
        h->armed = 1;
        if (!h->mapped_row_bytes) continue;
        const eg_layer_args *a = &h->a;
        const int64_t nh = (int64_t)(a->max_ngram - 1) * a->n_head;
        int64_t *rows = (int64_t *)a->scratch;
        for (int64_t t = 0; t < m; t++) {
            eg_rows(sids, pos0 + t, a->max_ngram, a->n_head, a->pad, a->mult, a->mods, a->offs, rows);
            for (int64_t i = 0; i < nh; i++) {
                const uintptr_t b = (uintptr_t)a->table + (uintptr_t)rows[i] * (uintptr_t)h->mapped_row_bytes;
                const uintptr_t lo = b & ~(page - 1);
                if (madvise((void *)lo, b + (uintptr_t)h->mapped_row_bytes - lo, MADV_WILLNEED) == 0) advised++;
            }
        }
    }
    g->fn = fn;
    g->m = m;
    g->pos0 = pos0;
    g->sids = sids;
    return PyLong_FromLong(advised);
}

static PyObject *py_hook_address(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromVoidPtr((void *)&eg_step_hook);
}

static PyObject *py_supported(PyObject *self, PyObject *arg) {
    (void)self;
    const long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(eg_pick(level) != NULL);
}

static PyMethodDef methods[] = {
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_FASTCALL,
     "forward(level, x, m, d, ids, n_vocab, lookup, sids, pos0, capacity, max_ngram, n_head, pad, mult, mods, offs, "
     "table, table_rows, head_dim, key_w, key_b, key_norm, query_norm, value_w, value_b, conv_norm, conv_w, kernel, "
     "dilation, conv): one Engram layer over x[m, d] in place"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "rows(sids, pos0, m, max_ngram, n_head, pad, mult, mods, offs, out): the heads' table rows of positions pos0.."},
    {"willneed", (PyCFunction)(void (*)(void))py_willneed, METH_FASTCALL,
     "willneed(table, row_bytes, table_rows, rows, n): read these rows' pages of a mapped table ahead"},
    {"supported", py_supported, METH_O, "supported(level): 0 scalar, 1 AVX2 + FMA, 2 AVX-512"},
    {"graft_new", (PyCFunction)(void (*)(void))py_graft_new, METH_FASTCALL,
     "graft_new(n_layers, d, n_vocab, lookup): a graft context, its layers run inside the decoder step"},
    {"graft_layer", (PyCFunction)(void (*)(void))py_graft_layer, METH_FASTCALL,
     "graft_layer(graft, j, max_ngram, ..., dilation, mapped_row_bytes): layer j's arguments; its hook context"},
    {"graft_bind", (PyCFunction)(void (*)(void))py_graft_bind, METH_FASTCALL,
     "graft_bind(graft, level, ids, m, sids, pos0, capacity, conv): bind the next step's rows; rows read ahead"},
    {"hook_address", py_hook_address, METH_NOARGS, "hook_address(): the step's residual hook (fk_res_hook)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_engram", "fucina's Engram layer kernel", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__engram(void) { return PyModule_Create(&moddef); }
