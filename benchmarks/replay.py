"""Replay throughput on a DeepSeek-V3-sized log: layer-steps per second, next to the previous implementation.

Run: python benchmarks/replay.py [--steps 10000] [--repeats 3] [--log FILE]

Builds (once, or reads --log) a synthetic log of 58 MoE layers x 256 experts (the default `eplb synth`
statistics, 4,096 tokens per step), then on EP32 with one redundant expert per GPU (288 slots) prints the
median over --repeats of:
- evaluation only, in memory, 256-step chunks: the lb and predicted time of four placements (replay,
  static, no EPLB, hindsight) per step and layer, with the compiled gather + segment sum
  (eplb/replay/evaluate.py), next to the previous implementation (the float32 batched matmul of three
  placements and its zero-count path, loaded from git commit PREVIOUS) measured in the same run on the
  same chunks; a second row with an expert at zero count in every layer-step (the old slow path);
- the whole replay (periodic greedy every 1,000 steps, window 1,000, hindsight row, no oracle);
- the oracle (greedy solved on every step's own counts), on a sample of steps, extrapolated.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from eplb.io.logs import open_log, write_counts
from eplb.placement import Placement
from eplb.replay import Schedule, blas_threads, initial_placement, replay
from eplb.replay.evaluate import Evaluator, oracle, time_model
from eplb.solve import Cluster, CostSetup
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SynthConfig, synth_counts
from solvers.greedy import solve_greedy

LAYERS, EXPERTS, GPUS, SLOTS = 58, 256, 32, 9
PREVIOUS = "50efd89"  # the last commit with the matmul evaluator (eplb/replay/run.py)
ROOT = Path(__file__).resolve().parents[1]


def make_log(path: Path, steps: int) -> float:
    t = time.perf_counter()
    cfg = SynthConfig(steps=steps, layers=LAYERS, experts=EXPERTS, top_k=8, tokens=4096)
    write_counts(path, synth_counts(cfg), model="deepseek-v3", top_k=8, num_steps=steps, dtype=cfg.count_dtype)
    return time.perf_counter() - t


def previous_module() -> types.ModuleType:
    """The replay module as of commit PREVIOUS, loaded from git (its evaluator is the baseline)."""
    source = subprocess.run(["git", "show", f"{PREVIOUS}:eplb/replay/run.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType("previous_replay")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{PREVIOUS}:eplb/replay/run.py", "exec"), module.__dict__)
    return module


def evaluation_rates(chunks: list[np.ndarray], cost: CostSetup, zero: bool) -> tuple[float, float]:
    """Median layer-steps/s of (new, previous) evaluators on the same in-memory chunks."""
    slots = np.full(GPUS, SLOTS)
    window = chunks[0].sum(axis=0).astype(np.float64)
    placed = Placement(solve_greedy(window, slots), slots, EXPERTS)
    start = initial_placement(LAYERS, EXPERTS, slots)
    hind = Placement(solve_greedy(chunks[1].sum(axis=0).astype(np.float64), slots), slots, EXPERTS)
    new = Evaluator(time_model(cost, GPUS))
    from eplb.evaluate import contiguous_placement

    new.set_placements([placed, start, contiguous_placement(LAYERS, EXPERTS, GPUS), hind])
    prev_mod = previous_module()
    old = prev_mod._Evaluator(LAYERS, EXPERTS, slots, cost)
    old.set_placements(placed, start)
    rates: dict[str, list[float]] = {"new": [], "old": []}
    with blas_threads(1):
        for counts in chunks:
            if zero:
                counts = counts.copy()
                counts[:, :, 0] = 0
            for name, ev in (("new", new), ("old", old)):
                t = time.perf_counter()
                ev.evaluate(counts)
                rates[name].append(counts.shape[0] * LAYERS / (time.perf_counter() - t))
    return statistics.median(rates["new"]), statistics.median(rates["old"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=16, help="256-step chunks for the evaluation-only rows")
    parser.add_argument("--log", type=Path, help="reuse (or create) the log here instead of a temporary file")
    parser.add_argument("--oracle-steps", type=int, default=64, help="steps the oracle rate is measured on")
    args = parser.parse_args()
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], hw, hw.nvlink_bandwidth)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.log or Path(tmp) / "log.npz"
        if not path.exists():
            made = make_log(path, args.steps)
            print(f"synthesized {args.steps:,} steps x {LAYERS} x {EXPERTS} in {made:.1f} s "
                  f"({path.stat().st_size / 1e6:,.0f} MB, stored)")  # fmt: skip
        log = open_log(path)
        info = log.info
        chunks = [c.counts for c, _ in zip(log.iter_counts(256), range(args.chunks), strict=False)]
        print(f"\nlog: {info.describe()}; EP{GPUS}, {GPUS * SLOTS} slots; medians over {args.repeats} runs")
        print(f"{'evaluation only (lb + time per step and layer)':<52}{'layer-steps/s':>15}{'previous':>12}{'x':>7}")
        for zero in (False, True):
            runs = [evaluation_rates(chunks, cost, zero) for _ in range(args.repeats)]
            new, old = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            label = "  4 placements, in memory, 256-step chunks" + (", zero counts" if zero else "")
            print(f"{label:<52}{new:>15,.0f}{old:>12,.0f}{new / old:>7.1f}")
        layer_steps = (info.num_steps or 0) * LAYERS
        cluster = Cluster(np.full(GPUS, SLOTS))
        whole: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            res = replay(path, cluster, schedule=Schedule(window=1000, interval=1000), cost=cost, oracle_every=0)
            whole.append(res.summary["timing"] | {"rebalances": res.summary["rebalances"]["count"]})
        print(f"\n{'whole replay (periodic greedy, no oracle)':<52}{'seconds':>15}{'layer-steps/s':>15}")
        wall = statistics.median(r["wall_s"] for r in whole)
        print(f"{'  total':<52}{wall:>15.2f}{layer_steps / wall:>15,.0f}")
        parts = (("read_s", "  reading the log"), ("hindsight_s", "  hindsight pass (read + interval solves)"),
                 ("solve_s", f"  {whole[0]['rebalances']} rebalances (solve + relabel)"),
                 ("evaluation_s", "  evaluation"))  # fmt: skip
        for key, label in parts:
            v = statistics.median(r[key] for r in whole)
            rate = f"{layer_steps / v:,.0f}" if key == "evaluation_s" and v > 0 else ""
            print(f"{label:<52}{v:>15.2f}{rate:>15}")
        counts = chunks[0][: args.oracle_steps]
        with blas_threads(1):
            t = time.perf_counter()
            oracle(counts, cluster, time_model(cost, GPUS))
            rate = counts.shape[0] * LAYERS / (time.perf_counter() - t)
        print(f"{'oracle (greedy per step), ' + str(counts.shape[0]) + ' steps, extrapolated':<52}"
              f"{layer_steps / rate:>15.1f}{rate:>15,.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
