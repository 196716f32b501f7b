"""Expert co-activation: which experts a token chooses together, and what that costs a placement.

A token is dispatched once to every GPU (and, across nodes, once to every node) that holds one of the
replicas its top-k picks are routed to, so its all-to-all copies are the number of *distinct* GPUs
its k experts land on, not k. Co-activated experts placed together cut that number.

Three views of the same quantity, from most to least data:

- exact, from token-level routing (`topk_ids [tokens, layers, k]`, docs/formats.md): `copies_per_token`
  routes every token with a replica-selection rule and counts distinct GPUs and nodes;
- the pair counts `pair_counts` ([layers, E, E], `eplb.io.logs.coactivation`), the input of the
  co-activation-aware solver (`solvers/coactivation.py`);
- a compact `CoactivationSummary` a cluster can send per window: per layer and expert, its load and its
  `m` most frequent partners with their pair counts (E x m ids and counts instead of E x E), from which
  `approx_copies_per_token` estimates the expected distinct GPUs (docs/cost-model.md, "Co-activation").

Replica selection (which replica of an expert with several a token uses) changes the copies:
- "vllm": vLLM's rule, replica (flat position of the pick in topk_ids) mod (replica count);
- "sglang": SGLang's static dispatch, a replica on the token's own GPU if there is one, else a fixed
  replica per (source GPU, expert), spread round robin over source GPUs;
- "coact": ours, a replica on a GPU the token already goes to (its own GPU or one of its single-replica
  experts' GPUs) if there is one, else vLLM's choice.
A token's source GPU is its position in its step modulo G (data-parallel ranks own interleaved tokens).
Positions (the flat position of vLLM's rule and the source GPU) count from the token's own step's start
(`step_offsets`; without them the tokens given are one step), so a count does not depend on how a log's
steps are cut into blocks.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb import _reach
from eplb.errors import EplbError, FieldError
from eplb.io.logs import LogInfo, open_log
from eplb.io.logs import coactivation as _coactivation
from eplb.io.windows import MAX_LOAD
from eplb.npy import NpyError, read_npy
from eplb.rules import pairs_refusal

__all__ = [
    "RULES",
    "CoactivationSummary",
    "CopyStats",
    "Reach",
    "approx_copies_per_token",
    "copies_per_token",
    "pair_counts",
    "partner_lift",
    "reach",
    "read_summary",
    "read_topk",
    "replica_gpus",
    "summarize",
]

RULES = ("vllm", "sglang", "coact")
SUMMARY_FORMAT = "eplb.coactivation-summary/v1"
SUMMARY_FIELDS = ("format", "tokens", "top_k", "loads", "partners", "counts")
"""The keys of a summary's JSON object (`CoactivationSummary.to_dict`); any other is refused by name."""
BINARY_MAX = 256 * 2**20
"""Most bytes a binary summary may unpack to (DeepSeek-V3, 58 x 256 experts x 8 partners: 2 MB)."""
WINDOW_TOLERANCE = 0.2
"""The largest share of a layer's picks a summary may put on other experts than its load window does beyond what
drawing the summary's picks at random may (`CoactivationSummary.window_contradiction`)."""
IntArray = NDArray[np.int64]
F64 = NDArray[np.float64]


def read_topk(path: str | Path) -> tuple[NDArray[np.int16], IntArray]:
    """A token-level log (eplb.topk/v1 `.npz`, validated by `open_log`) in memory:
    (topk_ids [tokens, layers, k] int16, step_offsets [steps + 1])."""
    ids, offsets, _ = _read_log(path)
    return ids, offsets


def _read_log(path: str | Path) -> tuple[NDArray[np.int16], IntArray, int]:
    """`read_topk` and the log's own expert count (its `num_experts`)."""
    ids, offsets, info = _read_log_info(path)
    return ids, offsets, info.num_experts


def _read_log_info(path: str | Path) -> tuple[NDArray[np.int16], IntArray, LogInfo]:
    """`read_topk` and what the log says of itself (`LogInfo`: its num_experts, layer_ids)."""
    log = open_log(path)
    if log.info.kind != "topk":
        raise EplbError(f"{path}: co-activation needs a token-level log (topk_ids), not {log.info.kind}")
    for _ in log.iter_counts(4096):  # validates ids and offsets
        pass
    with np.load(path) as z:
        ids = np.asarray(z["topk_ids"], dtype=np.int16)
        return ids, np.asarray(z["step_offsets"], dtype=np.int64), log.info


def read_summary(
    path: str | Path, num_experts: int | None = None, partners: int = 8, *, num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
) -> CoactivationSummary:
    """A window's co-activation summary from a file: a summary (.json, "eplb.coactivation-summary/v1",
    `CoactivationSummary.to_dict`, or its .npz image, `to_bytes`) or a token-level log (.npz with topk_ids, of
    its own `num_experts`), summarized with the top `partners` per expert (keeping its exact pair counts).
    num_experts, num_layers: the load window's, when given: a file of another shape is refused naming both.
    layer_ids: the window's model layers; a log that names its own (`layer_ids`) gives those rows, as a placement
    does (`eplb.io.foreign.read_placement_for`), and one it lacks is refused. EplbError with the file's name on
    anything else."""
    from eplb.io.exports import ranges
    from eplb.io.files import existing_file, plural, read_json

    p = existing_file(path, "co-activation file")
    suffix = p.suffix.lower()
    summary: CoactivationSummary | None = None  # a token-level log's is made once its shape is checked
    if suffix == ".json" or (suffix == ".npz" and _is_summary_image(p)):
        data = read_json(p) if suffix == ".json" else None  # its own errors name the file
        try:
            summary = _summary_file(p, data)
        except EplbError as exc:
            raise EplbError(f"{p}: {exc}") from None
        layers, experts = summary.loads.shape
    elif suffix == ".npz":
        ids, _, info = _read_log_info(p)
        if layer_ids is not None and info.layer_ids is not None and num_experts in (None, info.num_experts):
            missing = [layer for layer in layer_ids if layer not in info.layer_ids]
            if missing:
                raise EplbError(f"{p}: the token-level log has no layer {missing[0]} (its layer_ids are "
                                f"{ranges(info.layer_ids)}), the loads' layer_ids are {ranges(list(layer_ids))}")
            ids = ids[:, [info.layer_ids.index(layer) for layer in layer_ids]]
        layers, experts = ids.shape[1], info.num_experts
    else:
        raise EplbError(f"{p}: a co-activation file is a summary (.json, or its .npz image) or a token-level log "
                        "(.npz with topk_ids)")
    if (num_experts is not None and experts != num_experts) or (num_layers is not None and layers != num_layers):
        if num_layers is not None and num_experts is not None:
            window = f"are {num_layers} x {num_experts}"
        elif num_experts is not None:
            window = f"have {plural(num_experts, 'expert')}"
        else:
            window = f"have {plural(num_layers or 0, 'layer')}"
        raise EplbError(f"{p}: the co-activation data is for {plural(layers, 'layer')} x {plural(experts, 'expert')}, "
                        f"the loads {window}")
    return _summarize(ids, experts, partners) if summary is None else summary  # the log's ids checked when read


def _summary_file(path: Path, data: Any) -> CoactivationSummary:
    """The summary a file holds: its JSON object (`data`, read from the .json), or None: the .npz image at path."""
    if data is None:
        return CoactivationSummary.from_bytes(path.read_bytes())
    if not isinstance(data, dict) or data.get("format") != SUMMARY_FORMAT:
        raise EplbError(f"expected a co-activation summary object with \"format\": \"{SUMMARY_FORMAT}\"")
    return CoactivationSummary.from_dict(data)


def _is_summary_image(path: Path) -> bool:
    """Whether an .npz is a summary's binary image (`CoactivationSummary.to_bytes`: an array `partners`, no
    `topk_ids`); an unreadable archive is left to the routing-log reader, which says why."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
    return "partners.npy" in names and "topk_ids.npy" not in names


def pair_counts(topk_ids: ArrayLike, num_experts: int) -> IntArray:
    """Co-activation [layers, E, E]: (l, i, j), i != j, tokens whose layer-l top-k holds both i and j;
    the diagonal holds each expert's load. topk_ids: [tokens, layers, k]."""
    return _coactivation(topk_ids, num_experts)


@dataclass(frozen=True)
class CopyStats:
    """Dispatch copies per token, means over tokens, per layer ([L] each).

    gpus: distinct GPUs a token's top-k is sent to (its own GPU included); remote_gpus: those other than
    the token's own GPU (the copies that cross a link); nodes: distinct nodes; remote_nodes: nodes other
    than the token's own (inter-node copies)."""

    gpus: F64
    remote_gpus: F64
    nodes: F64
    remote_nodes: F64

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k).tolist() for k in ("gpus", "remote_gpus", "nodes", "remote_nodes")}


def _gpu_of_slot(slots_per_gpu: IntArray) -> IntArray:
    return np.repeat(np.arange(slots_per_gpu.size, dtype=np.int64), slots_per_gpu)


def _replica_table(phy2log: IntArray, slots_per_gpu: IntArray, num_experts: int) -> tuple[IntArray, IntArray]:
    """(gpus [E, R] GPU of each replica in slot order, -1 padded; count [E]) of one layer."""
    gpu = _gpu_of_slot(slots_per_gpu)
    valid = phy2log >= 0
    count = np.bincount(phy2log[valid], minlength=num_experts).astype(np.int64)
    width = max(int(count.max(initial=0)), 1)
    table = np.full((num_experts, width), -1, dtype=np.int64)
    order = np.argsort(np.where(valid, phy2log, num_experts), kind="stable")[: int(valid.sum())]
    experts = phy2log[order]
    rank = np.arange(order.size) - np.searchsorted(experts, experts, side="left")
    table[experts, rank] = gpu[order]
    return table, count


def _offsets(tokens: int, step_offsets: ArrayLike | None) -> IntArray:
    """step_offsets [steps + 1] (token offsets of the steps, rising from 0 to tokens) as int64, checked; None: the
    tokens are one step, [0, tokens]."""
    if step_offsets is None:
        return np.array([0, tokens], dtype=np.int64)
    offsets = np.asarray(step_offsets, dtype=np.int64)
    bad = offsets.ndim != 1 or not offsets.size or offsets[0] != 0 or offsets[-1] != tokens
    if bad or (np.diff(offsets) < 0).any():
        raise EplbError(f"step_offsets must rise from 0 to the {tokens} tokens, got {offsets.tolist()[:8]}")
    return offsets


def _step_positions(tokens: int, step_offsets: ArrayLike | None) -> IntArray:
    """[tokens] each token's position in its own step, from step_offsets [steps + 1] (token offsets of the
    steps, 0 .. tokens; None: the tokens are one step)."""
    offsets = _offsets(tokens, step_offsets)
    out: IntArray = np.arange(tokens, dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
    return out


def _routing_inputs(
    topk_ids: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, num_experts: int, rule: str
) -> tuple[NDArray[np.integer[Any]], IntArray, IntArray]:
    """(topk_ids [tokens, L, k], phy2log [L, P] int64, slots_per_gpu [G] int64), checked; topk_ids keeps int16,
    int32 and int64 (native order), other types become int64."""
    if rule not in RULES:
        raise EplbError(f"unknown replica rule {rule!r}: choose one of {', '.join(RULES)}")
    ids = np.asarray(topk_ids)
    if ids.dtype not in (np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)):
        ids = ids.astype(np.int64)
    p2l = np.asarray(phy2log, dtype=np.int64)
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if p2l.ndim == 1:
        p2l = p2l[None, :]
    if ids.ndim != 3 or p2l.ndim != 2 or ids.shape[1] != p2l.shape[0]:
        raise EplbError(f"topk_ids must be [tokens, {p2l.shape[0]} layers, k], got shape {list(ids.shape)}")
    if slots.ndim != 1 or (slots < 0).any() or p2l.shape[1] != int(slots.sum()):
        raise EplbError(f"slots_per_gpu sums to {int(slots.sum())} but phy2log has {p2l.shape[1]} slots")
    if p2l.size and int(p2l.max()) >= num_experts:
        raise EplbError(f"phy2log holds expert {int(p2l.max())}, beyond the {num_experts} experts")
    return ids, p2l, slots


def _replica_tables(p2l: IntArray, slots: IntArray, num_experts: int) -> tuple[IntArray, IntArray]:
    """(table [L, E, R] GPU of each replica in slot order, -1 padded; count [L, E]) of every layer."""
    per_layer = [_replica_table(row, slots, num_experts) for row in p2l]
    width = max((t.shape[1] for t, _ in per_layer), default=1)
    table = np.full((p2l.shape[0], num_experts, width), -1, dtype=np.int64)
    count = np.zeros((p2l.shape[0], num_experts), dtype=np.int64)
    for layer, (t, c) in enumerate(per_layer):
        table[layer, :, : t.shape[1]] = t
        count[layer] = c
    return table, count


_MODES = {"reach": 0, "copies": 1, "gpus": 2}


def _route(
    ids: NDArray[np.integer[Any]], offsets: IntArray, p2l: IntArray, slots: IntArray, num_experts: int, rule: str,
    per_node: int, nodes: int, mode: str,
) -> IntArray:
    """The compiled loop (eplb/_reach.c) over checked inputs (`_routing_inputs`, `_offsets`): mode "reach"
    [steps, L, G + nodes] tokens of each step reaching each GPU, then each node; "copies" [L, 4] summed distinct
    GPUs, GPUs with the source GPU, nodes, nodes with the source's; "gpus" [tokens, L, k] each pick's GPU."""
    tokens, layers, k = ids.shape
    num_gpus, steps = slots.size, offsets.size - 1
    shape = {"reach": (steps, layers, num_gpus + nodes), "copies": (layers, 4), "gpus": (tokens, layers, k)}[mode]
    out = np.zeros(shape, dtype=np.int64)
    if out.size == 0 or tokens == 0:
        return out
    table, count = _replica_tables(p2l, slots, num_experts)
    done = _reach.route(np.ascontiguousarray(ids), tokens, layers, k, np.ascontiguousarray(offsets), steps, table,
                        count, num_experts, table.shape[2], RULES.index(rule), num_gpus, per_node, nodes,
                        _MODES[mode], out)  # fmt: skip
    if done is None:
        _refuse_picks(ids, count, num_experts)
    return out


def _refuse_picks(ids: NDArray[np.integer[Any]], count: IntArray, num_experts: int) -> None:
    """EplbError naming the first pick (layer by layer) of an expert outside 0 .. E - 1 or without a slot."""
    for layer in range(ids.shape[1]):
        e = ids[:, layer, :].astype(np.int64)
        outside = (e < 0) | (e >= num_experts)
        if outside.any():
            raise EplbError(f"layer {layer}: expert id {int(e[outside][0])} is outside 0..{num_experts - 1}")
        empty = count[layer][e] == 0
        if empty.any():
            raise EplbError(f"layer {layer}: expert {int(e[empty][0])} is routed to but has no slot in phy2log")
    raise EplbError("topk_ids could not be routed")  # unreachable: the kernel refuses only those picks


def replica_gpus(
    topk_ids: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    num_experts: int,
    rule: str = "vllm",
    step_offsets: ArrayLike | None = None,
) -> IntArray:
    """GPU each pick is served on: [tokens, layers, k] from topk_ids [tokens, layers, k], phy2log [L, P]
    (one placement per layer) and slots_per_gpu [G], with replica-selection `rule` (module docstring);
    step_offsets: [steps + 1] token offsets of the steps in topk_ids (None: one step)."""
    ids, p2l, slots = _routing_inputs(topk_ids, phy2log, slots_per_gpu, num_experts, rule)
    offsets = _offsets(ids.shape[0], step_offsets)
    if ids.shape[2] > MAX_PICKS:
        return _replica_gpus(ids, p2l, slots, num_experts, rule, _step_positions(ids.shape[0], offsets))
    return _route(ids, offsets, p2l, slots, num_experts, rule, slots.size, 0, "gpus")


MAX_PICKS = 64
"""Most picks per token (k) the compiled loop routes (eplb/_reach.c's MAX_K); more take the numpy reference."""


def _replica_gpus(
    topk_ids: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, num_experts: int, rule: str,
    position: IntArray | None,
) -> IntArray:
    """`replica_gpus` in numpy, with position [tokens]: each token's position in its step (None: its row). The
    reference the compiled loop (eplb/_reach.c) is tested and benchmarked against."""
    ids, p2l, slots = _routing_inputs(topk_ids, phy2log, slots_per_gpu, num_experts, rule)
    ids = ids.astype(np.int64)
    tokens, layers, k = ids.shape
    num_gpus = slots.size
    if position is None:
        position = np.arange(tokens, dtype=np.int64)
    source = position % num_gpus  # [T]
    out = np.empty_like(ids)
    flat_pos = position[:, None] * k + np.arange(k)[None, :]  # [T, k]: the pick's flat position in its step
    for layer in range(layers):
        table, count = _replica_table(p2l[layer], slots, num_experts)
        e = ids[:, layer, :]
        if (count[e] == 0).any():
            bad = int(e[count[e] == 0][0])
            raise EplbError(f"layer {layer}: expert {bad} is routed to but has no slot in phy2log")
        cnt = count[e]
        vllm = table[e, flat_pos % cnt]
        if rule == "vllm" or table.shape[1] == 1:
            out[:, layer, :] = vllm
            continue
        reps = table[e]  # [T, k, R]
        valid = reps >= 0
        if rule == "sglang":
            local = valid & (reps == source[:, None, None])
            fixed = table[e, source[:, None] % cnt]
            out[:, layer, :] = np.where(local.any(axis=2), source[:, None], fixed)
            continue
        # coact: prefer a GPU the token already visits (own GPU, single-replica experts' GPUs)
        single = cnt == 1
        visited = np.zeros((tokens, num_gpus), dtype=bool)
        visited[np.arange(tokens), source] = True
        rows = np.broadcast_to(np.arange(tokens)[:, None], e.shape)
        visited[rows[single], reps[:, :, 0][single]] = True
        hit = valid & np.take_along_axis(visited, np.where(valid, reps, 0).reshape(tokens, -1), axis=1).reshape(
            reps.shape
        )
        first_hit = np.take_along_axis(reps, np.argmax(hit, axis=2)[:, :, None], axis=2)[:, :, 0]
        out[:, layer, :] = np.where(hit.any(axis=2), first_hit, vllm)
    return out


def _node_split(num_gpus: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(GPUs per node, nodes counted apart: 0 without gpus_per_node)."""
    per_node = gpus_per_node or num_gpus
    if per_node < 1 or num_gpus % per_node:
        raise EplbError(f"{num_gpus} GPUs do not split into nodes of {per_node}")
    return per_node, (num_gpus // per_node if gpus_per_node else 0)


STEP_REACH_PICKS = 8_000_000
"""Picks (tokens x layers x k) routed at once by `_step_reach_numpy` (bounds its memory)."""


def step_reach(
    topk_ids: ArrayLike,
    step_offsets: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    num_experts: int,
    rule: str = "vllm",
    gpus_per_node: int | None = None,
) -> F64:
    """Exact per-step reach: [n, L, G] the fraction of each step's tokens whose top-k picks, routed with `rule`,
    land on each GPU (the `reach` of `eplb.cost.TimeModel.gpu_terms`, from the tokens instead of a summary);
    with gpus_per_node [n, L, G + N]: then the fraction landing on each node (two links).
    topk_ids: [tokens, L, k]; step_offsets: [n + 1] token offsets of the steps (from 0; a token's position counts
    from its step's start); phy2log: [L, P]. One compiled pass over the tokens (eplb/_reach.c), no temporaries
    of the tokens' size."""
    ids, p2l, slots = _routing_inputs(topk_ids, phy2log, slots_per_gpu, num_experts, rule)
    offsets = _offsets(ids.shape[0], step_offsets)
    per_node, nodes = _node_split(slots.size, gpus_per_node)
    if ids.shape[2] > MAX_PICKS:
        return _step_reach_numpy(ids, offsets, p2l, slots, num_experts, rule, gpus_per_node)
    reached = _route(ids, offsets, p2l, slots, num_experts, rule, per_node, nodes, "reach")
    per_step = np.maximum(np.diff(offsets), 1).astype(np.float64)[:, None, None]
    out: F64 = reached / per_step
    return out


def _step_reach_numpy(
    topk_ids: ArrayLike,
    step_offsets: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    num_experts: int,
    rule: str = "vllm",
    gpus_per_node: int | None = None,
) -> F64:
    """`step_reach` in numpy (blocks of `STEP_REACH_PICKS` picks): the reference of the compiled loop."""
    ids, _, slots = _routing_inputs(topk_ids, phy2log, slots_per_gpu, num_experts, rule)
    offsets = _offsets(ids.shape[0], step_offsets)
    tokens, layers, k = ids.shape
    num_gpus = slots.size
    per_node, nodes = _node_split(num_gpus, gpus_per_node)
    reached = np.zeros((offsets.size - 1, layers, num_gpus + nodes))
    step_of = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))  # [T]
    position = _step_positions(tokens, offsets)
    block = max(1, STEP_REACH_PICKS // max(layers * k, 1))
    for a in range(0, tokens, block):
        b = min(tokens, a + block)
        gpus = _replica_gpus(ids[a:b], phy2log, slots, num_experts, rule, position[a:b])  # [t, L, k]
        hit = np.zeros((b - a, layers, num_gpus), dtype=bool)
        hit[np.arange(b - a)[:, None, None], np.arange(layers)[None, :, None], gpus] = True
        if nodes:
            hit = np.concatenate([hit, hit.reshape(b - a, layers, nodes, per_node).any(axis=3)], axis=2)
        steps = step_of[a:b]
        starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
        reached[steps[starts]] += np.add.reduceat(hit.view(np.uint8), starts, axis=0, dtype=np.int64)
    per_step = np.maximum(np.diff(offsets), 1).astype(np.float64)[:, None, None]
    out: F64 = reached / per_step
    return out


def _distinct(a: IntArray) -> IntArray:
    """Distinct values per row of a [..., k] array: [...]."""
    s = np.sort(a, axis=-1)
    out: IntArray = 1 + (np.diff(s, axis=-1) != 0).sum(axis=-1)
    return out


def copies_per_token(
    topk_ids: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    num_experts: int,
    *,
    gpus_per_node: int | None = None,
    rule: str = "vllm",
    step_offsets: ArrayLike | None = None,
) -> CopyStats:
    """Exact mean dispatch copies per token and layer of a placement on token-level routing.

    topk_ids: [tokens, L, k]; phy2log: [L, P]; slots_per_gpu: [G]; gpus_per_node: None = one node;
    step_offsets: [steps + 1] token offsets of the steps in topk_ids (None: one step).
    Each token's picks go to the replicas `rule` chooses; copies = distinct GPUs (nodes) among them. One compiled
    pass over the tokens (eplb/_reach.c)."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 3 or ids.shape[0] == 0:
        raise EplbError(f"topk_ids must be a non-empty [tokens, layers, k] array, got shape {list(ids.shape)}")
    ids, p2l, slots = _routing_inputs(ids, phy2log, slots_per_gpu, num_experts, rule)
    offsets = _offsets(ids.shape[0], step_offsets)
    per_node, _ = _node_split(slots.size, gpus_per_node)
    if ids.shape[2] > MAX_PICKS:
        return _copies_numpy(ids, p2l, slots, num_experts, gpus_per_node=gpus_per_node, rule=rule,
                             step_offsets=offsets)  # fmt: skip
    sums = _route(ids, offsets, p2l, slots, num_experts, rule, per_node, 0, "copies")
    tokens = ids.shape[0]
    return CopyStats(gpus=sums[:, 0] / tokens, remote_gpus=(sums[:, 1] - tokens) / tokens,
                     nodes=sums[:, 2] / tokens, remote_nodes=(sums[:, 3] - tokens) / tokens)  # fmt: skip


def _copies_numpy(
    topk_ids: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    num_experts: int,
    *,
    gpus_per_node: int | None = None,
    rule: str = "vllm",
    step_offsets: ArrayLike | None = None,
) -> CopyStats:
    """`copies_per_token` in numpy: the reference of the compiled loop."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 3 or ids.shape[0] == 0:
        raise EplbError(f"topk_ids must be a non-empty [tokens, layers, k] array, got shape {list(ids.shape)}")
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    position = _step_positions(ids.shape[0], step_offsets)
    gpus = _replica_gpus(ids, phy2log, slots, num_experts, rule, position)  # [T, L, k]
    num_gpus = slots.size
    per_node, _ = _node_split(num_gpus, gpus_per_node)
    source = (position % num_gpus)[:, None, None]
    with_src = np.concatenate([gpus, np.broadcast_to(source, (*gpus.shape[:2], 1))], axis=2)
    n_gpu = _distinct(gpus)
    n_gpu_src = _distinct(with_src)
    nodes = gpus // per_node
    n_node = _distinct(nodes)
    n_node_src = _distinct(with_src // per_node)
    # remote = distinct destinations other than the source: |D ∪ {s}| - 1
    return CopyStats(
        gpus=n_gpu.mean(axis=0),
        remote_gpus=(n_gpu_src - 1).mean(axis=0),
        nodes=n_node.mean(axis=0),
        remote_nodes=(n_node_src - 1).mean(axis=0),
    )


def _narrow(a: IntArray) -> NDArray[np.signedinteger[Any]]:
    """`a` in the smallest of int16, int32 and int64 that holds it (a smaller image, faster to unpack)."""
    for dtype in (np.int16, np.int32):
        info = np.iinfo(dtype)
        if a.size == 0 or (int(a.min()) >= info.min and int(a.max()) <= info.max):
            return a.astype(dtype)
    return a


# --------------------------------------------------------------------------------------------
# The compact summary
# --------------------------------------------------------------------------------------------


def _whole(v: NDArray[Any]) -> bool:
    """Whether v holds integers only: an integer dtype, or Python ints (not bools) too large for one."""
    if v.dtype.kind == "O":
        return all(type(x) is int for x in v.ravel())
    return v.dtype.kind in "iu"


def _refuse_outside(v: NDArray[Any], name: str, low: int, high: int) -> None:
    """EplbError naming v's first entry (by index) outside low .. high; v holds whole numbers (`_whole`), compared
    exactly (Python ints beyond int64 too)."""
    if not v.size:
        return
    outside = np.asarray((v < low) | (v > high), dtype=bool)
    if not outside.any():
        return
    at = np.unravel_index(int(np.argmax(outside)), v.shape)
    where = f"{name}{''.join(f'[{int(i)}]' for i in at)} is {int(v[at])}"
    if name == "partners":
        raise EplbError(f"co-activation summary: {where}: partners must be expert ids in 0..{high} or -1")
    if int(v[at]) < low:
        raise EplbError(f"co-activation summary: {where}: {name} must be >= 0")
    raise EplbError(f"co-activation summary: {where}: out of range, more than any token count (at most {high:.0e})")


def _check_consistent(tokens: IntArray, top_k: int, loads: IntArray, partners: IntArray, counts: IntArray) -> None:
    """EplbError naming the first field that contradicts what the summary's numbers mean (shapes and ranges
    already checked): each token chose at most top_k distinct experts and kept at least one (capacity limits
    may drop picks, and top_k may be the most a token chooses), so a layer's loads sum to between its tokens
    and tokens x top_k, and no expert is picked by more than the tokens; a listed partner is another expert,
    listed once, and the tokens that chose both are at most either one's load; an expert's listed counts sum
    to at most its load x (top_k - 1); an unlisted partner (-1) counts 0. The two experts of a pair may list
    different counts (summaries merged from per-rank top lists give lower bounds)."""
    layers = loads.shape[0]
    where = "co-activation summary:"
    over = loads > tokens[:, None]
    if over.any():
        layer, e = (int(v) for v in np.argwhere(over)[0])
        raise EplbError(f"{where} layer {layer}, expert {e}: load {int(loads[layer, e])} exceeds the layer's "
                        f"{int(tokens[layer])} tokens (a token picks an expert at most once)")
    picks = loads.sum(axis=1, dtype=object)  # exact: loads <= tokens, but E of them may pass int64
    for layer in range(layers):
        if not int(tokens[layer]) <= picks[layer] <= int(tokens[layer]) * top_k:
            raise EplbError(f"{where} layer {layer}: loads sum to {picks[layer]} picks, but {int(tokens[layer])} "
                            f"tokens choose between 1 and top_k {top_k} experts each: "
                            f"{int(tokens[layer])} to {int(tokens[layer]) * top_k} picks")
    num_experts, m = partners.shape[1:]
    flat_p, flat_c, flat_l = partners.reshape(-1), counts.reshape(-1), loads.reshape(-1)
    unlisted = (flat_p < 0) & (flat_c != 0)
    if unlisted.any():
        layer, e = divmod(int(np.argmax(unlisted)) // m, num_experts)
        raise EplbError(f"{where} layer {layer}, expert {e}: counts must be 0 where partners is -1")
    at = np.flatnonzero(flat_p >= 0)  # the listed pairs, flat (layer, expert, rank)
    if at.size == 0:
        return
    row = at // m  # layer x E + expert
    pj, c = flat_p[at], flat_c[at]
    row_j = row - row % num_experts + pj  # the partner's row in the same layer
    bad = np.flatnonzero(row_j == row)
    if bad.size:
        layer, e = divmod(int(row[bad[0]]), num_experts)
        raise EplbError(f"{where} layer {layer}, expert {e} lists itself as a partner")
    bad = np.flatnonzero((c > flat_l[row]) | (c > flat_l[row_j]))
    if bad.size:
        b = int(bad[0])
        (layer, e), j = divmod(int(row[b]), num_experts), int(pj[b])
        raise EplbError(f"{where} layer {layer}: {int(c[b])} tokens chose experts {e} and {j}, more than the load of "
                        f"one of them ({int(loads[layer, e])} and {int(loads[layer, j])})")
    ranked = np.sort(partners, axis=2)
    dup = (ranked[:, :, 1:] == ranked[:, :, :-1]) & (ranked[:, :, 1:] >= 0)
    if dup.any():
        layer, e, rank = (int(v) for v in np.argwhere(dup)[0])
        raise EplbError(f"{where} layer {layer}, expert {e} lists partner {int(ranked[layer, e, rank])} twice")
    total = counts.sum(axis=2, dtype=np.float64)  # listed counts <= load each: a float sum cannot overflow
    most = loads.astype(np.float64) * (top_k - 1)
    over = total > most * (1 + 1e-12)
    if over.any():
        layer, e = (int(v) for v in np.argwhere(over)[0])
        load = int(loads[layer, e])
        raise EplbError(f"{where} layer {layer}, expert {e}: its partners' counts sum to "
                        f"{sum(int(v) for v in counts[layer, e])}, more than its load {load} x (top_k - 1) = "
                        f"{load * (top_k - 1)}")


@dataclass(frozen=True)
class CoactivationSummary:
    """What a cluster sends per window instead of E x E pair counts per layer.

    tokens: [L] tokens routed; top_k: k; loads: [L, E] picks per expert; partners: [L, E, m] each expert's
    m most frequent co-activated experts (most frequent first, -1 where it has fewer); counts: [L, E, m]
    tokens that chose both. Size: L x E x (2m + 1) numbers (m = 8, E = 256: 17 numbers per expert against 256).
    exact: [L, E, E] the exact pair counts when summarized from token-level routing (`summarize`), else None;
    never sent (`to_dict` and `to_bytes` leave it out), `pairs` prefers it to the estimate.
    """

    tokens: IntArray
    top_k: int
    loads: IntArray
    partners: IntArray
    counts: IntArray
    exact: NDArray[np.signedinteger[Any]] | None = field(default=None, compare=False, repr=False)

    @property
    def num_experts(self) -> int:
        return int(self.loads.shape[1])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (lists)."""
        return {
            "format": SUMMARY_FORMAT,
            "tokens": self.tokens.tolist(),
            "top_k": self.top_k,
            "loads": self.loads.tolist(),
            "partners": self.partners.tolist(),
            "counts": self.counts.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CoactivationSummary:
        """Inverse of `to_dict`; EplbError naming the field on bad input, an unknown one included (the API's
        schema refuses them too: a typo'd field is not silently dropped)."""
        unknown = [key for key in d if key not in SUMMARY_FIELDS]
        if unknown:
            raise EplbError(f"co-activation summary: unknown field {unknown[0]!r} (a summary holds "
                            f"{', '.join(SUMMARY_FIELDS)}: docs/formats.md)")
        try:
            return cls._checked(d["tokens"], d["top_k"], d["loads"], d["partners"], d["counts"])
        except KeyError as exc:
            raise EplbError(f"co-activation summary: missing field {exc}") from None

    @classmethod
    def _checked(cls, tokens: Any, top_k: Any, loads: Any, partners: Any, counts: Any) -> CoactivationSummary:
        """The summary of these fields as int64 arrays, or EplbError saying what is wrong."""
        try:
            raw = {"tokens": np.asarray(tokens), "loads": np.asarray(loads), "partners": np.asarray(partners),
                   "counts": np.asarray(counts)}  # fmt: skip
            top = np.asarray(top_k)
        except (TypeError, ValueError, OverflowError):
            raise EplbError("co-activation summary: tokens, loads, partners and counts must be rectangular arrays "
                            "of whole numbers (one row per layer, one per expert)") from None
        for name, v in raw.items():
            if v.size and not _whole(v):
                raise EplbError(f"co-activation summary: {name} must be whole numbers, got {v.dtype}")
        if top.ndim or not _whole(top):
            raise EplbError(f"co-activation summary: top_k must be a whole number, got {top.tolist()!r}")
        for name in ("tokens", "loads", "counts"):
            _refuse_outside(raw[name], name, 0, int(MAX_LOAD))
        loads_shape, p_shape = raw["loads"].shape, raw["partners"].shape
        if len(loads_shape) != 2 or len(p_shape) != 3 or p_shape != raw["counts"].shape or p_shape[:2] != loads_shape:
            raise EplbError("co-activation summary: loads must be [L, E], partners and counts [L, E, m]")
        if raw["tokens"].shape != (loads_shape[0],):
            raise EplbError(f"co-activation summary: tokens must be [{loads_shape[0]}] (one per layer)")
        experts = loads_shape[1]
        if not 1 <= top.item() <= experts:
            raise EplbError(f"co-activation summary: top_k is {top.item()}: top_k must be >= 1 and at most the "
                            f"summary's {experts} experts (a token picks an expert once)")
        _refuse_outside(raw["partners"], "partners", -1, experts - 1)
        k = int(top.item())
        t, l_, p, c = (v.astype(np.int64) for v in raw.values())  # all within int64 now
        _check_consistent(t, k, l_, p, c)
        return cls(t, k, l_, p, c)

    def to_bytes(self) -> bytes:
        """Compact binary form: a compressed .npz image (arrays tokens, top_k, loads, partners, counts; no pickled
        objects), about a quarter of the JSON's size (docs/formats.md)."""
        buffer = io.BytesIO()
        np.savez_compressed(buffer, tokens=self.tokens, top_k=np.int64(self.top_k), loads=_narrow(self.loads),
                            partners=_narrow(self.partners), counts=_narrow(self.counts))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> CoactivationSummary:
        """Inverse of `to_bytes`, checked as `from_dict` (EplbError on anything else, including an archive whose
        arrays would unpack to more than BINARY_MAX bytes)."""
        fields = []
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                if sum(info.file_size for info in archive.infolist()) > BINARY_MAX:
                    raise EplbError(f"co-activation summary: unpacks to more than {BINARY_MAX:,} bytes")
                members = set(archive.namelist())
                arrays = SUMMARY_FIELDS[1:]
                unknown = sorted(members - {f"{name}.npy" for name in arrays})
                if unknown:
                    raise EplbError(f"co-activation summary: unknown array {unknown[0].removesuffix('.npy')!r} (a "
                                    f"summary holds {', '.join(arrays)}: docs/formats.md)")
                for name in arrays:
                    if f"{name}.npy" not in members:
                        raise EplbError(f"co-activation summary: missing array {name!r}")
                    # at most the entry's stated size is unpacked (checked above); the .npy header must then
                    # describe those bytes, or numpy would allocate whatever shape it claims
                    image = archive.read(f"{name}.npy")
                    try:
                        fields.append(read_npy(image))
                    except NpyError as exc:
                        raise EplbError(f"co-activation summary: {name}.npy is {exc}") from None
        except (zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, OSError, ValueError,
                EOFError) as exc:
            raise EplbError(f"co-activation summary: not a .npz image of one ({exc})") from None
        return cls._checked(*fields)

    @classmethod
    def parse(cls, value: dict[str, Any] | str) -> CoactivationSummary:
        """A summary as a request carries it: the JSON object (`to_dict`) or a base64 string of `to_bytes`."""
        if isinstance(value, str):
            try:
                data = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise EplbError("co-activation summary: a string must be base64 of its .npz image") from None
            return cls.from_bytes(data)
        return cls.from_dict(value)

    @classmethod
    def for_window(
        cls, value: dict[str, Any] | str, loads: NDArray[np.float64], field: str = "coactivation"
    ) -> CoactivationSummary:
        """A request's or a deployment window's summary (`parse`), checked against the loads [layers, E] it
        comes with: the one conversion POST /placement and a deployment's window share, so both answer a bad
        summary alike: a FieldError naming `field` ('coactivation: missing array ...', 'coactivation: the
        summary is for 2 layers x 8 experts, the loads are 3 x 8'); one of more expert pairs than the service
        holds (`eplb.rules.pairs_refusal`) before it is read."""
        refused = pairs_refusal(*loads.shape)
        if refused is not None:
            raise FieldError(field, refused)
        try:
            summary = cls.parse(value)
        except EplbError as exc:
            raise FieldError(field, str(exc).removeprefix("co-activation summary: ")) from None
        if summary.loads.shape != loads.shape:
            raise FieldError(field, f"the summary is for {summary.loads.shape[0]} layers x {summary.loads.shape[1]} "
                             f"experts, the loads are {loads.shape[0]} x {loads.shape[1]}")
        why = summary.window_contradiction(loads)
        if why is not None:
            raise FieldError((field, "loads"), why)
        return summary

    def window_contradiction(self, loads: F64) -> str | None:
        """Why this summary cannot be of the load window `loads` [layers, E] (same shape), or None: the one check
        of POST /placement, a deployment's window (`for_window`) and the CLI's --coactivation.

        Both count the same picks per expert (docs/formats.md), but need not be equal: a window may be scaled
        (only its ratios matter to a placement, and the service asks for a large one scaled down) or smoothed,
        an engine's load counter and its top-k recorder may cover a few different steps or count dropped picks
        otherwise, and a summary may be of a sample of the window's tokens. So totals are not compared (nor
        `tokens`: the predictions take tokens per GPU from the config, not the window's sum), and per layer the
        shares are: the total variation distance between the summary's and the window's split of the layer's
        picks over experts, 1/2 sum_e |s_e/n - w_e|, the fraction of picks the summary puts on other experts than
        the window, may be at most `WINDOW_TOLERANCE` (0.2) plus the sampling noise of its n picks,
        1/2 sum_e sqrt(w_e (1 - w_e) / n): n picks drawn from the window's shares w are on average at most that far
        apart (E|X_e - n w_e| <= sqrt(n w_e (1 - w_e)) for each expert's count X_e; at most 1/2 sqrt((E - 1) / n),
        an even split's). Only the summary's n is known: it counts picks, the window may be scaled.

        Without the noise term a small layer's sample was refused: 800 picks over 256 experts are ~0.2 apart from
        sampling alone. Simulated (numpy multinomial draws, `test_sampling_noise_stays_within_the_tolerance`):
        800 picks from an even split of 256 experts are 0.22 apart on average and 0.26 at most of 1,000 draws,
        the tolerance 0.48; from an even split of 64 experts, 0.11 and 0.15 (tolerance 0.34); noise alone never
        exceeded it there, nor at 100 to 50,000 picks from the most even and most skewed layers of the shipped
        windows. The 0.2 stays for what is not random sampling: a summary of a tenth of the law log's tokens (its
        first steps, contiguous) is up to 0.09 apart where its noise term is 0.02 to 0.06. A window whose experts
        are numbered otherwise (reversed, or another window's) still exceeds it on the fixtures, whose summaries
        hold about 50,000 picks per layer or more (noise term below 0.02; tests/test_coactivation_inputs.py
        measures both). Too few picks cannot tell: an even layer of at most (E - 1) / 2.56 picks (the tolerance
        reaches 1) is never refused. A layer with tokens in one and none in the other contradicts too; one empty
        in both is taken."""
        picks = self.loads.astype(np.float64)
        sent, routed = picks.sum(axis=1), loads.sum(axis=1)
        one_sided = np.flatnonzero((sent > 0) != (routed > 0))
        if one_sided.size:
            layer = int(one_sided[0])
            if sent[layer] > 0:
                return (f"layer {layer}: the window routes no token, the summary counts {int(sent[layer]):,} picks "
                        "there: send the summary of the same window")
            return (f"layer {layer}: the summary has no tokens, the window routes {routed[layer]:,.6g} picks there: "
                    "send the summary of the same window")
        both = sent > 0
        share = np.zeros_like(picks)
        window = np.zeros_like(picks)
        share[both] = picks[both] / sent[both, None]
        window[both] = loads[both] / routed[both, None]
        apart = 0.5 * np.abs(share - window).sum(axis=1)
        noise = np.zeros_like(sent)
        noise[both] = 0.5 * np.sqrt(window[both] * (1.0 - window[both])).sum(axis=1) / np.sqrt(sent[both])
        allowed = WINDOW_TOLERANCE + noise
        bad = np.flatnonzero(apart > allowed)
        if bad.size == 0:
            return None
        worst = int(bad[np.argmax(apart[bad])])
        fix = "send the summary of the same window, its experts numbered as the window's"
        if bad.size == 1:
            return (f"layer {worst}: the summary puts {apart[worst]:.0%} of the layer's {int(sent[worst]):,} picks on "
                    f"other experts than the window's loads do (at most {allowed[worst]:.0%} may differ: "
                    f"{WINDOW_TOLERANCE:.0%} plus {noise[worst]:.0%} that drawing them at random may): {fix}")
        return (f"{bad.size} of the {loads.shape[0]} layers: the summary puts more than {WINDOW_TOLERANCE:.0%} of a "
                f"layer's picks, beyond what drawing them at random may, on other experts than the window's loads do "
                f"(layer {worst}: {apart[worst]:.0%} of {int(sent[worst]):,} picks, at most {allowed[worst]:.0%}): "
                f"{fix}")

    def layers(self, count: int) -> CoactivationSummary:
        """The summary of the first `count` layers."""
        return CoactivationSummary(self.tokens[:count], self.top_k, self.loads[:count], self.partners[:count],
                                   self.counts[:count], None if self.exact is None else self.exact[:count])

    def pairs(self) -> F64:
        """Pair counts [L, E, E] (zero diagonal) for the co-activation-aware solver (`Problem.coactivation`): the
        exact counts of the tokens this summary was made from when it holds them, else `pair_estimate`."""
        if self.exact is None:
            return self.pair_estimate()
        out = self.exact.astype(np.float64)
        idx = np.arange(out.shape[1])
        out[:, idx, idx] = 0.0
        return out

    @cached_property
    def pick_terms(self) -> tuple[F64, F64]:
        """(p [L, E] chance a token picks each expert, excess [L, E, E] co-activation beyond independent picks:
        c_ij / tokens - p_i p_j), computed once per summary for `reach`."""
        tokens = np.maximum(self.tokens.astype(np.float64), 1.0)[:, None]
        p = np.minimum(self.loads / tokens, 1.0)
        excess: F64 = self.pair_estimate() / tokens[:, :, None] - p[:, :, None] * p[:, None, :]
        return p, excess

    def pair_estimate(self) -> F64:
        """Estimated pair counts [L, E, E] (zero diagonal, symmetric): listed pairs as listed (the larger of the
        two listings when both experts list the pair: merged lists give lower bounds); each expert's unlisted
        pair mass (load x (picks per token - 1) minus its listed counts, picks per token = the layer's loads
        over its tokens, at most top_k) spread over its unlisted partners in proportion to their loads; the two
        directions' estimates of an unlisted pair averaged."""
        layers, num_experts = self.loads.shape
        est = np.zeros((layers, num_experts, num_experts))
        listed = np.zeros((layers, num_experts, num_experts), dtype=bool)
        li, ei, mi = np.nonzero(self.partners >= 0)
        pj = self.partners[li, ei, mi]
        listed[li, ei, pj] = True
        listed[li, pj, ei] = True
        exact = np.zeros_like(est)
        counts = self.counts[li, ei, mi].astype(np.float64)
        np.maximum.at(exact, (li, ei, pj), counts)
        np.maximum.at(exact, (li, pj, ei), counts)
        loads = self.loads.astype(np.float64)
        listed_sum = np.where(listed, exact, 0.0).sum(axis=2)
        picks = loads.sum(axis=1) / np.maximum(self.tokens.astype(np.float64), 1.0)  # [L]: top_k, less with drops
        rest = np.maximum(loads * (np.minimum(picks, self.top_k) - 1)[:, None] - listed_sum, 0.0)  # [L, E]
        eye = np.eye(num_experts, dtype=bool)[None]
        weight = np.where(listed | eye, 0.0, loads[:, None, :])
        denom = weight.sum(axis=2, keepdims=True)
        spread = np.divide(rest[:, :, None] * weight, denom, out=np.zeros_like(est), where=denom > 0)
        est = np.where(listed, exact, (spread + spread.transpose(0, 2, 1)) / 2)
        est[:, eye[0]] = 0.0
        return est


def summarize(topk_ids: ArrayLike, num_experts: int, partners: int = 8) -> CoactivationSummary:
    """The compact summary of token-level routing topk_ids [tokens, L, k]: top-`partners` per expert. EplbError
    naming the first pick no token makes (an id outside 0 .. num_experts - 1, an expert twice in one top-k)."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise EplbError(f"topk_ids must be [tokens, layers, k], got shape {list(ids.shape)}")
    if ids.size and ids.dtype.kind not in "iu":
        raise EplbError(f"topk_ids must hold integer expert ids, got {ids.dtype}")
    outside = (ids < 0) | (ids >= num_experts)
    if outside.any():
        token, layer, rank = (int(v) for v in np.argwhere(outside)[0])
        raise EplbError(f"topk_ids: token {token}, layer {layer}: expert id {int(ids[token, layer, rank])} is outside "
                        f"0..{num_experts - 1}")
    ranked = np.sort(ids, axis=2)
    twice = (ranked[:, :, 1:] == ranked[:, :, :-1]).any(axis=2)
    if twice.any():
        token, layer = (int(v) for v in np.argwhere(twice)[0])
        raise EplbError(f"topk_ids: token {token}, layer {layer}: top-k {ids[token, layer].tolist()} names an expert "
                        "twice; a token picks k distinct experts")
    return _summarize(ids, num_experts, partners)


def _summarize(ids: NDArray[np.integer[Any]], num_experts: int, partners: int) -> CoactivationSummary:
    """`summarize` of checked picks ids [tokens, L, k] (a token-level log's, checked when read)."""
    if partners < 1:
        raise EplbError(f"partners must be >= 1, got {partners}")
    pairs = pair_counts(ids, num_experts)
    idx = np.arange(num_experts)
    loads = pairs[:, idx, idx].copy()
    off = pairs.copy()
    off[:, idx, idx] = -1
    m = min(partners, num_experts - 1)
    top = np.argsort(-off, axis=2, kind="stable")[:, :, :m]
    cnt = np.take_along_axis(off, top, axis=2)
    top = np.where(cnt > 0, top, -1)
    cnt = np.maximum(cnt, 0)
    tokens = np.full(ids.shape[1], ids.shape[0], dtype=np.int64)
    return CoactivationSummary(tokens, int(ids.shape[2]), loads, top.astype(np.int64), cnt.astype(np.int64),
                               exact=_narrow(pairs))


def _replica_fraction(phy2log: IntArray, slots: IntArray, num_experts: int) -> F64:
    """[L, E, G] fraction of each expert's replicas on each GPU (uniform shares; empty slots hold none)."""
    layers, num_gpus = phy2log.shape[0], slots.size
    gpu = _gpu_of_slot(slots)
    ok = phy2log >= 0
    layer = np.broadcast_to(np.arange(layers, dtype=np.int64)[:, None], phy2log.shape)
    flat = (layer * num_experts + phy2log) * num_gpus + gpu[None, :]
    frac = np.bincount(flat[ok], minlength=layers * num_experts * num_gpus).astype(np.float64)
    frac = frac.reshape(layers, num_experts, num_gpus)
    total = frac.sum(axis=2, keepdims=True)
    out: F64 = np.divide(frac, total, out=np.zeros_like(frac), where=total > 0)
    return out


@dataclass(frozen=True)
class Reach:
    """Chance that a token's top-k reaches each GPU and each node, per layer (uniform replica choice).

    gpu: [L, G]; node: [L, N]. Their sums over the last axis are the expected distinct GPUs and nodes per
    token; a token from GPU s sends to every reached GPU but s, so the expected remote GPUs per token (over
    source GPUs) is gpu.sum x (1 - 1/G), and likewise for nodes."""

    gpu: F64
    node: F64

    def copies(self) -> dict[str, F64]:
        """Expected copies per token [L] each: gpus, remote_gpus, nodes, remote_nodes (`CopyStats`' names)."""
        g, n = self.gpu.sum(axis=1), self.node.sum(axis=1)
        return {
            "gpus": g,
            "remote_gpus": g * (1.0 - 1.0 / self.gpu.shape[1]),
            "nodes": n,
            "remote_nodes": n * (1.0 - 1.0 / self.node.shape[1]),
        }


def reach(
    summary: CoactivationSummary,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    gpus_per_node: int | None = None,
    node_limit: int | None = None,
) -> Reach:
    """Expected reach of a token on each GPU and node from the summary (uniform replica choice).

    Per GPU (node) g, with p_e = load_e / tokens and f_eg the fraction of e's replicas on g:
    P(token reaches g) = 1 - prod_e (1 - f_eg p_e) x exp(sum_{i<j} f_ig f_jg (c_ij / tokens - p_i p_j)):
    independent picks corrected by the pairs' excess co-activation (c_ij from `pair_estimate`), then held
    within what the picks' first two moments allow: with m = sum_e f_eg p_e the token's expected picks on g
    and s = sum_{i != j} f_ig f_jg c_ij / tokens its expected ordered pairs there, max(m / k, m^2 / (m + s))
    <= P <= m - s / k (a token reaching g puts 1 to k picks there; the second lower bound is Cauchy-Schwarz).
    The bounds meet when every token that reaches g puts the same number of picks there (a GPU or node that
    holds every expert: 1; experts always chosen together on one GPU: their pick chance; experts never
    chosen together: the sum of their chances), where the product form is not exact.
    node_limit: DeepSeek-style node-limited routing (a token's experts lie on at most M nodes); where the
    expected nodes per token exceed M, every GPU's and node's reach is scaled down to M nodes.
    phy2log: [L, P] (-1 = empty slot); slots_per_gpu: [G]."""
    p2l = np.asarray(phy2log, dtype=np.int64)
    if p2l.ndim == 1:
        p2l = p2l[None, :]
    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    if p2l.shape[0] != summary.loads.shape[0]:
        raise EplbError(f"phy2log has {p2l.shape[0]} layers but the co-activation summary has {summary.loads.shape[0]}")
    if p2l.shape[1] != int(slots.sum()):
        raise EplbError(f"slots_per_gpu sums to {int(slots.sum())} but phy2log has {p2l.shape[1]} slots")
    per_node = gpus_per_node or slots.size
    if slots.size % per_node:
        raise EplbError(f"{slots.size} GPUs do not split into nodes of {per_node}")
    if node_limit is not None and node_limit < 1:
        raise EplbError(f"node limit must be >= 1, got {node_limit}")
    frac = _replica_fraction(p2l, slots, summary.num_experts)  # [L, E, G]
    node_frac = frac.reshape(frac.shape[0], frac.shape[1], -1, per_node).sum(axis=3)
    p, excess = summary.pick_terms

    top_k = float(summary.top_k)

    def reached(f: F64) -> F64:
        log_none = np.log1p(-np.minimum(f * p[:, :, None], 1 - 1e-12)).sum(axis=1)  # [L, G]
        pair = (f * np.matmul(excess, f)).sum(axis=1) / 2  # sum_ij f_ig excess_ij f_jg / 2
        picks = (f * p[:, :, None]).sum(axis=1)  # [L, G] m: expected picks on g
        pairs = 2 * pair + picks * picks  # s: sum_{i != j} f_i f_j c_ij / tokens (excess_ii = -p_i^2)
        second = np.divide(picks * picks, picks + pairs, out=np.zeros_like(picks), where=picks + pairs > 0)
        low = np.minimum(np.maximum(picks / top_k, second), 1.0)
        high = np.maximum(np.minimum(picks - pairs / top_k, 1.0), low)
        out: F64 = np.clip(1.0 - np.exp(log_none + pair), low, high)
        return out

    gpu, node = reached(frac), reached(node_frac)
    if node_limit is not None:
        scale = np.minimum(1.0, node_limit / np.maximum(node.sum(axis=1, keepdims=True), 1e-12))
        gpu, node = gpu * scale, node * scale
    return Reach(gpu, node)


def approx_copies_per_token(
    summary: CoactivationSummary, phy2log: ArrayLike, slots_per_gpu: ArrayLike, gpus_per_node: int | None = None
) -> tuple[F64, F64]:
    """Expected distinct GPUs and nodes per token [L] each, from the summary (`reach`)."""
    r = reach(summary, phy2log, slots_per_gpu, gpus_per_node)
    return r.gpu.sum(axis=1), r.node.sum(axis=1)


def partner_lift(topk_ids: ArrayLike, num_experts: int, partners: int | None = None) -> float:
    """How strongly experts are chosen together: for each expert, the tokens shared with its `partners`
    most frequent partners (default E / 8) over what independent picks with the same loads would share
    (load_i (k - 1) load_j / (total - load_i) per pair); load-weighted over experts, median over layers.
    1.0 for independent picks; DeepSeek-V2-Lite's ESFT logs give 1.90 to 2.59 (docs/cost-model.md).
    topk_ids: [tokens, layers, k]."""
    ids = np.asarray(topk_ids)
    m = partners or max(1, num_experts // 8)
    s = summarize(ids, num_experts, m)
    loads = s.loads.astype(np.float64)
    total = loads.sum(axis=1, keepdims=True)
    flat = np.maximum(s.partners, 0).reshape(loads.shape[0], -1)
    partner_load = np.take_along_axis(loads, flat, axis=1).reshape(s.partners.shape) * (s.partners >= 0)
    rest = np.maximum(total - loads, 1.0)
    expected = loads * (s.top_k - 1) * partner_load.sum(axis=2) / rest
    ratio = np.divide(s.counts.sum(axis=2), expected, out=np.ones_like(expected), where=expected > 0)
    weighted = (ratio * loads).sum(axis=1) / np.maximum(total[:, 0], 1.0)
    return float(np.median(weighted))
