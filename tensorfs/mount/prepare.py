"""What a mount serves, made ready from its Source (in the command, after the daemon is forked:
obstore, for a remote model, cannot be used across a fork): the model, opened and held to its
manifest as any model is (opening/source.py), and what its model directory view holds besides its tensors
(with the models opened for it: the other weights files of the model's folder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..model import Model
from ..opening.source import ManifestBeside, Source, Verify
from ..opening.view_files import ViewRequest, view_of
from ..proof.signature import Signature
from ..selection import Selection
from ..utils.names import Layout
from ..views import ViewSpec


@dataclass
class Served:
    """What a mount serves: the model, its view's spec, and the other models the view serves files of."""

    model: Model
    view: ViewSpec
    others: list[Model] = field(default_factory=list)

    def close(self) -> None:
        for model in (self.model, *self.others):
            model.close()


@dataclass(frozen=True)
class Opening:
    """How the mount opens its source: what it serves of it, and what it holds it to."""

    selection: Selection
    layout: Layout
    manifest: Path | str | None = None
    verify: Verify | None = None
    signature: Signature | None = None
    view: ViewRequest = field(default_factory=ViewRequest)


def prepare(source: Source, opening: Opening, warn: Callable[[str], None], progress: bool = True) -> Served:
    """The model validated (and with --verify all, verified: a progress line on a terminal for both
    unless not `progress`), and its view's spec; what its fallbacks stand in for and the companion
    files left out are said through `warn`."""
    # The model first: its errors name it, not the manifest looked for beside it.
    held_to = opening.manifest if opening.manifest is not None else ManifestBeside.IF_ANY
    model = source.open(
        opening.selection,
        opening.layout,
        manifest=held_to,
        verify=opening.verify,
        progress=progress,
        signature=opening.signature,
    )
    try:
        for stand_in in model.stand_ins:
            warn(stand_in)
        view, others = view_of(source, model, opening.view)
        for warning in view.warnings:
            warn(warning)
        for held in (model, *others.models):
            held.gate.integrity.hasher.cache.close()  # the daemon opens its own connection
        return Served(model, view, others.models)
    except BaseException:
        model.close()
        raise
