"""A fleet's parts on one machine, for the tests and the benchmark of fleets: a distributed store, a
caching tier in front of it, and nodes that reach both over a network interface of their own.

- SeaweedCluster: SeaweedFS as a cluster, not one process: a master, three volume servers, a filer
  and its S3 gateway, each a process a test can kill and start again, on 127.0.0.1 only, all their
  state in one directory. The master's default replication is 001 (each volume on two servers):
  any one volume server can die, even under a GET streaming from it, and every object still reads.
  Each process runs as servers.py's SeaweedFS does (a mount namespace of its own, its /tmp a
  directory of ours: no two processes share gRPC sockets, they talk over TCP as on several
  machines). It runs beside the tests' one-process SeaweedFS: a second SeaweedFS whose S3 gateway
  keeps its fixed default Iceberg and Lance ports (8181, 9101) exits at once; both are turned off.

- CachingTier: nginx in front of the store (proxy_cache, slices of 8 MiB), its configuration
  rendered from contrib/nginx-tier.conf, the file operators use (one source of truth: what is
  tested is what ships). Nodes mount a model through it as an http:// model. The tier reads the
  store anonymously: the cluster lets anyone read the buckets named `readable`, and nothing else.
  The other way, the tier holding the store's credentials, needs a request signer (SigV4) nginx
  does not have without a third-party module, and would give whoever reaches the tier no less than
  an anonymous read does. What a pinned read (If-Match) and an unpinned one get from the tier is
  said in that file.

The nodes that reach them, and the relay they go through: nodes.py.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .servers import (
    SeaweedFS,
    free_ports,
    nginx_temp_paths,
    remove_weed_sockets,
    start_nginx,
    start_weed,
    stop,
    wait_http,
    weed_root,
    write_s3_config,
)

TIER_TEMPLATE = Path(__file__).resolve().parents[2] / "contrib" / "nginx-tier.conf"
"""The tier's configuration as it ships (a checkout's: tests and benchmarks run from one)."""


def _until(condition: Callable[[], bool], what: str, seconds: float, alive: Callable[[], str | None]) -> None:
    """Poll `condition` until it holds; RuntimeError at the deadline, or as soon as `alive()` names a
    process that died meanwhile."""
    deadline = time.monotonic() + seconds
    while not condition():
        dead = alive()
        if dead is not None:
            raise RuntimeError(f"{dead} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.05)


def _get_json(url: str) -> object:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


# -- the store -------------------------------------------------------------------------------------


class SeaweedCluster(SeaweedFS):
    """A SeaweedFS cluster with S3 on free ports of 127.0.0.1: endpoint, env() and store() as
    SeaweedFS's; `readable` buckets anyone may read (the tier does) without credentials."""

    VOLUMES = 3

    def __init__(self, directory: Path, *, readable: Sequence[str] = (), replication: str = "001") -> None:
        super().__init__(directory)
        self.readable = tuple(readable)
        self.replication = replication
        self.roles = ("master", *(f"volume{i}" for i in range(self.VOLUMES)), "filer", "s3")
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._killed: set[str] = set()
        """Roles a test stopped: their exit is no failure of the cluster."""
        self.ports: dict[str, tuple[int, int]] = {}
        """Each process's (HTTP, gRPC) ports."""
        self.metrics_port = 0
        """The S3 gateway's Prometheus metrics (what it sent, by bucket)."""

    def address(self, role: str) -> str:
        """How weed names a server of the cluster: host:port.grpcport."""
        http, grpc = self.ports[role]
        return f"127.0.0.1:{http}.{grpc}"

    def _arguments(self, role: str) -> list[str]:
        root = weed_root(self.directory)
        http, grpc = self.ports[role]
        kind = "volume" if role.startswith("volume") else role
        common = [f"-logdir={root}/{role}", kind, "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={http}",
                  f"-port.grpc={grpc}"]  # fmt: skip
        if kind == "master":
            # One master needs no quorum (-peers=none); small volumes spread a model over all servers.
            return [*common, f"-mdir={root}/master", f"-defaultReplication={self.replication}", "-peers=none",
                    "-telemetry=false", "-volumeSizeLimitMB=128"]  # fmt: skip
        if kind == "volume":
            return [*common, f"-dir={root}/{role}", f"-master={self.address('master')}", "-max=0",
                    "-preStopSeconds=0"]  # fmt: skip
        if kind == "filer":
            return [*common, f"-master={self.address('master')}", f"-defaultStoreDir={root}/filer",
                    f"-localSocket={root}/filer.sock"]  # fmt: skip
        return [*common, f"-filer={self.address('filer')}", f"-config={root}/s3.json",
                f"-localSocket={root}/s3.sock", "-port.iceberg=0", "-port.lance=0",
                "-metricsIp=127.0.0.1", f"-metricsPort={self.metrics_port}"]  # fmt: skip

    def _start(self, role: str) -> None:
        d = self.directory
        (d / role).mkdir(parents=True, exist_ok=True)
        self.processes[role] = start_weed(d, self._arguments(role), tmp=d / "tmp" / role, log=d / role / "stdout.log")
        self._killed.discard(role)

    def _kill(self, role: str) -> None:
        self._killed.add(role)
        stop(self.processes[role])

    def _dead(self) -> str | None:
        for role, process in self.processes.items():
            if role not in self._killed and process.poll() is not None:
                return f"SeaweedFS's {role} (status {process.returncode}, see {self.directory / role})"
        return None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_s3_config(self.directory / "s3.json", self.readable)
        *ports, self.metrics_port = free_ports(2 * len(self.roles) + 1)
        self.ports = {role: (ports[2 * i], ports[2 * i + 1]) for i, role in enumerate(self.roles)}
        self.s3_port = self.ports["s3"][0]
        self._grpc = [grpc for _, grpc in self.ports.values()]
        try:
            # Each after the server it needs answers: one started before finds nothing, and tries
            # again only seconds later (a filer before its master, 7 s).
            self._start("master")
            _until(lambda: self._answers("master"), "the master", 60, self._dead)
            for role in self.roles[1:-1]:
                self._start(role)
            wanted = set(range(self.VOLUMES))
            _until(lambda: self._answers("filer"), "the filer", 60, self._dead)
            self._start("s3")
            _until(lambda: self.registered() == wanted, "the volume servers to register", 60, self._dead)
            _until(lambda: self._answers("s3"), "the S3 gateway", 60, self._dead)
        except BaseException:
            self.stop()
            raise

    def _answers(self, role: str) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.ports[role][0]}/", timeout=2)
        except urllib.error.HTTPError:
            return True  # an answer (S3 refuses an anonymous listing)
        except OSError:
            return False
        return True

    def registered(self) -> set[int]:
        """The volume servers (by index) the master has now."""
        try:
            status = _get_json(f"http://127.0.0.1:{self.ports['master'][0]}/dir/status")
        except (OSError, ValueError):
            return set()
        by_port = {self.ports[f"volume{i}"][0]: i for i in range(self.VOLUMES)}
        found = set()
        for center in status["Topology"]["DataCenters"] or []:  # type: ignore[index]
            for rack in center["Racks"] or []:
                for node in rack["DataNodes"] or []:
                    port = int(node["Url"].rpartition(":")[2])
                    if port in by_port:
                        found.add(by_port[port])
        return found

    def kill_volume(self, index: int, *, wait: bool = True) -> None:
        """SIGKILL volume server `index`, and wait until the master has dropped it (unless not `wait`:
        then the cluster may still send requests to it, as it does to a server that has just died)."""
        self._kill(f"volume{index}")
        if wait:
            self._wait_dropped(index)

    def _wait_dropped(self, index: int) -> None:
        _until(lambda: index not in self.registered(), f"the master to drop volume server {index}", 60, self._dead)

    def start_volume(self, index: int) -> None:
        """Start volume server `index` again (its volumes as they were), once the master has dropped
        it, and wait until it is registered."""
        if self.processes[f"volume{index}"].poll() is None:
            return
        self._wait_dropped(index)  # else its old registration would pass for the new one
        self._start(f"volume{index}")
        _until(lambda: index in self.registered(), f"volume server {index} to register", 60, self._dead)

    def kill_s3(self) -> None:
        """SIGKILL the S3 gateway: the store is down to its clients (the rest of the cluster runs)."""
        self._kill("s3")

    def start_s3(self) -> None:
        if self.processes["s3"].poll() is None:
            return
        self._start("s3")
        wait_http(self.s3_port, self.processes["s3"], "SeaweedFS's S3 gateway")

    def stop(self) -> None:
        for process in self.processes.values():
            stop(process)
        if not self._private:
            remove_weed_sockets(self._grpc)

    def chunks(self, bucket: str, key: str) -> list[tuple[int, int, list[int]]]:
        """An object's chunks as the filer keeps them: (start, end, the volume servers holding it by index)."""
        meta = _get_json(f"http://127.0.0.1:{self.ports['filer'][0]}/buckets/{bucket}/{key}?metadata=true")
        by_port = {self.ports[f"volume{i}"][0]: i for i in range(self.VOLUMES)}
        found = []
        for chunk in meta["chunks"]:  # type: ignore[index]
            if chunk.get("is_chunk_manifest"):
                raise ValueError(f"{bucket}/{key}: its chunks are listed in a manifest chunk: not read here")
            volume = chunk["file_id"].partition(",")[0]
            where = _get_json(f"http://127.0.0.1:{self.ports['master'][0]}/dir/lookup?volumeId={volume}")
            holders = sorted(by_port[int(at["url"].rpartition(":")[2])] for at in where["locations"])  # type: ignore[index]
            start = int(chunk.get("offset", 0))
            found.append((start, start + int(chunk["size"]), holders))
        return sorted(found)

    def _metric(self, name: str, *labels: str) -> int:
        """A counter of the S3 gateway (since it started), summed over the series that have `labels`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.startswith(name + "{") and all(label in series for label in labels):
                total += float(value)
        return int(total)

    def sent(self, bucket: str) -> int:
        """Bytes the S3 gateway has sent from objects of `bucket` since it started: the store's egress."""
        return self._metric("SeaweedFS_s3_bucket_traffic_sent_bytes_total", f'bucket="{bucket}"')

    def gets(self, bucket: str) -> int:
        """GET requests the S3 gateway has answered for `bucket` since it started (any status)."""
        return self._metric("SeaweedFS_s3_request_total", f'bucket="{bucket}"', 'type="GET"')


# -- the caching tier ------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\$\{(TIER_[A-Z_]+)\}")


def render_tier_config(values: Mapping[str, str | Sequence[str]], template: str | None = None) -> str:
    """The tier's nginx.conf: the template (contrib/nginx-tier.conf) with its ${TIER_...} filled in.
    A line naming a placeholder given a list is written once for each of its values (several
    `listen` addresses, several gateways of the store); comments are left as they are."""
    text = TIER_TEMPLATE.read_text() if template is None else template
    lines = []
    for line in text.splitlines(keepends=True):
        names = set(_PLACEHOLDER.findall(line))
        if not names or line.lstrip().startswith("#"):
            lines.append(line)
            continue
        missing = names - values.keys()
        if missing:
            raise ValueError(f"no value for {', '.join(sorted(missing))} in the tier's template")
        several = [name for name in names if not isinstance(values[name], str)]
        if len(several) > 1:
            raise ValueError(f"one line of the tier's template names several lists: {line.strip()}")
        for each in values[several[0]] if several else [""]:
            filled = line
            for name in names:
                filled = filled.replace(f"${{{name}}}", each if name in several else str(values[name]))
            lines.append(filled)
    return "".join(lines)


@dataclass(frozen=True)
class TierRequest:
    """One line of the tier's access log: a node's request, or one slice of it (log_subrequest)."""

    client: str
    method: str
    path: str
    status: int
    sent: int
    range: str
    """The client's Range ('' for none)."""
    if_match: str
    """The client's If-Match: the version a read is pinned to ('' when it is not pinned)."""
    slice: str
    """The slice a subrequest fetched ('' on a request's own line, which is its first slice's)."""
    cache: str
    """$upstream_cache_status: HIT, MISS, REVALIDATED, STALE, ... ('' when the cache was not asked)."""
    origin_statuses: tuple[int, ...]
    origin_range: str
    """The Content-Range of the store's answer: the slice it sent (bytes START-END/SIZE)."""
    origin_bytes: int
    """What came from the store for it (headers included)."""

    @property
    def from_origin(self) -> bool:
        return bool(self.origin_statuses)


_TIER_LINE = re.compile(
    r'(?P<client>\S+) \[[^\]]*\] "(?P<method>[^" ]*) ?(?P<path>[^" ]*)[^"]*" (?P<status>\d+) (?P<sent>\d+) '
    r'range="(?P<range>[^"]*)" if_match="(?P<if_match>[^"]*)" slice="(?P<slice>[^"]*)" '
    r"cache=(?P<cache>\S+) origin=(?P<origin>\S+(?:, \S+)*) origin_status=(?P<origin_status>\S+(?:, \S+)*) "
    r'origin_range="(?P<origin_range>[^"]*)" origin_bytes=(?P<origin_bytes>\S+(?:, \S+)*)$'
)


def _numbers(field: str) -> list[int]:
    return [int(part) for part in re.split(r"[,:] ?", field) if part.strip().isdigit()]


class CachingTier:
    """nginx as a caching tier in front of an S3 (or HTTP) origin, on `addresses` (127.0.0.1, and the
    host ends of nodes) at one port; configured by contrib/nginx-tier.conf."""

    def __init__(
        self,
        directory: Path,
        origin: str | Sequence[str],
        *,
        addresses: Sequence[str] = ("127.0.0.1",),
        port: int | None = None,
        cache_size: str = "20g",
        unpinned_ttl: str = "5s",
    ) -> None:
        """`origin`: host:port of the store's S3 gateway (or several); the rest as the template says."""
        self.directory = directory.resolve()  # nginx's paths are absolute
        self.origin = [origin] if isinstance(origin, str) else list(origin)
        self.addresses = list(addresses)
        self.port = port or free_ports(1)[0]
        self.cache_size = cache_size
        self.unpinned_ttl = unpinned_ttl
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_at(self.addresses[0])

    def url_at(self, address: str) -> str:
        return f"http://{address}:{self.port}"

    def config(self) -> str:
        return render_tier_config(
            {
                "TIER_DIR": str(self.directory),
                "TIER_LISTEN": [f"{address}:{self.port}" for address in self.addresses],
                "TIER_ORIGIN": self.origin,
                "TIER_CACHE_SIZE": self.cache_size,
                "TIER_UNPINNED_TTL": self.unpinned_ttl,
                "TIER_USER": pwd.getpwuid(os.geteuid()).pw_name,
            }
        )

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        nginx_temp_paths(self.directory)  # the template names them; they must exist
        (self.directory / "cache").mkdir(exist_ok=True)
        self.process = start_nginx(self.directory, self.config())
        try:
            wait_http(self.port, self.process, "the caching tier (nginx)", seconds=30)
        except RuntimeError as exc:
            log = self.directory / "error.log"
            raise RuntimeError(f"{exc}: {log.read_text()[-2000:] if log.exists() else ''}") from None

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process, signal.SIGTERM)
            self.process = None

    def kill(self) -> None:
        """SIGKILL the tier, its workers too. Its cache stays on disk for the next start(), which
        knows of it as nginx's cache loader reads it (a request just after may miss)."""
        if self.process is not None:
            stop(self.process)
            self.process = None

    def log(self) -> list[TierRequest]:
        """Every request and every slice so far, from the access log (oldest first)."""
        path = self.directory / "access.log"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            m = _TIER_LINE.match(line)
            if m is None:
                raise ValueError(f"the tier's log has a line it should not: {line}")
            # nginx logs an empty value as "-", and a quote (an ETag's) as \x22.
            text = {key: "" if value == "-" else value.replace("\\x22", '"') for key, value in m.groupdict().items()}
            request = TierRequest(
                text["client"], text["method"], text["path"], int(text["status"]), int(text["sent"]), text["range"],
                text["if_match"], text["slice"], text["cache"], tuple(_numbers(text["origin_status"])),
                text["origin_range"], sum(_numbers(text["origin_bytes"])),
            )  # fmt: skip
            found.append(request)
        return found


# -- a relay to the store --------------------------------------------------------------------------
