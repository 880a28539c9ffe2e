"""A weights file of the model's folder served as it is, byte for byte: its tensors' bytes through
the gate of the model that holds it, and the bytes no tensor holds (the header the table was read
from, a GGUF's padding, a checkpoint's zip records) from the same file, while it is the file that
was validated (Gate.read_untensored).

Nothing is copied to build one: a reader asks which pieces cover a byte range, as of a synthesized
file (synthesized.py), and each piece says where its bytes are.
"""

from __future__ import annotations

import os
import threading
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..catalogue.tables import file_runs
from ..utils.identity import ShardKey
from .synthesized import Piece

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..catalogue.tables import Tables
    from ..gate import Gate

__all__ = ["Untensored", "WeightsFile"]


@dataclass(frozen=True)
class Untensored:
    """Bytes [start, end) of a weights file that no tensor holds (they are the shard's own, at the same offsets)."""

    start: int
    end: int
    shard: ShardKey


class WeightsFile:
    """One shard file of `model`, served whole under its own name, its bytes handed out by `gate`.

    Its layout (which byte ranges are tensors', in file order) is made on first use and kept in
    arrays: a mount that nobody reads it from pays nothing.
    """

    def __init__(self, model: Tables, gate: Gate, shard: ShardKey) -> None:
        self.model = model
        self.gate = gate
        """What hands out its bytes: its tensors' (read, read_into), and the others (read_untensored)."""
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

    def pieces(self, start: int, end: int) -> Iterator[Untensored | Piece]:
        """What covers bytes [start, end) of the file, in order: the tensors' pieces, and the bytes
        between them (Untensored). Empty tensors have no piece."""
        self.build()
        end = min(end, self.size)
        position = start
        index = max(0, bisect_right(self._starts, position) - 1)
        while position < end:
            if index < len(self._starts) and self._ends[index] <= position:
                index += 1
                continue
            if index >= len(self._starts) or self._starts[index] >= end:
                yield Untensored(position, end, self.shard)
                return
            begin = self._starts[index]
            if begin > position:
                yield Untensored(position, begin, self.shard)
                position = begin
            until = min(end, self._ends[index])
            yield Piece(position, until, self._names[index], self.shard, position)
            position = until
            index += 1
