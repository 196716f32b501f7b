/* Compiled swap loop of solvers/coactivation.py (built by `pip install -e .`).
 *
 * refine(): one layer's best-swap local search. Each step makes the admissible slot swap with the
 * largest gain in co-located pair weight (ties: the first (s, t) in row-major order), exactly as the
 * numpy loop in solvers/coactivation.py (`_swaps_numpy`) does; the same floating-point operations in the
 * same order, so both give the same swaps.
 *
 * The numpy loop rebuilds the whole P x P gain matrix every step. Here the gains are grouped in blocks,
 * one per pair of GPUs (a, b): the swaps of a slot on a with a slot on b. A block's gains and
 * admissibility read only columns a and b of the affinity matrix and the loads, holdings and slots of
 * a and b, so a swap between GPUs g and h changes only the blocks that involve g or h. Every block keeps
 * its best admissible entry. A changed block first gets only a cheap upper bound on its gains (O(slots)
 * instead of O(slots^2), see bound()); the blocks sit in a max-heap by best entry or bound, and a step
 * evaluates changed blocks from the top down only until a clean block is on top: its best entry is then
 * the step's swap.
 *
 * Buffers are C-contiguous int64 / float64 through the buffer protocol (no numpy headers). The numpy
 * side (`solvers.coactivation._setup`) builds the pair weights, the initial affinity (its matmul) and
 * the loads, and reads the co-located weight back from the affinity this returns. A non-finite input
 * makes refine() return None without doing anything (the numpy loop handles those).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_buffer.h"

typedef int64_t i64;

typedef struct {
    double key;
    i64 tie, k; /* tie: -1 dirty, else the best entry's index; k: the block */
} Node;

typedef struct {
    i64 P, G, E, S; /* slots, GPUs, experts, load rows (window + sub-windows) */
    const double *W, *WT, *cap; /* W [P, P]; WT its transpose; cap [S] */
    double *A;                  /* affinity [P, G], updated in place */
    double *wt, *ld;            /* slot loads [P, S]; GPU loads [G, S] */
    const i64 *row;             /* expert of each slot [P] */
    i64 *gpu;                   /* GPU of each slot [P], updated in place */
    i64 *mem, *first, *pos;     /* slots by GPU: mem[first[g] .. first[g + 1]); pos[s]: s's index in mem */
    i64 *hc;                    /* [G, E] replicas of expert e on GPU g */
    double *bv, *ta, *tb, *xt, *t0, *tl; /* bv: best gain per block (a < b) at a * G + b; the rest: scratch [P] */
    unsigned char *th;
    i64 *bi;              /* its row-major index s * P + t; -1: none */
    double *ub;           /* per block, when dirty: no gain in it exceeds this */
    unsigned char *dirty; /* per block: bv, bi stale (the block changed since computed) */
    Node *heap;              /* the blocks by best gain or bound (see sift) */
    i64 *hpos, nheap;
    double w2min;         /* min of 2 W */
    unsigned char *moved; /* [G] GPUs a swap changed since the round began (iterated local search) */
} Coact;

/* (v, idx) beats (bv, bi) when larger, or equal with an earlier row-major index. bi -1 with bv 1e-9:
 * nothing yet, and a gain must exceed 1e-9 (the numpy loop stops when the best does not). */
static inline int beats(double v, i64 idx, double bv, i64 bi) { return v > bv || (v == bv && bi >= 0 && idx < bi); }

static inline int admissible(const Coact *c, i64 s, i64 t, i64 a, i64 b) {
    const i64 E = c->E, S = c->S;
    if (c->hc[b * E + c->row[s]] || c->hc[a * E + c->row[t]]) return 0;
    const double *ws = c->wt + s * S, *wt = c->wt + t * S, *la = c->ld + a * S, *lb = c->ld + b * S;
    for (i64 k = 0; k < S; k++) {
        if (!(la[k] - ws[k] + wt[k] <= c->cap[k])) return 0; /* load of a after the swap */
        if (!(lb[k] - wt[k] + ws[k] <= c->cap[k])) return 0; /* load of b */
    }
    return 1;
}

/* Block (a, b), a < b: its best admissible entry, over (s, t) and (t, s), s on a, t on b. An entry is
 * checked for admissibility only when it beats the best admissible one so far. */
static void block(Coact *c, i64 a, i64 b) {
    const i64 P = c->P, G = c->G, k = a * G + b;
    const double *A = c->A;
    const i64 na = c->first[a + 1] - c->first[a], nb = c->first[b + 1] - c->first[b];
    const i64 *ma = c->mem + c->first[a], *mb = c->mem + c->first[b];
    double bv = 1e-9;
    i64 bi = -1;
    double *ta = c->ta, *tb = c->tb, *xt = c->xt, *t0 = c->t0, *tl = c->tl;
    const double la0 = c->ld[a * c->S], lb0 = c->ld[b * c->S], cap0 = c->cap[0];
    unsigned char *th = c->th;
    for (i64 j = 0; j < nb; j++) {
        i64 t = mb[j];
        ta[j] = A[t * G + a];
        tb[j] = A[t * G + b];
        xt[j] = ta[j] - tb[j];
        t0[j] = c->wt[t * c->S];
        tl[j] = lb0 - t0[j];                        /* admissible()'s first load row, b's side: tl + ws0 */
        th[j] = c->hc[a * c->E + c->row[t]] == 0; /* a does not hold t's expert */
    }
    for (i64 i = 0; i < na; i++) {
        i64 s = ma[i];
        if (c->hc[b * c->E + c->row[s]]) continue; /* b holds s's expert: no swap of s with b */
        double sa = A[s * G + a], sb = A[s * G + b], us = sb - sa;
        const double s0 = c->wt[s * c->S], sl = la0 - s0; /* a's side: sl + t0 */
        const double *ws = c->W + s * P, *wts = c->WT + s * P;
        for (i64 j = 0; j < nb; j++) {
            i64 t = mb[j];
            /* numpy: b - own[:, None] + b.T - own[None, :] - 2.0 * weight, at (s, t) and at (t, s):
             * ((sb - sa) + ta) - tb - 2 w and ((ta - tb) + sb) - sa - 2 w' (us, xt: the first terms) */
            double g1 = us + ta[j] - tb[j] - 2.0 * ws[t];
            double g2 = xt[j] + sb - sa - 2.0 * wts[t];
            /* the common cases, tested without branches: neither gain can beat the best so far, or the
             * swap fails admissible()'s first checks (holdings, the window's loads) */
            if (!(((g1 >= bv) | (g2 >= bv)) & th[j] & (sl + t0[j] <= cap0) & (tl[j] + s0 <= cap0))) continue;
            i64 i1 = s * P + t, i2 = t * P + s;
            int b1 = beats(g1, i1, bv, bi), b2 = beats(g2, i2, bv, bi);
            if (!(b1 || b2) || !admissible(c, s, t, a, b)) continue;
            if (b1) {
                bv = g1;
                bi = i1;
            }
            if (beats(g2, i2, bv, bi)) {
                bv = g2;
                bi = i2;
            }
        }
    }
    c->bv[k] = bv;
    c->bi[k] = bi;
    c->dirty[k] = 0;
}

/* An upper bound on every gain of block (a, b), from columns a and b of the affinity alone. Rounding to
 * nearest is monotone, so evaluating a gain's expression (same operations, same order) with each operand
 * replaced by one at least as favourable (the largest first difference, the smallest 2 W) gives a value
 * at least as large: the bound is exact-safe, not approximate. */
static double bound(const Coact *c, i64 a, i64 b) {
    const i64 G = c->G;
    const double *A = c->A;
    const i64 na = c->first[a + 1] - c->first[a], nb = c->first[b + 1] - c->first[b];
    const i64 *ma = c->mem + c->first[a], *mb = c->mem + c->first[b];
    double U = -INFINITY, X = -INFINITY, ub = -INFINITY;
    for (i64 i = 0; i < na; i++) {
        double u = A[ma[i] * G + b] - A[ma[i] * G + a];
        U = u > U ? u : U;
    }
    for (i64 j = 0; j < nb; j++) {
        double x = A[mb[j] * G + a] - A[mb[j] * G + b];
        X = x > X ? x : X;
    }
    for (i64 j = 0; j < nb; j++) {
        double v = U + A[mb[j] * G + a] - A[mb[j] * G + b] - c->w2min; /* g1 = sb - sa + ta - tb - 2 w */
        ub = v > ub ? v : ub;
    }
    for (i64 i = 0; i < na; i++) {
        double v = X + A[ma[i] * G + b] - A[ma[i] * G + a] - c->w2min; /* g2 = ta - tb + sb - sa - 2 w */
        ub = v > ub ? v : ub;
    }
    return ub;
}

/* The blocks in one max-heap of nodes (heap[0] on top; hpos[k]: block k's place). A clean block sits by its
 * best (gain, then the earlier index first), a dirty one by its bound; on equal values a dirty block
 * comes first (tie -1), so when the top is clean no dirty block can hold an entry that beats it. */
static inline int above(const Node *x, const Node *y) { return x->key > y->key || (x->key == y->key && x->tie < y->tie); }

static inline void set_node(Coact *c, i64 k) {
    Node *n = c->heap + c->hpos[k];
    if (c->dirty[k]) {
        n->key = c->ub[k];
        n->tie = -1;
    } else if (c->bi[k] >= 0) {
        n->key = c->bv[k];
        n->tie = c->bi[k];
    } else {
        n->key = -INFINITY;
        n->tie = INT64_MAX;
    }
}

static void sift_down(Coact *c, i64 i) {
    Node *h = c->heap, x = h[i];
    const i64 n = c->nheap;
    for (;;) {
        i64 l = 2 * i + 1, m = i;
        const Node *top = &x;
        if (l < n && above(&h[l], top)) m = l, top = &h[l];
        if (l + 1 < n && above(&h[l + 1], top)) m = l + 1;
        if (m == i) break;
        h[i] = h[m];
        c->hpos[h[i].k] = i;
        i = m;
    }
    h[i] = x;
    c->hpos[x.k] = i;
}

/* block k has a new key: move it up or down */
static void sift(Coact *c, i64 k) {
    set_node(c, k);
    Node *h = c->heap, x = h[c->hpos[k]];
    i64 i = c->hpos[k];
    while (i > 0 && above(&x, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        c->hpos[h[i].k] = i;
        i = (i - 1) / 2;
    }
    h[i] = x;
    c->hpos[k] = i;
    sift_down(c, i);
}

/* block (a, b) changed: keep only its bound until a step needs it (none above 1e-9: no entry can win) */
static void touch(Coact *c, i64 a, i64 b) {
    i64 k = a * c->G + b;
    double ub = bound(c, a, b);
    c->ub[k] = ub;
    c->dirty[k] = ub > 1e-9;
    if (!c->dirty[k]) c->bi[k] = -1;
}

static void touch_all_of(Coact *c, i64 g) {
    for (i64 x = 0; x < c->G; x++) {
        if (x == g) continue;
        touch(c, x < g ? x : g, x < g ? g : x);
        sift(c, x < g ? x * c->G + g : g * c->G + x);
    }
}

/* numpy: affinity[:, g] += weight[:, t] - weight[:, s] (and h), gpu_load likewise; the holdings and slot
 * lists follow. The blocks are not touched here. */
static void apply_swap(Coact *c, i64 s, i64 t) {
    const i64 P = c->P, G = c->G, E = c->E, S = c->S, g = c->gpu[s], h = c->gpu[t];
    const double *wcs = c->WT + s * P, *wct = c->WT + t * P; /* columns s and t of W */
    for (i64 r = 0; r < P; r++) {
        c->A[r * G + g] += wct[r] - wcs[r];
        c->A[r * G + h] += wcs[r] - wct[r];
    }
    const double *ws = c->wt + s * S, *wt = c->wt + t * S;
    for (i64 k = 0; k < S; k++) {
        c->ld[g * S + k] += wt[k] - ws[k];
        c->ld[h * S + k] += ws[k] - wt[k];
    }
    c->hc[g * E + c->row[s]]--;
    c->hc[h * E + c->row[s]]++;
    c->hc[h * E + c->row[t]]--;
    c->hc[g * E + c->row[t]]++;
    i64 ps = c->pos[s], pt = c->pos[t];
    c->mem[ps] = t;
    c->mem[pt] = s;
    c->pos[s] = pt;
    c->pos[t] = ps;
    c->gpu[s] = h;
    c->gpu[t] = g;
    c->moved[g] = c->moved[h] = 1;
}

/* the blocks of every GPU a swap changed since the round began get fresh bounds (the others' best entries
 * and bounds still hold: a block reads only its two GPUs' columns, loads, holdings and slots) */
static void touch_moved(Coact *c) {
    for (i64 g = 0; g < c->G; g++)
        if (c->moved[g]) touch_all_of(c, g);
}

/* every block bounded afresh, the heap built from scratch */
static void rebuild(Coact *c) {
    const i64 G = c->G;
    c->nheap = 0;
    for (i64 a = 0; a < G; a++)
        for (i64 b = a + 1; b < G; b++) {
            touch(c, a, b);
            c->heap[c->nheap].k = a * G + b;
            c->hpos[a * G + b] = c->nheap++;
            set_node(c, a * G + b);
        }
    for (i64 i = c->nheap / 2; i >= 0 && c->nheap > 0; i--) sift_down(c, i);
}

/* best-swap descent from the current state (heap up to date), at most `budget` swaps; *val += each gain */
static i64 descend(Coact *c, i64 budget, double *val) {
    const i64 P = c->P, G = c->G;
    i64 swaps = 0;
    for (; swaps < budget && c->nheap > 0; swaps++) {
        while (c->heap[0].tie == -1) { /* the best bound first: evaluate it, it sinks to its exact place */
            i64 k = c->heap[0].k;
            block(c, k / G, k % G);
            set_node(c, k);
            sift_down(c, 0);
        }
        i64 k = c->heap[0].k, bi = c->bi[k];
        if (bi < 0) break;
        i64 s = bi / P, t = bi % P, g = c->gpu[s], h = c->gpu[t];
        *val += c->bv[k];
        apply_swap(c, s, t);
        touch_all_of(c, g);
        touch_all_of(c, h);
    }
    return swaps;
}

/* xorshift64 (Marsaglia): the kicks' random numbers, the same sequence as solvers/coactivation.py's */
static inline uint64_t xorshift(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* `kick` random admissible swaps (each from up to KICK_TRIES random slot pairs); *val += each gain */
#define KICK_TRIES 50
static void kick(Coact *c, i64 kick, uint64_t *rng, double *val) {
    const i64 P = c->P, G = c->G;
    const double *A = c->A;
    for (i64 n = 0; n < kick; n++)
        for (int tries = 0; tries < KICK_TRIES; tries++) {
            i64 s = (i64)(xorshift(rng) % (uint64_t)P), t = (i64)(xorshift(rng) % (uint64_t)P);
            i64 a = c->gpu[s], b = c->gpu[t];
            if (a == b || !admissible(c, s, t, a, b)) continue;
            *val += ((A[s * G + b] - A[s * G + a]) + A[t * G + a]) - A[t * G + b] - 2.0 * c->W[s * P + t];
            apply_swap(c, s, t);
            break;
        }
}

/* A state of the search: the placement and everything derived from it, the blocks' best entries, bounds and
 * heap included (so restoring it needs no re-bounding: they were exact or valid bounds for that state) */
typedef struct {
    double *A, *ld, *bv, *ub;
    i64 *hc, *gpu, *mem, *pos, *bi, *hpos;
    unsigned char *dirty;
    Node *heap;
} Snap;

static void copy_state(Coact *to, const Coact *from) {
    const size_t P = (size_t)from->P, G = (size_t)from->G, E = (size_t)from->E, S = (size_t)from->S;
    memcpy(to->A, from->A, sizeof(double) * P * G);
    memcpy(to->ld, from->ld, sizeof(double) * G * S);
    memcpy(to->hc, from->hc, sizeof(i64) * G * E);
    memcpy(to->gpu, from->gpu, sizeof(i64) * P);
    memcpy(to->mem, from->mem, sizeof(i64) * P);
    memcpy(to->pos, from->pos, sizeof(i64) * P);
    memcpy(to->bv, from->bv, sizeof(double) * G * G);
    memcpy(to->ub, from->ub, sizeof(double) * G * G);
    memcpy(to->bi, from->bi, sizeof(i64) * G * G);
    memcpy(to->hpos, from->hpos, sizeof(i64) * G * G);
    memcpy(to->dirty, from->dirty, G * G);
    memcpy(to->heap, from->heap, sizeof(Node) * (size_t)from->nheap);
}

static void save(const Coact *c, Snap *b) {
    Coact to = *c;
    to.A = b->A, to.ld = b->ld, to.hc = b->hc, to.gpu = b->gpu, to.mem = b->mem, to.pos = b->pos;
    to.bv = b->bv, to.ub = b->ub, to.bi = b->bi, to.hpos = b->hpos, to.dirty = b->dirty, to.heap = b->heap;
    copy_state(&to, c);
}

static void restore(Coact *c, const Snap *b) {
    Coact from = *c;
    from.A = b->A, from.ld = b->ld, from.hc = b->hc, from.gpu = b->gpu, from.mem = b->mem, from.pos = b->pos;
    from.bv = b->bv, from.ub = b->ub, from.bi = b->bi, from.hpos = b->hpos, from.dirty = b->dirty, from.heap = b->heap;
    copy_state(c, &from);
}

/* The descent, then `rounds` of iterated local search: from the best state, `kick` random admissible swaps
 * and a descent; the result kept if its co-located weight beats the best by more than 1e-9, else undone.
 * max_swaps bounds the descents' swaps over all rounds (the kicks not counted). Returns descent swaps. */
static i64 run(Coact *c, i64 max_swaps, i64 rounds, i64 kick_size, Snap *best) {
    double val = 0.0;
    rebuild(c);
    i64 swaps = descend(c, max_swaps, &val);
    if (rounds <= 0 || kick_size <= 0 || c->P < 2 || c->G < 2) return swaps;
    uint64_t rng = 0x9E3779B97F4A7C15ULL;
    double best_val = val;
    save(c, best);
    for (i64 r = 0; r < rounds && swaps < max_swaps; r++) {
        memset(c->moved, 0, (size_t)c->G);
        kick(c, kick_size, &rng, &val);
        touch_moved(c);
        swaps += descend(c, max_swaps - swaps, &val);
        if (val > best_val + 1e-9) {
            best_val = val;
            save(c, best);
        } else {
            restore(c, best); /* back to the best state, its blocks' entries and bounds with it */
            val = best_val;
        }
    }
    return swaps;
}

static PyObject *py_refine(PyObject *self, PyObject *args) {
    PyObject *o_weight, *o_aff, *o_w, *o_load, *o_cap, *o_row, *o_gpu;
    Py_ssize_t P, G, E, S, max_swaps, rounds = 0, kick_size = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnnnn|nn", &o_weight, &o_aff, &o_w, &o_load, &o_cap, &o_row, &o_gpu, &P, &G,
                          &E, &S, &max_swaps, &rounds, &kick_size))
        return NULL;
    if (P < 0 || G < 1 || E < 1 || S < 1) {
        PyErr_SetString(PyExc_ValueError, "refine: need P >= 0, G >= 1, E >= 1, S >= 1");
        return NULL;
    }
    Py_buffer b[7];
    const BufferSpec spec[7] = {
        {o_weight, 8, P * P, 0, "weight"}, {o_aff, 8, P * G, 1, "affinity"}, {o_w, 8, S * P, 0, "slot_loads"},
        {o_load, 8, S * G, 0, "gpu_loads"}, {o_cap, 8, S, 0, "cap"},        {o_row, 8, P, 0, "row"},
        {o_gpu, 8, P, 1, "gpu"},
    };
    if (buffers(spec, 7, b) < 0) return NULL;
    const i64 *row = b[5].buf, *gpu = b[6].buf;
    int bad = 0;
    for (i64 s = 0; s < P && !bad; s++) bad = row[s] < 0 || row[s] >= E || gpu[s] < 0 || gpu[s] >= G;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "refine: expert or GPU id out of range");
        release_buffers(b, 7);
        return NULL;
    }
    Coact c = {P, G, E, S};
    c.W = b[0].buf;
    c.A = b[1].buf;
    c.cap = b[4].buf;
    c.row = row;
    c.gpu = b[6].buf;
    double *WT = malloc(sizeof(double) * (size_t)(P * P + 1));
    c.wt = malloc(sizeof(double) * (size_t)(P * S + 1));
    c.ld = malloc(sizeof(double) * (size_t)(G * S));
    c.mem = malloc(sizeof(i64) * (size_t)(P + 1));
    c.first = calloc((size_t)G + 1, sizeof(i64));
    c.pos = malloc(sizeof(i64) * (size_t)(P + 1));
    c.hc = calloc((size_t)(G * E), sizeof(i64));
    c.bv = malloc(sizeof(double) * (size_t)(G * G));
    c.bi = malloc(sizeof(i64) * (size_t)(G * G));
    c.ub = malloc(sizeof(double) * (size_t)(G * G));
    c.dirty = malloc((size_t)(G * G));
    c.heap = malloc(sizeof(Node) * (size_t)(G * G));
    c.hpos = malloc(sizeof(i64) * (size_t)(G * G));
    c.ta = malloc(sizeof(double) * (size_t)(P + 1));
    c.tb = malloc(sizeof(double) * (size_t)(P + 1));
    c.xt = malloc(sizeof(double) * (size_t)(P + 1));
    c.t0 = malloc(sizeof(double) * (size_t)(P + 1));
    c.tl = malloc(sizeof(double) * (size_t)(P + 1));
    c.th = malloc((size_t)P + 1);
    c.moved = calloc((size_t)G, 1);
    Snap best = {malloc(sizeof(double) * (size_t)(P * G + 1)), malloc(sizeof(double) * (size_t)(G * S)),
                 malloc(sizeof(double) * (size_t)(G * G)), malloc(sizeof(double) * (size_t)(G * G)),
                 malloc(sizeof(i64) * (size_t)(G * E)), malloc(sizeof(i64) * (size_t)(P + 1)),
                 malloc(sizeof(i64) * (size_t)(P + 1)), malloc(sizeof(i64) * (size_t)(P + 1)),
                 malloc(sizeof(i64) * (size_t)(G * G)), malloc(sizeof(i64) * (size_t)(G * G)),
                 malloc((size_t)(G * G)), malloc(sizeof(Node) * (size_t)(G * G))};
    i64 swaps = -2; /* -2: out of memory; -1: a non-finite input (nothing done) */
    if (WT && c.wt && c.ld && c.mem && c.first && c.pos && c.hc && c.bv && c.bi && c.ub && c.dirty && c.heap && c.hpos &&
        c.ta && c.tb && c.xt && c.t0 && c.tl && c.th && c.moved && best.A && best.ld && best.hc && best.gpu && best.mem &&
        best.pos && best.bv && best.ub && best.bi && best.hpos && best.dirty && best.heap) {
        Py_BEGIN_ALLOW_THREADS
        const double *W = c.W, *w = b[2].buf, *load = b[3].buf;
        int finite = 1;
        c.w2min = INFINITY;
        for (i64 r = 0; r < P; r++)
            for (i64 q = 0; q < P; q++) {
                double x = W[r * P + q];
                finite &= isfinite(x) != 0;
                c.w2min = 2.0 * x < c.w2min ? 2.0 * x : c.w2min;
                WT[q * P + r] = x;
            }
        /* bitwise symmetric weights (pair counts give them): W serves as its own transpose, less memory traffic */
        c.WT = memcmp(WT, W, sizeof(double) * (size_t)(P * P)) == 0 ? W : WT;
        for (i64 i = 0; i < P * G; i++) finite &= isfinite(c.A[i]) != 0;
        for (i64 k = 0; k < S; k++) {
            finite &= isfinite(c.cap[k]) != 0;
            for (i64 s = 0; s < P; s++) finite &= isfinite(c.wt[s * S + k] = w[k * P + s]) != 0;
            for (i64 g = 0; g < G; g++) finite &= isfinite(c.ld[g * S + k] = load[k * G + g]) != 0;
        }
        for (i64 s = 0; s < P; s++) {
            c.first[c.gpu[s] + 1]++;
            c.hc[c.gpu[s] * E + row[s]]++;
        }
        for (i64 g = 0; g < G; g++) c.first[g + 1] += c.first[g];
        i64 *fill = c.bi; /* scratch before run(): next free place per GPU */
        for (i64 g = 0; g < G; g++) fill[g] = c.first[g];
        for (i64 s = 0; s < P; s++) {
            c.pos[s] = fill[c.gpu[s]]++;
            c.mem[c.pos[s]] = s;
        }
        swaps = finite ? run(&c, max_swaps, rounds, kick_size, &best) : -1;
        Py_END_ALLOW_THREADS
    }
    free(WT); free(c.wt); free(c.ld); free(c.mem); free(c.first); free(c.pos); free(c.hc);
    free(c.bv); free(c.bi); free(c.ub); free(c.dirty); free(c.heap); free(c.hpos); free(c.ta); free(c.tb); free(c.xt); free(c.t0); free(c.tl); free(c.th); free(c.moved);
    free(best.A); free(best.ld); free(best.hc); free(best.gpu); free(best.mem); free(best.pos);
    free(best.bv); free(best.ub); free(best.bi); free(best.hpos); free(best.dirty); free(best.heap);
    release_buffers(b, 7);
    if (swaps == -2) return PyErr_NoMemory();
    if (swaps == -1) Py_RETURN_NONE;
    return PyLong_FromLongLong((long long)swaps);
}

/* weights(pairs [R, C], row [P], rep [P], out [P, P]): out[s, u] = pairs[row[s], row[u]] / (rep[s] * rep[u]),
 * 0 where row[s] == row[u]: numpy's `pairs[row][:, row] / (rep[:, None] * rep[None, :])` and mask, the same
 * operations, without the two gathers' temporaries. */
static PyObject *py_weights(PyObject *self, PyObject *args) {
    PyObject *o_pairs, *o_row, *o_rep, *o_out;
    Py_ssize_t R, C, P;
    if (!PyArg_ParseTuple(args, "OOOOnnn", &o_pairs, &o_row, &o_rep, &o_out, &R, &C, &P)) return NULL;
    if (R < 0 || C < 0 || P < 0) {
        PyErr_SetString(PyExc_ValueError, "weights: negative size");
        return NULL;
    }
    Py_buffer b[4];
    const BufferSpec spec[4] = {
        {o_pairs, 8, R * C, 0, "pairs"}, {o_row, 8, P, 0, "row"}, {o_rep, 8, P, 0, "rep"}, {o_out, 8, P * P, 1, "out"}};
    if (buffers(spec, 4, b) < 0) return NULL;
    const i64 *row = b[1].buf;
    int bad = 0;
    for (i64 s = 0; s < P && !bad; s++) bad = row[s] < 0 || row[s] >= R || row[s] >= C;
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "weights: expert id out of range");
        release_buffers(b, 4);
        return NULL;
    }
    const double *pairs = b[0].buf, *rep = b[2].buf;
    double *out = b[3].buf;
    Py_BEGIN_ALLOW_THREADS
    for (i64 s = 0; s < P; s++) {
        const double *pr = pairs + row[s] * C;
        double *o = out + s * P;
        for (i64 u = 0; u < P; u++) o[u] = row[u] == row[s] ? 0.0 : pr[row[u]] / (rep[s] * rep[u]);
    }
    Py_END_ALLOW_THREADS
    release_buffers(b, 4);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"weights", py_weights, METH_VARARGS, "weights(pairs, row, rep, out, R, C, P): pair weight of every two slots"},
    {"refine", py_refine, METH_VARARGS,
     "refine(weight, affinity, slot_loads, gpu_loads, cap, row, gpu, P, G, E, S, max_swaps, rounds=0, kick=0) -> "
     "swaps made, or None (a non-finite input: nothing done)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_coact", "Compiled swap loop of solvers.coactivation.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__coact(void) { return PyModule_Create(&module); }
