"""Replay throughput on a DeepSeek-V3-sized log: layer-steps per second, next to the previous implementations.

Run: python benchmarks/replay.py [--steps 10000] [--repeats 3] [--log FILE]

Builds (once, or reads --log) a synthetic log of 58 MoE layers x 256 experts (the default `eplb synth`
statistics, 4,096 tokens per step), then on EP32 with one redundant expert per GPU (288 slots) prints the
median over --repeats of:
- evaluation only, in memory, 256-step chunks: the lb and predicted time of four placements (replay,
  static, no EPLB, hindsight) per step and layer with the compiled pass (eplb/replay/evaluate.py,
  _evaluate.c), next to the two previous implementations measured in the same run on the same chunks:
  the per-slot compiled loop of commit COMPILED (its evaluate.py and _evaluate.c from git, the C built
  into a temporary directory; skipped without a C compiler) and the float32 batched matmul of three
  placements of commit MATMUL (loaded from git). The implementations take turns going first on each chunk,
  so none is favoured by the chunk being in cache. A second row has an expert at zero count in every
  layer-step (the zero-count path), a third runs the compiled pass on two threads;
- the whole replay (periodic greedy every 1,000 steps, window 1,000, hindsight row, no oracle);
- the oracle (greedy solved on every step's own counts), on a sample of steps, extrapolated.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eplb.io.logs import open_log, write_counts
from eplb.placement import Placement
from eplb.replay import Schedule, _evaluate, blas_threads, initial_placement, replay
from eplb.replay.evaluate import Evaluator, oracle, time_model
from eplb.solve import Cluster, CostSetup
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.synth import SynthConfig, synth_counts
from solvers.greedy import solve_greedy

LAYERS, EXPERTS, GPUS, SLOTS = 58, 256, 32, 9
COMPILED = "a570521"  # the last commit with the per-slot compiled loop (eplb/replay/evaluate.py, _evaluate.c)
MATMUL = "50efd89"  # the last commit with the matmul evaluator (eplb/replay/run.py)
ROOT = Path(__file__).resolve().parents[1]


def make_log(path: Path, steps: int) -> float:
    t = time.perf_counter()
    cfg = SynthConfig(steps=steps, layers=LAYERS, experts=EXPERTS, top_k=8, tokens=4096)
    write_counts(path, synth_counts(cfg), model="deepseek-v3", top_k=8, num_steps=steps, dtype=cfg.count_dtype)
    return time.perf_counter() - t


def git_show(commit: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def matmul_module() -> types.ModuleType:
    """The replay module as of commit MATMUL, loaded from git (its evaluator is a baseline)."""
    module = types.ModuleType("matmul_replay")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(git_show(MATMUL, "eplb/replay/run.py"), f"{MATMUL}:eplb/replay/run.py", "exec"), module.__dict__)
    return module


def compiled_module() -> types.ModuleType | None:
    """eplb/replay/evaluate.py as of commit COMPILED with its own _evaluate.c, built from git into a temporary
    directory; None without git or a C compiler."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    try:
        source, c_source = git_show(COMPILED, "eplb/replay/evaluate.py"), git_show(COMPILED, "eplb/replay/_evaluate.c")
        with tempfile.TemporaryDirectory(prefix="eplb-previous-evaluate-") as tmp:
            (Path(tmp) / "_evaluate.c").write_text(c_source)
            ext = Extension("_evaluate", [str(Path(tmp) / "_evaluate.c")], extra_compile_args=["-O3"])
            cmd = build_ext(Distribution({"name": "previous-evaluate", "ext_modules": [ext]}))
            cmd.build_lib, cmd.build_temp = tmp, str(Path(tmp) / "build")
            cmd.ensure_finalized()
            cmd.run()
            built = cmd.get_ext_fullpath("_evaluate")
            spec = importlib.util.spec_from_file_location("previous_evaluate._evaluate", built)
            assert spec is not None and spec.loader is not None
            kernel = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(kernel)  # loaded before the directory goes
    except Exception as exc:  # no git history, no compiler: the row shows no baseline
        print(f"(the {COMPILED} compiled evaluator could not be built: {exc})")
        return None
    module = types.ModuleType("previous_evaluate")
    module.__dict__["_evaluate"] = kernel
    source = source.replace("from eplb.replay import _evaluate\n", "")
    exec(compile(source, f"{COMPILED}:eplb/replay/evaluate.py", "exec"), module.__dict__)
    return module


def evaluation_rates(
    chunks: list[np.ndarray], cost: CostSetup, zero: bool, threads: int, compiled: types.ModuleType | None,
    matmul: types.ModuleType,
) -> dict[str, float]:  # fmt: skip
    """Median layer-steps/s of the new evaluator and the previous ones on the same in-memory chunks."""
    from eplb.evaluate import contiguous_placement

    slots = np.full(GPUS, SLOTS)
    window = chunks[0].sum(axis=0).astype(np.float64)
    placed = Placement(solve_greedy(window, slots), slots, EXPERTS)
    start = initial_placement(LAYERS, EXPERTS, slots)
    hind = Placement(solve_greedy(chunks[1].sum(axis=0).astype(np.float64), slots), slots, EXPERTS)
    four = [placed, start, contiguous_placement(LAYERS, EXPERTS, GPUS), hind]
    new = Evaluator(time_model(cost, GPUS), threads=threads)
    new.set_placements(four)
    runs: dict[str, Callable[[np.ndarray], object]] = {"new": new.evaluate}
    if compiled is not None:
        prev = compiled.Evaluator(time_model(cost, GPUS))
        prev.set_placements(four)
        runs["compiled"] = prev.evaluate
    old = matmul._Evaluator(LAYERS, EXPERTS, slots, cost)
    old.set_placements(placed, start)
    runs["matmul"] = old.evaluate
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    with blas_threads(1):
        for i, counts in enumerate(chunks):
            if zero:
                counts = counts.copy()
                counts[:, :, 0] = 0
            for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
                t = time.perf_counter()
                runs[name](counts)
                rates[name].append(counts.shape[0] * LAYERS / (time.perf_counter() - t))
    return {name: statistics.median(r) for name, r in rates.items()}


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
        print(f"\nlog: {info.describe()}; EP{GPUS}, {GPUS * SLOTS} slots; medians over {args.repeats} runs; "
              f"compiled pass: {_evaluate.instruction_set} loop bodies")  # fmt: skip
        compiled, matmul = compiled_module(), matmul_module()
        print(f"{'evaluation only (lb + time per step and layer)':<64}{'layer-steps/s':>15}"
              f"{COMPILED + ' compiled':>18}{'x':>6}{MATMUL + ' matmul':>16}{'x':>6}")  # fmt: skip
        for zero, threads in ((False, 1), (True, 1), (False, 2)):
            runs = [evaluation_rates(chunks, cost, zero, threads, compiled, matmul) for _ in range(args.repeats)]
            med = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            label = "  4 placements, in memory, 256-step chunks" + (", zero counts" if zero else "")
            label += ", 2 threads" if threads > 1 else ""
            prev = f"{'-':>24}"
            if "compiled" in med:
                prev = f"{med['compiled']:>18,.0f}{med['new'] / med['compiled']:>6.1f}"
            print(f"{label:<64}{med['new']:>15,.0f}{prev}{med['matmul']:>16,.0f}{med['new'] / med['matmul']:>6.1f}")
        layer_steps = (info.num_steps or 0) * LAYERS
        cluster = Cluster(np.full(GPUS, SLOTS))
        whole: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            res = replay(path, cluster, schedule=Schedule(window=1000, interval=1000), cost=cost, oracle_every=0)
            whole.append(res.summary["timing"] | {"rebalances": res.summary["rebalances"]["count"]})
        print(f"\n{'whole replay (periodic greedy, no oracle)':<64}{'seconds':>15}{'layer-steps/s':>15}")
        wall = statistics.median(r["wall_s"] for r in whole)
        print(f"{'  total':<64}{wall:>15.2f}{layer_steps / wall:>15,.0f}")
        parts = (("read_s", "  reading the log"), ("hindsight_s", "  hindsight pass (read + interval solves)"),
                 ("solve_s", f"  {whole[0]['rebalances']} rebalances (solve + relabel)"),
                 ("evaluation_s", "  evaluation"))  # fmt: skip
        for key, label in parts:
            v = statistics.median(r[key] for r in whole)
            rate = f"{layer_steps / v:,.0f}" if key == "evaluation_s" and v > 0 else ""
            print(f"{label:<64}{v:>15.2f}{rate:>15}")
        counts = chunks[0][: args.oracle_steps]
        with blas_threads(1):
            model = time_model(cost, GPUS)
            oracle(counts[:2], cluster, model)  # warm: the first call's set-up is no per-step cost
            seconds = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                oracle(counts, cluster, model)
                seconds.append(time.perf_counter() - t)
            rate = counts.shape[0] * LAYERS / statistics.median(seconds)
        print(f"{'oracle (greedy per step), ' + str(counts.shape[0]) + ' steps, extrapolated':<64}"
              f"{layer_steps / rate:>15.1f}{rate:>15,.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
