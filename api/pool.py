"""A bounded pool of solver processes the event loop can await.

Each worker is a long-lived spawned process that takes one task at a time over a pipe, so a native
solver crash kills one worker (it is replaced), never the server, and a cancelled job's worker can be
terminated. At most `workers` tasks run and at most `queue_limit` more wait; beyond that `submit`
raises `QueueFull` at once (the API answers 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
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


def _worker_main(conn: Connection) -> None:
    """Worker loop: receive (fn, kwargs), send ("ok", result) or ("error", message).

    The worker leads its own process group, so stopping it also stops the processes its solver started
    (the MILP solves layers in a pool of its own)."""
    os.setpgrp()
    import eplb.solve  # noqa: F401  (import once, warm)

    while True:
        try:
            fn, kwargs = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
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

    def __init__(self, workers: int, queue_limit: int) -> None:
        self.size = max(1, workers)
        self.queue_limit = max(0, queue_limit)
        self._ctx = mp.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] | None = None
        self._waiting = 0
        self._running: dict[int, _Worker] = {}
        self._closed = False

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return len(self._running)

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child,), daemon=False, name="eplb-solver")
        process.start()
        child.close()
        return _Worker(process, parent)

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self.size):
            self._idle.put_nowait(self._spawn())

    def has_room(self) -> bool:
        return self._waiting < self.queue_limit or (self._idle is not None and not self._idle.empty())

    async def submit(self, fn: Callable[..., Any], token: int, **kwargs: Any) -> Any:
        """Run fn(**kwargs) in a worker; `token` identifies the task for `cancel`.

        Raises QueueFull, EplbError (bad input found by the solver), WorkerDied or TaskCancelled.
        """
        if self._idle is None or self._closed:
            raise WorkerDied("the solver pool is not running")
        if self._idle.empty() and self._waiting >= self.queue_limit:
            raise QueueFull
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        self._running[token] = worker
        try:
            worker.conn.send((fn, kwargs))
            status, payload = await asyncio.get_running_loop().run_in_executor(None, _receive, worker.conn)
        except (EOFError, OSError, BrokenPipeError):
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
        if status == "ok":
            return payload
        if status == "error":
            raise EplbError(payload)
        raise RuntimeError(payload)

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

    def _replace(self, worker: _Worker) -> None:
        _kill_tree(worker.process)
        with contextlib.suppress(Exception):
            worker.process.join(timeout=5)
            worker.conn.close()
        if not self._closed:
            self._release(self._spawn())

    async def close(self) -> None:
        self._closed = True
        workers: list[_Worker] = list(self._running.values())
        while self._idle is not None and not self._idle.empty():
            workers.append(self._idle.get_nowait())
        for w in workers:
            _kill_tree(w.process)
            with contextlib.suppress(Exception):
                w.conn.close()
        for w in workers:
            with contextlib.suppress(Exception):
                w.process.join(timeout=5)


def _kill_tree(process: BaseProcess) -> None:
    """SIGKILL the worker's process group (the worker and whatever its solver spawned), and the worker itself
    in case it has not made its group yet (it is still starting)."""
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.kill()


def _receive(conn: Connection) -> tuple[str, Any]:
    message: tuple[str, Any] = conn.recv()
    return message
