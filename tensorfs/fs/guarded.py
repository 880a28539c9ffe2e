"""Files in places that other users may control, opened so that nobody gains anything by changing them.

tensorfs often runs as root, on a model directory that another user owns, and keeps caches and
records in directories. Two rules follow:

- A file in a model's directory is opened once: beneath that directory (no symlink, no '..'
  leads out of it; a Hugging Face cache snapshot may also reach its repository's blobs), without
  blocking (a FIFO planted there is no hang) and never as a controlling terminal. Everything
  after that — its type, owner, permissions, size, bytes — comes from that descriptor, never from
  the path again, so swapping the file for a symlink or a FIFO after it was looked at changes nothing.
- A path that leads into another file system (a symlink to a blob on another mount, a mount point
  in the directory) may lead into one that never answers (a FUSE daemon stopped, a server gone):
  every file system entered on the way is asked first, within ANSWER_SECONDS, and one that does not
  answer is not entered (Unanswered), nor asked again while the first question still waits.
- A directory that tensorfs writes into (a cache, its records) must be this user's alone: owned by
  them and writable by nobody else, nor any directory above it (but root's and sticky ones, whose
  entries others cannot rename); what is in it is opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from ..errors import TensorfsError, printable
from .syscalls import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV, openat2

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
"""How a file someone else may control is opened: read-only, not inherited, never blocking on a FIFO."""


class UnsafeLocation(TensorfsError):
    """A directory or file that another user could change under tensorfs."""


class NotRegular(OSError):
    """Not a regular file (a FIFO, a device, a socket, a directory): nothing to read from it, and
    never opened to read (a device's open may do something). `kind` says which."""

    kind = "not a regular file"


_KINDS = {
    stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}  # fmt: skip


class Unanswered(OSError):
    """A path that leads into another file system, which did not answer (a hung mount): not entered."""


ANSWER_SECONDS = 2.0
"""How long a file system a path leads into may take to answer a statfs before it is taken for hung."""

Answer = TypeVar("Answer")


def within(timeout: float, name: str, ask: Callable[[], Answer]) -> Answer | str:
    """`ask()` on a thread of its own, or "hung" if it has not returned within `timeout`.

    The thread is left behind if a file system never answers. It ends when the file system does,
    or its FUSE connection is aborted; not with this process: a request a FUSE daemon has taken
    is waited for uninterruptibly, and the process cannot exit before it ends (see
    mount.mounttable.unmount()).
    """
    outcome: list[Answer] = []
    thread = threading.Thread(target=lambda: outcome.append(ask()), name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else "hung"


_unanswered: dict[int, threading.Event] = {}  # mount id -> set once the question that file system left waiting ends
_unanswered_lock = threading.Lock()


def mount_id(fd: int) -> int:
    """The id of the mount an open file is on (as /proc/self/mountinfo numbers them), asked of the
    kernel's table of this process's files: the file system itself is not asked anything."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.EINVAL, "no mount id in /proc/self/fdinfo", str(fd))


def answers(fd: int) -> bool:
    """Whether the file system of the open file `fd` (an O_PATH descriptor will do) answers a statfs
    within ANSWER_SECONDS. One that did not is not asked again until that question has ended: every
    path into a hung mount is refused at once, and no more threads are left waiting on it."""
    mount = mount_id(fd)
    with _unanswered_lock:
        waiting = _unanswered.get(mount)
        if waiting is not None:
            if not waiting.is_set():
                return False
            del _unanswered[mount]
    mine = os.dup(fd)  # the question's own: it may outlive the caller's descriptor
    ended = threading.Event()

    def ask() -> bool:
        try:
            os.fstatvfs(mine)
        except OSError:
            pass  # an answer all the same (a dead FUSE mount answers ENOTCONN at once)
        finally:
            os.close(mine)
            ended.set()
        return True

    if within(ANSWER_SECONDS, f"statfs of mount {mount}", ask) is True:
        return True
    with _unanswered_lock:
        _unanswered[mount] = ended
    return False


def open_beneath(dir_fd: int, relative: str, flags: int = READ_FLAGS, *, same_mount: bool = False) -> int:
    """`relative` opened beneath the directory `dir_fd`: no absolute path, '..' or symlink leads
    out of it (EXDEV); a symlink within it is followed. With `same_mount`, no mount point is
    crossed either (EXDEV): nothing on another file system is asked anything. OSError as os.open
    raises it.

    On a kernel without openat2 (before 5.6) no symlink is followed at all (ELOOP).
    """
    resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | (RESOLVE_NO_XDEV if same_mount else 0)
    try:
        return openat2(dir_fd, relative, flags, resolve)
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
    repository's ../../blobs/: those are followed too, and nothing else out of the snapshot; so are
    those of a folder in a snapshot (snapshots/REV/unet, a pipeline's component), into the same blobs.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(os.path.abspath(path))
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.real = Path(os.readlink(f"/proc/self/fd/{self.fd}"))
        self._repository: int | None = None
        self._answered: set[int] = set()  # the mounts (by id) a walk from here found answering
        snapshot = next((path for path in (self.path, *self.path.parents) if path.parent.name == "snapshots"), None)
        if snapshot is not None:
            with contextlib.suppress(OSError):
                self._repository = os.open(snapshot.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def open(self, relative: str, flags: int = READ_FLAGS) -> int:
        """The file at `relative` (a path in the directory), opened beneath it; OSError if it cannot
        be, EXDEV for a symlink out of it, Unanswered for a path into a file system that does not answer."""
        try:
            return open_beneath(self.fd, relative, flags, same_mount=True)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        # Out of the directory (a symlink to an absolute path in it, a snapshot's link to a blob), or
        # into another file system: walked a step at a time, and what it leads to opened if it may be.
        found = self._walk(relative)
        try:
            if not self._may_open(found):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative)
            return os.open(f"/proc/self/fd/{found}", flags)  # that very file, whatever its path holds now
        finally:
            os.close(found)

    def _may_open(self, found: int) -> bool:
        """Whether a file a walk found is one this directory may lead to: a file in it (through a
        symlink to an absolute path in it), or a snapshot's blob in its repository."""
        real = Path(os.readlink(f"/proc/self/fd/{found}"))
        if real.is_relative_to(self.real) and real != self.real:
            return True
        if self._repository is None:
            return False
        return real.parent == Path(os.readlink(f"/proc/self/fd/{self._repository}")) / "blobs"

    def _within(self, fd: int) -> bool:
        """Whether an open directory is this one or in it (or in a snapshot's repository)."""
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if real.is_relative_to(self.real):
            return True
        return self._repository is not None and real.is_relative_to(os.readlink(f"/proc/self/fd/{self._repository}"))

    def _walk(self, relative: str) -> int:
        """An O_PATH descriptor of what `relative` leads to from the directory, symlinks followed as
        the kernel follows them, but one step at a time: before anything on another file system is
        asked about (its type, a name in it), that file system must answer (Unanswered if not).
        The kernel crosses into a mount without asking it anything; a stat or a lookup in it would
        wait for as long as it does not answer."""
        pending = [part for part in reversed(relative.split("/")) if part not in ("", ".")]
        current = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        links = 0
        try:
            mount = mount_id(current)
            while pending:
                try:
                    step = os.open(pending.pop(), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
                except OSError:
                    if not self._within(current):  # what is not found out of the directory is out of it
                        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative) from None
                    raise
                try:
                    entered = mount_id(step)
                    if entered != mount and entered not in self._answered:
                        if not answers(step):
                            where = os.readlink(f"/proc/self/fd/{step}")  # the kernel's name for it: nothing asked
                            raise Unanswered(
                                errno.ETIMEDOUT,
                                f"leads into another file system ({printable(where)}), which did not answer within "
                                f"{ANSWER_SECONDS:g} s: a hung mount?",
                                relative,
                            )
                        self._answered.add(entered)
                    target = os.readlink("", dir_fd=step) if stat.S_ISLNK(os.fstat(step).st_mode) else None
                except BaseException:
                    os.close(step)
                    raise
                if target is None:
                    os.close(current)
                    current, mount = step, entered
                    continue
                os.close(step)
                links += 1
                if links > 40:  # the kernel's own limit
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), relative)
                pending += [part for part in reversed(target.split("/")) if part not in ("", ".")]
                if target.startswith("/"):
                    os.close(current)
                    current = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    mount = mount_id(current)
            return current
        except BaseException:
            os.close(current)
            raise

    def has(self, name: str) -> bool:
        """Whether the directory holds an entry `name` (a dangling symlink, or a mount point, too),
        told without asking anything of what the entry may lead to (os.path.lexists would ask a
        file system mounted there)."""
        try:
            os.close(open_beneath(self.fd, name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, same_mount=True))
        except OSError as exc:
            return exc.errno == errno.EXDEV  # a mount point (or a path out): there, to be refused when opened
        return True

    def open_regular(self, relative: str) -> tuple[int, os.stat_result]:
        """A regular file beneath the directory and its status, from the one descriptor; NotRegular
        for anything else (found by a descriptor that opens nothing: O_PATH), OSError when it cannot
        be opened."""
        found = self.open(relative, os.O_PATH | os.O_CLOEXEC)
        try:
            st = os.fstat(found)
            if not stat.S_ISREG(st.st_mode):
                refused = NotRegular(errno.EINVAL, "not a regular file", relative)
                refused.kind = _KINDS.get(stat.S_IFMT(st.st_mode), refused.kind)
                raise refused
            fd = os.open(f"/proc/self/fd/{found}", READ_FLAGS)  # that very file, whatever its path holds now
        finally:
            os.close(found)
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
