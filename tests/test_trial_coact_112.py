"""A hostile user's --coactivation files: each refusal is one line naming the file and the field, and nothing in
a summary is silently ignored or taken when it cannot be a window's (the keys it holds, a top_k above its expert
count, counts beyond what a window holds); the summary's binary image reads as its JSON does; a token-level log
meets the window by their layer ids and is refused by shape before it is summarized; `summarize` refuses picks no
token makes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eplb.coactivation import CoactivationSummary, read_summary
from eplb.errors import EplbError
from tests.cli_run import last_line, run_eplb


def small() -> dict[str, Any]:
    """docs/formats.md's example: 100 tokens chose {0, 1}, 100 chose {2, 3}: top-2 of 4 experts."""
    return {"format": "eplb.coactivation-summary/v1", "top_k": 2, "tokens": [200], "loads": [[100, 100, 100, 100]],
            "partners": [[[1, -1], [0, -1], [3, -1], [2, -1]]],
            "counts": [[[100, 0], [100, 0], [100, 0], [100, 0]]]}  # fmt: skip


def solve(tmp_path: Path, capsys: pytest.CaptureFixture[str], coactivation: str) -> tuple[int, str]:
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[100, 100, 100, 100]]}))
    return run_eplb(capsys, "solve", "--loads", str(window), "--gpus", "2", "--slots-per-gpu", "2", "--solver",
                    "greedy-coact", "--coactivation", coactivation)


def written(tmp_path: Path, data: Any, name: str = "s.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # a key the reader does not know was dropped: a typo'd field, or exact pairs the file cannot carry
        ({"exact": [[[0] * 4] * 4]}, "unknown field 'exact'"),
        ({"Top_k": 3}, "unknown field 'Top_k'"),
        # a token picks distinct experts: more than E is no top_k (it changed the copies 1.00 -> 1.50 GPUs)
        ({"top_k": 10**6}, "top_k is 1000000: top_k must be >= 1 and at most the summary's 4 experts"),
        ({"top_k": 10**30}, "top_k is 1000000000000000000000000000000: top_k must be >= 1 and at most"),
        ({"top_k": 0}, "top_k is 0: top_k must be >= 1 and at most the summary's 4 experts"),
        # beyond a window's counts (the solvers refused them later as 'coactivation[0][0][1] is 1e+18')
        ({"tokens": [2 * 10**18], "loads": [[10**18] * 4], "counts": [[[10**18, 0]] * 4]},
         "tokens[0] is 2000000000000000000: out of range, more than any token count (at most 1e+15)"),
        ({"tokens": [10**30]}, "tokens[0] is 1000000000000000000000000000000: out of range"),
        ({"counts": [[[100, 0], [100, 0], [100, -5], [100, 0]]]}, "counts[0][2][1] is -5: counts must be >= 0"),
        ({"loads": [[100, -100, 100, 100]]}, "loads[0][1] is -100: loads must be >= 0"),
    ],
)
def test_a_summary_that_cannot_be_a_windows_is_refused_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], message: str
) -> None:
    path = written(tmp_path, {**small(), **change})
    code, err = solve(tmp_path, capsys, path)
    assert code == 2
    assert last_line(err) == err.strip()  # one line
    assert f"{path}: co-activation summary: {message}" in err


def test_the_docs_example_is_taken(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = solve(tmp_path, capsys, written(tmp_path, small()))
    assert code == 0, err
    assert read_summary(written(tmp_path, small())).to_dict() == small()


def test_the_summarys_binary_image_reads_as_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`CoactivationSummary.to_bytes` is an .npz (docs/formats.md); it was read as a routing log and refused as
    one holding both 'loads' and 'counts'."""
    summary = CoactivationSummary.from_dict(small())
    image = tmp_path / "s.npz"
    image.write_bytes(summary.to_bytes())
    assert read_summary(image, 4, num_layers=1).to_dict() == small()
    code, err = solve(tmp_path, capsys, str(image))
    assert code == 0, err
    summary.partners[0, 0, 0] = 0  # checked as the JSON form is
    image.write_bytes(summary.to_bytes())
    with pytest.raises(EplbError, match=r"s\.npz: co-activation summary: layer 0, expert 0 lists itself"):
        read_summary(image)


def test_a_file_that_is_no_json_is_named_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text("{")
    code, err = solve(tmp_path, capsys, str(path))
    assert code == 2 and err.count("s.json") == 1 and "not valid JSON" in err


def test_an_image_with_an_array_the_reader_does_not_know_is_refused(tmp_path: Path) -> None:
    """As the JSON form's unknown keys: an array `exact` (pairs a summary cannot carry) was silently dropped."""
    import io
    import zipfile

    summary = CoactivationSummary.from_dict(small())
    buffer = io.BytesIO(summary.to_bytes())
    with zipfile.ZipFile(buffer, "a") as archive:
        archive.writestr("exact.npy", b"")
    with pytest.raises(EplbError, match=r"^co-activation summary: unknown array 'exact' \(a summary holds tokens, "):
        CoactivationSummary.from_bytes(buffer.getvalue())
    image = tmp_path / "s.npz"
    image.write_bytes(buffer.getvalue())
    with pytest.raises(EplbError, match=r"s\.npz: co-activation summary: unknown array 'exact'"):
        read_summary(image)


def test_a_summary_of_another_shape_is_refused_naming_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said 'for 1 layers x 4 experts'."""
    path = written(tmp_path, small())
    window = tmp_path / "w2.json"
    window.write_text(json.dumps({"loads": [[100, 100, 100, 100]] * 2}))
    code, err = run_eplb(capsys, "solve", "--loads", str(window), "--gpus", "2", "--coactivation", path)
    assert code == 2
    assert f"{path}: the co-activation data is for 1 layer x 4 experts, the loads are 2 x 4" in err


def test_a_token_log_meets_a_window_by_their_layer_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log of model layers 10-13 was taken for a window of layers 3-6 (rows matched by position, silently); a
    log of more layers than the window was refused by its shape though it holds the window's. Now the window's
    layer ids pick the log's rows, as they pick a placement's (--current, --placement), and one the log lacks is
    refused naming both."""
    import numpy as np

    from eplb.io.logs import write_topk

    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((400, 4, 8)), axis=2)[:, :, :2]  # 400 tokens, 4 layers, top-2 of 8 experts
    log = tmp_path / "log.npz"
    write_topk(log, ids, [0, 400], num_experts=8, layer_ids=[10, 11, 12, 13])
    loads = np.stack([np.bincount(ids[:, layer].ravel(), minlength=8) for layer in range(4)])
    window = tmp_path / "w.json"
    base = ["solve", "--loads", str(window), "--gpus", "2", "--solver", "greedy-coact", "--coactivation", str(log)]
    window.write_text(json.dumps({"layer_ids": [3, 4, 5, 6], "loads": loads.tolist()}))
    code, err = run_eplb(capsys, *base)
    assert code == 2
    assert f"{log}: the token-level log has no layer 3 (its layer_ids are 10-13), the loads' layer_ids are 3-6" \
        in last_line(err)
    window.write_text(json.dumps({"layer_ids": [11, 13], "loads": loads[[1, 3]].tolist()}))
    assert read_summary(log, 8, num_layers=2, layer_ids=[11, 13]).loads.tolist() == loads[[1, 3]].tolist()
    code, err = run_eplb(capsys, *base)
    assert code == 0, err
    window.write_text(json.dumps({"loads": loads.tolist()}))  # a window without layer ids: by position
    code, err = run_eplb(capsys, *base)
    assert code == 0, err


def test_a_token_log_of_other_experts_is_refused_before_it_is_summarized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log declaring 30,000 experts next to a 64-expert window was summarized first (its pair counts
    [layers, E, E]: a MemoryError traceback, 'Unable to allocate 26.8 GiB'), then refused by shape."""
    import numpy as np

    import eplb.coactivation as coactivation
    from eplb.io.logs import write_topk

    log = tmp_path / "log.npz"
    write_topk(log, np.array([[[0, 1]], [[2, 3]]] * 100), [0, 200], num_experts=30_000)

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("summarized a log of another shape")

    monkeypatch.setattr(coactivation, "pair_counts", never)  # what allocates [layers, E, E]
    code, err = solve(tmp_path, capsys, str(log))
    assert code == 2
    assert last_line(err) == f"eplb solve: error: {log}: the co-activation data is for 1 layer x 30,000 experts, " \
        "the loads are 1 x 4"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[[0, 5]]], "topk_ids: token 0, layer 0: expert id 5 is outside 0..3"),  # was numpy's broadcast ValueError
        ([[[0, 1]], [[-1, 2]]], "topk_ids: token 1, layer 0: expert id -1 is outside 0..3"),
        ([[[0, 1]], [[2, 2]]], "topk_ids: token 1, layer 0: top-k [2, 2] names an expert twice"),  # was taken
        ([[[0.0, 1.0]]], "topk_ids must hold integer expert ids, got float64"),
    ],
)
def test_summarize_refuses_picks_no_token_makes(ids: list[Any], message: str) -> None:
    """The library's `summarize` of raw topk_ids: an id outside 0..E-1 was a numpy ValueError, a token naming an
    expert twice a summary its own check refuses ('load 3 exceeds the layer's 2 tokens') once sent."""
    from eplb.coactivation import summarize

    with pytest.raises(EplbError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        summarize(ids, 4)
