"""Worker side of the service: request bytes in, answer bytes out.

Everything CPU-bound about a request runs here, never in the event loop: JSON or .npy parsing and validating
15,000 numbers, solving, and writing the answer. A small request of a fast solver runs all of it in one go
(`placement_inline`) in the fast lane (api/inline.py: a thread of the server, or an idle solver process); a large
body is parsed in the parser process and every other job solved in a solver process. The event loop only moves
bytes and stays free for /healthz and the next client. Errors become problem-details answers naming the
field."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import orjson
import pydantic_core
from numpy.typing import NDArray
from pydantic import BaseModel, ValidationError

from api.problems import ProblemError, field_errors, field_problem, invalid, not_json, problem_body
from api.schemas import ClusterIn, CostIn, EvaluateRequest, PlacementIn, PlacementRequest
from eplb.budget import cluster_slots
from eplb.errors import EplbError, FieldError
from eplb.io.windows import check_loads
from eplb.npy import NpyError, read_npy
from eplb.placement import FORMAT as PLACEMENT_FORMAT
from eplb.placement import Placement
from eplb.rules import CLUSTER_FIELDS, work_fields, work_refusal
from eplb.schemas import SolverOut
from eplb.solve import (  # _balance_dict, _time_dict: the answer's rounding, shared with Outcome.to_model
    Cluster,
    CostSetup,
    Outcome,
    _balance_dict,
    _time_dict,
    check_cluster_fields,
    check_coactivation,
    check_current,
    check_links,
    check_uniform_shares,
    evaluate,
    groups_refusal,
    infer_model,
    least_stage_gib,
    link_fields,
    solve,
    solver_name,
    time_limited,
    window_refusal,
)
from eplb.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    all_to_all_links,
    service_preset,
)
from solvers import registry
from solvers.registry import Options

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Body:
    """A request body as received. kind: json (the whole request) or npy (the loads [layers, E] as a .npy
    array; `request` then holds the other fields as a JSON object). path: the route, for problem details."""

    data: bytes
    kind: Literal["json", "npy"]
    path: str
    request: str | None = None


@dataclass(frozen=True)
class SolveJob:
    """Everything a worker needs for one placement request (picklable). loads: [layers, E] tokens."""

    loads: NDArray[np.float64]
    cluster: Cluster
    solver: str
    cost: CostSetup | None
    current: Placement | None
    options: Options
    stage_bytes: float | None
    run_async: bool
    objective: str = "lb"
    coactivation: CoactivationSummary | None = None



@dataclass(frozen=True)
class Answer:
    """What a worker hands back: a JSON body (an answer or a problem) with its status, or the validated job, or
    a validated body (`parse_body`). For /metrics: the solver's wall time in seconds and lb (mean, max, baseline
    mean, baseline max)."""

    status: int
    body: bytes = b""
    job: SolveJob | None = None
    value: Any = None
    seconds: float = 0.0
    lb: tuple[float, float, float, float] | None = None
    solver: str | None = None  # set on a solved placement's answer


def work(job: SolveJob) -> int:
    """layers x slots x GPUs of a validated job: what a solve's time grows with (`eplb.rules.SERVICE_MAX_WORK`)."""
    slots = job.cluster.slots_per_gpu
    return int(job.loads.shape[0]) * int(slots.sum()) * int(slots.size)


def in_background(job: SolveJob, async_threshold_s: float) -> bool:
    """Whether a validated request runs as a job (asked for, or a time budget over the threshold)."""
    return job.run_async or (job.options.total_time_limit_s or 0) > async_threshold_s


# ----- worker entry points (called through api.pool) -------------------------------------------------------------


def parse_placement(body: Body, milp_default_time_limit_s: float) -> Answer:
    """POST /placement, first half (in the parser process): the validated job, or the problem with the body."""
    try:
        request, loads = parse(PlacementRequest, body)
        return Answer(200, job=solve_job(request, loads, milp_default_time_limit_s))
    except ProblemError as exc:
        return _problem(exc, body.path)


def placement_inline(body: Body, milp_default_time_limit_s: float, async_threshold_s: float,
                     inline: frozenset[str], inline_max_work: int) -> Answer:
    """POST /placement in the server's own threads (api/inline.py): parse and validate, then solve and serialize
    when the request is synchronous, its solver is one of `inline` and its `work` is at most `inline_max_work`;
    otherwise the validated job, for the solver processes."""
    parsed = parse_placement(body, milp_default_time_limit_s)
    job = parsed.job
    if (job is None or job.solver not in inline or job.objective != "lb" or in_background(job, async_threshold_s)
            or work(job) > inline_max_work):
        return parsed  # the time objective's candidates take longer, and so does a large solve: a solver process
    return answer_job(job, body.path)


@dataclass(frozen=True)
class Solved:
    """One solve of the service and what /metrics counts of it (`api.metrics.Metrics.solved`): its solver, wall
    time in seconds and lb (mean, max, baseline mean, baseline max; None when no layer has tokens)."""

    outcome: Outcome
    solver: str
    seconds: float
    lb: tuple[float, float, float, float] | None


def timed_solve(solver: str, **kwargs: Any) -> Solved:
    """`eplb.solve.solve` timed, in a solver process or the lane: every solve the service makes runs here (POST
    /placement's through `answer_job`, a deployment's windows through `api.routes.deployments`), so /metrics counts
    and times them alike."""
    started = time.perf_counter()
    outcome = solve(solver=solver, **kwargs)
    seconds = time.perf_counter() - started
    p, b = outcome.balance.lb_over_tokens(), outcome.baseline.lb_over_tokens()  # None: no layer has tokens
    lb = None if p is None or b is None else (round(p[0], 6), round(p[1], 6), round(b[0], 6), round(b[1], 6))
    return Solved(outcome, solver, seconds, lb)


def answer_job(job: SolveJob, path: str = "/placement") -> Answer:
    """POST /placement, second half (in a solver process): solve a validated job, answer with the JSON."""
    try:
        solved = timed_solve(
            job.solver,
            loads=job.loads,
            cluster=job.cluster,
            cost=job.cost,
            current=job.current,
            options=job.options,
            stage_bytes=job.stage_bytes,
            objective=job.objective,
            coactivation=job.coactivation,
        )
    except EplbError as exc:
        return _problem(field_problem(exc), path)
    return Answer(200, answer_json(solved.outcome), seconds=solved.seconds, lb=solved.lb, solver=solved.solver)


def parse_body(model: type[BaseModel], body: Body) -> Answer:
    """Any other route's JSON body (`api.routing.Route`, through `api.offload.parse_body`): the validated model as
    `value`, or the problem, as /placement's body is parsed (`parse`)."""
    try:
        return Answer(200, value=_validate(model, body.data))
    except ProblemError as exc:
        return _problem(exc, body.path)


def answer_evaluate(body: Body) -> Answer:
    """POST /evaluate: judge a given placement on a window."""
    try:
        request, loads = parse(EvaluateRequest, body)
        window = check_window(request.loads if loads is None else loads)
        cost = cost_setup(request, model_for(request.model, window))
        given = placement(request.placement, "placement", window.shape[1])
        if given.num_layers != window.shape[0]:
            raise FieldError("placement", f"has {given.num_layers} layers, the loads have {window.shape[0]}")
        if request.gpus_per_node is not None and given.num_gpus % request.gpus_per_node:
            raise FieldError("gpus_per_node", f"{request.gpus_per_node} does not divide the {given.num_gpus} GPUs")
        _check_links(cost, Cluster(given.slots_per_gpu, request.gpus_per_node), "gpus_per_node")
        outcome = evaluate(window, given, cost, coactivation=coactivation(request, window),
                           gpus_per_node=request.gpus_per_node)
    except ProblemError as exc:
        return _problem(exc, body.path)
    except EplbError as exc:
        return _problem(field_problem(exc), body.path)
    return Answer(200, answer_json(outcome))




# Outcome fields answer_json builds itself; any other that is set sends the outcome through the answer models
BUILT = frozenset({"placement", "balance", "baseline", "solver", "prediction", "baseline_prediction", "moves",
                   "bytes_per_move", "plan"})
SOLVER_FLOATS = frozenset({"wall_ms", "time_limit_s_per_layer"})  # float fields of SolverOut
SOLVER_FLOAT_LISTS = frozenset({"bound", "gap", "layer_ms"})


def answer_json(outcome: Outcome) -> bytes:
    """The answer's bytes: `orjson.dumps(outcome.to_model().to_json_dict())`, built straight from the outcome.

    The answer models validate and then dump every number of the placement (about 35,000 for 58 x 288 slots),
    a millisecond of a greedy request that takes six; here orjson writes the numpy arrays itself. The shape
    stays the models' (eplb/schemas.py): the same keys in the same order, the floats rounded by the same
    helpers, so the bytes are equal (tests/test_api.py compares them). Any outcome this does not cover (weighted
    shares, co-activation copies, a field it does not know, a solver fact that is not plain JSON) goes through
    the models."""
    solver = outcome.solver
    if (outcome.placement.shares is not None or any(getattr(outcome, f.name) is not None
                                                    for f in dataclasses.fields(outcome) if f.name not in BUILT)
            or not all(_plain(v) for v in solver.values())):
        return orjson.dumps(outcome.to_model().to_json_dict())
    p = outcome.placement
    predicted, baseline = _balance_dict(outcome.balance), _balance_dict(outcome.baseline)
    if outcome.prediction is not None and outcome.baseline_prediction is not None:
        predicted.update(_time_dict(outcome.prediction))
        baseline.update(_time_dict(outcome.baseline_prediction))
    predicted["baseline"] = baseline
    answer: dict[str, Any] = {
        "placement": {"format": PLACEMENT_FORMAT, "num_experts": p.num_experts, "num_gpus": p.num_gpus,
                      "slots_per_gpu": np.ascontiguousarray(p.slots_per_gpu, dtype=np.int64),
                      "phy2log": np.ascontiguousarray(p.phy2log, dtype=np.int64),
                      "replicas": np.ascontiguousarray(p.replicas, dtype=np.int64)},
        "predicted": predicted,
    }
    if solver:
        declared = SolverOut.model_fields
        out = {k: solver[k] for k in declared if solver.get(k) is not None}
        out.update((k, v) for k, v in solver.items() if k not in declared and v is not None)
        for k in SOLVER_FLOATS & out.keys():
            out[k] = float(out[k])
        for k in SOLVER_FLOAT_LISTS & out.keys():
            out[k] = [float(v) for v in out[k]]
        answer["solver"] = out
    if outcome.moves is not None:
        total = int(outcome.moves.sum())
        moves: dict[str, Any] = {"per_layer": outcome.moves.tolist(), "total": total}
        if outcome.bytes_per_move is not None:
            moves["bytes_moved"] = float(total * outcome.bytes_per_move)
        answer["moves"] = moves
    if outcome.plan is not None:
        answer["plan"] = outcome.plan.to_dict()
    return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)


def _plain(value: Any) -> bool:
    """A value orjson writes as pydantic's JSON mode would: str, int, float, bool, None, and lists of them."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def _problem(exc: ProblemError, path: str) -> Answer:
    return Answer(exc.status, problem_body(exc.status, exc.title, exc.detail, path, exc.errors))


# ----- parsing -----------------------------------------------------------------------------------------------


def parse(model: type[M], body: Body) -> tuple[M, NDArray[np.float64] | None]:
    """Validate a body against `model` (strict, unknown fields refused). For an npy body, also return its
    loads array; the model's own `loads` is then empty. Raises ProblemError: 400 for bytes that are not JSON or
    .npy, 422 naming the field otherwise."""
    if body.kind == "json":
        return _validate(model, body.data), None
    loads = _read_npy(body.data)
    try:  # read as the JSON body is (NaN, Infinity and big integers reach the fields' own checks)
        fields = pydantic_core.from_json(body.request or "{}")
    except ValueError as exc:
        raise ProblemError(400, "Bad request", f"the 'request' query parameter is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise invalid([{"field": "query.request", "message": "must be a JSON object of the request's fields"}])
    if "loads" in fields:
        raise invalid([{"field": "loads", "message": "given in the .npy body; leave it out of 'request'"}])
    return _validate(model, json.dumps({**fields, "loads": []}).encode()), loads  # json writes NaN back as NaN


def _validate(model: type[M], data: bytes) -> M:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        bad_json = next((e for e in errors if e["type"] == "json_invalid"), None)
        if bad_json is not None:
            raise not_json(bad_json["msg"]) from None
        raise invalid(field_errors(errors)) from None


def _read_npy(data: bytes) -> NDArray[np.float64]:
    """The npy body's loads as float64 (a copy: the image is read as a view of the body). The header is checked
    against the bytes that follow it before anything is allocated (eplb.npy)."""
    try:
        array = read_npy(data)
    except NpyError as exc:
        raise ProblemError(400, "Body is not .npy", f"the body is {exc}") from None
    if array.dtype.kind not in "iuf":
        message = f"the .npy array must hold integers or floats, not {array.dtype}"
        raise invalid([{"field": "loads", "message": message}])
    return array.astype(np.float64)


def check_window(value: Any) -> NDArray[np.float64]:
    """loads [layers, E] (or [steps, layers, E], summed), finite, >= 0; refused as a deployment's window is
    (`eplb.deployments.Setup.loads`): the text names the value, 'loads[0][1] is -2: loads must be >= 0'."""
    try:
        return check_loads(value, "loads")
    except EplbError as exc:
        raise FieldError("loads", str(exc), str(exc)) from None


# ----- request fields -> eplb objects ------------------------------------------------------------------------


def _spec(field: str, value: Any, presets: Mapping[str, Any]) -> Any:
    """A preset by name (`eplb.specs.service_preset`: case-insensitive, never a file path: this is a network
    service) or the spec object the request carried (already validated: ModelSpec and HardwareSpec are the
    request's schema)."""
    return service_preset(value, presets, field) if isinstance(value, str) else value


def model_for(value: Any, loads: NDArray[np.float64]) -> ModelSpec | None:
    """The named or given model, checked against the window (`ModelSpec.window_mismatch`: its experts, at most its
    MoE layers; `window_refusal`: in the words of a deployment's windows); absent: the preset with the window's
    expert count (and layer count when several match), as `eplb solve` does; None when none matches."""
    if value is None:
        return infer_model(loads.shape[1], loads.shape[0])
    model: ModelSpec = _spec("model", value, MODEL_PRESETS)
    why = window_refusal(model, *loads.shape)
    if why is not None:
        raise FieldError("loads", why)
    return model


def cost_setup(req: CostIn, model: ModelSpec | None) -> CostSetup | None:
    """The time prediction's setup (None without a model)."""
    hardware: HardwareSpec = _spec("hardware", req.hardware, HARDWARE_PRESETS)
    try:
        within, between = all_to_all_links(hardware, req.link)
    except EplbError as exc:
        raise FieldError("link", str(exc)) from None
    if model is None:
        return None
    return CostSetup(model, hardware, within, req.tokens_per_gpu, req.overlap, req.node_limit, between)


def _check_links(cost: CostSetup | None, the_cluster: Cluster, field: str) -> None:
    """A '+' link (or a node limit) without nodes, refused naming it and the GPUs per node (`field`), as a
    deployment's PUT does (`eplb.solve.link_fields`), before any solve (and before a job is queued)."""
    try:
        check_links(cost, the_cluster)
    except EplbError as exc:
        raise FieldError(link_fields(cost, the_cluster, field), str(exc)) from None


def coactivation(req: CostIn, window: NDArray[np.float64]) -> CoactivationSummary | None:
    """The request's co-activation summary, checked against the window [layers, E] (FieldError otherwise): as a
    deployment's window's (`CoactivationSummary.for_window`). A node_limit without one is refused: only the
    summary's copies per token are capped by it (a deployment's windows may bring theirs later)."""
    if req.coactivation is None:
        if req.node_limit is not None:
            raise FieldError(("node_limit", "coactivation"), "a node limit caps the nodes a token reaches: it needs "
                             "the window's co-activation summary (coactivation; docs/formats.md)")
        return None
    from eplb.coactivation import CoactivationSummary

    value = req.coactivation
    return CoactivationSummary.for_window(value if isinstance(value, str) else value.model_dump(), window)


def cluster(value: ClusterIn, model: ModelSpec | None, num_experts: int) -> Cluster:
    if value.memory_budget_bytes is not None and model is None:
        raise FieldError("model", f"memory_budget_bytes needs a model: no preset has {num_experts} experts")
    slots = cluster_slots(value, num_experts, None if model is None else model.expert_bytes_all_layers)
    return Cluster(slots, value.gpus_per_node, value.num_groups)


def placement(value: PlacementIn, field: str, num_experts: int) -> Placement:
    """A placement given for a window of `num_experts` experts (its `num_experts` the window's when unset)."""
    if value.num_experts is not None and value.num_experts != num_experts:  # before its ids are checked against it
        raise FieldError(f"{field}.num_experts", f"is {value.num_experts}, but the loads have {num_experts} experts")
    data = value.model_dump(exclude_none=True)
    data.setdefault("num_experts", num_experts)
    try:
        return Placement.from_dict(data, field)
    except EplbError as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field}: ")) from None


def _check_budgets(req: PlacementRequest, name: str, model: ModelSpec | None, num_experts: int) -> None:
    """time_limit_s for a solver without a time limit, and a stage_gib without the serving placement (no plan to
    stage) or that holds no expert copy: FieldError."""
    if req.time_limit_s is not None and "total_time_limit_s" not in registry.get_solver(name).options:
        able = time_limited("total_time_limit_s")
        raise FieldError("time_limit_s", f"solver {name!r} has no time limit: drop time_limit_s or choose a solver "
                         f"that has one ({', '.join(able)})")
    if req.stage_gib is None:
        return
    if req.current_placement is None:  # as a move budget without it (registry.check_options)
        raise FieldError("stage_gib", "a migration plan needs the serving placement (give current_placement)")
    if model is None:
        raise FieldError("stage_gib", f"needs a model: a stage is counted in expert copies (no preset matches the "
                         f"window's {num_experts} experts and layers)")
    least = least_stage_gib(model, req.stage_gib)
    if least is not None:
        raise FieldError("stage_gib", f"{req.stage_gib:g} GiB cannot hold one expert copy of {model.name}: give at "
                         f"least {least:g}")


GROUP_FIELDS = {**CLUSTER_FIELDS, "current_phy2log": "current_placement"}
"""What the registry's refusal of a hierarchical cluster calls its settings here (the CLI: its flags); a request,
unlike a deployment, may drop its current placement, and the refusal offers that too."""
SETTING_FIELDS = {"solver": "solver", "split": "split", "objective": "objective"}
"""What `eplb.solve`'s refusals of a share split call the settings here (the CLI: its flags, `SETTING_FLAGS`)."""


OPTION_FIELDS = {"total_time_limit_s": "time_limit_s", "max_lb_slack": "max_lb_slack", "max_moves": "max_moves",
                 "max_moves_per_layer": "max_moves_per_layer", "target_lb": "target_lb",
                 "current_phy2log": "current_placement"}
"""The request's field of each solver option it sets (`solve_job`), and of the serving placement, for the registry's
messages: they name these fields, and offer no option the request cannot set (the MILP's per-layer time_limit_s,
robust)."""


def _check_solver(name: str, named: bool, the_cluster: Cluster, current: Placement | None, options: Options,
                  window: NDArray[np.float64]) -> None:
    """What the solve would refuse, refused before any solve or job naming the request's fields, as a deployment's
    PUT does: a current placement of another shape (current_placement; `eplb.solve`'s own check), options the
    solver does not take or cannot honour (the options given: the registry's `check_options`), a hierarchical
    cluster the solver cannot honour (the solver, when the request named it, cluster.gpus_per_node,
    cluster.num_groups: `eplb.solve.groups_refusal`), any other cluster it cannot honour (solver), no current
    placement for a solver that rebalances one (solver, current_placement)."""
    try:
        if current is not None:
            check_current(current, window, the_cluster)
    except EplbError as exc:
        raise field_problem(FieldError("current_placement", str(exc), str(exc))) from None
    try:
        registry.check_options(name, options, current is not None, names=OPTION_FIELDS)
    except registry.SolverError as exc:
        fields = [OPTION_FIELDS.get(option, option) for option in exc.options]
        raise field_problem(FieldError(fields or ["solver"], str(exc), str(exc))) from None
    if current is None and registry.get_solver(name).capabilities.requires_current:
        message = (f"solver {name!r} rebalances a serving placement: give current_placement (the placement the "
                   f"cluster serves), or choose another solver")
        raise field_problem(FieldError(["solver", "current_placement"], message, message))
    refused = groups_refusal(name, the_cluster, window.shape[1], options, names=GROUP_FIELDS, named=named,
                             current_phy2log=None if current is None else current.phy2log)
    if isinstance(refused, FieldError):
        raise field_problem(refused)
    if refused is not None:
        raise field_problem(FieldError("solver", str(refused), str(refused)))


def solve_job(req: PlacementRequest, loads: NDArray[np.float64] | None, milp_default_time_limit_s: float) -> SolveJob:
    """Validate a placement request into a SolveJob (loads: the npy body's array, else the request's).
    Raises ProblemError naming the bad field."""
    try:
        window = check_window(req.loads if loads is None else loads)
        model = model_for(req.model, window)
        cost = cost_setup(req, model)
        the_cluster = cluster(req.cluster, model, window.shape[1])
        too_large = work_refusal(window.shape[0], int(the_cluster.slots_per_gpu.sum()), the_cluster.num_gpus)
        if too_large is not None:  # before any solve or job: no time limit caps the greedy kernels
            raise FieldError(work_fields(req.cluster), too_large)
        check_cluster_fields(window.shape[1], the_cluster)  # nodes and groups that do not divide: by name, as PUT
        _check_links(cost, the_cluster, "cluster.gpus_per_node")
        current = None
        if req.current_placement is not None:
            current = placement(req.current_placement, "current_placement", window.shape[1])
        name = solver_name(req.solver or ("incremental" if current is not None else "greedy"), req.split,
                           names=SETTING_FIELDS)
        if name not in registry.names():
            raise FieldError("solver", f"unknown solver {name!r}: choose one of {', '.join(registry.names())}")
        if req.objective == "time" and cost is None:
            raise FieldError("objective", "time needs a model for the cost model: give model (no preset has "
                             f"{window.shape[1]} experts)")
        check_uniform_shares(name, req.objective, req.split, names=SETTING_FIELDS)  # before any solve or job
        summary = coactivation(req, window)
        check_coactivation(name, summary, names=SETTING_FIELDS)  # before any solve or job, naming the field
        _check_budgets(req, name, model, window.shape[1])
    except EplbError as exc:
        raise field_problem(exc) from None
    milp = "time_limit_s" in registry.get_solver(name).options
    limit = req.time_limit_s if req.time_limit_s is not None or not milp else milp_default_time_limit_s
    options = Options(
        total_time_limit_s=limit,
        max_lb_slack=req.max_lb_slack,
        max_moves=req.max_moves,
        max_moves_per_layer=req.max_moves_per_layer,
        target_lb=req.target_lb,
    )
    _check_solver(name, req.solver is not None, the_cluster, current, options, window)
    stage_bytes = None if req.stage_gib is None else req.stage_gib * 2**30
    return SolveJob(window, the_cluster, name, cost, current, options, stage_bytes, req.run_async, req.objective,
                    summary)
