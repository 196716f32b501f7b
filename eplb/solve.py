"""One place where a load window becomes a placement with its predicted balance and time.

The CLI (`eplb solve`, `eplb evaluate`) and the HTTP API both call `solve` / `evaluate` here and print
or return `Outcome.to_dict()`, so the two always agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb.budget import describe_slots, slot_counts, slots_beyond_experts
from eplb.cost import LayerPrediction, TimeModel, predict
from eplb.errors import EplbError, FieldError, shown
from eplb.evaluate import Balance, balance, contiguous_placement, placement_loads
from eplb.io.files import plural
from eplb.io.windows import check_loads
from eplb.objective import OBJECTIVES, candidates, choose_by_time
from eplb.placement import Placement
from eplb.specs import MODEL_PRESETS, HardwareSpec, ModelSpec
from solvers import registry
from solvers.bounds import lower_bound
from solvers.migration import arrange_slots, count_moves, relabel_gpus
from solvers.plan import MigrationPlan, PlanError, build_plan
from solvers.registry import Options, Problem, SolverError
from solvers.validation import InvalidPlacement, validate_placement, whole_number

if TYPE_CHECKING:
    from eplb import schemas
    from eplb.coactivation import CoactivationSummary, Reach


OPTION_ARGS = {**{f.name: f.name for f in fields(Options)}, "current_phy2log": "solve(current=...)"}
"""`solve`'s names for the registry's refusals (`registry.check_options`): every option by its own name, and the
serving placement as this function takes it (`current`), not as the registry's Problem holds it."""
SETTING_FLAGS = {"solver": "--solver", "split": "--split", "objective": "--objective"}
"""What the messages of `solver_name` and `check_uniform_shares` call these settings unless told (`names=`, as
`solvers.registry.check` takes it): `eplb solve`'s flags. The API and deployments pass their JSON fields."""


def _named(names: Mapping[str, str] | None) -> Mapping[str, str]:
    return SETTING_FLAGS if names is None else {**{k: k for k in SETTING_FLAGS}, **names}


def solver_name(solver: str, split: str | None = None, names: Mapping[str, str] | None = None) -> str:
    """The registry name for a solver and share split (`milp` + weighted -> `milp-weighted`); split None: not given
    (uniform, or the split a solver such as `milp-weighted` names itself). names: what the refusals of a split the
    solver cannot give call the settings (default `SETTING_FLAGS`); they are FieldErrors of them."""
    if split not in (None, "uniform", "weighted"):
        raise EplbError(f"split must be 'uniform' or 'weighted', got {split!r}")
    weights = solver in registry.names() and registry.get_solver(solver).capabilities.shares
    if split == "uniform" and weights:
        n = _named(names)
        message = (f"{n['solver']} {solver} gives replicas weighted shares, {n['split']} uniform even ones: drop "
                   f"{n['split']} uniform, or choose {n['solver']} {solver.removesuffix('-weighted')}")
        raise FieldError((n["solver"], n["split"]), message, message)
    if split != "weighted" or weights:
        return solver
    weighted = f"{solver}-weighted"
    if weighted not in registry.names():
        n = _named(names)
        message = f"the {solver} solver gives uniform shares only; use {n['solver']} milp for {n['split']} weighted"
        raise FieldError((n["solver"], n["split"]), message, message)
    return weighted


def check_uniform_shares(name: str, objective: str, split: str | None = None,
                         names: Mapping[str, str] | None = None) -> None:
    """The time objective places uniform shares: a FieldError for solver `name` when it weights them, asked for
    with `split` weighted or named itself (`milp-weighted`). names: what the message calls the settings (default
    `SETTING_FLAGS`, the CLI's; the API and deployments check before any solve with their JSON fields)."""
    if objective != "time" or name not in registry.names() or not registry.get_solver(name).capabilities.shares:
        return
    n = _named(names)
    if split == "weighted":
        message = f"the time objective places uniform shares: drop {n['split']} weighted (solver {name!r})"
        raise FieldError((n["split"], n["objective"]), message, message)
    uniform = name.removesuffix("-weighted")
    alternative = f" ({uniform!r} places uniform ones)" if uniform != name and uniform in registry.names() else ""
    message = (f"the time objective places uniform shares, and solver {name!r} weights them: choose another "
               f"{n['solver']}{alternative}")
    raise FieldError((n["solver"], n["objective"]), message, message)


@dataclass(frozen=True, init=False)
class Cluster:
    """slots_per_gpu: [G] expert slots on each GPU (a list, tuple or array of whole numbers >= 1, at most
    `eplb.rules.CLI_MAX_GPUS` GPUs: `eplb.budget.slot_counts`; stored as int64); gpus_per_node and num_groups
    (integers: int or numpy's, not 2.0, as the CLI's flags; stored as int) select the hierarchical policy (expert
    groups kept within nodes) when both are given. EplbError naming the field otherwise; `check_shapes` judges them
    against a window."""

    slots_per_gpu: NDArray[np.int64]
    gpus_per_node: int | None = None
    num_groups: int | None = None

    def __init__(self, slots_per_gpu: ArrayLike, gpus_per_node: SupportsIndex | None = None,
                 num_groups: SupportsIndex | None = None) -> None:
        object.__setattr__(self, "slots_per_gpu", slot_counts(slots_per_gpu))
        for name, value in (("gpus_per_node", gpus_per_node), ("num_groups", num_groups)):
            count = None if value is None else whole_number(value)
            if value is not None and count is None:
                raise EplbError(f"{name} must be a whole number (an int), got {shown(value)}")
            object.__setattr__(self, name, count)

    @property
    def num_gpus(self) -> int:
        return int(self.slots_per_gpu.size)


DEFAULT_TOKENS_PER_GPU = 4096.0
"""Tokens per GPU in one step when a load window is judged (solve, evaluate, compare --loads): a window
sums many steps, so its own total is no step size. 4,096 is a prefill-sized step (seed 000's tables use
256 for decode and 4,096 to 32,768 for prefill); --tokens-per-gpu / `tokens_per_gpu` change it."""


@dataclass(frozen=True)
class CostSetup:
    """What the time prediction needs: specs, all-to-all link bandwidth (B/s), tokens per GPU in one
    step (None: the window is taken as one step), whether comm overlaps the GEMMs, and the node limit of
    node-limited routing (used with co-activation data)."""

    model: ModelSpec
    hardware: HardwareSpec
    link_bw: float
    tokens_per_gpu: float | None = None
    overlap: bool = True
    node_limit: int | None = None  # DeepSeek-style node-limited routing: a token's experts on at most M nodes
    inter_node_bw: float | None = None  # B/s between nodes (a '+' link, DeepEP): link_bw is then within a node


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
    plan: MigrationPlan | None = None
    copies: dict[str, NDArray[np.float64]] | None = None  # expected copies per token [L] (co-activation data)
    baseline_copies: dict[str, NDArray[np.float64]] | None = None

    def to_model(self) -> schemas.PlacementResponse:
        """The answer `eplb solve --json` prints and `POST /placement` returns (eplb/schemas.py)."""
        from eplb import schemas  # pydantic models cost ~0.2 s to build: only answers that are sent need them

        predicted: dict[str, Any] = _balance_dict(self.balance)
        baseline: dict[str, Any] = _balance_dict(self.baseline)
        if self.prediction is not None and self.baseline_prediction is not None:
            predicted.update(_time_dict(self.prediction))
            baseline.update(_time_dict(self.baseline_prediction))
        if self.copies is not None and self.baseline_copies is not None:
            predicted["copies_per_token"] = {k: _round(v, 4) for k, v in self.copies.items()}
            baseline["copies_per_token"] = {k: _round(v, 4) for k, v in self.baseline_copies.items()}
        moves = None
        if self.moves is not None:
            total = int(self.moves.sum())
            bytes_moved = None if self.bytes_per_move is None else float(total * self.bytes_per_move)
            moves = schemas.Moves(per_layer=self.moves.tolist(), total=total, bytes_moved=bytes_moved)
        return schemas.PlacementResponse(
            placement=schemas.PlacementOut.model_validate(self.placement.to_dict()),
            predicted=schemas.Predicted(**predicted, baseline=schemas.Balance(**baseline)),
            solver=schemas.SolverOut.model_validate(self.solver) if self.solver else None,
            moves=moves,
            plan=None if self.plan is None else self.plan.to_dict(),
        )

    def to_dict(self) -> dict[str, Any]:
        """`to_model()` as a JSON object, absent fields left out (with a current placement it carries the
        migration plan under "plan", docs/formats.md)."""
        return self.to_model().to_json_dict()


def _balance_dict(b: Balance) -> dict[str, Any]:
    """The answer's balance numbers: per layer, None where the layer has no tokens (no lb, as replay reports it);
    lb_mean and lb_max over the layers with tokens, left out when none has any."""
    tokens = b.has_tokens.tolist()
    out: dict[str, Any] = {name: [v if t else None for v, t in zip(_round(values), tokens, strict=True)]
                           for name, values in (("lb", b.lb), ("balancedness", b.balancedness),
                                                ("imbalance", b.imbalance))}
    summary = b.lb_over_tokens()
    if summary is not None:
        out["lb_mean"], out["lb_max"] = (round(v, 6) for v in summary)
    return out


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
    """The preset matching a window's expert count (and layer count when several match), else None. A preset with
    fewer MoE layers than the window cannot be its model (`ModelSpec.window_mismatch`, the rule a named model is
    checked by) and matches none."""
    matches = [m for m in MODEL_PRESETS.values() if m.window_mismatch(num_layers, num_experts) is None]
    if len(matches) > 1:
        matches = [m for m in matches if m.num_moe_layers == num_layers] or matches[:0]
    return matches[0] if len(matches) == 1 else None


def model_mismatch(
    model: ModelSpec, num_layers: int, num_experts: int, what: str, way: Callable[[str, str | None], str],
    names: Mapping[str, str] | None = None,
) -> str | None:
    """None when data of num_layers x num_experts can be `model`'s; else the one refusal: what is wrong
    (`ModelSpec.window_mismatch`: what names the data, 'the log has', 'the loads have'; names its sizes), then the
    way out in the caller's words (the CLI's flags, the service's JSON fields, the Python API's arguments):
    way(need, rows). need is the model the data wants, 'a model with 16 experts and 2 or more MoE layers', with
    ' (the preset P has)' when a preset fits (`infer_model`); rows is `ModelSpec.window_rows` (the data the model
    takes) when the layers are what is wrong, None when the experts are (the data are another model's)."""
    why = model.window_mismatch(num_layers, num_experts, what, names)
    if why is None:
        return None
    fits = infer_model(num_experts, num_layers)
    need = (f"a model with {plural(num_experts, 'expert')} and {num_layers:,} or more MoE layers"
            f"{f' (the preset {fits.name} has)' if fits is not None else ''}")
    rows = model.window_rows() if num_experts == model.num_experts else None
    return f"{why}: {way(need, rows)}"


def window_refusal(model: ModelSpec, num_layers: int, num_experts: int, what: str = "the window has") -> str | None:
    """`model_mismatch` in the service's words, for a window (POST /placement's loads, a deployment's windows) or a
    placement of a deployment (what: 'the placement has'): the rows to send, the model's (a deployment's model is
    its config's, so no other model is offered)."""
    return model_mismatch(model, num_layers, num_experts, what, lambda _need, _rows: f"send {model.window_rows()}")


def time_limited(option: str = "time_limit_s") -> list[str]:
    """The registered solvers that take the time limit `option` (time_limit_s per layer, total_time_limit_s)."""
    return [n for n in registry.names() if option in registry.get_solver(n).options]


def least_stage_gib(model: ModelSpec, stage_gib: float) -> float | None:
    """None when a migration stage of `stage_gib` GiB holds one expert copy of `model` (a stage moves whole
    copies); else the fewest GiB that do, rounded up to 1e-4 so the value shown is enough."""
    if stage_gib * 2**30 >= model.expert_bytes:
        return None
    return math.ceil(model.expert_bytes / 2**30 * 1e4) / 1e4


def check_links(cost: CostSetup | None, cluster: Cluster) -> None:
    """EplbError for two links (within and between nodes), or a node limit, on a cluster without nodes: before
    any solve (a node limit without nodes would be dropped without a word)."""
    if cost is not None and cost.inter_node_bw is not None:
        TimeModel.check_nodes(cluster.num_gpus, cluster.gpus_per_node)
    if cost is not None and cost.node_limit is not None and cluster.gpus_per_node is None:
        raise EplbError("a node limit caps the nodes a token reaches: it needs the GPUs per node (--gpus-per-node; "
                        "gpus_per_node in the API and deployments)")


def check_shapes(loads: NDArray[np.float64], cluster: Cluster) -> None:
    """Raise EplbError when the cluster cannot hold the window's [layers, E] experts, has a GPU of more slots than
    experts, or nodes or groups that do not divide the GPUs or the experts."""
    num_experts = loads.shape[1]
    total = int(cluster.slots_per_gpu.sum())
    if total < num_experts:
        raise EplbError(
            f"{total} slots on {cluster.num_gpus} GPUs cannot hold {num_experts} experts: need at least "
            f"{-(-num_experts // cluster.num_gpus)} slots per GPU"
        )
    beyond = slots_beyond_experts(cluster.slots_per_gpu, num_experts)  # also bounds what a solve allocates
    if beyond is not None:
        raise EplbError(beyond)
    if cluster.gpus_per_node is not None and (cluster.gpus_per_node < 1 or cluster.num_gpus % cluster.gpus_per_node):
        raise EplbError(f"{cluster.num_gpus} GPUs do not split into nodes of {cluster.gpus_per_node}")
    if cluster.num_groups is not None and (cluster.num_groups < 1 or num_experts % cluster.num_groups):
        raise EplbError(f"{num_experts} experts do not split into {cluster.num_groups} equal groups")


def check_cluster_fields(num_experts: int, cluster: Cluster) -> None:
    """`check_shapes` of a cluster alone (an empty window of `num_experts` experts), its refusals naming the service's
    fields: `cluster` (slots), `cluster.gpus_per_node` (nodes that do not divide the GPUs), `cluster.num_groups` (groups
    that do not divide the experts). FieldError; what POST /placement and a deployment's PUT check before any solve
    or job."""
    probe = np.zeros((1, num_experts))
    slots = cluster.slots_per_gpu
    for name, part in (("cluster", Cluster(slots)), ("cluster.gpus_per_node", Cluster(slots, cluster.gpus_per_node)),
                       ("cluster.num_groups", Cluster(slots, num_groups=cluster.num_groups))):
        try:
            check_shapes(probe, part)
        except EplbError as exc:
            raise FieldError(name, str(exc)) from None


def link_fields(cost: CostSetup | None, cluster: Cluster, nodes: str) -> list[str]:
    """The fields a `check_links` refusal is about: the setting that needs nodes (`node_limit` when it is set on a
    cluster without nodes, else `link`: a '+' link) and the GPUs per node (`nodes`: the caller's name of it)."""
    limited = cost is not None and cost.node_limit is not None and cluster.gpus_per_node is None
    return ["node_limit" if limited else "link", nodes]


def groups_refusal(
    name: str, cluster: Cluster, num_experts: int, options: Options, *, names: Mapping[str, str],
    current_phy2log: NDArray[np.int64] | None = None, named: bool = True, when: str = "",
) -> FieldError | SolverError | None:
    """`solvers.registry.check` of solver `name` on an empty window of `num_experts` experts on the cluster
    (with the serving placement `current_phy2log`, if any), and, when it refuses a cluster with groups and
    nodes, again without them: None when the solver takes it; a FieldError naming the fields when the groups
    are what it refuses (names['solver'] when `named`, names['gpus_per_node'], names['num_groups'], and
    names['current_phy2log'] when the caller may drop its serving placement (names has the key, as the
    registry's message then offers it) and the groups without it are taken; its text `when` + the registry's);
    else the registry's SolverError. names: as `registry.check` (what the messages call options and cluster
    settings: the caller's JSON fields). A solver that needs the serving placement is not probed without one (a
    cluster may record what it serves first; the solve says so otherwise)."""
    caps = registry.get_solver(name).capabilities
    if caps.requires_current and current_phy2log is None:
        return None

    def probe(hierarchical: bool, current: bool = True) -> None:
        registry.check(name, Problem(
            np.zeros((1, num_experts)), cluster.slots_per_gpu,
            cluster.num_groups if hierarchical else None, cluster.gpus_per_node if hierarchical else None,
            current_phy2log=current_phy2log if current else None,
            coactivation=np.zeros((1, num_experts, num_experts)) if caps.coactivation else None),
            options, names=names)  # fmt: skip

    def takes(hierarchical: bool, current: bool = True) -> bool:
        try:
            probe(hierarchical, current)
        except SolverError:
            return False
        return True

    try:
        probe(True)
    except SolverError as exc:
        if cluster.num_groups is None or cluster.gpus_per_node is None or not takes(False):
            return exc  # refused for something else as well
        fields = [names.get(k, k) for k in ("gpus_per_node", "num_groups")]
        if named:
            fields = [names.get("solver", "solver"), *fields]
        current = names.get("current_phy2log")
        if current is not None and current_phy2log is not None and takes(True, current=False):
            fields.append(current)  # the registry's message offers dropping it: groups and current, not both
        return FieldError(fields, f"{when}{exc}")
    return None


def solve(
    loads: ArrayLike,
    cluster: Cluster,
    *,
    solver: str | None = None,
    cost: CostSetup | None = None,
    current: Placement | None = None,
    options: Options | None = None,
    split: str | None = None,
    scenarios: NDArray[np.float64] | None = None,
    stage_bytes: float | None = None,
    objective: str = "lb",
    coactivation: CoactivationSummary | None = None,
    empty_slots: bool = True,
    starting: Callable[[str], None] | None = None,
) -> Outcome:
    """Place every layer's experts with the registered solver `solver` (see `solvers.registry`).
    loads: [layers, E] tokens (an array, or lists; [steps, layers, E] is summed over steps; finite, >= 0 and at most
    `solvers.validation.MAX_LOAD` each: `eplb.io.windows.check_loads`, the CLI's and the service's rule, refuses
    others by name before any solver runs); options: the solver's knobs (time limits, move budget). Returns the
    validated placement, its balance next to the contiguous baseline, a lower bound, and the predicted
    time when `cost` is given. scenarios: [S, layers, E] recent sub-windows for `options.robust`.
    solver: default "incremental" when `current` is given, else "greedy". With `current`, the outcome
    carries the moves and the migration plan (stages of at most `stage_bytes` bytes each; needs `cost`
    for the bytes of one copy). objective: "lb" (the solver's) or "time" (per layer the candidate with
    the lowest predicted time, `eplb.objective`; needs `cost`). coactivation: the window's co-activation
    summary: the predicted comm counts one copy per GPU a token reaches, and the time objective may
    co-locate experts chosen together. empty_slots: whether the time objective may leave slots empty (one
    slot per expert); False where the placement will serve as the next `current` (deployments). starting:
    called with the solver's registry name once every input is checked, just before the solver runs (the CLI's
    progress line, so that no refusal follows it). EplbError for any input it refuses, naming it."""
    loads = check_loads(loads)
    check_shapes(loads, cluster)
    check_links(cost, cluster)
    check_objective(objective, cost, coactivation, loads)
    if current is not None:
        check_current(current, loads, cluster)
    started = time.perf_counter()
    base = solver if solver is not None else "incremental" if current is not None else "greedy"
    try:
        registry.get_solver(base)  # "" or a misspelt name is refused with the registered ones
    except SolverError as exc:
        raise EplbError(str(exc)) from None
    name = solver_name(base, split)
    check_uniform_shares(name, objective, split)
    if current is None:  # what asks for the serving placement says to give it as `current`
        try:
            registry.check_options(name, options or Options(), False, names=OPTION_ARGS)
            registry.check_current_given(name, False, names=OPTION_ARGS)
        except SolverError as exc:
            raise EplbError(str(exc)) from None
    problem = Problem(
        loads,
        cluster.slots_per_gpu,
        num_groups=cluster.num_groups,
        gpus_per_node=cluster.gpus_per_node,
        current_phy2log=None if current is None else current.phy2log,
        scenarios=scenarios,
        coactivation=solver_pairs(name, coactivation),
    )
    try:
        if starting is not None:
            registry.check(name, problem, options or Options())  # its refusals before the caller's output
            starting(name)
        solution = registry.solve(name, problem, options or Options())
    except InvalidPlacement:
        raise  # a solver bug, never the caller's fault
    except (SolverError, ValueError) as exc:
        raise EplbError(str(exc)) from None
    phy2log, shares = solution.phy2log, solution.shares
    info: dict[str, Any] = {"name": name, "status": solution.status}
    if objective == "time":
        assert cost is not None  # check_objective
        choice = choose_by_time(
            candidates(loads, phy2log, cluster.slots_per_gpu, coactivation=coactivation, scenarios=scenarios,
                       # global swaps would move groups off their nodes, and copy beyond a move budget
                       colocate=not problem.hierarchical and not _budgeted(options),
                       fewer_replicas=empty_slots and current is None and not problem.hierarchical,
                       nodes=cluster.gpus_per_node if cost.inter_node_bw is not None else None),
            lambda p2l: _predict(loads, Placement(p2l, cluster.slots_per_gpu, loads.shape[1]), cost,
                                 _reach(coactivation, p2l, cluster, cost), cluster.gpus_per_node).time_us,
        )
        phy2log = choice.phy2log
        validate_placement(phy2log, cluster.slots_per_gpu, loads.shape[1])  # an invalid candidate is a bug
        info.update(choice.info())
    if solution.layer_status is not None:
        info["layer_status"] = solution.layer_status
    info["layer_ms"] = solution.layer_ms
    info.update(solution.info)
    if solution.bound_tokens is not None:
        info["bound_tokens"] = solution.bound_tokens.tolist()
    moves = None
    if current is not None:
        if not registry.get_solver(name).capabilities.aligned:
            # GPUs move only with their node where nodes matter: expert groups kept on nodes, or the time
            # objective's co-location on nodes over two links
            on_nodes = objective == "time" and cost is not None and cost.inter_node_bw is not None
            nodes = cluster.gpus_per_node if cluster.num_groups is not None or on_nodes else None
            phy2log = relabel_gpus(phy2log, current.phy2log, cluster.slots_per_gpu, nodes)
        elif objective == "time":  # co-location swaps move experts between GPUs: back to their serving slots
            phy2log = arrange_slots(phy2log, current.phy2log, cluster.slots_per_gpu)
        idle = loads.sum(axis=1) == 0  # nothing to balance: a layer without tokens keeps its serving placement
        if idle.any():
            phy2log = np.where(idle[:, None], current.phy2log, phy2log)
            if shares is not None:
                shares = np.where(idle[:, None], current.slot_shares(), shares)
        moves = count_moves(phy2log, current.phy2log, cluster.slots_per_gpu)
    placement = Placement(phy2log, cluster.slots_per_gpu, loads.shape[1], shares,
                          layer_ids=None if current is None else current.layer_ids)  # the serving layers'
    outcome = evaluate(loads, placement, cost, coactivation=coactivation, gpus_per_node=cluster.gpus_per_node)
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
    if current is not None:
        try:
            outcome.plan = build_plan(
                current.phy2log, phy2log, cluster.slots_per_gpu, outcome.bytes_per_move, stage_bytes,
                cluster.gpus_per_node,
            )
        except PlanError as exc:
            raise EplbError(str(exc)) from None
    return outcome


def solver_pairs(name: str, coactivation: CoactivationSummary | None) -> NDArray[np.float64] | None:
    """`Problem.coactivation` for solver `name`: for a co-activation-aware one (greedy-coact) the window's pair
    counts [layers, E, E], exact when the summary was made from a token-level log, else the summary's estimate
    (`CoactivationSummary.pairs`); None for the others. EplbError naming the inputs when there is no summary."""
    if name not in registry.names() or not registry.get_solver(name).capabilities.coactivation:
        return None
    check_coactivation(name, coactivation)
    assert coactivation is not None
    return coactivation.pairs()


GIVE_COACTIVATION = ("pass coactivation=, the window's CoactivationSummary (eplb.coactivation.summarize of its "
                     "tokens' ids)")
"""How a caller of `solve` gives a co-activation-aware solver its data (`check_coactivation`'s default)."""


def check_coactivation(name: str, coactivation: CoactivationSummary | None,
                       names: Mapping[str, str] | None = None, give: str = GIVE_COACTIVATION) -> None:
    """A co-activation-aware solver (greedy-coact) without the window's summary is refused, saying where to give
    it: `give` (the CLI: its --coactivation flag), or, with the caller's names (the service's JSON:
    names.get('coactivation', 'coactivation')), a FieldError naming that field. The service and the CLI check
    before any solve; `solve` itself in its caller's words."""
    if coactivation is not None or name not in registry.names():
        return
    if not registry.get_solver(name).capabilities.coactivation:
        return
    lead = f"solver {name!r} needs the window's co-activation data"
    if names is None:
        raise EplbError(f"{lead}: {give}")
    field = names.get("coactivation", "coactivation")
    raise FieldError(field, f"{lead}: give {field}, the window's co-activation summary (docs/formats.md)")


def check_current(current: Placement, loads: NDArray[np.float64], cluster: Cluster) -> None:
    """A serving placement the solve can start from: the window's layers and experts, the cluster's slots per GPU,
    no empty slot (EplbError otherwise; the service checks it before any solve, naming its field)."""
    if current.num_experts != loads.shape[1] or current.num_layers != loads.shape[0]:
        raise EplbError(
            f"the current placement is for {current.num_layers} layers x {current.num_experts} experts, "
            f"the loads are {loads.shape[0]} x {loads.shape[1]}"
        )
    if current.slots_per_gpu.tolist() != cluster.slots_per_gpu.tolist():
        raise EplbError(
            f"the current placement is for {describe_slots(current.slots_per_gpu)}, the request asks for "
            f"{describe_slots(cluster.slots_per_gpu)}: moves are counted between placements of one cluster shape"
        )
    if current.empty_slots.any():
        layer, slot = (int(v) for v in np.argwhere(current.empty_slots)[0])
        raise EplbError(f"the current placement has empty slots (-1; layer {layer}, slot {slot}): give the placement "
                        "served after EP scaling finished, where every slot holds an expert")


def evaluate(
    loads: ArrayLike,
    placement: Placement,
    cost: CostSetup | None = None,
    *,
    coactivation: CoactivationSummary | None = None,
    gpus_per_node: int | None = None,
) -> Outcome:
    """Judge a placement on loads [layers, E] (checked as `solve` checks them): balance and predicted time, next to
    the baseline. With a co-activation summary, also the expected copies per token (GPUs and nodes of
    `gpus_per_node`), which the predicted comm then uses."""
    loads = placement_loads(check_loads(loads), placement)
    check_objective("lb", cost, coactivation, loads)
    base = contiguous_placement(placement.num_layers, placement.num_experts, placement.num_gpus)
    outcome = Outcome(placement, balance(loads, placement), balance(loads, base))
    q = q_base = None
    if coactivation is not None:
        from eplb.coactivation import reach

        node_limit = None if cost is None else cost.node_limit
        r, r_base = (reach(coactivation, p.phy2log, p.slots_per_gpu, gpus_per_node, node_limit)
                     for p in (placement, base))
        outcome.copies, outcome.baseline_copies = r.copies(), r_base.copies()
        q, q_base = _comm_reach(r, cost), _comm_reach(r_base, cost)
    if cost is not None:
        outcome.prediction = _predict(loads, placement, cost, q, gpus_per_node)
        outcome.baseline_prediction = _predict(loads, base, cost, q_base, gpus_per_node)
    return outcome


def _budgeted(options: Options | None) -> bool:
    """True when the solve has a move budget (the time objective's co-location swaps do not count copies)."""
    return options is not None and (options.max_moves is not None or options.max_moves_per_layer is not None)


def check_objective(
    objective: str,
    cost: CostSetup | None,
    coactivation: CoactivationSummary | None = None,
    loads: NDArray[np.float64] | None = None,
) -> None:
    """Raise EplbError for an unknown objective, a time objective without a model, or a co-activation
    summary of another shape than the loads [layers, E], or with no tokens in a layer the loads route."""
    if objective not in OBJECTIVES:
        raise EplbError(f"unknown objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    if objective == "time" and cost is None:
        raise EplbError("the time objective needs the model and hardware for the cost model (give --model)")
    if coactivation is not None and loads is not None and coactivation.loads.shape != loads.shape:
        raise EplbError(
            f"the co-activation summary is for {coactivation.loads.shape[0]} layers x {coactivation.loads.shape[1]} "
            f"experts, the loads are {loads.shape[0]} x {loads.shape[1]}"
        )
    if coactivation is not None and loads is not None:
        empty = np.flatnonzero((coactivation.tokens == 0) & (loads.sum(axis=1) > 0))
        if empty.size:
            raise EplbError(f"the co-activation summary has no tokens in layer {int(empty[0])}, which the loads "
                            "route: send the summary of the same window")


def _reach(
    coactivation: CoactivationSummary | None, phy2log: NDArray[np.int64], cluster: Cluster, cost: CostSetup
) -> NDArray[np.float64] | None:
    if coactivation is None:
        return None
    from eplb.coactivation import reach

    return _comm_reach(reach(coactivation, phy2log, cluster.slots_per_gpu, cluster.gpus_per_node, cost.node_limit),
                       cost)  # fmt: skip


def _comm_reach(r: Reach, cost: CostSetup | None) -> NDArray[np.float64]:
    """The reach the comm term takes: [L, G] each GPU's, with two links [L, G + N] each GPU's then each node's."""
    if cost is None or cost.inter_node_bw is None:
        return r.gpu
    return np.concatenate([r.gpu, r.node], axis=1)


def _predict(
    loads: NDArray[np.float64],
    placement: Placement,
    cost: CostSetup,
    reach: NDArray[np.float64] | None = None,
    gpus_per_node: int | None = None,
) -> LayerPrediction:
    empty = bool(placement.empty_slots.any())  # an empty slot (-1) serves nothing: share 0 on any expert id
    return predict(
        loads,
        placement.phy2log.clip(0) if empty else placement.phy2log,
        placement.slots_per_gpu,
        cost.model,
        cost.hardware,
        cost.link_bw,
        tokens_per_gpu=cost.tokens_per_gpu,
        shares=placement.slot_shares() if empty else placement.shares,
        overlap=cost.overlap,
        reach=reach,
        inter_node_bw=cost.inter_node_bw,
        gpus_per_node=gpus_per_node,
    )
