"""Routing-log formats: every format round-trips, streams in chunks, and bad files name the step or line."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.files import plural
from eplb.io.logs import (
    coactivation,
    open_log,
    read_counts,
    topk_counts,
    write_counts,
    write_jsonl,
    write_log,
    write_topk,
)
from eplb.io.windows import read_window


@pytest.fixture
def counts() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 300, size=(23, 3, 16))


def test_counts_npz_round_trip_with_metadata(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "log.npz"
    steps = np.arange(23) * 10 + 5
    write_counts(path, counts, model="deepseek-v3", top_k=8, steps=steps, layer_ids=[3, 4, 5])
    log = open_log(path)
    assert (log.info.kind, log.info.num_steps, log.info.num_layers, log.info.num_experts) == ("counts", 23, 3, 16)
    assert (log.info.model, log.info.top_k, log.info.layer_ids) == ("deepseek-v3", 8, [3, 4, 5])
    chunks = list(log.iter_counts(5))
    assert [c.start for c in chunks] == [0, 5, 10, 15, 20]
    assert np.array_equal(np.concatenate([c.counts for c in chunks]), counts)
    assert np.array_equal(np.concatenate([c.steps for c in chunks]), steps)
    assert chunks[0].counts.dtype == np.uint16  # smallest type that holds the values
    # the file is a plain npz too: numpy and `eplb solve --loads` read it (summed over steps)
    with np.load(path) as z:
        assert np.array_equal(z["counts"], counts)
    assert np.array_equal(read_window(path).loads, counts.sum(axis=0))


def test_counts_written_from_chunks_known_or_unknown_length(tmp_path: Path, counts: np.ndarray) -> None:
    for num_steps in (23, None):
        path = tmp_path / f"log{num_steps}.npz"
        write_counts(path, (counts[i : i + 4] for i in range(0, 23, 4)), num_steps=num_steps, compress=True)
        again, info = read_counts(path)
        assert np.array_equal(again, counts) and info.num_steps == 23
    with pytest.raises(EplbError, match="num_steps is 30 but the chunks hold 23"):
        write_counts(tmp_path / "x.npz", (counts[i : i + 4] for i in range(0, 23, 4)), num_steps=30)
    assert not (tmp_path / "x.npz").exists() and not (tmp_path / "x.npz.part").exists()


def test_npy_counts_stream(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "log.npy"
    np.save(path, counts.astype(np.int32))
    assert np.array_equal(read_counts(path)[0], counts)


def test_jsonl_round_trip(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "log.jsonl"
    write_jsonl(path, counts, model="m", top_k=2, steps=np.arange(23) * 3, layer_ids=[10, 11, 12])
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 23 * 3
    assert json.loads(lines[1]) == {"step": 0, "layer": 10, "counts": counts[0, 0].tolist()}
    log = open_log(path)
    assert (log.info.model, log.info.top_k, log.info.layer_ids, log.info.num_steps) == ("m", 2, [10, 11, 12], 23)
    whole = log.read_counts()
    assert np.array_equal(whole.counts, counts) and whole.steps.tolist() == list(range(0, 69, 3))


def test_jsonl_without_header_any_layer_order(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    records = [
        {"step": 7, "layer": 1, "counts": [1, 2]},
        {"step": 7, "layer": 0, "counts": [3, 4]},
        {"step": 9, "layer": 0, "counts": [5, 6]},
        {"step": 9, "layer": 1, "counts": [7, 8]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    whole = open_log(path).read_counts()
    assert whole.steps.tolist() == [7, 9]
    assert whole.counts.tolist() == [[[3, 4], [1, 2]], [[5, 6], [7, 8]]]


def test_topk_round_trip_counts_and_coactivation(tmp_path: Path) -> None:
    ids = np.array(
        [  # 4 tokens, 2 layers, k=2; step 0 = tokens 0..2, step 1 = token 3
            [[0, 1], [2, 3]],
            [[1, 0], [2, 0]],
            [[0, 3], [3, 2]],
            [[2, 1], [1, 0]],
        ],
        dtype=np.int16,
    )
    offsets = np.array([0, 3, 4])
    path = tmp_path / "routing.npz"
    write_topk(path, ids, offsets, num_experts=4, model="tiny")
    log = open_log(path)
    assert (log.info.kind, log.info.num_steps, log.info.top_k, log.info.num_experts) == ("topk", 2, 2, 4)
    counts = log.read_counts().counts
    assert counts[0, 0].tolist() == [3, 2, 0, 1] and counts[1, 1].tolist() == [1, 1, 0, 0]
    assert np.array_equal(counts, topk_counts(ids, offsets, 4))
    co = log.coactivation()
    assert co.shape == (2, 4, 4) and np.array_equal(co, co.transpose(0, 2, 1))
    assert co[0, 0, 1] == 2 and co[0, 0, 3] == 1 and co[0, 1, 3] == 0  # tokens choosing both
    assert np.array_equal(np.einsum("lii->li", co), counts.sum(axis=0))
    assert np.array_equal(co, coactivation(ids, 4))


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_files_name_the_step(tmp_path: Path, counts: np.ndarray) -> None:
    npz = tmp_path / "log.npz"
    write_counts(npz, counts)
    step_bytes = 3 * 16 * 2  # uint16
    data = npz.read_bytes()
    start = data.index(b"\x93NUMPY")  # the counts member comes first, stored
    header_len = 10 + int.from_bytes(data[start + 8 : start + 10], "little")
    npz.write_bytes(data[: start + header_len + 11 * step_bytes + 5])
    with pytest.raises(EplbError, match=r"not a readable \.npz archive .*cut short .*: copy it again"):
        open_log(npz)
    npy = tmp_path / "log.npy"
    np.save(npy, counts.astype(np.int32))
    _truncate(npy, 0.5)
    with pytest.raises(EplbError, match=r"truncated: the file ends inside step 11 of 23"):
        open_log(npy)
    jsonl = tmp_path / "log.jsonl"
    write_jsonl(jsonl, counts)
    text = jsonl.read_text()
    jsonl.write_text(text[: len(text) // 2])  # cut inside a line
    log = open_log(jsonl)
    with pytest.raises(EplbError, match=r"line \d+: not valid JSON .* may be truncated"):
        log.read_counts()
    lines = text.splitlines(keepends=True)
    jsonl.write_text("".join(lines[:-1]))  # cut at a line end: the last step lacks its last layer
    with pytest.raises(EplbError, match=r"step 22 \(lines 68-69\) is missing 1 layer: 2; the file may be truncated"):
        open_log(jsonl).read_counts()


def test_bad_counts_files(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, counts=counts[0])
    with pytest.raises(EplbError, match=r"counts must be \[steps, layers, experts\], got shape \[3, 16\]"):
        open_log(path)
    neg = counts.astype(np.int32)
    neg[9, 1, 4] = -2
    np.savez(path, counts=neg, steps=np.arange(23) + 100)
    with pytest.raises(EplbError, match=r"step 109 \(position 9\), layer 1, expert 4: count is -2"):
        open_log(path).read_counts()
    np.savez(path, counts=counts, steps=np.array([0, 1, 2, 5, 4, *range(6, 24)]))
    with pytest.raises(EplbError, match=r"steps out of order: step 4 \(position 4\) comes after step 5"):
        open_log(path)
    np.savez(path, counts=counts, num_experts=np.int64(15))
    with pytest.raises(EplbError, match="metadata says 15 experts, counts have 16"):
        open_log(path)
    np.savez(path, loads=counts[0])
    with pytest.raises(EplbError, match="expected 'counts'"):
        open_log(path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"step": 0, "layer": 0, "counts": [1, 2]}', '{"step": 0, "layer": 0, "counts": [1, 2]}'],
         r"line 2: step 0 has layer 0 twice \(first on line 1\)"),
        (['{"step": 0, "layer": 0, "counts": [1, 2]}', '{"step": 0, "layer": 1, "counts": [1, 2]}',
          '{"step": 1, "layer": 0, "counts": [1, 2]}', '{"step": 2, "layer": 0, "counts": [1, 2]}'],
         r"step 1 \(lines 3-3\) is missing 1 layer: 1"),
        (['{"step": 5, "layer": 0, "counts": [1, 2]}', '{"step": 4, "layer": 0, "counts": [1, 2]}'],
         r"line 2: step 4 comes after step 5; steps out of order"),
        (['{"step": 0, "layer": 0, "counts": [1, 2]}', '{"step": 1, "layer": 0, "counts": [1, -2]}'],
         r"line 2: step 1, layer 0, expert 1: count is -2"),
        (['{"step": 0, "layer": 0, "counts": [1, 2]}', '{"step": 1, "layer": 0, "counts": [1, 2, 3]}'],
         r"line 2: 'counts' must list 2 numbers, got 3 values"),
        (['{"step": 0, "layer": 0, "counts": [1, 2]}', '{"step": 1, "layer": 3, "counts": [1, 2]}'],
         r"line 2: step 1 has layer 3, which the first step does not have"),
        (['{"format": "eplb.counts-jsonl/v1", "num_steps": 3}', '{"step": 0, "layer": 0, "counts": [1, 2]}'],
         r"the file says 3 steps but holds 1"),
    ],
)  # fmt: skip
def test_bad_jsonl_names_the_line_or_step(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(EplbError, match=message):
        open_log(path).read_counts()


def test_bad_topk_files(tmp_path: Path) -> None:
    ids = np.zeros((5, 2, 2), dtype=np.int16)
    ids[:, :, 1] = 1
    path = tmp_path / "bad.npz"
    np.savez(path, topk_ids=ids, step_offsets=np.array([0, 3, 2, 5]), num_experts=np.int64(4))
    with pytest.raises(EplbError, match=r"step_offsets go backwards at step 2.*steps out of order"):
        open_log(path)
    np.savez(path, topk_ids=ids, step_offsets=np.array([0, 3, 6]), num_experts=np.int64(4))
    with pytest.raises(EplbError, match="step_offsets end at token 6, topk_ids has 5 tokens; truncated"):
        open_log(path)
    ids[4, 1, 0] = 9
    np.savez(path, topk_ids=ids, step_offsets=np.array([0, 3, 5]), num_experts=np.int64(4))
    with pytest.raises(EplbError, match=r"step 1, token 4, layer 1: expert id 9 is outside 0\.\.3"):
        open_log(path).read_counts()
    np.savez(path, topk_ids=ids, step_offsets=np.array([0, 5]))
    with pytest.raises(EplbError, match="needs 'num_experts'"):
        open_log(path)


def test_a_log_of_another_format_is_refused_naming_both(tmp_path: Path) -> None:
    """format 'eplb.counts/v9' in an npz and 'eplb.counts-jsonl/v2' in a JSONL header were read as v1 (placement
    files refuse a format they do not read)."""
    counts = np.ones((3, 2, 4), dtype=np.int64)
    np.savez(tmp_path / "v9.npz", counts=counts, format="eplb.counts/v9")
    np.savez(tmp_path / "tk.npz", counts=counts, format="eplb.topk/v1")  # counts that say they are token-level
    np.savez(tmp_path / "topk.npz", topk_ids=np.zeros((2, 2, 1), dtype=np.int16), step_offsets=np.array([0, 2]),
             num_experts=np.int64(4), format="eplb.topk/v2")
    (tmp_path / "v2.jsonl").write_text(json.dumps({"format": "eplb.counts-jsonl/v2"}) + "\n"
                                       + json.dumps({"step": 0, "layer": 0, "counts": [1, 2]}) + "\n")
    for name, said, read in (("v9.npz", "eplb.counts/v9", "eplb.counts/v1"),
                             ("tk.npz", "eplb.topk/v1", "eplb.counts/v1"), ("topk.npz", "eplb.topk/v2", "eplb.topk/v1"),
                             ("v2.jsonl", "eplb.counts-jsonl/v2", "eplb.counts-jsonl/v1")):
        message = f"{tmp_path / name}: format is '{said}', but eplb reads logs like this one as '{read}'"
        with pytest.raises(EplbError, match=f"^{re.escape(message)}$"):
            open_log(tmp_path / name)
        if name.endswith(".npz"):  # read as a load window too
            with pytest.raises(EplbError, match=f"^{re.escape(message)}$"):
                read_window(tmp_path / name)
    np.savez(tmp_path / "v1.npz", counts=counts, format="eplb.counts/v1")
    assert open_log(tmp_path / "v1.npz").read_counts().counts.sum() == 24
    assert read_window(tmp_path / "v1.npz").loads.sum() == 24


def test_unknown_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(EplbError, match="routing log not found"):
        open_log(tmp_path / "nope.npz")
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(EplbError, match=r"unknown routing log type '\.csv'"):
        open_log(tmp_path / "x.csv")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(EplbError, match=r"not a readable \.npz archive"):
        open_log(tmp_path / "junk.npz")


def test_deflated_npz_streams_too(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "c.npz"
    write_counts(path, counts, compress=True)
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("counts.npy").compress_type == zipfile.ZIP_DEFLATED
    assert np.array_equal(np.concatenate([c.counts for c in open_log(path).iter_counts(7)]), counts)


@pytest.mark.parametrize(
    ("dtype", "value", "shown"),
    [
        (np.float64, 1e30, "1e+30, too large for a token count (at most 1e+15)"),
        (np.int64, 2**62, "4611686018427387904, too large for a token count (at most 1e+15)"),
        (np.uint64, 2**63 + 5, "9223372036854775813, too large for a token count (at most 1e+15)"),
        (np.float64, 1.5, "1.5; counts must be whole numbers"),
        (np.float32, np.inf, "inf; counts must be finite"),
        (np.float64, np.nan, "nan; counts must be finite"),
    ],
)
def test_npz_and_npy_counts_are_whole_token_counts(
    tmp_path: Path, counts: np.ndarray, dtype: type, value: float, shown: str
) -> None:
    """The limit and the whole-number rule of a load window and a JSONL log, for every integer and float type."""
    bad: np.ndarray = counts.astype(dtype)
    bad[10, 0, 3] = value
    npz, npy = tmp_path / "c.npz", tmp_path / "c.npy"
    np.savez(npz, counts=bad)
    np.save(npy, bad)
    for path in (npz, npy):
        with pytest.raises(EplbError) as info:
            open_log(path).read_counts()
        assert str(info.value) == f"{path}: step 10 (position 10), layer 0, expert 3: count is {shown}"


def test_counts_up_to_the_limit_read(tmp_path: Path, counts: np.ndarray) -> None:
    for dtype in (np.int64, np.uint64, np.float64):
        fine = counts.astype(dtype)
        fine[4, 2, 7] = 10**15
        np.savez(tmp_path / "c.npz", counts=fine)
        assert open_log(tmp_path / "c.npz").read_counts().counts[4, 2, 7] == 10**15


def test_jsonl_counts_share_the_check(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    for value, shown in ((1.5, "1.5; counts must be whole numbers"), (2**62, "4.611686018427388e+18, too large"),
                         (10**400, "more than 1.8e+308, too large for a token count (at most 1e+15)")):  # fmt: skip
        path.write_text('{"step": 0, "layer": 0, "counts": [1, 2]}\n'
                        f'{{"step": 1, "layer": 0, "counts": [1, {value}]}}\n')  # fmt: skip
        with pytest.raises(EplbError, match=re.escape(f"{path}: line 2: step 1, layer 0, expert 1: count is {shown}")):
            open_log(path).read_counts()


def test_jsonl_without_header_counts_its_steps(tmp_path: Path, counts: np.ndarray) -> None:
    """Replay sizes its window buffer by info.num_steps: a header-less log counts its records when opened."""
    path = tmp_path / "live.jsonl"
    write_jsonl(path, counts, header=False)
    with path.open("a") as f:
        f.write("\n  \n")  # blank lines are no records
    log = open_log(path)
    assert (log.info.num_steps, log.steps_counted) == (23, True)
    assert "23 steps" in log.info.describe()
    with path.open("a") as f:  # a live file grows after it was opened: the log is what it held then
        f.write('{"step": 23, "layer": 0, "counts": ' + json.dumps([1] * 16) + "}\n")
    assert np.array_equal(log.read_counts().counts, counts)
    write_jsonl(path, counts[:20], header=False)  # ... and if it shrank, that is said
    with pytest.raises(EplbError, match="truncated: the file held 23 steps when opened but holds 20"):
        log.read_counts()
    headed = tmp_path / "headed.jsonl"
    write_jsonl(headed, counts)
    assert (open_log(headed).info.num_steps, open_log(headed).steps_counted) == (23, False)


def test_jsonl_header_with_too_few_steps(tmp_path: Path, counts: np.ndarray) -> None:
    path = tmp_path / "under.jsonl"
    write_jsonl(path, counts, steps=np.arange(23) * 2)
    path.write_text(path.read_text().replace('"num_steps": 23', '"num_steps": 10', 1))
    log = open_log(path)
    with pytest.raises(EplbError) as info:
        list(log.iter_counts(4))
    assert str(info.value) == (f"{path}: the file holds more steps than its header says (num_steps 10): step 20 "
                               "(position 10) is past them; correct num_steps or remove it")  # fmt: skip
    seen = []
    with pytest.raises(EplbError, match="holds more steps"):
        for chunk in log.iter_counts(4):
            seen.append(chunk.num_steps)
    assert sum(seen) <= 10  # raised before a step beyond the header's count is handed out


def test_a_log_model_that_is_no_preset_is_named() -> None:
    from eplb.specs import MODEL_PRESETS, named_model

    assert named_model(" DeepSeek-V3 ", "log.npz") is MODEL_PRESETS["deepseek-v3"]
    with pytest.raises(EplbError) as info:
        named_model("nonesuch", "model_bad.npz")
    assert str(info.value).startswith("model_bad.npz: names model 'nonesuch', which is no preset (deepseek-v4.1-flash")
    assert "; give --model NAME or FILE" in str(info.value)


def test_replay_says_when_a_log_model_is_no_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log naming a model no preset has (a typo, a Hugging Face name) is replayed with the preset of its shape, and
    a note says so and how to choose; a log of a shape no preset has replays without times."""
    from eplb.cli import main

    path = tmp_path / "model_bad.npz"
    np.savez(path, counts=np.random.default_rng(0).integers(0, 50, (4, 58, 256)), model="nonesuch")
    assert main(["replay", str(path), "--interval", "2", "--window", "2", "--no-progress", "--oracle-every", "0",
                 "--model", "deepseek-v3"]) == 0  # fmt: skip  # --model overrides the log's model
    capsys.readouterr()
    assert main(["replay", str(path), "--interval", "2", "--window", "2", "--no-progress", "--oracle-every", "0",
                 "--json"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert "names model 'nonesuch', which is no preset" in out.err and "give --model NAME or FILE" in out.err
    assert "using 'deepseek-v3', the preset with its 256 experts and 58 layers" in out.err
    assert json.loads(out.out)["cost"]["model"] == "deepseek-v3"
    small = tmp_path / "foo.npz"
    np.savez(small, counts=np.random.default_rng(0).integers(0, 50, (4, 2, 16)), model="foo")
    assert main(["replay", str(small), "--gpus", "4", "--interval", "2", "--window", "2", "--no-progress",
                 "--json"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert "no preset matches its shape: no times and no bytes" in out.err and json.loads(out.out)["cost"] is None


def test_float16_counts_are_checked_in_float64() -> None:
    """1e15 is inf in float16: the limit is compared in float64, so inf is refused and valid float16 counts pass
    without an overflow warning."""
    import warnings

    from eplb.io.logs import count_problem

    infinite = np.array([[[np.inf, 1.0]]], dtype=np.float16)
    assert count_problem(infinite) == ((0, 0, 0), "count is inf; counts must be finite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count_problem(np.array([[[3.0, 1.0]]], dtype=np.float16)) is None


NOT_NPZ = "--compress deflates an .npz log's members; "
CONVERT = "eplb logs convert: error: "


@pytest.mark.parametrize(("argv", "said"), [
    (["synth", "--out", "OUT/log.jsonl", "--compress"],
     "eplb synth: error: " + NOT_NPZ + "--out OUT/log.jsonl is JSONL, written as plain text: drop --compress, or "
     "name it .npz"),
    (["logs", "convert", "LOG", "OUT/log.jsonl", "--compress"],
     CONVERT + NOT_NPZ + "OUT OUT/log.jsonl is JSONL, written as plain text: drop --compress, or name "
     "it .npz"),
    (["logs", "convert", "LOG", "OUT/log.ndjson", "--compress"], CONVERT + NOT_NPZ + "OUT "
     "OUT/log.ndjson is JSONL"),
    (["logs", "convert", "LOG", "OUT/log.parquet", "--compress"], CONVERT + NOT_NPZ + "OUT "
     "OUT/log.parquet is Parquet, whose shards are always compressed (zstd): drop --compress"),
    (["logs", "convert", "LOG", "OUT/shards", "--to", "parquet", "--compress"], CONVERT + NOT_NPZ +
     "OUT OUT/shards is Parquet"),
    (["logs", "convert", "LOG", "OUT/log.jsonl", "--to", "npz"], CONVERT + "--to npz writes NPZ: OUT "
     "OUT/log.jsonl must end in .npz (a log's format is told from its name when it is read)"),  # written, then
    (["logs", "convert", "LOG", "OUT/log.npz", "--to", "jsonl"], CONVERT + "--to jsonl writes JSONL: OUT "
     "OUT/log.npz must end in .jsonl or .ndjson"),  # 'not valid JSON' reading it back
])  # fmt: skip
def test_compress_for_a_log_it_cannot_deflate_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counts: np.ndarray, argv: list[str], said: str
) -> None:
    """--compress with a .jsonl (eplb synth, eplb logs convert) or Parquet output was silently ignored; now
    refused, naming the flag and the output, before anything is written."""
    from eplb.cli import main

    log = tmp_path / "in.npz"
    write_counts(log, counts)
    out = tmp_path / "out"
    out.mkdir()
    swap = {"LOG": str(log)}
    argv = [swap.get(a, a.replace("OUT/", f"{out}/")) for a in argv]
    assert main(argv + (["--steps", "10", "--layers", "2"] if argv[0] == "synth" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(said.replace("OUT/", f"{out}/")), err
    assert not list(out.iterdir())  # nothing written


@pytest.mark.parametrize("argv", [["synth", "--out", "OUT/log.npz"], ["logs", "convert", "LOG", "OUT/log.npz"]])
def test_compress_deflates_an_npz_log(tmp_path: Path, counts: np.ndarray, argv: list[str]) -> None:
    """The refusal above can fail: with an .npz, --compress deflates every member, and the log reads back."""
    from eplb.cli import main

    log = tmp_path / "in.npz"
    write_counts(log, counts)
    out = tmp_path / "log.npz"
    swap = {"LOG": str(log), "OUT/log.npz": str(out)}
    extra = ["--steps", "10", "--layers", "2", "--experts", "16", "--top-k", "2", "--hot-ratio", "4"] if (
        argv[0] == "synth") else []
    assert main([swap.get(a, a) for a in argv] + extra + ["--compress"]) == 0
    with zipfile.ZipFile(out) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    assert open_log(out).info.num_steps == (10 if argv[0] == "synth" else counts.shape[0])


@pytest.mark.parametrize("name", ["log.jsonl", "log.ndjson", "LOG.JSONL"])
def test_write_log_refuses_compress_for_jsonl_as_the_cli_does(tmp_path: Path, counts: np.ndarray, name: str) -> None:
    """eplb.io.logs.write_log(..., compress=True) to a .jsonl path dropped compress without a word (the CLI refuses
    --compress there): the same check (eplb.io.logs.refuse_compress) in the API's words, before anything is
    written; compress=False and an .npz still write."""
    path = tmp_path / name
    with pytest.raises(EplbError, match=re.escape(f"compress=True deflates an .npz log's members; {path} is JSONL, "
                                                  "written as plain text: drop compress=True, or name it .npz")):
        write_log(path, counts, compress=True)
    assert not list(tmp_path.iterdir())
    write_log(path, counts, compress=False)
    assert open_log(path).read_counts().counts.tolist() == counts.tolist()
    write_log(tmp_path / "log.npz", counts, compress=True)
    with zipfile.ZipFile(tmp_path / "log.npz") as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}


def test_the_documented_jsonl_example_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/formats.md's JSONL example named model deepseek-v3 (256 experts) for 4 experts: eplb replay refused it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text()
    example = re.search(r"```json\n(\{\"format\": \"eplb\.counts-jsonl/v1\".*?)```", doc, re.S)
    assert example is not None
    path = tmp_path / "log.jsonl"
    path.write_text(example.group(1))
    assert main(["replay", str(path), "--gpus", "2", "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["log"]["steps"] == 2 and summary["results"]["no_eplb"]["steps"] == 2


def test_messages_count_one_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'1 shards', '1 steps', '1 layers' read wrong: counts in messages go through eplb.io.files.plural."""
    assert [plural(1, "step"), plural(0, "step"), plural(4000, "step"), plural(1, "entry", "entries"),
            plural(np.int64(2), "entry", "entries")] == ["1 step", "0 steps", "4,000 steps", "1 entry", "2 entries"]
    one = tmp_path / "one.npz"
    write_counts(one, np.full((1, 1, 1), 3))
    assert open_log(one).info.describe() == f"{one}: 1 step x 1 layer x 1 expert"
    assert main(["logs", "convert", str(one), str(tmp_path / "one.parquet")]) == 0
    assert capsys.readouterr().out.strip().endswith(": 1 step x 1 layer x 1 expert in 1 shard")
    write_counts(one, np.full((1, 1, 4), 3))
    assert main(["replay", str(one), "--gpus", "2", "--no-progress"]) == 0
    assert "\nreplayed 1 step x 1 layer in " in capsys.readouterr().out
    with pytest.raises(EplbError, match=r"^write_counts: num_steps is 2 but the chunks hold 1 step$"):
        write_counts(tmp_path / "x.npz", iter([np.ones((1, 2, 4))]), num_steps=2)
    with pytest.raises(EplbError, match=r"^steps lists 1 id for 2 steps$"):
        write_jsonl(tmp_path / "x.jsonl", np.ones((2, 1, 4)), steps=[5])
    with pytest.raises(EplbError, match=r"^the log to write: layer_ids lists 1 layer but the counts have 2 rows: "):
        write_counts(tmp_path / "x.npz", np.ones((2, 2, 4)), layer_ids=[3])
    short = tmp_path / "short.jsonl"
    short.write_text('{"num_steps": 2}\n{"step": 0, "layer": 0, "counts": [1, 2]}\n')
    with pytest.raises(EplbError, match=r"truncated: the file says 2 steps but holds 1; step 1 is missing"):
        open_log(short).read_counts()


def test_each_source_is_read_once_when_converted_to_the_narrowest_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log whose file's type does not tell its largest count (JSONL, token-level, uint32, int64) was read twice by
    eplb logs convert and the counts writers: a whole pass for the type (narrowest_dtype), then the copy; JSONL parsed
    twice, token-level logs counted twice. Now once, the type still the narrowest (uint16 here), steps kept."""
    from collections.abc import Callable, Iterator

    from eplb.io.logs import CountsChunk, RoutingLog
    from eplb.io.parquet import write_parquet

    reads: list[str] = []
    iter_counts = RoutingLog.iter_counts

    def counted(self: RoutingLog, chunk_steps: int = 256) -> Iterator[CountsChunk]:
        reads.append(self.info.path)
        yield from iter_counts(self, chunk_steps)

    rng = np.random.default_rng(3)
    counts = rng.integers(0, 300, size=(30, 2, 8))
    steps = np.arange(30) * 2 + 7
    ids = np.argsort(rng.random((90, 2, 8)), axis=2)[:, :, :2]  # [tokens, layers, k] distinct experts
    offsets = np.arange(0, 91, 3)
    sources: dict[str, Callable[[Path], None]] = {
        "log.jsonl": lambda p: write_jsonl(p, counts, steps=steps),
        "wide.npz": lambda p: write_counts(p, counts, steps=steps, dtype=np.uint32),
        "wide.npy": lambda p: np.save(p, counts.astype(np.int64)),
        "topk.npz": lambda p: write_topk(p, ids, offsets, num_experts=8),
    }
    monkeypatch.setattr(RoutingLog, "iter_counts", counted)
    for name, make in sources.items():
        src = tmp_path / name
        make(src)
        want = topk_counts(ids, offsets, 8) if name == "topk.npz" else counts
        for out in (tmp_path / f"{name}.npz", tmp_path / f"{name}.parquet", tmp_path / f"cli-{name}.npz"):
            reads.clear()
            if out.name.startswith("cli-"):
                assert main(["logs", "convert", str(src), str(out)]) == 0
            elif out.suffix == ".parquet":
                write_parquet(out, open_log(src))
            else:
                write_counts(out, open_log(src))
            assert reads.count(str(src)) == 1, (name, out.name, reads)
            reads.clear()
            back = open_log(out).read_counts()
            np.testing.assert_array_equal(back.counts, want)
            assert back.counts.dtype == np.uint16, (name, out.name)
            if name in ("log.jsonl", "wide.npz"):  # the others number their steps 0, 1, ...
                np.testing.assert_array_equal(back.steps, steps)


def test_one_table_of_names_tells_every_reader_and_writer_the_format(
    tmp_path: Path, counts: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    """eplb.io.logs.LOG_SUFFIXES is the one table (eplb logs convert kept two copies, the readers their own): every
    name in it, in any case, is written by eplb logs convert (the formats it writes) and write_log, and read back by
    open_log as its format; .npy is read only."""
    from eplb.cli.logs import WRITTEN
    from eplb.io.logs import LOG_SUFFIXES, log_format

    src = tmp_path / "src.npz"
    write_counts(src, counts)
    kinds = {"npz": "counts", "jsonl": "jsonl", "parquet": "parquet"}
    for fmt, names in LOG_SUFFIXES.items():
        for name in (*names, *(n.upper() for n in names)):
            assert log_format(f"a/log{name}") == fmt
            if fmt not in WRITTEN:
                continue
            out = tmp_path / f"{fmt}-log{name}"
            assert main(["logs", "convert", str(src), str(out)]) == 0, capsys.readouterr().err
            log = open_log(out)
            assert log.info.kind == kinds[fmt] and log.read_counts().counts.tolist() == counts.tolist()
            if fmt != "parquet":
                write_log(tmp_path / f"w{name}", counts)
                assert open_log(tmp_path / f"w{name}").read_counts().counts.tolist() == counts.tolist()
    assert log_format("log.csv") is None and log_format("log") is None
    np.save(tmp_path / "c.npy", counts)
    assert open_log(tmp_path / "c.npy").read_counts().counts.tolist() == counts.tolist()
    assert main(["logs", "convert", str(src), str(tmp_path / "x.npy")]) == 2
    assert "cannot tell the output format from '.npy': name it .npz, .jsonl or .parquet" in capsys.readouterr().err


@pytest.mark.parametrize("ids, why", [
    ([5, 3], "layer 3 comes after layer 5"),
    ([2, 2], "layer 2 appears twice"),
    ([3], "layer_ids lists 1 layer but the counts have 2 rows"),
    ([-1, 2], "layer -1 is negative"),
])
def test_a_logs_layer_ids_follow_the_placements_rule_when_written_and_read(
        tmp_path: Path, ids: list[int], why: str) -> None:
    """A log's rows are model layers in increasing order, as windows and placements hold them: `eplb replay` took
    [5, 3] from a log that the same file read as a window refused, and the writers wrote such logs."""
    from eplb.io.parquet import write_parquet

    c = np.ones((4, 2, 8), dtype=np.int64)
    for name, write in (("w.npz", write_counts), ("w.jsonl", write_jsonl), ("w_parquet", write_parquet)):
        with pytest.raises(EplbError, match=re.escape(why)):
            write(tmp_path / name, c, layer_ids=ids)
        assert not (tmp_path / name).exists()
    np.savez(tmp_path / "r.npz", counts=c, format=np.array("eplb.counts/v1"), num_experts=np.array(8),
             layer_ids=np.array(ids))
    head = {"format": "eplb.counts-jsonl/v1", "num_experts": 8, "num_layers": 2, "layer_ids": ids}
    records = [{"step": s, "layer": j, "counts": [1] * 8} for s in range(2) for j in range(2)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in [head, *records]) + "\n")
    for name in ("r.npz", "r.jsonl"):
        with pytest.raises(EplbError, match=re.escape(f"r.{name.split('.')[1]}") + ".*" + re.escape(why)):
            open_log(tmp_path / name)
    write_parquet(tmp_path / "ok_parquet", c, layer_ids=[3, 5])
    assert open_log(tmp_path / "ok_parquet").info.layer_ids == [3, 5]


def test_per_step_json_loads_are_a_window_as_documented(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb import-load --keep-steps --out x.json` writes "loads" as [steps][layers][E], which docs/formats.md did
    not document (only [layers][E]): `eplb solve` sums it over the steps, `eplb replay` refuses a .json, and the same
    import written as .npz replays. The load window table says so."""
    counts = np.random.default_rng(0).integers(0, 20, (3, 2, 4))
    recorded = tmp_path / "vllm.json"
    recorded.write_text(json.dumps({"counts": counts.tolist()}))
    window, log = tmp_path / "x.json", tmp_path / "x.npz"
    for out in (window, log):
        assert main(["import-load", "--from", "vllm", str(recorded), "--keep-steps", "--out", str(out)]) == 0
    assert np.asarray(json.loads(window.read_text())["loads"]).shape == (3, 2, 4)
    np.testing.assert_array_equal(read_window(window).loads, counts.sum(axis=0))
    assert main(["replay", str(window), "--gpus", "2"]) == 2
    assert "x.json: unknown routing log type '.json'" in capsys.readouterr().err
    assert main(["replay", str(log), "--gpus", "2", "--window", "1", "--interval", "2", "--delay", "0"]) == 0
    text = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `.json` |"))
    assert "[steps][layers][E]" in row and "import-load --keep-steps" in row
    assert "refuse `.json` (`x.json: unknown routing log type '.json'`)" in " ".join(text.split())
