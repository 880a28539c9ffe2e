"""The commands of remote models' cache: prefetch, and cache ls, du and prune."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ..errors import TensorfsError, printable
from ..selection import Selection
from ..sources.chunks import default_cache_dir
from ..sources.store import RemoteOptions
from ..utils.progress import Progress
from ..utils.units import human_size
from .group import cli
from .options import ByteSize, hidden_alias, model_argument, quiet_option, remote_options, selection_options, source_of
from .output import table


@cli.command(short_help="Fetch a remote MODEL (or a selection of it) into the cache.")
@model_argument
@quiet_option
@selection_options
@remote_options
def prefetch(
    path: Path | str, quiet: bool, selection: Selection, cache_dir: Path | None, remote: RemoteOptions
) -> None:
    """Fetch every byte of a remote MODEL (or of a selection's tensors) into the cache, ahead of a job.

    A progress line on a terminal. Afterwards the model (the selection) mounts and reads with --offline too.
    """
    from ..prefetch import fetch_plan

    with source_of(path, remote).open(selection, progress=not quiet) as model:
        wanted = fetch_plan(model, whole=selection.everything)
        if not wanted:
            click.echo(f"{printable(str(path))}: a local model: nothing to fetch")
            return
        total = sum(data.chunk_bytes(chunk) for data, chunks in wanted.items() for chunk in chunks)
        if remote.cache_size is not None and total > remote.cache_size:
            size = human_size(remote.cache_size)
            raise TensorfsError(f"{printable(str(path))}: {human_size(total)} does not fit in --cache-size {size}")
        with Progress(total, "fetching", quiet=quiet) as progress:
            for data, chunks in wanted.items():
                data.prefetch(progress.advance, chunks)
        missing = sum(data.missing(chunks) for data, chunks in wanted.items())
        if missing:  # evicted meanwhile (the cache is shared, and bounded): --offline would not find them
            raise TensorfsError(f"{printable(str(path))}: {missing} chunk(s) were evicted again: raise --cache-size")
        click.echo(f"{printable(str(path))}: {len(wanted)} shard(s), {human_size(total)} cached")


@cli.group(short_help="What the cache of remote models holds, and trimming it.")
def cache() -> None:
    """The local cache of remote models' bytes: what it holds, and trimming it."""


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="The cache. Default: $XDG_CACHE_HOME/tensorfs (~/.cache/tensorfs).",
)


def _object_cache(cache_dir: Path | None) -> Any:
    from ..sources.chunks import ChunkCache

    directory = (cache_dir or default_cache_dir()).absolute()
    if not (directory / "objects.sqlite").exists():
        raise TensorfsError(f"{directory}: no cache of remote models here")
    return ChunkCache(directory)


@cache.command(name="ls", short_help="Every object version cached: size, bytes cached, use.")
@cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per object version and line.")
def cache_ls(cache_dir: Path | None, as_json: bool) -> None:
    """Every object version in the cache: URL, size, bytes cached, last used, whether in use now."""
    entries = _object_cache(cache_dir).entries()
    if as_json:
        for e in entries:
            record = {"url": e.url, "etag": e.etag, "size": e.size, "cached": e.cached, "used": e.used}
            click.echo(json.dumps({**record, "in_use": e.in_use}))
        return
    rows = [("SIZE", "CACHED", "LAST USED", "IN USE", "URL")]
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))
        rows.append((human_size(e.size), human_size(e.cached), used, "yes" if e.in_use else "no", printable(e.url)))
    for line in table(rows, ">>>>"):
        click.echo(line)


@cache.command(name="du", short_help="How much the cache holds.")
@cache_dir_option
def cache_du(cache_dir: Path | None) -> None:
    """How much the cache holds."""
    cached = _object_cache(cache_dir)
    entries = cached.entries()
    held = sum(e.cached for e in entries)
    click.echo(f"{human_size(held)} ({held} bytes) cached of {len(entries)} object version(s), in {cached.directory}")


@cache.command(name="prune", short_help="Evict what is not in use, down to a size.")
@cache_dir_option
@hidden_alias("--max-size", "--cache-size", type=ByteSize())
@click.option(
    "--cache-size",
    type=ByteSize(),
    help="Keep at most this much (least recently used goes first), as a mount's --cache-size. Default: nothing.",
)
def cache_prune(cache_dir: Path | None, cache_size: int | None) -> None:
    """Evict what is not in use (by a mount or a command) until the cache holds at most --cache-size."""
    cached = _object_cache(cache_dir)
    freed = cached.prune(cache_size or 0)
    held = sum(e.cached for e in cached.entries())
    click.echo(f"freed {human_size(freed)}; {human_size(held)} cached")
