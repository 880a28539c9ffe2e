"""Writing a view to disk: the synthesized safetensors file(s) of a model (or a selection), streamed.

Written whole or not at all: into a temporary name beside the destination, renamed at the end.
Bytes are read from the shard files (preadv; for a remote model through its cache), never the mappings.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import TensorfsError, printable
from ..model import Model
from . import ModelView, SynthesizedFile, shared_metadata

_BLOCK = 1 << 20


def write_safetensors(model: Model, path: Path, progress: Callable[[int], None] | None = None) -> None:
    """One safetensors file holding every tensor of `model`, at `path` (replaced whole if there)."""
    synthesized = SynthesizedFile(model, model.sorted_names, shared_metadata(model))
    partial = path.with_name(f".{path.name}.partial")
    try:
        _write(synthesized, partial, progress)
        partial.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise TensorfsError(f"cannot write {printable(str(path))}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def write_view(view: ModelView, directory: Path, progress: Callable[[int], None] | None = None) -> None:
    """A model directory (what .tensorfs/model/ of a mount holds) at `directory`, which must not exist."""
    if directory.exists() or directory.is_symlink():
        raise TensorfsError(f"{printable(str(directory))}: already exists; name a new directory")
    partial = directory.with_name(f".{directory.name}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _write_files(view, partial, progress)
        partial.rename(directory)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise TensorfsError(f"cannot write {printable(str(directory))}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def view_bytes(view: ModelView) -> int:
    return sum(c.size if isinstance(c, SynthesizedFile) else len(c) for c in view.files.values())


def _write_files(view: ModelView, directory: Path, progress: Callable[[int], None] | None) -> None:
    for sub in view.directories:
        (directory / sub).mkdir()
    for path, content in view.files.items():
        if isinstance(content, SynthesizedFile):
            _write(content, directory / path, progress)
        else:
            (directory / path).write_bytes(content)
            if progress is not None:
                progress(len(content))


def _write(synthesized: SynthesizedFile, path: Path, progress: Callable[[int], None] | None) -> None:
    model: Model = synthesized.model
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "wb") as out:
        for start in range(0, synthesized.size, _BLOCK):
            end = min(synthesized.size, start + _BLOCK)
            filled = 0
            for piece in synthesized.pieces(start, end):
                if isinstance(piece, bytes):
                    view[filled : filled + len(piece)] = piece
                    filled += len(piece)
                    continue
                length = piece.end - piece.start
                model.readinto(piece.shard, piece.shard_offset, view[filled : filled + length])
                filled += length
            out.write(view[:filled])
            if progress is not None:
                progress(filled)
        out.flush()
        os.fsync(out.fileno())
