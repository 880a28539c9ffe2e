"""The errors tensorfs raises for bad input; each carries the exit code the CLI uses for it."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    SafetensorError = Exception
else:
    try:  # what code written for safetensors catches: tensorfs's refusals of a file are one too
        from safetensors import SafetensorError
    except ImportError:  # safetensors is optional: then nothing expects its error

        class SafetensorError(Exception):
            """Stands in for safetensors' SafetensorError, safetensors not being installed."""


def printable(text: str) -> str:
    """Escape control characters and lone surrogates, so that one message stays one readable line."""
    if text.isprintable():
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    out = []
    for ch in text:
        code = ord(ch)
        if ch.isprintable() and not 0xD800 <= code <= 0xDFFF:
            out.append(ch)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a model: the file it is in, the tensor (if any) and why."""

    file: str
    reason: str
    tensor: str | None = None

    def __str__(self) -> str:
        where = printable(self.file)
        if self.tensor is not None:
            where += f": tensor '{printable(self.tensor)}'"
        return f"{where}: {printable(self.reason)}"  # a reason may quote what the file holds


class TensorfsError(Exception):
    """Base class of every error tensorfs raises on purpose (never a bug)."""

    exit_code = 1

    def lines(self) -> list[str]:
        """The message as the one-line-per-problem form the CLI prints."""
        return str(self).splitlines() or [type(self).__name__]


class InvalidModelError(TensorfsError, SafetensorError):
    """The model breaks the safetensors rules or tensorfs's naming rules; lists every problem. A
    safetensors.SafetensorError too (when safetensors is installed), as safetensors' refusal is."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ModelNotFound(InvalidModelError, FileNotFoundError):
    """A model named by a path that is not there: a FileNotFoundError too (errno ENOENT, its
    filename), as safetensors raises for a file that is not there."""

    def __init__(self, problem: Problem) -> None:
        super().__init__([problem])
        self.errno, self.strerror, self.filename = errno.ENOENT, os.strerror(errno.ENOENT), problem.file

    def __str__(self) -> str:  # safetensors' words (code written for it matches them), not OSError's "[Errno 2] ..."
        return f"No such file or directory: {printable(self.problems[0].file)}"

    def lines(self) -> list[str]:  # the CLI's: the file first, as every other line it prints
        return [str(p) for p in self.problems]

    def __reduce__(self) -> tuple[type[ModelNotFound], tuple[Problem]]:
        return type(self), (self.problems[0],)


class TensorNotFound(TensorfsError, KeyError, SafetensorError):
    """A tensor was asked for by a name the model does not hold: a KeyError too, as a dict's would be,
    and a SafetensorError, as safetensors' get_tensor raises."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SliceError(TensorfsError, IndexError, SafetensorError):
    """A slice safetensors refuses (raising its SafetensorError, as this is one too): a numpy slice its
    numpy slices do not take, or any slice of a tensor given as its raw bytes. An IndexError too, as
    numpy's would be."""


class IntegrityError(TensorfsError):
    """A tensor's bytes do not hash to what its manifest says."""

    def __init__(
        self,
        message: str,
        tensor: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
        span: tuple[int, int] | None = None,
    ):
        super().__init__(message)
        self.tensor = tensor
        self.expected = expected
        """The manifest's SHA-256 (hex)."""
        self.actual = actual
        """The SHA-256 the bytes have (hex)."""
        self.span = span
        """The bytes [start, end) of the file that are not the signed ones, when a signature's range
        (not the tensor's own bytes) was what they failed."""


class MountError(TensorfsError):
    """A mount or unmount could not be done (bad mountpoint, FUSE unavailable, daemon failed)."""


class ModelClosedError(TensorfsError, SafetensorError):
    """A model's data was asked for after the model was closed: a SafetensorError too, in
    safetensors' words ("File is closed"), as its closed handle raises."""

    def __init__(self, source: object) -> None:
        super().__init__(
            f"File is closed: model {printable(str(source))} was closed; its tensors can no longer be read"
        )
        self.source = source

    def __reduce__(self) -> tuple[type[ModelClosedError], tuple[object]]:
        return type(self), (self.source,)


class RefusedArgument(TensorfsError, ValueError, SafetensorError):
    """A framework, a device or a backend safetensors does not take either: a SafetensorError too, as
    its refusal is, said as it says it ("framework jax is invalid"), then why."""


class ShardChangedError(TensorfsError):
    """A shard's bytes are no longer the ones validated: the file shrank or was written under tensorfs."""

    def __init__(self, message: str, lost_from: int | None = None) -> None:
        super().__init__(message)
        self.lost_from = lost_from
        """Where in the shard the bytes ran out, when that is what happened."""


class RemoteError(TensorfsError):
    """An object could not be read from its store (after the retries the error allows)."""


class AccessDenied(RemoteError):
    """The store refused the request (401, 403)."""


class ObjectChanged(RemoteError):
    """An object was replaced in its store since it was validated: its other bytes are not to be mixed in."""


class TooLarge(RemoteError):
    """An object over the size asked for: its body was not read (or not past the limit)."""


class Unexpected(RemoteError):
    """An answer that is not what was asked for: more bytes than the range, or an encoding."""
