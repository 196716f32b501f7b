"""Turning validated request bodies into eplb objects, with errors that name the offending field."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from api.schemas import ClusterIn, CostIn, EvaluateRequest, PlacementIn, PlacementRequest
from eplb.budget import slots_per_gpu
from eplb.errors import EplbError
from eplb.io.windows import check_loads
from eplb.placement import Placement
from eplb.solve import Cluster, CostSetup, evaluate, solve
from eplb.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    hardware_from_dict,
    link_bandwidth,
    model_from_dict,
)
from solvers.registry import Options


class FieldError(EplbError):
    """Bad input in one field of the request body."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _spec(field: str, value: Any, presets: Mapping[str, Any], from_dict: Callable[[dict[str, Any]], Any]) -> Any:
    """A preset by name (never a file path: this is a network service) or a spec object."""
    if isinstance(value, str):
        if value not in presets:
            raise FieldError(field, f"unknown preset {value!r}; known: {', '.join(presets)}")
        return presets[value]
    try:
        return from_dict(value.model_dump())
    except EplbError as exc:
        raise FieldError(field, str(exc)) from None


def _model(value: Any) -> ModelSpec:
    spec: ModelSpec = _spec("model", value, MODEL_PRESETS, model_from_dict)
    return spec


def _hardware(value: Any) -> HardwareSpec:
    spec: HardwareSpec = _spec("hardware", value, HARDWARE_PRESETS, hardware_from_dict)
    return spec


def _loads(value: list[list[float]], model: ModelSpec) -> NDArray[np.float64]:
    try:
        loads = check_loads(value, "loads")
    except EplbError as exc:
        raise FieldError("loads", str(exc).removeprefix("loads")) from None
    if loads.shape[1] != model.num_experts:
        raise FieldError(
            "loads", f"rows have {loads.shape[1]} experts but model {model.name!r} has {model.num_experts}"
        )
    return loads


def cost_setup(req: CostIn) -> tuple[ModelSpec, CostSetup]:
    model = _model(req.model)
    hardware = _hardware(req.hardware)
    try:
        link_bw = link_bandwidth(hardware, req.link)
    except EplbError as exc:
        raise FieldError("link", str(exc)) from None
    return model, CostSetup(model, hardware, link_bw, req.tokens_per_gpu, req.overlap)


def cluster(value: ClusterIn, model: ModelSpec) -> Cluster:
    try:
        slots = slots_per_gpu(
            value.num_gpus,
            model.num_experts,
            slots=value.slots_per_gpu,
            num_redundant=value.num_redundant,
            memory_budget_bytes=value.memory_budget_bytes,
            slot_bytes=model.expert_bytes_all_layers,
        )
    except EplbError as exc:
        raise FieldError("cluster", str(exc)) from None
    return Cluster(slots, value.gpus_per_node, value.num_groups)


def placement(value: PlacementIn, field: str, num_experts: int) -> Placement:
    data = value.model_dump()
    if data.get("num_experts") is None:
        data["num_experts"] = num_experts
    try:
        return Placement.from_dict(data, field)
    except EplbError as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field}: ")) from None


@dataclass(frozen=True)
class SolveJob:
    """Everything a worker needs for one placement request (picklable)."""

    loads: NDArray[np.float64]
    cluster: Cluster
    solver: str
    cost: CostSetup
    current: Placement | None
    time_limit_s: float | None
    split: str
    max_lb_slack: float


def solve_job(req: PlacementRequest, milp_default_time_limit_s: float) -> SolveJob:
    """Validate a placement request into a SolveJob; raises FieldError naming the bad field."""
    model, cost = cost_setup(req)
    loads = _loads(req.loads, model)
    the_cluster = cluster(req.cluster, model)
    current = None
    if req.current_placement is not None:
        current = placement(req.current_placement, "current_placement", model.num_experts)
    if req.split == "weighted" and req.solver != "milp":
        raise FieldError("split", "weighted shares need solver 'milp'")
    limit = req.time_limit_s
    if req.solver == "milp" and limit is None:
        limit = milp_default_time_limit_s
    return SolveJob(loads, the_cluster, req.solver, cost, current, limit, req.split, req.max_lb_slack)


def run_solve_job(job: SolveJob) -> dict[str, Any]:
    """Worker side: solve and return the response body."""
    return solve(
        job.loads,
        job.cluster,
        solver=job.solver,
        cost=job.cost,
        current=job.current,
        options=Options(total_time_limit_s=job.time_limit_s, max_lb_slack=job.max_lb_slack)
        if job.solver == "milp" else None,
        split=job.split,
    ).to_dict()


def run_evaluate(req: EvaluateRequest) -> dict[str, Any]:
    """Validate and evaluate a placement on a window."""
    model, cost = cost_setup(req)
    loads = _loads(req.loads, model)
    given = placement(req.placement, "placement", model.num_experts)
    if given.num_layers != loads.shape[0]:
        raise FieldError("placement", f"has {given.num_layers} layers, the loads have {loads.shape[0]}")
    return evaluate(loads, given, cost).to_dict()
