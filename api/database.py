"""The service's database (`eplb.store`): where it is opened, the threads that talk to it, and the job store
kept in it (`SqlJobStore`), so every replica of the service can read and cancel any job.

Database calls block, so they run in their own threads (`in_db`), never in the default executor the solver
pool waits in: a window solve that holds a deployment's lock while it waits for the pool cannot starve it.

The replica that accepts a job runs it (its solver pool) and owns it: while the job is queued or running it
renews the job's lease every third of `lease_s`. Any replica that reads jobs first marks as failed the active
jobs whose lease lapsed (their owner died or lost the database), so no job stays "running" forever. A cancel
through another replica sets the status in the database; the owner sees it at its next renewal and stops the
solver. Clocks of replicas are assumed in step to well under `lease_s` (NTP)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import json
import os
import socket
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from api.jobs import ACTIVE, JobStore, JobWork, TooManyJobs
from api.pool import TaskCancelled
from api.problems import ProblemError
from api.schemas import Job, JobStatus, Problem
from api.settings import Settings
from eplb.errors import EplbError
from eplb.schemas import PlacementResponse
from eplb.store import JobRow, Store, StoreSettings, open_store

T = TypeVar("T")
DB_THREADS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="eplb-db")


async def in_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking database call in the database threads."""
    return await asyncio.get_running_loop().run_in_executor(DB_THREADS, functools.partial(fn, *args, **kwargs))


async def get_db(request: Request) -> Store:
    """The service's database: `app.state.db` (`create_service` opens it at start), else opened and migrated
    from EPLB_DATABASE_URL / EPLB_DATA_DIR on first use."""
    db: Store | None = getattr(request.app.state, "db", None)
    if db is None:
        db = await in_db(open_store)
        request.app.state.db = db
    return db


DbDep = Annotated[Store, Depends(get_db)]


def create_service(settings: Settings | None = None) -> FastAPI:
    """The app `eplb serve` runs: the database opened and migrated now, jobs kept in it."""
    from api.app import create_app

    settings = settings or Settings()
    db = open_store()
    jobs = SqlJobStore(db, settings.max_jobs, settings.job_ttl_s, StoreSettings().job_lease_s)
    app = create_app(settings, job_store=jobs)
    app.state.db = db
    return app

LAPSED = Problem(title="Solver failed", status=500,
                 detail="the service replica running this job stopped before it finished; submit it again")


@dataclass
class _Local:
    work: JobWork
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class SqlJobStore(JobStore):
    """Jobs in the `jobs` table; this replica's own jobs also in `_local` (their work and task)."""

    def __init__(self, store: Store, max_jobs: int, ttl_s: float, lease_s: float = 10.0) -> None:
        super().__init__(max_jobs, ttl_s)
        self.store, self.lease_s = store, lease_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._local: dict[str, _Local] = {}
        self._beat: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()

    # ----- JobStore ------------------------------------------------------------------------------------------
    async def submit(self, work: JobWork) -> Job:
        job = await in_db(self._insert)
        local = _Local(work)
        self._local[job.id] = local
        local.task = asyncio.create_task(self._run(job.id, local))
        if self._beat is None or self._beat.done():
            self._beat = asyncio.create_task(self._heartbeat())
        return job

    async def get(self, job_id: str) -> Job | None:
        return await in_db(self._get, job_id)

    async def list(self, limit: int) -> tuple[list[Job], int]:
        return await in_db(self._list, limit)

    async def cancel(self, job_id: str) -> Job | None:
        local = self._local.get(job_id)
        job = await in_db(self._finish, job_id, "cancelled")
        if local is not None and job is not None and job.status == "cancelled":
            self._stop(job_id, local)
        return job

    async def expire(self) -> int:
        return await in_db(self._expire)

    async def active(self) -> int:
        return await in_db(self._active)

    async def close(self) -> None:
        """Stop this replica's jobs (marked failed: the service stopped) and the lease renewal."""
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._beat
        tasks = [local.task for local in self._local.values() if local.task is not None and not local.task.done()]
        for job_id in list(self._local):
            await in_db(self._finish, job_id, "failed", None,
                                    Problem(title="Solver failed", status=500, detail="the service stopped"))
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ----- running this replica's jobs ---------------------------------------------------------------------
    async def _run(self, job_id: str, local: _Local) -> None:
        def started() -> None:
            task = asyncio.get_running_loop().create_task(in_db(self._started, job_id))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        status: JobStatus = "failed"
        result: dict[str, Any] | None = None
        error: Problem | None = None
        try:
            result = PlacementResponse.model_validate(await local.work.run(started)).to_json_dict()
            status = "done"
        except (TaskCancelled, asyncio.CancelledError):
            status = "cancelled"
        except ProblemError as exc:
            error = exc.problem()
        except EplbError as exc:
            error = Problem(title="Invalid request", status=422, detail=str(exc))
        except Exception as exc:  # a bug must fail the job, not vanish with the task
            error = Problem(title="Solver failed", status=500, detail=str(exc))
        finally:
            self._local.pop(job_id, None)
        await in_db(self._finish, job_id, status, result, error)

    async def _heartbeat(self) -> None:
        """Renew this replica's leases; stop local jobs another replica cancelled. Ends when none is left."""
        while self._local:
            await asyncio.sleep(self.lease_s / 3)
            try:
                gone = await in_db(self._renew, list(self._local))
            except Exception:  # the database is briefly unreachable: retry at the next beat
                continue
            for job_id in gone:
                local = self._local.get(job_id)
                if local is not None:
                    self._stop(job_id, local)

    def _stop(self, job_id: str, local: _Local) -> None:
        if not local.work.cancel() and local.task is not None:
            local.task.cancel()  # still queued: stop waiting for a worker
        self._local.pop(job_id, None)

    # ----- database side (run in threads) -------------------------------------------------------------------
    def _insert(self) -> Job:
        now = time.time()
        with self.store.write() as session:
            self._reap(session, now)
            self._delete_expired(session)
            active = session.scalar(select(func.count()).select_from(JobRow).where(JobRow.status.in_(ACTIVE)))
            if (active or 0) >= self.max_jobs:
                raise TooManyJobs
            row = JobRow(id=uuid.uuid4().hex, status="queued", owner=self.owner, lease_until=now + self.lease_s,
                         created_at=now)
            session.add(row)
            session.flush()
            return _job(row, with_result=False)

    def _started(self, job_id: str) -> None:
        with self.store.write() as session:
            session.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "queued")
                            .values(status="running", started_at=time.time()))

    def _finish(self, job_id: str, status: JobStatus, result: dict[str, Any] | None = None,
                error: Problem | None = None) -> Job | None:
        """Move an active job to `status` (a finished job is left as it is); the job, or None if unknown."""
        with self.store.write() as session:
            self._reap(session, time.time())
            row = session.get(JobRow, job_id)
            if row is None:
                return None
            if row.status in ACTIVE:
                row.status, row.finished_at = status, time.time()
                row.result = None if result is None else zlib.compress(json.dumps(result).encode())
                row.error = None if error is None else error.model_dump(exclude_none=True)
            return _job(row, with_result=True)

    def _renew(self, job_ids: builtins.list[str]) -> builtins.list[str]:
        """Extend this replica's leases; returns those of `job_ids` no longer active (cancelled elsewhere)."""
        now = time.time()
        with self.store.write() as session:
            session.execute(update(JobRow).where(JobRow.owner == self.owner, JobRow.status.in_(ACTIVE))
                            .values(lease_until=now + self.lease_s))
            self._reap(session, now)
            still = set(session.scalars(select(JobRow.id).where(JobRow.id.in_(job_ids), JobRow.status.in_(ACTIVE))))
        return [j for j in job_ids if j not in still]

    @staticmethod
    def _reap(session: Session, now: float) -> None:
        """Fail active jobs whose owner's lease lapsed."""
        session.execute(update(JobRow).where(JobRow.status.in_(ACTIVE), JobRow.lease_until < now)
                        .values(status="failed", finished_at=now, error=LAPSED.model_dump(exclude_none=True)))

    def _get(self, job_id: str) -> Job | None:
        with self.store.read() as session:
            row = session.get(JobRow, job_id)
            lapsed = row is not None and row.status in ACTIVE and row.lease_until < time.time()
        if lapsed:
            with self.store.write() as session:
                self._reap(session, time.time())
                row = session.get(JobRow, job_id)
        if row is None or (row.finished_at is not None and row.finished_at < time.time() - self.ttl_s):
            return None
        return _job(row, with_result=True)

    def _list(self, limit: int) -> tuple[builtins.list[Job], int]:
        now = time.time()
        with self.store.read() as session:
            lapsed = session.scalar(select(func.count()).select_from(JobRow)
                                    .where(JobRow.status.in_(ACTIVE), JobRow.lease_until < now))
        if lapsed:
            with self.store.write() as session:
                self._reap(session, now)
        with self.store.read() as session:
            kept = (JobRow.finished_at.is_(None)) | (JobRow.finished_at >= now - self.ttl_s)
            newest = session.scalars(select(JobRow).where(kept).order_by(JobRow.created_at.desc()).limit(limit))
            jobs = [_job(r, with_result=False) for r in newest]
            return jobs, session.scalar(select(func.count()).select_from(JobRow).where(kept)) or 0

    def _active(self) -> int:
        with self.store.read() as session:
            return int(session.scalar(select(func.count()).select_from(JobRow).where(JobRow.status.in_(ACTIVE)))
                       or 0)

    def _expire(self) -> int:
        with self.store.write() as session:
            return self._delete_expired(session)

    def _delete_expired(self, session: Session) -> int:
        cutoff = time.time() - self.ttl_s
        done = session.execute(delete(JobRow).where(JobRow.finished_at.is_not(None), JobRow.finished_at < cutoff))
        return int(getattr(done, "rowcount", 0) or 0)


def _job(row: JobRow, with_result: bool) -> Job:
    result = None
    if with_result and row.result is not None:
        result = PlacementResponse.model_validate(json.loads(zlib.decompress(row.result)))
    return Job(id=row.id, status=row.status,
               created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at, result=result,
               error=None if row.error is None else Problem.model_validate(row.error))
