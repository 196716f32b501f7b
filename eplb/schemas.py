"""The answer shapes, defined once: `eplb solve|evaluate --json` prints them and `POST /placement|/evaluate`
returns them (the pydantic models are also the OpenAPI schema). `Outcome.to_model()` in eplb/solve.py builds
them. Times are in microseconds, loads in tokens. Also `ClusterRules`, a cluster shape's fields with their
bounds and checks, once for a request (`api.schemas.ClusterIn`) and a deployment's config
(`eplb.deployments.ClusterShape`)."""

from __future__ import annotations

from typing import Annotated, Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from eplb.rules import MAX_BUDGET_BYTES, SERVICE_MAX_GPUS, groups_need_nodes, one_budget, one_per_gpu

T = TypeVar("T")


class PlacementOut(BaseModel):
    """A placement file's object (docs/formats.md)."""

    format: str = Field(description="eplb.placement/v1")
    num_experts: int
    num_gpus: int
    slots_per_gpu: list[int] = Field(description="[G] slots on each GPU")
    phy2log: list[list[int]] = Field(description="[layers][sum(slots)] logical expert per slot, GPU by GPU")
    replicas: list[list[int]] = Field(description="[layers][E] replicas per expert")
    shares: list[list[float]] | None = Field(None, description="[layers][slots] token shares (weighted only)")


class CopiesPerToken(BaseModel):
    """Expected all-to-all copies of one token per layer, from the window's co-activation summary: distinct
    GPUs (nodes) its top-k reaches, and those other than its own (the copies that cross a link)."""

    gpus: list[float]
    remote_gpus: list[float]
    nodes: list[float]
    remote_nodes: list[float]


class Balance(BaseModel):
    """Per-layer balance, and the predicted per-layer time when a model is known. Times in microseconds."""

    lb: list[float | None] = Field(description="max GPU load / mean GPU load, per layer (1.0 is perfect); null for "
                                   "a layer without tokens (no lb)")
    balancedness: list[float | None] = Field(description="mean / max per layer (vLLM's and SGLang's number)")
    imbalance: list[float | None] = Field(description="(max - mean) / mean per layer (TensorRT-LLM's number)")
    lb_mean: float | None = Field(None, description="over the layers with tokens (absent: no layer has any)")
    lb_max: float | None = Field(None, description="over the layers with tokens (absent: no layer has any)")
    time_us: list[float] | None = Field(None, description="predicted layer time: the slowest GPU")
    compute_us: list[float] | None = None
    weight_read_us: list[float] | None = None
    comm_us: list[float] | None = None
    bottleneck: list[str] | None = Field(None, description="compute, weight_read or comm, per layer (the slowest "
                                         "GPU's largest term); idle for a layer without tokens")
    total_time_us: float | None = Field(None, description="sum over layers: MoE time of one step")
    tokens_per_gpu: list[float] | None = None
    copies_per_token: CopiesPerToken | None = Field(
        None, description="with a co-activation summary: expected copies per token, which the comm time uses"
    )


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
    bytes_moved: float | None = Field(None, description="bytes of the copies (absent without a model: no expert "
                                      "size)")


class PlacementResponse(BaseModel):
    """The placement, its predicted balance and time next to the no-EPLB baseline, and solver facts."""

    placement: PlacementOut
    predicted: Predicted
    solver: SolverOut | None = None
    moves: Moves | None = None
    plan: dict[str, Any] | None = Field(
        None, description="migration plan from current_placement: ordered copies in byte-budgeted stages"
    )

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON object (absent fields left out): what `--json` prints and the API answers."""
        return self.model_dump(mode="json", exclude_none=True)


GpuSlots = Annotated[int, Field(ge=1, le=SERVICE_MAX_GPUS)]
"""Expert slots on one GPU: every GPU holds at least one expert (`solvers.registry.check`)."""
BudgetBytes = Annotated[float, Field(gt=0, le=MAX_BUDGET_BYTES)]
"""Bytes of expert weights one GPU may hold: a budget of none fits no expert."""
PerGpu = Field(min_length=1, max_length=SERVICE_MAX_GPUS)  # a per-GPU list: one value, or one per GPU


class ClusterRules(BaseModel):
    """A cluster shape's fields, bounds and rules, declared once for the models that take one (POST /placement's
    `api.schemas.ClusterIn`, a deployment's `eplb.deployments.ClusterShape`): num_gpus; gpus_per_node and
    num_groups (hierarchical policy; num_groups only with gpus_per_node); at most one slot budget, of which
    slots_per_gpu and memory_budget_bytes are one value or one per GPU (`eplb.rules`). On the cluster, so a
    422's errors name its fields. No budget: one redundant expert per GPU (none on one GPU; one slot per GPU
    when there are more GPUs than experts; `eplb.budget.slots_per_gpu`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_gpus: int = Field(ge=1, le=SERVICE_MAX_GPUS, description="GPUs in the expert-parallel group (1 to 4,096)")
    gpus_per_node: int | None = Field(None, ge=1, le=SERVICE_MAX_GPUS, description="GPUs per node: the hierarchical "
                                      "policy (with num_groups), and a '+' link")
    num_groups: int | None = Field(None, ge=1, le=65_536, description="expert groups, each kept within a node "
                                   "(hierarchical policy; needs gpus_per_node)")
    slots_per_gpu: GpuSlots | Annotated[list[GpuSlots], PerGpu] | None = Field(
        None, description="expert slots (1 to 4,096): one count, or one per GPU (num_gpus of them)"
    )
    num_redundant: int | None = Field(None, ge=0, le=1_000_000, description="redundant experts in all")
    memory_budget_bytes: BudgetBytes | Annotated[list[BudgetBytes], PerGpu] | None = Field(
        None, description="bytes of expert weights each GPU may hold (above 0, up to 1e15): one number, or one "
        "per GPU (num_gpus of them)"
    )

    @field_validator("num_groups")
    @classmethod
    def _groups_need_nodes(cls, num_groups: int | None, info: ValidationInfo) -> int | None:
        return groups_need_nodes(num_groups, info.data)  # every solve would ignore groups without nodes

    @field_validator("slots_per_gpu", "memory_budget_bytes")
    @classmethod
    def _one_per_gpu(cls, values: T, info: ValidationInfo) -> T:
        return one_per_gpu(values, info.data)

    @model_validator(mode="after")
    def _one_budget(self) -> Self:
        one_budget(self)
        return self
