"""The ESFT token-level fixtures and their converter (fixtures/esft_topk.py)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from eplb.coactivation import partner_lift, read_topk
from eplb.io.logs import open_log

FIXTURES = Path(__file__).parents[1] / "fixtures"
# partner lifts of the four tasks, docs/cost-model.md ("Co-activation")
LIFTS = {"law": 2.43, "intent": 2.59, "summary": 2.18, "translation": 1.90}


def _converter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("esft_topk", FIXTURES / "esft_topk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_task(root: Path, lines_of_layer: list[list[str]]) -> None:
    task = root / "results" / "expert_scores" / "t"
    task.mkdir(parents=True)
    for i, lines in enumerate(lines_of_layer, 1):
        (task / f"expert_weights_{i}.txt").write_text("".join(line + "\n" for line in lines))


def _line(ids: list[int]) -> str:
    weights = [f"{0.1 + 0.01 * j:.4f}" for j in range(len(ids))]
    return "\t".join([*map(str, ids), "", *weights])


def test_converter_reads_ids_per_sequence_and_drops_weights(tmp_path: Path) -> None:
    conv = _converter()
    rng = np.random.default_rng(0)
    lengths = [3, 1, 2]
    truth = rng.integers(0, 64, size=(sum(lengths), conv.LAYERS, 6))
    offsets = np.r_[0, np.cumsum(lengths)]
    layers = [[_line(truth[a:b, layer].ravel().tolist()) for a, b in itertools.pairwise(offsets)]
              for layer in range(conv.LAYERS)]  # fmt: skip
    _write_task(tmp_path, layers)
    ids, got_offsets = conv.convert(tmp_path, "t")
    assert ids.dtype == np.int16 and ids.shape == truth.shape
    assert np.array_equal(ids, truth) and np.array_equal(got_offsets, offsets)


def test_converter_refuses_a_line_without_the_weights_separator(tmp_path: Path) -> None:
    conv = _converter()
    layers = [[_line([1, 2, 3, 4, 5, 6])] for _ in range(conv.LAYERS)]
    layers[4] = ["\t".join(["1", "2", "3", "4", "5", "6", "0.5"] * 2)]
    _write_task(tmp_path, layers)
    with pytest.raises(SystemExit, match=r"expert_weights_5.txt:1: no empty field"):
        conv.convert(tmp_path, "t")


def test_converter_names_a_missing_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"expert_weights_1.txt: not found"):
        _converter().convert(tmp_path, "law")


@pytest.mark.parametrize("task", sorted(LIFTS))
def test_shipped_esft_logs_are_valid_token_logs_with_real_coactivation(task: str) -> None:
    path = FIXTURES / f"esft-dsv2lite-{task}-topk.npz"
    info = open_log(path).info
    assert info.num_experts == 64 and info.num_layers == 26
    ids, offsets = read_topk(path)
    assert ids.shape[1:] == (26, 6) and 8_000 < ids.shape[0] < 8_600
    assert offsets[0] == 0 and offsets[-1] == ids.shape[0] and bool(np.all(np.diff(offsets) > 0))
    # a token's 6 experts are distinct in every layer
    s = np.sort(ids, axis=2)
    assert not bool(np.any(s[..., 1:] == s[..., :-1]))
    assert abs(partner_lift(ids, 64) - LIFTS[task]) < 0.02
