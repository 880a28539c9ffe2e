"""`.tensorfs/stats.json` as a file: a fresh snapshot of the counters at each open, and a size that a
stat tells truly (copyfile and mmap take the size a stat says: a size of 0 made them copy nothing).

A snapshot's length changes as the counters grow, and the kernel asks the size before the open that
takes the snapshot: so the file's size is a bound, raised (never lowered) when a snapshot outgrows
it, and every snapshot is read as padded to it with spaces before its last newline (JSON allows
them). Its attributes are never cached (a timeout of 0). It is read with direct_io (the daemon's
answer, never a cached page, never queued behind readers' read-ahead): mapped, it must be mapped
private (np.memmap's mode "c"); a shared mapping of it is ENODEV (libfuse 3.14 cannot allow one).
"""

from __future__ import annotations

import json

from .stats import Stats

__all__ = ["StatsFile"]

_ROUND = 4096


class StatsFile:
    """The snapshots of stats.json open now, by handle, and the size the file says it has."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.size = 0
        self._open: dict[int, bytes] = {}

    def snapshot(self) -> bytes:
        """The counters now, as JSON; the file's size raised if they outgrew it."""
        made = (json.dumps(self.stats.snapshot(), indent=1) + "\n").encode()
        if len(made) > self.size:
            self.size = -(-(len(made) + len(made) // 4) // _ROUND) * _ROUND
        return made

    def opened(self, fh: int) -> None:
        """A fresh snapshot for the handle `fh`."""
        self._open[fh] = self.snapshot()

    def read(self, fh: int, offset: int, size: int) -> bytes | None:
        """Bytes of the handle's snapshot, padded to the file's size now; None: not a handle of it."""
        made = self._open.get(fh)
        if made is None:
            return None
        padded = made[:-1] + b" " * max(0, self.size - len(made)) + b"\n"
        return padded[offset : offset + size]

    def released(self, fh: int) -> bool:
        """Whether `fh` was a handle of it (now forgotten)."""
        return self._open.pop(fh, None) is not None
