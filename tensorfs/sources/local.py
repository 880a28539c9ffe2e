"""Shards that are local files: found as the loaders find them (choosing.py), read and validated through one descriptor,
mapped read-only, and read (for hashing) with preadv from that same descriptor."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import formats
from ..caches.headers import WORTH_CACHING
from ..errors import InvalidModelError, Problem, ShardChangedError, printable
from ..formats import ShardHeader, gguf
from ..fs.guarded import ModelDirectory, mounted_under, read_bounded, why_refused
from ..utils.identity import Identity
from .choosing import MAX_COMPONENTS, choose, component, is_model_file, is_pipeline, weights_beside
from .index import MAX_INDEX_BYTES, is_index_name, missing_shard, parse_weight_map, shard_names
from .pages import Handover, Pages
from .shard import ShardData, Within

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..caches.headers import HeaderCache


@dataclass
class FoundShards:
    """A local model's shard files, and its index when it has one."""

    paths: list[Path]
    index_label: str | None = None
    weight_map: dict[str, str] | None = None
    """The index's weight map; None also when the index was known to the header cache and not read."""
    index_key: str | None = None
    """The index file's identity as read (its path and Identity), when there is one."""
    directory: ModelDirectory | None = None
    """The directory the shards were found in, opened once: they are opened beneath it (None: the
    one shard was named itself)."""
    missing: dict[str, Problem] = field(default_factory=dict)
    """Shards the index names that are not there, by file name: what was said of each."""
    parts: tuple[tuple[str, ...], ...] = ()
    """A directory of several models (choosing.Choice.parts), opened as one tree's: each one's files."""

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()


def missing(path: Path) -> Problem | None:
    """The problem of a path that is not there (a dangling symlink is there: its open says why not)."""
    return None if os.path.lexists(path) else Problem(str(path), "no such file or directory")


def find_shards(
    source: Path, problems: list[Problem], cache: HeaderCache | None = None, *, several: bool = False
) -> FoundShards:
    """The shard files of `source`, and the index's weight map when there is one; with `several`,
    a directory of several models is every one's files (FoundShards.parts), else a problem.

    With a cache, an index unchanged since it was last read whole is not read again: the cache
    holds the shard names it gave, and the model's own checks (see model.py) stand for the rest.
    What is mounted inside the directory is not looked into (it may hang): a shard there is skipped,
    with a warning.
    """
    if source.is_dir():
        try:
            directory = ModelDirectory(source)
        except OSError as exc:
            problems.append(Problem(str(source), f"cannot open: {exc.strerror}"))
            return FoundShards([])
        mounted = mounted_under(directory.real)
        try:
            names = sorted(e.name for e in directory.scan())
        except OSError as exc:
            problems.append(Problem(str(source), f"cannot list: {exc.strerror}"))
            return FoundShards([], directory=directory)
        for name in [name for name in names if name in mounted]:
            if is_model_file(name):
                log.warning("%s: skipped: another file system is mounted there", printable(str(source / name)))
            names.remove(name)
        choice = choose(names, str(source))
        if choice.index is not None:
            return _shards_from_index(directory, source / choice.index, problems, cache)
        if several and choice.parts:
            files = [source / name for part in choice.parts for name in part]
            return FoundShards(files, directory=directory, parts=choice.parts)
        if choice.problem is not None:
            problems.append(Problem(str(source), choice.problem))
        return FoundShards([source / name for name in choice.files], directory=directory)
    if is_index_name(source.name) and source.is_file():
        try:
            directory = ModelDirectory(source.parent)
        except OSError as exc:
            problems.append(Problem(str(source.parent), f"cannot open: {exc.strerror}"))
            return FoundShards([])
        return _shards_from_index(directory, source, problems, cache)
    absent = missing(source)
    if absent is not None:
        problems.append(absent)
        return FoundShards([])
    parts = gguf.split_files(source.name)
    if parts is not None and len(parts) > 1:  # a part of a multi-file GGUF: the model is all of them
        return _split_parts(source, parts, problems)
    return FoundShards([source])


def find_pipeline(source: Path, *, beside: bool = False) -> tuple[list[str], bool] | None:
    """The component folders of the diffusers pipeline whose root is `source` (those holding weights,
    sorted), and whether the root holds weights of its own beside them (only with `beside`: else such
    a root is no pipeline's); None when it is none (choosing.is_pipeline). A folder is one of the
    root's own directories, never a symlink to one elsewhere, nor what is mounted there (it may
    hang); the first MAX_COMPONENTS of them are looked into."""
    if not source.is_dir():
        return None
    try:
        with ModelDirectory(source) as directory:
            entries = sorted(directory.scan(), key=lambda entry: entry.name)
            names = [entry.name for entry in entries]
            if not is_pipeline(names, beside=beside):
                return None
            mounted = mounted_under(directory.real)
            folders = [
                entry.name
                for entry in entries
                if not entry.name.startswith(".") and entry.name not in mounted and entry.is_dir(follow_symlinks=False)
            ]
            found = []
            for name in folders[:MAX_COMPONENTS]:
                try:
                    inner = [entry.name for entry in directory.scan(name)]
                except OSError:
                    continue
                if component(inner, str(source / name)) is not None:
                    found.append(name)
            return found, weights_beside(names)
    except OSError:
        return None


def _split_parts(source: Path, parts: list[str], problems: list[Problem]) -> FoundShards:
    try:
        directory = ModelDirectory(source.parent)
    except OSError as exc:
        problems.append(Problem(str(source.parent), f"cannot open: {exc.strerror}"))
        return FoundShards([])
    missing = [name for name in parts if not directory.has(name)]
    if missing:
        why = f"a part of a multi-file GGUF of {len(parts)} files, of which {', '.join(missing)} cannot be found"
        problems.append(Problem(str(source), why))
        return FoundShards([], directory=directory)
    return FoundShards([source.parent / name for name in parts], directory=directory)


def _shards_from_index(
    directory: ModelDirectory, index: Path, problems: list[Problem], cache: HeaderCache | None
) -> FoundShards:
    label = str(index)
    try:
        fd, before = directory.open_regular(index.name)
    except OSError as exc:
        problems.append(Problem(label, f"cannot read: {why_refused(exc)}"))
        return FoundShards([], label, directory=directory)
    try:
        read_as = f"{os.path.abspath(index)}\0{Identity.of(before).key()}"
        if before.st_size < WORTH_CACHING:
            cache = None
        names = cache.get("index", read_as) if cache is not None else None
        if (
            isinstance(names, list)
            and all(isinstance(name, str) for name in names)
            and all(directory.has(name) for name in names)  # else read it, to say which tensor
        ):
            return FoundShards(sorted(index.parent / name for name in names), label, None, read_as, directory)
        # Refused from its size, unread; and as soon as it reads longer (a file that grows meanwhile).
        data = read_bounded(fd, MAX_INDEX_BYTES) if before.st_size <= MAX_INDEX_BYTES else None
        # Written while read, or too lately to tell: what was read is checked, and not remembered.
        unchanged = Identity.of(os.fstat(fd)) == Identity.of(before)
        key = read_as if unchanged and Identity.of(before).settled() else None
    except OSError as exc:
        problems.append(Problem(label, f"cannot read: {exc.strerror}"))
        return FoundShards([], label, directory=directory)
    finally:
        os.close(fd)
    if data is None or len(data) > MAX_INDEX_BYTES:
        problems.append(Problem(label, f"over {MAX_INDEX_BYTES:,} bytes: too large to be an index"))
        return FoundShards([], label, directory=directory)
    known = len(problems)
    weight_map = parse_weight_map(data, label, problems)
    if weight_map is None:
        return FoundShards([], label, directory=directory)
    names = shard_names(weight_map, label, problems)
    if cache is not None and key is not None and len(problems) == known:
        cache.put("index", key, names)
    missing: dict[str, Problem] = {}
    existing = _existing(directory, index, names, weight_map, label, missing)
    problems.extend(missing.values())
    return FoundShards(existing, label, weight_map, key, directory, missing)


def _existing(
    directory: ModelDirectory,
    index: Path,
    names: list[str],
    weight_map: dict[str, str],
    label: str,
    missing: dict[str, Problem],
) -> list[Path]:
    shards = []
    for name in names:
        if directory.has(name):
            shards.append(index.parent / name)
        else:
            missing[name] = missing_shard(label, weight_map, name)
    return sorted(shards)


def open_shard(path: Path, label: str) -> int:
    """Open a shard read-only and return its descriptor, or raise InvalidModelError saying why not."""
    try:
        # O_NONBLOCK: a FIFO given as a shard must not hang the open; regular files ignore it.
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidModelError([Problem(label, f"cannot open: {exc.strerror}")]) from None


def read_header_fd(fd: int, path: Path, label: str) -> ShardHeader:
    """The validated table of the open shard `fd` (the file at `path`, shown as `label`), its bytes
    read from that descriptor."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModelError([Problem(label, "not a regular file")])
        return formats.read_table(
            lambda offset, count: _pread_exactly(fd, count, offset, label), st.st_size, path, label
        )
    except OSError as exc:
        raise InvalidModelError([Problem(label, f"cannot read: {exc.strerror}")]) from None


def read_shard_header(path: Path, label: str | None = None) -> ShardHeader:
    """Read and validate the table of the shard at `path`; `label` names it in messages.

    Raises InvalidModelError listing every problem found. Tensor data is never read.
    """
    label = str(path) if label is None else label
    fd = open_shard(path, label)
    try:
        return read_header_fd(fd, path, label)
    finally:
        os.close(fd)


def _pread_exactly(fd: int, count: int, offset: int, label: str) -> bytes:
    chunks = []
    while count:
        chunk = os.pread(fd, count, offset)
        if not chunk:
            raise InvalidModelError([Problem(label, "file shrank while its header was being read")])
        chunks.append(chunk)
        count -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class LocalDescription:
    """A local shard as validated: enough to open the very same file again, or refuse it."""

    path: Path
    label: str
    identity: Identity
    beneath: Path | None = None
    """The model's directory it was found in, and is opened beneath again (None: named itself)."""


def _worth_caching(fd: int, size: int) -> bool:
    """Whether the shard's table may be long enough to be worth the header cache (WORTH_CACHING):
    a safetensors file's first 8 bytes say how long its header is; another format's table is no
    longer than its file."""
    prefix = os.pread(fd, formats.SNIFF_BYTES, 0)
    if formats.detect(prefix, "").NAME != "safetensors":
        return size >= WORTH_CACHING
    return len(prefix) == 8 and int.from_bytes(prefix, "little") >= WORTH_CACHING


class LocalShard(ShardData):
    """A shard file, mapped read-only through the descriptor it was validated through (kept open)."""

    key: Path

    def __init__(self, path: Path, label: str, fd: int, validated: os.stat_result, beneath: Path | None = None) -> None:
        self.key = path
        self.label = label
        self._beneath = beneath
        self._fd = fd
        self._exact = -1  # a descriptor of the same file that reads no more than asked (_exact_fd): made on first use
        self._validated = validated
        self._mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        self.view = memoryview(self._mapping)
        self._pages: Pages | None = None
        self._handover: Handover | None = None
        self._letting_go = threading.Lock()  # a unit is let go only while the mapping is there
        self._closed = False

    @classmethod
    def open(
        cls, path: Path, label: str, cache: HeaderCache | None = None, directory: ModelDirectory | None = None
    ) -> tuple[ShardHeader, LocalShard]:
        """Read, validate and map the shard at `path`; InvalidModelError saying every problem if not.

        `directory`: the model's directory the shard was found in, which it is opened beneath (a
        symlink out of it is refused). With a cache, a file unchanged since its header was validated
        (same device, inode, size, mtime and ctime) is not read or validated again.

        The shard is known by its absolute path from here on (its key: every table of the model is
        keyed by it, here and in a daemon, which leaves the working directory); `label` names it in
        messages as the user named it.
        """
        path = Path(os.path.abspath(path))
        try:
            path.name.encode("utf-8")
        except UnicodeEncodeError:  # .meta.json and index.json name shards in JSON, which is Unicode
            raise InvalidModelError([Problem(label, "file name is not valid UTF-8; rename the shard")]) from None
        if directory is None:
            fd = open_shard(path, label)
        else:
            try:
                fd = directory.open(path.name)
            except OSError as exc:
                raise InvalidModelError([Problem(label, f"cannot open: {why_refused(exc)}")]) from None
        try:
            validated = os.fstat(fd)
            identity = Identity.of(validated)
            header = None
            if cache is not None and not (stat.S_ISREG(validated.st_mode) and _worth_caching(fd, validated.st_size)):
                cache = None
            if cache is not None:
                header = cache.shard(path, identity.key())
            if header is None:
                header = read_header_fd(fd, path, label)
                if Identity.of(os.fstat(fd)) != identity:
                    raise InvalidModelError([Problem(label, "changed while it was being validated; try again")])
                if cache is not None and identity.settled():
                    cache.put_shard(identity.key(), header)
            # Map the descriptor the header was read from: the bytes served are the bytes validated.
            return header, cls(path, label, fd, validated, directory.path if directory is not None else None)
        except InvalidModelError:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise InvalidModelError([Problem(label, f"cannot map: {exc.strerror}")]) from None

    @classmethod
    def reopen(cls, saved: LocalDescription) -> LocalShard:
        """Map the file validated elsewhere again; InvalidModelError if it is no longer that file."""
        # Absolute from here on: a daemon leaves the directory it was started in.
        path = Path(os.path.abspath(saved.path))
        if saved.beneath is None:
            fd = open_shard(path, saved.label)
        else:  # as it was found: a link into a mount that stopped answering meanwhile is no hang
            try:
                with ModelDirectory(saved.beneath) as directory:
                    fd = directory.open(path.name)
            except OSError as exc:
                raise InvalidModelError([Problem(saved.label, f"cannot open: {why_refused(exc)}")]) from None
        try:
            status = os.fstat(fd)
            if Identity.of(status) != saved.identity:
                raise InvalidModelError([Problem(saved.label, "changed while it was being validated; try again")])
            return cls(path, saved.label, fd, status, saved.beneath)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def reopen_with_header(cls, saved: LocalDescription, cache: HeaderCache) -> tuple[ShardHeader, LocalShard]:
        """reopen(), and the header validated: from the cache, or read again from the same file."""
        shard = cls.reopen(saved)
        try:
            header = cache.shard(shard.key, saved.identity.key()) or read_header_fd(shard._fd, shard.key, saved.label)
        except BaseException:
            shard.close()
            raise
        return header, shard

    @property
    def pages(self) -> Pages:
        if self._pages is None:
            self._pages = Pages(self.view)
        return self._pages

    def ensure(self, start: int, end: int, *, ahead: bool = False, within: Within = None) -> bool:
        return self.pages.populate(start, end)

    def resident(self, start: int, end: int) -> bool:
        return self.pages.resident(start, end)

    def served(self, start: int, end: int) -> None:
        if self._closed:
            return  # its address may be another mapping's now
        if self._handover is None:
            self._handover = Handover(len(self.view))
        self._handover.served(start, end)

    def flush(self) -> None:
        """Let go of the pages served whole since the last flush: off the thread that answers reads,
        for dropping pages costs about 0.1 ms a unit (docs/performance.md), as a remote shard's are."""
        handover = self._handover
        for first, last in handover.taken() if handover is not None else []:
            with self._letting_go:  # a unit at a time: close() waits for one at most
                if self._closed:
                    return  # its address may be another mapping's now
                self.pages.let_go(self._fd, first, last)

    def read_cached(self, offset: int, count: int) -> bytes | None:
        buffer = bytearray(count)
        try:  # a miss starts the disk read of these bytes alone (no read-ahead): the caller's read waits less
            done = os.preadv(self._exact_fd(), [buffer], offset, os.RWF_NOWAIT)
        except OSError:  # EAGAIN: not all in the page cache (the caller reads it off its thread)
            return None
        return bytes(buffer) if done == count else None

    def readinto_exact(self, offset: int, buffer: memoryview) -> None:
        self._readinto(self._exact_fd(), offset, buffer)

    def _exact_fd(self) -> int:
        """The same file (not its path's) through a descriptor of its own that the kernel reads no
        more than asked through (POSIX_FADV_RANDOM): a random reader's 4 KiB read through the shard's
        own descriptor brought its read-ahead window in from the disk first (docs/performance.md)."""
        if self._exact < 0:
            with self._letting_go:
                if self._exact < 0:
                    exact = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
                    os.posix_fadvise(exact, 0, 0, os.POSIX_FADV_RANDOM)
                    self._exact = exact
        return self._exact

    def readinto(self, offset: int, buffer: memoryview) -> None:
        self._readinto(self._fd, offset, buffer)

    def _readinto(self, fd: int, offset: int, buffer: memoryview) -> None:
        """Read the file, not the mapping: a mapped page whose bytes were cut from the file kills the
        process that touches it (SIGBUS); a read just comes up short, which is ShardChangedError."""
        done, size = 0, len(buffer)
        while done < size:
            count = os.preadv(fd, [buffer[done:]], offset + done)
            if count == 0:
                raise ShardChangedError(
                    f"{self.key}: bytes [{offset + done}, {offset + size}) are gone: "
                    "the file shrank after it was validated",
                    lost_from=offset + done,
                )
            done += count

    def identity(self) -> Identity | None:
        # The file held open, not the path: whatever the path leads to now (another file, a link
        # into a mount that does not answer), the bytes read are this file's.
        validated = Identity.of(self._validated)
        try:
            now = Identity.of(os.fstat(self._fd))
        except OSError:
            return None
        return validated if now == validated else None

    def status(self) -> os.stat_result:
        return os.fstat(self._fd)

    def watched(self) -> tuple[int, os.stat_result] | None:
        return self._fd, self._validated

    def describe(self) -> LocalDescription:
        return LocalDescription(self.key, self.label, Identity.of(self._validated), self._beneath)

    def mapped_file(self) -> tuple[int, int]:
        return self._fd, self._validated.st_size

    def close(self) -> None:
        with self._letting_go:
            self._closed = True
        self.close_private(lambda: None)  # a file's mapping needs nothing kept open: it goes with its last view
        for fd in (self._fd, self._exact):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.view.release()
        self._mapping.close()  # BufferError while a view of it is alive: it goes with the last one
