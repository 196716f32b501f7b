/* The GPUs (and nodes) each token's top-k picks reach: the compiled loop of eplb/coactivation.py's
 * `step_reach`, `copies_per_token` and `replica_gpus` (built by `pip install -e .`).
 *
 * One pass over the tokens, layer by layer inside each token: the token's k picks are routed to a replica
 * with the rule (vLLM's, SGLang's static dispatch or ours, "coact"; eplb/coactivation.py's module docstring)
 * exactly as the numpy reference (`_replica_gpus`) routes them, then the distinct GPUs and nodes among them
 * are found with stamps (a GPU's stamp is the last token-layer that reached it), so no [tokens, layers, k]
 * or [tokens, layers, G] temporaries are built. A token's position (vLLM's flat pick position and its source
 * GPU) counts from its own step's start (offsets).
 *
 * Modes (what `out` receives, int64):
 *   0 reach:  [n, L, G + N] tokens of each step that reach each GPU, then each node (N = 0: GPUs only);
 *   1 copies: [L, 4] sums over tokens of the distinct GPUs, distinct GPUs with the source GPU, distinct nodes,
 *             distinct nodes with the source's node;
 *   2 gpus:   [T, L, k] the GPU each pick is served on.
 * An expert id outside [0, E) or without a replica in its layer makes route() return None, out partly
 * written (the Python side names the pick).
 *
 * counts() is the same pass for eplb.io.logs: each step's picks per layer and expert, checking every id is in
 * [0, E) and named once per token and layer.
 *
 * Buffers through the buffer protocol (solvers/_buffer.h; no numpy headers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../solvers/_buffer.h"

typedef int64_t i64;

enum { RULE_VLLM = 0, RULE_SGLANG = 1, RULE_COACT = 2 };
enum { MODE_REACH = 0, MODE_COPIES = 1, MODE_GPUS = 2 };

#define MAX_K 64 /* picks per token */

typedef struct {
    const void *ids; /* [T, L, k] of itemsize isz */
    int isz;
    i64 T, L, k, n;
    const i64 *offsets; /* [n + 1] */
    const i64 *table;   /* [L, E, R] GPU of each replica in slot order, -1 padded */
    const i64 *count;   /* [L, E] replicas */
    i64 E, R, G, per_node, N;
    int rule, mode;
    i64 *out;
} Job;

static inline i64 id_at(const void *ids, int isz, i64 i) {
    switch (isz) {
        case 2: return ((const int16_t *)ids)[i];
        case 4: return ((const int32_t *)ids)[i];
        default: return ((const int64_t *)ids)[i];
    }
}

/* g[0..k-1]: the GPUs of one token's picks e[0..k-1] in one layer (table row base tab, counts cnt) */
static inline void route_picks(const Job *jb, const i64 *e, const i64 *tab, const i64 *cnt, i64 pos, i64 src,
                               i64 *g) {
    const i64 k = jb->k, R = jb->R;
    for (i64 j = 0; j < k; j++) {
        const i64 c = cnt[e[j]]; /* most experts have one replica: no division */
        g[j] = tab[e[j] * R + (c == 1 ? 0 : (i64)((uint64_t)(pos * k + j) % (uint64_t)c))];
    }
    if (jb->rule == RULE_VLLM || R == 1) return;
    if (jb->rule == RULE_SGLANG) {
        for (i64 j = 0; j < k; j++) {
            const i64 *reps = tab + e[j] * R;
            i64 c = cnt[e[j]], local = 0;
            for (i64 r = 0; r < c; r++) local |= reps[r] == src;
            g[j] = local ? src : reps[src % c];
        }
        return;
    }
    /* coact: the first replica (slot order) on a GPU the token already visits: its own GPU or one of its
     * single-replica picks' GPUs; else vLLM's choice (already in g) */
    i64 visited[MAX_K + 1];
    int nv = 0;
    visited[nv++] = src;
    for (i64 j = 0; j < k; j++)
        if (cnt[e[j]] == 1) visited[nv++] = tab[e[j] * R];
    for (i64 j = 0; j < k; j++) {
        const i64 *reps = tab + e[j] * R;
        i64 c = cnt[e[j]];
        if (c == 1) continue; /* its own GPU, visited */
        for (i64 r = 0; r < c; r++) {
            int hit = 0;
            for (int v = 0; v < nv; v++) hit |= visited[v] == reps[r];
            if (hit) {
                g[j] = reps[r];
                break;
            }
        }
    }
}

/* 0, or -1 for a bad pick */
static int run(const Job *jb, i64 *stamp_gpu, i64 *stamp_node) {
    const i64 L = jb->L, k = jb->k, G = jb->G, N = jb->N, E = jb->E, per_node = jb->per_node;
    const i64 width = G + N;
    i64 e[MAX_K], g[MAX_K];
    i64 mark = 0;
    for (i64 s = 0; s < jb->n; s++) {
        const i64 a = jb->offsets[s], b = jb->offsets[s + 1];
        for (i64 t = a; t < b; t++) {
            const i64 pos = t - a, src = pos % G;
            for (i64 l = 0; l < L; l++) {
                const i64 base = (t * L + l) * k;
                const i64 *cnt = jb->count + l * E;
                for (i64 j = 0; j < k; j++) {
                    e[j] = id_at(jb->ids, jb->isz, base + j);
                    if (e[j] < 0 || e[j] >= E || cnt[e[j]] < 1) return -1;
                }
                route_picks(jb, e, jb->table + l * E * jb->R, cnt, pos, src, g);
                if (jb->mode == MODE_GPUS) {
                    memcpy(jb->out + base, g, (size_t)k * sizeof(i64));
                    continue;
                }
                mark++;
                i64 gpus = 0, nodes = 0;
                i64 *row = jb->mode == MODE_REACH ? jb->out + (s * L + l) * width : NULL;
                for (i64 j = 0; j < k; j++) {
                    if (stamp_gpu[g[j]] != mark) {
                        stamp_gpu[g[j]] = mark;
                        gpus++;
                        if (row) row[g[j]]++;
                    }
                    i64 node = g[j] / per_node;
                    if (stamp_node[node] != mark) {
                        stamp_node[node] = mark;
                        nodes++;
                        if (row && N) row[G + node]++;
                    }
                }
                if (jb->mode == MODE_COPIES) {
                    i64 *sums = jb->out + l * 4;
                    sums[0] += gpus;
                    sums[1] += gpus + (stamp_gpu[src] != mark);
                    sums[2] += nodes;
                    sums[3] += nodes + (stamp_node[src / per_node] != mark);
                }
            }
        }
    }
    return 0;
}

static const char route_doc[] =
    "route(ids, tokens, layers, k, offsets, steps, table, count, experts, width, rule, gpus, gpus_per_node, "
    "nodes, mode, out) -> True, or None on an expert id outside [0, experts) or without a replica\n\n"
    "ids: C-contiguous int16, int32 or int64 [tokens, layers, k]; offsets: int64 [steps + 1] token offsets of the "
    "steps, rising from 0 to tokens; table: int64 [layers, experts, width] GPU of each replica in slot order, -1 "
    "padded; count: int64 [layers, experts] replicas; rule: 0 vllm, 1 sglang, 2 coact; nodes: 0 (no node "
    "columns in mode 0) or gpus / gpus_per_node. mode 0: out int64 [steps, layers, gpus + nodes] tokens per step "
    "reaching each GPU and node, added to; 1: [layers, 4] summed distinct GPUs, GPUs with the source, nodes, "
    "nodes with the source's, added to; 2: [tokens, layers, k] each pick's GPU.";

static PyObject *route(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oids, *ooff, *otab, *ocnt, *oout;
    Py_ssize_t T, L, k, n, E, R, G, per_node, N;
    int rule, mode;
    if (!PyArg_ParseTuple(args, "OnnnOnOOnninnniO", &oids, &T, &L, &k, &ooff, &n, &otab, &ocnt, &E, &R, &rule, &G,
                          &per_node, &N, &mode, &oout))
        return NULL;
    if (T < 0 || L < 0 || k < 1 || k > MAX_K || n < 0 || E < 1 || R < 1 || G < 1 || per_node < 1 ||
        G % per_node || (N != 0 && N != G / per_node) || rule < 0 || rule > 2 || mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "route: bad sizes, rule or mode");
        return NULL;
    }
    Py_buffer ids;
    if (PyObject_GetBuffer(oids, &ids, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((ids.itemsize != 2 && ids.itemsize != 4 && ids.itemsize != 8) || ids.len != ids.itemsize * T * L * k) {
        PyErr_SetString(PyExc_ValueError, "route: ids must be [tokens, layers, k] of 2, 4 or 8 byte integers");
        PyBuffer_Release(&ids);
        return NULL;
    }
    Py_ssize_t out_items = mode == MODE_REACH ? n * L * (G + N) : mode == MODE_COPIES ? L * 4 : T * L * k;
    BufferSpec spec[] = {
        {ooff, 8, n + 1, 0, "offsets"},
        {otab, 8, L * E * R, 0, "table"},
        {ocnt, 8, L * E, 0, "count"},
        {oout, 8, out_items, 1, "out"},
    };
    Py_buffer views[4];
    if (buffers(spec, 4, views) < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    PyObject *ret = NULL;
    const i64 *offsets = (const i64 *)views[0].buf;
    int ok = n >= 0 && offsets[0] == 0 && offsets[n] == T;
    for (Py_ssize_t s = 0; ok && s < n; s++) ok = offsets[s] <= offsets[s + 1];
    const i64 *table = (const i64 *)views[1].buf, *count = (const i64 *)views[2].buf;
    for (Py_ssize_t i = 0; ok && i < L * E; i++) {
        ok = count[i] >= 0 && count[i] <= R;
        for (Py_ssize_t r = 0; ok && r < count[i]; r++) ok = table[i * R + r] >= 0 && table[i * R + r] < G;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "route: offsets must rise from 0 to tokens, replicas lie on GPUs 0..G-1");
        goto done;
    }
    i64 *stamps = calloc((size_t)(G + G / per_node), sizeof(i64));
    if (!stamps) {
        PyErr_NoMemory();
        goto done;
    }
    Job jb = {ids.buf, (int)ids.itemsize, T, L, k, n, offsets, table, count, E, R, G, per_node, N, rule, mode,
              (i64 *)views[3].buf};
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = run(&jb, stamps, stamps + G);
    Py_END_ALLOW_THREADS;
    free(stamps);
    ret = rc == 0 ? Py_True : Py_None;
    Py_INCREF(ret);
done:
    release_buffers(views, 4);
    PyBuffer_Release(&ids);
    return ret;
}

static const char counts_doc[] =
    "counts(ids, tokens, layers, k, offsets, steps, experts, out) -> True, or None on an expert id outside "
    "[0, experts) or named twice in one token's top-k (out partly written)\n\n"
    "ids: C-contiguous int16, int32 or int64 [tokens, layers, k]; offsets: int64 [steps + 1] rising from 0 to "
    "tokens; out: int64 [steps, layers, experts], each step's picks of each expert added to it. With out None "
    "only the checks run.";

static PyObject *counts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oids, *ooff, *oout;
    Py_ssize_t T, L, k, n, E;
    if (!PyArg_ParseTuple(args, "OnnnOnnO", &oids, &T, &L, &k, &ooff, &n, &E, &oout)) return NULL;
    if (T < 0 || L < 0 || k < 1 || n < 0 || E < 1) {
        PyErr_SetString(PyExc_ValueError, "counts: bad sizes");
        return NULL;
    }
    Py_buffer ids;
    if (PyObject_GetBuffer(oids, &ids, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((ids.itemsize != 2 && ids.itemsize != 4 && ids.itemsize != 8) || ids.len != ids.itemsize * T * L * k) {
        PyErr_SetString(PyExc_ValueError, "counts: ids must be [tokens, layers, k] of 2, 4 or 8 byte integers");
        PyBuffer_Release(&ids);
        return NULL;
    }
    int have_out = oout != Py_None;
    BufferSpec spec[] = {{ooff, 8, n + 1, 0, "offsets"}, {oout, 8, n * L * E, 1, "out"}};
    Py_buffer views[2];
    if (buffers(spec, have_out ? 2 : 1, views) < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    PyObject *ret = NULL;
    const i64 *offsets = (const i64 *)views[0].buf;
    int ok = offsets[0] == 0 && offsets[n] == T;
    for (Py_ssize_t s = 0; ok && s < n; s++) ok = offsets[s] <= offsets[s + 1];
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "counts: offsets must rise from 0 to tokens");
        goto done;
    }
    i64 *out = have_out ? (i64 *)views[1].buf : NULL;
    const void *buf = ids.buf;
    int isz = (int)ids.itemsize, bad = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (i64 s = 0; s < n && !bad; s++)
        for (i64 t = offsets[s]; t < offsets[s + 1] && !bad; t++)
            for (i64 l = 0; l < L && !bad; l++) {
                const i64 base = (t * L + l) * k;
                i64 *row = out ? out + (s * L + l) * E : NULL;
                for (i64 j = 0; j < k; j++) {
                    i64 e = id_at(buf, isz, base + j);
                    if (e < 0 || e >= E) bad = 1;
                    for (i64 i = 0; i < j; i++) bad |= id_at(buf, isz, base + i) == e;
                    if (bad) break;
                    if (row) row[e]++;
                }
            }
    Py_END_ALLOW_THREADS;
    ret = bad ? Py_None : Py_True;
    Py_INCREF(ret);
done:
    release_buffers(views, have_out ? 2 : 1);
    PyBuffer_Release(&ids);
    return ret;
}

static PyMethodDef methods[] = {
    {"route", route, METH_VARARGS, route_doc},
    {"counts", counts, METH_VARARGS, counts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_reach",
                                    "Token reach: the compiled loop of eplb.coactivation (eplb/_reach.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__reach(void) { return PyModule_Create(&module); }
