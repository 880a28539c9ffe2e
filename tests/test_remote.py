"""Models in object stores: S3 (SeaweedFS, a real S3-compatible store), HTTP and the Hub's layout (nginx).

Every server runs on 127.0.0.1, started by the session's fixtures and always stopped.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest

import tensorfs
from conftest import Mounts, drop_caches, wait_until
from helpers import (
    MIB,
    cli,
    entry,
    patience,
    random_bytes,
    raw_shard,
    reads_in_handlers,
    reference_table,
    remote_stats,
    sharded_every_dtype,
    sharded_model,
    upload,
    write_reference,
)
from servers import TOKEN, HostileServer, Nginx, RequestGate, SeaweedFS, StallingProxy
from tensorfs.mount.mounttable import mounts as mount_table
from tensorfs.sources.store import RemoteOptions
from tensorfs.testing.link import SlowLink
from tensorfs.utils.units import human_size


@pytest.fixture
def local_model(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    directory = tmp_path / "model"
    return directory, sharded_every_dtype(directory)


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The credentials, in this process's environment and for the commands run in tests."""
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    return {**os.environ}


def options(tmp_path: Path, **kwargs: object) -> RemoteOptions:
    return RemoteOptions(cache_dir=tmp_path / "cache", **kwargs)  # type: ignore[arg-type]


def read_all(source: str, remote: RemoteOptions) -> dict[str, bytes]:
    with tensorfs.open_model(source, remote=remote) as model:
        return {name: bytes(model.raw(name)) for name in model}


# -- S3 ---------------------------------------------------------------------------------------


def test_an_s3_model_reads_byte_exact(
    seaweedfs: SeaweedFS,
    bucket: str,
    s3_env: dict[str, str],
    local_model: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
) -> None:
    directory, expected = local_model
    upload(seaweedfs.store(bucket), "models/one", directory)
    remote = options(tmp_path, endpoint_url=seaweedfs.endpoint)
    assert read_all(f"s3://{bucket}/models/one", remote) == expected  # with its index
    with tensorfs.open_model(f"s3://{bucket}/models/one", remote=remote) as model:
        info = model.info("layers/2/w")
        assert info.shard == f"s3://{bucket}/models/one/model-00002-of-00002.safetensors"
        assert info.as_json()["shard"] == "model-00002-of-00002.safetensors"
        assert model.metadata["model-00001-of-00002.safetensors"] == {"format": "pt"}
        assert model.array("scalar").shape == ()
    shard = f"s3://{bucket}/models/one/model-00002-of-00002.safetensors"
    assert read_all(shard, remote) == {k: v for k, v in expected.items() if k.startswith("layers/")}
    (directory / "model.safetensors.index.json").unlink()
    upload(seaweedfs.store(bucket), "noindex", directory)
    assert read_all(f"s3://{bucket}/noindex/", remote) == expected  # every *.safetensors under the prefix


def test_validate_and_ls_of_an_s3_model(
    seaweedfs: SeaweedFS,
    bucket: str,
    s3_env: dict[str, str],
    local_model: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
) -> None:
    directory, expected = local_model
    upload(seaweedfs.store(bucket), "m", directory)
    common = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache")]
    result = cli("validate", *common, f"s3://{bucket}/m", env=s3_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"s3://{bucket}/m: valid: 2 shards, {len(expected)} tensors")
    result = cli("ls", "--json", *common, f"s3://{bucket}/m", env=s3_env)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["name"]: r["nbytes"] for r in records} == {name: len(data) for name, data in expected.items()}
    for record in records:  # where the reference reader finds each tensor in the local copy of its shard
        shard = directory / record["shard"]
        dtype, shape, (begin, end), _ = reference_table(shard)[0][record["name"]]
        data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        where = (record["dtype"], record["shape"], record["data_offsets"], record["offset"])
        assert where == (dtype, shape, [begin, end], data_start + begin), record


def test_s3_errors_are_one_line(seaweedfs: SeaweedFS, bucket: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    store = seaweedfs.store(bucket)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.safetensors").write_bytes(raw_shard({"x": entry("F32", [2], 0, 4)}, bytes(4)))
    upload(store, "bad", tmp_path / "bad")
    common = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache")]
    wrong = {**s3_env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    closed = seaweedfs.endpoint.rsplit(":", 1)[0] + ":9"  # nothing listens on port 9
    cases = [
        (["validate", *common, f"s3://{bucket}/bad"], s3_env,
         f"error: s3://{bucket}/bad/a.safetensors: tensor 'x': data_offsets [0, 4] hold 4 bytes but F32 [2] needs 8"),
        (["validate", *common, f"s3://{bucket}/bad/missing.safetensors"], s3_env,
         f"error: s3://{bucket}/bad/missing.safetensors: not found (404)"),
        (["validate", *common, f"s3://{bucket}/nothing-here"], s3_env,
         f"error: s3://{bucket}/nothing-here/: no .safetensors, .gguf, .bin, .pt or .pth files in this directory (it is empty)"),
        (["validate", *common, f"s3://{bucket}/bad"], wrong,
         f"error: s3://{bucket}/bad/: access denied (403): check the credentials"),
        (["validate", "--remote-timeout", "2", "--endpoint-url", closed, f"s3://{bucket}/bad"], s3_env,
         f"error: s3://{bucket}/bad/: unreachable"),
        (["validate", *common, "https://127.0.0.1:9/models/"], s3_env,
         "error: https://127.0.0.1:9/models/: name the model's index"),
    ]  # fmt: skip
    for args, env, start in cases:
        result = cli(*args, env=env)
        assert result.returncode == 1, (args, result.stderr)
        assert result.stderr.startswith(start) and result.stderr.count("\n") == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr


# -- HTTP and the Hub ---------------------------------------------------------------------------


@pytest.fixture
def served(nginx: Nginx, local_model: tuple[Path, dict[str, bytes]], request: pytest.FixtureRequest) -> Iterator[str]:
    """The model under the test's own directory of the session's nginx; yields that directory's URL."""
    directory, _ = local_model
    name = request.node.name.replace("[", "-").replace("]", "")
    target = nginx.root / name
    shutil.copytree(directory, target)
    try:
        yield f"{nginx.url}/{name}"
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_an_http_model_by_its_index_or_its_file(
    served: str, local_model: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    _, expected = local_model
    remote = options(tmp_path)
    assert read_all(f"{served}/model.safetensors.index.json", remote) == expected
    assert set(read_all(f"{served}/model-00001-of-00002.safetensors", remote)) == {
        name for name in expected if not name.startswith("layers/")
    }


def test_a_hub_model_and_its_token(
    nginx: Nginx, local_model: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, expected = local_model
    public = nginx.root / "org" / "public" / "resolve" / "main"
    private = nginx.root / "private" / "secret" / "resolve" / "v1"
    for target in (public, private):
        shutil.copytree(directory, target)
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    remote = options(tmp_path)
    assert read_all("hf://org/public", remote) == expected
    with pytest.raises(tensorfs.InvalidModelError, match=r"authentication required \(401\)"):
        read_all("hf://private/secret@v1", remote)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(TOKEN + "\n")  # the token file huggingface_hub writes
    assert read_all("hf://private/secret@v1", remote) == expected
    (tmp_path / "hf" / "token").unlink()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert read_all("hf://private/secret@v1", remote) == expected


def test_a_hub_model_behind_redirects(
    nginx: Nginx, local_model: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, expected = local_model
    shutil.copytree(directory, nginx.root / "lfs" / "moved" / "model" / "resolve" / "main")
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    before = len(nginx.requests())
    assert read_all("hf://moved/model", options(tmp_path)) == expected  # every GET answered 302 first
    paths = [path for _, path, _ in nginx.requests()[before:]]
    shard = "/moved/model/resolve/main/model-00001-of-00002.safetensors"
    assert shard in paths and f"/lfs{shard}" in paths


def test_http_errors_are_one_line(nginx: Nginx, tmp_path: Path) -> None:
    (nginx.root / "fine").mkdir()
    write_reference(nginx.root / "fine" / "m.safetensors", {"w": ("U8", [4], b"abcd")})
    cases = [
        (["--remote-timeout", "2", f"{nginx.url}/broken/m.safetensors"],
         f"error: {nginx.url}/broken/m.safetensors: the server answered 500 Internal Server Error\n"),
        (["--remote-timeout", "2", "http://127.0.0.1:1/m.safetensors"],
         "error: http://127.0.0.1:1/m.safetensors: unreachable (Connection refused)\n"),
        (["--cache-dir", "/proc/no-cache-here", f"{nginx.url}/fine/m.safetensors"],
         "error: cannot use the cache /proc/no-cache-here: No such file or directory\n"),
    ]  # fmt: skip
    for args, stderr in cases:
        result = cli("validate", *args)
        assert (result.returncode, result.stderr) == (1, stderr)


def test_urls_as_users_write_them(nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = nginx.root / "written"
    directory.mkdir()
    tensors = {"w": ("U8", [4], b"abcd")}
    write_reference(directory / "with space.safetensors", tensors)
    assert read_all(f"{nginx.url}/written/with%20space.safetensors", options(tmp_path)) == {"w": b"abcd"}
    queried = cli("validate", f"{nginx.url}/written/with%20space.safetensors?X-Amz-Signature=0")
    assert queried.returncode == 1 and "URLs with a query or fragment (signed URLs) are not supported" in queried.stderr
    ftp = cli("validate", "ftp://host/m.safetensors")
    assert ftp.returncode == 2 and "ftp:// is not a source tensorfs reads" in ftp.stderr
    with pytest.raises(tensorfs.InvalidModelError, match="ftp:// is not a source tensorfs reads"):
        tensorfs.open_model("ftp://host/m.safetensors")
    # hf://ORG/NAME is hf://ORG/NAME@main, for --offline too
    hub = nginx.root / "written-org" / "m" / "resolve" / "main"
    hub.mkdir(parents=True)
    write_reference(hub / "model.safetensors", tensors)
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    assert read_all("hf://written-org/m", options(tmp_path)) == {"w": b"abcd"}
    assert read_all("hf://written-org/m@main", options(tmp_path, offline=True)) == {"w": b"abcd"}


def test_validation_takes_at_most_two_gets_a_shard(nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "two-gets"
    directory.mkdir()
    names = {f"a.very.long.name.for.a.tensor.{i:05d}": ("U8", [1], b"x") for i in range(2000)}  # a 150 KiB header
    write_reference(directory / "big-header.safetensors", names)
    write_reference(directory / "small-header.safetensors", {"w": ("U8", [8], b"12345678")})
    header = int.from_bytes((directory / "big-header.safetensors").read_bytes()[:8], "little")
    assert header > 64 << 10
    before = len(nginx.requests())
    for name in ("big-header", "small-header"):
        with tensorfs.open_model(f"{nginx.url}/two-gets/{name}.safetensors", remote=options(tmp_path)):
            pass
    requests = [(method, path) for method, path, _ in nginx.requests()[before:]]
    assert requests.count(("GET", "/two-gets/big-header.safetensors")) == 2
    assert requests.count(("GET", "/two-gets/small-header.safetensors")) == 1
    assert len(requests) == 3


def _chunk_bytes(model: tensorfs.Model, name: str, chunk: int = 8 * MIB) -> int:
    """The bytes of the chunks that hold tensor `name`: what reading it alone may fetch."""
    shard, offset, nbytes = model.locate(name)
    end = min(model.shard_data(shard).status().st_size, ((offset + nbytes - 1) // chunk + 1) * chunk)
    return end - offset // chunk * chunk


def test_one_tensor_read_fetches_its_chunks_only(nginx: Nginx, tmp_path: Path) -> None:
    """A tensor read alone costs the chunks it lies in, no other: nothing read ahead into the tensors
    after it (64 of them, 256 MiB), in-process and through a mount; the header is one GET."""
    directory = nginx.root / "one-tensor"
    directory.mkdir()
    tensors = {f"t{i}": ("U8", [4 * MIB], random_bytes(4 * MIB, i)) for i in range(64)}  # 256 MiB
    write_reference(directory / "m.safetensors", tensors)
    url = f"{nginx.url}/one-tensor/m.safetensors"
    before = len(nginx.requests())
    with tensorfs.open_model(url, remote=options(tmp_path)) as model:
        header = sum(sent for _, path, sent in nginx.requests()[before:] if path.endswith("m.safetensors"))
        since = len(nginx.requests())
        assert bytes(model.raw("t37")) == tensors["t37"][2]
        own = _chunk_bytes(model, "t37")
    fetched = sum(sent for _, path, sent in nginx.requests()[since:] if path.endswith("m.safetensors"))
    assert header <= 64 * 1024 and fetched == own  # its chunks (one or two of 8 MiB), nothing more


def test_one_tensor_file_read_through_a_mount_fetches_its_chunks_only(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    directory = nginx.root / "one-file"
    directory.mkdir()
    tensors = {f"t{i}": ("U8", [4 * MIB], random_bytes(4 * MIB, 70 + i)) for i in range(16)}
    write_reference(directory / "m.safetensors", tensors)
    url = f"{nginx.url}/one-file/m.safetensors"
    mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
    with tensorfs.open_model(directory / "m.safetensors") as model:
        own = _chunk_bytes(model, "t5")
    since = len(nginx.requests())
    assert (mountpoint / "t5").read_bytes() == tensors["t5"][2]

    def fetched() -> int:
        return sum(sent for _, path, sent in nginx.requests()[since:] if path.endswith("m.safetensors"))

    # A read is answered as its bytes come, before the rest of its chunks: those are waited for here.
    wait_until(lambda: remote_stats(mountpoint)["fetched_bytes"] >= own and fetched() >= own, what="its chunks")
    assert fetched() == own  # its chunks alone: nothing read ahead into t6 and after


def test_a_model_read_front_to_back_is_read_ahead_across_its_tensors(nginx: Nginx, tmp_path: Path) -> None:
    """A reader that goes on from one tensor into the next is read ahead of, past each tensor's end:
    loading a model of 2 MiB tensors in order, every GET past the first chunk held at a gate, three
    come to be in flight at once (reading ahead only within each tensor, one at a time: the reader
    waited on the one for good)."""
    directory = nginx.root / "front-to-back"
    directory.mkdir()
    tensors = {f"t{i:02d}": ("U8", [2 * MIB], random_bytes(2 * MIB, 90 + i)) for i in range(24)}  # 48 MiB
    write_reference(directory / "m.safetensors", tensors)
    gate = RequestGate(nginx.port)
    try:
        with tensorfs.open_model(gate.url("front-to-back/m.safetensors"), remote=options(tmp_path)) as model:
            gate.hold_from(8 * MIB)  # the first chunk comes; those after it wait at the gate
            outcome: list[dict[str, bytes] | BaseException] = []

            def load() -> None:
                try:  # one at a time, in the order of the bytes: no prefetch
                    outcome.append({name: tensor.tobytes() for name, tensor in model.tensors(ahead=0)})
                except BaseException as exc:
                    outcome.append(exc)

            reader = threading.Thread(target=load)
            reader.start()
            try:
                assert gate.wait_held(3, patience(30)), (gate.held, gate.ranges)
            finally:
                gate.release()
                reader.join()
        assert outcome == [{name: data for name, (_, _, data) in tensors.items()}] and gate.failure is None
    finally:
        gate.close()


def test_the_read_ahead_keeps_requests_in_flight(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A reader going through a tensor from its start must not wait a round trip for each chunk (a
    distant link idles meanwhile): the chunks ahead of it are asked for together. Every GET past the
    first chunk is held at a gate until three are in flight at once; with both windows ahead taken out
    (the mount's, mount/operations.py, and the remote source's, sources/remote.py) one request was in flight at a
    time, and the reader waited on it for good."""
    directory = nginx.root / "far"
    directory.mkdir()
    data = random_bytes(64 * MIB, 11)
    write_reference(directory / "m.safetensors", {"t": ("U8", [64 * MIB], data)})
    gate = RequestGate(nginx.port)
    try:
        mountpoint = mounts.mount(gate.url("far/m.safetensors"), "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        gate.hold_from(8 * MIB)  # the first chunk comes; those after it wait at the gate
        outcome: list[bytes | OSError] = []
        reader = threading.Thread(target=lambda: outcome.append(read_or_error(mountpoint / "t")))
        reader.start()
        try:
            assert gate.wait_held(3, patience(30)), (gate.held, gate.ranges)
        finally:
            gate.release()
            reader.join()
        assert outcome == [data] and gate.failure is None
    finally:
        gate.close()


def test_a_reader_catching_up_with_its_window_keeps_going_on(nginx: Nginx, tmp_path: Path) -> None:
    """Ranges asked for behind where the run asked for so far ends continue it: a mount asks for a
    window ahead of its reader first (up to the tensor's end), then the reader's own reads come,
    within that window. Those kept the run going, with the window ahead of it growing past the
    tensor's end into the next; taken for a new run, they had it start again from one chunk, within
    the tensor only (a link idled at every tensor's end, docs/performance.md). Driven here as a mount
    drives a remote shard: t0 read whole, t1 begun, its window asked for, then reads within it."""
    directory = nginx.root / "catching-up"
    directory.mkdir()
    sizes = {"t0": 8 * MIB, "t1": 40 * MIB, "t2": 80 * MIB}
    write_reference(directory / "m.safetensors", {n: ("U8", [size], bytes(size)) for n, size in sizes.items()})
    gate = RequestGate(nginx.port)
    try:
        with tensorfs.open_model(gate.url("catching-up/m.safetensors"), remote=options(tmp_path)) as model:
            shard = model.locate("t1")[0]
            data = model.shard_data(shard)
            places = {name: model.locate(name)[1:] for name in sizes}
            within = {name: (offset, offset + nbytes) for name, (offset, nbytes) in places.items()}
            t1, t2 = within["t1"], within["t2"]
            data.ensure(*within["t0"], within=within["t0"])
            data.ensure(t1[0], t1[0] + MIB, within=t1)  # on from where t0 ended: a reader going on
            data.ensure(t1[0] + MIB, t1[1], within=t1)  # the mount's window ahead of it
            for mib in range(2, 12, 2):  # the reader's own reads, within that window
                data.ensure(t1[0] + mib * MIB, t1[0] + (mib + 1) * MIB, within=t1)
            first_of_t2 = -(-t2[0] // (8 * MIB)) * (8 * MIB)  # the first chunk wholly t2's

            def asked_of_t2() -> int:
                return sum(1 for _, at in gate.ranges if at is not None and at >= first_of_t2)

            # The window grows to 8 chunks, 7 of them past t1's last: taken for a new run, the reader's
            # reads had it fetch no more of t2 than the 2 chunks asked for with t1's window.
            wait_until(lambda: asked_of_t2() >= 6, what="the window past t1's end into t2")
    finally:
        gate.close()


def test_a_reader_going_on_into_the_next_shard_finds_its_chunks_coming(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """A reader going through a model front to back does not meet each shard's first bytes cold,
    one chunk alone in flight (a distant link idled at every shard's start, docs/performance.md):
    its window runs on past the end of a shard into the next one's first chunks. Reading shard 1's
    tensors in order through a mount, shard 2's chunks are asked for before anything of shard 2
    is read; a reader of shard 1's last tensor alone asked nothing of shard 2."""
    directory = nginx.root / "going-on"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    data = sharded_model(directory, {first: {f"a{i}": 6 * MIB for i in range(6)}, second: {"b0": 24 * MIB}})
    gate = RequestGate(nginx.port)
    try:
        url = gate.url("going-on/model.safetensors.index.json")
        mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        with tensorfs.open_model(directory) as model:
            own = _chunk_bytes(model, "a5")
        since = len(gate.ranges)

        def asked_of_second() -> int:
            return sum(1 for path, at in gate.ranges[since:] if path.endswith(second) and at is not None)

        assert (mountpoint / "a5").read_bytes() == data["a5"]
        wait_until(lambda: remote_stats(mountpoint)["fetched_bytes"] >= own, what="a5's chunks")
        assert asked_of_second() == 0  # one tensor's reader: no further than its chunks
        for name in ["a0", "a1", "a2", "a3", "a4"]:
            assert (mountpoint / name).read_bytes() == data[name]
        wait_until(lambda: asked_of_second() >= 3, what="shard 2's chunks, asked for ahead of its reader")
        assert (mountpoint / "b0").read_bytes() == data["b0"]
    finally:
        gate.close()


def test_a_reader_going_on_into_the_next_shard_keeps_its_window(nginx: Nginx, tmp_path: Path) -> None:
    """A reader going on from the end of one shard into the next goes on with the window it had
    there: its first read in the next shard continues the run its window began ahead of it, not a
    run of its own that starts again from no chunk ahead, within its tensor only (a distant link
    idled at every shard's start, docs/performance.md). In-process, two GETs at once: the window's
    lead-in into shard 2 is at most its first two chunks; the reader's first read there (its first
    MiB) asks for the third."""
    directory = nginx.root / "window-on"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    sharded_model(directory, {first: {"a0": 6 * MIB, "a1": 6 * MIB}, second: {"b0": 40 * MIB}})
    gate = RequestGate(nginx.port)
    try:
        url = gate.url("window-on/model.safetensors.index.json")
        with tensorfs.open_model(url, remote=options(tmp_path, concurrency=2)) as model:
            for name in ["a0", "a1", "b0"]:  # as a mount asks: each tensor's first MiB, then the rest
                shard, start, nbytes = model.locate(name)
                within = (start, start + nbytes)
                model.shard_data(shard).ensure(start, start + MIB, within=within)
                if name != "b0":
                    model.shard_data(shard).ensure(start + MIB, start + nbytes, within=within)

            def third_chunk_asked() -> bool:
                return any(path.endswith(second) and (at or 0) >= 16 * MIB for path, at in gate.ranges)

            wait_until(third_chunk_asked, what="shard 2's third chunk, ahead of the reader's first read there")
    finally:
        gate.close()


def test_a_reader_going_on_into_the_next_shard_leaves_its_reader_alone(nginx: Nginx, tmp_path: Path) -> None:
    """A reader going on past its shard's end has the next shard's first chunks fetched, but does
    not take over the run of a reader already in that shard: that reader's window goes on growing
    ahead of it. Taken over, its next read was a new run's, with no chunk ahead of it (four loaders
    streaming a shard each reset each other's window at every shard's end). In-process, two GETs
    at once: B reads on from 16 MiB into shard 2 (its window at one chunk), A reads shard 1 to its
    end, then B's next read asks for the chunk two ahead of it (its window at two)."""
    directory = nginx.root / "alone"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    sharded_model(directory, {first: {"a0": 6 * MIB, "a1": 6 * MIB}, second: {"b0": 16 * MIB, "b1": 40 * MIB}})
    gate = RequestGate(nginx.port)
    try:
        url = gate.url("alone/model.safetensors.index.json")
        with tensorfs.open_model(url, remote=options(tmp_path, concurrency=2)) as model:

            def read(name: str, begin: int, end: int) -> None:
                shard, start, nbytes = model.locate(name)
                model.shard_data(shard).ensure(start + begin, start + end, within=(start, start + nbytes))

            read("b1", 0, MIB)  # B: a run of its own in shard 2
            read("b1", MIB, 2 * MIB)
            for name in ["a0", "a1"]:  # A: shard 1 front to back, its window past the end
                read(name, 0, MIB)
                read(name, MIB, 6 * MIB)
            read("b1", 2 * MIB, 3 * MIB)  # B goes on
            _, b1, _ = model.locate("b1")
            two_ahead = ((b1 + 3 * MIB - 1) // (8 * MIB) + 2) * (8 * MIB)

            def asked_two_ahead() -> bool:
                return any(path.endswith(second) and (at or 0) >= two_ahead for path, at in gate.ranges)

            wait_until(asked_two_ahead, what="the chunk two ahead of B, its window grown")
    finally:
        gate.close()


def read_or_error(path: Path) -> bytes | OSError:
    """The file's bytes, or the error reading it failed with (from a thread)."""
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc


def test_a_cold_read_is_answered_before_its_chunk_has_all_come(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """A read of a tensor's first 4 KiB is answered once its bytes have come, not when the whole chunk
    has (a cold tensor's first bytes cost a round trip, not a chunk's transfer): the chunk's GET held
    mid-body after its first MiB, the read returns the right bytes (answering after the chunk, as
    before, it waited for as long as the GET was held); once the rest flows, every byte."""
    directory = nginx.root / "slow"
    directory.mkdir()
    data = random_bytes(4 * MIB, 12)
    write_reference(directory / "m.safetensors", {"t": ("U8", [4 * MIB], data)})  # one chunk (of 8 MiB)
    proxy = StallingProxy(nginx.port)
    try:
        mountpoint = mounts.mount(proxy.url("slow/m.safetensors"), "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        proxy.stall_after(MIB)
        got: list[bytes | OSError] = []
        with open(mountpoint / "t", "rb", buffering=0) as f:

            def first_bytes() -> None:
                try:
                    got.append(os.pread(f.fileno(), 4096, 0))
                except OSError as exc:
                    got.append(exc)

            reader = threading.Thread(target=first_bytes)
            reader.start()
            try:
                reader.join(patience(30))
                assert not reader.is_alive(), "the read waits for the rest of the chunk"
                assert got == [data[:4096]], got
                assert proxy.holding.wait(patience(30))  # and the rest of the chunk is still held
            finally:
                proxy.release()
                reader.join()
        assert (mountpoint / "t").read_bytes() == data
    finally:
        proxy.close()


def test_a_cold_read_well_into_a_chunk_has_its_own_bytes_fetched_first(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """A cold read that starts 5 MiB into a chunk nothing is fetching yet is answered once its own
    bytes have come, not after the 5 MiB before them: the chunk's GET held after its first MiB of
    body, the read returns the right bytes (with the chunk asked for from its start, as before, that
    MiB was the tensor before's, and the read waited for as long as the GET was held). Once the rest
    flows, every byte; and the chunk's record, summed once both parts came, holds: with no request
    at all (--offline) another reader checks the chunk against it and reads the same bytes."""
    directory = nginx.root / "mid"
    directory.mkdir()
    before, after = random_bytes(5 * MIB, 14), random_bytes(2 * MIB, 15)
    write_reference(directory / "m.safetensors", {"a": ("U8", [5 * MIB], before), "b": ("U8", [2 * MIB], after)})
    proxy = StallingProxy(nginx.port)
    cache = tmp_path / "cache"
    try:
        url = proxy.url("mid/m.safetensors")
        mountpoint = mounts.mount(url, "--cache-dir", str(cache))  # type: ignore[arg-type]
        proxy.stall_after(MIB)
        got: list[bytes | OSError] = []
        with open(mountpoint / "b", "rb", buffering=0) as f:

            def first_bytes() -> None:
                try:
                    got.append(os.pread(f.fileno(), 4096, 0))
                except OSError as exc:
                    got.append(exc)

            reader = threading.Thread(target=first_bytes)
            reader.start()
            try:
                reader.join(patience(30))
                assert not reader.is_alive(), "the read waits for the bytes before it in its chunk"
                assert got == [after[:4096]], got
            finally:
                proxy.release()
                reader.join()
        assert (mountpoint / "b").read_bytes() == after and (mountpoint / "a").read_bytes() == before
        assert mounts.run("umount", str(mountpoint)).returncode == 0
        offline = options(tmp_path, offline=True)
        assert read_all(url, offline) == {"a": before, "b": after}
    finally:
        proxy.close()


def test_a_mount_opens_its_connection_to_the_store_as_it_starts(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """The daemon opens a connection to the store before it says the mount is ready: a cold tensor's
    first read goes over it, with no new connection (a round trip more on a distant link, its
    handshake's). Counted at a link in front of the store: without it, that read opened one."""
    directory = nginx.root / "connect"
    directory.mkdir()
    data = random_bytes(MIB, 16)
    write_reference(directory / "m.safetensors", {"t": ("U8", [MIB], data)})
    with SlowLink(("127.0.0.1", nginx.port), delay=0.001) as link:
        mountpoint = mounts.mount(f"{link.url()}/connect/m.safetensors", "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
        opened = link.connections
        with open(mountpoint / "t", "rb", buffering=0) as f:
            assert f.read(4096) == data[:4096]
        assert link.connections == opened
        assert mounts.run("umount", str(mountpoint)).returncode == 0


def test_fetch_threads_yield_to_the_requests_thread(nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "nice"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"t": ("U8", [MIB], random_bytes(MIB, 3))})
    with tensorfs.open_model(f"{nginx.url}/nice/m.safetensors", remote=options(tmp_path)) as model:
        bytes(model.raw("t"))
        fetcher = model.shard_data(model.locate("t")[0])._pool  # type: ignore[attr-defined]
        tids = {thread.native_id for thread in fetcher._threads}
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert tids and all(os.getpriority(os.PRIO_PROCESS, tid) == min(19, ours + 10) for tid in tids)  # type: ignore[arg-type]


def test_a_fetch_waits_for_a_chunk_in_use_when_the_cache_is_full(nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "full-cache"
    directory.mkdir()
    data = random_bytes(3 * MIB, 5)
    write_reference(directory / "m.safetensors", {"t": ("U8", [3 * MIB], data)})
    remote = options(tmp_path, chunk_size=MIB, cache_size=2 * MIB, concurrency=1)  # room for two chunks
    with tensorfs.open_model(f"{nginx.url}/full-cache/m.safetensors", remote=remote) as model:
        shard_key, offset, _ = model.locate("t")
        shard = model.shard_data(shard_key)
        shard.ensure_pinned(offset, offset + MIB)  # chunks 0 and 1, pinned: as while a reply goes out
        got = bytearray(100)
        second = threading.Thread(target=shard.readinto, args=(offset + 5 * MIB // 2, memoryview(got)))
        second.start()
        cached = shard.cached  # type: ignore[attr-defined]
        wait_until(
            lambda: cached.cache.waiting_for_room > 0 or not second.is_alive(), what="the fetch to wait for room"
        )
        assert cached.cache.waiting_for_room == 1 and second.is_alive()  # no room for chunk 2 while 0, 1 are held
        shard.unpin(offset, offset + MIB)
        second.join()
        assert bytes(got) == data[5 * MIB // 2 : 5 * MIB // 2 + 100]
        assert not cached.present(0)  # let go, it made the room


def test_a_cache_too_small_for_two_chunks_is_refused(nginx: Nginx, tmp_path: Path) -> None:
    with pytest.raises(tensorfs.TensorfsError, match=r"--cache-size 15.0 MiB holds less than two chunks of 8.0 MiB"):
        options(tmp_path, cache_size=15 * MIB)
    result = cli("validate", "--cache-size", "1M", f"{nginx.url}/any.safetensors")
    assert result.returncode == 1 and result.stderr == (
        "error: --cache-size 1.0 MiB holds less than two chunks of 8.0 MiB (a read may span two): "
        "raise it, or lower --chunk-mb\n"
    )


# -- mounted ------------------------------------------------------------------------------------


def test_mount_an_s3_model(
    mounts: Mounts, seaweedfs: SeaweedFS, bucket: str, s3_env: dict[str, str],
    local_model: tuple[Path, dict[str, bytes]], tmp_path: Path,
) -> None:  # fmt: skip
    directory, expected = local_model
    (directory / "config.json").write_text('{"model_type": "test"}')
    (directory / ".hidden").write_text("a hidden file is the folder's too")
    upload(seaweedfs.store(bucket), "m", directory)
    obstore.put(seaweedfs.store(bucket), "m/1_Pooling/config.json", b'{"pooling": 1}')  # one level down
    cache = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache")]
    mountpoint = mounts.mount(f"s3://{bucket}/m", *cache)  # type: ignore[arg-type]
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == [  # the listing's: the model's folder
        ".hidden", "1_Pooling", "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]  # fmt: skip
    for name in ("config.json", ".hidden"):
        assert (view / name).read_bytes() == (directory / name).read_bytes()
    assert (view / "1_Pooling" / "config.json").read_bytes() == b'{"pooling": 1}'
    for name, data in expected.items():
        assert (mountpoint / name).read_bytes() == data, name
        meta = json.loads((mountpoint / f"{name}.meta.json").read_text())
        assert meta["shard"].startswith("model-0000") and meta["nbytes"] == len(data)
    result = subprocess.run(
        ["sha256sum", "--strict", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    counted = remote_stats(mountpoint)
    sizes = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    companions = sum(
        len(data) for data in (b'{"model_type": "test"}', b'{"pooling": 1}', (directory / ".hidden").read_bytes())
    )
    assert counted["fetched_bytes"] == sizes + companions and counted["fetch_failures"] == 0  # every chunk, once
    chunks = sum(-(-path.stat().st_size // (8 * MIB)) for path in directory.glob("*.safetensors"))
    assert counted["gets"] == chunks + counted["split_chunks"] + 3  # a chunk a cold read began well into: two
    entry = next(m for m in mount_table() if m.mountpoint == mountpoint)
    assert entry.source == f"s3://{bucket}/m"
    settings = json.loads((mountpoint / ".tensorfs" / "daemon.json").read_text())["options"]["remote"]
    assert settings == {"cache_dir": str(tmp_path / "cache"), "cache_size": None, "chunk_size": 8 * MIB,
                        "concurrency": 8, "timeout": 60.0, "offline": False}  # fmt: skip
    status = mounts.run("status", "--json")
    assert any(json.loads(line)["source"] == f"s3://{bucket}/m" for line in status.stdout.splitlines())
    # a second mount of it reads from the cache: --offline needs no store at all
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    offline = mounts.mount(f"s3://{bucket}/m", "--offline", "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
    assert (offline / "layers/3/w").read_bytes() == expected["layers/3/w"]
    listed = mounts.run("cache", "ls", "--json", "--cache-dir", str(tmp_path / "cache"))
    objects = [json.loads(line) for line in listed.stdout.splitlines()]
    shards = {f"s3://{bucket}/m/model-0000{i}-of-00002.safetensors" for i in (1, 2)}
    companions = {
        f"s3://{bucket}/m/{name}" for name in ("config.json", "1_Pooling/config.json", ".hidden")
    }  # read through it
    assert {o["url"] for o in objects} == shards | companions
    assert all(o["cached"] == o["size"] and o["in_use"] == (o["url"] in shards) for o in objects)


def test_a_hub_model_mounts_with_its_companion_files(
    mounts: Mounts, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = nginx.root / "org" / "companions" / "resolve" / "main"
    directory.mkdir(parents=True)
    write_reference(directory / "model.safetensors", {"w": ("F32", [2], random_bytes(8, 1))})
    (directory / "config.json").write_text('{"architectures": ["Test"]}')
    (directory / "tokenizer.json").write_bytes(random_bytes(100_000, 2))
    (directory / "notes.txt").write_text("not a name a loader looks for")
    with open(directory / "tokenizer.model", "wb") as huge:
        huge.seek(65 * MIB)  # any size: read through the cache as a shard is (issue 55)
        huge.write(b"end")
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    options = ["--log-file", str(mounts.log_file), "--cache-dir", str(tmp_path / "c")]
    result = mounts.attempt("hf://org/companions", *options, mountpoint=mountpoint)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"]
    for name in ("config.json", "tokenizer.json"):
        assert (view / name).read_bytes() == (directory / name).read_bytes()
    with open(view / "tokenizer.model", "rb") as huge:
        huge.seek(65 * MIB - 2)
        assert huge.read() == b"\0\0end"


def test_cache_prune_takes_what_no_reader_uses_and_the_mount_reads_on(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """A mount holds no chunk it is not answering from: `cache prune` beside it frees them all, and the
    mount fetches again what is read (a chunk answered from stays: see test_trust)."""
    directory = nginx.root / "held"
    directory.mkdir()
    tensors = {f"t{i}": ("U8", [3 * MIB], random_bytes(3 * MIB, 20 + i)) for i in range(4)}
    write_reference(directory / "m.safetensors", tensors)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    mountpoint = mounts.mount(f"{nginx.url}/held/m.safetensors", *cache)  # type: ignore[arg-type]
    # The last tensor: all of it in the last chunk, and no chunk after it for a read-ahead to take (one
    # that went on from an earlier tensor would fetch the next chunk, or not, as the reads fall).
    assert (mountpoint / "t3").read_bytes() == tensors["t3"][2]
    last_chunk = (directory / "m.safetensors").stat().st_size - 8 * MIB

    def listed() -> list[dict[str, object]]:
        return [json.loads(line) for line in cli("cache", "ls", "--json", *cache).stdout.splitlines()]

    wait_until(lambda: listed()[0]["cached"] == last_chunk, what="the last chunk to be recorded")
    assert listed()[0]["in_use"] is True
    freed = cli("cache", "prune", *cache).stdout
    assert freed == f"freed {human_size(last_chunk)}; 0 B cached\n"  # nobody answers from it
    drop_caches()  # no page cache to hide a hole
    for name, (_, _, data) in tensors.items():
        assert (mountpoint / name).read_bytes() == data, name


def test_a_forbidden_default_manifest_is_no_manifest(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "guarded"
    directory.mkdir()
    tensors = {"w": ("U8", [MIB], random_bytes(MIB, 40))}
    write_reference(directory / "m.safetensors", tensors)
    (directory / "tensors.sha256").write_text("not for you\n")  # answered 403
    url = f"{nginx.url}/guarded/m.safetensors"
    mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"))  # type: ignore[arg-type]
    assert (mountpoint / "w").read_bytes() == tensors["w"][2]
    assert (
        "tensors.sha256: access denied (403): tensorfs sends no credentials to an HTTP(S) server: check the URL, "
        "and that the server lets it be read; taken as no manifest" in mounts.log()
    )
    verify = cli("verify", "--cache-dir", str(tmp_path / "cache"), url)
    assert verify.returncode == 1 and verify.stdout == ""
    assert verify.stderr.endswith(
        f"error: {nginx.url}/guarded/m.safetensors: no tensors.sha256 here; name a manifest with --manifest FILE\n"
    )
    # a model that cannot be reached is named, not the manifest looked for beside it
    unreachable = cli(
        "verify", "--remote-timeout", "2", "--cache-dir", str(tmp_path / "cache"), "http://127.0.0.1:1/m.safetensors"
    )
    assert unreachable.returncode == 1 and "http://127.0.0.1:1/m.safetensors: unreachable" in unreachable.stderr


def test_offline_reads_what_is_cached_only(nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "offline"
    directory.mkdir()
    tensors = {f"t{i}": ("U8", [16 * MIB], random_bytes(16 * MIB, i)) for i in range(3)}
    write_reference(directory / "m.safetensors", tensors)
    url = f"{nginx.url}/offline/m.safetensors"
    with tensorfs.open_model(url, remote=options(tmp_path)) as model:
        bytes(model.raw("t0"))
    with tensorfs.open_model(url, remote=options(tmp_path, offline=True)) as model:
        assert bytes(model.raw("t0")) == tensors["t0"][2]
        with pytest.raises(tensorfs.TensorfsError, match=r"not cached \(--offline\)"):
            model.raw("t2")
    with pytest.raises(tensorfs.InvalidModelError, match="never had this model"):
        tensorfs.open_model(f"{nginx.url}/offline/other.safetensors", remote=options(tmp_path, offline=True))


def test_prefetch_and_the_cache_commands(nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "prefetch"
    directory.mkdir()
    tensors = {f"t{i}": ("U8", [5 * MIB], random_bytes(5 * MIB, i)) for i in range(6)}
    write_reference(directory / "m.safetensors", tensors)
    url = f"{nginx.url}/prefetch/m.safetensors"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    too_small = cli("prefetch", *cache, "--cache-size", "20M", url)
    assert too_small.returncode == 1
    assert too_small.stderr == f"error: {url}: 30.0 MiB does not fit in --cache-size 20.0 MiB\n"
    result = cli("prefetch", *cache, url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("1 shard(s), 30.0 MiB cached\n")
    with tensorfs.open_model(url, remote=options(tmp_path, offline=True)) as model:
        assert {name: bytes(model.raw(name)) for name in model} == {n: t[2] for n, t in tensors.items()}
    stage = ["--cache-dir", str(tmp_path / "stage")]
    result = cli("prefetch", *stage, "--include", "t0", url)  # a selection: only its tensor's chunk
    assert result.returncode == 0 and result.stdout.endswith("1 shard(s), 8.0 MiB cached\n"), result.stderr
    with tensorfs.open_model(url, remote=RemoteOptions(cache_dir=tmp_path / "stage", offline=True)) as model:
        assert bytes(model.raw("t0")) == tensors["t0"][2]
        with pytest.raises(tensorfs.TensorfsError, match="not cached"):
            model.raw("t3")
    du = cli("cache", "du", *cache)
    size = (directory / "m.safetensors").stat().st_size
    assert du.stdout.startswith(f"30.0 MiB ({size} bytes) cached of 1 object version(s)")
    pruned = cli("cache", "prune", "--cache-size", "10M", *cache)
    assert pruned.returncode == 0 and pruned.stdout == "freed 24.0 MiB; 6.0 MiB cached\n"  # the last chunk is short
    assert cli("cache", "prune", *cache).stdout == "freed 6.0 MiB; 0 B cached\n"
    assert cli("cache", "ls", *cache).stdout.count("\n") == 1  # the objects' rows go with their last chunk


def test_remote_options_take_a_cache_dir_as_a_string(tmp_path: Path) -> None:
    assert RemoteOptions(cache_dir=str(tmp_path)).cache_dir == tmp_path  # type: ignore[arg-type]


def test_headers_of_objects_are_cached_by_url_etag_and_size(
    nginx: Nginx,
    served: str,
    local_model: tuple[Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tensorfs.sources.remote as objects
    import tensorfs.utils.identity

    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # objects just written may be cached here
    parses = 0
    real = objects._validated

    def counted(*args: Any) -> Any:
        nonlocal parses
        parses += 1
        return real(*args)

    monkeypatch.setattr(objects, "_validated", counted)
    _, expected = local_model
    remote = options(tmp_path)
    url = f"{served}/model.safetensors.index.json"
    assert read_all(url, remote) == expected
    assert parses == 2
    assert read_all(url, remote) == expected  # the same objects: their headers come from the cache
    assert parses == 2
    # One object replaced by the same bytes with another mtime: nginx gives it another ETag, so its
    # header is validated again (and the other's is not).
    target = nginx.root / served.rsplit("/", 1)[1] / "model-00001-of-00002.safetensors"
    os.utime(target, (1_000_000_000, 1_000_000_000))
    assert read_all(url, remote) == expected
    assert parses == 3


# -- the remote options, as the store sees them -----------------------------------------------


@pytest.fixture
def s3_impostor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostileServer]:
    """An S3 endpoint on loopback that keeps every request's headers (it checks no signature), holding
    one object, s3://bucket/m.safetensors; credentials and a region in the environment, as a user
    of AWS tools has them (every command run here inherits them)."""
    (tmp_path / "served" / "bucket").mkdir(parents=True)
    server = HostileServer(tmp_path / "served")
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_REGION", "us-west-1")
    try:
        yield server
    finally:
        server.close()


def impostor_model(server: HostileServer) -> dict[str, bytes]:
    tensors = {f"t{i}": random_bytes(MIB, 40 + i) for i in range(2)}
    write_reference(server.root / "bucket" / "m.safetensors", {k: ("U8", [MIB], v) for k, v in tensors.items()})
    return tensors


def test_region_signs_every_request_for_that_region(mounts: Mounts, s3_impostor: HostileServer, tmp_path: Path) -> None:
    """--region is the region of every request's SigV4 credential scope (over AWS_REGION)."""
    expected = impostor_model(s3_impostor)
    options = ["--endpoint-url", s3_impostor.url, "--cache-dir", str(tmp_path / "cache"), "--region", "eu-west-3"]
    mountpoint = mounts.mount("s3://bucket/m.safetensors", *options)  # type: ignore[arg-type]
    for name, data in expected.items():
        assert (mountpoint / name).read_bytes() == data
    signed = [headers.get("authorization", "") for headers in s3_impostor.headers]
    gets = [request for request in s3_impostor.requests if request[:2] == ("GET", "bucket/m.safetensors")]
    assert len(gets) >= 2  # the header, and the tensors' bytes (by the daemon)
    scopes = {re.match(r"AWS4-HMAC-SHA256 Credential=AKIDTENSORFS/\d{8}/([^/,]+)/s3/aws4_request,", a) for a in signed}
    assert None not in scopes, signed  # every request signed
    assert {scope[1] for scope in scopes if scope is not None} == {"eu-west-3"}


def test_no_sign_request_sends_no_credentials(mounts: Mounts, s3_impostor: HostileServer, tmp_path: Path) -> None:
    """--no-sign-request: no request carries an Authorization header, though credentials are at hand."""
    expected = impostor_model(s3_impostor)
    options = ["--endpoint-url", s3_impostor.url, "--cache-dir", str(tmp_path / "cache"), "--no-sign-request"]
    mountpoint = mounts.mount("s3://bucket/m.safetensors", *options)  # type: ignore[arg-type]
    for name, data in expected.items():
        assert (mountpoint / name).read_bytes() == data
    assert len([r for r in s3_impostor.requests if r[:2] == ("GET", "bucket/m.safetensors")]) >= 2
    assert [h["authorization"] for h in s3_impostor.headers if "authorization" in h] == []
    assert not any(key.startswith("x-amz-security-token") for h in s3_impostor.headers for key in h)


def test_remote_concurrency_bounds_the_requests_in_flight(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    """--remote-concurrency 2: with four readers of four tensors at once (and the read-ahead of each),
    two GETs at most are ever in flight (counted exactly, at a gate), and two are: the gate holds
    every GET until two wait there and the four reads wait in the daemon. (The look-ups at mount, of
    headers and companion files, go 8 at once whatever it is: docs/remote.md.)"""
    directory = nginx.root / "concurrency"
    directory.mkdir()
    tensors = {f"t{i}": random_bytes(4 * MIB, 60 + i) for i in range(4)}
    write_reference(directory / "m.safetensors", {k: ("U8", [4 * MIB], v) for k, v in tensors.items()})
    gate = RequestGate(nginx.port)
    try:
        options = ["--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1", "--remote-concurrency", "2"]
        mountpoint = mounts.mount(gate.url("concurrency/m.safetensors"), *options)  # type: ignore[arg-type]
        gate.reset()
        before = len(gate.ranges)
        gate.hold_from(0)
        outcomes: dict[str, bytes | OSError] = {}
        readers = [
            threading.Thread(target=lambda name=name: outcomes.update({name: read_or_error(mountpoint / name)}))
            for name in tensors
        ]
        for reader in readers:
            reader.start()
        try:
            assert gate.wait_held(2, patience(30)), gate.ranges[before:]
            wait_until(lambda: reads_in_handlers(mountpoint) >= 4, what="the four reads to wait in the daemon")
        finally:
            gate.release()
            for reader in readers:
                reader.join()
        assert outcomes == tensors and gate.failure is None
        assert len(gate.ranges) - before >= 16  # a GET a chunk
        assert gate.most_in_flight == 2, gate.ranges[before:]
    finally:
        gate.close()


def test_a_chunk_fetched_again_is_not_answered_before_it_is_checked(
    mounts: Mounts, nginx: Nginx, tmp_path: Path
) -> None:
    """A chunk fetched once, evicted, and fetched again from a store that changed the object in place
    (same ETag: nginx's is the mtime and size, the mtime put back): its bytes are held to the sums the
    first fetch recorded, so a read is not answered from them as they come (as a chunk no fetch gave
    before is), but once the whole chunk came and was checked: the GET held mid-body, the read waits;
    let go, it is refused (EIO), never a byte of the other bytes."""
    directory = nginx.root / "again"
    directory.mkdir()
    data = random_bytes(4 * MIB, 16)
    shard = directory / "m.safetensors"
    write_reference(shard, {"t": ("U8", [4 * MIB], data)})  # one chunk (of 8 MiB)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    proxy = StallingProxy(nginx.port)
    try:
        first = mounts.mount(proxy.url("again/m.safetensors"), *cache)  # type: ignore[arg-type]
        assert (first / "t").read_bytes() == data  # fetched, its sums recorded
        assert cli("umount", str(first)).returncode == 0
        again = mounts.mount(proxy.url("again/m.safetensors"), *cache)  # type: ignore[arg-type]
        # Evicted while the object is in use (so it stays cached, with its sums): fetched again when wanted.
        assert cli("cache", "prune", *cache).returncode == 0
        stat = shard.stat()
        served = shard.read_bytes()
        start = len(served) - len(data)
        shard.write_bytes(served[:start] + bytes(b ^ 0x3C for b in served[start:]))  # the header as it was
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same ETag
        drop_caches()  # the kernel's pages of the first mount's reads are not this mount's, but be sure
        proxy.stall_after(MIB)
        got: list[bytes | OSError] = []
        with open(again / "t", "rb", buffering=0) as f:

            def first_bytes() -> None:
                try:
                    got.append(os.pread(f.fileno(), 4096, 0))
                except OSError as exc:
                    got.append(exc)

            reader = threading.Thread(target=first_bytes)
            reader.start()
            try:
                assert proxy.holding.wait(patience(30))  # its first MiB came, the rest is held
                assert reader.is_alive() and got == [], got  # not answered from what came so far
            finally:
                proxy.release()
                reader.join()
        said = (
            "the data" if got and got[0] == data[:4096] else "other bytes" if got and isinstance(got[0], bytes) else got
        )
        assert len(got) == 1 and isinstance(got[0], OSError) and got[0].errno == errno.EIO, said
    finally:
        proxy.close()
