"""Offline replay of a routing log with rebalancing, next to four baselines.

Schedule (positions count logged steps from 0; docs/replay.md):
- checks run at positions `first, first + interval, first + 2 interval, ...` (`first` defaults to
  `interval`, so the first one has a full interval of history); the trigger decides whether a check
  rebalances (periodic: always; threshold: recent realized lb above X; cost: the predicted time saved
  over the next interval exceeds the predicted migration cost);
- the check at position s sees only the steps before it: positions max(0, s - window) .. s - 1
  (optionally EWMA-weighted). Step s itself is never in its own window: no lookahead;
- the placement it computes serves from position s + delay (default 1), or later when its weight
  copies overlap serving and take longer (steps of the last step with tokens' predicted time); no check
  runs while copies are in flight; with a cost model, a check whose window has no tokens keeps the placement;
- a rebalance whose copies are still in flight when the log ends never serves: it is marked
  (`Rebalance.served` False) and not charged (rebalances are charged when their placement starts serving);
- before the first placement applies, the cluster serves vLLM's initial placement.

Rows on the same log and cluster: no EPLB (experts in id order), static (the first rebalance's placement
kept), the replay, hindsight (each interval between checks served by greedy solved on that interval's
own summed counts: the ceiling of any placement held over an interval) and the per-step oracle (greedy on
every step's own counts). Per step and layer: realized lb (NaN where the layer has no tokens that step: no
lb, left out of the lb statistics; the step still counts, with its time) and predicted layer time
(`eplb.cost.TimeModel`); per rebalance: moves, bytes, transfer time, the time charged for it, solve time.
Total simulated time = every step's MoE time + migration charges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits

from eplb import trigger
from eplb.cost.migration import MigrationCost, MigrationSpec
from eplb.errors import EplbError
from eplb.evaluate import contiguous_placement
from eplb.io.logs import CountsChunk, LogInfo, RoutingLog, as_log
from eplb.placement import Placement
from eplb.replay.evaluate import Evaluator, oracle, time_model
from eplb.replay.schedule import Schedule, Window
from eplb.replay.summary import BASELINES, RowStats, weight_reads_note
from eplb.solve import Cluster, CostSetup, Outcome, check_links, check_objective, evaluate, model_mismatch, solve
from solvers import registry
from solvers.registry import Options, applicable

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary

__all__ = [
    "BASELINES",
    "Rebalance",
    "ReplayResult",
    "StepBlock",
    "blas_threads",
    "initial_placement",
    "predict_time_us",
    "replay",
]

LogSource = RoutingLog | str | Path | NDArray[Any] | Iterable[NDArray[Any]]
def _moves(outcome: Outcome) -> int:
    return 0 if outcome.moves is None else int(outcome.moves.sum())


@dataclass(frozen=True)
class Rebalance:
    """One rebalance. position/step: where it ran (log position, step id); applies_from: first
    position it serves; window_steps: steps it saw; moves: expert copies onto GPUs, all layers
    ([layers] in moves_per_layer); bytes_moved: moves x one expert's bytes (None without a model);
    transfer_s: how long the copies take; charge_s: serving time charged for them; saving_s: the
    predicted time saved over the next interval (cost trigger); solve_ms: the solver's wall time
    (relabelling and, for the cost trigger, every budget tried); window_lb: [layers] lb the solver
    reports on its own window, NaN for a layer without tokens there (`Balance.has_tokens`: it has no lb, as in
    StepBlock; `window_lb_mean` leaves it out); solver_info: the solver's report (`eplb.solve.Outcome.solver`);
    served: False when the log ended while its copies were in flight (its placement never served; charge_s 0)."""

    position: int
    step: int
    applies_from: int
    window_steps: int
    moves: int
    moves_per_layer: NDArray[np.int64]
    bytes_moved: float | None
    solve_ms: float
    window_lb: NDArray[np.float64]
    solver_info: dict[str, Any] = field(default_factory=dict)
    transfer_s: float | None = None
    charge_s: float | None = None
    saving_s: float | None = None
    served: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "position": self.position,
            "applies_from": self.applies_from,
            "window_steps": self.window_steps,
            "moves": self.moves,
            "bytes_moved": self.bytes_moved,
            "transfer_s": self.transfer_s,
            "charge_s": self.charge_s,
            "saving_s": self.saving_s,
            "solve_ms": self.solve_ms,
            "window_lb_mean": self.window_lb_mean,
            "served": self.served,
        }

    @property
    def window_lb_mean(self) -> float | None:
        """Mean of `window_lb` over the layers with tokens in the window (the rule of every lb mean); None when
        none has any (a check without a cost model rebalances on such a window too: docs/replay.md)."""
        mean = float(_nan_mean(self.window_lb, axis=0))
        return None if np.isnan(mean) else mean


@dataclass(frozen=True)
class StepBlock:
    """Per step and layer results for consecutive steps. start: position of the first step;
    steps: [n] step ids; lb, static_lb, no_eplb_lb, hindsight_lb, oracle_lb: [n, layers] realized lb
    (NaN where not evaluated or the layer has no tokens that step); time_us: [n, layers] the replay's predicted
    layer time (NaN without a cost model); *_time_us of the other rows likewise; oracle_sampled: [n] the steps the
    oracle solved (its rows' statistics cover only those)."""

    start: int
    steps: NDArray[np.int64]
    lb: NDArray[np.float64]
    static_lb: NDArray[np.float64]
    no_eplb_lb: NDArray[np.float64]
    hindsight_lb: NDArray[np.float64]
    oracle_lb: NDArray[np.float64]
    time_us: NDArray[np.float64]
    static_time_us: NDArray[np.float64]
    no_eplb_time_us: NDArray[np.float64]
    hindsight_time_us: NDArray[np.float64]
    oracle_time_us: NDArray[np.float64]
    oracle_sampled: NDArray[np.bool_]

    @property
    def num_steps(self) -> int:
        return int(self.steps.size)

    def row(self, name: str) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(lb, time_us) [n, layers] of summary row `name` (one of BASELINES)."""
        prefix = "" if name == "replay" else f"{name}_"
        lb: NDArray[np.float64] = getattr(self, f"{prefix}lb")
        t: NDArray[np.float64] = getattr(self, f"{prefix}time_us")
        return lb, t

    def add_to(self, stats: dict[str, RowStats]) -> None:
        """Add every row's lb and time to its statistics (the oracle's sampled steps only)."""
        for name in BASELINES:
            stats[name].add(*self.row(name), rows=self.oracle_sampled if name == "oracle" else None)

    @staticmethod
    def concat(blocks: list[StepBlock]) -> StepBlock:
        names = [f.name for f in StepBlock.__dataclass_fields__.values() if f.name not in ("start", "steps")]
        arrays = {n: np.concatenate([getattr(b, n) for b in blocks]) for n in names}
        return StepBlock(blocks[0].start, np.concatenate([b.steps for b in blocks]), **arrays)


@dataclass
class ReplayResult:
    """What a replay produced. summary: the JSON-ready summary (`summary.json`); steps: every
    step's results when the replay was run with collect=True; checks: every check's position, step id
    and decision."""

    info: LogInfo
    cluster: Cluster
    schedule: Schedule
    solver: str
    rebalances: list[Rebalance]
    summary: dict[str, Any]
    final: Placement
    static: Placement | None
    steps: StepBlock | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)


ReachOf = Callable[[int, NDArray[np.int64]], NDArray[np.float64]]
"""(i, phy2log [L, P]) -> the reach [L, G] of step i under that placement (`oracle`'s reach_of)."""
COPY_ROWS = ("replay", "static", "no_eplb", "hindsight")
"""The rows whose copies per token a token-level log's replay counts, in `_Replay.placements` order."""

TOKEN_LOG_MAX = 50_000_000
"""Picks (tokens x layers x k) of a token-level log held in memory to count copies per token."""


def _token_routing(info: LogInfo) -> tuple[NDArray[np.int16], NDArray[np.int64]] | None:
    """(topk_ids [tokens, L, k], step_offsets [steps + 1]) of a token-level log small enough to hold, else None;
    L is info.num_layers, the file's first layers (`eplb compare --layers` replays a log cut to its first L)."""
    if info.kind != "topk":
        return None
    import zipfile

    from eplb.coactivation import read_topk

    with zipfile.ZipFile(info.path) as archive:  # the array's size before reading it (the log is validated already)
        stored = archive.getinfo("topk_ids.npy").file_size
    if stored > TOKEN_LOG_MAX * 8:  # at most 8 bytes per pick in the file
        return None
    ids, offsets = read_topk(info.path)
    if ids.shape[1] > info.num_layers:
        ids = np.ascontiguousarray(ids[:, : info.num_layers])
    return (ids, offsets) if ids.size <= TOKEN_LOG_MAX else None


def _token_picks(info: LogInfo) -> int | None:
    """Picks (tokens x layers x k) of a token-level log's ``topk_ids``, from its .npy header alone; None for a log
    of counts."""
    if info.kind != "topk":
        return None
    import math
    import zipfile

    with zipfile.ZipFile(info.path) as archive, archive.open("topk_ids.npy") as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return math.prod(header(f)[0])


def _counts_only_note(info: LogInfo) -> str:
    """The note of a token-level log replayed as counts (more picks than TOKEN_LOG_MAX)."""
    picks = _token_picks(info)
    return (f"note: the log's {picks or 0:,} picks (tokens x layers x top-k) are above the {TOKEN_LOG_MAX:,} a replay "
            "holds (TOKEN_LOG_MAX), so it is replayed as per-step counts: no dispatch copies per token, and the "
            "all-to-all is timed one copy per pick, not per GPU a token reaches (cut the log to keep its tokens)")


def _nan_mean(a: NDArray[np.float64], axis: int | tuple[int, ...]) -> NDArray[np.float64]:
    """`a.mean(axis)` over the values that are not NaN (NaN where none is); exactly `a.mean(axis)` without NaN."""
    missing = np.isnan(a)
    if not missing.any():
        out: NDArray[np.float64] = a.mean(axis=axis)
        return out
    n = (~missing).sum(axis=axis)
    total = np.where(missing, 0.0, a).sum(axis=axis)
    mean: NDArray[np.float64] = np.divide(total, n, out=np.full(np.shape(total), np.nan), where=n > 0)
    return mean


def initial_placement(num_layers: int, num_experts: int, slots_per_gpu: NDArray[np.int64]) -> Placement:
    """vLLM's initial placement: slot s holds expert s mod E (ids in order, then the redundant
    slots hold experts 0, 1, ... again), the same in every layer."""
    num_physical = int(np.sum(slots_per_gpu))
    row = np.arange(num_physical, dtype=np.int64) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), slots_per_gpu, num_experts)


def predict_time_us(
    counts: NDArray[Any], placement: Placement, cost: CostSetup, gpus_per_node: int | None = None
) -> NDArray[np.float64]:
    """Predicted layer time µs [steps, layers] of `placement` for per-step counts [steps, layers, E]:
    `eplb.cost.predict` applied to each step on its own, vectorized (float32 GPU loads)."""
    ev = Evaluator(time_model(cost, placement.num_gpus, gpus_per_node))
    ev.set_placements([placement])
    out: NDArray[np.float64] = ev.evaluate(np.asarray(counts))[1][0]
    return out


@contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block with the BLAS library limited to n threads (None: leave it alone), then restore.
    The solvers' small matrix products ran 10-20x slower with OpenBLAS's spinning threads on shared
    CPUs, so `replay` uses one thread by default."""
    if n is None:
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield


def replay(
    log: LogSource,
    cluster: Cluster,
    *,
    schedule: Schedule | None = None,
    solver: str = "greedy",
    split: str = "uniform",
    cost: CostSetup | None = None,
    migration: MigrationSpec | None = None,
    options: Options | None = None,
    oracle_every: int = 1,
    hindsight: bool = True,
    time_limit_s: float | None = None,
    objective: str = "lb",
    chunk_steps: int = 256,
    collect: bool = False,
    on_steps: Callable[[StepBlock], None] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int | None = 1,
) -> ReplayResult:
    """Replay a routing log on `cluster` with rebalancing (see the module docstring).

    log: a RoutingLog, a path, a [steps, layers, E] array or an iterable of such chunks (read once:
    no hindsight row). solver, split, options: as `eplb.solve.solve`. cost: specs for the predicted time
    (None: no times, no bytes, no migration charge). migration: how weights move (default: over the
    all-to-all link, overlapping serving). oracle_every: solve the oracle on every n-th step (1: all;
    0: none). hindsight: add the hindsight row (reads the log twice). on_steps: called with each
    evaluated StepBlock; progress: called with the number of steps done; collect: keep every step's
    results in ReplayResult.steps (for tests and small logs); threads: BLAS threads (None: unchanged).
    objective: "lb" or "time" (`eplb.objective`: each rebalance also tries co-locating experts chosen
    together, from the window's tokens; needs `cost` and a token-level log).
    """
    sched = schedule or Schedule()
    sched.check()
    if oracle_every < 0:
        raise EplbError(f"oracle_every must be >= 0, got {oracle_every}")
    if sched.trigger == "cost" and cost is None:
        raise EplbError("the cost trigger needs a cost model: give a model (--model) or use --trigger periodic")
    one_shot = not isinstance(log, RoutingLog | str | Path | np.ndarray)
    src = as_log(log)
    check_links(cost, cluster)
    if migration is not None and migration.gpus_per_node not in (None, cluster.gpus_per_node):
        raise EplbError(f"migration: gpus_per_node {migration.gpus_per_node} is not the cluster's "
                        f"({cluster.gpus_per_node})")
    if migration is None and cost is not None:  # with two links, copies from another node take the NIC
        migration = MigrationSpec(cost.link_bw, hbm_bw=cost.hardware.hbm_bandwidth, inter_node_bw=cost.inter_node_bw,
                                  gpus_per_node=cluster.gpus_per_node)  # fmt: skip
    if migration is not None:
        migration.check()
    _check_shapes(src.info, cluster, cost, needs_cost=sched.trigger == "cost")
    check_objective(objective, cost)
    if objective == "time" and src.info.kind != "topk":
        raise EplbError(
            f"{src.info.path}: the time objective co-locates experts chosen together, which needs a token-level "
            "log (topk_ids); this log has per-step counts only: use --objective lb"
        )
    with blas_threads(threads):
        policy = _Policy(solver, split, options, time_limit_s, objective)
        run = _Replay(src, cluster, sched, policy, cost, migration)
        if hindsight and not one_shot:
            run.plan_hindsight(chunk_steps)
        if src.info.num_steps is None or src.info.num_steps > sched.first_position:  # a check will run
            warm_up(policy.name, time_limit_s, objective, cost, cluster)
        return run.run(chunk_steps, oracle_every, collect, on_steps, progress)


def warm_up(solver: str, time_limit_s: float | None = None, objective: str = "lb",
            cost: CostSetup | None = None, cluster: Cluster | None = None) -> None:
    """Pay now, outside a replay's solve timing, what the first rebalance of a process would pay once: loading
    the solver's modules (a tiny solve from a serving placement, as a rebalance solves) and scipy's linear
    assignment, which relabelling a new placement onto the serving one imports on first use
    (`solvers.migration`, ~0.3 s). Otherwise the first rebalance's solve time carries that start-up and
    inflates the per-rebalance figures (`eplb replay`'s solve_ms_mean and solve_ms_max, `eplb compare --log`'s
    solve times). objective, cost: the replay's; the tiny solve takes the rebalances' path: with the time
    objective (or a solver that needs co-activation data) it solves with a co-activation summary of tiny
    token-level routing, and by time with `cost`'s specs on a model of its few experts (the candidates'
    co-location search, solvers.coactivation's compiled kernels, the cost model with copies per token).
    cluster: the replay's; the tiny cluster follows its shape: two nodes of two GPUs when it has GPUs per node (or
    `cost` needs nodes), and two expert groups, one a node, when it has groups too (the solver's hierarchical path,
    relabelling node by node). `replay` calls it before its loop; later calls in a process cost two tiny solves."""
    import scipy.optimize  # noqa: F401  (solvers.migration imports it on demand)

    check_objective(objective, cost)
    by_time = objective == "time"
    pairs = by_time or registry.get_solver(solver).capabilities.coactivation
    top_k = 2 if cost is None else cost.model.top_k
    experts = 2 * max(2, top_k)  # every tiny token picks top_k distinct experts
    nodes = cost is not None and (cost.inter_node_bw is not None or cost.node_limit is not None)
    nodes = nodes or (cluster is not None and cluster.gpus_per_node is not None)
    hierarchical = nodes and cluster is not None and cluster.num_groups is not None
    gpus = 4 if nodes else 2  # nodes: two of two GPUs
    tiny_cluster = Cluster(np.full(gpus, experts // gpus + 1), gpus_per_node=2 if nodes else None,
                           num_groups=2 if hierarchical else None)  # one redundant expert a GPU  # fmt: skip
    serving = initial_placement(1, experts, tiny_cluster.slots_per_gpu)
    loads = np.arange(experts, 0, -1, dtype=np.float64)[None, :]
    summary = None
    if pairs:
        from eplb.coactivation import summarize

        tokens = np.arange(4 * experts)[:, None, None]
        summary = summarize((tokens + np.arange(top_k)) % experts, experts)  # [tokens, 1 layer, top_k]
        loads = summary.loads.astype(np.float64)
    tiny = None
    if by_time:
        assert cost is not None
        tiny = replace(cost, model=cost.model.model_copy(update={"num_experts": experts}))
    solve(loads, tiny_cluster, solver=solver, options=applicable(solver, Options(time_limit_s=time_limit_s)),
          current=serving, objective=objective, cost=tiny, coactivation=summary, empty_slots=False)


def _check_shapes(info: LogInfo, cluster: Cluster, cost: CostSetup | None, needs_cost: bool = False) -> None:
    """The log against the cluster's slots and the cost's model (`ModelSpec.window_mismatch`, the CLI's rule, in
    the Python API's words; needs_cost: the schedule needs a cost model, so dropping it is no way out)."""
    experts, slots = info.num_experts, cluster.slots_per_gpu
    if cost is not None:
        drop = "" if needs_cost else "; or no cost (cost=None: no times, no bytes)"

        def way(need: str, rows: str | None) -> str:
            log = "" if rows is None else f"; or a log with {rows}"
            return f"give cost (a CostSetup) {need}, a preset or a JSON file (eplb.specs.load_model){log}{drop}"

        why = model_mismatch(cost.model, info.num_layers, experts, "the log has", way)
        if why is not None:
            raise EplbError(why)  # the CLI's refusal (eplb.cli.solve.model_for) in its flags
    if int(slots.sum()) < experts:
        raise EplbError(f"{int(slots.sum())} slots on {slots.size} GPUs cannot hold {experts} experts")


@dataclass(frozen=True)
class _Policy:
    """What a rebalance solves with: registry name, share split, options, MILP time limit, objective ("lb" or
    "time": `eplb.objective`, with the window's co-activation summary of a token-level log)."""

    solver: str
    split: str
    options: Options | None
    time_limit_s: float | None
    objective: str = "lb"

    @property
    def name(self) -> str:
        return self.solver if self.split == "uniform" else f"{self.solver}-{self.split}"

    def options_for(self, robust: bool, **budget: Any) -> Options:
        base = self.options or Options()
        opts = replace(base, time_limit_s=self.time_limit_s or base.time_limit_s, **budget)
        return replace(applicable(self.name, opts), robust=robust)  # robust applies to every solver


class _Replay:
    """The state of one replay: serving placement, pending placement, window, rows' statistics."""

    def __init__(
        self,
        src: RoutingLog,
        cluster: Cluster,
        sched: Schedule,
        policy: _Policy,
        cost: CostSetup | None,
        migration: MigrationSpec | None,
    ) -> None:
        self.src, self.info, self.cluster, self.sched, self.policy = src, src.info, cluster, sched, policy
        self.cost, self.migration = cost, migration
        layers, experts = self.info.num_layers, self.info.num_experts
        slots = cluster.slots_per_gpu
        self.serving = initial_placement(layers, experts, slots)
        self.static: Placement | None = None
        self.base = contiguous_placement(layers, experts, cluster.num_gpus)
        self.pending: tuple[int, Placement, float] | None = None  # (applies from, placement, its charge s)
        self.hindsight: list[Placement] = []
        self.segment = 0
        self.evaluator = Evaluator(None if cost is None else time_model(cost, cluster.num_gpus, cluster.gpus_per_node))
        self.window = Window(sched.window)  # grows as steps arrive: never more than the log holds
        self.stats = {name: RowStats() for name in BASELINES}
        self.rebalances: list[Rebalance] = []
        self.checks: list[dict[str, Any]] = []
        self.next_check = sched.first_position
        self.timing = {"evaluation_s": 0.0, "solve_s": 0.0, "oracle_s": 0.0, "read_s": 0.0, "hindsight_s": 0.0}
        self.tokens = _token_routing(self.info)  # token-level logs: exact dispatch copies per token per row
        self.copies = {name: [0.0, 0, 0.0] for name in COPY_ROWS}  # copies x tokens, tokens, nodes x tokens
        self.notes = [_counts_only_note(self.info)] if self.tokens is None and self.info.kind == "topk" else []
        try:
            self.needs_pairs = registry.get_solver(policy.solver).capabilities.coactivation  # e.g. greedy-coact
        except registry.SolverError as exc:
            raise EplbError(str(exc)) from None
        if (policy.objective == "time" or self.needs_pairs) and self.tokens is None:
            what = "the time objective needs" if policy.objective == "time" else f"{policy.solver} needs"
            raise EplbError(f"{self.info.path}: {what} the log's tokens (a token-level log with at most "
                            f"{TOKEN_LOG_MAX:,} picks): use a token-level log, cut it, or another solver")  # fmt: skip
        self.step_time_s = 0.0  # the replay's predicted time (MoE layers) of its last step with tokens, for
        # transfer lengths (with a model, a check whose window has no tokens keeps, so a rebalance never sees 0)
        self.window_span: tuple[int, int] | None = None  # the current check's window: positions lo .. hi - 1
        self.window_summary: CoactivationSummary | None = None  # its co-activation summary (time objective) ...
        self.summary_of: tuple[int, int] | None = None  # ... and the window it is of

    # ---- hindsight: one pass for each interval's summed counts, one greedy solve per interval ----

    def segment_bounds(self, steps: int) -> list[int]:
        """Positions where the intervals between checks start: 0, first, first + interval, ..., steps."""
        bounds = [0, *range(self.sched.first_position, steps, self.sched.interval)]
        return [b for b in bounds if b < steps] + [steps]

    def plan_hindsight(self, chunk_steps: int) -> None:
        t0 = time.perf_counter()
        sums: list[NDArray[np.float64]] = []
        first, interval = self.sched.first_position, self.sched.interval
        for chunk in self.src.iter_counts(chunk_steps):
            positions = np.arange(chunk.start, chunk.start + chunk.num_steps)
            seg = np.where(positions < first, 0, 1 + (positions - first) // interval)
            for s in np.unique(seg):
                while len(sums) <= s:
                    sums.append(np.zeros((self.info.num_layers, self.info.num_experts)))
                sums[int(s)] += chunk.counts[seg == s].sum(axis=0, dtype=np.float64)
        self.hindsight = [solve(s, self.cluster, solver="greedy").placement for s in sums]
        self.timing["hindsight_s"] = time.perf_counter() - t0

    # ---- the loop ----

    def placements(self) -> list[Placement]:
        rows = [self.serving, self.static or self.serving, self.base]
        return [*rows, self.hindsight[self.segment]] if self.hindsight else rows

    def run(
        self,
        chunk_steps: int,
        oracle_every: int,
        collect: bool,
        on_steps: Callable[[StepBlock], None] | None,
        progress: Callable[[int], None] | None,
    ) -> ReplayResult:
        started = time.perf_counter()
        self.evaluator.set_placements(self.placements())
        blocks: list[StepBlock] = []
        done = 0
        t_read = time.perf_counter()
        for chunk in self.src.iter_counts(chunk_steps):
            self.timing["read_s"] += time.perf_counter() - t_read
            if chunk.counts.shape[1:] != (self.info.num_layers, self.info.num_experts):
                raise EplbError(
                    f"{self.info.path}: step {int(chunk.steps[0])} has shape {list(chunk.counts.shape[1:])}"
                )
            pos, end = chunk.start, chunk.start + chunk.num_steps
            while pos < end:
                self.at_position(pos, chunk)
                stop = min(end, self.next_check, self.pending[0] if self.pending is not None else end)
                block = self.serve(chunk, pos, stop, oracle_every, progress)
                if on_steps is not None:
                    on_steps(block)
                if collect:
                    blocks.append(block)
                pos = stop
            done = end
            if progress is not None:
                progress(done)
            t_read = time.perf_counter()
        if done == 0:
            raise EplbError(f"{self.info.path}: the log has no steps")
        if self.pending is not None:  # the log ended while its copies were in flight: never served, not charged
            last = self.rebalances[-1]
            self.rebalances[-1] = replace(last, served=False, charge_s=None if last.charge_s is None else 0.0)
            for c in self.checks:
                if c["position"] == last.position:
                    c["served"] = False
        return self.result(done, time.perf_counter() - started, oracle_every, blocks if collect else None)

    def at_position(self, pos: int, chunk: CountsChunk) -> None:
        """Apply a placement due at `pos`, then run the check due at `pos` (against it: copies that land at a check
        are not in flight; unless copies are), then apply what that check schedules for `pos` itself (delay 0)."""
        changed = self.apply_due(pos)
        if pos == self.next_check:
            if self.pending is None:
                self.check(pos, chunk)
            else:
                self.note_check(pos, chunk, "skip", reason="copies still in flight")
            self.next_check += self.sched.interval
            self.segment = min(self.segment + 1, max(len(self.hindsight) - 1, 0))
            changed = self.apply_due(pos) or True
        if changed:
            self.evaluator.set_placements(self.placements())

    def apply_due(self, pos: int) -> bool:
        """Serve the pending placement if it is due at `pos`, charging its migration once it serves."""
        if self.pending is None or pos != self.pending[0]:
            return False
        _, self.serving, charge = self.pending
        self.stats["replay"].migration_s += charge
        if self.static is None:
            self.static = self.serving
            self.stats["static"].migration_s += charge
        self.pending = None
        return True

    def serve(self, chunk: CountsChunk, pos: int, stop: int, oracle_every: int,
              progress: Callable[[int], None] | None = None) -> StepBlock:
        """Evaluate positions pos .. stop - 1 on every row, add them to the statistics and the window; progress: called
        with the steps done as the oracle's batches finish (the replay's own count: positions done)."""
        counts = chunk.counts[pos - chunk.start : stop - chunk.start]
        n, layers = counts.shape[0], counts.shape[1]
        t0 = time.perf_counter()
        lb, times = self.evaluator.evaluate(counts, self.step_reach(self.placements(), pos, stop))
        self.timing["evaluation_s"] += time.perf_counter() - t0
        nan = np.full((n, layers), np.nan)
        o_lb, o_time = nan, nan
        sampled = np.zeros(n, dtype=np.bool_)  # the steps the oracle solves
        if oracle_every:
            picked = np.arange((-pos) % oracle_every, n, oracle_every)
            sampled[picked] = True
            if picked.size:
                t0 = time.perf_counter()
                o_lb, o_time = nan.copy(), nan.copy()
                solved = None if progress is None else (lambda k: progress(pos + int(picked[k - 1]) + 1))
                o_lb[picked], o_time[picked] = oracle(counts[picked], self.cluster, self.evaluator.time,
                                                      self.oracle_reach(pos + picked), solved)  # fmt: skip
                self.timing["oracle_s"] += time.perf_counter() - t0
        has_h = lb.shape[0] > 3
        block = StepBlock(
            start=pos,
            steps=chunk.steps[pos - chunk.start : stop - chunk.start],
            lb=lb[0],
            static_lb=lb[1],
            no_eplb_lb=lb[2],
            hindsight_lb=lb[3] if has_h else nan,
            oracle_lb=o_lb,
            time_us=times[0],
            static_time_us=times[1],
            no_eplb_time_us=times[2],
            hindsight_time_us=times[3] if has_h else nan,
            oracle_time_us=o_time,
            oracle_sampled=sampled,
        )
        block.add_to(self.stats)
        if self.tokens is not None:
            self.count_copies(pos, stop)
        busy = np.flatnonzero(~np.isnan(lb[0]).all(axis=1))  # the steps with tokens
        if self.evaluator.time is not None and busy.size:
            self.step_time_s = float(times[0, busy[-1]].sum()) / 1e6
        self.window.store_lb(pos, _nan_mean(lb[0], axis=1))
        keep_from = max(pos, self.next_check - self.sched.window)
        if keep_from < stop:
            self.window.store_counts(keep_from, counts[keep_from - pos :])
        return block

    def step_reach(self, placements: list[Placement], lo: int, hi: int) -> NDArray[np.float64] | None:
        """Token-level logs with a time model: [K, hi - lo, L, G] each placement's exact per-step reach of positions
        lo .. hi - 1 (`eplb.coactivation.step_reach`, vLLM's replica rule), for the co-activation comm term; else
        None (the comm term from counts)."""
        if self.tokens is None or self.evaluator.time is None or hi <= lo:
            return None
        from eplb.coactivation import step_reach

        t0 = time.perf_counter()
        ids, offsets = self.tokens
        a, b = int(offsets[lo]), int(offsets[hi])
        nodes = self.reach_nodes
        out = np.stack([step_reach(ids[a:b], offsets[lo : hi + 1] - a, p.phy2log, p.slots_per_gpu,
                                   self.info.num_experts, gpus_per_node=nodes) for p in placements])  # fmt: skip
        self.timing["copies_s"] = self.timing.get("copies_s", 0.0) + time.perf_counter() - t0
        return out

    @property
    def reach_nodes(self) -> int | None:
        """GPUs per node when the time model's comm has two links (step reach then covers the nodes too)."""
        time = self.evaluator.time
        return None if time is None or time.reach_width == time.gpus else time.gpus_per_node

    def oracle_reach(self, positions: NDArray[np.int64]) -> ReachOf | None:
        """For the oracle row of a token-level log: (i, phy2log [L, P]) -> the reach [L, G] of the step at
        positions[i] under that placement; None without tokens or a time model."""
        if self.tokens is None or self.evaluator.time is None:
            return None
        from eplb.coactivation import step_reach

        ids, offsets = self.tokens
        slots = self.cluster.slots_per_gpu

        def reach_of(i: int, phy2log: NDArray[np.int64]) -> NDArray[np.float64]:
            a, b = int(offsets[positions[i]]), int(offsets[positions[i] + 1])
            out: NDArray[np.float64] = step_reach(ids[a:b], np.array([0, b - a]), phy2log, slots,
                                                  self.info.num_experts, gpus_per_node=self.reach_nodes)[0]  # fmt: skip
            return out

        return reach_of

    def count_copies(self, pos: int, stop: int) -> None:
        """Add the exact copies per token (distinct GPUs, and nodes when the cluster has them, a token's top-k
        reaches, vLLM's replica rule, mean over layers) of positions pos .. stop - 1 for every placement row."""
        from eplb.coactivation import copies_per_token

        assert self.tokens is not None
        ids, offsets = self.tokens
        a, b = int(offsets[pos]), int(offsets[stop])
        if b <= a:
            return
        t0 = time.perf_counter()
        for name, p in zip(COPY_ROWS, self.placements(), strict=False):
            c = copies_per_token(ids[a:b], p.phy2log, p.slots_per_gpu, self.info.num_experts,
                                 gpus_per_node=self.cluster.gpus_per_node,
                                 step_offsets=offsets[pos : stop + 1] - a)  # fmt: skip
            self.copies[name][0] += float(c.gpus.mean()) * (b - a)
            self.copies[name][1] += b - a
            self.copies[name][2] += float(c.nodes.mean()) * (b - a)
        self.timing["copies_s"] = self.timing.get("copies_s", 0.0) + time.perf_counter() - t0

    # ---- checks and rebalances ----

    def check(self, pos: int, chunk: CountsChunk) -> None:
        """Decide at check position `pos` from the steps before it, and schedule the new placement."""
        sched = self.sched
        lo = max(0, pos - sched.window)
        self.window_span = (lo, pos)
        if sched.trigger == "threshold":
            recent = self.window.recent_lb(lo, pos)
            if not recent > sched.threshold:
                self.note_check(pos, chunk, "keep", recent_lb=recent)
                return
        loads, weight = self.window.loads(lo, pos, sched.ewma)
        if self.cost is not None and not loads.any():  # with a model: a move's copies are timed by a busy step's
            self.note_check(pos, chunk, "keep", reason="the window has no tokens")
            return
        scenarios = None
        if sched.robust_windows is not None:
            scenarios = self.window.scenarios(lo, pos, min(sched.robust_windows, pos - lo))
        t0 = time.perf_counter()
        if sched.trigger == "cost":
            choice = self.cheapest(loads / max(weight, 1e-12), loads, scenarios, self.window.steps(lo, pos))
            if choice is None:
                self.timing["solve_s"] += time.perf_counter() - t0
                self.note_check(pos, chunk, "keep", reason="no move pays for itself")
                return
            outcome, cost, saving = choice
        else:
            outcome = self.solve(loads, scenarios)
            cost, saving = self.migration_cost(outcome, loads / max(weight, 1e-12)), None
        solve_ms = (time.perf_counter() - t0) * 1000
        self.timing["solve_s"] += solve_ms / 1000
        charge, span = (0.0, 0) if cost is None else cost.charge_s(self.step_time_s)
        applies = pos + max(sched.delay, span)
        self.pending = (applies, outcome.placement, charge)
        moves = outcome.moves if outcome.moves is not None else np.zeros(loads.shape[0], dtype=np.int64)
        self.rebalances.append(
            Rebalance(
                position=pos,
                step=int(chunk.steps[pos - chunk.start]),
                applies_from=applies,
                window_steps=pos - lo,
                moves=int(moves.sum()),
                moves_per_layer=moves,
                bytes_moved=None if self.cost is None else float(moves.sum()) * self.cost.model.expert_bytes,
                solve_ms=round(solve_ms, 3),
                window_lb=np.where(outcome.balance.has_tokens, outcome.balance.lb, np.nan),
                solver_info=outcome.solver,
                transfer_s=None if cost is None else cost.transfer_s,
                charge_s=None if cost is None else charge,
                saving_s=saving,
            )
        )
        self.note_check(pos, chunk, "rebalance", moves=int(moves.sum()))

    def note_check(self, pos: int, chunk: CountsChunk, decision: str, **more: Any) -> None:
        """Record the check at position `pos` (in `chunk`): its position, step id, decision and `more`."""
        self.checks.append({"position": pos, "step": int(chunk.steps[pos - chunk.start]), "decision": decision,
                            **more})  # fmt: skip

    def solve(
        self, loads: NDArray[np.float64], scenarios: NDArray[np.float64] | None, fresh: bool = False, **budget: Any
    ) -> Outcome:
        """The policy's solve of `loads` against the serving placement; fresh: greedy instead of the policy's
        solver (the cost trigger's fresh candidate), relabelled onto the serving placement."""
        robust = scenarios is not None
        by_time = self.policy.objective == "time"
        cost = self.cost if by_time else None
        summary = self.window_coactivation() if by_time or self.needs_pairs else None
        common: dict[str, Any] = {"current": self.serving, "scenarios": scenarios, "objective": self.policy.objective,
                                  "cost": cost, "coactivation": summary,
                                  "empty_slots": False}  # a replay's placement is the next check's serving one
        if fresh:
            opts = replace(applicable("greedy", self.policy.options or Options()), robust=robust)
            return solve(loads, self.cluster, solver="greedy", options=opts, **common)
        options = self.policy.options_for(robust, **budget)
        return solve(loads, self.cluster, solver=self.policy.solver, split=self.policy.split, options=options,
                     **common)  # fmt: skip

    def window_coactivation(self) -> CoactivationSummary | None:
        """The co-activation summary of the tokens of the current check's window (token-level logs held in
        memory), cached per check."""
        if self.tokens is None or self.window_span is None:
            return None
        if self.summary_of != self.window_span:
            from eplb.coactivation import summarize

            ids, offsets = self.tokens
            lo, hi = self.window_span
            self.window_summary = summarize(ids[offsets[lo] : offsets[hi]], self.info.num_experts)
            self.summary_of = self.window_span
        return self.window_summary

    def migration_cost(self, new: Outcome, step_loads: NDArray[np.float64]) -> MigrationCost | None:
        """What copying the experts of `new` (a solve from the serving placement) onto the serving placement costs
        (None without a cost model): the copies of its migration plan, built by the solve with the cluster's GPUs
        per node (built again only for a migration spec that reads sources without them)."""
        if self.cost is None or self.migration is None:
            return None
        pred = evaluate(step_loads, self.serving, self.cost, gpus_per_node=self.cluster.gpus_per_node).prediction
        assert pred is not None
        plan = new.plan if self.migration.gpus_per_node == self.cluster.gpus_per_node else None
        return self.migration.rebalance_cost(new.placement.phy2log, self.serving.phy2log, self.cluster.slots_per_gpu,
                                             self.cost.model.expert_bytes, pred, plan)  # fmt: skip

    def candidates(self) -> list[dict[str, Any]]:
        """The cost trigger's candidates as `solve` keyword arguments: with the incremental solver and no budget of
        the caller's own (Options max_moves or target_lb) `eplb.trigger.candidates` (move budgets, no budget, a
        fresh greedy placement), as deployments do; else the policy's one solve."""
        opts = self.policy.options or Options()
        return trigger.candidates(self.serving.num_layers * self.serving.num_physical, self.policy.solver,
                                  opts.max_moves is not None or opts.target_lb is not None)

    def cheapest(
        self,
        step_loads: NDArray[np.float64],
        loads: NDArray[np.float64],
        scenarios: NDArray[np.float64] | None,
        recent: NDArray[Any],
    ) -> tuple[Outcome, MigrationCost | None, float] | None:
        """The candidate to rebalance with, None when none saves more than it costs. A candidate's net
        saving = mean time per step saved on the window's own steps `recent` [n, L, E] x the interval -
        its migration charge; `eplb.trigger.choose_candidate` picks: among the near-best net savings, the most
        balanced.

        Why not simply the best net: judged on the steps it was fitted to, every candidate past a few
        percent of moves puts those steps at the weight-read floor of the step time, so their savings tie
        and the cheapest won, while the later steps it serves, which drift off the floor, kept paying for
        its worse balance (fresh greedy saved more over the next interval at most checks of the benchmark
        logs). Balance is what absorbs the drift the window cannot show. Per-step times, not the window
        mean's: a step's time is its busiest GPU's, so step noise that a placement cannot follow counts. On a
        token-level log the comm term counts the GPUs each step's tokens reach (`step_reach`)."""
        assert self.cost is not None
        candidates = [self.solve(loads, scenarios, **k) for k in self.candidates()]
        judge = Evaluator(self.evaluator.time)
        placements = [self.serving, *(o.placement for o in candidates)]
        judge.set_placements(placements)
        assert self.window_span is not None
        lb, times = judge.evaluate(recent, self.step_reach(placements, *self.window_span))
        step_s = times.sum(axis=2).mean(axis=1) / 1e6  # [1 + candidates] s per step
        balance = _nan_mean(lb, axis=(1, 2))  # [1 + candidates] mean realized lb (of the step-layers with tokens)
        scored: list[tuple[float, float, MigrationCost | None, Outcome, float]] = []
        for outcome, t_new, b in zip(candidates, step_s[1:], balance[1:], strict=True):
            cost = self.migration_cost(outcome, step_loads)
            net, saving = trigger.net_saving(float(step_s[0] - t_new), self.sched.interval, cost, self.step_time_s,
                                             self.sched.delay)  # fmt: skip
            scored.append((net, float(b), cost, outcome, saving))
        pick = trigger.choose_candidate([s[0] for s in scored], [s[1] for s in scored], [_moves(s[3]) for s in scored])
        if pick is None:
            return None
        _, _, cost, outcome, saving = scored[pick]
        return outcome, cost, saving

    # ---- the summary ----

    def result(self, steps: int, wall: float, oracle_every: int, blocks: list[StepBlock] | None) -> ReplayResult:
        summary = self.summary(steps, wall, oracle_every)
        return ReplayResult(
            info=self.info,
            cluster=self.cluster,
            schedule=self.sched,
            solver=self.policy.name,
            rebalances=self.rebalances,
            summary=summary,
            final=self.serving,
            static=self.static,
            steps=StepBlock.concat(blocks) if blocks else None,
            checks=self.checks,
        )

    def summary(self, steps: int, wall: float, oracle_every: int) -> dict[str, Any]:
        info, slots, cost = self.info, self.cluster.slots_per_gpu, self.cost
        base = self.stats["no_eplb"].to_dict()
        results: dict[str, Any] = {}
        for name in BASELINES:  # a sampled oracle's time is scaled to all steps, like with like
            sampled = name == "oracle" and oracle_every > 1
            d = self.stats[name].to_dict(self.stats["no_eplb"].steps if sampled else None)
            if d.get("total_time_s") and base.get("total_time_s"):
                d["speedup_vs_no_eplb"] = round(base["total_time_s"] / d["total_time_s"], 4)
            results[name] = d
        for name, (total, tokens, nodes) in self.copies.items():
            if tokens:
                results[name]["copies_per_token"] = round(total / tokens, 4)
                if self.cluster.gpus_per_node is not None:
                    results[name]["nodes_per_token"] = round(nodes / tokens, 4)
        hs = self.stats["hindsight"]
        if hs.count:
            results["replay"]["hindsight_ratio"] = round(self.stats["replay"].lb_mean / hs.lb_mean, 6)
        notes = list(self.notes)
        replay, none = results["replay"], results["no_eplb"]
        if (replay.get("total_time_s") and none.get("total_time_s") and replay["total_time_s"] > none["total_time_s"]
                and replay["step_time_us"] > none["step_time_us"] and int(slots.sum()) > info.num_experts
                and bool((self.serving.phy2log >= 0).all())):  # fmt: skip
            notes.append(weight_reads_note(info.num_experts, int(slots.sum()), "; fewer redundant slots (--redundant) "
                                           "read less", baseline="no EPLB", placement="the replay's placements fill"))
        rbs = self.rebalances
        moved = [r.bytes_moved for r in rbs]
        layer_steps = steps * info.num_layers
        ev = self.timing["evaluation_s"]
        return {
            "log": {"path": info.path, "kind": info.kind, "steps": steps, "layers": info.num_layers,
                    "experts": info.num_experts, "model": info.model, "top_k": info.top_k},
            "cluster": {"gpus": int(slots.size), "slots_per_gpu": slots.tolist(),
                        "redundant": int(slots.sum()) - info.num_experts, "gpus_per_node": self.cluster.gpus_per_node,
                        "groups": self.cluster.num_groups},
            "schedule": {**self.sched.to_dict(), "solver": self.policy.name, "oracle_every": oracle_every},
            "cost": None if cost is None else {
                "model": cost.model.name, "hardware": cost.hardware.name, "link_bandwidth": cost.link_bw,
                "inter_node_bandwidth": cost.inter_node_bw,
                "tokens_per_gpu": cost.tokens_per_gpu, "overlap": cost.overlap,
            },
            "migration": None if self.migration is None else {
                "link_bandwidth": self.migration.link_bw, "inter_node_bandwidth": self.migration.inter_node_bw,
                "overlap": self.migration.overlap,
                "link_share": self.migration.link_share,
                "fixed_stall_s": self.migration.fixed_stall_s,
            },
            "results": results,
            "rebalances": {
                "checks": len(self.checks),
                "skipped": sum(c["decision"] == "skip" for c in self.checks),  # copies still in flight
                "count": len(rbs),
                "moves": sum(r.moves for r in rbs),
                "moves_per_rebalance": round(sum(r.moves for r in rbs) / len(rbs), 1) if rbs else None,
                "slots_moved_fraction": round(
                    sum(r.moves for r in rbs) / len(rbs) / (info.num_layers * int(slots.sum())), 6
                ) if rbs else None,
                "bytes_moved": None if any(b is None for b in moved) else float(sum(b for b in moved if b is not None)),
                "solve_ms_mean": round(float(np.mean([r.solve_ms for r in rbs])), 3) if rbs else None,
                "solve_ms_max": round(max(r.solve_ms for r in rbs), 3) if rbs else None,
                "list": [r.to_dict() for r in rbs],
            },
            "timing": {
                "wall_s": round(wall, 3),
                **{k: round(v, 3) for k, v in self.timing.items()},
                "layer_steps_per_s": round(layer_steps / wall, 1) if wall > 0 else None,
                "evaluation_layer_steps_per_s": round(layer_steps / ev, 1) if ev > 0 else None,
            },
            "notes": notes,
        }  # fmt: skip
