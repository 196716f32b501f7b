"""A bounded pool of solver processes the event loop can await.

Each worker is a long-lived spawned process that takes one task at a time over a pipe, so a native
solver crash kills one worker (it is replaced), never the server, and a cancelled job's worker can be
terminated. At most `workers` tasks run and at most `queue_limit` more wait; beyond that `submit`
raises `QueueFull` at once (the API answers 503 with Retry-After).

A worker acknowledges each task before running it, so a worker that died while idle (killed, out of memory)
is told apart from one that died running the task: the task is retried on its replacement. The pipe traffic
runs in a thread, so even a large request body never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from eplb.errors import EplbError


class QueueFull(Exception):
    """Every worker is busy and the wait queue is full."""


class WorkerDied(Exception):
    """The worker process ended without an answer (a native crash, or it was terminated)."""


class TaskCancelled(Exception):
    """The task was cancelled while waiting or running."""


class _NotStarted(Exception):
    """The worker was gone before it took the task (it died while idle)."""


RETRIES = 2  # fresh workers tried when the one taken had died while idle
IDLE_EXIT_S = 0.5  # an idle worker not gone this long after its pipe closed is still starting: killed
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def _die_with(server: int) -> None:
    """End this worker when the server process `server` dies, however it dies (a SIGKILL runs none of its cleanup),
    even mid-solve: on Linux the kernel sends SIGKILL (PR_SET_PDEATHSIG; the server's loop thread spawns the
    workers and lives as long as the server); elsewhere a thread checks the parent every second. A server gone
    before this ran: exit now."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != server:
        os._exit(0)
    if not armed:
        def watch() -> None:
            while os.getppid() == server:
                time.sleep(1.0)
            os.killpg(os.getpgrp(), signal.SIGKILL)

        threading.Thread(target=watch, name="eplb-server-watch", daemon=True).start()


def warm_solvers() -> None:
    """A solver worker's start-up: eplb.solve and every solver's module (OR-Tools too) load now, not in the first
    request."""
    import eplb.solve  # noqa: F401
    from solvers import registry

    for name in registry.names():
        registry.get_solver(name)


def warm_parser() -> None:
    """The body parser's start-up (`api.offload.parse_body`): api.convert alone, no solver (0.7 s and 57 MB
    against 1.3 s and 152 MB with every solver's module, measured with /usr/bin/time)."""
    import api.convert  # noqa: F401


def _worker_main(conn: Connection, server: int, warm: Callable[[], None] = warm_solvers) -> None:
    """Worker loop: run `warm`, then receive (fn, kwargs), acknowledge it, send ("ok", result) or ("error",
    message); return when the pipe closes (the pool's orderly stop). `server`: the server's pid; the worker dies
    with it (`_die_with`: a MILP job of an hour does not outlive a killed server).

    The worker leads its own process group, so stopping it also stops the processes its solver started
    (the MILP solves layers in a pool of its own)."""
    os.setpgrp()
    _die_with(server)
    warm()

    while True:
        try:
            fn, kwargs = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        conn.send(("started", None))
        try:
            conn.send(("ok", fn(**kwargs)))
        except EplbError as exc:
            conn.send(("error", str(exc)))
        except Exception as exc:  # reported to the caller as a server error
            conn.send(("crash", f"{type(exc).__name__}: {exc}"))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection


class SolvePool:
    """Spawned solver processes with a bounded wait queue."""

    def __init__(self, workers: int, queue_limit: int, warm: Callable[[], None] = warm_solvers) -> None:
        """warm: what each worker loads at its start, a module-level function (it is sent to a spawned process)."""
        self.warm = warm
        self.size = max(1, workers)
        self.queue_limit = max(0, queue_limit)
        self._ctx = mp.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] | None = None
        self._waiting = 0
        self._running: dict[int, _Worker] = {}
        self._closed = False
        self._tokens = itertools.count(1)
        self._listeners: list[Callable[[], None]] = []

    def token(self) -> int:
        """A new task id for `submit` and `cancel`."""
        return next(self._tokens)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return len(self._running)

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, os.getpid(), self.warm), daemon=False,
                                    name="eplb-solver")
        process.start()
        child.close()
        return _Worker(process, parent)

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self.size):
            self._idle.put_nowait(self._spawn())

    @property
    def free(self) -> int:
        """Idle workers no waiting task has a claim on: this many tasks submitted now start at once."""
        return 0 if self._idle is None or self._closed else max(0, self._idle.qsize() - self._waiting)

    def on_release(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (in the event loop) whenever a worker becomes idle."""
        self._listeners.append(listener)

    def has_room(self) -> bool:
        return self._waiting < self.queue_limit or (self._idle is not None and not self._idle.empty())

    async def submit(self, fn: Callable[..., Any], token: int, on_start: Callable[[], None] | None = None,
                     **kwargs: Any) -> Any:
        """Run fn(**kwargs) in a worker; `token` identifies the task for `cancel`; `on_start()` is called when a
        worker takes the task.

        Raises QueueFull, EplbError (bad input found by the solver), WorkerDied or TaskCancelled.
        """
        if self._idle is None or self._closed:
            raise WorkerDied("the solver pool is not running")
        if self._idle.empty() and self._waiting >= self.queue_limit:
            raise QueueFull
        for attempt in range(RETRIES + 1):
            try:
                status, payload = await self._attempt(fn, token, on_start, kwargs)
            except _NotStarted:
                if attempt == RETRIES:
                    raise WorkerDied("solver processes exit as soon as they start") from None
                continue
            if status == "ok":
                return payload
            if status == "error":
                raise EplbError(payload)
            raise RuntimeError(payload)
        raise AssertionError("unreachable")

    async def _attempt(self, fn: Callable[..., Any], token: int, on_start: Callable[[], None] | None,
                       kwargs: dict[str, Any]) -> tuple[str, Any]:
        assert self._idle is not None
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        self._running[token] = worker
        if on_start is not None:
            on_start()
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, _exchange, worker.conn, (fn, kwargs))
        except _NotStarted:
            self._replace(worker)
            if token not in self._running:
                raise TaskCancelled from None
            raise
        except (EOFError, OSError):
            cancelled = token not in self._running
            self._replace(worker)
            if cancelled:
                raise TaskCancelled from None
            raise WorkerDied(f"solver process exited with code {worker.process.exitcode}") from None
        except asyncio.CancelledError:
            self._replace(worker)
            raise
        finally:
            self._running.pop(token, None)
        self._release(worker)
        return answer

    def cancel(self, token: int) -> bool:
        """Stop a running task by terminating its worker (a fresh one takes its place)."""
        worker = self._running.pop(token, None)
        if worker is None:
            return False
        _kill_tree(worker.process)
        return True

    def _release(self, worker: _Worker) -> None:
        if self._idle is not None and not self._closed:
            self._idle.put_nowait(worker)
            for listener in self._listeners:
                listener()

    def _replace(self, worker: _Worker) -> None:
        _kill_tree(worker.process)
        with contextlib.suppress(Exception):
            worker.process.join(timeout=5)
            worker.conn.close()
        if not self._closed:
            self._release(self._spawn())

    async def close(self) -> None:
        """Stop every worker: idle ones by closing their pipe (they exit cleanly, releasing what their
        solvers hold), running ones by killing their process group. An idle worker still starting (importing
        the solvers, seconds under load) sees the closed pipe only when it is done: one not gone within
        IDLE_EXIT_S is killed too, as it holds nothing yet (a server stopped right after its start waited for
        that, 2.9 s)."""
        self._closed = True
        running: list[_Worker] = list(self._running.values())
        idle: list[_Worker] = []
        while self._idle is not None and not self._idle.empty():
            idle.append(self._idle.get_nowait())
        for w in running:
            _kill_tree(w.process)
        for w in idle + running:
            with contextlib.suppress(Exception):
                w.conn.close()
        loop = asyncio.get_running_loop()
        for w in idle + running:
            await loop.run_in_executor(None, w.process.join, IDLE_EXIT_S if w in idle else 5)
            if w.process.is_alive():
                _kill_tree(w.process)
                await loop.run_in_executor(None, w.process.join, 5)


def _kill_tree(process: BaseProcess) -> None:
    """SIGKILL the worker's process group (the worker and whatever its solver spawned), and the worker itself
    in case it has not made its group yet (it is still starting)."""
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.kill()


def _exchange(conn: Connection, task: tuple[Callable[..., Any], dict[str, Any]]) -> tuple[str, Any]:
    """Send a task and wait for its answer (in a thread). Raises _NotStarted when the worker was gone before
    it acknowledged the task, EOFError when it died running it."""
    try:
        conn.send(task)
        conn.recv()  # ("started", None)
    except (EOFError, OSError):
        raise _NotStarted from None
    message: tuple[str, Any] = conn.recv()
    return message
