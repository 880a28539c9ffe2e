"""The files beside a local model's weights, found for its view: from the top level of the model's
directory and its subdirectories one level down, each opened once beneath it (fs/guarded.py), hashed
as it is found (companions.py serves it while it holds those bytes), the walk bounded in files,
bytes and time."""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path

from ..errors import printable
from ..fs.guarded import ModelDirectory, NotRegular, mounted_under, why_refused
from ..utils.identity import Identity, ShardKey
from .companions import (
    MAX_COMPANION_BYTES,
    MAX_COMPANIONS,
    MAX_COMPANIONS_TOTAL,
    SCAN_SECONDS,
    Companion,
    FolderFiles,
    LocalOrigin,
    Skipped,
    content_digest,
    in_view,
    is_weights_file,
)

__all__ = ["find_companions", "model_directory"]


def model_directory(source: Path) -> Path:
    """The directory a local model's other files live in (its own, or that of its file or index)."""
    return source if source.is_dir() else source.parent


def find_companions(
    source: Path,
    *,
    folder: bool = False,
    own: Collection[ShardKey] = (),
    components: Collection[str] = (),
    wanted: Collection[str] | None = None,
) -> FolderFiles:
    """The regular files beside a local model's weights (one level of subdirectories too), by path,
    and each subdirectory's status (its owner and permissions).

    Each file is opened once, beneath the model's directory (see fs/guarded.py): a symlink that leads
    out of it (but for a Hugging Face cache snapshot's links to its repository's blobs) is left out
    with a warning, and so is a file that cannot be read, one over 64 MiB, what is mounted inside
    the directory (never looked into: it may hang), and what goes past 1000 files, 256 MiB in all
    or 30 s of scanning. A file in a subdirectory is no more readable than the subdirectory lets
    it be: its read bits are kept only where the directory grants search. What in_view() says is
    not in the view is left out, and so are the model's own files (`own`: a checkpoint named
    model.pt is weights by being the model, not by its name). In a view of the folder (`folder`),
    the other weights files are named (FolderFiles.weights), not read. Each companion is hashed as
    it is found: its content is what it is served while it holds (see CompanionFiles).

    `wanted`: files to take too, by path, where the scan does not reach (a signature's: at any
    depth, hidden ones too; the model's directory holds exactly those and what the signature leaves
    out, its check said).
    """
    root_path = model_directory(source).absolute()
    try:
        root = ModelDirectory(root_path)
    except OSError as exc:
        return FolderFiles(warnings=[f"{printable(str(root_path))}: companion files skipped: {exc.strerror}"])
    mine = {os.path.abspath(weight) for weight in own}
    with root:
        return _scan(root, mine, folder, components, wanted)


def _scan(
    root: ModelDirectory, own: set[str], folder: bool, components: Collection[str], wanted: Collection[str] | None
) -> FolderFiles:
    deadline = time.monotonic() + SCAN_SECONDS
    skipped = Skipped()  # a directory another user fills with a million unreadable files: one warning a reason
    found = FolderFiles()
    total = 0
    mounted = mounted_under(root.real)
    candidates = _candidates(root, mounted, skipped, folder, components)
    if wanted is not None:  # and those of a signature a scan does not reach (hidden, or deeper)
        scanned = set(candidates)
        candidates += [path for path in _taken(wanted, mounted, folder, components) if path not in scanned]
    for relative in candidates:
        if os.path.abspath(root.path / relative) in own:
            continue
        shown = printable(str(root.path / relative))
        if len(found.companions) + len(found.weights) == MAX_COMPANIONS:
            found.warnings.append(
                f"{shown} and the files after it: skipped: over {MAX_COMPANIONS} files beside the model"
            )
            break
        if time.monotonic() > deadline:
            found.warnings.append(f"{shown} and the files after it: skipped: the scan took over {SCAN_SECONDS:g} s")
            break
        if folder and is_weights_file(relative):
            found.weights.append(relative)  # opened, validated and served as a model of its own
            continue
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
            found.directories[subdirectory] = where
            searchable = (where.st_mode & 0o111) << 2  # x for each of owner, group, others, as r
            st = os.stat_result((st.st_mode & ~(0o444 & ~searchable), *st[1:10]))
        total += st.st_size
        found.companions.append(Companion(relative, st.st_size, mtime_ns, st, LocalOrigin(root.path, identity, digest)))
    found.warnings.extend(skipped.said())
    return found


def _taken(wanted: Collection[str], mounted: set[str], folder: bool, components: Collection[str]) -> list[str]:
    """The files wanted that a view takes, the top's first (what a loader needs most lies there),
    none beneath what is mounted inside the directory."""
    kept = [
        path
        for path in wanted
        if (folder or in_view(path, folder=False, components=components))
        and not any(path == place or path.startswith(place + "/") for place in mounted)
    ]
    return sorted(kept, key=lambda path: (path.count("/"), path))


def _candidates(
    root: ModelDirectory, mounted: set[str], skipped: Skipped, folder: bool, components: Collection[str]
) -> list[str]:
    """The files of the directory and of its subdirectories one level down that a view takes: the
    top's first (what a loader needs most lies there: a bound past which files are left out keeps
    them), then each subdirectory's."""
    names: list[str] = []
    inner_names: list[str] = []
    try:
        top = sorted(root.scan(), key=lambda e: e.name)
    except OSError:
        return names
    for entry in top:
        is_dir = entry.is_dir(follow_symlinks=False)
        if entry.name.startswith(".") or not (is_dir or in_view(entry.name, folder=folder)):
            continue
        if entry.name in mounted:
            _mounted(root, entry.name, skipped)
            continue
        if is_dir:
            try:
                inner = sorted(root.scan(entry.name), key=lambda e: e.name)
            except OSError:
                continue
            for e in inner:
                path = f"{entry.name}/{e.name}"
                if not in_view(path, folder=folder, components=components) or e.is_dir(follow_symlinks=False):
                    continue
                if path in mounted:
                    _mounted(root, path, skipped)
                    continue
                inner_names.append(path)
        else:
            names.append(entry.name)
    return names + inner_names


def _mounted(root: ModelDirectory, relative: str, skipped: Skipped) -> None:
    why = "another file system is mounted there"
    skipped.add(why, f"{printable(str(root.path / relative))}: skipped: {why}")
