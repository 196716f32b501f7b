"""Exact solver vs greedy vs lower bound on DeepSeek-V3-shaped windows.

Prints, per EP configuration (58 layers x 256 experts; EP32 with 288 slots, EP64 with 320):
  * per-layer lb (max GPU load / mean) of greedy, the MILP at each time limit, and the bound,
    as median and max over layers, with the MILP's wall time per layer;
  * for a drift between two windows: weights copied (moves) by a fresh greedy placement
    (relabelled to the current one) vs the migration-aware MILP at lb within 1 %;
  * the weighted-share model's lb against the uniform one.

Loads: a real window from fixtures/ when present (SGLang's published DeepSeek-V3 expert
counts), else a deterministic synthetic one with the hottest expert about 10x the mean.

    python benchmarks/milp.py                 # everything (about 10 minutes on 2 cores)
    python benchmarks/milp.py --layers 8      # a quick subset
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from solvers.bounds import lower_bound
from solvers.greedy import solve_greedy
from solvers.migration import count_moves, relabel_gpus
from solvers.milp import available_cores, lp_shares, max_gpu_loads, solve_milp

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WINDOW = FIXTURES / "sglang6017-dsv3-prefill-in4096.json"
CONFIGS = {"EP32/288": (32, 288), "EP64/320": (64, 320)}


def synthetic_window(
    layers: int = 58, experts: int = 256, hot_ratio: float = 10.0, seed: int = 0
) -> NDArray[np.float64]:
    """Deterministic [layers, experts] token counts, hottest expert ``hot_ratio`` x the mean."""
    rng = np.random.default_rng(seed)
    out = np.empty((layers, experts))
    for layer in range(layers):
        base = rng.lognormal(0.0, 1.0, size=experts)
        lo, hi = 0.0, 4.0  # exponent that makes max / mean == hot_ratio
        for _ in range(60):
            mid = (lo + hi) / 2
            skewed = base**mid
            lo, hi = (mid, hi) if skewed.max() / skewed.mean() < hot_ratio else (lo, mid)
        out[layer] = np.round(base**lo / (base**lo).sum() * 8 * 16384)
    return out


def load_window(path: Path | None, synthetic: bool) -> tuple[NDArray[np.float64], str]:
    if not synthetic and path is not None and path.exists():
        data = json.loads(path.read_text())
        return np.asarray(data["loads"], dtype=np.float64), path.name
    return synthetic_window(), "synthetic (lognormal, hottest = 10x mean)"


def lb_of(objective: NDArray[np.float64], loads: NDArray[np.float64], num_gpus: int) -> NDArray[np.float64]:
    return np.asarray(objective / (loads.sum(axis=1) / num_gpus))


def stats(values: NDArray[np.float64], fmt: str = "{:.5f}") -> str:
    return f"median {fmt.format(float(np.median(values)))}  max {fmt.format(float(np.max(values)))}"


def excess_ratio(better: NDArray[np.float64], worse: NDArray[np.float64]) -> str:
    """Median of (lb - 1) of ``better`` over that of ``worse``: how much imbalance is left."""
    worse_excess = float(np.median(worse - 1))
    if worse_excess <= 0:
        return "n/a"
    return f"{float(np.median(better - 1)) / worse_excess:.2f}"


def balance(loads: NDArray[np.float64], limits: list[float], processes: int | None) -> None:
    for name, (num_gpus, num_slots) in CONFIGS.items():
        slots = np.full(num_gpus, num_slots // num_gpus, dtype=np.int64)
        greedy = lb_of(max_gpu_loads(loads, solve_greedy(loads, slots), slots), loads, num_gpus)
        bound = lb_of(lower_bound(loads, slots, split="uniform"), loads, num_gpus)
        print(f"\n== {name}: {loads.shape[0]} layers x {loads.shape[1]} experts, {slots[0]} slots per GPU")
        print(f"  greedy        lb {stats(greedy)}")
        print(f"  bound         lb {stats(bound)}")
        for limit in limits:
            result = solve_milp(loads, slots, time_limit_s=limit, threads=processes)
            milp = result.lb
            statuses = {s: result.status.count(s) for s in sorted(set(result.status))}
            print(
                f"  milp {limit:>4.1f} s    lb {stats(milp)}   wall/layer {stats(result.wall_ms, '{:.0f}')} ms"
                f"   total {result.total_wall_ms / 1e3:.1f} s   {statuses}"
            )
            print(
                f"                (lb - 1) milp / greedy, median: {excess_ratio(milp, greedy)};"
                f" milp <= greedy on {int(np.sum(milp <= greedy + 1e-12))}/{milp.size} layers;"
                f" median gap to bound {float(np.median(result.gap)) * 100:.3f} %"
            )


def migration(loads: NDArray[np.float64], limit: float, processes: int | None, seed: int = 1) -> None:
    """Current placement: greedy on the window; new window: the same loads drifted ~20 %
    per expert (lognormal, sigma 0.2), a plausible change between two rebalancing windows."""
    rng = np.random.default_rng(seed)
    drifted = np.round(loads * rng.lognormal(0.0, 0.2, size=loads.shape))
    for name, (num_gpus, num_slots) in CONFIGS.items():
        slots = np.full(num_gpus, num_slots // num_gpus, dtype=np.int64)
        current = solve_greedy(loads, slots)
        fresh = relabel_gpus(solve_greedy(drifted, slots), current, slots)
        fresh_moves = count_moves(fresh, current, slots)
        fresh_lb = lb_of(max_gpu_loads(drifted, fresh, slots), drifted, num_gpus)
        stay_lb = lb_of(max_gpu_loads(drifted, current, slots), drifted, num_gpus)
        result = solve_milp(drifted, slots, time_limit_s=limit, threads=processes, current_phy2log=current)
        assert result.moves is not None
        print(f"\n== migration {name}: drift sigma 0.2, MILP {limit:.1f} s per layer, slack 1 %")
        print(f"  keep current  lb {stats(stay_lb)}   moves 0")
        print(
            f"  fresh greedy  lb {stats(fresh_lb)}   moves median {np.median(fresh_moves):.0f}"
            f"  total {fresh_moves.sum()}"
        )
        print(
            f"  milp migrate  lb {stats(result.lb)}   moves median {np.median(result.moves):.0f}"
            f"  total {result.moves.sum()}"
        )
        ratio = fresh_moves.sum() / max(1, result.moves.sum())
        print(f"  fresh greedy / migration-aware moves: {ratio:.1f}x  (wall {result.total_wall_ms / 1e3:.1f} s)")


def weighted(loads: NDArray[np.float64], limit: float, processes: int | None) -> None:
    """Two views: LP shares on the uniform MILP's own placement (what shares alone buy,
    free of run-to-run noise), and a separate weighted solve."""
    for name, (num_gpus, num_slots) in CONFIGS.items():
        slots = np.full(num_gpus, num_slots // num_gpus, dtype=np.int64)
        uniform = solve_milp(loads, slots, time_limit_s=limit, threads=processes)
        gpu = np.repeat(np.arange(num_gpus), slots)
        reshared = np.empty(loads.shape[0])
        for layer in range(loads.shape[0]):
            member = np.zeros((loads.shape[1], num_gpus), dtype=bool)
            member[uniform.phy2log[layer], gpu] = True
            share_eg = lp_shares(loads[layer], member)
            assert share_eg is not None
            reshared[layer] = float((loads[layer] @ share_eg).max())
        reshared_lb = lb_of(reshared, loads, num_gpus)
        shares = solve_milp(loads, slots, time_limit_s=limit, threads=processes, split="weighted")
        weighted_bound = lb_of(lower_bound(loads, slots, split="weighted"), loads, num_gpus)
        print(f"\n== weighted shares {name}, {limit:.1f} s per layer")
        print(f"  uniform              lb {stats(uniform.lb)}")
        print(
            f"  same placement + LP  lb {stats(reshared_lb)}"
            f"   (lb - 1) vs uniform: {excess_ratio(reshared_lb, uniform.lb)}"
        )
        print(
            f"  weighted solve       lb {stats(shares.lb)}   (lb - 1) vs uniform: {excess_ratio(shares.lb, uniform.lb)}"
        )
        print(f"  weighted bound       lb {stats(weighted_bound)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="first N layers only (default: all)")
    parser.add_argument("--limits", default="1,5", help="per-layer time limits, seconds (default: 1,5)")
    parser.add_argument("--migration-limit", type=float, default=2.0, help="per-layer limit for migration")
    parser.add_argument("--weighted-limit", type=float, default=1.0, help="per-layer limit for weighted vs uniform")
    parser.add_argument("--window", type=Path, default=WINDOW, help="JSON load window with key 'loads'")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic window")
    parser.add_argument("--processes", type=int, default=None, help="layers solved at once (default: cores)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: balance,migration,weighted")
    args = parser.parse_args()

    loads, source = load_window(args.window, args.synthetic)
    if args.layers:
        loads = loads[: args.layers]
    hot = loads.max(axis=1) / loads.mean(axis=1)
    print(f"loads: {source}, {loads.shape[0]} layers, hottest/mean median {np.median(hot):.1f} max {hot.max():.1f}")
    print(f"cores: {available_cores()}, processes: {args.processes or 'default'}")
    skip = set(args.skip.split(","))
    started = time.time()
    if "balance" not in skip:
        balance(loads, [float(x) for x in args.limits.split(",")], args.processes)
    if "migration" not in skip:
        migration(loads, args.migration_limit, args.processes)
    if "weighted" not in skip:
        weighted(loads, args.weighted_limit, args.processes)
    print(f"\ntotal {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
