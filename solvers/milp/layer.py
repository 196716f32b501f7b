"""One layer's problem in integer model units, and a complete placement of it (`State`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from solvers.bounds import max_replicas_per_expert
from solvers.migration import gpu_membership

Split = Literal["uniform", "weighted"]
FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

SCALE_TARGET = 1e7
"""Integer units per mean GPU load: the rounding error per replica is below one unit,
so a GPU's load is off by less than ``slots / 1e7`` relative."""


@dataclass(frozen=True)
class LayerData:
    """One layer's problem, loads also in integer model units.

    ``w [E]`` tokens per expert; ``slots [G]``; ``scale`` model units per token;
    ``per_replica [E, K]`` uniform per-replica units ``floor(w[e] * scale / k)`` in
    column ``k - 1``; ``expert_units [E]`` = ``floor(w * scale)`` (weighted);
    ``rounding_units`` = ``max(slots)``: a GPU's model load is within that many units
    of ``scale`` x its exact load; ``bound_tokens`` a lower bound on the max GPU load;
    ``current [E, G]`` the current placement's membership, or None.
    """

    w: FloatArray
    slots: IntArray
    split: Split
    scale: float
    max_replicas: int
    per_replica: IntArray
    expert_units: IntArray
    rounding_units: int
    bound_tokens: float
    current: BoolArray | None

    @property
    def num_experts(self) -> int:
        return int(self.w.size)

    @property
    def num_gpus(self) -> int:
        return int(self.slots.size)


def layer_data(
    w: FloatArray, slots: IntArray, split: Split, bound_tokens: float, current_phy2log: IntArray | None
) -> LayerData:
    """The model data of one layer: ``w [E]`` tokens, ``slots [G]``, ``current_phy2log [P]`` or None."""
    mean = float(w.sum()) / slots.size
    scale = SCALE_TARGET / mean if mean > 0 else 1.0
    max_replicas = max_replicas_per_expert(w.size, slots)
    ks = np.arange(1, max_replicas + 1)
    return LayerData(
        w=w,
        slots=slots,
        split=split,
        scale=scale,
        max_replicas=max_replicas,
        per_replica=np.floor(w[:, None] * scale / ks[None, :]).astype(np.int64),
        expert_units=np.floor(w * scale).astype(np.int64),
        rounding_units=int(slots.max()),
        bound_tokens=bound_tokens,
        current=None if current_phy2log is None else membership(current_phy2log, slots, w.size),
    )


@dataclass(frozen=True)
class State:
    """A complete placement of one layer: ``member [E, G]`` bool and ``amounts [E, G]``,
    the model units expert e puts on GPU g (uniform pieces or weighted ``f``)."""

    member: BoolArray
    amounts: IntArray


def membership(phy2log: IntArray, slots: IntArray, num_experts: int) -> BoolArray:
    """``[E, G]`` bool of one layer's ``phy2log [P]``: expert e has a replica on GPU g."""
    return np.asarray(gpu_membership(phy2log[None, :], slots, num_experts)[0].T)


def start_membership(data: LayerData, phy2log: IntArray) -> BoolArray:
    """``[E, G]`` membership of a warm start ``phy2log [P]``; a second replica of an expert on one
    GPU (which the model cannot express) is replaced by the absent expert with the most load per replica."""
    member = membership(phy2log, data.slots, data.num_experts)
    for g in np.flatnonzero(member.sum(axis=0) < data.slots).tolist():
        while member[:, g].sum() < data.slots[g]:
            per_replica = data.w / np.maximum(member.sum(axis=1), 1)
            per_replica[member[:, g]] = -np.inf
            member[int(np.argmax(per_replica)), g] = True
    return member


def split_units(units: int, parts: FloatArray) -> IntArray:
    """Integers >= 0 proportional to ``parts [n]`` (summing to 1) that add up to ``units``."""
    raw = parts * units
    out = np.floor(raw).astype(np.int64)
    short = units - int(out.sum())
    if short > 0:
        out[np.argsort(-(raw - out), kind="stable")[:short]] += 1
    return out


def uniform_amounts(data: LayerData, member: BoolArray) -> IntArray:
    """``[E, G]`` model units per (expert, GPU) under uniform shares."""
    replicas = member.sum(axis=1)
    q = data.per_replica[np.arange(data.num_experts), np.clip(replicas, 1, data.max_replicas) - 1]
    return np.asarray(member * q[:, None], dtype=np.int64)


def state_from(data: LayerData, member: BoolArray, share_eg: FloatArray | None = None) -> State:
    """State of a placement ``member [E, G]``; weighted amounts follow ``share_eg [E, G]`` (None: uniform)."""
    if data.split == "uniform":
        return State(member, uniform_amounts(data, member))
    amounts = np.zeros(member.shape, dtype=np.int64)
    for e in range(data.num_experts):
        gpus = np.flatnonzero(member[e])
        parts = np.full(gpus.size, 1.0 / gpus.size) if share_eg is None else share_eg[e, gpus]
        total = parts.sum()
        parts = parts / total if total > 0 else np.full(gpus.size, 1.0 / gpus.size)
        amounts[e, gpus] = split_units(int(data.expert_units[e]), parts)
    return State(member, amounts)


def state_shares(data: LayerData, state: State) -> FloatArray:
    """``[E, G]`` fraction of expert e's tokens served on GPU g in a state."""
    replicas = np.maximum(state.member.sum(axis=1), 1)
    uniform = state.member / replicas[:, None]
    if data.split == "uniform":
        return np.asarray(uniform, dtype=np.float64)
    units = data.expert_units[:, None].astype(np.float64)
    weighted = state.amounts / np.where(units > 0, units, 1.0)
    return np.asarray(np.where(units > 0, weighted, uniform), dtype=np.float64)


def true_loads(data: LayerData, state: State) -> FloatArray:
    """``[G]`` exact tokens per GPU of a state."""
    return np.asarray(data.w @ state_shares(data, state), dtype=np.float64)


def copies(data: LayerData, state: State) -> int:
    """(expert, GPU) pairs of the state absent from the current placement (labels as is)."""
    if data.current is None:
        return 0
    return int((state.member & ~data.current).sum())


def phy2log_of(data: LayerData, state: State) -> IntArray:
    """``phy2log [P]`` of a state: each GPU's experts in id order, GPU by GPU."""
    return np.concatenate([np.flatnonzero(state.member[:, g]) for g in range(data.num_gpus)]).astype(np.int64)


def slot_shares(data: LayerData, phy2log: IntArray, share_eg: FloatArray) -> FloatArray:
    """``[P]`` share of each slot of ``phy2log [P]`` from ``share_eg [E, G]``."""
    return np.asarray(share_eg[phy2log, np.repeat(np.arange(data.num_gpus), data.slots)], dtype=np.float64)
