"""What a mount serves, made ready from its Source (in the command, after the daemon is forked:
obstore, for a remote model, cannot be used across a fork): the model, opened and held to its
manifest as any model is (opener.py), and what its model directory view holds besides its tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..model import Model
from ..names import Layout
from ..opener import Beside, Source, Verify
from ..selection import Selection
from ..signing import Signature
from ..views import ViewSpec


def prepare(
    source: Source,
    selection: Selection,
    layout: Layout,
    manifest: Path | str | None,
    verify: Verify | None,
    view_shards: int,
    warn: Callable[[str], None],
    progress: bool = True,
    signature: Signature | None = None,
) -> tuple[Model, ViewSpec]:
    """The model validated (and with --verify all, verified: a progress line on a terminal for both
    unless not `progress`), and its view's spec; what its fallbacks stand in for and the companion
    files left out are said through `warn`."""
    # The model first: its errors name it, not the manifest looked for beside it.
    held_to = manifest if manifest is not None else Beside.IF_ANY
    model = source.open(selection, layout, manifest=held_to, verify=verify, progress=progress, signature=signature)
    try:
        for stand_in in model.stand_ins:
            warn(stand_in)
        view = source.view_spec(view_shards, model.shards, model.signed)
        for warning in view.warnings:
            warn(warning)
        model.gate.integrity.hasher.cache.close()  # the daemon opens its own connection
        return model, view
    except BaseException:
        model.close()
        raise
