"""The placement service: `create_app()` builds the FastAPI app (`eplb serve` runs it with uvicorn).

Layout (FastAPI's full-stack template): routes are APIRouter modules in api/routes/ (placement, jobs, meta);
the objects they share (settings, solver pool, parser process, in-process lane, job store, metrics) are
dependencies in api/deps.py, kept on `app.state`; api/middleware.py checks the API key and the body size before
any body is read; api/convert.py is the worker side (parse and validate, solve and serialize: in the in-process
lane for small requests of fast solvers, else in the parser and solver processes); api/problems.py renders every
error as RFC 9457 problem details."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.inline import FastLane
from api.jobs import JobStore, MemoryJobStore
from api.metrics import Metrics
from api.middleware import Gate
from api.pool import SolvePool, warm_parser
from api.problems import ERRORS, PROBLEM, install_handlers
from api.routes import deployments, jobs, meta, placement
from api.schemas import EvaluateRequest, PlacementRequest
from api.settings import Settings
from solvers import registry

PARSE_QUEUE = 64  # request bodies that may wait for the parser process before 503


def create_app(settings: Settings | None = None, job_store: JobStore | None = None) -> FastAPI:
    """Build the app; settings default to the environment (EPLB_*), the job store to memory."""
    settings = settings or Settings()
    metrics = Metrics()
    pool = SolvePool(settings.solver_workers, settings.queue_limit)
    # large bodies are parsed apart from solving (a busy solver delays no 202), in a process that loads no solver
    parsers = SolvePool(1, PARSE_QUEUE, warm_parser)
    lane = FastLane(settings.inline_threads, settings.queue_limit, pool)  # small requests of the fast solvers
    store = job_store or MemoryJobStore(settings.max_jobs, settings.job_ttl_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        await parsers.start()
        await lane.start()
        for name in settings.inline & set(registry.names()):  # the lane's solver modules load now, not in a request
            registry.get_solver(name)
        try:
            yield
        finally:
            await store.close()
            await lane.close()
            await parsers.close()
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
    app.state.settings, app.state.metrics, app.state.jobs = settings, metrics, store
    app.state.pool, app.state.parsers, app.state.inline = pool, parsers, lane
    install_handlers(app)
    for module in (placement, jobs, meta, deployments):
        app.include_router(module.router)
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    app.add_middleware(Gate, settings=settings, metrics=metrics, openapi=app.openapi)
    return app


NOT_HTTP = ("text/plain, from the HTTP server before any route: a request it cannot read, e.g. a request line or "
            "headers longer than it accepts")
"""Every operation's 400 says it: uvicorn answers 'Invalid HTTP request received.' whatever the route."""


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request models the placement routes parse themselves (in a solver process)
    added to the components, and problem+json as the content type of every error."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (PlacementRequest, EvaluateRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        for path in schema.get("paths", {}).values():
            for op in path.values():
                if "requestBody" in op:  # any body may fail to parse, be too large (Gate), or be of another type
                    problem = {"application/json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
                    types = " or ".join(op["requestBody"]["content"])
                    unread = ERRORS[400] if "application/x-npy" in types else "the body is not valid JSON"
                    for status, text in (("400", unread), ("413", ERRORS[413]),
                                         ("415", f"unsupported Content-Type: send {types}")):
                        op["responses"].setdefault(status, {"description": text, "content": dict(problem)})
                for status, response in op.get("responses", {}).items():
                    content = response.get("content", {})
                    if status.isdigit() and int(status) >= 400 and "application/json" in content:
                        content[PROBLEM] = content.pop("application/json")
                bad = op["responses"].setdefault("400", {"description": NOT_HTTP, "content": {}})
                if bad["description"] != NOT_HTTP:
                    bad["description"] += f"; {NOT_HTTP}"
                bad["content"]["text/plain"] = {"schema": {"type": "string"}}
        app.openapi_schema = schema
    return app.openapi_schema
