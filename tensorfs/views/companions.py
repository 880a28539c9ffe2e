"""The files that come with a model's weights (config.json, tokenizer files, modules.json, an index,
the signature, ...) and how they are served. Which of them a view takes is the rule's to say
(FileRule: opening/view_files.py holds it); this module and the finders only ask it.

They are found at mount (local_files.py, remote_files.py) and served from where they are, when
they are read: a local file through a descriptor opened beneath the model's directory (and only
while it holds what it held when found: its content decides, not its times), a remote one through
the chunk cache, like the weights. The daemon holds none of their bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import RemoteError, TensorfsError
from ..fs.guarded import ModelDirectory, why_refused
from ..sources.client import head
from ..sources.store import ObjectRef, ObjectVersion, RemoteOptions
from ..utils.identity import Identity
from ..utils.names import MAX_PATH_DEPTH

log = logging.getLogger(__name__)

MAX_FILES = 100_000
"""The most files of a model's folder a view takes (its weights files among them); past it, the
rest is left out, the top's first kept (what a loader needs most lies there)."""
MAX_DEPTH = MAX_PATH_DEPTH
"""How deep in a model's folder a view takes files: a file 16 levels down, no deeper."""
HASHED_BYTES = 64 << 20
HASHED_TOTAL = 256 << 20
"""A local companion is hashed when found (then a copy of the same bytes, or a chmod, serves on) if
it is at most HASHED_BYTES, while those hashed come to at most HASHED_TOTAL; any other is served
while it is the very file found (its identity: a change of it answers EIO, never other bytes)."""
SCAN_SECONDS = 30.0
"""How long the scan of a model's directory for them may take (past it, the rest is left out)."""
_DIGEST_BLOCK = 1 << 20
MAX_NAMING_FILE = 1 << 20
"""modules.json and config files read at mount to find the files they name: larger ones are not followed."""


@dataclass(frozen=True)
class LocalOrigin:
    """A companion file in a local model's directory, as found: served while it holds what it held then."""

    directory: Path
    identity: Identity
    digest: bytes | None
    """The SHA-256 of its content when found: a file whose identity moved (a chmod moves its ctime)
    is the same file if its content is the same. None: not hashed (past HASHED_BYTES or
    HASHED_TOTAL), served while it is the very file found."""


@dataclass(frozen=True)
class RemoteOrigin:
    """A companion object in a store, read through the chunk cache (at its version, once known)."""

    ref: ObjectRef
    options: RemoteOptions
    version: ObjectVersion | None = None
    """Known from a listing (S3) or a HEAD (HTTP); None: asked for at the first read (the Hub's listing)."""


@dataclass(frozen=True)
class Companion:
    path: str
    """Relative to the model's directory: config.json, 1_Pooling/config.json (a name that is not
    UTF-8 keeps its bytes as surrogate escapes, as os.fsdecode makes them)."""
    size: int
    mtime_ns: int
    status: os.stat_result | None
    """The source file's, for its owner and permissions (None: a remote object's, the source's apply)."""
    origin: LocalOrigin | RemoteOrigin
    content: bytes | None = field(default=None, repr=False)
    """Its bytes as they were proven, served from here whatever becomes of the file (a signature's
    own, as it was verified); None: read from where it is."""
    unsearchable: int = 0
    """The read bits the folders it is in take away (those of whoever a folder grants no search)."""


class CompanionError(TensorfsError):
    """A companion file that cannot be served now: gone, or changed (its store's failures are RemoteErrors)."""


class CompanionFiles:
    """The companion files of a view, opened on their first read and kept open: read(path, offset, size)."""

    def __init__(self, companions: Iterable[Companion]) -> None:
        self.by_path = {c.path: c for c in companions}
        self._lock = threading.Lock()
        self._open: dict[str, _LocalFile | Any] = {}  # path -> a _LocalFile, or a RemoteShard

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of a companion file (blocking: call it from a worker thread)."""
        companion = self.by_path[path]
        size = max(0, min(size, companion.size - offset))
        if size == 0:
            return b""
        if companion.content is not None:
            return companion.content[offset : offset + size]
        opened = self._opened(companion)
        if isinstance(opened, _LocalFile):
            return opened.read(offset, size)
        buffer = bytearray(size)
        try:
            opened.readinto(offset, memoryview(buffer))
        except RemoteError:  # (its message names the object's URL already)
            raise
        except TensorfsError as exc:
            raise CompanionError(str(exc)) from None
        return bytes(buffer)

    def status(self, path: str) -> os.stat_result | None:
        """A local companion's status now, for its owner and permissions (a chmod or a chown after the
        mount is followed, as a shard's is), its size and mtime as found; None for a remote one (its
        source's apply). Blocking: the file is looked up beneath the model's directory. As found
        when it cannot be looked up (its reads then say why)."""
        companion = self.by_path[path]
        origin, found = companion.origin, companion.status
        if not isinstance(origin, LocalOrigin) or found is None:
            return found
        try:
            with ModelDirectory(origin.directory) as directory:
                fd = directory.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                now = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError:
            return found
        mode = now.st_mode & ~companion.unsearchable
        return os.stat_result((mode, *found[1:4], now.st_uid, now.st_gid, *found[6:10]))

    def _opened(self, companion: Companion) -> Any:
        with self._lock:
            found = self._open.get(companion.path)
            if found is None:
                local = isinstance(companion.origin, LocalOrigin)
                found = self._open[companion.path] = _LocalFile(companion) if local else _open_remote(companion)
            return found

    def close(self) -> None:
        with self._lock:
            opened, self._open = self._open, {}
        for found in opened.values():
            found.close()


class _LocalFile:
    """A local companion as it is served: the file at its path now, while it holds what the companion
    held when it was found. Its content decides, not its times: a file whose identity moved (a chmod
    moves its ctime; a copy of the same bytes put in its place is another inode) is read again and
    served if it holds the same bytes; anything else at its path (other bytes, a symlink out of the
    model's directory, a FIFO, nothing) is a CompanionError."""

    def __init__(self, companion: Companion) -> None:
        assert isinstance(companion.origin, LocalOrigin)
        self.companion = companion
        self.origin = companion.origin
        self._lock = threading.Lock()  # a descriptor is replaced (and closed) only while no read uses it
        self._fd = -1
        self._identity: Identity | None = None

    def read(self, offset: int, size: int) -> bytes:
        path = self.companion.path
        with self._lock:
            try:
                if self._fd < 0 or Identity.of(os.fstat(self._fd)) != self._identity:
                    self._reopen()
                data = os.pread(self._fd, size, offset)
            except OSError as exc:
                raise CompanionError(f"{path}: cannot read: {exc.strerror}") from None
        if len(data) != size:
            raise CompanionError(f"{path}: shorter than when it was mounted")
        return data

    def _reopen(self) -> None:
        """Take the file at the companion's path, opened beneath the model's directory, if it holds
        what the companion held (hashed, unless it is the very file found, unchanged)."""
        path = self.companion.path
        try:
            with ModelDirectory(self.origin.directory) as directory:
                fd, st = directory.open_regular(path)
        except OSError as exc:
            raise CompanionError(f"{path}: cannot open: {why_refused(exc)}") from None
        try:
            identity = Identity.of(st)
            if identity != self.origin.identity and (
                self.origin.digest is None
                or st.st_size != self.companion.size
                or content_digest(fd, st.st_size) != self.origin.digest
                or Identity.of(os.fstat(fd)) != identity  # written to while it was read: not what was hashed
            ):
                raise CompanionError(f"{path}: changed since it was mounted; mount again to serve it")
        except BaseException:
            os.close(fd)
            raise
        self.close_file()
        self._fd, self._identity = fd, identity

    def close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        with self._lock:
            self.close_file()


def _open_remote(companion: Companion) -> Any:
    """The companion's object read through the cache, at the version found (or its size then)."""
    origin = companion.origin
    assert isinstance(origin, RemoteOrigin)
    from ..sources.remote import RemoteShard  # the remote machinery, only when needed

    version = origin.version
    if version is None:
        version = head(origin.ref)  # (a RemoteError says why not)
        if version is None:
            raise CompanionError(f"{origin.ref.url}: listed, and not there now (404)")
    if version.size != companion.size:
        raise CompanionError(f"{origin.ref.url}: {version.size} bytes now, not {companion.size}: it changed")
    return RemoteShard.of(version, origin.options)


class Skipped:
    """Files left out, by reason: one warning a reason, however many (a lying listing, or a directory
    another user fills, may hold a million), saying the first as it is and counting the others."""

    def __init__(self) -> None:
        self._by_reason: dict[str, tuple[str, int]] = {}  # reason -> (what is said of the first, how many)

    def add(self, reason: str, said: str) -> None:
        first, count = self._by_reason.get(reason, (said, 0))
        self._by_reason[reason] = (first, count + 1)

    def said(self) -> list[str]:
        return [
            first + (f" (and {count - 1} more files skipped: {reason})" if count > 1 else "")
            for reason, (first, count) in self._by_reason.items()
        ]


# -- what a folder holds ----------------------------------------------------------------------


@dataclass
class FolderFiles:
    """What a model's directory holds besides the model's own weights, as a view takes it."""

    companions: list[Companion] = dataclasses.field(default_factory=list)
    weights: list[str] = dataclasses.field(default_factory=list)
    """Weights files that are not the model's (a view of the folder only), by path: each is opened and
    validated as a model of its own, and served through its gate."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """Files left out, and why (one line a reason)."""
    directories: dict[str, os.stat_result] = dataclasses.field(default_factory=dict)
    """The subdirectories files come from (a local model's): their owners and permissions."""


class FileRule(Protocol):
    """Which files of a model's folder its view takes (opening/view_files.py ViewRule is the rule):
    what the finders ask of each path they meet."""

    @property
    def folder(self) -> bool:
        """A view of the model's own folder (else synthesized)."""
        ...

    def left_out(self, path: str) -> str | None:
        """Why a file or folder is never taken, nor looked into (None: it may be)."""
        ...

    def takes(self, path: str) -> bool:
        """Whether the view holds the file."""
        ...

    def weights(self, path: str) -> bool:
        """Whether a file the view takes is served as a model of its own, not read as bytes."""
        ...


def content_digest(fd: int, size: int) -> bytes:
    """The SHA-256 of the first `size` bytes of the open file `fd` (read with pread: its position stays)."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_DIGEST_BLOCK, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.digest()
