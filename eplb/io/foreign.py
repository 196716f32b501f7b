"""Placements in: ours, SGLang's, TensorRT-LLM's and vllm-ascend's files (`read_placement_file`,
`read_placement_any`), detected by their keys. Every failure is an EplbError saying what to change."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray

from eplb.errors import EplbError
from eplb.io.exports import MAX_MODEL_LAYERS, ranges, repeated_on_a_gpu
from eplb.io.files import existing_file, int_list, int_table, parse_json, plural, refuse_bools
from eplb.placement import Placement
from solvers.validation import EMPTY_SLOT


@dataclass(frozen=True)
class ForeignPlacement:
    """A placement read from a file: the placement (its `layer_ids` the model layers the file states, if any)
    and the file's format (one of TARGETS)."""

    placement: Placement
    format: str

    @property
    def layer_ids(self) -> list[int]:
        """The model layer of each placement row (`layer_ids[i]` for row i): the placement's, else 0..layers-1."""
        ids = self.placement.layer_ids
        return list(range(self.placement.num_layers)) if ids is None else list(ids)


def read_placement_any(
    path: str | Path, *, num_gpus: int | None = None, layer_ids: Sequence[int] | None = None,
    gpus_flag: str = "num_gpus",
) -> Placement:
    """Read a placement file of any supported kind (ours, SGLang, TensorRT-LLM, vllm-ascend); see
    `read_placement_file` for `num_gpus`, `layer_ids` and `gpus_flag`."""
    return read_placement_file(path, num_gpus=num_gpus, layer_ids=layer_ids, gpus_flag=gpus_flag).placement


def read_placement_for(
    path: str | Path, num_layers: int, num_experts: int, *, layer_ids: Sequence[int] | None = None,
    num_gpus: int | None = None, gpus_flag: str | None = "num_gpus",
) -> Placement:
    """Read a placement to use with a load window of num_layers x num_experts (its model layers `layer_ids`);
    a placement of another shape is refused naming both shapes, then one for other than num_gpus GPUs as in
    `read_placement_file` (`eplb evaluate --placement`, `eplb solve --current`: its flag). gpus_flag None: num_gpus
    only splits SGLang and TensorRT-LLM files, and the caller compares the GPU count with its cluster's."""
    try:
        placement = _read(path, num_gpus, layer_ids, num_experts).placement
        picked: EplbError | None = None
    except EplbError as exc:
        if layer_ids is None:
            raise
        placement = _read(path, num_gpus, None, num_experts).placement
        picked = exc  # the file's own error, if any
    if (placement.num_layers, placement.num_experts) != (num_layers, num_experts):
        unlabelled = (layer_ids is None and placement.layer_ids is not None and placement.num_layers > num_layers
                      and placement.num_experts == num_experts)  # e.g. SGLang's model-layer rows, a vLLM window
        raise EplbError(
            f"{path}: the placement is {plural(placement.num_layers, 'layer')} x "
            f"{plural(placement.num_physical, 'slot')} of {plural(placement.num_experts, 'expert')} but the loads are "
            f"{plural(num_layers, 'layer')} x {plural(num_experts, 'expert')}; "
            "give the placement solved for these loads" + (
                " (eplb's file), or give the loads the model layer of each row (layer_ids, e.g. 3-60 for "
                "DeepSeek-V3) to pick the placement's rows by: these have none (a vLLM window numbers MoE layers by "
                "position)" if unlabelled else "")
        )
    if gpus_flag is not None:  # after the shape: another model's file says that first
        refuse_other_gpus(path, placement, num_gpus, gpus_flag)
    if picked is not None:  # the right shape, but its rows are other model layers than the loads name
        raise picked
    return placement


def refuse_other_gpus(path: str | Path, placement: Placement, num_gpus: int | None, flag: str = "--gpus") -> None:
    """A GPU count given for a file that records its own (ours, vllm-ascend) must be the file's: refuse another,
    naming `flag` (SGLang and TensorRT-LLM files were split over num_gpus, so theirs always agree). The one
    check, which `read_placement_file` and `parse_placement` run, and `read_placement_for` after the shape's."""
    if num_gpus is not None and num_gpus != placement.num_gpus:
        own = placement.num_gpus
        raise EplbError(f"{flag} {num_gpus}: {path} records its own GPU count, {own}: give {own}, or a placement "
                        f"for {plural(num_gpus, 'GPU')} (only SGLang and TensorRT-LLM files, which do not record "
                        f"it, need {flag} to be read)")


def read_placement_file(
    path: str | Path, *, num_gpus: int | None = None, layer_ids: Sequence[int] | None = None,
    gpus_flag: str = "num_gpus",
) -> ForeignPlacement:
    """Read and detect a placement file: ours (`phy2log`), SGLang (`physical_to_logical_map`), TensorRT-LLM
    (YAML or JSON with `initial_global_assignments`) or vllm-ascend (`layer_list`).

    num_gpus: the EP size, needed for SGLang and TensorRT-LLM files (they do not record it); for files that
    record it (ours, vllm-ascend) it must be theirs, or is refused naming `gpus_flag` (`refuse_other_gpus`).
    layer_ids: the model layers to keep, in increasing order. SGLang rows are model layers (dense ones included)
    and TensorRT-LLM keys are model layers, so this picks rows (e.g. 3..60 for DeepSeek-V3); for our files with a
    `layer_ids` field it picks those rows; otherwise it labels the rows and must match their count.
    The placement read carries the model layer of each row (`Placement.layer_ids`) when the file or `layer_ids`
    states them: SGLang's rows, TensorRT-LLM's keys, our `layer_ids` field; None otherwise.
    """
    foreign = _read(path, num_gpus, layer_ids)
    refuse_other_gpus(path, foreign.placement, num_gpus, gpus_flag)
    return foreign


def _read(path: str | Path, num_gpus: int | None, layer_ids: Sequence[int] | None,
          num_experts: int | None = None) -> ForeignPlacement:
    """`read_placement_file` but for the check of num_gpus against a GPU count the file records; num_experts: the
    experts of the loads the placement is for, if known (`_parse`)."""
    p = existing_file(path, "placement file")
    if p.suffix.lower() in (".jsonl", ".ndjson"):  # one JSON object a line: YAML's parser said only '<document start>'
        raise EplbError(f"{p}: a routing log (JSONL), not a placement: give it to eplb replay; placements are JSON "
                        "or YAML text (eplb's, SGLang's, TensorRT-LLM's or vllm-ascend's)")
    try:
        text = p.read_text()
    except UnicodeDecodeError as exc:
        raise EplbError(f"{p}: {_binary_kind(p) or f'not a readable text file ({exc})'}") from None
    except OSError as exc:
        raise EplbError(f"{p}: not a readable text file ({exc})") from None
    return _parse(_parse_placement_text(text, p), str(p), num_gpus, layer_ids, num_experts)


def _binary_kind(p: Path) -> str | None:
    """What a binary file given as a placement is, when it is one of ours (an .npz or .npy of loads or a routing
    log, a Parquet shard), with where it goes; None otherwise."""
    with p.open("rb") as f:
        magic = f.read(6)
    use = "give it as --loads (or to eplb replay)"
    if magic == b"\x93NUMPY":
        kind = "a numpy array (.npy): a load window or a routing log"
    elif magic.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(p) as zf:
                members = zf.namelist()
        except (zipfile.BadZipFile, OSError):
            return None
        arrays = {n.removesuffix(".npy") for n in members if n.endswith(".npy")}
        if not arrays:
            return None
        kind = ("a token-level routing log (topk_ids)" if "topk_ids" in arrays else
                "a routing log (per-step counts)" if "counts" in arrays else
                "a load window (loads)" if "loads" in arrays else "a numpy archive (.npz)")
    elif magic.startswith(b"PAR1"):
        kind, use = "a Parquet shard of a routing log", "give it to eplb replay"
    else:
        return None
    return (f"{kind}, not a placement: {use}; placements are JSON or YAML text (eplb's, SGLang's, TensorRT-LLM's "
            "or vllm-ascend's)")


def parse_placement(
    data: Any, *, source: str = "placement", num_gpus: int | None = None, layer_ids: Sequence[int] | None = None,
    gpus_flag: str = "num_gpus",
) -> ForeignPlacement:
    """Turn a parsed placement object (JSON or YAML) into a ForeignPlacement; see `read_placement_file`."""
    foreign = _parse(data, source, num_gpus, layer_ids)
    refuse_other_gpus(source, foreign.placement, num_gpus, gpus_flag)
    return foreign


def _parse(data: Any, source: str, num_gpus: int | None, layer_ids: Sequence[int] | None,
           num_experts: int | None = None) -> ForeignPlacement:
    """A ForeignPlacement of parsed file `data`. num_experts: the experts of the loads it is for, if known: files
    that do not record theirs (SGLang, TensorRT-LLM, vllm-ascend: E is their largest id + 1) must not name an id
    beyond them."""
    if not isinstance(data, dict):
        raise EplbError(f"{source}: expected an object (ours: phy2log; SGLang: physical_to_logical_map; "
                        "TensorRT-LLM: initial_global_assignments; vllm-ascend: layer_list)")
    if "phy2log" in data:
        placement = Placement.from_dict(data, source)
        return _pick_rows(placement, "json", layer_ids, source)
    if "physical_to_logical_map" in data:
        _refuse_other_keys(data, {"physical_to_logical_map"}, source, "SGLang passes every key of the file to "
                           "init_by_mapping, so it would not start with")
        table = int_table(data["physical_to_logical_map"], f"{source}: physical_to_logical_map")
        _refuse_float_ids(data["physical_to_logical_map"], source)
        placement = _from_table(table, num_gpus, source, "SGLang", list(range(table.shape[0])), num_experts)
        return _pick_rows(placement, "sglang", layer_ids, source)
    if "initial_global_assignments" in data or "num_slots" in data:
        return _parse_trtllm(data, source, num_gpus, layer_ids, num_experts)
    if "layer_list" in data:
        placement = _parse_vllm_ascend(data, source, num_experts)
        return _pick_rows(placement, "vllm-ascend", layer_ids, source)
    if "logical_count" in data or "loads" in data:
        raise EplbError(f"{source}: this is a load statistics file, not a placement; import it with "
                        "`eplb import-load` or pass it as --loads")
    if "stages" in data and "num_copies" in data:  # what `eplb solve --plan` writes next to its --out
        raise EplbError(f"{source}: a migration plan (stages), not a placement: give the placement it leads to (the "
                        "--out of the eplb solve that wrote it)")
    keys = ", ".join(sorted(str(k) for k in data)[:6])
    raise EplbError(f"{source}: not a placement file I know (keys: {keys}); expected phy2log, "
                    "physical_to_logical_map, initial_global_assignments or layer_list")


def _refuse_float_ids(rows: list[list[Any]], source: str) -> None:
    """Refuse an SGLang map [layers][slots] (whole numbers, as `int_table` checked) holding one as a float (2.0):
    SGLang's `torch.tensor` of it is a float tensor, which it cannot index its expert lists by."""
    for r, row in enumerate(rows):
        for s, v in enumerate(row):
            if isinstance(v, float):
                raise EplbError(f"{source}: physical_to_logical_map[{r}][{s}] is {v}: SGLang makes a float tensor of "
                                "a map holding one and cannot start with it; write expert ids as whole numbers (2)")


def _refuse_other_keys(data: dict[str, Any], keys: set[str], source: str, why: str) -> None:
    """Refuse an engine's placement file `data` holding a key other than `keys`, the ones the engine takes: it
    would not have served the file (`why ... key 'x'`)."""
    other = sorted(str(k) for k in data if k not in keys)
    if other:
        raise EplbError(f"{source}: {why} {'key' if len(other) == 1 else 'keys'} "
                        f"{', '.join(repr(k) for k in other[:3])}{' ...' if len(other) > 3 else ''}: drop "
                        f"{'it' if len(other) == 1 else 'them'}")


def _parse_placement_text(text: str, p: Path) -> Any:
    """The object in placement file `p`: JSON unless named .yaml/.yml, YAML when it is not JSON and not named .json
    (a JSON `null` is JSON's, refused by `_parse` as no object, not called a YAML mistake)."""
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml"):
        try:
            data = parse_json(text, str(p))
        except json.JSONDecodeError as exc:
            if suffix == ".json":
                raise EplbError(f"{p}: not valid JSON ({exc})") from None
        else:
            refuse_bools(data, text, f"{p}: ")
            return data
    data = parse_trtllm_yaml(text, str(p))
    refuse_bools(data, None, f"{p}: ")
    return data


def _parse_trtllm(
    data: dict[str, Any], source: str, num_gpus: int | None, layer_ids: Sequence[int] | None,
    num_experts: int | None = None,
) -> ForeignPlacement:
    assignments = data.get("initial_global_assignments")
    if not assignments:
        raise EplbError(f"{source}: no initial_global_assignments (an online-only load balancer config); "
                        "there is no placement to read")
    if not isinstance(assignments, dict):
        raise EplbError(f"{source}: initial_global_assignments must map layer ids to lists of expert ids")
    rows: dict[int, Any] = {}
    keys: dict[int, Any] = {}
    for key, row in assignments.items():
        layer = _layer_key(key, source)
        if layer in rows:
            raise EplbError(f"{source}: initial_global_assignments keys {keys[layer]!r} and {key!r} are both layer "
                            f"{layer}; give each layer once")
        rows[layer], keys[layer] = row, key
    ids = sorted(rows)
    table = int_table([rows[i] for i in ids], f"{source}: initial_global_assignments")
    num_slots = data.get("num_slots")
    if num_slots is not None and num_slots != table.shape[1]:
        raise EplbError(f"{source}: num_slots is {num_slots!r} but the assignments list "
                        f"{plural(table.shape[1], 'slot')} per layer")
    placement = _from_table(table, num_gpus, source, "TensorRT-LLM", ids, num_experts)
    return _pick_rows(placement, "trtllm", layer_ids, source)


def _layer_key(key: Any, source: str) -> int:
    """A TensorRT-LLM `initial_global_assignments` key as its model layer: a whole number >= 0 as ids are read
    (`int_list`: 3.7 and true/false are refused, not cut to 3 or read as 1), or its digits (JSON's keys are text)."""
    try:
        (layer,) = int_list([int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key], "key")
    except EplbError:
        layer = -1
    if layer < 0:
        raise EplbError(f"{source}: initial_global_assignments key {key!r} is not a layer number (a whole number "
                        ">= 0, the model layer of its row)")
    if layer >= MAX_MODEL_LAYERS:  # as --layer-ids: no model has the layer, TensorRT-LLM would not look for it
        raise EplbError(f"{source}: initial_global_assignments key {key!r} is beyond any model's layers (at most "
                        f"{MAX_MODEL_LAYERS:,})")
    return layer


def _parse_vllm_ascend(data: dict[str, Any], source: str, num_experts: int | None = None) -> Placement:
    """A vllm-ascend expert map as vllm-ascend loads it (`ExpertLoadBalancer._expert_file_to_tensor`): it reads
    `moe_layer_count` and layer 0's `device_count` as required keys (a KeyError makes it fall back to its default
    map), builds one [layers, devices, slots] tensor and maps each expert to one slot per device; a map it would not
    serve as written is refused, naming the entry."""
    layers = data.get("layer_list")
    if not isinstance(layers, list) or not layers:
        raise EplbError(f"{source}: layer_list must be a non-empty list of layers")
    if "moe_layer_count" not in data:
        raise EplbError(f"{source}: no moe_layer_count: vllm-ascend reads it from the map (without it, it serves its "
                        f"default map instead); add \"moe_layer_count\": {len(layers)}")
    count = data["moe_layer_count"]
    if count != len(layers):
        raise EplbError(f"{source}: moe_layer_count is {count!r} but layer_list has {plural(len(layers), 'layer')}")
    if isinstance(layers[0], dict) and "device_count" not in layers[0]:
        raise EplbError(f"{source}: layer_list[0] has no device_count: vllm-ascend reads the device count from layer "
                        "0 (without it, it serves its default map instead); add it")
    rows: list[list[int]] = []
    slots: list[int] | None = None
    for i, layer in enumerate(layers):
        devices = layer.get("device_list") if isinstance(layer, dict) else None
        if not isinstance(devices, list) or not devices:
            raise EplbError(f"{source}: layer_list[{i}] has no device_list")
        _check_vllm_ascend_ids(layer, devices, i, f"{source}: layer_list[{i}]")
        experts = []
        for d, device in enumerate(devices):
            ids = device.get("device_expert") if isinstance(device, dict) else None
            if not isinstance(ids, list) or not ids:
                raise EplbError(f"{source}: layer_list[{i}].device_list[{d}] has no device_expert list")
            experts.append(int_list(ids, f"{source}: layer_list[{i}].device_list[{d}].device_expert"))
        these = [len(e) for e in experts]
        if len(set(these)) > 1:
            raise EplbError(f"{source}: layer_list[{i}] has {these} slots per device: vllm-ascend builds one "
                            "[layers, devices, slots] tensor, so every device holds the same number")
        if slots is None:
            slots = these
        elif these != slots:
            raise EplbError(f"{source}: layer_list[{i}] has {these} slots per device, layer 0 has {slots}")
        rows.append([v for e in experts for v in e])
    assert slots is not None
    table = np.asarray(rows, dtype=np.int64)
    twice = repeated_on_a_gpu(table, slots[0])
    if twice is not None:
        layer, device, expert = twice
        raise EplbError(f"{source}: layer_list[{layer}].device_list[{device}].device_expert holds expert {expert} "
                        "twice: vllm-ascend maps each expert to one slot per device, so one copy would get none of "
                        "its tokens; give each device distinct experts")
    return Placement(table, np.asarray(slots, dtype=np.int64), _num_experts(table, source, num_experts))


def _check_vllm_ascend_ids(layer: dict[str, Any], devices: list[Any], index: int, where: str) -> None:
    """A vllm-ascend layer's `layer_id`, `device_count` and `device_id`s, where given (layer 0's `device_count`
    must be, `_parse_vllm_ascend`), must agree with its place in `layer_list` (`index`) and its `devices` list:
    vllm-ascend reads layers and devices by position and ignores them (vllm_ascend/eplb/core/eplb_utils.py), so a
    file where they disagree was not written as it will be served."""
    said = layer.get("layer_id")
    if said is not None and said != index:
        raise EplbError(f"{where} has layer_id {said!r}: vllm-ascend takes the layers in list order, so entry {index} "
                        f"is MoE layer {index}; list the layers in order")
    count = layer.get("device_count")
    if count is not None and count != len(devices):
        raise EplbError(f"{where} says device_count {count!r} but its device_list has "
                        f"{plural(len(devices), 'device')}; list every device, or correct device_count")
    ids = [device.get("device_id") if isinstance(device, dict) else None for device in devices]
    for d, device_id in enumerate(ids):
        if device_id is None or device_id == d:
            continue
        if ids.count(device_id) > 1:
            first = ids.index(device_id)
            again = ids.index(device_id, first + 1)
            raise EplbError(f"{where}: device_id {device_id!r} appears twice (device_list[{first}] and [{again}]); "
                            "give each device once")
        raise EplbError(f"{where}.device_list[{d}] has device_id {device_id!r}: vllm-ascend takes the devices in list "
                        f"order, so entry {d} is device {d}; list the devices in order")


def _from_table(
    table: NDArray[np.int64], num_gpus: int | None, source: str, system: str, layer_ids: list[int],
    num_experts: int | None = None,
) -> Placement:
    """An SGLang or TensorRT-LLM table [rows][slots] split over num_gpus, its rows model layers `layer_ids`."""
    if num_gpus is None:
        raise EplbError(f"{source}: {system} placement files do not record the EP size; pass the GPU count (--gpus)")
    if num_gpus < 1 or table.shape[1] % num_gpus:
        raise EplbError(f"{source}: {plural(table.shape[1], 'slot')} per layer do not split evenly over "
                        f"{plural(num_gpus, 'GPU')}; "
                        "pass the EP size the file was made for (--gpus)")
    slots = np.full(num_gpus, table.shape[1] // num_gpus, dtype=np.int64)
    return Placement(table, slots, _num_experts(table, source, num_experts), layer_ids=tuple(layer_ids))


def _num_experts(table: NDArray[np.int64], source: str, expected: int | None = None) -> int:
    """E of a table [rows][slots] of expert ids that does not record it: its largest id + 1. `expected`: the loads'
    E, if known; an id beyond it, in a table that lacks some id below it (no placement of that many experts: each
    would be called missing), is refused by name; a whole placement of more experts is left to the caller's shape
    check (another model's file)."""
    if table.size == 0 or table.min() < EMPTY_SLOT:
        raise EplbError(f"{source}: expert ids must be >= 0 (or -1 for an empty slot)")
    top = int(table.max())
    if expected is not None and top >= expected:
        held = np.zeros((table.shape[0], top + 1), dtype=bool)
        rows, cols = np.nonzero(table >= 0)
        held[rows, table[rows, cols]] = True
        if held.all():
            return top + 1
        row, slot = (int(v) for v in np.argwhere(table >= expected)[0])
        raise EplbError(f"{source}: row {row}, slot {slot}: expert id {int(table[row, slot])} is outside "
                        f"0..{expected - 1} (the loads have {plural(expected, 'expert')}); give the placement made "
                        "for these loads")
    return top + 1


def _pick_rows(placement: Placement, fmt: str, wanted: Sequence[int] | None, source: str) -> ForeignPlacement:
    """The rows of model layers `wanted`, in that order, of a placement whose rows have layer ids; `wanted` labels
    the rows of one without (it must then name one layer per row)."""
    if wanted is None:
        return ForeignPlacement(placement, fmt)
    want = [int(v) for v in wanted]
    if placement.layer_ids is None:
        if len(want) != placement.num_layers:
            raise EplbError(f"{source}: {plural(len(want), 'layer id')} given for a placement of "
                            f"{plural(placement.num_layers, 'layer')}")
        return ForeignPlacement(dataclasses.replace(placement, layer_ids=tuple(want)), fmt)
    rows = placement.layer_ids
    index = {layer: i for i, layer in enumerate(rows)}
    missing = [v for v in want if v not in index]
    if missing:
        raise EplbError(f"{source}: has no row for layer {missing[0]} (it covers layers {ranges(list(rows))})")
    picked = [index[v] for v in want]
    shares = None if placement.shares is None else placement.shares[picked]
    sub = Placement(placement.phy2log[picked], placement.slots_per_gpu, placement.num_experts, shares, tuple(want))
    return ForeignPlacement(sub, fmt)


def parse_trtllm_yaml(text: str, source: str = "config") -> dict[str, Any]:
    """Parse a TensorRT-LLM load-balancer YAML (PyYAML's SafeLoader, refusing a key given twice) into its mapping."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as dup:
        again = f"key {dup.key!r} appears twice" if repr(dup.key) == repr(dup.first) else (
            f"key {dup.key!r} repeats key {dup.first!r}")
        raise EplbError(f"{source}: line {dup.line}: {again} in one mapping (YAML would keep only the last); "
                        "give each key once") from None
    except yaml.YAMLError as err:
        raise EplbError(f"{source}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise EplbError(f"{source}: expected a YAML mapping with num_slots and initial_global_assignments")
    return data


class _DuplicateKey(Exception):
    """A key given twice in one YAML mapping, at `line` (1-based); `first`: the equal key before it (3 for 3.0)."""

    def __init__(self, key: Any, first: Any, line: int) -> None:
        super().__init__(key, first, line)
        self.key, self.first, self.line = key, first, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (`_DuplicateKey`) where safe_load keeps the
    last silently; merged keys (`<<`) may still be overridden, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
                seen[key] = key
            except TypeError:  # unhashable: SafeLoader refuses it below
                pass
        return super().construct_mapping(node, deep)
