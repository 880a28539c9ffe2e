"""Each rule of the signed path at its edge, one test a rule: those a mutation round of the signed path
found no test of (each test seen to fail with its rule removed). The signed path's main tests are
tests/test_signing.py; these reuse its models and helpers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from model_signing import hashing, signing
from safetensors.numpy import save_file
from signed_models import SIGNED_SHARD, make_key, resign, sign
from test_signing import (
    RANGED_ELEMENTS,
    CountedHashing,
    flip_byte,
    held,
    make_model,
    make_ranged_model,
    resources_of,
    tensor_offset,
)

import tensorfs
import tensorfs.proof.signature
import tensorfs.utils.identity
from helpers import cli
from servers import Nginx
from tensorfs.gate.untensored import UntensoredBytes
from tensorfs.opening.source import Source
from tensorfs.opening.view_files import view_of
from tensorfs.proof.integrity import Integrity
from tensorfs.proof.signature import SignedFile
from tensorfs.proof.signed_model import signed_content
from tensorfs.sources.store import RemoteOptions


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return make_key(tmp_path / "signer")


def signed_ignoring(model: Path, private: Path, ignored: list[str], *, sharded: bool = False) -> None:
    """The model signed by model_signing's API, these paths left out (the signature too)."""
    config = hashing.Config().set_ignored_paths(paths=["model.sig", *ignored])
    if sharded:
        config = config.use_shard_serialization(shard_size=SIGNED_SHARD)
    signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(config).sign(
        model, model / "model.sig"
    )


# -- what the hash cache may say -------------------------------------------------------------------


def test_a_companion_refused_once_is_refused_again_with_the_cache(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A companion whose bytes are not the signed ones leaves no row saying they matched: the next open
    with the same hash cache refuses it again (a row written before the check let it through)."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # written a moment ago: cached at once
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    (model / "config.json").write_text('{"model_type": "changed"}\n')
    for _ in range(2):
        with pytest.raises(tensorfs.SignatureError, match=r"config.json: bytes hash to"):
            tensorfs.open_model(model, signature=held(public), cache=tmp_path / "cache")


def test_another_signature_of_ranges_over_files_the_cache_knows_is_held_to_what_it_says(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash cache knows t3's ranges held their signed bytes; a signature that says other digests of
    them (the same files) is held to what it says: t3 is refused (rows keyed by what was signed, the
    ranges' digests compared, no tensor taken as proven by rows of another signature)."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    signature = sign(model, private, sharded=True)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        assert opened.array("t3").tolist() == [3.0] * RANGED_ELEMENTS  # its ranges checked: rows kept
    begin = tensor_offset(model, "t3")
    inside = begin // SIGNED_SHARD + 1  # a range wholly inside t3

    def other_digest(statement: dict[str, Any]) -> None:
        for resource in resources_of(statement):
            if resource["name"] == f"model.safetensors:{inside * SIGNED_SHARD}:{(inside + 1) * SIGNED_SHARD}":
                resource["digest"] = "1" * 64

    resign(signature, private, other_digest)
    with tensorfs.open_model(model, signature=held(public), cache=cache) as opened:
        assert "t3" not in opened.gate.integrity.verified
        with pytest.raises(tensorfs.IntegrityError, match=r"tensor 't3': bytes \[\d+, \d+\) hash to"):
            opened.array("t3")
        assert opened.array("t2").tolist() == [2.0] * RANGED_ELEMENTS


# -- companions: a model opened by its file, a view's signature ------------------------------------


@pytest.mark.parametrize("change", ["changed", "added"])
def test_a_model_opened_by_its_file_has_its_companions_held_to_the_signature(
    tmp_path: Path, keys: tuple[Path, Path], change: str
) -> None:
    """Exported by its weights file (its directory's files are not walked then), a signed model's
    companions are still held to the signature: one changed is refused by its bytes, one the
    signature does not name is refused as not covered."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    if change == "changed":
        (model / "config.json").write_text('{"model_type": "changed"}\n')
        said = "config.json: bytes hash to"
    else:
        (model / "tokenizer.json").write_text("{}\n")
        said = "tokenizer.json: not covered by the signature"
    done = cli(
        "export", str(model / "model-00001-of-00002.safetensors"), str(tmp_path / "out"), "--public-key", str(public)
    )
    assert done.returncode == 1 and said in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_signature_changed_after_it_was_verified_is_not_served_in_the_view(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """The view of a signed model's folder serves model.sig as it was verified: a byte appended to it
    since is refused ("changed since it was verified"), never served."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    source = Source.named(model, caches=False)
    with source.open(signature=held(public)) as opened:
        with (model / "model.sig").open("ab") as signature:
            signature.write(b" ")
        with pytest.raises(tensorfs.SignatureError, match=r"model.sig: changed since it was verified"):
            view_of(source, opened)


def test_a_companions_content_that_changed_while_it_was_checked_is_refused() -> None:
    """A local companion signed by ranges is read to be checked: bytes read that are not the content it
    was found with (it changed meanwhile) are refused, whatever the signature says of them."""
    data = b"a" * 100
    signed_file = SignedFile(((0, 100, hashlib.sha256(data).hexdigest()),))
    signed = tensorfs.proof.signature.SignedModel("sig", "signer", "shards", {"f.txt": signed_file}, ())
    found_with = hashlib.sha256(b"b" * 100).digest()  # what it held when it was found
    with pytest.raises(tensorfs.SignatureError, match=r"f.txt: changed while it was checked"):
        signed_content(signed, "f.txt", "f.txt", lambda: data, found_with)


# -- the bytes no tensor holds -----------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "while"])
def test_bytes_no_tensor_holds_changed_in_place_are_not_served(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A view serves a weights file's header as it was validated: its file written in place before its
    first read, or while it is read, is refused ("changed in place"), never its new bytes served."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    shard = model / "model.safetensors"
    at = shard.read_bytes().index(b"aaaa")  # the metadata's value, in the header

    def rewrite() -> None:
        with shard.open("r+b") as file:
            file.seek(at)
            file.write(b"bbbb")

    with tensorfs.open_model(model, signature=held(public), cache=False) as opened:
        if when == "before":
            rewrite()
        else:
            fill = UntensoredBytes.fill

            def written_while_read(self: UntensoredBytes, read: Any) -> None:
                rewrite()
                fill(self, read)

            monkeypatch.setattr(UntensoredBytes, "fill", written_while_read)
        with pytest.raises(tensorfs.TensorfsError, match=r"changed in place"):
            opened.gate.copy_untensored(shard, 0, memoryview(bytearray(8)))


# -- the signature as a document ---------------------------------------------------------------------


def test_a_signature_read_from_a_pipe_is_bounded_in_size(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature named by a pipe (nothing says its size first) is read up to the bound and refused past
    it, valid as its first bytes may be."""
    private, public = keys
    model = make_model(tmp_path / "model")
    data = sign(model, private, signature=tmp_path / "elsewhere.sig").read_bytes()
    monkeypatch.setattr(tensorfs.proof.signature, "MAX_SIGNATURE_BYTES", len(data) + 10)
    read, write = os.pipe()
    try:
        os.write(write, data + b" " * 20)  # valid JSON still, and past the bound
        os.close(write)
        write = -1
        signature = tensorfs.Signature(public_key=public, location=f"/proc/self/fd/{read}")
        with pytest.raises(tensorfs.SignatureError, match=r"too large"):
            tensorfs.open_model(model, signature=signature, cache=False)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def test_a_signature_linked_from_outside_the_model_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """model.sig beside the model is opened beneath its directory: a link to a signature elsewhere is
    not followed (it is refused), valid as that signature is."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, signature=tmp_path / "outside.sig")
    (model / "model.sig").symlink_to(tmp_path / "outside.sig")
    with pytest.raises(tensorfs.SignatureError, match=r"model.sig: .*(link|symlink)"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_an_outside_signature_named_is_no_file_of_the_model(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A signature named outside the model's directory (--signature ../outside.sig) is no file of the
    model: the export says nothing of it, and writes the model's own files."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, signature=tmp_path / "outside.sig")
    done = cli("export", "model", "out", "--public-key", str(public), "--signature", "outside.sig", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (model / "config.json").read_bytes()


def test_a_statement_of_the_older_form_naming_a_file_twice_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """model_signing still reads statements of its v0.1 form (a subject a file): one naming config.json
    twice, a false digest first, is refused as the current form's is."""
    private, public = keys
    model = make_model(tmp_path / "model")

    def older(statement: dict[str, Any]) -> None:
        subjects = [{"name": r["name"], "digest": {"sha256": r["digest"]}} for r in resources_of(statement)]
        config = next(s for s in subjects if s["name"] == "config.json")
        statement["subject"] = [{"name": "config.json", "digest": {"sha256": "0" * 64}}, *subjects]
        statement["predicateType"] = "https://model_signing/Digests/v0.1"
        del statement["predicate"]
        assert config

    resign(sign(model, private), private, older)
    with pytest.raises(tensorfs.SignatureError, match=r"model.sig: its statement names config.json twice"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_an_envelope_whose_payload_is_no_statement_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """The envelope's payload type is not signed (model_signing's library signs a fixed one): an envelope
    saying its payload is anything but an in-toto statement is refused, as model_signing's verify does."""
    import json

    private, public = keys
    model = make_model(tmp_path / "model")
    signature = sign(model, private)
    bundle = json.loads(signature.read_text())
    bundle["dsseEnvelope"]["payloadType"] = "application/json"
    signature.write_text(json.dumps(bundle))
    with pytest.raises(tensorfs.SignatureError, match=r"model.sig: .*not an in-toto statement"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_files_hashed_with_another_algorithm_are_said_to_be(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A model signed with its files hashed by BLAKE2 is refused, saying so (tensorfs checks SHA-256)."""
    private, public = keys
    model = make_model(tmp_path / "model")
    config = hashing.Config().set_ignored_paths(paths=["model.sig"]).use_file_serialization(hashing_algorithm="blake2")
    signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(config).sign(
        model, model / "model.sig"
    )
    with pytest.raises(tensorfs.SignatureError, match=r"files hashed with blake2"):
        tensorfs.open_model(model, signature=held(public), cache=False)


# -- the files of the model --------------------------------------------------------------------------


def test_an_empty_file_a_signature_of_files_does_not_name_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """An empty file is signed with no range by a signature of ranges alone: one a signature of files
    does not name is not covered (model_signing's verify refuses it too)."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    (model / "empty.txt").write_bytes(b"")
    with pytest.raises(tensorfs.SignatureError, match=r"empty.txt: not covered by the signature"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_a_link_a_signature_of_ranges_does_not_name_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A symlink added to a model signed by ranges is a file it does not name (its size is not one of
    no bytes: it is not looked through): not covered."""
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private, sharded=True)
    (model / "link.txt").symlink_to(model / "config.json")
    with pytest.raises(tensorfs.SignatureError, match=r"link.txt: not covered by the signature"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_a_file_beside_one_the_signer_left_out_is_not_left_out(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """The signer left out tokenizer/notes.txt: tokenizer/merges.txt added beside it is a file the
    signature does not name (a path left out is that path, not its directory)."""
    private, public = keys
    model = make_model(tmp_path / "model")
    (model / "tokenizer" / "notes.txt").write_text("notes\n")
    signed_ignoring(model, private, ["tokenizer/notes.txt"])
    (model / "tokenizer" / "merges.txt").write_text("a b\n")
    with pytest.raises(tensorfs.SignatureError, match=r"tokenizer/merges.txt: not covered by the signature"):
        tensorfs.open_model(model, signature=held(public), cache=False)


def test_what_the_signer_left_out_is_not_served(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """README.md left out by the signer: the export (the signed folder) does not hold it."""
    private, public = keys
    model = make_model(tmp_path / "model")
    (model / "README.md").write_text("# a model\n")
    signed_ignoring(model, private, ["README.md"])
    done = cli("export", str(model), str(tmp_path / "out"), "--public-key", str(public))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "README.md").exists()


def test_a_weights_file_beside_the_model_is_checked_by_verify(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A signed weights file beside the model, not in its index (a variant), is held to the signature by
    `tensorfs verify`, as model_signing's verify holds every file: a byte of it changed is refused."""
    private, public = keys
    model = make_model(tmp_path / "model")
    save_file({"w": np.arange(64, dtype=np.float32)}, model / "extra.safetensors")
    sign(model, private)
    flip_byte(model / "extra.safetensors", (model / "extra.safetensors").stat().st_size - 1)
    done = cli("verify", str(model), "--public-key", str(public))
    assert done.returncode == 1 and "extra.safetensors: bytes hash to" in done.stderr, done.stderr


def test_a_shard_the_signer_left_out_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A shard of the model the signature leaves out is no file it covers: opening the model is refused,
    naming it (not a tensor of it failing on read)."""
    private, public = keys
    model = make_model(tmp_path / "model")
    signed_ignoring(model, private, ["model-00002-of-00002.safetensors"])
    with pytest.raises(
        tensorfs.SignatureError, match=r"model-00002-of-00002.safetensors: not covered by the signature"
    ):
        tensorfs.open_model(model, signature=held(public), cache=False)


# -- checks shared by readers ------------------------------------------------------------------------


def test_a_check_made_before_a_file_changed_is_not_taken_after(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A check of a tensor's ranges is shared by whoever asks for the same ranges since the same
    change of the file (a mount's readers of one tensor come together). A byte of a tensor read
    and proven, then changed in place: the tensor is read again, and its ranges are checked again,
    never proven by the check made before the change."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    weights = model / "model.safetensors"
    with tensorfs.open_model(model, signature=held(public), cache=False) as opened:
        assert opened.array("t5").tolist() == [5.0] * RANGED_ELEMENTS
        flip_byte(weights, tensor_offset(model, "t5") + RANGED_ELEMENTS * 2)
        with pytest.raises(tensorfs.TensorfsError, match=r"t5"):
            opened.array("t5")


def test_a_tensor_whose_file_changed_while_it_was_checked_is_not_made_verified(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks of a tensor's ranges read its bytes as signed, and its file was written in place
    before they were done with: the tensor is not made verified (the bytes proven are not those
    there now), and its next read checks its ranges again and is refused."""
    private, public = keys
    model = make_ranged_model(tmp_path / "model")
    sign(model, private, sharded=True)
    weights = model / "model.safetensors"
    at = tensor_offset(model, "t5") + RANGED_ELEMENTS * 2
    establish = Integrity.establish
    changed: list[int] = []

    def changed_as_checked(self: Integrity, *args: Any, **kwargs: Any) -> Any:
        proven = establish(self, *args, **kwargs)  # every range of it read as signed, and proven
        if not changed:
            changed.append(at)
            flip_byte(weights, at)  # then written, before the gate takes what they proved
        return proven

    monkeypatch.setattr(Integrity, "establish", changed_as_checked)
    with tensorfs.open_model(model, signature=held(public), cache=False) as opened:
        with contextlib.suppress(tensorfs.IntegrityError):  # served as proven, or refused once seen written
            opened.array("t5")
        assert changed == [at]
        assert "t5" not in opened.gate.integrity.verified
        with pytest.raises(tensorfs.TensorfsError, match=r"t5"):
            opened.array("t5")


def test_a_remote_file_signed_whole_is_opened_again_lazily(
    nginx: Nginx,
    tmp_path: Path,
    keys: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """A remote file's identity (its ETag) proves nothing of its bytes: a later open cannot take them
    as checked. A file signed whole is hashed whole at its first open and its tensors' values taken
    on the way, every one kept (the smallest too: without its value a tensor is proven by the whole
    file alone), so that a later open hashes each tensor it serves against its value, never the
    whole file again (a 14-byte tensor's first read hashed its 20 KB file twice over)."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # files written a moment ago: cached at once
    private, public = keys
    model = make_model(tmp_path / "model")
    sign(model, private)
    served = nginx.root / request.node.name
    shutil.copytree(model, served)
    hashed = CountedHashing(monkeypatch)
    weights = sum(path.stat().st_size for path in model.glob("*.safetensors"))
    index = f"{nginx.url}/{request.node.name}/model.safetensors.index.json"
    try:
        chunks = RemoteOptions(cache_dir=tmp_path / "chunks")
        with tensorfs.open_model(index, signature=held(public), remote=chunks, cache=tmp_path / "cache") as opened:
            assert set(opened.gate.integrity.expected or {}) == {"big", "small", "head", "empty"}
            assert hashed.bytes >= weights  # each weights file hashed whole
        hashed.bytes = 0
        with tensorfs.open_model(index, signature=held(public), remote=chunks, cache=tmp_path / "cache") as opened:
            assert opened.array("small").tolist() == list(range(7))
            assert opened.array("head").shape == (30, 20)
            assert opened.gate.integrity.verified >= {"small", "head"}
            assert hashed.bytes == 0  # no signed bytes checked again: each tensor against its value
    finally:
        shutil.rmtree(served)


def test_a_verified_signature_kept_under_other_rules_is_verified_again(
    tmp_path: Path, keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a key verified is kept with the rules that verified it (tensorfs's, and model_signing's
    release): once those change, a kept result is not taken, however it reads (it was, by the
    signature's and the key's bytes alone, at d4c56fe)."""
    import sqlite3

    from tensorfs.caches.signatures import VerifiedSignatures
    from tensorfs.proof.signature import verify_signature

    private, public = keys
    model = make_model(tmp_path / "m")
    sign(model, private)
    data = (model / "model.sig").read_bytes()
    cache = VerifiedSignatures(tmp_path / "cache")
    signature = tensorfs.Signature(public_key=public)
    first = verify_signature(data, "model.sig", signature, cache)
    assert "model.safetensors" in first.files or len(first.files) > 1
    cache.close()
    with sqlite3.connect(tmp_path / "cache" / "signatures.sqlite") as db:  # the kept result made to lie
        (table,) = db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchone()
        lie = '{"key": "sha256:0", "method": "files", "files": {}, "ignored": []}'
        assert db.execute(f"UPDATE {table} SET said=?", (lie,)).rowcount == 1
    taken = verify_signature(data, "model.sig", signature, VerifiedSignatures(tmp_path / "cache"))
    assert taken.files == {}  # the same rules: taken as kept (the cache's own trust, its directory's)
    monkeypatch.setattr(tensorfs.proof.signature, "RULES", 1000, raising=False)  # how it verifies, changed
    again = verify_signature(data, "model.sig", signature, VerifiedSignatures(tmp_path / "cache"))
    assert again.files == first.files and again.signer == first.signer
