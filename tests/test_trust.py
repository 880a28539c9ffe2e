"""No wrong byte from the remote cache, whatever a server sends or a file on disk holds; no request
where a server should not send it.

Each test makes the fault happen for real: a server that sends more than the range asked for, or
compressed bytes, or other bytes under the same ETag; a cache file changed on disk; a file system
that cannot hold an object; several daemons on one bounded cache; a server that redirects to the
cloud's metadata service, or from https:// down to http://.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import tensorfs
from conftest import Mounts, drop_caches, missing_root, require, wait_until
from helpers import (
    MIB,
    CacheBlocks,
    certificate_for_loopback,
    cli,
    errno_of_reading,
    patience,
    random_bytes,
    random_shard,
    remote_stats,
    same_crc32c,
    write_reference,
)
from servers import HostileServer, Lie, Nginx
from tensorfs.proof.manifest import format_manifest
from tensorfs.sources.chunks import OBJECTS_DIR
from tensorfs.sources.store import RemoteOptions


def four_tensors(path: Path, size: int = 8 * MIB) -> dict[str, bytes]:
    """One shard of four tensors of `size` random bytes (every chunk differs from every other)."""
    return random_shard(path, {f"t{i}": size for i in range(4)}, seed=200)


def cached_chunks(cache: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(cache / "objects.sqlite") as db:
        return sorted(db.execute("SELECT object, chunk FROM chunks").fetchall())


# -- what a server sends ------------------------------------------------------------------------


def test_an_answer_longer_than_its_range_writes_nothing_outside_it(hostile: HostileServer, tmp_path: Path) -> None:
    """A 206 whose body runs past the range: refused, and the chunk after it (already cached, and
    its tensor's hash in the hash cache) keeps its bytes: in this process, after a remount, for verify."""
    expected = four_tensors(hostile.root / "m.safetensors")  # t0 ends in chunk 1, t2 lies in chunks 2 and 3
    url = f"{hostile.url}/m.safetensors"
    cache = tmp_path / "cache"
    common = ["--cache-dir", str(cache), "--include", "t2"]
    manifest = cli("manifest", "-o", str(tmp_path / "t2.sha256"), *common, url)
    assert manifest.returncode == 0, manifest.stderr  # t2's chunks fetched, its hash in the hash cache
    (oid, _), *_ = cached_chunks(cache)
    before = cached_chunks(cache)
    assert (oid, 2) in before and (oid, 1) not in before
    kept = (cache / OBJECTS_DIR / oid).read_bytes()[16 * MIB : 32 * MIB]
    remote = RemoteOptions(cache_dir=cache)
    with tensorfs.open_model(url, remote=remote) as model:
        hostile.lies.append(
            Lie("range", "m.safetensors", MIB)
        )  # from now on, a megabyte more than each range asked for
        with pytest.raises(tensorfs.TensorfsError, match=r"sent more than the \d+ bytes of .* asked for: refused"):
            bytes(model.raw("t0"))  # chunks 0 and 1 fetched: both answers run over
        assert bytes(model.raw("t2")) == expected["t2"]
    assert (cache / OBJECTS_DIR / oid).read_bytes()[16 * MIB : 32 * MIB] == kept  # not a byte written into them
    assert cached_chunks(cache) == before  # and nothing more taken for present
    hostile.lies.clear()
    with tensorfs.open_model(url, remote=remote) as model:  # another process's look at the same cache
        hostile.lies.append(Lie("range", "m.safetensors", MIB))
        assert bytes(model.raw("t2")) == expected["t2"]
    hostile.lies.clear()
    verified = cli("verify", "--manifest", str(tmp_path / "t2.sha256"), *common, url)
    assert verified.returncode == 0, verified.stderr
    with tensorfs.open_model(url, remote=remote) as model:  # an honest answer: all is well
        assert {name: bytes(model.raw(name)) for name in model} == expected


def test_the_hash_cache_of_a_remote_tensor_is_keyed_by_its_object_version(
    hostile: HostileServer, tmp_path: Path
) -> None:
    """A remote tensor's hash is kept for its object's version: asked again of that version, its
    chunks gone from the cache, it is told without fetching them; the object replaced by other bytes
    of the same size and date under a new ETag, the hashes told are the new bytes' (a hash cache
    keyed by what the two versions share told the old ones)."""
    url = f"{hostile.url}/m.safetensors"
    cache = tmp_path / "cache"

    def manifest() -> dict[str, str]:
        done = cli("manifest", "--cache-dir", str(cache), url)
        assert done.returncode == 0, done.stderr
        return {line.split()[1]: line.split()[0] for line in done.stdout.splitlines()}

    def sha256s(tensors: dict[str, bytes]) -> dict[str, str]:
        return {name: hashlib.sha256(data).hexdigest() for name, data in tensors.items()}

    first = four_tensors(hostile.root / "m.safetensors", size=MIB)  # each worth a row of the hash cache
    assert manifest() == sha256s(first)
    assert cli("cache", "prune", "--cache-dir", str(cache)).returncode == 0 and cached_chunks(cache) == []
    sent = hostile.sent["m.safetensors"]
    assert manifest() == sha256s(first)
    assert hostile.sent["m.safetensors"] - sent < MIB  # the header at most: no tensor's bytes again
    second = {f"t{i}": random_bytes(MIB, 900 + i) for i in range(4)}
    write_reference(hostile.root / "m.safetensors", {name: ("U8", [MIB], data) for name, data in second.items()})
    hostile.etags["m.safetensors"] = '"the second version"'  # same size, same Last-Modified
    assert manifest() == sha256s(second)


def test_a_compressed_answer_is_refused_in_one_line(hostile: HostileServer, tmp_path: Path) -> None:
    four_tensors(hostile.root / "m.safetensors", size=MIB)
    hostile.lies.append(Lie("body", "m.safetensors", "gzip"))
    result = cli("validate", "--cache-dir", str(tmp_path / "cache"), f"{hostile.url}/m.safetensors")
    assert result.returncode == 1
    assert result.stderr == (
        f"error: {hostile.url}/m.safetensors: the server sent it gzip-encoded (Content-Encoding), though asked "
        "for its bytes as they are: refused (serve it without compression)\n"
    )
    assert hostile.requests and all(accept == "identity" for *_, accept in hostile.requests)  # it was asked


def test_bytes_fetched_again_must_be_the_bytes_that_came_first(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    """A verified tensor whose chunks were evicted, and that the store then serves otherwise under
    the same ETag (its chunk's CRC-32C forged to match): never served (EIO), for the manifest is in
    force; `cache ls` beside changes nothing."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    manifest = tmp_path / "tensors.sha256"
    assert (
        cli("manifest", "-o", str(manifest), "--no-cache", "--cache-dir", str(tmp_path / "other"), url).returncode == 0
    )
    cache = tmp_path / "cache"
    mountpoint = mounts.mount(
        url,
        "--manifest",
        str(manifest),
        "--cache-dir",
        str(cache),
        "--cache-size",
        "24M",  # type: ignore[arg-type]
    )
    assert (mountpoint / "t0").read_bytes() == expected["t0"]  # verified, served
    listed = cli("cache", "ls", "--json", "--cache-dir", str(cache))
    assert listed.returncode == 0 and json.loads(listed.stdout.splitlines()[0])["in_use"] is True
    for name in ("t1", "t2", "t3"):  # 24 MiB through a 24 MiB cache: t0's chunks are evicted
        assert (mountpoint / name).read_bytes() == expected[name]
    stats = remote_stats(mountpoint)
    assert stats["evicted_chunks"] > 0
    before = remote_stats(mountpoint)
    assert cli("cache", "ls", "--cache-dir", str(cache)).returncode == 0  # beside the mount: changes nothing
    after = remote_stats(mountpoint)
    assert (after["gets"], after["evicted_chunks"]) == (before["gets"], before["evicted_chunks"])
    served = (hostile.root / "m.safetensors").read_bytes()
    chunk = served[: 8 * MIB]  # t0's first chunk: other bytes in it, with its CRC-32C kept (what a CRC cannot tell)
    changed = chunk[:MIB] + bytes(b ^ 0xFF for b in chunk[MIB : 2 * MIB]) + chunk[2 * MIB :]
    hostile.lies.append(Lie("body", "m.safetensors", same_crc32c(chunk, changed) + served[8 * MIB :]))  # the same ETag
    drop_caches()  # the kernel's copy of t0 too: it is read again
    assert errno_of_reading(mountpoint / "t0") == errno.EIO  # never the other bytes
    assert "are not those the same version (ETag" in mounts.log()
    assert (mountpoint / "t3").read_bytes() == expected["t3"]  # what is cached is served on


# The rule "bytes fetched again are the bytes that came first" without a manifest in force: what a
# chunk first summed to is kept in the cache for every process, and a refusal under a manifest or a
# signature elsewhere (another mount on the same cache, or a neighbouring tensor) never takes it away.


@dataclass
class Store:
    """A model in the hostile server, through one of its APIs: its URL, the options that reach it, and
    what a lie names it by."""

    url: str
    options: list[str]
    target: str
    path: Path


def store_of(hostile: HostileServer, protocol: str) -> Store:
    if protocol == "http":
        return Store(f"{hostile.url}/m.safetensors", [], "m.safetensors", hostile.root / "m.safetensors")
    (hostile.root / "bucket").mkdir(exist_ok=True)
    options = ["--endpoint-url", hostile.url, "--no-sign-request"]
    return Store(
        "s3://bucket/m.safetensors", options, "bucket/m.safetensors", hostile.root / "bucket" / "m.safetensors"
    )


def other_bytes(store: Store) -> Lie:
    """Every byte after the header other (flipped) from now on, under the object's first ETag."""
    served = store.path.read_bytes()
    header = 8 + int.from_bytes(served[:8], "little")
    return Lie("body", store.target, served[:header] + bytes(b ^ 0xFF for b in served[header:]))


def read_or_errno(path: Path) -> bytes | int:
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc.errno or -1


@pytest.mark.parametrize("protocol", ["http", "s3"])
def test_without_a_manifest_a_chunk_evicted_and_fetched_again_is_held_to_its_first_bytes(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, protocol: str
) -> None:
    """No manifest, a bounded cache (3 MiB of 1 MiB chunks): every tensor read, the first evicted;
    then the store answers other bytes under the same ETag: a tensor read again is refused (EIO),
    never served with them."""
    store = store_of(hostile, protocol)
    expected = random_shard(store.path, {f"t{i}": MIB for i in range(6)}, seed=210)
    cache = ["--cache-dir", str(tmp_path / "cache"), "--cache-size", "3M", "--chunk-mb", "1"]
    mountpoint = mounts.mount(store.url, *store.options, *cache)
    for name, data in expected.items():
        assert (mountpoint / name).read_bytes() == data
    assert remote_stats(mountpoint)["evicted_chunks"] > 0
    hostile.lies.append(other_bytes(store))
    drop_caches()
    for name, data in expected.items():
        assert read_or_errno(mountpoint / name) in (data, errno.EIO), name
    assert remote_stats(mountpoint)["changed_chunks"] > 0  # the other bytes came, and were refused
    assert "are not those the same version (ETag" in mounts.log()


@pytest.mark.parametrize("protocol", ["http", "s3"])
def test_a_refusal_under_a_manifest_leaves_what_chunks_first_summed_to(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, protocol: str
) -> None:
    """A mount without a manifest reads t0 (its chunks summed); the store then lies; a mount of the
    same cache with a manifest refuses t1, whose first chunk t0 shares; a third mount, without a
    manifest, reads t0 again: never the other bytes (served at d4c56fe: the refusal had forgotten what
    the shared chunk first summed to, for every process)."""
    store = store_of(hostile, protocol)
    expected = random_shard(store.path, {"t0": 3 * MIB // 2, "t1": 16 * MIB}, seed=300)  # chunk 1 holds both
    sums = tmp_path / "m.sha256"
    sums.write_text(format_manifest({name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}))
    cache = [*store.options, "--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1"]
    first = mounts.mount(store.url, *cache)
    assert (first / "t0").read_bytes() == expected["t0"]
    assert mounts.run("umount", str(first)).returncode == 0
    hostile.lies.append(other_bytes(store))
    checked = mounts.mount(store.url, "--manifest", str(sums), *cache)
    assert read_or_errno(checked / "t1") == errno.EIO
    assert mounts.run("umount", str(checked)).returncode == 0
    again = mounts.mount(store.url, *cache)
    drop_caches()
    assert read_or_errno(again / "t0") in (expected["t0"], errno.EIO)


@pytest.mark.parametrize("protocol", ["http", "s3"])
def test_a_verified_tensor_beside_a_refused_one_is_never_served_other_bytes(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, protocol: str
) -> None:
    """Under a manifest, t0 verified and served; the store lies; t1, which shares t0's last chunk, is
    refused; t0 read again (its pages dropped) is its own bytes or EIO, never the other bytes."""
    store = store_of(hostile, protocol)
    expected = random_shard(store.path, {"t0": 3 * MIB // 2, "t1": 16 * MIB}, seed=300)
    sums = tmp_path / "m.sha256"
    sums.write_text(format_manifest({name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}))
    cache = ["--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1"]
    mountpoint = mounts.mount(store.url, *store.options, "--manifest", str(sums), *cache)
    assert (mountpoint / "t0").read_bytes() == expected["t0"]
    hostile.lies.append(other_bytes(store))
    assert read_or_errno(mountpoint / "t1") == errno.EIO
    drop_caches()
    assert read_or_errno(mountpoint / "t0") in (expected["t0"], errno.EIO)


def test_a_cache_file_changed_on_disk_is_a_miss_never_data(hostile: HostileServer, tmp_path: Path) -> None:
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    cache = tmp_path / "cache"
    manifest = cli("manifest", "-o", str(tmp_path / "tensors.sha256"), "--cache-dir", str(cache), url)
    assert manifest.returncode == 0, manifest.stderr
    (oid, _), *_ = cached_chunks(cache)
    with open(cache / OBJECTS_DIR / oid, "r+b") as f:  # a byte of t1 (chunk 1) changed in the cache file
        f.seek(8 * MIB + 4096)
        byte = f.read(1)
        f.seek(8 * MIB + 4096)
        f.write(bytes([byte[0] ^ 1]))
    gets = len([r for r in hostile.requests if r[0] == "GET"])
    with tensorfs.open_model(url, remote=RemoteOptions(cache_dir=cache)) as model:
        assert {name: bytes(model.raw(name)) for name in model} == expected
    fetched_again = [r for r in hostile.requests[gets:] if r[0] == "GET" and r[2].startswith(f"bytes={8 * MIB}-")]
    assert len(fetched_again) == 1  # the bad chunk, and only it, came again
    verified = cli("verify", "--manifest", str(tmp_path / "tensors.sha256"), "--cache-dir", str(cache), url)
    assert verified.returncode == 0, verified.stderr


def test_an_object_too_large_for_the_cache_file_system(hostile: HostileServer, tmp_path: Path) -> None:
    four_tensors(hostile.root / "m.safetensors")  # 32 MiB

    def small_files() -> None:  # files of at most 16 MiB: the object's cache file cannot be made
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * MIB, 16 * MIB))

    cache = tmp_path / "cache"
    result = cli("ls", "--cache-dir", str(cache), f"{hostile.url}/m.safetensors", preexec_fn=small_files)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert (
        result.stderr.startswith("error: ") and "File too large" in result.stderr and "Traceback" not in result.stderr
    )
    assert os.listdir(cache / OBJECTS_DIR) == []  # nothing left behind
    with sqlite3.connect(cache / "objects.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM objects").fetchone() == (0,)


# -- one bounded cache, several processes --------------------------------------------------------


def test_daemons_sharing_a_bounded_cache_keep_its_bound_and_go_on(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """Two mounts (one model each) on one 40 MiB cache, four readers each: every read exact, no wait
    for room that ends in a failure, and the blocks on disk never past the bound."""
    models = {}
    for name in ("a", "b"):
        directory = nginx.root / f"shared-{name}"
        models[name] = {
            tensor: data for tensor, data in four_tensors(directory / "m.safetensors", size=6 * MIB).items()
        }
        more = {f"u{i}": random_bytes(6 * MIB, 300 + i + (name == "b") * 10) for i in range(8)}
        write_reference(
            directory / "m.safetensors",
            {
                **{k: ("U8", [6 * MIB], v) for k, v in models[name].items()},
                **{k: ("U8", [6 * MIB], v) for k, v in more.items()},
            },
        )
        models[name].update(more)
    cache = tmp_path / "cache"
    common = ["--cache-dir", str(cache), "--cache-size", "40M"]
    blocks = CacheBlocks(tmp_path)
    mountpoints = {
        name: mounts.mount(f"{nginx.url}/shared-{name}/m.safetensors", *common, command=blocks.mount_command)  # type: ignore[arg-type]
        for name in models
    }
    failures: list[str] = []

    def reader(name: str, seed: int) -> None:
        for tensor in sorted(models[name], key=lambda t: hash((t, seed))):
            try:
                if (mountpoints[name] / tensor).read_bytes() != models[name][tensor]:
                    failures.append(f"{name}/{tensor}: wrong bytes")
            except OSError as exc:
                failures.append(f"{name}/{tensor}: {exc}")

    threads = [threading.Thread(target=reader, args=(name, seed)) for name in models for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    # the blocks on disk, both daemons' together (and the file system's own)
    assert 0 < blocks.peak() <= 40 * MIB + 2 * 4096, blocks.peak()

    def pruned() -> bool:  # the chunks no reader holds go (those of the last replies, within a second)
        prune = cli("cache", "prune", "--cache-dir", str(cache))
        assert prune.returncode == 0, prune.stderr
        return not prune.stdout.startswith("freed 0 B")

    wait_until(pruned, what="cache prune to free the chunks no reader holds", timeout=30)
    for name, tensors in models.items():  # and the mounts read on, fetching again what they need
        for tensor, data in tensors.items():
            assert (mountpoints[name] / tensor).read_bytes() == data


def test_daemons_of_one_model_on_one_cache_fetch_each_chunk_once(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    """Two mounts of the same object on one cache directory, four readers in each at once, in
    different orders: one cache file for both, written by both daemons. Every read is exact, each
    chunk is fetched once by the two together (the other daemon waits for it and checks it), and
    what the cache holds after is the object's bytes, read back with no request at all."""
    tensors = {f"t{i}": random_bytes(2 * MIB, 400 + i) for i in range(6)}
    write_reference(hostile.root / "m.safetensors", {k: ("U8", [2 * MIB], v) for k, v in tensors.items()})
    size = (hostile.root / "m.safetensors").stat().st_size
    url = f"{hostile.url}/m.safetensors"
    cache = tmp_path / "cache"
    common = ["--cache-dir", str(cache), "--chunk-mb", "1"]
    both = [mounts.mount(url, *common) for _ in range(2)]  # type: ignore[arg-type]
    failures: list[str] = []

    def reader(mountpoint: Path, seed: int) -> None:
        for name in sorted(tensors, key=lambda t: hash((t, seed))):
            try:
                if (mountpoint / name).read_bytes() != tensors[name]:
                    failures.append(f"{mountpoint.name}/{name}: wrong bytes")
            except OSError as exc:
                failures.append(f"{mountpoint.name}/{name}: {exc}")

    threads = [threading.Thread(target=reader, args=(m, seed)) for m in both for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    chunks = {f"bytes={start}-{min(start + MIB, size) - 1}" for start in range(0, size, MIB)}
    fetched = [r for method, name, r, _ in hostile.requests if method == "GET" and name == "m.safetensors"]
    counts = {r: fetched.count(r) for r in chunks}
    assert counts == dict.fromkeys(chunks, 1), counts
    for mountpoint in both:
        assert mounts.run("umount", str(mountpoint)).returncode == 0
    listed = [json.loads(line) for line in cli("cache", "ls", "--json", "--cache-dir", str(cache)).stdout.splitlines()]
    assert [(o["url"], o["cached"], o["size"]) for o in listed] == [(url, size, size)]
    asked = len(hostile.requests)
    with tensorfs.open_model(url, remote=RemoteOptions(cache_dir=cache, chunk_size=MIB, offline=True)) as model:
        assert {name: bytes(model.raw(name)) for name in model} == tensors
    assert len(hostile.requests) == asked


def test_a_chunk_another_process_answers_from_is_not_evicted(nginx: Nginx, tmp_path: Path) -> None:
    """Pins are per chunk and per process: `cache prune` takes every chunk but the one a reader of
    another process holds, and when the cache is full of held chunks the message says who holds them."""
    directory = nginx.root / "pinned"
    expected = four_tensors(directory / "m.safetensors", size=2 * MIB)
    url = f"{nginx.url}/pinned/m.safetensors"
    cache = tmp_path / "cache"
    remote = RemoteOptions(cache_dir=cache, chunk_size=MIB, cache_size=5 * MIB)

    with tensorfs.open_model(url, remote=remote) as model:
        shard_key, offset, _ = model.locate("t1")
        shard = model.shard_data(shard_key)
        shard.ensure_pinned(
            offset, offset + MIB
        )  # two chunks pinned (t1 does not begin on a chunk), as while a reply goes out
        start, nbytes = model.locate("t3")[1:]
        got = bytearray(nbytes)
        model.readinto(shard_key, start, memoryview(got))  # more chunks cached, not pinned
        assert bytes(got) == expected["t3"]
        shard.flush()
        held = [(oid, chunk) for oid, chunk in cached_chunks(cache) if offset // MIB <= chunk <= (offset + MIB) // MIB]
        assert len(held) == 2 and len(cached_chunks(cache)) > 2
        assert cli("cache", "prune", "--cache-dir", str(cache)).returncode == 0
        assert cached_chunks(cache) == held  # the others go; those in use stay
        started = time.monotonic()  # (it waits for room as long as for the store: --remote-timeout)
        full = cli("manifest", "--cache-dir", str(cache), "--cache-size", "2M", "--chunk-mb", "1",
                   "--remote-timeout", "5", url)  # fmt: skip
        assert full.returncode == 1 and time.monotonic() - started < patience(60)
        assert f"processes {os.getpid()} use it too" in full.stderr, full.stderr
        shard.unpin(offset, offset + MIB)
    done = cli("manifest", "--cache-dir", str(cache), "--cache-size", "6M", "--chunk-mb", "1", url)
    assert done.returncode == 0, done.stderr


# -- where a server redirects -------------------------------------------------------------------

# Inside a network namespace of its own (a loopback where 169.254.169.254 is an address too): a
# metadata service there, and a store on 127.0.0.1 that redirects to it; then the tensorfs command
# of argv[3:], URL in it standing for the store's. Prints {"code", "stderr", "asked"} as JSON.
REDIRECTED_TO_METADATA = """
import http.server, json, subprocess, sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from servers import HostileServer, Lie
asked = []
class Metadata(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        asked.append(self.path)
        body = b'{"AccessKeyId": "ASIA-INSTANCE", "SecretAccessKey": "only-for-this-machine"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_HEAD = do_GET
metadata = http.server.ThreadingHTTPServer(("169.254.169.254", 80), Metadata)
threading.Thread(target=metadata.serve_forever, daemon=True).start()
store = HostileServer(Path(sys.argv[2]))
for name in ("m.safetensors", "tensors.sha256"):
    store.lies.append(Lie("redirect", name, "http://169.254.169.254/latest/meta-data/iam/security-credentials/role"))
store.lies.append(Lie("redirect", "mapped.safetensors", "http://[::ffff:169.254.169.254]/latest/meta-data/"))
command = [word.replace("URL", store.url) for word in sys.argv[3:]]
done = subprocess.run([sys.executable, "-m", "tensorfs.cli", *command], capture_output=True, text=True, timeout=120)
print(json.dumps({"code": done.returncode, "stderr": done.stderr, "asked": asked}))
"""


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "URL/m.safetensors"],
        ["validate", "URL/mapped.safetensors"],
        ["verify", "--manifest", "URL/tensors.sha256", "MODEL"],
    ],
    ids=["shard", "ipv4-in-ipv6", "manifest"],
)
def test_a_redirect_to_a_metadata_address_is_never_followed(tmp_path: Path, command: list[str]) -> None:
    """A store that redirects a shard, or a manifest, to the cloud's metadata service (where an
    instance's credentials are): the request is refused without reaching it, in one line."""
    require("root (a network namespace of its own)", missing_root())
    require("unshare and ip", None if shutil.which("unshare") and shutil.which("ip") else "not installed")
    (tmp_path / "served").mkdir()
    write_reference(tmp_path / "m.safetensors", {"w": ("U8", [4], b"abcd")})
    words = [word.replace("MODEL", str(tmp_path / "m.safetensors")) for word in command]
    script = [sys.executable, "-c", REDIRECTED_TO_METADATA, str(Path(__file__).parent), str(tmp_path / "served")]
    isolated = 'ip link set lo up && ip addr add 169.254.169.254/32 dev lo && exec "$@"'
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", isolated, "sh", *script, *words[:1], "--remote-timeout", "2", *words[1:]],
        capture_output=True, text=True, timeout=patience(120),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["asked"] == [], outcome  # the metadata service was never reached
    assert outcome["code"] == 1 and outcome["stderr"].count("\n") == 1, outcome
    assert "refused: a link-local or cloud-metadata address" in outcome["stderr"], outcome
    assert "only-for-this-machine" not in outcome["stderr"]


def test_https_redirects_are_followed_to_https_only(tmp_path: Path) -> None:
    """An https:// model's store redirects a shard to another https:// server (followed, as HTTP
    does) and another to a plain http:// one (never followed: the bytes would come unprotected)."""
    require("openssl", None if shutil.which("openssl") else "not installed")
    authority, certificate, key = certificate_for_loopback(tmp_path / "tls")
    for name in ("front", "back", "plain"):
        (tmp_path / name).mkdir()
    write_reference(tmp_path / "back" / "m.safetensors", {"w": ("U8", [4], b"abcd")})
    write_reference(tmp_path / "plain" / "m.safetensors", {"w": ("U8", [4], b"abcd")})
    front = HostileServer(tmp_path / "front", (certificate, key))
    back = HostileServer(tmp_path / "back", (certificate, key))
    plain = HostileServer(tmp_path / "plain")
    try:
        front.lies.append(Lie("redirect", "same.safetensors", f"{back.url}/m.safetensors"))
        front.lies.append(Lie("redirect", "down.safetensors", f"{plain.url}/m.safetensors"))
        env = {**os.environ, "SSL_CERT_FILE": str(authority)}
        same = cli("validate", "--no-cache", "--remote-timeout", "5", f"{front.url}/same.safetensors", env=env)
        assert same.returncode == 0 and same.stdout.startswith(f"{front.url}/same.safetensors: valid"), same.stderr
        down = cli("validate", "--no-cache", "--remote-timeout", "5", f"{front.url}/down.safetensors", env=env)
        assert down.returncode == 1 and down.stderr.count("\n") == 1, down.stderr
        assert "a redirect not followed (https:// to http://, or more than 10 in a row)" in down.stderr
        assert plain.requests == []  # never asked
    finally:
        for server in (front, back, plain):
            server.close()
