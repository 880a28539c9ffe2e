"""Tensor names -> safe relative paths in the mounted tree, and the rules that keep them safe."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Literal

Layout = Literal["slash", "dotted"]
"""How a name becomes a path: "slash" nests on '/', "dotted" on '/' and '.'."""

LAYOUTS: tuple[Layout, ...] = ("slash", "dotted")
SIDECAR_SUFFIXES = (".meta.json", ".sha256")
CONTROL_DIR = ".tensorfs"  # the mount's own files: index.json, daemon.json, stats.json, the model view
STATS_NAME = "stats.json"  # in CONTROL_DIR, made afresh at each open
MAX_NAME_BYTES = 255
_LONGEST_SUFFIX = max(len(s) for s in SIDECAR_SUFFIXES)


def tensor_path(name: str, layout: Layout = "slash") -> str:
    """The tensor's file path relative to the mount root, components joined by '/'."""
    return name.replace(".", "/") if layout == "dotted" else name


MAX_PATH_DEPTH = 16
"""The most parts a path from outside may have (a listed file, an archive's entry)."""


def path_problem(path: str, max_depth: int = MAX_PATH_DEPTH, max_part: int | None = MAX_NAME_BYTES) -> str | None:
    """Why a name that a server, a listing, an archive or a file supplies is not a plain relative path
    that may become a file here (None when it is one): not empty, no NUL, valid Unicode, not absolute,
    no empty, '.' or '..' part, at most `max_depth` parts of at most 255 bytes each.

    The one gate every such name passes (tensor names pass name_problem(), stricter still)."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "contains a NUL character"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (it holds a lone surrogate)"
    if path.startswith("/"):
        return "is an absolute path"
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            return f"has {'an empty' if not part else f'a {part!r}'} path component"
        if max_part is not None and len(part.encode("utf-8")) > max_part:
            return f"has a path component over {max_part} bytes"
    if len(parts) > max_depth:
        return f"is {len(parts)} levels deep, over {max_depth}"
    return None


def name_problem(name: str, layout: Layout = "slash") -> str | None:
    """Why `name` cannot become a file in the tree under `layout`, or None when it can: a plain
    relative path (path_problem(), any depth), and more (see docs/guarantees.md)."""
    why = path_problem(name, max_depth=len(name) + 1, max_part=None)  # bytes of each part: said below
    if why is not None:
        return f"name {why}"
    encoded = name.encode("utf-8")
    parts = name.split("/")
    if layout == "dotted":
        for part in parts:  # '.' separates components too: a leading, trailing or doubled '.' makes an empty one
            if part.startswith(".") or part.endswith(".") or ".." in part:
                where = "name" if part == name else f"component '{part}'"
                how = (
                    "begins with '.'"
                    if part.startswith(".")
                    else "ends with '.'"
                    if part.endswith(".")
                    else "holds '..'"
                )
                return f"{where} {how}, which --layout dotted makes an empty path component"
        parts = tensor_path(name, layout).split("/")
    if parts[0] == CONTROL_DIR:
        return f"names beginning with '{CONTROL_DIR}/' are reserved for tensorfs"
    if len(encoded) + _LONGEST_SUFFIX <= MAX_NAME_BYTES:
        return None  # short enough that no component can be too long
    for part in parts[:-1]:
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"directory name '{part[:40]}...' is over {MAX_NAME_BYTES} bytes"
    last = len(parts[-1].encode("utf-8"))
    if last + _LONGEST_SUFFIX > MAX_NAME_BYTES:
        return (
            f"file name is {last} bytes; with its '{SIDECAR_SUFFIXES[0]}' sidecar it would pass "
            f"the {MAX_NAME_BYTES}-byte limit"
        )
    return None


# With names joined by NUL (and a NUL before and after), these substrings find every empty
# component; a '.', '..' or reserved component starts with one of _DOT_STARTS. Substring searches
# over the joined names are far faster than a regex or a loop over 100k names.
_EMPTY_COMPONENTS = ("//", "/\0", "\0/", "\0\0")
_DOT_STARTS = ("/.", "\0.")
_SURELY_SHORT = (MAX_NAME_BYTES - _LONGEST_SUFFIX) // 4  # characters: UTF-8 needs at most 4 bytes each


def name_problems(names: Collection[str], layout: Layout = "slash") -> list[tuple[str, str]]:
    """(name, reason) for every name that name_problem() rejects.

    Models hold 100k names, so the common case, all names fine, is decided by a few passes over
    all names joined into one string; only names that may be at fault are looked at one by one.
    """
    joined = "\0" + "\0".join(names) + "\0"
    if layout == "dotted":
        joined = joined.replace(".", "/")
    suspects: Iterable[str]
    try:
        joined.encode("utf-8")
        clean = (
            joined.count("\0") == len(names) + 1  # no name holds a NUL
            and not any(bad in joined for bad in _EMPTY_COMPONENTS)
            and not any(start in joined for start in _DOT_STARTS)
        )
    except UnicodeEncodeError:
        clean = False
    if clean and max(map(len, names), default=0) <= _SURELY_SHORT:
        return []
    suspects = [n for n in names if len(n) > _SURELY_SHORT] if clean else names
    found = []
    for name in suspects:
        reason = name_problem(name, layout)
        if reason is not None:
            found.append((name, reason))
    return found


def collisions(names: Collection[str], layout: Layout = "slash") -> list[tuple[str, str]]:
    """(name, reason) for every tensor whose path clashes with another entry of the tree.

    A clash is two tensors on one path, a tensor on another's sidecar path, or a path that would
    have to be both a file and a directory. Names must already have passed name_problem().
    """
    found: list[tuple[str, str]] = []
    files: Collection[str]  # every tensor path; owner() gives its tensor
    owner: Callable[[str], str]
    if layout == "slash":
        files, owner = names, str
    else:
        by_path: dict[str, str] = {}
        for name in names:
            other = by_path.setdefault(tensor_path(name, layout), name)
            if other != name:
                found.append((name, f"maps to the same path '{tensor_path(name, layout)}' as tensor '{other}'"))
        files, owner = by_path, by_path.__getitem__

    def sidecar_owner(path: str) -> str | None:
        for suffix in SIDECAR_SUFFIXES:
            if path.endswith(suffix) and path[: -len(suffix)] in files:
                return owner(path[: -len(suffix)])
        return None

    joined = "\0".join(files) + "\0"
    maybe_sidecars = any(suffix + "\0" in joined for suffix in SIDECAR_SUFFIXES)
    for path in [p for p in files if p.endswith(SIDECAR_SUFFIXES)] if maybe_sidecars else []:
        sidecar_of = sidecar_owner(path)
        if sidecar_of is not None:
            found.append((owner(path), f"has the same path as a sidecar of tensor '{sidecar_of}'"))
    seen_dirs: set[str] = set()
    for path in [p for p in files if "/" in p] if "/" in joined else []:
        end = path.rfind("/")
        while end > 0:
            directory = path[:end]
            if directory in seen_dirs:
                break  # and so are the directories above it
            seen_dirs.add(directory)
            if directory in files:
                found.append(
                    (owner(directory), f"is a file, but tensor '{owner(path)}' needs '{directory}' as a directory")
                )
            sidecar_of = sidecar_owner(directory)
            if sidecar_of is not None:
                found.append(
                    (owner(path), f"needs '{directory}' as a directory, but it is a sidecar of tensor '{sidecar_of}'")
                )
            end = path.rfind("/", 0, end)
    return found
