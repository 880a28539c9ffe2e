"""The commands' option types (sizes, bounded numbers, models) and the option bundles several
commands share (the selection, a remote model's options, the caches, the layout)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import click
from click.core import ParameterSource

from ..errors import printable
from ..opening.source import Source
from ..proof.manifest import DEFAULT_MANIFEST
from ..proof.signature import DEFAULT_SIGNATURE, Signature, SignatureError
from ..selection import Selection, parse_layers
from ..sources.store import RemoteOptions, is_remote, location_problem, redact
from ..utils.names import LAYOUTS

READAHEAD_LIMIT_KB = 1 << 20
"""1 GiB: beyond it readahead is no longer ahead of anything a reader does."""
PREFETCH_LIMIT_MB = 1024
MAX_BACKGROUND_LIMIT = (1 << 16) - 1
"""The most the kernel takes for a FUSE connection's max_background (fs/fuse/control.c)."""


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


class ModelLocation(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A model: a local path, or the URL of one in a store (s3://, http(s)://, hf://)."""

    name = "model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        why = location_problem(value)
        if why is not None:
            self.fail(f"{printable(redact(str(value)))}: {why}", param, ctx)
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


class ParsedText(click.ParamType):  # type: ignore[type-arg]
    """An option whose text a function turns into its value (--layers 0-15, --metrics :9100): the
    function's ValueError is a usage error, saying why."""

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


model_argument = click.argument("path", metavar="MODEL", type=ModelLocation())

fallback_option = click.option(
    "--fallback",
    type=ModelLocation(),
    multiple=True,
    metavar="MODEL",
    help="Another copy of the model (a path or a URL; repeatable, tried in order): a tensor whose own shard "
    "cannot give its bytes (a read error, a store down, a shard changed, bytes that fail the manifest), or a "
    "shard missing or invalid, is read from the first fallback whose copy agrees (dtype and shape, and the "
    "manifest's hash when there is one). Opened when first needed.",
)

quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="No progress line (there is one on a terminal only, on stderr)."
)

layout_option = click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="slash",
    show_default=True,
    help="How tensor names become paths: 'slash' nests on '/', 'dotted' also on '.'.",
)


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
            type=ParsedText("A-B", parse_layers),
            help="Only layers A to B (inclusive) of names like model.layers.N.*; tensors of no numbered layer "
            "(embeddings, norms, head) stay unless excluded.",
        ),
    ]
    for option in reversed(options):
        with_selection = option(with_selection)
    return with_selection


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


def manifest_options(serve: str, all_before: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--manifest and --verify: the manifest a command that hands tensors out holds them to (`serve`
    says what it does not before, `all_before` when --verify all hashes everything)."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--verify",
            type=click.Choice(["open", "all", "off"]),
            help=f"With a manifest: hash each tensor on its first open (default), {all_before}, or not at all.",
        )(command)
        return click.option(
            "--manifest",
            "manifest_path",
            type=ModelLocation(),
            metavar="FILE|URL",
            help=f"{serve} before its bytes match this manifest (a file or a URL). Default: {DEFAULT_MANIFEST} "
            "in MODEL (in its directory, for a file), if there.",
        )(command)

    return apply


def signature_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--signature, --public-key and --certificate-chain, as one Signature `signature` (None: none given)."""

    @functools.wraps(command)
    def with_signature(
        *args: Any,
        signature_path: Path | str | None,
        public_key: Path | None,
        certificate_chain: tuple[Path, ...],
        **kwargs: Any,
    ) -> Any:
        signature = None
        if signature_path is not None or public_key is not None or certificate_chain:
            try:
                signature = Signature(public_key, certificate_chain, signature_path)
            except SignatureError as exc:
                raise click.UsageError(str(exc)) from None
        return command(*args, signature=signature, **kwargs)

    options = [
        click.option(
            "--signature",
            "signature_path",
            type=ModelLocation(),
            metavar="FILE|URL",
            help=f"Hold MODEL to this OpenSSF Model Signing signature instead of a manifest: its files exactly those "
            f"signed, each tensor served only from signed bytes. Default, with --public-key or --certificate-chain: "
            f"{DEFAULT_SIGNATURE} in MODEL.",
        ),
        click.option(
            "--public-key",
            type=click.Path(path_type=Path, dir_okay=False),
            help="Verify the signature with this PEM public key (an elliptic-curve key's: model_signing's `key`).",
        ),
        click.option(
            "--certificate-chain",
            type=click.Path(path_type=Path, dir_okay=False),
            multiple=True,
            help="Verify the signature's certificate against these PEM certificates (repeatable; model_signing's "
            "`certificate`).",
        ),
    ]
    for option in reversed(options):
        with_signature = option(with_signature)
    return with_signature


def cache_options(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--no-cache",
        is_flag=True,
        help="Neither read nor write the caches of validated headers and of hashes: validate and hash from scratch.",
    )(command)


def hidden_alias(old: str, new: str, **option: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`old`, the name option `new` had before (of the same `option` type), still taken but not in --help;
    given as both, a usage error. Put above the option `new` (it passes the value on as `new`'s)."""
    name = new.lstrip("-").replace("-", "_")
    given_as_old = f"{name}_given_as_old_name"

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def with_alias(*args: Any, **kwargs: Any) -> Any:
            value = kwargs.pop(given_as_old)
            if value is not None:
                if click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{old} is the old name of {new}: give it once")
                kwargs[name] = value
            return command(*args, **kwargs)

        return click.option(old, given_as_old, hidden=True, default=None, **option)(with_alias)

    return apply


VIEW_FILES = click.IntRange(0, 99999)


def view_options(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--view and --view-shards: what the model's view is (`where` says where it is), passed on as one
    `view` (a ViewRequest)."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def with_view(*args: Any, **kwargs: Any) -> Any:
            from ..opening.view_files import ViewRequest

            kwargs["view"] = ViewRequest(kwargs.pop("view"), kwargs.pop("view_shards"))
            return command(*args, **kwargs)

        shards = click.option(
            "--view-shards",
            type=VIEW_FILES,
            metavar="N",
            default=0,
            help="The model's tensors in this many synthesized files (at most one a tensor), with an index when "
            "more than one, instead of the model's own files. Default (0), with --view merged: one up to "
            "20 GiB of tensors, else files of at most 5 GiB.",
        )
        view = click.option(
            "--view",
            type=click.Choice(["folder", "merged"]),
            default=None,
            help=f"{where}: 'folder', the model's own folder, every file under its own name with its own bytes "
            "(the default; a PyTorch checkpoint's is read as safetensors unless asked); 'merged', its tensors "
            "in one synthesized safetensors file (a GGUF's: one GGUF) beside its other files. A selection's "
            "is always synthesized.",
        )
        return view(shards(with_view))

    return apply


def source_of(
    path: Path | str, remote: RemoteOptions, no_cache: bool = False, fallback: tuple[Path | str, ...] = ()
) -> Source:
    """The Source a command's MODEL, remote options, --no-cache and --fallback name (a folder of
    several models: each under a folder of its own)."""
    return Source.named(path, remote, caches=not no_cache, fallback=fallback, several=True)
