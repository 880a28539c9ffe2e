"""The system's mount table and fusermount3: which tensorfs mounts exist, and unmounting them."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import MountError

FSTYPE = "fuse.tensorfs"
CONTROL_DIR = ".tensorfs"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: Path
    fstype: str


def _unescape(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as octal escapes.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts() -> list[MountEntry]:
    """Every mount of this process's mount namespace."""
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split()
            separator = fields.index("-")
            entries.append(MountEntry(Path(_unescape(fields[4])), fields[separator + 1]))
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


def read_daemon_info(mountpoint: Path) -> dict[str, object] | None:
    """The mount's .tensorfs/daemon.json, or None when its daemon no longer answers."""
    try:
        return dict(json.loads((mountpoint / CONTROL_DIR / "daemon.json").read_bytes()))
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ENOENT, errno.EIO):
            return None
        raise


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


def unmount(mountpoint: Path, *, lazy: bool = False, wait_seconds: float = 10.0) -> None:
    """Unmount a FUSE mount, also one whose daemon died; wait for a live daemon to exit.

    A lazy unmount returns at once: the daemon serves what is still open, then exits.
    """
    entry = mount_at(mountpoint)
    if entry is None:
        raise MountError(f"{mountpoint}: not mounted")
    if not entry.fstype.startswith("fuse"):
        raise MountError(f"{mountpoint}: not a FUSE mount ({entry.fstype}); tensorfs only unmounts its own")
    info = read_daemon_info(mountpoint) if entry.fstype == FSTYPE else None
    pid = info.get("pid") if info else None
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        raise MountError("fusermount3 not found: install the fuse3 package")
    command = [fusermount, "-u", *(["-z"] if lazy else []), str(mountpoint)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        if "busy" in detail.lower():
            raise MountError(f"{mountpoint}: busy (files are open there); close them, or unmount with --lazy")
        raise MountError(f"{mountpoint}: {detail}")
    if isinstance(pid, int) and not lazy:
        deadline = time.monotonic() + wait_seconds
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
