"""Comparison reports: every solver on the same windows, side by side, in Markdown, HTML and JSON.

`compare_window` runs the solvers over a sweep of EP sizes and slot counts on one load window;
`compare_log` replays a routing log with each solver on the same rebalancing schedule (`eplb.replay`);
`write_report` turns the runs into `results.json`, `report.md`, a self-contained `report.html` (plots
embedded as PNG data URIs) and the PNG files themselves.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from eplb.budget import GIB, describe_slots, slots_per_gpu
from eplb.errors import EplbError
from eplb.executor import Executor, LocalExecutor, RayExecutor, Report, Task, portable, reopen
from eplb.io.files import output_dir, plural
from eplb.io.logs import RoutingLog
from eplb.replay import Rebalance, Schedule, StepBlock, replay
from eplb.solve import Cluster, CostSetup, solve
from solvers import registry
from solvers.bounds import lower_bound
from solvers.registry import Options, Problem, SolverError, applicable

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary



@dataclass
class ReplayStats:
    """What replaying a routing log adds to a Run (`compare_log`). Per-rebalance lists: [R], one entry
    per rebalance; per-layer lists: [L]. The Run's per-layer means (lb, bound, time_us, ...) average
    the `steps` steps served by the solver's own placements: from the first rebalance's first serving
    step (`first_step`) to the end of the log; the steps before it serve vLLM's initial placement
    whatever the solver, and count only in `lb_all_steps`."""

    steps: int  # steps averaged over
    first_step: int  # step id of the first of them
    rebalance_steps: list[int]  # [R] step ids at which the solver ran
    solve_ms: list[float]  # [R] solver wall time per rebalance, all layers, ms
    layer_solve_ms: list[list[float]]  # [R][L] per layer, ms (greedy: the wall time split evenly)
    bytes_moved: list[float] | None  # [R] bytes of expert weights copied; None without a model
    window_lb: list[float | None]  # [R] mean over the window's layers with tokens of the lb the solver reported
    # on it (`Rebalance.window_lb_mean`); None: no layer had any
    # per-layer lbs below: None for a layer without tokens in any of the steps averaged (no lb, as Run's lb)
    lb_all_steps: list[float | None]  # [L] mean lb over every step of the log
    static_lb: list[float | None]  # [L] the first rebalance's placement kept
    oracle_lb: list[float | None] | None  # [L] every sampled step solved on its own counts (greedy); None: skipped
    oracle_steps: int  # sampled steps behind oracle_lb
    static_time_us: list[float] | None = None  # [L] µs, mean predicted layer time
    oracle_time_us: list[float] | None = None  # [L] µs
    step_time_us: float | None = None  # mean predicted MoE time of a step, all layers, µs
    schedule: dict[str, Any] = field(default_factory=dict)


@dataclass
class Run:
    """One solver on one cluster shape; per-layer lists have one entry per MoE layer.

    On a load window (`compare_window`): lb, bound, gap and times of the placement on that window, solve_ms per
    layer; lb, bound and baseline_lb are None for a layer without tokens (it has no lb, docs/replay.md, as the
    API's per-layer lists say null), and every mean and max leaves it out (`lb_mean_max`). On a routing log
    (`compare_log`): lb, baseline_lb (no EPLB) and time_us are per-layer means over the replayed steps (see
    ReplayStats), bound the mean of each step's lower bound (no placement does better on average), gap and status
    the worst over the rebalances' windows, solve_ms the mean per layer over rebalances, moves the expert copies
    per rebalance ([R], all layers), and `replay` holds the rest.
    """

    solver: str
    ep: int
    slots_per_gpu: list[int]
    lb: list[float | None]
    bound: list[float | None]
    solve_ms: list[float]
    status: list[str]
    gap: list[float]
    baseline_lb: list[float | None]
    time_us: list[float] | None = None
    baseline_time_us: list[float] | None = None
    bottleneck: list[str] | None = None
    moves: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    replay: ReplayStats | None = None

    @property
    def label(self) -> str:
        slots = self.slots_per_gpu
        per = f"{slots[0]}" if len(set(slots)) == 1 else f"{min(slots)}-{max(slots)}"
        return f"EP{self.ep} x {per} slots"


def over_tokens(values: NDArray[np.float64], has_tokens: NDArray[np.bool_]) -> list[float | None]:
    """[L] values as a Run holds them: None where the layer has no tokens (`eplb.evaluate.Balance.has_tokens`)."""
    return [float(v) if t else None for v, t in zip(values.tolist(), has_tokens.tolist(), strict=True)]


def known(values: Sequence[float | None]) -> list[float]:
    """The entries of a Run's per-layer list that hold a number (the layers with tokens)."""
    return [v for v in values if v is not None]


def lb_mean_max(values: Sequence[float | None]) -> tuple[float, float]:
    """(mean, max) of a Run's per-layer lb (or bound) over the layers with tokens, as `Balance.lb_over_tokens`
    takes them; a Run has at least one (`compare_window` refuses a window without tokens, `compare_log` a log
    whose served steps have none)."""
    lb = known(values)
    if not lb:
        raise EplbError("no layer has tokens: no lb to report")
    return float(np.mean(lb)), max(lb)


def parse_solvers(text: str) -> list[str]:
    """`greedy,milp,milp-weighted` -> list, checked against the solvers registered now (`solvers.registry.names`:
    one registered at run time too; a solver listed twice is refused: it ran twice). What each solver needs of
    the comparison is `refuse_solvers`'."""
    choices = ", ".join(registry.names())
    items = [s.strip() for s in text.split(",")]
    names = [s for s in items if s]
    bad = [s for s in names if s not in registry.names()]
    if not names:
        raise EplbError(f"--solvers {text!r} names no solver: choose from {choices}")
    if len(names) < len(items):  # 'greedy,,' compared one solver, then said only 'nothing to compare'
        raise EplbError(f"--solvers {text!r} has an empty item: give solver names separated by single commas "
                        f"(choose from {choices})")
    if bad:
        raise EplbError(f"--solvers names {plural(len(bad), 'unknown solver')} ({', '.join(map(repr, bad))}): "
                        f"choose from {choices}")
    refuse_repeats(names, "--solvers")
    return names


def refuse_solvers(
    solvers: Sequence[str],
    shapes: Sequence[tuple[int, NDArray[np.int64]]],
    num_experts: int,
    time_limit_s: float | None,
    *,
    log: RoutingLog | None = None,
    coactivation: bool = False,
) -> None:
    """EplbError, before any solve, for a solver the comparison cannot give what it needs, saying why: on one
    window (log None) a solver that edits a serving placement (incremental: there is none; a log's replay gives
    it one) or that needs co-activation pair counts without `coactivation` (the window's summary); on a log, such
    a solver unless the log holds its tokens (`eplb.replay.run.TOKEN_LOG_MAX`); and a cluster shape a solver does
    not take (deepseek with uneven slots, ...), named by its EP size and slots. Unknown names: SolverError's
    message, as an EplbError."""
    from eplb.replay.run import TOKEN_LOG_MAX, _token_picks

    for name in solvers:
        try:
            caps = registry.get_solver(name).capabilities
        except SolverError as exc:
            raise EplbError(str(exc)) from None
        if log is None and caps.requires_current:
            raise EplbError(f"solver {name!r} edits the placement being served, and a window comparison has none: "
                            "compare it replaying a routing log (eplb compare --log FILE), where each rebalance "
                            "starts from the serving placement")
        if caps.coactivation and log is None and not coactivation:
            raise EplbError(f"solver {name!r} co-locates experts chosen together and needs the window's co-activation "
                            "data: give --coactivation FILE (a summary or a token-level log), or compare it replaying "
                            "a token-level log (--log)")
        if caps.coactivation and log is not None:
            picks = _token_picks(log.info)
            if picks is None or picks > TOKEN_LOG_MAX:
                raise EplbError(f"{log.info.path}: {name} needs the log's tokens (a token-level log with at most "
                                f"{TOKEN_LOG_MAX:,} picks): use a token-level log, cut it, or another solver")
        options = applicable(name, Options(time_limit_s=time_limit_s))
        for ep, slots in shapes:
            total = int(slots.sum())
            problem = Problem(np.zeros((1, num_experts)), slots,
                              current_phy2log=np.zeros((1, total), dtype=np.int64) if log is not None else None,
                              coactivation=np.zeros((1, num_experts, num_experts)) if caps.coactivation else None)
            try:
                registry.check(name, problem, options)
            except SolverError as exc:
                raise EplbError(f"EP{ep} ({describe_slots(slots)}): {exc}") from None


def refuse_repeats(values: Sequence[object], flag: str) -> None:
    """EplbError naming `flag` and the first value it lists twice: a sweep entry given twice ran twice, silently
    (`--ep 4,4`, `--solvers greedy,greedy`)."""
    seen: set[object] = set()
    for v in values:
        if v in seen:
            raise EplbError(f"{flag} lists {v} twice: give each once")
        seen.add(v)


def cluster_shapes(
    num_experts: int, eps: Sequence[int], redundant: Sequence[int] | None, flags: tuple[str, str] | None = None
) -> list[tuple[int, NDArray[np.int64]]]:
    """(EP, slots per GPU) for every EP and redundancy; redundancy None: `slots_per_gpu`'s default. flags: what
    the messages call the EP sizes and the redundant counts (the CLI: ("--ep", "--redundant")); by default the
    quantities."""
    ep_name, redundant_name = flags or ("EP sizes", "redundancy")
    if not eps or (redundant is not None and not redundant):
        raise EplbError(f"no cluster shape to compare: no {ep_name if not eps else redundant_name} given")
    shapes = []
    for ep in eps:
        if ep < 1:
            raise EplbError(f"{ep_name} must be >= 1, got {ep}")
        for r in redundant if redundant is not None else [None]:
            names = {"num_gpus": ep_name, "num_redundant": f"{redundant_name} at EP{ep}"}  # what failed, where
            shapes.append((ep, slots_per_gpu(ep, num_experts, num_redundant=r, names=names)))
    return shapes


def compare_window(
    loads: NDArray[np.float64],
    shapes: Sequence[tuple[int, NDArray[np.int64]]],
    solvers: Sequence[str],
    cost: CostSetup | None,
    time_limit_s: float | None = None,
    progress: bool | None = None,
    executor: Executor | None = None,
    objectives: Sequence[str] = ("lb",),
    coactivation: CoactivationSummary | None = None,
) -> list[Run]:
    """Run every solver with every objective on every cluster shape for loads [layers, E]: one task per
    (shape, solver, objective) on `executor` (default: here, in order); the runs come back in that order
    whatever the executor. A run with the time objective is named "SOLVER+time". A window without any token is
    refused (no layer has an lb to compare)."""
    if not (loads > 0).any():
        raise EplbError("the load window has no tokens (every load is 0): no layer has an lb to compare")
    refuse_solvers(solvers, shapes, loads.shape[1], time_limit_s, coactivation=coactivation is not None)
    ex = executor or LocalExecutor()
    tasks = window_tasks(loads, shapes, solvers, cost, time_limit_s, objectives, coactivation, ex)
    return ex.map(_window_run, tasks, label="compare", progress=progress)


WindowTask = tuple[NDArray[np.float64], int, NDArray[np.int64], str, "CostSetup | None", "float | None", str,
                   "CoactivationSummary | None"]


def window_tasks(
    loads: NDArray[np.float64],
    shapes: Sequence[tuple[int, NDArray[np.int64]]],
    solvers: Sequence[str],
    cost: CostSetup | None,
    time_limit_s: float | None,
    objectives: Sequence[str],
    coactivation: CoactivationSummary | None,
    executor: Executor,
) -> list[Task[WindowTask]]:
    """`compare_window`'s tasks for `_window_run`, one per (shape, solver, objective), with CPU hints."""
    layers = loads.shape[0]
    return [Task((loads, ep, slots, name, cost, time_limit_s, objective, coactivation),
                 note=f"EP{ep} {_run_name(name, objective)}", cpus=_cpus(name, layers, executor))
            for ep, slots in shapes for name in solvers for objective in objectives]  # fmt: skip


def _run_name(solver: str, objective: str) -> str:
    return solver if objective == "lb" else f"{solver}+{objective}"


def _cpus(solver: str, layers: int, ex: Executor) -> float:
    """CPUs a task of `solver` on `layers` layers occupies: the MILP solves layers on threads (as many
    as the cores it sees), the others run on one."""
    return float(min(layers, ex.node_cpus())) if solver.startswith("milp") else 1.0


def _window_run(arg: WindowTask, report: Report) -> Run:
    """One solver with one objective on one cluster shape (a `compare_window` task)."""
    loads, ep, slots, name, cost, time_limit_s, objective, coactivation = arg
    options = applicable(name, Options(time_limit_s=time_limit_s))
    outcome = solve(loads, Cluster(slots), solver=name, cost=cost, options=options, objective=objective,
                    coactivation=coactivation)
    info = outcome.solver
    layers = loads.shape[0]
    tokens = outcome.balance.has_tokens  # the others have no lb, and no bound on it
    run = Run(
        solver=_run_name(name, objective),
        ep=ep,
        slots_per_gpu=slots.tolist(),
        lb=over_tokens(outcome.balance.lb, tokens),
        bound=over_tokens(np.asarray(info["bound"], dtype=np.float64), tokens),
        solve_ms=layer_solve_ms(info, info["wall_ms"], layers),
        status=list(info.get("layer_status", [info["status"]] * layers)),
        gap=list(info["gap"]),
        baseline_lb=over_tokens(outcome.baseline.lb, tokens),
    )
    if outcome.prediction is not None and outcome.baseline_prediction is not None:
        run.time_us = outcome.prediction.time_us.tolist()
        run.baseline_time_us = outcome.baseline_prediction.time_us.tolist()
        run.bottleneck = list(outcome.prediction.bottleneck)
    if outcome.copies is not None:
        run.extra["copies_per_token"] = outcome.copies["gpus"].tolist()
    return run


def layer_solve_ms(info: dict[str, Any], wall_ms: float, layers: int) -> list[float]:
    """[L] ms per layer of one solve that took `wall_ms` in all: the solver's own time on each layer (`layer_ms`:
    the MILP's per-layer solves, which run on parallel threads; the other solvers' wall time split evenly) plus
    what of `wall_ms` they leave uncovered, split evenly: the time objective's candidates and their predicted
    times, relabelling to the serving placement, evaluation, the cost trigger's other candidates. So they add up
    to at least the whole solve's wall time (exactly, for solvers without per-layer times)."""
    own = np.asarray(info.get("layer_ms", [info["wall_ms"] / layers] * layers), dtype=np.float64)
    rest = max(0.0, float(wall_ms) - float(own.sum()))
    out: list[float] = np.round(own + rest / layers, 3).tolist()
    return out


_STATUS_ORDER = ("greedy_fallback", "time_limit", "feasible", "optimal", "heuristic")
"""Solver statuses from worst to best: a log run's per-layer status is the worst over its rebalances."""


class _LogView(RoutingLog):
    """A routing log cut to its first `layers` layers (None: all), calling `tap(start, counts)` with
    every chunk read (positions from 0, counts [n, layers, E]) when tap is set."""

    def __init__(self, log: RoutingLog, layers: int | None) -> None:
        self.inner = log
        self.layers = layers
        info = log.info
        if layers is not None:
            ids = None if info.layer_ids is None else info.layer_ids[:layers]
            info = replace(info, num_layers=layers, layer_ids=ids)
        self.info = info
        self.tap: Callable[[int, NDArray[Any]], None] | None = None

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        for chunk in self.inner.iter_counts(chunk_steps):
            counts = chunk.counts if self.layers is None else chunk.counts[:, : self.layers]
            if self.tap is not None:
                self.tap(chunk.start, counts)
            yield chunk.steps, counts


class _StepBounds:
    """Sum over steps from position `start` on of each step's lower bound on lb, per layer: the
    bound of `solvers.bounds.lower_bound` on that step's counts over its mean GPU load (a layer without
    tokens that step has no lb and is left out, as in the lb means). Uniform shares and weighted shares
    (valid for any placement) apart."""

    def __init__(self, slots: NDArray[np.int64], start: int, layers: int) -> None:
        self.slots, self.start = slots, start
        self.sums = {"uniform": np.zeros(layers), "weighted": np.zeros(layers)}
        self.counts = np.zeros(layers, dtype=np.int64)  # step-layers with tokens
        self.steps = 0

    def mean(self, split: str) -> list[float | None]:
        """[L] the mean bound over the step-layers with tokens (None for a layer that never has any: no lb)."""
        means = np.divide(self.sums[split], self.counts, out=np.ones(self.counts.size), where=self.counts > 0)
        return [float(m) if n else None for m, n in zip(means, self.counts, strict=True)]

    def __call__(self, pos: int, counts: NDArray[Any]) -> None:
        keep = counts[max(0, self.start - pos) :]
        if not keep.shape[0]:
            return
        n, layers, experts = keep.shape
        flat = keep.reshape(n * layers, experts).astype(np.float64)
        mean = flat.sum(axis=1) / self.slots.size
        for split, total in self.sums.items():
            bound = lower_bound(flat, self.slots, split=split)  # type: ignore[arg-type]
            lb = np.divide(bound, mean, out=np.zeros_like(bound), where=mean > 0)
            total += lb.reshape(n, layers).sum(axis=0)
        self.counts += (mean > 0).reshape(n, layers).sum(axis=0)
        self.steps += n


class _LayerMeans:
    """Per-layer sums of a replay's StepBlocks over positions >= start (and of lb over all steps). Values are
    NaN where a step-layer has none (no tokens: no lb; no model: no time) and are left out of its mean."""

    NAMES = ("lb", "static_lb", "no_eplb_lb", "time_us", "static_time_us", "no_eplb_time_us")

    def __init__(self, start: int, layers: int) -> None:
        self.start = start
        names = (*self.NAMES, "oracle_lb", "oracle_time_us", "lb_all")
        self.sums = {name: np.zeros(layers) for name in names}
        self.counts = {name: np.zeros(layers, dtype=np.int64) for name in names}
        self.steps = self.oracle_steps = self.all_steps = 0
        self.first_step: int | None = None

    def _add(self, name: str, values: NDArray[np.float64]) -> None:
        """Add values [n, L], leaving out NaN."""
        known = ~np.isnan(values)
        self.sums[name] += np.where(known, values, 0.0).sum(axis=0)
        self.counts[name] += known.sum(axis=0)

    def __call__(self, block: StepBlock) -> None:
        self._add("lb_all", block.lb)
        self.all_steps += block.num_steps
        keep = slice(max(0, self.start - block.start), None)
        if not block.steps[keep].size:
            return
        if self.first_step is None:
            self.first_step = int(block.steps[keep][0])
        for name in self.NAMES:
            self._add(name, getattr(block, name)[keep])
        self.steps += int(block.steps[keep].size)
        picked = block.oracle_sampled[keep]
        self._add("oracle_lb", block.oracle_lb[keep][picked])
        self._add("oracle_time_us", block.oracle_time_us[keep][picked])
        self.oracle_steps += int(picked.sum())

    def mean(self, name: str) -> list[float] | None:
        """[L] mean over the kept steps that have a value (None when a layer has none: no steps, no oracle, no
        times, or no tokens)."""
        n = self.counts[name]
        if not n.size or (n == 0).any():
            return None
        out: list[float] = (self.sums[name] / n).tolist()
        return out

    def layer_means(self, name: str) -> list[float | None] | None:
        """[L] mean over the kept steps that have a value, None for a layer that has none (an lb of a layer
        without tokens in any of them); None when no layer has any (no steps, or the oracle skipped)."""
        n = self.counts[name]
        if not n.any():
            return None
        means = np.divide(self.sums[name], n, out=np.zeros(n.size), where=n > 0)
        return [float(m) if c else None for m, c in zip(means, n, strict=True)]


def compare_log(
    log: RoutingLog,
    shapes: Sequence[tuple[int, NDArray[np.int64]]],
    solvers: Sequence[str],
    cost: CostSetup | None,
    time_limit_s: float | None = None,
    *,
    schedule: Schedule | None = None,
    oracle_every: int = 10,
    layers: int | None = None,
    progress: bool | None = None,
    executor: Executor | None = None,
) -> list[Run]:
    """Replay a routing log [steps, L, E] with every solver on every cluster shape, all on the same
    schedule (`eplb.replay.replay`), and summarize each replay as a Run (see Run and ReplayStats).
    Each (shape, solver) replay is one task on `executor` (default: here, in order).

    oracle_every: solve the oracle on every n-th step (0: skip it); it and the no-EPLB baseline do not
    depend on the solver, so only the first solver of each shape computes them and the others share
    them. layers: replay only the first `layers` layers (quicker MILP runs). Raises EplbError when no
    rebalanced placement serves a step of the log (the log is shorter than the schedule's first
    rebalance plus its delay)."""
    sched = schedule or Schedule()
    sched.check()
    if layers is not None and not 1 <= layers <= log.info.num_layers:
        raise EplbError(f"layers must be between 1 and the log's {log.info.num_layers}, got {layers}")
    refuse_solvers(solvers, shapes, log.info.num_experts, time_limit_s, log=log)
    view = _LogView(log, layers)
    served_from = sched.first_position + sched.delay
    num_steps = view.info.num_steps
    if num_steps is not None and served_from >= num_steps:
        raise EplbError(_too_short(num_steps, sched))
    ex = executor or LocalExecutor()
    sent = portable(log) if isinstance(ex, RayExecutor) else log
    tasks = [
        Task(_LogTask(sent, layers, ep, slots, name, cost, time_limit_s, sched, oracle_every, i == 0, served_from),
             units=num_steps, note=f"EP{ep} {name}", cpus=_cpus(name, view.info.num_layers, ex))
        for ep, slots in shapes for i, name in enumerate(solvers)
    ]  # fmt: skip
    done = iter(ex.map(_log_task, tasks, label="compare", unit="steps", progress=progress))
    runs: list[Run] = []
    for ep, slots in shapes:
        shared: _LayerMeans | None = None
        bounds: _StepBounds | None = None
        for name in solvers:
            split = "weighted" if registry.get_solver(name).capabilities.shares else "uniform"
            means, tapped, rebalances, schedule_info = next(done)
            shared, bounds = shared or means, bounds or tapped
            assert bounds is not None
            runs.append(_log_run(name, ep, slots, split, rebalances, means, shared, bounds, schedule_info))
    return runs


def _too_short(num_steps: int, sched: Schedule) -> str:
    """Why no rebalanced placement serves a step of a `num_steps`-step log under `sched`, and what would help: the
    first rebalance comes at step position 1 at the earliest (it needs a step before it) and its placement serves
    `delay` steps later, so a log needs more than first + delay steps; no schedule fits a 1-step log."""
    first, delay = sched.first_position, sched.delay
    served_from = first + delay
    at = "--first-rebalance" if sched.first is not None else "--interval"
    head = (f"the log has {plural(num_steps, 'step')} but the first rebalanced placement serves from step position "
            f"{served_from:,} ({at} {first:,}, --delay {delay})")
    longer = f"a log of more than {plural(served_from, 'step')}"
    last = num_steps - 1  # the last position a placement could serve
    if last < 1:
        least = "" if served_from == 1 else " (or of 2 steps or more with --first-rebalance 1 --delay 0)"
        return (f"{head}: a rebalance needs a step before it and a step its placement serves, so no schedule fits "
                f"{plural(num_steps, 'step')}: give {longer}{least}")
    if delay <= last - 1:
        fix = "give --first-rebalance " + ("1" if last - delay == 1 else f"{last - delay:,} or less")
    else:
        fix = "give --delay " + ("0" if last == 1 else f"{last - 1:,} or less") + " with --first-rebalance 1"
    return f"{head}: {fix}, or {longer}"


@dataclass(frozen=True)
class _LogTask:
    """One `compare_log` replay: the log (or its path), its first `layers` layers, one solver on one
    shape; `first`: the shape's first solver, which also computes the oracle and the step bounds."""

    log: RoutingLog | str
    layers: int | None
    ep: int
    slots: NDArray[np.int64]
    solver: str
    cost: CostSetup | None
    time_limit_s: float | None
    schedule: Schedule
    oracle_every: int
    first: bool
    served_from: int


def _log_task(
    task: _LogTask, report: Report
) -> tuple[_LayerMeans, _StepBounds | None, list[Rebalance], dict[str, Any]]:
    """Replay one solver on one shape: (per-layer sums, step bounds of the first solver, rebalances,
    the summary's schedule); `replay` warms the process up first (`eplb.replay.run.warm_up`)."""
    view = _LogView(reopen(task.log), task.layers)
    layers = view.info.num_layers
    means = _LayerMeans(task.served_from, layers)
    bounds = _StepBounds(task.slots, task.served_from, layers) if task.first else None
    view.tap = bounds
    result = replay(
        view, Cluster(task.slots), schedule=task.schedule, solver=task.solver, cost=task.cost,
        oracle_every=task.oracle_every if task.first else 0, time_limit_s=task.time_limit_s,
        on_steps=means, progress=report, hindsight=False,
    )  # fmt: skip
    if means.steps == 0:
        raise EplbError(_too_short(means.all_steps, task.schedule))
    return means, bounds, result.rebalances, result.summary["schedule"]


def _log_run(
    name: str,
    ep: int,
    slots: NDArray[np.int64],
    split: str,
    rebalances: Sequence[Rebalance],
    means: _LayerMeans,
    shared: _LayerMeans,
    bounds: _StepBounds,
    schedule: dict[str, Any],
) -> Run:
    """A Run from one replay: `means` its own per-layer sums, `shared` the ones holding the oracle."""
    lb = means.layer_means("lb")
    if lb is None:  # a layer without tokens in every served step has no lb (None), as in a window report
        raise EplbError("compare --log: no layer has tokens in any step after the first rebalance, so there is no "
                        "realized lb; use a longer log or an earlier --first-rebalance")
    layers = len(lb)
    infos = [rb.solver_info for rb in rebalances]
    layer_ms = [layer_solve_ms(rb.solver_info, rb.solve_ms, layers) for rb in rebalances]
    statuses = [list(info.get("layer_status", [info["status"]] * layers)) for info in infos]
    rank = {name: i for i, name in enumerate(_STATUS_ORDER)}  # worst first; unknown names rank last
    # no rebalance: every check kept the serving placement (the cost trigger, or windows without tokens)
    status = [min((s[i] for s in statuses), key=lambda x: rank.get(x, len(rank))) for i in range(layers)] if (
        statuses) else ["no_rebalance"] * layers
    time_us = means.mean("time_us")
    moved = [rb.bytes_moved for rb in rebalances if rb.bytes_moved is not None]
    stats = ReplayStats(
        steps=means.steps,
        first_step=int(means.first_step or 0),
        rebalance_steps=[rb.step for rb in rebalances],
        solve_ms=[rb.solve_ms for rb in rebalances],
        layer_solve_ms=layer_ms,
        bytes_moved=moved if len(moved) == len(rebalances) else None,
        window_lb=[rb.window_lb_mean for rb in rebalances],
        lb_all_steps=means.layer_means("lb_all") or [],
        static_lb=means.layer_means("static_lb") or [],
        oracle_lb=shared.layer_means("oracle_lb"),
        oracle_steps=shared.oracle_steps,
        static_time_us=means.mean("static_time_us"),
        oracle_time_us=shared.mean("oracle_time_us"),
        step_time_us=None if time_us is None else float(sum(time_us)),
        schedule=schedule,
    )
    return Run(
        solver=name,
        ep=ep,
        slots_per_gpu=slots.tolist(),
        lb=list(lb),
        bound=list(bounds.mean(split)),
        solve_ms=np.mean(layer_ms, axis=0).tolist() if layer_ms else [0.0] * layers,
        status=status,
        gap=np.max([info["gap"] for info in infos], axis=0).tolist() if infos else [0.0] * layers,
        baseline_lb=list(means.layer_means("no_eplb_lb") or []),
        time_us=time_us,
        baseline_time_us=means.mean("no_eplb_time_us"),
        moves=[rb.moves for rb in rebalances],
        replay=stats,
    )


# ----- verdict and tables --------------------------------------------------------------------------------


def verdict(runs: Sequence[Run]) -> list[str]:
    """Sentences comparing whatever ran on each cluster shape: each SOLVER+time run against SOLVER's (predicted
    time, lb, copies per token); within each objective, every solver against the reference (greedy when it ran,
    else the first solver): on lb for the lb objective, on predicted time for the time objective, with solve
    times. For a log replay, what each solver's placements realized (lb) and cost to roll out (moves)."""
    lines: list[str] = []
    by_shape: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_shape.setdefault(run.label, {})[run.solver] = run
    for label, group in by_shape.items():
        if any(r.replay is not None for r in group.values()):
            lines.extend(_log_verdict(label, group))
            continue
        lines.extend(_objective_verdict(label, group))
        for suffix in ("", "+time"):
            same = {name: r for name, r in group.items() if name.endswith("+time") == (suffix == "+time")}
            if len(same) < 2:
                continue
            ref_name = f"greedy{suffix}" if f"greedy{suffix}" in same else next(iter(same))
            ref = same[ref_name]
            for name, run in same.items():
                if name == ref_name:
                    continue
                if suffix and run.time_us is not None and ref.time_us is not None:
                    lines.append(_time_versus(label, run, ref))
                else:
                    lines.append(_lb_versus(label, run, ref))
    return lines or ["Only one solver ran: nothing to compare."]


LB_DECIMALS = 4
"""Decimals of lb in the verdict and the tables: a layer counts as better or worse only when its lb prints so."""


def _tally(pairs: Sequence[tuple[float, float]]) -> tuple[int, int, int]:
    """(lower, higher, equal) layers of (run's lb, ref's lb) pairs, at the `LB_DECIMALS` the tables print."""
    rounded = [(round(a, LB_DECIMALS), round(b, LB_DECIMALS)) for a, b in pairs]
    lower = sum(1 for a, b in rounded if a < b)
    higher = sum(1 for a, b in rounded if a > b)
    return lower, higher, len(rounded) - lower - higher


def _lb_versus(label: str, run: Run, ref: Run) -> str:
    """One sentence: run against ref on one window, on lb per layer (the layers with tokens), with solve times; a
    layer whose lb prints the same (`LB_DECIMALS`) is matched, neither beaten nor lost."""
    pairs = _lb_pairs(run, ref)
    better, worse, matched = _tally(pairs)
    (r_mean, r_max), (g_mean, g_max) = lb_mean_max(run.lb), lb_mean_max(ref.lb)
    ms, g_ms = float(np.median(run.solve_ms)), float(np.median(ref.solve_ms))
    layers = _layers_text(pairs, run)
    if better == 0:
        how = "matched" if worse == 0 else "did not beat"
        where = "every layer" if worse == 0 else "any layer"
        return (
            f"{label}: {run.solver} {how} {ref.solver} on {where} ({layers}"
            + (f", worse on {worse}" if worse and matched else "")
            + f"; lb max {r_max:.4f} vs {g_max:.4f}); it took a median {ms:,.1f} ms per layer against {ref.solver}'s "
            f"{g_ms:,.2f} ms."
        )
    others = [f"matched on {matched}"] if matched else []
    others += [f"worse on {worse}"] if worse else []
    r_top, g_top = round(r_max, LB_DECIMALS), round(g_max, LB_DECIMALS)
    top = "the same" if r_top == g_top else (
        f"{100 * abs(g_top - r_top) / g_top:.2f}% {'lower' if r_top < g_top else 'higher'}")  # fmt: skip
    return (
        f"{label}: {run.solver} beat {ref.solver} on {better} of {layers}"
        + (f" ({', '.join(others)})" if others else "")
        + f": worst-layer lb {r_max:.4f} vs {g_max:.4f} ({top}), "
        f"mean lb {r_mean:.4f} vs {g_mean:.4f}, at a median {ms:,.1f} ms per layer ({ref.solver} {g_ms:,.2f} ms)."
    )


def _lb_pairs(run: Run, ref: Run) -> list[tuple[float, float]]:
    """(run's lb, ref's lb) of each layer both have one for (the same window's layers with tokens)."""
    return [(a, b) for a, b in zip(run.lb, ref.lb, strict=True) if a is not None and b is not None]


def _layers_text(pairs: Sequence[tuple[float, float]], run: Run) -> str:
    """'8 layers', or '7 layers with tokens' when some layer has none (no lb: left out)."""
    return plural(len(pairs), "layer") + ("" if len(pairs) == len(run.lb) else " with tokens")


def _time_versus(label: str, run: Run, ref: Run) -> str:
    """One sentence: run against ref on one window, on predicted time per layer, lb, copies and solve time."""
    assert run.time_us is not None and ref.time_us is not None
    t, b = np.asarray(run.time_us), np.asarray(ref.time_us)
    faster, slower = int((t < b * (1 - 1e-9)).sum()), int((t > b * (1 + 1e-9)).sum())
    copies = ""
    if "copies_per_token" in run.extra and "copies_per_token" in ref.extra:
        copies = (f", copies per token {np.mean(run.extra['copies_per_token']):.2f} vs "
                  f"{np.mean(ref.extra['copies_per_token']):.2f}")
    ms, g_ms = float(np.median(run.solve_ms)), float(np.median(ref.solve_ms))
    return (
        f"{label}: {run.solver} predicted faster than {ref.solver} on {faster} of {plural(t.size, 'layer')} (slower on "
        f"{slower}): {t.sum() / 1000:,.3f} ms vs {b.sum() / 1000:,.3f} ms per step, lb mean "
        f"{lb_mean_max(run.lb)[0]:.4f} vs {lb_mean_max(ref.lb)[0]:.4f}{copies}; solve {ms:,.2f} vs {g_ms:,.2f} ms "
        "per layer (median)."
    )


def _objective_verdict(label: str, group: dict[str, Run]) -> list[str]:
    """Each "SOLVER+time" run against SOLVER's own (lb objective): predicted time per layer, lb, copies."""
    lines = []
    for name, run in group.items():
        base = group.get(name.removesuffix("+time"))
        if not name.endswith("+time") or base is None or run.time_us is None or base.time_us is None:
            continue
        lines.append(_time_versus(label, run, base))
    return lines


def _moves_text(moves: float, bytes_per_move: float | None) -> str:
    return f"{moves:,.0f}" + ("" if bytes_per_move is None else f" ({moves * bytes_per_move / GIB:,.1f} GiB)")


def _bytes_per_move(r: Run) -> float | None:
    """Bytes of one expert copy (from the replay's bytes moved), None without a model or moves."""
    st = r.replay
    if st is None or st.bytes_moved is None or not r.moves or sum(r.moves) == 0:
        return None
    return sum(st.bytes_moved) / sum(r.moves)


def _log_verdict(label: str, group: dict[str, Run]) -> list[str]:
    """Per cluster shape of a log replay: the baselines, each solver's realized lb and moves, and each
    other solver against greedy (or the first solver)."""
    first = next(iter(group.values()))
    st = first.replay
    assert st is not None
    context = [f"no EPLB {lb_mean_max(first.baseline_lb)[0]:.3f}"]
    if st.oracle_lb is not None:
        context.append(f"oracle {lb_mean_max(st.oracle_lb)[0]:.3f} on {plural(st.oracle_steps, 'sampled step')}")
    context.append(f"lower bound {lb_mean_max(first.bound)[0]:.3f}")
    counts = {name: len(r.moves or []) for name, r in group.items()}
    same_count = len(set(counts.values())) == 1
    parts = []
    for name, r in group.items():
        rs = r.replay
        assert rs is not None and r.moves is not None
        if not r.moves:
            parts.append(f"{name} {lb_mean_max(r.lb)[0]:.3f} with no rebalance (every check kept the serving "
                         "placement)")
            continue
        parts.append(
            f"{name} {lb_mean_max(r.lb)[0]:.3f} (static {lb_mean_max(rs.static_lb)[0]:.3f})"
            + ("" if same_count else f" over {plural(counts[name], 'rebalance')}")
            + f" moving {_moves_text(float(np.median(r.moves)), _bytes_per_move(r))} expert copies and solving in "
            f"{_ms(float(np.median(rs.solve_ms)))} ms per rebalance (medians)"
        )
    lines = [
        f"{label}, replaying {plural(st.steps, 'step')} from step {st.first_step:,}"
        + (f" ({plural(counts[first.solver], 'rebalance')})" if same_count else "")
        + f": mean lb {'; '.join(parts)}; for reference {', '.join(context)}."
    ]
    ref_name = "greedy" if "greedy" in group else first.solver
    ref = group[ref_name]
    for name, r in group.items():
        if name == ref_name:
            continue
        lines.append(_versus(label, name, r, ref_name, ref))
    return lines


def _ms(ms: float) -> str:
    """A solve time in ms: whole ms from 10 ms on, tenths below (greedy's few ms are not '0')."""
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.1f}"


def _versus(label: str, name: str, r: Run, ref_name: str, ref: Run) -> str:
    """One sentence: r against ref on realized lb and moves per rebalance."""
    (r_lb, r_max), (g_lb, g_max) = lb_mean_max(r.lb), lb_mean_max(ref.lb)
    pairs = _lb_pairs(r, ref)
    better, _, _ = _tally(pairs)
    d_lb = (r_lb - g_lb) / g_lb
    lb_word = "the same" if abs(d_lb) < 1e-3 else f"{abs(d_lb):.1%} {'lower' if d_lb < 0 else 'higher'}"
    r_moves = sum(r.moves or [])
    g_moves = sum(ref.moves or [])
    if g_moves:
        d_mv = (r_moves - g_moves) / g_moves
        share = f"{abs(d_mv):.1%}" if abs(d_mv) < 0.1 else f"{abs(d_mv):.0%}"
        mv_word = "as many" if abs(d_mv) < 1e-3 else f"{share} {'fewer' if d_mv < 0 else 'more'}"
    else:
        mv_word = "no moves for either" if r_moves == 0 else "more"
    assert r.replay is not None and ref.replay is not None
    r_ms = float(np.median(r.replay.solve_ms)) if r.replay.solve_ms else 0.0
    g_ms = float(np.median(ref.replay.solve_ms)) if ref.replay.solve_ms else 0.0
    return (
        f"{label}: {name} against {ref_name}: mean realized lb {r_lb:.4f} vs {g_lb:.4f} ({lb_word}; lower on "
        f"{better} of {_layers_text(pairs, r)}, worst layer {r_max:.4f} vs {g_max:.4f}); "
        f"{r_moves:,} vs {g_moves:,} expert copies over the rebalances ({mv_word}); "
        f"solve {_ms(r_ms)} vs {_ms(g_ms)} ms per rebalance (median)."
    )


def _replay_rows(runs: Sequence[Run]) -> list[list[str]]:
    """Log replays: realized lb next to the baselines, moves and solve time per rebalance, time."""
    rows = [["cluster", "solver", "steps", "lb mean", "static", "oracle", "no EPLB", "lower bound", "rebalances",
             "moves / rebalance (median)", "moves (all)", "solve ms / rebalance (median)", "MoE time / step"]]
    for r in runs:
        st = r.replay
        if st is None or r.moves is None:
            continue
        per = _bytes_per_move(r)
        rows.append([
            r.label, r.solver, f"{st.steps:,}", f"{lb_mean_max(r.lb)[0]:.4f}", f"{lb_mean_max(st.static_lb)[0]:.4f}",
            "" if st.oracle_lb is None else f"{lb_mean_max(st.oracle_lb)[0]:.4f}",
            f"{lb_mean_max(r.baseline_lb)[0]:.4f}",
            f"{lb_mean_max(r.bound)[0]:.4f}", f"{len(r.moves)}",
            _moves_text(float(np.median(r.moves)), per) if r.moves else "", _moves_text(float(sum(r.moves)), per),
            f"{np.median(st.solve_ms):,.1f}" if st.solve_ms else "",
            "" if st.step_time_us is None else f"{st.step_time_us / 1000:,.3f} ms",
        ])  # fmt: skip
    return rows


def _moves_rows(runs: Sequence[Run]) -> list[list[str]]:
    """Log replays: expert copies moved at each rebalance (rows) by each run (columns)."""
    replayed = [r for r in runs if r.replay is not None and r.moves is not None]
    steps = sorted({s for r in replayed if r.replay is not None for s in r.replay.rebalance_steps})
    rows = [["rebalance at step"] + [f"{r.label} {r.solver}" for r in replayed]]
    for step in steps:
        row = [f"{step:,}"]
        for r in replayed:
            assert r.replay is not None and r.moves is not None
            at = dict(zip(r.replay.rebalance_steps, r.moves, strict=True))
            row.append("" if step not in at else _moves_text(at[step], _bytes_per_move(r)))
        rows.append(row)
    rows.append(["all"] + [_moves_text(sum(r.moves or []), _bytes_per_move(r)) for r in replayed])
    return rows


def _summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = [["cluster", "solver", "lb mean", "lb max", "bound max", "gap max", "baseline lb max",
             "solve ms/layer (median)", "status", "MoE time / step"]]
    for r in runs:
        statuses = sorted(set(r.status))
        time_text = "" if r.time_us is None else f"{sum(r.time_us) / 1000:,.3f} ms"
        (lb_mean, lb_max), bound, baseline = lb_mean_max(r.lb), lb_mean_max(r.bound), lb_mean_max(r.baseline_lb)
        rows.append([
            r.label, r.solver, f"{lb_mean:.4f}", f"{lb_max:.4f}", f"{bound[1]:.4f}", f"{max(r.gap):.4f}",
            f"{baseline[1]:.3f}", f"{np.median(r.solve_ms):,.2f}", ", ".join(statuses), time_text,
        ])
    return rows


def _markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(out)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ----- plots ---------------------------------------------------------------------------------------------


def _plots(runs: Sequence[Run], out: Path) -> list[tuple[str, str]]:
    """Write PNGs; returns (file name, caption) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    made: list[tuple[str, str]] = []
    shapes = list(dict.fromkeys(r.label for r in runs))
    solvers = list(dict.fromkeys(r.solver for r in runs))
    colors = {s: c for s, c in zip(solvers, ["#4c72b0", "#dd8452", "#55a868", "#c44e52"], strict=False)}

    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 3.2 * len(shapes)), squeeze=False)
    for ax, label in zip(axes[:, 0], shapes, strict=True):
        group = [r for r in runs if r.label == label]
        layers = np.arange(len(group[0].lb))
        for r in group:  # a layer without tokens (None: no lb) is a gap in the line
            ax.plot(layers, np.array(r.lb, dtype=np.float64), marker=".", label=r.solver, color=colors[r.solver])
        ax.plot(layers, np.max(np.array([r.bound for r in group], dtype=np.float64), axis=0), ls="--", color="black",
                label="lower bound")
        oracle = group[0].replay.oracle_lb if group[0].replay is not None else None
        if oracle is not None:
            ax.plot(layers, np.array(oracle, dtype=np.float64), ls=":", color="gray", label="oracle (each step solved)")
        ax.set_title(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("lb (max / mean GPU load)" if group[0].replay is None else "lb, mean over steps")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right" if group[0].replay is None else "best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lb_per_layer.png", dpi=110)
    plt.close(fig)
    made.append(("lb_per_layer.png", "Per-layer lb of each solver next to the best lower bound"))

    replayed = [r for r in runs if r.replay is not None and r.moves is not None]
    if replayed:
        made.append(_moves_plot(replayed, colors, out))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r.label}\n{r.solver}" for r in runs]
    face = [colors[r.solver] for r in runs]
    _boxes(ax1, [known(r.lb) for r in runs], labels, face, "lb over layers", "Spread of lb over layers", log=False)
    _boxes(ax2, [r.solve_ms for r in runs], labels, face, "solve time per layer (ms{scale})",
           "Solve time per layer", log=True)
    fig.tight_layout()
    fig.savefig(out / "spread_and_time.png", dpi=110)
    plt.close(fig)
    made.append(("spread_and_time.png", "lb spread over layers and solve time per layer"))

    timed = [r for r in runs if r.time_us is not None and r.baseline_time_us is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(10, 4))
        eps = sorted({r.ep for r in timed})
        for solver in solvers:
            pts = [(r.ep, sum(r.time_us) / 1000) for r in timed if r.solver == solver and r.time_us is not None]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=solver, color=colors[solver])
        base = sorted({(r.ep, sum(r.baseline_time_us) / 1000) for r in timed if r.baseline_time_us is not None})
        ax.plot(*zip(*base, strict=True), marker="s", ls=":", color="gray", label="no EPLB (contiguous)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(eps, [str(e) for e in eps])
        ax.set_xlabel("EP size (GPUs)")
        ax.set_ylabel("predicted MoE time per step (ms, all layers)")
        ax.set_title("Predicted time by EP size (slowest GPU per layer, summed over layers)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "time_by_ep.png", dpi=110)
        plt.close(fig)
        made.append(("time_by_ep.png", "Predicted MoE time per step by EP size"))
    return made


def _moves_plot(runs: Sequence[Run], colors: dict[str, str], out: Path) -> tuple[str, str]:
    """moves_per_rebalance.png: expert copies moved (left, GiB on a second axis when every run has
    the same bytes per copy) and solver wall time (right) at each rebalance of a log replay."""
    import matplotlib.pyplot as plt

    styles = ["-", "--", "-.", ":"]
    shapes = list(dict.fromkeys(r.label for r in runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        assert r.replay is not None and r.moves is not None
        style = dict(marker="o", ls=styles[shapes.index(r.label) % len(styles)], color=colors[r.solver],
                     label=f"{r.label} {r.solver}")  # fmt: skip
        ax1.plot(r.replay.rebalance_steps, r.moves, **style)
        ax2.plot(r.replay.rebalance_steps, np.asarray(r.replay.solve_ms) / 1000, **style)
    ax1.set_xlabel("log step of the rebalance")
    ax1.set_ylabel("expert copies moved (all layers)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Moves per rebalance")
    per = {round(b, 3) for r in runs if (b := _bytes_per_move(r)) is not None}
    if len(per) == 1 and all(_bytes_per_move(r) is not None for r in runs):
        b = per.pop()
        sec = ax1.secondary_yaxis("right", functions=(lambda m: m * b / GIB, lambda g: g * GIB / b))
        sec.set_ylabel("GiB of expert weights copied")
    scale = _log_y(ax2, [ms for r in runs if r.replay is not None for ms in r.replay.solve_ms])
    ax2.set_xlabel("log step of the rebalance")
    ax2.set_ylabel(f"solver wall time per rebalance (s{scale})")
    ax2.set_title("Solve time per rebalance (all layers)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "moves_per_rebalance.png", dpi=110)
    plt.close(fig)
    return "moves_per_rebalance.png", "Moves and solve time per rebalance of the log replay"


def _log_y(ax: Any, values: Sequence[float]) -> str:
    """A log y axis when some value is > 0, else linear (a log axis of no positive value, e.g. solve times that
    all round to 0 ms, warns and draws nothing): ", log scale" or "", for the axis label."""
    if any(v > 0 for v in values):
        ax.set_yscale("log")
        return ", log scale"
    return ""


def _boxes(ax: Any, data: list[list[float]], labels: list[str], face: list[str], ylabel: str, title: str,
           log: bool) -> None:
    """One box per run, coloured by solver. log: a log y axis when the data allow (`_log_y`); ylabel may hold
    {scale}, filled with what `_log_y` says."""
    box = ax.boxplot(data, positions=list(range(len(data))), patch_artist=True)
    for patch, color in zip(box["boxes"], face, strict=True):
        patch.set_facecolor(color)
    scale = _log_y(ax, [v for d in data for v in d]) if log else ""
    ax.set_xticks(list(range(len(data))), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(ylabel.format(scale=scale))
    ax.set_title(title)
    ax.grid(alpha=0.3)


# ----- writing -------------------------------------------------------------------------------------------


def write_report(runs: Sequence[Run], out: Path, meta: dict[str, Any], what: str = "report directory") -> None:
    """results.json, report.md, report.html (self-contained) and the PNGs into `out` (made with its parents); an
    EplbError naming `what` when they cannot be written (check `out` with `eplb.io.files.output_dir` before the
    work, as `eplb compare --out` does)."""
    out = output_dir(out, what, create=True)
    try:
        _write_report(runs, out, meta)
    except OSError as exc:
        raise EplbError(f"{what} {out}: cannot write the report there ({exc.strerror or exc})") from None


def _write_report(runs: Sequence[Run], out: Path, meta: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": [_run_json(r) for r in runs]}, indent=1) + "\n")
    plots = _plots(runs, out)
    words = verdict(runs)
    tables = [(title, rows) for title, rows in _tables(runs) if len(rows) > 1]
    md = [f"# eplb compare: {meta.get('title', 'solvers side by side')}", ""]
    md += [f"- {line}" for line in words]
    md += ["", "## Setup", ""] + [f"- {k}: {v}" for k, v in meta.items() if k != "title"]
    for title, rows in tables:
        md += ["", f"## {title}", "", _markdown_table(rows)]
    md += [""]
    for name, caption in plots:
        md += [f"## {caption}", "", f"![{caption}]({name})", ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "report.html").write_text(_html(meta, words, tables, plots, out))


def _tables(runs: Sequence[Run]) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of every table the report shows; empty ones (a header only) are dropped."""
    replayed = any(r.replay is not None for r in runs)
    tables = [("Summary", _summary_rows(runs))]
    if replayed:
        tables += [
            ("Log replay: realized lb (mean over the replayed steps and layers), moves and solve time",
             _replay_rows(runs)),
            ("Moves per rebalance (expert copies onto GPUs, all layers)", _moves_rows(runs)),
        ]  # fmt: skip
    tables.append(("Predicted time and its bottleneck", _time_rows(runs)))
    return tables


def speed_words(before: float, after: float) -> str:
    """Time `after` against `before` (same unit) in words: '1.25x faster', '1.05x slower', 'as fast' when the ratio
    rounds to 1.00x, 'n/a' when either is not positive."""
    if not (before > 0 and after > 0):
        return "n/a"
    speed = before / after
    if f"{speed:.2f}" == "1.00" or f"{1 / speed:.2f}" == "1.00":
        return "as fast"
    return f"{speed:.2f}x faster" if speed > 1 else f"{1 / speed:.2f}x slower"


def _time_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = [["cluster", "solver", "MoE time / step", "vs no EPLB", "bottleneck (layers)"]]
    for r in runs:
        if r.time_us is None or r.baseline_time_us is None:
            continue
        counts = {} if r.bottleneck is None else {b: r.bottleneck.count(b) for b in sorted(set(r.bottleneck))}
        rows.append([r.label, r.solver, f"{sum(r.time_us) / 1000:,.3f} ms",
                     speed_words(sum(r.baseline_time_us), sum(r.time_us)),
                     ", ".join(f"{k} {v}" for k, v in counts.items()) or "varies by step (log replay)"])
    return rows


def _run_json(r: Run) -> dict[str, Any]:
    d = asdict(r)
    d.update(d.pop("extra"))
    if d["replay"] is None:  # window runs: the keys they always had
        del d["replay"]
    return d


def _html(
    meta: dict[str, Any], words: list[str], tables: list[tuple[str, list[list[str]]]], plots: list[tuple[str, str]],
    out: Path,
) -> str:
    """The self-contained page: tables inline, plots as PNG data URIs."""
    figures = "".join(
        f"<figure><img alt='{html.escape(cap)}' src='data:image/png;base64,"
        f"{base64.b64encode((out / name).read_bytes()).decode()}'><figcaption>{html.escape(cap)}</figcaption></figure>"
        for name, cap in plots
    )
    setup = "".join(f"<li>{html.escape(str(k))}: {html.escape(str(v))}</li>" for k, v in meta.items() if k != "title")
    verdict_html = "".join(f"<li>{html.escape(w)}</li>" for w in words)
    tables_html = "\n".join(f"<h2>{html.escape(title)}</h2>{_html_table(rows)}" for title, rows in tables)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>eplb compare</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85rem; margin: 1rem 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f2f2f2; }} td:first-child, td:nth-child(2) {{ text-align: left; }}
figure {{ margin: 1.5rem 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; font-size: 0.9rem; }}
.verdict {{ background: #f6f8ff; border-left: 4px solid #4c72b0; padding: 0.5rem 1rem; }}
pre {{ background: #f7f7f7; padding: 0.5rem; font-size: 0.8rem; }}
</style></head><body>
<h1>eplb compare: {html.escape(str(meta.get("title", "solvers side by side")))}</h1>
<div class="verdict"><h2>Verdict</h2><ul>{verdict_html}</ul></div>
<h2>Setup</h2><ul>{setup}</ul>
{tables_html}
{figures}
</body></html>
"""
