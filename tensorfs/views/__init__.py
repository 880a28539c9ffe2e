"""Views of a model as other programs expect to find one: `.tensorfs/model/` of a mount, and `export`.

The view of a whole model is the model's own folder: every file under its own name with its own
bytes, its weights files served through the gates of the models that hold them (weights.py: the
model's shards through its gate, the other weights files beside it, a variant or an adapter,
through those of the models they are opened as), the other files as they are (companions.py).

What cannot be the folder is synthesized, and its note says so (NOTE_NAME): a selection, a
conversion (a PyTorch checkpoint served as safetensors), or the model merged into one file when
asked. A synthesized view holds the tensors as one `model.safetensors` (or several files and an
index, as transformers writes them; a GGUF model's one `model.gguf`), plus the model's companion
files (config.json, tokenizer files, ...). A selection's is named so that no loader takes it for
the whole model (PARTIAL_NAME, PARTIAL_INDEX; a GGUF's pairs say it is a part: formats/ggufparts.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import orjson

from ..sources.index import index_document
from .companions import Companion, CompanionFiles
from .synthesized import Piece, SynthesizedFile, format_of
from .weights import WeightsFile

if TYPE_CHECKING:  # the views build on the model; the model does not need them to load
    from ..catalogue.tables import Tables
    from ..gate import Gate

__all__ = [
    "NOTE_NAME", "VIEW_DIR", "Companion", "Held", "ModelView", "Piece", "SynthesizedFile", "ViewFile", "ViewSpec",
    "WeightsFile", "build_view", "split",
]  # fmt: skip

VIEW_DIR = "model"
"""The view's directory, in .tensorfs/."""
AUTO_SINGLE_LIMIT = 20 << 30
"""Up to this much tensor data, the view is one file; beyond, files of at most AUTO_SHARD_BYTES."""
AUTO_SHARD_BYTES = 5 << 30
NOTE_NAME = "tensorfs-view.json"
"""The note in a synthesized view: that it is synthesized, why, of what source and selection."""


@dataclass(frozen=True)
class ViewSpec:
    """What a view is made of besides the model (picklable: the daemon gets it with the model)."""

    companions: list[Companion] = field(default_factory=list)
    shards: int = 0
    """Synthesized files: 0 chooses (one up to 20 GiB, else files of at most 5 GiB)."""
    warnings: list[str] = field(default_factory=list)
    """Companion files left out, and why (the daemon logs them)."""
    directories: dict[str, os.stat_result] = field(default_factory=dict)
    """The source's subdirectories that companions come from: their owners and permissions."""
    name: str = "model"
    """What the synthesized files of the whole model are called, as its loader looks for them
    (sources/choosing.view_name): "model", "adapter_model" for an adapter (PEFT's), or
    "diffusion_pytorch_model" for a diffusers component."""
    components: dict[str, str] = field(default_factory=dict)
    """A pipeline's component folders, each with what its files are called: each is a folder of the
    view holding its own tensors (named without the folder), as its loader looks for them."""
    folder: bool = False
    """The view is the model's own folder: every file under its own name with its own bytes (the
    weights files where `weights` says); else it is synthesized of the model's tensors (`why`)."""
    weights: dict[str, tuple[int, int]] = field(default_factory=dict)
    """A folder view's weights files, by path: (0 for the model, k for the k-th other model opened
    for the view; the file's place among that model's opened shards). Places, not paths: a daemon
    maps the same files again, under their absolute paths."""
    why: str = ""
    """Why a synthesized view is synthesized (a selection, a conversion, merged when asked)."""
    note: dict[str, str | None] = field(default_factory=dict)
    """What a synthesized view's note says besides why: the source, the selection, the signature."""
    unverified: str | None = None
    """A signature the view serves that nothing verified (a model.sig beside a model mounted without a
    key), by its path: said at mount, and by status."""


ViewFile = SynthesizedFile | WeightsFile | Companion | bytes
"""A file of the view: synthesized of the tensors, one of the model's weights files served as it is,
a companion file (read from where it is), or bytes made here (the index of several synthesized
files, a synthesized view's note)."""


class ModelView:
    """The files of the view by path (relative to its directory), and its subdirectories."""

    def __init__(
        self,
        files: dict[str, ViewFile],
        directory_status: dict[str, os.stat_result] | None = None,
    ) -> None:
        self.files = dict(sorted(files.items()))
        self.companions = CompanionFiles(content for content in self.files.values() if isinstance(content, Companion))
        """The companion files, read from where they are (their mtimes, owners and permissions are their own)."""
        self.directory_status = directory_status or {}
        """The subdirectories' sources, where there are (local models)."""
        self.directories = sorted(
            {str(parent) for path in self.files for parent in PurePosixPath(path).parents} - {"."}
        )

    def synthesized(self) -> list[SynthesizedFile | WeightsFile]:
        """The files made of tensors: synthesized, or weights files served as they are."""
        return [content for content in self.files.values() if isinstance(content, SynthesizedFile | WeightsFile)]

    def size(self, path: str) -> int:
        content = self.files[path]
        return content.size if isinstance(content, SynthesizedFile | WeightsFile | Companion) else len(content)

    def close(self) -> None:
        self.companions.close()


PARTIAL_NAME = "selected"
"""What the synthesized files of a selection are called instead of model: a loader that looks for a
whole model (model.safetensors, or its index) finds none, and fails, rather than loading the
selection as the whole model with the rest made up."""
PARTIAL_INDEX = f"{PARTIAL_NAME}.safetensors.index.partial.json"
"""The index of a selection's files: not named *.index.json, which accelerate's load_checkpoint_in_model
takes from a directory for the model's (it would load the selection's layers, the rest left at random)."""


Held = tuple["Tables", "Gate"]
"""A model's tables and the gate that hands out its bytes (a Model and its gate)."""


def build_view(model: Tables, gate: Gate, spec: ViewSpec, others: Sequence[Held] = ()) -> ModelView:
    """The view `spec` describes of `model` (its bytes handed out by `gate`), and of the `others`
    (the models opened for a folder view's other weights files, in the order the spec numbers them)."""
    files: dict[str, ViewFile] = {c.path: c for c in spec.companions}
    if spec.folder:
        held = [(model, gate), *others]
        for path, (which, place) in spec.weights.items():
            tables, its_gate = held[which]
            files[path] = WeightsFile(tables, its_gate, tables.opened_shards()[place].header.path)
        return ModelView(files, spec.directories)
    files[NOTE_NAME] = orjson.dumps({"synthesized": spec.why, **spec.note}, option=orjson.OPT_INDENT_2) + b"\n"
    if not spec.components:
        _add_weights(files, (model, gate), model.sorted_names, spec.name, spec.shards, "")
    for folder, name in spec.components.items():  # a pipeline: each component in its folder
        prefix = f"{folder}/"
        names = [tensor for tensor in model.sorted_names if tensor.startswith(prefix)]
        if names:
            _add_weights(files, (model, gate), names, name, spec.shards, prefix)
    return ModelView(files, spec.directories)


def _add_weights(files: dict[str, ViewFile], held: Held, names: list[str], name: str, shards: int, prefix: str) -> None:
    """The files of tensors `names` in `files`: named `name` (or as a selection's are), in `shards`
    files (0 chooses), in the folder `prefix` names, their names there without it."""
    model, gate = held

    def sizes() -> list[int]:  # looked up only where needed: 100k lookups are tens of ms of a remount
        return [model.locate(tensor)[2] for tensor in names]

    component = sizes() if prefix else None
    total = model.nbytes if component is None else sum(component)
    count = shards or _auto_count(total)
    metadata = shared_metadata(model, names if prefix else None)
    groups = [names] if count == 1 else split(names, component if component is not None else sizes(), count)
    base = prefix + (name if model.selection.everything else PARTIAL_NAME)
    if format_of(model, names) == "gguf":  # one GGUF, whatever its size: GGUF loaders take a file
        files[f"{base}.gguf"] = SynthesizedFile(model, gate, names, None, prefix)
    elif len(groups) == 1:
        files[f"{base}.safetensors"] = SynthesizedFile(model, gate, names, metadata, prefix)
    else:
        weight_map: dict[str, str] = {}
        for k, group in enumerate(groups, 1):
            file_name = f"{base}-{k:05d}-of-{len(groups):05d}.safetensors"
            files[file_name] = SynthesizedFile(model, gate, group, metadata, prefix)
            weight_map.update({tensor.removeprefix(prefix): file_name.removeprefix(prefix) for tensor in group})
        index = f"{base}.safetensors.index.json" if model.selection.everything else prefix + PARTIAL_INDEX
        files[index] = index_document(dict(sorted(weight_map.items())), total)


def shared_metadata(model: Tables, names: list[str] | None = None) -> dict[str, str] | None:
    """The shards' `__metadata__` when they all have the same (none when they differ): of every
    shard, or of those holding `names`."""
    if names is not None:
        shards = dict.fromkeys(model.locate(name)[0] for name in names)
        found = [dict(model.shard_header(shard).metadata or {}) for shard in shards]
    else:
        found = list(model.metadata.values())
    if not found or any(metadata != found[0] for metadata in found):
        return None
    return found[0] or None


def split(names: list[str], sizes: list[int], count: int) -> list[list[str]]:
    """`names` (in order) cut into `count` runs of about equal bytes (fewer only when there are
    fewer names): run k ends where the bytes so far first reach k/count of the total."""
    count = max(1, min(count, len(names)))
    total = sum(sizes)
    cuts = [0]
    done = 0
    for index, size in enumerate(sizes):
        runs_left = count - len(cuts)
        if runs_left == 0:
            break
        # Cut before this name once its run has its share, or when each later run needs a name of its own.
        if index > cuts[-1] and (done + size / 2 > total * len(cuts) / count or len(names) - index == runs_left):
            cuts.append(index)
        done += size
    cuts.append(len(names))
    return [names[a:b] for a, b in pairwise(cuts)]


def _auto_count(nbytes: int) -> int:
    return 1 if nbytes <= AUTO_SINGLE_LIMIT else -(-nbytes // AUTO_SHARD_BYTES)
