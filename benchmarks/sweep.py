"""Wall time of a fixed small sweep on the local executor vs Ray on this machine, and per-task times.

The sweep: `compare_window` of greedy and MILP (0.5 s per layer) on the shipped ESFT window's first
8 layers at EP 4, 8 and 16 (6 tasks), then `replay_logs` of a synthetic 2,000-step log (16 layers x
64 experts) cut into 4 layer ranges. Each is run on the local executor and on a local Ray started
with all this machine's CPUs (start-up timed apart). Per-task times (measured inside each task) give
the wall time W workers would take: the longest-first schedule of the measured tasks onto W workers,
plus the overhead Ray showed here per task.

    python benchmarks/sweep.py            # prints the table (CPU-bound: run it on an idle machine)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eplb.budget import spread_evenly  # noqa: E402
from eplb.executor import Executor, LocalExecutor, RayExecutor, Report, Task, _Part, _replay_part, layer_parts  # noqa: E402
from eplb.io.logs import as_log  # noqa: E402
from eplb.io.windows import read_window  # noqa: E402
from eplb.replay import Schedule  # noqa: E402
from eplb.report import _window_run, cluster_shapes, window_tasks  # noqa: E402
from eplb.solve import Cluster  # noqa: E402
from eplb.synth import SynthConfig, synth_log  # noqa: E402

FIXTURE = ROOT / "fixtures" / "esft-dsv2lite-law.json"


def _timed(arg: tuple[Callable[[Any, Report], Any], Any], report: Report) -> tuple[Any, float]:
    fn, inner = arg
    t0 = time.perf_counter()
    out = fn(inner, report)
    return out, time.perf_counter() - t0


def sweep_tasks() -> list[tuple[str, list[Task[Any]]]]:
    loads = read_window(FIXTURE).loads[:8]
    shapes = cluster_shapes(loads.shape[1], [4, 8, 16], None)
    window = [Task((_window_run, t.arg), note=t.note, cpus=t.cpus)
              for t in window_tasks(loads, shapes, ("greedy", "milp"), None, 0.5, ("lb",), None, LocalExecutor())]
    counts = synth_log(SynthConfig(steps=2000, layers=16, experts=64, top_k=6, tokens=2048, seed=1, hot_ratio=10))
    args = dict(schedule=Schedule(window=200, interval=250), solver="greedy", oracle_every=5)
    cluster = Cluster(spread_evenly(80, 16))
    replay = [Task((_replay_part, _Part(as_log(counts[:, r.start : r.stop]), None, cluster, args, False)),
                   note=f"layers {r.start}-{r.stop - 1}") for r in layer_parts(16, 4)]  # fmt: skip
    return [("compare: greedy+milp x EP4,8,16 (6 tasks)", window), ("replay: 2,000 steps x 16 layers, 4 parts", replay)]


def run(ex: Executor, tasks: list[Task[Any]]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    out = ex.map(_timed, tasks, label="bench", progress=False)
    return time.perf_counter() - t0, [t for _, t in out]


def projected(times: list[float], workers: int, per_task: float) -> float:
    """Longest-first list schedule of `times` (+ per_task overhead each) on `workers` workers."""
    loads = np.zeros(workers)
    for t in sorted(times, reverse=True):
        loads[np.argmin(loads)] += t + per_task
    return float(loads.max())


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    cpus = os.cpu_count() or 1
    print(f"machine: {cpus} CPUs (shared); python {sys.version.split()[0]}")
    sweeps = sweep_tasks()
    local = LocalExecutor()
    results = {}
    for name, tasks in sweeps:
        results[name] = {"local": run(local, tasks)}
    t0 = time.perf_counter()
    ray_ex = RayExecutor(num_cpus=cpus)
    startup = time.perf_counter() - t0
    try:
        run(ray_ex, sweeps[1][1][:1])  # first task on Ray: worker processes start and import eplb
        for name, tasks in sweeps:
            results[name]["ray"] = run(ray_ex, tasks)
    finally:
        ray_ex.close()
    print(f"Ray start-up (ray.init, local, {cpus} CPUs): {startup:.2f} s (once per command)\n")
    for name, tasks in sweeps:
        (lw, lt), (rw, rt) = results[name]["local"], results[name]["ray"]
        per_task = max(0.0, (rw - max(sum(rt) / cpus, max(rt))) / len(rt))
        print(name)
        print(f"  local executor: wall {lw:.2f} s (sum of task times {sum(lt):.2f} s)")
        print(f"  Ray, {cpus} CPUs:    wall {rw:.2f} s (sum of task times {sum(rt):.2f} s); overhead about "
              f"{per_task * 1000:.0f} ms per task beyond the ideal {cpus}-worker schedule")
        print("  per task, s (local / on Ray): " + ", ".join(
            f"{t.note} {a:.2f}/{b:.2f}" for t, a, b in zip(tasks, lt, rt, strict=True)))
        print("  projected wall with W one-CPU workers (tasks as measured locally + that overhead): " + ", ".join(
            f"W={w}: {projected(lt, w, per_task):.2f} s" for w in (1, 2, 4, 8, 16)))
        print()


if __name__ == "__main__":
    main()
