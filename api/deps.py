"""Dependencies routes declare (FastAPI's `Depends`): settings, the solver pool, the in-process lane, the job
store, metrics, and the API-key check. The objects live on `app.state`, set by `api.app.create_app`; a test or
another store swaps them there. Every dependency is `async def`: FastAPI runs a plain `def` one in a worker
thread, a thread hop per dependency per request."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.inline import FastLane
from api.jobs import JobStore
from api.metrics import Metrics
from api.pool import SolvePool
from api.problems import unauthorized
from api.settings import Settings

bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="the service's API key (EPLB_API_KEY), when it has one")


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_pool(request: Request) -> SolvePool:
    pool: SolvePool = request.app.state.pool
    return pool


async def get_parsers(request: Request) -> SolvePool:
    pool: SolvePool = request.app.state.parsers
    return pool


async def get_inline(request: Request) -> FastLane:
    lane: FastLane = request.app.state.inline
    return lane


async def get_jobs(request: Request) -> JobStore:
    jobs: JobStore = request.app.state.jobs
    return jobs


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
PoolDep = Annotated[SolvePool, Depends(get_pool)]
ParsersDep = Annotated[SolvePool, Depends(get_parsers)]  # one process that parses and validates request bodies
InlineDep = Annotated[FastLane, Depends(get_inline)]  # small requests of the fast solvers: a thread, else a worker
JobsDep = Annotated[JobStore, Depends(get_jobs)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


def key_ok(settings: Settings, authorization: str | None) -> bool:
    """Whether an Authorization header carries the API key (always true without one); constant time."""
    if settings.api_key is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), settings.api_key.encode())


async def require_key(
    request: Request, settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """401 unless the request carries the API key. Routes with a body are also checked by `api.middleware`
    before the body is read; this dependency declares the Bearer scheme in OpenAPI and guards the rest."""
    if not key_ok(settings, request.headers.get("authorization")):
        raise unauthorized()


Authorized = [Depends(require_key)]
