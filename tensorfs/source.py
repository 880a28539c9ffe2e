"""A model as a user names it, resolved once: where it is (a local path or a URL), how to reach it,
the caches it is read with, and what comes with it (its manifest, its companion files).

Every command, the mount and the in-process API start from a Source and go down through it: it
opens the model (formats, sources, model.py), finds and reads its manifest, finds its companion
files, makes its hasher. Nothing above it knows how any of that is found.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import Problem, printable
from .formats import is_weights_name
from .hashcache import HashCache
from .integrity import Hasher
from .manifest import DEFAULT_MANIFEST, MAX_MANIFEST_BYTES, ManifestError, parse_manifest
from .model import Model, open_model
from .names import Layout
from .safefiles import ModelDirectory, NotRegular, read_bounded
from .selection import Selection
from .sources.chunkcache import default_cache_dir
from .sources.shard import ShardKey
from .sources.store import (
    AccessDenied,
    RemoteError,
    RemoteOptions,
    TooLarge,
    beside,
    exists,
    is_remote,
    read_url,
    redact,
)

if TYPE_CHECKING:
    from .views import ViewSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A model: a .safetensors file, a directory of shards (with or without an index), an index file;
    or such a model in a store (s3://, http(s)://, hf://), read through the chunk cache."""

    location: Path | str
    """A local path, or a URL."""
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    """How stores are reached, and where the caches are (cache_dir)."""
    caches: bool = True
    """Whether validated headers and tensors' hashes are remembered (False: --no-cache)."""
    fallback: tuple[Path | str, ...] = ()
    """Other copies of the model (--fallback), in order: see fallback.py."""

    @classmethod
    def named(
        cls, location: str | os.PathLike[str], remote: RemoteOptions | None = None, *, caches: bool = True
    ) -> Source:
        """The source a user names: a URL of a scheme tensorfs reads stays a URL, anything else is a path."""
        if isinstance(location, str) and is_remote(location):
            return cls(location, remote or RemoteOptions(), caches)
        return cls(Path(location), remote or RemoteOptions(), caches)

    @property
    def is_remote(self) -> bool:
        return isinstance(self.location, str)

    @property
    def shown(self) -> str:
        """How messages name it (one line, no secret)."""
        return printable(redact(str(self.location)))

    @property
    def cache_dir(self) -> Path:
        """Where the caches are: --cache-dir, else $XDG_CACHE_HOME/tensorfs."""
        return (self.remote.cache_dir or default_cache_dir()).absolute()

    @property
    def is_one_shard(self) -> bool:
        """Whether it is one .safetensors file: maybe one shard of the model its manifest lists."""
        if isinstance(self.location, str):
            return is_weights_name(self.location.rstrip("/"))
        return not self.location.is_dir() and not self.location.name.endswith(".index.json")

    @property
    def directory(self) -> Path | str:
        """The model's directory (a local one's own, or that of its file), or its URL: for messages."""
        if isinstance(self.location, str) or self.location.is_dir():
            return self.location
        return self.location.parent

    def open(self, selection: Selection | None = None, layout: Layout = "slash") -> Model:
        """Validate every header and map the shards (see open_model): the selection's tensors."""
        selection = selection or Selection()
        return open_model(
            self.location,
            layout=layout,
            remote=self.remote,
            include=selection.include,
            exclude=selection.exclude,
            layers=selection.layers,
            cache=self.cache_dir if self.caches else False,
            fallback=self.fallback,
        )

    def hash_cache(self) -> HashCache:
        """The persistent cache of tensors' hashes (off with --no-cache)."""
        return HashCache(self.cache_dir if self.caches else None)

    def hasher(self, model: Model) -> Hasher:
        return Hasher(model, self.hash_cache())

    # -- the manifest -----------------------------------------------------------------------
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
        candidate = Path(self.directory) / DEFAULT_MANIFEST
        return candidate if os.path.lexists(candidate) else None

    def manifest(self, given: Path | str | None = None, selection: Selection | None = None) -> Manifest | None:
        """The manifest `given` (a file, a pipe, a URL), else the one beside the model if there is one.

        It may list other tensors too when the source is one shard of a model, or a selection of it.
        """
        found = given if given is not None else self.default_manifest()
        if found is None:
            return None
        digests = read_manifest(found, self.remote, in_model=given is None)
        lists_more = self.is_one_shard or not (selection or Selection()).everything
        return Manifest(str(found), digests, lists_more)

    # -- what comes with it -------------------------------------------------------------------
    def view_spec(self, shards: int = 0, weights: Collection[ShardKey] = ()) -> ViewSpec:
        """What a view of the model holds besides its tensors: its companion files (those left out
        are the spec's warnings; `weights`, the model's own files, never one), and how many
        synthesized files (`shards`: 0 chooses)."""
        from .views import ViewSpec
        from .views.companions import find_companions, find_remote_companions

        warnings: list[str] = []
        directories: dict[str, os.stat_result] = {}
        if isinstance(self.location, str):
            companions = find_remote_companions(self.location, self.remote, warnings, weights)
        else:
            companions = find_companions(self.location, warnings, directories, weights)
        return ViewSpec(companions, shards, warnings, directories)

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


@dataclass(frozen=True)
class Manifest:
    """The SHA-256 a model's tensors must hash to, by name."""

    label: str
    """Where it was read from, as given."""
    digests: Mapping[str, str]
    lists_more: bool = False
    """It may list tensors the model does not hold (the model is one shard, or a selection)."""

    def coverage(self, model: Model) -> list[Problem]:
        """What keeps it from being the model's: tensors it lists that the model does not hold (unless it
        may list more), and tensors the model holds that it does not list."""
        problems = [
            Problem(self.label, "is in the manifest but not in the model", name)
            for name in ([] if self.lists_more else self.digests)
            if name not in model
        ]
        problems += [
            Problem(self.label, "is in the model but not in the manifest", name)
            for name in model.names()
            if name not in self.digests
        ]
        return problems

    def mismatches(self, model: Model, actual: Mapping[str, str], reason: Callable[[str], str]) -> list[Problem]:
        """The tensors whose hash (`actual`) differs from the manifest's, each said with `reason(tensor)`."""
        return [
            Problem(str(model.info(name).shard), reason(name), name)
            for name in sorted(actual)
            if name in self.digests and self.digests[name] != actual[name]
        ]


def read_manifest(path: Path | str, remote: RemoteOptions | None = None, *, in_model: bool = False) -> dict[str, str]:
    """The manifest in `path` (a file, a pipe such as <(...), or a URL), at most MAX_MANIFEST_BYTES.

    `in_model`: the manifest found in a model's directory, which someone else may control: a
    regular file beneath it, opened once, never blocking.
    """
    if is_remote(path):
        assert isinstance(path, str)
        try:
            data = read_url(path, remote or RemoteOptions(), MAX_MANIFEST_BYTES)
        except TooLarge:
            raise ManifestError(f"{path}: over {MAX_MANIFEST_BYTES >> 20} MiB, too large to be a manifest") from None
        except (RemoteError, FileNotFoundError) as exc:
            shown = redact(path)
            raise ManifestError(str(exc) if str(exc).startswith(shown) else f"{shown}: {exc}") from None
    else:
        path = Path(path)
        try:
            if in_model:
                with ModelDirectory(path.parent) as directory:
                    fd, _ = directory.open_regular(path.name)
            else:  # named by whoever runs the command: a pipe is fine, and waited for
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
                kind = os.fstat(fd).st_mode
                if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
                    os.close(fd)
                    raise ManifestError(f"{path}: not a regular file or a pipe")
            try:
                data = read_bounded(fd, MAX_MANIFEST_BYTES)
            finally:
                os.close(fd)
        except NotRegular:
            raise ManifestError(f"{path}: not a regular file") from None
        except OSError as exc:
            why = "a symlink out of the model's directory" if exc.errno == errno.EXDEV else exc.strerror
            raise ManifestError(f"{path}: cannot read: {why}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: over {MAX_MANIFEST_BYTES >> 20} MiB, too large to be a manifest")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    return parse_manifest(text, str(path))
