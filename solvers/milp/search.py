"""How one layer is searched: large-neighbourhood search (CP-SAT re-solves a few GPUs at a time) and
the full model, each keeping the better of its result and the state it started from."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from solvers.milp.layer import IntArray, LayerData, State, copies, true_loads
from solvers.milp.model import Goal, Solved, build_model, hint_state, solve_model
from solvers.milp.patterns import fits_pattern_model, solve_pattern_model

READBACK_MARGIN_S = 0.02
"""Time kept back from the solver for reading the solution and validating it."""
MIN_SOLVE_S = 0.02
"""Below this much time left, skip the solver and keep what there is."""
LNS_SUB_TIME_S = 0.1
"""Time limit of one neighbourhood solve; pairs of GPUs solve in about 15 ms. Doubled (up to
`LNS_MAX_SUB_TIME_S`) after a solve that ends without even the hinted solution, as on a busy machine."""
LNS_MAX_SUB_TIME_S = 1.0
LNS_MIN_GPUS, LNS_MAX_GPUS = 2, 8
LNS_PATIENCE = 6
"""Neighbourhoods without improvement before the search tries one GPU more."""


@dataclass(frozen=True)
class Clock:
    """A layer's deadline (absolute, ``time.time()``) and the request's cancel event."""

    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event)

    def seconds_left(self) -> float:
        """Seconds the solver may still use (0 once cancelled)."""
        if self.cancel.is_set():
            return 0.0
        return self.deadline - time.time() - READBACK_MARGIN_S

    def until(self, fraction: float) -> Clock:
        """The same clock ending ``fraction`` of the way from now to its deadline."""
        now = time.time()
        return Clock(now + fraction * max(0.0, self.deadline - now), self.cancel)


@dataclass
class SearchLog:
    """What the solves of a search found: solutions, a proof, a time-out, the best bound (model units)."""

    solutions: int = 0
    proven: bool = False
    timed_out: bool = False
    bound_units: float = -math.inf


@dataclass(frozen=True, order=True)
class Score:
    """What a search minimizes, exactly, compared in order. Balance: (max load, GPUs tied at it).
    Moves: (overload tokens above the cap, copies)."""

    primary: float
    secondary: float


def tie_tokens(data: LayerData) -> float:
    """Loads closer than this (model rounding) count as tied."""
    return (data.rounding_units + 1) / data.scale


def score(data: LayerData, state: State, goal: Goal) -> Score:
    """The exact `Score` of a state under ``goal``."""
    loads = true_loads(data, state)
    if goal.kind == "balance":
        top = float(loads.max())
        return Score(top, float(np.count_nonzero(loads >= top - tie_tokens(data))))
    return Score(float(np.maximum(loads - goal.cap_tokens, 0.0).sum()), float(copies(data, state)))


def _balance_gpus(data: LayerData, loads: np.ndarray, size: int) -> list[int]:
    """Every GPU tied at the max (shares equalize loads exactly), leaving room for a light one."""
    order = np.argsort(-loads, kind="stable")
    tied = order[loads[order] >= loads[order[0]] - tie_tokens(data)]
    return [int(g) for g in tied[: max(1, size - 1)]]


def _moves_gpus(
    data: LayerData, state: State, loads: np.ndarray, size: int, cap: float, rng: np.random.Generator
) -> list[int]:
    """The most overloaded GPU and the emptiest (to take its load), then one weighted by its copies."""
    chosen: list[int] = []
    if (loads - cap).max() > 0:
        chosen.append(int(np.argmax(loads - cap)))
        if size > 1 and int(np.argmin(loads)) not in chosen:
            chosen.append(int(np.argmin(loads)))
    assert data.current is not None
    new_pairs = (state.member & ~data.current).sum(axis=0).astype(np.float64)
    if new_pairs.sum() > 0 and len(chosen) < size:
        pick = int(rng.choice(data.num_gpus, p=new_pairs / new_pairs.sum()))
        if pick not in chosen:
            chosen.append(pick)
    return chosen


def neighbourhood(
    data: LayerData, state: State, size: int, rng: np.random.Generator, goal: Goal
) -> tuple[IntArray, IntArray]:
    """The GPUs and the experts a neighbourhood frees: ``(gpus [H], experts [C])``.

    GPUs: `_balance_gpus` or `_moves_gpus`, then some of the emptiest and some at random. Experts: all on
    those GPUs and (moves) those the current placement has there; their replica counts are free.
    """
    loads = true_loads(data, state)
    size = min(size, data.num_gpus)
    if goal.kind == "balance":
        chosen = _balance_gpus(data, loads, size)
    else:
        chosen = _moves_gpus(data, state, loads, size, goal.cap_tokens, rng)
    light = np.argsort(loads, kind="stable")[: max(1, data.num_gpus // 4)]
    while len(chosen) < size:
        pick = int(rng.choice(light if rng.random() < 0.5 else np.arange(data.num_gpus)))
        if pick not in chosen:
            chosen.append(pick)
    gpus = np.array(sorted(chosen), dtype=np.int64)
    free = state.member[:, gpus].any(axis=1)
    if goal.kind == "moves" and data.current is not None:
        free |= data.current[:, gpus].any(axis=1)
    return gpus, np.flatnonzero(free).astype(np.int64)


def _done(best: Score, goal: Goal, stop_at: float) -> bool:
    """Nothing left to gain: the primary score reached ``stop_at`` (moves: also no copy left)."""
    return best.primary <= stop_at and (goal.kind == "balance" or best.secondary <= 0)


def large_neighbourhood_search(
    data: LayerData, state: State, clock: Clock, goal: Goal, rng: np.random.Generator, log: SearchLog,
    stop_at: float = -math.inf,
) -> State:
    """The best state found by re-solving a few GPUs at a time exactly, the rest fixed; a result
    replaces the incumbent when its exact score is no worse. Runs until the clock ends, until `_done`,
    or hands over to the full model once a neighbourhood would hold every GPU."""
    best, best_score = state, score(data, state, goal)
    size, failures, seed, sub_time = LNS_MIN_GPUS, 0, 0, LNS_SUB_TIME_S
    if goal.kind == "moves":
        stop_at = max(stop_at, 0.0)  # no overload and no copy cannot be improved
    while not _done(best_score, goal, stop_at):
        if size >= data.num_gpus:  # the neighbourhood is the whole layer: solve it once
            return full_solve(data, best, clock, goal, 1, seed, log)
        if clock.seconds_left() < MIN_SOLVE_S:
            log.timed_out = True
            break
        gpus, experts = neighbourhood(data, best, size, rng, goal)
        built = build_model(data, best, gpus, experts, goal)
        hint_state(built, best)
        left = clock.seconds_left()
        if left < MIN_SOLVE_S:
            log.timed_out = True
            break
        seed += 1
        solved = solve_model(data, best, built, min(left, sub_time), 1, seed)
        improved = False
        if solved.state is None and solved.timed_out:
            sub_time = min(2 * sub_time, LNS_MAX_SUB_TIME_S)
        if solved.state is not None:
            log.solutions += 1
            found = score(data, solved.state, goal)
            improved = found < best_score
            if found <= best_score:
                best, best_score = solved.state, found
        failures = 0 if improved else failures + 1
        if failures >= LNS_PATIENCE:
            size, failures = (size + 1 if size < LNS_MAX_GPUS else LNS_MIN_GPUS), 0
    return best


def _solve_whole_layer(data: LayerData, state: State, goal: Goal, clock: Clock, workers: int, seed: int) -> Solved:
    """One full-model run until the clock ends (model building included): the pattern model for small
    uniform balance problems, else the x[e, g] model."""
    if goal.kind == "balance" and fits_pattern_model(data):
        return solve_pattern_model(data, state, clock.seconds_left, workers, seed)
    everything = np.arange(data.num_gpus, dtype=np.int64)
    built = build_model(data, state, everything, np.arange(data.num_experts, dtype=np.int64), goal)
    hint_state(built, state)
    return solve_model(data, state, built, clock.seconds_left(), workers, seed)


def full_solve(
    data: LayerData, state: State, clock: Clock, goal: Goal, workers: int, seed: int, log: SearchLog
) -> State:
    """The better of ``state`` and one full-model solve hinted with it."""
    if clock.seconds_left() < MIN_SOLVE_S:
        log.timed_out = True
        return state
    solved = _solve_whole_layer(data, state, goal, clock, workers, seed)
    log.timed_out = solved.timed_out
    log.proven = solved.proven
    log.bound_units = solved.bound
    if solved.state is None:
        return state
    log.solutions += 1
    return solved.state if score(data, solved.state, goal) <= score(data, state, goal) else state
