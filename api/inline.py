"""The in-process lane: fast, bounded requests run in a few threads of the server process itself.

A greedy request on a 58 x 256 window costs about 5 ms of work; handing its body to a parser process and its
job to a solver process cost as much again in pickling, pipes and wake-ups. Requests that are small (the body
at most `EPLB_INLINE_MAX_BYTES`) and whose solver is one of `EPLB_INLINE_SOLVERS` (the compiled greedy,
DeepSeek and incremental kernels, which release the GIL while they run) are parsed, solved and serialized
here instead, in one thread hop. Everything else (the MILP, jobs, large bodies) still goes to the processes
of `api.pool`, where a native crash or a cancel costs one worker, never the server (docs/api.md).

At most `threads` tasks run and at most `queue_limit` more wait; beyond that `submit` raises `QueueFull` at
once, as the process pool does.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from api.pool import QueueFull

T = TypeVar("T")


class InlineLane:
    """A bounded thread pool the event loop can await, with the solver pool's queue rules."""

    def __init__(self, threads: int, queue_limit: int) -> None:
        self.size = max(1, threads)
        self.queue_limit = max(0, queue_limit)
        self._executor: ThreadPoolExecutor | None = None
        self._admitted = 0  # running + waiting; a task leaves when its thread is done (or it never started)
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        return min(self._admitted, self.size)

    @property
    def waiting(self) -> int:
        return max(0, self._admitted - self.size)

    def has_room(self) -> bool:
        return self._admitted < self.size + self.queue_limit

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="eplb-inline")

    async def submit(self, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run fn(**kwargs) in a lane thread. Raises QueueFull when every thread is busy and the queue is full."""
        if self._executor is None:
            raise RuntimeError("the inline lane is not running")
        with self._lock:
            if not self.has_room():
                raise QueueFull
            self._admitted += 1
        future = self._executor.submit(functools.partial(fn, **kwargs))
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self._admitted -= 1

    async def close(self) -> None:
        """Wait for the running tasks (they are bounded: milliseconds) and stop the threads."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
