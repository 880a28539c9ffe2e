"""model.safetensors.index.json: which shard holds which tensor (the same rules wherever it is read from)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import orjson

from ..errors import Problem
from ..utils.names import path_problem

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000
"""An index is read whole: one larger than a header may be (the reference's limit) is refused unread."""
_VARIANT_INDEX = re.compile(r".+\.(?:safetensors|bin)\.index\.[^./]+\.json")


def is_index_name(name: str) -> bool:
    """Whether a file of this name is an index of a model's shards: NAME.index.json, or a variant's as
    transformers names it (model.safetensors.index.fp16.json)."""
    return name.endswith(".index.json") or _VARIANT_INDEX.fullmatch(name) is not None


def index_document(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """An index as the reference writers make it: metadata.total_size, and the weight_map."""
    document = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode()


def parse_weight_map(data: bytes, label: str, problems: list[Problem]) -> dict[str, str] | None:
    """The index's weight_map (tensor -> shard file name), or None with the problems said.

    A repeated key needs no check of its own: every mapping is compared with the shards' contents.
    """
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        problems.append(Problem(label, f"index is not valid JSON: {exc}"))
        return None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        problems.append(Problem(label, "index has no weight_map object"))
        return None
    if set(map(type, weight_map.values())) <= {str}:
        return weight_map
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            problems.append(Problem(label, "weight_map value is not a shard file name", name))
    return None


def shard_names(weight_map: dict[str, str], label: str, problems: list[Problem]) -> list[str]:
    """The shard file names the index names, each once in its order; those that are not plain names are problems."""
    names = []
    for shard in dict.fromkeys(weight_map.values()):
        if path_problem(shard, max_depth=1) is not None or "\\" in shard:
            problems.append(
                Problem(
                    label,
                    f"weight_map names '{shard}', which is not a plain file name",
                    first_tensor(weight_map, shard),
                )
            )
        else:
            names.append(shard)
    return names


def missing_shard(index_label: str, weight_map: dict[str, str], shard: str) -> Problem:
    """What is said of a shard the index names that is not there: the index's problem, told of the
    first tensor it maps there (wherever the index was read from)."""
    reason = f"weight_map names shard '{shard}', which does not exist"
    return Problem(index_label, reason, first_tensor(weight_map, shard))


def first_tensor(weight_map: dict[str, str], shard: str) -> str:
    """The first tensor the index maps to `shard`: the one a problem with that shard is told of."""
    return next(name for name, value in weight_map.items() if value == shard)
