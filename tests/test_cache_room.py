"""Room in the chunk cache on a disk that is nearly full: a read waits (bounded) for chunks that are
about to become evictable, instead of being told at once that the disk is full."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import missing_root, require, wait_until
from helpers import MIB, patience
from tensorfs.sources.cache.chunks import ChunkCache
from tensorfs.sources.cache.objects import CacheFull
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
    directory = tmp_path / "small-disk"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(directory)], check=True)
    try:
        cache = ChunkCache(directory / "cache")
        committing, go = threading.Event(), threading.Event()
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
            # The disk taken by another file, but for less than a chunk (room for the records' rows).
            disk = os.statvfs(directory)
            (directory / "filler").write_bytes(bytes(disk.f_bavail * disk.f_frsize - MIB // 2))
            attempts: list[int] = []
            allocate = second.allocate

            def counted(offset: int, nbytes: int) -> None:
                attempts.append(offset)
                allocate(offset, nbytes)

            monkeypatch.setattr(second, "allocate", counted)
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
        subprocess.run(["umount", "-l", str(directory)], check=False)
