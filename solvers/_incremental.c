/* Compiled move loop of solvers/incremental.py (built by `pip install -e .`).
 *
 * walk(): every layer, from the serving placement, takes one best move per step (spread, replace or
 * swap; see solvers/incremental.py) and records the busiest GPU's load and the copies after each step.
 * Its first moves repair the serving placement's duplicates (a second replica of an expert on one GPU), up to
 * a per-layer number of them (`repair_step`).
 * Layers are independent; one step looks at every replica of the busiest GPU against every redundant
 * slot, the coldest experts and the slots of the lightest GPUs, so a layer's step is a few thousand
 * arithmetic operations. The numpy version of the same loop took 0.6 to 2 s on a DeepSeek-V3-sized
 * model (one numpy round per step); this one takes milliseconds.
 *
 * Ranking: a move must lower the busiest GPU by min_gain; among those, the best value per copy, where value is
 * the drop of the summed excess above `level` of every GPU it touches (receivers and the other holders of the
 * experts whose replica counts change included) plus alpha x the busiest GPU's drop (level inf: the busiest GPU's
 * drop alone; solvers/incremental.py passes the balanced level and alpha 1, or a target and alpha 0). When other GPUs tie with
 * the busiest one (the same load up to rounding, TIE), the layer's max only drops when every one of them drops: the
 * busiest GPU's drop is then the max's, over the touched and the tied GPUs; if no move lowers them all, the step
 * lowers the busiest one as without ties (the next step sees one tied GPU fewer).
 *
 * Buffers are C-contiguous int64 / float64 through the buffer protocol (no numpy headers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_buffer.h"

/* Inlining is chosen where it was measured: holder_tops has two callers (the walk's step and repair_step) and out of
 * line the step took ~5% longer; the step's moves (best_move) are inlined for a step without ties and kept out of line
 * for one with ties (best_move_tied), so the common step's code stays as it was before ties were handled. */
#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#else
#define ALWAYS_INLINE inline
#define NOINLINE
#endif

typedef int64_t i64;

#define TIE 1e-12 /* GPUs whose load is within this fraction of the peak tie with the busiest GPU (rounding) */

typedef struct {
    /* problem */
    i64 E, P, G, K, light, group_size, node_size, num_groups;
    const i64 *gpu_of, *start, *count, *node_ok; /* node_ok: [nodes * groups] of this layer, or NULL */
    /* scratch, one layer at a time */
    i64 *ex, *cnt, *top_gpu, *lights, *red_slot, *tied; /* tied: [G] the GPUs tied with the busiest one */
    double *load, *share, *top_load, *add, *rise, *red_base, *red_nx;
    double level, alpha; /* excess: load above level (inf: none); a move's rank: excess drop + alpha x peak drop */
    double *gain_more, *cost_less; /* [E] excess change of all holders if the expert gains / loses a replica */
    uint16_t *holds;     /* [G * E] replicas of each expert on each GPU (2 or more: a duplicate) */
    unsigned char *orig; /* [G * E] 1 where the GPU held the expert in the serving placement */
} Walk;

static inline int allowed(const Walk *c, i64 e, i64 g) {
    return c->node_ok == NULL || c->node_ok[(g / c->node_size) * c->num_groups + e / c->group_size];
}

/* share, add (per replica with one more), rise (per replica with one fewer, minus share) of expert e */
static inline void expert_terms(Walk *c, const double *w, i64 e) {
    i64 n = c->cnt[e];
    c->share[e] = n > 0 ? w[e] / (double)n : 0.0;
    c->add[e] = w[e] / (double)(n + 1);
    c->rise[e] = n >= 2 ? w[e] / (double)(n - 1) - c->share[e] : INFINITY;
}

static double compute_loads(Walk *c) {
    double peak = -INFINITY;
    for (i64 g = 0; g < c->G; g++) c->load[g] = 0.0;
    for (i64 s = 0; s < c->P; s++) c->load[c->gpu_of[s]] += c->share[c->ex[s]];
    for (i64 g = 0; g < c->G; g++) peak = c->load[g] > peak ? c->load[g] : peak;
    return peak;
}

/* the three busiest distinct GPUs holding each expert */
static ALWAYS_INLINE void holder_tops(Walk *c) {
    for (i64 i = 0; i < 3 * c->E; i++) {
        c->top_load[i] = -INFINITY;
        c->top_gpu[i] = -1;
    }
    for (i64 s = 0; s < c->P; s++) {
        i64 x = c->ex[s], g = c->gpu_of[s];
        double *tl = c->top_load + 3 * x;
        i64 *tg = c->top_gpu + 3 * x;
        if (tg[0] == g || tg[1] == g || tg[2] == g) continue;
        double l = c->load[g];
        if (l > tl[0]) {
            tl[2] = tl[1]; tg[2] = tg[1]; tl[1] = tl[0]; tg[1] = tg[0]; tl[0] = l; tg[0] = g;
        } else if (l > tl[1]) {
            tl[2] = tl[1]; tg[2] = tg[1]; tl[1] = l; tg[1] = g;
        } else if (l > tl[2]) {
            tl[2] = l; tg[2] = g;
        }
    }
}

static inline double holder_max(const Walk *c, i64 x, i64 not1, i64 not2) {
    for (int i = 0; i < 3; i++) {
        i64 g = c->top_gpu[3 * x + i];
        if (g < 0) return -INFINITY;
        if (g != not1 && g != not2) return c->top_load[3 * x + i];
    }
    return -INFINITY;
}

static inline double exc(const Walk *c, double v) { return v > c->level ? v - c->level : 0.0; }

/* gain_more[e]: change of the holders' summed excess if e gains a replica (<= 0); cost_less[e]: if it loses one */
static void holder_excess(Walk *c) {
    for (i64 e = 0; e < c->E; e++) c->gain_more[e] = c->cost_less[e] = 0.0;
    for (i64 s = 0; s < c->P; s++) {
        i64 x = c->ex[s];
        double l = c->load[c->gpu_of[s]], base = exc(c, l);
        c->gain_more[x] += exc(c, l - (c->share[x] - c->add[x])) - base;
        c->cost_less[x] += c->cnt[x] >= 2 ? exc(c, l + c->rise[x]) - base : 0.0;
    }
}

typedef struct {
    double value, score;
    i64 cost, slot[2], expert[2];
} Move;

/* A move lowering the busiest GPU to `score` (the highest new load of the GPUs it touches): kept in best if it lowers
 * it by min_gain, fits the budget and has the best value per copy (with by_score, on equal value the lower score) */
static inline void consider(Move *best, double peak, double score, double drop, double alpha, i64 cost,
                            double min_gain, i64 budget_left, int by_score, i64 s0, i64 e0, i64 s1, i64 e1) {
    double gain = peak - score;
    if (!(gain >= min_gain)) return;
    if (budget_left >= 0 && cost > budget_left) return;
    double value = (drop + alpha * gain) / (cost > 0 ? (double)cost : 0.1);
    if (value > best->value || (by_score && value == best->value && score < best->score)) {
        best->value = value;
        best->score = score;
        best->cost = cost;
        best->slot[0] = s0;
        best->expert[0] = e0;
        best->slot[1] = s1;
        best->expert[1] = e1;
    }
}

/* The busiest of the tied GPUs (c->tied[0 .. ntied)) after a move, `skip` left out (its new load is in the move's
 * score): each holder of expert `lower` serves `by` less per replica it holds, each holder of `raise` `up` more;
 * -1: no such expert. */
static inline double tied_after(const Walk *c, i64 ntied, i64 skip, i64 lower, double by, i64 raise, double up) {
    double top = -INFINITY;
    for (i64 i = 0; i < ntied; i++) {
        i64 u = c->tied[i];
        if (u == skip) continue;
        double v = c->load[u];
        if (lower >= 0) v -= (double)c->holds[u * c->E + lower] * by;
        if (raise >= 0) v += (double)c->holds[u * c->E + raise] * up;
        top = v > top ? v : top;
    }
    return top;
}

/* consider() for the walk's step. With ntied GPUs tied with the busiest one h, the layer's max only drops when every
 * one of them drops too: the move goes into best ranked by the highest new load of its GPUs and the tied ones (`tied`:
 * the tied ones'), on equal value the lower first; and into fallback ranked as without ties, for a step where no move
 * lowers them all (it then lowers h: one tied GPU fewer). Without ties, best as before. */
static inline void consider_step(Move *best, Move *fallback, i64 ntied, double tied, double peak, double score,
                                 double drop, double alpha, i64 cost, double min_gain, i64 budget_left, i64 s0, i64 e0,
                                 i64 s1, i64 e1) {
    if (ntied == 0) {
        consider(best, peak, score, drop, alpha, cost, min_gain, budget_left, 0, s0, e0, s1, e1);
        return;
    }
    consider(fallback, peak, score, drop, alpha, cost, min_gain, budget_left, 0, s0, e0, s1, e1);
    consider(best, peak, score > tied ? score : tied, drop, alpha, cost, min_gain, budget_left, 1, s0, e0, s1, e1);
}

/* 1 when GPU g has more slots than experts it may hold (all E, or those of the groups on its node). */
static int spare_gpu(const Walk *c, i64 g) {
    i64 may = 0;
    for (i64 f = 0; f < c->E && may < c->count[g]; f++) may += allowed(c, f, g);
    return c->count[g] > may;
}

/* One repair of a duplicate: a slot s whose expert e has another replica on its GPU g is overwritten by an expert
 * f that g lacks (and may hold: its group is on g's node), 1 copy. Of all (s, f), the one with the lowest
 * estimated busiest GPU afterwards: g's new load, the busiest other holder of e (its replicas serve more) and the
 * busiest GPU other than g (f's holders only lose load); on ties the f whose holders lose the most. A GPU with
 * more slots than experts it may hold keeps its duplicates: its slots force some, and where it holds fewer experts
 * than it may, on purpose (greedy parks its spare slots on an expert it holds alone: `spare_gpu`). Returns 0 when no
 * duplicate can be repaired. */
static int repair_step(Walk *c, i64 *slot, i64 *expert) {
    const i64 E = c->E, P = c->P, G = c->G;
    i64 first = -1, second = -1; /* the two busiest GPUs */
    for (i64 g = 0; g < G; g++) {
        if (first < 0 || c->load[g] > c->load[first]) {
            second = first;
            first = g;
        } else if (second < 0 || c->load[g] > c->load[second]) {
            second = g;
        }
    }
    holder_tops(c);
    double best_score = INFINITY, best_drop = -INFINITY;
    *slot = -1;
    for (i64 s = P - 1; s >= 0; s--) { /* the last slot of a duplicate: the first keeps its place */
        i64 g = c->gpu_of[s], e = c->ex[s], k = c->holds[g * E + e];
        if (k < 2 || spare_gpu(c, g)) continue;
        int later = 0; /* one slot per (g, e): skip s when a later slot of g holds e too */
        for (i64 t = s + 1; t < c->start[g] + c->count[g]; t++) later |= c->ex[t] == e;
        if (later) continue;
        double base = c->load[g] - c->share[e] + (double)(k - 1) * c->rise[e];
        double ne = holder_max(c, e, g, g) + c->rise[e];
        double rest = g == first ? (second >= 0 ? c->load[second] : -INFINITY) : c->load[first];
        double fixed = ne > rest ? ne : rest;
        for (i64 f = 0; f < E; f++) {
            if (c->holds[g * E + f] || !allowed(c, f, g)) continue;
            double nh = base + c->add[f], score = nh > fixed ? nh : fixed, drop = c->share[f] - c->add[f];
            if (score < best_score || (score == best_score && drop > best_drop)) {
                best_score = score;
                best_drop = drop;
                *slot = s;
                *expert = f;
            }
        }
    }
    return *slot >= 0;
}

/* expert e replaces the expert of slot s (state, replica counts and their shares) */
static void write_slot(Walk *c, const double *w, i64 s, i64 e) {
    i64 g = c->gpu_of[s], old = c->ex[s];
    c->holds[g * c->E + old]--;
    c->cnt[old]--;
    c->holds[g * c->E + e]++;
    c->cnt[e]++;
    c->ex[s] = e;
    expert_terms(c, w, old);
    expert_terms(c, w, e);
}

/* The best move of one step whose replicas leave GPU src (the busiest GPU h, or one tied with it; c->tied then lists
 * the other ntied GPUs at the peak, h among them): spread, replace or swap, ranked by consider_step; none: slot -1. */
static ALWAYS_INLINE Move best_move(Walk *c, i64 src, i64 ntied, double min_gain, i64 left) {
    const i64 E = c->E, P = c->P, G = c->G;
    const double alpha = c->alpha;
    Move best = {-INFINITY, INFINITY, 0, {-1, -1}, {-1, -1}};
    const double top = c->load[src], exc_h = exc(c, top), bar = top - min_gain;
    Move fallback = best;
    /* the lightest GPUs other than src, by selection */
    i64 nl = 0;
    for (i64 g = 0; g < G; g++) {
        if (g == src) continue;
        i64 i;
        if (nl < c->light)
            i = nl++;
        else if (c->load[g] < c->load[c->lights[nl - 1]])
            i = nl - 1;
        else
            continue;
        c->lights[i] = g;
        for (; i > 0 && c->load[c->lights[i]] < c->load[c->lights[i - 1]]; i--) {
            i64 t = c->lights[i];
            c->lights[i] = c->lights[i - 1];
            c->lights[i - 1] = t;
        }
    }
    /* the coldest experts that may land on src: one that costs a copy, one that was on src (free) */
    i64 cold_paid = -1, cold_free = -1;
    double cold_paid_share = INFINITY, cold_free_share = INFINITY;
    for (i64 y = 0; y < E; y++) {
        if (c->holds[src * E + y] || !allowed(c, y, src)) continue;
        double a = c->add[y];
        if (c->orig[src * E + y]) {
            if (a < cold_free_share) { cold_free_share = a; cold_free = y; }
        } else if (a < cold_paid_share) {
            cold_paid_share = a;
            cold_paid = y;
        }
    }
    const uint16_t *hold_h = c->holds + src * E;
    const unsigned char *orig_h = c->orig + src * E;
    /* redundant replicas off src: where a spread may land */
    i64 nred = 0;
    for (i64 t = 0; t < P; t++) {
        i64 g = c->gpu_of[t], x = c->ex[t];
        if (g == src || c->cnt[x] < 2) continue;
        double base = c->load[g] - c->share[x], nx = holder_max(c, x, g, src) + c->rise[x];
        if (base > bar || nx > bar) continue; /* would leave a GPU at the peak whatever lands there */
        c->red_slot[nred] = t;
        c->red_base[nred] = base;
        c->red_nx[nred] = nx;
        nred++;
    }
    for (i64 a = c->start[src]; a < c->start[src] + c->count[src]; a++) {
        i64 e = c->ex[a];
        double add_e = c->add[e], drop_e = c->share[e] - add_e;
        i64 away_e = !orig_h[e];
        /* spread: e gains a replica over a redundant slot t on another GPU */
        for (i64 r = 0; r < nred; r++) {
            i64 t = c->red_slot[r], g = c->gpu_of[t], x = c->ex[t];
            if (c->holds[g * E + e] || !allowed(c, e, g)) continue;
            double nh = top - drop_e + (hold_h[x] ? c->rise[x] : 0.0);
            double nt = c->red_base[r] + add_e;
            double score = nh > nt ? nh : nt;
            score = score > c->red_nx[r] ? score : c->red_nx[r];
            i64 cost = (i64)!c->orig[g * E + e] - (i64)!c->orig[g * E + x];
            double lg = c->load[g];
            double drop = exc_h - exc(c, nh) + exc(c, lg) - exc(c, nt)
                          - (c->gain_more[e] - (exc(c, top - drop_e) - exc_h))
                          - (c->cost_less[x] - (exc(c, lg + c->rise[x]) - exc(c, lg))
                             - (hold_h[x] ? exc(c, top + c->rise[x]) - exc_h : 0.0));
            double tied = ntied ? tied_after(c, ntied, g, e, drop_e, x, c->rise[x]) : -INFINITY;
            consider_step(&best, &fallback, ntied, tied, top, score, drop, alpha, cost, min_gain, left, t, e,
                          -1, -1);
        }
        /* replace: a redundant replica on src gives its slot to a cold expert */
        if (c->cnt[e] >= 2) {
            double nx = holder_max(c, e, src, src) + c->rise[e];
            double others = c->cost_less[e] - (exc(c, top + c->rise[e]) - exc_h);
            /* the coldest expert that costs a copy here, then the coldest that lands free (it served here) */
            const i64 colds[2] = {cold_paid, cold_free};
            const double cold_shares[2] = {cold_paid_share, cold_free_share};
            for (int k = 0; k < 2; k++) {
                i64 y = colds[k];
                if (y < 0) continue;
                double nh = top - c->share[e] + cold_shares[k];
                double drop = exc_h - exc(c, nh) - others - c->gain_more[y];
                double tied = ntied ? tied_after(c, ntied, -1, y, c->share[y] - cold_shares[k], e, c->rise[e])
                                    : -INFINITY;
                consider_step(&best, &fallback, ntied, tied, top, nh > nx ? nh : nx, drop, alpha, (k == 0) - away_e,
                              min_gain, left, a, y, -1, -1);
            }
        }
        /* swap: e trades places with a replica on one of the lightest GPUs */
        for (i64 li = 0; li < nl; li++) {
            i64 b = c->lights[li];
            if (c->holds[b * E + e] || !allowed(c, e, b)) continue;
            for (i64 t = c->start[b]; t < c->start[b] + c->count[b]; t++) {
                i64 x = c->ex[t];
                if (hold_h[x] || !allowed(c, x, src)) continue;
                double nh = top - c->share[e] + c->share[x];
                double nb = c->load[b] - c->share[x] + c->share[e];
                i64 cost = (i64)!c->orig[b * E + e] - (i64)!c->orig[b * E + x] + (i64)!orig_h[x] - away_e;
                double drop = exc_h - exc(c, nh) + exc(c, c->load[b]) - exc(c, nb);
                double tied = ntied ? tied_after(c, ntied, b, -1, 0.0, -1, 0.0) : -INFINITY;
                consider_step(&best, &fallback, ntied, tied, top, nh > nb ? nh : nb, drop, alpha, cost,
                              min_gain, left, t, e, a, x);
            }
        }
    }
    if (best.slot[0] < 0) best = fallback; /* no move lowers every tied GPU: lower src */
    return best;
}

/* best_move with ties, out of line: the walk's loop keeps one copy of the moves, for a step without ties */
static NOINLINE Move best_move_tied(Walk *c, i64 src, i64 ntied, double min_gain, i64 left) {
    return best_move(c, src, ntied, min_gain, left);
}

/* A layer's first moves: up to max_repairs repairs (repair_step), while the copies stay within max_copies (< 0: no
 * bound), written as steps 0, 1, ... of out_*. Returns the repairs made. */
static i64 repair_layer(Walk *c, const double *w, i64 max_repairs, i64 max_copies, double *out_max, i64 *out_copies,
                        i64 *out_slot, i64 *out_expert) {
    i64 step = 0, copies = 0;
    for (i64 s, f; step < c->K && step < max_repairs && (max_copies < 0 || copies < max_copies); step++) {
        if (!repair_step(c, &s, &f)) break;
        copies += !c->orig[c->gpu_of[s] * c->E + f];
        write_slot(c, w, s, f);
        out_slot[2 * step] = s;
        out_expert[2 * step] = f;
        out_max[step + 1] = compute_loads(c);
        out_copies[step + 1] = copies;
    }
    return step;
}

static void walk_layer(Walk *c, const double *w, const i64 *phy, double target, i64 max_copies, double min_gain,
                       i64 max_repairs, double *out_max, i64 *out_copies, i64 *out_steps, i64 *out_slot,
                       i64 *out_expert, i64 *out_repairs) {
    const i64 E = c->E, P = c->P, G = c->G;
    memcpy(c->ex, phy, sizeof(i64) * P);
    memset(c->cnt, 0, sizeof(i64) * E);
    memset(c->holds, 0, sizeof(uint16_t) * (size_t)G * E);
    memset(c->orig, 0, (size_t)G * E);
    i64 dups = 0; /* replicas that share a GPU with an earlier replica of their expert */
    for (i64 s = 0; s < P; s++) {
        i64 i = c->gpu_of[s] * E + c->ex[s];
        c->cnt[c->ex[s]]++;
        dups += c->holds[i]++ > 0;
        c->orig[i] = 1;
    }
    for (i64 e = 0; e < E; e++) expert_terms(c, w, e);
    if (isinf(c->level)) /* no excess anywhere: moves ranked by the busiest GPU's drop alone */
        for (i64 e = 0; e < E; e++) c->gain_more[e] = c->cost_less[e] = 0.0;
    i64 copies = 0, step = 0;
    double peak = compute_loads(c);
    out_max[0] = peak;
    out_copies[0] = 0;
    /* repairs first: each duplicate of the serving placement costs one copy, budget permitting; a layer without
     * any (greedy's, milp's, this walk's own placements) skips them */
    if (dups > 0 && max_repairs > 0) {
        step = repair_layer(c, w, max_repairs, max_copies, out_max, out_copies, out_slot, out_expert);
        peak = out_max[step];
        copies = out_copies[step];
    }
    *out_repairs = step;
    for (; step < c->K && G > 1; step++) {
        if (target >= 0 && peak <= target) break;
        i64 h = 0;
        for (i64 g = 1; g < G; g++)
            if (c->load[g] > c->load[h]) h = g;
        peak = c->load[h];
        holder_tops(c);
        if (!isinf(c->level)) holder_excess(c);
        /* the GPUs tied with h: the layer's max drops only if they drop too */
        i64 ntied = 0;
        for (i64 g = 0; g < G; g++)
            if (g != h && c->load[g] >= peak * (1 - TIE)) c->tied[ntied++] = g;
        i64 left = max_copies >= 0 ? max_copies - copies : -1;
        Move best = {-INFINITY, INFINITY, 0, {-1, -1}, {-1, -1}};
        /* the moves of h's replicas; if none, those of each GPU tied with h in turn (src; h takes its place among
         * the tied): lowering one of them first can leave h a move, or it may lower h too */
        if (ntied == 0) {
            best = best_move(c, h, 0, min_gain, left); /* inlined with ntied 0: the ties' code drops out */
        } else {
            for (i64 si = -1; si < ntied && best.slot[0] < 0; si++) {
                const i64 src = si < 0 ? h : c->tied[si];
                if (si >= 0) c->tied[si] = h;
                best = best_move_tied(c, src, ntied, min_gain, left);
                if (si >= 0) c->tied[si] = src;
            }
        }
        if (best.slot[0] < 0) break;
        /* apply: both writes of a swap use the experts read above */
        for (int i = 0; i < 2; i++) {
            out_slot[2 * step + i] = best.slot[i];
            out_expert[2 * step + i] = best.expert[i];
            if (best.slot[i] >= 0) write_slot(c, w, best.slot[i], best.expert[i]);
        }
        copies += best.cost;
        peak = compute_loads(c);
        out_max[step + 1] = peak;
        out_copies[step + 1] = copies;
    }
    *out_steps = step;
    for (i64 k = step + 1; k <= c->K; k++) {
        out_max[k] = out_max[step];
        out_copies[k] = out_copies[step];
    }
}

static PyObject *py_walk(PyObject *self, PyObject *args) {
    PyObject *o_w, *o_phy, *o_slots, *o_node_ok, *o_target, *o_min_gain, *o_max, *o_copies, *o_steps, *o_slot,
        *o_expert, *o_level, *o_max_repairs, *o_repairs;
    double alpha;
    Py_ssize_t L, E, P, G, K, light, group_size, node_size, num_groups, num_nodes, max_copies;
    if (!PyArg_ParseTuple(args, "OOOnnnnnnOnnnnOnOOOOOOOdOO", &o_w, &o_phy, &o_slots, &L, &E, &P, &G, &K, &light,
                          &o_node_ok, &group_size, &node_size, &num_groups, &num_nodes, &o_target, &max_copies,
                          &o_min_gain, &o_max, &o_copies, &o_steps, &o_slot, &o_expert, &o_level, &alpha,
                          &o_max_repairs, &o_repairs))
        return NULL;
    Py_buffer b[14];
    int has_nodes = o_node_ok != Py_None, held = has_nodes ? 14 : 13;  /* node_ok last, only when given */
    const BufferSpec spec[14] = {
        {o_w, 8, L * E, 0, "loads"},
        {o_phy, 8, L * P, 0, "phy2log"},
        {o_slots, 8, G, 0, "slots_per_gpu"},
        {o_target, 8, L, 0, "target"},
        {o_min_gain, 8, L, 0, "min_gain"},
        {o_max, 8, L * (K + 1), 1, "out_max"},
        {o_copies, 8, L * (K + 1), 1, "out_copies"},
        {o_steps, 8, L, 1, "out_steps"},
        {o_slot, 8, L * K * 2, 1, "out_slot"},
        {o_expert, 8, L * K * 2, 1, "out_expert"},
        {o_level, 8, L, 0, "level"},
        {o_max_repairs, 8, L, 0, "max_repairs"},
        {o_repairs, 8, L, 1, "out_repairs"},
        {o_node_ok, 8, L * num_nodes * num_groups, 0, "node_ok"},
    };
    if (buffers(spec, held, b) < 0) return NULL;
    const double *w = b[0].buf, *target = b[3].buf, *min_gain = b[4].buf;
    const i64 *phy = b[1].buf, *slots = b[2].buf, *node_ok = has_nodes ? b[13].buf : NULL;
    const double *level = b[10].buf;
    const i64 *max_repairs = b[11].buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t g = 0; g < G; g++) total += slots[g] > 0 ? slots[g] : 0;
    if (total != P) { /* gpu_of below has P entries, one per slot */
        release_buffers(b, held);
        PyErr_Format(PyExc_ValueError, "slots_per_gpu sums to %zd slots, phy2log has %zd per layer", total, P);
        return NULL;
    }
    Walk c = {E, P, G, K, light > 0 ? light : 1, group_size, node_size, num_groups};
    i64 *gpu_of = malloc(sizeof(i64) * P), *start = malloc(sizeof(i64) * G);
    for (i64 g = 0, s = 0; g < G; g++) {
        start[g] = s;
        for (i64 j = 0; j < slots[g]; j++) gpu_of[s++] = g;
    }
    c.gpu_of = gpu_of;
    c.start = start;
    c.count = slots;
    c.ex = malloc(sizeof(i64) * P);
    c.cnt = malloc(sizeof(i64) * E);
    c.top_gpu = malloc(sizeof(i64) * 3 * E);
    c.lights = malloc(sizeof(i64) * c.light);
    c.tied = malloc(sizeof(i64) * G);
    c.load = malloc(sizeof(double) * G);
    c.share = malloc(sizeof(double) * E);
    c.top_load = malloc(sizeof(double) * 3 * E);
    c.red_slot = malloc(sizeof(i64) * P);
    c.add = malloc(sizeof(double) * E);
    c.rise = malloc(sizeof(double) * E);
    c.red_base = malloc(sizeof(double) * P);
    c.red_nx = malloc(sizeof(double) * P);
    c.holds = malloc(sizeof(uint16_t) * (size_t)G * E);
    c.gain_more = malloc(sizeof(double) * E);
    c.cost_less = malloc(sizeof(double) * E);
    c.alpha = alpha;
    c.orig = malloc((size_t)G * E);
    Py_BEGIN_ALLOW_THREADS
    for (i64 l = 0; l < L; l++) {
        c.node_ok = node_ok ? node_ok + l * num_nodes * num_groups : NULL;
        c.level = level[l];
        walk_layer(&c, w + l * E, phy + l * P, target[l], max_copies, min_gain[l], max_repairs[l],
                   (double *)b[5].buf + l * (K + 1), (i64 *)b[6].buf + l * (K + 1), (i64 *)b[7].buf + l,
                   (i64 *)b[8].buf + l * K * 2, (i64 *)b[9].buf + l * K * 2, (i64 *)b[12].buf + l);
    }
    Py_END_ALLOW_THREADS
    free(gpu_of); free(start); free(c.ex); free(c.cnt); free(c.top_gpu); free(c.lights); free(c.tied);
    free(c.load); free(c.share); free(c.top_load); free(c.holds); free(c.orig);
    free(c.red_slot); free(c.add); free(c.rise); free(c.red_base); free(c.red_nx); free(c.gain_more); free(c.cost_less);
    release_buffers(b, held);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"walk", py_walk, METH_VARARGS,
     "walk(loads, phy2log, slots, L, E, P, G, K, light, node_ok, group_size, node_size, num_groups, num_nodes, "
     "target, max_copies, min_gain, out_max, out_copies, out_steps, out_slot, out_expert, level, alpha, "
     "max_repairs, out_repairs)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_incremental", "Compiled move loop of solvers.incremental.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__incremental(void) { return PyModule_Create(&module); }
