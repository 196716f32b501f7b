"""`eplb compare`: greedy vs MILP (and weighted shares) side by side, with a verdict, tables and plots."""

from __future__ import annotations

import argparse
from typing import Any

from eplb.cli.logs import LOG_HELP
from eplb.cli.replay import add_schedule_options, schedule_from
from eplb.cli.solve import (
    CLI_MAX_GPUS,
    DEFAULT_HARDWARE,
    MAX_COUNT,
    add_cost_options,
    add_progress_options,
    check_time_limit,
    coactivation_for,
    cost_setup,
    int_at_most,
    model_for,
    tokens_per_gpu,
)
from eplb.errors import EplbError
from eplb.executor import add_executor_options, executor_from
from eplb.io.files import output_dir, plural
from eplb.io.logs import open_log
from eplb.io.windows import read_window
from eplb.objective import OBJECTIVES
from eplb.report import (
    Run,
    cluster_shapes,
    compare_log,
    compare_window,
    parse_solvers,
    refuse_repeats,
    verdict,
    write_report,
)
from eplb.solve import DEFAULT_TOKENS_PER_GPU, CostSetup
from eplb.specs import ModelSpec
from solvers import registry

DESCRIPTION = """\
Run several solvers on the same load window over a sweep of EP sizes and redundancy, and write a report:
report.md, a self-contained report.html (plots embedded) and results.json with every per-layer number
({"runs": [{"solver", "ep", "slots_per_gpu", "lb", "bound", "solve_ms", "time_us", ...}]}).

With --log, replay a routing log instead: every solver rebalances on the same schedule (--window,
--interval, --trigger, ... with `eplb replay`'s defaults: the cost trigger when a model is known, else
periodic), and each run records the per-layer lb averaged over the steps its placements served, the moves
(expert copies) and solve time of every rebalance, bytes moved, the predicted time, and the no-EPLB, static
and (sampled) oracle baselines (docs/replay.md).

The verdict at the top compares whatever ran on each cluster shape: each solver against greedy (else the
first solver) of the same objective, on lb (time runs: on predicted time), and each SOLVER+time run against
SOLVER (for a log: on realized lb and moves per rebalance), with solve times. A solve time is the wall time of
the whole solve (the time objective's candidates included); for a log, of each rebalance, with a process's
one-time start-up paid before the replay."""

EPILOG = """\
examples:
  eplb compare --solvers greedy,milp --ep 16,32 --time-limit 2 --out report/
  eplb compare --loads window.json --solvers greedy,milp,milp-weighted --ep 8,16,32,64 --redundant 0,32 --out r/
  eplb compare --log log.npz --window 500 --interval 1000 --layers 8 --time-limit 1 --out r/"""

FLAGS = ("--ep", "--redundant")
"""What `cluster_shapes`' messages call the EP sizes and the redundant counts."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `compare` subcommand."""
    p = subparsers.add_parser("compare", help="compare solvers side by side and write a report",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--loads", metavar="FILE", help="load window (default: the embedded DeepSeek-V3 window)")
    source.add_argument("--log", metavar="FILE", help=f"routing log to replay instead of one window: {LOG_HELP}")
    p.add_argument("--layers", type=int, metavar="N", help="use only the first N layers (quicker MILP runs)")
    p.add_argument("--solvers", default="greedy,milp", help="comma-separated registered solvers: "
                   f"{', '.join(registry.names())} (default: greedy,milp; incremental with --log only, greedy-coact "
                   "with --coactivation or a token-level --log)")
    p.add_argument("--ep", default="32", help="EP sizes to sweep, comma-separated (default: 32)")
    p.add_argument("--redundant", help="redundant experts in all, comma-separated (default: one per GPU; none on "
                   "one GPU)")
    p.add_argument("--time-limit", type=float, default=2.0, metavar="S", help="MILP limit per layer, s (default: 2)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for report.md, report.html, results.json")
    p.add_argument("--objectives", default="lb", help="with --loads: lb, time or lb,time (each solver once per "
                   "objective, the time runs named SOLVER+time; docs/solvers.md, 'Objectives'; default: lb)")
    p.add_argument("--coactivation", metavar="FILE", help="with --loads: the window's co-activation summary (.json, "
                   "or its .npz image) or token-level log (.npz with topk_ids): copies per token and the co-activation "
                   "comm term")
    add_cost_options(p, model_default="the log's model with --log, else the preset with the expert count",
                     tokens_default=f"{DEFAULT_TOKENS_PER_GPU:.0f} with --loads, each step's own tokens with --log",
                     tokens_value=None, two_links=False)
    replay = p.add_argument_group("log replay (with --log)")
    add_schedule_options(replay)
    replay.add_argument("--oracle-every", type=int_at_most(MAX_COUNT, "steps"), default=10, metavar="N",
                        help="solve the oracle on every N-th step (default 10; 0: skip it)")
    add_progress_options(p)
    add_executor_options(p)
    # the log-only flags default to None, so that one given with a window is refused (`_refuse_log_options`),
    # whatever its value; `_run_log` puts their defaults back
    log_options = {a.dest: (a.option_strings[0], a.default) for a in replay._group_actions}
    p.set_defaults(func=run, log_options=log_options, **dict.fromkeys(log_options))


def _ints(text: str, flag: str, unit: str, low: int, high: int | None = None) -> list[int]:
    """A flag's comma-separated whole numbers, each in [low, high] (high None: unbounded here) -> [int]; unit:
    what they count, for the message. A blank entry ('4,,8', '') is refused, not skipped."""
    accepted = f"comma-separated whole numbers of {unit}, " + (f"{low:,} or more" if high is None else
                                                                f"{low:,} to {high:,}")  # fmt: skip
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise EplbError(f"{flag} takes {accepted}, got {text!r}") from None
    for v in values:
        if v < low or (high is not None and v > high):
            raise EplbError(f"{flag} takes {accepted}, got {v}")
    refuse_repeats(values, flag)
    return values


def run(args: argparse.Namespace) -> int:
    out = output_dir(args.out, "--out")  # before the solves, not after them
    solvers = parse_solvers(args.solvers)
    check_time_limit("--time-limit", args.time_limit)
    if args.layers is not None and args.layers < 1:
        raise EplbError(f"--layers must be >= 1, got {args.layers}")
    eps = _ints(args.ep, "--ep", "GPUs", 1, CLI_MAX_GPUS)
    # the most --redundant one EP size takes is checked with it (cluster_shapes)
    redundant = None if args.redundant is None else _ints(args.redundant, "--redundant", "redundant experts in all", 0)
    with executor_from(args) as args.run_on:
        runs, meta = _run_log(args, solvers, eps, redundant) if args.log else _run_window(args, solvers, eps, redundant)
    meta["command"] = "eplb " + " ".join(args.argv)
    write_report(runs, out, meta, "--out")
    for line in verdict(runs):
        print(line)
    print(f"wrote {out / 'report.md'}, {out / 'report.html'}, {out / 'results.json'}")
    return 0


def _run_window(
    args: argparse.Namespace, solvers: list[str], eps: list[int], redundant: list[int] | None
) -> tuple[list[Run], dict[str, Any]]:
    _refuse_log_options(args)
    window = read_window(args.loads)
    _check_layers(args, window.num_layers, "window")
    loads = window.loads if args.layers is None else window.loads[: args.layers]
    shapes = cluster_shapes(window.num_experts, eps, redundant, FLAGS)
    args.tokens_per_gpu_default = DEFAULT_TOKENS_PER_GPU  # a window's own total is no step size
    model = model_for(args, window)
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if not objectives or any(o not in OBJECTIVES for o in objectives):
        raise EplbError(f"--objectives takes {', '.join(OBJECTIVES)} (comma-separated), got {args.objectives!r}")
    refuse_repeats(objectives, "--objectives")
    coactivation = coactivation_for(args, window)
    if coactivation is not None and args.layers is not None:
        coactivation = coactivation.layers(args.layers)
    runs = compare_window(loads, shapes, solvers, _one_link_cost(args, model), args.time_limit, progress=args.progress,
                          executor=args.run_on, objectives=objectives,
                          coactivation=coactivation)  # fmt: skip
    return runs, {
        "title": f"{', '.join(solvers)} on {window.source}",
        "loads": f"{window.source}, {plural(loads.shape[0], 'layer')} x {plural(loads.shape[1], 'expert')}",
        "model": model.name if model else "unknown (no time prediction)",
        "hardware": args.hardware or DEFAULT_HARDWARE,
        "MILP time limit per layer": f"{args.time_limit} s",
        "tokens per GPU (time prediction)": tokens_per_gpu(args),
    }


def _run_log(
    args: argparse.Namespace, solvers: list[str], eps: list[int], redundant: list[int] | None
) -> tuple[list[Run], dict[str, Any]]:
    given = [flag for flag, on in (("--objectives", args.objectives != "lb"), ("--coactivation", args.coactivation))
             if on]  # fmt: skip
    if given:  # the flag the user gave, not both
        raise EplbError(f"{' and '.join(given)} {'compare' if len(given) > 1 else 'compares'} placements on one "
                        "window: give --loads, not --log")
    for dest, (_, default) in args.log_options.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    log = open_log(args.log)
    info = log.info
    _check_layers(args, info.num_layers, "log")
    shapes = cluster_shapes(info.num_experts, eps, redundant, FLAGS)
    if args.oracle_every < 0:
        raise EplbError("--oracle-every must be >= 0")
    model = model_for(args, info)
    cost = _one_link_cost(args, model)
    schedule = schedule_from(args, cost)  # eplb replay's schedule, its default trigger included
    runs = compare_log(log, shapes, solvers, cost, args.time_limit, schedule=schedule,
                       oracle_every=args.oracle_every, layers=args.layers, progress=args.progress,
                       executor=args.run_on)  # fmt: skip
    layers = info.num_layers if args.layers is None else args.layers
    first = runs[0].replay
    return runs, {
        "title": f"{', '.join(solvers)} replaying {info.path}",
        "log": info.describe() + (f"; first {plural(layers, 'layer')}" if args.layers is not None else ""),
        "schedule": schedule.describe("each solver"),
        "solve time": "wall time of each rebalance's solve" + (" (all the cost trigger's candidates and their "
                      "judging)" if schedule.trigger == "cost" else "") + "; the one-time start-up (imports) is "
                      "paid before the replay, outside the timing",
        "steps averaged": "" if first is None else (
            f"{first.steps:,}, from step {first.first_step:,} (the first a rebalanced placement could serve) on"),
        "oracle": "skipped" if args.oracle_every == 0 else (
            f"greedy on each step's own counts, one step in {args.oracle_every}"),
        "model": model.name if model else "unknown (no time prediction, no bytes moved)",
        "hardware": args.hardware or DEFAULT_HARDWARE,
        "MILP time limit per layer": f"{args.time_limit} s",
        "tokens per GPU (time prediction)": "each step's own" if args.tokens_per_gpu is None else args.tokens_per_gpu,
    }


def _refuse_log_options(args: argparse.Namespace) -> None:
    """The log-replay flags (`register`'s 'log replay' group: --window, --interval, --trigger, --oracle-every, ...)
    given without --log, named: a window run ignored them without a word."""
    given = [flag for dest, (flag, _) in args.log_options.items() if getattr(args, dest) is not None]
    if given:
        source = f"--loads {args.loads}" if args.loads else "the embedded window (no --log given)"
        raise EplbError(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} how --log replays a routing log; "
                        f"{source} compares placements on one window: give --log FILE, or drop "
                        f"{'it' if len(given) == 1 else 'them'}")


def _check_layers(args: argparse.Namespace, num_layers: int, source: str) -> None:
    """--layers at most the window's (or log's) layer count: more was taken as all of them, without a word."""
    if args.layers is not None and args.layers > num_layers:
        raise EplbError(f"--layers {args.layers}: the {source} has {plural(num_layers, 'layer')} (give 1 to "
                        f"{num_layers})")


def _one_link_cost(args: argparse.Namespace, model: ModelSpec | None) -> CostSetup | None:
    """`cost_setup`, refusing two links: compare's cluster shapes carry no GPUs per node."""
    cost = cost_setup(args, model)
    if cost is not None and cost.inter_node_bw is not None:
        raise EplbError("eplb compare times one all-to-all link (--link nvlink, nic, pcie or GB/s): its cluster "
                        "shapes carry no GPUs per node, which a '+' link needs")
    return cost
