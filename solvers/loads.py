"""GPU loads of a placement: the one implementation, numpy only (no solver imports)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]

__all__ = ["gpu_loads", "max_gpu_loads"]


def gpu_loads(
    loads: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, shares: ArrayLike | None = None
) -> FloatArray:
    """Tokens each GPU serves: ``[L, G]``.

    loads: ``[L, E]`` tokens per logical expert; phy2log: ``[L, P]`` expert in each slot (GPU by GPU);
    slots_per_gpu: ``[G]`` slots per GPU, each >= 1, summing to P; shares: ``[L, P]`` fraction of its
    expert's tokens each slot serves, or None for uniform shares (``1 / replicas``).
    """
    w = np.asarray(loads, dtype=np.float64)
    p2l = np.asarray(phy2log, dtype=np.int64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    num_layers, num_experts = w.shape
    if shares is None:
        flat = p2l + (np.arange(num_layers) * num_experts)[:, None]
        replicas = np.bincount(flat.ravel(), minlength=num_layers * num_experts).reshape(w.shape)
        per_slot = np.take_along_axis(w / np.maximum(replicas, 1), p2l, axis=1)
    else:
        per_slot = np.take_along_axis(w, p2l, axis=1) * np.asarray(shares, dtype=np.float64)
    if per_slot.shape[1] == 0:
        return np.zeros((num_layers, slots.size), dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
    return np.asarray(np.add.reduceat(per_slot, starts, axis=1), dtype=np.float64)


def max_gpu_loads(
    loads: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, shares: ArrayLike | None = None
) -> FloatArray:
    """Max GPU load per layer, tokens: ``[L]`` (see :func:`gpu_loads`)."""
    return np.asarray(gpu_loads(loads, phy2log, slots_per_gpu, shares).max(axis=1), dtype=np.float64)
