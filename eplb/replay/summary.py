"""Streaming statistics of a replay's rows (replay, baselines) with fixed memory, and the note a summary shares with
`eplb solve`'s (`weight_reads_note`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["BASELINES", "RowStats", "weight_reads_note"]

BASELINES: tuple[str, ...] = ("no_eplb", "static", "replay", "hindsight", "oracle")
"""Summary rows, in the order the CLI prints them."""

_HIST_BINS = 16_000  # lb histogram for percentiles: bins of 0.001 from 1.0 to 17.0, then overflow
_HIST_WIDTH = 1e-3
EXACT_VALUES = 65_536
"""lb values a row keeps as they are (512 KiB): its percentiles are exact up to this many layer-steps, and come
from the histogram (at most 0.001 above) beyond."""


@dataclass
class RowStats:
    """Running lb and time statistics of one row (memory: a fixed histogram, and the first EXACT_VALUES lb values).
    migration_s: seconds charged for weight moves (stalls, or the slowdown of steps served while copies run)."""

    count: int = 0
    lb_sum: float = 0.0
    lb_max: float = 0.0
    hist: NDArray[np.int64] = field(default_factory=lambda: np.zeros(_HIST_BINS + 1, dtype=np.int64))
    values: list[NDArray[np.float64]] = field(default_factory=list)
    """Every lb value added, while there are at most EXACT_VALUES of them (then emptied: the histogram alone)."""
    steps: int = 0
    step_time_sum: float = 0.0
    has_time: bool = True
    migration_s: float = 0.0

    def add(self, lb: NDArray[np.float64], time_us: NDArray[np.float64], rows: NDArray[np.bool_] | None = None) -> None:
        """lb, time_us: [n, L] of n steps; rows: [n] the steps that belong to the row (None: all; the sampled
        oracle passes its sampled steps). NaN lb: a layer without tokens that step, which has no lb and is left
        out of the lb statistics; the step still counts, and so does its time."""
        if rows is not None:
            lb, time_us = lb[rows], time_us[rows]
        if not lb.shape[0]:
            return
        values = lb[~np.isnan(lb)]
        if values.size:
            if self.exact and self.count + values.size <= EXACT_VALUES:
                self.values.append(values.astype(np.float64))
            else:
                self.values = []
            self.count += values.size
            self.lb_sum += float(values.sum())
            self.lb_max = max(self.lb_max, float(values.max()))
            idx = np.minimum(((values - 1.0) / _HIST_WIDTH).astype(np.int64), _HIST_BINS)
            self.hist += np.bincount(np.maximum(idx, 0).ravel(), minlength=_HIST_BINS + 1)
        self.steps += lb.shape[0]
        if np.isnan(time_us).any():
            self.has_time = False
        else:
            self.step_time_sum += float(time_us.sum())

    @property
    def exact(self) -> bool:
        """True while `values` holds every lb value added (at most EXACT_VALUES)."""
        return sum(v.size for v in self.values) == self.count

    def quantile(self, q: float) -> float:
        """The nearest-rank q-quantile of the lb values: the k-th smallest, k = ceil(q x count) (at least 1), as
        numpy's `np.quantile(values, q, method="inverted_cdf")`; exact while `exact`, else the upper edge of the
        histogram bin holding it (at most 0.001 above; lb_max for the overflow bin). NaN without values."""
        if not self.count:
            return math.nan
        k = max(1, math.ceil(round(q * self.count, 9)))  # rounded: 0.07 x 100 is 7.000000000000001
        if self.exact:
            return float(np.partition(np.concatenate(self.values), k - 1)[k - 1])
        i = int(np.searchsorted(np.cumsum(self.hist), k, side="left"))
        return self.lb_max if i >= _HIST_BINS else min(self.lb_max, 1.0 + (i + 1) * _HIST_WIDTH)

    @classmethod
    def merged(cls, parts: list[RowStats]) -> RowStats:
        """One row's statistics over all layers from its statistics over layer ranges of the same steps."""
        out = cls()
        out.count = sum(p.count for p in parts)
        out.lb_sum = sum(p.lb_sum for p in parts)
        out.lb_max = max(p.lb_max for p in parts)
        out.hist = np.sum([p.hist for p in parts], axis=0)
        exact = all(p.exact for p in parts) and out.count <= EXACT_VALUES
        out.values = [v for p in parts for v in p.values] if exact else []
        out.steps = parts[0].steps
        out.has_time = all(p.has_time for p in parts)
        out.step_time_sum = sum(p.step_time_sum for p in parts)
        out.migration_s = sum(p.migration_s for p in parts)
        return out

    @property
    def lb_mean(self) -> float:
        return self.lb_sum / self.count if self.count else math.nan

    def to_dict(self, all_steps: int | None = None) -> dict[str, Any]:
        """lb mean and percentiles; mean step time µs (MoE layers), and the total simulated time s =
        steps' MoE time + migration charges. all_steps: the row covers a sample of this many steps (the
        sampled oracle): serving and total time are scaled from its steps to them."""
        if not self.count:
            return {"steps": 0}
        timed = self.has_time and self.steps > 0
        scale = 1.0 if all_steps is None else all_steps / self.steps
        serve_s = self.step_time_sum / 1e6 * scale if timed else None
        return {
            "steps": self.steps,
            "lb_mean": round(self.lb_mean, 6),
            "lb_p50": round(self.quantile(0.5), 3),
            "lb_p99": round(self.quantile(0.99), 3),
            "lb_max": round(self.lb_max, 6),
            "step_time_us": round(self.step_time_sum / self.steps, 3) if timed else None,
            "serving_s": None if serve_s is None else round(serve_s, 6),
            "migration_s": round(self.migration_s, 6) if timed else None,
            "total_time_s": None if serve_s is None else round(serve_s + self.migration_s, 6),
        }


def weight_reads_note(num_experts: int, num_physical: int, remedy: str, *, baseline: str = "the baseline",
                      placement: str = "this placement fills") -> str:
    """Why a placement of ``num_physical`` filled slots per layer is predicted slower than the baseline of
    ``num_experts`` (no redundancy): every redundant slot is one more expert's weights read per layer, which outweighs
    the balance at small batches. remedy: the end of the line (what reads less). `eplb solve` and `eplb replay`
    print it."""
    return (f"note: slower than {baseline}, which reads {num_experts} experts' weights per layer where {placement} "
            f"{num_physical} slots{remedy}")
