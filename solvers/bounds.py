"""Lower bounds on the max GPU load of any placement of one MoE layer.

Every bound here is a number of tokens ``T`` such that *every* placement of the
layer on GPUs with ``slots_per_gpu`` slots has a GPU carrying at least ``T``
tokens. They are cheap (no solver) and reported next to every placement, greedy's
included, so a user can see how far a placement is from the best possible one.

Which argument holds for which share split:

======================  =========  ==========  ==========================================
argument                uniform    weighted    reasoning
======================  =========  ==========  ==========================================
mean load               yes        yes         the GPU loads sum to the layer's tokens
hot expert (replicas)   yes        yes         an expert on r GPUs leaves >= load/r on one
smallest pieces         yes        no          uniform replicas never serve fewer tokens
                                               than load/max_replicas; weighted ones can
                                               serve nothing
======================  =========  ==========  ==========================================

A weighted placement may choose any shares, uniform ones included, so a bound valid
for weighted shares is valid for every placement; that is the default.

The solvers' rule that no GPU holds two replicas of one expert enters only through
`max_replicas_per_expert` (one replica per GPU): it can only raise the optimum, so the
bounds stay valid under it, and they hold for placements with such duplicates too (an
expert on r GPUs still leaves load/r on one of them; tests/test_bounds.py checks every
placement of small layers, duplicates included). The cap of one replica per GPU never
lifts the result above the mean bound (load/G <= total/G).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

Split = Literal["uniform", "weighted"]

__all__ = [
    "lower_bound",
    "max_replicas_per_expert",
    "mean_load_bound",
    "replication_bound",
    "smallest_pieces_bound",
]


def _check(loads: ArrayLike, slots_per_gpu: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Validate and convert ``loads [L, E]`` and ``slots_per_gpu [G]``."""
    w = np.asarray(loads, dtype=np.float64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if w.ndim != 2:
        raise ValueError(f"loads must have shape [layers, experts], got shape {w.shape}")
    if slots.ndim != 1 or slots.size == 0:
        raise ValueError(f"slots_per_gpu must be a non-empty 1-D array, got shape {slots.shape}")
    if np.any(slots < 0):
        raise ValueError("slots_per_gpu must be non-negative")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("loads must be finite and non-negative")
    if int(slots.sum()) < w.shape[1]:
        raise ValueError(f"{int(slots.sum())} slots cannot hold {w.shape[1]} experts")
    return w, slots


def max_replicas_per_expert(num_experts: int, slots_per_gpu: ArrayLike) -> int:
    """Most replicas one expert can have: one per GPU that has a slot, and every
    other expert still needs one slot, so ``min(#GPUs with slots, P - E + 1)``."""
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    return min(int(np.count_nonzero(slots)), int(slots.sum()) - num_experts + 1)


def mean_load_bound(loads: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.float64]:
    """Total tokens over the number of GPUs that hold slots, per layer: ``[L]``, tokens.

    Holds for every split: whatever the shares, the GPU loads add up to the layer's
    tokens, so the largest is at least their mean.
    """
    w, slots = _check(loads, slots_per_gpu)
    return np.asarray(w.sum(axis=1) / np.count_nonzero(slots), dtype=np.float64)


def replication_bound(loads: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.float64]:
    """Hot-expert bound per layer: ``[L]``, tokens.

    With ``r[e]`` replicas, expert ``e`` leaves at least ``loads[e] / r[e]`` tokens on
    one GPU (uniform: exactly that on each; weighted: the largest share is at least
    the mean share). Replica counts satisfy ``1 <= r[e] <= max_replicas_per_expert``
    and ``sum(r) == P``, so the bound is ``min_r max_e loads[e] / r[e]`` over those
    counts. Giving the next replica to the expert with the largest ``load / r``
    (water filling) attains that minimum, since each step lowers the current maximum
    as far as one replica can and never raises another expert's ratio. Holds for
    every split.
    """
    w, slots = _check(loads, slots_per_gpu)
    num_layers, num_experts = w.shape
    extra = int(slots.sum()) - num_experts
    cap = max_replicas_per_expert(num_experts, slots)
    replicas = np.ones((num_layers, num_experts), dtype=np.int64)
    ratio = w.copy()
    layers = np.arange(num_layers)
    active = np.ones(num_layers, dtype=bool)  # every layer at once: one argmax per replica, not per layer
    for _ in range(extra if num_experts else 0):
        hottest = np.argmax(ratio, axis=1)
        active &= replicas[layers, hottest] < cap  # at cap, the hottest ratio is final: that layer is done
        if not active.any():
            break
        rows, cols = layers[active], hottest[active]
        replicas[rows, cols] += 1
        ratio[rows, cols] = w[rows, cols] / replicas[rows, cols]
    return np.asarray(ratio.max(axis=1, initial=0.0), dtype=np.float64)


def smallest_pieces_bound(loads: ArrayLike, slots_per_gpu: ArrayLike) -> NDArray[np.float64]:
    """Slot-count bound per layer, uniform shares only: ``[L]``, tokens.

    A GPU with ``s`` slots holds ``s`` distinct experts, and under uniform shares
    each replica of ``e`` serves ``loads[e] / r[e] >= loads[e] / max_replicas`` tokens.
    So the fullest GPU carries at least the sum of the ``max(slots)`` smallest values
    of ``loads / max_replicas``. It matters for small layers where GPUs are nearly
    full of distinct experts. Does not hold for weighted shares, where a replica may
    serve no tokens at all.
    """
    w, slots = _check(loads, slots_per_gpu)
    cap = max_replicas_per_expert(w.shape[1], slots)
    fullest = int(slots.max())
    smallest = np.sort(w, axis=1)[:, :fullest] / cap
    return np.asarray(smallest.sum(axis=1), dtype=np.float64)


def lower_bound(loads: ArrayLike, slots_per_gpu: ArrayLike, *, split: Split = "weighted") -> NDArray[np.float64]:
    """Best of the bounds above per layer: ``[L]``, tokens of the fullest GPU.

    Args:
        loads: ``[L, E]`` tokens routed to each logical expert, non-negative.
        slots_per_gpu: ``[G]`` slots of each GPU; ``sum >= E``.
        split: ``"weighted"`` (default) returns a bound valid for every placement,
            whatever its shares; ``"uniform"`` adds the smallest-pieces argument,
            valid only when every replica serves ``1 / replicas`` of its expert.

    Returns:
        ``[L]`` float64: no placement (of the given split) has a smaller max GPU load.
    """
    bound = np.maximum(mean_load_bound(loads, slots_per_gpu), replication_bound(loads, slots_per_gpu))
    if split == "uniform":
        bound = np.maximum(bound, smallest_pieces_bound(loads, slots_per_gpu))
    elif split != "weighted":
        raise ValueError(f"split must be 'uniform' or 'weighted', got {split!r}")
    return bound
