"""Where independent pieces of eplb work run: in order in this process, or spread over a Ray cluster.

A piece is a `Task`: one argument for a function `fn(arg, report) -> result`, its size in progress units
(steps of a log, or 1), a note for the progress bar and the CPUs it occupies (MILP solves layers on
threads: a task that solves with it asks for min(layers, a node's CPUs)). `Executor.map(fn, tasks)`
returns the results in the tasks' order whatever ran where, so callers merge them exactly as the local
loop would have. `report(done)` tells the local progress bar how far a task is; Ray's progress counts
finished tasks (a `ray.wait` loop).

- `LocalExecutor`: one task after the other, here (the default; needs nothing).
- `RayExecutor`: Ray tasks (`pip install 'eplb[ray]'`). With no address it starts a local Ray on this
  machine; with one (`auto`, `ray://head:10001`, `head:6379`) it joins that cluster; either on first use, once
  the command has checked its inputs. A task that raises
  anything but an EplbError (a lost worker, a killed process, a flaky disk) is retried up to `retries`
  times; an EplbError (bad input, an unreadable log) is not retried: the first one ends the map with
  that one message, the other tasks are cancelled. Every worker needs eplb installed and the data
  paths the tasks name (docs/cluster.md).

`replay_logs` (below) runs `eplb.replay.replay` on an executor: one task per log, and a log split
by layers when its schedule lets layers replay independently.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, SupportsIndex, TypeVar

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, single_spaced
from eplb.io.logs import LogInfo, RoutingLog, as_log, open_log
from eplb.placement import Placement
from eplb.progress import Progress
from eplb.replay import BASELINES, Rebalance, ReplayResult, Schedule, StepBlock, replay
from eplb.replay.summary import RowStats
from eplb.solve import Cluster, CostSetup
from solvers.registry import Options
from solvers.validation import whole_number

__all__ = [
    "EXECUTORS",
    "Executor",
    "LocalExecutor",
    "RayExecutor",
    "Report",
    "Task",
    "add_executor_options",
    "executor_from",
    "layer_parts",
    "make_executor",
    "replay_logs",
]

EXECUTORS: tuple[str, ...] = ("local", "ray")
A = TypeVar("A")
R = TypeVar("R")
Report = Callable[[int], None]
"""report(done): units of the running task done so far (a no-op on Ray workers)."""


@dataclass(frozen=True)
class Task(Generic[A]):
    """One piece of work. arg: what fn receives; units: its size for the progress bar (None:
    unknown); note: shown next to the bar; cpus: CPUs it occupies (Ray's num_cpus)."""

    arg: A
    units: int | None = 1
    note: str = ""
    cpus: float = 1.0


class Executor(ABC):
    """Runs tasks and returns their results in order (see the module docstring)."""

    name: str

    def map(
        self,
        fn: Callable[[A, Report], R],
        tasks: Sequence[Task[A]],
        *,
        label: str,
        unit: str = "",
        progress: bool | None = None,
    ) -> list[R]:
        """[fn(task.arg, report) for task in tasks], with a progress bar `label` over the tasks' units."""
        sizes = [t.units for t in tasks]
        total = None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)
        with Progress(total, label, enabled=progress, unit=unit) as bar:
            return self._run(fn, tasks, bar)

    @abstractmethod
    def _run(self, fn: Callable[[A, Report], R], tasks: Sequence[Task[A]], bar: Progress) -> list[R]: ...

    def node_cpus(self) -> int:
        """CPUs of the largest node a task can run on (the ceiling of a task's `cpus`)."""
        from solvers.milp.runner import available_cores

        return available_cores()

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Release what the executor started (a local Ray instance)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class LocalExecutor(Executor):
    """Tasks one after the other in this process; an exception ends the map (no retries: here a failure
    is a bug or bad input, not a lost worker)."""

    name = "local"

    def _run(self, fn: Callable[[A, Report], R], tasks: Sequence[Task[A]], bar: Progress) -> list[R]:
        results: list[R] = []
        for task in tasks:
            base = bar.done

            def report(done: int, base: int = base, note: str = task.note) -> None:
                bar.update(base + done, note)

            results.append(fn(task.arg, report))
            bar.update(base + (task.units or 0), task.note)
        return results


@dataclass(frozen=True)
class _Failed:
    """An EplbError raised in a worker, returned as a value so that Ray does not retry it."""

    message: str


def _run_task(fn: Callable[[Any, Report], Any], arg: Any) -> Any:
    """What a Ray worker runs: fn(arg) with a no-op report; EplbError comes back as _Failed."""
    try:
        return fn(arg, _no_report)
    except EplbError as exc:
        return _Failed(str(exc))


def _no_report(done: int) -> None:
    return None


class RayExecutor(Executor):
    """Tasks as Ray tasks. address: None (or `local`) starts a local Ray instance on this machine (num_cpus: its
    CPUs, a whole number >= 1, default all); else the cluster to join (num_cpus refused: its CPUs are its own).
    retries: attempts after the first for a task that raised anything but an EplbError or whose worker died. A Ray
    already initialized in this process is used as it is (and left running). Ray is started or joined on first use
    (`map`, `node_cpus`), not here: a command checks its inputs in between, so a refusal comes without Ray's start-up
    (seconds).
    quiet: Ray's driver logger ("ray") at ERROR (ray.init's logging_level), so that its start-up warnings
    ("Token authentication is enabled for this Ray cluster...") stay out of the command's output; False leaves
    Ray's logging as Ray sets it. flag: what the messages call the address (the CLI's --ray-address; default
    `address`)."""

    name = "ray"

    def __init__(self, address: str | None = None, *, num_cpus: SupportsIndex | None = None, retries: int = 2,
                 quiet: bool = True, flag: str | None = None) -> None:  # fmt: skip
        try:
            import ray
        except ImportError:
            raise EplbError("--executor ray needs Ray: pip install 'eplb[ray]'") from None
        if retries < 0:
            raise EplbError(f"retries must be >= 0, got {retries}")
        self.endpoint = None if address is None else ray_endpoint(address, flag)
        address = None if address is None else address.strip()  # what ray.init gets: ' auto' is 'Invalid address'
        num_cpus = _local_cpus(num_cpus, address)
        self.ray = ray
        self.address, self.num_cpus, self.retries, self.quiet, self.flag = address, num_cpus, retries, quiet, flag
        self.started = False
        self._remote: Any = None

    def _ready(self) -> Any:
        """The remote task function, once Ray is up: started or joined here on first use."""
        if self._remote is not None:
            return self._remote
        ray, address = self.ray, self.address
        if not ray.is_initialized():
            if self.endpoint is not None:  # Ray waits minutes (HOST:6379) or 30 s (ray://) for nothing that answers
                self._probe(*self.endpoint, str(address))
            elif address == "auto" and os.environ.get(RAY_ADDRESS, "").strip():
                named = os.environ[RAY_ADDRESS].strip()  # what auto joins first; Ray waits as long for it
                try:
                    endpoint = ray_endpoint(named, RAY_ADDRESS)
                except EplbError:  # another form (an http:// one for `ray job`): Ray's own message says what to do
                    endpoint = None
                if endpoint is not None:
                    self._probe(*endpoint, f"{named} ({RAY_ADDRESS}, which {self.flag or 'address'} auto joins)")
            logs = {"logging_level": logging.ERROR} if self.quiet else {"configure_logging": False}
            try:
                local = _starts_local_ray(address)
                ray.init(address="local" if local else address, num_cpus=self.num_cpus if local else None,
                         include_dashboard=False, **logs)  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise EplbError(self._unreachable(exc)) from None
            self.started = True
        self._remote = ray.remote(_run_task)
        return self._remote

    def _probe(self, host: str, port: int, shown: str) -> None:
        """EplbError at once when nothing accepts a connection at the address's host and port (a closed port, a host
        that does not resolve): ray.init would retry a GCS address for minutes, logging each attempt, and wait 30 s for
        a Ray client address before saying 'ray client connection timeout'."""
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            if isinstance(exc, socket.gaierror):
                raise EplbError(f"cannot reach the Ray cluster at {shown}: no host {host!r} "
                                f"({reason})") from None
            if isinstance(exc, TimeoutError):
                reason = f"no answer within {PROBE_TIMEOUT_S:g} s"
            client = shown.startswith(RAY_CLIENT)
            which = "Ray client server port (10001 by default)" if client else "GCS port (6379 by default)"
            raise EplbError(f"cannot reach the Ray cluster at {shown}: {reason} at {host}:{port} (is Ray's head "
                            f"running there, `ray start --head`, and is {port} its {which}?)") from None

    def _unreachable(self, exc: Exception) -> str:
        """Why Ray did not start or could not be joined, in eplb's terms: Ray's own text for `auto` points at Ray's
        `--address` flag and RAY_ADDRESS, which are not how eplb is told where the cluster is."""
        address, said = self.address, single_spaced(exc)
        if address is None:
            return f"cannot start a local Ray instance: {said}"
        given = f"{self.flag} {address}" if self.flag else f"address {address!r}"
        if address == "auto" and isinstance(exc, ConnectionError):
            return (f"{given} found no Ray cluster to join on this machine (auto joins the one `ray start` started "
                    f"here, or the one the RAY_ADDRESS environment variable names): run the command on a node of the "
                    f"cluster, give the head's address ({self.flag or 'address'} HEAD:6379, or ray://HEAD:10001 from "
                    "outside the cluster), or leave the address out to start a local Ray")
        if "ray[client]" in str(exc):  # Ray without its client, e.g. `pip install ray`: no ray:// address
            return (f"{given} needs Ray's client, which this Ray lacks (its grpcio): pip install 'eplb[ray]' (it "
                    "installs ray[client]), or run the command on a node of the cluster with "
                    f"{self.flag or 'address'} auto")
        if self.endpoint is None:
            return f"cannot reach the Ray cluster at {address}: {said}"
        host, port = self.endpoint  # the probe connected there: a Ray that refused this driver, or no Ray at all
        which = "Ray client server" if address.startswith(RAY_CLIENT) else "GCS"
        return (f"cannot reach the Ray cluster at {address}: {said} ({host}:{port} accepts connections but Ray could "
                f"not join it: is {port} the head's {which} port? A cluster with token authentication also needs "
                "RAY_AUTH_MODE=token here, and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)")  # fmt: skip

    def node_cpus(self) -> int:
        self._ready()
        nodes: list[dict[str, Any]] = self.ray.nodes()  # type: ignore[no-untyped-call]
        cpus = [node["Resources"].get("CPU", 0) for node in nodes if node.get("Alive")]
        return max(1, int(max(cpus, default=1)))

    def _run(self, fn: Callable[[A, Report], R], tasks: Sequence[Task[A]], bar: Progress) -> list[R]:
        ray = self.ray
        ceiling = self.node_cpus()
        refs = [
            self._ready().options(num_cpus=min(t.cpus, ceiling), max_retries=self.retries, retry_exceptions=True)
            .remote(fn, t.arg)
            for t in tasks
        ]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
                for ref in ready:
                    i = index[ref]
                    results[i] = self._get(ref, tasks[i])
                    bar.advance(tasks[i].units or 0, tasks[i].note)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        return results

    def _get(self, ref: Any, task: Task[Any]) -> Any:
        try:
            out = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            text = str(exc)
            if "No module named 'eplb'" in text or "No module named 'solvers'" in text:
                raise EplbError("a Ray worker cannot import eplb: install eplb (the same version) on every node "
                                "of the cluster (docs/cluster.md)") from None  # fmt: skip
            last = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
            what = f"task {task.note!r}" if task.note else "a task"
            raise EplbError(f"{what} failed after {self.retries + 1} attempts: {last}") from None
        if isinstance(out, _Failed):
            raise EplbError(out.message)
        return out

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


def _starts_local_ray(address: str | None) -> bool:
    """Whether RayExecutor's address starts a new Ray on this machine (no address, or `local`; of num_cpus CPUs)
    rather than joining a cluster's."""
    return address is None or address == "local"


def _local_cpus(num_cpus: object, address: str | None) -> int | None:
    """RayExecutor's num_cpus: None, or a whole number >= 1 for the local Ray it starts (no address, or `local`; a Ray
    of 0 CPUs runs no task: `map` would wait forever); EplbError otherwise, and for num_cpus with the address of a
    cluster to join (whose CPUs are its own)."""
    if num_cpus is None:
        return None
    count = whole_number(num_cpus)
    if count is None or count < 1:
        raise EplbError(f"num_cpus must be a whole number >= 1 (the CPUs of the local Ray), got {num_cpus!r}")
    if not _starts_local_ray(address):
        raise EplbError(f"num_cpus sizes the local Ray eplb starts (no address, or 'local'); the cluster at "
                        f"{address!r} has its own CPUs: leave num_cpus out")
    return count


RAY_CLIENT = "ray://"
RAY_ADDRESS = "RAY_ADDRESS"
"""The environment variable Ray's `auto` joins first."""
PROBE_TIMEOUT_S = 5.0
"""Seconds `RayExecutor` waits for a TCP connection to the cluster's address before ray.init."""
_UNPROBED = ("auto", "local")


def ray_endpoint(address: str, flag: str | None = None) -> tuple[str, int] | None:
    """The (host, port) of a Ray address to join, None for `auto` and `local` (no one place to reach); EplbError naming
    the address (`flag`'s words) for what is no Ray address: empty, an http(s) URL (the dashboard's or the job server's,
    not the cluster's), another scheme, no port or a port outside 1-65535."""
    given = f"{flag} {address!r}" if flag else f"address {address!r}"
    accepted = "give auto, the head's GCS address HOST:6379, or the Ray client's ray://HOST:10001"
    if not isinstance(address, str):
        raise EplbError(f"{given} is not a string (it is {type(address).__name__}): {accepted}, or leave it out "
                        "to start a local Ray")
    if not address.strip():
        raise EplbError(f"{given} is empty: {accepted}, or leave it out to start a local Ray")
    address = address.strip()
    if address in _UNPROBED:
        return None
    rest = address[len(RAY_CLIENT):] if address.startswith(RAY_CLIENT) else address
    if "://" in rest:
        scheme = rest.split("://", 1)[0]
        what = "an HTTP URL (Ray's dashboard or job server, port 8265, takes no tasks)" if scheme.lower() in (
            "http", "https") else f"a {scheme}:// URL"
        raise EplbError(f"{given} is {what}: {accepted}")
    host, colon, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not colon or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise EplbError(f"{given} needs a host and a port from 1 to 65535: {accepted}")
    return host, int(port)


def make_executor(name: str, address: str | None = None) -> Executor:
    """The executor the CLI's `--executor NAME [--ray-address ADDR]` asks for."""
    if name == "local":
        if address is not None:
            raise EplbError("--ray-address needs --executor ray")
        return LocalExecutor()
    if name == "ray":
        return RayExecutor(address, flag="--ray-address")
    raise EplbError(f"unknown executor {name!r}: choose from {', '.join(EXECUTORS)}")


def portable(log: RoutingLog) -> RoutingLog | str:
    """What to send a worker for `log`: its absolute path when it is a file or directory (the worker opens it: a
    memory-mapped .npy must not travel as its data; a cluster's worker does not run in the driver's directory), else
    the log object itself."""
    path = Path(log.info.path)
    return str(path.absolute()) if path.exists() else log


def reopen(log: RoutingLog | str) -> RoutingLog:
    """The worker's side of `portable`."""
    return open_log(log) if isinstance(log, str) else log


# --------------------------------------------------------------------------------------------
# Replays on an executor
# --------------------------------------------------------------------------------------------


def layer_parts(num_layers: int, parts: int) -> list[range]:
    """[0, L) cut into `parts` consecutive ranges of nearly equal size (fewer when L < parts)."""
    edges = np.linspace(0, num_layers, min(max(1, parts), num_layers) + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]


def splits_by_layer(schedule: Schedule, cost: CostSetup | None, options: Options | None = None) -> bool:
    """True when a replay's layers are independent, so that replaying layer ranges apart and merging
    gives the same numbers: a periodic trigger (threshold and cost decide on all layers together), no
    cost model (weight moves are timed over all layers' copies, which shifts when a placement serves),
    no move budget for the whole model (`options.max_moves`) and no robust refinement (not checked)."""
    budget = options is not None and options.max_moves is not None
    return schedule.trigger == "periodic" and cost is None and not budget and schedule.robust_windows is None


class _LayerSlice(RoutingLog):
    """Layers `layers` of a log (positions unchanged); Parquet logs read only those columns."""

    def __init__(self, log: RoutingLog, layers: range) -> None:
        self.inner, self.layers = log, layers
        ids = log.info.layer_ids
        self.info = replace(log.info, num_layers=len(layers),
                            layer_ids=None if ids is None else ids[layers.start : layers.stop])  # fmt: skip

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        for chunk in self.inner.iter_counts(chunk_steps):
            yield chunk.steps, chunk.counts[:, self.layers.start : self.layers.stop]


def _open_layers(log: RoutingLog | str, layers: range | None) -> RoutingLog:
    if layers is None:
        return reopen(log)
    if isinstance(log, str) and (log.lower().endswith(".parquet") or Path(log).is_dir()):
        from eplb.io.parquet import open_parquet

        return open_parquet(log, layers=layers)
    return _LayerSlice(reopen(log), layers)


@dataclass(frozen=True)
class _Part:
    """One replay task: a log (or its path), the layers to replay (None: all), replay's arguments."""

    log: RoutingLog | str
    layers: range | None
    cluster: Cluster
    kwargs: dict[str, Any]
    blocks: bool
    stream: Callable[[StepBlock], None] | None = None  # local, whole log: blocks go straight there


@dataclass
class _PartResult:
    result: ReplayResult
    stats: dict[str, RowStats]
    blocks: list[StepBlock] = field(default_factory=list)


def _replay_part(part: _Part, report: Report) -> _PartResult:
    log = _open_layers(part.log, part.layers)
    stats = {name: RowStats() for name in BASELINES}
    blocks: list[StepBlock] = []

    def on_steps(block: StepBlock) -> None:
        block.add_to(stats)
        if part.stream is not None:
            part.stream(block)
        elif part.blocks:
            blocks.append(block)

    result = replay(log, part.cluster, on_steps=on_steps, progress=report, **part.kwargs)
    return _PartResult(result, stats, blocks)


def replay_logs(
    executor: Executor,
    logs: Sequence[RoutingLog | str | Path | NDArray[Any]],
    cluster: Cluster,
    *,
    schedule: Schedule | None = None,
    solver: str = "greedy",
    cost: CostSetup | None = None,
    parts: int | None = None,
    on_steps: Callable[[int, StepBlock], None] | None = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> list[ReplayResult]:
    """`eplb.replay.replay` of every log on `executor`: one task per log, and each log cut into `parts`
    layer ranges (default: the executor's CPUs on a Ray cluster, 1 locally) when `splits_by_layer`
    allows. The results equal a plain `replay` of each log (timings apart; `summary["timing"]` adds the
    parts' times). kwargs: the rest of `replay`'s arguments (not on_steps, progress, collect).
    on_steps(i, block): every StepBlock of log i in order, all layers (the parts' blocks are kept
    until their log is done: memory steps x layers x 12 floats)."""
    sched = schedule or Schedule()
    sched.check()
    for bad in ("on_steps", "progress", "collect"):
        if bad in kwargs:
            raise EplbError(f"replay_logs takes no {bad!r}")
    opened = [as_log(log) for log in logs]
    split = splits_by_layer(sched, cost, kwargs.get("options"))
    n_parts = parts if parts is not None else (executor.node_cpus() if isinstance(executor, RayExecutor) else 1)
    args = dict(schedule=sched, solver=solver, cost=cost, **kwargs)
    tasks: list[Task[_Part]] = []
    owner: list[int] = []
    for i, log in enumerate(opened):
        info = log.info
        sent = portable(log) if isinstance(executor, RayExecutor) else log
        ranges: list[range | None] = list(layer_parts(info.num_layers, n_parts)) if split else [None]
        if len(ranges) == 1:
            ranges = [None]
        for layers in ranges:
            note = Path(info.path).name + ("" if layers is None else f" layers {layers.start}-{layers.stop - 1}")
            stream = None
            if on_steps is not None and layers is None and not isinstance(executor, RayExecutor):
                stream = functools.partial(on_steps, i)
            part = _Part(sent, layers, cluster, args, on_steps is not None and stream is None, stream)
            tasks.append(Task(part, info.num_steps, note))
            owner.append(i)
    started = time.perf_counter()
    done = executor.map(_replay_part, tasks, label="replay", unit="steps", progress=progress)
    wall = time.perf_counter() - started
    results = []
    for i, log in enumerate(opened):
        mine = [r for r, o in zip(done, owner, strict=True) if o == i]
        merged = mine[0].result if len(mine) == 1 else _merge(log.info, mine, wall)
        merged = _named_as_given(merged, log.info.path)
        if on_steps is not None:
            for block in _merged_blocks(mine):
                on_steps(i, block)
        results.append(merged)
    return results


def _named_as_given(result: ReplayResult, path: str) -> ReplayResult:
    """`result` naming its log by `path`, the driver's: a Ray worker opened the log's absolute path (`portable`)."""
    summary = {**result.summary, "log": {**result.summary["log"], "path": path}}
    return replace(result, info=replace(result.info, path=path), summary=summary)


def _merged_blocks(parts: list[_PartResult]) -> Iterator[StepBlock]:
    """The parts' StepBlocks side by side: the same steps, layers concatenated in order."""
    if len(parts) == 1:
        yield from parts[0].blocks
        return
    names = [n for n in StepBlock.__dataclass_fields__ if n not in ("start", "steps", "oracle_sampled")]
    for group in zip(*(p.blocks for p in parts), strict=True):
        first = group[0]
        arrays = {n: np.concatenate([getattr(b, n) for b in group], axis=1) for n in names}
        yield StepBlock(first.start, first.steps, oracle_sampled=first.oracle_sampled, **arrays)


def _merge_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Solver reports of layer ranges -> one: per-layer lists concatenated, *_ms summed, the rest the
    first part's."""
    out = dict(infos[0])
    for key, value in infos[0].items():
        values = [info.get(key) for info in infos]
        if isinstance(value, list):
            out[key] = [v for part in values for v in (part or [])]
        elif key.endswith("_ms") and all(isinstance(v, int | float) for v in values):
            out[key] = float(sum(values))  # type: ignore[arg-type]
    return out


def _merge_rebalance(parts: list[Rebalance]) -> Rebalance:
    first = parts[0]
    moved = [p.bytes_moved for p in parts]
    return replace(
        first,
        moves=sum(p.moves for p in parts),
        moves_per_layer=np.concatenate([p.moves_per_layer for p in parts]),
        bytes_moved=None if any(b is None for b in moved) else float(sum(b for b in moved if b is not None)),
        solve_ms=round(sum(p.solve_ms for p in parts), 3),
        window_lb=np.concatenate([p.window_lb for p in parts]),
        solver_info=_merge_info([p.solver_info for p in parts]),
    )


def _merge_placements(parts: list[Placement | None]) -> Placement | None:
    if any(p is None for p in parts):
        return None
    ps = [p for p in parts if p is not None]
    shares = [p.shares for p in ps if p.shares is not None]
    return Placement(np.concatenate([p.phy2log for p in ps]), ps[0].slots_per_gpu, ps[0].num_experts,
                     np.concatenate(shares) if len(shares) == len(ps) else None)


def _merge(info: LogInfo, parts: list[_PartResult], wall: float) -> ReplayResult:
    """One ReplayResult from the replays of a log's layer ranges (same schedule, same checks)."""
    results = [p.result for p in parts]
    first = results[0]
    rebalances = [_merge_rebalance(list(group)) for group in zip(*(r.rebalances for r in results), strict=True)]
    stats = {name: RowStats.merged([p.stats[name] for p in parts]) for name in BASELINES}
    summary = dict(first.summary)
    summary["log"] = {**first.summary["log"], "layers": info.num_layers}
    base = stats["no_eplb"].to_dict()
    rows: dict[str, Any] = {}
    for name in BASELINES:
        d = stats[name].to_dict()
        if d.get("total_time_s") and base.get("total_time_s"):
            d["speedup_vs_no_eplb"] = round(base["total_time_s"] / d["total_time_s"], 4)
        rows[name] = d
    if stats["hindsight"].count:
        rows["replay"]["hindsight_ratio"] = round(stats["replay"].lb_mean / stats["hindsight"].lb_mean, 6)
    summary["results"] = rows
    slots = int(first.cluster.slots_per_gpu.sum())
    moves = sum(r.moves for r in rebalances)
    moved = [r.bytes_moved for r in rebalances]
    summary["rebalances"] = {
        **first.summary["rebalances"],
        "moves": moves,
        "moves_per_rebalance": round(moves / len(rebalances), 1) if rebalances else None,
        "slots_moved_fraction": round(moves / len(rebalances) / (info.num_layers * slots), 6) if rebalances else None,
        "bytes_moved": None if any(b is None for b in moved) else float(sum(b for b in moved if b is not None)),
        "solve_ms_mean": round(float(np.mean([r.solve_ms for r in rebalances])), 3) if rebalances else None,
        "solve_ms_max": round(max(r.solve_ms for r in rebalances), 3) if rebalances else None,
        "list": [r.to_dict() for r in rebalances],
    }
    timing = {k: round(sum(r.summary["timing"].get(k) or 0.0 for r in results), 3)
              for k in first.summary["timing"] if k.endswith("_s")}  # fmt: skip
    layer_steps = first.summary["log"]["steps"] * info.num_layers
    timing["wall_s"] = round(wall, 3)
    timing["layer_steps_per_s"] = round(layer_steps / wall, 1) if wall > 0 else None
    ev = timing.get("evaluation_s") or 0.0
    timing["evaluation_layer_steps_per_s"] = round(layer_steps / ev, 1) if ev > 0 else None
    summary["timing"] = {**first.summary["timing"], **timing, "parts": len(parts)}
    checks = [dict(c) for c in first.checks]
    for c, group in zip(checks, zip(*(r.checks for r in results), strict=True), strict=True):
        if "moves" in c:
            c["moves"] = sum(g.get("moves", 0) for g in group)
    steps = None
    if all(r.steps is not None for r in results):
        steps = next(_merged_blocks([_PartResult(r, {}, [r.steps]) for r in results if r.steps is not None]))
    return ReplayResult(
        info=info,
        cluster=first.cluster,
        schedule=first.schedule,
        solver=first.solver,
        rebalances=rebalances,
        summary=summary,
        final=_merge_placements([r.final for r in results]) or first.final,
        static=_merge_placements([r.static for r in results]),
        steps=steps,
        checks=checks,
    )


# --------------------------------------------------------------------------------------------
# The command line's options
# --------------------------------------------------------------------------------------------


def add_executor_options(p: argparse.ArgumentParser) -> None:
    """--executor local|ray and --ray-address (read back with `executor_from`)."""
    g = p.add_argument_group("where the work runs")
    g.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: here, one task after the other (default); ray: Ray tasks (pip install 'eplb[ray]')")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="Ray cluster to join (auto, HOST:6379, ray://HOST:10001); default: start a local Ray")


def executor_from(args: argparse.Namespace) -> Executor:
    """The executor of `add_executor_options`' arguments (close it when done: `with executor_from(args)`)."""
    return make_executor(args.executor, args.ray_address)
