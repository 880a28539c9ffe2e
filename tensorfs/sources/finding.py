"""Which objects of a store are a model, and what is beside it: its shards found (by an index, a
listing, or the names loaders look for), the objects in its directory (for its companion files), each
listing bounded and every name it gives gated (names.py) before anything is made of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import Problem, RemoteError, TooLarge
from ..formats import WEIGHT_FILES, checkpoint_index_applies, choose_files, is_weights_name, pytorch
from ..names import path_problem
from .client import MAX_LISTED, get_whole, list_objects, modified, reason_of
from .index import INDEX_NAME, MAX_INDEX_BYTES, parse_weight_map, shard_names
from .store import ObjectRef, RemoteOptions, StoreSpec, store_spec

__all__ = ["Listed", "Located", "beside", "files_of", "hub_listing", "listing_beside", "locate"]


@dataclass
class Located:
    """A remote model's shards, and the index's weight map when there is one."""

    shards: list[ObjectRef]
    weight_map: dict[str, str] | None = None
    index_label: str | None = None


def locate(source: str, options: RemoteOptions, problems: list[Problem]) -> Located:
    """The shards of the remote model at `source` (same rules as a local model's), problems said."""
    spec, key = store_spec(source, options)
    if is_weights_name(key):
        return Located([ObjectRef(spec, key)])
    if key.endswith(".index.json"):
        return _from_index(ObjectRef(spec, key), problems)
    # A directory: its index if it has one, else the weight files a listing shows chosen as a local
    # directory's are (s3), a checkpoint's index, or model.safetensors (HTTP and the Hub: no listing).
    prefix = f"{key}/" if key else ""
    found = _by_index(ObjectRef(spec, prefix + INDEX_NAME), problems)
    if found is not None:
        return found
    shards = _list_shards(spec, prefix, problems) if spec.kind != "http" else []
    if shards is None:
        return Located([])
    names, ambiguous = choose_files([ref.key[len(prefix) :] for ref in shards])
    if checkpoint_index_applies(names):
        found = _by_index(ObjectRef(spec, prefix + pytorch.INDEX_NAME), problems)
        if found is not None:
            return found
    if spec.kind == "http":
        return Located([ObjectRef(spec, prefix + "model.safetensors")])
    if ambiguous is not None:
        problems.append(Problem(spec.url(key) + "/", ambiguous))
    elif not names:
        problems.append(Problem(spec.url(key) + "/", f"no {WEIGHT_FILES} objects under this prefix"))
    return Located([ObjectRef(spec, prefix + name) for name in names])


def _by_index(index: ObjectRef, problems: list[Problem]) -> Located | None:
    """The shards `index` names; None when there is no such object (a failure to read it is a problem)."""
    try:
        data = _index(index)
    except FileNotFoundError:
        return None
    except RemoteError as exc:
        problems.append(Problem(index.url, reason_of(exc, index.url)))
        return Located([])
    return _from_index(index, problems, data)


def _index(index: ObjectRef) -> bytes:
    """An index whole: TooLarge (its body unread) past MAX_INDEX_BYTES, in the words the local one gets."""
    try:
        return get_whole(index, MAX_INDEX_BYTES)
    except TooLarge:
        raise TooLarge(f"{index.url}: over {MAX_INDEX_BYTES:,} bytes: too large to be an index") from None


def _from_index(index: ObjectRef, problems: list[Problem], data: bytes | None = None) -> Located:
    label = index.url
    if data is None:
        try:
            data = _index(index)
        except FileNotFoundError:
            problems.append(Problem(label, "not found"))
            return Located([], index_label=label)
        except RemoteError as exc:
            problems.append(Problem(label, reason_of(exc, label)))
            return Located([], index_label=label)
    weight_map = parse_weight_map(data, label, problems)
    if weight_map is None:
        return Located([], index_label=label)
    return Located([index.sibling(name) for name in shard_names(weight_map, label, problems)], weight_map, label)


def _list_shards(spec: StoreSpec, prefix: str, problems: list[Problem]) -> list[ObjectRef] | None:
    where = spec.url(prefix.rstrip("/")) + "/"
    try:
        listed, more = list_objects(spec, prefix)
    except RemoteError as exc:
        problems.append(Problem(where, reason_of(exc, where)))
        return None
    if more:
        problems.append(Problem(where, f"over {MAX_LISTED} objects under this prefix: name the model's index"))
        return None
    keys = sorted(key for meta in listed if is_weights_name(key := str(meta["path"])) and "/" not in key[len(prefix) :])
    for key in keys:
        why = path_problem(key[len(prefix) :], max_depth=1)  # its own name: the model is refused
        if why is not None:
            problems.append(Problem(where, f"a shard's name {why}"))
    return [ObjectRef(spec, key) for key in keys]


def beside(source: str, name: str, options: RemoteOptions) -> ObjectRef:
    """The object named `name` in the remote model's directory (its prefix, or its file's directory)."""
    spec, key = store_spec(source, options)
    if is_weights_name(key) or key.endswith(".index.json"):
        return ObjectRef(spec, key).sibling(name)
    return ObjectRef(spec, f"{key}/{name}" if key else name)


Listed = list[tuple[str, int, float, str | None]]
"""Objects of a model's directory: (path in it, size, mtime, ETag if known)."""


def listing_beside(source: str, options: RemoteOptions, subdirectories: int = 0) -> Listed | None:
    """The objects in a remote model's directory, and those of its first `subdirectories`
    subdirectories (not hidden) one level down, for a store that lists (S3); None for one that does
    not (HTTP, the Hub). RemoteError when a listing fails; what is past MAX_LISTED objects is left out."""
    spec, _ = store_spec(source, options)
    if spec.kind != "s3":
        return None
    directory = beside(source, "x", options).key.rpartition("/")[0]
    top = f"{directory}/" if directory else ""
    listed, _ = list_objects(spec, top)
    entries = [
        (str(meta["path"]).removeprefix(top), int(meta["size"]), modified(meta), str(meta.get("e_tag") or "") or None)
        for meta in listed
    ]
    found: Listed = []
    inner: set[str] = set()
    for entry in files_of(entries):
        parts = entry[0].split("/")
        if len(parts) > 2:
            continue
        if len(parts) == 2:
            if parts[0].startswith(".") or (parts[0] not in inner and len(inner) == subdirectories):
                continue
            inner.add(parts[0])
        found.append(entry)
    return found


def files_of(entries: Listed) -> Listed:
    """A listing's entries that are files of the directory: a directory marker (a key that ends in
    '/' or is empty, as the S3 console and sync tools make for a folder) is none, and neither is a
    key that other keys are beneath (a folder made as an object): their paths are directories."""
    folders: set[str] = set()
    for path, *_ in entries:
        parts = path.split("/")
        folders.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    return [entry for entry in entries if entry[0] and not entry[0].endswith("/") and entry[0] not in folders]


MAX_HUB_LISTING = 16 << 20
"""The most one answer of the Hub's listing API may hold."""


def hub_listing(source: str, options: RemoteOptions, subdirectories: int = 0) -> Listed | None:
    """The files of a Hub model's directory (and of its first `subdirectories` subdirectories), as
    its API lists them ({HF_ENDPOINT}/api/models/ORG/NAME/tree/REVISION/PATH); None for a source
    that is not on the Hub. RemoteError when the listing fails."""
    if not source.startswith("hf://"):
        return None
    spec, key = store_spec(source, options)
    repo, _, revision = spec.scheme_root.removeprefix("hf://").partition("@")
    endpoint = spec.root.removesuffix(f"/{repo}/resolve/{revision}")
    api = StoreSpec("http", f"{endpoint}/api/models/{repo}/tree", f"{endpoint}/api/models/{repo}/tree",
                    headers=spec.headers, timeout=spec.timeout)  # fmt: skip
    directory = key.rpartition("/")[0] if is_weights_name(key) or key.endswith(".index.json") else key

    def listed(path: str) -> list[dict[str, Any]]:
        where = ObjectRef(api, f"{revision}/{path}" if path else revision)
        try:
            document = orjson.loads(get_whole(where, MAX_HUB_LISTING))
        except FileNotFoundError:
            raise RemoteError(f"{where.url}: the Hub's listing of the model's files is not there (404)") from None
        except orjson.JSONDecodeError as exc:
            raise RemoteError(f"{where.url}: the Hub's listing is not JSON: {exc}") from None
        if not isinstance(document, list):
            raise RemoteError(f"{where.url}: the Hub's listing is not a list of files")
        return [item for item in document if isinstance(item, dict) and isinstance(item.get("path"), str)]

    top = listed(directory)
    prefix = f"{directory}/" if directory else ""
    # A folder is asked for by its name: one plain part below the directory, or not at all (its files
    # would not be the view's).
    folders = [
        item["path"]
        for item in top
        if item.get("type") == "directory"
        and item["path"].startswith(prefix)
        and path_problem(item["path"][len(prefix) :], max_depth=1) is None
    ]
    items = top[:MAX_LISTED]
    for folder in sorted(folders)[:subdirectories]:  # at most MAX_LISTED in all: a lying Hub's bound
        if len(items) >= MAX_LISTED:
            break
        items += listed(folder)[: MAX_LISTED - len(items)]
    entries: Listed = []
    for item in items:
        if item.get("type") != "file" or not item["path"].startswith(prefix):
            continue
        size = item.get("size")
        if not isinstance(size, int) or isinstance(size, bool):
            size = -1  # no size: said where it is used
        entries.append((str(item["path"]).removeprefix(prefix), size, 0.0, None))
    return files_of(entries)
