"""The time objective and the co-activation comm term of the cost model (eplb/objective.py, eplb.cost.predict)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from eplb.coactivation import copies_per_token, reach, read_summary, read_topk, summarize
from eplb.cost import predict
from eplb.errors import EplbError
from eplb.io.windows import read_window
from eplb.solve import Cluster, CostSetup, evaluate, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, link_bandwidth

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LAW = FIXTURES / "esft-dsv2lite-law-topk.npz"
V2 = MODEL_PRESETS["deepseek-v2-lite"]
H800 = HARDWARE_PRESETS["h800"]


def cost(tokens: float, link: str = "nic", node_limit: int | None = None) -> CostSetup:
    return CostSetup(V2, H800, link_bandwidth(H800, link), tokens, True, node_limit)


@pytest.fixture(scope="module")
def law() -> tuple[np.ndarray, np.ndarray]:
    ids, _ = read_topk(LAW)
    return ids, read_window(LAW).loads


def test_topk_log_reads_as_its_window(law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    counts = np.stack([np.bincount(ids[:, layer].ravel(), minlength=64) for layer in range(ids.shape[1])])
    assert np.array_equal(loads, counts)


def test_time_objective_is_never_slower_and_cuts_comm_bound_layers(law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    summary = summarize(ids, 64)
    cluster = Cluster(np.full(8, 9, dtype=np.int64))
    setup = cost(4096)  # over the NIC: comm bounds every layer
    by_lb = solve(loads, cluster, cost=setup, coactivation=summary)
    by_time = solve(loads, cluster, cost=setup, coactivation=summary, objective="time")
    assert by_lb.prediction is not None and by_time.prediction is not None
    assert set(by_lb.prediction.bottleneck) == {"comm"}
    assert (by_time.prediction.time_us <= by_lb.prediction.time_us * (1 + 1e-9)).all()
    assert by_time.prediction.total_time_us < 0.95 * by_lb.prediction.total_time_us
    assert by_time.copies is not None and by_lb.copies is not None
    assert by_time.copies["gpus"].mean() < 0.9 * by_lb.copies["gpus"].mean()
    # the chosen candidate per layer is reported, and the exact count on the tokens agrees in direction
    assert len(by_time.solver["layer_choice"]) == loads.shape[0]
    slots = cluster.slots_per_gpu
    exact_lb = copies_per_token(ids, by_lb.placement.phy2log, slots, 64).gpus.mean()
    exact_time = copies_per_token(ids, by_time.placement.phy2log, slots, 64).gpus.mean()
    assert exact_time < 0.9 * exact_lb


def test_without_coactivation_data_prefill_time_objective_is_todays_placement() -> None:
    window = read_window(None)  # DeepSeek-V3 prefill window, compute-bound at 4,096 tokens per GPU
    v3, b200 = MODEL_PRESETS["deepseek-v3"], HARDWARE_PRESETS["b200"]
    setup = CostSetup(v3, b200, link_bandwidth(b200, "nvlink"), 4096.0)
    cluster = Cluster(np.full(32, 9, dtype=np.int64))
    by_lb = solve(window.loads, cluster, cost=setup)
    by_time = solve(window.loads, cluster, cost=setup, objective="time")
    assert np.array_equal(by_lb.placement.phy2log, by_time.placement.phy2log)
    assert set(by_time.solver["layer_choice"]) == {"solver"}


def test_weight_read_bound_layers_take_fewer_replicas(law: tuple[np.ndarray, np.ndarray]) -> None:
    _, loads = law
    cluster = Cluster(np.full(8, 9, dtype=np.int64))
    setup = cost(256, link="nvlink")  # decode on NVLink: reading the experts' weights bounds the layer
    by_lb = solve(loads, cluster, cost=setup)
    by_time = solve(loads, cluster, cost=setup, objective="time")
    assert by_lb.prediction is not None and by_time.prediction is not None
    weight_bound = np.array([b == "weight_read" for b in by_lb.prediction.bottleneck])
    assert weight_bound.any()
    assert (by_time.prediction.time_us[weight_bound] < by_lb.prediction.time_us[weight_bound]).all()
    assert (by_time.prediction.time_us <= by_lb.prediction.time_us * (1 + 1e-9)).all()
    empty = by_time.placement.empty_slots
    assert empty[weight_bound].sum(axis=1).min() == 8  # one slot per expert: 64 of the 72 slots used
    assert (by_time.placement.replicas[weight_bound] == 1).all()


def test_reach_comm_counts_one_copy_per_reached_gpu() -> None:
    # 4 GPUs x 2 slots, 8 experts, k = 2; every token picks a pair (2i, 2i+1) that sits on GPU i
    tokens = 400
    pair = np.arange(tokens) % 4
    ids = np.stack([2 * pair, 2 * pair + 1], axis=1)[:, None, :]  # [tokens, 1 layer, 2]
    together = np.arange(8, dtype=np.int64)[None, :]
    apart = np.array([[0, 2, 4, 6, 1, 3, 5, 7]], dtype=np.int64)
    slots = np.full(4, 2, dtype=np.int64)
    assert copies_per_token(ids, together, slots, 8).gpus[0] == 1.0
    assert copies_per_token(ids, apart, slots, 8).gpus[0] == 2.0
    summary = summarize(ids, 8)
    r_together, r_apart = reach(summary, together, slots), reach(summary, apart, slots)
    # the summary's estimate (second order in the pairs) overestimates perfectly paired picks, but orders them
    assert 1.0 <= r_together.gpu.sum() < r_apart.gpu.sum() == pytest.approx(2.0, rel=0.05)
    loads = np.full((1, 8), tokens / 4.0)
    model = MODEL_PRESETS["deepseek-v2-lite"].model_copy(update={"num_experts": 8, "top_k": 2})
    args = {"model": model, "hw": H800, "link_bw": 50e9, "tokens_per_gpu": 100.0}
    exact_together = np.full((1, 4), 0.25)  # each GPU is reached by the quarter of tokens whose pair it holds
    comm_together = predict(loads, together, slots, reach=exact_together, **args).gpu_comm_us  # type: ignore[arg-type]
    comm_apart = predict(loads, apart, slots, reach=2 * exact_together, **args).gpu_comm_us  # type: ignore[arg-type]
    per_copy = (model.dispatch_bytes_per_copy + model.combine_bytes_per_copy) / 50e9 * 1e6
    # a GPU receives the reached share of the 3 other GPUs' 100 tokens, and sends to the reached others
    assert comm_together == pytest.approx(np.full((1, 4), 3 * 100 * 0.25 * per_copy))
    assert comm_apart == pytest.approx(2 * comm_together)
    plain = predict(loads, together, slots, **args).gpu_comm_us  # type: ignore[arg-type]
    assert plain == pytest.approx(np.full((1, 4), 100 * 2 * 0.75 * per_copy))  # k copies, 1/G of them local


def test_node_limit_caps_nodes_per_token(law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    summary = summarize(ids, 64)
    p2l = np.tile(np.arange(64, dtype=np.int64), (loads.shape[0], 1))
    free = reach(summary, p2l, np.full(8, 8), gpus_per_node=2)
    assert free.node.sum(axis=1).max() > 2
    limited = reach(summary, p2l, np.full(8, 8), gpus_per_node=2, node_limit=2)
    assert limited.node.sum(axis=1).max() <= 2 + 1e-9
    outcome = evaluate(loads, solve(loads, Cluster(np.full(8, 8, dtype=np.int64))).placement, cost(256, node_limit=2),
                       coactivation=summary, gpus_per_node=2)
    assert outcome.copies is not None and outcome.copies["nodes"].max() <= 2 + 1e-9


def test_bad_objective_inputs_are_one_clear_error(law: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    ids, loads = law
    cluster = Cluster(np.full(8, 9, dtype=np.int64))
    with pytest.raises(EplbError, match="needs the model"):
        solve(loads, cluster, objective="time")
    with pytest.raises(EplbError, match="uniform shares"):  # refused before the MILP runs
        solve(loads, cluster, cost=cost(256), objective="time", solver="milp", split="weighted")
    with pytest.raises(EplbError, match="unknown objective"):
        solve(loads, cluster, cost=cost(256), objective="speed")
    with pytest.raises(EplbError, match="co-activation summary is for 2 layers"):
        solve(loads, cluster, cost=cost(256), coactivation=summarize(ids[:, :2], 64))
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"format": "eplb.coactivation-summary/v1", "tokens": [1], "top_k": 2, "loads": [[-1]],
                               "partners": [[[0]]], "counts": [[[1]]]}))
    with pytest.raises(EplbError, match=">= 0"):
        read_summary(bad, 1)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(EplbError, match="format"):
        read_summary(tmp_path / "other.json", 64)


def test_weighted_shares_refused_by_the_time_objective_name_the_flags_or_the_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`eplb solve` keeps its flags in the refusal; given names (the API's, a deployment's), the same check names
    the JSON fields, a FieldError of them. --solver milp-weighted was told to 'drop --split weighted', a flag it
    was not given."""
    from eplb.cli import main
    from eplb.deployments import FIELD_NAMES
    from eplb.errors import FieldError
    from eplb.solve import check_uniform_shares, solver_name

    common = ["solve", "--gpus", "32", "--slots-per-gpu", "9", "--model", "deepseek-v3", "--objective", "time"]
    for args, message in (
        ([*common, "--solver", "milp", "--split", "weighted"],
         "the time objective places uniform shares: drop --split weighted (solver 'milp-weighted')"),
        ([*common, "--solver", "milp-weighted"], "the time objective places uniform shares, and solver 'milp-weighted' "
         "weights them: choose another --solver ('milp' places uniform ones)"),
        (["solve", "--solver", "greedy", "--split", "weighted"],
         "the greedy solver gives uniform shares only; use --solver milp for --split weighted"),
    ):
        assert main(args) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"eplb solve: error: {message}"  # after 'solving ...'

    api = {"solver": "solver", "split": "split", "objective": "objective"}
    with pytest.raises(FieldError) as split:
        check_uniform_shares("milp-weighted", "time", "weighted", names=api)
    assert split.value.fields == ("split", "objective") and str(split.value) == split.value.message == (
        "the time objective places uniform shares: drop split weighted (solver 'milp-weighted')")
    with pytest.raises(FieldError) as named:
        check_uniform_shares("milp-weighted", "time", names=FIELD_NAMES)
    assert named.value.fields == ("solver", "objective") and "choose another solver (" in str(named.value)
    with pytest.raises(FieldError) as greedy:
        solver_name("greedy", "weighted", names=api)
    assert greedy.value.fields == ("solver", "split") and "--" not in str(greedy.value)
    check_uniform_shares("milp-weighted", "lb", "weighted", names=api)  # the lb objective takes weighted shares
    check_uniform_shares("milp", "time", names=api)


def test_cli_reports_copies_and_the_time_objective(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    ids, _ = read_topk(LAW)
    summary_file.write_text(json.dumps(summarize(ids, 64).to_dict()))
    base = [sys.executable, "-m", "eplb.cli", "solve", "--loads", str(LAW), "--gpus", "8", "--slots-per-gpu", "9",
            "--model", "deepseek-v2-lite", "--hardware", "h800", "--link", "nic", "--coactivation", str(summary_file)]
    out = subprocess.run([*base, "--objective", "time", "--json"], capture_output=True, text=True, check=True)
    answer = json.loads(out.stdout)
    copies = answer["predicted"]["copies_per_token"]
    assert len(copies["gpus"]) == 26 and len(answer["predicted"]["baseline"]["copies_per_token"]["nodes"]) == 26
    assert answer["solver"]["objective"] == "time"
    text = subprocess.run([*base, "--objective", "time"], capture_output=True, text=True, check=True).stdout
    assert "copies per token (co-activation" in text and "time objective, layers taken from" in text
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"loads": [[5, 1, 3]]}))  # 3 experts: no preset, so no cost model
    err = subprocess.run([*base[:4], "--objective", "time", "--loads", str(odd), "--gpus", "2", "--slots-per-gpu", "2"],
                         capture_output=True, text=True)
    assert err.returncode == 2 and "needs the model" in err.stderr and "Traceback" not in err.stderr
    missing = subprocess.run([*base[:-1], str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.json" in missing.stderr and "Traceback" not in missing.stderr


def test_compare_runs_lb_and_time_side_by_side(law: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "eplb.cli", "compare", "--loads", str(LAW), "--coactivation", str(LAW),
                          "--solvers", "greedy", "--objectives", "lb,time", "--ep", "8", "--hardware", "h800",
                          "--link", "nic", "--tokens-per-gpu", "256", "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "greedy+time predicted faster than greedy on" in run.stdout and "(slower on 0)" in run.stdout
    runs = {r["solver"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"greedy", "greedy+time"}
    assert sum(runs["greedy+time"]["time_us"]) < sum(runs["greedy"]["time_us"])
    assert np.mean(runs["greedy+time"]["copies_per_token"]) < np.mean(runs["greedy"]["copies_per_token"])
    bad = subprocess.run([sys.executable, "-m", "eplb.cli", "compare", "--objectives", "fast", "--out", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--objectives takes lb, time" in bad.stderr


def test_service_takes_the_summary_and_the_time_objective(server_factory: Callable[..., str]) -> None:
    base = server_factory()
    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads
    summary = summarize(ids, 64).to_dict()
    body = {"model": "deepseek-v2-lite", "hardware": "h800", "link": "nic", "tokens_per_gpu": 256,
            "cluster": {"num_gpus": 8, "slots_per_gpu": 9}, "loads": loads.tolist(), "coactivation": summary}
    lb = httpx.post(f"{base}/placement", json=body, timeout=120)
    fast = httpx.post(f"{base}/placement", json={**body, "objective": "time"}, timeout=120)
    assert lb.status_code == 200 and fast.status_code == 200, (lb.text, fast.text)
    a, b = lb.json(), fast.json()
    assert b["solver"]["objective"] == "time"
    assert sum(b["predicted"]["time_us"]) < sum(a["predicted"]["time_us"])
    assert np.mean(b["predicted"]["copies_per_token"]["gpus"]) < np.mean(a["predicted"]["copies_per_token"]["gpus"])
    # what the CLI computes for the same inputs
    local = solve(loads, Cluster(np.full(8, 9, dtype=np.int64)), cost=cost(256), objective="time",
                  coactivation=summarize(ids, 64))
    assert b["placement"]["phy2log"] == local.placement.phy2log.tolist()
    ev = httpx.post(f"{base}/evaluate", json={"model": "deepseek-v2-lite", "hardware": "h800", "link": "nic",
                                             "tokens_per_gpu": 256, "loads": loads.tolist(), "coactivation": summary,
                                             "placement": b["placement"], "gpus_per_node": 4}, timeout=60)
    assert ev.status_code == 200, ev.text
    assert ev.json()["predicted"]["time_us"] == b["predicted"]["time_us"]
    assert max(ev.json()["predicted"]["copies_per_token"]["nodes"]) <= 2
    for over, field in (({"coactivation": {**summary, "loads": summary["loads"][:2]}}, "coactivation"),
                        ({"objective": "speed"}, "objective"),
                        ({"coactivation": {**summary, "top_k": 0}}, "coactivation.top_k")):
        bad = httpx.post(f"{base}/placement", json={**body, **over}, timeout=60)
        assert bad.status_code == 422 and bad.headers["content-type"].startswith("application/problem+json")
        assert field in bad.text, bad.text


def test_replay_of_a_token_log_reports_copies_per_token(tmp_path: Path) -> None:
    from eplb.evaluate import contiguous_placement

    subprocess.run([sys.executable, "-m", "eplb.cli", "replay", str(LAW), "--gpus", "8", "--slots-per-gpu", "9",
                    "--window", "4", "--interval", "4", "--trigger", "periodic", "--out", str(tmp_path / "r")],
                   capture_output=True, text=True, check=True)
    results = json.loads((tmp_path / "r" / "summary.json").read_text())["results"]
    ids, _ = read_topk(LAW)
    base = contiguous_placement(26, 64, 8)
    exact = copies_per_token(ids, base.phy2log, base.slots_per_gpu, 64).gpus.mean()
    assert results["no_eplb"]["copies_per_token"] == pytest.approx(exact, abs=1e-4)
    assert {"replay", "static", "hindsight"} <= {k for k, v in results.items() if "copies_per_token" in v}


def test_time_objective_keeps_groups_on_their_nodes(law: tuple[np.ndarray, np.ndarray]) -> None:
    ids, loads = law
    cluster = Cluster(np.full(8, 9, dtype=np.int64), gpus_per_node=4, num_groups=4)
    for setup in (cost(256, link="nvlink"), cost(4096)):
        lb = solve(loads, cluster, cost=setup, coactivation=summarize(ids, 64))
        by_time = solve(loads, cluster, cost=setup, coactivation=summarize(ids, 64), objective="time")
        assert np.array_equal(by_time.placement.phy2log, lb.placement.phy2log)  # no global candidate applies
