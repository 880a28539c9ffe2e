"""Writing a file whole or not at all: what every file tensorfs writes for a user goes through here
(a manifest, an exported model, a daemon's record, the files of an exported model directory)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def partial_of(path: Path) -> Path:
    """Where a file (or a directory) is written before it is renamed to `path`: beside it, hidden, this
    process's own (two writers never share one)."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def umasked(mode: int) -> int:
    """`mode` less this process's umask: what a file made with it gets."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_whole(
    path: Path, write: Callable[[BinaryIO], object], *, mode: int | None = None, sync: bool = False
) -> None:
    """Write the file at `path` with `write(out)`, whole or not at all: into a partial file beside it,
    renamed over it at the end, so that a reader sees the old file or the new one, never half of one.
    A device or a pipe at `path` is written as it comes instead.

    `mode`: the new file's permissions, as they are (default: 0666 less the umask, as for any new
    file); `sync`: on disk before it is renamed. The partial file is removed on any failure, Ctrl-C and
    SystemExit included; an OSError is raised as it is.
    """
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        special = False
    if special:
        with open(path, "wb") as out:
            write(out)
        return
    partial = partial_of(path)
    mode = umasked(0o666) if mode is None else mode
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with open(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # a partial file left by an earlier try keeps its mode otherwise
            write(out)
            if sync:
                out.flush()
                os.fsync(out.fileno())
        partial.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # nothing to remove, or a read-only directory
            partial.unlink()
        raise
