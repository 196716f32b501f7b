"""Co-activation-aware placement on token-level logs, train/test split.

Solve on the first half of a log's steps, evaluate on the rest: dispatch copies per token (distinct GPUs,
remote GPUs, nodes; co-activation-aware replica rule and vLLM's), lb on the held-out loads, predicted
layer time (eplb.cost.predict: its comm term does not yet see co-activation), for contiguous, load-only
greedy and greedy-coact (1% lb cap on the training window and 8 training sub-windows).

    python benchmarks/coactivation.py                     # shipped ESFT law log + a synthetic DeepSeek-V3 case
    python benchmarks/coactivation.py --log A.npz --ep 8 --slots 72
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
from eplb.cost import predict
from eplb.io.logs import open_log
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, link_bandwidth
from eplb.synth import SynthConfig, synth_topk
from solvers.registry import Options, Problem, solve

ROOT = Path(__file__).parents[1]
LAW = ROOT / "fixtures" / "esft-dsv2lite-law-topk.npz"


def _loads(ids: NDArray[np.int16], experts: int) -> NDArray[np.float64]:
    pairs = pair_counts(ids, experts)
    idx = np.arange(experts)
    return pairs[:, idx, idx].astype(np.float64)


def _lb(p2l: NDArray[np.int64], loads: NDArray[np.float64], slots: NDArray[np.int64]) -> NDArray[np.float64]:
    gpu = np.repeat(np.arange(slots.size), slots)
    out = []
    for layer in range(loads.shape[0]):
        cnt = np.bincount(p2l[layer], minlength=loads.shape[1])
        per_gpu = np.bincount(gpu, weights=loads[layer][p2l[layer]] / cnt[p2l[layer]], minlength=slots.size)
        out.append(per_gpu.max() / per_gpu.mean())
    return np.asarray(out)


def _contiguous(loads: NDArray[np.float64], num_slots: int) -> NDArray[np.int64]:
    """Experts in id order, extra slots to the hottest experts (as the engines do without EPLB)."""
    experts = loads.shape[1]
    rows = [np.r_[np.arange(experts), np.argsort(-row, kind="stable")[: num_slots - experts]] for row in loads]
    return np.asarray(rows, dtype=np.int64)


def run_case(
    name: str, ids: NDArray[np.int16], offsets: NDArray[np.int64], experts: int, gpus: int, slots_per_gpu: int,
    gpus_per_node: int, model: str, slack: float,
) -> None:
    steps = offsets.size - 1
    half = steps // 2
    train, test = ids[: offsets[half]], ids[offsets[half] :]
    loads, test_loads = _loads(train, experts), _loads(test, experts)
    bounds = np.linspace(0, half, 9).astype(int)
    scen = np.stack([_loads(ids[offsets[a] : offsets[b]], experts) for a, b in itertools.pairwise(bounds)])
    slots = np.full(gpus, slots_per_gpu, dtype=np.int64)
    pairs = pair_counts(train, experts).astype(np.float64)
    spec, hw = MODEL_PRESETS[model], HARDWARE_PRESETS["h800"]
    link = link_bandwidth(hw, "nvlink" if gpus <= gpus_per_node else "nic")
    print(f"\n## {name}: {ids.shape[1]} layers x {experts} experts, top-{ids.shape[2]}, {steps} steps "
          f"({train.shape[0]} train / {test.shape[0]} test tokens), EP{gpus} x {slots_per_gpu} slots, "
          f"{gpus_per_node} GPUs per node; partner lift {partner_lift(train, experts):.2f}")
    print("| placement | wall s | copies/token (coact rule) | vLLM rule | remote GPUs | nodes | "
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
    base = None
    for label, (p2l, wall) in rows.items():
        c = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="coact")
        v = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="vllm")
        lb_test, lb_train = _lb(p2l, test_loads, slots), _lb(p2l, loads, slots)
        pred = predict(test_loads, p2l, slots, spec, hw, link, tokens_per_gpu=256)
        copies = float(c.gpus.mean())
        if label == "greedy":
            base = (copies, float(np.median(lb_test)))
        print(f"| {label} | {wall:.2f} | {copies:.3f} | {v.gpus.mean():.3f} | {c.remote_gpus.mean():.3f} | "
              f"{c.nodes.mean():.3f} | {np.median(lb_test):.4f} ({lb_test.max():.4f}) | {np.median(lb_train):.4f} | "
              f"{np.median(pred.time_us):.1f} |")
    assert base is not None
    p2l = coact.phy2log
    copies = float(copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node, rule="coact").gpus.mean())
    lb = float(np.median(_lb(p2l, test_loads, slots)))
    print(f"greedy-coact vs greedy on held-out steps: copies/token {copies / base[0] - 1:+.1%}, "
          f"median lb {lb / base[1] - 1:+.2%}")
    exact = copies_per_token(test, p2l, slots, experts, gpus_per_node=gpus_per_node).gpus
    est, _ = approx_copies_per_token(summarize(train, experts, 8), p2l, slots, gpus_per_node)
    print(f"summary (top-8 partners, train) estimate of greedy-coact's held-out copies/token: mean {est.mean():.3f} "
          f"against exact {exact.mean():.3f} (vLLM rule), largest layer error {np.abs(est - exact).max():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", type=Path, action="append", help="token-level log(s) (default: the shipped ESFT law log)")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 72], help="total slots (one case each)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--slack", type=float, default=0.01)
    ap.add_argument("--skip-synthetic", action="store_true")
    args = ap.parse_args()
    for path in args.log or [LAW]:
        ids, offsets = read_topk(path)
        experts = open_log(path).info.num_experts
        for total in args.slots:
            run_case(path.name, ids, offsets, experts, args.ep, total // args.ep, args.gpus_per_node,
                     "deepseek-v2-lite", args.slack)
    if not args.skip_synthetic:
        cfg = SynthConfig(steps=16, layers=6, experts=256, top_k=8, tokens=2048, seed=1)
        ids, offsets = synth_topk(cfg)
        run_case("synthetic DeepSeek-V3-like (eplb.synth, ESFT-calibrated co-activation)", ids, offsets, 256, 32, 9,
                 8, "deepseek-v3", args.slack)


if __name__ == "__main__":
    main()
