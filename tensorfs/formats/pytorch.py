"""PyTorch checkpoints (`torch.save`'s zip format, torch 1.6 and later): a file's archive directory and
pickle -> its validated table (ShardHeader), without running the pickle and without torch.

A checkpoint is a zip archive whose entries are all in one folder (ARCHIVE/): data.pkl, the pickled
object (a state dict), whose tensors name their storages by key; each storage the entry
ARCHIVE/data/KEY, stored uncompressed (torch aligns their data to 64 bytes); ARCHIVE/byteorder,
"little". A tensor is its storage's bytes from its storage offset, when its elements are contiguous:
a table entry over those bytes in the file. Tensors that share a storage (tied weights, slices of one
tensor) have entries over the same bytes.

The zip is read as torch's reader reads it: its central directory (at the end, Zip64 too), then the
local header of each entry used, for where its data begins (torch writes sizes only in the central
directory). The pickle is read by pickled.py, which runs none of it. Refused, in one line each:
anything but a zip holding ARCHIVE/data.pkl; an entry whose name is not a plain relative path (the one
gate of names from outside, names.path_problem: a storage a pickle names is looked up among those);
TorchScript archives; encrypted or compressed entries;
entries that overlap, or run past the central directory; a big-endian byteorder; the legacy format
(torch < 1.6) with a hint; any global a state dict's pickle does not use; a storage missing, or of
another size than the pickle says; a tensor past its storage, or not contiguous (by name, with a hint).
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidModelError, Problem
from ..utils.identity import ShardKey
from ..utils.names import path_problem
from . import pickled
from .table import Described, Entry, ShardHeader

if TYPE_CHECKING:
    from .table import Reader

NAME = "pytorch"
SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth")
"""The names its files are found by in a directory or a listing (content decides what a file is)."""
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = b"\x80\x02\x8a\x0a"  # protocol 2, then a 10-byte long: torch's legacy magic number
METADATA = {"format": "pt"}
"""A checkpoint's metadata, as its safetensors view says it (what transformers looks for)."""
MAX_DIRECTORY_BYTES = 64 << 20
"""The most an archive's central directory may take (100k storages take about 8 MB)."""
MAX_PICKLE_BYTES = 64 << 20
"""The most data.pkl may take (a state dict takes about 100 bytes a tensor)."""
_GROUP_BYTES = 1 << 20  # local headers this close together are read in one piece
_LOCAL_SLACK = 256  # read past a local header's name, for its extra field (torch pads to 64 bytes)

_EOCD = struct.Struct("<IHHHHIIH")
_EOCD_SIG, _LOCATOR_SIG, _EOCD64_SIG = 0x06054B50, 0x07064B50, 0x06064B50
_LOCATOR = struct.Struct("<IIQI")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG, _LOCAL_SIG = 0x02014B50, 0x04034B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_U32_MAX, _U16_MAX = 0xFFFFFFFF, 0xFFFF
_UNREAD_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000  # encrypted, patch data, strong encryption, masked directory
_DIRECTORY_ATTRIBUTE = 0x10  # MS-DOS's: miniz (torch's zip reader) takes such an entry for a directory


def _exactly(read: Reader, offset: int, count: int) -> bytes:
    """`count` bytes from `offset` (fewer only at the end of the file): a reader of a store's first
    bytes gives no more than those, and the rest is asked for again past them."""
    data = read(offset, count)
    while 0 < len(data) < count:
        more = read(offset + len(data), count - len(data))
        if not more:
            break
        data += more
    return data


def sniff(first: bytes, name: str) -> bool:
    """A zip archive, or torch's legacy format (claimed to be refused with a hint), whatever its name."""
    return first[:4] in (ZIP_MAGIC, LEGACY_MAGIC)


class _Fault(Exception):
    """What is wrong where the checkpoint cannot be read any further."""


def _inside(read: Reader, size: int) -> Reader:
    """`read`, for bytes inside the file alone: every offset and length is an archive record's word,
    and a read past the end would be told as a file that shrank (or, from a store, not sent)."""

    def inside(offset: int, count: int) -> bytes:
        if offset < 0 or count < 0 or offset + count > size:
            raise _Fault(
                f"the zip's records point at bytes {offset:,} to {offset + count:,}, outside the file "
                f"({size:,} bytes): damaged"
            )
        return read(offset, count)

    return inside


@dataclass(frozen=True, slots=True)
class _Record:
    """An entry of the central directory."""

    name: str
    flags: int
    method: int
    crc: int
    compressed: int
    size: int
    header_offset: int
    attributes: int
    """Its external attributes (MS-DOS's in the low byte)."""


def read_table(read: Reader, size: int, path: ShardKey, label: str) -> ShardHeader:
    """The validated table of the checkpoint at `path` (`size` bytes, shown as `label`), its bytes had
    from `read(offset, count)`: the central directory, the local headers of the entries it uses, the
    pickle. Tensor data is never read. InvalidModelError listing what is wrong."""
    problems: list[Problem] = []
    read = _inside(read, size)
    try:
        if _exactly(read, 0, min(size, 4)) == LEGACY_MAGIC:
            raise _Fault(
                "a PyTorch checkpoint in the legacy format (torch < 1.6, or _use_new_zipfile_serialization="
                "False): tensorfs reads the zip format; load it and torch.save it again with a current torch"
            )
        records, directory_start = _central_directory(read, size)
        archive = _archive_name(records)
        pickle_record = records[f"{archive}/data.pkl"]
        if pickle_record.size > MAX_PICKLE_BYTES:
            raise _Fault(f"{pickle_record.name} takes {pickle_record.size:,} bytes, over {MAX_PICKLE_BYTES:,}")
        # Every entry's header is checked, as torch reads them all (its small records too).
        starts = _data_starts(read, size, list(records.values()), directory_start)
        _check_records(read, archive, records, starts)
        data = _exactly(read, starts[pickle_record.name], pickle_record.size)
        if len(data) != pickle_record.size:
            raise _Fault("data.pkl's bytes did not all come")
        if zlib.crc32(data) != pickle_record.crc:
            raise _Fault(f"{pickle_record.name} does not match its CRC-32: the archive is damaged")
        found = pickled.state_dict(data)
    except pickled.Refused as refused:
        raise InvalidModelError([Problem(label, f"data.pkl {refused}")]) from None
    except _Fault as fault:
        raise InvalidModelError([Problem(label, str(fault))]) from None
    entries: list[Entry] = []
    for item in found:
        entry = _entry(item, archive, records, starts, problems, label)
        if entry is not None:
            entries.append(entry)
    if problems:
        raise InvalidModelError(problems)
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    return ShardHeader(path, size, 0, entries, dict(METADATA), NAME, None)


def _entry(
    item: pickled.Found, archive: str, records: dict[str, _Record], starts: dict[str, int],
    problems: list[Problem], label: str,
) -> Entry | None:  # fmt: skip
    tensor, storage = item.tensor, item.tensor.storage
    record = records.get(f"{archive}/data/{storage.key}")
    if record is None:
        problems.append(Problem(label, f"its storage {storage.key} is not in the archive", item.name))
        return None
    if record.size != storage.nbytes:
        why = f"its storage {storage.key} holds {storage.nbytes} bytes, where the archive's entry has {record.size}"
        problems.append(Problem(label, why, item.name))
        return None
    width = tensor.dtype.bits // 8
    begin, nbytes = tensor.offset * width, tensor.numel * width
    if begin + nbytes > record.size:
        why = f"runs past the end of its storage {storage.key} ({record.size} bytes) from byte {begin}"
        problems.append(Problem(label, why, item.name))
        return None
    if not tensor.contiguous():
        why = (
            f"is not contiguous (size {list(tensor.shape)}, stride {list(tensor.stride)}): tensorfs serves a "
            "tensor as the bytes it is stored in; save tensor.contiguous() instead"
        )
        problems.append(Problem(label, why, item.name))
        return None
    start = starts[record.name] + begin
    return (start, start + nbytes, item.name, tensor.dtype, list(tensor.shape))


def _central_directory(read: Reader, size: int) -> tuple[dict[str, _Record], int]:
    """The archive's entries by name, and where its central directory begins."""
    if size < _EOCD.size:
        raise _Fault(f"file is {size} bytes, too short to be a zip archive")
    tail_length = min(size, _EOCD.size + _U16_MAX)
    tail = _exactly(read, size - tail_length, tail_length)
    position = len(tail) - _EOCD.size
    while position >= 0:  # the last end record whose comment reaches the end of the file exactly
        position = tail.rfind(struct.pack("<I", _EOCD_SIG), 0, position + 4)
        if position < 0:
            break
        if position + _EOCD.size + _EOCD.unpack_from(tail, position)[7] == len(tail):
            break
        position -= 1
    if position < 0:
        raise _Fault("no zip end-of-central-directory record: not a zip archive, or truncated")
    _, disk, directory_disk, on_disk, count, directory_size, directory_start, _ = _EOCD.unpack_from(tail, position)
    end_at = size - len(tail) + position
    directory_end = end_at
    # A Zip64 archive (torch writes one whatever its size) has its own end record before the locator.
    locator = _exactly(read, end_at - _LOCATOR.size, _LOCATOR.size) if end_at >= _LOCATOR.size else b""
    if len(locator) == _LOCATOR.size and _LOCATOR.unpack(locator)[0] == _LOCATOR_SIG:
        _, record_disk, record_at, disks = _LOCATOR.unpack(locator)
        if record_disk or disks > 1:
            raise _Fault("a zip archive split over several disks")
        fits = record_at + _EOCD64.size <= end_at - _LOCATOR.size
        fields = _EOCD64.unpack(_exactly(read, record_at, _EOCD64.size)) if fits else None
        if fields is None or fields[0] != _EOCD64_SIG or record_at + 12 + fields[1] != end_at - _LOCATOR.size:
            raise _Fault("a Zip64 archive whose Zip64 end record is not where its locator says")
        classic = (disk, directory_disk, on_disk, count, directory_size, directory_start)
        zip64 = fields[4:]
        # The end record's own fields say the same, or that they did not fit (all ones).
        if any(old not in (new, _U16_MAX, _U32_MAX) for old, new in zip(classic, zip64, strict=True)):
            raise _Fault("the zip's end record and its Zip64 end record disagree")
        disk, directory_disk, on_disk, count, directory_size, directory_start = zip64
        directory_end = record_at
    elif _U16_MAX in (count, on_disk) or _U32_MAX in (directory_size, directory_start):
        raise _Fault("a Zip64 archive without its Zip64 locator")
    if disk or directory_disk or on_disk != count:
        raise _Fault("a zip archive split over several disks")
    if directory_start + directory_size != directory_end:
        raise _Fault("the zip's central directory is not where its end record says (data before or after it)")
    if directory_size > MAX_DIRECTORY_BYTES:
        raise _Fault(f"the zip's central directory takes {directory_size:,} bytes, over {MAX_DIRECTORY_BYTES:,}")
    if count * _CENTRAL.size > directory_size:
        raise _Fault(f"the zip's end record says {count} entries, more than its central directory can hold")
    directory = _exactly(read, directory_start, directory_size)
    if len(directory) != directory_size:
        raise _Fault("the zip's central directory did not all come")
    return _records(directory, count), directory_start


def _records(directory: bytes, count: int) -> dict[str, _Record]:
    records: dict[str, _Record] = {}
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > len(directory):
            raise _Fault("the zip's central directory ends in the middle of an entry")
        fields = _CENTRAL.unpack_from(directory, position)
        signature, _, _, flags, method, _, _, crc, compressed, size = fields[:10]
        name_length, extra_length, comment_length, disk, _, attributes, header_offset = fields[10:]
        end = position + _CENTRAL.size + name_length + extra_length + comment_length
        if signature != _CENTRAL_SIG or end > len(directory):
            raise _Fault("the zip's central directory holds something other than its entries")
        raw_name = directory[position + _CENTRAL.size : position + _CENTRAL.size + name_length]
        extra = directory[position + _CENTRAL.size + name_length : end - comment_length]
        size, compressed, header_offset, disk = _zip64(extra, size, compressed, header_offset, disk)
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise _Fault(f"the zip holds an entry whose name is not UTF-8: {raw_name[:200]!r}") from None
        why = path_problem(name)  # the one gate of names from outside: the checkpoint is refused
        if why is not None:
            raise _Fault(f"the zip holds an entry whose name {why}: {name[:200]}")
        if name in records:
            raise _Fault(f"the zip holds {name} twice")
        if disk:
            raise _Fault(f"{name} is on another disk of a split archive")
        records[name] = _Record(name, flags, method, crc, compressed, size, header_offset, attributes)
        position = end
    if position != len(directory):
        raise _Fault("the zip's central directory holds more than its end record says")
    return records


def _zip64(extra: bytes, size: int, compressed: int, offset: int, disk: int) -> tuple[int, int, int, int]:
    """The sizes, offset and disk of an entry, those too large for their fields taken from its Zip64 extra field."""
    if _U32_MAX not in (size, compressed, offset) and disk != _U16_MAX:
        return size, compressed, offset, disk
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        if position + 4 + length > len(extra):
            raise _Fault(
                f"a zip entry's extra field (tag {tag:#06x}) says {length} bytes, past the end of its extra data"
            )
        if tag == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            try:
                size = next(values) if size == _U32_MAX else size
                compressed = next(values) if compressed == _U32_MAX else compressed
                offset = next(values) if offset == _U32_MAX else offset
            except StopIteration:
                raise _Fault("a zip entry's Zip64 extra field is too short") from None
            return size, compressed, offset, 0 if disk == _U16_MAX else disk
        position += 4 + length
    raise _Fault("a zip entry too large for its fields has no Zip64 extra field")


def _archive_name(records: dict[str, _Record]) -> str:
    """The folder all entries are in (torch's reader takes the first entry's)."""
    if not records:
        raise _Fault("the zip archive is empty")
    first = next(iter(records))
    archive, slash, _ = first.partition("/")
    if not slash:
        raise _Fault(f"the zip's first entry, {first}, is not in a folder: not a PyTorch checkpoint")
    if f"{archive}/data.pkl" not in records:
        raise _Fault(f"the zip holds no {archive}/data.pkl: not a PyTorch checkpoint (torch.save)")
    if f"{archive}/version" not in records:
        raise _Fault(f"the zip holds no {archive}/version: not a PyTorch checkpoint (torch.save writes one)")
    if f"{archive}/constants.pkl" in records:
        raise _Fault("a TorchScript archive (torch.jit.save): a model's code, not a state dict; save its state_dict()")
    return archive


def _data_starts(read: Reader, size: int, used: list[_Record], directory_start: int) -> dict[str, int]:
    """Where each used entry's data begins, from its local header; each checked: stored, not
    encrypted, named as in the central directory, inside the data before the central directory,
    not overlapping another."""
    for record in used:
        if record.header_offset + _LOCAL.size > directory_start:
            raise _Fault(f"{record.name}'s local header is not where the central directory says (past the data)")
        if record.flags & _UNREAD_FLAGS:
            raise _Fault(
                f"{record.name} is encrypted or patch data (zip flags {record.flags:#06x}): torch reads neither"
            )
        if record.name.endswith("/") or record.attributes & _DIRECTORY_ATTRIBUTE:
            raise _Fault(f"{record.name} is marked as a directory")
        if record.method != 0 or record.compressed != record.size:
            raise _Fault(
                f"{record.name} is compressed (method {record.method}): tensorfs maps storages where they are, "
                "and torch.save stores them uncompressed; save the checkpoint again with torch.save"
            )
    spans = sorted(
        (record.header_offset, min(size, record.header_offset + _LOCAL.size + len(record.name.encode()) + _LOCAL_SLACK))
        for record in used
    )
    pieces = _read_spans(read, spans)
    starts: dict[str, int] = {}
    ranges = []
    for record in used:
        header = pieces[record.header_offset]
        if len(header) < _LOCAL.size:
            raise _Fault(f"{record.name}'s local header runs past the end of the file")
        signature, _, _, _, _, _, _, _, _, name_length, extra_length = _LOCAL.unpack_from(header)
        if len(header) < _LOCAL.size + name_length:  # a long name: no further than the file goes
            header = _exactly(read, record.header_offset, min(_LOCAL.size + name_length, size - record.header_offset))
        if signature != _LOCAL_SIG or header[_LOCAL.size : _LOCAL.size + name_length] != record.name.encode():
            raise _Fault(f"{record.name}'s local header is not where the central directory says")
        start = record.header_offset + _LOCAL.size + name_length + extra_length
        if start + record.size > directory_start:
            raise _Fault(f"{record.name} runs into the zip's central directory: truncated or damaged")
        starts[record.name] = start
        ranges.append((record.header_offset, start + record.size, record.name))
    ranges.sort()
    for (_, end, name), (begin, _, following) in itertools.pairwise(ranges):
        if begin < end:
            raise _Fault(f"{following} overlaps {name} in the archive")
    return starts


def _read_spans(read: Reader, spans: list[tuple[int, int]]) -> dict[int, bytes]:
    """The bytes of each [start, end) of `spans` (sorted), by start: those close together read in one
    piece (a store is asked once for many small storages' headers)."""
    pieces: dict[int, bytes] = {}
    index = 0
    while index < len(spans):
        group = [spans[index]]
        while index + len(group) < len(spans) and spans[index + len(group)][1] - group[0][0] <= _GROUP_BYTES:
            group.append(spans[index + len(group)])
        first = group[0][0]
        last = max(end for _, end in group)
        blob = _exactly(read, first, last - first)
        for start, end in group:
            pieces[start] = blob[start - first : end - first]
        index += len(group)
    return pieces


_NUMBERS = (re.compile(rb"\s*\d+\s*"), "a number")
SMALL_RECORDS = {
    "version": _NUMBERS,
    ".format_version": _NUMBERS,
    ".storage_alignment": _NUMBERS,
    "byteorder": (re.compile(rb"little|big"), "'little' or 'big'"),
    ".data/serialization_id": (re.compile(rb"[\x20-\x7e]*"), "printable text"),
}
"""The small records torch reads besides the pickle and the storages, and what each must hold."""


def _check_records(read: Reader, archive: str, records: dict[str, _Record], starts: dict[str, int]) -> None:
    """torch's small records hold what torch reads them as; the byteorder is little-endian's."""
    for name, (pattern, what) in SMALL_RECORDS.items():
        record = records.get(f"{archive}/{name}")
        if record is None:
            continue
        content = _exactly(read, starts[record.name], min(record.size, 64))
        if record.size > 64 or not pattern.fullmatch(content):
            raise _Fault(f"{record.name} holds {content[:64]!r}, not {what}")
        if name == "byteorder" and content == b"big":
            raise _Fault(
                "a big-endian checkpoint (byteorder 'big'): tensorfs serves little-endian bytes; "
                "load it and torch.save it again on a little-endian machine"
            )


PART_NAME = re.compile(r"(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.(?:bin|pt|pth))")
"""How a sharded checkpoint's files are named: pytorch_model-00001-of-00003.bin."""
DEFAULT_NAME = "pytorch_model.bin"
INDEX_NAME = "pytorch_model.bin.index.json"
TRAINING_STATE = re.compile(r"training_args\.bin|(optimizer|scheduler)\.(pt|bin)|scaler\.pt|rng_state(_\d+)?\.pth")
"""What a training run saves beside its model (transformers' Trainer, accelerate): never the model."""


def is_model_name(name: str) -> bool:
    """Whether a file of this name is a model's checkpoint by its name (pytorch_model.bin, or a part of a
    numbered one), not another file a directory holds besides (optimizer.pt, ONNX data in .bin files)."""
    return name == DEFAULT_NAME or PART_NAME.fullmatch(name) is not None


def choose(names: list[str]) -> tuple[list[str], str | None]:
    """Which of a directory's checkpoint files (sorted names) are its model, without an index: the
    file pytorch_model.bin, or all the parts of one numbered checkpoint, or the one file there is;
    (them, or why there is no telling). A training run's directory holds more (optimizer.pt,
    training_args.bin): those are not the model's, unless there is nothing else."""
    names = [name for name in names if not TRAINING_STATE.fullmatch(name)] or names
    if DEFAULT_NAME in names:
        return [DEFAULT_NAME], None
    found = [PART_NAME.fullmatch(name) for name in names]
    groups = {(m["prefix"], m["count"], m["suffix"]) for m in found if m}
    if names and all(found) and len(groups) == 1:
        prefix, count, suffix = groups.pop()
        expected = [f"{prefix}-{k:05d}-of-{count}{suffix}" for k in range(1, int(count) + 1)]
        missing = [name for name in expected if name not in names]
        if not missing and names == expected:
            return names, None
        if missing:
            why = f"holds parts of a sharded checkpoint of {int(count)} files, of which {_some(missing)}"
            return [], f"{why} cannot be found"
    if len(names) <= 1:
        return names, None
    why = f"holds several PyTorch checkpoints ({_some(names)}): name the one to open"
    return [], f"{why}, or give it an index ({INDEX_NAME})"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def fits(begins: list[int], ends: list[int], data_start: int, size: int, layout: Any) -> bool:
    """Whether tensors at these offsets could be a checkpoint's of `size` bytes: each inside the file
    (tied tensors share bytes, so they may overlap)."""
    return all(begin <= end for begin, end in zip(begins, ends, strict=True)) and max(ends, default=0) <= size


def table_bytes(first: bytes, size: int) -> int:
    """A checkpoint's table is not at its start (its central directory is at the end, its storages'
    headers throughout): a store gives the first bytes, and is asked for the rest as it is read."""
    return min(len(first), size)


def file_metadata(header: ShardHeader, read: Reader) -> dict[str, str] | None:
    """What the checkpoint says of itself, as its safetensors view says it: {"format": "pt"}."""
    return header.metadata


def described_metadata(header: ShardHeader, read: Reader, into: Described) -> dict[str, Any] | None:
    """{"format": "pt"}, as far as it fits `into`."""
    return into.of(header.metadata)


def across_files(shards: list[tuple[str, ShardHeader]]) -> list[Problem]:
    """Nothing beyond what every format's files are held to (unique names, the index)."""
    return []
