"""The benchmark of remote models (`tensorfs bench --remote`): a model served by nginx on loopback,
read through the mount and its cache, against obstore downloading the same bytes in the same run.

The bars (the remote-models issue and the download-speed issue): a first read of the model through
the mount >= 0.9x obstore downloading the same objects into files with the same concurrency and
chunk size (what a user has after a download) on loopback, >= 0.95x through a distant link (25 ms
each way, 200 MB/s shared: link.py), with the daemon's CPU per GiB <= 1.2x the downloader's; the first
4 KiB of a cold small tensor through the link within 2 round trips at the median; a re-read from
the cache >= 0.9x a local shard's first read; one 4 MiB tensor fetches its own chunks alone (two at
most) + the headers; a 20-shard model mounts with at most 2 GETs a shard, in at most 3x the time it
takes from local disk; `stat` p99 < 10 ms while four readers stream cold remote data; the daemon's
RssAnon flat within 16 MiB over the whole read. Each side of a first read starts with the disk
synced and, as root, the page cache dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..opening.source import open_model
from ..testing.link import SlowLink
from ..testing.sample_models import many_tiny_tensors
from ..testing.servers import Nginx
from ..utils.units import human_size
from .bucket import bucket_section
from .common import (
    CHUNK,
    CONCURRENCY,
    PIECE,
    SMALL_TENSOR,
    TENSOR,
    Config,
    Mounter,
    Report,
    build,
    can_drop_caches,
    cpu_seconds,
    drop_caches,
    median,
    probe_while,
    read_file,
    resident_bytes,
    rss_anon_kib,
    touch_fresh_memory,
    warm,
)


def download(url: str, objects: list[tuple[str, int]], into: Path | None = None) -> tuple[float, float]:
    """(bytes/s, CPU seconds of this process) of obstore fetching every object whole, in CHUNK
    ranges, CONCURRENCY at once: the bytes dropped, or (`into`, a directory made and removed after)
    each object written to a file of its own, each range's pieces where they belong as they come,
    what a user has after a download."""
    import obstore
    from obstore.store import HTTPStore

    store = HTTPStore.from_url(url, client_options={"allow_http": True, "timeout": "600s"})
    jobs = [(name, start, min(size, start + CHUNK)) for name, size in objects for start in range(0, size, CHUNK)]
    files: dict[str, int] = {}
    if into is not None:
        into.mkdir()
        for name, size in objects:
            files[name] = os.open(into / name.replace("/", "_"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(files[name], size)

    def fetch(job: tuple[str, int, int]) -> int:
        name, offset, end = job
        got = obstore.get(store, name, options={"range": (offset, end)})
        if into is None:
            return len(got.bytes())
        for piece in got.stream(min_chunk_size=PIECE):
            view = memoryview(piece)
            while view:
                written = os.pwrite(files[name], view, offset)
                view, offset = view[written:], offset + written
        return end - job[1]

    cpu, begin = time.process_time(), time.perf_counter()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            fetched = sum(pool.map(fetch, jobs))
        return fetched / (time.perf_counter() - begin), time.process_time() - cpu
    finally:
        for fd in files.values():
            os.close(fd)
        if into is not None:
            shutil.rmtree(into, ignore_errors=True)


def first_read(
    mounter: Mounter,
    url: str,
    cache: Path,
    names: list[str],
    nbytes: int,
    held: list[tuple[int, int]] | None = None,
    counted: list[tuple[int, int]] | None = None,
) -> tuple[float, float, tuple[int, int]]:
    """Reading `names` (`nbytes` in all) through a fresh mount of `url` with the cache `cache`:
    bytes/s, the daemon's CPU seconds, and its RssAnon (KiB) before and after. `held`: where to add
    what the page cache holds after, of the cache's files and of the mounted files (bytes);
    `counted`: where to add (reads answered from chunks still coming, tensor reads) (stats.json)."""
    with mounter.mounted(url, "--cache-dir", str(cache)) as (mnt, pid):
        before, cpu = rss_anon_kib(pid), cpu_seconds(pid)
        start = time.perf_counter()
        for name in names:
            read_file(mnt / name)
        rate = nbytes / (time.perf_counter() - start)
        measured = rate, cpu_seconds(pid) - cpu, (before, rss_anon_kib(pid))
        if counted is not None:
            stats = json.loads((mnt / ".tensorfs" / "stats.json").read_bytes())
            counted.append((stats["sources"]["remote"]["arriving_reads"], stats["reads"]["tensor"]))
        if held is not None:
            time.sleep(2.5)  # the daemon records its chunks each second, then lets go of what it served
            files = sorted((cache / "objects").iterdir())
            held.append((resident_bytes(files), resident_bytes([mnt / name for name in names])))
        return measured


def fetched(server: Nginx, since: int, suffix: str = ".safetensors") -> tuple[int, int]:
    """(GETs, body bytes) of shard objects the server sent since request number `since`."""
    requests = [r for r in server.requests()[since:] if r[0] == "GET" and r[1].endswith(suffix)]
    return len(requests), sum(sent for _, _, sent in requests)


def quiesce(used: Path | None = None, served: list[Path] | None = None) -> None:
    """Remove a cache no longer wanted, flush what is dirty (the disk's writeback of one try's
    gigabytes would otherwise take CPU from the next: it halved later tries' first reads), and drop
    the page cache where we may (the last try's pages would otherwise be reclaimed during this one);
    the `served` files read in again, as a server's memory holds what it serves."""
    if used is not None:
        shutil.rmtree(used, ignore_errors=True)
    if can_drop_caches():
        drop_caches()
        warm(served or [])
    else:
        os.sync()


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    report = Report()
    if shutil.which("nginx") is None:
        report.notes.append("remote benchmark skipped: nginx is not installed (apt-get install nginx-light)")
        return report
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-remote-", dir=config.workdir) as tmp:
        work = Path(tmp)
        server = Nginx(work / "nginx")
        model, one = server.root / "model", server.root / "one"
        out(f"building a {config.gib:g} GiB model of 64 MiB tensors in {config.shards} shards, served by nginx ...")
        big = build(
            model, config.gib, config.shards, min(TENSOR, int(config.gib * (1 << 30)) // 4), config.small_tensors
        )
        build(one, min(1.0, config.gib), 4, SMALL_TENSOR)
        shard_files = sorted(model.glob("*.safetensors"))
        with open_model(model) as opened:
            small = sorted(name for name in opened if name.startswith("small."))
            model_bytes = sum(opened.info(name).nbytes for name in big)
            big_shards = sorted({Path(opened.info(name).shard) for name in big})
        touch_fresh_memory(2 * model_bytes)
        warm(shard_files)
        server.start()
        try:
            _measure(config, report, work, server, model, big_shards, big, small, model_bytes, out)
        finally:
            server.stop()
        bucket_section(config, report, work, out)
    return report


def _measure(config: Config, report: Report, work: Path, server: Nginx, model: Path, big_shards: list[Path],
             big: list[str], small: list[str], model_bytes: int, out: Callable[[str], None]) -> None:  # fmt: skip
    url = f"{server.url}/model/model.safetensors.index.json"
    mounter = Mounter(work, config)
    objects = [(f"model/{path.name}", path.stat().st_size) for path in big_shards]
    object_bytes = sum(size for _, size in objects)

    rates = [download(server.url, objects)[0] for _ in range(config.repeat)]
    report.add("download", f"obstore download, {CONCURRENCY} at once, bytes dropped", f"{median(rates) / 1e9:.2f} GB/s",
               None, "(reported)", gbps=median(rates) / 1e9)  # fmt: skip

    first, again, local, rss = [], [], [], []
    saved, saved_cpu, daemon_cpu = [], [], []
    held: list[tuple[int, int]] = []
    for i in range(config.repeat):
        cache = ["--cache-dir", str(work / f"cache{i}")]
        quiesce(work / f"cache{i - 1}" if i else None, big_shards)
        rate, cpu = download(server.url, objects, work / "download")
        saved.append(rate)
        saved_cpu.append(cpu)
        quiesce(None, big_shards)
        rate, cpu, memory = first_read(mounter, url, work / f"cache{i}", big, model_bytes, held)
        first.append(rate)
        daemon_cpu.append(cpu)
        rss.append(memory)
        # Both from disk: a mount holds each byte once (in its files' pages), so what a new mount reads
        # of the cache comes from disk, as a new mount's first read of a local model does.
        quiesce()
        with mounter.mounted(url, *cache) as (mnt, _):
            again.append(model_bytes / sum(read_file(mnt / name) for name in big))
        quiesce()
        with mounter.mounted(model) as (mnt, _):
            local.append(model_bytes / sum(read_file(mnt / name) for name in big))
    quiesce(work / f"cache{config.repeat - 1}", big_shards)
    gib = object_bytes / (1 << 30)
    report.add("download_files", f"obstore download into files, {CONCURRENCY} at once, {CHUNK >> 20} MiB ranges",
               f"{median(saved) / 1e9:.2f} GB/s", None, "", gbps=median(saved) / 1e9)  # fmt: skip
    report.add("remote_first_read", "first read of a remote model through the mount", f"{median(first) / 1e9:.2f} GB/s",
               median(first) / median(saved), ">= 0.9x download into files", gbps=median(first) / 1e9,
               object_bytes=object_bytes, at_least=0.9)  # fmt: skip
    report.add("download_cpu", "  the downloader's CPU per GiB (baseline)", f"{median(saved_cpu) / gib:.2f} s",
               None, "", seconds_per_gib=median(saved_cpu) / gib)  # fmt: skip
    report.add("remote_cpu", "  the daemon's CPU per GiB", f"{median(daemon_cpu) / gib:.2f} s",
               median(daemon_cpu) / median(saved_cpu), "<= 1.2x the downloader's",
               seconds_per_gib=median(daemon_cpu) / gib, at_most=1.2)  # fmt: skip
    cached, mounted = max(held, key=sum)
    report.add("remote_page_cache", "page cache held after it: cache files + mounted files",
               f"{cached / 2**20:.0f} + {mounted / 2**20:.0f} MiB", (cached + mounted) / model_bytes,
               "<= 1.1x the model's bytes", cache_bytes=cached, mounted_bytes=mounted)  # fmt: skip
    report.add("local_first_read", "first read of the local model, from disk (baseline)",
               f"{median(local) / 1e9:.2f} GB/s", None, "", gbps=median(local) / 1e9)  # fmt: skip
    report.add("remote_reread", "re-read from the cache (a new mount), from disk", f"{median(again) / 1e9:.2f} GB/s",
               median(again) / median(local), ">= 0.9x local first read", gbps=median(again) / 1e9)  # fmt: skip
    before, after = max(rss, key=lambda pair: pair[1] - pair[0])
    report.add("remote_rss", f"daemon RssAnon before/after reading {human_size(model_bytes)}",
               f"{before / 1024:.1f} / {after / 1024:.1f} MiB", None, "flat within 16 MiB",
               before_kib=before, after_kib=after)  # fmt: skip

    # One 4 MiB tensor in the middle of a 1 GiB 4-shard model: what it costs to read it, headers apart.
    one_url = f"{server.url}/one/model.safetensors.index.json"
    with open_model(server.root / "one") as opened:
        names = sorted(opened)
    name = names[len(names) // 2]
    reads = []
    for i in range(config.repeat):
        since = len(server.requests())
        with mounter.mounted(one_url, "--cache-dir", str(work / f"one{i}")) as (mnt, _):
            gets, headers = fetched(server, since)
            since = len(server.requests())
            read_file(mnt / name)
            reads.append((fetched(server, since)[1], headers, gets))
    body, headers, gets = max(reads)
    report.add("one_tensor", "bytes fetched to read one 4 MiB tensor", f"{body / (1 << 20):.1f} MiB",
               None, "its own chunks (<= 16 MiB)", bytes=body, header_bytes=headers, header_gets=gets)  # fmt: skip

    _through_a_link(config, report, mounter, server, work, objects, big_shards, big, model_bytes, names, out)
    _latency(config, report, mounter, server, url, big_shards, big, small, work)
    _many_shards(config, report, mounter, server, work, out)


def _through_a_link(config: Config, report: Report, mounter: Mounter, server: Nginx, work: Path,
                    objects: list[tuple[str, int]], big_shards: list[Path], big: list[str], model_bytes: int,
                    small_model: list[str], out: Callable[[str], None]) -> None:  # fmt: skip
    """The first read and a cold small tensor's first byte through a distant link (link.py)."""
    with SlowLink(("127.0.0.1", server.port)) as link:
        out(f"through a link of {link.delay * 1e3:g} ms each way, {link.rate / 1e6:g} MB/s shared ...")
        url = f"{link.url()}/model/model.safetensors.index.json"
        saved, first = [], []
        counted: list[tuple[int, int]] = []
        for i in range(config.repeat):
            quiesce(work / f"link{i - 1}" if i else None, big_shards)
            saved.append(download(link.url(), objects, work / "download")[0])
            quiesce(None, big_shards)
            first.append(first_read(mounter, url, work / f"link{i}", big, model_bytes, counted=counted)[0])
        quiesce(work / f"link{config.repeat - 1}")
        # A cold small tensor's first 4 KiB, tensors far apart (each its own chunk), the mount made.
        firsts = []
        with mounter.mounted(f"{link.url()}/one/model.safetensors.index.json", "--cache-dir",
                             str(work / "link-one")) as (mnt, _):  # fmt: skip
            for name in small_model[:: max(1, len(small_model) // 5)][:5]:
                start = time.perf_counter()
                with open(mnt / name, "rb", buffering=0) as f:
                    f.read(4096)
                firsts.append(time.perf_counter() - start)
        quiesce(work / "link-one")
        round_trip = link.round_trip
    report.add("link_download_files", "through the link: obstore download into files (baseline)",
               f"{median(saved) / 1e9:.3f} GB/s", None, "", gbps=median(saved) / 1e9)  # fmt: skip
    arriving, reads = counted[-1]
    report.add("link_first_read", "  ... first read through the mount", f"{median(first) / 1e9:.3f} GB/s",
               median(first) / median(saved), ">= 0.95x download into files", gbps=median(first) / 1e9,
               at_least=0.95, arriving_reads=arriving, reads=reads)  # fmt: skip
    report.add("link_arriving_reads", "  ... reads answered from chunks still coming (last try)",
               f"{arriving} of {reads}", None, "(reported)", arriving_reads=arriving, reads=reads)  # fmt: skip
    report.add("link_first_byte", "  ... first 4 KiB of a cold small tensor: median / max",
               f"{median(firsts) * 1e3:.0f} / {max(firsts) * 1e3:.0f} ms", median(firsts) / round_trip,
               "<= 2 round trips at the median", median_ms=median(firsts) * 1e3, max_ms=max(firsts) * 1e3,
               round_trip_ms=round_trip * 1e3, at_most=2.0)  # fmt: skip


def _latency(config: Config, report: Report, mounter: Mounter, server: Nginx, url: str, big_shards: list[Path],
             big: list[str], small: list[str], work: Path) -> None:  # fmt: skip
    """stat (and open+read of a small tensor) while four readers stream cold remote data."""
    quiesce()
    with mounter.mounted(url, "--cache-dir", str(work / "latency")) as (mnt, _):
        per_stream = -(-len(big) // 4)
        streams = [  # each a loader reading tensor after tensor: cat, so nothing here competes with the probes
            subprocess.Popen(["cat", *[str(mnt / n) for n in big[i * per_stream : (i + 1) * per_stream]]],
                             stdout=subprocess.DEVNULL)
            for i in range(4)
        ]  # fmt: skip
        stats, opens = probe_while(streams, mnt, small)
    if stats and opens:
        report.add("remote_stat_latency", "stat while 4 stream cold remote data: median / p99",
                   f"{median(stats) * 1e3:.2f} / {float(np.percentile(stats, 99)) * 1e3:.2f} ms", None, "p99 < 10 ms",
                   median_ms=median(stats) * 1e3, p99_ms=float(np.percentile(stats, 99)) * 1e3,
                   samples=len(stats))  # fmt: skip
        report.add("remote_open_latency", "open+read of a small remote tensor meanwhile",
                   f"{median(opens) * 1e3:.2f} / {float(np.percentile(opens, 99)) * 1e3:.2f} ms", None, "",
                   median_ms=median(opens) * 1e3, p99_ms=float(np.percentile(opens, 99)) * 1e3)  # fmt: skip


def _many_shards(config: Config, report: Report, mounter: Mounter, server: Nginx, work: Path,
                 out: Callable[[str], None]) -> None:  # fmt: skip
    """A model of many tiny tensors in 20 shards: mounted from the store against from local disk."""
    tiny = server.root / "tiny"
    out(f"building {config.tiny_tensors} tiny tensors in {config.tiny_shards} shards ...")
    many_tiny_tensors(tiny, config.tiny_tensors, config.tiny_shards)
    warm(sorted(tiny.glob("*.safetensors")))
    url = f"{server.url}/tiny/model.safetensors.index.json"
    remote_times, local_times, gets = [], [], []
    for i in range(config.repeat):
        since = len(server.requests())
        start = time.perf_counter()
        with mounter.mounted(url, "--cache-dir", str(work / f"tiny{i}")):
            remote_times.append(time.perf_counter() - start)
            gets.append(fetched(server, since)[0])
        start = time.perf_counter()
        with mounter.mounted(tiny):
            local_times.append(time.perf_counter() - start)
    report.add("remote_mount", f"mount of {config.tiny_tensors} tensors in {config.tiny_shards} remote shards",
               f"{median(remote_times):.2f} s", median(remote_times) / median(local_times), "<= 3x from local disk",
               seconds=median(remote_times), local_seconds=median(local_times))  # fmt: skip
    report.add("remote_mount_gets", "GETs of shards to mount it", f"{max(gets)} for {config.tiny_shards} shards",
               max(gets) / config.tiny_shards, "<= 2 a shard", gets=max(gets))  # fmt: skip
