"""The namespace of a mount, without a mount."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorfs
from helpers import entry, raw_shard, write_reference
from tensorfs.mount.contents import index_json, meta_json, meta_size, sha256_line
from tensorfs.mount.tree import ROOT_INODE, Kind, NoSuchEntry, Ownership, Tree


@pytest.fixture
def model(tmp_path: Path) -> Iterator[tensorfs.Model]:
    write_reference(
        tmp_path / "m.safetensors",
        {
            "b/x": ("F32", [2], bytes(8)),
            "b/c/y": ("BF16", [3], bytes(6)),
            "a": ("U8", [], b"\x07"),
            "é": ("F4", [2], b"\x21"),
        },
    )
    with tensorfs.open_model(tmp_path / "m.safetensors") as opened:
        yield opened


def make_tree(model: tensorfs.Model, layout: str = "slash") -> Tree:
    return Tree(model, layout, {"index.json": lambda: index_json(model), "hello": lambda: b"hi\n"})  # type: ignore[arg-type]


def walk(tree: Tree, inode: int = ROOT_INODE, prefix: str = "") -> dict[str, int]:
    found = {}
    for name, child in tree.listing(inode):
        found[prefix + name] = child
        if tree.node(child).kind is Kind.DIRECTORY:
            found.update(walk(tree, child, prefix + name + "/"))
    return found


def test_every_tensor_has_a_file_and_two_sidecars(model: tensorfs.Model) -> None:
    tree = make_tree(model)
    paths = walk(tree)
    assert sorted(paths) == sorted(
        [
            ".tensorfs", ".tensorfs/SHA256SUMS", ".tensorfs/hello", ".tensorfs/index.json",
            "a", "a.meta.json", "a.sha256",
            "b", "b/c", "b/c/y", "b/c/y.meta.json", "b/c/y.sha256",
            "b/x", "b/x.meta.json", "b/x.sha256",
            "é", "é.meta.json", "é.sha256",
        ]
    )  # fmt: skip
    assert len(set(paths.values())) == len(paths)  # one inode per entry
    assert tree.node(paths["b/c/y"]).tensor == "b/c/y"
    assert tree.node(paths["b/c/y.sha256"]).kind is Kind.SHA256
    assert tree.tensor_inode("b/c/y") == paths["b/c/y"]


def test_lookup_and_parent(model: tensorfs.Model) -> None:
    tree = make_tree(model)
    b = tree.lookup(ROOT_INODE, "b")
    c = tree.lookup(b, "c")
    assert tree.parent(c) == b and tree.parent(b) == ROOT_INODE and tree.parent(ROOT_INODE) == ROOT_INODE
    assert tree.lookup(c, "y") == walk(tree)["b/c/y"]
    with pytest.raises(NoSuchEntry):
        tree.lookup(ROOT_INODE, "nope")
    with pytest.raises(NoSuchEntry):
        tree.lookup(walk(tree)["a"], "x")  # a file is no directory
    with pytest.raises(NoSuchEntry):
        tree.node(10_000)


def test_attributes(model: tensorfs.Model) -> None:
    shard = model.shards[0]
    os.chmod(shard, 0o640)
    tree = make_tree(model)
    paths = walk(tree)
    st = shard.stat()
    root = tree.attributes(ROOT_INODE)
    # directories: the source's owner, its read bits with the matching search bits; files: the shard's
    assert (root.mode, root.nlink, root.mtime_ns, root.uid, root.gid) == (
        0o40550,
        4,
        st.st_mtime_ns,
        st.st_uid,
        st.st_gid,
    )
    x = tree.attributes(paths["b/x"])
    assert (x.mode, x.size, x.nlink, x.mtime_ns, x.uid, x.gid) == (0o100440, 8, 1, st.st_mtime_ns, st.st_uid, st.st_gid)
    assert tree.attributes(paths["b"]).mode == 0o40550
    assert tree.attributes(paths["a"]).size == 1
    assert tree.attributes(paths["a.sha256"]).size == len(f"{'0' * 64}  a\n")
    assert tree.attributes(paths["é.sha256"]).size == len(f"{'0' * 64}  é\n".encode())
    meta = tree.attributes(paths["b/x.meta.json"])
    assert meta.size == len(tree.small_file(paths["b/x.meta.json"]))
    assert tree.attributes(paths[".tensorfs/hello"]).size == 3


def test_permissions_follow_the_shards(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir(mode=0o755)
    write_reference(directory / "open.safetensors", {"open/w": ("U8", [1], b"a")})
    write_reference(directory / "private.safetensors", {"private/w": ("U8", [1], b"b")})
    os.chmod(directory / "open.safetensors", 0o644)
    os.chmod(directory / "private.safetensors", 0o600)
    os.chown(directory / "private.safetensors", 4242, 4343) if os.geteuid() == 0 else None
    with tensorfs.open_model(directory) as model:
        tree = make_tree(model)
        paths = walk(tree)
        private = (4242, 4343) if os.geteuid() == 0 else (os.getuid(), os.getgid())
        for name in ("private/w", "private/w.meta.json", "private/w.sha256"):
            a = tree.attributes(paths[name])
            assert (a.mode, a.uid, a.gid) == (0o100400, *private), name
        assert tree.attributes(paths["open/w.sha256"]).mode == 0o100444
        assert tree.attributes(paths["private"]).mode == 0o40555  # directories: as the source directory
        assert tree.attributes(paths[".tensorfs/hello"]).mode == 0o100444  # as the source directory
        assert tree.attributes(paths[".tensorfs/index.json"]).mode == 0o100400  # it names every shard's tensors
        assert tree.attributes(paths[".tensorfs/SHA256SUMS"]).mode == 0o100400  # what every shard grants
        # chmod of a shard under the mount: refreshed when the daemon sees it
        os.chmod(directory / "private.safetensors", 0o640)
        assert tree.refresh_shard(directory / "private.safetensors")
        assert tree.attributes(paths["private/w"]).mode == 0o100440
        assert not tree.refresh_shard(directory / "private.safetensors")
        assert set(tree.inodes_of(directory / "private.safetensors")) == {
            paths["private/w"],
            paths["private/w.meta.json"],
            paths["private/w.sha256"],
        }
        # -o uid=,gid=,umask= set them all instead
        override = Tree(model, "slash", {}, Ownership(uid=7, gid=8, umask=0o027))
        for name in ("private/w", "open/w.sha256", ".tensorfs/SHA256SUMS"):
            a = override.attributes(paths[name])
            assert (a.mode, a.uid, a.gid) == (0o100440, 7, 8), name
        assert override.attributes(paths["private"]).mode == 0o40550
        listed = {name: (mode, uid, gid) for name, _, mode, _, _, _, uid, gid in override.scan(paths["private"], 0)}
        assert listed == {name: (0o100440, 7, 8) for name in ("w", "w.meta.json", "w.sha256")}


def test_meta_json(model: tensorfs.Model) -> None:
    tree = make_tree(model)
    paths = walk(tree)
    meta = json.loads(tree.small_file(paths["b/c/y.meta.json"]))
    info = model.info("b/c/y")
    assert meta == {
        "name": "b/c/y",
        "dtype": "BF16",
        "shape": [3],
        "nbytes": 6,
        "shard": "m.safetensors",
        "offset": info.offset,
        "data_offsets": list(info.data_offsets),
        "numpy_dtype": "bfloat16",
    }
    assert info.numpy_dtype == np.dtype(meta["numpy_dtype"])  # the first imports ml_dtypes, which names bfloat16
    assert json.loads(tree.small_file(paths["é.meta.json"]))["numpy_dtype"] is None
    assert json.loads(tree.small_file(paths["a.meta.json"]))["numpy_dtype"] == "|u1"


def test_hostile_names_stay_inside_json(tmp_path: Path) -> None:
    name = 'q"}, "dtype": "X\n\\'
    (tmp_path / "m.safetensors").write_bytes(raw_shard({name: entry("U8", [1], 0, 1)}, b"x"))
    with tensorfs.open_model(tmp_path) as model:
        tree = make_tree(model)
        meta = json.loads(tree.small_file(tree.tensor_inode(name) + 1))
        assert meta["name"] == name and meta["dtype"] == "U8"


def test_sha256_lines_escape_like_gnu() -> None:
    digest = hashlib.sha256(b"").hexdigest()
    assert sha256_line(digest, "w") == f"{digest}  w\n".encode()
    assert sha256_line(digest, "a\\b\nc") == f"\\{digest}  a\\\\b\\nc\n".encode()


def test_dotted_layout(model: tensorfs.Model, tmp_path: Path) -> None:
    write_reference(tmp_path / "d.safetensors", {"m.l.0.w": ("U8", [1], b"a"), "m.l.1.w": ("U8", [1], b"b")})
    with tensorfs.open_model(tmp_path / "d.safetensors", layout="dotted") as dotted:
        paths = walk(make_tree(dotted, "dotted"))
        assert "m/l/0/w" in paths and "m/l/1/w.sha256" in paths and "m/l" in paths


def test_index_json(model: tensorfs.Model) -> None:
    document = json.loads(index_json(model))
    assert document == {
        "metadata": {"total_size": 8 + 6 + 1 + 1},
        "weight_map": dict.fromkeys(["a", "b/c/y", "b/x", "é"], "m.safetensors"),
    }


def test_meta_size_adds_up_to_the_meta_json(tmp_path: Path) -> None:
    names = ["a", 'q"uote', "back\\slash", "new\nline", "ünï/cødé", "名前", "tab\tx", "\x7f", "e" * 200, "sp ace"]
    header = {}
    offset = 0
    for i, name in enumerate(names):
        shape = [[], [0], [3, 5], [1, 1, 1, 7]][i % 4]
        dtype = ["F32", "BF16", "F4", "BOOL", "C64"][i % 5]
        bits = {"F32": 32, "BF16": 16, "F4": 4, "BOOL": 8, "C64": 64}[dtype]
        count = 1
        for dim in shape:
            count *= dim
        if count * bits % 8:
            shape, count = [2], 2
        nbytes = count * bits // 8
        header[name] = entry(dtype, shape, offset, offset + nbytes)
        offset += nbytes
    shard = tmp_path / "ünï shard.safetensors"
    shard.write_bytes(raw_shard(header, bytes(offset)))
    with tensorfs.open_model(shard) as model:
        for name in names:
            assert meta_size(model, name) == len(meta_json(model, name)), name


def test_the_model_directory_view_in_the_control_directory(model: tensorfs.Model, tmp_path: Path) -> None:
    from tensorfs.opening.view_files import ViewRule
    from tensorfs.views import Companion, SynthesizedFile, ViewSpec, build_view
    from tensorfs.views.local_files import find_companions

    source = tmp_path / "companions"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_bytes(b"{}")
    (source / "sub" / "x.txt").write_bytes(b"x")
    os.utime(source / "config.json", ns=(5, 5))
    companions = find_companions(source, ViewRule(folder=False)).companions
    view = build_view(model, model.gate, ViewSpec(companions, 2))
    tree = Tree(model, "slash", {"index.json": lambda: index_json(model)}, view=view)
    paths = walk(tree)
    assert [p for p in paths if p.startswith(".tensorfs/")] == [
        ".tensorfs/SHA256SUMS",
        ".tensorfs/index.json",
        ".tensorfs/model",
        ".tensorfs/model/config.json",
        ".tensorfs/model/model-00001-of-00002.safetensors",
        ".tensorfs/model/model-00002-of-00002.safetensors",
        ".tensorfs/model/model.safetensors.index.json",
        ".tensorfs/model/sub",
        ".tensorfs/model/sub/x.txt",
        ".tensorfs/model/tensorfs-view.json",
    ]
    assert len(set(paths.values())) == len(paths) and tree.inode_count == len(paths) + 1  # the root too
    for path, inode in paths.items():
        parent = path.rpartition("/")[0]
        if tree.node(inode).kind is Kind.DIRECTORY:
            assert tree.parent(inode) == paths.get(parent, ROOT_INODE)
        assert tree.lookup(paths.get(parent, ROOT_INODE), path.rpartition("/")[2]) == inode
    sub = paths[".tensorfs/model/sub"]
    assert tree.parent(sub) == paths[".tensorfs/model"] and tree.attributes(paths[".tensorfs/model"]).nlink == 3
    config = tree.attributes(paths[".tensorfs/model/config.json"])
    assert (config.kind, config.size, config.mtime_ns) == (Kind.VIEW, 2, 5)
    companion = tree.view_file(paths[".tensorfs/model/sub/x.txt"])
    assert isinstance(companion, Companion) and view.companions.read(companion.path, 0, 10) == b"x"  # read when asked
    view.close()
    first = tree.view_file(paths[".tensorfs/model/model-00001-of-00002.safetensors"])
    assert isinstance(first, SynthesizedFile)
    assert tree.attributes(paths[".tensorfs/model/model-00001-of-00002.safetensors"]).size == first.size
    with pytest.raises(NoSuchEntry):
        tree.lookup(paths[".tensorfs/model"], "nothing")
    with pytest.raises(NoSuchEntry):
        tree.view_file(paths[".tensorfs/index.json"])
    shard = model.shards[0]
    assert paths[".tensorfs/model/model-00001-of-00002.safetensors"] in tree.inodes_of(shard)  # it was read
    assert paths[".tensorfs/model/model-00002-of-00002.safetensors"] not in tree.inodes_of(shard)  # never was
