"""The FUSE handlers, awaited directly (no mount): errnos, reads, listings, hashing."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

import tensorfs
from helpers import random_bytes, write_reference
from tensorfs.mount.contents import index_json
from tensorfs.mount.operations import TensorOperations
from tensorfs.mount.tree import ROOT_INODE, Tree
from tensorfs.proof.integrity import Hasher, Integrity

DATA = random_bytes(3 << 20, 7)  # 3 MiB: reads of several requests, and a hash that takes a moment


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[TensorOperations]:
    tensors = {"big": ("U8", [len(DATA)], DATA), "dir/small": ("F32", [2], DATA[:8])}
    tensors.update({f"many/t{i:04d}": ("U8", [1], bytes([i % 256])) for i in range(500)})
    write_reference(tmp_path / "m.safetensors", tensors)
    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        tree = Tree(model, "slash", {"index.json": lambda: index_json(model)})
        yield TensorOperations(tree)


def run(fn: Any, *args: Any) -> Any:
    return trio.run(fn, *args)


def errno_of(fn: Any, *args: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as caught:
        run(fn, *args)
    return caught.value.errno


def test_lookup_getattr(ops: TensorOperations) -> None:
    entry = run(ops.lookup, ROOT_INODE, b"big", None)
    assert entry.st_size == len(DATA)
    assert entry.st_mode == stat.S_IFREG | (os.stat(ops.tree.model.shards[0]).st_mode & 0o444)  # the shard's
    assert entry.st_uid == os.getuid()
    assert entry.entry_timeout >= 3600 and entry.attr_timeout >= 3600
    assert run(ops.getattr, entry.st_ino, None).st_size == len(DATA)
    assert run(ops.lookup, ROOT_INODE, b".", None).st_ino == ROOT_INODE
    directory = run(ops.lookup, ROOT_INODE, b"dir", None)
    assert run(ops.lookup, directory.st_ino, b"..", None).st_ino == ROOT_INODE
    assert errno_of(ops.lookup, ROOT_INODE, b"missing", None) == errno.ENOENT
    assert errno_of(ops.lookup, ROOT_INODE, b"\xff", None) == errno.ENOENT
    assert errno_of(ops.getattr, 999_999, None) == errno.ENOENT


def test_read_returns_views_of_the_mapping(ops: TensorOperations) -> None:
    inode = run(ops.lookup, ROOT_INODE, b"big", None).st_ino
    info = run(ops.open, inode, os.O_RDONLY, None)
    assert info.keep_cache and not info.direct_io
    chunk = run(ops.read, info.fh, 1000, 1 << 20)
    assert isinstance(chunk, memoryview) and chunk.readonly
    assert bytes(chunk) == DATA[1000 : 1000 + (1 << 20)]
    assert bytes(run(ops.read, info.fh, len(DATA) - 5, 100)) == DATA[-5:]
    assert bytes(run(ops.read, info.fh, len(DATA) + 10, 100)) == b""
    whole = b"".join(bytes(run(ops.read, info.fh, off, 128 << 10)) for off in range(0, len(DATA), 128 << 10))
    assert whole == DATA


def test_sidecars(ops: TensorOperations) -> None:
    inode = run(ops.lookup, ROOT_INODE, b"big.sha256", None).st_ino
    fh = run(ops.open, inode, os.O_RDONLY, None).fh
    content = run(ops.read, fh, 0, 4096)
    assert content == f"{hashlib.sha256(DATA).hexdigest()}  big\n".encode()
    assert run(ops.getattr, inode, None).st_size == len(content)
    meta = run(ops.lookup, ROOT_INODE, b"big.meta.json", None)
    assert b'"nbytes": 3145728' in run(ops.read, run(ops.open, meta.st_ino, 0, None).fh, 0, 4096)


def test_concurrent_readers_share_one_hashing(ops: TensorOperations) -> None:
    inode = run(ops.lookup, ROOT_INODE, b"big.sha256", None).st_ino
    results: list[bytes] = []

    async def readers() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(lambda: _append(results, ops.read(inode, 0, 4096)))

    run(readers)
    assert ops.gate.integrity.hasher.tensors_hashed == 1
    assert len(set(results)) == 1 and results[0].startswith(hashlib.sha256(DATA).hexdigest().encode())


async def _append(results: list[bytes], pending: Any) -> None:
    results.append(bytes(await pending))


def test_readdir_with_offsets(ops: TensorOperations, monkeypatch: pytest.MonkeyPatch) -> None:
    many = run(ops.lookup, ROOT_INODE, b"many", None).st_ino
    fh = run(ops.opendir, many, None)
    seen: list[tuple[bytes, int]] = []
    budget = [0]

    def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        if budget[0] == 0:
            return False  # the kernel's buffer is full
        budget[0] -= 1
        seen.append((name, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    start = 0
    while True:  # read the listing 37 entries at a time, resuming where the last reply stopped
        budget[0] = 37
        before = len(seen)
        run(ops.readdir, fh, start, None)
        if len(seen) == before:
            break
        start = seen[-1][1]
    names = [name for name, _ in seen]
    assert names[:2] == [b".", b".."]
    expected = sorted(f"t{i:04d}{suffix}".encode() for i in range(500) for suffix in ("", ".meta.json", ".sha256"))
    assert names[2:] == expected
    assert [n for _, n in seen] == list(range(1, len(seen) + 1))


def test_every_mutation_is_refused(ops: TensorOperations) -> None:
    inode = run(ops.lookup, ROOT_INODE, b"big", None).st_ino
    calls = [
        (ops.setattr, inode, None, None, None, None),
        (ops.mknod, ROOT_INODE, b"n", 0o644, 0, None),
        (ops.mkdir, ROOT_INODE, b"d", 0o755, None),
        (ops.unlink, ROOT_INODE, b"big", None),
        (ops.rmdir, ROOT_INODE, b"dir", None),
        (ops.symlink, ROOT_INODE, b"s", b"big", None),
        (ops.rename, ROOT_INODE, b"big", ROOT_INODE, b"b2", 0, None),
        (ops.link, inode, ROOT_INODE, b"l", None),
        (ops.create, ROOT_INODE, b"c", 0o644, os.O_WRONLY, None),
        (ops.write, inode, 0, b"x"),
        (ops.setxattr, inode, b"user.x", b"1", None),
        (ops.removexattr, inode, b"user.x", None),
    ]
    for fn, *args in calls:
        assert errno_of(fn, *args) == errno.EROFS, fn
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert errno_of(ops.open, inode, flags, None) == errno.EROFS
    assert errno_of(ops.open, ROOT_INODE, os.O_RDONLY, None) == errno.EISDIR
    assert errno_of(ops.opendir, inode, None) == errno.ENOTDIR


def test_xattrs_and_statfs(ops: TensorOperations) -> None:
    # ENOSYS: the kernel answers EOPNOTSUPP itself from then on, without asking (see test_mount).
    assert errno_of(ops.getxattr, ROOT_INODE, b"user.x", None) == errno.ENOSYS
    assert errno_of(ops.listxattr, ROOT_INODE, None) == errno.ENOSYS
    assert errno_of(ops.flush, ROOT_INODE) == errno.ENOSYS
    assert ops.stats.errors == {}  # not failures
    stats = run(ops.statfs, None)
    assert stats.f_namemax == 255 and stats.f_files == ops.tree.inode_count and stats.f_bfree == 0


def test_a_bug_in_a_handler_is_logged_and_answered_eio(
    ops: TensorOperations, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(inode: int) -> Any:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(ops.tree, "attributes", broken)
    with caplog.at_level(logging.ERROR, logger="tensorfs.mount.operations"):
        assert errno_of(ops.getattr, ROOT_INODE, None) == errno.EIO
    assert "bug in getattr" in caplog.text and "ZeroDivisionError: boom" in caplog.text


def test_changes_to_a_shard_are_seen_before_the_next_read(tmp_path: Path) -> None:
    write_reference(tmp_path / "m.safetensors", {"big": ("U8", [len(DATA)], DATA), "other": ("U8", [4], b"abcd")})
    shard = tmp_path / "m.safetensors"
    for manifest in (False, True):
        with tensorfs.open_model(shard) as model:
            expected = {"big": hashlib.sha256(DATA).hexdigest(), "other": hashlib.sha256(b"abcd").hexdigest()}
            model.gate.set_integrity(Integrity(Hasher(model), expected if manifest else None))
            dropped: list[tuple[list[int], bool]] = []

            def invalidate(inodes: Sequence[int], attr_only: bool = False, dropped: list[Any] = dropped) -> None:
                dropped.append((sorted(inodes), attr_only))

            ops = TensorOperations(Tree(model, "slash", {}), invalidate=invalidate)
            everything = sorted([*ops.tree.inodes_of(shard), ops.tree.sums_inode])
            big, other = ops.tree.tensor_inode("big"), ops.tree.tensor_inode("other")
            fh = run(ops.open, big, os.O_RDONLY, None).fh
            assert bytes(run(ops.read, fh, 0, 16)) == DATA[:16]
            ops.flush_sources()  # what was served fingerprinted (a daemon does it every second)
            os.chmod(shard, 0o640)  # a change like a write (nothing tells it from one through a mapping)
            # Served on: with a manifest verified again; without one, the bytes served read again and
            # found as their fingerprints say.
            assert bytes(run(ops.read, fh, 16, 16)) == DATA[16:32]
            # Its pages and attributes asked for again (a manifest's hashes are of the bytes as they are
            # now); or, the bytes served to be checked first, its attributes alone.
            assert dropped == [(everything, not manifest)]
            assert run(ops.getattr, big, None).st_mode == stat.S_IFREG | 0o440
            with open(shard, "r+b") as f:  # what `dd conv=notrunc` does
                f.seek(model.info("big").offset + 100)
                f.write(b"\0" * 8)
            assert errno_of(ops.read, fh, 0, 16) == errno.EIO  # no manifest: not the bytes served; with one: mismatch
            assert dropped[-1] == (everything, False)
            if manifest:  # the shard's other tensor is verified again, and served
                assert bytes(run(ops.read, run(ops.open, other, os.O_RDONLY, None).fh, 0, 4)) == b"abcd"
            else:  # the whole shard is no longer what was validated
                assert errno_of(ops.open, other, os.O_RDONLY, None) == errno.EIO
                assert errno_of(ops.read, other + 2, 0, 100) == errno.EIO  # its .sha256
            write_reference(shard, {"big": ("U8", [len(DATA)], DATA), "other": ("U8", [4], b"abcd")})


def test_a_sidecar_hashed_while_its_shard_changes_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The hash of bytes changed under the daemon is no answer: without a manifest, EIO.
    write_reference(tmp_path / "m.safetensors", {"big": ("U8", [len(DATA)], DATA)})
    shard = tmp_path / "m.safetensors"
    with tensorfs.open_model(shard) as model:
        integrity = model.gate.integrity
        ops = TensorOperations(Tree(model, "slash", {}))
        real = integrity.digest

        def digest_while_written(name: str) -> str:
            found = real(name)
            with open(shard, "r+b") as f:  # a writer, while the daemon hashed
                f.seek(model.info("big").offset)
                f.write(b"\1")
            return found

        monkeypatch.setattr(integrity, "digest", digest_while_written)
        assert errno_of(ops.read, ops.tree.tensor_inode("big") + 2, 0, 4096) == errno.EIO


def test_a_synthesized_layout_is_made_off_the_request_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tensorfs.views import SynthesizedFile, ViewSpec, build_view

    write_reference(tmp_path / "m.safetensors", {f"t{i}": ("U8", [3], bytes([i, i, i])) for i in range(50)})
    built_on: list[threading.Thread] = []
    build = SynthesizedFile.build

    def recorded(self: SynthesizedFile) -> None:
        if not self.built:
            built_on.append(threading.current_thread())
        build(self)

    monkeypatch.setattr(SynthesizedFile, "build", recorded)
    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        view = build_view(model, model.gate, ViewSpec(shards=2))
        ops = TensorOperations(Tree(model, "slash", {}, view=view))
        control = run(ops.lookup, ROOT_INODE, b".tensorfs", None).st_ino
        directory = run(ops.lookup, control, b"model", None).st_ino
        assert built_on == []  # nothing asked of the files yet
        first = run(ops.lookup, directory, b"model-00001-of-00002.safetensors", None)
        assert len(built_on) == 1 and first.st_size == view.synthesized()[0].size
        listed: list[bytes] = []

        async def listing() -> None:
            await ops.readdir(directory, 0, None)  # type: ignore[arg-type]

        monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, entry, offset: listed.append(name) or True)
        run(listing)
        assert b"model-00002-of-00002.safetensors" in listed and len(built_on) == 2
        assert threading.main_thread() not in built_on  # workers' threads, never the one answering requests
        data = bytes(run(ops.read, first.st_ino, 0, first.st_size))  # bytes-like, as pyfuse3 takes it
        assert data[8 : 8 + int.from_bytes(data[:8], "little")].startswith(b'{"t0":')


def test_control_files_are_made_off_the_request_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """index.json and metadata.json tell of every tensor, every key of a model (a GGUF's arrays took
    26 s and 1.9 GB to make on the request thread, the daemon answering nothing else meanwhile):
    a lookup, a getattr or a listing of .tensorfs/ has them made on a worker thread, once."""
    import threading

    write_reference(tmp_path / "m.safetensors", {"w": ("U8", [1], b"x")})
    made_on: list[tuple[str, threading.Thread]] = []

    def maker(name: str) -> Any:
        def make() -> bytes:
            made_on.append((name, threading.current_thread()))
            return name.encode()

        return make

    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        makers = {name: maker(name) for name in ("index.json", "metadata.json", "daemon.json")}
        ops = TensorOperations(Tree(model, "slash", makers))
        control = run(ops.lookup, ROOT_INODE, b".tensorfs", None).st_ino
        assert made_on == []  # nothing asked of the files yet
        described = run(ops.lookup, control, b"metadata.json", None)
        assert described.st_size == len(b"metadata.json") and [name for name, _ in made_on] == ["metadata.json"]
        run(ops.getattr, described.st_ino, None)
        listed: list[bytes] = []

        async def listing() -> None:
            await ops.readdir(control, 0, None)  # type: ignore[arg-type]

        monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, entry, offset: listed.append(name) or True)
        run(listing)
        assert b"index.json" in listed and sorted(name for name, _ in made_on) == sorted(makers)  # each once
        assert threading.main_thread() not in [thread for _, thread in made_on]  # never the request thread
        fh = run(ops.open, described.st_ino, os.O_RDONLY, None).fh
        assert bytes(run(ops.read, fh, 0, 4096)) == b"metadata.json"
