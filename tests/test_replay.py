"""Replay with periodic rebalancing: the schedule convention (no lookahead), baselines, the time
model, bounded memory, the synthetic generator and the `eplb synth` / `eplb replay` commands."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import tracemalloc
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.cli import replay as cli_replay
from eplb.cost import predict
from eplb.errors import EplbError
from eplb.evaluate import balance, contiguous_placement
from eplb.executor import LocalExecutor, replay_logs
from eplb.io.logs import open_log, topk_counts, write_counts, write_jsonl
from eplb.placement import Placement
from eplb.progress import Progress
from eplb.replay import Schedule, initial_placement, predict_time_us, replay
from eplb.replay.schedule import Window
from eplb.replay.summary import EXACT_VALUES, RowStats, weight_reads_note
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SEED004_TABLE, SynthConfig, log_stats, synth_counts, synth_log, synth_topk
from solvers.greedy import solve_greedy
from tests.cli_run import error_prefix, last_line, run_eplb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def seed004() -> np.ndarray:
    return np.asarray(json.loads((FIXTURES / "seed004-counts.json").read_text())["loads"][0])


def two_regimes(steps: int, shift: int, layers: int = 3, experts: int = 32, seed: int = 0) -> np.ndarray:
    """Counts [steps, layers, experts]: one hot set before `shift`, a different one from it on."""
    rng = np.random.default_rng(seed)
    pop = [rng.permuted(np.tile(1.0 / np.arange(1, experts + 1), (layers, 1)), axis=1) for _ in range(2)]
    p = np.where(np.arange(steps)[:, None, None] < shift, pop[0][None], pop[1][None])
    return rng.multinomial(4096, p / p.sum(axis=2, keepdims=True))


def small_cost(experts: int, top_k: int = 8, tokens_per_gpu: float | None = None, overlap: bool = True) -> CostSetup:

    model = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": experts, "top_k": top_k, "name": "small"})
    hw = HARDWARE_PRESETS["b200"]
    return CostSetup(model, hw, hw.nvlink_bandwidth, tokens_per_gpu, overlap)


def test_no_lookahead_regime_shift() -> None:
    """The shift lands on a rebalance step: that rebalance saw only the old regime, so lb jumps at the
    shift and stays high until the next rebalance, whose window holds only new-regime steps."""
    log = two_regimes(500, shift=300)
    res = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=50, interval=100), collect=True)
    st = res.steps
    assert st is not None
    lb = st.lb.mean(axis=1)
    before, after_shift, recovered = lb[201:300].mean(), lb[300:401].mean(), lb[401:].mean()
    assert before < 1.15 and recovered < 1.15
    assert after_shift > 1.5 * before and lb[300] > 1.4 and lb[400] > 1.4  # step 400 still on the old placement
    assert st.oracle_lb.max() < 1.2  # the ceiling does not jump
    assert [(r.position, r.applies_from, r.window_steps) for r in res.rebalances] == [
        (100, 101, 50), (200, 201, 50), (300, 301, 50), (400, 401, 50)
    ]  # fmt: skip


@pytest.mark.parametrize(("delay", "first_good"), [(1, 151), (0, 150), (3, 153)])
def test_placement_serves_from_the_step_after_its_rebalance(delay: int, first_good: int) -> None:
    log = two_regimes(200, shift=100)
    sched = Schedule(window=40, interval=1000, first=150, delay=delay)
    res = replay(log, Cluster(np.full(8, 5)), schedule=sched, oracle_every=0, collect=True)
    assert res.steps is not None
    lb = res.steps.lb.mean(axis=1)
    assert lb[first_good - 1] > 1.4 and lb[first_good:].max() < 1.2
    assert np.isnan(res.steps.oracle_lb).all()


def test_seed004_window_lb_reproduced_at_one_step() -> None:
    """A seed-004-like log (noisy draws from seed 004's popularity); the step after the rebalance carries
    exactly the window's counts, so its realized lb must equal the lb the solver reports on that window."""
    base = seed004().astype(np.float64)
    rng = np.random.default_rng(4)
    log = rng.multinomial(4096 * 8, base / base.sum(), size=(12, 1))
    window, s = 5, 8
    log[s + 1, 0] = log[s - window : s, 0].sum(axis=0)
    cluster = Cluster(np.full(32, 9))  # EP32, one redundant expert per GPU (seed 004 section 5.2)
    res = replay(log, cluster, schedule=Schedule(window=window, interval=s), collect=True)
    solved = solve(log[s - window : s].sum(axis=0).astype(np.float64), cluster)
    assert res.steps is not None
    assert res.steps.lb[s + 1, 0] == pytest.approx(solved.balance.lb[0], rel=1e-6)
    assert res.rebalances[0].window_lb[0] == pytest.approx(solved.balance.lb[0], rel=1e-12)
    assert res.steps.no_eplb_lb[s + 1, 0] == pytest.approx(solved.baseline.lb[0], rel=1e-6)
    # on seed 004's own counts: the replay reproduces its table (EP32: 1.41 without EPLB, 1.00 with)
    exact = np.tile(seed004(), (4, 1, 1))
    res = replay(exact, cluster, schedule=Schedule(window=1, interval=2), collect=True)
    assert res.steps is not None
    assert round(float(res.steps.no_eplb_lb[3, 0]), 2) == SEED004_TABLE[32][0]
    assert round(float(res.steps.lb[3, 0]), 2) == SEED004_TABLE[32][2]


def test_baselines_static_oracle_and_moves() -> None:
    log = two_regimes(260, shift=130, layers=2)
    cluster = Cluster(np.full(8, 5))
    cost = small_cost(32)
    res = replay(log, cluster, schedule=Schedule(window=30, interval=60), cost=cost, collect=True)
    st = res.steps
    assert st is not None and res.static is not None
    assert [r.position for r in res.rebalances] == [60, 120, 180, 240]
    for t in (100, 200, 259):  # static = the first rebalance's placement, kept
        assert st.static_lb[t] == pytest.approx(balance(log[t].astype(float), res.static).lb, rel=1e-6)
    for t in (0, 77, 259):  # oracle = greedy on the step's own counts
        own = Placement(solve_greedy(log[t].astype(float), cluster.slots_per_gpu), cluster.slots_per_gpu, 32)
        assert st.oracle_lb[t] == pytest.approx(balance(log[t].astype(float), own).lb, rel=1e-9)
    assert np.all(st.oracle_lb <= st.lb + 1e-6)
    start = initial_placement(2, 32, cluster.slots_per_gpu)
    for t in (0, 60):  # vLLM's initial placement serves until the first placement applies at step 61
        assert st.lb[t] == pytest.approx(balance(log[t].astype(float), start).lb, rel=1e-6)
    first = res.rebalances[0]
    assert first.moves == int(first.moves_per_layer.sum()) > 0
    assert first.bytes_moved == first.moves * cost.model.expert_bytes and first.solve_ms > 0
    summary = res.summary
    assert summary["rebalances"]["count"] == 4
    assert set(summary["results"]) == {"no_eplb", "static", "replay", "hindsight", "oracle"}
    assert summary["results"]["replay"]["lb_mean"] < summary["results"]["static"]["lb_mean"]
    assert summary["results"]["oracle"]["lb_mean"] <= summary["results"]["replay"]["lb_mean"]


def test_initial_placement_is_vllms() -> None:
    p = initial_placement(2, 6, np.array([3, 3, 2]))
    assert p.phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2


def test_ewma_alpha_one_sees_only_the_last_step() -> None:
    log = two_regimes(40, shift=20)
    cluster = Cluster(np.full(8, 5))
    res = replay(log, cluster, schedule=Schedule(window=10, interval=30, ewma=1.0), oracle_every=0)
    expected = solve(log[29].astype(np.float64), cluster).balance.lb
    assert res.rebalances[0].window_lb == pytest.approx(expected, rel=1e-12)
    plain = replay(log, cluster, schedule=Schedule(window=10, interval=30), oracle_every=0)
    assert plain.rebalances[0].window_lb == pytest.approx(solve(log[20:30].sum(0).astype(float), cluster).balance.lb)


@pytest.mark.parametrize(("tokens_per_gpu", "overlap"), [(None, True), (4096.0, True), (None, False)])
def test_time_column_is_the_cost_models(tokens_per_gpu: float | None, overlap: bool) -> None:
    rng = np.random.default_rng(3)
    counts = rng.poisson(rng.gamma(0.5, 40.0, size=(6, 3, 32)))  # some experts get no tokens
    counts[2, 1] = 0  # a layer with no tokens at all
    counts[4, 0, :20] = 0  # most experts idle: fewer active slots on every GPU
    assert (counts == 0).any()
    slots = np.full(8, 5)
    cost = small_cost(32, tokens_per_gpu=tokens_per_gpu, overlap=overlap)
    placement = Placement(solve_greedy(counts.sum(axis=0).astype(float), slots), slots, 32)
    ours = predict_time_us(counts, placement, cost)
    assert ours[2, 1] == 0.0  # no token: nothing to dispatch, compute or read, with a T given too
    for t in range(6):
        ref = predict(counts[t].astype(float), placement.phy2log, slots, cost.model, cost.hardware, cost.link_bw,
                      tokens_per_gpu=tokens_per_gpu, overlap=overlap)  # fmt: skip
        assert ours[t] == pytest.approx(ref.time_us, rel=1e-5)


def test_memory_is_bounded_by_the_window_not_the_log() -> None:
    cfg = SynthConfig(steps=3000, layers=4, experts=64, top_k=4, tokens=512, model=None)
    cluster = Cluster(np.full(8, 9))

    def peak(steps: int) -> int:
        chunks = (c for i, c in enumerate(synth_counts(cfg, 100)) if i * 100 < steps)
        tracemalloc.start()
        replay(chunks, cluster, schedule=Schedule(window=200, interval=300), oracle_every=0, chunk_steps=100)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    short, long = peak(600), peak(3000)
    assert long < 1.3 * short


def _replay_overstated(path: Path, said: int, hindsight: bool) -> None:
    """Replay `path`, whose header says `said` steps (it holds 100), with a window of `said` steps, to its error."""
    with pytest.raises(EplbError, match=f"truncated: the file says {said:,} steps but holds 100; step 100 is"):
        replay(path, Cluster(np.full(4, 5)), schedule=Schedule(window=said, interval=40), oracle_every=0,
               hindsight=hindsight)  # fmt: skip


def test_a_header_overstating_the_steps_does_not_size_the_window(tmp_path: Path) -> None:
    """The window buffer was sized from the log's stated step count: a JSONL header saying 200,000 steps (it
    holds 100) with a window of 200,000 allocated 200,000 steps of counts (and lbs) up front; 10^9 with a huge
    --window: OOM. It grows with the steps that arrive; the replay still ends naming the over-stated count
    (in the hindsight pass when there is one, after the steps without)."""
    counts = two_regimes(100, shift=50, layers=2, experts=16)
    path = tmp_path / "over.jsonl"
    write_jsonl(path, counts)
    header, *records = path.read_text().splitlines(keepends=True)
    # without hindsight the counts ring was the cost (200,000 x 2 x 16 int64: 51 MB); with it, the lbs
    # allocated before the hindsight pass finds the file short (2,000,000 float64: 16 MB)
    for said, hindsight in ((200_000, False), (2_000_000, True)):
        path.write_text(json.dumps({**json.loads(header), "num_steps": said}) + "\n" + "".join(records))
        _replay_overstated(path, said, hindsight)  # untraced: the modules the path imports, the solver's warm-up
        tracemalloc.start()  # (run alone, those were most of the peak)
        try:
            _replay_overstated(path, said, hindsight)  # what replaying the file allocates
            _, top = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert top < 8 * 2**20, (said, hindsight, top)


def test_the_window_buffer_grows_with_the_steps_and_keeps_the_last_window() -> None:
    """Window against a plain list of every step stored: the same window loads, steps and recent lb at every
    size (shorter and longer than the log), and never more room than the steps stored (doubling) or `size`."""
    rng = np.random.default_rng(3)
    for size in (1, 7, 64, 300, 10**9):
        window, pos = Window(size), 0
        stored: list[np.ndarray] = []
        lbs: list[np.ndarray] = []
        for n in rng.integers(1, 90, size=12):
            counts, lb = rng.integers(0, 50, size=(int(n), 2, 3)), rng.random(int(n))
            window.store_counts(pos, counts)
            window.store_lb(pos, lb)
            stored.extend(counts)
            lbs.extend(lb)
            pos += int(n)
            lo = max(0, pos - size)
            np.testing.assert_array_equal(window.steps(lo, pos), np.asarray(stored[lo:pos]))
            loads, weight = window.loads(lo, pos, None)
            np.testing.assert_array_equal(loads, np.sum(stored[lo:pos], axis=0))
            assert weight == pos - lo
            assert window.recent_lb(lo, pos) == pytest.approx(float(np.mean(lbs[lo:pos])))
            assert window.capacity <= min(size, 2 * pos)


def test_schedule_and_input_errors() -> None:
    log = two_regimes(10, shift=5)
    cluster = Cluster(np.full(8, 5))
    for sched, message in [
        (Schedule(window=0), "window must be"),
        (Schedule(interval=5, delay=5), r"delay \(5\) must be shorter than interval \(5\).*give delay 0 \.\. 4"),
        (Schedule(first=0), "first must be >= 1 .the first rebalance needs at least one step"),
        (Schedule(ewma=1.5), r"ewma \(EWMA alpha\) must be in"),
    ]:
        with pytest.raises(EplbError, match=message):
            replay(log, cluster, schedule=sched)
    with pytest.raises(EplbError, match="cannot hold 32 experts"):
        replay(log, Cluster(np.full(8, 3)))
    with pytest.raises(EplbError, match="the log has 32 experts, but model 'small' has 16: give cost"):
        replay(log, cluster, cost=small_cost(16))


# --------------------------------------------------------------------------------------------
# The synthetic generator
# --------------------------------------------------------------------------------------------


def test_synth_is_deterministic_by_seed_and_prefix_stable() -> None:
    cfg = SynthConfig(steps=30, layers=3, experts=32, top_k=4, tokens=256, groups=4, shift_at=(12,), shift_every=9,
                      hot_ratio=4)
    a, b = synth_log(cfg), synth_log(cfg)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, synth_log(SynthConfig(**{**cfg.__dict__, "seed": 1})))
    longer = synth_log(SynthConfig(**{**cfg.__dict__, "steps": 50}))
    assert np.array_equal(longer[:30], a)
    assert np.all(a.sum(axis=2) == 256 * 4) and a.dtype == np.uint16


def test_synth_default_looks_like_deepseek_r1() -> None:
    """Published DeepSeek-R1 numbers: hottest expert ~10-12x the mean; without EPLB at EP32 an
    imbalance (max - mean) / mean ~1.5 (the SGLang DeepSeek-V3 windows in fixtures/ give 1.48-1.52);
    hot sets that hold for tens to hundreds of steps."""
    stats = log_stats(synth_counts(SynthConfig(steps=120)), gpus=32, lags=(1, 10, 100))
    assert 10.0 <= stats.hot_ratio[0] <= 12.0
    assert 1.35 <= stats.imbalance <= 1.65
    assert stats.hot_set_overlap[10] > 0.8 and 0.5 < stats.hot_set_overlap[100] < 0.8


def test_synth_regime_shift_changes_the_hot_set() -> None:
    cfg = SynthConfig(steps=40, layers=2, experts=64, top_k=4, tokens=4096, drift_std=0.0, groups=1,
                      group_std=0.0, shift_at=(20,), model=None)  # fmt: skip
    log = synth_log(cfg).astype(float)
    before, after = log[:20].sum(0), log[20:].sum(0)

    def top(x: np.ndarray) -> set[int]:
        return set(np.argsort(-x)[:8].tolist())

    assert all(len(top(before[layer]) & top(after[layer])) <= 3 for layer in range(2))
    assert all(len(top(log[:10].sum(0)[layer]) & top(log[10:20].sum(0)[layer])) >= 7 for layer in range(2))


def test_synth_hot_ratio_or_exponent() -> None:
    flat = SynthConfig(steps=5, layers=8, experts=64, top_k=4, tokens=20000, groups=1, group_std=0, drift_std=0,
                       hot_ratio=3.0, model=None)  # fmt: skip
    stats = log_stats(synth_counts(flat), gpus=8, lags=(1,))
    assert 2.6 < stats.hot_ratio[0] < 3.4
    with pytest.raises(EplbError, match="below what the group and drift effects alone give"):
        SynthConfig(hot_ratio=1.1, drift_std=2.0).resolved_exponent()
    assert SynthConfig(exponent=0.4).resolved_exponent() == 0.4


def test_synth_topk_tokens_pick_distinct_experts() -> None:
    cfg = SynthConfig(steps=3, layers=2, experts=16, top_k=4, tokens=50, groups=2, model=None, hot_ratio=3)
    ids, offsets = synth_topk(cfg)
    assert ids.shape == (150, 2, 4) and ids.dtype == np.int16 and offsets.tolist() == [0, 50, 100, 150]
    assert np.all(np.sort(ids, axis=2)[:, :, 1:] != np.sort(ids, axis=2)[:, :, :-1])


def test_synth_topk_has_the_hot_ratio_of_the_counts_format() -> None:
    """--format topk ignored --hot-ratio: the tokens' Gumbel top-k (picks without replacement) and the co-activation
    types flattened the hottest experts, the median hottest / mean of Qwen3's shape (128 experts, top-8) was 5.0
    against the counts format's 10.7. Its logits are solved so each expert's expected picks are the counts format's:
    the same hot ratio and no-EPLB lb, with co-activation or without."""
    cfg = SynthConfig(steps=6, layers=24, experts=128, top_k=8, tokens=1024, model=None)
    counts = log_stats(synth_counts(cfg), gpus=32, lags=(1,))
    assert 9.0 < counts.hot_ratio[0] < 12.5  # the default 11, from 24 layers' draws
    for clusters in (16, 0):
        ids, offsets = synth_topk(SynthConfig(**{**cfg.__dict__, "coact_clusters": clusters}))
        tokens = log_stats([topk_counts(ids, offsets, cfg.experts)], gpus=32, lags=(1,))
        assert abs(tokens.hot_ratio[0] / counts.hot_ratio[0] - 1) < 0.05, clusters
        assert abs(tokens.no_eplb_lb[0] / counts.no_eplb_lb[0] - 1) < 0.05, clusters


def test_synth_topk_picks_each_expert_as_often_as_the_counts_expect() -> None:
    """The logits give every expert its expected picks (`_inclusions`: k p, or the inclusion probabilities where k
    distinct picks bind, here the hottest of 16 experts top-4 at a hot ratio of 4), whatever the co-activation
    strength, within Rosen's approximation of Gumbel top-k's inclusion probabilities."""
    from eplb.synth import _inclusions, _Popularity

    for std in (0.0, 3.0, 12.0):
        cfg = SynthConfig(steps=1, layers=3, experts=16, top_k=4, tokens=40_000, groups=2, hot_ratio=4, model=None,
                          coact_std=std)  # fmt: skip
        expected = _inclusions(_Popularity(cfg).next(), cfg.top_k)
        assert expected.max() == 1.0  # an expert every token picks
        ids, offsets = synth_topk(cfg)
        picked = topk_counts(ids, offsets, cfg.experts)[0] / cfg.tokens
        assert np.abs(picked - expected).max() < 0.03, std


def test_seed004_preset_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "seed004.npz"
    assert run_cli(["synth", "--out", str(out), "--preset", "seed004"]) == 0
    counts = open_log(out).read_counts().counts
    assert counts.shape == (1, 1, 256)
    assert counts[0, 0].tolist() == seed004().tolist()  # fixtures/seed004-counts.json: the published draw


# --------------------------------------------------------------------------------------------
# The commands (through a parser built from register(); `eplb` wires it in eplb/cli/__init__.py)
# --------------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eplb")
    sub = parser.add_subparsers(dest="command")
    cli_replay.register(sub)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except EplbError as exc:
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


@pytest.mark.parametrize(("name", "steps"), [("steps.csv", 300), ("steps.csv", 30), ("rebalances.csv", 300),
                                             ("summary.json", 300)])  # fmt: skip
def test_replay_out_write_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, steps: int
) -> None:
    """A full disk under --out DIR (the file a link to /dev/full) is one error line naming the flag and the file,
    whether steps.csv fails while the replay writes it (300 steps, more than its buffer) or when it is closed (30),
    or a file written after the replay does; it was an OSError traceback."""
    log = tmp_path / "log.npz"
    write_counts(log, two_regimes(steps, shift=150, layers=2), top_k=8)
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to("/dev/full")
    assert run_cli(["replay", str(log), "--window", "50", "--interval", "100", "--gpus", "8", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"eplb replay: error: --out {out}: cannot write {name} there (No space left "
                                       "on device)\n")  # fmt: skip


def test_replay_out_replaced_by_a_file_during_the_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out DIR checked before the run, then moved away and a file put in its place while the replay runs: the
    files written after it are refused in one line, not a NotADirectoryError traceback."""
    log = tmp_path / "log.npz"
    write_counts(log, two_regimes(200, shift=150, layers=2), top_k=8)
    out = tmp_path / "run"

    def then_replace(*args: Any, **kwargs: Any) -> Any:
        done = replay_logs(*args, **kwargs)
        out.rename(tmp_path / "moved")
        out.write_text("in the way")
        return done

    monkeypatch.setattr(cli_replay, "replay_logs", then_replace)
    assert run_cli(["replay", str(log), "--window", "50", "--interval", "100", "--gpus", "8", "--out", str(out)]) == 2
    said = f"eplb replay: error: --out {out}: cannot write rebalances.csv there (Not a directory)\n"
    assert capsys.readouterr().err == said
    assert (tmp_path / "moved" / "steps.csv").read_text().count("\n") == 1 + 200 * 2  # written before, in full


def test_replay_out_refused_after_a_run_into_the_same_dir_leaves_no_file_of_the_run_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replay into --out DIR refused mid-way (a log with no tokens is refused once replayed, after steps.csv) left
    the run before's rebalances.csv and summary.json next to its own partial steps.csv: DIR mixed two runs. Those
    are removed before steps.csv is opened; a link there (to /dev/full, a full disk) is not a file of a run."""
    log, zero = tmp_path / "log.npz", tmp_path / "zero.npz"
    counts = two_regimes(60, shift=30, layers=2)
    write_counts(log, counts, top_k=8)
    write_counts(zero, np.zeros_like(counts), top_k=8)
    out = tmp_path / "run"
    flags = ["--window", "20", "--interval", "20", "--gpus", "8", "--out", str(out)]
    assert run_eplb(capsys, "replay", str(log), *flags)[0] == 0
    assert {p.name for p in out.iterdir()} == {"steps.csv", "rebalances.csv", "summary.json"}
    code, err = run_eplb(capsys, "replay", str(zero), *flags)
    assert code == 2 and last_line(err).startswith(error_prefix(["replay"])) and "no step has tokens" in err
    assert {p.name for p in out.iterdir()} == {"steps.csv"}  # the refused run's own, none of the run before's


def test_replay_schedule_line_names_the_step_id_of_the_first_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log whose step ids start at 1,000: the schedule line said 'from step 70' (the first check's position) while
    rebalances.csv and every other line name step ids (the check ran at step 1,070). It names the step id, with the
    position; a log ending before its first check names the position as one."""
    log = tmp_path / "log.npz"
    write_counts(log, two_regimes(100, shift=50, layers=2), top_k=8, steps=np.arange(1000, 1100))
    flags = ["--window", "30", "--interval", "30", "--first-rebalance", "70", "--gpus", "8"]
    assert run_cli(["replay", str(log), *flags, "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "rebalances.csv").read_text().splitlines()[1].startswith("1070,")
    assert "a check every 30 steps from step 1,070 (position 70)," in capsys.readouterr().out
    short = tmp_path / "short.npz"
    write_counts(short, two_regimes(20, shift=10, layers=2), top_k=8, steps=np.arange(1000, 1020))
    assert run_cli(["replay", str(short), *flags]) == 0
    out = capsys.readouterr().out
    assert "a check every 30 steps from step position 70," in out and "the log ends before step position 70" in out


def test_synth_then_replay_writes_the_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.npz"
    assert run_cli(["synth", "--out", str(log), "--steps", "90", "--layers", "3", "--experts", "32",
                    "--top-k", "4", "--tokens", "512", "--groups", "4", "--shift-at", "50",
                    "--hot-ratio", "4"]) == 0  # fmt: skip
    assert "hottest / mean expert" in capsys.readouterr().out
    out = tmp_path / "run"
    assert run_cli(["replay", str(log), "--window", "20", "--interval", "30", "--gpus", "8",
                    "--model", "deepseek-v3", "--out", str(out)]) == 2  # fmt: skip
    assert "the log has 32 experts, but model 'deepseek-v3' has 256: give --model" in capsys.readouterr().err
    assert run_cli(["replay", str(log), "--window", "20", "--interval", "30", "--gpus", "8", "--redundant", "8",
                    "--oracle-every", "2", "--out", str(out), "--progress"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "replay (incremental)" in captured.out and "rebalances: 2" in captured.out
    assert "(oracle on one step in 2 only: lb over those 45 steps," in captured.out  # was 'every 2-th step'
    assert "90/90 steps 100%" in captured.err
    with (out / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "layer", "lb", "oracle_lb", "static_lb", "no_eplb_lb", "hindsight_lb", "time_us"]
    assert len(rows) == 90 * 3 and rows[3]["oracle_lb"] == "" and rows[6]["oracle_lb"] != ""
    assert rows[0]["time_us"] == ""  # no model for 32 experts: no time
    with (out / "rebalances.csv").open() as f:
        rebalances = list(csv.DictReader(f))
    assert [r["step"] for r in rebalances] == ["30", "60"] and list(rebalances[0]) == [
        "step", "moves", "bytes_moved", "transfer_s", "charge_s", "solve_ms", "served"
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schedule"]["window"] == 20 and summary["cluster"]["redundant"] == 8
    assert summary["schedule"]["trigger"] == "periodic"  # no model for 32 experts: the cost trigger cannot run
    assert run_cli(["replay", str(log), "--window", "20", "--interval", "30", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rebalances"]["count"] == 2


def test_synth_names_the_default_model_on_its_own_shape_given_as_flags(tmp_path: Path) -> None:
    """`eplb synth --layers 58` (DeepSeek-V3's own layer count, as docs/formats.md's JSONL example gives it) wrote a
    log naming no model, while leaving --layers out named deepseek-v3: the default model is named whenever the log
    has its shape, 58 x 256 experts top-8, flags or not; another shape (fewer layers) names none, as before."""
    for flags, model in (([], "deepseek-v3"), (["--layers", "58"], "deepseek-v3"),
                         (["--layers", "58", "--experts", "256", "--top-k", "8"], "deepseek-v3"),
                         (["--layers", "8"], None), (["--experts", "128"], None)):  # fmt: skip
        for suffix in (".npz", ".jsonl"):
            out = tmp_path / f"s{len(flags)}{suffix}"
            assert run_cli(["synth", "--out", str(out), "--steps", "2", "--tokens", "64", *flags]) == 0
            assert open_log(out).info.model == model, (flags, suffix)


def test_every_key_of_summary_json_is_documented(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/replay.md's summary.json entry named neither `migration` nor each rebalance's `saving_s` (nor `checks`,
    `list`, ...): every top-level key, every key of `rebalances` and of each rebalance in its list is named there."""
    log = tmp_path / "log.npz"
    write_counts(log, synth_log(SynthConfig(steps=60, layers=2, experts=64, top_k=6, tokens=256, groups=1,
                                            hot_ratio=4)), model="deepseek-v2-lite", top_k=6)  # fmt: skip
    assert run_cli(["replay", str(log), "--gpus", "8", "--window", "10", "--interval", "20", "--trigger", "periodic",
                    "--oracle-every", "0", "--out", str(tmp_path / "r")]) == 0  # fmt: skip
    capsys.readouterr()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    text = (Path(__file__).resolve().parents[1] / "docs" / "replay.md").read_text()
    entry = text[text.index("  - `summary.json`:") : text.index("- a progress bar on stderr")]
    assert summary["migration"] is not None and summary["rebalances"]["list"]
    keys = [*summary, *summary["migration"], *summary["rebalances"], *summary["rebalances"]["list"][0]]
    missing = [k for k in dict.fromkeys(keys) if f"`{k}`" not in entry]
    assert not missing, missing


def test_synth_takes_the_shape_of_a_model_preset_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log named after a preset has its shape: `eplb synth --experts 16 --top-k 2 --model mixtral-8x7b` wrote a log
    `eplb replay` then refused ('model 'mixtral-8x7b' has 8 experts, the log has 16'), naming no way out. Its
    experts and layers are judged by the one rule (`ModelSpec.window_mismatch`), in its text, with its flags."""
    out = tmp_path / "s.npz"
    for flags, wrong in ((["--experts", "16", "--top-k", "2"], "have 16 experts (--experts), but model 'mixtral-8x7b' "
                          "has 8"),
                         (["--experts", "8", "--top-k", "4"], "route top-4 (--top-k), but model 'mixtral-8x7b' routes "
                          "top-2"),
                         (["--layers", "33"], "have 33 layers (--layers), but model 'mixtral-8x7b' has 32 MoE layers "
                          "(32 layers)")):  # fmt: skip
        assert run_cli(["synth", "--out", str(out), "--model", "mixtral-8x7b", "--steps", "5", *flags]) == 2
        assert capsys.readouterr().err.strip().endswith(
            f"--model mixtral-8x7b: the log would {wrong}: make them agree, or drop --model (the log then names no "
            "model)")
        assert not out.exists()
    rule = MODEL_PRESETS["mixtral-8x7b"].window_mismatch(33, 8, "the log would have", {"layers": "--layers"})
    assert run_cli(["synth", "--out", str(out), "--model", "mixtral-8x7b", "--steps", "5", "--layers", "33"]) == 2
    assert f"--model mixtral-8x7b: {rule}: make them agree" in capsys.readouterr().err  # the one rule's text
    assert run_cli(["synth", "--out", str(out), "--preset", "seed004", "--model", "kimi-k2"]) == 2
    assert ("the log would have 256 experts (--preset seed004), but model 'kimi-k2' has 384: make them agree"
            in capsys.readouterr().err)
    assert run_cli(["synth", "--out", str(out), "--model", "Mixtral-8x7B", "--steps", "30", "--layers", "3",
                    "--hot-ratio", "3", "--tokens", "64"]) == 0  # fmt: skip
    info = open_log(out).info
    assert (info.num_layers, info.num_experts, info.top_k, info.model) == (3, 8, 2, "Mixtral-8x7B")
    capsys.readouterr()
    assert run_cli(["replay", str(out), "--gpus", "4", "--window", "10", "--interval", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"]["model"] == "mixtral-8x7b"
    assert run_cli(["synth", "--out", str(out), "--model", "my-own-model", "--experts", "16", "--top-k", "2",
                    "--steps", "5", "--layers", "2", "--hot-ratio", "4"]) == 0  # no preset: any shape  # fmt: skip
    with pytest.raises(EplbError, match=r"^synth: model MIXTRAL-8x7b: the log would have 33 layers \(synth: layers\), "
                       "but model 'mixtral-8x7b'"):  # the Python API's names; the preset found whatever the case
        SynthConfig(layers=33, experts=8, top_k=2, model="MIXTRAL-8x7b").check_model()


def test_a_log_whose_model_has_other_experts_names_the_way_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "s.npz"
    write_counts(log, synth_log(SynthConfig(steps=5, layers=2, experts=16, top_k=2, tokens=32, hot_ratio=4)),
                 model="mixtral-8x7b")
    assert run_cli(["replay", str(log), "--gpus", "4"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"the log has 16 experts, but model 'mixtral-8x7b' has 8: {log} names it as its model: give --model NAME or "
        "FILE, a model with 16 experts and 2 or more MoE layers, to override it")
    assert run_cli(["replay", str(log), "--gpus", "4", "--model", "deepseek-v2-lite"]) == 2  # the log's: no drop
    assert capsys.readouterr().err.strip().endswith(
        "the log has 16 experts, but model 'deepseek-v2-lite' has 64: give --model a model with 16 experts and 2 or "
        "more MoE layers, a preset or a JSON file")
    write_counts(log, synth_log(SynthConfig(steps=5, layers=2, experts=64, top_k=2, tokens=32)))
    assert run_cli(["replay", str(log), "--gpus", "4", "--model", "mixtral-8x7b"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "the log has 64 experts, but model 'mixtral-8x7b' has 8: give --model a model with 64 experts and 2 or more "
        "MoE layers (the preset deepseek-v2-lite has), a preset or a JSON file; or drop --model")


def test_a_log_of_more_layers_than_its_model_has_is_refused_by_the_one_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb replay --model mixtral-8x7b` and `replay(cost=...)` judged a log's experts only: a 33-layer log was
    timed as Mixtral's 32 MoE layers. Both refuse it now by the rule of POST /placement and `eplb solve`
    (`ModelSpec.window_mismatch`), in one text, each naming its own way out; 32 layers replay."""
    counts = synth_log(SynthConfig(steps=6, layers=33, experts=8, top_k=2, tokens=32, hot_ratio=3))
    log = tmp_path / "s.npz"
    write_counts(log, counts, top_k=2)
    rule = "the log has 33 layers, but model 'mixtral-8x7b' has 32 MoE layers (32 layers): "
    rows = "a log with one row per MoE layer, at most 32 (fewer are a part of the model), of its 8 experts"
    assert rule == f"{MODEL_PRESETS['mixtral-8x7b'].window_mismatch(33, 8, 'the log has')}: "
    assert run_cli(["replay", str(log), "--gpus", "4", "--model", "mixtral-8x7b"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{rule}give --model a model with 8 experts and 33 or more MoE layers, a preset or a JSON file; or {rows}; or "
        "drop --model")
    cost = CostSetup(MODEL_PRESETS["mixtral-8x7b"], HARDWARE_PRESETS["h100"], 450e9, 64.0)
    cluster = Cluster(np.full(4, 3, dtype=np.int64))
    with pytest.raises(EplbError) as caught:
        replay(counts, cluster, schedule=Schedule(window=3, interval=3), cost=cost, oracle_every=0, hindsight=False)
    assert str(caught.value) == (f"{rule}give cost (a CostSetup) a model with 8 experts and 33 or more MoE layers, a "
                                 f"preset or a JSON file (eplb.specs.load_model); or {rows}; or no cost (cost=None: no "
                                 "times, no bytes)")
    fits = replay(counts[:, :32], cluster, schedule=Schedule(window=3, interval=3), cost=cost, oracle_every=0,
                  hindsight=False)  # fmt: skip
    assert fits.rebalances


def test_replay_with_a_model_reports_time_and_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.npz"
    counts = synth_log(SynthConfig(steps=12, layers=58, experts=256, tokens=2048))
    write_counts(log, counts, model="deepseek-v3", top_k=8)
    assert run_cli(["replay", str(log), "--window", "4", "--interval", "5", "--oracle-every", "0", "--json",
                    "--trigger", "periodic"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["cost"]["model"] == "deepseek-v3"
    rb = summary["rebalances"]["list"][0]  # 12 steps: the copies of the check at 5 land after the log
    assert not rb["served"] and rb["applies_from"] > 12 and rb["charge_s"] == 0
    assert rb["bytes_moved"] == rb["moves"] * MODEL_PRESETS["deepseek-v3"].expert_bytes
    assert summary["results"]["replay"]["step_time_us"] > 0


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "layer": 0, "counts": [1, 2]}\n{"step": 0, "layer": 0, "counts": [1, 2]}\n')
    assert run_cli(["replay", str(bad), "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "line 2: step 0 comes after step 1" in err
    assert run_cli(["replay", str(tmp_path / "none.npz")]) == 2
    assert "routing log not found" in capsys.readouterr().err
    assert run_cli(["synth", "--out", str(tmp_path / "x.csv")]) == 2
    assert "use a .npz or .jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "0", "-1"])
def test_a_time_limit_that_is_not_finite_and_positive_is_refused_as_solve_and_compare_refuse_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """eplb replay --time-limit inf was taken (a MILP without end at every rebalance), nan refused in other words
    than eplb solve's and eplb compare's: one check (eplb.cli.solve.check_time_limit), the same words from the three
    commands, before the log is read."""
    from eplb.cli import main

    log = tmp_path / "log.npz"
    write_counts(log, np.ones((5, 2, 16), dtype=np.int64))
    said = f"--time-limit must be > 0 seconds and finite, got {float(value):g}\n"
    assert run_cli(["replay", str(log), "--solver", "milp", f"--time-limit={value}", "--gpus", "4"]) == 2
    assert capsys.readouterr().err == f"eplb replay: error: {said}"
    assert run_cli(["replay", str(tmp_path / "none.npz"), "--solver", "milp", f"--time-limit={value}"]) == 2
    assert capsys.readouterr().err == f"eplb replay: error: {said}"  # before the log is opened
    for command in (["solve", "--solver", "milp"], ["compare", "--solvers", "milp", "--out", str(tmp_path / "r")]):
        assert main([*command, f"--time-limit={value}"]) == 2
        assert capsys.readouterr().err == f"eplb {command[0]}: error: {said}"


def test_the_oracle_reports_progress_as_its_batches_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step oracle, minutes on a large cluster (--gpus 65536 --slots-per-gpu 1: greedy takes 5 s a layer-step),
    reported no progress until its whole chunk of steps (256) was done: it reports the steps done after each batch of
    steps it solves, and a large cluster solves fewer steps a batch (at most _ORACLE_BATCH_SLOTS rows x slots)."""
    import eplb.replay.evaluate as evaluate

    monkeypatch.setattr(evaluate, "_ORACLE_BATCH_STEPS", 8)
    done: list[int] = []
    replay(two_regimes(40, shift=20, layers=2), Cluster(np.full(8, 5)), schedule=Schedule(window=10, interval=100),
           hindsight=False, progress=done.append)  # fmt: skip
    assert done == [8, 16, 24, 32, 40, 40]  # each batch of the oracle, then the chunk
    done.clear()
    replay(two_regimes(40, shift=20, layers=2), Cluster(np.full(8, 5)), schedule=Schedule(window=10, interval=100),
           hindsight=False, oracle_every=16, progress=done.append)  # fmt: skip
    assert done == [33, 40]  # positions 0, 16, 32: one batch, done once the last of them is
    done.clear()
    before = replay(two_regimes(40, shift=20, layers=2), Cluster(np.full(8, 5)),
                    schedule=Schedule(window=10, interval=100), hindsight=False, collect=True)  # fmt: skip
    monkeypatch.setattr(evaluate, "_ORACLE_BATCH_SLOTS", 5 * 2 * 40)  # 2 layers x 40 slots: 5 steps a batch
    after = replay(two_regimes(40, shift=20, layers=2), Cluster(np.full(8, 5)),
                   schedule=Schedule(window=10, interval=100), hindsight=False, collect=True, progress=done.append)
    assert done == [*range(5, 41, 5), 40]  # a larger cluster: fewer steps a batch, the same oracle
    assert before.steps is not None and after.steps is not None
    np.testing.assert_array_equal(before.steps.oracle_lb, after.steps.oracle_lb)


def test_progress_bar() -> None:
    """eplb.progress.Progress serves both the replay (a `progress(done)` callable, unit "steps",
    maybe no total) and `eplb compare` (`advance(n, note)` in a with block)."""
    stream = io.StringIO()
    bar = Progress(1000, "replay", stream, enabled=True, unit="steps")
    bar(10)
    bar(1000)
    bar.close()
    bar.close()  # once only
    text = stream.getvalue()
    assert text.startswith("\rreplay [") and "1,000/1,000 steps 100%" in text and text.endswith("\n")
    assert text.count("\n") == 1
    stream = io.StringIO()
    with Progress(None, "replay", stream, enabled=True, unit="steps") as unknown:
        unknown.update(12_345)
    assert "replay 12,345 steps" in stream.getvalue() and "left" not in stream.getvalue()
    stream = io.StringIO()
    with Progress(4, "compare", stream, enabled=True) as steps:
        steps.advance(1, "EP32 milp")
        steps.advance(9)
    assert steps.done == 4 and "4/4 100%" in stream.getvalue() and "EP32 milp" in stream.getvalue()
    quiet = io.StringIO()  # not a terminal: silent unless enabled
    with Progress(3, "compare", quiet) as silent:
        silent.advance(3)
    assert quiet.getvalue() == ""



# --------------------------------------------------------------------------------------------
# One cost model, hindsight, migration, triggers, robust placements
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dedup", [False, True])
def test_replay_time_is_predict_also_per_gpu_and_with_dedup(dedup: bool) -> None:
    """The replay's per-step time and `eplb.cost.predict` are one model: equal on the same counts, on the
    extremes path (overlap, no dedup) and on the per-GPU path (dedup)."""
    from eplb.cost import TimeModel
    from eplb.replay.evaluate import Evaluator

    rng = np.random.default_rng(5)
    counts = rng.poisson(rng.gamma(0.5, 40.0, size=(5, 2, 32)))
    slots = np.full(8, 5)
    cost = small_cost(32)
    placement = Placement(solve_greedy(counts.sum(axis=0).astype(float), slots), slots, 32)
    ev = Evaluator(TimeModel.from_specs(cost.model, cost.hardware, cost.link_bw, 8, None, True, dedup))
    ev.set_placements([placement])
    lb, times = ev.evaluate(counts)
    for t in range(5):
        ref = predict(counts[t].astype(float), placement.phy2log, slots, cost.model, cost.hardware, cost.link_bw,
                      dedup=dedup)  # fmt: skip
        assert times[0, t] == pytest.approx(ref.time_us, rel=1e-5)
        assert lb[0, t] == pytest.approx(ref.lb, rel=1e-5)


def test_hindsight_row_is_a_direct_solve_per_interval() -> None:
    log = two_regimes(250, shift=120, layers=2)
    cluster = Cluster(np.full(8, 5))
    res = replay(log, cluster, schedule=Schedule(window=30, interval=60, first=50), oracle_every=0, collect=True)
    st = res.steps
    assert st is not None
    for lo, hi in ((0, 50), (50, 110), (110, 170), (170, 230), (230, 250)):
        own = solve(log[lo:hi].sum(axis=0).astype(np.float64), cluster).placement
        for t in (lo, (lo + hi) // 2, hi - 1):
            assert st.hindsight_lb[t] == pytest.approx(balance(log[t].astype(float), own).lb, rel=1e-6)
    ratio = res.summary["results"]["replay"]["hindsight_ratio"]
    assert ratio == pytest.approx(np.nanmean(st.lb) / np.nanmean(st.hindsight_lb), rel=1e-6) and ratio > 1


def test_migration_charge_is_bytes_over_bandwidth() -> None:
    """Constructed: GPUs 0 and 2 receive two experts each, GPU 1 one: the blocking stall is the busiest
    destination's bytes over the link; with overlap the copies take 1 / share as long."""
    from eplb.cost.migration import MigrationSpec, plan_copies, plan_for
    from solvers.migration import arrange_slots

    slots = np.array([2, 2, 2])
    old = np.array([[0, 1, 2, 3, 4, 5]])
    new = np.array([[3, 4, 5, 2, 0, 1]])  # GPU 0: {3, 4} new; GPU 1: {5} new, 2 kept; GPU 2: {0, 1} new
    into = plan_copies(plan_for(arrange_slots(new, old, slots), old, slots), 3, None)[0]  # 2 keeps its slot
    assert into.tolist() == [2, 1, 2]
    bw, per_copy = 50e9, 44e6
    cost = MigrationSpec(bw, overlap=False).cost(into * per_copy, _prediction([[0.0]], [[0.0]], [[90.0]], True))
    assert cost.stall_s == pytest.approx(2 * per_copy / bw) and cost.bytes == 5 * per_copy
    charge, steps = cost.charge_s(step_time_s=0.01)
    assert charge == pytest.approx(2 * per_copy / bw) and steps == 0
    comm_bound = _prediction([[0.0, 0.0]], [[0.0, 0.0]], [[90.0, 60.0]], overlap=True)
    lap = MigrationSpec(bw, overlap=True, link_share=0.25).cost(np.array([2 * per_copy, 0.0]), comm_bound)
    assert lap.transfer_s == pytest.approx(2 * per_copy / (0.25 * bw)) and lap.stall_s == 0
    assert lap.slowdown == pytest.approx(1 / 0.75 - 1)  # the all-to-all on 0.75 of the link
    assert lap.charge_s(0.01)[0] == pytest.approx(2 * per_copy / bw)  # comm-bound: what blocking would stall
    # in a replay: the charge of each rebalance is its busiest GPU's bytes / bandwidth (blocking)
    log = two_regimes(200, shift=100, layers=2)
    cluster = Cluster(np.full(8, 5))
    small = small_cost(32)
    res = replay(log, cluster, schedule=Schedule(window=30, interval=60), cost=small, oracle_every=0,
                 migration=MigrationSpec(bw, overlap=False), hindsight=False)  # fmt: skip
    serving = initial_placement(2, 32, cluster.slots_per_gpu)
    total = 0.0
    for rb in res.rebalances:
        assert rb.transfer_s is not None and rb.charge_s == rb.transfer_s
        total += rb.charge_s
    assert res.summary["results"]["replay"]["migration_s"] == pytest.approx(total, abs=1e-6)
    first = res.rebalances[0]
    assert res.static is not None
    copies = plan_copies(plan_for(res.static.phy2log, serving.phy2log, cluster.slots_per_gpu), 8, None)[0]
    expected = copies.max() * small.model.expert_bytes
    assert first.transfer_s == pytest.approx(expected / bw)
    r = res.summary["results"]["replay"]
    assert r["total_time_s"] == pytest.approx(r["serving_s"] + r["migration_s"], abs=1e-5)


def _prediction(compute: list[list[float]], weight: list[list[float]], comm: list[list[float]],
                overlap: bool) -> Any:
    """A LayerPrediction of the given per-GPU terms [L][G] µs (the fields the migration charge reads)."""
    from eplb.cost.model import LayerPrediction, combine_terms

    c, w, m = (np.array(x, dtype=float) for x in (compute, weight, comm))
    gpu = combine_terms(c, w, m, overlap)
    layers, gpus = c.shape
    zeros, slowest = np.zeros(layers), gpu.argmax(axis=1)
    pick = np.arange(layers)
    return LayerPrediction(gpu.max(axis=1), c[pick, slowest], w[pick, slowest], m[pick, slowest], ["comm"] * layers,
                           slowest, gpu, c, w, m, np.zeros((layers, gpus)), np.zeros((layers, gpus), dtype=np.int64),
                           zeros, np.ones(layers), overlap)  # fmt: skip


def test_copies_slow_each_layer_by_its_own_comm_share() -> None:
    """The all-to-all on 1 - share of the link: each GPU's comm term grows by 1 / (1 - share). Comm hidden behind
    the GEMMs slows nothing until it surfaces; comm after the GEMMs (no overlap) always slows the step; and the
    slowdown is the layers' own, not one of their mean comm share (below, a comm-bound layer next to a GEMM-bound
    one slows the step by 0.19, where the old rule, max(0, mean share / 0.75 - 1) with a mean share of 0.625,
    said 0)."""
    from eplb.cost.migration import MigrationSpec

    spec = MigrationSpec(50e9, link_share=0.25)
    hidden = _prediction([[100.0, 90.0]], [[10.0, 10.0]], [[50.0, 60.0]], overlap=True)
    assert spec.slowdown(hidden) == 0.0  # 60 / 0.75 = 80 < 100
    after = _prediction([[60.0, 60.0]], [[10.0, 10.0]], [[40.0, 30.0]], overlap=False)  # 100 us, comm 0.4 of it
    assert spec.slowdown(after) == pytest.approx((60 + 40 / 0.75) / 100 - 1)  # 0.133
    mixed = _prediction([[0.0, 0.0], [80.0, 80.0]], [[0.0, 0.0], [0.0, 0.0]], [[100.0, 100.0], [20.0, 20.0]],
                        overlap=True)  # layer 0 all comm, layer 1 comm 0.2 of it
    assert spec.slowdown(mixed) == pytest.approx((100 / 0.75 + 80) / 180 - 1)
    assert spec.slowdown(_prediction([[0.0]], [[0.0]], [[0.0]], overlap=True)) == 0.0  # an idle step


def test_copies_hbm_traffic_is_charged_to_weight_bound_steps() -> None:
    """With overlap, a copy is read from a source GPU's HBM and written to its destination's: the busiest
    GPU's copy bytes (in + out) / HBM bandwidth when weight reads bound the step (its weight reads take
    1 / (1 - h) as long while copies take the share h of its HBM bandwidth, over the copies' transfer_s). The
    sources are the plan's (`solvers.plan`): replicas that stay put, else all holders, taken in turn."""
    from eplb.cost.migration import MigrationSpec, plan_copies, plan_for
    from solvers.plan import build_plan

    slots = np.array([2, 2, 2])
    old = np.array([[0, 1, 2, 3, 0, 5]])  # expert 0 on GPUs 0 and 2
    new = np.array([[0, 1, 0, 3, 4, 5]])  # GPU 1 takes 0 (from GPU 0, whose replica stays), GPU 2 takes 4
    old[0, 4], new[0, 4] = 4, 2  # every expert held: GPU 2 {4, 5} -> {2, 5}, 2 read from GPU 1's slot 2
    into, sent, _ = plan_copies(plan_for(new, old, slots), 3, None)
    assert into.tolist() == [0, 1, 1]
    assert sent.tolist() == [1.0, 1.0, 0.0]
    per_copy, hbm = 44e6, 8e12
    spec = MigrationSpec(900e9, hbm_bw=hbm)
    weight_bound = _prediction([[50.0] * 3], [[100.0] * 3], [[10.0] * 3], overlap=True)  # comm hidden
    cost = spec.cost(into * per_copy, weight_bound, sent * per_copy)
    assert cost.charge_s(1e-3)[0] == pytest.approx(2 * per_copy / hbm)  # GPU 1: one copy in, one out
    one = np.array([per_copy])
    assert MigrationSpec(900e9).cost(one, weight_bound, one).slowdown == 0  # HBM not asked
    blocking = MigrationSpec(900e9, overlap=False, hbm_bw=hbm).cost(one, weight_bound, one)
    assert blocking.charge_s(1e-3)[0] == pytest.approx(per_copy / 900e9)  # inside the stall
    # on aligned greedy placements of random windows the plan's reads per GPU are the estimate's, up to less than
    # one copy per (layer, expert) the GPU sends
    from solvers.greedy import solve_greedy
    from solvers.migration import arrange_slots, count_moves

    rng = np.random.default_rng(3)
    slots = np.full(8, 5)
    for _ in range(10):
        cur = solve_greedy(rng.pareto(1.5, (3, 32)) + 0.01, slots)
        nxt = arrange_slots(solve_greedy(rng.pareto(1.5, (3, 32)) + 0.01, slots), cur, slots)
        plan = build_plan(cur, nxt, slots)
        remote = plan.src_gpu != plan.dst_gpu
        sent_by_plan = np.bincount(plan.src_gpu[remote], minlength=8)
        groups = [len(set(zip(plan.layer[remote & (plan.src_gpu == g)].tolist(),
                              plan.expert[remote & (plan.src_gpu == g)].tolist(), strict=True))) for g in range(8)]
        arrived, estimate, _ = plan_copies(plan_for(nxt, cur, slots), 8, None)
        assert sent_by_plan.sum() > 20 and estimate.sum() == pytest.approx(arrived.sum())
        assert sent_by_plan.sum() == count_moves(nxt, cur, slots).sum()
        assert np.all(np.abs(estimate - sent_by_plan) <= np.array(groups) + 1e-9)


def test_cost_trigger_never_pays_more_than_it_saves() -> None:
    """Over a link of 1 kB/s every copy costs hours: the cost trigger keeps the initial placement. Over
    NVLink the same log rebalances (so the test can fail both ways)."""
    from eplb.cost.migration import MigrationSpec

    log = two_regimes(200, shift=100, layers=2)
    cluster = Cluster(np.full(8, 5))
    cost = small_cost(32, tokens_per_gpu=4096.0)
    sched = Schedule(window=30, interval=60, trigger="cost")
    slow = replay(log, cluster, schedule=sched, cost=cost, oracle_every=0, migration=MigrationSpec(1e3, overlap=False))
    assert slow.rebalances == [] and [c["decision"] for c in slow.checks] == ["keep", "keep", "keep"]
    fast = replay(log, cluster, schedule=sched, cost=cost, oracle_every=0, migration=MigrationSpec(900e9))
    assert fast.rebalances and all(r.saving_s is not None and r.saving_s > (r.charge_s or 0) for r in fast.rebalances)


def test_fixed_stall_is_charged_once_per_rebalance_that_copies() -> None:
    """A fixed stall adds to every charge, blocking or overlapped, and is not charged when nothing is copied.
    In a replay, the fastest link with a stall longer than any interval's saving keeps the first placement at
    every check, where the same log without the stall rebalances."""
    from eplb.cost.migration import MigrationSpec

    bw, per_copy, stall = 50e9, 44e6, 0.25
    bytes_in = np.array([2 * per_copy, 0.0])
    comm_bound = _prediction([[0.0, 0.0]], [[0.0, 0.0]], [[90.0, 60.0]], overlap=True)
    blocking = MigrationSpec(bw, overlap=False, fixed_stall_s=stall).cost(bytes_in, comm_bound)
    charge, steps = blocking.charge_s(0.01)
    assert charge == pytest.approx(2 * per_copy / bw + stall) and steps == 0
    plain = MigrationSpec(bw, link_share=0.25).cost(bytes_in, comm_bound)
    lap = MigrationSpec(bw, link_share=0.25, fixed_stall_s=stall).cost(bytes_in, comm_bound)
    assert lap.charge_s(0.01)[0] == pytest.approx(plain.charge_s(0.01)[0] + stall) and plain.charge_s(0.01)[0] > 0
    assert lap.charge_s(0.01)[1] == plain.charge_s(0.01)[1] > 0  # the copies span the same steps
    nothing = MigrationSpec(bw, fixed_stall_s=stall).cost(np.zeros(2), comm_bound)
    assert nothing.charge_s(0.01) == (0.0, 0)
    for bad in (-1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(EplbError, match="fixed stall"):
            MigrationSpec(bw, fixed_stall_s=bad).check()
    log = two_regimes(200, shift=100, layers=2)
    cluster = Cluster(np.full(8, 5))
    cost = small_cost(32, tokens_per_gpu=4096.0)
    sched = Schedule(window=30, interval=60, trigger="cost")
    moves = replay(log, cluster, schedule=sched, cost=cost, oracle_every=0, migration=MigrationSpec(900e9))
    assert moves.rebalances
    saved = max(r.saving_s or 0.0 for r in moves.rebalances)
    stalled = replay(log, cluster, schedule=sched, cost=cost, oracle_every=0,
                     migration=MigrationSpec(900e9, fixed_stall_s=10 * saved))  # fmt: skip
    assert stalled.rebalances == [] and {c["decision"] for c in stalled.checks} == {"keep"}
    assert stalled.summary["migration"]["fixed_stall_s"] == 10 * saved


def test_threshold_trigger_fires_exactly_above_the_threshold() -> None:
    """Checks at 60, 120, 180: the first sees vLLM's initial placement (lb well above 1.3) and fires; at 120
    the new placement serves the old regime (lb near 1): keep; the shift at 130 makes 180 fire."""
    log = two_regimes(240, shift=130, layers=2)
    cluster = Cluster(np.full(8, 5))
    res = replay(log, cluster, schedule=Schedule(window=40, interval=60, trigger="threshold", threshold=1.3),
                 oracle_every=0, collect=True)  # fmt: skip
    st = res.steps
    assert st is not None
    recent = {c: float(st.lb[c - 40 : c].mean()) for c in (60, 120, 180)}
    assert recent[60] > 1.3 and recent[120] < 1.3 and recent[180] > 1.3
    assert [c["decision"] for c in res.checks] == ["rebalance", "keep", "rebalance"]
    assert [r.position for r in res.rebalances] == [60, 180]


def test_no_lookahead_with_the_cost_trigger() -> None:
    """Two logs equal before step 120 and different after: the decision and placement at 120 match."""
    a = two_regimes(200, shift=100, layers=2, seed=1)
    b = a.copy()
    b[120:] = two_regimes(80, shift=0, layers=2, seed=9)
    cluster = Cluster(np.full(8, 5))
    sched = Schedule(window=30, interval=60, trigger="cost")
    ra, rb_ = (replay(x, cluster, schedule=sched, cost=small_cost(32, tokens_per_gpu=4096.0), oracle_every=0,
                      hindsight=False) for x in (a, b))  # fmt: skip
    at_a = [r for r in ra.rebalances if r.position <= 120]
    at_b = [r for r in rb_.rebalances if r.position <= 120]
    assert [(r.position, r.moves) for r in at_a] == [(r.position, r.moves) for r in at_b]
    assert ra.checks[:2] == rb_.checks[:2]


def test_robust_refinement_lowers_the_worst_scenario_and_keeps_the_rules() -> None:
    from solvers import registry
    from solvers.registry import Options, Problem
    from solvers.robust import worst_lb

    log = two_regimes(120, shift=60, layers=2, experts=32)
    scen = np.stack([log[:60].sum(axis=0), log[60:].sum(axis=0)]).astype(np.float64)
    loads = scen.sum(axis=0)
    slots = np.full(8, 5)
    for groups, per_node in ((None, None), (4, 4)):
        problem = Problem(loads, slots, num_groups=groups, gpus_per_node=per_node, scenarios=scen)
        plain = registry.solve("greedy", problem)
        robust = registry.solve("greedy", problem, Options(robust=True))
        gpu = np.repeat(np.arange(8), 5)
        for layer in range(2):
            x = np.concatenate([scen, loads[None]])[:, layer]
            x = x / (x.sum(axis=1, keepdims=True) / 8)
            assert worst_lb(x, robust.phy2log[layer], slots) <= worst_lb(x, plain.phy2log[layer], slots) + 1e-12
            for g in range(8):  # no expert twice on a GPU
                held = robust.phy2log[layer][gpu == g]
                assert len(set(held.tolist())) == held.size
            if groups is not None and per_node is not None:  # each expert group stays on its node
                node_of_slot = gpu // per_node
                for e in range(32):
                    before = set(node_of_slot[plain.phy2log[layer] == e].tolist())
                    assert set(node_of_slot[robust.phy2log[layer] == e].tolist()) == before
        assert robust.info["robust"]["worst_lb_after"] <= robust.info["robust"]["worst_lb_before"]
    assert robust.info["robust"]["worst_lb_after"] < robust.info["robust"]["worst_lb_before"]  # it did something
    with pytest.raises(registry.SolverError, match="robust needs scenarios"):
        registry.solve("greedy", Problem(loads, slots), Options(robust=True))


def test_cost_trigger_takes_the_most_balanced_near_the_best_net_saving() -> None:
    """Candidates whose net saving ties at the step-time floor: the most balanced of those within 5% of the best
    net saving (ties: the fewest copies), not simply the best net saving (the smallest budgets, which served the
    next interval worse); nothing when nothing pays."""
    from eplb.trigger import choose_candidate

    # net s:          small budget, mid budget, none, fresh greedy
    net = [1.00, 0.99, 0.98, 0.99]
    lb = [1.30, 1.105, 1.10, 1.095]
    copies = [50, 400, 900, 2000]
    assert choose_candidate(net, lb, copies) == 3  # the most balanced, within 5% of the best net saving
    assert choose_candidate(net, [1.30, 1.10, 1.10, 1.12], copies) == 1  # tied lb: the fewer copies
    assert choose_candidate([1.0, 0.5, 0.98, 0.90], lb, copies) == 2  # the mid budget and fresh save too little
    assert choose_candidate([-0.1, 0.0], [1.0, 1.0], [1, 2]) is None
    nan, inf = float("nan"), float("inf")  # a failed prediction is never chosen (max() kept a NaN first, then crashed)
    assert choose_candidate([nan, 0.5, 0.4], [1.0, 1.1, 1.2], [1, 2, 3]) == 1
    assert choose_candidate([inf, 0.5], [1.0, nan], [1, 2]) is None
    assert choose_candidate([], [], []) is None


def test_saving_counts_only_the_steps_after_the_copies_land() -> None:
    """A candidate saving 1 ms a step over a 100-step interval whose copies span 30 steps saves 70 ms (the serving
    placement serves meanwhile); with a delay of 40 steps, 60 ms; copies longer than the interval save nothing."""
    from eplb.cost.migration import MigrationCost
    from eplb.trigger import net_saving

    copies = MigrationCost(bytes=1.0, transfer_s=0.3, stall_s=0.0, slowdown=0.25)  # 30 steps of 10 ms: 0.3 x 0.2 s
    assert net_saving(1e-3, 100, copies, 0.01) == pytest.approx((0.07 - 0.06, 0.07))
    assert net_saving(1e-3, 100, copies, 0.01, delay=40) == pytest.approx((0.0, 0.06))
    assert net_saving(1e-3, 20, copies, 0.01) == pytest.approx((-0.06, 0.0))
    assert net_saving(1e-3, 100, None, 0.01, delay=1) == pytest.approx((0.099, 0.099))


def test_a_check_where_copies_land_runs_against_the_landed_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies that span exactly one interval land at the next check: that check runs (it was skipped as 'copies
    still in flight', so a whole interval passed without one)."""
    from eplb.cost.migration import MigrationCost, MigrationSpec

    monkeypatch.setattr(MigrationCost, "charge_s", lambda self, step_time_s: (0.0, 60))
    log = two_regimes(200, shift=100, layers=2)
    res = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=30, interval=60), cost=small_cost(32),
                 oracle_every=0, migration=MigrationSpec(900e9), hindsight=False)  # fmt: skip
    assert [c["decision"] for c in res.checks] == ["rebalance", "rebalance", "rebalance"]
    assert [r.applies_from for r in res.rebalances] == [120, 180, 240]


def test_checks_skipped_while_copies_fly_are_counted_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies spanning 70 steps at checks 60 apart: every other check is skipped; the summary counts them and the
    terminal says why (it read '2 of 4 checks' under 'rebalancing every check', as if the trigger had declined)."""
    from eplb.cli.replay import format_summary
    from eplb.cost.migration import MigrationCost, MigrationSpec

    monkeypatch.setattr(MigrationCost, "charge_s", lambda self, step_time_s: (0.0, 70))
    res = replay(two_regimes(300, shift=100, layers=2), Cluster(np.full(8, 5)),
                 schedule=Schedule(window=30, interval=60), cost=small_cost(32), oracle_every=0,
                 migration=MigrationSpec(900e9), hindsight=False)  # fmt: skip
    decisions = [c["decision"] for c in res.checks]
    assert decisions == ["rebalance", "skip", "rebalance", "skip"]
    assert res.summary["rebalances"]["skipped"] == 2
    assert "2 of 4 checks (2 skipped: the copies of the rebalance before were still in flight)" in format_summary(res)


def test_cost_trigger_keeps_the_callers_move_budget() -> None:
    """Options(max_moves=N) with the cost trigger: the policy's one budgeted solve is judged, never the trigger's
    unbudgeted or fresh candidates (a rebalance copied every slot the fresh placement moved)."""
    from solvers.registry import Options

    log = two_regimes(200, shift=100, layers=2)
    cost = small_cost(32, tokens_per_gpu=4096.0)
    res = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=30, interval=60, trigger="cost"), cost=cost,
                 solver="incremental", options=Options(max_moves=3), oracle_every=0, hindsight=False)  # fmt: skip
    assert res.rebalances and all(r.moves <= 3 for r in res.rebalances)
    free = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=30, interval=60, trigger="cost"), cost=cost,
                  solver="incremental", oracle_every=0, hindsight=False)  # fmt: skip
    assert max(r.moves for r in free.rebalances) > 3  # without the budget it moves more (the test can fail)


def test_cost_trigger_with_fresh_candidate_still_pays_for_itself() -> None:
    log = two_regimes(200, shift=100, layers=2)
    cluster = Cluster(np.full(8, 5))
    sched = Schedule(window=30, interval=60, trigger="cost")
    result = replay(log, cluster, schedule=sched, solver="incremental", cost=small_cost(32, tokens_per_gpu=4096.0),
                    oracle_every=0)
    assert result.rebalances and all(r.saving_s is not None and r.saving_s > (r.charge_s or 0)
                                     for r in result.rebalances)


# --------------------------------------------------------------------------------------------
# Steps without tokens, sampled oracles and rebalances the log ends on
# --------------------------------------------------------------------------------------------


def test_copies_after_an_idle_step_take_the_last_busy_steps_time() -> None:
    """Step 99, just before the check at 100, has no tokens (time 0): the copies still span
    transfer_s / (the last step with tokens' time) steps instead of landing at once."""
    log = two_regimes(300, shift=150, layers=2)
    log[99] = 0
    cluster, cost = Cluster(np.full(8, 5)), small_cost(32)
    res = replay(log, cluster, schedule=Schedule(window=100, interval=100), cost=cost, oracle_every=0,
                 hindsight=False)  # fmt: skip
    first = res.rebalances[0]
    step_s = float(predict_time_us(log[98:99], initial_placement(2, 32, cluster.slots_per_gpu), cost).sum()) / 1e6
    assert first.transfer_s is not None and first.position == 100
    assert first.applies_from == 100 + math.ceil(first.transfer_s / step_s) > 101


def test_a_check_whose_window_has_no_tokens_keeps() -> None:
    log = two_regimes(200, shift=150, layers=2)
    log[:100] = 0
    res = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=100, interval=100), cost=small_cost(32),
                 oracle_every=0, hindsight=False)  # fmt: skip
    assert res.checks[0] == {"position": 100, "step": 100, "decision": "keep", "reason": "the window has no tokens"}
    assert res.rebalances == []


def test_steps_and_layers_without_tokens_have_no_lb() -> None:
    """An empty step-layer is not perfectly balanced: NaN in the steps, left out of every row's statistics (its
    time still counts), of the threshold trigger's recent lb; a step without tokens is still a step of every row
    (the oracle's rows are its sampled steps), so layer ranges replayed apart count the same steps."""
    log = two_regimes(120, shift=200, layers=3)
    log[50:60] = 0
    log[:, 2] = 0  # a layer that never gets a token
    cluster = Cluster(np.full(8, 5))
    sched = Schedule(window=40, interval=60, trigger="threshold", threshold=100.0)  # keeps, telling its lb
    res = replay(log, cluster, schedule=sched, cost=small_cost(32), collect=True)
    st = res.steps
    assert st is not None
    for lb in (st.lb, st.static_lb, st.no_eplb_lb, st.hindsight_lb, st.oracle_lb):
        assert np.isnan(lb[50:60]).all() and np.isnan(lb[:, 2]).all() and not np.isnan(lb[:50, :2]).any()
    assert (st.time_us[:, 2] >= 0).all()
    for name, lb in (("replay", st.lb), ("no_eplb", st.no_eplb_lb), ("oracle", st.oracle_lb)):
        row = res.summary["results"][name]
        steps = int(st.oracle_sampled.sum()) if name == "oracle" else 120
        assert row["steps"] == steps and row["lb_mean"] == pytest.approx(np.nanmean(lb), abs=1e-6)
        assert row["serving_s"] == pytest.approx(np.nansum(st.row(name)[1]) / 1e6, abs=1e-6)
    layer_mean = st.lb[:, :2].mean(axis=1)
    assert res.checks[0]["recent_lb"] == pytest.approx(np.nanmean(layer_mean[20:60]), rel=1e-9)


def test_a_rebalances_window_lb_leaves_out_layers_without_tokens() -> None:
    """A layer without tokens in a check's window has no window lb (NaN in `window_lb`) and counts in no
    `window_lb_mean`, as in every other lb mean; merged layer ranges give the same mean. Without a cost model a
    check whose window has no tokens at all still rebalances (every layer's window lb NaN, the mean null in
    summary.json, which stays strict JSON)."""
    log = two_regimes(90, shift=200, layers=4)
    log[:30, :2] = 0  # layers 0-1 idle in the first check's window
    log[30:60] = 0  # the second check's window has no token at all
    cluster, sched = Cluster(np.full(8, 5)), Schedule(window=30, interval=30)
    res = replay(log, cluster, schedule=sched, oracle_every=0, hindsight=False)
    first, empty = res.rebalances[0], res.rebalances[1]
    assert np.isnan(first.window_lb[:2]).all() and (first.window_lb[2:] > 1.0).all()
    assert first.window_lb_mean == pytest.approx(float(first.window_lb[2:].mean()), rel=1e-12)
    assert empty.position == 60 and np.isnan(empty.window_lb).all() and empty.window_lb_mean is None
    listed = json.loads(json.dumps(res.summary, allow_nan=False))["rebalances"]["list"]
    assert [r["window_lb_mean"] for r in listed[:2]] == [first.window_lb_mean, None]
    merged = replay_logs(LocalExecutor(), [log], cluster, schedule=sched, parts=2, oracle_every=0)[0]
    assert [r.window_lb_mean for r in merged.rebalances] == pytest.approx([r.window_lb_mean for r in res.rebalances])


def test_a_log_with_one_busy_step_reports_that_steps_lb() -> None:
    log = np.zeros((33, 2, 32), dtype=np.int64)
    log[0] = two_regimes(1, shift=5, layers=2)[0]
    res = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=16, interval=16), collect=True)
    start = initial_placement(2, 32, np.full(8, 5))
    no_eplb = res.summary["results"]["no_eplb"]
    assert no_eplb["steps"] == 33 and no_eplb["lb_mean"] == pytest.approx(
        balance(log[0].astype(float), contiguous_placement(2, 32, 8)).lb.mean(), abs=1e-6)
    assert res.summary["results"]["replay"]["lb_mean"] == pytest.approx(
        balance(log[0].astype(float), start).lb.mean(), abs=1e-6)
    empty = replay(np.zeros((20, 2, 32), dtype=np.int64), Cluster(np.full(8, 5)), schedule=Schedule(10, 10))
    assert all(row == {"steps": 0} for row in empty.summary["results"].values())


def test_lb_percentiles_are_nearest_rank_and_exact_on_small_samples() -> None:
    """p50 and p99 are the ceil(q n)-th smallest lb (numpy's inverted_cdf), exactly while a row has at most
    EXACT_VALUES of them; beyond, at most one 0.001 bin above. A 1-step, 2-layer log reported p99 = p50, the
    smaller lb, though p99 of two values is the larger one."""
    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 7, 50, 99, 100, 101, 1000):
        values = 1.0 + rng.exponential(0.3, size=n)
        stats = RowStats()
        for part in np.array_split(values, 3):
            stats.add(part[:, None], np.zeros((part.size, 1)))
        for q in (0.01, 0.5, 0.9, 0.99, 1.0):
            assert stats.quantile(q) == np.quantile(values, q, method="inverted_cdf"), (n, q)
        # 0.07 x 100 is 7.000000000000001 in floats, and numpy takes the 8th smallest of 100: the 7th is 7%'s
        assert stats.quantile(0.07) == np.sort(values)[max(1, math.ceil(Fraction(7, 100) * n)) - 1], n
    big = 1.0 + rng.exponential(0.3, size=EXACT_VALUES + 10)
    stats = RowStats()
    stats.add(big[: EXACT_VALUES // 2, None], np.zeros((EXACT_VALUES // 2, 1)))
    assert stats.exact
    stats.add(big[EXACT_VALUES // 2 :, None], np.zeros((big.size - EXACT_VALUES // 2, 1)))
    assert not stats.exact and not stats.values
    for q in (0.5, 0.99):
        want = np.quantile(big, q, method="inverted_cdf")
        assert want <= stats.quantile(q) <= want + 1e-3
    log = two_regimes(1, shift=5, layers=2)
    lb = balance(log[0].astype(float), contiguous_placement(2, 32, 8)).lb
    assert lb[0] != lb[1]
    row = replay(log, Cluster(np.full(8, 5)), schedule=Schedule(window=1, interval=2)).summary["results"]["no_eplb"]
    assert (row["lb_p50"], row["lb_p99"]) == (round(lb.min(), 3), round(lb.max(), 3))


def test_layer_ranges_merge_to_the_whole_rows_percentiles() -> None:
    rng = np.random.default_rng(2)
    lb = 1.0 + rng.exponential(0.2, size=(40, 6))
    whole, parts = RowStats(), [RowStats(), RowStats()]
    whole.add(lb, np.zeros_like(lb))
    parts[0].add(lb[:, :4], np.zeros((40, 4)))
    parts[1].add(lb[:, 4:], np.zeros((40, 2)))
    merged = RowStats.merged(parts)
    assert merged.exact and merged.to_dict() == whole.to_dict()


def test_a_sampled_oracles_total_time_is_scaled_to_all_steps() -> None:
    log = two_regimes(200, shift=100, layers=2)
    cluster, cost = Cluster(np.full(8, 5)), small_cost(32)
    sched = Schedule(window=50, interval=50, trigger="periodic")
    every = replay(log, cluster, schedule=sched, cost=cost, hindsight=False).summary["results"]
    sampled = replay(log, cluster, schedule=sched, cost=cost, hindsight=False, oracle_every=10).summary["results"]
    oracle, full = sampled["oracle"], every["oracle"]
    assert oracle["steps"] == 20 and full["steps"] == 200
    assert oracle["total_time_s"] == pytest.approx(oracle["step_time_us"] * 200 / 1e6, rel=1e-5)
    assert oracle["total_time_s"] == pytest.approx(full["total_time_s"], rel=0.02)
    assert oracle["speedup_vs_no_eplb"] == pytest.approx(full["speedup_vs_no_eplb"], rel=0.02)


def test_a_rebalance_the_log_ends_on_is_never_served_nor_charged() -> None:
    """The copies of the check at 100 land after a 103-step log's end: the rebalance is marked never served and
    charged nothing, static stays vLLM's initial placement; in a longer log the same rebalance serves and is
    charged."""
    log = two_regimes(300, shift=150, layers=2)
    cluster, cost = Cluster(np.full(8, 5)), small_cost(32)
    sched = Schedule(window=100, interval=100, trigger="periodic")
    kwargs: dict[str, Any] = {"schedule": sched, "cost": cost, "oracle_every": 0, "hindsight": False, "collect": True}
    long = replay(log, cluster, **kwargs)
    served = long.rebalances[0]
    assert served.served and served.charge_s is not None and served.charge_s > 0 and served.applies_from > 103
    short = replay(log[:103], cluster, **kwargs)
    [never] = short.rebalances
    assert (never.position, never.moves, never.served, never.charge_s) == (100, served.moves, False, 0)
    assert short.static is None and short.checks[0]["served"] is False
    summary = short.summary
    assert summary["rebalances"]["list"][0]["served"] is False
    assert summary["results"]["replay"]["migration_s"] == summary["results"]["static"]["migration_s"] == 0
    st = short.steps
    assert st is not None and np.array_equal(st.lb, st.static_lb)
    assert "the one at step 100 never served: the log ended while its" in cli_replay.format_summary(short)
    # cut the long log before the second rebalance's copies land: only the first is charged
    cut = replay(log[: long.rebalances[1].position + 2], cluster, **kwargs)
    assert [(r.position, r.served) for r in cut.rebalances] == [(100, True), (200, False)]
    assert cut.summary["results"]["replay"]["migration_s"] == pytest.approx(served.charge_s, abs=1e-6)


def test_replay_help_states_the_defaults_and_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_cli(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the options' help
    assert "periodic rebalancing" not in text and "vLLM's defaults" not in text
    assert "--solver (default incremental" in text and "default: cost when a model is known" in text
    for phrase in ("MILP time limit per layer and rebalance, seconds (default: 5, as eplb solve)",
                   "ALPHA in (0, 1], 1: the last step alone (default: plain sum)",
                   "K sub-windows, 2 .. the steps the first check's window holds (--window,",
                   "the fraction of the link the copies take, in (0, 1)", "(default: the all-to-all link, --link;"):
        assert phrase in text


def test_weight_copies_take_the_all_to_all_link_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As the Python API and deployments: --link nic prices copies over the NIC, not NVLink; a two-link --link keeps
    both links; --migration-link still overrides."""
    log = tmp_path / "log.npz"
    write_counts(log, synth_log(SynthConfig(steps=12, layers=2, experts=256, tokens=2048)), model="deepseek-v3",
                 top_k=8)  # fmt: skip
    hw = HARDWARE_PRESETS["b200"]
    base = [str(log), "--window", "4", "--interval", "5", "--oracle-every", "0", "--json", "--gpus-per-node", "8"]
    for extra, link, between in ((["--link", "nic"], hw.nic_bandwidth, None),
                                 ([], hw.nvlink_bandwidth, None),
                                 (["--link", "nvlink+nic"], hw.nvlink_bandwidth, hw.nic_bandwidth),
                                 (["--link", "nic", "--migration-link", "nvlink"], hw.nvlink_bandwidth, None)):
        assert run_cli(["replay", *base, *extra]) == 0
        migration = json.loads(capsys.readouterr().out)["migration"]
        assert (migration["link_bandwidth"], migration["inter_node_bandwidth"]) == (link, between), extra


def test_the_first_rebalance_is_timed_without_the_process_start_up(tmp_path: Path) -> None:
    """The first rebalance's solve_ms carried scipy's one-time import (~0.3 s, the linear assignment that
    relabels a new placement onto the serving one), so `eplb replay`'s solve_ms_mean and solve_ms_max were that
    start-up: `replay` now warms the process up before its loop, with `eplb.replay.run.warm_up`, the one warm-up
    `eplb compare --log` uses too. Checked in a fresh interpreter (this one may have imported scipy already):
    scipy's assignment is loaded when the loop starts, and `eplb solve` never imports scipy."""
    import subprocess

    log = tmp_path / "log.npz"
    write_counts(log, np.random.default_rng(0).integers(0, 50, (40, 2, 16)))
    script = f"""
import sys
import eplb.replay.run as run
from eplb.cli import main
assert "scipy.optimize" not in sys.modules
seen = []
loop = run._Replay.run
def spy(self, *args, **kwargs):
    seen.append("scipy.optimize" in sys.modules)
    return loop(self, *args, **kwargs)
run._Replay.run = spy
assert main(["replay", {str(log)!r}, "--gpus", "4", "--interval", "10", "--window", "10", "--solver", "greedy",
             "--oracle-every", "0", "--no-progress", "--json"]) == 0
assert seen == [True], seen
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import sys; from eplb.cli import main; main(['solve']); "
                           "assert not [m for m in sys.modules if m.startswith('scipy')]"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import eplb.report

    assert not hasattr(eplb.report, "_warm_up")  # compare's replays go through `replay`'s warm-up


@pytest.mark.parametrize("objective", ["lb", "time"])
def test_the_warm_up_solves_by_the_replays_objective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, objective: str
) -> None:
    """`warm_up` solved by lb whatever the replay's objective, so a `--objective time` replay's first rebalance
    still paid the time path's one-time costs (the co-activation summary, the candidates' co-location search,
    the cost model with copies per token). Its tiny solve now takes the rebalances' path: the same objective,
    a cost (the replay's specs) and a co-activation summary with the time objective, none without."""
    import eplb.replay.run as run
    from eplb.io.logs import write_topk

    log = tmp_path / "topk.npz"
    ids = (np.arange(40 * 16)[:, None, None] * 7 + np.arange(2)[None, None, :] * 3 + np.arange(2)[None, :, None]) % 16
    write_topk(log, ids, np.arange(0, 40 * 16 + 1, 16), num_experts=16)  # 40 steps x 16 tokens x 2 layers, top-2
    cost = small_cost(16, top_k=2, tokens_per_gpu=16)
    calls: list[dict[str, object]] = []
    real = solve  # what eplb.replay.run imports, patched there

    def spy(loads: np.ndarray, cluster: Cluster, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(loads, cluster, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "solve", spy)
    replay(log, Cluster(np.full(4, 5, dtype=np.int64)), schedule=Schedule(window=10, interval=10, trigger="periodic"),
           solver="greedy", cost=cost, objective=objective, oracle_every=0, hindsight=False)  # fmt: skip
    warm, *rebalances = calls
    assert rebalances and all(c["objective"] == objective for c in calls)
    timed = objective == "time"
    assert (warm["cost"] is not None, warm["coactivation"] is not None) == (timed, timed)
    assert (rebalances[0]["cost"] is not None, rebalances[0]["coactivation"] is not None) == (timed, timed)
    if timed:
        assert warm["cost"].hardware == cost.hardware and warm["cost"].link_bw == cost.link_bw  # type: ignore[attr-defined]
    assert warm["current"] is not None and warm["empty_slots"] is False  # as a rebalance solves


@pytest.mark.parametrize(("gpus_per_node", "num_groups"), [(None, None), (4, None), (4, 4)])
def test_the_warm_up_solves_on_the_replays_cluster_shape(
    monkeypatch: pytest.MonkeyPatch, gpus_per_node: int | None, num_groups: int | None
) -> None:
    """`warm_up` solved on a tiny cluster of no nodes and no groups whatever the replay's cluster, so a replay with
    groups (the hierarchical policy) paid its path's one-time costs (the solver's hierarchical code, relabelling
    node by node) in its first rebalance. The tiny cluster now follows the replay's: nodes when it has GPUs per
    node, expert groups on them when it has groups; the solver gets a hierarchical problem exactly when every
    rebalance does, from a serving placement as they are."""
    from solvers import registry

    counts = np.random.default_rng(3).integers(0, 40, (30, 2, 16))
    problems: list[tuple[bool, bool, bool]] = []  # (nodes, hierarchical, from a serving placement) of each solve
    real = registry.solve

    def spy(name: str, problem: registry.Problem, options: registry.Options) -> registry.Solution:
        problems.append((problem.gpus_per_node is not None, problem.hierarchical, problem.current_phy2log is not None))
        return real(name, problem, options)

    monkeypatch.setattr(registry, "solve", spy)
    cluster = Cluster(np.full(8, 3, dtype=np.int64), gpus_per_node=gpus_per_node, num_groups=num_groups)
    replay(counts, cluster, schedule=Schedule(window=10, interval=10, trigger="periodic"), solver="greedy",
           oracle_every=0, hindsight=False)  # fmt: skip
    warm, *rebalances = problems
    assert len(rebalances) == 2 and set(rebalances) == {warm}
    assert warm == (gpus_per_node is not None, num_groups is not None, True)


def test_the_python_apis_refusal_of_a_model_with_other_experts_names_the_way_out() -> None:
    """`replay` with a cost whose model has other experts than the log said only 'model X has 8 experts, the log
    has 64', naming no way out; it now says the CLI's one message (`eplb.solve.model_mismatch`) in the Python API's
    words: the cost's model to give (the preset that has the log's experts), or no cost unless the cost trigger
    needs one."""
    counts = np.random.default_rng(4).integers(0, 30, (20, 2, 64))
    cluster = Cluster(np.full(8, 9, dtype=np.int64))
    lead = ("the log has 64 experts, but model 'mixtral-8x7b' has 8: give cost (a CostSetup) a model with 64 experts "
            "and 2 or more MoE layers (the preset deepseek-v2-lite has), a preset or a JSON file "
            "(eplb.specs.load_model)")
    cost = CostSetup(MODEL_PRESETS["mixtral-8x7b"], HARDWARE_PRESETS["h100"], 450e9, 64.0)
    for trigger, way in (("periodic", "; or no cost (cost=None: no times, no bytes)"), ("cost", "")):
        with pytest.raises(EplbError) as caught:
            replay(counts, cluster, schedule=Schedule(window=10, interval=10, trigger=trigger), cost=cost,
                   oracle_every=0, hindsight=False)  # fmt: skip
        assert str(caught.value) == lead + way


@pytest.mark.parametrize(("fields", "api", "cli"), [
    ({"window": 1000, "interval": 100, "robust_windows": 900},
     "robust_windows 900: the window of the first check (step 100, interval) holds 100 steps (interval), too few "
     "for 900 sub-windows of a step or more: give robust_windows 2 .. 100",
     "--robust-windows 900: the window of the first check (step 100, --interval) holds 100 steps (--interval), too "
     "few for 900 sub-windows of a step or more: give --robust-windows 2 .. 100"),
    ({"window": 50, "interval": 100, "first": 1, "robust_windows": 2},
     "robust_windows 2: the window of the first check (step 1, first) holds 1 step (first), too few for 2 "
     "sub-windows of a step or more: drop robust_windows or give a later first",
     "--robust-windows 2: the window of the first check (step 1, --first-rebalance) holds 1 step "
     "(--first-rebalance), too few for 2 sub-windows of a step or more: drop --robust-windows or give a later "
     "--first-rebalance"),
    ({"window": 8, "interval": 100, "robust_windows": 9}, "robust_windows must be 2 .. window (8), got 9",
     "--robust-windows must be 2 .. --window (8), got 9"),
    ({"window": 8, "interval": 100, "robust_windows": 1}, "robust_windows must be 2 .. window (8), got 1",
     "--robust-windows must be 2 .. --window (8), got 1"),
    # below 2 at a first check earlier than the window: it said 2 .. --window (1000), when 100 is the most
    ({"window": 1000, "interval": 100, "robust_windows": 1},
     "robust_windows must be 2 .. 100, the steps the window of the first check (step 100, interval) holds, got 1",
     "--robust-windows must be 2 .. 100, the steps the window of the first check (step 100, --interval) holds, got 1"),
    ({"window": 1000, "interval": 100, "robust_windows": 2000},
     "robust_windows 2,000: the window of the first check (step 100, interval) holds 100 steps (interval), too few "
     "for 2,000 sub-windows of a step or more: give robust_windows 2 .. 100",
     "--robust-windows 2,000: the window of the first check (step 100, --interval) holds 100 steps (--interval), "
     "too few for 2,000 sub-windows of a step or more: give --robust-windows 2 .. 100"),
    ({"window": 50, "interval": 100, "first": 1, "robust_windows": 1},
     "robust_windows 1: the window of the first check (step 1, first) holds 1 step (first), too few for 2 "
     "sub-windows of a step or more: drop robust_windows or give a later first",
     "--robust-windows 1: the window of the first check (step 1, --first-rebalance) holds 1 step "
     "(--first-rebalance), too few for 2 sub-windows of a step or more: drop --robust-windows or give a later "
     "--first-rebalance"),
])  # fmt: skip
def test_robust_windows_are_bounded_by_the_first_checks_window_in_the_python_api_as_in_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any], api: str, cli: str
) -> None:
    """`replay(Schedule(window=1000, interval=100, robust_windows=900))` ran 'robust over 900 sub-windows' of the
    first check's 100 steps (cutting 100): only `eplb replay` refused it (e53444b), by its own check and texts.
    One check now, `Schedule.check`: the Python API's words name the fields, the CLI's the flags; the most
    sub-windows the first check's window holds are taken."""
    counts = np.random.default_rng(5).integers(0, 30, (120, 2, 16))
    cluster = Cluster(np.full(4, 5, dtype=np.int64))
    with pytest.raises(EplbError) as caught:
        replay(counts, cluster, schedule=Schedule(**fields), oracle_every=0, hindsight=False)
    assert str(caught.value) == api
    log = tmp_path / "log.npz"
    write_counts(log, counts, top_k=2)
    flags = {"window": "--window", "interval": "--interval", "first": "--first-rebalance",
             "robust_windows": "--robust-windows"}  # fmt: skip
    argv = [arg for field, value in fields.items() for arg in (flags[field], str(value))]
    assert run_cli(["replay", str(log), "--gpus", "4", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err == f"eplb replay: error: {cli}\n"
    most = min(fields["window"], fields.get("first", fields["interval"]))
    if most >= 2:
        result = replay(counts, cluster, schedule=Schedule(**{**fields, "robust_windows": most}), oracle_every=0,
                        hindsight=False)  # fmt: skip
        assert result.rebalances


def _small_topk_log(path: Path, hot: bool = False) -> Path:
    """40 steps x 16 tokens x 2 layers, top-2 of 16 experts (with `hot`, every token also picks expert 0)."""
    from eplb.io.logs import write_topk

    ids = (np.arange(40 * 16)[:, None, None] * 7 + np.arange(2)[None, None, :] * 3 + np.arange(2)[None, :, None]) % 16
    if hot:
        ids[:, :, 0] = 0
        ids[:, :, 1] = 1 + np.arange(40 * 16)[:, None] % 15
    write_topk(path, ids, np.arange(0, 40 * 16 + 1, 16), num_experts=16)
    return path


def test_a_token_log_above_the_limit_is_replayed_as_counts_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token-level log of more picks than TOKEN_LOG_MAX was replayed as counts silently (no dispatch copies per
    token, the comm term per pick): the summary's notes and the terminal now say so; under the limit, no note."""
    import eplb.replay.run as run
    from eplb.cli import main

    log = _small_topk_log(tmp_path / "topk.npz")  # 640 tokens x 2 layers x top-2: 2,560 picks
    args = (log, Cluster(np.full(4, 5, dtype=np.int64)))
    kwargs: dict[str, Any] = dict(schedule=Schedule(window=10, interval=10, trigger="periodic"), oracle_every=0)
    held = replay(*args, **kwargs).summary
    assert held["notes"] == [] and held["results"]["replay"]["copies_per_token"] > 0
    monkeypatch.setattr(run, "TOKEN_LOG_MAX", 2_000)
    counted = replay(*args, **kwargs).summary
    assert "copies_per_token" not in counted["results"]["replay"]
    assert counted["notes"] == [
        "note: the log's 2,560 picks (tokens x layers x top-k) are above the 2,000 a replay holds (TOKEN_LOG_MAX), so "
        "it is replayed as per-step counts: no dispatch copies per token, and the all-to-all is timed one copy per "
        "pick, not per GPU a token reaches (cut the log to keep its tokens)"]
    assert main(["replay", str(log), "--gpus", "4", "--window", "10", "--interval", "10", "--trigger", "periodic",
                 "--oracle-every", "0"]) == 0  # fmt: skip
    assert counted["notes"][0] in capsys.readouterr().out.splitlines()


def test_a_replay_slower_than_no_eplb_for_its_weight_reads_has_eplb_solves_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 16 tokens per GPU the 4 redundant slots' weight reads outweigh the balance: the replay's MoE time is above
    no EPLB's, and the summary and terminal carry eplb solve's note (one function); without redundant slots, or
    with a hot expert and many tokens per GPU, it is not slower and there is no note."""
    log = _small_topk_log(tmp_path / "topk.npz")
    kwargs: dict[str, Any] = dict(schedule=Schedule(window=10, interval=10, trigger="periodic"), oracle_every=0)
    small = replay(log, Cluster(np.full(4, 5, dtype=np.int64)), cost=small_cost(16, top_k=2, tokens_per_gpu=16),
                   **kwargs).summary  # fmt: skip
    rows = small["results"]
    assert rows["replay"]["total_time_s"] > rows["no_eplb"]["total_time_s"]
    note = weight_reads_note(16, 20, "; fewer redundant slots (--redundant) read less", baseline="no EPLB",
                             placement="the replay's placements fill")
    assert small["notes"] == [note] and note.startswith("note: slower than no EPLB, which reads 16 experts' weights")
    none = replay(log, Cluster(np.full(4, 4, dtype=np.int64)), cost=small_cost(16, top_k=2, tokens_per_gpu=16),
                  **kwargs).summary  # fmt: skip
    assert none["notes"] == []
    hot = replay(_small_topk_log(tmp_path / "hot.npz", hot=True), Cluster(np.full(4, 5, dtype=np.int64)),
                 cost=small_cost(16, top_k=2, tokens_per_gpu=4096), **kwargs).summary  # fmt: skip
    assert hot["results"]["replay"]["total_time_s"] < hot["results"]["no_eplb"]["total_time_s"] and hot["notes"] == []
