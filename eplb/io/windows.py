"""Load windows: tokens routed to each logical expert of each MoE layer over a window.

Files (docs/formats.md):
- `.json`: `{"loads": [[...E counts...] per layer]}` (other keys such as `source`, `layer_ids` are kept
  as metadata), or a bare list of lists;
- `.npy`: a `[layers, E]` window, or `[steps, layers, E]` per-step counts (summed over steps);
- `.npz`: array `loads` (`[layers, E]`) or `counts` (`[steps, layers, E]`, summed), or a single array.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, FieldError
from eplb.io.files import (
    existing_file,
    json_kind,
    number_text,
    plural,
    read_json,
    real_array,
    unreadable_npz,
    usable_path,
)
from eplb.placement import row_layer_ids
from solvers.validation import MAX_LOAD as MAX_LOAD  # the one cap on token counts, re-exported
from solvers.validation import load_refusal

DEFAULT_WINDOW = "dsv3-prefill-in1024.json"


@dataclass(frozen=True)
class LoadWindow:
    """loads: [layers, E] tokens (token-to-expert assignments) per logical expert; meta: file metadata."""

    loads: NDArray[np.float64]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.loads.shape[1])


def check_loads(value: Any, what: str = "loads") -> NDArray[np.float64]:
    """Validate a window: [layers, E] (or [steps, layers, E], summed over steps), finite, >= 0 and at most
    MAX_LOAD.

    Raises EplbError naming the first bad row or value: of per-step counts, the entry as the file holds it
    ([step][layer][expert]), then, if each is a count, the first of their sums beyond MAX_LOAD.
    """
    if isinstance(value, list):
        _check_rectangular(value, what)
    arr = real_array(value, what, f"{what} must be numbers in a [layers][experts] array")
    empty = (f"{what} is empty: a window holds at least one layer of the model's experts, one count per expert "
             f"([layers][experts]; got shape {list(arr.shape)})")
    if arr.ndim < 3 and arr.size == 0:  # [], [[]]: no layer, or a layer of no expert
        raise EplbError(empty)
    if arr.ndim == 1:
        raise EplbError(f"{what} must be [layers][experts]; got one row of {plural(arr.size, 'number')} "
                        "(wrap a single layer in another list)")
    if arr.ndim != 2 and arr.ndim != 3:
        raise EplbError(f"{what} must be [layers][experts] or [steps][layers][experts], got shape {list(arr.shape)}")
    if arr.size == 0:  # steps of no layer, or of layers of no expert
        raise EplbError(empty)
    why = load_refusal(arr, what, number_text)  # finite, >= 0, at most MAX_LOAD: the solvers' own rule
    if why is None and arr.ndim == 3:  # each step's counts are fine (named [step][layer][expert]): their sum?
        steps = arr.shape[0]
        arr = arr.sum(axis=0)
        why = load_refusal(arr, f"{what} summed over its {plural(steps, 'step')}, ", number_text)
    if why is not None:
        raise EplbError(why)
    return arr


def _check_rectangular(rows: list[Any], what: str) -> None:
    if rows and all(isinstance(r, list) for r in rows):
        lengths = [len(r) for r in rows]
        for i, n in enumerate(lengths):
            if n != lengths[0]:
                raise EplbError(f"{what} is ragged: row 0 has {plural(lengths[0], 'expert')}, row {i} has {n}")
        for i, r in enumerate(rows):
            if r and isinstance(r[0], list):
                _check_rectangular(r, f"{what}[{i}]")


def read_window(path: str | Path | None = None) -> LoadWindow:
    """Read a load window file; None reads the embedded default (a DeepSeek-V3 prefill window)."""
    if path is None:
        data = json.loads(resources.files("eplb.data").joinpath(DEFAULT_WINDOW).read_text())
        return _window(check_loads(data["loads"]), f"embedded default ({DEFAULT_WINDOW})", _meta(data))
    raw = usable_path(path, "load file")  # a name the system refuses is one line, not is_dir's OSError
    if raw.is_dir() and any(raw.glob("part-*.parquet")):  # a Parquet log's shards
        raise EplbError(_log_not_window(raw))
    p = existing_file(path, "load file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".parquet"):
        raise EplbError(_log_not_window(p))
    if suffix == ".json":
        return _read_json(p)
    if suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise EplbError(f"{p}: not a readable .npy array ({exc or 'cut short'})") from None
        return LoadWindow(check_loads(arr, str(p)), str(p))
    if suffix == ".npz":
        return _read_npz(p)
    raise EplbError(f"{p}: unknown load file type '{suffix}' (use .json, .npy or .npz)")


def _log_not_window(p: Path) -> str:
    """A JSONL or Parquet routing log given as --loads: how to make it a window (an .npz log reads as one)."""
    return (f"{p}: a routing log, which --loads reads only as an .npz: write one with `eplb logs convert {p} log.npz` "
            "(its counts summed over the steps are the window), or replay it with eplb replay")


def _read_json(p: Path) -> LoadWindow:
    data = read_json(p)
    if isinstance(data, dict):
        if "loads" not in data:
            raise EplbError(_not_a_window(p, data))
        return _window(check_loads(data["loads"], f"{p}: loads"), str(p), _meta(data))
    return LoadWindow(check_loads(data, str(p)), str(p))


def _not_a_window(p: Path, data: dict[str, Any]) -> str:
    """Why a JSON object without 'loads' is no load window: the kind of file it is, when its keys tell (a placement,
    a migration plan, an engine's statistics dump), and what takes it."""
    kind, what = json_kind(data) or ("", "")
    if kind == "placement":
        return (f"{p}: {what}, not a load window: give it as --placement (eplb evaluate) or --current (eplb solve), "
                "and the window as --loads")
    if kind == "sglang":
        return (f"{p}: {what}, not a load window: make one with `eplb import-load --from sglang {p} --out "
                "window.json`")
    if kind == "plan":
        return f"{p}: {what}, not a load window: give the window the plan was made for"
    keys = ", ".join(sorted(str(k) for k in data)[:6]) or "none"
    text = f"{p}: expected a 'loads' field holding [layers][experts] token counts (keys: {keys})"
    if "counts" in data:
        text += (f"; per-step counts [steps][layers][experts] under 'counts' are read by `eplb import-load --from "
                 f"vllm {p} --out window.json`")
    return text


def _window(loads: NDArray[np.float64], source: str, meta: dict[str, Any]) -> LoadWindow:
    """A window with metadata `meta`, its `layer_ids` (if any) checked against its rows."""
    if meta.get("layer_ids") is not None:
        meta = {**meta, "layer_ids": window_layer_ids(meta["layer_ids"], loads.shape[0], source)}
    return LoadWindow(loads, source, meta)


def window_layer_ids(value: Any, num_layers: int, source: str, rows: str = "the loads have") -> list[int]:
    """A window's or a routing log's `layer_ids`, the model layer of each of its `num_layers` rows, by the
    placements' rule (`eplb.placement.row_layer_ids`: whole numbers >= 0, one per row, increasing), since
    `eplb solve --out` writes them into the placement; EplbError naming `source` otherwise (`rows`: what holds the
    rows, for the message)."""
    if isinstance(value, list | np.ndarray) and len(value) != num_layers:
        raise EplbError(f"{source}: layer_ids lists {plural(len(value), 'layer')} but {rows} "
                        f"{plural(num_layers, 'row')}: give one model layer per row (e.g. 3-60 for DeepSeek-V3's 58 "
                        "MoE layers), or drop layer_ids")
    try:
        return row_layer_ids(value, num_layers, increasing=True)
    except FieldError as exc:
        raise EplbError(f"{source}: layer_ids: {exc.message}") from None


def _read_npz(p: Path) -> LoadWindow:
    try:
        with np.load(p, allow_pickle=False) as npz:
            names = list(npz.files)
            refuse_mixed_arrays(names, p)
            if "topk_ids" in names:  # a token-level log: the window is its picks per expert, all steps summed
                return _read_topk_log(p)
            meta = {} if "layer_ids" not in names else {"layer_ids": npz["layer_ids"].tolist()}
            if "format" in names and "counts" in names:  # a routing log's (eplb.io.logs): the version it says
                from eplb.io.logs import FORMAT_COUNTS, check_format

                check_format({"format": npz["format"].tolist()}, FORMAT_COUNTS, str(p))
            for key in ("loads", "counts"):
                if key in names:
                    return _window(check_loads(npz[key], f"{p}: {key}"), str(p), meta)
            if len(names) == 1:
                return LoadWindow(check_loads(npz[names[0]], f"{p}: {names[0]}"), str(p))
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise EplbError(unreadable_npz(p, exc)) from None
    raise EplbError(f"{p}: expected an array named 'loads' or 'counts', found {names}")


NPZ_ARRAYS = {"loads": "a [layers, E] window", "counts": "[steps, layers, E] per-step counts",
              "topk_ids": "token-level routing"}
"""The arrays an .npz of loads or a routing log is read by: a file holds one of them."""


def refuse_mixed_arrays(names: Iterable[str], path: str | Path) -> None:
    """EplbError when an .npz's arrays `names` hold more than one of NPZ_ARRAYS: which one it is would be a guess
    (the one check of `read_window` and `eplb.io.logs.open_log`)."""
    present = set(names)
    held = [key for key in NPZ_ARRAYS if key in present]
    if len(held) > 1:
        kinds = "; ".join(f"{key}: {NPZ_ARRAYS[key]}" for key in held)
        raise EplbError(f"{path}: holds both {held[0]!r} and {held[1]!r}, so which to read is unclear; keep one "
                        f"({kinds})")


def _read_topk_log(p: Path) -> LoadWindow:
    from eplb.io.logs import open_log

    log = open_log(p)
    total = np.zeros((log.info.num_layers, log.info.num_experts))
    for chunk in log.iter_counts(4096):
        total += chunk.counts.sum(axis=0, dtype=np.float64)
    meta = {} if log.info.layer_ids is None else {"layer_ids": log.info.layer_ids}
    return _window(check_loads(total, f"{p}: topk_ids"), f"{p} (token-level log, all steps)", meta)


def _meta(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "loads"}
