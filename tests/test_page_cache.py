"""The page cache holds each byte a mount serves once: in the mounted file's own pages (the kernel
keeps them, keep_cache), not also in the shard's (or the remote cache file's) pages under the
daemon's mapping. Measured with mincore, after the page cache was dropped (root)."""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import Mounts, drop_caches, missing_root, require, wait_until
from helpers import daemon_stats, random_bytes, random_shard, write_reference
from servers import Nginx
from tensorfs.bench.common import resident_bytes
from tensorfs.sources.pages import HANDOVER_UNIT, Handover

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("machine_held")  # what they measure, no other test drops meanwhile


@pytest.fixture
def drop_page_cache() -> None:
    """These tests start with nothing of their models in memory (see _model): they need to drop it."""
    require("root", missing_root())
    drop_caches()


def _model(directory: Path, tensors: int = 4, size: int = 8 * MIB) -> dict[str, bytes]:
    """A model of tensors whose bytes are not aligned to the units let go of, its pages out of memory."""
    data = random_shard(directory / "model.safetensors", {f"t{i}": size + 4096 * i for i in range(tensors)}, seed=100)
    os.sync()  # written back first: a dirty page cannot be let go
    drop_caches()
    return data


def _pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


ATTEMPTS = 3
"""This machine's kernel lets a few clean pages of files just read go while other processes write,
with no reclaim counted: 5 of 600 rounds of reading four 8 MiB plain files, beside a loop writing
2 GB and two busy cores, found 4 to 34 scattered pages of them gone. No lock keeps every writer
away, so a page cache holding less than a test expects is dropped, read into and measured again, up
to ATTEMPTS times: a mount that does not keep what it serves falls short every time. Only what must
be held is measured again; what must be let go (the source's pages) is never retried."""


def _held(read: Callable[[], None], measure: Callable[[], object], expected: object) -> None:
    """read() (it checks the bytes it reads), then measure() is `expected` (what the page cache holds)."""
    seen: list[object] = []
    for attempt in range(ATTEMPTS):
        if attempt:
            drop_caches()
        read()
        got = measure()
        if got == expected:
            return
        seen.append(got)
    pytest.fail(f"the page cache held {seen} in {ATTEMPTS} reads, never {expected}")


def _read_whole(files: list[Path], data: dict[str, bytes]) -> None:
    for path, expected in zip(files, data.values(), strict=True):
        assert path.read_bytes() == expected


def test_a_unit_is_let_go_once_all_of_it_was_served() -> None:
    unit = HANDOVER_UNIT
    served = Handover(3 * unit + 100)
    assert served.served(0, unit // 2) == []
    assert served.served(unit // 2, unit + 10) == [(0, unit)]  # the first unit whole; 10 bytes of the second
    assert served.served(unit + 10, 2 * unit - 1) == []
    assert served.served(2 * unit - 1, 2 * unit) == [(unit, 2 * unit)]
    assert served.served(3 * unit, 3 * unit + 100) == [(3 * unit, 3 * unit + 100)]  # the short last one
    assert served.served(0, 4 * unit) == [(0, unit), (unit, 2 * unit), (2 * unit, 3 * unit), (3 * unit, 3 * unit + 100)]
    assert served.served(0, unit) == [(0, unit)]  # served again (the kernel let its pages go): let go again


@pytest.mark.parametrize("keep", [False, True], ids=["once", "kept"])
def test_a_model_read_through_a_mount_is_held_once(
    mounts: Mounts, tmp_path: Path, drop_page_cache: None, keep: bool
) -> None:
    """Every tensor read through the mount (read(), then np.memmap): the mounted files hold every byte,
    the shard at most its header's unit; with --keep-source-pages the shard holds them all too."""
    data = _model(tmp_path / "model")
    shard = tmp_path / "model" / "model.safetensors"
    mountpoint = mounts.mount(tmp_path / "model", *(["--keep-source-pages"] if keep else []))
    files = [mountpoint / name for name in data]
    nbytes = sum(map(len, data.values()))
    if keep:  # the shard's pages held too: at least every byte read
        _held(
            lambda: _read_whole(files, data),
            lambda: (resident_bytes(files), min(resident_bytes([shard]), nbytes)),
            (nbytes, nbytes),
        )
    else:  # the last replies are let go of by the next request, or within a second
        _held(lambda: _read_whole(files, data), lambda: resident_bytes(files), nbytes)
        wait_until(lambda: resident_bytes([shard]) <= HANDOVER_UNIT, what="the shard's pages to be let go")
    for path, expected in zip(files, data.values(), strict=True):  # what the kernel kept is right
        assert np.memmap(path, dtype=np.uint8, mode="r").tobytes() == expected


def test_the_synthesized_model_is_held_once(mounts: Mounts, tmp_path: Path, drop_page_cache: None) -> None:
    """Read whole, .tensorfs/model/model.safetensors (replies within a tensor, and across tensors and
    the header) leaves the shard's pages to go: the file holds them."""
    from safetensors.numpy import load

    data = _model(tmp_path / "model")
    shard = tmp_path / "model" / "model.safetensors"
    mountpoint = mounts.mount(tmp_path / "model")
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"

    def read() -> None:
        assert {name: array.tobytes() for name, array in load(view.read_bytes()).items()} == data

    _held(read, lambda: resident_bytes([view]), _pages(view.stat().st_size))
    wait_until(lambda: resident_bytes([shard]) <= HANDOVER_UNIT, what="the shard's pages to be let go")


def test_a_remote_model_is_held_once(mounts: Mounts, nginx: Nginx, tmp_path: Path, drop_page_cache: None) -> None:
    """Through a remote mount the cache file's pages go once their chunks are recorded (flushed: a
    dirty page cannot be dropped); a new mount reads them again from disk, exact."""
    data = _model(nginx.root / "held-once")
    cache = tmp_path / "cache"
    url = f"{nginx.url}/held-once/model.safetensors"
    mountpoint = mounts.mount(url, "--cache-dir", str(cache))  # type: ignore[arg-type]
    files = [mountpoint / name for name in data]
    _held(lambda: _read_whole(files, data), lambda: resident_bytes(files), sum(map(len, data.values())))
    (cached,) = (cache / "objects").iterdir()
    wait_until(lambda: resident_bytes([cached]) <= HANDOVER_UNIT, what="the cache file's pages to be let go")
    again = mounts.mount(url, "--cache-dir", str(cache))  # type: ignore[arg-type]
    for name, expected in data.items():
        assert (again / name).read_bytes() == expected


def test_read_ahead_is_for_streams_only(mounts: Mounts, tmp_path: Path) -> None:
    """Random 4 KiB and 1 MiB reads of a 64 MiB tensor bring in nothing ahead of them (each brought in
    a 32 MiB window at d4c56fe: 83.4 GiB read ahead for 13.4 GiB served by fio); a reader streaming
    through it has its window."""
    data = random_bytes(64 * MIB, 77)
    (tmp_path / "m").mkdir()
    write_reference(tmp_path / "m" / "model.safetensors", {"big": ("U8", [len(data)], data)})
    mountpoint = mounts.mount(tmp_path / "m")
    rng = random.Random(5)
    with open(mountpoint / "big", "rb", buffering=0) as f:
        for size in (4096, MIB) * 40:
            offset = rng.randrange(1, (len(data) - size) // 4096) * 4096
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # each read the daemon's
            assert os.pread(f.fileno(), size, offset) == data[offset : offset + size]
    stats = daemon_stats(mountpoint)
    assert stats["read_bytes"]["tensor"] > 0
    assert stats["prefetch_bytes"] <= 1.5 * stats["read_bytes"]["tensor"], stats["prefetch_bytes"]
    assert (mountpoint / "big").read_bytes() == data  # a stream, from its first byte
    assert daemon_stats(mountpoint)["prefetch_bytes"] > stats["prefetch_bytes"]
