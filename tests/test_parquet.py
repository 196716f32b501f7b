"""Parquet routing logs: shards by time range, readers of a part, `eplb logs convert` round trips."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.logs import CountsChunk, open_log, read_counts, write_counts, write_jsonl
from eplb.io.parquet import open_parquet, write_parquet
from eplb.synth import SynthConfig, synth_log


@pytest.fixture(scope="module")
def counts() -> np.ndarray:
    return synth_log(SynthConfig(steps=300, layers=5, experts=16, top_k=2, tokens=64, seed=3, hot_ratio=4))


def test_shards_hold_time_ranges_and_read_back(tmp_path: Path, counts: np.ndarray) -> None:
    out = tmp_path / "log.parquet"
    steps = np.arange(1000, 1000 + 3 * counts.shape[0], 3)
    chunks = open_log(_npz(tmp_path, counts, steps=steps)).iter_counts(64)
    assert write_parquet(out, chunks, model="m", top_k=2, layer_ids=[3, 4, 5, 6, 7], shard_steps=128) == 300
    shards = sorted(out.glob("part-*.parquet"))
    assert [pq.read_metadata(s).num_rows for s in shards] == [128, 128, 44]
    first = pq.read_table(shards[1], columns=["step"]).column("step").to_numpy()
    assert first[0] == steps[128] and first[-1] == steps[255]  # shard 1 is positions 128..255
    log = open_log(out)
    assert (log.info.kind, log.info.num_steps, log.info.model, log.info.top_k) == ("parquet", 300, "m", 2)
    assert log.info.layer_ids == [3, 4, 5, 6, 7]
    whole = log.read_counts()
    np.testing.assert_array_equal(whole.counts, counts)
    np.testing.assert_array_equal(whole.steps, steps)


def test_a_worker_reads_only_its_layers_and_steps(tmp_path: Path, counts: np.ndarray) -> None:
    out = tmp_path / "shards"
    write_parquet(out, counts, shard_steps=100)
    part = open_parquet(out, layers=range(1, 3), positions=range(150, 260))
    assert (part.info.num_layers, part.info.num_steps) == (2, 110)
    read = part.read_counts()
    np.testing.assert_array_equal(read.counts, counts[150:260, 1:3])
    np.testing.assert_array_equal(read.steps, np.arange(150, 260))
    assert [s for s in part.shards if s[1] + s[2] > 150 and s[1] < 260] == part.shards[1:3]
    with pytest.raises(EplbError, match=r"layers 4\.\.5 are not among"):
        open_parquet(out, layers=range(4, 6))


def test_a_missing_shard_is_named(tmp_path: Path, counts: np.ndarray) -> None:
    out = tmp_path / "log.parquet"
    write_parquet(out, counts, shard_steps=100)
    (out / "part-00001.parquet").unlink()
    with pytest.raises(EplbError, match=r"part-00002.parquet: starts at step position 200, but the shards before "
                       r"it end at 100: a shard is missing"):
        open_log(out)


def test_missing_last_shards_are_named(tmp_path: Path, counts: np.ndarray) -> None:
    """A copy of a log without its last shard read as a shorter log, silently (300 steps replayed as 200): the last
    shard records the log's step count and every other shard null, so missing last shards are named; a shard alone
    and a log written before the mark (no `steps` key) still read."""
    out = tmp_path / "log.parquet"
    write_parquet(out, counts, shard_steps=100)
    steps = [json.loads(pq.read_metadata(f).metadata[b"eplb"])["steps"] for f in sorted(out.glob("part-*.parquet"))]
    assert steps == [None, None, 300]
    assert open_log(out).info.num_steps == 300
    (out / "part-00002.parquet").unlink()
    with pytest.raises(EplbError) as caught:
        open_log(out)
    assert str(caught.value) == (f"{out}: its shards end with part-00001.parquet at step position 200, which is not "
                                 "the log's last shard (the last records the log's step count): the shards after it "
                                 "are missing (a copy cut short?)")
    assert open_log(out / "part-00001.parquet").info.num_steps == 100  # a shard by itself
    legacy = tmp_path / "legacy.parquet"
    legacy.mkdir()
    for name in ("part-00000.parquet", "part-00001.parquet"):
        table = pq.read_table(out / name)
        meta = json.loads(pq.read_metadata(out / name).metadata[b"eplb"])
        del meta["steps"]
        pq.write_table(table.replace_schema_metadata({b"eplb": json.dumps(meta).encode()}), legacy / name)
    assert open_log(legacy).info.num_steps == 200


def test_shards_after_the_last_or_a_wrong_count_are_refused(tmp_path: Path, counts: np.ndarray) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_parquet(a, counts[:100], shard_steps=100)  # one shard, the last: steps 100
    write_parquet(b, counts, shard_steps=100)
    (a / "part-00001.parquet").write_bytes((b / "part-00001.parquet").read_bytes())
    with pytest.raises(EplbError, match=r"a.parquet/part-00000.parquet: the log's last shard \(it records the log's "
                       r"100 steps\), but part-00001.parquet follows it: shards of another log\?"):
        open_log(a)
    table = pq.read_table(b / "part-00002.parquet")
    meta = json.loads(pq.read_metadata(b / "part-00002.parquet").metadata[b"eplb"])
    pq.write_table(table.replace_schema_metadata({b"eplb": json.dumps({**meta, "steps": 301}).encode()}),
                   b / "part-00002.parquet")
    with pytest.raises(EplbError, match=r"part-00002.parquet: records the log's 301 steps, but its shards hold 300$"):
        open_log(b)


def test_one_shard_given_alone_is_a_log_of_its_own_steps(
    tmp_path: Path, counts: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/formats.md: every command takes the directory or one `.parquet` shard, any of them (a shard after the
    first was refused: 'starts at step position 77, but the shards before it end at 0')."""
    out = tmp_path / "q.parquet"
    steps = np.arange(counts.shape[0]) * 2 + 7
    write_parquet(out, open_log(_npz(tmp_path, counts, steps=steps)).iter_counts(64), shard_steps=77)
    for i, (a, b) in enumerate([(0, 77), (77, 154), (154, 231), (231, 300)]):
        log = open_log(out / f"part-{i:05d}.parquet")
        assert log.info.num_steps == b - a
        whole = log.read_counts()
        np.testing.assert_array_equal(whole.counts, counts[a:b])
        np.testing.assert_array_equal(whole.steps, steps[a:b])
    part = open_parquet(out / "part-00001.parquet", layers=range(2, 4), positions=range(10, 20))
    np.testing.assert_array_equal(part.read_counts().counts, counts[87:97, 2:4])
    assert main(["replay", str(out / "part-00001.parquet"), "--gpus", "8", "--interval", "20", "--window", "20",
                 "--json", "--no-progress"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["log"]["steps"] == 77


@pytest.mark.parametrize("argv", [["replay", "--help"], ["compare", "--help"], ["logs", "convert", "--help"]])
def test_every_command_reading_a_log_says_it_takes_parquet(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """eplb replay's LOG and eplb compare's --log listed '.npz, .npy or .jsonl' only, though both read Parquet."""
    with pytest.raises(SystemExit):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert (".npz (per-step counts or token-level topk_ids), .npy, .jsonl, or Parquet: a directory of shards or one "
            ".parquet shard") in text  # fmt: skip


def test_corrupt_shard_data_is_one_error_naming_the_shard(tmp_path: Path, counts: np.ndarray) -> None:
    out = tmp_path / "log.parquet"
    write_parquet(out, counts, shard_steps=100)
    _corrupt_data_pages(out / "part-00001.parquet")
    log = open_log(out)  # footers are intact: opening works
    with pytest.raises(EplbError, match=r"part-00001.parquet: unreadable Parquet data"):
        log.read_counts()


def test_an_existing_output_is_refused(tmp_path: Path, counts: np.ndarray) -> None:
    (tmp_path / "x.parquet").mkdir()
    with pytest.raises(EplbError, match="already exists"):
        write_parquet(tmp_path / "x.parquet", counts)


@pytest.mark.parametrize("first", ["npz", "jsonl"])
def test_convert_round_trips_through_every_format(tmp_path: Path, counts: np.ndarray, first: str) -> None:
    steps = np.arange(counts.shape[0]) * 2 + 7
    src = tmp_path / f"src.{first}"
    if first == "npz":
        write_counts(src, counts, model="deepseek-v3", top_k=2, steps=steps, layer_ids=[1, 2, 3, 4, 5])
    else:
        write_jsonl(src, counts, model="deepseek-v3", top_k=2, steps=steps, layer_ids=[1, 2, 3, 4, 5])
    shards = tmp_path / "a.parquet"
    back = tmp_path / ("b.jsonl" if first == "npz" else "b.npz")
    assert main(["logs", "convert", str(src), str(shards), "--shard-steps", "64"]) == 0
    assert main(["logs", "convert", str(shards), str(back)]) == 0
    for path in (shards, back):
        got, info = read_counts(path)
        np.testing.assert_array_equal(got, counts)
        np.testing.assert_array_equal(open_log(path).read_counts().steps, steps)
        assert (info.model, info.top_k, info.layer_ids) == ("deepseek-v3", 2, [1, 2, 3, 4, 5])
    assert len(list(shards.glob("part-*.parquet"))) == 5


@pytest.mark.parametrize("top", [300, 70_000])
def test_a_round_trip_through_every_format_keeps_the_narrowest_dtype(tmp_path: Path, top: int) -> None:
    """npz -> jsonl -> parquet -> npz: every writer stores the counts as the narrowest type they fit (uint16, else
    uint32), so the last npz is the first one's size (the converter widened uint16 to uint32, even npz -> npz)."""
    counts = np.random.default_rng(5).integers(0, top, size=(40, 3, 8)).astype(np.int64)
    want = np.dtype(np.uint16 if top < 2**16 else np.uint32)
    steps = np.arange(40) * 3 + 1
    src = tmp_path / "a.npz"
    write_counts(src, counts, model="m", top_k=2, steps=steps, layer_ids=[4, 5, 6])
    chain = [src, tmp_path / "b.jsonl", tmp_path / "c.parquet", tmp_path / "d.npz", tmp_path / "e.npz"]
    for a, b in itertools.pairwise(chain):
        shards = ["--shard-steps", "16"] if b.suffix == ".parquet" else []  # refused for one-file output
        assert main(["logs", "convert", str(a), str(b), *shards]) == 0
    for path in chain:
        whole = open_log(path).read_counts()
        np.testing.assert_array_equal(whole.counts, counts)
        np.testing.assert_array_equal(whole.steps, steps)
        if path.suffix != ".jsonl":
            assert whole.counts.dtype == want, path
    for shard in (tmp_path / "c.parquet").glob("part-*.parquet"):
        assert pq.read_schema(shard).field("layer_0").type.value_type.to_pandas_dtype() == want
    assert (tmp_path / "d.npz").stat().st_size == (tmp_path / "e.npz").stat().st_size == src.stat().st_size


def test_convert_errors_are_one_line(tmp_path: Path, counts: np.ndarray, capsys: pytest.CaptureFixture[str]) -> None:
    src = _npz(tmp_path, counts)
    assert main(["logs", "convert", str(src), str(tmp_path / "out.csv")]) == 2
    assert "cannot tell the output format from '.csv'" in capsys.readouterr().err
    assert main(["logs", "convert", str(tmp_path / "nope"), str(tmp_path / "o.npz")]) == 2
    assert "routing log not found" in capsys.readouterr().err
    assert main(["logs", "convert", str(src), str(tmp_path / "dir"), "--to", "parquet"]) == 0
    meta = json.loads(pq.read_metadata(tmp_path / "dir" / "part-00000.parquet").metadata[b"eplb"])
    assert meta["format"] == "eplb.counts-parquet/v1" and meta["start"] == 0 and meta["num_experts"] == 16


def _npz(tmp_path: Path, counts: np.ndarray, steps: np.ndarray | None = None) -> Path:
    path = tmp_path / "log.npz"
    write_counts(path, counts, steps=steps)
    return path


def _corrupt_data_pages(path: Path) -> None:
    """Overwrite the first column chunk's pages (the footer, at the end, stays valid)."""
    md = pq.read_metadata(path)
    col = md.row_group(0).column(1)
    start = col.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(raw))


def test_parquet_counts_share_the_log_check(tmp_path: Path, counts: np.ndarray) -> None:
    """A shard written by another tool with counts no window takes is refused like an .npz log, by step."""
    bad = counts.astype(np.uint64)
    bad[150, 2, 5] = 2**63 + 5
    write_parquet(out := tmp_path / "log.parquet", bad, shard_steps=100, dtype=np.uint64)  # the type given: only fit
    with pytest.raises(EplbError) as info:
        open_log(out).read_counts()
    assert str(info.value) == (f"{out}: step 150 (position 150), layer 2, expert 5: count is 9223372036854775813, "
                               "too large for a token count (at most 1e+15)")  # fmt: skip


def test_row_groups_are_1024_steps_whatever_the_chunks(tmp_path: Path) -> None:
    """Row groups followed the chunks the steps came in: `eplb logs convert log.jsonl shards/ --to parquet
    --shard-steps 2000` wrote groups of [48, 952] steps in later shards. Each shard's groups are 1,024 steps, the last
    one shorter (docs/formats.md), and the steps read back the same."""
    counts = np.random.default_rng(0).integers(0, 50, (5000, 2, 4)).astype(np.uint16)
    ids = np.arange(5000, dtype=np.int64)
    chunks = (CountsChunk(a, ids[a : a + 1000], counts[a : a + 1000]) for a in range(0, 5000, 1000))
    out = tmp_path / "shards"
    assert write_parquet(out, chunks, shard_steps=2000) == 5000
    groups = [[md.row_group(g).num_rows for g in range(md.num_row_groups)]
              for md in (pq.read_metadata(f) for f in sorted(out.glob("part-*.parquet")))]  # fmt: skip
    assert groups == [[1024, 976], [1024, 976], [1000]]
    assert [json.loads(pq.read_metadata(f).metadata[b"eplb"])["start"] for f in sorted(out.glob("*.parquet"))] == [
        0, 2000, 4000]  # fmt: skip
    np.testing.assert_array_equal(open_log(out).read_counts().counts, counts)
    jsonl = tmp_path / "log.jsonl"
    write_jsonl(jsonl, counts)
    assert main(["logs", "convert", str(jsonl), str(tmp_path / "cli"), "--to", "parquet", "--shard-steps", "2000"]) == 0
    last = pq.read_metadata(tmp_path / "cli" / "part-00001.parquet")
    assert [last.row_group(g).num_rows for g in range(last.num_row_groups)] == [1024, 976]


def test_shard_metadata_is_read_as_every_json_reader_does(tmp_path: Path, counts: np.ndarray,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A shard's 'eplb' metadata was read with plain json.loads: a key given twice kept the last one, and metadata
    that was no object, not UTF-8, or had no num_layers was a traceback (TypeError, UnicodeDecodeError, KeyError). It
    is read by eplb.io.files.parse_json, as every JSON reader of eplb, and each of these is one error line."""
    write_parquet(tmp_path / "good", counts, shard_steps=1000)
    table = pq.read_table(tmp_path / "good" / "part-00000.parquet")
    good = table.schema.metadata[b"eplb"].decode()
    assert '"num_experts": 16' in good and '"num_layers": 5' in good and '"start": 0' in good
    for name, raw, said in (
        ("twice", good.replace('"num_experts": 16', '"num_experts": 16, "num_experts": 8').encode(),
         "part-00000.parquet: its 'eplb' metadata: key 'num_experts' appears twice in one object (JSON readers keep "
         "only the last); give each key once"),
        ("list", b"[1, 2]", "part-00000.parquet: its 'eplb' metadata is not a JSON object (it holds list)"),
        ("bytes", b"\xff\xfe{", "part-00000.parquet: its 'eplb' metadata is not JSON"),
        ("start", good.replace('"start": 0', '"start": "0"').encode(), "part-00000.parquet: its 'eplb' metadata: "
         "start (the position of the shard's first step) must be a whole number >= 0, got '0'"),
        ("layers", good.replace('"num_layers": 5, ', "").encode(), ": the shards' 'eplb' metadata has no num_layers"),
        ("top_k", good.replace('"top_k": null', '"top_k": "two"').encode(), ": metadata top_k must be a positive "
         "integer, got 'two'"),
    ):  # fmt: skip
        (tmp_path / name).mkdir()
        pq.write_table(table.replace_schema_metadata({b"eplb": raw}), tmp_path / name / "part-00000.parquet")
        with pytest.raises(EplbError) as caught:
            open_log(tmp_path / name)
        assert str(caught.value).startswith(str(tmp_path / name)) and said in str(caught.value), str(caught.value)
        assert main(["logs", "convert", str(tmp_path / name), str(tmp_path / f"{name}.npz")]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
