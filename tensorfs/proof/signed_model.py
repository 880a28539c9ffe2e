"""Holding a model to a verified signature (signature.py): its files are exactly the signed ones, and
the signer's digests are the gate's manifest.

A signature gives each file's SHA-256 (or its ranges'), not each tensor's; the gate checks
tensors. So the bytes of each file are checked against what the signature says of them, each byte
hashed once: a file signed whole at open (a progress line; a remote one is read once), a file
signed by ranges range by range as its tensors are first read (signed_bytes.SignedRanges). A check
proves the tensors whose bytes it covered; their own digests are taken on the way only where
something will hold bytes to them (a fallback's copy; a later open of a remote file signed whole), else when
asked for. The hash cache keeps rows saying that the file of an identity matched what the signature
says of it, so that a later open of the unchanged file hashes nothing (the hash cache's own trust:
an unchanged identity is unchanged bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..caches.hashes import HashCache
from ..caches.signatures import VerifiedSignatures
from ..catalogue.tables import Tables
from ..errors import RemoteError, ShardChangedError, printable
from ..formats import is_weights_name
from ..fs.guarded import ModelDirectory, NotRegular, mounted_under
from ..sources.finding import beside, directory_url, listing_beside
from ..sources.store import RemoteOptions
from ..utils.identity import Identity, ShardKey
from .integrity import SIGNATURE_LABEL, Hasher, Integrity
from .signature import DEFAULT_SIGNATURE, Signature, SignatureError, SignedFile, SignedModel, read_signature
from .signed_bytes import SignedRanges, check_file

FILE_SPAN = (-1, -1)
"""The hash cache's row for a whole file (no tensor's span is negative): what the signature said of
the file when the file of that identity was found to match it (SignedFile.key)."""
MAX_FILES = 100_000
MAX_DEPTH = 32
"""The most a local model's directory is walked for its files: past either, it is refused."""
MAX_SAID = 10
"""The most files a refusal names, one line each (then how many more)."""


@dataclass(frozen=True)
class Holding:
    """How a model is held to its signature, as the opener knows it."""

    where: Path | str
    """The model's directory, or a remote one's URL."""
    remote: RemoteOptions
    cache: HashCache
    """The hash cache (its directory keeps the signatures verified too)."""
    one_file: bool
    """Opened as one file (a model signed as one file is ".", as model_signing names it)."""
    everything: bool = True
    """No selection: every weights file is the model's (else those not selected are checked as served)."""
    progress: bool = False
    verify_all: bool = False
    """Every tensor checked now (--verify all), whatever the hash cache knows."""
    fallbacks: bool = False
    """The model has fallbacks: each tensor's value is taken when its bytes are checked."""


def hold_model(tables: Tables, signature: Signature, holding: Holding) -> tuple[SignedModel, Integrity]:
    """The verified signature `signature` names (else model.sig beside the model), and the integrity that
    holds the model's gate to it: a local model's files exactly those signed (a remote one's listing),
    the signed digests its manifest (hold_to). SignatureError naming the file and why, if not."""
    where, remote, cache = holding.where, holding.remote, holding.cache
    verified = VerifiedSignatures(cache.directory if cache.enabled else None)
    try:
        signed = find_signature(signature, where, remote, verified)
    finally:
        verified.close()
    root: Path | str = directory_url(where, remote) if isinstance(where, str) else where
    own = signature_path(signature, root)
    if own is not None:  # never a file it covers, wherever it lies, whatever the signer left out
        signed = dataclasses.replace(signed, ignored=(*signed.ignored, own), path=own)
    if not holding.one_file:
        if isinstance(where, str):
            if not remote.offline:  # (offline, no store is asked: only what the cache holds is served)
                check_remote_files(signed, where, remote)
        else:
            check_local_files(signed, where, tables.shards, cache, everything=holding.everything)
    integrity = hold_to(tables, signed, root, Hasher(tables, cache), holding)
    if holding.verify_all:
        integrity.check_many(tables.names())
    return signed, integrity


def signature_path(signature: Signature, root: Path | str) -> str | None:
    """The path of the signature `signature` names (else model.sig beside the model) in the model's
    directory (`root`: its path or its URL), when it lies there."""
    if signature.location is None:
        return DEFAULT_SIGNATURE
    if isinstance(signature.location, Path):
        if not isinstance(root, Path):
            return None
        own = os.path.relpath(os.path.abspath(signature.location), os.path.abspath(root))
        return None if own.startswith("..") else PurePosixPath(Path(own)).as_posix()
    prefix = str(root).rstrip("/") + "/"
    url = signature.location
    return url.removeprefix(prefix) if isinstance(root, str) and url.startswith(prefix) else None


def find_signature(
    signature: Signature, where: Path | str, remote: RemoteOptions, verified: VerifiedSignatures | None = None
) -> SignedModel:
    """The signature `signature` names, else model.sig beside the model (`where`: its directory or URL),
    verified (or found `verified` before: caches/signatures.py)."""
    if signature.location is not None:
        return read_signature(signature.location, signature, remote, verified=verified)
    if isinstance(where, str):
        return read_signature(beside(where, DEFAULT_SIGNATURE, remote).url, signature, remote, verified=verified)
    try:  # asked of the directory, never of what a mount or a link there leads to (it may hang)
        with ModelDirectory(where) as directory:
            there = directory.has(DEFAULT_SIGNATURE)
    except OSError:
        there = False
    if not there:
        shown = printable(str(where / DEFAULT_SIGNATURE))
        raise SignatureError(f"{shown}: no signature here; name one (--signature FILE|URL)")
    return read_signature(where / DEFAULT_SIGNATURE, signature, remote, in_model=True, verified=verified)


def hold_to(tables: Tables, signed: SignedModel, directory: Path | str, hasher: Hasher, holding: Holding) -> Integrity:
    """The gate's integrity under `signed` (signed_bytes.SignedRanges): the bytes no tensor holds
    checked now (a file signed whole: the file, each byte hashed once, the files several at once),
    and what the hash cache knows held its signed bytes for the files' identities taken as known;
    the rest checked as its tensors are first read. With `holding.verify_all`, every byte checked
    now, whatever the cache knows. SignatureError, naming the file, for a shard the signature does
    not name or whose bytes are not the signed ones."""
    files: dict[ShardKey, SignedFile] = {}
    for shard in tables.shards:
        relative = "." if holding.one_file and "." in signed.files else relative_name(directory, shard)
        signed_file = signed.files.get(relative)
        if signed_file is None:
            raise SignatureError(unsigned(str(shard), signed))
        files[shard] = signed_file
    for opened in tables.opened_shards():  # bytes read to be checked are summed so: fetched again, they must be them
        opened.data.hold_to_manifest()
    # With fallbacks, a tensor's value is taken when its bytes are checked: a fallback's copy is held to it.
    pending = SignedRanges(files, signed.label, values=holding.fallbacks)
    known = pending.open(hasher, everything=holding.verify_all, progress=holding.progress)
    label = f"{SIGNATURE_LABEL}{signed.label}"
    return Integrity(hasher, known.values, known.proven, label, signed.signer, pending)


def relative_name(directory: Path | str, shard: ShardKey) -> str:
    """How a signature names a file of the model: its path from the model's directory (a model
    signed as one file is ".", as model_signing names it)."""
    if isinstance(shard, Path):
        return PurePosixPath(os.path.relpath(shard, directory)).as_posix()
    return shard.removeprefix(str(directory).rstrip("/") + "/")


# -- the files of the model ------------------------------------------------------------------------


def check_local_files(
    signed: SignedModel, directory: Path, shards: Iterable[ShardKey], cache: HashCache, *, everything: bool = True
) -> None:
    """A local model's directory holds exactly the files signed (but those the signature leaves out,
    itself among them), and each that is not one of the model's shards (theirs are hashed with their
    tensors) holds its signed bytes: hashed once, then known by the hash cache. SignatureError, one
    line a file, naming each that is missing, unsigned or not the signed one. Not `everything` (a
    selection): weights files are the model's, hashed when their tensors are served, if they are."""
    shard_names = {relative_name(directory, shard) for shard in shards}
    problems: list[str] = []
    with ModelDirectory(directory) as root:
        present = _walk(root, directory)
        problems += _coverage(signed, present, lambda relative: str(directory / relative))
        for relative in present:
            weights = relative in shard_names or (not everything and is_weights_name(relative))
            if relative in signed.files and not weights:
                try:
                    _check_plain(root, directory, relative, signed, cache)
                except SignatureError as exc:
                    problems.append(str(exc))
    if problems:
        raise refusal(problems)


def unsigned(shown: str, signed: SignedModel) -> str:
    """What is said of a file the signature does not cover."""
    return f"{printable(shown)}: not covered by the signature {signed.label}"


def _coverage(signed: SignedModel, present: Mapping[str, int], shown: Callable[[str], str]) -> list[str]:
    """A line for each file signed and not present, and for each present that the signature neither names nor
    leaves out (`present`: each file's size, -1 unknown); `shown(relative)` is how a message names a
    file. An empty file a signature of ranges names no range of is signed as model_signing signs it
    (its shard serializer makes no item of one, and its verify takes it so)."""
    missing = sorted(set(signed.files) - set(present))
    problems = [f"{printable(shown(name))}: signed, but not in the model" for name in missing]
    problems += [
        unsigned(shown(name), signed)
        for name in sorted(present)
        if name not in signed.files and not signed.is_ignored(name) and not empty_of_ranges(signed, present[name])
    ]
    return problems


def empty_of_ranges(signed: SignedModel, size: int) -> bool:
    """A file of no bytes a signature of ranges names no range of: signed, as model_signing signs it."""
    return size == 0 and signed.method == "shards"


def refusal(problems: list[str]) -> SignatureError:
    """What refuses a model, one line a file, for so many (a statement naming a million files the
    model lacks made a million lines): the first ones, then how many more."""
    if len(problems) > MAX_SAID:
        problems = [*problems[:MAX_SAID], f"... and {len(problems) - MAX_SAID:,} more"]
    return SignatureError("\n".join(problems))


def check_remote_files(signed: SignedModel, source: str, remote: RemoteOptions) -> None:
    """A model in a store that lists (S3) holds the files signed, and no other, in its directory and
    its subdirectories (a store that does not list, HTTP or the Hub, is not asked).
    SignatureError, one line a file, naming each missing or unsigned."""
    try:
        listed = listing_beside(source, remote, MAX_DEPTH, whole=True)  # a cut one: never taken for all
    except RemoteError as exc:
        raise SignatureError(f"{exc}: the signature {signed.label} cannot be checked against it") from None
    if listed is None:
        return
    base = directory_url(source, remote)
    present = {path: size for path, size, *_ in listed}
    problems = _coverage(signed, present, lambda relative: f"{base}/{relative}")
    if problems:
        raise refusal(problems)


def _walk(root: ModelDirectory, directory: Path) -> dict[str, int]:
    """Every file beneath the directory (what is not a directory: a link is a file, never followed),
    by path, with its size (-1: a link's, not known); what is mounted inside it is not entered."""
    mounted = mounted_under(root.real)
    found: dict[str, int] = {}
    todo = [""]
    while todo:
        relative = todo.pop()
        if relative.count("/") >= MAX_DEPTH:
            raise SignatureError(f"{printable(str(directory / relative))}: over {MAX_DEPTH} directories deep")
        try:
            for entry in root.scan(relative):  # (each looked at while its directory is open)
                path = f"{relative}/{entry.name}" if relative else entry.name
                if path in mounted:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    todo.append(path)
                else:
                    found[path] = _size_of(entry)
                if len(found) > MAX_FILES:
                    raise SignatureError(f"{printable(str(directory))}: over {MAX_FILES} files")
        except OSError as exc:
            raise SignatureError(f"{printable(str(directory / relative))}: cannot list: {exc.strerror}") from None
    return dict(sorted(found.items()))


def _size_of(entry: os.DirEntry[str]) -> int:
    """A regular file's size, as listed (-1 for anything else: a link is not followed)."""
    try:
        return entry.stat(follow_symlinks=False).st_size if entry.is_file(follow_symlinks=False) else -1
    except OSError:
        return -1


def _check_plain(root: ModelDirectory, directory: Path, relative: str, signed: SignedModel, cache: HashCache) -> None:
    """A file of the model that is not a shard holds its signed bytes (the hash cache first)."""
    shown = str(directory / relative)
    signed_file = signed.files[relative]
    try:
        fd, status = root.open_regular(relative)
    except (NotRegular, OSError) as exc:
        why = "not a regular file" if isinstance(exc, NotRegular) else exc.strerror
        raise SignatureError(f"{printable(shown)}: cannot be checked: {why}") from None
    try:
        identity = Identity.of(status)
        if cache.enabled and cache.get_many(identity, [FILE_SPAN]).get(FILE_SPAN) == signed_file.key():
            return

        def read(offset: int, buffer: memoryview) -> None:
            if os.preadv(fd, [buffer], offset) != len(buffer):
                raise ShardChangedError(f"{shown}: shorter than when opened")

        check_file(read, status.st_size, signed_file, shown, signed.label)
        cache.put_many(identity, {FILE_SPAN: signed_file.key()})
    finally:
        os.close(fd)


def signed_content(
    signed: SignedModel,
    relative: str,
    shown: str,
    read: Callable[[], bytes],
    content_digest: bytes | None = None,
) -> None:
    """A companion file (`relative` in the model's directory; `shown`, as messages name it) is served
    only with its signed bytes. `content_digest`: the SHA-256 of the content a local one is served
    while it holds, which must be the signed file's (read only when the signature signed ranges of
    it); without one (a remote file), the content `read` gives is checked. SignatureError if not."""
    signed_file = signed.files.get(relative)
    if signed_file is None:
        raise SignatureError(unsigned(shown, signed))
    if signed_file.whole and content_digest is not None:
        if content_digest.hex() != signed_file.ranges[0][2]:
            raise SignatureError(
                f"{printable(shown)}: bytes hash to {content_digest.hex()}, not to {signed_file.ranges[0][2]} as "
                f"the signature {signed.label} says"
            )
        return
    data = read()
    if content_digest is not None and hashlib.sha256(data).digest() != content_digest:
        raise SignatureError(f"{printable(shown)}: changed while it was checked")

    def from_memory(offset: int, buffer: memoryview) -> None:
        buffer[:] = data[offset : offset + len(buffer)]

    check_file(from_memory, len(data), signed_file, shown, signed.label)
