"""The peers tensorfs is measured against in the same run: bindfs and the pyfuse3 floor (floor.py);
Debian's packages of the peers installed when missing (bindfs, s3fs, rclone: bucket.py).

Each peer serves the same bytes from the same warm page cache, through FUSE, on a fresh mount for
every try, with the connection knobs tensorfs sets on its own mounts (the bdi's read_ahead_kb, the
connection's max_background in fusectl): the peers differ from tensorfs only in the daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..mount.mounttable import mount_at

FUSECTL = Path("/sys/fs/fuse/connections")
MOUNT_TIMEOUT = 60.0  # a bound on a daemon that never mounts: s3fs and rclone start slowly on a busy machine
INSTALL_TIMEOUT = 300.0

Locate = Callable[[str], tuple[Path, int, int]]
"""Where a peer serves a tensor's bytes: (file, offset in it, byte count)."""


@dataclass(frozen=True)
class Knobs:
    readahead_kb: int
    max_background: int


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    mounted: Callable[[Path, Knobs], contextlib.AbstractContextManager[tuple[Locate, dict[str, int | None]]]]
    """A fresh mount in this directory, tuned with these knobs: yields where each tensor is, and the
    knobs in force as read back from the kernel."""


def bindfs_missing() -> str | None:
    """None when bindfs can run; else why not (see apt_installed)."""
    return apt_installed("bindfs")


def apt_installed(package: str) -> str | None:
    """None when the peer `package` (its command of the same name) can run; else why not. A missing
    one is installed from Debian's packages as root (apt-get), as a user of the peer would."""
    if shutil.which(package):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{package} is not installed, and installing it needs root and apt-get (apt-get install {package})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    print(f"installing {package} (apt-get install {package}) to measure it as a peer ...", file=sys.stderr, flush=True)
    failure = ""
    for commands in ([install], [["apt-get", "update"], install]):  # stale package lists: update once
        try:
            for command in commands:
                subprocess.run(command, check=True, capture_output=True, env=env, timeout=INSTALL_TIMEOUT)
        except subprocess.CalledProcessError as exc:
            said = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
            failure = f"{' '.join(exc.cmd)}: {said[-1] if said else f'exit {exc.returncode}'}"
            continue
        except subprocess.TimeoutExpired as exc:
            failure = f"{' '.join(map(str, exc.cmd))} took over {INSTALL_TIMEOUT:.0f} s"
            continue
        if shutil.which(package):
            return None
    return f"{package} is not installed and could not be installed ({failure})"


def tune(mountpoint: Path, knobs: Knobs) -> dict[str, int | None]:
    """Set the mount's read_ahead_kb and max_background as tensorfs sets its own; the values in force."""
    device = os.stat(mountpoint).st_dev  # answered by the daemon: it is serving
    readahead = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    background = FUSECTL / str(os.minor(device)) / "max_background"
    for path, value in ((readahead, knobs.readahead_kb), (background, knobs.max_background)):
        with contextlib.suppress(OSError):  # not root: the defaults stay, and the report says so
            path.write_text(f"{value}\n")
    return {"readahead_kb": _read_number(readahead), "max_background": _read_number(background)}


def _read_number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def serving(command: list[str], mountpoint: Path, log: Path, knobs: Knobs) -> Iterator[dict[str, int | None]]:
    """Run a FUSE daemon in the foreground until its mount at `mountpoint` is live, tuned as `knobs`
    say; unmount and reap it after."""
    with foreground(command, mountpoint, log):
        yield tune(mountpoint, knobs)


@contextlib.contextmanager
def foreground(command: list[str], mountpoint: Path, log: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    """A FUSE daemon (its pid) in the foreground, with `env` if given, until its mount at `mountpoint`
    is live; unmounted and reaped after."""
    mountpoint.mkdir()
    with open(log, "ab") as log_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while mount_at(mountpoint) is None:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited ({process.returncode}) without mounting: see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not mount {mountpoint} in {MOUNT_TIMEOUT:.0f} s: see {log}")
            time.sleep(0.005)
        yield process.pid
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)
        try:
            process.wait(timeout=MOUNT_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        mountpoint.rmdir()


def bindfs_peer(shard: Path, tensors: dict[str, tuple[Path, int, int]], log: Path) -> Peer:
    """bindfs (single-threaded, as tensorfs's one trio thread; read-only) of the shard's directory:
    each tensor is its byte range of the shard file seen through the mount."""

    @contextlib.contextmanager
    def mounted(mountpoint: Path, knobs: Knobs) -> Iterator[tuple[Locate, dict[str, int | None]]]:
        command = ["bindfs", "-f", "-r", "--no-allow-other", str(shard.parent), str(mountpoint)]
        with serving(command, mountpoint, log, knobs) as in_force:

            def locate(name: str) -> tuple[Path, int, int]:
                _, offset, nbytes = tensors[name]
                return mountpoint / shard.name, offset, nbytes

            yield locate, in_force

    return Peer("bindfs", "bindfs", mounted)


def floor_peer(shard: Path, tensors: dict[str, tuple[Path, int, int]], log: Path) -> Peer:
    """The minimal pyfuse3 daemon of floor.py: one file per tensor of the shard."""

    @contextlib.contextmanager
    def mounted(mountpoint: Path, knobs: Knobs) -> Iterator[tuple[Locate, dict[str, int | None]]]:
        command = [sys.executable, "-m", "tensorfs.bench.floor", str(shard), str(mountpoint)]
        with serving(command, mountpoint, log, knobs) as in_force:

            def locate(name: str) -> tuple[Path, int, int]:
                return mountpoint / name, 0, tensors[name][2]

            yield locate, in_force

    return Peer("floor", "the pyfuse3 floor (bench/floor.py)", mounted)
