"""Placements out: the files serving systems load at start-up (`export_text`, `write_export`), one target each:

- `sglang`: the JSON SGLang's `--init-expert-location` reads, `{"physical_to_logical_map": [model layers][P]}`
  (sgl-project/sglang python/sglang/srt/eplb/expert_location.py). SGLang passes every key of the file to
  `init_by_mapping`, so the file holds that one key and nothing else; it has a row for every model layer
  (dense ones included), and the file name must end in `.json`.
- `trtllm`: TensorRT-LLM's MoE load-balancer YAML `{num_slots, initial_global_assignments: {layer: [P ids]},
  layer_updates_per_iter: 0}` (NVIDIA/TensorRT-LLM `MoeLoadBalancerConfig` in tensorrt_llm/llmapi/llm_args.py,
  examples/wide_ep/ep_load_balancer/README.md). The config model forbids extra keys.
- `vllm-ascend`: the expert map JSON `{moe_layer_count, layer_list: [{layer_id, device_count, device_list:
  [{device_id, device_expert: [ids]}]}]}` (vllm-project/vllm-ascend vllm_ascend/eplb/adaptor/vllm_adaptor.py).
- `json`: our own placement file (docs/formats.md).

Every failure is an EplbError saying what to change.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, FieldError, shown
from eplb.io.files import output_file, plural, replace_text
from eplb.placement import Placement, appears_twice, row_layer_ids

TARGETS = ("sglang", "trtllm", "vllm-ascend", "json")
SYSTEM_NAMES = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm-ascend": "vllm-ascend", "json": "eplb"}
TARGET_SUFFIXES = {"sglang": (".json",), "trtllm": (".yaml", ".yml"), "vllm-ascend": (".json",), "json": (".json",)}
"""The names each target's file takes, the one table (`write_export`, `eplb export --out`): a file under another
suffix is refused, as eplb tells a placement file's format by its name when it reads it back (YAML under x.json
was written, then not read). SGLang's .json is also SGLang's own rule, lower case (`write_export`)."""

MAX_MODEL_LAYERS = 10_000
"""The most model layers an export names (SGLang writes a row per model layer; the largest models have a few
hundred): SGLang's row count, `--num-model-layers` and a `--layer-ids` id stay below it."""

_EQUAL_SLOTS_REASON = {
    "sglang": "it splits the physical experts evenly over the EP ranks",
    "trtllm": "every rank owns num_slots / ep_size consecutive slots",
    "vllm-ascend": "its expert map is one [layers, devices, slots] table",
}


def parse_layer_ids(text: str, max_count: int | None = None, num_model_layers: int | None = None) -> list[int]:
    """Parse a layer id list such as `3-60` or `0,1,5-7` into ids, in the order given. With `max_count`, a list
    of more ids is refused before any range is expanded (`0-99999999999` costs nothing); with `num_model_layers`,
    an id the model does not have (>= it) is refused."""
    spans: list[tuple[int, int]] = []
    count = 0
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise EplbError(f"layer ids: expected numbers and ranges like 3-60 or 0,1,5-7, got {shown(text)}")
        if max(len(g) for g in m.groups() if g is not None) > 9:  # int() of a long digit string is slow, or refused
            raise EplbError(f"layer ids: {part} names a layer beyond any model's (at most 9 digits)")
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start
        if stop < start:
            raise EplbError(f"layer ids: range {part} runs backwards; write it low-high")
        if num_model_layers is not None and stop >= num_model_layers:
            raise EplbError(f"layer ids: layer {stop} is beyond the model's {plural(num_model_layers, 'layer')} "
                            f"(0-{num_model_layers - 1})")
        count += stop - start + 1
        spans.append((start, stop))
        if max_count is not None and count > max_count:
            twice = _first_repeated(spans)
            if twice is not None:  # the likelier mistake: say that one
                raise EplbError(f"layer ids: {shown(text)}: {appears_twice(twice)}")
            raise EplbError(f"layer ids: {shown(text)} names more than the placement's {plural(max_count, 'layer')}: "
                            "give one model layer per placement layer")
    return [layer for start, stop in spans for layer in range(start, stop + 1)]


def _first_repeated(spans: list[tuple[int, int]]) -> int | None:
    """A layer two of the ranges `spans` [(start, stop)] both hold, or None."""
    ordered = sorted(spans)
    return next((b[0] for a, b in itertools.pairwise(ordered) if b[0] <= a[1]), None)


def checked_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The model layer of each of a placement's `num_layers` layers (rows): `layer_ids` when it has one id >= 0
    per row, each a different layer, in any order (the service's exports take them so); None: 0..num_layers-1.
    Raises FieldError('layer_ids', ...) otherwise (`eplb.placement.row_layer_ids`, the one check of exports,
    placement files, and the service's bodies and queries)."""
    return list(range(num_layers)) if layer_ids is None else row_layer_ids(layer_ids, num_layers)


def row_labels(placement: Placement, layer_ids: Sequence[int] | None = None) -> list[int]:
    """The model layer of each placement row as the exports write it: `layer_ids` when given (checked; it must
    agree with the placement's own, if it has them), else `placement.layer_ids`, else 0..layers-1."""
    own = placement.layer_ids
    if layer_ids is None:
        return list(range(placement.num_layers)) if own is None else list(own)
    ids = checked_layer_ids(layer_ids, placement.num_layers)
    if own is not None and tuple(ids) != own:
        raise FieldError("layer_ids", f"{ranges(ids)} given, but the placement's rows are model layers "
                         f"{ranges(list(own))} (its layer_ids): drop layer_ids, or relabel the placement with "
                         "dataclasses.replace(placement, layer_ids=...)")
    return ids


def model_layers_refusal(layer_ids: Sequence[int], num_model_layers: int, name: str = "num_model_layers") -> str | None:
    """Why an SGLang map of `num_model_layers` rows cannot hold model layers `layer_ids`, naming the count `name`
    (the CLI's flag); None when it can."""
    top = max(layer_ids, default=-1)
    if num_model_layers > top:
        return None
    return (f"{name} is {num_model_layers} but layer id {top} needs at least {plural(top + 1, 'row')} (model layers "
            f"0-{top})")


def ranges(ids: Sequence[int]) -> str:
    """Layer ids for a message, runs shortened: [3, 4, 5, 9] -> '3-5,9'; [] -> 'none'."""
    if not ids:
        return "none"
    parts: list[str] = []
    start = prev = ids[0]
    for v in [*ids[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def check_exportable(placement: Placement, target: str) -> None:
    """Raise EplbError unless `target` can express `placement`, saying what to change if not.

    sglang, trtllm and vllm-ascend need an expert in every slot, the same slot count on every GPU and uniform shares;
    vllm-ascend also needs every GPU to hold distinct experts in every layer.
    """
    if target not in TARGETS:
        raise EplbError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    if target == "json":
        return
    _require_no_empty_slots(placement, target)
    _require_uniform_shares(placement, target)
    _equal_slots(placement, target)
    if target == "vllm-ascend":
        _require_distinct_per_gpu(placement)


def to_sglang(
    placement: Placement, layer_ids: Sequence[int] | None = None, num_model_layers: int | None = None
) -> dict[str, Any]:
    """SGLang `--init-expert-location` object: `{"physical_to_logical_map": [num_model_layers][P]}`.

    SGLang indexes the map by model layer, dense layers included. Row `layer_ids[i]` gets placement layer i
    (default: the placement's own layer_ids, else layer i); rows no placement layer covers get SGLang's own
    trivial map (slot s holds s mod E). num_model_layers defaults to max(layer_ids) + 1.
    """
    check_exportable(placement, "sglang")
    ids = row_labels(placement, layer_ids)
    rows = max(ids) + 1 if num_model_layers is None else num_model_layers
    if rows > MAX_MODEL_LAYERS:  # the rows are allocated and written: a stray layer id must not make millions
        said = f"model layer {max(ids)}" if num_model_layers is None else f"num_model_layers {num_model_layers:,}"
        raise EplbError(f"SGLang's map has a row per model layer, and {said} would make it {rows:,} rows, more than "
                        f"any model has (at most {MAX_MODEL_LAYERS:,}): check the placement's layer_ids")
    refusal = model_layers_refusal(ids, rows)
    if refusal is not None:
        raise EplbError(refusal)
    table = np.tile(np.arange(placement.num_physical, dtype=np.int64) % placement.num_experts, (rows, 1))
    table[ids] = placement.phy2log
    return {"physical_to_logical_map": table.tolist()}


def to_trtllm(placement: Placement, layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """TensorRT-LLM MoE load-balancer config: `num_slots` (P), `initial_global_assignments`
    `{model layer id: [P expert ids]}` (slot j of layer l holds expert [l][j]; each rank owns P / ep_size
    consecutive slots) and `layer_updates_per_iter: 0` (static placement). Model layer ids: `layer_ids`, else
    the placement's own, else 0..layers-1."""
    check_exportable(placement, "trtllm")
    ids = row_labels(placement, layer_ids)
    assignments = {layer: row for layer, row in zip(ids, placement.phy2log.tolist(), strict=True)}
    return {"num_slots": placement.num_physical, "initial_global_assignments": assignments, "layer_updates_per_iter": 0}


def to_vllm_ascend(placement: Placement) -> dict[str, Any]:
    """vllm-ascend expert map: `moe_layer_count` (L) and `layer_list`, one entry per MoE layer in order
    (`layer_id` is the MoE layer index, as vllm-ascend's own recorder writes it), each with `device_count` (G)
    and `device_list: [{device_id, device_expert: [S logical expert ids, local slot order]}]`."""
    check_exportable(placement, "vllm-ascend")
    slots = int(placement.slots_per_gpu[0])
    grid = placement.phy2log.reshape(placement.num_layers, placement.num_gpus, slots).tolist()
    return {
        "moe_layer_count": placement.num_layers,
        "layer_list": [
            {
                "layer_id": layer,
                "device_count": placement.num_gpus,
                "device_list": [{"device_id": g, "device_expert": experts} for g, experts in enumerate(devices)],
            }
            for layer, devices in enumerate(grid)
        ],
    }


def to_json(placement: Placement, layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Our placement file object (docs/formats.md), with `layer_ids` (model layer of each row, increasing) when
    given or when the placement has its own."""
    if layer_ids is not None and placement.layer_ids is None:
        placement = dataclasses.replace(placement, layer_ids=tuple(row_labels(placement, layer_ids)))
    else:
        row_labels(placement, layer_ids)  # the same as the placement's own, if given
    return placement.to_dict()


def trtllm_yaml(config: dict[str, Any]) -> str:
    """Write a `to_trtllm` config as YAML: block mapping, one flow list per layer (the layout TensorRT-LLM's
    generate_eplb_config.py writes); `parse_trtllm_yaml` (PyYAML) reads it back."""
    lines = [
        "# TensorRT-LLM MoE load balancer config (moe_config.load_balancer), written by eplb.",
        "# Each rank owns num_slots / ep_size consecutive slots of every layer.",
        f"num_slots: {int(config['num_slots'])}",
        f"layer_updates_per_iter: {int(config['layer_updates_per_iter'])}",
    ]
    assignments = config.get("initial_global_assignments")
    if assignments is not None:
        lines.append("initial_global_assignments:")
        for layer, row in assignments.items():
            lines.append(f"  {int(layer)}: [{', '.join(str(int(v)) for v in row)}]")
    return "\n".join(lines) + "\n"


def export_text(
    placement: Placement,
    target: str,
    *,
    layer_ids: Sequence[int] | None = None,
    num_model_layers: int | None = None,
) -> str:
    """The file text `target` loads (see the module docstring); raises EplbError if it cannot express it.
    layer_ids: the model layer of each placement row, for sglang and trtllm (default: `placement.layer_ids`, else
    0..layers-1); num_model_layers: SGLang's row count (default: the last layer id + 1)."""
    check_exportable(placement, target)
    if target == "sglang":
        return json.dumps(to_sglang(placement, layer_ids, num_model_layers)) + "\n"
    if target == "trtllm":
        return trtllm_yaml(to_trtllm(placement, layer_ids))
    if target == "vllm-ascend":
        row_labels(placement, layer_ids)  # checked, though vllm-ascend numbers MoE layers by position
        return json.dumps(to_vllm_ascend(placement)) + "\n"
    return json.dumps(to_json(placement, layer_ids)) + "\n"


def write_export(
    placement: Placement,
    target: str,
    path: str | Path,
    *,
    layer_ids: Sequence[int] | None = None,
    num_model_layers: int | None = None,
) -> None:
    """Write `export_text` to `path`, named as TARGET_SUFFIXES says; SGLang files must be named *.json, lower case,
    as SGLang tests the text (`endswith(".json")`: it parses any other `--init-expert-location` value, P.JSON too,
    as inline JSON)."""
    p = Path(path)
    if target == "sglang" and not p.name.endswith(".json"):
        raise EplbError(
            f"SGLang reads --init-expert-location as a file only when its name ends in .json (lower case); "
            f"name the output like {p.stem or 'placement'}.sglang.json"
        )
    p = output_file(p, suffixes=TARGET_SUFFIXES.get(target, ()))
    text = export_text(placement, target, layer_ids=layer_ids, num_model_layers=num_model_layers)
    replace_text(p, text)


def _equal_slots(placement: Placement, target: str) -> int:
    slots = placement.slots_per_gpu
    if np.all(slots == slots[0]):
        return int(slots[0])
    suggest = max(placement.num_physical // placement.num_gpus, -(-placement.num_experts // placement.num_gpus))
    raise EplbError(
        f"{SYSTEM_NAMES[target]} needs the same number of slots on every GPU ({_EQUAL_SLOTS_REASON[target]}); "
        f"this placement has {int(slots.min())}-{int(slots.max())} per GPU; re-solve with --slots-per-gpu {suggest}"
    )


def _require_no_empty_slots(placement: Placement, target: str) -> None:
    if not placement.empty_slots.any():
        return
    layer, slot = (int(v) for v in np.argwhere(placement.empty_slots)[0])
    name = SYSTEM_NAMES[target]
    gpu_of_slot = np.repeat(np.arange(placement.num_gpus), placement.slots_per_gpu)
    serving = np.bincount(gpu_of_slot[~placement.empty_slots[layer]], minlength=placement.num_gpus) > 0
    if serving.all():  # every GPU holds experts: spare slots, whatever left them empty
        gpu = int(gpu_of_slot[slot])
        count = int(placement.empty_slots.sum())
        raise EplbError(
            f"{name} loads an expert into every slot, but slot {slot} of layer {layer} is empty (-1: no expert's "
            f"weights, no tokens) on GPU {gpu}, which holds experts in its other slots "
            f"({plural(count, 'empty slot')} in all); {name} cannot take empty slots: solve with every slot "
            "filled (eplb solve --objective lb, the default, fills them), or export --to json to keep them"
        )
    raise EplbError(
        f"{name} loads an expert into every slot, but slot {slot} of layer {layer} is empty (-1) and GPU "
        f"{int(np.flatnonzero(~serving)[0])} holds no expert (a rank absent while EP scales); re-solve for the GPUs "
        "that serve, or export --to json to keep the empty slots"
    )


def _require_uniform_shares(placement: Placement, target: str) -> None:
    if placement.shares is None:
        return
    uniform = 1.0 / np.take_along_axis(placement.replicas, placement.phy2log, axis=1)
    bad = np.argwhere(np.abs(placement.shares - uniform) > 1e-9)
    if bad.size == 0:
        return
    layer, slot = (int(v) for v in bad[0])
    raise EplbError(
        f"{SYSTEM_NAMES[target]} splits each expert's tokens evenly over its replicas, but this placement has "
        f"weighted shares (layer {layer}, slot {slot} serves {placement.shares[layer, slot]:.3g} of expert "
        f"{int(placement.phy2log[layer, slot])}'s tokens, not {uniform[layer, slot]:.3g}); re-solve without "
        "weighted shares, or export --to json to keep them"
    )


def repeated_on_a_gpu(phy2log: NDArray[np.int64], slots_per_gpu: int) -> tuple[int, int, int] | None:
    """The first (layer, GPU, expert) where a GPU holds an expert twice, or None: vllm-ascend maps each expert to one
    slot per device (its export, and its maps read back). phy2log: [L, G x slots_per_gpu]; empty slots (-1) are no
    expert."""
    grid = phy2log.reshape(phy2log.shape[0], -1, slots_per_gpu)
    ordered = np.sort(grid, axis=2)
    dup = np.argwhere((ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] >= 0))
    if dup.size == 0:
        return None
    layer, gpu, k = (int(v) for v in dup[0])
    return layer, gpu, int(ordered[layer, gpu, k])


def _require_distinct_per_gpu(placement: Placement) -> None:
    twice = repeated_on_a_gpu(placement.phy2log, int(placement.slots_per_gpu[0]))
    if twice is None:
        return
    layer, gpu, expert = twice
    raise EplbError(
        f"vllm-ascend gives each expert one slot per device, but GPU {gpu} holds expert {expert} twice in layer "
        f"{layer}; re-solve so no GPU holds two copies of an expert (more GPUs or fewer redundant slots)"
    )
