"""Remote models when things go wrong: servers that stop, connections that drop, objects that change
or vanish, a full cache disk, eviction under load, a daemon killed mid-fetch.

Reads that fail get EIO and an ERROR line naming the tensor, the object and the cause; the daemon
goes on, and reads succeed again once the cause is gone. No byte that is not the model's is served.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from conftest import Mounts, drop_caches, missing_root, require, wait_until
from helpers import MIB, errno_of_reading, random_bytes, write_reference
from servers import DroppingProxy, Nginx, SeaweedFS
from tensorfs.model import open_model
from tensorfs.mount.mounttable import pid_alive
from tensorfs.sources.chunkcache import OBJECTS_DIR
from tensorfs.sources.store import RemoteOptions


def big_model(directory: Path, tensors: int = 12, size: int = 8 * MIB) -> dict[str, bytes]:
    """One shard of `tensors` tensors of `size` bytes each (random, so every chunk differs)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {f"t{i:02d}": random_bytes(size, 100 + i) for i in range(tensors)}
    write_reference(directory / "m.safetensors", {name: ("U8", [size], blob) for name, blob in data.items()})
    return data


@pytest.fixture
def own_nginx(tmp_path: Path) -> Iterator[Nginx]:
    """An nginx of the test's own, to be stopped and started again."""
    server = Nginx(tmp_path / "nginx")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_a_server_that_stops_and_comes_back(mounts: Mounts, own_nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(own_nginx.root / "m")
    url = f"{own_nginx.url}/m/m.safetensors"
    mountpoint = mounts.mount(url, "--remote-timeout", "2", "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t00").read_bytes() == expected["t00"]
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
        proxy.refuse = 25  # more failed attempts than a retry count would allow; well within the time
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
    common = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "5"]
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
    mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1")  # type: ignore[arg-type]
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


def test_a_full_cache_disk(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A cache disk (a 20 MiB tmpfs, no --cache-size) that fills before any bound: 64 MiB of tensors
    read through it, what nobody uses evicted to make room (chunks fetched ahead of the reader
    among them), every byte exact; filled by a file not the cache's, a read gets EIO (what is
    cached is served on, the daemon lives) until there is room again."""
    require("root (it mounts a small tmpfs)", missing_root())
    expected = big_model(nginx.root / "full", tensors=8)
    cache = tmp_path / "small-disk"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=0700", "tmpfs", str(cache)], check=True)
    try:
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
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


def test_eviction_under_eight_readers(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    expected = big_model(nginx.root / "evict", tensors=16, size=6 * MIB)  # 96 MiB through a 40 MiB cache
    cache = tmp_path / "cache"
    mountpoint = mounts.mount(f"{nginx.url}/evict/m.safetensors", "--cache-size", "40M", "--cache-dir", str(cache))  # type: ignore[arg-type]
    names = sorted(expected)
    failures: list[str] = []
    done = [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        handles = {name: open(mountpoint / name, "rb") for name in names}  # noqa: SIM115
        try:
            for _ in range(60):
                name = rng.choice(names)
                offset = rng.randrange(6 * MIB)
                length = rng.randrange(1, 2 * MIB)
                try:
                    got = os.pread(handles[name].fileno(), length, offset)
                except OSError as exc:
                    failures.append(f"{name}: {exc}")
                    continue
                if got != expected[name][offset : offset + length]:
                    failures.append(f"{name} [{offset}, +{length}): wrong bytes")
                done[0] += 1
        finally:
            for handle in handles.values():
                handle.close()

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and done[0] == 8 * 60
    with sqlite3.connect(cache / "objects.sqlite") as db:
        (chunks,) = db.execute("SELECT COUNT(*) FROM chunks").fetchone()
    assert chunks * 8 * MIB <= 40 * MIB  # the bound held (what is recorded is what is held)


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
        reader.wait(timeout=60)
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
