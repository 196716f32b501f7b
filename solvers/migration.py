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

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["arrange_slot_order", "arrange_slots", "count_moves", "gpu_membership", "relabel_gpus", "relabel_slot_order"]


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


def _occurrence(key: NDArray[np.int64]) -> NDArray[np.int64]:
    """For each entry of the flat ``key``, how many equal keys come before it (0 for the first): so the
    first of several replicas of an expert on a GPU keeps its slot, as vLLM expects."""
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.flatnonzero(np.concatenate([[True], sorted_key[1:] != sorted_key[:-1]]))
    run_start = np.repeat(first, np.diff(np.append(first, key.size)))
    occ = np.empty_like(key)
    occ[order] = np.arange(key.size) - run_start
    return occ


def _gpu_occurrence(key: NDArray[np.int64], p2l: NDArray[np.int64], slots: NDArray[np.int64]) -> NDArray[np.int64]:
    """`_occurrence` of flat (layer, GPU, expert) keys of placement p2l [L, P]: all zeros, without a sort of
    every key, when no GPU holds an expert twice (the rule every solver keeps where it can), checked by
    sorting each GPU's few slots when all GPUs have the same slot count."""
    if np.all(slots == slots[0]):
        per_gpu = np.sort(p2l.reshape(-1, int(slots[0])), axis=1)
        if not (per_gpu[:, 1:] == per_gpu[:, :-1]).any():
            return np.zeros_like(key)
    return _occurrence(key)


def _overlap(
    new: NDArray[np.int64], cur: NDArray[np.int64], gpu: NDArray[np.int64], num_gpus: int, num_experts: int,
    slots: NDArray[np.int64],
) -> NDArray[np.int64]:
    """``[L, G new, G current]`` experts the two GPUs have in common (as sets), all layers at once:
    every (new replica, current replica) pair of one expert in one layer is counted once per GPU pair."""
    num_layers, num_physical = new.shape
    layer = np.repeat(np.arange(num_layers), num_physical)
    gpus = np.tile(gpu, num_layers)
    new_e, cur_e = new.ravel(), cur.ravel()
    # one entry per (layer, GPU, expert): a GPU holding two replicas of an expert holds it once as a set
    new_first = _gpu_occurrence((layer * num_gpus + gpus) * num_experts + new_e, new, slots) == 0
    cur_first = np.flatnonzero(_gpu_occurrence((layer * num_gpus + gpus) * num_experts + cur_e, cur, slots) == 0)
    # current GPUs of each (layer, expert), padded: [L * E, R]
    expert_key = layer[cur_first] * num_experts + cur_e[cur_first]
    rank = _occurrence(expert_key)
    holders = np.full((num_layers * num_experts, int(rank.max()) + 1), -1, dtype=np.int64)
    holders[expert_key, rank] = gpus[cur_first]
    lookup = holders[layer[new_first] * num_experts + new_e[new_first]]  # [N, R]
    pair = ((layer[new_first] * num_gpus + gpus[new_first])[:, None] * num_gpus + lookup)[lookup >= 0]
    counts = np.bincount(pair, minlength=num_layers * num_gpus * num_gpus)
    return counts.reshape(num_layers, num_gpus, num_gpus).astype(np.int64)


def _match_all(overlap: NDArray[np.int64], slots: NDArray[np.int64]) -> NDArray[np.int64]:
    """``target [L, G]``: the current GPU each new GPU becomes, maximizing the total overlap per layer
    among GPUs with the same slot count. Layers where every new GPU's best current GPU is a distinct one
    take that (it is optimal); the others are solved exactly (scipy's linear sum assignment, one per
    layer and slot count, tens of microseconds each)."""
    num_gpus = overlap.shape[1]
    uniform = bool(np.all(slots == slots[0]))
    masked = overlap if uniform else np.where((slots[:, None] == slots[None, :])[None], overlap, -1)
    target = np.asarray(np.argmax(masked, axis=2), dtype=np.int64)
    if num_gpus == 1:
        return target
    ordered = np.sort(target, axis=1)
    collided = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if collided.size == 0:
        return target
    from scipy.optimize import linear_sum_assignment  # imported on demand: it costs ~0.3 s at start-up

    classes = [np.flatnonzero(slots == s) for s in np.unique(slots)]
    for layer in collided.tolist():
        for gpus in classes:
            rows, cols = linear_sum_assignment(overlap[layer][np.ix_(gpus, gpus)], maximize=True)
            target[layer, gpus[rows]] = gpus[cols]
    return target


def _match_nodes(overlap: NDArray[np.int64], slots: NDArray[np.int64], gpus_per_node: int) -> NDArray[np.int64]:
    """Like :func:`_match_all`, but whole nodes move together so expert groups stay within nodes: per layer,
    nodes with the same slot layout are matched on their summed GPU overlap, then GPUs within each matched
    pair of nodes (exact assignments both; the node step maximizes a proxy of the kept pairs)."""
    from scipy.optimize import linear_sum_assignment  # imported on demand: it costs ~0.3 s at start-up

    num_layers, num_gpus, _ = overlap.shape
    num_nodes = num_gpus // gpus_per_node
    layout = slots.reshape(num_nodes, gpus_per_node)
    _, node_class = np.unique(layout, axis=0, return_inverse=True)
    node_overlap = overlap.reshape(num_layers, num_nodes, gpus_per_node, num_nodes, gpus_per_node).sum(axis=(2, 4))
    classes = [np.flatnonzero(node_class.ravel() == c) for c in np.unique(node_class)]
    target = np.empty((num_layers, num_gpus), dtype=np.int64)
    for layer in range(num_layers):
        for nodes in classes:
            rows, cols = linear_sum_assignment(node_overlap[layer][np.ix_(nodes, nodes)], maximize=True)
            for a, b in zip(nodes[rows].tolist(), nodes[cols].tolist(), strict=True):
                first_a, first_b = a * gpus_per_node, b * gpus_per_node
                block = overlap[layer, first_a : first_a + gpus_per_node, first_b : first_b + gpus_per_node]
                for gpus in (np.flatnonzero(layout[a] == count) for count in np.unique(layout[a])):
                    r, c = linear_sum_assignment(block[np.ix_(gpus, gpus)], maximize=True)
                    target[layer, first_a + gpus[r]] = first_b + gpus[c]
    return target


def relabel_gpus(
    new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike, gpus_per_node: int | None = None
) -> NDArray[np.int64]:
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
        gpus_per_node: for hierarchical placements: GPUs only move with their whole node (nodes are runs of
            this many GPUs), so expert groups kept within nodes stay so.

    Returns:
        ``[L, P]`` int64, the relabelled new placement. When per-slot data (weighted
        shares) must follow the slots, use :func:`relabel_slot_order`.
    """
    return relabel_slot_order(new_phy2log, current_phy2log, slots_per_gpu, gpus_per_node)[0]


def relabel_slot_order(
    new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike, gpus_per_node: int | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Like :func:`relabel_gpus`, also returning the slot permutation.

    Returns:
        ``(relabelled [L, P], source [L, P])`` with ``relabelled[l, s] ==
        new_phy2log[l, source[l, s]]``, so per-slot data such as shares follow with
        ``np.take_along_axis(shares, source, axis=1)``.
    """
    new, cur, slots = _check(new_phy2log, current_phy2log, slots_per_gpu)
    if new.size == 0:
        return new.copy(), np.broadcast_to(np.arange(new.shape[1]), new.shape).copy()
    num_experts = int(max(new.max(), cur.max())) + 1
    gpu = np.repeat(np.arange(slots.size), slots)
    overlap = _overlap(new, cur, gpu, slots.size, num_experts, slots)
    if gpus_per_node is not None and slots.size % gpus_per_node == 0 and slots.size > gpus_per_node:
        return _arrange(new, cur, slots, _match_nodes(overlap, slots, gpus_per_node), num_experts)
    return _arrange(new, cur, slots, _match_all(overlap, slots), num_experts)


def arrange_slots(new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.int64]:
    """Reorder the slots inside each GPU (GPUs keep their labels) so that every expert a GPU keeps stays
    in its current slot: ``[L, P]``. For placements already aligned with the current one (incremental)."""
    return arrange_slot_order(new_phy2log, current_phy2log, slots_per_gpu)[0]


def arrange_slot_order(
    new_phy2log: ArrayLike, current_phy2log: ArrayLike, slots_per_gpu: ArrayLike
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Like :func:`arrange_slots`, also returning the slot permutation ``source [L, P]`` (as
    :func:`relabel_slot_order`), so per-slot data such as shares follow their slots."""
    new, cur, slots = _check(new_phy2log, current_phy2log, slots_per_gpu)
    if new.size == 0:
        return new.copy(), np.broadcast_to(np.arange(new.shape[1]), new.shape).copy()
    identity = np.broadcast_to(np.arange(slots.size), (new.shape[0], slots.size))
    return _arrange(new, cur, slots, identity, int(max(new.max(), cur.max())) + 1)


def _arrange(
    new: NDArray[np.int64], cur: NDArray[np.int64], slots: NDArray[np.int64], target: NDArray[np.int64],
    num_experts: int,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """New GPU g becomes GPU ``target[l, g]``; experts kept on a GPU keep their current slot, the others
    fill its free slots in order. Returns (relabelled [L, P], source [L, P])."""
    num_layers, num_physical = new.shape
    num_gpus = target.shape[1]
    gpu = np.repeat(np.arange(num_gpus), slots)
    layer = np.arange(num_layers)[:, None]
    new_gpu = target[layer, gpu[None, :]]  # [L, P] label each new slot's GPU gets
    # (layer, GPU, expert, occurrence) keys: a current slot whose key the new placement also has keeps its expert
    base_new = ((layer * num_gpus + new_gpu) * num_experts + new).ravel()
    base_cur = ((layer * num_gpus + gpu[None, :]) * num_experts + cur).ravel()
    key_new = base_new * num_physical + _gpu_occurrence(base_new, new, slots)
    key_cur = base_cur * num_physical + _gpu_occurrence(base_cur, cur, slots)
    order_new = np.argsort(key_new)
    pos = np.searchsorted(key_new[order_new], key_cur).clip(max=key_new.size - 1)
    kept = key_new[order_new[pos]] == key_cur
    out = np.empty(new.size, dtype=np.int64)
    source = np.empty(new.size, dtype=np.int64)
    out[kept] = cur.ravel()[kept]
    source[kept] = order_new[pos[kept]]
    taken = np.zeros(new.size, dtype=bool)
    taken[order_new[pos[kept]]] = True
    # the other new replicas fill the free slots of their GPU in slot order (both sides sorted by layer, GPU)
    rest = np.flatnonzero(~taken)
    rest = rest[np.argsort((layer * num_gpus + new_gpu).ravel()[rest], kind="stable")]
    free = np.flatnonzero(~kept)
    out[free] = new.ravel()[rest]
    source[free] = rest
    return out.reshape(new.shape), (source % num_physical).reshape(new.shape)
