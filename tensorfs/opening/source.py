"""Opening a model, one way for the CLI, the mount and the library: a model as a user names it (a path
or a URL), its caches, its shards found, read, validated together and mapped (locations.py), its
fallbacks, its manifest put in force, and where its folder is (its view: view_files.py).

Every command, the mount and the in-process API start from a Source (open_model makes one), and go
down through Source.open: nothing above this module knows how a model's parts are found, and where
tensorfs's caches are is decided here alone (Caches).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from ..caches.hashes import HashCache
from ..caches.headers import HeaderCache
from ..catalogue.fallbacks import Fallbacks, FallbackSpec
from ..errors import AccessDenied, InvalidModelError, ModelNotFound, Problem, RemoteError, printable
from ..formats import is_weights_name
from ..fs.guarded import ModelDirectory
from ..model import Model
from ..proof.integrity import Hasher, Integrity
from ..proof.manifest import DEFAULT_MANIFEST, Manifest, ManifestError, read_manifest
from ..proof.signature import Signature, SignatureError
from ..selection import Selection
from ..sources.client import exists
from ..sources.finding import beside, directory_url
from ..sources.index import is_index_name
from ..sources.local import missing
from ..sources.store import CREDENTIALS_HINT, RemoteOptions, default_cache_dir, is_remote, location_problem, redact
from ..utils.names import Layout
from ..utils.progress import Progress
from .locations import OpenWith, open_location

__all__ = ["Caches", "ManifestBeside", "Source", "Verify", "hash_all", "open_model"]

log = logging.getLogger(__name__)

Verify = Literal["open", "all", "off"]
"""When a manifest's hashes are checked: each tensor before its first byte goes out, every tensor
before the model is handed out, or not at all."""


class ManifestBeside(enum.Enum):
    """The manifest found beside the model (tensors.sha256 in its directory, or under its prefix)."""

    REQUIRED = "required"
    """It must be there (an error if not)."""
    IF_ANY = "if any"
    """It is held to it if it is there."""


@dataclass(frozen=True)
class Caches:
    """Where tensorfs's caches are, for one model: validated headers, tensors' hashes and remote
    objects' chunks, all in one directory (--cache-dir, `cache=`, else $XDG_CACHE_HOME/tensorfs)."""

    directory: Path
    remember: bool = True
    """Whether headers and hashes are remembered (False: --no-cache, `cache=False`). A remote model's
    chunks are read through the directory's cache whatever this says."""

    @classmethod
    def of(cls, cache: bool | str | os.PathLike[str], remote: RemoteOptions | None) -> Caches:
        """`cache` as open_model takes it (True, False or a directory), with a remote model's options."""
        if cache is not True and cache is not False:
            return cls(Path(cache).absolute())
        where = remote.cache_dir if remote is not None and remote.cache_dir is not None else default_cache_dir()
        return cls(where.absolute(), bool(cache))

    def remote(self, options: RemoteOptions) -> RemoteOptions:
        """`options` reading through this directory's chunk cache."""
        if options.cache_dir == self.directory:
            return options
        import dataclasses

        return dataclasses.replace(options, cache_dir=self.directory)

    def headers(self) -> HeaderCache:
        return HeaderCache(self.directory if self.remember else None)

    def hashes(self) -> HashCache:
        return HashCache(self.directory if self.remember else None)


@dataclass(frozen=True)
class Source:
    """A model: a .safetensors file (or GGUF, or checkpoint), an index file, a directory (the model
    loaders load from it: sources/choosing.py); or such a model in a store (s3://, http(s)://, hf://),
    read through the chunk cache."""

    location: Path | str
    """A local path, or a URL."""
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    """How stores are reached (its cache_dir: where every cache is)."""
    caches: bool = True
    """Whether validated headers and tensors' hashes are remembered (False: --no-cache)."""
    fallback: tuple[Path | str, ...] = ()
    """Other copies of the model (--fallback), in order: see catalogue/fallbacks.py."""
    several: bool = False
    """A folder of several models is opened as one tree's, each model under a folder of its own (a
    command's); else it is refused, naming them (the Python API's, which answers for one model)."""

    @classmethod
    def named(
        cls,
        location: str | os.PathLike[str],
        remote: RemoteOptions | None = None,
        *,
        caches: bool = True,
        fallback: Sequence[str | os.PathLike[str]] = (),
        several: bool = False,
    ) -> Source:
        """The source a user names: a URL of a scheme tensorfs reads stays a URL, anything else is a path.
        The model and each fallback pass one check (InvalidModelError, the URL shown without its
        secret): a URL of a scheme tensorfs does not read or mistyped, or one that carries credentials,
        is refused before anything is made of it (a daemon would show it in its command line to every
        user); and so is a local model that is not there (its fallbacks are looked for when needed)."""
        where = _location(location)
        absent = missing(where) if isinstance(where, Path) else None
        if absent is not None:  # said now, before anything else is looked at (a mount's mountpoint)
            raise ModelNotFound(absent)
        return cls(where, remote or RemoteOptions(), caches, tuple(map(_location, fallback)), several)

    @property
    def is_remote(self) -> bool:
        return isinstance(self.location, str)

    @property
    def shown(self) -> str:
        """How messages name it (one line, no secret)."""
        return printable(redact(str(self.location)))

    @property
    def cache(self) -> Caches:
        """Where its caches are: --cache-dir, else $XDG_CACHE_HOME/tensorfs."""
        return Caches.of(self.caches, self.remote)

    @property
    def cache_dir(self) -> Path:
        return self.cache.directory

    @property
    def is_one_shard(self) -> bool:
        """Whether it is one weights file: maybe one shard of the model its manifest lists."""
        if isinstance(self.location, str):
            return is_weights_name(self.location.rstrip("/"))
        return not self.location.is_dir() and not is_index_name(self.location.name)

    @property
    def directory(self) -> Path | str:
        """The model's directory (a local one's own, or that of its file), or its URL: for messages."""
        if isinstance(self.location, str) or self.location.is_dir():
            return self.location
        return self.location.parent

    # -- opening ----------------------------------------------------------------------------------
    def open(
        self,
        selection: Selection | None = None,
        layout: Layout = "slash",
        *,
        manifest: Path | str | ManifestBeside | None = None,
        verify: Verify | None = None,
        progress: bool = False,
        signature: Signature | None = None,
    ) -> Model:
        """Validate every header and map the shards (see open_model): the selection's tensors.

        `manifest`: the one to hold the model to: a file, a pipe or a URL, or the one beside the
        model (ManifestBeside); None for none. `verify` ("open" by default): "all" hashes every tensor
        before the model is returned (InvalidModelError naming every mismatch), "off" puts no
        manifest in force; "open" or "all" said explicitly needs a manifest. `progress`: a progress
        line on a terminal while validating the shards and while hashing. `signature`: the signature
        (and what verifies it) the model is held to instead of a manifest (see proof/signed_model.py).
        """
        selection = selection or Selection()
        if signature is not None and (verify == "off" or manifest not in (None, ManifestBeside.IF_ANY)):
            why = "--verify off" if verify == "off" else "a manifest"
            raise SignatureError(f"{self.shown}: a signature is the model's manifest: not with {why} too")
        model = self._open_tables(selection, layout, progress)
        try:
            if signature is not None:
                self._hold_to_signature(model, signature, selection, progress, verify == "all")
                return model
            found = None
            if verify != "off" and manifest is not None:
                given = None if isinstance(manifest, ManifestBeside) else manifest
                found = self.manifest(model, given)
            if found is None and (manifest is ManifestBeside.REQUIRED or verify in ("open", "all")):
                raise ManifestError(
                    f"{self.shown}: verifying needs a manifest: name one (--manifest FILE, verify=PATH), or put "
                    f"{DEFAULT_MANIFEST} in the model's directory"
                )
            hasher = Hasher(model, self.cache.hashes())
            if found is not None:
                model.manifest_beside = found.beside
                problems = found.coverage(model)
                if problems:
                    raise InvalidModelError(problems)
            # In force before anything is hashed: remote chunks fetched for it are held to their SHA-256s.
            expected, label = (dict(found.digests), found.label) if found is not None else (None, "")
            integrity = Integrity(hasher, expected, label=label)
            model.gate.set_integrity(integrity)
            if found is not None and verify == "all":
                actual = hash_all(model, hasher, progress=progress)
                bad = found.mismatches(model, actual, lambda _: f"does not match {found.label}; nothing mounted")
                if bad:
                    raise InvalidModelError(bad)
                integrity.verified.update(actual)
        except BaseException:
            model.close()
            raise
        return model

    def _hold_to_signature(
        self, model: Model, signature: Signature, selection: Selection, progress: bool, verify_all: bool
    ) -> None:
        """Put a verified signature in force on the model's gate (proof/signed_model.py)."""
        from ..proof.signed_model import Holding, hold_model

        holding = Holding(
            self.location if isinstance(self.location, str) else Path(self.directory),
            self.remote,
            self.cache.hashes(),
            one_file=self.is_one_shard,
            everything=selection.everything,
            progress=progress,
            verify_all=verify_all,
            fallbacks=model.fallbacks is not None,
        )
        model.signed, integrity = hold_model(model, signature, holding)
        model.gate.set_integrity(integrity)

    def _open_tables(self, selection: Selection, layout: Layout, progress: bool = False) -> Model:
        caches = self.cache
        fallbacks = None
        if self.fallback:
            spec = FallbackSpec.of(
                self.fallback, layout=layout, remote=self.remote, selection=selection, cache=self._cache_argument()
            )
            fallbacks = Fallbacks(spec, _open_fallback)
        try:
            remote = caches.remote(self.remote)
            how = OpenWith(layout, remote, caches.headers, selection, fallbacks, progress, self.several)
            return open_location(self.location, how)
        except BaseException:
            if fallbacks is not None:
                fallbacks.close()
            raise

    def _cache_argument(self) -> bool | Path:
        return self.cache.directory if self.caches else False

    def hash_cache(self) -> HashCache:
        """The persistent cache of tensors' hashes (off with --no-cache)."""
        return self.cache.hashes()

    # -- the manifest -------------------------------------------------------------------------------
    def default_manifest(self) -> Path | str | None:
        """tensors.sha256 in the model's directory (beside its file), or beside its objects in the
        store (asked with a HEAD; none with --offline), if there is one."""
        if isinstance(self.location, str):
            if self.remote.offline:
                return None
            ref = beside(self.location, DEFAULT_MANIFEST, self.remote)
            try:
                return ref.url if exists(ref) else None
            except AccessDenied as exc:  # S3 answers 403 for a missing key to whoever may not list the bucket
                log.warning("%s; taken as no manifest", exc)
                return None
            except RemoteError as exc:
                raise ManifestError(str(exc)) from None
        try:  # asked of the directory, never of what a mount or a link there leads to (it may hang)
            with ModelDirectory(Path(self.directory)) as directory:
                there = directory.has(DEFAULT_MANIFEST)
        except OSError:
            there = False
        return Path(self.directory) / DEFAULT_MANIFEST if there else None

    def manifest(self, model: Model, given: Path | str | None = None) -> Manifest | None:
        """The manifest of `model` (opened from this source): `given` (a file, a pipe, a URL), else the
        one beside the model if there is one; its lines for the files beside the model set apart
        (Manifest.of_model).

        It may list other tensors too when the source is one shard of a model, or a selection of it.
        """
        found = given if given is not None else self.default_manifest()
        if found is None:
            return None
        digests = read_manifest(found, self.remote, in_model=given is None)
        lists_more = self.is_one_shard or not model.selection.everything
        return Manifest(str(found), digests, lists_more).of_model(model)

    @property
    def folder(self) -> Path | str:
        """The model's folder: its directory (that of its file or index), or its directory's URL."""
        if isinstance(self.location, str):
            return directory_url(self.location, self.remote)
        from ..views.local_files import model_directory

        return Path(os.path.abspath(model_directory(self.location)))

    def in_folder(self, path: str) -> Path | str:
        """Where a file of the model's folder is (its path, or its URL)."""
        if isinstance(self.location, str):
            return beside(self.location, path, self.remote).url
        folder = self.folder
        assert isinstance(folder, Path)
        return folder / path

    def settings(self) -> dict[str, Any] | None:
        """A remote source's cache and fetch settings, as a daemon's record shows them (None: a local one)."""
        if not self.is_remote:
            return None
        remote = self.remote
        return {
            "cache_dir": str(self.cache_dir),
            "cache_size": remote.cache_size,
            "chunk_size": remote.chunk_size,
            "concurrency": remote.concurrency,
            "timeout": remote.timeout,
            "offline": remote.offline,
        }


def open_model(
    path: str | os.PathLike[str],
    *,
    layout: Layout = "slash",
    remote: RemoteOptions | None = None,
    include: Iterable[str] | str = (),
    exclude: Iterable[str] | str = (),
    layers: tuple[int, int] | str | int | None = None,
    cache: bool | str | os.PathLike[str] = True,
    verify: bool | str | os.PathLike[str] | None = None,
    fallback: Sequence[str | os.PathLike[str]] = (),
    signature: Signature | None = None,
) -> Model:
    """Validate every header of the model at `path` and map its shards.

    `path` is a weights file (.safetensors, a GGUF, a PyTorch checkpoint) or an index file; or a
    directory, whose model is the one loaders load from it (model.safetensors, else its index, else
    pytorch_model.bin ...: sources/choosing.py; a directory of several models' files is refused,
    naming them: name the one to open); or such a model in a store: s3://BUCKET/PREFIX,
    http(s)://.../NAME.safetensors or .../model.safetensors.index.json, hf://ORG/NAME[@REVISION], read
    through a local cache (`remote` says how). Raises InvalidModelError naming every problem found; no
    tensor data is read.

    `include`/`exclude` (fnmatch globs on names, or one glob) and `layers` ((A, B), "A-B" or N: the N in
    `*.layers.N.*`) select a subset: every header is still validated, but only the selected
    tensors are in the model, and shards without any are not kept mapped (see Selection).

    `cache`: where tensorfs's caches are (validated headers, tensors' hashes, and a remote model's
    chunks): True for $XDG_CACHE_HOME/tensorfs (or `remote`'s cache_dir), a directory, or False to
    remember no header or hash (validate and hash from scratch). Files unchanged since (same device,
    inode, size, mtime and ctime) are not parsed, checked or hashed again.

    `verify`: a manifest the tensors must match, as the mount's --manifest: a file or a URL, or True
    for tensors.sha256 beside the model (under a remote model's prefix); an error if there is none.
    Then no view of a tensor is handed out before its bytes hash to the manifest's value
    (IntegrityError, naming the tensor, if not); the hash cache spares unchanged local files the
    hashing (a remote model's tensors are hashed from the bytes served: see Hasher.hash_all).

    `fallback`: other copies of the model (paths or URLs), tried in order for a tensor whose own
    shard cannot give its bytes (or gives bytes that fail the manifest), and for a shard missing or
    invalid; a fallback's copy is taken only when its dtype and shape agree, and under `verify` only
    when its bytes match the manifest (see tensorfs.catalogue.fallbacks).

    `signature`: an OpenSSF Model Signing signature the model is held to instead of a manifest
    (`tensorfs.Signature(public_key="key.pub")`: model.sig beside the model; `location=` another):
    verified before anything is returned (SignatureError, naming the file and why, if it does not),
    a local model's files exactly those signed, and no tensor handed out before the signed bytes
    of its file prove it (hashed whole at first open, or each range as first read; the hash cache after).
    """
    manifest: Path | str | ManifestBeside | None = None
    if verify is True:
        manifest = ManifestBeside.REQUIRED
    elif verify is not None and verify is not False:
        manifest = verify if isinstance(verify, str) else Path(verify)
    caches = cache if cache is True or cache is False else Path(cache)
    remote = remote or RemoteOptions()
    if caches is not True and caches is not False:
        import dataclasses

        remote = dataclasses.replace(remote, cache_dir=Path(caches).absolute())
    source = Source.named(path, remote, caches=caches is not False, fallback=fallback)
    selection = Selection(include, exclude, layers)  # type: ignore[arg-type]  # it takes one glob too
    return source.open(selection, layout, manifest=manifest, signature=signature)


def _location(location: str | os.PathLike[str]) -> Path | str:
    """A model's location as a user gives it, through the one check every location passes: a URL of a
    scheme tensorfs reads stays a URL (never one with credentials in it), anything else is a path."""
    why = location_problem(location)
    if why is not None:
        raise InvalidModelError([Problem(printable(redact(str(location))), why)])
    if isinstance(location, str) and is_remote(location):
        if "@" in urlsplit(location).netloc:  # never shown, never sent
            raise InvalidModelError([Problem(printable(redact(location)), CREDENTIALS_HINT)])
        return location
    return Path(location)


def hash_all(model: Model, hasher: Hasher, *, progress: bool = False, proving: bool = True) -> dict[str, str]:
    """Every tensor's SHA-256 (the cache's first; `proving`: see Hasher.hash_all), with a progress line
    on a terminal when asked."""
    if not progress:
        return hasher.hash_all(proving=proving)
    with Progress(model.nbytes, "hashing") as line:
        return hasher.hash_all(progress=line.advance, proving=proving)


def _open_fallback(location: str | Path, **how: Any) -> Model:
    """A fallback, opened as any model (its own fallbacks none)."""
    return open_model(location, **how)
