"""`eplb synth`: what k distinct experts per token allow (an expert gets at most 1/k of a layer's picks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main as cli_main
from eplb.errors import EplbError
from eplb.synth import SynthConfig, _distinct_counts, _inclusion, _Popularity, synth_counts
from tests.cli_run import error_prefix, run_eplb


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


def test_inclusion_probabilities_cap_each_expert_at_one_pick_per_token() -> None:
    """Water-filling: pi = min(1, c p) sums to k; with k p <= 1 everywhere it is k p itself."""
    flat = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(_inclusion(flat, 2), 2 * flat)
    hot = np.array([0.7, 0.1, 0.1, 0.06, 0.04])  # 2 x 0.7 > 1: the hot expert is in every token's top-2
    pi = _inclusion(hot, 2)
    assert pi[0] == 1.0 and pi.sum() == pytest.approx(2.0)
    np.testing.assert_allclose(pi[1:], hot[1:] / hot[1:].sum())  # the other pick spread by p
    two_hot = np.array([0.45, 0.45, 0.05, 0.05])  # k = 3: two capped
    pi = _inclusion(two_hot, 3)
    np.testing.assert_allclose(pi, [1.0, 1.0, 0.5, 0.5])


def test_distinct_counts_give_no_expert_more_picks_than_tokens_and_the_inclusion_means() -> None:
    rng = np.random.default_rng(3)
    pi = _inclusion(np.array([0.7, 0.1, 0.1, 0.06, 0.04]), 2)
    draws = np.stack([_distinct_counts(rng, pi, 50) for _ in range(2000)])
    assert (draws <= 50).all() and (draws.sum(axis=1) == 100).all()
    np.testing.assert_allclose(draws.mean(axis=0) / 50, pi, atol=0.01)  # each expert in a share pi of the tokens


def test_synthetic_counts_respect_k_distinct_experts_per_token() -> None:
    """Mixtral's shape at a hot ratio near E/k, few tokens: a plain multinomial of tokens x k picks gives the
    hottest expert more picks than there are tokens on some steps; the log never does, and keeps its totals."""
    cfg = SynthConfig(layers=4, experts=8, top_k=2, tokens=64, steps=400, hot_ratio=3.9, model=None)
    log = np.concatenate(list(synth_counts(cfg)))
    assert log.max() <= cfg.tokens
    assert (log.sum(axis=2) == cfg.tokens * cfg.top_k).all()
    first = _Popularity(cfg).next()  # popularity [layers, experts] of step 0
    assert (cfg.top_k * first.max(axis=1) > 0.9).any()  # the constraint is near binding


def test_the_default_hot_ratio_out_of_reach_of_a_shape_aims_below_its_cap_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb synth --model mixtral-8x7b` (and DeepSeek-V2-Lite) refused the default 11 unless told a ratio: without
    --hot-ratio or --exponent it aims for 0.75 E/k and says so; a ratio given is still the user's, refused above E/k."""
    import json

    for model, ratio in (("mixtral-8x7b", 3.0), ("deepseek-v2-lite", 8.0)):
        out = tmp_path / f"{model}.npz"
        assert cli_main(["synth", "--out", str(out), "--model", model, "--steps", "40", "--json"]) == 0
        said = capsys.readouterr()
        assert json.loads(said.out)["config"]["hot_ratio"] == ratio
        assert said.err.startswith("note: the default hot ratio 11 is out of reach for ") and f"aiming for {ratio:g}" \
            in said.err, said.err
        stats = json.loads(said.out)["stats"]
        assert abs(stats["hot_ratio"]["median"] / ratio - 1) < 0.2, stats  # about what it aims for
    assert cli_main(["synth", "--out", str(tmp_path / "q.npz"), "--model", "qwen3-235b-a22b", "--layers", "2",
                     "--steps", "4", "--json"]) == 0  # 128 experts top-8 reach 16: the default 11, no note
    said = capsys.readouterr()
    assert json.loads(said.out)["config"]["hot_ratio"] == 11 and said.err == ""


def test_many_tokens_draw_the_same_law_per_cell_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`eplb synth --tokens 1e12` died 'Unable to allocate 7.28 TiB' (a draw per token where k distinct picks bind).
    Above 2^20 tokens x picks the counts are one multinomial over the cells of u between the edges' fractional parts:
    the law of the per-token draws (means and variances here over 300 seeds each), at no cost per token."""
    import eplb.synth as synth

    pi = np.random.default_rng(0).random(64) ** 3
    pi = np.minimum(pi / pi.sum() * 8, 1.0)  # some experts at 1: every token picks them
    tokens = 100_000  # 800,000 points: per token
    per_token = np.array([_distinct_counts(np.random.default_rng(s), pi, tokens) for s in range(300)])
    monkeypatch.setattr(synth, "_POINTS_PER_DRAW", 0)
    per_cell = np.array([_distinct_counts(np.random.default_rng(s + 1000), pi, tokens) for s in range(300)])
    assert (per_cell.sum(axis=1) == 8 * tokens).all() and per_cell.max() <= tokens
    se = np.sqrt(per_token.var(axis=0) / 300 + per_cell.var(axis=0) / 300) + 1e-9
    assert (np.abs(per_token.mean(axis=0) - per_cell.mean(axis=0)) / se).max() < 5  # z of each expert's mean
    varies = per_token.var(axis=0) > 0
    ratio = per_cell.var(axis=0)[varies] / per_token.var(axis=0)[varies]
    assert 0.9 < float(np.median(ratio)) < 1.1
    monkeypatch.undo()
    huge = _distinct_counts(np.random.default_rng(3), pi, 10**12)
    assert huge.sum() == 8 * 10**12 and huge.max() <= 10**12


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--shift-at", "99"], ["--groups", "3"], ["--steps", "0"]])
def test_the_default_hot_ratio_note_comes_only_for_a_synth_that_goes_ahead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    """`eplb synth --model mixtral-8x7b` with another flag refused printed the note on the default hot ratio (out of
    reach for 8 experts, top-2) before the error: the refusal is alone, the note comes for a run that draws."""
    out = tmp_path / "m.npz"
    argv = ["synth", "--out", str(out), "--model", "mixtral-8x7b", "--steps", "4", *bad]
    code, err = run_eplb(capsys, *argv)
    assert code == 2 and err.startswith(error_prefix(argv)) and "note:" not in err, err
    assert not out.exists()
