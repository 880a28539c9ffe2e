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
from pathlib import Path
from typing import Any

from ..errors import MountError

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
    """The runtime directory, made if need be; refused if someone else owns it (a /tmp squatter)."""
    directory = runtime_dir()
    try:
        directory.mkdir(mode=0o755 if directory == SYSTEM_DIR else 0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        raise MountError(f"cannot use the runtime directory {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise MountError(f"the runtime directory {directory} is not a directory of this user's")
    return directory


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
    """Write (or replace) the record of the mount at `mountpoint`, whole or not at all."""
    path = record_path(mountpoint, _private_dir())
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        partial.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _record_dirs() -> list[Path]:
    """Where records may be: this user's runtime directory, the system's, and (to root) every user's."""
    directories = [runtime_dir(), SYSTEM_DIR]
    if os.geteuid() == 0:  # `sudo tensorfs umount` of a user's mount must find its daemon
        directories += sorted(Path("/run/user").glob("*/tensorfs")) + sorted(Path("/tmp").glob("tensorfs-*"))
    return list(dict.fromkeys(directories))


def find_record(mountpoint: Path) -> tuple[Path, dict[str, Any]] | None:
    """(where, what) of the record of the daemon of the mount at `mountpoint` (see _record_dirs)."""
    for directory in _record_dirs():
        path = record_path(mountpoint, directory)
        try:
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("mountpoint") == str(mountpoint):
            return path, record
    return None


def read_record(mountpoint: Path) -> dict[str, Any] | None:
    """The record of the daemon of the mount at `mountpoint`, if there is one."""
    found = find_record(mountpoint)
    return found[1] if found is not None else None


def remove_record(mountpoint: Path, pid: int | None = None) -> None:
    """Remove the mount's record (only if it is daemon `pid`'s, when given)."""
    found = find_record(mountpoint)
    if found is None or (pid is not None and found[1].get("pid") != pid):
        return
    with contextlib.suppress(OSError):
        found[0].unlink()


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


def daemon_of(record: dict[str, Any]) -> int | None:
    """The pid of the record's daemon if that very process still runs (not a zombie, not a reused pid)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or process_state(pid) in (None, "Z", "X"):
        return None
    started = record.get("process_start")
    if started is not None and process_start(pid) != started:
        return None
    return pid


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
