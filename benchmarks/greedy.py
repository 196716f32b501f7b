"""Greedy solver and DeepSeek drop-in: speed next to baselines measured in the same run, and lb quality.

Run: python benchmarks/greedy.py [--repeats N]
Speed: for each case, median and range (ms) over N rounds; in each round every implementation runs once, in
turn, so a busy machine slows all of them alike. Implementations: ours (`solve_greedy`, compiled kernels,
swap refinement to convergence; `rebalance_experts`, DeepSeek's algorithm with identical results), the
previous numpy implementation of the same functions (loaded from git, commit PREVIOUS), and a plain Python
loop over layers (replicate, then heaviest-first into the least-loaded GPU with room) for greedy.
Quality: lb (max GPU load / mean) per layer on every shipped real window (the embedded DeepSeek-V3 window and
fixtures/sglang6017-*.json), median and range, for ours, the previous numpy greedy and DeepSeek's algorithm,
with the number of layers where ours is worse than DeepSeek's.
Count search: on a Mixtral-shaped window (8 experts, few slots), greedy with and without its replica-count search
next to the MILP's optimum.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import Placement
from solvers.greedy import rebalance_experts, solve_greedy

ROOT = Path(__file__).resolve().parents[1]
PREVIOUS = "f50e3b8"  # last commit with the numpy-only solvers/greedy.py
Solve = Callable[[], NDArray[np.int64]]


def drop_in_phy2log(rebalance: Callable[..., Any], loads: NDArray[np.float64], groups: int,
                    nodes: int) -> NDArray[np.int64]:
    """The phy2log of a DeepSeek-style `rebalance_experts` at EP32 / 288 slots."""
    phy2log: NDArray[np.int64] = rebalance(loads, 288, groups, nodes, 32)[0]
    return phy2log


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


def skewed(layers: int, experts: int, seed: int) -> NDArray[np.float64]:
    """Synthetic loads with the hottest expert about 10x the mean (lognormal popularity)."""
    rng = np.random.default_rng(seed)
    loads = rng.lognormal(0.0, 1.0, (layers, experts))
    return np.asarray(np.round(loads / loads.mean(axis=1, keepdims=True) * 1000), dtype=np.float64)


def topk_window(layers: int, experts: int, top_k: int, tokens: int, seed: int) -> NDArray[np.float64]:
    """Token counts [layers, experts] of a window where each of `tokens` tokens picks top_k distinct experts
    (Gumbel top-k on a per-layer Pareto(1) popularity, seeded): the Mixtral-shaped windows of the count search."""
    rng = np.random.default_rng(seed)
    out = np.zeros((layers, experts))
    for layer in range(layers):
        logp = np.log(rng.pareto(1.0, experts) + 0.05)
        top = np.argpartition(-(logp[None, :] + rng.gumbel(size=(tokens, experts))), top_k, axis=1)[:, :top_k]
        out[layer] = np.bincount(top.ravel(), minlength=experts)
    return out


def count_search_rows(results: list[dict[str, Any]], repeats: int) -> None:
    """Mixtral-shaped windows (32 layers x 8 experts, top-2, 8192 tokens, seed 1): greedy with and without the
    replica-count search (`solvers.greedy.search_counts`) against the MILP's optimum (CP-SAT, 2 s per layer, one
    thread: the status says which layers it proved), lb mean and max, and greedy's median ms per window (the two
    run in turn, round after round)."""
    import solvers.greedy as greedy_module
    from solvers.milp import solve_milp

    def without_search(loads: NDArray[np.float64], slots: NDArray[np.int64]) -> NDArray[np.int64]:
        saved = greedy_module.COUNT_SEARCH_SLOTS
        greedy_module.COUNT_SEARCH_SLOTS = 0
        try:
            return solve_greedy(loads, slots)
        finally:
            greedy_module.COUNT_SEARCH_SLOTS = saved

    loads = topk_window(32, 8, 2, 8192, 1)
    print("\ncount search: Mixtral-shaped window (32 x 8, top-2), lb mean / max; greedy median ms of the window")
    print(f"{'EP x slots':<12}{'greedy':>18}{'no count search':>18}{'MILP':>18}{'proven':>9}{'ms':>8}"
          f"{'ms, no search':>15}")
    for gpus, per_gpu in ((4, 3), (8, 2), (16, 1)):
        slots = np.full(gpus, per_gpu)
        times = interleaved({"on": partial(solve_greedy, loads, slots), "off": partial(without_search, loads, slots)},
                            {"on": repeats, "off": repeats})  # fmt: skip
        ours = lb_of(loads, solve_greedy(loads, slots), slots)
        rule = lb_of(loads, without_search(loads, slots), slots)
        milp = solve_milp(loads, slots, time_limit_s=2.0, threads=1)
        best = lb_of(loads, milp.phy2log, slots)
        proven = sum(status == "optimal" for status in milp.status)
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        cells = [f"{c.mean():.4f} / {c.max():.4f}" for c in (ours, rule, best)]
        print(f"{f'{gpus} x {per_gpu}':<12}{cells[0]:>18}{cells[1]:>18}{cells[2]:>18}{f'{proven}/32':>9}{on:>8.2f}"
              f"{off:>15.2f}")
        results.append({"case": "count search mixtral-shaped 32x8 top-2", "gpus": gpus, "slots_per_gpu": per_gpu,
                        "lb_greedy": [float(ours.mean()), float(ours.max())],
                        "lb_no_count_search": [float(rule.mean()), float(rule.max())],
                        "lb_milp": [float(best.mean()), float(best.max())], "milp_proven": proven,
                        "median_ms": round(on, 3), "median_ms_no_count_search": round(off, 3)})
    print("\ncount search: random small layers (24 per shape, Pareto(1) loads + 1, seed 2026) on the layers the MILP"
          " proves optimal: layers at the optimum, busiest GPU over the optimum mean / max")
    print(f"{'shape':<16}{'proven':>8}{'greedy at opt':>15}{'ratio':>18}{'no search at opt':>18}{'ratio':>18}")
    rng = np.random.default_rng(2026)
    for experts, gpus, per_gpu in ((8, 4, 3), (8, 8, 2), (12, 8, 2)):
        small = rng.pareto(1.0, (24, experts)) * 100 + 1
        slots = np.full(gpus, per_gpu)
        milp = solve_milp(small, slots, time_limit_s=2.0, threads=1)
        proved = np.array([status == "optimal" for status in milp.status])
        optimum = np.asarray(milp.objective)[proved]
        row: dict[str, Any] = {"case": "count search random small layers", "experts": experts, "gpus": gpus,
                               "slots_per_gpu": per_gpu, "milp_proven": int(proved.sum())}
        cells = []
        for key, phy2log in (("greedy", solve_greedy(small, slots)), ("no_count_search", without_search(small, slots))):
            ratio = lb_of(small, phy2log, slots)[proved] * small[proved].sum(axis=1) / gpus / optimum
            at = int(np.sum(ratio <= 1 + 1e-9))
            cells += [f"{at}", f"{ratio.mean():.4f} / {ratio.max():.4f}"]
            row[f"at_optimum_{key}"], row[f"ratio_{key}"] = at, [float(ratio.mean()), float(ratio.max())]
        print(f"{f'{experts} on {gpus} x {per_gpu}':<16}{int(proved.sum()):>8}{cells[0]:>15}{cells[1]:>18}"
              f"{cells[2]:>18}{cells[3]:>18}")
        results.append(row)


def previous_greedy() -> ModuleType | None:
    """solvers/greedy.py (and the torch_order.py it imports) as of commit PREVIOUS, or None without git."""
    try:
        sources = {
            name: subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{PREVIOUS}:solvers/{name}.py"],
                capture_output=True, text=True, check=True,
            ).stdout
            for name in ("greedy", "torch_order")
        }
    except (OSError, subprocess.CalledProcessError):
        return None
    folder = Path(tempfile.mkdtemp(prefix="eplb-previous-"))
    (folder / "previous_torch_order.py").write_text(sources["torch_order"])
    (folder / "previous_greedy.py").write_text(
        sources["greedy"].replace("from solvers.torch_order import", "from previous_torch_order import")
    )
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("previous_greedy", folder / "previous_greedy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interleaved(runs: dict[str, Solve], repeats: dict[str, int]) -> dict[str, list[float]]:
    """Wall times (ms) of each implementation, run in turn round after round (after one warm-up call each)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(max(repeats.values())):
        for name, fn in runs.items():
            if round_ < repeats[name]:
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1000)
    return times


def windows() -> dict[str, NDArray[np.float64]]:
    """Every shipped real window: the embedded one and fixtures/sglang6017-*.json."""
    found = {"embedded dsv3-prefill-in1024": read_window(None).loads}
    for path in sorted((ROOT / "fixtures").glob("sglang6017-*.json")):
        found[path.stem.replace("sglang6017-dsv3-", "sglang6017 ")] = read_window(path).loads
    return found


def lb_of(loads: NDArray[np.float64], phy2log: NDArray[np.int64], slots: NDArray[np.int64]) -> NDArray[np.float64]:
    return np.asarray(balance(loads, Placement(phy2log, slots, loads.shape[1])).lb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    previous = previous_greedy()
    if previous is None:
        print(f"note: git or commit {PREVIOUS} not available: no previous-implementation rows")
    real = windows()
    results: list[dict[str, Any]] = []

    def speed(case: str, runs: dict[str, Solve], repeats: dict[str, int]) -> None:
        times = interleaved(runs, repeats)
        base = statistics.median(times["ours"])
        for impl, ts in times.items():
            med = statistics.median(ts)
            print(f"{case:<66}{impl:<23}{med:>10.2f}{min(ts):>9.2f}{max(ts):>9.2f}{med / base:>10.1f}x")
            results.append({"case": case, "impl": impl, "median_ms": round(med, 3), "min_ms": round(min(ts), 3),
                            "max_ms": round(max(ts), 3), "slower_than_ours": round(med / base, 2)})

    print(f"speed, ms over {args.repeats} interleaved rounds")
    print(f"{'case':<66}{'implementation':<23}{'median':>10}{'min':>9}{'max':>9}{'vs ours':>11}")
    slow = max(1, args.repeats // 10)
    for name, loads in real.items():
        for gpus, per_gpu in ((32, 9), (64, 5)):
            slots = np.full(gpus, per_gpu)
            runs: dict[str, Solve] = {"ours": partial(solve_greedy, loads, slots)}
            if previous is not None:
                runs["previous numpy"] = partial(previous.solve_greedy, loads, slots)
            runs["plain loop (no swaps)"] = partial(loop_greedy, loads, per_gpu, gpus)
            speed(f"solve_greedy {name} EP{gpus}/{gpus * per_gpu}", runs,
                  {"ours": args.repeats, "previous numpy": args.repeats, "plain loop (no swaps)": slow})
    synthetic = skewed(61, 384, 0)
    slots = np.full(128, 4)
    runs = {"ours": lambda: solve_greedy(synthetic, slots)}
    if previous is not None:
        runs["previous numpy"] = lambda: previous.solve_greedy(synthetic, slots)
    runs["plain loop (no swaps)"] = lambda: loop_greedy(synthetic, 4, 128)
    speed("solve_greedy 61x384 synthetic EP128/512", runs,
          {"ours": args.repeats, "previous numpy": args.repeats, "plain loop (no swaps)": slow})
    for name, loads in real.items():
        for label, groups, nodes in (("global", 1, 1), ("8g/4n", 8, 4)):
            runs = {"ours": partial(drop_in_phy2log, rebalance_experts, loads, groups, nodes)}
            if previous is not None:
                runs["previous numpy"] = partial(drop_in_phy2log, previous.rebalance_experts, loads, groups, nodes)
            speed(f"rebalance_experts {name} EP32/288 {label}", runs,
                  {"ours": args.repeats, "previous numpy": args.repeats})

    print("\nquality: lb per layer, median [min, max]; 'worse' = layers where ours > DeepSeek's")
    print(f"{'window':<36}{'EP/slots':<10}{'ours':>27}{'previous numpy':>27}{'DeepSeek':>27}{'worse':>7}")
    for name, loads in real.items():
        for gpus, per_gpu in ((32, 9), (64, 5)):
            slots = np.full(gpus, per_gpu)
            ours = lb_of(loads, solve_greedy(loads, slots), slots)
            deepseek = lb_of(loads, rebalance_experts(loads, gpus * per_gpu, 1, 1, gpus)[0], slots)
            prev = lb_of(loads, previous.solve_greedy(loads, slots), slots) if previous is not None else None
            cells = [ours, prev, deepseek]
            text = ["n/a" if c is None else f"{np.median(c):.5f} [{c.min():.5f}, {c.max():.5f}]" for c in cells]
            worse = int(np.sum(ours > deepseek + 1e-12))
            print(f"{name:<36}{f'{gpus}/{gpus * per_gpu}':<10}{text[0]:>27}{text[1]:>27}{text[2]:>27}{worse:>7}")
            results.append({"window": name, "gpus": gpus, "slots": gpus * per_gpu, "worse_than_deepseek": worse,
                            **{f"lb_{k}": None if c is None else [float(np.median(c)), float(c.min()), float(c.max())]
                               for k, c in zip(("ours", "previous", "deepseek"), cells, strict=True)}})
    count_search_rows(results, args.repeats)
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "greedy.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
