"""`eplb synth`: what k distinct experts per token allow (an expert gets at most 1/k of a layer's picks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eplb.cli import main as cli_main
from eplb.errors import EplbError
from eplb.synth import SynthConfig


def test_a_hot_ratio_above_experts_over_top_k_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mixtral's 8 experts, top-2: the hottest expert holds at most 1/2 of the picks, 4x the mean (E/k, not E)."""
    with pytest.raises(EplbError, match=r"a hot ratio of 5 is out of reach for 8 experts, top-2: each token picks 2 "
                       r"distinct experts, so an expert gets at most 1/2 of a layer's picks, experts / top-k = 4x the "
                       r"mean: lower --hot-ratio or give --exponent"):  # fmt: skip
        SynthConfig(layers=32, experts=8, top_k=2, hot_ratio=5, model=None).resolved_exponent()
    assert SynthConfig(layers=32, experts=8, top_k=2, hot_ratio=4, model=None).resolved_exponent() > 0  # E/k: reached
    with pytest.raises(EplbError, match=r"a hot ratio of 16.5 is out of reach for 128 experts, top-8: .* 16x the mean"):
        SynthConfig(experts=128, hot_ratio=16.5, model=None).resolved_exponent()  # Qwen3-235B-A22B's shape
    out = tmp_path / "m.npz"
    assert cli_main(["synth", "--out", str(out), "--model", "mixtral-8x7b", "--hot-ratio", "5", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb synth: error: a hot ratio of 5 is out of reach for 8 experts, top-2"), err  # one prefix
    assert not out.exists()
