"""`eplb synth` with extreme but valid settings writes a log (it died with tracebacks), and refuses settings whose
counts no log can hold by the flags."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from eplb.io.logs import open_log
from tests.cli_run import run_eplb as run

SHAPE = ["--steps", "3", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64"]


MAX_EXPONENT_SAID = ("--exponent must be >= 0 and at most 1,000 (steeper changes nothing: the next expert's "
                     "popularity is below 1e-300 of the hottest's), got ")


@pytest.mark.parametrize("fmt", ["counts", "topk"])
def test_a_steep_popularity_gives_the_hottest_experts_every_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    """--exponent 1000 with top-8 of 16: the popularity of every expert past the 7th hottest underflows to 0, and
    `_inclusion` raised IndexError (index 0 is out of bounds). In the limit each token picks 8 distinct experts, the
    hottest ones, every one of them each token."""
    out = tmp_path / "x.npz"
    shape = ["--steps", "3", "--layers", "2", "--experts", "16", "--top-k", "8", "--tokens", "64"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow and divide-by-zero warnings were printed on the way
        code, err = run(capsys, "synth", "--out", str(out), "--format", fmt, "--exponent", "1000", *shape)
    assert code == 0 and "Traceback" not in err and "Warning" not in err, err
    counts = np.concatenate([chunk.counts for chunk in open_log(out).iter_counts()])  # topk_ids: their counts
    assert counts.shape == (3, 2, 16)
    assert (np.sort(counts, axis=2)[..., -8:] == 64).all() and (counts.sum(axis=2) == 64 * 8).all()


@pytest.mark.parametrize("exponent", ["1e4", "1e308", "1001"])
def test_a_steeper_exponent_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], exponent: str) -> None:
    """--exponent 1e308 was an IndexError traceback after numpy's overflow warnings; top-1 wrote the same log as
    1000 does."""
    code, err = run(capsys, "synth", "--out", str(tmp_path / "x.npz"), "--exponent", exponent, *SHAPE)
    assert code == 2 and err == f"eplb synth: error: {MAX_EXPONENT_SAID}{float(exponent)!r}\n", err
    assert not list(tmp_path.iterdir())


def test_tokens_beyond_any_count_are_refused_by_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tokens 1e20 was an OverflowError traceback from numpy's multinomial (Python int too large for C long)."""
    out = tmp_path / "x.npz"
    code, err = run(capsys, "synth", "--out", str(out), "--steps", "3", "--layers", "2", "--experts", "16",
                    "--top-k", "2", "--tokens", "100000000000000000000", "--hot-ratio", "4")
    assert code == 2 and err.startswith("eplb synth: error: --tokens 100000000000000000000"), err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir()), err


def test_an_exponent_given_notes_no_hot_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --exponent the hot ratio is not aimed for, yet 16 experts, top-2 noted 'the default hot ratio 11 is out
    of reach ...: aiming for 6'; without it the note stays."""
    code, err = run(capsys, "synth", "--out", str(tmp_path / "x.npz"), "--exponent", "1.2", *SHAPE)
    assert code == 0 and err == "", err
    code, err = run(capsys, "synth", "--out", str(tmp_path / "y.npz"), *SHAPE)
    assert code == 0 and err.startswith("note: the default hot ratio 11 is out of reach"), err
