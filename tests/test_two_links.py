"""The all-to-all over two links (DeepEP's dispatch across nodes): `--link nvlink+nic`, `TimeModel._two_link_comm`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.coactivation import copies_per_token, step_reach, summarize
from eplb.cost import TimeModel, predict
from eplb.errors import EplbError
from eplb.placement import Placement
from eplb.replay import Schedule, replay
from eplb.replay.run import initial_placement
from eplb.solve import Cluster, CostSetup, evaluate
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, all_to_all_links

H800 = HARDWARE_PRESETS["h800"]
NVLINK, _BETWEEN = all_to_all_links(H800, "nvlink+nic")
assert _BETWEEN is not None
NIC: float = _BETWEEN
MODEL = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": 16, "top_k": 3, "name": "small"})


def _deepep_counts(gpu_of_pick: np.ndarray, gpus: int, per_node: int) -> tuple[np.ndarray, ...]:
    """Brute force: every GPU sends the same tokens (picks served on gpu_of_pick [tokens, k]). A token goes once
    over the NIC to each other node it reaches, to the GPU with the sender's local index there, which forwards
    it over NVLink to the other GPUs it reaches on that node; GPUs on the sender's own node get it over NVLink.
    Returns (NIC sent, NIC received, NVLink sent, NVLink received) copies per GPU [G]."""
    nic_s, nic_r, nvl_s, nvl_r = (np.zeros(gpus) for _ in range(4))
    for src in range(gpus):
        node, index = divmod(src, per_node)
        for picks in gpu_of_pick:
            reached = set(picks.tolist())
            for other in {g // per_node for g in reached} - {node}:
                proxy = other * per_node + index
                nic_s[src] += 1
                nic_r[proxy] += 1
                for g in reached:
                    if g // per_node == other and g != proxy:
                        nvl_s[proxy] += 1
                        nvl_r[g] += 1
            for g in reached:
                if g // per_node == node and g != src:
                    nvl_s[src] += 1
                    nvl_r[g] += 1
    return nic_s, nic_r, nvl_s, nvl_r


@pytest.mark.parametrize("nic_bw", [NIC, 1e15])  # the NIC binds, or NVLink does
def test_two_link_comm_equals_a_token_by_token_count_of_deepeps_dispatch(nic_bw: float) -> None:
    gpus, per_node, tokens = 8, 4, 300
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(16, size=3, replace=False, p=np.r_[np.full(8, 0.1), np.full(8, 0.025)])
                    for _ in range(tokens)])[:, None, :].astype(np.int16)  # fmt: skip
    slots = np.full(gpus, 2, dtype=np.int64)
    p2l = np.array([[3, 9, 0, 15, 1, 2, 12, 4, 5, 13, 6, 11, 7, 10, 8, 14]])  # one slot per expert
    reach = step_reach(ids, np.array([0, tokens]), p2l, slots, 16, gpus_per_node=per_node)[0]  # [1, G + N]
    assert reach.shape == (1, gpus + gpus // per_node)
    gpu_of_pick = (np.argsort(p2l[0])[ids[:, 0, :]] // 2).astype(np.int64)
    nic_s, nic_r, nvl_s, nvl_r = _deepep_counts(gpu_of_pick, gpus, per_node)
    tm = TimeModel.from_specs(MODEL, H800, NVLINK, gpus, float(tokens), inter_node_bw=nic_bw, gpus_per_node=per_node)
    assert tm.nic_us_per_copy is not None
    rows = np.bincount(gpu_of_pick.ravel(), minlength=gpus).astype(np.float64)[None, :] * gpus
    _, _, comm = tm.gpu_terms(rows.sum(axis=1, keepdims=True), rows, np.full((1, gpus), 2.0), reach)
    expected = np.maximum(np.maximum(nic_s, nic_r) * tm.nic_us_per_copy,
                          np.maximum(nvl_s, nvl_r) * tm.comm_us_per_copy)  # fmt: skip
    assert np.allclose(comm[0], expected, rtol=1e-9)
    remote_picks = sum(int((gpu_of_pick // per_node != s // per_node).sum()) for s in range(gpus))
    assert nic_s.sum() < remote_picks  # node dedup: fewer NIC copies than picks on other nodes


def test_without_coactivation_two_links_take_independent_picks_and_the_nic_only_once_per_node() -> None:
    """From rows alone: a token reaches GPU g with 1 - (1 - r_g / (G k T))^k, node v likewise; so the two-link comm
    of a balanced layer sits between all copies over NVLink and all over the NIC, and node dedup makes it cheaper
    than every remote copy over the NIC."""
    gpus, per_node, t = 32, 8, 256.0
    loads = np.full((1, 256), 1000.0)
    p2l = np.arange(256)[None, :]
    slots = np.full(gpus, 8, dtype=np.int64)
    two = predict(loads, p2l, slots, MODEL_PRESETS["deepseek-v3"], H800, NVLINK, t, inter_node_bw=NIC,
                  gpus_per_node=per_node)  # fmt: skip
    nvlink_only = predict(loads, p2l, slots, MODEL_PRESETS["deepseek-v3"], H800, NVLINK, t)
    nic_only = predict(loads, p2l, slots, MODEL_PRESETS["deepseek-v3"], H800, NIC, t)
    assert nvlink_only.comm_us[0] < two.comm_us[0] < nic_only.comm_us[0]
    k, nodes = 8, gpus // per_node
    big_q = 1 - (1 - 1 / nodes) ** k  # a token reaches each node with this chance
    tm = TimeModel.from_specs(MODEL_PRESETS["deepseek-v3"], H800, NVLINK, gpus, t, inter_node_bw=NIC,
                              gpus_per_node=per_node)  # fmt: skip
    assert tm.nic_us_per_copy is not None
    q = 1 - (1 - 1 / gpus) ** k
    expected = max((nodes - 1) * t * big_q * tm.nic_us_per_copy, nodes * (per_node - 1) * t * q * tm.comm_us_per_copy)
    assert two.comm_us[0] == pytest.approx(expected, rel=1e-9)


def test_a_window_summary_gives_the_comm_term_each_gpus_and_each_nodes_reach() -> None:
    """evaluate() with a co-activation summary and two links: the comm term takes `reach`'s GPU and node
    columns; tokens whose picks share a node then cross the NIC less than with the picks spread over nodes."""
    from eplb.coactivation import reach

    rng = np.random.default_rng(0)
    gpus, per_node, tokens = 4, 2, 2000
    node = rng.integers(0, 2, size=tokens)  # each token picks 3 of experts 8v .. 8v + 7
    ids = np.stack([rng.choice(8, size=3, replace=False) + 8 * v for v in node])[:, None, :].astype(np.int16)
    summary = summarize(ids, 16)
    loads = summary.loads.astype(np.float64)
    slots = np.full(gpus, 4, dtype=np.int64)
    setup = CostSetup(MODEL, H800, NVLINK, 64.0, inter_node_bw=NIC)
    tm = TimeModel.from_specs(MODEL, H800, NVLINK, gpus, 64.0, inter_node_bw=NIC, gpus_per_node=per_node)
    comm = {}
    for name, p2l in (("by node", np.arange(16)), ("spread", np.arange(16).reshape(4, 4).T.ravel())):
        out = evaluate(loads, Placement(p2l[None, :], slots, 16), setup, coactivation=summary, gpus_per_node=per_node)
        r = reach(summary, p2l[None, :], slots, per_node)
        rows = np.bincount(np.repeat(np.arange(gpus), 4), weights=loads[0, p2l], minlength=gpus)[None, :]
        _, _, expected = tm.gpu_terms(loads.sum(axis=1, keepdims=True), rows, np.full((1, gpus), 4.0),
                                      np.concatenate([r.gpu, r.node], axis=1))  # fmt: skip
        assert out.prediction is not None and out.prediction.gpu_comm_us is not None
        assert np.allclose(out.prediction.gpu_comm_us, expected, rtol=1e-9)
        comm[name] = float(out.prediction.comm_us[0])
    assert comm["by node"] < comm["spread"]


def test_replay_of_a_token_log_over_two_links_equals_predict_with_the_exact_reach(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    steps, tokens, gpus, per_node = 4, 128, 4, 2
    ids = np.stack([rng.choice(16, size=3, replace=False) for _ in range(steps * tokens)])[:, None, :]
    ids = np.repeat(ids, 2, axis=1).astype(np.int16)  # 2 layers, the same picks
    offsets = np.arange(0, steps * tokens + 1, tokens, dtype=np.int64)
    log = tmp_path / "tokens.npz"
    np.savez(log, topk_ids=ids, step_offsets=offsets, num_experts=np.int64(16))
    setup = CostSetup(MODEL, H800, NVLINK, 64.0, inter_node_bw=NIC)
    cluster = Cluster(np.full(gpus, 4, dtype=np.int64), gpus_per_node=per_node)
    out = replay(log, cluster, schedule=Schedule(window=2, interval=2, first=100), cost=setup, oracle_every=0,
                 collect=True)  # fmt: skip
    assert out.steps is not None
    serving = initial_placement(2, 16, cluster.slots_per_gpu)
    exact = copies_per_token(ids, serving.phy2log, cluster.slots_per_gpu, 16, gpus_per_node=per_node)
    static = out.summary["results"]["static"]  # the initial placement serves throughout
    assert static["nodes_per_token"] == pytest.approx(float(exact.nodes.mean()), abs=1e-4)
    assert static["copies_per_token"] == pytest.approx(float(exact.gpus.mean()), abs=1e-4)
    reach = step_reach(ids, offsets, serving.phy2log, cluster.slots_per_gpu, 16, gpus_per_node=per_node)
    for s in range(steps):
        counts = np.stack([np.bincount(ids[offsets[s] : offsets[s + 1], layer].ravel(), minlength=16)
                           for layer in range(2)])  # fmt: skip
        expected = predict(counts, serving.phy2log, cluster.slots_per_gpu, MODEL, H800, NVLINK, 64.0,
                           reach=reach[s], inter_node_bw=NIC, gpus_per_node=per_node).time_us  # fmt: skip
        assert np.allclose(out.steps.time_us[s], expected, rtol=1e-5)


def test_two_links_need_more_than_one_node() -> None:
    for per_node in (None, 8, 3):
        with pytest.raises(EplbError, match="needs the GPUs per node"):
            TimeModel.from_specs(MODEL, H800, NVLINK, 8, 64.0, inter_node_bw=NIC, gpus_per_node=per_node)
    for bad in ("nvlink+nic+pcie", "nvlink+", "+nic"):
        with pytest.raises(EplbError, match="two joined by"):
            all_to_all_links(H800, bad)
    with pytest.raises(EplbError, match="link must be"):
        all_to_all_links(H800, "nvlink+fast")


def test_cli_two_links_refused_by_name_without_nodes_and_used_with_them(capsys: pytest.CaptureFixture[str]) -> None:
    from eplb.cli import main

    base = ["solve", "--gpus", "32", "--tokens-per-gpu", "256", "--json"]
    assert main([*base, "--link", "nvlink+nic"]) == 2
    assert "--gpus-per-node" in capsys.readouterr().err
    total = {}
    for link in ("nvlink+nic", "nic"):
        assert main([*base, "--link", link, "--gpus-per-node", "8"]) == 0
        total[link] = json.loads(capsys.readouterr().out)["predicted"]["total_time_us"]
    assert total["nvlink+nic"] < total["nic"]  # within a node over NVLink, once per node over the NIC


def test_replay_and_compare_refuse_two_links_without_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eplb.cli import main

    log = tmp_path / "log.npz"
    assert main(["synth", "--out", str(log), "--steps", "40", "--layers", "2"]) == 0
    capsys.readouterr()
    assert main(["replay", str(log), "--interval", "20", "--link", "nvlink+nic", "--oracle-every", "0"]) == 2
    assert "needs the GPUs per node (--gpus-per-node" in capsys.readouterr().err
    assert main(["compare", "--link", "nvlink+nic", "--out", str(tmp_path / "cmp")]) == 2
    assert "compare times one all-to-all link" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(["replay", str(log), "--interval", "20", "--link", "nvlink+nic", "--gpus-per-node", "8",
                 "--oracle-every", "0", "--out", str(out)]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    b200 = HARDWARE_PRESETS["b200"]
    assert summary["cost"]["inter_node_bandwidth"] == b200.nic_bandwidth
    migration = summary["migration"]  # copies from another node over the NIC, the others over NVLink
    assert migration["link_bandwidth"] == b200.nvlink_bandwidth
    assert migration["inter_node_bandwidth"] == b200.nic_bandwidth


def test_migration_over_two_links_sends_copies_from_other_nodes_over_the_nic() -> None:
    """Copies read from a GPU on the destination's node take NVLink, the others the NIC, both at once: the
    transfer lasts the slower of the two per GPU. With nodes the plan reads a copy on its destination's node
    when it can, and the count of copies from other nodes is exactly the plan's."""
    from eplb.cost.migration import MigrationSpec, plan_copies, plan_for
    from solvers.migration import arrange_slots
    from solvers.plan import build_plan

    slots = np.full(4, 2, dtype=np.int64)  # 2 nodes of 2 GPUs
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = np.array([[0, 2, 1, 3, 4, 5, 6, 7]])  # GPUs 0 and 1 trade experts 1 and 2: within node 0
    near_in, _, near_across = plan_copies(plan_for(new, old, slots, 2), 4, 2)
    assert near_across.tolist() == [0.0, 0.0, 0.0, 0.0]
    far = np.array([[0, 4, 2, 3, 1, 5, 6, 7]])  # GPUs 0 and 2 trade experts 1 and 4: across the nodes
    far_in, _, far_across = plan_copies(plan_for(far, old, slots, 2), 4, 2)
    assert far_across.tolist() == [1.0, 0.0, 1.0, 0.0]
    per_copy = 44e6
    spec = MigrationSpec(NVLINK, overlap=False, inter_node_bw=NIC, gpus_per_node=2)
    near_s = spec.cost(near_in * per_copy, remote_in=near_across * per_copy).transfer_s
    far_s = spec.cost(far_in * per_copy, remote_in=far_across * per_copy).transfer_s
    assert near_s == pytest.approx(per_copy / NVLINK) and far_s == pytest.approx(per_copy / NIC)
    serving = evaluate(np.ones((1, 8)), Placement(old, slots, 8), CostSetup(MODEL.model_copy(
        update={"num_experts": 8}), H800, NVLINK, 64.0)).prediction  # fmt: skip
    assert serving is not None
    overlapped = MigrationSpec(NVLINK, inter_node_bw=NIC, gpus_per_node=2)
    assert overlapped.rebalance_cost(far, old, slots, per_copy, serving).transfer_s == pytest.approx(
        per_copy / (overlapped.link_share * NIC))  # rebalance_cost sends the copies from node 1 over the NIC
    from solvers.greedy import solve_greedy

    rng = np.random.default_rng(5)
    slots = np.full(8, 5, dtype=np.int64)  # 2 nodes of 4 GPUs, 8 redundant slots: experts with several sources
    for _ in range(10):
        cur = solve_greedy(rng.pareto(1.5, (3, 32)) + 0.01, slots)
        nxt = arrange_slots(solve_greedy(rng.pareto(1.5, (3, 32)) + 0.01, slots), cur, slots)
        plan = build_plan(cur, nxt, slots, gpus_per_node=4)
        copy = ~plan.local
        across = copy & (plan.src_gpu // 4 != plan.dst_gpu // 4)
        assert across.sum() < copy.sum()
        _, sent, far_in = plan_copies(plan_for(nxt, cur, slots, 4), 8, 4)  # the estimate's plan is this one
        assert np.array_equal(far_in, np.bincount(plan.dst_gpu[across], minlength=8))
        assert np.array_equal(sent, np.bincount(plan.src_gpu[copy], minlength=8))
        spread = build_plan(cur, nxt, slots)  # without nodes the plan takes sources in turn, wherever they are
        assert (~spread.local & (spread.src_gpu // 4 != spread.dst_gpu // 4)).sum() >= across.sum()


def test_a_node_limit_without_nodes_is_refused_not_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    # the reach would be computed without nodes, so the limit would silently not apply
    from eplb.cli import main

    law = str(Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz")
    base = ["solve", "--loads", law, "--coactivation", law, "--gpus", "8", "--node-limit", "1", "--json"]
    assert main(base) == 2
    assert "needs the GPUs per node (--gpus-per-node" in capsys.readouterr().err
    assert main([*base, "--gpus-per-node", "4"]) == 0
    nodes = json.loads(capsys.readouterr().out)["predicted"]["copies_per_token"]["nodes"]
    assert nodes == pytest.approx([1.0] * len(nodes))  # the limit holds in the model
