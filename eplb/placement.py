"""The placement of experts on GPUs, its validation, and placement files.

A placement holds, per MoE layer, `phy2log[layer, slot]`: the logical expert in each physical slot.
Slots are numbered GPU by GPU; GPU g owns a contiguous run of `slots_per_gpu[g]` slots (DeepSeek EPLB's
and vLLM's convention). `log2phy` and `replicas` are derived from it. Optional `shares[layer, slot]`
say what fraction of its expert's tokens each slot serves (absent: uniform, 1 / replicas).

An entry of -1 (`EMPTY_SLOT`) is an empty slot, as vLLM marks the slots of ranks that are absent while it
scales EP up or down: it holds no expert's weights, serves no tokens (share 0) and is no replica; it still
counts in `slots_per_gpu`. Every logical expert still needs a replica in every layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, FieldError, shown
from eplb.io.files import existing_file, int_list, number_text, output_file, plural, read_json, real_array, replace_text
from solvers.validation import (
    EMPTY_SLOT,
    InvalidPlacement,
    replica_counts,
    slot_gpu,
    validate_placement,
    whole_number,
)

FORMAT = "eplb.placement/v1"


@dataclass(frozen=True)
class Placement:
    """A validated expert placement for every MoE layer.

    phy2log: [layers, num_physical] int64 logical expert per slot (-1: empty slot); slots_per_gpu: [G] int64;
    num_experts: E (an int); shares: [layers, num_physical] float64 or None for uniform shares; layer_ids: the
    model layer of each row (DeepSeek-V3's MoE layers are 3..60), whole numbers >= 0 in increasing order, or None
    when unknown (the exports then number the rows 0..layers-1).
    """

    phy2log: NDArray[np.int64]
    slots_per_gpu: NDArray[np.int64]
    num_experts: int
    shares: NDArray[np.float64] | None = None
    layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        num_experts = expert_count(self.num_experts, "placement: num_experts")
        phy2log = _expert_ids(self.phy2log, num_experts)
        slots = _slot_counts(self.slots_per_gpu, phy2log.shape[1] if phy2log.ndim == 2 else None)
        shares = None if self.shares is None else real_array(
            self.shares, "placement: shares", "placement: shares must hold only numbers")
        try:
            validate_placement(phy2log, slots, num_experts, shares)
        except InvalidPlacement as exc:
            raise EplbError(f"invalid placement: {exc}") from None
        layer_ids = None if self.layer_ids is None else tuple(
            row_layer_ids(self.layer_ids, phy2log.shape[0], increasing=True))
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "slots_per_gpu", slots)
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "shares", shares)
        object.__setattr__(self, "layer_ids", layer_ids)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_gpus(self) -> int:
        return int(self.slots_per_gpu.size)

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def empty_slots(self) -> NDArray[np.bool_]:
        """Slots that hold no expert (-1 in phy2log): [layers, num_physical]."""
        return np.asarray(self.phy2log == EMPTY_SLOT)

    @property
    def slot_gpu(self) -> NDArray[np.int64]:
        """GPU of every slot: [num_physical]."""
        return slot_gpu(self.slots_per_gpu)

    @property
    def replicas(self) -> NDArray[np.int64]:
        """Replicas of each logical expert: [layers, E], each >= 1."""
        return replica_counts(self.phy2log, self.num_experts)

    @property
    def log2phy(self) -> NDArray[np.int64]:
        """Slots of each logical expert: [layers, E, max replicas], padded with -1, slots ascending
        (empty slots appear nowhere)."""
        layers, num_physical = self.phy2log.shape
        width = int(self.replicas.max())
        order = np.argsort(self.phy2log, axis=1, kind="stable")  # empty slots (-1) sort first
        sorted_experts = np.take_along_axis(self.phy2log, order, axis=1)
        held = sorted_experts != EMPTY_SLOT
        first = np.zeros((layers, self.num_experts), dtype=np.int64)
        counts = self.replicas
        first[:, 1:] = np.cumsum(counts, axis=1)[:, :-1]
        empties = (~held).sum(axis=1, keepdims=True)
        rank = np.arange(num_physical)[None, :] - empties - np.take_along_axis(first, sorted_experts.clip(0), axis=1)
        out = np.full((layers, self.num_experts, width), -1, dtype=np.int64)
        rows = np.repeat(np.arange(layers), num_physical)
        out[rows[held.ravel()], sorted_experts[held], rank[held]] = order[held]
        return out

    def slot_shares(self) -> NDArray[np.float64]:
        """Fraction of its expert's tokens each slot serves: [layers, num_physical] (0 for empty slots)."""
        if self.shares is not None:
            return self.shares
        counts = np.take_along_axis(self.replicas, self.phy2log.clip(0), axis=1)
        return np.where(self.empty_slots, 0.0, 1.0 / counts)

    def to_dict(self) -> dict[str, Any]:
        """The placement file's JSON object (see docs/formats.md)."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "num_experts": self.num_experts,
            "num_gpus": self.num_gpus,
            "slots_per_gpu": self.slots_per_gpu.tolist(),
            "phy2log": self.phy2log.tolist(),
            "replicas": self.replicas.tolist(),
        }
        if self.shares is not None:
            out["shares"] = np.round(self.shares, 12).tolist()
        if self.layer_ids is not None:
            out["layer_ids"] = list(self.layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "placement") -> Placement:
        """Read a placement object (docs/formats.md); `format`, `replicas`, `num_gpus`, `shares` and `layer_ids`
        are optional, and checked if present."""
        if not isinstance(data, dict):
            raise EplbError(f"{source}: expected a JSON object with phy2log and slots_per_gpu")
        for key in ("phy2log", "slots_per_gpu"):
            if key not in data:
                raise EplbError(f"{source}: missing field '{key}'")
        if data.get("format", FORMAT) != FORMAT:
            raise EplbError(f"{source}: format is {shown(data['format'])}, but eplb reads placement files of format "
                            f"{FORMAT!r}")
        phy2log = _int_array(data["phy2log"], f"{source}: phy2log", 2)
        slots = _int_array(data["slots_per_gpu"], f"{source}: slots_per_gpu", 1)
        num_experts = data.get("num_experts")
        if num_experts is None:
            num_experts = int(phy2log.max()) + 1 if phy2log.size else 0
        num_experts = expert_count(num_experts, f"{source}: num_experts")
        shares = None
        if data.get("shares") is not None:
            shares = _float_matrix(data["shares"], f"{source}: shares")
        try:
            placement = cls(phy2log, slots, num_experts, shares, data.get("layer_ids"))
        except FieldError as exc:  # layer_ids: named with the file
            raise FieldError(exc.fields, exc.message, f"{source}: {exc}") from None
        if "replicas" in data and _int_array(data["replicas"], f"{source}: replicas", 2).tolist() != \
                placement.replicas.tolist():
            raise EplbError(f"{source}: 'replicas' does not match the replica counts in phy2log")
        gpus = data.get("num_gpus", placement.num_gpus)
        if isinstance(gpus, bool) or gpus != placement.num_gpus:
            raise EplbError(f"{source}: num_gpus is {shown(gpus)} but slots_per_gpu lists {placement.num_gpus}")
        return placement


def save_placement(placement: Placement, path: str | Path) -> None:
    """Write a placement file (JSON)."""
    replace_text(output_file(path), json.dumps(placement.to_dict()) + "\n")


def load_placement(path: str | Path) -> Placement:
    """Read a placement file written by `save_placement` (or any JSON with the same fields)."""
    p = existing_file(path, "placement file")
    return Placement.from_dict(read_json(p), str(p))


def _int_array(value: Any, what: str, ndim: int) -> NDArray[np.int64]:
    """Integers read through float64: exact only within +-2**53, so larger ones are refused, not wrapped."""
    arr = _array(value, what, ndim)
    if not np.all(np.mod(arr, 1) == 0):
        raise EplbError(f"{what} must hold integers")
    if arr.size and np.abs(arr).max() > 2**53:
        big = arr.flat[np.abs(arr).argmax()]
        raise EplbError(f"{what} holds {big:.3g}, too large for an expert id or a slot count")
    return arr.astype(np.int64)


def _float_matrix(value: Any, what: str) -> NDArray[np.float64]:
    return _array(value, what, 2)


def _array(value: Any, what: str, ndim: int) -> NDArray[np.float64]:
    arr = real_array(value, what, f"{what} must be a {'list of lists' if ndim == 2 else 'list'} of numbers "
                     "with equal row lengths")
    if arr.ndim != ndim:
        raise EplbError(f"{what} must be {ndim}-dimensional, got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise EplbError(f"{what} holds NaN or infinite values")
    return arr


def expert_count(value: object, what: str) -> int:
    """`value` as E, the logical experts of a layer: an int or a numpy integer >= 1, returned as a Python int (it
    is written to JSON); EplbError naming `what` for anything else (a float, even 6.0; a bool; a string), by
    `solvers.validation.whole_number`, the Python API's one reading of counts."""
    count = whole_number(value)
    if count is None or count < 1:
        kind = "" if count is not None else f" ({type(value).__name__})"
        raise EplbError(f"{what} must be a whole number >= 1 (an int), got {shown(value)}{kind}")
    return count


def appears_twice(layer: int) -> str:
    """The message for a layer named twice (a placement's layers are distinct model layers)."""
    return f"layer {layer} appears twice: every placement layer is a different model layer"


def row_layer_ids(layer_ids: Any, num_layers: int, *, increasing: bool = False) -> list[int]:
    """The model layer of each of a placement's `num_layers` rows: `layer_ids`, whole numbers >= 0, one per row,
    each a different layer, and with `increasing` in increasing order (as `Placement.layer_ids`). Raises
    FieldError('layer_ids', ...) otherwise: the one check of the field, of the exports' layer ids
    (`eplb.io.exports.checked_layer_ids`) and of the service's."""
    try:
        ids = int_list(layer_ids, "layer_ids")
    except EplbError as exc:
        text = str(exc)
        raise FieldError("layer_ids", text.removeprefix("layer_ids").lstrip(": "), text) from None
    if len(ids) != num_layers:
        raise FieldError("layer_ids", f"{plural(len(ids), 'id')} for the placement's {plural(num_layers, 'layer')}: "
                         "give one model layer per placement layer (e.g. 3-60 for DeepSeek-V3's 58 MoE layers)")
    seen: set[int] = set()
    for i, v in enumerate(ids):
        if v < 0:
            raise FieldError("layer_ids", f"layer {v} is negative: model layers count from 0")
        if v in seen:
            raise FieldError("layer_ids", appears_twice(v))
        if increasing and i and v < ids[i - 1]:
            raise FieldError("layer_ids", f"layer {v} comes after layer {ids[i - 1]}: a placement's rows are its "
                             "model layers in increasing order")
        seen.add(v)
    return ids


def _expert_ids(value: Any, num_experts: int) -> NDArray[np.int64]:
    """phy2log as int64 [layers, num_physical] (a 1-D row is one layer). Ids of another dtype are checked against
    -1..E-1 before they are converted, so that 2**64 - 1 (uint64) is not taken as -1, an empty slot."""
    try:
        raw = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (ValueError, TypeError):
        raise EplbError("placement: phy2log must be [layers][slots] expert ids, rows of one length") from None
    if raw.ndim == 1:
        raw = raw[None, :]
    if raw.dtype == np.int64:
        return raw
    if raw.dtype.kind not in "iuf":
        raise EplbError(f"placement: phy2log must hold integer expert ids, got {raw.dtype} values")
    if raw.ndim == 2:
        for bad, rule in ((np.mod(raw, 1) != 0 if raw.dtype.kind == "f" else None, "expert ids are whole numbers"),
                          ((raw < EMPTY_SLOT) | (raw >= num_experts),
                           f"expert ids run 0..{num_experts - 1} (-1 marks an empty slot)")):
            if bad is not None and bad.any():
                layer, slot = (int(v) for v in np.argwhere(bad)[0])
                raise EplbError(f"invalid placement: phy2log[{layer}][{slot}] is {number_text(raw[layer, slot])}: "
                                f"{rule}")
    return raw.astype(np.int64)


def _slot_counts(value: Any, num_physical: int | None) -> NDArray[np.int64]:
    """slots_per_gpu as int64 [G]: whole numbers (3.7 is refused, not cut to 3), checked against the
    `num_physical` slots of a layer before they are converted (2**64 - 1 would become -1)."""
    try:
        raw = np.asarray(value).reshape(-1)
    except (ValueError, TypeError):
        raise EplbError("placement: slots_per_gpu must be a list of slot counts") from None
    if raw.dtype == np.int64:
        return raw
    if raw.dtype.kind not in "iuf":
        raise EplbError(f"placement: slots_per_gpu must hold whole slot counts, got {raw.dtype} values")
    for bad, rule in ((np.mod(raw, 1) != 0 if raw.dtype.kind == "f" else None, "a GPU holds a whole number of slots"),
                      (raw > num_physical if num_physical is not None else None,
                       f"more than the {plural(num_physical or 0, 'slot')} of a phy2log row")):
        if bad is not None and bad.any():
            gpu = int(np.argmax(bad))
            raise EplbError(f"invalid placement: slots_per_gpu[{gpu}] is {number_text(raw[gpu])}: {rule}")
    return raw.astype(np.int64)
