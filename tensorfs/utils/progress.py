"""A progress line (bytes or a count, rate, ETA) on a terminal; silence anywhere else, and when asked to be quiet."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import TextIO

from .units import human_size, plural


class Progress:
    """Counts bytes (or things: `unit`, e.g. "shard") from any thread; redraws one line at most every
    0.1 s when `stream` is a terminal, unless `quiet` (a command's -q)."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        *,
        enabled: bool | None = None,
        quiet: bool = False,
        unit: str | None = None,
    ) -> None:
        self.total = total
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and (self.stream.isatty() if enabled is None else enabled)
        self.done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._drawn = 0.0

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if self.enabled and now - self._drawn >= 0.1:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        if self.unit is None:
            done, rate_shown = f"{human_size(self.done)} / {human_size(self.total)}", f"{human_size(int(rate))}/s"
        else:
            done, rate_shown = f"{self.done} / {plural(self.total, self.unit)}", f"{rate:.1f} {self.unit}s/s"
        line = f"{self.label} {done}  {rate_shown}  ETA {int(left) // 60}:{int(left) % 60:02d}"
        try:
            self.stream.write(f"\r{line:<72}")
            self.stream.flush()
        except OSError:  # a terminal gone away: the progress line is decoration, the work goes on
            self.enabled = False

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                self._draw(time.monotonic())
                with contextlib.suppress(OSError):
                    self.stream.write("\n")
                    self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
