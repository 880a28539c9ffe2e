"""The mount's lifecycle: checks, pyfuse3.init, readiness, background or foreground, signals, unmount."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

from . import __version__
from .errors import MountError
from .fs import TensorOperations
from .integrity import Integrity
from .model import Model
from .mounttable import FSTYPE, mount_at, read_daemon_info
from .names import Layout
from .tree import Tree, index_json

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


def mount(model: Model, mountpoint: Path, options: MountOptions, integrity: Integrity) -> int:
    """Mount `model` at `mountpoint`; return once it answers (or, in the foreground, once unmounted)."""
    check_mountpoint(mountpoint)
    mountpoint = Path(os.path.abspath(mountpoint))
    # The log is opened here, before any fork, so that a log file that cannot be written is a
    # one-line error now rather than a daemon that dies without a word.
    _setup_logging(options, to_stderr=options.foreground and options.log_file is None)
    if options.foreground:
        return serve(model, mountpoint, options, integrity, notify=lambda message: _announce(message, mountpoint))
    return _mount_in_background(model, mountpoint, options, integrity)


def _announce(message: str, mountpoint: Path) -> None:
    if message == READY:
        print(f"mounted at {mountpoint}; Ctrl-C unmounts", file=sys.stderr, flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _mount_in_background(model: Model, mountpoint: Path, options: MountOptions, integrity: Integrity) -> int:
    """Fork a daemon that mounts and serves; wait until it says the mount answers, or why not."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns when forking with threads alive (numpy's BLAS pool): the child never
        # uses them, nor any lock they could hold.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the daemon
        os.close(read_end)
        code = 1
        try:
            os.setsid()
            _detach_stdio()

            def notify(message: str) -> None:
                os.write(write_end, message.encode("utf-8", "backslashreplace") + b"\n")

            code = serve(model, mountpoint, options, integrity, notify)
        except BaseException:
            log.exception("daemon failed")
        finally:
            os._exit(code)
    os.close(write_end)
    message = _read_until_eof(read_end, READY_TIMEOUT).strip()
    os.close(read_end)
    if message.splitlines()[:1] == [READY]:
        return 0
    _, status = os.waitpid(pid, os.WNOHANG)
    if message:
        raise MountError(message.splitlines()[0])
    log_file = options.log_file or default_log_file()
    raise MountError(f"the daemon exited before the mount was ready (status {status}); see {log_file}")


def _read_until_eof(fd: int, timeout: float) -> str:
    import select

    chunks = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
        if b"\n" in chunk:
            break
    return b"".join(chunks).decode("utf-8", "replace")


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


def serve(
    model: Model, mountpoint: Path, options: MountOptions, integrity: Integrity, notify: Callable[[str], None]
) -> int:
    """Mount, serve until unmounted or signalled, unmount. `notify` hears READY or an error."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def daemon_json() -> bytes:
        document = {
            "pid": os.getpid(),
            "source": str(model.source.absolute()),
            "mountpoint": str(mountpoint),
            "version": __version__,
            "started": started,
            "tensors": len(model),
            "bytes": model.nbytes,
            "options": {
                "layout": options.layout,
                "fuse": list(options.fuse_options),
                "readahead_kb": options.readahead_kb,
                "debug": options.debug,
                "manifest": integrity.expected is not None,
                "hash_cache": str(integrity.hasher.cache.directory) if integrity.hasher.cache.enabled else None,
            },
            "log_file": None
            if options.foreground and options.log_file is None
            else str(options.log_file or default_log_file()),
        }
        return (json.dumps(document, indent=2) + "\n").encode()

    tree = Tree(model, options.layout, {"index.json": lambda: index_json(model), "daemon.json": daemon_json})
    operations = TensorOperations(tree, integrity)
    fuse_options = set(pyfuse3.default_options) | {"fsname=tensorfs", "subtype=tensorfs", "ro"}
    fuse_options |= set(options.fuse_options)
    if options.debug and options.foreground:
        fuse_options.add("debug")
    try:
        pyfuse3.init(operations, str(mountpoint), fuse_options)
    except RuntimeError as exc:
        notify(f"cannot mount at {mountpoint}: {exc}")
        return 1
    log.info("serving %s (%d tensors) at %s", model.source, len(model), mountpoint)
    try:
        trio.run(_run, operations, mountpoint, options.readahead_kb, notify)
    except BaseException:
        pyfuse3.close(unmount=False)  # the session may be broken: pyfuse3's advice is to not unmount
        raise
    pyfuse3.close(unmount=True)
    log.info("unmounted %s", mountpoint)
    return 0


async def _run(
    operations: TensorOperations, mountpoint: Path, readahead_kb: int, notify: Callable[[str], None]
) -> None:
    async with trio.open_nursery() as nursery:
        operations.nursery = nursery
        nursery.start_soon(_unmount_on_signal)
        nursery.start_soon(_report_ready, mountpoint, readahead_kb, notify)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _unmount_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _report_ready(mountpoint: Path, readahead_kb: int, notify: Callable[[str], None]) -> None:
    # A stat of the root from another thread is answered by this daemon's loop: when it returns,
    # the mount is live and answering.
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    if readahead_kb:
        _set_readahead(st.st_dev, readahead_kb)
    notify(READY)


def _set_readahead(device: int, kilobytes: int) -> None:
    """Raise the mount's readahead so the kernel sends 1 MiB reads (1.7x the 128 KiB default here)."""
    path = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    try:
        path.write_text(f"{kilobytes}\n")
    except OSError as exc:
        log.warning("could not set readahead (%s): %s", path, exc.strerror)
