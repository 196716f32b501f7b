"""The CP-SAT placement model of one layer, whole or restricted to a neighbourhood.

Built in :func:`build_model`, hinted with a state in :func:`hint_state`, solved and read back into a
`State` in :func:`solve_model` (OR-Tools' build / solve / read-back split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from ortools.sat.python import cp_model

from solvers.milp.layer import BoolArray, IntArray, LayerData, State, uniform_amounts


@dataclass(frozen=True)
class Goal:
    """What a solve minimizes. ``balance``: the max GPU load. ``moves``: copies of experts onto GPUs
    that the current placement lacks, after removing every load above ``cap_units`` (model units;
    ``cap_tokens`` the same cap in exact tokens)."""

    kind: Literal["balance", "moves"]
    cap_units: int = 0
    cap_tokens: float = 0.0


BALANCE = Goal("balance")


@dataclass(frozen=True)
class NeighbourhoodModel:
    """CP-SAT model of a neighbourhood: GPUs ``gpus [H]`` and experts ``experts [C]`` are free,
    everything else stays as in the state it was built from (all free: the full model).
    ``x_index`` / ``amount_index``: ``[C, H]`` proto indices of ``x[e, g]`` and of e's units on g;
    ``outside_amounts``: ``[n, 3]`` rows (expert, GPU, proto index) of weighted units on GPUs outside;
    ``counts``: ``[n, 3]`` rows (expert, k, proto index of z[e, k]) for uniform layers."""

    model: cp_model.CpModel
    gpus: IntArray
    experts: IntArray
    x_index: IntArray
    amount_index: IntArray
    outside_amounts: IntArray
    counts: IntArray


@dataclass
class _Parts:
    """What the expert constraints hand to the objective: per free expert, its units on each free GPU;
    per outside GPU, the free experts' units there; weighted outside amounts; replica-count literals;
    uniform per-replica pieces (each a lower bound on the max load)."""

    amount: list[list[Any]] = field(default_factory=list)
    outside_terms: dict[int, list[Any]] = field(default_factory=dict)
    outside_amounts: list[tuple[int, int, int]] = field(default_factory=list)
    counts: list[tuple[int, int, int]] = field(default_factory=list)
    pieces: list[Any] = field(default_factory=list)


def _add_uniform_expert(
    m: cp_model.CpModel, data: LayerData, e: int, x_e: list[cp_model.IntVar], kept: int,
    outside_gpus: list[int], parts: _Parts,
) -> None:
    """Expert e with uniform shares: one-hot ``z[e, k]`` over its replica count k (``kept`` of them
    outside), ``piece[e, g]`` = ``per_replica[e, k]`` on the free GPUs that hold it, else 0."""
    ks = range(max(1, kept), min(data.max_replicas, kept + len(x_e)) + 1)
    q = data.per_replica[e]
    z = [m.new_bool_var(f"z[{e},{k}]") for k in ks]
    m.add_exactly_one(z)
    parts.counts.extend((e, k, z_k.index) for k, z_k in zip(ks, z, strict=True))
    m.add(sum(x_e) == sum((k - kept) * z_k for k, z_k in zip(ks, z, strict=True)))
    piece = sum(int(q[k - 1]) * z_k for k, z_k in zip(ks, z, strict=True))
    on_gpu = [m.new_int_var(0, int(q[ks[0] - 1]), f"piece[{e},{j}]") for j in range(len(x_e))]
    for x, units in zip(x_e, on_gpu, strict=True):
        m.add(units == piece).only_enforce_if(x)
        m.add(units == 0).only_enforce_if(~x)
    # the free replicas carry (k - kept) pieces in all
    m.add(sum(on_gpu) == sum(int((k - kept) * q[k - 1]) * z_k for k, z_k in zip(ks, z, strict=True)))
    parts.pieces.append(piece)
    for o in outside_gpus:
        parts.outside_terms.setdefault(o, []).append(piece)
    parts.amount.append(on_gpu)


def _add_weighted_expert(
    m: cp_model.CpModel, data: LayerData, e: int, x_e: list[cp_model.IntVar], kept: int,
    outside_gpus: list[int], parts: _Parts,
) -> None:
    """Expert e with weighted shares: ``f[e, g]`` units on each free GPU (0 unless it holds e); its
    replicas outside stay but the units they serve may shift."""
    units = int(data.expert_units[e])
    f = [m.new_int_var(0, units, f"f[{e},{j}]") for j in range(len(x_e))]
    for x, f_g in zip(x_e, f, strict=True):
        m.add(f_g == 0).only_enforce_if(~x)
    f_out = []
    for o in outside_gpus:
        var = m.new_int_var(0, units, f"f[{e},{o}]")
        f_out.append(var)
        parts.outside_terms.setdefault(o, []).append(var)
        parts.outside_amounts.append((e, o, var.index))
    m.add(sum(f) + sum(f_out) == units)
    m.add(sum(x_e) >= max(0, 1 - kept))
    m.add(sum(x_e) <= data.max_replicas - kept)
    parts.amount.append(f)


def _add_balance_objective(
    m: cp_model.CpModel, data: LayerData, state: State, loads: list[Any], parts: _Parts,
    free_gpu: BoolArray, total_units: int,
) -> None:
    """Minimize the max load; in a neighbourhood, not below the max of the GPUs it cannot change, and
    then the load above that level (so ties at the top are broken up)."""
    max_load = m.new_int_var(0, total_units, "T")
    for load in loads:
        m.add(load <= max_load)
    for piece in parts.pieces:
        m.add(max_load >= piece)
    if free_gpu.all():
        all_units = sum(sum(row) for row in parts.amount)
        m.add(data.num_gpus * max_load >= all_units)
        # model loads are at most rounding_units below scale x exact loads: a valid cut
        m.add(max_load >= max(0, math.ceil(data.bound_tokens * data.scale) - data.rounding_units))
        m.minimize(max_load)
        return
    touched = free_gpu.copy()
    touched[list(parts.outside_terms)] = True
    level = int(state.amounts[:, ~touched].sum(axis=0).max()) if not touched.all() else 0
    m.add(max_load >= level)
    excess = [m.new_int_var(0, total_units, f"excess[{n}]") for n in range(len(loads))]
    for load, over in zip(loads, excess, strict=True):
        m.add(over >= load - level)
    m.minimize((len(loads) + 1) * max_load + sum(excess))


def _add_moves_objective(
    m: cp_model.CpModel, data: LayerData, x: list[list[cp_model.IntVar]], gpus: IntArray, experts: IntArray,
    loads: list[Any], goal: Goal, total_units: int,
) -> None:
    """Minimize ``penalty * overload + copies``; ``penalty`` exceeds any copy count, so an overload is
    removed before any copy is saved."""
    assert data.current is not None
    new_pairs = [x[i][j] for i, e in enumerate(experts) for j, g in enumerate(gpus) if not data.current[e, g]]
    overload = []
    for n, load in enumerate(loads):
        over = m.new_int_var(0, total_units, f"over[{n}]")
        m.add(over >= load - goal.cap_units)
        overload.append(over)
    penalty = int(data.slots[gpus].sum()) + 1
    m.minimize(penalty * sum(overload) + sum(new_pairs))


def build_model(data: LayerData, state: State, gpus: IntArray, experts: IntArray, goal: Goal) -> NeighbourhoodModel:
    """The placement model of one layer with GPUs ``gpus [H]`` and experts ``experts [C]`` free.

    Variables: ``x[e, g]`` replica of e on g; uniform: one-hot ``z[e, k]`` for e's replica count k
    (replicas outside the neighbourhood included) and ``piece[e, g]``; weighted: ``f[e, g]`` units.
    Constraints: every slot of a free GPU holds an expert, every expert keeps a replica, at most
    ``max_replicas`` replicas; loads of outside GPUs holding a free expert follow its replica count.
    """
    m = cp_model.CpModel()
    free_gpu = np.zeros(data.num_gpus, dtype=bool)
    free_gpu[gpus] = True
    free_expert = np.zeros(data.num_experts, dtype=bool)
    free_expert[experts] = True
    x = [[m.new_bool_var(f"x[{e},{g}]") for g in gpus] for e in experts]
    for j, g in enumerate(gpus):
        m.add(sum(row[j] for row in x) == int(data.slots[g]))
    parts = _Parts()
    add_expert = _add_uniform_expert if data.split == "uniform" else _add_weighted_expert
    for i, e in enumerate(experts.tolist()):
        outside_gpus = np.flatnonzero(state.member[e] & ~free_gpu).tolist()
        add_expert(m, data, e, x[i], len(outside_gpus), outside_gpus, parts)
    loads: list[Any] = [sum(parts.amount[i][j] for i in range(experts.size)) for j in range(gpus.size)]
    fixed = np.where(free_expert[:, None], 0, state.amounts).sum(axis=0)
    loads += [int(fixed[o]) + sum(terms) for o, terms in sorted(parts.outside_terms.items())]
    total_units = int(data.expert_units.sum()) + 1
    if goal.kind == "balance":
        _add_balance_objective(m, data, state, loads, parts, free_gpu, total_units)
    else:
        _add_moves_objective(m, data, x, gpus, experts, loads, goal, total_units)
    return NeighbourhoodModel(
        model=m,
        gpus=gpus,
        experts=experts,
        x_index=np.array([[v.index for v in row] for row in x], dtype=np.int64).reshape(experts.size, -1),
        amount_index=np.array([[v.index for v in row] for row in parts.amount], dtype=np.int64).reshape(
            experts.size, -1
        ),
        outside_amounts=np.array(parts.outside_amounts, dtype=np.int64).reshape(-1, 3),
        counts=np.array(parts.counts, dtype=np.int64).reshape(-1, 3),
    )


def hint_state(built: NeighbourhoodModel, state: State) -> None:
    """Hint the placement, units and replica counts of a state (CP-SAT derives the max load and the
    slack variables from them)."""
    m = built.model
    m.clear_hints()  # type: ignore[no-untyped-call]
    hint = m.proto.solution_hint
    sub = np.ix_(built.experts, built.gpus)
    hint.vars.extend(built.x_index.ravel().tolist())
    hint.values.extend(state.member[sub].astype(np.int64).ravel().tolist())
    hint.vars.extend(built.amount_index.ravel().tolist())
    hint.values.extend(state.amounts[sub].ravel().tolist())
    expert, gpu, index = built.outside_amounts.T
    hint.vars.extend(index.tolist())
    hint.values.extend(state.amounts[expert, gpu].tolist())
    expert, k, index = built.counts.T
    hint.vars.extend(index.tolist())
    hint.values.extend((state.member[expert].sum(axis=1) == k).astype(np.int64).tolist())


@dataclass(frozen=True)
class Solved:
    """One CP-SAT run: its status name, the new state (None without a solution), the objective and
    best bound in model units, whether it proved optimality and whether the time limit stopped it."""

    status: str
    state: State | None
    objective: float
    bound: float
    proven: bool
    timed_out: bool


def run_cp_sat(model: cp_model.CpModel, time_limit_s: float, workers: int, seed: int) -> cp_model.CpSolver:
    """A solver that has run on ``model`` (read its status from ``solver.response_proto``)."""
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_time_in_seconds = max(time_limit_s, 0.0)
    p.num_workers = workers
    p.random_seed = seed
    # keep the complete, feasible hint through presolve's symmetry handling
    p.keep_all_feasible_solutions_in_presolve = True
    solver.solve(model)
    return solver


def solved_without_state(solver: cp_model.CpSolver) -> Solved | None:
    """The `Solved` of a run that found no solution, or None when it has one."""
    status = solver.response_proto.status
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    timed_out = status not in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID)
    return Solved(solver.status_name(status), None, math.inf, -math.inf, False, timed_out)


def solved_with(solver: cp_model.CpSolver, state: State) -> Solved:
    """The `Solved` of a run that found ``state``."""
    status = solver.response_proto.status
    return Solved(
        status=solver.status_name(status),
        state=state,
        objective=float(solver.objective_value),
        bound=float(solver.best_objective_bound),
        proven=status == cp_model.OPTIMAL,
        timed_out=status != cp_model.OPTIMAL,
    )


def solve_model(
    data: LayerData, state: State, built: NeighbourhoodModel, time_limit_s: float, workers: int, seed: int = 0
) -> Solved:
    """Run CP-SAT on a built model and merge its solution into a copy of ``state``."""
    solver = run_cp_sat(built.model, time_limit_s, workers, seed)
    failed = solved_without_state(solver)
    if failed is not None:
        return failed
    values = np.asarray(solver.response_proto.solution, dtype=np.int64)
    member = state.member.copy()
    member[np.ix_(built.experts, built.gpus)] = values[built.x_index] > 0
    if data.split == "uniform":
        return solved_with(solver, State(member, uniform_amounts(data, member)))
    amounts = state.amounts.copy()
    amounts[np.ix_(built.experts, built.gpus)] = values[built.amount_index]
    expert, gpu, index = built.outside_amounts.T
    amounts[expert, gpu] = values[index]
    return solved_with(solver, State(member, amounts))
