"""Deployments: register a serving cluster, send it load windows, read its history, record what it applied.
The domain logic is `eplb.deployments`; this module maps it onto HTTP. The database is `api.database.get_db`;
window solves run in the service's solver pool while the deployment's lock is held."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from api import convert
from api.database import DbDep, in_db
from api.deps import Authorized, MetricsDep, PoolDep, SettingsDep
from api.metrics import Metrics
from api.offload import in_pool
from api.pool import SolvePool
from api.problems import ProblemError, documented
from api.routing import Route
from api.schemas import AppliedIn, WindowIn
from api.settings import Settings
from eplb import deployments
from eplb.deployments import (
    DeploymentConfig,
    DeploymentUpdate,
    DeploymentView,
    HistoryEntry,
    HistoryPage,
    NotFound,
    WindowResult,
)
from eplb.errors import EplbError, FieldError
from eplb.io.exports import checked_layer_ids, parse_layer_ids, to_sglang, to_trtllm, to_vllm_ascend
from eplb.io.files import plural
from eplb.placement import Placement
from eplb.rules import DEPLOYMENT_NAME_RULE, HISTORY_PAGE_MAX, MAX_HISTORY_ID, name_refusal
from eplb.solve import Outcome
from eplb.specs import model_preset
from eplb.store import Conflict, Store

MAX_ID = MAX_HISTORY_ID
"""The largest history id the store holds (`eplb.rules.MAX_HISTORY_ID`): a larger `before` is a 422."""
router = APIRouter(prefix="/deployments", tags=["deployments"], dependencies=Authorized, route_class=Route)


class DeploymentList(BaseModel):
    deployments: list[DeploymentView]


def _deployment_name(name: str) -> str:
    """The path's deployment name; one no deployment can have is a 422 naming `path.name` (`eplb.rules.name_refusal`'s
    text, the CLI's and the client's), before anything is read, as FastAPI names the query's parameters
    (`query.limit`)."""
    refused = name_refusal(name)
    if refused is not None:
        raise FieldError("path.name", DEPLOYMENT_NAME_RULE, refused)
    return name


DeploymentName = Annotated[str, Depends(_deployment_name)]


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking `eplb.deployments` call in the database threads; NotFound becomes 404, a write that lost to
    concurrent ones every attempt (`eplb.store.Conflict`) 409 (EplbError 422)."""
    try:
        return await in_db(fn, *args, **kwargs)
    except NotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from None
    except Conflict as exc:
        raise ProblemError(409, "Conflict", str(exc)) from None


def _pool_solver(pool: SolvePool, settings: Settings, metrics: Metrics,
                 loop: asyncio.AbstractEventLoop) -> Callable[..., Outcome]:
    """`eplb.solve.solve` run in the solver pool as POST /placement's solves run (`api.convert.timed_solve`, its
    failures the same problems: `api.offload.in_pool`) and counted in /metrics as they are, callable from the thread
    that holds the deployment's lock."""

    def run(**kwargs: Any) -> Outcome:
        solved: convert.Solved = asyncio.run_coroutine_threadsafe(
            in_pool(pool, settings, convert.timed_solve, **kwargs), loop).result()
        metrics.solved(solved.solver, solved.seconds, solved.lb)
        return solved.outcome

    return run


@router.get("", response_model=DeploymentList, response_model_exclude_none=True, responses=documented(401),
            summary="Every registered deployment")
async def list_deployments(db: DbDep) -> DeploymentList:
    return DeploymentList(deployments=await _call(deployments.list_all, db))


@router.put("/{name}", response_model=DeploymentUpdate, response_model_exclude_none=True,
            responses={201: {"model": DeploymentUpdate, "description": "registered"},
                       **documented(401, 404, 409, 422)},
            summary="Register a deployment, or update its config (history stays; the serving placement too unless "
                    "the new shape no longer fits it: `placement_dropped` then says so)")
async def put_deployment(name: DeploymentName, body: DeploymentConfig, db: DbDep,
                         response: Response) -> DeploymentUpdate:
    update: DeploymentUpdate
    update, created = await _call(deployments.register, db, name, body)  # `created`, `placement_dropped`: as locked
    response.status_code = 201 if created else 200
    return update


def model_layers(config: DeploymentConfig, placement: Placement,
                 given: str | None) -> tuple[list[int] | None, int | None]:
    """The model layer of each placement row, and the model's layer count, for the SGLang and TensorRT-LLM
    exports (SGLang's rows and TensorRT-LLM's keys are model layers, dense ones included), as `eplb export` takes
    them from a placement file's layer_ids: `given` (the `layer_ids` query, e.g. 3-60); else, when the placement
    has the model's MoE layer count, the preset's MoE layers (after its `first_dense_layers`: DeepSeek-V3's 3..60
    of 61, as `eplb export` writes them); else None, None (the rows are the placement's own, 0..L-1: windows of
    a part of the model name no layers). `given` is bounded: at most one id per placement layer (counted before
    a range is expanded), each below the model's layer count; a 422 naming layer_ids otherwise."""
    model = model_preset(config.model)  # a stored config names a preset (Setup refuses any other name)
    total = placement.num_layers if model is None else model.num_model_layers
    if given is None:
        if model is not None and placement.num_layers == model.num_moe_layers:
            return model.moe_layer_ids(), total
        return None, None
    try:
        ids = checked_layer_ids(parse_layer_ids(given, placement.num_layers, total), placement.num_layers)
    except FieldError as exc:  # the library names its argument, layer_ids
        raise _layer_ids_error(exc.message) from None
    except EplbError as exc:
        raise _layer_ids_error(str(exc).removeprefix("layer ids: ")) from None
    dense = model.first_dense_layers if model is not None else 0
    first = next((i for i in ids if i < dense), None)
    if model is not None and first is not None:  # a MoE layer's map on a dense layer: the MoE layer's own lost
        layers = "0" if dense == 1 else f"0-{dense - 1}"
        raise _layer_ids_error(f"layer {first} is dense: model {model.name!r} has {plural(dense, 'dense layer')} "
                               f"({layers}) before its MoE layers {dense}-{total - 1}")
    return ids, total


def _layer_ids_error(message: str) -> FieldError:
    return FieldError("query.layer_ids", message)


@router.get("/{name}", response_model=DeploymentView, response_model_exclude_none=True,
            responses={200: {"description": "the deployment, or its current placement in `format`"},
                       **documented(401, 404, 422)},
            summary="Config and current placement (or the placement exported for a serving system)")
async def get_deployment(
    name: DeploymentName, db: DbDep,
    format: Annotated[Literal["sglang", "trtllm", "vllm-ascend"] | None, Query(
        description="export the current placement for this serving system instead")] = None,
    layer_ids: Annotated[str | None, Query(max_length=10_000, description="with format sglang or trtllm: the model "
                                           "layer of each placement layer, e.g. 3-60 or 0,1,5-7 (default: the "
                                           "model preset's MoE layers, dense layers first, when the placement "
                                           "has all of them)")] = None,
) -> Any:
    view: DeploymentView = await _call(deployments.get, db, name)
    if format is None:
        if layer_ids is not None:
            raise _layer_ids_error("only with format=sglang or format=trtllm")
        return view
    if view.placement is None:
        raise ProblemError(404, "Not found", f"deployment {name!r} has no placement yet: send a window first")
    placement = Placement.from_dict(view.placement.model_dump(exclude_none=True))
    if format == "vllm-ascend":  # its map is indexed by MoE layer
        if layer_ids is not None:
            raise _layer_ids_error("only with format=sglang or format=trtllm (vllm-ascend indexes MoE layers)")
        return _exported(to_vllm_ascend, placement)
    ids, total = model_layers(view.config, placement, layer_ids)
    if format == "sglang":
        return _exported(to_sglang, placement, ids, total)
    return _exported(to_trtllm, placement, ids)


def _exported(export: Callable[..., dict[str, Any]], *args: Any) -> JSONResponse:
    """The export's JSON; a placement the serving system cannot express is a 422 naming `query.format`."""
    try:
        return JSONResponse(export(*args))
    except EplbError as exc:
        raise FieldError("query.format", str(exc)) from None


@router.delete("/{name}", status_code=204, responses=documented(401, 404, 422),
               summary="Retire a deployment and its history")
async def delete_deployment(name: DeploymentName, db: DbDep) -> Response:
    await _call(deployments.retire, db, name)
    return Response(status_code=204)


@router.post("/{name}/windows", response_model=WindowResult, response_model_exclude_none=True,
             responses=documented(401, 404, 422, 500, 503),
             summary="Send a load window: rebalance when the deployment's trigger fires, else 'kept' and why (the "
                     "last window sent again, nothing changed since: its answer again, nothing stored)")
async def post_window(name: DeploymentName, body: WindowIn, db: DbDep, pool: PoolDep,
                      settings: SettingsDep, metrics: MetricsDep) -> WindowResult:
    solver = _pool_solver(pool, settings, metrics, asyncio.get_running_loop())
    result: WindowResult = await _call(_process_window, db, name, body, solver)
    return result


def _process_window(db: Store, name: str, body: WindowIn, solver: Callable[..., Outcome]) -> WindowResult:
    """`eplb.deployments.process_window` of a window's body, in the database threads (its dumps too: a window's
    arrays are hundreds of thousands of numbers, never handled in the event loop)."""
    value = body.coactivation
    coactivation = value if value is None or isinstance(value, str) else value.model_dump()
    current = None if body.current_placement is None else body.current_placement.model_dump(exclude_none=True)
    return deployments.process_window(db, name, body.loads, force=body.force, run_solve=solver,
                                      coactivation=coactivation, current_placement=current)


@router.get("/{name}/history", response_model=HistoryPage, response_model_exclude_none=True,
            responses=documented(401, 404, 422), summary="The deployment's events, newest first, paged")
async def get_history(
    name: DeploymentName, db: DbDep,
    limit: Annotated[int, Query(ge=1, le=HISTORY_PAGE_MAX, description="entries per page")] = 50,
    before: Annotated[int | None, Query(ge=1, le=MAX_ID,
                                        description="entries older than this id (a page's `next`)")] = None,
) -> HistoryPage:
    page: HistoryPage = await _call(deployments.history, db, name, limit, before)
    return page


@router.post("/{name}/placement", response_model=HistoryEntry, response_model_exclude_none=True,
             responses=documented(401, 404, 422),
             summary="Record the placement the cluster applied (it becomes the current placement; the one already "
                     "serving records nothing and answers the entry that made it serve)")
async def post_applied(name: DeploymentName, body: AppliedIn, db: DbDep) -> HistoryEntry:
    entry: HistoryEntry = await _call(_record_applied, db, name, body)
    return entry


def _record_applied(db: Store, name: str, body: AppliedIn) -> HistoryEntry:
    """`eplb.deployments.record_applied` of the body's placement, dumped in the database threads too."""
    return deployments.record_applied(db, name, body.placement.model_dump(exclude_none=True))
