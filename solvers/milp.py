"""Exact expert placement with OR-Tools CP-SAT: balance, weighted shares, migration.

One layer's problem, for ``E`` logical experts with loads ``w[e]`` (tokens) and ``G``
GPUs with ``slots[g]`` slots (``P = sum(slots)``):

Balance (uniform shares, what serving systems route today)::

    x[e, g] in {0, 1}                 expert e has a replica on GPU g (at most one per GPU)
    r[e] = sum_g x[e, g] >= 1         replica count, chosen jointly with the placement
    sum_e x[e, g] == slots[g]         every slot holds an expert
    load[g] = sum_e x[e, g] w[e] / r[e] <= T,     minimize T

``w[e] / r[e]`` is linearized with a one-hot ``z[e, k]`` ("e has k replicas") and an
integer ``piece[e, g]`` that equals the per-replica load ``q[e, k] = w[e] / k`` when
``x[e, g]`` and 0 otherwise (CP-SAT enforcement literals). Loads are scaled to integer
token units (about ``_SCALE_TARGET`` units per mean GPU load) and rounded down, so the
model never overstates a load; every objective reported is recomputed exactly from the
float loads, and every reported bound is corrected for the rounding.

Weighted shares (``split="weighted"``): the replicas of an expert serve unequal parts
``f[e, g] >= 0`` of its tokens, ``f[e, g] <= w[e] x[e, g]``, ``sum_g f[e, g] == w[e]``.
A serving system needs weighted replica selection (route to replica i with probability
``share[i]``) to realise it; with uniform routing use the balance model.

Migration (``current_phy2log`` given): after the balance solve, a second solve minimizes
the number of (expert, GPU) pairs absent from the current placement -- expert weights
copied onto a GPU -- subject to ``max load <= (1 + max_lb_slack) * best max load found``.

How a layer is solved (all models are the one :func:`build_model` builds, either whole
or restricted to a neighbourhood: a few GPUs free, the rest fixed):

* tiny layers (``E * G <= 64``): the full model, proven optimal in milliseconds;
* small layers (``<= 512`` pairs): neighbourhood search, then the full model hinted
  with its result, to prove optimality or improve;
* large layers (DeepSeek-V3: 256 x 32): neighbourhood search (LNS) with CP-SAT solving
  each neighbourhood exactly, including its experts' replica counts. Measured on
  256 x 32 x 9 slots: the full model spends about a second in presolve and then
  barely moves from greedy (1.0085 -> 1.0083 in 2 s), while 2-GPU neighbourhoods
  solve in about 15 ms each and reach 1.002 in 1 s. Its root bound is the mean load,
  which :mod:`solvers.bounds` gives for free.
* weighted, large: the search runs on uniform loads and an LP (MathOpt, GLOP) sets
  the final shares; weighted neighbourhoods stall because equal shares make many GPUs
  tie at the max.
* migration: the current placement is repaired (overload above the cap removed at
  the fewest copies) rather than the balanced one trimmed: measured 5-8x fewer copies.

:func:`solve_milp` runs layers in parallel in a process pool, warm-starts every solve
from the greedy placement (so the answer is never worse than greedy), honours per-layer
and per-request time limits and falls back to greedy when nothing is found in time.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from ortools.sat.python import cp_model

from solvers.bounds import lower_bound, max_replicas_per_expert
from solvers.migration import count_moves, gpu_membership, relabel_slot_order
from solvers.registry import Capabilities, Options, Problem, Solution, Solver
from solvers.validation import validate_placement

Split = Literal["uniform", "weighted"]
LayerStatus = Literal["optimal", "feasible", "time_limit", "greedy_fallback"]
FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

__all__ = [
    "LayerStatus",
    "MilpResult",
    "available_cores",
    "gpu_loads",
    "lp_shares",
    "max_gpu_loads",
    "shutdown_pools",
    "solve_milp",
]

_SCALE_TARGET = 1e7
"""Integer units per mean GPU load: the rounding error per replica is below one unit,
so a GPU's load is off by less than ``slots / 1e7`` relative."""
_READBACK_MARGIN_S = 0.02
"""Time kept back from the solver for reading the solution and validating it."""
_MIN_SOLVE_S = 0.02
"""Below this much time left, skip the solver and return the warm start."""
_MIGRATION_BALANCE_FRACTION = 0.3
"""Share of a layer's time spent on the balance solve when migration follows."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MilpResult:
    """What :func:`solve_milp` returns, every array indexed by layer first.

    Attributes:
        phy2log: ``[L, P]`` int64, logical expert in each physical slot.
        shares: ``[L, P]`` float64 fraction of its expert's tokens each slot serves
            (summing to 1 per expert per layer), or None for uniform shares.
        status: per layer, ``"optimal"`` (proven, or equal to the bound), ``"feasible"``
            (stopped before the time limit: within 1e-6 of the bound, or the solver
            ended without a proof), ``"time_limit"`` (stopped by the time limit with its
            best placement, possibly greedy's warm start) or ``"greedy_fallback"`` (no
            solver placement in time, or a worker failed: greedy's placement). With
            ``current_phy2log`` it is the status of the copy-minimizing solve
            (``"optimal"``: no placement within the load cap needs fewer copies).
        objective: ``[L]`` max GPU load of the returned placement, tokens.
        bound: ``[L]`` lower bound on the max GPU load of any placement of that split,
            tokens: the best of the solver's proven bound and :mod:`solvers.bounds`.
        gap: ``[L]`` ``(objective - bound) / objective`` (0 when both are 0).
        wall_ms: ``[L]`` wall time spent on each layer, milliseconds.
        greedy_objective: ``[L]`` max GPU load of the greedy placement, tokens.
        moves: ``[L]`` expert weights copied onto GPUs from ``current_phy2log``, after
            relabelling, or None when no current placement was given.
        lb: ``[L]`` load-balance factor, ``objective`` / mean GPU load (1 for an empty layer).
        total_wall_ms: wall time of the whole call, milliseconds.
    """

    phy2log: IntArray
    shares: FloatArray | None
    status: list[LayerStatus]
    objective: FloatArray
    bound: FloatArray
    gap: FloatArray
    wall_ms: FloatArray
    greedy_objective: FloatArray
    moves: IntArray | None
    lb: FloatArray
    total_wall_ms: float


def gpu_loads(
    loads: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, shares: ArrayLike | None = None
) -> FloatArray:
    """Tokens each GPU serves: ``[L, G]`` from ``loads [L, E]``, ``phy2log [L, P]``,
    ``slots_per_gpu [G]`` and optional ``shares [L, P]`` (default: uniform,
    ``1 / replicas`` per slot)."""
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
    gpu_of_slot = np.repeat(np.arange(slots.size), slots)
    out = np.zeros((num_layers, slots.size), dtype=np.float64)
    np.add.at(out, (np.arange(num_layers)[:, None], gpu_of_slot[None, :]), per_slot)
    return out


def max_gpu_loads(
    loads: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, shares: ArrayLike | None = None
) -> FloatArray:
    """Max GPU load per layer, tokens: ``[L]`` (see :func:`gpu_loads`)."""
    return np.asarray(gpu_loads(loads, phy2log, slots_per_gpu, shares).max(axis=1), dtype=np.float64)


# --------------------------------------------------------------------------- one layer: data and state


@dataclass(frozen=True)
class _LayerData:
    """One layer's problem, loads also in integer model units.

    ``w [E]`` tokens per expert; ``slots [G]``; ``scale`` model units per token;
    ``per_replica [E, K]`` uniform per-replica units ``floor(w[e] * scale / k)`` in
    column ``k - 1``; ``expert_units [E]`` = ``floor(w * scale)`` (weighted);
    ``rounding_units`` = ``max(slots)``: a GPU's model load is within that many units
    of ``scale`` x its exact load; ``current [E, G]`` the current placement's membership.
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
    current: NDArray[np.bool_] | None

    @property
    def num_experts(self) -> int:
        return int(self.w.size)

    @property
    def num_gpus(self) -> int:
        return int(self.slots.size)


def _layer_data(
    w: FloatArray, slots: IntArray, split: Split, bound_tokens: float, current_phy2log: IntArray | None
) -> _LayerData:
    mean = float(w.sum()) / slots.size
    scale = _SCALE_TARGET / mean if mean > 0 else 1.0
    max_replicas = max_replicas_per_expert(w.size, slots)
    ks = np.arange(1, max_replicas + 1)
    return _LayerData(
        w=w,
        slots=slots,
        split=split,
        scale=scale,
        max_replicas=max_replicas,
        per_replica=np.floor(w[:, None] * scale / ks[None, :]).astype(np.int64),
        expert_units=np.floor(w * scale).astype(np.int64),
        rounding_units=int(slots.max()),
        bound_tokens=bound_tokens,
        current=None if current_phy2log is None else _membership(current_phy2log, slots, w.size),
    )


@dataclass(frozen=True)
class _State:
    """A complete placement of one layer: ``member [E, G]`` bool and ``amounts [E, G]``,
    the model units expert e puts on GPU g (uniform pieces or weighted ``f``)."""

    member: NDArray[np.bool_]
    amounts: IntArray


def _membership(phy2log: IntArray, slots: IntArray, num_experts: int) -> NDArray[np.bool_]:
    """``[E, G]`` bool of one layer: expert e has a replica on GPU g."""
    return np.asarray(gpu_membership(phy2log[None, :], slots, num_experts)[0].T)


def _start_membership(data: _LayerData, phy2log: IntArray) -> NDArray[np.bool_]:
    """Membership of a warm start; a second replica of an expert on one GPU (which the
    model cannot express) is replaced by the absent expert with the most load per replica."""
    member = _membership(phy2log, data.slots, data.num_experts)
    for g in np.flatnonzero(member.sum(axis=0) < data.slots).tolist():
        while member[:, g].sum() < data.slots[g]:
            per_replica = data.w / np.maximum(member.sum(axis=1), 1)
            per_replica[member[:, g]] = -np.inf
            member[int(np.argmax(per_replica)), g] = True
    return member


def _split_units(units: int, parts: FloatArray) -> IntArray:
    """Integers >= 0 proportional to ``parts`` (summing to 1) that add up to ``units``."""
    raw = parts * units
    out = np.floor(raw).astype(np.int64)
    short = units - int(out.sum())
    if short > 0:
        out[np.argsort(-(raw - out), kind="stable")[:short]] += 1
    return out


def _uniform_amounts(data: _LayerData, member: NDArray[np.bool_]) -> IntArray:
    replicas = member.sum(axis=1)
    q = data.per_replica[np.arange(data.num_experts), np.clip(replicas, 1, data.max_replicas) - 1]
    return np.asarray(member * q[:, None], dtype=np.int64)


def _state_from(data: _LayerData, member: NDArray[np.bool_], share_eg: FloatArray | None = None) -> _State:
    """State of a placement; weighted amounts follow ``share_eg [E, G]`` (None: uniform)."""
    if data.split == "uniform":
        return _State(member, _uniform_amounts(data, member))
    amounts = np.zeros(member.shape, dtype=np.int64)
    for e in range(data.num_experts):
        gpus = np.flatnonzero(member[e])
        parts = np.full(gpus.size, 1.0 / gpus.size) if share_eg is None else share_eg[e, gpus]
        total = parts.sum()
        parts = parts / total if total > 0 else np.full(gpus.size, 1.0 / gpus.size)
        amounts[e, gpus] = _split_units(int(data.expert_units[e]), parts)
    return _State(member, amounts)


def _shares_eg(data: _LayerData, state: _State) -> FloatArray:
    """``[E, G]`` fraction of expert e's tokens served on GPU g."""
    replicas = np.maximum(state.member.sum(axis=1), 1)
    uniform = state.member / replicas[:, None]
    if data.split == "uniform":
        return np.asarray(uniform, dtype=np.float64)
    units = data.expert_units[:, None].astype(np.float64)
    weighted = state.amounts / np.where(units > 0, units, 1.0)
    return np.asarray(np.where(units > 0, weighted, uniform), dtype=np.float64)


def _true_loads(data: _LayerData, state: _State) -> FloatArray:
    """``[G]`` exact tokens per GPU of a state."""
    return np.asarray(data.w @ _shares_eg(data, state), dtype=np.float64)


def _moves(data: _LayerData, state: _State) -> int:
    """(expert, GPU) pairs of the state absent from the current placement (labels as is)."""
    assert data.current is not None
    return int((state.member & ~data.current).sum())


def _to_placement(
    data: _LayerData, state: _State, share_eg: FloatArray | None = None
) -> tuple[IntArray, FloatArray | None]:
    """``phy2log [P]`` (experts of a GPU in id order) and, weighted, ``shares [P]``
    (from ``share_eg [E, G]`` when given, else from the state's units)."""
    phy2log = np.concatenate([np.flatnonzero(state.member[:, g]) for g in range(data.num_gpus)])
    phy2log = phy2log.astype(np.int64)
    if data.split == "uniform":
        return phy2log, None
    gpu_of_slot = np.repeat(np.arange(data.num_gpus), data.slots)
    shares = _shares_eg(data, state) if share_eg is None else share_eg
    return phy2log, shares[phy2log, gpu_of_slot]


# --------------------------------------------------------------------------- one layer: model

Objective = Literal["balance", "moves"]


@dataclass(frozen=True)
class _Model:
    """CP-SAT model of a neighbourhood: GPUs ``gpus [H]`` and experts ``experts [C]``
    are free, everything else stays as in the state it was built from. With every GPU
    and expert free it is the full model. ``x_index``/``amount_index`` are ``[C, H]``
    proto indices of ``x[e, g]`` and of e's model units on g; ``outside_amounts``
    ``[n, 3]`` rows (expert, GPU, proto index) of weighted units on GPUs outside;
    ``counts`` ``[n, 3]`` rows (expert, k, proto index of z[e, k]) for uniform layers."""

    model: cp_model.CpModel
    gpus: IntArray
    experts: IntArray
    x_index: IntArray
    amount_index: IntArray
    outside_amounts: IntArray
    counts: IntArray


def build_model(
    data: _LayerData,
    state: _State,
    gpus: IntArray,
    experts: IntArray,
    objective: Objective,
    load_cap_units: int = 0,
) -> _Model:
    """Build the placement model of one layer restricted to a neighbourhood.

    Variables (e in ``experts``, g in ``gpus``): ``x[e, g]`` replica of e on g;
    uniform: one-hot ``z[e, k]`` for e's replica count k (its replicas outside the
    neighbourhood included) and ``piece[e, g]`` = ``per_replica[e, k]`` if ``x[e, g]``
    else 0; weighted: ``f[e, g]`` units of e served on g, 0 unless ``x[e, g]``.
    Constraints: every slot of a free GPU holds an expert, every expert keeps a
    replica, at most ``max_replicas`` replicas. Loads of GPUs outside the
    neighbourhood that hold a free expert follow its replica count (uniform).

    ``objective="balance"``: minimize the max load over free and affected GPUs; in a
    neighbourhood, not below the max of the GPUs it cannot change, and then the load
    above that level (so ties at the top are broken up).
    ``objective="moves"``: minimize ``penalty * overload + copies`` where overload is
    the units above ``load_cap_units`` on those GPUs and copies counts ``x[e, g]`` with
    e not on g in the current placement; ``penalty`` exceeds any copy count, so an
    overload is removed before any copy is saved.
    """
    m = cp_model.CpModel()
    free_gpu = np.zeros(data.num_gpus, dtype=bool)
    free_gpu[gpus] = True
    free_expert = np.zeros(data.num_experts, dtype=bool)
    free_expert[experts] = True
    outside = ~free_gpu
    full = bool(free_gpu.all())

    x = [[m.new_bool_var(f"x[{e},{g}]") for g in gpus] for e in experts]
    for j, g in enumerate(gpus):
        m.add(sum(row[j] for row in x) == int(data.slots[g]))

    amount: list[list[cp_model.IntVar]] = []
    outside_terms: dict[int, list[Any]] = {}  # outside GPU -> its free experts' units there
    outside_amounts: list[tuple[int, int, int]] = []  # weighted: (expert, outside GPU, proto index)
    counts: list[tuple[int, int, int]] = []  # uniform: (expert, replica count k, proto index of z)
    piece_cuts: list[Any] = []
    for i, e in enumerate(experts):
        kept = int(state.member[e, outside].sum())
        if data.split == "uniform":
            ks = range(max(1, kept), min(data.max_replicas, kept + gpus.size) + 1)
            q = data.per_replica[e]
            z = [m.new_bool_var(f"z[{e},{k}]") for k in ks]
            m.add_exactly_one(z)
            counts.extend((int(e), k, z_k.index) for k, z_k in zip(ks, z, strict=True))
            m.add(sum(x[i]) == sum((k - kept) * z_k for k, z_k in zip(ks, z, strict=True)))
            piece = sum(int(q[k - 1]) * z_k for k, z_k in zip(ks, z, strict=True))
            pieces = [m.new_int_var(0, int(q[ks[0] - 1]), f"piece[{e},{g}]") for g in gpus]
            for j in range(gpus.size):
                m.add(pieces[j] == piece).only_enforce_if(x[i][j])
                m.add(pieces[j] == 0).only_enforce_if(~x[i][j])
            # the free replicas carry (k - kept) pieces in all
            m.add(sum(pieces) == sum(int((k - kept) * q[k - 1]) * z_k for k, z_k in zip(ks, z, strict=True)))
            piece_cuts.append(piece)
            for o in np.flatnonzero(state.member[e] & outside).tolist():
                outside_terms.setdefault(o, []).append(piece)
            amount.append(pieces)
        else:
            units = int(data.expert_units[e])
            f = [m.new_int_var(0, units, f"f[{e},{g}]") for g in gpus]
            for j in range(gpus.size):
                m.add(f[j] == 0).only_enforce_if(~x[i][j])
            # e's replicas outside stay, but the units they serve may shift
            f_out = []
            for o in np.flatnonzero(state.member[e] & outside).tolist():
                var = m.new_int_var(0, units, f"f[{e},{o}]")
                f_out.append(var)
                outside_terms.setdefault(o, []).append(var)
                outside_amounts.append((int(e), o, var.index))
            m.add(sum(f) + sum(f_out) == units)
            m.add(sum(x[i]) >= max(0, 1 - kept))
            m.add(sum(x[i]) <= data.max_replicas - kept)
            amount.append(f)

    loads: list[Any] = [sum(amount[i][j] for i in range(experts.size)) for j in range(gpus.size)]
    fixed = np.where(free_expert[:, None], 0, state.amounts).sum(axis=0)
    loads += [int(fixed[o]) + sum(terms) for o, terms in sorted(outside_terms.items())]
    total_units = int(data.expert_units.sum()) + 1

    if objective == "balance":
        max_load = m.new_int_var(0, total_units, "T")
        for load in loads:
            m.add(load <= max_load)
        for piece in piece_cuts:
            m.add(max_load >= piece)
        if full:
            all_units = sum(sum(row) for row in amount)
            m.add(data.num_gpus * max_load >= all_units)
            # model loads are at most rounding_units below scale x exact loads: a valid cut
            m.add(max_load >= max(0, math.ceil(data.bound_tokens * data.scale) - data.rounding_units))
            m.minimize(max_load)
        else:
            touched = free_gpu.copy()
            touched[list(outside_terms)] = True
            # GPUs the neighbourhood cannot change: no use going below their max ...
            level = int(state.amounts[:, ~touched].sum(axis=0).max()) if not touched.all() else 0
            m.add(max_load >= level)
            # ... and among equal maxima prefer less load above it: fewer GPUs tied at the top
            excess = [m.new_int_var(0, total_units, f"excess[{n}]") for n in range(len(loads))]
            for load, over in zip(loads, excess, strict=True):
                m.add(over >= load - level)
            m.minimize((len(loads) + 1) * max_load + sum(excess))
    else:
        assert data.current is not None
        copies = [x[i][j] for i, e in enumerate(experts) for j, g in enumerate(gpus) if not data.current[e, g]]
        overload = []
        for n, load in enumerate(loads):
            over = m.new_int_var(0, total_units, f"over[{n}]")
            m.add(over >= load - load_cap_units)
            overload.append(over)
        penalty = int(data.slots[gpus].sum()) + 1
        m.minimize(penalty * sum(overload) + sum(copies))

    return _Model(
        model=m,
        gpus=gpus,
        experts=experts,
        x_index=np.array([[v.index for v in row] for row in x], dtype=np.int64).reshape(experts.size, -1),
        amount_index=np.array([[v.index for v in row] for row in amount], dtype=np.int64).reshape(experts.size, -1),
        outside_amounts=np.array(outside_amounts, dtype=np.int64).reshape(-1, 3),
        counts=np.array(counts, dtype=np.int64).reshape(-1, 3),
    )


def hint_state(built: _Model, state: _State) -> None:
    """Hint the placement, units and replica counts of a state (CP-SAT derives the max
    load and the slack variables from them)."""
    m = built.model
    m.clear_hints()  # type: ignore[no-untyped-call]
    sub_member = state.member[np.ix_(built.experts, built.gpus)]
    sub_amounts = state.amounts[np.ix_(built.experts, built.gpus)]
    proto = m.proto
    proto.solution_hint.vars.extend(built.x_index.ravel().tolist())
    proto.solution_hint.values.extend(sub_member.astype(np.int64).ravel().tolist())
    proto.solution_hint.vars.extend(built.amount_index.ravel().tolist())
    proto.solution_hint.values.extend(sub_amounts.ravel().tolist())
    expert, gpu, index = built.outside_amounts.T
    proto.solution_hint.vars.extend(index.tolist())
    proto.solution_hint.values.extend(state.amounts[expert, gpu].tolist())
    expert, k, index = built.counts.T
    proto.solution_hint.vars.extend(index.tolist())
    proto.solution_hint.values.extend((state.member[expert].sum(axis=1) == k).astype(np.int64).tolist())


# --------------------------------------------------------------------------- one layer: solve


@dataclass(frozen=True)
class _Solved:
    """One CP-SAT run: its status name, the new state (None without a solution), the
    objective and best bound in model units, and whether the time limit stopped it."""

    status: str
    state: _State | None
    objective: float
    bound: float
    timed_out: bool


def solve_model(
    data: _LayerData,
    state: _State,
    built: _Model,
    time_limit_s: float,
    workers: int,
    seed: int = 0,
    params: dict[str, Any] | None = None,
) -> _Solved:
    """Run CP-SAT on a built model and merge its solution into a copy of ``state``."""
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_time_in_seconds = max(time_limit_s, 0.0)
    p.num_workers = workers
    p.random_seed = seed
    # keep the complete, feasible hint through presolve's symmetry handling (issue notes)
    p.keep_all_feasible_solutions_in_presolve = True
    for name, value in (params or {}).items():
        setattr(p, name, value)
    status = solver.solve(built.model)
    name = solver.status_name(status)
    timed_out = status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Solved(name, None, math.inf, -math.inf, timed_out)
    values = np.asarray(solver.response_proto.solution, dtype=np.int64)
    member = state.member.copy()
    member[np.ix_(built.experts, built.gpus)] = values[built.x_index] > 0
    if data.split == "uniform":
        new_state = _State(member, _uniform_amounts(data, member))
    else:
        amounts = state.amounts.copy()
        amounts[np.ix_(built.experts, built.gpus)] = values[built.amount_index]
        expert, gpu, index = built.outside_amounts.T
        amounts[expert, gpu] = values[index]
        new_state = _State(member, amounts)
    return _Solved(name, new_state, float(solver.objective_value), float(solver.best_objective_bound), timed_out)


# --------------------------------------------------------------------------- one layer: search

_TINY_MAX_PAIRS = 64
"""Layers with at most this many (expert, GPU) pairs go straight to the full model."""
_FULL_MODEL_MAX_PAIRS = 512
"""Up to this many pairs, the neighbourhood search gets part of the time and the full
model (hinted with its result) the rest, to prove optimality or improve. Larger
layers only get the neighbourhood search: there the full model improves on greedy far
less in the same time (measured: 32x8 at 1 s, full 1.0128 vs 1.0007 by neighbourhoods;
256x32 spends about a second in presolve) and its bound is the mean-load bound."""
_FULL_AFTER_LNS_FRACTION = 0.5
_REPAIR_FRACTION = 0.8
"""Share of the migration time the repair of the current placement gets before the
search falls back to trimming the copies of the balanced placement."""
_LNS_SUB_TIME_S = 0.1
"""Time limit of one neighbourhood solve; pairs of GPUs solve in about 15 ms."""
_LNS_MIN_GPUS, _LNS_MAX_GPUS = 2, 8
_LNS_PATIENCE = 6
"""Neighbourhoods without improvement before the search tries one GPU more."""
_STOP_GAP = 1e-6
"""Stop early when the relative gap to the bound is below this (status "feasible")."""


def _deadline_left(deadline: float) -> float:
    return deadline - time.time() - _READBACK_MARGIN_S


def _tie_tokens(data: _LayerData) -> float:
    """Loads closer than this (model rounding) count as tied."""
    return (data.rounding_units + 1) / data.scale


def _neighbourhood(
    data: _LayerData, state: _State, size: int, rng: np.random.Generator, objective: Objective, cap: float
) -> tuple[IntArray, IntArray]:
    """Pick the GPUs and experts a neighbourhood frees.

    Balance: the fullest GPU, some of the emptiest and some at random. Moves: the most
    overloaded GPU (if any), GPUs weighted by their copies, the emptiest, random ones.
    Experts: all on those GPUs and (moves) those the current placement has there. Their
    replica counts are free: a replica can change hands between them (measured: adding
    the hottest experts elsewhere slowed every step more than it helped).
    """
    loads = _true_loads(data, state)
    num_gpus = data.num_gpus
    size = min(size, num_gpus)
    chosen: list[int] = []
    if objective == "balance":
        # every GPU tied at the max (shares equalize loads exactly), leaving room for a light one
        order = np.argsort(-loads, kind="stable")
        tied = order[loads[order] >= loads[order[0]] - _tie_tokens(data)]
        chosen.extend(int(g) for g in tied[: max(1, size - 1)])
    else:
        over = loads - cap
        if over.max() > 0:  # the most overloaded GPU and, to take its load, the emptiest
            chosen.append(int(np.argmax(over)))
            if size > 1 and int(np.argmin(loads)) not in chosen:
                chosen.append(int(np.argmin(loads)))
        assert data.current is not None
        copies = (state.member & ~data.current).sum(axis=0).astype(np.float64)
        if copies.sum() > 0 and len(chosen) < size:
            pick = int(rng.choice(num_gpus, p=copies / copies.sum()))
            if pick not in chosen:
                chosen.append(pick)
    light = np.argsort(loads, kind="stable")[: max(1, num_gpus // 4)]
    while len(chosen) < size:
        pool = light if rng.random() < 0.5 else np.arange(num_gpus)
        pick = int(rng.choice(pool))
        if pick not in chosen:
            chosen.append(pick)
    gpus = np.array(sorted(chosen), dtype=np.int64)
    free = state.member[:, gpus].any(axis=1)
    if objective == "moves" and data.current is not None:
        free |= data.current[:, gpus].any(axis=1)
    return gpus, np.flatnonzero(free).astype(np.int64)


def _key(data: _LayerData, state: _State, objective: Objective, cap: float) -> tuple[float, float]:
    """What a search minimizes, exactly: (max load, GPUs tied at it) or (overload
    tokens, copies)."""
    loads = _true_loads(data, state)
    if objective == "balance":
        top = float(loads.max())
        return top, float(np.count_nonzero(loads >= top - _tie_tokens(data)))
    return float(np.maximum(loads - cap, 0.0).sum()), float(_moves(data, state))


@dataclass
class _SearchLog:
    solutions: int = 0
    proven: bool = False
    timed_out: bool = False
    bound_units: float = -math.inf


def _lns(
    data: _LayerData,
    state: _State,
    deadline: float,
    objective: Objective,
    cap_units: int,
    cap_tokens: float,
    rng: np.random.Generator,
    log: _SearchLog,
    stop_at: float = -math.inf,
) -> _State:
    """Large-neighbourhood search: CP-SAT re-solves a few GPUs at a time, exactly,
    with the rest fixed; a result replaces the incumbent when its exact key is no worse.
    Runs until ``deadline``, until the key's first entry is <= ``stop_at`` (and, for
    moves, no copy is left), or hands over to the full model once a neighbourhood would
    hold every GPU."""
    best, best_key = state, _key(data, state, objective, cap_tokens)
    size, failures, seed = _LNS_MIN_GPUS, 0, 0
    if objective == "moves":
        stop_at = max(stop_at, 0.0)  # no overload and no copy cannot be improved
    while best_key[0] > stop_at or (objective == "moves" and best_key[1] > 0):
        if size >= data.num_gpus:  # the neighbourhood is the whole layer: solve it once
            return _full_solve(data, best, deadline, objective, cap_units, cap_tokens, 1, seed, log)
        left = _deadline_left(deadline)
        if left < _MIN_SOLVE_S:
            log.timed_out = True
            break
        gpus, experts = _neighbourhood(data, best, size, rng, objective, cap_tokens)
        built = build_model(data, best, gpus, experts, objective, cap_units)
        hint_state(built, best)
        left = _deadline_left(deadline)
        if left < _MIN_SOLVE_S:
            log.timed_out = True
            break
        seed += 1
        solved = solve_model(data, best, built, min(left, _LNS_SUB_TIME_S), 1, seed)
        improved = False
        if solved.state is not None:
            log.solutions += 1
            key = _key(data, solved.state, objective, cap_tokens)
            improved = key < best_key
            if key <= best_key:
                best, best_key = solved.state, key
        if improved:
            failures = 0
            continue
        failures += 1
        if failures >= _LNS_PATIENCE:
            size, failures = (size + 1 if size < _LNS_MAX_GPUS else _LNS_MIN_GPUS), 0
    return best


def _full_solve(
    data: _LayerData,
    state: _State,
    deadline: float,
    objective: Objective,
    cap_units: int,
    cap_tokens: float,
    workers: int,
    seed: int,
    log: _SearchLog,
) -> _State:
    """Solve the full model once, hinted with ``state``; keep the better of the two."""
    everything = np.arange(data.num_gpus, dtype=np.int64)
    built = build_model(data, state, everything, np.arange(data.num_experts, dtype=np.int64), objective, cap_units)
    hint_state(built, state)
    left = _deadline_left(deadline)
    if left < _MIN_SOLVE_S:
        log.timed_out = True
        return state
    solved = solve_model(data, state, built, left, workers, seed)
    log.timed_out = solved.timed_out
    log.proven = solved.status == "OPTIMAL"
    log.bound_units = solved.bound
    if solved.state is None:
        return state
    log.solutions += 1
    if _key(data, solved.state, objective, cap_tokens) <= _key(data, state, objective, cap_tokens):
        return solved.state
    return state


# --------------------------------------------------------------------------- one layer: driver


@dataclass(frozen=True)
class _LayerTask:
    """Everything a worker needs for one layer (picklable)."""

    layer: int
    loads: FloatArray  # [E]
    slots: IntArray  # [G]
    greedy: IntArray  # [P]
    bound_tokens: float
    current: IntArray | None  # [P]
    split: Split
    max_lb_slack: float
    time_limit_s: float
    deadline: float  # absolute, time.time(), of the whole request
    workers: int
    seed: int
    waves_left: int = 1  # layers per process still to run from this one on, itself included


@dataclass(frozen=True)
class _LayerOutcome:
    layer: int
    phy2log: IntArray  # [P]
    shares: FloatArray | None  # [P]
    status: LayerStatus
    objective: float
    bound: float
    wall_ms: float


def _status(log: _SearchLog, objective: float, bound: float) -> LayerStatus:
    """``optimal``: proven (or at the bound); ``feasible``: stopped early, within
    ``_STOP_GAP`` of the bound or the solver's own end; ``time_limit``: stopped by the
    deadline; ``greedy_fallback``: the deadline came before any solver solution."""
    if log.proven or objective <= bound * (1 + 1e-9):
        return "optimal"
    if objective <= bound * (1 + _STOP_GAP):
        return "feasible"
    if log.timed_out:
        return "time_limit" if log.solutions else "greedy_fallback"
    return "feasible"


def _objective(data: _LayerData, state: _State) -> float:
    """Max GPU load of a state as it will be returned (weighted: float shares)."""
    if data.split == "uniform":
        return float(_true_loads(data, state).max())
    return float((data.w @ _exact_shares(data, state)).max())


def _exact_shares(data: _LayerData, state: _State) -> FloatArray:
    """``[E, G]`` shares for the output, in floats: the best (exactly evaluated) of the
    state's integer units, uniform shares and the LP's shares on the same placement,
    so a weighted answer is never worse than uniform shares on its placement."""
    candidates = [_shares_eg(data, state), _shares_eg(replace(data, split="uniform"), state)]
    by_lp = lp_shares(data.w, state.member)
    if by_lp is not None:
        candidates.append(by_lp)
    return min(candidates, key=lambda shares: float((data.w @ shares).max()))


def _finish(
    data: _LayerData, state: _State, current: IntArray | None, exact: bool = False
) -> tuple[IntArray, FloatArray | None]:
    """A state as ``phy2log [P]`` and ``shares [P]``, relabelled to overlap ``current``;
    ``exact``: weighted shares in floats (see :func:`_exact_shares`)."""
    share_eg = _exact_shares(data, state) if exact and data.split == "weighted" else None
    phy2log, shares = _to_placement(data, state, share_eg)
    if current is not None:
        relabeled, source = relabel_slot_order(phy2log[None, :], current[None, :], data.slots)
        phy2log = relabeled[0]
        shares = None if shares is None else shares[source[0]]
    return phy2log, shares


def lp_shares(w: FloatArray, member: NDArray[np.bool_]) -> FloatArray | None:
    """Weighted shares minimizing the max GPU load of a fixed placement, by LP.

    ``w [E]`` tokens, ``member [E, G]`` placement. Solves ``min T`` s.t. ``sum_g f[e, g]
    == w[e]``, ``sum_e f[e, g] <= T``, ``f >= 0`` on the placement's pairs (MathOpt,
    GLOP). Returns ``[E, G]`` shares (uniform for experts without load) or None if the
    LP did not solve to optimality.
    """
    from ortools.math_opt.python import mathopt

    mean = float(w.sum()) / member.shape[1]
    if mean <= 0:
        return None
    scaled = w / mean  # the LP sees loads around 1
    experts, gpus = np.nonzero(member)
    model = mathopt.Model(name="weighted_shares")
    flow = [model.add_variable(lb=0.0, ub=float(scaled[e])) for e in experts.tolist()]
    max_load = model.add_variable(lb=0.0, name="T")
    for e in range(member.shape[0]):
        model.add_linear_constraint(mathopt.fast_sum(flow[n] for n in np.flatnonzero(experts == e)) == scaled[e])
    for g in range(member.shape[1]):
        model.add_linear_constraint(mathopt.fast_sum(flow[n] for n in np.flatnonzero(gpus == g)) <= max_load)
    model.minimize(max_load)
    result = mathopt.solve(model, mathopt.SolverType.GLOP)
    if result.termination.reason != mathopt.TerminationReason.OPTIMAL:
        return None
    values = np.clip(np.array(result.variable_values(flow), dtype=np.float64), 0.0, None)
    amounts = np.zeros(member.shape)
    amounts[experts, gpus] = values
    totals = amounts.sum(axis=1, keepdims=True)
    uniform = member / np.maximum(member.sum(axis=1, keepdims=True), 1)
    return np.asarray(np.where(totals > 0, amounts / np.where(totals > 0, totals, 1.0), uniform))


def _as_split(data: _LayerData, state: _State, search: _LayerData) -> _State:
    """A state of the search (uniform loads) as a state of ``data``: LP shares when the
    layer is weighted and they lower the max load."""
    if data.split == search.split:
        return state
    uniform = _state_from(data, state.member)
    shares = lp_shares(data.w, state.member)
    if shares is None:
        return uniform
    weighted = _state_from(data, state.member, shares)
    return weighted if _true_loads(data, weighted).max() <= _true_loads(data, uniform).max() else uniform


def _solve_layer(task: _LayerTask) -> _LayerOutcome:
    """Solve one layer: balance, then (with a current placement) fewest copies.

    The neighbourhood search always runs on uniform loads; for weighted layers an LP
    then sets the shares of its placement (weighted neighbourhoods stall: free shares
    make many GPUs tie at the max, more than a neighbourhood holds). The full model,
    for small layers, runs in the requested split.
    """
    started = time.time()
    # an equal share of what is left of the request for this layer and those queued after it
    share = (task.deadline - started) / max(1, task.waves_left) if math.isfinite(task.deadline) else math.inf
    deadline = min(started + task.time_limit_s, started + share, task.deadline)
    data = _layer_data(task.loads, task.slots, task.split, task.bound_tokens, task.current)
    uniform = replace(data, split="uniform")
    pairs = data.num_experts * data.num_gpus
    full, tiny = pairs <= _FULL_MODEL_MAX_PAIRS, pairs <= _TINY_MAX_PAIRS
    rng = np.random.default_rng(task.seed + task.layer)
    start = _state_from(uniform, _start_membership(uniform, task.greedy))

    # phase 1: balance
    log = _SearchLog()
    balance_deadline = deadline
    if data.current is not None:
        balance_deadline = started + _MIGRATION_BALANCE_FRACTION * (deadline - started)
    best = _as_split(data, start, uniform)
    stop = task.bound_tokens * (1 + _STOP_GAP)
    if float(task.loads.sum()) <= 0:
        log.proven = True
    else:
        if not tiny:
            lns_deadline = balance_deadline
            if full:
                lns_deadline = started + _FULL_AFTER_LNS_FRACTION * (balance_deadline - started)
            searched = _as_split(data, _lns(uniform, start, lns_deadline, "balance", 0, 0.0, rng, log, stop), uniform)
            if _objective(data, searched) <= _objective(data, best):
                best = searched
        if full and _objective(data, best) > stop:
            best = _full_solve(data, best, balance_deadline, "balance", 0, 0.0, task.workers, task.seed, log)
    objective = _objective(data, best)
    rounding = 0 if data.split == "uniform" else data.rounding_units
    bound = min(max(task.bound_tokens, (log.bound_units - rounding) / data.scale), objective)
    status = _status(log, objective, bound)

    # phase 2: fewest copies at max load <= (1 + slack) x best
    if data.current is not None and task.current is not None:
        cap_tokens = (1 + task.max_lb_slack) * objective
        cap_units = math.floor(cap_tokens * data.scale) - data.rounding_units
        phy2log, shares = _finish(data, best, task.current)
        share_eg = None
        if shares is not None:
            share_eg = np.zeros(best.member.shape)
            share_eg[phy2log, np.repeat(np.arange(data.num_gpus), data.slots)] = shares
        relabeled = _state_from(data, _membership(phy2log, task.slots, data.num_experts), share_eg)
        log2 = _SearchLog()
        if tiny:
            moved = _full_solve(
                data, relabeled, deadline, "moves", cap_units, cap_tokens, task.workers, task.seed, log2
            )
        else:
            # Repair the current placement (remove the overload above the cap at the fewest
            # copies): far fewer copies than trimming the balanced placement's. On uniform
            # loads, which the LP's shares only lower. If the repair has not removed the
            # overload by the checkpoint, trim the balanced placement's copies instead.
            trimmed = _state_from(uniform, relabeled.member)
            moved_uniform = trimmed
            if bool((data.current.sum(axis=0) == task.slots).all()):
                checkpoint = time.time() + _REPAIR_FRACTION * (deadline - time.time())
                repair = _state_from(uniform, data.current)
                moved_uniform = _lns(uniform, repair, checkpoint, "moves", cap_units, cap_tokens, rng, log2)
                if _key(uniform, moved_uniform, "moves", cap_tokens)[0] > 0:
                    moved_uniform = trimmed
            if _key(uniform, moved_uniform, "moves", cap_tokens)[0] <= 0:
                moved_uniform = _lns(uniform, moved_uniform, deadline, "moves", cap_units, cap_tokens, rng, log2)
            moved = relabeled
            if _key(uniform, moved_uniform, "moves", cap_tokens)[0] <= 0:
                moved = _as_split(data, moved_uniform, uniform)
        best = moved
        objective = _objective(data, best)
        if _moves(data, best) == 0:
            log2.proven = True
        status = _status(log2, math.inf, bound) if log.solutions or log2.solutions else "greedy_fallback"

    phy2log, shares = _finish(data, best, task.current, exact=True)
    return _LayerOutcome(
        layer=task.layer,
        phy2log=phy2log,
        shares=shares,
        status=status,
        objective=objective,
        bound=min(bound, objective),
        wall_ms=(time.time() - started) * 1e3,
    )


# --------------------------------------------------------------------------- all layers


_POOLS: dict[int, ProcessPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _pool(processes: int) -> ProcessPoolExecutor:
    """A process pool kept across calls (starting one costs about half a second: each
    worker imports OR-Tools). forkserver where available, spawn elsewhere; never fork,
    which is unsafe in threaded servers."""
    with _POOLS_LOCK:
        pool = _POOLS.get(processes)
        if pool is None:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload([__name__])
            pool = ProcessPoolExecutor(max_workers=processes, mp_context=ctx)
            _POOLS[processes] = pool
        return pool


def _drop_pool(processes: int) -> None:
    with _POOLS_LOCK:
        pool = _POOLS.pop(processes, None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def shutdown_pools() -> None:
    """Stop the worker processes kept by :func:`solve_milp` (also done at exit)."""
    for processes in list(_POOLS):
        _drop_pool(processes)


atexit.register(shutdown_pools)


def _fallback(task: _LayerTask, started: float) -> _LayerOutcome:
    """Greedy's placement for a layer whose solve did not come back."""
    data = _layer_data(task.loads, task.slots, task.split, task.bound_tokens, task.current)
    state = _state_from(data, _start_membership(data, task.greedy))
    objective = float(_true_loads(data, state).max())
    phy2log, shares = _finish(data, state, task.current, exact=True)
    return _LayerOutcome(
        layer=task.layer,
        phy2log=phy2log,
        shares=shares,
        status="greedy_fallback",
        objective=objective,
        bound=min(task.bound_tokens, objective),
        wall_ms=(time.time() - started) * 1e3,
    )


def _run(tasks: list[_LayerTask], processes: int, deadline: float | None) -> list[_LayerOutcome]:
    """Solve the layers, in a process pool when there is more than one layer and process."""
    started = time.time()
    if processes <= 1 or len(tasks) <= 1:
        return [_solve_layer(task) for task in tasks]
    pool = _pool(processes)
    futures: list[Future[_LayerOutcome]] = [pool.submit(_solve_layer, task) for task in tasks]
    # a worker honours its deadline; wait a little longer before declaring it lost
    patience = None if deadline is None else max(0.0, deadline - time.time()) + 30.0
    outcomes = []
    for task, future in zip(tasks, futures, strict=True):
        try:
            outcomes.append(future.result(timeout=patience))
        except (BrokenProcessPool, TimeoutError, OSError, RuntimeError):
            _drop_pool(processes)
            outcomes.append(_fallback(task, started))
    return outcomes


def solve_milp(
    loads: ArrayLike,
    slots_per_gpu: ArrayLike,
    *,
    time_limit_s: float = 5.0,
    total_time_limit_s: float | None = None,
    split: Split = "uniform",
    current_phy2log: ArrayLike | None = None,
    max_lb_slack: float = 0.01,
    workers: int | None = None,
    processes: int | None = None,
    warm_start: ArrayLike | None = None,
    seed: int = 0,
) -> MilpResult:
    """Place every layer's experts with CP-SAT, warm-started from greedy.

    Args:
        loads: ``[L, E]`` tokens routed to each logical expert per layer, >= 0.
        slots_per_gpu: ``[G]`` slots on each GPU (may differ), each >= 1,
            ``E <= sum <= E * G``.
        time_limit_s: wall-time limit per layer, seconds (model building included).
        total_time_limit_s: wall-time limit for the whole call, seconds. A layer
            starting at ``t`` gets ``min(time_limit_s, (deadline - t) / waves_left)``,
            ``waves_left`` = its and the later layers' share per process, so the
            layers split what is left after pool start-up. None: per-layer limit only.
        split: ``"uniform"`` (each replica serves ``1 / replicas``) or ``"weighted"``
            (replicas serve chosen shares, returned in ``shares``).
        current_phy2log: ``[L, P]`` placement now served. When given, each layer
            then minimizes the experts copied onto GPUs subject to max GPU load <=
            ``(1 + max_lb_slack)`` x the best max load found, and the result is
            relabelled to overlap it (see :mod:`solvers.migration`).
        max_lb_slack: allowed relative increase of the max load for fewer copies.
        workers: CP-SAT threads per layer (default: cores / processes, at least 1).
        processes: layers solved at once (default: min(L, cores)).
        warm_start: ``[L, P]`` placement to start from instead of greedy's.
        seed: random seed of the neighbourhood search and of CP-SAT.

    Returns:
        A :class:`MilpResult`; every placement in it is valid and no layer's max load
        exceeds the warm start's (without ``current_phy2log``).
    """
    started = time.time()
    w = np.asarray(loads, dtype=np.float64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if w.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("loads must be finite and non-negative")
    if slots.ndim != 1 or slots.size == 0 or np.any(slots < 1):
        raise ValueError("slots_per_gpu must be a non-empty list of counts >= 1")
    num_layers, num_experts = w.shape
    num_slots = int(slots.sum())
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts: add slots or GPUs")
    if int(slots.max()) > num_experts:
        raise ValueError(
            f"a GPU with {int(slots.max())} slots would need two replicas of one of the {num_experts} experts"
        )
    if split not in ("uniform", "weighted"):
        raise ValueError(f"split must be 'uniform' or 'weighted', got {split!r}")
    if time_limit_s <= 0 or (total_time_limit_s is not None and total_time_limit_s <= 0):
        raise ValueError("time limits must be positive")
    if max_lb_slack < 0:
        raise ValueError("max_lb_slack must be >= 0")

    if warm_start is None:
        from solvers.greedy import solve_greedy

        start = solve_greedy(w, slots)
    else:
        start = np.asarray(warm_start, dtype=np.int64)
    validate_placement(start, slots, num_experts)
    current = None
    if current_phy2log is not None:
        current = np.asarray(current_phy2log, dtype=np.int64)
        validate_placement(current, slots, num_experts)

    cores = available_cores()
    processes = max(1, min(num_layers, cores if processes is None else processes))
    workers = max(1, cores // processes) if workers is None else max(1, workers)
    deadline = math.inf if total_time_limit_s is None else started + total_time_limit_s
    bounds = lower_bound(w, slots, split=split)
    tasks = [
        _LayerTask(
            layer=layer,
            loads=w[layer],
            slots=slots,
            greedy=start[layer],
            bound_tokens=float(bounds[layer]),
            current=None if current is None else current[layer],
            split=split,
            max_lb_slack=float(max_lb_slack),
            time_limit_s=float(time_limit_s),
            deadline=deadline,
            workers=workers,
            seed=seed,
            waves_left=math.ceil((num_layers - layer) / processes),
        )
        for layer in range(num_layers)
    ]
    outcomes = _run(tasks, processes, None if total_time_limit_s is None else deadline)

    phy2log = np.stack([o.phy2log for o in outcomes]) if outcomes else np.zeros((0, num_slots), np.int64)
    shares = None
    if split == "weighted":
        shares = np.stack([np.asarray(o.shares) for o in outcomes]) if outcomes else np.zeros((0, num_slots))
    validate_placement(phy2log, slots, num_experts, shares)
    objective = max_gpu_loads(w, phy2log, slots, shares)
    bound = np.minimum(np.array([o.bound for o in outcomes], dtype=np.float64), objective)
    gap = np.where(objective > 0, (objective - bound) / np.where(objective > 0, objective, 1.0), 0.0)
    mean = w.sum(axis=1) / slots.size
    lb = np.where(mean > 0, objective / np.where(mean > 0, mean, 1.0), 1.0)
    return MilpResult(
        phy2log=phy2log,
        shares=shares,
        status=[o.status for o in outcomes],
        objective=objective,
        bound=bound,
        gap=np.asarray(gap, dtype=np.float64),
        wall_ms=np.array([o.wall_ms for o in outcomes], dtype=np.float64),
        greedy_objective=max_gpu_loads(w, start, slots),
        moves=None if current is None else count_moves(phy2log, current, slots),
        lb=np.asarray(lb, dtype=np.float64),
        total_wall_ms=(time.time() - started) * 1e3,
    )


DEFAULT_LAYER_LIMIT_S = 5.0
"""Per-layer limit when neither a per-layer nor a whole-call limit is given, s."""


class MilpSolver(Solver):
    """Registered as "milp": `solve_milp` with uniform shares, warm-started from greedy."""

    name = "milp"
    summary = "exact CP-SAT search, warm-started from greedy (never worse); migration-aware with a current placement"
    capabilities = Capabilities(current=True)
    options = frozenset({"time_limit_s", "total_time_limit_s", "max_lb_slack"})
    split: ClassVar[Split] = "uniform"

    def solve(self, problem: Problem, options: Options) -> Solution:
        from solvers.greedy import solve_greedy

        warm = solve_greedy(problem.loads, problem.slots_per_gpu)
        per_layer = options.time_limit_s or options.total_time_limit_s or DEFAULT_LAYER_LIMIT_S
        result = solve_milp(
            problem.loads,
            problem.slots_per_gpu,
            time_limit_s=per_layer,
            total_time_limit_s=options.total_time_limit_s,
            split=self.split,
            current_phy2log=problem.current_phy2log,
            max_lb_slack=options.max_lb_slack,
            warm_start=warm,
        )
        statuses: list[str] = list(result.status)
        overall = next((s for s in ("greedy_fallback", "time_limit", "feasible") if s in statuses), "optimal")
        return Solution(
            result.phy2log,
            shares=result.shares,
            status=overall,
            layer_status=statuses,
            layer_ms=[round(float(v), 3) for v in result.wall_ms],
            bound_tokens=result.bound,
            info={"time_limit_s_per_layer": per_layer},
        )


class WeightedMilpSolver(MilpSolver):
    """Registered as "milp-weighted": the MILP with weighted shares (needs weighted replica selection)."""

    name = "milp-weighted"
    summary = "the MILP with weighted shares per replica (the server must route by share)"
    capabilities = Capabilities(current=True, shares=True, aligned=True)
    split = "weighted"
