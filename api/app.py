"""The placement service: `create_app()` builds the FastAPI app (`eplb serve` runs it with uvicorn)."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import convert
from api.metrics import Metrics
from api.pool import QueueFull, SolvePool, TaskCancelled, WorkerDied
from api.schemas import EvaluateRequest, Job, JobStatus, PlacementRequest, PlacementResponse, Problem
from api.settings import Settings
from eplb.errors import EplbError
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS

PROBLEM = "application/problem+json"


class ProblemError(Exception):
    """Raised by routes; rendered as RFC 9457 problem details."""

    def __init__(
        self, status: int, title: str, detail: str, headers: dict[str, str] | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail, self.headers, self.errors = status, title, detail, headers, errors


def problem_response(
    status: int, title: str, detail: str, instance: str | None = None, headers: dict[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, instance=instance, errors=errors)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM, headers=headers)


@dataclass
class JobRecord:
    id: str
    token: int
    created_at: float
    status: JobStatus = "queued"
    finished_at: float | None = None
    result: dict[str, Any] | None = None
    error: Problem | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def view(self) -> Job:
        result = None if self.result is None else PlacementResponse.model_validate(self.result)
        return Job(id=self.id, status=self.status, created_at=self.created_at,
                   finished_at=self.finished_at, result=result, error=self.error)


class BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get 413 before the app reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(
            413, "Request body too large", f"the body exceeds {self.limit} bytes (EPLB_MAX_BODY_BYTES)",
            instance=scope.get("path"),
        )
        await response(scope, receive, send)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is not valid JSON"},
    413: {"model": Problem, "description": "request body too large"},
    422: {"model": Problem, "description": "invalid input; `errors` names the fields"},
}
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {401: {"model": Problem, "description": "missing or wrong API key"}}
BUSY_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": Problem, "description": "every solver is busy and the queue is full; retry after Retry-After"},
    500: {"model": Problem, "description": "the solver failed"},
}


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; settings default to the environment (EPLB_*)."""
    settings = settings or Settings()
    metrics = Metrics()
    pool = SolvePool(settings.solver_workers, settings.queue_limit)
    jobs: dict[str, JobRecord] = {}
    tokens = itertools.count(1)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            for record in jobs.values():
                if record.task is not None:
                    record.task.cancel()
            await pool.close()

    app = FastAPI(
        title="eplb",
        version="0.1.0",
        summary="Expert placement for Mixture-of-Experts inference",
        description="POST the per-expert loads a serving cluster saw over a window; get back which logical "
        "expert sits in every physical slot of every GPU, with the predicted load balance (lb = busiest GPU / "
        "mean GPU) and per-layer time, next to the no-EPLB baseline. Errors are RFC 9457 problem details.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.pool, app.state.metrics, app.state.jobs = settings, pool, metrics, jobs

    # ----- errors -------------------------------------------------------------------------------------------
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(exc.status, exc.title, exc.detail, request.url.path, exc.headers, exc.errors)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            errors.append({"field": ".".join(loc) or "body", "message": err.get("msg", "invalid")})
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
        return problem_response(422, "Invalid request", detail, request.url.path, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem_response(exc.status_code, str(exc.detail), str(exc.detail), request.url.path,
                                getattr(exc, "headers", None))

    @app.exception_handler(EplbError)
    async def _eplb(request: Request, exc: EplbError) -> JSONResponse:
        errors = None
        if isinstance(exc, convert.FieldError):
            errors = [{"field": exc.field, "message": exc.message}]
        return problem_response(422, "Invalid request", str(exc), request.url.path, errors=errors)

    @app.middleware("http")
    async def _measure(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.request(path, request.method, response.status_code, time.perf_counter() - started)
        return response

    # ----- auth ---------------------------------------------------------------------------------------------
    async def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            raise ProblemError(401, "Unauthorized", "send 'Authorization: Bearer <key>' with the service's API key",
                               headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_key)]

    # ----- solving ------------------------------------------------------------------------------------------
    def busy() -> ProblemError:
        return ProblemError(503, "Service busy", "every solver worker is busy and the wait queue is full",
                            headers={"Retry-After": str(settings.retry_after_s)})

    async def run(job: convert.SolveJob, token: int) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            raw = await pool.submit(convert.run_solve_job, token, job=job)
        except QueueFull:
            raise busy() from None
        except WorkerDied as exc:
            raise ProblemError(500, "Solver failed", f"the solver process died: {exc}") from None
        except RuntimeError as exc:
            raise ProblemError(500, "Solver failed", str(exc)) from None
        # one serialization for the synchronous answer and a job's result, so the two bodies are identical
        result: dict[str, Any] = PlacementResponse.model_validate(raw).model_dump(mode="json", exclude_none=True)
        metrics.solved(job.solver, time.perf_counter() - started, result)
        return result

    def expire_jobs() -> None:
        now = time.time()
        expired = [k for k, r in jobs.items() if r.finished_at is not None and now - r.finished_at > settings.job_ttl_s]
        for key in expired:
            del jobs[key]

    async def run_job(record: JobRecord, job: convert.SolveJob) -> None:
        record.status = "running"
        try:
            record.result = await run(job, record.token)
            record.status = "done"
        except TaskCancelled:
            record.status = "cancelled"
        except asyncio.CancelledError:
            record.status = "cancelled"
        except ProblemError as exc:
            record.status = "failed"
            record.error = Problem(title=exc.title, status=exc.status, detail=exc.detail)
        except EplbError as exc:
            record.status = "failed"
            record.error = Problem(title="Invalid request", status=422, detail=str(exc))
        finally:
            record.finished_at = time.time()

    @app.post(
        "/placement",
        response_model=PlacementResponse,
        response_model_exclude_none=True,
        status_code=200,
        responses={202: {"model": Job, "description": "accepted as a job; poll Location"},
                   **ERROR_RESPONSES, **AUTH_RESPONSES, **BUSY_RESPONSES},
        summary="Compute a placement for a load window",
        dependencies=auth,
    )
    async def placement(body: PlacementRequest) -> Any:
        job = convert.solve_job(body, settings.milp_default_time_limit_s)
        long_milp = job.solver == "milp" and (job.time_limit_s or 0) > settings.async_threshold_s
        if not (body.run_async or long_milp):
            return await run(job, next(tokens))
        expire_jobs()
        if len(jobs) >= settings.max_jobs:
            raise ProblemError(503, "Too many jobs", f"{settings.max_jobs} jobs are kept; retry when some expire",
                               headers={"Retry-After": str(settings.retry_after_s)})
        if not pool.has_room():
            raise busy()
        record = JobRecord(uuid.uuid4().hex, next(tokens), time.time())
        jobs[record.id] = record
        record.task = asyncio.create_task(run_job(record, job))
        location = f"/jobs/{record.id}"
        accepted = record.view().model_dump(mode="json", exclude_none=True)
        return JSONResponse(accepted, status_code=202, headers={"Location": location})

    def find_job(job_id: str) -> JobRecord:
        expire_jobs()
        record = jobs.get(job_id)
        if record is None:
            raise ProblemError(404, "No such job", f"job {job_id!r} does not exist or has expired")
        return record

    not_found: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "unknown or expired job"}}

    @app.get("/jobs/{job_id}", response_model=Job, response_model_exclude_none=True, responses=not_found,
             summary="Status and result of a job")
    async def get_job(job_id: str) -> Job:
        return find_job(job_id).view()

    @app.delete("/jobs/{job_id}", response_model=Job, response_model_exclude_none=True,
                responses={**not_found, **AUTH_RESPONSES},
                summary="Cancel a job", dependencies=auth)
    async def cancel_job(job_id: str) -> Job:
        record = find_job(job_id)
        if record.status in ("queued", "running"):
            if not pool.cancel(record.token) and record.task is not None:
                record.task.cancel()
            record.status = "cancelled"
            record.finished_at = time.time()
        return record.view()

    @app.post("/evaluate", response_model=PlacementResponse, response_model_exclude_none=True,
              responses={**ERROR_RESPONSES, **AUTH_RESPONSES},
              summary="Balance and predicted time of a given placement", dependencies=auth)
    async def evaluate(body: EvaluateRequest) -> Any:
        return await asyncio.to_thread(convert.run_evaluate, body)

    @app.get("/presets", summary="Model and hardware presets")
    async def presets() -> dict[str, Any]:
        return {
            "models": {name: spec.to_dict() for name, spec in MODEL_PRESETS.items()},
            "hardware": {name: spec.to_dict() for name, spec in HARDWARE_PRESETS.items()},
        }

    @app.get("/healthz", summary="The process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Solvers are ready and the queue has room",
             responses={503: {"model": Problem, "description": "not ready"}})
    async def readyz() -> Any:
        if not pool.has_room():
            return problem_response(503, "Not ready", "the solver queue is full", "/readyz",
                                    {"Retry-After": str(settings.retry_after_s)})
        return {"status": "ready", "workers": pool.size, "running": pool.running, "waiting": pool.waiting}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    for status, response in op.get("responses", {}).items():
                        content = response.get("content", {})
                        if status.isdigit() and int(status) >= 400 and "application/json" in content:
                            content[PROBLEM] = content.pop("application/json")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
