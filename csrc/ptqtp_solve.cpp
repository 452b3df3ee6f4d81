// The PTQTP solver (fucina.quant.ptqtp): K trit-planes fitted to each 256-value group.
//
// The same alternation as the module's torch formulation (its docstring is the spec): ridge
// scales in double (closed-form K x K inverse, lambda escalated while the Frobenius condition
// estimate exceeds 1e6), then per element the first strict least-squares minimum over the 3^K
// trit tuples in the pinned order, until no scale moves by 1e-4 or 50 rounds; then f16 scales
// (tie-rounded for the scale-tied K=2 fit) and one last topology against exactly those.
//
// Its own extension (fucina.quant._ptqtp: the quant band sits below the kernels). Compiled for
// baseline x86-64 (no ISA pragmas, no FMA, no fast-math): every host produces the
// same bytes, and a group's result depends on nothing but its 256 values, so the thread count
// does not change the file. It is an offline tool; the 0.6B shape's 1.7 M groups take minutes
// here where the batched torch formulation took hours.
#include <Python.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int GROUP = 256;
constexpr double LAMBDA0 = 1e-8, LAMBDA_MAX = 1.0, KAPPA_MAX = 1e6;
constexpr float EPSILON = 1e-4f;
constexpr int MAX_ITERATIONS = 50;

// float -> IEEE half bits, round to nearest even; overflow -> inf, NaN kept
uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u));
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   // rounds past 65504
    if (mag < 0x38800000u) {                                     // subnormal half (or zero)
        if (mag < 0x33000000u) return (uint16_t)sign;            // below half the smallest subnormal
        uint32_t m = (mag & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(mag >> 23);                      // 14 .. 24
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((mag >> 13) - (112u << 10)), rem = mag & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, x;
    if (e == 0) {
        float v = std::ldexp((float)m, -24);
        return sign ? -v : v;
    }
    if (e == 31) x = sign | 0x7f800000u | (m << 13);
    else x = sign | ((e + 112u) << 23) | (m << 13);
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

float f16_round(float f) { return f16_to_f32(f32_to_f16(f)); }

// The 3^K trit tuples in the pinned search order (fucina.quant.ptqtp.candidates): sparser
// first; among equals the nonzeros on finer (later) planes first; + before -.
struct Candidates {
    int n = 0;
    int8_t c[27][3] = {};
    explicit Candidates(int K) {
        int8_t all[27][3];
        int m = 1;
        for (int k = 0; k < K; k++) m *= 3;
        const int8_t digit[3] = {0, 1, -1};
        for (int i = 0; i < m; i++) {                       // itertools.product order
            int r = i;
            for (int k = K - 1; k >= 0; k--) { all[i][k] = digit[r % 3]; r /= 3; }
        }
        // stable insertion sort by the pinned key
        int order[27];
        for (int i = 0; i < m; i++) order[i] = i;
        for (int i = 1; i < m; i++) {
            int v = order[i], j = i - 1;
            while (j >= 0 && less(all[v], all[order[j]], K)) { order[j + 1] = order[j]; j--; }
            order[j + 1] = v;
        }
        n = m;
        for (int i = 0; i < m; i++) std::memcpy(c[i], all[order[i]], 3);
    }
    static bool less(const int8_t *a, const int8_t *b, int K) {
        int na = 0, nb = 0;
        for (int k = 0; k < K; k++) { na += a[k] != 0; nb += b[k] != 0; }
        if (na != nb) return na < nb;
        // the nonzero planes, finest first, compared as (-i, ...) tuples: a larger plane index first
        int ia[3], ib[3], la = 0, lb = 0;
        for (int k = K - 1; k >= 0; k--) { if (a[k]) ia[la++] = -k; if (b[k]) ib[lb++] = -k; }
        for (int i = 0; i < la && i < lb; i++) if (ia[i] != ib[i]) return ia[i] < ib[i];
        if (la != lb) return la < lb;
        for (int k = 0; k < K; k++) {                       // + (False) before - (True)
            bool ma = a[k] == -1, mb = b[k] == -1;
            if (ma != mb) return !ma;
        }
        return false;
    }
};

// Per element the index of the first candidate of least squared error for the plane scales a.
// Elementwise float ops only (no FMA: -ffp-contract=off), so the wider clones give the same bits.
__attribute__((target_clones("avx512f", "avx2", "default")))
void topology(const float *w, const float *a, int K, const Candidates &cand, uint8_t *pick) {
    float level[27];
    for (int c = 0; c < cand.n; c++) {
        float s = 0.0f;
        for (int k = 0; k < K; k++) s = s + (cand.c[c][k] == 0 ? 0.0f : cand.c[c][k] > 0 ? a[k] : -a[k]);
        level[c] = s;
    }
    float best[GROUP];
    int32_t idx[GROUP];
    for (int e = 0; e < GROUP; e++) {
        float d = w[e] - level[0];
        best[e] = d * d;
        idx[e] = 0;
    }
    for (int c = 1; c < cand.n; c++) {
        const float lv = level[c];
        for (int e = 0; e < GROUP; e++) {
            float d = w[e] - lv, err = d * d;
            bool better = err < best[e];
            best[e] = better ? err : best[e];
            idx[e] = better ? c : idx[e];
        }
    }
    for (int e = 0; e < GROUP; e++) pick[e] = (uint8_t)idx[e];
}

// Ridge scales for the planes picked: a = (S^T S + lam I)^-1 S^T w.
void ridge(const float *w, const uint8_t *pick, int K, const Candidates &cand, float *a_out) {
    double A[3][3] = {}, b[3] = {};
    long cnt[27] = {};
    double sum[27] = {};
    for (int e = 0; e < GROUP; e++) { cnt[pick[e]]++; sum[pick[e]] += (double)w[e]; }
    for (int c = 0; c < cand.n; c++) {
        if (!cnt[c]) continue;
        for (int i = 0; i < K; i++) {
            b[i] += cand.c[c][i] * sum[c];
            for (int j = 0; j < K; j++) A[i][j] += (double)(cand.c[c][i] * cand.c[c][j] * cnt[c]);
        }
    }
    double lam = LAMBDA0, inv[3][3];
    for (;;) {
        double M[3][3];
        for (int i = 0; i < K; i++)
            for (int j = 0; j < K; j++) M[i][j] = A[i][j] + (i == j ? lam : 0.0);
        double det;
        if (K == 1) {
            det = M[0][0];
            inv[0][0] = 1.0 / det;
        } else if (K == 2) {
            det = M[0][0] * M[1][1] - M[0][1] * M[1][0];
            inv[0][0] = M[1][1] / det; inv[0][1] = -M[0][1] / det;
            inv[1][0] = -M[1][0] / det; inv[1][1] = M[0][0] / det;
        } else {
            double c00 = M[1][1] * M[2][2] - M[1][2] * M[2][1];
            double c01 = M[1][2] * M[2][0] - M[1][0] * M[2][2];
            double c02 = M[1][0] * M[2][1] - M[1][1] * M[2][0];
            det = M[0][0] * c00 + M[0][1] * c01 + M[0][2] * c02;
            inv[0][0] = c00 / det;
            inv[0][1] = (M[0][2] * M[2][1] - M[0][1] * M[2][2]) / det;
            inv[0][2] = (M[0][1] * M[1][2] - M[0][2] * M[1][1]) / det;
            inv[1][0] = c01 / det;
            inv[1][1] = (M[0][0] * M[2][2] - M[0][2] * M[2][0]) / det;
            inv[1][2] = (M[0][2] * M[1][0] - M[0][0] * M[1][2]) / det;
            inv[2][0] = c02 / det;
            inv[2][1] = (M[0][1] * M[2][0] - M[0][0] * M[2][1]) / det;
            inv[2][2] = (M[0][0] * M[1][1] - M[0][1] * M[1][0]) / det;
        }
        double nm = 0, ni = 0;
        for (int i = 0; i < K; i++)
            for (int j = 0; j < K; j++) { nm += M[i][j] * M[i][j]; ni += inv[i][j] * inv[i][j]; }
        double kappa = std::sqrt(nm) * std::sqrt(ni);      // inf or NaN when M is singular
        bool bad = !(kappa <= KAPPA_MAX);
        if (!bad || lam >= LAMBDA_MAX) break;
        lam = lam * 10 > LAMBDA_MAX ? LAMBDA_MAX : lam * 10;
    }
    for (int i = 0; i < K; i++) {
        double s = 0;
        for (int j = 0; j < K; j++) s += inv[i][j] * b[j];
        a_out[i] = (float)s;
    }
}

// The tied K=2 scale: s = c.w / (c.c + LAMBDA0) over the 9-level codes c = 3 t0 + t1.
float tied_scale(const float *w, const uint8_t *pick, const Candidates &cand) {
    double cw = 0, cc = 0;
    for (int e = 0; e < GROUP; e++) {
        double c = 3.0 * cand.c[pick[e]][0] + cand.c[pick[e]][1];
        cw += c * (double)w[e];
        cc += c * c;
    }
    return (float)(cw / (cc + LAMBDA0));
}

// fucina.quant.ptqtp.tie_round: the f16 nearest s whose triple is an f16 too; NaN when none
float tie_round(float s) {
    int bits = (int)f32_to_f16(s);
    const int deltas[7] = {0, -1, 1, -2, 2, -3, 3};
    for (int d : deltas) {
        int v = bits + d;
        v = v < 0 ? 0 : v > 0x7bff ? 0x7bff : v;
        float b = f16_to_f32((uint16_t)v);
        if (f16_round(3 * b) == 3 * b) return b;
    }
    return NAN;
}

// Fits K (1..3) trit-planes to one 256-value group w: trits [256, K] in -1..1 (element-major),
// scales [K] (f16-exact magnitudes), *iterations the rounds run. tie (K = 2 only): the
// scale-tied fit. Returns 0 converged, 1 not converged within 50 rounds, -1 when a tied scale
// has no f16 whose triple is an f16 too.
int solve_group(const float *w_in, int K, int tie, int8_t *trits, float *scales, int *iterations) {
    static const Candidates cand_by_k[4] = {Candidates(0), Candidates(1), Candidates(2), Candidates(3)};
    const Candidates &cand = cand_by_k[K];
    float w[GROUP];
    bool finite[GROUP];
    for (int e = 0; e < GROUP; e++) {
        finite[e] = std::isfinite(w_in[e]);
        w[e] = finite[e] ? w_in[e] : 0.0f;
    }
    // every plane at sign(w): the tuple (s, s, .., s)
    int plus = 0, minus = 0;
    for (int c = 0; c < cand.n; c++) {
        bool all_p = true, all_m = true;
        for (int k = 0; k < K; k++) { all_p &= cand.c[c][k] == 1; all_m &= cand.c[c][k] == -1; }
        if (all_p) plus = c;
        if (all_m) minus = c;
    }
    uint8_t pick[GROUP];
    for (int e = 0; e < GROUP; e++) pick[e] = w[e] > 0 ? (uint8_t)plus : w[e] < 0 ? (uint8_t)minus : 0;

    float a[3] = {0, 0, 0}, a_new[3], s_tied = 0;
    bool converged = false;
    int it = 0;
    for (it = 1; it <= MAX_ITERATIONS; it++) {
        float moved = 0;
        if (tie) {
            float s = tied_scale(w, pick, cand);
            moved = std::fabs(s - s_tied);
            s_tied = s;
            a[0] = s * 3.0f;
            a[1] = s;
        } else {
            ridge(w, pick, K, cand, a_new);
            for (int k = 0; k < K; k++) {
                float m = std::fabs(a_new[k] - a[k]);
                moved = m > moved ? m : moved;
            }
            std::memcpy(a, a_new, sizeof a);
        }
        topology(w, a, K, cand, pick);
        if (moved < EPSILON) { converged = true; break; }
    }
    *iterations = it > MAX_ITERATIONS ? MAX_ITERATIONS : it;

    // stored scales: f16 magnitudes (tie-rounded for the tied fit); signs folded into the trits
    float sign[3], mag[3], signed_scale[3];
    if (tie) {
        float s = s_tied;
        float sg = s < 0 ? -1.0f : 1.0f, m = tie_round(std::fabs(s));
        if (std::isnan(m)) return -1;
        mag[0] = 3 * m; mag[1] = m;
        sign[0] = sign[1] = sg;
    } else {
        for (int k = 0; k < K; k++) {
            sign[k] = a[k] < 0 ? -1.0f : 1.0f;
            mag[k] = f16_round(std::fabs(a[k]));
        }
    }
    for (int k = 0; k < K; k++) signed_scale[k] = mag[k] * sign[k];
    topology(w, signed_scale, K, cand, pick);
    for (int e = 0; e < GROUP; e++)
        for (int k = 0; k < K; k++)
            trits[e * K + k] = finite[e] ? (int8_t)(cand.c[pick[e]][k] * (int)sign[k]) : 0;
    for (int k = 0; k < K; k++) scales[k] = mag[k];
    return converged ? 0 : 1;
}

PyObject *py_solve(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long wp, tp, sp;
    long long groups;
    int K, tie, threads;
    if (!PyArg_ParseTuple(args, "KLiiKKi", &wp, &groups, &K, &tie, &tp, &sp, &threads)) return NULL;
    if (!wp || !tp || !sp || groups < 0 || K < 1 || K > 3 || (tie && K != 2) || threads < 1 || threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "solve: K in 1..3 (2 when tied), groups >= 0, threads in 1..1024, pointers set");
        return NULL;
    }
    const float *w = (const float *)(uintptr_t)wp;
    int8_t *trits = (int8_t *)(uintptr_t)tp;
    float *scales = (float *)(uintptr_t)sp;
    long long unconverged = 0, failed = groups;
    int max_it = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : unconverged) reduction(max : max_it) \
    reduction(min : failed)
    for (long long g = 0; g < groups; g++) {
        int it = 0;
        int rc = solve_group(w + g * 256, K, tie, trits + g * 256 * K, scales + g * K, &it);
        max_it = it > max_it ? it : max_it;
        unconverged += rc == 1;
        if (rc < 0 && g < failed) failed = g;
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("iLL", max_it, unconverged, failed < groups ? failed : -1LL);
}

PyMethodDef methods[] = {
    {"solve", py_solve, METH_VARARGS,
     "solve(w, groups, K, tie, trits, scales, threads) -> (max iterations, unconverged, first failed group or -1)"},
    {NULL, NULL, 0, NULL},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ptqtp", "The PTQTP group solver (fucina.quant.ptqtp)", -1, methods,
                      NULL, NULL, NULL, NULL};

}  // namespace

PyMODINIT_FUNC PyInit__ptqtp(void) { return PyModule_Create(&module); }
