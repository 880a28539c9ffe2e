"""Writing a view to disk: the model's folder as it is, or the synthesized file(s) of a model (or a
selection), streamed.

Written whole or not at all, by the one writer (tensorfs.fs.writer): made new beside the destination,
through descriptors only, renamed to its name at the end; never through a symlink.
Bytes are read through the gate of the model that holds them (checked, verified, from a fallback
where need be), from the shard files (preadv; for a remote model through its cache), never the mappings.
A block of zeros is left a hole (seeked over, the file's size set at its end): a sparse source stays
sparse, and costs no disk.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import printable
from ..fs.writer import NewDirectory, WriteError, umasked, write_directory, write_whole
from ..gate import run
from . import Companion, ModelView, SynthesizedFile, WeightsFile, shared_metadata

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..catalogue.tables import Tables
    from ..gate import Gate
    from ..utils.identity import ShardKey

_BLOCK = 1 << 20
_ZEROS = bytes(_BLOCK)


@dataclass
class Written:
    """What writing a model put on disk: bytes written, and bytes of zeros left as holes."""

    data: int = 0
    holes: int = 0


def write_safetensors(
    model: Tables,
    gate: Gate,
    path: Path,
    progress: Callable[[int], None] | None = None,
    *,
    replace: bool = True,
    written: Written | None = None,
) -> int:
    """One safetensors file holding every tensor of `model` (its bytes handed out by `gate`), at
    `path`, by the one writer (tensorfs.fs.writer): a regular file there is replaced whole when
    `replace` (never one of the model's own shards), anything else refused, nothing written through
    a symlink. Returns its size in bytes; what was written and left as holes is added to `written`."""

    def not_a_shard(st: os.stat_result) -> None:
        if any(_same_file(st, model, shard) for shard in model.shards):
            raise WriteError(f"cannot write {printable(str(path))}: it is a shard of the model being written")

    synthesized = SynthesizedFile(model, gate, model.sorted_names, shared_metadata(model))
    write_whole(
        path,
        lambda out: _stream(synthesized, out, progress, written or Written()),
        mode=_mode_of(model),
        sync=True,
        replace=replace,
        existing=not_a_shard,
    )
    return synthesized.size


def write_view(view: ModelView, directory: Path, progress: Callable[[int], None] | None = None) -> Written:
    """A model directory (what .tensorfs/model/ of a mount holds) at `directory`, which must not
    exist, by the one writer (tensorfs.fs.writer): made whole, through descriptors only, or not at all.
    What it wrote, and left as holes."""
    written = Written()
    with write_directory(directory) as new:
        _write_files(view, new, progress, written)
    return written


def view_bytes(view: ModelView) -> int:
    return sum(view.size(path) for path in view.files)


def _write_files(view: ModelView, new: NewDirectory, progress: Callable[[int], None] | None, written: Written) -> None:
    for sub in view.directories:
        source = view.directory_status.get(sub)
        # As closed as the source's (and the owner's to fill); else as any new directory.
        new.mkdir(sub, stat.S_IMODE(source.st_mode) | 0o700 if source is not None else umasked(0o777))
    for path, content in view.files.items():
        if isinstance(content, SynthesizedFile | WeightsFile):
            # No more readable than the file (or the files) its bytes come from.
            mode = _mode_of(content.model) if isinstance(content, SynthesizedFile) else _own_mode(content)
            with new.create(path, mode) as out:
                _stream(content, out, progress, written)
                out.flush()
                os.fsync(out.fileno())
        elif isinstance(content, Companion):
            # No more readable than it was (the owner's bits at least, to be written).
            mode = stat.S_IMODE(content.status.st_mode) & 0o666 | 0o600 if content.status is not None else 0o600
            with new.create(path, mode) as out:
                for start in range(0, content.size, _BLOCK):
                    piece = view.companions.read(path, start, _BLOCK)
                    _put(out, piece, written)
                    if progress is not None:
                        progress(len(piece))
                out.truncate()
        else:
            with new.create(path, 0o666) as out:
                out.write(content)
            written.data += len(content)
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


def _own_mode(file: WeightsFile) -> int:
    """A weights file written as it is: no more readable than its source (the owner's bits at least)."""
    return stat.S_IMODE(file.status().st_mode) & 0o666 | 0o600


def _stream(
    file: SynthesizedFile | WeightsFile, out: BinaryIO, progress: Callable[[int], None] | None, written: Written
) -> None:
    """Write the file's bytes to `out`, a block at a time, each through the file's gate (one plan: the
    tensors of a block that lie together in one shard read together, gate/spans.py)."""
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    for start in range(0, file.size, _BLOCK):
        length = min(file.size, start + _BLOCK) - start
        run(file.read(start, view[:length]))
        _put(out, buffer if length == _BLOCK else buffer[:length], written)
        if progress is not None:
            progress(length)
    out.truncate()


def _put(out: BinaryIO, block: bytes | bytearray, written: Written) -> None:
    """Write `block` at the file's position, or seek over it if it is all zeros (a hole: the file's
    size is set by a truncate() at its end)."""
    if block == (_ZEROS if len(block) == _BLOCK else bytes(len(block))):
        out.seek(len(block), os.SEEK_CUR)
        written.holes += len(block)
    else:
        out.write(block)
        written.data += len(block)
