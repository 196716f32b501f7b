/* GPU loads of several placements for a block of steps: the inner loop of replay evaluation
 * (eplb/replay/evaluate.py; built by `pip install -e .`).
 *
 * Layout: a tile of up to 64 steps of one layer is transposed to x[E][steps] (float32, cache-resident)
 * so that every slot adds one contiguous run of steps, x[e][..] x share, to its GPU's accumulator: a
 * gather of one expert row per slot and a segment sum per GPU, vectorized over steps by the compiler. No numpy headers: buffers
 * come through the Python buffer protocol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

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

/* One layer, one placement: GPU g sums slots bounds[g] .. bounds[g+1]-1. Writes the busiest and idlest
 * GPU's rows and the most active slots per step, and optionally every GPU's rows and active slots. */
static void one_placement(const float *x, i64 n, const i64 *expert, const float *share, const i64 *bounds,
                          i64 gpus, int has_zero, float *acc, float *act, float *rmax, float *rmin, float *amax,
                          float *rows_out, float *active_out, i64 stride) {
    for (i64 g = 0; g < gpus; g++) {
        memset(acc, 0, (size_t)n * sizeof(float));
        float fixed = 0.0f; /* active slots when no expert has a zero count: slots with a share > 0 */
        if (has_zero) memset(act, 0, (size_t)n * sizeof(float));
        for (i64 s = bounds[g]; s < bounds[g + 1]; s++) {
            const float *xe = x + expert[s] * n;
            const float w = share[s];
            if (w <= 0.0f) continue;
            for (i64 t = 0; t < n; t++) acc[t] += xe[t] * w;
            if (has_zero) {
                for (i64 t = 0; t < n; t++) act[t] += xe[t] > 0.0f ? 1.0f : 0.0f;
            } else {
                fixed += 1.0f;
            }
        }
        if (!has_zero)
            for (i64 t = 0; t < n; t++) act[t] = fixed;
        if (g == 0) {
            memcpy(rmax, acc, (size_t)n * sizeof(float));
            memcpy(rmin, acc, (size_t)n * sizeof(float));
            memcpy(amax, act, (size_t)n * sizeof(float));
        } else {
            for (i64 t = 0; t < n; t++) {
                rmax[t] = acc[t] > rmax[t] ? acc[t] : rmax[t];
                rmin[t] = acc[t] < rmin[t] ? acc[t] : rmin[t];
                amax[t] = act[t] > amax[t] ? act[t] : amax[t];
            }
        }
        if (rows_out) memcpy(rows_out + g * stride, acc, (size_t)n * sizeof(float));
        if (active_out) memcpy(active_out + g * stride, act, (size_t)n * sizeof(float));
    }
}

#define STEP_TILE 64

/* x[e][j] = counts[t0 + j][l][e] as float32, j < nt: one layer's tile of steps, steps last. */
#define TILE_BODY(T)                                                                               \
    for (i64 j = 0; j < nt; j++) {                                                                 \
        const T *src = (const T *)counts + ((t0 + j) * L + l) * E;                                 \
        for (i64 e = 0; e < E; e++) x[e * nt + j] = (float)src[e];                                 \
    }

static void load_tile(const void *counts, int kind, i64 L, i64 E, i64 l, i64 t0, i64 nt, float *x) {
    switch (kind) {
        case 'B': TILE_BODY(uint8_t) break;
        case 'H': TILE_BODY(uint16_t) break;
        case 'I': TILE_BODY(uint32_t) break;
        case 'i': TILE_BODY(int32_t) break;
        case 'q': TILE_BODY(int64_t) break;
        default: TILE_BODY(float) break;
    }
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

static const char gpu_loads_doc[] =
    "gpu_loads(counts, kind, steps, layers, experts, expert, share, placements, slots, bounds, gpus, rmax, "
    "rmin, amax, rows, active)\n\n"
    "counts: C-contiguous [n, L, E] of kind 'B' (uint8), 'H' (uint16), 'I' (uint32), 'i' (int32), 'q' (int64) "
    "or 'f' (float32); expert: int64 [L, K, P] expert in each slot of each of K placements (padded); share: "
    "float32 [L, K, P] (0 for padding); bounds: int64 [K, G + 1] first slot of each GPU. Writes float32 rmax, "
    "rmin, amax [L, K, n] (busiest and idlest GPU's rows, most active slots) and, unless None, rows and "
    "active [L, K, G, n].";

static PyObject *gpu_loads(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oc, *oexp, *oshare, *obounds, *ormax, *ormin, *oamax, *orows, *oactive;
    int kind;
    Py_ssize_t L, E, n, K, P, G;
    if (!PyArg_ParseTuple(args, "OCnnnOOnnOnOOOOO", &oc, &kind, &n, &L, &E, &oexp, &oshare, &K, &P, &obounds, &G,
                          &ormax, &ormin, &oamax, &orows, &oactive))
        return NULL;
    Py_ssize_t size = kind_size(kind);
    if (!size) {
        PyErr_SetString(PyExc_ValueError, "gpu_loads: kind must be one of B, H, I, i, q, f");
        return NULL;
    }
    if (L < 0 || E < 1 || n < 0 || K < 1 || P < 0 || G < 1) {
        PyErr_SetString(PyExc_ValueError, "gpu_loads: bad sizes");
        return NULL;
    }
    Py_buffer bc, be, bs, bb, bmax, bmin, bam, brows = {0}, bact = {0};
    int have_rows = orows != Py_None, have_act = oactive != Py_None;
    if (get_buf(oc, &bc, size, n * L * E, 0, "counts") < 0) return NULL;
    if (get_buf(oexp, &be, 8, L * K * P, 0, "expert") < 0) goto fail_c;
    if (get_buf(oshare, &bs, 4, L * K * P, 0, "share") < 0) goto fail_e;
    if (get_buf(obounds, &bb, 8, K * (G + 1), 0, "bounds") < 0) goto fail_s;
    if (get_buf(ormax, &bmax, 4, L * K * n, 1, "rmax") < 0) goto fail_b;
    if (get_buf(ormin, &bmin, 4, L * K * n, 1, "rmin") < 0) goto fail_max;
    if (get_buf(oamax, &bam, 4, L * K * n, 1, "amax") < 0) goto fail_min;
    if (have_rows && get_buf(orows, &brows, 4, L * K * G * n, 1, "rows") < 0) goto fail_am;
    if (have_act && get_buf(oactive, &bact, 4, L * K * G * n, 1, "active") < 0) goto fail_rows;
    const i64 *bounds = (const i64 *)bb.buf;
    for (Py_ssize_t k = 0; k < K; k++)
        for (Py_ssize_t g = 0; g < G; g++)
            if (bounds[k * (G + 1)] != 0 || bounds[k * (G + 1) + g] > bounds[k * (G + 1) + g + 1] ||
                bounds[k * (G + 1) + G] > P) {
                PyErr_SetString(PyExc_ValueError, "gpu_loads: bounds must rise from 0 to at most P");
                goto fail_all;
            }
    const i64 *expert = (const i64 *)be.buf;
    for (Py_ssize_t i = 0; i < L * K * P; i++)
        if (expert[i] < 0 || expert[i] >= E) {
            PyErr_SetString(PyExc_ValueError, "gpu_loads: expert ids must be in [0, E)");
            goto fail_all;
        }
    float *work = malloc(sizeof(float) * (size_t)(E + 2) * STEP_TILE);
    if (!work) {
        PyErr_NoMemory();
        goto fail_all;
    }
    Py_BEGIN_ALLOW_THREADS;
    const float *share = (const float *)bs.buf;
    float *x = work, *acc = work + E * STEP_TILE, *act = acc + STEP_TILE;
    for (i64 t0 = 0; t0 < n; t0 += STEP_TILE) {
        i64 nt = n - t0 < STEP_TILE ? n - t0 : STEP_TILE;
        for (i64 l = 0; l < L; l++) {
            load_tile(bc.buf, kind, L, E, l, t0, nt, x);
            int has_zero = 0;
            for (i64 i = 0; i < E * nt; i++) has_zero |= x[i] <= 0.0f;
            for (i64 k = 0; k < K; k++) {
                i64 lk = l * K + k;
                one_placement(x, nt, expert + lk * P, share + lk * P, bounds + k * (G + 1), G, has_zero, acc, act,
                              (float *)bmax.buf + lk * n + t0, (float *)bmin.buf + lk * n + t0,
                              (float *)bam.buf + lk * n + t0, have_rows ? (float *)brows.buf + lk * G * n + t0 : NULL,
                              have_act ? (float *)bact.buf + lk * G * n + t0 : NULL, n);
            }
        }
    }
    Py_END_ALLOW_THREADS;
    free(work);
    if (have_act) PyBuffer_Release(&bact);
    if (have_rows) PyBuffer_Release(&brows);
    PyBuffer_Release(&bam);
    PyBuffer_Release(&bmin);
    PyBuffer_Release(&bmax);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&be);
    PyBuffer_Release(&bc);
    Py_RETURN_NONE;
fail_all:
    if (have_act) PyBuffer_Release(&bact);
fail_rows:
    if (have_rows) PyBuffer_Release(&brows);
fail_am:
    PyBuffer_Release(&bam);
fail_min:
    PyBuffer_Release(&bmin);
fail_max:
    PyBuffer_Release(&bmax);
fail_b:
    PyBuffer_Release(&bb);
fail_s:
    PyBuffer_Release(&bs);
fail_e:
    PyBuffer_Release(&be);
fail_c:
    PyBuffer_Release(&bc);
    return NULL;
}

static PyMethodDef methods[] = {
    {"gpu_loads", gpu_loads, METH_VARARGS, gpu_loads_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_evaluate",
                                    "Replay evaluation inner loop (eplb/replay/_evaluate.c).", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__evaluate(void) { return PyModule_Create(&module); }
