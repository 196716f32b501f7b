"""Checks every solver runs on its output before returning it: an invalid placement is a bug."""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike, NDArray

MAX_LOAD = 1e15
"""The largest token count of one expert in one window (and of one step's count in a log): larger values would
overflow the solvers' and the cost model's sums of squares and products (a finite 1.7e308 made the greedy kernel
corrupt its heap). The one cap of load windows (`eplb.io.windows.check_loads`: the CLI, the service, the Python
API), logs (`eplb.io.logs.count_problem`) and every registered solver (`solvers.registry.check`)."""

EMPTY_SLOT = -1
"""phy2log value of an empty slot (vLLM's convention for slots of absent ranks): it holds no expert's weights
and serves no tokens; it still counts in slots_per_gpu."""


class InvalidPlacement(ValueError):
    """A placement that breaks an invariant (missing expert, wrong slot count, bad shares)."""


def load_refusal(loads: NDArray[np.float64], what: str = "loads",
                 show: Callable[[float], str] = repr, noun: str = "loads") -> str | None:
    """Why `loads` (a float array of any shape, [layers, E] for a window) holds no token counts, naming its first
    bad entry ('loads[0][3] is nan: loads must be finite numbers'; `show` writes the value, `noun` what the rule
    calls them): not finite, below 0 or above MAX_LOAD. None when every entry is a count. Whole-array reductions;
    a mask only on failure."""
    if not loads.size or (loads.min() >= 0 and loads.max() <= MAX_LOAD):  # NaN fails both comparisons
        return None
    for bad, rule in ((~np.isfinite(loads), f"{noun} must be finite numbers"), (loads < 0, f"{noun} must be >= 0"),
                      (loads > MAX_LOAD, f"larger than any token count (limit {MAX_LOAD:g}); scale the window down, "
                                         "a placement follows the loads' ratios, up to rounding")):
        if bad.any():
            index = tuple(int(v) for v in np.unravel_index(int(np.argmax(bad)), loads.shape))
            return f"{what}{''.join(f'[{i}]' for i in index)} is {show(float(loads[index]))}: {rule}"
    return None


def refuse_loads(loads: ArrayLike, what: str = "loads") -> None:
    """ValueError (one line, `load_refusal`'s) unless `loads` is an array of real token counts, each finite, >= 0 and
    at most MAX_LOAD: the guard a solver entry point runs before any compiled kernel sees the loads."""
    arr = np.asarray(loads)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{what} must hold real numbers (integers or floats), got dtype {arr.dtype}")
    why = load_refusal(arr.astype(np.float64, copy=False), what)
    if why is not None:
        raise ValueError(why)


def whole_number(value: object) -> int | None:
    """`value` as an int when it is an integer (int, numpy integer: `operator.index`), else None (a float, even
    2.0, as the CLI's integer flags refuse '2.0'; a bool, which is no count; anything else). The one reading of the
    Python API's counts (`eplb.solve.Cluster`, `solvers.registry.Options`, `eplb.replay.Schedule`)."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def real_number(value: object) -> bool:
    """Whether `value` is a real number a setting may be (int, float, numpy's; not a bool, a string or None)."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def slot_gpu(slots_per_gpu: NDArray[np.int64]) -> NDArray[np.int64]:
    """GPU index of every physical slot: [num_physical], slots numbered GPU by GPU."""
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    return np.repeat(np.arange(slots.size, dtype=np.int64), slots)


def replica_counts(phy2log: NDArray[np.int64], num_experts: int) -> NDArray[np.int64]:
    """Replicas of each logical expert: [layers, E] from phy2log [layers, num_physical]; empty slots (-1) hold none."""
    layers = phy2log.shape[0]
    flat = phy2log + (np.arange(layers, dtype=np.int64) * num_experts)[:, None]
    held = phy2log != EMPTY_SLOT
    return np.bincount(flat[held], minlength=layers * num_experts).reshape(layers, num_experts)


def validate_placement(
    phy2log: NDArray[np.int64],
    slots_per_gpu: NDArray[np.int64],
    num_experts: int,
    shares: NDArray[np.float64] | None = None,
) -> None:
    """Raise InvalidPlacement unless the placement is servable.

    phy2log: [layers, num_physical] logical expert in each slot, or -1 for an empty slot; slots_per_gpu: [G], each >= 1,
    summing to num_physical; shares: optional [layers, num_physical] fraction of its expert's tokens
    each slot serves (>= 0, summing to 1 over each expert's replicas).
    """
    slots = np.asarray(slots_per_gpu)
    if slots.ndim != 1 or slots.size == 0 or np.any(slots < 1):
        raise InvalidPlacement(f"slots_per_gpu must be a non-empty list of counts >= 1, got {slots.tolist()}")
    if phy2log.ndim != 2:
        raise InvalidPlacement(f"phy2log must be [layers, num_physical], got shape {phy2log.shape}")
    if phy2log.shape[0] == 0:
        raise InvalidPlacement("phy2log has no layers: a placement holds at least one MoE layer")
    if phy2log.shape[1] != int(slots.sum()):
        raise InvalidPlacement(
            f"phy2log has {phy2log.shape[1]} slots per layer but slots_per_gpu sums to {int(slots.sum())}"
        )
    if not np.issubdtype(phy2log.dtype, np.integer):
        raise InvalidPlacement(f"phy2log must hold integer expert ids, got {phy2log.dtype}")
    wrong = np.argwhere((phy2log < EMPTY_SLOT) | (phy2log >= num_experts))
    if wrong.size:
        layer, slot = (int(v) for v in wrong[0])
        raise InvalidPlacement(f"phy2log[{layer}][{slot}] is {int(phy2log[layer, slot])}: expert ids run "
                               f"0..{num_experts - 1} (-1 marks an empty slot)")
    counts = replica_counts(phy2log.astype(np.int64), num_experts)
    missing = np.argwhere(counts == 0)
    if missing.size:
        layer, expert = (int(v) for v in missing[0])
        raise InvalidPlacement(
            f"logical expert {expert} has no replica in layer {layer} ({len(missing)} missing in all)"
        )
    if shares is None:
        return
    if shares.shape != phy2log.shape:
        raise InvalidPlacement(f"shares has shape {shares.shape}, phy2log {phy2log.shape}")
    if not np.all(np.isfinite(shares)) or np.any(shares < 0):
        raise InvalidPlacement("shares must be finite and >= 0")
    held = phy2log != EMPTY_SLOT
    if np.any(shares[~held] != 0):
        layer, slot = (int(v) for v in np.argwhere(~held & (shares != 0))[0])
        raise InvalidPlacement(f"slot {slot} of layer {layer} is empty (-1) but has share {shares[layer, slot]:g}; "
                               "an empty slot serves no tokens (share 0)")
    layers = phy2log.shape[0]
    flat = phy2log.astype(np.int64) + (np.arange(layers, dtype=np.int64) * num_experts)[:, None]
    totals = np.bincount(flat[held], weights=shares[held], minlength=layers * num_experts)
    bad = np.flatnonzero(np.abs(totals - 1.0) > 1e-6)
    if bad.size:
        layer, expert = divmod(int(bad[0]), num_experts)
        raise InvalidPlacement(
            f"shares of expert {expert} in layer {layer} sum to {totals[bad[0]]:.6g}, not 1"
        )


def duplicate_count(phy2log: NDArray[np.int64], slots_per_gpu: NDArray[np.int64]) -> NDArray[np.int64]:
    """Surplus replicas per layer: for each GPU holding k > 1 replicas of one expert, k - 1 (0 when no GPU holds an
    expert twice; empty slots count as none): [layers], from phy2log [layers, P] and slots_per_gpu [G]."""
    layers, _ = phy2log.shape
    gpus = slot_gpu(slots_per_gpu)
    num_experts = int(phy2log.max()) + 1 if phy2log.size else 1
    key = (gpus[None, :] * num_experts + phy2log).astype(np.int64)
    key = np.sort(np.where(phy2log == EMPTY_SLOT, -1 - np.arange(phy2log.shape[1]), key), axis=1)  # empties differ
    return np.asarray((key[:, 1:] == key[:, :-1]).sum(axis=1), dtype=np.int64).reshape(layers)


def duplicate_free_possible(replicas: NDArray[np.int64], slots_per_gpu: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Whether some placement with these replica counts has no two replicas of one expert on one GPU: [layers],
    from replicas [layers, E] and slots_per_gpu [G] (at least the replicas in all; extra slots may stay empty).

    Gale-Ryser (max-flow min-cut on experts x GPUs, one replica per pair): such a placement exists exactly
    when, for every k, the k most replicated experts have at most sum_g min(slots_g, k) replicas.
    """
    counts = np.asarray(replicas, dtype=np.int64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    most_first = -np.sort(-counts, axis=1)
    k = np.arange(1, counts.shape[1] + 1)
    room = np.minimum(slots[None, :], k[:, None]).sum(axis=1)  # [E]: sum_g min(slots_g, k)
    return np.asarray((np.cumsum(most_first, axis=1) <= room[None, :]).all(axis=1), dtype=np.bool_)
