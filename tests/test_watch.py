"""Watching shard files: what inotify reports, what sizes and times tell, and since when."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import write_through_a_mapping
from tensorfs.sources.watch import Change, ShardWatch


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "s.safetensors"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield path, fd
    finally:
        os.close(fd)


def write_in_place(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_what_inotify_reports(shard: tuple[Path, int]) -> None:
    path, fd = shard
    watch = ShardWatch([(path, fd, os.fstat(fd))])
    assert watch.fileno() >= 0 and watch.changes() == []
    os.chmod(path, 0o600)  # told from a write through a mapping whose mtime was set back by nothing
    assert watch.changes() == [(path, Change.CONTENT)]
    write_in_place(path, 10, b"x")
    assert watch.changes() == [(path, Change.CONTENT)]
    assert watch.check(path) == []  # reported already
    os.rename(path, path.with_name("moved"))
    assert watch.changes() == [(path, Change.MOVED)]
    watch.close()


def test_two_watches_of_one_file_each_hear_of_its_changes(shard: tuple[Path, int]) -> None:
    """The process's watches share one inotify instance (closing one that held a watch cost the
    kernel's 8 ms: every model's close), where a file has one watch: two models of one shard open
    at once each hear of a write, and one closed leaves the other's watch on. The events are
    inotify's own: sizes and times are not asked (check() is not called)."""
    path, fd = shard
    first = ShardWatch([(path, fd, os.fstat(fd))])
    second = ShardWatch([(path, fd, os.fstat(fd))])
    assert first.changes() == second.changes() == []
    assert first.fileno() == second.fileno() >= 0  # one descriptor for the process
    write_in_place(path, 10, b"x")
    assert first.changes() == [(path, Change.CONTENT)]  # (it read the event: kept for the other too)
    assert second.changes() == [(path, Change.CONTENT)]
    first.close()
    os.chmod(path, 0o600)
    assert second.changes() == [(path, Change.CONTENT)]
    assert first.fileno() == -1 and second.fileno() >= 0
    second.close()


def test_what_happened_since_validation_is_reported_first(shard: tuple[Path, int]) -> None:
    path, fd = shard
    validated = os.fstat(fd)
    write_in_place(path, 0, b"y")  # after validation, before the watch began: no event will come
    os.utime(path, ns=(validated.st_atime_ns, validated.st_mtime_ns))  # the mtime set back, as rsync -t does
    watch = ShardWatch([(path, fd, validated)])
    assert watch.changes() == [(path, Change.CONTENT)]
    assert watch.changes() == []
    watch.close()


def test_without_inotify_sizes_and_times_tell(shard: tuple[Path, int]) -> None:
    path, fd = shard
    watch = ShardWatch([(path, fd, os.fstat(fd))])
    watch.close()  # as when no inotify watch is left
    assert watch.fileno() < 0 and watch.changes() == []
    before = os.fstat(fd)
    write_in_place(path, 5, b"z")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert watch.check(path) == [Change.CONTENT]  # only the ctime moved: without events, a write it may hide
    os.truncate(path, 4096)
    assert watch.check(path) == [Change.CONTENT]
    assert watch.check(path) == []


def test_a_write_through_a_mapping_with_its_mtime_set_back_is_a_change(shard: tuple[Path, int]) -> None:
    """Written through a shared mapping (no inotify event), its mtime set back: the ctime alone moved,
    and with inotify on, that is a change of the bytes (it was taken for an attribute's)."""
    path, fd = shard
    watch = ShardWatch([(path, fd, os.fstat(fd))])
    assert watch.changes() == []
    write_through_a_mapping(path, 100)
    assert watch.fileno() >= 0 and watch.changes() == [(path, Change.CONTENT)]  # IN_ATTRIB, from utime
    assert watch.check(path, at_once=True) == []  # reported already
    watch.close()
    watch = ShardWatch([(path, fd, os.fstat(fd))])
    while watch.changes():  # a fresh watch, nothing left to report: then its look at the times alone
        pass
    write_through_a_mapping(path, 200)
    assert watch.check(path, at_once=True) == [Change.CONTENT]
    watch.close()
