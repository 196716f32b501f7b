"""The solver pool: a crashing solver kills one worker, never the caller, and the pool heals."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from api.pool import QueueFull, SolvePool, TaskCancelled, WorkerDied
from eplb.errors import EplbError


def crash() -> None:
    os._exit(11)  # what a segfault in native solver code looks like to the parent


def add(a: int, b: int) -> int:
    return a + b


def refuse() -> None:
    raise EplbError("bad input found in the worker")


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_crash_is_contained_and_the_pool_recovers() -> None:
    async def scenario() -> None:
        pool = SolvePool(workers=1, queue_limit=1)
        await pool.start()
        try:
            with pytest.raises(WorkerDied, match="exited with code 11"):
                await pool.submit(crash, 1)
            assert await pool.submit(add, 2, a=2, b=3) == 5  # a fresh worker took the crashed one's place
            with pytest.raises(EplbError, match="bad input found in the worker"):
                await pool.submit(refuse, 3)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_queue_full_and_cancel() -> None:
    async def scenario() -> None:
        pool = SolvePool(workers=1, queue_limit=0)
        await pool.start()
        try:
            running = asyncio.create_task(pool.submit(sleep, 10, seconds=30))
            while pool.running == 0:
                await asyncio.sleep(0.05)
            with pytest.raises(QueueFull):
                await pool.submit(add, 11, a=1, b=1)
            started = time.monotonic()
            assert pool.cancel(10)
            with pytest.raises(TaskCancelled):
                await running
            assert time.monotonic() - started < 10  # stopped, not waited out
            assert await pool.submit(add, 12, a=1, b=1) == 2
        finally:
            await pool.close()

    asyncio.run(scenario())
