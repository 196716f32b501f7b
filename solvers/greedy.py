"""Greedy expert placement: give extra slots to the hottest experts, then pack heaviest-first.

Every function works on all layers at once (rows of a 2-D array); the only Python loops run over
slots, never over layers.

Two entry points:
- `solve_greedy(loads, slots_per_gpu, ...)`: ours. GPUs may have different slot counts, no two replicas
  of one expert share a GPU when another placement exists, optional hierarchical (node-aware) policy.
- `rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`: a drop-in for DeepSeek
  EPLB's function of the same name, same signature, semantics and results (int64 CPU tensors for a torch
  tensor weight, as DeepSeek's; numpy arrays otherwise).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import numpy as np
from numpy.typing import NDArray

from solvers import _kernels
from solvers.bounds import lower_bound
from solvers.registry import Capabilities, Options, Problem, Solution, Solver
from solvers.torch_order import argsort_desc_like_torch, sum_last_like_torch
from solvers.validation import refuse_loads, slot_gpu, validate_placement, whole_number

FloatArray = NDArray[np.floating[Any]]
IntArray = NDArray[np.int64]


def replicate(
    weight: FloatArray, num_physical: IntArray, max_replicas: int | None = None
) -> tuple[IntArray, IntArray, IntArray]:
    """Give each extra slot to the expert with the largest load per replica (lowest index on ties).

    weight: [rows, E] load per expert; num_physical: [rows] slots to fill per row (>= E);
    max_replicas: cap on replicas of one expert (e.g. the GPU count), None for no cap.
    Returns phy2log [rows, max(num_physical)] (experts 0..E-1 first, then the extra replicas in the
    order they were given; -1 pads rows with fewer slots), rank [rows, P] (replica index of each slot)
    and logcnt [rows, E] (replicas per expert). Arithmetic stays in weight's dtype (float32 or float64).
    """
    rows, num_log = weight.shape
    num_physical = np.ascontiguousarray(num_physical, dtype=np.int64)
    width = int(num_physical.max())
    phy2log = np.empty((rows, width), dtype=np.int64)
    rank = np.empty((rows, width), dtype=np.int64)
    logcnt = np.empty((rows, num_log), dtype=np.int64)
    _kernels.replicate(
        _f64(weight), rows, num_log, num_physical, width, max_replicas or 0, _is_f32(weight), phy2log, rank, logcnt
    )
    return phy2log, rank, logcnt


def pack(
    weight: FloatArray,
    capacity: IntArray,
    experts: IntArray | None = None,
    num_experts: int = 0,
    order: IntArray | None = None,
) -> tuple[IntArray, IntArray]:
    """Heaviest item first, into the least-loaded bin that still has room (first such bin on ties).

    weight: [rows, n] item weights, -inf marks padding items that are not packed;
    capacity: [rows, bins] items each bin takes, summing per row to the number of real items;
    experts: [rows, n] logical expert of each item: when given, an item avoids bins that already hold
    its expert unless every bin with room does; order: [rows, n] the item order to pack in
    (default: heaviest first, ties in index order). Bin loads add up in weight's dtype.
    Returns bin_of_item [rows, n] and rank_in_bin [rows, n] (-1 for padding).
    """
    rows, n = weight.shape
    capacity = np.ascontiguousarray(capacity, dtype=np.int64)
    values = _f64(weight)
    if order is None:
        order = np.empty((rows, n), dtype=np.int64)
        _kernels.argsort_desc(values, rows, n, False, order)
    bin_of = np.empty((rows, n), dtype=np.int64)
    rank = np.empty((rows, n), dtype=np.int64)
    _kernels.pack(
        values,
        rows,
        n,
        np.ascontiguousarray(order, dtype=np.int64),
        capacity,
        capacity.shape[1],
        None if experts is None else np.ascontiguousarray(experts, dtype=np.int64),
        num_experts,
        _is_f32(weight),
        bin_of,
        rank,
    )
    return bin_of, rank


def _f64(a: FloatArray) -> NDArray[np.float64]:
    """a as a C-contiguous float64 array (float32 values convert exactly)."""
    return np.ascontiguousarray(a, dtype=np.float64)


def _is_f32(a: FloatArray) -> bool:
    return bool(a.dtype == np.float32)


def _place(
    loads: FloatArray, capacity: IntArray, max_replicas: int | None
) -> tuple[IntArray, NDArray[np.bool_]]:
    """Replicate then pack rows of experts onto rows of bins (`replicate` and `pack` in one compiled pass,
    an expert's replicas packed one after another; counts that force a duplicate the slots do not are replicated
    again under the Gale-Ryser condition, see `solve_greedy`). loads: [rows, E]; capacity: [rows, bins].
    Returns [rows, max slots] expert ids in slot order (bin by bin, -1 padding where a row has fewer
    slots) and stuck [rows]: True where a bin had to take a second replica of one expert."""
    rows, num_experts = loads.shape
    capacity = np.ascontiguousarray(capacity, dtype=np.int64)
    width = int(capacity.sum(axis=1).max())
    out = np.empty((rows, width), dtype=np.int64)
    stuck = np.zeros(rows, dtype=np.bool_)
    _kernels.place(_f64(loads), rows, num_experts, capacity, capacity.shape[1], width, max_replicas or 0, out, stuck)
    return out, stuck


def spread_duplicates(
    loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray
) -> IntArray:
    """Move replicas between GPUs so no GPU holds two replicas of one expert whenever the replica counts allow
    it (`solvers.validation.duplicate_free_possible`), and as few as they allow otherwise; replica and slot
    counts are kept.

    First single swaps, each chosen to keep the two GPUs' loads as low as possible; a duplicate that no swap
    removes is then rerouted by a chain of moves (`_reroute_duplicates`, augmenting paths of a max flow).
    The caller refines the loads afterwards. loads: [layers, E]; phy2log: [layers, P]. Only layers with
    duplicates are visited (rare).
    """
    phy2log = phy2log.copy()
    gpu = slot_gpu(slots_per_gpu)
    num_experts = loads.shape[1]
    for layer in np.flatnonzero(_duplicates_per_layer(phy2log, gpu)):
        row = phy2log[layer]
        for _ in range(row.size):
            dup_slot = _first_duplicate(row, gpu)
            if dup_slot < 0:
                break
            cnt = np.bincount(row, minlength=num_experts)
            share = loads[layer] / np.maximum(cnt, 1)
            gpu_load = np.bincount(gpu, weights=share[row], minlength=slots_per_gpu.size)
            holds = np.zeros((slots_per_gpu.size, num_experts), dtype=bool)
            holds[gpu, row] = True
            g, e = gpu[dup_slot], row[dup_slot]
            other = row  # expert in each candidate slot
            ok = (gpu != g) & ~holds[g, other] & ~holds[gpu, e]
            if not ok.any():
                break
            new_g = gpu_load[g] - share[e] + share[other]
            new_h = gpu_load[gpu] - share[other] + share[e]
            cost = np.where(ok, np.maximum(new_g, new_h), np.inf)
            s = int(np.argmin(cost))
            row[dup_slot], row[s] = row[s], row[dup_slot]
        if _first_duplicate(row, gpu) >= 0:
            _reroute_duplicates(row, gpu, int(slots_per_gpu.size), num_experts)
    return phy2log


def _reroute_duplicates(row: IntArray, gpu: IntArray, num_gpus: int, num_experts: int) -> None:
    """Leave ``row [P]`` (experts of one layer's slots, GPU of each slot ``gpu [P]``) with the fewest duplicates
    its replica and slot counts allow, in place: none when a duplicate-free layout exists.

    A max flow on experts x GPUs (one replica per pair), started from the placement itself: every second
    (third, ...) replica of an expert on a GPU is taken out, its slot left vacant, and each goes back by a
    shortest augmenting path (breadth-first over GPUs): it lands on a GPU h1 without its expert, which passes one
    of its replicas f1 on to a GPU h2 without f1, ... until a replica fills a vacant slot. No move lands a
    replica on a GPU that holds its expert, so each path removes one duplicate and adds none. When no path is
    left the flow is maximal (Ford-Fulkerson): the replicas still out go back into the vacant slots as the
    duplicates no layout avoids (none are left when a duplicate-free layout exists).
    """
    holds = np.zeros((num_gpus, num_experts), dtype=np.int64)
    np.add.at(holds, (gpu, row), 1)
    seen = np.zeros((num_gpus, num_experts), dtype=bool)
    out: list[int] = []  # experts taken out, one entry per replica
    for s in range(row.size):
        g, e = int(gpu[s]), int(row[s])
        if seen[g, e]:
            out.append(e)
            row[s] = -1
            holds[g, e] -= 1
        seen[g, e] = True
    vacant = row < 0
    while out:
        # came[h] = (GPU the replica entering h leaves, -1 for one taken out; its expert)
        came: dict[int, tuple[int, int]] = {}
        frontier: list[int] = []
        for e in dict.fromkeys(out):
            for h in np.flatnonzero(holds[:, e] == 0).tolist():
                if h not in came:
                    came[h] = (-1, e)
                    frontier.append(h)
        end = next((h for h in frontier if vacant[gpu == h].any()), -1)
        while end < 0 and frontier:
            reached: list[int] = []
            for h in frontier:
                on_h = np.unique(row[(gpu == h) & ~vacant])
                can = holds[:, on_h] == 0  # [G, experts on h]: GPUs without that expert
                for h2 in np.flatnonzero(can.any(axis=1)).tolist():
                    if h2 not in came:
                        came[h2] = (h, int(on_h[int(np.argmax(can[h2]))]))
                        reached.append(h2)
                        if end < 0 and vacant[gpu == h2].any():
                            end = h2
                if end >= 0:
                    break
            frontier = reached
        if end < 0:  # the flow is maximal: the rest are duplicates no layout avoids
            row[vacant] = out
            return
        # walk back: each entering replica takes the slot the leaving one frees (at the end, a vacant one)
        h = end
        target = int(np.flatnonzero((gpu == h) & vacant)[0])
        vacant[target] = False
        while True:
            src, e = came[h]
            row[target] = e
            holds[h, e] += 1
            if src < 0:
                out.remove(e)
                break
            target = int(np.flatnonzero((gpu == src) & (row == e))[0])
            holds[src, e] -= 1
            h = src


def refine_swaps(
    loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray, max_rounds: int = 64
) -> IntArray:
    """Lower each layer's busiest GPU by swapping one of its replicas with one on another GPU, to convergence.

    loads: [layers, E]; phy2log: [layers, P] (replica counts are kept, so every replica's load is fixed).
    Each round the busiest GPU trades one replica with one on its partner: the lightest GPU that has a trade
    lowering the busiest without lifting the partner to the old peak; of that partner's trades, the one
    leaving the lower maximum of the two loads. A swap never puts two replicas of one expert on one GPU.
    Stops when the busiest GPU has no trade, or after max_rounds swaps in a layer. Every GPU is in reach.
    Compiled (`_kernels.refine`).
    Returns the refined phy2log [layers, P].
    """
    rows, num_physical = phy2log.shape
    slots = np.ascontiguousarray(slots_per_gpu, dtype=np.int64)
    expert = np.array(phy2log, dtype=np.int64, order="C")
    if slots.size >= 2 and max_rounds > 0:
        _kernels.refine(expert, _f64(loads), rows, num_physical, loads.shape[1], slots, slots.size, max_rounds)
    return expert


COUNT_SEARCH_SLOTS = 64
"""Layers (nodes, for the hierarchical policy) with at most this many slots get `search_counts`."""
COUNT_SEARCH_MOVES = 32
"""The most moves `search_counts` keeps per layer."""
COUNT_SEARCH_PAIR_EXPERTS = 8
"""Layers (nodes) with at most this many experts also try pairs of one-replica moves in `search_counts`."""
COUNT_SEARCH_BUDGET = 512
"""The most candidate counts `search_counts` packs per layer: it bounds the time of layers with many experts
(docs/solvers.md, "Replica-count search")."""


def search_counts(
    loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray, max_replicas: int | None, rounds: int
) -> IntArray:
    """phy2log [layers, P] (placed and refined) after searching the replica counts of each layer with at most
    COUNT_SEARCH_SLOTS slots and no duplicate: the largest-load-per-replica rule picks counts that no packing
    balances when slots are few (loads 10, 9, 1 on 2 GPUs x 2 slots: 2, 1, 1 replicas leave 14 on a GPU; 1, 1, 2
    reach 10.5, the optimum). Each round every move of n replicas from an expert with more than n to another (at
    most max_replicas each, None: no cap) is packed as `solve_greedy` packs and refined (`refine_swaps`, rounds;
    0 turns the search off), skipping packings with a duplicate; when none helps and the layer has at most
    COUNT_SEARCH_PAIR_EXPERTS experts, every pair of one-replica moves. The move whose GPU loads, busiest first,
    are lowest is kept while they drop (at most COUNT_SEARCH_MOVES moves, COUNT_SEARCH_BUDGET packings), so the
    busiest GPU never rises. Compiled (`_kernels.search`). loads: [layers, E] (every expert with a replica in the
    row: a node's own experts for the hierarchical policy); slots_per_gpu: [G]. Returns a new array, or phy2log
    itself when no layer is searched (more slots than COUNT_SEARCH_SLOTS, rounds 0, one GPU)."""
    if phy2log.shape[1] > COUNT_SEARCH_SLOTS or rounds <= 0 or np.size(slots_per_gpu) < 2:
        return phy2log  # no layer to search: the placements as they are
    slots = np.ascontiguousarray(slots_per_gpu, dtype=np.int64)
    out = np.array(phy2log, dtype=np.int64, order="C")
    _kernels.search(out, _f64(loads), out.shape[0], out.shape[1], loads.shape[1], slots, slots.size, max_replicas or 0,
                    rounds, COUNT_SEARCH_MOVES, COUNT_SEARCH_PAIR_EXPERTS, COUNT_SEARCH_BUDGET)  # fmt: skip
    return out


def _replica_counts(phy2log: IntArray, num_experts: int) -> IntArray:
    """Replicas of each expert per row: [rows, E]."""
    rows = phy2log.shape[0]
    offset = (np.arange(rows) * num_experts)[:, None]
    return np.bincount((phy2log + offset).ravel(), minlength=rows * num_experts).reshape(rows, num_experts)


def _duplicates_per_layer(phy2log: IntArray, gpu: IntArray) -> NDArray[np.bool_]:
    key = np.sort(gpu[None, :] * (int(phy2log.max()) + 1) + phy2log, axis=1)
    return np.asarray((key[:, 1:] == key[:, :-1]).any(axis=1))


def _first_duplicate(row: IntArray, gpu: IntArray) -> int:
    key = gpu * (int(row.max()) + 1) + row
    order = np.argsort(key, kind="stable")
    same = np.flatnonzero(key[order][1:] == key[order][:-1])
    return int(order[same[0] + 1]) if same.size else -1


def _gpu_peaks(loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray) -> NDArray[np.float64]:
    """Busiest GPU's tokens per row, uniform shares: [rows], from loads [rows, E] and phy2log [rows, P] (every slot
    holding an expert; only the replicas in phy2log count, so a node's slots alone give the node's shares)."""
    share = np.take_along_axis(loads / np.maximum(_replica_counts(phy2log, loads.shape[1]), 1), phy2log, axis=1)
    starts = np.cumsum(slots_per_gpu) - slots_per_gpu
    peaks: NDArray[np.float64] = np.add.reduceat(share, starts, axis=1).max(axis=1)
    return peaks


def _lower(candidate: NDArray[np.float64], current: NDArray[np.float64]) -> NDArray[np.bool_]:
    """[rows] where the candidate's busiest GPU is lower than the current one's beyond rounding."""
    return np.asarray(candidate < current * (1 - 1e-12), dtype=np.bool_)


def _parked_alternative(
    loads: FloatArray, slots_per_gpu: IntArray, max_replicas: int | None, rounds: int, peak: NDArray[np.float64]
) -> tuple[IntArray, IntArray, NDArray[np.float64]] | None:
    """Placements of rows of experts (loads [rows, n]) on GPUs (slots_per_gpu [B]) of which some have more slots
    than there are experts, each such GPU holding fewer distinct experts, where they lower the busiest GPU below
    peak [rows] (the fewest-duplicates placement's): None when no GPU has more slots than n.

    A GPU with more slots than n must hold duplicates; the fewest (one replica of every expert, plus the extra
    slots) make it serve a share of every expert, hot ones included: loads 100, 90 on GPUs of 3 and 1 slots get
    {100, 90, 90} | {100}, 140 on the first, where {90, 90, 90} | {100} serve 90 and 100. A duplicate costs
    nothing on an expert no other GPU holds (its replicas all serve the same GPU), and only shifts shares onto
    the GPU otherwise. So for t = n..1 each such GPU takes t distinct experts: the rows are placed on slots
    capped at t there (`_place`, the duplicate spread, `refine_swaps`: no duplicate, as no GPU has more slots than
    experts), the capped slots then take duplicates of an expert their GPU holds (`_park`), and the result is
    refined; a row takes the first t that lowers its busiest GPU the most. A row whose busiest GPU is at the lower
    bound (`solvers.bounds.lower_bound`: the mean, the hottest expert over its most replicas) tries no more t. GPUs
    with at most n slots never get a duplicate. Returns (rows [k] where lower, their phy2log [k,
    sum(slots_per_gpu)], their busiest GPU's tokens [k]).
    """
    n = loads.shape[1]
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    big = slots > n
    if not big.any():
        return None
    loads = _f64(loads)
    bound = lower_bound(loads, slots) * (1 + 1e-12)
    best_phy = np.empty((loads.shape[0], int(slots.sum())), dtype=np.int64)
    best_peak = np.asarray(peak, dtype=np.float64).copy()
    found = np.zeros(loads.shape[0], dtype=np.bool_)
    for t in range(n, 0, -1):
        rows = np.flatnonzero(best_peak > bound)  # the rest can go no lower
        cap = np.where(big, t, slots)
        if rows.size == 0 or int(cap.sum()) < n:
            continue
        sub = loads[rows]
        local, stuck = _place(sub, np.tile(cap, (rows.size, 1)), max_replicas)
        if stuck.any():
            local[stuck] = spread_duplicates(sub[stuck], local[stuck], cap)
        phy = refine_swaps(sub, _park(sub, refine_swaps(sub, local, cap, rounds), cap, slots), slots, rounds)
        candidate = _gpu_peaks(sub, phy, slots)
        better = _lower(candidate, best_peak[rows])
        best_phy[rows[better]], best_peak[rows[better]] = phy[better], candidate[better]
        found[rows[better]] = True
    return np.flatnonzero(found), best_phy[found], best_peak[found]


def _park(loads: FloatArray, phy2log: IntArray, capacity: IntArray, slots_per_gpu: IntArray) -> IntArray:
    """phy2log [rows, sum(capacity)] (GPU g in capacity[g] slots) widened to slots_per_gpu [B] (>= capacity): the
    slots GPU g gains all hold more replicas of one expert g holds, the one leaving the lowest busiest GPU, then the
    lowest load on g, then the lowest id (an expert only g holds changes no load: `_exclusive_onto_growing` gives
    g one where it can), GPU by GPU. loads: [rows, E]. Returns [rows, sum(slots_per_gpu)], GPU by GPU."""
    rows, num_experts = loads.shape
    gpus = capacity.size
    r = np.arange(rows)
    phy2log = _exclusive_onto_growing(phy2log, capacity, slots_per_gpu, num_experts)
    held = np.zeros((rows, gpus, num_experts), dtype=np.int64)  # replicas of each expert on each GPU
    np.add.at(held, (r[:, None], slot_gpu(capacity)[None, :], phy2log), 1)
    count = held.sum(axis=1)  # [rows, E]
    gpu_load = (held * (loads / count)[:, None, :]).sum(axis=2)  # [rows, B]
    pieces: list[IntArray] = []
    starts = np.cumsum(capacity) - capacity
    for g in range(gpus):
        pieces.append(phy2log[:, starts[g]:starts[g] + capacity[g]])
        extra = int(slots_per_gpu[g] - capacity[g])
        if extra == 0:
            continue
        # [rows, E, B]: every GPU's load with `extra` more replicas of each expert on g
        now = held.transpose(0, 2, 1).astype(np.float64)
        after_held = now.copy()
        after_held[:, :, g] += extra
        after = (gpu_load[:, None, :] + after_held * (loads / (count + extra))[:, :, None]
                 - now * (loads / count)[:, :, None])
        peak = np.where(held[:, g, :] > 0, after.max(axis=2), np.inf)
        least = peak.min(axis=1, keepdims=True)
        e = np.argmin(np.where(peak <= least * (1 + 1e-12), after[:, :, g], np.inf), axis=1)
        held[r, g, e] += extra
        count[r, e] += extra
        gpu_load = after[r, e]
        pieces.append(np.repeat(e[:, None], extra, axis=1))
    return np.ascontiguousarray(np.concatenate(pieces, axis=1))


def _exclusive_onto_growing(
    phy2log: IntArray, capacity: IntArray, slots_per_gpu: IntArray, num_experts: int
) -> IntArray:
    """phy2log [rows, sum(capacity)] with the contents of GPUs of equal capacity exchanged so that each GPU that
    will gain slots (slots_per_gpu [B] > capacity [B]) holds an expert no other GPU holds, where one that will not
    gain has such an expert to give: the loads stay as they are (equal capacities, whole contents), and the gained
    slots can then hold duplicates that shift no load (`_park`)."""
    out = phy2log.copy()
    count = _replica_counts(out, num_experts)
    starts = np.cumsum(capacity) - capacity
    growing = slots_per_gpu > capacity
    for g in np.flatnonzero(growing):
        seg = slice(int(starts[g]), int(starts[g] + capacity[g]))
        lacking = ~(np.take_along_axis(count, out[:, seg], axis=1) == 1).any(axis=1)
        for h in np.flatnonzero(~growing & (capacity == capacity[g])):
            other = slice(int(starts[h]), int(starts[h] + capacity[h]))
            swap = lacking & (np.take_along_axis(count, out[:, other], axis=1) == 1).any(axis=1)
            out[swap, seg], out[swap, other] = out[swap, other], out[swap, seg]
            lacking &= ~swap
    return out


def solve_greedy(
    loads: FloatArray,
    slots_per_gpu: IntArray,
    *,
    num_groups: int | None = None,
    gpus_per_node: int | None = None,
    max_replicas: int | None = None,
    refine_rounds: int = 1000,
) -> IntArray:
    """Our greedy placement for every layer at once: replicate, pack, then swap refinement.

    loads: [layers, E] tokens per expert; slots_per_gpu: [G] slots on each GPU (may differ, each >= 1,
    sum >= E). With num_groups and gpus_per_node (and num_groups divisible by the node count) the
    hierarchical policy runs: expert groups are packed onto nodes (bins of equal group counts balanced by tokens,
    each bin on the node that carries it best when the nodes' slots differ: `_nodes_for_bins`, then `_swap_groups`),
    replicated inside each node and packed onto that node's GPUs, so a token's experts stay within few nodes;
    otherwise the global policy.
    max_replicas caps the GPUs that hold one expert (default: the GPU count, or GPUs per node; the duplicates a
    GPU with more slots than experts parks on one expert it holds occupy no more GPUs);
    refine_rounds bounds the swaps per layer of the refinement (`refine_swaps`, which stops by itself when
    the busiest GPU cannot improve; 0 turns it off, and the count search with it).
    Layers (nodes) of at most COUNT_SEARCH_SLOTS slots then search their replica counts (`search_counts`): on few
    slots the largest-load-per-replica counts can leave a GPU far above what other counts reach.
    No GPU holds two replicas of one expert unless it has more slots than there are experts (node experts for the
    hierarchical policy): a layer whose packing gets stuck with replica counts that force a duplicate elsewhere
    (uneven slots) is replicated again under the Gale-Ryser condition in the compiled loop (`_kernels.c`,
    place_row), then packed again; `spread_duplicates` repairs what the packing leaves. Such a GPU with spare
    slots holds at least those extra slots as duplicates; where fewer distinct experts there lower the busiest GPU
    (`_parked_alternative`), more. Returns phy2log [layers, sum(slots_per_gpu)], validated.
    """
    refuse_loads(loads)  # finite, >= 0, at most MAX_LOAD before any compiled kernel sees them
    loads = np.asarray(loads, dtype=np.float64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    layers, num_experts = loads.shape
    num_gpus = slots.size
    if int(slots.sum()) < num_experts:
        raise ValueError(f"{int(slots.sum())} slots cannot hold {num_experts} experts")
    num_nodes = num_gpus // gpus_per_node if gpus_per_node else 1
    hierarchical = (
        num_groups is not None
        and gpus_per_node is not None
        and num_nodes > 1
        and num_gpus % gpus_per_node == 0
        and num_experts % num_groups == 0
        and num_groups % num_nodes == 0
    )
    if not hierarchical:  # one compiled pass per layer: replicate, pack, refine
        cap = max_replicas if max_replicas is not None else num_gpus
        slots = np.ascontiguousarray(slots)
        loads = _f64(loads)
        phy2log = np.empty((layers, int(slots.sum())), dtype=np.int64)
        stuck = np.zeros(layers, dtype=np.bool_)
        _kernels.greedy(loads, layers, num_experts, slots, num_gpus, cap or 0, refine_rounds, phy2log, stuck)
        if stuck.any():  # rare: a GPU took two replicas of one expert while packing; refined after the spread
            rows = np.flatnonzero(stuck)
            spread = spread_duplicates(loads[rows], phy2log[rows], slots)
            phy2log[rows] = refine_swaps(loads[rows], spread, slots, refine_rounds)
        phy2log = search_counts(loads, phy2log, slots, cap, refine_rounds)
        found = _parked_alternative(loads, slots, cap, refine_rounds, _gpu_peaks(loads, phy2log, slots))
        if found is not None:  # a GPU has more slots than there are experts
            phy2log[found[0]] = found[1]
    else:
        assert num_groups is not None and gpus_per_node is not None
        phy2log, stuck, mlog2log = _place_hierarchical(
            loads, slots, num_groups, gpus_per_node, max_replicas, refine_rounds
        )
        if stuck.any():  # spread node by node: an expert's replicas stay on its group's node
            rows = np.flatnonzero(stuck)
            for gpus, span in _node_spans(slots, gpus_per_node):
                phy2log[rows, span] = spread_duplicates(loads[rows], phy2log[rows, span], slots[gpus])
        phy2log = _refine_within_nodes(loads, phy2log, slots, gpus_per_node, refine_rounds)
        node_experts = mlog2log.reshape(layers, num_nodes, -1)  # [layers, nodes, node experts], as placed
        cap = max_replicas if max_replicas is not None else gpus_per_node
        for node, (gpus, span) in enumerate(_node_spans(slots, gpus_per_node)):  # the count search, node by node
            if int(slots[gpus].sum()) <= COUNT_SEARCH_SLOTS:
                held = np.ascontiguousarray(node_experts[:, node])
                local = search_counts(_take(_f64(loads), held), _positions(held, phy2log[:, span]), slots[gpus], cap,
                                      refine_rounds)  # fmt: skip
                phy2log[:, span] = _take(held, local)
        for node, (gpus, span) in enumerate(_node_spans(slots, gpus_per_node)):
            if not np.any(slots[gpus] > node_experts.shape[2]):
                continue  # the rest: nodes with a GPU of more slots than the node has experts
            held = np.ascontiguousarray(node_experts[:, node])
            found = _parked_alternative(_take(_f64(loads), held), slots[gpus], cap, refine_rounds,
                                        _gpu_peaks(loads, phy2log[:, span], slots[gpus]))  # fmt: skip
            if found is not None:
                phy2log[found[0], span] = _take(held[found[0]], found[1])
    validate_placement(phy2log, slots, num_experts)
    return phy2log


def _node_spans(slots: IntArray, gpus_per_node: int) -> list[tuple[slice, slice]]:
    """Per node: (its GPUs, its slots) as slices of slots [G] and of a layer's P slots."""
    ends = np.cumsum(slots)
    spans = []
    for node in range(slots.size // gpus_per_node):
        first, last = node * gpus_per_node, (node + 1) * gpus_per_node
        spans.append((slice(first, last), slice(int(ends[first] - slots[first]), int(ends[last - 1]))))
    return spans


def _refine_within_nodes(
    loads: FloatArray, phy2log: IntArray, slots: IntArray, gpus_per_node: int, rounds: int
) -> IntArray:
    """refine_swaps node by node, so expert groups stay on their nodes."""
    out = phy2log.copy()
    for gpus, span in _node_spans(slots, gpus_per_node):  # over nodes, each call covers every layer
        out[:, span] = refine_swaps(loads, phy2log[:, span], slots[gpus], rounds)
    return out


def _place_hierarchical(
    loads: FloatArray, slots: IntArray, num_groups: int, gpus_per_node: int, max_replicas: int | None,
    refine_rounds: int = 1000,
) -> tuple[IntArray, NDArray[np.bool_], IntArray]:
    """Groups onto nodes, then `_place` inside each node. Returns phy2log [layers, P], stuck [layers] and mlog2log
    [layers, E] (the logical experts node by node, each node's in the order its rows were placed).
    refine_rounds: the refinement's, for judging which node carries which groups when the nodes' slots differ
    (`_nodes_for_bins`)."""
    layers, num_experts = loads.shape
    num_nodes = slots.size // gpus_per_node
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    node_slots = slots.reshape(num_nodes, gpus_per_node)
    if np.any(node_slots.sum(axis=1) < experts_per_node):
        raise ValueError(
            f"hierarchical policy: every node needs at least {experts_per_node} slots "
            f"({num_experts} experts over {num_nodes} nodes), got {node_slots.sum(axis=1).tolist()}"
        )
    cap = max_replicas if max_replicas is not None else gpus_per_node
    # Step 1: groups onto nodes, equal group counts per node, balanced by tokens; where the nodes' slots differ,
    # each bin of groups goes to the node that carries it best.
    group_load = loads.reshape(layers, num_groups, group_size).sum(axis=2)
    node_cap = np.full((layers, num_nodes), num_groups // num_nodes, dtype=np.int64)
    node_of_group, rank_in_node = pack(group_load, node_cap)
    kinds, kind_of_node = np.unique(node_slots, axis=0, return_inverse=True)
    if len(kinds) > 1 and num_nodes * len(kinds) <= MAX_NODE_PAIRS:
        kind_of_node = kind_of_node.reshape(-1)
        node_of_group = _nodes_for_bins(loads, node_of_group, rank_in_node, group_size, kinds, kind_of_node, cap,
                                        refine_rounds)  # fmt: skip
        node_of_group, rank_in_node = _swap_groups(loads, node_of_group, rank_in_node, group_size, kinds,
                                                   kind_of_node, cap, refine_rounds)  # fmt: skip
    log2mlog = _group_order(node_of_group, rank_in_node, num_groups // num_nodes, group_size)
    mlog2log = _inverse(log2mlog)
    # Step 2 and 3: replicate within each node and pack onto its GPUs (rows = layer x node).
    node_loads = _take(_f64(loads), mlog2log).reshape(layers * num_nodes, experts_per_node)
    capacity = np.tile(node_slots, (layers, 1))
    local, stuck = _place(node_loads, capacity, cap)
    # Rows of local are padded to the largest node; strip padding node by node, keeping slot order.
    local = local.reshape(layers, num_nodes, -1) + (np.arange(num_nodes) * experts_per_node)[None, :, None]
    width = node_slots.sum(axis=1)
    keep = np.arange(local.shape[2])[None, :] < width[:, None]
    mlog = local[:, keep]
    stuck_layers = np.asarray(stuck.reshape(layers, num_nodes).any(axis=1), dtype=np.bool_)
    return _take(mlog2log, mlog), stuck_layers, mlog2log


MAX_NODE_PAIRS = 1024
"""The most (bin of groups, kind of node) pairs per layer `_nodes_for_bins` places to choose the nodes (nodes x
distinct slot rows of a node); beyond, step 1's bins keep the nodes of its packing."""


def _nodes_for_bins(
    loads: FloatArray, node_of_group: IntArray, rank_in_node: IntArray, group_size: int, kinds: IntArray,
    kind_of_node: IntArray, max_replicas: int, rounds: int,
) -> IntArray:
    """node_of_group [layers, groups] with step 1's bins of groups (the packing's node labels) given to the nodes
    that carry them best, for nodes whose slots differ (kinds [K, gpus per node]: the distinct slot rows of a node;
    kind_of_node [N]). The packing balances tokens as if the nodes were alike; a bin's hot experts on a node whose
    GPUs cannot spread them (a GPU with more slots than the node has experts takes one replica of each, plus
    duplicates) set the layer's busiest GPU although another node could carry them (loads 100, 90, 1, 5 in 2
    groups on GPUs of 3, 1 | 1, 1 slots: 140 on node 0, 100 on node 1). So each bin is placed on each kind of node
    as the node places it (`_place`, the duplicate spread, `refine_swaps`), and each layer gives the bins to the
    nodes with the lowest busiest GPU over all assignments (a bottleneck assignment), keeping the packing's
    labels where they reach it. loads: [layers, E]."""
    layers, groups = node_of_group.shape
    nodes = kind_of_node.size
    mlog2log = _inverse(_group_order(node_of_group, rank_in_node, groups // nodes, group_size))
    bins = mlog2log.reshape(layers * nodes, -1)  # [layers x bins, node experts]: logical experts, as placed
    layer_of_row = np.repeat(np.arange(layers), nodes)
    peaks = np.empty((layers, nodes, len(kinds)))  # [layer, bin, kind]: the busiest GPU of the bin on the kind
    for k, kind in enumerate(kinds):
        peaks[:, :, k] = _node_peaks(loads, bins, layer_of_row, kind, max_replicas, rounds).reshape(layers, nodes)
    node_of_bin = _bottleneck_assignment(peaks[:, :, kind_of_node])
    return np.take_along_axis(node_of_bin, node_of_group, axis=1)


def _node_peaks(
    loads: FloatArray, experts: IntArray, layer_of_row: IntArray, kind: IntArray, max_replicas: int, rounds: int
) -> NDArray[np.float64]:
    """[rows] the busiest GPU's tokens when a node of GPUs with slots kind [B] holds the logical experts
    experts [rows, n] of layer layer_of_row [rows] (loads [layers, E]), placed as `solve_greedy` places a node's
    experts (`_place`, the duplicate spread, `refine_swaps`, and on GPUs with more slots than n experts the
    alternatives of `_parked_alternative`)."""
    kind = np.ascontiguousarray(kind, dtype=np.int64)
    loads = _f64(loads)
    node_loads = np.ascontiguousarray(loads[layer_of_row[:, None], experts])  # [rows, n]
    local, stuck = _place(node_loads, np.tile(kind, (experts.shape[0], 1)), max_replicas)
    if stuck.any():  # spread on logical ids, as solve_greedy does (its repair visits duplicates in id order)
        rows = np.flatnonzero(stuck)
        spread = spread_duplicates(loads[layer_of_row[rows]], _take(experts[rows], local[rows]), kind)
        local[rows] = _positions(experts[rows], spread)
    refined = search_counts(node_loads, refine_swaps(node_loads, local, kind, rounds), kind, max_replicas, rounds)
    peak = _gpu_peaks(node_loads, refined, kind)  # the swaps and the count search ignore ids
    found = _parked_alternative(node_loads, kind, max_replicas, rounds, peak)
    if found is not None:  # as solve_greedy's last step on such a node
        peak[found[0]] = found[2]
    return peak


def _positions(experts: IntArray, ids: IntArray) -> IntArray:
    """[rows, k] the position of each of ids [rows, k] in its row of experts [rows, n] (distinct ids per row)."""
    rows, n = experts.shape
    order = np.argsort(experts, axis=1)
    offset = (np.arange(rows) * (int(max(experts.max(), ids.max())) + 1))[:, None]
    found = np.searchsorted((np.take_along_axis(experts, order, axis=1) + offset).ravel(), (ids + offset).ravel())
    at: IntArray = np.take_along_axis(order, found.reshape(ids.shape) - np.arange(rows)[:, None] * n, axis=1)
    return at


MAX_GROUP_SWAP_ROUNDS = 64
"""The most group swaps per layer `_swap_groups` makes."""
MAX_GROUP_SWAP_CANDIDATES = 64
"""The most swaps one round of `_swap_groups` tries per layer ((groups per node)^2 x (nodes - 1)); beyond, the
bins' assignment stands: each candidate places two nodes again, so 256 groups on 4 nodes took minutes."""


def _swap_groups(
    loads: FloatArray, node_of_group: IntArray, rank_in_node: IntArray, group_size: int, kinds: IntArray,
    kind_of_node: IntArray, max_replicas: int, rounds: int,
) -> tuple[IntArray, IntArray]:
    """node_of_group and rank_in_node [layers, groups] after swapping groups between nodes whose slots differ,
    while a swap lowers the busiest node. Bins of equal tokens suit alike nodes; where nodes differ, a node with
    no slot to spare (as many slots as experts) cannot replicate a hot expert that another node's spare slots
    could, so the bins themselves (not only which node takes which, `_nodes_for_bins`) should follow the nodes:
    two hot experts in two bins, one node with spare slots (nodes of 8, 8, 8 and 12 slots per GPU) leave the
    second on a node that cannot replicate it. Each round, in every layer still improving, each group of the
    busiest node is tried against each group of every other node (the group taking the other's rank), both
    nodes placed as `solve_greedy` places them (`_node_peaks`), and the swap leaving the lower of the two nodes'
    busiest GPUs is made when it is below the busiest node's; at most MAX_GROUP_SWAP_ROUNDS rounds.
    kinds [K, gpus per node], kind_of_node [N] as in `_nodes_for_bins`; loads [layers, E]."""
    layers, groups = node_of_group.shape
    nodes = kind_of_node.size
    per = groups // nodes
    if per == 1 or per * per * (nodes - 1) > MAX_GROUP_SWAP_CANDIDATES:  # one group per node: `_nodes_for_bins`
        return node_of_group, rank_in_node  # has tried every assignment; too many: the bins' assignment stands
    at = np.empty((layers, nodes, per), dtype=np.int64)  # the group at each (node, rank)
    np.put_along_axis(at.reshape(layers, -1), node_of_group * per + rank_in_node, np.arange(groups)[None, :], axis=1)
    within = np.arange(group_size)

    def experts_of(node_groups: IntArray) -> IntArray:  # [..., per] groups -> [..., per x group size] experts
        out: IntArray = (node_groups[..., None] * group_size + within).reshape(*node_groups.shape[:-1], -1)
        return out

    def peaks_of(node_groups: IntArray, node: IntArray, layer: IntArray) -> NDArray[np.float64]:
        """[rows] peaks of the groups node_groups [rows, per] on nodes node [rows] of layers layer [rows]."""
        out = np.empty(node.size)
        for k, kind in enumerate(kinds):
            rows = np.flatnonzero(kind_of_node[node] == k)
            if rows.size:
                out[rows] = _node_peaks(loads, experts_of(node_groups[rows]), layer[rows], kind, max_replicas, rounds)
        return out

    everyone = np.arange(layers)
    peak = peaks_of(at.reshape(-1, per), np.tile(np.arange(nodes), layers), np.repeat(everyone, nodes))
    peak = peak.reshape(layers, nodes)
    # candidates: (rank i on the busiest node, other node by offset, rank j there)
    i, off, j = (a.reshape(-1) for a in np.meshgrid(np.arange(per), np.arange(1, nodes), np.arange(per),
                                                     indexing="ij"))  # fmt: skip
    active = everyone
    for _ in range(MAX_GROUP_SWAP_ROUNDS):
        if active.size == 0:
            break
        hot = np.argmax(peak[active], axis=1)  # [A]
        other = (hot[:, None] + off[None, :]) % nodes  # [A, C]
        a = at[active, hot][:, i]  # [A, C]: the group leaving the busiest node
        b = at[active[:, None], other, j[None, :]]  # [A, C]: the group coming in
        hot_groups = np.repeat(at[active, hot][:, None, :], i.size, axis=1)  # [A, C, per]
        hot_groups[:, np.arange(i.size), i] = b
        other_groups = at[active[:, None], other].copy()  # [A, C, per]
        other_groups[:, np.arange(i.size), j] = a
        layer = np.repeat(active, i.size)
        new_hot = peaks_of(hot_groups.reshape(-1, per), np.repeat(hot, i.size), layer).reshape(active.size, -1)
        new_other = peaks_of(other_groups.reshape(-1, per), other.reshape(-1), layer).reshape(active.size, -1)
        worst = np.maximum(new_hot, new_other)
        best = np.argmin(worst, axis=1)
        pick = np.arange(active.size)
        improves = _lower(worst[pick, best], peak[active, hot])
        for row in np.flatnonzero(improves):  # few layers: the swaps themselves
            layer_id, c = active[row], best[row]
            h, o = hot[row], other[row, c]
            at[layer_id, h, i[c]], at[layer_id, o, j[c]] = b[row, c], a[row, c]
            peak[layer_id, h], peak[layer_id, o] = new_hot[row, c], new_other[row, c]
        active = active[improves]
    flat = at.reshape(layers, -1)
    node_of, rank_of = np.empty_like(node_of_group), np.empty_like(rank_in_node)
    position = np.arange(nodes * per)
    np.put_along_axis(node_of, flat, np.broadcast_to(position // per, flat.shape), axis=1)
    np.put_along_axis(rank_of, flat, np.broadcast_to(position % per, flat.shape), axis=1)
    return node_of, rank_of


def _bottleneck_assignment(cost: NDArray[np.float64]) -> IntArray:
    """[layers, n]: per layer a one-to-one assignment of n rows to n columns (column of each row) whose largest
    cost [layers, n, n] is the least any has; the identity where it is one of them. Every permutation for n up to
    BRUTE_FORCE_NODES (all layers at once), else a search for the least threshold that admits a perfect matching."""
    layers, n, _ = cost.shape
    if n <= BRUTE_FORCE_NODES:
        perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)  # the identity first
        worst = cost[:, np.arange(n)[None, :], perms].max(axis=2)  # [layers, n!]
        best: IntArray = perms[np.argmin(worst, axis=1)]  # the first least: the identity when it is one
        return best
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching

    out = np.broadcast_to(np.arange(n, dtype=np.int64), (layers, n)).copy()
    for layer in range(layers):
        c = cost[layer]
        kept = np.diagonal(c).max()
        if kept <= max(c.min(axis=1).max(), c.min(axis=0).max()):  # no assignment goes below these
            continue
        values = np.unique(c[c < kept])
        lo, hi = 0, values.size  # values[hi] (kept, the identity's) always admits one
        match = out[layer]
        while lo < hi:
            mid = (lo + hi) // 2
            found = maximum_bipartite_matching(csr_matrix(c <= values[mid]), perm_type="column")
            if (found >= 0).all():
                hi, match = mid, found
            else:
                lo = mid + 1
        out[layer] = match
    return out


BRUTE_FORCE_NODES = 6
"""Up to this many nodes `_bottleneck_assignment` tries every permutation (720)."""


def _group_order(node_of_group: IntArray, rank_in_node: IntArray, groups_per_node: int, group_size: int) -> IntArray:
    """log2mlog [layers, E]: position of each logical expert when experts are listed node by node."""
    first = (node_of_group * groups_per_node + rank_in_node) * group_size
    return (first[:, :, None] + np.arange(group_size)).reshape(first.shape[0], -1)


def _inverse(perm: IntArray) -> IntArray:
    """Inverse of each row's permutation: [rows, n]."""
    perm = np.ascontiguousarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    _kernels.take(perm, perm, perm.shape[0], perm.shape[1], perm.shape[1], True, inv)
    return inv


_A = TypeVar("_A", NDArray[np.float64], NDArray[np.int64])


def _take(src: _A, idx: IntArray) -> _A:
    """np.take_along_axis(src, idx, axis=1) for 2-D float64 or int64 src (compiled, no index broadcasting)."""
    src = np.ascontiguousarray(src)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    out = np.empty(idx.shape, dtype=src.dtype)
    _kernels.take(src, idx, src.shape[0], src.shape[1], idx.shape[1], False, out)
    return out


def _as_numpy(weight: Any) -> NDArray[np.float32]:
    """Accept numpy arrays, nested lists and torch tensors (any device) without importing torch."""
    if hasattr(weight, "detach"):
        weight = weight.detach().cpu().numpy()
    return np.asarray(weight, dtype=np.float32)


def _torch_of(weight: Any) -> Any:
    """The torch module when `weight` is a torch tensor (torch is then imported already), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(weight, torch.Tensor) else None


@overload
def rebalance_experts(
    weight: NDArray[Any] | Sequence[Any], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[IntArray, IntArray, IntArray]: ...


@overload
def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Any, Any, Any]: ...


def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Any, Any, Any]:
    """Drop-in for DeepSeek EPLB's `rebalance_experts`.

    weight: [layers, E] load statistics (a torch tensor of any device, a numpy array or nested lists);
    num_replicas: physical experts, a multiple of num_gpus; hierarchical policy when num_groups % num_nodes
    == 0, else global. Raises AssertionError where DeepSeek's function asserts (counts that do not divide,
    fewer physical than logical experts: the message names the arguments), as callers such as vLLM's tests expect.
    Invalid input may raise otherwise than DeepSeek's does: a count that is no whole number >= 1 is a ValueError
    naming it (DeepSeek's raises ZeroDivisionError for a 0, and runs on with a negative count), as is a weight
    that is not [layers, E] finite counts >= 0.
    Returns phy2log [layers, num_replicas], log2phy [layers, E, max replicas] (-1 padded) and
    logcnt [layers, E], all int64, identical to DeepSeek's (float32 arithmetic, same tie-breaking): torch
    int64 CPU tensors for a torch tensor weight, as DeepSeek's (callers pad them and move them with `.to`),
    numpy arrays otherwise.
    """
    for name, count in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)):
        whole = whole_number(count)
        if whole is None or whole < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {count!r}")
    num_replicas, num_groups, num_nodes, num_gpus = (int(c) for c in (num_replicas, num_groups, num_nodes, num_gpus))
    w = _as_numpy(weight)
    if w.ndim != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {w.shape}")
    refuse_loads(w, "weight")
    layers, num_log = w.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _deepseek_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _deepseek_hierarchical(w, num_replicas, 1, 1, num_gpus)
    maxcnt = int(logcnt.max())
    log2phy = np.empty((layers, num_log, maxcnt), dtype=np.int64)
    _kernels.log2phy(phy2log, phyrank, layers, num_replicas, num_log, maxcnt, log2phy)
    torch = _torch_of(weight)
    if torch is None:
        return phy2log, log2phy, logcnt
    as_tensor = torch.from_numpy
    return as_tensor(phy2log.astype(np.int64)), as_tensor(log2phy), as_tensor(logcnt.astype(np.int64))


def _require(condition: bool, message: str) -> None:
    """Fail as DeepSeek's function does where it asserts (AssertionError), also under `python -O`."""
    if not condition:
        raise AssertionError(message)


def _deepseek_pack(weight: NDArray[np.float32], num_packs: int) -> tuple[IntArray, IntArray]:
    """DeepSeek's balanced_packing: equal item counts per pack; one item per pack keeps item order."""
    rows, n = weight.shape
    _require(n % num_packs == 0, f"{n} items do not split evenly over {num_packs} packs")
    if n == num_packs:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    capacity = np.full((rows, num_packs), n // num_packs, dtype=np.int64)
    return pack(weight, capacity, order=argsort_desc_like_torch(weight))


def _deepseek_hierarchical(
    weight: NDArray[np.float32], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[IntArray, IntArray, IntArray]:
    layers, num_log = weight.shape
    for what, a, by, b in (  # rebalance_experts' argument names (the global policy passes 1 group on 1 node)
        ("the weight's experts", num_log, "num_groups", num_groups),
        ("num_groups", num_groups, "num_nodes", num_nodes),
        ("num_gpus", num_gpus, "num_nodes", num_nodes),
        ("num_replicas", num_physical, "num_gpus", num_gpus),
    ):
        _require(a % b == 0, f"{what} ({a}) must be a multiple of {by} ({b})")
    _require(num_physical >= num_log, f"num_replicas ({num_physical}) cannot hold the weight's {num_log} experts "
                                      "(one slot each at least)")
    group_size = num_log // num_groups
    log2mlog = mlog2log = None  # experts listed node by node (mlog); the global policy keeps logical order
    mlog_load: FloatArray = weight
    if num_nodes > 1 or num_groups > 1:
        if num_groups == num_nodes:  # one group per node: no packing, the sums are not needed
            node_of_group, rank_in_node = _deepseek_pack(weight[:, :num_groups], num_nodes)
        else:  # group sums added in torch's order: float32 sums above 2^24 round as DeepSeek's do
            group_load = sum_last_like_torch(weight.reshape(-1, group_size)).reshape(layers, num_groups)
            node_of_group, rank_in_node = _deepseek_pack(group_load, num_nodes)
        log2mlog = _group_order(node_of_group, rank_in_node, num_groups // num_nodes, group_size)
        mlog2log = _inverse(log2mlog)
        mlog_load = _take(_f64(weight), mlog2log)
    # Steps 2 and 3 (rows = layer x node): replicate within the node, pack its replicas onto its GPUs
    rows, per_node = layers * num_nodes, num_log // num_nodes
    pphy2mlog = np.empty((rows, num_physical // num_nodes), dtype=np.int64)
    pphyrank = np.empty_like(pphy2mlog)
    mlogcnt = np.empty((rows, per_node), dtype=np.int64)
    _kernels.deepseek_rows(
        _f64(mlog_load), rows, per_node, num_physical // num_nodes, num_gpus // num_nodes, pphy2mlog, pphyrank, mlogcnt
    )
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + (np.arange(num_nodes) * per_node)[:, None]).reshape(
        layers, -1
    )
    if log2mlog is None or mlog2log is None:  # global policy: mlog is log
        return pphy2mlog, pphyrank.reshape(layers, -1), mlogcnt
    pphy2log = _take(mlog2log, pphy2mlog)
    counts: IntArray = mlogcnt.reshape(layers, -1)
    logcnt = _take(counts, log2mlog)
    return pphy2log, pphyrank.reshape(layers, -1), logcnt


class GreedySolver(Solver):
    """Registered as "greedy": `solve_greedy` (replicate, pack, swap refinement)."""

    name = "greedy"
    summary = "replicate the hottest experts, pack heaviest-first, refine by swaps (milliseconds)"
    capabilities = Capabilities(hierarchical=True)

    def solve(self, problem: Problem, options: Options) -> Solution:
        phy2log = solve_greedy(
            problem.loads, problem.slots_per_gpu, num_groups=problem.num_groups, gpus_per_node=problem.gpus_per_node
        )
        return Solution(phy2log, status="heuristic")


class DeepSeekSolver(Solver):
    """Registered as "deepseek": DeepSeek EPLB's algorithm (`rebalance_experts`), for comparison."""

    name = "deepseek"
    summary = "DeepSeek EPLB's algorithm, same results as its eplb.py (equal slots per GPU)"
    capabilities = Capabilities(hierarchical=True, uneven_slots=False)

    def solve(self, problem: Problem, options: Options) -> Solution:
        slots = problem.slots_per_gpu
        num_gpus = int(slots.size)
        nodes = num_gpus // problem.gpus_per_node if problem.gpus_per_node else 1
        groups = problem.num_groups if problem.hierarchical else 1
        assert groups is not None
        try:
            phy2log, _, _ = rebalance_experts(problem.loads, int(slots.sum()), groups, nodes, num_gpus)
        except AssertionError as exc:  # DeepSeek's way to refuse; callers of a solver expect ValueError
            raise ValueError(f"deepseek: {exc}") from None
        return Solution(phy2log.astype(np.int64), status="heuristic")
