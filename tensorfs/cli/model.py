"""The commands that act on a model: validate, ls, manifest, verify, export."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import click

from ..errors import InvalidModelError, TensorfsError, printable
from ..formats import shape_text
from ..fs.writer import refuse_existing
from ..model import Model
from ..opening.source import ManifestBeside, Verify, hash_all
from ..opening.view_files import ViewRequest, digests_beside, view_of
from ..proof.manifest import DEFAULT_MANIFEST, beside_name, format_manifest
from ..proof.signature import Signature
from ..selection import Selection
from ..sources.store import RemoteOptions
from ..utils.identity import shard_name
from ..utils.names import Layout
from ..utils.progress import Progress
from ..utils.units import human_size, plural
from .group import cli
from .options import (
    VIEW_FILES,
    ModelLocation,
    cache_options,
    fallback_option,
    hidden_alias,
    layout_option,
    manifest_options,
    model_argument,
    quiet_option,
    remote_options,
    selection_options,
    signature_options,
    source_of,
    view_options,
)
from .output import OutputError, ended_by_signals, error_lines, table, write_file

if TYPE_CHECKING:
    from ..views.export import Written


@cli.command(short_help="Check every header of MODEL as mount would, and summarise it.")
@model_argument
@layout_option
@quiet_option
@signature_options
@selection_options
@cache_options
@remote_options
def validate(
    path: Path | str,
    layout: Layout,
    quiet: bool,
    signature: Signature | None,
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
    with source_of(path, remote, no_cache).open(selection, layout, progress=not quiet, signature=signature) as model:
        signer = model.gate.integrity.signer
        click.echo(
            f"{printable(str(path))}: valid: {_models(model)}{plural(len(model.shards), 'shard')}, "
            f"{plural(len(model), 'tensor')}, {human_size(model.nbytes)} ({model.nbytes} bytes)"
            + ("" if selection.everything else f", selected by {printable(selection.describe())}")
            + (f", signed by {signer} ({model.gate.integrity.label})" if signer else "")
        )


@cli.command(name="ls", short_help="List the tensors of MODEL: name, dtype, shape, size and shard.")
@model_argument
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tensor and line, as in its .meta.json.")
@signature_options
@selection_options
@cache_options
@remote_options
def ls_command(
    path: Path | str,
    as_json: bool,
    signature: Signature | None,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """List the tensors of MODEL: name, dtype, shape, size and shard."""
    with source_of(path, remote, no_cache).open(selection, signature=signature) as model:
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
    sys.stdout.write("".join(line + "\n" for line in table(rows, "<<<>")))


@cli.command(short_help="The SHA-256 of every tensor of MODEL, as sha256sum lists files.")
@model_argument
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), help="Write here, not to stdout.")
@click.option("--json", "as_json", is_flag=True, help="A JSON object {tensor name: hex SHA-256}.")
@quiet_option
@selection_options
@cache_options
@remote_options
def manifest(
    path: Path | str,
    output: Path | None,
    as_json: bool,
    quiet: bool,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """The SHA-256 of every tensor's raw bytes, in sha256sum format (`<hex>  <tensor name>`) by name.

    Of a folder, the weights files beside the model too (variants, adapters, other checkpoints: what
    its view serves), each tensor named after its file (`model.fp16.safetensors/lm_head.weight`).
    Hashes found in the cache (same shard file, unchanged) are not computed again.
    """
    source = source_of(path, remote, no_cache)
    with source.open(selection, progress=not quiet) as model:
        hashes = hash_all(model, model.gate.integrity.hasher, progress=not quiet, proving=False)  # what they are
        beside, warnings = digests_beside(source, model, progress=not quiet)
        error_lines(warnings, prefix="warning: ")
        named = {
            beside_name(file, name): digest for file, digests in beside.items() for name, digest in digests.items()
        }
        # (a name of the model's own is never taken for a file's: that file is then left out of a view)
        text = format_manifest({**named, **hashes}, as_json=as_json)
    if output is None:
        sys.stdout.write(text)
    else:
        write_file(output, text)


@cli.command(short_help="Write MODEL (or a selection of it) as a new model at DEST.")
@model_argument
@click.argument("dest", type=click.Path(path_type=Path))
@hidden_alias("--shards", "--view-shards", type=VIEW_FILES)
@view_options("A directory DEST")
@manifest_options("Write no tensor", "all before writing anything")
@fallback_option
@quiet_option
@signature_options
@selection_options
@remote_options
def export(
    path: Path | str,
    dest: Path,
    view: ViewRequest,
    manifest_path: Path | str | None,
    verify: str | None,
    fallback: tuple[Path | str, ...],
    quiet: bool,
    signature: Signature | None,
    selection: Selection,
    cache_dir: Path | None,
    remote: RemoteOptions,
) -> None:
    """Write MODEL (or a selection of its tensors) as a new model at DEST.

    DEST ending in .safetensors (.gguf for a GGUF model; a PyTorch checkpoint is written as
    safetensors, without torch and without running its pickle): its tensors in one file. Otherwise a
    new directory holding what .tensorfs/model/ of a mount holds: the model's own folder, every file
    under its own name with its own bytes (its signature too); or, for a selection, a PyTorch
    checkpoint or --view merged, a synthesized model.safetensors (or model-0000K-of-0000N.safetensors
    and an index; a GGUF model's model.gguf; a selection's are named selected) beside the model's
    companion files (config.json, tokenizer files, ...) and a note saying so. Streamed, with a
    progress line on a terminal; written whole or not at all. Held to its manifest (or signature) as
    a mount is (--manifest, else tensors.sha256 beside the model if there): a tensor whose bytes do
    not match fails the export, unless a --fallback copy gives bytes that do (as a mount serves them).
    """
    from ..views import build_view
    from ..views.export import Written, view_bytes, write_view

    source = source_of(path, remote, fallback=fallback)  # the model's name checked first, then DEST's
    shown = printable(str(dest))
    one_file = dest.name.endswith((".safetensors", ".gguf"))
    if one_file and (view.shards or view.choice is not None):
        given = "--view-shards" if view.shards else "--view"
        raise TensorfsError(f"{shown}: {given} needs a directory DEST (a {dest.suffix} DEST is one file)")
    # Never over anything, the source's own files least of all: said now, before the model is opened;
    # the writer's own rename never replaces what comes meanwhile either.
    refuse_existing(dest, "file" if one_file else "directory")
    held_to = manifest_path if manifest_path is not None else ManifestBeside.IF_ANY
    verifying = cast(Verify | None, verify)
    opened = source.open(selection, manifest=held_to, verify=verifying, progress=not quiet, signature=signature)
    with opened as model, ended_by_signals():
        tensors = plural(len(model), "tensor")
        if one_file and dest.suffix != f".{model.view_format}":
            why = f"a {model.format} model is written as a .{model.view_format} file (or a directory)"
            raise TensorfsError(f"{shown}: {why}")
        if one_file:
            written = Written()
            with Progress(model.nbytes, "writing", quiet=quiet) as progress:
                model.write_safetensors(dest, progress.advance, replace=False, written=written)
            done = f"wrote {shown}: {tensors}, {_amount(written)}"
        else:
            spec, others = view_of(source, model, view)
            try:
                error_lines(spec.warnings, prefix="warning: ")
                files = build_view(model, model.gate, spec, [(other, other.gate) for other in others.models])
                try:
                    with Progress(view_bytes(files), "writing", quiet=quiet) as progress:
                        written = write_view(files, dest, progress.advance)
                finally:
                    files.close()
            finally:
                others.close()
            done = f"wrote {shown}/: {tensors}, {plural(len(files.files), 'file')}, {_amount(written)}"
    try:
        click.echo(done)
    except OutputError as exc:  # the model is written: say so, for the exit code says something failed
        raise OutputError(exc.cause, f"wrote {shown}, but ") from None


def _models(model: Model) -> str:
    """Where the models of a folder of several are in the tree ("3 models (a/, b/, c/), "), else ""."""
    if not model.parts:
        return ""
    folders = [f"{printable(folder)}/" for folder in model.parts]
    shown = ", ".join(folders[:6]) + (", ..." if len(folders) > 6 else "")
    return f"{plural(len(folders), 'model')} ({shown}), "


def _amount(written: Written) -> str:
    """How much an export put on disk ("41.6 MiB", "4.0 KiB and 22.5 GiB of zeros left as holes")."""
    holes = f" and {human_size(written.holes)} of zeros left as holes" if written.holes else ""
    return f"{human_size(written.data)}{holes}"


@cli.command(short_help="Hash every tensor of MODEL and compare with a manifest.")
@model_argument
@click.option(
    "--manifest",
    "manifest_path",
    type=ModelLocation(),
    metavar="FILE|URL",
    help=f"The manifest to check against (sha256sum or JSON; a file or a URL). Default: {DEFAULT_MANIFEST} in "
    "MODEL (in its directory, for a file).",
)
@quiet_option
@signature_options
@selection_options
@cache_options
@remote_options
def verify(
    path: Path | str,
    manifest_path: Path | str | None,
    quiet: bool,
    signature: Signature | None,
    selection: Selection,
    cache_dir: Path | None,
    no_cache: bool,
    remote: RemoteOptions,
) -> None:
    """Hash every tensor of MODEL (or of the selection) and compare with a manifest.

    Exit 0 when all match; exit 1 naming every mismatched, missing and unexpected tensor. With a
    selection, the manifest may list other tensors too.
    """
    source = source_of(path, remote, no_cache)
    if signature is not None:  # every tensor checked against the signed bytes of its file
        with source.open(
            selection, manifest=manifest_path, signature=signature, verify="all", progress=not quiet
        ) as model:
            integrity = model.gate.integrity
            signer, label = printable(integrity.signer), printable(integrity.label)
            click.echo(f"{printable(str(path))}: all {len(model)} tensors match {label}, signed by {signer}")
        return
    # The model first: its errors name it, not the manifest beside it.
    with source.open(selection, progress=not quiet) as model:
        found = source.manifest(model, manifest_path)
        if found is None:
            raise TensorfsError(f"{source.directory}: no {DEFAULT_MANIFEST} here; name a manifest with --manifest FILE")
        actual = hash_all(model, model.gate.integrity.hasher, progress=not quiet)
        problems = found.mismatches(model, actual, lambda name: f"does not match {found.label} (sha256 {actual[name]})")
        problems += found.coverage(model)
        count = len(model)
        if found.beside and not found.lists_more:  # the files beside the model it lists (not of one shard's)
            beside, warnings = digests_beside(source, model, progress=not quiet)
            error_lines(warnings, prefix="warning: ")
            problems += found.beside_problems(beside, lambda file: str(source.in_folder(file)))
            count += sum(len(beside.get(file, {})) for file in found.beside)
        if problems:
            raise InvalidModelError(problems)
        click.echo(f"{printable(str(path))}: all {count} tensors match {printable(found.label)}")
