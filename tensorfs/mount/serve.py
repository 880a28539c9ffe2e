"""Serving a mount: pyfuse3.init, the trio loop, readiness, signals, unmount."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from .. import __version__
from ..integrity import Integrity
from ..model import Model
from . import fs
from .daemon import READY, MountOptions, default_log_file
from .fs import TensorOperations
from .tree import Tree, index_json

log = logging.getLogger("tensorfs")


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
                "prefetch_mb": options.prefetch_mb,
                "max_background": options.max_background,
                "debug": options.debug,
                "manifest": integrity.expected is not None,
                "hash_cache": str(integrity.hasher.cache.directory) if integrity.hasher.cache.enabled else None,
            },
            "log_file": None
            if options.foreground and options.log_file is None
            else str(options.log_file or default_log_file()),
        }
        return (json.dumps(document, indent=2) + "\n").encode()

    fs.TRACE_REQUESTS = options.debug
    tree = Tree(model, options.layout, {"index.json": lambda: index_json(model), "daemon.json": daemon_json})
    operations = TensorOperations(tree, integrity)
    operations.prefetch = options.prefetch_mb << 20
    fuse_options = set(pyfuse3.default_options) | {"fsname=tensorfs", "subtype=tensorfs", "ro"}
    fuse_options |= set(options.fuse_options)
    if options.debug and options.foreground:
        fuse_options.add("debug")
    try:
        pyfuse3.init(operations, str(mountpoint), fuse_options)
    except RuntimeError as exc:
        hint = f" (check the -o options: {','.join(options.fuse_options)})" if options.fuse_options else ""
        notify(f"cannot mount at {mountpoint}: {exc}{hint}")
        return 1
    log.info("serving %s (%d tensors) at %s", model.source, len(model), mountpoint)
    try:
        trio.run(_run, operations, mountpoint, options, notify)
    except BaseException:
        pyfuse3.close(unmount=False)  # the session may be broken: pyfuse3's advice is to not unmount
        raise
    pyfuse3.close(unmount=True)
    log.info("unmounted %s", mountpoint)
    return 0


async def _run(
    operations: TensorOperations, mountpoint: Path, options: MountOptions, notify: Callable[[str], None]
) -> None:
    async with trio.open_nursery() as nursery:
        operations.nursery = nursery
        nursery.start_soon(_unmount_on_signal)
        nursery.start_soon(_report_ready, mountpoint, options, notify)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _unmount_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _report_ready(mountpoint: Path, options: MountOptions, notify: Callable[[str], None]) -> None:
    # A stat of the root from another thread is answered by this daemon's loop: when it returns,
    # the mount is live and answering.
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    if options.readahead_kb:
        _set_readahead(st.st_dev, options.readahead_kb)
    if options.max_background:
        _set_max_background(st.st_dev, options.max_background)
    notify(READY)


def _set_readahead(device: int, kilobytes: int) -> None:
    """Raise the mount's readahead so the kernel sends 1 MiB reads (1.7x the 128 KiB default here)."""
    path = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    try:
        path.write_text(f"{kilobytes}\n")
    except OSError as exc:
        log.warning("could not set readahead (%s): %s", path, exc.strerror)


FUSECTL = Path("/sys/fs/fuse/connections")


def _set_max_background(device: int, requests: int) -> None:
    """Lower how many readahead requests the kernel keeps queued at this daemon (its default: 12).

    Every queued read waits on the daemon's one thread, and so does any lookup behind them: with
    four readers streaming cold data, listing the root took 74 ms (median) at 12 and 0.8 ms at 3,
    and the streams finished sooner; one cold reader alone reads a little slower with very few.
    The knob is in the fusectl file system, mounted if need be.
    """
    if os.major(device) != 0:
        return
    setting = FUSECTL / str(os.minor(device)) / "max_background"
    try:
        if not setting.parent.exists() and os.geteuid() == 0 and not any(FUSECTL.iterdir()):
            subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], capture_output=True, check=False)
            log.info("mounted fusectl at %s to tune the FUSE connection", FUSECTL)
        setting.write_text(f"{requests}\n")
    except OSError as exc:
        log.warning("could not set max_background (%s): %s", setting, exc.strerror)
