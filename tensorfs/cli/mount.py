"""The commands that act on mounts: mount, umount, status, stats."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, cast

import click

from ..errors import TensorfsError, printable
from ..opening.view_files import ViewRequest
from ..proof.signature import Signature
from ..selection import Selection
from ..sources.store import RemoteOptions
from ..utils.names import Layout
from ..utils.units import human_size
from .group import cli
from .options import (
    FINITE_SECONDS,
    MAX_BACKGROUND_LIMIT,
    PREFETCH_LIMIT_MB,
    READAHEAD_KB,
    Finite,
    ModelLocation,
    ParsedText,
    cache_options,
    fallback_option,
    layout_option,
    manifest_options,
    remote_options,
    selection_options,
    signature_options,
    source_of,
    view_options,
)
from .output import OutputError, error_lines, table


def _metrics_address(text: str) -> tuple[str, int] | str:
    """[HOST:]PORT, or unix:PATH, of the metrics endpoint."""
    from ..mount.metrics import parse_address

    return parse_address(text)


@cli.command(short_help="Mount MODEL read-only at MOUNTPOINT, one file per tensor.")
@click.argument("path", metavar="MODEL", type=ModelLocation())
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("-f", "--foreground", is_flag=True, help="Stay attached; Ctrl-C unmounts.")
@click.option(
    "-o",
    "fuse_options",
    multiple=True,
    metavar="OPT[,OPT...]",
    help="Mount options (repeatable): FUSE's, e.g. allow_other; and uid=, gid=, umask= to set every file's owner, "
    "group and permissions instead of taking them from the shards.",
)
@layout_option
@click.option("-q", "--quiet", is_flag=True, help="No progress line (on a terminal), and nothing said once mounted.")
@click.option("--debug", is_flag=True, help="Log every request (and libfuse's own debug output with -f).")
@click.option(
    "--log-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Where the daemon logs. Default: stderr with -f, else $XDG_STATE_HOME/tensorfs/MOUNTPOINT.log "
    "(the mountpoint escaped as systemd does, e.g. mnt-weights.log).",
)
@click.option(
    "--readahead-kb",
    type=READAHEAD_KB,
    default=1024,
    show_default=True,
    help="The mount's kernel readahead, raised once it is up (0 leaves the kernel's default).",
)
@click.option(
    "--prefetch-mb",
    type=click.IntRange(1, PREFETCH_LIMIT_MB),
    default=32,
    show_default=True,
    help="How far ahead of a sequential reader the daemon brings data in from disk, off its main thread.",
)
@click.option(
    "--max-background",
    type=click.IntRange(0, MAX_BACKGROUND_LIMIT),
    default=4,
    show_default=True,
    help="Readahead requests the kernel may queue at the daemon (0 keeps the kernel's 12; root only): fewer "
    "keeps lookups quick while data streams.",
)
@fallback_option
@click.option(
    "--keep-source-pages",
    is_flag=True,
    help="Keep the shards' own pages (a remote model's: its cache files') in memory after the kernel has the "
    "mounted files' copy: twice the memory for what is read, for a remount that finds it there. By default "
    "each byte read is held once.",
)
@manifest_options("Serve no tensor", "all before mounting")
@signature_options
@view_options("What .tensorfs/model/ holds")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="The log's lines: text, or one JSON object each (time, level, pid, event, fields).",
)
@click.option(
    "--metrics",
    type=ParsedText("address", _metrics_address),
    metavar="[HOST:]PORT|unix:PATH",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST 127.0.0.1 unless given: any local user "
    "can read them), or on a Unix socket only you can use (made 0600).",
)
@selection_options
@cache_options
@remote_options
def mount(
    path: Path | str,
    mountpoint: Path,
    foreground: bool,
    fuse_options: tuple[str, ...],
    layout: Layout,
    quiet: bool,
    debug: bool,
    log_file: Path | None,
    readahead_kb: int,
    prefetch_mb: int,
    max_background: int,
    fallback: tuple[Path | str, ...],
    keep_source_pages: bool,
    manifest_path: Path | str | None,
    verify: str | None,
    signature: Signature | None,
    view: ViewRequest,
    log_format: str,
    metrics: tuple[str, int] | str | None,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> int:
    """Mount MODEL read-only at MOUNTPOINT: one file per tensor, with .meta.json and .sha256 beside it.

    Everything is validated first, as `validate` does; nothing is mounted if anything is wrong.
    With --include/--exclude/--layers only the selected tensors appear, everywhere in the mount.
    Returns once the mount answers, leaving the daemon in the background (unless -f), and says
    so in one line (unless -q).
    """
    from ..mount.daemon import mount as mount_model
    from ..mount.helper import tensorfs_options
    from ..mount.options import MountOptions, split_fuse_options

    model = source_of(path, remote, no_cache, fallback)
    own = {key: flag for key, (flag, _) in tensorfs_options(mount).items()}
    passed, ownership = split_fuse_options(fuse_options, own)
    options = MountOptions(
        layout=layout,
        fuse_options=passed,
        ownership=ownership,
        foreground=foreground,
        debug=debug,
        log_file=log_file.absolute() if log_file else None,
        readahead_kb=readahead_kb,
        prefetch_mb=prefetch_mb,
        max_background=max_background,
        keep_source_pages=keep_source_pages,
        quiet=quiet,
        remote=model.settings(),
        metrics=metrics,
        log_format=log_format,
    )

    from ..mount.prepare import Opening, prepare
    from ..opening.source import Verify

    def warn(warning: str) -> None:
        error_lines([warning], prefix="warning: ")

    def announce(line: str) -> None:
        if quiet:
            return
        try:
            click.echo(line)
        except OutputError as exc:  # the mount stands: say so, for the exit code says something failed
            raise OutputError(exc.cause, f"mounted {printable(str(mountpoint))}, but ") from None

    # The model is validated after the daemon is forked: obstore (a remote model) cannot cross a fork.
    opening = Opening(selection, layout, manifest_path, cast(Verify | None, verify), signature, view)
    ready = partial(prepare, model, opening, warn, not quiet)
    return mount_model(ready, mountpoint, options, announce)


@cli.command(short_help="Unmount a tensorfs mount, also one whose daemon died or hangs.")
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("-z", "--lazy", is_flag=True, help="Detach now, finish when the mount is no longer busy.")
def umount(mountpoint: Path, lazy: bool) -> None:
    """Unmount a tensorfs mount, also one whose daemon died or hangs (detached, and the daemon stopped)."""
    from ..mount.mounttable import unmount

    done = unmount(mountpoint, lazy=lazy)
    if "hung" in done:
        click.echo(done)


@cli.command(short_help="Each tensorfs mount and how it is: ok, degraded, hung or dead.")
@click.argument("mountpoints", metavar="[MOUNTPOINT]...", nargs=-1, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per mount and line.")
@click.option(
    "--timeout",
    type=FINITE_SECONDS,
    default=2.0,
    show_default=True,
    help="Seconds a daemon has to answer before its mount is called hung.",
)
def status(mountpoints: tuple[Path, ...], as_json: bool, timeout: float) -> int:
    """Each tensorfs mount (or those named) and how it is: ok, degraded (serving, but tensors failed
    verification, a shard changed under it, or an EIO in the last minute), hung (its daemon does not
    answer) or dead; with bytes served and uptime.

    Exit 0 when every mount shown is ok (or there is none), 1 when any is not. Never blocks on a mount.
    """
    from ..mount.mounttable import FSTYPE, health, mounts, read_stats, resolve_mountpoint
    from ..mount.stats import degraded
    from ..mount.statsview import duration

    entries = [entry for entry in mounts() if entry.fstype == FSTYPE]
    if mountpoints:
        wanted = [resolve_mountpoint(path) for path in mountpoints]
        missing = [
            path for path, real in zip(mountpoints, wanted, strict=True) if real not in {e.mountpoint for e in entries}
        ]
        if missing:
            raise TensorfsError(f"{printable(str(missing[0]))}: not a tensorfs mount")
        entries = [entry for entry in entries if entry.mountpoint in wanted]

    def look(entry: Any) -> tuple[Any, dict[str, Any] | None]:
        state = health(entry.mountpoint, timeout)
        found = read_stats(entry.mountpoint, timeout) if state.healthy else None
        return state, found if isinstance(found, dict) else None

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(entries)))) as pool:  # hung ones wait together
        looked = list(pool.map(look, entries))
    rows = []
    healthy = True
    for entry, (state, counters) in zip(entries, looked, strict=True):
        record = state.record or {}
        source = str(record.get("source") or entry.source)
        shown_state, reason = state.state, state.reason
        why = degraded(counters) if counters is not None else None
        if why is not None:
            shown_state, reason = "degraded", why
        healthy = healthy and shown_state == "ok"
        served = sum(counters["read_bytes"].values()) if counters is not None else None
        signed = (record.get("options") or {}).get("signature")
        view = str((record.get("options") or {}).get("view") or "folder")
        unverified = (record.get("options") or {}).get("unverified_signature")
        uptime = counters["uptime_seconds"] if counters is not None else None
        if as_json:
            document = {**record, "mountpoint": str(entry.mountpoint), "source": source}
            document.update(state=shown_state, live=state.healthy, reason=reason or None, pid=state.pid)
            document.update(served_bytes=served, uptime_seconds=uptime)
            click.echo(json.dumps(document))
            continue
        shown = printable(str(entry.mountpoint))
        if shown_state == "ok":
            what_to_do = ""
        elif shown_state == "degraded":
            what_to_do = f"{reason}; see tensorfs stats {shown} and its log"
        else:
            what_to_do = f"{reason}; run: tensorfs umount {shown}"
        rows.append(
            (
                shown,
                shown_state,
                str(state.pid or "-"),
                str(record.get("tensors", "-")),
                human_size(int(record["bytes"])) if isinstance(record.get("bytes"), int) else "-",
                human_size(served) if served is not None else "-",
                duration(uptime) if uptime is not None else "-",
                printable(source)
                + (f", signed by {printable(str(signed['signer']))}" if isinstance(signed, dict) else "")
                + (f"; its view {printable(view)}" if view != "folder" else "")
                + (f"; {printable(str(unverified))} not verified" if unverified else "")
                + (f"  ({printable(what_to_do)})" if what_to_do else ""),
            )
        )
    if not as_json:
        if not rows:
            click.echo("no tensorfs mounts")
        else:
            header = ("MOUNTPOINT", "STATE", "PID", "TENSORS", "SIZE", "SERVED", "UP", "SOURCE")
            for line in table([header, *rows], "<<<<<<<"):
                click.echo(line)
    return 0 if healthy else 1


@cli.command(short_help="What a mount's daemon has done: bytes, rates, latency, errors.")
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="The counters as one JSON object a line (as stats.json).")
@click.option(
    "--watch", type=Finite(0.1, 86400), metavar="SECONDS", help="Again every SECONDS, with the rates between."
)
@click.option(
    "--timeout",
    type=FINITE_SECONDS,
    default=2.0,
    show_default=True,
    help="Seconds the daemon has to answer before it is called hung.",
)
def stats(mountpoint: Path, as_json: bool, watch: float | None, timeout: float) -> None:
    """What the daemon of a mount has done: bytes served, rates, read latency, errors, memory.

    Read from MOUNTPOINT/.tensorfs/stats.json, with a deadline (a hung daemon is an error, never a
    hang). With --watch the table is drawn again in place on a terminal, as lines when piped; Ctrl-C ends it,
    and so does the mount going away (an error).
    """
    from ..mount.mounttable import FSTYPE, mount_at, read_stats, resolve_mountpoint
    from ..mount.statsview import render

    real = resolve_mountpoint(mountpoint)
    entry = mount_at(real)
    shown = printable(str(mountpoint))
    if entry is None or entry.fstype != FSTYPE:
        raise TensorfsError(f"{shown}: not a tensorfs mount")

    def snapshot() -> dict[str, Any]:
        found = read_stats(real, timeout)
        if isinstance(found, str):
            now = mount_at(real)
            if now is None or now.fstype != FSTYPE:  # unmounted since (a --watch outlives it)
                raise TensorfsError(f"{shown}: not mounted any more")
            why = {"hung": f"its daemon did not answer within {timeout:g} s", "dead": "its daemon is gone"}
            raise TensorfsError(f"{shown}: {why.get(found, found)}; see tensorfs status")
        return found

    before: dict[str, Any] | None = None
    redraw = watch is not None and sys.stdout.isatty() and not as_json
    try:
        while True:
            now = snapshot()
            if as_json:
                click.echo(json.dumps(now))
            else:
                table = render(printable(str(real)), now, before)
                click.echo(("\x1b[H\x1b[2J" if redraw else "") + table + ("" if redraw or watch is None else "\n"))
            if watch is None:
                return
            before = now
            time.sleep(watch)
    except KeyboardInterrupt:
        return
