"""The `tensorfs` command line: one subcommand per thing a user does with a model."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import click

from . import __version__
from .errors import InvalidModelError, Problem, TensorfsError, printable
from .integrity import (
    HashCache,
    Hasher,
    Integrity,
    compare,
    find_default_manifest,
    read_manifest,
    require_coverage,
    shard_of_a_model,
)
from .manifest import DEFAULT_MANIFEST, format_manifest
from .model import Model, open_model
from .names import LAYOUTS, Layout
from .progress import Progress
from .selection import Selection, parse_layers
from .sources.cache import default_cache_dir
from .sources.shard import shard_name
from .sources.store import RemoteOptions, is_remote, unsupported_scheme
from .units import human_size

if TYPE_CHECKING:
    from .views import ViewSpec

# The mount layer is imported by the commands that use it: the others start the faster for it.
READAHEAD_LIMIT_KB = 1 << 20
"""1 GiB: beyond it readahead is no longer ahead of anything a reader does."""
PREFETCH_LIMIT_MB = 1024
MAX_BACKGROUND_LIMIT = (1 << 16) - 1
"""The most the kernel takes for a FUSE connection's max_background (fs/fuse/control.c)."""


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


class OutputError(TensorfsError):
    """Standard output could not be written (a full disk, a closed pipe): the output is lost."""

    def __init__(self, exc: OSError, done: str = "") -> None:
        super().__init__(f"{done}cannot write to standard output: {exc.strerror or exc}")
        self.cause = exc
        self.broken_pipe = exc.errno == errno.EPIPE


_PIECE = 1 << 14
"""Characters of standard output written at once at most (a pipe holds 64 KiB)."""


class _GuardedOutput:
    """Standard output for the commands: an error writing it is an OutputError, not a traceback.

    Every command's output (and click's help) goes through it, so every command fails alike.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream  # None: the process was started with standard output closed

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            if len(text) <= _PIECE:
                return self._stream.write(text)
            # Python's buffered writer drops the error of a write that went out in part (`| head`):
            # a long text goes a pipe's worth at a time, each piece flushed, so the error is seen.
            for start in range(0, len(text), _PIECE):
                self._stream.write(text[start : start + _PIECE])
                self._stream.flush()
            return len(text)
        except OSError as exc:
            raise OutputError(exc) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            raise OutputError(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command as Ctrl-C does: what was half-written is removed on the way out."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {number: signal.signal(number, leave) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def write_file(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a regular file), or as it comes (a device, a pipe)."""
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        special = False
    except OSError as exc:
        raise TensorfsError(f"cannot write {path}: {exc.strerror}") from None
    target = path if special else path.with_name(f".{path.name}.partial")
    try:
        with _ended_by_signals(), open(target, "w", encoding="utf-8") as out:
            out.write(text)
        if not special:
            target.replace(path)  # all or nothing: never a half-written file
    except BaseException as exc:  # a write that failed, or Ctrl-C, SIGTERM, SIGHUP: nothing half-written left
        if not special:
            with contextlib.suppress(OSError):  # nothing to remove, or a read-only directory
                target.unlink()
        if isinstance(exc, OSError):
            raise TensorfsError(f"cannot write {path}: {exc.strerror}") from None
        raise


class Finite(click.FloatRange):
    """A float within bounds, and a number: click's FloatRange lets NaN through."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number.", param, ctx)
        return number


class ReadaheadKB(click.IntRange):
    """0 (the kernel's own), or a readahead of at least a page: the kernel takes 1-3 KiB as 0."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        kilobytes = super().convert(value, param, ctx)
        if 0 < kilobytes < 4:
            self.fail(f"{kilobytes} is less than a page (4 KiB): the kernel would turn readahead off.", param, ctx)
        return kilobytes


FINITE_SECONDS = Finite(0.1, 60)
READAHEAD_KB = ReadaheadKB(0, READAHEAD_LIMIT_KB)

layout_option = click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="slash",
    show_default=True,
    help="How tensor names become paths: 'slash' nests on '/', 'dotted' also on '.'.",
)


class ModelSource(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A model: a local path, or the URL of one in a store (s3://, http(s)://, hf://)."""

    name = "model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        why = unsupported_scheme(value)
        if why is not None:
            self.fail(why, param, ctx)
        if isinstance(value, Path) or not is_remote(value):
            return Path(value)
        return str(value)


class ByteSize(click.ParamType):  # type: ignore[type-arg]
    """A size in bytes: 1048576, 512M, 20G, 1.5T (binary units)."""

    name = "size"
    _UNITS: ClassVar[dict[str, int]] = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in self._UNITS else ""
        try:
            number = float(text[: len(text) - len(unit)])
        except ValueError:
            self.fail(f"{value!r} is not a size (e.g. 512M, 20G)", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} is not a size above 0", param, ctx)
        return int(number * self._UNITS[unit])


model_argument = click.argument("path", metavar="MODEL", type=ModelSource())


class ParsedBy(click.ParamType):  # type: ignore[type-arg]
    """A value `parse` makes of the text (its ValueError: a usage error saying why)."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name = name
        self._parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):  # already converted (a default)
            return value
        try:
            return self._parse(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _metrics_address(text: str) -> tuple[str, int] | str:
    """[HOST:]PORT, or unix:PATH, of the metrics endpoint."""
    from .mount.metrics import parse_address

    return parse_address(text)


def selection_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--include/--exclude/--layers, as one Selection `selection`."""

    @functools.wraps(command)
    def with_selection(
        *args: Any, include: tuple[str, ...], exclude: tuple[str, ...], layers: tuple[int, int] | None, **kwargs: Any
    ) -> Any:
        return command(*args, selection=Selection(include, exclude, layers), **kwargs)

    options = [
        click.option(
            "--include",
            metavar="GLOB",
            multiple=True,
            help="Only tensors whose name matches (fnmatch, e.g. 'model.layers.1?.*'; repeatable). Default: all.",
        ),
        click.option(
            "--exclude", metavar="GLOB", multiple=True, help="Leave out tensors whose name matches (repeatable)."
        ),
        click.option(
            "--layers",
            type=ParsedBy("A-B", parse_layers),
            help="Only layers A to B (inclusive) of names like model.layers.N.*; tensors of no numbered layer "
            "(embeddings, norms, head) stay unless excluded.",
        ),
    ]
    for option in reversed(options):
        with_selection = option(with_selection)
    return with_selection


def open_selected(
    path: Path | str, selection: Selection, remote: RemoteOptions, *, no_cache: bool = False, **kwargs: Any
) -> Model:
    """open_model with the command's selection, remote options and header cache (--cache-dir, --no-cache)."""
    cache = False if no_cache else (remote.cache_dir or True)
    return open_model(
        path,
        include=selection.include,
        exclude=selection.exclude,
        layers=selection.layers,
        remote=remote,
        cache=cache,
        **kwargs,
    )


def remote_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options of models in stores (and the cache they are read through), as one RemoteOptions `remote`."""

    @functools.wraps(command)
    def with_remote(
        *args: Any,
        endpoint_url: str | None,
        region: str | None,
        no_sign_request: bool,
        cache_size: int | None,
        chunk_mb: int,
        remote_concurrency: int,
        remote_timeout: float,
        offline: bool,
        **kwargs: Any,
    ) -> Any:
        remote = RemoteOptions(
            endpoint_url=endpoint_url,
            region=region,
            no_sign_request=no_sign_request,
            cache_dir=kwargs["cache_dir"].absolute() if kwargs.get("cache_dir") else None,
            cache_size=cache_size,
            chunk_size=chunk_mb << 20,
            concurrency=remote_concurrency,
            timeout=remote_timeout,
            offline=offline,
        )
        return command(*args, remote=remote, **kwargs)

    options = [
        click.option("--endpoint-url", metavar="URL", help="An S3-compatible store's endpoint (or AWS_ENDPOINT_URL)."),
        click.option("--region", help="The S3 region (or AWS_REGION; default us-east-1)."),
        click.option(
            "--no-sign-request", is_flag=True, help="Anonymous requests: a public bucket, or the Hub unlogged."
        ),
        click.option(
            "--cache-dir",
            type=click.Path(path_type=Path, file_okay=False),
            help="Where the caches live: validated headers, hashes, and the bytes of remote models. "
            "Default: $XDG_CACHE_HOME/tensorfs (~/.cache/tensorfs).",
        ),
        click.option(
            "--cache-size",
            type=ByteSize(),
            help="Bound the cache of remote models (e.g. 50G): least recently used chunks go first. Default: no bound.",
        ),
        click.option(
            "--chunk-mb",
            type=click.IntRange(1, 1024),
            default=8,
            show_default=True,
            help="The unit remote objects are fetched and cached in.",
        ),
        click.option(
            "--remote-concurrency", type=click.IntRange(1, 64), default=8, show_default=True, help="GETs at once."
        ),
        click.option(
            "--remote-timeout",
            type=Finite(1, 3600),
            default=60.0,
            show_default=True,
            help="Seconds a read may wait on the store, retries included, before it fails (EIO).",
        ),
        click.option("--offline", is_flag=True, help="Use what the cache holds of a remote model; no request at all."),
    ]
    for option in reversed(options):
        with_remote = option(with_remote)
    return with_remote


def cache_options(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--no-cache",
        is_flag=True,
        help="Neither read nor write the caches of validated headers and of hashes: validate and hash from scratch.",
    )(command)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tensorfs")
def cli() -> None:
    """Serve the tensors of a safetensors model as files, one per tensor.

    MODEL is a .safetensors file, a directory of shards (with or without
    model.safetensors.index.json), or an index file; or such a model in a
    store, read through a local cache: s3://BUCKET/PREFIX (or .../KEY.safetensors),
    https://.../model.safetensors.index.json (or .../NAME.safetensors),
    hf://ORG/NAME[@REVISION].
    """


@cli.command()
@model_argument
@layout_option
@selection_options
@cache_options
@remote_options
def validate(
    path: Path | str,
    layout: Layout,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """Check every header of MODEL as `mount` would, and summarise it (the selection, if one is given).

    Files unchanged since they were last validated (same device, inode, size, mtime and ctime) are
    taken from the cache of validated headers; --no-cache checks everything from scratch.
    Exit 0 when valid; exit 1 and one line per problem on stderr when not.
    """
    with open_selected(path, selection, layout=layout, remote=remote, no_cache=no_cache) as model:
        click.echo(
            f"{printable(str(path))}: valid: {len(model.shards)} shard{'s' * (len(model.shards) != 1)}, "
            f"{len(model)} tensor{'s' * (len(model) != 1)}, {human_size(model.nbytes)} ({model.nbytes} bytes)"
            + ("" if selection.everything else f", selected by {printable(selection.describe())}")
        )


@cli.command(name="ls")
@model_argument
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tensor and line, as in its .meta.json.")
@selection_options
@cache_options
@remote_options
def ls_command(
    path: Path | str, as_json: bool, selection: Selection, cache_dir: Path | None, no_cache: bool, remote: RemoteOptions
) -> None:
    """List the tensors of MODEL: name, dtype, shape, size and shard."""
    with open_selected(path, selection, remote=remote, no_cache=no_cache) as model:
        if as_json:
            _ls_json(model)
        else:
            _ls_table(model)


def _ls_json(model: Model) -> None:
    out = sys.stdout
    for name in model:
        out.write(json.dumps(model.info(name).as_json(), ensure_ascii=False) + "\n")


def _ls_table(model: Model) -> None:
    rows = [("NAME", "DTYPE", "SHAPE", "SIZE", "SHARD")]
    for name in model:
        info = model.info(name)
        rows.append(
            (printable(name), info.dtype, shape_text(info.shape), human_size(info.nbytes), shard_name(info.shard))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    out = sys.stdout
    for row in rows:
        out.write(
            f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}  {row[4]}\n"
        )


def open_cache(cache_dir: Path | None, no_cache: bool) -> HashCache:
    return HashCache(None if no_cache else (cache_dir or default_cache_dir()).absolute())


def hash_model(model: Model, cache: HashCache) -> dict[str, str]:
    """Every tensor's SHA-256, with a progress line on a terminal."""
    with Progress(model.nbytes, "hashing") as progress:
        return Hasher(model, cache).hash_all(progress=progress.advance)


@cli.command()
@model_argument
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), help="Write here, not to stdout.")
@click.option("--json", "as_json", is_flag=True, help="A JSON object {tensor name: hex SHA-256}.")
@selection_options
@cache_options
@remote_options
def manifest(
    path: Path | str,
    output: Path | None,
    as_json: bool,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """The SHA-256 of every tensor's raw bytes, in sha256sum format (`<hex>  <tensor name>`) by name.

    Hashes found in the cache (same shard file, unchanged) are not computed again.
    """
    with open_selected(path, selection, remote=remote, no_cache=no_cache) as model:
        text = format_manifest(hash_model(model, open_cache(cache_dir, no_cache)), as_json=as_json)
    if output is None:
        sys.stdout.write(text)
    else:
        write_file(output, text)


def view_files_option(name: str, what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """How many files the synthesized model is cut into (`what` says where it is)."""
    return click.option(
        name,
        type=click.IntRange(0, 99999),
        default=0,
        help=f"{what} is cut into this many files (at most one a tensor), with an index when more than one. "
        "Default (0): one up to 20 GiB of tensors, else files of at most 5 GiB.",
    )


@cli.command()
@model_argument
@click.argument("dest", type=click.Path(path_type=Path))
@view_files_option("--shards", "A directory DEST: the model")
@selection_options
@remote_options
def export(
    path: Path | str, dest: Path, shards: int, selection: Selection, cache_dir: Path | None, remote: RemoteOptions
) -> None:
    """Write MODEL's tensors (or a selection of them) as a new safetensors model at DEST.

    DEST ending in .safetensors: one file. Otherwise a new directory holding what .tensorfs/model/
    of a mount holds: model.safetensors (or model-0000K-of-0000N.safetensors and an index) and the
    model's companion files (config.json, tokenizer files, ...). Streamed, with a progress line on
    a terminal; written whole or not at all.
    """
    from .views import build_view
    from .views.export import view_bytes, write_view

    shown = printable(str(dest))
    one_file = dest.name.endswith(".safetensors")
    if one_file and shards:
        raise TensorfsError(f"{shown}: --shards needs a directory DEST (a .safetensors DEST is one file)")
    if dest.exists() or dest.is_symlink():  # never over anything, the source's own files least of all
        raise TensorfsError(f"{shown}: already exists; name a new {'file' if one_file else 'directory'}")
    with open_selected(path, selection, remote=remote) as model, _ended_by_signals():
        tensors = f"{len(model)} tensor{'s' * (len(model) != 1)}"
        if one_file:
            with Progress(model.nbytes, "writing") as progress:
                model.write_safetensors(dest, progress.advance)
            done = f"wrote {shown}: {tensors}, {human_size(dest.stat().st_size)}"
        else:
            view = build_view(model, view_spec(path, shards, remote))
            try:
                with Progress(view_bytes(view), "writing") as progress:
                    write_view(view, dest, progress.advance)
            finally:
                view.close()
            done = f"wrote {shown}/: {tensors}, {len(view.files)} file{'s' * (len(view.files) != 1)}"
    try:
        click.echo(done)
    except OutputError as exc:  # the model is written: say so, for the exit code says something failed
        raise OutputError(exc.cause, f"wrote {shown}, but ") from None


@cli.command()
@model_argument
@click.option(
    "--manifest",
    "manifest_path",
    type=ModelSource(),
    metavar="FILE|URL",
    help=f"The manifest to check against (sha256sum or JSON; a file or a URL). Default: {DEFAULT_MANIFEST} in "
    "MODEL (in its directory, for a file).",
)
@selection_options
@cache_options
@remote_options
def verify(
    path: Path | str,
    manifest_path: Path | str | None,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """Hash every tensor of MODEL (or of the selection) and compare with a manifest.

    Exit 0 when all match; exit 1 naming every mismatched, missing and unexpected tensor. With a
    selection, the manifest may list other tensors too.
    """
    # The model first: its errors name it, not the manifest beside it.
    with open_selected(path, selection, remote=remote, no_cache=no_cache) as model:
        in_model = manifest_path is None
        manifest_path = manifest_path or find_default_manifest(path, remote)
        if manifest_path is None:
            where = path if isinstance(path, str) or path.is_dir() else path.parent
            raise TensorfsError(f"{where}: no {DEFAULT_MANIFEST} here; name a manifest with --manifest FILE")
        expected = read_manifest(manifest_path, remote, in_model=in_model)
        actual = hash_model(model, open_cache(cache_dir, no_cache))
        result = compare(model, expected, actual)
        label = str(manifest_path)
        problems = [
            Problem(str(model.info(name).shard), f"does not match {label} (sha256 {actual[name]})", name)
            for name in result.mismatched
        ]
        if not shard_of_a_model(path) and selection.everything:  # else it lists other tensors too, rightly
            problems += [Problem(label, "is in the manifest but not in the model", name) for name in result.missing]
        problems += [Problem(label, "is in the model but not in the manifest", name) for name in result.unexpected]
        if problems:
            raise InvalidModelError(problems)
        click.echo(f"{printable(str(path))}: all {len(model)} tensors match {printable(label)}")


@cli.command()
@click.argument("source", metavar="MODEL", type=ModelSource())
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
@click.option("-q", "--quiet", is_flag=True, help="Print nothing once mounted.")
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
@click.option(
    "--manifest",
    "manifest_path",
    type=ModelSource(),
    metavar="FILE|URL",
    help=f"Serve no tensor before its bytes match this manifest (a file or a URL). Default: {DEFAULT_MANIFEST} "
    "in MODEL (in its directory, for a file), if there.",
)
@click.option(
    "--verify",
    type=click.Choice(["open", "all", "off"]),
    help="With a manifest: hash each tensor on its first open (default), all before mounting, or not at all.",
)
@view_files_option("--view-shards", "The synthesized model in .tensorfs/model/")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="The log's lines: text, or one JSON object each (time, level, pid, event, fields).",
)
@click.option(
    "--metrics",
    type=ParsedBy("address", _metrics_address),
    metavar="[HOST:]PORT|unix:PATH",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST 127.0.0.1 unless given: any local user "
    "can read them), or on a Unix socket only you can use (made 0600).",
)
@selection_options
@cache_options
@remote_options
def mount(
    source: Path | str,
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
    manifest_path: Path | str | None,
    verify: str | None,
    view_shards: int,
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
    from .mount.daemon import MountOptions, split_fuse_options
    from .mount.daemon import mount as mount_model

    passed, ownership = split_fuse_options(fuse_options)
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
        quiet=quiet,
        remote=_settings(remote) if is_remote(source) else None,
        metrics=metrics,
        log_format=log_format,
    )

    def prepare() -> tuple[Model, Integrity, ViewSpec]:
        # Here, after the daemon is forked: obstore (for a remote model) cannot be used across a fork.
        # The model first: its errors name it, not the manifest looked for beside it.
        model = open_selected(source, selection, layout=layout, remote=remote, no_cache=no_cache)
        try:
            integrity = integrity_of(model)
            return model, integrity, view_spec(source, view_shards, remote)
        except BaseException:
            model.close()
            raise

    def integrity_of(model: Model) -> Integrity:
        given = manifest_path or (find_default_manifest(source, remote) if verify != "off" else None)
        if verify is not None and verify != "off" and given is None:
            raise TensorfsError(f"--verify={verify} needs a manifest: --manifest FILE, or {DEFAULT_MANIFEST} in MODEL")
        cache = open_cache(cache_dir, no_cache)
        expected = None
        verified: set[str] = set()
        if given is not None and verify != "off":
            expected = read_manifest(given, remote, in_model=manifest_path is None)
            extra_allowed = shard_of_a_model(source) or not selection.everything  # lists the rest too
            require_coverage(model, expected, str(given), extra_allowed=extra_allowed)
            if verify == "all":
                actual = hash_model(model, cache)
                bad = compare(model, expected, actual).mismatched
                if bad:
                    raise InvalidModelError(
                        Problem(str(model.info(name).shard), f"does not match {given}; nothing mounted", name)
                        for name in bad
                    )
                verified = set(actual)
        cache.close()  # the daemon opens its own connection
        return Integrity(Hasher(model, cache), expected, verified)

    def announce(line: str) -> None:
        if quiet:
            return
        try:
            click.echo(line)
        except OutputError as exc:  # the mount stands: say so, for the exit code says something failed
            raise OutputError(exc.cause, f"mounted {printable(str(mountpoint))}, but ") from None

    return mount_model(prepare, mountpoint, options, announce)


def view_spec(source: Path | str, shards: int, remote: RemoteOptions) -> ViewSpec:
    """What the model directory view holds besides the tensors; the files left out are warned of on stderr."""
    from .views import ViewSpec
    from .views.companions import find_companions, find_remote_companions

    warnings: list[str] = []
    directories: dict[str, os.stat_result] = {}
    if isinstance(source, str):
        companions = find_remote_companions(source, remote, warnings)
    else:
        companions = find_companions(source, warnings, directories)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    return ViewSpec(companions, shards, warnings, directories)


def _settings(remote: RemoteOptions) -> dict[str, object]:
    return {
        "cache_dir": str((remote.cache_dir or default_cache_dir()).absolute()),
        "cache_size": remote.cache_size,
        "chunk_size": remote.chunk_size,
        "concurrency": remote.concurrency,
        "timeout": remote.timeout,
        "offline": remote.offline,
    }


@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("-z", "--lazy", is_flag=True, help="Detach now, finish when the mount is no longer busy.")
def umount(mountpoint: Path, lazy: bool) -> None:
    """Unmount a tensorfs mount, also one whose daemon died or hangs (detached, and the daemon stopped)."""
    from .mount.mounttable import unmount

    done = unmount(mountpoint, lazy=lazy)
    if "hung" in done:
        click.echo(done)


@cli.command()
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
    from .mount.mounttable import FSTYPE, health, mounts, read_stats, resolve_mountpoint
    from .mount.stats import degraded
    from .mount.statsview import duration

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
                printable(source) + (f"  ({printable(what_to_do)})" if what_to_do else ""),
            )
        )
    if not as_json:
        if not rows:
            click.echo("no tensorfs mounts")
        else:
            header = ("MOUNTPOINT", "STATE", "PID", "TENSORS", "SIZE", "SERVED", "UP", "SOURCE")
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(7)]
            for row in [header, *rows]:
                click.echo("  ".join(f"{cell:<{w}}" for cell, w in zip(row[:7], widths, strict=True)) + "  " + row[7])
    return 0 if healthy else 1


@cli.command()
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
    hang). With --watch the table is drawn again in place on a terminal, as lines when piped; Ctrl-C ends it.
    """
    from .mount.mounttable import FSTYPE, mount_at, read_stats, resolve_mountpoint
    from .mount.statsview import render

    real = resolve_mountpoint(mountpoint)
    entry = mount_at(real)
    shown = printable(str(mountpoint))
    if entry is None or entry.fstype != FSTYPE:
        raise TensorfsError(f"{shown}: not a tensorfs mount")

    def snapshot() -> dict[str, Any]:
        found = read_stats(real, timeout)
        if isinstance(found, str):
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


@cli.command()
@model_argument
@selection_options
@remote_options
def prefetch(path: Path | str, selection: Selection, cache_dir: Path | None, remote: RemoteOptions) -> None:
    """Fetch every byte of a remote MODEL (or of a selection's tensors) into the cache, ahead of a job.

    A progress line on a terminal. Afterwards the model (the selection) mounts and reads with --offline too.
    """
    from .sources.remote import RemoteShard

    with open_selected(path, selection, remote=remote) as model:
        wanted: dict[RemoteShard, list[int]] = {}
        for shard, entries in model.by_shard().items():  # the chunks of the (selected) tensors' bytes
            data = model.shard_data(shard)
            if isinstance(data, RemoteShard):
                start = model.shard_header(shard).data_start
                everything = [(0, data.cached.version.size)] if selection.everything else []
                wanted[data] = data.chunks_of(everything or [(start + b, start + e) for b, e, *_ in entries])
        if not wanted:
            click.echo(f"{printable(str(path))}: a local model: nothing to fetch")
            return
        total = sum(data.chunk_bytes(chunk) for data, chunks in wanted.items() for chunk in chunks)
        if remote.cache_size is not None and total > remote.cache_size:
            size = human_size(remote.cache_size)
            raise TensorfsError(f"{printable(str(path))}: {human_size(total)} does not fit in --cache-size {size}")
        with Progress(total, "fetching") as progress:
            for data, chunks in wanted.items():
                data.prefetch(progress.advance, chunks)
        missing = sum(not data.cached.present(chunk) for data, chunks in wanted.items() for chunk in chunks)
        if missing:  # evicted meanwhile (the cache is shared, and bounded): --offline would not find them
            raise TensorfsError(f"{printable(str(path))}: {missing} chunk(s) were evicted again: raise --cache-size")
        click.echo(f"{printable(str(path))}: {len(wanted)} shard(s), {human_size(total)} cached")


@cli.group()
def cache() -> None:
    """The local cache of remote models' bytes: what it holds, and trimming it."""


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="The cache. Default: $XDG_CACHE_HOME/tensorfs (~/.cache/tensorfs).",
)


def _object_cache(cache_dir: Path | None) -> Any:
    from .sources.cache import ChunkCache

    directory = (cache_dir or default_cache_dir()).absolute()
    if not (directory / "objects.sqlite").exists():
        raise TensorfsError(f"{directory}: no cache of remote models here")
    return ChunkCache(directory)


@cache.command(name="ls")
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
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(f"{cell:>{w}}" for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])


@cache.command(name="du")
@cache_dir_option
def cache_du(cache_dir: Path | None) -> None:
    """How much the cache holds."""
    cached = _object_cache(cache_dir)
    entries = cached.entries()
    held = sum(e.cached for e in entries)
    click.echo(f"{human_size(held)} ({held} bytes) cached of {len(entries)} object version(s), in {cached.directory}")


@cache.command(name="prune")
@cache_dir_option
@click.option(
    "--max-size", type=ByteSize(), help="Keep at most this much (least recently used goes first). Default: nothing."
)
def cache_prune(cache_dir: Path | None, max_size: int | None) -> None:
    """Evict what is not in use (by a mount or a command) until the cache holds at most --max-size."""
    cached = _object_cache(cache_dir)
    freed = cached.prune(max_size or 0)
    held = sum(e.cached for e in cached.entries())
    click.echo(f"freed {human_size(freed)}; {human_size(held)} cached")


@cli.command()
@click.option("--quick", is_flag=True, help="A small model and one try of each: checks the benchmark works.")
@click.option("--gib", type=Finite(0.01, 1024), help="Size of the model of big tensors (default 2).")
@click.option("--shards", type=click.IntRange(1, 1000), help="Its shard count (default 4).")
@click.option(
    "--repeat", type=click.IntRange(1, 100), help="Tries of each measurement; medians are reported (default 3)."
)
@click.option("--readahead-kb", type=READAHEAD_KB, help="Passed to each mount (default 1024).")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), help="Where to build (default: $TMPDIR).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), help="Also write the results here."
)
@click.option("--remote", is_flag=True, help="Measure remote models instead: served by nginx, through the cache.")
def bench(
    quick: bool,
    gib: float | None,
    shards: int | None,
    repeat: int | None,
    readahead_kb: int | None,
    workdir: Path | None,
    json_path: Path | None,
    remote: bool,
) -> int:
    """Measure the read path, mount and listing against direct baselines and peers (bindfs, and the
    least pyfuse3 daemon there is: tensorfs/bench/floor.py), in the same run (needs FUSE; root for
    cold reads, and to install bindfs when missing).

    With --remote: a model served by nginx on loopback, read through the mount and its cache, against
    obstore downloading it (needs nginx).
    """
    from . import bench as benchmark

    config = benchmark.Config.quick() if quick else benchmark.Config()
    for name, value in (("gib", gib), ("shards", shards), ("repeat", repeat), ("readahead_kb", readahead_kb)):
        if value is not None:
            setattr(config, name, value)
    config.workdir = workdir
    return benchmark.main(config, json_path, remote=remote)


def _run_by_mount(words: list[str]) -> bool:
    """Whether the words are a mount helper's (a model and a mountpoint), not a command's."""
    if len(words) < 2 or words[0] in cli.commands or words[0].startswith("-"):
        return False
    return is_remote(words[0]) or os.path.exists(words[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 done, 1 bad input or failure, 2 usage error.

    An output that cannot be written (`> /dev/full`) is a one-line error and exit 1; a reader
    that went away (`| head`) ends the command quietly with 141, as coreutils' commands end.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    if _run_by_mount(words):  # mount.fuse3 runs `tensorfs SRC MNT -o OPTS` for -t fuse.tensorfs
        from .mount.helper import main as helper

        return helper(words)
    stdout = sys.stdout
    sys.stdout = _GuardedOutput(stdout)
    try:
        result = cli.main(args=words, prog_name="tensorfs", standalone_mode=False)
        sys.stdout.flush()
    except OutputError as exc:
        _drop_output(stdout)
        if exc.broken_pipe:
            return 141
        _error_lines(exc.lines())
        return exc.exit_code
    except TensorfsError as exc:
        _error_lines(exc.lines())
        return exc.exit_code
    except click.ClickException as exc:
        with contextlib.suppress(OSError):
            exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        _error_lines(["Aborted."], prefix="")
        return 130
    finally:
        sys.stdout = stdout
    return result if isinstance(result, int) else 0


def _error_lines(lines: Sequence[str], prefix: str = "error: ") -> None:
    with contextlib.suppress(OSError):  # a standard error that cannot be written either: the exit code says it
        for line in lines:
            click.echo(f"{prefix}{line}", err=True)


def _drop_output(stdout: TextIO | None) -> None:
    """Whatever is still buffered for a standard output that failed would fail again at exit."""
    if stdout is not None and stdout is sys.__stdout__:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
