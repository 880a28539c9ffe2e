"""The rules that span a model's shards, once each shard is validated on its own: one format, no name
in two shards, the index agrees with the shards, names that are safe paths and do not clash."""

from __future__ import annotations

from .. import formats
from ..errors import Problem, printable
from ..formats import NAME
from ..utils.identity import shard_name
from ..utils.names import Layout, collisions, name_problems
from .tables import Shard, owners

__all__ = ["check_model", "index_agrees"]


def index_agrees(shards: list[Shard], weight_map: dict[str, str], tensors: int) -> bool:
    """Whether the index maps exactly the shards' tensors, each to its shard (C-speed for 100k)."""
    if len(weight_map) != tensors:
        return False
    for shard in shards:
        names = [entry[NAME] for entry in shard.header.entries]
        if list(map(weight_map.get, names)) != [shard_name(shard.header.path)] * len(names):
            return False
    return True


def check_model(
    shards: list[Shard],
    weight_map: dict[str, str] | None,
    index_label: str | None,
    layout: Layout,
    problems: list[Problem],
) -> dict[str, Shard]:
    """The rules that span shards: unique names, the index agrees, names are safe paths.

    Returns which shard holds each tensor.
    """
    owner = owners(shards)
    # One model, one format (its views are files of that format), and what that format asks of its
    # files together (several GGUF models in one directory): said instead of their names' clashes.
    mixed = [
        Problem(shard.label, f"is a {shard.header.format} file, where {shards[0].label} is {shards[0].header.format}"
                ": a model's shards are all of one format")
        for shard in shards
        if shard.header.format != shards[0].header.format
    ]  # fmt: skip
    if shards and not mixed:
        in_order = sorted(shards, key=lambda shard: str(shard.header.path))
        mixed = formats.across_files(shards[0].header.format, [(s.label, s.header) for s in in_order])
    if mixed:
        problems += mixed
        return owner
    if len(owner) != sum(len(shard.header.entries) for shard in shards):
        problems += _held_twice(shards)
    bad_names = name_problems(owner, layout)
    for name, reason in bad_names:
        problems.append(Problem(owner[name].label, reason, name))
    if weight_map is not None and index_label is not None and not index_agrees(shards, weight_map, len(owner)):
        read = {shard_name(shard.header.path) for shard in shards}  # a shard missing or invalid: reported
        for name, mapped in weight_map.items():
            actual = owner.get(name)
            if mapped in read and (actual is None or shard_name(actual.header.path) != mapped):
                problems.append(Problem(index_label, f"the index maps it to {mapped}, which does not hold it", name))
        for name, holder in owner.items():
            if name not in weight_map:
                problems.append(Problem(holder.label, "is not listed in the index's weight_map", name))
    # Clashes among the names that are each valid, reported with everything else in one pass.
    valid = owner if not bad_names else {name: shard for name, shard in owner.items() if name not in dict(bad_names)}
    for name, reason in collisions(valid, layout):
        problems.append(Problem(owner[name].label, reason, name))
    return owner


def _held_twice(shards: list[Shard]) -> list[Problem]:
    """A tensor in two shards: said of the tensor; many tensors of one shard in another (the files of
    two models side by side: two LoRAs, two checkpoints), said once of the pair of files."""
    first: dict[str, int] = {}
    again: dict[tuple[int, int], list[str]] = {}  # (the shard, the one holding them first) -> names
    for k, shard in enumerate(shards):
        for entry in shard.header.entries:
            holder = first.setdefault(entry[NAME], k)
            if holder != k:
                again.setdefault((k, holder), []).append(entry[NAME])
    problems: list[Problem] = []
    for (k, h), names in again.items():
        label, other = shards[k].label, shard_name(shards[h].header.path)
        if len(names) == 1:
            problems.append(Problem(label, f"is also in shard {other}", names[0]))
        else:
            problems.append(
                Problem(
                    label,
                    f"{len(names)} of its tensors ('{printable(names[0])}' ...) are also in shard {other}: the "
                    "files of two models? name the one to open",
                )
            )
    return problems
