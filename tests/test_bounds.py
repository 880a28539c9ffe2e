"""Bounded memory and time for whatever a server or a directory holds.

A server that announces a gigabyte of index or manifest is refused before its body is read; a
model directory with a hung mount inside it is scanned without ever touching that mount.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tensorfs
from conftest import Mounts
from helpers import MIB, cli, errno_of_reading, patience, random_bytes, write_index, write_reference
from servers import HostileServer, Lie
from tensorfs.gate.plans import run
from tensorfs.mount.mounttable import daemon_pid
from tensorfs.opening.view_files import ViewRule
from tensorfs.sources.store import RemoteError, RemoteOptions


def test_an_index_of_a_gigabyte_is_refused_unread(hostile: HostileServer, tmp_path: Path) -> None:
    write_reference(hostile.root / "a.safetensors", {"w": ("U8", [16], bytes(16))})
    write_index(hostile.root, {"w": "a.safetensors"})
    hostile.lies.append(Lie("size", "model.safetensors.index.json", 1 << 30))
    url = f"{hostile.url}/model.safetensors.index.json"
    result = cli("validate", "--cache-dir", str(tmp_path / "cache"), url)
    assert result.returncode == 1
    assert result.stderr == f"error: {url}: over 100,000,000 bytes: too large to be an index\n"
    assert hostile.sent.get("model.safetensors.index.json", 0) < 64 * MIB  # not read (the socket's buffers at most)


def test_a_manifest_of_one_and_a_half_gigabytes_is_refused_unread(hostile: HostileServer, tmp_path: Path) -> None:
    write_reference(hostile.root / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    (hostile.root / "tensors.sha256").write_text("")
    hostile.lies.append(Lie("size", "tensors.sha256", 3 << 29))
    url = f"{hostile.url}/m.safetensors"
    result = cli("verify", "--cache-dir", str(tmp_path / "cache"), url)
    assert result.returncode == 1
    assert result.stderr == f"error: {hostile.url}/tensors.sha256: over 256 MiB, too large to be a manifest\n"
    assert hostile.sent.get("tensors.sha256", 0) < 64 * MIB


def test_a_local_index_past_the_limit_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    write_reference(model / "a.safetensors", {"w": ("U8", [16], bytes(16))})
    with open(model / "model.safetensors.index.json", "wb") as index:  # sparse: costs nothing
        index.truncate(100_000_001)
    result = cli("validate", str(model))
    assert result.returncode == 1
    assert (
        result.stderr
        == f"error: {model / 'model.safetensors.index.json'}: over 100,000,000 bytes: too large to be an index\n"
    )


def test_a_hung_mount_inside_the_model_directory_is_never_entered(mounts: Mounts, tmp_path: Path) -> None:
    """A subdirectory of the model's directory holds a mount whose daemon is stopped: anything that
    looked into it would hang for good. Validation and the mount go on without it, and say so."""
    model = tmp_path / "model"
    model.mkdir()
    expected = random_bytes(MIB, 9)
    write_reference(model / "m.safetensors", {"w": ("U8", [MIB], expected)})
    (model / "config.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    write_reference(other / "o.safetensors", {"x": ("U8", [16], bytes(16))})
    (model / "onnx").mkdir()
    inner = mounts.mount(other, mountpoint=model / "onnx")
    hung = mounts.daemon_pid(inner)
    os.kill(hung, signal.SIGSTOP)
    try:
        validated = cli("validate", str(model), timeout=60)
        assert validated.returncode == 0, validated.stderr
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        result = mounts.attempt(model, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
        assert result.returncode == 0, result.stderr
        assert f"warning: {model / 'onnx'}: skipped: another file system is mounted there" in result.stderr
        assert (mountpoint / "w").read_bytes() == expected
        assert sorted(os.listdir(mountpoint / ".tensorfs" / "model")) == ["config.json", "m.safetensors"]
    finally:
        os.kill(hung, signal.SIGCONT)


def hub_snapshot(root: Path) -> tuple[Path, Path]:
    """A Hugging Face cache's repository (models--org--name) with one snapshot: (the snapshot, its blobs/)."""
    repository = root / "models--org--name"
    (repository / "blobs").mkdir(parents=True)
    snapshot = repository / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    return snapshot, repository / "blobs"


def test_a_snapshots_link_into_a_hung_mount_is_skipped_never_waited_on(mounts: Mounts, tmp_path: Path) -> None:
    """A Hugging Face snapshot whose links lead to its repository's blobs/, where another user has
    mounted a FUSE file system whose daemon is stopped (a tensorfs mount serving the blobs): anything
    that looked at a blob there would wait for good (`tensorfs mount` did: killed at 90 s). The
    snapshot's config.json is such a link: validate, mount and export skip it, with a warning saying
    why, and serve the rest; a shard whose blob is there refuses the model in one line. Each command
    within the hang guard of its process (no timing asserted), nothing left behind."""
    snapshot, blobs = hub_snapshot(tmp_path / "hub")
    expected = random_bytes(MIB, 11)
    write_reference(snapshot / "model.safetensors", {"w": ("U8", [MIB], expected)})  # a file of its own
    served = tmp_path / "served"  # what the hung mount serves: the blobs, as tensor files
    served.mkdir()
    write_reference(served / "blobs.safetensors", {"cfg": ("U8", [2], b"{}"), "shard": ("U8", [16], bytes(16))})
    (snapshot / "config.json").symlink_to("../../blobs/cfg")
    hung = mounts.daemon_pid(mounts.mount(served, mountpoint=blobs))
    os.kill(hung, signal.SIGSTOP)
    skipped = (
        f"warning: {snapshot / 'config.json'}: skipped: leads into another file system ({blobs}), which did "
        "not answer within 2 s: a hung mount?"
    )
    try:
        validated = cli("validate", str(snapshot), timeout=60)
        assert validated.returncode == 0, validated.stderr
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        result = mounts.attempt(snapshot, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
        assert result.returncode == 0, result.stderr
        assert skipped in result.stderr.splitlines(), result.stderr
        assert (mountpoint / "w").read_bytes() == expected
        assert os.listdir(mountpoint / ".tensorfs" / "model") == ["model.safetensors"]
        assert cli("umount", str(mountpoint)).returncode == 0
        exported = cli("export", str(snapshot), str(tmp_path / "out"), timeout=60)
        assert exported.returncode == 0, exported.stderr
        assert skipped in exported.stderr.splitlines(), exported.stderr
        assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
        (snapshot / "model.safetensors").unlink()
        (snapshot / "model.safetensors").symlink_to("../../blobs/shard")
        refused = cli("validate", str(snapshot), timeout=60)
        assert (refused.returncode, refused.stdout) == (1, "")
        assert refused.stderr == (
            f"error: {snapshot / 'model.safetensors'}: cannot open: leads into another file system ({blobs}), "
            "which did not answer within 2 s: a hung mount?\n"
        )
    finally:
        os.kill(hung, signal.SIGCONT)


def test_a_snapshots_link_changed_into_a_hung_mount_once_open_is_never_followed(mounts: Mounts, tmp_path: Path) -> None:
    """Once a snapshot's model is open, its shard's link is made to lead into a mount whose daemon is
    stopped: hashing its tensor (the hash cache asks whether the file is still the one validated)
    and writing the model over a file (never over one of its own shards) ask the file held open,
    never its path again, and are done (each waited for by os.stat of the path before)."""
    snapshot, blobs = hub_snapshot(tmp_path / "hub")
    expected = random_bytes(MIB, 12)
    write_reference(blobs / "hash-w", {"w": ("U8", [MIB], expected)})
    (snapshot / "model.safetensors").symlink_to("../../blobs/hash-w")
    served = tmp_path / "served"
    served.mkdir()
    write_reference(served / "o.safetensors", {"x": ("U8", [16], bytes(16))})
    (tmp_path / "hung").mkdir()
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"replaced whole")
    outcome: list[object] = []
    with tensorfs.open_model(snapshot, cache=tmp_path / "cache") as model:
        hung = mounts.daemon_pid(mounts.mount(served, mountpoint=tmp_path / "hung"))
        os.kill(hung, signal.SIGSTOP)
        worker = threading.Thread(
            target=lambda: outcome.extend([run(model.gate.digest("w")), model.write_safetensors(out)]), daemon=True
        )
        try:
            (snapshot / "model.safetensors").unlink()
            (snapshot / "model.safetensors").symlink_to(tmp_path / "hung" / "x")
            worker.start()
            worker.join(60)  # a hang guard: it takes milliseconds
            assert not worker.is_alive(), "hashing or writing the model waited on the hung mount"
        finally:
            os.kill(hung, signal.SIGCONT)
            worker.join(60)
    assert outcome[0] == hashlib.sha256(expected).hexdigest()
    with tensorfs.open_model(out, cache=False) as written:
        assert written.raw("w") == expected


def _header_of_repeats(size: int) -> bytes:
    """Tensor names each given twice (a million such pairs fit in the largest header)."""
    return ("{" + ",".join(f'"k{i}":0,"k{i}":0' for i in range(size // 24)) + "}").encode()


def _metadata_of_repeats(size: int) -> bytes:
    pairs = ",".join(f'"k{i}":"","k{i}":""' for i in range(size // 24))
    return ('{"__metadata__":{' + pairs + '},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}').encode()


def _fields_of_repeats(size: int) -> bytes:
    fields = ",".join(f'"f{i}":0,"f{i}":0' for i in range(size // 24))
    return ('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],' + fields + "}}").encode()


def _wide_and_deep(size: int) -> bytes:
    """An ignored field holding an array of zeros 124 arrays deep: as deep as the reference parses."""
    nested = "[" * 124 + ",".join(["0"] * (size // 2)) + "]" * 124
    return ('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + nested + "}}").encode()


@pytest.mark.parametrize(
    ("build", "verdict"),
    [
        (_header_of_repeats, "tensor 'k0': appears more than once in the header"),
        (_metadata_of_repeats, "__metadata__ repeats the key 'k0'"),
        (_fields_of_repeats, "tensor 'w': repeats the field(s) f0, f1, f2"),
        (_wide_and_deep, None),
    ],
    ids=["repeated-names", "repeated-metadata-keys", "repeated-fields", "wide-and-deep"],
)
def test_hostile_headers_are_told_in_bounded_time(
    tmp_path: Path, build: Callable[[int], bytes], verdict: str | None
) -> None:
    """Headers of a few MB made to be slow to check (every key repeated: a check that looks each one
    up in a list of the repeats is quadratic, a minute for 2 MB and days for the largest header),
    validated by the CLI in a process of its own: told within the timeout (a loose bound, which only
    a hang or a quadratic check misses), every line an error line, no traceback."""
    header = build(3_000_000)
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"x")
    result = cli("validate", "--no-cache", str(path), timeout=60)
    if verdict is None:
        assert (result.returncode, result.stderr) == (0, ""), result.stderr[-2000:]
        return
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"error: {path}: {verdict}"), lines[0][:300]
    assert all(line.startswith(f"error: {path}: ") for line in lines), [
        line for line in lines if not line.startswith("error: ")
    ][:5]


def mount_with_a_piped_manifest(
    mounts: Mounts, model: Path, mountpoint: Path, producer: str
) -> subprocess.CompletedProcess[str]:
    """`tensorfs mount --manifest <(PRODUCER) MODEL MOUNTPOINT`, as a shell runs it (a pipe, /dev/fd/N)."""
    mounts.watch(mountpoint)
    command = f'exec "$0" -m tensorfs.cli mount --log-file "$1" --manifest <({producer}) "$2" "$3"'
    return subprocess.run(
        ["bash", "-c", command, sys.executable, str(mounts.log_file), str(model), str(mountpoint)],
        capture_output=True, text=True, timeout=patience(120), check=False,
    )  # fmt: skip


def test_a_manifest_through_a_pipe_is_used_and_one_past_the_limit_is_refused(mounts: Mounts, tmp_path: Path) -> None:
    """`--manifest <(...)` (a pipe): its hashes are in force (the tensor it says otherwise of is EIO);
    a pipe of 256 MiB and one byte is refused in one line, exit 1, nothing mounted, no daemon left."""
    model = tmp_path / "model"
    model.mkdir()
    tensors = {"good": random_bytes(4096, 1), "bad": random_bytes(4096, 2)}
    write_reference(model / "m.safetensors", {name: ("U8", [4096], data) for name, data in tensors.items()})
    listed = cli("manifest", "--no-cache", str(model)).stdout
    manifest = tmp_path / "hashes.sha256"
    manifest.write_text(listed.replace(hashlib.sha256(tensors["bad"]).hexdigest(), "0" * 64))
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mount_with_a_piped_manifest(mounts, model, mountpoint, f"cat {shlex.quote(str(manifest))}")
    assert result.returncode == 0, result.stderr + mounts.log()
    assert (mountpoint / "good").read_bytes() == tensors["good"]
    assert errno_of_reading(mountpoint / "bad") == errno.EIO  # the piped manifest's word
    assert cli("umount", str(mountpoint)).returncode == 0
    too_large = mount_with_a_piped_manifest(mounts, model, mountpoint, f"head -c {(256 << 20) + 1} /dev/zero")
    assert too_large.returncode == 1
    assert re.fullmatch(r"error: /dev/fd/\d+: over 256 MiB, too large to be a manifest\n", too_large.stderr), (
        too_large.stderr
    )
    assert not os.path.ismount(mountpoint) and os.listdir(mountpoint) == []
    assert daemon_pid(mountpoint) is None  # no record: no daemon


# -- listings, scans and bodies: each bound met, not just announced ---------------------------


class SteppingClock:
    """time as a module holds it, but monotonic() goes `step` seconds on at each call: a scan or a
    listing that looks at the clock once an item "takes" `step` seconds an item, at the machine's
    own speed."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.now = time.monotonic()

    def monotonic(self) -> float:
        self.now += self.step
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def pages_listed(server: HostileServer) -> int:
    return sum("list-type=2" in path for path in server.paths)


class PageClock:
    """A clock (for a module's `time`) that moves a second with each page of a listing the server
    has sent: a store that takes a second a page, whenever and however often the clock is read."""

    def __init__(self, server: HostileServer) -> None:
        self.server = server
        self.start = time.monotonic()

    def monotonic(self) -> float:
        return self.start + pages_listed(self.server)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_listing_goes_through_at_most_100000_objects(hostile: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix whose listing never ends (a store that says there are more, page after page): the
    model is refused in one line once 100,000 objects are past, its 101st page of 1000 the last
    asked for."""
    (hostile.root / "bucket").mkdir()
    hostile.lies.append(Lie("listing", "bucket/many", "huge"))
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    result = cli("validate", "--endpoint-url", hostile.url, "--remote-timeout", "600", "s3://bucket/many/")
    expected = (
        "error: s3://bucket/many/: over 100000 objects under this prefix; none of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json, "
        "diffusion_pytorch_model.safetensors.index.json, diffusion_pytorch_model.safetensors, "
        "diffusion_pytorch_model.bin, diffusion_pytorch_model.bin.index.json is there: name the model's file or index\n"
    )
    assert (result.returncode, result.stderr) == (1, expected)
    assert pages_listed(hostile) == 101


@pytest.mark.parametrize("pages", ["huge", "trickle"])
def test_a_listing_ends_at_the_remote_timeout(
    hostile: HostileServer, monkeypatch: pytest.MonkeyPatch, pages: str
) -> None:
    """A listing that never ends ends within --remote-timeout, whatever the objects it has gone
    through, each page taking a second of the clock it reads: 5 s here, one deadline for all its
    pages, whether they hold a thousand objects each or one."""
    from tensorfs.sources import client, store

    (hostile.root / "bucket").mkdir()
    hostile.lies.append(Lie("listing", "bucket/slow", pages))
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    spec, prefix = store.store_spec("s3://bucket/slow/", RemoteOptions(endpoint_url=hostile.url, timeout=5))
    monkeypatch.setattr(client, "time", PageClock(hostile))
    with pytest.raises(RemoteError, match=r"^s3://bucket/slow/: listing took over 5 s$"):
        client.list_objects(spec, prefix)
    assert 5 <= pages_listed(hostile) <= 8  # (the client may ask for a page or two ahead)


class HeadClock(PageClock):
    """A clock that moves a second with each HEAD the server has answered."""

    def monotonic(self) -> float:
        return self.start + sum(method == "HEAD" for method, *_ in self.server.requests)


def test_the_heads_that_tell_folder_markers_end_at_the_remote_timeout(
    hostile: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's directory in S3 holding 30 empty objects, each a HEAD to tell from a folder marker,
    each HEAD taking a second of the clock the listing reads: the listing ends at 5 s in all, within
    the listing's one deadline, not after 30 HEADs."""
    from tensorfs.sources import client, finding

    model = hostile.root / "bucket" / "m"
    model.mkdir(parents=True)
    write_reference(model / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    for k in range(30):
        (model / f"empty{k:02d}.txt").write_bytes(b"")
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(client, "time", HeadClock(hostile))
    with pytest.raises(RemoteError, match=r"^s3://bucket/m/: listing took over 5 s$"):
        finding.listing_beside("s3://bucket/m", RemoteOptions(endpoint_url=hostile.url, timeout=5))
    assert 5 <= sum(method == "HEAD" for method, *_ in hostile.requests) <= 7


class HubClock(PageClock):
    """A clock that moves a second with each answer of the Hub's listing API the server has sent."""

    def monotonic(self) -> float:
        return self.start + sum(path.startswith("/api/models/") for path in self.server.paths)


def test_the_hubs_discovery_ends_at_the_remote_timeout_in_all(
    hostile: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub whose model directory holds 50 folders, each listed within --remote-timeout but each
    taking a second of the clock the discovery reads: the discovery ends at 5 s in all, not 50 s,
    with the files listed by then, and says what it left out."""
    from tensorfs.sources import client, finding

    repo = hostile.root / "org" / "name"
    for k in range(50):
        (repo / f"f{k:02d}").mkdir(parents=True)
        (repo / f"f{k:02d}" / "config.json").write_text("{}")
    write_reference(repo / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    monkeypatch.setenv("HF_ENDPOINT", hostile.url)
    monkeypatch.setattr(client, "time", HubClock(hostile))
    listing = f"{hostile.url}/api/models/org/name/tree/main"
    found = finding.hub_listing("hf://org/name", RemoteOptions(timeout=5), depth=2)
    assert found is not None
    files, cut = found
    assert sorted(path for path, *_ in files) == [*(f"f{k:02d}/config.json" for k in range(5)), "model.safetensors"]
    assert cut == (
        f"{listing}: 45 folders not listed (past {finding.MAX_FOLDERS_LISTED} folders, 100,000 files or the "
        "listing's time): their files are left out"
    )
    assert sum(path.startswith("/api/models/") for path in hostile.paths) == 6  # the top listing, and 5 folders'


def test_the_companion_scan_stops_after_30_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model directory of 40 companion files, each taking a second of the scan's clock: those of
    the first 30 s are found, and the rest are skipped with one warning that says so."""
    from tensorfs.views import local_files

    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    for i in range(40):
        (directory / f"c{i:02d}.json").write_text("{}")
    monkeypatch.setattr(local_files, "time", SteppingClock(1.0))
    scanned = local_files.find_companions(directory, ViewRule(folder=False))
    found = scanned.companions
    assert 25 <= len(found) < 40 and [c.path for c in found] == [f"c{i:02d}.json" for i in range(len(found))]
    assert scanned.warnings == [
        f"{directory / f'c{len(found):02d}.json'} and the files after it: skipped: the scan took over 30 s"
    ]


def test_a_naming_file_longer_than_announced_is_refused_as_it_comes(hostile: HostileServer, tmp_path: Path) -> None:
    """config.json names the modules a loader imports (auto_map), which tensorfs then looks for
    beside a model served over plain HTTP: it is read whole, at most 1 MiB. A server whose HEAD
    says a few bytes and whose GET then sends 2 MiB: refused, not followed (the module it names is
    never asked for), with a warning that says why."""
    from tensorfs.views.remote_files import find_remote_companions

    write_reference(hostile.root / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    (hostile.root / "config.json").write_text('{"auto_map": {"AutoModel": "modeling_x.Model"}}')
    for module in ("modeling_x.py", "modeling_y.py"):
        (hostile.root / module).write_text("MODEL = 1\n")
    options = RemoteOptions(cache_dir=tmp_path / "cache")
    scanned = find_remote_companions(f"{hostile.url}/m.safetensors", options, ViewRule(folder=False))
    found, warnings = scanned.companions, scanned.warnings
    assert {"config.json", "modeling_x.py"} <= {c.path for c in found} and warnings == []  # told honestly: followed
    grown = b'{"auto_map": {"AutoModel": "modeling_y.Model"}, "pad": "' + b"x" * (2 * MIB) + b'"}'
    hostile.lies.append(Lie("body", "config.json", ("GET", grown)))
    scanned = find_remote_companions(f"{hostile.url}/m.safetensors", options, ViewRule(folder=False))
    found, warnings = scanned.companions, scanned.warnings
    assert "modeling_y.py" not in {c.path for c in found}
    assert not any(name == "modeling_y.py" for _, name, _, _ in hostile.requests)
    config = f"{hostile.url}/config.json"
    assert warnings == [f"{config}: not followed: {config}: {len(grown)} bytes, over 1.0 MiB"], warnings
