"""A weights file of the model's folder served as it is, byte for byte: its tensors' bytes through
the gate of the model that holds it, and the bytes no tensor holds (the header the table was read
from, a GGUF's padding, a checkpoint's zip records) from the same file, while it is the file that
was validated (Gate.read_untensored).

Nothing is copied to build one: a reader asks which tensors' bytes a byte range holds (a bisection of
its layout, nothing made per tensor), and the gate reads them together (gate/spans.py).
"""

from __future__ import annotations

import os
import threading
from array import array
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

from ..catalogue.tables import file_runs
from ..utils.identity import ShardKey
from .synthesized import Piece

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..catalogue.tables import Tables
    from ..gate import Gate, Plan, Run, Served

__all__ = ["WeightsFile"]


class WeightsFile:
    """One shard file of `model`, served whole under its own name, its bytes handed out by `gate`.

    Its layout (which byte ranges are tensors', in file order) is made on first use and kept in
    arrays: a mount that nobody reads it from pays nothing.
    """

    def __init__(self, model: Tables, gate: Gate, shard: ShardKey) -> None:
        self.model = model
        self.gate = gate
        """What hands out its bytes: its tensors' (read, read_file), and the others (read_untensored)."""
        self.shard = shard
        self.format = self.model.shard_header(shard).format
        self._lock = threading.Lock()
        self._built = False
        self._starts = array("Q")  # absolute [start, end) of each run of one tensor's bytes, in file order
        self._ends = array("Q")
        self._names: list[str] = []

    @property
    def size(self) -> int:
        return self.model.shard_header(self.shard).file_size

    @property
    def built(self) -> bool:
        return self._built

    def build(self) -> None:
        """Make the layout now (it is made on first use otherwise): a daemon does it off its request thread."""
        with self._lock:
            if self._built:
                return
            held, _ = file_runs(self.model.shard_header(self.shard))
            self._starts = array("Q", (start for start, _, _ in held))
            self._ends = array("Q", (end for _, end, _ in held))
            self._names = [name for _, _, name in held]
            self._built = True

    def status(self) -> os.stat_result:
        """The shard file's status, as opened and validated: its owner, permissions and times are the file's."""
        return self.model.shard_data(self.shard).status()

    def draws_on(self, shard: ShardKey) -> bool:
        return shard == self.shard

    def runs(self, start: int, end: int) -> list[Run]:
        """The tensors' bytes that bytes [start, end) of the file hold: each tensor's run of them (its
        bytes had once: a checkpoint's tensors that share a storage's are had from the first), clipped
        to the range, in file order. Empty tensors hold none."""
        self.build()
        first = bisect_right(self._ends, start)  # the first that ends after start
        last = bisect_left(self._starts, end)  # the first that begins at or after end
        found = list(zip(self._starts[first:last], self._ends[first:last], self._names[first:last], strict=True))
        if found:
            begin, until, name = found[0]
            found[0] = (max(begin, start), until, name)
            begin, until, name = found[-1]
            found[-1] = (begin, min(until, end), name)
        return found

    def within(self, start: int, end: int) -> Piece | None:
        """The piece of one tensor that bytes [start, end) of the file are, if they are (None: they
        hold bytes of several tensors, or that no tensor holds)."""
        self.build()
        index = bisect_right(self._starts, start) - 1
        if start >= end or index < 0 or self._ends[index] < end:
            return None
        return Piece(start, end, self._names[index], self.shard, start)

    def read(self, start: int, buffer: memoryview) -> Plan[list[Served]]:
        """Fill `buffer` with the file's bytes from `start` (all within the file), through its gate:
        the tensors' bytes together (one read of the file), the rest as validated (a plan)."""
        return self.gate.read_file(self.shard, start, buffer, self.runs(start, start + len(buffer)))
