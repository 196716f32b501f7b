"""The cost trigger's candidates and its choice among them, one definition for replay and deployments.

With the incremental solver a check tries several move budgets, no budget and a fresh greedy placement
(`candidates`); each is scored by its net saving (predicted time saved over the next interval once its copies
land minus its migration charge, `net_saving`, `eplb.cost.migration`) and `choose_candidate` picks one, or none
when nothing pays for itself. Why this choice: docs/replay.md ("Rebalancing policies, triggers and migration").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eplb.cost.migration import MigrationCost

__all__ = ["MOVE_BUDGETS", "NET_TOLERANCE", "TRIGGER_OPTIONS", "candidates", "choose_candidate",
           "net_saving", "unused_option"]

TRIGGER_OPTIONS: dict[str, tuple[str, ...]] = {
    "periodic": ("every",), "threshold": ("threshold",), "cost": ("steps", "migration", "migration_stall_s"),
}
"""The options only one trigger reads: a deployment policy's (`eplb.deployments.Policy`), and `eplb replay`'s
--threshold. Given with another trigger, one is refused (`unused_option`): it would change nothing."""

MOVE_BUDGETS: tuple[float, ...] = (0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
"""Move budgets the cost trigger tries with the incremental solver, as fractions of all slots."""
NET_TOLERANCE = 0.05
"""The cost trigger considers the candidates whose net saving is within this fraction of the best (the
estimate's error: on the benchmark logs the window's own steps overstate the next interval's saving by
5-40%) and takes the most balanced of them."""


def candidates(total_slots: int, solver: str = "incremental", budgeted: bool = False) -> list[dict[str, Any]]:
    """What the cost trigger solves, as keyword arguments of one solve each: for the incremental solver with no
    budget of the caller's own (`budgeted`: max_moves or target_lb given), {"max_moves": b} for every MOVE_BUDGETS
    fraction of `total_slots` (layers x slots), {"max_moves": None} (the solver's own stop rule) and {"fresh": True}
    (a fresh greedy placement, relabelled onto the serving one); else the policy's one solve, [{}]. Replay and
    deployments both ask here."""
    if solver != "incremental" or budgeted:
        return [{}]
    budgets = sorted({max(1, round(f * total_slots)) for f in MOVE_BUDGETS})
    return [*({"max_moves": b} for b in budgets), {"max_moves": None}, {"fresh": True}]


def net_saving(saved_per_step_s: float, steps: int, cost: MigrationCost | None, step_time_s: float,
               delay: int = 0) -> tuple[float, float]:
    """(net saving, saving), s, of a candidate whose placement serves `saved_per_step_s` faster per step than the
    serving one, over the `steps` steps until the next decision: until its copies land (the steps they span,
    `MigrationCost.charge_s`, or `delay`, the longer) the serving placement serves on, so only the steps after
    save; the net saving takes its migration charge off (None: nothing to copy or no migration model)."""
    charge, span = (0.0, 0) if cost is None else cost.charge_s(step_time_s)
    saving = saved_per_step_s * max(0, steps - max(delay, span))
    return saving - charge, saving


def choose_candidate(net_s: list[float], lb: list[float], moves: list[int]) -> int | None:
    """The cost trigger's choice among candidates (net saving s, lb on the judged loads, copies each): of
    those within NET_TOLERANCE of the best net saving, the most balanced (ties: the fewest copies); None when no
    candidate saves more than it costs. A candidate whose net saving or lb is not a finite number (a prediction
    that failed) is never chosen."""
    finite = [i for i in range(len(net_s)) if math.isfinite(net_s[i]) and math.isfinite(lb[i])]
    best = max((net_s[i] for i in finite), default=0.0)
    if best <= 0:
        return None
    near = [i for i in finite if net_s[i] >= best * (1 - NET_TOLERANCE)]
    return min(near, key=lambda i: (lb[i], moves[i]))


def unused_option(trigger: str, given: Iterable[str], names: Mapping[str, str] | None = None, whose: str = "the",
                  default: bool = False) -> tuple[str, str] | None:
    """The first of the options `given` that `trigger` does not read (`TRIGGER_OPTIONS`), with the one text that
    refuses it, or None. names: what the text calls the options and `trigger` (the CLI: its flags; a deployment:
    its JSON fields); whose: whose trigger it is ("this run's"); default: the trigger was not chosen."""
    def n(field: str) -> str:
        return (names or {}).get(field, field)

    for option in given:
        owner = next((t for t, options in TRIGGER_OPTIONS.items() if option in options), trigger)
        if owner != trigger:
            return option, (f"{n(option)} is used by {n('trigger')} {owner} only; {whose} trigger is {trigger}"
                            f"{' (the default)' if default else ''}: use {n('trigger')} {owner} or drop {n(option)}")
    return None
