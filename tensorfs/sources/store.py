"""Shards that are objects in a store: S3 (and any S3-compatible store), plain HTTP(S), and the Hub.

The client is obstore (the best measured here: docs/performance.md). Everything about a store is kept in a
StoreSpec, a picklable recipe, so that the daemon makes its own client from what the command
validated. Each object is read at a version: the ETag and size seen when its header was read;
every later GET is conditional on that ETag (If-Match), so versions are never mixed.

    s3://BUCKET/PREFIX            every *.safetensors under PREFIX/ (not recursive), or the index there
    s3://BUCKET/KEY.safetensors   one object (and KEY.index.json: an index, its shards beside it)
    http(s)://HOST/.../NAME.safetensors, or .../model.safetensors.index.json (no listing over HTTP)
    hf://ORG/NAME[@REVISION]      the Hub: {HF_ENDPOINT}/ORG/NAME/resolve/REVISION/FILE (and hf://.../FILE)
"""

from __future__ import annotations

import configparser
import functools
import ipaddress
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

from ..errors import AccessDenied, ObjectChanged, RemoteError, TensorfsError, TooLarge, Unexpected, printable
from ..formats import WEIGHT_FILES, is_weights_name
from ..units import human_size
from .index import INDEX_NAME

if TYPE_CHECKING:
    from obstore.store import ObjectStore

REMOTE_SCHEMES = ("s3://", "http://", "https://", "hf://")
FIRST_READ = 64 << 10
MAX_OBJECT_BYTES = 1 << 44
"""The largest object read (16 TiB: the largest file ext4 holds, and far past any model's shard): a
size a server announces is checked against it before anything is made of it."""
"""The first GET of a shard: its header, almost always whole (a second GET reads the rest)."""
HF_ENDPOINT = "https://huggingface.co"


def is_remote(source: object) -> bool:
    return isinstance(source, str) and source.startswith(REMOTE_SCHEMES)


def unsupported_scheme(source: object) -> str | None:
    """Why `source` cannot be a model when it is a URL of a scheme tensorfs does not read (else None)."""
    if not isinstance(source, str) or is_remote(source):
        return None
    scheme, sep, _ = source.partition("://")
    if sep and scheme and scheme.replace("+", "").replace(".", "").replace("-", "").isalnum():
        return f"{scheme}:// is not a source tensorfs reads (s3://, http://, https://, hf://, or a local path)"
    return None


CREDENTIALS_HINT = (
    "credentials in a URL are never sent, and would show in /proc/mounts, logs and records: for S3 set "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), for the Hub HF_TOKEN"
)


def check_url(url: str, what: str = "") -> None:
    """RemoteError (the URL shown without its secret) for a URL that carries credentials (user:password@)."""
    if "@" in urlsplit(url).netloc:
        raise RemoteError(f"{redact(url)}: {what + ': ' if what else ''}{CREDENTIALS_HINT}")


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s\"']*@")


def redact(text: str) -> str:
    """`text` with the user:password of any URL in it replaced by ***."""
    return _USERINFO.sub(r"\1***@", text)


def model_key(source: str, options: RemoteOptions) -> str:
    """One name for one model however its URL is written: hf://ORG/NAME is hf://ORG/NAME@main."""
    spec, key = store_spec(source, options)
    return spec.url(key)


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach stores, and the local cache that remote shards are read through."""

    endpoint_url: str | None = None
    """An S3-compatible endpoint (AWS_ENDPOINT_URL also sets it)."""
    region: str | None = None
    no_sign_request: bool = False
    """Anonymous requests (public buckets)."""
    cache_dir: Path | None = None
    """Default: $XDG_CACHE_HOME/tensorfs (~/.cache/tensorfs)."""
    cache_size: int | None = None
    """Bytes the cache may hold (least recently used chunks go first); None: no bound."""
    chunk_size: int = 8 << 20
    concurrency: int = 8
    """GETs at once."""
    timeout: float = 60.0
    """Seconds a read may wait on the store, retries included, before it fails."""
    offline: bool = False
    """Only what is cached: no request is made."""

    def __post_init__(self) -> None:
        if self.cache_dir is not None and not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))  # a string is meant as a path
        if self.cache_size is not None and self.cache_size < 2 * self.chunk_size:
            raise TensorfsError(
                f"--cache-size {human_size(self.cache_size)} holds less than two chunks of "
                f"{human_size(self.chunk_size)} (a read may span two): raise it, or lower --chunk-mb"
            )


@dataclass(frozen=True)
class StoreSpec:
    """A store, as a recipe that any process can make a client from (see client())."""

    kind: Literal["s3", "http"]
    root: str
    """The bucket (s3), or the base URL without a trailing slash (http)."""
    scheme_root: str
    """What URLs of its objects begin with: s3://BUCKET, the base URL, hf://ORG/NAME@REV."""
    endpoint_url: str | None = None
    region: str | None = None
    no_sign: bool = False
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    timeout: float = 60.0

    def url(self, key: str) -> str:
        return f"{self.scheme_root}/{key}" if key else self.scheme_root

    def client(self) -> ObjectStore:
        """An obstore client for this store: one per process and recipe (they are thread-safe).

        obstore's runtime does not survive a fork: a process forked after obstore was used hangs
        on its first request. That is a bug of the caller, told here rather than as a hang.
        """
        global _used_in
        with _clients_lock:
            if _used_in is not None and _used_in != os.getpid():
                raise RuntimeError(
                    f"obstore was used in process {_used_in}, which forked this one: it cannot work here"
                )
            _used_in = os.getpid()
            store = _clients.get(self)
            if store is None:
                store = _clients[self] = _make_client(self)
            return store


_clients: dict[StoreSpec, Any] = {}
_clients_lock = threading.Lock()
_used_in: int | None = None  # the process whose obstore runtime is running


def _make_client(spec: StoreSpec) -> ObjectStore:
    from obstore.store import HTTPStore, S3Store

    timeout = timedelta(seconds=spec.timeout)
    retry = {
        "max_retries": 1_000_000,  # the time is the bound (--remote-timeout), not a count
        "retry_timeout": timeout,
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2},
    }
    client: dict[str, Any] = {"timeout": timeout, "connect_timeout": timedelta(seconds=min(10.0, spec.timeout))}
    # The bytes as they are stored: a compressed answer is refused (see _plain), never taken for them.
    client["default_headers"] = {"Accept-Encoding": "identity", **dict(spec.headers)}
    if spec.kind == "http":
        # An https:// model's requests (and the redirects they follow) are https:// only: allow_http
        # off is reqwest's https_only, which refuses a redirect down to http://.
        client["allow_http"] = spec.root.startswith("http://")
        _refuse_link_local(client)
        return HTTPStore.from_url(spec.root, client_options=client, retry_config=retry)  # type: ignore[arg-type]
    config: dict[str, Any] = {}
    endpoint = spec.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    if endpoint:
        check_url(endpoint, "the endpoint")
        config["endpoint"] = endpoint
        config["virtual_hosted_style_request"] = False  # S3-compatible stores want the bucket in the path
        client["allow_http"] = endpoint.startswith("http://")
    profile = _profile()
    region = spec.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    config["region"] = region or profile.get("region") or "us-east-1"
    if spec.no_sign:
        config["skip_signature"] = True
    elif not os.environ.get("AWS_ACCESS_KEY_ID") and profile.get("aws_access_key_id"):
        # The shared credentials file (obstore reads the environment and instance metadata itself).
        config["access_key_id"] = profile["aws_access_key_id"]
        config["secret_access_key"] = profile.get("aws_secret_access_key", "")
        if profile.get("aws_session_token"):
            config["token"] = profile["aws_session_token"]
    if spec.no_sign or os.environ.get("AWS_ACCESS_KEY_ID") or "access_key_id" in config:
        _refuse_link_local(client)  # (else the credentials may be the instance's: at a link-local address)
    return S3Store(spec.root, config=config, client_options=client, retry_config=retry)  # type: ignore[arg-type]


# -- redirects ----------------------------------------------------------------------------------
#
# obstore 0.12 (object_store 0.12) follows redirects itself, as reqwest does by default: at most 10,
# to any address, and cannot be told otherwise (its client options have no redirect policy). What it
# can be told is which addresses go through a proxy: every request for a link-local or cloud-metadata
# address written as an IP (in a model's URL, or in a redirect's Location) is sent to a proxy that is
# not there, and fails; every other request goes straight to its server, as before.

REFUSED_NETWORKS = (
    "169.254.0.0/16",  # IPv4 link-local: the metadata services of AWS, GCP, Azure, OpenStack, ECS
    "fe80::/10",  # IPv6 link-local
    "fd00:ec2::254/128",  # AWS's metadata service over IPv6
    "100.100.100.200/32",  # Alibaba Cloud's metadata service
)
"""Addresses no request of tensorfs's goes to (nor is redirected to)."""

NOWHERE = "127.0.169.254:1"
"""The proxy those requests are sent to: a port only root may listen on, where nothing does."""

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _refuse_link_local(client: dict[str, Any]) -> None:
    """Client options under which no request reaches a REFUSED_NETWORKS address written as an IP.

    Not when a proxy is set in the environment: a proxy given to the client replaces those, and the
    user's proxy is then what decides where requests go."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    client["proxy_url"] = f"http://{NOWHERE}"
    client["proxy_excludes"] = _direct()


@functools.cache
def _direct() -> str:
    """reqwest's no-proxy list for every host name ("*") and every address but REFUSED_NETWORKS
    (an IP is matched by address ranges only; IPv4 within IPv6 too: ::ffff:169.254.169.254)."""
    refused = [ipaddress.ip_network(text) for text in REFUSED_NETWORKS]
    refused += [
        ipaddress.ip_network(f"::ffff:{n.network_address}/{96 + n.prefixlen}") for n in refused if n.version == 4
    ]
    allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = [
        ipaddress.ip_network("0.0.0.0/0"),
        ipaddress.ip_network("::/0"),
    ]
    for network in refused:
        kept: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for piece in allowed:
            if piece.version == network.version and network.subnet_of(piece):  # type: ignore[arg-type]
                kept.extend(piece.address_exclude(network))  # type: ignore[arg-type]
            else:
                kept.append(piece)
        allowed = kept
    return ",".join(["*", *(str(network) for network in allowed)])


def _profile() -> dict[str, str]:
    """The AWS profile's settings from ~/.aws/credentials and ~/.aws/config (AWS_PROFILE, default 'default')."""
    name = os.environ.get("AWS_PROFILE") or "default"
    found: dict[str, str] = {}
    files = (
        (os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config", "default" if name == "default" else f"profile {name}"),
        (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials", name),
    )
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(os.path.expanduser(path), encoding="utf-8")
        except (OSError, configparser.Error):
            continue
        if parser.has_section(section):
            found.update(parser.items(section))
    return found


def _hf_token() -> str | None:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token.strip()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    for path in (os.environ.get("HF_TOKEN_PATH"), os.path.join(home, "token")):
        if path:
            try:
                return Path(os.path.expanduser(path)).read_text().strip() or None
            except OSError:
                continue
    return None


# -- objects and where a model's are ---------------------------------------------------------


@dataclass(frozen=True)
class ObjectRef:
    """An object of a store (not yet a version of it)."""

    spec: StoreSpec
    key: str

    @property
    def url(self) -> str:
        return self.spec.url(self.key)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def sibling(self, name: str) -> ObjectRef:
        directory = self.key.rpartition("/")[0]
        return ObjectRef(self.spec, f"{directory}/{name}" if directory else name)


@dataclass(frozen=True)
class ObjectVersion:
    """An object as it was when its header was read: every later GET must find the same one."""

    ref: ObjectRef
    etag: str
    size: int
    mtime: float
    """Last-Modified, in seconds since the epoch."""

    @property
    def url(self) -> str:
        return self.ref.url


def store_spec(source: str, options: RemoteOptions) -> tuple[StoreSpec, str]:
    """(the store, the key or prefix within it) of a model's URL."""
    check_url(source)
    if source.startswith("s3://"):
        bucket, _, key = source[len("s3://") :].partition("/")
        if not bucket:
            raise RemoteError(f"{source}: no bucket: s3://BUCKET/PREFIX")
        spec = StoreSpec(
            "s3", bucket, f"s3://{bucket}", options.endpoint_url, options.region, options.no_sign_request,
            timeout=options.timeout,
        )  # fmt: skip
        return spec, key.strip("/")
    if source.startswith("hf://"):
        org, _, rest = source[len("hf://") :].strip("/").partition("/")
        name_revision, _, key = rest.partition("/")
        name, _, revision = name_revision.partition("@")
        if not org or not name:
            raise RemoteError(f"{source}: a Hub model is hf://ORG/NAME or hf://ORG/NAME@REVISION")
        repo, revision = f"{org}/{name}", revision or "main"
        endpoint = (os.environ.get("HF_ENDPOINT") or HF_ENDPOINT).rstrip("/")
        check_url(endpoint, "HF_ENDPOINT")
        token = None if options.no_sign_request else _hf_token()
        headers = (("Authorization", f"Bearer {token}"),) if token else ()
        base = f"{endpoint}/{repo}/resolve/{revision}"
        return StoreSpec("http", base, f"hf://{repo}@{revision}", headers=headers, timeout=options.timeout), key
    if "?" in source or "#" in source:
        raise RemoteError(f"{source}: URLs with a query or fragment (signed URLs) are not supported")
    base, _, name = source.rstrip("/").rpartition("/")
    name = unquote(name)  # the store's client escapes what the key needs: %20 must not become %2520
    if not (is_weights_name(name) or name.endswith(".index.json")):
        raise RemoteError(
            f"{source}: name the model's index (…/{INDEX_NAME}) or a {WEIGHT_FILES} file: HTTP has no listing"
        )
    return StoreSpec("http", base, base, timeout=options.timeout), name


MAX_LISTED = 100_000
"""Objects a listing goes through at most (a prefix holding more is not one model's)."""


def list_objects(spec: StoreSpec, prefix: str) -> tuple[list[Any], bool]:
    """The objects under `prefix` (every level), as the store lists them a page at a time: at most
    MAX_LISTED, within --remote-timeout in all; (them, whether there were more). RemoteError if the
    listing fails."""
    import obstore

    deadline = time.monotonic() + spec.timeout
    found: list[Any] = []
    try:
        pages = retried(spec, lambda: obstore.list(spec.client(), prefix or None, chunk_size=1000))
        for page in pages:
            found += page
            if len(found) > MAX_LISTED:
                return found[:MAX_LISTED], True
            if time.monotonic() > deadline:
                raise RemoteError(f"{spec.url(prefix.rstrip('/'))}/: listing took over {spec.timeout:g} s")
    except RemoteError:
        raise
    except Exception as exc:
        raise RemoteError(f"{spec.url(prefix.rstrip('/'))}/: {describe_error(exc)}") from None
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


ACCESS_HINT = "check the credentials and the bucket's policy (AWS_*, a profile, HF_TOKEN)"


def describe_error(exc: BaseException) -> str:
    """One line on why a request failed (no URL's secret in it)."""
    from obstore import exceptions as errors

    if isinstance(exc, FileNotFoundError):
        return "not found (404)"
    text = redact(str(exc))
    status = re.search(r"status code: (\d{3}[^:\n]*)", text)
    code = status.group(1)[:3] if status else ""
    if isinstance(exc, errors.PermissionDeniedError) or code == "403":
        return f"access denied (403): {ACCESS_HINT}"
    if isinstance(exc, errors.UnauthenticatedError) or code == "401":
        return f"authentication required (401): {ACCESS_HINT}"
    if isinstance(exc, errors.PreconditionError) or "412 Precondition Failed" in text:
        return "changed since it was validated (its ETag differs): mount it again"
    if "/latest/api/token" in text or "/latest/meta-data/" in text or "credential" in text.lower():
        # No credentials configured: the client looked for an instance's (EC2 metadata), and found none.
        return f"no credentials found: {ACCESS_HINT}, or --no-sign-request for a public bucket"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "error following redirect" in text:  # reqwest's: https_only (allow_http off), or too many
        return "a redirect not followed (https:// to http://, or more than 10 in a row)"
    if re.search(rf"\b{re.escape(NOWHERE)}\b", text):  # sent to the proxy that is not there: see REFUSED_NETWORKS
        return "refused: a link-local or cloud-metadata address (where the server redirected it?)"
    if status:  # not the body that came with it (an HTML page, an XML error)
        return f"the server answered {printable(status.group(1).strip())}"
    if "error sending request" in first or "ConnectError" in text:
        # obstore's debug text ends with the cause: connection refused, a DNS failure, TLS
        causes = re.findall(r'(?:message|error): "([^"]+)"', text) or re.findall(r'ConnectError\(\s*"([^"]+)"', text)
        return f"unreachable ({printable(causes[-1])})" if causes else "unreachable"
    reason = first.rsplit(" - ", 1)[-1]  # after "Error performing GET URL in 2s, after 3 retries, ... - "
    return printable(reason[:300])


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
            if "error sending request" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(5.0, 2 * pause)


def _raise(ref: ObjectRef, exc: BaseException) -> None:
    message = f"{ref.url}: {describe_error(exc)}"
    if isinstance(exc, FileNotFoundError):
        raise FileNotFoundError(message) from None
    from obstore import exceptions as errors

    if isinstance(exc, errors.PreconditionError) or "412 Precondition Failed" in str(exc):
        raise ObjectChanged(message) from None
    if isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)) or ACCESS_HINT in message:
        raise AccessDenied(message) from None
    raise RemoteError(message) from None


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
        if "416" in str(exc):  # nothing at offset 0: an empty object
            meta = retried(ref.spec, lambda: obstore.head(client, ref.key))
            return ObjectVersion(ref, str(meta["e_tag"] or ""), int(meta["size"]), modified(meta)), b""
        _raise(ref, exc)
        raise
    # A format that tells its table's length from its first bytes asks once more at most; one that
    # can only tell how far it got (GGUF) asks for twice as much each time, up to its own bound.
    buffer = bytearray(head)
    while (end := min(needed(bytes(buffer), version.size), version.size)) > len(buffer):
        read_range(version, len(buffer), end, lambda _, piece: buffer.extend(piece))
    return version, bytes(buffer[:end])


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
