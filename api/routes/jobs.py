"""Background solves: list, poll, cancel. The store behind them is `api.deps.get_jobs` (api/jobs.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from api.deps import JobsDep, SettingsDep, require_key
from api.problems import ProblemError, documented
from api.routing import Route
from api.schemas import Job, JobList
from eplb.errors import shown
from eplb.rules import JOBS_PAGE_MAX

router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=Route)


def no_such_job(job_id: str) -> ProblemError:
    return ProblemError(404, "No such job", f"job {shown(job_id)} does not exist or has expired")


@router.get("", response_model=JobList, response_model_exclude_none=True, responses=documented(401, 422),
            summary="The newest jobs kept (results at /jobs/{id})", dependencies=[Depends(require_key)])
async def list_jobs(
    jobs: JobsDep, settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=JOBS_PAGE_MAX, description="the newest jobs to list")] = 100,
) -> JobList:
    listed, kept = await jobs.list(limit)
    return JobList(jobs=listed, kept=kept, active=await jobs.active(), max_jobs=settings.max_jobs)


@router.get("/{job_id}", response_model=Job, response_model_exclude_none=True, responses=documented(404),
            summary="Status and result of a job")
async def get_job(job_id: str, jobs: JobsDep) -> Job:
    job = await jobs.get(job_id)
    if job is None:
        raise no_such_job(job_id)
    return job


@router.delete("/{job_id}", response_model=Job, response_model_exclude_none=True, responses=documented(401, 404),
               summary="Cancel a job (a running solve's worker is stopped and replaced)",
               dependencies=[Depends(require_key)])
async def cancel_job(job_id: str, jobs: JobsDep) -> Job:
    job = await jobs.cancel(job_id)
    if job is None:
        raise no_such_job(job_id)
    return job
