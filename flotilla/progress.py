"""A one-line progress bar on stderr (no tqdm): done/total, failures, rate, ETA.

On a terminal the line is redrawn in place at most every ``interval_s``; on a
pipe or file it prints a line at each tenth of the way, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class ProgressBar:
    """Call :meth:`advance` once per finished item and :meth:`close` at the end."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = 0.1, label: str = "batch") -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.enabled = enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.label = label
        self._start = time.monotonic()
        self._last_draw = float("-inf")
        self._last_tenth = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self) -> str:
        """The current bar as text, e.g. ``batch [#####-----] 50/100 2 failed 12.3/s eta 4s``."""
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * WIDTH)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        failed = f" {self.failed} failed" if self.failed else ""
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        return (f"{self.label} [{'#' * filled}{'-' * (WIDTH - filled)}] {self.done}/{self.total}"
                f"{failed} {rate:.1f}/s eta {eta_text}")

    def advance(self, *, failed: bool = False) -> None:
        self.done += 1
        self.failed += int(failed)
        if not self.enabled:
            return
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= self.interval_s or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        else:
            tenth = self.done * 10 // self.total
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
