/* Every placement's GPU-load extremes and lb for a block of steps: the compiled pass of replay evaluation
 * (eplb/replay/evaluate.py; built by `pip install -e .`).
 *
 * One pass over the block, tile by tile: a tile of up to TILE steps of one layer is converted and
 * transposed to x[E][TILE] float32 (W x W register transposes; it stays in cache), then for each placement
 * and GPU the GPU's slots are gathered and summed, x[expert] x share, TILE steps at once in vector
 * registers, and the busiest and idlest GPU's rows and the most active slots are kept in registers too. A
 * slot's active count is 1 per step unless its expert has a zero count somewhere in the tile; only those
 * slots compare. Per step the kernel also writes the layer's total rows and every placement's lb, so Python
 * only turns the extremes into times (eplb.cost.TimeModel.layer_time_from_extremes). Sums run in slot
 * order in float32, multiply then add (no fused multiply-add), as the earlier per-slot loop did, so results
 * do not depend on the instruction set. Layers are split over threads when asked.
 *
 * The loop bodies are instantiated for three vector widths W (float lanes): 16 (AVX-512), 8 (AVX2) and 4
 * (SSE2, NEON, any target), and the widest the CPU runs is picked at import (x86-64 with GCC or Clang;
 * elsewhere W = 4). EPLB_EVALUATE_ISA=avx2|base in the environment picks a narrower one (tests). Without
 * GCC/Clang vector extensions (or with -DEPLB_SCALAR) a scalar loop computes the same sums; without
 * pthreads (Windows) the layers are not split over threads.
 *
 * No numpy headers: buffers come through the Python buffer protocol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* GCC and Clang: vector extensions; any other compiler (or -DEPLB_SCALAR): the same sums, one step at a time */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(EPLB_SCALAR)
#define EPLB_VECTORS 1
#endif
#if defined(EPLB_VECTORS) && defined(__x86_64__) && !defined(EPLB_BASE_ONLY)
#define EPLB_X86 1
#endif
#if defined(_WIN32)
#include <malloc.h> /* _aligned_malloc; layers are not split over threads */
#else
#include <pthread.h>
#define EPLB_THREADS 1
#endif

typedef int64_t i64;

#define UNIT 16           /* steps per unit of tile width */
#define TILE (UNIT * 4)   /* steps per tile (a block's last tile may be 1 to 3 units wide) */

#ifdef EPLB_VECTORS
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
#endif

static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable,
                   const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != itemsize || view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of items of %zd", name,
                     count, itemsize, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

typedef struct {
    const void *counts; /* [n, L, E] */
    int kind;
    i64 n, L, E, K, P, G;
    const i64 *expert;  /* [L, K, P] */
    const float *share; /* [L, K, P] */
    const i64 *bounds;  /* [K, G + 1] */
    double *total;      /* [n, L]: written unless have_total */
    int have_total;
    double *lb;                /* [K, n, L] */
    float *rmax, *rmin, *amax; /* [K, n, L] */
    float *rows, *active;      /* [K, n, L, G] or NULL */
    i64 l0, l1;                /* this worker's layers */
    int failed;
} Job;

typedef void (*load_fn)(const Job *jb, i64 l, i64 t0, i64 nt, i64 tw, float *x, unsigned char *zero);
typedef void (*place_fn)(const Job *jb, const float *x, const unsigned char *zero, i64 l, i64 t0, i64 nt);

#ifdef EPLB_VECTORS

/* ---- W x W transposes of r[0..W-1]: level B swaps the off-diagonal B x B blocks of every 2B x 2B block ---- */

/* LO, HI: parenthesized lane lists; lanes W.. pick from the second vector (GCC: __builtin_shuffle takes a
 * mask vector, Clang: __builtin_shufflevector takes the indices) */
#define LANES(...) __VA_ARGS__
#if defined(__clang__)
#define SHUFFLE(VI, A, C, IDX) __builtin_shufflevector(A, C, LANES IDX)
#else
#define SHUFFLE(VI, A, C, IDX) __builtin_shuffle(A, C, (VI){LANES IDX})
#endif

#define SWAP_LEVEL(VF, VI, W, B, LO, HI)                                                                   \
    for (int i_ = 0; i_ < (W); i_++)                                                                       \
        if (!(i_ & (B))) {                                                                                 \
            VF a_ = r[i_], c_ = r[i_ | (B)];                                                               \
            r[i_] = SHUFFLE(VI, a_, c_, LO);                                                               \
            r[i_ | (B)] = SHUFFLE(VI, a_, c_, HI);                                                         \
        }

#define TRANSPOSE16                                                                                        \
    SWAP_LEVEL(vf16, vi16, 16, 8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                \
               (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))                             \
    SWAP_LEVEL(vf16, vi16, 16, 4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),              \
               (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))                               \
    SWAP_LEVEL(vf16, vi16, 16, 2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),              \
               (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))                               \
    SWAP_LEVEL(vf16, vi16, 16, 1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),             \
               (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))

#define TRANSPOSE8                                                                                         \
    SWAP_LEVEL(vf8, vi8, 8, 4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))                   \
    SWAP_LEVEL(vf8, vi8, 8, 2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))                   \
    SWAP_LEVEL(vf8, vi8, 8, 1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))

#define TRANSPOSE4                                                                                         \
    SWAP_LEVEL(vf4, vi4, 4, 2, (0, 1, 4, 5), (2, 3, 6, 7))                                                 \
    SWAP_LEVEL(vf4, vi4, 4, 1, (0, 4, 2, 6), (1, 5, 3, 7))

/* ---- tile loading: x[e][j] = counts[t0 + j][l][e] as float32 (0 for nt <= j < tw), zero[e] = some step
 * j < nt has x[e][j] <= 0, total[t0 + j][l] = sum over e (exact for integer kinds). VEC_SUM: the totals
 * are summed in int32 lanes before the transpose (exact for 8- and 16-bit counts while E < W x 2^15);
 * otherwise in an int64 loop over each step's counts (float32: the caller's totals, have_total) ---- */

#define LOAD_TILE(NAME, T, VEC_SUM, W, ATTR)                                                               \
    ATTR static void NAME(const T *counts, i64 L, i64 E, i64 l, i64 t0, i64 nt, i64 tw, float *x,          \
                          unsigned char *zero, double *total, int have_total) {                            \
        typedef T tv_ __attribute__((vector_size(sizeof(T) * W)));                                         \
        const vf##W vzero = {0};                                                                           \
        const int vec_sum = VEC_SUM && !have_total && E < (W) * 32768;                                     \
        vi##W sums[TILE];                                                                                  \
        if (vec_sum) memset(sums, 0, sizeof sums);                                                         \
        i64 ew = E - E % (W);                                                                              \
        for (i64 e0 = 0; e0 < ew; e0 += W) {                                                               \
            vi##W z = {0};                                                                                 \
            for (i64 j0 = 0; j0 < tw; j0 += W) {                                                           \
                vf##W r[W];                                                                                \
                for (int jj = 0; jj < (W); jj++) {                                                         \
                    if (j0 + jj < nt) {                                                                    \
                        tv_ u;                                                                             \
                        memcpy(&u, counts + ((t0 + j0 + jj) * L + l) * E + e0, sizeof u);                  \
                        if (vec_sum) sums[j0 + jj] += __builtin_convertvector(u, vi##W);                   \
                        r[jj] = __builtin_convertvector(u, vf##W);                                         \
                        z |= r[jj] <= vzero;                                                               \
                    } else {                                                                               \
                        r[jj] = vzero;                                                                     \
                    }                                                                                      \
                }                                                                                          \
                TRANSPOSE##W                                                                               \
                for (int i = 0; i < (W); i++) memcpy(x + (e0 + i) * tw + j0, &r[i], sizeof r[i]);          \
            }                                                                                              \
            for (int i = 0; i < (W); i++) zero[e0 + i] = z[i] != 0;                                        \
        }                                                                                                  \
        for (i64 e = ew; e < E; e++) {                                                                     \
            unsigned char z = 0;                                                                           \
            for (i64 j = 0; j < tw; j++) {                                                                 \
                float v = j < nt ? (float)counts[((t0 + j) * L + l) * E + e] : 0.0f;                       \
                x[e * tw + j] = v;                                                                         \
                if (j < nt) z |= v <= 0.0f;                                                                \
            }                                                                                              \
            zero[e] = z;                                                                                   \
        }                                                                                                  \
        if (have_total) return;                                                                            \
        for (i64 j = 0; j < nt; j++) {                                                                     \
            const T *src = counts + ((t0 + j) * L + l) * E;                                                \
            i64 s = 0;                                                                                     \
            if (vec_sum) {                                                                                 \
                for (int i = 0; i < (W); i++) s += (i64)sums[j][i];                                        \
                for (i64 e = ew; e < E; e++) s += (i64)src[e];                                             \
            } else {                                                                                       \
                for (i64 e = 0; e < E; e++) s += (i64)src[e];                                              \
            }                                                                                              \
            total[(t0 + j) * L + l] = (double)s;                                                           \
        }                                                                                                  \
    }

/* lane-wise a > b ? a : b and a < b ? a : b */
#define VMAX(VI, VF, A, B) ((VF)(((VI)(A) & ((A) > (B))) | ((VI)(B) & ~((A) > (B)))))
#define VMIN(VI, VF, A, B) ((VF)(((VI)(A) & ((A) < (B))) | ((VI)(B) & ~((A) < (B)))))

/* Adds slot S, unless its share is <= 0, to a GPU's rows ACC and active slots ACT (NVX vectors of steps, x
 * rows STRIDE floats apart); FIXED counts the slots active at every step of the tile (no zero count in it). */
#define ADD_SLOT(VI, VF, ACC, ACT, FIXED, S, NVX, STRIDE)                                                  \
    do {                                                                                                   \
        const float w_ = share[S];                                                                         \
        if (!(w_ <= 0.0f)) {                                                                               \
            const VF vw_ = vzero + w_;                                                                     \
            const i64 e_ = expert[S];                                                                      \
            const VF *xe_ = (const VF *)(x + e_ * (STRIDE));                                               \
            for (int v = 0; v < (NVX); v++) ACC[v] = ACC[v] + xe_[v] * vw_;                                \
            if (zero[e_]) {                                                                                \
                for (int v = 0; v < (NVX); v++) ACT[v] = ACT[v] + (VF)((VI)vone & (xe_[v] > vzero));       \
            } else {                                                                                       \
                FIXED += 1.0f;                                                                             \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

/* One tile of one layer (nt <= UNITS x UNIT steps, x rows UNITS x UNIT floats), every placement: GPU g sums
 * slots bounds[g] .. bounds[g+1]-1. */
#define TILE_PLACEMENTS(NAME, UNITS, W, ATTR)                                                              \
    ATTR static void NAME(const Job *jb, const float *x, const unsigned char *zero, i64 l, i64 t0, i64 nt) { \
        enum { NVX = (UNITS) * UNIT / (W) };                                                               \
        const i64 K = jb->K, P = jb->P, G = jb->G, n = jb->n, L = jb->L;                                   \
        const vf##W vzero = {0}, vone = vzero + 1.0f;                                                      \
        for (i64 k = 0; k < K; k++) {                                                                      \
            const i64 *expert = jb->expert + (l * K + k) * P;                                              \
            const float *share = jb->share + (l * K + k) * P;                                              \
            const i64 *bounds = jb->bounds + k * (G + 1);                                                  \
            vf##W mx[NVX], mn[NVX], am[NVX];                                                               \
            for (int v = 0; v < NVX; v++) mx[v] = mn[v] = am[v] = vzero; /* G >= 1: set by GPU 0 */        \
            for (i64 g = 0; g < G; g++) {                                                                  \
                vf##W acc[NVX], act[NVX];                                                                  \
                for (int v = 0; v < NVX; v++) acc[v] = act[v] = vzero;                                     \
                float fixed = 0.0f;                                                                        \
                for (i64 s = bounds[g]; s < bounds[g + 1]; s++)                                            \
                    ADD_SLOT(vi##W, vf##W, acc, act, fixed, s, NVX, (UNITS) * UNIT);                       \
                for (int v = 0; v < NVX; v++) act[v] = act[v] + fixed;                                     \
                if (g == 0) {                                                                              \
                    for (int v = 0; v < NVX; v++) mx[v] = mn[v] = acc[v], am[v] = act[v];                  \
                } else {                                                                                   \
                    for (int v = 0; v < NVX; v++) {                                                        \
                        mx[v] = VMAX(vi##W, vf##W, acc[v], mx[v]);                                         \
                        mn[v] = VMIN(vi##W, vf##W, acc[v], mn[v]);                                         \
                        am[v] = VMAX(vi##W, vf##W, act[v], am[v]);                                         \
                    }                                                                                      \
                }                                                                                          \
                if (jb->rows) {                                                                            \
                    float a[(UNITS) * UNIT], c[(UNITS) * UNIT];                                            \
                    memcpy(a, acc, sizeof a);                                                              \
                    memcpy(c, act, sizeof c);                                                              \
                    for (i64 j = 0; j < nt; j++) {                                                         \
                        i64 o = ((k * n + t0 + j) * L + l) * G + g;                                        \
                        jb->rows[o] = a[j];                                                                \
                        jb->active[o] = c[j];                                                              \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            float hi[(UNITS) * UNIT], lo[(UNITS) * UNIT], most[(UNITS) * UNIT];                            \
            memcpy(hi, mx, sizeof hi);                                                                     \
            memcpy(lo, mn, sizeof lo);                                                                     \
            memcpy(most, am, sizeof most);                                                                 \
            for (i64 j = 0; j < nt; j++) {                                                                 \
                i64 o = (k * n + t0 + j) * L + l;                                                          \
                jb->rmax[o] = hi[j];                                                                       \
                jb->rmin[o] = lo[j];                                                                       \
                jb->amax[o] = most[j];                                                                     \
                double mean = jb->total[(t0 + j) * L + l] / (double)G;                                     \
                jb->lb[o] = mean > 0 ? (double)hi[j] / mean : 1.0;                                         \
            }                                                                                              \
        }                                                                                                  \
    }

/* Everything for one vector width: loaders per count type, placements per tile width, and dispatchers. */
#define ISA(SUF, W, ATTR)                                                                                  \
    LOAD_TILE(load_u8_##SUF, uint8_t, 1, W, ATTR)                                                          \
    LOAD_TILE(load_u16_##SUF, uint16_t, 1, W, ATTR)                                                        \
    LOAD_TILE(load_u32_##SUF, uint32_t, 0, W, ATTR)                                                        \
    LOAD_TILE(load_i32_##SUF, int32_t, 0, W, ATTR)                                                         \
    LOAD_TILE(load_i64_##SUF, int64_t, 0, W, ATTR)                                                         \
    LOAD_TILE(load_f32_##SUF, float, 0, W, ATTR)                                                           \
    TILE_PLACEMENTS(place1_##SUF, 1, W, ATTR)                                                              \
    TILE_PLACEMENTS(place2_##SUF, 2, W, ATTR)                                                              \
    TILE_PLACEMENTS(place3_##SUF, 3, W, ATTR)                                                              \
    TILE_PLACEMENTS(place4_##SUF, 4, W, ATTR)                                                              \
    static void load_##SUF(const Job *jb, i64 l, i64 t0, i64 nt, i64 tw, float *x, unsigned char *zero) {  \
        i64 L = jb->L, E = jb->E;                                                                          \
        double *tot = jb->total;                                                                           \
        int have = jb->have_total;                                                                         \
        switch (jb->kind) {                                                                                \
            case 'B': load_u8_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;           \
            case 'H': load_u16_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;          \
            case 'I': load_u32_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;          \
            case 'i': load_i32_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;          \
            case 'q': load_i64_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;          \
            default: load_f32_##SUF(jb->counts, L, E, l, t0, nt, tw, x, zero, tot, have); break;           \
        }                                                                                                  \
    }                                                                                                      \
    static void place_##SUF(const Job *jb, const float *x, const unsigned char *zero, i64 l, i64 t0, i64 nt) { \
        switch ((nt + UNIT - 1) / UNIT) {                                                                  \
            case 1: place1_##SUF(jb, x, zero, l, t0, nt); break;                                           \
            case 2: place2_##SUF(jb, x, zero, l, t0, nt); break;                                           \
            case 3: place3_##SUF(jb, x, zero, l, t0, nt); break;                                           \
            default: place4_##SUF(jb, x, zero, l, t0, nt); break;                                          \
        }                                                                                                  \
    }

ISA(base, 4, )
#ifdef EPLB_X86
ISA(avx2, 8, __attribute__((target("avx2"))))
ISA(avx512, 16, __attribute__((target("avx512f"))))
#endif

#else /* no vector extensions */

/* x[e][j], zero[e] and total[t0 + j][l] as LOAD_TILE, one step at a time */
#define LOAD_ROW(T, ACC)                                                                                   \
    {                                                                                                      \
        const T *src = (const T *)jb->counts + ((t0 + j) * jb->L + l) * E;                                 \
        ACC s = 0;                                                                                         \
        for (i64 e = 0; e < E; e++) {                                                                      \
            float v = (float)src[e];                                                                       \
            x[e * tw + j] = v;                                                                             \
            zero[e] |= v <= 0.0f;                                                                          \
            s += (ACC)src[e];                                                                              \
        }                                                                                                  \
        if (!jb->have_total) jb->total[(t0 + j) * jb->L + l] = (double)s;                                  \
    }

static void load_base(const Job *jb, i64 l, i64 t0, i64 nt, i64 tw, float *x, unsigned char *zero) {
    const i64 E = jb->E;
    memset(zero, 0, (size_t)E);
    for (i64 j = 0; j < tw; j++) {
        if (j >= nt) {
            for (i64 e = 0; e < E; e++) x[e * tw + j] = 0.0f;
            continue;
        }
        switch (jb->kind) {
            case 'B': LOAD_ROW(uint8_t, i64) break;
            case 'H': LOAD_ROW(uint16_t, i64) break;
            case 'I': LOAD_ROW(uint32_t, i64) break;
            case 'i': LOAD_ROW(int32_t, i64) break;
            case 'q': LOAD_ROW(int64_t, i64) break;
            default: LOAD_ROW(float, double) break;
        }
    }
}

static void place_base(const Job *jb, const float *x, const unsigned char *zero, i64 l, i64 t0, i64 nt) {
    const i64 K = jb->K, P = jb->P, G = jb->G, n = jb->n, L = jb->L, tw = (nt + UNIT - 1) / UNIT * UNIT;
    for (i64 k = 0; k < K; k++) {
        const i64 *expert = jb->expert + (l * K + k) * P;
        const float *share = jb->share + (l * K + k) * P;
        const i64 *bounds = jb->bounds + k * (G + 1);
        float mx[TILE], mn[TILE], am[TILE];
        for (i64 g = 0; g < G; g++) {
            float acc[TILE] = {0}, act[TILE] = {0}, fixed = 0.0f;
            for (i64 s = bounds[g]; s < bounds[g + 1]; s++) {
                const float w = share[s];
                if (w <= 0.0f) continue;
                const float *xe = x + expert[s] * tw;
                for (i64 j = 0; j < nt; j++) acc[j] = acc[j] + xe[j] * w;
                if (zero[expert[s]]) {
                    for (i64 j = 0; j < nt; j++) act[j] += xe[j] > 0.0f ? 1.0f : 0.0f;
                } else {
                    fixed += 1.0f;
                }
            }
            for (i64 j = 0; j < nt; j++) {
                act[j] += fixed;
                mx[j] = g == 0 || acc[j] > mx[j] ? acc[j] : mx[j];
                mn[j] = g == 0 || acc[j] < mn[j] ? acc[j] : mn[j];
                am[j] = g == 0 || act[j] > am[j] ? act[j] : am[j];
                if (jb->rows) {
                    i64 o = ((k * n + t0 + j) * L + l) * G + g;
                    jb->rows[o] = acc[j];
                    jb->active[o] = act[j];
                }
            }
        }
        for (i64 j = 0; j < nt; j++) {
            i64 o = (k * n + t0 + j) * L + l;
            jb->rmax[o] = mx[j];
            jb->rmin[o] = mn[j];
            jb->amax[o] = am[j];
            double mean = jb->total[(t0 + j) * L + l] / (double)G;
            jb->lb[o] = mean > 0 ? (double)mx[j] / mean : 1.0;
        }
    }
}

#endif /* EPLB_VECTORS */

static load_fn load_tile = load_base;
static place_fn tile_placements = place_base;
#ifdef EPLB_VECTORS
static const char *isa_name = "base";
#else
static const char *isa_name = "scalar";
#endif

static void pick_isa(void) {
#ifdef EPLB_X86
    const char *want = getenv("EPLB_EVALUATE_ISA");
    int cap = 2; /* 0 base, 1 avx2, 2 avx512 */
    if (want && !strcmp(want, "base")) cap = 0;
    if (want && !strcmp(want, "avx2")) cap = 1;
    __builtin_cpu_init();
    if (cap >= 2 && __builtin_cpu_supports("avx512f")) {
        load_tile = load_avx512, tile_placements = place_avx512, isa_name = "avx512";
    } else if (cap >= 1 && __builtin_cpu_supports("avx2")) {
        load_tile = load_avx2, tile_placements = place_avx2, isa_name = "avx2";
    }
#endif
}

/* The counts of layer l's tile, one row of E counts per step, rows L x E apart: fetched ahead into cache. */
static void prefetch_tile(const Job *jb, i64 l, i64 t0, i64 nt) {
    const char *base = (const char *)jb->counts;
    i64 size = jb->kind == 'B' ? 1 : jb->kind == 'H' ? 2 : jb->kind == 'q' ? 8 : 4;
    i64 row = jb->E * size;
    for (i64 j = 0; j < nt; j++) {
        const char *src = base + ((t0 + j) * jb->L + l) * row;
#ifdef EPLB_VECTORS
        for (i64 b = 0; b < row; b += 64) __builtin_prefetch(src + b);
#else
        (void)src;
#endif
    }
}

static void free_tile(float *x) {
#ifdef _WIN32
    _aligned_free(x);
#else
    free(x);
#endif
}

static void *run_job(void *arg) {
    Job *jb = arg;
    size_t bytes = sizeof(float) * (size_t)jb->E * TILE;
#ifdef _WIN32
    float *x = _aligned_malloc(bytes, 64);
#else
    float *x = NULL;
    if (posix_memalign((void **)&x, 64, bytes) != 0) x = NULL;
#endif
    unsigned char *zero = malloc((size_t)jb->E);
    if (!x || !zero) {
        jb->failed = 1;
        free_tile(x);
        free(zero);
        return NULL;
    }
    for (i64 t0 = 0; t0 < jb->n; t0 += TILE) {
        i64 nt = jb->n - t0 < TILE ? jb->n - t0 : TILE;
        i64 tw = (nt + UNIT - 1) / UNIT * UNIT; /* x[E][tw] */
        for (i64 l = jb->l0; l < jb->l1; l++) {
            load_tile(jb, l, t0, nt, tw, x, zero);
            if (l + 1 < jb->l1) prefetch_tile(jb, l + 1, t0, nt); /* its rows arrive while this layer sums */
            tile_placements(jb, x, zero, l, t0, nt);
        }
    }
    free_tile(x);
    free(zero);
    return NULL;
}

static Py_ssize_t kind_size(int kind) {
    switch (kind) {
        case 'B': return 1;
        case 'H': return 2;
        case 'I': case 'i': case 'f': return 4;
        case 'q': return 8;
        default: return 0;
    }
}

#define MAX_THREADS 64

static const char evaluate_doc[] =
    "evaluate(counts, kind, steps, layers, experts, expert, share, placements, slots, bounds, gpus, total, "
    "have_total, lb, rmax, rmin, amax, rows, active, threads)\n\n"
    "counts: C-contiguous [n, L, E] of kind 'B' (uint8), 'H' (uint16), 'I' (uint32), 'i' (int32), 'q' (int64) "
    "or 'f' (float32); expert: int64 [L, K, P] expert in each slot of each of K placements (padded); share: "
    "float32 [L, K, P] (0 for padding); bounds: int64 [K, G + 1] first slot of each GPU. total: float64 [n, L], "
    "the layer's summed counts per step, read if have_total else written (kind 'f' needs have_total). Writes "
    "float64 lb and float32 rmax, rmin, amax [K, n, L] (lb, busiest and idlest GPU's rows, most active slots) "
    "and, unless None, rows and active [K, n, L, G]. threads: layers are split over this many threads.";

static PyObject *evaluate(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oc, *oexp, *oshare, *obounds, *ototal, *olb, *ormax, *ormin, *oamax, *orows, *oactive;
    int kind, have_total, threads;
    Py_ssize_t L, E, n, K, P, G;
    if (!PyArg_ParseTuple(args, "OCnnnOOnnOnOpOOOOOOi", &oc, &kind, &n, &L, &E, &oexp, &oshare, &K, &P, &obounds,
                          &G, &ototal, &have_total, &olb, &ormax, &ormin, &oamax, &orows, &oactive, &threads))
        return NULL;
    Py_ssize_t size = kind_size(kind);
    if (!size) {
        PyErr_SetString(PyExc_ValueError, "evaluate: kind must be one of B, H, I, i, q, f");
        return NULL;
    }
    if (L < 0 || E < 1 || n < 0 || K < 1 || P < 0 || G < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "evaluate: bad sizes");
        return NULL;
    }
    if (kind == 'f' && !have_total) {
        PyErr_SetString(PyExc_ValueError, "evaluate: float32 counts need their totals (have_total)");
        return NULL;
    }
    if ((orows == Py_None) != (oactive == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "evaluate: rows and active are both None or both arrays");
        return NULL;
    }
    Py_buffer bc, be, bs, bb, btot, blb, bmax, bmin, bam, brows = {0}, bact = {0};
    int have_rows = orows != Py_None;
    PyObject *ret = NULL;
    if (get_buf(oc, &bc, size, n * L * E, 0, "counts") < 0) return NULL;
    if (get_buf(oexp, &be, 8, L * K * P, 0, "expert") < 0) goto fail_c;
    if (get_buf(oshare, &bs, 4, L * K * P, 0, "share") < 0) goto fail_e;
    if (get_buf(obounds, &bb, 8, K * (G + 1), 0, "bounds") < 0) goto fail_s;
    if (get_buf(ototal, &btot, 8, n * L, 1, "total") < 0) goto fail_b;
    if (get_buf(olb, &blb, 8, K * n * L, 1, "lb") < 0) goto fail_tot;
    if (get_buf(ormax, &bmax, 4, K * n * L, 1, "rmax") < 0) goto fail_lb;
    if (get_buf(ormin, &bmin, 4, K * n * L, 1, "rmin") < 0) goto fail_max;
    if (get_buf(oamax, &bam, 4, K * n * L, 1, "amax") < 0) goto fail_min;
    if (have_rows && get_buf(orows, &brows, 4, K * n * L * G, 1, "rows") < 0) goto fail_am;
    if (have_rows && get_buf(oactive, &bact, 4, K * n * L * G, 1, "active") < 0) goto fail_rows;
    const i64 *bounds = (const i64 *)bb.buf;
    for (Py_ssize_t k = 0; k < K; k++)
        for (Py_ssize_t g = 0; g < G; g++)
            if (bounds[k * (G + 1)] != 0 || bounds[k * (G + 1) + g] > bounds[k * (G + 1) + g + 1] ||
                bounds[k * (G + 1) + G] > P) {
                PyErr_SetString(PyExc_ValueError, "evaluate: bounds must rise from 0 to at most P");
                goto fail_all;
            }
    const i64 *expert = (const i64 *)be.buf;
    for (Py_ssize_t i = 0; i < L * K * P; i++)
        if (expert[i] < 0 || expert[i] >= E) {
            PyErr_SetString(PyExc_ValueError, "evaluate: expert ids must be in [0, E)");
            goto fail_all;
        }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > L) threads = L > 0 ? (int)L : 1;
#ifndef EPLB_THREADS
    threads = 1;
#endif
    Job jobs[MAX_THREADS];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (Job){bc.buf, kind, n, L, E, K, P, G, expert, (const float *)bs.buf, bounds,
                        (double *)btot.buf, have_total, (double *)blb.buf, (float *)bmax.buf, (float *)bmin.buf,
                        (float *)bam.buf, have_rows ? (float *)brows.buf : NULL,
                        have_rows ? (float *)bact.buf : NULL, L * i / threads, L * (i + 1) / threads, 0};
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS;
#ifdef EPLB_THREADS
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], NULL, run_job, &jobs[i]) == 0;
    for (int i = 1; i < threads; i++)
        if (!started[i]) run_job(&jobs[i]); /* no thread: this one does its layers */
    run_job(&jobs[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(tid[i], NULL);
#else
    run_job(&jobs[0]);
#endif
    Py_END_ALLOW_THREADS;
    for (int i = 0; i < threads; i++) failed |= jobs[i].failed;
    if (failed) {
        PyErr_NoMemory();
        goto fail_all;
    }
    Py_INCREF(Py_None);
    ret = Py_None;
fail_all:
    if (have_rows) PyBuffer_Release(&bact);
fail_rows:
    if (have_rows) PyBuffer_Release(&brows);
fail_am:
    PyBuffer_Release(&bam);
fail_min:
    PyBuffer_Release(&bmin);
fail_max:
    PyBuffer_Release(&bmax);
fail_lb:
    PyBuffer_Release(&blb);
fail_tot:
    PyBuffer_Release(&btot);
fail_b:
    PyBuffer_Release(&bb);
fail_s:
    PyBuffer_Release(&bs);
fail_e:
    PyBuffer_Release(&be);
fail_c:
    PyBuffer_Release(&bc);
    return ret;
}

static PyMethodDef methods[] = {
    {"evaluate", evaluate, METH_VARARGS, evaluate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_evaluate",
                                    "Replay evaluation's compiled pass (eplb/replay/_evaluate.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__evaluate(void) {
    pick_isa();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "instruction_set", isa_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
