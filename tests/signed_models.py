"""Models signed for the tests (OpenSSF Model Signing, through model_signing's own signing API), with
keys made here (cryptography)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import hashing, signing

SIGNED_SHARD = 4096
"""The shard size of models signed in ranges here: a tensor spans several ranges."""


def make_key(where: Path) -> tuple[Path, Path]:
    """A P-256 key pair in PEM files: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where.with_suffix(".key"), where.with_suffix(".pub")
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def hashing_config(sharded: bool) -> hashing.Config:
    """How the models here are hashed: whole files or ranges; the signature itself left out, as
    model_signing's command line leaves it out."""
    config = hashing.Config().set_ignored_paths(paths=["model.sig"])
    return config.use_shard_serialization(shard_size=SIGNED_SHARD) if sharded else config


def sign(model: Path, private: Path, *, sharded: bool = False, signature: Path | None = None) -> Path:
    where = signature or model / "model.sig"
    config = signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(hashing_config(sharded))
    config.sign(model, where)
    return where


def resign(signature: Path, private: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The signature's statement edited by `edit` (in place) and signed again with the signer's own key:
    what a hostile or careless signer makes, reaching tensorfs's own reading of what was signed (the
    statement's root digest made again from its resources, as model_signing checks it)."""
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement_pb2
    from model_signing._signing import sign_ec_key

    bundle = json.loads(signature.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    edit(statement)
    resources = statement.get("predicate", {}).get("resources", [])
    if resources and statement.get("subject"):
        root = hashlib.sha256(b"".join(bytes.fromhex(resource["digest"]) for resource in resources))
        statement["subject"][0]["digest"]["sha256"] = root.hexdigest()
    pb = json_format.ParseDict(statement, statement_pb2.Statement())
    payload = SimpleNamespace(statement=SimpleNamespace(pb=pb))
    sign_ec_key.Signer(private).sign(payload).write(signature)  # type: ignore[arg-type]
    return signature
