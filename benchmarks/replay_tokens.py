"""Token-level replay: layer-steps per second and peak memory, the compiled token reach next to the numpy loop.

Run: python benchmarks/replay_tokens.py [--repeats 3] [--dir DIR] [--only qwen3|mixtral] [--before DIR]

Two token-level logs (written into --dir by `eplb synth` unless there already):
- qwen3: `eplb synth --out DIR/qwen3.npz --model qwen3-235b-a22b --layers 32 --steps 60 --format topk
  --tokens 2048`, replayed with `eplb replay LOG --gpus 32 --window 20 --interval 20 --trigger periodic
  --oracle-every 0`;
- mixtral: `eplb synth --out DIR/mixtral.npz --model mixtral-8x7b --steps 300 --format topk --tokens 2048
  --hot-ratio 3`, replayed with `eplb replay LOG --gpus 16 --window 50 --interval 50 --trigger cost
  --oracle-every 5`.
Each replay runs in its own process (`eplb replay ... --json` in-process, so its peak RSS is the replay's)
twice per repeat: "new" as shipped (eplb/_reach.c: `step_reach` and `copies_per_token` in one compiled pass
over the tokens) and "old" with those two replaced by their numpy references (`_step_reach_numpy`,
`_copies_numpy`: the code they replaced, kept for the tests), or with --before DIR the whole eplb of a built
checkout DIR (`git archive b5809a3~1 | tar -x -C DIR`, then build_ext --inplace there: also its numpy log
reader), taking turns going first. Prints medians of
the replay's own wall time (timing.wall_s, and layer-steps/s = steps x layers / wall_s), the time in the
token reach (timing.copies_s, plus for the cost trigger the rebalances' solve_ms, which judges candidates
on the window's reach), and peak RSS; and checks old and new print the same results and rebalances.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CASES: dict[str, tuple[list[str], list[str]]] = {
    "qwen3": (
        ["--model", "qwen3-235b-a22b", "--layers", "32", "--steps", "60", "--format", "topk", "--tokens", "2048"],
        ["--gpus", "32", "--window", "20", "--interval", "20", "--trigger", "periodic", "--oracle-every", "0"],
    ),
    "mixtral": (
        ["--model", "mixtral-8x7b", "--steps", "300", "--format", "topk", "--tokens", "2048", "--hot-ratio", "3"],
        ["--gpus", "16", "--window", "50", "--interval", "50", "--trigger", "cost", "--oracle-every", "5"],
    ),
}


def worker(variant: str, log: str, replay_args: list[str]) -> None:
    """One replay in this process; prints a JSON line: the summary and the peak RSS in MB."""
    import contextlib
    import io

    import eplb.coactivation as co
    from eplb.cli import main

    if variant == "old":
        co.step_reach = co._step_reach_numpy
        co.copies_per_token = co._copies_numpy
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["replay", log, *replay_args, "--no-progress", "--json"])
    summary = json.loads(out.getvalue())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"summary": summary, "peak_mb": peak_mb}))


def run(variant: str, log: Path, replay_args: list[str], before: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if variant == "old" and before is not None:
        env["PYTHONPATH"] = str(before)
    cmd = [sys.executable, __file__, "--worker", "new" if before else variant, str(log), *replay_args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def comparable(summary: dict[str, Any]) -> Any:
    """The summary without its timings (what must not change)."""
    rebalances = [{k: v for k, v in r.items() if k != "solve_ms"} for r in summary["rebalances"]["list"]]
    results = {name: {k: v for k, v in row.items() if not k.startswith("solve_ms")}
               for name, row in summary["results"].items()}  # fmt: skip
    return results, rebalances


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where the logs are (written there if missing); default a temporary one")
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--before", type=Path, help="a built checkout whose eplb is the old code (default: the references)")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.worker[2:])
        return
    tmp = None if args.dir else tempfile.TemporaryDirectory()
    where = args.dir or Path(tmp.name if tmp else ".")
    where.mkdir(parents=True, exist_ok=True)
    old = f"eplb of {args.before}" if args.before else "numpy step_reach / copies_per_token"
    print(f"medians over {args.repeats} runs; old = {old}, new = eplb/_reach.c")
    head = f"{'log':<9} {'':<4} {'wall s':>8} {'layer-steps/s':>14} {'reach s':>8} {'solve ms max':>13} {'peak MB':>8}"
    print(head)
    for name, (synth_args, replay_args) in CASES.items():
        if args.only and name != args.only:
            continue
        log = where / f"{name}.npz"
        if not log.exists():
            subprocess.run(["eplb", "synth", "--out", str(log), *synth_args], check=True, capture_output=True)
        rows: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for r in range(args.repeats):
            for variant in ("old", "new") if r % 2 == 0 else ("new", "old"):
                rows[variant].append(run(variant, log, replay_args, args.before))
        if comparable(rows["old"][0]["summary"]) != comparable(rows["new"][0]["summary"]):
            raise SystemExit(f"{name}: old and new replays differ")
        med: dict[str, dict[str, float]] = {}
        for variant, runs in rows.items():
            timing = [x["summary"]["timing"] for x in runs]
            solve = [x["summary"]["rebalances"]["solve_ms_max"] or 0.0 for x in runs]
            med[variant] = {
                "wall": statistics.median(t["wall_s"] for t in timing),
                "rate": statistics.median(t["layer_steps_per_s"] for t in timing),
                "reach": statistics.median(t.get("copies_s", 0.0) for t in timing),
                "solve": statistics.median(solve),
                "peak": statistics.median(x["peak_mb"] for x in runs),
            }
        for variant in ("old", "new"):
            m = med[variant]
            print(f"{name:<9} {variant:<4} {m['wall']:>8.2f} {m['rate']:>14,.0f} {m['reach']:>8.2f} "
                  f"{m['solve']:>13,.0f} {m['peak']:>8,.0f}")  # fmt: skip
        o, n = med["old"], med["new"]
        print(f"{name:<9} {'x':<4} {o['wall'] / n['wall']:>8.1f} {'':>14} {o['reach'] / max(n['reach'], 1e-9):>8.1f} "
              f"{o['solve'] / max(n['solve'], 1e-9):>13.1f} {o['peak'] / n['peak']:>8.2f}  (same results: yes)")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
