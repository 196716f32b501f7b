"""Offline replay of a routing log with periodic rebalancing, next to three baselines.

Schedule (positions count logged steps from 0; docs/replay.md):
- rebalances run at positions `first, first + interval, first + 2 interval, ...` (`first` defaults
  to `interval`, so the first one has a full interval of history);
- the rebalance at position s sees only the steps before it: positions max(0, s - window) .. s - 1
  (optionally EWMA-weighted, the most recent step weighing 1, the one j steps earlier (1 - alpha)^j).
  Step s itself is never in its own window: no lookahead;
- the placement it computes serves from position s + delay (default delay 1: step s still runs on
  the old placement while the solver runs and weights move; delay 0 is vLLM's timing, where
  rearrange() runs right after step s - 1 and step s already uses the new experts);
- before the first placement applies, the cluster serves vLLM's initial placement: experts in id
  order over the slots, the redundant slots holding experts 0, 1, ... again.

Baselines on the same log and cluster:
- no EPLB: experts in id order, E/G per GPU, no redundant slots (`contiguous_placement`);
- static: the first rebalance's placement kept for the rest of the log;
- oracle: every step solved on its own counts by the greedy solver (the ceiling; no rollout cost).

Per step and layer: realized lb (max / mean GPU load of that step's counts) for the replay and
each baseline, and the replay's predicted layer time (`eplb.cost.predict`'s model, computed here
vectorized over steps). Per rebalance: moves (expert copies onto a GPU), bytes moved, solve time.
Evaluation is vectorized over layers and steps (a float32 batched matmul of the step's counts with
each placement's [E, G] share matrix); memory is bounded by the window (a ring buffer of the last
`window` steps) and a chunk of steps, not by the log's length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits

from eplb.errors import EplbError
from eplb.evaluate import contiguous_placement
from eplb.io.logs import CountsChunk, LogInfo, RoutingLog, as_log
from eplb.placement import Placement
from eplb.solve import Cluster, CostSetup, solve
from solvers.greedy import solve_greedy
from solvers.registry import Options, applicable

__all__ = [
    "BASELINES",
    "Rebalance",
    "ReplayResult",
    "Schedule",
    "StepBlock",
    "blas_threads",
    "initial_placement",
    "predict_time_us",
    "replay",
]

BASELINES: tuple[str, ...] = ("no_eplb", "static", "replay", "oracle")
"""Summary rows, in the order the CLI prints them."""

_ORACLE_BATCH_STEPS = 32  # steps per vectorized oracle solve (memory ~ steps x layers x E x G bits)
_HIST_BINS = 16_000  # lb histogram for percentiles: bins of 0.001 from 1.0 to 17.0, then overflow
_HIST_WIDTH = 1e-3


@dataclass(frozen=True)
class Schedule:
    """When to rebalance and what the solver sees (positions count logged steps from 0).

    window: steps in the solver's window (vLLM's default 1000); interval: steps between rebalances
    (vLLM's default 3000); first: position of the first rebalance (default: interval); delay: steps
    after a rebalance before its placement serves (default 1: from the next step); ewma: alpha in
    (0, 1] to weight the window, None for a plain sum.
    """

    window: int = 1000
    interval: int = 3000
    first: int | None = None
    delay: int = 1
    ewma: float | None = None

    def check(self) -> None:
        """Raise EplbError on an impossible schedule."""
        for name in ("window", "interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EplbError(f"{name} must be a whole number of steps >= 1, got {v!r}")
        if self.first is not None and (not isinstance(self.first, int) or self.first < 1):
            raise EplbError(f"the first rebalance needs at least one step before it: got position {self.first!r}")
        if not isinstance(self.delay, int) or self.delay < 0:
            raise EplbError(f"delay must be a whole number of steps >= 0, got {self.delay!r}")
        if self.delay >= self.interval:
            raise EplbError(
                f"delay ({self.delay}) must be shorter than the interval ({self.interval}): a placement must "
                "serve before the next rebalance"
            )
        if self.ewma is not None and not (0 < self.ewma <= 1):
            raise EplbError(f"EWMA alpha must be in (0, 1], got {self.ewma!r}")

    @property
    def first_position(self) -> int:
        return self.interval if self.first is None else self.first

    def describe(self, solver: str) -> str:
        weighting = "plain sum" if self.ewma is None else f"EWMA alpha {self.ewma:g}"
        serve = {0: "the same step", 1: "the next step"}.get(self.delay, f"{self.delay} steps later")
        return (
            f"{solver} every {self.interval:,} steps from step {self.first_position:,}; window {self.window:,} "
            f"steps before each ({weighting}); a new placement serves from {serve}"
        )


@dataclass(frozen=True)
class Rebalance:
    """One rebalance. position/step: where it ran (log position, step id); applies_from: first
    position it serves; window_steps: steps it saw; moves: expert copies onto GPUs, all layers
    ([layers] in moves_per_layer); bytes_moved: moves x one expert's bytes (None without a model);
    solve_ms: the solver's wall time (relabelling GPUs against the serving placement included);
    window_lb: [layers] lb the solver reports on its own window; solver_info: the solver's report
    (`eplb.solve.Outcome.solver`: name, status, per-layer `layer_ms`, `bound`, `gap`, and the
    MILP's `layer_status`)."""

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "position": self.position,
            "applies_from": self.applies_from,
            "window_steps": self.window_steps,
            "moves": self.moves,
            "bytes_moved": self.bytes_moved,
            "solve_ms": self.solve_ms,
            "window_lb_mean": float(self.window_lb.mean()),
        }


@dataclass(frozen=True)
class StepBlock:
    """Per step and layer results for consecutive steps. start: position of the first step;
    steps: [n] step ids; lb, static_lb, no_eplb_lb, oracle_lb: [n, layers] realized lb (oracle NaN
    where not solved); time_us: [n, layers] the replay's predicted layer time (NaN without a cost
    model); *_time_us of the baselines likewise."""

    start: int
    steps: NDArray[np.int64]
    lb: NDArray[np.float64]
    static_lb: NDArray[np.float64]
    no_eplb_lb: NDArray[np.float64]
    oracle_lb: NDArray[np.float64]
    time_us: NDArray[np.float64]
    static_time_us: NDArray[np.float64]
    no_eplb_time_us: NDArray[np.float64]
    oracle_time_us: NDArray[np.float64]

    @property
    def num_steps(self) -> int:
        return int(self.steps.size)

    @staticmethod
    def concat(blocks: list[StepBlock]) -> StepBlock:
        names = ("lb", "static_lb", "no_eplb_lb", "oracle_lb", "time_us", "static_time_us", "no_eplb_time_us",
                 "oracle_time_us")  # fmt: skip
        arrays = {n: np.concatenate([getattr(b, n) for b in blocks]) for n in names}
        return StepBlock(blocks[0].start, np.concatenate([b.steps for b in blocks]), **arrays)


@dataclass
class ReplayResult:
    """What a replay produced. summary: the JSON-ready summary (`summary.json`); steps: every
    step's results when the replay was run with collect=True."""

    info: LogInfo
    cluster: Cluster
    schedule: Schedule
    solver: str
    rebalances: list[Rebalance]
    summary: dict[str, Any]
    final: Placement
    static: Placement | None
    steps: StepBlock | None = None


# --------------------------------------------------------------------------------------------
# Placements as matrices, and the vectorized time model
# --------------------------------------------------------------------------------------------


def initial_placement(num_layers: int, num_experts: int, slots_per_gpu: NDArray[np.int64]) -> Placement:
    """vLLM's initial placement: slot s holds expert s mod E (ids in order, then the redundant
    slots hold experts 0, 1, ... again), the same in every layer."""
    num_physical = int(np.sum(slots_per_gpu))
    row = np.arange(num_physical, dtype=np.int64) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), slots_per_gpu, num_experts)


def _share_matrix(p: Placement) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """(shares [L, E, G]: fraction of expert e's tokens GPU g serves; slots [L, E, G]: replicas of e
    on g) from a placement, float32 for the batched matmul."""
    layers = p.num_layers
    experts, gpus = p.num_experts, p.num_gpus
    gpu = np.repeat(np.arange(gpus, dtype=np.int64), p.slots_per_gpu)
    flat = (np.arange(layers, dtype=np.int64)[:, None] * experts + p.phy2log) * gpus + gpu[None, :]
    size = layers * experts * gpus
    shares = np.bincount(flat.ravel(), weights=p.slot_shares().ravel(), minlength=size)
    slots = np.bincount(flat.ravel(), minlength=size)
    shape = (layers, experts, gpus)
    return shares.reshape(shape).astype(np.float32), slots.reshape(shape).astype(np.float32)


@dataclass(frozen=True)
class _TimeModel:
    """The constants of `eplb.cost.predict` for one cluster and cost setup."""

    gpus: int
    top_k: int
    shared: int
    us_per_row: float  # compute µs per routed or shared row
    expert_read_us: float  # µs to read one routed expert's weights
    shared_read_us: float  # µs to read the shared experts' weights
    comm_us_per_copy: float  # µs per token copy (dispatch + combine)
    tokens_per_gpu: float | None
    overlap: bool

    @classmethod
    def from_cost(cls, cost: CostSetup, gpus: int) -> _TimeModel:
        m, hw = cost.model, cost.hardware
        return cls(
            gpus=gpus,
            top_k=m.top_k,
            shared=m.num_shared_experts,
            us_per_row=m.flops_per_row / hw.dense_flops * 1e6,
            expert_read_us=m.expert_bytes / hw.hbm_bandwidth * 1e6,
            shared_read_us=m.shared_expert_bytes / hw.hbm_bandwidth * 1e6,
            comm_us_per_copy=(m.dispatch_bytes_per_copy + m.combine_bytes_per_copy) / cost.link_bw * 1e6,
            tokens_per_gpu=cost.tokens_per_gpu,
            overlap=cost.overlap,
        )

    def scale(self, total: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(T tokens per GPU, factor turning counts into rows of one step), both shaped like total."""
        g, k = self.gpus, self.top_k
        if self.tokens_per_gpu is None:
            return total / (g * k), np.ones_like(total)
        target = g * self.tokens_per_gpu * k
        factor = np.divide(target, total, out=np.zeros_like(total), where=total > 0)
        return np.full_like(total, self.tokens_per_gpu), factor

    def layer_time(
        self,
        total: NDArray[np.float64],
        rmax: NDArray[np.floating[Any]],
        rmin: NDArray[np.floating[Any]],
        amax: NDArray[np.floating[Any]],
    ) -> NDArray[np.float64]:
        """Layer time µs (slowest GPU) with comm overlapped, from the busiest and idlest GPU's rows
        and the most active slots on any GPU (all shaped alike, broadcastable with total).
        max over GPUs of max(compute, weight, comm) is the max of the three maxima: compute and
        received copies grow with a GPU's rows, sent copies shrink with them."""
        tokens, factor = self.scale(total)
        g = self.gpus
        hi, lo = rmax * factor, rmin * factor
        compute = (hi + self.shared * tokens) * self.us_per_row
        weight = np.where(factor > 0, amax, 0.0) * self.expert_read_us + np.where(tokens > 0, self.shared_read_us, 0.0)
        copies = np.maximum(self.top_k * tokens - lo / g, hi * (1.0 - 1.0 / g))
        out: NDArray[np.float64] = np.maximum(np.maximum(compute, weight), copies * self.comm_us_per_copy)
        return out

    def layer_time_per_gpu(
        self, total: NDArray[np.float64], rows: NDArray[np.float32], active: NDArray[np.floating[Any]]
    ) -> NDArray[np.float64]:
        """Layer time µs without overlap: max over GPUs (axis -2) of max(compute, weight) + comm, from
        per-GPU rows and active slots [..., G, n]; total [..., 1, n]."""
        tokens, factor = self.scale(total)
        g = self.gpus
        r = rows * factor
        compute = (r + self.shared * tokens) * self.us_per_row
        shared = np.where(tokens > 0, self.shared_read_us, 0.0)
        weight = np.where(factor > 0, active, 0.0) * self.expert_read_us + shared
        copies = np.maximum(self.top_k * tokens - r / g, r * (1.0 - 1.0 / g))
        out: NDArray[np.float64] = (np.maximum(compute, weight) + copies * self.comm_us_per_copy).max(axis=-2)
        return out


def predict_time_us(counts: NDArray[Any], placement: Placement, cost: CostSetup) -> NDArray[np.float64]:
    """Predicted layer time µs [steps, layers] of `placement` for per-step counts [steps, layers, E]:
    `eplb.cost.predict` applied to each step on its own (a step's counts are its routed rows),
    vectorized. Equal to predict(counts[s], ...).time_us up to float32 rounding of GPU loads."""
    ev = _Evaluator(placement.num_layers, placement.num_experts, placement.slots_per_gpu, cost)
    ev.set_placements(placement, placement)
    out = ev.evaluate(np.asarray(counts))
    return np.ascontiguousarray(out[1][:, 0, :].T, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# The evaluator: every placement's lb and time for a block of steps, vectorized
# --------------------------------------------------------------------------------------------


class _Evaluator:
    """Evaluates blocks of steps against the serving placement, the static one (when it differs)
    and no EPLB with one batched float32 matmul: counts [L, n, E] @ shares [L, E, K x G]."""

    def __init__(self, layers: int, experts: int, slots: NDArray[np.int64], cost: CostSetup | None) -> None:
        self.layers, self.experts = layers, experts
        self.gpus = int(slots.size)
        self.time = None if cost is None else _TimeModel.from_cost(cost, self.gpus)
        self.base = contiguous_placement(layers, experts, self.gpus)
        self.same = True
        self.shares = np.zeros((layers, experts, 0), dtype=np.float32)
        self.slot_mat = np.zeros_like(self.shares)
        self.replicas = np.zeros((layers, experts, 0), dtype=np.float32)
        self.max_replicas = np.ones(layers, dtype=np.int64)
        self.max_slots = np.zeros((1, 0, 1), dtype=np.float32)
        self.room = 0  # zero-count slots that cannot lower the max active slots of any placement
        self._work: tuple[NDArray[np.float32], ...] = ()

    def set_placements(self, replay: Placement, static: Placement) -> None:
        self.same = static is replay
        placements = [replay, self.base] if self.same else [replay, static, self.base]
        mats = [_share_matrix(p) for p in placements]
        self.shares = np.concatenate([m[0] for m in mats], axis=2)
        self.slot_mat = np.concatenate([m[1] for m in mats], axis=2)
        self.replicas = np.stack([m[1].sum(axis=2) for m in mats], axis=2)  # [L, E, K]
        self.max_replicas = self.replicas.max(axis=(1, 2)).astype(np.int64)  # [L]
        self.max_slots = np.asarray([p.slots_per_gpu.max() for p in placements], dtype=np.float32)[None, :, None]
        # a GPU holding the most slots keeps all of them active unless a zero-count expert sits on it:
        # fewer zero-count slots than such GPUs leave one untouched (pigeonhole)
        self.room = min(int((p.slots_per_gpu == p.slots_per_gpu.max()).sum()) for p in placements)

    def evaluate(self, counts: NDArray[Any]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """counts [n, L, E] -> (lb [L, 3, n], time_us [L, 3, n]) for (replay, static, no EPLB);
        time is NaN without a cost model."""
        n = counts.shape[0]
        g, k = self.gpus, self.shares.shape[2] // self.gpus
        x, prod, rows = self._buffers(n, k)
        np.copyto(x, counts.transpose(1, 0, 2), casting="unsafe")
        np.matmul(x, self.shares, out=prod)
        np.copyto(rows.reshape(self.layers, k * g, n), prod.transpose(0, 2, 1))
        total = rows[:, -1].sum(axis=1, dtype=np.float64)[:, None, :]  # no EPLB: shares of 1, exact sums
        peak = rows.max(axis=2)
        mean = total / g
        lb = np.divide(peak, mean, out=np.ones(peak.shape), where=mean > 0)
        times = np.full(lb.shape, np.nan)
        if self.time is not None:
            times = self._times(x, counts, rows, peak, total)
        if self.same:
            lb = lb[:, [0, 0, 1]]
            times = times[:, [0, 0, 1]]
        return lb, times

    def _buffers(self, n: int, k: int) -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
        """Work arrays for n steps and k placements: counts [L, n, E], their product with the shares
        [L, n, k G] and its transpose [L, k, G, n]. Kept for the most common (n, k), the chunk size,
        since fresh large arrays cost page faults; blocks cut short by a rebalance get new ones."""
        layers, g = self.layers, self.gpus
        shapes = ((layers, n, self.experts), (layers, n, k * g), (layers, k, g, n))
        if self._work and self._work[0].shape == shapes[0] and self._work[2].shape == shapes[2]:
            x, prod, rows = self._work
            return x, prod, rows
        work = tuple(np.empty(shape, dtype=np.float32) for shape in shapes)
        if n >= (self._work[0].shape[1] if self._work else 0):
            self._work = work
        return work[0], work[1], work[2]

    def _times(
        self,
        x: NDArray[np.float32],
        counts: NDArray[Any],
        rows: NDArray[np.float32],
        peak: NDArray[np.float32],
        total: NDArray[np.float64],
    ) -> NDArray[np.float64]:
        assert self.time is not None
        layers, k, g, n = rows.shape
        zeros = counts.size > 0 and counts.min() == 0
        if not self.time.overlap:
            active = np.broadcast_to(self.slot_mat.sum(axis=1).reshape(layers, k, g)[..., None], rows.shape)
            if zeros:
                hit0 = (x == 0).astype(np.float32)
                lost = np.matmul(hit0, self.slot_mat).transpose(0, 2, 1).reshape(layers, k, g, n)
                active = active - lost
            return self.time.layer_time_per_gpu(total[:, :, None, :], rows, active)
        amax: NDArray[np.float32] = np.broadcast_to(self.max_slots, (layers, k, n))
        if zeros:
            # Only a layer-step with at least `room` zero-count slots can have fewer active slots on
            # its most active GPU; bound zero-count slots by zero-count experts x the most replicas.
            flagged = np.argwhere(counts.min(axis=2) == 0)  # (step, layer)
            zc = np.count_nonzero(counts[flagged[:, 0], flagged[:, 1]] == 0, axis=1)
            maybe = flagged[zc * self.max_replicas[flagged[:, 1]] >= self.room]
            if maybe.size:
                amax = amax.copy()
            for layer in np.unique(maybe[:, 1]):
                steps = maybe[maybe[:, 1] == layer, 0]
                hit = (x[layer, steps] > 0).astype(np.float32) @ self.slot_mat[layer]  # [m, K x G]
                amax[layer][:, steps] = hit.reshape(len(steps), k, g).max(axis=2).T
        return self.time.layer_time(total, peak, rows.min(axis=2), amax)


def _oracle(
    counts: NDArray[Any], cluster: Cluster, time_model: _TimeModel | None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Greedy on every step's own counts: (lb [n, L], time_us [n, L]). All steps and layers are one
    batch of rows for `solve_greedy` (vectorized over rows; its loops run over slots)."""
    n, layers, experts = counts.shape
    slots = cluster.slots_per_gpu
    lb = np.empty((n, layers))
    times = np.full((n, layers), np.nan)
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
    for a in range(0, n, _ORACLE_BATCH_STEPS):
        b = min(n, a + _ORACLE_BATCH_STEPS)
        loads = counts[a:b].reshape(-1, experts).astype(np.float64)
        p2l = solve_greedy(loads, slots, num_groups=cluster.num_groups, gpus_per_node=cluster.gpus_per_node)
        flat = p2l + (np.arange(loads.shape[0], dtype=np.int64) * experts)[:, None]
        replicas = np.bincount(flat.ravel(), minlength=loads.size).astype(np.float64)
        slot_load = loads.ravel()[flat] / replicas[flat]
        gpu_rows = np.add.reduceat(slot_load, starts, axis=1)
        total = loads.sum(axis=1)
        mean = total / slots.size
        peak = gpu_rows.max(axis=1)
        lb[a:b] = np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0).reshape(b - a, layers)
        if time_model is not None:
            active = np.add.reduceat((slot_load > 0).astype(np.float64), starts, axis=1)
            t = time_model.layer_time(total, peak, gpu_rows.min(axis=1), active.max(axis=1))
            times[a:b] = t.reshape(b - a, layers)
    return lb, times


# --------------------------------------------------------------------------------------------
# BLAS threads
# --------------------------------------------------------------------------------------------


@contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block with the BLAS library limited to n threads (None: leave it alone), then restore.

    The replay's matmuls are small (per layer: steps x E by E x 3G). On shared or busy CPUs
    OpenBLAS's spinning worker threads made them 10-20x slower than one thread (measured on a
    2-vCPU VM: 0.05 vs 0.8 M layer-steps/s), so `replay` uses one thread by default."""
    if n is None:
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield


# --------------------------------------------------------------------------------------------
# Streaming summaries
# --------------------------------------------------------------------------------------------


@dataclass
class _Stat:
    """Running lb and time statistics of one baseline (memory: a fixed histogram)."""

    count: int = 0
    lb_sum: float = 0.0
    lb_max: float = 0.0
    hist: NDArray[np.int64] = field(default_factory=lambda: np.zeros(_HIST_BINS + 1, dtype=np.int64))
    steps: int = 0
    step_time_sum: float = 0.0
    has_time: bool = True

    def add(self, lb: NDArray[np.float64], time_us: NDArray[np.float64]) -> None:
        """lb, time_us: [n, L] of n evaluated steps (rows with NaN lb are skipped)."""
        keep = ~np.isnan(lb[:, 0])
        lb, time_us = lb[keep], time_us[keep]
        if not lb.size:
            return
        self.count += lb.size
        self.lb_sum += float(lb.sum())
        self.lb_max = max(self.lb_max, float(lb.max()))
        idx = np.minimum(((lb - 1.0) / _HIST_WIDTH).astype(np.int64), _HIST_BINS)
        self.hist += np.bincount(np.maximum(idx, 0).ravel(), minlength=_HIST_BINS + 1)
        self.steps += lb.shape[0]
        if np.isnan(time_us).any():
            self.has_time = False
        else:
            self.step_time_sum += float(time_us.sum())

    def quantile(self, q: float) -> float:
        if not self.count:
            return math.nan
        rank = q * (self.count - 1)
        i = int(np.searchsorted(np.cumsum(self.hist), rank, side="right"))
        return self.lb_max if i >= _HIST_BINS else min(self.lb_max, 1.0 + (i + 1) * _HIST_WIDTH)

    def to_dict(self) -> dict[str, Any]:
        if not self.count:
            return {"steps": 0}
        step_time = self.step_time_sum / self.steps if self.has_time and self.steps else None
        return {
            "steps": self.steps,
            "lb_mean": round(self.lb_sum / self.count, 6),
            "lb_p50": round(self.quantile(0.5), 3),
            "lb_p99": round(self.quantile(0.99), 3),
            "lb_max": round(self.lb_max, 6),
            "step_time_us": None if step_time is None else round(step_time, 3),
        }


# --------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------


class _Window:
    """Ring buffer of the last `size` steps' counts (memory: size x layers x E of the log's dtype)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ring: NDArray[Any] | None = None

    def store(self, positions: range, counts: NDArray[Any]) -> None:
        if not len(positions):
            return
        if self.ring is None:
            self.ring = np.zeros((self.size, *counts.shape[1:]), dtype=counts.dtype)
        self.ring[np.asarray(positions) % self.size] = counts

    def loads(self, lo: int, hi: int, ewma: float | None) -> NDArray[np.float64]:
        """Window loads [L, E] of positions lo .. hi - 1 (all stored): plain or EWMA-weighted sum."""
        assert self.ring is not None
        out = np.zeros(self.ring.shape[1:], dtype=np.float64)
        for a in range(lo, hi, 64):
            b = min(hi, a + 64)
            idx = np.arange(a, b) % self.size
            block = self.ring[idx]
            if ewma is None:
                out += block.sum(axis=0, dtype=np.float64)
            else:
                w = (1.0 - ewma) ** (hi - 1 - np.arange(a, b))
                out += np.tensordot(w, block.astype(np.float64), axes=1)
        return out


def replay(
    log: RoutingLog | str | Path | NDArray[Any] | Iterable[NDArray[Any]],
    cluster: Cluster,
    *,
    schedule: Schedule | None = None,
    solver: str = "greedy",
    split: str = "uniform",
    cost: CostSetup | None = None,
    oracle_every: int = 1,
    time_limit_s: float | None = None,
    chunk_steps: int = 256,
    collect: bool = False,
    on_steps: Callable[[StepBlock], None] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int | None = 1,
) -> ReplayResult:
    """Replay a routing log on `cluster` with periodic rebalancing (see the module docstring).

    log: a RoutingLog, a path, a [steps, layers, E] array or an iterable of such chunks.
    solver, split: as `eplb.solve.solve` ("greedy" or "milp"; split "weighted" with the MILP).
    cost: specs for the predicted time (None: no times, no bytes moved). oracle_every: solve the
    oracle on every n-th step (1: all; 0: none); the oracle is the slow part (~10 ms per
    DeepSeek-V3-sized step). on_steps: called with each evaluated StepBlock (e.g. to write CSV);
    progress: called with the number of steps done; collect: keep every step's results in
    ReplayResult.steps (memory grows with the log: for tests and small logs); threads: OpenBLAS
    threads during the replay (default 1, see `blas_threads`; None leaves the setting alone).
    """
    with blas_threads(threads):
        return _replay(log, cluster, schedule, solver, split, cost, oracle_every, time_limit_s, chunk_steps,
                       collect, on_steps, progress)  # fmt: skip


def _replay(
    log: RoutingLog | str | Path | NDArray[Any] | Iterable[NDArray[Any]],
    cluster: Cluster,
    schedule: Schedule | None,
    solver: str,
    split: str,
    cost: CostSetup | None,
    oracle_every: int,
    time_limit_s: float | None,
    chunk_steps: int,
    collect: bool,
    on_steps: Callable[[StepBlock], None] | None,
    progress: Callable[[int], None] | None,
) -> ReplayResult:
    sched = schedule or Schedule()
    sched.check()
    if oracle_every < 0:
        raise EplbError(f"oracle_every must be >= 0, got {oracle_every}")
    src = as_log(log)
    info = src.info
    layers, experts = info.num_layers, info.num_experts
    slots = cluster.slots_per_gpu
    if cost is not None and cost.model.num_experts != experts:
        raise EplbError(f"model {cost.model.name!r} has {cost.model.num_experts} experts, the log has {experts}")
    if int(slots.sum()) < experts:
        raise EplbError(f"{int(slots.sum())} slots on {slots.size} GPUs cannot hold {experts} experts")
    if experts < slots.size:
        raise EplbError(f"{slots.size} GPUs but only {experts} experts: the no-EPLB baseline needs E >= GPUs")

    started = time.perf_counter()
    current = initial_placement(layers, experts, slots)
    static: Placement | None = None
    pending: tuple[int, Placement] | None = None
    evaluator = _Evaluator(layers, experts, slots, cost)
    evaluator.set_placements(current, current)
    window = _Window(sched.window)
    stats = {name: _Stat() for name in BASELINES}
    rebalances: list[Rebalance] = []
    blocks: list[StepBlock] = []
    next_rebalance = sched.first_position
    timing = {"evaluation_s": 0.0, "solve_s": 0.0, "oracle_s": 0.0, "read_s": 0.0}
    done = 0
    t_read = time.perf_counter()
    for chunk in src.iter_counts(chunk_steps):
        timing["read_s"] += time.perf_counter() - t_read
        if chunk.counts.shape[1:] != (layers, experts):
            raise EplbError(f"{info.path}: step {int(chunk.steps[0])} has shape {list(chunk.counts.shape[1:])}")
        pos, end = chunk.start, chunk.start + chunk.num_steps
        while pos < end:
            if pos == next_rebalance:
                rb, placement = _rebalance(window, pos, chunk, sched, cluster, solver, split, cost, current,
                                           time_limit_s)
                rebalances.append(rb)
                timing["solve_s"] += rb.solve_ms / 1000
                pending = (pos + sched.delay, placement)
                next_rebalance += sched.interval
            if pending is not None and pos == pending[0]:
                current = pending[1]
                if static is None:
                    static = current
                evaluator.set_placements(current, static)
                pending = None
            stop = min(end, next_rebalance, pending[0] if pending is not None else end)
            block = _evaluate_block(chunk, pos, stop, evaluator, cluster, oracle_every, timing)
            for name, lb, t in (
                ("replay", block.lb, block.time_us),
                ("static", block.static_lb, block.static_time_us),
                ("no_eplb", block.no_eplb_lb, block.no_eplb_time_us),
                ("oracle", block.oracle_lb, block.oracle_time_us),
            ):
                stats[name].add(lb, t)
            if on_steps is not None:
                on_steps(block)
            if collect:
                blocks.append(block)
            keep_from = max(pos, next_rebalance - sched.window)
            if keep_from < stop:
                window.store(range(keep_from, stop), chunk.counts[keep_from - chunk.start : stop - chunk.start])
            pos = stop
        done = end
        if progress is not None:
            progress(done)
        t_read = time.perf_counter()
    if done == 0:
        raise EplbError(f"{info.path}: the log has no steps")

    wall = time.perf_counter() - started
    layer_steps = done * layers
    name = solver if split == "uniform" else f"{solver}-{split}"
    summary = _summary(info, cluster, sched, name, oracle_every, stats, rebalances, cost, done, wall, timing)
    summary["timing"]["layer_steps_per_s"] = round(layer_steps / wall, 1) if wall > 0 else None
    ev = timing["evaluation_s"]
    summary["timing"]["evaluation_layer_steps_per_s"] = round(layer_steps / ev, 1) if ev > 0 else None
    return ReplayResult(
        info=info,
        cluster=cluster,
        schedule=sched,
        solver=name,
        rebalances=rebalances,
        summary=summary,
        final=current,
        static=static,
        steps=StepBlock.concat(blocks) if collect and blocks else None,
    )


def _rebalance(
    window: _Window,
    pos: int,
    chunk: CountsChunk,
    sched: Schedule,
    cluster: Cluster,
    solver: str,
    split: str,
    cost: CostSetup | None,
    current: Placement,
    time_limit_s: float | None,
) -> tuple[Rebalance, Placement]:
    """Solve the window before position `pos` against the serving placement."""
    lo = max(0, pos - sched.window)
    loads = window.loads(lo, pos, sched.ewma)
    options = applicable(solver, Options(time_limit_s=time_limit_s))
    outcome = solve(loads, cluster, solver=solver, split=split, current=current, options=options)
    moves = outcome.moves if outcome.moves is not None else np.zeros(loads.shape[0], dtype=np.int64)
    total = int(moves.sum())
    rb = Rebalance(
        position=pos,
        step=int(chunk.steps[pos - chunk.start]),
        applies_from=pos + sched.delay,
        window_steps=pos - lo,
        moves=total,
        moves_per_layer=moves,
        bytes_moved=None if cost is None else total * cost.model.expert_bytes,
        solve_ms=float(outcome.solver["wall_ms"]),
        window_lb=outcome.balance.lb,
        solver_info=outcome.solver,
    )
    return rb, outcome.placement


def _evaluate_block(
    chunk: CountsChunk,
    pos: int,
    stop: int,
    evaluator: _Evaluator,
    cluster: Cluster,
    oracle_every: int,
    timing: dict[str, float],
) -> StepBlock:
    counts = chunk.counts[pos - chunk.start : stop - chunk.start]
    n, layers = counts.shape[0], counts.shape[1]
    t0 = time.perf_counter()
    lb, times = evaluator.evaluate(counts)
    timing["evaluation_s"] += time.perf_counter() - t0
    oracle_lb = np.full((n, layers), np.nan)
    oracle_time = np.full((n, layers), np.nan)
    if oracle_every:
        first = (-pos) % oracle_every
        picked = np.arange(first, n, oracle_every)
        if picked.size:
            t0 = time.perf_counter()
            o_lb, o_time = _oracle(counts[picked], cluster, evaluator.time)
            timing["oracle_s"] += time.perf_counter() - t0
            oracle_lb[picked] = o_lb
            oracle_time[picked] = o_time
    return StepBlock(
        start=pos,
        steps=chunk.steps[pos - chunk.start : stop - chunk.start],
        lb=lb[:, 0].T,
        static_lb=lb[:, 1].T,
        no_eplb_lb=lb[:, 2].T,
        oracle_lb=oracle_lb,
        time_us=times[:, 0].T,
        static_time_us=times[:, 1].T,
        no_eplb_time_us=times[:, 2].T,
        oracle_time_us=oracle_time,
    )


def _summary(
    info: LogInfo,
    cluster: Cluster,
    sched: Schedule,
    solver: str,
    oracle_every: int,
    stats: dict[str, _Stat],
    rebalances: list[Rebalance],
    cost: CostSetup | None,
    steps: int,
    wall: float,
    timing: dict[str, float],
) -> dict[str, Any]:
    slots = cluster.slots_per_gpu
    base = stats["no_eplb"].to_dict()
    results: dict[str, Any] = {}
    for name in BASELINES:
        d = stats[name].to_dict()
        if d.get("step_time_us") and base.get("step_time_us"):
            d["speedup_vs_no_eplb"] = round(base["step_time_us"] / d["step_time_us"], 4)
        results[name] = d
    moved = [r.bytes_moved for r in rebalances]
    return {
        "log": {
            "path": info.path,
            "kind": info.kind,
            "steps": steps,
            "layers": info.num_layers,
            "experts": info.num_experts,
            "model": info.model,
            "top_k": info.top_k,
        },
        "cluster": {
            "gpus": int(slots.size),
            "slots_per_gpu": slots.tolist(),
            "redundant": int(slots.sum()) - info.num_experts,
            "gpus_per_node": cluster.gpus_per_node,
            "groups": cluster.num_groups,
        },
        "schedule": {
            "window": sched.window,
            "interval": sched.interval,
            "first_rebalance": sched.first_position,
            "delay": sched.delay,
            "ewma": sched.ewma,
            "solver": solver,
            "oracle_every": oracle_every,
        },
        "cost": None
        if cost is None
        else {
            "model": cost.model.name,
            "hardware": cost.hardware.name,
            "link_bandwidth": cost.link_bw,
            "tokens_per_gpu": cost.tokens_per_gpu,
            "overlap": cost.overlap,
        },
        "results": results,
        "rebalances": {
            "count": len(rebalances),
            "moves": sum(r.moves for r in rebalances),
            "bytes_moved": None if any(b is None for b in moved) else float(sum(b for b in moved if b is not None)),
            "solve_ms_mean": round(float(np.mean([r.solve_ms for r in rebalances])), 3) if rebalances else None,
            "solve_ms_max": round(max(r.solve_ms for r in rebalances), 3) if rebalances else None,
            "list": [r.to_dict() for r in rebalances],
        },
        "timing": {
            "wall_s": round(wall, 3),
            **{k: round(v, 3) for k, v in timing.items()},
        },
    }
