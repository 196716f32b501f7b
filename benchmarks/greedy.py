"""Greedy solver speed and quality, vectorized vs a plain per-layer loop of the same algorithm.

Run: python benchmarks/greedy.py [--repeats N]
Prints, per case, median wall time of: our vectorized `solve_greedy` (with and without its swap
refinement), the DeepSeek-compatible
`rebalance_experts`, and a plain Python loop over layers (replicate, then heaviest-first into the
least-loaded GPU with room), with the speed ratio and mean/max lb of each placement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import Placement
from solvers.greedy import rebalance_experts, solve_greedy

ROOT = Path(__file__).resolve().parents[1]


def loop_greedy(loads: NDArray[np.float64], slots: int, gpus: int) -> NDArray[np.int64]:
    """The same global algorithm one layer at a time with Python lists (the baseline)."""
    out = []
    for row in loads.tolist():
        experts = len(row)
        replicas = [1] * experts
        for _ in range(slots * gpus - experts):
            e = max(range(experts), key=lambda i: row[i] / replicas[i])
            replicas[e] += 1
        items = sorted(((row[e] / replicas[e], e) for e in range(experts) for _ in range(replicas[e])), reverse=True)
        load, used = [0.0] * gpus, [0] * gpus
        members: list[list[int]] = [[] for _ in range(gpus)]
        for w, e in items:
            g = min((g for g in range(gpus) if used[g] < slots), key=lambda g: load[g])
            load[g] += w
            used[g] += 1
            members[g].append(e)
        out.append([e for m in members for e in m])
    return np.asarray(out, dtype=np.int64)


def _deepseek_phy2log(loads: NDArray[np.float64], replicas: int, gpus: int) -> NDArray[np.int64]:
    return rebalance_experts(loads, replicas, 1, 1, gpus)[0]


def timed(fn: Callable[[], NDArray[np.int64]], repeats: int) -> tuple[float, NDArray[np.int64]]:
    times, result = [], fn()
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000, result


def skewed(layers: int, experts: int, seed: int) -> NDArray[np.float64]:
    """Synthetic loads with the hottest expert about 10x the mean (lognormal popularity)."""
    rng = np.random.default_rng(seed)
    loads = rng.lognormal(0.0, 1.0, (layers, experts))
    return np.asarray(np.round(loads / loads.mean(axis=1, keepdims=True) * 1000), dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    real = read_window(None).loads
    cases = [
        ("DeepSeek-V3 58x256 (SGLang prefill) EP32, 288 slots", real, 32, 9),
        ("DeepSeek-V3 58x256 (SGLang prefill) EP64, 320 slots", real, 64, 5),
        ("61x384 synthetic (hot ~10x mean) EP128, 512 slots", skewed(61, 384, 0), 128, 4),
    ]
    results = []
    print(f"{'case':<55}{'impl':<22}{'median ms':>10}{'lb mean':>9}{'lb max':>8}{'vs loop':>9}")
    for name, loads, gpus, per_gpu in cases:
        slots = np.full(gpus, per_gpu)
        num_experts = loads.shape[1]
        runs: dict[str, Callable[[], NDArray[np.int64]]] = {
            "solve_greedy (ours)": partial(solve_greedy, loads, slots),
            "ours without swaps": partial(solve_greedy, loads, slots, refine_rounds=0),
            "rebalance_experts": partial(_deepseek_phy2log, loads, gpus * per_gpu, gpus),
            "plain loop": partial(loop_greedy, loads, per_gpu, gpus),
        }
        measured = {impl: timed(fn, args.repeats if impl != "plain loop" else max(1, args.repeats // 3))
                    for impl, fn in runs.items()}
        loop_ms = measured["plain loop"][0]
        for impl, (ms, phy2log) in measured.items():
            lb = balance(loads, Placement(phy2log, slots, num_experts)).lb
            print(f"{name:<55}{impl:<22}{ms:>10.2f}{lb.mean():>9.4f}{lb.max():>8.4f}{loop_ms / ms:>8.1f}x")
            results.append({"case": name, "impl": impl, "median_ms": round(ms, 3), "lb_mean": float(lb.mean()),
                            "lb_max": float(lb.max()), "speedup_vs_loop": round(loop_ms / ms, 2)})
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "greedy.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
