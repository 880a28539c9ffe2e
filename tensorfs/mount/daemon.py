"""The mount's lifecycle: checks, the daemon's process, readiness, logging. Serving is serve.py's.

In the background, `tensorfs mount` forks the daemon first, so that the daemon imports trio and
pyfuse3 on one core while the command validates the model on the other. The command then hands the
daemon a snapshot of the validated model through a pipe (the daemon maps the same files again,
refusing any that changed), and waits until the daemon says the mount answers, or why not. The
daemon never holds the garbage of parsing 100k-tensor headers, which keeps its memory small.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from pathlib import Path

from ..errors import MountError, TensorfsError, printable
from ..model import Model
from ..sources.store import redact
from ..utils.gcpause import gc_paused
from ..utils.units import human_size, plural
from ..views import ViewSpec
from .handover import ModelSnapshot, reopen, snapshot
from .logs import default_log_file, setup_logging
from .mounttable import FSTYPE, health, mount_at, resolve_mountpoint
from .options import READY, MountOptions
from .prepare import Served
from .runtime import mountpoint_lock, remove_record

log = logging.getLogger("tensorfs")

READY_TIMEOUT = 120.0


def check_mountpoint(mountpoint: Path) -> None:
    """Refuse a mountpoint that is missing, not a directory, not empty or already mounted on."""
    entry = mount_at(mountpoint)
    if entry is not None:
        if entry.fstype == FSTYPE:
            state = health(mountpoint)
            if state.state == "dead":
                raise MountError(
                    f"mountpoint {mountpoint} holds a dead tensorfs mount: run `tensorfs umount {mountpoint}`"
                )
            if state.state == "hung":
                raise MountError(
                    f"mountpoint {mountpoint} holds a hung tensorfs mount ({state.reason}): "
                    f"run `tensorfs umount {mountpoint}`"
                )
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


FUSE_DEVICE = "/dev/fuse"
_FUSE_NUMBERS = (10, 229)  # the misc character device the kernel's FUSE registers
_WITHOUT_A_MOUNT = "tensorfs.open_model, safe_open and load_file load the model in-process without one (docs/python.md)"


def check_fuse_device(device: str = FUSE_DEVICE) -> None:
    """Refuse, saying what is missing, where no FUSE device can be had: libfuse says why only on the
    standard error of a foreground mount (a daemon's is closed), as "fuse_session_mount failed"."""
    try:
        st = os.stat(device)
    except FileNotFoundError:
        raise MountError(
            f"no FUSE device: {device} is missing (load the module: modprobe fuse; in a container, give it the "
            f"device: --device /dev/fuse --cap-add SYS_ADMIN); {_WITHOUT_A_MOUNT}"
        ) from None
    except OSError as exc:
        raise MountError(f"no FUSE device: {device}: {exc.strerror}; {_WITHOUT_A_MOUNT}") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != _FUSE_NUMBERS:
        raise MountError(
            f"no FUSE device: {device} is not FUSE's (the character device 10:229; in a container: "
            f"--device /dev/fuse --cap-add SYS_ADMIN); {_WITHOUT_A_MOUNT}"
        )
    if os.geteuid() != 0:
        return  # fusermount3 (setuid root) opens it for everyone else
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:  # a container's device rules (EPERM)
        raise MountError(
            f"cannot open the FUSE device {device}: {exc.strerror} (a container must be let use it: "
            f"--device /dev/fuse); {_WITHOUT_A_MOUNT}"
        ) from None


Prepare = Callable[[], Served]
"""Validates the model (and verifies it, if asked), after the daemon is forked: what `mount` serves,
held to its manifest, and what its model directory view holds besides its tensors."""

Announce = Callable[[str], None]
"""Says one line to the user (the CLI's output)."""


def mount(prepare: Prepare, mountpoint: Path, options: MountOptions, announce: Announce) -> int:
    """Mount what `prepare` validates at `mountpoint`; return once it answers (in the foreground: once unmounted).

    The mountpoint is locked from the first check until the mount answers (or fails): two mounts
    racing for one directory never both mount.
    """
    mountpoint = resolve_mountpoint(mountpoint)
    log_file = (
        None if options.foreground and options.log_file is None else options.log_file or default_log_file(mountpoint)
    )
    options = dataclasses.replace(options, log_file=log_file)
    locked = contextlib.ExitStack()
    try:
        lock = locked.enter_context(mountpoint_lock(mountpoint, READY_TIMEOUT + 60))
        check_mountpoint(mountpoint)
        check_fuse_device()
        # The log is opened here, before any fork, so that a log file that cannot be written is a
        # one-line error now rather than a daemon that dies without a word.
        setup_logging(log_file, debug=options.debug, log_format=options.log_format)
        if not options.foreground:
            return _mount_in_background(prepare, mountpoint, options, lock, announce)
        from .serve import serve

        served = prepare()

        def notify(message: str) -> None:
            if message == READY:
                locked.close()  # mounted: the next mount of this directory may look (and be refused)
                if not options.quiet:
                    shown = printable(str(mountpoint))
                    print(f"mounted {shown} (in the foreground; Ctrl-C unmounts)", file=sys.stderr, flush=True)
            else:
                print(f"error: {redact(message)}", file=sys.stderr, flush=True)

        return serve(served, mountpoint, options, notify)
    finally:
        locked.close()


def _mount_in_background(
    prepare: Prepare, mountpoint: Path, options: MountOptions, lock: int, announce: Announce
) -> int:
    """Fork the daemon, validate meanwhile, hand it the model; wait until it answers, or say why not."""
    model_read, model_write = os.pipe()
    status_read, status_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(lock)  # the command holds the lock until the mount answers; the daemon must not keep it
        os.close(model_write)
        os.close(status_read)
        os._exit(_daemon(model_read, status_write, mountpoint, options))
    os.close(model_read)
    os.close(status_write)
    try:
        served = prepare()
    except BaseException:
        os.close(model_write)  # the daemon reads nothing, and leaves
        os.close(status_read)
        os.waitpid(pid, 0)
        raise
    try:
        with gc_paused():  # 100k entries: pausing the GC halves the time this takes
            others = [snapshot(other) for other in served.others]
            handover = pickle.dumps((snapshot(served.model), others, served.view), protocol=5)
        try:
            with os.fdopen(model_write, "wb") as pipe:
                pipe.write(handover)
        except BrokenPipeError:
            pass  # the daemon died: its status says why
        tensors, nbytes = len(served.model), served.model.nbytes  # while the daemon takes the model over
    finally:
        served.close()
    # The command's copy of the model (a cycle: its gate and hasher refer back to it) is freed while
    # the daemon takes the model over, not at exit, after the daemon has answered.
    del served, handover
    gc.collect()
    message = _read_line(status_read, READY_TIMEOUT)
    os.close(status_read)
    if message == READY:
        announce(
            f"mounted {printable(str(mountpoint))}: {plural(tensors, 'tensor')} ({human_size(nbytes)}), "
            f"daemon {pid}, log {printable(str(options.log_file))}"
        )
        return 0
    if message is None:  # no word within the deadline: stop it, and leave nothing behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
        remove_record(mountpoint, pid)
        raise MountError(
            f"the daemon did not answer within {READY_TIMEOUT:.0f} s and was stopped; see {options.log_file}"
        )
    _, status = os.waitpid(pid, 0)  # it said why, or closed its pipe: either way it is on its way out
    if message:
        raise MountError(message)
    code = os.waitstatus_to_exitcode(status)
    how = f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    raise MountError(f"the daemon ended before the mount was ready ({how}); see {options.log_file}")


def _daemon(model_read: int, status_write: int, mountpoint: Path, options: MountOptions) -> int:
    """The daemon's life: import the server while the model is validated, receive it, serve it."""
    told = False

    def notify(message: str) -> None:
        nonlocal told
        if told:
            return  # the command has its answer and is gone: later news goes to the log only
        told = True
        with contextlib.suppress(OSError):
            os.write(status_write, message.encode("utf-8", "backslashreplace") + b"\n")
            os.close(status_write)

    try:
        os.setsid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serving, where it reopens the log
        _detach_stdio()
        from .serve import serve  # trio and pyfuse3: imported here, while the command validates

        with os.fdopen(model_read, "rb") as pipe:
            handover = pipe.read()
        if not handover:
            return 0  # the model was refused: the command says why
        with gc_paused():
            saved, others, view = pickle.loads(handover)
            del handover
            served = reopen_served(saved, others, view)
        os.chdir("/")  # hold no directory busy: the one `tensorfs mount` ran in may be unmounted later
        gc.freeze()  # what the daemon holds lives as long as it does: no collection need look at it again
        return serve(served, mountpoint, options, notify)
    except TensorfsError as exc:
        log.error("%s", exc)
        notify(str(exc).splitlines()[0])
        return 1
    except BaseException as exc:
        log.exception("daemon failed")
        notify(f"the daemon failed: {exc!r}")
        return 1


def reopen_served(saved: ModelSnapshot, others: list[ModelSnapshot], view: ViewSpec) -> Served:
    """What the command prepared, mapped again in the daemon (refusing any file that changed since)."""
    model = reopen(saved)
    opened: list[Model] = []
    try:
        opened += [reopen(other) for other in others]
    except BaseException:
        for done in (model, *opened):
            done.close()
        raise
    return Served(model, view, opened)


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
