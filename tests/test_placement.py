"""Placement type, placement files, load windows and slot budgets."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from eplb.budget import GIB, slots_per_gpu, spread_evenly
from eplb.cli import main
from eplb.errors import EplbError, FieldError
from eplb.evaluate import balance, contiguous_placement
from eplb.io.windows import read_window
from eplb.placement import Placement, load_placement, save_placement
from eplb.specs import load_model


def test_derived_views() -> None:
    p = Placement(np.array([[0, 1, 1, 2, 0, 3]]), np.array([2, 2, 2]), 4)
    assert p.replicas.tolist() == [[2, 2, 1, 1]]
    assert p.log2phy.tolist() == [[[0, 4], [1, 2], [3, -1], [5, -1]]]
    assert p.slot_gpu.tolist() == [0, 0, 1, 1, 2, 2]
    assert p.slot_shares().tolist() == [[0.5, 0.5, 0.5, 1.0, 0.5, 1.0]]


@pytest.mark.parametrize(
    ("phy2log", "slots", "shares", "message"),
    [
        ([[0, 1, 1, 1]], [2, 2], None, "expert 2 has no replica in layer 0"),
        ([[0, 1, 2]], [2, 2], None, "slots_per_gpu sums to 4"),
        ([[0, 1, 2, 7]], [2, 2], None, r"phy2log\[0\]\[3\] is 7: expert ids run 0..2"),
        ([[0, 1, 2, -2]], [2, 2], None, r"phy2log\[0\]\[3\] is -2: expert ids run 0..2 \(-1 marks an empty slot\)"),
        ([[0, 1, -1, -1]], [2, 2], None, "expert 2 has no replica in layer 0"),
        ([[0, 1, 2, -1]], [2, 2], [[1, 1, 1, 0.5]], r"slot 3 of layer 0 is empty \(-1\) but has share 0.5"),
        ([[0, 1, 2, 2]], [4, 0], None, "counts >= 1"),
        ([[0, 1, 2, 2]], [2, 2], [[1, 1, 0.5, 0.4]], "expert 2 in layer 0 sum to 0.9, not 1"),
        ([[0, 1, 2, 2]], [2, 2], [[1, 1, 1e308, 0]], r"expert 2 in layer 0 sum to 1e\+308, not 1$"),  # was 309 digits
    ],
)
def test_invalid_placements_are_refused(
    phy2log: list[list[int]], slots: list[int], shares: list[list[float]] | None, message: str
) -> None:
    with pytest.raises(EplbError, match=message):
        Placement(np.array(phy2log), np.array(slots), 3, None if shares is None else np.array(shares))


def test_placement_file_round_trip(tmp_path: Path) -> None:
    shares = np.array([[1, 0.3, 0.7, 1], [1, 1, 0.5, 0.5]])
    p = Placement(np.array([[0, 1, 1, 2], [2, 1, 0, 0]]), np.array([3, 1]), 3, shares)
    save_placement(p, tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["format"] == "eplb.placement/v1" and data["replicas"] == [[1, 2, 1], [2, 1, 1]]
    q = load_placement(tmp_path / "p.json")
    assert q.phy2log.tolist() == p.phy2log.tolist() and q.slots_per_gpu.tolist() == [3, 1]
    assert q.shares is not None and np.allclose(q.shares, p.shares)  # type: ignore[arg-type]


def test_placement_file_errors(tmp_path: Path) -> None:
    with pytest.raises(EplbError, match="not found"):
        load_placement(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(EplbError, match="not valid JSON"):
        load_placement(tmp_path / "bad.json")
    (tmp_path / "nophy.json").write_text('{"slots_per_gpu": [1]}')
    with pytest.raises(EplbError, match="missing field 'phy2log'"):
        load_placement(tmp_path / "nophy.json")
    (tmp_path / "rep.json").write_text('{"phy2log": [[0, 1]], "slots_per_gpu": [1, 1], "replicas": [[2, 1]]}')
    with pytest.raises(EplbError, match="'replicas' does not match"):
        load_placement(tmp_path / "rep.json")


def test_load_window_formats(tmp_path: Path) -> None:
    window = np.array([[1.0, 2, 3], [4, 5, 6]])
    steps = np.stack([window, 2 * window])
    (tmp_path / "w.json").write_text(json.dumps({"loads": window.tolist(), "source": "test"}))
    np.save(tmp_path / "w.npy", window)
    np.save(tmp_path / "s.npy", steps)
    np.savez(tmp_path / "w.npz", loads=window)
    np.savez(tmp_path / "s.npz", counts=steps)
    for name, expected in [("w.json", window), ("w.npy", window), ("s.npy", 3 * window), ("w.npz", window),
                           ("s.npz", 3 * window)]:
        assert read_window(tmp_path / name).loads.tolist() == expected.tolist(), name
    assert read_window(tmp_path / "w.json").meta == {"source": "test"}
    default = read_window(None)
    assert default.loads.shape == (58, 256) and default.loads.sum() == 3_892_314_112


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"loads": [[1, 2], [3]]}', "ragged: row 0 has 2 experts, row 1 has 1"),
        ('{"loads": [[1, -2]]}', r"loads\[0\]\[1\] is -2: loads must be >= 0"),
        ('{"loads": [[1, NaN]]}', r"loads\[0\]\[1\] is nan"),
        ('{"loads": [[1, 1e308]]}', r"loads\[0\]\[1\] is 1e\+308: larger than any token count"),
        ('{"loads": [1, 2, 3]}', "one row of 3 numbers"),
        ('{"loads": []}', "loads is empty: a window holds at least one layer"),
        ('{"counts": [[1]]}', "expected a 'loads' field"),
        ('{"loads": [["a", 1]]}', "must be numbers"),
    ],
)
def test_bad_load_files(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "w.json").write_text(content)
    with pytest.raises(EplbError, match=message):
        read_window(tmp_path / "w.json")


@pytest.mark.parametrize(
    ("layer_ids", "message"),
    [
        ([3], "layer_ids lists 1 layer but the loads have 2 rows: give one model layer per row"),
        (["a", "b"], "layer_ids: must hold only numbers"),
        ([-1, 0], "layer_ids: layer -1 is negative: model layers count from 0"),
        ([5, 3], "layer_ids: layer 3 comes after layer 5"),
        ([4, 4], "layer_ids: layer 4 appears twice"),
        ([3.5, 4], "layer_ids: must be a list of integers"),
        (3, "layer_ids: must be a list of integers"),
    ],
)
def test_a_windows_layer_ids_are_checked_when_it_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layer_ids: object, message: str
) -> None:
    """A window's layer_ids were kept unchecked: [3] for 2 rows crashed eplb solve (IndexError in its summary) and
    made eplb evaluate pick 1 row of a 58-layer placement; ["a", "b"], [-1, 0] and [5, 3] were printed as model
    layers ("model layer a"), refused only by solve --out, in words that did not name the loads file."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"layer_ids": layer_ids, "loads": [[1, 2], [3, 4]]}))
    with pytest.raises(EplbError, match=f"^{re.escape(f'{window}: {message}')}"):
        read_window(window)
    assert main(["solve", "--loads", str(window), "--gpus", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"eplb solve: error: {window}: {message}")
    np.savez(tmp_path / "w.npz", loads=np.array([[1, 2], [3, 4]]), layer_ids=np.array(layer_ids))
    if not isinstance(layer_ids, list) or all(isinstance(v, int) for v in layer_ids):  # npz: no strings to mix
        with pytest.raises(EplbError, match=f"^{re.escape(str(tmp_path / 'w.npz'))}: "):
            read_window(tmp_path / "w.npz")


def test_a_windows_layer_ids_are_kept_from_every_file_type(tmp_path: Path) -> None:
    """JSON windows kept their layer_ids and .npz ones (written by import-load, eplb.io.logs) dropped them."""
    (tmp_path / "w.json").write_text(json.dumps({"layer_ids": [3, 4], "loads": [[1, 2], [3, 4]]}))
    np.savez(tmp_path / "w.npz", loads=np.array([[1, 2], [3, 4]]), layer_ids=np.array([3, 4]))
    np.savez(tmp_path / "s.npz", counts=np.array([[[1, 2], [3, 4]]]), layer_ids=np.array([3, 4]))
    for name in ("w.json", "w.npz", "s.npz"):
        assert read_window(tmp_path / name).meta["layer_ids"] == [3, 4], name
    assert read_window(None).meta["layer_ids"] == list(range(3, 61))


def test_bad_per_step_counts_are_named_as_the_file_holds_them(tmp_path: Path) -> None:
    """[steps, layers, E] counts were summed before they were checked: -1 in every entry of 5 steps read
    'counts[0][0] is -5', and 4.6e18 over 3 steps '1.38e+19', neither of which the file holds."""
    cases = [
        (np.full((5, 2, 4), -1), r"counts\[0\]\[0\]\[0\] is -1: loads must be >= 0"),
        (np.full((3, 2, 4), 2**62), r"counts\[0\]\[0\]\[0\] is 4\.611686018427388e\+18: larger than any token count"),
        (np.array([[[0, 1.0]], [[2, np.nan]]]), r"counts\[1\]\[0\]\[1\] is nan: loads must be finite"),
        (np.full((3, 2, 4), 6e14), r"counts summed over its 3 steps, \[0\]\[0\] is 1800000000000000: larger than any "
                                   "token count"),  # each step's count is one, their sum is not
    ]
    for counts, message in cases:
        np.savez(tmp_path / "s.npz", counts=counts)
        with pytest.raises(EplbError, match=f"^{re.escape(str(tmp_path / 's.npz'))}: {message}"):
            read_window(tmp_path / "s.npz")
        np.save(tmp_path / "s.npy", counts)
        with pytest.raises(EplbError, match=message.replace("counts", "", 1)):
            read_window(tmp_path / "s.npy")


def test_an_npz_of_two_kinds_of_counts_is_refused(tmp_path: Path) -> None:
    """An npz with both loads and counts was read as its loads, one with topk_ids and counts as its token-level
    log, by the window reader and the routing-log reader alike, without a word."""
    from eplb.io.logs import open_log

    window = np.ones((2, 4))
    ids = np.zeros((2, 2, 1), dtype=np.int16)
    np.savez(tmp_path / "both.npz", loads=window, counts=window[None])
    np.savez(tmp_path / "tk.npz", topk_ids=ids, step_offsets=np.array([0, 2]), num_experts=np.int64(4),
             counts=window[None])
    for name, first, second in (("both.npz", "loads", "counts"), ("tk.npz", "counts", "topk_ids")):
        message = f"{tmp_path / name}: holds both '{first}' and '{second}', so which to read is unclear; keep one ("
        for read in (read_window, open_log):
            with pytest.raises(EplbError, match=f"^{re.escape(message)}"):
                read(tmp_path / name)


def test_bad_load_paths(tmp_path: Path) -> None:
    with pytest.raises(EplbError, match="not found"):
        read_window(tmp_path / "nope.json")
    (tmp_path / "w.csv").write_text("1,2")
    with pytest.raises(EplbError, match="unknown load file type"):
        read_window(tmp_path / "w.csv")
    (tmp_path / "t.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(EplbError, match=r"not a readable \.npz"):
        read_window(tmp_path / "t.npz")


def test_budgets() -> None:
    assert spread_evenly(259, 8).tolist() == [33, 33, 33, 32, 32, 32, 32, 32]
    assert slots_per_gpu(8, 256).tolist() == [33] * 8  # default: one redundant per GPU
    assert slots_per_gpu(100, 4).tolist() == [1] * 100  # more GPUs than experts: one slot each (not 1 or 2)
    assert slots_per_gpu(4, 4).tolist() == [2] * 4
    assert slots_per_gpu(8, 256, num_redundant=3).tolist() == [33, 33, 33] + [32] * 5
    assert slots_per_gpu(3, 4, slots=[1, 2, 3]).tolist() == [1, 2, 3]
    v3 = load_model("deepseek-v3")
    # 58 layers x 3 x 7168 x 2048 params at 1 B = 2.38 GiB per slot
    assert v3.expert_bytes_all_layers / GIB == pytest.approx(2.3789, abs=1e-3)
    slot = v3.expert_bytes_all_layers
    assert slots_per_gpu(32, 256, memory_budget_bytes=24 * GIB, slot_bytes=slot).tolist() == [10] * 32
    per_gpu = [20 * GIB] * 16 + [24 * GIB] * 16
    assert slots_per_gpu(32, 256, memory_budget_bytes=per_gpu, slot_bytes=slot).tolist() == [8] * 16 + [10] * 16
    # a budget beyond E slots is capped at E: one copy of every expert per GPU is the most that helps
    assert slots_per_gpu(2, 4, memory_budget_bytes=1000.0, slot_bytes=1.0).tolist() == [4, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slots": 7}, "cannot hold 256 experts: need at least 8 slots per GPU"),
        ({"memory_budget_bytes": 2 * GIB}, "fits no expert"),
        ({"memory_budget_bytes": 18 * GIB}, "give at least 19.03 GiB per GPU"),
        ({"slots": [8, 8]}, "got 2 values for 32 GPUs"),
        ({"num_redundant": -1}, ">= 0"),
    ],
)
def test_budget_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EplbError, match=message):
        slot_bytes = load_model("deepseek-v3").expert_bytes_all_layers
        slots_per_gpu(32, 256, slot_bytes=slot_bytes, **kwargs)  # type: ignore[arg-type]


def test_balance_numbers() -> None:
    loads = np.array([[30.0, 10, 10, 10], [0, 0, 0, 0]])
    base = contiguous_placement(2, 4, 2)
    b = balance(loads, base)
    assert b.gpu_loads.tolist() == [[40, 20], [0, 0]]
    assert b.lb.tolist() == pytest.approx([40 / 30, 1.0])
    assert b.balancedness.tolist() == pytest.approx([0.75, 1.0])
    assert b.imbalance.tolist() == pytest.approx([1 / 3, 0.0])


def test_empty_slots_follow_vllm() -> None:
    """-1 in phy2log is an empty slot (vLLM marks the slots of absent ranks so while EP scales, and skips them
    when moving weights): it holds no expert, gets no tokens and is no replica, but counts in slots_per_gpu."""
    p = Placement(np.array([[0, -1, 1, 2, 0, -1]]), np.array([2, 2, 2]), 3)
    assert p.empty_slots.tolist() == [[False, True, False, False, False, True]]
    assert p.replicas.tolist() == [[2, 1, 1]]
    assert p.log2phy.tolist() == [[[0, 4], [2, -1], [3, -1]]]
    assert p.slot_shares().tolist() == [[0.5, 0.0, 1.0, 1.0, 0.5, 0.0]]
    loads = np.array([[40.0, 30, 10]])
    b = balance(loads, p)
    assert b.gpu_loads.tolist() == [[20, 40, 20]]
    q = Placement.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q.phy2log.tolist() == p.phy2log.tolist() and q.replicas.tolist() == [[2, 1, 1]]
    with pytest.raises(EplbError, match=r"expert ids run 0\.\.2"):
        Placement(np.array([[0, -3, 1, 2, 0, -1]]), np.array([2, 2, 2]), 3)


def test_empty_slots_in_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """evaluate judges a placement with empty slots, time included; solve --current refuses one, naming it."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[40, 30, 10, 20, 10, 10, 20, 20]] * 2}))
    placement = tmp_path / "p.json"
    phy2log = np.array([[0, 1, 2, -1, 3, 4, 5, 0, 6, 7, -1, -1]] * 2)
    save_placement(Placement(phy2log, np.array([4, 4, 4]), 8), placement)
    assert main(["evaluate", "--loads", str(window), "--placement", str(placement), "--model", "mixtral-8x7b",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # GPU loads 20 + 30 + 10, 20 + 10 + 10 + 20, 20 + 20: lb = 60 / (160 / 3)
    assert out["predicted"]["lb"] == pytest.approx([1.125, 1.125])
    full = tmp_path / "full.json"  # the same experts per GPU, no empty slots, one slot fewer on each GPU
    save_placement(Placement(np.array([[0, 1, 2, 3, 4, 5, 0, 6, 7]] * 2), np.array([3, 4, 2]), 8), full)
    assert main(["evaluate", "--loads", str(window), "--placement", str(full), "--model", "mixtral-8x7b",
                 "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert out["predicted"]["time_us"] == pytest.approx(same["predicted"]["time_us"])
    err = _eplb_error(["solve", "--loads", str(window), "--gpus", "3", "--slots-per-gpu", "4", "--current",
                       str(placement)], capsys)
    assert "the current placement has empty slots (-1; layer 0, slot 3)" in err


def _eplb_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI, expect exit 2 with one error line (no traceback), return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("eplb "), err
    return err


def test_cli_bad_input_and_output_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every file-reading and file-writing option of solve, evaluate, export and import-load: empty files,
    directories and missing output directories get one line saying which (before any solving)."""
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[4, 1, 1, 2], [1, 1, 1, 1]]}))
    placement = tmp_path / "p.json"
    save_placement(Placement(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), np.array([2, 2]), 4), placement)
    folder, empty = str(tmp_path / "folder"), str(tmp_path / "empty.npz")
    missing_dir = str(tmp_path / "nope" / "out.json")
    solve = ["solve", "--loads", str(window), "--gpus", "2", "--slots-per-gpu", "2"]
    cases = [
        (["solve", "--loads", empty], "load file .*empty.npz is empty \\(0 bytes\\)"),
        (["solve", "--loads", folder], "load file .*folder is a directory"),
        ([*solve, "--current", folder], "placement file .*folder is a directory"),
        ([*solve, "--out", folder], "--out .*folder is a directory; give a file name inside it"),
        ([*solve, "--out", missing_dir], "directory .*nope does not exist"),
        (["evaluate", "--loads", str(window), "--placement", folder], "placement file .*folder is a directory"),
        (["evaluate", "--loads", str(window), "--placement", empty], "placement file .*empty.npz is empty"),
        (["export", "--placement", str(placement), "--to", "json", "--out", folder], "is a directory"),
        (["export", "--placement", str(placement), "--to", "json", "--out", missing_dir], "does not exist"),
        (["import-load", "--from", "vllm", empty, "--out", str(tmp_path / "x.json")], "empty.npz is empty"),
        (["import-load", "--from", "vllm", folder, "--out", str(tmp_path / "x.json")], "folder is a directory"),
        (["import-load", "--from", "sglang", str(window), "--out", missing_dir], "does not exist"),
        (["replay", folder], "folder: no part-\\*.parquet shards in this directory"),
        (["replay", empty], "routing log .*empty.npz is empty"),
    ]
    for argv, message in cases:
        assert re.search(message, _eplb_error(argv, capsys)), argv
    assert not (tmp_path / "nope").exists()


def test_evaluate_names_a_shape_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A placement for another model or window: both shapes, not a missing layer id."""
    fixture = str(Path(__file__).resolve().parents[1] / "fixtures" / "sglang6017-dsv3-prefill-in4096.json")
    big = tmp_path / "dsv3.json"
    assert main(["solve", "--loads", fixture, "--out", str(big)]) == 0  # rows labelled model layers 3..60
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"loads": [[4, 1, 1, 2], [1, 1, 1, 1]], "layer_ids": [1, 2]}))
    capsys.readouterr()
    err = _eplb_error(["evaluate", "--loads", str(small), "--placement", str(big)], capsys)
    assert "the placement is 58 layers x 288 slots of 256 experts but the loads are 2 layers x 4 experts" in err
    err = _eplb_error(["solve", "--loads", str(small), "--gpus", "36", "--current", str(big)], capsys)
    assert "58 layers x 288 slots of 256 experts but the loads are 2 layers x 4 experts" in err


def test_a_placement_carries_its_layer_ids_through_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb solve --out` writes the window's layer_ids (3..60); Placement had no such field, so from_dict dropped
    them (even invalid ones) and save_placement(load_placement(f)) lost them. The placement keeps them now,
    checked: whole numbers >= 0, one per row, distinct, increasing; a bad list is refused naming the field."""
    solved = tmp_path / "p.json"
    assert main(["solve", "--gpus", "32", "--slots-per-gpu", "9", "--out", str(solved)]) == 0
    capsys.readouterr()
    p = load_placement(solved)
    assert p.layer_ids == tuple(range(3, 61))
    save_placement(p, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["layer_ids"] == list(range(3, 61))
    assert load_placement(tmp_path / "again.json").layer_ids == p.layer_ids
    assert Placement(p.phy2log, p.slots_per_gpu, 256).layer_ids is None  # unknown: None, and no field written
    assert "layer_ids" not in Placement(p.phy2log, p.slots_per_gpu, 256).to_dict()
    data = json.loads(solved.read_text())
    ids = data["layer_ids"]
    for bad, said in (("x", "layer_ids must hold only numbers"),
                      ([3, 3, *ids[2:]], "layer_ids: layer 3 appears twice"),
                      ([4, 3, *ids[2:]], "layer_ids: layer 3 comes after layer 4: a placement's rows are its model "
                                         "layers in increasing order"),
                      ([-1, *ids[1:]], "layer_ids: layer -1 is negative"),
                      (ids[:-1], "layer_ids: 57 ids for the placement's 58 layers"),
                      ([3.5, *ids[1:]], "layer_ids must be a list of integers")):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "layer_ids": bad}))
        with pytest.raises(FieldError) as refused:
            load_placement(tmp_path / "bad.json")
        assert str(refused.value).startswith(f"{tmp_path / 'bad.json'}: {said}"), (bad, str(refused.value))
        assert refused.value.fields == ("layer_ids",)
        with pytest.raises(FieldError, match=f"^{re.escape(said)}"):
            Placement(p.phy2log, p.slots_per_gpu, 256, layer_ids=bad)  # type: ignore[arg-type]


def test_placement_inputs_are_refused_not_cut_or_wrapped() -> None:
    """Placement(phy2log, [3.7, 3.2], 6) cut the slots to [3, 3]; a uint64 id 2**64 - 1 became -1, an empty slot;
    num_experts 6.0, 6.5, True or "6" raised TypeError or UFuncTypeError; np.int64(6) was kept, and JSON could not
    write it; from_dict raised numpy's ValueError for ragged replicas and took any format."""
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 2]])
    with pytest.raises(EplbError, match=r"slots_per_gpu\[0\] is 3\.7: a GPU holds a whole number of slots"):
        Placement(phy2log, [3.7, 3.2], 6)  # type: ignore[arg-type]
    with pytest.raises(EplbError, match=r"slots_per_gpu\[0\] is 5\.5: a GPU holds a whole number of slots"):
        Placement(np.zeros((1, 22), dtype=np.int64), np.full(4, 5.5), 1)  # what Cluster(np.full(4, 5.5)) passes
    wrapped = np.array([[0, 1, 2, 3, 4, 5, 2**64 - 1]], dtype=np.uint64)
    with pytest.raises(EplbError, match=r"phy2log\[0\]\[6\] is 18446744073709551615: expert ids run 0\.\.5"):
        Placement(wrapped, np.array([4, 3]), 6)  # type: ignore[arg-type]
    in_range = Placement(wrapped[:, :6], np.array([3, 3]), 6)  # type: ignore[arg-type]
    assert in_range.phy2log.dtype == np.int64 and in_range.phy2log.tolist() == [[0, 1, 2, 3, 4, 5]]
    for bad, shown in ((6.0, "6.0 (float)"), (6.5, "6.5 (float)"), (True, "True (bool)"), ("6", "'6' (str)"),
                       (np.float64(6), "6.0 (float64)"), (0, "0")):
        with pytest.raises(EplbError) as refused:
            Placement(phy2log, np.array([4, 3]), bad)  # type: ignore[arg-type]
        assert str(refused.value) == f"placement: num_experts must be a whole number >= 1 (an int), got {shown}"
    numpy_count = Placement(phy2log, np.array([4, 3]), np.int64(6))  # type: ignore[arg-type]
    assert type(numpy_count.num_experts) is int
    assert json.loads(json.dumps(numpy_count.to_dict()))["num_experts"] == 6
    data = Placement(phy2log, np.array([4, 3]), 6).to_dict()
    with pytest.raises(EplbError) as ragged:
        Placement.from_dict({**data, "replicas": [[1, 1], [1]]}, "p.json")
    assert str(ragged.value) == "p.json: replicas must be a list of lists of numbers with equal row lengths"
    with pytest.raises(EplbError) as other:
        Placement.from_dict({**data, "format": "something/v9"}, "p.json")
    assert str(other.value) == "p.json: format is 'something/v9', but eplb reads placement files of format " \
                               "'eplb.placement/v1'"
    for gpus in ("2", True, 3):
        with pytest.raises(EplbError, match=r"^p\.json: num_gpus is .* but slots_per_gpu lists 2"):
            Placement.from_dict({**data, "num_gpus": gpus}, "p.json")
    with pytest.raises(EplbError, match="num_experts must be a whole number >= 1"):
        Placement.from_dict({**data, "num_experts": True}, "p.json")
    assert Placement.from_dict(data).to_dict() == data
