"""How co-activation data gets in: greedy-coact's pair counts from a summary or a token-level log, a token-level
log's own expert count, and summaries whose numbers contradict each other (CLI, library, API, deployments)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from eplb import deployments as dep
from eplb.cli import main
from eplb.coactivation import CoactivationSummary, pair_counts, read_summary, read_topk, summarize
from eplb.errors import EplbError
from eplb.io.windows import read_window
from eplb.solve import Cluster, solve
from eplb.store import Store, open_store
from solvers import registry
from solvers.registry import Problem

LAW = Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"
LAYERS = 3  # of the log's 26: keeps solves and requests small


@pytest.fixture(scope="module")
def law() -> tuple[np.ndarray, np.ndarray]:
    ids, _ = read_topk(LAW)
    return ids[:, :LAYERS], read_window(LAW).loads[:LAYERS]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def summary_file(tmp_path: Path, data: dict[str, Any], name: str = "summary.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# ----- 1. greedy-coact gets its pair counts ------------------------------------------------------------------------
def test_greedy_coact_runs_from_a_token_log_or_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["solve", "--loads", str(LAW), "--gpus", "8", "--json"]
    code, out, err = run([*base, "--coactivation", str(LAW)], capsys)
    assert code == 0, err
    greedy = json.loads(out)["predicted"]["copies_per_token"]["gpus"]
    ids, _ = read_topk(LAW)
    as_json = summary_file(tmp_path, summarize(ids, 64).to_dict())
    for given in (str(LAW), as_json):  # exact pairs from the log, the estimate from the summary
        code, out, err = run([*base, "--coactivation", given, "--solver", "greedy-coact"], capsys)
        assert code == 0, err
        answer = json.loads(out)
        assert answer["solver"]["name"] == "greedy-coact"
        assert np.mean(answer["predicted"]["copies_per_token"]["gpus"]) < 0.9 * np.mean(greedy)
    code, _, err = run([*base, "--solver", "greedy-coact"], capsys)
    assert code == 2 and err.endswith("co-activation data: give --coactivation FILE (a summary or a token-level log)\n")
    assert '"coactivation"' not in err and "Traceback" not in err  # no replay offered: eplb solve replays nothing


def test_max_lb_slack_reaches_greedy_coact_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["solve", "--loads", str(LAW), "--gpus", "8", "--json", "--coactivation", str(LAW)]
    base += ["--solver", "greedy-coact"]
    answers = {}
    for slack in ("0.01", "0.05"):
        code, out, err = run([*base, "--max-lb-slack", slack], capsys)
        assert code == 0, err
        answers[slack] = json.loads(out)["predicted"]
    assert answers["0.05"]["lb_max"] > 1.02 > answers["0.01"]["lb_max"]  # the looser cap was used
    assert np.mean(answers["0.05"]["copies_per_token"]["gpus"]) < np.mean(answers["0.01"]["copies_per_token"]["gpus"])
    code, _, err = run(["solve", "--max-lb-slack", "0.05"], capsys)  # greedy has no cap to loosen
    assert code == 2 and "does not take --max-lb-slack (it takes: none)" in err  # the flag typed, not max_lb_slack


def test_solve_takes_exact_pairs_from_tokens_and_the_estimate_from_a_sent_summary(
    law: tuple[np.ndarray, np.ndarray],
) -> None:
    ids, loads = law
    summary = summarize(ids, 64)
    exact = pair_counts(ids, 64).astype(np.float64)
    idx = np.arange(64)
    exact[:, idx, idx] = 0.0
    assert np.array_equal(summary.pairs(), exact)
    assert np.array_equal(summary.layers(2).pairs(), exact[:2])
    sent = CoactivationSummary.from_dict(summary.to_dict())  # what a cluster sends carries no exact pairs
    assert sent.exact is None and np.array_equal(sent.pairs(), summary.pair_estimate())
    cluster = Cluster(np.full(8, 9, dtype=np.int64))
    for given, pairs in ((summary, exact), (sent, summary.pair_estimate())):
        outcome = solve(loads, cluster, solver="greedy-coact", coactivation=given)
        direct = registry.solve("greedy-coact", Problem(loads, cluster.slots_per_gpu, coactivation=pairs))
        assert np.array_equal(outcome.placement.phy2log, direct.phy2log)
    with pytest.raises(EplbError, match="co-activation data: pass coactivation=, the window's CoactivationSummary"):
        solve(loads, cluster, solver="greedy-coact")


# ----- 2. a token-level log's own expert count ---------------------------------------------------------------------
def test_a_token_log_is_summarized_with_its_own_expert_count(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    loads = read_window(LAW).loads
    cases = {"narrow": loads[:, :32], "wide": np.concatenate([loads, loads], axis=1)}
    for name, window in cases.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, window)
        code, _, err = run(["solve", "--loads", str(path), "--coactivation", str(LAW), "--gpus", "8",
                            "--slots-per-gpu", "20"], capsys)  # fmt: skip
        assert code == 2 and "Traceback" not in err, err
        assert f"26 layers x 64 experts, the loads are 26 x {window.shape[1]}" in err
    code, _, err = run(["solve", "--coactivation", str(LAW), "--gpus", "8"], capsys)  # the 58 x 256 default window
    assert code == 2 and "26 layers x 64 experts" in err and "256" in err
    assert read_summary(LAW).num_experts == 64
    with pytest.raises(EplbError, match="is for 26 layers x 64 experts, the loads are 2 x 64"):
        read_summary(LAW, 64, num_layers=2)


# ----- 3. summaries whose numbers contradict each other --------------------------------------------------------------
def small() -> dict[str, Any]:
    """100 tokens chose {0, 1}, 100 chose {2, 3}: top-2 of 4 experts."""
    return {"tokens": [200], "top_k": 2, "loads": [[100, 100, 100, 100]],
            "partners": [[[1, -1], [0, -1], [3, -1], [2, -1]]],
            "counts": [[[100, 0], [100, 0], [100, 0], [100, 0]]]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": [10**15]}, "loads sum to 400 picks, but 1000000000000000 tokens choose between 1 and top_k 2"),
        ({"top_k": 1}, "loads sum to 400 picks, but 200 tokens choose between 1 and top_k 1"),
        ({"loads": [[300, 50, 25, 25]]}, "load 300 exceeds the layer's 200 tokens"),
        ({"loads": [[150, 50, 100, 100]]}, "100 tokens chose experts 0 and 1, more than the load"),
        ({"partners": [[[0, -1], [0, -1], [3, -1], [2, -1]]]}, "expert 0 lists itself"),
        ({"partners": [[[1, 1], [0, -1], [3, -1], [2, -1]]], "counts": [[[100, 100], [100, 0], [100, 0], [100, 0]]]},
         "lists partner 1 twice"),
        ({"counts": [[[100, 5], [100, 0], [100, 0], [100, 0]]]}, "counts must be 0 where partners is -1"),
        ({"partners": [[[1, 2], [0, -1], [3, -1], [2, -1]]], "counts": [[[100, 50], [100, 0], [100, 0], [100, 0]]]},
         "partners' counts sum to 150, more than its load 100 x (top_k - 1) = 100"),
    ],
)
def test_inconsistent_summaries_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    assert CoactivationSummary.from_dict(small()).num_experts == 4  # the consistent one is taken
    with pytest.raises(EplbError, match="co-activation summary: ") as info:
        CoactivationSummary.from_dict({**small(), **change})
    assert message in str(info.value)
    d = {k: np.asarray(v, dtype=np.int64) for k, v in {**small(), **change}.items()}
    binary = CoactivationSummary(d["tokens"], int(d["top_k"]), d["loads"], d["partners"], d["counts"])
    with pytest.raises(EplbError, match="co-activation summary: "):  # the binary form, checked in the same place
        CoactivationSummary.from_bytes(binary.to_bytes())


@pytest.mark.parametrize(
    "change",
    [
        {"tokens": [0], "loads": [[0, 0, 0, 0]], "counts": [[[0, 0]] * 4]},  # an empty window, as summarize gives
        {"top_k": 4},  # 200 tokens kept 400 of their 800 picks: capacity drops, or top_k the most a token takes
        {"tokens": [300]},  # 100 tokens with a single pick each (variable top-k)
        {"counts": [[[100, 0], [90, 0], [100, 0], [100, 0]]]},  # merged per-rank lists: lower bounds, unequal
    ],
)
def test_summaries_of_real_routing_quirks_are_taken(change: dict[str, Any]) -> None:
    summary = CoactivationSummary.from_dict({**small(), **change})
    assert CoactivationSummary.from_bytes(summary.to_bytes()).to_dict() == summary.to_dict()


def test_every_shipped_log_summarizes_consistently() -> None:
    for path in sorted(LAW.parent.glob("esft-dsv2lite-*-topk.npz")):
        ids, _ = read_topk(path)
        for partners in (1, 8, 63):
            summary = summarize(ids, 64, partners)
            assert CoactivationSummary.from_bytes(summary.to_bytes()).to_dict() == summary.to_dict()


def test_cli_refuses_a_summary_of_impossible_tokens(law: tuple[np.ndarray, np.ndarray], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ids, loads = law
    window = tmp_path / "window.npy"
    np.save(window, loads)
    data = summarize(ids, 64).to_dict()
    base = ["solve", "--loads", str(window), "--gpus", "8", "--model", "deepseek-v2-lite", "--coactivation"]
    code, out, err = run([*base, summary_file(tmp_path, data), "--json"], capsys)
    assert code == 0, err
    assert min(json.loads(out)["predicted"]["copies_per_token"]["gpus"]) >= 1.0
    huge = summary_file(tmp_path, {**data, "tokens": [10**15] * LAYERS}, "huge.json")
    code, _, err = run([*base, huge], capsys)
    assert code == 2 and "huge.json: co-activation summary: layer 0: loads sum to" in err and "Traceback" not in err


# ----- the service: POST /placement and deployments ----------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'eplb.db'}")
    yield s
    s.close()


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(solver_workers=1, api_key="k"))
    app.state.db = store
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c


def test_service_runs_greedy_coact_from_a_summary(
    client: TestClient, law: tuple[np.ndarray, np.ndarray]
) -> None:
    ids, loads = law
    summary = summarize(ids, 64).to_dict()
    body = {"model": "deepseek-v2-lite", "hardware": "h800", "tokens_per_gpu": 256, "loads": loads.tolist(),
            "cluster": {"num_gpus": 8, "slots_per_gpu": 9}, "solver": "greedy-coact"}  # fmt: skip
    placed = client.post("/placement", json={**body, "coactivation": summary})
    assert placed.status_code == 200, placed.text
    assert placed.json()["solver"]["name"] == "greedy-coact"
    missing = client.post("/placement", json=body)
    assert missing.status_code == 422 and missing.json()["errors"][0]["field"] == "coactivation", missing.text
    assert "--coactivation" not in missing.text  # the JSON field, not the CLI's flag
    config = {"model": "deepseek-v2-lite", "hardware": "h800", "tokens_per_gpu": 256.0, "solver": "greedy-coact",
              "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}  # fmt: skip
    assert client.put("/deployments/coact", json=config).status_code == 201
    sent = client.post("/deployments/coact/windows", json={"loads": loads.tolist(), "coactivation": summary})
    assert sent.status_code == 200, sent.text
    assert sent.json()["action"] == "placed" and sent.json()["entry"]["solver"] == "greedy-coact"
    bare = client.post("/deployments/coact/windows", json={"loads": loads.tolist(), "force": True})
    assert bare.status_code == 422 and bare.json()["errors"][0]["field"] == "coactivation", bare.text
    assert "--coactivation" not in bare.text


def test_service_refuses_a_summary_of_impossible_tokens(client: TestClient, law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    huge = {**summarize(ids, 64).to_dict(), "tokens": [10**15] * LAYERS}
    setup = {"model": "deepseek-v2-lite", "hardware": "h800", "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}
    solved = client.post("/placement", json={**setup, "loads": loads.tolist(), "coactivation": huge})
    assert client.put("/deployments/x", json=setup).status_code == 201
    window = client.post("/deployments/x/windows", json={"loads": loads.tolist(), "coactivation": huge})
    for refused in (solved, window):
        assert refused.status_code == 422 and "loads sum to" in refused.text, refused.text
        assert "Traceback" not in refused.text
    assert solved.json()["errors"][0]["field"] == "coactivation"


def test_deployment_windows_feed_greedy_coact(store: Store, law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    config = dep.DeploymentConfig.model_validate({"model": "deepseek-v2-lite", "hardware": "h800",
                                                  "solver": "greedy-coact", "cluster": {"num_gpus": 8,
                                                                                        "slots_per_gpu": 9}})
    dep.register(store, "coact", config)
    placed = dep.process_window(store, "coact", loads.tolist(), coactivation=summarize(ids, 64).to_dict())
    assert placed.action == "placed" and placed.entry.solver == "greedy-coact"
    again = dep.process_window(store, "coact", loads[:, ::-1].tolist(), force=True,
                               coactivation=summarize(63 - ids, 64).to_dict())  # fmt: skip
    assert again.action == "rebalanced" and again.entry.solver == "greedy-coact"
    with pytest.raises(EplbError, match="needs the window's co-activation data"):
        dep.process_window(store, "coact", loads.tolist(), force=True)


def test_replay_runs_greedy_coact_on_a_token_level_log_and_refuses_a_counts_log(tmp_path: Path) -> None:
    from eplb.replay import Schedule, replay

    sched = Schedule(window=16, interval=16, trigger="periodic")
    copies = {}
    for name in ("greedy", "greedy-coact"):
        res = replay(str(LAW), Cluster(np.full(8, 9)), schedule=sched, solver=name, oracle_every=0)
        copies[name] = res.summary["results"]["replay"]["copies_per_token"]
    assert copies["greedy-coact"] < 0.95 * copies["greedy"]  # the window's pairs reached the solver
    counts = tmp_path / "counts.npy"
    np.save(counts, np.ones((20, 2, 16), dtype=np.int64))
    with pytest.raises(EplbError, match="greedy-coact needs the log's tokens"):
        replay(str(counts), Cluster(np.full(4, 4)), schedule=sched, solver="greedy-coact", oracle_every=0)


def test_merged_pair_counts_estimate_the_larger_listing_on_both_sides() -> None:
    s = CoactivationSummary.from_dict({**small(), "counts": [[[100, 0], [90, 0], [100, 0], [100, 0]]]})
    est = s.pair_estimate()[0]
    assert est[0, 1] == est[1, 0] == 100  # lower bounds: the larger one, and the estimate stays symmetric


def test_dropped_picks_do_not_inflate_the_unlisted_pair_mass() -> None:
    # 300 tokens with 400 picks: 100 kept two experts, 200 kept one; no partners listed at all
    d = {"tokens": [300], "top_k": 2, "loads": [[100, 100, 100, 100]], "partners": [[[-1]] * 4],
         "counts": [[[0]] * 4]}  # fmt: skip
    est = CoactivationSummary.from_dict(d).pair_estimate()[0]
    # each pick shares a token with (400 / 300 - 1) others on average, not top_k - 1 = 1
    assert est.sum() == pytest.approx(400 * (400 / 300 - 1))


def test_a_summary_layer_without_tokens_is_refused_where_the_loads_route() -> None:
    from eplb.placement import Placement
    from eplb.solve import evaluate

    s = CoactivationSummary.from_dict({
        "tokens": [0, 10], "top_k": 2, "loads": [[0, 0, 0, 0], [5, 5, 5, 5]],
        "partners": [[[-1]] * 4, [[1], [0], [3], [2]]], "counts": [[[0]] * 4, [[5], [5], [5], [5]]]})
    placement = Placement(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), np.array([2, 2]), 4)
    with pytest.raises(EplbError, match="no tokens in layer 0, which the loads route"):
        evaluate(np.array([[1.0, 1, 1, 1], [5, 5, 5, 5]]), placement, coactivation=s)
    assert evaluate(np.array([[0.0, 0, 0, 0], [5, 5, 5, 5]]), placement, coactivation=s).copies is not None


# ----- a summary checked against its window ----------------------------------------------------------------------
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def summary_of(loads: np.ndarray, top_k: int = 8) -> CoactivationSummary:
    """A consistent summary with these picks per expert (rounded) and no partners listed: enough tokens for every
    pick, none picking an expert twice."""
    picks = np.rint(loads).astype(np.int64)
    tokens = np.maximum(picks.max(axis=1), -(-picks.sum(axis=1) // top_k))
    none = np.zeros((*picks.shape, 1), dtype=np.int64)
    return CoactivationSummary.from_dict({"tokens": tokens, "top_k": top_k, "loads": picks, "partners": none - 1,
                                          "counts": none})


def apart(summary: CoactivationSummary, loads: np.ndarray) -> np.ndarray:
    """[L] the total variation distance of the summary's and the window's split of each layer's picks."""
    s, w = summary.loads / summary.loads.sum(axis=1, keepdims=True), loads / loads.sum(axis=1, keepdims=True)
    distance: np.ndarray = 0.5 * np.abs(s - w).sum(axis=1)
    return distance


def noise_term(summary: CoactivationSummary, loads: np.ndarray) -> np.ndarray:
    """[L] 1/2 sum_e sqrt(w_e (1 - w_e) / n): what n picks drawn from the window's shares w are apart at most on
    average, counted apart from `window_contradiction`."""
    w = loads / loads.sum(axis=1, keepdims=True)
    noise: np.ndarray = 0.5 * np.sqrt(w * (1 - w)).sum(axis=1) / np.sqrt(summary.loads.sum(axis=1))
    return noise


def test_a_summary_that_contradicts_its_window_is_refused_by_one_check() -> None:
    """The trial sent a window's experts reversed with the window's own summary: 200, copies per token from data
    that disagree. The shares of each layer's picks are compared (`CoactivationSummary.window_contradiction`, at
    most WINDOW_TOLERANCE = 0.2 apart plus the sampling noise of the summary's picks): the figures its docstring
    gives, measured here."""
    from eplb.coactivation import WINDOW_TOLERANCE

    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads  # 26 x 64, the summary's own picks
    whole, tenth = summarize(ids, 64), summarize(ids[: len(ids) // 10], 64)
    assert whole.window_contradiction(loads) is None and whole.window_contradiction(loads * 1e-3) is None  # scaled
    assert whole.loads.sum(axis=1).min() == 49_962 and noise_term(whole, loads).max() < 0.018  # 50,000 picks
    assert apart(tenth, loads).max() < 0.09 < WINDOW_TOLERANCE and tenth.window_contradiction(loads) is None
    assert noise_term(tenth, loads).min() > 0.02 and noise_term(tenth, loads).max() < 0.06  # 4,992 picks
    assert apart(whole, loads[:, ::-1]).min() > 0.17 and apart(whole, loads[:, ::-1]).max() < 0.41
    assert str(whole.window_contradiction(loads[:, ::-1])).startswith(
        "23 of the 26 layers: the summary puts more than 20% of a layer's picks, beyond what drawing them at random "
        "may, on other experts than the window's loads do (layer 18: 40% of 49,962 picks, at most 22%)")
    for name in ("sglang6017-dsv3-prefill-in4096.json", "sglang6017-dsv3-decode-in1000out1000.json"):
        window = read_window(FIXTURES / name).loads
        own = summary_of(window)
        assert own.window_contradiction(window) is None
        reversed_apart = apart(own, window[:, ::-1])
        assert reversed_apart.min() > 0.24 and reversed_apart.max() < 0.72, name
        assert noise_term(own, window[:, ::-1]).max() < 0.002, name  # millions of picks: no noise to speak of
        assert str(own.window_contradiction(window[:, ::-1])).startswith("58 of the 58 layers:")
    one = loads.copy()
    one[5] = one[5, ::-1]
    assert whole.window_contradiction(one) == (
        f"layer 5: the summary puts {apart(whole, one)[5]:.0%} of the layer's 49,962 picks on other experts than the "
        "window's loads do (at most 22% may differ: 20% plus 2% that drawing them at random may): send the summary "
        "of the same window, its experts numbered as the window's")
    empty = loads.copy()
    empty[2] = 0.0
    assert whole.window_contradiction(empty) == (f"layer 2: the window routes no token, the summary counts "
                                                 f"{int(whole.loads[2].sum()):,} picks there: send the summary of "
                                                 "the same window")
    both = summary_of(empty[:3], top_k=6)  # a layer without tokens in both: taken
    assert both.tokens[2] == 0 and both.window_contradiction(empty[:3]) is None
    assert str(both.window_contradiction(loads[:3])).startswith("layer 2: the summary has no tokens, the window routes")


def test_a_summary_of_a_small_sample_of_its_window_is_taken() -> None:
    """A summary of a few of the window's picks differs from it by sampling alone: 800 picks over DeepSeek-V3's 256
    experts were ~0.2 apart and refused (422) with the tolerance 0.2; 40 tokens of the law log (240 picks over 64
    experts) likewise. Now the tolerance adds the summary's sampling noise: both are taken, and the 800 picks are
    still refused against the window reversed where the layer is skewed enough to tell (3 of its 4 layers)."""
    rng = np.random.default_rng(15)
    decode = read_window(FIXTURES / "sglang6017-dsv3-decode-in1000out1000.json").loads[:4]
    shares = decode / decode.sum(axis=1, keepdims=True)
    small = summary_of(np.stack([rng.multinomial(800, p) for p in shares]).astype(np.float64))
    assert apart(small, decode).max() > 0.2 and small.window_contradiction(decode) is None
    assert small.window_contradiction(decode[:, ::-1]) == (
        "3 of the 4 layers: the summary puts more than 20% of a layer's picks, beyond what drawing them at random may, "
        "on other experts than the window's loads do (layer 0: 53% of 800 picks, at most 46%): send the summary of "
        "the same window, its experts numbered as the window's")
    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads
    few = summarize(ids[np.sort(rng.choice(len(ids), 40, replace=False))], 64)
    assert few.loads.sum(axis=1).max() == 240 and (apart(few, loads) > 0.2).sum() > 10
    assert few.window_contradiction(loads) is None


def test_sampling_noise_stays_within_the_tolerance() -> None:
    """The simulation `window_contradiction`'s docstring cites: 1,000 summaries of n picks drawn (multinomial) from
    a layer's shares, for even splits of 256 and 64 experts and the most even and most skewed layers of the shipped
    DeepSeek-V3 windows and the law log, 100 to 50,000 picks: their distance to the window is on average within the
    noise term (the bound holds) and none is refused."""
    from eplb.coactivation import WINDOW_TOLERANCE

    rng = np.random.default_rng(0)
    splits = {"even-256": np.full(256, 1 / 256), "even-64": np.full(64, 1 / 64)}
    for name in ("sglang6017-dsv3-prefill-in4096.json", "sglang6017-dsv3-decode-in1000out1000.json", LAW.name):
        w = read_window(FIXTURES / name).loads
        w = w / w.sum(axis=1, keepdims=True)
        spread = np.sqrt(w * (1 - w)).sum(axis=1)
        splits[f"{name}-even"], splits[f"{name}-skewed"] = w[np.argmax(spread)], w[np.argmin(spread)]
    figures = {}
    for name, p in splits.items():
        window = np.tile(p, (1000, 1))
        for n in (100, 800, 5_000, 50_000):
            drawn = summary_of(rng.multinomial(n, p, size=1000).astype(np.float64))
            distance, noise = apart(drawn, window), noise_term(drawn, window)
            assert distance.mean() <= noise.max() and distance.max() < WINDOW_TOLERANCE + noise.min(), (name, n)
            assert drawn.window_contradiction(window) is None, (name, n)
            figures[name, n] = (round(float(distance.mean()), 2), round(float(distance.max()), 2),
                                round(WINDOW_TOLERANCE + float(noise.max()), 2))
    assert figures["even-256", 800] == (0.22, 0.26, 0.48)  # the docstring's figures
    assert figures["even-64", 800] == (0.11, 0.15, 0.34)


def test_post_placement_a_window_and_the_cli_refuse_a_contradicting_summary_alike(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One check for the three ways a summary comes with a window: a 422 naming coactivation and loads from POST
    /placement and a deployment's window (nothing stored), and the CLI's --coactivation refused with its text. The
    trial's case: the window's experts reversed, sent with the window's own summary (layers 3-5 of the law log; its
    first three layers are nearly even, reversed 0.17-0.18 apart, within the tolerance)."""
    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads[3:6]
    summary = summarize(ids[:, 3:6], 64).to_dict()
    flipped = loads[:, ::-1].tolist()
    setup = {"model": "deepseek-v2-lite", "hardware": "h800", "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}
    assert client.put("/deployments/flip", json=setup).status_code == 201
    placed = client.post("/placement", json={**setup, "loads": flipped, "coactivation": summary})
    window = client.post("/deployments/flip/windows", json={"loads": flipped, "coactivation": summary})
    why = CoactivationSummary.from_dict(summary).window_contradiction(loads[:, ::-1])
    assert why is not None and why.startswith("3 of the 3 layers:")
    for refused in (placed, window):
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"] == [{"field": "coactivation", "message": why}, {"field": "loads",
                                                                                         "message": why}]
        assert refused.json()["detail"] == f"coactivation, loads: {why}"
    assert client.get("/deployments/flip").json()["windows"] == 0
    assert client.post("/deployments/flip/windows", json={"loads": loads.tolist(), "coactivation": summary}).json()[
        "action"] == "placed"
    np.save(tmp_path / "flipped.npy", loads[:, ::-1])
    code, _, err = run(["solve", "--loads", str(tmp_path / "flipped.npy"), "--gpus", "8", "--coactivation",
                        summary_file(tmp_path, summary)], capsys)
    assert code == 2 and f"contradicts the load window {tmp_path / 'flipped.npy'}: {why}" in err, err
