"""Finding, reading, validating and mapping a model's shards: the model at a location, local or
remote, one model or a diffusers pipeline's components, its rules across shards checked and what
fallbacks stand in for. source.py's Source is the way in (its caches, manifest and companions).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..caches.headers import WORTH_CACHING, HeaderCache
from ..catalogue.assembly import check_model
from ..catalogue.fallbacks import Fallbacks
from ..catalogue.tables import Shard, opened_for, owners
from ..errors import InvalidModelError, Problem, RemoteError, printable
from ..model import Model
from ..selection import Selection
from ..sources.choosing import NO_COMPONENT
from ..sources.finding import pipeline_folders
from ..sources.local import FoundShards, LocalDescription, LocalShard, find_pipeline, find_shards
from ..sources.store import RemoteOptions, is_remote
from ..utils.gcpause import gc_paused
from ..utils.identity import ShardKey, shard_name
from ..utils.names import Layout
from ..utils.progress import Progress
from .pipelines import open_pipeline
from .repository import checked_parts, model_of, parts_of

log = logging.getLogger(__name__)
_MAX_READERS = 8  # header reads are I/O (and GIL-bound parsing): a few threads hide disk latency


@dataclass(frozen=True)
class OpenWith:
    """What a location is opened with, passed down as one: the layout's naming rules, the remote
    options, the selection, the header cache (made when first needed), the fallbacks, a progress
    line on a terminal."""

    layout: Layout
    remote: RemoteOptions
    header_cache: Callable[[], HeaderCache]
    selection: Selection = field(default_factory=Selection)
    fallbacks: Fallbacks | None = None
    progress: bool = False
    several: bool = False
    """A folder of several models is opened as one tree's, each under its own folder
    (repository.py); else it is refused, naming the files to choose from."""


def open_location(path: Path | str, how: OpenWith) -> Model:
    """The model at `path`: every shard found, read, validated and mapped (a progress line on a
    terminal when asked), the rules across shards checked; the selection's tensors.
    InvalidModelError naming every problem found. A diffusers pipeline's root is the models of its
    component folders, each opened so (pipelines.py); with `how.several`, with the models of its own
    files beside them (a repository's single-file checkpoints: repository.py)."""
    found = find_pipeline(path, beside=how.several) if isinstance(path, Path) else None
    components, beside = found if found is not None else (None, False)
    opened: Model | None = None  # a remote root's own models, when it is a pipeline's too
    if isinstance(path, str):
        # A remote directory is asked whether it is a pipeline only once it is no model, or several
        # (single-file checkpoints at a pipeline's root: a Stable Diffusion 1.5-style repository).
        try:
            opened = _open_model(path, how)
        except InvalidModelError as exc:
            no_component = [p.reason for p in exc.problems] == [NO_COMPONENT]
            components = pipeline_components(path, how.remote) if no_component else None
            if not components:
                raise
        else:
            components = (
                pipeline_components(path, how.remote, own_weights=True) if how.several and opened.parts else None
            )
            if not components:
                return opened
            beside = True
    if components:
        if how.fallbacks is not None:  # (a remote root of several models took none: `opened` is None)
            raise InvalidModelError([Problem(str(path), "a pipeline takes no fallback: name a component's folder")])
        whole = replace(how, selection=Selection(), fallbacks=None)
        opening = functools.partial(open_location, how=whole)
        if opened is not None and not how.selection.everything:
            opened.close()
            opened = None
        root = (opened or _open_model(path, whole)) if beside else None
        try:
            return open_pipeline(
                path, components, lambda folder: opening(_folder(path, folder)), how.selection, how.layout, root
            )
        except BaseException:
            if root is not None:
                root.close()
            raise
    return _open_model(path, how)


def _open_model(path: Path | str, how: OpenWith) -> Model:
    """The one model at `path` (see open_location)."""
    layout, remote, selection, fallbacks, progress = how.layout, how.remote, how.selection, how.fallbacks, how.progress
    problems: list[Problem] = []
    failed: dict[str, list[Problem]] = {}  # shards that could not be opened, by file name
    headers = how.header_cache()
    found: FoundShards | None = None  # a local model's files
    with gc_paused(), contextlib.closing(headers):
        # Every problem is collected, of every shard and across shards, before any is reported.
        if isinstance(path, str) and is_remote(path):
            from ..sources.remote import RemoteOpener  # the stores' machinery: for a remote model only

            try:
                opener = RemoteOpener(path, remote, problems, several=how.several)
            except RemoteError as exc:
                raise InvalidModelError([Problem(path, str(exc).removeprefix(f"{path}: "))]) from None
            source: ShardKey = path
            opener.cache.db()  # the objects' cache must be usable (RemoteError if not), before the headers'
            opener.headers = headers if headers.enabled else None
            located = opener.located
            opened = _open_shards(opener.shards, opener.open, problems, failed, progress)
            weight_map, index_label, done = located.weight_map, located.index_label, opener.remember
            groups = located.parts
        else:
            source = Path(path)
            found = find_shards(source, problems, headers, several=how.several)
            weight_map, index_label, groups = found.weight_map, found.index_label, found.parts
            open_local = functools.partial(LocalShard.open, cache=headers, directory=found.directory)
            try:
                opened = _open_shards([(p, str(p)) for p in found.paths], open_local, problems, failed, progress)
            finally:
                found.close()
            failed.update({name: [problem] for name, problem in found.missing.items()})
            done = None
        stand_ins: list[str] = []
        if fallbacks is not None and failed:
            opened += _lent_by(fallbacks, failed, problems, stand_ins)
        try:
            parts = parts_of(opened, groups) if how.several and index_label is None and not failed else []
            if len(parts) > 1:
                return _several_models(source, parts, how, problems, done)
            checks = None
            if headers.enabled and found is not None and sum(s.header.data_start for s in opened) >= WORTH_CACHING:
                checks = _checks_key(source, found, opened, layout)
            owner = owners(opened) if checks is not None and headers.get("model", checks) == len(opened) else None
            if owner is None:
                if weight_map is None and index_label is not None:  # the index was known, the model not
                    again = find_shards(Path(source), [])  # (its own problems are known: none)
                    again.close()
                    weight_map = again.weight_map
                owner = check_model(opened, weight_map, index_label, layout, problems)
                if checks is not None and not problems:
                    headers.put("model", checks, len(opened))
            if problems:
                raise InvalidModelError(problems)
            if done is not None:
                done()
            if selection.everything:
                model = Model(source, opened, owner, layout, fallbacks=fallbacks)
                if headers.enabled and found is not None and not failed:
                    model.header_cache = headers.directory
            else:
                kept, owner = opened_for(opened, selection, str(path))
                model = Model(source, kept, owner, layout, selection, fallbacks=fallbacks)
            model.stand_ins = stand_ins
            return model
        except BaseException:
            for shard in opened:
                if not shard.lent:
                    shard.data.close()
            raise


def _several_models(
    source: ShardKey,
    parts: list[tuple[str, list[Shard]]],
    how: OpenWith,
    problems: list[Problem],
    done: Callable[[], None] | None,
) -> Model:
    """The models of a folder of several as one tree's, each under its own folder (repository.py)."""
    if how.fallbacks is not None:
        shown = ", ".join(f"{name}/" for name, _ in parts[:4]) + (", ..." if len(parts) > 4 else "")
        why = f"holds several models ({shown}): --fallback stands in for one model's files: name its file"
        problems.append(Problem(str(source), why))
    shards, owner = checked_parts(parts, how.layout, problems)
    if problems:
        raise InvalidModelError(problems)
    if done is not None:
        done()
    where = {name: [shard_name(shard.header.path) for shard in files] for name, files in parts}
    return model_of(source, shards, owner, how.layout, how.selection, where)


def pipeline_components(path: Path | str, remote: RemoteOptions, *, own_weights: bool = False) -> list[str] | None:
    """The component folders of the diffusers pipeline whose root `path` is (pipelines.py), or None
    (`own_weights`: its root may hold models of its own too)."""
    if isinstance(path, str):
        return pipeline_folders(path, remote, own_weights=own_weights) if not remote.offline else None
    found = find_pipeline(path, beside=own_weights)
    return found[0] if found is not None else None


def _folder(root: Path | str, folder: str) -> Path | str:
    """A folder of a model's directory, local or remote."""
    return root / folder if isinstance(root, Path) else f"{root.rstrip('/')}/{folder}"


def _checks_key(source: ShardKey, found: FoundShards, opened: list[Shard], layout: Layout) -> str | None:
    """What names a local model's checks across shards: its files' identities, the layout; None
    when some file has no identity known (then the model is checked whole)."""
    if found.index_label is not None and found.index_key is None:
        return None
    files: list[str] = []
    for shard in opened:
        description = shard.data.describe()
        if not isinstance(description, LocalDescription):
            return None
        if not description.identity.settled():
            return None
        files += [os.path.abspath(description.path), description.identity.key()]
    text = "\0".join([os.path.abspath(str(source)), layout, found.index_key or "", *files])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _open_shards(
    shards: list[tuple[Any, str]],
    open_one: Callable[..., Any],
    problems: list[Problem],
    failed: dict[str, list[Problem]],
    progress: bool = False,
) -> list[Shard]:
    """Read, validate and map every shard, in parallel (`progress`: a line on a terminal counting
    them); problems of all shards are collected (and those of each shard that failed in `failed`, by
    its file name).

    `open_one(where, label)` returns (header, ShardData) or raises InvalidModelError.
    """
    counted = Progress(len(shards), "validating", quiet=not (progress and shards), unit="shard")

    def attempt(shard: tuple[Any, str]) -> Shard | InvalidModelError:
        try:
            header, data = open_one(*shard)
        except InvalidModelError as exc:
            return exc
        finally:
            counted.advance(1)
        return Shard(header, data)

    with counted:
        if len(shards) <= 1:
            results = [attempt(shard) for shard in shards]
        else:
            with ThreadPoolExecutor(max_workers=min(_MAX_READERS, len(shards))) as pool:
                results = list(pool.map(attempt, shards))
    opened: list[Shard] = []
    for (_, label), result in zip(shards, results, strict=True):
        if isinstance(result, InvalidModelError):
            problems.extend(result.problems)
            failed[shard_name(label)] = list(result.problems)
        else:
            opened.append(result)
    return opened


def _lent_by(
    fallbacks: Fallbacks, failed: dict[str, list[Problem]], problems: list[Problem], said: list[str]
) -> list[Shard]:
    """The fallbacks' shards that stand in for those that failed (each of the same file name), their
    problems taken back and said as warnings (also in `said`); a shard no fallback has keeps its problems."""
    lent: list[Shard] = []
    for name, its_problems in failed.items():
        found = fallbacks.shard_named(name)
        if found is None:
            continue
        index, header, data = found
        lent.append(Shard(header, data, lent=True))
        for problem in its_problems:
            problems.remove(problem)
        said.append(f"{printable(str(its_problems[0]))}; its tensors are served from fallback {fallbacks.shown(index)}")
        log.warning("%s", said[-1])
    return lent
