"""Comparison reports: every solver on the same windows, side by side, in Markdown, HTML and JSON.

`compare_window` runs the solvers over a sweep of EP sizes and slot counts on one load window;
`write_report` turns the runs into `results.json`, `report.md`, a self-contained `report.html` (plots
embedded as PNG data URIs) and the PNG files themselves.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.budget import spread_evenly
from eplb.errors import EplbError
from eplb.progress import Progress
from eplb.solve import Cluster, CostSetup, solve

SOLVER_CHOICES = ("greedy", "milp", "milp-weighted")


@dataclass
class Run:
    """One solver on one cluster shape; per-layer lists have one entry per MoE layer."""

    solver: str
    ep: int
    slots_per_gpu: list[int]
    lb: list[float]
    bound: list[float]
    solve_ms: list[float]
    status: list[str]
    gap: list[float]
    baseline_lb: list[float]
    time_us: list[float] | None = None
    baseline_time_us: list[float] | None = None
    bottleneck: list[str] | None = None
    moves: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        slots = self.slots_per_gpu
        per = f"{slots[0]}" if len(set(slots)) == 1 else f"{min(slots)}-{max(slots)}"
        return f"EP{self.ep} x {per} slots"


def parse_solvers(text: str) -> list[str]:
    """`greedy,milp,milp-weighted` -> list, checked."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SOLVER_CHOICES]
    if bad or not names:
        raise EplbError(f"unknown solver(s) {bad or text!r}: choose from {', '.join(SOLVER_CHOICES)}")
    return list(dict.fromkeys(names))


def cluster_shapes(
    num_experts: int, eps: Sequence[int], redundant: Sequence[int] | None
) -> list[tuple[int, NDArray[np.int64]]]:
    """(EP, slots per GPU) for every EP and redundancy; redundancy None means one redundant expert per GPU."""
    shapes = []
    for ep in eps:
        if ep < 1:
            raise EplbError(f"EP sizes must be >= 1, got {ep}")
        for r in redundant if redundant is not None else [ep]:
            slots = spread_evenly(num_experts + r, ep)
            if int(slots.min()) < 1:
                raise EplbError(f"EP{ep} with {r} redundant leaves GPUs without a slot")
            if int(slots.max()) > num_experts:
                raise EplbError(f"EP{ep} with {r} redundant puts more slots on a GPU than there are experts")
            shapes.append((ep, slots))
    return shapes


def compare_window(
    loads: NDArray[np.float64],
    shapes: Sequence[tuple[int, NDArray[np.int64]]],
    solvers: Sequence[str],
    cost: CostSetup | None,
    time_limit_s: float | None = None,
    progress: bool | None = None,
) -> list[Run]:
    """Run every solver on every cluster shape for loads [layers, E]."""
    runs: list[Run] = []
    with Progress(len(shapes) * len(solvers), "compare", enabled=progress) as bar:
        for ep, slots in shapes:
            for name in solvers:
                solver, split = ("milp", "weighted") if name == "milp-weighted" else (name, "uniform")
                outcome = solve(loads, Cluster(slots), solver=solver, cost=cost, time_limit_s=time_limit_s, split=split)
                info = outcome.solver
                layers = loads.shape[0]
                run = Run(
                    solver=name,
                    ep=ep,
                    slots_per_gpu=slots.tolist(),
                    lb=outcome.balance.lb.tolist(),
                    bound=list(info["bound_lb"]),
                    solve_ms=list(info.get("layer_ms", [info["wall_ms"] / layers] * layers)),
                    status=list(info.get("layer_status", [info["status"]] * layers)),
                    gap=list(info["gap"]),
                    baseline_lb=outcome.baseline.lb.tolist(),
                )
                if outcome.prediction is not None and outcome.baseline_prediction is not None:
                    run.time_us = outcome.prediction.time_us.tolist()
                    run.baseline_time_us = outcome.baseline_prediction.time_us.tolist()
                    run.bottleneck = list(outcome.prediction.bottleneck)
                runs.append(run)
                bar.advance(1, f"EP{ep} {name}")
    return runs


# ----- verdict and tables --------------------------------------------------------------------------------


def verdict(runs: Sequence[Run]) -> list[str]:
    """Sentences saying where the exact solvers beat greedy, by how much, at what solve time."""
    lines: list[str] = []
    by_shape: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_shape.setdefault(run.label, {})[run.solver] = run
    for label, group in by_shape.items():
        greedy = group.get("greedy")
        if greedy is None:
            continue
        g_max, g_mean = max(greedy.lb), float(np.mean(greedy.lb))
        for name, run in group.items():
            if name == "greedy":
                continue
            better = sum(1 for a, b in zip(run.lb, greedy.lb, strict=True) if a < b - 1e-9)
            worse = sum(1 for a, b in zip(run.lb, greedy.lb, strict=True) if a > b + 1e-9)
            r_max, r_mean = max(run.lb), float(np.mean(run.lb))
            ms = float(np.median(run.solve_ms))
            g_ms = float(np.median(greedy.solve_ms))
            if better == 0:
                lines.append(
                    f"{label}: {name} did not beat greedy on any of {len(run.lb)} layers (lb max {r_max:.4f} vs "
                    f"{g_max:.4f}); it took a median {ms:,.1f} ms per layer against greedy's {g_ms:,.2f} ms."
                )
                continue
            lines.append(
                f"{label}: {name} beat greedy on {better} of {len(run.lb)} layers"
                + (f" (worse on {worse})" if worse else "")
                + f": worst-layer lb {r_max:.4f} vs {g_max:.4f} ({100 * (g_max - r_max) / g_max:.2f}% lower), "
                f"mean lb {r_mean:.4f} vs {g_mean:.4f}, at a median {ms:,.1f} ms per layer "
                f"(greedy {g_ms:,.2f} ms)."
            )
    return lines or ["Only one solver ran: nothing to compare."]


def _summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = [["cluster", "solver", "lb mean", "lb max", "bound max", "gap max", "baseline lb max",
             "solve ms/layer (median)", "status", "MoE time / step"]]
    for r in runs:
        statuses = sorted(set(r.status))
        time_text = "" if r.time_us is None else f"{sum(r.time_us) / 1000:,.3f} ms"
        rows.append([
            r.label, r.solver, f"{np.mean(r.lb):.4f}", f"{max(r.lb):.4f}", f"{max(r.bound):.4f}", f"{max(r.gap):.4f}",
            f"{max(r.baseline_lb):.3f}", f"{np.median(r.solve_ms):,.2f}", ", ".join(statuses), time_text,
        ])
    return rows


def _markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(out)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ----- plots ---------------------------------------------------------------------------------------------


def _plots(runs: Sequence[Run], out: Path) -> list[tuple[str, str]]:
    """Write PNGs; returns (file name, caption) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    shapes = list(dict.fromkeys(r.label for r in runs))
    solvers = list(dict.fromkeys(r.solver for r in runs))
    colors = {s: c for s, c in zip(solvers, ["#4c72b0", "#dd8452", "#55a868", "#c44e52"], strict=False)}

    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 3.2 * len(shapes)), squeeze=False)
    for ax, label in zip(axes[:, 0], shapes, strict=True):
        group = [r for r in runs if r.label == label]
        layers = np.arange(len(group[0].lb))
        for r in group:
            ax.plot(layers, r.lb, marker=".", label=r.solver, color=colors[r.solver])
        ax.plot(layers, np.max([r.bound for r in group], axis=0), ls="--", color="black", label="lower bound")
        ax.set_title(label)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("lb (max / mean GPU load)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "lb_per_layer.png", dpi=110)
    plt.close(fig)
    made.append(("lb_per_layer.png", "Per-layer lb of each solver next to the best lower bound"))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    positions, labels, data, times = [], [], [], []
    for i, r in enumerate(runs):
        positions.append(i)
        labels.append(f"{r.label}\n{r.solver}")
        data.append(r.lb)
        times.append(r.solve_ms)
    box = ax1.boxplot(data, positions=positions, patch_artist=True)
    for patch, r in zip(box["boxes"], runs, strict=True):
        patch.set_facecolor(colors[r.solver])
    ax1.set_xticks(positions, labels, rotation=45, ha="right", fontsize=7)
    ax1.set_ylabel("lb over layers")
    ax1.set_title("Spread of lb over layers")
    ax1.grid(alpha=0.3)
    box = ax2.boxplot(times, positions=positions, patch_artist=True)
    for patch, r in zip(box["boxes"], runs, strict=True):
        patch.set_facecolor(colors[r.solver])
    ax2.set_yscale("log")
    ax2.set_xticks(positions, labels, rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("solve time per layer (ms, log scale)")
    ax2.set_title("Solve time per layer")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "spread_and_time.png", dpi=110)
    plt.close(fig)
    made.append(("spread_and_time.png", "lb spread over layers and solve time per layer"))

    timed = [r for r in runs if r.time_us is not None and r.baseline_time_us is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(10, 4))
        eps = sorted({r.ep for r in timed})
        for solver in solvers:
            pts = [(r.ep, sum(r.time_us) / 1000) for r in timed if r.solver == solver and r.time_us is not None]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=solver, color=colors[solver])
        base = sorted({(r.ep, sum(r.baseline_time_us) / 1000) for r in timed if r.baseline_time_us is not None})
        ax.plot(*zip(*base, strict=True), marker="s", ls=":", color="gray", label="no EPLB (contiguous)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(eps, [str(e) for e in eps])
        ax.set_xlabel("EP size (GPUs)")
        ax.set_ylabel("predicted MoE time per step (ms, all layers)")
        ax.set_title("Predicted time by EP size (slowest GPU per layer, summed over layers)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "time_by_ep.png", dpi=110)
        plt.close(fig)
        made.append(("time_by_ep.png", "Predicted MoE time per step by EP size"))
    return made


# ----- writing -------------------------------------------------------------------------------------------


def write_report(runs: Sequence[Run], out: Path, meta: dict[str, Any]) -> None:
    """results.json, report.md, report.html (self-contained) and the PNGs into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": [_run_json(r) for r in runs]}, indent=1) + "\n")
    plots = _plots(runs, out)
    words = verdict(runs)
    rows = _summary_rows(runs)
    md = [f"# eplb compare: {meta.get('title', 'solvers side by side')}", ""]
    md += [f"- {line}" for line in words]
    md += ["", "## Setup", ""] + [f"- {k}: {v}" for k, v in meta.items() if k != "title"]
    md += ["", "## Summary", "", _markdown_table(rows), ""]
    times = _time_rows(runs)
    if len(times) > 1:
        md += ["## Predicted time and its bottleneck", "", _markdown_table(times), ""]
    for name, caption in plots:
        md += [f"## {caption}", "", f"![{caption}]({name})", ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "report.html").write_text(_html(meta, words, rows, runs, plots, out))


def _time_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = [["cluster", "solver", "MoE time / step", "vs no EPLB", "bottleneck (layers)"]]
    for r in runs:
        if r.time_us is None or r.baseline_time_us is None or r.bottleneck is None:
            continue
        counts = {b: r.bottleneck.count(b) for b in sorted(set(r.bottleneck))}
        speed = sum(r.baseline_time_us) / sum(r.time_us)
        rows.append([r.label, r.solver, f"{sum(r.time_us) / 1000:,.3f} ms", f"{speed:.2f}x faster",
                     ", ".join(f"{k} {v}" for k, v in counts.items())])
    return rows


def _run_json(r: Run) -> dict[str, Any]:
    d = asdict(r)
    d.update(d.pop("extra"))
    return d


def _html(
    meta: dict[str, Any], words: list[str], rows: list[list[str]], runs: Sequence[Run], plots: list[tuple[str, str]],
    out: Path,
) -> str:
    """The self-contained page: tables inline, plots as PNG data URIs."""
    figures = "".join(
        f"<figure><img alt='{html.escape(cap)}' src='data:image/png;base64,"
        f"{base64.b64encode((out / name).read_bytes()).decode()}'><figcaption>{html.escape(cap)}</figcaption></figure>"
        for name, cap in plots
    )
    setup = "".join(f"<li>{html.escape(str(k))}: {html.escape(str(v))}</li>" for k, v in meta.items() if k != "title")
    verdict_html = "".join(f"<li>{html.escape(w)}</li>" for w in words)
    times = _time_rows(runs)
    time_html = f"<h2>Predicted time and its bottleneck</h2>{_html_table(times)}" if len(times) > 1 else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>eplb compare</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85rem; margin: 1rem 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f2f2f2; }} td:first-child, td:nth-child(2) {{ text-align: left; }}
figure {{ margin: 1.5rem 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; font-size: 0.9rem; }}
.verdict {{ background: #f6f8ff; border-left: 4px solid #4c72b0; padding: 0.5rem 1rem; }}
pre {{ background: #f7f7f7; padding: 0.5rem; font-size: 0.8rem; }}
</style></head><body>
<h1>eplb compare: {html.escape(str(meta.get("title", "solvers side by side")))}</h1>
<div class="verdict"><h2>Verdict</h2><ul>{verdict_html}</ul></div>
<h2>Setup</h2><ul>{setup}</ul>
<h2>Summary</h2>{_html_table(rows)}
{time_html}
{figures}
</body></html>
"""
