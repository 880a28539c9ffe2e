"""The mount's lifecycle: checks, the daemon's process, readiness, logging. Serving is serve.py's.

In the background, `tensorfs mount` forks the daemon first, so that the daemon imports trio and
pyfuse3 on one core while the command validates the model on the other. The command then hands the
daemon a snapshot of the validated model through a pipe (the daemon maps the same files again,
refusing any that changed), and waits until the daemon says the mount answers, or why not. The
daemon never holds the garbage of parsing 100k-tensor headers, which keeps its memory small.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MountError, TensorfsError
from ..gcpause import gc_paused
from ..integrity import HashCache, Hasher, Integrity
from ..model import Model, reopen, snapshot
from ..names import Layout
from .mounttable import FSTYPE, mount_at, read_daemon_info

log = logging.getLogger("tensorfs")

READY = "ready"
READY_TIMEOUT = 120.0
# Options that break tensorfs (DESIGN.md): direct_io breaks np.memmap of the files, max_read= breaks
# pyfuse3 3.5 with libfuse 3.14, and the tree is read-only.
REFUSED_OPTIONS = {
    "rw": "the tree is read-only",
    "direct_io": "it breaks np.memmap of the mounted files",
    "max_read": "it breaks pyfuse3 3.5 with libfuse 3.14 (requests are already up to 1 MiB)",
}


@dataclass(frozen=True)
class MountOptions:
    layout: Layout = "slash"
    fuse_options: tuple[str, ...] = ()
    """Options passed to FUSE as given with -o (allow_other, ...)."""
    foreground: bool = False
    debug: bool = False
    log_file: Path | None = None
    readahead_kb: int = 1024
    prefetch_mb: int = 32
    max_background: int = 4
    extra: dict[str, object] = field(default_factory=dict)


def default_log_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "tensorfs" / "tensorfs.log"


def split_fuse_options(values: tuple[str, ...]) -> tuple[str, ...]:
    """`-o a,b -o c` -> (a, b, c), refusing the options that break tensorfs."""
    options = tuple(opt.strip() for value in values for opt in value.split(",") if opt.strip())
    for option in options:
        key = option.split("=", 1)[0]
        if key in REFUSED_OPTIONS:
            raise MountError(f"option '{option}' is not supported: {REFUSED_OPTIONS[key]}")
    return options


def check_mountpoint(mountpoint: Path) -> None:
    """Refuse a mountpoint that is missing, not a directory, not empty or already mounted on."""
    entry = mount_at(mountpoint)
    if entry is not None:
        if entry.fstype == FSTYPE and read_daemon_info(mountpoint) is None:
            raise MountError(f"mountpoint {mountpoint} holds a dead tensorfs mount: run `tensorfs umount {mountpoint}`")
        what = "a tensorfs mount (see `tensorfs status`)" if entry.fstype == FSTYPE else f"a {entry.fstype} mount"
        raise MountError(f"mountpoint {mountpoint} already holds {what}")
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as exc:
        raise MountError(f"mountpoint {mountpoint}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    try:
        with os.scandir(mountpoint) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        raise MountError(f"mountpoint {mountpoint}: {exc.strerror}") from None
    if not empty:
        raise MountError(f"mountpoint {mountpoint} is not empty")


Prepare = Callable[[], tuple[Model, Integrity]]
"""Validates the model (and verifies it, if asked): what `mount` serves."""


def mount(prepare: Prepare, mountpoint: Path, options: MountOptions) -> int:
    """Mount what `prepare` validates at `mountpoint`; return once it answers (in the foreground: once unmounted)."""
    check_mountpoint(mountpoint)
    mountpoint = Path(os.path.abspath(mountpoint))
    # The log is opened here, before any fork, so that a log file that cannot be written is a
    # one-line error now rather than a daemon that dies without a word.
    _setup_logging(options, to_stderr=options.foreground and options.log_file is None)
    if options.foreground:
        from .serve import serve

        model, integrity = prepare()
        return serve(model, mountpoint, options, integrity, notify=lambda message: _announce(message, mountpoint))
    return _mount_in_background(prepare, mountpoint, options)


def _announce(message: str, mountpoint: Path) -> None:
    if message == READY:
        print(f"mounted at {mountpoint}; Ctrl-C unmounts", file=sys.stderr, flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _mount_in_background(prepare: Prepare, mountpoint: Path, options: MountOptions) -> int:
    """Fork the daemon, validate meanwhile, hand it the model; wait until it answers, or say why not."""
    model_read, model_write = os.pipe()
    status_read, status_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(model_write)
        os.close(status_read)
        os._exit(_daemon(model_read, status_write, mountpoint, options))
    os.close(model_read)
    os.close(status_write)
    try:
        model, integrity = prepare()
    except BaseException:
        os.close(model_write)  # the daemon reads nothing, and leaves
        os.close(status_read)
        os.waitpid(pid, 0)
        raise
    with model, gc_paused():  # 100k entries: pausing the GC halves the time this takes
        cache_dir = integrity.hasher.cache.directory
        handover = pickle.dumps((snapshot(model), integrity.expected, integrity.verified, cache_dir), protocol=5)
    try:
        with os.fdopen(model_write, "wb") as pipe:
            pipe.write(handover)
    except BrokenPipeError:
        pass  # the daemon died: its status says why
    message = _read_line(status_read, READY_TIMEOUT)
    os.close(status_read)
    if message == READY:
        return 0
    log_file = options.log_file or default_log_file()
    if message is None:  # no word within the deadline: stop it, and leave nothing behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
        raise MountError(f"the daemon did not answer within {READY_TIMEOUT:.0f} s and was stopped; see {log_file}")
    _, status = os.waitpid(pid, 0)  # it said why, or closed its pipe: either way it is on its way out
    if message:
        raise MountError(message)
    raise MountError(f"the daemon exited before the mount was ready (status {status}); see {log_file}")


def _daemon(model_read: int, status_write: int, mountpoint: Path, options: MountOptions) -> int:
    """The daemon's life: import the server while the model is validated, receive it, serve it."""

    def notify(message: str) -> None:
        os.write(status_write, message.encode("utf-8", "backslashreplace") + b"\n")

    try:
        os.setsid()
        _detach_stdio()
        from .serve import serve  # trio and pyfuse3: imported here, while the command validates

        with os.fdopen(model_read, "rb") as pipe:
            handover = pipe.read()
        if not handover:
            return 0  # the model was refused: the command says why
        with gc_paused():
            saved, expected, verified, cache_dir = pickle.loads(handover)
            del handover
            model = reopen(saved)
        os.chdir("/")  # hold no directory busy: the one `tensorfs mount` ran in may be unmounted later
        gc.freeze()  # what the daemon holds lives as long as it does: no collection need look at it again
        integrity = Integrity(Hasher(model, HashCache(cache_dir)), expected, verified)
        return serve(model, mountpoint, options, integrity, notify)
    except TensorfsError as exc:
        notify(str(exc).splitlines()[0])
        return 1
    except BaseException as exc:
        log.exception("daemon failed")
        notify(f"the daemon failed: {exc!r}")
        return 1


def _read_line(fd: int, timeout: float) -> str | None:
    """The first line the daemon writes (empty if it closed the pipe first); None past the deadline."""
    chunks = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        chunks.append(chunk)
        if not chunk or b"\n" in chunk:
            return b"".join(chunks).decode("utf-8", "replace").strip()
    return None


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _setup_logging(options: MountOptions, *, to_stderr: bool) -> None:
    handler: logging.Handler
    if to_stderr:
        handler = logging.StreamHandler(sys.stderr)
    else:
        path = options.log_file or default_log_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, encoding="utf-8")
        except OSError as exc:
            raise MountError(f"cannot write the log file {path}: {exc.strerror}") from None
    handler.setFormatter(logging.Formatter("%(asctime)s tensorfs[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if options.debug else logging.INFO)
