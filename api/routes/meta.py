"""Presets, health and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api.deps import InlineDep, MetricsDep, PoolDep, SettingsDep
from api.problems import documented, problem_response
from api.routing import Route
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from solvers import registry

router = APIRouter(tags=["meta"], route_class=Route)


@router.get("/presets", summary="Model and hardware presets")
async def presets() -> dict[str, Any]:
    return {
        "models": {name: spec.to_dict() for name, spec in MODEL_PRESETS.items()},
        "hardware": {name: spec.to_dict() for name, spec in HARDWARE_PRESETS.items()},
        "solvers": {name: registry.get_solver(name).summary for name in registry.names()},
    }


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Solvers are ready and the queue has room", responses=documented(503))
async def readyz(pool: PoolDep, lane: InlineDep, settings: SettingsDep) -> Any:
    if not (pool.has_room() and lane.has_room()):
        return problem_response(503, "Not ready", "the solver queue is full", "/readyz",
                                {"Retry-After": str(settings.retry_after_s)})
    return {"status": "ready", "workers": pool.size, "running": pool.running, "waiting": pool.waiting,
            "lane": {"threads": lane.size, "running": lane.running, "waiting": lane.waiting,
                     "ran_in_threads": lane.in_threads, "ran_in_workers": lane.in_workers}}


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
async def prometheus(metrics: MetricsDep) -> PlainTextResponse:
    return PlainTextResponse(metrics.render(), media_type=metrics.content_type)
