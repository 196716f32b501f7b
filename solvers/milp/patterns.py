"""Pattern model of a small uniform layer: GPUs counted by the set of experts they hold, not labelled.

GPUs with the same slot count are interchangeable, so the x[e, g] model has (G!)-fold symmetric copies
of every placement and CP-SAT cannot prove small layers optimal (8 experts on 8 GPUs x 2 slots stayed
unproven after 30 s). Here a *pattern* is a set of ``s`` distinct experts a GPU with ``s`` slots may
hold, and the model counts GPUs per pattern::

    z[e, k] in {0, 1}, sum_k z[e, k] = 1        expert e has k replicas
    piece[e] = sum_k floor(w[e] scale / k) z[e, k]
    n[c] in 0..count[s]                         GPUs with s slots that hold pattern c (|c| = s)
    sum_{c : |c| = s} n[c] = count[s]           every GPU holds one pattern
    sum_{c ni e} n[c] = sum_k k z[e, k]         replica counts
    T >= sum_{e in c} piece[e]  if n[c] >= 1    the max load
    minimize T

No GPU labels, hence no symmetry between identical GPUs. Replica counts are bounded by the warm start's
max load ``U`` (an improving placement has ``piece[e] <= U``, so ``k >= w[e] / U``), and patterns whose
smallest possible load exceeds ``U`` are left out. Used when the patterns number at most
`PATTERN_LIMIT` (8 experts x 2 slots: 28; 16 x 4: 1,820).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from solvers.milp.layer import IntArray, LayerData, State, uniform_amounts
from solvers.milp.model import Solved, run_cp_sat, solved_with, solved_without_state

PATTERN_LIMIT = 2000
"""Most patterns (sets of experts one GPU may hold, over every slot count) the model enumerates."""


def pattern_count(num_experts: int, slots: IntArray) -> int:
    """Patterns of a layer: ``sum over distinct slot counts s of C(E, s)``."""
    return sum(math.comb(num_experts, int(s)) for s in np.unique(slots))


def fits_pattern_model(data: LayerData) -> bool:
    """Uniform layer with few enough patterns."""
    return data.split == "uniform" and pattern_count(data.num_experts, data.slots) <= PATTERN_LIMIT


@dataclass(frozen=True)
class PatternModel:
    """The built model: ``patterns`` per slot count (tuples of experts), the proto indices of their
    counts ``n[c]`` and usage literals, and ``counts`` rows (expert, k, proto index of z[e, k])."""

    model: cp_model.CpModel
    patterns: dict[int, list[tuple[int, ...]]]
    count_index: dict[int, list[int]]
    used_index: dict[int, list[int]]
    counts: IntArray


def build_pattern_model(data: LayerData, incumbent_units: int) -> PatternModel:
    """The pattern model of a uniform layer whose best known max load is ``incumbent_units``."""
    m = cp_model.CpModel()
    q = data.per_replica
    z: list[dict[int, cp_model.IntVar]] = []
    for e in range(data.num_experts):
        ks = [k for k in range(1, data.max_replicas + 1) if q[e, k - 1] <= incumbent_units] or [data.max_replicas]
        z.append({k: m.new_bool_var(f"z[{e},{k}]") for k in ks})
        m.add_exactly_one(z[e].values())
    smallest_piece = np.array([q[e, max(z[e]) - 1] for e in range(data.num_experts)])
    piece = [sum(int(q[e, k - 1]) * v for k, v in z[e].items()) for e in range(data.num_experts)]
    lowest = max(0, math.ceil(data.bound_tokens * data.scale) - data.rounding_units)
    max_load = m.new_int_var(min(lowest, incumbent_units), incumbent_units, "T")
    holders: list[list[cp_model.IntVar]] = [[] for _ in range(data.num_experts)]
    patterns: dict[int, list[tuple[int, ...]]] = {}
    count_index: dict[int, list[int]] = {}
    used_index: dict[int, list[int]] = {}
    for size, gpus in zip(*np.unique(data.slots, return_counts=True), strict=True):
        s, count = int(size), int(gpus)
        patterns[s], count_index[s], used_index[s] = [], [], []
        class_total = []
        for c in itertools.combinations(range(data.num_experts), s):
            if int(smallest_piece[list(c)].sum()) > incumbent_units:
                continue  # cannot appear in a placement as good as the incumbent
            n = m.new_int_var(0, count, f"n{c}")
            used = m.new_bool_var(f"used{c}")
            m.add(n >= 1).only_enforce_if(used)
            m.add(n == 0).only_enforce_if(~used)
            m.add(max_load >= sum(piece[e] for e in c)).only_enforce_if(used)
            for e in c:
                holders[e].append(n)
            class_total.append(n)
            patterns[s].append(c)
            count_index[s].append(n.index)
            used_index[s].append(used.index)
        m.add(sum(class_total) == count)
    for e in range(data.num_experts):
        m.add(sum(holders[e]) == sum(k * v for k, v in z[e].items()))
        m.add(max_load >= piece[e])
    m.add(data.num_gpus * max_load >= int(data.expert_units.sum()) - data.num_gpus * data.rounding_units)
    m.minimize(max_load)
    counts = [(e, k, v.index) for e in range(data.num_experts) for k, v in z[e].items()]
    return PatternModel(m, patterns, count_index, used_index, np.array(counts, dtype=np.int64).reshape(-1, 3))


def hint_pattern_state(built: PatternModel, state: State) -> None:
    """Hint the pattern counts and replica counts of a state."""
    hint = built.model.proto.solution_hint
    held: dict[tuple[int, ...], int] = {}
    for g in range(state.member.shape[1]):
        key = tuple(np.flatnonzero(state.member[:, g]).tolist())
        held[key] = held.get(key, 0) + 1
    for s, patterns in built.patterns.items():
        values = [held.get(c, 0) for c in patterns]
        hint.vars.extend(built.count_index[s] + built.used_index[s])
        hint.values.extend(values + [int(v > 0) for v in values])
    expert, k, index = built.counts.T
    hint.vars.extend(index.tolist())
    hint.values.extend((state.member[expert].sum(axis=1) == k).astype(np.int64).tolist())


def member_from_patterns(data: LayerData, built: PatternModel, values: IntArray) -> np.ndarray:
    """``[E, G]`` membership from a solution: each slot class's GPUs, in index order, take its patterns."""
    member = np.zeros((data.num_experts, data.num_gpus), dtype=bool)
    for s, patterns in built.patterns.items():
        gpus = iter(np.flatnonzero(data.slots == s).tolist())
        for c, index in zip(patterns, built.count_index[s], strict=True):
            for _ in range(int(values[index])):
                member[list(c), next(gpus)] = True
    return member


def solve_pattern_model(
    data: LayerData, state: State, seconds_left: Callable[[], float], workers: int, seed: int
) -> Solved:
    """Minimize the max load of a small uniform layer with the pattern model, hinted with ``state``;
    ``seconds_left()`` is asked once the model is built."""
    incumbent = int(state.amounts.sum(axis=0).max())
    built = build_pattern_model(data, incumbent)
    hint_pattern_state(built, state)
    solver = run_cp_sat(built.model, seconds_left(), workers, seed)
    failed = solved_without_state(solver)
    if failed is not None:
        return failed
    values = np.asarray(solver.response_proto.solution, dtype=np.int64)
    member = member_from_patterns(data, built, values)
    return solved_with(solver, State(member, uniform_amounts(data, member)))
