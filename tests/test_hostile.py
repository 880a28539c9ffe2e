"""The standing hostile harness (issue 32, section 7): a store that lies (servers.HostileServer, whose
lies are a table of servers.Lie) over plain HTTP, S3's API and the Hub's, and a local user who plants
what they like in a model's directory, each driven across every command that reads from outside:
validate, ls, manifest, verify, export, mount, prefetch and cache, and the loader in-process.

Whatever the lie, each command holds to the same rules, checked by one checker (`check`):

- never a traceback: only tensorfs's own errors leave it (in-process: TensorfsError alone);
- every line it writes on stderr is one error or warning naming the file (its URL or path) and the
  reason; a refusal exits non-zero, and says so in an error line; a success has none;
- never wrong bytes: what a mount, an export, a manifest or the loader gives is the truth's (the
  files the server holds, compared byte for byte), or a refusal (EIO, an error); every
  byte-serving command has the truth's manifest in force, so a store that serves other bytes from
  the first answer on is caught too;
- nothing left behind: no partial file, no mount, no daemon;
- bounded time: every command in a process of its own with a hang guard (a timeout that only a
  hang reaches), the loader on a thread with one.

The suite runs two cases of every lie (SUITE) and of every plant (LOCAL_SUITE), each lie first seen
to be told on the wire; `make fuzz` draws lies and plants at random, several at once, and crafted
files (GGUF, zip, pickle, safetensors) served by the same server, from a seed it prints. What the
harness found has a test of its own each, at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
from conftest import Mounts
from helpers import MIB, fuzzing, random_bytes, write_index, write_reference
from servers import HostileServer, Lie
from tensorfs import RemoteOptions, TensorfsError
from tensorfs.fs.guarded import mounted_under
from tensorfs.mount.mounttable import mount_at
from tensorfs.sources.failures import RANGE_NEEDED

HANG_GUARD = 120.0
"""Seconds a command may take before it is taken for hung (every command here takes a few at most)."""
REMOTE = ["--no-sign-request", "--remote-timeout", "3", "--chunk-mb", "1"]
"""Every remote command's options: a lie that makes a client wait costs 3 s, not the default minute."""

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
MODEL = "bucket/m"
"""Where the truth lies under the server's root: s3://bucket/m, hf://bucket/m, URL/bucket/m/...."""
LISTED = "bucket/n"
"""The same shards and config.json without an index, s3://bucket/n: its shards are found by the listing."""
COMPANIONS = {
    "config.json": b'{"model_type": "bert"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "modules.json": b'[{"idx": 0, "name": "0", "path": "", "type": "t"}, {"idx": 1, "name": "1", "path": "1_Pooling"}]',
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
}


@dataclass
class Truth:
    """What the server holds, as it is: the model's tensors, every file of its view, its manifest."""

    root: Path
    tensors: dict[str, bytes]
    view: dict[str, bytes]
    """The files of .tensorfs/model/ and of an export: the model's folder, every file as it is."""
    manifest: Path
    """The truth's manifest (sha256sum lines), kept locally: what the byte-serving commands are held to."""


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Truth:
    root = tmp_path_factory.mktemp("truth")
    model = root / "served" / MODEL
    (model / "1_Pooling").mkdir(parents=True)
    tensors = {
        "a": random_bytes(3 * MIB // 2, 1),  # across the first chunks (--chunk-mb 1)
        "b": random_bytes(64 * 64 * 4, 2),
        "c": random_bytes(2048, 3),
        "d": random_bytes(8, 4),
    }
    write_reference(model / SHARD1, {"a": ("U8", [3 * MIB // 2], tensors["a"]), "b": ("F32", [64, 64], tensors["b"])})
    write_reference(model / SHARD2, {"c": ("BF16", [1024], tensors["c"]), "d": ("I64", [], tensors["d"])})
    write_index(model, {"a": SHARD1, "b": SHARD1, "c": SHARD2, "d": SHARD2})
    for name, data in COMPANIONS.items():
        (model / name).write_bytes(data)
    listed = root / "served" / LISTED  # the same shards without an index: found by S3's listing
    listed.mkdir()
    for name in (SHARD1, SHARD2, "config.json"):
        (listed / name).write_bytes((model / name).read_bytes())
    manifest = root / "truth.sha256"
    manifest.write_text("".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in tensors.items()))
    for directory in (model, listed):  # beside each model too: the manifest in force by default
        (directory / "tensors.sha256").write_bytes(manifest.read_bytes())
    view = {path.relative_to(model).as_posix(): path.read_bytes() for path in model.rglob("*") if path.is_file()}
    return Truth(root / "served", tensors, view, manifest)


@pytest.fixture(scope="module")
def server(truth: Truth) -> Iterator[HostileServer]:
    served = HostileServer(truth.root)
    try:
        yield served
    finally:
        served.close()


# -- the commands, each as a user runs it ---------------------------------------------------------


@dataclass
class Run:
    """One command run against a model: what it said, and what it left."""

    command: str
    code: int
    stdout: str
    stderr: str
    tensors_in: dict[str, dict[str, str] | None] = field(default_factory=dict)
    """What each safetensors file handed out holds, by what its header says: each tensor's SHA-256
    (None: its header is not one)."""
    bytes_out: dict[str, bytes | str | None] = field(default_factory=dict)
    """What it handed out, by tensor or view file: bytes (or their SHA-256, in hex), or None where it
    refused (EIO, an error)."""


@dataclass
class Place:
    """Where a case runs: its model's URL (and the options and environment that reach it), and a
    directory of its own for what the commands write."""

    source: str
    options: list[str]
    env: dict[str, str]
    work: Path
    mounts: Mounts | None

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tensorfs.cli", *args], capture_output=True, text=True, timeout=HANG_GUARD,
            env=self.env, check=False,
        )  # fmt: skip

    def remote(self) -> RemoteOptions:
        endpoint = next((self.options[k + 1] for k, o in enumerate(self.options) if o == "--endpoint-url"), None)
        return RemoteOptions(
            endpoint_url=endpoint, no_sign_request=True, timeout=3, chunk_size=MIB, cache_dir=self.work / "cache"
        )


PROTOCOLS = ("http", "s3", "hub", "s3-listed")


def model_of(protocol: str) -> str:
    """The model a protocol's cases read: the one with an index, or (s3-listed) the one without."""
    return LISTED if protocol == "s3-listed" else MODEL


def place(protocol: str, server: HostileServer, work: Path, mounts: Mounts | None) -> Place:
    cache = ["--cache-dir", str(work / "cache")]
    env = {**os.environ, "HF_ENDPOINT": server.url}
    if protocol == "http":
        return Place(f"{server.url}/{MODEL}/{INDEX}", [*REMOTE, *cache], env, work, mounts)
    if protocol in ("s3", "s3-listed"):
        return Place(f"s3://{model_of(protocol)}", [*REMOTE, *cache, "--endpoint-url", server.url], env, work, mounts)
    assert protocol == "hub"
    return Place(f"hf://{MODEL}", [*REMOTE, *cache], env, work, mounts)


def validate(at: Place, truth: Truth) -> Run:
    done = at.cli("validate", *at.options, at.source)
    return Run("validate", done.returncode, done.stdout, done.stderr)


def ls(at: Place, truth: Truth) -> Run:
    done = at.cli("ls", "--json", *at.options, at.source)
    if done.returncode == 0:  # what it lists is of the truth's table (a store may leave a shard out of a listing)
        listed = {row["name"]: row["nbytes"] for row in map(json.loads, done.stdout.splitlines())}
        assert listed.items() <= {name: len(data) for name, data in truth.tensors.items()}.items(), listed
    return Run("ls", done.returncode, done.stdout, done.stderr)


def manifest(at: Place, truth: Truth) -> Run:
    out = at.work / "out.sha256"
    done = at.cli("manifest", "-o", str(out), *at.options, at.source)
    run = Run("manifest", done.returncode, done.stdout, done.stderr)
    if done.returncode == 0:
        hashes = dict(reversed(line.split("  ", 1)) for line in out.read_text().splitlines())  # type: ignore[misc]
        run.bytes_out = {
            name: truth.tensors[name] if digest == sha(truth.tensors[name]) else b"?" for name, digest in hashes.items()
        }
    else:
        assert not out.exists(), "a manifest left though refused"
    return run


def verify(at: Place, truth: Truth) -> Run:
    done = at.cli("verify", "--manifest", str(truth.manifest), *at.options, at.source)
    run = Run("verify", done.returncode, done.stdout, done.stderr)
    if done.returncode == 0:  # its word: every tensor's bytes hashed to the truth's
        run.bytes_out = dict(truth.tensors)
    return run


def export(at: Place, truth: Truth) -> Run:
    dest = at.work / "exported"
    done = at.cli("export", *at.options, at.source, str(dest))
    run = Run("export", done.returncode, done.stdout, done.stderr)
    if done.returncode == 0:
        run.bytes_out = {str(path.relative_to(dest)): path.read_bytes() for path in dest.rglob("*") if path.is_file()}
    else:
        assert not dest.exists(), "an export left though refused"
    return run


# Reads each file it is given, whole, in a process of its own: {"files": {path: sha256, or the errno of the
# failure}, "tensors": {path: of a safetensors file, the SHA-256 of each tensor its header says it holds,
# or null when its header is not one}}.
READER = """
import hashlib, json, sys
found, tensors = {}, {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        found[path] = exc.errno
        continue
    found[path] = hashlib.sha256(data).hexdigest()
    if path.endswith(".safetensors"):
        try:
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + n])
            held = {name: hashlib.sha256(data[8 + n + t["data_offsets"][0] : 8 + n + t["data_offsets"][1]]).hexdigest()
                    for name, t in header.items() if name != "__metadata__"}
        except Exception:
            held = None
        tensors[path] = held
print(json.dumps({"files": found, "tensors": tensors}))
"""


def mount(at: Place, truth: Truth) -> Run:
    assert at.mounts is not None
    mountpoint = at.work / "mnt"
    mountpoint.mkdir()
    options = ["--manifest", str(truth.manifest), "--log-file", str(at.work / "daemon.log"), *at.options]
    at.mounts.watch(mountpoint)
    done = at.cli("mount", *options, at.source, str(mountpoint))
    run = Run("mount", done.returncode, done.stdout, done.stderr)
    if done.returncode != 0:
        assert mount_at(mountpoint) is None, "mounted though refused"
        return run
    try:
        view = mountpoint / ".tensorfs" / "model"
        files = [*(mountpoint / name for name in truth.tensors), *(p for p in view.rglob("*") if p.is_file())]
        read = subprocess.run(
            [sys.executable, "-c", READER, *map(str, files)], capture_output=True, text=True, timeout=HANG_GUARD,
            check=True,
        )  # fmt: skip
        answers = json.loads(read.stdout)
        for path, found in answers["files"].items():
            in_view = Path(path).is_relative_to(view)
            name = str(Path(path).relative_to(view if in_view else mountpoint))
            assert found in (5, 2) or isinstance(found, str), f"{path}: errno {found}, not EIO"  # EIO, or bytes
            refused = found in (5, 2)  # EIO; or, of a tensor, not there (a store that left its shard out)
            run.bytes_out[f"view/{name}" if in_view else name] = None if refused else found  # their SHA-256
            if not refused and path in answers["tensors"]:
                run.tensors_in[f"view/{name}"] = answers["tensors"][path]
    finally:
        unmounted = at.cli("umount", str(mountpoint))
        assert unmounted.returncode == 0, unmounted.stderr
    return run


def prefetch(at: Place, truth: Truth) -> Run:
    """prefetch, then cache ls, du and prune of what it cached, then the model read from the cache
    alone (export --offline): the cache never holds other bytes as the truth's."""
    done = at.cli("prefetch", *at.options, at.source)
    runs = [Run("prefetch", done.returncode, done.stdout, done.stderr)]
    cache = ["--cache-dir", str(at.work / "cache")]
    for command in (["cache", "ls"], ["cache", "du"], ["cache", "prune", "--max-size", "1M"]):
        listed = at.cli(*command, *cache)
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    dest = at.work / "offline"
    offline = at.cli("export", *at.options, "--offline", at.source, str(dest))
    run = Run("prefetch", runs[0].code, done.stdout, done.stderr)
    check_lines(Run("export --offline", offline.returncode, offline.stdout, offline.stderr), at, truth)
    if offline.returncode == 0:
        exported = {
            name: data
            for file in dest.glob("*.safetensors")
            for name, data in safetensors_tensors(file.read_bytes()).items()
        }
        run.bytes_out = {name: data if data == truth.tensors.get(name) else b"?" for name, data in exported.items()}
    return run


def loader(at: Place, truth: Truth) -> Run:
    """open_model (each tensor's bytes), load_file and safe_open, in-process: only a TensorfsError
    leaves them."""
    outcome: list[Run] = []

    def use() -> None:
        run = Run("loader", 0, "", "")
        try:
            with tensorfs.open_model(at.source, remote=at.remote(), verify=str(truth.manifest)) as model:
                for name in model:
                    try:
                        run.bytes_out[name] = bytes(model.raw(name))
                    except TensorfsError:
                        run.bytes_out[name] = None
            loaded = tensorfs.load_file(at.source, framework="np", remote=at.remote(), verify=str(truth.manifest))
            for name, array in loaded.items():
                run.bytes_out[f"load_file {name}"] = array.tobytes()
            with tensorfs.safe_open(at.source, "np", remote=at.remote(), verify=str(truth.manifest)) as opened:
                for name in opened.keys():  # noqa: SIM118  (safe_open has keys(), no iteration)
                    run.bytes_out[f"safe_open {name}"] = opened.get_tensor(name).tobytes()
        except TensorfsError as exc:
            run.code, run.stderr = 1, "".join(f"error: {line}\n" for line in exc.lines())
        outcome.append(run)

    failure: list[BaseException] = []

    def guarded() -> None:
        try:
            use()
        except BaseException as exc:  # anything but a TensorfsError: the test's failure, told below
            failure.append(exc)

    thread = threading.Thread(target=guarded, daemon=True)
    env = {key: at.env[key] for key in ("HF_ENDPOINT",) if key in at.env}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        thread.start()
        thread.join(HANG_GUARD)
    assert not thread.is_alive(), "the loader hung"
    if failure:
        raise AssertionError(f"the loader raised {type(failure[0]).__name__}, not a TensorfsError") from failure[0]
    return outcome[0]


COMMANDS: dict[str, Callable[[Place, Truth], Run]] = {
    "validate": validate,
    "ls": ls,
    "manifest": manifest,
    "verify": verify,
    "export": export,
    "mount": mount,
    "prefetch": prefetch,
    "loader": loader,
}


# -- the one checker -------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_tensors(data: bytes) -> dict[str, bytes]:
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    start = 8 + length
    return {
        name: data[start + entry["data_offsets"][0] : start + entry["data_offsets"][1]]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def check_lines(run: Run, at: Place, truth: Truth) -> None:
    """No traceback; every stderr line an error or a warning naming a file and why; an error line
    exactly when it exits non-zero (1)."""
    lines = run.stderr.splitlines()
    assert "Traceback" not in run.stderr, f"{run.command}: {run.stderr[-3000:]}"
    assert run.code in (0, 1), f"{run.command}: exit {run.code}: {run.stderr[-2000:]}"
    named = (at.source.split("/bucket/")[0], "s3://", "hf://", str(at.work), str(truth.manifest))
    for line in lines:
        kind, _, said = line.partition(": ")
        assert kind in ("error", "warning"), f"{run.command}: a line that is no error or warning: {line!r}"
        assert any(where in said for where in named), f"{run.command}: names no file: {line!r}"
        assert re.search(r": \S", said), f"{run.command}: says no reason: {line!r}"
    errors = [line for line in lines if line.startswith("error: ")]
    assert bool(errors) == (run.code != 0), f"{run.command}: exit {run.code}, and {errors or 'no error line'}"


def check(
    run: Run,
    at: Place,
    truth: Truth,
    lies: list[Lie],
    planted: Collection[int] = (),
    served: Mapping[str, bytes] | None = None,
) -> None:
    """Every rule of the module's docstring, of one command's run (`planted`: the daemons of the
    mounts a hostile user left, stopped, which are theirs and not the command's; `served`: files a
    plant made that are the folder's own, by path, as the view serves them)."""
    check_lines(run, at, truth)
    # A companion has no manifest: what the store says of its bytes (its size, other bytes, other
    # ranges, another file's through a redirect), it says of it consistently, is all there is of them;
    # nor do a weights file's bytes that no tensor holds (its tensors' are held to the manifest).
    unvouched = {
        lie.target.partition(f"{MODEL}/")[2] or lie.target.partition(f"{LISTED}/")[2]
        for lie in lies
        if lie.what in ("size", "body", "range", "redirect")
    }
    everything = any(lie.target == "*" for lie in lies if lie.what in ("size", "body", "range", "redirect"))
    listed = {lie.value: b"{}" for lie in lies if lie.what == "name"}  # a plain name listed is a file: "{}"
    for name, handed in run.bytes_out.items():
        if handed is None:
            continue  # refused
        key = name.removeprefix("load_file ").removeprefix("safe_open ").removeprefix("view/")
        if name.startswith("view/") or run.command == "export":
            if key.endswith(".safetensors"):  # whatever its header says, a tensor in it has the truth's bytes
                held = run.tensors_in.get(name) if isinstance(handed, str) else _tensors_in(handed)
                truths = {t: sha(data) for t, data in truth.tensors.items()}
                assert held is not None and all(truths.get(t) == h for t, h in held.items()), (
                    f"{run.command}: other tensors than the truth's in {name}"
                )
            if key in unvouched or everything:
                continue
            expected = truth.view.get(key, listed.get(key, (served or {}).get(key)))
        else:
            expected = truth.tensors.get(key)
        same = handed == expected or (isinstance(handed, str) and expected is not None and handed == sha(expected))
        assert same, f"{run.command}: other bytes than the truth's for {name}"
    hung = {
        mounted for mounted in mounted_under(at.work) if not mounted.endswith("mnt")
    }  # the plants' (never looked into)
    leftovers = [path for path in _files(at.work, hung) if ".partial" in path.name]
    assert not leftovers, f"{run.command}: left {leftovers}"
    assert mounted_under(at.work) == hung, f"{run.command}: left mounted: {mounted_under(at.work) - hung}"
    daemons = [
        pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) not in planted and _runs_in(int(pid), at.work)
    ]
    assert not daemons, f"{run.command}: left processes {[_cmdline(int(pid)) for pid in daemons]}"


def _tensors_in(data: bytes) -> dict[str, str] | None:
    """Each tensor's SHA-256, by what a safetensors file's header says it holds (None: no header)."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        return {
            name: sha(data[8 + n + t["data_offsets"][0] : 8 + n + t["data_offsets"][1]])
            for name, t in header.items()
            if name != "__metadata__"
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _files(top: Path, mounted: set[str]) -> list[Path]:
    """Every file under `top`, the mounts beneath it (`mounted`, relative paths) left alone."""
    found, pending = [], [top]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if os.path.relpath(entry.path, top) in mounted:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                else:
                    found.append(Path(entry.path))
    return found


def _runs_in(pid: int, work: Path) -> bool:
    """Whether process `pid` is a command of the case's (its command line names the case's directory)."""
    return str(work) in _cmdline(pid)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


# -- the lies ----------------------------------------------------------------------------------------


def flipped(path: Path, after: int) -> bytes:
    """A file's bytes, every one from `after` on inverted: another model's tensors under the same header."""
    data = path.read_bytes()
    return data[:after] + bytes(b ^ 0xFF for b in data[after:])


def _tensors_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


HOSTILE_NAMES = [
    "/etc/passwd", "../escape.json", "a//b.json", "x\x00y.json", "é" * 200 + ".json", "d/" * 16 + "c.json", ".", "sub/",
    "../../../../../api/models/x/", "/abs/",
]  # fmt: skip
"""Names a listing gives that are no plain relative path (or too deep for a companion); those ending in
'/' folders the Hub's listing has (each asked for by its name, were it let through)."""


def lies_of(kind: str, truth: Truth, model: str) -> list[Lie]:
    """The lie of the suite called `kind`, about the files of `model` (a directory under the root)."""
    here = truth.root / model
    one, two = f"{model}/{SHARD1}", f"{model}/{SHARD2}"
    table: dict[str, list[Lie]] = {
        "size-smaller": [Lie("size", one, (here / SHARD1).stat().st_size - 1000)],
        "size-huge": [Lie("size", two, 1 << 58)],
        "size-index": [Lie("size", f"{model}/{INDEX}", 1 << 30)],
        "range-longer": [Lie("range", one, 4096)],
        "range-ignored": [Lie("range", one, "ignored")],
        "range-shifted": [Lie("range", one, "shifted")],
        "range-short": [Lie("range", one, "short")],
        "etag-fresh": [Lie("etag", one, "fresh")],
        "etag-none": [Lie("etag", two, "none")],
        "etag-fresh-unchecked": [Lie("etag", one, "fresh"), Lie("etag", one, "unchecked")],
        "body-flipped": [Lie("body", one, flipped(here / SHARD1, _tensors_start(here / SHARD1)))],
        "body-gzip": [Lie("body", f"{model}/config.json", "gzip")],
        "body-cut": [Lie("body", two, "cut")],
        "body-stall": [Lie("body", two, "stall")],
        "body-index": [
            Lie("body", f"{model}/{INDEX}", json.dumps({"weight_map": {"a": "../../etc/passwd", "b": "/x"}}).encode())
        ],
        "body-modules": [
            Lie(
                "body",
                f"{model}/modules.json",
                json.dumps([{"path": p} for p in ["../..", "/etc", "a/b", "x\x00"]]).encode(),
            )
        ],
        "body-manifest": [Lie("body", f"{model}/tensors.sha256", b"not a manifest\n\x00\xff")],
        "redirect-loop": [Lie("redirect", one, "loop")],
        "redirect-metadata": [Lie("redirect", two, "http://169.254.169.254/latest/meta-data/")],
        "redirect-elsewhere": [Lie("redirect", one, f"/{model}/{SHARD2}")],
        "status-500-companion": [
            Lie("status", f"{model}/tokenizer.json", 500),
            Lie("status", f"{model}/config.json", 500),
        ],
        "status-403-shard": [Lie("status", two, 403)],
        "status-404-listing": [Lie("status", model, 404)],
        "listing-garbage": [Lie("listing", model, "garbage")],
        "listing-loop": [Lie("listing", model, "loop")],
        "listing-huge": [Lie("listing", model, "huge")],
        "listing-sizes": [Lie("listing", model, "sizes")],
        "listing-negative": [Lie("listing", model, "negative")],
        "listing-omitted": [Lie("listing", two, "omitted")],
        "names": [Lie("name", model, name) for name in HOSTILE_NAMES],
    }
    return table[kind]


ALL = tuple(COMMANDS)
LIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # a lie: (the APIs that can tell it, the commands that read what it is about)
    **{kind: (PROTOCOLS, ALL) for kind in (
        "size-smaller", "size-huge", "range-longer", "range-ignored", "range-shifted", "range-short", "etag-fresh",
        "etag-none", "etag-fresh-unchecked", "body-flipped", "body-cut", "body-stall", "redirect-loop",
        "redirect-metadata", "redirect-elsewhere", "status-403-shard",
    )},
    "size-index": (("http", "s3", "hub"), ALL),
    "body-index": (("http", "s3", "hub"), ALL),
    "body-gzip": (PROTOCOLS, ("mount", "export")),
    "body-modules": (("http",), ("mount", "export")),  # what modules.json names is looked for where nothing lists
    "body-manifest": (("http", "s3", "hub"), ("export", "validate", "prefetch")),  # the default manifest's readers
    "status-500-companion": (PROTOCOLS, ("mount", "export")),
    "status-404-listing": (("hub",), ("mount", "export")),
    "listing-garbage": (("s3", "hub", "s3-listed"), ("mount", "export", "validate")),
    "listing-loop": (("s3", "s3-listed"), ("mount", "export", "validate")),
    "listing-huge": (("s3", "hub", "s3-listed"), ("mount", "export", "validate")),
    "listing-sizes": (("s3", "hub", "s3-listed"), ("mount", "export", "validate")),
    "listing-negative": (("s3", "hub", "s3-listed"), ("mount", "export", "validate")),
    "listing-omitted": (("s3-listed",), ("validate", "mount", "loader")),
    "names": (("s3", "hub", "s3-listed"), ("mount", "export", "validate")),
}  # fmt: skip
"""Each lie of the suite: the APIs that can tell it (a listing's lies need a store that lists, an
index's a model with one) and the commands that read what it is about."""

SUITE_CASES = 2
"""How many cases each lie has in the suite (its APIs and commands taken in turn); `make fuzz` draws
from them all."""


def suite() -> list[tuple[str, str, str]]:
    cases = []
    for k, (kind, (protocols, commands)) in enumerate(LIES.items()):
        for j in range(SUITE_CASES):
            cases.append((kind, protocols[(k + j) % len(protocols)], commands[(k + 2 * j) % len(commands)]))
    return sorted(set(cases), key=cases.index)


SUITE = suite()


def run_case(
    lies: list[Lie], protocol: str, command: str, server: HostileServer, truth: Truth, work: Path,
    mounts: Mounts | None,
) -> None:  # fmt: skip
    """One command of a model told `lies` over one API: every rule of the module's docstring."""
    server.lies = lies
    server.etags.clear()
    try:
        at = place(protocol, server, work, mounts)
        run = COMMANDS[command](at, truth)
        print(f"{command} over {protocol}, told {lies!r:.300}: exit {run.code}\n{run.stderr}")  # shown if it fails
        check(run, at, truth, lies)
    finally:
        server.lies = []


@pytest.mark.parametrize(
    ("lie", "protocol", "command"),
    [pytest.param(*case, id="-".join(case), marks=[pytest.mark.mount] if case[2] == "mount" else []) for case in SUITE],
)
def test_a_lying_store(
    lie: str, protocol: str, command: str, server: HostileServer, truth: Truth, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """One lie of the table, told over one API, to one command that reads what it is about."""
    mounts = request.getfixturevalue("mounts") if command == "mount" else None
    run_case(lies_of(lie, truth, model_of(protocol)), protocol, command, server, truth, tmp_path, mounts)


# -- make fuzz: random lies, and random crafted files -----------------------------------------------


def lie_strategy(truth: Truth, model: str) -> st.SearchStrategy[Lie]:
    """One lie of any kind, about any file of `model` (or its listing), with a value drawn for it."""
    here = truth.root / model
    files = sorted(str(path.relative_to(truth.root)) for path in here.rglob("*") if path.is_file())
    shards = [f"{model}/{SHARD1}", f"{model}/{SHARD2}"]
    file = st.sampled_from(files)
    elsewhere = st.sampled_from(files).map(lambda path: f"/{path}")
    sizes = st.one_of(
        st.sampled_from([0, 1, 8, 1 << 44, 1 << 58, 2**63 - 1]),
        st.tuples(st.sampled_from(shards), st.integers(-4096, 4096)).map(
            lambda pair: max(0, (truth.root / pair[0]).stat().st_size + pair[1])
        ),
    )
    replaced = st.one_of(
        st.binary(max_size=300),
        st.sampled_from(shards).map(lambda shard: flipped(truth.root / shard, _tensors_start(truth.root / shard))),
        st.tuples(st.sampled_from(files), st.integers(0, 100_000)).map(
            lambda pair: (truth.root / pair[0]).read_bytes()[: pair[1]]
        ),
    )
    return st.one_of(
        st.builds(Lie, st.just("size"), file, sizes),
        st.builds(Lie, st.just("range"), file, st.one_of(st.integers(1, 70_000), st.sampled_from(["ignored", "shifted", "short"]))),
        st.builds(Lie, st.just("etag"), file, st.sampled_from(["fresh", "none", "unchecked", '"forged"', 'W/"weak"'])),
        st.builds(Lie, st.just("body"), file, st.one_of(st.sampled_from(["gzip", "cut", "stall"]), replaced)),
        st.builds(Lie, st.just("listing"), st.just(model), st.sampled_from(["garbage", "loop", "huge", "sizes", "negative"])),
        st.builds(Lie, st.just("listing"), file, st.just("omitted")),
        st.builds(Lie, st.just("name"), st.just(model), st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=20))),
        st.builds(
            Lie, st.just("redirect"), file,
            st.one_of(st.sampled_from(["loop", "http://169.254.169.254/latest/", "http://127.0.0.1:1/refused"]), elsewhere),
        ),
        st.builds(Lie, st.just("status"), st.one_of(file, st.just(model)), st.sampled_from([400, 401, 403, 404, 416, 500, 503])),
    )  # fmt: skip


def lies_told(draw: st.DrawFn, truth: Truth, model: str) -> list[Lie]:
    """One to three lies; where one gives a shard other bytes (or another file's), the manifest
    served beside the model is not lied about too (it is what export and prefetch hold bytes to)."""
    lies = draw(st.lists(lie_strategy(truth, model), min_size=1, max_size=3))
    other_bytes = any(
        (lie.what == "body" and isinstance(lie.value, bytes)) or (lie.what == "redirect" and lie.value.startswith("/"))
        for lie in lies
    )
    if other_bytes:
        lies = [lie for lie in lies if not lie.target.endswith("tensors.sha256") and lie.target != model] or lies[:1]
    return lies


@pytest.mark.fuzz
def test_random_lies(server: HostileServer, truth: Truth, tmp_path: Path, mounts: Mounts) -> None:
    """Lies drawn at random (one to three, of any kind, about any file or listing, over any API) told to
    a command drawn at random: every rule of the module's docstring, whatever the mix."""
    cases = iter(range(1_000_000))

    @fuzzing(6)
    @given(data=st.data(), protocol=st.sampled_from(PROTOCOLS), command=st.sampled_from(list(COMMANDS)))
    def case(data: st.DataObject, protocol: str, command: str) -> None:
        lies = data.draw(st.composite(lambda draw: lies_told(draw, truth, model_of(protocol)))())
        work = tmp_path / f"case{next(cases)}"
        work.mkdir()
        run_case(lies, protocol, command, server, truth, work, mounts if command == "mount" else None)

    case()


def crafted_base(kind: str, directory: Path) -> tuple[str, bytes]:
    """A well-formed file of a format (its name, its bytes) that the fuzz then damages."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors":
        tensors = {"w": ("F16", [4, 8], random_bytes(64, 5)), "x/y": ("I8", [3], b"abc"), "s": ("F64", [], bytes(8))}
        write_reference(directory / "model.safetensors", tensors, {"format": "pt"})
        return "model.safetensors", (directory / "model.safetensors").read_bytes()
    if kind == "gguf":
        from gguf_files import write_gguf

        write_gguf(
            directory / "model.gguf", {"tok": ("F32", [4, 32]), "blk.0.q": ("Q8_0", [2, 32])}, {"general.name": "x"}
        )
        return "model.gguf", (directory / "model.gguf").read_bytes()
    import torch

    state = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    state["tied"] = state["a.weight"]
    torch.save(state, directory / "pytorch_model.bin")
    return "pytorch_model.bin", (directory / "pytorch_model.bin").read_bytes()


@pytest.mark.fuzz
def test_random_crafted_files(server: HostileServer, truth: Truth, tmp_path: Path, mounts: Mounts) -> None:
    """Files of every format (safetensors, GGUF, a PyTorch zip, its pickle) with bytes changed at
    random and cut short, served by the store as they are, to a command drawn at random: every rule
    of the module's docstring; what a command hands out of a file it takes is the file's own bytes
    where the file's table says they are (what tensorfs reads of it locally)."""
    bases = {kind: crafted_base(kind, tmp_path / "bases" / kind) for kind in ("safetensors", "gguf", "zip")}
    cases = iter(range(1_000_000))

    @fuzzing(6)
    @given(
        kind=st.sampled_from(["safetensors", "gguf", "zip", "pickle"]),
        edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4),
        cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
        command=st.sampled_from(["validate", "ls", "export", "mount", "loader"]),
    )
    def case(kind: str, edits: list[tuple[int, int]], cut: int | None, command: str) -> None:
        from helpers import records_edited

        name, base = bases["zip" if kind == "pickle" else kind]
        data = bytearray(records_edited(base, "/data.pkl", edits) if kind == "pickle" else base)
        if kind != "pickle":
            for position, value in edits:
                data[position % len(data)] = value
            data = data[: cut % (len(data) + 1)] if cut is not None else data
        number = next(cases)
        served = truth.root / "crafted" / str(number)
        served.mkdir(parents=True)
        (served / name).write_bytes(bytes(data))
        work = tmp_path / f"case{number}"
        work.mkdir()
        at = Place(f"{server.url}/crafted/{number}/{name}", [*REMOTE, "--cache-dir", str(work / "cache")],
                   {**os.environ, "HF_ENDPOINT": server.url}, work, mounts if command == "mount" else None)  # fmt: skip
        print(f"{command} of a {kind} file, {edits} and cut at {cut}")  # shown if it fails
        run = crafted(COMMANDS[command], at, served / name)
        print(f"exit {run.code}\n{run.stderr}")

    case()


def crafted(command: Callable[[Place, Truth], Run], at: Place, local: Path) -> Run:
    """`command` of a crafted file: what it hands out is what tensorfs hands out of the same file
    read locally (each tensor's bytes where its table says, the export's files), or a refusal."""
    try:
        with tensorfs.open_model(local, cache=False) as model:
            tensors = {name: bytes(model.raw(name)) for name in model}
    except TensorfsError:
        tensors = {}
    exported = at.work / "local-export"
    at.cli("export", "--cache-dir", str(at.work / "local-cache"), str(local), str(exported))
    view = {str(p.relative_to(exported)): p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    own = Truth(local.parent, tensors, view, at.work / "local.sha256")
    own.manifest.write_text("".join(f"{sha(data)}  {name}\n" for name, data in tensors.items()))
    run = command(at, own)
    check(run, at, own, [])
    return run


# -- a hostile local user ----------------------------------------------------------------------------


def hung_mount(mounts: Mounts, at: Path, work: Path, undo: contextlib.ExitStack, binds: Collection[Path] = ()) -> int:
    """A tensorfs mount at `at` whose daemon is stopped (anything that asks it waits for good), and
    each of `binds` a bind mount of one of its files (made while it answers); its daemon's pid. What
    is undone at the end is `undo`'s (the daemon let go first, then the binds)."""
    other = work / "other"
    other.mkdir(exist_ok=True)
    write_reference(other / "o.safetensors", {"x": ("U8", [16], bytes(16))})
    at.mkdir(exist_ok=True)
    pid = mounts.daemon_pid(mounts.mount(other, mountpoint=at))
    for bind in binds:
        subprocess.run(["mount", "--bind", str(at / "x"), str(bind)], check=True, capture_output=True)
        undo.callback(subprocess.run, ["umount", "-l", str(bind)], check=False, capture_output=True)
    os.kill(pid, signal.SIGSTOP)
    undo.callback(os.kill, pid, signal.SIGCONT)
    return pid


def plant(what: str, model: Path, truth: Truth, work: Path, mounts: Mounts, undo: contextlib.ExitStack) -> int | None:
    """What another user leaves in a model's directory they can write (root runs the command): the
    stopped daemon's pid, where a plant is a hung mount (let go by `undo`). Plants are made of the
    truth, never of what another plant left (a FIFO)."""
    shard2 = (truth.root / MODEL / SHARD2).read_bytes()
    outside = work / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret.json"
    secret.write_text('{"root": "only"}')
    secret.chmod(0o600)
    if what == "fifo-companion":
        (model / "config.json").unlink()
        os.mkfifo(model / "config.json")
    elif what == "link-out-companion":
        (model / "tokenizer.json").unlink()
        (model / "tokenizer.json").symlink_to(secret)
    elif what == "links-by-thousands":
        for k in range(2000):
            (model / f"x{k:04d}.json").symlink_to(secret)
    elif what == "link-into-a-hung-mount":
        pid = hung_mount(mounts, outside / "hung", work, undo)
        (model / "vocab.txt").symlink_to(outside / "hung" / "x")
        return pid
    elif what == "a-hung-mount-on-files":  # the default manifest and a companion: files of a hung mount
        (model / "preprocessor_config.json").write_text("{}")
        files = [model / name for name in ("tensors.sha256", "preprocessor_config.json") if (model / name).is_file()]
        return hung_mount(mounts, outside / "hung-files", work, undo, files)
    elif what == "a-hung-mount-inside":
        return hung_mount(mounts, model / "onnx", work, undo)
    elif what == "fifo-manifest":
        (model / "tensors.sha256").unlink()
        os.mkfifo(model / "tensors.sha256")
    elif what == "link-out-shard":
        (outside / SHARD2).write_bytes(shard2)
        (model / SHARD2).unlink()
        (model / SHARD2).symlink_to(outside / SHARD2)
    elif what == "fifo-shard":
        (model / SHARD2).unlink()
        os.mkfifo(model / SHARD2)
    elif what == "index-out":
        (outside / "o.safetensors").write_bytes(shard2)
        weight_map = {"a": SHARD1, "b": SHARD1, "c": "../outside/o.safetensors", "d": "../outside/o.safetensors"}
        write_index(model, weight_map)
    elif what == "directory-as-companion":
        (model / "special_tokens_map.json").mkdir()  # a loader's name for a file, and a FIFO in it
        os.mkfifo(model / "special_tokens_map.json" / "x")
    elif what == "deep-and-hidden":  # a file of the folder two levels down (served); a git repository's (not)
        for path, data in SERVED_PLANTS[what].items():
            (model / path).parent.mkdir(parents=True, exist_ok=True)
            (model / path).write_bytes(data)
        (model / ".git").mkdir()
        (model / ".git" / "config").write_text("[core]")
    else:
        raise AssertionError(what)
    return None


SERVED_PLANTS: dict[str, dict[str, bytes]] = {"deep-and-hidden": {"a/b/c.json": b"{}"}}
"""What a plant puts in the folder that its view and export serve as the folder's own (issue 55)."""

LOCAL_COMMANDS = ("validate", "ls", "manifest", "verify", "export", "mount", "loader")
COMPANIONS_READ = ("mount", "export")
PLANTED: dict[str, tuple[str, ...]] = {
    # a plant: the commands that read what it is about
    **dict.fromkeys(
        ("fifo-companion", "link-out-companion", "links-by-thousands", "link-into-a-hung-mount",
         "directory-as-companion", "deep-and-hidden"),
        COMPANIONS_READ,
    ),
    "a-hung-mount-inside": ("validate", "mount", "export", "loader"),  # shards looked for, companions
    "a-hung-mount-on-files": ("export", "mount"),  # the default manifest, a companion
    "fifo-manifest": ("export", "mount"),  # the default manifest (the others are given --manifest)
    **dict.fromkeys(("link-out-shard", "fifo-shard", "index-out"), LOCAL_COMMANDS),
}  # fmt: skip
LOCAL_SUITE = [
    (what, commands[(k + j) % len(commands)]) for k, (what, commands) in enumerate(PLANTED.items()) for j in range(2)
]
"""Two commands that read what each plant is about, in the suite; make fuzz draws plants and commands
at random."""


def local_case(plants: list[str], command: str, truth: Truth, work: Path, mounts: Mounts) -> None:
    """`command` run as root on a copy of the truth in which another user planted `plants`."""
    model = work / "model"
    model.mkdir()
    for path in (truth.root / MODEL).rglob("*"):
        if path.is_file():
            (model / path.relative_to(truth.root / MODEL)).parent.mkdir(parents=True, exist_ok=True)
            (model / path.relative_to(truth.root / MODEL)).write_bytes(path.read_bytes())
    with contextlib.ExitStack() as undo:
        undo.callback(mounts.cleanup)  # the plants' mounts gone with the case (a fuzz's cases share the fixture)
        last = sorted(plants, key=lambda what: what == "a-hung-mount-on-files")  # nothing is planted on its mounts
        stopped = [pid for what in last if (pid := plant(what, model, truth, work, mounts, undo)) is not None]
        at = Place(str(model), ["--cache-dir", str(work / "cache")], dict(os.environ), work, mounts)
        run = COMMANDS[command](at, truth)
        print(f"{command} after {plants}: exit {run.code}\n{run.stderr[:3000]}")  # shown if it fails
        served = {path: data for what in last for path, data in SERVED_PLANTS.get(what, {}).items()}
        check(run, at, truth, [], stopped, served)


@pytest.mark.parametrize(("what", "command"), LOCAL_SUITE, ids=["-".join(case) for case in LOCAL_SUITE])
def test_a_hostile_local_user(what: str, command: str, truth: Truth, mounts: Mounts, tmp_path: Path) -> None:
    """One thing another user planted in the model's directory, met by one command run as root."""
    local_case([what], command, truth, tmp_path, mounts)


@pytest.mark.fuzz
def test_random_plants(truth: Truth, mounts: Mounts, tmp_path: Path) -> None:
    """Several things planted at once, met by a command drawn at random."""
    cases = iter(range(1_000_000))

    @fuzzing(3)
    @given(
        plants=st.sets(st.sampled_from(list(PLANTED)), min_size=1, max_size=4), command=st.sampled_from(LOCAL_COMMANDS)
    )
    def case(plants: set[str], command: str) -> None:
        work = tmp_path / f"case{next(cases)}"
        work.mkdir()
        local_case(sorted(plants), command, truth, work, mounts)

    case()


# -- what the harness found, each held by a test of its own -----------------------------------------


def test_a_status_is_read_from_the_answer_never_from_a_number_elsewhere_in_the_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed first GET whose text held "416" in the time it took (3.406712416 s) was taken for a
    416 (an empty object), and the HEAD asked then, failing too, left the command as a traceback."""
    import obstore

    from tensorfs.errors import RemoteError
    from tensorfs.sources.client import read_first_bytes
    from tensorfs.sources.store import ObjectRef, StoreSpec

    def failing(*_: object, **__: object) -> None:
        raise RuntimeError(
            "Generic HTTP error: Error performing GET http://127.0.0.1:9/m.safetensors in 3.406712416s, after "
            "16 retries - the connection was reset"
        )

    monkeypatch.setattr(obstore, "get", failing)
    monkeypatch.setattr(obstore, "head", failing)
    spec = StoreSpec("http", "http://127.0.0.1:9", "http://127.0.0.1:9", timeout=1)
    with pytest.raises(RemoteError, match=r"^http://127.0.0.1:9/m.safetensors: "):
        read_first_bytes(ObjectRef(spec, "m.safetensors"), lambda first, size: size)


@pytest.mark.parametrize(
    ("lie", "said"),
    [
        ("range-ignored", "the server ignored the byte range asked for (it sent the whole object): refused"),
        ("range-short", "the server sent bytes [0, 32768) for the [0, 65536) asked for: refused"),
        ("body-cut", "the answer ended before all its bytes came (the connection was cut)"),
        ("body-stall", "no answer within --remote-timeout (the store, or the connection to it, stalled)"),
    ],
)
def test_what_a_lying_answer_is_said_to_be(
    lie: str, said: str, server: HostileServer, truth: Truth, tmp_path: Path
) -> None:
    """What obstore says of an answer that is not the one asked for, said in words (it was its own
    debug text's first line: "Generic S3 error: Received non-partial response when range requested")."""
    server.lies = lies_of(lie, truth, MODEL)
    try:
        for protocol in ("http", "s3"):
            at = place(protocol, server, tmp_path / protocol, None)
            shard = f"{at.source.removesuffix('/' + INDEX)}/{SHARD2 if lie.startswith('body') else SHARD1}"
            done = at.cli("validate", *at.options, at.source)
            # A plain HTTP server that ignores ranges is one that cannot serve a model: said with what can.
            expected = RANGE_NEEDED if (lie, protocol) == ("range-ignored", "http") else said
            assert (done.returncode, done.stderr) == (1, f"error: {shard}: {expected}\n")
    finally:
        server.lies = []


def test_a_listing_the_client_gives_up_on_is_said_in_words(server: HostileServer, truth: Truth, tmp_path: Path) -> None:
    """A bucket holding a key that is no plain path ('n//etc/passwd'): obstore gives up on the whole
    listing. A model found by its listing is refused; one named by its index is read, its companions
    skipped; both in words (it was obstore's "Encountered object with invalid path: ...")."""
    server.lies = lies_of("names", truth, LISTED)
    said = (
        "the listing holds a key that is no plain path ('n//etc/passwd'), which the store's client refuses to list past"
    )
    try:
        at = place("s3-listed", server, tmp_path, None)
        done = at.cli("validate", *at.options, at.source)
        assert (done.returncode, done.stderr) == (1, f"error: s3://{LISTED}/: {said}\n")
        server.lies = lies_of("names", truth, MODEL)
        at = place("s3", server, tmp_path, None)
        done = at.cli("export", *at.options, f"{at.source}/{INDEX}", str(tmp_path / "out"))
        warning = f"warning: companion files skipped: s3://{MODEL}/: {said.replace('n//', 'm//')}\n"
        assert (done.returncode, done.stderr) == (0, warning)
    finally:
        server.lies = []


def test_a_listed_file_without_a_size_is_left_out(
    server: HostileServer, truth: Truth, mounts: Mounts, tmp_path: Path
) -> None:  # fmt: skip
    """The Hub's listing says -1 (or nothing, or true) for a file's size: the file is left out, with
    one warning (the export wrote it empty; the mount's view could not be listed: EIO)."""
    server.lies = lies_of("listing-negative", truth, MODEL)
    said = "skipped: the listing gives it no size, or a negative one (and 4 more files skipped: no size)"
    try:
        at = place("hub", server, tmp_path, mounts)
        done = at.cli("export", *at.options, at.source, str(tmp_path / "out"))
        assert (done.returncode, done.stderr) == (0, f"warning: hf://{MODEL}@main/config.json: {said}\n")
        assert sorted(os.listdir(tmp_path / "out")) == ["1_Pooling", SHARD1, SHARD2]  # its folder's file listed alone
        run = mount(at, truth)
        assert run.code == 0 and set(run.bytes_out) == {
            *truth.tensors,
            f"view/{SHARD1}",
            f"view/{SHARD2}",
            "view/1_Pooling/config.json",
        }
    finally:
        server.lies = []


def test_a_hub_folder_that_is_no_plain_name_is_never_asked_for(
    server: HostileServer, truth: Truth, tmp_path: Path
) -> None:
    """The Hub's listing names folders '/abs' and '../../../../../api/models/x' (and 'sub'): neither of the
    two is asked for (the first asked for failed the whole listing, quietly: the companions were then
    guessed at), and the names that are no plain path are one warning."""
    server.lies = lies_of("names", truth, MODEL)
    server.paths.clear()
    try:
        at = place("hub", server, tmp_path, None)
        done = at.cli("export", *at.options, at.source, str(tmp_path / "out"))
        assert done.returncode == 0, done.stderr
        assert done.stderr == (
            f"warning: hf://{MODEL}: '.': skipped: has a '.' path component (and 6 more files skipped: names that "
            "are not plain relative paths)\n"
        )
        listings = [path for path in server.paths if path.startswith("/api/")]
        tree = f"/api/models/{MODEL}/tree/main"
        # The top once to choose the model's files, once for its companions; 'sub' is a plain name.
        assert listings == [tree, tree, f"{tree}/1_Pooling", f"{tree}/sub"], listings
    finally:
        server.lies = []


def test_a_companion_that_cannot_be_read_is_said_of_once(server: HostileServer, truth: Truth, tmp_path: Path) -> None:
    """A listed companion the store refuses: one line naming its URL once (it was "config.json: URL: ...")."""
    server.lies = lies_of("status-500-companion", truth, MODEL)
    try:
        at = place("s3", server, tmp_path, None)
        done = at.cli("export", *at.options, at.source, str(tmp_path / "out"))
        assert (done.returncode, done.stderr.splitlines()[-1]) == (
            1, f"error: s3://{MODEL}/config.json: the server answered 500 Internal Server Error"
        )  # fmt: skip
        assert not (tmp_path / "out").exists()
    finally:
        server.lies = []


def test_an_export_is_held_to_the_manifest_beside_the_model(truth: Truth, tmp_path: Path) -> None:
    """An export hands tensors out as a mount does, and is held to the same manifest: tensors.sha256
    beside the model by default (it was held to none, and wrote a tensor the manifest refuses), or
    --manifest; --verify off, to none."""
    model = tmp_path / "model"
    model.mkdir()
    for name in (SHARD1, SHARD2, INDEX):
        (model / name).write_bytes((truth.root / MODEL / name).read_bytes())
    wrong = truth.manifest.read_text().replace(sha(truth.tensors["c"]), "0" * 64)
    (model / "tensors.sha256").write_text(wrong)
    at = Place(str(model), ["--cache-dir", str(tmp_path / "cache")], dict(os.environ), tmp_path, None)
    refused = at.cli("export", *at.options, str(model), str(tmp_path / "refused"))
    assert refused.returncode == 1 and not (tmp_path / "refused").exists()
    assert refused.stderr.count("\n") == 1 and f"{model / SHARD2}: tensor 'c': its bytes hash to" in refused.stderr
    for options in (["--manifest", str(truth.manifest)], ["--verify", "off"]):
        done = at.cli("export", *at.options, *options, str(model), str(tmp_path / options[0]))
        assert done.returncode == 0, done.stderr
        files = sorted((tmp_path / options[0]).glob("*.safetensors"))
        assert [file.name for file in files] == [SHARD1, SHARD2]  # the model's own files
        exported = {name: data for file in files for name, data in safetensors_tensors(file.read_bytes()).items()}
        assert exported == truth.tensors


def _answers(server: HostileServer, model: str, target: str) -> list[object]:
    """What the server answers to what can be asked of `target` and of the model's listings (status,
    the headers that say what the answer is, the body or what became of it), honestly or not."""
    import http.client

    found: list[object] = []
    bucket, _, prefix = model.partition("/")
    asks = [
        ("HEAD", f"/{target}", {}),
        ("GET", f"/{target}", {"Range": "bytes=0-65535"}),
        ("GET", f"/{target}", {}),
        ("GET", f"/{bucket}?list-type=2&prefix={prefix}/", {}),
        ("GET", f"/api/models/{model}/tree/main", {}),
    ]
    for method, path, headers in asks:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
        try:
            connection.request(method, path.replace("\0", "%00"), headers=headers)
            answer = connection.getresponse()
            said = {
                k: v
                for k, v in answer.getheaders()
                if k in ("Content-Length", "Content-Range", "ETag", "Location", "Content-Encoding")
            }
            found.append((answer.status, said, answer.read(4 << 20)))  # a lie may say 2^58 bytes
        except (OSError, http.client.HTTPException) as exc:
            found.append(type(exc).__name__)
        finally:
            connection.close()
    return found


@pytest.mark.parametrize("lie", list(LIES))
def test_each_lie_is_told(lie: str, server: HostileServer, truth: Truth) -> None:
    """Each lie of the suite changes what the server says of what it is about (a lie the server did
    not tell would let any command pass)."""
    model = model_of(LIES[lie][0][-1])
    lies = lies_of(lie, truth, model)
    target = next((one.target for one in lies if "." in one.target.rpartition("/")[2]), f"{model}/{SHARD1}")
    honest = _answers(server, model, target)
    server.lies = lies
    try:
        told = _answers(server, model, target)
    finally:
        server.lies = []
    assert told != honest
