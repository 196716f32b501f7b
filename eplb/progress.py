"""A small progress bar on stderr for long work (replays, reports). Silent when stderr is not a terminal
unless forced, so logs and tests stay clean.

Three ways to drive it, mixed freely:

- `bar.advance(n, note)`: n more units done (`with Progress(8, "compare") as bar: bar.advance(1, "EP32 milp")`);
- `bar.update(done, note)`: `done` units done in all;
- `bar(done)`: the same as `update`, so a bar can be handed to anything that takes a `progress(done)`
  callable (`eplb.replay.replay(..., progress=bar)`).

With a known total the line reads `replay [#####...] 1,234/4,000 steps  31%  2.1 s elapsed, 4.7 s left`;
with an unknown total (None: a JSONL log without a step count) `replay 1,234 steps  2.1 s elapsed`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A one-line progress bar. total: units of work (None: unknown); label: the line's first word;
    stream: where to draw (default stderr); enabled: draw or not (default: when the stream is a
    terminal); unit: the work's unit after the counts ("steps"; default none). Redrawn at most 10
    times a second; `close()` (or leaving the `with` block) draws the last state and ends the line."""

    def __init__(
        self,
        total: int | None,
        label: str,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        *,
        unit: str = "",
        width: int = 24,
    ) -> None:
        self.total = None if total is None else max(1, total)
        self.label = label
        self.unit = unit
        self.width = width
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.note = ""
        self.started = time.monotonic()
        self._last = 0.0
        self._drawn = 0  # length of the line drawn last, to blank what a shorter one leaves
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def advance(self, n: int = 1, note: str = "") -> None:
        """n more units done."""
        self.update(self.done + n, note)

    def update(self, done: int, note: str = "") -> None:
        """`done` units done in all (clipped to the total when it is known)."""
        self.done = done if self.total is None else min(self.total, done)
        self.note = note
        if self.enabled:
            self._draw()

    def __call__(self, done: int) -> None:
        self.update(done)

    def close(self) -> None:
        """Draw the final state and end the line (once; nothing when disabled)."""
        if self.enabled and not self._closed:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def text(self) -> str:
        """The line as drawn now (without the leading carriage return)."""
        elapsed = time.monotonic() - self.started
        unit = f" {self.unit}" if self.unit else ""
        note = f" {self.note[:40]}" if self.note else ""
        if self.total is None:
            return f"{self.label} {self.done:,}{unit} {elapsed:5.1f} s elapsed{note}"
        frac = self.done / self.total
        left = elapsed / frac - elapsed if frac > 0 else 0.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return (
            f"{self.label} [{bar}] {self.done:,}/{self.total:,}{unit} {frac:4.0%} "
            f"{elapsed:5.1f} s elapsed, {left:5.1f} s left{note}"
        )

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1 and (self.total is None or self.done < self.total):
            return
        self._last = now
        line = self.text()
        self.stream.write("\r" + line.ljust(self._drawn))
        self.stream.flush()
        self._drawn = len(line)
