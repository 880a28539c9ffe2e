"""The files that come with a model's weights (config.json, tokenizer files, README.md, ...).

Read once, at mount, from the top level of the model's directory and its subdirectories one
level down; held in memory, so serving them never touches the source again.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import printable
from ..integrity import DEFAULT_MANIFEST
from ..sources.remote import RemoteError, RemoteOptions, TooLarge, beside, get_whole, listing_beside

MAX_COMPANION_BYTES = 64 << 20
MAX_COMPANIONS_TOTAL = 256 << 20
MAX_COMPANIONS = 1000
"""What a daemon holds of companion files at most (they are in its memory for its whole life)."""


@dataclass(frozen=True)
class Companion:
    path: str
    """Relative to the model's directory: config.json, 1_Pooling/config.json."""
    data: bytes
    mtime_ns: int
    status: os.stat_result | None = None
    """The source file's, for its owner and permissions (None: a remote object's, the source's apply)."""


def model_directory(source: Path) -> Path:
    """The directory a local model's other files live in (its own, or that of its file or index)."""
    return source if source.is_dir() else source.parent


def is_weights(name: str) -> bool:
    """The files a view makes itself or that describe the weights, not taken from the source (a
    manifest of the source's tensors would not match a selection of them)."""
    return name.endswith((".safetensors", ".safetensors.index.json")) or name == DEFAULT_MANIFEST


def find_companions(
    source: Path, warnings: list[str], directories: dict[str, os.stat_result] | None = None
) -> list[Companion]:
    """The regular files beside a local model's weights (one level of subdirectories too), by path;
    `directories`, if given, gets each subdirectory's status (its owner and permissions).

    A file in a subdirectory is no more readable than the subdirectory lets it be: its read bits
    are kept only where the directory grants search.

    Hidden files and directories, the weights and their indexes are left out; a file over 64 MiB,
    a symlink that leads out of the model's directory (but for a Hugging Face cache snapshot's
    links to its repository's blobs), or one that cannot be read is left out with
    a warning (in `warnings`), as is what goes past 1000 files or 256 MiB in all.
    """
    root = model_directory(source).resolve()
    found: list[Companion] = []
    total = 0
    for relative in _candidates(root):
        shown = printable(str(root / relative))
        if len(found) == MAX_COMPANIONS:
            warnings.append(f"{shown} and the files after it: skipped: over {MAX_COMPANIONS} companion files")
            break
        path = root / relative
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            warnings.append(f"{shown}: skipped: {getattr(exc, 'strerror', None) or exc}")
            continue
        if not (target.is_relative_to(root) or _in_hub_blobs(root, target)):
            warnings.append(f"{shown}: skipped: a symlink out of the model's directory")
            continue
        try:
            st = os.stat(target)
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size > MAX_COMPANION_BYTES:
                warnings.append(f"{shown}: skipped: {st.st_size} bytes, over 64 MiB")
                continue
            if total + st.st_size > MAX_COMPANIONS_TOTAL:
                warnings.append(f"{shown}: skipped: companion files over 256 MiB in all")
                continue
            data = target.read_bytes()
        except OSError as exc:
            warnings.append(f"{shown}: skipped: {exc.strerror}")
            continue
        mtime_ns = st.st_mtime_ns
        subdirectory = relative.rpartition("/")[0]
        if subdirectory:
            try:
                where = os.stat(root / subdirectory)
            except OSError as exc:
                warnings.append(f"{shown}: skipped: {exc.strerror}")
                continue
            if directories is not None:
                directories[subdirectory] = where
            searchable = (where.st_mode & 0o111) << 2  # x for each of owner, group, others, as r
            st = os.stat_result((st.st_mode & ~(0o444 & ~searchable), *st[1:10]))
        total += len(data)
        found.append(Companion(relative, data, mtime_ns, st))
    return found


WELL_KNOWN = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "preprocessor_config.json",
    "chat_template.jinja",
    "README.md",
)
"""What a loader looks for beside the weights: fetched from stores that cannot list a directory."""


COMPANION_TIMEOUT = 10.0
"""Seconds a companion file may take, retries included: they are optional, and some are guessed."""
MAX_SUBDIRECTORIES = 50


def find_remote_companions(source: str, options: RemoteOptions, warnings: list[str]) -> list[Companion]:
    """The files beside a remote model's weights: every one a listing shows (S3; and one level of
    subdirectories), else the well-known ones that are there (HTTP, the Hub); the same limits as
    for a local model, each fetch bounded by COMPANION_TIMEOUT. Nothing with --offline (the cache
    keeps only the weights)."""
    if options.offline:
        warnings.append(f"{printable(source)}: companion files are not fetched with --offline")
        return []
    options = dataclasses.replace(options, timeout=min(options.timeout, COMPANION_TIMEOUT))
    try:
        listed = listing_beside(source, options, MAX_SUBDIRECTORIES)
    except RemoteError as exc:
        warnings.append(f"companion files skipped: {exc}")
        return []
    wanted: list[tuple[str, float]] = []
    if listed is None:
        wanted = [(name, 0.0) for name in WELL_KNOWN]
    else:
        total = 0
        for path, size, mtime in sorted(listed):
            if any(part.startswith(".") for part in path.split("/")) or is_weights(path.rpartition("/")[2]):
                continue
            shown = printable(beside(source, path, options).url)
            if size > MAX_COMPANION_BYTES:
                warnings.append(f"{shown}: skipped: {size} bytes, over 64 MiB")
            elif total + size > MAX_COMPANIONS_TOTAL:
                warnings.append(f"{shown}: skipped: companion files over 256 MiB in all")
            elif len(wanted) == MAX_COMPANIONS:
                warnings.append(f"{shown}: skipped: over {MAX_COMPANIONS} companion files")
            else:
                total += size
                wanted.append((path, mtime))

    def fetch(item: tuple[str, float]) -> Companion | str | None:
        ref = beside(source, item[0], options)
        try:
            data = get_whole(ref, MAX_COMPANION_BYTES)
        except FileNotFoundError:
            return None  # a well-known name that this model does not have
        except TooLarge as exc:
            return f"{printable(str(exc))}: skipped"
        except RemoteError as exc:
            return f"{printable(str(exc))}: skipped"
        return Companion(item[0], data, int((item[1] or time.time()) * 1e9))

    found: list[Companion] = []
    held = 0
    with ThreadPoolExecutor(max_workers=8) as pool:
        for result in pool.map(fetch, wanted):
            if isinstance(result, str):
                warnings.append(result)
            elif result is not None:
                if held + len(result.data) > MAX_COMPANIONS_TOTAL:  # sizes told only now (HTTP)
                    warnings.append(f"{printable(beside(source, result.path, options).url)}: skipped: "
                                    "companion files over 256 MiB in all")  # fmt: skip
                    continue
                held += len(result.data)
                found.append(result)
    return found


def _in_hub_blobs(root: Path, target: Path) -> bool:
    """Whether `target` is a blob of the Hugging Face cache repository whose snapshot `root` is:
    a snapshot's files are symlinks to ../../blobs/HASH, part of the same model."""
    return root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"


def _candidates(root: Path) -> list[str]:
    names: list[str] = []
    try:
        top = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return names
    for entry in top:
        if entry.name.startswith(".") or is_weights(entry.name):
            continue
        if entry.is_dir(follow_symlinks=False):
            try:
                inner = sorted(os.scandir(entry.path), key=lambda e: e.name)
            except OSError:
                continue
            names += [
                f"{entry.name}/{e.name}"
                for e in inner
                if not e.name.startswith(".") and not is_weights(e.name) and not e.is_dir()
            ]
        else:
            names.append(entry.name)
    return names
