"""Room in the chunk cache on a disk that is nearly full: a read waits (bounded) for chunks that are
about to become evictable, instead of being told at once that the disk is full."""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import tensorfs.sources.chunks.chunks
from conftest import Mounts, missing_root, require, wait_until
from helpers import MIB, patience, random_bytes, small_disk, write_reference
from servers import Nginx
from tensorfs.sources.chunks import CacheFull
from tensorfs.sources.chunks.chunks import ChunkCache
from tensorfs.sources.chunks.full import full
from tensorfs.sources.store import ObjectRef, ObjectVersion, StoreSpec

SPEC = StoreSpec("http", "http://store", "http://store", timeout=5)


def version(key: str) -> ObjectVersion:
    return ObjectVersion(ObjectRef(SPEC, key), f'"{key}"', MIB, 0.0)


def fetch(start: int, end: int, write: Callable[[int, bytes], object]) -> None:
    write(start, bytes(end - start))


def test_a_read_waits_for_chunks_being_recorded_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache disk (a 3 MiB tmpfs) nearly filled by another file; one object's chunk just fetched, let go,
    and being recorded (the save held, by a handshake, between taking it from what waits to be saved
    and writing its row). A read of another object's chunk finds no room: it waits, past the point
    where it was told "the cache disk is full" at once, and once the row is written the chunk is
    evicted for it and the read goes on."""
    require("root (it mounts a small tmpfs)", missing_root())
    committing, go = threading.Event(), threading.Event()
    with small_disk(tmp_path / "small-disk", "3m") as directory:
        try:
            cache = ChunkCache(directory / "cache")
            commit = cache.records.commit

            def held_commit(*args: Any) -> None:  # the save under way, held between taking and recording
                committing.set()
                assert go.wait(patience(60))
                commit(*args)

            monkeypatch.setattr(cache.records, "commit", held_commit)
            with ThreadPoolExecutor(2) as executor:
                first = cache.open_object(version("a"), None, MIB, fetch)
                first.ensure_pinned(0, 0, executor)
                first.let_go([0])
                saving = threading.Thread(target=cache.save, kwargs={"wait": True})
                saving.start()
                assert committing.wait(patience(30))
                second = cache.open_object(version("b"), None, MIB, fetch)
                fill_but_for_rows(directory)  # by another file
                attempts: list[int] = []
                allocate = second.file.allocate

                def counted(offset: int, nbytes: int) -> None:
                    attempts.append(offset)
                    allocate(offset, nbytes)

                monkeypatch.setattr(second.file, "allocate", counted)
                outcome: list[object] = []

                def claim() -> None:
                    try:
                        outcome.append(cache.claim(second, 0, 0, time.monotonic() + patience(30)))
                    except CacheFull as exc:
                        outcome.append(exc)

                reader = threading.Thread(target=claim)
                reader.start()
                # Past the second attempt (where it gave up at once), or done: no room came meanwhile.
                wait_until(lambda: len(attempts) >= 3 or bool(outcome), what="the read's third try for room")
                assert not outcome, outcome  # still waiting, not told the disk is full
                go.set()
                reader.join(patience(30))
                saving.join(patience(30))
                assert outcome == [{0}]  # the chunk just recorded was evicted for it
                second.let_go([0])
                for cached in (first, second):
                    cache.let_go(cached)
                    cached.close()
            cache.close()
        finally:
            go.set()


def test_the_database_on_a_full_disk_is_a_full_disk(tmp_path: Path) -> None:
    """SQLite's refusal for want of room ("database or disk is full") is the cache's own for a full
    disk, as the file's ENOSPC is: one refusal and one message whichever wrote first (a mount's reads
    said SQLite's words when a row's write met the full disk before a chunk's blocks did), and the
    claim's wait for room applies to it. Both the database made on a full disk and a write to it."""
    require("root (it mounts a small tmpfs)", missing_root())
    with small_disk(tmp_path / "small-disk", "2m") as directory:
        cache = ChunkCache(directory / "cache")
        cache.open_object(version("a"), None, MIB, fetch)  # the database made, with room
        said = rf"^the cache disk is full \({re.escape(str(directory / 'cache'))}\)$"
        with pytest.raises(CacheFull, match=said), cache.records.transaction() as db:
            db.execute(  # a row bigger than the disk's room left
                "INSERT INTO models VALUES (?, ?, ?)", ("big", "x" * (4 * MIB), 0.0)
            )
        fresh = directory / "fresh"
        fill(directory)
        with pytest.raises(CacheFull, match=r"^the cache disk is full"):
            ChunkCache(fresh).open_object(version("b"), None, MIB, fetch)


def fill_but_for_rows(directory: Path) -> None:
    """Take the disk `directory` is on but for less than a chunk: room for the records' rows alone."""
    disk = os.statvfs(directory)
    (directory / "filler").write_bytes(bytes(disk.f_bavail * disk.f_frsize - MIB // 2))


def fill(directory: Path) -> None:
    """Take every block of the disk `directory` is on (a file written until the disk says no)."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("where", ["rows", "flush"])
def test_chunks_whose_rows_met_a_full_disk_are_recorded_once_there_is_room(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save the disk had no room for, its rows' or the flush of its chunks' bytes before them,
    keeps its chunks to be saved again (they are recorded, so evictable, once there is room) and says
    so once while it lasts. Given up, as they were, their blocks stayed taken with no row to evict
    them by: a cache disk filled by others and then freed stayed full for the daemon (a mount's reads
    EIO after the room came back)."""
    cache = ChunkCache(tmp_path / "cache")
    cached = cache.open_object(version("a"), None, MIB, fetch)
    refusals: list[int] = []

    def no_room(*args: Any) -> None:
        refusals.append(1)
        if where == "rows":
            raise full(cache.directory)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with ThreadPoolExecutor(1) as executor:
        cached.ensure_pinned(0, 0, executor)
    cached.let_go([0])
    with monkeypatch.context() as patched:
        if where == "rows":
            patched.setattr(cache.records, "commit", no_room)
        else:
            patched.setattr(tensorfs.sources.chunks.chunks.os, "fdatasync", no_room)
        assert cache.save(wait=True) is False and cache.save(wait=True) is False and len(refusals) == 2
        assert cache.pending(cached.id, 0) and cache.records.recorded(cached.id, 0) is None
        assert [r.getMessage() for r in caplog.records].count(
            f"could not record chunks in the cache: the cache disk is full ({cache.directory}) (recorded once there is room)"
        ) == 1
    assert cache.save(wait=True) is True  # room again
    assert not cache.pending(cached.id, 0) and cache.records.recorded(cached.id, 0) is not None
    cache.let_go(cached)
    cached.close()
    cache.close()


def test_a_read_on_a_full_disk_whose_chunks_cannot_be_recorded_is_refused_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks waiting to be recorded are soon evictable, so a read finding no room waits for their
    save; not once a save had no room for their rows: saving them again frees nothing till room
    comes, and every read on the full disk waited out its whole deadline (then ROOM_WAIT, 10 s) for nothing.
    Now it tries the save once and is told the disk is full (counted: the saves it tried)."""
    require("root (it mounts a small tmpfs)", missing_root())
    with small_disk(tmp_path / "small-disk", "3m") as directory:
        cache = ChunkCache(directory / "cache")
        refusals: list[int] = []

        def no_room(*args: Any) -> None:
            refusals.append(1)
            raise full(cache.directory)

        monkeypatch.setattr(cache.records, "commit", no_room)
        with ThreadPoolExecutor(1) as executor:
            first = cache.open_object(version("a"), None, MIB, fetch)
            first.ensure_pinned(0, 0, executor)
            first.let_go([0])
            assert cache.save(wait=True) is False
            second = cache.open_object(version("b"), None, MIB, fetch)
            fill(directory)
            with pytest.raises(CacheFull, match=r"the cache disk is full"):
                cache.claim(second, 0, 0, time.monotonic() + patience(20))
            assert len(refusals) <= 2, len(refusals)  # the first save, and one more at most
            for cached in (first, second):
                cache.let_go(cached)
                cached.close()
        cache.close()


def test_a_claim_that_met_chunks_in_use_let_go_meanwhile_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim on a full disk evicts what it can; a chunk a reader holds is passed over. When that
    reader lets go after the eviction looked and before the claim weighs whether anything will soon
    be evictable, it saw nothing held and nothing freed, and refused at once: "the cache disk is
    full", to four readers taking turns through a disk with room for two chunks (1 read in 256 under
    load). Made to happen: the reader lets go just as the eviction ends; the claim now tries again
    and gets the chunk's room."""
    require("root (it mounts a small tmpfs)", missing_root())
    with small_disk(tmp_path / "small-disk", "3m") as directory:
        cache = ChunkCache(directory / "cache")
        with ThreadPoolExecutor(2) as executor:
            first = cache.open_object(version("a"), None, MIB, fetch)
            first.ensure_pinned(0, 0, executor)  # held by its reader
            assert cache.save(wait=True)
            second = cache.open_object(version("b"), None, MIB, fetch)
            fill_but_for_rows(directory)
            evict = cache.room.evict
            passed_over: list[int] = []

            def evict_then_let_go(wanted: int) -> int:
                freed = evict(wanted)
                if not passed_over:  # the first eviction passes the held chunk over; then it is let go
                    passed_over.append(freed)
                    first.let_go([0])
                return freed

            monkeypatch.setattr(cache.room, "evict", evict_then_let_go)
            claimed = cache.claim(second, 0, 0, time.monotonic() + patience(30))
            assert passed_over == [0] and claimed == {0}
            assert cache.records.recorded(first.id, 0) is None  # evicted for it, on the claim's next look
            second.let_go([0])
            for cached in (first, second):
                cache.let_go(cached)
                cached.close()
        cache.close()


def test_a_read_that_joined_a_fetch_which_found_the_disk_full_claims_room_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader whose chunk another reader's fetch is bringing waits for that fetch. When the fetch
    found the disk full (it takes its blocks without making room: a reader's first read, or one ahead
    of readers), that was not this read's failure: it was told "the cache disk is full" while a chunk
    nobody held could have been evicted for it. Made to happen on a real full disk (the fetch held
    before it takes its blocks until the reader has joined it): the read claims room itself,
    evicting the chunk nobody holds, and gets its bytes."""
    require("root (it mounts a small tmpfs)", missing_root())
    with small_disk(tmp_path / "small-disk", "3m") as directory:
        cache = ChunkCache(directory / "cache")
        with ThreadPoolExecutor(2) as executor:
            first = cache.open_object(version("a"), None, MIB, fetch)
            first.ensure_pinned(0, 0, executor)
            first.let_go([0])
            assert cache.save(wait=True)  # recorded, held by nobody: evictable
            second = cache.open_object(version("b"), None, MIB, fetch)
            fill_but_for_rows(directory)
            joined, go = threading.Event(), threading.Event()
            reserve, pin_present = cache.reserve, second.pin_present

            def held_reserve(*args: Any, **kwargs: Any) -> None:
                # The fetch's, held until the reader waits on it; before the room's lock, which the
                # reader's claim takes too.
                assert go.wait(patience(30))
                reserve(*args, **kwargs)

            def pin_then_tell(first_chunk: int, last_chunk: int) -> tuple[list[int], list[int]]:
                found = pin_present(first_chunk, last_chunk)
                joined.set()
                return found

            monkeypatch.setattr(cache, "reserve", held_reserve)
            monkeypatch.setattr(second, "pin_present", pin_then_tell)
            fetching = second.fetching(0, executor)  # as a reader's first read begins it: room=True
            assert fetching is not None
            outcome: list[object] = []

            def read() -> None:
                try:
                    second.ensure_pinned(0, 0, executor)
                    outcome.append("pinned")
                except Exception as exc:
                    outcome.append(exc)

            reader = threading.Thread(target=read)
            reader.start()
            assert joined.wait(patience(30))
            go.set()
            reader.join(patience(60))
            with pytest.raises(CacheFull, match="the cache disk is full"):
                fetching.result()  # the fault: the fetch it joined found no room
            assert outcome == ["pinned"]
            assert second.pinned_bytes() == MIB and cache.records.recorded(first.id, 0) is None
            second.let_go([0])
            for cached in (first, second):
                cache.let_go(cached)
                cached.close()
        cache.close()


@pytest.mark.mount
def test_readers_of_a_model_larger_than_the_cache_disk_wait_for_room_and_get_exact_bytes(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """Four readers of a 64 MiB model over HTTP through a mount whose cache is on an empty 20 MiB
    disk (two chunks' room, no --cache-size): each read waits for the chunks the others hold to be let
    go, and every byte comes back exact (39-64 of the 256 reads were refused as "the cache disk is
    full", at once or after a while, while a lone reader was exact)."""
    require("root (it mounts a small tmpfs)", missing_root())
    tensors = {f"t{k}": random_bytes(8 * MIB, 70 + k) for k in range(8)}
    served = nginx.root / f"room-{os.getpid()}"
    served.mkdir()
    write_reference(served / "model.safetensors", {name: ("U8", [len(data)], data) for name, data in tensors.items()})
    with small_disk(tmp_path / "small-disk", "20m") as directory:
        mountpoint = mounts.mount(f"{nginx.url}/{served.name}/model.safetensors", "--cache-dir", str(directory))  # type: ignore[arg-type]

        def reader(k: int) -> list[str]:
            wrong = []
            order = list(tensors)[k:] + list(tensors)[:k]  # each its own order: they meet in every chunk
            for name in order:
                with open(mountpoint / name, "rb", buffering=0) as file:
                    for offset in range(0, 8 * MIB, MIB):
                        try:
                            got = os.pread(file.fileno(), MIB, offset)
                        except OSError as exc:
                            wrong.append(f"{name}@{offset}: {exc}")
                            continue
                        if got != tensors[name][offset : offset + MIB]:
                            same = got == tensors[name][offset : offset + len(got)]
                            wrong.append(f"{name}@{offset}: {len(got)} bytes, {'a part' if same else 'other bytes'}")
            return wrong

        with ThreadPoolExecutor(4) as pool:
            found = [line for lines in pool.map(reader, range(4)) for line in lines]
        assert found == [], (found[:5], mounts.log()[-3000:])


@pytest.mark.mount
def test_readers_of_tensor_files_through_a_cache_disk_that_also_holds_the_databases_get_exact_bytes(
    mounts: Mounts, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 tensors of 1 MiB (8 chunks) over HTTP, mounted with default options and every cache on an
    empty 20 MiB disk (XDG_CACHE_HOME: the chunk cache's objects.sqlite beside the chunks, the header
    cache too): four readers each read every tensor file whole, twice, in their own order, the file's
    pages dropped after each read (every read reaches the daemon, as on a machine short of memory).
    The chunks take turns through two chunks' room, hundreds of evictions; every byte comes back
    exact. The database's write-ahead log grew to SQLite's 4 MiB, what two chunks left of the disk:
    then no eviction (its row deleted first) nor save could be written, and every read was told "the
    cache disk is full", at once or at the end of --remote-timeout (40 of 256 reads at load 8-10)."""
    require("root (it mounts a small tmpfs)", missing_root())
    tensors = {f"t{k:02d}": random_bytes(MIB, 900 + k) for k in range(64)}
    served = nginx.root / f"tensor-files-{os.getpid()}"
    served.mkdir()
    write_reference(served / "model.safetensors", {name: ("U8", [MIB], data) for name, data in tensors.items()})
    with small_disk(tmp_path / "small-disk", "20m") as disk:
        monkeypatch.setenv("XDG_CACHE_HOME", str(disk))  # the mount's caches: all of them on the small disk
        mountpoint = mounts.mount(f"{nginx.url}/{served.name}/model.safetensors")

        def reader(k: int) -> list[str]:
            order = list(tensors) * 2
            random.Random(k).shuffle(order)
            wrong = []
            for name in order:
                try:
                    with open(mountpoint / name, "rb") as file:
                        got = file.read()
                        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError as exc:
                    wrong.append(f"{name}: {exc}")
                    continue
                if got != tensors[name]:
                    wrong.append(f"{name}: {len(got)} bytes, not its own")
            return wrong

        with ThreadPoolExecutor(4) as pool:
            found = [line for lines in pool.map(reader, range(4)) for line in lines]
        assert found == [], (f"{len(found)} of 512 reads", found[:5], mounts.log()[-3000:])
