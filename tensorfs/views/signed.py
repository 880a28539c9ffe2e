"""The companion files a view of a signed model serves: the signed ones, with their signed bytes
(proof/signed_model.py holds the model itself to the signature)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from ..errors import TensorfsError, printable
from ..proof.signature import SignedModel
from ..proof.signed_model import empty_of_ranges, refusal, signed_content
from ..sources.store import redact
from .companions import Companion, CompanionFiles, FileRule, LocalOrigin

__all__ = ["signed_companions"]


def signed_companions(
    signed: SignedModel, companions: Iterable[Companion], *, remote: bool, rule: FileRule
) -> list[Companion]:
    """The companion files a view serves are the signed ones, with their signed bytes (a local one is
    served only while it holds what it held when found; a remote one is read once here); beside a
    remote model (whose files were not listed when it was opened), no companion the signature names
    is missing. SignatureError, one line a file, if not. The companions to serve: those the signature
    leaves out are not, but for the signature itself in a view of the model's folder (the `rule`'s),
    whose bytes must be those verified; a signed file missing is one the rule takes."""
    with_signature = rule.folder
    problems: list[str] = []
    listed: set[str] = set()
    kept: list[Companion] = []
    for companion in companions:
        origin = companion.origin

        def read(companion: Companion = companion) -> bytes:
            files = CompanionFiles([companion])
            try:
                return files.read(companion.path, 0, companion.size)
            finally:
                files.close()

        shown = str(origin.directory / companion.path) if isinstance(origin, LocalOrigin) else redact(origin.ref.url)
        if companion.path == signed.path and companion.path not in signed.files:
            if with_signature:
                try:
                    known = origin.digest if isinstance(origin, LocalOrigin) else None  # (a signature's is hashed)
                    digest = known if known is not None else hashlib.sha256(read()).digest()
                except TensorfsError as exc:
                    problems.append(str(exc))
                    continue
                if digest.hex() != signed.digest:
                    problems.append(f"{printable(shown)}: changed since it was verified")
                    continue
                verified = signed.document if len(signed.document) == companion.size else None
                kept.append(dataclasses.replace(companion, content=verified))  # served as it was verified
            continue
        if signed.is_ignored(companion.path) and companion.path not in signed.files:
            continue
        listed.add(companion.path)
        kept.append(companion)
        if companion.path not in signed.files and empty_of_ranges(signed, companion.size):
            continue  # signed as model_signing signs it (see proof/signed_model.py)
        try:
            if isinstance(origin, LocalOrigin):
                signed_content(signed, companion.path, shown, read, origin.digest)
            else:
                signed_content(signed, companion.path, shown, read)
        except TensorfsError as exc:
            problems.append(str(exc))
    for relative in sorted(set(signed.files) - listed if remote else ()):
        # (in a folder's view, the weights files are served as models of their own: not companions)
        if rule.takes(relative) and not rule.weights(relative):
            problems.append(f"{printable(relative)}: signed, but not beside the model ({signed.label})")
    if problems:
        raise refusal(problems)
    return kept
