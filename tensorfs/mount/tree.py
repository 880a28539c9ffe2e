"""The mounted namespace: inodes, directories, entries, attributes and the bytes of small files.

Pure: no pyfuse3 here, so all of it is tested without a mount. The tree never changes once
built, and a model may hold 100k tensors, so nothing is stored per entry: inodes are computed,
a directory's entries are found by arithmetic, names by bisection in the sorted tensor paths, and
a .meta.json's size by adding up the lengths of its parts.

Inodes: 1 is the root, then every other directory, then .tensorfs/ and everything in it (its
files, and the model directory view with its files), then three per tensor in path order: the
tensor's bytes, its .meta.json and its .sha256. A directory lists its subdirectories (and, at the
root, .tensorfs), then each of its tensors' three files.
"""

from __future__ import annotations

import os
import stat
import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from ..errors import TensorfsError
from ..formats import BEGIN, END, NAME
from ..proof.manifest import sha256sum_line
from ..utils.identity import ShardKey, shard_name
from ..utils.names import CONTROL_DIR, SIDECAR_SUFFIXES, Layout, tensor_path
from ..views import VIEW_DIR, Companion, ModelView, SynthesizedFile, ViewFile, WeightsFile
from .contents import checkable, entry_meta_size, meta_json, meta_size, sha256_line

if TYPE_CHECKING:
    from ..model import Model

ROOT_INODE = 1
SUMS_NAME = "SHA256SUMS"
_READ_BITS = 0o444
META_SUFFIX, SHA256_SUFFIX = SIDECAR_SUFFIXES
SUFFIXES = ("", META_SUFFIX, SHA256_SUFFIX)
_HEX_LINE = len("0" * 64 + "  \n")


class Kind(Enum):
    DIRECTORY = "directory"
    TENSOR = "tensor"
    META = "meta"
    SHA256 = "sha256"
    CONTROL = "control"
    """A file of .tensorfs/ made from the model alone."""
    SUMS = "sums"
    """.tensorfs/SHA256SUMS: every tensor's hash, by path from the mount root."""
    VIEW = "view"
    """A file of the model directory view (.tensorfs/model/): synthesized, or the source's own."""


_TENSOR_KINDS = (Kind.TENSOR, Kind.META, Kind.SHA256)
_EVERY_TENSOR_FILES = ("index.json", "metadata.json")  # control files that tell of every shard (and SHA256SUMS)


class NoSuchEntry(TensorfsError):
    """A name or inode that the tree does not hold."""


@dataclass(frozen=True)
class Ownership:
    """Owner, group and permissions for every file (-o uid=,gid=,umask=) instead of the source's."""

    uid: int | None = None
    gid: int | None = None
    umask: int | None = None


@dataclass(frozen=True, slots=True)
class Access:
    """Who owns a group of files and who may read them."""

    uid: int
    gid: int
    file_mode: int
    dir_mode: int

    @classmethod
    def of(cls, st: os.stat_result, ownership: Ownership) -> Access:
        """The source file's owner and read bits (and matching search bits for directories), or the overrides."""
        if ownership.umask is None:
            read = st.st_mode & _READ_BITS
            files, directories = read, read | read >> 2  # r-- becomes r-x
        else:
            files, directories = _READ_BITS & ~ownership.umask, 0o555 & ~ownership.umask
        return cls(
            st.st_uid if ownership.uid is None else ownership.uid,
            st.st_gid if ownership.gid is None else ownership.gid,
            stat.S_IFREG | files,
            stat.S_IFDIR | directories,
        )


@dataclass(frozen=True, slots=True)
class Attributes:
    inode: int
    kind: Kind
    mode: int
    size: int
    nlink: int
    mtime_ns: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class Node:
    """What an inode is: its kind and, for the files of a tensor, the tensor's name."""

    inode: int
    kind: Kind
    tensor: str | None = None
    control: str | None = None
    """For what is in .tensorfs/: its path there (index.json, model/config.json)."""


@dataclass(frozen=True, slots=True)
class _ControlNode:
    """.tensorfs/ or something in it: few, so each is an object."""

    path: str
    """Relative to .tensorfs/ ('' for itself)."""
    kind: Kind
    parent: int
    """Index of its directory among the static nodes (.tensorfs/ is its own)."""
    children: dict[str, int]
    """A directory's entries: name -> index, in listing order."""
    listing: list[tuple[str, int]]
    """The same entries as a list, for readdir's positions."""
    in_view: str | None = None
    """For the view's subdirectories and files: the path in the view (config.json, 1_Pooling/x)."""


class Buildable(Protocol):
    """What an answer needs made first, and may be made elsewhere (off the request thread): a
    synthesized file's layout, a control file's bytes."""

    @property
    def built(self) -> bool: ...

    def build(self) -> None: ...


class ControlFile:
    """A file of .tensorfs/ made from the model once, on first use (index.json and metadata.json tell of
    every tensor or every key of a model: a daemon makes them off its request thread, see Tree.unbuilt)."""

    def __init__(self, make: Callable[[], bytes]) -> None:
        self._make = make
        self._lock = threading.Lock()  # two requests may ask for it at once, on two threads
        self._content: bytes | None = None

    @property
    def built(self) -> bool:
        return self._content is not None

    def build(self) -> None:
        """Make the bytes now (made on first use otherwise)."""
        with self._lock:
            if self._content is None:
                self._content = self._make()

    @property
    def content(self) -> bytes:
        self.build()
        assert self._content is not None
        return self._content


class Tree:
    """The read-only tree of one mounted model."""

    def __init__(
        self,
        model: Model,
        layout: Layout,
        control_files: dict[str, Callable[[], bytes]],
        ownership: Ownership | None = None,
        view: ModelView | None = None,
    ) -> None:
        """`control_files` maps each file of .tensorfs/ to the function that makes its bytes;
        `view`, when given, is served as .tensorfs/model/."""
        self.model = model
        self.view = view
        self.companions_now: dict[str, os.stat_result] = {}
        """Local companions' statuses as last looked up (follow()), by path: their owners and modes now."""
        self.layout = layout
        self.ownership = ownership or Ownership()
        if layout == "slash":
            self.paths = self.names = model.sorted_names  # a name is its path: one list serves both
        else:
            pairs = sorted((tensor_path(name, layout), name) for name in model.sorted_names)
            self.paths = [path for path, _ in pairs]
            self.names = [name for _, name in pairs]
        shard_stats = {shard: model.shard_data(shard).status() for shard in model.shards}
        self._shard_mtime_ns = {shard: st.st_mtime_ns for shard, st in shard_stats.items()}
        self.mtime_ns = max(self._shard_mtime_ns.values(), default=0)
        # Each tensor's files are owned and readable as its shard is; directories and .tensorfs/ as
        # the source (the model's directory, or its file).
        self._shard_access = {shard: Access.of(st, self.ownership) for shard, st in shard_stats.items()}
        try:
            source = os.stat(model.source)
        except OSError:
            source = shard_stats[model.shards[0]]
        self.access = Access.of(source, self.ownership)
        self._sums_access = self._every_shard_access()

        # Directories: index 0 is the root; each knows its path, parent, subdirectories and tensors.
        self._dir_paths: list[str] = [""]
        self._dir_index: dict[str, int] = {"": 0}
        self._dir_parent: list[int] = [0]
        self._dir_subdirs: list[list[int]] = [[]]
        self._dir_tensors: list[Sequence[int]] = [range(len(self.paths))]
        if any("/" in path for path in self.paths):
            tensors_of: list[array[int]] = [array("L")]
            self._dir_tensors = tensors_of  # type: ignore[assignment]
            for i, path in enumerate(self.paths):
                directory = path.rpartition("/")[0]
                index = self._dir_index.get(directory)
                if index is None:
                    index = self._add_directory(directory)
                tensors_of[index].append(i)
        for subdirs in self._dir_subdirs:
            subdirs.sort(key=self._dir_paths.__getitem__)

        self._control_files = {name: ControlFile(make) for name, make in control_files.items()}
        self.control_dir_inode = ROOT_INODE + len(self._dir_paths)
        self._static = _static_nodes(control_files, view)
        self._first_tensor_inode = self.control_dir_inode + len(self._static)
        self._sums_size: int | None = None

    def _add_directory(self, path: str) -> int:
        parent_path = path.rpartition("/")[0]
        parent = self._dir_index.get(parent_path)
        if parent is None:
            parent = self._add_directory(parent_path)
        index = len(self._dir_paths)
        self._dir_paths.append(path)
        self._dir_index[path] = index
        self._dir_parent.append(parent)
        self._dir_subdirs.append([])
        self._dir_tensors.append(array("L"))
        self._dir_subdirs[parent].append(index)
        return index

    def _every_shard_access(self) -> Access:
        """SHA256SUMS and index.json tell of every tensor: readable only with what every shard grants."""
        file_mode = self.access.file_mode
        for access in self._shard_access.values():
            file_mode &= access.file_mode | ~_READ_BITS
        return Access(self.access.uid, self.access.gid, file_mode, self.access.dir_mode)

    def refresh_shard(self, shard: ShardKey) -> bool:
        """Take the shard file's owner, permissions and mtime again; whether any of them changed (a
        file of another model the view serves as it is: its status is taken at every ask)."""
        if shard not in self._shard_access:
            return True
        st = self.model.shard_data(shard).status()
        access = Access.of(st, self.ownership)
        if access == self._shard_access[shard] and st.st_mtime_ns == self._shard_mtime_ns[shard]:
            return False
        self._shard_access[shard] = access
        self._shard_mtime_ns[shard] = st.st_mtime_ns
        self._sums_access = self._every_shard_access()
        return True

    def inodes_of(self, shard: ShardKey) -> list[int]:
        """The inodes of every file with bytes of the shard: its tensors' files and their two sidecars,
        and the view's files made of tensors (synthesized, or the shard's own file)."""
        inodes: list[int] = []
        if shard in self._shard_access:  # (not: a shard of another model whose file the view serves)
            first = [self.tensor_inode(entry[NAME]) for entry in self.model.shard_header(shard).entries]
            inodes += [inode + which for inode in first for which in range(3)]
        if self.view is not None:
            for index, node in enumerate(self._static):
                if node.kind is not Kind.VIEW or node.in_view is None:
                    continue
                content = self.view.files[node.in_view]
                # A file never read has nothing in the kernel's cache to drop.
                if isinstance(content, SynthesizedFile | WeightsFile) and content.built and content.draws_on(shard):
                    inodes.append(self.control_dir_inode + index)
        return inodes

    # -- inodes ----------------------------------------------------------------------------
    @property
    def inode_count(self) -> int:
        return self._first_tensor_inode - ROOT_INODE + 3 * len(self.paths)

    def node(self, inode: int) -> Node:
        """What `inode` is; NoSuchEntry when the tree has no such inode."""
        if ROOT_INODE <= inode < self.control_dir_inode:
            return Node(inode, Kind.DIRECTORY)
        if self.control_dir_inode <= inode < self._first_tensor_inode:
            static = self._static[inode - self.control_dir_inode]
            return Node(inode, static.kind, control=static.path or None)
        tensor, which = divmod(inode - self._first_tensor_inode, 3)
        if 0 <= tensor < len(self.names):
            return Node(inode, _TENSOR_KINDS[which], tensor=self.names[tensor])
        raise NoSuchEntry(f"no inode {inode}")

    def tensor_inode(self, name: str) -> int:
        """The inode of tensor `name`'s file (its sidecars follow it)."""
        return self._first_tensor_inode + 3 * self._path_index(tensor_path(name, self.layout))

    def _path_index(self, path: str) -> int:
        index = bisect_left(self.paths, path)
        if index == len(self.paths) or self.paths[index] != path:
            raise NoSuchEntry(f"no tensor at {path!r}")
        return index

    def _basename(self, tensor: int) -> str:
        return self.paths[tensor].rpartition("/")[2]

    # -- directories -----------------------------------------------------------------------
    def _static_dir(self, inode: int) -> _ControlNode | None:
        """The node of a directory in .tensorfs/ (or of .tensorfs/ itself); None for any other inode."""
        if self.control_dir_inode <= inode < self._first_tensor_inode:
            static = self._static[inode - self.control_dir_inode]
            if static.kind is Kind.DIRECTORY:
                return static
        return None

    def entry_count(self, inode: int) -> int:
        """How many entries directory `inode` holds."""
        static = self._static_dir(inode)
        if static is not None:
            return len(static.children)
        index = self._dir_number(inode)
        return len(self._dir_subdirs[index]) + (index == 0) + 3 * len(self._dir_tensors[index])

    def entry_at(self, inode: int, position: int) -> tuple[str, int]:
        """Entry number `position` (from 0) of directory `inode`, as (name, inode)."""
        static = self._static_dir(inode)
        if static is not None:
            name, child = static.listing[position]
            return name, self.control_dir_inode + child
        index = self._dir_number(inode)
        subdirs = self._dir_subdirs[index]
        if position < len(subdirs):
            sub = subdirs[position]
            return self._dir_paths[sub].rpartition("/")[2], ROOT_INODE + sub
        position -= len(subdirs)
        if index == 0:
            if position == 0:
                return CONTROL_DIR, self.control_dir_inode
            position -= 1
        tensor, which = divmod(position, 3)
        t = self._dir_tensors[index][tensor]
        return self._basename(t) + SUFFIXES[which], self._first_tensor_inode + 3 * t + which

    def scan(self, inode: int, position: int) -> Iterator[tuple[str, int, int, int, int, int, int, int]]:
        """Entries of directory `inode` from `position` on: (name, inode, mode, size, nlink, mtime_ns, uid, gid).

        What readdir needs, made in one pass: what the three files of a tensor share is found once.
        """
        count = self.entry_count(inode)
        static = self._static_dir(inode) is not None
        if static or position < count - 3 * len(self._dir_tensors[self._dir_number(inode)]):
            # Subdirectories, .tensorfs and control files: few, taken one by one.
            while position < count:
                name, child = self.entry_at(inode, position)
                if self.node(child).kind not in _TENSOR_KINDS:
                    a = self.attributes(child)
                    yield name, child, a.mode, a.size, a.nlink, a.mtime_ns, a.uid, a.gid
                    position += 1
                    continue
                break
        if position >= count or static:
            return
        index = self._dir_number(inode)
        tensors = self._dir_tensors[index]
        first_tensor = count - 3 * len(tensors)
        start, which = divmod(position - first_tensor, 3)
        model, paths, names, first_inode = self.model, self.paths, self.names, self._first_tensor_inode
        mtimes, accesses = self._shard_mtime_ns, self._shard_access
        for k in range(start, len(tensors)):  # by index: slicing an array would copy the rest of it
            t = tensors[k]
            shard, data_start, entry = model.entry(names[t])
            base = paths[t].rpartition("/")[2]
            mtime, access = mtimes[shard], accesses[shard]
            mode, uid, gid = access.file_mode, access.uid, access.gid
            file_inode = first_inode + 3 * t
            if which == 0:
                yield base, file_inode, mode, entry[END] - entry[BEGIN], 1, mtime, uid, gid
            if which <= 1:
                size = entry_meta_size(entry, data_start, shard_name(shard), model.shard_header(shard).format)
                yield base + META_SUFFIX, file_inode + 1, mode, size, 1, mtime, uid, gid
            yield base + SHA256_SUFFIX, file_inode + 2, mode, self._sha256_size(t), 1, mtime, uid, gid
            which = 0

    def listing(self, inode: int) -> list[tuple[str, int]]:
        """Every entry of directory `inode` as (name, inode)."""
        return [self.entry_at(inode, i) for i in range(self.entry_count(inode))]

    def lookup(self, parent: int, name: str) -> int:
        """The inode of `name` in directory `parent`; NoSuchEntry when there is none."""
        static = self._static_dir(parent)
        if static is not None:
            child = static.children.get(name)
            if child is None:
                raise NoSuchEntry(f"no {name!r} in {CONTROL_DIR}/{static.path}")
            return self.control_dir_inode + child
        index = self._dir_number(parent)
        if index == 0 and name == CONTROL_DIR:
            return self.control_dir_inode
        prefix = self._dir_paths[index] + "/" if index else ""
        sub = self._dir_index.get(prefix + name)
        if sub is not None and "/" not in name:
            return ROOT_INODE + sub
        for which, suffix in enumerate(SUFFIXES):
            if name.endswith(suffix) and len(name) > len(suffix):
                base = name[: len(name) - len(suffix)] if suffix else name
                if "/" in base:
                    break
                try:
                    return self._first_tensor_inode + 3 * self._path_index(prefix + base) + which
                except NoSuchEntry:
                    continue
        raise NoSuchEntry(f"no entry {name!r} in directory {parent}")

    def parent(self, inode: int) -> int:
        """The parent directory of directory `inode` (the root is its own parent)."""
        if inode == self.control_dir_inode:
            return ROOT_INODE
        static = self._static_dir(inode)
        if static is not None:
            return self.control_dir_inode + static.parent
        return ROOT_INODE + self._dir_parent[self._dir_number(inode)]

    def _dir_number(self, inode: int) -> int:
        index = inode - ROOT_INODE
        if not 0 <= index < len(self._dir_paths):
            raise NoSuchEntry(f"inode {inode} is not a directory")
        return index

    # -- attributes and contents -----------------------------------------------------------
    def attributes(self, inode: int) -> Attributes:
        tensor, which = divmod(inode - self._first_tensor_inode, 3)
        if 0 <= tensor < len(self.names):  # the common case first: a tensor's file
            name = self.names[tensor]
            shard, _, nbytes = self.model.locate(name)
            mtime, access = self._shard_mtime_ns[shard], self._shard_access[shard]
            if which == 0:
                kind, size = Kind.TENSOR, nbytes
            elif which == 1:
                kind, size = Kind.META, meta_size(self.model, name)
            else:
                kind, size = Kind.SHA256, self._sha256_size(tensor)
            return Attributes(inode, kind, access.file_mode, size, 1, mtime, access.uid, access.gid)
        node = self.node(inode)
        access = self.access
        if node.kind is Kind.DIRECTORY:
            static = self._static_dir(inode)
            if static is not None:
                subdirs = sum(self._static[child].kind is Kind.DIRECTORY for child in static.children.values())
                source = self.view.directory_status.get(static.in_view) if self.view and static.in_view else None
                if source is not None:  # a subdirectory of the view: as its source directory is
                    access = Access.of(source, self.ownership)
            else:
                subdirs = len(self._dir_subdirs[self._dir_number(inode)]) + (inode == ROOT_INODE)  # .tensorfs/
            return Attributes(inode, node.kind, access.dir_mode, 0, 2 + subdirs, self.mtime_ns, access.uid, access.gid)
        if node.kind is Kind.VIEW:
            content = self.view_file(inode)
            mtime = self.mtime_ns
            if isinstance(content, SynthesizedFile):
                access, size = self._sums_access, content.size  # made of the shards: readable as they all are
            elif isinstance(content, WeightsFile):  # the shard's own file: as it is
                st = content.status()
                mtime, size, access = st.st_mtime_ns, content.size, Access.of(st, self.ownership)
            elif isinstance(content, Companion):
                mtime, size = content.mtime_ns, content.size
                status = self.companions_now.get(content.path, content.status)
                if status is not None:  # no more readable than the source's file is now
                    access = Access.of(status, self.ownership)
            else:  # the index of several synthesized files: it lists every tensor
                access, size = self._sums_access, len(content)
            return Attributes(inode, node.kind, access.file_mode, size, 1, mtime, access.uid, access.gid)
        if node.kind is Kind.SUMS:
            if self._sums_size is None:
                self._sums_size = len(self.sha256sums(dict.fromkeys(self.names, "0" * 64)))
            access = self._sums_access
            size = self._sums_size
        else:
            if node.control in _EVERY_TENSOR_FILES:
                access = self._sums_access
            size = len(self.small_file(inode))
        return Attributes(inode, node.kind, access.file_mode, size, 1, self.mtime_ns, access.uid, access.gid)

    def _sha256_size(self, tensor: int) -> int:
        base = self._basename(tensor)
        if base.isascii() and "\\" not in base and "\n" not in base and "\r" not in base and base != "-":
            return _HEX_LINE + len(base)
        return len(sha256_line("0" * 64, base))

    def small_file(self, inode: int) -> bytes:
        """The bytes of a .meta.json or a .tensorfs/ file (the latter made once, on first use)."""
        node = self.node(inode)
        if node.kind is Kind.META:
            assert node.tensor is not None
            return meta_json(self.model, node.tensor)  # cheap enough to make again: nothing kept per tensor
        if node.kind is not Kind.CONTROL:
            raise NoSuchEntry(f"inode {inode} is not a small file")
        assert node.control is not None
        return self._control_files[node.control].content

    def sha256_file(self, inode: int, hex_digest: str) -> bytes:
        """The .sha256 sidecar of inode `inode`, given its tensor's digest."""
        tensor, which = divmod(inode - self._first_tensor_inode, 3)
        assert which == 2 and 0 <= tensor < len(self.names)
        return sha256_line(hex_digest, self._basename(tensor))

    def sha256sums(self, digests: Mapping[str, str]) -> bytes:
        """SHA256SUMS: a line per tensor, by path from the mount root, for `sha256sum -c` there."""
        return "".join(
            sha256sum_line(digests[name], checkable(path)) for name, path in zip(self.names, self.paths, strict=True)
        ).encode()

    @property
    def sums_inode(self) -> int:
        return self.lookup(self.control_dir_inode, SUMS_NAME)

    def unbuilt(self, inode: int, *, listing: bool = False) -> list[Buildable]:
        """What the attributes of `inode` would make (with `listing`, of the entries of directory
        `inode`): synthesized files' layouts, control files' bytes. The caller may make them first,
        elsewhere."""
        if not self.control_dir_inode <= inode < self._first_tensor_inode:
            return []
        node = self._static[inode - self.control_dir_inode]
        nodes = [self._static[child] for child in node.children.values()] if listing else [node]
        found: list[Buildable] = [self._control_files[n.path] for n in nodes if n.kind is Kind.CONTROL]
        if self.view is not None:
            views = [self.view.files[n.in_view] for n in nodes if n.kind is Kind.VIEW and n.in_view is not None]
            found += [file for file in views if isinstance(file, SynthesizedFile | WeightsFile)]
        return [file for file in found if not file.built]

    def followed(self, inode: int) -> Companion | None:
        """The local companion `inode` is, whose owner and mode are followed (looked up again before
        each answer about it, and kept by the kernel a moment only); None for any other inode."""
        if not self.control_dir_inode <= inode < self._first_tensor_inode:
            return None
        static = self._static[inode - self.control_dir_inode]
        if static.kind is not Kind.VIEW or static.in_view is None or self.view is None:
            return None
        content = self.view.files[static.in_view]
        return content if isinstance(content, Companion) and content.status is not None else None

    def follow(self, companion: Companion) -> None:
        """Look the companion's status up again (blocking: its file, beneath the model's directory)."""
        assert self.view is not None
        found = self.view.companions.status(companion.path)
        if found is not None:
            self.companions_now[companion.path] = found

    def view_file(self, inode: int) -> ViewFile:
        """What a file of the view is: a synthesized safetensors file, a weights file as it is, a
        companion file, or bytes."""
        static = self._view_node(inode)
        if static is None or static.in_view is None or static.kind is not Kind.VIEW or self.view is None:
            raise NoSuchEntry(f"inode {inode} is not a file of the view")
        return self.view.files[static.in_view]

    def _view_node(self, inode: int) -> _ControlNode | None:
        """The node of a subdirectory or file of the view; None for any other inode."""
        if self.control_dir_inode <= inode < self._first_tensor_inode:
            static = self._static[inode - self.control_dir_inode]
            if static.in_view is not None:
                return static
        return None


def _static_nodes(control_files: Mapping[str, object], view: ModelView | None) -> list[_ControlNode]:
    """.tensorfs/ and everything in it, as a list: its files, then the view's directories and files.

    Entries are listed by name. The first is .tensorfs/ itself; inodes follow the list's order.
    """
    kinds = {name: Kind.CONTROL for name in control_files} | {SUMS_NAME: Kind.SUMS}
    if view is not None:
        kinds[VIEW_DIR] = Kind.DIRECTORY
        kinds.update({f"{VIEW_DIR}/{path}": Kind.DIRECTORY for path in view.directories})
        kinds.update({f"{VIEW_DIR}/{path}": Kind.VIEW for path in view.files})
    paths = ["", *sorted(kinds)]
    index = {path: i for i, path in enumerate(paths)}
    nodes: list[_ControlNode] = []
    for path in paths:
        parent = index[path.rpartition("/")[0]] if path else 0
        in_view = path.removeprefix(VIEW_DIR + "/") if path.startswith(VIEW_DIR + "/") else None
        nodes.append(_ControlNode(path, kinds.get(path, Kind.DIRECTORY), parent, {}, [], in_view))
    for i, node in enumerate(nodes[1:], 1):
        nodes[node.parent].listing.append((node.path.rpartition("/")[2], i))
    for node in nodes:
        node.listing.sort()
        node.children.update(node.listing)
    return nodes
