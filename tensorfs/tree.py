"""The mounted namespace: inodes, directories, entries, attributes and the bytes of small files.

Pure: no pyfuse3 here, so all of it is tested without a mount. The tree never changes once
built: inodes are fixed numbers, computed rather than stored, so a model of 100k tensors costs
a few lists, and anything else (a directory's listing, a .meta.json) is made on first use.

Inodes: 1 is the root; then every other directory; then .tensorfs/ and its files; then three per
tensor in sorted order: the tensor's bytes, its .meta.json and its .sha256.
"""

from __future__ import annotations

import json
import stat
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from .errors import TensorfsError
from .integrity import sha256sum_line
from .model import Model
from .names import RESERVED_DIR, SIDECAR_SUFFIXES, Layout, tensor_path

ROOT_INODE = 1
SUMS_NAME = "SHA256SUMS"
FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555
META_SUFFIX, SHA256_SUFFIX = SIDECAR_SUFFIXES


class Kind(Enum):
    DIRECTORY = "directory"
    TENSOR = "tensor"
    META = "meta"
    SHA256 = "sha256"
    CONTROL = "control"
    """A file of .tensorfs/ made from the model alone."""
    SUMS = "sums"
    """.tensorfs/SHA256SUMS: every tensor's hash, by path from the mount root."""


class NoSuchEntry(TensorfsError):
    """A name or inode that the tree does not hold."""


@dataclass(frozen=True, slots=True)
class Attributes:
    inode: int
    kind: Kind
    mode: int
    size: int
    nlink: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Node:
    """What an inode is: its kind and, for the files of a tensor, the tensor's name."""

    inode: int
    kind: Kind
    tensor: str | None = None
    control: str | None = None


class Tree:
    """The read-only tree of one mounted model."""

    def __init__(self, model: Model, layout: Layout, control_files: dict[str, Callable[[], bytes]]) -> None:
        """`control_files` maps each file of .tensorfs/ to the function that makes its bytes."""
        self.model = model
        self.names = model.names()
        self._shard_mtime_ns = {shard: model.shard_stat(shard).st_mtime_ns for shard in model.shards}
        self.mtime_ns = max(self._shard_mtime_ns.values(), default=0)

        # Directories: index 0 is the root; each knows its parent, its name and its tensors.
        self._dir_paths: list[str] = [""]
        self._dir_index: dict[str, int] = {"": 0}
        self._dir_parent: list[int] = [0]
        self._dir_tensors: list[list[int]] = [[]]
        self._dir_subdirs: list[list[int]] = [[]]
        self._basenames: list[str] = []
        for i, name in enumerate(self.names):
            directory, _, base = tensor_path(name, layout).rpartition("/")
            index = self._dir_index.get(directory)
            if index is None:
                index = self._add_directory(directory)
            self._dir_tensors[index].append(i)
            self._basenames.append(base)

        self.layout = layout
        self._control_names = sorted([*control_files, SUMS_NAME])
        self._control_makers = control_files
        self.control_dir_inode = ROOT_INODE + len(self._dir_paths)
        self._first_tensor_inode = self.control_dir_inode + 1 + len(self._control_names)
        self._listings: dict[int, list[tuple[str, int]]] = {}
        self._lookups: dict[int, dict[str, int]] = {}
        self._small_files: dict[int, bytes] = {}
        self._sums_size: int | None = None

    def _add_directory(self, path: str) -> int:
        parent_path, _, _ = path.rpartition("/")
        parent = self._dir_index.get(parent_path)
        if parent is None:
            parent = self._add_directory(parent_path)
        index = len(self._dir_paths)
        self._dir_paths.append(path)
        self._dir_index[path] = index
        self._dir_parent.append(parent)
        self._dir_tensors.append([])
        self._dir_subdirs.append([])
        self._dir_subdirs[parent].append(index)
        return index

    # -- inodes ----------------------------------------------------------------------------
    @property
    def inode_count(self) -> int:
        return self._first_tensor_inode - ROOT_INODE + 3 * len(self.names)

    def node(self, inode: int) -> Node:
        """What `inode` is; NoSuchEntry when the tree has no such inode."""
        if ROOT_INODE <= inode < self.control_dir_inode:
            return Node(inode, Kind.DIRECTORY)
        if inode == self.control_dir_inode:
            return Node(inode, Kind.DIRECTORY)
        if self.control_dir_inode < inode < self._first_tensor_inode:
            control = self._control_names[inode - self.control_dir_inode - 1]
            return Node(inode, Kind.SUMS if control == SUMS_NAME else Kind.CONTROL, control=control)
        offset = inode - self._first_tensor_inode
        if 0 <= offset < 3 * len(self.names):
            tensor, which = divmod(offset, 3)
            return Node(inode, (Kind.TENSOR, Kind.META, Kind.SHA256)[which], tensor=self.names[tensor])
        raise NoSuchEntry(f"no inode {inode}")

    def tensor_inode(self, name: str) -> int:
        """The inode of tensor `name`'s file (its sidecars follow it)."""
        index = _bisect(self.names, name)
        return self._first_tensor_inode + 3 * index

    # -- directories -----------------------------------------------------------------------
    def listing(self, inode: int) -> list[tuple[str, int]]:
        """The entries of directory `inode` as (name, inode), sorted by name; made on first use."""
        listing = self._listings.get(inode)
        if listing is None:
            listing = sorted(self._entries(inode))
            self._listings[inode] = listing
        return listing

    def _entries(self, inode: int) -> list[tuple[str, int]]:
        if inode == self.control_dir_inode:
            return [(name, self.control_dir_inode + 1 + i) for i, name in enumerate(self._control_names)]
        index = self._dir_number(inode)
        entries = [(self._dir_paths[sub].rpartition("/")[2], ROOT_INODE + sub) for sub in self._dir_subdirs[index]]
        first = self._first_tensor_inode
        for t in self._dir_tensors[index]:
            base = self._basenames[t]
            file_inode = first + 3 * t
            entries += [
                (base, file_inode),
                (base + META_SUFFIX, file_inode + 1),
                (base + SHA256_SUFFIX, file_inode + 2),
            ]
        if index == 0:
            entries.append((RESERVED_DIR, self.control_dir_inode))
        return entries

    def lookup(self, parent: int, name: str) -> int:
        """The inode of `name` in directory `parent`; NoSuchEntry when there is none."""
        table = self._lookups.get(parent)
        if table is None:
            table = dict(self.listing(parent))
            self._lookups[parent] = table
        found = table.get(name)
        if found is None:
            raise NoSuchEntry(f"no entry {name!r} in directory {parent}")
        return found

    def parent(self, inode: int) -> int:
        """The parent directory of directory `inode` (the root is its own parent)."""
        if inode == self.control_dir_inode:
            return ROOT_INODE
        return ROOT_INODE + self._dir_parent[self._dir_number(inode)]

    def _dir_number(self, inode: int) -> int:
        index = inode - ROOT_INODE
        if not 0 <= index < len(self._dir_paths):
            raise NoSuchEntry(f"inode {inode} is not a directory")
        return index

    # -- attributes and contents -----------------------------------------------------------
    def attributes(self, inode: int) -> Attributes:
        node = self.node(inode)
        if node.kind is Kind.DIRECTORY:
            subdirs = 0 if inode == self.control_dir_inode else len(self._dir_subdirs[self._dir_number(inode)])
            subdirs += inode == ROOT_INODE  # .tensorfs/
            return Attributes(inode, node.kind, DIR_MODE, 0, 2 + subdirs, self.mtime_ns)
        if node.kind is Kind.TENSOR:
            assert node.tensor is not None
            info = self.model.info(node.tensor)
            return Attributes(inode, node.kind, FILE_MODE, info.nbytes, 1, self._shard_mtime_ns[info.shard])
        if node.kind is Kind.SHA256:
            assert node.tensor is not None
            size = len(sha256_line("0" * 64, self._basename(node.tensor)))
            return Attributes(inode, node.kind, FILE_MODE, size, 1, self._tensor_mtime(node.tensor))
        if node.kind is Kind.SUMS:
            if self._sums_size is None:
                self._sums_size = len(self.sha256sums(dict.fromkeys(self.names, "0" * 64)))
            return Attributes(inode, node.kind, FILE_MODE, self._sums_size, 1, self.mtime_ns)
        mtime = self.mtime_ns if node.tensor is None else self._tensor_mtime(node.tensor)
        return Attributes(inode, node.kind, FILE_MODE, len(self.small_file(inode)), 1, mtime)

    def _tensor_mtime(self, name: str) -> int:
        return self._shard_mtime_ns[self.model.info(name).shard]

    def _basename(self, name: str) -> str:
        return self._basenames[_bisect(self.names, name)]

    def small_file(self, inode: int) -> bytes:
        """The bytes of a .meta.json or a .tensorfs/ file, made on first use."""
        content = self._small_files.get(inode)
        if content is None:
            node = self.node(inode)
            if node.kind is Kind.META:
                assert node.tensor is not None
                content = meta_json(self.model, node.tensor)
            elif node.kind is Kind.CONTROL:
                assert node.control is not None
                content = self._control_makers[node.control]()
            else:
                raise NoSuchEntry(f"inode {inode} is not a small file")
            self._small_files[inode] = content
        return content

    def sha256_file(self, inode: int, hex_digest: str) -> bytes:
        """The .sha256 sidecar of inode `inode`, given its tensor's digest."""
        node = self.node(inode)
        assert node.kind is Kind.SHA256 and node.tensor is not None
        return sha256_line(hex_digest, self._basename(node.tensor))

    def sha256sums(self, digests: Mapping[str, str]) -> bytes:
        """SHA256SUMS: a line per tensor, by path from the mount root, for `sha256sum -c` there."""
        layout = self.layout
        return "".join(sha256sum_line(digests[name], tensor_path(name, layout)) for name in self.names).encode()

    @property
    def sums_inode(self) -> int:
        return self.control_dir_inode + 1 + self._control_names.index(SUMS_NAME)


def meta_json(model: Model, name: str) -> bytes:
    """The .meta.json of a tensor: what a reader needs to map its file (np.memmap and friends)."""
    return (json.dumps(model.info(name).as_json(), ensure_ascii=False) + "\n").encode("utf-8")


def sha256_line(hex_digest: str, filename: str) -> bytes:
    """A line `sha256sum -c` accepts, escaping the name as GNU sha256sum does when it must."""
    return sha256sum_line(hex_digest, filename).encode()


def index_json(model: Model) -> bytes:
    """A model.safetensors.index.json-style index of what is mounted."""
    weight_map = {name: model.info(name).shard.name for name in model.names()}
    document = {"metadata": {"total_size": model.nbytes}, "weight_map": weight_map}
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _bisect(names: list[str], name: str) -> int:
    index = bisect_left(names, name)
    if index == len(names) or names[index] != name:
        raise NoSuchEntry(f"no tensor {name!r}")
    return index
