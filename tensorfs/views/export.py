"""Writing a view to disk: the synthesized safetensors file(s) of a model (or a selection), streamed.

Written whole or not at all, by the one writer (tensorfs.files): made new beside the destination,
through descriptors only, renamed to its name at the end; never through a symlink.
Bytes are read through the model's gate (checked, verified, from a fallback where need be), from the
shard files (preadv; for a remote model through its cache), never the mappings.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import printable
from ..files import NewDirectory, WriteError, umasked, write_directory, write_whole
from . import Companion, ModelView, SynthesizedFile, shared_metadata

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..identity import ShardKey
    from ..tables import Tables

_BLOCK = 1 << 20

Read = Callable[[str, int, memoryview], None]
"""How a tensor's bytes are had: fill the buffer from an offset in the tensor (the gate's copy_into)."""


def write_safetensors(
    model: Tables, path: Path, read: Read, progress: Callable[[int], None] | None = None, *, replace: bool = True
) -> int:
    """One safetensors file holding every tensor of `model`, at `path`, by the one writer (tensorfs.files):
    a regular file there is replaced whole when `replace` (never one of the model's own shards),
    anything else refused, nothing written through a symlink. Returns its size in bytes."""

    def not_a_shard(st: os.stat_result) -> None:
        if any(_same_file(st, model, shard) for shard in model.shards):
            raise WriteError(f"cannot write {printable(str(path))}: it is a shard of the model being written")

    synthesized = SynthesizedFile(model, model.sorted_names, shared_metadata(model))
    write_whole(
        path,
        lambda out: _stream(synthesized, out, read, progress),
        mode=_mode_of(model),
        sync=True,
        replace=replace,
        existing=not_a_shard,
    )
    return synthesized.size


def write_view(view: ModelView, directory: Path, read: Read, progress: Callable[[int], None] | None = None) -> None:
    """A model directory (what .tensorfs/model/ of a mount holds) at `directory`, which must not
    exist, by the one writer (tensorfs.files): made whole, through descriptors only, or not at all."""
    with write_directory(directory) as new:
        _write_files(view, new, read, progress)


def view_bytes(view: ModelView) -> int:
    return sum(view.size(path) for path in view.files)


def _write_files(view: ModelView, new: NewDirectory, read: Read, progress: Callable[[int], None] | None) -> None:
    for sub in view.directories:
        source = view.directory_status.get(sub)
        # As closed as the source's (and the owner's to fill); else as any new directory.
        new.mkdir(sub, stat.S_IMODE(source.st_mode) | 0o700 if source is not None else umasked(0o777))
    for path, content in view.files.items():
        if isinstance(content, SynthesizedFile):
            with new.create(path, _mode_of(content.model)) as out:
                _stream(content, out, read, progress)
                out.flush()
                os.fsync(out.fileno())
        elif isinstance(content, Companion):
            # No more readable than it was (the owner's bits at least, to be written).
            mode = stat.S_IMODE(content.status.st_mode) & 0o666 | 0o600 if content.status is not None else 0o600
            with new.create(path, mode) as out:
                for start in range(0, content.size, _BLOCK):
                    piece = view.companions.read(path, start, _BLOCK)
                    out.write(piece)
                    if progress is not None:
                        progress(len(piece))
        else:
            with new.create(path, 0o666) as out:
                out.write(content)
            if progress is not None:
                progress(len(content))


def _same_file(st: os.stat_result, model: Tables, shard: ShardKey) -> bool:
    """Whether `st` is the shard's file: the one held open, never its path looked up again (a
    snapshot's link may lead elsewhere now, even into a mount that does not answer)."""
    if not isinstance(shard, Path):
        return False  # an object in a store
    try:
        other = model.shard_data(shard).status()
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _mode_of(model: Tables) -> int:
    """The permissions of a file made of the model's tensors: no more readable than its shard files."""
    mode = 0o666
    for shard in model.shards:  # as opened and validated, never looked up by its path again
        mode &= stat.S_IMODE(model.shard_data(shard).status().st_mode) | 0o600
    return umasked(mode) | 0o600


def _stream(synthesized: SynthesizedFile, out: BinaryIO, read: Read, progress: Callable[[int], None] | None) -> None:
    """Write the synthesized file's bytes to `out`, a block at a time, each tensor's read by `read`."""
    model: Tables = synthesized.model
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    for start in range(0, synthesized.size, _BLOCK):
        end = min(synthesized.size, start + _BLOCK)
        filled = 0
        for piece in synthesized.pieces(start, end):
            if isinstance(piece, bytes):
                view[filled : filled + len(piece)] = piece
                filled += len(piece)
                continue
            length = piece.end - piece.start
            begin = piece.shard_offset - model.locate(piece.tensor)[1]  # where in the tensor
            read(piece.tensor, begin, view[filled : filled + length])
            filled += length
        out.write(view[:filled])
        if progress is not None:
            progress(filled)
