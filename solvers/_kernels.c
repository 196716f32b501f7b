/* Compiled inner loops of solvers/greedy.py (built by `pip install -e .`).
 *
 * Every function takes C-contiguous buffers (numpy arrays) of float64 or int64, works row by row
 * (a row is one layer, or one layer x node) and writes its results into output buffers the caller
 * allocated. No numpy headers: buffers come through the Python buffer protocol.
 *
 * Float32 mode (`f32` != 0) reproduces DeepSeek EPLB's float32 arithmetic: values are float32 numbers
 * held in doubles, and every sum or quotient is rounded back to float32. One double operation on two
 * float32 operands rounded to float32 equals the float32 operation (53 >= 2 * 24 + 2 bits).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

/* ---------- buffer helpers ---------- */

static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable,
                   const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != itemsize || view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of items of %zd",
                     name, count, itemsize, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---------- replicate: each extra slot to the expert with the largest load per replica ---------- */

/* max-heap of experts keyed by (per-replica load desc, index asc): the top is numpy's argmax */
typedef struct {
    double *key;
    i64 *item;
    i64 size;
} Heap;

static inline int heap_before(const Heap *h, i64 a, i64 b) {
    double ka = h->key[h->item[a]], kb = h->key[h->item[b]];
    return ka > kb || (ka == kb && h->item[a] < h->item[b]);
}

static void heap_down(Heap *h, i64 i) {
    for (;;) {
        i64 l = 2 * i + 1, r = l + 1, best = i;
        if (l < h->size && heap_before(h, l, best)) best = l;
        if (r < h->size && heap_before(h, r, best)) best = r;
        if (best == i) return;
        i64 t = h->item[i];
        h->item[i] = h->item[best];
        h->item[best] = t;
        i = best;
    }
}

static PyObject *py_replicate(PyObject *self, PyObject *args) {
    PyObject *o_weight, *o_nphy, *o_phy2log, *o_rank, *o_logcnt;
    Py_ssize_t rows, num_log, width, max_replicas;
    int f32;
    if (!PyArg_ParseTuple(args, "OnnOnnpOOO", &o_weight, &rows, &num_log, &o_nphy, &width, &max_replicas, &f32,
                          &o_phy2log, &o_rank, &o_logcnt))
        return NULL;
    Py_buffer bw, bn, bp, br, bc;
    if (get_buf(o_weight, &bw, 8, rows * num_log, 0, "weight") < 0) return NULL;
    if (get_buf(o_nphy, &bn, 8, rows, 0, "num_physical") < 0) goto e1;
    if (get_buf(o_phy2log, &bp, 8, rows * width, 1, "phy2log") < 0) goto e2;
    if (get_buf(o_rank, &br, 8, rows * width, 1, "rank") < 0) goto e3;
    if (get_buf(o_logcnt, &bc, 8, rows * num_log, 1, "logcnt") < 0) goto e4;
    const double *weight = bw.buf;
    const i64 *nphy = bn.buf;
    i64 *phy2log = bp.buf, *rank = br.buf, *logcnt = bc.buf;
    double *key = malloc(sizeof(double) * (num_log + 1));
    i64 *item = malloc(sizeof(i64) * (num_log + 1));
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++) {
        const double *w = weight + row * num_log;
        i64 *p = phy2log + row * width, *rk = rank + row * width, *cnt = logcnt + row * num_log;
        for (Py_ssize_t e = 0; e < num_log; e++) {
            cnt[e] = 1;
            key[e] = w[e];
            item[e] = e;
        }
        for (Py_ssize_t s = 0; s < width; s++) {
            p[s] = s < num_log ? s : -1;
            rk[s] = 0;
        }
        Heap h = {key, item, num_log};
        for (i64 i = h.size / 2 - 1; i >= 0; i--) heap_down(&h, i);
        if (max_replicas == 1) h.size = 0;
        for (i64 s = num_log; s < nphy[row]; s++) {
            i64 e;
            if (h.size > 0) {
                e = h.item[0];
            } else { /* every expert capped: largest load per replica regardless of the cap */
                e = 0;
                for (i64 k = 1; k < num_log; k++)
                    if (w[k] / (double)cnt[k] > w[e] / (double)cnt[e]) e = k;
            }
            p[s] = e;
            rk[s] = cnt[e];
            cnt[e]++;
            if (h.size > 0) {
                double q = w[e] / (double)cnt[e];
                key[e] = f32 ? (double)(float)q : q;
                if (max_replicas > 0 && cnt[e] >= max_replicas) {
                    h.item[0] = h.item[--h.size];
                }
                heap_down(&h, 0);
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(key);
    free(item);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&br);
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bn);
    PyBuffer_Release(&bw);
    Py_RETURN_NONE;
e4:
    PyBuffer_Release(&br);
e3:
    PyBuffer_Release(&bp);
e2:
    PyBuffer_Release(&bn);
e1:
    PyBuffer_Release(&bw);
    return NULL;
}

/* ---------- sorting: heaviest first ---------- */

typedef struct {
    double key;
    i64 idx;
} Pair;

static int cmp_desc_stable(const void *a, const void *b) {
    const Pair *x = a, *y = b;
    if (x->key > y->key) return -1;
    if (x->key < y->key) return 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* libstdc++'s std::sort (introsort + final insertion sort) on pairs with comp(a, b) = a.key > b.key:
 * the order torch's CPU sort(descending=True) gives to ties. */
#define THRESHOLD 16
static inline int comp(const Pair *a, const Pair *b) { return a->key > b->key; }

static void move_median_to_first(Pair *a, i64 result, i64 x, i64 y, i64 z) {
    i64 pick;
    if (comp(&a[x], &a[y])) {
        if (comp(&a[y], &a[z])) pick = y;
        else if (comp(&a[x], &a[z])) pick = z;
        else pick = x;
    } else if (comp(&a[x], &a[z])) pick = x;
    else if (comp(&a[y], &a[z])) pick = z;
    else pick = y;
    Pair t = a[result];
    a[result] = a[pick];
    a[pick] = t;
}

static i64 partition_pivot(Pair *a, i64 first, i64 last) {
    i64 mid = first + (last - first) / 2;
    move_median_to_first(a, first, first + 1, mid, last - 1);
    i64 lo = first + 1, hi = last;
    for (;;) {
        while (comp(&a[lo], &a[first])) lo++;
        hi--;
        while (comp(&a[first], &a[hi])) hi--;
        if (!(lo < hi)) return lo;
        Pair t = a[lo];
        a[lo] = a[hi];
        a[hi] = t;
        lo++;
    }
}

static void adjust_heap(Pair *a, i64 first, i64 hole, i64 len, Pair value) {
    i64 top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (comp(&a[first + child], &a[first + child - 1])) child--;
        a[first + hole] = a[first + child];
        hole = child;
    }
    if (len % 2 == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        a[first + hole] = a[first + child - 1];
        hole = child - 1;
    }
    i64 parent = (hole - 1) / 2;
    while (hole > top && comp(&a[first + parent], &value)) {
        a[first + hole] = a[first + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    a[first + hole] = value;
}

static void heap_sort(Pair *a, i64 first, i64 last) {
    i64 len = last - first;
    if (len >= 2) {
        for (i64 parent = (len - 2) / 2;; parent--) {
            adjust_heap(a, first, parent, len, a[first + parent]);
            if (parent == 0) break;
        }
    }
    while (last - first > 1) {
        last--;
        Pair v = a[last];
        a[last] = a[first];
        adjust_heap(a, first, 0, last - first, v);
    }
}

static void introsort_loop(Pair *a, i64 first, i64 last, i64 depth) {
    while (last - first > THRESHOLD) {
        if (depth == 0) {
            heap_sort(a, first, last);
            return;
        }
        depth--;
        i64 cut = partition_pivot(a, first, last);
        introsort_loop(a, cut, last, depth);
        last = cut;
    }
}

static void linear_insert(Pair *a, i64 last) {
    Pair v = a[last];
    i64 j = last - 1;
    while (comp(&v, &a[j])) {
        a[j + 1] = a[j];
        j--;
    }
    a[j + 1] = v;
}

static void final_insertion_sort(Pair *a, i64 first, i64 last) {
    i64 head = last < first + THRESHOLD ? last : first + THRESHOLD;
    for (i64 i = first + 1; i < head; i++) {
        Pair v = a[i];
        if (comp(&v, &a[first])) {
            memmove(&a[first + 1], &a[first], sizeof(Pair) * (i - first));
            a[first] = v;
        } else {
            linear_insert(a, i);
        }
    }
    for (i64 i = head; i < last; i++) linear_insert(a, i);
}

static void torch_sort_desc(Pair *a, i64 n) {
    if (n < 2) return;
    i64 lg = 0;
    while ((n >> (lg + 1)) > 0) lg++;
    introsort_loop(a, 0, n, 2 * lg);
    final_insertion_sort(a, 0, n);
}

static PyObject *py_argsort_desc(PyObject *self, PyObject *args) {
    PyObject *o_values, *o_out;
    Py_ssize_t rows, n;
    int like_torch;
    if (!PyArg_ParseTuple(args, "OnnpO", &o_values, &rows, &n, &like_torch, &o_out)) return NULL;
    Py_buffer bv, bo;
    if (get_buf(o_values, &bv, 8, rows * n, 0, "values") < 0) return NULL;
    if (get_buf(o_out, &bo, 8, rows * n, 1, "out") < 0) {
        PyBuffer_Release(&bv);
        return NULL;
    }
    const double *values = bv.buf;
    i64 *out = bo.buf;
    Pair *a = malloc(sizeof(Pair) * (n + 1));
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++) {
        for (Py_ssize_t i = 0; i < n; i++) a[i] = (Pair){values[row * n + i], i};
        if (like_torch) torch_sort_desc(a, n);
        else qsort(a, n, sizeof(Pair), cmp_desc_stable);
        for (Py_ssize_t i = 0; i < n; i++) out[row * n + i] = a[i].idx;
    }
    Py_END_ALLOW_THREADS
    free(a);
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bv);
    Py_RETURN_NONE;
}

/* ---------- pack: heaviest item first into the least-loaded bin with room ---------- */

static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *o_weight, *o_order, *o_cap, *o_experts, *o_bin, *o_rank;
    Py_ssize_t rows, n, bins, num_experts;
    int f32;
    if (!PyArg_ParseTuple(args, "OnnOOnOnpOO", &o_weight, &rows, &n, &o_order, &o_cap, &bins, &o_experts,
                          &num_experts, &f32, &o_bin, &o_rank))
        return NULL;
    Py_buffer bw, bord, bc, be, bb, br;
    int have_experts = o_experts != Py_None;
    if (get_buf(o_weight, &bw, 8, rows * n, 0, "weight") < 0) return NULL;
    if (get_buf(o_order, &bord, 8, rows * n, 0, "order") < 0) goto e1;
    if (get_buf(o_cap, &bc, 8, rows * bins, 0, "capacity") < 0) goto e2;
    if (have_experts && get_buf(o_experts, &be, 8, rows * n, 0, "experts") < 0) goto e3;
    if (get_buf(o_bin, &bb, 8, rows * n, 1, "bin_of") < 0) goto e4;
    if (get_buf(o_rank, &br, 8, rows * n, 1, "rank") < 0) goto e5;
    const double *weight = bw.buf;
    const i64 *order = bord.buf, *capacity = bc.buf, *experts = have_experts ? be.buf : NULL;
    i64 *bin_of = bb.buf, *rank = br.buf;
    double *load = malloc(sizeof(double) * (bins + 1));
    i64 *used = malloc(sizeof(i64) * (bins + 1));
    unsigned char *holds = have_experts ? calloc((size_t)bins * (num_experts + 1), 1) : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++) {
        const double *w = weight + row * n;
        const i64 *ord = order + row * n, *cap = capacity + row * bins;
        const i64 *ex = have_experts ? experts + row * n : NULL;
        i64 *bo = bin_of + row * n, *rk = rank + row * n;
        for (Py_ssize_t b = 0; b < bins; b++) {
            load[b] = 0.0;
            used[b] = 0;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            bo[i] = -1;
            rk[i] = -1;
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            i64 it = ord[j];
            if (w[it] == -INFINITY) continue; /* padding */
            i64 best = -1, any = -1;
            for (Py_ssize_t b = 0; b < bins; b++) {
                if (used[b] >= cap[b]) continue;
                if (any < 0 || load[b] < load[any]) any = b;
                if (ex && holds[b * num_experts + ex[it]]) continue;
                if (best < 0 || load[b] < load[best]) best = b;
            }
            if (best < 0) best = any; /* every bin with room holds this expert already */
            if (best < 0) break;      /* no room left: the caller's capacities were short */
            bo[it] = best;
            rk[it] = used[best]++;
            double l = load[best] + w[it];
            load[best] = f32 ? (double)(float)l : l;
            if (ex) holds[best * num_experts + ex[it]] = 1;
        }
        if (ex)
            for (Py_ssize_t i = 0; i < n; i++)
                if (bo[i] >= 0) holds[bo[i] * num_experts + ex[i]] = 0;
    }
    Py_END_ALLOW_THREADS
    free(load);
    free(used);
    free(holds);
    PyBuffer_Release(&br);
    PyBuffer_Release(&bb);
    if (have_experts) PyBuffer_Release(&be);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&bord);
    PyBuffer_Release(&bw);
    Py_RETURN_NONE;
e5:
    PyBuffer_Release(&bb);
e4:
    if (have_experts) PyBuffer_Release(&be);
e3:
    PyBuffer_Release(&bc);
e2:
    PyBuffer_Release(&bord);
e1:
    PyBuffer_Release(&bw);
    return NULL;
}

/* Tournament tree over bins: tree[1] is the bin with the lowest key (lowest index on ties);
 * key[b] is a bin's load while it may take the current replica, INFINITY otherwise. */
typedef struct {
    i64 *tree;
    double *key;
    i64 size; /* leaves: a power of two >= bins; leaves `bins` and beyond hold a sentinel (key INFINITY) */
} Tourney;

static inline i64 tourney_winner(const Tourney *t, i64 x, i64 y) { return t->key[y] < t->key[x] ? y : x; }

static inline void tourney_update(Tourney *t, i64 b) {
    for (i64 node = (t->size + b) >> 1; node >= 1; node >>= 1)
        t->tree[node] = tourney_winner(t, t->tree[2 * node], t->tree[2 * node + 1]);
}

static void tourney_build(Tourney *t, i64 bins) {
    for (i64 i = 0; i < t->size; i++) t->tree[t->size + i] = i < bins ? i : bins;
    for (i64 node = t->size - 1; node >= 1; node--)
        t->tree[node] = tourney_winner(t, t->tree[2 * node], t->tree[2 * node + 1]);
}

/* ---------- DeepSeek EPLB's replicate + balanced_packing, one row (layer x node) at a time ---------- */

/* weight [rows, n_log] float32 values; n_phy replicas per row packed onto `packs` GPUs of n_phy / packs
 * slots. Float32 arithmetic, argmax ties to the lowest index, torch's sort order, first lightest pack.
 * Writes, in packed slot order (GPU by GPU), the expert and replica rank of every slot, and logcnt. */
static PyObject *py_deepseek_rows(PyObject *self, PyObject *args) {
    PyObject *o_weight, *o_phy2log, *o_rank, *o_logcnt;
    Py_ssize_t rows, n_log, n_phy, packs;
    if (!PyArg_ParseTuple(args, "OnnnnOOO", &o_weight, &rows, &n_log, &n_phy, &packs, &o_phy2log, &o_rank,
                          &o_logcnt))
        return NULL;
    if (n_phy < n_log || packs < 1 || n_phy % packs) {
        PyErr_SetString(PyExc_ValueError, "deepseek_rows: bad sizes");
        return NULL;
    }
    Py_buffer bw, bp, br, bc;
    if (get_buf(o_weight, &bw, 8, rows * n_log, 0, "weight") < 0) return NULL;
    if (get_buf(o_phy2log, &bp, 8, rows * n_phy, 1, "phy2log") < 0) goto e1;
    if (get_buf(o_rank, &br, 8, rows * n_phy, 1, "rank") < 0) goto e2;
    if (get_buf(o_logcnt, &bc, 8, rows * n_log, 1, "logcnt") < 0) goto e3;
    const double *weight = bw.buf;
    i64 *out_p = bp.buf, *out_r = br.buf, *logcnt = bc.buf;
    i64 per_pack = n_phy / packs;
    double *key = malloc(sizeof(double) * (n_log + 1)), *pack_load = malloc(sizeof(double) * (packs + 1));
    i64 *item = malloc(sizeof(i64) * (n_log + 1)), *phy = malloc(sizeof(i64) * n_phy),
        *rank = malloc(sizeof(i64) * n_phy), *pack_items = malloc(sizeof(i64) * (packs + 1));
    Pair *order = malloc(sizeof(Pair) * n_phy);
    i64 leaves = 1;
    while (leaves < packs) leaves *= 2;
    i64 *tree = malloc(sizeof(i64) * 2 * leaves);
    double *key_of_pack = malloc(sizeof(double) * (packs + 1));
    Tourney t = {tree, key_of_pack, leaves};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++) {
        const double *w = weight + row * n_log;
        i64 *cnt = logcnt + row * n_log, *op = out_p + row * n_phy, *orank = out_r + row * n_phy;
        for (i64 e = 0; e < n_log; e++) {
            cnt[e] = 1;
            key[e] = w[e];
            item[e] = e;
            phy[e] = e;
            rank[e] = 0;
        }
        Heap h = {key, item, n_log};
        for (i64 i = h.size / 2 - 1; i >= 0; i--) heap_down(&h, i);
        for (i64 s = n_log; s < n_phy; s++) {
            i64 e = h.item[0];
            phy[s] = e;
            rank[s] = cnt[e]++;
            key[e] = (double)(float)(w[e] / (double)cnt[e]);
            heap_down(&h, 0);
        }
        if (packs == n_phy) { /* one slot per GPU: replicas stay in order */
            memcpy(op, phy, sizeof(i64) * n_phy);
            memcpy(orank, rank, sizeof(i64) * n_phy);
            continue;
        }
        for (i64 s = 0; s < n_phy; s++) order[s] = (Pair){(double)(float)(w[phy[s]] / (double)cnt[phy[s]]), s};
        torch_sort_desc(order, n_phy);
        int finite = 1; /* the tournament picks what the scan picks when every load is finite */
        for (i64 e = 0; e < n_log; e++) finite &= isfinite(w[e]) != 0;
        for (i64 b = 0; b < packs; b++) {
            pack_load[b] = 0.0;
            pack_items[b] = 0;
            key_of_pack[b] = 0.0;
        }
        key_of_pack[packs] = INFINITY;
        tourney_build(&t, packs);
        for (i64 j = 0; j < n_phy; j++) {
            i64 s = order[j].idx, best = t.tree[1];
            if (!finite) { /* the first least-loaded pack with room, by a scan */
                best = -1;
                for (i64 b = 0; b < packs; b++)
                    if (pack_items[b] < per_pack && (best < 0 || pack_load[b] < pack_load[best])) best = b;
            }
            i64 pos = best * per_pack + pack_items[best]++;
            pack_load[best] = (double)(float)(pack_load[best] + order[j].key);
            key_of_pack[best] = pack_items[best] < per_pack ? pack_load[best] : INFINITY;
            tourney_update(&t, best);
            op[pos] = phy[s];
            orank[pos] = rank[s];
        }
    }
    Py_END_ALLOW_THREADS
    free(key);
    free(pack_load);
    free(item);
    free(phy);
    free(rank);
    free(pack_items);
    free(order);
    free(tree);
    free(key_of_pack);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&br);
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bw);
    Py_RETURN_NONE;
e3:
    PyBuffer_Release(&br);
e2:
    PyBuffer_Release(&bp);
e1:
    PyBuffer_Release(&bw);
    return NULL;
}

/* ---------- place: replicate, then pack heaviest-first, one row at a time ---------- */

/* stable merge sort of pairs by key descending (equal keys keep their input order) */
static void merge_sort_desc(Pair *a, Pair *tmp, i64 n) {
    for (i64 i = 1; i < n; i++) { /* insertion sort on runs of 8 */
        if (i % 8 == 0) continue;
        Pair v = a[i];
        i64 j = i - 1, lo = i - i % 8;
        while (j >= lo && a[j].key < v.key) {
            a[j + 1] = a[j];
            j--;
        }
        a[j + 1] = v;
    }
    for (i64 width = 8; width < n; width *= 2) {
        for (i64 lo = 0; lo < n; lo += 2 * width) {
            i64 mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            i64 i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int right = a[j].key > a[i].key;
                tmp[k++] = a[right ? j : i];
                j += right;
                i += 1 - right;
            }
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        memcpy(a, tmp, sizeof(Pair) * n);
    }
}

/* replicate, one row: each of the slots beyond the E experts' first replicas to the expert with the largest
 * load per replica (lowest index on ties), at most max_replicas (0: no cap) while any expert is below it.
 * Writes cnt [E]. */
static void replicate_row(const double *w, i64 num_log, i64 slots, i64 max_replicas, i64 *cnt, double *key,
                          i64 *item) {
    for (i64 e = 0; e < num_log; e++) {
        cnt[e] = 1;
        key[e] = w[e];
        item[e] = e;
    }
    Heap h = {key, item, num_log};
    for (i64 i = h.size / 2 - 1; i >= 0; i--) heap_down(&h, i);
    if (max_replicas == 1) h.size = 0;
    for (i64 s = num_log; s < slots; s++) {
        i64 e = 0;
        if (h.size > 0) {
            e = h.item[0];
        } else {
            for (i64 k = 1; k < num_log; k++)
                if (w[k] / (double)cnt[k] > w[e] / (double)cnt[e]) e = k;
        }
        cnt[e]++;
        if (h.size > 0) {
            key[e] = w[e] / (double)cnt[e];
            if (max_replicas > 0 && cnt[e] >= max_replicas) h.item[0] = h.item[--h.size];
            heap_down(&h, 0);
        }
    }
}

/* Gale-Ryser on experts x bins, one replica per pair: counts cnt [E] fit on bins of capacity cap [bins] with the
 * fewest same-bin duplicates any counts allow, D = slots - sum_b min(cap_b, E) (0 when no bin has more slots than
 * there are experts), exactly when the k most replicated experts hold at most room_k + D replicas for every k,
 * room_k = sum_b min(cap_b, k) (max-flow min-cut). slack [E + 1] gets, for k = 1..E, what the k most replicated
 * experts may hold beyond one replica each when every count is 1: room_k + D - k (>= 0). work [slots + 1]. */
static void initial_slack(const i64 *cap, i64 bins, i64 num_log, i64 slots, i64 *slack, i64 *work) {
    for (i64 k = 0; k <= num_log; k++) work[k] = 0;
    for (i64 b = 0; b < bins; b++) work[cap[b] < num_log ? cap[b] : num_log]++;
    for (i64 k = num_log - 1; k >= 1; k--) work[k] += work[k + 1]; /* work[k]: bins with at least k slots */
    i64 room = 0;
    for (i64 k = 1; k <= num_log; k++) {
        room += work[k];
        slack[k] = room - k; /* D added below, once room_E is known */
    }
    for (i64 k = 1; k <= num_log; k++) slack[k] += slots - room;
}

/* 1 when counts cnt [E] force more same-bin duplicates than the slots themselves do (some k most replicated
 * experts hold more than slack[k] replicas beyond one each), else 0. hist [max(cnt) + 1]. */
static int counts_excess(const i64 *cnt, i64 num_log, const i64 *slack, i64 *hist) {
    i64 most = 1;
    for (i64 e = 0; e < num_log; e++) most = cnt[e] > most ? cnt[e] : most;
    for (i64 v = 0; v <= most; v++) hist[v] = 0;
    for (i64 e = 0; e < num_log; e++) hist[cnt[e]]++;
    i64 k = 0, beyond = 0;
    for (i64 v = most; v >= 1; v--)
        for (i64 j = 0; j < hist[v]; j++) {
            k++;
            beyond += v - 1;
            if (beyond > slack[k]) return 1;
        }
    return 0;
}

/* Whether one more replica of an expert with `c` replicas keeps the counts within the slack: it becomes the
 * (above[c] + 1)-th most replicated, so the k most replicated hold one more for every k > above[c]. */
static inline int can_add(i64 c, i64 num_log, const i64 *slack, const i64 *above) {
    for (i64 k = above[c] + 1; k <= num_log; k++)
        if (slack[k] < 1) return 0;
    return 1;
}

/* replicate_row under the Gale-Ryser condition (initial_slack: slack [E + 1], consumed): each extra slot to the
 * expert with the largest load per replica whose extra replica still lets the counts fit with the fewest
 * duplicates the slots force (none when no bin has more slots than there are experts). The counts that fit form
 * a polymatroid, so an expert that cannot take one more never can again (it is dropped), the greedy fills every
 * slot, and its largest load per replica is the lowest any such counts have. When every expert left is capped,
 * the largest load per replica among those that fit, else among all (as replicate_row). above [slots + 1]. */
static void replicate_row_fit(const double *w, i64 num_log, i64 slots, i64 max_replicas, i64 *cnt, double *key,
                              i64 *item, i64 *slack, i64 *above) {
    for (i64 e = 0; e < num_log; e++) {
        cnt[e] = 1;
        key[e] = w[e];
        item[e] = e;
    }
    for (i64 v = 0; v <= slots; v++) above[v] = 0; /* above[v]: experts with more than v replicas */
    above[0] = num_log;
    Heap h = {key, item, num_log};
    for (i64 i = h.size / 2 - 1; i >= 0; i--) heap_down(&h, i);
    if (max_replicas == 1) h.size = 0;
    for (i64 s = num_log; s < slots; s++) {
        i64 e = -1;
        while (h.size > 0 && !can_add(cnt[h.item[0]], num_log, slack, above)) { /* never fits again: drop */
            h.item[0] = h.item[--h.size];
            heap_down(&h, 0);
        }
        int from_heap = h.size > 0;
        if (from_heap) {
            e = h.item[0];
        } else {
            for (i64 pass = 0; pass < 2 && e < 0; pass++)
                for (i64 k = 0; k < num_log; k++)
                    if ((pass || can_add(cnt[k], num_log, slack, above)) &&
                        (e < 0 || w[k] / (double)cnt[k] > w[e] / (double)cnt[e]))
                        e = k;
        }
        for (i64 k = above[cnt[e]] + 1; k <= num_log; k++) slack[k]--;
        above[cnt[e]]++;
        cnt[e]++;
        if (from_heap) {
            key[e] = w[e] / (double)cnt[e];
            if (max_replicas > 0 && cnt[e] >= max_replicas) h.item[0] = h.item[--h.size];
            heap_down(&h, 0);
        }
    }
}

/* pack, one row: replicas (cnt [E]) heaviest first, an expert's one after another, each into the least-loaded
 * bin with room that does not hold its expert yet. Returns 1 when some bin had to take a second replica of one
 * expert (every bin with room already held it), else 0. */
static int pack_row(const double *w, i64 num_log, const i64 *cap, i64 bins, i64 *out, const i64 *cnt, Pair *items,
                    Pair *tmp, double *load, i64 *used, i64 *tree, double *key_of_bin, i64 *prev, i64 *first_slot) {
    /* experts by load per replica, heaviest first; an expert's replicas go one after another */
    for (i64 e = 0; e < num_log; e++) items[e] = (Pair){w[e] / (double)cnt[e], e};
    merge_sort_desc(items, tmp, num_log);
    /* pack: each replica into the least-loaded bin with room that does not hold its expert yet */
    Tourney t = {tree, key_of_bin, 1};
    while (t.size < bins) t.size *= 2;
    first_slot[0] = 0;
    for (i64 b = 0; b < bins; b++) {
        load[b] = 0.0;
        used[b] = 0;
        if (b > 0) first_slot[b] = first_slot[b - 1] + cap[b - 1];
        key_of_bin[b] = cap[b] > 0 ? 0.0 : INFINITY;
    }
    key_of_bin[bins] = INFINITY;
    tourney_build(&t, bins);
    int stuck = 0;
    for (i64 k = 0; k < num_log; k++) {
        i64 e = items[k].idx;
        double weight = items[k].key;
        for (i64 c = 0; c < cnt[e]; c++) { /* bins[0..c) of prev hold e already */
            for (i64 i = 0; i < c; i++) {
                key_of_bin[prev[i]] = INFINITY;
                tourney_update(&t, prev[i]);
            }
            i64 b = t.tree[1];
            /* judged before the blocked bins reopen: when every bin with room holds e, the winner is a
             * blocked bin (or a full one, or the sentinel), whose key the loop below may make finite again */
            int blocked = key_of_bin[b] == INFINITY;
            for (i64 i = 0; i < c; i++) {
                if (used[prev[i]] < cap[prev[i]]) {
                    key_of_bin[prev[i]] = load[prev[i]];
                    tourney_update(&t, prev[i]);
                }
            }
            if (blocked) { /* every bin with room holds e: the least-loaded one */
                b = t.tree[1];
                stuck = 1;
            }
            prev[c] = b;
            out[first_slot[b] + used[b]] = e;
            used[b]++;
            load[b] += weight;
            key_of_bin[b] = used[b] < cap[b] ? load[b] : INFINITY;
            tourney_update(&t, b);
        }
    }
    return stuck;
}

/* One row: loads [E] over bins with capacity [bins] (sum = slots of the row, >= E). Writes the expert
 * of each slot, bin by bin, into out [slots], and the replica counts into cnt [E]. Returns 1 when some bin had to
 * take a second replica of one expert, else 0. When the packing is stuck and replicate_row's counts force more
 * duplicates than the slots do (uneven slots: two hot experts with a replica on every GPU, where GPUs of one slot
 * cannot hold both), the counts are chosen again under that condition (replicate_row_fit) and packed again; rows
 * the first packing places without a duplicate never get there. slack [E + 1], above [slots + 1]. */
static int place_row(const double *w, i64 num_log, const i64 *cap, i64 bins, i64 max_replicas, i64 *out,
                     i64 *cnt, double *key, i64 *item, Pair *items, Pair *tmp, double *load, i64 *used,
                     i64 *tree, double *key_of_bin, i64 *prev, i64 *first_slot, i64 *slack, i64 *above) {
    i64 slots = 0;
    for (i64 b = 0; b < bins; b++) slots += cap[b];
    replicate_row(w, num_log, slots, max_replicas, cnt, key, item);
    int stuck = pack_row(w, num_log, cap, bins, out, cnt, items, tmp, load, used, tree, key_of_bin, prev, first_slot);
    if (!stuck) return 0;
    initial_slack(cap, bins, num_log, slots, slack, above);
    if (!counts_excess(cnt, num_log, slack, above)) return stuck;
    replicate_row_fit(w, num_log, slots, max_replicas, cnt, key, item, slack, above);
    return pack_row(w, num_log, cap, bins, out, cnt, items, tmp, load, used, tree, key_of_bin, prev, first_slot);
}

static PyObject *py_place(PyObject *self, PyObject *args) {
    PyObject *o_loads, *o_cap, *o_out, *o_stuck;
    Py_ssize_t rows, num_log, bins, width, max_replicas;
    if (!PyArg_ParseTuple(args, "OnnOnnnOO", &o_loads, &rows, &num_log, &o_cap, &bins, &width, &max_replicas,
                          &o_out, &o_stuck))
        return NULL;
    Py_buffer bl, bc, bo, bs;
    if (get_buf(o_loads, &bl, 8, rows * num_log, 0, "loads") < 0) return NULL;
    if (get_buf(o_cap, &bc, 8, rows * bins, 0, "capacity") < 0) goto e1;
    if (get_buf(o_out, &bo, 8, rows * width, 1, "out") < 0) goto e2;
    if (get_buf(o_stuck, &bs, 1, rows, 1, "stuck") < 0) goto e3;
    const double *loads = bl.buf;
    const i64 *capacity = bc.buf;
    i64 *out = bo.buf;
    unsigned char *stuck = bs.buf;
    for (Py_ssize_t row = 0; row < rows; row++) {
        i64 slots = 0;
        for (Py_ssize_t b = 0; b < bins; b++) slots += capacity[row * bins + b];
        if (slots < num_log || slots > width) {
            PyErr_Format(PyExc_ValueError, "row %zd: %lld slots for %zd experts (width %zd)", row, (long long)slots,
                         num_log, width);
            goto e4;
        }
    }
    i64 *cnt = malloc(sizeof(i64) * (num_log + 1)), *item = malloc(sizeof(i64) * (num_log + 1));
    double *key = malloc(sizeof(double) * (num_log + 1)), *load = malloc(sizeof(double) * (bins + 1));
    Pair *items = malloc(sizeof(Pair) * (num_log + 1)), *tmp = malloc(sizeof(Pair) * (num_log + 1));
    i64 leaves = 1;
    while (leaves < bins) leaves *= 2;
    i64 *used = malloc(sizeof(i64) * (bins + 1)), *tree = malloc(sizeof(i64) * 2 * leaves);
    double *key_of_bin = malloc(sizeof(double) * (bins + 1));
    i64 *prev = malloc(sizeof(i64) * (width + 1)), *first_slot = malloc(sizeof(i64) * (bins + 1));
    i64 *slack = malloc(sizeof(i64) * (num_log + 1)), *above = malloc(sizeof(i64) * (width + 1));
    int ok = cnt && item && key && load && items && tmp && used && tree && key_of_bin && prev && first_slot && slack &&
             above;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t row = 0; row < rows; row++) {
            i64 *o = out + row * width;
            for (Py_ssize_t s = 0; s < width; s++) o[s] = -1;
            stuck[row] = (unsigned char)place_row(loads + row * num_log, num_log, capacity + row * bins, bins,
                                                  max_replicas, o, cnt, key, item, items, tmp, load, used, tree,
                                                  key_of_bin, prev, first_slot, slack, above);
        }
        Py_END_ALLOW_THREADS
    }
    free(cnt);
    free(item);
    free(key);
    free(load);
    free(items);
    free(tmp);
    free(used);
    free(tree);
    free(key_of_bin);
    free(prev);
    free(first_slot);
    free(slack);
    free(above);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&bl);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
e4:
    PyBuffer_Release(&bs);
e3:
    PyBuffer_Release(&bo);
e2:
    PyBuffer_Release(&bc);
e1:
    PyBuffer_Release(&bl);
    return NULL;
}

/* ---------- refine: lower the busiest GPU by swapping replicas between GPUs ---------- */

/* One layer: expert [P] of each slot and w [P] its replica's load (both in/out: a trade swaps two slots'
 * contents). Each round the busiest GPU trades one replica with one on another GPU: the partner is the
 * lightest GPU with a trade that lowers the busiest without lifting the partner to its old load, and the
 * trade is the one on that partner leaving the lower maximum of the two. A trade never brings a second
 * replica of an expert onto a GPU. For one pair of GPUs with gap = load difference, the best trade moves
 * d = wa - wb closest to gap / 2, found by walking both GPUs' replicas sorted by weight (two pointers).
 * Stops when the busiest GPU has no trade, or after max_rounds trades. Returns the trades made. */
typedef struct {
    i64 *by_load;         /* GPUs by load ascending (the busiest last) */
    i64 *slot, *ex;       /* per GPU (stride `width`): its slots by weight ascending, and their experts */
    double *sw;           /* the same slots' weights, contiguous for the pair search */
    double *load;
    unsigned short *holds; /* [gpus, E]: replicas of each expert on each GPU */
    Pair *pairs, *tmp;     /* [gpus]: for sorting GPUs by load */
} RefineWork;

/* by_load [gpus] sorted ascending by load except the partner at `rank`, whose load rose, and the busiest
 * GPU (last), whose load fell: move the busiest down, then the partner up, each after (busiest) or before
 * (partner) equal loads, exactly as one-step insertion would. Loads must be finite (binary searches). */
static void reorder_gpus(i64 *by_load, const double *load, i64 gpus, i64 rank) {
    i64 top = gpus - 1, hot = by_load[top], h = by_load[rank];
    double lhot = load[hot], lh = load[h];
    i64 lo = rank + 1, hi = top; /* above the partner: the first load > lhot */
    while (lo < hi) {
        i64 mid = (lo + hi) / 2;
        if (load[by_load[mid]] > lhot) hi = mid;
        else lo = mid + 1;
    }
    if (lo == rank + 1 && lh > lhot) { /* the busiest passes the partner too */
        lo = 0;
        hi = rank;
        while (lo < hi) {
            i64 mid = (lo + hi) / 2;
            if (load[by_load[mid]] > lhot) hi = mid;
            else lo = mid + 1;
        }
    }
    i64 j = lo;
    memmove(by_load + j + 1, by_load + j, sizeof(i64) * (size_t)(top - j));
    by_load[j] = hot;
    j = rank + (j <= rank);
    lo = j + 1;
    hi = gpus; /* above the partner: the first load >= lh */
    while (lo < hi) {
        i64 mid = (lo + hi) / 2;
        if (load[by_load[mid]] < lh) lo = mid + 1;
        else hi = mid;
    }
    memmove(by_load + j, by_load + j + 1, sizeof(i64) * (size_t)(lo - 1 - j));
    by_load[lo - 1] = h;
}

static void sort_gpu(i64 *order, i64 n, const double *w) {
    for (i64 i = 1; i < n; i++) {
        i64 s = order[i], j = i;
        for (; j > 0 && w[order[j - 1]] > w[s]; j--) order[j] = order[j - 1];
        order[j] = s;
    }
}

/* Entry i of one GPU's sorted lists changed weight: move it to its place (stable, as a re-sort would). */
static void resort_entry(i64 *slot, i64 *ex, double *sw, i64 n, i64 i) {
    i64 s = slot[i], e = ex[i];
    double v = sw[i];
    for (; i > 0 && sw[i - 1] > v; i--) {
        slot[i] = slot[i - 1];
        ex[i] = ex[i - 1];
        sw[i] = sw[i - 1];
    }
    for (; i + 1 < n && sw[i + 1] < v; i++) {
        slot[i] = slot[i + 1];
        ex[i] = ex[i + 1];
        sw[i] = sw[i + 1];
    }
    slot[i] = s;
    ex[i] = e;
    sw[i] = v;
}

static i64 refine_layer(i64 *expert, double *w, const i64 *start, const i64 *count, i64 gpus, i64 width,
                        i64 num_experts, i64 max_rounds, RefineWork *k) {
    for (i64 g = 0; g < gpus; g++) {
        double sum = 0.0;
        i64 *order = k->slot + g * width;
        unsigned short *hold = k->holds + g * num_experts;
        for (i64 i = 0; i < count[g]; i++) {
            i64 s = start[g] + i;
            sum += w[s];
            order[i] = s;
            hold[expert[s]]++;
        }
        sort_gpu(order, count[g], w);
        for (i64 i = 0; i < count[g]; i++) {
            k->ex[g * width + i] = expert[order[i]];
            k->sw[g * width + i] = w[order[i]];
        }
        k->load[g] = sum;
    }
    int finite = 1;
    for (i64 g = 0; g < gpus; g++) finite &= isfinite(k->load[g]) != 0;
    if (finite && gpus >= 64) { /* by_load: GPUs by load ascending, ties in GPU order (a stable sort) */
        for (i64 g = 0; g < gpus; g++) k->pairs[g] = (Pair){-k->load[g], g};
        merge_sort_desc(k->pairs, k->tmp, gpus);
        for (i64 g = 0; g < gpus; g++) k->by_load[g] = k->pairs[g].idx;
    } else {
        for (i64 g = 0; g < gpus; g++) {
            i64 j = g;
            for (; j > 0 && k->load[k->by_load[j - 1]] > k->load[g]; j--) k->by_load[j] = k->by_load[j - 1];
            k->by_load[j] = g;
        }
    }
    i64 *by_load = k->by_load;
    double *load = k->load;
    i64 rounds = 0;
    for (; rounds < max_rounds; rounds++) {
        i64 hot = by_load[gpus - 1];
        double peak = load[hot], limit = peak * (1 - 1e-12), best_worse = INFINITY, partner_load = INFINITY;
        const double *hw = k->sw + hot * width;
        const i64 *he = k->ex + hot * width, nh = count[hot];
        const unsigned short *hold_hot = k->holds + hot * num_experts;
        i64 best_ia = -1, best_jb = -1, partner = -1, partner_rank = -1;
        for (i64 r = 0; r < gpus - 1; r++) {
            i64 h = by_load[r];
            double lh = load[h], gap = limit - lh, half = (peak - lh) * 0.5;
            if (lh > partner_load || gap <= 0) break; /* a lighter partner has a trade, or none can */
            const double *pw = k->sw + h * width;
            const i64 *pe = k->ex + h * width;
            const unsigned short *hold_h = k->holds + h * num_experts;
            i64 n = count[h], j = 0;
            for (i64 ia = 0; ia < nh; ia++) {
                double wa = hw[ia], target = wa - half;
                if (hold_h[he[ia]]) continue;
                while (j < n && pw[j] < target) j++;
                /* nearest unblocked replicas below and at-or-above the target, within 0 < d, lh + d < limit.
                 * The two scans are written out on purpose: one loop over both directions measured 4-7%
                 * slower on the whole solve (benchmarks/greedy.py), with the same placements. */
                for (i64 jb = j - 1; jb >= 0; jb--) {
                    double d = wa - pw[jb];
                    if (d <= 0 || lh + d >= limit) break;
                    if (hold_hot[pe[jb]]) continue;
                    double worse = lh + d > peak - d ? lh + d : peak - d;
                    if (worse < best_worse) {
                        best_worse = worse;
                        best_ia = ia;
                        best_jb = jb;
                        partner = h;
                        partner_rank = r;
                        partner_load = lh;
                    }
                    break;
                }
                for (i64 jb = j; jb < n; jb++) {
                    double d = wa - pw[jb];
                    if (d <= 0 || lh + d >= limit) break;
                    if (hold_hot[pe[jb]]) continue;
                    double worse = lh + d > peak - d ? lh + d : peak - d;
                    if (worse < best_worse) {
                        best_worse = worse;
                        best_ia = ia;
                        best_jb = jb;
                        partner = h;
                        partner_rank = r;
                        partner_load = lh;
                    }
                    break;
                }
            }
        }
        if (best_ia < 0) break;
        i64 h = partner, ia = hot * width + best_ia, jb = h * width + best_jb;
        i64 best_a = k->slot[ia], best_b = k->slot[jb], ea = expert[best_a], eb = expert[best_b];
        double d = w[best_a] - w[best_b];
        k->holds[hot * num_experts + ea]--;
        k->holds[hot * num_experts + eb]++;
        k->holds[h * num_experts + eb]--;
        k->holds[h * num_experts + ea]++;
        expert[best_a] = eb;
        expert[best_b] = ea;
        w[best_a] -= d;
        w[best_b] += d;
        w[best_a] = w[best_a] < 0 ? 0 : w[best_a];
        k->ex[ia] = eb;
        k->sw[ia] = w[best_a];
        k->ex[jb] = ea;
        k->sw[jb] = w[best_b];
        resort_entry(k->slot + hot * width, k->ex + hot * width, k->sw + hot * width, count[hot], best_ia);
        resort_entry(k->slot + h * width, k->ex + h * width, k->sw + h * width, count[h], best_jb);
        load[hot] -= d;
        load[h] += d;
        /* keep by_load sorted: the busiest GPU (last) moves down, its partner up */
        if (finite && isfinite(load[hot]) && isfinite(load[h])) {
            reorder_gpus(by_load, load, gpus, partner_rank);
            continue;
        }
        finite = 0;
        i64 j = gpus - 1;
        for (; j > 0 && load[by_load[j - 1]] > load[hot]; j--) by_load[j] = by_load[j - 1];
        by_load[j] = hot;
        j = partner_rank + (j <= partner_rank); /* the partner moved up one when the busiest passed it */
        for (; j + 1 < gpus && load[by_load[j + 1]] < load[h]; j++) by_load[j] = by_load[j + 1];
        by_load[j] = h;
    }
    for (i64 g = 0; g < gpus; g++)
        for (i64 s = start[g]; s < start[g] + count[g]; s++) k->holds[g * num_experts + expert[s]] = 0;
    return rounds;
}

/* Work buffers of refine_layer for `gpus` GPUs of at most `width` slots and E experts (NULL when short of
 * memory). */
static int refine_alloc(RefineWork *k, i64 gpus, i64 width, i64 num_experts) {
    k->by_load = malloc(sizeof(i64) * (gpus + 1));
    k->slot = malloc(sizeof(i64) * gpus * width);
    k->ex = malloc(sizeof(i64) * gpus * width);
    k->sw = malloc(sizeof(double) * gpus * width);
    k->load = malloc(sizeof(double) * (gpus + 1));
    k->holds = calloc((size_t)gpus * (num_experts + 1), sizeof(unsigned short));
    k->pairs = malloc(sizeof(Pair) * (gpus + 1));
    k->tmp = malloc(sizeof(Pair) * (gpus + 1));
    return k->by_load && k->slot && k->ex && k->sw && k->load && k->holds && k->pairs && k->tmp;
}

static void refine_free(RefineWork *k) {
    free(k->by_load);
    free(k->slot);
    free(k->ex);
    free(k->sw);
    free(k->load);
    free(k->holds);
    free(k->pairs);
    free(k->tmp);
}

/* One row's replica weights w [P] (expert's load / its replica count); cnt [E] zeroed, left zeroed. */
static void replica_weights(const i64 *ex, const double *l, i64 num_physical, i64 *cnt, double *w) {
    for (i64 s = 0; s < num_physical; s++) cnt[ex[s]]++;
    for (i64 s = 0; s < num_physical; s++) w[s] = l[ex[s]] / (double)cnt[ex[s]];
    for (i64 s = 0; s < num_physical; s++) cnt[ex[s]] = 0;
}

static PyObject *py_refine(PyObject *self, PyObject *args) {
    PyObject *o_expert, *o_loads, *o_slots;
    Py_ssize_t rows, num_physical, gpus, num_experts, max_rounds;
    if (!PyArg_ParseTuple(args, "OOnnnOnn", &o_expert, &o_loads, &rows, &num_physical, &num_experts, &o_slots,
                          &gpus, &max_rounds))
        return NULL;
    Py_buffer be, bl, bs;
    if (get_buf(o_expert, &be, 8, rows * num_physical, 1, "expert") < 0) return NULL;
    if (get_buf(o_loads, &bl, 8, rows * num_experts, 0, "loads") < 0) {
        PyBuffer_Release(&be);
        return NULL;
    }
    if (get_buf(o_slots, &bs, 8, gpus, 0, "slots_per_gpu") < 0) {
        PyBuffer_Release(&bl);
        PyBuffer_Release(&be);
        return NULL;
    }
    i64 *expert = be.buf;
    const double *loads = bl.buf;
    const i64 *count = bs.buf;
    i64 width = 1;
    for (i64 g = 0; g < gpus; g++) width = count[g] > width ? count[g] : width;
    RefineWork k;
    int ok = refine_alloc(&k, gpus, width, num_experts);
    i64 *start = malloc(sizeof(i64) * (gpus + 1)), *cnt = calloc(num_experts + 1, sizeof(i64));
    double *w = malloc(sizeof(double) * (num_physical + 1));
    i64 total = 0;
    if (ok && start && cnt && w) {
        start[0] = 0;
        for (i64 g = 1; g < gpus; g++) start[g] = start[g - 1] + count[g - 1];
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t row = 0; row < rows; row++) {
            i64 *ex = expert + row * num_physical;
            replica_weights(ex, loads + row * num_experts, num_physical, cnt, w);
            total += refine_layer(ex, w, start, count, gpus, width, num_experts, max_rounds, &k);
        }
        Py_END_ALLOW_THREADS
    }
    refine_free(&k);
    free(start);
    free(cnt);
    free(w);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bl);
    PyBuffer_Release(&be);
    if (!(ok && start && cnt && w)) return PyErr_NoMemory();
    return PyLong_FromLongLong(total);
}

/* ---------- search: the replica counts of small layers, packed and refined again (solve_greedy) ---------- */

/* The GPU loads of one row (replica weights w [P]) into out [gpus], busiest first. */
static void sorted_loads(const double *w, const i64 *count, i64 gpus, double *out) {
    for (i64 g = 0, s = 0; g < gpus; g++) {
        double sum = 0.0;
        for (i64 i = 0; i < count[g]; i++, s++) sum += w[s];
        i64 j = g;
        for (; j > 0 && out[j - 1] < sum; j--) out[j] = out[j - 1];
        out[j] = sum;
    }
}

/* 1 when GPU loads a [gpus] (busiest first) are lower than b's: the first load that differs beyond rounding
 * (tol) is lower in a. */
static int loads_lower(const double *a, const double *b, i64 gpus, double tol) {
    for (i64 g = 0; g < gpus; g++) {
        if (a[g] < b[g] - tol) return 1;
        if (a[g] > b[g] + tol) return 0;
    }
    return 0;
}

/* Work of search_counts: the row's counts cnt [E] and GPU loads now [gpus] (busiest first), the best move of a
 * round (top [gpus], best [P]), and buffers for packing and refining a candidate. */
typedef struct {
    const double *l;
    const i64 *count;
    i64 num_log, gpus, width, most, max_rounds;
    i64 *cnt, *cnt2, *cand, *best;
    double *w, *now, *next, *top, tol;
    Pair *items, *tmp;
    double *load, *key_of_bin;
    i64 *used, *tree, *prev, *first_slot;
    RefineWork *k;
    int found;
    i64 packed, budget; /* candidates packed in this row, and the most it may pack */
} Search;

/* Pack and refine the counts cnt2 (as solve_greedy does); when the result has no duplicate and its GPU loads,
 * busiest first, are lower than the round's best (top) beyond rounding, it becomes the best. Moves whose heaviest
 * replica alone exceeds the best's busiest GPU are not packed (no GPU can carry less than a replica). */
static void search_try(Search *q) {
    double largest = 0.0;
    for (i64 e = 0; e < q->num_log; e++) {
        double r = q->cnt2[e] > 0 ? q->l[e] / (double)q->cnt2[e] : 0.0;
        largest = r > largest ? r : largest;
    }
    if (largest > q->top[0] + q->tol || q->packed >= q->budget) return;
    q->packed++;
    if (pack_row(q->l, q->num_log, q->count, q->gpus, q->cand, q->cnt2, q->items, q->tmp, q->load, q->used, q->tree,
                 q->key_of_bin, q->prev, q->first_slot))
        return; /* a duplicate: the row had none */
    for (i64 s = 0; s < q->width; s++) q->w[s] = q->l[q->cand[s]] / (double)q->cnt2[q->cand[s]];
    if (q->max_rounds > 0)
        refine_layer(q->cand, q->w, q->first_slot, q->count, q->gpus, q->most, q->num_log, q->max_rounds, q->k);
    sorted_loads(q->w, q->count, q->gpus, q->next);
    if (!loads_lower(q->next, q->top, q->gpus, q->tol)) return;
    memcpy(q->top, q->next, sizeof(double) * (size_t)q->gpus);
    memcpy(q->best, q->cand, sizeof(i64) * (size_t)q->width);
    memcpy(q->cnt + q->num_log, q->cnt2, sizeof(i64) * (size_t)q->num_log); /* the best's counts, after cnt */
    q->found = 1;
}

/* Replica-count search, one row placed and refined without a duplicate: o [P] its slots, cnt [2E] its counts in
 * the first E (in/out; experts with no replica in the row stay out), w [P] its replica weights (in, then work).
 * The largest-load-per-replica rule picks counts no packing balances when slots are few (loads 10, 9, 1 on 2 GPUs
 * x 2 slots: counts 2, 1, 1 leave 14; 1, 1, 2 reach 10.5). Each round every move of n replicas from an expert with
 * more than n to another expert (up to max_replicas, 0: no cap) is packed (pack_row) and refined (refine_layer)
 * again (search_try); when none is lower and the row has at most pair_experts experts, every pair of one-replica
 * moves is (one move at a time got stuck where the optimum moves two replicas of two experts, or replicates a
 * small expert 3 or 4 times as filler). The move leaving the lowest GPU loads, busiest first and compared in turn,
 * is kept when they are lower beyond rounding, until none is, after max_search moves or once q->budget candidates
 * are packed (the best of the round so far is kept): the busiest GPU never rises. Returns the moves kept. */
static i64 search_counts(Search *q, i64 *o, i64 max_replicas, i64 max_search, i64 pair_experts) {
    i64 E = q->num_log, moves = 0, *cnt = q->cnt, *cnt2 = q->cnt2;
    sorted_loads(q->w, q->count, q->gpus, q->now);
    q->packed = 0;
    for (; moves < max_search && q->packed < q->budget; moves++) {
        q->tol = q->now[0] * 1e-12;
        q->found = 0;
        memcpy(q->top, q->now, sizeof(double) * (size_t)q->gpus);
        for (i64 src = 0; src < E; src++)
            for (i64 dst = 0; dst < E; dst++)
                for (i64 n = 1; n < cnt[src] && dst != src && cnt[dst] > 0; n++) { /* n replicas from src to dst */
                    if (max_replicas > 0 && cnt[dst] + n > max_replicas) break;
                    memcpy(cnt2, cnt, sizeof(i64) * (size_t)E);
                    cnt2[src] -= n;
                    cnt2[dst] += n;
                    search_try(q);
                }
        if (!q->found && E <= pair_experts) /* pairs of one-replica moves (a, b) <= (c, d) in move order */
            for (i64 a = 0; a < E; a++)
                for (i64 b = 0; b < E; b++) {
                    if (a == b || cnt[a] < 2 || cnt[b] < 1) continue;
                    for (i64 c = a; c < E; c++)
                        for (i64 d = c == a ? b + 1 : 0; d < E; d++) {
                            if (c == d || cnt[d] < 1) continue;
                            memcpy(cnt2, cnt, sizeof(i64) * (size_t)E);
                            cnt2[a]--;
                            cnt2[b]++;
                            cnt2[c]--;
                            cnt2[d]++;
                            int fits = 1;
                            for (i64 e = 0; e < E; e++)
                                fits &= cnt2[e] >= (cnt[e] > 0) && (max_replicas <= 0 || cnt2[e] <= max_replicas);
                            if (fits) search_try(q);
                        }
                }
        if (!q->found) break;
        memcpy(cnt, cnt + E, sizeof(i64) * (size_t)E);
        memcpy(o, q->best, sizeof(i64) * (size_t)q->width);
        memcpy(q->now, q->top, sizeof(double) * (size_t)q->gpus);
    }
    return moves;
}

/* ---------- greedy: place, then refine, each row in one pass (the global policy of solve_greedy) ---------- */

static PyObject *py_greedy(PyObject *self, PyObject *args) {
    PyObject *o_loads, *o_slots, *o_out, *o_stuck;
    Py_ssize_t rows, num_log, gpus, max_replicas, max_rounds;
    if (!PyArg_ParseTuple(args, "OnnOnnnOO", &o_loads, &rows, &num_log, &o_slots, &gpus, &max_replicas,
                          &max_rounds, &o_out, &o_stuck))
        return NULL;
    Py_buffer bl, bc, bo, bs;
    if (get_buf(o_slots, &bc, 8, gpus, 0, "slots_per_gpu") < 0) return NULL;
    const i64 *count = bc.buf;
    i64 width = 0, most = 1;
    for (i64 g = 0; g < gpus; g++) {
        width += count[g];
        most = count[g] > most ? count[g] : most;
        if (count[g] < 1) {
            PyErr_SetString(PyExc_ValueError, "greedy: every GPU needs at least one slot");
            PyBuffer_Release(&bc);
            return NULL;
        }
    }
    if (gpus < 1 || width < num_log) {
        PyErr_Format(PyExc_ValueError, "greedy: %lld slots for %zd experts", (long long)width, num_log);
        PyBuffer_Release(&bc);
        return NULL;
    }
    if (get_buf(o_loads, &bl, 8, rows * num_log, 0, "loads") < 0) goto e1;
    if (get_buf(o_out, &bo, 8, rows * width, 1, "out") < 0) goto e2;
    if (get_buf(o_stuck, &bs, 1, rows, 1, "stuck") < 0) goto e3;
    const double *loads = bl.buf;
    i64 *out = bo.buf;
    unsigned char *stuck = bs.buf;
    i64 leaves = 1;
    while (leaves < gpus) leaves *= 2;
    i64 *cnt = malloc(sizeof(i64) * (num_log + 1)), *item = malloc(sizeof(i64) * (num_log + 1));
    double *key = malloc(sizeof(double) * (num_log + 1)), *load = malloc(sizeof(double) * (gpus + 1));
    Pair *items = malloc(sizeof(Pair) * (num_log + 1)), *tmp = malloc(sizeof(Pair) * (num_log + 1));
    i64 *used = malloc(sizeof(i64) * (gpus + 1)), *tree = malloc(sizeof(i64) * 2 * leaves);
    double *key_of_bin = malloc(sizeof(double) * (gpus + 1)), *w = malloc(sizeof(double) * (width + 1));
    i64 *prev = malloc(sizeof(i64) * (width + 1)), *first_slot = malloc(sizeof(i64) * (gpus + 1));
    i64 *slack = malloc(sizeof(i64) * (num_log + 1)), *above = malloc(sizeof(i64) * (width + 1));
    RefineWork k;
    int ok = refine_alloc(&k, gpus, most, num_log) && cnt && item && key && load && items && tmp && used && tree &&
             key_of_bin && w && prev && first_slot && slack && above;
    i64 total = 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t row = 0; row < rows; row++) {
            i64 *o = out + row * width;
            const double *l = loads + row * num_log;
            for (i64 s = 0; s < width; s++) o[s] = -1;
            stuck[row] = (unsigned char)place_row(l, num_log, count, gpus, max_replicas, o, cnt, key, item, items,
                                                  tmp, load, used, tree, key_of_bin, prev, first_slot, slack, above);
            if (stuck[row] || gpus < 2 || max_rounds <= 0) continue; /* the caller spreads duplicates first */
            for (i64 s = 0; s < width; s++) w[s] = l[o[s]] / (double)cnt[o[s]];
            total += refine_layer(o, w, first_slot, count, gpus, most, num_log, max_rounds, &k);
        }
        Py_END_ALLOW_THREADS
    }
    refine_free(&k);
    free(cnt);
    free(item);
    free(key);
    free(load);
    free(items);
    free(tmp);
    free(used);
    free(tree);
    free(key_of_bin);
    free(w);
    free(prev);
    free(first_slot);
    free(slack);
    free(above);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bl);
    PyBuffer_Release(&bc);
    if (!ok) return PyErr_NoMemory();
    return PyLong_FromLongLong(total);
e3:
    PyBuffer_Release(&bo);
e2:
    PyBuffer_Release(&bl);
e1:
    PyBuffer_Release(&bc);
    return NULL;
}

/* search: search_counts on every row of expert [rows, P] (in/out; loads [rows, E]) that holds no two replicas of
 * one expert on one GPU; the rows are placed and refined already (the caller keeps rows with more slots than the
 * search is meant for out). Returns the moves kept. */
static PyObject *py_search(PyObject *self, PyObject *args) {
    PyObject *o_expert, *o_loads, *o_slots;
    Py_ssize_t rows, width, num_log, gpus, max_replicas, max_rounds, max_search, pair_experts, budget;
    if (!PyArg_ParseTuple(args, "OOnnnOnnnnnn", &o_expert, &o_loads, &rows, &width, &num_log, &o_slots, &gpus,
                          &max_replicas, &max_rounds, &max_search, &pair_experts, &budget))
        return NULL;
    Py_buffer be, bl, bc;
    if (get_buf(o_slots, &bc, 8, gpus, 0, "slots_per_gpu") < 0) return NULL;
    const i64 *count = bc.buf;
    i64 total_slots = 0, most = 1;
    for (i64 g = 0; g < gpus; g++) {
        total_slots += count[g];
        most = count[g] > most ? count[g] : most;
    }
    if (gpus < 1 || total_slots != width) {
        PyErr_Format(PyExc_ValueError, "search: %lld slots on the GPUs, rows of %zd", (long long)total_slots, width);
        PyBuffer_Release(&bc);
        return NULL;
    }
    if (get_buf(o_expert, &be, 8, rows * width, 1, "expert") < 0) {
        PyBuffer_Release(&bc);
        return NULL;
    }
    if (get_buf(o_loads, &bl, 8, rows * num_log, 0, "loads") < 0) {
        PyBuffer_Release(&be);
        PyBuffer_Release(&bc);
        return NULL;
    }
    i64 *expert = be.buf;
    const double *loads = bl.buf;
    for (i64 s = 0; s < rows * width; s++)
        if (expert[s] < 0 || expert[s] >= num_log) {
            PyErr_Format(PyExc_ValueError, "search: expert id %lld out of range [0, %zd)", (long long)expert[s],
                         num_log);
            PyBuffer_Release(&bl);
            PyBuffer_Release(&be);
            PyBuffer_Release(&bc);
            return NULL;
        }
    i64 leaves = 1;
    while (leaves < gpus) leaves *= 2;
    i64 *cnt = calloc(2 * num_log + 1, sizeof(i64)), *cnt2 = malloc(sizeof(i64) * (num_log + 1));
    i64 *cand = malloc(sizeof(i64) * (width + 1)), *best = malloc(sizeof(i64) * (width + 1));
    double *w = malloc(sizeof(double) * (width + 1)), *now = malloc(sizeof(double) * 3 * (gpus + 1));
    Pair *items = malloc(sizeof(Pair) * (num_log + 1)), *tmp = malloc(sizeof(Pair) * (num_log + 1));
    double *load = malloc(sizeof(double) * (gpus + 1)), *key_of_bin = malloc(sizeof(double) * (gpus + 1));
    i64 *used = malloc(sizeof(i64) * (gpus + 1)), *tree = malloc(sizeof(i64) * 2 * leaves);
    i64 *prev = malloc(sizeof(i64) * (width + 1)), *first_slot = malloc(sizeof(i64) * (gpus + 1));
    unsigned char *seen = calloc((size_t)num_log + 1, 1);
    RefineWork k;
    int ok = refine_alloc(&k, gpus, most, num_log) && cnt && cnt2 && cand && best && w && now && items && tmp &&
             load && key_of_bin && used && tree && prev && first_slot && seen;
    i64 total = 0;
    Search q = {NULL, count, num_log, gpus, width, most, max_rounds, cnt, cnt2, cand, best, w, now, now + gpus + 1,
                now + 2 * (gpus + 1), 0.0, items, tmp, load, key_of_bin, used, tree, prev, first_slot, &k, 0, 0,
                budget};
    if (ok && gpus >= 2 && max_search > 0) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t row = 0; row < rows; row++) {
            i64 *o = expert + row * width;
            const double *l = loads + row * num_log;
            int duplicate = 0;
            for (i64 g = 0, s = 0; g < gpus; g++) {
                for (i64 i = 0; i < count[g]; i++) duplicate |= seen[o[s + i]]++ > 0;
                for (i64 i = 0; i < count[g]; i++, s++) seen[o[s]] = 0;
            }
            if (duplicate) continue; /* the search keeps rows free of duplicates; these have one already */
            for (i64 e = 0; e < num_log; e++) cnt[e] = 0;
            for (i64 s = 0; s < width; s++) cnt[o[s]]++;
            for (i64 s = 0; s < width; s++) w[s] = l[o[s]] / (double)cnt[o[s]];
            q.l = l;
            total += search_counts(&q, o, max_replicas, max_search, pair_experts);
        }
        Py_END_ALLOW_THREADS
    }
    refine_free(&k);
    free(cnt);
    free(cnt2);
    free(cand);
    free(best);
    free(w);
    free(now);
    free(items);
    free(tmp);
    free(load);
    free(key_of_bin);
    free(used);
    free(tree);
    free(prev);
    free(first_slot);
    free(seen);
    PyBuffer_Release(&bl);
    PyBuffer_Release(&be);
    PyBuffer_Release(&bc);
    if (!ok) return PyErr_NoMemory();
    return PyLong_FromLongLong(total);
}

/* ---------- log2phy: the physical slots of each logical expert, by replica rank ---------- */

static PyObject *py_log2phy(PyObject *self, PyObject *args) {
    PyObject *o_phy2log, *o_rank, *o_out;
    Py_ssize_t rows, n_phy, n_log, maxcnt;
    if (!PyArg_ParseTuple(args, "OOnnnnO", &o_phy2log, &o_rank, &rows, &n_phy, &n_log, &maxcnt, &o_out)) return NULL;
    Py_buffer bp, br, bo;
    if (get_buf(o_phy2log, &bp, 8, rows * n_phy, 0, "phy2log") < 0) return NULL;
    if (get_buf(o_rank, &br, 8, rows * n_phy, 0, "rank") < 0) {
        PyBuffer_Release(&bp);
        return NULL;
    }
    if (get_buf(o_out, &bo, 8, rows * n_log * maxcnt, 1, "out") < 0) {
        PyBuffer_Release(&br);
        PyBuffer_Release(&bp);
        return NULL;
    }
    const i64 *phy2log = bp.buf, *rank = br.buf;
    i64 *out = bo.buf;
    int bad = 0;
    memset(out, 0xff, sizeof(i64) * (size_t)(rows * n_log * maxcnt)); /* -1 everywhere */
    for (i64 row = 0; row < rows && !bad; row++)
        for (i64 s = 0; s < n_phy; s++) {
            i64 e = phy2log[row * n_phy + s], r = rank[row * n_phy + s];
            if (e < 0 || e >= n_log || r < 0 || r >= maxcnt) {
                bad = 1;
                break;
            }
            out[(row * n_log + e) * maxcnt + r] = s;
        }
    PyBuffer_Release(&bo);
    PyBuffer_Release(&br);
    PyBuffer_Release(&bp);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "log2phy: expert or replica rank out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---------- take: out[row, i] = src[row, idx[row, i]] for 8-byte items (take_along_axis on rows) ---------- */

static PyObject *py_take(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_idx, *o_out;
    Py_ssize_t rows, n_src, n_idx;
    int inverse;
    if (!PyArg_ParseTuple(args, "OOnnnpO", &o_src, &o_idx, &rows, &n_src, &n_idx, &inverse, &o_out)) return NULL;
    Py_buffer bs, bi, bo;
    if (get_buf(o_src, &bs, 8, rows * n_src, 0, "src") < 0) return NULL;
    if (get_buf(o_idx, &bi, 8, rows * n_idx, 0, "idx") < 0) {
        PyBuffer_Release(&bs);
        return NULL;
    }
    if (get_buf(o_out, &bo, 8, rows * (inverse ? n_src : n_idx), 1, "out") < 0) {
        PyBuffer_Release(&bi);
        PyBuffer_Release(&bs);
        return NULL;
    }
    const uint64_t *src = bs.buf;
    const i64 *idx = bi.buf;
    uint64_t *out = bo.buf;
    int bad = 0;
    for (i64 row = 0; row < rows && !bad; row++) {
        const i64 *ix = idx + row * n_idx;
        for (i64 i = 0; i < n_idx; i++) {
            i64 j = ix[i];
            if (j < 0 || j >= n_src) {
                bad = 1;
                break;
            }
            if (inverse) out[row * n_src + j] = (uint64_t)i; /* src unused: out[row, idx[row, i]] = i */
            else out[row * n_idx + i] = src[row * n_src + j];
        }
    }
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bi);
    PyBuffer_Release(&bs);
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "take: index out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"replicate", py_replicate, METH_VARARGS,
     "replicate(weight, rows, E, num_physical, width, max_replicas, f32, phy2log, rank, logcnt)"},
    {"argsort_desc", py_argsort_desc, METH_VARARGS, "argsort_desc(values, rows, n, like_torch, out)"},
    {"pack", py_pack, METH_VARARGS,
     "pack(weight, rows, n, order, capacity, bins, experts, num_experts, f32, bin_of, rank)"},
    {"deepseek_rows", py_deepseek_rows, METH_VARARGS,
     "deepseek_rows(weight, rows, n_log, n_phy, packs, phy2log, rank, logcnt): DeepSeek's replicate and pack"},
    {"place", py_place, METH_VARARGS,
     "place(loads, rows, E, capacity, bins, width, max_replicas, out, stuck): replicate and pack each row"},
    {"log2phy", py_log2phy, METH_VARARGS,
     "log2phy(phy2log, rank, rows, n_phy, n_log, maxcnt, out): out[row, e, r] = slot of replica r of e, else -1"},
    {"take", py_take, METH_VARARGS,
     "take(src, idx, rows, n_src, n_idx, inverse, out): out[r, i] = src[r, idx[r, i]] (8-byte items); inverse: "
     "out[r, idx[r, i]] = i"},
    {"greedy", py_greedy, METH_VARARGS,
     "greedy(loads, rows, E, slots_per_gpu, gpus, max_replicas, max_rounds, out, stuck) -> swaps made: place "
     "and refine each row (rows marked stuck are placed, not refined)"},
    {"search", py_search, METH_VARARGS,
     "search(expert, loads, rows, num_physical, E, slots_per_gpu, gpus, max_replicas, max_rounds, max_search, "
     "pair_experts, budget) -> moves kept: the replica-count search on each placed, refined row without a duplicate"},
    {"refine", py_refine, METH_VARARGS,
     "refine(expert, loads, rows, num_physical, num_experts, slots_per_gpu, gpus, max_rounds) -> swaps made"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Compiled loops of solvers.greedy.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
