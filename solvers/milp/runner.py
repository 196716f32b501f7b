"""All layers: warm start, one task per layer (or per layer and node under the hierarchical policy),
run on threads, assembled into a `MilpResult`.

Threads, not processes: CP-SAT releases the GIL while it searches, so layers solve in parallel, and a
thread costs nothing to start where a process pool cost about 2 s (each worker imports OR-Tools;
``python benchmarks/milp.py --section startup`` measures both). The service already runs each request in
a worker process of its own (api/pool.py) whose process group it kills on cancel, which stops these
threads with it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from solvers.bounds import lower_bound
from solvers.loads import max_gpu_loads
from solvers.migration import count_moves
from solvers.milp.driver import LayerOutcome, LayerStatus, LayerTask, solve_layer
from solvers.milp.layer import FloatArray, IntArray, Split
from solvers.validation import validate_placement

_STATUS_ORDER: tuple[LayerStatus, ...] = ("optimal", "feasible", "time_limit", "greedy_fallback")


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
            solver placement in time: greedy's placement). With ``current_phy2log`` it is
            the status of the copy-minimizing solve (``"optimal"``: no placement within the
            load cap needs fewer copies). Under the hierarchical policy, for the group-to-node
            assignment of the warm start (the worst of the layer's nodes).
        objective: ``[L]`` max GPU load of the returned placement, tokens.
        bound: ``[L]`` lower bound on the max GPU load of any placement of that split,
            tokens: the best of the solver's proven bound and :mod:`solvers.bounds` (under the
            hierarchical policy: of any placement keeping the warm start's group-to-node assignment).
        gap: ``[L]`` ``(objective - bound) / objective`` (0 when both are 0).
        wall_ms: ``[L]`` wall time spent on each layer, milliseconds.
        greedy_objective: ``[L]`` max GPU load of the warm start, tokens.
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


@dataclass(frozen=True)
class Part:
    """The piece of one layer a task solves: experts ``experts [n]`` (global ids, sorted) on the slots
    ``slot_start:slot_stop`` of the GPUs ``gpu_start:gpu_stop``. The whole layer, or one node's."""

    layer: int
    experts: IntArray
    gpu_start: int
    gpu_stop: int
    slot_start: int
    slot_stop: int


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def whole_layers(num_layers: int, num_experts: int, slots: IntArray) -> list[Part]:
    """One part per layer: every expert on every GPU."""
    experts = np.arange(num_experts, dtype=np.int64)
    return [Part(layer, experts, 0, slots.size, 0, int(slots.sum())) for layer in range(num_layers)]


def node_parts(warm: IntArray, slots: IntArray, num_experts: int, gpus_per_node: int) -> list[Part] | None:
    """One part per layer and node, each node keeping the experts ``warm [L, P]`` puts on it; None when
    some expert of ``warm`` sits on two nodes (it is not node-local)."""
    num_layers = warm.shape[0]
    ends = np.cumsum(slots)
    parts = []
    for layer in range(num_layers):
        held = 0
        for first in range(0, slots.size, gpus_per_node):
            last = first + gpus_per_node
            lo, hi = int(ends[first] - slots[first]), int(ends[last - 1])
            experts = np.unique(warm[layer, lo:hi])
            held += experts.size
            parts.append(Part(layer, experts, first, last, lo, hi))
        if held != num_experts:
            return None
    return parts


def _check_inputs(w: FloatArray, slots: IntArray, split: str, time_limit_s: float,
                  total_time_limit_s: float | None, max_lb_slack: float) -> None:
    """ValueError with what to fix, for inputs no placement can honour."""
    if w.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("loads must be finite and non-negative")
    if slots.ndim != 1 or slots.size == 0 or np.any(slots < 1):
        raise ValueError("slots_per_gpu must be a non-empty list of counts >= 1")
    num_experts = w.shape[1]
    if int(slots.sum()) < num_experts:
        raise ValueError(f"{int(slots.sum())} slots cannot hold {num_experts} experts: add slots or GPUs")
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


def _parts_for(
    warm: IntArray, slots: IntArray, num_experts: int, hierarchical: bool, gpus_per_node: int | None,
    warm_given: bool,
) -> list[Part]:
    """Whole layers, or under the hierarchical policy one part per layer and node."""
    if not hierarchical:
        return whole_layers(warm.shape[0], num_experts, slots)
    assert gpus_per_node is not None
    if slots.size % gpus_per_node:
        raise ValueError(f"{slots.size} GPUs do not split into nodes of {gpus_per_node}")
    parts = node_parts(warm, slots, num_experts, gpus_per_node)
    if parts is None:
        if warm_given:
            raise ValueError("the warm start puts an expert on two nodes: the hierarchical policy keeps each on one")
        return whole_layers(warm.shape[0], num_experts, slots)  # greedy itself used the global policy
    for part in parts:
        widest = int(slots[part.gpu_start : part.gpu_stop].max())
        if widest > part.experts.size:
            raise ValueError(
                f"a GPU with {widest} slots on a node holding {part.experts.size} experts would need two "
                "replicas of one expert: use fewer slots per GPU or fewer groups"
            )
    return parts


@dataclass(frozen=True)
class PartProblem:
    """One part in its own expert and slot numbering: ``loads [n]`` tokens, ``slots [H]``, ``warm [S]``
    warm start, a lower bound on its max GPU load and the warm start's max GPU load (tokens)."""

    part: Part
    loads: FloatArray
    slots: IntArray
    warm: IntArray
    bound_tokens: float
    warm_max: float


def part_problem(part: Part, w: FloatArray, slots: IntArray, warm: IntArray, split: Split) -> PartProblem:
    """The problem of one part of ``w [L, E]`` with warm start ``warm [L, P]``."""
    loads = w[part.layer, part.experts]
    part_slots = slots[part.gpu_start : part.gpu_stop]
    local_warm = np.searchsorted(part.experts, warm[part.layer, part.slot_start : part.slot_stop]).astype(np.int64)
    return PartProblem(
        part=part,
        loads=loads,
        slots=part_slots,
        warm=local_warm,
        bound_tokens=float(lower_bound(loads[None, :], part_slots, split=split)[0]),
        warm_max=float(max_gpu_loads(loads[None, :], local_warm[None, :], part_slots)[0]),
    )


def parts_to_solve(problems: list[PartProblem], has_current: bool) -> list[bool]:
    """Which parts can change their layer's result. Without a current placement, a part whose warm start
    is already at or below the layer's bound (the largest of its parts' bounds) cannot lower the layer's
    max load and keeps its warm start (under the hierarchical policy most nodes of a layer do)."""
    if has_current:
        return [True] * len(problems)
    layer_bound: dict[int, float] = {}
    for p in problems:
        layer_bound[p.part.layer] = max(layer_bound.get(p.part.layer, 0.0), p.bound_tokens)
    return [p.warm_max > layer_bound[p.part.layer] * (1 + 1e-9) for p in problems]


def kept_outcome(problem: PartProblem, split: Split) -> LayerOutcome:
    """A part that keeps its warm start (uniform shares)."""
    shares = None
    if split == "weighted":
        counts = np.bincount(problem.warm, minlength=problem.loads.size)
        shares = 1.0 / counts[problem.warm]
    return LayerOutcome(problem.warm, shares, "optimal", problem.warm_max, problem.bound_tokens, 0.0)


def run_tasks(tasks: list[LayerTask], threads: int, cancel: threading.Event) -> list[LayerOutcome]:
    """Solve the tasks on ``threads`` threads (in order on the caller's when 1); on an interrupt, the
    layers still running stop at their next neighbourhood."""
    if threads <= 1 or len(tasks) <= 1:
        return [solve_layer(task) for task in tasks]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="eplb-milp") as pool:
        futures = [pool.submit(solve_layer, task) for task in tasks]
        try:
            return [future.result() for future in futures]
        except BaseException:
            cancel.set()
            for future in futures:
                future.cancel()
            raise


def _layer_status(statuses: list[LayerStatus]) -> LayerStatus:
    """The worst status of a layer's parts."""
    return max(statuses, key=_STATUS_ORDER.index)


def solve_milp(
    loads: ArrayLike,
    slots_per_gpu: ArrayLike,
    *,
    time_limit_s: float = 5.0,
    total_time_limit_s: float | None = None,
    split: Split = "uniform",
    current_phy2log: ArrayLike | None = None,
    max_lb_slack: float = 0.01,
    num_groups: int | None = None,
    gpus_per_node: int | None = None,
    workers: int | None = None,
    threads: int | None = None,
    warm_start: ArrayLike | None = None,
    seed: int = 0,
) -> MilpResult:
    """Place every layer's experts with CP-SAT, warm-started from greedy.

    Args:
        loads: ``[L, E]`` tokens routed to each logical expert per layer, >= 0.
        slots_per_gpu: ``[G]`` slots on each GPU (may differ), each >= 1, ``E <= sum <= E * G``.
        time_limit_s: wall-time limit per layer, seconds (model building included).
        total_time_limit_s: wall-time limit for the whole call, seconds. A task starting at ``t`` gets
            ``min(its limit, (deadline - t) / waves_left)``, ``waves_left`` = its and the later tasks'
            share per thread. None: per-layer limit only.
        split: ``"uniform"`` (each replica serves ``1 / replicas``) or ``"weighted"`` (replicas serve
            chosen shares, returned in ``shares``).
        current_phy2log: ``[L, P]`` placement now served. When given, each layer then minimizes the
            experts copied onto GPUs subject to max GPU load <= ``(1 + max_lb_slack)`` x the best max
            load found, and the result is relabelled to overlap it (see :mod:`solvers.migration`).
        max_lb_slack: allowed relative increase of the max load for fewer copies.
        num_groups, gpus_per_node: the hierarchical policy. The warm start is hierarchical greedy's and
            every expert, replicas included, stays on the node the warm start puts its group on: each
            node of each layer is solved on its own (time limit split between the nodes). Greedy falls
            back to the global policy when the groups do not divide over the nodes; so does this.
        workers: CP-SAT threads per task (default: cores / threads, at least 1).
        threads: tasks solved at once (default: min(tasks, cores)).
        warm_start: ``[L, P]`` placement to start from instead of greedy's.
        seed: random seed of the neighbourhood search and of CP-SAT.

    Returns:
        A :class:`MilpResult`; every placement in it is valid and no layer's max load exceeds the warm
        start's (without ``current_phy2log``).
    """
    started = time.time()
    w = np.asarray(loads, dtype=np.float64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    _check_inputs(w, slots, split, time_limit_s, total_time_limit_s, max_lb_slack)
    num_layers, num_experts = w.shape
    hierarchical = num_groups is not None and gpus_per_node is not None
    if hierarchical and current_phy2log is not None:
        raise ValueError("the MILP's migration mode does not keep the hierarchical policy: drop the current "
                         "placement or the groups")
    if warm_start is None:
        from solvers.greedy import solve_greedy

        warm = solve_greedy(w, slots, num_groups=num_groups, gpus_per_node=gpus_per_node)
    else:
        warm = np.asarray(warm_start, dtype=np.int64)
    validate_placement(warm, slots, num_experts)
    current = None
    if current_phy2log is not None:
        current = np.asarray(current_phy2log, dtype=np.int64)
        validate_placement(current, slots, num_experts)

    parts = _parts_for(warm, slots, num_experts, hierarchical, gpus_per_node, warm_start is not None)
    problems = [part_problem(part, w, slots, warm, split) for part in parts]
    solve_it = parts_to_solve(problems, current is not None)
    to_solve = [p for p, chosen in zip(problems, solve_it, strict=True) if chosen]
    per_layer_parts = np.bincount([p.part.layer for p in to_solve], minlength=num_layers)
    cores = available_cores()
    threads = max(1, min(len(to_solve), cores if threads is None else threads))
    workers = max(1, cores // threads) if workers is None else max(1, workers)
    deadline = math.inf if total_time_limit_s is None else started + total_time_limit_s
    cancel = threading.Event()
    tasks = [
        LayerTask(
            index=i,
            loads=p.loads,
            slots=p.slots,
            greedy=p.warm,
            bound_tokens=p.bound_tokens,
            current=None if current is None else current[p.part.layer],
            split=split,
            max_lb_slack=float(max_lb_slack),
            time_limit_s=time_limit_s / int(per_layer_parts[p.part.layer]),
            deadline=deadline,
            workers=workers,
            seed=seed,
            waves_left=math.ceil((len(to_solve) - i) / threads),
            cancel=cancel,
        )
        for i, p in enumerate(to_solve)
    ]
    solved = iter(run_tasks(tasks, threads, cancel))
    pairs = zip(problems, solve_it, strict=True)
    outcomes = [next(solved) if chosen else kept_outcome(p, split) for p, chosen in pairs]
    return _assemble(w, slots, split, parts, outcomes, solve_it, warm, current, started)


def _assemble(
    w: FloatArray, slots: IntArray, split: Split, parts: list[Part], outcomes: list[LayerOutcome],
    solved: list[bool], warm: IntArray, current: IntArray | None, started: float,
) -> MilpResult:
    """The parts' answers put back into whole layers, checked and measured. A layer's status is the worst
    of its solved parts' ("optimal" when none needed solving: its warm start is at the bound)."""
    num_layers, num_experts = w.shape
    phy2log = np.zeros((num_layers, int(slots.sum())), dtype=np.int64)
    shares = np.zeros(phy2log.shape) if split == "weighted" else None
    bound = np.zeros(num_layers)
    wall_ms = np.zeros(num_layers)
    statuses: list[list[LayerStatus]] = [[] for _ in range(num_layers)]
    for part, outcome, was_solved in zip(parts, outcomes, solved, strict=True):
        phy2log[part.layer, part.slot_start : part.slot_stop] = part.experts[outcome.phy2log]
        if shares is not None:
            shares[part.layer, part.slot_start : part.slot_stop] = np.asarray(outcome.shares)
        bound[part.layer] = max(bound[part.layer], outcome.bound)
        wall_ms[part.layer] += outcome.wall_ms
        if was_solved:
            statuses[part.layer].append(outcome.status)
    validate_placement(phy2log, slots, num_experts, shares)
    objective = max_gpu_loads(w, phy2log, slots, shares)
    bound = np.minimum(bound, objective)
    gap = np.where(objective > 0, (objective - bound) / np.where(objective > 0, objective, 1.0), 0.0)
    mean = w.sum(axis=1) / slots.size
    lb = np.where(mean > 0, objective / np.where(mean > 0, mean, 1.0), 1.0)
    return MilpResult(
        phy2log=phy2log,
        shares=shares,
        status=[_layer_status(s) if s else "optimal" for s in statuses],
        objective=objective,
        bound=bound,
        gap=np.asarray(gap, dtype=np.float64),
        wall_ms=wall_ms,
        greedy_objective=max_gpu_loads(w, warm, slots),
        moves=None if current is None else count_moves(phy2log, current, slots),
        lb=np.asarray(lb, dtype=np.float64),
        total_wall_ms=(time.time() - started) * 1e3,
    )
