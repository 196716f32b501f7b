"""`eplb compare`: greedy vs MILP (and weighted shares) side by side, with a verdict, tables and plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from eplb.cli.solve import add_cost_options, cost_setup, model_for
from eplb.errors import EplbError
from eplb.loads import read_window
from eplb.report import cluster_shapes, compare_window, parse_solvers, verdict, write_report

DESCRIPTION = """\
Run several solvers on the same load window over a sweep of EP sizes and redundancy, and write a report:
report.md, a self-contained report.html (plots embedded) and results.json with every per-layer number
({"runs": [{"solver", "ep", "slots_per_gpu", "lb", "bound", "solve_ms", "time_us", ...}]}).

The verdict at the top says where the exact solver beat greedy, by how much, and at what solve time."""

EPILOG = """\
examples:
  eplb compare --solvers greedy,milp --ep 16,32 --time-limit 2 --out report/
  eplb compare --loads window.json --solvers greedy,milp,milp-weighted --ep 8,16,32,64 --redundant 0,32 --out r/"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `compare` subcommand."""
    p = subparsers.add_parser("compare", help="compare solvers side by side and write a report",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", metavar="FILE", help="load window (default: the embedded DeepSeek-V3 window)")
    p.add_argument("--layers", type=int, metavar="N", help="use only the first N layers (quicker MILP runs)")
    p.add_argument("--solvers", default="greedy,milp", help="comma-separated: greedy, milp, milp-weighted "
                   "(default: greedy,milp)")
    p.add_argument("--ep", default="32", help="EP sizes to sweep, comma-separated (default: 32)")
    p.add_argument("--redundant", help="redundant experts in all, comma-separated (default: one per GPU)")
    p.add_argument("--time-limit", type=float, default=2.0, metavar="S", help="MILP limit per layer, s (default: 2)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for report.md, report.html, results.json")
    add_cost_options(p)
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise EplbError(f"{what} must be comma-separated whole numbers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    window = read_window(args.loads)
    loads = window.loads
    if args.layers is not None:
        if args.layers < 1:
            raise EplbError("--layers must be >= 1")
        loads = loads[: args.layers]
    solvers = parse_solvers(args.solvers)
    shapes = cluster_shapes(window.num_experts, _ints(args.ep, "--ep"),
                            None if args.redundant is None else _ints(args.redundant, "--redundant"))
    if not args.time_limit > 0:
        raise EplbError("--time-limit must be > 0")
    if args.tokens_per_gpu is None:
        args.tokens_per_gpu = 4096.0  # hold T per GPU fixed across EP sizes (seed 000: T is what EP conserves)
    model = model_for(args, window)
    runs = compare_window(loads, shapes, solvers, cost_setup(args, model), args.time_limit)
    meta = {
        "title": f"{', '.join(solvers)} on {window.source}",
        "loads": f"{window.source}, {loads.shape[0]} layers x {loads.shape[1]} experts",
        "model": model.name if model else "unknown (no time prediction)",
        "hardware": args.hardware,
        "MILP time limit per layer": f"{args.time_limit} s",
        "tokens per GPU (time prediction)": args.tokens_per_gpu,
        "command": "eplb " + " ".join(args.argv),
    }
    out = Path(args.out)
    write_report(runs, out, meta)
    for line in verdict(runs):
        print(line)
    print(f"wrote {out / 'report.md'}, {out / 'report.html'}, {out / 'results.json'}")
    return 0
