"""What each daemon leaves outside its mount: a record per mount and a lock per mountpoint.

The tools (`status`, `umount`, `mount`) must never block on a mount whose daemon hangs, so nothing
they need is read through a mount: each daemon keeps a JSON record of itself in a runtime
directory (written atomically, removed on a clean exit, kept with the reason on a failing one),
and `mount` takes an exclusive lock per mountpoint for the whole check-and-mount.

Runtime directory: $TENSORFS_RUNTIME_DIR if set; as root /run/tensorfs; otherwise
$XDG_RUNTIME_DIR/tensorfs, or /tmp/tensorfs-UID when there is no XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MountError
from ..fs.guarded import UnsafeLocation, private_directory, read_bounded
from ..fs.writer import write_whole
from ..sources.store import redact

SYSTEM_DIR = Path("/run/tensorfs")


def runtime_dir() -> Path:
    """Where this user's daemons keep their records and locks (see the module's docstring)."""
    chosen = os.environ.get("TENSORFS_RUNTIME_DIR")
    if chosen:
        return Path(chosen)
    if os.geteuid() == 0:
        return SYSTEM_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "tensorfs" if xdg else Path(f"/tmp/tensorfs-{os.geteuid()}")


def _private_dir() -> Path:
    """The runtime directory, made if need be; refused if another user could change what is in it
    (someone else's, writable by others: a /tmp squatter)."""
    directory = runtime_dir()
    try:
        return private_directory(
            directory, what="the runtime directory", mode=0o755 if directory == SYSTEM_DIR else 0o700
        )
    except UnsafeLocation as exc:
        raise MountError(str(exc)) from None


def escape_path(path: Path) -> str:
    """A file name for an absolute path, as systemd escapes one: /mnt/my-model -> mnt-my\\x2dmodel."""
    text = str(path).strip("/")
    if not text:
        return "-"
    out = []
    for i, char in enumerate(text):
        if char == "/":
            out.append("-")
        elif (char.isascii() and (char.isalnum() or char in ":_")) or (char == "." and i > 0):
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogateescape"))
    name = "".join(out)
    if len(name) <= 200:
        return name
    return name[:160] + "-" + hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def record_path(mountpoint: Path, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"{escape_path(mountpoint)}.json"


def write_record(mountpoint: Path, record: dict[str, Any]) -> None:
    """Write (or replace) the record of the mount at `mountpoint`, whole or not at all, by the one
    writer; readable by its owner alone (it names the model, the options and the log), and never
    with a URL's user:password in it. WriteError if it cannot be written."""
    text = redact(json.dumps(record, indent=2)) + "\n"
    write_whole(record_path(mountpoint, _private_dir()), lambda out: out.write(text.encode()), mode=0o600)


MAX_RECORD_BYTES = 1 << 20
"""A record is a few hundred bytes: a file larger than this is not one."""


@dataclass(frozen=True)
class FoundRecord:
    """A daemon's record, from a directory that only the user it describes can write."""

    path: Path
    record: dict[str, Any]
    owner: int
    """The user whose directory (and file) it is: the user whose daemon it may describe."""


def _record_dirs() -> list[Path]:
    """Where records may be: this user's runtime directory, the system's, and (to root) every user's."""
    directories = [runtime_dir(), SYSTEM_DIR]
    if os.geteuid() == 0:  # `sudo tensorfs umount` of a user's mount must find its daemon
        directories += sorted(Path("/run/user").glob("*/tensorfs")) + sorted(Path("/tmp").glob("tensorfs-*"))
    return list(dict.fromkeys(directories))


def _owner_of(directory: Path) -> int | None:
    """Whose records a directory may hold: its owner's, if it is a real directory that nobody else can
    write (a record planted by another user in a directory they control describes nothing)."""
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        return None
    if directory == SYSTEM_DIR and st.st_uid != 0:
        return None
    return st.st_uid


def find_record(mountpoint: Path, user: int | None = None) -> FoundRecord | None:
    """The record of the daemon of the mount at `mountpoint` (see _record_dirs), if a trusted one is
    found; with `user` (who made the mount), only in a directory of that user's: another user's
    record describes nothing of theirs."""
    for directory in _record_dirs():
        owner = _owner_of(directory)
        if owner is None or (user is not None and owner != user):
            continue
        path = record_path(mountpoint, directory)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o022:
                continue
            record = json.loads(read_bounded(fd, MAX_RECORD_BYTES))
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
        if isinstance(record, dict) and record.get("mountpoint") == str(mountpoint):
            return FoundRecord(path, record, owner)
    return None


def read_record(mountpoint: Path) -> dict[str, Any] | None:
    """The record of the daemon of the mount at `mountpoint`, if there is one."""
    found = find_record(mountpoint)
    return found.record if found is not None else None


def remove_record(mountpoint: Path, pid: int | None = None) -> None:
    """Remove the mount's record (only if it is daemon `pid`'s, when given), if it is this user's."""
    found = find_record(mountpoint)
    if found is None or found.owner != os.geteuid() or (pid is not None and found.record.get("pid") != pid):
        return
    with contextlib.suppress(OSError):
        found.path.unlink()


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): a pid reused later has another start."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (R, S, D, T, Z, ...), None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_uid(pid: int) -> int | None:
    """The real user id of process `pid` (None if there is no such process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _is_fuse_daemon(pid: int) -> bool:
    """Whether process `pid` is a tensorfs program holding a FUSE connection open (/dev/fuse)."""
    try:
        if b"tensorfs" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return any(os.readlink(fd) == "/dev/fuse" for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def daemon_of(found: FoundRecord, mount_owner: int | None = None) -> int | None:
    """The pid of the record's daemon if it is provably that daemon: the very process that wrote the
    record (its start time; not a reused pid, not a zombie), a tensorfs program holding a FUSE
    connection, run by the user whose directory the record is in, who also owns the mount
    (`mount_owner`, the mount's user_id, when known). Else None: nothing is ever signalled on the
    word of a record alone."""
    record = found.record
    pid = record.get("pid")
    started = record.get("process_start")
    if not isinstance(pid, int) or pid <= 0 or not isinstance(started, int):
        return None
    if process_state(pid) in (None, "Z", "X") or process_start(pid) != started:
        return None
    if process_uid(pid) != found.owner or (mount_owner is not None and mount_owner != found.owner):
        return None
    return pid if _is_fuse_daemon(pid) else None


@contextlib.contextmanager
def mountpoint_lock(mountpoint: Path, timeout: float) -> Iterator[int]:
    """Hold the exclusive lock of `mountpoint` (its real path) for a check-and-mount; yields its descriptor.

    A second `tensorfs mount` on the same directory waits here until the first has mounted (or
    failed), then finds the mount and is refused; never are two mounts stacked. A process forked
    meanwhile holds the lock too until it closes the descriptor.
    """
    lock = _private_dir() / f"{escape_path(mountpoint)}.lock"
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            _take(fd, mountpoint, deadline)
            if _same_file(lock, fd):
                break  # else its holder removed it meanwhile: the lock is a new file's now
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield fd
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # held: whoever waits on this file finds it gone and takes a new one
        os.close(fd)  # the lock goes with the last descriptor of it: the daemon closes its copy at once


def _take(fd: int, mountpoint: Path, deadline: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() > deadline:
                raise MountError(f"mountpoint {mountpoint}: another tensorfs mount of it did not finish") from None
            time.sleep(0.02)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
