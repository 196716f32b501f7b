"""The solver pool: a crashing solver kills one worker, never the caller, and the pool heals."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from api.inline import FastLane
from api.pool import QueueFull, SolvePool, TaskCancelled, WorkerDied, warm_parser
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


def loaded() -> list[str]:
    """Which of the heavy modules the worker has loaded."""
    import sys

    return sorted(m for m in ("api.convert", "eplb.solve", "ortools", "solvers.milp") if m in sys.modules)


def test_the_parser_worker_loads_no_solver_and_a_solver_worker_every_one() -> None:
    """The body parser's process loaded every solver's module (OR-Tools: 152 MB and 1.3 s against 57 MB and 0.7 s)
    for parsing alone; it loads api.convert (and eplb.solve, which it imports), and a solver worker every solver before
    its first task."""
    async def scenario() -> dict[str, list[str]]:
        seen = {}
        for name, pool in (("parser", SolvePool(1, 0, warm_parser)), ("solver", SolvePool(1, 0))):
            await pool.start()
            try:
                seen[name] = await pool.submit(loaded, 1)
            finally:
                await pool.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen["parser"] == ["api.convert", "eplb.solve"]  # api.convert's own imports, no solver's module
    assert seen["solver"] == ["eplb.solve", "ortools", "solvers.milp"], seen


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


def where(_: int) -> int:
    return os.getpid()  # the server's pid in a lane thread, a worker's in a solver process


def test_fast_lane_takes_its_thread_then_idle_workers_then_queues_in_order() -> None:
    async def scenario() -> None:
        pool = SolvePool(workers=1, queue_limit=0)
        lane = FastLane(threads=1, queue_limit=2, pool=pool)
        await pool.start()
        await lane.start()
        try:
            assert await lane.submit(where, _=0) == os.getpid()  # idle: the thread, no hop
            assert await pool.submit(add, 1, a=1, b=1) == 2  # the worker is up
            blocker = threading.Event()
            first = asyncio.create_task(lane.submit(blocker.wait, timeout=30))  # holds the thread
            await asyncio.sleep(0.05)
            assert lane.running == 1
            assert await lane.submit(where, _=1) != os.getpid()  # thread busy, worker idle: the worker
            slow = asyncio.create_task(lane.submit(sleep, seconds=0.5))  # the worker, busy now
            await asyncio.sleep(0.05)
            assert pool.free == 0
            order: list[int] = []

            async def queued(n: int) -> None:
                await lane.submit(add, a=n, b=0)
                order.append(n)

            waiting = [asyncio.create_task(queued(n)) for n in (1, 2)]
            await asyncio.sleep(0.05)
            assert lane.waiting == 2 and not lane.has_room()
            with pytest.raises(QueueFull):
                await lane.submit(add, a=0, b=0)
            blocker.set()
            await asyncio.gather(first, slow, *waiting)
            assert order == [1, 2] and lane.waiting == 0 and lane.running == 0  # first come, first served
        finally:
            await lane.close()
            await pool.close()

    asyncio.run(scenario())


def test_fast_lane_never_waits_behind_a_long_task_in_the_pool() -> None:
    async def scenario() -> None:
        pool = SolvePool(workers=1, queue_limit=1)
        lane = FastLane(threads=1, queue_limit=1, pool=pool)
        await pool.start()
        await lane.start()
        try:
            long = asyncio.create_task(pool.submit(sleep, 1, seconds=30))  # a MILP-like job holds the worker
            while pool.running == 0:
                await asyncio.sleep(0.05)
            started = time.monotonic()
            assert await lane.submit(where, _=0) == os.getpid()
            assert time.monotonic() - started < 5
            assert pool.cancel(1)
            with pytest.raises(TaskCancelled):
                await long
        finally:
            await lane.close()
            await pool.close()

    asyncio.run(scenario())
