"""How close to hindsight can any held placement get on the synthetic drift logs? A bound for issue 11.

Run: python benchmarks/forecast_bound.py [--steps 6000] [--layers 8] [--window 500] [--interval 1000]

benchmarks/rebalance.py judges a policy by realized lb / the hindsight row's (greedy solved on each
interval's own summed counts, which sees the future). This script asks what part of that gap no causal
policy can close. On the drift and shifts logs of benchmarks/rebalance.py (the same configs, regenerated
step by step so the generator's hidden state is known) it serves every interval with greedy solved on:
- `causal oracle`: the expected popularity over the interval given the generator's exact state at the
  check (its regime and every expert's drift value x; x is an Ornstein-Uhlenbeck process, so
  x(t + h) ~ N(rho^h x(t), 1 - rho^2h); Monte Carlo, 25 points over the interval x 64 draws). No policy
  that sees only counts knows more than this about the next interval, except future regime shifts, which
  it cannot know either;
- `regime mean`: the regime's long-run mean popularity (drift averaged out; knows the regime, not x);
- `hindsight`: the interval's own summed counts (the replay's hindsight row; checked equal to it here).
Next to them the replays of periodic greedy and of the default (incremental, cost trigger) on the same log.
Every lb is realized: the mean over steps and layers of busiest GPU / mean GPU, over the steps from the
first rebalance on (the first interval, served by vLLM's initial placement in every replay, is left out).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
from numpy.typing import NDArray
from rebalance import GPUS, SLOTS, synth_configs  # the cluster and logs of benchmarks/rebalance.py

from eplb.cost.migration import MigrationSpec
from eplb.placement import Placement
from eplb.replay import Schedule, replay
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SynthConfig, _Popularity
from solvers.loads import gpu_loads

POINTS, DRAWS = 25, 64


def softmax(logp: NDArray[np.float64]) -> NDArray[np.float64]:
    p = np.exp(logp - logp.max(axis=-1, keepdims=True))
    out: NDArray[np.float64] = p / p.sum(axis=-1, keepdims=True)
    return out


def expected_popularity(proc: _Popularity, horizons: NDArray[np.float64], rng: np.random.Generator) -> NDArray[Any]:
    """E[p] [layers, experts] averaged over `horizons` (steps after proc's current state)."""
    rho, std = proc.rho, proc.cfg.drift_std
    total = np.zeros_like(proc.x)
    for h in horizons:
        z = rng.standard_normal((DRAWS, *proc.x.shape))
        x = rho**h * proc.x + math.sqrt(1 - rho ** (2 * h)) * z
        total += softmax(proc.base + std * x).mean(axis=0)
    out: NDArray[Any] = total / len(horizons)
    return out


def regime_mean(proc: _Popularity, rng: np.random.Generator) -> NDArray[Any]:
    """The regime's long-run mean popularity [layers, experts] (x drawn from its stationary N(0, 1))."""
    z = rng.standard_normal((POINTS * DRAWS, *proc.x.shape))
    out: NDArray[Any] = softmax(proc.base + proc.cfg.drift_std * z).mean(axis=0)
    return out


Forecasts = dict[str, list[NDArray[Any]]]
"""name -> the forecast popularity [layers, experts] at each check."""


def generate(cfg: SynthConfig, checks: list[int], interval: int, delay: int) -> tuple[NDArray[Any], Forecasts]:
    """(log [steps, layers, experts], exactly as synth_log(cfg) writes it; the forecasts at each check)."""
    proc = _Popularity(cfg)
    rng = np.random.default_rng(1)
    log = np.empty((cfg.steps, cfg.layers, cfg.experts), dtype=np.int64)
    forecasts: Forecasts = {"causal oracle": [], "regime mean": []}
    for s in range(cfg.steps):
        if s in checks:  # the state that wrote step s - 1: all a check at s could know, and more
            serve = np.linspace(delay + 1, interval + 1, POINTS)  # steps s + delay .. s + interval from s - 1
            forecasts["causal oracle"].append(expected_popularity(proc, serve, rng))
            forecasts["regime mean"].append(regime_mean(proc, rng))
        log[s] = proc.sample(proc.next())
    return log, forecasts


def realized_lb(log: NDArray[Any], placements: list[Placement], starts: list[int]) -> NDArray[np.float64]:
    """lb [steps, layers] of placements[k] serving steps starts[k] .. starts[k + 1] - 1 (the last to the end)."""
    out = np.empty(log.shape[:2])
    bounds = [*starts, log.shape[0]]
    for p, lo, hi in zip(placements, bounds, bounds[1:], strict=False):
        for s in range(lo, hi):
            g = gpu_loads(log[s], p.phy2log, p.slots_per_gpu, p.shares)
            out[s] = g.max(axis=1) / g.mean(axis=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--interval", type=int, default=1000)
    args = parser.parse_args()
    sched = Schedule(window=args.window, interval=args.interval)
    checks = list(range(sched.first_position, args.steps, args.interval))
    cluster = Cluster(np.full(GPUS, SLOTS))
    start = checks[0] + sched.delay
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], hw, hw.nvlink_bandwidth)
    migration = MigrationSpec(hw.nvlink_bandwidth, hbm_bw=hw.hbm_bandwidth)
    replays = (("periodic greedy", "greedy", "periodic"), ("default (incremental, cost)", "incremental", "cost"))
    for name, cfg in synth_configs(args.steps, args.layers, seed=0).items():
        log, forecasts = generate(cfg, checks, args.interval, sched.delay)
        rows: dict[str, NDArray[np.float64]] = {}
        for label, loads in forecasts.items():
            placements = [solve(f, cluster, solver="greedy").placement for f in loads]
            rows[label] = realized_lb(log, placements, [c + sched.delay for c in checks])[start:]
        ends = [*checks[1:], args.steps]
        sums = [log[lo:hi].sum(axis=0, dtype=np.float64) for lo, hi in zip(checks, ends, strict=True)]
        hindsight = realized_lb(log, [solve(s, cluster, solver="greedy").placement for s in sums], checks)[start:]
        for label, solver, trigger in replays:
            res = replay(log, cluster, schedule=Schedule(window=args.window, interval=args.interval, trigger=trigger),
                         solver=solver, cost=cost, migration=migration, oracle_every=0, collect=True)  # fmt: skip
            assert res.steps is not None
            rows[label] = res.steps.lb[start:]
            gap = float(np.abs(res.steps.hindsight_lb[start:] - hindsight).max())
            if gap > 1e-6:  # the replay evaluates in float32
                raise SystemExit(f"{name}: this script's hindsight differs from the replay's by {gap:g}")
        h = float(hindsight.mean())
        print(f"\n{name}: {args.steps:,} steps x {args.layers} layers x 256 experts; EP{GPUS}, {GPUS * SLOTS} slots; "
              f"checks every {args.interval} steps from {checks[0]}, window {args.window}; "
              f"lb over steps {start}..{args.steps - 1}")  # fmt: skip
        print(f"  {'placement served over each interval':<40}{'lb':>8}{'/hindsight':>12}")
        for label, lb in rows.items():
            print(f"  {label:<40}{lb.mean():>8.4f}{lb.mean() / h:>12.4f}")
        print(f"  {'hindsight (the interval summed)':<40}{h:>8.4f}{1.0:>12.4f}")

if __name__ == "__main__":
    main()
