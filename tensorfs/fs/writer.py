"""The one writer: every file tensorfs writes at a path it is given is written here (a manifest with
-o, an exported model file or directory, a daemon's record, benchmark results), and the log it
appends to is opened here.

A path is looked up once: the directory it names a file in is opened, and everything after goes
through that descriptor (and the descriptors of what was made in it), never through a path again.

- A file is made new beside its destination, under a hidden name of its own (O_CREAT|O_EXCL|
  O_NOFOLLOW: never a file that was there, never through a symlink), written, and renamed to the
  destination's name at the end (renameat2; RENAME_NOREPLACE when nothing may be replaced): a reader
  sees the old file or the new one, never half of one, and no byte goes into anything that was there.
- A directory is made new the same way: a hidden partial directory (mkdirat, 0700: nobody else can
  put anything in it), filled only through its descriptor (mkdirat, openat beneath it, no symlink
  followed), renamed to its name with RENAME_NOREPLACE.
- What is at the destination already: a regular file may be replaced, when the caller allows it
  (its name is renamed over: a symlink planted there meanwhile is replaced, never followed); a
  symlink, a FIFO, a device or a directory is refused, and nothing is written to it.
- Before the rename, the partial's name must still be the file or directory that was written: one
  moved or swapped meanwhile (by another user who can write the directory) is an error, nothing
  renamed, and what was written is taken back through the descriptor it was written by (a file
  emptied, a directory's contents removed), wherever its name went. Another user who can write the
  destination's directory can still rename what is there afterwards: such a directory is theirs as
  much as the writer's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import TensorfsError, printable
from .syscalls import RENAME_NOREPLACE, renameat2

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WriteError(TensorfsError):
    """A file could not be written where it was asked for (nothing half-written is left there)."""


def umasked(mode: int) -> int:
    """`mode` less this process's umask: what a file made with it gets."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_whole(
    path: Path,
    write: Callable[[BinaryIO], object],
    *,
    mode: int | None = None,
    sync: bool = False,
    replace: bool = True,
    existing: Callable[[os.stat_result], None] | None = None,
) -> None:
    """Write the file at `path` with `write(out)`, whole or not at all (see the module's docstring).

    `mode`: the new file's permissions, as they are (default: 0666 less the umask, as for any new
    file); `sync`: on disk before it is renamed; `replace`: a regular file at `path` is replaced
    (else anything there is an error: "already exists"); `existing`: called with the status of the
    regular file found at `path`, before anything is written, to refuse it by raising. The partial
    file is removed on any failure, Ctrl-C and SystemExit included. WriteError for what cannot be
    written, an OSError of `write` included.
    """
    mode = umasked(0o666) if mode is None else mode
    with _Destination(path) as destination:
        destination.check(replace=replace, kind="file", existing=existing)
        with destination.written("file", replace=replace) as fd, open(fd, "wb", closefd=False) as out:
            write(out)
            out.flush()
            os.fchmod(fd, mode)
            if sync:
                os.fsync(fd)


@contextlib.contextmanager
def write_directory(path: Path) -> Iterator[NewDirectory]:
    """A new directory at `path` (which must not exist), filled through the NewDirectory yielded and
    put in place when the block ends, whole or not at all (see the module's docstring): on any
    failure what was made is removed. WriteError for what cannot be written."""
    with _Destination(path) as destination:
        destination.check(replace=False, kind="directory")
        with destination.written("directory", replace=False) as fd:
            yield NewDirectory(fd, destination.shown)
            os.fchmod(fd, umasked(0o777))


def refuse_existing(path: Path, kind: str) -> None:
    """WriteError ("already exists") if anything is at `path`: a new file or directory is wanted there.
    (Only an early word: the writer's own rename is what never replaces it.)"""
    with _Destination(path) as destination:
        destination.check(replace=False, kind=kind)


def open_append(path: Path, mode: int = 0o600) -> int:
    """A file at `path` opened to append to (a log), made with `mode` if missing: never through a
    symlink at its name, never blocking, and only a regular file. OSError if it cannot be."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO nobody reads, or a device
            why = "a symlink" if exc.errno == errno.ELOOP else "not a regular file"
            raise OSError(exc.errno, why, str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


class NewDirectory:
    """A directory being written (see write_directory): what is made in it is made through its
    descriptor, at relative paths of plain names, never through a symlink."""

    def __init__(self, fd: int, shown: str) -> None:
        self._fd = fd
        self._shown = shown

    def mkdir(self, relative: str, mode: int) -> None:
        """A subdirectory (its parent made first), given `mode`."""
        parent, name = self._parent_of(relative)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, _DIRECTORY, dir_fd=parent)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        finally:
            if parent != self._fd:
                os.close(parent)

    def create(self, relative: str, mode: int) -> BinaryIO:
        """A new file, open to write (made with `mode` less the umask)."""
        parent, name = self._parent_of(relative)
        try:
            return open(os.open(name, _NEW_FILE, mode, dir_fd=parent), "wb")
        finally:
            if parent != self._fd:
                os.close(parent)

    def _parent_of(self, relative: str) -> tuple[int, str]:
        parts = relative.split("/")
        if any(part in ("", ".", "..") or "\0" in part for part in parts):
            raise WriteError(f"cannot write {self._shown}: {printable(relative)} is not a plain relative path")
        current = self._fd
        try:
            for part in parts[:-1]:
                inner = os.open(part, _DIRECTORY, dir_fd=current)
                if current != self._fd:
                    os.close(current)
                current = inner
        except BaseException:
            if current != self._fd:
                os.close(current)
            raise
        return current, parts[-1]


class _Destination:
    """Where a path names a file: its directory, opened once, and the name in it."""

    def __init__(self, path: Path) -> None:
        self.shown = printable(str(path))
        self.name = path.name
        if self.name in ("", ".", ".."):
            raise self.error("not a file name")
        try:
            self.fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise self.error(exc.strerror or str(exc)) from None

    def error(self, why: str) -> WriteError:
        return WriteError(f"cannot write {self.shown}: {why}")

    def check(self, *, replace: bool, kind: str, existing: Callable[[os.stat_result], None] | None = None) -> None:
        """Refuse what is at the name now: anything, unless `replace`; then anything but a regular file."""
        try:
            st = os.stat(self.name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self.error(exc.strerror or str(exc)) from None
        if not replace:
            raise WriteError(f"{self.shown}: already exists; name a new {kind}")
        if stat.S_ISLNK(st.st_mode):
            raise self.error("a symlink (tensorfs never writes through one: name its target, or remove it)")
        if not stat.S_ISREG(st.st_mode):
            raise self.error("not a regular file")
        if existing is not None:
            existing(st)

    def new_file(self) -> tuple[str, int]:
        """A new, empty file beside the destination, this process's own: (its name, its descriptor)."""
        while True:
            partial = self._partial_name()
            try:
                return partial, os.open(partial, _NEW_FILE, 0o600, dir_fd=self.fd)
            except FileExistsError:
                continue  # (a name of 48 random bits taken: someone else's)
            except OSError as exc:
                raise self.error(exc.strerror or str(exc)) from None

    def new_directory(self) -> tuple[str, int]:
        """A new, empty directory beside the destination, this user's alone: (its name, its descriptor)."""
        while True:
            partial = self._partial_name()
            try:
                os.mkdir(partial, 0o700, dir_fd=self.fd)
                fd = os.open(partial, _DIRECTORY, dir_fd=self.fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise self.error(exc.strerror or str(exc)) from None
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:  # swapped as it was made
                os.close(fd)
                raise self.error(f"{printable(partial)} was replaced as it was made")
            return partial, fd

    @contextlib.contextmanager
    def written(self, kind: str, *, replace: bool) -> Iterator[int]:
        """A new partial file or directory (`kind`) beside the destination, its descriptor for the
        block to fill, renamed into place when the block ends. On any failure, what was written is
        taken back through the descriptor, wherever its name went (a file emptied, a directory's
        contents removed), the partial's name removed while it is still the partial's, and an OSError
        said as a WriteError. The descriptor is closed after."""
        partial, fd = self.new_file() if kind == "file" else self.new_directory()
        made = os.fstat(fd)
        try:
            yield fd
            self.finish(partial, made, replace=replace, kind=kind)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                if kind == "file":
                    os.ftruncate(fd, 0)
                else:
                    _empty(fd)
            self.discard(partial, made, directory=kind == "directory")
            if isinstance(exc, OSError):
                raise self.error(exc.strerror or str(exc)) from None
            raise
        finally:
            os.close(fd)

    def finish(self, partial: str, written: os.stat_result, *, replace: bool, kind: str) -> None:
        """Rename the partial to the destination's name, if the partial's name is still what was written."""
        if not _same(_status_of(partial, self.fd), written):
            raise self.error(
                f"its partial {kind} {printable(partial)} was moved or replaced while it was written "
                "(by someone else who can write its directory)"
            )
        try:
            renameat2(self.fd, partial, self.fd, self.name, 0 if replace else RENAME_NOREPLACE)
            return
        except OSError as exc:
            if exc.errno == errno.EEXIST or (exc.errno == errno.ENOTEMPTY and not replace):
                raise WriteError(f"{self.shown}: already exists; name a new {kind}") from None
            if replace or exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise self.error(exc.strerror or str(exc)) from None
        # A file system without RENAME_NOREPLACE (NFS, some FUSE): a link never replaces either.
        if kind == "file":
            try:
                os.link(partial, self.name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            except FileExistsError:
                raise WriteError(f"{self.shown}: already exists; name a new {kind}") from None
            except OSError as exc:
                raise self.error(exc.strerror or str(exc)) from None
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=self.fd)
            return
        try:  # a directory cannot be linked: renamed, it replaces at most an empty directory
            renameat2(self.fd, partial, self.fd, self.name, 0)
        except OSError as exc:
            raise self.error(exc.strerror or str(exc)) from None

    def discard(self, partial: str, written: os.stat_result, *, directory: bool) -> None:
        """Remove the partial, if its name is still what was written (never what took its place)."""
        if not _same(_status_of(partial, self.fd), written):
            return
        with contextlib.suppress(OSError):
            if directory:
                os.rmdir(partial, dir_fd=self.fd)  # (an rmdir removes nothing but an empty directory)
            else:
                os.unlink(partial, dir_fd=self.fd)

    def _partial_name(self) -> str:
        short = os.fsdecode(os.fsencode(self.name)[:200])  # room for the rest within 255 bytes
        return f".{short}.{secrets.token_hex(6)}.partial"

    def __enter__(self) -> _Destination:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)


def _status_of(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _same(a: os.stat_result | None, b: os.stat_result) -> bool:
    return a is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _empty(fd: int) -> None:
    """Remove everything in the directory `fd`, through descriptors (nothing outside it is touched)."""
    with os.scandir(fd) as entries:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_directory in found:
        if is_directory:
            inner = os.open(name, _DIRECTORY, dir_fd=fd)
            try:
                _empty(inner)
            finally:
                os.close(inner)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
