"""One place where a load window becomes a placement with its predicted balance and time.

The CLI (`eplb solve`, `eplb evaluate`) and the HTTP API both call `solve` / `evaluate` here and print
or return `Outcome.to_dict()`, so the two always agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from eplb.cost import LayerPrediction, predict
from eplb.errors import EplbError
from eplb.evaluate import Balance, balance, contiguous_placement
from eplb.placement import Placement
from eplb.specs import MODEL_PRESETS, HardwareSpec, ModelSpec
from solvers.bounds import lower_bound
from solvers.greedy import solve_greedy
from solvers.migration import count_moves, relabel_gpus

SolverName = Literal["greedy", "milp"]
SOLVERS: tuple[str, ...] = ("greedy", "milp")


@dataclass(frozen=True)
class Cluster:
    """slots_per_gpu: [G] expert slots on each GPU; gpus_per_node and num_groups select the
    hierarchical policy (expert groups kept within nodes) when both are given."""

    slots_per_gpu: NDArray[np.int64]
    gpus_per_node: int | None = None
    num_groups: int | None = None

    @property
    def num_gpus(self) -> int:
        return int(self.slots_per_gpu.size)


@dataclass(frozen=True)
class CostSetup:
    """What the time prediction needs: specs, all-to-all link bandwidth (B/s), tokens per GPU in one
    step (None: the window is taken as one step) and whether comm overlaps the GEMMs."""

    model: ModelSpec
    hardware: HardwareSpec
    link_bw: float
    tokens_per_gpu: float | None = None
    overlap: bool = True


@dataclass
class Outcome:
    """A placement (new or given) judged on a window, with the no-EPLB baseline beside it."""

    placement: Placement
    balance: Balance
    baseline: Balance
    solver: dict[str, Any] = field(default_factory=dict)
    prediction: LayerPrediction | None = None
    baseline_prediction: LayerPrediction | None = None
    moves: NDArray[np.int64] | None = None
    bytes_per_move: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `eplb solve --json` prints and `POST /placement` returns."""
        predicted: dict[str, Any] = _balance_dict(self.balance)
        baseline: dict[str, Any] = _balance_dict(self.baseline)
        if self.prediction is not None and self.baseline_prediction is not None:
            predicted.update(_time_dict(self.prediction))
            baseline.update(_time_dict(self.baseline_prediction))
        predicted["baseline"] = baseline
        out: dict[str, Any] = {
            "placement": self.placement.to_dict(),
            "predicted": predicted,
        }
        if self.solver:
            out["solver"] = self.solver
        if self.moves is not None:
            out["moves"] = {
                "per_layer": self.moves.tolist(),
                "total": int(self.moves.sum()),
                "bytes_moved": None if self.bytes_per_move is None else float(self.moves.sum() * self.bytes_per_move),
            }
        return out


def _balance_dict(b: Balance) -> dict[str, Any]:
    return {
        "lb": _round(b.lb),
        "balancedness": _round(b.balancedness),
        "imbalance": _round(b.imbalance),
        "lb_mean": round(float(b.lb.mean()), 6),
        "lb_max": round(float(b.lb.max()), 6),
    }


def _time_dict(p: LayerPrediction) -> dict[str, Any]:
    return {
        "time_us": _round(p.time_us, 3),
        "compute_us": _round(p.compute_us, 3),
        "weight_read_us": _round(p.weight_read_us, 3),
        "comm_us": _round(p.comm_us, 3),
        "bottleneck": list(p.bottleneck),
        "total_time_us": round(p.total_time_us, 3),
        "tokens_per_gpu": _round(p.tokens_per_gpu, 3),
    }


def _round(a: NDArray[np.floating[Any]], digits: int = 6) -> list[float]:
    return [round(float(v), digits) for v in a]


def infer_model(num_experts: int, num_layers: int) -> ModelSpec | None:
    """The preset matching a window's expert count (and layer count when several match), else None."""
    matches = [m for m in MODEL_PRESETS.values() if m.num_experts == num_experts]
    if len(matches) > 1:
        matches = [m for m in matches if m.num_moe_layers == num_layers] or matches[:0]
    return matches[0] if len(matches) == 1 else None


def check_shapes(loads: NDArray[np.float64], cluster: Cluster) -> None:
    """Raise EplbError when the cluster cannot hold the window's experts."""
    num_experts = loads.shape[1]
    total = int(cluster.slots_per_gpu.sum())
    if total < num_experts:
        raise EplbError(
            f"{total} slots on {cluster.num_gpus} GPUs cannot hold {num_experts} experts: need at least "
            f"{-(-num_experts // cluster.num_gpus)} slots per GPU"
        )
    if cluster.gpus_per_node is not None and cluster.num_gpus % cluster.gpus_per_node:
        raise EplbError(f"{cluster.num_gpus} GPUs do not split into nodes of {cluster.gpus_per_node}")
    if cluster.num_groups is not None and (cluster.num_groups < 1 or num_experts % cluster.num_groups):
        raise EplbError(f"{num_experts} experts do not split into {cluster.num_groups} equal groups")


def solve(
    loads: NDArray[np.float64],
    cluster: Cluster,
    *,
    solver: str = "greedy",
    cost: CostSetup | None = None,
    current: Placement | None = None,
    time_limit_s: float | None = None,
    request_time_limit_s: float | None = None,
    split: str = "uniform",
    max_lb_slack: float = 0.01,
) -> Outcome:
    """Place every layer's experts. loads: [layers, E] tokens; time_limit_s (per layer) and
    request_time_limit_s (whole call) bound the MILP. Returns the validated placement, its
    balance next to the contiguous baseline, a lower bound, and the predicted time when `cost` is given."""
    check_shapes(loads, cluster)
    if current is not None:
        _check_current(current, loads, cluster)
    started = time.perf_counter()
    shares: NDArray[np.float64] | None = None
    info: dict[str, Any]
    if solver == "greedy":
        if split != "uniform":
            raise EplbError("the greedy solver gives uniform shares only; use --solver milp for --split weighted")
        phy2log = solve_greedy(
            loads, cluster.slots_per_gpu, num_groups=cluster.num_groups, gpus_per_node=cluster.gpus_per_node
        )
        info = {"name": "greedy", "status": "heuristic"}
        info["layer_ms"] = [round((time.perf_counter() - started) * 1000 / loads.shape[0], 3)] * loads.shape[0]
    elif solver == "milp":
        phy2log, shares, info = _solve_milp(
            loads, cluster, current, time_limit_s, request_time_limit_s, split, max_lb_slack
        )
    else:
        raise EplbError(f"unknown solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    moves = None
    if current is not None:
        if shares is None:
            phy2log = relabel_gpus(phy2log, current.phy2log, cluster.slots_per_gpu)
        moves = count_moves(phy2log, current.phy2log, cluster.slots_per_gpu)
    placement = Placement(phy2log, cluster.slots_per_gpu, loads.shape[1], shares)
    outcome = evaluate(loads, placement, cost)
    bound_tokens = lower_bound(loads, cluster.slots_per_gpu, split="weighted" if shares is not None else "uniform")
    if "bound_tokens" in info:
        bound_tokens = np.maximum(bound_tokens, np.asarray(info.pop("bound_tokens")))
    mean = outcome.balance.gpu_loads.mean(axis=1)
    lb_bound = np.where(mean > 0, bound_tokens / np.where(mean > 0, mean, 1.0), 1.0)
    info["wall_ms"] = round((time.perf_counter() - started) * 1000, 3)
    info["bound"] = _round(lb_bound)
    info["gap"] = _round((outcome.balance.lb - lb_bound) / outcome.balance.lb)
    outcome.solver = info
    outcome.moves = moves
    if cost is not None and moves is not None:
        outcome.bytes_per_move = cost.model.expert_bytes
    return outcome


def _check_current(current: Placement, loads: NDArray[np.float64], cluster: Cluster) -> None:
    if current.num_experts != loads.shape[1] or current.num_layers != loads.shape[0]:
        raise EplbError(
            f"the current placement is for {current.num_layers} layers x {current.num_experts} experts, "
            f"the loads are {loads.shape[0]} x {loads.shape[1]}"
        )
    if current.slots_per_gpu.tolist() != cluster.slots_per_gpu.tolist():
        raise EplbError(
            f"the current placement has slots per GPU {current.slots_per_gpu.tolist()}, the request asks "
            f"for {cluster.slots_per_gpu.tolist()}: moves are counted between placements of one cluster shape"
        )


DEFAULT_MILP_LAYER_LIMIT_S = 5.0


def _solve_milp(
    loads: NDArray[np.float64],
    cluster: Cluster,
    current: Placement | None,
    time_limit_s: float | None,
    request_time_limit_s: float | None,
    split: str,
    max_lb_slack: float,
) -> tuple[NDArray[np.int64], NDArray[np.float64] | None, dict[str, Any]]:
    """The exact solver, warm-started from greedy (so never worse than it)."""
    from solvers.milp import solve_milp

    if split not in ("uniform", "weighted"):
        raise EplbError(f"split must be 'uniform' or 'weighted', got {split!r}")
    warm = solve_greedy(
        loads, cluster.slots_per_gpu, num_groups=cluster.num_groups, gpus_per_node=cluster.gpus_per_node
    )
    per_layer = time_limit_s or (request_time_limit_s or DEFAULT_MILP_LAYER_LIMIT_S)
    try:
        result = solve_milp(
            loads,
            cluster.slots_per_gpu,
            time_limit_s=per_layer,
            total_time_limit_s=request_time_limit_s,
            split="weighted" if split == "weighted" else "uniform",
            current_phy2log=None if current is None else current.phy2log,
            max_lb_slack=max_lb_slack,
            warm_start=warm,
        )
    except ValueError as exc:
        raise EplbError(str(exc)) from None
    statuses = list(result.status)
    overall = next(
        (s for s in ("greedy_fallback", "time_limit", "feasible") if s in statuses), "optimal"
    )
    info: dict[str, Any] = {
        "name": "milp" if split == "uniform" else "milp-weighted",
        "status": overall,
        "layer_status": statuses,
        "layer_ms": _round(result.wall_ms, 3),
        "time_limit_s_per_layer": per_layer,
        "bound_tokens": result.bound.tolist(),
    }
    if cluster.num_groups is not None and cluster.gpus_per_node is not None:
        info["note"] = "the MILP places experts globally; the hierarchical (node) policy shaped only its warm start"
    return result.phy2log, result.shares, info


def evaluate(loads: NDArray[np.float64], placement: Placement, cost: CostSetup | None = None) -> Outcome:
    """Judge a placement on loads [layers, E]: balance and predicted time, next to the baseline."""
    if loads.shape[0] != placement.num_layers or loads.shape[1] != placement.num_experts:
        raise EplbError(
            f"the placement is for {placement.num_layers} layers x {placement.num_experts} experts, "
            f"the loads are {loads.shape[0]} x {loads.shape[1]}"
        )
    base = contiguous_placement(placement.num_layers, placement.num_experts, placement.num_gpus)
    outcome = Outcome(placement, balance(loads, placement), balance(loads, base))
    if cost is not None:
        outcome.prediction = _predict(loads, placement, cost)
        outcome.baseline_prediction = _predict(loads, base, cost)
    return outcome


def _predict(loads: NDArray[np.float64], placement: Placement, cost: CostSetup) -> LayerPrediction:
    return predict(
        loads,
        placement.phy2log,
        placement.slots_per_gpu,
        cost.model,
        cost.hardware,
        cost.link_bw,
        tokens_per_gpu=cost.tokens_per_gpu,
        shares=placement.shares,
        overlap=cost.overlap,
    )
