"""The answer shapes, defined once: `eplb solve|evaluate --json` prints them and `POST /placement|/evaluate`
returns them (the pydantic models are also the OpenAPI schema). `Outcome.to_model()` in eplb/solve.py builds
them. Times are in microseconds, loads in tokens. Also `ClusterRules`, a cluster shape's fields with their
bounds and checks, once for a request (`api.schemas.ClusterIn`) and a deployment's config
(`eplb.deployments.ClusterShape`), and `Numbers`, the one validator of every numeric array a request or a config
holds."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema, core_schema

from eplb.errors import clip
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


ARRAY_ERROR = "eplb_array"
"""The pydantic error type of a numeric array `Numbers` refused: one error for the array, its input the array; its
context's `check` says which element is wrong (`_ArrayCheck.explain`: '[0][3] is null: loads are ...', 'must be
[layers][experts]; got one row of ...'), the message to follow the field's dotted path (`api.problems.field_errors`
writes 'loads[0][3] is null: ...'); its own message is the array's rule."""
_LIST_KEYS = frozenset({"type", "items_schema", "min_length", "max_length", "strict", "metadata"})
_LEAF_KEYS = frozenset({"type", "ge", "gt", "le", "lt", "allow_inf_nan", "strict", "metadata"})


class Numbers:
    """A numeric array field, refused in one error naming its first bad element: `Annotated[list[list[float]],
    Numbers("loads", ...)]`, where pydantic answered a body of 400,000 nulls with 400,000 errors (28 MB, 11 s,
    0.8 GB). The array's type stays the one declaration (its nesting, lengths, element type and bounds; the OpenAPI
    schema), validated by pydantic itself, as fast as before: every level stops at its first bad element
    (`fail_fast`) and the array's one error (`ARRAY_ERROR`) replaces that element's. Only then, on the refused
    value, `_ArrayCheck.explain` finds the element in Python and says where it is, what it is and what the array
    holds: `[0][3] is null: loads are [layers][experts] numbers of tokens (...)`. Time proportional to the array,
    no memory beyond the value's.

    noun: what the elements are ('expert ids'); shape: the dimensions ('[layers][slots]', none for a flat list);
    unit: after 'numbers' ('of tokens'); note: a last word, in parentheses."""

    def __init__(self, noun: str, shape: str = "", unit: str = "", note: str = "") -> None:
        self.noun, self.shape, self.unit, self.note = noun, shape, unit, note

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        schema = handler(source)
        check = _ArrayCheck(schema, self)
        return core_schema.custom_error_schema(_fail_fast(schema), ARRAY_ERROR, custom_error_message=check.rule,
                                               custom_error_context={"check": check})


def _fail_fast(schema: Any) -> Any:
    """The array's schema with every list level stopping at its first bad element (one error, not one each)."""
    if schema["type"] != "list":
        return schema
    return {**schema, "fail_fast": True, "items_schema": _fail_fast(schema["items_schema"])}


class _ArrayCheck:
    """What a `Numbers` array holds, read from its core schema: one (min_length, max_length) per level, the element
    type and its bounds (checked strictly, as the request models take them: integers for an int, integers or floats
    for a float, never a bool or a string); `explain` finds the first element that breaks them."""

    def __init__(self, schema: CoreSchema, spec: Numbers) -> None:
        levels: list[tuple[int | None, int | None]] = []
        leaf: Any = schema
        while leaf["type"] == "list" and set(leaf) <= _LIST_KEYS:
            levels.append((leaf.get("min_length"), leaf.get("max_length")))
            leaf = leaf["items_schema"]
        if not levels or leaf["type"] not in ("int", "float") or not set(leaf) <= _LEAF_KEYS:
            raise TypeError(f"Numbers takes lists of ints or floats (with bounds and lengths), not {schema}")
        self.levels = levels
        self.integer = leaf["type"] == "int"
        self.types: frozenset[type] = frozenset({int} if self.integer else {int, float})
        self.ge, self.gt, self.le, self.lt = (leaf.get(k) for k in ("ge", "gt", "le", "lt"))
        self.bounded = any(b is not None for b in (self.ge, self.gt, self.le, self.lt))
        self.finite = not leaf.get("allow_inf_nan", True)  # NaN also fails any bound, as pydantic has it
        self.shape = spec.shape
        words = [spec.noun, "are", spec.shape, "whole numbers" if self.integer else "numbers", spec.unit,
                 _bounds_text(self.ge, self.gt, self.le, self.lt)]
        self.rule = " ".join(w for w in words if w) + (f" ({spec.note})" if spec.note else "")

    def __repr__(self) -> str:
        return f"Numbers({self.rule!r})"

    def explain(self, value: Any) -> str | None:
        """Why pydantic refused `value`, from the array down: '[0][3] is null: <rule>', 'must be [layers][experts];
        got one row of 256 numbers (...)', 'has 5,000 values: at most 4,096'; None for a value that is no list
        (pydantic's own words: a union's other member may take it) or where nothing is found."""
        if type(value) is not list:
            return None
        if len(self.levels) > 1 and value and all(type(v) in (int, float) for v in value):
            what = self.shape.partition("]")[0].lstrip("[").removesuffix("s")
            wrap = f" (wrap a single {what} in another list)" if len(self.levels) == 2 and what else ""
            return f"must be {self.shape}; got one row of {_plural(len(value), 'number')}{wrap}"
        return self._level(value, 0, "")

    def _level(self, value: list[Any], depth: int, at: str) -> str | None:
        least, most = self.levels[depth]
        if least is not None and len(value) < least:
            return (f"{at} is empty: at least {_plural(least, 'value')}" if not value else
                    f"{at} has {_plural(len(value), 'value')}: at least {least:,}").lstrip()
        if most is not None and len(value) > most:
            return f"{at} has {_plural(len(value), 'value')}: at most {most:,}".lstrip()
        last = depth == len(self.levels) - 1
        if last and set(map(type, value)) <= self.types and self._in_bounds(value):
            return None  # a row whole in C; only a row that fails is walked
        for i, item in enumerate(value):
            if last:
                if not self._ok(item):
                    return f"{at}[{i}] is {_found(item)}: {self.rule}"
            elif type(item) is not list:
                return f"{at}[{i}] is {_found(item)}, not an array: {self.rule}"
            else:
                why = self._level(item, depth + 1, f"{at}[{i}]")
                if why is not None:
                    return why
        return None

    def _in_bounds(self, row: list[Any]) -> bool:
        if not row or (not self.bounded and not self.finite):
            return True
        try:
            if not self.integer and (any(map(math.isnan, row)) or (self.finite and not all(map(math.isfinite, row)))):
                return False
        except OverflowError:  # an integer beyond float range among floats: walked
            return False
        low, high = min(row), max(row)
        return ((self.ge is None or low >= self.ge) and (self.gt is None or low > self.gt)
                and (self.le is None or high <= self.le) and (self.lt is None or high < self.lt))

    def _ok(self, v: Any) -> bool:
        if type(v) not in self.types:
            return False
        if type(v) is float and (math.isnan(v) or (self.finite and math.isinf(v))):
            return not self.bounded and not self.finite
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun if n == 1 else noun + 's'}"


def _bound(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e7 else f"{float(v):g}"


def _bounds_text(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    """' from -1 to 65,535', 'above 0 and at most 1e+15': a `Numbers` element's bounds for its rule."""
    if ge is not None and le is not None:
        return f"from {_bound(ge)} to {_bound(le)}"
    parts = [f"{word} {_bound(v)}" for word, v in (("at least", ge), ("above", gt), ("at most", le), ("below", lt))
             if v is not None]
    return " and ".join(parts)


def _found(v: Any) -> str:
    """What an element is, as the JSON had it: null, true, "1e3", an object, an array, 1.5."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(clip(v), ensure_ascii=False)
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, int | float):
        try:
            return clip(repr(v))
        except ValueError:  # an integer of more digits than str() writes
            return "an integer of thousands of digits"
    return f"a {type(v).__name__}"


GpuSlots = Annotated[int, Field(ge=1, le=SERVICE_MAX_GPUS)]
"""Expert slots on one GPU: every GPU holds at least one expert (`solvers.registry.check`)."""
BudgetBytes = Annotated[float, Field(gt=0, le=MAX_BUDGET_BYTES)]
"""Bytes of expert weights one GPU may hold: a budget of none fits no expert."""
PerGpu = Field(min_length=1, max_length=SERVICE_MAX_GPUS)  # a per-GPU list: one value, or one per GPU
SlotsPerGpu = Annotated[list[GpuSlots], PerGpu, Numbers("slot counts")]
BudgetsPerGpu = Annotated[list[BudgetBytes], PerGpu, Numbers("budgets", unit="of bytes")]


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
    slots_per_gpu: GpuSlots | SlotsPerGpu | None = Field(
        None, description="expert slots (1 to 4,096): one count, or one per GPU (num_gpus of them)"
    )
    num_redundant: int | None = Field(None, ge=0, le=1_000_000, description="redundant experts in all")
    memory_budget_bytes: BudgetBytes | BudgetsPerGpu | None = Field(
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
