"""Remote models when things go wrong: servers that stop, connections that drop, objects that change
or vanish, a full cache disk, eviction under load, a daemon killed mid-fetch; and faults in the middle
of a GET's body (a proxy holds it there): a read left waiting, a server gone, a chunk half written.

Reads that fail get EIO and an ERROR line naming the tensor, the object and the cause; the daemon
goes on, and reads succeed again once the cause is gone. No byte that is not the model's is served.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import obstore
import pytest

from conftest import Mounts, drop_caches, missing_root, require, wait_until
from helpers import (
    MIB,
    CacheBlocks,
    OneRead,
    cli,
    daemon_process,
    daemon_resources,
    descriptors_but_sockets,
    errno_of_reading,
    file_mappings,
    patience,
    random_bytes,
    random_range_reads,
    random_shard,
    reads_in_handlers,
    reap,
    remote_stats,
    small_disk,
    threads_of,
    write_reference,
)
from servers import DroppingProxy, HostileServer, Lie, Nginx, SeaweedFS, StallingProxy
from tensorfs.mount.mounttable import pid_alive
from tensorfs.opening.source import open_model
from tensorfs.sources.chunks import OBJECTS_DIR
from tensorfs.sources.store import RemoteOptions


def big_model(directory: Path, tensors: int = 12, size: int = 8 * MIB) -> dict[str, bytes]:
    """One shard of `tensors` tensors of `size` bytes each (random, so every chunk differs)."""
    return random_shard(directory / "m.safetensors", {f"t{i:02d}": size for i in range(tensors)}, seed=100)


def test_a_server_that_stops_and_comes_back(mounts: Mounts, own_nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(own_nginx.root / "m")
    url = f"{own_nginx.url}/m/m.safetensors"
    mountpoint = mounts.mount(url, "--remote-timeout", "2", "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t00").read_bytes() == expected["t00"]
    # Its reads were answered as their bytes came: the rest of its two chunks is waited for here.
    wait_until(lambda: remote_stats(mountpoint)["fetched_bytes"] >= 16 * MIB, what="t00's chunks to be cached")
    own_nginx.stop()
    assert errno_of_reading(mountpoint / "t07") == errno.EIO  # within the timeout: the reader is not left hanging
    assert pid_alive(pid)
    assert (mountpoint / "t00").read_bytes() == expected["t00"]  # what is cached is served on
    log = mounts.log()
    assert "tensor 't07': bytes [0, " in log and f"{url}: unreachable" in log
    back = Nginx(own_nginx.directory, own_nginx.port)  # the same server back, on the same port
    back.start()
    try:
        assert (mountpoint / "t07").read_bytes() == expected["t07"]
    finally:
        back.stop()


def test_dropped_connections_are_resumed(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "dropping", tensors=6)
    proxy = DroppingProxy(nginx.port, 3 * MIB)  # every connection cut after 3 MiB
    try:
        url = f"http://127.0.0.1:{proxy.port}/dropping/m.safetensors"
        mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        for name, data in expected.items():
            assert (mountpoint / name).read_bytes() == data, name
        assert proxy.connections > len(expected)  # the transfers were cut, and went on where they stopped
    finally:
        proxy.close()


def test_a_read_rides_out_an_outage_shorter_than_the_timeout(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "outage", tensors=2)
    proxy = DroppingProxy(nginx.port, 1 << 40)
    try:
        url = f"http://127.0.0.1:{proxy.port}/outage/m.safetensors"
        mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "120")  # type: ignore[arg-type]
        # The outage closes what the daemon holds open (the connections it opened as it started) and
        # refuses more new ones than a retry count would allow; well within the time.
        proxy.cut()
        proxy.refuse = 25
        assert (mountpoint / "t01").read_bytes() == expected["t01"]
        assert proxy.refuse == 0
    finally:
        proxy.close()


def test_connections_closed_at_once_are_tried_again(nginx: Nginx, tmp_path: Path) -> None:
    """A store that accepts connections and closes them before a request goes out (as one behind a
    balancer does while it restarts): validation and reads ask again, none fails early."""
    expected = big_model(nginx.root / "closing", tensors=2, size=MIB)
    for attempt in range(3):  # a new proxy, so a new client: no connection kept from before
        proxy = DroppingProxy(nginx.port, 1 << 40)
        try:
            proxy.refuse = 8
            url = f"http://127.0.0.1:{proxy.port}/closing/m.safetensors"
            options = RemoteOptions(cache_dir=tmp_path / f"cache{attempt}", timeout=120)
            with open_model(url, remote=options) as model:
                assert proxy.refuse == 0
                proxy.cut()
                proxy.refuse = 8
                assert model.array("t01").tobytes() == expected["t01"]
                assert proxy.refuse == 0
        finally:
            proxy.close()


def test_an_object_replaced_or_deleted_under_the_mount(
    mounts: Mounts, seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    expected = big_model(tmp_path / "model", tensors=4)
    store = seaweedfs.store(bucket)
    shard = (tmp_path / "model" / "m.safetensors").read_bytes()
    obstore.put(store, "a/m.safetensors", shard)
    obstore.put(store, "b/m.safetensors", shard)
    # One GET at once: the read-ahead after t00 then takes one chunk at most, never all of t02's
    # (fetched before the object changed, its old bytes would be served, rightly).
    common = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "5"]
    common += ["--remote-concurrency", "1"]
    replaced = mounts.mount(f"s3://{bucket}/a/m.safetensors", *common)  # type: ignore[arg-type]
    deleted = mounts.mount(f"s3://{bucket}/b/m.safetensors", *common)  # type: ignore[arg-type]
    assert (replaced / "t00").read_bytes() == expected["t00"]
    obstore.put(store, "a/m.safetensors", shard[:-1] + bytes([shard[-1] ^ 1]))  # a new version: a new ETag
    obstore.delete(store, "b/m.safetensors")
    assert errno_of_reading(replaced / "t02") == errno.EIO  # never a byte of the new version
    assert errno_of_reading(deleted / "t02") == errno.EIO
    assert (replaced / "t00").read_bytes() == expected["t00"]  # the version validated, as it is cached
    log = mounts.log()
    assert f"s3://{bucket}/a/m.safetensors: changed since it was validated" in log
    assert f"s3://{bucket}/b/m.safetensors: not found (404)" in log


def test_an_object_replaced_on_a_server_without_etags(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "noetag", tensors=4)
    path = nginx.root / "noetag" / "m.safetensors"
    url = f"{nginx.url}/noetag/m.safetensors"
    # One GET at once: the read-ahead after t00 takes a chunk at most, never the whole of t01 (its
    # old bytes, fetched before the object changed, would rightly be served).
    options = ["--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1", "--remote-concurrency", "1"]
    mountpoint = mounts.mount(url, *options)  # type: ignore[arg-type]
    assert (mountpoint / "t00").read_bytes() == expected["t00"]
    shard = path.read_bytes()
    replacement = path.with_name("new.tmp")
    replacement.write_bytes(shard[:-1] + bytes([shard[-1] ^ 1]))  # the same size: only Last-Modified tells
    stat = path.stat()
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))
    os.replace(replacement, path)
    for name in ("t01", "t02", "t03"):  # never a byte of the new version
        assert errno_of_reading(mountpoint / name) == errno.EIO
    assert (mountpoint / "t00").read_bytes() == expected["t00"]  # the version validated, as it is cached
    assert f"{url}: changed since it was validated" in mounts.log()


def test_an_answer_of_another_etag_is_refused_from_a_server_that_ignores_if_match(
    mounts: Mounts, tmp_path: Path
) -> None:
    """The object changes (a new ETag, the same size) and the server serves the new bytes whatever
    If-Match says: tensorfs sees the answer's ETag is not the one it validated, and gives EIO, never
    a byte of the new version."""
    expected = big_model(tmp_path / "served", tensors=4, size=MIB)
    server = HostileServer(tmp_path / "served")
    try:
        url = f"{server.url}/m.safetensors"
        # One GET at once: the read-ahead after t00 takes a chunk at most, never t02's or t03's.
        options = ["--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1", "--remote-concurrency", "1"]
        mountpoint = mounts.mount(url, *options)  # type: ignore[arg-type]
        assert (mountpoint / "t00").read_bytes() == expected["t00"]
        validated = server.etags["m.safetensors"]
        path = tmp_path / "served" / "m.safetensors"
        shard = path.read_bytes()
        path.write_bytes(shard[: -2 * MIB] + bytes(b ^ 0xFF for b in shard[-2 * MIB :]))  # t02 and t03 changed
        server.lies += [Lie("etag", "m.safetensors", '"a-new-version"'), Lie("etag", "m.safetensors", "unchecked")]
        before = len(server.headers)
        for name in ("t02", "t03"):
            assert errno_of_reading(mountpoint / name) == errno.EIO, name  # never the new bytes
        asked = [h.get("if-match") for h in server.headers[before:]]
        assert asked and set(asked) == {validated}  # each GET pinned to the version validated, and served all the same
        assert (mountpoint / "t00").read_bytes() == expected["t00"]  # what is cached is that version's
        assert f"{url}: changed since it was validated" in mounts.log()
    finally:
        server.close()


def test_a_full_cache_disk(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A cache disk (a 20 MiB tmpfs, no --cache-size) that fills before any bound: 64 MiB of tensors
    read through it, what nobody uses evicted to make room (chunks fetched ahead of the reader
    among them), every byte exact; filled by a file not the cache's, a read gets EIO (what is
    cached is served on, the daemon lives) until there is room again."""
    require("root (it mounts a small tmpfs)", missing_root())
    expected = big_model(nginx.root / "full", tensors=8)
    with small_disk(tmp_path / "small-disk", "20m") as cache:
        mountpoint = mounts.mount(f"{nginx.url}/full/m.safetensors", "--cache-dir", str(cache))  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        for name, data in expected.items():
            assert (mountpoint / name).read_bytes() == data, name

        def pruned() -> bool:  # nothing cached (the chunks of the last reply are let go within a second)
            mounts.run("cache", "prune", "--cache-dir", str(cache))
            listed = mounts.run("cache", "ls", "--json", "--cache-dir", str(cache)).stdout.splitlines()
            return all(json.loads(line)["cached"] == 0 for line in listed)

        wait_until(pruned, what="the cache to be emptied")
        filler = cache / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # the disk, taken by somebody else
            while True:
                f.write(bytes(MIB))
                f.flush()
        drop_caches()  # the mount's files read again, not remembered
        outcomes = {name: errno_of_reading(mountpoint / name) for name in expected}
        assert errno.EIO in outcomes.values(), outcomes
        assert set(outcomes.values()) <= {None, errno.EIO}, outcomes  # served, or refused with EIO: nothing else
        for name, outcome in outcomes.items():
            if outcome is None:
                assert (mountpoint / name).read_bytes() == expected[name]
        assert pid_alive(pid) and "the cache disk is full" in mounts.log()
        filler.unlink()
        for name, data in expected.items():
            assert (mountpoint / name).read_bytes() == data, name
        assert mounts.run("umount", str(mountpoint)).returncode == 0


def blocks_on_disk(cache: Path) -> int:
    """Bytes the cache's object files hold on disk (their blocks), what the cache's bound is on."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(cache / OBJECTS_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_blocks * 512
    return total


def test_eviction_under_eight_readers(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "evict", tensors=16, size=6 * MIB)  # 96 MiB through a 40 MiB cache
    cache = tmp_path / "cache"
    blocks = CacheBlocks(tmp_path)
    url = f"{nginx.url}/evict/m.safetensors"
    mountpoint = mounts.mount(url, "--cache-size", "40M", "--cache-dir", str(cache), command=blocks.mount_command)  # type: ignore[arg-type]
    failures = random_range_reads(mountpoint, expected, readers=8, reads=60, longest=2 * MIB)
    assert failures == []
    # The bound is on the blocks the cache file holds on disk, at every moment, whatever the rows say
    # (a chunk being fetched has its blocks and no row yet), give or take the file system's own block
    # of the file's extents; what is recorded is held, and the model went through the cache more
    # than twice over: chunks were evicted to keep it.
    assert len(os.listdir(cache / OBJECTS_DIR)) == 1
    assert 0 < blocks.peak() <= 40 * MIB + 4096, blocks.peak()
    with sqlite3.connect(cache / "objects.sqlite") as db:
        (chunk_size,) = db.execute("SELECT chunk_size FROM objects").fetchone()  # as the cache cut them

    def recorded() -> int:  # bytes of the chunks recorded present
        with sqlite3.connect(cache / "objects.sqlite") as db:
            (found,) = db.execute(
                "SELECT COALESCE(SUM(MIN(o.chunk_size, o.size - c.chunk * o.chunk_size)), 0)"
                " FROM chunks c JOIN objects o ON c.object = o.id"
            ).fetchone()
        return int(found)

    wait_until(lambda: recorded() > 0, what="the last chunks fetched to be recorded")  # (each second)
    assert recorded() <= blocks_on_disk(cache) <= 40 * MIB + 4096
    stats = remote_stats(mountpoint)
    assert stats["evicted_chunks"] > 0 and stats["fetched_bytes"] > 40 * MIB + 2 * chunk_size, stats


def test_a_daemon_killed_mid_fetch_leaves_no_hole(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "killed", tensors=24)
    url = f"{nginx.url}/killed/m.safetensors"
    cache = tmp_path / "cache"
    mountpoint = mounts.mount(url, "--cache-dir", str(cache))  # type: ignore[arg-type]
    pid = mounts.daemon_pid(mountpoint)
    reader = subprocess.Popen(
        ["cat", *[str(mountpoint / name) for name in sorted(expected)]], stdout=subprocess.DEVNULL
    )

    def some_chunks_recorded() -> bool:
        try:
            with sqlite3.connect(cache / "objects.sqlite") as db:
                return db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0] >= 3
        except sqlite3.Error:
            return False

    try:
        wait_until(some_chunks_recorded, what="some chunks to be recorded", timeout=60)
        os.kill(pid, signal.SIGKILL)  # mid-read, with fetches in flight
    finally:
        reader.wait(timeout=patience(60))
    wait_until(lambda: not pid_alive(pid), what="the daemon to die")
    assert mounts.run("umount", "--lazy", str(mountpoint)).returncode == 0
    # every chunk recorded holds the object's bytes: none is a hole, none half-written
    shard = (nginx.root / "killed" / "m.safetensors").read_bytes()
    with sqlite3.connect(cache / "objects.sqlite") as db:
        rows = db.execute("SELECT object, chunk FROM chunks").fetchall()
    assert rows
    for oid, chunk in rows:
        with open(cache / OBJECTS_DIR / oid, "rb") as f:
            f.seek(chunk * 8 * MIB)
            assert f.read(8 * MIB) == shard[chunk * 8 * MIB : (chunk + 1) * 8 * MIB], chunk
    again = mounts.mount(url, "--cache-dir", str(cache))  # type: ignore[arg-type]
    for name, data in expected.items():
        assert (again / name).read_bytes() == data, name


# -- faults in the middle of a GET's body ---------------------------------------------------------


HELD_AFTER = 32 << 10
"""Bytes a held GET lets through: fewer than a direct_read asks for, wherever in its chunk the GET
starts (a cold read well into a chunk has its own bytes asked for first)."""


def direct_read(path: Path, offset: int, size: int = 64 << 10) -> tuple[bytes | int, float]:
    """One read of a mounted file that is one request to the daemon (O_DIRECT: no readahead, and no
    read again by the kernel after a failure): (its bytes, or the errno it failed with; seconds it took)."""
    buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    began = time.monotonic()
    try:
        count = os.preadv(fd, [buffer], offset)
        return buffer[:count], time.monotonic() - began
    except OSError as exc:
        return exc.errno or 0, time.monotonic() - began
    finally:
        os.close(fd)
        buffer.close()


TIMEOUT = 3
"""--remote-timeout of the tests below, in seconds."""


def test_a_get_held_mid_body_is_eio_within_the_remote_timeout(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A chunk's GET that stops mid-body (the server's bytes held by a proxy, the connection open): the
    read waiting on it gets EIO within --remote-timeout (a loose bound, not a timing), the daemon
    goes on, and the same reads get the model's bytes once they flow again."""
    expected = big_model(nginx.root / "held", tensors=3)
    proxy = StallingProxy(nginx.port)
    try:
        url = proxy.url("held/m.safetensors")
        options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", str(TIMEOUT)]
        mountpoint = mounts.mount(url, *options, "--remote-concurrency", "1")  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        gets = remote_stats(mountpoint)["gets"]
        proxy.stall_after(HELD_AFTER)  # t01's chunk: its first bytes come, then nothing more
        outcome, seconds = direct_read(mountpoint / "t01", 2 * MIB)
        assert proxy.holding.is_set() and remote_stats(mountpoint)["gets"] > gets  # held mid-body, not refused
        assert outcome == errno.EIO and seconds < patience(2 * TIMEOUT + 5), (outcome, seconds)
        # A buffered reader: the kernel asks again after a failed readahead (a request, a page), each
        # request bounded so; the error is the reader's all the same.
        began = time.monotonic()
        assert errno_of_reading(mountpoint / "t02") == errno.EIO
        assert time.monotonic() - began < patience(4 * TIMEOUT + 10)
        assert pid_alive(pid) and f"tensor 't01': bytes [{2 * MIB}, " in mounts.log()
        proxy.release()
        assert direct_read(mountpoint / "t01", 2 * MIB)[0] == expected["t01"][2 * MIB : 2 * MIB + (64 << 10)]
        for name in ("t01", "t02"):
            assert (mountpoint / name).read_bytes() == expected[name], name
    finally:
        proxy.close()


def in_a_thread(read: Callable[[], tuple[bytes | int, float]]) -> tuple[threading.Thread, list[bytes | int]]:
    """`read` begun on a thread of its own: the thread, and where its bytes (or errno) will be."""
    outcome: list[bytes | int] = []
    thread = threading.Thread(target=lambda: outcome.append(read()[0]))
    thread.start()
    return thread, outcome


def test_a_read_in_a_chunk_being_fetched_is_answered_as_its_bytes_come(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """A read that lands in a chunk another read's GET is bringing in already is answered once its
    own bytes have been written, not when the whole chunk has (a reader that caught up with the
    read-ahead stalled for a chunk's transfer each time): the GET held mid-body 3 MiB in, a read 1
    MiB in returns the model's bytes while the rest is still held (answering after the chunk, it
    waited for as long as the GET was held), counted (`arriving_reads`), and the read-ahead goes on
    for it: the next chunk is asked for."""
    expected = big_model(nginx.root / "joined", tensors=1, size=12 * MIB)["t00"]  # two chunks
    proxy = StallingProxy(nginx.port)
    try:
        mountpoint = mounts.mount(proxy.url("joined/m.safetensors"), "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        proxy.stall_after(3 * MIB)
        assert direct_read(mountpoint / "t00", 0, 4096)[0] == expected[:4096]  # begins the chunk's GET
        before, requests = remote_stats(mountpoint), proxy.requests
        assert before["arriving_reads"] == 0  # that read began its chunk's fetch: it joined none
        reader, got = in_a_thread(lambda: direct_read(mountpoint / "t00", MIB))
        try:
            reader.join(patience(30))
            assert not reader.is_alive(), "the read waits for the rest of the chunk"
            assert got == [expected[MIB : MIB + (64 << 10)]]
            after = remote_stats(mountpoint)
            assert after["arriving_reads"] == 1 and after["fetched_bytes"] == 0  # no chunk has all come
            assert proxy.holding.wait(patience(30))  # and the rest of the chunk is still held
            wait_until(lambda: proxy.requests > requests, what="the next chunk to be asked for")
        finally:
            proxy.release()
            reader.join()
        assert (mountpoint / "t00").read_bytes() == expected
    finally:
        proxy.close()


def test_a_fetch_that_fails_after_a_read_had_its_bytes(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A read answered from a chunk still coming keeps its bytes when the chunk's GET fails after
    them (held mid-body past --remote-timeout): they were written as this object version's GET sent
    them, in a chunk with nothing to be checked against (it never came before), and an answer is
    not taken back. The chunk is not kept: the failure is counted, nothing of it is recorded, and
    once the store's bytes flow it is fetched again and read byte-exact."""
    expected = big_model(nginx.root / "failed-after", tensors=1, size=4 * MIB)["t00"]  # one chunk
    proxy = StallingProxy(nginx.port)
    try:
        options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", str(TIMEOUT)]
        mountpoint = mounts.mount(proxy.url("failed-after/m.safetensors"), *options)  # type: ignore[arg-type]
        proxy.stall_after(3 * MIB)
        assert direct_read(mountpoint / "t00", 0, 4096)[0] == expected[:4096]  # begins the chunk's GET
        failures = remote_stats(mountpoint)["fetch_failures"]
        got = direct_read(mountpoint / "t00", MIB)[0]  # joins it
        assert got == expected[MIB : MIB + (64 << 10)]
        counted = remote_stats(mountpoint)
        assert counted["arriving_reads"] == 1 and counted["fetch_failures"] == failures  # answered first
        wait_until(
            lambda: remote_stats(mountpoint)["fetch_failures"] > failures,
            what="the held GET to fail",
            timeout=2 * TIMEOUT + 10,
        )
        gets = remote_stats(mountpoint)["gets"]
        assert remote_stats(mountpoint)["fetched_bytes"] == 0  # nothing of the chunk kept
        proxy.release()
        assert (mountpoint / "t00").read_bytes() == expected
        assert remote_stats(mountpoint)["gets"] > gets  # fetched again
    finally:
        proxy.close()


def test_a_fetch_that_fails_before_a_read_had_its_bytes(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A read waiting in a chunk still coming for bytes that have not come yet gets EIO when the
    chunk's GET fails (held mid-body past --remote-timeout): never zeros, nor the bytes before; no
    second GET is hidden in that read (it fails with the fetch it joined); a retry once the store's
    bytes flow reads them exactly."""
    expected = big_model(nginx.root / "failed-before", tensors=1, size=4 * MIB)["t00"]  # one chunk
    proxy = StallingProxy(nginx.port)
    try:
        options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", str(TIMEOUT)]
        mountpoint = mounts.mount(proxy.url("failed-before/m.safetensors"), *options)  # type: ignore[arg-type]
        proxy.stall_after(MIB)
        assert direct_read(mountpoint / "t00", 0, 4096)[0] == expected[:4096]  # begins the chunk's GET
        before = remote_stats(mountpoint)
        reader, got = in_a_thread(lambda: direct_read(mountpoint / "t00", 2 * MIB))
        try:
            wait_until(lambda: reads_in_handlers(mountpoint) == 1, what="the read to wait in the daemon")
            reader.join(patience(2 * TIMEOUT + 10))
            assert not reader.is_alive(), "the read outlived the GET it waited on"
            assert got == [errno.EIO], got
        finally:
            proxy.release()
            reader.join()
        after = remote_stats(mountpoint)
        assert after["fetch_failures"] == before["fetch_failures"] + 1 and after["gets"] == before["gets"]
        assert after["arriving_reads"] == 0
        assert direct_read(mountpoint / "t00", 2 * MIB)[0] == expected[2 * MIB : 2 * MIB + (64 << 10)]
    finally:
        proxy.close()


def test_a_server_that_stops_mid_body(mounts: Mounts, own_nginx: Nginx, tmp_path: Path) -> None:
    """The server goes while a chunk's body is coming (the proxy held it mid-way), and the connection
    with it; every attempt after it is refused: the read gets EIO within --remote-timeout of it, and
    reads the model's bytes once the server is back."""
    expected = big_model(own_nginx.root / "m", tensors=3)
    proxy = StallingProxy(own_nginx.port)
    try:
        options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", str(TIMEOUT)]
        mountpoint = mounts.mount(proxy.url("m/m.safetensors"), *options, "--remote-concurrency", "1")  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        proxy.stall_after(HELD_AFTER)
        outcome: list[tuple[bytes | int, float]] = []
        reader = threading.Thread(target=lambda: outcome.append(direct_read(mountpoint / "t01", 2 * MIB)))
        reader.start()
        try:
            assert proxy.holding.wait(patience(30)), "the GET never came"
            stopped = time.monotonic()
            own_nginx.stop()
            proxy.cut()  # what the server had sent on (socket buffers hold megabytes) is lost with it
            proxy.release()
        finally:
            reader.join(patience(60))
        assert outcome and outcome[0][0] == errno.EIO, outcome
        assert time.monotonic() - stopped < patience(2 * TIMEOUT + 5)
        assert pid_alive(pid)
        back = Nginx(own_nginx.directory, own_nginx.port)
        back.start()
        try:
            assert (mountpoint / "t01").read_bytes() == expected["t01"]
        finally:
            back.stop()
    finally:
        proxy.close()


def test_a_daemon_killed_while_a_chunk_is_half_written(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """SIGKILL while a chunk's GET has written part of it into the cache file (the proxy holds the rest):
    the chunk is not recorded, its blocks are freed when the cache file is next opened, and a new
    mount fetches it again whole and reads byte-exact."""
    expected = big_model(nginx.root / "halfway", tensors=2)
    shard = (nginx.root / "halfway" / "m.safetensors").read_bytes()
    cache = tmp_path / "cache"
    proxy = StallingProxy(nginx.port)
    try:
        url = proxy.url("halfway/m.safetensors")
        options = ["--cache-dir", str(cache), "--remote-concurrency", "1"]
        mountpoint = mounts.mount(url, *options)  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        with sqlite3.connect(cache / "objects.sqlite") as db:
            oid, chunk_size = db.execute("SELECT id, chunk_size FROM objects WHERE url=?", (url,)).fetchone()
        path = cache / OBJECTS_DIR / oid
        chunk = 1  # t01 begins in it
        begin = chunk * chunk_size
        proxy.stall_after(3 * MIB)
        reader = subprocess.Popen(["cat", str(mountpoint / "t01")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        page = mmap.PAGESIZE
        try:

            def written(offset: int, count: int) -> bytes:
                with open(path, "rb") as f:
                    f.seek(offset)
                    return f.read(count)

            def pages_written() -> tuple[int, int]:
                """The chunk's pages that hold the shard's bytes, and those still all zero."""
                data = np.frombuffer(written(begin, chunk_size).ljust(chunk_size, b"\0"), np.uint8).reshape(-1, page)
                want = np.frombuffer(shard, np.uint8, chunk_size, begin).reshape(-1, page)
                return int((data == want).all(axis=1).sum()), int((data == 0).all(axis=1).sum())

            # Which part of the chunk comes first depends on which of cat's reads (the kernel sends
            # several at once) the daemon takes first: a read well into the chunk has its GET begin
            # there. Either way 3 MiB of it come, in whole pages but for the one being written.
            wait_until(
                lambda: proxy.holding.is_set() and pages_written()[0] * page >= 2 * MIB,
                what="2 MiB of the chunk to be written, and the proxy holding the rest",
                timeout=patience(30),
            )
            full, empty = pages_written()  # the rest never came: all zero but a page being written
            assert full * page <= 3 * MIB and full + empty >= chunk_size // page - 2
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(pid), what="the daemon to die")
            _, stderr = reader.communicate(timeout=patience(30))
        finally:
            reap(reader)
        said = stderr.decode()  # cat's: the connection went with the daemon
        assert reader.returncode == 1 and ("connection abort" in said or "endpoint is not connected" in said), said

        def rows(table: str) -> list[tuple[object, ...]]:
            with sqlite3.connect(cache / "objects.sqlite") as db:
                found: list[tuple[object, ...]] = db.execute(
                    f"SELECT * FROM {table} WHERE object=? AND chunk=?", (oid, chunk)
                ).fetchall()
            return found

        assert rows("chunks") == [] and rows("digests") == []  # neither present nor summed: it never came
        assert mounts.run("umount", "--lazy", str(mountpoint)).returncode == 0
        proxy.release()
        again = mounts.mount(url, *options)  # type: ignore[arg-type]
        # the half-written chunk's blocks were freed when the new daemon opened the cache file
        with open(path, "rb") as f:
            try:
                data_at = os.lseek(f.fileno(), begin, os.SEEK_DATA)
            except OSError as exc:
                assert exc.errno == errno.ENXIO  # no data from there on
                data_at = os.fstat(f.fileno()).st_size
        assert data_at >= begin + chunk_size, data_at
        fetched = remote_stats(again)["fetched_bytes"]
        assert (again / "t01").read_bytes() == expected["t01"]
        assert remote_stats(again)["fetched_bytes"] - fetched >= chunk_size  # fetched again, whole
        assert written(begin, chunk_size) == shard[begin : begin + chunk_size]
        # recorded, now that it came whole (a daemon records what it fetched each second)
        wait_until(lambda: rows("chunks") != [], what="the chunk to be recorded")
    finally:
        proxy.close()


# -- requests inside a running handler, waiting on a GET held mid-body ----------------------------


def cache_file_locks(pid: int, path: Path) -> list[tuple[str, int]]:
    """The locks a process holds on a cache file, through its descriptors of it: (READ or WRITE, byte)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        for line in info.splitlines():
            if line.startswith("lock:"):  # lock:  1: OFDLCK ADVISORY  READ -1 fe:00:1234 START END
                fields = line.split()  # (the kernel merges adjacent bytes locked alike into one range)
                found.update((fields[4], byte) for byte in range(int(fields[-2]), int(fields[-1]) + 1))
    return sorted(found)


def pinned_chunks(pid: int, path: Path) -> list[int]:
    """The chunks a process holds against eviction: their presence bytes (1 + 2 x chunk), locked."""
    return [(byte - 1) // 2 for _, byte in cache_file_locks(pid, path) if byte % 2 == 1]


def test_readers_killed_while_their_reads_wait_on_a_held_get(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """Each round, a reader's read of two cold chunks is inside the daemon's handler, the chunks pinned,
    waiting on their GET held mid-body; the reader is killed (SIGKILL), then the GETs go on and the
    answer goes to a reader that is gone. Over the rounds the daemon's pins on the cache (its lock
    bytes in the cache file), descriptors, mappings and threads do not grow, and every tensor reads
    exact after."""
    expected = big_model(nginx.root / "pins", tensors=16, size=2 * MIB)
    cache = tmp_path / "cache"
    proxy = StallingProxy(nginx.port)
    try:
        url = proxy.url("pins/m.safetensors")
        options = ["--cache-dir", str(cache), "--chunk-mb", "1", "--remote-concurrency", "1"]
        mountpoint = mounts.mount(url, *options)  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        with sqlite3.connect(cache / "objects.sqlite") as db:
            (oid,) = db.execute("SELECT id FROM objects WHERE url=?", (url,)).fetchone()
        path = cache / OBJECTS_DIR / oid

        def one_round(i: int) -> None:
            # t{i} holds chunks 2i and 2i + 1 (and a little of the next): a read across the two, never fetched
            reader = OneRead(mountpoint / f"t{i:02d}", MIB - (32 << 10))
            try:
                assert reader.said() == "open"
                proxy.stall_after(64 << 10)  # less of the first chunk than the read wants
                reader.go()
                wait_until(
                    lambda: proxy.holding.is_set() and reads_in_handlers(mountpoint) == 1,
                    what="the read to wait inside the daemon's handler on its GET",
                )
                assert pinned_chunks(pid, path) == [2 * i, 2 * i + 1]  # pinned before they are fetched
                reader.process.kill()
                proxy.release()
                assert reader.process.wait(patience(30)) == -signal.SIGKILL
            finally:
                proxy.release()  # (a reader killed waits for its answer: it cannot go before)
                reader.stop()

        def at_rest() -> bool:  # nothing pinned, nothing being fetched: the file held open, and that is all
            return cache_file_locks(pid, path) == [("READ", 0)]

        one_round(0)  # the first sets up what every read shares
        wait_until(at_rest, what="the first reply's chunks to be let go")
        before = daemon_resources(pid), file_mappings(pid), len(threads_of(pid))
        files_open = descriptors_but_sockets(pid)
        said = daemon_process(mountpoint)
        for i in range(1, len(expected)):
            one_round(i)
        assert reads_in_handlers(mountpoint) == 0
        wait_until(at_rest, what="every chunk to be let go")  # replies' ranges: within a second
        wait_until(lambda: len(threads_of(pid)) <= before[2], what="the rounds' worker threads to go", timeout=30)
        (_, maps), files = daemon_resources(pid), file_mappings(pid)
        now = daemon_process(mountpoint)  # and as the daemon counts itself
        # Its HTTP pool's connections come and go (a stalled one closed, another opened: 26 -> 27 in
        # one CI run); a descriptor leaked a round would be 15 more.
        assert now["fds"] <= said["fds"] + 2 and now["threads"] <= said["threads"], (said, now)
        assert descriptors_but_sockets(pid) == files_open
        # (one of pyfuse3's receive buffers more or less is no leak: see test_faults.py's rounds)
        assert maps <= before[0][1] + 1 and files == before[1], (before, maps, files)
        assert pid_alive(pid) and remote_stats(mountpoint)["gets"] >= 2 * len(expected)
        for name, data in expected.items():
            assert (mountpoint / name).read_bytes() == data, name
    finally:
        proxy.close()


def test_sigterm_with_a_read_waiting_on_a_get_that_never_ends(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """SIGTERM while a read waits inside the daemon's handler on a GET held mid-body for good: the
    daemon takes it at once, the read gets EIO within --remote-timeout, and the daemon unmounts and
    exits 0 (the store hanging does not keep it)."""
    big_model(nginx.root / "hung", tensors=2)
    proxy = StallingProxy(nginx.port)
    try:
        options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", str(TIMEOUT)]
        mountpoint, daemon = mounts.mount_adopted(proxy.url("hung/m.safetensors"), *options)  # type: ignore[arg-type]
        pid = mounts.daemon_pid(mountpoint)
        reader = OneRead(mountpoint / "t01", 2 * MIB)
        try:
            assert reader.said() == "open"
            proxy.stall_after(HELD_AFTER)
            reader.go()
            wait_until(
                lambda: proxy.holding.is_set() and reads_in_handlers(mountpoint) == 1,
                what="the read to wait inside the daemon's handler on its GET",
            )
            signalled = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            assert reader.said(timeout=4 * TIMEOUT + 10) == f"error {errno.EIO}"
            assert "SIGTERM: unmounting" in mounts.log()
            assert daemon.exit_status(timeout=4 * TIMEOUT + 10) == (pid, 0)
            assert time.monotonic() - signalled < patience(4 * TIMEOUT + 10)
        finally:
            reader.stop()
        assert proxy.holding.is_set() and not os.path.ismount(mountpoint)
    finally:
        proxy.close()


def test_an_empty_object_is_said_to_be_empty(nginx: Nginx, tmp_path: Path) -> None:
    """An empty file has no byte at offset 0: the store answers the first read 416, and tensorfs asks
    its size instead (a HEAD) and says what is wrong with the file, not with the request."""
    directory = nginx.root / "empty-object"
    directory.mkdir()
    (directory / "m.safetensors").write_bytes(b"")
    result = cli("validate", "--cache-dir", str(tmp_path / "cache"), f"{nginx.url}/empty-object/m.safetensors")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "m.safetensors" in result.stderr and "416" not in result.stderr and "Traceback" not in result.stderr


def test_a_failure_that_mentions_416_is_not_taken_for_an_empty_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error is taken for a 416 (an empty object, then asked for its size) by its status alone: a
    500 after retries whose time taken has the digits 416 in it, as obstore says it, is said as the
    500 it is (it was taken for an empty object; the HEAD that followed failed with a traceback)."""
    import obstore

    from tensorfs.errors import RemoteError
    from tensorfs.sources.client import read_first_bytes
    from tensorfs.sources.store import ObjectRef, RemoteOptions, store_spec

    def failed(*_: object, **__: object) -> None:
        raise Exception(
            "Generic HTTP error: Error performing GET http://127.0.0.1:1/m.safetensors in 2.572416593s, after 10 "
            "retries, max_retries: 10, retry_timeout: 180s - Server returned non-2xx status code: 500 Internal "
            "Server Error: "
        )

    def head(*_: object, **__: object) -> None:
        raise AssertionError("asked for the size of an object that is not empty")

    monkeypatch.setattr(obstore, "get", failed)
    monkeypatch.setattr(obstore, "head", head)
    spec, key = store_spec("s3://bucket/m.safetensors", RemoteOptions(endpoint_url="http://127.0.0.1:1"))
    with pytest.raises(RemoteError, match=r"the server answered 500 Internal Server Error$"):
        read_first_bytes(ObjectRef(spec, key), lambda first, size: size)


@pytest.mark.mount
def test_readers_waiting_on_a_stalled_chunk_each_wait_one_timeout(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    """Five readers of tensors in one chunk whose body stalls, under a manifest (each tensor hashed
    before it is served): they all wait on the one fetch of the chunk, and are all answered (EIO)
    when it fails; one fetch failed, not one after another (they were answered in waves, a timeout
    each: two hashing threads, each waiting out the stall in turn)."""
    tensors = {f"t{k}": random_bytes(MIB, 90 + k) for k in range(5)}
    write_reference(hostile.root / "m.safetensors", {name: ("U8", [MIB], data) for name, data in tensors.items()})
    sums = tmp_path / "m.sha256"
    sums.write_text("".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in tensors.items()))
    mountpoint = mounts.mount(
        f"{hostile.url}/m.safetensors",  # type: ignore[arg-type]
        *("--cache-dir", str(tmp_path / "cache"), "--manifest", str(sums), "--remote-timeout", "6"),
    )
    hostile.lies.append(Lie("body", "m.safetensors", "stall"))  # (its header was read at the mount)
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda name: errno_of_reading(mountpoint / name), tensors))
    assert answers == [errno.EIO] * 5
    assert remote_stats(mountpoint)["fetch_failures"] == 1  # one fetch failed, and answered them all


@pytest.mark.mount
@pytest.mark.parametrize(("read", "stalls"), [(".tensorfs/model/config.json", "config.json"), ("t", "m.safetensors")])
def test_readers_of_one_stalled_file_each_wait_one_timeout(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, read: str, stalls: str
) -> None:
    """Six readers of one remote file (a companion, a tensor) whose body stalls: all wait on the one
    fetch of its chunk and are all answered (EIO) when it fails. They were answered one
    --remote-timeout after another (the kernel sends the readers of a file's page one at a time:
    each failed read left the page to the next reader, who asked the daemon again and waited a
    timeout of its own). A reader that opens it after them asks the store again."""
    write_reference(hostile.root / "m.safetensors", {"t": ("U8", [MIB], random_bytes(MIB, 7))})
    (hostile.root / "config.json").write_bytes(b'{"model_type": "test", "pad": "' + b"x" * 300_000 + b'"}')
    mountpoint = mounts.mount(
        f"{hostile.url}/m.safetensors",  # type: ignore[arg-type]
        *("--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "4"),
    )
    path = mountpoint / read
    assert path.stat().st_size > 300_000  # (the companion found at the mount, by a HEAD)
    hostile.lies.append(Lie("body", stalls, "stall"))  # (the shard's header was read at the mount)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(errno_of_reading, [path] * 6))
    assert answers == [errno.EIO] * 6
    assert remote_stats(mountpoint)["fetch_failures"] == 1  # one fetch failed, and answered them all
    hostile.lies.clear()
    assert path.read_bytes() == (hostile.root / stalls).read_bytes()[-path.stat().st_size :]
