"""Request and response bodies of the placement service (pydantic models = the OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

EXAMPLE_LOADS: list[Any] = [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]
EXAMPLE_PHY2LOG: list[Any] = [[0, 1, 2, 3, 4, 5, 6, 7]] * 2


class ModelSpecIn(BaseModel):
    """A model spec (see docs/cost-model.md); every field is required."""

    model_config = ConfigDict(extra="forbid")
    name: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    hidden_size: int
    moe_intermediate_size: int
    expert_bytes_per_param: float
    shared_bytes_per_param: float
    dispatch_bytes_per_copy: float
    combine_bytes_per_copy: float


class HardwareSpecIn(BaseModel):
    """A GPU spec: FLOP/s, bytes and bytes per second."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dense_flops: float
    hbm_bandwidth: float
    hbm_capacity: float
    nvlink_bandwidth: float
    nic_bandwidth: float


class ClusterIn(BaseModel):
    """The EP group. Give at most one of slots_per_gpu, num_redundant, memory_budget_bytes
    (none: one redundant expert per GPU)."""

    model_config = ConfigDict(extra="forbid")
    num_gpus: int = Field(ge=1, le=4096, description="GPUs in the expert-parallel group")
    gpus_per_node: int | None = Field(None, ge=1, le=4096, description="GPUs per node (hierarchical policy)")
    num_groups: int | None = Field(None, ge=1, le=4096, description="expert groups (hierarchical policy)")
    slots_per_gpu: int | list[int] | None = Field(None, description="expert slots: one count or one per GPU")
    num_redundant: int | None = Field(None, ge=0, le=1_000_000, description="redundant experts in all")
    memory_budget_bytes: float | list[float] | None = Field(
        None, description="bytes of expert weights each GPU may hold: one number or one per GPU"
    )

    @model_validator(mode="after")
    def _one_budget(self) -> ClusterIn:
        given = [n for n in ("slots_per_gpu", "num_redundant", "memory_budget_bytes") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give only one of slots_per_gpu, num_redundant, memory_budget_bytes (got {given})")
        return self


class PlacementIn(BaseModel):
    """A placement as `POST /placement` returns it (docs/formats.md)."""

    model_config = ConfigDict(extra="allow")
    phy2log: list[list[int]]
    slots_per_gpu: list[int]
    num_experts: int | None = None
    shares: list[list[float]] | None = None


class CostIn(BaseModel):
    """What the time prediction needs."""

    model: str | ModelSpecIn = Field(
        "deepseek-v3", description="model preset name (GET /presets) or a full spec object"
    )
    hardware: str | HardwareSpecIn = Field("b200", description="GPU preset name or a full spec object")
    link: str = Field("nvlink", description="all-to-all link: nvlink, nic, or GB/s per GPU per direction")
    tokens_per_gpu: float | None = Field(
        None, gt=0, description="tokens per GPU in one step; absent: the window is taken as one step"
    )
    overlap: bool = Field(True, description="comm overlaps the GEMMs (two micro-batches)")


class PlacementRequest(CostIn):
    """Where should the experts go next, given the load the cluster saw over a window?"""

    model_config = ConfigDict(
        populate_by_name=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "mixtral-8x7b",
                    "hardware": "h100",
                    "cluster": {"num_gpus": 4, "num_redundant": 4},
                    "loads": EXAMPLE_LOADS,
                    "tokens_per_gpu": 256,
                    "solver": "greedy",
                }
            ]
        },
    )
    cluster: ClusterIn
    loads: list[list[float]] = Field(description="[layers][E] tokens routed to each expert over the window")
    solver: Literal["greedy", "milp"] = "greedy"
    time_limit_s: float | None = Field(
        None, gt=0, le=3600, description="MILP: time budget for the whole request, seconds"
    )
    split: Literal["uniform", "weighted"] = Field(
        "uniform", description="weighted: replicas serve unequal shares (MILP only; needs weighted routing)"
    )
    current_placement: PlacementIn | None = Field(None, description="the placement now serving: moves are counted")
    max_lb_slack: float = Field(0.01, ge=0, le=1, description="migration-aware MILP: allowed lb above the best")
    run_async: bool = Field(False, alias="async", description="answer 202 with a job to poll")


class EvaluateRequest(CostIn):
    """How good is this placement on this window?"""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "mixtral-8x7b",
                    "hardware": "h100",
                    "placement": {"phy2log": EXAMPLE_PHY2LOG, "slots_per_gpu": [2, 2, 2, 2]},
                    "loads": EXAMPLE_LOADS,
                }
            ]
        }
    )
    placement: PlacementIn
    loads: list[list[float]] = Field(description="[layers][E] tokens routed to each expert over the window")


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description="field-level errors: {field, message}")


class PlacementOut(BaseModel):
    """A placement file's object (docs/formats.md)."""

    format: str = Field(description="eplb.placement/v1")
    num_experts: int
    num_gpus: int
    slots_per_gpu: list[int] = Field(description="[G] slots on each GPU")
    phy2log: list[list[int]] = Field(description="[layers][sum(slots)] logical expert per slot, GPU by GPU")
    replicas: list[list[int]] = Field(description="[layers][E] replicas per expert")
    shares: list[list[float]] | None = Field(None, description="[layers][slots] token shares (weighted only)")


class Balance(BaseModel):
    """Per-layer balance, and the predicted per-layer time when a model is known. Times in microseconds."""

    lb: list[float] = Field(description="max GPU load / mean GPU load, per layer (1.0 is perfect)")
    balancedness: list[float] = Field(description="mean / max per layer (vLLM's and SGLang's number)")
    imbalance: list[float] = Field(description="(max - mean) / mean per layer (TensorRT-LLM's number)")
    lb_mean: float
    lb_max: float
    time_us: list[float] | None = Field(None, description="predicted layer time: the slowest GPU")
    compute_us: list[float] | None = None
    weight_read_us: list[float] | None = None
    comm_us: list[float] | None = None
    bottleneck: list[str] | None = Field(None, description="compute, weight_read or comm, per layer")
    total_time_us: float | None = Field(None, description="sum over layers: MoE time of one step")
    tokens_per_gpu: list[float] | None = None


class Predicted(Balance):
    """The placement's numbers, with the no-EPLB baseline (contiguous, no redundancy) beside them."""

    baseline: Balance


class SolverOut(BaseModel):
    """What the solver did. bound is a lower bound on lb per layer; gap = (lb - bound) / lb."""

    model_config = ConfigDict(extra="allow")
    name: str
    status: str = Field(description="heuristic (greedy), or optimal / feasible / time_limit / greedy_fallback")
    wall_ms: float
    bound: list[float]
    gap: list[float]
    layer_ms: list[float] | None = None
    layer_status: list[str] | None = None
    time_limit_s_per_layer: float | None = None


class Moves(BaseModel):
    """Expert weights copied onto GPUs to go from the current placement to this one."""

    per_layer: list[int]
    total: int
    bytes_moved: float | None


class PlacementResponse(BaseModel):
    """The placement, its predicted balance and time next to the no-EPLB baseline, and solver facts."""

    placement: PlacementOut
    predicted: Predicted
    solver: SolverOut | None = None
    moves: Moves | None = None


JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]


class Job(BaseModel):
    """A long solve run in the background."""

    id: str
    status: JobStatus
    created_at: float
    finished_at: float | None = None
    result: PlacementResponse | None = Field(None, description="when done: the body POST /placement answers")
    error: Problem | None = None
