"""What a placement costs on given loads: the one placement-aware time model.

`TimeModel` holds the constants of one (model, hardware, link, tokens, overlap, dedup) setup and turns
per-GPU routed rows and active slots into per-GPU and per-layer times. `predict` (a load window, the
API's and `eplb solve`'s numbers) and replay (every step of a log) both call it, so they agree by
construction. Formulas: docs/cost-model.md ("Placement-aware prediction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb.cost.uniform import IDLE, TERMS
from eplb.errors import EplbError
from eplb.specs import HardwareSpec, ModelSpec

__all__ = ["LayerPrediction", "TimeModel", "combine_terms", "predict"]

_US = 1e6  # seconds -> microseconds
F64 = NDArray[np.float64]


@dataclass(frozen=True)
class TimeModel:
    """The constants of the per-GPU layer time for G GPUs.

    us_per_row: compute µs per routed or shared row; expert_read_us / shared_read_us: µs to read one
    routed expert's / all shared experts' weights; comm_us_per_copy: µs per token copy (dispatch +
    combine); tokens_per_gpu: T of one step, None to take the loads as one step; overlap: comm hidden
    under the GEMMs (max of the terms) or added; dedup: a token goes once to each GPU holding any of
    its k experts. nic_us_per_copy with gpus_per_node (two links, DeepEP's dispatch): a token crosses the NIC
    once to each other node it reaches and is forwarded over NVLink (comm_us_per_copy) to the GPUs it reaches
    there (`_two_link_comm`); copies are then always one per reached GPU and node, whatever `dedup` says.
    """

    gpus: int
    top_k: int
    shared: int
    us_per_row: float
    expert_read_us: float
    shared_read_us: float
    comm_us_per_copy: float
    tokens_per_gpu: float | None = None
    overlap: bool = True
    dedup: bool = False
    gpus_per_node: int | None = None
    nic_us_per_copy: float | None = None

    @classmethod
    def from_specs(
        cls,
        model: ModelSpec,
        hw: HardwareSpec,
        link_bw: float,
        gpus: int,
        tokens_per_gpu: float | None = None,
        overlap: bool = True,
        dedup: bool = False,
        inter_node_bw: float | None = None,
        gpus_per_node: int | None = None,
    ) -> TimeModel:
        """link_bw: all-to-all B/s per GPU and direction (within a node when inter_node_bw is given: the NIC's
        B/s per GPU and direction between nodes of gpus_per_node GPUs); tokens_per_gpu > 0 or None."""
        bytes_per_copy = model.dispatch_bytes_per_copy + model.combine_bytes_per_copy
        for bw in (link_bw, inter_node_bw):
            if bw is not None and (not math.isfinite(bw) or bw <= 0):
                raise EplbError(f"link bandwidth must be positive (B/s), got {bw!r}")
        if tokens_per_gpu is not None and not (math.isfinite(tokens_per_gpu) and tokens_per_gpu > 0):
            raise EplbError(f"tokens per GPU must be a positive number, got {tokens_per_gpu!r}")
        nic_us = None
        if inter_node_bw is not None:
            cls.check_nodes(gpus, gpus_per_node)
            nic_us = bytes_per_copy / inter_node_bw * _US
        return cls(
            gpus=gpus,
            top_k=model.top_k,
            shared=model.num_shared_experts,
            us_per_row=model.flops_per_row / hw.dense_flops * _US,
            expert_read_us=model.expert_bytes / hw.hbm_bandwidth * _US,
            shared_read_us=model.shared_expert_bytes / hw.hbm_bandwidth * _US,
            comm_us_per_copy=bytes_per_copy / link_bw * _US,
            tokens_per_gpu=tokens_per_gpu,
            overlap=overlap,
            dedup=dedup,
            gpus_per_node=gpus_per_node if nic_us is not None else None,
            nic_us_per_copy=nic_us,
        )

    @staticmethod
    def check_nodes(gpus: int, gpus_per_node: int | None) -> None:
        """Two links (within and between nodes) need the GPUs per node and more than one node: EplbError."""
        if gpus_per_node is None or gpus_per_node < 1 or gpus_per_node >= gpus or gpus % gpus_per_node:
            raise EplbError(
                f"a link within and one between nodes (a '+' link) needs the GPUs per node (--gpus-per-node; "
                f"gpus_per_node in the API and deployments) and more than one node: {gpus} GPUs, "
                f"{gpus_per_node or 'no'} GPUs per node"
            )

    @property
    def reach_width(self) -> int:
        """Width of the reach array `gpu_terms` takes: G, or G + N (GPUs then nodes) with two links."""
        if self.nic_us_per_copy is None or self.gpus_per_node is None:
            return self.gpus
        return self.gpus + self.gpus // self.gpus_per_node

    @property
    def extremes_suffice(self) -> bool:
        """True when the layer time depends only on the busiest and idlest GPU's rows and the most
        active slots (comm overlapped, no dedup): see `layer_time_from_extremes`."""
        return self.overlap and not self.dedup and self.nic_us_per_copy is None

    def tokens(self, total: F64) -> F64:
        """T tokens per GPU of one step, shaped like total (the layer's routed rows of the window): tokens_per_gpu,
        or total / (G k) when it is None. A layer without tokens (total 0) has T = 0 either way: nothing to dispatch,
        compute or read, so every term, and its time, is 0 (no fixed latency is modelled)."""
        if self.tokens_per_gpu is None:
            return total / (self.gpus * self.top_k)
        return np.where(total > 0, self.tokens_per_gpu, 0.0)

    def step_rows(self, rows: NDArray[Any], total: F64) -> F64:
        """The window's rows [..., G] as rows of one step: rows / total x G T k (the layer's routed rows G T k), 0 on a
        layer without tokens; rows as they are when tokens_per_gpu is None. Divided first: rows <= total, so a window
        of any scale is finite (the factor G T k / total of a subnormal total, 1e-320, is above the largest float)."""
        if self.tokens_per_gpu is None:
            return np.asarray(rows, dtype=np.float64)
        share = np.divide(rows, total, out=np.zeros(np.broadcast_shapes(np.shape(rows), np.shape(total))),
                          where=total > 0)
        out: F64 = share * (self.gpus * self.tokens_per_gpu * self.top_k)
        return out

    def gpu_terms(
        self, total: F64, rows: NDArray[Any], active: NDArray[Any], reach: NDArray[Any] | None = None
    ) -> tuple[F64, F64, F64]:
        """(compute, weight_read, comm) µs per GPU from the GPUs' routed rows and active slots
        [..., G] (GPU last) and the layer's total rows [..., 1]. reach: [..., G] chance that a token's
        top-k reaches each GPU (co-activation data, `eplb.coactivation.reach`), with two links [..., G + N]:
        each GPU's, then each node's; with it a token is sent once to each GPU it reaches, whatever `dedup`
        says."""
        tokens, busy = self.tokens(total), total > 0
        g, k = self.gpus, self.top_k
        r = self.step_rows(rows, total)
        compute = (r + self.shared * tokens) * self.us_per_row
        weight = self._weight_read(busy, active)
        if self.nic_us_per_copy is not None:
            return compute, weight, self._two_link_comm(tokens, busy, r, reach)
        if reach is not None:
            q = np.where(busy, reach, 0.0)
            received = (g - 1) * tokens * q
            sent = tokens * (q.sum(axis=-1, keepdims=True) - q)
        elif self.dedup:
            frac = np.divide(r, g * k * tokens, out=np.zeros(r.shape), where=tokens > 0)
            q = 1.0 - (1.0 - frac) ** k  # chance a token has >= 1 of its experts on that GPU
            received = (g - 1) * tokens * q
            sent = tokens * (q.sum(axis=-1, keepdims=True) - q)
        else:
            received = r * (1.0 - 1.0 / g)
            sent = k * tokens - r / g
        comm = np.maximum(sent, received) * self.comm_us_per_copy
        return compute, weight, comm

    def _two_link_comm(self, tokens: F64, busy: NDArray[np.bool_], r: F64, reach: NDArray[Any] | None) -> F64:
        """µs per GPU of DeepEP's dispatch and combine over two links, every GPU's T tokens routing like the
        layer. With q_g a token's chance to reach GPU g and Q_v node v (from `reach`, else from independent
        picks of the rows), N nodes of n GPUs, GPU g on node v:
        NIC: sends T (sum Q - Q_v) (once to each other node reached, to the GPU with its own index there) and
        receives (N - 1) T Q_v (from its own index on each other node); NVLink: sends N T (sum_{h in v} q_h - q_g)
        (its own tokens, and those it received over the NIC, to the other GPUs they reach on its node) and
        receives N (n - 1) T q_g. The two links run at once: comm = max of the two links' max(sent, received)
        x their µs per copy. One node (N = 1) gives the one-link reach terms."""
        assert self.gpus_per_node is not None and self.nic_us_per_copy is not None
        g, n, k = self.gpus, self.gpus_per_node, self.top_k
        nodes = g // n
        if reach is None:
            frac = np.divide(r, g * k * tokens, out=np.zeros(r.shape), where=tokens > 0)
            node_frac = frac.reshape(*frac.shape[:-1], nodes, n).sum(axis=-1)
            q, big_q = 1.0 - (1.0 - frac) ** k, 1.0 - (1.0 - node_frac) ** k
        else:
            if reach.shape[-1] != g + nodes:
                raise ValueError(f"two links need reach [..., {g} GPUs + {nodes} nodes], got {reach.shape}")
            both = np.where(busy, reach, 0.0)
            q, big_q = both[..., :g], both[..., g:]
        on_node = q.reshape(*q.shape[:-1], nodes, n)
        others_on_node = (on_node.sum(axis=-1, keepdims=True) - on_node).reshape(q.shape)
        own_node = np.repeat(big_q, n, axis=-1)  # [..., G] Q of each GPU's node
        nic = np.maximum(tokens * (big_q.sum(axis=-1, keepdims=True) - own_node), (nodes - 1) * tokens * own_node)
        nvlink = np.maximum(nodes * tokens * others_on_node, nodes * (n - 1) * tokens * q)
        out: F64 = np.maximum(nic * self.nic_us_per_copy, nvlink * self.comm_us_per_copy)
        return out

    def _weight_read(self, busy: NDArray[np.bool_], active: NDArray[Any]) -> F64:
        """µs to read the active routed experts' and the shared experts' weights (none where busy is False: a layer
        without tokens)."""
        routed = np.where(busy, active, 0.0) * self.expert_read_us
        out: F64 = routed + np.where(busy, self.shared_read_us, 0.0)
        return out

    def gpu_time(self, compute: F64, weight: F64, comm: F64) -> F64:
        """Per-GPU layer time µs from its three terms (`combine_terms`)."""
        return combine_terms(compute, weight, comm, self.overlap)

    def layer_time(
        self, total: F64, rows: NDArray[Any], active: NDArray[Any], reach: NDArray[Any] | None = None
    ) -> F64:
        """Layer time µs (slowest GPU) [...] from rows and active slots [..., G] and total [..., 1]
        (reach: as in `gpu_terms`)."""
        out: F64 = self.gpu_time(*self.gpu_terms(total, rows, active, reach)).max(axis=-1)
        return out

    def layer_time_from_extremes(self, total: F64, rmax: NDArray[Any], rmin: NDArray[Any], amax: NDArray[Any]) -> F64:
        """`layer_time` from the busiest and idlest GPU's rows and the most active slots (all shaped
        like total). Exact when `extremes_suffice`: the max over GPUs of max(compute, weight, comm) is
        the max of the three maxima; compute and received copies grow with a GPU's rows, sent copies
        shrink with them."""
        if not self.extremes_suffice:
            raise ValueError("layer_time_from_extremes needs overlap and no dedup")
        tokens = self.tokens(total)
        g, k = self.gpus, self.top_k
        hi, lo = self.step_rows(rmax, total), self.step_rows(rmin, total)
        compute = (hi + self.shared * tokens) * self.us_per_row
        weight = self._weight_read(total > 0, amax)
        copies = np.maximum(k * tokens - lo / g, hi * (1.0 - 1.0 / g))
        out: F64 = np.maximum(np.maximum(compute, weight), copies * self.comm_us_per_copy)
        return out


def combine_terms(compute: F64, weight: F64, comm: F64, overlap: bool) -> F64:
    """A GPU's layer time µs from its terms (same shapes): the GEMMs wait for the larger of compute and weight
    reads; the all-to-all overlaps them (two micro-batches) or follows them."""
    gemm = np.maximum(compute, weight)
    out: F64 = np.maximum(gemm, comm) if overlap else gemm + comm
    return out


@dataclass(frozen=True)
class LayerPrediction:
    """Predicted per-layer MoE time of a placement. L = layers, G = GPUs; times in µs.

    Per layer, the time is the slowest GPU's; `compute_us`, `weight_read_us`, `comm_us` and
    `bottleneck` are that GPU's (`IDLE` for a layer without tokens, whose terms are all 0). Per-GPU arrays
    keep the full picture.
    """

    time_us: F64  # [L]
    compute_us: F64  # [L], slowest GPU
    weight_read_us: F64  # [L], slowest GPU
    comm_us: F64  # [L], slowest GPU
    bottleneck: list[str]  # [L], slowest GPU's largest term; "idle" for a layer without tokens (every term 0)
    slowest_gpu: NDArray[np.int64]  # [L]
    gpu_time_us: F64  # [L, G]
    gpu_compute_us: F64  # [L, G]
    gpu_weight_read_us: F64  # [L, G]
    gpu_comm_us: F64  # [L, G]
    gpu_rows: F64  # [L, G] routed rows per GPU in one step (shared rows excluded)
    active_slots: NDArray[np.int64]  # [L, G] slots that receive > 0 tokens (their weights are read)
    tokens_per_gpu: F64  # [L] T used per layer
    lb: F64  # [L] max / mean routed rows per GPU (1.0 = balanced)
    overlap: bool

    @property
    def total_time_us(self) -> float:
        """Sum of per-layer times: the MoE time of one step, µs."""
        return float(self.time_us.sum())

    def to_dict(self, per_gpu: bool = False) -> dict[str, Any]:
        """JSON-ready dict of the per-layer arrays (per-GPU arrays too when `per_gpu`)."""
        d: dict[str, Any] = {
            "time_us": self.time_us.tolist(),
            "compute_us": self.compute_us.tolist(),
            "weight_read_us": self.weight_read_us.tolist(),
            "comm_us": self.comm_us.tolist(),
            "bottleneck": list(self.bottleneck),
            "slowest_gpu": self.slowest_gpu.tolist(),
            "tokens_per_gpu": self.tokens_per_gpu.tolist(),
            "lb": self.lb.tolist(),
            "total_time_us": self.total_time_us,
            "overlap": self.overlap,
        }
        if per_gpu:
            d["gpu_time_us"] = self.gpu_time_us.tolist()
            d["gpu_compute_us"] = self.gpu_compute_us.tolist()
            d["gpu_weight_read_us"] = self.gpu_weight_read_us.tolist()
            d["gpu_comm_us"] = self.gpu_comm_us.tolist()
        return d


def _as_2d(name: str, a: ArrayLike, dtype: type[Any]) -> NDArray[Any]:
    try:
        arr = np.asarray(a, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise EplbError(f"{name} must be a numeric array: {exc}") from exc
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise EplbError(f"{name} must be 2-D [layers, ...], got shape {arr.shape}")
    return arr


def _checked_inputs(
    loads: ArrayLike, phy2log: ArrayLike, slots_per_gpu: ArrayLike, model: ModelSpec, shares: ArrayLike | None
) -> tuple[F64, NDArray[np.int64], NDArray[np.int64], F64]:
    """(loads [L, E], phy2log [L, P], slots [G], slot shares [L, P]) checked; EplbError otherwise."""
    load = _as_2d("loads", loads, np.float64)
    p2l = np.asarray(phy2log)
    if p2l.ndim == 1:
        p2l = p2l[None, :]
    if p2l.ndim != 2 or p2l.dtype.kind not in "iu":
        raise EplbError(f"phy2log must be a 2-D integer array [layers, slots], got {p2l.dtype} {p2l.shape}")
    p2l = p2l.astype(np.int64, copy=False)
    slots = np.asarray(slots_per_gpu)
    if slots.ndim != 1 or slots.size == 0 or not np.issubdtype(slots.dtype, np.integer):
        raise EplbError("slots_per_gpu must be a non-empty 1-D integer array [G]")
    if (slots < 0).any():
        raise EplbError("slots_per_gpu must not be negative")
    num_layers, num_experts = load.shape
    if p2l.shape[0] != num_layers:
        raise EplbError(f"phy2log has {p2l.shape[0]} layers but loads has {num_layers}")
    if int(slots.sum()) != p2l.shape[1]:
        raise EplbError(f"slots_per_gpu sums to {int(slots.sum())} but phy2log has {p2l.shape[1]} slots")
    if num_experts != model.num_experts:
        raise EplbError(f"loads have {num_experts} experts but model {model.name!r} has {model.num_experts}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise EplbError("loads must be finite and non-negative")
    if p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
        raise EplbError(f"phy2log entries must be expert ids in [0, {num_experts})")
    flat = (p2l + (np.arange(num_layers, dtype=np.int64) * num_experts)[:, None]).ravel()
    replicas = np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    orphan = (replicas == 0) & (load > 0)
    if orphan.any():
        layer, expert = np.argwhere(orphan)[0]
        raise EplbError(f"layer {layer}: expert {expert} has load but no slot in phy2log")
    if shares is None:
        return load, p2l, slots.astype(np.int64), 1.0 / np.take_along_axis(replicas, p2l, axis=1)
    share = _as_2d("shares", shares, np.float64)
    if share.shape != p2l.shape:
        raise EplbError(f"shares shape {share.shape} must match phy2log shape {p2l.shape}")
    if not np.isfinite(share).all() or (share < 0).any():
        raise EplbError("shares must be finite and non-negative")
    sums = np.bincount(flat, weights=share.ravel(), minlength=num_layers * num_experts).reshape(replicas.shape)
    bad = (replicas > 0) & (np.abs(sums - 1.0) > 1e-6)
    if bad.any():
        layer, expert = np.argwhere(bad)[0]
        raise EplbError(f"layer {layer}: shares of expert {expert}'s replicas sum to {sums[layer, expert]:.6g}, not 1")
    return load, p2l, slots.astype(np.int64), share


def predict(
    loads: ArrayLike,
    phy2log: ArrayLike,
    slots_per_gpu: ArrayLike,
    model: ModelSpec,
    hw: HardwareSpec,
    link_bw: float,
    tokens_per_gpu: float | None = None,
    shares: ArrayLike | None = None,
    overlap: bool = True,
    dedup: bool = False,
    reach: ArrayLike | None = None,
    inter_node_bw: float | None = None,
    gpus_per_node: int | None = None,
) -> LayerPrediction:
    """Predict per-layer MoE time of a placement for a window of loads (vectorized over L, G).

    loads: [L, E] token-expert assignments per logical expert over the window (>= 0).
    phy2log: [L, P] int; slot s holds logical expert phy2log[l, s]; slots are numbered GPU by
        GPU, GPU g owning the next slots_per_gpu[g] slots. slots_per_gpu: [G] int, sum = P.
    tokens_per_gpu: T of one step; each layer's loads are scaled so the layer's routed rows are
        G x T x k (a window of any scale, subnormal 1e-320 too, costs what its ratios do). None: the window
        is taken as one step, T_l = sum(loads[l]) / (G x k). A layer without tokens has T_l = 0 either way,
        time 0 and bottleneck "idle".
    shares: [L, P] fraction of its expert's tokens each slot serves (per expert summing to 1);
        None = 1 / replicas, as vLLM/SGLang/DeepSeek route.
    overlap: True, comm overlaps the GEMMs (two micro-batches): GPU time = max(compute,
        weight_read, comm); False: max(compute, weight_read) + comm.
    dedup: per-GPU dedup of token copies (see docs/cost-model.md for the approximation).
    reach: [L, G] chance that a token reaches each GPU, from co-activation data (`eplb.coactivation.reach`):
        comm then counts one copy per reached GPU (co-activated experts on one GPU share a copy); with two
        links [L, G + N], each GPU's then each node's.
    inter_node_bw, gpus_per_node: two links (DeepEP's dispatch): copies between nodes of gpus_per_node GPUs
        cross the NIC at inter_node_bw B/s once per reached node, copies within a node link_bw
        (`TimeModel._two_link_comm`).

    Per GPU (`TimeModel.gpu_terms`): routed rows = sum of its slots' rows; compute = (rows + shared x
    T) x 2 x params / flops; weight read = (slots with > 0 rows) x expert_bytes + shared bytes; comm
    assumes every GPU's tokens route like the layer as a whole, so GPU g receives rows_g (1 - 1/G)
    copies and sends T k - rows_g / G; its comm time is max(sent, received) x (dispatch + combine
    bytes) / link_bw.
    """
    load, p2l, slots, share = _checked_inputs(loads, phy2log, slots_per_gpu, model, shares)
    if tokens_per_gpu is not None:  # only the ratios matter: each layer scaled exactly to a largest load in [0.5, 1)
        load = np.ldexp(load, -np.frexp(load.max(axis=1, keepdims=True))[1])
    num_layers, num_gpus = load.shape[0], slots.size
    tm = TimeModel.from_specs(model, hw, link_bw, num_gpus, tokens_per_gpu, overlap, dedup, inter_node_bw,
                              gpus_per_node)  # fmt: skip
    slot_rows = np.take_along_axis(load, p2l, axis=1) * share  # [L, P] tokens of the window
    gpu_of_slot = np.repeat(np.arange(num_gpus, dtype=np.int64), slots)
    g_flat = (gpu_of_slot[None, :] + (np.arange(num_layers, dtype=np.int64) * num_gpus)[:, None]).ravel()
    lg = num_layers * num_gpus
    window_rows = np.bincount(g_flat, weights=slot_rows.ravel(), minlength=lg).reshape(num_layers, num_gpus)
    active = np.bincount(g_flat, weights=(slot_rows > 0).ravel(), minlength=lg).reshape(num_layers, num_gpus)
    total = load.sum(axis=1)[:, None]
    q = None
    if reach is not None:
        q = np.asarray(reach, dtype=np.float64)
        if q.shape != (num_layers, tm.reach_width):
            what = f"{num_gpus} GPUs" + ("" if tm.reach_width == num_gpus else f" + {tm.reach_width - num_gpus} nodes")
            raise EplbError(f"reach must be [{num_layers} layers, {what}], got shape {list(q.shape)}")
    compute, weight, comm = tm.gpu_terms(total, window_rows, active, q)
    gpu_time = tm.gpu_time(compute, weight, comm)
    tokens = tm.tokens(total)
    slowest = np.argmax(gpu_time, axis=1)
    pick = slowest[:, None]
    c_s, w_s, m_s = (np.take_along_axis(a, pick, axis=1)[:, 0] for a in (compute, weight, comm))
    codes = np.argmax(np.stack([c_s, w_s, m_s]), axis=0)
    busy_layers = (total[:, 0] > 0).tolist()  # [L] a layer without tokens has no bottleneck: IDLE
    mean_rows = window_rows.mean(axis=1)
    lb = np.divide(window_rows.max(axis=1), mean_rows, out=np.ones(num_layers), where=mean_rows > 0)
    return LayerPrediction(
        time_us=np.take_along_axis(gpu_time, pick, axis=1)[:, 0],
        compute_us=c_s,
        weight_read_us=w_s,
        comm_us=m_s,
        bottleneck=[TERMS[i] if busy else IDLE for i, busy in zip(codes.tolist(), busy_layers, strict=True)],
        slowest_gpu=slowest.astype(np.int64),
        gpu_time_us=gpu_time,
        gpu_compute_us=compute,
        gpu_weight_read_us=weight,
        gpu_comm_us=comm,
        gpu_rows=tm.step_rows(window_rows, total),
        active_slots=active.astype(np.int64),
        tokens_per_gpu=tokens[:, 0],
        lb=lb,
        overlap=overlap,
    )
