"""Routing logs as a directory of Parquet shards (`eplb.counts-parquet/v1`), for logs too long for one file.

Layout (docs/formats.md, "Parquet"): `LOG/part-00000.parquet`, `part-00001.parquet`, ... each holding
consecutive steps (a time range; `shard_steps` steps each, the last one shorter); one shard opened by itself
is a log of its own steps (its positions from 0, its step ids kept). A shard has one row
per step: `step` (int64 step id) and one column per MoE layer, `layer_0` .. `layer_{L-1}`, each a
fixed-size list of E counts (the log's integer type). Every shard's schema metadata carries, under the
key `eplb`, JSON with the format, `num_experts`, `num_layers`, `model`, `top_k`, `layer_ids`, and the
shard's own `start` (position of its first step in the whole log), so a missing shard is named, and `steps`:
the log's step count in its last shard, null in the others, so missing last shards are named too (a log written
before `steps` existed reads without that check).

A reader reads only its part: `open_parquet(path, layers=range(a, b))` reads only those layers'
columns, `positions=range(s, t)` only the shards and row groups holding those steps. Needs pyarrow
(`pip install 'eplb[parquet]'`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError, shown, single_spaced
from eplb.io.files import parse_json
from eplb.io.logs import CountsChunk, LogInfo, RoutingLog, _meta_int, check_fits, counts_to_write, written_layer_ids
from eplb.io.windows import window_layer_ids

__all__ = ["FORMAT_PARQUET", "ParquetLog", "is_parquet", "open_parquet", "write_parquet"]

FORMAT_PARQUET = "eplb.counts-parquet/v1"
SHARD_STEPS = 10_000
"""Steps per shard by default (DeepSeek-V3 sized, uint16: about 300 MB before compression)."""
ROW_GROUP_STEPS = 1_024
"""Steps per row group: the unit a reader skips or reads."""
_META_KEY = b"eplb"


def _arrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or a one-line error saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise EplbError("Parquet routing logs need pyarrow: pip install 'eplb[parquet]'") from None
    return pyarrow, pyarrow.parquet


def is_parquet(path: str | Path) -> bool:
    """True for a `.parquet` file or a directory (a directory of shards)."""
    p = Path(path)
    return p.suffix.lower() == ".parquet" or p.is_dir()


def _shard_files(p: Path) -> list[Path]:
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise EplbError(f"{p}: no such file or directory (a Parquet routing log is a directory of part-*.parquet)")
    files = sorted(p.glob("part-*.parquet"))
    if not files:
        raise EplbError(f"{p}: no part-*.parquet shards in this directory")
    return files


class ParquetLog(RoutingLog):
    """A Parquet routing log, or the part of it a worker reads: `layers` (default all) and `positions`
    (default all steps; the view's positions restart at 0). Opening reads the shards' footers only."""

    def __init__(self, path: str | Path, layers: range | None = None, positions: range | None = None) -> None:
        _, pq = _arrow()
        self.path = Path(path)
        self.shards: list[tuple[Path, int, int]] = []  # (file, start position, steps)
        meta: dict[str, Any] | None = None
        total = 0
        alone = self.path.is_file()  # one shard given by itself: a log of its own steps, from position 0
        marked: int | None = None  # the step count the log's last shard records
        for f in _shard_files(self.path):
            try:
                md = pq.read_metadata(f)
            except (OSError, ValueError) as exc:
                raise EplbError(f"{f}: not a readable Parquet file ({single_spaced(exc)})") from None
            raw = (md.metadata or {}).get(_META_KEY)
            if raw is None:
                raise EplbError(f"{f}: not an eplb routing log shard (no 'eplb' metadata; write it with eplb logs "
                                "convert)")  # fmt: skip
            shard_meta = _shard_meta(raw, f)
            start = shard_meta.pop("start")
            has_end, steps = "steps" in shard_meta, shard_meta.pop("steps", None)
            if start != total and not alone:
                raise EplbError(f"{f}: starts at step position {start}, but the shards before it end at {total}: "
                                "a shard is missing or out of order")  # fmt: skip
            if marked is not None and not alone:
                raise EplbError(f"{self.shards[-1][0]}: the log's last shard (it records the log's {marked:,} "
                                f"steps), but {f.name} follows it: shards of another log?")  # fmt: skip
            schema = md.schema.to_arrow_schema().remove_metadata()
            if meta is None:
                meta, first_schema, first = shard_meta, schema, f
            elif shard_meta != meta:
                raise EplbError(f"{f}: its metadata differs from the first shard's (shards of different logs?)")
            elif not schema.equals(first_schema):
                change = _schema_change(first_schema, schema)
                raise EplbError(f"{f}: its columns differ from the first shard's ({change})")
            self.shards.append((f, total, int(md.num_rows)))
            total += int(md.num_rows)
            marked = steps
        assert meta is not None
        if meta.get("format") != FORMAT_PARQUET:
            raise EplbError(f"{self.path}: format {shown(meta.get('format'))}, expected {FORMAT_PARQUET}")
        sizes = {key: _meta_int(meta, key, str(self.path)) for key in ("num_layers", "num_experts")}
        for key, value in sizes.items():
            if value is None:
                raise EplbError(f"{self.path}: the shards' 'eplb' metadata has no {key} (write the log with eplb logs "
                                "convert)")  # fmt: skip
        num_layers, num_experts = int(sizes["num_layers"] or 0), int(sizes["num_experts"] or 0)
        self.stored_dtype = _check_columns(first_schema, num_layers, num_experts, first)
        self.layers = range(num_layers) if layers is None else layers
        self.positions = range(total) if positions is None else positions
        if not self.layers or self.layers.start < 0 or self.layers.stop > num_layers or self.layers.step != 1:
            raise EplbError(f"{self.path}: layers {self.layers.start}..{self.layers.stop - 1} are not among the "
                            f"log's 0..{num_layers - 1}")  # fmt: skip
        if self.positions.start < 0 or self.positions.stop > total or self.positions.step != 1:
            raise EplbError(f"{self.path}: step positions {self.positions.start}..{self.positions.stop - 1} are "
                            f"not in the log's 0..{total - 1}")  # fmt: skip
        ids = meta.get("layer_ids")
        checked = None if ids is None else window_layer_ids(ids, num_layers, str(self.path), "the shards have")
        self.info = LogInfo(
            path=str(self.path),
            kind="parquet",
            num_steps=len(self.positions),
            num_layers=len(self.layers),
            num_experts=num_experts,
            top_k=_meta_int(meta, "top_k", str(self.path)),
            model=None if meta.get("model") is None else str(meta["model"]),
            layer_ids=None if checked is None else [checked[i] for i in self.layers],
            meta=meta,
        )
        if has_end and not alone:  # written with the end mark (logs of earlier eplb versions have no `steps`)
            if marked is None:
                raise EplbError(f"{self.path}: its shards end with {self.shards[-1][0].name} at step position "
                                f"{total:,}, which is not the log's last shard (the last records the log's step "
                                "count): the shards after it are missing (a copy cut short?)")  # fmt: skip
            if marked != total:
                raise EplbError(f"{self.shards[-1][0]}: records the log's {marked:,} steps, but its shards hold "
                                f"{total:,}")  # fmt: skip

    def _chunks(self, chunk_steps: int) -> Iterator[tuple[NDArray[np.int64], NDArray[Any]]]:
        _, pq = _arrow()
        lo, hi = self.positions.start, self.positions.stop
        columns = ["step", *(f"layer_{i}" for i in self.layers)]
        experts = self.info.num_experts
        for f, start, steps in self.shards:
            if start + steps <= lo or start >= hi:
                continue
            try:
                pf = pq.ParquetFile(f)
                row = start
                for g in range(pf.num_row_groups):
                    n = pf.metadata.row_group(g).num_rows
                    a, b = max(lo, row), min(hi, row + n)
                    if a < b:
                        table = pf.read_row_group(g, columns=columns).slice(a - row, b - a)
                        step_ids = _column(table, "step", f, "its id").to_numpy().astype(np.int64)
                        counts = np.stack(
                            [_counts(table, c, experts, f) for c in columns[1:]], axis=1
                        )
                        for c in range(0, b - a, chunk_steps):
                            yield step_ids[c : c + chunk_steps], counts[c : c + chunk_steps]
                    row += n
            except (OSError, ValueError, KeyError) as exc:
                raise EplbError(f"{f}: unreadable Parquet data ({single_spaced(exc)})") from None


def _shard_meta(raw: bytes, f: Path) -> dict[str, Any]:
    """A shard's 'eplb' metadata: a JSON object read as every eplb JSON reader reads (`parse_json`: a key given twice
    is refused, not the last one kept), with `start`, the position of its first step, a whole number >= 0."""
    where = f"{f}: its 'eplb' metadata"
    try:
        meta = parse_json(raw, where)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EplbError(f"{where} is not JSON") from None
    if not isinstance(meta, dict):
        raise EplbError(f"{where} is not a JSON object (it holds {type(meta).__name__})")
    start = meta.get("start")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise EplbError(f"{where}: start (the position of the shard's first step) must be a whole number >= 0, got "
                        f"{shown(start)}")  # fmt: skip
    steps = meta.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise EplbError(f"{where}: steps (the log's step count, in its last shard; null in the others) must be a "
                        f"whole number >= 1 or null, got {shown(steps)}")  # fmt: skip
    return meta


def _schema_change(first: Any, other: Any) -> str:
    """The first column where shard schema `other` differs from `first` (Arrow schemas), in words: 'no column
    layer_3', 'layer_0: fixed_size_list<element: int64>[8], not fixed_size_list<element: uint16>[8]', 'extra columns
    x'."""
    for name in first.names:
        if name not in other.names:
            return f"no column {name}"
        if not other.field(name).type.equals(first.field(name).type):
            return f"{name}: {other.field(name).type}, not {first.field(name).type}"
    extra = [n for n in other.names if n not in first.names]
    return f"extra columns {', '.join(extra)}" if extra else "the columns' order"


def _check_columns(schema: Any, num_layers: int, num_experts: int, f: Path) -> np.dtype[Any]:
    """The numpy type of the counts of a shard of schema `schema` (an Arrow schema), after checking that it holds what
    its metadata says: an int64 `step` column and `layer_0` .. `layer_{L-1}`, each a fixed-size list of E numbers
    (integers, or floats whose values the count checks judge); EplbError naming the shard and column otherwise."""
    import pyarrow.types as types

    def column(name: str) -> Any:
        if name not in schema.names:
            raise EplbError(f"{f}: no column {name} (the metadata's num_layers is {num_layers}, num_experts "
                            f"{num_experts}: a shard holds step, layer_0 .. layer_{num_layers - 1})")  # fmt: skip
        return schema.field(name).type

    step = column("step")
    if not types.is_int64(step):
        raise EplbError(f"{f}: column step is {step}, expected int64 step ids")
    value: Any = None
    for i in range(num_layers):
        kind = column(f"layer_{i}")
        numbers = types.is_fixed_size_list(kind) and (types.is_integer(kind.value_type)
                                                      or types.is_floating(kind.value_type))  # fmt: skip
        if not numbers or kind.list_size != num_experts or (value is not None and kind.value_type != value):
            raise EplbError(f"{f}: column layer_{i} is {kind}, expected lists of {num_experts} counts (the "
                            f"metadata's num_experts), all of one number type")  # fmt: skip
        value = kind.value_type
    found: np.dtype[Any] = np.dtype(value.to_pandas_dtype())
    return found


def _column(table: Any, name: str, f: Path, what: str) -> Any:
    """Column `name` of `table` as one Arrow array; EplbError when it, or a list in it, holds a null (pyarrow reads a
    null int64 as -2**63), naming `what` every step needs."""
    arr = table.column(name).combine_chunks()
    if arr.null_count or (hasattr(arr, "flatten") and arr.flatten().null_count):
        raise EplbError(f"{f}: column {name} holds nulls; every step needs {what}")
    return arr


def _counts(table: Any, name: str, experts: int, f: Path) -> NDArray[Any]:
    """Column `name` of `table`, fixed-size lists of E counts in n rows -> [n, E] array."""
    arr = _column(table, name, f, "its counts")
    values: NDArray[Any] = arr.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(arr), experts)


def open_parquet(path: str | Path, layers: range | None = None, positions: range | None = None) -> ParquetLog:
    """Open a Parquet routing log (a directory of shards, or one `.parquet` shard: a log of that shard's steps,
    positions from 0), or part of it."""
    return ParquetLog(path, layers, positions)


def write_parquet(
    path: str | Path,
    chunks: RoutingLog | Iterable[CountsChunk] | NDArray[Any],
    *,
    model: str | None = None,
    top_k: int | None = None,
    layer_ids: list[int] | None = None,
    shard_steps: int = SHARD_STEPS,
    compression: str = "zstd",
    dtype: Any = None,
) -> int:
    """Write a routing log as a directory of Parquet shards; returns the steps written.

    chunks: a RoutingLog (e.g. `open_log(src)`), CountsChunks (step ids and counts [n, layers, E]), or a
    [steps, layers, E] array (step ids 0..steps-1). dtype: the counts' stored integer type (default, as
    `eplb.io.logs.write_counts`: `count_dtype` of an array's or a RoutingLog's largest count; uint32 for other
    chunks). shard_steps: steps per shard file. The directory appears under its name only when complete
    (written to NAME.part, then renamed); an existing one is refused."""
    pa, pq = _arrow()
    out = Path(path)
    if out.exists():
        raise EplbError(f"{out}: already exists; remove it or choose another name")
    if shard_steps < 1:
        raise EplbError(f"shard_steps must be >= 1, got {shard_steps}")
    blocks: Iterable[CountsChunk]
    if isinstance(chunks, RoutingLog | np.ndarray):  # the type from the counts (an array's are checked)
        streamed, chosen, _ = counts_to_write(chunks, dtype)
        arr = chunks if isinstance(chunks, np.ndarray) else None
        blocks = streamed if arr is None else [CountsChunk(0, np.arange(arr.shape[0], dtype=np.int64), arr)]
    else:
        blocks, chosen = chunks, None if dtype is None else np.dtype(dtype)
    out_dtype = np.dtype(np.uint32) if chosen is None else chosen
    tmp = out.with_name(out.name + ".part")
    try:
        _remove(tmp)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise EplbError(f"cannot write {out}: cannot create {tmp} ({exc.strerror or exc})") from None
    try:
        writer = _ShardWriter(pa, pq, tmp, shard_steps, compression, model, top_k, layer_ids, out_dtype)
        for chunk in blocks:
            writer.add(chunk.steps, np.asarray(chunk.counts))
        written = writer.close()
        if written == 0:
            raise EplbError("no steps to write")
        os.replace(tmp, out)
    except OSError as exc:  # a full disk, a directory that went away
        raise EplbError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        _remove(tmp)
    return written


def _remove(path: Path) -> None:
    """Remove a left-over NAME.part, a directory of shards or a file."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class _ShardWriter:
    """Rolls shards every `shard_steps` steps; each shard's row groups are ROW_GROUP_STEPS steps, the last one
    shorter, whatever the chunks the steps come in (they are gathered into whole row groups first: a chunk's own
    boundaries made groups of any size, [48, 952] in a 2,000-step shard)."""

    def __init__(
        self, pa: Any, pq: Any, folder: Path, shard_steps: int, compression: str, model: str | None,
        top_k: int | None, layer_ids: list[int] | None, dtype: np.dtype[Any],
    ) -> None:  # fmt: skip
        self.pa, self.pq, self.folder, self.shard_steps, self.compression = pa, pq, folder, shard_steps, compression
        self.dtype = dtype
        self.meta: dict[str, Any] = {"format": FORMAT_PARQUET, "model": model, "top_k": top_k, "layer_ids": layer_ids}
        self.writer: Any = None
        self.schema: Any = None
        self.in_shard = 0  # steps of the current shard, written or pending
        self.shard = 0
        self.shard_start = 0  # position of the current shard's first step
        self.written = 0  # steps in written row groups
        self.added = 0  # steps given to `add`
        self.pending: list[tuple[NDArray[np.int64], NDArray[Any]]] = []  # the next row group's steps so far
        self.pending_steps = 0
        self.shape: tuple[int, ...] | None = None

    def add(self, steps: NDArray[np.int64], counts: NDArray[Any]) -> None:
        if counts.ndim != 3:
            raise EplbError(f"counts chunks must be [steps, layers, experts], got shape {list(counts.shape)}")
        if self.shape is None:
            self.shape = counts.shape[1:]
            layers, experts = self.shape
            ids = self.meta["layer_ids"]
            if ids is not None:
                self.meta["layer_ids"] = written_layer_ids(ids, layers)
            self.meta.update(num_layers=int(layers), num_experts=int(experts))
            value = self.pa.from_numpy_dtype(self.dtype)
            self.schema = self.pa.schema(
                [("step", self.pa.int64()), *((f"layer_{i}", self.pa.list_(value, experts)) for i in range(layers))]
            )
        elif counts.shape[1:] != self.shape:
            raise EplbError(f"step {self.added} has shape {list(counts.shape[1:])}, earlier steps {list(self.shape)}")
        check_fits(counts, self.dtype, self.added)
        counts = counts.astype(self.dtype, copy=False)
        done = 0
        while done < counts.shape[0]:
            if self.writer is None or self.in_shard == self.shard_steps:
                self._roll()
            room = min(self.shard_steps - self.in_shard, ROW_GROUP_STEPS - self.pending_steps)
            n = min(counts.shape[0] - done, room)
            self.pending.append((np.asarray(steps[done : done + n], dtype=np.int64), counts[done : done + n]))
            self.pending_steps += n
            self.in_shard += n
            self.added += n
            done += n
            if self.pending_steps == ROW_GROUP_STEPS or self.in_shard == self.shard_steps:
                self._flush()

    def _roll(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.shard_start = self.written
        meta = json.dumps({**self.meta, "start": self.written, "steps": None}).encode()  # steps: set in the last
        schema = self.schema.with_metadata({_META_KEY: meta})
        name = self.folder / f"part-{self.shard:05d}.parquet"
        self.writer = self.pq.ParquetWriter(name, schema, compression=self.compression)
        self.schema_with_meta = schema
        self.shard += 1
        self.in_shard = 0

    def _flush(self) -> None:
        """Write the pending steps as one row group."""
        if not self.pending_steps:
            return
        pa = self.pa
        steps = np.concatenate([s for s, _ in self.pending])
        block = np.ascontiguousarray(np.concatenate([c for _, c in self.pending]))
        n, layers, experts = block.shape
        columns = [pa.array(steps)]
        for i in range(layers):
            flat = pa.array(block[:, i, :].reshape(-1), type=self.schema.field(f"layer_{i}").type.value_type)
            columns.append(pa.FixedSizeListArray.from_arrays(flat, experts))
        table = pa.Table.from_arrays(columns, schema=self.schema_with_meta)
        self.writer.write_table(table, row_group_size=ROW_GROUP_STEPS)
        self.written += n
        self.pending, self.pending_steps = [], 0

    def close(self) -> int:
        """Write what is pending and mark the last shard with the log's step count (`steps`: every other shard
        holds null, so a reader knows when the shards after one are missing)."""
        if self.writer is not None:
            self._flush()
            end = {**self.meta, "start": self.shard_start, "steps": self.written}
            self.writer.add_key_value_metadata({_META_KEY: json.dumps(end).encode()})
            self.writer.close()
        return self.written
