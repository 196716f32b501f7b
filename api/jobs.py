"""Background solves (jobs): the `JobStore` interface the routes use, and the in-memory store.

Only queued and running jobs count against `max_jobs`; finished ones (done, failed, cancelled) stay readable
until `ttl_s` after they finished, then expire. A store kept elsewhere (a database) implements the same
five methods; the routes get the store from `api.deps.get_jobs`."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from api.pool import TaskCancelled
from api.problems import ProblemError
from api.schemas import Job, JobStatus, Problem
from eplb.errors import EplbError
from eplb.schemas import PlacementResponse

ACTIVE: tuple[JobStatus, ...] = ("queued", "running")


@dataclass(frozen=True)
class JobWork:
    """One background solve. `run(started)` returns the answer as a JSON object and calls `started()` when a
    solver worker takes it; `cancel()` stops it while it runs (True when it did)."""

    run: Callable[[Callable[[], None]], Awaitable[dict[str, Any]]]
    cancel: Callable[[], bool]


class TooManyJobs(Exception):
    """`max_jobs` jobs are queued or running."""


class JobStore(ABC):
    """Where jobs live: submit, get, list, cancel, expire (and close at shutdown)."""

    def __init__(self, max_jobs: int, ttl_s: float) -> None:
        self.max_jobs, self.ttl_s = max_jobs, ttl_s

    @abstractmethod
    async def submit(self, work: JobWork) -> Job:
        """Start `work` as a queued job; raises TooManyJobs when `max_jobs` are queued or running."""

    @abstractmethod
    async def get(self, job_id: str) -> Job | None:
        """The job with its result, or None when unknown or expired."""

    @abstractmethod
    async def list(self, limit: int) -> tuple[list[Job], int]:
        """The newest `limit` jobs kept, newest first, without results, and how many are kept."""

    @abstractmethod
    async def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued or running job (a finished one is returned unchanged); None when unknown."""

    @abstractmethod
    async def expire(self) -> int:
        """Forget finished jobs older than `ttl_s`; returns how many were dropped."""

    @abstractmethod
    async def active(self) -> int:
        """Queued and running jobs."""

    @abstractmethod
    async def close(self) -> None:
        """Stop what still runs (server shutdown)."""


@dataclass
class _Record:
    job: Job
    work: JobWork
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class MemoryJobStore(JobStore):
    """Jobs in this process's memory (they end with it)."""

    def __init__(self, max_jobs: int, ttl_s: float) -> None:
        super().__init__(max_jobs, ttl_s)
        self._records: dict[str, _Record] = {}

    async def submit(self, work: JobWork) -> Job:
        await self.expire()
        if await self.active() >= self.max_jobs:
            raise TooManyJobs
        record = _Record(Job(id=uuid.uuid4().hex, status="queued", created_at=time.time()), work)
        self._records[record.job.id] = record
        record.task = asyncio.create_task(self._run(record))
        return record.job.model_copy()

    async def get(self, job_id: str) -> Job | None:
        await self.expire()
        record = self._records.get(job_id)
        return None if record is None else record.job.model_copy()

    async def list(self, limit: int) -> tuple[list[Job], int]:
        await self.expire()
        newest = sorted(self._records.values(), key=lambda r: r.job.created_at, reverse=True)[:limit]
        return [r.job.model_copy(update={"result": None}) for r in newest], len(self._records)

    async def cancel(self, job_id: str) -> Job | None:
        record = self._records.get(job_id)
        if record is None:
            return None
        if record.job.status in ACTIVE:
            if not record.work.cancel() and record.task is not None:
                record.task.cancel()  # still queued: stop waiting for a worker
            self._finish(record, "cancelled")
        return record.job.model_copy()

    async def expire(self) -> int:
        cutoff = time.time() - self.ttl_s
        old = [k for k, r in self._records.items()
               if r.job.finished_at is not None and r.job.finished_at < cutoff]
        for key in old:
            del self._records[key]
        return len(old)

    async def active(self) -> int:
        return sum(r.job.status in ACTIVE for r in self._records.values())

    async def close(self) -> None:
        tasks = [r.task for r in self._records.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, record: _Record) -> None:
        def started() -> None:
            if record.job.status == "queued":
                record.job.status, record.job.started_at = "running", time.time()

        try:
            result = await record.work.run(started)
        except (TaskCancelled, asyncio.CancelledError):
            self._finish(record, "cancelled")
        except ProblemError as exc:
            self._finish(record, "failed", error=exc.problem())
        except EplbError as exc:
            self._finish(record, "failed", error=Problem(title="Invalid request", status=422, detail=str(exc)))
        except Exception as exc:  # a bug must fail the job, not vanish with the task
            self._finish(record, "failed", error=Problem(title="Solver failed", status=500, detail=str(exc)))
        else:
            self._finish(record, "done", result=PlacementResponse.model_validate(result))

    @staticmethod
    def _finish(record: _Record, status: JobStatus, result: PlacementResponse | None = None,
                error: Problem | None = None) -> None:
        if record.job.status not in ACTIVE:
            return  # cancelled first: the late answer is dropped
        record.job.status, record.job.finished_at = status, time.time()
        record.job.result, record.job.error = result, error
