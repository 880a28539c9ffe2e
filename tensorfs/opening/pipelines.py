"""A diffusers pipeline as one model: several models (its component folders: unet/, vae/,
text_encoder/ ...), each opened as any model is, their tensors named under their folder
(unet/conv_in.weight), and what comes with them (model_index.json, scheduler/, tokenizer/) served
beside them as companion files.

Nothing below the opener knows of pipelines: each component is a model of its own, found,
validated and mapped by the one opener; here its tables are only named under its folder. The view
(views/) gives each component its own folder, its weights named as its loader looks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..catalogue.tables import Shard, owners
from ..errors import InvalidModelError, Problem
from ..formats import gguf
from ..model import Model
from ..selection import Selection
from ..utils.identity import ShardKey, shard_name
from ..utils.names import Layout
from .repository import model_name, model_of, named_under

__all__ = ["GGUF_COMPONENT", "open_pipeline"]

GGUF_COMPONENT = (
    "a GGUF file in a pipeline's component folder: diffusers loads no component from one (from_single_file "
    "does): name the file to mount it alone"
)


def open_pipeline(
    source: ShardKey,
    components: Sequence[str],
    open_component: Callable[[str], Model],
    selection: Selection,
    layout: Layout,
    root: Model | None = None,
) -> Model:
    """The pipeline at `source` as one model: each component folder opened by `open_component(folder)`
    (every problem of every component said at once), its tensors named FOLDER/NAME; the selection's
    tensors (its globs and layers match those names: 'unet/*' is one component). `root`: the model
    of the root's own files beside the pipeline (a repository's), under a folder of its own (or its
    models' folders, where it is several: repository.py)."""
    problems: list[Problem] = []
    opened: list[tuple[str, Model]] = []
    try:
        for folder in components:
            try:
                opened.append((folder, open_component(folder)))
            except InvalidModelError as exc:
                problems.extend(exc.problems)
                continue
            problems += [
                Problem(str(shard.header.path), GGUF_COMPONENT)
                for shard in opened[-1][1].opened_shards()
                if shard.header.format == gguf.NAME
            ]
        if problems:
            raise InvalidModelError(problems)
        shards = [
            Shard(named_under(shard.header, folder), shard.data)
            for folder, model in opened
            for shard in model.opened_shards()
        ]
        parts: dict[str, list[str]] = {}
        for folder, model in opened:  # a component of several models: each one's folder within its own
            inner = model.parts or {"": [shard_name(shard.header.path) for shard in model.opened_shards()]}
            for name, files in inner.items():
                parts[f"{folder}/{name}".rstrip("/")] = [f"{folder}/{file}" for file in files]
        if root is not None:
            shards += _beside(root, parts)
    except BaseException:
        for _, model in opened:
            model.close()
        raise
    for model in [*(model for _, model in opened), *([root] if root is not None else [])]:
        model.gate.close()  # its shards are the pipeline's now, watched by the pipeline's gate
    try:
        return model_of(source, shards, owners(shards), layout, selection, parts)
    except BaseException:
        for shard in shards:
            shard.data.close()
        raise


def _beside(root: Model, parts: dict[str, list[str]]) -> list[Shard]:
    """The shards of the root's own models, each under its folder (added to `parts`, by folder)."""
    if root.parts:
        parts.update(root.parts)
        return list(root.opened_shards())
    files = [shard_name(shard.header.path) for shard in root.opened_shards()]
    folder = model_name(files)
    if folder in parts:  # (a checkpoint unet.safetensors beside the folder unet/)
        folder = min(files)
    parts[folder] = files
    return [Shard(named_under(shard.header, folder), shard.data) for shard in root.opened_shards()]
