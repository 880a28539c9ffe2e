"""Stores and their objects: S3 (and any S3-compatible store), plain HTTP(S), and the Hub; their URLs,
credentials and clients. The requests made of them: client.py; which objects are a model: finding.py.

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
import difflib
import functools
import ipaddress
import os
import re
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

from ..errors import RemoteError, TensorfsError
from ..formats import WEIGHT_FILES, is_weights_name
from ..utils.units import human_size
from .index import INDEX_NAME, is_index_name

if TYPE_CHECKING:
    from obstore.store import ObjectStore

REMOTE_SCHEMES = ("s3://", "http://", "https://", "hf://")
HF_ENDPOINT = "https://huggingface.co"


def is_remote(source: object) -> bool:
    return isinstance(source, str) and source.startswith(REMOTE_SCHEMES)


_MISTYPED_URL = re.compile(r"(?i)(s3|hf|https?)(:/{0,2}|/{2,})(?=[^/:])")
"""The start of a URL mistyped: s3:/BUCKET, hf:ORG, https//HOST, a scheme in capitals (S3:/...)."""


def location_problem(source: object) -> str | None:
    """Why `source` cannot be a model when its text says so (else None): a URL of a scheme tensorfs
    does not read, or a path that is not there whose text is a URL mistyped (s3:/BUCKET/KEY); said
    with the URL it may have meant."""
    if not isinstance(source, str) or is_remote(source):
        return None
    scheme, sep, rest = source.partition("://")
    if sep and scheme and scheme.replace("+", "").replace(".", "").replace("-", "").isalnum():
        why = f"{scheme}:// is not a source tensorfs reads (s3://, http://, https://, hf://, or a local path)"
        meant = difflib.get_close_matches(scheme.lower(), [name.removesuffix("://") for name in REMOTE_SCHEMES], 1)
        return why + (f"; did you mean {redact(f'{meant[0]}://{rest}')}?" if meant else "")
    mistyped = _MISTYPED_URL.match(source)
    if mistyped is not None and not os.path.lexists(source):
        url = redact(f"{mistyped[1].lower()}://{source[mistyped.end() :]}")
        return f"no such file or directory; did you mean {url}?"
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


def default_cache_dir() -> Path:
    """The caches' directory unless one is named (RemoteOptions.cache_dir, --cache-dir): here, not with
    the chunk cache (chunks/), which a local model never imports."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "tensorfs"


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
        # Pauses between tries grow to 5 s, and to no more than a tenth of the timeout: a short
        # timeout's last try then ends within the grace its waiters give it (waits.GRACE), and its
        # failure (a 500) is said as it is, not as a stall.
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=min(5.0, max(0.1, spec.timeout / 10))),
            "base": 2,
        },
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
    if not (is_weights_name(name) or is_index_name(name)):
        raise RemoteError(
            f"{source}: name the model's index (…/{INDEX_NAME}) or a {WEIGHT_FILES} file: HTTP has no listing"
        )
    return StoreSpec("http", base, base, timeout=options.timeout), name
