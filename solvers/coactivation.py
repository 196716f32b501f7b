"""Co-activation-aware refinement: swap replicas between GPUs so experts chosen together share a GPU.

A token is sent once to each GPU that serves one of its k experts, so the all-to-all copies per token
fall when co-activated experts sit together. `refine_coactivation` starts from any placement (greedy's,
in the registered "greedy-coact") and repeatedly makes the slot swap that co-locates the most pair
weight, as long as no GPU's load rises above the start's busiest GPU x (1 + max_lb_slack), on the window
and on every recent sub-window given (so the placement keeps its balance on steps it has not seen). The
swaps stop at a local optimum; then `ROUNDS` rounds of iterated local search each start from the best
placement so far, make `KICK` random swaps within the caps and descend again, keeping the result only if it
co-locates more pair weight (single swaps alone stop early in local optima; measured: docs/solvers.md).

Pair weight of two slots holding experts i != j with r_i, r_j replicas: c_ij / (r_i r_j), c_ij the tokens
that chose both (`pairs [L, E, E]`); replicas of one expert have none. Maximising the co-located pair
weight is the second-order form of minimising distinct GPUs per token (exact while no token puts more than
two of its experts on one GPU); docs/solvers.md ("Co-activation-aware greedy") reports the measured copies.

The search runs in C (solvers/_coact.c: gains kept per pair of GPUs, only the blocks a swap touches are
re-bounded, exact upper bounds decide which to re-evaluate), with the numpy loop's floating-point
operations in the same order and the same xorshift64 draws for the kicks, so it makes the same swaps;
`_swaps_numpy` is that numpy loop, kept as the reference (tests compare the two) and for non-finite inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import ThreadpoolController

from solvers import _coact
from solvers.greedy import solve_greedy, spread_duplicates
from solvers.registry import Capabilities, Options, Problem, Solution, Solver, SolverError

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass
class _State:
    """One layer's search state, as the numpy loop and the compiled one (solvers/_coact.c) share it."""

    row: IntArray  # [P] expert of each slot (fixed: swaps move slots between GPUs)
    gpu: IntArray  # [P] GPU of each slot
    w: FloatArray  # [S + 1, P] load of each slot, on the window then the sub-windows
    gpu_load: FloatArray  # [S + 1, G]
    cap: FloatArray  # [S + 1] no GPU above this
    weight: FloatArray  # [P, P] pair weight of two slots
    affinity: FloatArray  # [P, G] pair weight of slot s with GPU g's slots
    num_experts: int


def _setup(
    row: IntArray, loads: FloatArray, pairs: FloatArray, slots: IntArray, slack: float, compiled: bool = False
) -> _State:
    """row: [P] experts by slot; loads: [S + 1, E] the window then sub-windows; pairs: [E, E]. compiled:
    the pair weights from solvers/_coact.c (the same values, faster)."""
    num_gpus, num_slots, num_experts = slots.size, row.size, loads.shape[1]
    gpu = np.repeat(np.arange(num_gpus, dtype=np.int64), slots)
    cnt = np.bincount(row, minlength=num_experts).astype(np.float64)
    rep = cnt[row]
    w = loads[:, row] / rep  # [S + 1, P] load of each slot
    gpu_load: FloatArray = np.stack([np.bincount(gpu, weights=x, minlength=num_gpus) for x in w])  # [S + 1, G]
    cap = gpu_load.max(axis=1) * (1.0 + slack) + 1e-9
    if compiled:
        weight = np.empty((num_slots, num_slots))
        pc = np.ascontiguousarray(pairs, dtype=np.float64)
        _coact.weights(pc, np.ascontiguousarray(row), rep, weight, pc.shape[0], pc.shape[1], num_slots)
    else:
        weight = pairs[row][:, row] / (rep[:, None] * rep[None, :])
        weight[row[:, None] == row[None, :]] = 0.0
    onehot = np.zeros((num_slots, num_gpus))
    onehot[np.arange(num_slots), gpu] = 1.0
    affinity: FloatArray = weight @ onehot
    return _State(row, gpu, w, gpu_load, cap, weight, affinity, num_experts)


def _descend_numpy(st: _State, budget: int, val: float) -> tuple[int, float]:
    """The reference descent: each step rebuilds the P x P gains and makes the best admissible swap (the
    first in row-major (s, t) order among equal gains), at most `budget` swaps. Updates st.gpu, st.affinity,
    st.gpu_load; returns (swaps, val plus each swap's gain)."""
    row, gpu, weight, affinity, gpu_load = st.row, st.gpu, st.weight, st.affinity, st.gpu_load
    num_gpus = gpu_load.shape[1]
    idx = np.arange(row.size)
    swaps = 0
    for _ in range(budget):
        b = affinity[:, gpu]  # b[s, t] = affinity of s with t's GPU
        own = affinity[idx, gpu]
        gain = b - own[:, None] + b.T - own[None, :] - 2.0 * weight
        ok = gpu[:, None] != gpu[None, :]
        for x, gl, c in zip(st.w, gpu_load, st.cap, strict=True):
            new_s = gl[gpu][:, None] - x[:, None] + x[None, :]  # load of s's GPU after the swap
            ok &= (new_s <= c) & (new_s.T <= c)  # noqa: SIM300
        holds = np.zeros((num_gpus, st.num_experts), dtype=bool)
        holds[gpu, row] = True
        ok &= ~holds[gpu[None, :], row[:, None]] & ~holds[gpu[:, None], row[None, :]]
        gain = np.where(ok, gain, -np.inf)
        s, t = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[s, t] > 1e-9:
            break
        val += float(gain[s, t])
        _apply_swap(st, int(s), int(t))
        swaps += 1
    return swaps, val


def _apply_swap(st: _State, s: int, t: int) -> None:
    g, h = st.gpu[s], st.gpu[t]
    st.affinity[:, g] += st.weight[:, t] - st.weight[:, s]
    st.affinity[:, h] += st.weight[:, s] - st.weight[:, t]
    st.gpu_load[:, g] += st.w[:, t] - st.w[:, s]
    st.gpu_load[:, h] += st.w[:, s] - st.w[:, t]
    st.gpu[s], st.gpu[t] = h, g


_MASK = (1 << 64) - 1
_SEED = 0x9E3779B97F4A7C15
_KICK_TRIES = 50


def _xorshift(x: int) -> int:
    """Marsaglia's xorshift64, as solvers/_coact.c's (the kicks' random numbers)."""
    x ^= (x << 13) & _MASK
    x ^= x >> 7
    return x ^ ((x << 17) & _MASK)


def _kick_numpy(st: _State, kick: int, rng: int, val: float) -> tuple[int, float]:
    """`kick` random admissible swaps, each from up to _KICK_TRIES random slot pairs (the C loop's draws).
    Returns (the generator's state, val plus each swap's gain)."""
    row, gpu, a_ = st.row, st.gpu, st.affinity
    num_slots = row.size
    for _ in range(kick):
        for _try in range(_KICK_TRIES):
            rng = _xorshift(rng)
            s = rng % num_slots
            rng = _xorshift(rng)
            t = rng % num_slots
            a, b = int(gpu[s]), int(gpu[t])
            if a == b or ((gpu == b) & (row == row[s])).any() or ((gpu == a) & (row == row[t])).any():
                continue
            la = st.gpu_load[:, a] - st.w[:, s] + st.w[:, t]
            lb = st.gpu_load[:, b] - st.w[:, t] + st.w[:, s]
            if not ((la <= st.cap).all() and (lb <= st.cap).all()):
                continue
            val += float(((a_[s, b] - a_[s, a]) + a_[t, a]) - a_[t, b] - 2.0 * st.weight[s, t])
            _apply_swap(st, s, t)
            break
    return rng, val


def _swaps_numpy(st: _State, max_swaps: int, rounds: int = 0, kick: int = 0) -> int:
    """The reference loop: the descent, then `rounds` of iterated local search (from the best state so far,
    `kick` random admissible swaps and a descent, kept if it co-locates more than 1e-9 more pair weight
    than the best, else undone); max_swaps bounds the descents' swaps over all rounds. Updates st.gpu,
    st.affinity, st.gpu_load; returns the descents' swaps."""
    swaps, val = _descend_numpy(st, max_swaps, 0.0)
    if rounds <= 0 or kick <= 0 or st.row.size < 2 or st.gpu_load.shape[1] < 2:
        return swaps
    rng, best_val = _SEED, val
    best = (st.gpu.copy(), st.affinity.copy(), st.gpu_load.copy())
    for _ in range(rounds):
        if swaps >= max_swaps:
            break
        rng, val = _kick_numpy(st, kick, rng, val)
        n, val = _descend_numpy(st, max_swaps - swaps, val)
        swaps += n
        if val > best_val + 1e-9:
            best_val = val
            best = (st.gpu.copy(), st.affinity.copy(), st.gpu_load.copy())
        else:
            st.gpu[...], st.affinity[...], st.gpu_load[...] = best
            val = best_val
    return swaps


def _swaps_compiled(st: _State, max_swaps: int, rounds: int = 0, kick: int = 0) -> int | None:
    """The same swaps as `_swaps_numpy` (solvers/_coact.c). Updates st.gpu and st.affinity (not
    st.gpu_load); returns swaps, or None (nothing done) when an input is not finite."""
    (num_rows, num_gpus), num_slots = st.gpu_load.shape, st.row.size
    c = np.ascontiguousarray
    affinity, gpu = c(st.affinity), c(st.gpu)  # C-ordered already (matmul, repeat): no copies
    swaps = _coact.refine(
        c(st.weight), affinity, c(st.w), c(st.gpu_load), c(st.cap), c(st.row), gpu,
        num_slots, num_gpus, st.num_experts, num_rows, max_swaps, rounds, kick,
    )  # fmt: skip
    if affinity is not st.affinity:
        st.affinity[...] = affinity
    if gpu is not st.gpu:
        st.gpu[...] = gpu
    return swaps


ROUNDS = 50
"""Iterated local search rounds per layer after the first descent (`refine_coactivation`'s default)."""
KICK = 16
"""Random admissible swaps that start each round (4 before: with 16, at the same 50 rounds, the held-out
copies fell on every real and synthetic case of benchmarks/coactivation.py; docs/solvers.md)."""
CHAIN_WORK = 3600
"""Rounds x slots of each later search of `refine_coactivation_chain` (twice that for the first): a round's
work (its kick, its descent's swaps, each re-bounding every slot's block) grows with the slots, so large
layers get fewer rounds (DeepSeek-V3's 288 slots: 25 and 12; 64-72 slots: `ROUNDS`)."""
CHAIN_KICK = 24
"""Random swaps that start each round of a later search of a chain (small kicks, such as 4, seldom leave the tighter
cap's optimum it starts from: at DeepSeek-V3 size those searches co-locate less than from scratch)."""


_THREADED_SLOTS = 128
"""Layers of at least this many slots are refined on several threads (smaller ones: too short to gain)."""


def _workers() -> int:
    """Threads for the layers: the CPUs this process may run on, at most 8."""
    return min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def chain_rounds(num_slots: int, searches: int) -> list[int]:
    """Rounds of each search of a chain of `searches` on layers of `num_slots` slots (`CHAIN_WORK`)."""
    first, later = (min(ROUNDS, work // max(num_slots, 1)) for work in (2 * CHAIN_WORK, CHAIN_WORK))
    return [first] + [later] * (searches - 1) if searches else []


_BLAS_THREADED = 4 * 65536  # OpenBLAS multiplies on one thread up to this many m x n x k
_blas: list[ThreadpoolController] = []  # made on first use (it inspects the loaded libraries)
_blas_lock = threading.Lock()


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """BLAS on one thread for the setup's small matmul (288 x 288 x 32 at DeepSeek-V3 size). OpenBLAS
    splits a product by rows and columns, never along the summed axis, so its result does not depend on
    the thread count; but waking its threads for a product that small cost more than the whole search on
    a busy 2-core machine (1.2-1.7 s against 0.35-0.45 s for a 58-layer model). The limit is global, so
    it is held briefly and under a lock (concurrent calls cannot restore each other's limits)."""
    with _blas_lock:
        if not _blas:
            _blas.append(ThreadpoolController())
        with _blas[0].limit(limits=1, user_api="blas"):
            yield


def _layer(
    row: IntArray,
    loads: FloatArray,
    pairs: FloatArray,
    slots: IntArray,
    slack: float,
    max_swaps: int,
    compiled: bool = True,
    rounds: int = 0,
    kick: int = KICK,
) -> tuple[IntArray, float, float, int]:
    """Refine one layer. row: [P] experts by slot; loads: [S + 1, E] the window then sub-windows;
    pairs: [E, E]. Returns (new row [P], co-located pair weight before, after, swaps made). compiled:
    the C loop where the inputs are finite (the numpy loop otherwise, or when False: the reference);
    rounds, kick: iterated local search after the descent (`_swaps_numpy`; 0 rounds: the descent alone)."""
    return _layer_chain(row, loads, pairs, slots, (slack,), max_swaps, compiled, rounds, kick)[0]


def _layer_chain(
    row: IntArray,
    loads: FloatArray,
    pairs: FloatArray,
    slots: IntArray,
    slacks: Sequence[float],
    max_swaps: int,
    compiled: bool = True,
    rounds: int | Sequence[int] = 0,
    kick: int | Sequence[int] = KICK,
) -> list[tuple[IntArray, float, float, int]]:
    """`_layer` at each of `slacks` in turn (ascending), one setup: the first search starts from `row`,
    each later one from the previous one's result, its caps still relative to the busiest GPU of `row`
    (a result within a tighter cap is admissible under a looser one, so the later searches start near
    their optimum). The GPU loads are recomputed from the placement between searches, in both loops.
    rounds, kick: for every search, or one per slack. Returns one (new row [P], pair weight before,
    after, swaps) per slack, before: of `row`."""
    per_search = [rounds] * len(slacks) if isinstance(rounds, int) else list(rounds)
    kicks = [kick] * len(slacks) if isinstance(kick, int) else list(kick)
    if not len(per_search) == len(kicks) == len(slacks):
        raise ValueError(f"{len(per_search)} rounds and {len(kicks)} kicks for {len(slacks)} slacks")
    threaded = row.size * row.size * slots.size > _BLAS_THREADED  # else BLAS keeps it on one thread itself
    with _one_blas_thread() if compiled and threaded else contextlib.nullcontext():
        st = _setup(row, loads, pairs, slots, slacks[0] if slacks else 0.0, compiled)
    ref = st.gpu_load.max(axis=1)
    idx = np.arange(row.size)
    before = float((st.affinity[idx, st.gpu]).sum() / 2)
    out = []
    for i, (slack, num_rounds, num_kick) in enumerate(zip(slacks, per_search, kicks, strict=True)):
        if i:
            st.cap = ref * (1.0 + slack) + 1e-9
            st.gpu_load = np.stack([np.bincount(st.gpu, weights=x, minlength=slots.size) for x in st.w])
        swaps = _swaps_compiled(st, max(max_swaps, 0), num_rounds, num_kick) if compiled else None
        if swaps is None:
            swaps = _swaps_numpy(st, max_swaps, num_rounds, num_kick)
        after = float((st.affinity[idx, st.gpu]).sum() / 2)
        order = np.argsort(st.gpu, kind="stable")
        out.append((row[order], before, after, swaps))
    return out


def refine_coactivation(
    loads: FloatArray,
    phy2log: IntArray,
    slots_per_gpu: IntArray,
    pairs: FloatArray,
    *,
    scenarios: FloatArray | None = None,
    max_lb_slack: float = 0.01,
    max_swaps: int = 1000,
    rounds: int | None = None,
) -> tuple[IntArray, dict[str, Any]]:
    """Swap slots between GPUs to co-locate co-activated experts, keeping every GPU's load within
    (1 + max_lb_slack) x the start's busiest GPU on the window and on each sub-window.

    loads: [L, E] tokens; phy2log: [L, P] start (replica counts are kept); slots_per_gpu: [G];
    pairs: [L, E, E] co-activation counts (diagonal ignored); scenarios: [S, L, E] recent sub-windows or
    None; max_swaps: per layer, over the descents of all rounds; rounds: of iterated local search after the
    first descent (None: `ROUNDS`; 0: the descent alone). Returns (phy2log [L, P], info: co-located pair
    weight before and after and swaps per layer)."""
    return refine_coactivation_chain(loads, phy2log, slots_per_gpu, pairs, (max_lb_slack,), scenarios=scenarios,
                                     max_swaps=max_swaps, rounds=ROUNDS if rounds is None else rounds, kick=KICK)[0]


def refine_coactivation_chain(
    loads: FloatArray,
    phy2log: IntArray,
    slots_per_gpu: IntArray,
    pairs: FloatArray,
    slacks: Sequence[float],
    *,
    scenarios: FloatArray | None = None,
    max_swaps: int = 1000,
    rounds: int | Sequence[int] | None = None,
    kick: int | Sequence[int] | None = None,
) -> list[tuple[IntArray, dict[str, Any]]]:
    """`refine_coactivation` at several lb caps at once, chained: per layer, the search at the tightest
    slack starts from `phy2log`, each looser one from the previous result (caps always relative to the
    busiest GPU of `phy2log`), on one setup of the pair weights. slacks: ascending; max_swaps: per
    search; rounds, kick: for every search, or one per slack (None: `chain_rounds`, `KICK` for the first
    search and `CHAIN_KICK` for each later one). Returns one (phy2log [L, P], info) per slack, as
    `refine_coactivation`'s."""
    if any(b < a for a, b in itertools.pairwise(slacks)):
        raise ValueError("refine_coactivation_chain: slacks must be ascending")
    p2l = np.asarray(phy2log, dtype=np.int64)
    per_search = chain_rounds(p2l.shape[1], len(slacks)) if rounds is None else rounds
    kicks = [KICK] + [CHAIN_KICK] * (len(slacks) - 1) if kick is None else kick
    loads = np.asarray(loads, dtype=np.float64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    outs = [p2l.copy() for _ in slacks]
    infos: list[dict[str, list[Any]]] = [
        {"colocated_pairs_before": [], "colocated_pairs_after": [], "swaps": []} for _ in slacks
    ]
    scen = None if scenarios is None else np.asarray(scenarios, dtype=np.float64)

    def one(layer: int) -> list[tuple[IntArray, float, float, int]]:
        rows = loads[layer][None, :] if scen is None else np.concatenate([loads[layer][None, :], scen[:, layer, :]])
        pair = np.asarray(pairs[layer], dtype=np.float64)
        return _layer_chain(p2l[layer], rows, pair, slots, slacks, max_swaps, rounds=per_search, kick=kicks)

    num_layers = loads.shape[0]
    workers = min(_workers(), num_layers)
    if workers > 1 and p2l.shape[1] >= _THREADED_SLOTS:  # the compiled search runs without the GIL
        with ThreadPoolExecutor(workers) as pool:
            by_layer = list(pool.map(one, range(num_layers)))
    else:
        by_layer = [one(layer) for layer in range(num_layers)]
    for layer, results in enumerate(by_layer):
        for out, info, (new_row, b, a, n) in zip(outs, infos, results, strict=True):
            out[layer] = new_row
            info["colocated_pairs_before"].append(b)
            info["colocated_pairs_after"].append(a)
            info["swaps"].append(n)
    return [(out, dict(info)) for out, info in zip(outs, infos, strict=True)]


def pack_within_nodes(
    phy2log: IntArray, loads: FloatArray, slots_per_gpu: IntArray, gpus_per_node: int
) -> IntArray:
    """Each node's slots (the experts it holds, per layer) packed onto its own GPUs heaviest first, each to the
    least loaded GPU with a free slot that does not hold the expert yet; where that leaves an expert twice on
    a GPU, greedy's repair within the node (`solvers.greedy.spread_duplicates`: swaps, then chains of moves), so
    no GPU holds an expert twice when the node's replicas allow it. Which node holds what is kept, the GPUs of a
    node are balanced. phy2log: [L, P]; loads: [L, E]; slots_per_gpu: [G], G a multiple of gpus_per_node.
    Returns phy2log [L, P]. All layers and nodes are packed at once, one item rank at a time."""
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    layers, num_slots = phy2log.shape
    experts, n = loads.shape[1], gpus_per_node
    nodes = slots.size // n
    gpu = np.repeat(np.arange(slots.size), slots)
    slot_node = gpu // n
    reps = np.stack([np.bincount(row, minlength=experts) for row in phy2log])
    weight = np.take_along_axis(loads, phy2log, axis=1) / np.take_along_axis(reps, phy2log, axis=1)  # [L, P]
    node_slots = slots.reshape(nodes, n).sum(axis=1)
    node_start = np.r_[0, np.cumsum(node_slots)]
    width = int(node_slots.max())
    order = np.lexsort((-weight, np.broadcast_to(slot_node, phy2log.shape)))  # [L, P] node by node, heaviest first
    rank = np.arange(num_slots) - node_start[slot_node]  # each sorted position's rank within its node
    item = np.full((layers, nodes, width), -1, dtype=np.int64)  # slot of each (layer, node, rank); -1: none
    item[:, slot_node, rank] = order
    valid = item >= 0
    expert = np.where(valid, np.take_along_axis(phy2log, np.maximum(item, 0).reshape(layers, -1), axis=1).reshape(
        item.shape), 0)  # fmt: skip
    w = np.where(valid, np.take_along_axis(weight, np.maximum(item, 0).reshape(layers, -1), axis=1).reshape(
        item.shape), 0.0)  # fmt: skip
    load = np.zeros((layers, nodes, n))
    free = np.broadcast_to(slots.reshape(nodes, n), (layers, nodes, n)).copy()
    count = np.zeros((layers, nodes, n, experts), dtype=np.int32)
    placed = np.zeros((layers, nodes, width), dtype=np.int64)  # GPU (within its node) of each item
    li, vi = np.arange(layers)[:, None], np.arange(nodes)[None, :]
    for r in range(width):
        e, ok = expert[:, :, r], valid[:, :, r]
        room = free > 0
        fits = room & (count[li, vi, :, e] == 0)
        mask = np.where(fits.any(axis=2, keepdims=True), fits, room)
        g = np.argmin(np.where(mask, load, np.inf), axis=2)
        placed[:, :, r] = g
        hit = np.broadcast_to(ok, g.shape)
        l_hit, v_hit, g_hit = np.broadcast_to(li, g.shape)[hit], np.broadcast_to(vi, g.shape)[hit], g[hit]
        load[l_hit, v_hit, g_hit] += w[:, :, r][hit]
        free[l_hit, v_hit, g_hit] -= 1
        count[l_hit, v_hit, g_hit, e[hit]] += 1
    out = phy2log.copy()
    gpu_start = np.r_[0, np.cumsum(slots)]
    for layer, v in zip(*np.nonzero(valid.any(axis=2)), strict=True):
        lists: list[list[int]] = [[] for _ in range(n)]
        for k in np.flatnonzero(valid[layer, v]):
            lists[int(placed[layer, v, k])].append(int(expert[layer, v, k]))
        a, b = gpu_start[v * n], gpu_start[(v + 1) * n]
        out[layer, a:b] = np.asarray([e for h in lists for e in h], dtype=np.int64)
    per_replica = loads / np.maximum(reps, 1)  # [L, E] tokens each replica serves (replicas on every node)
    for v in range(nodes):  # where the packing left an expert twice on a GPU, node by node
        rows = np.flatnonzero((count[:, v] > 1).any(axis=(1, 2)))
        if rows.size:
            a, b, node_slots = gpu_start[v * n], gpu_start[(v + 1) * n], slots[v * n : (v + 1) * n]
            local = out[rows, a:b]
            held = np.stack([np.bincount(row, minlength=experts) for row in local])  # replicas on this node
            out[rows, a:b] = spread_duplicates(per_replica[rows] * held, local, node_slots)
    return out


def refine_on_nodes(
    loads: FloatArray,
    phy2log: IntArray,
    slots_per_gpu: IntArray,
    gpus_per_node: int,
    pairs: FloatArray,
    slacks: Sequence[float],
    *,
    scenarios: FloatArray | None = None,
) -> list[IntArray]:
    """Co-location on nodes: the swap descent of `refine_coactivation_chain` with whole nodes as the bins (a
    token crosses the NIC once per other node it reaches, so experts chosen together should share a node), node
    loads within each of `slacks` above the busiest node's, then `pack_within_nodes`. One phy2log [L, P] per
    slack. The descent alone (no rounds): measured on the synthetic DeepSeek-V3-like log it finds what 20 rounds
    find (docs/solvers.md)."""
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    node_slots = slots.reshape(-1, gpus_per_node).sum(axis=1)
    chain = refine_coactivation_chain(loads, phy2log, node_slots, pairs, slacks, scenarios=scenarios, rounds=0)
    return [pack_within_nodes(p2l, loads, slots, gpus_per_node) for p2l, _ in chain]


class CoactGreedySolver(Solver):
    """Registered as "greedy-coact": greedy, then `refine_coactivation` within max_lb_slack of its lb."""

    name = "greedy-coact"
    summary = "greedy, then swaps that co-locate experts chosen together (fewer dispatch copies) within an lb cap"
    capabilities = Capabilities(coactivation=True)
    options = frozenset({"max_lb_slack"})

    def solve(self, problem: Problem, options: Options) -> Solution:
        if problem.coactivation is None:  # check() refuses this first; kept for direct callers
            raise SolverError("greedy-coact needs co-activation pair counts [layers, E, E]")
        start = solve_greedy(problem.loads, problem.slots_per_gpu)
        phy2log, info = refine_coactivation(
            problem.loads,
            start,
            problem.slots_per_gpu,
            problem.coactivation,
            scenarios=problem.scenarios,
            max_lb_slack=options.max_lb_slack,
        )
        return Solution(phy2log, status="heuristic", info=info)
