"""The files that come with a model's weights (config.json, tokenizer files, modules.json, ...).

Found at mount, from the top level of the model's directory and its subdirectories one level
down (a subdirectory's weights too: a sentence-transformers module's; and an adapter beside the
model, PEFT's), and served from where they are, when they are read: a local file through a
descriptor opened beneath the model's directory (and only while it holds what it held when found:
its content decides, not its times), a remote one through the chunk cache, like the weights. The
daemon holds none of their bytes.

Where a store cannot list a directory, what loaders look for is looked for: the Hub's API lists a
repository's files; over plain HTTP the well-known names are asked for, and then the files the
model's own files name (modules.json's modules, the custom code of config.json's auto_map).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..errors import RemoteError, TensorfsError, TooLarge, printable
from ..identity import Identity, ShardKey
from ..manifest import DEFAULT_MANIFEST
from ..names import path_problem
from ..safefiles import ModelDirectory, NotRegular, mounted_under, why_refused
from ..sources.choosing import ADAPTER_NAMES, is_model_file
from ..sources.client import get_whole, head
from ..sources.finding import beside, hub_listing, listing_beside
from ..sources.store import ObjectRef, ObjectVersion, RemoteOptions

log = logging.getLogger(__name__)

MAX_COMPANION_BYTES = 64 << 20
MAX_COMPANIONS_TOTAL = 256 << 20
MAX_COMPANIONS = 1000
"""The most a view takes of companion files: one file, all of them, and how many."""
SCAN_SECONDS = 30.0
"""How long the scan of a model's directory for them may take (past it, the rest is left out)."""
_DIGEST_BLOCK = 1 << 20
MAX_NAMING_FILE = 1 << 20
"""modules.json and config files read at mount to find the files they name: larger ones are not followed."""


@dataclass(frozen=True)
class LocalOrigin:
    """A companion file in a local model's directory, as found: served while it holds what it held then."""

    directory: Path
    identity: Identity
    digest: bytes
    """The SHA-256 of its content when found: a file whose identity moved (a chmod moves its ctime)
    is the same file if its content is the same."""


@dataclass(frozen=True)
class RemoteOrigin:
    """A companion object in a store, read through the chunk cache (at its version, once known)."""

    ref: ObjectRef
    options: RemoteOptions
    version: ObjectVersion | None = None
    """Known from a listing (S3) or a HEAD (HTTP); None: asked for at the first read (the Hub's listing)."""


@dataclass(frozen=True)
class Companion:
    path: str
    """Relative to the model's directory: config.json, 1_Pooling/config.json (a name that is not
    UTF-8 keeps its bytes as surrogate escapes, as os.fsdecode makes them)."""
    size: int
    mtime_ns: int
    status: os.stat_result | None
    """The source file's, for its owner and permissions (None: a remote object's, the source's apply)."""
    origin: LocalOrigin | RemoteOrigin


class CompanionError(TensorfsError):
    """A companion file that cannot be served now (gone, changed, or its store unreachable)."""


class CompanionFiles:
    """The companion files of a view, opened on their first read and kept open: read(path, offset, size)."""

    def __init__(self, companions: Iterable[Companion]) -> None:
        self.by_path = {c.path: c for c in companions}
        self._lock = threading.Lock()
        self._open: dict[str, _LocalFile | Any] = {}  # path -> a _LocalFile, or a RemoteShard

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of a companion file (blocking: call it from a worker thread)."""
        companion = self.by_path[path]
        size = max(0, min(size, companion.size - offset))
        if size == 0:
            return b""
        opened = self._opened(companion)
        if isinstance(opened, _LocalFile):
            return opened.read(offset, size)
        buffer = bytearray(size)
        try:
            opened.readinto(offset, memoryview(buffer))
        except TensorfsError as exc:  # its message names the object's URL already
            raise CompanionError(str(exc)) from None
        return bytes(buffer)

    def _opened(self, companion: Companion) -> Any:
        with self._lock:
            found = self._open.get(companion.path)
            if found is None:
                local = isinstance(companion.origin, LocalOrigin)
                found = self._open[companion.path] = _LocalFile(companion) if local else _open_remote(companion)
            return found

    def close(self) -> None:
        with self._lock:
            opened, self._open = self._open, {}
        for found in opened.values():
            found.close()


class _LocalFile:
    """A local companion as it is served: the file at its path now, while it holds what the companion
    held when it was found. Its content decides, not its times: a file whose identity moved (a chmod
    moves its ctime; a copy of the same bytes put in its place is another inode) is read again and
    served if it holds the same bytes; anything else at its path (other bytes, a symlink out of the
    model's directory, a FIFO, nothing) is a CompanionError."""

    def __init__(self, companion: Companion) -> None:
        assert isinstance(companion.origin, LocalOrigin)
        self.companion = companion
        self.origin = companion.origin
        self._lock = threading.Lock()  # a descriptor is replaced (and closed) only while no read uses it
        self._fd = -1
        self._identity: Identity | None = None

    def read(self, offset: int, size: int) -> bytes:
        path = self.companion.path
        with self._lock:
            try:
                if self._fd < 0 or Identity.of(os.fstat(self._fd)) != self._identity:
                    self._reopen()
                data = os.pread(self._fd, size, offset)
            except OSError as exc:
                raise CompanionError(f"{path}: cannot read: {exc.strerror}") from None
        if len(data) != size:
            raise CompanionError(f"{path}: shorter than when it was mounted")
        return data

    def _reopen(self) -> None:
        """Take the file at the companion's path, opened beneath the model's directory, if it holds
        what the companion held (hashed, unless it is the very file found, unchanged)."""
        path = self.companion.path
        try:
            with ModelDirectory(self.origin.directory) as directory:
                fd, st = directory.open_regular(path)
        except OSError as exc:
            raise CompanionError(f"{path}: cannot open: {why_refused(exc)}") from None
        try:
            identity = Identity.of(st)
            if identity != self.origin.identity and (
                st.st_size != self.companion.size
                or content_digest(fd, st.st_size) != self.origin.digest
                or Identity.of(os.fstat(fd)) != identity  # written to while it was read: not what was hashed
            ):
                raise CompanionError(f"{path}: changed since it was mounted; mount again to serve it")
        except BaseException:
            os.close(fd)
            raise
        self.close_file()
        self._fd, self._identity = fd, identity

    def close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        with self._lock:
            self.close_file()


def _open_remote(companion: Companion) -> Any:
    """The companion's object read through the cache, at the version found (or its size then)."""
    origin = companion.origin
    assert isinstance(origin, RemoteOrigin)
    from ..sources.remote import RemoteShard  # the remote machinery, only when needed

    version = origin.version
    try:
        if version is None:
            version = head(origin.ref)
            if version is None:
                raise CompanionError(f"{origin.ref.url}: listed, and not there now (404)")
        if version.size != companion.size:
            raise CompanionError(f"{origin.ref.url}: {version.size} bytes now, not {companion.size}: it changed")
        return RemoteShard.of(version, origin.options)
    except RemoteError as exc:
        raise CompanionError(str(exc)) from None


class Skipped:
    """Files left out, by reason: one warning a reason, however many (a lying listing, or a directory
    another user fills, may hold a million), saying the first as it is and counting the others."""

    def __init__(self) -> None:
        self._by_reason: dict[str, tuple[str, int]] = {}  # reason -> (what is said of the first, how many)

    def add(self, reason: str, said: str) -> None:
        first, count = self._by_reason.get(reason, (said, 0))
        self._by_reason[reason] = (first, count + 1)

    def said(self) -> list[str]:
        return [
            first + (f" (and {count - 1} more files skipped: {reason})" if count > 1 else "")
            for reason, (first, count) in self._by_reason.items()
        ]


# -- local models ---------------------------------------------------------------------------


def model_directory(source: Path) -> Path:
    """The directory a local model's other files live in (its own, or that of its file or index)."""
    return source if source.is_dir() else source.parent


def is_companion(path: str, components: Collection[str] = ()) -> bool:
    """Whether a file of a model's directory (its path there) comes with the model into its view, by
    its name: not the model's own weights or their index at the top of the directory, which the view
    makes itself (choosing.is_model_file: an adapter is a companion, and so are the weights of a
    subdirectory, a sentence-transformers module's), nor the manifest of the source's tensors (it
    would not match a selection of them), nor hidden files. A pipeline's component folders
    (`components`) are models of their own: their weights are the view's to make, as the top's are."""
    if any(part.startswith(".") for part in path.split("/")):
        return False
    folder, _, name = path.rpartition("/")
    if folder in components:
        return not is_model_file(name)
    return "/" in path or not (is_model_file(path) or path == DEFAULT_MANIFEST)


def content_digest(fd: int, size: int) -> bytes:
    """The SHA-256 of the first `size` bytes of the open file `fd` (read with pread: its position stays)."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_DIGEST_BLOCK, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.digest()


def find_companions(
    source: Path,
    warnings: list[str],
    directories: dict[str, os.stat_result] | None = None,
    weights: Collection[ShardKey] = (),
    components: Collection[str] = (),
) -> list[Companion]:
    """The regular files beside a local model's weights (one level of subdirectories too), by path;
    `directories`, if given, gets each subdirectory's status (its owner and permissions).

    Each file is opened once, beneath the model's directory (see safefiles): a symlink that leads
    out of it (but for a Hugging Face cache snapshot's links to its repository's blobs) is left out
    with a warning, and so is a file that cannot be read, one over 64 MiB, what is mounted inside
    the directory (never looked into: it may hang), and what goes past 1000 files, 256 MiB in all
    or 30 s of scanning. A file in a subdirectory is no more readable than the subdirectory lets
    it be: its read bits are kept only where the directory grants search. What is_companion() says
    is none is left out, and so are the model's own files (`weights`: a checkpoint named model.pt
    is weights by being the model, not by its name), and the weights of a pipeline's component
    folders (`components`). Each is hashed as it is found: its content
    is what it is served while it holds (see CompanionFiles).
    """
    root_path = model_directory(source).absolute()
    try:
        root = ModelDirectory(root_path)
    except OSError as exc:
        warnings.append(f"{printable(str(root_path))}: companion files skipped: {exc.strerror}")
        return []
    own = {os.path.abspath(weight) for weight in weights}
    with root:
        return _scan(root, warnings, directories, own, components)


def _scan(
    root: ModelDirectory,
    warnings: list[str],
    directories: dict[str, os.stat_result] | None,
    own: set[str],
    components: Collection[str],
) -> list[Companion]:
    deadline = time.monotonic() + SCAN_SECONDS
    skipped = Skipped()  # a directory another user fills with a million unreadable files: one warning a reason
    found: list[Companion] = []
    total = 0
    for relative in _candidates(root, mounted_under(root.real), skipped, components):
        if os.path.abspath(root.path / relative) in own:
            continue
        shown = printable(str(root.path / relative))
        if len(found) == MAX_COMPANIONS:
            warnings.append(f"{shown} and the files after it: skipped: over {MAX_COMPANIONS} companion files")
            break
        if time.monotonic() > deadline:
            warnings.append(f"{shown} and the files after it: skipped: the scan took over {SCAN_SECONDS:g} s")
            break
        try:
            fd, st = root.open_regular(relative)
        except NotRegular:
            continue
        except OSError as exc:
            why = printable(why_refused(exc))
            skipped.add(why, f"{shown}: skipped: {why}")
            continue
        try:  # served later through a descriptor opened again, only while it holds what it holds now
            if st.st_size > MAX_COMPANION_BYTES:
                skipped.add("over 64 MiB", f"{shown}: skipped: {st.st_size} bytes, over 64 MiB")
                continue
            if total + st.st_size > MAX_COMPANIONS_TOTAL:
                skipped.add("over 256 MiB in all", f"{shown}: skipped: companion files over 256 MiB in all")
                continue
            digest = content_digest(fd, st.st_size)
            if Identity.of(os.fstat(fd)) != Identity.of(st):
                skipped.add("written to", f"{shown}: skipped: written to while it was being read")
                continue
        except OSError as exc:
            why = f"cannot read: {exc.strerror}"
            skipped.add(why, f"{shown}: skipped: {why}")
            continue
        finally:
            os.close(fd)
        identity, mtime_ns = Identity.of(st), st.st_mtime_ns
        subdirectory = relative.rpartition("/")[0]
        if subdirectory:
            try:
                where = root.status(subdirectory)
            except OSError as exc:
                why = printable(why_refused(exc))
                skipped.add(why, f"{shown}: skipped: {why}")
                continue
            if directories is not None:
                directories[subdirectory] = where
            searchable = (where.st_mode & 0o111) << 2  # x for each of owner, group, others, as r
            st = os.stat_result((st.st_mode & ~(0o444 & ~searchable), *st[1:10]))
        total += st.st_size
        found.append(Companion(relative, st.st_size, mtime_ns, st, LocalOrigin(root.path, identity, digest)))
    warnings.extend(skipped.said())
    return found


def _candidates(root: ModelDirectory, mounted: set[str], skipped: Skipped, components: Collection[str]) -> list[str]:
    names: list[str] = []
    try:
        top = sorted(root.scan(), key=lambda e: e.name)
    except OSError:
        return names
    for entry in top:
        if entry.name.startswith(".") or not (is_companion(entry.name) or entry.is_dir(follow_symlinks=False)):
            continue
        if entry.name in mounted:
            _mounted(root, entry.name, skipped)
            continue
        if entry.is_dir(follow_symlinks=False):
            try:
                inner = sorted(root.scan(entry.name), key=lambda e: e.name)
            except OSError:
                continue
            for e in inner:
                path = f"{entry.name}/{e.name}"
                if not is_companion(path, components) or e.is_dir(follow_symlinks=False):
                    continue
                if path in mounted:
                    _mounted(root, path, skipped)
                    continue
                names.append(path)
        else:
            names.append(entry.name)
    return names


def _mounted(root: ModelDirectory, relative: str, skipped: Skipped) -> None:
    why = "another file system is mounted there"
    skipped.add(why, f"{printable(str(root.path / relative))}: skipped: {why}")


# -- remote models ----------------------------------------------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
WELL_KNOWN = (
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "adapter_config.json",
    *ADAPTER_NAMES,
    "README.md",
)
"""What loaders look for beside the weights: asked for where a store cannot list a directory
(plain HTTP). sentence-transformers' modules.json and their own configs are among them, and PEFT's
adapter beside its base model."""
MODULE_FILES = ("config.json", "sentence_bert_config.json", "model.safetensors", "pytorch_model.bin", *TOKENIZER_FILES)
"""What a module of modules.json may hold in its folder (a Pooling's config, a Transformer's tokenizer,
a Dense layer's weights)."""

COMPANION_TIMEOUT = 10.0
"""Seconds a companion file may take to be found, retries included: they are optional, and some are guessed."""
MAX_SUBDIRECTORIES = 50
MAX_SUBDIRECTORY_DEPTH = 2
"""A companion's path: a file of the model's directory, or of a subdirectory of it (one level)."""


def find_remote_companions(
    source: str,
    options: RemoteOptions,
    warnings: list[str],
    weights: Collection[ShardKey] = (),
    components: Collection[str] = (),
) -> list[Companion]:
    """The files beside a remote model's weights: every one a listing shows (S3, and the Hub's API;
    one level of subdirectories too), else (plain HTTP) the well-known ones that are there and the
    files the model's own files name; the same limits as for a local model, each look bounded by
    COMPANION_TIMEOUT. Nothing with --offline (the cache keeps only the weights).

    Which were found, and which looked for and not there, is logged.
    """
    if options.offline:
        warnings.append(f"{printable(source)}: companion files are not fetched with --offline")
        return []
    quick = dataclasses.replace(options, timeout=min(options.timeout, COMPANION_TIMEOUT))
    try:
        listed = listing_beside(source, quick, MAX_SUBDIRECTORIES)
    except RemoteError as exc:
        warnings.append(f"companion files skipped: {exc}")
        return []
    if listed is None:
        try:
            listed = hub_listing(source, quick, MAX_SUBDIRECTORIES)
        except RemoteError as exc:  # a mirror that serves files but not the API: as over plain HTTP
            log.info("%s; looking for the files loaders look for instead", exc)
    if listed is not None:
        found = _listed(source, options, listed, warnings, {str(weight) for weight in weights}, components)
        log.info("companion files of %s: %s", printable(source), ", ".join(c.path for c in found) or "none")
        return found
    return _guessed(source, options, quick, warnings)


def _listed(
    source: str,
    options: RemoteOptions,
    listed: list[tuple[str, int, float, str | None]],
    warnings: list[str],
    own: set[str],
    components: Collection[str] = (),
) -> list[Companion]:
    found: list[Companion] = []
    total = 0
    skipped = Skipped()
    for path, size, mtime, etag in sorted(listed):
        why = path_problem(path, MAX_SUBDIRECTORY_DEPTH)  # the one gate of names from outside
        if why is not None:
            name = printable(path[:200])
            skipped.add("names that are not plain relative paths", f"{printable(source)}: '{name}': skipped: {why}")
            continue
        if not is_companion(path, components):
            continue
        ref = beside(source, path, options)
        if ref.url in own:
            continue
        shown = printable(ref.url)
        if size < 0:  # a lying listing's (-1: none at all)
            skipped.add("no size", f"{shown}: skipped: the listing gives it no size, or a negative one")
        elif size > MAX_COMPANION_BYTES:
            skipped.add("over 64 MiB", f"{shown}: skipped: {size} bytes, over 64 MiB")
        elif total + size > MAX_COMPANIONS_TOTAL:
            skipped.add("over 256 MiB in all", f"{shown}: skipped: companion files over 256 MiB in all")
        elif len(found) == MAX_COMPANIONS:
            skipped.add("too many", f"{shown}: skipped: over {MAX_COMPANIONS} companion files")
        else:
            total += size
            version = ObjectVersion(ref, etag, size, mtime) if etag is not None else None
            mtime_ns = int((mtime or time.time()) * 1e9)
            found.append(Companion(path, size, mtime_ns, None, RemoteOrigin(ref, options, version)))
    warnings.extend(skipped.said())
    return found


def _guessed(source: str, options: RemoteOptions, quick: RemoteOptions, warnings: list[str]) -> list[Companion]:
    """Plain HTTP: the well-known names that are there, then what modules.json and the configs name."""
    looked: dict[str, ObjectVersion | None] = {}

    def look(paths: Iterable[str]) -> None:
        wanted = [path for path in dict.fromkeys(paths) if path not in looked and is_companion(path)]

        def one(path: str) -> tuple[str, ObjectVersion | str | None]:
            try:
                return path, head(beside(source, path, quick))
            except RemoteError as exc:
                return path, f"{printable(str(exc))}: skipped"

        with ThreadPoolExecutor(max_workers=8) as pool:
            for path, answer in pool.map(one, wanted[: MAX_COMPANIONS - len(looked)]):
                if isinstance(answer, str):
                    warnings.append(answer)
                    looked[path] = None
                else:
                    looked[path] = answer

    look(WELL_KNOWN)
    look(_named(source, quick, looked, warnings))
    found: list[Companion] = []
    total = 0
    for path, version in sorted(looked.items()):
        if version is None:
            continue
        shown = printable(version.url)
        if version.size > MAX_COMPANION_BYTES:
            warnings.append(f"{shown}: skipped: {version.size} bytes, over 64 MiB")
        elif total + version.size > MAX_COMPANIONS_TOTAL:
            warnings.append(f"{shown}: skipped: companion files over 256 MiB in all")
        else:
            total += version.size
            mtime_ns = int((version.mtime or time.time()) * 1e9)
            ref = version.ref
            found.append(Companion(path, version.size, mtime_ns, None, RemoteOrigin(ref, options, version)))
    absent = sorted(path for path, version in looked.items() if version is None)
    log.info(
        "companion files of %s: found %s; looked for and not there: %s",
        printable(source),
        ", ".join(c.path for c in found) or "none",
        ", ".join(absent) or "none",
    )
    return found


def _named(
    source: str, options: RemoteOptions, looked: dict[str, ObjectVersion | None], warnings: list[str]
) -> list[str]:
    """The files that the model's own files found so far name: each module of modules.json (its
    config.json, and any well-known file in its folder), and the Python files of auto_map."""
    named: list[str] = []
    for document_name in ("modules.json", "config.json", "tokenizer_config.json"):
        version = looked.get(document_name)
        if version is None or version.size > MAX_NAMING_FILE:
            continue
        try:
            document = orjson.loads(get_whole(version.ref, MAX_NAMING_FILE))
        except (RemoteError, TooLarge, FileNotFoundError, orjson.JSONDecodeError) as exc:
            warnings.append(f"{printable(version.url)}: not followed: {exc}")
            continue
        if document_name == "modules.json" and isinstance(document, list):
            for module in document:
                folder = module.get("path") if isinstance(module, dict) else None
                if isinstance(folder, str) and _plain_name(folder):  # its files: one level down
                    named += [f"{folder}/{name}" for name in MODULE_FILES]
        elif isinstance(document, dict) and isinstance(document.get("auto_map"), dict):
            for value in document["auto_map"].values():
                for reference in value if isinstance(value, list) else [value]:
                    if isinstance(reference, str) and "." in reference:
                        module_name = reference.rpartition("--")[2].rpartition(".")[0]
                        if _plain_name(f"{module_name}.py", MAX_SUBDIRECTORY_DEPTH):
                            named.append(f"{module_name}.py")
    return named


def _plain_name(path: str, depth: int = 1) -> bool:
    """Whether a name a model's file gives is one to look for: a plain relative path of at most
    `depth` parts (names.path_problem, the one gate of names from outside), and no backslash (a
    separator to some servers)."""
    return path_problem(path, depth) is None and "\\" not in path
