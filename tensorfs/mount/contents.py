"""What a mount's small files hold, each made from the model's tables alone: a tensor's .meta.json
(and its size, added up without making it: a listing needs 100k), a .sha256 line, index.json and
metadata.json."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import TYPE_CHECKING

from ..formats import Described, Entry
from ..proof.manifest import sha256sum_line
from ..sources.index import index_document
from ..utils.identity import shard_name

if TYPE_CHECKING:
    from ..catalogue.tables import Tables as Model

__all__ = ["checkable", "entry_meta_size", "index_json", "meta_json", "meta_size", "metadata_json", "sha256_line"]


def meta_json(model: Model, name: str) -> bytes:
    """The .meta.json of a tensor: what a reader needs to map its file (np.memmap and friends)."""
    return (json.dumps(model.info(name).as_json(), ensure_ascii=False) + "\n").encode("utf-8")


def meta_size(model: Model, name: str) -> int:
    """len(meta_json(model, name)), by adding up the lengths of its parts (a listing needs 100k of them)."""
    shard, data_start, entry = model.entry(name)
    return entry_meta_size(entry, data_start, shard_name(shard), model.shard_header(shard).format)


def entry_meta_size(entry: Entry, data_start: int, shard_name: str, format_name: str) -> int:
    begin, end, name, dtype, shape = entry
    numpy_name = dtype.numpy_name
    shape_size = 2 + 2 * len(shape) + sum(map(len, map(str, shape))) - (2 if shape else 0)
    size = (
        _META_FIXED
        + _json_string_size(name)
        + len(dtype.name)
        + shape_size
        + len(str(end - begin))
        + _json_string_size(shard_name)
        + len(str(data_start + begin))
        + len(str(begin))
        + len(str(end))
        + (4 if numpy_name is None else len(numpy_name) + 2)
    )
    if format_name == "gguf":  # the dimensions as stored (the shape reversed), the block and type sizes
        size += _GGUF_FIXED + shape_size + len(str(dtype.block_size)) + len(str(dtype.type_size or dtype.bits // 8))
    return size


def _json_string_size(text: str) -> int:
    encoded = encode_basestring(text)
    return len(encoded) if encoded.isascii() else len(encoded.encode("utf-8"))


# Everything of a .meta.json but its values: keys, quotes around the dtype, separators, braces, "\n".
_META_FIXED = (
    len('{"name": , "dtype": "", "shape": , "nbytes": , "shard": , "offset": , "data_offsets": [, ], "numpy_dtype": }')
    + 1
)
_GGUF_FIXED = len(', "gguf_dims": , "block_size": , "type_size": ')  # what a GGUF tensor's adds


def sha256_line(hex_digest: str, filename: str) -> bytes:
    """A line `sha256sum -c` accepts, escaping the name as GNU sha256sum does when it must."""
    return sha256sum_line(hex_digest, checkable(filename)).encode()


def checkable(path: str) -> str:
    """`sha256sum -c` reads standard input for a file named '-': name it ./- instead."""
    return "./-" if path == "-" else path


def metadata_json(model: Model, into: Described | None = None) -> bytes:
    """What each shard says of itself (a safetensors `__metadata__`, a GGUF's key/value pairs), by
    shard file name, with the model's format: as much as fits `into` (by default, 16 MiB of it;
    formats.Described says what stands for what is left out), and, under "left_out", how many pairs
    of each shard are not there at all."""
    into = into or Described()
    shards: dict[str, object] = {}
    left_out: dict[str, int] = {}
    for shard in model.shards:
        name = shard_name(shard)
        shards[name] = model.described_metadata(shard, into)
        if into.left_out:
            left_out[name], into.left_out = into.left_out, 0
    # A folder of several models: each one's folder in the tree, and its files (and of several
    # formats, each file's: "format" is then "mixed").
    models: dict[str, object] = {"models": model.parts} if model.parts else {}
    formats = {shard_name(shard): model.shard_header(shard).format for shard in model.shards}
    if len(set(formats.values())) > 1:
        document: dict[str, object] = {"format": "mixed", "formats": formats, **models, "shards": shards}
    else:
        document = {"format": model.format, **models, "shards": shards}
    if left_out:
        document["left_out"] = left_out
    return (json.dumps(document, ensure_ascii=False) + "\n").encode("utf-8")


def index_json(model: Model) -> bytes:
    """A model.safetensors.index.json-style index of what is mounted."""
    return index_document({name: shard_name(model.locate(name)[0]) for name in model.sorted_names}, model.nbytes)
