"""Deployments: named serving clusters the service remembers, with their current placement and history.

A deployment fixes the model, hardware, cluster shape, slot budget, solver and rebalance policy once
(`DeploymentConfig`). Each load window it sends ([layers, E] tokens) is judged against the placement now
serving; the policy's trigger decides whether to rebalance; a rebalance is solved from the serving placement
(the incremental solver when it is registered) and stored with its prediction, moves and plan. What the
cluster actually applied is recorded separately (`record_applied`): a serving system may refuse or delay a plan.

Every write to one deployment happens in one transaction that holds the deployment's lock (`Store.write`
plus `Store.lock_deployment`), so two replicas given concurrent windows process them one after the other.
The solve runs inside that transaction (a greedy solve takes well under a second; a long MILP holds the lock
for its time budget). Under the same lock a window that repeats the last one processed (`window_key`: the same
loads, current placement, force and co-activation summary, the deployment unchanged since) is answered that
window's stored answer and changes nothing: an engine's EP ranks each send the one window of a rebalance, and
all get one answer."""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import delete, func, select

from eplb import trigger
from eplb.budget import cluster_slots, describe_slots
from eplb.cost.migration import MAX_FIXED_STALL_S, MigrationSpec
from eplb.errors import EplbError, FieldError, shown
from eplb.io.files import plural
from eplb.io.windows import check_loads
from eplb.placement import Placement
from eplb.rules import (
    CLUSTER_FIELDS,
    DEPLOYMENT_NAME,
    DEPLOYMENT_NAME_RULE,
    HISTORY_PAGE_MAX,
    NAME_SHOWN,
    SERVICE_MAX_GPUS,
    is_deployment_name,
    name_refusal,
    work_fields,
    work_refusal,
)
from eplb.schemas import ClusterRules, PlacementOut, PlacementResponse
from eplb.solve import (
    DEFAULT_TOKENS_PER_GPU,
    Cluster,
    CostSetup,
    Outcome,
    check_cluster_fields,
    check_coactivation,
    check_links,
    check_uniform_shares,
    evaluate,
    groups_refusal,
    link_fields,
    solve,
    window_refusal,
)
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec, all_to_all_links, service_preset
from eplb.store import DeploymentRow, HistoryRow, Store
from eplb.store.arrays import pack, unpack
from solvers import registry
from solvers.migration import count_moves
from solvers.registry import Options, applicable

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary
    from solvers.plan import MigrationPlan

NAME = DEPLOYMENT_NAME  # eplb.rules: light, the plug-ins read it too (NAME_SHOWN too, re-exported)
STRICT = ConfigDict(extra="forbid", strict=True)
Action = Literal["placed", "rebalanced", "kept", "applied"]
POLICY_FIELDS = {"max_moves": "policy.max_moves", "target_lb": "policy.target_lb",
                 "total_time_limit_s": "time_limit_s"}
"""The config's field of each solver option a deployment sets."""
FIELD_NAMES = {**POLICY_FIELDS, **CLUSTER_FIELDS}
"""What the registry's messages call options and cluster settings in a deployment's config (its JSON fields)."""


class NotFound(EplbError):
    """No deployment of that name (or no such history entry)."""


PLACEMENT_DROPPED = ("the serving placement no longer fits the new config (experts or slots per GPU changed) and "
                     "was dropped: the next window places afresh")
"""`DeploymentUpdate.placement_dropped` of a PUT that dropped the serving placement."""


# ----- configuration -------------------------------------------------------------------------------------------
class ClusterShape(ClusterRules):
    """A deployment's EP group and its slot budget: the fields, bounds and rules of `eplb.schemas.ClusterRules`,
    as POST /placement's cluster (at most one of slots_per_gpu, num_redundant, memory_budget_bytes; none: one
    redundant expert per GPU, one slot per GPU when there are more GPUs than experts, written out at PUT)."""


class Policy(BaseModel):
    """When to rebalance and how far.

    trigger: periodic (every `every` windows), threshold (the serving placement's predicted lb on the window,
    mean over the layers with tokens, above `threshold`) or cost (the predicted time saved over the next window, `steps`
    steps, exceeds the migration charge: `eplb.cost.migration`; with the incremental solver and no budget of
    its own, the move budgets, no budget and fresh greedy are judged and `eplb.trigger.choose_candidate`
    picks, as in replay; migration: the copies overlap serving or block it, as replay's --migration;
    migration_stall_s adds to every charge); max_moves / target_lb: the incremental solver's budget; windows:
    solve on the sum of the last N windows."""

    model_config = STRICT
    trigger: Literal["periodic", "threshold", "cost"] = "threshold"
    every: int = Field(1, ge=1, le=1_000_000, description="periodic: windows between rebalances")
    threshold: float = Field(1.10, ge=1.0, le=1000.0, description="threshold: rebalance above this lb")
    steps: int = Field(1000, ge=1, le=10**9, description="cost: forward steps the next window lasts")
    migration_stall_s: float = Field(0.0, ge=0.0, le=MAX_FIXED_STALL_S, description="cost: seconds serving stops at "
                                     "every rebalance that copies anything, besides the copies (host-side planning, "
                                     "synchronizing the ranks)")
    migration: Literal["overlap", "blocking"] = Field("overlap", description="cost: how the copies are charged, as "
                                                      "`eplb replay --migration`: overlap: they run while serving, "
                                                      "taking a quarter of the link (vLLM's way); blocking: serving "
                                                      "stops while they cross the link")
    max_moves: int | None = Field(None, ge=0, le=10**9, description="expert copies allowed per rebalance: at least "
                                  "1 at PUT (`check_policy`); a config stored with 0 keeps its serving placement")
    target_lb: float | None = Field(None, ge=1.0, le=1000.0, description="stop moving once every layer reaches it")
    windows: int = Field(1, ge=1, le=1000, description="solve on the sum of the last N windows")


class DeploymentConfig(BaseModel):
    """What `PUT /deployments/{name}` registers. model and hardware are preset names (GET /presets; case-insensitive,
    stored as the presets' own: `stored_config`)."""

    model_config = ConfigDict(
        extra="forbid", strict=True,
        json_schema_extra={"examples": [{
            "model": "mixtral-8x7b", "hardware": "h100", "cluster": {"num_gpus": 4, "num_redundant": 4},
            "tokens_per_gpu": 256, "policy": {"trigger": "threshold", "threshold": 1.05},
        }]},
    )
    model: str = Field(min_length=1, max_length=200)
    hardware: str = Field("b200", min_length=1, max_length=200)
    link: str = Field("nvlink", max_length=40, description="all-to-all link: nvlink, nic, pcie, or GB/s; or within + "
                      "between nodes, e.g. nvlink+nic (DeepEP across nodes; needs cluster.gpus_per_node)")
    tokens_per_gpu: float = Field(DEFAULT_TOKENS_PER_GPU, gt=0, le=1e9, description="tokens per GPU in one step, "
                                  "for the predicted times and the cost trigger (default 4,096, as POST /placement "
                                  "and `eplb solve`): a window sums many steps, each priced at this size")
    overlap: bool = True
    objective: Literal["lb", "time"] = Field("lb", description="lb: balance tokens; time: lowest predicted layer "
                                             "time (docs/solvers.md, 'Objectives')")
    node_limit: int | None = Field(None, ge=1, le=SERVICE_MAX_GPUS, description="node-limited routing: nodes a token's "
                                   "experts may lie on (with windows' co-activation summaries)")
    cluster: ClusterShape
    solver: str | None = Field(None, max_length=40, description="absent: incremental when registered and a "
                               "placement serves, else greedy (the first placement)")
    time_limit_s: float | None = Field(None, gt=0, le=3600, description="MILP: budget per solve, seconds")
    policy: Policy = Field(default_factory=Policy)

    @field_validator("tokens_per_gpu", mode="before")
    @classmethod
    def _default_tokens(cls, value: object) -> object:
        """null is the default: a config stored before there was one (null then priced the whole window as one
        step) reads with it."""
        return DEFAULT_TOKENS_PER_GPU if value is None else value


def config_model(config: DeploymentConfig) -> ModelSpec:
    """The model preset a config names (`eplb.specs.service_preset`: case-insensitive, as `eplb solve --model`
    and POST /placement take it); a FieldError naming `model` when it names none."""
    return service_preset(config.model, MODEL_PRESETS, "model")


def config_slots(config: DeploymentConfig) -> NDArray[np.int64]:
    """Slots per GPU [G] of a config's cluster (`eplb.budget.cluster_slots`: a FieldError naming the cluster's
    budget field; the model must be a preset)."""
    model = config_model(config)
    return cluster_slots(config.cluster, model.num_experts, model.expert_bytes_all_layers)


def explicit_slots(config: DeploymentConfig) -> DeploymentConfig:
    """`config` with its default slot budget written out (num_redundant), so the stored deployment keeps its
    shape should the default ever change."""
    shape = config.cluster
    if any(v is not None for v in (shape.slots_per_gpu, shape.num_redundant, shape.memory_budget_bytes)):
        return config
    redundant = int(config_slots(config).sum()) - config_model(config).num_experts
    return config.model_copy(update={"cluster": shape.model_copy(update={"num_redundant": redundant})})


def stored_config(config: DeploymentConfig) -> DeploymentConfig:
    """`config` as a deployment stores it: its model and hardware as the presets' own names ('DeepSeek-V3' is
    stored as 'deepseek-v3', so every later read finds the preset), its default slot budget written out
    (`explicit_slots`)."""
    names = {"model": config_model(config).name,
             "hardware": service_preset(config.hardware, HARDWARE_PRESETS, "hardware").name}
    return explicit_slots(config.model_copy(update=names))


class Setup:
    """A config resolved into what solving needs: model spec, cost setup, cluster. A cluster shape, link or
    solver option every window would refuse is refused here, naming its field."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.model: ModelSpec = config_model(config)
        hardware: HardwareSpec = service_preset(config.hardware, HARDWARE_PRESETS, "hardware")
        try:
            within, between = all_to_all_links(hardware, config.link)
        except EplbError as exc:
            raise FieldError("link", str(exc)) from None
        self.cost = CostSetup(self.model, hardware, within, config.tokens_per_gpu, config.overlap,
                              config.node_limit, between)
        self.migration = MigrationSpec(within, overlap=config.policy.migration == "overlap",
                                       hbm_bw=hardware.hbm_bandwidth, inter_node_bw=between,
                                       gpus_per_node=config.cluster.gpus_per_node,
                                       fixed_stall_s=config.policy.migration_stall_s)  # fmt: skip
        shape = config.cluster
        self.cluster = Cluster(config_slots(config), shape.gpus_per_node, shape.num_groups)
        check_cluster_fields(self.model.num_experts, self.cluster)  # the checks every window's solve runs
        too_large = work_refusal(1, int(self.cluster.slots_per_gpu.sum()), self.cluster.num_gpus)
        if too_large is not None:  # even a window of one layer would be refused (`loads`)
            raise FieldError(work_fields(shape, None), too_large)
        try:  # a '+' link or a node limit needs nodes: refused here, by name, not at the first window
            check_links(self.cost, self.cluster)
        except EplbError as exc:
            raise FieldError(link_fields(self.cost, self.cluster, "cluster.gpus_per_node"), str(exc)) from None
        try:
            if config.solver is not None:
                registry.get_solver(config.solver)  # unknown names fail here, naming the choices
                check_uniform_shares(config.solver, config.objective, names=FIELD_NAMES)  # as every solve would
            for has_current in (False, True):  # the first window, then every rebalance (from the serving one)
                refused = groups_refusal(
                    self.solver_name(has_current), self.cluster, self.model.num_experts,
                    self.options(has_current), names=FIELD_NAMES, named=self.config.solver is not None,
                    current_phy2log=np.zeros((1, int(self.cluster.slots_per_gpu.sum())), dtype=np.int64)
                    if has_current else None,
                    when="every rebalance starts from the serving placement, and " if has_current else "")
                if refused is not None:  # a SolverError: FieldError('solver', ...) below
                    raise refused
        except registry.SolverError as exc:
            raise FieldError("solver", str(exc), str(exc)) from None

    def solver_name(self, has_current: bool) -> str:
        if self.config.solver is not None:
            return self.config.solver
        return "incremental" if has_current and "incremental" in registry.names() else "greedy"

    def options(self, has_current: bool) -> Options:
        """The solver's options from the policy; a set option the solver does not take is refused."""
        name = self.solver_name(has_current)
        takes = registry.get_solver(name).options
        wanted: dict[str, Any] = {}
        if has_current:
            wanted = {"max_moves": self.config.policy.max_moves, "target_lb": self.config.policy.target_lb}
        if self.config.time_limit_s is not None:
            wanted["total_time_limit_s"] = self.config.time_limit_s
        wanted = {k: v for k, v in wanted.items() if v is not None}
        refused = sorted(k for k in wanted if k not in takes)
        if refused:
            able = [n for n in registry.names() if set(refused) <= registry.get_solver(n).options]
            fields = ["solver", *(POLICY_FIELDS.get(k, k) for k in refused)]  # the config's names, as in errors
            message = (f"solver {name!r} does not take {', '.join(fields[1:])}: choose a solver that does "
                       f"({', '.join(able) or 'none is registered'})")
            raise FieldError(fields, message, message)
        return Options(**wanted)

    def candidates(self, judged: bool, layers: int) -> list[dict[str, Any]]:
        """What to solve for a window: the policy's one solve, or, when the cost trigger judges a rebalance of
        the incremental solver with no budget of its own, `eplb.trigger.candidates` (move budgets, no budget,
        fresh greedy), as in replay."""
        if not judged:
            return [{}]
        policy = self.config.policy
        return trigger.candidates(layers * int(self.cluster.slots_per_gpu.sum()), self.solver_name(True),
                                  policy.max_moves is not None or policy.target_lb is not None)

    def solve(
        self, run_solve: SolveFn, loads: NDArray[np.float64], current: Placement | None,
        summary: CoactivationSummary | None, fresh: bool = False, **budget: Any,
    ) -> Outcome:
        """One candidate: the policy's solver (budget: max_moves overriding the policy's), or with fresh greedy,
        against the serving placement. The placement serves as the next window's current one: no empty slots."""
        options = self.options(current is not None)
        if budget:
            options = replace(options, **budget)
        if fresh:
            options = applicable("greedy", options)
        solver = "greedy" if fresh else self.solver_name(current is not None)
        check_coactivation(solver, summary, names=FIELD_NAMES)  # the window's field, not the CLI's flag
        return run_solve(loads=loads, cluster=self.cluster, solver=solver, cost=self.cost, current=current,
                         options=options, objective=self.config.objective, coactivation=summary,
                         empty_slots=False)  # fmt: skip

    def coactivation(
        self, value: dict[str, Any] | str | None, loads: NDArray[np.float64]
    ) -> CoactivationSummary | None:
        """A window's co-activation summary checked against its loads (`CoactivationSummary.for_window`, as
        POST /placement's), or None."""
        if value is None:
            return None
        from eplb.coactivation import CoactivationSummary

        return CoactivationSummary.for_window(value, loads)

    def loads(self, value: Any, what: str = "loads") -> NDArray[np.float64]:
        try:
            loads = check_loads(value, what)
        except EplbError as exc:  # its text names the value: 'loads[0][1] is -2: loads must be >= 0'
            raise FieldError(what, str(exc), str(exc)) from None
        why = window_refusal(self.model, *loads.shape)  # POST /placement's rule: its experts, at most its MoE layers
        if why is not None:
            raise FieldError(what, why)
        slots = self.cluster.slots_per_gpu
        too_large = work_refusal(loads.shape[0], int(slots.sum()), slots.size)  # POST /placement's bound too
        if too_large is not None:
            raise FieldError(work_fields(self.config.cluster, what), too_large)
        return loads


# ----- answers --------------------------------------------------------------------------------------------------
class WindowInfo(BaseModel):
    """A window's identity: sha256 of its float64 [layers, E] bytes, its shape and total tokens."""

    digest: str
    layers: int
    experts: int
    tokens: float


class HistoryEntry(BaseModel):
    """One event of a deployment (see HistoryRow). lb_*: predicted lb on the window, mean over the layers with tokens
    (None: no placement, or a window without tokens); time_*_us: predicted MoE time of one step; bytes_moved: moves
    x one expert's bytes in one layer."""

    id: int
    seq: int = Field(description="window number (for applied: the windows received so far)")
    at: float = Field(description="Unix time, s")
    action: Action
    reason: str
    window: WindowInfo | None = None
    lb_before: float | None = None
    lb_after: float | None = None
    time_before_us: float | None = None
    time_after_us: float | None = None
    moves: int | None = None
    bytes_moved: float | None = None
    solver: str | None = None
    solver_status: str | None = None
    wall_ms: float | None = None
    plan: dict[str, Any] | None = None


class HistoryPage(BaseModel):
    """Newest first; pass `next` as `before` for the following page (None: no more)."""

    entries: list[HistoryEntry]
    next: int | None = None


class DeploymentView(BaseModel):
    """A deployment: config, the placement now serving, counters."""

    name: str
    config: DeploymentConfig
    placement: PlacementOut | None = Field(None, description="the placement now serving (None until the first)")
    windows: int = Field(description="windows received")
    last_rebalance: int | None = Field(None, description="window number of the last new placement the service made "
                                       "(placed or rebalanced; the periodic trigger counts from it)")
    last_placement: Literal["placed", "rebalanced"] | None = Field(
        None, description="what that window did: `placed` (no placement served: the first window, or the first "
        "after an update dropped the placement) or `rebalanced`; None before the first")
    created_at: float
    updated_at: float


class DeploymentUpdate(DeploymentView):
    """What `PUT /deployments/{name}` answers (and `eplb.client.Client.put_deployment` returns): the deployment,
    whether this PUT registered it, and why it dropped the serving placement (if it did)."""

    created: bool = Field(False, description="true when this PUT registered the deployment (201), false when it "
                          "updated one (200)")
    placement_dropped: str | None = Field(None, description="present when this update dropped the serving "
                                          "placement: the new model or cluster shape (experts, slots per GPU) no "
                                          "longer fits it; the next window places afresh (history stays)")


class WindowResult(BaseModel):
    """The answer to a window: `action` placed/rebalanced (with `result`: placement, prediction, moves, plan) or
    kept (`reason` says why; `before` is the serving placement judged on the window)."""

    deployment: str
    seq: int
    action: Action
    reason: str
    history_id: int
    entry: HistoryEntry = Field(description="the stored history entry")
    result: PlacementResponse | None = None
    window_key: str | None = Field(None, description="sha256 hex of what the window said (`window_key`); the same "
                                   "window sent again, nothing changed since, is answered this answer unchanged")


SolveFn = Callable[..., Outcome]
"""Runs `eplb.solve.solve` with the same keyword arguments (the service runs it in a solver process)."""


# ----- operations ------------------------------------------------------------------------------------------------
def check_name(name: str) -> str:
    """`name` when a deployment can have it; else a FieldError naming `name` (`eplb.rules.name_refusal`'s text)."""
    refused = name_refusal(name)  # fullmatch: 'victim\n' is no name
    if refused is not None:
        raise FieldError("name", DEPLOYMENT_NAME_RULE, refused)
    return name


def check_policy(policy: Policy) -> None:
    """Only the options of the policy's trigger (`eplb.trigger.unused_option`, the rule `eplb replay` refuses
    --threshold by without --trigger threshold): another trigger's option set to other than its default would change
    nothing, and is refused by name; and no max_moves 0 (no rebalance could change anything). At PUT only: a config
    stored with either reads and works as before (a stored max_moves 0 keeps the serving placement, `_trigger`)."""
    defaults = Policy()
    given = [field for options in trigger.TRIGGER_OPTIONS.values() for field in options
             if getattr(policy, field) != getattr(defaults, field)]
    names = {field: f"policy.{field}" for field in Policy.model_fields}
    unused = trigger.unused_option(policy.trigger, given, names, "this policy's",
                                   default="trigger" not in policy.model_fields_set)
    if unused is not None:
        raise FieldError((names[unused[0]], names["trigger"]), unused[1], unused[1])
    if policy.max_moves == 0:  # every rebalance would keep the serving placement
        raise FieldError(names["max_moves"], "0 copies leave the serving placement as it is, so no rebalance would "
                         "change anything: give at least 1, or drop policy.max_moves (no budget)")


def check_config(config: DeploymentConfig) -> Setup:
    """What PUT refuses of a config (FieldErrors naming its fields): `check_policy`'s PUT-only rules, then what
    every window would refuse (`Setup`). Returns the Setup."""
    check_policy(config.policy)
    return Setup(config)


def register(store: Store, name: str, config: DeploymentConfig) -> tuple[DeploymentUpdate, bool]:
    """Create or update deployment `name`. An update keeps the serving placement and history when the slot
    layout is unchanged (and drops the placement otherwise). Returns the deployment, with whether this call created
    it and dropped its placement (both judged under the deployment's lock), and whether it was created."""
    check_name(name)
    setup = check_config(config)
    stored = stored_config(config).model_dump(mode="json")
    now = time.time()
    with store.write() as session:
        row, created = store.create_or_lock_deployment(
            session, name, {"config": stored, "windows": 0, "created_at": now, "updated_at": now})
        serving = None
        if not created:  # the placement stays only while it fits the new slot layout and expert count
            serving = _placement(row)
            if (serving is None or serving.num_experts != setup.model.num_experts
                    or serving.slots_per_gpu.tolist() != setup.cluster.slots_per_gpu.tolist()):
                row.phy2log, row.shares = None, None
            row.config, row.updated_at = stored, now
            session.flush()
        view = _view(session, row)
        dropped = PLACEMENT_DROPPED if serving is not None and view.placement is None else None
        return DeploymentUpdate.model_construct(**dict(view), created=created, placement_dropped=dropped), created


def get(store: Store, name: str) -> DeploymentView:
    with store.read() as session:
        return _view(session, _row(session.get(DeploymentRow, name), name))


def current_placement(store: Store, name: str) -> Placement | None:
    """The placement now serving, or None."""
    with store.read() as session:
        return _placement(_row(session.get(DeploymentRow, name), name))


def list_all(store: Store) -> list[DeploymentView]:
    with store.read() as session:
        rows = list(session.scalars(select(DeploymentRow).order_by(DeploymentRow.name)))
        return [_view(session, r) for r in rows]


def retire(store: Store, name: str) -> None:
    """Delete the deployment and its history."""
    with store.write() as session:
        row = _row(store.lock_deployment(session, name), name)
        session.execute(delete(HistoryRow).where(HistoryRow.deployment == name))
        session.delete(row)


def history(store: Store, name: str, limit: int = 50, before: int | None = None) -> HistoryPage:
    """Up to `limit` entries older than id `before` (default: the newest), newest first."""
    if not 1 <= limit <= HISTORY_PAGE_MAX:
        raise EplbError(f"limit must be 1-{HISTORY_PAGE_MAX}, got {limit}")
    with store.read() as session:
        _row(session.get(DeploymentRow, name), name)
        query = select(HistoryRow).where(HistoryRow.deployment == name)
        if before is not None:
            query = query.where(HistoryRow.id < before)
        rows = list(session.scalars(query.order_by(HistoryRow.id.desc()).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    return HistoryPage(entries=[_entry(r) for r in rows], next=rows[-1].id if more else None)


def history_count(store: Store, name: str) -> int:
    with store.read() as session:
        return int(session.scalar(select(func.count()).where(HistoryRow.deployment == name)) or 0)


def window_coactivation(store: Store, history_id: int) -> CoactivationSummary | None:
    """The co-activation summary a history entry's window carried, or None."""
    from eplb.coactivation import CoactivationSummary

    with store.read() as session:
        row = session.get(HistoryRow, history_id)
        if row is None:
            raise NotFound(f"no history entry {history_id}")
        return None if row.coactivation is None else CoactivationSummary.from_bytes(row.coactivation)


def window_loads(store: Store, history_id: int) -> NDArray[np.float64]:
    """The stored window of a history entry: [layers, E] tokens."""
    with store.read() as session:
        row = session.get(HistoryRow, history_id)
        if row is None or row.loads is None:
            raise NotFound(f"history entry {history_id} has no window")
        return np.asarray(unpack(row.loads), dtype=np.float64)


def process_window(store: Store, name: str, loads_value: Any, *, force: bool = False,
                   run_solve: SolveFn = solve, coactivation: dict[str, Any] | str | None = None,
                   current_placement: Any = None) -> WindowResult:
    """Judge one window ([layers][E] tokens) for deployment `name`, rebalance when the trigger fires (or
    `force`), store the event; holds the deployment's lock throughout. coactivation: the window's summary
    (`CoactivationSummary.parse`: its object or base64 of its .npz image): the predictions count the GPUs a
    token reaches, the time objective may co-locate experts chosen together, and the history keeps it.
    current_placement: the placement the cluster serves (a placement object, as `record_applied` takes); when it
    is not the stored serving one it is recorded first (an applied entry), so the window is judged against, and
    a rebalance starts from, what serves.

    A duplicate, the window this deployment processed last sent again (equal `window_key`) while the deployment
    is as that window left it (serving placement and config), is answered that window's stored answer, and
    nothing is recorded: each EP rank of an engine sends the same window and must get the same placement."""
    with store.write() as session:
        row = _row(store.lock_deployment(session, name), name)
        setup = Setup(DeploymentConfig.model_validate(row.config))
        policy = setup.config.policy
        loads = setup.loads(loads_value)
        current = _placement(row)
        served = None
        if current_placement is not None:  # what serves replaces the stored placement, whatever its layers
            served = _serving(setup, current_placement, "current_placement")
            if served.num_layers != loads.shape[0]:
                raise FieldError("current_placement", f"{served.num_layers} layers, the window has {loads.shape[0]}")
        elif current is not None and current.num_layers != loads.shape[0]:
            raise FieldError("loads", f"{plural(loads.shape[0], 'layer')}, but the serving placement has "
                             f"{current.num_layers} (send the placement the cluster serves with the window, as "
                             "current_placement)")
        summary = setup.coactivation(coactivation, loads)
        key = window_key(loads, served, force, summary)
        if row.last_window_answer is not None and row.last_window_key == _state_key(key, row):
            return WindowResult.model_validate_json(zlib.decompress(row.last_window_answer))
        if served is not None and (current is None or not _same_placement(served, current)):
            _record_serving(session, row, setup, served, "sent with the window as current_placement")
            current = served
        seq = row.windows + 1
        now = time.time()
        entry = HistoryRow(deployment=name, seq=seq, at=now, loads=pack(loads), **_window_columns(loads))
        if summary is not None:
            entry.coactivation = summary.to_bytes()
        nodes = setup.cluster.gpus_per_node
        before = None
        if current is not None:
            before = evaluate(loads, current, setup.cost, coactivation=summary, gpus_per_node=nodes)
        if before is not None:
            entry.lb_before, entry.time_before_us = _lb_time(before)
        fire, reason = _trigger(policy, seq, row.last_rebalance, before, force, bool(loads.sum() > 0))
        outcome: Outcome | None = None
        after: Outcome | None = None
        moves = 0
        if fire:
            recent = [loads, *_recent_windows(session, name, policy.windows - 1, loads.shape)]
            summed = np.sum(recent, axis=0)
            judged = policy.trigger == "cost" and before is not None and current is not None and not force
            tried = []
            for kwargs in setup.candidates(judged, loads.shape[0]):
                out = setup.solve(run_solve, summed, current, summary, **kwargs)
                judge = evaluate(loads, out.placement, setup.cost, coactivation=summary, gpus_per_node=nodes)
                copies = 0 if current is None else int(count_moves(
                    out.placement.phy2log, current.phy2log, setup.cluster.slots_per_gpu).sum())
                tried.append((out, judge, copies, kwargs))
            pick = 0
            if judged:
                assert before is not None and current is not None
                pick, fire, reason = _worth_it(before, [(a, c, k, o.plan) for o, a, c, k in tried], current, setup,
                                               policy.steps)  # fmt: skip
            outcome, after, moves, _ = tried[pick]
        if outcome is not None and after is not None and fire:
            entry.action = "placed" if current is None else "rebalanced"
            entry.lb_after, entry.time_after_us = _lb_time(after)
            entry.moves, entry.bytes_moved = moves, moves * setup.model.expert_bytes
            entry.solver, entry.solver_status = outcome.solver.get("name"), outcome.solver.get("status")
            entry.wall_ms = outcome.solver.get("wall_ms")
            entry.plan = None if outcome.plan is None else outcome.plan.to_dict()
            entry.phy2log = pack(outcome.placement.phy2log)
            row.phy2log = entry.phy2log
            row.shares = None if outcome.placement.shares is None else pack(outcome.placement.shares)
            entry.shares = row.shares
            row.last_rebalance = seq
        else:
            entry.action = "kept"
            entry.lb_after, entry.time_after_us = entry.lb_before, entry.time_before_us
            entry.moves, entry.bytes_moved = 0, 0.0
        entry.reason = reason
        row.windows, row.updated_at = seq, now
        session.add(entry)
        session.flush()
        result = None
        if entry.action != "kept" and outcome is not None:
            result = outcome.to_model()
            if result.plan is None and isinstance(entry.plan, dict):
                result.plan = entry.plan
        answer = WindowResult(deployment=name, seq=seq, action=entry.action, reason=reason, history_id=entry.id,
                              entry=_entry(entry), result=result, window_key=key).model_dump_json()
        row.last_window_key = _state_key(key, row)
        row.last_window_answer = zlib.compress(answer.encode(), 6)
        return WindowResult.model_validate_json(answer)  # as a duplicate gets it, to the last digit


def record_applied(store: Store, name: str, value: Any) -> HistoryEntry:
    """Record the placement the cluster now serves (a placement object as `POST /placement` returns it): it
    becomes the current placement, whatever the stored one's layer count (the cluster is the authority on what
    it serves, as with a window's current_placement); one the deployment cannot hold is refused (`_serving`).
    Moves are counted from the previous one, lb and time predicted on the last window received (`_record_serving`:
    neither from a placement, or on a window, of other layers). The placement already serving (the same experts in
    the same slots, the same shares: a plan confirmed, a report sent again) records nothing, as a window's
    current_placement equal to it records nothing: the answer is the entry that made it serve."""
    with store.write() as session:
        row = _row(store.lock_deployment(session, name), name)
        setup = Setup(DeploymentConfig.model_validate(row.config))
        applied = _serving(setup, value, "placement")
        current = _placement(row)
        if current is not None and _same_placement(applied, current):
            made = _serving_entry(session, row)
            if made is not None:
                return _entry(made)
        return _entry(_record_serving(session, row, setup, applied, "reported by the cluster"))


def window_key(loads: NDArray[np.float64], current: Placement | None, force: bool,
               summary: CoactivationSummary | None) -> str:
    """What a window request says, as sha256 hex: the loads [L, E] (float64), the current placement's phy2log
    [L, P] (int64) and shares (float64; absent: uniform), `force`, and the co-activation summary's arrays
    (whichever form it was sent in). Every EP rank of an engine sends the same window and map: one key."""
    digest = hashlib.sha256(b"eplb.window-key/v1")
    arrays: list[tuple[str, Any]] = [("loads", np.asarray(loads, dtype=np.float64)), ("force", np.int64(force))]
    if current is not None:
        arrays += [("phy2log", current.phy2log.astype(np.int64)),
                   ("shares", None if current.shares is None else current.shares.astype(np.float64))]
    if summary is not None:
        arrays += [(f"coactivation.{field}", np.asarray(value, dtype=np.int64)) for field, value in (
            ("tokens", summary.tokens), ("top_k", summary.top_k), ("loads", summary.loads),
            ("partners", summary.partners), ("counts", summary.counts))]
    for field, array in arrays:  # each named, with its dtype and shape, so no two requests run together
        if array is None:
            digest.update(f"{field}=none;".encode())
            continue
        array = np.ascontiguousarray(array)
        digest.update(f"{field}={array.dtype.str}{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# ----- helpers -------------------------------------------------------------------------------------------------
def _row(row: DeploymentRow | None, name: str) -> DeploymentRow:
    if row is None:
        hint = f"register it with PUT /deployments/{name}" if is_deployment_name(name) else DEPLOYMENT_NAME_RULE
        raise NotFound(f"no deployment named {shown(name, NAME_SHOWN)}: {hint}")
    return row


def _serving(setup: Setup, value: Any, field: str) -> Placement:
    """A placement the cluster serves (a placement object, as `POST /placement` returns it) checked against the
    deployment: the model's experts, the cluster's slots per GPU, every slot filled; a FieldError naming `field`."""
    if isinstance(value, dict) and "num_experts" not in value:
        value = {**value, "num_experts": setup.model.num_experts}
    try:
        served = Placement.from_dict(value, field)
    except FieldError as exc:  # a field in it (layer_ids): named in the placement, as the service's schema does
        raise FieldError([f"{field}.{name}" for name in exc.fields], exc.message) from None
    except EplbError as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field}: ")) from None
    if served.num_experts != setup.model.num_experts:
        raise FieldError(field, f"{served.num_experts} experts, the model has {setup.model.num_experts}")
    too_many = window_refusal(setup.model, served.num_layers, served.num_experts, "the placement has")  # windows'
    if too_many is not None:
        raise FieldError(field, too_many)
    if served.slots_per_gpu.tolist() != setup.cluster.slots_per_gpu.tolist():
        raise FieldError(field, f"{describe_slots(served.slots_per_gpu)}, the deployment has "
                         f"{describe_slots(setup.cluster.slots_per_gpu)}")
    if served.empty_slots.any():  # it would serve as every window's current placement, which refuses them
        layer, slot = (int(v) for v in np.argwhere(served.empty_slots)[0])
        why = ("is -1, an empty slot: a deployment's placement is what the next window rebalances from, so "
               "every slot must hold an expert (record the placement served once EP scaling finished)")
        raise FieldError(f"{field}.phy2log.{layer}.{slot}", why, f"{field}.phy2log[{layer}][{slot}] {why}")
    return served


def _record_serving(session: Any, row: DeploymentRow, setup: Setup, applied: Placement, reason: str) -> HistoryRow:
    """Make `applied` the deployment's serving placement, with an applied history entry: moves from the previous
    placement, lb and time predicted on the last window (moves and lb before none when the previous one has
    other layers, which a window's current_placement and `record_applied` both replace; lb none when the last
    window has other layers)."""
    name = row.name
    previous = _placement(row)
    if previous is not None and previous.num_layers != applied.num_layers:
        previous = None  # another layer count: no copies to count, nothing to judge before
    entry = HistoryRow(deployment=name, seq=row.windows, at=time.time(), action="applied", reason=reason)
    if previous is not None:
        moves = int(count_moves(applied.phy2log, previous.phy2log, setup.cluster.slots_per_gpu).sum())
        entry.moves, entry.bytes_moved = moves, moves * setup.model.expert_bytes
    last = session.scalars(select(HistoryRow).where(HistoryRow.deployment == name, HistoryRow.loads.is_not(None))
                           .order_by(HistoryRow.id.desc()).limit(1)).first()
    if last is not None and last.loads is not None:
        loads = np.asarray(unpack(last.loads), dtype=np.float64)
        if loads.shape[0] == applied.num_layers:
            entry.window_digest, entry.window_layers = last.window_digest, last.window_layers
            entry.window_experts, entry.window_tokens = last.window_experts, last.window_tokens
            nodes = setup.cluster.gpus_per_node
            if previous is not None:
                before = evaluate(loads, previous, setup.cost, gpus_per_node=nodes)
                entry.lb_before, entry.time_before_us = _lb_time(before)
            after = evaluate(loads, applied, setup.cost, gpus_per_node=nodes)
            entry.lb_after, entry.time_after_us = _lb_time(after)
    entry.phy2log = pack(applied.phy2log)
    entry.shares = None if applied.shares is None else pack(applied.shares)
    row.phy2log, row.shares, row.updated_at = entry.phy2log, entry.shares, entry.at
    session.add(entry)
    session.flush()
    return entry


def _same_placement(a: Placement, b: Placement) -> bool:
    """Whether two placements of one cluster put the same experts in the same slots with the same shares."""
    if not np.array_equal(a.phy2log, b.phy2log):
        return False
    return (a.shares is None and b.shares is None) or (
        a.shares is not None and b.shares is not None and np.array_equal(a.shares, b.shares))


def _serving_entry(session: Any, row: DeploymentRow) -> HistoryRow | None:
    """The history entry that made the stored placement serve (the newest with a placement: placed, rebalanced or
    applied), or None when it holds another (a history this version did not write)."""
    made = session.scalars(select(HistoryRow).where(HistoryRow.deployment == row.name, HistoryRow.phy2log.is_not(None))
                           .order_by(HistoryRow.id.desc()).limit(1)).first()
    if made is None or made.phy2log != row.phy2log or made.shares != row.shares:
        return None
    entry: HistoryRow = made
    return entry


def _state_key(key: str, row: DeploymentRow) -> str:
    """`key` (a `window_key`) bound to the deployment's state: its stored serving placement and config. Stored
    after a window, it matches the same window again only while nothing recorded since has changed them (an
    applied placement, another window, a PUT)."""
    digest = hashlib.sha256(key.encode())
    for blob in (row.phy2log, row.shares):
        digest.update(b"none;" if blob is None else len(blob).to_bytes(8, "little") + blob)
    digest.update(json.dumps(row.config, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def _placement(row: DeploymentRow) -> Placement | None:
    """The stored serving placement, or None: none yet, or one that no longer fits the config's slots (stored
    before a change of the default slot budget, or a config this version cannot resolve), or one with empty
    slots (recorded before `record_applied` refused them), or one of more layers than the model has MoE layers
    (stored before windows were held to them): the next window places afresh."""
    if row.phy2log is None:
        return None
    try:  # a stored config a newer eplb cannot resolve (a preset renamed, a stricter check) serves nothing
        config = DeploymentConfig.model_validate(row.config)
        slots, model = config_slots(config), config_model(config)
    except (EplbError, KeyError, ValueError):
        return None
    phy2log = unpack(row.phy2log)
    if phy2log.shape[1] != int(slots.sum()) or (phy2log < 0).any() or phy2log.shape[0] > model.num_moe_layers:
        return None
    shares = None if row.shares is None else unpack(row.shares)
    return Placement(phy2log, slots, model.num_experts, shares)


def _view(session: Any, row: DeploymentRow) -> DeploymentView:
    placement = _placement(row)
    return DeploymentView(
        name=row.name, config=DeploymentConfig.model_validate(row.config),
        placement=None if placement is None else PlacementOut.model_validate(placement.to_dict()),
        windows=row.windows, last_rebalance=row.last_rebalance, last_placement=_last_placement(session, row),
        created_at=row.created_at, updated_at=row.updated_at,
    )


def _last_placement(session: Any, row: DeploymentRow) -> Literal["placed", "rebalanced"] | None:
    """Whether window `row.last_rebalance` placed (no placement served) or rebalanced: its history entry's action
    (None before the first new placement, or when the history holds no such entry)."""
    if row.last_rebalance is None:
        return None
    action = session.scalars(select(HistoryRow.action).where(
        HistoryRow.deployment == row.name, HistoryRow.seq == row.last_rebalance,
        HistoryRow.action.in_(("placed", "rebalanced"))).order_by(HistoryRow.id.desc()).limit(1)).first()
    return "placed" if action == "placed" else "rebalanced" if action == "rebalanced" else None


def _entry(row: HistoryRow) -> HistoryEntry:
    window = None
    if row.window_digest is not None:
        window = WindowInfo(digest=row.window_digest, layers=row.window_layers or 0, experts=row.window_experts or 0,
                            tokens=row.window_tokens or 0.0)
    return HistoryEntry(
        id=row.id, seq=row.seq, at=row.at, action=row.action, reason=row.reason, window=window,
        lb_before=row.lb_before, lb_after=row.lb_after, time_before_us=row.time_before_us,
        time_after_us=row.time_after_us, moves=row.moves, bytes_moved=row.bytes_moved, solver=row.solver,
        solver_status=row.solver_status, wall_ms=row.wall_ms, plan=row.plan,
    )


def _window_columns(loads: NDArray[np.float64]) -> dict[str, Any]:
    return {
        "window_digest": hashlib.sha256(np.ascontiguousarray(loads, dtype=np.float64).tobytes()).hexdigest(),
        "window_layers": int(loads.shape[0]), "window_experts": int(loads.shape[1]),
        "window_tokens": float(loads.sum()),
    }


def _lb_time(outcome: Outcome) -> tuple[float | None, float | None]:
    """The history's numbers of an outcome: lb, mean over the layers with tokens (None: no layer has any, no lb),
    and the predicted MoE time of one step (None without a model)."""
    lb_mean = outcome.balance.lb_over_tokens()
    lb = None if lb_mean is None else round(lb_mean[0], 6)
    time_us = None if outcome.prediction is None else round(outcome.prediction.total_time_us, 3)
    return lb, time_us


def _trigger(policy: Policy, seq: int, last: int | None, before: Outcome | None, force: bool,
             tokens: bool) -> tuple[bool, str]:
    """Whether to solve for this window, and why (the cost trigger decides again after solving). A window without
    tokens (`tokens` False) is kept whatever the trigger or `force`: it has no lb to judge, and nothing to place
    on (docs/replay.md: a layer without tokens has no lb, not 1.0); so is one of a policy stored with max_moves 0
    once a placement serves."""
    if not tokens:
        forced = "forced by the request, but " if force else ""
        stays = "the serving placement stays" if before is not None else "nothing to place on, no placement serves yet"
        return False, f"{forced}the window has no tokens (no lb to judge): {stays}"
    if before is None:
        return True, "no placement serves yet"
    if policy.max_moves == 0:  # stored before PUT refused it (`check_policy`): no rebalance could copy anything
        forced = "forced by the request, but " if force else ""
        return False, (f"{forced}policy.max_moves is 0: a rebalance may copy no expert, so the serving placement "
                       "stays (PUT the config with policy.max_moves at least 1, or without it)")
    if force:
        return True, "forced by the request"
    if policy.trigger == "periodic":
        since = seq - (last or 0)
        if since >= policy.every:
            return True, f"periodic: {since} windows since the last rebalance (every {policy.every})"
        return False, f"periodic: {since} of {policy.every} windows since the last rebalance"
    lb_mean = before.balance.lb_over_tokens()  # the layers with tokens: the others have no lb
    lb = 1.0 if lb_mean is None else lb_mean[0]  # None only on a window without tokens, kept above
    if policy.trigger == "threshold":
        if lb > policy.threshold:
            return True, f"threshold: predicted lb {lb:.4f} > {policy.threshold}"
        return False, f"threshold: predicted lb {lb:.4f} <= {policy.threshold}"
    return True, "cost: candidate solved"


def _worth_it(
    before: Outcome,
    tried: list[tuple[Outcome, int, dict[str, Any], MigrationPlan | None]],
    current: Placement,
    setup: Setup,
    steps: int,
) -> tuple[int, bool, str]:
    """Cost trigger: for each candidate (its judged outcome, copies, solve arguments, the solve's migration plan),
    the predicted time saved over `steps` steps (those after its copies land, `eplb.trigger.net_saving`) minus the
    migration charge of copying its experts while serving
    (replay's cost model, `eplb.cost.migration`, counting the plan's copies); `eplb.trigger.choose_candidate`
    picks one. Returns (candidate, rebalance?, why)."""
    pred = before.prediction
    if pred is None or any(after.prediction is None for after, _, _, _ in tried):
        return 0, True, "cost: no time prediction, rebalanced"
    spec = setup.migration
    saved, charge = [], []
    for after, _, _, plan in tried:
        assert after.prediction is not None
        migration = spec.rebalance_cost(after.placement.phy2log, current.phy2log, setup.cluster.slots_per_gpu,
                                        setup.model.expert_bytes, pred, plan)  # fmt: skip
        net, saving = trigger.net_saving((pred.total_time_us - after.prediction.total_time_us) * 1e-6, steps, migration,
                                         pred.total_time_us * 1e-6)  # fmt: skip
        saved.append(saving)
        charge.append(saving - net)
    lbs = [(after.balance.lb_over_tokens() or (1.0, 1.0))[0] for after, _, _, _ in tried]  # a window with tokens
    pick = trigger.choose_candidate([s - c for s, c in zip(saved, charge, strict=True)], lbs,
                                    [copies for _, copies, _, _ in tried])  # fmt: skip
    shown = max(range(len(tried)), key=lambda i: saved[i] - charge[i]) if pick is None else pick
    which = "" if len(tried) == 1 else f" ({_describe(tried[shown][2])}, of {len(tried)} candidates)"
    verb = "costs" if pick is not None else "would cost"
    why = f"cost: saves {saved[shown] * 1e3:.3f} ms over {steps} steps, migration {verb} {charge[shown] * 1e3:.3f} ms"
    return shown, pick is not None, why + which


def _describe(kwargs: dict[str, Any]) -> str:
    if kwargs.get("fresh"):
        return "fresh greedy"
    if kwargs.get("max_moves") is not None:
        return f"incremental, max_moves={kwargs['max_moves']}"
    return "incremental, no budget"


RECENT_WINDOWS_SCANNED = 10_000
"""How many of a deployment's newest stored windows `_recent_windows` searches for ones of a window's shape."""


def _recent_windows(session: Any, name: str, count: int, shape: tuple[int, ...]) -> list[NDArray[np.float64]]:
    """The last `count` stored windows of this shape ([layers, E]), newest first, found among the deployment's
    newest `RECENT_WINDOWS_SCANNED` stored windows of any shape (fewer when fewer match there)."""
    if count < 1:
        return []
    newest = (select(HistoryRow.id).where(HistoryRow.deployment == name, HistoryRow.loads.is_not(None))
              .order_by(HistoryRow.id.desc()).limit(RECENT_WINDOWS_SCANNED))
    layers, experts = shape
    query = select(HistoryRow.loads).where(HistoryRow.id.in_(newest.scalar_subquery()),
                                           HistoryRow.window_layers == layers, HistoryRow.window_experts == experts)
    blobs = session.scalars(query.order_by(HistoryRow.id.desc()).limit(count))
    return [np.asarray(unpack(b), dtype=np.float64) for b in blobs]
