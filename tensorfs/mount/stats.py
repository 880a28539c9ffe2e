"""What a daemon counts: requests, errors, bytes served, read latency, integrity, what is open and
touched. Plain integers, changed on the daemon's one request thread (no locks per request); read
as a snapshot for .tensorfs/stats.json, `tensorfs stats` and the Prometheus endpoint.

The snapshot's field names are stable (docs/operating.md). Other layers plug their
own counters in as a `sources` entry: a function that returns a flat {name: number} dict.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from .. import __version__

LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the read latency histogram, in seconds (Prometheus style: each also counts the faster)."""
KINDS = ("tensor", "sidecar", "control", "view")
"""What a read served: a tensor's bytes, a .meta.json or .sha256, a .tensorfs/ file, the model view."""
TOUCH_UNIT = 1 << 20
_READ, _AHEAD = 1, 2


class Stats:
    """The counters of one mount."""

    def __init__(self, model_bytes: int) -> None:
        self.started = time.time()
        self._started_monotonic = time.monotonic()
        self.model_bytes = model_bytes
        self.requests: dict[str, int] = {}
        self.errors: dict[tuple[str, int], int] = {}
        self.reads = dict.fromkeys(KINDS, 0)
        self.read_bytes = dict.fromkeys(KINDS, 0)
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: slower than every bound
        self.latency_sum = 0.0
        self.steps: dict[str, int] = {}
        """Blocking steps of the gates' plans made on worker threads, by kind (gate/plans.py's StepKind)."""
        self.page_waits = 0
        """Reads that waited for their pages to be brought in (on a worker thread)."""
        self.page_wait_seconds = 0.0
        self.prefetch_windows = 0
        self.prefetch_bytes = 0
        self.verified = 0
        self.verify_failures = 0
        self.signature: dict[str, str] | None = None
        """The signature the mount is held to and who signed it (None: none)."""
        self.open_files = 0
        self.opened_tensors: set[str] = set()
        self._touched: dict[object, bytearray] = {}  # per shard, a byte per MiB: 1 read, 2 read ahead
        self.touched_bytes = 0
        self.prefetch_ahead_bytes = 0
        """The MiB that read-ahead brought in before any reader asked (by MiB: the hits' measure)."""
        self.prefetch_hit_bytes = 0
        """Of those, the MiB a reader then read: the hit ratio is hit / ahead."""
        self.changed: set[object] = set()
        """Shards changed in place under the mount (refused without a manifest, verified again with one)."""
        self.rechecked_shards = 0
        """Times a shard's status changed with no manifest, and the bytes served from it were read again."""
        self.unchanged_shards = 0
        """Of those, the times they were found as they were (a chmod, a touch): served on."""
        self.invalidations = 0
        """Times the kernel was told to drop the pages it caches of a changed shard's files, and had."""
        self.fallback_tensors: dict[str, str] = {}
        """Tensors served from a fallback: by name, which one (--fallback, as given)."""
        self.fallback_reads: dict[str, int] = {}
        self.fallback_bytes: dict[str, int] = {}
        """Reads, and bytes, a fallback served: by fallback."""
        self._last_io_error: float | None = None
        self.sources: dict[str, Callable[[], dict[str, int | float]]] = {}

    # -- counting (the request thread) ----------------------------------------------------------
    def request(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1

    def error(self, op: str, code: int) -> None:
        self.errors[op, code] = self.errors.get((op, code), 0) + 1
        if code == errno.EIO:
            self._last_io_error = time.monotonic()

    def read(self, kind: str, nbytes: int, seconds: float) -> None:
        self.reads[kind] += 1
        self.read_bytes[kind] += nbytes
        self.latency[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def from_fallback(self, source: str, nbytes: int) -> None:
        self.fallback_reads[source] = self.fallback_reads.get(source, 0) + 1
        self.fallback_bytes[source] = self.fallback_bytes.get(source, 0) + nbytes

    def touch(self, shard: object, start: int, end: int) -> None:
        """Bytes [start, end) of a shard were served: count each MiB of it once."""
        units = self._units(shard, start, end)
        for unit in range(*units[1:]):
            state = units[0][unit]
            if state != _READ:
                units[0][unit] = _READ
                self.touched_bytes += TOUCH_UNIT
                if state == _AHEAD:
                    self.prefetch_hit_bytes += TOUCH_UNIT

    def prefetched(self, shard: object, start: int, end: int) -> None:
        """Bytes [start, end) of a shard were read ahead of a reader."""
        self.prefetch_windows += 1
        self.prefetch_bytes += max(0, end - start)
        units = self._units(shard, start, end)
        for unit in range(*units[1:]):
            if units[0][unit] == 0:
                units[0][unit] = _AHEAD
                self.prefetch_ahead_bytes += TOUCH_UNIT

    def _units(self, shard: object, start: int, end: int) -> tuple[bytearray, int, int]:
        bits = self._touched.get(shard)
        if bits is None:
            bits = self._touched[shard] = bytearray()
        if end <= start:
            return bits, 0, 0
        first, last = start // TOUCH_UNIT, (end - 1) // TOUCH_UNIT
        if last >= len(bits):
            bits.extend(bytes(last + 1 - len(bits)))
        return bits, first, last + 1

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every counter, as JSON values (safe to call from another thread: it copies first)."""
        requests, errors, last = dict(self.requests), dict(self.errors), self._last_io_error
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._started_monotonic, 3),
            "requests": requests,
            "errors": [{"op": op, "errno": code, "count": n} for (op, code), n in sorted(errors.items())],
            "reads": dict(self.reads),
            "read_bytes": dict(self.read_bytes),
            "read_latency": {
                "buckets": list(LATENCY_BUCKETS),
                "counts": list(self.latency),
                "sum_seconds": round(self.latency_sum, 6),
            },
            "steps": dict(self.steps),
            "page_waits": self.page_waits,
            "page_wait_seconds": round(self.page_wait_seconds, 6),
            "prefetch_windows": self.prefetch_windows,
            "prefetch_bytes": self.prefetch_bytes,
            "prefetch_ahead_bytes": self.prefetch_ahead_bytes,
            "prefetch_hit_bytes": self.prefetch_hit_bytes,
            "integrity": {
                "verified": self.verified,
                "verify_failures": self.verify_failures,
                "signature": self.signature,
            },
            "changed_shards": len(self.changed),
            "rechecked_shards": self.rechecked_shards,
            "unchanged_shards": self.unchanged_shards,
            "invalidations": self.invalidations,
            "fallback": {
                "tensors": dict(self.fallback_tensors),
                "reads": dict(self.fallback_reads),
                "bytes": dict(self.fallback_bytes),
            },
            "seconds_since_io_error": None if last is None else round(time.monotonic() - last, 3),
            "open_files": self.open_files,
            "tensors_opened": len(self.opened_tensors),
            "touched_bytes": min(self.touched_bytes, self.model_bytes),
            "model_bytes": self.model_bytes,
            "process": process_status(),
            "sources": {name: source() for name, source in dict(self.sources).items()},
        }


def process_status() -> dict[str, int]:
    """The daemon's memory (RSS, RssAnon), threads and open descriptors, from /proc."""
    found = {"rss_bytes": 0, "rss_anon_bytes": 0, "threads": threading.active_count(), "fds": 0}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key == "VmRSS":
                    found["rss_bytes"] = int(value.split()[0]) * 1024
                elif key == "RssAnon":
                    found["rss_anon_bytes"] = int(value.split()[0]) * 1024
                elif key == "Threads":
                    found["threads"] = int(value)
        found["fds"] = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        pass
    return found


def degraded(snapshot: dict[str, Any]) -> str | None:
    """Why a daemon serving its mount is not doing well (None when it is)."""
    why = []
    if snapshot["integrity"]["verify_failures"]:
        why.append(f"{snapshot['integrity']['verify_failures']} tensor(s) failed verification")
    if snapshot["changed_shards"]:
        why.append(f"{snapshot['changed_shards']} shard(s) changed under it")
    served_otherwise = snapshot.get("fallback", {}).get("tensors", {})
    if served_otherwise:
        why.append(f"{len(served_otherwise)} tensor(s) served from a fallback")
    since = snapshot["seconds_since_io_error"]
    if since is not None and since < 60:
        why.append(f"an EIO answered {since:.0f} s ago")
    return "; ".join(why) or None


def quantile(buckets: list[float], counts: list[int], q: float) -> float | None:
    """The upper bound of the bucket that holds quantile q of the counted latencies (None: none)."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for bound, count in zip([*buckets, float("inf")], counts, strict=True):
        seen += count
        if seen >= rank:
            return bound
    return float("inf")
