"""`eplb cost`: what one MoE layer costs per GPU under uniform routing, sweeps over EP, and maps."""

from __future__ import annotations

import argparse
import json
import math

from eplb.cli.solve import MAX_TOKENS_PER_GPU, check_link, flag_link
from eplb.cost import (
    DEFAULT_MAP_TOKENS,
    DEFAULT_SWEEP_EPS,
    DEFAULT_SWEEP_TOKENS,
    UniformCost,
    format_sweep_table,
    plot_dominance_map,
    sweep,
    uniform_cost,
)
from eplb.errors import EplbError
from eplb.io.images import IMAGE_HELP, image_format
from eplb.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    link_bandwidth,
    load_hardware,
    load_model,
)

DESCRIPTION = """\
Estimate the time of one MoE layer on one GPU from three terms, at peak rates, with uniform routing:

  compute      (k + shared) x T rows x 2 x 3 x hidden x intermediate FLOP / dense FLOP/s
               Expert GEMMs. EP does not change it: every GPU gets about k x T routed rows.
  weight read  (E/EP routed experts x their bytes + shared expert bytes) / HBM bandwidth
               Every hosted expert's weights are read from HBM once per step.
  comm         T x copies x (dispatch + combine bytes) / link bandwidth (per GPU, one direction)
               All-to-all; copies = k(1 - 1/EP) per token, or (EP-1)(1 - (1 - 1/EP)^k) with --dedup.

Also: rows per expert r = EP x T x k / E, the weight-reuse threshold r* = bytes/param / 2 x FLOP/s /
HBM B/s (below r* reading weights is slower than the GEMM), EP_min = r* x E / (k x T), and with
--hot-expert-factor h the load-balance factor lb = 1 + (h - 1) / (E/EP) of the GPU holding an expert
with h x the mean load. Times are microseconds (µs) per MoE layer per GPU; 1 GB/s = 1e9 B/s.
"""

EPILOG = f"""\
model presets: {", ".join(MODEL_PRESETS)}
hardware presets: {", ".join(HARDWARE_PRESETS)}
(or pass a JSON file with the spec's fields, see docs/cost-model.md)

examples:
  eplb cost --ep 64 --tokens-per-gpu 256                 decode on B200 NVLink, DeepSeek V4.1-Flash
  eplb cost --ep 8 --tokens-per-gpu 32768 --link nic --json
  eplb cost --sweep --tokens-per-gpu 256,32768 --hot-expert-factor 10
  eplb cost --plot map.png                              figure-4-style map, NVLink and NIC panels
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `cost` subcommand."""
    p = subparsers.add_parser(
        "cost",
        help="per-GPU time of an MoE layer: compute, weight read, all-to-all (uniform routing)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="deepseek-v4.1-flash",
        metavar="NAME|FILE.json",
        help="model preset or JSON spec file (default: deepseek-v4.1-flash)",
    )
    p.add_argument(
        "--hardware",
        default="b200",
        metavar="NAME|FILE.json",
        help="GPU preset or JSON spec file (default: b200)",
    )
    p.add_argument(
        "--link",
        default=None,
        metavar="nvlink|nic|GBPS",
        help="all-to-all link: the GPU's NVLink, its NIC, or a bandwidth in GB/s per GPU and direction "
        "(default: nvlink; --plot accepts a comma list and defaults to nvlink,nic)",
    )
    p.add_argument(
        "--ep",
        default=None,
        metavar="N",
        help="expert-parallel size: GPUs sharing the E routed experts (E/EP each). "
        "Comma list with --sweep/--plot (default there: 2,4,...,128)",
    )
    p.add_argument(
        "--tokens-per-gpu",
        default=None,
        metavar="T",
        help="tokens each GPU holds per step (decode: requests x tokens per request; prefill: chunk). "
        "Comma list with --sweep (default 256,32768) or --plot (default 32..65536)",
    )
    p.add_argument(
        "--dedup",
        action="store_true",
        help="send a token once per destination GPU (DeepEP normal mode) instead of once per expert",
    )
    p.add_argument(
        "--hot-expert-factor",
        type=float,
        default=None,
        metavar="H",
        help="report lb of the GPU holding one expert with H x the mean load (sweep default: 10)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--sweep", action="store_true", help="print a table over EP sizes and T values")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help=f"write a map of which term is slowest per EP and T into FILE, {IMAGE_HELP}",
    )
    p.set_defaults(func=run)


def _int_list(opt: str, text: str, limit: float = math.inf) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        try:
            v = int(part)
        except ValueError:
            raise EplbError(f"{opt} must be a positive integer or a comma list of them, got {text!r}") from None
        if v < 1:
            raise EplbError(f"{opt} must be positive, got {v}")
        if v > limit:
            raise EplbError(f"{opt} {v} is too large (at most {limit:,.0f})")
        out.append(v)
    return out


def _link_label(link: str) -> str:
    key = link.strip().lower()
    return key if key in ("nvlink", "nic") else f"{key} GB/s"


def _links(hw: HardwareSpec, text: str) -> list[tuple[str, float]]:
    def read(part: str) -> float:
        return flag_link("--link", part, lambda: link_bandwidth(hw, part))

    links = [(part, read(part)) for part in text.split(",") if part.strip()]
    for part, bw in links:
        check_link(bw, "--link", part)
    return [(_link_label(part), bw) for part, bw in links]


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _explain(u: UniformCost, model: ModelSpec, hw: HardwareSpec, link: str) -> str:
    k, s, t = model.top_k, model.num_shared_experts, u.tokens_per_gpu
    ratio = u.rows_per_expert / u.reuse_threshold_rows
    regime = "compute-bound GEMMs" if ratio >= 1 else "weight reads slower than the GEMMs"
    shared_txt = f" + shared {_mb(model.shared_expert_bytes)}" if s else ""
    lines = [
        f"{model.name} on {hw.name}, link {link} = {u.link_bandwidth / 1e9:g} GB/s per GPU per direction; "
        f"EP {u.ep}, T = {t:,.0f} tokens per GPU",
        "Uniform routing at peak rates: every GPU and every one of the "
        f"{model.num_moe_layers} MoE layers costs the same. Per MoE layer, per GPU:",
        "",
        f"  {'compute':<12} {u.compute_us:>10,.1f} µs   {u.rows_per_gpu:,.0f} rows (T x ({k} routed + {s} shared)) "
        f"x {model.flops_per_row / 1e6:.1f} MFLOP / {hw.dense_flops / 1e15:g} PFLOP/s",
        f"  {'weight read':<12} {u.weight_read_us:>10,.1f} µs   {u.experts_per_gpu:g} routed experts x "
        f"{_mb(model.expert_bytes)}{shared_txt} / {hw.hbm_bandwidth / 1e12:g} TB/s",
        f"  {'comm':<12} {u.comm_us:>10,.1f} µs   T x {u.comm_copies_per_token:.2f} copies "
        f"({'dedup' if u.dedup else 'no dedup'}) x ({model.dispatch_bytes_per_copy:,.0f} B dispatch + "
        f"{model.combine_bytes_per_copy:,.0f} B combine) / {u.link_bandwidth / 1e9:g} GB/s",
        f"  {'bottleneck':<12} {u.bottleneck}: layer time {u.time_us:,.1f} µs with comm overlapped, "
        f"{u.time_no_overlap_us:,.1f} µs if comm adds to the GEMMs",
        "",
        f"rows per expert r = EP x T x k / E = {u.rows_per_expert:,.1f}; reuse threshold r* = "
        f"{u.reuse_threshold_rows:.1f} rows; r/r* = {ratio:.2f} ({regime})",
        f"EP_min = r* x E / (k x T) = {u.ep_min:.2f} (smallest integer EP with r >= r*: {u.ep_min_integer})",
    ]
    if u.hot_expert_lb is not None and u.hot_expert_factor is not None:
        lines.append(
            f"one expert at {u.hot_expert_factor:g} x the mean load: lb = 1 + (h - 1) / (E/EP) = "
            f"{u.hot_expert_lb:.3f} (its GPU's compute and comm grow by that factor)"
        )
    lines.append(
        f"all {model.num_moe_layers} MoE layers: {u.step_time_us:,.1f} µs of MoE time per step per GPU (overlapped)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run `eplb cost`; returns the exit code. Bad input raises EplbError."""
    image = None if args.plot is None else image_format(args.plot, "--plot")  # refused before anything is read
    model = load_model(args.model)
    hw = load_hardware(args.hardware)
    h = args.hot_expert_factor
    if h is not None and (not math.isfinite(h) or h < 1):
        raise EplbError(f"--hot-expert-factor must be >= 1 (x the mean load), got {h:g}")
    eps = _int_list("--ep", args.ep) if args.ep is not None else None
    tokens = None
    if args.tokens_per_gpu is not None:
        tokens = _int_list("--tokens-per-gpu", args.tokens_per_gpu, MAX_TOKENS_PER_GPU)
    for ep in eps or []:
        if ep > model.num_experts:
            raise EplbError(f"--ep {ep} exceeds the model's {model.num_experts} routed experts")

    # With --plot, --ep and --tokens-per-gpu pick the map's grid (and --link its panels); the one-point explanation
    # follows when each is one value. Every refusal comes before the map is written.
    plot_links = None if image is None else _links(hw, args.link if args.link else "nvlink,nic")
    link = args.link or "nvlink"
    single = eps is not None and tokens is not None and len(eps) == 1 and len(tokens) == 1
    point = not args.sweep and (image is None or (single and "," not in link))
    if image is None and not args.sweep:
        if eps is None or tokens is None:
            raise EplbError("give --ep N and --tokens-per-gpu T (or --sweep / --plot FILE.png)")
        if not single:
            raise EplbError("--ep and --tokens-per-gpu take one value each unless --sweep or --plot is given")
    bw = 0.0
    if args.sweep or point:
        if "," in link:
            raise EplbError("--sweep takes one --link (a comma list picks the panels of --plot)" if args.sweep else
                            "--link takes one link here (a comma list only with --plot)")  # fmt: skip
        ((_, bw),) = _links(hw, link)

    if plot_links is not None:
        plot_dominance_map(
            args.plot,
            model,
            hw,
            plot_links,
            eps=eps or DEFAULT_SWEEP_EPS,
            tokens=tokens or DEFAULT_MAP_TOKENS,
            dedup=args.dedup,
            name="--plot",
        )
        if not args.sweep and not args.json:
            print(f"wrote {args.plot} ({str(image).upper()})")

    if args.sweep:
        rows = sweep(
            model,
            hw,
            bw,
            eps=eps or DEFAULT_SWEEP_EPS,
            tokens=tokens or DEFAULT_SWEEP_TOKENS,
            dedup=args.dedup,
            hot_expert_factor=10.0 if h is None else h,
        )
        if args.json:
            print(json.dumps({"sweep": [r.to_dict() for r in rows]}, indent=2))
        else:
            print(f"{model.name} on {hw.name}, link {_link_label(link)}")
            print(format_sweep_table(rows))
        return 0

    if not point:
        return 0
    assert eps is not None and tokens is not None
    u = uniform_cost(model, hw, bw, eps[0], tokens[0], dedup=args.dedup, hot_expert_factor=h)
    if args.json:
        d = u.to_dict()
        d["inputs"]["link"] = _link_label(link)
        print(json.dumps(d, indent=2))
    else:
        print(_explain(u, model, hw, _link_label(link)))
    return 0
