"""What moving expert weights costs: bytes per destination GPU, transfer time, and its effect on serving.

A rebalance copies every expert that lands on a GPU not holding it (in that layer) from a GPU that
does: the copies and their sources are the migration plan's (`solvers.plan.build_plan`, `plan_for`).
Copies into different GPUs run in parallel, one stream per GPU, so the transfer lasts as long as the
busiest destination: `max_g bytes_in[g] / link_bw`. Two ways to apply them (docs/cost-model.md,
"Migration"):

- blocking: serving stops while the weights move; the stall adds to the simulated time;
- overlap (vLLM's layer-by-layer moves while serving): the copies take a share of the link for
  `bytes / (share x link_bw)`; meanwhile the all-to-all runs on the rest (every GPU's comm term takes
  1 / (1 - share) as long) and every copy is read from a source GPU's HBM and written to the destination's,
  so a GPU whose copies take the fraction h of its HBM bandwidth reads its experts' weights 1 / (1 - h) as
  long. A step slows by what both add to its layers' times (each layer's slowest GPU, terms combined as the
  cost model does: `MigrationSpec.slowdown`), and the steps served while the copies run lose
  `transfer_s x d / (1 + d)` for a slowdown d. The new placement serves only once the copies are done.

Either way a rebalance that copies anything may also stop serving for a fixed `fixed_stall_s` (host-side
planning, building the transfer ops, synchronizing the ranks), which the bytes do not show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError
from solvers.plan import MigrationPlan, build_plan

if TYPE_CHECKING:
    from eplb.cost.model import LayerPrediction

MAX_FIXED_STALL_S = 3600.0
"""The largest fixed stall per rebalance accepted, s."""

__all__ = ["MAX_FIXED_STALL_S", "MigrationCost", "MigrationSpec", "plan_copies", "plan_for"]


@dataclass(frozen=True)
class MigrationSpec:
    """How weights move. link_bw: B/s per GPU and direction for the copies (`eplb.specs.link_bandwidth`:
    nvlink, nic, pcie or GB/s); overlap: copies run while serving (True) or stall it (False);
    link_share: with overlap, the fraction of the link the copies take from the all-to-all (0, 1);
    hbm_bw: a GPU's HBM B/s, for the copies' reads and writes that the weight reads of the steps served
    meanwhile wait for (with overlap; None: not charged). gpus_per_node: the plan reads a copy on its
    destination's node when it can; inter_node_bw (two links, needs gpus_per_node): copies from a GPU on another
    node take that link, copies within a node link_bw; both run at once. fixed_stall_s: seconds serving stops at
    every rebalance that copies anything, besides the copies themselves (0: none)."""

    link_bw: float
    overlap: bool = True
    link_share: float = 0.25
    hbm_bw: float | None = None
    inter_node_bw: float | None = None
    gpus_per_node: int | None = None
    fixed_stall_s: float = 0.0

    def check(self) -> None:
        for bw in (self.link_bw, self.inter_node_bw):
            if bw is not None and not (math.isfinite(bw) and bw > 0):
                raise EplbError(f"migration link bandwidth must be positive (B/s), got {bw!r}")
        if self.inter_node_bw is not None and not (self.gpus_per_node and self.gpus_per_node > 0):
            raise EplbError("migration over two links needs the GPUs per node")
        if not (0 < self.link_share < 1):
            raise EplbError(f"migration link share must be in (0, 1), got {self.link_share!r}")
        if self.hbm_bw is not None and not (math.isfinite(self.hbm_bw) and self.hbm_bw > 0):
            raise EplbError(f"HBM bandwidth must be positive (B/s), got {self.hbm_bw!r}")
        if not (math.isfinite(self.fixed_stall_s) and 0 <= self.fixed_stall_s <= MAX_FIXED_STALL_S):
            raise EplbError(f"the fixed stall per rebalance must be 0 to {MAX_FIXED_STALL_S:g} s, "
                            f"got {self.fixed_stall_s!r}")

    def slowdown(self, serving: LayerPrediction, hbm_share: NDArray[np.float64] | None = None) -> float:
        """The relative slowdown of a step like `serving` (a prediction, per GPU and layer) while the copies run:
        every GPU's comm term takes 1 / (1 - link_share) as long, and GPU g's weight reads 1 / (1 - hbm_share[g])
        (hbm_share [G]: the fraction of its HBM bandwidth the copies take; None: none); each layer waits for its
        slowest GPU, terms combined as the cost model combines them (`eplb.cost.model.combine_terms`: comm hidden
        behind the GEMMs with overlap, after them without); 0 for a step without time."""
        from eplb.cost.model import combine_terms

        def step_us(comm: float, weight: NDArray[np.float64] | float) -> float:
            times = combine_terms(serving.gpu_compute_us, serving.gpu_weight_read_us * weight,
                                  serving.gpu_comm_us * comm, serving.overlap)  # fmt: skip
            return float(times.max(axis=1, initial=0.0).sum())

        before = step_us(1.0, 1.0)
        weight = 1.0 if hbm_share is None else 1.0 / (1.0 - hbm_share)
        return max(0.0, step_us(1.0 / (1.0 - self.link_share), weight) / before - 1.0) if before > 0 else 0.0

    def cost(
        self,
        bytes_in: NDArray[np.float64],
        serving: LayerPrediction | None = None,
        bytes_out: NDArray[np.float64] | None = None,
        remote_in: NDArray[np.float64] | None = None,
    ) -> MigrationCost:
        """The cost of copying bytes_in [G] bytes into each GPU (read from bytes_out [G] of each GPU, None: not
        known) while serving steps like `serving` (None: the copies slow nothing; blocking copies stop serving
        whatever it is). remote_in [G]: the part of bytes_in read from other nodes (two links; None: every copy
        takes link_bw)."""
        if remote_in is not None and self.inter_node_bw is not None:
            per_gpu = np.maximum((bytes_in - remote_in) / self.link_bw, remote_in / self.inter_node_bw)
        else:
            per_gpu = bytes_in / self.link_bw
        link_s = float(per_gpu.max()) if per_gpu.size else 0.0  # seconds at full link speed
        if not self.overlap:  # at link speed the copies' HBM traffic fits in the stall
            return MigrationCost(float(bytes_in.sum()), link_s, stall_s=link_s + self.fixed_stall_s, slowdown=0.0,
                                 overlap=False)  # fmt: skip
        seconds = link_s / self.link_share
        hbm_share = None
        if self.hbm_bw is not None and bytes_out is not None and seconds > 0:
            hbm_share = np.minimum(0.99, (bytes_in + bytes_out) / seconds / self.hbm_bw)  # copies' HBM B/s per GPU
        slowdown = 0.0 if serving is None else self.slowdown(serving, hbm_share)
        return MigrationCost(float(bytes_in.sum()), seconds, stall_s=self.fixed_stall_s, slowdown=slowdown)

    def rebalance_cost(
        self,
        new: NDArray[np.int64],
        old: NDArray[np.int64],
        slots_per_gpu: NDArray[np.int64],
        expert_bytes: float,
        serving: LayerPrediction,
        plan: MigrationPlan | None = None,
    ) -> MigrationCost:
        """What turning the serving placement `old` into `new` (phy2log [L, P], aligned) costs while steps like
        the one `serving` predicts (the serving placement on the recent mean step) are served: the copies, their
        sources and which of them cross nodes are the migration plan's. plan: the plan from `old` to `new` when the
        caller has one (`eplb.solve.Outcome.plan` of the solve from `old`), read from sources on the destinations'
        nodes of this spec's gpus_per_node (`solvers.plan.build_plan`'s gpus_per_node); its stages, if budgeted,
        are the copies the cluster will run; None: built here (`plan_for`: one stage per layer)."""
        if plan is None:
            plan = plan_for(new, old, slots_per_gpu, self.gpus_per_node)
        copies_in, copies_out, across = plan_copies(plan, slots_per_gpu.size, self.gpus_per_node)
        remote_in = across * expert_bytes if self.inter_node_bw is not None and self.gpus_per_node else None
        return self.cost(copies_in * expert_bytes, serving, copies_out * expert_bytes, remote_in)


@dataclass(frozen=True)
class MigrationCost:
    """One rebalance's weight moves. bytes: all copies; transfer_s: how long they take; stall_s: serving
    time lost outright (blocking copies, and the spec's fixed stall); slowdown: with overlap, the relative
    slowdown of the steps served while the copies run, their link and HBM traffic included (each takes
    1 + slowdown times as long, so over the transfer_s they run, serving loses transfer_s x slowdown /
    (1 + slowdown)); overlap: the copies run while serving."""

    bytes: float
    transfer_s: float
    stall_s: float
    slowdown: float
    overlap: bool = True

    def charge_s(self, step_time_s: float) -> tuple[float, int]:
        """(seconds charged, steps the copies span) when steps take step_time_s each; nothing when nothing
        is copied."""
        if self.transfer_s <= 0:
            return 0.0, 0
        if not self.overlap:
            return self.stall_s, 0
        steps = math.ceil(self.transfer_s / step_time_s) if step_time_s > 0 else 0
        return self.stall_s + self.transfer_s * self.slowdown / (1.0 + self.slowdown), steps


def plan_for(
    new: NDArray[np.int64], old: NDArray[np.int64], slots_per_gpu: NDArray[np.int64], gpus_per_node: int | None = None,
    stage_copies: int | None = None,
) -> MigrationPlan:
    """The migration plan from `old` to the aligned `new` (phy2log [L, P], -1: empty) that the estimates count:
    `solvers.plan.build_plan`, whose choice of sources (on the destination's node when the cluster has nodes and
    one is there, replicas that stay put first, in turn; a copy across the NIC where a stage budget breaks a
    cycle) is the one rule the plan and the estimate share. stage_copies: most copies per stage (the plan's
    stage budget / one copy's bytes); None: one stage per layer, the plan `eplb solve` builds without
    --stage-gib. PlanError (a ValueError) for placements that are not aligned."""
    budget = None if stage_copies is None else float(stage_copies)
    return build_plan(old, new, slots_per_gpu, 1.0, budget, gpus_per_node)


def plan_copies(plan: MigrationPlan, num_gpus: int, gpus_per_node: int | None) -> tuple[
        NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:  # fmt: skip
    """(copies into each GPU [G], copies read from each GPU [G], copies into each GPU read from another node [G]),
    summed over layers, of `plan`'s copies (local writes and releases move nothing between GPUs): the one count
    of copies the estimates use. A copy into g is an expert g holds in the new placement but not in the serving
    one (same layer), read from the source the plan chose; across nodes are those whose source is on another
    node (nodes: gpus_per_node consecutive GPUs; None: one node, nothing crosses), which without a stage budget
    are the copies of an expert with no replica on the destination's node, and under one may also be reads
    across the NIC that break a cycle of copies longer than the budget."""
    copy = ~plan.local
    per_node = gpus_per_node or num_gpus
    across = copy & (plan.src_gpu // per_node != plan.dst_gpu // per_node)
    into, sent, far = (np.bincount(g, minlength=num_gpus).astype(np.float64)
                       for g in (plan.dst_gpu[copy], plan.src_gpu[copy], plan.dst_gpu[across]))
    return into, sent, far
