"""The files beside a local model's weights, found for its view: every file of the model's directory,
to MAX_DEPTH levels (hidden ones, and through symlinks to files and folders within it, too), each
opened once beneath it (fs/guarded.py), hashed as it is found within a budget (companions.py serves
it while it holds those bytes), the walk bounded in files, depth and time."""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path

from ..errors import printable
from ..fs.guarded import ModelDirectory, NotRegular, mounted_under, why_refused
from ..utils.identity import Identity, ShardKey
from .companions import (
    HASHED_BYTES,
    HASHED_TOTAL,
    MAX_DEPTH,
    MAX_FILES,
    SCAN_SECONDS,
    Companion,
    FileRule,
    FolderFiles,
    LocalOrigin,
    Skipped,
    content_digest,
)

__all__ = ["find_companions", "model_directory"]


def model_directory(source: Path) -> Path:
    """The directory a local model's other files live in (its own, or that of its file or index)."""
    return source if source.is_dir() else source.parent


def find_companions(
    source: Path, rule: FileRule, *, own: Collection[ShardKey] = (), wanted: Collection[str] | None = None
) -> FolderFiles:
    """The regular files beside a local model's weights, at any depth up to MAX_DEPTH, by path, and
    each subdirectory's status (its owner and permissions).

    Each file is opened once, beneath the model's directory (see fs/guarded.py): a symlink (to a file
    or a folder) within it is followed, one that leads out of it (but for a Hugging Face cache
    snapshot's links to its repository's blobs) is left out with a warning, and so is a file that
    cannot be read, a FIFO, a device or a socket, what is mounted inside the directory (never looked
    into: it may hang), a git repository's own folder (.git), and what goes past MAX_FILES files,
    MAX_DEPTH levels or SCAN_SECONDS of scanning. A file in a subdirectory is no more readable than
    the subdirectory lets it be: its read bits are kept only where the directory grants search.
    What the `rule` does not take is left out, and so are the model's own files (`own`: a
    checkpoint named model.pt is weights by being the model, not by its name). The weights files the
    rule says are models of their own are named (FolderFiles.weights), not read. Each
    companion is hashed as it is found, within HASHED_BYTES a file and HASHED_TOTAL in all: its
    content is what it is served while it holds (see CompanionFiles); one past them is served while
    it is the very file found.

    `wanted`: files to take too, by path, where the scan does not reach (a signature's: the model's
    directory holds exactly those and what the signature leaves out, its check said), each hashed
    whatever its size (its signed bytes are checked against that).
    """
    root_path = model_directory(source).absolute()
    try:
        root = ModelDirectory(root_path)
    except OSError as exc:
        return FolderFiles(warnings=[f"{printable(str(root_path))}: companion files skipped: {exc.strerror}"])
    mine = {os.path.abspath(weight) for weight in own}
    with root:
        return _scan(root, mine, rule, wanted)


def _scan(root: ModelDirectory, own: set[str], rule: FileRule, wanted: Collection[str] | None) -> FolderFiles:
    deadline = time.monotonic() + SCAN_SECONDS
    skipped = Skipped()  # a directory another user fills with a million unreadable files: one warning a reason
    found = FolderFiles()
    hashed = 0
    mounted = mounted_under(root.real)
    candidates = _candidates(root, mounted, skipped, rule, deadline)
    must_hash = set(wanted or ())
    if wanted is not None:  # and those of a signature a scan does not reach
        scanned = set(candidates)
        candidates += [path for path in _taken(wanted, mounted, rule) if path not in scanned]
    for relative in candidates:
        if os.path.abspath(root.path / relative) in own:
            continue
        shown = printable(str(root.path / relative))
        if len(found.companions) + len(found.weights) == MAX_FILES:
            found.warnings.append(f"{shown} and the files after it: skipped: over {MAX_FILES:,} files in the folder")
            break
        if time.monotonic() > deadline:
            found.warnings.append(f"{shown} and the files after it: skipped: the scan took over {SCAN_SECONDS:g} s")
            break
        if rule.weights(relative):
            found.weights.append(relative)  # opened, validated and served as a model of its own
            continue
        try:
            fd, st = root.open_regular(relative)
        except NotRegular as exc:
            if exc.kind != "a directory":  # (a symlink to a folder beyond the walk's depth: said there)
                skipped.add(exc.kind, f"{shown}: skipped: {exc.kind}, not a file")
            continue
        except OSError as exc:
            why = printable(why_refused(exc))
            skipped.add(why, f"{shown}: skipped: {why}")
            continue
        try:  # served later through a descriptor opened again, only while it holds what it holds now
            digest = None
            if relative in must_hash or (st.st_size <= HASHED_BYTES and hashed + st.st_size <= HASHED_TOTAL):
                digest = content_digest(fd, st.st_size)
                hashed += st.st_size
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
        unsearchable = _unsearchable(root, relative, found, skipped, shown)
        if unsearchable is None:
            continue
        shows = os.stat_result((st.st_mode & ~unsearchable, *st[1:10]))
        origin = LocalOrigin(root.path, identity, digest)
        found.companions.append(Companion(relative, st.st_size, mtime_ns, shows, origin, unsearchable=unsearchable))
    found.warnings.extend(skipped.said())
    return found


def _unsearchable(root: ModelDirectory, relative: str, found: FolderFiles, skipped: Skipped, shown: str) -> int | None:
    """The read bits the folders a file is in take away: a file is no more readable than each of them
    lets it be (its read bits kept only where every one grants search); None (said) if a folder
    cannot be looked at."""
    removed = 0
    parts = relative.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        subdirectory = "/".join(parts[:depth])
        where = found.directories.get(subdirectory)
        if where is None:
            try:
                where = found.directories[subdirectory] = root.status(subdirectory)
            except OSError as exc:
                why = printable(why_refused(exc))
                skipped.add(why, f"{shown}: skipped: {why}")
                return None
        searchable = (where.st_mode & 0o111) << 2  # x for each of owner, group, others, as r
        removed |= 0o444 & ~searchable
    return removed


def _taken(wanted: Collection[str], mounted: set[str], rule: FileRule) -> list[str]:
    """The files wanted that a view takes, the top's first (what a loader needs most lies there),
    none beneath what is mounted inside the directory."""
    kept = [
        path
        for path in wanted
        if rule.takes(path) and not any(path == place or path.startswith(place + "/") for place in mounted)
    ]
    return sorted(kept, key=lambda path: (path.count("/"), path))


def _candidates(
    root: ModelDirectory,
    mounted: set[str],
    skipped: Skipped,
    rule: FileRule,
    deadline: float,
) -> list[str]:
    """The files of the directory a view takes, level by level to MAX_DEPTH (the top's first: what a
    loader needs most lies there, and a bound past which files are left out keeps them), each level
    in name order; symlinks to folders within it walked too, as a loader would find their files
    (a link to a folder it is in: not walked, no loop). At most MAX_FILES + 1 (the caller says what
    is past MAX_FILES)."""
    names: list[str] = []
    top = root.status()
    level: list[tuple[str, frozenset[tuple[int, int]]]] = [("", frozenset({(top.st_dev, top.st_ino)}))]
    for depth in range(MAX_DEPTH):
        deeper: list[tuple[str, frozenset[tuple[int, int]]]] = []
        for directory, above in level:
            if time.monotonic() > deadline:
                return names
            try:  # (what each entry is, told while the directory is open)
                entries = sorted(
                    (e.name, e.is_dir(follow_symlinks=False) or e.is_symlink()) for e in root.scan(directory)
                )
            except OSError as exc:
                why = printable(why_refused(exc))
                skipped.add(why, f"{printable(str(root.path / directory))}: skipped: {why}")
                continue
            for name, may_be_folder in entries:
                path = f"{directory}/{name}" if directory else name
                left_out = rule.left_out(path)
                if left_out is not None:
                    skipped.add(left_out, f"{printable(str(root.path / path))}: skipped: {left_out}")
                    continue
                if path in mounted:
                    _mounted(root, path, skipped)
                    continue
                inner = _folder(root, path) if may_be_folder else None
                if inner is not None:
                    shown = printable(str(root.path / path))
                    if inner in above:  # a link to a folder it is in
                        skipped.add("a loop", f"{shown}: skipped: a link to a folder it is in")
                    elif depth + 1 < MAX_DEPTH:
                        deeper.append((path, above | {inner}))
                    else:
                        skipped.add("too deep", f"{shown}: skipped: over {MAX_DEPTH} levels deep")
                    continue
                if rule.takes(path):
                    names.append(path)
                    if len(names) > MAX_FILES:
                        return names
        level = deeper
    return names


def _folder(root: ModelDirectory, path: str) -> tuple[int, int] | None:
    """The folder a directory or a symlink of the directory is (its device and inode), if it is one
    to walk: a directory, or a symlink to one within the directory; None for anything else."""
    try:
        st = root.status(path)  # opened beneath the directory: a link out of it is no folder of it
    except OSError:
        return None  # (a link to a file, or out: said when it is opened as a file)
    return st.st_dev, st.st_ino


def _mounted(root: ModelDirectory, relative: str, skipped: Skipped) -> None:
    why = "another file system is mounted there"
    skipped.add(why, f"{printable(str(root.path / relative))}: skipped: {why}")
