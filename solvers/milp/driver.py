"""One layer from warm start to placement: balance, then (with a current placement) fewest copies."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from solvers.migration import relabel_slot_order
from solvers.milp.layer import (
    FloatArray,
    IntArray,
    LayerData,
    Split,
    State,
    copies,
    layer_data,
    membership,
    phy2log_of,
    slot_shares,
    start_membership,
    state_from,
    state_shares,
)
from solvers.milp.model import BALANCE, Goal
from solvers.milp.patterns import fits_pattern_model
from solvers.milp.search import Clock, SearchLog, full_solve, large_neighbourhood_search, score
from solvers.milp.shares import exact_shares, returned_max_load, with_split_of

LayerStatus = Literal["optimal", "feasible", "time_limit", "greedy_fallback"]

TINY_MAX_PAIRS = 64
"""Layers with at most this many (expert, GPU) pairs go straight to the full model (as do uniform layers
that fit the pattern model)."""
FULL_MODEL_MAX_PAIRS = 512
"""Up to this many pairs, the neighbourhood search gets part of the time and the full model (hinted with
its result) the rest, to prove optimality or improve. Larger layers only get the neighbourhood search:
there the full model improves on greedy far less in the same time (measured: 32x8 at 1 s, full 1.0128 vs
1.0007 by neighbourhoods; 256x32 spends about a second in presolve) and its bound is the mean load."""
FULL_AFTER_LNS_FRACTION = 0.5
MIGRATION_BALANCE_FRACTION = 0.3
"""Share of a layer's time spent on the balance solve when migration follows."""
REPAIR_FRACTION = 0.8
"""Share of the migration time the repair of the current placement gets before the search falls back to
trimming the copies of the balanced placement."""
STOP_GAP = 1e-6
"""Stop early when the relative gap to the bound is below this (status "feasible")."""


@dataclass(frozen=True)
class LayerTask:
    """Everything one layer's solve needs: ``loads [E]`` tokens, ``slots [G]``, ``greedy [P]`` warm start,
    ``current [P]`` or None, ``deadline`` of the whole request (absolute, ``time.time()``), ``waves_left``:
    tasks per thread still to run from this one on, itself included."""

    index: int
    loads: FloatArray
    slots: IntArray
    greedy: IntArray
    bound_tokens: float
    current: IntArray | None
    split: Split
    max_lb_slack: float
    time_limit_s: float
    deadline: float
    workers: int
    seed: int
    waves_left: int = 1
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class LayerOutcome:
    """One layer's answer: ``phy2log [P]``, ``shares [P]`` or None, status, max load and bound (tokens)."""

    phy2log: IntArray
    shares: FloatArray | None
    status: LayerStatus
    objective: float
    bound: float
    wall_ms: float


@dataclass(frozen=True)
class LayerPlacement:
    """``phy2log [P]`` and, weighted, ``shares [P]`` of one layer."""

    phy2log: IntArray
    shares: FloatArray | None


@dataclass(frozen=True)
class Balanced:
    """Result of the balance phase: the state, its max load and bound (tokens), status, and whether any
    solver run produced a solution."""

    state: State
    objective: float
    bound: float
    status: LayerStatus
    solver_found: bool


def layer_status(log: SearchLog, objective: float, bound: float) -> LayerStatus:
    """``optimal``: proven (or at the bound); ``feasible``: stopped early, within ``STOP_GAP`` of the bound
    or the solver's own end; ``time_limit``: stopped by the deadline; ``greedy_fallback``: the deadline came
    before any solver solution."""
    if log.proven or objective <= bound * (1 + 1e-9):
        return "optimal"
    if objective <= bound * (1 + STOP_GAP):
        return "feasible"
    if log.timed_out:
        return "time_limit" if log.solutions else "greedy_fallback"
    return "feasible"


def layer_clock(task: LayerTask, started: float) -> Clock:
    """The layer's own deadline: its limit, and an equal share of what is left of the request for it and
    the tasks queued after it."""
    share = (task.deadline - started) / max(1, task.waves_left) if math.isfinite(task.deadline) else math.inf
    return Clock(min(started + task.time_limit_s, started + share, task.deadline), task.cancel)


def solves_whole_layer_at_once(data: LayerData) -> bool:
    """Tiny layers and uniform layers that fit the pattern model skip the neighbourhood search."""
    return data.num_experts * data.num_gpus <= TINY_MAX_PAIRS or fits_pattern_model(data)


def placement_of(data: LayerData, state: State, current: IntArray | None, exact: bool = False) -> LayerPlacement:
    """A state as a placement, relabelled to overlap ``current [P]``; ``exact``: weighted shares in floats
    (see `exact_shares`), else from the state's units."""
    phy2log = phy2log_of(data, state)
    shares = None
    if data.split == "weighted":
        shares = slot_shares(data, phy2log, exact_shares(data, state) if exact else state_shares(data, state))
    if current is not None:
        relabeled, source = relabel_slot_order(phy2log[None, :], current[None, :], data.slots)
        phy2log = relabeled[0]
        shares = None if shares is None else shares[source[0]]
    return LayerPlacement(phy2log, shares)


def _searched_for_balance(
    task: LayerTask, data: LayerData, start: State, clock: Clock, rng: np.random.Generator, log: SearchLog
) -> State:
    """The best state of the neighbourhood search (on uniform loads) and the full model, per layer size."""
    uniform = replace(data, split="uniform")
    best = with_split_of(data, start, uniform)
    stop = task.bound_tokens * (1 + STOP_GAP)
    whole = solves_whole_layer_at_once(data)
    full = whole or data.num_experts * data.num_gpus <= FULL_MODEL_MAX_PAIRS
    if not whole:
        lns_clock = clock.until(FULL_AFTER_LNS_FRACTION) if full else clock
        found = large_neighbourhood_search(uniform, start, lns_clock, BALANCE, rng, log, stop)
        searched = with_split_of(data, found, uniform)
        if returned_max_load(data, searched) <= returned_max_load(data, best):
            best = searched
    if full and returned_max_load(data, best) > stop:
        best = full_solve(data, best, clock, BALANCE, task.workers, task.seed, log)
    return best


def balance_layer(task: LayerTask, data: LayerData, start: State, clock: Clock, rng: np.random.Generator) -> Balanced:
    """Phase 1: the lowest max load found, with its bound and status."""
    log = SearchLog()
    if float(task.loads.sum()) <= 0:
        log.proven = True
        best = with_split_of(data, start, replace(data, split="uniform"))
    else:
        best = _searched_for_balance(task, data, start, clock, rng, log)
    objective = returned_max_load(data, best)
    rounding = 0 if data.split == "uniform" else data.rounding_units
    bound = min(max(task.bound_tokens, (log.bound_units - rounding) / data.scale), objective)
    return Balanced(best, objective, bound, layer_status(log, objective, bound), log.solutions > 0)


def _relabeled(data: LayerData, state: State, current: IntArray) -> State:
    """``state`` with its GPUs relabelled to overlap ``current [P]`` (shares kept)."""
    placed = placement_of(data, state, current)
    share_eg = None
    if placed.shares is not None:
        share_eg = np.zeros(state.member.shape)
        share_eg[placed.phy2log, np.repeat(np.arange(data.num_gpus), data.slots)] = placed.shares
    return state_from(data, membership(placed.phy2log, data.slots, data.num_experts), share_eg)


def _repaired_or_trimmed(
    data: LayerData, relabeled: State, clock: Clock, goal: Goal, rng: np.random.Generator, log: SearchLog
) -> State:
    """Fewest copies on a large layer. Repair the current placement (remove the overload above the cap at
    the fewest copies: measured 5-8x fewer copies than trimming the balanced placement's); if the repair
    has not removed the overload by the checkpoint, trim the balanced placement's copies instead. On
    uniform loads, which the LP's shares only lower."""
    assert data.current is not None
    uniform = replace(data, split="uniform")
    moved = state_from(uniform, relabeled.member)
    if bool((data.current.sum(axis=0) == data.slots).all()):
        repair = state_from(uniform, data.current)
        repaired = large_neighbourhood_search(uniform, repair, clock.until(REPAIR_FRACTION), goal, rng, log)
        if score(uniform, repaired, goal).primary <= 0:
            moved = repaired
    if score(uniform, moved, goal).primary > 0:
        return relabeled
    moved = large_neighbourhood_search(uniform, moved, clock, goal, rng, log)
    return with_split_of(data, moved, uniform) if score(uniform, moved, goal).primary <= 0 else relabeled


def migrate_layer(
    task: LayerTask, data: LayerData, balanced: Balanced, clock: Clock, rng: np.random.Generator
) -> tuple[State, LayerStatus]:
    """Phase 2: fewest copies from the current placement at max load <= (1 + slack) x the best found.
    Returns the state and the copy-minimizing solve's status."""
    assert task.current is not None
    cap_tokens = (1 + task.max_lb_slack) * balanced.objective
    goal = Goal("moves", math.floor(cap_tokens * data.scale) - data.rounding_units, cap_tokens)
    relabeled = _relabeled(data, balanced.state, task.current)
    log = SearchLog()
    if data.num_experts * data.num_gpus <= TINY_MAX_PAIRS:
        moved = full_solve(data, relabeled, clock, goal, task.workers, task.seed, log)
    else:
        moved = _repaired_or_trimmed(data, relabeled, clock, goal, rng, log)
    if copies(data, moved) == 0:
        log.proven = True
    found = balanced.solver_found or log.solutions > 0
    return moved, layer_status(log, math.inf, balanced.bound) if found else "greedy_fallback"


def solve_layer(task: LayerTask) -> LayerOutcome:
    """Solve one layer: balance, then (with a current placement) fewest copies.

    The neighbourhood search always runs on uniform loads; for weighted layers an LP then sets the shares
    of its placement (weighted neighbourhoods stall: free shares make many GPUs tie at the max, more than
    a neighbourhood holds). The full model, for small layers, runs in the requested split.
    """
    started = time.time()
    clock = layer_clock(task, started)
    data = layer_data(task.loads, task.slots, task.split, task.bound_tokens, task.current)
    uniform = replace(data, split="uniform")
    start = state_from(uniform, start_membership(uniform, task.greedy))
    rng = np.random.default_rng(task.seed + task.index)
    balance_clock = clock if task.current is None else clock.until(MIGRATION_BALANCE_FRACTION)
    balanced = balance_layer(task, data, start, balance_clock, rng)
    best, status = balanced.state, balanced.status
    if task.current is not None:
        best, status = migrate_layer(task, data, balanced, clock, rng)
    objective = returned_max_load(data, best)
    placed = placement_of(data, best, task.current, exact=True)
    return LayerOutcome(
        phy2log=placed.phy2log,
        shares=placed.shares,
        status=status,
        objective=objective,
        bound=min(balanced.bound, objective),
        wall_ms=(time.time() - started) * 1e3,
    )

