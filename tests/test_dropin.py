"""`solvers.greedy.rebalance_experts` as a drop-in for DeepSeek EPLB's: torch tensors in, torch int64 CPU tensors out
(what DeepSeek's function returns and its callers pad and move), numpy in, numpy out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from solvers.greedy import rebalance_experts

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "deepseek_eplb_golden.json").read_text())["cases"]


@pytest.mark.parametrize("case", GOLDEN[::7], ids=lambda c: f"{c['kind']}-{c['variant']}-{c['num_gpus']}")
def test_a_tensor_weight_gets_deepseeks_int64_cpu_tensors(case: dict[str, Any]) -> None:
    """It returned numpy arrays for a tensor, where DeepSeek's returns tensors: older vLLM's eplb_state pads log2phy
    with torch.nn.functional.pad and moves the maps with .to(device), which numpy arrays do not take."""
    args = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    out = rebalance_experts(torch.tensor(case["weight"], dtype=torch.float32), *args)
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert [(t.dtype, t.device.type) for t in out] == [(torch.int64, "cpu")] * 3
    assert [t.tolist() for t in out] == [case["phy2log"], case["log2phy"], case["logcnt"]]
    padded = torch.nn.functional.pad(out[1], (0, 2), value=-1)  # as vLLM's rearrange pads log2phy
    assert padded.shape[-1] == out[1].shape[-1] + 2 and out[0].to("cpu").shape == out[0].shape


def test_numpy_and_lists_in_numpy_out() -> None:
    case = GOLDEN[0]
    args = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    for weight in (np.asarray(case["weight"]), case["weight"]):
        out = rebalance_experts(weight, *args)
        assert all(type(a) is np.ndarray and a.dtype == np.int64 for a in out)
        assert [a.tolist() for a in out] == [case["phy2log"], case["log2phy"], case["logcnt"]]


@pytest.mark.parametrize("name", ["num_replicas", "num_groups", "num_nodes", "num_gpus"])
@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_a_count_below_one_or_not_whole_is_a_value_error_naming_it(name: str, bad: object) -> None:
    """0 for num_groups, num_nodes or num_gpus raised a bare ZeroDivisionError (integer modulo by zero), as DeepSeek's
    function does; a negative num_groups even returned a placement; a float num_replicas (16.0) was a TypeError
    ('float' object cannot be interpreted as an integer). The drop-in names the argument instead."""
    counts: dict[str, Any] = {"num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 4, name: bad}
    with pytest.raises(ValueError, match=rf"^{name} must be a whole number >= 1, got {bad!r}$"):
        rebalance_experts(np.ones((2, 16)), counts["num_replicas"], counts["num_groups"], counts["num_nodes"],
                          counts["num_gpus"])
    counts[name] = np.int64(16 if name == "num_replicas" else 2)  # numpy's integers are counts too
    phy2log, _, logcnt = rebalance_experts(np.ones((2, 16)), counts["num_replicas"], counts["num_groups"],
                                           counts["num_nodes"], counts["num_gpus"])
    assert phy2log.shape == (2, 16) and (logcnt == 1).all()
