"""Turning a memory budget or a redundancy count into expert slots per GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, FieldError
from eplb.io.files import number_text, plural, real_array
from eplb.rules import BUDGETS, CLI_MAX_GPUS, gpu_count_mismatch

if TYPE_CHECKING:
    from eplb.schemas import ClusterRules

GIB = 1024**3

QUANTITIES = {"num_gpus": "the GPU count", "slots": "slots per GPU", "num_redundant": "redundant experts",
              "memory_budget_bytes": "memory budget"}  # fmt: skip
"""What `slots_per_gpu`'s messages call its arguments by default (the Python API, the service); the CLI names
its flags instead (`eplb.cli.solve.BUDGET_FLAGS`)."""


def describe_slots(slots: NDArray[np.int64]) -> str:
    """One short phrase for slots per GPU [G]: "32 GPUs, 9 slots each", "100 GPUs, 1 slot each", "1 GPU, 9 slots
    each" or "32 GPUs, 8-10 slots each"."""
    lo, hi = int(slots.min()), int(slots.max())
    each = plural(lo, "slot") if lo == hi else f"{lo:,}-{hi:,} slots"
    return f"{plural(slots.size, 'GPU')}, {each} each"


def slots_beyond_experts(slots: NDArray[np.int64], num_experts: int) -> str | None:
    """Why slots per GPU [G] are more than a window of `num_experts` experts can use (a GPU with more slots than
    experts), or None: the rule of every cluster, from a budget (`slots_per_gpu`) or given (`eplb.solve.Cluster`);
    it also bounds what a solve allocates (slots x layers)."""
    most = int(slots.max())
    if most <= num_experts:
        return None
    return (f"{most:,} slots on one GPU but only {num_experts} experts: a GPU never needs more slots than there are "
            "experts (extra slots would only hold a second copy on the same GPU)")


def slot_counts(value: Any, what: str = "slots_per_gpu") -> NDArray[np.int64]:
    """Slots per GPU [G] int64 from a list, tuple or array of whole numbers >= 1 (3.0 is 3, 3.7 is refused), one per
    GPU, at most CLI_MAX_GPUS of them; EplbError naming `what` and the first bad value otherwise."""
    arr = real_array(value, what, f"{what} must be whole slot counts, one per GPU")
    if arr.ndim != 1 or arr.size == 0:
        raise EplbError(f"{what} must list one slot count per GPU (a 1-D list of at least one), got shape "
                        f"{list(arr.shape)}")
    if arr.size > CLI_MAX_GPUS:
        raise EplbError(f"{what} lists {arr.size:,} GPUs: at most {CLI_MAX_GPUS:,}")
    finite, most = np.isfinite(arr), np.iinfo(np.int32).max
    for bad, rule in ((~finite | (np.mod(np.where(finite, arr, 0), 1) != 0), "slot counts are whole numbers"),
                      (arr < 1, "every GPU needs at least one slot"),
                      (arr > most, f"more slots than any GPU holds (at most {most:,})")):
        if bad.any():
            i = int(np.argmax(bad))
            raise EplbError(f"{what}[{i}] is {number_text(arr[i])}: {rule}")
    return arr.astype(np.int64)


def spread_evenly(total: int, num_gpus: int) -> NDArray[np.int64]:
    """total slots over num_gpus GPUs as evenly as possible, the first GPUs taking the remainder: [G]."""
    base, extra = divmod(total, num_gpus)
    return np.asarray([base + 1] * extra + [base] * (num_gpus - extra), dtype=np.int64)


def slots_per_gpu(
    num_gpus: int,
    num_experts: int,
    *,
    slots: int | Sequence[int] | None = None,
    num_redundant: int | None = None,
    memory_budget_bytes: float | Sequence[float] | None = None,
    slot_bytes: float | None = None,
    names: Mapping[str, str] | None = None,
) -> NDArray[np.int64]:
    """Slots on each GPU from exactly one of: a slot count (one or one per GPU), a number of redundant
    experts (spread evenly), or a memory budget in bytes (one or one per GPU) with `slot_bytes`, the bytes
    of one expert slot across all MoE layers. None of them: one redundant expert per GPU as the GPUs allow (none on
    a single GPU, whose E slots hold every expert once), or with more GPUs than experts one slot per GPU (as
    DeepSeek-V3's EP320 decode: E + G slots would leave GPUs with 1 and 2).
    Raises EplbError when the cluster cannot hold every expert at least once. names: what the messages call
    the arguments num_gpus, slots, num_redundant and memory_budget_bytes (the CLI: its flags); by default
    `QUANTITIES`, the quantities.
    """
    name = {**QUANTITIES, **(names or {})}

    def lead(key: str | None) -> str:  # a message about a value names the flag that gave it
        return f"{names[key]}: " if names and key is not None and key in names else ""

    given = [x is not None for x in (slots, num_redundant, memory_budget_bytes)]
    if sum(given) > 1:
        raise EplbError("give only one of " + (", ".join(name[k] for k in ("slots", "num_redundant",
                        "memory_budget_bytes")) if names else "slots per GPU, redundant experts, or a memory budget"))
    if num_gpus < 1:
        raise EplbError(f"{name['num_gpus']} must be at least 1, got {num_gpus}")
    source = "slots" if slots is not None else "num_redundant" if num_redundant is not None else None
    if slots is not None:
        out = _per_gpu(slots, num_gpus, name["slots"]).astype(np.int64)
        if np.any(out < 1):
            raise EplbError(f"{lead('slots')}every GPU needs at least one expert slot")
    elif memory_budget_bytes is not None:
        if slot_bytes is None or slot_bytes <= 0:
            raise EplbError("a memory budget needs the model's bytes per expert slot (give --model)")
        budget = _per_gpu(memory_budget_bytes, num_gpus, name["memory_budget_bytes"], integer=False)
        out = np.floor(budget / slot_bytes + 1e-9).astype(np.int64)
        if np.any(out < 1):
            g = int(np.argmin(out))
            raise EplbError(
                f"{lead('memory_budget_bytes')}a budget of {budget[g] / GIB:.2f} GiB on GPU {g} fits no expert: one "
                f"expert slot across all MoE layers takes {slot_bytes / GIB:.2f} GiB"
            )
        if int(out.sum()) < num_experts:
            need = np.ceil(num_experts / num_gpus) * slot_bytes / GIB
            lo, hi = budget.min() / GIB, budget.max() / GIB
            budgets = (f"a budget of {lo:.2f} GiB per GPU fits" if f"{lo:.2f}" == f"{hi:.2f}" else
                       f"budgets of {lo:.2f}-{hi:.2f} GiB per GPU ({budget.sum() / GIB:.2f} GiB in all) fit")
            raise EplbError(
                f"{lead('memory_budget_bytes')}{budgets} {int(out.sum())} expert slots in all, fewer than the "
                f"{num_experts} experts; give at least {need:.2f} GiB per GPU ({slot_bytes / GIB:.2f} GiB per slot) "
                "or more GPUs"
            )
    else:
        fewest, most = max(0, num_gpus - num_experts), num_experts * (num_gpus - 1)  # every GPU a slot; <= E each
        default = min(num_gpus, most) if num_gpus <= num_experts else num_gpus - num_experts  # 1 GPU: none
        redundant = default if num_redundant is None else int(num_redundant)
        if redundant < 0:
            raise EplbError(f"{name['num_redundant']} must be >= 0, got {redundant}")
        if redundant < fewest:
            raise EplbError(f"{lead(source)}{num_experts} experts + {redundant} redundant leave some of the "
                            f"{num_gpus} GPUs without a slot: give at least {fewest} redundant experts")
        if redundant > most:  # checked before spreading: a huge count would not fit an int64
            put = "redundant expert puts" if redundant == 1 else "redundant experts put"
            where = "the one GPU" if num_gpus == 1 else f"some of the {num_gpus} GPUs"
            raise EplbError(
                f"{lead(source)}{redundant} {put} more than {num_experts} slots (one per expert) on {where}: give at "
                f"most {most} redundant experts (extra slots would only hold a second copy on the same GPU)"
            )
        out = spread_evenly(num_experts + redundant, num_gpus)
    if memory_budget_bytes is not None:
        out = np.minimum(out, num_experts)  # a GPU never needs more slots than there are experts
    elif (beyond := slots_beyond_experts(out, num_experts)) is not None:
        raise EplbError(f"{lead(source)}{beyond}")
    if int(out.sum()) < num_experts:
        raise EplbError(
            f"{lead(source)}{int(out.sum())} slots in all cannot hold {num_experts} experts: need at least "
            f"{-(-num_experts // num_gpus)} slots per GPU on {num_gpus} GPUs"
        )
    return out


def cluster_slots(cluster: ClusterRules, num_experts: int, slot_bytes: float | None) -> NDArray[np.int64]:
    """Slots per GPU [G] of a cluster of the service's JSON (POST /placement's, a deployment's:
    `eplb.schemas.ClusterRules`) for `num_experts` experts of `slot_bytes` bytes per slot (None: no model);
    `slots_per_gpu`'s refusal as a FieldError naming the budget it came from (`cluster.slots_per_gpu`,
    `cluster.num_redundant`, `cluster.memory_budget_bytes`; `cluster` when none is given)."""
    given = next((name for name in BUDGETS if getattr(cluster, name) is not None), None)
    try:
        return slots_per_gpu(cluster.num_gpus, num_experts, slots=cluster.slots_per_gpu,
                             num_redundant=cluster.num_redundant, memory_budget_bytes=cluster.memory_budget_bytes,
                             slot_bytes=slot_bytes)  # fmt: skip
    except EplbError as exc:
        raise FieldError("cluster" if given is None else f"cluster.{given}", str(exc)) from None


def _per_gpu(value: float | Sequence[float], num_gpus: int, what: str, integer: bool = True) -> NDArray[np.float64]:
    arr = np.asarray(value, dtype=np.float64).reshape(-1)
    one = arr.size == 1
    if one:
        arr = np.full(num_gpus, arr[0])
    wrong = gpu_count_mismatch(arr.size, num_gpus)
    if wrong is not None:
        raise EplbError(f"{what}: {wrong}")
    bad = ~np.isfinite(arr) | (arr < 0)
    rule = "must be finite and >= 0"
    if integer and not bad.any():
        bad, rule = np.mod(arr, 1) != 0, "must be whole numbers"
    if bad.any():  # the first bad value, a budget in GiB (the CLI's unit, and the other messages')
        i = int(np.argmax(bad))
        given = number_text(arr[i]) if integer else number_text(arr[i] / GIB) + " GiB" * bool(np.isfinite(arr[i]))
        raise EplbError(f"{what} {rule}, got {given}" + ("" if one else f" for GPU {i}"))
    return arr
