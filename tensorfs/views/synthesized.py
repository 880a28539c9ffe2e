"""A safetensors (or GGUF) file made from a model's tensors: its header, and where each of its bytes
comes from.

Nothing is copied to build one: the header is made on first use, and each tensor's bytes stay in
its shard; a reader asks which pieces cover a byte range. A safetensors file is laid out as the
reference writer lays it out (safetensors' `serialize`): tensors ordered by dtype, widest first,
then by name, with no gaps, so each starts aligned to its element size; the header is padded with
spaces to a multiple of 8, so the data starts 8-aligned, and its keys are sorted by name. A GGUF is
laid out as the source's: its key/value pairs as they are (but the split.* ones of a multi-file
model; a selection's say it is a part of a model: formats/ggufparts.py), its tensors in the
source's order, each padded with zeros to the source's alignment.
"""

from __future__ import annotations

import json
import threading
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import TYPE_CHECKING

from ..formats import BEGIN, DTYPE, END, SHAPE, gguf
from ..formats.dtypes import DTYPES
from ..formats.ggufparts import part_pairs
from ..selection import layer_of
from ..utils.identity import ShardKey

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..catalogue.tables import Tables
    from ..gate import Gate, Plan, Served

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


def format_of(model: Tables, names: list[str]) -> str:
    """The format of a file synthesized of `names`: a GGUF of a GGUF's tensors, else safetensors
    (a folder of several models may hold both)."""
    if not names:
        return model.view_format
    return "gguf" if model.shard_header(model.locate(names[0])[0]).format == gguf.NAME else "safetensors"


class SynthesizedFile:
    """One file holding `names` (tensors of `model`, their bytes handed out by `gate`): safetensors in
    the reference writer's layout, or, for a GGUF model, a GGUF.

    The layout is made on first use (a mount that nobody reads it from pays nothing), and kept in
    arrays: for 100k tensors, the header's bytes and a few MiB.
    """

    def __init__(
        self, model: Tables, gate: Gate, names: list[str], metadata: Mapping[str, str] | None, strip: str = ""
    ) -> None:
        self.model = model
        self.gate = gate
        """What hands out the tensors' bytes (the model's gate: a selection's is its parent's)."""
        self.format = format_of(model, names)
        """The file's format: its tensors' files' ("gguf"), else "safetensors"."""
        self._names = names
        self._metadata = dict(sorted(metadata.items())) if metadata else None
        self._strip = strip
        """What the names begin with that the file's header leaves out (a pipeline's component folder)."""
        self._lock = threading.Lock()  # the daemon's thread and a hashing or export thread may ask at once
        self._built = False
        self._header = b""
        self._order = array("L")  # file order -> index in names
        self._starts = array("Q")  # file order -> where its data starts, from the end of the header
        self._ends = array("Q")

    @property
    def built(self) -> bool:
        return self._built

    def build(self) -> None:
        """Make the layout now (it is made on first use otherwise): a daemon does it off its request thread."""
        with self._lock:
            if self._built:
                return
            if self.format == gguf.NAME:
                header, order, starts, ends, nbytes = _gguf_layout(self.model, self._names, self._strip)
            else:
                header, order, starts, ends, nbytes = _safetensors_layout(
                    self.model, self._names, self._metadata, self._strip
                )
            self._header = header
            self._order = array("L", order)
            self._starts = array("Q", (starts[i] for i in order))
            self._ends = array("Q", (ends[i] for i in order))
            self._nbytes = nbytes
            self._built = True

    @property
    def header(self) -> bytes:
        self.build()
        return self._header

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        self.build()
        return len(self._header) + self._nbytes

    @property
    def names(self) -> list[str]:
        """The tensors, in file order."""
        self.build()
        return [self._names[i] for i in self._order]

    def draws_on(self, shard: ShardKey) -> bool:
        """Whether any byte of the file comes from `shard`."""
        return any(self.model.locate(name)[0] == shard for name in self._names)

    def pieces(self, start: int, end: int) -> Iterator[bytes | Piece]:
        """What covers bytes [start, end) of the file, in order: header bytes, then tensors' pieces
        (and the zeros that pad a GGUF's tensors to its alignment).

        Empty tensors have no piece.
        """
        for part in self._parts(start, end):
            if isinstance(part, tuple):
                yield Piece(*part)
            else:
                yield part if isinstance(part, bytes) else bytes(part)

    def within(self, start: int, end: int) -> Piece | None:
        """The piece of one tensor that bytes [start, end) of the file are, if they are (None: they
        hold the header, padding, or bytes of several tensors)."""
        self.build()
        position = start - len(self._header)
        index = bisect_right(self._starts, position) - 1
        if start >= end or position < 0 or index < 0 or self._ends[index] < position + end - start:
            return None
        name = self._names[self._order[index]]
        shard, offset, _ = self.model.locate(name)
        return Piece(start, end, name, shard, offset + position - self._starts[index])

    def read(self, start: int, buffer: memoryview) -> Plan[list[Served]]:
        """Fill `buffer` with the file's bytes from `start` (all within the file), through the gate (a
        plan): the tensors of each shard read together (gate/spans.py), in one read of their file where
        they lie close together in it (in the file's order or not), else in a few."""
        wanted: dict[ShardKey, list[_Wanted]] = {}
        position = 0  # where the next part goes in the buffer
        for part in self._parts(start, start + len(buffer)):
            if isinstance(part, bytes):  # the header
                buffer[position : position + len(part)] = part
                position += len(part)
            elif isinstance(part, int):  # padding
                buffer[position : position + part] = bytes(part)
                position += part
            else:
                begin, end, name, shard, offset = part
                wanted.setdefault(shard, []).append((offset, offset + end - begin, name, position))
                position += end - begin
        served: list[Served] = []
        for shard, pieces in wanted.items():
            pieces.sort()
            for together in _close_together(pieces):
                served += yield from self._read_together(shard, together, buffer)
        return served

    def _read_together(self, shard: ShardKey, pieces: list[_Wanted], buffer: memoryview) -> Plan[list[Served]]:
        """Pieces of one shard's tensors (in its file's order, none overlapping) read together, each into
        its place in `buffer`: straight there when they lie there as in their file, one after the other."""
        low, high, at = pieces[0][0], pieces[-1][1], pieces[0][3]
        runs = [(begin, end, name) for begin, end, name, _ in pieces]
        if all(begin - low == where - at and (k == 0 or begin == pieces[k - 1][1])
               for k, (begin, _, _, where) in enumerate(pieces)):  # fmt: skip
            return (yield from self.gate.read_file(shard, low, buffer[at : at + high - low], runs, untensored=False))
        scratch = memoryview(bytearray(high - low))  # the file's bytes between them are not served (zeros)
        served = yield from self.gate.read_file(shard, low, scratch, runs, untensored=False)
        for begin, end, _, where in pieces:
            buffer[where : where + end - begin] = scratch[begin - low : end - low]
        return served

    def _parts(self, start: int, end: int) -> Iterator[bytes | int | _Part]:
        """pieces(), lighter: the header's bytes, a count of zeros, a tensor's piece as a tuple."""
        self.build()
        data_start = len(self._header)
        end = min(end, data_start + self._nbytes)
        if start < data_start:
            yield self._header[start : min(end, data_start)]
            start = data_start
        position, stop = start - data_start, end - data_start
        index = bisect_right(self._starts, position) - 1
        locate = self.model.locate
        while position < stop and 0 <= index < len(self._order):
            begin, until = self._starts[index], min(stop, self._ends[index])
            if begin > position:  # padding before this tensor
                yield min(begin, stop) - position
                position = min(begin, stop)
                continue
            if until > position:
                name = self._names[self._order[index]]
                shard, offset, _ = locate(name)
                yield data_start + position, data_start + until, name, shard, offset + position - begin
                position = until
            index += 1
        if position < stop:  # padding after the last tensor
            yield stop - position


_Part = tuple[int, int, str, ShardKey, int]
"""A Piece's fields (start, end, tensor, shard, shard_offset), as a tuple."""
_Wanted = tuple[int, int, str, int]
"""Bytes [start, end) of a shard's file that are a tensor's (named), and where they go in a buffer."""
APART = 64 << 10
"""Bytes of a shard's file between two tensors' that are read with them (not served) rather than
reading each apart: as long as no more are read so than are served."""


def _close_together(pieces: list[_Wanted]) -> Iterator[list[_Wanted]]:
    """Pieces of one shard's file, in its order, cut where they overlap (tensors that share bytes) or
    lie far apart: each cut read in one read of the file."""
    together: list[_Wanted] = []
    served = skipped = 0
    for piece in pieces:
        if together:
            gap = piece[0] - together[-1][1]
            if gap < 0 or gap > APART or skipped + gap > served + APART:
                yield together
                together, served, skipped = [], 0, 0
            else:
                skipped += gap
        together.append(piece)
        served += piece[1] - piece[0]
    if together:
        yield together


_Layout = tuple[bytes, list[int], list[int], list[int], int]
"""(header, file order -> index in names, each name's start and end from where the data starts, data bytes)."""


def _safetensors_layout(model: Tables, names: list[str], metadata: Mapping[str, str] | None, strip: str) -> _Layout:
    entries = [model.entry(name)[2] for name in names]
    order = sorted(range(len(names)), key=lambda i: (-_RANK[entries[i][DTYPE].name], names[i]))
    offset = 0
    starts, ends = [0] * len(names), [0] * len(names)
    for i in order:
        begin, end = entries[i][BEGIN], entries[i][END]
        starts[i], ends[i] = offset, offset + end - begin
        offset += end - begin
    fields = [
        f'{encode_basestring(names[i].removeprefix(strip))}:{{"dtype":"{entries[i][DTYPE].name}",'
        f'"shape":[{",".join(map(str, entries[i][SHAPE]))}],"data_offsets":[{starts[i]},{ends[i]}]}}'
        for i in sorted(range(len(names)), key=names.__getitem__)
    ]
    if metadata is not None:
        fields.insert(0, '"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    text = ("{" + ",".join(fields) + "}").encode("utf-8")
    del fields
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order, starts, ends, offset


def _gguf_layout(model: Tables, names: list[str], strip: str) -> _Layout:
    """The source's order (shard by shard, by offset), its key/value pairs (the first shard's, as a
    multi-file GGUF keeps them; its split.* ones dropped; a selection's saying it is a part) and its
    alignment. The names without `strip` (the folder of a model of several)."""
    shards = {shard: k for k, shard in enumerate(model.shards)}
    place = [model.locate(name) for name in names]
    order = sorted(range(len(names)), key=lambda i: (shards[place[i][0]], place[i][1]))
    own = place[order[0]][0] if order else model.shards[0]  # the first file its tensors are in
    first = model.shard_header(own)
    layout = first.layout or {}
    alignment = layout.get("alignment", gguf.DEFAULT_ALIGNMENT)
    pairs = [(key, raw) for key, raw in gguf.pairs(model.shard_data(own).read, layout)
             if not key.startswith("split.")]  # fmt: skip
    shown = [name.removeprefix(strip) for name in names]
    if model.selection.everything:
        kept = [raw for _, raw in pairs]
    else:  # a part of the model says so, and which blocks it holds (ggufparts.py)
        kept = part_pairs(pairs, sorted({layer for name in shown if (layer := layer_of(name)) is not None}))
    offset = 0
    starts, ends = [0] * len(names), [0] * len(names)
    infos = []
    for i in order:
        _, _, entry = model.entry(names[i])
        starts[i], ends[i] = offset, offset + entry[END] - entry[BEGIN]
        infos.append((shown[i], entry[SHAPE][::-1], entry[DTYPE], offset))
        offset = ends[i] + -ends[i] % alignment
    return gguf.table(3, kept, infos, alignment), order, starts, ends, offset
