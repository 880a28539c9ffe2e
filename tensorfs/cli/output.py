"""What the commands write: standard output guarded (an error writing it is one line, not a
traceback), tables, a file written whole or not at all, and errors and warnings on standard error
(no URL's user:password in them).

`tensorfs --version` writes through here before click or any command is imported: what more a
function needs (click, the writer, redact) it imports itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..errors import TensorfsError


class OutputError(TensorfsError):
    """Standard output could not be written (a full disk, a closed pipe): the output is lost."""

    def __init__(self, exc: OSError, done: str = "") -> None:
        super().__init__(f"{done}cannot write to standard output: {exc.strerror or exc}")
        self.cause = exc
        self.broken_pipe = exc.errno == errno.EPIPE


_PIECE = 1 << 14
"""Characters of standard output written at once at most (a pipe holds 64 KiB)."""


class GuardedOutput:
    """Standard output for the commands: an error writing it is an OutputError, not a traceback.

    Every command's output (and click's help) goes through it, so every command fails alike.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream  # None: the process was started with standard output closed

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            if len(text) <= _PIECE:
                return self._stream.write(text)
            # Python's buffered writer drops the error of a write that went out in part (`| head`):
            # a long text goes a pipe's worth at a time, each piece flushed, so the error is seen.
            for start in range(0, len(text), _PIECE):
                self._stream.write(text[start : start + _PIECE])
                self._stream.flush()
            return len(text)
        except OSError as exc:
            raise OutputError(exc) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            raise OutputError(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command as Ctrl-C does: what was half-written is removed on the way out."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {number: signal.signal(number, leave) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def write_file(path: Path, text: str) -> None:
    """Write `text` to `path` by the one writer (tensorfs.fs.writer): a new file, or a regular file there
    replaced, whole or not at all; never through a symlink, never into a FIFO or a device. Ctrl-C,
    SIGTERM or SIGHUP meanwhile leave nothing half-written."""
    from ..fs.writer import write_whole

    with ended_by_signals():
        write_whole(path, lambda out: out.write(text.encode("utf-8")))


def table(rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Rows as lines of columns two spaces apart, each column as wide as its widest cell and aligned
    as `align` says ('<' left, '>' right), but the last, which runs free."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(align))]
    return [
        "  ".join(f"{cell:{side}{width}}" for cell, side, width in zip(row, align, widths, strict=False))
        + "  "
        + row[len(align)]
        for row in rows
    ]


def error_lines(lines: Sequence[str], prefix: str = "error: ") -> None:
    """Each line on standard error, after `prefix`: every error and warning a command prints goes
    through here, and never shows a URL's user:password."""
    import click

    from ..sources.store import redact

    with contextlib.suppress(OSError):  # a standard error that cannot be written either: the exit code says it
        for line in lines:
            click.echo(redact(f"{prefix}{line}"), err=True)


def drop_output(stdout: TextIO | None) -> None:
    """Whatever is still buffered for a standard output that failed would fail again at exit."""
    if stdout is not None and stdout is sys.__stdout__:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
