"""Files in places that other users may control, opened so that nobody gains anything by changing them.

tensorfs often runs as root, on a model directory that another user owns, and keeps caches and
records in directories. Two rules follow:

- A file in a model's directory is opened once: beneath that directory (no symlink, no '..'
  leads out of it; a Hugging Face cache snapshot may also reach its repository's blobs), without
  blocking (a FIFO planted there is no hang) and never as a controlling terminal. Everything
  after that — its type, owner, permissions, size, bytes — comes from that descriptor, never from
  the path again, so swapping the file for a symlink or a FIFO after it was looked at changes nothing.
- A directory that tensorfs writes into (a cache, its records) must be this user's alone: owned by
  them and writable by nobody else, nor any directory above it (but root's and sticky ones, whose
  entries others cannot rename); what is in it is opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from .errors import TensorfsError
from .syscalls import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, openat2

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
"""How a file someone else may control is opened: read-only, not inherited, never blocking on a FIFO."""


class UnsafeLocation(TensorfsError):
    """A directory or file that another user could change under tensorfs."""


class NotRegular(OSError):
    """Opened, but not a regular file (a FIFO, a device, a directory): nothing to read from it."""


def open_beneath(dir_fd: int, relative: str, flags: int = READ_FLAGS) -> int:
    """`relative` opened beneath the directory `dir_fd`: no absolute path, '..' or symlink leads
    out of it (EXDEV); a symlink within it is followed. OSError as os.open raises it.

    On a kernel without openat2 (before 5.6) no symlink is followed at all (ELOOP).
    """
    try:
        return openat2(dir_fd, relative, flags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or relative.startswith("/"):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative)
    current = dir_fd
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != dir_fd:
                os.close(current)
            current = inner
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=current)
    finally:
        if current != dir_fd:
            os.close(current)


class ModelDirectory:
    """A model's directory, opened once: its files and subdirectories are opened beneath it.

    A Hugging Face cache snapshot (…/models--ORG--NAME/snapshots/REV) holds symlinks to its
    repository's ../../blobs/: those are followed too, and nothing else out of the snapshot.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(os.path.abspath(path))
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.real = Path(os.readlink(f"/proc/self/fd/{self.fd}"))
        self._repository: int | None = None
        if self.path.parent.name == "snapshots":
            with contextlib.suppress(OSError):
                self._repository = os.open(self.path.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def open(self, relative: str, flags: int = READ_FLAGS) -> int:
        """The file at `relative` (a path in the directory), opened beneath it; OSError if it cannot
        be, EXDEV for a symlink out of it."""
        try:
            return open_beneath(self.fd, relative, flags)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        # A symlink to an absolute path within the directory: followed as the path it is in it (and
        # still opened beneath it, so that a link changed meanwhile cannot lead out).
        real = Path(os.path.realpath(self.path / relative))
        if real.is_relative_to(self.real) and real != self.real:
            return open_beneath(self.fd, str(real.relative_to(self.real)), flags)
        if self._repository is None:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative)
        # A snapshot's file: a link to its repository's blobs, resolved from the repository.
        fd = open_beneath(self._repository, f"snapshots/{self.path.name}/{relative}", flags)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        repository = self.path.parent.parent
        if Path(target).parent == Path(os.path.realpath(repository)) / "blobs":
            return fd
        os.close(fd)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative)

    def open_regular(self, relative: str) -> tuple[int, os.stat_result]:
        """A regular file beneath the directory and its status, from the one descriptor; NotRegular
        for anything else, OSError when it cannot be opened."""
        fd = self.open(relative)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegular(errno.EINVAL, "not a regular file", relative)
        return fd, st

    def scan(self, relative: str = "") -> Iterator[os.DirEntry[str]]:
        """The entries of a directory beneath this one (itself by default), without following a
        symlink to one elsewhere; OSError when it cannot be listed."""
        fd = os.dup(self.fd) if not relative else self.open(relative, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with os.scandir(fd) as entries:
                yield from entries
        finally:
            os.close(fd)

    def status(self, relative: str = "") -> os.stat_result:
        """A subdirectory's status (or the directory's own), through a descriptor opened beneath it."""
        if not relative:
            return os.fstat(self.fd)
        fd = self.open(relative, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in (self.fd, self._repository):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd, self._repository = -1, None

    def __enter__(self) -> ModelDirectory:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def read_bounded(fd: int, limit: int) -> bytes:
    """At most `limit` bytes of an open file (one more tells the caller it holds more)."""
    chunks: list[bytes] = []
    left = limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- directories this user writes into ------------------------------------------------------


def private_directory(path: Path, *, what: str, mode: int = 0o700) -> Path:
    """`path`, made if missing (with `mode`), as a directory only this user can change; UnsafeLocation
    (saying what to do) if another user could: it, or a directory above it, is not a directory,
    is a symlink, is another user's, or is writable by another user."""
    path = Path(os.path.abspath(path))
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafeLocation(f"cannot use {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeLocation(f"{what} {path} is a symlink: name the directory it leads to")
    why = _unsafe(st, own=True)
    if why is not None:
        raise UnsafeLocation(f"{what} {path} {why}")
    for above in path.parents:
        try:
            st = os.stat(above)
        except OSError as exc:
            raise UnsafeLocation(f"cannot use {what} {path}: {above}: {exc.strerror}") from None
        why = _unsafe(st, own=False)
        if why is not None:
            raise UnsafeLocation(f"{what} {path} lies in {above}, which {why}")
    return path


def _unsafe(st: os.stat_result, *, own: bool) -> str | None:
    """Why a directory lets another user change what is in it (None: it does not)."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != me and (own or st.st_uid != 0):
        return f"belongs to user {st.st_uid}: other users could change what tensorfs keeps there"
    if st.st_mode & 0o022 and not (not own and st.st_mode & stat.S_ISVTX):
        who = "every user" if st.st_mode & 0o002 else f"group {st.st_gid}"
        return (
            f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): other users could change what "
            "tensorfs keeps there; chmod go-w it, or use another directory"
        )
    return None


def why_refused(exc: OSError) -> str:
    """Why a file of a model's directory could not be opened, in words."""
    if exc.errno == errno.EXDEV:
        return "a symlink out of the model's directory"
    if isinstance(exc, NotRegular):
        return "not a regular file"
    return exc.strerror or str(exc)


def check_private_file(path: Path, *, what: str) -> None:
    """A file tensorfs keeps in a private directory must be a regular file of this user's that
    nobody else can write (not a symlink, nor left there by another user); UnsafeLocation if not.
    A missing file is fine (it will be made)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeLocation(f"cannot use {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeLocation(f"{what} {path} is a symlink: remove it")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeLocation(f"{what} {path} is not a regular file: remove it")
    if st.st_uid != os.geteuid():
        raise UnsafeLocation(f"{what} {path} belongs to user {st.st_uid}, not to this one: remove it")
    if st.st_mode & 0o022:
        raise UnsafeLocation(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): remove it"
        )


def make_private_file(path: Path, *, what: str) -> None:
    """Make sure `path` exists as a file of this user's, readable by them alone (an empty one if
    missing); a database given this file keeps its mode for the journals it makes beside it."""
    check_private_file(path, what=what)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UnsafeLocation(f"cannot use {what} {path}: {exc.strerror}") from None
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def mounted_under(directory: Path) -> set[str]:
    """The mount points beneath `directory`, relative to it ("sub", "sub/inner"): what a scan of
    the directory must not enter (another file system, and maybe one that hangs)."""
    top = os.path.abspath(directory).rstrip("/") + "/"
    found = set()
    with (
        contextlib.suppress(OSError),
        open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table,
    ):
        for line in table:
            fields = line.split(" ")
            if len(fields) > 4:
                point = unescape_mountinfo(fields[4])
                if point.startswith(top):
                    found.add(point[len(top) :])
    return found


def unescape_mountinfo(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as octal escapes.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
