"""Co-activation-aware placement on token-level logs, train/test split.

Solve on the first half of a log's steps, evaluate on the rest: dispatch copies per token (distinct GPUs,
remote GPUs, nodes; co-activation-aware replica rule and vLLM's), lb on the held-out loads, predicted
layer time on the held-out steps (eplb.solve.evaluate: the comm term counts the GPUs a token reaches, from the
held-out steps' co-activation summary), for contiguous, load-only greedy, greedy-coact (1% lb cap on the
training window and 8 training sub-windows) and greedy and the MILP (1 s per layer) with --objective time
(candidates chosen on the training window's summary).

    python benchmarks/coactivation.py                     # the 4 shipped ESFT logs + a synthetic DeepSeek-V3 case
    python benchmarks/coactivation.py --log A.npz --ep 8 --slots 72 --link nic
    python benchmarks/coactivation.py --skip-esft         # the synthetic case alone
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from eplb.coactivation import (
    approx_copies_per_token,
    copies_per_token,
    pair_counts,
    partner_lift,
    read_topk,
    summarize,
)
from eplb.io.logs import open_log
from eplb.placement import Placement
from eplb.solve import Cluster, CostSetup, evaluate
from eplb.solve import solve as eplb_solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, all_to_all_links
from eplb.synth import SynthConfig, synth_topk
from solvers.registry import Options, Problem, solve

ROOT = Path(__file__).parents[1]
ESFT = [ROOT / "fixtures" / f"esft-dsv2lite-{task}-topk.npz" for task in ("law", "intent", "summary", "translation")]


def _loads(ids: NDArray[np.int16], experts: int) -> NDArray[np.float64]:
    pairs = pair_counts(ids, experts)
    idx = np.arange(experts)
    return pairs[:, idx, idx].astype(np.float64)


def _contiguous(loads: NDArray[np.float64], num_slots: int) -> NDArray[np.int64]:
    """Experts in id order, extra slots to the hottest experts (as the engines do without EPLB)."""
    experts = loads.shape[1]
    rows = [np.r_[np.arange(experts), np.argsort(-row, kind="stable")[: num_slots - experts]] for row in loads]
    return np.asarray(rows, dtype=np.int64)


def run_case(
    name: str, ids: NDArray[np.int16], offsets: NDArray[np.int64], experts: int, gpus: int, slots_per_gpu: int,
    gpus_per_node: int, model: str, slack: float, link_name: str, milp_limit: float,
) -> dict[str, tuple[float, float, int, int]]:
    """Print one case's table; per placement its held-out (copies/token change, median lb change, layers
    predicted faster, slower) against load-only greedy."""
    steps = offsets.size - 1
    half = steps // 2
    train, test = ids[: offsets[half]], ids[offsets[half] :]
    loads, test_loads = _loads(train, experts), _loads(test, experts)
    bounds = np.linspace(0, half, 9).astype(int)
    scen = np.stack([_loads(ids[offsets[a] : offsets[b]], experts) for a, b in itertools.pairwise(bounds)])
    slots = np.full(gpus, slots_per_gpu, dtype=np.int64)
    pairs = pair_counts(train, experts).astype(np.float64)
    spec, hw = MODEL_PRESETS[model], HARDWARE_PRESETS["h800"]
    if link_name == "auto":
        link_name = "nvlink" if gpus <= gpus_per_node else "nvlink+nic"
    if "+" in link_name and gpus <= gpus_per_node:
        link_name = link_name.split("+")[0]  # one node: only the link within it
    within, between = all_to_all_links(hw, link_name)
    setup = CostSetup(spec, hw, within, 256.0, inter_node_bw=between)
    train_summary, test_summary = summarize(train, experts, 8), summarize(test, experts, 8)
    nodes = gpus_per_node if gpus > gpus_per_node else None
    print(f"\n## {name}: {ids.shape[1]} layers x {experts} experts, top-{ids.shape[2]}, {steps} steps "
          f"({train.shape[0]} train / {test.shape[0]} test tokens), EP{gpus} x {slots_per_gpu} slots, "
          f"{gpus_per_node} GPUs per node; partner lift {partner_lift(train, experts):.2f}; {model} on h800, "
          f"{link_name}, 256 tokens per GPU")
    print("| placement | wall ms | copies/token (coact rule) | vLLM rule | remote GPUs | nodes | "
          "test lb median (max) | train lb median | predicted µs/layer (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    rows["contiguous"] = (_contiguous(loads, gpus * slots_per_gpu), 0.0)
    t = time.perf_counter()
    rows["greedy"] = (solve("greedy", Problem(loads, slots)).phy2log, time.perf_counter() - t)
    t = time.perf_counter()
    problem = Problem(loads, slots, scenarios=scen, coactivation=pairs)
    coact = solve("greedy-coact", problem, Options(max_lb_slack=slack))
    rows[f"greedy-coact ({slack:.0%} cap)"] = (coact.phy2log, time.perf_counter() - t)
    for solver, options in (("greedy", Options()), ("milp", Options(time_limit_s=milp_limit))):
        t = time.perf_counter()
        out = eplb_solve(loads, Cluster(slots, nodes), solver=solver, cost=setup, options=options, objective="time",
                         coactivation=train_summary, scenarios=scen)
        rows[f"{solver} --objective time"] = (out.placement.phy2log, time.perf_counter() - t)
    base = None
    times, held = {}, {}
    for label, (p2l, wall) in rows.items():
        c = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="coact")
        v = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="vllm")
        placement = Placement(p2l, slots, experts)
        held_out = evaluate(test_loads, placement, setup, coactivation=test_summary, gpus_per_node=nodes)
        lb_test, lb_train = held_out.balance.lb, evaluate(loads, placement).balance.lb
        assert held_out.prediction is not None
        times[label] = held_out.prediction.time_us
        copies = float(c.gpus.mean())
        if label == "greedy":
            base = (copies, float(np.median(lb_test)))
        held[label] = (copies, float(np.median(lb_test)))
        print(f"| {label} | {wall * 1000:,.1f} | {copies:.3f} | {v.gpus.mean():.3f} | {c.remote_gpus.mean():.3f} | "
              f"{c.nodes.mean():.3f} | {np.median(lb_test):.4f} ({lb_test.max():.4f}) | {np.median(lb_train):.4f} | "
              f"{np.median(held_out.prediction.time_us):.1f} |")
    assert base is not None
    _refine_speed(loads, rows["greedy"][0], slots, pairs, scen, slack)
    for label in ("greedy --objective time", "milp --objective time"):
        ours, greedy_us = times[label], times["greedy"]
        print(f"{label} vs greedy, predicted held-out layer time: faster on {int((ours < greedy_us).sum())} of "
              f"{ours.size} layers, slower on {int((ours > greedy_us).sum())}; total {ours.sum() / 1000:.3f} ms vs "
              f"{greedy_us.sum() / 1000:.3f} ms per step ({ours.sum() / greedy_us.sum() - 1:+.1%})")
    p2l = coact.phy2log
    copies = float(copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="coact").gpus.mean())
    lb = float(np.median(evaluate(test_loads, Placement(p2l, slots, experts)).balance.lb))
    print(f"greedy-coact vs greedy on held-out steps: copies/token {copies / base[0] - 1:+.1%}, "
          f"median lb {lb / base[1] - 1:+.2%}")
    exact = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node).gpus
    est, _ = approx_copies_per_token(summarize(train, experts, 8), p2l, slots, gpus_per_node)
    print(f"summary (top-8 partners, train) estimate of greedy-coact's held-out copies/token: mean {est.mean():.3f} "
          f"against exact {exact.mean():.3f} (vLLM rule), largest layer error {np.abs(est - exact).max():.3f}")
    g = times["greedy"]
    return {label: (c / base[0] - 1, m / base[1] - 1, int((times[label] < g).sum()), int((times[label] > g).sum()))
            for label, (c, m) in held.items() if label not in ("greedy", "contiguous")}


def _spread(values: list[float], fmt: str = "+.1%") -> str:
    return f"{np.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def print_goals(cases: dict[str, dict[str, tuple[float, float, int, int]]]) -> None:
    """Across cases, per placement: held-out copies/token and median lb against greedy (median [min, max]),
    and on how many cases the issue's goals hold (>= 20% fewer copies at lb within 1%; never predicted
    slower than greedy on a layer)."""
    print(f"\n## Held-out, against load-only greedy, over {len(cases)} cases: median [min, max]")
    print("| placement | copies/token | test lb median | >= 20% fewer copies at lb within 1% | "
          "no layer predicted slower |")
    print("|---|---|---|---|---|")
    for label in next(iter(cases.values())):
        rows = [case[label] for case in cases.values()]
        met = [name for name, case in cases.items() if case[label][0] <= -0.2 and case[label][1] <= 0.01]
        print(f"| {label} | {_spread([r[0] for r in rows])} | {_spread([r[1] for r in rows], '+.2%')} | "
              f"{len(met)} of {len(rows)} | {sum(r[3] == 0 for r in rows)} of {len(rows)} |")


def _refine_speed(loads: NDArray[np.float64], start: NDArray[np.int64], slots: NDArray[np.int64],
                  pairs: NDArray[np.float64], scen: NDArray[np.float64], slack: float) -> None:
    """greedy-coact's refinement of every layer (the descent and ROUNDS rounds of iterated local search): the
    compiled loop next to the numpy reference loop, and the compiled descent alone."""
    from solvers.coactivation import ROUNDS, _layer

    walls: dict[bool, list[float]] = {True: [], False: []}
    descent = 0.0
    same = True
    for layer in range(loads.shape[0]):
        rows = np.concatenate([loads[layer][None, :], scen[:, layer, :]])
        out = {}
        for compiled in (True, False):
            t = time.perf_counter()
            out[compiled] = _layer(start[layer], rows, pairs[layer], slots, slack, 1000, compiled=compiled,
                                   rounds=ROUNDS)[0]
            walls[compiled].append(time.perf_counter() - t)
        same &= bool(np.array_equal(out[True], out[False]))
        t = time.perf_counter()
        _layer(start[layer], rows, pairs[layer], slots, slack, 1000, rounds=0)
        descent += time.perf_counter() - t
    fast, ref = sum(walls[True]), sum(walls[False])
    print(f"greedy-coact refinement, all {loads.shape[0]} layers: compiled {fast * 1000:,.1f} ms "
          f"({fast * 1000 / loads.shape[0]:.2f} ms per layer; the first descent alone {descent * 1000:,.1f} ms), "
          f"numpy reference loop {ref * 1000:,.1f} ms ({ref / fast:,.0f}x), identical placements: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", type=Path, action="append", help="token-level log(s) (default: the 4 ESFT logs)")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 72], help="total slots (one case each)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--slack", type=float, default=0.01)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-esft", action="store_true", help="the synthetic case only (no --log, no ESFT logs)")
    ap.add_argument("--link", default="auto", help="nvlink, nic, GB/s, or within+between nodes: nvlink+nic "
                    "(default: nvlink on one node, else nvlink+nic)")
    ap.add_argument("--milp-time-limit", type=float, default=1.0, help="MILP s per layer (default: 1)")
    args = ap.parse_args()
    cases = {}
    for path in [] if args.skip_esft else args.log or ESFT:
        ids, offsets = read_topk(path)
        experts = open_log(path).info.num_experts
        for total in args.slots:
            cases[f"{path.name} x{total // args.ep}"] = run_case(
                path.name, ids, offsets, experts, args.ep, total // args.ep, args.gpus_per_node, "deepseek-v2-lite",
                args.slack, args.link, args.milp_time_limit)  # fmt: skip
    if cases:
        print_goals(cases)
    if not args.skip_synthetic:
        cfg = SynthConfig(steps=16, layers=6, experts=256, top_k=8, tokens=2048, seed=1)
        ids, offsets = synth_topk(cfg)
        synthetic = run_case("synthetic DeepSeek-V3-like (eplb.synth, ESFT-calibrated co-activation)", ids, offsets,
                             256, 32, 9, 8, "deepseek-v3", args.slack, args.link, args.milp_time_limit)
        print_goals({"synthetic": synthetic})


if __name__ == "__main__":
    main()
