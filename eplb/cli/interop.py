"""`eplb export` and `eplb import-load`: placements out to serving systems, their load statistics in."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from eplb.cli.solve import int_at_most
from eplb.errors import EplbError, FieldError
from eplb.io.exports import (
    MAX_MODEL_LAYERS,
    SYSTEM_NAMES,
    TARGET_SUFFIXES,
    TARGETS,
    model_layers_refusal,
    parse_layer_ids,
    ranges,
    row_labels,
    write_export,
)
from eplb.io.files import output_file, plural, same_file, writing
from eplb.io.foreign import read_placement_file
from eplb.io.statistics import LOAD_FORMATS, ImportedLoads, fold_slots, import_loads, write_loads
from eplb.placement import Placement
from eplb.rules import CLI_MAX_GPUS
from eplb.specs import MODEL_PRESETS, ModelSpec

_EXPERT_COUNTS = {spec.num_experts for spec in MODEL_PRESETS.values()}

EXPORT_DESCRIPTION = """\
Write a placement in the form a serving system loads at start-up:

  sglang        JSON for SGLang's --init-expert-location: {"physical_to_logical_map": [model layers][slots]}.
                One row per model layer, dense layers included (they get SGLang's trivial map), so say
                which model layer each placement layer is with --layer-ids (DeepSeek-V3: 3-60; the default
                for a placement of all of a preset's MoE layers, as the service's export).
  trtllm        YAML for TensorRT-LLM's moe_config.load_balancer: num_slots, initial_global_assignments
                {model layer: [expert per slot]}, layer_updates_per_iter: 0 (static).
  vllm-ascend   JSON for vllm-ascend's eplb_config.expert_map_path: moe_layer_count, layer_list of
                {layer_id, device_count, device_list: [{device_id, device_expert}]}.
  json          eplb's own placement file (docs/formats.md), e.g. to convert a foreign file back.

sglang, trtllm and vllm-ascend need the same number of slots on every GPU and route each expert's tokens
evenly over its replicas; vllm-ascend also needs distinct experts on each GPU. A placement that breaks a
target's rule is refused with what to change. Recipes: docs/integrations.md."""

EXPORT_EPILOG = """\
examples:
  eplb export --placement placement.json --to sglang --layer-ids 3-60 --out placement.sglang.json
  eplb export --placement placement.json --to trtllm --layer-ids 3-60 --out moe_load_balancer.yaml
  eplb export --placement placement.json --to vllm-ascend --out expert_map.json
  eplb export --placement moe_load_balancer.yaml --gpus 36 --to json --out placement.json"""

IMPORT_DESCRIPTION = """\
Turn the expert statistics a serving system recorded into a load window for `eplb solve --loads`:

  sglang   the expert distribution recorder's stat dump: {"logical_count": [steps][layers][experts]}
           (or [layers][experts]) as .json, or an .npz/.npy holding logical_count. Layers with no tokens
           at all (dense layers) are dropped and layer_ids records the model layer of each row left.
  trtllm   the folder TensorRT-LLM writes to EXPERT_STATISTIC_PATH: meta_info.json and rank*.safetensors
           (or rank*.json) with counts keyed "{iteration}_{layer}"; ranks are added up. With its load
           balancer on it counts slots, not experts: pass the load-balancer YAML that was live (--placement,
           with --gpus) and slots are added up per logical expert.
  vllm     per-step counts [steps][layers][experts] (.npy, .npz or .json "counts"); several files are the
           EP ranks of one recording and are summed, as vLLM does. vLLM's own expert_load_window counts
           physical slots: pass the placement that was live (--placement) or store physical_to_logical_map
           in the .npz, and slots are added up per logical expert. vLLM numbers MoE layers by position
           (0..57 for DeepSeek-V3's model layers 3-60): the window has no layer_ids.

SGLang files are successive dumps, stacked along the step axis. Steps a circular recorder buffer never
wrote (all zero) are dropped. The window is the sum over the selected steps; with --keep-steps the per-step
counts are written instead."""

IMPORT_EPILOG = """\
examples:
  eplb import-load --from sglang expert_distribution.json --out window.json
  eplb import-load --from trtllm ./expert_statistic --steps=-50: --out window.json
  eplb import-load --from vllm load_window.npz --placement current.json --out window.npz --keep-steps"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `export` and `import-load` subcommands."""
    e = subparsers.add_parser(
        "export",
        help="write a placement for SGLang, TensorRT-LLM or vllm-ascend",
        description=EXPORT_DESCRIPTION,
        epilog=EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--placement", required=True, metavar="FILE", help="placement to export: eplb's JSON, or an "
                   "SGLang, TensorRT-LLM or vllm-ascend file (SGLang and TensorRT-LLM files need --gpus; eplb's and "
                   "vllm-ascend's record their GPU count)")
    e.add_argument("--to", required=True, choices=TARGETS, help="target system")
    e.add_argument("--out", required=True, metavar="FILE", help="file to write (SGLang: name must end in .json)")
    e.add_argument("--layer-ids", metavar="IDS", help="model layer of each placement layer, "
                   "e.g. 3-60 or 0,1,5-7 (default: the file's own, else 0, 1, ...); for input files whose rows are "
                   "model layers (SGLang, TensorRT-LLM, eplb's with layer_ids) it selects those layers")
    e.add_argument("--num-model-layers", type=_num_model_layers, metavar="N", help="SGLang only: rows to write, "
                   "all model layers (default: the last layer id + 1)")
    e.add_argument("--gpus", type=_gpu_count, metavar="N", help="EP size, to read SGLang or TensorRT-LLM placement "
                   "files (for others it must be the file's own)")
    e.set_defaults(func=run_export)

    i = subparsers.add_parser(
        "import-load",
        help="turn SGLang, TensorRT-LLM or vLLM expert statistics into a load window",
        description=IMPORT_DESCRIPTION,
        epilog=IMPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("--from", dest="source_format", required=True, choices=LOAD_FORMATS, help="recording system")
    i.add_argument("files", nargs="+", metavar="FILE", help="statistics files (TensorRT-LLM: the folder)")
    i.add_argument("--out", required=True, metavar="FILE", help="load file to write: .json, .npz or .npy")
    i.add_argument("--steps", type=_step_range, metavar="A:B", help="keep steps A..B-1 only (Python slice: "
                   "--steps=-100: keeps the last 100); for TensorRT-LLM, steps are the recorded iterations in order")
    i.add_argument("--keep-steps", action="store_true", help="write [steps][layers][experts] counts, not their sum")
    i.add_argument("--keep-empty-layers", action="store_true", help="SGLang: keep layers that recorded no tokens")
    i.add_argument("--placement", metavar="FILE", help="vLLM and TensorRT-LLM: the placement live while recording, "
                   "to fold physical-slot counts into logical experts")
    i.add_argument("--gpus", type=_gpu_count, metavar="N",
                   help="EP size, to read an SGLang or TensorRT-LLM --placement")
    i.set_defaults(func=run_import_load)


_gpu_count = int_at_most(CLI_MAX_GPUS, "GPUs")
"""argparse type of --gpus, as `eplb solve --gpus` (>= 1 is checked by `_check_gpus`, with the flag's name, as
`eplb evaluate` does)."""


def _check_gpus(gpus: int | None) -> None:
    """Refuse a --gpus below 1 by name (a file read with it said '... do not split evenly over 0 GPUs')."""
    if gpus is not None and gpus < 1:
        raise EplbError(f"--gpus must be >= 1, got {gpus}")


def _num_model_layers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_MODEL_LAYERS:
        raise argparse.ArgumentTypeError(f"{value} is not a model's layer count: give 1 to {MAX_MODEL_LAYERS:,}")
    return value


def _layer_ids(text: str, num_layers: int, num_model_layers: int | None) -> list[int]:
    """--layer-ids for a placement (file) of `num_layers` layers: at most one id per layer, counted before a
    range is expanded (`0-99999999` costs nothing), each below --num-model-layers (or `MAX_MODEL_LAYERS`)."""
    try:
        ids = parse_layer_ids(text, max_count=num_layers, num_model_layers=num_model_layers)
    except EplbError as exc:
        raise EplbError(f"--layer-ids: {str(exc).removeprefix('layer ids: ')}") from None
    if ids and max(ids) >= MAX_MODEL_LAYERS:
        raise EplbError(f"--layer-ids: layer {max(ids)} is beyond any model's layers (at most {MAX_MODEL_LAYERS:,})")
    return ids


def _step_range(text: str) -> tuple[int | None, int | None]:
    m = re.fullmatch(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected A:B, A: or :B with whole numbers, got {text!r}")
    return (None if m.group(1) is None else int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


def run_export(args: argparse.Namespace) -> int:
    _check_gpus(args.gpus)
    # a target's file under another suffix is refused (SGLang's own rule, .json, is write_export's: its message)
    output_file(args.out, "--out", () if args.to == "sglang" else TARGET_SUFFIXES[args.to],
                [("--placement", args.placement)])
    if args.num_model_layers is not None and args.to != "sglang":
        raise EplbError("--num-model-layers applies to --to sglang only")
    # SGLang rows and TensorRT-LLM keys are model layers: --layer-ids picks those; for other files it names rows.
    foreign = read_placement_file(args.placement, num_gpus=args.gpus, gpus_flag="--gpus")
    whole = foreign.placement  # every row of the file, before --layer-ids picks any
    if args.layer_ids is not None:  # bounded by the file's layers (rows), so read it once without them first
        ids = _layer_ids(args.layer_ids, whole.num_layers, args.num_model_layers)
        rows = whole.layer_ids  # the file's rows are model layers: the flag may ask for one it has not
        missing = [] if rows is None else [v for v in ids if v not in rows]
        if rows is not None and missing:
            raise EplbError(f"--layer-ids {args.layer_ids}: {args.placement} has no row for layer {missing[0]} (it "
                            f"covers layers {ranges(list(rows))})")
        try:
            foreign = read_placement_file(args.placement, num_gpus=args.gpus, layer_ids=ids, gpus_flag="--gpus")
        except FieldError as exc:  # the ids themselves (their order)
            if exc.fields != ("layer_ids",):
                raise
            raise EplbError(f"--layer-ids: {exc.message}") from None
    placement = foreign.placement
    preset = _preset(whole)
    num_model_layers, defaulted = args.num_model_layers, False
    if (placement.layer_ids is None and args.to in ("sglang", "trtllm") and preset is not None
            and preset.first_dense_layers > 0 and placement.num_layers == preset.num_moe_layers):
        # the preset's MoE layers, after its dense ones (DeepSeek-V3: 3..60 of 61), as the service's export
        placement, defaulted = replace(placement, layer_ids=tuple(preset.moe_layer_ids())), True
    ids = row_labels(placement)
    if args.to == "sglang" and num_model_layers is None and preset is not None and max(ids) < preset.num_model_layers:
        num_model_layers = preset.num_model_layers  # SGLang expects a row for every layer of the model
    if num_model_layers is not None:
        refusal = model_layers_refusal(ids, num_model_layers, "--num-model-layers")
        if refusal is not None:
            raise EplbError(f"{refusal}: give at least {max(ids) + 1}, or --layer-ids that fit")
    with writing(args.out, "--out"):
        write_export(placement, args.to, args.out, num_model_layers=num_model_layers)
    for warning in _engine_gaps(placement, args.to, preset, num_model_layers):
        print(f"warning: {warning}", file=sys.stderr)
    print(_export_summary(placement, args.to, args.out, num_model_layers, preset if defaulted else None))
    return 0


def run_import_load(args: argparse.Namespace) -> int:
    _check_gpus(args.gpus)
    for i, f in enumerate(args.files):  # the files are stacked (SGLang) or summed (ranks): one twice counts twice
        again = next((g for g in args.files[:i] if same_file(f, g)), None)
        if again is not None:
            raise EplbError(f"FILE {f} is {again} again: its counts would be added twice; give each file once")
    output_file(args.out, "--out", inputs=[*(("FILE", f) for f in args.files), ("--placement", args.placement)])
    live = None
    if args.placement:
        if args.source_format == "sglang":
            raise EplbError("--placement applies to --from vllm and trtllm only (SGLang records logical experts)")
        live = read_placement_file(args.placement, num_gpus=args.gpus, gpus_flag="--gpus")
    elif args.gpus is not None and args.source_format == "sglang":
        raise EplbError("--gpus is the EP size of the --placement that --from vllm and trtllm take: SGLang records "
                        "logical experts, so --from sglang needs neither: drop --gpus")
    elif args.gpus is not None:
        raise EplbError("--gpus is the EP size of an SGLang or TensorRT-LLM --placement: give --placement with it, "
                        "or drop --gpus")
    loads = import_loads(args.source_format, args.files, drop_empty_layers=not args.keep_empty_layers,
                         phy2log=None if live is None or args.source_format != "vllm" else live.placement.phy2log)
    if live is not None and args.source_format == "trtllm":
        loads = fold_slots(loads, live.placement.phy2log, live.layer_ids)
    elif args.source_format == "trtllm" and loads.counts.shape[2] not in _EXPERT_COUNTS:
        print(f"note: meta_info.json says {loads.counts.shape[2]} experts, which no known model has: if "
              "TensorRT-LLM's load balancer was on, these are slots; pass --placement (the load-balancer YAML "
              "that was live) and --gpus to fold them to logical experts", file=sys.stderr)
    if args.steps is not None:
        loads = loads.select_steps(*args.steps)
        if loads.order_note:  # in time order, on an assumption the files cannot confirm
            print(f"note: {loads.order_note}", file=sys.stderr)
    with writing(args.out, "--out"):
        write_loads(loads, args.out, keep_steps=args.keep_steps)
    print(_import_summary(loads, args.out, args.keep_steps))
    return 0


def _preset(placement: Placement) -> ModelSpec | None:
    """The one model preset the placement's rows (all of a file's) are of: its experts, and one row per MoE layer
    (ours, TensorRT-LLM's, vllm-ascend's files) or per model layer (SGLang's); else None."""
    matches = [m for m in MODEL_PRESETS.values() if m.num_experts == placement.num_experts
               and placement.num_layers in (m.num_moe_layers, m.num_model_layers)]
    return matches[0] if len(matches) == 1 else None


def _engine_gaps(placement: Placement, target: str, preset: ModelSpec | None, num_model_layers: int | None
                 ) -> list[str]:
    """What the engine, serving `preset`, will look for in the export and not find, one warning each: its MoE
    layers the placement has no row for, rows that are no MoE layer of it, SGLang rows for other than its layers;
    nothing without a preset (or for --to json)."""
    if preset is None or target == "json":
        return []
    system, name, moe = SYSTEM_NAMES[target], preset.name, preset.moe_layer_ids()
    ids = row_labels(placement)
    warnings: list[str] = []
    if target == "vllm-ascend":  # it numbers MoE layers by position: row i serves MoE layer i
        served = moe[: placement.num_layers]
        if placement.layer_ids is not None and ids != served:
            warnings.append(f"vllm-ascend takes the rows in order as {name}'s MoE layers (model {_layers(served)}), "
                            f"but they are model {_layers(ids)}: export the rows of every MoE layer, in order")
        ids = served
    missing = [layer for layer in moe if layer not in set(ids)]
    if missing:
        one = len(missing) == 1
        consequence = {"sglang": f"{'its row gets' if one else 'their rows get'} SGLang's trivial map (slot s holds "
                                 "expert s mod E)",
                       "trtllm": "it raises KeyError at start-up for a layer missing from initial_global_assignments",
                       "vllm-ascend": f"the expert map has no entry for {'it' if one else 'them'}"}[target]
        warnings.append(f"{system} will look for {name}'s MoE {_layers(missing)} and not find "
                        f"{'it' if one else 'them'} in this placement (its rows are model {_layers(ids)}): "
                        f"{consequence}; export every MoE layer ({ranges(moe)})")
    other = [layer for layer in ids if layer not in set(moe)]
    if other:
        warnings.append(f"model {_layers(other)} {'is' if len(other) == 1 else 'are'} not among {name}'s MoE "
                        f"layers ({ranges(moe)}): check --layer-ids")
    if target == "sglang" and num_model_layers is not None and num_model_layers != preset.num_model_layers:
        warnings.append(f"--num-model-layers {num_model_layers}: {name} has {plural(preset.num_model_layers, 'layer')} "
                        "and SGLang expects one row for each")
    return warnings


def _layers(ids: list[int]) -> str:
    """'layer 3' or 'layers 3-5,9', for a message."""
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {ranges(ids)}"


def _export_summary(placement: Placement, target: str, out: str, num_model_layers: int | None,
                    preset: ModelSpec | None = None) -> str:
    """What was written and how to load it; `preset`: the one whose MoE layers labelled the rows."""
    g, p, e, count = placement.num_gpus, placement.num_physical, placement.num_experts, placement.num_layers
    slots = int(placement.slots_per_gpu[0])
    ids = row_labels(placement)
    layers = f"placement {'layer' if count == 1 else 'layers'} -> model {_layers(ids)}"
    if preset is not None:
        layers += (f", {preset.name}'s MoE layers after its {plural(preset.first_dense_layers, 'dense one')} "
                   "(--layer-ids to name others)")
    hint = "" if placement.layer_ids is not None or target in ("json", "vllm-ascend") else (
        "; if the model starts with dense layers, pass --layer-ids (DeepSeek-V3: 3-60)")
    name = Path(out).name
    if target == "sglang":
        rows = max(ids) + 1 if num_model_layers is None else num_model_layers
        return (f"wrote {out}: SGLang expert location, {plural(rows, 'model layer')} x "
                f"{plural(p, 'physical expert')} ({layers}{hint})\n"
                f"launch SGLang with EP size {g}, --ep-num-redundant-experts {p - e} and "
                f"--init-expert-location {name}")
    if target == "trtllm":
        return (f"wrote {out}: TensorRT-LLM load balancer, num_slots {p} ({plural(slots, 'slot')} per rank on "
                f"{plural(g, 'rank')}; {layers}{hint})\nset moe_config.load_balancer: {name} and EP size {g}")
    if target == "vllm-ascend":
        return (f"wrote {out}: vllm-ascend expert map, {plural(count, 'MoE layer')} x {plural(g, 'device')} x "
                f"{plural(slots, 'slot')}\nserve on {plural(g, 'device')} with --additional-config "
                f"'{{\"eplb_config\": {{\"expert_map_path\": \"{name}\", \"num_redundant_experts\": {p - e}}}}}'")
    # the file's own words: layer_ids when it records them, else rows by position (a vllm-ascend map records none)
    held = (f"layer_ids: model {_layers(ids)}" if placement.layer_ids is not None else
            "no layer_ids: rows by position, no model layer named; --layer-ids to record them")
    return f"wrote {out}: eplb placement, {plural(count, 'layer')} ({held}), {plural(g, 'GPU')}, {plural(p, 'slot')}"


def _import_summary(loads: ImportedLoads, out: str, keep_steps: bool) -> str:
    window = loads.window
    layers, experts = window.shape
    total = float(window.sum())
    what = f"{plural(loads.num_steps, 'step')} x " if keep_steps else ""
    per_layer = total / layers if layers else 0.0
    rows = (f"model {_layers(loads.layer_ids)}" if loads.layer_ids is not None else  # vLLM numbers MoE layers
            f"MoE {_layers(list(range(layers)))} by position, no model layer ids")
    empty = [i for i, total in enumerate(window.sum(axis=1)) if total == 0]  # kept: vLLM's, or --keep-empty-layers
    labels = empty if loads.layer_ids is None else [loads.layer_ids[i] for i in empty]
    none = "" if not empty else (f" (the mean over layers; {plural(len(empty), 'layer')} without tokens: "
                                 f"{'' if loads.layer_ids is None else 'model '}{_layers(labels)})")
    return (f"read {loads.source}\n"
            f"wrote {out}: {what}{plural(layers, 'layer')} ({rows}) x "
            f"{plural(experts, 'expert')}, "
            f"{per_layer:,.0f} token-expert assignments per layer summed over {plural(loads.num_steps, 'step')}{none}")
