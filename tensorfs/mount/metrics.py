"""The Prometheus endpoint of a daemon (mount --metrics [HOST:]PORT or unix:PATH), served by prometheus_client.

Each scrape reads a snapshot of the mount's counters (stats.py). Labels are the mountpoint and a
few fixed sets (op, errno, kind): never a tensor or a path, which would multiply the series.

On TCP (127.0.0.1 by default) every local user can scrape it, and so learn what the mount serves;
on a Unix socket (made 0600) only its owner can, or whoever the owner lets in (a scraper's sidecar).
"""

from __future__ import annotations

import contextlib
import errno as errnos
import http.server
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import TensorfsError
from .stats import Stats

DEFAULT_HOST = "127.0.0.1"


Address = tuple[str, int] | str
"""(host, port) of a TCP endpoint, or the path of a Unix socket."""


def parse_address(text: str) -> Address:
    """[HOST:]PORT (HOST 127.0.0.1 unless given), or unix:PATH; ValueError saying why not."""
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path:
            raise ValueError("unix: needs the path of the socket to make, e.g. unix:/run/tensorfs/metrics.sock")
        return os.path.abspath(path)
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not [HOST:]PORT with a port from 1 to 65535")
    return host, int(port)


class _Collector:
    def __init__(self, stats: Stats, mountpoint: str) -> None:
        self.stats = stats
        self.mountpoint = mountpoint

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snapshot = self.stats.snapshot()
        where = ["mountpoint"]
        mnt = self.mountpoint

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=where)
            family.add_metric([mnt], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=where)
            family.add_metric([mnt], value)
            return family

        requests = CounterMetricFamily("tensorfs_requests", "FUSE requests answered.", labels=[*where, "op"])
        for op, count in sorted(snapshot["requests"].items()):
            requests.add_metric([mnt, op], count)
        yield requests
        errors = CounterMetricFamily(
            "tensorfs_request_errors", "Requests answered with an errno.", labels=[*where, "op", "errno"]
        )
        for row in snapshot["errors"]:
            errors.add_metric([mnt, row["op"], errnos.errorcode.get(row["errno"], str(row["errno"]))], row["count"])
        yield errors
        reads = CounterMetricFamily("tensorfs_reads", "Reads answered, by what they read.", labels=[*where, "kind"])
        read_bytes = CounterMetricFamily(
            "tensorfs_read_bytes", "Bytes served, by what they were.", labels=[*where, "kind"]
        )
        for kind, count in snapshot["reads"].items():
            reads.add_metric([mnt, kind], count)
            read_bytes.add_metric([mnt, kind], snapshot["read_bytes"][kind])
        yield reads
        yield read_bytes
        latency = snapshot["read_latency"]
        running, buckets = 0, []
        for bound, count in zip([*latency["buckets"], float("inf")], latency["counts"], strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        histogram = HistogramMetricFamily(
            "tensorfs_request_duration_seconds", "Time to answer a read.", labels=[*where, "op"]
        )
        histogram.add_metric([mnt, "read"], buckets, latency["sum_seconds"])
        yield histogram
        steps = CounterMetricFamily(
            "tensorfs_plan_steps", "Blocking steps of the gate's plans made on worker threads.", labels=[*where, "kind"]
        )
        for kind, count in sorted(snapshot.get("steps", {}).items()):
            steps.add_metric([mnt, kind], count)
        yield steps
        yield counter("tensorfs_page_waits", "Reads that waited for pages brought in.", snapshot["page_waits"])
        yield counter("tensorfs_page_wait_seconds", "Time reads waited for pages.", snapshot["page_wait_seconds"])
        yield counter("tensorfs_prefetch_windows", "Windows read ahead of readers.", snapshot["prefetch_windows"])
        yield counter("tensorfs_prefetch_bytes", "Bytes of windows read ahead.", snapshot["prefetch_bytes"])
        ahead = snapshot["prefetch_ahead_bytes"]
        yield counter("tensorfs_prefetch_ahead_bytes", "MiB read ahead before a reader asked (by MiB).", ahead)
        hits = snapshot["prefetch_hit_bytes"]
        yield counter("tensorfs_prefetch_hit_bytes", "Of those, MiB a reader then read (by MiB).", hits)
        integrity = snapshot["integrity"]
        yield counter("tensorfs_tensors_verified", "Tensors whose hash matched the manifest.", integrity["verified"])
        failures = integrity["verify_failures"]
        yield counter("tensorfs_verification_failures", "Tensors refused: not the manifest's hash.", failures)
        if integrity.get("signature") is not None:
            signed = GaugeMetricFamily(
                "tensorfs_signature_info",
                "The signature the mount is held to, and its signer.",
                labels=[*where, "signature", "signer"],
            )
            signed.add_metric([mnt, integrity["signature"]["signature"], integrity["signature"]["signer"]], 1)
            yield signed
        fallback = snapshot["fallback"]
        by_source = [*where, "source"]
        reads_from = CounterMetricFamily("tensorfs_fallback_reads", "Reads served from a fallback.", labels=by_source)
        bytes_from = CounterMetricFamily("tensorfs_fallback_bytes", "Bytes served from a fallback.", labels=by_source)
        for source, count in sorted(fallback["reads"].items()):
            reads_from.add_metric([mnt, source], count)
            bytes_from.add_metric([mnt, source], fallback["bytes"][source])
        yield reads_from
        yield bytes_from
        yield gauge("tensorfs_fallback_tensors", "Tensors served from a fallback now.", len(fallback["tensors"]))
        yield gauge("tensorfs_open_files", "Files open now.", snapshot["open_files"])
        yield counter("tensorfs_tensors_opened", "Distinct tensors opened.", snapshot["tensors_opened"])
        yield gauge("tensorfs_touched_bytes", "Distinct bytes of the model served (by MiB).", snapshot["touched_bytes"])
        yield gauge("tensorfs_model_bytes", "Bytes of tensor data mounted.", snapshot["model_bytes"])
        yield gauge("tensorfs_uptime_seconds", "Seconds since the daemon started.", snapshot["uptime_seconds"])
        process = snapshot["process"]
        yield gauge("tensorfs_resident_memory_bytes", "The daemon's RSS.", process["rss_bytes"])
        yield gauge("tensorfs_anonymous_memory_bytes", "The daemon's RssAnon.", process["rss_anon_bytes"])
        yield gauge("tensorfs_threads", "The daemon's threads.", process["threads"])
        yield gauge("tensorfs_open_fds", "The daemon's open descriptors.", process["fds"])
        info = GaugeMetricFamily("tensorfs_build_info", "The daemon's version.", labels=[*where, "version"])
        info.add_metric([mnt, snapshot["version"]], 1)
        yield info
        for source, values in snapshot["sources"].items():
            for name, value in values.items():
                yield counter(f"tensorfs_{source}_{name}", f"{source}: {name.replace('_', ' ')}.", value)


def describe(address: Address) -> str:
    return f"unix:{address}" if isinstance(address, str) else "{}:{}".format(*address)


def serve_metrics(address: Address, stats: Stats, mountpoint: str) -> Callable[[], None]:
    """Start the endpoint on a thread of its own; returns what stops it. TensorfsError if it cannot listen."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(stats, mountpoint))
    if isinstance(address, str):
        return _serve_unix(address, registry)
    host, port = address
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise TensorfsError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    return server.shutdown


class _UnixServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    address_family = socket.AF_UNIX
    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would ask for a host name and port
        self.server_name, self.server_port = "localhost", 0


def _serve_unix(path: str, registry: Any) -> Callable[[], None]:
    """The endpoint on a Unix socket at `path`, readable and writable by this user alone; a stale
    socket of this user's is replaced, anything else there refused."""
    from prometheus_client import MetricsHandler

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TensorfsError(f"cannot serve metrics on unix:{path}: {exc.strerror}") from None
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise TensorfsError(f"cannot serve metrics on unix:{path}: something else is there; remove it")
        os.unlink(path)
    umask = os.umask(0o177)
    try:
        server = _UnixServer(path, MetricsHandler.factory(registry))  # type: ignore[arg-type]  # a socket path
    except OSError as exc:
        raise TensorfsError(f"cannot serve metrics on unix:{path}: {exc.strerror or exc}") from None
    finally:
        os.umask(umask)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        with contextlib.suppress(OSError):
            os.unlink(path)

    return stop
