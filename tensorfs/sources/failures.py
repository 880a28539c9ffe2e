"""What a failed request to a store means, in one place: the error tensorfs raises for it and why,
in one line (no URL's secret in it).

obstore says most kinds by the exception's type (obstore.exceptions: a 404 is a FileNotFoundError,
a 403 PermissionDeniedError, 401 UnauthenticatedError, 412 PreconditionError; a range answered
with the whole body NotSupportedError; a listing's key that is no path InvalidPathError), and
those are told by the type alone. Everything else is its GenericError (a listing's 403 too, a
timeout, a body cut short, a redirect refused, a server unreachable), which has no finer type: for
it, the HTTP status its answer had decides first, as the same table says, then what its text says
of the failure (the client's debug text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AccessDenied, ObjectChanged, RemoteError, printable
from .store import NOWHERE, StoreSpec, redact


@dataclass(frozen=True)
class Failure:
    """A failed request: the error to raise for it, and why in one line."""

    error: type[Exception]
    reason: str


def access_hint(spec: StoreSpec) -> str:
    """What to check when a store refuses a request (401, 403), by the kind of store it is."""
    if spec.kind == "s3":
        return (
            "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the bucket's "
            "policy; --no-sign-request for a public bucket"
        )
    if spec.scheme_root.startswith("hf://"):
        if any(name == "Authorization" for name, _ in spec.headers):
            return "the Hub's token given (HF_TOKEN, or $HF_HOME/token) may not read this repository: is it gated?"
        return (
            "a private or gated repository needs a token that may read it (HF_TOKEN, or `hf auth login`); the Hub "
            "answers so for a repository that does not exist, too"
        )
    return "tensorfs sends no credentials to an HTTP(S) server: check the URL, and that the server lets it be read"


RANGE_NEEDED = (
    "the server does not answer Range requests (it sent the whole file for a range): tensorfs reads a model's "
    "files by ranges; serve them from a server that does (nginx, Apache, any S3 store; not `python -m http.server`)"
)
CHANGED = "changed since it was validated (its ETag differs): mount it again"

_STATUS = re.compile(r"status code: (\d{3}[^:\n]*)")  # how the client's errors say the server's answer


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a store's answer had, when a request failed on one (never a number found elsewhere
    in the text: a port, a time)."""
    found = _STATUS.search(str(exc))
    return int(found.group(1)[:3]) if found else None


def unsent(exc: BaseException) -> bool:
    """Whether a request failed before it went out ("connection was not ready": a store or balancer
    that accepts connections and drops them while it restarts): safe to send again."""
    from obstore import exceptions as errors

    return isinstance(exc, errors.GenericError) and "error sending request" in str(exc)


def _denied(spec: StoreSpec) -> Failure:
    return Failure(AccessDenied, f"access denied (403): {access_hint(spec)}")


def _unauthenticated(spec: StoreSpec) -> Failure:
    return Failure(AccessDenied, f"authentication required (401): {access_hint(spec)}")


_BY_STATUS: dict[int, Callable[[StoreSpec], Failure]] = {
    401: _unauthenticated,
    403: _denied,
    412: lambda spec: Failure(ObjectChanged, CHANGED),
}
"""The statuses that say a kind, whichever exception carries them."""


def failure(exc: BaseException, spec: StoreSpec) -> Failure:
    """What the client's error `exc`, of a request to `spec`'s store, means."""
    from obstore import exceptions as errors

    if isinstance(exc, FileNotFoundError):
        return Failure(FileNotFoundError, "not found (404)")
    if isinstance(exc, errors.PermissionDeniedError):
        return _denied(spec)
    if isinstance(exc, errors.UnauthenticatedError):
        return _unauthenticated(spec)
    if isinstance(exc, errors.PreconditionError):
        return Failure(ObjectChanged, CHANGED)
    if isinstance(exc, errors.NotSupportedError):  # a range GET answered 200 with the whole body (HTTP)
        return Failure(RemoteError, RANGE_NEEDED)
    text = redact(str(exc))
    if isinstance(exc, errors.InvalidPathError):  # obstore parses every key of a listing, and gives up at one
        key = re.search(r'Path "((?:[^"\\]|\\.)*)"', text)
        shown = f" ('{printable(key.group(1)[:200])}')" if key else ""
        return Failure(
            RemoteError,
            f"the listing holds a key that is no plain path{shown}, which the store's client refuses to list past",
        )
    status = status_of(exc)
    if status in _BY_STATUS:
        return _BY_STATUS[status](spec)
    return Failure(RemoteError, _generic(text, spec))


def _generic(text: str, spec: StoreSpec) -> str:
    """Why a request failed, as the client's generic error says it (its debug text)."""
    if spec.kind == "s3" and (
        "/latest/api/token" in text or "/latest/meta-data/" in text or "credential" in text.lower()
    ):
        # No credentials configured: the client looked for an instance's (EC2 metadata), and found none.
        return f"no credentials found: {access_hint(spec)}"
    first = text.strip().splitlines()[0] if text.strip() else "GenericError"
    if "error following redirect" in text:  # reqwest's: https_only (allow_http off), or too many
        return "a redirect not followed (https:// to http://, or more than 10 in a row)"
    if re.search(rf"\b{re.escape(NOWHERE)}\b", text):  # sent to the proxy that is not there: see REFUSED_NETWORKS
        return "refused: a link-local or cloud-metadata address (where the server redirected it?)"
    listing = re.search(r"Got invalid list response: ([^\n]*)", text)
    if listing:
        return f"the store's answer is not a listing (S3's ListObjectsV2): {printable(listing.group(1)[:200])}"
    if "RangeNotSupported" in text or "NotPartial" in text:
        return "the server ignored the byte range asked for (it sent the whole object): refused"
    other_range = re.search(r"expected: (\d+)\.\.(\d+),\s*actual: (\d+)\.\.(\d+)", text)
    if other_range:
        asked, sent = other_range.groups()[:2], other_range.groups()[2:]
        return f"the server sent bytes [{sent[0]}, {sent[1]}) for the [{asked[0]}, {asked[1]}) asked for: refused"
    if "kind: Timeout" in text or "TimedOut" in text:
        return "no answer within --remote-timeout (the store, or the connection to it, stalled)"
    if "IncompleteBody" in text or "kind: Body" in text:
        return "the answer ended before all its bytes came (the connection was cut)"
    status = _STATUS.search(text)
    if status:  # not the body that came with it (an HTML page, an XML error)
        return f"the server answered {printable(status.group(1).strip())}"
    if "error sending request" in first or "ConnectError" in text:
        # obstore's debug text ends with the cause: connection refused, a DNS failure, TLS
        causes = re.findall(r'(?:message|error): "([^"]+)"', text) or re.findall(r'ConnectError\(\s*"([^"]+)"', text)
        return f"unreachable ({printable(causes[-1])})" if causes else "unreachable"
    reason = first.rsplit(" - ", 1)[-1]  # after "Error performing GET URL in 2s, after 3 retries, ... - "
    return printable(reason[:300])
