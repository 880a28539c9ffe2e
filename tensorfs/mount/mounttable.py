"""The system's mount table and fusermount3: which tensorfs mounts exist, how they are, unmounting them.

Nothing here reads through a mount, and every question asked of one has a deadline: a daemon
that hangs must never hang the tools.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MountError
from ..fs.guarded import ANSWER_SECONDS, unescape_mountinfo, within
from ..utils.names import CONTROL_DIR, STATS_NAME
from .runtime import FoundRecord, daemon_of, find_record, process_state, read_record, remove_record

FSTYPE = "fuse.tensorfs"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: Path
    fstype: str
    source: str = ""
    device: str = ""
    """major:minor of the mount's device (a FUSE mount's minor names its connection in fusectl)."""
    owner: int | None = None
    """Who made the mount: a FUSE mount's user_id (None for other file systems)."""


def mounts() -> list[MountEntry]:
    """Every mount of this process's mount namespace."""
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split()
            separator = fields.index("-")
            source = fields[separator + 2] if len(fields) > separator + 2 else ""
            options = fields[separator + 3] if len(fields) > separator + 3 else ""
            owner = next((int(o[8:]) for o in options.split(",") if o.startswith("user_id=") and o[8:].isdigit()), None)
            entries.append(
                MountEntry(
                    Path(unescape_mountinfo(fields[4])),
                    fields[separator + 1],
                    unescape_mountinfo(source),
                    fields[2],
                    owner,
                )
            )
    return entries


def mount_at(path: Path) -> MountEntry | None:
    """The mount whose mountpoint is `path`, if any (the last one, when mounts are stacked)."""
    target = Path(os.path.abspath(path))
    found = None
    for entry in mounts():
        if entry.mountpoint == target:
            found = entry
    return found


def tensorfs_mounts() -> list[Path]:
    return [entry.mountpoint for entry in mounts() if entry.fstype == FSTYPE]


def resolve_mountpoint(path: Path) -> Path:
    """The real path of `path` (symlinks resolved), without ever asking a mount about its own root.

    os.path.realpath would lstat a mountpoint, and a mount whose daemon hangs would hang that
    lstat: a path that is a mountpoint is taken as it stands.
    """
    mounted = {entry.mountpoint for entry in mounts()}
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's own limit on symlinks followed in one lookup
        if current in mounted or current.parent == current:
            return current
        parent = Path(os.path.realpath(current.parent))
        candidate = parent / current.name
        if candidate in mounted:
            return candidate
        try:
            target = os.readlink(candidate)
        except OSError:  # not a symlink (or not there): the path is what it is
            return candidate
        current = Path(os.path.abspath(parent / target))
    raise MountError(f"{path}: too many levels of symbolic links")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (exited, not yet reaped by whoever adopted it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status[status.rindex(")") + 2 :][:1] not in ("Z", "X")


def daemon_pid(mountpoint: Path) -> int | None:
    """The pid in the record of the daemon of the mount at `mountpoint` (never read through the mount)."""
    record = read_record(resolve_mountpoint(mountpoint))
    pid = record.get("pid") if record is not None else None
    return pid if isinstance(pid, int) else None


# -- health ---------------------------------------------------------------------------------

PROBE_TIMEOUT = ANSWER_SECONDS


def probe(mountpoint: Path, timeout: float = PROBE_TIMEOUT) -> str:
    """Ask the mount's daemon something it must answer itself: "ok", "dead", "hung" or "no access".

    statfs is never answered from the kernel's caches.
    """

    def ask() -> str:
        try:
            os.statvfs(mountpoint)
        except OSError as exc:
            if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ENOENT):
                return "dead"
            if exc.errno in (errno.EACCES, errno.EPERM):
                return "no access"
            return "ok" if exc.errno == errno.ENOSYS else "dead"
        return "ok"

    return within(timeout, f"probe {mountpoint}", ask)


def read_stats(mountpoint: Path, timeout: float = PROBE_TIMEOUT) -> dict[str, Any] | str:
    """The daemon's counters (.tensorfs/stats.json), or why not ("hung", "dead", a reason),
    asked within a deadline as probe() asks."""

    def ask() -> dict[str, Any] | str:
        try:
            with open(mountpoint / CONTROL_DIR / STATS_NAME, "rb") as file:
                found: dict[str, Any] = json.loads(file.read())
                return found
        except OSError as exc:
            dead = exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
            return "dead" if dead else f"cannot read its stats.json: {exc.strerror}"
        except ValueError:
            return "its stats.json is not JSON (a daemon of another version?)"

    return within(timeout, f"stats {mountpoint}", ask)


@dataclass(frozen=True)
class Health:
    """A tensorfs mount as the tools see it, learnt without blocking on it."""

    mountpoint: Path
    state: str
    """"ok", "hung" (the daemon runs but does not answer) or "dead" (no daemon serves it)."""
    reason: str
    """Why, when not ok; what to do about it."""
    record: dict[str, Any] | None
    pid: int | None
    """The daemon's pid while it runs."""

    @property
    def healthy(self) -> bool:
        return self.state == "ok"


def health(mountpoint: Path, timeout: float = PROBE_TIMEOUT) -> Health:
    """How the tensorfs mount at `mountpoint` is: from its record, its daemon's process and a probe.

    A record is believed only from a directory of the user who made the mount (its user_id) and,
    while a daemon serves the mount, only when it is provably that daemon's (see daemon_of): the
    daemon is known (and may be signalled) only then. Of a dead mount, the record of its user says
    why it died.
    """
    entry = mount_at(mountpoint)
    user = entry.owner if entry is not None and entry.owner is not None else os.geteuid()
    found = find_record(mountpoint, user)
    pid = daemon_of(found, user) if found is not None else None
    record = found.record if found is not None and pid is not None else None
    if pid is not None and process_state(pid) in ("T", "t"):
        return Health(mountpoint, "hung", f"its daemon {pid} is stopped (SIGSTOP?)", record, pid)
    answer = probe(mountpoint, timeout)
    if answer == "hung":
        return Health(mountpoint, "hung", f"its daemon did not answer within {timeout:g} s", record, pid)
    if answer == "dead" or (answer == "no access" and found is not None and pid is None):
        record = found.record if found is not None else None
        return Health(mountpoint, "dead", _why_dead(found), record, None)
    return Health(mountpoint, "ok", "", record, pid)


def _why_dead(found: FoundRecord | None) -> str:
    if found is None:
        return "no daemon serves it"
    pid = found.record.get("pid")
    reason = found.record.get("error") or last_error(found.record.get("log_file"), pid, found.owner)
    return f"daemon {pid} is gone" + (f": {reason}" if reason else " (killed?)")


def last_error(log_file: object, pid: object, owner: int) -> str | None:
    """The last ERROR (or fatal error) the daemon `pid` wrote to its log, if any: a regular file of
    `owner`'s (the record's user), opened without following a symlink or waiting on a FIFO."""
    if not isinstance(log_file, str):
        return None
    try:
        fd = os.open(log_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
            return None
        with open(fd, "rb", closefd=False) as f:
            f.seek(max(0, st.st_size - (256 << 10)))
            lines = f.read(256 << 10).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    finally:
        os.close(fd)
    mark = f"tensorfs[{pid}] "
    found, last_writer_was_it = None, False
    for line in lines:
        if line.startswith("Fatal Python error:"):  # faulthandler's report of a fatal signal: no prefix,
            if last_writer_was_it:  # so it is the daemon's whose line came just before
                found = line
        elif "tensorfs[" in line:
            last_writer_was_it = mark in line
            if last_writer_was_it:
                level, _, message = line.partition(mark)[2].partition(" ")
                if level in ("ERROR", "CRITICAL"):
                    found = message
    return found


# -- unmounting -----------------------------------------------------------------------------


def unmount(mountpoint: Path, *, lazy: bool = False, wait_seconds: float = 10.0) -> str:
    """Unmount a FUSE mount, also one whose daemon died or hangs; wait for a live daemon to exit.

    A lazy unmount returns at once: the daemon serves what is still open, then exits. A hung
    daemon's mount is detached lazily and the daemon stopped. Returns what was done, in words;
    MountError when something could not be done (the mount may be detached all the same).
    """
    mountpoint = resolve_mountpoint(mountpoint)
    entry = mount_at(mountpoint)
    if entry is None:
        raise MountError(f"{mountpoint}: not mounted")
    if entry.fstype != FSTYPE:
        raise MountError(f"{mountpoint}: not a tensorfs mount ({entry.fstype}); tensorfs only unmounts its own")
    state = health(mountpoint)
    pid = state.pid
    if state.state == "hung":
        _fusermount(mountpoint, lazy=True)
        if pid is None:
            aborted = _abort_connection(entry)
            raise MountError(
                f"{mountpoint}: detached, but its daemon ({state.reason}) has no record here to find it by "
                f"(mounted by another user, or with another TENSORFS_RUNTIME_DIR?){aborted}: stop it yourself"
            )
        if not _stop(pid, wait_seconds):
            aborted = _abort_connection(entry)
            raise MountError(
                f"{mountpoint}: detached, but its daemon {pid} ({state.reason}) did not exit even on SIGKILL "
                f"(state {process_state(pid)}: frozen?){aborted}"
            )
        remove_record(mountpoint)
        return f"{mountpoint}: detached; its daemon was hung ({state.reason}) and has been stopped"
    _fusermount(mountpoint, lazy=lazy)
    if pid is not None and not lazy:
        deadline = time.monotonic() + wait_seconds
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    if pid is None:
        remove_record(mountpoint)  # a dead daemon's record: nothing else will remove it
    return f"{mountpoint}: unmounted"


def _fusermount(mountpoint: Path, *, lazy: bool) -> None:
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        raise MountError("fusermount3 not found: install the fuse3 package")
    command = [fusermount, "-u", *(["-z"] if lazy else []), str(mountpoint)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=PROBE_TIMEOUT * 5)
    except subprocess.TimeoutExpired:
        raise MountError(f"{mountpoint}: fusermount3 did not return; try: umount -l {mountpoint}") from None
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        if "busy" in detail.lower():
            raise MountError(f"{mountpoint}: busy (files are open there); close them, or unmount with --lazy")
        raise MountError(f"{mountpoint}: {detail}")


FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")


def _abort_connection(entry: MountEntry) -> str:
    """End every request of a daemon that stays hung (root, with fusectl): the readers stuck in it,
    and this command's own probe, which it could not exit without. Says so, or nothing."""
    major, _, minor = entry.device.partition(":")
    if major != "0" or not minor.isdigit():
        return ""
    try:
        (FUSE_CONNECTIONS / minor / "abort").write_text("1\n")
    except OSError:
        return ""
    return "; its FUSE connection was aborted, so nothing waits on it"


def _stop(pid: int, wait_seconds: float) -> bool:
    """Stop a daemon that does not answer: SIGTERM (and SIGCONT, should it be stopped), then SIGKILL.

    Whether it is gone.
    """
    for signals, seconds in (((signal.SIGTERM, signal.SIGCONT), min(wait_seconds, 3.0)), ((signal.SIGKILL,), 3.0)):
        for signum in signals:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + seconds
        while pid_alive(pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        else:
            return True
    return False
