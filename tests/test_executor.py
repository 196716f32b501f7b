"""Executors on a real local Ray (2 CPUs, started once for the session): the same numbers as the local
executor for a compare sweep and a replay split by layers, retries, one clear error for a log a worker
cannot read, and the command line's --executor."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from eplb.budget import spread_evenly
from eplb.cli import main
from eplb.errors import EplbError
from eplb.executor import LocalExecutor, RayExecutor, Task, layer_parts, make_executor, replay_logs
from eplb.io.logs import open_log, write_counts
from eplb.io.parquet import write_parquet
from eplb.io.windows import read_window
from eplb.replay import Schedule, StepBlock, replay
from eplb.report import cluster_shapes, compare_log, compare_window
from eplb.solve import Cluster
from eplb.synth import SynthConfig, synth_log

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "esft-dsv2lite-law.json"
TIMED = {"solve_ms", "wall_ms", "layer_ms", "timing", "solve_ms_mean", "solve_ms_max", "layer_solve_ms"}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayExecutor]:
    """A local Ray of this module's own (address "local": never a cluster found on the machine), stopped when the
    module ends. A Ray driver whose raylet is gone ends its whole process (exit code 1, its words in a captured
    stderr): one CI run stopped so, mid-suite and unexplained, 7 tests after this module while the Ray it started
    for the whole session still ran."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]  # workers cannot import tests/
    try:
        yield RayExecutor()  # uses the instance above, leaves it running
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    counts = synth_log(SynthConfig(steps=240, layers=6, experts=32, top_k=4, tokens=256, seed=5, hot_ratio=4))
    path = tmp_path_factory.mktemp("logs") / "log.npz"
    write_counts(path, counts, top_k=4)
    return path


def _untimed(value: Any) -> Any:
    """value without wall-clock fields (they differ run to run whatever the executor)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMED}
    if isinstance(value, list | tuple):
        return [_untimed(v) for v in value]
    return value


def test_cli_replay_with_ray_starts_a_local_ray(
    log_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --ray-address: `eplb replay --executor ray` starts its own local Ray (in a fresh process, as a
    user runs it) and prints the same summary as the local executor, and nothing of Ray's. First in the module: the
    module's own Ray is not running yet."""
    args = [str(log_path), "--solver", "greedy", "--gpus", "8", "--redundant", "8", "--window", "40", "--interval",
            "60", "--oracle-every", "4", "--json", "--no-progress"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "eplb.cli", "replay", *args, "--executor", "ray"],
                          capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Ray's start-up warnings ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled
    # ...") were the command's output: ray.init's logging_level keeps them out
    assert proc.stderr == "", proc.stderr[-2000:]
    remote = json.loads(proc.stdout)
    assert main(["replay", *args]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["timing"]["parts"] >= 2  # split by layers over the local Ray's CPUs
    assert _untimed(remote) == _untimed(local)


def test_compare_sweep_on_ray_equals_local(ray_cluster: RayExecutor) -> None:
    loads = read_window(FIXTURE).loads[:3]
    shapes = cluster_shapes(loads.shape[1], [4, 8], [8])
    local = compare_window(loads, shapes, ["greedy", "milp"], None, time_limit_s=0.5, progress=False)
    remote = compare_window(loads, shapes, ["greedy", "milp"], None, time_limit_s=0.5, progress=False,
                            executor=ray_cluster)  # fmt: skip
    assert [(r.solver, r.ep, r.slots_per_gpu) for r in remote] == [(r.solver, r.ep, r.slots_per_gpu) for r in local]
    for a, b in zip(local, remote, strict=True):
        if a.solver == "greedy":  # deterministic: every number equal
            assert _untimed(a) == _untimed(b)
        else:  # MILP under a time limit: never worse than greedy on either executor
            assert b.baseline_lb == a.baseline_lb and len(b.lb) == 3


def test_compare_log_on_ray_equals_local(ray_cluster: RayExecutor, log_path: Path) -> None:
    log = open_log(log_path)
    shapes = [(4, spread_evenly(36, 4)), (8, spread_evenly(40, 8))]
    kwargs: dict[str, Any] = dict(schedule=Schedule(window=40, interval=80), oracle_every=5, progress=False)
    local = compare_log(log, shapes, ["greedy", "deepseek"], None, **kwargs)
    remote = compare_log(log, shapes, ["greedy", "deepseek"], None, executor=ray_cluster, **kwargs)
    assert _untimed(remote) == _untimed(local)
    assert remote[1].replay is not None and remote[1].replay.oracle_lb is not None  # shared from greedy's task


@pytest.mark.parametrize("kind", ["npz", "parquet"])
def test_replay_split_by_layers_equals_one_replay(
    ray_cluster: RayExecutor, log_path: Path, tmp_path: Path, kind: str
) -> None:
    path = log_path
    if kind == "parquet":
        path = tmp_path / "log.parquet"
        write_parquet(path, open_log(log_path).iter_counts(), top_k=4, shard_steps=100)
    cluster = Cluster(spread_evenly(40, 8))
    schedule = Schedule(window=40, interval=60)
    whole = replay(open_log(path), cluster, schedule=schedule, solver="greedy", oracle_every=4, collect=True)
    blocks: list[StepBlock] = []
    got = replay_logs(ray_cluster, [path, path], cluster, schedule=schedule, solver="greedy", oracle_every=4,
                      parts=3, on_steps=lambda i, b: blocks.append(b) if i == 0 else None)  # fmt: skip
    assert got[0].summary["timing"]["parts"] == 3  # each log cut into 3 layer ranges: 6 tasks
    for result in got:
        assert _untimed(result.summary) == _untimed(whole.summary)
        assert _untimed([r.to_dict() for r in result.rebalances]) == _untimed([r.to_dict() for r in whole.rebalances])
        np.testing.assert_array_equal(result.final.phy2log, whole.final.phy2log)
        assert result.checks == whole.checks
    assert whole.steps is not None
    merged = StepBlock.concat(blocks)
    for name in ("lb", "oracle_lb", "static_lb", "no_eplb_lb", "hindsight_lb"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole.steps, name))
    np.testing.assert_array_equal(merged.steps, whole.steps.steps)


def test_layer_parts() -> None:
    assert layer_parts(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert layer_parts(2, 5) == [range(0, 1), range(1, 2)]
    assert layer_parts(5, 1) == [range(0, 5)]


def _fails_once(marker: str, report: Any) -> int:
    """Raise on the first attempt (no marker yet), succeed after; return the attempts."""
    attempts = Path(marker)
    count = int(attempts.read_text()) + 1 if attempts.exists() else 1
    attempts.write_text(str(count))
    if count == 1:
        raise OSError("lost the node (first attempt)")
    return count


def test_a_task_that_fails_once_is_retried(ray_cluster: RayExecutor, tmp_path: Path) -> None:
    markers = [str(tmp_path / f"attempts-{i}") for i in range(3)]
    got = ray_cluster.map(_fails_once, [Task(m, note=f"task {i}") for i, m in enumerate(markers)], label="t",
                          progress=False)  # fmt: skip
    assert got == [2, 2, 2]


def _always_fails(arg: int, report: Any) -> int:
    raise RuntimeError(f"broken task {arg}")


def test_a_task_that_keeps_failing_is_one_error(ray_cluster: RayExecutor) -> None:
    with pytest.raises(EplbError, match=r"task 'boom' failed after 3 attempts: RuntimeError: broken task 7"):
        ray_cluster.map(_always_fails, [Task(7, note="boom")], label="t", progress=False)


def _count_and_open(arg: tuple[str, str], report: Any) -> int:
    """Count the attempt in a file, then read the whole log."""
    counter, path = arg
    with open(counter, "a") as f:
        f.write("x")
    return int(open_log(path).read_counts().counts.sum())


def test_a_worker_that_cannot_read_the_log_gives_one_clear_error(
    ray_cluster: RayExecutor, log_path: Path, tmp_path: Path
) -> None:
    shards = tmp_path / "log.parquet"
    write_parquet(shards, open_log(log_path).iter_counts(), shard_steps=100)
    broken = shards / "part-00001.parquet"
    col = pq.read_metadata(broken).row_group(0).column(3)
    raw = bytearray(broken.read_bytes())
    raw[col.data_page_offset : col.data_page_offset + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    broken.write_bytes(bytes(raw))  # the footer still reads: the driver opens the log, the workers fail
    with pytest.raises(EplbError, match=r"part-00001\.parquet: unreadable Parquet data") as err:
        replay_logs(ray_cluster, [shards], Cluster(spread_evenly(40, 8)), schedule=Schedule(window=40, interval=60),
                    solver="greedy", parts=2)  # fmt: skip
    assert "\n" not in str(err.value)
    counter = tmp_path / "attempts"
    with pytest.raises(EplbError, match=r"part-00001\.parquet"):
        ray_cluster.map(_count_and_open, [Task((str(counter), str(shards)))], label="t", progress=False)
    assert counter.read_text() == "x"  # an EplbError is not retried


def test_cli_compare_with_ray_writes_the_same_runs(
    ray_cluster: RayExecutor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ray"
    assert main(["compare", "--loads", str(FIXTURE), "--layers", "3", "--solvers", "greedy", "--ep", "4,8",
                 "--out", str(out), "--no-progress", "--executor", "ray"]) == 0  # fmt: skip
    loads = read_window(FIXTURE).loads[:3]
    local = compare_window(loads, cluster_shapes(64, [4, 8], None), ["greedy"], None, progress=False)
    got = json.loads((out / "results.json").read_text())["runs"]
    assert [r["lb"] for r in got] == [r.lb for r in local]
    assert [r["baseline_lb"] for r in got] == [r.baseline_lb for r in local]
    assert main(["compare", "--solvers", "greedy", "--out", str(tmp_path / "x"), "--ray-address", "auto"]) == 2
    assert "--ray-address needs --executor ray" in capsys.readouterr().err


def test_without_ray_installed_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(EplbError, match=r"--executor ray needs Ray: pip install 'eplb\[ray\]'"):
        make_executor("ray")
    assert isinstance(make_executor("local"), LocalExecutor)


def _no_ray_yet(monkeypatch: pytest.MonkeyPatch, init: Any) -> None:
    """This process as one in which Ray has not started (the session's instance may run), with `init` as ray.init."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)


def test_inputs_are_checked_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, log_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RayExecutor started Ray when made, before the command read its inputs: `eplb compare --log` of a log shorter
    than the interval failed after Ray's start-up (about 10 s), against 1 s locally. Ray starts on first use now."""

    def init(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init ran before the inputs were checked")

    _no_ray_yet(monkeypatch, init)
    short = "the log has 240 steps but the first rebalanced placement serves from step position 1,001"
    with RayExecutor() as executor, pytest.raises(EplbError, match=short):
        compare_log(open_log(log_path), cluster_shapes(32, [8], None), ["greedy"], None,
                    schedule=Schedule(interval=1000), executor=executor)  # fmt: skip
    assert main(["compare", "--log", str(log_path), "--solvers", "greedy", "--ep", "8", "--interval", "1000",
                 "--out", str(tmp_path / "r"), "--no-progress", "--executor", "ray"]) == 2  # fmt: skip
    assert short in capsys.readouterr().err


def test_no_cluster_at_auto_is_said_in_eplbs_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own words for `auto` with no cluster point at its `--address` flag and RAY_ADDRESS; eplb's flag is
    --ray-address."""

    def init(*args: Any, **kwargs: Any) -> None:  # what ray.init(address="auto") raises with no cluster (Ray 2.x)
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    _no_ray_yet(monkeypatch, init)
    executor = make_executor("ray", "auto")
    with pytest.raises(EplbError) as info:
        executor.node_cpus()
    said = str(info.value)
    assert said.startswith("--ray-address auto found no Ray cluster to join on this machine (auto joins the one "
                           "`ray start` started here, or the one the RAY_ADDRESS environment variable names): "), said
    assert "--ray-address HEAD:6379, or ray://HEAD:10001" in said and "`--address`" not in said
    with pytest.raises(EplbError, match=r"^address 'auto' found no Ray cluster"):  # the Python API's words
        RayExecutor("auto").node_cpus()


def test_the_ray_extra_brings_the_ray_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ray-address ray://head:10001` failed 'Ray Client requires pip package ray[client]': the eplb[ray] extra
    installed only `ray`. It (and the test extra) asks for ray[client] now, whose grpcio this environment then has;
    a Ray without it is told in eplb's terms."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [[r for r in extras[name] if r.startswith("ray")] for name in ("ray", "test")] == [["ray[client]>=2.9"]] * 2
    assert importlib.util.find_spec("grpc") is not None  # what Ray's client needs

    def init(*args: Any, **kwargs: Any) -> None:  # what ray.init("ray://...") raises without ray[client] (Ray 2.x)
        raise ValueError("Ray Client requires pip package `ray[client]`. If you installed the minimal Ray (e.g. `pip "
                         "install ray`), please reinstall by executing `pip install ray[client]`.")

    _no_ray_yet(monkeypatch, init)
    with socket.create_server(("127.0.0.1", 0)) as head:  # something listens there: the address is probed first
        address = f"ray://127.0.0.1:{head.getsockname()[1]}"
        with pytest.raises(EplbError) as info:
            make_executor("ray", address).node_cpus()
    assert str(info.value) == (f"--ray-address {address} needs Ray's client, which this Ray lacks (its grpcio): "
                               "pip install 'eplb[ray]' (it installs ray[client]), or run the command on a node of "
                               "the cluster with --ray-address auto")


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as free:
        return int(free.getsockname()[1])


def test_a_ray_address_where_nothing_answers_or_that_is_no_ray_address_is_one_line_at_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--ray-address 127.0.0.1:6379` with no Ray there ran for minutes, Ray logging 'Failed to connect to GCS' every
    few seconds; `ray://HOST:10001` waited 30 s with a UserWarning for 'ray client connection timeout'; an empty
    address (an unset $VAR) said 'Invalid address format: ', an http:// one spoke of RAY_ADDRESS, which was not set.
    An address that is no Ray address is refused before Ray is called, and one where nothing answers after a TCP
    probe, each in one line naming the address."""

    def init(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was called")

    _no_ray_yet(monkeypatch, init)  # this process's Ray, if another test started it, would take the tasks instead
    port = _closed_port()
    for address, said in (
            (f"127.0.0.1:{port}", f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused at "
                                  f"127.0.0.1:{port} (is Ray's head running there, `ray start --head`, and is {port} "
                                  "its GCS port (6379 by default)?)"),
            (f"ray://127.0.0.1:{port}", f"cannot reach the Ray cluster at ray://127.0.0.1:{port}: Connection refused "
                                        f"at 127.0.0.1:{port} (is Ray's head running there, `ray start --head`, and is "
                                        f"{port} its Ray client server port (10001 by default)?)"),
            ("ray://no-such-host.invalid:10001", "cannot reach the Ray cluster at ray://no-such-host.invalid:10001: no "
                                                 "host 'no-such-host.invalid' ("),
            ("", "--ray-address '' is empty: give auto, the head's GCS address HOST:6379, or the Ray client's "
                 "ray://HOST:10001, or leave it out to start a local Ray"),
            ("http://127.0.0.1:8265", "--ray-address 'http://127.0.0.1:8265' is an HTTP URL (Ray's dashboard or job "
                                      "server, port 8265, takes no tasks): give auto, "),
            ("localhost", "--ray-address 'localhost' needs a host and a port from 1 to 65535: give auto, "),
            ("127.0.0.1:99999", "--ray-address '127.0.0.1:99999' needs a host and a port from 1 to 65535"),
            ("ray:/head", "--ray-address 'ray:/head' needs a host and a port")):
        started = time.monotonic()
        assert main(["compare", "--solvers", "greedy", "--ep", "8", "--layers", "2", "--out", str(tmp_path / "r"),
                     "--no-progress", "--executor", "ray", "--ray-address", address]) == 2  # fmt: skip
        err = capsys.readouterr().err
        assert err.startswith(f"eplb compare: error: {said}") and err.count("\n") == 1, (address, err)
        assert time.monotonic() - started < 10, address
    with pytest.raises(EplbError, match=r"^address 'localhost' needs a host and a port"):  # the Python API's words
        RayExecutor("localhost")
    with pytest.raises(EplbError, match=r"^address 123 is not a string \(it is int\): give auto, "):  # was 'empty'
        RayExecutor(123)  # type: ignore[arg-type]


def test_auto_with_a_ray_address_where_nothing_answers_is_one_line_at_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--ray-address auto` joins RAY_ADDRESS first: one naming a closed port ran for minutes as HOST:6379 did. It is
    probed as the address itself is, and the line says where the address came from."""

    def init(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was called")

    _no_ray_yet(monkeypatch, init)
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    started = time.monotonic()
    assert main(["compare", "--solvers", "greedy", "--ep", "8", "--layers", "2", "--out", str(tmp_path / "r"),
                 "--no-progress", "--executor", "ray", "--ray-address", "auto"]) == 2  # fmt: skip
    assert capsys.readouterr().err == (
        f"eplb compare: error: cannot reach the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS, which --ray-address auto "
        f"joins): Connection refused at 127.0.0.1:{port} (is Ray's head running there, `ray start --head`, and is "
        f"{port} its GCS port (6379 by default)?)\n")
    assert time.monotonic() - started < 10


def test_rays_own_words_are_one_line_of_single_spaces(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RAY_ADDRESS=http://HOST:8265 with --ray-address auto: Ray's message lists its fixes on lines of their own,
    which the one-line error printed as literal '\\n' escapes; another library's message is single-spaced."""

    def init(*args: Any, **kwargs: Any) -> None:
        raise ValueError("Invalid Ray address: 'http://h:8265'. To fix this, either:\n  1. Unset RAY_ADDRESS, or\n"
                         "  2. Set RAY_ADDRESS to the GCS address.")

    _no_ray_yet(monkeypatch, init)
    monkeypatch.setenv("RAY_ADDRESS", "http://h:8265")
    assert main(["compare", "--solvers", "greedy", "--ep", "8", "--layers", "2", "--out", str(tmp_path / "r"),
                 "--no-progress", "--executor", "ray", "--ray-address", "auto"]) == 2  # fmt: skip
    assert capsys.readouterr().err == (
        "eplb compare: error: cannot reach the Ray cluster at auto: Invalid Ray address: 'http://h:8265'. To fix this, "
        "either: 1. Unset RAY_ADDRESS, or 2. Set RAY_ADDRESS to the GCS address.\n")


def test_layer_ranges_with_idle_layers_merge_to_the_whole_replay() -> None:
    """Layers 0-1 idle in the first check's window, layers 2-3 in the last one's: each layer range replayed apart
    sees other empty steps, yet merged the rebalances, steps and lb equal the replay of all layers."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(120, 4, 16)).astype(np.int64)
    counts[:30, :2] = 0
    counts[70:90, 2:] = 0
    cluster = Cluster(np.full(4, 5))
    schedule = Schedule(window=20, interval=30)
    whole = replay(counts, cluster, schedule=schedule, oracle_every=2)
    merged = replay_logs(LocalExecutor(), [counts], cluster, schedule=schedule, parts=2, oracle_every=2)[0]
    assert [(r.position, r.moves_per_layer.tolist()) for r in merged.rebalances] == [
        (r.position, r.moves_per_layer.tolist()) for r in whole.rebalances]
    for name in ("replay", "no_eplb", "oracle"):
        a, b = whole.summary["results"][name], merged.summary["results"][name]
        assert a["steps"] == b["steps"] and a["lb_mean"] == pytest.approx(b["lb_mean"], abs=1e-6)
    assert whole.summary["results"]["replay"]["steps"] == 120
