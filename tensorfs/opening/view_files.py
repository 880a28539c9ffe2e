"""Which files a model's view holds, and why: the one home of that rule (views/ finds and serves them).

The view of a whole model is its own folder: every file of it (views/local_files.py and
remote_files.py find them, as far as ViewRule takes them) under its own name, the model's shards
served through its gate, and every other weights file (a variant, an adapter, a LoRA, a module's
weights) opened and validated as a model of its own, held to the signature or the manifest the
model is held to, and served through that model's gate. Those models are grouped so that no name is
held twice in one (a variant shares every name of the model it varies).

A selection, a conversion (a PyTorch checkpoint read as safetensors) and a model merged into one file
on request are synthesized: their files are made of the tensors, and their note says so; they take
the folder's other files, but for the weights the synthesized files stand for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..caches.hashes import HashCache
from ..caches.headers import HeaderCache
from ..catalogue.tables import Shard, owners
from ..errors import InvalidModelError, TensorfsError, printable
from ..formats import NAME, is_weights_name, pytorch
from ..model import Model
from ..proof.integrity import Hasher, Integrity
from ..proof.manifest import DEFAULT_MANIFEST
from ..proof.signature import DEFAULT_SIGNATURE, SignedModel
from ..sources.choosing import is_adapter, is_model_file, view_name
from ..sources.store import RemoteOptions, redact
from ..utils.identity import ShardKey, shard_name
from ..utils.names import Layout
from .locations import OpenWith, open_location
from .source import Source, hash_all

if TYPE_CHECKING:
    from ..views import ViewSpec
    from ..views.companions import FolderFiles

__all__ = [
    "LEFT_OUT", "Others", "ViewChoice", "ViewRequest", "ViewRule", "digests_beside", "is_weights_file", "open_others",
    "relative_path", "synthesized_because", "view_of",
]  # fmt: skip

log = logging.getLogger(__name__)

ViewChoice = Literal["folder", "merged"]
"""What the user asked a view to be (--view): the model's own folder, or its tensors merged."""


@dataclass(frozen=True)
class ViewRequest:
    """What the user asked of a view: `choice` (--view; None: the folder, but for a PyTorch
    checkpoint, read as safetensors), and into how many synthesized files (--view-shards; 0 chooses)."""

    choice: ViewChoice | None = None
    shards: int = 0


LEFT_OUT = (".git",)
"""Folders a view never takes: a git repository's own files (its history, its LFS objects: every
weight again), not the model's."""


def is_weights_file(path: str) -> bool:
    """Whether a file of a model's folder is weights a view serves through a gate of its own, by its
    name: a safetensors or GGUF file, a checkpoint named as a model's (choosing.is_model_file), an
    adapter's. Other .bin, .pt and .pth files (ONNX external data, an optimizer's state) are plain files."""
    name = path.rpartition("/")[2]
    if name.endswith(pytorch.SUFFIXES):
        return is_model_file(name) or is_adapter(name)
    return is_weights_name(name)


@dataclass(frozen=True)
class ViewRule:
    """Which files of a model's folder its view takes, by their paths there (views.FileRule: what
    the finders ask). `folder`: a view of the model's own folder (else synthesized); `components`:
    the folders a synthesized view's models come from (a pipeline's components); `only_weights`: the
    weights files of the folder alone (what a manifest of the folder hashes: no companion opened)."""

    folder: bool
    components: tuple[str, ...] = ()
    only_weights: bool = False

    def left_out(self, path: str) -> str | None:
        """Why a file or folder is never taken, nor looked into (None: it may be)."""
        return "a git repository's own files" if any(part in LEFT_OUT for part in path.split("/")) else None

    def takes(self, path: str) -> bool:
        """Whether the view holds the file: hidden ones too, never one LEFT_OUT. A view of the folder
        takes every other file (its weights among them). A synthesized view makes its own weights:
        not the model's own weights or their index at the top of the folder (choosing.is_model_file:
        an adapter is a companion, and so are the weights of a subdirectory, a sentence-transformers
        module's), nor the manifest of the source's tensors (it would not match a selection of them),
        nor the weights of a pipeline's component folders, which are models of their own."""
        if self.left_out(path) is not None:
            return False
        if self.folder:
            return not self.only_weights or is_weights_file(path)
        where, _, name = path.rpartition("/")
        if where in self.components:
            return not is_model_file(name)
        return "/" in path or not (is_model_file(path) or path == DEFAULT_MANIFEST)

    def weights(self, path: str) -> bool:
        """Whether a file the view takes is served as a model of its own (a view of the folder's
        weights files), not read as bytes."""
        return self.folder and is_weights_file(path)


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


def view_of(source: Source, model: Model, request: ViewRequest | None = None) -> tuple[ViewSpec, Others]:
    """What the view of `model` (opened from `source`) holds besides its tensors, and the models
    opened for it (the other weights files of its folder: the caller closes them).

    The view of a whole model is its own folder, unless the `request` is "merged" or
    cuts its tensors into files, or the model is a PyTorch checkpoint (read as safetensors, unless
    the request is "folder"); a selection's is synthesized. Companion files
    left out are the spec's warnings. A model held to a signature has its files' bytes held to
    it: each companion's must be the signed one (SignatureError naming those that are not), the
    other weights files' are held to it as the model's are, and the signature itself is served
    in the folder, as it was verified."""
    from ..views import ViewSpec

    request = request or ViewRequest()
    why = synthesized_because(model, request)
    weights = model.shards
    # A synthesized view gives each model of several (a pipeline's components) a folder of its own,
    # and serves none of the weights files of the folders they come from (they would not match it).
    folders = [] if why is None else list(model.parts)
    holding = sorted({os.path.dirname(file) for files in model.parts.values() for file in files} - {""})
    signed = model.signed
    # A signed model's files are those its signature names (at any depth, hidden ones too), itself too.
    wanted = None if signed is None else [name for name in (*signed.files, signed.path) if name not in (None, ".")]
    rule = ViewRule(folder=why is None, components=tuple(holding))
    found = _found(source, model, rule, wanted)
    companions = found.companions
    if signed is not None:
        from ..views.signed import signed_companions

        # (offline, no companion is fetched: none is missing for that)
        remote = source.is_remote and not source.remote.offline
        companions = signed_companions(signed, companions, remote=remote, rule=rule)
    warnings = found.warnings
    unverified = None if signed is not None else next((c.path for c in companions if c.path == DEFAULT_SIGNATURE), None)
    if unverified is not None:  # said once: the view serves it as any file, and nothing checked it
        warnings.append(
            f"{printable(redact(str(source.in_folder(unverified))))}: a signature beside the model, not verified "
            "(--public-key or --certificate-chain holds the model to it): served as any file of the folder"
        )
    if why is not None:
        components = {name: view_name(model.parts[name]) for name in folders}
        name = view_name([shard_name(weight) for weight in weights])
        note = _note(source, model)
        spec = ViewSpec(
            companions, request.shards, warnings, found.directories, name, components, why=why, note=note,
            unverified=unverified,
        )  # fmt: skip
        if signed is not None:
            warnings.append(
                f"the view of {source.shown} is synthesized ({why}): the signature {signed.label} covers the "
                "model's files, not the view's"
            )
        return spec, Others()
    integrity = model.gate.integrity
    manifest = integrity.label if integrity.expected is not None and signed is None else None
    places, others = _others(source, model, found.weights, signed, manifest)
    warnings += others.warnings
    weights_files = {**places, **others.places}
    spec = ViewSpec(
        companions, 0, warnings, found.directories, folder=True, weights=weights_files, unverified=unverified
    )
    return spec, others


def digests_beside(
    source: Source, model: Model, *, progress: bool = False
) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The SHA-256 of every tensor of the weights files beside `model` (those its view serves as
    other models: variants, adapters, other checkpoints), by file (its path in the folder), then
    tensor; and what was left out of them (a file that is no valid model). Nothing for a model
    named by its file, or a selection of one."""
    if source.is_one_shard or not model.selection.everything:
        return {}, []
    found = _found(source, model, ViewRule(folder=True, only_weights=True))
    _, others = _others(source, model, found.weights, None, None)
    try:
        digests: dict[str, dict[str, str]] = {}
        for other in others.models:
            for name, digest in hash_all(other, other.gate.integrity.hasher, progress=progress, proving=False).items():
                digests.setdefault(relative_path(source.folder, other.info(name).shard), {})[name] = digest
        return digests, others.warnings
    finally:
        others.close()


def _found(source: Source, model: Model, rule: ViewRule, wanted: list[str] | None = None) -> FolderFiles:
    """The files of the model's folder the `rule` takes, found where the model is (views/)."""
    if isinstance(source.location, str):
        from ..views.remote_files import find_remote_companions

        return find_remote_companions(source.location, source.remote, rule, own=model.shards, wanted=wanted or ())
    from ..views.local_files import find_companions

    return find_companions(source.location, rule, own=model.shards, wanted=wanted)


def _others(
    source: Source, model: Model, weights: list[str], signed: SignedModel | None, manifest: str | None
) -> tuple[dict[str, tuple[int, int]], Others]:
    """Where each of the model's own files is in its folder (ViewSpec.weights: model 0), and the other
    `weights` files of the folder opened as models of their own (open_others)."""
    directory = source.folder
    places = {relative_path(directory, shard.header.path): (0, k) for k, shard in enumerate(model.opened_shards())}
    # Beside a model named by its file, other weights files are other models: not the folder's to open.
    beside_it = [] if source.is_one_shard else [path for path in weights if path not in places]
    others = open_others(
        beside_it,
        directory,
        locate=source.in_folder,
        layout=model.layout,
        remote=source.cache.remote(source.remote),
        headers=source.cache.headers,
        signed=signed,
        hashes=source.cache.hashes(),
        manifest=manifest,
        beside=model.manifest_beside,
    )
    return places, others


def _note(source: Source, model: Model) -> dict[str, str | None]:
    """What a synthesized view's note says besides why: the source, the selection, the signature."""
    signed = model.signed
    where = source.location if isinstance(source.location, str) else os.path.abspath(source.location)
    return {
        "source": printable(redact(str(where))),  # (a note read elsewhere: no path relative to a shell)
        "selection": None if model.selection.everything else model.selection.describe(),
        "signature": None if signed is None else f"the signature {signed.label} covers the source's files, not these",
    }


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
    for shard in model.opened_shards():  # (a file's path found once, not once a tensor)
        listed = beside.get(relative_path(directory, shard.header.path), {})
        for entry in shard.header.entries:
            digest = listed.get(entry[NAME])
            if digest is None:
                return values, entry[NAME]
            values[entry[NAME]] = digest
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
