"""The fast lane: small requests of the fast solvers run in a thread of the server process itself when one is
free, else in an idle solver process, one hop, never behind a long solve.

A greedy request on a 58 x 256 window costs about 5 ms of work; handing its body to a parser process and then
its job to a solver process cost a millisecond or two more of pickling, pipes and wake-ups, on every request.
Requests that are small (the body at most `EPLB_INLINE_MAX_BYTES`) and whose solver is one of
`EPLB_INLINE_SOLVERS` (the compiled greedy, DeepSeek and incremental kernels, which release the GIL while they
run) are parsed, solved and serialized in one go instead: in a lane thread when one is free (no hop at all),
else in an idle worker of `api.pool` (one hop; the threads share one GIL, the worker processes do not, so under
load both cores serve). When neither is free the request waits, first come first served, for whichever frees
first; it never waits for a worker some other task is queued for (a long MILP), and at most `queue_limit`
requests wait (beyond that `submit` raises `QueueFull` at once, as the process pool does). Everything else (the
MILP, jobs, large bodies) goes to the processes of `api.pool` as before, where a native crash or a cancel costs
one worker, never the server (docs/api.md).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from api.pool import QueueFull, SolvePool

T = TypeVar("T")
Where = Literal["thread", "worker"]

SOLVERS = ("greedy", "deepseek", "incremental")
"""The solvers that may run in the lane, in the server process: small, tested C loops that release the GIL.
`EPLB_INLINE_SOLVERS` names some of them (all by default); any other (the MILP's OR-Tools above all) runs in
the solver processes, where a native crash costs one worker, never the server (api.settings refuses the rest)."""


class FastLane:
    """Lane threads first, then idle solver workers, with one FIFO queue in front of both."""

    def __init__(self, threads: int, queue_limit: int, pool: SolvePool | None = None) -> None:
        self.size = max(1, threads)
        self.queue_limit = max(0, queue_limit)
        self.pool = pool
        self._executor: ThreadPoolExecutor | None = None
        self._free_threads = self.size
        self._promised = 0  # idle workers handed to waiters that have not taken them yet
        self._waiters: collections.deque[asyncio.Future[Where]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_threads = self.in_workers = 0  # tasks run each way (for /readyz and the tests)

    @property
    def running(self) -> int:
        """Tasks in the lane threads now."""
        return self.size - self._free_threads

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def has_room(self) -> bool:
        return self._available() is not None or len(self._waiters) < self.queue_limit

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="eplb-lane")
        if self.pool is not None:
            self.pool.on_release(self._wake)

    async def submit(self, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run fn(**kwargs) (a picklable module-level function: it may run in a solver process). Raises QueueFull
        when nothing is free and the queue is full, and whatever the pool's `submit` raises."""
        if self._executor is None or self._loop is None:
            raise RuntimeError("the fast lane is not running")
        where = None if self._waiters else self._claim()
        if where is None:
            if len(self._waiters) >= self.queue_limit:
                raise QueueFull
            ticket: asyncio.Future[Where] = self._loop.create_future()
            self._waiters.append(ticket)
            try:
                where = await ticket
            except asyncio.CancelledError:
                if ticket in self._waiters:
                    self._waiters.remove(ticket)
                elif ticket.done() and not ticket.cancelled():
                    self._give_back(ticket.result())
                raise
            if where == "worker":
                self._promised -= 1  # taken now: no await between here and the pool's get
        if where == "thread":
            self.in_threads += 1
            loop = self._loop
            future = self._executor.submit(functools.partial(fn, **kwargs))
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._give_back, "thread"))
            return await asyncio.wrap_future(future)
        assert self.pool is not None
        self.in_workers += 1
        result: T = await self.pool.submit(fn, self.pool.token(), None, **kwargs)
        return result

    def _available(self) -> Where | None:
        if self._free_threads > 0:
            return "thread"
        if self.pool is not None and self.pool.free - self._promised > 0:
            return "worker"
        return None

    def _claim(self) -> Where | None:
        where = self._available()
        if where == "thread":
            self._free_threads -= 1
        return where

    def _give_back(self, where: Where) -> None:
        if where == "thread":
            self._free_threads += 1
        else:
            self._promised -= 1
        self._wake()

    def _wake(self) -> None:
        """Hand what is free to the waiters, oldest first."""
        while self._waiters:
            where = self._claim()
            if where is None:
                return
            ticket = self._waiters.popleft()
            if ticket.done():  # cancelled while it waited
                if where == "thread":
                    self._free_threads += 1
                continue
            if where == "worker":
                self._promised += 1
            ticket.set_result(where)

    async def close(self) -> None:
        """Wait for the running threads (their tasks are bounded: milliseconds) and stop them."""
        for ticket in self._waiters:
            ticket.cancel()
        self._waiters.clear()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
