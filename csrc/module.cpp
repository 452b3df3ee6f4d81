/* Python binding of the native kernels: raw pointers and sizes in, nothing allocated.
 * The Python wrappers (fucina.kernels) validate every tensor before a pointer gets here;
 * the checks below are a second line that turns a bad call into ValueError, never a crash. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <algorithm>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <errno.h>
#include <omp.h>
#include <string.h>
#ifdef FK_X86
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "fk_delta.h"
#include "fk_dsv4.h"
#include "fk_kda.h"
#include "fk_common.h"

static const fk_isa *g_isa = &fk_isa_scalar;
int fk_amx_on = 0;   /* C linkage from its declaration in fk_common.h */
static int g_amx_able = 0;   /* cpu_has_amx(), asked once at import */
static int g_threads = 1;
static int g_prefill = FK_PREFILL_CANON;

/* the route family of a call: the BF16 legacy route exists on the AVX-512 unit only */
static int prefill_for_isa(void) {
    return g_prefill == FK_PREFILL_BF16 && g_isa != &fk_isa_avx512 ? FK_PREFILL_INT8 : g_prefill;
}

static int cpu_has_bf16(void);

#ifdef FK_X86
static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    unsigned a, b, c, d;
    int f16c = 0;
    /* F16C is CPUID.1:ECX bit 29 */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    f16c = (c >> 29) & 1;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") && f16c;
}
static int cpu_has_bf16(void) { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }
/* AMX-TILE and AMX-INT8 (CPUID.7.0:EDX bits 24, 25), the OS saving the tile state (XCR0 bits 17,
 * 18), and Linux's per-process grant of it (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA):
 * a hypervisor can report the instructions and still fault on them, so all three are asked */
static int cpu_has_amx(void) {
    if (!cpu_has_avx512()) return 0;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (((d >> 24) & 3) != 3) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 27) & 1)) return 0;   /* OSXSAVE: xgetbv is allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
static int cpu_has_avx2vnni(void) { return cpu_has_avx2() && __builtin_cpu_supports("avxvnni"); }
#else
static int cpu_has_amx(void) { return 0; }
static int cpu_has_bf16(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }
static int cpu_has_avx2(void) { return 0; }
static int cpu_has_avx2vnni(void) { return 0; }
/* never selected: isa_by_name refuses them on this CPU family */
const fk_isa fk_isa_avx512 = {"avx512", 0, 0, 0, 0, 0};
const fk_isa fk_isa_avx2 = {"avx2", 0, 0, 0, 0, 0};
const fk_isa fk_isa_avx2vnni = {"avx2vnni", 0, 0, 0, 0, 0};
#endif

static const fk_isa *isa_by_name(const char *name) {
    if (!strcmp(name, "avx512")) return cpu_has_avx512() ? &fk_isa_avx512 : NULL;
    if (!strcmp(name, "avx2vnni")) return cpu_has_avx2vnni() ? &fk_isa_avx2vnni : NULL;
    if (!strcmp(name, "avx2")) return cpu_has_avx2() ? &fk_isa_avx2 : NULL;
    if (!strcmp(name, "scalar")) return &fk_isa_scalar;
    return NULL;
}

/* block size and bytes per block of a format with a native route; 0 for any other type */
static int type_block(long t, long *bs, long *ts) {
    switch (t) {
    case FK_F32: *bs = 1; *ts = 4; return 1;
    case FK_F16: case FK_BF16: *bs = 1; *ts = 2; return 1;
    case FK_Q4_0: *bs = 32; *ts = 18; return 1;
    case FK_Q4_1: *bs = 32; *ts = 20; return 1;
    case FK_Q5_0: *bs = 32; *ts = 22; return 1;
    case FK_Q5_1: *bs = 32; *ts = 24; return 1;
    case FK_Q8_0: *bs = 32; *ts = 34; return 1;
    case FK_IQ4_NL: *bs = 32; *ts = 18; return 1;
    case FK_Q2_K: *bs = 256; *ts = 84; return 1;
    case FK_Q3_K: *bs = 256; *ts = 110; return 1;
    case FK_Q4_K: *bs = 256; *ts = 144; return 1;
    case FK_Q5_K: *bs = 256; *ts = 176; return 1;
    case FK_Q6_K: *bs = 256; *ts = 210; return 1;
    case FK_IQ4_XS: *bs = 256; *ts = 136; return 1;
    case FK_TQ1_0: *bs = 256; *ts = 54; return 1;
    case FK_TQ2_0: *bs = 256; *ts = 66; return 1;
    case FK_MXFP4: *bs = 32; *ts = 17; return 1;
    case FK_IQ2_XXS: case FK_IQ2_XS: case FK_IQ2_S: case FK_IQ3_XXS: case FK_IQ3_S: case FK_IQ1_S: case FK_IQ1_M:
        *bs = 256;   /* with their codebooks */
        *ts = fk_iq_bytes((int)t);
        return fk_iq.ready;
    case FK_PTQTP_BASE + 1: case FK_PTQTP_BASE + 2: case FK_PTQTP_BASE + 3:   /* row_bytes: one plane's */
        *bs = 256; *ts = 66; return 1;
    case FK_PTQTP_FOLD: *bs = 256; *ts = 130; return 1;
    case FK_TQ2_X8: *bs = 256; *ts = 66; return 1;   /* the buffer holds the rows rounded up to 8 */
    case FK_Q4K_X16: *bs = 256; *ts = 144; return 1;  /* the buffer holds the rows rounded up to 16 */
    case FK_Q5K_X16: *bs = 256; *ts = 176; return 1;  /* likewise */
    case FK_Q6K_X16: *bs = 256; *ts = 210; return 1;  /* likewise */
    case FK_IQ4XS_X16: *bs = 256; *ts = 136; return 1;  /* likewise */
    case FK_Q2K_X16: *bs = 256; *ts = 84; return 1;     /* likewise */
    case FK_Q3K_X16: *bs = 256; *ts = 110; return 1;    /* likewise */
    case FK_Q40_X16: *bs = 64; *ts = 36; return 1;    /* likewise; two blocks a unit */
    case FK_Q41_X16: *bs = 64; *ts = 40; return 1;    /* likewise */
    case FK_Q50_X16: *bs = 64; *ts = 44; return 1;    /* likewise */
    case FK_Q51_X16: *bs = 64; *ts = 48; return 1;    /* likewise */
    case FK_Q80_X16: *bs = 64; *ts = 68; return 1;    /* likewise */
    case FK_MXFP4_X16: *bs = 64; *ts = 34; return 1;  /* likewise */
    case FK_IQ4NL_X16: *bs = 64; *ts = 36; return 1;  /* likewise */
    }
    return 0;
}

/* FASTCALL argument checks: nargs must be `want`; args[first .. first + count) as integers */
static int int_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int first, int count,
                    long long *v) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", fn, want);
        return 0;
    }
    for (int i = 0; i < count; i++) {
        v[i] = PyLong_AsLongLong(args[first + i]);
        if (v[i] == -1 && PyErr_Occurred()) return 0;
    }
    return 1;
}

/* a kernel call, with the GIL released when it runs long enough for other Python threads
 * to gain from it (below that, releasing and taking it back costs more than the call) */
#define FK_CALL(long_enough, call)       \
    do {                                 \
        if (long_enough) {               \
            Py_BEGIN_ALLOW_THREADS call; \
            Py_END_ALLOW_THREADS         \
        } else {                         \
            call;                        \
        }                                \
    } while (0)

/* matmul(qtype, w_ptr, row_bytes, n, k, x_ptr, m, y_ptr, ldy) */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[9];
    if (!int_args("matmul", args, nargs, 9, 0, 9, v)) return NULL;
    fk_matmul_args a;
    a.qtype = (int)v[0];
    a.w = (const uint8_t *)(uintptr_t)v[1];
    a.row_bytes = (size_t)v[2];
    a.n = v[3];
    a.k = v[4];
    a.x = (const float *)(uintptr_t)v[5];
    a.m = v[6];
    a.y = (float *)(uintptr_t)v[7];
    a.ldy = v[8];
    a.nthreads = g_threads;
    a.prefill = prefill_for_isa();
    long bs, ts;
    if (!type_block(a.qtype, &bs, &ts)) {
        PyErr_Format(PyExc_ValueError, "no native route for GGML type %d", a.qtype);
        return NULL;
    }
    if (a.n <= 0 || a.k <= 0 || a.m < 0 || a.k % bs || (long long)a.row_bytes != a.k / bs * ts ||
        a.ldy < a.n || !a.w || !a.x || !a.y || a.k > (1LL << 28) || a.n > (1LL << 31)) {
        PyErr_SetString(PyExc_ValueError, "matmul: inconsistent shapes or null pointer");
        return NULL;
    }
    if (a.m == 0) Py_RETURN_NONE;
    const fk_isa *isa = g_isa;
    FK_CALL((double)a.m * (double)a.n * (double)a.k > 2e6, isa->matmul(&a));
    Py_RETURN_NONE;
}

/* attn_decode(q_ptr, k_ptr, v_ptr, out_ptr, n, row_stride, n_head, kv_heads, d, scale) */
static PyObject *py_attn_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[9];
    const double scale = int_args("attn_decode", args, nargs, 10, 0, 9, v) ? PyFloat_AsDouble(args[9]) : -1.0;
    if (PyErr_Occurred()) return NULL;
    fk_attn_args a;
    a.q = (const float *)(uintptr_t)v[0];
    a.k = (const uint16_t *)(uintptr_t)v[1];
    a.v = (const uint16_t *)(uintptr_t)v[2];
    a.out = (float *)(uintptr_t)v[3];
    a.n = v[4];
    a.row_stride = v[5];
    if (!a.q || !a.k || !a.v || !a.out || v[6] <= 0 || v[7] <= 0 || v[8] <= 0 || v[6] % v[7] ||
        v[6] / v[7] > FK_ATTN_MAX_GROUP || v[8] > FK_ATTN_MAX_D || v[8] % 16 || a.n <= 0 ||
        a.n > (1LL << 31) || a.row_stride < v[7] * v[8]) {
        PyErr_SetString(PyExc_ValueError, "attn_decode: inconsistent shapes or null pointer");
        return NULL;
    }
    a.n_head = (int)v[6];
    a.kv_heads = (int)v[7];
    a.d = (int)v[8];
    a.scale = (float)scale;
    a.nthreads = g_threads;
    a.pos0 = 0;
    a.sinks = NULL;
    const fk_isa *isa = g_isa;
    FK_CALL((double)a.n * a.kv_heads * a.d > 1e5, isa->attn_decode(&a));
    Py_RETURN_NONE;
}

/* delta_step(qkv, z, b, a, window, conv_w, dt_bias, ssm_a, state, norm_w, out, hk, hv, dk, dv,
 * d_conv, eps): one Gated DeltaNet decode token (fk_delta.cpp) */
static PyObject *py_delta_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[16];
    if (!int_args("delta_step", args, nargs, 17, 0, 16, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[16]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    for (int i = 0; i < 11; i++)
        if (!v[i]) { PyErr_SetString(PyExc_ValueError, "delta_step: null pointer"); return NULL; }
    if (v[11] < 1 || v[12] < 1 || v[12] % v[11] || v[13] < 1 || v[13] > 1024 || v[14] < 1 || v[14] > 1024 ||
        v[15] < 2 || v[15] > 64) {
        PyErr_SetString(PyExc_ValueError, "delta_step: inconsistent head counts or dims");
        return NULL;
    }
    fk_delta_args a = {(const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], (const float *)(uintptr_t)v[2],
                       (const float *)(uintptr_t)v[3], (float *)(uintptr_t)v[4], (const float *)(uintptr_t)v[5],
                       (const float *)(uintptr_t)v[6], (const float *)(uintptr_t)v[7], (float *)(uintptr_t)v[8],
                       (const float *)(uintptr_t)v[9], (float *)(uintptr_t)v[10], (int)v[11], (int)v[12], (int)v[13],
                       (int)v[14], (int)v[15], g_threads, (float)eps};
    fk_delta_step(&a);
    Py_RETURN_NONE;
}

/* hc_pre(mix, x, scale, base, h, post, comb, m, n, iters, eps) and hc_post(y, x, post, comb,
 * out, m, n): DeepSeek-V4's hyper-connection mixers (fk_dsv4.cpp) */
static PyObject *py_hc_pre(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[10];
    if (!int_args("hc_pre", args, nargs, 11, 0, 10, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[10]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    for (int i = 0; i < 7; i++)
        if (!v[i]) { PyErr_SetString(PyExc_ValueError, "hc_pre: null pointer"); return NULL; }
    if (v[7] < 0 || v[8] < 1 || v[9] < 1 || v[9] > 1000) {
        PyErr_SetString(PyExc_ValueError, "hc_pre: bad row count, width or iteration count");
        return NULL;
    }
    fk_hc_pre((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], (const float *)(uintptr_t)v[2],
              (const float *)(uintptr_t)v[3], v[7], v[8], (int)v[9], (float)eps, (float *)(uintptr_t)v[4],
              (float *)(uintptr_t)v[5], (float *)(uintptr_t)v[6]);
    Py_RETURN_NONE;
}

/* a thread's scratch of at least `bytes`, grown (contents dropped) when too small; NULL when
 * out of memory */
static void *scratch(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = malloc(bytes);
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}

/* y [m, n] = x [m, k] W^T through the ISA in force (shapes checked by the caller) */
static void isa_matmul(int qtype, const uint8_t *w, long long row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                       float *y) {
    fk_matmul_args a;
    a.qtype = qtype;
    a.w = w;
    a.row_bytes = (size_t)row_bytes;
    a.n = n;
    a.k = k;
    a.x = x;
    a.m = m;
    a.y = y;
    a.ldy = n;
    a.nthreads = g_threads;
    a.prefill = prefill_for_isa();
    g_isa->matmul(&a);
}

/* a weight's shape check: n rows of k values of type qt in rows of rb bytes (GGML rows, or
 * row groups: isa_matmul's callers take the whole matrix, which every route reads as groups) */
static bool weight_ok(long long qt, long long rb, long long n, long long k) {
    long bs, ts;
    return qt >= 0 && (qt < FK_PTQTP_BASE || fk_group_rows((int)qt)) && type_block(qt, &bs, &ts) && n >= 1 &&
           n <= (1LL << 24) && k >= 1 &&
           k <= (1LL << 24) && k % bs == 0 && rb == k / bs * ts;
}

/* a deepseek4 query row's geometry: q_a rank, heads of hd values, RoPE on each tail's n_rot */
static bool qkv_shape_ok(long long rank, long long heads, long long hd, long long n_rot) {
    return rank >= 1 && rank <= (1LL << 20) && heads >= 1 && heads <= 4096 && hd >= 2 && hd <= 4096 && n_rot >= 2 &&
           n_rot % 2 == 0 && n_rot <= hd;
}

/* hc_pre_full(x, qtype, w, row_bytes, scale, base, h, post, comb, m, n, iters, norm_eps, eps): hc_pre
 * with its input made here too: the streams x [m, 4 n] RMS-normed (fk_rms_norm), then the
 * mixer's projection w [24, 4 n] (the ISA's matmul), then fk_hc_pre: one call a mixer */
static thread_local void *hc_buf;
static thread_local size_t hc_cap;

static PyObject *py_hc_pre_full(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[12];
    if (!int_args("hc_pre_full", args, nargs, 14, 0, 12, v)) return NULL;
    const double norm_eps = PyFloat_AsDouble(args[12]), eps = PyFloat_AsDouble(args[13]);
    if (PyErr_Occurred()) return NULL;
    const long long m = v[9], n = v[10], k = 4 * n;
    for (int i = 0; i < 9; i++)
        if (i != 1 && !v[i]) { PyErr_SetString(PyExc_ValueError, "hc_pre_full: null pointer"); return NULL; }
    if (m < 1 || m > (1LL << 24) || n < 1 || n > (1LL << 24) || v[11] < 1 || v[11] > 1000 ||
        !weight_ok(v[1], v[3], 24, k)) {
        PyErr_SetString(PyExc_ValueError, "hc_pre_full: bad rows, width, iteration count or weight");
        return NULL;
    }
    float *normed = (float *)scratch(&hc_buf, &hc_cap, (size_t)(m * k + m * 24) * sizeof(float));
    if (!normed) return PyErr_NoMemory();
    const float *x = (const float *)(uintptr_t)v[0];
    float *mix = normed + m * k;
    fk_rms_norm(x, NULL, m, k, (float)norm_eps, normed);
    isa_matmul((int)v[1], (const uint8_t *)(uintptr_t)v[2], v[3], 24, k, normed, m, mix);
    fk_hc_pre(mix, x, (const float *)(uintptr_t)v[4], (const float *)(uintptr_t)v[5], m, n, (int)v[11], (float)eps,
              (float *)(uintptr_t)v[6], (float *)(uintptr_t)v[7], (float *)(uintptr_t)v[8]);
    Py_RETURN_NONE;
}

static PyObject *py_hc_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[7];
    if (!int_args("hc_post", args, nargs, 7, 0, 7, v)) return NULL;
    for (int i = 0; i < 5; i++)
        if (!v[i]) { PyErr_SetString(PyExc_ValueError, "hc_post: null pointer"); return NULL; }
    if (v[5] < 0 || v[6] < 1) {
        PyErr_SetString(PyExc_ValueError, "hc_post: bad row count or width");
        return NULL;
    }
    fk_hc_post((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], (const float *)(uintptr_t)v[2],
               (const float *)(uintptr_t)v[3], v[5], v[6], (float *)(uintptr_t)v[4]);
    Py_RETURN_NONE;
}

/* rms_norm(x, w, out, m, n, eps) (w may be 0) and swiglu_clamp(g, u, out, n, limit): the
 * same file's norm and activation */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (!int_args("rms_norm", args, nargs, 6, 0, 5, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[5]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    if (!v[0] || !v[2] || v[3] < 0 || v[4] < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: null pointer, bad row count or width");
        return NULL;
    }
    fk_rms_norm((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[3], v[4], (float)eps,
                (float *)(uintptr_t)v[2]);
    Py_RETURN_NONE;
}

static PyObject *py_swiglu_clamp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[4];
    if (!int_args("swiglu_clamp", args, nargs, 5, 0, 4, v)) return NULL;
    const double limit = PyFloat_AsDouble(args[4]);
    if (limit == -1.0 && PyErr_Occurred()) return NULL;
    if (!v[0] || !v[1] || !v[2] || v[3] < 0) {
        PyErr_SetString(PyExc_ValueError, "swiglu_clamp: null pointer or bad length");
        return NULL;
    }
    fk_swiglu_clamp((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[3], (float)limit,
                    (float *)(uintptr_t)v[2]);
    Py_RETURN_NONE;
}

/* rope_tail(x, m, heads, d, cs, n_rot, inverse): fk_rope_tail in place */
static PyObject *py_rope_tail(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[7];
    if (!int_args("rope_tail", args, nargs, 7, 0, 7, v)) return NULL;
    if (!v[0] || !v[4] || v[1] < 0 || v[2] < 1 || v[3] < 2 || v[5] < 2 || v[5] % 2 || v[5] > v[3] ||
        (v[6] != 0 && v[6] != 1)) {
        PyErr_SetString(PyExc_ValueError, "rope_tail: null pointer or bad shape");
        return NULL;
    }
    fk_rope_tail((float *)(uintptr_t)v[0], v[1], v[2], v[3], (const float *)(uintptr_t)v[4], v[5], (int)v[6]);
    Py_RETURN_NONE;
}

static thread_local void *qkv_buf;
static thread_local size_t qkv_cap;

/* the query row and the K=V cache row of one decode position (dsv4_qkv's arithmetic; shapes
 * checked by the caller): qr = rms_norm(ys0, q_a_norm); q = q_b(qr), each head RMS-normed and
 * its tail RoPE'd by cs; kv = rms_norm(ys1, kv_norm), its tail RoPE'd, stored f16 in raw.
 * False when the scratch row could not be had. */
static bool dsv4_qkv_core(const float *ys0, const float *ys1, const float *q_a_norm, const float *kv_norm, int qb_type,
                          const uint8_t *q_b, long long qb_rb, const float *cs, float *qr, float *q, uint16_t *raw,
                          long long rank, long long heads, long long hd, long long n_rot, float eps) {
    float *kv = (float *)scratch(&qkv_buf, &qkv_cap, (size_t)hd * sizeof(float));
    if (!kv) return false;
    fk_rms_norm(ys0, q_a_norm, 1, rank, eps, qr);
    isa_matmul(qb_type, q_b, qb_rb, heads * hd, rank, qr, 1, q);
    fk_rms_norm(q, NULL, heads, hd, eps, q);
    fk_rope_tail(q, 1, heads, hd, cs, n_rot, 0);
    fk_rms_norm(ys1, kv_norm, 1, hd, eps, kv);
    fk_rope_tail(kv, 1, 1, hd, cs, n_rot, 0);
    for (long long i = 0; i < hd; i++) raw[i] = fk_f2h_portable(kv[i]);
    return true;
}

/* dsv4_qkv(ys0, ys1, q_a_norm, kv_norm, qtype, q_b, row_bytes, cs, qr, q, raw_row, rank, heads,
 * hd, n_rot, eps): one decode row's query and K=V row, as the Python steps in turn:
 * qr = rms_norm(ys0, q_a_norm) [rank]; q = q_b qr, each head RMS-normed (no weight), its tail
 * RoPE'd by cs [n_rot / 2, 2]; kv = rms_norm(ys1, kv_norm) [hd], its tail RoPE'd, stored f16
 * (round to nearest even) at raw_row */
static PyObject *py_dsv4_qkv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[15];
    if (!int_args("dsv4_qkv", args, nargs, 16, 0, 15, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[15]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const long long rank = v[11], heads = v[12], hd = v[13], n_rot = v[14];
    for (int i = 0; i < 11; i++)
        if (i != 4 && !v[i]) { PyErr_SetString(PyExc_ValueError, "dsv4_qkv: null pointer"); return NULL; }
    if (!qkv_shape_ok(rank, heads, hd, n_rot) || !weight_ok(v[4], v[6], heads * hd, rank)) {
        PyErr_SetString(PyExc_ValueError, "dsv4_qkv: bad shape or weight");
        return NULL;
    }
    if (!dsv4_qkv_core((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], (const float *)(uintptr_t)v[2],
                       (const float *)(uintptr_t)v[3], (int)v[4], (const uint8_t *)(uintptr_t)v[5], v[6],
                       (const float *)(uintptr_t)v[7], (float *)(uintptr_t)v[8], (float *)(uintptr_t)v[9],
                       (uint16_t *)(uintptr_t)v[10], rank, heads, hd, n_rot, (float)eps))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* q8_0_grouped(w, g, rank, in, x, m, y): fk_q8_0_grouped; w holds g * rank Q8_0 rows of in */
static PyObject *py_q8_0_grouped(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[7];
    if (!int_args("q8_0_grouped", args, nargs, 7, 0, 7, v)) return NULL;
    if (!v[0] || !v[4] || !v[6] || v[1] < 1 || v[2] < 1 || v[3] < 32 || v[3] % 32 || v[5] < 1 ||
        v[1] * v[2] > (1LL << 24) || v[3] > (1LL << 24) || v[5] > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError, "q8_0_grouped: null pointer or bad shape");
        return NULL;
    }
    const long long work = v[1] * v[2] * v[3] * v[5];
    FK_CALL(work > 1000000, fk_q8_0_grouped((const uint8_t *)(uintptr_t)v[0], v[1], v[2], v[3],
                                            (const float *)(uintptr_t)v[4], v[5], (float *)(uintptr_t)v[6], g_threads,
                                            g_isa != &fk_isa_scalar));
    Py_RETURN_NONE;
}

/* dsv4_attend(q, H, d, raw, n_raw, comp, comp_len, rows, n_comp, sinks, out, scale): one query
 * row q [H, d] over DeepSeek-V4's keys (V = K): the raw window rows raw [n_raw, d] f16 and the
 * compressed rows comp[rows[j]] f16, each head's softmax with its sink logit; out [H, d].
 * The keys are gathered into one f16 block (every row index checked against comp_len before
 * a key is read) for the ISA's decode attention, one kv head shared by all H. */
static thread_local void *dsv4_buf;
static thread_local size_t dsv4_cap;

/* one query row q [H, d] over the raw rows raw [n_raw, d] and n_comp compressed rows of comp
 * (rows[j], or with rows NULL row j * ratio + ratio - 1), V = K, with the sinks: the keys
 * gathered into one f16 block for the ISA's decode attention. Every index checked by the
 * caller. False when the block could not be had. */
static bool dsv4_attend_core(const float *q, long long H, long long d, const uint16_t *raw, long long n_raw,
                             const uint16_t *comp, const int64_t *rows, long long n_comp, long long ratio,
                             const int64_t *blocks, const float *sinks, float scale, float *out) {
    uint16_t *keys = (uint16_t *)scratch(&dsv4_buf, &dsv4_cap, (size_t)((n_raw + n_comp) * d) * sizeof(uint16_t));
    if (!keys) return false;
    if (n_raw) memcpy(keys, raw, (size_t)(n_raw * d) * sizeof(uint16_t));
    for (long long j = 0; j < n_comp; j++) {
        const long long r = rows ? rows[j] : ((blocks ? blocks[j] : j) + 1) * ratio - 1;
        memcpy(keys + (n_raw + j) * d, comp + r * d, (size_t)d * sizeof(uint16_t));
    }
    fk_attn_args a;
    a.q = q;
    a.k = a.v = keys;
    a.out = out;
    a.n = n_raw + n_comp;
    a.row_stride = d;
    a.n_head = (int)H;
    a.kv_heads = 1;
    a.d = (int)d;
    a.scale = scale;
    a.nthreads = g_threads;
    a.pos0 = 0;
    a.sinks = sinks;
    g_isa->attn_decode(&a);
    return true;
}

static PyObject *py_dsv4_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    if (!int_args("dsv4_attend", args, nargs, 12, 0, 11, v)) return NULL;
    const double scale = PyFloat_AsDouble(args[11]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    const long long H = v[1], d = v[2], n_raw = v[4], comp_len = v[6], n_comp = v[8];
    const uint16_t *raw = (const uint16_t *)(uintptr_t)v[3], *comp = (const uint16_t *)(uintptr_t)v[5];
    const int64_t *rows = (const int64_t *)(uintptr_t)v[7];
    if (!v[0] || !v[9] || !v[10] || H < 1 || H > FK_ATTN_MAX_GROUP || d < 16 || d % 16 || d > FK_ATTN_MAX_D ||
        n_raw < 0 || n_comp < 0 || n_raw + n_comp < 1 || n_raw + n_comp > (1LL << 24) || (n_raw && !raw) ||
        (n_comp && (!comp || !rows))) {
        PyErr_SetString(PyExc_ValueError, "dsv4_attend: null pointer or bad shape");
        return NULL;
    }
    for (long long j = 0; j < n_comp; j++)
        if (rows[j] < 0 || rows[j] >= comp_len) {
            PyErr_Format(PyExc_ValueError, "dsv4_attend: compressed row %lld outside [0, %lld)", (long long)rows[j],
                         comp_len);
            return NULL;
        }
    if (!dsv4_attend_core((const float *)(uintptr_t)v[0], H, d, raw, n_raw, comp, rows, n_comp, 0, 0,
                          (const float *)(uintptr_t)v[9], (float)scale, (float *)(uintptr_t)v[10]))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* dsv4_attn_in(x, w_type, w, w_rb, n_in, rank, hd, q_a_norm, kv_norm, qb_type, q_b, qb_rb, cs, heads, n_rot,
 * raw_row, st_w, st_kv, st_sc, comp_ape, lid_w, lid_kv, lid_sc, idx_ape, n_idx, idx_out, qr, q, eps):
 * a deepseek4 decode row's attention input in one call. ys = w x, the layer's fused input
 * projections [rank | hd | st_w | st_w | lid_w | lid_w | n_idx] (q_a, kv, the compressor's kv and
 * score, the indexer compressor's kv and score, the indexer's head weights); then dsv4_qkv on
 * the first two (qr, q, the f16 K=V row at raw_row); the compressor state rows (kv as is,
 * score plus the position's ape row) when st_w (and lid_w) is not 0; the head weights into
 * idx_out when n_idx is not 0. Each part the separate calls' arithmetic. */
static thread_local void *attn_in_buf;
static thread_local size_t attn_in_cap;

static PyObject *py_dsv4_attn_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[28];
    if (!int_args("dsv4_attn_in", args, nargs, 29, 0, 28, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[28]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const long long n_in = v[4], rank = v[5], hd = v[6], heads = v[13], n_rot = v[14];
    const long long st_w = v[16], lid_w = v[20], n_idx = v[24];
    const int need[] = {0, 2, 7, 8, 10, 12, 15, 26, 27};
    for (int i : need)
        if (!v[i]) { PyErr_SetString(PyExc_ValueError, "dsv4_attn_in: null pointer"); return NULL; }
    if (!qkv_shape_ok(rank, heads, hd, n_rot) || st_w < 0 || st_w > (1LL << 20) || lid_w < 0 || lid_w > (1LL << 20) ||
        n_idx < 0 ||
        n_idx > 4096 || (st_w && (!v[17] || !v[18] || !v[19])) || (lid_w && (!v[21] || !v[22] || !v[23])) ||
        (n_idx && !v[25])) {
        PyErr_SetString(PyExc_ValueError, "dsv4_attn_in: bad shape or a missing state row");
        return NULL;
    }
    const long long n_out = rank + hd + 2 * st_w + 2 * lid_w + n_idx;
    if (!weight_ok(v[1], v[3], n_out, n_in) || !weight_ok(v[9], v[11], heads * hd, rank)) {
        PyErr_SetString(PyExc_ValueError, "dsv4_attn_in: a weight's type or shape does not match");
        return NULL;
    }
    float *ys = (float *)scratch(&attn_in_buf, &attn_in_cap, (size_t)n_out * sizeof(float));
    if (!ys) return PyErr_NoMemory();
    isa_matmul((int)v[1], (const uint8_t *)(uintptr_t)v[2], v[3], n_out, n_in, (const float *)(uintptr_t)v[0], 1, ys);
    if (!dsv4_qkv_core(ys, ys + rank, (const float *)(uintptr_t)v[7], (const float *)(uintptr_t)v[8], (int)v[9],
                       (const uint8_t *)(uintptr_t)v[10], v[11], (const float *)(uintptr_t)v[12],
                       (float *)(uintptr_t)v[26], (float *)(uintptr_t)v[27], (uint16_t *)(uintptr_t)v[15], rank, heads,
                       hd, n_rot, (float)eps))
        return PyErr_NoMemory();
    const float *y = ys + rank + hd;
    const long long widths[2] = {st_w, lid_w};
    for (int part = 0; part < 2; part++) {   /* the compressor's state, then the indexer compressor's */
        const long long w = widths[part];
        if (!w) continue;
        float *kv = (float *)(uintptr_t)v[17 + 4 * part], *sc = (float *)(uintptr_t)v[18 + 4 * part];
        const float *ape = (const float *)(uintptr_t)v[19 + 4 * part];
        memcpy(kv, y, (size_t)w * sizeof(float));
        for (long long i = 0; i < w; i++) sc[i] = y[w + i] + ape[i];
        y += 2 * w;
    }
    if (n_idx) memcpy((float *)(uintptr_t)v[25], y, (size_t)n_idx * sizeof(float));
    Py_RETURN_NONE;
}

/* dsv4_attn_out(q, H, d, raw, n_raw, comp, comp_len, ratio, n_vis, blocks, n_blocks, sinks, cs, n_rot, wo_a, g,
 * o_rank, wob_type, wo_b, wob_rb, n_embd, out, scale): a deepseek4 decode row's attention and
 * output in one call: the query q [H, d] over the raw rows and the compressed keys (blocks
 * [n_blocks] when the indexer chose, else all n_vis visible blocks; block b's key at row
 * (b + 1) ratio - 1 of comp, every index checked), the inverse RoPE of each head's tail by cs,
 * attn_output_a (Q8_0 rows, f32 activations, q8_0_grouped) and attn_output_b into out [n_embd]. */
static thread_local void *attn_out_buf;
static thread_local size_t attn_out_cap;

static PyObject *py_dsv4_attn_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[22];
    if (!int_args("dsv4_attn_out", args, nargs, 23, 0, 22, v)) return NULL;
    const double scale = PyFloat_AsDouble(args[22]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    const long long H = v[1], d = v[2], n_raw = v[4], comp_len = v[6], ratio = v[7], n_vis = v[8];
    const long long n_blocks = v[10], n_rot = v[13], g = v[15], o_rank = v[16], n_embd = v[20];
    const int64_t *blocks = (const int64_t *)(uintptr_t)v[9];
    const long long n_comp = ratio ? (blocks ? n_blocks : n_vis) : 0;
    if (!v[0] || !v[11] || !v[12] || !v[14] || !v[18] || !v[21] || H < 1 || H > FK_ATTN_MAX_GROUP || d < 16 ||
        d % 16 || d > FK_ATTN_MAX_D || n_raw < 0 || (n_raw && !v[3]) || ratio < 0 || ratio > (1LL << 24) || n_vis < 0 ||
        n_vis > (1LL << 24) || n_blocks < 0 ||
        n_comp < 0 || n_raw + n_comp < 1 || n_raw + n_comp > (1LL << 24) || (n_comp && !v[5]) || n_rot < 2 ||
        n_rot % 2 || n_rot > d || g < 1 || o_rank < 1 || (H * d) % g || (H * d / g) % 32 || g * o_rank > (1LL << 24) ||
        !weight_ok(v[17], v[19], n_embd, g * o_rank)) {
        PyErr_SetString(PyExc_ValueError, "dsv4_attn_out: null pointer or bad shape");
        return NULL;
    }
    for (long long j = 0; j < n_comp; j++) {   /* every compressed key's row inside comp */
        const long long b = blocks ? blocks[j] : j;
        if (b < 0 || b >= n_vis || (b + 1) * ratio - 1 >= comp_len) {
            PyErr_Format(PyExc_ValueError, "dsv4_attn_out: block %lld outside the %lld visible", b, n_vis);
            return NULL;
        }
    }
    float *h = (float *)scratch(&attn_out_buf, &attn_out_cap, (size_t)(H * d + g * o_rank) * sizeof(float));
    if (!h) return PyErr_NoMemory();
    float *mid = h + H * d;
    if (!dsv4_attend_core((const float *)(uintptr_t)v[0], H, d, (const uint16_t *)(uintptr_t)v[3], n_raw,
                          (const uint16_t *)(uintptr_t)v[5], NULL, n_comp, ratio, blocks, (const float *)(uintptr_t)v[11],
                          (float)scale, h))
        return PyErr_NoMemory();
    fk_rope_tail(h, 1, H, d, (const float *)(uintptr_t)v[12], n_rot, 1);
    fk_q8_0_grouped((const uint8_t *)(uintptr_t)v[14], g, o_rank, H * d / g, h, 1, mid, g_threads,
                    g_isa != &fk_isa_scalar);
    isa_matmul((int)v[17], (const uint8_t *)(uintptr_t)v[18], v[19], n_embd, g * o_rank, mid, 1,
               (float *)(uintptr_t)v[21]);
    Py_RETURN_NONE;
}

/* ---- the decoder layer step -----------------------------------------------------------
 * plan_schema() -> (plan fields, layer fields), each a tuple of (name, kind) in descriptor
 * order (fk_plan.h). plan_new(desc) -> capsule: desc is int64 slots, the plan's fields then
 * each layer's, filled by name from that schema (I/F 1 slot, V 1, W 5). Every setting and
 * weight shape is checked here, once; the vectors' lengths are checked by the caller. */
static const char *kPlanCapsule = "fucina.kernels.plan";

enum { FK_SLOTS_I = 1, FK_SLOTS_F = 1, FK_SLOTS_V = 1, FK_SLOTS_W = 8 };
#define FK_COUNT(kind, name) + FK_SLOTS_##kind
static const long long kPlanSlots = 0 FK_PLAN_FIELDS(FK_COUNT);
static const long long kLayerSlots = 0 FK_LAYER_FIELDS(FK_COUNT);

static PyObject *schema_tuple(const char *const *names, const char *kinds, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *e = Py_BuildValue("(sC)", names[i], kinds[i]);
        if (!e) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, e);
    }
    return t;
}

static PyObject *py_plan_schema(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#define FK_NAME(kind, name) #name,
#define FK_KIND(kind, name) #kind[0],
    static const char *const pn[] = {FK_PLAN_FIELDS(FK_NAME)}, *const ln[] = {FK_LAYER_FIELDS(FK_NAME)};
    static const char pk[] = {FK_PLAN_FIELDS(FK_KIND)}, lk[] = {FK_LAYER_FIELDS(FK_KIND)};
    PyObject *a = schema_tuple(pn, pk, (int)sizeof pk), *b = schema_tuple(ln, lk, (int)sizeof lk);
    if (!a || !b) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    return Py_BuildValue("(NN)", a, b);
}

static const long long *read_I(const long long *u, int64_t *out) { *out = u[0]; return u + 1; }
static const long long *read_F(const long long *u, double *out) { memcpy(out, u, 8); return u + 1; }
static const long long *read_V(const long long *u, const float **out) {
    *out = (const float *)(uintptr_t)u[0];
    return u + 1;
}
static const long long *read_W(const long long *u, fk_lin *w) {
    w->qtype = (int)u[0];
    w->w = (const uint8_t *)(uintptr_t)u[1];
    w->rb = u[2];
    w->n = u[3];
    w->k = u[4];
    w->lora_a = (const float *)(uintptr_t)u[5];
    w->lora_b = (const float *)(uintptr_t)u[6];
    w->lora_r = u[7];
    return u + 8;
}
#define FK_READ(kind, name) u = read_##kind(u, &y->name);

/* a weight's LoRA: none (rank 0, no pointers), or both factors of a rank in range on a present weight */
static int lora_ok(const fk_lin *w) {
    if (w->lora_r == 0) return !w->lora_a && !w->lora_b;
    return w->w && w->lora_a && w->lora_b && w->lora_r >= 1 && w->lora_r <= FK_LORA_MAX_R;
}
#define FK_LORA_OK_I(name)
#define FK_LORA_OK_F(name)
#define FK_LORA_OK_V(name)
#define FK_LORA_OK_W(name) &&lora_ok(&y->name)
#define FK_LORA_OK(kind, name) FK_LORA_OK_##kind(name)

/* a present weight of shape [n, k] in a format with a native route */
static int lin_ok(const fk_lin *w, int64_t n, int64_t k) {
    long bs, ts;
    return w->w && type_block(w->qtype, &bs, &ts) && w->n == n && w->k == k && k % bs == 0 && w->rb == k / bs * ts;
}

/* one fused weight [sum of parts, k] or every part, never a mix */
static int fused_or_parts(const fk_lin *fused, const fk_lin *const *parts, const int64_t *ns, int n_parts, int64_t k) {
    int64_t total = 0;
    for (int j = 0; j < n_parts; j++) total += ns[j];
    if (fused->w) {
        for (int j = 0; j < n_parts; j++)
            if (parts[j]->w) return 0;
        return lin_ok(fused, total, k);
    }
    for (int j = 0; j < n_parts; j++)
        if (!lin_ok(parts[j], ns[j], k)) return 0;
    return 1;
}

/* an expert stack whose experts start every `step` rows (moe_impl.inc moe_expert: at e x step
 * x rb, or where the expert store's table says): GGML rows, or row groups (FK_Q4K_X16,
 * FK_Q6K_X16, FK_TQ2_X8 and kin) where every expert is whole groups, so its rows are a layout
 * of their own at its offset (the store packs each expert's rows so: kernels.stream_layout) */
static int stack_ok(const fk_lin *w, int64_t step) {
    if (w->qtype < FK_PTQTP_BASE) return 1;
    const int64_t g = fk_group_rows(w->qtype);
    return g && step % g == 0;
}

/* a MoE ffn's settings and weights (moe_impl.inc) */
static int moe_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t NE = y->n_expert, K = y->n_expert_used, M = y->n_ff_exp, E = y->routed_down.w ? y->routed_down.n : p->n_embd;
    const int64_t S = y->exps_stride ? y->exps_stride : M;   /* fk_plan.h exps_stride */
    return NE >= 1 && NE <= (1 << 20) && K >= 1 && K <= NE && M >= 1 && (y->moe_norm == 0 || y->moe_norm == 1) &&
           S >= M && S <= (1LL << 30) && (!y->exps_stride || !y->moe_table) &&
           y->moe_scale >= 0.0 && y->moe_scale < 1e30 && lin_ok(&y->gate_inp, NE, p->n_embd) &&
           lin_ok(&y->gate_exps, (NE - 1) * S + M, E) && lin_ok(&y->up_exps, (NE - 1) * S + M, E) && lin_ok(&y->down_exps, NE * E, M) &&
           (y->moe_table == 0 || y->moe_hook != 0) &&   /* the step checks the table's entries after the hook */
           !y->gate_exps.lora_r && !y->up_exps.lora_r && !y->down_exps.lora_r &&   /* no LoRA on expert stacks */
           stack_ok(&y->gate_exps, S) && stack_ok(&y->up_exps, S) && stack_ok(&y->down_exps, E);
}

/* a MoE ffn's shared expert (moe_shared_impl.inc): the dense ffn's weights, all or none;
 * its gate and norm only with it (the vectors' lengths are the caller's check) */
static int moe_shared_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t F = y->layer_ff ? y->layer_ff : p->n_ff;
    const fk_lin *gu[2] = {&y->gate, &y->up};
    const int64_t ngu[2] = {F, F};
    if (!y->down.w) return !y->gate_up.w && !y->gate.w && !y->up.w && !y->shexp_gate && !y->shexp_norm;
    return fused_or_parts(&y->gate_up, gu, ngu, 2, p->n_embd) && lin_ok(&y->down, p->n_embd, F);
}

/* a DeltaNet mixer's settings and weights (fk_delta.h) */
static int delta_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t hk = y->ssm_hk, hv = y->ssm_hv, dk = y->ssm_dk, dv = y->ssm_dv, E = p->n_embd;
    if (hk < 1 || hv < 1 || hv % hk || hv > 4096 || dk < 1 || dk > 1024 || dv < 1 || dv > 1024 || y->d_conv < 2 ||
        y->d_conv > 64 || !y->conv_w || !y->dt_bias || !y->ssm_a || !y->ssm_norm || !y->attn_norm || !y->ffn_norm)
        return 0;
    const fk_lin *in[4] = {&y->ssm_qkv, &y->ssm_z, &y->ssm_beta, &y->ssm_alpha};
    const int64_t n_in[4] = {2 * hk * dk + hv * dv, hv * dv, hv, hv};
    return fused_or_parts(&y->ssm_in, in, n_in, 4, E) && lin_ok(&y->ssm_out, E, hv * dv);
}

/* a KDA mixer's settings and weights (fk_kda.h): square heads, the low-rank gate pairs, the
 * DeltaNet layer's conv and norms; the gate form one fk_kda.h knows */
static int kda_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t H = y->ssm_hv, dk = y->ssm_dk, di = H * dk, rf = y->ssm_f_b.k, rg = y->ssm_g_b.k, E = p->n_embd;
    const int full = !y->ssm_g_b.w;   /* kimi-k3's full-rank output gate (fk_kda.h) */
    const int gate_ok = y->kda_gate == FK_KDA_GATE_SOFTPLUS ? y->kda_bound == 0.0
                        : y->kda_gate == FK_KDA_GATE_LOWER_BOUND && y->kda_bound > -1e30 && y->kda_bound < 0.0;
    if (!gate_ok || H < 1 || H > 4096 || y->ssm_hk != H || dk < 1 || dk > 1024 ||
        y->ssm_dv != dk || y->d_conv < 2 || y->d_conv > 64 || !y->conv_w || !y->dt_bias || !y->ssm_a ||
        !y->ssm_norm || !y->attn_norm || !y->ffn_norm || y->kv_from || y->ssm_z.w || y->ssm_alpha.w || rf < 1 ||
        rf > di || (!full && (rg < 1 || rg > di)))
        return 0;
    const fk_lin *in[4] = {&y->ssm_qkv, &y->ssm_f_a, &y->ssm_g_a, &y->ssm_beta};
    const fk_lin *in_full[4] = {&y->ssm_qkv, &y->ssm_f_a, &y->ssm_beta, &y->ssm_g_a};
    const int64_t n_in[4] = {3 * di, rf, rg, H}, n_full[4] = {3 * di, rf, H, di};
    return (full ? fused_or_parts(&y->ssm_in, in_full, n_full, 4, E) && (y->ssm_in.w || lin_ok(&y->ssm_g_a, di, E))
                 : fused_or_parts(&y->ssm_in, in, n_in, 4, E) && lin_ok(&y->ssm_g_b, di, rg)) &&
           lin_ok(&y->ssm_f_b, di, rf) && lin_ok(&y->ssm_out, E, di);
}

/* another mixer's layer leaves the KDA fields empty */
static int kda_absent(const fk_layer *y) {
    return y->mixer == FK_MIXER_KDA || (!y->kda_gate && y->kda_bound == 0.0 && !y->ssm_f_a.w && !y->ssm_f_b.w &&
                                        !y->ssm_g_a.w && !y->ssm_g_b.w);
}

/* kimi-k3's fields (fk_plan.h FK_K3_FIELDS): the MLA gate on an MLA mixer, the latent experts
 * (routed_down and routed_up together, the norm only with them) on a MoE ffn, SiTU's betas
 * with act FK_ACT_SITU (beta nonzero), the residual scores in pairs and the bank flag 0 or 1
 * (the vectors' lengths: kernels.DecoderPlan) */
static int k3_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t E = p->n_embd;
    if (y->mla_gate.w && (y->mixer != FK_MIXER_MLA || !lin_ok(&y->mla_gate, y->n_head * y->mla_v, E))) return 0;
    if (y->routed_down.w || y->routed_up.w || y->routed_norm) {
        const int64_t lat = y->routed_down.n;
        if (y->ffn != FK_FFN_MOE || !y->routed_down.w || lat < 1 || lat > (1 << 20) || !lin_ok(&y->routed_down, lat, E) ||
            !lin_ok(&y->routed_up, E, lat) || y->moe_table || y->moe_in_norm || y->exps_stride)
            return 0;
    }
    const int situ = p->act == FK_ACT_SITU;
    if (situ ? !(y->situ_beta != 0.0 && y->situ_beta > -1e30 && y->situ_beta < 1e30 && y->situ_lbeta > -1e30 &&
                 y->situ_lbeta < 1e30)
             : y->situ_beta != 0.0 || y->situ_lbeta != 0.0)
        return 0;
    return (y->res_bank == 0 || y->res_bank == 1) && (!y->attn_res_score) == (!y->ffn_res_score) &&
           (!y->res_bank || y->attn_res_score) && (!y->out_res_score || y->attn_res_score);
}

/* an MLA mixer's settings and weights (mla_impl.inc): one q path, the stacked heads of k_b
 * and v_b (no LoRA on those: the step reads them a head at a time), the rope width the plan's */
static int mla_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t H = y->n_head, R = y->mla_rank, N = y->mla_nope, PR = y->mla_rope, V = y->mla_v, E = p->n_embd;
    const int64_t QW = H * (N + PR);
    if (H < 1 || H > 4096 || R < 1 || R > 8192 || N < 1 || N > 1024 || PR < 2 || PR % 2 || PR > 1024 || V < 1 ||
        V > 1024 || (y->layer_rot ? y->layer_rot : p->n_rot) != PR || (y->rope != 0 && y->rope != 1) || y->window ||
        y->kv_from || y->q_gate || y->qkv_bias || y->q_norm || y->k_norm || y->v_norm || y->attn_sinks || y->wo_bias ||
        y->wqkv.w || y->wk.w || y->wv.w || !y->attn_norm || !y->ffn_norm || !y->kv_a_norm ||
        y->k_b.lora_r || y->v_b.lora_r)
        return 0;
    const int q_ok = y->q_a.w ? !y->wq.w && y->q_a_norm && y->q_a.n >= 1 && lin_ok(&y->q_a, y->q_a.n, E) &&
                                    lin_ok(&y->q_b, QW, y->q_a.n)
                              : !y->q_b.w && !y->q_a_norm && lin_ok(&y->wq, QW, E);
    return q_ok && lin_ok(&y->kv_a, R + PR, E) && lin_ok(&y->k_b, H * R, N) && lin_ok(&y->v_b, H * V, R) &&
           lin_ok(&y->wo, E, H * V);
}

/* another mixer's layer leaves the MLA fields empty */
static int mla_absent(const fk_layer *y) {
    return y->mixer == FK_MIXER_MLA || (!y->mla_rank && !y->mla_nope && !y->mla_rope && !y->mla_v && !y->q_a.w &&
                                        !y->q_a_norm && !y->q_b.w && !y->kv_a.w && !y->kv_a_norm && !y->k_b.w && !y->v_b.w);
}

/* the widths a layer's step writes: its projection row and its mixer output row */
static void layer_widths(const fk_layer *y, int64_t *proj, int64_t *out) {
    if (y->mixer == FK_MIXER_MLA) {   /* mla_impl.inc has its own scratch */
        *out = *proj = 0;
        return;
    }
    if (y->mixer == FK_MIXER_KDA) {   /* the row fk_kda.h lays out; the gates' inputs packed in out */
        int64_t ob, og, od;
        fk_kda_layout(y, &ob, &og, &od, proj);
        const int64_t di = y->ssm_hv * y->ssm_dk, r = y->ssm_f_b.k > y->ssm_g_b.k ? y->ssm_f_b.k : y->ssm_g_b.k;
        *out = di > r ? di : r;
        return;
    }
    if (y->mixer == FK_MIXER_DELTA) {
        *out = y->ssm_hv * y->ssm_dv;
        *proj = 2 * y->ssm_hk * y->ssm_dk + 2 * *out + 2 * y->ssm_hv;
        return;
    }
    *out = y->n_head * y->head_dim;
    *proj = (y->q_gate ? 2 : 1) * *out + 2 * y->n_kv * y->head_dim;
}

/* gemma4's layer fields (fk_plan.h): layer i's K/V source is an earlier layer of its
 * geometry that stores its own; the per-layer input weights present iff the plan has n_ple */
static int gemma4_ok(const fk_plan *p, const fk_layer *layers, int64_t i) {
    const fk_layer *y = layers + i;
    const int64_t E = p->n_embd, NP = p->n_ple;
    if (y->layer_ff < 0 || y->layer_ff > p->n_ff || y->kv_from < 0 || y->kv_from > i) return 0;
    if (y->kv_from) {
        const fk_layer *s = layers + y->kv_from - 1;
        if (s->kv_from || s->mixer != FK_MIXER_ATTENTION || y->mixer != FK_MIXER_ATTENTION || s->n_kv != y->n_kv || s->head_dim != y->head_dim || s->window != y->window || y->wqkv.w ||
            y->wk.w || y->wv.w || !lin_ok(&y->wq, y->n_head * y->head_dim, E))
            return 0;
    }
    return NP ? lin_ok(&y->ple_gate, NP, E) && lin_ok(&y->ple_proj, E, NP) && y->ple_norm
              : !y->ple_gate.w && !y->ple_proj.w && !y->ple_norm;
}

/* gpt-oss's fields (fk_plan.h): sinks and the output bias on an attention mixer, the router
 * and expert biases and the gating flag on a MoE ffn (the vectors' lengths: kernels.DecoderPlan) */
static int gptoss_ok(const fk_layer *y) {
    const int moe = y->ffn == FK_FFN_MOE, att = y->mixer == FK_MIXER_ATTENTION;
    return (y->moe_weight_softmax == 0 || (moe && y->moe_weight_softmax == 1)) && (att || (!y->attn_sinks && !y->wo_bias)) &&
           (moe || (!y->gate_inp_b && !y->gate_exps_b && !y->up_exps_b && !y->down_exps_b));
}

/* sigmoid routing and the selection bias (fk_plan.h FK_MOE_SIGMOID_FIELDS): a MoE ffn's, not
 * with gpt-oss's gating (the bias's length: kernels.DecoderPlan) */
static int moe_sigmoid_ok(const fk_layer *y) {
    if (y->moe_sigmoid == 0 && !y->exp_probs_b) return 1;
    return (y->moe_sigmoid == 0 || y->moe_sigmoid == 1) && y->ffn == FK_FFN_MOE && !y->moe_weight_softmax;
}

/* deepseek4's fields (fk_plan.h FK_DSV4_FIELDS): its gating on a MoE ffn, not with another's;
 * the hash table only with it, each entry an expert id (read once here, before any step);
 * the clamps finite, nonzero only with act FK_ACT_SWIGLU_CLAMP */
static int dsv4_ok(const fk_plan *p, const fk_layer *y, int ffn_ok) {
    const int clamp = p->act == FK_ACT_SWIGLU_CLAMP;
    if (!(y->clamp_exp >= 0.0 && y->clamp_exp < 1e30 && y->clamp_shexp >= 0.0 && y->clamp_shexp < 1e30) ||
        (!clamp && (y->clamp_exp != 0.0 || y->clamp_shexp != 0.0)) || (y->moe_sqrt_softplus != 0 && y->moe_sqrt_softplus != 1))
        return 0;
    if (y->moe_sqrt_softplus && (y->ffn != FK_FFN_MOE || y->moe_sigmoid || y->moe_weight_softmax || y->gate_inp_b))
        return 0;
    if (!y->tid2eid) return y->tid_vocab == 0;
    if (!ffn_ok || !y->moe_sqrt_softplus || y->tid_vocab < 1 || y->tid_vocab > (1LL << 26)) return 0;
    const int32_t *t = (const int32_t *)(uintptr_t)y->tid2eid;
    for (int64_t i = 0; i < y->tid_vocab * y->n_expert_used; i++)
        if (t[i] < 0 || t[i] >= y->n_expert) return 0;
    return 1;
}

static int layer_ok(const fk_plan *p, const fk_layer *y) {
    const int64_t H = y->n_head, KV = y->n_kv, D = y->head_dim, E = p->n_embd, F = y->layer_ff ? y->layer_ff : p->n_ff;
    const fk_lin *gu[2] = {&y->gate, &y->up};
    const int64_t ngu[2] = {F, F};
    const int ffn_ok = y->ffn == FK_FFN_MOE ? moe_ok(p, y) && moe_shared_ok(p, y)
                                            : y->ffn == FK_FFN_DENSE && fused_or_parts(&y->gate_up, gu, ngu, 2, E) &&
                                                  lin_ok(&y->down, E, F);
    if (!dsv4_ok(p, y, ffn_ok)) return 0;
    if (y->mixer == FK_MIXER_NONE)   /* its ffn only: no mixer weight, no hook around a mixer */
        return ffn_ok && y->ffn == FK_FFN_MOE && !y->wqkv.w && !y->wq.w && !y->wk.w && !y->wv.w && !y->wo.w &&
               !y->ssm_in.w && !y->ssm_qkv.w && !y->ssm_out.w && !y->res_hook && !y->res_bank && !y->attn_res_score &&
               !y->ple_gate.w && !y->kv_from;
    if (y->mixer == FK_MIXER_DELTA) return ffn_ok && !y->kv_from && delta_ok(p, y);
    if (y->mixer == FK_MIXER_MLA) return ffn_ok && mla_ok(p, y);
    if (y->mixer == FK_MIXER_KDA) return ffn_ok && kda_ok(p, y);
    if (y->mixer != FK_MIXER_ATTENTION || (y->q_gate != 0 && y->q_gate != 1) || (y->ffn != FK_FFN_DENSE && y->ffn != FK_FFN_MOE) || H < 1 || KV < 1 || H % KV ||
        H / KV > FK_ATTN_MAX_GROUP || D < 16 || D % 16 || D > FK_ATTN_MAX_D || (y->layer_rot ? y->layer_rot : p->n_rot) > D ||
        y->layer_rot < 0 || y->layer_rot % 2 ||
        (y->rope != 0 && y->rope != 1) || y->window < 0 || y->window > (1LL << 30) || !y->attn_norm || !y->ffn_norm)
        return 0;
    const fk_lin *qkv[3] = {&y->wq, &y->wk, &y->wv};
    const int64_t nqkv[3] = {(y->q_gate ? 2 : 1) * H * D, KV * D, KV * D};
    return (y->kv_from || fused_or_parts(&y->wqkv, qkv, nqkv, 3, E)) && lin_ok(&y->wo, E, H * D) && ffn_ok;
}

static void plan_free(PyObject *cap) {
    fk_plan *p = (fk_plan *)PyCapsule_GetPointer(cap, kPlanCapsule);
    if (p) {
        free(p->layers);
        free(p);
    }
}

static PyObject *py_plan_new(PyObject *self, PyObject *args) {
    (void)self;
    const char *ib;
    Py_ssize_t il;
    if (!PyArg_ParseTuple(args, "y#", &ib, &il)) return NULL;
    if (il % 8 || il / 8 < kPlanSlots) {
        PyErr_SetString(PyExc_ValueError, "plan: malformed descriptor");
        return NULL;
    }
    fk_plan head;
    const long long *u = (const long long *)ib;
    {
        fk_plan *y = &head;
        FK_PLAN_FIELDS(FK_READ)
    }
    const long long L = head.n_layer;
    if (L < 1 || L > 4096 || il / 8 != kPlanSlots + L * kLayerSlots || head.n_embd < 1 || head.n_embd > (1 << 20) ||
        head.n_ff < 1 || head.n_ff > (1 << 22) || head.n_rot < 2 || head.n_rot % 2 || (head.neox != 0 && head.neox != 1) ||
        (head.act != FK_ACT_SILU && head.act != FK_ACT_GELU_TANH && head.act != FK_ACT_SWIGLU_OAI && head.act != FK_ACT_SITU &&
         head.act != FK_ACT_SWIGLU_CLAMP) || !(head.eps > 0.0) || !(head.scale > 0.0) ||
        head.n_ple < 0 || head.n_ple > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "plan: inconsistent model dimensions");
        return NULL;
    }
    fk_plan *p = (fk_plan *)calloc(1, sizeof(fk_plan));
    fk_layer *layers = (fk_layer *)calloc((size_t)L, sizeof(fk_layer));
    if (!p || !layers) {
        free(p);
        free(layers);
        return PyErr_NoMemory();
    }
    *p = head;
    p->layers = layers;
    int64_t n_bank = 0, n_none = 0;
    for (long long i = 0; i < L; i++) {
        fk_layer *y = layers + i;
        FK_LAYER_FIELDS(FK_READ)
        if (!layer_ok(p, y) || !gemma4_ok(p, layers, i) || !gptoss_ok(y) || !moe_sigmoid_ok(y) || !mla_absent(y) || !kda_absent(y) || !k3_ok(p, y) || !(1 FK_LAYER_FIELDS(FK_LORA_OK)) ||
            (y->res_hook == 0) != (y->res_hook_ctx == 0)) {
            free(layers);
            free(p);
            PyErr_Format(PyExc_ValueError, "plan: layer %lld has inconsistent weights or settings", i);
            return NULL;
        }
        int64_t nq, nqkv;
        n_bank += y->res_bank;
        if (n_bank > FK_RES_MAX) {
            free(layers);
            free(p);
            PyErr_Format(PyExc_ValueError, "plan: more than %d banked layers", FK_RES_MAX);
            return NULL;
        }
        n_none += y->mixer == FK_MIXER_NONE;
        layer_widths(y, &nqkv, &nq);
        if (nq > p->max_q) p->max_q = nq;
        if (nqkv > p->max_qkv) p->max_qkv = nqkv;
    }
    /* an ffn-only plan is all FK_MIXER_NONE layers; the clamped act is its alone */
    p->ffn_only = n_none > 0;
    if ((n_none && n_none != L) || (p->act == FK_ACT_SWIGLU_CLAMP && !n_none)) {
        free(layers);
        free(p);
        PyErr_SetString(PyExc_ValueError, "plan: an ffn-only plan (mixer none, act swiglu_clamp) mixes with no other layer");
        return NULL;
    }
    PyObject *cap = PyCapsule_New(p, kPlanCapsule, plan_free);
    if (!cap) {
        free(layers);
        free(p);
    }
    return cap;
}

/* the ISA in force runs every layer (ffn 0) or one layer's ffn (ffn 1) of the plan, the GIL released */
static int run_step(fk_step_args *a, int ffn) {
    a->nthreads = g_threads;
    a->prefill = prefill_for_isa();
    a->matmul = g_isa->matmul;
    a->status = 0;
    const fk_isa *isa = g_isa;
    Py_BEGIN_ALLOW_THREADS
    if (ffn)
        isa->ffn(a);
    else
        isa->step(a);
    Py_END_ALLOW_THREADS
    return a->status;
}

/* the common head of step / step_batch: the plan, x and m, the RoPE tables (args 5..8) */
static int step_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, long long *v, fk_step_args *a) {
    if (!int_args(fn, args, nargs, 9, 1, 8, v)) return 0;
    const fk_plan *p = (const fk_plan *)PyCapsule_GetPointer(args[0], kPlanCapsule);
    if (!p) return 0;
    a->plan = p;
    a->x = (float *)(uintptr_t)v[0];
    a->m = v[1];
    a->cis[0] = (const float *)(uintptr_t)v[4];
    a->cis_len[0] = v[5];
    a->cis[1] = (const float *)(uintptr_t)v[6];
    a->cis_len[1] = v[7];
    return 1;
}

/* m rows at positions pos.. fit every layer of the cache table kv: each write lands in
 * [base, base + rows), each read starts at or after base, the RoPE tables reach */
static int rows_fit(const fk_step_args *a, const int64_t *kv, int64_t pos, int64_t m) {
    const fk_plan *p = a->plan;
    for (int l = 0; l < p->n_layer; l++) {
        const int64_t *e = kv + (p->layers[l].kv_from ? p->layers[l].kv_from - 1 : l) * FK_KV_ENTRY;
        if (p->layers[l].mixer == FK_MIXER_DELTA || p->layers[l].mixer == FK_MIXER_KDA) {   /* window, state, snapshot slots, keep <= m */
            if (!e[0] || !e[1] || e[3] < 0 || e[3] > m || (e[3] && !e[2])) return 0;
            for (int64_t j = 0; j < e[3]; j++)
                if (!((const int64_t *)(uintptr_t)e[2])[j]) return 0;
            continue;
        }
        const int64_t w = p->layers[l].window, base = e[2], first_read = w > 0 && pos - w + 1 > 0 ? pos - w + 1 : 0;
        const int t = (int)p->layers[l].rope;
        if (!e[0] || !e[1] || base < 0 || e[3] < 1 || pos < base || pos + m - base > e[3] || first_read < base ||
            !a->cis[t] || a->cis_len[t] < pos + m)
            return 0;
    }
    return 1;
}

/* step(plan, x_ptr, m, pos0, kv_table, ...): m rows of one stream at pos0.. */
static int block_rows(fk_step_args *a, const long long *v) {
    a->pos0 = v[2];
    a->kv = (const int64_t *)(uintptr_t)v[3];
    a->row_pos = NULL;
    a->row_kv = NULL;
    return a->x && a->kv && a->m >= 1 && a->pos0 >= 0 && a->m <= (1LL << 24) && rows_fit(a, a->kv, a->pos0, a->m);
}

/* step_batch(plan, x_ptr, m, row_kv, row_pos, ...): row i is one token of its own stream, at
 * position row_pos[i] of the cache whose table is row_kv[i * n_layer * FK_KV_ENTRY ..] */
static int batch_rows(fk_step_args *a, const long long *v) {
    a->row_kv = (const int64_t *)(uintptr_t)v[2];
    a->row_pos = (const int64_t *)(uintptr_t)v[3];
    a->pos0 = 0;
    a->kv = NULL;
    int ok = a->x && a->row_kv && a->row_pos && a->m >= 1 && a->m <= (1 << 16);
    for (int64_t i = 0; ok && i < a->m; i++)
        ok = a->row_pos[i] >= 0 && rows_fit(a, a->row_kv + i * a->plan->n_layer * FK_KV_ENTRY, a->row_pos[i], 1);
    return ok;
}

/* the two entries of the step: (plan, x, m, two slots read by `rows`, cis0, cis0_len, cis1, cis1_len) */
static PyObject *step_entry(const char *fn, const char *what, int (*rows)(fk_step_args *, const long long *),
                            PyObject *const *args, Py_ssize_t nargs) {
    long long v[8];
    fk_step_args a = {};
    if (!step_args(fn, args, nargs, v, &a)) return NULL;
    if (a.plan->ffn_only) {
        PyErr_Format(PyExc_ValueError, "%s: an ffn-only plan has no layer step", fn);
        return NULL;
    }
    if (!rows(&a, v)) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent positions, %s or RoPE table", fn, what);
        return NULL;
    }
    const int status = run_step(&a, 0);
    if (status == -2) {
        PyErr_Format(PyExc_ValueError, "%s: a residual hook refused the call (not bound to these rows)", fn);
        return NULL;
    }
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return step_entry("step", "cache", block_rows, args, nargs);
}

static PyObject *py_step_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return step_entry("step_batch", "caches", batch_rows, args, nargs);
}

/* ffn(plan, layer, x_ptr, m, out_ptr, ids_ptr): out [m, n_embd] = layer's ffn over the rows
 * x [m, n_embd] of an ffn-only plan; ids_ptr (int64 [m], 0: none) the rows' token ids,
 * required by a hash-routed layer and checked against its table before any is read */
static PyObject *py_ffn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (!int_args("ffn", args, nargs, 6, 1, 5, v)) return NULL;
    const fk_plan *p = (const fk_plan *)PyCapsule_GetPointer(args[0], kPlanCapsule);
    if (!p) return NULL;
    fk_step_args a = {};
    a.plan = p;
    a.layer = v[0];
    a.x = (float *)(uintptr_t)v[1];
    a.m = v[2];
    a.out = (float *)(uintptr_t)v[3];
    a.ids = (const int64_t *)(uintptr_t)v[4];
    if (!p->ffn_only || a.layer < 0 || a.layer >= p->n_layer || !a.x || !a.out || a.m < 1 || a.m > (1LL << 24)) {
        PyErr_SetString(PyExc_ValueError, "ffn: not an ffn-only plan, a layer out of range, or bad rows");
        return NULL;
    }
    const fk_layer *L = p->layers + a.layer;
    if (L->tid2eid) {
        if (!a.ids) {
            PyErr_Format(PyExc_ValueError, "ffn: layer %lld routes by token id and got no ids", (long long)a.layer);
            return NULL;
        }
        for (int64_t i = 0; i < a.m; i++)
            if (a.ids[i] < 0 || a.ids[i] >= L->tid_vocab) {
                PyErr_Format(PyExc_ValueError, "ffn: token id %lld outside the table's [0, %lld)", (long long)a.ids[i],
                             (long long)L->tid_vocab);
                return NULL;
            }
    } else {
        a.ids = NULL;
    }
    if (run_step(&a, 1)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* dequant_rows(qtype, w_ptr, row_bytes, n, k, ids_ptr, count, out_ptr): out[i] = row ids[i] */
static PyObject *py_dequant_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[8];
    if (!int_args("dequant_rows", args, nargs, 8, 0, 8, v)) return NULL;
    long bs, ts;
    const uint8_t *w = (const uint8_t *)(uintptr_t)v[1];
    const int64_t *ids = (const int64_t *)(uintptr_t)v[5];
    float *out = (float *)(uintptr_t)v[7];
    const long long rb = v[2], n = v[3], k = v[4], count = v[6];
    if (v[0] > FK_PTQTP_BASE || !type_block(v[0], &bs, &ts) || !w || !ids || !out || n <= 0 || k <= 0 ||
        k % bs || rb != k / bs * ts || count < 0 || k > (1LL << 28)) {
        PyErr_SetString(PyExc_ValueError, "dequant_rows: inconsistent shapes or null pointer");
        return NULL;
    }
    for (long long i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) {
            PyErr_Format(PyExc_ValueError, "dequant_rows: row %lld out of range [0, %lld)", (long long)ids[i], n);
            return NULL;
        }
    for (long long i = 0; i < count; i++) g_isa->dequant_row((int)v[0], w + ids[i] * rb, k, out + i * k);
    Py_RETURN_NONE;
}

/* The 16-row group layouts of two-block units (kernels._PAIR_FIELDS, generic/x16n_impl.inc,
 * q80x16_impl.inc): a block's bytes, whether column 0 holds the two blocks' f16 d side by
 * side, then per field its byte offset in the block, dword count, first column for block 0,
 * column step to block 1 and transform (0 none, 1 each byte ^ 0x80, 2 Q5's qh bit transpose) */
struct fk_pair_field { int off, nc, c0, step, kind; };
struct fk_pair_layout { int bb, dpair, nf; fk_pair_field f[3]; };
static int pair_layout(long t, fk_pair_layout *L) {
    switch (t) {
    case FK_Q4_0: case FK_IQ4_NL: *L = {18, 1, 1, {{2, 4, 1, 4, 0}}}; return 1;
    case FK_Q4_1: *L = {20, 0, 2, {{0, 1, 0, 1, 0}, {4, 4, 2, 4, 0}}}; return 1;
    case FK_Q5_0: *L = {22, 1, 2, {{2, 1, 1, 1, 2}, {6, 4, 3, 4, 0}}}; return 1;
    case FK_Q5_1: *L = {24, 0, 3, {{0, 1, 0, 1, 0}, {4, 1, 2, 1, 2}, {8, 4, 4, 4, 0}}}; return 1;
    case FK_Q8_0: *L = {34, 1, 1, {{2, 8, 1, 8, 1}}}; return 1;
    }
    return 0;
}

/* Q5's qh word, bit-transposed: the fifth bit of element e = 16 s + 4 i + t at 8 t + 4 s + i;
 * per byte j of the word, the bits its value sets (filled at module init) */
static uint32_t qh_bits[4][256];
static void qh_bits_init(void) {
    for (int j = 0; j < 4; j++)
        for (int v = 0; v < 256; v++) {
            uint32_t w = 0;
            for (int b = 0; b < 8; b++) {
                const int e = 8 * j + b;
                if (v >> b & 1) w |= 1u << (8 * (e % 4) + 4 * (e / 16) + e % 16 / 4);
            }
            qh_bits[j][v] = w;
        }
}

/* dwords 0 .. nc of 16 rows (row r at in + r rb) as nc columns (dword e of row r at 64 e + 4 r),
 * each byte ^ flip */
static void rows_to_cols(const uint8_t *in, long long rb, long long nc, uint8_t flip, uint8_t *out) {
    long long e = 0;
#if defined(__SSE2__)
    /* 4 x 4 dword transposes: 1.15-1.6x the rate of 4-byte copies (Intel Xeon) */
    const __m128i f = _mm_set1_epi8((char)flip);
    for (; e + 4 <= nc; e += 4)
        for (int r = 0; r < 16; r += 4) {
            const uint8_t *i0 = in + r * rb + 4 * e;
            const __m128i a0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)i0), f),
                          a1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(i0 + rb)), f),
                          a2 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(i0 + 2 * rb)), f),
                          a3 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(i0 + 3 * rb)), f);
            const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3),
                          t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
            uint8_t *o = out + 64 * e + 4 * r;
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + 64), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + 128), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(o + 192), _mm_unpackhi_epi64(t2, t3));
        }
#endif
    for (int r = 0; r < 16; r++)
        for (long long c = e; c < nc; c++) {
            uint32_t d;
            memcpy(&d, in + r * rb + 4 * c, 4);
            d ^= flip * 0x01010101u;
            memcpy(out + 64 * c + 4 * r, &d, 4);
        }
}

/* one unit (16 rows, `unit` bytes each) of a K-quant: its whole dwords as columns, then the
 * bytes past them row by row */
static void pack_x16_unit(const uint8_t *in, long long rb, long long unit, uint8_t *out) {
    const long long ncol = unit / 4, tail = unit - 4 * ncol;
    rows_to_cols(in, rb, ncol, 0, out);
    for (int r = 0; r < 16; r++) memcpy(out + 64 * ncol + r * tail, in + r * rb + 4 * ncol, (size_t)tail);
}

/* one unit (two blocks) of 16 rows of a two-block-unit type into its columns (pair_layout) */
static void pack_pair_unit(const uint8_t *in, long long rb, const fk_pair_layout *L, uint8_t *out) {
    if (L->dpair)
        for (int r = 0; r < 16; r++) {
            memcpy(out + 4 * r, in + r * rb, 2);
            memcpy(out + 4 * r + 2, in + r * rb + L->bb, 2);
        }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < L->nf; j++) {
            const fk_pair_field &f = L->f[j];
            const uint8_t *src = in + h * L->bb + f.off;
            uint8_t *dst = out + 64 * (f.c0 + f.step * h);
            if (f.kind != 2) {
                rows_to_cols(src, rb, f.nc, f.kind ? 0x80 : 0, dst);
                continue;
            }
            for (int r = 0; r < 16; r++) {   /* one qh dword */
                const uint8_t *q = src + r * rb;
                const uint32_t d = qh_bits[0][q[0]] | qh_bits[1][q[1]] | qh_bits[2][q[2]] | qh_bits[3][q[3]];
                memcpy(dst + 4 * r, &d, 4);
            }
        }
}

/* one unit (two 17-byte blocks) of 16 MXFP4 rows: the 16 rows' E8M0 byte pairs (row r's at 2 r),
 * then each block's 4 qs dwords as columns at 32 + 64 (4 h + i) */
static void pack_mxfp4_unit(const uint8_t *in, long long rb, uint8_t *out) {
    for (int r = 0; r < 16; r++) {
        out[2 * r] = in[r * rb];
        out[2 * r + 1] = in[r * rb + 17];
    }
    for (int h = 0; h < 2; h++) rows_to_cols(in + 17 * h + 1, rb, 4, 0, out + 32 + 256 * h);
}

/* how a GGML type packs into its 16-row groups: 1 a K-quant (unit: its superblock), 2 a
 * two-block unit (pl), 3 MXFP4 (two blocks); 0 no 16-row group layout */
static int pack_kind(long t, long long *unit, fk_pair_layout *pl) {
    long bs, ts;
    if (!type_block(t, &bs, &ts)) return 0;
    if (t == FK_Q2_K || t == FK_Q3_K || t == FK_Q4_K || t == FK_Q5_K || t == FK_Q6_K || t == FK_IQ4_XS) {
        *unit = ts;
        return 1;
    }
    *unit = 2 * ts;
    return pair_layout(t, pl) ? 2 : t == FK_MXFP4 ? 3 : 0;
}

static int pack_shape_ok(long long n, long long rb, long long unit) {
    return n > 0 && n % 16 == 0 && rb > 0 && rb % unit == 0 && rb <= (1LL << 40) / n;
}

/* n rows at src into their groups at dst (pack_kind's kind, unit, pl), over `threads` */
static void pack_run(int kind, long long unit, const fk_pair_layout *pl, const uint8_t *src, uint8_t *dst,
                     long long n, long long rb, int threads) {
    const long long nu = rb / unit;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * rb >= (1 << 16))
    for (long long g = 0; g < n / 16; g++)
        for (long long u = 0; u < nu; u++) {
            const uint8_t *in = src + (size_t)(16 * g * rb + u * unit);   /* row r at in + r rb */
            uint8_t *out = dst + (size_t)((g * nu + u) * 16 * unit);
            if (kind == 1) pack_x16_unit(in, rb, unit, out);
            else if (kind == 3) pack_mxfp4_unit(in, rb, out);
            else pack_pair_unit(in, rb, pl, out);
        }
}

/* group_pack(qtype, src, dst, n, row_bytes): n rows (a multiple of 16) of a GGML type into its
 * 16-row groups, the bytes kernels.q4k_interleave and kin write (K-quants and IQ4_XS: each
 * superblock's dwords as columns; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: per two-block
 * unit, its fields as columns), over the kernels' threads; the torch copies of the load-time
 * interleave move 0.4-1.6 GB/s. src and dst must not overlap. */
static PyObject *py_group_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (!int_args("group_pack", args, nargs, 5, 0, 5, v)) return NULL;
    const long t = (long)v[0];
    const uint8_t *src = (const uint8_t *)(uintptr_t)v[1];
    uint8_t *dst = (uint8_t *)(uintptr_t)v[2];
    const long long n = v[3], rb = v[4];
    long long unit;
    fk_pair_layout pl;
    const int kind = pack_kind(t, &unit, &pl);
    if (!kind) {
        PyErr_Format(PyExc_ValueError, "group_pack: type %ld has no 16-row group layout", t);
        return NULL;
    }
    if (!src || !dst || !pack_shape_ok(n, rb, unit)) {
        PyErr_SetString(PyExc_ValueError, "group_pack: inconsistent shapes or null pointer");
        return NULL;
    }
    const size_t bytes = (size_t)(n * rb);
    if (src < dst + bytes && dst < src + bytes) {
        PyErr_SetString(PyExc_ValueError, "group_pack: source and destination overlap");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pack_run(kind, unit, &pl, src, dst, n, rb, g_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* read_experts(n, fds, offsets, sizes, types, rows, dsts, stage, stage_bytes, stages, status): n reads,
 * each argument past n an int64 array of n, over the kernels' threads (the expert store's
 * misses: models/expert_store.py). Read i puts sizes[i] bytes of fds[i] at offsets[i] into
 * dsts[i]; where types[i] is not -1 it reads into its thread's stage (stage + thread x
 * stage_bytes; `stages` of them, at most as many threads) and packs rows[i] rows of that GGML type into dsts[i]. status[i]: the bytes read
 * (sizes[i] when whole), or -errno. Reads on the kernels' own threads: from Python threads
 * the step's OpenMP team spun on the cores the readers wanted (two Python readers ran 0.83-0.90x
 * one). Every read is tried; the caller decides what a failure costs. */
static PyObject *py_read_experts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    if (!int_args("read_experts", args, nargs, 11, 0, 11, v)) return NULL;
    const long long n = v[0], stage_bytes = v[8], stages = v[9];
    const int64_t *fds = (const int64_t *)(uintptr_t)v[1], *offs = (const int64_t *)(uintptr_t)v[2],
                  *sizes = (const int64_t *)(uintptr_t)v[3], *types = (const int64_t *)(uintptr_t)v[4],
                  *rows = (const int64_t *)(uintptr_t)v[5], *dsts = (const int64_t *)(uintptr_t)v[6];
    uint8_t *stage = (uint8_t *)(uintptr_t)v[7];
    int64_t *status = (int64_t *)(uintptr_t)v[10];
    if (n < 0 || (n && (!fds || !offs || !sizes || !types || !rows || !dsts || !status)) || stage_bytes < 0 ||
        stages < 1 || (stage_bytes && !stage)) {
        PyErr_SetString(PyExc_ValueError, "read_experts: inconsistent arguments or null pointer");
        return NULL;
    }
    for (long long i = 0; i < n; i++) {   /* every shape checked before any read */
        long long unit = 0;
        fk_pair_layout pl;
        const int packs = types[i] != -1;
        if (fds[i] < 0 || offs[i] < 0 || sizes[i] <= 0 || !dsts[i] ||
            (packs && (!pack_kind((long)types[i], &unit, &pl) || sizes[i] > stage_bytes || rows[i] <= 0 ||
                       sizes[i] % rows[i] || !pack_shape_ok(rows[i], sizes[i] / rows[i], unit)))) {
            PyErr_Format(PyExc_ValueError, "read_experts: read %lld has an inconsistent shape", i);
            return NULL;
        }
    }
    const int threads = (int)std::min<long long>(g_threads, stages);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (n > 1)
    for (long long i = 0; i < n; i++) {
        const int packs = types[i] != -1;
        uint8_t *into = packs ? stage + (size_t)omp_get_thread_num() * (size_t)stage_bytes : (uint8_t *)(uintptr_t)dsts[i];
        long long got = 0;
        int err = 0;
        while (got < sizes[i]) {
            const ssize_t r = pread((int)fds[i], into + got, (size_t)(sizes[i] - got), (off_t)(offs[i] + got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) err = errno;
            if (r <= 0) break;
            got += r;
        }
        status[i] = err ? -err : got;
        if (got == sizes[i] && packs) {
            long long unit;
            fk_pair_layout pl;
            const int kind = pack_kind((long)types[i], &unit, &pl);
            pack_run(kind, unit, &pl, into, (uint8_t *)(uintptr_t)dsts[i], rows[i], sizes[i] / rows[i], 1);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The first maximum of x[0..n), numpy's argmax: a NaN ranks highest (the first NaN wins),
 * ties go to the lowest index. Two passes, both SSE (x86-64's baseline; the compiler will
 * not vectorise a max whose NaN order it must keep): the row's max and whether it holds a
 * NaN, then the first index equal to it (or the first NaN). Called on a row the kernels just
 * wrote, right after a step (the code and the row cold): numpy's argmax took 50-84 us on a
 * 49k vocabulary and 100-155 on 262k, this 17-27 and 67-106. */
static long long first_max_f32(const float *x, long long n, float *value) {
    long long i = 0;
    float m = x[0];
    int nan = m != m;
#if defined(__SSE2__)
    if (n >= 16) {
        __m128 m0 = _mm_loadu_ps(x), m1 = m0, m2 = m0, m3 = m0, u = _mm_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
            const __m128 c = _mm_loadu_ps(x + i + 8), d = _mm_loadu_ps(x + i + 12);
            u = _mm_or_ps(u, _mm_or_ps(_mm_cmpunord_ps(a, b), _mm_cmpunord_ps(c, d)));
            m0 = _mm_max_ps(m0, a);
            m1 = _mm_max_ps(m1, b);
            m2 = _mm_max_ps(m2, c);
            m3 = _mm_max_ps(m3, d);
        }
        m0 = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
        m0 = _mm_max_ps(m0, _mm_shuffle_ps(m0, m0, _MM_SHUFFLE(1, 0, 3, 2)));
        m0 = _mm_max_ps(m0, _mm_shuffle_ps(m0, m0, _MM_SHUFFLE(2, 3, 0, 1)));
        m = _mm_cvtss_f32(m0);
        nan |= _mm_movemask_ps(u) != 0;
    }
#endif
    for (; i < n; i++) {
        const float v = x[i];
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) break;
        *value = x[i];
        return i;
    }
    i = 0;
#if defined(__SSE2__)
    const __m128 mv = _mm_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), mv)) |
                        _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i + 4), mv)) << 4 |
                        _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i + 8), mv)) << 8 |
                        _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i + 12), mv)) << 12;
        if (hit) {
            i += __builtin_ctz((unsigned)hit);
            *value = x[i];
            return i;
        }
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) break;
    if (i == n) i = 0;  /* unreachable: m is one of the values */
    *value = x[i];
    return i;
}

static PyObject *py_argmax_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[3];
    if (!int_args("argmax_rows", args, nargs, 3, 0, 3, v)) return NULL;
    const float *x = (const float *)(uintptr_t)v[0];
    const long long rows = v[1], cols = v[2];
    if (!x || rows < 1 || cols < 1 || rows > (1LL << 20) || cols > (1LL << 34)) {
        PyErr_SetString(PyExc_ValueError, "argmax_rows: null pointer or empty / oversized rows");
        return NULL;
    }
    PyObject *out = PyList_New(rows);
    if (!out) return NULL;
    for (long long r = 0; r < rows; r++) {
        float val;
        const long long i = first_max_f32(x + r * cols, cols, &val);
        PyObject *t = Py_BuildValue("(Ld)", i, (double)val);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, r, t);
    }
    return out;
}

static PyObject *py_act_roundtrip(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long xp, op;
    long long k;
    if (!PyArg_ParseTuple(args, "KLK", &xp, &k, &op)) return NULL;
    if (!xp || !op || k <= 0 || k % 32) {
        PyErr_SetString(PyExc_ValueError, "act_roundtrip: k must be a positive multiple of 32");
        return NULL;
    }
    g_isa->act_roundtrip((const float *)(uintptr_t)xp, k, (float *)(uintptr_t)op);
    Py_RETURN_NONE;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 1024) {
        PyErr_SetString(PyExc_ValueError, "threads must be in 1..1024");
        return NULL;
    }
    g_threads = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(g_threads);
}

fk_iq_tables fk_iq;

/* set_iq_tables(bytes): the IQ1-IQ3 codebooks as fk_iq_tables lays them out (up to sign_mask),
 * each entry checked against the range the kernels' int16 sums assume (generic/iq_impl.inc) */
static PyObject *py_set_iq_tables(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    static fk_iq_tables t;   /* 0.8 MB: not on the stack */
    const size_t need = offsetof(fk_iq_tables, sign_mask);
    const auto all = [](const auto &table, auto in_range) {   /* every entry of a [n][w] table */
        return std::all_of(&table[0][0], &table[0][0] + sizeof(table), [&](int v) { return in_range(v); });
    };
    const auto iq2 = [](int v) { return v == 8 || v == 25 || v == 43; };
    bool ok = (size_t)b.len == need;
    if (ok) {
        memcpy(&t, b.buf, need);
        ok = all(t.iq2xxs, iq2) && all(t.iq2xs, iq2) && all(t.iq2s, iq2) &&
             all(t.iq3xxs, [](int v) { return v >= 2 && v <= 62 && v % 2 == 0; }) &&
             all(t.iq3s, [](int v) { return v >= 1 && v <= 15 && v % 2 == 1; }) &&
             all(t.iq1s, [](int v) { return v >= -1 && v <= 1; });
    }
    PyBuffer_Release(&b);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "set_iq_tables: %zu bytes of codebooks in range expected", need);
        return NULL;
    }
    for (int i = 0; i < 256 * 4; i++) (&t.iq3xxs[0][0])[i] /= 2;
    for (int i = 0; i < 4096; i++)
        for (int j = 0; j < 8; j++) t.iq1s_u[i][j] = (uint8_t)(16 + 8 * t.iq1s[i & 2047][j] + (i & 2048 ? -1 : 1));
    for (int s = 0; s < 256; s++) {
        t.sign_mask[s] = 0;
        for (int j = 0; j < 8; j++)
            if ((s >> j) & 1) t.sign_mask[s] |= (uint64_t)0xFF << (8 * j);
    }
    /* the signed values of every word: its low `bits` index the grid, the rest the 7 sign bits */
    const auto signed_values = [&](int8_t (*v)[8], const uint8_t (*grid)[8], int bits) {
        for (int w = 0; w < 128 << bits; w++)
            for (int j = 0; j < 8; j++) {
                const int g = grid[w & ((1 << bits) - 1)][j];
                v[w][j] = (int8_t)((t.ksigns[w >> bits] >> j) & 1 ? -g : g);
            }
    };
    signed_values(t.iq2xs_v, t.iq2xs, 9);
    signed_values(t.iq2xxs_v, t.iq2xxs, 8);
    t.ready = 1;
    fk_iq = t;
    Py_RETURN_NONE;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    const fk_isa *isa = isa_by_name(name);
    if (!isa) {
        PyErr_Format(PyExc_ValueError, "ISA %s is unknown or not supported by this CPU", name);
        return NULL;
    }
    g_isa = isa;
    Py_RETURN_NONE;
}

static PyObject *py_set_prefill(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (!strcmp(name, "canon")) {
        g_prefill = FK_PREFILL_CANON;
    } else if (!strcmp(name, "int8")) {
        g_prefill = FK_PREFILL_INT8;
    } else if (!strcmp(name, "bf16") && cpu_has_bf16()) {
        g_prefill = FK_PREFILL_BF16;
    } else {
        PyErr_Format(PyExc_ValueError, "prefill route %s is unknown or not supported by this CPU", name);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_get_prefill(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(g_prefill == FK_PREFILL_CANON ? "canon" : g_prefill == FK_PREFILL_BF16 ? "bf16" : "int8");
}

static PyObject *py_prefill_min_m(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(FK_PREFILL_MIN_M);
}

static PyObject *py_get_isa(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(g_isa->name);
}

static PyObject *py_gemv_rows(PyObject *self, PyObject *arg) {
    (void)self;
    const long qt = PyLong_AsLong(arg);
    if (qt == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(g_isa->gemv_rows ? g_isa->gemv_rows((int)qt) : 0);
}

static PyObject *py_supported_isas(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    const char *names[] = {"avx512", "avx2vnni", "avx2", "scalar"};
    for (int i = 0; i < 4; i++)
        if (isa_by_name(names[i])) {
            PyObject *s = PyUnicode_FromString(names[i]);
            if (!s || PyList_Append(l, s) < 0) { Py_XDECREF(s); Py_DECREF(l); return NULL; }
            Py_DECREF(s);
        }
    return l;
}

static PyObject *py_get_amx(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyBool_FromLong(fk_amx_on);
}

static PyObject *py_set_amx(PyObject *self, PyObject *arg) {
    (void)self;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    if (on && !g_amx_able) {
        PyErr_SetString(PyExc_ValueError, "AMX is not available on this CPU (or not enabled by its OS)");
        return NULL;
    }
    fk_amx_on = on;
    Py_RETURN_NONE;
}

static PyObject *py_omp_max_threads(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(omp_get_max_threads());
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL,
     "matmul(qtype, w_ptr, row_bytes, n, k, x_ptr, m, y_ptr, ldy): y[m,n] = x[m,k] @ W[n,k]^T"},
    {"attn_decode", (PyCFunction)(void (*)(void))py_attn_decode, METH_FASTCALL,
     "attn_decode(q, k, v, out, n, row_stride, n_head, kv_heads, d, scale): one-row attention over f16 K/V"},
    {"delta_step", (PyCFunction)(void (*)(void))py_delta_step, METH_FASTCALL,
     "delta_step(qkv, z, b, a, window, conv_w, dt_bias, ssm_a, state, norm_w, out, hk, hv, dk, dv, d_conv, eps)"},
    {"hc_pre", (PyCFunction)(void (*)(void))py_hc_pre, METH_FASTCALL,
     "hc_pre(mix, x, scale, base, h, post, comb, m, n, iters, eps): DeepSeek-V4's hyper-connection pre-mix"},
    {"hc_pre_full", (PyCFunction)(void (*)(void))py_hc_pre_full, METH_FASTCALL,
     "hc_pre_full(x, qtype, w, row_bytes, scale, base, h, post, comb, m, n, iters, norm_eps, eps): "
     "norm, projection and hc_pre"},
    {"hc_post", (PyCFunction)(void (*)(void))py_hc_post, METH_FASTCALL,
     "hc_post(y, x, post, comb, out, m, n): DeepSeek-V4's hyper-connection post-mix"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, w, out, m, n, eps): ggml's RMS norm of m rows of n (w: 0 or n weights)"},
    {"swiglu_clamp", (PyCFunction)(void (*)(void))py_swiglu_clamp, METH_FASTCALL,
     "swiglu_clamp(g, u, out, n, limit): silu(min(g, limit)) * clamp(u, -limit, limit)"},
    {"rope_tail", (PyCFunction)(void (*)(void))py_rope_tail, METH_FASTCALL,
     "rope_tail(x, m, heads, d, cs, n_rot, inverse): RoPE on each head's last n_rot values, in place"},
    {"dsv4_qkv", (PyCFunction)(void (*)(void))py_dsv4_qkv, METH_FASTCALL,
     "dsv4_qkv(ys0, ys1, q_a_norm, kv_norm, qtype, q_b, row_bytes, cs, qr, q, raw_row, rank, heads, hd, n_rot, eps): "
     "deepseek4's decode query and K=V row"},
    {"q8_0_grouped", (PyCFunction)(void (*)(void))py_q8_0_grouped, METH_FASTCALL,
     "q8_0_grouped(w, g, rank, in, x, m, y): deepseek4's grouped output projection, Q8_0 weights, f32 rows"},
    {"dsv4_attn_in", (PyCFunction)(void (*)(void))py_dsv4_attn_in, METH_FASTCALL,
     "dsv4_attn_in(x, w_type, w, w_rb, n_in, rank, hd, q_a_norm, kv_norm, qb_type, q_b, qb_rb, cs, heads, n_rot, "
     "raw_row, st_w, st_kv, st_sc, comp_ape, lid_w, lid_kv, lid_sc, idx_ape, n_idx, idx_out, qr, q, eps): "
     "deepseek4's decode attention input"},
    {"dsv4_attn_out", (PyCFunction)(void (*)(void))py_dsv4_attn_out, METH_FASTCALL,
     "dsv4_attn_out(q, H, d, raw, n_raw, comp, comp_len, ratio, n_vis, blocks, n_blocks, sinks, cs, n_rot, wo_a, g, "
     "o_rank, wob_type, wo_b, wob_rb, n_embd, out, scale): deepseek4's decode attention and output projections"},
    {"dsv4_attend", (PyCFunction)(void (*)(void))py_dsv4_attend, METH_FASTCALL,
     "dsv4_attend(q, H, d, raw, n_raw, comp, comp_len, rows, n_comp, sinks, out, scale): deepseek4's decode attention row"},
    {"plan_schema", py_plan_schema, METH_NOARGS, "plan_schema(): the plan's and a layer's (name, kind) fields"},
    {"plan_new", py_plan_new, METH_VARARGS, "plan_new(desc): a validated decoder plan from int64 slots"},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL,
     "step(plan, x, m, pos0, kv_table, cis0, cis0_len, cis1, cis1_len): every layer over x[m, n_embd]"},
    {"step_batch", (PyCFunction)(void (*)(void))py_step_batch, METH_FASTCALL,
     "step_batch(plan, x, m, row_kv, row_pos, cis0, cis0_len, cis1, cis1_len): one token per stream"},
    {"ffn", (PyCFunction)(void (*)(void))py_ffn, METH_FASTCALL,
     "ffn(plan, layer, x, m, out, ids): one layer's ffn of an ffn-only plan over x[m, n_embd]"},
    {"dequant_rows", (PyCFunction)(void (*)(void))py_dequant_rows, METH_FASTCALL,
     "dequant_rows(qtype, w, row_bytes, n, k, ids, count, out): rows of a weight as f32"},
    {"group_pack", (PyCFunction)(void (*)(void))py_group_pack, METH_FASTCALL,
     "group_pack(qtype, src, dst, n, row_bytes): rows into their 16-row groups"},
    {"read_experts", (PyCFunction)(void (*)(void))py_read_experts, METH_FASTCALL,
     "read_experts(n, fds, offsets, sizes, types, rows, dsts, stage, stage_bytes, stages, status): "
     "reads, each packed into 16-row groups or not, over the kernels' threads"},
    {"argmax_rows", (PyCFunction)(void (*)(void))py_argmax_rows, METH_FASTCALL,
     "argmax_rows(ptr, rows, cols): each f32 row's first maximum as a list of (index, value), numpy's order "
     "(NaN highest)"},
    {"act_roundtrip", py_act_roundtrip, METH_VARARGS, "quantize activations as matmul does, dequantize back"},
    {"set_threads", py_set_threads, METH_O, "threads for the kernels' OpenMP regions"},
    {"get_threads", py_get_threads, METH_NOARGS, ""},
    {"set_iq_tables", py_set_iq_tables, METH_O, "the IQ1-IQ3 codebooks (bytes, as fk_iq_tables lays them out)"},
    {"set_isa", py_set_isa, METH_O, "force 'avx512', 'avx2vnni', 'avx2' or 'scalar'"},
    {"get_isa", py_get_isa, METH_NOARGS, ""},
    {"set_prefill", py_set_prefill, METH_O, "'canon' (batch invariant, the default) or a legacy route: 'int8' or 'bf16' (AVX512_BF16, m >= 8)"},
    {"get_prefill", py_get_prefill, METH_NOARGS, ""},
    {"prefill_min_m", py_prefill_min_m, METH_NOARGS, ""},
    {"supported_isas", py_supported_isas, METH_NOARGS, ""},
    {"gemv_rows", py_gemv_rows, METH_O, "route probe: the most rows the current ISA's canonical decode GEMV takes for a GGML type"},
    {"omp_max_threads", py_omp_max_threads, METH_NOARGS, ""},
    {"get_amx", py_get_amx, METH_NOARGS, "whether the AVX-512 prefill kernel uses the AMX tiles"},
    {"set_amx", py_set_amx, METH_O, "use (True) or not (False) the AMX tiles in the AVX-512 prefill kernel"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native", "fucina native kernels", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    if (cpu_has_avx512()) g_isa = &fk_isa_avx512;
    else if (cpu_has_avx2vnni()) g_isa = &fk_isa_avx2vnni;
    else if (cpu_has_avx2()) g_isa = &fk_isa_avx2;
    fk_amx_on = g_amx_able = cpu_has_amx();
    qh_bits_init();
    g_threads = omp_get_max_threads();
    if (g_threads < 1) g_threads = 1;
    return PyModule_Create(&moddef);
}
