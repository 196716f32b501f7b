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
    assert code == 2 and "--coactivation FILE" in err and '"coactivation"' not in err and "Traceback" not in err


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
    with pytest.raises(EplbError, match="needs the window's co-activation data"):
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
