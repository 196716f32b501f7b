"""POST /placement and POST /evaluate. A small body (at most EPLB_INLINE_MAX_BYTES) is parsed and validated in
the server's in-process lane (api/inline.py); a synchronous request for one of EPLB_INLINE_SOLVERS, of at most
EPLB_INLINE_MAX_WORK layers x slots x GPUs, is solved and serialized there too, in the same thread. Any other
validated job goes to a solver process (api/pool.py); a larger body is parsed in the parser process first. This
side only checks the Content-Type and moves bytes, so the event loop stays free. (/evaluate runs whole in the lane,
or in a solver process for a large body.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from api import convert
from api.deps import Authorized, InlineDep, JobsDep, MetricsDep, ParsersDep, PoolDep, SettingsDep
from api.jobs import JobWork, TooManyJobs
from api.metrics import Metrics
from api.offload import busy, in_lane, in_pool, inline
from api.pool import SolvePool
from api.problems import PROBLEM, ProblemError, documented
from api.routing import JSON, NPY, Route, is_json, media_type, unsupported
from api.schemas import EvaluateRequest, Job, PlacementRequest
from api.settings import Settings
from eplb.errors import FieldError
from eplb.schemas import PlacementResponse

router = APIRouter(tags=["placement"], dependencies=Authorized, route_class=Route)
RequestFields = Annotated[
    str | None,
    Query(alias="request", description="with an application/x-npy body (the loads): the request's other "
          "fields as a JSON object, e.g. {\"cluster\": {\"num_gpus\": 32}}"),
]


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody: the model as JSON, or the loads as a .npy array (`api.app` adds the model's
    schema to the components)."""
    return {"requestBody": {"required": True, "content": {
        JSON: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}},
        NPY: {"schema": {"type": "string", "format": "binary",
                         "description": "loads [layers, E] as a NumPy .npy array (integers or floats)"}},
    }}}


async def read_body(request: Request, fields: str | None) -> convert.Body:
    """The body and its kind; 415 for any Content-Type but JSON and .npy (`api.routing`, every route's check), 422
    for `?request=` with a JSON body or given twice."""
    content_type = media_type(request)
    given = len(request.query_params.getlist("request"))
    if given > 1:  # a query parameter read once: the framework kept the last and dropped the rest unseen
        raise FieldError("query.request", f"given {given} times: give the request's other fields once, as one JSON "
                         "object")
    if is_json(content_type):
        if fields is not None:
            raise FieldError("query.request", "only with an application/x-npy body")
        return convert.Body(await request.body(), "json", request.url.path)
    if content_type == NPY:
        return convert.Body(await request.body(), "npy", request.url.path, fields)
    raise unsupported(content_type, NPY)


def respond(answer: convert.Answer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type=JSON if answer.status < 400 else PROBLEM)


@router.post(
    "/placement",
    response_model=PlacementResponse,
    response_model_exclude_none=True,
    summary="Compute a placement for a load window",
    openapi_extra=body_doc(PlacementRequest),
    responses={202: {"model": Job, "description": "accepted as a job; poll Location"},
               **documented(400, 401, 413, 415, 422, 500, 503)},
)
async def placement(request: Request, settings: SettingsDep, pool: PoolDep, parsers: ParsersDep, lane: InlineDep,
                    jobs: JobsDep, metrics: MetricsDep, fields: RequestFields = None) -> Response:
    body = await read_body(request, fields)
    if inline(settings, body):
        parsed = await in_lane(lane, settings, convert.placement_inline, body=body,
                               milp_default_time_limit_s=settings.milp_default_time_limit_s,
                               async_threshold_s=settings.async_threshold_s, inline=settings.inline,
                               inline_max_work=settings.inline_max_work)
    else:
        parsed = await in_pool(parsers, settings, convert.parse_placement, body=body,
                               milp_default_time_limit_s=settings.milp_default_time_limit_s)
    job = parsed.job
    if job is None:  # a problem, or solved in the lane
        return respond(solved(parsed, metrics))
    if not convert.in_background(job, settings.async_threshold_s):
        return respond(solved(await in_pool(pool, settings, convert.answer_job, job=job), metrics))
    if not pool.has_room():
        raise busy(settings)
    try:
        accepted = await jobs.submit(background(job, pool, settings, metrics))
    except TooManyJobs:
        raise ProblemError(503, "Too many jobs", f"{settings.max_jobs} jobs are queued or running; retry later",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
    return Response(orjson.dumps(accepted.model_dump(mode="json", exclude_none=True)), status_code=202,
                    media_type=JSON, headers={"Location": f"/jobs/{accepted.id}"})


def solved(answer: convert.Answer, metrics: Metrics) -> convert.Answer:
    """Count a solved placement in /metrics; return the answer."""
    if answer.status == 200 and answer.solver is not None:
        metrics.solved(answer.solver, answer.seconds, answer.lb)
    return answer


def background(job: convert.SolveJob, pool: SolvePool, settings: Settings, metrics: Metrics) -> JobWork:
    """A validated solve as work for the job store."""
    token = pool.token()

    async def run(started: Callable[[], None]) -> dict[str, Any]:
        answer = await in_pool(pool, settings, convert.answer_job, token, started, job=job)
        data: dict[str, Any] = orjson.loads(answer.body)
        if answer.status != 200:
            raise ProblemError(answer.status, data["title"], data["detail"], errors=data.get("errors"))
        metrics.solved(job.solver, answer.seconds, answer.lb)
        return data

    return JobWork(run=run, cancel=lambda: pool.cancel(token))


@router.post(
    "/evaluate",
    response_model=PlacementResponse,
    response_model_exclude_none=True,
    summary="Balance and predicted time of a given placement",
    openapi_extra=body_doc(EvaluateRequest),
    responses=documented(400, 401, 413, 415, 422, 500, 503),
)
async def evaluate(request: Request, settings: SettingsDep, pool: PoolDep, lane: InlineDep,
                   fields: RequestFields = None) -> Response:
    body = await read_body(request, fields)
    if inline(settings, body):
        return respond(await in_lane(lane, settings, convert.answer_evaluate, body=body))
    return respond(await in_pool(pool, settings, convert.answer_evaluate, body=body))
