"""Every placement's realized lb and predicted layer time for blocks of steps.

One compiled pass per block (eplb/replay/_evaluate.c): tile by tile of steps and layer, the counts are
transposed in cache and every placement's GPU rows are gathered and summed over the GPU's slots in vector
registers, keeping only the busiest and idlest GPU's rows, the most active slots, the layer's total and the
lb per step (every GPU's rows and active slots too when the time model needs them). The times come from
`eplb.cost.TimeModel`, the same model `eplb.cost.predict` uses: `layer_time_from_extremes` on those arrays,
laid out [placements, steps, layers] as returned. Memory: a few [placements, steps, layers] arrays per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.cost import TimeModel
from eplb.placement import Placement
from eplb.replay import _evaluate
from eplb.solve import Cluster, CostSetup
from solvers.greedy import solve_greedy

__all__ = ["Evaluator", "oracle", "time_model"]

_KINDS = {np.dtype(np.uint8): "B", np.dtype(np.uint16): "H", np.dtype(np.uint32): "I", np.dtype(np.int32): "i",
          np.dtype(np.int64): "q", np.dtype(np.float32): "f"}  # fmt: skip
_ORACLE_BATCH_STEPS = 32  # steps per vectorized oracle solve, at most ...
_ORACLE_BATCH_SLOTS = 32 * 58 * 288  # ... and at most this many rows x slots (32 steps of DeepSeek-V3 at EP32, 288
# slots): greedy's time grows with rows x slots, batched or not (5 s a row at 65,536 slots), so a large cluster solves
# fewer steps a batch and reports progress between them


def time_model(cost: CostSetup, gpus: int, gpus_per_node: int | None = None) -> TimeModel:
    """The TimeModel of a cost setup on G GPUs (each step's counts are its routed rows)."""
    return TimeModel.from_specs(cost.model, cost.hardware, cost.link_bw, gpus, cost.tokens_per_gpu, cost.overlap,
                                inter_node_bw=cost.inter_node_bw, gpus_per_node=gpus_per_node)  # fmt: skip


class Evaluator:
    """lb and time of K placements (same layers, experts and slots) on blocks of per-step counts."""

    def __init__(self, time: TimeModel | None, threads: int = 1) -> None:
        """threads: the compiled pass splits the layers over this many threads."""
        self.time = time
        self.threads = max(1, threads)
        self.placements: list[Placement] = []
        self._expert = np.zeros((0, 0, 0), dtype=np.int64)
        self._share = np.zeros((0, 0, 0), dtype=np.float32)
        self._bounds = np.zeros((0, 0), dtype=np.int64)

    def set_placements(self, placements: Sequence[Placement]) -> None:
        """Placements to evaluate, in the order `evaluate` returns them (slot counts may differ)."""
        self.placements = list(placements)
        width = max(p.num_physical for p in placements)
        layers = placements[0].num_layers
        expert = np.zeros((layers, len(placements), width), dtype=np.int64)
        share = np.zeros((layers, len(placements), width), dtype=np.float32)
        bounds = np.zeros((len(placements), placements[0].num_gpus + 1), dtype=np.int64)
        for k, p in enumerate(placements):
            expert[:, k, : p.num_physical] = p.phy2log
            share[:, k, : p.num_physical] = p.slot_shares()
            bounds[k, 1:] = np.cumsum(p.slots_per_gpu)
        self._expert, self._share, self._bounds = expert, share, bounds

    def evaluate(
        self, counts: NDArray[Any], reach: NDArray[np.float64] | None = None
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """counts [n, L, E] -> (lb [K, n, L], time_us [K, n, L]) per placement; time NaN without a model, lb NaN
        where the layer has no tokens that step (no lb: not perfectly balanced).
        reach: [K, n, L, G] each step's fraction of tokens reaching each GPU (token-level logs,
        `eplb.coactivation.step_reach`; [K, n, L, G + N] with two links, then each node's): the comm term counts
        one copy per GPU a token reaches."""
        n, layers, experts = counts.shape
        k, width = self._expert.shape[1], self._expert.shape[2]
        gpus = self._bounds.shape[1] - 1
        kind = _KINDS.get(counts.dtype)
        if kind is None:
            counts, kind = counts.astype(np.float32), "f"
        counts = np.ascontiguousarray(counts)
        total = np.empty((n, layers))  # the layer's summed counts per step, exact for integer counts
        if kind == "f":
            counts.sum(axis=2, dtype=np.float64, out=total)
        lb = np.empty((k, n, layers))
        rmax, rmin, amax = (np.empty((k, n, layers), dtype=np.float32) for _ in range(3))
        per_gpu = self.time is not None and (reach is not None or not self.time.extremes_suffice)
        rows = np.empty((k, n, layers, gpus), dtype=np.float32) if per_gpu else None
        active = np.empty_like(rows) if rows is not None else None
        _evaluate.evaluate(counts, kind, n, layers, experts, self._expert, self._share, k, width, self._bounds, gpus,
                           total, kind == "f", lb, rmax, rmin, amax, rows, active, self.threads)  # fmt: skip
        lb[:, total <= 0] = np.nan
        if self.time is None:
            return lb, np.full(lb.shape, np.nan)
        if rows is not None and active is not None:
            times = self.time.layer_time(total[None, :, :, None], rows, active, reach)
        else:
            times = self.time.layer_time_from_extremes(total[None], rmax, rmin, amax)
        return lb, times


def oracle(
    counts: NDArray[Any],
    cluster: Cluster,
    time: TimeModel | None,
    reach_of: Callable[[int, NDArray[np.int64]], NDArray[np.float64]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Greedy on every step's own counts: (lb [n, L], NaN where a layer has no tokens; time_us [n, L]). All steps
    and layers are one batch of rows for `solve_greedy` (vectorized over rows; its loops run over slots).
    reach_of(i, phy2log [L, P]): step i's reach [L, G] (or [L, G + N], `TimeModel.reach_width`) of the step's own
    placement (token-level logs), for the comm term. progress(k): called with the steps solved so far after each
    batch (`_ORACLE_BATCH_STEPS`, fewer on a large cluster: `_ORACLE_BATCH_SLOTS`)."""
    n, layers, experts = counts.shape
    slots = cluster.slots_per_gpu
    lb = np.empty((n, layers))
    times = np.full((n, layers), np.nan)
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
    batch = max(1, min(_ORACLE_BATCH_STEPS, _ORACLE_BATCH_SLOTS // max(1, layers * int(slots.sum()))))
    for a in range(0, n, batch):
        b = min(n, a + batch)
        loads = counts[a:b].reshape(-1, experts).astype(np.float64)
        p2l = solve_greedy(loads, slots, num_groups=cluster.num_groups, gpus_per_node=cluster.gpus_per_node)
        flat = p2l + (np.arange(loads.shape[0], dtype=np.int64) * experts)[:, None]
        replicas = np.bincount(flat.ravel(), minlength=loads.size).astype(np.float64)
        slot_load = loads.ravel()[flat] / replicas[flat]
        gpu_rows = np.add.reduceat(slot_load, starts, axis=1)
        total = loads.sum(axis=1)
        mean = total / slots.size
        peak = gpu_rows.max(axis=1)
        lb[a:b] = np.divide(peak, mean, out=np.full_like(peak, np.nan), where=mean > 0).reshape(b - a, layers)
        if time is not None:
            active = np.add.reduceat((slot_load > 0).astype(np.float64), starts, axis=1)
            reach = None
            if reach_of is not None:
                per_step = p2l.reshape(b - a, layers, -1)
                reach = np.concatenate([reach_of(a + i, per_step[i]) for i in range(b - a)])  # [(b - a) L, width]
            t = time.layer_time(total[:, None], gpu_rows, active, reach)
            times[a:b] = t.reshape(b - a, layers)
        if progress is not None:
            progress(b)
    return lb, times
