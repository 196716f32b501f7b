"""Replay throughput on a DeepSeek-V3-sized log: layer-steps per second.

Run: python benchmarks/replay.py [--steps 10000] [--repeats 3] [--log FILE] [--compare-threads]

Builds (once, or reads --log) a synthetic 10,000-step log of 58 MoE layers x 256 experts (the
default `eplb synth` statistics, 4,096 tokens per step, stored .npz), then replays it on EP32 with
one redundant expert per GPU (288 slots), greedy every 1,000 steps with a 1,000-step window, and
prints the median over --repeats of:
- the whole replay (reading the file, 10 rebalances with GPU relabelling, evaluating the replay,
  static and no-EPLB placements with predicted times), without the oracle;
- evaluation only (the vectorized lb + time of three placements for every step and layer), both
  as measured inside those replays and on in-memory chunks;
- the oracle (greedy solved on every step's own counts), on a sample of steps, extrapolated;
- with --compare-threads, evaluation with OpenBLAS's default thread count (slow on shared CPUs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from eplb.io.logs import open_log, write_counts
from eplb.placement import Placement
from eplb.replay import Schedule as ReplaySchedule
from eplb.replay import blas_threads, initial_placement, replay
from eplb.replay.run import _Evaluator, _oracle
from eplb.solve import Cluster, CostSetup
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SynthConfig, synth_counts
from solvers.greedy import solve_greedy

LAYERS, EXPERTS, GPUS, SLOTS = 58, 256, 32, 9


def make_log(path: Path, steps: int) -> float:
    t = time.perf_counter()
    cfg = SynthConfig(steps=steps, layers=LAYERS, experts=EXPERTS, top_k=8, tokens=4096)
    write_counts(path, synth_counts(cfg), model="deepseek-v3", top_k=8, num_steps=steps, dtype=cfg.count_dtype)
    return time.perf_counter() - t


def whole_replays(path: Path, repeats: int, cost: CostSetup) -> list[dict[str, Any]]:
    cluster = Cluster(np.full(GPUS, SLOTS))
    out = []
    for _ in range(repeats):
        res = replay(path, cluster, schedule=ReplaySchedule(window=1000, interval=1000), cost=cost, oracle_every=0)
        out.append(res.summary["timing"] | {"rebalances": res.summary["rebalances"]["count"]})
    return out


def evaluation_only(path: Path, cost: CostSetup, chunks: int, threads: int | None) -> list[float]:
    """Layer-steps/s of _Evaluator.evaluate on in-memory 256-step chunks, replay != static."""
    log = open_log(path)
    data = [c.counts for c, _ in zip(log.iter_counts(256), range(chunks), strict=False)]
    slots = np.full(GPUS, SLOTS)
    window = data[0].sum(axis=0).astype(np.float64)
    placed = Placement(solve_greedy(window, slots), slots, EXPERTS)
    ev = _Evaluator(LAYERS, EXPERTS, slots, cost)
    ev.set_placements(placed, initial_placement(LAYERS, EXPERTS, slots))
    rates = []
    with blas_threads(threads):
        for counts in data:
            t = time.perf_counter()
            ev.evaluate(counts)
            rates.append(counts.shape[0] * LAYERS / (time.perf_counter() - t))
    return rates


def oracle_rate(path: Path, cost: CostSetup, steps: int) -> float:
    log = open_log(path)
    counts = next(iter(log.iter_counts(steps))).counts
    cluster = Cluster(np.full(GPUS, SLOTS))
    ev = _Evaluator(LAYERS, EXPERTS, cluster.slots_per_gpu, cost)
    with blas_threads(1):
        t = time.perf_counter()
        _oracle(counts, cluster, ev.time)
        return steps * LAYERS / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", type=Path, help="reuse (or create) the log here instead of a temporary file")
    parser.add_argument("--oracle-steps", type=int, default=64, help="steps the oracle rate is measured on")
    parser.add_argument("--compare-threads", action="store_true", help="also time OpenBLAS's default threads")
    args = parser.parse_args()
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], hw, hw.nvlink_bandwidth)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.log or Path(tmp) / "log.npz"
        if not path.exists():
            made = make_log(path, args.steps)
            print(f"synthesized {args.steps:,} steps x {LAYERS} x {EXPERTS} in {made:.1f} s "
                  f"({path.stat().st_size / 1e6:,.0f} MB, stored)")  # fmt: skip
        info = open_log(path).info
        layer_steps = (info.num_steps or 0) * LAYERS
        runs = whole_replays(path, args.repeats, cost)
        wall = statistics.median(r["wall_s"] for r in runs)
        ev_s = statistics.median(r["evaluation_s"] for r in runs)
        print(f"\nlog: {info.describe()}; EP{GPUS}, {GPUS * SLOTS} slots; greedy every 1,000 steps, window 1,000; "
              f"median of {args.repeats}")  # fmt: skip
        print(f"{'':<44}{'seconds':>10}{'layer-steps/s':>16}")
        print(f"{'whole replay (no oracle)':<44}{wall:>10.2f}{layer_steps / wall:>16,.0f}")
        for key, label in (("read_s", "  reading the log"), ("solve_s", f"  {runs[0]['rebalances']} rebalances "
                           "(solve + relabel)"), ("evaluation_s", "  evaluation (3 placements + time)")):  # fmt: skip
            v = statistics.median(r[key] for r in runs)
            print(f"{label:<44}{v:>10.2f}{'' if key != 'evaluation_s' else f'{layer_steps / ev_s:,.0f}':>16}")
        rates = evaluation_only(path, cost, 24, threads=1)
        print(f"{'evaluation only, in memory, 256-step chunks':<44}{'':>10}{statistics.median(rates):>16,.0f}")
        if args.compare_threads:
            rates = evaluation_only(path, cost, 8, threads=None)
            label = "  same with OpenBLAS default threads"
            print(f"{label:<44}{'':>10}{statistics.median(rates):>16,.0f}")
        o = oracle_rate(path, cost, args.oracle_steps)
        print(f"{'oracle (greedy per step), ' + str(args.oracle_steps) + ' steps':<44}"
              f"{layer_steps / o:>10.1f}{o:>16,.0f}   (seconds: extrapolated to the whole log)")  # fmt: skip


if __name__ == "__main__":
    main()
