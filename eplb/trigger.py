"""The cost trigger's candidates and its choice among them, one definition for replay and deployments.

With the incremental solver a check tries several move budgets, no budget and a fresh greedy placement
(`candidates`); each is scored by its net saving (predicted time saved over the next interval minus its
migration charge, `eplb.cost.migration`) and `choose_candidate` picks one, or none when nothing pays for
itself. Why this choice: docs/replay.md ("Rebalancing policies, triggers and migration").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LB_TOLERANCE", "MOVE_BUDGETS", "NET_TOLERANCE", "TRIGGER_OPTIONS", "candidates", "choose_candidate",
           "unused_option"]

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
5-40%)..."""
LB_TOLERANCE = 0.01
"""... and of those takes the one with the fewest copies whose lb is within this fraction of the most
balanced one's."""


def candidates(total_slots: int) -> list[dict[str, Any]]:
    """The incremental solver's candidates as keyword arguments: {"max_moves": b} for every MOVE_BUDGETS
    fraction of `total_slots` (layers x slots), {"max_moves": None} (the solver's own stop rule) and
    {"fresh": True} (a fresh greedy placement, relabelled onto the serving one)."""
    budgets = sorted({max(1, round(f * total_slots)) for f in MOVE_BUDGETS})
    return [*({"max_moves": b} for b in budgets), {"max_moves": None}, {"fresh": True}]


def choose_candidate(net_s: list[float], lb: list[float], moves: list[int]) -> int | None:
    """The cost trigger's choice among candidates (net saving s, lb on the judged loads, copies each): of
    those within NET_TOLERANCE of the best net saving, the fewest copies whose lb is within LB_TOLERANCE of
    the most balanced one's (ties: the lower lb); None when no candidate saves more than it costs."""
    best = max(net_s, default=0.0)
    if best <= 0:
        return None
    near = [i for i, n in enumerate(net_s) if n >= best * (1 - NET_TOLERANCE)]
    balanced = min(lb[i] for i in near)
    return min((i for i in near if lb[i] <= balanced * (1 + LB_TOLERANCE)), key=lambda i: (moves[i], lb[i]))


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
