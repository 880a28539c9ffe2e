"""A folder of several models as one tree: each model's tensors named under a folder of its own
(MODEL/NAME), so that no two models' names ever meet, each model checked on its own first.

A folder holds several models where no loader's name says which one is the model (choosing.py:
quantizations side by side, variants with no default, safetensors beside GGUF files, checkpoints
that share their tensors' names). Each is named after its files: a file's name without its suffix
(`model.Q4_K_M.gguf` is `model.Q4_K_M/`), the common stem of numbered parts (`model-00001-of-00002`
is `model/`). A diffusers pipeline's components are such folders too, named after theirs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from ..catalogue.assembly import check_model
from ..catalogue.tables import Shard, opened_for, owners
from ..errors import Problem, printable
from ..formats import NAME, WEIGHT_SUFFIXES, ShardHeader
from ..model import Model
from ..selection import Selection
from ..sources.choosing import NUMBERED
from ..utils.identity import ShardKey, shard_name
from ..utils.names import CONTROL_DIR, Layout, collisions, name_problem

__all__ = ["checked_parts", "model_name", "model_of", "named_under", "parts_of"]


def parts_of(shards: list[Shard], groups: Sequence[Sequence[str]]) -> list[tuple[str, list[Shard]]]:
    """The models `shards` are, each named: by `groups` (each model's file names, as the folder's
    names say: choosing.Choice.parts; none: the shards are one), each then cut where its files
    share tensors' names (two checkpoints, two LoRAs: each file goes with the first of the others
    none of whose names it holds)."""
    by_file = {shard_name(shard.header.path): shard for shard in shards}
    listed = [[by_file[name] for name in group if name in by_file] for group in groups]
    if not groups:
        listed = [sorted(shards, key=lambda shard: shard_name(shard.header.path))]
    models: list[list[Shard]] = []
    for group in listed:
        cut: list[tuple[set[str], list[Shard]]] = []
        for shard in group:
            names = {entry[NAME] for entry in shard.header.entries}
            found = next((model for model in cut if model[0].isdisjoint(names)), None)
            if found is None:
                cut.append((names, [shard]))
            else:
                found[0].update(names)
                found[1].append(shard)
        models += [files for _, files in cut if files]
    taken: set[str] = set()
    named = []
    for model in models:
        files = [shard_name(shard.header.path) for shard in model]
        name = model_name(files)
        if name in taken or name == CONTROL_DIR:  # (model.safetensors and model.gguf: both "model")
            name = min(files)
        taken.add(name)
        named.append((name, model))
    return named


def model_name(files: list[str]) -> str:
    """What a model of these files is called: one file's name without its suffix; numbered parts'
    common stem; else the files' common beginning (or "model")."""
    if len(files) == 1:
        name = files[0]
        suffix = next((suffix for suffix in WEIGHT_SUFFIXES if name.endswith(suffix)), "")
        return name[: len(name) - len(suffix)] if len(name) > len(suffix) else name
    numbered = [NUMBERED.fullmatch(name) for name in files]
    stems = {found["prefix"] for found in numbered if found is not None}
    if len(stems) == 1 and all(numbered):
        return stems.pop()
    stem = os.path.commonprefix(files)  # noqa: RUF071 (names, compared character by character)
    return stem.rstrip("-_.") or "model"


def checked_parts(
    parts: list[tuple[str, list[Shard]]], layout: Layout, problems: list[Problem]
) -> tuple[list[Shard], dict[str, Shard]]:
    """The shards of several models as one tree's: each model checked as a model on its own (its
    rules across files, its names), then its tensors named under its folder (named_under); the
    problems found added to `problems`. The shards named so, and which holds each tensor."""
    shards: list[Shard] = []
    for folder, files in parts:
        check_model(files, None, None, layout, problems)  # its names, as any model's
        why = name_problem(f"{folder}/x", layout)  # and its folder's, now in every one of them
        if why is not None:
            problems.append(Problem(files[0].label, f"as the folder of its model, {printable(folder)!r}: {why}"))
        shards += [Shard(named_under(shard.header, folder), shard.data, lent=shard.lent) for shard in files]
    owner = owners(shards)
    # Across folders ("a.b/w" and "a/b.w" are one path in --layout dotted).
    problems += [Problem(owner[name].label, reason, name) for name, reason in collisions(owner, layout)]
    return shards, owner


def model_of(
    source: ShardKey,
    shards: list[Shard],
    owner: dict[str, Shard],
    layout: Layout,
    selection: Selection,
    parts: dict[str, list[str]],
) -> Model:
    """The one model of several models' shards (named under their folders): the selection's tensors
    of them, and where each model is (Tables.parts)."""
    if selection.everything:
        model = Model(source, shards, owner, layout)
    else:
        kept, owner = opened_for(shards, selection, str(source))
        model = Model(source, kept, owner, layout, selection)
    model.parts = parts
    return model


def named_under(header: ShardHeader, folder: str) -> ShardHeader:
    """A shard's table with its tensors named FOLDER/NAME (a model of a folder of several)."""
    entries = [(*entry[:NAME], f"{folder}/{entry[NAME]}", *entry[NAME + 1 :]) for entry in header.entries]
    return dataclasses.replace(header, entries=entries)  # type: ignore[arg-type]
