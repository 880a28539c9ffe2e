"""Serving a mount: pyfuse3.init, the trio loop, readiness, tuning, signals, the record, unmount."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from .. import __version__
from ..errors import TensorfsError
from ..fs.syscalls import libc
from ..fs.writer import WriteError
from ..model import Model
from ..utils.identity import ShardKey
from ..utils.names import STATS_NAME
from ..utils.units import plural
from ..views import ModelView, ViewSpec, WeightsFile, build_view
from .contents import index_json, metadata_json
from .logs import reopen_logs
from .operations import TensorOperations
from .options import READY, MountOptions
from .prepare import Served
from .runtime import process_start, remove_record, write_record
from .tree import Tree

log = logging.getLogger("tensorfs")


def serve(served: Served, mountpoint: Path, options: MountOptions, notify: Callable[[str], None]) -> int:
    """Mount, serve until unmounted or signalled, unmount. `notify` hears READY or an error."""
    _return_big_buffers()
    model, view = served.model, served.view
    # Meanwhile the store's connections are opened: the mount says it is ready once they are (or soon after).
    connecting = _open_connections(model)
    record = _record(model, mountpoint, options, view)
    control = {
        "index.json": lambda: index_json(model),
        "metadata.json": lambda: metadata_json(model),
        "daemon.json": lambda: _json(record),
    }
    control[STATS_NAME] = lambda: b""  # made afresh at each open (mount/statsfile.py)
    for warning in view.warnings:
        log.warning("%s", warning)
    others = [(other, other.gate) for other in served.others]
    files = build_view(model, model.gate, view, others)
    tree = Tree(model, options.layout, control, options.ownership, files)
    hasher = model.gate.integrity.hasher
    counters: dict[str, Callable[[], dict[str, int | float]]] = {
        "hashes": lambda: {
            "tensors_hashed": hasher.tensors_hashed,  # each one not found in the hash cache (a miss)
            "bytes_hashed": hasher.bytes_hashed,
            "cache_hits": hasher.cache_hits,
        }
    }
    if options.remote is not None:  # the fetches and the cache count for themselves
        from ..sources.fetching import COUNTERS

        counters["remote"] = COUNTERS.snapshot
    operations = TensorOperations(
        tree,
        prefetch=options.prefetch_mb << 20,
        invalidate=_invalidate,
        trace=options.debug,
        counters=counters,
        keep_source_pages=options.keep_source_pages,
        others=served.others,
    )
    _keep_untensored(files)  # once the gates report to the mount: a change seen meanwhile is said
    fuse_options = set(pyfuse3.default_options) | {f"fsname={fsname(model.source)}", "subtype=tensorfs", "ro"}
    fuse_options |= set(options.fuse_options)
    if options.debug and options.foreground:
        fuse_options.add("debug")
    stop_metrics: Callable[[], None] = _nothing
    if options.metrics is not None:
        from .metrics import serve_metrics  # http.server: imported by a mount that serves its metrics only

        try:  # before mounting: a port in use is a mount error, with nothing mounted
            stop_metrics = serve_metrics(options.metrics, operations.stats, str(mountpoint))
        except TensorfsError as exc:
            notify(str(exc))
            return 1
    try:
        write_record(mountpoint, record)
    except WriteError as exc:
        stop_metrics()
        notify(f"the daemon's record: {exc}")
        return 1
    try:
        pyfuse3.init(operations, str(mountpoint), fuse_options)
    except RuntimeError as exc:
        stop_metrics()
        remove_record(mountpoint, os.getpid())
        hint = f" (check the -o options: {','.join(options.fuse_options)})" if options.fuse_options else ""
        notify(f"cannot mount at {mountpoint}: {exc}{hint}")
        return 1
    log.info("serving %s (%s) at %s", _absolute(model.source), plural(len(model), "tensor"), mountpoint)
    try:
        trio.run(_run, operations, mountpoint, options, record, notify, connecting)
    except BaseException as exc:
        pyfuse3.close(unmount=False)  # the session may be broken: pyfuse3's advice is to not unmount
        if not record["ready"]:  # nothing half-mounted: a mount that never answered is taken away
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
            remove_record(mountpoint, os.getpid())
            raise
        record["error"] = f"the daemon failed: {exc!r}"
        record["exited"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with contextlib.suppress(WriteError):
            write_record(mountpoint, record)  # kept, so that `tensorfs status` can say why it died
        raise
    systemd_notify(b"STOPPING=1")
    stop_metrics()
    operations.close()
    pyfuse3.close(unmount=True)
    served.close()  # what remote shards fetched is recorded in their cache
    remove_record(mountpoint, os.getpid())
    log.info("unmounted %s", mountpoint)
    return 0


def _open_connections(model: Model) -> list[Future[None]]:
    """sources/remote.py's open_connections for the model's remote shards; for a local model none, and
    the stores' machinery (the chunk cache, the fetchers) is not imported."""
    if all(isinstance(shard, Path) for shard in model.shards):
        return []
    from ..sources.remote import open_connections

    return open_connections(model.shard_data(shard) for shard in model.shards)


def _keep_untensored(view: ModelView) -> None:
    """The bytes no tensor holds of each local weights file the view serves as it is, read now, while
    the files are those validated (the daemon refused any that changed): a chmod of the model's files
    later is a change of them, and these bytes must still be the validated ones (Gate.keep_untensored).
    A remote object's are read at their first read (its version is pinned: it cannot change in place,
    and nothing is fetched for a view nobody reads); one that cannot be read now, at its first read,
    if its file is unchanged then. One file after another: the headers were just read (their pages are
    in memory), and threads would only take turns at the GIL."""
    for file in view.files.values():
        if isinstance(file, WeightsFile) and isinstance(file.shard, Path):
            try:
                file.gate.keep_untensored(file.shard)
            except TensorfsError as exc:
                log.warning("%s", exc)


def _return_big_buffers() -> None:
    """Keep the daemon's heap small while remote fetch threads come and go.

    glibc gives each thread that allocates its own arena and keeps freed buffers there, so the
    fetch threads' pieces made the daemon's memory grow. Two arenas bound it without the slow
    path of one mapping per buffer (M_MMAP_THRESHOLD), which costs first-read throughput
    (docs/performance.md).
    """
    with contextlib.suppress(OSError, AttributeError):
        libc.mallopt(_M_ARENA_MAX, 2)


_M_ARENA_MAX = -8


def _record(model: Model, mountpoint: Path, options: MountOptions, view: ViewSpec) -> dict[str, Any]:
    """What the daemon says of itself: in its runtime record and in .tensorfs/daemon.json."""
    integrity = model.gate.integrity
    metrics = None
    if options.metrics is not None:
        from .metrics import describe

        metrics = describe(options.metrics)
    return {
        "pid": os.getpid(),
        "process_start": process_start(os.getpid()),
        "source": _absolute(model.source),
        "mountpoint": str(mountpoint),
        "version": __version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tensors": len(model),
        "bytes": model.nbytes,
        "options": {
            "layout": options.layout,
            "fuse": list(options.fuse_options),
            "uid": options.ownership.uid,
            "gid": options.ownership.gid,
            "umask": None if options.ownership.umask is None else f"{options.ownership.umask:03o}",
            "readahead_kb": options.readahead_kb,
            "prefetch_mb": options.prefetch_mb,
            "max_background": options.max_background,
            "keep_source_pages": options.keep_source_pages,
            "debug": options.debug,
            "manifest": integrity.expected is not None,
            "signature": integrity.signature(),
            "hash_cache": str(integrity.hasher.cache.directory) if integrity.hasher.cache.enabled else None,
            "remote": options.remote,
            "fallback": []
            if model.fallbacks is None
            else [model.fallbacks.shown(i) for i in range(len(model.fallbacks))],
            "selection": None if model.selection.everything else model.selection.as_json(),
            "view": "folder" if view.folder else f"synthesized: {view.why}",
            "unverified_signature": view.unverified,
            "metrics": metrics,
        },
        "in_force": {"readahead_kb": None, "max_background": None},
        "ready": False,
        "log_file": None if options.log_file is None else str(options.log_file),
    }


def _json(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2) + "\n").encode()


def _absolute(source: ShardKey) -> str:
    return source if isinstance(source, str) else str(source.absolute())


def fsname(source: ShardKey) -> str:
    """The source's absolute path as the mount's fsname (what `df` and `mount` show), as sshfs does.

    libfuse splits options on ',' and takes '\\' as an escape; pyfuse3 passes options as ASCII,
    so other characters (and '%' itself) are %-encoded (UTF-8).
    """
    out = []
    for char in _absolute(source):
        if char in ",\\":
            out.append("\\" + char)
        elif char.isascii() and char.isprintable() and char != "%":
            out.append(char)
        else:
            out.extend(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogateescape"))
    return "".join(out)


def _invalidate(inodes: Sequence[int], attr_only: bool = False) -> None:
    """Have the kernel forget what it caches of `inodes`: pages and attributes, or (`attr_only`) the
    attributes alone (called from a worker thread)."""
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode, attr_only=attr_only)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel holds nothing of it
                log.warning("could not invalidate inode %d: %s", inode, exc.strerror)


async def _run(
    operations: TensorOperations,
    mountpoint: Path,
    options: MountOptions,
    record: dict[str, Any],
    notify: Callable[[str], None],
    connecting: list[Future[None]],
) -> None:
    async with trio.open_nursery() as nursery:
        operations.nursery = nursery
        nursery.start_soon(_handle_signals)
        nursery.start_soon(operations.watch_changes)
        nursery.start_soon(_flush_caches, operations)
        nursery.start_soon(_report_ready, mountpoint, options, record, notify, connecting)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _flush_caches(operations: TensorOperations) -> None:
    """Every second: let go of ranges held for replies sent (when reads stop, no read does it),
    record fetched chunks in the cache (other processes see them), and let go of the source's pages
    served since (off the thread that answers reads)."""
    while True:
        await trio.sleep(1.0)
        operations.release_replied()
        await trio.to_thread.run_sync(operations.flush_sources)


async def _handle_signals() -> None:
    """SIGTERM and SIGINT unmount; SIGHUP reopens the log file (logrotate), the mount goes on."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: %s", reopen_logs())
                continue
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


CONNECT_WAIT = 5.0
"""How long a mount waits for its store's connections before it says it is ready (they go on opening after)."""


async def _report_ready(
    mountpoint: Path,
    options: MountOptions,
    record: dict[str, Any],
    notify: Callable[[str], None],
    connecting: list[Future[None]],
) -> None:
    # A stat of the root from another thread is answered by this daemon's loop: when it returns,
    # the mount is live and answering.
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    if connecting:
        await trio.to_thread.run_sync(functools.partial(wait_for, connecting, CONNECT_WAIT))
    record["in_force"] = {
        "readahead_kb": _set_readahead(st.st_dev, options.readahead_kb),
        "max_background": _set_max_background(st.st_dev, options.max_background),
    }
    record["ready"] = True
    try:
        write_record(mountpoint, record)
    except WriteError as exc:
        log.warning("could not update the daemon's record: %s", exc)
    notify(READY)
    systemd_notify(b"READY=1")


def _nothing() -> None:
    pass


def systemd_notify(message: bytes) -> None:
    """Tell systemd (a Type=notify unit sets NOTIFY_SOCKET): one datagram, as sd_notify(3) sends it."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where  # '@': an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", where, exc.strerror)


def _set_readahead(device: int, kilobytes: int) -> int | None:
    """Raise the mount's readahead so the kernel sends 1 MiB reads (faster than the 128 KiB default:
    docs/performance.md).

    Returns the value in force, read back from the kernel (None if it cannot be read).
    """
    path = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    if kilobytes:
        try:
            path.write_text(f"{kilobytes}\n")
        except OSError as exc:
            log.warning("could not set readahead (%s): %s", path, exc.strerror)
    return _read_number(path)


FUSECTL = Path("/sys/fs/fuse/connections")


def _set_max_background(device: int, requests: int) -> int | None:
    """Lower how many readahead requests the kernel keeps queued at this daemon (its default: 12).

    Every queued read waits on the daemon's one thread, and so does any lookup behind them: with
    fewer, listings stay quick while cold data streams, and the streams finish sooner; one cold
    reader alone reads a little slower with very few (docs/performance.md).
    The knob is in the fusectl file system, mounted if need be. Returns the value in force.
    """
    if os.major(device) != 0:
        return None
    setting = FUSECTL / str(os.minor(device)) / "max_background"
    if requests:
        try:
            if not setting.parent.exists() and os.geteuid() == 0 and not any(FUSECTL.iterdir()):
                subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], capture_output=True, check=False)
                log.info("mounted fusectl at %s to tune the FUSE connection", FUSECTL)
            setting.write_text(f"{requests}\n")
        except OSError as exc:
            log.warning("could not set max_background (%s): %s", setting, exc.strerror)
    return _read_number(setting)


def _read_number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
