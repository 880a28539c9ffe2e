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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Mounts
from helpers import MIB, cli, errno_of_reading, patience, random_bytes, write_index, write_reference
from servers import HostileServer
from tensorfs.mount.mounttable import daemon_pid
from tensorfs.sources.store import RemoteError, RemoteOptions


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[HostileServer]:
    (tmp_path / "served").mkdir()
    server = HostileServer(tmp_path / "served")
    try:
        yield server
    finally:
        server.close()


def test_an_index_of_a_gigabyte_is_refused_unread(hostile: HostileServer, tmp_path: Path) -> None:
    write_reference(hostile.root / "a.safetensors", {"w": ("U8", [16], bytes(16))})
    write_index(hostile.root, {"w": "a.safetensors"})
    hostile.announced["model.safetensors.index.json"] = 1 << 30
    url = f"{hostile.url}/model.safetensors.index.json"
    result = cli("validate", "--cache-dir", str(tmp_path / "cache"), url)
    assert result.returncode == 1
    assert result.stderr == f"error: {url}: over 100,000,000 bytes: too large to be an index\n"
    assert hostile.sent.get("model.safetensors.index.json", 0) < 64 * MIB  # not read (the socket's buffers at most)


def test_a_manifest_of_one_and_a_half_gigabytes_is_refused_unread(hostile: HostileServer, tmp_path: Path) -> None:
    write_reference(hostile.root / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    (hostile.root / "tensors.sha256").write_text("")
    hostile.announced["tensors.sha256"] = 3 << 29
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
        assert sorted(os.listdir(mountpoint / ".tensorfs" / "model")) == ["config.json", "model.safetensors"]
    finally:
        os.kill(hung, signal.SIGCONT)


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


def test_a_listing_goes_through_at_most_100000_objects(hostile: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix whose listing never ends (a store that says there are more, page after page): the
    model is refused in one line once 100,000 objects are past, its 101st page of 1000 the last
    asked for."""
    (hostile.root / "bucket").mkdir()
    hostile.endless_listing["bucket"] = 1000
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    result = cli("validate", "--endpoint-url", hostile.url, "--remote-timeout", "600", "s3://bucket/many/")
    expected = "error: s3://bucket/many/: over 100000 objects under this prefix: name the model's index\n"
    assert (result.returncode, result.stderr) == (1, expected)
    assert hostile.pages_listed == 101


def test_a_listing_ends_at_the_remote_timeout(hostile: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing that never ends ends within --remote-timeout, whatever the objects it has gone
    through: 5 s here, each thousand objects (ten pages) taking a second of the clock it reads."""
    from tensorfs.sources import store

    (hostile.root / "bucket").mkdir()
    hostile.endless_listing["bucket"] = 100
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    spec, prefix = store.store_spec("s3://bucket/slow/", RemoteOptions(endpoint_url=hostile.url, timeout=5))
    monkeypatch.setattr(store, "time", SteppingClock(1.0))
    with pytest.raises(RemoteError, match=r"^s3://bucket/slow/: listing took over 5 s$"):
        store.list_objects(spec, prefix)
    assert 10 <= hostile.pages_listed <= 60  # (the client lists a thousand objects at a time)


def test_the_companion_scan_stops_after_30_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model directory of 40 companion files, each taking a second of the scan's clock: those of
    the first 30 s are found, and the rest are skipped with one warning that says so."""
    from tensorfs.views import companions

    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    for i in range(40):
        (directory / f"c{i:02d}.json").write_text("{}")
    warnings: list[str] = []
    monkeypatch.setattr(companions, "time", SteppingClock(1.0))
    found = companions.find_companions(directory, warnings)
    assert 25 <= len(found) < 40 and [c.path for c in found] == [f"c{i:02d}.json" for i in range(len(found))]
    assert warnings == [
        f"{directory / f'c{len(found):02d}.json'} and the files after it: skipped: the scan took over 30 s"
    ]


def test_a_naming_file_longer_than_announced_is_refused_as_it_comes(hostile: HostileServer, tmp_path: Path) -> None:
    """config.json names the modules a loader imports (auto_map), which tensorfs then looks for
    beside a model served over plain HTTP: it is read whole, at most 1 MiB. A server whose HEAD
    says a few bytes and whose GET then sends 2 MiB: refused, not followed (the module it names is
    never asked for), with a warning that says why."""
    from tensorfs.views.companions import find_remote_companions

    write_reference(hostile.root / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    (hostile.root / "config.json").write_text('{"auto_map": {"AutoModel": "modeling_x.Model"}}')
    for module in ("modeling_x.py", "modeling_y.py"):
        (hostile.root / module).write_text("MODEL = 1\n")
    options = RemoteOptions(cache_dir=tmp_path / "cache")
    warnings: list[str] = []
    found = find_remote_companions(f"{hostile.url}/m.safetensors", options, warnings)
    assert {"config.json", "modeling_x.py"} <= {c.path for c in found} and warnings == []  # told honestly: followed
    grown = b'{"auto_map": {"AutoModel": "modeling_y.Model"}, "pad": "' + b"x" * (2 * MIB) + b'"}'
    hostile.grown["config.json"] = grown
    found = find_remote_companions(f"{hostile.url}/m.safetensors", options, warnings)
    assert "modeling_y.py" not in {c.path for c in found}
    assert not any(name == "modeling_y.py" for _, name, _, _ in hostile.requests)
    config = f"{hostile.url}/config.json"
    assert warnings == [f"{config}: not followed: {config}: {len(grown)} bytes, over 1.0 MiB"], warnings
