"""Routing logs: what a cluster's router did, step by step, in three file formats.

A *step* is one forward pass of the whole EP group; its *counts* are `[layers, E]` token-to-expert
assignments (a layer sums to top_k x tokens). Formats (docs/formats.md, "Routing logs"):

- per-step counts, `.npz` (`eplb.counts/v1`): `counts [steps, layers, E]` integers plus metadata
  `model`, `num_experts`, `top_k`, optional `steps [steps]` (step ids, increasing) and
  `layer_ids [layers]`. A plain `.npy` holding `[steps, layers, E]` also reads.
- token-level routing, `.npz` (`eplb.topk/v1`): `topk_ids [tokens, layers, k]` int16 (the shape of
  vLLM's routed-experts capture) and `step_offsets [steps + 1]` (step i is tokens
  `step_offsets[i]:step_offsets[i+1]`); counts and expert co-activation follow from it.
- JSONL (`eplb.counts-jsonl/v1`): one record per step and layer,
  `{"step": 12, "layer": 3, "counts": [...E numbers...]}`, with an optional header line first.

Readers stream: `open_log(path).iter_counts(chunk_steps)` yields `CountsChunk`s without loading
the log, so memory is one chunk. Every problem is an `EplbError` naming the file and the step
(or the line, for JSONL): truncated files, wrong shapes, negative counts, steps out of order,
duplicate or missing layers.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb.errors import EplbError, shown
from eplb.io.files import (
    existing_file,
    number_text,
    parse_json,
    plural,
    real_array,
    refuse_bools,
    unreadable_npz,
    usable_path,
)
from eplb.io.windows import MAX_LOAD, refuse_mixed_arrays, window_layer_ids

__all__ = [
    "FORMAT_COUNTS",
    "FORMAT_JSONL",
    "FORMAT_TOPK",
    "LOG_SUFFIXES",
    "CountsChunk",
    "LogInfo",
    "RoutingLog",
    "as_log",
    "check_format",
    "coactivation",
    "count_dtype",
    "log_format",
    "open_log",
    "output_log",
    "read_counts",
    "topk_counts",
    "write_counts",
    "write_jsonl",
    "write_log",
    "write_topk",
]

FORMAT_COUNTS = "eplb.counts/v1"
FORMAT_TOPK = "eplb.topk/v1"
FORMAT_JSONL = "eplb.counts-jsonl/v1"

_COUNTS = "counts"
_TOPK = "topk_ids"
_OFFSETS = "step_offsets"
_META_KEYS = ("format", "model", "num_experts", "top_k", "steps", "layer_ids")
MAX_TOPK_EXPERTS = int(np.iinfo(np.int16).max) + 1
"""Experts a token-level log may have: its topk_ids are int16 (docs/formats.md)."""


@dataclass(frozen=True)
class LogInfo:
    """What a routing log holds. `num_steps` is None when only a full pass can tell (chunks streamed in
    without a count; a JSONL log without a `num_steps` header counts its records when opened); `kind` is
    "counts", "topk", "jsonl" or "parquet"."""

    path: str
    kind: str
    num_steps: int | None
    num_layers: int
    num_experts: int
    top_k: int | None = None
    model: str | None = None
    layer_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: `path: 4,000 steps x 58 layers x 256 experts (deepseek-v3, top-8)`."""
        steps = "? steps" if self.num_steps is None else plural(self.num_steps, "step")
        extra = [x for x in (self.model, None if self.top_k is None else f"top-{self.top_k}") if x]
        tail = f" ({', '.join(extra)})" if extra else ""
        return f"{self.path}: {steps} x {plural(self.num_layers, 'layer')} x {plural(self.num_experts, 'expert')}{tail}"


@dataclass(frozen=True)
class CountsChunk:
    """Consecutive steps of a log. start: position (0-based) of the first step in the log;
    steps: [n] step ids; counts: [n, layers, E] token-to-expert assignments (file dtype, >= 0)."""

    start: int
    steps: NDArray[np.int64]
    counts: NDArray[Any]

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[0])


class RoutingLog(ABC):
    """An opened routing log. Iterate it with `iter_counts`; nothing is loaded up front beyond
    metadata (and, for token-level logs, the step offsets)."""

    info: LogInfo
    steps_counted = False
    """True when info.num_steps was counted when the log was opened, not read from the file."""
    stored_dtype: np.dtype[Any] | None = None
    """The type the file stores counts as, when it has one (npz and npy counts, Parquet; not JSONL, topk_ids)."""

    @abstractmethod
    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        """Yield (step ids [n], counts [n, L, E]) for consecutive steps."""

    def iter_counts(self, chunk_steps: int = 256) -> Iterator[CountsChunk]:
        """Per-step counts, `chunk_steps` steps at a time (the last chunk may be shorter).
        Validates as it goes: counts >= 0 and finite, step ids strictly increasing."""
        if chunk_steps < 1:
            raise EplbError(f"chunk_steps must be >= 1, got {chunk_steps}")
        start = 0
        last_step: int | None = None
        said = self.info.num_steps
        for steps, counts in self._chunks(chunk_steps):
            if said is not None and start + counts.shape[0] > said:
                where = "header" if self.info.kind == "jsonl" else "metadata"
                raise EplbError(
                    f"{self.info.path}: the file holds more steps than its {where} says (num_steps {said}): step "
                    f"{int(steps[said - start])} (position {said}) is past them; correct num_steps or remove it"
                )
            _check_counts(counts, steps, start, self.info.path)
            if steps.size:
                if last_step is not None and steps[0] <= last_step:
                    raise _order_error(self.info.path, start, int(steps[0]), last_step)
                bad = np.flatnonzero(np.diff(steps) <= 0)
                if bad.size:
                    i = int(bad[0])
                    raise _order_error(self.info.path, start + i + 1, int(steps[i + 1]), int(steps[i]))
                last_step = int(steps[-1])
            yield CountsChunk(start, steps, counts)
            start += counts.shape[0]
        if said is not None and start != said:
            held = plural(said, "step")
            held = f"held {held} when opened" if self.steps_counted else f"says {held}"
            raise EplbError(f"{self.info.path}: truncated: the file {held} but holds {start}; step {start} is missing")

    def read_counts(self) -> CountsChunk:
        """The whole log as one chunk (for small logs: memory is steps x layers x E)."""
        parts = list(self.iter_counts(4096))
        if not parts:
            empty = np.zeros((0, self.info.num_layers, self.info.num_experts), dtype=np.int64)
            return CountsChunk(0, np.zeros(0, dtype=np.int64), empty)
        return CountsChunk(0, np.concatenate([p.steps for p in parts]), np.concatenate([p.counts for p in parts]))

    def coactivation(self, chunk_steps: int = 256) -> NDArray[np.int64]:
        """Expert co-activation [layers, E, E]: tokens that chose both experts i and j in a layer
        (the diagonal holds each expert's count). Token-level logs only."""
        raise EplbError(f"{self.info.path}: co-activation needs a token-level log (topk_ids), not {self.info.kind}")


def _order_error(path: str, position: int, step: int, previous: int) -> EplbError:
    return EplbError(
        f"{path}: steps out of order: step {step} (position {position}) comes after step {previous}; "
        "step ids must increase"
    )


def count_type_refusal(dtype: np.dtype[Any]) -> str | None:
    """Why counts of `dtype` are no token counts (bools, objects, strings, complex numbers: not a count type), or
    None for integers and floats, whose values `count_problem` judges."""
    if dtype.kind in "iuf":
        return None
    return f"counts have dtype {dtype}, not a count type: give integers (or whole floats)"


def _check_counts(counts: NDArray[Any], steps: NDArray[np.int64], start: int, path: str) -> None:
    """Raise naming the counts' type when it is no count type, else the first (step, layer, expert) that
    `count_problem` refuses."""
    wrong = count_type_refusal(counts.dtype)
    if wrong is not None:
        raise EplbError(f"{path}: {wrong}")
    found = count_problem(counts)
    if found is not None:
        (s, layer, e), why = found
        raise EplbError(f"{path}: step {int(steps[s])} (position {start + s}), layer {layer}, expert {e}: {why}")


def count_problem(counts: NDArray[Any]) -> tuple[tuple[int, ...], str] | None:
    """The first entry of `counts` (any shape, integers or floats: `count_type_refusal` refuses other types first)
    that is no token count, as (index, "count is X; why"): not finite, negative, fractional or above MAX_LOAD (the
    limit of load windows); None when every entry is one. Every log reader checks with it. Whole-array reductions
    (a mask only on failure); integer types that cannot exceed the limit (uint16, int32, ...) cost one min, or
    nothing when unsigned."""
    if not counts.size:
        return None
    kind = counts.dtype.kind
    limit = np.float64(MAX_LOAD)  # a float64 scalar: float16 counts compare in float64 (MAX_LOAD is inf in float16)
    fits = kind in "iu" and np.iinfo(counts.dtype).max <= MAX_LOAD
    if kind == "u" and (fits or counts.max() <= limit):
        return None
    if kind == "i" and counts.min() >= 0 and (fits or counts.max() <= limit):
        return None
    if kind == "f" and counts.min() >= 0 and counts.max() <= limit and np.array_equal(np.floor(counts), counts):
        return None  # NaN fails the comparisons, inf the limit
    bad = ~((counts >= 0) & (counts <= limit))
    if kind == "f":
        bad |= np.floor(counts) != counts
    index = tuple(int(v) for v in np.unravel_index(int(np.argmax(bad)), counts.shape))
    value = counts[index]
    if kind == "f" and not np.isfinite(value):
        why = "; counts must be finite"
    elif value < 0:
        why = "; counts must be >= 0"
    elif value > MAX_LOAD:
        why = f", too large for a token count (at most {MAX_LOAD:g})"
    else:
        why = "; counts must be whole numbers"
    return index, f"count is {number_text(value)}{why}"


# --------------------------------------------------------------------------------------------
# .npy members inside zip archives, read and written as streams
# --------------------------------------------------------------------------------------------


def _read_npy_header(f: IO[bytes], what: str) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise EplbError(f"{what}: not a readable .npy array ({exc})") from None
    return tuple(int(v) for v in shape), bool(fortran), np.dtype(dtype)


def _write_npy_header(f: IO[bytes], shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(f, header)


def _read_exact(f: IO[bytes], nbytes: int) -> bytes:
    """Read nbytes or fewer at end of data (callers report the shortfall)."""
    parts: list[bytes] = []
    remaining = nbytes
    while remaining > 0:
        block = f.read(remaining)
        if not block:
            break
        parts.append(block)
        remaining -= len(block)
    return b"".join(parts)


def _write_member(zf: zipfile.ZipFile, name: str, value: Any) -> None:
    arr = np.asarray(value)
    with zf.open(name + ".npy", "w") as f:
        np.lib.format.write_array(f, arr, allow_pickle=False)


def _read_small(zf: zipfile.ZipFile, name: str, path: str) -> NDArray[Any] | None:
    member = name + ".npy"
    if member not in zf.namelist():
        return None
    try:
        with zf.open(member) as f:
            arr = np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise EplbError(f"{path}: metadata '{name}' is unreadable ({exc})") from None
    return np.asarray(arr)


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise EplbError(unreadable_npz(path, exc)) from None


def _meta_from_zip(zf: zipfile.ZipFile, path: str) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key in _META_KEYS:
        arr = _read_small(zf, key, path)
        if arr is None:
            continue
        # step ids stay an array: its dtype is what `_step_ids` checks (a list of uint64 beyond int64 is float64)
        meta[key] = arr if key == "steps" else arr.tolist() if arr.ndim else arr.item()
    return meta


MAX_ID = 2**63 - 1
"""The largest step or layer id a log may hold (int64, as the readers store them)."""
MAX_META = 2**53
"""The largest count (steps, experts, top-k) metadata may state: exact as a float (a JSON 1e300 is a float)."""


def _meta_int(meta: dict[str, Any], key: str, path: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not (number and math.isfinite(value) and int(value) == value and value >= 1):  # NaN, inf: no integer
        raise EplbError(f"{path}: metadata {key} must be a positive integer, got {value!r}")
    if value > MAX_META:
        raise EplbError(f"{path}: metadata {key} is {number_text(value)}: too large (at most {MAX_META:,})")
    return int(value)


def _step_ids(meta: dict[str, Any], num_steps: int, path: str) -> NDArray[np.int64]:
    raw = meta.get("steps")
    if raw is None:
        return np.arange(num_steps, dtype=np.int64)
    steps = np.asarray(raw)
    if steps.ndim != 1 or steps.size != num_steps:
        raise EplbError(f"{path}: 'steps' must be {num_steps} integer step ids, got shape {list(steps.shape)}")
    if steps.dtype.kind not in "iu":
        raise EplbError(f"{path}: 'steps' must be integer step ids, got dtype {steps.dtype}")
    if steps.dtype.kind == "u" and steps.size and int(steps.max()) > MAX_ID:
        i = int(np.argmax(steps > MAX_ID))
        raise EplbError(f"{path}: steps[{i}] is {int(steps[i])} ({steps.dtype}): step ids are at most 2**63 - 1")
    steps = steps.astype(np.int64)
    bad = np.flatnonzero(np.diff(steps) <= 0)
    if bad.size:
        i = int(bad[0])
        raise _order_error(path, i + 1, int(steps[i + 1]), int(steps[i]))
    return steps


def check_format(meta: dict[str, Any], expected: str, path: str) -> None:
    """A log's stated `format` (optional) must be the one its reader reads, `expected`: another (a later version,
    another kind) is refused naming both, as placement files are."""
    said = meta.get("format")
    if said is not None and said != expected:
        raise EplbError(f"{path}: format is {shown(said)}, but eplb reads logs like this one as {expected!r}")


def written_layer_ids(layer_ids: ArrayLike, num_layers: int) -> list[int]:
    """`layer_ids` of a log about to be written with `num_layers` layers, by the rule its readers apply."""
    return window_layer_ids(np.asarray(layer_ids).reshape(-1).tolist(), num_layers, "the log to write",
                            "the counts have")


def _layer_ids(meta: dict[str, Any], num_layers: int, path: str) -> list[int] | None:
    """A log's `layer_ids` (None when it has none), by the windows' and placements' rule: a log's rows are model
    layers in increasing order, as the placements a replay writes hold them."""
    raw = meta.get("layer_ids")
    return None if raw is None else window_layer_ids(raw, num_layers, path, "the counts have")


def _check_axes(path: str | Path, name: str, shape: tuple[int, ...], per: str = "layer") -> None:
    """Refuse a [steps or tokens, layers, experts or k] array with no layers or none of the last axis: the replay
    and every reader would have nothing to place (and, for 0 layers, call every step empty)."""
    if shape[1] < 1:
        raise EplbError(f"{path}: {name} has 0 layers (shape {list(shape)}); a routing log records at least one "
                        "MoE layer")
    if shape[2] < 1:
        raise EplbError(f"{path}: {name} has 0 experts per {per} (shape {list(shape)})")


# --------------------------------------------------------------------------------------------
# Per-step counts: .npz and .npy
# --------------------------------------------------------------------------------------------


def _not_three_axes(path: str | Path, shape: Sequence[int]) -> str:
    """Why counts of `shape` are no log; two axes are a load window, named as one with the command that takes it."""
    return f"{path}: counts must be [steps, layers, experts], got shape {list(shape)}" + (
        " (a [layers, experts] window: use it with eplb solve --loads)" if len(shape) == 2 else "")


class _NpzCounts(RoutingLog):
    def __init__(self, path: Path) -> None:
        self._path = path
        with _open_zip(path) as zf:
            if _COUNTS + ".npy" not in zf.namelist():
                raise EplbError(f"{path}: no 'counts' array (found {sorted(n[:-4] for n in zf.namelist())})")
            meta = _meta_from_zip(zf, str(path))
            check_format(meta, FORMAT_COUNTS, str(path))
            with zf.open(_COUNTS + ".npy") as f:
                shape, fortran, dtype = _read_npy_header(f, f"{path}: counts")
        if len(shape) != 3:
            raise EplbError(_not_three_axes(path, shape))
        _check_axes(path, "counts", shape)
        if fortran:
            raise EplbError(f"{path}: counts is stored in Fortran order; save it C-contiguous to stream it")
        if (wrong := count_type_refusal(dtype)) is not None:
            raise EplbError(f"{path}: {wrong}")
        num_experts = _meta_int(meta, "num_experts", str(path))
        if num_experts is not None and num_experts != shape[2]:
            raise EplbError(f"{path}: metadata says {plural(num_experts, 'expert')}, counts have {shape[2]} per layer")
        self._shape = shape
        self._dtype = self.stored_dtype = dtype
        self._steps = _step_ids(meta, shape[0], str(path))
        self.info = LogInfo(
            path=str(path),
            kind="counts",
            num_steps=shape[0],
            num_layers=shape[1],
            num_experts=shape[2],
            top_k=_meta_int(meta, "top_k", str(path)),
            model=None if meta.get("model") is None else str(meta["model"]),
            layer_ids=_layer_ids(meta, shape[1], str(path)),
            meta=meta,
        )

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        steps, layers, experts = self._shape
        step_bytes = layers * experts * self._dtype.itemsize
        path = self._path
        try:
            with zipfile.ZipFile(path) as zf, zf.open(_COUNTS + ".npy") as f:
                _read_npy_header(f, str(path))
                done = 0
                while done < steps:
                    n = min(chunk_steps, steps - done)
                    raw = _read_exact(f, n * step_bytes)
                    if len(raw) < n * step_bytes:
                        have = done + len(raw) // step_bytes
                        raise EplbError(
                            f"{path}: truncated: counts end inside step {int(self._steps[have])} "
                            f"(position {have} of {steps})"
                        )
                    counts = np.frombuffer(raw, dtype=self._dtype).reshape(n, layers, experts)
                    yield self._steps[done : done + n], counts
                    done += n
        except (zipfile.BadZipFile, zlib.error, OSError) as exc:
            raise EplbError(f"{path}: corrupt counts data ({exc})") from None


class _NpyCounts(RoutingLog):
    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            with path.open("rb") as f:
                shape, _, dtype = _read_npy_header(f, str(path))
                offset = f.tell()
            step_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if len(shape) == 3 else 0
            if step_bytes:
                have = (path.stat().st_size - offset) // step_bytes
                raise EplbError(
                    f"{path}: truncated: the file ends inside step {have} of {shape[0]} "
                    f"({plural(have, 'complete step')})"
                ) from None
            raise EplbError(f"{path}: not a readable .npy array ({exc})") from None
        if arr.ndim != 3:
            raise EplbError(_not_three_axes(path, arr.shape))
        _check_axes(path, "counts", arr.shape)
        if (wrong := count_type_refusal(arr.dtype)) is not None:
            raise EplbError(f"{path}: {wrong}")
        self._arr = arr
        self.stored_dtype = arr.dtype
        self.info = LogInfo(str(path), "counts", int(arr.shape[0]), int(arr.shape[1]), int(arr.shape[2]))

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        total = self._arr.shape[0]
        for a in range(0, total, chunk_steps):
            b = min(total, a + chunk_steps)
            yield np.arange(a, b, dtype=np.int64), np.ascontiguousarray(self._arr[a:b])


class _ArrayLog(RoutingLog):
    """An in-memory [steps, layers, E] array or an iterable of such chunks, seen as a log."""

    def __init__(
        self,
        source: NDArray[Any] | Iterable[NDArray[Any]],
        name: str = "<array>",
        num_steps: int | None = None,
        top_k: int | None = None,
        model: str | None = None,
    ) -> None:
        self._source = source
        if isinstance(source, np.ndarray):
            if source.ndim != 3:
                raise EplbError(f"{name}: counts must be [steps, layers, experts], got shape {list(source.shape)}")
            _check_axes(name, "counts", source.shape)
            shape = source.shape
            self.stored_dtype = source.dtype
            self.info = LogInfo(name, "counts", int(shape[0]), int(shape[1]), int(shape[2]), top_k, model)
            self._first: NDArray[Any] | None = None
            self._rest: Iterator[NDArray[Any]] | None = None
        else:
            it = iter(source)
            first = np.asarray(next(it, np.zeros((0, 0, 0))))
            if first.ndim != 3 or first.shape[1] == 0 or first.shape[2] == 0:
                raise EplbError(f"{name}: chunks must be [steps, layers, experts], got shape {list(first.shape)}")
            self._first, self._rest = first, it
            self.info = LogInfo(name, "counts", num_steps, int(first.shape[1]), int(first.shape[2]), top_k, model)

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        if isinstance(self._source, np.ndarray):
            arr = self._source
            for a in range(0, arr.shape[0], chunk_steps):
                b = min(arr.shape[0], a + chunk_steps)
                yield np.arange(a, b, dtype=np.int64), arr[a:b]
            return
        if self._first is None or self._rest is None:
            raise EplbError(f"{self.info.path}: an iterable log can be read once")
        first, rest = self._first, self._rest
        self._first = None
        pos = 0
        for block in _rechunk(_same_shape(_prepend(first, rest), self.info.path), chunk_steps):
            yield np.arange(pos, pos + block.shape[0], dtype=np.int64), block
            pos += block.shape[0]


def _prepend(first: NDArray[Any], rest: Iterator[NDArray[Any]]) -> Iterator[NDArray[Any]]:
    yield first
    for block in rest:
        yield np.asarray(block)


def chunk_mismatch(index: int, position: int, shape: tuple[int, ...], first: tuple[int, ...] | None) -> str | None:
    """Why chunk `index` (its first step at `position`) of `shape` cannot follow chunks of [steps, *first] (None:
    it is the first): not [steps, layers, experts], or other layers or experts than chunk 0; None when it fits.
    The one text of the readers of chunks and the writers."""
    if len(shape) != 3:
        return f"counts chunk {index} must be [steps, layers, experts], got shape {list(shape)}"
    if first is None or shape[1:] == first:
        return None
    return (f"counts chunk {index} (from step position {position:,}) has {plural(shape[1], 'layer')} x "
            f"{plural(shape[2], 'expert')}, chunk 0 has {plural(first[0], 'layer')} x {plural(first[1], 'expert')}: "
            "every chunk holds the same layers and experts")


def _same_shape(blocks: Iterable[NDArray[Any]], path: str) -> Iterator[NDArray[Any]]:
    """The blocks [n_i, layers, E] of a stream, each checked against the first (`chunk_mismatch`, EplbError)."""
    first: tuple[int, ...] | None = None
    position = 0
    for index, block in enumerate(blocks):
        why = chunk_mismatch(index, position, block.shape, first)
        if why is not None:
            raise EplbError(f"{path}: {why}")
        first = first or block.shape[1:]
        position += block.shape[0]
        yield block


def _rechunk(blocks: Iterable[NDArray[Any]], size: int) -> Iterator[NDArray[Any]]:
    """Regroup a stream of [n_i, ...] blocks of one shape after the first axis into [size, ...] blocks (the last
    may be shorter)."""
    pending: list[NDArray[Any]] = []
    have = 0
    for block in blocks:
        while block.shape[0]:
            take = min(size - have, block.shape[0])
            pending.append(block[:take])
            have += take
            block = block[take:]
            if have == size:
                yield pending[0] if len(pending) == 1 else np.concatenate(pending)
                pending, have = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else np.concatenate(pending)


# --------------------------------------------------------------------------------------------
# Token-level routing: topk_ids [tokens, layers, k] with step offsets
# --------------------------------------------------------------------------------------------


class _TopkNpz(RoutingLog):
    def __init__(self, path: Path) -> None:
        self._path = path
        with _open_zip(path) as zf:
            names = zf.namelist()
            if _OFFSETS + ".npy" not in names:
                raise EplbError(f"{path}: a token-level log needs 'step_offsets' next to 'topk_ids'")
            meta = _meta_from_zip(zf, str(path))
            check_format(meta, FORMAT_TOPK, str(path))
            offsets_arr = _read_small(zf, _OFFSETS, str(path))
            with zf.open(_TOPK + ".npy") as f:
                shape, fortran, dtype = _read_npy_header(f, f"{path}: topk_ids")
        if len(shape) != 3:
            raise EplbError(f"{path}: topk_ids must be [tokens, layers, k], got shape {list(shape)}")
        _check_axes(path, "topk_ids", shape, per="token")
        if fortran:
            raise EplbError(f"{path}: topk_ids is stored in Fortran order; save it C-contiguous to stream it")
        if dtype.kind not in "iu":
            raise EplbError(f"{path}: topk_ids must hold integer expert ids, got dtype {dtype}")
        num_experts = _meta_int(meta, "num_experts", str(path))
        if num_experts is None:
            raise EplbError(f"{path}: a token-level log needs 'num_experts' (expert ids alone do not give E)")
        if num_experts > MAX_TOPK_EXPERTS:
            raise EplbError(f"{path}: metadata num_experts is {num_experts:,}: more than int16 topk_ids can name "
                            f"(at most {MAX_TOPK_EXPERTS:,})")
        top_k = _meta_int(meta, "top_k", str(path))
        if top_k is not None and top_k != shape[2]:
            raise EplbError(f"{path}: metadata says top_k {top_k}, topk_ids has {plural(shape[2], 'expert')} per token")
        assert offsets_arr is not None
        self._offsets = _check_offsets(offsets_arr, shape[0], str(path))
        num_steps = self._offsets.size - 1
        self._shape = shape
        self._dtype = dtype
        self._steps = _step_ids(meta, num_steps, str(path))
        self.info = LogInfo(
            path=str(path),
            kind="topk",
            num_steps=num_steps,
            num_layers=shape[1],
            num_experts=num_experts,
            top_k=shape[2],
            model=None if meta.get("model") is None else str(meta["model"]),
            layer_ids=_layer_ids(meta, shape[1], str(path)),
            meta=meta,
        )

    def _token_blocks(self, chunk_steps: int) -> Iterator[tuple[int, NDArray[Any]]]:
        """(first step index, topk_ids of steps [i, i + n)) chunk by chunk, ids validated."""
        _, layers, k = self._shape
        token_bytes = layers * k * self._dtype.itemsize
        offsets, path, num_experts = self._offsets, self._path, self.info.num_experts
        num_steps = offsets.size - 1
        try:
            with zipfile.ZipFile(path) as zf, zf.open(_TOPK + ".npy") as f:
                _read_npy_header(f, str(path))
                for i in range(0, num_steps, chunk_steps):
                    j = min(num_steps, i + chunk_steps)
                    n_tok = int(offsets[j] - offsets[i])
                    raw = _read_exact(f, n_tok * token_bytes)
                    if len(raw) < n_tok * token_bytes:
                        have = int(offsets[i]) + len(raw) // token_bytes
                        step = int(np.searchsorted(offsets, have, side="right")) - 1
                        raise EplbError(f"{path}: truncated: topk_ids end inside step {int(self._steps[step])}")
                    ids = np.frombuffer(raw, dtype=self._dtype).reshape(n_tok, layers, k)
                    if _compiled_counts(ids, None, num_experts) is not None:
                        yield i, ids  # every id in range and distinct per token and layer (eplb/_reach.c)
                        continue
                    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
                        t, layer, pick = (int(v) for v in np.argwhere((ids < 0) | (ids >= num_experts))[0])
                        step = int(np.searchsorted(offsets, offsets[i] + t, side="right")) - 1
                        raise EplbError(
                            f"{path}: step {int(self._steps[step])}, token {int(offsets[i]) + t}, layer {layer}: "
                            f"expert id {int(ids[t, layer, pick])} is outside 0..{num_experts - 1}"
                        )
                    _check_distinct(ids, offsets, i, self._steps, str(path))
                    yield i, ids
        except (zipfile.BadZipFile, zlib.error, OSError) as exc:
            raise EplbError(f"{path}: corrupt topk_ids data ({exc})") from None

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        for i, ids in self._token_blocks(chunk_steps):
            j = min(self._offsets.size - 1, i + chunk_steps)
            local = self._offsets[i : j + 1] - self._offsets[i]
            yield self._steps[i:j], topk_counts(ids, local, self.info.num_experts)

    def coactivation(self, chunk_steps: int = 256) -> NDArray[np.int64]:
        layers, experts = self.info.num_layers, self.info.num_experts
        total = np.zeros((layers, experts, experts), dtype=np.int64)
        for _, ids in self._token_blocks(chunk_steps):
            total += coactivation(ids, experts)
        return total


def _check_distinct(
    ids: NDArray[Any], offsets: NDArray[np.int64], first_step: int, step_ids: NDArray[np.int64], path: str
) -> None:
    """Raise naming the first token and layer whose top-k repeats an expert (a token picks k distinct experts)."""
    k = ids.shape[2]
    if k < 2 or not ids.size:
        return
    repeated = np.zeros(ids.shape[:2], dtype=bool)  # [tokens, layers]; pairwise: faster than sorting for small k
    for a in range(k - 1):
        for b in range(a + 1, k):
            repeated |= ids[:, :, a] == ids[:, :, b]
    if repeated.any():
        t, layer = (int(v) for v in np.argwhere(repeated)[0])
        token = int(offsets[first_step]) + t
        step = int(np.searchsorted(offsets, token, side="right")) - 1
        raise EplbError(
            f"{path}: step {int(step_ids[step])}, token {token}, layer {layer}: top-k {ids[t, layer].tolist()} names "
            "an expert twice; a token picks k distinct experts"
        )


def _check_offsets(raw: NDArray[Any], tokens: int, path: str) -> NDArray[np.int64]:
    if raw.ndim != 1 or raw.size < 1:
        raise EplbError(f"{path}: step_offsets must be [steps + 1] integers, got shape {list(raw.shape)}")
    if raw.dtype.kind not in "iu":
        raise EplbError(f"{path}: step_offsets must be integers (token positions), got dtype {raw.dtype}")
    offsets = raw.astype(np.int64)
    if offsets[0] != 0:
        raise EplbError(f"{path}: step_offsets must start at 0, got {int(offsets[0])}")
    bad = np.flatnonzero(np.diff(offsets) < 0)
    if bad.size:
        i = int(bad[0])
        raise EplbError(
            f"{path}: step_offsets go backwards at step {i + 1}: token {int(offsets[i + 1])} after "
            f"{int(offsets[i])}; steps out of order"
        )
    if offsets[-1] != tokens:
        end = int(np.searchsorted(offsets, tokens, side="right"))
        hint = f"; truncated: tokens end inside step {end - 1}" if offsets[-1] > tokens else ""
        raise EplbError(f"{path}: step_offsets end at token {int(offsets[-1])}, topk_ids has "
                        f"{plural(tokens, 'token')}{hint}")
    return offsets


def topk_counts(topk_ids: ArrayLike, step_offsets: ArrayLike, num_experts: int) -> NDArray[np.int64]:
    """Per-step counts [steps, layers, E] from token-level routing.

    topk_ids: [tokens, layers, k] expert ids in 0..E-1; step_offsets: [steps + 1], step i is tokens
    step_offsets[i]:step_offsets[i+1] (offsets start at 0 and end at the token count).
    """
    ids = np.asarray(topk_ids)
    offsets = np.asarray(step_offsets, dtype=np.int64)
    tokens, layers, _ = ids.shape
    steps = offsets.size - 1
    fast = _compiled_counts(ids, offsets, num_experts)
    if fast is not None:
        return fast
    step_of_token = np.repeat(np.arange(steps, dtype=np.int64), np.diff(offsets))
    if step_of_token.size != tokens:
        raise EplbError(f"step_offsets cover {plural(step_of_token.size, 'token')}, topk_ids has {tokens:,}")
    row = (step_of_token[:, None] * layers + np.arange(layers, dtype=np.int64)[None, :]) * num_experts  # [T, L]
    flat = (row[:, :, None] + ids.astype(np.int64)).ravel()
    counts = np.bincount(flat, minlength=steps * layers * num_experts)
    return counts.reshape(steps, layers, num_experts)


def _compiled_counts(
    ids: NDArray[Any], offsets: NDArray[np.int64] | None, num_experts: int
) -> NDArray[np.int64] | None:
    """`topk_counts` of ids [tokens, layers, k] in one compiled pass (eplb/_reach.c; offsets None: only its
    checks, an empty [0, layers, E] array); None when the ids are not int16, int32 or int64, the offsets do not
    rise from 0 to the tokens, or an id is outside 0..E-1 or named twice by a token in a layer (the numpy code
    then counts, or names the pick)."""
    from eplb import _reach

    tokens, layers, k = ids.shape
    span = np.array([0, tokens], dtype=np.int64) if offsets is None else np.ascontiguousarray(offsets)
    if ids.dtype not in (np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)) or k < 1 or span.ndim != 1:
        return None
    if span.size < 1 or span[0] != 0 or span[-1] != tokens or (np.diff(span) < 0).any():
        return None
    out = np.zeros((0 if offsets is None else span.size - 1, layers, num_experts), dtype=np.int64)
    done = _reach.counts(np.ascontiguousarray(ids), tokens, layers, k, span, span.size - 1, num_experts,
                         None if offsets is None else out)  # fmt: skip
    return out if done else None


def coactivation(topk_ids: ArrayLike, num_experts: int) -> NDArray[np.int64]:
    """Expert co-activation [layers, E, E] of token-level routing topk_ids [tokens, layers, k]:
    entry (l, i, j), i != j, counts the tokens whose top-k in layer l holds both i and j (symmetric);
    the diagonal (l, i, i) counts the tokens that chose i (its load)."""
    ids = np.asarray(topk_ids).astype(np.int64)
    _, layers, k = ids.shape
    size = num_experts * num_experts
    base = (np.arange(layers, dtype=np.int64) * size)[None, :]
    out = np.zeros(layers * size, dtype=np.int64)
    for a in range(k):
        out += np.bincount((base + ids[:, :, a] * (num_experts + 1)).ravel(), minlength=layers * size)
        for b in range(a + 1, k):
            lo = np.minimum(ids[:, :, a], ids[:, :, b])
            hi = np.maximum(ids[:, :, a], ids[:, :, b])
            out += np.bincount((base + lo * num_experts + hi).ravel(), minlength=layers * size)
    mat = out.reshape(layers, num_experts, num_experts)
    upper = np.triu(mat, 1)
    sym: NDArray[np.int64] = upper + upper.transpose(0, 2, 1)
    idx = np.arange(num_experts)
    sym[:, idx, idx] = mat[:, idx, idx]
    return sym


# --------------------------------------------------------------------------------------------
# JSONL: one record per step and layer
# --------------------------------------------------------------------------------------------


class _Jsonl(RoutingLog):
    def __init__(self, path: Path) -> None:
        self._path = path
        header: dict[str, Any] = {}
        has_header = False
        first: dict[str, Any] | None = None
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = _parse_line(line, lineno, str(path))
                if "step" not in rec and first is None and not has_header:
                    header, has_header = rec, True
                    continue
                first = rec
                break
        if first is None:
            raise EplbError(f'{path}: no step records (expected lines like {{"step": 0, "layer": 0, "counts": [...]}})')
        check_format(header, FORMAT_JSONL, str(path))
        num_experts = _meta_int(header, "num_experts", str(path))
        counts = first.get("counts")
        if not isinstance(counts, list) or not counts:
            raise EplbError(f"{path}: the first record has no 'counts' list")
        if num_experts is not None and num_experts != len(counts):
            raise EplbError(f"{path}: the header says {plural(num_experts, 'expert')}, the first record has "
                            f"{plural(len(counts), 'count')}")
        self._header = header
        self._layers = self._first_step_layers()
        num_steps = _meta_int(header, "num_steps", str(path))
        self._step_limit: int | None = None
        if num_steps is None:  # count: a progress bar's total; a file still growing is read up to it
            records = _nonblank_lines(path) - has_header
            num_steps = self._step_limit = -(-records // len(self._layers))
            self.steps_counted = True
        layer_ids = _layer_ids(header, len(self._layers), str(path)) if "layer_ids" in header else None
        if layer_ids is None and self._layers != list(range(len(self._layers))):
            layer_ids = list(self._layers)
        self.info = LogInfo(
            path=str(path),
            kind="jsonl",
            num_steps=num_steps,
            num_layers=len(self._layers),
            num_experts=len(counts),
            top_k=_meta_int(header, "top_k", str(path)),
            model=None if header.get("model") is None else str(header["model"]),
            layer_ids=layer_ids,
            meta=header,
        )

    def _first_step_layers(self) -> list[int]:
        """The layers of the first step, sorted: every step must have exactly these."""
        seen: dict[int, int] = {}
        step: int | None = None
        for lineno, rec in self._records():
            s, layer = _step_layer(rec, lineno, str(self._path))
            if step is None:
                step = s
            if s != step:
                break
            if layer in seen:
                raise EplbError(
                    f"{self._path}: line {lineno}: step {s} has layer {layer} twice (first on line {seen[layer]})"
                )
            seen[layer] = lineno
        return sorted(seen)

    def _records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(line number, record) of every step record; the header (if any) is skipped."""
        first = True
        with self._path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = _parse_line(line, lineno, str(self._path))
                if first and "step" not in rec:
                    first = False
                    continue
                first = False
                yield lineno, rec

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        path = str(self._path)
        layers = self._layers
        row_of = {layer: i for i, layer in enumerate(layers)}
        num_layers, num_experts = len(layers), self.info.num_experts
        buf = np.zeros((chunk_steps, num_layers, num_experts), dtype=np.int64)
        step_ids: list[int] = []
        seen: dict[int, int] = {}
        current: int | None = None
        first_line = 0
        last_line = 0

        def finish() -> None:
            if len(seen) != num_layers:
                missing = [layer for layer in layers if layer not in seen]
                raise EplbError(
                    f"{path}: step {current} (lines {first_line}-{last_line}) is missing "
                    f"{plural(len(missing), 'layer')}: {', '.join(map(str, missing[:8]))}"
                    f"{' ...' if len(missing) > 8 else ''}"
                    + ("; the file may be truncated" if last_line == self._last_line() else "")
                )

        started = 0
        for lineno, rec in self._records():
            step, layer = _step_layer(rec, lineno, path)
            if step != current:
                if started == self._step_limit:
                    break  # the steps counted when opened; a live file may have grown since
                started += 1
                if current is not None:
                    if step < current:
                        raise EplbError(
                            f"{path}: line {lineno}: step {step} comes after step {current}; steps out of order "
                            "(records of one step must be together, steps increasing)"
                        )
                    finish()
                    if len(step_ids) == chunk_steps:
                        yield np.asarray(step_ids, dtype=np.int64), buf.copy()
                        step_ids = []
                current, first_line = step, lineno
                seen = {}
                step_ids.append(step)
                buf[len(step_ids) - 1] = 0
            if layer in seen:
                raise EplbError(
                    f"{path}: line {lineno}: step {step} has layer {layer} twice (first on line {seen[layer]})"
                )
            if layer not in row_of:
                raise EplbError(
                    f"{path}: line {lineno}: step {step} has layer {layer}, which the first step does not have "
                    f"(layers {layers[0]}..{layers[-1]})"
                )
            seen[layer] = lineno
            last_line = lineno
            buf[len(step_ids) - 1, row_of[layer]] = _counts_of(rec, lineno, num_experts, path)
        if current is not None:
            finish()
            yield np.asarray(step_ids, dtype=np.int64), buf[: len(step_ids)].copy()

    def _last_line(self) -> int:
        last = 0
        with self._path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    last = lineno
        return last


def _nonblank_lines(path: Path) -> int:
    """Lines of a text file that hold more than whitespace (a pass at line speed, no JSON parsing)."""
    with path.open("rb") as f:
        return sum(1 for line in f if not line.isspace())


def _parse_line(line: bytes, lineno: int, path: str) -> dict[str, Any]:
    try:
        rec = parse_json(line, f"{path}: line {lineno}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        end = "" if line.endswith(b"\n") else " (the line has no newline: the file may be truncated)"
        raise EplbError(f"{path}: line {lineno}: not valid JSON ({exc}){end}") from None
    if not isinstance(rec, dict):
        raise EplbError(f"{path}: line {lineno}: expected an object {{\"step\", \"layer\", \"counts\"}}")
    refuse_bools(rec, line, f"{path}: line {lineno}: ")
    return rec


def _step_layer(rec: dict[str, Any], lineno: int, path: str) -> tuple[int, int]:
    for key in ("step", "layer"):
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ID:
            raise EplbError(f"{path}: line {lineno}: '{key}' must be an integer 0 .. 2**63 - 1, got {v!r}")
    return int(rec["step"]), int(rec["layer"])


def _counts_of(rec: dict[str, Any], lineno: int, num_experts: int, path: str) -> NDArray[np.int64]:
    raw = rec.get("counts")
    if not isinstance(raw, list) or len(raw) != num_experts:
        got = plural(len(raw), "value") if isinstance(raw, list) else repr(raw)[:40]
        raise EplbError(f"{path}: line {lineno}: 'counts' must list {plural(num_experts, 'number')}, got {got}")
    arr = real_array(raw, f"{path}: line {lineno}: counts", f"{path}: line {lineno}: 'counts' must hold numbers")
    found = count_problem(arr)
    if found is not None:
        (e,), why = found
        raise EplbError(f"{path}: line {lineno}: step {rec['step']}, layer {rec['layer']}, expert {e}: {why}")
    return arr.astype(np.int64)


# --------------------------------------------------------------------------------------------
# Opening and writing
# --------------------------------------------------------------------------------------------


LOG_SUFFIXES: dict[str, tuple[str, ...]] = {
    "npz": (".npz",),
    "npy": (".npy",),
    "jsonl": (".jsonl", ".ndjson"),
    "parquet": (".parquet",),
}
"""The names each routing-log format's files end with, the one table: readers tell a log's format by its name
(`open_log`; a directory is Parquet shards whatever its name), writers pick theirs by it (`write_log`, `eplb logs
convert`)."""


def log_format(path: str | Path) -> str | None:
    """The format (a key of LOG_SUFFIXES) that path's name ends in, case aside; None when none."""
    suffix = Path(path).suffix.lower()
    return next((fmt for fmt, names in LOG_SUFFIXES.items() if suffix in names), None)


def open_log(path: str | Path) -> RoutingLog:
    """Open a routing log by its extension (LOG_SUFFIXES): `.npz` (per-step counts, or token-level `topk_ids`),
    `.npy` (`[steps, layers, E]`), `.jsonl`, `.parquet` or a directory of Parquet shards
    (`eplb.io.parquet`). Reads metadata only; iterate with `iter_counts`."""
    p = usable_path(path, "routing log")
    fmt = log_format(p)
    if fmt == "parquet" or p.is_dir():
        from eplb.io.parquet import open_parquet

        return open_parquet(p)
    existing_file(p, "routing log")
    if fmt == "npz":
        with _open_zip(p) as zf:
            names = zf.namelist()
        refuse_mixed_arrays((n.removesuffix(".npy") for n in names), p)
        if _TOPK + ".npy" in names:
            return _TopkNpz(p)
        if _COUNTS + ".npy" in names:
            return _NpzCounts(p)
        found = sorted(n.removesuffix(".npy") for n in names)
        window = " (a 'loads' array is a load window: use it with eplb solve --loads)" if "loads" in found else ""
        raise EplbError(f"{p}: expected 'counts' ([steps, layers, E]) or 'topk_ids' ([tokens, layers, k]), "
                        f"found {found}{window}")
    if fmt == "npy":
        return _NpyCounts(p)
    if fmt == "jsonl":
        return _Jsonl(p)
    raise EplbError(f"{p}: unknown routing log type '{p.suffix.lower()}' (use .npz, .npy, .jsonl or a Parquet "
                    "directory)")


def read_counts(path: str | Path) -> tuple[NDArray[Any], LogInfo]:
    """A whole (small) log as counts [steps, layers, E] and its info."""
    log = open_log(path)
    return log.read_counts().counts, log.info


def as_log(
    source: RoutingLog | str | Path | NDArray[Any] | Iterable[NDArray[Any]],
    *,
    num_steps: int | None = None,
    top_k: int | None = None,
    model: str | None = None,
) -> RoutingLog:
    """A RoutingLog from a log, a path, a [steps, layers, E] array or an iterable of such chunks."""
    if isinstance(source, RoutingLog):
        return source
    if isinstance(source, str | Path):
        return open_log(source)
    return _ArrayLog(source, num_steps=num_steps, top_k=top_k, model=model)


def count_dtype(max_count: float) -> np.dtype[Any]:
    """The integer type a log's counts of at most `max_count` are stored as, by every writer (the one rule): the
    narrowest of uint16, uint32 and int64 that holds them (int64 holds MAX_LOAD). uint16 is the floor (the format's
    documented type; narrower would overflow sooner where callers add counts in their own type)."""
    for dt in (np.uint16, np.uint32):
        if max_count <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def check_fits(counts: NDArray[Any], dtype: np.dtype[Any], first: int) -> None:
    """EplbError when counts [n, layers, E] of the steps at positions first.. do not fit the type `dtype` a writer
    stores them as: < 0 or above its largest, or, for an integer type, not whole numbers."""
    if dtype.kind in "iu" and counts.dtype.kind == "f":
        refuse_counts(counts, first)
    limit = np.iinfo(dtype).max if dtype.kind in "iu" else math.inf
    if counts.size and (counts.min() < 0 or counts.max() > limit):
        raise EplbError(f"counts in steps {first}..{first + counts.shape[0] - 1} do not fit {dtype} (or are < 0)")


def refuse_counts(counts: NDArray[Any], first: int) -> None:
    """EplbError naming the first entry of counts [n, layers, E] (steps at positions first..) that `count_problem`
    refuses: a writer never writes a log its readers refuse."""
    wrong = count_type_refusal(counts.dtype)
    if wrong is not None:
        raise EplbError(f"counts: {wrong}")
    found = count_problem(counts)
    if found is not None:
        (step, layer, e), why = found
        raise EplbError(f"counts: step position {first + step}, layer {layer}, expert {e}: {why}")


def counts_to_write(
    counts: RoutingLog | ArrayLike | Iterable[Any], dtype: Any, pick: bool = True
) -> tuple[Iterable[Any], np.dtype[Any] | None, int | None]:
    """What a log writer streams, from what it was given: (chunks, arrays [n, layers, E] or CountsChunks; the type
    to store them as; the number of steps when known). An array (checked: [steps, layers, E] token counts) is one
    chunk, a RoutingLog its `iter_counts`, anything else is taken as chunks. The type is `dtype` when given, else,
    when `pick`, `count_dtype` of an array's or a log's largest count (a log whose file's type is at most 16 bits
    is uint16 unread; another is read once, into a spool that keeps its largest count: `_spooled`), else None
    (other chunks: the writer's default)."""
    chosen = None if dtype is None else np.dtype(dtype)
    if isinstance(counts, RoutingLog):
        stored = counts.stored_dtype
        if chosen is None and pick and stored is not None and stored.kind in "iu" and stored.itemsize <= 2:
            chosen = count_dtype(0)  # no count above uint16's limit: no need to read them
        elif chosen is None and pick:
            chunks, chosen = _spooled(counts)
            return chunks, chosen, counts.info.num_steps
        return counts.iter_counts(1024), chosen, counts.info.num_steps
    if isinstance(counts, np.ndarray | list | tuple):
        arr = np.asarray(counts)
        if arr.ndim != 3:
            raise EplbError(f"counts must be [steps, layers, experts], got shape {list(arr.shape)}")
        if chosen is None:
            refuse_counts(arr, 0)
            if pick:
                chosen = count_dtype(int(arr.max()) if arr.size else 0)
        return [arr], chosen, int(arr.shape[0])
    return cast(Iterable[Any], counts), chosen, None


def _spooled(log: RoutingLog) -> tuple[Iterator[CountsChunk], np.dtype[Any]]:
    """A log whose largest count its file's type does not tell (JSONL, token-level, uint32, int64, ...), read once:
    its chunks go to a temporary file at the file's integer type (int64 for the others) while the largest count is
    kept, and come back as CountsChunks (the file closed, and gone, once they are read). Returns (those chunks,
    `count_dtype` of the largest count): a writer names the stored type before the counts, and reading the log a
    second time for it (JSONL's parsing, token-level counting) cost as much as the conversion."""
    stored = log.stored_dtype
    wide = stored if stored is not None and stored.kind in "iu" else np.dtype(np.int64)
    tail = (log.info.num_layers, log.info.num_experts)
    spool = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _unspool, or here on failure)
    ids: list[NDArray[np.int64]] = []
    top = 0
    try:
        for chunk in log.iter_counts(1024):
            if chunk.counts.size:
                top = max(top, int(chunk.counts.max()))
            spool.write(np.ascontiguousarray(chunk.counts, dtype=wide).tobytes())
            ids.append(chunk.steps)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return _unspool(spool, ids, tail, wide), count_dtype(top)


def _unspool(
    spool: IO[bytes], ids: list[NDArray[np.int64]], tail: tuple[int, int], dtype: np.dtype[Any]
) -> Iterator[CountsChunk]:
    """The CountsChunks `_spooled` wrote: step ids `ids` per chunk, counts [n, *tail] of `dtype`; closes `spool`."""
    try:
        start, step_bytes = 0, tail[0] * tail[1] * dtype.itemsize
        for steps in ids:
            raw = _read_exact(spool, steps.size * step_bytes)
            yield CountsChunk(start, steps, np.frombuffer(raw, dtype=dtype).reshape(steps.size, *tail))
            start += steps.size
    finally:
        spool.close()


def output_log(path: str | Path, what: str = "log file") -> Path:
    """The path of a log file to write, its directory created; EplbError, before any work, when it is a
    directory, a path the system will not look up (`usable_path`, naming `what`) or its directory cannot be made
    (e.g. a file of that name is in the way)."""
    p = usable_path(path, what)
    if p.is_dir():
        raise EplbError(f"{p} is a directory; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EplbError(f"cannot write {p}: cannot create its directory {p.parent} ({exc.strerror or exc})") from None
    return p


def _atomic_target(path: Path) -> Path:
    """NAME.part, the file a writer writes `path` through (`output_log` checked)."""
    return output_log(path).with_name(path.name + ".part")


def _write_error(path: Path, exc: OSError) -> EplbError:
    """An OSError while writing `path` (through NAME.part: an unwritable directory, a full disk) as one line."""
    return EplbError(f"cannot write {path}: {exc.strerror or exc}")


def write_counts(
    path: str | Path,
    counts: RoutingLog | ArrayLike | Iterable[NDArray[Any] | CountsChunk],
    *,
    model: str | None = None,
    top_k: int | None = None,
    steps: ArrayLike | None = None,
    layer_ids: ArrayLike | None = None,
    num_steps: int | None = None,
    dtype: Any = None,
    compress: bool = False,
) -> None:
    """Write per-step counts `.npz` (eplb.counts/v1), streaming.

    counts: [steps, layers, E] array, a RoutingLog (read once: through a temporary file that learns its largest
    count on the way, unless its file's type tells), or an iterable of [n, layers, E] chunks or CountsChunks (give
    num_steps when known; otherwise the chunks are spooled to a temporary file first). The step ids of a RoutingLog
    or CountsChunks are kept unless `steps` is given (stored when they are not 0, 1, ...). dtype: stored integer
    type (default: `count_dtype` of the largest count of an array or RoutingLog, uint16 when it fits; uint32 for
    other chunks, whose largest count is not known before they are written: give it, e.g. `count_dtype(bound)`).
    compress: deflate the members (level 1): about 1.5x smaller for synthetic counts, and about
    6x slower to read (zlib), so off by default, as with np.savez.
    The file appears under its name only when complete (written to NAME.part, then renamed).
    """
    p = Path(path)
    tmp = _atomic_target(p)  # a path it cannot write is refused before the counts are read
    chunks, chosen, known = counts_to_write(counts, dtype)
    num_steps = known if known is not None else num_steps
    out_dtype = np.dtype(np.uint32) if chosen is None else chosen
    seen: list[NDArray[np.int64]] = []  # step ids of CountsChunks
    chunks = _counts_only(chunks, seen)
    spool: IO[bytes] | None = None
    try:
        with zipfile.ZipFile(
            tmp, "w", compression=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED, compresslevel=1
        ) as zf:
            shape_tail: tuple[int, ...] | None = None
            if num_steps is None:
                spool = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
                written, shape_tail = _write_chunks(spool, chunks, out_dtype, None)
                spool.seek(0)
                with zf.open(_COUNTS + ".npy", "w", force_zip64=True) as f:
                    _write_npy_header(f, (written, *shape_tail), out_dtype)
                    while block := spool.read(1 << 24):
                        f.write(block)
                num_steps = written
            else:
                it = iter(chunks)
                head = next(it, None)
                if head is None:
                    raise EplbError("no counts to write")
                first = np.asarray(head)
                if first.ndim != 3:
                    raise EplbError(f"counts chunks must be [steps, layers, experts], got shape {list(first.shape)}")
                shape_tail = first.shape[1:]
                with zf.open(_COUNTS + ".npy", "w", force_zip64=True) as f:
                    _write_npy_header(f, (num_steps, *shape_tail), out_dtype)
                    written, _ = _write_chunks(f, _prepend(first, it), out_dtype, shape_tail)
                if written != num_steps:
                    raise EplbError(f"write_counts: num_steps is {num_steps} but the chunks hold "
                                    f"{plural(written, 'step')}")
            assert shape_tail is not None
            if steps is None and seen:
                steps = _kept_ids(seen)
            _write_meta(zf, FORMAT_COUNTS, model, shape_tail[1], top_k, steps, layer_ids, num_steps, shape_tail[0])
        os.replace(tmp, p)
    except OSError as exc:
        raise _write_error(p, exc) from None
    finally:
        if spool is not None:
            spool.close()
        if tmp.exists():
            tmp.unlink()


def _counts_only(chunks: Iterable[Any], seen: list[NDArray[np.int64]]) -> Iterator[NDArray[Any]]:
    """The counts of a stream of arrays or CountsChunks; the step ids of CountsChunks appended to `seen`."""
    for chunk in chunks:
        if isinstance(chunk, CountsChunk):
            seen.append(chunk.steps)
            yield chunk.counts
        else:
            yield chunk


def _kept_ids(seen: list[NDArray[np.int64]]) -> NDArray[np.int64] | None:
    """The step ids of a log's CountsChunks, or None when they are 0, 1, ... (the readers' default)."""
    ids = np.concatenate(seen)
    return None if np.array_equal(ids, np.arange(ids.size)) else ids


def _write_chunks(
    f: IO[bytes], chunks: Iterable[NDArray[Any]], dtype: np.dtype[Any], shape_tail: tuple[int, ...] | None
) -> tuple[int, tuple[int, ...]]:
    written = 0
    for index, chunk in enumerate(chunks):
        block = np.asarray(chunk)
        why = chunk_mismatch(index, written, block.shape, shape_tail)
        if why is not None:
            raise EplbError(why)
        shape_tail = shape_tail or block.shape[1:]
        check_fits(block, dtype, written)
        f.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
        written += block.shape[0]
    if shape_tail is None:
        raise EplbError("no counts to write")
    return written, shape_tail


def _write_meta(
    zf: zipfile.ZipFile,
    fmt: str,
    model: str | None,
    num_experts: int,
    top_k: int | None,
    steps: ArrayLike | None,
    layer_ids: ArrayLike | None,
    num_steps: int,
    num_layers: int,
) -> None:
    _write_member(zf, "format", fmt)
    _write_member(zf, "num_experts", np.int64(num_experts))
    if model is not None:
        _write_member(zf, "model", str(model))
    if top_k is not None:
        _write_member(zf, "top_k", np.int64(top_k))
    if steps is not None:
        ids = np.asarray(steps, dtype=np.int64).reshape(-1)
        if ids.size != num_steps:
            raise EplbError(f"steps lists {plural(ids.size, 'id')} for {plural(num_steps, 'step')}")
        bad = np.flatnonzero(np.diff(ids) <= 0)
        if bad.size:
            raise EplbError(f"step ids must increase: {int(ids[bad[0] + 1])} follows {int(ids[bad[0]])}")
        _write_member(zf, "steps", ids)
    if layer_ids is not None:
        lids = np.asarray(written_layer_ids(layer_ids, num_layers), dtype=np.int64)
        _write_member(zf, "layer_ids", lids)


def write_topk(
    path: str | Path,
    topk_ids: ArrayLike,
    step_offsets: ArrayLike,
    *,
    num_experts: int,
    model: str | None = None,
    steps: ArrayLike | None = None,
    layer_ids: ArrayLike | None = None,
    compress: bool = False,
) -> None:
    """Write a token-level routing log `.npz` (eplb.topk/v1): topk_ids [tokens, layers, k] stored as
    int16 (ids must be < 32768) and step_offsets [steps + 1] (start 0, non-decreasing, end = tokens)."""
    p = Path(path)
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise EplbError(f"topk_ids must be [tokens, layers, k], got shape {list(ids.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise EplbError(f"topk_ids must be expert ids in 0..{num_experts - 1}")
    if num_experts > np.iinfo(np.int16).max + 1:
        raise EplbError(f"{num_experts} experts do not fit int16 expert ids")
    offsets = _check_offsets(np.asarray(step_offsets), ids.shape[0], "step_offsets")
    tmp = _atomic_target(p)
    try:
        with zipfile.ZipFile(
            tmp, "w", compression=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED, compresslevel=1
        ) as zf:
            with zf.open(_TOPK + ".npy", "w", force_zip64=True) as f:
                _write_npy_header(f, ids.shape, np.dtype(np.int16))
                for a in range(0, ids.shape[0], 1 << 16):
                    f.write(np.ascontiguousarray(ids[a : a + (1 << 16)], dtype=np.int16).tobytes())
            _write_member(zf, _OFFSETS, offsets)
            _write_meta(
                zf, FORMAT_TOPK, model, num_experts, ids.shape[2], steps, layer_ids, offsets.size - 1, ids.shape[1]
            )
        os.replace(tmp, p)
    except OSError as exc:
        raise _write_error(p, exc) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_jsonl(
    path: str | Path,
    counts: RoutingLog | ArrayLike | Iterable[NDArray[Any] | CountsChunk],
    *,
    model: str | None = None,
    top_k: int | None = None,
    steps: ArrayLike | None = None,
    layer_ids: ArrayLike | None = None,
    num_steps: int | None = None,
    header: bool = True,
) -> None:
    """Write JSONL counts: a header line (format, model, num_experts, top_k, num_layers, num_steps
    when known, layer_ids) unless header=False, then `{"step", "layer", "counts"}` per step and layer.
    `layer` is the model layer id when layer_ids is given, else the index 0..L-1. counts: as `write_counts`
    takes them (the step ids of a RoutingLog or CountsChunks are kept unless `steps` is given); every count is
    checked (`count_problem`) and written as an integer."""
    p = Path(path)
    chunks, _, known = counts_to_write(counts, None, pick=False)
    num_steps = known if known is not None else num_steps
    step_ids = None if steps is None else np.asarray(steps, dtype=np.int64).reshape(-1)
    if step_ids is not None and step_ids.size > 1 and np.any(np.diff(step_ids) <= 0):
        raise EplbError("step ids must increase")
    if step_ids is not None and num_steps is not None and step_ids.size != num_steps:
        raise EplbError(f"steps lists {plural(step_ids.size, 'id')} for {plural(num_steps, 'step')}")
    lids: list[int] | None = None if layer_ids is None else np.asarray(layer_ids).reshape(-1).tolist()
    tmp = _atomic_target(p)
    try:
        with tmp.open("w") as f:
            pos = 0
            wrote_header = not header
            for chunk in chunks:
                ids = chunk.steps if isinstance(chunk, CountsChunk) else None
                block = np.asarray(chunk.counts if isinstance(chunk, CountsChunk) else chunk)
                if block.ndim != 3:
                    raise EplbError(f"counts chunks must be [steps, layers, experts], got shape {list(block.shape)}")
                refuse_counts(block, pos)
                if lids is not None:
                    lids = written_layer_ids(lids, block.shape[1])
                if step_ids is not None and pos + block.shape[0] > step_ids.size:
                    raise EplbError(f"steps lists {plural(step_ids.size, 'id')} for more steps")
                if not wrote_header:
                    head: dict[str, Any] = {"format": FORMAT_JSONL, "num_experts": int(block.shape[2])}
                    if model is not None:
                        head["model"] = model
                    if top_k is not None:
                        head["top_k"] = int(top_k)
                    head["num_layers"] = int(block.shape[1])
                    if num_steps is not None:
                        head["num_steps"] = int(num_steps)
                    if lids is not None:
                        head["layer_ids"] = lids
                    f.write(json.dumps(head) + "\n")
                    wrote_header = True
                values = block.astype(np.int64, copy=False).tolist()
                lines = []
                for i, step_rows in enumerate(values):
                    step = int(step_ids[pos + i] if step_ids is not None else ids[i] if ids is not None else pos + i)
                    for j, row in enumerate(step_rows):
                        layer = lids[j] if lids is not None else j
                        lines.append(f'{{"step": {step}, "layer": {layer}, "counts": {json.dumps(row)}}}\n')
                f.write("".join(lines))
                pos += block.shape[0]
            if pos == 0:  # a JSONL log without a step record is no log (no record gives the layers)
                raise EplbError("no steps to write")
            if step_ids is not None and step_ids.size != pos:
                raise EplbError(f"steps lists {plural(step_ids.size, 'id')} for {plural(pos, 'step')}")
        os.replace(tmp, p)
    except OSError as exc:
        raise _write_error(p, exc) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def refuse_compress(compress: bool, fmt: str, what: str, option: str = "compress=True") -> None:
    """Compression deflates an .npz log's members, nothing else: EplbError when it is asked for output format `fmt`
    (npz, jsonl or parquet), rather than a silent no-op. what: the output as the message names it (a path, '--out
    log.jsonl'); option: how the request is spelled (the CLI's: --compress)."""
    if not compress or fmt == "npz":
        return
    why = (f"is JSONL, written as plain text: drop {option}, or name it .npz" if fmt == "jsonl" else
           f"is Parquet, whose shards are always compressed (zstd): drop {option}")  # fmt: skip
    raise EplbError(f"{option} deflates an .npz log's members; {what} {why}")


def write_log(path: str | Path, counts: ArrayLike | Iterable[NDArray[Any]], **kwargs: Any) -> None:
    """Write per-step counts by extension (LOG_SUFFIXES): `.npz` (write_counts) or `.jsonl` (write_jsonl;
    compress=True is refused, `refuse_compress`)."""
    fmt = log_format(path)
    if fmt == "npz":
        write_counts(path, counts, **kwargs)
    elif fmt == "jsonl":
        refuse_compress(bool(kwargs.pop("compress", False)), "jsonl", str(path))
        kwargs.pop("dtype", None)
        write_jsonl(path, counts, **kwargs)
    else:
        raise EplbError(f"{path}: unknown routing log type '{Path(path).suffix.lower()}' (use .npz or .jsonl)")
