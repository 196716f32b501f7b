"""Moving from the current placement to a new one: relabel GPUs, count copies.

A placement is only defined up to which GPU is called which: GPUs with the same
number of slots are interchangeable, and so are the slots inside one GPU. Before
counting what a new placement costs to roll out, ``relabel_gpus`` picks the
labelling that keeps as many experts where they already are as possible, and
``count_moves`` counts the expert weights that then still have to be copied onto
a GPU. Both work for any solver's output.

Shapes: ``phy2log [L, P]`` (slot -> logical expert, slots numbered GPU by GPU,
GPU ``g`` owning a contiguous run of ``slots_per_gpu[g]`` slots), ``slots_per_gpu [G]``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from numpy.typing import ArrayLike, NDArray
from ortools.graph.python import linear_sum_assignment

__all__ = ["count_moves", "gpu_membership", "relabel_gpus", "relabel_slot_order"]


def _check(
    new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    new = np.asarray(new_phy2log, dtype=np.int64)
    cur = np.asarray(current_phy2log, dtype=np.int64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if new.ndim != 2 or new.shape != cur.shape:
        raise ValueError(f"new and current phy2log must both be [layers, slots]; got {new.shape} and {cur.shape}")
    if slots.ndim != 1 or np.any(slots < 0) or int(slots.sum()) != new.shape[1]:
        raise ValueError(f"slots_per_gpu must be non-negative and sum to {new.shape[1]} slots")
    if new.size and (min(new.min(), cur.min()) < 0):
        raise ValueError("phy2log entries must be expert ids >= 0")
    return new, cur, slots


def gpu_membership(phy2log: NDArray[np.int64], slots_per_gpu: NDArray[np.int64], num_experts: int) -> NDArray[np.bool_]:
    """``[L, G, E]`` bool: expert ``e`` has a replica on GPU ``g`` in layer ``l``."""
    num_layers = phy2log.shape[0]
    gpu_of_slot = np.repeat(np.arange(slots_per_gpu.size), slots_per_gpu)
    member = np.zeros((num_layers, slots_per_gpu.size, num_experts), dtype=bool)
    layer_idx = np.repeat(np.arange(num_layers), phy2log.shape[1])
    member[layer_idx, np.tile(gpu_of_slot, num_layers), phy2log.ravel()] = True
    return member


def count_moves(new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.int64]:
    """Expert weights to copy, per layer: ``[L]`` int64.

    The number of distinct (expert, GPU) pairs present in ``new_phy2log`` and absent
    from ``current_phy2log``: each is one expert's weights copied onto one GPU.
    Which slot an expert sits in inside a GPU is not counted (a local move). GPUs are
    taken as labelled; call :func:`relabel_gpus` first to count against the best
    labelling. Multiply by an expert's bytes for bytes moved.
    """
    new, cur, slots = _check(new_phy2log, current_phy2log, slots_per_gpu)
    num_experts = int(max(new.max(initial=-1), cur.max(initial=-1))) + 1
    new_member = gpu_membership(new, slots, num_experts)
    cur_member = gpu_membership(cur, slots, num_experts)
    return np.asarray((new_member & ~cur_member).sum(axis=(1, 2)), dtype=np.int64)


def _match_gpus(overlap: NDArray[np.int64]) -> NDArray[np.int64]:
    """Assignment maximizing total overlap: ``overlap [n, n]`` (new GPU x current
    GPU) -> ``[n]`` current GPU given to each new GPU."""
    n = overlap.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    assignment = linear_sum_assignment.SimpleLinearSumAssignment()
    left = np.repeat(np.arange(n), n)
    right = np.tile(np.arange(n), n)
    assignment.add_arcs_with_cost(left, right, -overlap.ravel())
    status = assignment.solve()
    if status != assignment.OPTIMAL:  # a complete bipartite graph always has a perfect matching
        raise RuntimeError(f"linear sum assignment failed with status {status}")
    return np.array([assignment.right_mate(i) for i in range(n)], dtype=np.int64)


def _arrange_slots(new_experts: NDArray[np.int64], current_experts: NDArray[np.int64]) -> NDArray[np.int64]:
    """Order one GPU's new experts so that each one already on the GPU keeps its slot."""
    remaining = Counter(new_experts.tolist())
    out = np.full(new_experts.size, -1, dtype=np.int64)
    for slot, expert in enumerate(current_experts.tolist()):
        if remaining[expert] > 0:
            out[slot] = expert
            remaining[expert] -= 1
    rest: list[int] = []
    for expert in new_experts.tolist():
        if remaining[expert] > 0:
            rest.append(expert)
            remaining[expert] -= 1
    out[out < 0] = rest
    return out


def relabel_gpus(new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.int64]:
    """Relabel a new placement's GPUs to overlap the current placement the most.

    Per layer, whole GPUs of the new placement are permuted among GPUs with the same
    slot count (a linear assignment maximizing the number of (expert, GPU) pairs kept),
    then the slots inside each GPU are ordered so that an expert already on the GPU
    stays in its slot. Loads, replica counts and shares per expert are unchanged; only
    which GPU and which slot is which. The result never needs more moves than the input.

    Args:
        new_phy2log: ``[L, P]`` the placement to roll out.
        current_phy2log: ``[L, P]`` the placement now served.
        slots_per_gpu: ``[G]`` slots per GPU, ``sum == P``.

    Returns:
        ``[L, P]`` int64, the relabelled new placement. When per-slot data (weighted
        shares) must follow the slots, use :func:`relabel_slot_order`.
    """
    return relabel_slot_order(new_phy2log, current_phy2log, slots_per_gpu)[0]


def relabel_slot_order(
    new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Like :func:`relabel_gpus`, also returning the slot permutation.

    Returns:
        ``(relabelled [L, P], source [L, P])`` with ``relabelled[l, s] ==
        new_phy2log[l, source[l, s]]``, so per-slot data such as shares follow with
        ``np.take_along_axis(shares, source, axis=1)``.
    """
    new, cur, slots = _check(new_phy2log, current_phy2log, slots_per_gpu)
    num_layers = new.shape[0]
    num_experts = int(max(new.max(initial=-1), cur.max(initial=-1))) + 1
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
    new_member = gpu_membership(new, slots, num_experts).astype(np.int64)
    cur_member = gpu_membership(cur, slots, num_experts).astype(np.int64)
    out = np.empty_like(new)
    source = np.empty_like(new)
    for layer in range(num_layers):
        overlap = new_member[layer] @ cur_member[layer].T  # [G new, G current]
        target = np.arange(slots.size)  # target[new GPU] = label it gets
        for slot_count in np.unique(slots):
            gpus = np.flatnonzero(slots == slot_count)
            if slot_count == 0 or gpus.size == 0:
                continue
            mates = _match_gpus(overlap[np.ix_(gpus, gpus)])
            target[gpus] = gpus[mates]
        for g_new, g_cur in enumerate(target.tolist()):
            s = int(slots[g_new])
            if s == 0:
                continue
            new_slots = np.arange(starts[g_new], starts[g_new] + s)
            cur_slots = np.arange(starts[g_cur], starts[g_cur] + s)
            arranged = _arrange_slots(new[layer, new_slots], cur[layer, cur_slots])
            out[layer, cur_slots] = arranged
            # map every arranged expert back to a distinct source slot of the new GPU
            pool: dict[int, list[int]] = {}
            for slot in new_slots.tolist():
                pool.setdefault(int(new[layer, slot]), []).append(slot)
            source[layer, cur_slots] = [pool[int(e)].pop(0) for e in arranged.tolist()]
    return out, source
