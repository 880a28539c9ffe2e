"""Signed models (OpenSSF Model Signing): models signed here with keys made here (model_signing's own
signing API; cryptography makes the keys), held to their signature through the loader, export and a
mount; every tampering refused in one line naming the file; and agreement with model_signing's own
verify on the same models, both ways."""

from __future__ import annotations

import base64
import datetime
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from model_signing import signing, verifying
from safetensors.numpy import save_file
from signed_models import SIGNED_SHARD, hashing_config, make_key, resign, sign

import tensorfs
import tensorfs.catalogue.tables
import tensorfs.opening.source
import tensorfs.proof.signed_bytes
import tensorfs.utils.identity
from conftest import Mounts
from helpers import MIB, cli, errno_of_reading, free_port, hub_api, remote_stats, scrape
from servers import HostileServer, Lie, Nginx, SeaweedFS
from tensorfs.opening.view_files import view_of
from tensorfs.sources.store import RemoteOptions


def library_accepts(model: Path, public: Path, signature: Path, *, sharded: bool = False) -> bool:
    """model_signing's own verify (it hashes every file). Its hashing configuration is named, not
    guessed: 1.1.1 cannot guess a sharded one back (the shard size comes back a float)."""
    config = verifying.Config().use_elliptic_key_verifier(public_key=public)
    try:
        config.set_hashing_config(hashing_config(sharded)).verify(model, signature)
    except Exception:  # its refusals are ValueErrors, and cryptography's and OpenSSL's own
        return False
    return True


def make_model(directory: Path) -> Path:
    """A signed-to-be model: two shards (a tensor of several signed ranges, small ones, an empty one),
    an index, config.json and a tokenizer in a subdirectory."""
    directory.mkdir()
    rng = np.random.default_rng(7)
    save_file(
        {"big": rng.random(5000, dtype=np.float32), "small": np.arange(7, dtype=np.int16)},
        directory / "model-00001-of-00002.safetensors",
    )
    save_file(
        {"head": rng.random((30, 20), dtype=np.float32), "empty": np.zeros((0, 3), dtype=np.float32)},
        directory / "model-00002-of-00002.safetensors",
    )
    weight_map = {
        "big": "model-00001-of-00002.safetensors",
        "small": "model-00001-of-00002.safetensors",
        "head": "model-00002-of-00002.safetensors",
        "empty": "model-00002-of-00002.safetensors",
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text('{"model_type": "test"}\n')
    (directory / "tokenizer").mkdir()
    (directory / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return directory


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return make_key(tmp_path / "signer")


def held(public: Path, location: Path | None = None) -> tensorfs.Signature:
    return tensorfs.Signature(public_key=public, location=location)


# -- opening a signed model --------------------------------------------------------------------------


class CountedHashing:
    """The bytes fed to SHA-256 by the checks of signed bytes (signed_bytes.py's hashlib)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        counter = self
        original = hashlib.sha256

        class Counted:
            def __init__(self, data: bytes = b"") -> None:
                self._hash = original()
                self.update(data)

            def update(self, data: Any) -> None:
                counter.bytes += memoryview(data).nbytes
                self._hash.update(data)

            def hexdigest(self) -> str:
                return self._hash.hexdigest()

        monkeypatch.setattr(tensorfs.proof.signed_bytes, "hashlib", SimpleNamespace(sha256=Counted))


def test_a_model_signed_by_files_is_hashed_once_then_opened_lazily(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each byte of a file signed whole is hashed once at open, for the file's digest: its tensors
    are proven by it, no digest of theirs taken (each byte went into two SHA-256s: the file's and
    its tensor's, 1.5x model_signing's verify-then-load). A later open knows the files by their
    identities: nothing hashed, nothing hashed when a tensor is read."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    hashed = CountedHashing(monkeypatch)
    cache = tmp_path / "cache"
    size = sum(path.stat().st_size for path in model.glob("*.safetensors"))
    companions = [path for path in model.rglob("*") if path.is_file() and path.suffix != ".safetensors"]
    size_of_others = sum(path.stat().st_size for path in companions if path.name != "model.sig")
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        integrity = opened.gate.integrity
        assert integrity.verified == {"big", "small", "head", "empty"}  # every shard hashed whole, once
        assert hashed.bytes == size + size_of_others and integrity.hasher.bytes_hashed == size  # each byte once
        assert set(integrity.expected or {}) == {"empty"}  # no tensor's value taken but the empty one's
        assert "public key signer.pub (sha256:" in integrity.signer
        assert integrity.label == f"the signature {model / 'model.sig'}"
        assert opened.array("small").tolist() == list(range(7)) and hashed.bytes == size + size_of_others
    hashed.bytes = 0
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        integrity = opened.gate.integrity
        assert integrity.verified == {"big", "small", "head", "empty"} and integrity.hasher.bytes_hashed == 0
        assert opened.array("small").tolist() == list(range(7))
        assert integrity.hasher.bytes_hashed == hashed.bytes == 0  # the files' identities: their signed bytes
        # A .sha256 asks for a value: the tensor hashed then (its file proven for this identity).
        assert opened.gate.integrity.digest("big") == hashlib.sha256(opened.raw("big")).hexdigest()


# -- a model signed by ranges: each range checked as its tensors are first read --------------------------

RANGED_TENSORS = 8
RANGED_ELEMENTS = 65536
"""The tensors of a model signed by ranges here: each 256 KiB of float32 (big enough for the hash
cache to keep its digest), over 64 signed ranges of 4 KiB."""


def make_ranged_model(directory: Path) -> Path:
    """One weights file of RANGED_TENSORS tensors t0, t1, ... in file order, metadata in its header,
    and config.json."""
    directory.mkdir()
    tensors = {f"t{i}": np.full(RANGED_ELEMENTS, i, dtype=np.float32) for i in range(RANGED_TENSORS)}
    save_file(tensors, directory / "model.safetensors", metadata={"note": "aaaa"})
    (directory / "config.json").write_text('{"model_type": "test"}\n')
    return directory


def tensor_offset(model: Path, name: str) -> int:
    """Where tensor `name`'s bytes begin in model.safetensors."""
    with tensorfs.open_model(model / "model.safetensors", cache=False) as opened:
        return opened.info(name).offset


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


class CountedReads:
    """The bytes read from the model's files to hash them (every check reads through Tables.readinto)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        original = tensorfs.catalogue.tables.Tables.readinto

        def counted(tables: tensorfs.catalogue.tables.Tables, shard: Any, offset: int, buffer: memoryview) -> None:
            self.bytes += len(buffer)
            original(tables, shard, offset, buffer)

        monkeypatch.setattr(tensorfs.catalogue.tables.Tables, "readinto", counted)

    def since(self) -> int:
        """The bytes read since the last call."""
        count, self.bytes = self.bytes, 0
        return count


def test_a_model_signed_by_ranges_is_checked_range_by_range_as_its_tensors_are_read(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    size = (model / "model.safetensors").stat().st_size
    nbytes = RANGED_ELEMENTS * 4
    reads = CountedReads(monkeypatch)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        # Opening read the range holding the header, nothing more.
        assert reads.since() == SIGNED_SHARD < size // 100
        assert opened.gate.integrity.expected == {}
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS
        # The 65 ranges holding t3's bytes, whole, read and hashed once, for the ranges' digests: they
        # prove t3, whose own digest is not taken (nothing needs it: no fallback, a local file).
        assert nbytes < reads.since() <= nbytes + 2 * SIGNED_SHARD
        assert opened.gate.integrity.verified == {"t3"}
        assert opened.gate.integrity.expected == {}
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        # A later open: the hash cache knew the header's range and t3's, for this identity of the file.
        assert reads.since() == 0
        assert opened.gate.integrity.verified == {"t3"}
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS
        assert reads.since() == 0  # its ranges were the cache's
        assert opened.array("t5").tolist() == [5.0] * RANGED_ELEMENTS
        assert nbytes < reads.since() <= nbytes + 2 * SIGNED_SHARD
    every = tensorfs.opening.source.Source.named(model, RemoteOptions(cache_dir=cache))
    with every.open(signature=held(public), verify="all") as opened:
        assert reads.since() == size  # --verify all: every range checked at open, whatever the cache knows
        assert opened.gate.integrity.verified == {f"t{i}" for i in range(RANGED_TENSORS)}


def test_readers_of_one_tensor_at_once_check_its_ranges_once(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four readers of a tensor not yet checked (a mount's reader and the kernel's reads ahead of it
    come together): each range holding its bytes is hashed once, the others waiting for it (each
    hashed it again: a signed mount of a model signed by ranges read at half the speed of an
    unsigned one). A handshake holds the first check until every reader has asked for its ranges."""
    import threading

    from tensorfs.proof.signed_bytes import SignedRanges

    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    target = tensor_offset(model, "t3") // SIGNED_SHARD + 1  # a range wholly inside t3
    readers = 4
    asked: list[int] = []
    everyone = threading.Event()
    checked: list[tuple[int, int]] = []
    shared, check = SignedRanges._shared, SignedRanges._check

    def counted_shared(
        self: SignedRanges, hasher: Any, shard: Any, first: int, last: int, *args: Any, **kw: Any
    ) -> Any:
        if first == last == target:
            asked.append(first)
            if len(asked) == readers:
                everyone.set()
        return shared(self, hasher, shard, first, last, *args, **kw)

    def held_check(self: SignedRanges, hasher: Any, shard: Any, first: int, last: int, *args: Any, **kw: Any) -> Any:
        if first == last == target:
            assert everyone.wait(timeout=60), "the other readers never asked"
        checked.append((first, last))
        return check(self, hasher, shard, first, last, *args, **kw)

    monkeypatch.setattr(SignedRanges, "_shared", counted_shared)
    monkeypatch.setattr(SignedRanges, "_check", held_check)
    with tensorfs.open_model(model, signature=held(public), cache=False) as opened:
        results: list[bool] = []

        def read() -> None:
            results.append(opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS)

        threads = [threading.Thread(target=read) for _ in range(readers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [True] * readers
    assert sorted(checked) == sorted(set(checked)), "a range was hashed more than once"
    assert (target, target) in checked


def test_a_byte_changed_in_one_signed_range_is_refused_when_its_tensor_is_read(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    weights = model / "model.safetensors"
    flip_byte(weights, tensor_offset(model, "t5") + RANGED_ELEMENTS * 2)  # in t5's own ranges
    with tensorfs.open_model(model, signature=held(public), cache=False) as opened:
        assert opened.array("t4").tolist() == [4.0] * RANGED_ELEMENTS  # its ranges are clean
        for _ in range(2):  # and again: refused as it was
            with pytest.raises(tensorfs.IntegrityError) as caught:
                opened.array("t5")
            said = str(caught.value)
            assert said.startswith(f"{weights}: tensor 't5': bytes [")
            assert " hash to " in said and f"as the signature {model / 'model.sig'} says" in said
            assert len(said.splitlines()) == 1
        assert opened.array("t6").tolist() == [6.0] * RANGED_ELEMENTS
    with tensorfs.safe_open(model, "np", signature=held(public), cache=False) as f:
        assert f.get_tensor("t0").tolist() == [0.0] * RANGED_ELEMENTS
        with pytest.raises(tensorfs.IntegrityError, match=r"tensor 't5': bytes \[\d+, \d+\) hash to"):
            f.get_tensor("t5")
    with pytest.raises(tensorfs.IntegrityError, match=r"tensor 't5': bytes \[\d+, \d+\) hash to"):
        tensorfs.load_file(model, framework="np", signature=held(public), cache=False)
    assert not library_accepts(model, public, model / "model.sig", sharded=True)


def test_a_tensor_of_a_changed_signed_range_is_not_served_from_a_fallback(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """Its signed digest was never established: nothing could hold a fallback's copy to it."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    flip_byte(model / "model.safetensors", tensor_offset(model, "t5") + RANGED_ELEMENTS * 2)
    other = tmp_path / "other"
    other.mkdir()
    forged = {f"t{i}": np.full(RANGED_ELEMENTS, 9, dtype=np.float32) for i in range(RANGED_TENSORS)}
    save_file(forged, other / "model.safetensors")
    with tensorfs.open_model(model, signature=held(public), cache=False, fallback=[other]) as opened:
        with pytest.raises(tensorfs.IntegrityError, match=r"tensor 't5': bytes \[\d+, \d+\) hash to"):
            opened.array("t5")
        assert opened.gate.copy("t5") is None
        assert opened.array("t4").tolist() == [4.0] * RANGED_ELEMENTS
        # A read of its file failed a moment ago: another tensor's would go to the fallback at once,
        # but an unproven one can go nowhere else: its own file is asked.
        opened.gate.failed(model / "model.safetensors")
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS
        assert opened.gate.copy("t3") is None


@pytest.mark.mount
def test_a_mount_refuses_a_tensor_of_a_changed_signed_range_and_serves_the_others(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    flip_byte(model / "model.safetensors", tensor_offset(model, "t5") + RANGED_ELEMENTS * 2)
    mountpoint = mounts.mount(model, "--public-key", str(public), "--no-cache")
    assert np.frombuffer((mountpoint / "t4").read_bytes(), np.float32).tolist() == [4.0] * RANGED_ELEMENTS
    with pytest.raises(OSError) as caught:
        (mountpoint / "t5").read_bytes()
    assert caught.value.errno == errno.EIO
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    with view.open("rb") as file, pytest.raises(OSError) as caught:  # the view's file: t5's bytes too
        file.read()
    assert caught.value.errno == errno.EIO
    assert np.frombuffer((mountpoint / "t6").read_bytes(), np.float32).tolist() == [6.0] * RANGED_ELEMENTS
    # Logged as what it is: a signed range's digest (not the tensor's own, said as a manifest's).
    said = f"{model / 'model.safetensors'}: tensor 't5': bytes ["
    assert said in mounts.log() and f"as the signature {model / 'model.sig'} says: refused (EIO)" in mounts.log()
    assert "does not match the manifest" not in mounts.log()


@pytest.mark.mount
def test_a_mounts_sums_of_a_model_signed_by_ranges_are_the_signed_bytes(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A .sha256 sidecar of a tensor not read yet, and SHA256SUMS, read first on a mount held to a
    signature of ranges: its ranges checked then, the values the bytes' own; a tensor of a changed
    range has EIO for its sidecar and for SHA256SUMS (its value never established)."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    names = [f"t{i}" for i in range(RANGED_TENSORS)]
    actual = {
        name: hashlib.sha256(np.full(RANGED_ELEMENTS, i, np.float32).tobytes()).hexdigest()
        for i, name in enumerate(names)
    }
    mountpoint = mounts.mount(model, "--public-key", str(public), "--no-cache")
    assert (mountpoint / "t6.sha256").read_text().split()[0] == actual["t6"]
    sums = (mountpoint / ".tensorfs" / "SHA256SUMS").read_text().splitlines()
    assert sorted(line.split()[0] for line in sums) == sorted(actual.values())
    flip_byte(model / "model.safetensors", tensor_offset(model, "t5") + RANGED_ELEMENTS * 2)
    again = mounts.mount(model, "--public-key", str(public), "--no-cache")
    assert (again / "t4.sha256").read_text().split()[0] == actual["t4"]
    for refused in (again / "t5.sha256", again / ".tensorfs" / "SHA256SUMS"):
        with pytest.raises(OSError) as caught:
            refused.read_bytes()
        assert caught.value.errno == errno.EIO, refused
    assert "bug" not in mounts.log()


@pytest.mark.mount
def test_a_header_changed_under_a_signature_of_ranges_is_refused_at_open(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"note":"aaaa"', b'"note":"bbbb"', 1))  # still a valid header
    assert weights.read_bytes() != data
    said = f"{weights}: bytes [0, {SIGNED_SHARD}) hash to "
    with pytest.raises(tensorfs.SignatureError) as caught:
        tensorfs.open_model(model, signature=held(public), cache=False)
    assert str(caught.value).startswith(said) and len(str(caught.value).splitlines()) == 1
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(model, "--public-key", str(public), "--no-cache", mountpoint=mountpoint)
    assert result.returncode != 0 and said in result.stderr
    assert not os.path.ismount(mountpoint)


def test_a_weight_changed_after_the_first_open_is_refused_by_the_next(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, signature=held(public), cache=cache):
        pass
    flip_last_byte(model / "model-00002-of-00002.safetensors")  # a new identity: the cache's row is not its
    with pytest.raises(tensorfs.SignatureError, match=r"model-00002-of-00002.safetensors: bytes hash to [0-9a-f]{64}"):
        tensorfs.open_model(model, signature=held(public), cache=cache)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- tampering: every way refused, through the loader, export and a mount, as model_signing refuses it ----


def weight_byte(model: Path, signature: Path, other: Path) -> str:
    flip_last_byte(model / "model-00001-of-00002.safetensors")
    return "model-00001-of-00002.safetensors: bytes"


def config_changed(model: Path, signature: Path, other: Path) -> str:
    (model / "config.json").write_text('{"model_type": "another"}\n')
    return "config.json: bytes hash to"


def file_added(model: Path, signature: Path, other: Path) -> str:
    (model / "tokenizer" / "merges.txt").write_text("a b\n")
    return "tokenizer/merges.txt: not covered by the signature"


def file_removed(model: Path, signature: Path, other: Path) -> str:
    (model / "tokenizer" / "vocab.txt").unlink()
    return "tokenizer/vocab.txt: signed, but not in the model"


def statement_edited(model: Path, signature: Path, other: Path) -> str:
    """The signed statement says another digest for config.json (the signature left as it was)."""
    bundle = json.loads(signature.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    for resource in statement["predicate"]["resources"]:
        if resource["name"] == "config.json":
            resource["digest"] = "0" * 64
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    signature.write_text(json.dumps(bundle))
    return "model.sig: does not verify with"


def another_key(model: Path, signature: Path, other: Path) -> str:
    """Signed again, by someone else's key: the model is as it was."""
    sign(model, other)
    return "model.sig: does not verify with"


def not_a_signature(model: Path, signature: Path, other: Path) -> str:
    signature.write_text('{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}')
    return "model.sig: not a model signature"


TAMPERINGS: list[Callable[[Path, Path, Path], str]] = [
    weight_byte,
    config_changed,
    file_added,
    file_removed,
    statement_edited,
    another_key,
    not_a_signature,
]


def tampered(tmp_path: Path, keys: tuple[Path, Path], tamper: Callable[[Path, Path, Path], str]) -> tuple[Path, str]:
    private, _ = keys
    other, _ = make_key(tmp_path / "other")
    model = make_model(tmp_path / "model")
    said = tamper(model, sign(model, private), other)
    return model, said


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda tamper: tamper.__name__)
def test_tampering_is_refused_by_the_loader(
    tmp_path: Path, keys: tuple[Path, Path], tamper: Callable[[Path, Path, Path], str]
) -> None:
    model, said = tampered(tmp_path, keys, tamper)
    with pytest.raises(tensorfs.SignatureError) as caught:
        tensorfs.load_file(model, framework="np", signature=held(keys[1]), cache=False)
    assert said in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda tamper: tamper.__name__)
def test_tampering_is_refused_by_export(
    tmp_path: Path, keys: tuple[Path, Path], tamper: Callable[[Path, Path, Path], str]
) -> None:
    model, said = tampered(tmp_path, keys, tamper)
    result = cli("export", str(model), str(tmp_path / "out"), "--public-key", str(keys[1]))
    assert result.returncode == 1 and result.stdout == ""
    assert said in result.stderr and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.mount
@pytest.mark.parametrize("tamper", [weight_byte, config_changed, file_added, another_key], ids=lambda t: t.__name__)
def test_tampering_is_refused_by_a_mount(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path], tamper: Callable[[Path, Path, Path], str]
) -> None:
    model, said = tampered(tmp_path, keys, tamper)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(model, "--public-key", str(keys[1]), "--no-cache", mountpoint=mountpoint)
    assert result.returncode != 0 and said in result.stderr
    assert not os.path.ismount(mountpoint)


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "shards"])
@pytest.mark.parametrize("tamper", [None, *TAMPERINGS], ids=lambda t: "untouched" if t is None else t.__name__)
def test_tensorfs_accepts_exactly_what_model_signing_accepts(
    tmp_path: Path,
    keys: tuple[Path, Path],
    tamper: Callable[[Path, Path, Path], str] | None,
    sharded: bool,
) -> None:
    private, public = keys
    other, _ = make_key(tmp_path / "other")
    model = make_model(tmp_path / "model")
    (model / "empty.txt").write_bytes(b"")  # signed by files; by ranges, named by none, and signed all the same
    signature = sign(model, private, sharded=sharded)
    if tamper is not None:
        if tamper is another_key:
            sign(model, other, sharded=sharded)
        else:
            tamper(model, signature, other)
    theirs = library_accepts(model, public, signature, sharded=sharded)
    result = cli("verify", str(model), "--public-key", str(public), "--no-cache")
    assert (result.returncode == 0) == theirs == (tamper is None), result.stderr


# -- the signature's own refusals ---------------------------------------------------------------------


def test_a_signature_must_be_there(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    model = make_model(tmp_path / "model")
    result = cli("validate", str(model), "--public-key", str(keys[1]))
    assert result.returncode == 1
    assert result.stderr == f"error: {model / 'model.sig'}: no signature here; name one (--signature FILE|URL)\n"


def test_a_signature_kept_apart_from_the_model(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A signature kept apart from the model: its files are the model's, none left out."""
    private, public = keys
    model = make_model(tmp_path / "model")
    apart = tmp_path / "apart.sig"
    sign(model, private, signature=apart)
    result = cli("validate", str(model), "--public-key", str(public), "--signature", str(apart))
    assert result.returncode == 0, result.stderr
    assert "signed by public key signer.pub (sha256:" in result.stdout and str(apart) in result.stdout


def test_the_verification_material_is_needed_once(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    model = make_model(tmp_path / "model")
    result = cli("ls", str(model), "--signature", str(model / "model.sig"))
    assert result.returncode == 2
    assert "a signature is verified with a public key or a certificate chain (one of them): neither" in result.stderr
    with pytest.raises(tensorfs.SignatureError, match="neither given"):
        tensorfs.Signature()
    result = cli("verify", str(model), "--public-key", str(keys[1]), "--manifest", str(model / "config.json"))
    assert result.returncode == 1
    assert result.stderr == f"error: {model}: a signature is the model's manifest: not with a manifest too\n"
    with pytest.raises(tensorfs.SignatureError, match="not with a manifest too"):
        tensorfs.open_model(model, signature=held(keys[1]), verify=True)


def test_a_key_that_is_no_key_is_named(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, _ = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    result = cli("ls", str(model), "--public-key", str(model / "config.json"))
    assert result.returncode == 1 and result.stderr.startswith(
        f"error: {model / 'config.json'}: cannot verify with it:"
    )
    assert len(result.stderr.splitlines()) == 1


# -- a certificate chain ---------------------------------------------------------------------------------


def certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None, *, ca: bool
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    return builder.sign(issuer_key, hashes.SHA256())


def write_pem(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def test_a_certificate_signed_model_is_held_to_its_chain(tmp_path: Path) -> None:
    root_key, leaf_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    root = write_pem(tmp_path / "root.pem", certificate("Test Root", root_key, None, ca=True))
    leaf = write_pem(tmp_path / "leaf.pem", certificate("Model Publisher", leaf_key, ("Test Root", root_key), ca=False))
    stranger = write_pem(tmp_path / "stranger.pem", certificate("Test Root", stranger_key, None, ca=True))
    private = tmp_path / "leaf.key"
    private.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    model = make_model(tmp_path / "model")
    config = signing.Config().set_hashing_config(hashing_config(False))
    config.use_certificate_signer(private_key=private, signing_certificate=leaf, certificate_chain=[root]).sign(
        model, model / "model.sig"
    )
    result = cli("validate", str(model), "--certificate-chain", str(root), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert "signed by certificate CN=Model Publisher" in result.stdout
    result = cli("validate", str(model), "--certificate-chain", str(stranger), "--no-cache")
    assert result.returncode == 1 and result.stderr.startswith(f"error: {model / 'model.sig'}: does not verify with")
    assert len(result.stderr.splitlines()) == 1


# -- a mount -------------------------------------------------------------------------------------------------


@pytest.mark.mount
def test_a_mount_serves_a_signed_model_and_its_signed_companions(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, sharded=True)
    port = free_port()
    mountpoint = mounts.mount(
        model, "--public-key", str(public), "--cache-dir", str(tmp_path / "cache"), "--metrics", str(port)
    )
    view = mountpoint / ".tensorfs" / "model"
    assert (view / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert (view / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert (view / "model.sig").read_bytes() == (model / "model.sig").read_bytes()  # the folder's, as it was verified
    assert np.frombuffer((mountpoint / "small").read_bytes(), np.int16).tolist() == list(range(7))
    # What the mount is held to, said by status, stats.json and the metrics.
    signer = tensorfs.open_model(model, signature=held(public), cache=False)
    with signer:
        held_to = {"signature": str(model / "model.sig"), "signer": signer.gate.integrity.signer}
    assert held_to["signer"].startswith("public key signer.pub (sha256:")
    assert json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())["integrity"]["signature"] == held_to
    status = [json.loads(line) for line in mounts.run("status", "--json").stdout.splitlines()]
    assert [entry["options"]["signature"] for entry in status if entry["mountpoint"] == str(mountpoint)] == [held_to]
    assert f"{model}, signed by {held_to['signer']}" in mounts.run("status").stdout
    labels = (("mountpoint", str(mountpoint)), ("signature", held_to["signature"]), ("signer", held_to["signer"]))
    assert scrape(port)[("tensorfs_signature_info", tuple(sorted(labels)))] == 1


@pytest.mark.mount
def test_a_companion_changed_under_a_mount_is_not_served(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    mountpoint = mounts.mount(model, "--public-key", str(public), "--no-cache")
    (model / "config.json").write_text('{"model_type": "evil"}\n')
    with pytest.raises(OSError) as caught:
        (mountpoint / ".tensorfs" / "model" / "config.json").read_bytes()
    assert caught.value.errno in (errno.EIO, errno.ESTALE)


# -- remote models ---------------------------------------------------------------------------------------


def put_tree(store: Any, prefix: str, directory: Path) -> None:
    """Every file of `directory`, subdirectories too, into a store under `prefix/`."""
    import obstore

    for path in sorted(directory.rglob("*")):
        if path.is_file():
            obstore.put(store, f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())


def test_a_signed_model_in_s3_is_held_to_its_signature(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, sharded=True)
    store = seaweedfs.store(bucket)
    put_tree(store, "signed", model)
    remote = RemoteOptions(endpoint_url=seaweedfs.endpoint, cache_dir=tmp_path / "cache")
    url = f"s3://{bucket}/signed"
    with tensorfs.open_model(url, signature=held(public), remote=remote) as opened:
        # Signed by ranges: at open, only the ranges holding a header are read (the second file's one
        # range holds it all: its tensors proven, no value of theirs taken: a later open checks the
        # ranges again); each tensor of the first is checked as it is read.
        integrity = opened.gate.integrity
        assert integrity.verified == {"head", "empty"} and set(integrity.expected or {}) == {"empty"}
        assert opened.array("small").tolist() == list(range(7))
        assert integrity.verified == {"small", "head", "empty"} and "big" not in (integrity.expected or {})
    common = ["--public-key", str(public), "--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "c2")]
    result = cli("export", url, str(tmp_path / "out"), *common)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert (tmp_path / "out" / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    # Each tampering in the bucket, refused in one line naming the object.
    import obstore

    obstore.put(store, "signed/config.json", b'{"model_type": "another"}\n')
    result = cli("export", url, str(tmp_path / "out2"), *common)
    assert result.returncode == 1 and result.stderr.startswith(
        f"error: s3://{bucket}/signed/config.json: not the file signed"
    )
    obstore.put(store, "signed/config.json", (model / "config.json").read_bytes())
    obstore.put(store, "signed/extra.txt", b"planted")
    with pytest.raises(tensorfs.SignatureError, match=rf"^s3://{bucket}/signed/extra.txt: not covered by the sig"):
        tensorfs.open_model(url, signature=held(public), remote=remote)
    obstore.delete(store, "signed/extra.txt")
    first = bytearray((model / "model-00001-of-00002.safetensors").read_bytes())
    first[len(first) // 2] ^= 0xFF  # in a range of "big" alone
    obstore.put(store, "signed/model-00001-of-00002.safetensors", bytes(first))
    again = RemoteOptions(endpoint_url=seaweedfs.endpoint, cache_dir=tmp_path / "cache3")
    with tensorfs.open_model(url, signature=held(public), remote=again) as opened:
        assert opened.array("small").tolist() == list(range(7))
        with pytest.raises(tensorfs.IntegrityError, match=r"model-00001-of-00002.safetensors: tensor 'big': bytes \["):
            opened.array("big")
    obstore.put(
        store, "signed/model-00001-of-00002.safetensors", (model / "model-00001-of-00002.safetensors").read_bytes()
    )
    weights = bytearray((model / "model-00002-of-00002.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    obstore.put(store, "signed/model-00002-of-00002.safetensors", bytes(weights))
    with pytest.raises(tensorfs.SignatureError, match=r"model-00002-of-00002.safetensors: bytes \[\d+, \d+\) hash"):
        tensorfs.open_model(url, signature=held(public), remote=remote)


def test_a_signed_model_over_http_is_held_to_its_signature(
    nginx: Nginx, tmp_path: Path, keys: tuple[Path, Path], request: pytest.FixtureRequest
) -> None:
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    name = request.node.name
    served = nginx.root / name
    shutil.copytree(model, served)
    try:
        index = f"{nginx.url}/{name}/model.safetensors.index.json"
        remote = RemoteOptions(cache_dir=tmp_path / "cache")
        with tensorfs.open_model(index, signature=held(public), remote=remote) as opened:
            assert opened.array("small").tolist() == list(range(7))
            assert opened.gate.integrity.label == f"the signature {nginx.url}/{name}/model.sig"
        flip_last_byte(served / "model-00001-of-00002.safetensors")
        with pytest.raises(tensorfs.SignatureError, match=r"model-00001-of-00002\.safetensors: bytes hash to"):
            tensorfs.open_model(index, signature=held(public), remote=RemoteOptions(cache_dir=tmp_path / "cache2"))
    finally:
        shutil.rmtree(served)


def test_a_signed_model_on_the_hub_is_held_to_its_signature(
    nginx: Nginx, tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same from a Hub repository (hf://, the Hub's API on nginx): model.sig is found in the
    repository and the loader held to it; a weight changed there is refused, naming its file."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    repo = "signed/hub-model"
    files = nginx.root / repo / "resolve" / "main"
    shutil.copytree(model, files)
    hub_api(nginx.root, repo, files)
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    try:
        remote = RemoteOptions(cache_dir=tmp_path / "cache")
        with tensorfs.open_model(f"hf://{repo}", signature=held(public), remote=remote) as opened:
            assert opened.array("small").tolist() == list(range(7))
            assert opened.gate.integrity.label.startswith("the signature ")
            assert opened.gate.integrity.label.endswith("/model.sig")
        flip_last_byte(files / "model-00001-of-00002.safetensors")
        with pytest.raises(tensorfs.SignatureError, match=r"model-00001-of-00002\.safetensors: bytes hash to"):
            tensorfs.open_model(f"hf://{repo}", signature=held(public), remote=RemoteOptions(cache_dir=tmp_path / "c2"))
    finally:
        shutil.rmtree(nginx.root / "signed")
        shutil.rmtree(nginx.root / "api" / "models" / "signed")


# -- what comes out of a mount or an export: the signed files, still signed --------------------------------


def signed_folder(directory: Path, private: Path, *, sharded: bool, by_library: bool = False) -> Path:
    """make_model's model with a variant beside it (a weights file that is not the model's), a hidden
    file three levels down and a file two levels down (the signature names them all), signed:
    through the hashing configuration of the tests (the signature left out, as model_signing's command
    line leaves it out), or `by_library` as model_signing's library signs with its defaults (nothing
    left out: its verify of the folder then names model.sig an extra file, unless told to leave it out)."""
    model = make_model(directory)
    save_file({"small": np.arange(7, dtype=np.float16)}, model / "model.fp16.safetensors")
    # What `hf download --local-dir` leaves (hidden, three levels down), and a file two levels down.
    (model / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("0123abcd\n")
    (model / "onnx" / "text_encoder").mkdir(parents=True)
    (model / "onnx" / "text_encoder" / "config.json").write_text("{}\n")
    if by_library:
        signing.Config().use_elliptic_key_signer(private_key=private).sign(model, model / "model.sig")
    else:
        sign(model, private, sharded=sharded)
    return model


def still_verifies(folder: Path, source: Path, public: Path, *, sharded: bool) -> None:
    """`folder` holds the source's files, each byte for byte, model.sig among them, and model_signing's
    own verify accepts it: its library (the signature left out of what it hashes), and for files
    signed whole its command line (1.1.1's cannot verify a signature of ranges, of the original either)."""
    names = sorted(path.relative_to(source).as_posix() for path in source.rglob("*") if path.is_file())
    assert sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()) == names
    for name in names:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    assert library_accepts(folder, public, folder / "model.sig", sharded=sharded)
    if not sharded:
        verified = cli_of("model_signing", "verify", "key", str(folder), "--signature", str(folder / "model.sig"),
                          "--public_key", str(public))  # fmt: skip
        assert verified.returncode == 0 and "Verification succeeded" in verified.stdout, verified.stdout


def cli_of(command: str, *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [str(Path(sys.executable).parent / command), *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.mount
@pytest.mark.parametrize("sharded", [False, True], ids=["files", "ranges"])
def test_a_signed_models_view_and_export_are_the_signed_files(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path], sharded: bool
) -> None:
    """The view of a signed model and its export are the signed folder: every file (the variant beside
    the model, served through a gate held to the signature too) under its own name with its own bytes,
    model.sig as it was verified; model_signing verifies both again. A selection's view is synthesized:
    its note and a warning say the signature does not cover it."""
    private, public = keys
    model = signed_folder(tmp_path / "model", private, sharded=sharded)
    common = ["--public-key", str(public), "--cache-dir", str(tmp_path / "cache")]
    view = mounts.mount(model, *common) / ".tensorfs" / "model"
    still_verifies(view, model, public, sharded=sharded)
    exported = mounts.run("export", *common, str(model), str(tmp_path / "exported"))
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    still_verifies(tmp_path / "exported", model, public, sharded=sharded)
    selected = mounts.run("export", *common, "--include", "small", str(model), str(tmp_path / "selected"))
    assert selected.returncode == 0, selected.stderr
    assert selected.stderr == (
        f"warning: the view of {model} is synthesized (a selection of the model's tensors (--include 'small')): "
        f"the signature {model / 'model.sig'} covers the model's files, not the view's\n"
    )
    note = json.loads((tmp_path / "selected" / "tensorfs-view.json").read_text())
    assert note["signature"] == f"the signature {model / 'model.sig'} covers the source's files, not these"
    assert not (tmp_path / "selected" / "model.sig").exists()


@pytest.mark.mount
def test_a_signature_replaced_after_the_mount_is_served_as_it_was_verified(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """model.sig replaced (and then written in place) under a signed mount: the view serves the bytes
    that were verified, as docs/signing.md says, and model_signing still verifies the view (it was
    EIO at d4c56fe)."""
    private, public = keys
    model = signed_folder(tmp_path / "model", private, sharded=False)
    verified = (model / "model.sig").read_bytes()
    view = mounts.mount(model, "--public-key", str(public), "--no-cache") / ".tensorfs" / "model"
    other = tmp_path / "other.sig"
    other.write_bytes(b"x" * len(verified))
    other.replace(model / "model.sig")  # another file under its name
    assert (view / "model.sig").read_bytes() == verified
    (model / "model.sig").write_bytes(b"y" * len(verified))  # and its bytes written in place
    assert (view / "model.sig").read_bytes() == verified
    assert library_accepts(view, public, view / "model.sig")  # the view, as it was signed


@pytest.mark.mount
def test_a_signed_models_variant_is_held_to_the_signature_in_its_view(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """The variant beside a signed model is served through a gate of its own, held to the signature
    as the model is: a byte of its tensor changed under the mount is refused (EIO, logged), the
    model's files served on."""
    from tensorfs.opening.source import Source

    private, public = keys
    model = signed_folder(tmp_path / "model", private, sharded=True)
    source = Source.named(model, caches=False)
    with source.open(signature=held(public)) as opened:
        spec, others = view_of(source, opened)
        try:
            assert [other.signed for other in others.models] == [opened.signed]  # the model's signature
            assert spec.weights["model.fp16.safetensors"][0] == 1  # the first other model's
        finally:
            others.close()
    view = mounts.mount(model, "--public-key", str(public), "--no-cache") / ".tensorfs" / "model"
    variant = model / "model.fp16.safetensors"
    flip_byte(variant, tensor_offset_of(variant, "small"))
    with pytest.raises(OSError) as caught:
        (view / "model.fp16.safetensors").read_bytes()
    assert caught.value.errno == errno.EIO
    assert (view / "model-00001-of-00002.safetensors").read_bytes() == (
        model / "model-00001-of-00002.safetensors"
    ).read_bytes()
    assert "model.fp16.safetensors: tensor 'small': bytes [" in mounts.log()  # the file, the tensor, the range


def tensor_offset_of(file: Path, name: str) -> int:
    with tensorfs.open_model(file, cache=False) as opened:
        return opened.info(name).offset


@pytest.mark.mount
@pytest.mark.parametrize("by_library", [False, True], ids=["cli-config", "library-defaults"])
def test_a_signed_model_from_s3_is_the_signed_folder_in_its_view_and_export(
    mounts: Mounts,
    seaweedfs: SeaweedFS,
    bucket: str,
    tmp_path: Path,
    keys: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    by_library: bool,
) -> None:
    """A signed model in a bucket, model.sig beside it: signed as the command line signs (the signature
    left out) or with the library's defaults (nothing left out: the signature is still never a file it
    must cover). Its view and its export are the signed files, which model_signing verifies again."""
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    private, public = keys
    model = signed_folder(tmp_path / "model", private, sharded=False, by_library=by_library)
    put_tree(seaweedfs.store(bucket), f"signed-{by_library}", model)
    url = f"s3://{bucket}/signed-{by_library}"
    common = ["--public-key", str(public), "--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "c")]
    view = mounts.mount(url, *common) / ".tensorfs" / "model"  # type: ignore[arg-type]
    still_verifies(view, model, public, sharded=False)
    exported = cli("export", url, str(tmp_path / "exported"), *common)
    assert exported.returncode == 0, exported.stderr
    still_verifies(tmp_path / "exported", model, public, sharded=False)


# -- the paths a user types ------------------------------------------------------------------------------


@pytest.mark.mount
@pytest.mark.parametrize("how", ["relative", "dotdot", "symlinked", "pipeline"])
def test_a_model_signed_by_ranges_mounts_by_the_path_a_user_types(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path], how: str
) -> None:
    """docs/signing.md's `tensorfs mount m2 mnt --public-key k.pub`, run in the model's parent
    directory with a cold hash cache: the model named relatively (or through `..`, or through a
    symlinked directory; or a pipeline's root) is held to its signature of ranges, and every tensor
    and .sha256 is served (the daemon leaves the working directory: the signed files were keyed by
    the path as typed, then looked up by its absolute form, and every tensor answered EIO)."""
    private, public = keys
    work = tmp_path / "work"
    work.mkdir()
    if how == "pipeline":
        model = work / "m2"
        model.mkdir()
        make_ranged_model(model / "unet")
        (model / "unet" / "model.safetensors").rename(model / "unet" / "diffusion_pytorch_model.safetensors")
        (model / "model_index.json").write_text('{"unet": ["diffusers", "UNet2DModel"]}\n')
    else:
        model = make_ranged_model(work / "m2")
    sign(model, private, sharded=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link").symlink_to(work, target_is_directory=True)
    cwd, name = {
        "relative": (work, "m2"),
        "dotdot": (work / "m2", "../m2"),
        "symlinked": (tmp_path / "elsewhere", "link/m2"),
        "pipeline": (work, "m2"),
    }[how]
    mountpoint = mounts.mount(name, "--public-key", str(public), "--cache-dir", str(tmp_path / "cold"), cwd=cwd)
    with tensorfs.open_model(model, cache=False) as opened:
        expected = {tensor: bytes(opened.raw(tensor)) for tensor in opened}
    assert len(expected) == RANGED_TENSORS
    for tensor, data in expected.items():
        assert (mountpoint / tensor).read_bytes() == data, tensor
        assert (mountpoint / f"{tensor}.sha256").read_text().split()[0] == hashlib.sha256(data).hexdigest()
    assert "bug in" not in mounts.log() and "Traceback" not in mounts.log()


def test_bytes_a_signature_refused_are_fetched_again(
    hostile: HostileServer, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A model signed by ranges over HTTP, from a store that lies once: other bytes in a tensor's
    range are refused when it is read, and in the range of the header at open; once the store is
    honest again (same URL, same ETag) the same cache serves the signed bytes: what a signature
    refused was not kept (it was, and the model stayed refused until the cache was cleared)."""
    private, public = keys
    model = make_ranged_model(hostile.root / "m")
    sign(model, private, sharded=True)
    url = f"{hostile.url}/m/model.safetensors"
    remote = RemoteOptions(cache_dir=tmp_path / "cache")
    served = (model / "model.safetensors").read_bytes()
    t3 = tensor_offset(model, "t3")
    lied = bytearray(served)
    lied[t3 + 100] ^= 0xFF  # in a range of t3 alone
    hostile.lies.append(Lie("body", "m/model.safetensors", bytes(lied)))
    signature = tensorfs.Signature(public_key=public, location=model / "model.sig")
    with tensorfs.open_model(url, signature=signature, remote=remote, cache=False) as opened:
        with pytest.raises(tensorfs.IntegrityError, match=r"tensor 't3': bytes \["):
            opened.array("t3")
        hostile.lies.clear()
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS
    header = bytearray(served)
    end = 8 + int.from_bytes(served[:8], "little")
    assert header[end - 1 : end] == b" "  # the writer's padding
    header[end - 1] = ord("\t")  # the header's JSON as valid, one byte of it another
    hostile.lies.append(Lie("body", "m/model.safetensors", bytes(header)))
    again = RemoteOptions(cache_dir=tmp_path / "cache-2")
    with pytest.raises(tensorfs.SignatureError, match=r"bytes \[0, \d+\) hash to"):
        tensorfs.open_model(url, signature=signature, remote=again, cache=False)
    hostile.lies.clear()
    with tensorfs.open_model(url, signature=signature, remote=again, cache=False) as opened:
        assert opened.array("t0").tolist() == [0.0] * RANGED_ELEMENTS


@pytest.mark.mount
def test_readers_of_a_stalled_range_signed_model_each_wait_one_timeout(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """Five readers of tensors of a model signed by ranges, over HTTP, whose every body stalls (its
    header and signature read at the mount): one chunk's fetch, and the checks of the ranges the
    readers need, are waited on by all; each reader is answered (EIO) once that fetch fails, one
    --remote-timeout after, and no second fetch of it is made for those still waiting (the slowest
    was answered after two: the checks of its ranges began again when the first failed)."""
    private, public = keys
    model = make_ranged_model(hostile.root / "m")
    sign(model, private, sharded=True)
    mountpoint = mounts.mount(
        f"{hostile.url}/m/model.safetensors",
        *("--public-key", str(public), "--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "6"),
        *("--chunk-mb", "1"),  # the header's chunk (t0-t3) fetched at the mount; t4-t7 in the next
    )
    hostile.lies.append(Lie("body", "m/model.safetensors", "stall"))
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda name: errno_of_reading(mountpoint / name), ["t4", "t5", "t6", "t7", "t5"]))
    assert answers == [errno.EIO] * 5
    assert remote_stats(mountpoint)["fetch_failures"] == 1  # one fetch failed, and answered every reader


@pytest.mark.mount
@pytest.mark.parametrize("sharded", [False, True], ids=["files", "ranges"])
def test_an_offline_remount_of_a_signed_model_asks_the_store_nothing(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, keys: tuple[Path, Path], sharded: bool
) -> None:
    """A signed model over HTTP, mounted once (its signature read, kept in the cache with the chunks),
    then with --offline: held to the same signature, every tensor served, and no request made of
    the store (it asked for model.sig, and was refused after --remote-timeout)."""
    private, public = keys
    model = make_model(hostile.root / "m")
    sign(model, private, sharded=sharded)
    url = f"{hostile.url}/m/model.safetensors.index.json"
    common = ["--public-key", str(public), "--cache-dir", str(tmp_path / "cache"), "--remote-timeout", "5"]
    online = mounts.mount(url, *common)  # type: ignore[arg-type]
    names = ["big", "small", "head", "empty"]
    expected = {name: (online / name).read_bytes() for name in names}
    assert cli("umount", str(online)).returncode == 0
    hostile.requests.clear()
    offline = mounts.mount(url, *common, "--offline")  # type: ignore[arg-type]
    assert {name: (offline / name).read_bytes() for name in names} == expected
    assert "signed by" in cli("status", str(offline)).stdout
    assert hostile.requests == []


# -- what a statement may say, and how a refusal says it -------------------------------------------------


def resources_of(statement: dict[str, Any]) -> list[dict[str, str]]:
    resources: list[dict[str, str]] = statement["predicate"]["resources"]
    return resources


def test_a_statement_naming_a_file_twice_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """config.json named twice, a false digest first: model_signing's reader keeps the last (and its
    verify passes); tensorfs refuses the statement, naming the file."""
    private, public = keys
    model = make_model(tmp_path / "model")

    def twice(statement: dict[str, Any]) -> None:
        config = next(r for r in resources_of(statement) if r["name"] == "config.json")
        resources_of(statement).insert(0, {**config, "digest": "0" * 64})

    resign(sign(model, private), private, twice)
    with pytest.raises(tensorfs.SignatureError, match=r"model.sig: its statement names config.json twice"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_a_range_of_no_bytes_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A statement of ranges with a range of no bytes (any digest): model_signing's verify refuses it,
    and so do validate and mount (they took it)."""
    private, public = keys
    model = make_model(tmp_path / "model")

    def empty_range(statement: dict[str, Any]) -> None:
        resources_of(statement).append(
            {"name": "model-00001-of-00002.safetensors:100:100", "algorithm": "sha256", "digest": "0" * 64}
        )

    resign(sign(model, private, sharded=True), private, empty_range)
    result = cli("validate", str(model), "--public-key", str(public), "--no-cache")
    assert (
        result.returncode == 1
        and "signs bytes [100, 100) of model-00001-of-00002.safetensors: no bytes" in result.stderr
    )
    assert not library_accepts(model, public, model / "model.sig", sharded=True)


def test_ranges_that_do_not_tile_a_file_are_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A statement of ranges that leaves a gap in a file (one of its ranges taken out): the file is not
    the one signed, said at open."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")

    def gap(statement: dict[str, Any]) -> None:
        ranged = [r for r in resources_of(statement) if r["name"].startswith("model.safetensors:")]
        resources_of(statement).remove(ranged[len(ranged) // 2])

    resign(sign(model, private, sharded=True), private, gap)
    with pytest.raises(
        tensorfs.SignatureError, match=r"not the file signed: the signature's ranges of it are not contiguous"
    ):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_bytes_after_a_range_signed_files_last_range_are_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """Bytes appended to a file signed by ranges (config.json, which nothing else validates): its
    ranges still hash as signed, and its size says it is not the file signed."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, sharded=True)
    size = (model / "config.json").stat().st_size
    with (model / "config.json").open("ab") as file:
        file.write(b" ")
    with pytest.raises(tensorfs.SignatureError) as caught:
        tensorfs.open_model(model, signature=held(public), cache=False)
    assert str(caught.value) == (
        f"{model / 'config.json'}: not the file signed: it is {size + 1} bytes; the signature says {size} "
        f"(the signature {model / 'model.sig'})"
    )


def test_a_malformed_statement_is_said_to_be_one(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """Signed as it is, with no serialization: the signature verifies, its statement is malformed (it
    was said not to verify, in Python's words: "'serialization'")."""
    private, public = keys
    model = make_model(tmp_path / "model")
    resign(sign(model, private), private, lambda statement: statement["predicate"].pop("serialization"))
    with pytest.raises(tensorfs.SignatureError) as caught:
        tensorfs.open_model(model, signature=held(public), cache=False)
    assert str(caught.value) == f"{model / 'model.sig'}: its statement is malformed: it has no 'serialization'"


def test_a_refusal_names_the_first_files_then_counts_the_others(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A statement naming 50 files the model lacks: ten lines naming them, then how many more (a
    million made a million lines)."""
    private, public = keys
    model = make_model(tmp_path / "model")

    def lacking(statement: dict[str, Any]) -> None:
        resources_of(statement).extend(
            {"name": f"gone/{k:03d}.json", "algorithm": "sha256", "digest": "0" * 64} for k in range(50)
        )

    resign(sign(model, private), private, lacking)
    result = cli("validate", str(model), "--public-key", str(public), "--no-cache")
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 11, result.stderr
    assert lines[0] == f"error: {model / 'gone' / '000.json'}: signed, but not in the model"
    assert lines[-1] == "error: ... and 40 more"


def test_a_signature_too_large_is_refused_before_it_is_read(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorfs.proof.manifest
    from tensorfs.proof.signature import MAX_SIGNATURE_BYTES

    model = make_model(tmp_path / "model")
    with open(model / "model.sig", "wb") as sig:  # sparse: costs nothing
        sig.truncate(MAX_SIGNATURE_BYTES + 1)

    def never(*args: object) -> bytes:
        raise AssertionError("read")

    monkeypatch.setattr(tensorfs.proof.manifest, "read_bounded", never)
    with pytest.raises(tensorfs.SignatureError, match=r"model.sig: over 256 MiB, too large to be a signature"):
        tensorfs.open_model(model, signature=held(keys[1]), cache=False)


def test_a_changed_signature_over_unchanged_files_is_not_taken_from_the_hash_cache(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash cache knows each file matched the signature it was opened with; a signature that says
    otherwise of the same files is held to what it says (each row keyed by what the signature said)."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
    private, public = keys
    model = make_model(tmp_path / "model")
    signature = sign(model, private)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, signature=held(public), cache=cache):
        pass  # every file hashed and found to match: remembered

    def other_weights(statement: dict[str, Any]) -> None:
        for resource in resources_of(statement):
            if resource["name"] == "model-00002-of-00002.safetensors":
                resource["digest"] = "1" * 64

    resign(signature, private, other_weights)
    with pytest.raises(tensorfs.SignatureError, match=r"model-00002-of-00002.safetensors: bytes hash to"):
        tensorfs.open_model(model, signature=held(public), cache=cache)


def test_a_signature_verified_before_with_the_same_key_is_not_verified_again(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A second open of a model held to the same signature with the same key takes what the
    signature says from the cache (no model_signing imported: it cost more than a warm open of the
    model); a key, or a signature, changed by a byte is verified again, and refused if it does not
    verify. Each open in a process of its own, as a user's."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    cache = tmp_path / "cache"
    opening = (
        "import sys, tensorfs\n"
        f"signature = tensorfs.Signature(public_key=sys.argv[1])\n"
        f"with tensorfs.open_model({str(model)!r}, signature=signature, cache={str(cache)!r}) as opened:\n"
        "    print(opened.gate.integrity.signer, 'model_signing' in sys.modules)\n"
    )

    def opened_with(key: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", opening, str(key)], capture_output=True, text=True, check=False)

    first, second = opened_with(public), opened_with(public)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.endswith(" True\n") and second.stdout.endswith(" False\n")  # verified, then remembered
    assert first.stdout.rsplit(" ", 1)[0] == second.stdout.rsplit(" ", 1)[0]  # the same signer said
    other = make_key(tmp_path / "other")[1]
    refused = opened_with(other)
    assert refused.returncode != 0 and "does not verify with" in refused.stderr, refused.stderr
    # The signature changed by a byte (its statement's own), signed again by the same key: verified again.
    resign(model / "model.sig", private, lambda statement: statement["predicate"].update(note="x"))
    again = opened_with(public)
    assert again.returncode == 0 and again.stdout.endswith(" True\n"), again.stderr


def test_a_signature_with_verify_off_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    model = make_model(tmp_path / "model")
    sign(model, keys[0])
    result = cli("export", str(model), str(tmp_path / "out"), "--public-key", str(keys[1]), "--verify", "off")
    assert (result.returncode, result.stderr) == (
        1,
        f"error: {model}: a signature is the model's manifest: not with --verify off too\n",
    )


def test_an_empty_file_of_a_model_signed_by_ranges_is_signed_as_model_signing_says(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """model_signing's shard serializer names no range of an empty file, and its verify accepts the
    model: so does tensorfs (it called the file unsigned); the view serves it."""
    private, public = keys
    model = make_model(tmp_path / "model")
    (model / "empty.txt").write_bytes(b"")
    signature = sign(model, private, sharded=True)
    assert library_accepts(model, public, signature, sharded=True)
    result = cli("verify", str(model), "--public-key", str(public), "--no-cache")
    assert result.returncode == 0, result.stderr
    exported = cli("export", str(model), str(tmp_path / "out"), "--public-key", str(public))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "empty.txt").read_bytes() == b""


def test_what_a_signed_model_in_s3_lacks_or_cannot_list_is_refused(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed file one level down deleted from the bucket: refused by the library (its listing says
    it is not there); a prefix of more objects than a listing takes: its cut listing is never compared
    with the signature as if it were the whole (a present model.safetensors was called "signed, but
    not in the model")."""
    import obstore

    import tensorfs.sources.client
    import tensorfs.sources.finding

    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    store = seaweedfs.store(bucket)
    put_tree(store, "deep", model)
    remote = RemoteOptions(endpoint_url=seaweedfs.endpoint, cache_dir=tmp_path / "cache")
    with tensorfs.open_model(f"s3://{bucket}/deep", signature=held(public), remote=remote):
        pass
    obstore.delete(store, "deep/tokenizer/vocab.txt")
    with pytest.raises(tensorfs.SignatureError, match=r"deep/tokenizer/vocab.txt: signed, but not in the model"):
        tensorfs.open_model(f"s3://{bucket}/deep", signature=held(public), remote=remote)
    put_tree(store, "cut", model)
    monkeypatch.setattr(tensorfs.sources.client, "MAX_LISTED", 3)
    monkeypatch.setattr(tensorfs.sources.finding, "MAX_LISTED", 3)
    with pytest.raises(tensorfs.SignatureError) as caught:
        tensorfs.open_model(f"s3://{bucket}/cut", signature=held(public), remote=remote)
    assert str(caught.value) == (
        f"s3://{bucket}/cut/: over 3 objects: its listing, cut there, is not the whole: the signature "
        f"s3://{bucket}/cut/model.sig cannot be checked against it"
    )


def test_a_signed_companion_missing_beside_a_model_over_http_is_refused(
    nginx: Nginx, tmp_path: Path, keys: tuple[Path, Path], request: pytest.FixtureRequest
) -> None:
    """Over plain HTTP nothing lists: the files a signature names are asked for by name, so a signed
    companion that is not there (tokenizer/vocab.txt, config.json) is said to be missing when the
    model's view is made (an export), not passed over."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    served = nginx.root / request.node.name
    shutil.copytree(model, served)
    index = f"{nginx.url}/{request.node.name}/model.safetensors.index.json"
    common = ["--public-key", str(public), "--cache-dir", str(tmp_path / "cache")]
    done = cli("export", index, str(tmp_path / "whole"), *common)
    assert done.returncode == 0, done.stderr
    assert (
        tmp_path / "whole" / "tokenizer" / "vocab.txt"
    ).read_bytes() == b"a\nb\n"  # asked for: the signature names it
    (served / "tokenizer" / "vocab.txt").unlink()
    done = cli("export", index, str(tmp_path / "out"), *common)
    assert (done.returncode, done.stderr) == (
        1,
        f"error: tokenizer/vocab.txt: signed, but not beside the model ({nginx.url}/{request.node.name}/model.sig)\n",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.mount
def test_a_signature_beside_a_model_mounted_without_a_key_is_said_unverified(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    model = make_model(tmp_path / "model")
    sign(model, keys[0])
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    done = mounts.attempt(model, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
    assert done.returncode == 0, done.stderr
    assert (
        done.stderr.count("not verified") == 1 and f"warning: {model / 'model.sig'}: a signature beside" in done.stderr
    )
    assert f"{model}; model.sig not verified" in cli("status", str(mountpoint)).stdout
    assert (mountpoint / ".tensorfs" / "model" / "model.sig").read_bytes() == (model / "model.sig").read_bytes()


def verified_in_view_and_export(mounts: Mounts, model: Path, public: Path, tmp_path: Path) -> Path:
    """`model` (signed, its files whole) mounted held to its signature and exported, both without a
    word, and model_signing verifying the view and the export again: the mountpoint."""
    common = ["--public-key", str(public), "--cache-dir", str(tmp_path / "cache")]
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = mounts.attempt(model, *common, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
    assert mounted.returncode == 0 and mounted.stderr == "", mounted.stderr
    still_verifies(mountpoint / ".tensorfs" / "model", model, public, sharded=False)
    exported = mounts.run("export", "-q", *common, str(model), str(tmp_path / "exported"))
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    still_verifies(tmp_path / "exported", model, public, sharded=False)
    return mountpoint


@pytest.mark.mount
def test_a_signed_file_over_64_mib_is_in_the_view_and_the_export(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """Issue 55: a signed non-weights file over 64 MiB (onnx/model.onnx of 70 MiB) was left out of the
    view and the export, and model_signing's verify of both failed with "Missing files". It is served
    with its signed bytes: model_signing verifies the view and the export again."""
    private, public = keys
    model = make_model(tmp_path / "model")
    (model / "onnx").mkdir()
    (model / "onnx" / "model.onnx").write_bytes(np.random.default_rng(3).bytes(70 * MIB))
    sign(model, private)
    verified_in_view_and_export(mounts, model, public, tmp_path)


@pytest.mark.mount
@pytest.mark.parametrize("layout", ["gguf-quantizations", "loras"])
def test_a_signed_folder_of_several_models_verifies_in_its_view_and_export(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path], layout: str
) -> None:
    """Issue 55, item 4: a signed repository of several models (three GGUF quantizations side by side;
    two LoRAs of the same tensor names) mounts held to its signature, each model in a folder of the
    tree, and model_signing verifies the view and the export again."""
    from gguf_files import write_gguf

    private, public = keys
    model = tmp_path / "repo"
    model.mkdir()
    if layout == "gguf-quantizations":
        for seed, quantization in enumerate(("Q4_K_M", "Q8_0", "F16")):
            tensors = {"token_embd.weight": ("Q8_0", [8, 32]), "blk.0.attn_q.weight": ("F32", [4, 32])}
            write_gguf(model / f"model.{quantization}.gguf", tensors, seed=10 * seed)
        folders = ["model.F16", "model.Q4_K_M", "model.Q8_0"]
    else:
        for seed, name in enumerate(("style-a", "style-b")):
            save_file({"lora_A": np.full(8, seed, dtype=np.float32), "lora_B": np.arange(8, dtype=np.float32)},
                      model / f"{name}.safetensors")  # fmt: skip
        folders = ["style-a", "style-b"]
    (model / "README.md").write_text("# several models\n")
    sign(model, private)
    mountpoint = verified_in_view_and_export(mounts, model, public, tmp_path)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", *folders]
