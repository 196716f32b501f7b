"""The cost model: per-layer, per-GPU time of an MoE layer from three terms.

    compute      rows x 2 x expert_params FLOP / dense_flops
    weight read  bytes of the experts a GPU must read from HBM / hbm_bandwidth
    comm         all-to-all bytes a GPU sends or receives (dispatch + combine) / link bandwidth

All times are microseconds (`*_us`), one MoE layer, one GPU, at peak rates. The uniform-routing
form reproduces seed 000 (figure 4, table 1, figure 7, section 5); `predict` applies the same
three terms to a concrete placement and a window of expert loads. Formulas, assumptions and the
calibration table are in docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from eplb.errors import EplbError
from eplb.io.images import image_format, save_figure
from eplb.specs import HardwareSpec, ModelSpec

__all__ = [
    "IDLE",
    "TERMS",
    "UniformCost",
    "comm_copies_per_token",
    "dominance_grid",
    "ep_min",
    "format_sweep_table",
    "hot_expert_lb",
    "max_hot_expert_factor",
    "plot_dominance_map",
    "reuse_threshold_rows",
    "sweep",
    "uniform_cost",
]

TERMS: tuple[str, str, str] = ("compute", "weight_read", "comm")
"""Names of the three terms, in the order used for tie-breaking and for `bottleneck` codes."""
IDLE = "idle"
"""The bottleneck of a layer without tokens (`eplb.cost.predict`): nothing to compute, read or send."""

_US = 1e6  # seconds -> microseconds

DEFAULT_SWEEP_EPS: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)
DEFAULT_SWEEP_TOKENS: tuple[int, ...] = (256, 32768)
DEFAULT_MAP_TOKENS: tuple[int, ...] = tuple(2**i for i in range(5, 17))  # 32 .. 65,536 (figure 4)


# --------------------------------------------------------------------------------------------
# Uniform routing (seed 000)
# --------------------------------------------------------------------------------------------


def comm_copies_per_token(top_k: int, ep: ArrayLike, dedup: bool = False) -> NDArray[np.float64]:
    """Token copies each token sends off its GPU, for EP size(s) `ep` (any shape, same shape out).

    Without dedup every (token, expert) pair on another GPU is one copy: k(1 - 1/EP).
    With per-GPU dedup a token goes once to each other GPU holding any of its k experts:
    (EP - 1)(1 - (1 - 1/EP)^k).
    """
    e = np.asarray(ep, dtype=np.float64)
    if dedup:
        return (e - 1.0) * (1.0 - (1.0 - 1.0 / e) ** top_k)
    return top_k * (1.0 - 1.0 / e)


def reuse_threshold_rows(model: ModelSpec, hw: HardwareSpec) -> float:
    """r* = b/2 x dense_flops / hbm_bandwidth: rows per expert at which one expert's GEMM time
    equals the time to read its weights (b = expert_bytes_per_param; activations not counted)."""
    return model.expert_bytes_per_param / 2.0 * hw.dense_flops / hw.hbm_bandwidth


def ep_min(model: ModelSpec, hw: HardwareSpec, tokens_per_gpu: float) -> float:
    """EP at which rows per expert reach r*: EP_min = r* x E / (k x T). Continuous (not rounded)."""
    if tokens_per_gpu <= 0:
        raise EplbError(f"tokens per GPU must be positive, got {tokens_per_gpu!r}")
    return reuse_threshold_rows(model, hw) * model.num_experts / (model.top_k * tokens_per_gpu)


def max_hot_expert_factor(model: ModelSpec) -> float:
    """The most load one expert can carry, x the mean expert load: E/k. A token chooses k distinct experts, so an
    expert gets at most every token, and the mean expert k/E of them (DeepSeek-V3: 256/8 = 32)."""
    return model.num_experts / model.top_k


def hot_expert_lb(num_experts: int, ep: float, hot_expert_factor: float) -> float:
    """lb of the GPU holding one expert with h x the mean load: 1 + (h - 1) / (E / EP)."""
    return 1.0 + (hot_expert_factor - 1.0) / (num_experts / ep)


@dataclass(frozen=True)
class UniformCost:
    """Per-layer, per-GPU cost of an MoE layer under uniform routing (every GPU alike). Times in µs."""

    model: str
    hardware: str
    link_bandwidth: float  # B/s, per GPU, one direction
    ep: int
    tokens_per_gpu: float  # T
    dedup: bool
    num_moe_layers: int
    experts_per_gpu: float  # E / EP
    rows_per_gpu: float  # (k + shared) x T
    compute_us: float
    weight_read_us: float
    comm_us: float
    rows_per_expert: float  # r = EP x T x k / E
    reuse_threshold_rows: float  # r*
    ep_min: float  # continuous EP at which r = r*
    ep_min_integer: int  # smallest integer EP with r >= r*
    comm_copies_per_token: float
    bottleneck: str  # "compute" | "weight_read" | "comm"
    time_us: float  # comm overlapped with the GEMMs: max of the three terms
    time_no_overlap_us: float  # max(compute, weight_read) + comm
    hot_expert_factor: float | None
    hot_expert_lb: float | None

    @property
    def step_time_us(self) -> float:
        """MoE time of one step over all MoE layers (overlapped), µs."""
        return self.time_us * self.num_moe_layers

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the contract keys plus inputs."""
        return {
            "compute_us": self.compute_us,
            "weight_read_us": self.weight_read_us,
            "comm_us": self.comm_us,
            "rows_per_expert": self.rows_per_expert,
            "reuse_threshold_rows": self.reuse_threshold_rows,
            "comm_copies_per_token": self.comm_copies_per_token,
            "bottleneck": self.bottleneck,
            "ep_min": self.ep_min,
            "ep_min_integer": self.ep_min_integer,
            "hot_expert_lb": self.hot_expert_lb,
            "time_us": self.time_us,
            "time_no_overlap_us": self.time_no_overlap_us,
            "step_time_us": self.step_time_us,
            "rows_per_gpu": self.rows_per_gpu,
            "experts_per_gpu": self.experts_per_gpu,
            "inputs": {
                "model": self.model,
                "hardware": self.hardware,
                "link_bandwidth": self.link_bandwidth,
                "ep": self.ep,
                "tokens_per_gpu": self.tokens_per_gpu,
                "dedup": self.dedup,
                "hot_expert_factor": self.hot_expert_factor,
                "num_moe_layers": self.num_moe_layers,
            },
        }


def _uniform_terms(
    model: ModelSpec,
    hw: HardwareSpec,
    link_bw: float,
    ep: NDArray[np.float64],
    tokens: NDArray[np.float64],
    dedup: bool,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """compute, weight_read, comm in µs for broadcastable arrays of EP and T."""
    rows = (model.top_k + model.num_shared_experts) * tokens
    compute = rows * model.flops_per_row / hw.dense_flops * _US
    weight = (model.num_experts / ep * model.expert_bytes + model.shared_expert_bytes) / hw.hbm_bandwidth * _US
    weight = np.broadcast_to(weight, np.broadcast_shapes(ep.shape, tokens.shape))
    copies = comm_copies_per_token(model.top_k, ep, dedup)
    comm = tokens * copies * (model.dispatch_bytes_per_copy + model.combine_bytes_per_copy) / link_bw * _US
    return np.asarray(compute, np.float64), np.asarray(weight, np.float64), np.asarray(comm, np.float64)


def _check_uniform_inputs(model: ModelSpec, link_bw: float, ep: int, tokens_per_gpu: float) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int | np.integer) or ep < 1:
        raise EplbError(f"EP must be a positive integer number of GPUs, got {ep!r}")
    if not math.isfinite(tokens_per_gpu) or tokens_per_gpu <= 0:
        raise EplbError(f"tokens per GPU must be a positive number, got {tokens_per_gpu!r}")
    if not math.isfinite(link_bw) or link_bw <= 0:
        raise EplbError(f"link bandwidth must be positive (B/s), got {link_bw!r}")
    if ep > model.num_experts:
        raise EplbError(
            f"EP {ep} is larger than the model's {model.num_experts} routed experts: some GPUs would hold no expert"
        )


def uniform_cost(
    model: ModelSpec,
    hw: HardwareSpec,
    link_bw: float,
    ep: int,
    tokens_per_gpu: float,
    dedup: bool = False,
    hot_expert_factor: float | None = None,
) -> UniformCost:
    """Cost of one MoE layer on one GPU with EP GPUs, T tokens per GPU and uniform routing.

    link_bw: B/s per GPU and direction (see `eplb.specs.link_bandwidth`). Times are µs.
    compute = (k + shared) T x 2 x 3 x hidden x intermediate / dense_flops
    weight read = (E/EP x expert_bytes + shared_expert_bytes) / hbm_bandwidth
    comm = T x copies x (dispatch + combine bytes) / link_bw
    """
    _check_uniform_inputs(model, link_bw, ep, tokens_per_gpu)
    if hot_expert_factor is not None and (not math.isfinite(hot_expert_factor) or hot_expert_factor < 1):
        raise EplbError(f"hot expert factor must be >= 1 (x the mean load), got {hot_expert_factor!r}")
    most = max_hot_expert_factor(model)
    if hot_expert_factor is not None and hot_expert_factor > most * (1 + 1e-12):
        raise EplbError(f"hot expert factor {hot_expert_factor:g} is more than one expert can carry: {model.name} "
                        f"routes each token to {model.top_k} of its {model.num_experts} experts, so an expert chosen "
                        f"by every token carries E/k = {most:g} x the mean load, the most (give 1 to {most:g})")
    c, w, m = _uniform_terms(model, hw, link_bw, np.asarray(float(ep)), np.asarray(float(tokens_per_gpu)), dedup)
    compute, weight, comm = float(c), float(w), float(m)
    terms = (compute, weight, comm)
    bottleneck = TERMS[int(np.argmax(terms))]
    r_star = reuse_threshold_rows(model, hw)
    epm = ep_min(model, hw, tokens_per_gpu)
    return UniformCost(
        model=model.name,
        hardware=hw.name,
        link_bandwidth=link_bw,
        ep=int(ep),
        tokens_per_gpu=float(tokens_per_gpu),
        dedup=dedup,
        num_moe_layers=model.num_moe_layers,
        experts_per_gpu=model.num_experts / ep,
        rows_per_gpu=(model.top_k + model.num_shared_experts) * float(tokens_per_gpu),
        compute_us=compute,
        weight_read_us=weight,
        comm_us=comm,
        rows_per_expert=ep * tokens_per_gpu * model.top_k / model.num_experts,
        reuse_threshold_rows=r_star,
        ep_min=epm,
        ep_min_integer=max(1, math.ceil(epm - 1e-9)),
        comm_copies_per_token=float(comm_copies_per_token(model.top_k, ep, dedup)),
        bottleneck=bottleneck,
        time_us=max(terms),
        time_no_overlap_us=max(compute, weight) + comm,
        hot_expert_factor=hot_expert_factor,
        hot_expert_lb=None if hot_expert_factor is None else hot_expert_lb(model.num_experts, ep, hot_expert_factor),
    )


# --------------------------------------------------------------------------------------------
# Sweeps, tables and maps
# --------------------------------------------------------------------------------------------


def sweep(
    model: ModelSpec,
    hw: HardwareSpec,
    link_bw: float,
    eps: Sequence[int] = DEFAULT_SWEEP_EPS,
    tokens: Sequence[float] = DEFAULT_SWEEP_TOKENS,
    dedup: bool = False,
    hot_expert_factor: float | None = 10.0,
) -> list[UniformCost]:
    """`uniform_cost` for every (T, EP), T-major: [len(tokens) x len(eps)] results. hot_expert_factor is taken up to
    the model's most, E/k (`max_hot_expert_factor`; the table's lb column names the one used): the default 10 is
    more than mixtral-8x7b's 4, whose lb(h=10) was 10.00 at EP 8."""
    factor = None if hot_expert_factor is None else min(hot_expert_factor, max_hot_expert_factor(model))
    return [
        uniform_cost(model, hw, link_bw, ep, t, dedup=dedup, hot_expert_factor=factor)
        for t in tokens
        for ep in eps
    ]


def _fmt_num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def format_sweep_table(rows: Sequence[UniformCost]) -> str:
    """Seed-000-table-1-style text table: per (T, EP) rows per expert r, r/r*, comm/compute, lb(h),
    and the three terms in µs with the bottleneck."""
    if not rows:
        return ""
    h = rows[0].hot_expert_factor
    lb_head = f"lb(h={h:g})" if h is not None else "lb"
    head = [
        "T/GPU", "EP", "r rows", "r/r*", "comm/compute", lb_head,
        "compute us", "weight us", "comm us", "bottleneck",
    ]  # fmt: skip
    body = []
    for u in rows:
        body.append(
            [
                f"{u.tokens_per_gpu:,.0f}",
                str(u.ep),
                _fmt_num(u.rows_per_expert),
                _fmt_num(u.rows_per_expert / u.reuse_threshold_rows),
                f"{u.comm_us / u.compute_us:.2f}",
                "-" if u.hot_expert_lb is None else f"{u.hot_expert_lb:.2f}",
                f"{u.compute_us:,.1f}",
                f"{u.weight_read_us:,.1f}",
                f"{u.comm_us:,.1f}",
                u.bottleneck,
            ]
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i < 9 else c for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [head, *body]]  # fmt: skip
    u0 = rows[0]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(
        f"r* = {u0.reuse_threshold_rows:.1f} rows (weights only); comm {'with' if u0.dedup else 'without'} "
        f"per-GPU dedup over {u0.link_bandwidth / 1e9:g} GB/s per direction; times are µs per MoE layer per GPU."
    )
    return "\n".join(lines)


def dominance_grid(
    model: ModelSpec,
    hw: HardwareSpec,
    link_bw: float,
    eps: Sequence[int] = DEFAULT_SWEEP_EPS,
    tokens: Sequence[float] = DEFAULT_MAP_TOKENS,
    dedup: bool = False,
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Which term dominates per (T, EP).

    Returns (codes, times): codes [len(tokens), len(eps)] index into TERMS; times
    [3, len(tokens), len(eps)] are compute, weight_read, comm in µs.
    """
    ep_arr = np.asarray(eps, dtype=np.float64)[None, :]
    t_arr = np.asarray(tokens, dtype=np.float64)[:, None]
    c, w, m = _uniform_terms(model, hw, link_bw, ep_arr, t_arr, dedup)
    times = np.stack([np.broadcast_to(x, (t_arr.shape[0], ep_arr.shape[1])) for x in (c, w, m)])
    return np.argmax(times, axis=0).astype(np.int64), times


_TERM_COLORS = {"compute": "#4c72b0", "weight_read": "#dd8452", "comm": "#55a868"}
_TERM_LABELS = {"compute": "compute slowest", "weight_read": "weight read slowest", "comm": "comm slowest"}


def plot_dominance_map(
    path: str,
    model: ModelSpec,
    hw: HardwareSpec,
    links: Sequence[tuple[str, float]],
    eps: Sequence[int] = DEFAULT_SWEEP_EPS,
    tokens: Sequence[float] = DEFAULT_MAP_TOKENS,
    dedup: bool = False,
    *,
    name: str = "plot",
) -> str:
    """Write a figure-4-style map: one panel per (label, B/s) link, cells coloured by the slowest
    term, each cell labelled with that term's µs. Written to `path` exactly, in the format its suffix names
    (one matplotlib writes: png, pdf, svg, ...; PNG without one; `eplb.io.images.image_format`, whose
    messages call the path `name`). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    if not links:
        raise EplbError("plot needs at least one link")
    image_format(path, name)  # refused before the grid is computed
    cmap = ListedColormap([_TERM_COLORS[t] for t in TERMS])
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links) + 0.6, 6.2), squeeze=False)
    for ax, (label, bw) in zip(axes[0], links, strict=True):
        codes, times = dominance_grid(model, hw, bw, eps, tokens, dedup)
        ax.imshow(codes, cmap=cmap, vmin=0, vmax=len(TERMS) - 1, origin="lower", aspect="auto")
        for i in range(codes.shape[0]):
            for j in range(codes.shape[1]):
                v = times[codes[i, j], i, j]
                ax.text(j, i, f"{v:,.0f}" if v >= 10 else f"{v:.1f}", ha="center", va="center",
                        fontsize=6.5, color="white")  # fmt: skip
        ax.set_xticks(range(len(eps)), [str(e) for e in eps])
        ax.set_yticks(range(len(tokens)), [f"{t:,.0f}" for t in tokens])
        ax.set_xlabel("EP size (GPUs in the expert-parallel group)")
        ax.set_ylabel("tokens per GPU per step, T")
        ax.set_title(f"{label}: {bw / 1e9:g} GB/s per GPU per direction", fontsize=10)
    handles = [Patch(color=_TERM_COLORS[t], label=_TERM_LABELS[t]) for t in TERMS]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(
        f"Slowest term per MoE layer per GPU (cell text: its time in µs)\n{model.name} on {hw.name}, "
        f"{'dedup' if dedup else 'no dedup'}, uniform routing",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save_figure(fig, path, name)
    return path
