"""What a model's view holds (views/): the model's own folder, or, where it cannot be the folder, a
synthesized view and why.

The view of a whole model is its folder: every file found beside the model (views/companions.py)
under its own name, the model's shards served through its gate, and every other weights file (a
variant, an adapter, a LoRA, a module's weights) opened and validated as a model of its own, held to
the signature the model is held to, and served through that model's gate. Those models are grouped
so that no name is held twice in one (a variant shares every name of the model it varies).

A selection, a conversion (a PyTorch checkpoint read as safetensors) and a model merged into one file
on request are synthesized: their files are made of the tensors, and their note says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..caches.hashes import HashCache
from ..caches.headers import HeaderCache
from ..catalogue.tables import Shard, owners
from ..errors import InvalidModelError, TensorfsError, printable
from ..model import Model
from ..proof.integrity import Hasher, Integrity
from ..proof.signature import SignedModel
from ..sources.store import RemoteOptions
from ..utils.identity import ShardKey, shard_name
from ..utils.names import Layout
from .locations import OpenWith, open_location

__all__ = ["Others", "ViewChoice", "ViewRequest", "open_others", "relative_path", "synthesized_because"]

log = logging.getLogger(__name__)

ViewChoice = Literal["folder", "merged"]
"""What the user asked a view to be (--view): the model's own folder, or its tensors merged."""


@dataclass(frozen=True)
class ViewRequest:
    """What the user asked of a view: `choice` (--view; None: the folder, but for a PyTorch
    checkpoint, read as safetensors), and into how many synthesized files (--view-shards; 0 chooses)."""

    choice: ViewChoice | None = None
    shards: int = 0


_OPENERS = 8  # other weights files' headers are read at once: a store's latency hidden


def synthesized_because(model: Model, request: ViewRequest) -> str | None:
    """Why the view of `model` cannot be (or is asked not to be) the model's folder; None when it is
    the folder. TensorfsError for a folder asked of what cannot be one."""
    choice, shards = request.choice, request.shards
    if not model.selection.everything:
        if choice == "folder":
            raise TensorfsError("--view folder serves a whole model: the view of a selection is synthesized")
        return f"a selection of the model's tensors ({model.selection.describe()})"
    if shards:
        if choice == "folder":
            raise TensorfsError("--view-shards cuts a synthesized file: not with --view folder")
        return f"the model's tensors in {shards} files (--view-shards {shards})"
    if choice == "merged":
        return "the model's tensors merged (--view merged)"
    if choice is None and model.format == "pytorch":
        return "a PyTorch checkpoint as safetensors, its pickle never run (--view folder serves it as it is)"
    return None


def relative_path(directory: Path | str, shard: ShardKey) -> str:
    """A file's path in the model's folder (its directory, or its URL): a shard lent by a fallback,
    which lies elsewhere, stands in under its own name."""
    if isinstance(shard, Path):
        relative = os.path.relpath(os.path.abspath(shard), os.path.abspath(directory))
        return shard.name if relative.startswith("..") else Path(relative).as_posix()
    prefix = str(directory).rstrip("/") + "/"
    return shard.removeprefix(prefix) if shard.startswith(prefix) else shard_name(shard)


@dataclass
class Others:
    """The weights files of a folder that are not the model's, opened as models of their own."""

    models: list[Model] = field(default_factory=list)
    places: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each file, by path: (1 + which model, the file's place among that model's opened shards)."""
    warnings: list[str] = field(default_factory=list)

    def close(self) -> None:
        for model in self.models:
            model.close()


def open_others(
    paths: Sequence[str],
    directory: Path | str,
    *,
    locate: Callable[[str], Path | str],
    layout: Layout,
    remote: RemoteOptions,
    headers: Callable[[], HeaderCache],
    signed: SignedModel | None,
    hashes: HashCache,
    manifest: str | None,
    beside: Mapping[str, Mapping[str, str]] = {},
) -> Others:
    """Open and validate each of `paths` (files of the folder `directory`; `locate(path)` says where
    it is) as a model of its own; held to `signed` (SignatureError if one is not the signed file),
    or, when the model is held to a manifest (`manifest`: its label), to what it says of each file
    (`beside`: by file, then tensor): a file it says nothing of is said to be covered by none and
    served unchecked, one it says something of must have every tensor in it (else it is left out,
    with a warning). A file that is not a valid model is left out, with a warning naming it and why."""
    found = Others()
    if not paths:
        return found

    def one(path: str) -> Model | InvalidModelError:
        try:
            return open_location(locate(path), OpenWith(layout, remote, headers))
        except InvalidModelError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(_OPENERS, len(paths))) as pool:
        opened = list(pool.map(one, paths))
    try:
        models: list[Model] = []
        checked: set[int] = set()  # (ids of) the models held to what the manifest says of their files
        seen: set[str] = set()
        for path, result in zip(paths, opened, strict=True):
            if isinstance(result, InvalidModelError):
                found.warnings.append(f"{printable(str(locate(path)))}: left out of the view: {_first(result)}")
                continue
            files = {relative_path(directory, shard) for shard in result.shards}
            if files & seen:  # the parts of a multi-file GGUF, each opened with all of them
                result.close()
                continue
            seen |= files
            if manifest is not None and files & beside.keys():
                _, lacking = _expected(result, directory, beside)
                if lacking is not None:
                    found.warnings.append(
                        f"{printable(str(locate(path)))}: left out of the view: tensor '{printable(lacking)}' is not "
                        f"in {printable(manifest)}, which lists the file's other tensors"
                    )
                    result.close()
                    continue
                checked.add(id(result))
            models.append(result)
        # A group is one gate: models held to the manifest and models it says nothing of are never one.
        held = _grouped([model for model in models if id(model) in checked], directory, layout)
        found.models = held + _grouped([model for model in models if id(model) not in checked], directory, layout)
        models = []
        for model in held:
            assert manifest is not None
            values, _ = _expected(model, directory, beside)
            model.gate.set_integrity(Integrity(Hasher(model, hashes), values, label=manifest))
        for k, model in enumerate(found.models, 1):
            for place, shard in enumerate(model.opened_shards()):
                relative = relative_path(directory, shard.header.path)
                if relative in paths:
                    found.places[relative] = (k, place)
            if signed is not None:
                from ..proof.signed_model import Holding, hold_to

                holding = Holding(directory, remote, hashes, one_file=False, fallbacks=model.fallbacks is not None)
                model.gate.set_integrity(hold_to(model, signed, directory, Hasher(model, hashes), holding))
                model.signed = signed
        uncovered = sorted(path for path in found.places if path not in beside)
        if manifest is not None and uncovered:
            shown = ", ".join(printable(path) for path in uncovered[:4])
            more = f" and {len(uncovered) - 4} more" if len(uncovered) > 4 else ""
            found.warnings.append(
                f"{shown}{more}: weights files beside the model, not covered by {printable(manifest)}: served as "
                "validated, their tensors unchecked"
            )
    except BaseException:
        found.close()
        for model in models:  # those not grouped yet
            model.close()
        raise
    return found


def _expected(
    model: Model, directory: Path | str, beside: Mapping[str, Mapping[str, str]]
) -> tuple[dict[str, str], str | None]:
    """What the manifest says of the model's tensors (`beside`: by file, then tensor), and the first
    tensor it says nothing of (None: it covers them all)."""
    values: dict[str, str] = {}
    for name in model.sorted_names:
        digest = beside.get(relative_path(directory, model.info(name).shard), {}).get(name)
        if digest is None:
            return values, name
        values[name] = digest
    return values, None


def _first(error: InvalidModelError) -> str:
    problems = error.problems
    said = problems[0].reason if problems else str(error)
    return said + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")


def _grouped(models: list[Model], source: ShardKey, layout: Layout) -> list[Model]:
    """The models' shards as few models as hold no name twice: each model's shards go into the first
    group none of whose names they hold (a variant and the model it varies never share one)."""
    if len(models) <= 1:
        return models
    groups: list[tuple[set[str], list[Shard]]] = []
    for model in models:
        names = set(model.sorted_names)
        group = next((group for group in groups if group[0].isdisjoint(names)), None)
        if group is None:
            groups.append((names, list(model.opened_shards())))
        else:
            group[0].update(names)
            group[1].extend(model.opened_shards())
    for model in models:
        model.gate.close()  # its shards are its group's now, watched by the group's gate
    return [Model(source, shards, owners(shards), layout) for _, shards in groups]
