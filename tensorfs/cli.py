"""The `tensorfs` command line: one subcommand per thing a user does with a model."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import InvalidModelError, Problem, TensorfsError, printable
from .integrity import (
    DEFAULT_MANIFEST,
    HashCache,
    Hasher,
    Integrity,
    compare,
    default_cache_dir,
    find_default_manifest,
    format_manifest,
    read_manifest,
    require_coverage,
)
from .model import Model, open_model
from .names import LAYOUTS, Layout
from .progress import Progress
from .units import human_size


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


layout_option = click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="slash",
    show_default=True,
    help="How tensor names become paths: 'slash' nests on '/', 'dotted' also on '.'.",
)
model_argument = click.argument("path", metavar="MODEL", type=click.Path(path_type=Path))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tensorfs")
def cli() -> None:
    """Serve the tensors of a safetensors model as files, one per tensor.

    MODEL is a .safetensors file, a directory of shards (with or without
    model.safetensors.index.json), or an index file.
    """


@cli.command()
@model_argument
@layout_option
def validate(path: Path, layout: Layout) -> None:
    """Check every header of MODEL as `mount` would, and summarise it.

    Exit 0 when valid; exit 1 and one line per problem on stderr when not.
    """
    with open_model(path, layout=layout) as model:
        click.echo(
            f"{printable(str(path))}: valid: {len(model.shards)} shard{'s' * (len(model.shards) != 1)}, "
            f"{len(model)} tensor{'s' * (len(model) != 1)}, {human_size(model.nbytes)} ({model.nbytes} bytes)"
        )


@cli.command(name="ls")
@model_argument
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tensor and line, as in its .meta.json.")
def ls_command(path: Path, as_json: bool) -> None:
    """List the tensors of MODEL: name, dtype, shape, size and shard."""
    with open_model(path) as model:
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
        rows.append((printable(name), info.dtype, shape_text(info.shape), human_size(info.nbytes), info.shard.name))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    out = sys.stdout
    for row in rows:
        out.write(
            f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}  {row[4]}\n"
        )


def cache_options(command: Callable[..., Any]) -> Callable[..., Any]:
    command = click.option("--no-cache", is_flag=True, help="Neither read nor write the hash cache.")(command)
    return click.option(
        "--cache-dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="Where the hash cache lives. Default: $XDG_CACHE_HOME/tensorfs (~/.cache/tensorfs).",
    )(command)


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
@cache_options
def manifest(path: Path, output: Path | None, as_json: bool, cache_dir: Path | None, no_cache: bool) -> None:
    """The SHA-256 of every tensor's raw bytes, in sha256sum format (`<hex>  <tensor name>`) by name.

    Hashes found in the cache (same shard file, unchanged) are not computed again.
    """
    with open_model(path) as model:
        text = format_manifest(hash_model(model, open_cache(cache_dir, no_cache)), as_json=as_json)
    if output is None:
        sys.stdout.write(text)
        return
    partial = output.with_name(f".{output.name}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(output)  # all or nothing: never a half-written manifest
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise TensorfsError(f"cannot write {output}: {exc.strerror}") from None


@cli.command()
@model_argument
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help=f"The manifest to check against (sha256sum or JSON). Default: {DEFAULT_MANIFEST} in MODEL.",
)
@cache_options
def verify(path: Path, manifest_path: Path | None, cache_dir: Path | None, no_cache: bool) -> None:
    """Hash every tensor of MODEL and compare with a manifest.

    Exit 0 when all match; exit 1 naming every mismatched, missing and unexpected tensor.
    """
    manifest_path = manifest_path or find_default_manifest(path)
    if manifest_path is None:
        raise TensorfsError(f"{path}: no {DEFAULT_MANIFEST} here; name a manifest with --manifest FILE")
    expected = read_manifest(manifest_path)
    with open_model(path) as model:
        actual = hash_model(model, open_cache(cache_dir, no_cache))
        result = compare(model, expected, actual)
        label = str(manifest_path)
        problems = [
            Problem(str(model.info(name).shard), f"does not match {label} (sha256 {actual[name]})", name)
            for name in result.mismatched
        ]
        problems += [Problem(label, "is in the manifest but not in the model", name) for name in result.missing]
        problems += [Problem(label, "is in the model but not in the manifest", name) for name in result.unexpected]
        if problems:
            raise InvalidModelError(problems)
        click.echo(f"{printable(str(path))}: all {len(model)} tensors match {printable(label)}")


@cli.command()
@click.argument("source", metavar="MODEL", type=click.Path(path_type=Path))
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("-f", "--foreground", is_flag=True, help="Stay attached; Ctrl-C unmounts.")
@click.option(
    "-o",
    "fuse_options",
    multiple=True,
    metavar="OPT[,OPT...]",
    help="FUSE mount options, e.g. -o allow_other (repeatable).",
)
@layout_option
@click.option("--debug", is_flag=True, help="Log every request (and libfuse's own debug output with -f).")
@click.option(
    "--log-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Where the daemon logs. Default: stderr with -f, else $XDG_STATE_HOME/tensorfs/tensorfs.log.",
)
@click.option(
    "--readahead-kb",
    type=click.IntRange(min=0),
    default=1024,
    show_default=True,
    help="The mount's kernel readahead, raised once it is up (0 leaves the kernel's default).",
)
@click.option(
    "--prefetch-mb",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="How far ahead of a sequential reader the daemon brings data in from disk, off its main thread.",
)
@click.option(
    "--max-background",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Readahead requests the kernel may queue at the daemon (0 keeps the kernel's 12): fewer keeps "
    "lookups quick while data streams.",
)
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help=f"Serve no tensor before its bytes match this manifest. Default: {DEFAULT_MANIFEST} in MODEL, if there.",
)
@click.option(
    "--verify",
    type=click.Choice(["open", "all", "off"]),
    help="With a manifest: hash each tensor on its first open (default), all before mounting, or not at all.",
)
@cache_options
def mount(
    source: Path,
    mountpoint: Path,
    foreground: bool,
    fuse_options: tuple[str, ...],
    layout: Layout,
    debug: bool,
    log_file: Path | None,
    readahead_kb: int,
    prefetch_mb: int,
    max_background: int,
    manifest_path: Path | None,
    verify: str | None,
    cache_dir: Path | None,
    no_cache: bool,
) -> int:
    """Mount MODEL read-only at MOUNTPOINT: one file per tensor, with .meta.json and .sha256 beside it.

    Everything is validated first, as `validate` does; nothing is mounted if anything is wrong.
    Returns once the mount answers, leaving the daemon in the background (unless -f).
    """
    from .mount.daemon import MountOptions, split_fuse_options
    from .mount.daemon import mount as mount_model

    options = MountOptions(
        layout=layout,
        fuse_options=split_fuse_options(fuse_options),
        foreground=foreground,
        debug=debug,
        log_file=log_file.absolute() if log_file else None,
        readahead_kb=readahead_kb,
        prefetch_mb=prefetch_mb,
        max_background=max_background,
    )
    manifest_path = manifest_path or (find_default_manifest(source) if verify != "off" else None)
    if verify is not None and verify != "off" and manifest_path is None:
        raise TensorfsError(f"--verify={verify} needs a manifest: --manifest FILE, or {DEFAULT_MANIFEST} in MODEL")

    def prepare() -> tuple[Model, Integrity]:
        model = open_model(source, layout=layout)
        cache = open_cache(cache_dir, no_cache)
        expected = None
        verified: set[str] = set()
        if manifest_path is not None and verify != "off":
            expected = read_manifest(manifest_path)
            require_coverage(model, expected, str(manifest_path))
            if verify == "all":
                actual = hash_model(model, cache)
                bad = compare(model, expected, actual).mismatched
                if bad:
                    raise InvalidModelError(
                        Problem(str(model.info(name).shard), f"does not match {manifest_path}; nothing mounted", name)
                        for name in bad
                    )
                verified = set(actual)
        cache.close()  # the daemon opens its own connection
        return model, Integrity(Hasher(model, cache), expected, verified)

    return mount_model(prepare, mountpoint, options)


@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("-z", "--lazy", is_flag=True, help="Detach now, finish when the mount is no longer busy.")
def umount(mountpoint: Path, lazy: bool) -> None:
    """Unmount a tensorfs mount, also one whose daemon died."""
    from .mount.mounttable import unmount

    unmount(mountpoint, lazy=lazy)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per mount and line.")
def status(as_json: bool) -> None:
    """List the tensorfs mounts: live ones with their source and daemon, dead ones with what to do."""
    from .mount.mounttable import read_daemon_info, tensorfs_mounts

    rows = []
    for mountpoint in tensorfs_mounts():
        info = read_daemon_info(mountpoint)
        if as_json:
            click.echo(json.dumps({"mountpoint": str(mountpoint), "live": info is not None, **(info or {})}))
        elif info is None:
            rows.append((str(mountpoint), "DEAD", "-", "-", f"run: tensorfs umount {mountpoint}"))
        else:
            rows.append(
                (
                    str(mountpoint),
                    str(info.get("pid")),
                    str(info.get("tensors")),
                    human_size(int(str(info.get("bytes", 0)))),
                    str(info.get("source")),
                )
            )
    if as_json:
        return
    if not rows:
        click.echo("no tensorfs mounts")
        return
    header = ("MOUNTPOINT", "PID", "TENSORS", "SIZE", "SOURCE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(f"{cell:<{w}}" for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])


@cli.command()
@click.option("--quick", is_flag=True, help="A small model and one try of each: checks the benchmark works.")
@click.option("--gib", type=float, help="Size of the model of big tensors (default 2).")
@click.option("--shards", type=int, help="Its shard count (default 4).")
@click.option("--repeat", type=int, help="Tries of each measurement; medians are reported (default 3).")
@click.option("--readahead-kb", type=int, help="Passed to each mount (default 1024).")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), help="Where to build (default: $TMPDIR).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), help="Also write the results here."
)
def bench(
    quick: bool,
    gib: float | None,
    shards: int | None,
    repeat: int | None,
    readahead_kb: int | None,
    workdir: Path | None,
    json_path: Path | None,
) -> int:
    """Measure the read path, mount and listing against direct baselines (needs FUSE; root for cold reads)."""
    from . import bench as benchmark

    config = benchmark.Config.quick() if quick else benchmark.Config()
    for name, value in (("gib", gib), ("shards", shards), ("repeat", repeat), ("readahead_kb", readahead_kb)):
        if value is not None:
            setattr(config, name, value)
    config.workdir = workdir
    return benchmark.main(config, json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 done, 1 bad input or failure, 2 usage error."""
    try:
        result = cli.main(args=list(argv) if argv is not None else None, prog_name="tensorfs", standalone_mode=False)
        sys.stdout.flush()
    except TensorfsError as exc:
        for line in exc.lines():
            click.echo(f"error: {line}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except BrokenPipeError:
        # The reader went away (`tensorfs ls | head`): stop quietly, as ls would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
