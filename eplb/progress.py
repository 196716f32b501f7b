"""A small progress bar on stderr for long work (replays, reports). Silent when stderr is not a terminal
unless forced, so logs and tests stay clean."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`with Progress(total, "solving") as bar: bar.advance(1, "EP32 milp")`."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.started = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        if self.enabled:
            self._draw("", force=True)
            self.stream.write("\n")
            self.stream.flush()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        if self.enabled:
            self._draw(note)

    def _draw(self, note: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total
        elapsed = now - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(frac * 24)
        timing = f"{elapsed:5.1f}s elapsed, {eta:5.1f}s left"
        self.stream.write(f"\r{self.label} [{bar:<24}] {self.done}/{self.total} {timing} {note[:40]:<40}")
        self.stream.flush()
