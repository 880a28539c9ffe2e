"""A model in a bucket (SeaweedFS's S3 on loopback), read whole through the mounts users pick for a
bucket today, in the same run: tensorfs's mount (every tensor's file), s3fs-fuse and rclone's mount
(the shard files; rclone with its cache off and full), against obstore downloading the same objects
into files (8 ranges of 8 MiB at once). For each: GB/s, the CPU seconds per GiB of the process
that does the work (the tensorfs daemon, s3fs, rclone, the downloader), as the store shares the
machine's cores with the client here and the client's CPU decides who is faster, and its threads'
context switches per GiB (their wake-ups); for tensorfs, the FUSE reads per GiB its daemon answered.

The bars (the speed issue): tensorfs's mount >= 1.1x the best of s3fs and rclone; the daemon's CPU
per GiB <= 1.2x the downloader's. s3fs and rclone are Debian's packages (installed as root when
missing, as bindfs is); a peer that cannot run is said, and left out. Each side starts from a fresh
cache, with the disk synced and, as root, the page cache dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

from ..testing.servers import ACCESS_KEY, SECRET_KEY, SeaweedFS
from .common import (
    CHUNK,
    CONCURRENCY,
    PIECE,
    TENSOR,
    Config,
    Mounter,
    Report,
    build,
    can_drop_caches,
    cpu_seconds,
    drop_caches,
    environment,
    median,
    read_file,
)
from .peers import apt_installed, foreground

BUCKET = "bucket-bench"


def bucket_section(config: Config, report: Report, work: Path, out: Callable[[str], None]) -> None:
    """Build a model, put it in SeaweedFS, read it every way, in turn, `config.repeat` times."""
    import obstore

    model = work / "bucket-model"
    names = build(model, config.gib, 1, TENSOR)
    shard = next(model.glob("*.safetensors"))
    nbytes = shard.stat().st_size
    seaweed = SeaweedFS(work / "bucket-seaweedfs")
    out(f"bucket: {nbytes / (1 << 30):.2f} GiB in SeaweedFS (S3) on loopback, read through each mount ...")
    seaweed.start()
    try:
        store = seaweed.store(BUCKET)
        obstore.put(store, f"m/{shard.name}", shard.read_bytes())
        sides: dict[str, Callable[[Path], Try]] = {
            "download": lambda cache: _download(seaweed, f"m/{shard.name}", nbytes, cache),
            "tensorfs": lambda cache: _tensorfs(config, work, seaweed, names, nbytes, cache),
        }
        peers = {
            "s3fs": ("s3fs", lambda cache: _s3fs(seaweed, work, shard.name, nbytes, cache)),
            "rclone_off": ("rclone", lambda cache: _rclone(seaweed, work, shard.name, nbytes, cache, "off")),
            "rclone_full": ("rclone", lambda cache: _rclone(seaweed, work, shard.name, nbytes, cache, "full")),
        }
        missing: dict[str, str] = {}
        for key, (package, read) in peers.items():
            why = apt_installed(package)
            if why is None:
                sides[key] = read
            else:
                missing[key] = why
        rates: dict[str, list[float]] = {key: [] for key in sides}
        cpus: dict[str, list[float]] = {key: [] for key in sides}
        switches: dict[str, list[float]] = {key: [] for key in sides}
        requests: list[float] = []
        gib = nbytes / (1 << 30)
        for attempt in range(config.repeat):
            for key, read in sides.items():
                cache = work / f"bucket-cache-{key}-{attempt}"
                _quiet()
                done = read(cache)
                rates[key].append(done.rate)
                cpus[key].append(done.cpu / gib)
                switches[key].append(done.switches / gib)
                if key == "tensorfs":
                    requests.append(done.requests / gib)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        seaweed.stop()
    rate = {key: median(values) for key, values in rates.items()}
    cpu = {key: median(values) for key, values in cpus.items()}
    woken = {key: median(values) for key, values in switches.items()}
    labels = {
        "download": "obstore downloading it into files (8 x 8 MiB at once)",
        "s3fs": "s3fs-fuse (Debian's s3fs), the shard file",
        "rclone_off": "rclone mount (Debian's rclone), --vfs-cache-mode off, the shard file",
        "rclone_full": "rclone mount, --vfs-cache-mode full, the shard file",
    }
    for key in ("download", "s3fs", "rclone_off", "rclone_full"):
        if key in rate:
            report.add(f"bucket_{key}", labels[key],
                       f"{rate[key] / 1e9:.3f} GB/s, {cpu[key]:.2f} CPU-s/GiB, {woken[key] / 1e3:.1f}k switches/GiB",
                       None, "(a peer)", gbps=rate[key] / 1e9, cpu_per_gib=cpu[key],
                       switches_per_gib=woken[key])  # fmt: skip
        elif key in missing:
            report.add(f"bucket_{key}", labels[key], "not measured", None, missing[key], missing=missing[key])
    best = max((rate[key] for key in ("s3fs", "rclone_off", "rclone_full") if key in rate), default=None)
    report.add("bucket_tensorfs", "tensorfs mount, every tensor's file", f"{rate['tensorfs'] / 1e9:.3f} GB/s",
               rate["tensorfs"] / best if best else None, ">= 1.1x the best of s3fs and rclone",
               gbps=rate["tensorfs"] / 1e9, cpu_per_gib=cpu["tensorfs"], switches_per_gib=woken["tensorfs"],
               requests_per_gib=median(requests))  # fmt: skip
    report.add("bucket_tensorfs_switches", "  ... the daemon's context switches per GiB (FUSE reads per GiB)",
               f"{woken['tensorfs'] / 1e3:.1f}k ({median(requests):.0f})",
               woken["tensorfs"] / woken["download"] if woken["download"] else None, "(the downloader's, as a ratio)",
               switches_per_gib=woken["tensorfs"], requests_per_gib=median(requests))  # fmt: skip
    report.add("bucket_tensorfs_cpu", "  ... the daemon's CPU per GiB", f"{cpu['tensorfs']:.2f} s",
               cpu["tensorfs"] / cpu["download"], "<= 1.2x the downloader's", seconds=cpu["tensorfs"])  # fmt: skip
    for key in ("s3fs", "rclone_off", "rclone_full"):
        if key in cpu:
            report.add(f"bucket_{key}_cpu", f"  ... {key}'s CPU per GiB", f"{cpu[key]:.2f} s",
                       cpu["tensorfs"] / cpu[key], "(tensorfs's, as a ratio)", seconds=cpu[key])  # fmt: skip


def _quiet() -> None:
    """The disk synced (a try's gigabytes written back now, not during the next) and, as root, the page
    cache dropped: every side reads from the store."""
    os.sync()
    if can_drop_caches():
        drop_caches()


def context_switches(pid: int) -> int:
    """Context switches of a process's threads alive now (voluntary and not: how often they were woken)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def _own_switches() -> int:
    """This process's context switches, of its threads that have ended too."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


class Try(NamedTuple):
    """One side's read of the object: bytes/s, CPU seconds, context switches, and FUSE reads answered
    (tensorfs's daemon's; 0 for the others)."""

    rate: float
    cpu: float
    switches: int
    requests: int = 0


def _download(seaweed: SeaweedFS, key: str, nbytes: int, into: Path) -> Try:
    """obstore fetching the object whole into a file, CHUNK ranges CONCURRENCY at once: (bytes/s, CPU s,
    context switches)."""
    import obstore

    store = seaweed.store(BUCKET)
    into.mkdir(parents=True)
    fd = os.open(into / "object", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, nbytes)

    def fetch(start: int) -> None:
        offset = start
        got = obstore.get(store, key, options={"range": (start, min(nbytes, start + CHUNK))})
        for piece in got.stream(min_chunk_size=PIECE):
            view = memoryview(piece)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written

    cpu, begin, woken = time.process_time(), time.perf_counter(), _own_switches()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(fetch, range(0, nbytes, CHUNK)))
        return Try(nbytes / (time.perf_counter() - begin), time.process_time() - cpu, _own_switches() - woken)
    finally:
        os.close(fd)


def _tensorfs(config: Config, work: Path, seaweed: SeaweedFS, names: list[str], nbytes: int, cache: Path) -> Try:
    mounter = Mounter(work, config)
    with (
        environment(seaweed.env()),
        mounter.mounted(f"s3://{BUCKET}/m", "--endpoint-url", seaweed.endpoint, cache=cache) as (mnt, pid),
    ):
        cpu, begin, woken = cpu_seconds(pid), time.perf_counter(), context_switches(pid)
        asked = _reads(mnt)
        for name in names:
            read_file(mnt / name)
        rate = nbytes / (time.perf_counter() - begin)
        return Try(rate, cpu_seconds(pid) - cpu, context_switches(pid) - woken, _reads(mnt) - asked)


def _reads(mountpoint: Path) -> int:
    """The reads of tensors' files a mount's daemon has answered (its stats)."""
    return int(json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())["reads"]["tensor"])


def _s3fs(seaweed: SeaweedFS, work: Path, shard: str, nbytes: int, cache: Path) -> Try:
    cache.mkdir(parents=True)
    secrets = cache / "passwd"
    secrets.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
    secrets.chmod(0o600)
    mountpoint = work / f"s3fs-{os.getpid()}"
    options = f"url={seaweed.endpoint},use_path_request_style,passwd_file={secrets},ro"
    command = ["s3fs", BUCKET, str(mountpoint), "-f", "-o", options]
    with _peer(command, mountpoint, work / "s3fs.log", {}) as pid:
        return _read_peer(mountpoint / "m" / shard, nbytes, pid)


def _rclone(seaweed: SeaweedFS, work: Path, shard: str, nbytes: int, cache: Path, mode: str) -> Try:
    cache.mkdir(parents=True)
    env = {
        "RCLONE_CONFIG_BENCH_TYPE": "s3",
        "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
        "RCLONE_CONFIG_BENCH_ENDPOINT": seaweed.endpoint,
        "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": ACCESS_KEY,
        "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": SECRET_KEY,
        "RCLONE_CONFIG_BENCH_REGION": "us-east-1",
    }
    mountpoint = work / f"rclone-{os.getpid()}"
    command = ["rclone", "mount", f"bench:{BUCKET}", str(mountpoint), "--read-only", "--vfs-cache-mode", mode,
               "--cache-dir", str(cache)]  # fmt: skip
    with _peer(command, mountpoint, work / "rclone.log", env) as pid:
        return _read_peer(mountpoint / "m" / shard, nbytes, pid)


def _read_peer(path: Path, nbytes: int, pid: int) -> Try:
    cpu, begin, woken = cpu_seconds(pid), time.perf_counter(), context_switches(pid)
    read_file(path)
    return Try(nbytes / (time.perf_counter() - begin), cpu_seconds(pid) - cpu, context_switches(pid) - woken)


def _peer(command: list[str], mountpoint: Path, log: Path, env: dict[str, str]) -> AbstractContextManager[int]:
    """A peer's daemon in the foreground until its mount is live (its pid); unmounted and reaped after.
    AWS_CA_BUNDLE is unset for it: rclone refuses to start with one beside a plain-HTTP endpoint."""
    variables = {key: value for key, value in os.environ.items() if key != "AWS_CA_BUNDLE"} | env
    return foreground(command, mountpoint, log, variables)
