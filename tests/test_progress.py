"""Every long operation shows its progress line on a terminal, and nothing elsewhere or with -q:
each command run with its stderr a pseudo-terminal, then -q there, then with stderr a pipe."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from signed_models import make_key, sign

from helpers import MIB, TENSORFS, cli, patience, random_bytes, write_reference
from servers import Nginx
from tensorfs.proof.manifest import DEFAULT_MANIFEST


def on_terminal(args: list[str], then: Callable[[], object] = lambda: None, timeout: float = 120) -> tuple[int, str]:
    """`tensorfs ARGS` with its stderr a pseudo-terminal (stdout a pipe): its exit code and what it
    wrote to the terminal. `then` runs once it has exited, before the terminal's last bytes are read
    (what a mount leaves running may hold the terminal until it is undone)."""
    primary, secondary = os.openpty()
    written: list[bytes] = []

    def read() -> None:  # until every holder of the terminal's other end has closed it (EIO)
        while True:
            try:
                chunk = os.read(primary, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            written.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    try:
        process = subprocess.Popen(
            [*TENSORFS, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=secondary
        )
    finally:
        os.close(secondary)
    reader.start()
    try:
        process.communicate(timeout=patience(timeout))
    finally:
        then()
    reader.join(patience(timeout))
    assert not reader.is_alive(), "the terminal is still held"
    os.close(primary)
    return process.returncode, b"".join(written).decode(errors="replace")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """Two shards and their manifest."""
    directory = tmp_path / "model"
    directory.mkdir()
    for shard in range(2):
        tensors = {f"s{shard}.t{n}": ("U8", [MIB], random_bytes(MIB, 10 * shard + n)) for n in range(3)}
        write_reference(directory / f"part{shard}.safetensors", tensors)
    manifest = cli("manifest", "--no-cache", "-o", str(directory / DEFAULT_MANIFEST), str(directory))
    assert manifest.returncode == 0, manifest.stderr
    return directory


def lines_of(label: str, terminal: str) -> list[str]:
    """The progress lines of `label` drawn on the terminal (each redrawn over the last, after a CR)."""
    return [part.strip() for part in terminal.split("\r") if part.startswith(label)]


def shows(args: Callable[[int], list[str]], labels: list[str], then: Callable[[], object] = lambda: None) -> None:
    """`tensorfs ARGS` (`args(n)` for the n-th run: each may need a DEST of its own) draws each
    label's progress line on a terminal, ending at its total; with -q nothing of it there; and
    nothing when stderr is a pipe. Each run does its work (exit 0)."""
    code, terminal = on_terminal(args(0), then)
    assert code == 0, terminal
    for label in labels:
        drawn = lines_of(label, terminal)
        assert drawn, f"{args(0)[0]}: no {label} line in {terminal!r}"
        done, _, total = drawn[-1].removeprefix(label).split("  ")[0].strip().partition(" / ")
        assert done.split()[0] == total.split()[0], drawn[-1]  # "2.0 MiB / 2.0 MiB", "2 / 2 shards"
    command, *rest = args(1)
    code, quiet = on_terminal([command, "-q", *rest], then)
    assert code == 0 and "\r" not in quiet and not any(lines_of(label, quiet) for label in labels), quiet
    try:
        piped = cli(*args(2))
    finally:
        then()
    assert piped.returncode == 0 and "\r" not in piped.stderr, piped.stderr
    assert not any(label in piped.stderr for label in labels), piped.stderr


def test_validate(model: Path) -> None:
    shows(lambda _: ["validate", "--no-cache", str(model)], ["validating"])


def test_manifest(model: Path) -> None:
    shows(lambda _: ["manifest", "--no-cache", str(model)], ["validating", "hashing"])


def test_verify(model: Path) -> None:
    shows(lambda _: ["verify", "--no-cache", str(model)], ["validating", "hashing"])


def test_verify_of_a_signed_model(model: Path, tmp_path: Path) -> None:
    """Held to a signature, every file hashed against it: the same lines."""
    (model / DEFAULT_MANIFEST).unlink()  # a signature is the model's manifest: none beside it
    private, public = make_key(tmp_path / "signer")
    sign(model, private)
    shows(
        lambda _: ["verify", "--no-cache", "--public-key", str(public), str(model)],
        ["validating", "hashing the signed files, once"],
    )


def test_export(model: Path, tmp_path: Path) -> None:
    """Verified first (--verify all: every tensor hashed), then written; a file DEST, and a directory."""
    shows(
        lambda n: ["export", "--verify", "all", str(model), str(tmp_path / f"out{n}")],
        ["validating", "hashing", "writing"],
    )
    one = next(model.glob("*.safetensors"))
    shows(lambda n: ["export", str(one), str(tmp_path / f"out{n}.safetensors")], ["validating", "writing"])


def test_prefetch(nginx: Nginx, tmp_path: Path) -> None:
    """The cache filled: each run into a cache of its own, so that each fetches."""
    directory = nginx.root / "progress"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"t": ("U8", [3 * MIB], random_bytes(3 * MIB, 1))})
    url = f"{nginx.url}/progress/m.safetensors"
    shows(lambda n: ["prefetch", url, "--cache-dir", str(tmp_path / f"cache{n}")], ["validating", "fetching"])


def test_a_mount_that_hashes(fuse: None, model: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()

    def unmount() -> None:
        if os.path.ismount(mountpoint):
            done = cli("umount", str(mountpoint))
            assert done.returncode == 0, done.stderr

    args = ["mount", "--no-cache", "--verify", "all", str(model), str(mountpoint)]
    shows(lambda _: args, ["validating", "hashing"], unmount)
