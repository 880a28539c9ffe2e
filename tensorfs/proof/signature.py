"""Signed models (OpenSSF Model Signing, the `model-signing` package): a signature read and verified
offline with the material a user has (a public key, or a certificate chain), through the library's
own types and cryptography, never a parser of bundles or envelopes of tensorfs's own; what it
proves is the signer's digests of every file of the model (whole files, or their ranges when they
were hashed in shards), without hashing any file: holding a model to them is signed_model.py's.

model-signing is an optional extra (`pip install tensorfs[signing]`): it is imported only when a
signature is verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..caches.signatures import VerifiedSignatures
from ..errors import TensorfsError, printable
from ..sources.store import RemoteOptions, is_remote, redact
from .manifest import read_document

if TYPE_CHECKING:
    from model_signing import manifest as signed_manifest

log = logging.getLogger(__name__)

DEFAULT_SIGNATURE = "model.sig"
"""The signature looked for beside a model (model_signing's own default name)."""
MAX_SIGNATURE_BYTES = 256 << 20
"""A signature lists a digest per file (or per range of a file): one past this is no signature."""
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")
"""What model_signing leaves out of every model it hashes (its hashing.Config's git paths)."""


class SignatureError(TensorfsError):
    """A signature that cannot be read, does not verify, or that the model does not match."""


@dataclass(frozen=True)
class Signature:
    """A signature to hold a model to, and what verifies it (offline: a public key, or a certificate
    chain whose root the user trusts): `Signature(public_key="key.pub")` takes model.sig beside the
    model, `location=` names another (a file or a URL)."""

    public_key: Path | None = None
    """The PEM public key of an elliptic-curve key (model_signing's `key` method)."""
    certificate_chain: tuple[Path, ...] = ()
    """PEM certificates the signing certificate must chain to (model_signing's `certificate` method)."""
    location: Path | str | None = None
    """A file or a URL; None: model.sig beside the model."""

    def __init__(
        self,
        public_key: str | os.PathLike[str] | None = None,
        certificate_chain: Iterable[str | os.PathLike[str]] = (),
        location: str | os.PathLike[str] | None = None,
    ) -> None:
        chain = tuple(Path(path) for path in certificate_chain)
        if (public_key is None) == (not chain):
            raise SignatureError(
                "a signature is verified with a public key or a certificate chain (one of them): "
                f"{'neither' if public_key is None else 'both'} given"
            )
        if location is not None and not (isinstance(location, str) and is_remote(location)):
            location = Path(location)
        object.__setattr__(self, "public_key", None if public_key is None else Path(public_key))
        object.__setattr__(self, "certificate_chain", chain)
        object.__setattr__(self, "location", location)


@dataclass(frozen=True)
class SignedFile:
    """What a signature says of one file: its digest, or its ranges' (hashed in shards)."""

    ranges: tuple[tuple[int, int | None, str], ...]
    """(start, end, hex SHA-256), in order; one (0, None, digest) for a file hashed whole."""

    @property
    def whole(self) -> bool:
        return len(self.ranges) == 1 and self.ranges[0][1] is None

    def key(self) -> str:
        """One string for all it says (what the hash cache remembers a file was found to match)."""
        if self.whole:
            return self.ranges[0][2]
        text = "".join(f"{start} {end} {digest}\n" for start, end, digest in self.ranges)
        return hashlib.sha256(text.encode()).hexdigest()

    def mismatch(self, size: int) -> str | None:
        """Why a file of `size` bytes cannot be the one signed (its ranges do not tile it), if so."""
        if self.whole:
            return None
        expected = 0
        for start, end, _ in self.ranges:
            if start != expected or end is None or end < start:
                return f"the signature's ranges of it are not contiguous (at byte {start})"
            expected = end
        if expected != size:
            return f"it is {size} bytes; the signature says {expected}"
        return None


@dataclass(frozen=True)
class SignedModel:
    """A verified signature: who signed, and the digests of every file it covers."""

    label: str
    """Where the signature was read from (no secret)."""
    signer: str
    """Who signed, as messages and the mount's status say it."""
    method: str
    """How the signer hashed the files: "files" (whole) or "shards" (ranges)."""
    files: Mapping[str, SignedFile]
    """Path relative to the model's directory ("." for a model that is one file) -> what is signed of it."""
    ignored: tuple[str, ...]
    """Paths the signer left out (and model_signing's git paths), relative to the model's directory;
    the signature's own path there too, as model_signing's verify leaves it out."""
    digest: str = ""
    """The SHA-256 of the signature's bytes, as they were verified."""
    path: str | None = None
    """The signature's own path in the model's directory, when it lies there (signed.hold_model)."""
    document: bytes = field(default=b"", repr=False, compare=False)
    """The signature's bytes, as they were verified (a view serves them as its model.sig)."""

    def is_ignored(self, relative: str) -> bool:
        """Whether a file of the model is one the signature leaves out (itself among them)."""
        parts = PurePosixPath(relative).parts
        return any(
            parts[: len(PurePosixPath(ignored).parts)] == PurePosixPath(ignored).parts
            for ignored in (*self.ignored, *GIT_PATHS)
        )


def read_signature(
    where: Path | str,
    signature: Signature,
    remote: RemoteOptions | None = None,
    *,
    in_model: bool = False,
    verified: VerifiedSignatures | None = None,
) -> SignedModel:
    """The signature at `where` (a file, or a URL; `in_model`: found beside the model), verified with
    `signature`'s material (or found `verified` before, with the same key). SignatureError, one line
    naming the file and the reason, when it cannot be read, is not a model signature, or does not
    verify."""
    data = read_document(
        where, remote, in_model=in_model, limit=MAX_SIGNATURE_BYTES, what="a signature", error=SignatureError
    )
    shown = printable(redact(str(where)))
    return verify_signature(data, shown, signature, verified)


def verify_signature(
    data: bytes, label: str, signature: Signature, verified: VerifiedSignatures | None = None
) -> SignedModel:
    """The signature `data` (a sigstore bundle as model_signing writes it), verified with `signature`'s
    material: the statement's signature checked by the library's cryptography, then its digests.
    With `verified`, what a public key verified before is taken from there (the same bytes of the
    signature and of the key), and what it verifies now is kept there."""
    key = _key_bytes(signature, label)
    digest = hashlib.sha256(data).hexdigest()
    material = None if key is None else hashlib.sha256(key).hexdigest()
    rules = verifier_rules()
    if verified is not None and material is not None:
        said = verified.get(digest, material, rules)
        if said is not None:
            return dataclasses.replace(_unremembered(said, label, signature, digest), document=data)
    signed = _verified(data, label, signature)
    if verified is not None and material is not None and _key_bytes(signature, label) == key:  # (unchanged meanwhile)
        verified.put(digest, material, rules, _remembered(signed))
    return dataclasses.replace(signed, document=data)


RULES = 2
"""The version of what verifying a signature means here (_verified, _remembered): raised whenever that
changes, so that no result kept by a tensorfs that verified otherwise is taken."""


def verifier_rules() -> str:
    """What verifies a signature now: RULES and the model_signing release (its metadata, not its code:
    importing it costs more than a warm open)."""
    try:
        release = importlib.metadata.version("model-signing")
    except importlib.metadata.PackageNotFoundError:
        release = "none"
    return f"{RULES}/model-signing {release}"


def _key_bytes(signature: Signature, label: str) -> bytes | None:
    """The public key's bytes (None: a certificate chain verifies)."""
    if signature.public_key is None:
        return None
    try:
        return signature.public_key.read_bytes()
    except OSError as exc:
        shown = printable(str(signature.public_key))
        raise SignatureError(f"{shown}: cannot verify with it: {exc.strerror or exc}") from None


def _remembered(signed: SignedModel) -> str:
    """What a verified signature says, as the cache of verified signatures keeps it."""
    files = {path: [list(span) for span in signed_file.ranges] for path, signed_file in signed.files.items()}
    return json.dumps(
        {"key": _fingerprint_of(signed.signer), "method": signed.method, "files": files, "ignored": signed.ignored}
    )


def _unremembered(said: str, label: str, signature: Signature, digest: str) -> SignedModel:
    """The SignedModel a verified signature said (_remembered), read from `label` with `signature`'s key
    (`digest`: the signature's bytes' SHA-256)."""
    found = json.loads(said)
    files = {
        path: SignedFile(
            tuple((int(start), None if end is None else int(end), str(digest)) for start, end, digest in spans)
        )
        for path, spans in found["files"].items()
    }
    assert signature.public_key is not None
    signer = f"public key {printable(signature.public_key.name)} ({found['key']})"
    return SignedModel(label, signer, str(found["method"]), files, tuple(found["ignored"]), digest=digest)


def _fingerprint_of(signer: str) -> str:
    """ "sha256:..." of a key's signer, as _signer says it."""
    return signer.rsplit("(", 1)[-1].rstrip(")")


def _verified(data: bytes, label: str, signature: Signature) -> SignedModel:
    """verify_signature(), by model_signing."""
    try:
        from model_signing import manifest as signed_manifest
        from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb, signing
    except ImportError:
        raise SignatureError(
            f"{label}: verifying a signature needs the model-signing package: pip install 'tensorfs[signing]'"
        ) from None
    verifier: Any
    material = signature.public_key if signature.public_key is not None else signature.certificate_chain[0]
    try:
        if signature.public_key is not None:
            verifier = sign_ec_key.Verifier(signature.public_key)
        else:
            verifier = sign_certificate.Verifier(list(signature.certificate_chain))
    except Exception as exc:  # the library's own words for a key or a certificate it cannot use
        raise SignatureError(f"{printable(str(material))}: cannot verify with it: {_reason(exc)}") from None
    try:
        bundle = _parsed(data, sign_sigstore_pb)
    except Exception as exc:  # anything the library's reader refuses: not a signature it wrote
        raise SignatureError(f"{label}: not a model signature (a sigstore bundle): {_reason(exc)}") from None
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # it prints a warning on stdout, which is a command's output
            payload_type, payload = verifier._verify_signed_content(bundle)  # the signature only
    except Exception as exc:  # InvalidSignature, a chain that does not verify, a key that is not the signer's
        raise SignatureError(
            f"{label}: does not verify with {printable(str(material))}: {_reason(exc) or 'the signature is not its'}"
        ) from None
    if said.getvalue().strip():
        log.warning("%s: %s", label, " ".join(said.getvalue().split()))
    try:  # what was signed, read by the library's own reader
        statement = _statement(payload_type, payload, signing)
        verified = signing.dsse_payload_to_manifest(statement)
        signed = _signed(verified, statement, signed_manifest, label, _signer(signature, bundle))
    except SignatureError:
        raise
    except Exception as exc:  # signed as it is, and no statement of a model's files
        raise SignatureError(f"{label}: its statement is malformed: {_malformed(exc)}") from None
    return dataclasses.replace(signed, digest=hashlib.sha256(data).hexdigest())


def _statement(payload_type: str, payload: bytes, signing: Any) -> dict[str, Any]:
    """The in-toto statement a verified envelope carries (as model_signing's Verifier.verify reads it)."""
    if payload_type != signing._IN_TOTO_JSON_PAYLOAD_TYPE:
        raise ValueError(f"its payload is {printable(str(payload_type))[:100]}, not an in-toto statement")
    statement = json.loads(payload)
    if not isinstance(statement, dict) or statement.get("_type") != signing._IN_TOTO_STATEMENT_TYPE:
        raise ValueError("its payload is not an in-toto statement")
    return statement


def _malformed(exc: BaseException) -> str:
    """What is wrong with a statement, as a line (a missing key named as such, not as Python says it)."""
    if isinstance(exc, KeyError) and exc.args:
        return f"it has no {printable(str(exc.args[0]))!r}"
    return _reason(exc)


def _parsed(data: bytes, sign_sigstore_pb: Any) -> Any:
    """The library's Signature of `data`: its reader takes a path, given one to the bytes already read
    (a memory file: nothing written anywhere, nothing read twice from outside)."""
    fd = os.memfd_create("model.sig", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as whole:  # a file object writes it all (a write may be short)
            whole.write(data)
        return sign_sigstore_pb.Signature.read(Path(f"/proc/self/fd/{fd}"))
    finally:
        os.close(fd)


def _signer(signature: Signature, bundle: Any) -> str:
    """Who signed: the key's SHA-256 (as model_signing hints it), or the signing certificate's subject."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if signature.public_key is not None:
        key = serialization.load_pem_public_key(signature.public_key.read_bytes())
        pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        return f"public key {printable(signature.public_key.name)} (sha256:{hashlib.sha256(pem).hexdigest()[:16]})"
    leaf = bundle.bundle.verification_material.x509_certificate_chain.certificates[0].raw_bytes
    return f"certificate {printable(x509.load_der_x509_certificate(leaf).subject.rfc4514_string())}"


def _signed(
    verified: signed_manifest.Manifest, statement: dict[str, Any], signed_manifest: Any, label: str, signer: str
) -> SignedModel:
    """The digests of a verified statement, by file, through the library's own types; SignatureError
    for what the library's own reading lets pass and no model's signature says: a file (or a range)
    named twice (the library keeps the last digest: a false one first passed), a range of no bytes."""
    twice = _named_twice(statement)
    if twice is not None:
        raise SignatureError(f"{label}: its statement names {printable(twice)} twice: no signer's tool writes that")
    serialization = verified.serialization_type
    method, hash_type = serialization.get("method"), serialization.get("hash_type")
    if hash_type != "sha256":
        raise SignatureError(f"{label}: files hashed with {printable(str(hash_type))}; tensorfs checks SHA-256 only")
    kind = signed_manifest.SerializationType.from_args(serialization)
    ranges: dict[str, list[tuple[int, int | None, str]]] = {}
    for descriptor in verified.resource_descriptors():
        key = kind.new_item(descriptor.identifier, descriptor.digest).key
        path = str(key.path)
        if method == "shards":
            start, end = int(key.start), int(key.end)
            if end <= start:
                raise SignatureError(
                    f"{label}: its statement signs bytes [{start}, {end}) of {printable(path)}: no bytes"
                )
            ranges.setdefault(path, []).append((start, end, descriptor.digest.digest_hex))
        else:
            ranges.setdefault(path, []).append((0, None, descriptor.digest.digest_hex))
    files = {path: SignedFile(tuple(sorted(spans, key=lambda span: span[0]))) for path, spans in ranges.items()}
    ignored = tuple(str(path) for path in serialization.get("ignore_paths", ()))
    return SignedModel(label, signer, str(method), files, ignored)


def _named_twice(statement: dict[str, Any]) -> str | None:
    """A name the statement gives two items (a file, or a file's range), if it does: its resources,
    or an older statement's subjects."""
    predicate = statement.get("predicate")
    items = predicate.get("resources") if isinstance(predicate, dict) else None
    if not isinstance(items, list):
        items = statement.get("subject")
    seen: set[str] = set()
    for item in items if isinstance(items, list) else ():
        name = item.get("name") if isinstance(item, dict) else None
        if isinstance(name, str):
            if name in seen:
                return name
            seen.add(name)
    return None


def _reason(exc: BaseException) -> str:
    """An exception of the library as one line (its message, else its kind)."""
    text = " ".join(str(exc).split())
    return printable(text[:300]) if text else type(exc).__name__
