"""A safetensors file made from a model's tensors: its header, and where each of its bytes comes from.

Nothing is copied to build one: the header is made once, and each tensor's bytes stay in its
shard; a reader asks which pieces cover a byte range. The layout is the reference writer's
(safetensors' `serialize`): tensors ordered by dtype, widest first, then by name, with no gaps, so
each starts aligned to its element size; the header is padded with spaces to a multiple of 8, so
the data starts 8-aligned. The header's keys are sorted by name.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ..dtypes import DTYPES
from ..header import Entry
from ..model import Model
from ..sources import ShardKey

_RANK = {name: rank for rank, name in enumerate(DTYPES)}  # the reference's dtype order, narrowest first


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the synthesized file, all from one tensor of one shard."""

    start: int
    end: int
    tensor: str
    shard: ShardKey
    shard_offset: int
    """Where the piece's first byte is in the shard file."""


class SynthesizedFile:
    """One safetensors file holding `names` (tensors of `model`), in the reference writer's layout."""

    def __init__(self, model: Model, names: list[str], metadata: Mapping[str, str] | None) -> None:
        self.model = model
        located: list[tuple[str, ShardKey, int, Entry]] = []
        for name in names:
            shard, data_start, entry = model.entry(name)
            located.append((name, shard, data_start, entry))
        located.sort(key=lambda item: (-_RANK[item[3][3].name], item[0]))
        fields: dict[str, object] = {}
        offset = 0
        self._starts: list[int] = []
        self._tensors: list[tuple[str, ShardKey, int, int]] = []  # name, shard, offset in the shard, nbytes
        for name, shard, data_start, (begin, end, _, dtype, shape) in located:
            fields[name] = {"dtype": dtype.name, "shape": list(shape), "data_offsets": [offset, offset + end - begin]}
            self._starts.append(offset)
            self._tensors.append((name, shard, data_start + begin, end - begin))
            offset += end - begin
        document: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
        document.update(sorted(fields.items()))
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self.header = len(text).to_bytes(8, "little") + text
        self.data_start = len(self.header)
        self.nbytes = offset
        """Bytes of tensor data."""
        self.size = self.data_start + offset
        self.shards = {shard for _, shard, _, _ in self._tensors}

    @property
    def names(self) -> list[str]:
        """The tensors, in file order."""
        return [name for name, _, _, _ in self._tensors]

    def pieces(self, start: int, end: int) -> Iterator[bytes | Piece]:
        """What covers bytes [start, end) of the file, in order: header bytes, then tensors' pieces.

        Empty tensors have no piece.
        """
        end = min(end, self.size)
        if start < self.data_start:
            yield self.header[start : min(end, self.data_start)]
            start = self.data_start
        position = start - self.data_start
        stop = end - self.data_start
        index = bisect_right(self._starts, position) - 1
        while position < stop and 0 <= index < len(self._tensors):
            name, shard, shard_offset, nbytes = self._tensors[index]
            begin = self._starts[index]
            until = min(stop, begin + nbytes)
            if until > position:
                yield Piece(
                    self.data_start + position,
                    self.data_start + until,
                    name,
                    shard,
                    shard_offset + position - begin,
                )
                position = until
            index += 1
