"""When a replay rebalances and what the solver sees: the schedule, the trigger and the window buffer."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError
from eplb.io.files import plural
from solvers.validation import real_number, whole_number

__all__ = ["TRIGGERS", "Schedule", "Window"]

_STEP_COUNTS = ("window", "interval", "first", "delay", "robust_windows")
"""The fields of a Schedule that count steps (or sub-windows): whole numbers, int or numpy's."""

TRIGGERS: tuple[str, ...] = ("periodic", "threshold", "cost")
"""periodic: rebalance at every check; threshold: when the recent realized lb exceeds `threshold`; cost:
when the predicted time saved over the next interval exceeds the predicted migration cost."""


@dataclass(frozen=True)
class Schedule:
    """When to rebalance and what the solver sees (positions count logged steps from 0).

    window: steps in the solver's window (vLLM's default 1000); interval: steps between checks (vLLM's
    default 3000); first: position of the first check (default: interval); delay: steps after a
    rebalance before its placement serves (default 1: from the next step); ewma: alpha in (0, 1] to
    weight the window, None for a plain sum; trigger: one of TRIGGERS (a check rebalances always,
    above `threshold` realized lb, or when it pays for its migration); robust_windows: split the window
    into this many sub-windows and make the placement hold up on all of them (`solvers.robust`).
    """

    window: int = 1000
    interval: int = 3000
    first: int | None = None
    delay: int = 1
    ewma: float | None = None
    trigger: str = "periodic"
    threshold: float = 1.1
    robust_windows: int | None = None

    def __post_init__(self) -> None:
        """Step counts given as numpy integers read as ints (`whole_number`); `check` refuses what is no count."""
        for name in _STEP_COUNTS:
            count = whole_number(getattr(self, name))
            if count is not None:
                object.__setattr__(self, name, count)

    def check(self, names: Mapping[str, str] | None = None) -> None:
        """Raise EplbError on an impossible schedule, naming each field as `names` does (the CLI: its flags;
        default: the field names)."""

        def n(field: str) -> str:
            return field if names is None else names.get(field, field)

        for name in ("window", "interval"):
            v = getattr(self, name)
            if whole_number(v) is None or v < 1:
                raise EplbError(f"{n(name)} must be a whole number of steps >= 1, got {v!r}")
        if self.first is not None and whole_number(self.first) is None:
            raise EplbError(f"{n('first')} must be a whole number of steps, got {self.first!r}")
        if self.first is not None and self.first < 1:
            raise EplbError(f"{n('first')} must be >= 1 (the first rebalance needs at least one step before it), "
                            f"got {self.first!r}")
        if whole_number(self.delay) is None or self.delay < 0:
            raise EplbError(f"{n('delay')} must be a whole number of steps >= 0, got {self.delay!r}")
        if self.delay >= self.interval:
            fix = f"{n('delay')} 0" if self.interval == 1 else f"{n('delay')} 0 .. {self.interval - 1}"
            raise EplbError(f"{n('delay')} ({self.delay}) must be shorter than {n('interval')} ({self.interval}): a "
                            f"placement must serve before the next rebalance; give {fix}")
        if self.ewma is not None and not (real_number(self.ewma) and 0 < self.ewma <= 1):
            raise EplbError(f"{n('ewma')} (EWMA alpha) must be in (0, 1], got {self.ewma!r}")
        if self.trigger not in TRIGGERS:
            raise EplbError(f"{n('trigger')} must be one of {', '.join(TRIGGERS)}, got {self.trigger!r}")
        if not (real_number(self.threshold) and math.isfinite(self.threshold) and self.threshold >= 1):
            raise EplbError(f"{n('threshold')} is a realized lb >= 1, got {self.threshold!r}")
        self._check_robust_windows(n)

    def _check_robust_windows(self, n: Callable[[str], str]) -> None:
        """robust_windows K cuts each check's window into K sub-windows of at least one step: 2 .. the steps the
        first check's window holds, min(window, the first check's position: first, or interval); a replay took
        K = 900 at a 100-step first check and cut 100 sub-windows. n: what the messages call the fields."""
        k = self.robust_windows
        if k is None:
            return
        held = min(self.window, self.first_position)
        whole = whole_number(k) is not None
        if whole and 2 <= k <= held:
            return
        if held == self.window:
            raise EplbError(f"{n('robust_windows')} must be 2 .. {n('window')} ({self.window}), got {k!r}")
        at = n("interval") if self.first is None else n("first")  # held < window: the first check's position
        if held >= 2 and not (whole and k > held):  # it said 2 .. --window (1000) at a 100-step first check
            raise EplbError(f"{n('robust_windows')} must be 2 .. {held:,}, the steps the window of the first check "
                            f"(step {self.first_position:,}, {at}) holds, got {k!r}")
        if not whole:  # and a one-step first check: no count would do
            raise EplbError(f"{n('robust_windows')} must be a whole number of sub-windows, got {k!r}")
        fix = (f"give {n('robust_windows')} 2 .. {held}" if held >= 2
               else f"drop {n('robust_windows')} or give a later {at}")
        raise EplbError(f"{n('robust_windows')} {k:,}: the window of the first check (step {self.first_position:,}, "
                        f"{at}) holds {plural(held, 'step')} ({at}), too few for {max(k, 2):,} sub-windows of a step "
                        f"or more: {fix}")

    @property
    def first_position(self) -> int:
        return self.interval if self.first is None else self.first

    def describe(self, solver: str, first_step: int | None = None) -> str:
        """One line: `solver`'s checks, trigger, window and delay. first_step: the log's step id of the first check
        (named with its position when they differ); None: the first check is named by its position."""
        weighting = "plain sum" if self.ewma is None else f"EWMA alpha {self.ewma:g}"
        serve = {0: "the same step", 1: "the next step"}.get(self.delay, f"{self.delay} steps later")
        when = {
            "periodic": "every check",
            "threshold": f"when the recent realized lb exceeds {self.threshold:g}",
            "cost": "when the predicted time saved over the next interval exceeds the migration cost",
        }[self.trigger]
        robust = "" if self.robust_windows is None else f", robust over {self.robust_windows} sub-windows"
        return (
            f"{solver}: a check every {self.interval:,} steps from {self.first_step_words(first_step)}, rebalancing "
            f"{when}; window {self.window:,} steps before each ({weighting}{robust}); a new placement serves from "
            f"{serve}"
        )

    def first_step_words(self, first_step: int | None = None) -> str:
        """'step 1,070 (position 70)': the first check's step id (`first_step`) and position; 'step 100' when they are
        one; 'step position 70' without the step id."""
        pos = self.first_position
        if first_step is None:
            return f"step position {pos:,}"
        return f"step {first_step:,}" + ("" if first_step == pos else f" (position {pos:,})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "interval": self.interval,
            "first_rebalance": self.first_position,
            "delay": self.delay,
            "ewma": self.ewma,
            "trigger": self.trigger,
            "threshold": self.threshold if self.trigger == "threshold" else None,
            "robust_windows": self.robust_windows,
        }


class Window:
    """Ring buffer of the last `size` steps' counts (memory: at most size x layers x E of the log's dtype), and
    of each step's realized lb (mean over layers) for the threshold trigger. The buffer grows with the
    positions stored (doubling, up to `size`), so a window longer than the log holds only the steps that
    arrived, whatever the log's header says it holds. Positions p are kept at index p % capacity: while the
    capacity is below `size`, every position stored is below it (index p), so growing copies in place."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.capacity = 0
        self.ring: NDArray[Any] | None = None
        self.lb = np.full(0, np.nan)

    def _reserve(self, end: int) -> None:
        """Room for positions up to end - 1: grow to at least `end` (doubling, at most `size`)."""
        if end <= self.capacity or self.capacity == self.size:
            return
        old = self.capacity
        self.capacity = min(self.size, max(end, 2 * old))
        lb = np.full(self.capacity, np.nan)
        lb[:old] = self.lb
        self.lb = lb
        if self.ring is not None:
            # in place (realloc: the stored rows keep their pages, the new ones read 0), not a new array and a
            # copy, which faulted in every stored row again: a 1,000-step window of 58 x 256 took 0.1 s more per
            # replay. No view of the ring escapes this class (every read takes rows by index: a copy).
            self.ring.resize((self.capacity, *self.ring.shape[1:]), refcheck=False)

    def _index(self, lo: int, hi: int) -> NDArray[np.int64]:
        return np.arange(lo, hi) % self.capacity

    def store_counts(self, start: int, counts: NDArray[Any]) -> None:
        """Counts [n, L, E] of positions start .. start + n - 1 (only the last `size` are kept)."""
        if counts.shape[0] > self.size:
            start, counts = start + counts.shape[0] - self.size, counts[-self.size :]
        if not counts.shape[0]:
            return
        self._reserve(start + counts.shape[0])
        if self.ring is None:
            self.ring = np.zeros((self.capacity, *counts.shape[1:]), dtype=counts.dtype)
        self.ring[self._index(start, start + counts.shape[0])] = counts

    def store_lb(self, start: int, lb: NDArray[np.float64]) -> None:
        """Realized lb [n] (mean over layers) of positions start .. start + n - 1."""
        if lb.size > self.size:
            start, lb = start + lb.size - self.size, lb[-self.size :]
        if not lb.size:
            return
        self._reserve(start + lb.size)
        self.lb[self._index(start, start + lb.size)] = lb

    def loads(self, lo: int, hi: int, ewma: float | None) -> tuple[NDArray[np.float64], float]:
        """(window loads [L, E] of positions lo .. hi - 1, total weight of its steps): plain or EWMA sum."""
        assert self.ring is not None
        out = np.zeros(self.ring.shape[1:], dtype=np.float64)
        weight = 0.0
        for a in range(lo, hi, 64):
            b = min(hi, a + 64)
            block = self.ring[self._index(a, b)]
            if ewma is None:
                out += block.sum(axis=0, dtype=np.float64)
                weight += b - a
            else:
                w = (1.0 - ewma) ** (hi - 1 - np.arange(a, b))
                out += np.tensordot(w, block.astype(np.float64), axes=1)
                weight += float(w.sum())
        return out, weight

    def steps(self, lo: int, hi: int) -> NDArray[Any]:
        """Stored counts of positions lo .. hi - 1, in order: [hi - lo, L, E]."""
        assert self.ring is not None
        return self.ring[self._index(lo, hi)]

    def scenarios(self, lo: int, hi: int, parts: int) -> NDArray[np.float64]:
        """The window lo .. hi - 1 cut into `parts` consecutive sub-windows: [parts, L, E] plain sums."""
        edges = np.linspace(lo, hi, parts + 1).round().astype(int)
        return np.stack([self.loads(int(a), int(b), None)[0] for a, b in itertools.pairwise(edges)])

    def recent_lb(self, lo: int, hi: int) -> float:
        """Mean realized lb of positions lo .. hi - 1 (NaN when none is stored)."""
        if hi <= lo:
            return math.nan
        vals = self.lb[self._index(lo, hi)]
        vals = vals[~np.isnan(vals)]
        return float(vals.mean()) if vals.size else math.nan
