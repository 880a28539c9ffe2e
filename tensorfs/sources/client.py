"""The requests tensorfs makes of a store (obstore's client): listings, HEADs, small objects whole,
an object's first bytes, ranges of exactly one version; what a failure means, in one line. Every
answer is read as it comes, never past what was asked for, and what a server announces is checked
before anything is made of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..errors import ObjectChanged, RemoteError, TooLarge, Unexpected, printable
from ..utils.units import human_size
from .failures import failure, status_of, unsent
from .store import ObjectRef, ObjectVersion, RemoteOptions, StoreSpec, check_url, store_spec

FIRST_READ = 64 << 10
"""The first GET of a shard: its header, almost always whole (a second GET reads the rest)."""
MAX_OBJECT_BYTES = 1 << 44
"""The largest object read (16 TiB: the largest file ext4 holds, and far past any model's shard): a
size a server announces is checked against it before anything is made of it."""

MAX_LISTED = 100_000
"""Objects a listing goes through at most (a prefix holding more is not one model's)."""


@dataclass(frozen=True)
class Deadline:
    """One bound in time for a job of many requests (a listing's pages, a discovery's folders), each
    request bounded on its own too: looked at before each next one, it ends the job within
    `seconds` and the one request then under way."""

    at: float
    seconds: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def passed(self) -> bool:
        return time.monotonic() > self.at

    def check(self, where: str, what: str) -> None:
        """RemoteError ("{where}: {what} took over N s") once the deadline is past."""
        if self.passed():
            raise RemoteError(f"{where}: {what} took over {self.seconds:g} s")


def list_objects(spec: StoreSpec, prefix: str, deadline: Deadline | None = None) -> tuple[list[Any], bool]:
    """The objects under `prefix` (every level), as the store lists them a page at a time: at most
    MAX_LISTED, within --remote-timeout in all (one deadline for the whole listing, however many
    pages; or `deadline`, that of a job it is part of); (them, whether there were more). RemoteError
    if the listing fails."""
    import obstore

    deadline = deadline or Deadline.after(spec.timeout)
    found: list[Any] = []
    try:
        # The client hands on `chunk_size` objects at a time, gathered over as many pages as they
        # take: one at a time, so that the deadline is looked at with every page that holds any
        # (a store sending one object a page, a page a second, is not waited on for 1000 s).
        pages = retried(spec, lambda: obstore.list(spec.client(), prefix or None, chunk_size=1))
        for page in pages:
            # The client drops a key's trailing '/': the prefix's own folder marker (`m/`, as the S3
            # console's "Create folder" makes) comes as `m`, which is not beneath the prefix.
            found += [meta for meta in page if str(meta["path"]).startswith(prefix)]
            if len(found) > MAX_LISTED:
                return found[:MAX_LISTED], True
            deadline.check(f"{spec.url(prefix.rstrip('/'))}/", "listing")
    except RemoteError:
        raise
    except Exception as exc:
        said = failure(exc, spec)  # a 403: AccessDenied (one may read a bucket's objects and not list them)
        error = said.error if issubclass(said.error, RemoteError) else RemoteError
        raise error(f"{spec.url(prefix.rstrip('/'))}/: {said.reason}") from None
    return found, False


def exists(ref: ObjectRef) -> bool:
    """Whether the object is there (a HEAD); RemoteError when the store cannot say."""
    return head(ref) is not None


def head(ref: ObjectRef) -> ObjectVersion | None:
    """The object's version now (a HEAD), None when there is none; RemoteError when the store cannot say."""
    import obstore

    try:
        meta = retried(ref.spec, lambda: obstore.head(ref.spec.client(), ref.key))
    except FileNotFoundError:
        return None
    except Exception as exc:
        _raise(ref, exc)
        raise  # unreachable: _raise always raises
    return ObjectVersion(ref, str(meta["e_tag"] or ""), int(meta["size"]), modified(meta))


def _http_file(url: str, options: RemoteOptions) -> tuple[StoreSpec, str]:
    check_url(url)
    if "?" in url or "#" in url:
        raise RemoteError(f"{url}: URLs with a query or fragment (signed URLs) are not supported")
    base, _, name = url.rpartition("/")
    return StoreSpec("http", base, base, timeout=options.timeout), name


# -- requests ----------------------------------------------------------------------------------


def reason_of(exc: BaseException, url: str) -> str:
    """An error's message without the URL it begins with (a Problem names the URL itself)."""
    return str(exc).removeprefix(f"{url}: ")


Answer = TypeVar("Answer")


def retried(spec: StoreSpec, call: Callable[[], Answer]) -> Answer:
    """`call()` (a GET, HEAD or LIST: safe to repeat), asked again until --remote-timeout while
    its request fails before any answer comes.

    The client retries most such failures itself, but not a connection closed before the request
    went out ("connection was not ready"), as by a store or balancer that accepts connections
    and drops them while it restarts.
    """
    deadline = time.monotonic() + spec.timeout
    pause = 0.1
    while True:
        try:
            return call()
        except Exception as exc:
            if not unsent(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(5.0, 2 * pause)


def _raise(ref: ObjectRef, exc: BaseException) -> None:
    """The error (failures.py) for the client's `exc`, said of the object."""
    said = failure(exc, ref.spec)
    raise said.error(f"{ref.url}: {said.reason}") from None


def _plain(ref: ObjectRef, result: Any) -> None:
    """Unexpected unless the answer holds the object's bytes as they are (asked for: Accept-Encoding: identity)."""
    encoding = str(result.attributes.get("Content-Encoding") or "identity").strip()
    if encoding.lower() != "identity":
        raise Unexpected(
            f"{ref.url}: the server sent it {printable(encoding)}-encoded (Content-Encoding), though asked for "
            "its bytes as they are: refused (serve it without compression)"
        )


def _body(ref: ObjectRef, result: Any, limit: int, what: str) -> bytes:
    """An answer's body, read as it comes and never past `limit` bytes (`what` says why that bound)."""
    _plain(ref, result)
    pieces: list[bytes] = []
    held = 0
    for piece in result.stream(min_chunk_size=_PIECE):
        held += len(piece)
        if held > limit:
            raise (TooLarge if what == "size" else Unexpected)(
                f"{ref.url}: over {human_size(limit)}" if what == "size"
                else f"{ref.url}: the server sent more than the {limit} bytes asked for: refused"
            )  # fmt: skip
        pieces.append(bytes(piece))
    return b"".join(pieces)


def get_whole(ref: ObjectRef, limit: int) -> bytes:
    """A small object whole (an index, a manifest, a companion file); FileNotFoundError when there is none.

    TooLarge when it holds more than `limit` bytes: before its body is read when the store says so,
    as soon as the body goes past it when the store said less.
    """
    import obstore

    try:
        result = retried(ref.spec, lambda: obstore.get(ref.spec.client(), ref.key))
        size = int(result.meta["size"])
        if size > limit:
            raise TooLarge(f"{ref.url}: {size} bytes, over {human_size(limit)}")
        return _body(ref, result, limit, "size")
    except RemoteError:
        raise
    except Exception as exc:
        _raise(ref, exc)
        raise  # unreachable: _raise always raises


def read_url(url: str, options: RemoteOptions, limit: int) -> bytes:
    """A small remote file whole (a manifest), named by its URL; TooLarge past `limit` bytes."""
    spec, key = store_spec(url, options) if not url.startswith(("http://", "https://")) else _http_file(url, options)
    return get_whole(ObjectRef(spec, key), limit)


def read_first_bytes(ref: ObjectRef, needed: Callable[[bytes, int], int]) -> tuple[ObjectVersion, bytes]:
    """The object's version and its first bytes, as many as `needed(first, size)` says its format's
    table takes (told from the first FIRST_READ of them, then from all that came): one GET, two when
    a safetensors header is longer, a few more for a long GGUF table (twice as many bytes each time).

    RemoteError (or FileNotFoundError) when the store does not give them.
    """
    import obstore

    client = ref.spec.client()
    try:
        first = retried(ref.spec, lambda: obstore.get(client, ref.key, options={"range": (0, FIRST_READ)}))
        meta = first.meta
        version = ObjectVersion(ref, str(meta["e_tag"] or ""), int(meta["size"]), modified(meta))
        if version.size > MAX_OBJECT_BYTES:  # before anything is sized by it (a cache file, its chunks' table)
            raise TooLarge(
                f"{ref.url}: announced at {version.size:,} bytes, over the {human_size(MAX_OBJECT_BYTES)} an object "
                "may be here"
            )
        head = _body(ref, first, min(FIRST_READ, version.size), "range")
    except RemoteError:
        raise
    except Exception as exc:
        if status_of(exc) == 416:  # nothing at offset 0: an empty object
            return _empty(ref, client)
        _raise(ref, exc)
        raise
    # A format that tells its table's length from its first bytes asks once more at most; one that
    # can only tell how far it got (GGUF) asks for twice as much each time, up to its own bound.
    buffer = bytearray(head)
    while (end := min(needed(bytes(buffer), version.size), version.size)) > len(buffer):
        read_range(version, len(buffer), end, lambda _, piece: buffer.extend(piece))
    return version, bytes(buffer[:end])


def _empty(ref: ObjectRef, client: Any) -> tuple[ObjectVersion, bytes]:
    """An object that has no byte at offset 0: its version, as a HEAD says it, and no bytes."""
    import obstore

    try:
        meta = retried(ref.spec, lambda: obstore.head(client, ref.key))
    except Exception as exc:
        _raise(ref, exc)
        raise  # unreachable: _raise always raises
    return ObjectVersion(ref, str(meta["e_tag"] or ""), int(meta["size"]), modified(meta)), b""


def read_range(version: ObjectVersion, start: int, end: int, write: Callable[[int, bytes], object]) -> None:
    """Bytes [start, end) of exactly this version of the object (If-Match its ETag), handed to
    `write(offset, piece)` as they come: memory stays small however large the range, and no piece
    is handed on that would go past `end`.

    ObjectChanged if the store has another version (or a short one) now; Unexpected if it sends
    more than the range, or encoded; RemoteError if it cannot say; an OSError of `write` as it is.
    """
    import obstore

    ref = version.ref
    options: dict[str, Any] = {"range": (start, end)}
    if version.etag:
        options["if_match"] = version.etag
    elif version.mtime:  # a server without ETags: its Last-Modified (to the second) stands for the version
        options["if_unmodified_since"] = datetime.fromtimestamp(version.mtime, UTC)
    offset = start
    unwritten: OSError | None = None
    try:
        result = retried(ref.spec, lambda: obstore.get(ref.spec.client(), ref.key, options=options))  # type: ignore[arg-type]
        _same_version(version, result.meta)  # a server may ignore the condition: the answer says
        _plain(ref, result)
        for piece in result.stream(min_chunk_size=_PIECE):
            if offset + len(piece) > end:
                raise Unexpected(
                    f"{ref.url}: the server sent more than the {end - start} bytes of [{start}, {end}) "
                    "asked for: refused"
                )
            try:
                write(offset, piece)
            except OSError as exc:  # the writer's, not the store's
                unwritten = exc
                break
            offset += len(piece)
    except RemoteError:
        raise
    except Exception as exc:
        _raise(ref, exc)
    if unwritten is not None:
        raise unwritten
    if offset != end:
        came = offset - start
        raise ObjectChanged(f"{ref.url}: {came} bytes came for [{start}, {end}): it changed since it was validated")


# Pieces written to the cache as they arrive: big enough to keep syscalls few, small enough that
# a fetch thread holds little memory (docs/performance.md).
_PIECE = 256 << 10


def _same_version(version: ObjectVersion, meta: Any) -> None:
    """ObjectChanged unless a response's object is the version validated (ETag, else size and Last-Modified)."""
    etag = str(meta.get("e_tag") or "")
    mtime = modified(meta)
    if (
        int(meta["size"]) != version.size
        or (etag and version.etag and etag != version.etag)
        or (not version.etag and mtime and version.mtime and mtime != version.mtime)
    ):
        raise ObjectChanged(f"{version.url}: changed since it was validated")


def modified(meta: Any) -> float:
    """An object's Last-Modified, in seconds since the epoch (0: none said)."""
    modified = meta.get("last_modified")
    return float(modified.timestamp()) if modified is not None else 0.0
