"""`eplb solve` and `eplb evaluate`: a load window in, a validated placement and its balance out."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import numpy as np
from numpy.typing import NDArray

from eplb.budget import GIB, describe_slots, slots_per_gpu
from eplb.errors import EplbError, FieldError
from eplb.io.files import number_text, output_file, plural, same_file, write_text, writing
from eplb.io.windows import LoadWindow, read_window
from eplb.objective import OBJECTIVES
from eplb.progress import Progress
from eplb.rules import CLI_MAX_GPUS as CLI_MAX_GPUS  # eplb compare's bound too
from eplb.rules import MAX_BUDGET_BYTES
from eplb.solve import (
    DEFAULT_TOKENS_PER_GPU,
    Cluster,
    CostSetup,
    Outcome,
    check_cluster_fields,
    check_coactivation,
    evaluate,
    infer_model,
    least_stage_gib,
    model_mismatch,
    solve,
    solver_name,
    time_limited,
)
from eplb.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    ModelSpec,
    all_to_all_links,
    implausible_link,
    load_hardware,
    load_model,
    model_preset,
    named_model,
)
from solvers import registry
from solvers.registry import MAX_MOVES, MAX_MOVES_PER_LAYER, Options

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary
    from eplb.io.logs import LogInfo
    from eplb.placement import Placement

T = TypeVar("T")

SOLVE_DESCRIPTION = """\
Compute where every logical expert of every MoE layer goes: hot experts get extra replicas and all
replicas are packed so each GPU serves about the same number of tokens. Prints lb (busiest GPU / mean
GPU, per layer; 1.0 is perfect) next to the no-EPLB baseline (experts in id order, no redundancy),
a lower bound on lb, and the predicted per-layer time from the cost model.

Slots per GPU come from one of --slots-per-gpu, --redundant (extra replicas in all, spread evenly) or
--memory-budget-gib (HBM for expert weights per GPU; one slot costs one expert across all MoE layers).
Default: one redundant expert per GPU as the GPUs allow (none on one GPU, whose slots hold every expert once;
one slot per GPU when there are more GPUs than experts)."""

SOLVE_EPILOG = """\
examples:
  eplb solve                                   embedded DeepSeek-V3 window, 32 GPUs, 288 slots
  eplb solve --loads window.json --gpus 64 --redundant 64 --out placement.json
  eplb solve --loads window.npz --gpus 32 --gpus-per-node 8 --groups 8 --slots-per-gpu 9
  eplb solve --gpus 32 --memory-budget-gib 24 --model deepseek-v3 --json

load files: .json {"loads": [[...]]}, .npy/.npz [layers, E] or [steps, layers, E] (docs/formats.md)."""

MAX_COUNT = 2**31 - 1
"""Largest step count, slot count, ... a flag takes: longer windows or intervals than 2**31 steps make no sense."""
MAX_TOKENS_PER_GPU = 1e9
"""Tokens per GPU in one step (as the API)."""
MAX_STAGE_GIB = 1e6
"""GiB per stage of a migration plan (as the API)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `solve` and `evaluate` subcommands."""
    p = subparsers.add_parser(
        "solve",
        help="compute a placement for a load window",
        description=SOLVE_DESCRIPTION,
        epilog=SOLVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_loads(p)
    add_cluster_options(p, from_current=True)
    p.add_argument("--solver", choices=registry.names(), action=SolverChoice,
                   help="Default: incremental with --current, else greedy (docs/solvers.md)")
    p.add_argument("--time-limit", type=float, metavar="S", help="MILP time limit per layer, seconds (default: 5)")
    p.add_argument("--total-time-limit", type=float, metavar="S", help="MILP time limit for the whole solve, "
                   "seconds, shared by the layers (default: none; with it alone, no per-layer limit)")
    p.add_argument("--split", choices=("uniform", "weighted"),
                   help="MILP: weighted lets replicas serve unequal shares of their expert's tokens (the placement "
                   "file then carries `shares`; the serving system needs weighted replica selection to use them; "
                   "docs/solvers.md). Default: uniform, what vLLM, SGLang and TensorRT-LLM route "
                   "(--solver milp-weighted: weighted)")
    p.add_argument("--max-lb-slack", type=float, default=0.01, metavar="F",
                   help="the MILP with --current: accept lb up to (1 + F) x the best found to copy fewer experts; "
                   "greedy-coact: no swap may lift a GPU above greedy's busiest x (1 + F) (default: 0.01)")
    p.add_argument("--current", metavar="FILE", help="the placement serving now (ours, SGLang or TensorRT-LLM "
                   "file): GPUs are relabelled to overlap it and the moves (expert copies, bytes) are reported. "
                   "The cluster is its GPUs and slots per GPU: --gpus, --slots-per-gpu, --redundant and "
                   "--memory-budget-gib may be left out, and are refused when they ask for another shape (SGLang "
                   "and TensorRT-LLM files, which do not record their GPU count, need --gpus)")
    p.add_argument("--max-moves", type=int_at_most(MAX_MOVES, "expert copies"), metavar="N",
                   help="incremental: expert copies allowed in the whole model (default: until further copies buy "
                   "less than 0.1%% of lb)")
    p.add_argument("--max-moves-per-layer", type=int_at_most(MAX_MOVES_PER_LAYER, "expert copies per layer"),
                   metavar="N", help="incremental: expert copies per layer")
    p.add_argument("--target-lb", type=float, metavar="X", help="incremental: the fewest copies that bring every "
                   "layer to lb <= X (layers that cannot stop at their best)")
    p.add_argument("--frontier", action="store_true", help="with --current: print the moves-vs-lb curve of "
                   "incremental rebalancing for the whole model instead of one placement")
    p.add_argument("--plan", metavar="FILE", help="with --current: write the migration plan (ordered expert copies "
                   "in stages, JSON, docs/formats.md)")
    p.add_argument("--stage-gib", type=float, metavar="X", help="most GiB copied per stage of the plan (default: "
                   "one stage per layer; needs the model)")
    p.add_argument("--out", metavar="FILE", help="write the placement file here (JSON, docs/formats.md)")
    p.add_argument("--objective", choices=OBJECTIVES, default="lb", help="lb: balance tokens (every solver's own "
                   "objective); time: per layer, the lowest predicted layer time among the solver's placement, "
                   "co-located variants (with --coactivation) and one slot per expert (decode, where weight reads "
                   "bound); needs the model. Default: lb (docs/solvers.md, 'Objectives')")
    add_cost_options(p)
    add_coactivation_options(p)
    p.add_argument("--json", action="store_true", help="print the JSON object the HTTP API returns")
    add_progress_options(p, what="a line on stderr counting the solve's seconds",
                         when="when stderr is a terminal, once the solve has run a second")
    p.set_defaults(func=run_solve)

    e = subparsers.add_parser(
        "evaluate",
        help="balance and predicted time of an existing placement on a load window",
        description="Judge a placement file on a load window: per-layer lb, balancedness and imbalance "
        "next to the no-EPLB baseline, and the predicted per-layer time.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_loads(e)
    e.add_argument("--placement", required=True, metavar="FILE", help="placement file: eplb's JSON, or an SGLang, "
                   "TensorRT-LLM or vllm-ascend file (SGLang and TensorRT-LLM files need --gpus)")
    e.add_argument("--gpus", type=int_at_most(CLI_MAX_GPUS, "GPUs"), metavar="N", help="EP size, to read an SGLang or "
                   "TensorRT-LLM --placement (they do not record it)")
    e.add_argument("--gpus-per-node", type=int, metavar="M", help="GPUs per node, for copies per node (with "
                   "--coactivation)")
    add_cost_options(e)
    add_coactivation_options(e)
    e.add_argument("--json", action="store_true", help="print the JSON object the HTTP API returns")
    e.set_defaults(func=run_evaluate)


class SolverChoice(argparse.Action):
    """--solver NAME, stored as given; its help lists every registered solver with its summary, read from
    `solvers.registry` only when the help is shown (the classes hold them, and importing them all, the MILP's
    OR-Tools among them, costs 0.3 s of every start-up), followed by the help given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.given_help: str | None = None
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)

    @property  # argparse's attribute, read when the help is formatted
    def help(self) -> str:
        solvers = "; ".join(f"{name}: {registry.get_solver(name).summary}" for name in registry.names())
        return f"{solvers}. {self.given_help or ''}".replace("%", "%%")  # argparse %-formats help

    @help.setter
    def help(self, value: str | None) -> None:
        self.given_help = value


def _add_loads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", metavar="FILE", help="load window: .json, .npy or .npz (default: the embedded "
                   "DeepSeek-V3 prefill window from SGLang's published statistics, 58 layers x 256 experts)")


DEFAULT_GPUS = 32
"""--gpus when not given (and, for eplb solve, no --current placement gives it)."""


def add_cluster_options(p: argparse.ArgumentParser, *, from_current: bool = False) -> None:
    """--gpus, --gpus-per-node, --groups and one of --slots-per-gpu, --redundant, --memory-budget-gib
    (read back with `slots_for` and `eplb.solve.Cluster`). from_current: the command takes --current, whose
    placement gives the GPUs and slots the flags leave out (`cluster_slots`): --gpus is then None when not given."""
    p.add_argument("--gpus", type=int_at_most(CLI_MAX_GPUS, "GPUs"), default=None if from_current else DEFAULT_GPUS,
                   metavar="N", help="GPUs in the EP group (default: " + (
                       "the --current placement's, else " if from_current else "") + f"{DEFAULT_GPUS})")
    p.add_argument("--gpus-per-node", type=int, metavar="M", help="GPUs per node: the hierarchical policy (with "
                   "--groups), nodes per token with co-activation data, and a '+' --link")
    p.add_argument(
        "--groups", type=int, metavar="G", help="expert groups (DeepSeek's node-limited routing); needs "
        "--gpus-per-node: selects the hierarchical policy when G divides evenly over the nodes"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--slots-per-gpu", type=int_list, metavar="S", help="expert slots on each GPU: "
                        "one number, or a comma-separated list with one per GPU")
    budget.add_argument("--redundant", type=int, metavar="R", help="redundant experts in all, spread as "
                        "evenly as the GPUs allow (default: one per GPU; none on one GPU)")
    budget.add_argument("--memory-budget-gib", type=float_list, metavar="X", help="GiB of expert weights "
                        "each GPU may hold (one number or one per GPU): a slot holds one expert of the model "
                        "(--model, or its default) in every MoE layer")


def add_progress_options(
    p: argparse.ArgumentParser, what: str = "a progress bar on stderr", when: str = "when stderr is a terminal"
) -> None:
    """--progress / --no-progress into args.progress (None: when stderr is a terminal); what: what they show,
    when: when it is shown by default, for the help."""
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help=f"show {what} (default: {when})")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")


def add_cost_options(
    p: argparse.ArgumentParser,
    *,
    model_default: str = "the preset with the window's expert count",
    tokens_default: str = f"{DEFAULT_TOKENS_PER_GPU:,.0f}, a prefill-sized step",
    tokens_value: float | None = DEFAULT_TOKENS_PER_GPU,
    two_links: bool = True,
) -> None:
    """--model, --hardware, --link, --tokens-per-gpu, --overlap/--no-overlap: what the time prediction needs.
    model_default, tokens_default: what the help says --model and --tokens-per-gpu default to; tokens_value: the
    tokens per GPU when --tokens-per-gpu is not given (args.tokens_per_gpu_default); two_links: whether the help
    offers a '+' --link (within + between nodes: a command with --gpus-per-node). --hardware, --tokens-per-gpu
    and --overlap default to None, so `cost_setup` can tell them given (and refuse them without a model)."""
    p.add_argument("--model", metavar="NAME|FILE", help="model spec for memory and time: a preset ("
                   f"{', '.join(MODEL_PRESETS)}) or JSON file (default: {model_default})")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help=f"GPU spec: {', '.join(HARDWARE_PRESETS)} or a JSON file (default: {DEFAULT_HARDWARE})")
    p.add_argument("--link", help="all-to-all link: nvlink, nic, pcie or GB/s per GPU and direction "
                   "(default: nvlink)" + (", or two joined by '+', within + between nodes: nvlink+nic is DeepEP's "
                   "dispatch across nodes (once per node over the NIC, then NVLink; needs --gpus-per-node)"
                   if two_links else "; one link (no '+': the cluster shapes carry no GPUs per node)"))
    p.add_argument("--tokens-per-gpu", type=float, metavar="T",
                   help=f"tokens per GPU in one step for the time prediction (default: {tokens_default})")
    p.set_defaults(tokens_per_gpu_default=tokens_value)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                   help="all-to-all overlaps the expert GEMMs (two micro-batches, as DeepSeek runs; default), or with "
                   "--no-overlap adds to them")


def add_coactivation_options(p: argparse.ArgumentParser) -> None:
    """--coactivation FILE and --node-limit M (read back with `coactivation_for` and `cost_setup`)."""
    p.add_argument("--coactivation", metavar="FILE", help="which experts the window's tokens chose together: a "
                   "summary (.json, eplb.coactivation-summary/v1, or its .npz image) or a token-level log (.npz with "
                   "topk_ids). The predicted comm then counts one copy per GPU a token reaches, and copies per token "
                   "are printed (docs/cost-model.md, 'Co-activation')")
    p.add_argument("--node-limit", type=int, metavar="M", help="node-limited routing (DeepSeek-V3: 4): a token's "
                   "experts lie on at most M nodes of --gpus-per-node GPUs; caps the co-activation copies")


def check_node_limit(args: argparse.Namespace) -> None:
    """--node-limit without --coactivation is refused, before any file is read, as the API refuses node_limit
    without coactivation: the limit caps only the copies per token counted from the summary (without one nothing
    reads it, and the run would say nothing)."""
    if args.node_limit is not None and not args.coactivation:
        raise EplbError("--node-limit caps the nodes a token reaches, counted from the window's co-activation "
                        "summary: give --coactivation FILE (a summary or a token-level log, docs/formats.md) or "
                        "drop --node-limit")


def coactivation_for(args: argparse.Namespace, window: LoadWindow) -> CoactivationSummary | None:
    """The --coactivation summary of the window's shape and loads (`CoactivationSummary.window_contradiction`, the
    API's check), or None."""
    if not args.coactivation:
        return None
    from eplb.coactivation import read_summary

    summary = read_summary(args.coactivation, window.num_experts, num_layers=window.num_layers,
                           layer_ids=window.meta.get("layer_ids"))
    why = summary.window_contradiction(window.loads)
    if why is not None:
        raise EplbError(f"--coactivation {args.coactivation} contradicts the load window {window.source}: {why}")
    return summary


def int_list(text: str) -> list[int]:
    """argparse type: `9` or `8,8,10` -> [int], each at most MAX_COUNT."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or a comma-separated list, got {text!r}") from None
    for v in values:
        if v > MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{v} is too large (at most {MAX_COUNT:,})")
    return values


def check_time_limit(flag: str, seconds: float | None) -> None:
    """A time limit's flag (--time-limit, --total-time-limit): None (not given) or seconds > 0 and finite; inf or nan
    (a MILP without end) and the rest are refused naming the flag. eplb solve's, compare's and replay's check."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise EplbError(f"{flag} must be > 0 seconds and finite, got {seconds:g}")


def int_at_most(limit: int, unit: str) -> Callable[[str], int]:
    """argparse type: a whole number <= limit (`unit` says what it counts, for the message). Lower bounds are
    checked where the value is used."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} is too large (at most {limit:,} {unit})")
        return value

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse


def float_list(text: str) -> list[float]:
    """argparse type: `24` or `20,24` -> [float]."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list, got {text!r}") from None


def model_for(args: argparse.Namespace, data: LoadWindow | LogInfo) -> ModelSpec | None:
    """The model for memory and time: --model; else, for a routing log, the preset its header names; else
    (with a note on stderr when the log names a model no preset has) the preset with the data's expert and layer
    count (None when none). A model the data cannot be of (`ModelSpec.window_mismatch`: other experts, more layers
    than its MoE layers; `eplb compare --layers N` counts N) is refused naming the flags that change it."""
    given = bool(args.model)
    named = None if isinstance(data, LoadWindow) else model_preset(data.model)  # the preset the log names
    if args.model:
        model = load_model(args.model)
    elif not isinstance(data, LoadWindow) and data.model and data.model.strip():
        try:
            model = named_model(data.model, str(data.path))
        except EplbError as exc:  # e.g. a Hugging Face name: say so, then infer as for a log that names none
            guess = infer_model(data.num_experts, data.num_layers)
            then = (f"using {guess.name!r}, the preset with its {data.num_experts} experts and {data.num_layers} "
                    "layers" if guess else "no preset matches its shape: no times and no bytes")
            print(f"note: {exc}; {then}", file=sys.stderr)
            return guess
    else:
        return infer_model(data.num_experts, data.num_layers)
    layers, experts = data.num_layers, data.num_experts
    if getattr(args, "layers", None) is not None and 0 < args.layers < layers:  # eplb compare uses the first N
        layers = args.layers
    loads = isinstance(data, LoadWindow)
    named_by = None if isinstance(data, LoadWindow) or given else data.path  # the log names the model
    # dropping --model helps unless the log names a preset its data cannot be of too
    drop = "" if named is not None and named.window_mismatch(layers, experts) is not None else "; or drop --model"

    def way(need: str, rows: str | None) -> str:
        if named_by is not None:
            return f"{named_by} names it as its model: give --model NAME or FILE, {need}, to override it"
        data_way = "" if rows is None else f"; or {'--loads' if loads else 'a log'} with {rows}"
        return f"give --model {need}, a preset or a JSON file{data_way}{drop}"

    why = model_mismatch(model, layers, experts, "the loads have" if loads else "the log has", way)
    if why is not None:
        raise EplbError(why)  # replay's Python API: the same rule, its own words (eplb.replay.run._check_shapes)
    return model


def check_groups(args: argparse.Namespace) -> None:
    """--groups selects the hierarchical policy together with --gpus-per-node: alone it would be ignored."""
    if args.groups is not None and args.gpus_per_node is None:
        raise EplbError(f"--groups {args.groups} needs --gpus-per-node: the hierarchical policy keeps each expert "
                        "group within a node; give both, or drop --groups")


def slots_for(args: argparse.Namespace, num_experts: int, model: ModelSpec | None,
              num_gpus: int | None = None) -> NDArray[np.int64]:
    """Slots per GPU [--gpus] from `add_cluster_options`' budget (default: `slots_per_gpu`'s); num_gpus: the GPUs
    when --gpus did not give them (a --current placement's), else DEFAULT_GPUS."""
    if args.memory_budget_gib is not None and model is None:
        raise EplbError(f"--memory-budget-gib needs --model: no preset has {num_experts} experts")
    most = MAX_BUDGET_BYTES / GIB  # the service's bound; beyond 1.6e299 GiB the bytes were inf ('must be finite')
    for x in args.memory_budget_gib or ():
        if math.isfinite(x) and x > most:
            raise EplbError(f"--memory-budget-gib {x:g}: more than any GPU holds (at most {most:,.0f} GiB)")
    gpus = args.gpus if args.gpus is not None else num_gpus if num_gpus is not None else DEFAULT_GPUS
    return slots_per_gpu(
        gpus,
        num_experts,
        slots=args.slots_per_gpu,
        num_redundant=args.redundant,
        memory_budget_bytes=None if args.memory_budget_gib is None else [x * GIB for x in args.memory_budget_gib],
        slot_bytes=None if model is None else model.expert_bytes_all_layers,
        names=BUDGET_FLAGS,
    )


def cluster_slots(args: argparse.Namespace, num_experts: int, model: ModelSpec | None,
                  current: Placement | None) -> NDArray[np.int64]:
    """Slots per GPU of `eplb solve`'s cluster: with a --current placement, its own (read with --gpus, which
    `read_placement_for` refuses when the file records another GPU count), and a budget flag
    (--slots-per-gpu, --redundant, --memory-budget-gib) that asks for other slots is refused naming both;
    without one, `slots_for`'s."""
    if current is None:
        return slots_for(args, num_experts, model)
    own = current.slots_per_gpu
    given = [(flag, value) for flag, value in (("--slots-per-gpu", args.slots_per_gpu), ("--redundant", args.redundant),
                                               ("--memory-budget-gib", args.memory_budget_gib)) if value is not None]
    if not given:
        return own
    asked = slots_for(args, num_experts, model, current.num_gpus)
    if asked.tolist() != own.tolist():
        flag, value = given[0]
        text = ",".join(f"{v:g}" for v in value) if isinstance(value, list) else str(value)
        raise EplbError(f"{flag} {text} asks for {describe_slots(asked)}, but --current {args.current} is for "
                        f"{describe_slots(own)}: moves are counted between placements of one cluster shape; drop "
                        f"{flag} (the shape is then the current placement's), or give a --current of that shape")
    return asked


def cluster_for(args: argparse.Namespace, slots: NDArray[np.int64], num_experts: int) -> Cluster:
    """The Cluster of slots per GPU `slots` with --gpus-per-node and --groups, refused naming the flag when they do
    not divide the GPUs or the `num_experts` experts (`eplb.solve.check_cluster_fields`, the service's check, whose
    words name no flag)."""
    cluster = Cluster(slots, args.gpus_per_node, args.groups)
    try:
        check_cluster_fields(num_experts, cluster)
    except FieldError as exc:
        flag = {"cluster.gpus_per_node": ("--gpus-per-node", slots.size),
                "cluster.num_groups": ("--groups", num_experts)}
        if exc.fields[0] not in flag:
            raise EplbError(exc.message) from None
        name, whole = flag[exc.fields[0]]
        raise EplbError(f"{exc.message}: give {name} a divisor of {whole}") from None
    return cluster


BUDGET_FLAGS = {"num_gpus": "--gpus", "slots": "--slots-per-gpu", "num_redundant": "--redundant",
                "memory_budget_bytes": "--memory-budget-gib"}  # fmt: skip
"""`eplb.budget.slots_per_gpu`'s arguments as `add_cluster_options` names them, for its messages (as
`OPTION_FLAGS` for the registry's); the Python API and the service keep `eplb.budget.QUANTITIES`."""


DEFAULT_HARDWARE = "b200"
"""--hardware when not given."""


def tokens_per_gpu(args: argparse.Namespace) -> float | None:
    """Tokens per GPU of the time prediction: --tokens-per-gpu, else the command's default (None: each step's own
    tokens, or the window as one step)."""
    given: float | None = args.tokens_per_gpu
    return given if given is not None else getattr(args, "tokens_per_gpu_default", None)


def cost_setup(args: argparse.Namespace, model: ModelSpec | None) -> CostSetup | None:
    """The cost setup from `add_cost_options` (None without a model: no time prediction, and the flags that only
    shape it are refused, naming the first given)."""
    node_limit = getattr(args, "node_limit", None)
    if model is None:
        overlap = None if args.overlap is None else "--overlap" if args.overlap else "--no-overlap"
        for flag, given, what in (
            ("--link", args.link, "times the all-to-all"),
            ("--hardware", args.hardware, "is the GPU the time prediction runs on"),
            ("--tokens-per-gpu", args.tokens_per_gpu, "sizes the step the time prediction times"),
            (overlap, overlap, "says how the predicted all-to-all meets the expert GEMMs"),
            ("--node-limit", node_limit, "caps the predicted co-activation copies"),
        ):
            if given is not None:
                raise EplbError(f"{flag} {what}, which needs a model: give --model NAME or FILE (no preset matches "
                                "the data's expert and layer count)")
        return None
    hardware = load_hardware(args.hardware or DEFAULT_HARDWARE)
    tokens = tokens_per_gpu(args)
    if tokens is not None and not 0 < tokens <= MAX_TOKENS_PER_GPU:
        raise EplbError(f"--tokens-per-gpu must be > 0 and at most {MAX_TOKENS_PER_GPU:,.0f}, got {tokens:g}")
    if node_limit is not None and node_limit < 1:
        raise EplbError("--node-limit must be >= 1 (nodes a token's experts may lie on)")
    link = args.link or "nvlink"
    within, between = flag_link("--link", link, lambda: all_to_all_links(hardware, link))
    for bw in (within, between):
        check_link(bw, "--link", link)
    return CostSetup(model, hardware, within, tokens, args.overlap is not False, node_limit, between)


def flag_link(flag: str, text: str, read: Callable[[], T]) -> T:
    """`read()` (a link's bandwidth from `text`, e.g. `eplb.specs.link_bandwidth`) with its error naming `flag`:
    a command may take two link flags (--link, --migration-link)."""
    try:
        return read()
    except EplbError as exc:
        raise EplbError(f"{flag} {text}: {exc}") from None


def check_link(bw: float | None, flag: str, text: str) -> None:
    """Refuse an implausible link bandwidth (B/s; None: no link; `eplb.specs.implausible_link`: a hardware file's
    link too) of `flag` given as `text`."""
    wrong = None if bw is None else implausible_link(bw / 1e9)
    if wrong is not None:
        raise EplbError(f"{flag} {text}: {wrong}")


DEFAULTS: dict[str, object] = {"--max-lb-slack": 0.01, "--objective": "lb"}
"""The flags of `eplb solve` with a default other than None (what `_given` takes for not given)."""


def _given(*pairs: tuple[str, object]) -> list[str]:
    """The flags of `pairs` (flag, value) that were given: a value other than None, False and the flag's default."""
    return [flag for flag, value in pairs if value is not None and value is not False and value != DEFAULTS.get(flag)]


def _check_frontier(args: argparse.Namespace) -> None:
    """--frontier prints a curve, no placement: refuse the flags that would then be ignored, naming them."""
    if not args.frontier:
        return
    ignored = _given(("--out", args.out), ("--plan", args.plan), ("--stage-gib", args.stage_gib),
                     ("--solver", None if args.solver == "incremental" else args.solver),
                     ("--time-limit", args.time_limit),
                     ("--total-time-limit", args.total_time_limit), ("--max-moves", args.max_moves),
                     ("--max-moves-per-layer", args.max_moves_per_layer), ("--target-lb", args.target_lb),
                     ("--max-lb-slack", args.max_lb_slack), ("--split", args.split), ("--objective", args.objective))
    if ignored:
        raise EplbError(f"--frontier prints the copies-vs-lb curve of incremental rebalancing and writes no placement "
                        f"or plan: drop {', '.join(ignored)} (or drop --frontier and get one placement)")


OPTION_FLAGS = {"time_limit_s": "--time-limit", "total_time_limit_s": "--total-time-limit",
                "max_lb_slack": "--max-lb-slack", "max_moves": "--max-moves",
                "max_moves_per_layer": "--max-moves-per-layer", "target_lb": "--target-lb",
                "robust": "--robust-windows"}  # fmt: skip
"""`solvers.registry.Options`' fields as the CLI's flags name them, for the registry's messages
(`registry.check_options`); the API's messages keep the field names."""


def solve_options(args: argparse.Namespace) -> Options:
    """The solver options `eplb solve` was given (a solver that does not take one refuses a value set)."""
    return Options(max_moves=args.max_moves, max_moves_per_layer=args.max_moves_per_layer, target_lb=args.target_lb,
                   max_lb_slack=args.max_lb_slack, time_limit_s=args.time_limit,
                   total_time_limit_s=args.total_time_limit)  # fmt: skip


def _check_options(args: argparse.Namespace, options: Options) -> None:
    """Refuse, naming the flags (`OPTION_FLAGS`), a move budget without --current, a time limit for a solver
    (--solver, or its default) without one, and any other option the solver does not take or value it refuses
    (`registry.check_options`)."""
    given = options.set_names()
    bounds = [OPTION_FLAGS[o] for o in registry.BUDGET_OPTIONS if o in given]
    if bounds and not args.current:  # --target-lb is no budget: it says where the edits may stop
        budgets = sum(flag != "--target-lb" for flag in bounds)
        kinds = [*(["a move budget" if budgets == 1 else "move budgets"] if budgets else []),
                 *(["a target lb"] if "--target-lb" in bounds else [])]
        verb = "bounds" if kinds in (["a move budget"], ["a target lb"]) else "bound"
        raise EplbError(f"{', '.join(bounds)}: {' and '.join(kinds)} {verb} the edits of the serving placement: give "
                        "it with --current FILE")
    name = solver_name(args.solver or ("incremental" if args.current else "greedy"), args.split)
    if registry.get_solver(name).capabilities.requires_current and not args.current:
        raise EplbError(f"solver {name!r} rebalances a serving placement: give it with --current FILE (or a solver "
                        "that places from scratch: " + ", ".join(
                            n for n in registry.names() if not registry.get_solver(n).capabilities.requires_current)
                        + ")")
    takes = registry.get_solver(name).options
    refused = [OPTION_FLAGS[o] for o in ("time_limit_s", "total_time_limit_s") if o in given and o not in takes]
    if refused:
        able = time_limited()
        raise EplbError(f"solver {name!r} does not take {', '.join(refused)} (it has no time limit): choose a solver "
                        f"that does ({', '.join(able)})")
    try:
        registry.check_options(name, options, has_current=bool(args.current), names=OPTION_FLAGS)
    except registry.SolverError as exc:
        raise EplbError(str(exc)) from None


def _check_stage(args: argparse.Namespace, model: ModelSpec | None, num_experts: int) -> None:
    """--stage-gib holds at least one expert copy of the model (a stage moves whole copies)."""
    if args.stage_gib is None:
        return
    if model is None:
        raise EplbError(f"--stage-gib needs --model: a stage is counted in expert copies of the model (no preset "
                        f"matches the loads' {num_experts} experts and layers)")
    least = least_stage_gib(model, args.stage_gib)
    if least is not None:
        raise EplbError(f"--stage-gib {args.stage_gib:g}: a stage must hold one expert copy of {model.name}, "
                        f"at least {least:g} GiB")


def run_solve(args: argparse.Namespace) -> int:
    _check_frontier(args)
    check_groups(args)
    check_node_limit(args)
    # --out may be the --current placement (replaced whole after the solve: the incremental workflow); no other
    # input, and --plan none at all
    inputs = [("--loads", args.loads), ("--model", args.model), ("--hardware", args.hardware),
              ("--coactivation", args.coactivation)]
    if args.out is not None:
        output_file(args.out, "--out", (".json",), inputs)
    if args.plan is not None:
        output_file(args.plan, "--plan", (".json",), [*inputs, ("--current", args.current)])
    if (args.plan or args.frontier or args.stage_gib is not None) and not args.current:
        raise EplbError("--plan, --stage-gib and --frontier need --current: the placement serving now")
    if args.plan and args.out and same_file(args.plan, args.out):
        raise EplbError(f"--plan and --out are both {args.out}: the plan would overwrite the placement; give two files")
    if args.stage_gib is not None and not 0 < args.stage_gib <= MAX_STAGE_GIB:
        raise EplbError(f"--stage-gib must be > 0 and at most {MAX_STAGE_GIB:g} GiB, got {args.stage_gib:g}")
    check_time_limit("--time-limit", args.time_limit)
    check_time_limit("--total-time-limit", args.total_time_limit)
    if not 0 <= args.max_lb_slack <= 1:
        raise EplbError("--max-lb-slack must be between 0 and 1 (0.01 = lb within 1% of the best), got "
                        f"{number_text(args.max_lb_slack)}")
    options = solve_options(args)
    _check_options(args, options)
    window = read_window(args.loads)
    model = model_for(args, window)
    _check_stage(args, model, window.num_experts)
    layer_ids = window.meta.get("layer_ids")
    current = None
    if args.current:
        from eplb.io.foreign import read_placement_for  # lazy: YAML support costs start-up time

        current = read_placement_for(args.current, window.num_layers, window.num_experts, layer_ids=layer_ids,
                                     num_gpus=args.gpus, gpus_flag="--gpus")
    slots = cluster_slots(args, window.num_experts, model, current)
    cluster = cluster_for(args, slots, window.num_experts)
    if args.frontier:
        assert current is not None
        return _print_frontier(window.loads, cluster, current.phy2log, args.json)
    ticker = Ticker("solve", enabled=args.progress, after=0.0 if args.progress else 1.0)

    def starting(name: str) -> None:  # every input checked: no refusal follows
        _milp_progress(args, name, window.num_layers)
        ticker.start(f"{name}, {plural(window.num_layers, 'layer')} x {plural(window.num_experts, 'expert')} on "
                     f"{plural(cluster.num_gpus, 'GPU')}")

    cost = cost_setup(args, model)
    coactivation = coactivation_for(args, window)
    check_coactivation(args.solver, coactivation, give="give --coactivation FILE (a summary or a token-level log)")
    with ticker:
        outcome = solve(
            window.loads,
            cluster,
            solver=args.solver,
            cost=cost,
            current=current,
            options=options,
            split=args.split,
            stage_bytes=None if args.stage_gib is None else args.stage_gib * GIB,
            objective=args.objective,
            coactivation=coactivation,
            starting=starting,
        )
    if args.out:
        from eplb.io.exports import write_export

        with writing(args.out, "--out"):
            write_export(outcome.placement, "json", args.out, layer_ids=layer_ids)
    if args.plan and outcome.plan is not None:
        write_text(args.plan, json.dumps(outcome.plan.to_dict()), "--plan")
    if args.json:
        json.dump(outcome.to_dict(), sys.stdout)
        print()
    else:
        print("\n".join([_summary(window, outcome, model, args.out, _policy(args, outcome)), *_notes(args, outcome)]))
    return 0


class Ticker(Progress):
    """The progress line of work that counts no units (a solve: one compiled call per solver, at 65,536 GPUs
    half a minute): `solve  12.3 s elapsed (greedy, 58 layers x 256 experts on 65,536 GPUs)` on stderr, redrawn
    twice a second by a thread from `start` until the `with` block ends, once `after` seconds have passed (a quick
    solve draws nothing). enabled: as `Progress` (default: when stderr is a terminal)."""

    def __init__(self, label: str, *, enabled: bool | None = None, after: float = 1.0, every: float = 0.5,
                 stream: TextIO | None = None) -> None:  # fmt: skip
        super().__init__(None, label, stream, enabled)
        self.wanted, self.enabled = self.enabled, False  # drawn from `after` on
        self.after, self.every = after, every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        return self

    def start(self, note: str = "") -> None:
        """Count the seconds from now on, `note` after them (once; nothing when not wanted)."""
        if not self.wanted or self._thread is not None:
            return
        self.note, self.started = note, time.monotonic()
        self._thread = threading.Thread(target=self._tick, name="eplb-ticker", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        if self._stop.wait(self.after):
            return
        self.enabled = True
        while True:
            self.update(0, self.note)
            if self._stop.wait(self.every):
                return

    def close(self) -> None:
        """Stop the thread; the line, when drawn, gets its last state and its end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        super().close()

    def text(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.label} {time.monotonic() - self.started:5.1f} s elapsed{note}"


def _milp_progress(args: argparse.Namespace, name: str, num_layers: int) -> None:
    """The MILP's 'solving ...' line on stderr, when solver `name` (the registry's) is one: `solve` calls this once
    every input is checked, so no refusal follows it."""
    if name not in ("milp", "milp-weighted"):
        return
    from solvers.milp import DEFAULT_LAYER_LIMIT_S

    per_layer = args.time_limit or args.total_time_limit or DEFAULT_LAYER_LIMIT_S
    waves = -(-num_layers // max(1, os.cpu_count() or 1))
    at_most = min(waves * per_layer, args.total_time_limit or math.inf)
    print(f"solving {num_layers} layers with the MILP, up to {per_layer:g} s per layer on "
          f"{os.cpu_count()} cores (about {at_most:,.0f} s at most)...", file=sys.stderr)


def _notes(args: argparse.Namespace, outcome: Outcome) -> list[str]:
    """Lines after the summary: why a placement is predicted slower than no EPLB, and how far --target-lb got."""
    lines = []
    p, pred, base = outcome.placement, outcome.prediction, outcome.baseline_prediction
    slower = pred is not None and base is not None and pred.total_time_us > base.total_time_us
    if slower and p.num_physical > p.num_experts and bool((p.phy2log >= 0).all()):
        from eplb.replay.summary import weight_reads_note

        lines.append(weight_reads_note(p.num_experts, p.num_physical, (
            ": against a serving placement no slot is left empty (--objective time leaves redundant slots empty only "
            "from scratch)" if args.current and args.objective == "time" else
            "; fewer redundant slots (--redundant, or --objective time) read less")))
    if args.target_lb is not None:
        spent = outcome.moves
        budget = spent is not None and (
            (args.max_moves is not None and int(spent.sum()) >= args.max_moves)
            or (args.max_moves_per_layer is not None and int(spent.max()) >= args.max_moves_per_layer))
        lines.append(_target_note(args.target_lb, outcome.balance.lb, budget, outcome.solver.get("fresh_layers")))
    return lines


FROM_SCRATCH_GROUPS = ("greedy", "deepseek", "milp", "milp-weighted")
"""The solvers that place from scratch by greedy's rule for --groups with --gpus-per-node (the MILP solves node by node
from greedy's placement): the hierarchical policy when the groups divide evenly over the nodes, else the global one."""


def _policy(args: argparse.Namespace, outcome: Outcome) -> str:
    """The summary's `policy:` line: which policy placed the experts (hierarchical: expert groups kept within nodes;
    global: over all GPUs) and, when --groups with --gpus-per-node asked for the hierarchical one and it did not run,
    why (`_why_not_hierarchical`)."""
    name, p = outcome.solver.get("name"), outcome.placement
    asked = args.groups is not None and args.gpus_per_node is not None
    why = _why_not_hierarchical(args.groups, args.gpus_per_node, p.num_gpus, p.num_experts)
    head = "policy:     "
    if not asked:
        return f"{head}global: experts placed over all {plural(p.num_gpus, 'GPU')} (the hierarchical policy, expert " \
               "groups kept within nodes, needs --groups with --gpus-per-node)"
    fell_back = f"global, not hierarchical (--groups {args.groups} --gpus-per-node {args.gpus_per_node}): {why}"
    kept = (f"hierarchical: {plural(args.groups, 'expert group')} kept within the "
            f"{plural(p.num_gpus // args.gpus_per_node, 'node')} of {args.gpus_per_node} GPUs")
    if name in FROM_SCRATCH_GROUPS:
        return head + (fell_back if why else kept)
    # incremental: its edits keep the groups where --current has them; the layers it re-solves go by greedy's rule
    line = (f"{head}hierarchical edits: an expert moves only onto the nodes of {args.gpus_per_node} GPUs where "
            f"--current holds its group (of {args.groups})")
    fresh = outcome.solver.get("fresh_layers") or []
    if fresh:
        line += f"; the {plural(len(fresh), 'layer')} re-solved fresh by greedy: {fell_back if why else kept}"
    return line


def _why_not_hierarchical(groups: int | None, gpus_per_node: int | None, num_gpus: int, num_experts: int) -> str:
    """Why greedy's and DeepSeek's hierarchical policy does not apply to `groups` expert groups with `gpus_per_node`
    (solvers/greedy.py's rule: more than one node, the experts split into the groups, the groups divide evenly over
    the nodes), or "" when it does or was not asked for."""
    if groups is None or gpus_per_node is None:
        return ""
    nodes = num_gpus // gpus_per_node
    if nodes <= 1:
        return f"the {num_gpus} GPUs are one node of {gpus_per_node}, so there is no node to keep a group within"
    if num_experts % groups:
        return f"{num_experts} experts do not split into {groups} equal groups"
    if groups % nodes:
        return (f"{groups} groups do not divide evenly over the {nodes} nodes ({num_gpus} GPUs / {gpus_per_node} per "
                f"node): give a multiple of {nodes} groups")
    return ""


def _target_note(target_lb: float, lb: NDArray[np.float64], budget: bool, fresh_layers: list[int] | None) -> str:
    """How far --target-lb got on the layers' ``lb [L]``: how many reached it, why the others did not (a move budget
    ran out; no edit gets there, and, when the solver looked (``fresh_layers`` not None: no budget), fresh greedy
    neither gets there nor is more than 1% better, or does not get there either), and which layers took fresh greedy
    instead of edits."""
    from eplb.io.exports import ranges
    from solvers.incremental import FRESH_LB_TOLERANCE

    short = lb > target_lb * (1 + 1e-9)
    fresh = np.zeros(lb.size, dtype=np.bool_)
    fresh[np.asarray(fresh_layers or [], dtype=np.int64)] = True
    margin = f"{(FRESH_LB_TOLERANCE - 1) * 100:g}%"
    line = f"target lb {target_lb:g}: reached on {int((~short).sum())} of {lb.size} layers"
    if short.any() and (budget or fresh_layers is None):
        line += " (a move budget ran out first)" if budget else " (no edit of the serving placement gets there)"
    elif short.any():
        line += " (" + "; ".join(f"{plural(n, 'layer')}: {text}" for n, text in (
            (int((short & ~fresh).sum()), f"no edit of the serving placement gets there, and fresh greedy neither "
                                          f"gets there nor is more than {margin} better"),
            (int((short & fresh).sum()), "fresh greedy does not get there either")) if n) + ")"
    if fresh.any():
        line += (f"; where edits stopped short and fresh greedy got there or was more than {margin} better, "
                 f"{plural(int(fresh.sum()), 'layer')} took it (solver.fresh_layers): {ranges(fresh_layers or [])}")
    return line


def _print_frontier(
    loads: NDArray[np.float64], cluster: Cluster, current: NDArray[np.int64], as_json: bool
) -> int:
    """--frontier: whole-model expert copies vs lb of incremental rebalancing from `current`."""
    from solvers.incremental import frontier, trajectories

    hierarchical = cluster.num_groups is not None and cluster.gpus_per_node is not None
    traj = trajectories(loads, current, cluster.slots_per_gpu, num_groups=cluster.num_groups if hierarchical else None,
                        gpus_per_node=cluster.gpus_per_node if hierarchical else None)
    curve = frontier(traj)
    if as_json:
        json.dump({"frontier": curve.to_dict()}, sys.stdout)
        print()
        return 0
    print(f"{'copies':>8}{'lb mean':>10}{'lb max':>10}   (incremental rebalancing from --current; eplb solve "
          "--max-moves N gives a point)")
    shown = np.unique(np.linspace(0, curve.copies.size - 1, num=min(25, curve.copies.size)).round().astype(int))
    for i in shown.tolist():
        print(f"{int(curve.copies[i]):>8}{curve.lb_mean[i]:>10.4f}{curve.lb_max[i]:>10.4f}")
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from eplb.io.foreign import read_placement_for

    if args.gpus is not None and args.gpus < 1:
        raise EplbError(f"--gpus must be >= 1, got {args.gpus}")
    check_node_limit(args)
    window = read_window(args.loads)
    placement = read_placement_for(args.placement, window.num_layers, window.num_experts,
                                   layer_ids=window.meta.get("layer_ids"), num_gpus=args.gpus, gpus_flag="--gpus")
    model = model_for(args, window)
    if args.gpus_per_node is not None and (args.gpus_per_node < 1 or placement.num_gpus % args.gpus_per_node):
        raise EplbError(f"--gpus-per-node {args.gpus_per_node} does not divide the {placement.num_gpus} GPUs")
    outcome = evaluate(window.loads, placement, cost_setup(args, model),
                       coactivation=coactivation_for(args, window), gpus_per_node=args.gpus_per_node)
    if args.json:
        json.dump(outcome.to_dict(), sys.stdout)
        print()
    else:
        print(_summary(window, outcome, model, None))
    return 0


def _summary(window: LoadWindow, outcome: Outcome, model: ModelSpec | None, out: str | None,
             policy: str | None = None) -> str:
    p = outcome.placement
    slots = p.slots_per_gpu
    lines = [
        f"loads:      {window.source}: {plural(window.num_layers, 'layer')} x {plural(window.num_experts, 'expert')}",
        f"cluster:    {describe_slots(slots)}, {p.num_physical} slots per layer "
        f"({p.num_physical - p.num_experts} redundant)",
    ]
    if outcome.solver:
        s = outcome.solver
        lines.append(f"solver:     {s['name']} ({s['status']}), {s['wall_ms']:.1f} ms")
    if policy is not None:
        lines.append(policy)
    new, base = outcome.balance, outcome.baseline
    tokens = new.has_tokens  # a layer without tokens has no lb and counts in no mean (Balance.lb_over_tokens)
    rows: list[tuple[str, str, str, str]] = [
        ("", "lb mean", "lb max", "balancedness min"),
        ("baseline (contiguous)", *_lb_cells(base.lb_over_tokens()), _min_cell(base.balancedness[tokens])),
        ("placement", *_lb_cells(new.lb_over_tokens()), _min_cell(new.balancedness[tokens])),
    ]
    if outcome.solver:
        bound = np.asarray(outcome.solver["bound"], dtype=np.float64)[tokens]
        rows.append(("lower bound", *_lb_cells((float(bound.mean()), float(bound.max())) if bound.size else None),
                     ""))
    lines.append("")
    lines.extend(f"  {a:<24}{b:>9}{c:>9}{d:>18}" for a, b, c, d in rows)
    if not tokens.all():
        empty = int((~tokens).sum())
        lines.append(f"  ({plural(empty, 'layer')} of {p.num_layers} without tokens: no lb, left out of the above)")
    if outcome.prediction is not None and outcome.baseline_prediction is not None and model is not None:
        t_new, t_base = outcome.prediction, outcome.baseline_prediction
        busy = t_new.tokens_per_gpu[tokens]  # T of the layers with tokens: an idle layer's T is 0
        lines.append("")
        lines.append(
            f"predicted MoE time of one step ({model.name}, T = {float(np.median(busy)) if busy.size else 0.0:,.0f} "
            "tokens/GPU, --tokens-per-gpu): "
            f"{t_new.total_time_us / 1000:,.3f} ms per step over {p.num_layers} layers "
            f"(baseline {t_base.total_time_us / 1000:,.3f} ms, {_ratio(t_base.total_time_us, t_new.total_time_us)})"
        )
        counts = {b: t_new.bottleneck.count(b) for b in sorted(set(t_new.bottleneck))}
        lines.append("  bottleneck per layer: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if outcome.copies is not None and outcome.baseline_copies is not None:
        c, b = outcome.copies, outcome.baseline_copies
        lines.append(
            f"copies per token (co-activation, mean over layers): {c['gpus'].mean():.2f} GPUs "
            f"({c['remote_gpus'].mean():.2f} remote), {c['nodes'].mean():.2f} nodes; baseline {b['gpus'].mean():.2f} "
            f"GPUs ({b['remote_gpus'].mean():.2f} remote), {b['nodes'].mean():.2f} nodes"
        )
    if outcome.solver.get("objective") == "time":
        picked = ", ".join(f"{k} {v}" for k, v in outcome.solver["candidates"].items() if v)
        lines.append(f"time objective, layers taken from: {picked}")
    with_tokens = np.flatnonzero(tokens)
    worst = with_tokens[np.argsort(-new.lb[with_tokens], kind="stable")[:3]]
    layer_ids = window.meta.get("layer_ids")
    names = [f"{i}" + (f" (model layer {layer_ids[i]})" if isinstance(layer_ids, list) else "") for i in worst]
    if worst.size:
        lines.append("")
        lines.append("worst layers: " + "; ".join(
            f"{name}: lb {new.lb[i]:.3f} (baseline {base.lb[i]:.3f})" for name, i in zip(names, worst, strict=True)
        ))
    if outcome.moves is not None:
        moved = int(outcome.moves.sum())
        lines.append(f"moves vs current placement: {moved} expert copies" + (
            f", {moved * outcome.bytes_per_move / GIB:.2f} GiB" if outcome.bytes_per_move else "") + (
            f", in {outcome.plan.num_stages} stages" if outcome.plan is not None else ""))
    if out:
        lines.append(f"wrote {out}")
    return "\n".join(lines)


def _lb_cells(summary: tuple[float, float] | None) -> tuple[str, str]:
    """The summary's (lb mean, lb max) cells; "n/a" when no layer has tokens."""
    return ("n/a", "n/a") if summary is None else (f"{summary[0]:.3f}", f"{summary[1]:.3f}")


def _min_cell(values: NDArray[np.float64]) -> str:
    """The least of values over the layers with tokens; "n/a" when there is none."""
    return f"{values.min():.3f}" if values.size else "n/a"


def _ratio(before: float, after: float) -> str:
    if after <= 0:
        return "n/a"
    return f"{before / after:.2f}x faster" if before >= after else f"{after / before:.2f}x slower"
