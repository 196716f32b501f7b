"""Offline replay of a routing log with rebalancing, next to baselines (docs/replay.md).

schedule: when to check and rebalance (Schedule, TRIGGERS) and the window buffer; evaluate: every
placement's lb and time per step (compiled loop in _evaluate.c); run: the replay itself; summary: the
rows' running statistics.
"""

from eplb.replay.run import (
    Rebalance,
    ReplayResult,
    StepBlock,
    blas_threads,
    initial_placement,
    predict_time_us,
    replay,
)
from eplb.replay.schedule import TRIGGERS, Schedule
from eplb.replay.summary import BASELINES
from eplb.trigger import MOVE_BUDGETS

__all__ = [
    "BASELINES",
    "MOVE_BUDGETS",
    "TRIGGERS",
    "Rebalance",
    "ReplayResult",
    "Schedule",
    "StepBlock",
    "blas_threads",
    "initial_placement",
    "predict_time_us",
    "replay",
]
