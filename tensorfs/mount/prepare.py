"""What a mount serves, made ready from its Source (in the command, after the daemon is forked:
obstore, for a remote model, cannot be used across a fork): the validated model, what checks it
(the manifest, the hashes), and what its model directory view holds besides its tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidModelError, TensorfsError
from ..hashcache import HashCache
from ..integrity import Hasher, Integrity
from ..manifest import DEFAULT_MANIFEST
from ..model import Model
from ..names import Layout
from ..progress import Progress
from ..selection import Selection
from ..source import Source
from ..views import ViewSpec


def hash_with_progress(model: Model, cache: HashCache) -> dict[str, str]:
    """Every tensor's SHA-256 (the cache's first), with a progress line on a terminal."""
    with Progress(model.nbytes, "hashing") as progress:
        return Hasher(model, cache).hash_all(progress=progress.advance)


def prepare(
    source: Source,
    selection: Selection,
    layout: Layout,
    manifest: Path | str | None,
    verify: str | None,
    view_shards: int,
    warn: Callable[[str], None],
) -> tuple[Model, Integrity, ViewSpec]:
    """The model validated (and with --verify all, verified), its integrity, its view's spec; the
    companion files left out are said through `warn`."""
    # The model first: its errors name it, not the manifest looked for beside it.
    model = source.open(selection, layout)
    for stand_in in model.stand_ins:
        warn(stand_in)
    try:
        integrity = _integrity(source, model, selection, manifest, verify)
        view = source.view_spec(view_shards, model.shards)
        for warning in view.warnings:
            warn(warning)
        return model, integrity, view
    except BaseException:
        model.close()
        raise


def _integrity(
    source: Source, model: Model, selection: Selection, given: Path | str | None, verify: str | None
) -> Integrity:
    cache = source.hash_cache()
    found = None if verify == "off" else source.manifest(given, selection)
    if verify is not None and verify != "off" and found is None:
        raise TensorfsError(f"--verify={verify} needs a manifest: --manifest FILE, or {DEFAULT_MANIFEST} in MODEL")
    verified: set[str] = set()
    if found is not None:
        problems = found.coverage(model)
        if problems:
            raise InvalidModelError(problems)
        if verify == "all":
            actual = hash_with_progress(model, cache)
            bad = found.mismatches(model, actual, lambda _: f"does not match {found.label}; nothing mounted")
            if bad:
                raise InvalidModelError(bad)
            verified = set(actual)
    cache.close()  # the daemon opens its own connection
    return Integrity(Hasher(model, cache), dict(found.digests) if found is not None else None, verified)
