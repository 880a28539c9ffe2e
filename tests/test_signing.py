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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from model_signing import signing, verifying
from safetensors.numpy import save_file
from signed_models import SIGNED_SHARD, hashing_config, make_key, sign

import tensorfs
import tensorfs.identity
import tensorfs.opener
import tensorfs.tables
from conftest import Mounts
from helpers import cli, free_port, hub_api, scrape
from servers import Nginx, SeaweedFS
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


def test_a_model_signed_by_files_is_hashed_once_then_opened_lazily(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensorfs.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        integrity = opened.gate.integrity
        assert integrity.verified == {"big", "small", "head", "empty"}  # every shard hashed whole, once
        assert "public key signer.pub (sha256:" in integrity.signer
        assert integrity.label == f"the signature {model / 'model.sig'}"
        expected = dict(integrity.expected or {})
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        integrity = opened.gate.integrity
        assert integrity.verified == set() and integrity.hasher.bytes_hashed == 0  # lazy: the hash cache knew
        assert integrity.expected == expected
        assert opened.array("small").tolist() == list(range(7))
        # Only the tensor read was hashed (a small one is hashed again rather than cached), against the
        # digest the first open took from the signed bytes.
        assert integrity.hasher.bytes_hashed == opened.info("small").nbytes and integrity.verified == {"small"}


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
        original = tensorfs.tables.Tables.readinto

        def counted(tables: tensorfs.tables.Tables, shard: Any, offset: int, buffer: memoryview) -> None:
            self.bytes += len(buffer)
            original(tables, shard, offset, buffer)

        monkeypatch.setattr(tensorfs.tables.Tables, "readinto", counted)

    def since(self) -> int:
        """The bytes read since the last call."""
        count, self.bytes = self.bytes, 0
        return count


def test_a_model_signed_by_ranges_is_checked_range_by_range_as_its_tensors_are_read(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensorfs.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
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
        # The 65 ranges holding t3's bytes, whole, read once for the ranges' digests and the tensor's.
        assert nbytes < reads.since() <= nbytes + 2 * SIGNED_SHARD
        assert opened.gate.integrity.verified == {"t3"}
        assert set(opened.gate.integrity.expected or {}) == {"t3"}
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        # A later open: the hash cache knew the header's range and t3's, for this identity of the file.
        assert reads.since() == 0
        assert set(opened.gate.integrity.expected or {}) == {"t3"}
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS
        assert reads.since() == 0  # its digest, too, was the cache's
        assert opened.array("t5").tolist() == [5.0] * RANGED_ELEMENTS
        assert nbytes < reads.since() <= nbytes + 2 * SIGNED_SHARD
    every = tensorfs.opener.Source.named(model, RemoteOptions(cache_dir=cache))
    with every.open(signature=held(public), verify="all") as opened:
        assert reads.since() == size  # --verify all: every range checked at open, whatever the cache knows
        assert opened.gate.integrity.verified == {f"t{i}" for i in range(RANGED_TENSORS)}


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
    with view.open("rb") as file, pytest.raises(OSError) as caught:  # the synthesized file: t5's bytes too
        file.read()
    assert caught.value.errno == errno.EIO
    assert np.frombuffer((mountpoint / "t6").read_bytes(), np.float32).tolist() == [6.0] * RANGED_ELEMENTS
    assert "tensor 't5' in shard" in mounts.log()


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
    monkeypatch.setattr(tensorfs.identity, "SETTLED_NS", 0)
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
        # range holds it all); each tensor of the first is checked as it is read.
        integrity = opened.gate.integrity
        assert integrity.verified == set() and set(integrity.expected or {}) == {"head", "empty"}
        assert opened.array("small").tolist() == list(range(7))
        assert integrity.verified == {"small"} and "big" not in (integrity.expected or {})
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
    """make_model's model with a variant beside it (a weights file that is not the model's), signed:
    through the hashing configuration of the tests (the signature left out, as model_signing's command
    line leaves it out), or `by_library` as model_signing's library signs with its defaults (nothing
    left out: its verify of the folder then names model.sig an extra file, unless told to leave it out)."""
    model = make_model(directory)
    save_file({"small": np.arange(7, dtype=np.float16)}, model / "model.fp16.safetensors")
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
def test_a_signed_models_variant_is_held_to_the_signature_in_its_view(
    mounts: Mounts, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """The variant beside a signed model is served through a gate of its own, held to the signature
    as the model is: a byte of its tensor changed under the mount is refused (EIO, logged), the
    model's files served on."""
    from tensorfs.opener import Source

    private, public = keys
    model = signed_folder(tmp_path / "model", private, sharded=True)
    source = Source.named(model, caches=False)
    with source.open(signature=held(public)) as opened:
        spec, others = source.view(opened)
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
    assert "tensor 'small' in shard" in mounts.log() and "model.fp16.safetensors" in mounts.log()


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
