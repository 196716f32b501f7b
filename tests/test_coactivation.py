"""Co-activation statistics, copies per token, the summary and the co-activation-aware solver."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import solvers.coactivation as coact
from eplb.coactivation import (
    CoactivationSummary,
    approx_copies_per_token,
    copies_per_token,
    pair_counts,
    read_topk,
    replica_gpus,
    summarize,
)
from eplb.errors import EplbError
from eplb.io.logs import write_counts, write_topk
from solvers import _coact
from solvers.greedy import solve_greedy
from solvers.registry import Options, Problem, SolverError, solve

FIXTURE = Path(__file__).parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"


def _brute(ids: np.ndarray, p2l: np.ndarray, slots: np.ndarray, rule: str, per_node: int) -> tuple[float, float, float]:
    """Mean distinct GPUs, remote GPUs and nodes per token of one layer, token by token."""
    gpu_of = [g for g, s in enumerate(slots) for _ in range(s)]
    replicas: dict[int, list[int]] = {}
    for s, e in enumerate(p2l):
        replicas.setdefault(int(e), []).append(gpu_of[s])
    num_gpus = len(slots)
    tot_g = tot_r = tot_n = 0
    for t, picks in enumerate(ids):
        src = t % num_gpus
        single = {replicas[int(e)][0] for e in picks if len(replicas[int(e)]) == 1} | {src}
        dest = []
        for j, e in enumerate(picks):
            reps = replicas[int(e)]
            vllm = reps[(t * len(picks) + j) % len(reps)]
            if rule == "vllm" or len(reps) == 1:
                dest.append(vllm)
            elif rule == "sglang":
                dest.append(src if src in reps else reps[src % len(reps)])
            else:
                near = [g for g in reps if g in single]
                dest.append(near[0] if near else vllm)
        tot_g += len(set(dest))
        tot_r += len(set(dest) - {src})
        tot_n += len({g // per_node for g in dest})
    n = len(ids)
    return tot_g / n, tot_r / n, tot_n / n


@pytest.mark.parametrize("rule", ["vllm", "sglang", "coact"])
def test_copies_equal_brute_force_count(rule: str) -> None:
    rng = np.random.default_rng(3)
    experts, k, tokens = 12, 3, 300
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens * 2)]).reshape(tokens, 2, k)
    slots = np.array([4, 4, 3, 5])  # 16 slots: 4 replicas spread over uneven GPUs
    p2l = np.stack([np.r_[rng.permutation(experts), rng.choice(experts, 4, replace=False)] for _ in range(2)])
    got = copies_per_token(ids, p2l, slots, experts, gpus_per_node=2, rule=rule)
    for layer in range(2):
        g, r, n = _brute(ids[:, layer], p2l[layer], slots, rule, 2)
        assert got.gpus[layer] == pytest.approx(g)
        assert got.remote_gpus[layer] == pytest.approx(r)
        assert got.nodes[layer] == pytest.approx(n)


def test_one_gpu_per_token_when_its_experts_share_a_gpu() -> None:
    # 4 GPUs x 4 slots; every token picks 3 of the 4 experts of one GPU
    rng = np.random.default_rng(0)
    home = rng.integers(0, 4, 500)
    ids = np.stack([home * 4 + rng.permutation(4)[:3] for home in home])[:, None, :]
    p2l = np.arange(16)[None, :]
    stats = copies_per_token(ids, p2l, np.full(4, 4), 16, gpus_per_node=2)
    assert stats.gpus[0] == 1.0
    assert stats.nodes[0] == 1.0
    spread = copies_per_token(ids, np.arange(16).reshape(4, 4).T.reshape(1, 16), np.full(4, 4), 16)
    assert spread.gpus[0] == 3.0  # the same log with each GPU holding one expert of every group


def test_summary_round_trip_and_full_partner_list_is_exact() -> None:
    ids, _ = read_topk(FIXTURE)
    sample = ids[:2000, :3]
    full = summarize(sample, 64, partners=63)
    pairs = pair_counts(sample, 64).astype(float)
    idx = np.arange(64)
    pairs[:, idx, idx] = 0
    assert np.allclose(full.pair_estimate(), pairs)
    small = summarize(sample, 64, partners=4)
    back = CoactivationSummary.from_dict(small.to_dict())
    assert np.array_equal(back.partners, small.partners) and np.array_equal(back.counts, small.counts)
    with pytest.raises(EplbError, match="partners"):
        CoactivationSummary.from_dict({**small.to_dict(), "partners": [[[99] * 4] * 64] * 3})


def test_summary_estimate_tracks_exact_copies_on_real_routing() -> None:
    ids, _ = read_topk(FIXTURE)
    sample = ids[:, :4]
    p2l = np.tile(np.arange(64), (4, 1))
    exact = copies_per_token(sample, p2l, np.full(8, 8), 64, gpus_per_node=4)
    gpus, nodes = approx_copies_per_token(summarize(sample, 64, partners=8), p2l, np.full(8, 8), gpus_per_node=4)
    assert np.all(np.abs(gpus - exact.gpus) < 0.3)
    assert np.all(np.abs(nodes - exact.nodes) < 0.1)


def test_summary_estimate_is_exact_where_its_moment_bounds_meet() -> None:
    """Pairs always chosen together (the docs' summary example): one GPU per token when each pair shares a
    GPU, two when it is split; a node holding every expert is reached by every token. The product form
    alone said 1.5, 1.70 and 0.98 here."""
    example = CoactivationSummary.from_dict({
        "format": "eplb.coactivation-summary/v1", "top_k": 2, "tokens": [200], "loads": [[100, 100, 100, 100]],
        "partners": [[[1, -1], [0, -1], [3, -1], [2, -1]]], "counts": [[[100, 0], [100, 0], [100, 0], [100, 0]]]})
    for p2l, gpus in (([0, 1, 2, 3], 1.0), ([0, 2, 1, 3], 2.0)):
        got, _ = approx_copies_per_token(example, np.array([p2l]), np.array([2, 2]))
        assert got[0] == pytest.approx(gpus)
    ids, _ = read_topk(FIXTURE)
    sample = ids[:2000, :3]
    _, nodes = approx_copies_per_token(summarize(sample, 64), np.tile(np.arange(64), (3, 1)), np.full(8, 8),
                                       gpus_per_node=8)  # fmt: skip
    assert np.allclose(nodes, 1.0)


def test_read_topk_refuses_counts_logs(tmp_path: Path) -> None:
    path = tmp_path / "counts.npz"
    write_counts(path, np.ones((2, 1, 4), dtype=np.int64), top_k=1)
    with pytest.raises(EplbError, match="token-level"):
        read_topk(path)


def _clustered_log(tokens: int, seed: int) -> np.ndarray:
    """16 experts in 4 hidden clusters (ids interleaved); a token picks 2 of 4 from one cluster,
    sometimes one from anywhere: [tokens, 1, 3]."""
    rng = np.random.default_rng(seed)
    cluster = rng.integers(0, 4, tokens)
    out = np.empty((tokens, 1, 3), dtype=np.int64)
    for t, c in enumerate(cluster):
        members = c + 4 * np.arange(4)
        first = rng.choice(members, 2, replace=False)
        rest = rng.choice(np.setdiff1d(np.arange(16), first))
        out[t, 0] = [*first, rest]
    return out


def test_greedy_coact_cuts_copies_within_the_lb_cap(tmp_path: Path) -> None:
    train, test = _clustered_log(4000, 1), _clustered_log(4000, 2)
    slots = np.full(4, 4)
    pairs = pair_counts(train, 16).astype(float)
    loads = pairs[:, np.arange(16), np.arange(16)]
    base = solve("greedy", Problem(loads, slots))
    problem = Problem(loads, slots, coactivation=pairs)
    coact = solve("greedy-coact", problem, Options(max_lb_slack=0.01))
    before = copies_per_token(test, base.phy2log, slots, 16).gpus[0]
    after = copies_per_token(test, coact.phy2log, slots, 16).gpus[0]
    assert after < 0.92 * before  # measured 2.18 against 2.46

    def max_load(p2l: np.ndarray) -> float:
        return float(np.bincount(np.repeat(np.arange(4), 4), weights=loads[0][p2l[0]]).max())

    assert max_load(coact.phy2log) <= max_load(base.phy2log) * 1.01 + 1e-9
    with pytest.raises(SolverError, match="co-activation"):
        solve("greedy-coact", Problem(loads, slots))
    write_topk(tmp_path / "t.npz", train, [0, 4000], num_experts=16)
    assert np.array_equal(read_topk(tmp_path / "t.npz")[0], train)


def test_synthetic_tokens_carry_calibrated_co_activation() -> None:
    from eplb.coactivation import partner_lift
    from eplb.synth import SynthConfig, synth_topk

    cfg = SynthConfig(steps=2, layers=4, experts=32, top_k=4, tokens=3000, groups=4, model=None, hot_ratio=4)
    ids, _ = synth_topk(cfg)
    assert np.all(np.sort(ids, axis=2)[:, :, 1:] != np.sort(ids, axis=2)[:, :, :-1])
    lift = partner_lift(ids, 32)
    assert abs(lift - cfg.partner_lift) < 0.4  # calibrated on the ESFT logs' mean, 2.27
    independent, _ = synth_topk(SynthConfig(**{**cfg.__dict__, "coact_clusters": 0}))
    assert partner_lift(independent, 32) < 1.3
    real, _ = read_topk(FIXTURE)
    assert 2.2 < partner_lift(real, 64) < 2.6  # the law task: 2.43


# --- the compiled swap loop (solvers/_coact.c) against the numpy loop it replaces ------------------------


def _random_case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """(row [P], loads [S + 1, E], pairs [E, E], slots [G], slack) with ties, 3-replica experts (weights
    c / 3, not dyadic), replicas of one expert on one GPU, uneven and empty GPUs, asymmetric pairs."""
    rng = np.random.default_rng(seed)
    experts, gpus = int(rng.integers(4, 40)), int(rng.integers(1, 9))
    slots = rng.integers(0, 7, gpus)
    slots[0] += max(0, experts - int(slots.sum()))
    extra = rng.choice(experts, int(slots.sum()) - experts, replace=True)
    row = rng.permutation(np.r_[np.arange(experts), extra]).astype(np.int64)
    scale = [2, 5, 1000][seed % 3]  # small counts: many equal gains
    loads = rng.integers(1, scale + 1, (int(rng.integers(1, 5)), experts)).astype(np.float64)
    pairs = rng.integers(0, scale + 1, (experts, experts)).astype(np.float64)
    if seed % 2:
        pairs = pairs + pairs.T
    slack = [0.0, 0.01, 0.2, 10.0][seed % 4]
    return row, loads, pairs, slots.astype(np.int64), slack


@pytest.mark.parametrize("seed", range(120))
def test_compiled_swaps_equal_the_numpy_loop(seed: int) -> None:
    _layer = coact._layer
    row, loads, pairs, slots, slack = _random_case(seed)
    max_swaps = [1000, 3, 0][seed % 7 // 3] if seed % 7 < 6 else -1
    fast = _layer(row, loads, pairs, slots, slack, max_swaps)
    ref = _layer(row, loads, pairs, slots, slack, max_swaps, compiled=False)
    assert np.array_equal(fast[0], ref[0])
    assert fast[1:] == ref[1:]  # pair weight before and after (same bits), swaps


@pytest.mark.parametrize("seed", range(60))
def test_compiled_local_search_rounds_equal_the_numpy_loop(seed: int) -> None:
    row, loads, pairs, slots, slack = _random_case(seed)
    rounds, max_swaps = [3, 20, 60][seed % 3], [1000, 1000, 7][seed % 5 // 2]
    fast = coact._layer(row, loads, pairs, slots, slack, max_swaps, rounds=rounds, kick=1 + seed % 5)
    ref = coact._layer(row, loads, pairs, slots, slack, max_swaps, compiled=False, rounds=rounds, kick=1 + seed % 5)
    assert np.array_equal(fast[0], ref[0])
    assert fast[1:] == ref[1:]
    if seed % 2:  # symmetric pairs (as counts give them): the gains are exact, the rounds keep improvements only
        descent = coact._layer(row, loads, pairs, slots, slack, max_swaps)
        assert fast[2] >= descent[2] - 1e-9 * max(1.0, abs(descent[2]))
    assert np.array_equal(np.sort(fast[0]), np.sort(row))  # the same replicas, moved between GPUs


def _real_problem(slots_per_gpu: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    ids, offsets = read_topk(FIXTURE)
    half = (offsets.size - 1) // 2
    pairs = pair_counts(ids[: offsets[half]], 64).astype(np.float64)
    idx = np.arange(64)
    loads = pairs[:, idx, idx]
    bounds = np.linspace(0, half, 5).astype(int)
    scen = np.stack([pair_counts(ids[offsets[a] : offsets[b]], 64)[:, idx, idx] for a, b in itertools.pairwise(bounds)])
    slots = np.full(8, slots_per_gpu, dtype=np.int64)
    return loads, solve_greedy(loads, slots), slots, pairs, scen.astype(np.float64)


@pytest.mark.parametrize("slots_per_gpu", [8, 9])
def test_compiled_refinement_equals_numpy_on_real_routing(slots_per_gpu: int, monkeypatch: pytest.MonkeyPatch) -> None:
    loads, start, slots, pairs, scen = _real_problem(slots_per_gpu)
    fast, fast_info = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen)
    monkeypatch.setattr(coact, "_swaps_compiled", coact._swaps_numpy)
    ref, ref_info = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen)
    assert np.array_equal(fast, ref)
    assert fast_info == ref_info
    assert sum(fast_info["swaps"]) > 100  # the search does run


def assert_refined_within_cap(p2l: np.ndarray, start: np.ndarray, loads: np.ndarray, scen: np.ndarray,
                              slack: float) -> None:
    """On the 8 x 9-slot real problem: replica counts kept, no GPU holds an expert twice, and no GPU above the
    start's busiest x (1 + slack) on the window or any sub-window."""
    gpu = np.repeat(np.arange(8), 9)
    for layer in range(loads.shape[0]):
        assert np.array_equal(np.sort(p2l[layer]), np.sort(start[layer]))  # replica counts kept
        for g in range(8):  # no GPU holds an expert twice
            held = p2l[layer][gpu == g]
            assert np.unique(held).size == held.size
        rep = np.bincount(start[layer], minlength=64)
        for x in np.concatenate([loads[layer][None], scen[:, layer]]):  # the window and every sub-window
            after, before = (float(np.bincount(gpu, weights=x[p] / rep[p]).max()) for p in (p2l[layer], start[layer]))
            assert after <= before * (1 + slack) + 1e-9


def test_local_search_rounds_cut_copies_within_the_caps() -> None:
    loads, start, slots, pairs, scen = _real_problem(9)
    descent, _ = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen, rounds=0)
    searched, info = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen)
    assert_refined_within_cap(searched, start, loads, scen, 0.01)
    ids, offsets = read_topk(FIXTURE)
    half = (offsets.size - 1) // 2
    test = ids[offsets[half] :]
    cut = copies_per_token(test, searched, slots, 64, rule="coact").gpus.mean()
    assert cut < 0.98 * copies_per_token(test, descent, slots, 64, rule="coact").gpus.mean()  # measured 3.28 vs 3.37
    plain = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen, rounds=0)[1]
    assert sum(info["colocated_pairs_after"]) > 1.05 * sum(plain["colocated_pairs_after"])  # measured +7.8%


def test_compiled_swaps_equal_the_numpy_loop_at_deepseek_v3_size() -> None:
    # 288 slots on 32 GPUs, 256 experts, 9 load rows: the reference's matmul runs on several BLAS threads,
    # the compiled path's on one; a capped number of swaps keeps the numpy loop short
    rng = np.random.default_rng(7)
    loads = rng.integers(50, 400, (9, 256)).astype(np.float64)
    pairs = rng.poisson(3.0, (256, 256)).astype(np.float64)
    pairs = pairs + pairs.T
    row = solve_greedy(loads[:1], np.full(32, 9))[0]
    fast = coact._layer(row, loads, pairs, np.full(32, 9), 0.01, 40)
    ref = coact._layer(row, loads, pairs, np.full(32, 9), 0.01, 40, compiled=False)
    assert fast[3] == ref[3] == 40
    assert np.array_equal(fast[0], ref[0]) and fast[1:] == ref[1:]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_non_finite_inputs_take_the_numpy_loop() -> None:
    _layer = coact._layer
    row, loads, pairs, slots, slack = _random_case(5)
    pairs[0, 1] = np.inf
    loads[0, 2] = np.nan
    fast = _layer(row, loads, pairs, slots, slack, 1000)
    ref = _layer(row, loads, pairs, slots, slack, 1000, compiled=False)
    assert np.array_equal(fast[0], ref[0]) and fast[3] == ref[3]


def test_compiled_loop_checks_its_buffers_and_runs_in_threads() -> None:
    _layer = coact._layer
    p, g = 4, 2
    weight, affinity, slot_loads, gpu_loads, cap = (np.zeros((p, p)), np.zeros((p, g)), np.zeros((1, p)),
                                                    np.zeros((1, g)), np.ones(1))
    row, gpu = np.zeros(p, dtype=np.int64), np.zeros(p, dtype=np.int64)
    with pytest.raises(ValueError, match="affinity"):
        _coact.refine(weight, np.zeros((p, g + 1)), slot_loads, gpu_loads, cap, row, gpu, p, g, 1, 1, 10)
    with pytest.raises(ValueError, match="out of range"):
        _coact.refine(weight, affinity, slot_loads, gpu_loads, cap, row, np.full(p, g, dtype=np.int64), p, g, 1, 1, 10)
    cases = [_random_case(seed) for seed in range(16)]

    def refined(case: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float],
                ) -> tuple[np.ndarray, float, float, int]:
        row, loads, pairs, slots, slack = case
        return _layer(row, loads, pairs, slots, slack, 1000)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(refined, cases))
    for case, out in zip(cases, got, strict=True):
        assert np.array_equal(out[0], _layer(*case, 1000, compiled=False)[0])


@pytest.mark.parametrize("seed", range(30))
def test_compiled_chain_equals_the_numpy_loop(seed: int) -> None:
    row, loads, pairs, slots, _ = _random_case(seed)
    slacks, rounds, kicks = (0.0, 0.01, 0.05, 0.2), [5, 3, 0, 8], [2, 6, 4, 1 + seed % 5]
    fast = coact._layer_chain(row, loads, pairs, slots, slacks, 1000, rounds=rounds, kick=kicks)
    ref = coact._layer_chain(row, loads, pairs, slots, slacks, 1000, compiled=False, rounds=rounds, kick=kicks)
    for (f_row, *f_rest), (r_row, *r_rest) in zip(fast, ref, strict=True):
        assert np.array_equal(f_row, r_row)
        assert f_rest == r_rest
    # the first search is `_layer`'s own; with symmetric pairs each later one co-locates at least as much
    assert np.array_equal(fast[0][0], coact._layer(row, loads, pairs, slots, 0.0, 1000, rounds=5, kick=2)[0])
    if seed % 2:
        after = [a for _, _, a, _ in fast]
        assert all(b >= a - 1e-9 * max(1.0, abs(a)) for a, b in itertools.pairwise(after))


def test_chained_caps_keep_replicas_and_every_cap_relative_to_the_start() -> None:
    loads, start, slots, pairs, scen = _real_problem(9)
    slacks = (0.005, 0.01, 0.02, 0.05)
    chain = coact.refine_coactivation_chain(loads, start, slots, pairs, slacks, scenarios=scen)
    assert coact.chain_rounds(72, 3) == [coact.ROUNDS] * 3 and coact.chain_rounds(288, 4) == [25, 12, 12, 12]
    for slack, (p2l, info) in zip(slacks, chain, strict=True):
        assert_refined_within_cap(p2l, start, loads, scen, slack)
        assert info["colocated_pairs_before"] == chain[0][1]["colocated_pairs_before"]
    # one search alone is refine_coactivation's
    single, info = coact.refine_coactivation(loads, start, slots, pairs, scenarios=scen, max_lb_slack=0.005)
    assert np.array_equal(single, chain[0][0]) and info == chain[0][1]
    with pytest.raises(ValueError, match="ascending"):
        coact.refine_coactivation_chain(loads, start, slots, pairs, (0.02, 0.01))


def test_chain_on_threads_equals_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    loads, start, slots, pairs, scen = _real_problem(9)
    monkeypatch.setattr(coact, "_THREADED_SLOTS", 1)
    monkeypatch.setattr(coact, "_workers", lambda: 4)
    threaded = coact.refine_coactivation_chain(loads, start, slots, pairs, (0.01, 0.02), scenarios=scen)
    monkeypatch.setattr(coact, "_workers", lambda: 1)
    serial = coact.refine_coactivation_chain(loads, start, slots, pairs, (0.01, 0.02), scenarios=scen)
    for (a, ia), (b, ib) in zip(threaded, serial, strict=True):
        assert np.array_equal(a, b) and ia == ib


@pytest.mark.parametrize("rule", ["vllm", "sglang", "coact"])
def test_copies_per_token_count_positions_from_each_steps_start(rule: str) -> None:
    """With step_offsets a token's flat position and source GPU count from its own step's start: the count over
    several steps is the token-weighted mean of each step's count alone, however the steps are grouped."""
    ids, offsets = read_topk(FIXTURE)
    ids, offsets = ids[: offsets[6]], offsets[:7]
    slots = np.full(8, 9)
    p2l = np.stack([solve_greedy(np.bincount(ids[:, layer].ravel(), minlength=64)[None].astype(float), slots)[0]
                    for layer in range(ids.shape[1])])  # fmt: skip
    each = [copies_per_token(ids[a:b], p2l, slots, 64, gpus_per_node=4, rule=rule)
            for a, b in itertools.pairwise(offsets)]  # fmt: skip
    sizes = np.diff(offsets)
    whole = copies_per_token(ids, p2l, slots, 64, gpus_per_node=4, rule=rule, step_offsets=offsets)
    for field in ("gpus", "remote_gpus", "nodes", "remote_nodes"):
        expected = sum(getattr(c, field) * n for c, n in zip(each, sizes, strict=True)) / sizes.sum()
        assert np.allclose(getattr(whole, field), expected, rtol=1e-12)
    assert np.array_equal(replica_gpus(ids[offsets[2] :], p2l, slots, 64, rule, step_offsets=offsets[2:] - offsets[2]),
                          replica_gpus(ids, p2l, slots, 64, rule, step_offsets=offsets)[offsets[2] :])  # fmt: skip
    with pytest.raises(EplbError, match="step_offsets must rise from 0 to the"):
        copies_per_token(ids, p2l, slots, 64, step_offsets=[0, 5])


def test_replay_copies_per_token_do_not_depend_on_where_blocks_are_cut() -> None:
    """no EPLB and hindsight hold the same placements whatever the solver and trigger, which only move where the
    replay cuts its blocks (at checks and applies): their copies per token are the same, and exact per step."""
    from eplb.replay import Schedule, replay
    from eplb.solve import Cluster, CostSetup
    from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS

    b200 = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v2-lite"], b200, b200.nvlink_bandwidth)
    cluster = Cluster(np.full(8, 9))
    runs = [replay(FIXTURE, cluster, schedule=Schedule(window=8, interval=8), solver=solver, cost=cost,
                   oracle_every=0) for solver in ("greedy", "incremental")]  # fmt: skip
    assert [r.applies_from for r in runs[0].rebalances] != [r.applies_from for r in runs[1].rebalances]
    rows = [r.summary["results"] for r in runs]
    for name in ("no_eplb", "hindsight"):  # before: hindsight 4.5434 against 4.5436
        assert rows[0][name]["copies_per_token"] == rows[1][name]["copies_per_token"]
    ids, offsets = read_topk(FIXTURE)
    base = np.tile(np.arange(64), (ids.shape[1], 1))  # no EPLB: experts in id order, 8 per GPU
    exact = copies_per_token(ids, base, np.full(8, 8), 64, step_offsets=offsets).gpus.mean()
    assert rows[0]["no_eplb"]["copies_per_token"] == round(float(exact), 4)
