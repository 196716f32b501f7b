"""Rebalancing policies side by side on drifting logs: realized lb, hindsight ratio, moves, total time.

Run: python benchmarks/rebalance.py [--steps 3000] [--layers 8] [--milp-layers 4] [--seeds 5]
                                    [--migration overlap|blocking] [--stall-ms MS]

Logs (EP32, 9 slots per GPU = 288, DeepSeek-V3 on B200, all-to-all and weight copies over NVLink, copies
overlapping serving with a quarter of the link, or with --migration blocking stalling it; --stall-ms: a fixed
stall at every rebalance besides the copies, `--migration-stall-ms`, given for all 58 MoE layers of DeepSeek-V3
and scaled to the layers a log simulates, so it keeps its share of the serving time):
- drift: `eplb synth` defaults (slow drift of each expert's popularity), --steps x --layers x 256;
- shifts: the same with regime shifts (a new hot set) at 1/3 and 2/3 of the log;
- sglang6017: the two shipped real DeepSeek-V3 windows (fixtures/sglang6017-*.json, prefill then decode)
  as consecutive intervals of --steps / 2 steps each, every step drawn from its window's expert
  distribution (4,096 tokens x top-8).
Policies, each a replay with checks every --interval steps on the --window steps before (no lookahead):
periodic fresh greedy (GPU relabelling against the serving placement); vLLM-style (fresh greedy, no GPU
relabelling: an expert keeps its slot only when it stays on its GPU); the migration-aware MILP at 1 s per
layer (periodic, first --milp-layers layers only: it is slow); incremental with the cost trigger (the
move budget that pays for itself); robust (greedy refined over 4 sub-windows, periodic). Columns:
realized lb (mean over steps and layers), hindsight ratio (realized lb / the hindsight row's), expert
copies and the fraction of all slots per rebalance, GB per rebalance, total simulated time (MoE time of
every step + migration charges) next to static, no-EPLB and hindsight. The tables are of seed 0; then, over
--seeds draws of every log (seeds 0 .. N-1: the synthetic logs and the real windows' sampled steps), the median
[min, max] of each policy's total time / periodic greedy's and realized lb / hindsight's, and on how many seeds
the default (incremental, cost trigger) is below periodic greedy, static and no EPLB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from eplb.cost.migration import MigrationSpec
from eplb.replay import Schedule, replay
from eplb.solve import Cluster, CostSetup
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SynthConfig, synth_log
from solvers import registry
from solvers.greedy import solve_greedy
from solvers.migration import arrange_slots
from solvers.registry import Capabilities, Options, Problem, Solution, Solver

ROOT = Path(__file__).resolve().parents[1]
GPUS, SLOTS, TOKENS, TOP_K = 32, 9, 4096, 8
LAYERS = MODEL_PRESETS["deepseek-v3"].num_moe_layers  # --stall-ms is for all of them


class VllmStyle(Solver):
    """Fresh greedy, no GPU relabelling: vLLM's policy with its old placement keeps an expert's slot only
    when the expert stays on the same GPU (slot order inside a GPU moves no weights)."""

    name: ClassVar[str] = "vllm-style"
    summary: ClassVar[str] = "fresh greedy without GPU relabelling (benchmark baseline)"
    capabilities: ClassVar[Capabilities] = Capabilities(current=True, aligned=True)

    def solve(self, problem: Problem, options: Options) -> Solution:
        fresh = solve_greedy(problem.loads, problem.slots_per_gpu)
        if problem.current_phy2log is None:
            return Solution(fresh)
        return Solution(arrange_slots(fresh, problem.current_phy2log, problem.slots_per_gpu))


def real_log(steps: int, seed: int = 0) -> NDArray[np.int64]:
    """The sglang6017 prefill then decode windows as two intervals of steps // 2 sampled steps."""
    rng = np.random.default_rng(seed)
    parts = []
    for name in ("sglang6017-dsv3-prefill-in4096.json", "sglang6017-dsv3-decode-in1000out1000.json"):
        loads = np.asarray(json.loads((ROOT / "fixtures" / name).read_text())["loads"], dtype=np.float64)
        p = loads / loads.sum(axis=1, keepdims=True)
        parts.append(rng.multinomial(TOKENS * TOP_K, p, size=(steps // 2, p.shape[0])))
    return np.concatenate(parts).astype(np.int64)


def policies(milp_layers: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("periodic greedy", {"solver": "greedy", "trigger": "periodic"}),
        ("vLLM-style", {"solver": "vllm-style", "trigger": "periodic"}),
        (f"MILP 1 s/layer ({milp_layers} layers)", {"solver": "milp", "trigger": "periodic", "time_limit_s": 1.0,
                                                     "layers": milp_layers}),
        ("incremental, cost trigger", {"solver": "incremental", "trigger": "cost"}),
        ("robust greedy (4 windows)", {"solver": "greedy", "trigger": "periodic", "robust_windows": 4}),
    ]  # fmt: skip


def run_policy(log: NDArray[Any], cost: CostSetup, window: int, interval: int, p: dict[str, Any],
               migration: MigrationSpec) -> dict[str, Any]:
    """One policy's replay of `log` (its first p["layers"] layers when given); migration's fixed stall is for all
    LAYERS and is scaled to the layers replayed."""
    layers = p.get("layers")
    counts = log[:, :layers] if layers else log
    migration = dataclasses.replace(migration, fixed_stall_s=migration.fixed_stall_s * counts.shape[1] / LAYERS)
    sched = Schedule(window=window, interval=interval, trigger=p["trigger"], robust_windows=p.get("robust_windows"))
    t = time.perf_counter()
    res = replay(counts, Cluster(np.full(GPUS, SLOTS)), schedule=sched, solver=p["solver"], cost=cost,
                 migration=migration, time_limit_s=p.get("time_limit_s"), oracle_every=0)
    s = res.summary
    rb = s["rebalances"]
    n = max(rb["count"], 1)
    return {
        "results": s["results"],
        "rebalances": rb["count"],
        "checks": rb["checks"],
        "moves_per_rebalance": rb["moves"] / n,
        "slots_fraction": rb["slots_moved_fraction"] or 0.0,
        "gb_per_rebalance": (rb["bytes_moved"] or 0.0) / n / 1e9,
        "wall_s": time.perf_counter() - t,
        "layers": counts.shape[1],
    }


def synth_configs(steps: int, layers: int, seed: int) -> dict[str, SynthConfig]:
    """The synthetic benchmark logs: `eplb synth` defaults (drift), and with regime shifts at 1/3 and 2/3."""
    base = SynthConfig(steps=steps, layers=layers, experts=256, top_k=TOP_K, tokens=TOKENS, seed=seed)
    return {"drift": base, "shifts": SynthConfig(**{**base.__dict__, "shift_at": (steps // 3, 2 * steps // 3)})}


def logs_of(steps: int, layers: int, seed: int) -> dict[str, NDArray[Any]]:
    """The three benchmark logs for one seed (synthetic draws and the real windows' sampled steps)."""
    logs = {name: synth_log(cfg) for name, cfg in synth_configs(steps, layers, seed).items()}
    return {**logs, "sglang6017": real_log(steps, seed)}


def print_table(name: str, log: NDArray[Any], args: argparse.Namespace, rows: dict[str, Any]) -> None:
    """One log's side-by-side table (one seed)."""
    print(f"\n{name}: {log.shape[0]:,} steps x {log.shape[1]} layers x {log.shape[2]} experts; EP{GPUS}, "
          f"{GPUS * SLOTS} slots; checks every {args.interval} steps, window {args.window}; copies {args.migration}"
          + (f", {args.stall_ms * log.shape[1] / LAYERS:.4g} ms stall per rebalance" if args.stall_ms else "")
          )  # fmt: skip
    print(f"  {'policy':<30}{'lb':>7}{'/hindsight':>11}{'rebal.':>8}{'copies/rb':>11}{'slots/rb':>10}"
          f"{'GB/rb':>8}{'total s':>9}{'vs greedy':>10}{'wall s':>8}")  # fmt: skip
    greedy_total = rows["periodic greedy"]["results"]["replay"]["total_time_s"]
    for label, r in rows.items():
        if label == "_baselines":
            continue
        res = r["results"]
        total = res["replay"]["total_time_s"]
        vs = "" if r["layers"] != log.shape[1] else f"{total / greedy_total:.4f}"
        print(f"  {label:<30}{res['replay']['lb_mean']:>7.3f}{res['replay']['hindsight_ratio']:>11.4f}"
              f"{r['rebalances']:>4}/{r['checks']:<3}{r['moves_per_rebalance']:>11,.0f}{r['slots_fraction']:>10.1%}"
              f"{r['gb_per_rebalance']:>8.1f}{total:>9.3f}{vs:>10}{r['wall_s']:>8.1f}")  # fmt: skip
    for b, title in BASELINE_ROWS:
        res = rows["_baselines"][b]
        print(f"  {title:<30}{res['lb_mean']:>7.3f}{'':>11}{'':>8}{'':>11}{'':>10}{'':>8}"
              f"{res['total_time_s']:>9.3f}{res['total_time_s'] / greedy_total:>10.4f}")  # fmt: skip


BASELINE_ROWS = (("static", "static (first placement kept)"), ("no_eplb", "no EPLB"),
                 ("hindsight", "hindsight (per interval)"))  # fmt: skip


def print_over_seeds(everything: dict[int, dict[str, Any]]) -> None:
    """Per log and policy, over all seeds: total time / periodic greedy's and realized lb / hindsight's,
    median [min, max], and on how many seeds the default is below periodic greedy, static and no EPLB."""
    seeds = sorted(everything)
    print(f"\nover {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}): median [min, max] of total time / periodic greedy's "
          "(full-model policies) and of realized lb / hindsight's")  # fmt: skip
    for name in everything[seeds[0]]:
        print(f"  {name:<32}{'total / greedy':>28}{'lb / hindsight':>28}")
        per_seed = [everything[s][name] for s in seeds]
        labels = [k for k in per_seed[0] if k != "_baselines"] + [t for _, t in BASELINE_ROWS]
        for label in labels:
            ratios, hs = [], []
            for rows in per_seed:
                greedy = rows["periodic greedy"]["results"]["replay"]["total_time_s"]
                key = next((b for b, t in BASELINE_ROWS if t == label), None)
                if key is not None:
                    ratios.append(rows["_baselines"][key]["total_time_s"] / greedy)
                    continue
                res = rows[label]["results"]["replay"]
                hs.append(res["hindsight_ratio"])
                if rows[label]["layers"] == rows["periodic greedy"]["layers"]:
                    ratios.append(res["total_time_s"] / greedy)
            total = _median_range(ratios, ".4f") if ratios else ""
            print(f"    {label:<30}{total:>28}{_median_range(hs, '.4f') if hs else '':>28}")
        default = "incremental, cost trigger"
        for other in ("periodic greedy", *(b for b, _ in BASELINE_ROWS if b != "hindsight")):
            below = sum(_total(rows, default) < _total(rows, other) for rows in per_seed)
            print(f"    {default} below {other}: {below} of {len(seeds)} seeds")


def _total(rows: dict[str, Any], label: str) -> float:
    if label in rows:
        return float(rows[label]["results"]["replay"]["total_time_s"])
    return float(rows["_baselines"][label]["total_time_s"])


def _median_range(values: list[float], fmt: str) -> str:
    return f"{np.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--window", type=int, default=300)
    parser.add_argument("--interval", type=int, default=500)
    parser.add_argument("--milp-layers", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=5,
                        help="logs drawn with seeds 0 .. N-1 (the first seed's tables are printed in full)")
    parser.add_argument("--migration", choices=("overlap", "blocking"), default="overlap",
                        help="copies overlap serving (a quarter of the link) or stall it")
    parser.add_argument("--stall-ms", type=float, default=0.0,
                        help="fixed stall per rebalance of all 58 layers, ms (default 0; scaled to a log's layers)")
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args()
    registry.register("vllm-style", "__main__:VllmStyle")
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], hw, hw.nvlink_bandwidth)
    migration = MigrationSpec(hw.nvlink_bandwidth, overlap=args.migration == "overlap", hbm_bw=hw.hbm_bandwidth,
                              fixed_stall_s=args.stall_ms / 1e3)  # for all LAYERS; run_policy scales it to a replay's
    migration.check()
    everything: dict[int, dict[str, Any]] = {}
    for seed in range(args.seeds):
        everything[seed] = {}
        for name, log in logs_of(args.steps, args.layers, seed).items():
            rows: dict[str, Any] = {}
            for label, p in policies(args.milp_layers):
                rows[label] = run_policy(log, cost, args.window, args.interval, p, migration)
            res = rows["periodic greedy"]["results"]
            rows["_baselines"] = {k: res[k] for k in ("no_eplb", "static", "hindsight")}
            everything[seed][name] = rows
            if seed == 0:
                print_table(name, log, args, rows)
    print_over_seeds(everything)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=float) + "\n")

if __name__ == "__main__":
    main()
