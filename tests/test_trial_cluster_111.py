"""A hostile user of cluster mode: Ray addresses eplb cannot read, and Parquet shard directories whose shards do not
hold the columns their metadata promises. Each is refused with one line naming the address or the shard, when the
log is opened (on the driver, before any Ray task), not as a traceback or a misleading error later."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eplb.errors import EplbError
from eplb.executor import LocalExecutor, RayExecutor, Report, Task, ray_endpoint, replay_logs
from eplb.io.parquet import open_parquet, write_parquet
from eplb.progress import Progress
from eplb.replay import Schedule
from eplb.solve import Cluster


@pytest.mark.parametrize("address", ["head:²", "head:٦٣٧٩", "ray://head:１０００１"])
def test_a_port_of_non_ascii_digits_is_refused_as_no_port(address: str) -> None:
    """'²'.isdigit() is True but int('²') raised ValueError (a traceback); Arabic-Indic digits reached the probe."""
    with pytest.raises(EplbError, match=r"^--ray-address .* needs a host and a port from 1 to 65535"):
        ray_endpoint(address, "--ray-address")


def _log(tmp_path: Path) -> Path:
    """A 3-shard log: 30 steps x 3 layers x 8 experts, uint16 counts."""
    counts = np.random.default_rng(0).integers(0, 50, size=(30, 3, 8))
    path = tmp_path / "log.parquet"
    write_parquet(path, counts, shard_steps=10)
    return path


def _rewrite(shard: Path, change: Callable[[Any], Any]) -> None:
    """Rewrite a shard's table through `change`, keeping its schema's 'eplb' metadata."""
    table = pq.read_table(shard)
    meta = table.schema.metadata
    pq.write_table(change(table).replace_schema_metadata(meta), shard)


def _wide(table: Any) -> Any:
    """The table with its counts as int64 lists (the first shard's are uint16)."""
    fields = [f if f.name == "step" else pa.field(f.name, pa.list_(pa.int64(), 8)) for f in table.schema]
    return table.cast(pa.schema(fields))


def test_a_shard_whose_counts_have_another_type_is_refused_at_open(tmp_path: Path) -> None:
    """Shard 1 of int64 counts among uint16 ones was read as uint16 (the first shard's type): converting the log
    failed with 'counts in steps 10..19 do not fit uint16' for counts that fit its own type."""
    path = _log(tmp_path)
    _rewrite(path / "part-00001.parquet", _wide)
    with pytest.raises(EplbError, match=r"part-00001\.parquet: its columns differ from the first shard's .*layer_0"):
        open_parquet(path)


def test_a_shard_without_a_layer_column_is_refused_at_open(tmp_path: Path) -> None:
    """It failed only when a worker read it: 'unreadable Parquet data ('Field "layer_2" does not exist in schema')'."""
    path = _log(tmp_path)
    for shard in sorted(path.glob("part-*.parquet")):
        _rewrite(shard, lambda t: t.drop_columns(["layer_2"]))
    with pytest.raises(EplbError, match=r"part-00000\.parquet: no column layer_2 \(the metadata's num_layers is 3"):
        open_parquet(path)


def test_lists_of_another_length_than_num_experts_are_refused_at_open(tmp_path: Path) -> None:
    """It failed on reading with numpy's 'cannot reshape array of size 80 into shape (10,4)'."""
    path = _log(tmp_path)
    for shard in sorted(path.glob("part-*.parquet")):
        table = pq.read_table(shard)
        meta = json.loads(table.schema.metadata[b"eplb"])
        meta["num_experts"] = 4
        pq.write_table(table.replace_schema_metadata({b"eplb": json.dumps(meta).encode()}), shard)
    with pytest.raises(EplbError, match=r"part-00000\.parquet: column layer_0 is .*, expected lists of 4 counts"):
        open_parquet(path)


def test_a_step_column_of_text_is_refused_at_open(tmp_path: Path) -> None:
    path = _log(tmp_path)
    for shard in sorted(path.glob("part-*.parquet")):
        _rewrite(shard, lambda t: t.set_column(0, "step", t.column("step").cast(pa.string())))
    with pytest.raises(EplbError, match=r"part-00000\.parquet: column step is string, expected int64 step ids"):
        open_parquet(path)


def test_nulls_are_named_by_their_column(tmp_path: Path) -> None:
    """The message showed '<pyarrow.lib.ChunkedArray object at 0x7f' where the column's name belongs."""
    path = _log(tmp_path)

    def null_step(table: Any) -> Any:
        col = table.column("layer_1").combine_chunks()
        mask = pa.array([i == 3 for i in range(len(col))])
        arr = pa.FixedSizeListArray.from_arrays(col.flatten(), 8, mask=mask)
        return table.set_column(2, table.schema.field("layer_1"), arr)

    _rewrite(path / "part-00001.parquet", null_step)
    with pytest.raises(EplbError, match=r"part-00001\.parquet: column layer_1 holds nulls; every step needs"):
        list(open_parquet(path).iter_counts(64))


def test_a_valid_log_still_opens_and_reads(tmp_path: Path) -> None:
    path = _log(tmp_path)
    log = open_parquet(path, layers=range(1, 3))
    counts = np.concatenate([c.counts for c in log.iter_counts(7)])
    assert counts.shape == (30, 2, 8)


class _ElsewhereExecutor(RayExecutor):
    """A RayExecutor whose tasks run here but in another working directory, as on a cluster's worker (whose working
    directory is where its raylet started, not the driver's)."""

    def __init__(self, cwd: Path) -> None:
        super().__init__()
        self.cwd = cwd

    def node_cpus(self) -> int:
        return 2

    def _run(self, fn: Callable[[Any, Report], Any], tasks: Sequence[Task[Any]], bar: Progress) -> list[Any]:
        here = os.getcwd()
        os.chdir(self.cwd)
        try:
            return [fn(t.arg, lambda done: None) for t in tasks]
        finally:
            os.chdir(here)


@pytest.mark.parametrize("split", [True, False])
def test_a_relative_log_path_is_opened_by_workers_in_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, split: bool
) -> None:
    """`eplb replay log.parquet --executor ray --ray-address auto` run where the log is: the workers (started by `ray
    start` elsewhere) were sent 'log.parquet' and said 'log.parquet: no such file or directory'. They are sent its
    absolute path; the result names the log as it was given, as the local executor's does."""
    _log(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    schedule = Schedule(trigger="periodic" if split else "threshold", interval=10, window=10)
    args: dict[str, Any] = dict(schedule=schedule, oracle_every=0, progress=False)
    [local] = replay_logs(LocalExecutor(), ["log.parquet"], Cluster([6, 6]), **args)
    [there] = replay_logs(_ElsewhereExecutor(tmp_path / "elsewhere"), ["log.parquet"], Cluster([6, 6]), **args)
    assert there.summary["log"] == local.summary["log"]
    assert there.info.path == "log.parquet"
    assert there.summary["results"] == local.summary["results"]


def test_a_port_that_answers_but_ray_cannot_join_names_token_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head with token authentication joined without RAY_AUTH_MODE=token: the probe connects, Ray retries for 20 s
    and says 'Failed to connect to Ray cluster at 192.0.2.2:6390' (its log lines alone say InvalidAuthToken); the
    message said only that, nothing of what to do."""
    import socket

    import ray

    def refuse(**_: Any) -> None:
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6390")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with pytest.raises(EplbError) as caught:
            RayExecutor(f"127.0.0.1:{port}", flag="--ray-address")._ready()
    message = str(caught.value)
    assert message.startswith(f"cannot reach the Ray cluster at 127.0.0.1:{port}: Failed to connect to Ray cluster at")
    assert f"127.0.0.1:{port} accepts connections but Ray could not join it" in message
    assert "RAY_AUTH_MODE=token" in message and "\n" not in message


@pytest.mark.parametrize("given", [" auto", "auto ", "\tauto\n", " local "])
def test_an_address_with_spaces_around_it_is_the_address(given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """' auto' passed the address check (which strips it) but ray.init got ' auto': 'Invalid address format:  auto'."""
    import ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "remote", lambda fn: fn)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    RayExecutor(given, flag="--ray-address")._ready()
    assert [c["address"] for c in calls] == [given.strip()]


def test_a_null_step_id_is_refused_by_its_column(tmp_path: Path) -> None:
    """A null step id read as -9223372036854775808: 'steps out of order: step 11 comes after step
    -9223372036854775808' mid-log, and taken as the first step's id at position 0."""
    path = _log(tmp_path)

    def null_id(table: Any) -> Any:
        ids = table.column("step").to_pylist()
        ids[0] = None
        return table.set_column(0, table.schema.field("step"), pa.array(ids, pa.int64()))

    _rewrite(path / "part-00000.parquet", null_id)
    with pytest.raises(EplbError, match=r"part-00000\.parquet: column step holds nulls; every step needs its id"):
        list(open_parquet(path).iter_counts(64))
