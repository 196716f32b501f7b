"""The cost model: what an MoE layer costs per GPU (uniform routing, `uniform`), what a placement
costs on given loads (`predict`), and what moving expert weights costs (migration). One implementation
of each, used by solve, evaluate, replay and reports. Formulas: docs/cost-model.md."""

from eplb.cost.model import LayerPrediction, TimeModel, predict
from eplb.cost.uniform import (
    DEFAULT_MAP_TOKENS,
    DEFAULT_SWEEP_EPS,
    DEFAULT_SWEEP_TOKENS,
    IDLE,
    TERMS,
    UniformCost,
    comm_copies_per_token,
    dominance_grid,
    ep_min,
    format_sweep_table,
    hot_expert_lb,
    plot_dominance_map,
    reuse_threshold_rows,
    sweep,
    uniform_cost,
)

__all__ = [
    "DEFAULT_MAP_TOKENS",
    "DEFAULT_SWEEP_EPS",
    "DEFAULT_SWEEP_TOKENS",
    "IDLE",
    "TERMS",
    "LayerPrediction",
    "TimeModel",
    "UniformCost",
    "comm_copies_per_token",
    "dominance_grid",
    "ep_min",
    "format_sweep_table",
    "hot_expert_lb",
    "plot_dominance_map",
    "predict",
    "reuse_threshold_rows",
    "sweep",
    "uniform_cost",
]
