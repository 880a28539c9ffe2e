"""A diffusers pipeline as one model: several models (its component folders: unet/, vae/,
text_encoder/ ...), each opened as any model is, their tensors named under their folder
(unet/conv_in.weight), and what comes with them (model_index.json, scheduler/, tokenizer/) served
beside them as companion files.

Nothing below the opener knows of pipelines: each component is a model of its own, found,
validated and mapped by the one opener; here its tables are only named under its folder. The view
(views/) gives each component its own folder, its weights named as its loader looks for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..catalogue.tables import Shard, opened_for, owners
from ..errors import InvalidModelError, Problem
from ..formats import NAME, ShardHeader, gguf
from ..model import Model
from ..selection import Selection
from ..utils.identity import ShardKey
from ..utils.names import Layout

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
) -> Model:
    """The pipeline at `source` as one model: each component folder opened by `open_component(folder)`
    (every problem of every component said at once), its tensors named FOLDER/NAME; the selection's
    tensors (its globs and layers match those names: 'unet/*' is one component)."""
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
            Shard(_named_under(shard.header, folder), shard.data)
            for folder, model in opened
            for shard in model.opened_shards()
        ]
    except BaseException:
        for _, model in opened:
            model.close()
        raise
    for _, model in opened:
        model.gate.close()  # its shards are the pipeline's now, watched by the pipeline's gate
    try:
        if selection.everything:
            return Model(source, shards, owners(shards), layout)
        kept, owner = opened_for(shards, selection, str(source))
    except BaseException:
        for shard in shards:
            shard.data.close()
        raise
    return Model(source, kept, owner, layout, selection)


def _named_under(header: ShardHeader, folder: str) -> ShardHeader:
    entries = [(*entry[:NAME], f"{folder}/{entry[NAME]}", *entry[NAME + 1 :]) for entry in header.entries]
    return dataclasses.replace(header, entries=entries)  # type: ignore[arg-type]
