"""`eplb synth` and `eplb replay`: make a routing log, replay one with periodic rebalancing."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import shutil
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.budget import GIB, describe_slots
from eplb.cli.logs import LOG_HELP, refuse_compress
from eplb.cli.solve import (
    MAX_COUNT,
    add_cluster_options,
    add_cost_options,
    add_progress_options,
    check_groups,
    check_link,
    check_time_limit,
    cluster_for,
    cost_setup,
    flag_link,
    int_at_most,
    int_list,
    model_for,
    slots_for,
)
from eplb.cost import TimeModel
from eplb.cost.migration import MAX_FIXED_STALL_S, MigrationSpec
from eplb.errors import EplbError, shown
from eplb.executor import add_executor_options, executor_from, replay_logs
from eplb.io.files import output_dir, output_file, plural, writing
from eplb.io.logs import open_log, output_log, topk_counts, write_counts, write_jsonl, write_topk
from eplb.objective import OBJECTIVES
from eplb.progress import Progress
from eplb.replay import BASELINES, TRIGGERS, ReplayResult, Schedule, StepBlock
from eplb.solve import CostSetup, time_limited
from eplb.specs import MODEL_PRESETS, link_bandwidth, model_preset
from eplb.synth import StatsAccumulator, SynthConfig, check_model_shape, seed004_log, synth_counts, synth_topk
from eplb.trigger import unused_option
from solvers import registry

SYNTH_DESCRIPTION = """\
Write a synthetic routing log: per-step expert counts (.npz or .jsonl) or token-level routing
(.npz with --format topk). Every layer has its own power-law expert popularity over a random
ranking of its experts (its own hot set), DeepSeek-style expert groups that run hot or cold together,
a slow drift that reshuffles the hot set over tens to hundreds of steps, optional abrupt regime
shifts (a domain switch), and sampling noise from the tokens per step. Deterministic by --seed.

The default looks like published DeepSeek-R1/V3 statistics: 58 layers x 256 experts, top-8, the
hottest expert about 11x the mean, and without EPLB at EP32 a busiest GPU about 2.5x the mean
(imbalance (max - mean) / mean about 1.5). --preset seed004 writes seed 004's section 5.2 counts
exactly (one step, one layer, 4096 tokens, top-8)."""

SYNTH_EPILOG = """\
examples:
  eplb synth --out log.npz                              4,000 steps, DeepSeek-R1-like
  eplb synth --out log.npz --steps 10000 --shift-at 5000   a domain switch at step 5,000
  eplb synth --out log.jsonl --steps 100 --layers 4 --experts 64 --top-k 6
  eplb synth --out routing.npz --format topk --steps 20 --tokens 512
  eplb synth --out seed004.npz --preset seed004

formats: docs/formats.md ("Routing logs")."""

REPLAY_DESCRIPTION = """\
Replay a routing log with rebalancing, as a cluster running EPLB would have served it. Every
--interval steps a check decides whether to rebalance (--trigger; default: cost when a model is
known, moving only when the predicted time saved over the next interval pays for the weight copies,
else periodic, every check); a rebalance places experts with --solver (default incremental: edits the
serving placement with few copies) from the --window steps before it (never the check step or later:
no lookahead). The new placement serves from the next step (--delay 1), or once its copies land.
Before the first placement applies, the cluster serves vLLM's initial placement.

Baselines on the same log and cluster: no EPLB (experts in id order, no redundancy), static (the
first rebalance's placement kept), oracle (every step solved on its own counts by the greedy
solver: the ceiling, and the costliest row: use --oracle-every N to sample), hindsight (each
interval between checks served by greedy solved on that interval's own counts).

Reports per step and layer the realized lb (busiest GPU / mean GPU) and the predicted layer time,
per rebalance the moves (expert copies onto GPUs), bytes moved and solve time."""

REPLAY_EPILOG = """\
examples:
  eplb replay log.npz                                  window 1000, interval 3000 (vLLM's); incremental
                                                       solver, cost trigger with a model, --delay 1
  eplb replay log.npz --window 500 --interval 1000 --redundant 64 --out run1
  eplb replay log.jsonl --gpus 64 --ewma 0.01 --oracle-every 10 --json
  eplb replay log.npz --solver milp --time-limit 5 --memory-budget-gib 20 --model deepseek-v3

--out DIR writes steps.csv (step, layer, lb, oracle_lb, static_lb, no_eplb_lb, hindsight_lb, time_us),
rebalances.csv (step, moves, bytes_moved, transfer_s, charge_s, solve_ms, served) and summary.json.
Details: docs/replay.md."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `synth` and `replay` subcommands."""
    s = subparsers.add_parser(
        "synth",
        help="write a synthetic routing log",
        description=SYNTH_DESCRIPTION,
        epilog=SYNTH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--out", required=True, metavar="FILE", help="log file to write: .npz or .jsonl")
    s.add_argument("--preset", choices=("default", "seed004"), default="default",
                   help="default (DeepSeek-R1-like) or seed004 (seed 004 section 5.2, exact)")
    s.add_argument("--format", choices=("counts", "topk"), default="counts",
                   help="counts: per-step expert counts; topk: token-level topk_ids [tokens, layers, k] (.npz)")
    d = SynthConfig()
    s.add_argument("--steps", type=int_at_most(MAX_COUNT, "steps"), metavar="N",
                   help=f"steps (default {d.steps:,}; seed004: 1)")
    s.add_argument("--layers", type=int, metavar="L", help=f"MoE layers (default {d.layers}; seed004: 1)")
    s.add_argument("--experts", type=int, metavar="E", help=f"routed experts per layer (default {d.experts})")
    s.add_argument("--top-k", type=int, metavar="K", help=f"experts per token (default {d.top_k})")
    s.add_argument("--tokens", type=int, metavar="T", help=f"tokens per step over the EP group (default {d.tokens:,})")
    shape = s.add_mutually_exclusive_group()
    shape.add_argument("--exponent", type=float, metavar="A", help="power-law exponent of expert popularity, 0 "
                       "(none: groups and drift only) to 1,000")
    shape.add_argument("--hot-ratio", type=float, metavar="R",
                       help=f"median hottest-expert / mean popularity to aim for (default {d.hot_ratio:g})")
    # the popularity flags default to None, so that --preset seed004, which has none of them, can refuse them given
    s.add_argument("--groups", type=int, metavar="N",
                   help=f"expert groups hot or cold together (default {d.groups}; 1 for none)")
    s.add_argument("--group-std", type=float, metavar="S",
                   help=f"std of a group's log popularity factor (default {d.group_std:g})")
    s.add_argument("--drift-std", type=float, metavar="S",
                   help=f"std of each expert's slow log-popularity drift (default {d.drift_std:g})")
    s.add_argument("--drift-steps", type=float, metavar="N",
                   help=f"correlation time of the drift in steps (default {d.drift_steps:g})")
    s.add_argument("--shift-at", type=int_list, metavar="S,S",
                   help="steps at which every layer switches to a new hot set (a domain switch)")
    s.add_argument("--shift-every", type=float, metavar="N",
                   help="also switch at random times this many steps apart on average, N > 0 (default: never)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--model", default=None, metavar="NAME",
                   help="model name stored in the log (default deepseek-v3 for the default shape, 58 x 256 top-8); "
                   "a preset ("
                   f"{', '.join(MODEL_PRESETS)}) sets the default --layers, --experts and --top-k to its own, and "
                   "those given must agree with it (its experts and top-k, at most its MoE layers)")
    s.add_argument("--gpus", type=int, default=32, metavar="N",
                   help="EP size for the printed no-EPLB imbalance (default 32)")
    s.add_argument("--compress", action="store_true",
                   help="deflate the .npz (about 1.5x smaller, several times slower to read); refused for .jsonl")
    s.add_argument("--json", action="store_true", help="print the config and statistics as JSON")
    add_progress_options(s)
    s.set_defaults(func=run_synth)

    r = subparsers.add_parser(
        "replay",
        help="replay a routing log with rebalancing",
        description=REPLAY_DESCRIPTION,
        epilog=REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("log", metavar="LOG", help=f"routing log: {LOG_HELP}")
    add_schedule_options(r)
    default_solver = "incremental" if "incremental" in registry.names() else "greedy"
    r.add_argument("--solver", choices=registry.names(), default=default_solver,
                   help=f"placement solver at each rebalance (default {default_solver})")
    r.add_argument("--time-limit", type=float, metavar="S",
                   help="MILP time limit per layer and rebalance, seconds (default: 5, as eplb solve)")
    r.add_argument("--objective", choices=OBJECTIVES, default="lb",
                   help="lb: balance tokens; time: each rebalance also tries co-locating experts chosen together "
                   "in the window's tokens and keeps, per layer, the lowest predicted time (token-level logs; needs "
                   "the model). Default: lb")
    add_cluster_options(r)
    r.add_argument("--oracle-every", type=int_at_most(MAX_COUNT, "steps"), default=1, metavar="N",
                   help="solve the oracle on every N-th step (default 1: all; 0: skip the oracle)")
    add_cost_options(r, model_default=LOG_MODEL_DEFAULT, tokens_default=LOG_TOKENS_DEFAULT, tokens_value=None)
    add_migration_options(r)
    r.add_argument("--out", metavar="DIR", help="write steps.csv, rebalances.csv and summary.json here")
    r.add_argument("--json", action="store_true", help="print summary.json's object instead of the table")
    add_progress_options(r)
    add_executor_options(r)
    r.set_defaults(func=run_replay)


LOG_MODEL_DEFAULT = "the log's model, else the preset with the log's expert count"
LOG_TOKENS_DEFAULT = "each step's own tokens"


def add_schedule_options(p: argparse._ActionsContainer) -> None:
    """--window, --interval, --first-rebalance, --delay, --ewma (read back with `schedule_from`)."""
    d = Schedule()
    steps = int_at_most(MAX_COUNT, "steps")
    p.add_argument("--window", type=steps, default=d.window, metavar="W",
                   help=f"steps the solver sees (default {d.window})")
    p.add_argument("--interval", type=steps, default=d.interval, metavar="I",
                   help=f"steps between checks (default {d.interval})")
    p.add_argument("--first-rebalance", type=steps, metavar="S",
                   help="step position of the first rebalance (default: the interval; vLLM's comes a "
                   "quarter interval in: 750 with --delay 0)")
    p.add_argument("--delay", type=steps, default=d.delay, metavar="D",
                   help="steps before a new placement serves (default 1: from the next step; 0: vLLM's timing)")
    p.add_argument("--ewma", type=float, metavar="ALPHA",
                   help="weight the window: the step j steps before the rebalance counts (1 - ALPHA)^j; ALPHA in "
                   "(0, 1], 1: the last step alone (default: plain sum)")
    p.add_argument("--trigger", choices=TRIGGERS,
                   help="when a check rebalances: always (periodic), when the recent realized lb exceeds "
                   "--threshold, or when the predicted time saved over the next interval exceeds the migration "
                   "cost (cost; needs a model). Default: cost with a model, else periodic")
    p.add_argument("--threshold", type=float, metavar="LB",
                   help=f"realized lb (mean over the window's steps and layers) above which --trigger threshold "
                   f"rebalances (default {d.threshold:g})")
    p.add_argument("--robust-windows", type=int_at_most(MAX_COUNT, "sub-windows"), metavar="K",
                   help="cut the window into K sub-windows, 2 .. the steps the first check's window holds (--window, "
                   "or the first check's step when earlier), and refine the placement so its worst lb over them is "
                   "lowest (solvers/robust.py; any solver; default: none)")


def add_migration_options(p: argparse._ActionsContainer) -> None:
    """--migration-link, --migration overlap|blocking, --migration-share, --migration-stall-ms (read back with
    `migration_from`)."""
    d = MigrationSpec(1.0)
    p.add_argument("--migration-link", metavar="nvlink|nic|pcie|GBPS",
                   help="the one link every expert copy takes, per GPU and direction (default: the all-to-all link, "
                   "--link; with a '+' --link, its two links: copies from another node take the one between nodes); "
                   "needs the model")
    p.add_argument("--migration", choices=("overlap", "blocking"),
                   help="copies run while serving, taking --migration-share of the link (overlap, vLLM's way; "
                   "default) or stall serving until done (blocking)")
    p.add_argument("--migration-share", type=float, metavar="F",
                   help=f"with overlap, the fraction of the link the copies take, in (0, 1) (default {d.link_share:g})")
    p.add_argument("--migration-stall-ms", type=float, metavar="MS",
                   help="serving stops this long at every rebalance that copies anything, besides the copies: "
                   "host-side planning, building the transfer ops, synchronizing the ranks (default 0; "
                   "docs/cost-model.md, 'Migration')")


def migration_from(args: argparse.Namespace, cost: CostSetup | None) -> MigrationSpec | None:
    """The checked MigrationSpec from `add_migration_options` (None without a cost model; then the options are
    refused: copies are priced by the model's expert bytes)."""
    if cost is None:
        given = [flag for flag, value in (("--migration-link", args.migration_link), ("--migration", args.migration),
                                          ("--migration-share", args.migration_share),
                                          ("--migration-stall-ms", args.migration_stall_ms)) if value is not None]
        if given:
            raise EplbError(f"{given[0]} prices weight migration, which needs a model (the bytes of an expert): give "
                            "--model NAME or FILE (no preset matches the log's expert and layer count)")
        return None
    between = None
    if args.migration_link is not None:
        link_bw = flag_link("--migration-link", args.migration_link,
                            lambda: link_bandwidth(cost.hardware, args.migration_link))
        check_link(link_bw, "--migration-link", args.migration_link)
    elif cost.inter_node_bw is not None:  # two links: copies from another node take the one between nodes
        TimeModel.check_nodes(args.gpus, args.gpus_per_node)
        link_bw, between = cost.link_bw, cost.inter_node_bw
    else:  # the all-to-all link, as the Python API and deployments price copies
        link_bw = cost.link_bw
    share = MigrationSpec(1.0).link_share if args.migration_share is None else args.migration_share
    if not 0 < share < 1:
        raise EplbError(f"--migration-share is the fraction of the link the copies take, in (0, 1), got {share:g}")
    stall_ms = 0.0 if args.migration_stall_ms is None else args.migration_stall_ms
    if not (math.isfinite(stall_ms) and 0 <= stall_ms <= MAX_FIXED_STALL_S * 1e3):
        raise EplbError(f"--migration-stall-ms must be 0 to {MAX_FIXED_STALL_S * 1e3:g} ms, got {stall_ms:g}")
    spec = MigrationSpec(link_bw, args.migration != "blocking", share, cost.hardware.hbm_bandwidth,
                         between, args.gpus_per_node, stall_ms / 1e3)  # fmt: skip
    spec.check()
    return spec


SCHEDULE_FLAGS = {"window": "--window", "interval": "--interval", "first": "--first-rebalance", "delay": "--delay",
                  "ewma": "--ewma", "trigger": "--trigger", "threshold": "--threshold",
                  "robust_windows": "--robust-windows"}  # fmt: skip
"""Schedule's fields as `add_schedule_options` names them, for its messages."""


def schedule_from(args: argparse.Namespace, cost: CostSetup | None) -> Schedule:
    """The checked Schedule from `add_schedule_options`' arguments (errors name the flags), for a run timed with
    `cost` (None: no model). The one place of the default trigger, `eplb replay`'s and `eplb compare --log`'s:
    cost when a model is known, else periodic; --trigger cost without a model is refused."""
    if args.trigger == "cost" and cost is None:
        raise EplbError("--trigger cost needs a model to predict times: give --model NAME, or choose --trigger "
                        "periodic or threshold")  # fmt: skip
    trigger = args.trigger or ("cost" if cost is not None else "periodic")
    unused = unused_option(trigger, ["threshold"] if args.threshold is not None else [], SCHEDULE_FLAGS,
                           "this run's", default=args.trigger is None)
    if unused is not None:
        raise EplbError(unused[1])
    threshold = Schedule().threshold if args.threshold is None else args.threshold
    schedule = Schedule(args.window, args.interval, args.first_rebalance, args.delay, args.ewma, trigger,
                        threshold, args.robust_windows)  # fmt: skip
    schedule.check(SCHEDULE_FLAGS)
    return schedule


# --------------------------------------------------------------------------------------------
# eplb synth
# --------------------------------------------------------------------------------------------


SYNTH_FLAGS = {"steps": "--steps", "layers": "--layers", "experts": "--experts", "top_k": "--top-k",
               "tokens": "--tokens", "exponent": "--exponent", "hot_ratio": "--hot-ratio", "groups": "--groups",
               "group_std": "--group-std", "drift_std": "--drift-std", "drift_steps": "--drift-steps",
               "shift_at": "--shift-at", "shift_every": "--shift-every", "model": "--model"}  # fmt: skip
"""SynthConfig's fields as `eplb synth` names them, for `SynthConfig.check`'s messages."""


def _check_disk(out: Path, need: float, what: str) -> None:
    """Refuse, before the work, a log of `need` bytes (`what` says of which flags) that the disk of `out` cannot
    hold: a full disk would stop the writer only after it drew the steps that fit."""
    where = out.absolute().parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:  # no way to know: the writer reports a full disk
        return
    if usage.total == 0:  # a file system of no size (/proc, some FUSE mounts): the writer says what it can't do
        return
    free = usage.free
    if need > free:
        raise EplbError(f"the log would take {need / 1e9:,.1f} GB ({what}) but {where} has {free / 1e9:,.1f} GB "
                        "free: lower them")


def _synth_config(args: argparse.Namespace) -> SynthConfig:
    """The SynthConfig of `eplb synth`'s flags: --layers, --experts and --top-k not given are --model's preset's (when
    it names one), else the defaults."""
    d = SynthConfig()
    if args.shift_every is not None and not args.shift_every > 0:  # 0 meant none without a word
        raise EplbError(f"--shift-every is the mean steps between random regime shifts and must be > 0, got "
                        f"{args.shift_every:g}: drop it for none")
    preset = model_preset(args.model)
    shape = d if preset is None else SynthConfig(layers=preset.num_moe_layers, experts=preset.num_experts,
                                                 top_k=preset.top_k)  # fmt: skip
    layers = shape.layers if args.layers is None else args.layers
    experts = shape.experts if args.experts is None else args.experts
    top_k = shape.top_k if args.top_k is None else args.top_k
    # the default model's name on the default model's shape, given as flags or not (--layers 58 dropped it); a log
    # of another shape (fewer layers included) names none, as before
    default_shape = (layers, experts, top_k) == (d.layers, d.experts, d.top_k)
    return SynthConfig(
        steps=d.steps if args.steps is None else args.steps,
        layers=layers,
        experts=experts,
        top_k=top_k,
        tokens=d.tokens if args.tokens is None else args.tokens,
        exponent=args.exponent,
        hot_ratio=args.hot_ratio if args.hot_ratio is not None else d.hot_ratio if args.exponent is not None else
        _default_hot_ratio(d.hot_ratio, experts, top_k),  # --exponent: no hot ratio is aimed for, none noted
        groups=d.groups if args.groups is None else args.groups,
        group_std=d.group_std if args.group_std is None else args.group_std,
        drift_std=d.drift_std if args.drift_std is None else args.drift_std,
        drift_steps=d.drift_steps if args.drift_steps is None else args.drift_steps,
        shift_at=tuple(args.shift_at or ()),
        shift_every=d.shift_every if args.shift_every is None else args.shift_every,
        seed=args.seed,
        model=args.model if args.model is not None else (d.model if default_shape else None),
    )


DEFAULT_HOT_REACH = 0.75
"""The default hot ratio's cap, as a share of experts / top-k (the most one expert can carry when each token picks
top-k distinct experts): Mixtral's 8 experts, top-2, get 3, the ratio docs/replay.md uses for it."""


def _default_hot_ratio(default: float, experts: int, top_k: int) -> float:
    """The hot ratio `eplb synth` aims for without --hot-ratio or --exponent: `default`, or DEFAULT_HOT_REACH of
    experts / top-k where the default is out of reach (it refused Mixtral and DeepSeek-V2-Lite shapes unless told a
    ratio; `_note_hot_ratio` says so)."""
    reach = experts / max(top_k, 1)
    if default <= DEFAULT_HOT_REACH * reach or experts < 1 or top_k < 1:
        return default
    return max(1.0, DEFAULT_HOT_REACH * reach)


def _note_hot_ratio(args: argparse.Namespace, cfg: SynthConfig) -> None:
    """A note on stderr, once every flag is checked, when `cfg` aims below the default hot ratio that its shape
    cannot reach (`_default_hot_ratio`; neither --hot-ratio nor --exponent given)."""
    default = SynthConfig().hot_ratio
    if args.hot_ratio is not None or args.exponent is not None or cfg.hot_ratio == default:
        return
    reach = cfg.experts / cfg.top_k
    print(f"note: the default hot ratio {default:g} is out of reach for {plural(cfg.experts, 'expert')}, "
          f"top-{cfg.top_k} (at most {reach:.3g}x the mean): aiming for {cfg.hot_ratio:g}"
          + (f" ({DEFAULT_HOT_REACH:g} of it)" if cfg.hot_ratio > 1 else "") + "; --hot-ratio R sets another",
          file=sys.stderr)  # fmt: skip


def run_synth(args: argparse.Namespace) -> int:
    out = output_file(args.out, "--out")  # a directory, or none there: refused as every writer's output
    suffix = out.suffix.lower()
    if suffix not in (".npz", ".jsonl"):
        raise EplbError(f"--out {out}: use a .npz or .jsonl file name")
    if args.format == "topk" and suffix != ".npz":
        raise EplbError("--format topk writes a .npz (topk_ids and step_offsets); name the file .npz")
    refuse_compress(args.compress, suffix.removeprefix("."), f"--out {out}")
    if args.gpus < 1:
        raise EplbError(f"--gpus must be >= 1, got {args.gpus}")
    if args.seed < 0:
        raise EplbError(f"--seed must be >= 0 (numpy's seeds are non-negative), got {args.seed}")
    acc = StatsAccumulator(gpus=args.gpus)
    try:
        config = _synthesize(args, out, acc)
    except MemoryError as exc:  # numpy refuses an array larger than the machine can hold
        what = "--steps x --tokens x --layers x --top-k picks and " if args.format == "topk" else ""
        raise EplbError(f"out of memory ({exc}): the log's {what}--layers x --experts arrays do not fit; lower "
                        "them") from None
    stats = acc.result()
    if args.json:
        json.dump({"out": str(out), "bytes": out.stat().st_size, "config": config, "stats": stats.to_dict()},
                  sys.stdout)  # fmt: skip
        print()
        return 0
    info = open_log(out).info
    print(f"wrote {info.describe()}, {out.stat().st_size / 1e6:,.1f} MB")
    h, lb = stats.hot_ratio, stats.no_eplb_lb
    print(f"  hottest / mean expert, per step and layer: median {h[0]:.2f} (p10 {h[1]:.2f}, p90 {h[2]:.2f})")
    print(
        f"  no EPLB on {stats.gpus} GPUs: lb median {lb[0]:.2f} (p10 {lb[1]:.2f}, p90 {lb[2]:.2f}), "
        f"imbalance (max - mean) / mean {stats.imbalance:.2f}"
    )
    if stats.hot_set_overlap:
        parts = ", ".join(f"{v:.0%} after {plural(k, 'step')}" for k, v in stats.hot_set_overlap.items())
        print(f"  top-{stats.top} hot set kept: {parts}")
    return 0


def _note_unknown_model(name: str | None) -> None:
    """A note on stderr, before the work, when --model is no preset: the log carries the name as given (a model of
    the user's own), and a typo (deepseek-v33) was first noted by `eplb replay`, after the synthesis."""
    if name is None or model_preset(name) is not None:
        return
    near = difflib.get_close_matches(name.strip().lower(), list(MODEL_PRESETS), n=1, cutoff=0.8)
    print(f"note: --model {shown(name)} is no preset ({', '.join(MODEL_PRESETS)}): the log names it as given, and "
          "eplb replay and compare time it by the preset of its expert count unless given --model"
          + (f"; did you mean {near[0]}?" if near else ""), file=sys.stderr)


def _synthesize(args: argparse.Namespace, out: Path, acc: StatsAccumulator) -> dict[str, Any]:
    """Draw the log `args` asks for, write it to `out` and feed its counts to `acc`; returns its config."""
    config: dict[str, Any]
    # A deflated .npz (counts or expert ids) takes less, by how much the data decides: its size is not checked
    # (--compress with a .jsonl is refused).
    deflated = args.compress
    if args.preset == "seed004":
        for field in ("experts", "top_k", "tokens", "exponent", "hot_ratio"):
            if getattr(args, field) is not None:
                raise EplbError(f"--preset seed004 fixes 256 experts, top-8, 4096 tokens and skew 0.4; drop "
                                f"{SYNTH_FLAGS[field]}")
        for field in ("groups", "group_std", "drift_std", "drift_steps", "shift_at", "shift_every"):
            if getattr(args, field) is not None:  # they were ignored
                raise EplbError(f"--preset seed004 draws each layer-step on its own, without expert groups, drift or "
                                f"regime shifts; drop {SYNTH_FLAGS[field]}")
        if args.format == "topk":
            raise EplbError("--preset seed004 draws counts only; use --format counts")
        steps, layers = (1 if v is None else v for v in (args.steps, args.layers))
        for flag, v in (("--steps", steps), ("--layers", layers)):
            if v < 1:
                raise EplbError(f"{flag} must be >= 1, got {v}")
        check_model_shape(args.model, layers, 256, 8, {**SYNTH_FLAGS, "experts": "--preset seed004",
                                                       "top_k": "--preset seed004"})  # fmt: skip
        _note_unknown_model(args.model)
        if not deflated:  # the writer stores them as uint16 (at most 4,096 x 8 a layer)
            _check_disk(out, steps * layers * 256 * 2.0, f"--steps {steps:,} x --layers {layers} x 256 experts' "
                        "counts of 2 bytes")
        with _synth_bar(args, steps) as bar:
            counts = seed004_log(steps, layers, args.seed, progress=bar)
        acc.add(counts)
        meta: dict[str, Any] = {"model": args.model, "top_k": 8}
        _write_counts(out, counts, meta, args.compress)
        config = {"preset": "seed004", "steps": steps, "layers": layers, "experts": 256, "top_k": 8,
                  "tokens": 4096, "skew": 0.4, "seed": args.seed}  # fmt: skip
    else:
        cfg = _synth_config(args)
        cfg.check(SYNTH_FLAGS)
        cfg.check_model(SYNTH_FLAGS)
        _note_unknown_model(cfg.model)
        output_log(out)  # a directory, or a file in the way: refused before the work
        try:
            exponent = cfg.resolved_exponent()
        except EplbError as exc:  # the library's messages say 'synth: ...'; the CLI's prefix says it already
            raise EplbError(str(exc).removeprefix("synth: ")) from None
        config = {"preset": "default", **_config_dict(cfg), "exponent_used": round(exponent, 6)}
        shape = f"--steps {cfg.steps:,} x --layers {cfg.layers}"  # the per-layer arrays fit (MemoryError): the log?
        if deflated:
            pass
        elif args.format == "topk":
            _check_disk(out, 2.0 * cfg.steps * cfg.tokens * cfg.layers * cfg.top_k,
                        f"{shape} x --tokens {cfg.tokens:,} x --top-k {cfg.top_k} expert ids of 2 bytes")
        else:
            # JSONL: a digit and a comma at least
            size = 2 if out.suffix.lower() == ".jsonl" else cfg.count_dtype.itemsize
            _check_disk(out, float(size) * cfg.steps * cfg.layers * cfg.experts,
                        f"{shape} x --experts {cfg.experts} counts of {size} bytes")
        _note_hot_ratio(args, cfg)
        if args.format == "topk":
            with _synth_bar(args, cfg.steps) as bar:
                bar.update(0, "calibrating co-activation")  # seconds, before the first step (SynthConfig)
                ids, offsets = synth_topk(cfg, progress=bar)
            acc.add(topk_counts(ids, offsets, cfg.experts))
            write_topk(out, ids, offsets, num_experts=cfg.experts, model=cfg.model, compress=args.compress)
        else:
            with _synth_bar(args, cfg.steps) as bar:

                def tee() -> Iterator[NDArray[Any]]:
                    for chunk in synth_counts(cfg):
                        acc.add(chunk)
                        yield chunk
                        bar.advance(chunk.shape[0])

                meta = {"model": cfg.model, "top_k": cfg.top_k, "num_steps": cfg.steps, "dtype": cfg.count_dtype}
                _write_counts(out, tee(), meta, args.compress)
    return config


def _synth_bar(args: argparse.Namespace, steps: int) -> Progress:
    """The progress bar of drawing (and writing) `steps` steps, once every flag is checked (--progress)."""
    return Progress(steps, "synth", enabled=args.progress, unit="steps")


def _config_dict(cfg: SynthConfig) -> dict[str, Any]:
    return {
        "steps": cfg.steps, "layers": cfg.layers, "experts": cfg.experts, "top_k": cfg.top_k, "tokens": cfg.tokens,
        "exponent": cfg.exponent, "hot_ratio": cfg.hot_ratio, "groups": cfg.groups, "group_std": cfg.group_std,
        "drift_std": cfg.drift_std, "drift_steps": cfg.drift_steps, "shift_at": list(cfg.shift_at),
        "shift_every": cfg.shift_every, "seed": cfg.seed, "model": cfg.model,
    }  # fmt: skip


def _write_counts(out: Path, counts: Any, meta: dict[str, Any], compress: bool) -> None:
    if out.suffix.lower() == ".jsonl":
        write_jsonl(out, counts, model=meta.get("model"), top_k=meta.get("top_k"), num_steps=meta.get("num_steps"))
    else:
        write_counts(out, counts, model=meta.get("model"), top_k=meta.get("top_k"), num_steps=meta.get("num_steps"),
                     dtype=meta.get("dtype"), compress=compress)  # fmt: skip


# --------------------------------------------------------------------------------------------
# eplb replay
# --------------------------------------------------------------------------------------------


def _writing(out: Path, name: str) -> AbstractContextManager[None]:
    """Run the block that writes file `name` of `--out DIR`: an OSError there is one error line (`writing`)."""
    return writing(out, "--out", name)


class _CsvSteps:
    """steps.csv in directory `out`, written block by block as the replay goes (write errors: `_writing`). A run
    before's rebalances.csv and summary.json there are removed first, so that a run failing after this one's
    steps.csv leaves DIR with no file of another run (links, such as one to a device, are left alone)."""

    HEADER = "step,layer,lb,oracle_lb,static_lb,no_eplb_lb,hindsight_lb,time_us\n"
    NAME = "steps.csv"
    LATER = ("rebalances.csv", "summary.json")

    def __init__(self, out: Path, layer_ids: list[int] | None, num_layers: int) -> None:
        self.out = out
        for name in self.LATER:
            old = out / name
            if old.is_file() and not old.is_symlink():
                with _writing(out, name):
                    old.unlink()
        with _writing(out, self.NAME):
            self.f = (out / self.NAME).open("w")
            self.f.write(self.HEADER)
        self.layers = np.asarray(layer_ids if layer_ids is not None else range(num_layers), dtype=np.int64)

    def __call__(self, block: StepBlock) -> None:
        n, layers = block.lb.shape
        cols = np.column_stack([
            np.repeat(block.steps, layers), np.tile(self.layers, n), block.lb.ravel(), block.oracle_lb.ravel(),
            block.static_lb.ravel(), block.no_eplb_lb.ravel(), block.hindsight_lb.ravel(), block.time_us.ravel(),
        ])  # fmt: skip
        fmt = "%d,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.3f\n"
        text = (fmt * cols.shape[0]) % tuple(cols.ravel().tolist())
        with _writing(self.out, self.NAME):
            self.f.write(text.replace("nan", ""))

    def of_log(self, _: int, block: StepBlock) -> None:
        """`eplb.executor.replay_logs`' on_steps (one log)."""
        self(block)

    def close(self, quiet: bool = False) -> None:
        """Close the file (flushing what is left); quiet: ignore a write error (another error is being reported)."""
        try:
            with _writing(self.out, self.NAME):
                self.f.close()
        except EplbError:
            if not quiet:
                raise


def run_replay(args: argparse.Namespace) -> int:
    check_groups(args)
    check_time_limit("--time-limit", args.time_limit)  # as eplb solve's and compare's, before the log is read
    if args.time_limit is not None and args.solver not in time_limited():
        raise EplbError(f"solver {args.solver!r} does not take --time-limit (it has no time limit): choose a solver "
                        f"that does ({', '.join(time_limited())})")
    log = open_log(args.log)
    info = log.info
    model = model_for(args, info)
    cluster = cluster_for(args, slots_for(args, info.num_experts, model), info.num_experts)
    cost = cost_setup(args, model)
    if args.oracle_every < 0:
        raise EplbError(f"--oracle-every must be >= 0 (0 skips the oracle), got {args.oracle_every}")
    schedule = schedule_from(args, cost)
    migration = migration_from(args, cost)
    out = output_dir(args.out, "--out", create=True) if args.out else None
    csv = None if out is None else _CsvSteps(out, info.layer_ids, info.num_layers)
    try:
        with executor_from(args) as executor:
            result = replay_logs(
                executor,
                [log],
                cluster,
                schedule=schedule,
                solver=args.solver,
                objective=args.objective,
                cost=cost,
                migration=migration,
                oracle_every=args.oracle_every,
                time_limit_s=args.time_limit,
                on_steps=None if csv is None else csv.of_log,
                progress=args.progress,
            )[0]
    except BaseException:
        if csv is not None:
            csv.close(quiet=True)  # the error in flight is the one to report
        raise
    if csv is not None:
        csv.close()
    if not result.summary["results"]["no_eplb"].get("steps"):
        raise EplbError(f"{args.log}: no step has tokens (every count is 0): there is no lb or time to report")
    if out is not None:
        with _writing(out, "rebalances.csv"), (out / "rebalances.csv").open("w") as f:
            f.write("step,moves,bytes_moved,transfer_s,charge_s,solve_ms,served\n")
            for rb in result.rebalances:
                moved = "" if rb.bytes_moved is None else f"{rb.bytes_moved:.0f}"
                transfer = "" if rb.transfer_s is None else f"{rb.transfer_s:.6f}"
                charge = "" if rb.charge_s is None else f"{rb.charge_s:.6f}"
                f.write(f"{rb.step},{rb.moves},{moved},{transfer},{charge},{rb.solve_ms:.3f},{int(rb.served)}\n")
        with _writing(out, "summary.json"):
            (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    if args.json:
        json.dump(result.summary, sys.stdout)
        print()
    else:
        print(format_summary(result, out))
    return 0


_LABELS = {
    "no_eplb": "no EPLB (id order)",
    "static": "static (first kept)",
    "replay": "replay",
    "hindsight": "hindsight (per interval)",
    "oracle": "oracle (per step)",
}


def format_summary(result: ReplayResult, out: Path | None = None) -> str:
    """The terminal table of a replay."""
    s = result.summary
    slots = result.cluster.slots_per_gpu
    lines = [
        f"log:        {result.info.describe()}",
        f"cluster:    {describe_slots(slots)}, {int(slots.sum())} slots per layer "
        f"({s['cluster']['redundant']} redundant)",
        f"schedule:   {result.schedule.describe(result.solver, result.checks[0]['step'] if result.checks else None)}",
    ]
    rb = s["rebalances"]
    skipped = (f" ({rb['skipped']:,} skipped: the copies of the rebalance before were still in flight)"
               if rb.get("skipped") else "")
    if rb["count"]:
        moved = "" if rb["bytes_moved"] is None else f", {rb['bytes_moved'] / GIB:,.1f} GiB"
        lines.append(
            f"rebalances: {rb['count']} of {rb['checks']} checks{skipped}, {rb['moves']:,} expert copies{moved} "
            f"({rb['slots_moved_fraction']:.1%} of the slots per rebalance); solve "
            f"{rb['solve_ms_mean']:,.1f} ms mean, {rb['solve_ms_max']:,.1f} ms max"
        )
    else:
        lines.append(f"rebalances: none in {rb['checks']} checks (the trigger kept the placement)" if rb["checks"]
                     else f"rebalances: none (the log ends before {result.schedule.first_step_words()})")
    for never in (r for r in rb["list"] if not r["served"]):
        lines.append(f"            the one at step {never['step']:,} never served: the log ended while its "
                     f"{never['moves']:,} expert copies were in flight (not charged)")
    if s["cost"]:
        c = s["cost"]
        tpg = "each step's own tokens" if c["tokens_per_gpu"] is None else f"T = {c['tokens_per_gpu']:,.0f} per GPU"
        link = f"{c['link_bandwidth'] / 1e9:g} GB/s link"
        if c.get("inter_node_bandwidth"):
            link = f"{c['link_bandwidth'] / 1e9:g} GB/s within a node, {c['inter_node_bandwidth'] / 1e9:g} GB/s between"
        lines.append(f"time model: {c['model']} on {c['hardware']}, {link}, {tpg}")
    lines.append("")
    head = (f"  {'':<26}{'lb mean':>9}{'lb p50':>9}{'lb p99':>9}{'lb max':>9}{'MoE ms/step':>13}{'migration s':>13}"
            f"{'total s':>10}{'vs no EPLB':>12}")  # fmt: skip
    lines.append(head)
    for name in BASELINES:
        r = s["results"][name]
        if not r.get("steps") or "lb_mean" not in r:
            sampled = name == "oracle" and s["schedule"].get("oracle_every")
            why = "(its sampled steps have no tokens)" if sampled else "(skipped)"
            lines.append(f"  {_LABELS[name]:<26}{why:>9}")
            continue
        t, mig, total = r.get("step_time_us"), r.get("migration_s"), r.get("total_time_s")
        speed = r.get("speedup_vs_no_eplb")
        label = _LABELS[name] if name != "replay" else f"replay ({result.solver})"
        lines.append(
            f"  {label:<26}{r['lb_mean']:>9.3f}{r['lb_p50']:>9.3f}{r['lb_p99']:>9.3f}{r['lb_max']:>9.3f}"
            f"{'' if t is None else f'{t / 1000:.3f}':>13}{'' if mig is None else f'{mig:.3f}':>13}"
            f"{'' if total is None else f'{total:.3f}':>10}{'' if speed is None else f'{speed:.3f}x':>12}"
        )
    for key, what in (("copies_per_token", "dispatch copies per token (GPUs a token's top-k reaches, vLLM's "
                       "replica rule)"), ("nodes_per_token", "nodes a token reaches")):  # fmt: skip
        values = {name: s["results"][name].get(key) for name in BASELINES}
        if any(v is not None for v in values.values()):
            shown = ", ".join(f"{_LABELS[name] if name != 'replay' else 'replay'} {v:.3f}"
                              for name, v in values.items() if v is not None)
            lines.append(f"  {what}: {shown}")
    ratio = s["results"]["replay"].get("hindsight_ratio")
    if ratio is not None:
        lines.append(f"  replay lb / hindsight lb: {ratio:.4f} (1.0: as good as a placement solved on each interval)")
    oe = s["schedule"]["oracle_every"]
    if oe > 1 and s["results"]["oracle"].get("steps"):
        sampled = plural(s["results"]["oracle"]["steps"], "step")
        lines.append(f"  (oracle on one step in {oe:,} only: lb over those {sampled}, total s scaled from them to all "
                     "steps)")
    lines.extend(s.get("notes", []))
    tm = s["timing"]
    lines.append("")
    rate = tm.get("evaluation_layer_steps_per_s")
    lines.append(
        f"replayed {plural(s['log']['steps'], 'step')} x {plural(s['log']['layers'], 'layer')} in {tm['wall_s']:.2f} "
        f"s: evaluation {tm['evaluation_s']:.2f} s ({'-' if rate is None else f'{rate:,.0f}'} layer-steps/s), solves "
        f"{tm['solve_s']:.2f} s, oracle {tm['oracle_s']:.2f} s"
    )
    if out is not None:
        lines.append(f"wrote {out / 'steps.csv'}, {out / 'rebalances.csv'}, {out / 'summary.json'}")
    return "\n".join(lines)
