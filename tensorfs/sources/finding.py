"""Which objects of a store are a model, and what is beside it: its shards found (its file, its index,
or its directory's listing handed to the loaders' rules, choosing.py), the objects in its directory
(for its companion files), each listing bounded and every name it gives gated (utils/names.py) before
anything is made of it."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from ..errors import AccessDenied, Problem, RemoteError, TooLarge, printable
from ..formats import is_weights_name
from ..utils.names import path_problem
from .choosing import MAX_COMPONENTS, PIPELINE_INDEX, Choice, choose, component, is_pipeline
from .client import MAX_LISTED, Deadline, exists, get_whole, list_objects, modified, reason_of
from .index import MAX_INDEX_BYTES, is_index_name, parse_weight_map, shard_names
from .store import ObjectRef, RemoteOptions, StoreSpec, store_spec

__all__ = ["Listed", "Located", "beside", "files_of", "hub_listing", "listing_beside", "locate", "pipeline_folders"]


@dataclass
class Located:
    """A remote model's shards, and the index's weight map when there is one."""

    shards: list[ObjectRef]
    weight_map: dict[str, str] | None = None
    index_label: str | None = None
    parts: tuple[tuple[str, ...], ...] = ()
    """A directory of several models (choosing.Choice.parts), opened as one tree's: each one's files."""


def locate(source: str, options: RemoteOptions, problems: list[Problem], *, several: bool = False) -> Located:
    """The shards of the remote model at `source` (its file, its index, or its directory's model as
    choosing.py says, the same as a local directory's), problems said; with `several`, a directory
    of several models is every one's files (Located.parts), else a problem."""
    spec, key = store_spec(source, options)
    if is_weights_name(key):
        return Located([ObjectRef(spec, key)])
    if is_index_name(key):
        return _from_index(ObjectRef(spec, key), problems)
    prefix = f"{key}/" if key else ""
    where = spec.url(key) + "/" if spec.kind == "s3" else spec.url(key)  # a prefix; a repository (or its folder)
    try:
        choice = _choose(source, options, spec, prefix, where)
    except RemoteError as exc:
        problems.append(Problem(where, reason_of(exc, where)))
        return Located([])
    if choice.index is not None:
        return _from_index(ObjectRef(spec, prefix + choice.index), problems)
    if several and choice.parts:
        files = [ObjectRef(spec, prefix + name) for part in choice.parts for name in part]
        return Located(files, parts=choice.parts)
    if choice.problem is not None:
        problems.append(Problem(where, choice.problem))
    return Located([ObjectRef(spec, prefix + name) for name in choice.files])


def _choose(source: str, options: RemoteOptions, spec: StoreSpec, prefix: str, where: str) -> Choice:
    """The model of a directory in a store, chosen from its listing (S3's, or the Hub's API), or from
    the names loaders look for, asked after one by one where there is none (a bucket listing more than
    MAX_LISTED, or that this user may not list; a Hub mirror without the API). RemoteError when the
    store cannot say."""

    def there(name: str) -> bool:
        return exists(ObjectRef(spec, prefix + name))

    if spec.kind == "s3":
        try:
            listed, more = list_objects(spec, prefix)
        except AccessDenied:  # one may read objects and not list them: S3 then says 403 for a missing key
            choice = choose(None, where, lambda name: _readable(ObjectRef(spec, prefix + name)))
            if choice.problem is None:
                return choice
            raise
        names = None if more else _names_in(sorted(str(meta["path"]) for meta in listed), prefix)
        choice = choose(names, where, there)
        if more and choice.problem is not None:  # said, or the listing's bound passes unseen
            return replace(choice, problem=f"over {MAX_LISTED} objects under this prefix; {choice.problem}")
        return choice
    try:
        names = [path for path, *_ in _hub_files(source, options, 1, 0)[0] if "/" not in path]
    except AccessDenied:
        raise
    except (FileNotFoundError, RemoteError) as exc:  # no such repository or revision; or a mirror without the API
        choice = choose(None, where, there)
        if choice.problem is None:
            return choice
        if isinstance(exc, FileNotFoundError):
            raise RemoteError(f"{where}: {_not_on_the_hub(source, options)}") from None
        raise
    return choose(names, where, there)


def _readable(ref: ObjectRef) -> bool:
    """Whether the object is there for whoever may not list its bucket (a 403 is none)."""
    try:
        return exists(ref)
    except AccessDenied:
        return False


def _names_in(keys: list[str], prefix: str) -> list[str]:
    """The names of the files directly under `prefix` of a listing's keys, each gated (utils/names.py):
    one that is not a plain name is no file of the model's (a directory marker, a key with '..')."""
    names = []
    for key in keys:
        name = key[len(prefix) :]
        if name and "/" not in name and path_problem(name, max_depth=1) is None:
            names.append(name)
    return names


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


def beside(source: str, name: str, options: RemoteOptions) -> ObjectRef:
    """The object named `name` in the remote model's directory (its prefix, or its file's directory)."""
    spec, key = store_spec(source, options)
    if is_weights_name(key) or is_index_name(key):
        return ObjectRef(spec, key).sibling(name)
    return ObjectRef(spec, f"{key}/{name}" if key else name)


def directory_url(source: str, options: RemoteOptions) -> str:
    """The URL of a remote model's directory (its prefix, or its file's or index's directory), which
    names in it are relative to; no '/' at its end."""
    return beside(source, "x", options).url.removesuffix("/x")


Listed = list[tuple[str, int, float, str | None]]
"""Objects of a model's directory: (path in it, size, mtime, ETag if known)."""


def listing_beside(
    source: str,
    options: RemoteOptions,
    depth: int = 1,
    *,
    whole: bool = False,
    keep: Callable[[str], bool] = lambda path: True,
) -> Listed | None:
    """The objects in a remote model's directory and its subdirectories, to `depth` levels (1: the
    directory's own), those the caller would `keep` (by path), for a store that lists (S3); None for
    one that does not (HTTP, the Hub). RemoteError when a listing fails; what is past MAX_LISTED
    objects is left out, but for a caller that needs the `whole` of it (RemoteError then, saying so)."""
    spec, _ = store_spec(source, options)
    if spec.kind != "s3":
        return None
    directory = beside(source, "x", options).key.rpartition("/")[0]
    top = f"{directory}/" if directory else ""
    deadline = Deadline.after(spec.timeout)  # the listing's, and the HEADs that tell its markers
    listed, cut = list_objects(spec, top, deadline)
    if cut and whole:
        raise RemoteError(f"{spec.url(top)}: over {MAX_LISTED:,} objects: its listing, cut there, is not the whole")
    entries = [
        (str(meta["path"]).removeprefix(top), int(meta["size"]), modified(meta), str(meta.get("e_tag") or "") or None)
        for meta in listed
    ]
    entries = [entry for entry in files_of(entries) if entry[0].count("/") < depth and keep(entry[0])]
    # A folder marker (`m/2_Dense/`, as the S3 console makes) comes without its '/' (the client drops
    # it): one with files beneath it is a folder; another empty key is asked for (a HEAD apiece,
    # within the listing's deadline): an empty file is there, a marker's name without its '/' is not.
    folders: set[str] = set()
    for path, *_ in entries:
        parts = path.split("/")
        folders.update("/".join(parts[:level]) for level in range(1, len(parts)))
    found: Listed = []
    for entry in entries:
        if entry[1] == 0:
            if entry[0] in folders:
                continue
            deadline.check(spec.url(top), "listing")
            if not exists(ObjectRef(spec, top + entry[0])):
                continue
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


MAX_FOLDERS_LISTED = 200
"""The folders of a Hub model's directory listed for its files (a listing each, after the top's)."""
MAX_HUB_LISTING = 16 << 20
"""The most one answer of the Hub's listing API may hold."""


def hub_listing(
    source: str, options: RemoteOptions, depth: int = 1, folders: int = MAX_FOLDERS_LISTED
) -> tuple[Listed, str | None] | None:
    """The files of a Hub model's directory and its folders, to `depth` levels (1: the directory's
    own), as its API lists them ({HF_ENDPOINT}/api/models/ORG/NAME/tree/REVISION/PATH), a listing a
    folder, and what of them was left out (past `folders` folders, MAX_LISTED files or the listing's
    deadline; None: nothing); None for a source that is not on the Hub. RemoteError when the listing
    fails."""
    if not source.startswith("hf://"):
        return None
    try:
        return _hub_files(source, options, depth, folders)
    except FileNotFoundError as exc:
        raise RemoteError(f"{exc}: the Hub's listing of the model's files is not there (404)") from None


def _hub_api(source: str, options: RemoteOptions) -> tuple[StoreSpec, str, str, str]:
    """(the Hub's API, the repository, the revision, the model's directory in it) of an hf:// source."""
    spec, key = store_spec(source, options)
    repo, _, revision = spec.scheme_root.removeprefix("hf://").partition("@")
    endpoint = spec.root.removesuffix(f"/{repo}/resolve/{revision}")
    api = StoreSpec("http", f"{endpoint}/api/models", f"{endpoint}/api/models", headers=spec.headers,
                    timeout=spec.timeout)  # fmt: skip
    directory = key.rpartition("/")[0] if is_weights_name(key) or is_index_name(key) else key
    return api, repo, revision, directory


def _hub_files(source: str, options: RemoteOptions, depth: int, folders: int) -> tuple[Listed, str | None]:
    """hub_listing's files; FileNotFoundError (its URL) when the repository, its revision or the
    directory is not there, or the Hub's API is not (a mirror that serves files only)."""
    api, repo, revision, directory = _hub_api(source, options)
    deadline = Deadline.after(api.timeout)  # one for the top listing and every folder's

    def listed(path: str) -> list[dict[str, Any]]:
        where = ObjectRef(api, f"{repo}/tree/{revision}/{path}" if path else f"{repo}/tree/{revision}")
        try:
            document = orjson.loads(get_whole(where, MAX_HUB_LISTING))
        except FileNotFoundError:
            raise FileNotFoundError(where.url) from None
        except orjson.JSONDecodeError as exc:
            raise RemoteError(f"{where.url}: the Hub's listing is not JSON: {exc}") from None
        if not isinstance(document, list):
            raise RemoteError(f"{where.url}: the Hub's listing is not a list of files")
        return [item for item in document if isinstance(item, dict) and isinstance(item.get("path"), str)]

    prefix = f"{directory}/" if directory else ""

    def folders_in(items: list[dict[str, Any]]) -> list[str]:
        # A folder is asked for by its name: plain parts below the directory, less deep than `depth`
        # (its files would not be the view's otherwise).
        return sorted(
            item["path"]
            for item in items
            if item.get("type") == "directory"
            and item["path"].startswith(prefix)
            and path_problem(item["path"][len(prefix) :], max_depth=depth - 1) is None
        )

    items = listed(directory)[:MAX_LISTED]
    todo = collections.deque(folders_in(items) if depth > 1 else [])
    done = 0  # folders listed, breadth first (the top's first: what a loader needs most lies there)
    while todo and done < folders and len(items) < MAX_LISTED and not deadline.passed():
        found = listed(todo.popleft())[: MAX_LISTED - len(items)]
        items += found
        todo += folders_in(found)
        done += 1
    cut = None
    if todo:
        where = ObjectRef(api, f"{repo}/tree/{revision}/{directory}".rstrip("/")).url
        cut = (
            f"{printable(where)}: {len(todo)} folders not listed (past {folders} folders, "
            f"{MAX_LISTED:,} files or the listing's time): their files are left out"
        )
    entries: Listed = []
    for item in items:
        if item.get("type") != "file" or not item["path"].startswith(prefix):
            continue
        size = item.get("size")
        if not isinstance(size, int) or isinstance(size, bool):
            size = -1  # no size: said where it is used
        entries.append((str(item["path"]).removeprefix(prefix), size, 0.0, None))
    return files_of(entries), cut


def _not_on_the_hub(source: str, options: RemoteOptions) -> str:
    """Why a Hub model whose files cannot be listed, and has none of the names loaders look for, is not
    there: no such repository, or no such revision of it (the repository's own page of the API says)."""
    api, repo, revision, directory = _hub_api(source, options)
    try:
        get_whole(ObjectRef(api, repo), MAX_HUB_LISTING)
    except (FileNotFoundError, RemoteError):
        endpoint = api.root.removesuffix("/api/models")
        return f"no repository {repo} on {endpoint} (a private or gated one needs a token: HF_TOKEN)"
    if directory:
        return f"no directory {directory} in revision {revision} of {repo}"
    return f"{repo} has no revision {revision} (a branch, a tag or a commit)"


def pipeline_folders(source: str, options: RemoteOptions, *, own_weights: bool = False) -> list[str] | None:
    """The component folders (those holding weights, sorted) of the diffusers pipeline whose root is
    the remote directory `source`, or None when it is none (choosing.is_pipeline; `own_weights`: its
    root may hold weights of its own too): model_index.json is asked for first (one HEAD), then the
    directory listed (S3's listing, or the Hub's API) one level down. None too when the store cannot
    say (opening the directory as a model says why)."""
    spec, key = store_spec(source, options)
    if is_weights_name(key) or is_index_name(key) or (spec.kind != "s3" and not source.startswith("hf://")):
        return None
    try:
        if not exists(beside(source, PIPELINE_INDEX, options)):
            return None
        hub = hub_listing(source, options, 2, MAX_COMPONENTS)
        listed = listing_beside(source, options, 2) if hub is None else hub[0]
    except (RemoteError, FileNotFoundError):
        return None
    by_folder: dict[str, list[str]] = {}
    for path, *_ in listed or []:
        if path_problem(path, max_depth=2) is None:  # the one gate of names from outside
            folder, _, name = path.rpartition("/")
            by_folder.setdefault(folder, []).append(name)
    if not is_pipeline(by_folder.get("", []), beside=own_weights):
        return None
    root = spec.url(key).rstrip("/")
    return sorted(
        folder
        for folder, names in by_folder.items()
        if folder and not folder.startswith(".") and component(names, f"{root}/{folder}") is not None
    )[:MAX_COMPONENTS]
