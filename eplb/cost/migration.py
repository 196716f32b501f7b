"""What moving expert weights costs: bytes per destination GPU, transfer time, and its effect on serving.

A rebalance copies every expert that lands on a GPU not holding it (in that layer) from a GPU that
does. Copies into different GPUs run in parallel, one stream per GPU, so the transfer lasts as long as
the busiest destination: `max_g bytes_in[g] / link_bw`. Two ways to apply them (docs/cost-model.md,
"Migration"):

- blocking: serving stops while the weights move; the stall adds to the simulated time;
- overlap (vLLM's layer-by-layer moves while serving): the copies take a share of the link for
  `bytes / (share x link_bw)`; meanwhile the all-to-all runs on the rest, so a step whose comm
  is the fraction c of its layer time slows by max(0, c / (1 - share) - 1) of itself; the new
  placement serves only once the copies are done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError

__all__ = ["MigrationCost", "MigrationSpec", "copies_per_gpu"]


@dataclass(frozen=True)
class MigrationSpec:
    """How weights move. link_bw: B/s per GPU and direction for the copies (`eplb.specs.link_bandwidth`:
    nvlink, nic, pcie or GB/s); overlap: copies run while serving (True) or stall it (False);
    link_share: with overlap, the fraction of the link the copies take from the all-to-all (0, 1)."""

    link_bw: float
    overlap: bool = True
    link_share: float = 0.25

    def check(self) -> None:
        if not (math.isfinite(self.link_bw) and self.link_bw > 0):
            raise EplbError(f"migration link bandwidth must be positive (B/s), got {self.link_bw!r}")
        if not (0 < self.link_share < 1):
            raise EplbError(f"migration link share must be in (0, 1), got {self.link_share!r}")

    def cost(self, bytes_in: NDArray[np.float64], comm_fraction: float) -> MigrationCost:
        """The cost of copying bytes_in [G] bytes into each GPU while serving steps whose comm term is
        `comm_fraction` (0..1) of their layer time."""
        peak = float(bytes_in.max()) if bytes_in.size else 0.0
        if not self.overlap:
            seconds = peak / self.link_bw
            return MigrationCost(float(bytes_in.sum()), seconds, stall_s=seconds, slowdown=0.0)
        seconds = peak / (self.link_share * self.link_bw)
        slowdown = max(0.0, min(1.0, comm_fraction) / (1.0 - self.link_share) - 1.0)
        return MigrationCost(float(bytes_in.sum()), seconds, stall_s=0.0, slowdown=slowdown)


@dataclass(frozen=True)
class MigrationCost:
    """One rebalance's weight moves. bytes: all copies; transfer_s: how long they take; stall_s: serving
    time lost outright (blocking); slowdown: with overlap, the relative slowdown of the steps served
    while the copies run (their extra time = slowdown x their time, at most transfer_s x slowdown)."""

    bytes: float
    transfer_s: float
    stall_s: float
    slowdown: float

    def charge_s(self, step_time_s: float) -> tuple[float, int]:
        """(seconds charged, steps the copies span) when steps take step_time_s each."""
        if self.transfer_s <= 0:
            return 0.0, 0
        if self.stall_s > 0:
            return self.stall_s, 0
        steps = math.ceil(self.transfer_s / step_time_s) if step_time_s > 0 else 0
        return self.transfer_s * self.slowdown, steps


def copies_per_gpu(
    new: NDArray[np.int64], old: NDArray[np.int64], slots_per_gpu: NDArray[np.int64]
) -> NDArray[np.int64]:
    """Expert copies each GPU receives: [G], summed over layers. new, old: phy2log [L, P] on the same
    slots; a copy is an expert a GPU holds in `new` but not in `old` (same layer)."""
    layers, _ = new.shape
    gpus = slots_per_gpu.size
    experts = int(max(new.max(initial=0), old.max(initial=0))) + 1
    gpu = np.repeat(np.arange(gpus, dtype=np.int64), slots_per_gpu)
    base = (np.arange(layers, dtype=np.int64)[:, None] * gpus + gpu[None, :]) * experts
    size = layers * gpus * experts
    has_new = np.bincount((base + new).ravel(), minlength=size) > 0
    has_old = np.bincount((base + old).ravel(), minlength=size) > 0
    out: NDArray[np.int64] = (has_new & ~has_old).reshape(layers, gpus, experts).sum(axis=(0, 2)).astype(np.int64)
    return out
