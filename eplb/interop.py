"""Interop with serving systems: export placements they load, import the load statistics they record.

Placements out (`export_text`, `write_export`), one target each:
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

Placements in (`read_placement_file`, `read_placement_any`): ours, SGLang's, TensorRT-LLM's, vllm-ascend's.

Load statistics in (`read_sglang_loads`, `read_trtllm_loads`, `read_vllm_loads`), each giving per-step counts
`[steps, layers, E]` that `ImportedLoads.window` sums to the `[layers, E]` window `eplb solve` reads:
- SGLang's expert distribution recorder in `stat` mode: `logical_count` `[steps, layers, E]` (or `[layers, E]`)
  as JSON or .npz/.npy (its own dump is a torch .pt file; see docs/integrations.md for the conversion);
- TensorRT-LLM's expert statistics: `meta_info.json` plus `rank{N}.safetensors` files of per-(iteration, layer)
  counts keyed `"{iter}_{layer}"` (tensorrt_llm/_torch/expert_statistic.py), read without the safetensors
  package, or the same keys in `rank{N}.json` files;
- vLLM-style arrays `[steps, layers, E]` (.npy/.npz/.json); vLLM's own `expert_load_window` counts physical
  slots, `[steps, layers, P]`, and is folded to logical experts with a `physical_to_logical_map`.

Every failure is an EplbError saying what to change.
"""

from __future__ import annotations

import importlib
import json
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError
from eplb.placement import Placement

TARGETS = ("sglang", "trtllm", "vllm-ascend", "json")
LOAD_FORMATS = ("sglang", "trtllm", "vllm")
SYSTEM_NAMES = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm-ascend": "vllm-ascend", "json": "eplb"}

_EQUAL_SLOTS_REASON = {
    "sglang": "it splits the physical experts evenly over the EP ranks",
    "trtllm": "every rank owns num_slots / ep_size consecutive slots",
    "vllm-ascend": "its expert map is one [layers, devices, slots] table",
}


# ----------------------------------------------------------------------------------------------------------
# Placements out
# ----------------------------------------------------------------------------------------------------------


def parse_layer_ids(text: str) -> list[int]:
    """Parse a layer id list such as `3-60` or `0,1,5-7` into ids, in the order given."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise EplbError(f"layer ids: expected numbers and ranges like 3-60 or 0,1,5-7, got {text!r}")
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start
        if stop < start:
            raise EplbError(f"layer ids: range {part} runs backwards; write it low-high")
        ids.extend(range(start, stop + 1))
    return ids


def check_exportable(placement: Placement, target: str) -> None:
    """Raise EplbError unless `target` can express `placement`, saying what to change if not.

    sglang, trtllm and vllm-ascend need the same slot count on every GPU and uniform shares;
    vllm-ascend also needs every GPU to hold distinct experts in every layer.
    """
    if target not in TARGETS:
        raise EplbError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    if target == "json":
        return
    _require_uniform_shares(placement, target)
    _equal_slots(placement, target)
    if target == "vllm-ascend":
        _require_distinct_per_gpu(placement)


def to_sglang(
    placement: Placement, layer_ids: Sequence[int] | None = None, num_model_layers: int | None = None
) -> dict[str, Any]:
    """SGLang `--init-expert-location` object: `{"physical_to_logical_map": [num_model_layers][P]}`.

    SGLang indexes the map by model layer, dense layers included. Row `layer_ids[i]` gets placement layer i
    (default: layer i); rows no placement layer covers get SGLang's own trivial map (slot s holds s mod E).
    num_model_layers defaults to max(layer_ids) + 1.
    """
    check_exportable(placement, "sglang")
    ids = _checked_layer_ids(placement, layer_ids)
    rows = max(ids) + 1 if num_model_layers is None else num_model_layers
    if rows <= max(ids):
        raise EplbError(f"num_model_layers is {rows} but layer id {max(ids)} needs at least {max(ids) + 1} rows")
    table = np.tile(np.arange(placement.num_physical, dtype=np.int64) % placement.num_experts, (rows, 1))
    table[ids] = placement.phy2log
    return {"physical_to_logical_map": table.tolist()}


def to_trtllm(placement: Placement, layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """TensorRT-LLM MoE load-balancer config: `num_slots` (P), `initial_global_assignments`
    `{model layer id: [P expert ids]}` (slot j of layer l holds expert [l][j]; each rank owns P / ep_size
    consecutive slots) and `layer_updates_per_iter: 0` (static placement)."""
    check_exportable(placement, "trtllm")
    ids = _checked_layer_ids(placement, layer_ids)
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
    """Our placement file object (docs/formats.md), with `layer_ids` (model layer of each row) when given."""
    out = placement.to_dict()
    if layer_ids is not None:
        out["layer_ids"] = _checked_layer_ids(placement, layer_ids)
    return out


def trtllm_yaml(config: dict[str, Any]) -> str:
    """Write a `to_trtllm` config as YAML: block mapping, one flow list per layer (the layout TensorRT-LLM's
    generate_eplb_config.py writes). No YAML library needed."""
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
    """The file text `target` loads (see the module docstring); raises EplbError if it cannot express it."""
    check_exportable(placement, target)
    if target == "sglang":
        return json.dumps(to_sglang(placement, layer_ids, num_model_layers)) + "\n"
    if target == "trtllm":
        return trtllm_yaml(to_trtllm(placement, layer_ids))
    if target == "vllm-ascend":
        if layer_ids is not None:
            _checked_layer_ids(placement, layer_ids)
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
    """Write `export_text` to `path`; SGLang files must be named *.json (SGLang parses any other
    `--init-expert-location` value as inline JSON)."""
    p = Path(path)
    if target == "sglang" and p.suffix.lower() != ".json":
        raise EplbError(
            f"SGLang reads --init-expert-location as a file only when its name ends in .json; "
            f"name the output like {p.stem or 'placement'}.sglang.json"
        )
    text = export_text(placement, target, layer_ids=layer_ids, num_model_layers=num_model_layers)
    p.write_text(text)


def _equal_slots(placement: Placement, target: str) -> int:
    slots = placement.slots_per_gpu
    if np.all(slots == slots[0]):
        return int(slots[0])
    suggest = max(placement.num_physical // placement.num_gpus, -(-placement.num_experts // placement.num_gpus))
    raise EplbError(
        f"{SYSTEM_NAMES[target]} needs the same number of slots on every GPU ({_EQUAL_SLOTS_REASON[target]}); "
        f"this placement has {int(slots.min())}-{int(slots.max())} per GPU; re-solve with --slots-per-gpu {suggest}"
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


def _require_distinct_per_gpu(placement: Placement) -> None:
    slots = int(placement.slots_per_gpu[0])
    grid = placement.phy2log.reshape(placement.num_layers, placement.num_gpus, slots)
    ordered = np.sort(grid, axis=2)
    dup = np.argwhere(ordered[:, :, 1:] == ordered[:, :, :-1])
    if dup.size == 0:
        return
    layer, gpu, k = (int(v) for v in dup[0])
    raise EplbError(
        f"vllm-ascend gives each expert one slot per device, but GPU {gpu} holds expert "
        f"{int(ordered[layer, gpu, k])} twice in layer {layer}; re-solve so no GPU holds two copies of an expert "
        "(more GPUs or fewer redundant slots)"
    )


def _checked_layer_ids(placement: Placement, layer_ids: Sequence[int] | None) -> list[int]:
    if layer_ids is None:
        return list(range(placement.num_layers))
    ids = [int(v) for v in layer_ids]
    if len(ids) != placement.num_layers:
        raise EplbError(
            f"layer ids name {len(ids)} layers but the placement has {placement.num_layers}; give one model layer "
            "id per placement layer (e.g. --layer-ids 3-60 for DeepSeek-V3's 58 MoE layers)"
        )
    if min(ids) < 0:
        raise EplbError(f"layer ids must be >= 0, got {min(ids)}")
    seen: set[int] = set()
    for v in ids:
        if v in seen:
            raise EplbError(f"layer id {v} appears twice; each placement layer needs its own model layer")
        seen.add(v)
    return ids


# ----------------------------------------------------------------------------------------------------------
# Placements in
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForeignPlacement:
    """A placement read from a file: the placement, the file's format (one of TARGETS) and the model layer
    of each placement row (`layer_ids[i]` for row i)."""

    placement: Placement
    format: str
    layer_ids: list[int]


def read_placement_any(
    path: str | Path, *, num_gpus: int | None = None, layer_ids: Sequence[int] | None = None
) -> Placement:
    """Read a placement file of any supported kind (ours, SGLang, TensorRT-LLM, vllm-ascend); see
    `read_placement_file` for `num_gpus` and `layer_ids`."""
    return read_placement_file(path, num_gpus=num_gpus, layer_ids=layer_ids).placement


def read_placement_file(
    path: str | Path, *, num_gpus: int | None = None, layer_ids: Sequence[int] | None = None
) -> ForeignPlacement:
    """Read and detect a placement file: ours (`phy2log`), SGLang (`physical_to_logical_map`), TensorRT-LLM
    (YAML or JSON with `initial_global_assignments`) or vllm-ascend (`layer_list`).

    num_gpus: the EP size, needed for SGLang and TensorRT-LLM files (they do not record it).
    layer_ids: the model layers to keep, in order. SGLang rows are model layers (dense ones included) and
    TensorRT-LLM keys are model layers, so this picks rows (e.g. 3..60 for DeepSeek-V3); for our files with a
    `layer_ids` field it picks those rows; otherwise it labels the rows and must match their count.
    """
    p = Path(path)
    if not p.is_file():
        raise EplbError(f"placement file not found: {p}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise EplbError(f"{p}: not a readable text file ({exc})") from None
    data = _parse_placement_text(text, p)
    return parse_placement(data, source=str(p), num_gpus=num_gpus, layer_ids=layer_ids)


def parse_placement(
    data: Any, *, source: str = "placement", num_gpus: int | None = None, layer_ids: Sequence[int] | None = None
) -> ForeignPlacement:
    """Turn a parsed placement object (JSON or YAML) into a ForeignPlacement; see `read_placement_file`."""
    if not isinstance(data, dict):
        raise EplbError(f"{source}: expected an object (ours: phy2log; SGLang: physical_to_logical_map; "
                        "TensorRT-LLM: initial_global_assignments; vllm-ascend: layer_list)")
    if "phy2log" in data:
        placement = Placement.from_dict(data, source)
        own = data.get("layer_ids")
        rows = list(range(placement.num_layers)) if own is None else _int_list(own, f"{source}: layer_ids")
        if own is not None and len(rows) != placement.num_layers:
            raise EplbError(f"{source}: layer_ids has {len(rows)} entries but phy2log has {placement.num_layers} rows")
        return _pick_rows(placement, "json", rows, layer_ids, source, labels_only=own is None)
    if "physical_to_logical_map" in data:
        table = _int_table(data["physical_to_logical_map"], f"{source}: physical_to_logical_map")
        placement = _from_table(table, num_gpus, source, "SGLang")
        return _pick_rows(placement, "sglang", list(range(table.shape[0])), layer_ids, source, labels_only=False)
    if "initial_global_assignments" in data or "num_slots" in data:
        return _parse_trtllm(data, source, num_gpus, layer_ids)
    if "layer_list" in data:
        placement = _parse_vllm_ascend(data, source)
        return _pick_rows(placement, "vllm-ascend", list(range(placement.num_layers)), layer_ids, source,
                          labels_only=True)
    if "logical_count" in data or "loads" in data:
        raise EplbError(f"{source}: this is a load statistics file, not a placement; import it with "
                        "`eplb import-load` or pass it as --loads")
    keys = ", ".join(sorted(str(k) for k in data)[:6])
    raise EplbError(f"{source}: not a placement file I know (keys: {keys}); expected phy2log, "
                    "physical_to_logical_map, initial_global_assignments or layer_list")


def _parse_placement_text(text: str, p: Path) -> Any:
    suffix = p.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return parse_trtllm_yaml(text, str(p))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if suffix == ".json":
            raise EplbError(f"{p}: not valid JSON ({exc})") from None
    return parse_trtllm_yaml(text, str(p))


def _parse_trtllm(
    data: dict[str, Any], source: str, num_gpus: int | None, layer_ids: Sequence[int] | None
) -> ForeignPlacement:
    assignments = data.get("initial_global_assignments")
    if not assignments:
        raise EplbError(f"{source}: no initial_global_assignments (an online-only load balancer config); "
                        "there is no placement to read")
    if not isinstance(assignments, dict):
        raise EplbError(f"{source}: initial_global_assignments must map layer ids to lists of expert ids")
    rows: dict[int, Any] = {}
    for key, row in assignments.items():
        try:
            rows[int(key)] = row
        except (TypeError, ValueError):
            raise EplbError(f"{source}: initial_global_assignments key {key!r} is not a layer number") from None
    ids = sorted(rows)
    table = _int_table([rows[i] for i in ids], f"{source}: initial_global_assignments")
    num_slots = data.get("num_slots")
    if num_slots is not None and num_slots != table.shape[1]:
        raise EplbError(f"{source}: num_slots is {num_slots} but the assignments list {table.shape[1]} slots per layer")
    placement = _from_table(table, num_gpus, source, "TensorRT-LLM")
    return _pick_rows(placement, "trtllm", ids, layer_ids, source, labels_only=False)


def _parse_vllm_ascend(data: dict[str, Any], source: str) -> Placement:
    layers = data.get("layer_list")
    if not isinstance(layers, list) or not layers:
        raise EplbError(f"{source}: layer_list must be a non-empty list of layers")
    count = data.get("moe_layer_count")
    if count is not None and count != len(layers):
        raise EplbError(f"{source}: moe_layer_count is {count} but layer_list has {len(layers)} layers")
    rows: list[list[int]] = []
    slots: list[int] | None = None
    for i, layer in enumerate(layers):
        devices = layer.get("device_list") if isinstance(layer, dict) else None
        if not isinstance(devices, list) or not devices:
            raise EplbError(f"{source}: layer_list[{i}] has no device_list")
        experts = []
        for d, device in enumerate(devices):
            ids = device.get("device_expert") if isinstance(device, dict) else None
            if not isinstance(ids, list) or not ids:
                raise EplbError(f"{source}: layer_list[{i}].device_list[{d}] has no device_expert list")
            experts.append(_int_list(ids, f"{source}: layer_list[{i}].device_list[{d}].device_expert"))
        these = [len(e) for e in experts]
        if slots is None:
            slots = these
        elif these != slots:
            raise EplbError(f"{source}: layer_list[{i}] has {these} slots per device, layer 0 has {slots}")
        rows.append([v for e in experts for v in e])
    assert slots is not None
    table = np.asarray(rows, dtype=np.int64)
    return Placement(table, np.asarray(slots, dtype=np.int64), _num_experts(table, source))


def _from_table(table: NDArray[np.int64], num_gpus: int | None, source: str, system: str) -> Placement:
    if num_gpus is None:
        raise EplbError(f"{source}: {system} placement files do not record the EP size; pass the GPU count (--gpus)")
    if num_gpus < 1 or table.shape[1] % num_gpus:
        raise EplbError(f"{source}: {table.shape[1]} slots per layer do not split evenly over {num_gpus} GPUs; "
                        "pass the EP size the file was made for (--gpus)")
    slots = np.full(num_gpus, table.shape[1] // num_gpus, dtype=np.int64)
    return Placement(table, slots, _num_experts(table, source))


def _num_experts(table: NDArray[np.int64], source: str) -> int:
    if table.size == 0 or table.min() < 0:
        raise EplbError(f"{source}: expert ids must be >= 0")
    return int(table.max()) + 1


def _pick_rows(
    placement: Placement,
    fmt: str,
    rows: list[int],
    wanted: Sequence[int] | None,
    source: str,
    *,
    labels_only: bool,
) -> ForeignPlacement:
    if wanted is None:
        return ForeignPlacement(placement, fmt, rows)
    want = [int(v) for v in wanted]
    if labels_only:
        if len(want) != placement.num_layers:
            raise EplbError(f"{source}: {len(want)} layer ids given for a placement of {placement.num_layers} layers")
        return ForeignPlacement(placement, fmt, want)
    index = {layer: i for i, layer in enumerate(rows)}
    missing = [v for v in want if v not in index]
    if missing:
        raise EplbError(f"{source}: has no row for layer {missing[0]} (it covers layers {rows[0]}..{rows[-1]})")
    picked = [index[v] for v in want]
    shares = None if placement.shares is None else placement.shares[picked]
    sub = Placement(placement.phy2log[picked], placement.slots_per_gpu, placement.num_experts, shares)
    return ForeignPlacement(sub, fmt, want)


def parse_trtllm_yaml(text: str, source: str = "config") -> dict[str, Any]:
    """Parse a TensorRT-LLM load-balancer YAML: `key: value` lines and `initial_global_assignments` as indented
    `layer: [ids]` flow lists (what `trtllm_yaml` and TensorRT-LLM's generate_eplb_config.py write) or `- id`
    block lists. Other layouts are read with PyYAML when it is installed."""
    try:
        return _parse_simple_yaml(text)
    except ValueError as exc:
        problem = str(exc)
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise EplbError(f"{source}: cannot read this YAML layout ({problem}); install PyYAML or write "
                        "initial_global_assignments as `layer: [ids]` lines") from None
    try:
        data = yaml.safe_load(text)
    except Exception as err:  # PyYAML's errors share no public base we can name without importing it
        raise EplbError(f"{source}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise EplbError(f"{source}: expected a YAML mapping with num_slots and initial_global_assignments")
    return data


def _parse_simple_yaml(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mapping: dict[int, list[int]] | None = None
    current: list[int] | None = None
    pending = ""  # a flow list continued over lines
    pending_key: int | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if pending:
            pending += " " + line.strip()
            if "]" in line:
                assert mapping is not None and pending_key is not None
                mapping[pending_key] = _flow_list(pending, number)
                pending, pending_key = "", None
            continue
        indented = line[0] in " \t"
        stripped = line.strip()
        if not indented:
            mapping, current = None, None
            key, sep, value = stripped.partition(":")
            if not sep or not key:
                raise ValueError(f"line {number}: expected `key: value`")
            value = value.strip()
            if value == "":
                mapping = {}
                out[key.strip()] = mapping
            else:
                out[key.strip()] = _scalar(value, number)
            continue
        if mapping is None:
            raise ValueError(f"line {number}: unexpected indentation")
        if stripped.startswith("-"):
            if current is None:
                raise ValueError(f"line {number}: list item outside a layer")
            current.append(_int_scalar(stripped[1:].strip(), number))
            continue
        key, sep, value = stripped.partition(":")
        if not sep:
            raise ValueError(f"line {number}: expected `layer: [ids]`")
        layer = _int_scalar(key.strip(), number)
        value = value.strip()
        if value == "":
            current = []
            mapping[layer] = current
        elif value.startswith("[") and "]" not in value:
            pending, pending_key, current = value, layer, None
        else:
            mapping[layer] = _flow_list(value, number)
            current = None
    if pending:
        raise ValueError("a [ list is never closed")
    return out


def _flow_list(value: str, number: int) -> list[int]:
    value = value.strip()
    if not (value.startswith("[") and value.endswith("]")):
        raise ValueError(f"line {number}: expected a [..] list")
    body = value[1:-1].strip()
    return [_int_scalar(v.strip(), number) for v in body.split(",")] if body else []


def _scalar(value: str, number: int) -> Any:
    if value.startswith("[") or value.startswith("{"):
        raise ValueError(f"line {number}: inline collections are not supported")
    try:
        return int(value)
    except ValueError:
        lowered = value.lower()
        if lowered in ("null", "~"):
            return None
        if lowered in ("true", "false"):
            return lowered == "true"
        return value.strip("'\"")


def _int_scalar(value: str, number: int) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"line {number}: {value!r} is not an integer") from None


def _int_table(value: Any, what: str) -> NDArray[np.int64]:
    arr = _numeric_array(value, what)
    if arr.ndim != 2:
        raise EplbError(f"{what} must be [layers][slots], got shape {list(arr.shape)}")
    if arr.size == 0:
        raise EplbError(f"{what} is empty")
    if not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must hold integer expert ids")
    return arr.astype(np.int64)


def _int_list(value: Any, what: str) -> list[int]:
    arr = _numeric_array(value, what)
    if arr.ndim != 1 or not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must be a list of integers")
    return [int(v) for v in arr]


# ----------------------------------------------------------------------------------------------------------
# Load statistics in
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportedLoads:
    """Per-step expert counts read from a serving system.

    counts: [steps, layers, E] tokens routed to each logical expert (token-to-expert assignments);
    layer_ids: model layer of each row; source: where they came from; format: sglang, trtllm or vllm;
    meta: extra facts from the files (e.g. num_experts_per_token, iterations).
    """

    counts: NDArray[np.float64]
    layer_ids: list[int]
    source: str
    format: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def window(self) -> NDArray[np.float64]:
        """The load window eplb solves on: counts summed over steps, [layers, E]."""
        return np.asarray(self.counts.sum(axis=0), dtype=np.float64)

    def select_steps(self, start: int | None, stop: int | None) -> ImportedLoads:
        """Keep steps[start:stop] (Python slice rules, so -100: keeps the last 100)."""
        picked = self.counts[start:stop]
        if picked.shape[0] == 0:
            raise EplbError(f"steps {'' if start is None else start}:{'' if stop is None else stop} select none of "
                            f"the {self.num_steps} recorded steps")
        return replace(self, counts=picked, meta={**self.meta, "steps_selected": [start, stop]})


def import_loads(
    fmt: str,
    paths: Sequence[str | Path],
    *,
    drop_empty_layers: bool = True,
    phy2log: NDArray[np.int64] | None = None,
) -> ImportedLoads:
    """Read load statistics of format `fmt` (sglang, trtllm or vllm) from `paths`; see the readers."""
    if not paths:
        raise EplbError("no input files given")
    if fmt == "sglang":
        return read_sglang_loads(paths, drop_empty_layers=drop_empty_layers)
    if fmt == "trtllm":
        return read_trtllm_loads(paths)
    if fmt == "vllm":
        return read_vllm_loads(paths, phy2log=phy2log)
    raise EplbError(f"unknown load format {fmt!r}; choose one of {', '.join(LOAD_FORMATS)}")


def read_sglang_loads(paths: Sequence[str | Path], *, drop_empty_layers: bool = True) -> ImportedLoads:
    """SGLang expert distribution `stat` dumps: `logical_count` [steps, layers, E] or [layers, E] in JSON
    (`{"logical_count": ...}`) or .npz (array `logical_count`, or a single array) or .npy.

    Several files are stacked along the step axis. SGLang's rows are model layers, dense ones included (all
    zero); with drop_empty_layers those rows are dropped and `layer_ids` keeps the model layer of each row left.
    """
    parts: list[NDArray[np.float64]] = []
    names: list[str] = []
    for raw in paths:
        p = _existing(raw)
        suffix = p.suffix.lower()
        if suffix == ".pt":
            raise EplbError(
                f"{p}: SGLang's .pt dumps need torch to read; convert once with python -c \"import torch, numpy; "
                f"d = torch.load('{p.name}'); numpy.savez('{p.stem}.npz', logical_count=d['logical_count'].numpy())\""
            )
        if suffix == ".json":
            data = _read_json(p)
            if not isinstance(data, dict) or "logical_count" not in data:
                raise EplbError(f"{p}: missing 'logical_count' (expected SGLang's stat dump, "
                                '{"logical_count": [[...per expert...] per layer]})')
            value: Any = data["logical_count"]
        elif suffix in (".npz", ".npy"):
            value = _read_array(p, ("logical_count",))
        else:
            raise EplbError(f"{p}: unknown file type '{suffix}' for SGLang statistics (use .json, .npz or .npy)")
        parts.append(_steps_layers_experts(value, f"{p}: logical_count"))
        names.append(p.name)
    counts = _stack(parts, names)
    layer_ids = list(range(counts.shape[1]))
    if drop_empty_layers:
        totals = counts.sum(axis=(0, 2))
        keep = np.flatnonzero(totals > 0)
        if keep.size == 0:
            raise EplbError(f"{', '.join(names)}: every count is 0; record while requests are being served")
        counts = counts[:, keep]
        layer_ids = [int(v) for v in keep]
    source = f"SGLang expert distribution ({', '.join(names)}, {counts.shape[0]} step(s))"
    return ImportedLoads(counts, layer_ids, source, "sglang")


def read_trtllm_loads(paths: Sequence[str | Path]) -> ImportedLoads:
    """TensorRT-LLM expert statistics: a directory (or its files) with `meta_info.json` (`num_experts`,
    `num_experts_per_token`) and one `rank{N}.safetensors` (or `rank{N}.json`) per rank mapping
    `"{iter}_{layer}"` to [E] counts. Ranks are summed; iterations become steps, layers (model layer ids,
    sorted) become rows. Every iteration must cover the same layers."""
    meta_path, rank_files = _trtllm_files(paths)
    meta = _read_json(meta_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("num_experts"), int) or meta["num_experts"] < 1:
        raise EplbError(f"{meta_path}: missing 'num_experts' (a positive integer)")
    num_experts = int(meta["num_experts"])
    totals: dict[tuple[int, int], NDArray[np.float64]] = {}
    for f in rank_files:
        for key, arr in _trtllm_rank_counts(f).items():
            m = re.fullmatch(r"(\d+)_(\d+)", key)
            if not m:
                raise EplbError(f"{f}: key {key!r} is not '{{iteration}}_{{layer}}'")
            vec = _counts_vector(arr, f"{f}: {key}", num_experts)
            it_layer = (int(m.group(1)), int(m.group(2)))
            totals[it_layer] = totals[it_layer] + vec if it_layer in totals else vec
    if not totals:
        raise EplbError(f"{rank_files[0].parent}: the rank files hold no counts")
    iters = sorted({k[0] for k in totals})
    layers = sorted({k[1] for k in totals})
    counts = np.zeros((len(iters), len(layers), num_experts), dtype=np.float64)
    for i, it in enumerate(iters):
        for j, layer in enumerate(layers):
            if (it, layer) not in totals:
                raise EplbError(f"{rank_files[0].parent}: iteration {it} has no counts for layer {layer}; "
                                "every iteration must cover the same layers")
            counts[i, j] = totals[(it, layer)]
    info: dict[str, Any] = {k: v for k, v in meta.items() if isinstance(v, int | float | str)}
    info.update({"iterations": [iters[0], iters[-1] + 1], "ranks": len(rank_files)})
    source = (f"TensorRT-LLM expert statistics ({meta_path.parent}, {len(rank_files)} rank file(s), "
              f"iterations {iters[0]}-{iters[-1]})")
    return ImportedLoads(counts, layers, source, "trtllm", info)


def read_vllm_loads(paths: Sequence[str | Path], *, phy2log: NDArray[np.int64] | None = None) -> ImportedLoads:
    """vLLM-style per-step counts: .npy, .npz (array `counts`, `logical_count`, `loads` or
    `expert_load_window`, or a single array) or .json (`{"counts": ...}` or `{"loads": ...}`), shaped
    [steps, MoE layers, E] or [MoE layers, E]. Several files are stacked along the step axis.

    vLLM's own `expert_load_window` counts physical slots, [steps, layers, P]: give `phy2log` [layers, P]
    (or store `physical_to_logical_map` in the .npz) and the slot counts are added up per logical expert.
    """
    parts: list[NDArray[np.float64]] = []
    names: list[str] = []
    for raw in paths:
        p = _existing(raw)
        suffix = p.suffix.lower()
        table = phy2log
        if suffix == ".json":
            data = _read_json(p)
            key = next((k for k in ("counts", "logical_count", "loads", "expert_load_window")
                        if isinstance(data, dict) and k in data), None)
            if key is None:
                raise EplbError(f"{p}: expected a 'counts' field holding [steps][layers][experts] token counts")
            value: Any = data[key]
            if table is None and "physical_to_logical_map" in data:
                table = _int_table(data["physical_to_logical_map"], f"{p}: physical_to_logical_map")
        elif suffix in (".npz", ".npy"):
            value = _read_array(p, ("counts", "logical_count", "loads", "expert_load_window"))
            if table is None and suffix == ".npz":
                table = _npz_table(p)
        else:
            raise EplbError(f"{p}: unknown file type '{suffix}' for vLLM counts (use .npy, .npz or .json)")
        arr = _steps_layers_experts(value, f"{p}: counts")
        if table is not None:
            arr = fold_physical(arr, table, f"{p}")
        parts.append(arr)
        names.append(p.name)
    counts = _stack(parts, names)
    source = f"vLLM-style counts ({', '.join(names)}, {counts.shape[0]} step(s))"
    return ImportedLoads(counts, list(range(counts.shape[1])), source, "vllm")


def fold_physical(
    counts: NDArray[np.float64], phy2log: NDArray[np.int64], what: str = "counts", num_experts: int | None = None
) -> NDArray[np.float64]:
    """Add physical-slot counts [steps, layers, P] up per logical expert with phy2log [layers, P]:
    returns [steps, layers, E], E = num_experts or max(phy2log) + 1."""
    table = np.asarray(phy2log, dtype=np.int64)
    if table.ndim != 2 or table.shape != counts.shape[1:]:
        raise EplbError(f"{what}: counts have {counts.shape[1]} layers x {counts.shape[2]} slots but the "
                        f"physical_to_logical_map is {list(table.shape)}; use the map that was live while recording")
    if table.min() < 0:
        raise EplbError(f"{what}: physical_to_logical_map holds negative expert ids")
    experts = int(table.max()) + 1 if num_experts is None else num_experts
    steps, layers, _ = counts.shape
    flat = table + (np.arange(layers, dtype=np.int64) * experts)[:, None]
    out = np.zeros((steps, layers * experts), dtype=np.float64)
    for s in range(steps):
        out[s] = np.bincount(flat.ravel(), weights=counts[s].ravel(), minlength=layers * experts)
    return out.reshape(steps, layers, experts)


def write_loads(loads: ImportedLoads, path: str | Path, *, keep_steps: bool = False) -> None:
    """Write a load file eplb reads (docs/formats.md): .json `{"loads": [layers][E], "source", "format",
    "layer_ids", "num_steps", ...}`, .npz (`loads`, or `counts` [steps, layers, E] with keep_steps, plus
    `layer_ids`) or .npy (the array alone). keep_steps writes the per-step counts instead of their sum."""
    p = Path(path)
    arr = loads.counts if keep_steps else loads.window
    suffix = p.suffix.lower()
    if suffix == ".json":
        values = arr.astype(np.int64).tolist() if np.all(np.mod(arr, 1) == 0) else arr.tolist()
        obj: dict[str, Any] = {
            "source": loads.source,
            "format": f"{loads.format} (imported by eplb import-load)",
            "layer_ids": loads.layer_ids,
            "num_steps": loads.num_steps,
            "num_experts": int(arr.shape[-1]),
            **{k: v for k, v in loads.meta.items() if k not in ("source", "loads")},
            "loads": values,
        }
        p.write_text(json.dumps(obj) + "\n")
    elif suffix == ".npz":
        ids = np.asarray(loads.layer_ids, dtype=np.int64)
        if keep_steps:
            np.savez(p, counts=arr, layer_ids=ids)
        else:
            np.savez(p, loads=arr, layer_ids=ids)
    elif suffix == ".npy":
        np.save(p, arr)
    else:
        raise EplbError(f"{p}: unknown output type '{suffix}' (use .json, .npz or .npy)")


def read_safetensors(path: str | Path) -> dict[str, NDArray[Any]]:
    """Read a safetensors file into numpy arrays without the safetensors package: an 8-byte little-endian
    header length, a JSON header `{name: {dtype, shape, data_offsets: [begin, end]}}` (offsets relative to
    the data after the header, optional `__metadata__`), then the raw little-endian data."""
    p = Path(path)
    blob = p.read_bytes()
    if len(blob) < 8:
        raise EplbError(f"{p}: too short to be a safetensors file")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise EplbError(f"{p}: not a safetensors file (header length {size} exceeds the file)")
    try:
        header = json.loads(blob[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EplbError(f"{p}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise EplbError(f"{p}: not a safetensors file (its header is not a JSON object)")
    data = memoryview(blob)[8 + size :]
    out: dict[str, NDArray[Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(v) for v in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EplbError(f"{p}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise EplbError(f"{p}: tensor {name!r} has dtype {dtype}, which eplb does not read")
        np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        if not (0 <= begin <= end <= len(data)) or end - begin != count * np_dtype.itemsize:
            raise EplbError(f"{p}: tensor {name!r} has data offsets that do not match its shape")
        arr = np.frombuffer(data[begin:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.copy()
    return out


_SAFETENSORS_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


def _trtllm_files(paths: Sequence[str | Path]) -> tuple[Path, list[Path]]:
    given = [Path(p) for p in paths]
    if len(given) == 1 and given[0].is_dir():
        folder = given[0]
        meta = folder / "meta_info.json"
        files = sorted(f for f in folder.glob("rank*.safetensors") if not f.name.endswith("_raw.safetensors"))
        files += sorted(f for f in folder.glob("rank*.json") if not f.name.endswith("_numtokens.json"))
        if not meta.is_file():
            raise EplbError(f"{folder}: no meta_info.json; point at the folder TensorRT-LLM wrote "
                            "(EXPERT_STATISTIC_PATH)")
        if not files:
            raise EplbError(f"{folder}: no rank*.safetensors (or rank*.json) count files")
        return meta, files
    for p in given:
        _existing(p)
    metas = [p for p in given if p.name == "meta_info.json"]
    files = [p for p in given if p.name != "meta_info.json"]
    if len(metas) != 1:
        raise EplbError("TensorRT-LLM statistics need their meta_info.json: pass the folder, or meta_info.json "
                        "and the rank files")
    if not files:
        raise EplbError("no rank count files given next to meta_info.json")
    return metas[0], files


def _trtllm_rank_counts(p: Path) -> dict[str, Any]:
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        return dict(read_safetensors(p))
    if suffix == ".json":
        data = _read_json(p)
        if not isinstance(data, dict):
            raise EplbError(f"{p}: expected an object mapping '{{iteration}}_{{layer}}' to lists of counts")
        return data
    raise EplbError(f"{p}: unknown rank file type '{suffix}' (use rank*.safetensors or rank*.json)")


def _counts_vector(value: Any, what: str, num_experts: int) -> NDArray[np.float64]:
    arr = _numeric_array(value, what)
    if arr.ndim != 1 or arr.size != num_experts:
        raise EplbError(f"{what} has shape {list(arr.shape)}; expected {num_experts} counts (meta_info num_experts)")
    _check_counts(arr, what)
    return arr


def _steps_layers_experts(value: Any, what: str) -> NDArray[np.float64]:
    arr = _numeric_array(value, what)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise EplbError(f"{what} must be [steps][layers][experts] or [layers][experts], got shape {list(arr.shape)}")
    if 0 in arr.shape:
        raise EplbError(f"{what} is empty (shape {list(arr.shape)})")
    _check_counts(arr, what)
    return arr


def _check_counts(arr: NDArray[np.float64], what: str) -> None:
    bad = np.argwhere(~np.isfinite(arr))
    if bad.size:
        index = "".join(f"[{int(v)}]" for v in bad[0])
        raise EplbError(f"{what}{index} is {arr[tuple(bad[0])]}: counts must be finite numbers")
    neg = np.argwhere(arr < 0)
    if neg.size:
        index = "".join(f"[{int(v)}]" for v in neg[0])
        raise EplbError(f"{what}{index} is {arr[tuple(neg[0])]:g}: counts must be >= 0")


def _stack(parts: list[NDArray[np.float64]], names: list[str]) -> NDArray[np.float64]:
    for part, name in zip(parts[1:], names[1:], strict=True):
        if part.shape[1:] != parts[0].shape[1:]:
            raise EplbError(f"{name} has {part.shape[1]} layers x {part.shape[2]} experts but {names[0]} has "
                            f"{parts[0].shape[1]} x {parts[0].shape[2]}; import files of one model together")
    return np.concatenate(parts, axis=0)


def _numeric_array(value: Any, what: str) -> NDArray[np.float64]:
    if isinstance(value, list):
        _check_rectangular(value, what)
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError):
        raise EplbError(f"{what} must hold only numbers") from None
    return arr


def _check_rectangular(rows: list[Any], what: str) -> None:
    if not rows or not all(isinstance(r, list) for r in rows):
        return
    for i, r in enumerate(rows):
        if len(r) != len(rows[0]):
            raise EplbError(f"{what} is ragged: row 0 has {len(rows[0])} entries, row {i} has {len(r)}")
    for i, r in enumerate(rows):
        _check_rectangular(r, f"{what}[{i}]")


def _read_array(p: Path, keys: tuple[str, ...]) -> NDArray[Any]:
    try:
        if p.suffix.lower() == ".npy":
            return np.asarray(np.load(p, allow_pickle=False))
        with np.load(p, allow_pickle=False) as npz:
            names = list(npz.files)
            for key in keys:
                if key in names:
                    return np.asarray(npz[key])
            arrays = [n for n in names if n not in ("layer_ids", "physical_to_logical_map")]
            if len(arrays) == 1:
                return np.asarray(npz[arrays[0]])
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise EplbError(f"{p}: not a readable numpy file ({exc})") from None
    raise EplbError(f"{p}: expected an array named {' or '.join(repr(k) for k in keys)}, found {names}")


def _npz_table(p: Path) -> NDArray[np.int64] | None:
    with np.load(p, allow_pickle=False) as npz:
        if "physical_to_logical_map" not in npz.files:
            return None
        return _int_table(np.asarray(npz["physical_to_logical_map"]), f"{p}: physical_to_logical_map")


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EplbError(f"{p}: not valid JSON ({exc})") from None


def _existing(raw: str | Path) -> Path:
    p = Path(raw)
    if not p.is_file():
        raise EplbError(f"file not found: {p}")
    return p
