"""Load statistics in: what serving systems record, read as per-step counts `[steps, layers, E]` that
`ImportedLoads.window` sums to the `[layers, E]` window `eplb solve` reads (`import_loads`, `write_loads`):

- SGLang's expert distribution recorder in `stat` mode: `logical_count` `[steps, layers, E]` (or `[layers, E]`)
  as JSON or .npz/.npy (its own dump is a torch .pt file; see docs/integrations.md for the conversion);
- TensorRT-LLM's expert statistics: `meta_info.json` plus `rank{N}.safetensors` files of per-(iteration, layer)
  counts keyed `"{iter}_{layer}"` (tensorrt_llm/_torch/expert_statistic.py), or the same keys in `rank{N}.json`;
- vLLM-style arrays `[steps, layers, E]` (.npy/.npz/.json); vLLM's own `expert_load_window` counts physical
  slots, `[steps, layers, P]`, and is folded to logical experts with a `physical_to_logical_map`.

Every failure is an EplbError saying what to change.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy
from numpy.typing import NDArray

from eplb.errors import EplbError
from eplb.io.files import (
    existing_file,
    int_table,
    numeric_array,
    output_file,
    plural,
    read_json,
    replace_text,
    unreadable_npz,
    usable_path,
)
from eplb.io.logs import count_problem
from solvers.validation import EMPTY_SLOT, replica_counts

LOAD_FORMATS = ("sglang", "trtllm", "vllm")
STATISTICS_FILE = "statistics file"
"""What the messages call an input file of `import_loads` (`eplb import-load FILE...`), as `eplb solve` says "load
file" and `eplb replay` "routing log" (`eplb.io.files.existing_file`)."""


@dataclass(frozen=True)
class ImportedLoads:
    """Per-step expert counts read from a serving system.

    counts: [steps, layers, E] tokens routed to each logical expert (token-to-expert assignments);
    layer_ids: model layer of each row, or None when the recording has none (vLLM numbers its MoE layers by
    position, 0..L-1 in model order, whatever their model layers); source: where they came from; format: sglang,
    trtllm or vllm;
    meta: extra facts from the files (e.g. num_experts_per_token, iterations); in_time_order: False when the
    steps come from a circular buffer that does not record where it wrapped (the sum is still exact);
    order_note: why they are not in time order, or, when they are, what that assumes (a caveat to show when
    steps are selected), or "".
    """

    counts: NDArray[np.float64]
    layer_ids: list[int] | None
    source: str
    format: str
    meta: dict[str, Any] = field(default_factory=dict)
    in_time_order: bool = True
    order_note: str = ""

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def window(self) -> NDArray[np.float64]:
        """The load window eplb solves on: counts summed over steps, [layers, E]."""
        return np.asarray(self.counts.sum(axis=0), dtype=np.float64)

    def select_steps(self, start: int | None, stop: int | None) -> ImportedLoads:
        """Keep steps[start:stop] (Python slice rules, so -100: keeps the last 100)."""
        if not self.in_time_order:
            why = self.order_note or "a full circular buffer, which does not record where it wrapped"
            raise EplbError(f"{self.source}: the steps are not in time order ({why}), so --steps cannot pick "
                            "recent ones; import them all")
        picked = self.counts[start:stop]
        if picked.shape[0] == 0:
            raise EplbError(f"--steps {'' if start is None else start}:{'' if stop is None else stop} selects none of "
                            f"the {plural(self.num_steps, 'recorded step')}")
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
    (`{"logical_count": ...}`) or .npz (array `logical_count`, or one array saved without a name) or .npy.

    Several files are stacked along the step axis. SGLang's rows are model layers, dense ones included (all
    zero); with drop_empty_layers those rows are dropped and `layer_ids` keeps the model layer of each row left.
    """
    parts: list[NDArray[np.float64]] = []
    names: list[str] = []
    for raw in paths:
        p = existing_file(raw, STATISTICS_FILE)
        suffix = p.suffix.lower()
        if suffix == ".pt":
            raise EplbError(f"{p}: SGLang's .pt dumps need torch to read; convert once with {sglang_pt_hint(p)}")
        if suffix == ".json":
            data = read_json(p)
            if not isinstance(data, dict) or "logical_count" not in data:
                raise EplbError(f"{p}: missing 'logical_count' (expected SGLang's stat dump, "
                                '{"logical_count": [[...per expert...] per layer]})')
            value: Any = data["logical_count"]
        elif suffix in (".npz", ".npy"):
            _, value = _read_array(p, ("logical_count",))
        else:
            raise EplbError(f"{p}: unknown file type '{suffix}' for SGLang statistics (use .json, .npz or .npy)")
        parts.append(_steps_layers_experts(value, f"{p}: logical_count"))
        names.append(p.name)
    ordered = [_sglang_dump_steps(part, name) for part, name in zip(parts, names, strict=True)]
    counts = _stack([steps for steps, _, _ in ordered], names)
    in_order = all(ok for _, ok, _ in ordered)
    note = "; ".join(n for _, ok, n in ordered if n and ok == in_order)
    layer_ids = list(range(counts.shape[1]))
    if drop_empty_layers:
        totals = counts.sum(axis=(0, 2))
        keep = np.flatnonzero(totals > 0)
        if keep.size == 0:
            raise EplbError(f"{', '.join(names)}: every count is 0; record while requests are being served")
        counts = counts[:, keep]
        layer_ids = [int(v) for v in keep]
    source = f"SGLang expert distribution ({', '.join(names)}, {plural(counts.shape[0], 'step')})"
    return ImportedLoads(counts, layer_ids, source, "sglang", in_time_order=in_order, order_note=note)


def sglang_pt_hint(p: Path) -> str:
    """The one-line command that turns SGLang's .pt stat dump into an .npz eplb reads (CPU host or GPU host)."""
    return (f"python -c \"import torch, numpy; d = torch.load('{p.name}', map_location='cpu', weights_only=True); "
            f"numpy.savez('{p.stem}.npz', logical_count=d['logical_count'].numpy())\"")


def _sglang_dump_steps(part: NDArray[np.float64], name: str) -> tuple[NDArray[np.float64], bool, str]:
    """The recorded steps of one SGLang stat dump in time order where the dump tells it: (steps, in time order,
    order note). SGLang's `_StatAccumulator` keeps steps in one of two buffers
    (`python/sglang/srt/eplb/expert_distribution.py`):

    - `--expert-distribution-recorder-buffer-size -1`: an unbounded buffer, dumped as the steps it recorded
      (`_InfiniteBuffer.get_all` returns its first `size` rows), in order, every one written;
    - a positive size N (default 1000): a circular buffer of N rows dumped whole (`_CircularBuffer.get_all`),
      rows never written all zero. Starting a recording zeroes the rows but keeps the write position, so the
      written rows are one run, in circular order, starting wherever the previous recording stopped: they are
      in time order from the first written row after the unwritten ones. Once full, the rows are rotated by an
      offset the dump does not record.

    So unwritten (all-zero) rows are dropped (no tokens: the window is unchanged) and the written run is
    rotated to start after them. A dump with every row written is either kind, which its rows cannot tell:
    it is read in order (what -1, docs/integrations.md's recipe, records), with a note saying so. Written rows
    in several runs (steps without tokens among them) are not known to be in order."""
    written = part.reshape(part.shape[0], -1).any(axis=1)
    if not written.any():
        return part[:1], True, ""
    if written.all():
        n = part.shape[0]
        return part, True, (f"{name}: every row holds counts ({plural(n, 'row')}): read in time order, as SGLang's "
                            "unbounded buffer (--expert-distribution-recorder-buffer-size -1) dumps them; a full "
                            f"circular buffer of {plural(n, 'row')} (buffer size {n}; SGLang's default is 1000) is "
                            "rotated by an offset the dump does not record, and --steps would pick arbitrary steps "
                            "of it")
    starts = np.flatnonzero(written & ~np.roll(written, 1))  # written rows after an unwritten one, circularly
    if starts.size > 1:
        return part[written], False, (f"{name}: rows without counts split its recorded steps into {starts.size} "
                                      "runs, so where a circular buffer wrapped is unknown")
    order = np.roll(np.arange(part.shape[0]), -int(starts[0]))
    return part[order[np.asarray(written)[order]]], True, ""


def _circular_buffer_steps(parts: list[NDArray[np.float64]]) -> tuple[list[NDArray[np.float64]], bool]:
    """vLLM's `expert_load_window` is a circular buffer dumped whole: rows never written are all zero, and once
    full, the rows are rotated by an offset the dump does not record. Drop the all-zero rows (they hold no tokens,
    so the window is unchanged) and say whether the rest are in time order (a buffer with unwritten rows never
    wrapped)."""
    kept, in_order = [], True
    for part in parts:
        written = part.reshape(part.shape[0], -1).any(axis=1)
        if written.all() and part.shape[0] > 1:
            in_order = False
        kept.append(part[written] if written.any() else part[:1])
    return kept, in_order


def read_trtllm_loads(paths: Sequence[str | Path]) -> ImportedLoads:
    """TensorRT-LLM expert statistics: a directory (or its files) with `meta_info.json` (`num_experts`,
    `num_experts_per_token`) and one `rank{N}.safetensors` (or `rank{N}.json`) per rank mapping
    `"{iter}_{layer}"` to [E] counts. Ranks are summed; iterations become steps, layers (model layer ids,
    sorted) become rows. Every iteration must cover the same layers."""
    meta_path, rank_files = _trtllm_files(paths)
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("num_experts"), int) or meta["num_experts"] < 1:
        raise EplbError(f"{meta_path}: missing 'num_experts' (a positive integer)")
    num_experts = int(meta["num_experts"])
    totals: dict[tuple[int, int], NDArray[np.float64]] = {}
    recorded: dict[Path, set[tuple[int, int]]] = {}
    for f in rank_files:
        recorded[f] = set()
        for key, arr in _trtllm_rank_counts(f).items():
            m = re.fullmatch(r"(\d+)_(\d+)", key)
            if not m:
                raise EplbError(f"{f}: key {key!r} is not '{{iteration}}_{{layer}}'")
            vec = _counts_vector(arr, f"{f}: {key}", num_experts)
            it_layer = (int(m.group(1)), int(m.group(2)))
            recorded[f].add(it_layer)
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
    _refuse_incomplete_ranks(recorded, set(totals))
    info: dict[str, Any] = {k: v for k, v in meta.items() if isinstance(v, int | float | str)}
    info.update({"iterations": [iters[0], iters[-1] + 1], "ranks": len(rank_files)})
    source = (f"TensorRT-LLM expert statistics ({meta_path.parent}, {plural(len(rank_files), 'rank file')}, "
              f"iterations {iters[0]}-{iters[-1]})")
    return ImportedLoads(counts, layers, source, "trtllm", info)


def _refuse_incomplete_ranks(recorded: dict[Path, set[tuple[int, int]]], keys: set[tuple[int, int]]) -> None:
    """Every rank file must count every (iteration, layer) some rank counts: each rank records its own tokens, so
    a key one lacks would be summed as 0 tokens of that rank (a cut-short or partly copied recording)."""
    for f, held in recorded.items():
        missing = sorted(keys - held)
        if missing:
            shown_keys = ", ".join(f"'{it}_{layer}'" for it, layer in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise EplbError(f"{f}: no counts for {shown_keys}{more}, which other rank files record; every rank "
                            "records every iteration and layer: give the complete recording")


def fold_slots(loads: ImportedLoads, phy2log: NDArray[np.int64], layer_ids: Sequence[int]) -> ImportedLoads:
    """Slot counts [steps, layers, P] (TensorRT-LLM with its load balancer on counts slot ids, num_experts =
    slots) folded to logical experts with the placement that was live: phy2log [placement layers, P], its rows
    being model layers layer_ids; the rows of loads.layer_ids are picked."""
    rows = {int(layer): i for i, layer in enumerate(layer_ids)}
    counted = list(range(loads.counts.shape[1])) if loads.layer_ids is None else loads.layer_ids
    missing = [layer for layer in counted if layer not in rows]
    if missing:
        raise EplbError(f"the placement has no row for model layer {missing[0]}, which the statistics count; give "
                        "the load-balancer config that was live while recording (its keys are model layers)")
    table = np.asarray(phy2log, dtype=np.int64)[[rows[layer] for layer in counted]]
    if table.shape[1] != loads.counts.shape[2]:
        raise EplbError(f"the statistics count {loads.counts.shape[2]} slots or experts per layer but the "
                        f"placement has {table.shape[1]} slots; give the config that was live while recording")
    counts = fold_physical(loads.counts, table, "slot counts")
    meta = {**loads.meta, "num_slots": int(table.shape[1]), "num_experts": int(counts.shape[2])}
    return replace(loads, counts=counts, meta=meta, source=f"{loads.source}, slots folded to experts")


def read_vllm_loads(paths: Sequence[str | Path], *, phy2log: NDArray[np.int64] | None = None) -> ImportedLoads:
    """vLLM-style per-step counts: .npy, .npz (array `counts`, `logical_count`, `loads` or
    `expert_load_window`, or one array saved without a name) or .json (`{"counts": ...}`, or
    `{"expert_load_window": ...}`; SGLang's `logical_count` and our `loads` are refused naming where they go),
    shaped [steps, MoE layers, E] or [MoE layers, E]. Several files are the EP ranks of one recording: each rank
    counts the tokens it dispatched, and vLLM sums the ranks (an all-reduce) before it rebalances, so do we.

    vLLM's own `expert_load_window` counts physical slots, [steps, layers, P]: give `phy2log` [layers, P]
    (or store `physical_to_logical_map` in the .npz) and the slot counts are added up per logical expert.
    That window is a circular buffer: rows never written (all zero) are dropped, and a full one is not in
    time order. vLLM numbers MoE layers by position (row i is the model's i-th MoE layer, `moe_layer_idx`), not
    by model layer, so the loads carry no `layer_ids` and are matched to placements by position.
    """
    parts: list[NDArray[np.float64]] = []
    names: list[str] = []
    recorder = False
    for raw in paths:
        p = existing_file(raw, STATISTICS_FILE)
        suffix = p.suffix.lower()
        table = phy2log
        if suffix == ".json":
            data = read_json(p)
            key = next((k for k in ("counts", "expert_load_window") if isinstance(data, dict) and k in data), None)
            if key is None:
                raise EplbError(f"{p}: " + (
                    "this is SGLang's stat dump (logical_count), whose rows are model layers: import it with "
                    "--from sglang" if isinstance(data, dict) and "logical_count" in data else
                    "this is a load window already (loads): give it as --loads, not to import-load"
                    if isinstance(data, dict) and "loads" in data else
                    "expected a 'counts' field holding [steps][layers][experts] token counts"))
            value: Any = data[key]
            if table is None and "physical_to_logical_map" in data:
                table = int_table(data["physical_to_logical_map"], f"{p}: physical_to_logical_map")
        elif suffix in (".npz", ".npy"):
            key, value = _read_array(p, ("counts", "logical_count", "loads", "expert_load_window"))
            if table is None and suffix == ".npz":
                table = _npz_table(p)
        else:
            raise EplbError(f"{p}: unknown file type '{suffix}' for vLLM counts (use .npy, .npz or .json)")
        recorder |= key == "expert_load_window"
        if key == "expert_load_window" and table is None:
            raise EplbError(f"{p}: expert_load_window counts vLLM's physical slots ([steps, layers, slots]), not "
                            "logical experts, and no physical_to_logical_map comes with it to add the slots up per "
                            "expert: save the map next to the window, or give the placement that was live "
                            "(--placement)")
        arr = _steps_layers_experts(value, f"{p}: counts")
        if table is not None:
            arr = fold_physical(arr, table, f"{p}")
            recorder = True
        parts.append(arr)
        names.append(p.name)
    for part, name in zip(parts[1:], names[1:], strict=True):
        if part.shape != parts[0].shape:
            raise EplbError(f"{name} holds {list(part.shape)} [steps, layers, experts] but {names[0]} holds "
                            f"{list(parts[0].shape)}; files are the EP ranks of one recording, summed step by step")
    counts = np.sum(parts, axis=0)
    in_order = True
    if recorder:
        (counts,), in_order = _circular_buffer_steps([counts])
    ranks = f", {len(names)} ranks summed" if len(names) > 1 else ""
    source = f"vLLM-style counts ({', '.join(names)}{ranks}, {plural(counts.shape[0], 'step')})"
    return ImportedLoads(counts, None, source, "vllm", {"ranks": len(names)},
                         in_time_order=in_order, order_note="" if in_order else (
                             "a full expert_load_window: vLLM fills it circularly and the dump does not record "
                             "where it wrapped"))


def fold_physical(
    counts: NDArray[np.float64], phy2log: NDArray[np.int64], what: str = "counts", num_experts: int | None = None
) -> NDArray[np.float64]:
    """Add physical-slot counts [steps, layers, P] up per logical expert with phy2log [layers, P]:
    returns [steps, layers, E], E = num_experts or max(phy2log) + 1. Empty slots (-1, vLLM's mark for the
    slots of absent ranks) hold no expert: their counts must be 0."""
    table = np.asarray(phy2log, dtype=np.int64)
    if table.ndim != 2 or table.shape != counts.shape[1:]:
        raise EplbError(f"{what}: counts have {plural(counts.shape[1], 'layer')} x {plural(counts.shape[2], 'slot')} "
                        "but the "
                        f"physical_to_logical_map is {list(table.shape)}; use the map that was live while recording")
    if table.min() < EMPTY_SLOT:
        raise EplbError(f"{what}: physical_to_logical_map holds {int(table.min())}; expert ids are >= 0 "
                        "(-1 marks an empty slot)")
    empty = table == EMPTY_SLOT
    served = np.argwhere(empty[None] & (counts > 0))
    if served.size:
        step, layer, slot = (int(v) for v in served[0])
        raise EplbError(f"{what}: slot {slot} of layer {layer} is empty (-1) in the map but counted "
                        f"{counts[step, layer, slot]:g} tokens at step {step}; use the map live while recording")
    experts = int(table.max()) + 1 if num_experts is None else num_experts
    if num_experts is None:  # E is the largest id + 1: an id below it without a slot means a wrong map, not E
        unheld = np.argwhere(replica_counts(table, experts) == 0)
        if unheld.size:
            layer, expert = (int(v) for v in unheld[0])
            raise EplbError(f"{what}: physical_to_logical_map gives logical expert {expert} no slot in layer {layer} "
                            f"though its ids run to {experts - 1} ({len(unheld)} missing in all); every expert has "
                            "a slot: use the map live while recording")
    steps, layers, _ = counts.shape
    flat = (table + (np.arange(layers, dtype=np.int64) * experts)[:, None])[~empty]
    out = np.zeros((steps, layers * experts), dtype=np.float64)
    for s in range(steps):
        out[s] = np.bincount(flat, weights=counts[s][~empty], minlength=layers * experts)
    return out.reshape(steps, layers, experts)


def write_loads(loads: ImportedLoads, path: str | Path, *, keep_steps: bool = False) -> None:
    """Write a load file eplb reads (docs/formats.md): .json `{"loads": [layers][E], "source", "format",
    "layer_ids", "num_steps", ...}`, .npz (`loads`, or `counts` [steps, layers, E] with keep_steps, plus
    `layer_ids`) or .npy (the array alone); `layer_ids` only when the loads have them. keep_steps writes the
    per-step counts instead of their sum."""
    p = output_file(path)
    arr = loads.counts if keep_steps else loads.window
    suffix = p.suffix.lower()
    if suffix == ".json":
        values = arr.astype(np.int64).tolist() if np.all(np.mod(arr, 1) == 0) else arr.tolist()
        obj: dict[str, Any] = {
            "source": loads.source,
            "format": f"{loads.format} (imported by eplb import-load)",
            **({} if loads.layer_ids is None else {"layer_ids": loads.layer_ids}),
            "num_steps": loads.num_steps,
            "num_experts": int(arr.shape[-1]),
            **{k: v for k, v in loads.meta.items() if k not in ("source", "loads")},
            "loads": values,
        }
        replace_text(p, json.dumps(obj) + "\n")
    elif suffix == ".npz":
        members: dict[str, NDArray[Any]] = {"counts" if keep_steps else "loads": arr}
        if loads.layer_ids is not None:
            members["layer_ids"] = np.asarray(loads.layer_ids, dtype=np.int64)
        np.savez(p, allow_pickle=False, **members)
    elif suffix == ".npy":
        np.save(p, arr)
    else:
        raise EplbError(f"{p}: unknown output type '{suffix}' (use .json, .npz or .npy)")


def read_safetensors(path: str | Path) -> dict[str, NDArray[Any]]:
    """Read a safetensors file into numpy arrays (the safetensors package's numpy API)."""
    p = Path(path)
    try:
        return dict(safetensors.numpy.load_file(p))
    except (safetensors.SafetensorError, ValueError, TypeError, OSError) as exc:
        raise EplbError(f"{p}: not a readable safetensors file ({exc})") from None


def _trtllm_files(paths: Sequence[str | Path]) -> tuple[Path, list[Path]]:
    """(meta_info.json, rank files) of a TensorRT-LLM recording given as its folder or as its files, each an
    `existing_file` (named STATISTICS_FILE, as the other formats' files)."""
    given = [usable_path(p, STATISTICS_FILE) for p in paths]
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
        return existing_file(meta, STATISTICS_FILE), [existing_file(f, STATISTICS_FILE) for f in files]
    for p in given:
        existing_file(p, STATISTICS_FILE)
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
        data = read_json(p)
        if not isinstance(data, dict):
            raise EplbError(f"{p}: expected an object mapping '{{iteration}}_{{layer}}' to lists of counts")
        return data
    raise EplbError(f"{p}: unknown rank file type '{suffix}' (use rank*.safetensors or rank*.json)")


def _counts_vector(value: Any, what: str, num_experts: int) -> NDArray[np.float64]:
    arr = numeric_array(value, what)
    if arr.ndim != 1 or arr.size != num_experts:
        raise EplbError(f"{what} has shape {list(arr.shape)}; expected {plural(num_experts, 'count')} (meta_info "
                        "num_experts)")
    _check_counts(arr, what)
    return arr


def _steps_layers_experts(value: Any, what: str) -> NDArray[np.float64]:
    arr = numeric_array(value, what)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise EplbError(f"{what} must be [steps][layers][experts] or [layers][experts], got shape {list(arr.shape)}")
    if 0 in arr.shape:
        raise EplbError(f"{what} is empty (shape {list(arr.shape)})")
    _check_counts(arr, what)
    return arr


def _check_counts(arr: NDArray[np.float64], what: str) -> None:
    """Every entry of `what` (a file and where in it) a token count, the routing logs' rule (`count_problem`):
    SGLang's, TensorRT-LLM's and vLLM's recorders count tokens, so 3.5 (or a negative, NaN, inf, or a count beyond
    any window) is a wrong file, refused naming the file, the key or field and the first bad entry."""
    found = count_problem(arr)
    if found is not None:
        index, why = found
        raise EplbError(f"{what}{''.join(f'[{i}]' for i in index)}: {why}")


def _stack(parts: list[NDArray[np.float64]], names: list[str]) -> NDArray[np.float64]:
    for part, name in zip(parts[1:], names[1:], strict=True):
        if part.shape[1:] != parts[0].shape[1:]:
            raise EplbError(f"{name} has {plural(part.shape[1], 'layer')} x {plural(part.shape[2], 'expert')} but "
                            f"{names[0]} has "
                            f"{parts[0].shape[1]} x {parts[0].shape[2]}; import files of one model together")
    return np.concatenate(parts, axis=0)






UNNAMED = "arr_0"
"""The name np.savez gives an array passed without one (`np.savez(file, counts)`)."""


def _read_array(p: Path, keys: tuple[str, ...]) -> tuple[str, NDArray[Any]]:
    """(name, array) of the one of `keys` an .npz holds, else of its one unnamed array (`UNNAMED`); an .npy's
    array, named "". Two of `keys`, or a lone array of another name, are refused: which counts they are is a
    guess."""
    try:
        if p.suffix.lower() == ".npy":
            return "", np.asarray(np.load(p, allow_pickle=False))
        with np.load(p, allow_pickle=False) as npz:
            names = list(npz.files)
            held = [key for key in keys if key in names]
            if len(held) > 1:
                raise EplbError(f"{p}: holds both {held[0]!r} and {held[1]!r}, so which counts to read is unclear; "
                                "keep one")
            if held:
                return held[0], np.asarray(npz[held[0]])
            arrays = [n for n in names if n not in ("layer_ids", "physical_to_logical_map")]
            if arrays == [UNNAMED]:
                return UNNAMED, np.asarray(npz[UNNAMED])
    except zipfile.BadZipFile as exc:
        raise EplbError(unreadable_npz(p, exc)) from None
    except (ValueError, OSError, EOFError) as exc:
        raise EplbError(f"{p}: not a readable numpy file ({exc or 'cut short'})") from None
    raise EplbError(f"{p}: expected an array named {' or '.join(repr(k) for k in keys)} (or one saved without a "
                    f"name, np.savez(file, array)), found {names}")


def _npz_table(p: Path) -> NDArray[np.int64] | None:
    with np.load(p, allow_pickle=False) as npz:
        if "physical_to_logical_map" not in npz.files:
            return None
        return int_table(np.asarray(npz["physical_to_logical_map"]), f"{p}: physical_to_logical_map")




