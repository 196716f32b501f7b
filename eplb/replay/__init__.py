"""Offline replay of a routing log with rebalancing, next to baselines (docs/replay.md)."""

from eplb.replay.run import (
    BASELINES,
    Rebalance,
    ReplayResult,
    Schedule,
    StepBlock,
    blas_threads,
    initial_placement,
    predict_time_us,
    replay,
)

__all__ = [
    "BASELINES",
    "Rebalance",
    "ReplayResult",
    "Schedule",
    "StepBlock",
    "blas_threads",
    "initial_placement",
    "predict_time_us",
    "replay",
]
