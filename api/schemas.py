"""Request bodies of the placement service, and its own answers (problems, jobs). Pydantic models are the
OpenAPI schema; the placement answer itself is `eplb.schemas.PlacementResponse`, shared with the CLI.

Every request model forbids unknown fields and takes strict types (no "4" for 4, no true for 1.0), and every
number has bounds, so a typo or an overflow is a 422 naming the field. Every numeric array is checked by
`eplb.schemas.Numbers`: one error naming its first bad element, however many there are."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from eplb.errors import FieldError
from eplb.placement import row_layer_ids
from eplb.rules import SERVICE_MAX_GPUS
from eplb.schemas import ClusterRules, Numbers, PlacementResponse
from eplb.solve import DEFAULT_TOKENS_PER_GPU
from eplb.specs import HardwareSpec, ModelSpec
from solvers.registry import MAX_MOVES, MAX_MOVES_PER_LAYER

EXAMPLE_LOADS: list[Any] = [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]
EXAMPLE_PHY2LOG: list[Any] = [[0, 1, 2, 3, 4, 5, 6, 7]] * 2
STRICT = ConfigDict(extra="forbid", strict=True)

SlotCount = Annotated[int, Field(ge=0, le=SERVICE_MAX_GPUS)]  # a placement's slots on one GPU
ExpertId = Annotated[int, Field(ge=-1, le=65_535)]  # -1: an empty slot (or no partner)
LayerId = Annotated[int, Field(ge=0, le=65_535)]  # a model layer number (DeepSeek-V3's MoE layers are 3..60)
Count = Annotated[int, Field(ge=0, le=10**15)]  # tokens, or picks, of a co-activation summary
Loads = Annotated[
    list[list[float]],
    Field(description="[layers][E] tokens routed to each expert over the window"),
    Numbers("loads", "[layers][experts]", "of tokens", "NaN is not accepted; send 0 for an expert without tokens"),
]
ExpertIds = Numbers("expert ids", "[layers][slots]", note="-1: an empty slot")


class ClusterIn(ClusterRules):
    """The EP group: the fields, bounds and rules of `eplb.schemas.ClusterRules`, as a deployment's cluster. Give
    at most one of slots_per_gpu, num_redundant, memory_budget_bytes (none: one redundant expert per GPU, none on
    one GPU; one slot per GPU when there are more GPUs than experts)."""


class PlacementIn(BaseModel):
    """A placement as `POST /placement` returns it (docs/formats.md); phy2log and slots_per_gpu suffice."""

    model_config = STRICT
    format: str | None = Field(None, max_length=100)
    phy2log: Annotated[list[list[ExpertId]], ExpertIds]
    slots_per_gpu: Annotated[list[SlotCount], Field(max_length=SERVICE_MAX_GPUS), Numbers("slot counts")]
    num_experts: int | None = Field(None, ge=1, le=65_536)
    num_gpus: int | None = Field(None, ge=1, le=SERVICE_MAX_GPUS)
    replicas: Annotated[list[list[int]], Numbers("replica counts", "[layers][experts]")] | None = None
    shares: Annotated[list[list[float]], Numbers("shares", "[layers][slots]")] | None = None
    layer_ids: Annotated[list[LayerId], Numbers("layer ids")] | None = Field(
        None, description="model layer of each phy2log row, in increasing order (`eplb solve --out` writes the "
        "window's); a label: rows are matched by position"
    )

    @field_validator("layer_ids")
    @classmethod
    def _one_layer_id_per_row(cls, ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        """Checked here as the Placement checks them (one per row, increasing), so a 422 names X.layer_ids."""
        if ids is None:
            return ids
        rows = info.data.get("phy2log")
        if rows is not None:
            try:
                row_layer_ids(ids, len(rows), increasing=True)
            except FieldError as exc:
                raise ValueError(exc.message) from None
        return ids


class CoactivationIn(BaseModel):
    """Which experts the window's tokens chose together: per layer and expert its picks and its most frequent
    partners with the tokens that chose both (`eplb.coactivation.summarize`; docs/formats.md). L layers, E
    experts, m partners per expert (8 is plenty)."""

    model_config = STRICT
    format: Literal["eplb.coactivation-summary/v1"] | None = None
    tokens: Annotated[list[Count], Numbers("token counts")] = Field(description="[L] tokens routed in the window")
    top_k: int = Field(ge=1, le=1024, description="experts each token chose")
    loads: Annotated[list[list[Count]], Numbers("picks", "[layers][experts]")] = Field(
        description="[L][E] picks per expert"
    )
    partners: Annotated[list[list[list[ExpertId]]], Numbers("partners", "[layers][experts][partners]",
                                                            note="expert ids; -1: no partner")] = Field(
        description="[L][E][m] each expert's most frequent co-chosen experts, most frequent first, -1 padded"
    )
    counts: Annotated[list[list[list[Count]]], Numbers("token counts", "[layers][experts][partners]")] = Field(
        description="[L][E][m] tokens that chose both the expert and that partner"
    )


CoactivationBinary = Annotated[str, Field(max_length=64 * 2**20, description="base64 (no line breaks) of the "
                                          "summary's .npz image, `CoactivationSummary.to_bytes` (docs/formats.md)")]


class CostIn(BaseModel):
    """What the time prediction needs."""

    model_config = STRICT
    model: str | ModelSpec | None = Field(
        None,
        description="model preset name (GET /presets) or a full spec object; absent: the preset with the "
        "window's expert count (and layer count when several match), or, when none matches, no time prediction",
    )
    hardware: str | HardwareSpec = Field("b200", description="GPU preset name or a full spec object")
    link: str = Field(
        "nvlink", max_length=40, description="all-to-all link: nvlink, nic, pcie, or GB/s per GPU per direction; or "
        "within + between nodes, e.g. nvlink+nic (DeepEP's dispatch across nodes; needs gpus_per_node)"
    )
    tokens_per_gpu: float = Field(
        DEFAULT_TOKENS_PER_GPU, gt=0, le=1e9,
        description="tokens per GPU in one step, for the time prediction (default 4,096, as `eplb solve`)",
    )
    overlap: bool = Field(True, description="comm overlaps the GEMMs (two micro-batches)")
    coactivation: CoactivationIn | CoactivationBinary | None = Field(
        None, description="the window's co-activation summary, as an object or base64 of its .npz image (4x smaller, "
        "8x faster to read): the comm time then counts one copy per GPU a token reaches, and copies per token are "
        "reported (docs/cost-model.md)"
    )
    node_limit: int | None = Field(
        None, ge=1, le=SERVICE_MAX_GPUS, description="node-limited routing: a token's experts lie on at most this many "
        "nodes of cluster.gpus_per_node GPUs (with coactivation)"
    )


class PlacementRequest(CostIn):
    """Where should the experts go next, given the load the cluster saw over a window?"""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
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
    loads: Loads
    solver: str | None = Field(
        None, max_length=40, description="a registered solver (GET /presets lists them); absent: greedy, or "
        "incremental when current_placement is given"
    )
    time_limit_s: float | None = Field(
        None, gt=0, le=3600, description="MILP: time budget for the whole request, seconds"
    )
    max_moves: int | None = Field(
        None, ge=0, le=MAX_MOVES, description="incremental: expert copies allowed in the whole model"
    )
    max_moves_per_layer: int | None = Field(
        None, ge=0, le=MAX_MOVES_PER_LAYER, description="incremental: expert copies allowed per layer"
    )
    target_lb: float | None = Field(
        None, ge=1, le=1000, description="incremental: fewest copies that bring every layer's lb to this"
    )
    stage_gib: float | None = Field(
        None, gt=0, le=1e6, description="migration plan: bytes copied per stage, GiB (default: one stage per layer "
        "with copies)"
    )
    split: Literal["uniform", "weighted"] | None = Field(
        None, description="weighted: replicas serve unequal shares (MILP only; needs weighted routing); default "
        "uniform (milp-weighted: weighted)"
    )
    current_placement: PlacementIn | None = Field(None, description="the placement now serving: moves are counted")
    objective: Literal["lb", "time"] = Field(
        "lb", description="lb: balance tokens; time: per layer the lowest predicted layer time among the solver's "
        "placement, co-located variants (with coactivation) and one slot per expert (docs/solvers.md)"
    )
    max_lb_slack: float = Field(0.01, ge=0, le=1, description="migration-aware MILP: allowed lb above the best")
    run_async: bool = Field(False, alias="async", description="answer 202 with a job to poll")


class EvaluateRequest(CostIn):
    """How good is this placement on this window?"""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "mixtral-8x7b",
                    "hardware": "h100",
                    "placement": {"phy2log": EXAMPLE_PHY2LOG, "slots_per_gpu": [2, 2, 2, 2]},
                    "loads": EXAMPLE_LOADS,
                }
            ]
        },
    )
    placement: PlacementIn
    loads: Loads
    gpus_per_node: int | None = Field(None, ge=1, le=SERVICE_MAX_GPUS, description="GPUs per node, for copies per node")


class WindowIn(BaseModel):
    """A load window for a registered deployment: what `POST /placement` takes minus what the deployment fixes."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"loads": [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]}]})
    loads: Loads
    force: bool = Field(False, description="rebalance whatever the trigger says")
    coactivation: CoactivationIn | CoactivationBinary | None = Field(None, description="the window's co-activation "
                                                "summary (object or base64 of its .npz image, as POST "
                                                "/placement takes it): kept in the history, used by the predictions "
                                                "and the time objective")
    current_placement: PlacementIn | None = Field(None, description="the placement the cluster serves now (as "
                                                  "POST /deployments/{name}/placement takes it): recorded as "
                                                  "serving first when the deployment holds another, so the window is "
                                                  "judged against what serves; every EP rank of an engine may send "
                                                  "the same window with it and gets the same answer")


class AppliedIn(BaseModel):
    """The placement the cluster now serves (a plan applied, refused or delayed)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    placement: PlacementIn


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description="field-level errors: {field, message}")


JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]


class Job(BaseModel):
    """A long solve run in the background."""

    id: str
    status: JobStatus = Field(description="queued: waiting for a solver worker; running: a worker has it")
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    result: PlacementResponse | None = Field(None, description="when done: the body POST /placement answers")
    error: Problem | None = None


class JobList(BaseModel):
    """The newest jobs kept now (`?limit`), newest first, without their results (GET /jobs/{id} has them)."""

    jobs: list[Job]
    kept: int = Field(description="jobs kept now, listed or not (finished ones for EPLB_JOB_TTL_S)")
    active: int = Field(description="queued and running jobs (these count against EPLB_MAX_JOBS)")
    max_jobs: int
