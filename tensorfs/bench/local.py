"""The benchmark of the read path of local models, the mount and listing, against direct baselines
and against peers serving the same bytes through FUSE (bindfs, and the pyfuse3 floor: peers.py).

Every figure is the median of several tries and is reported as a ratio to its baseline measured
in the same run, since these machines are noisy.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..mount.options import MountOptions
from ..mount.runtime import read_record
from ..sources.index import INDEX_NAME
from ..testing.sample_models import Tensor, many_tiny_tensors, write_sharded
from ..utils.units import human_size
from .common import (
    Config,
    Mounter,
    Report,
    can_drop_caches,
    concurrently,
    cpu_seconds,
    drop_caches,
    median,
    probe_while,
    read_file,
    read_range,
    resident_bytes,
    rss_anon_kib,
    touch_fresh_memory,
    wait_until_settled,
    warm,
)
from .peers import Knobs, Locate, Peer, bindfs_missing, bindfs_peer, floor_peer

# -- building ---------------------------------------------------------------------------------


def build_big_model(directory: Path, config: Config) -> dict[str, tuple[Path, int, int]]:
    """Shards of F32 tensors of random bytes, plus a shard of small ones; tensor -> (shard, offset, nbytes)."""
    tensor_bytes = config.tensor_mib << 20
    total = int(config.gib * (1 << 30))
    count = max(config.shards, total // tensor_bytes)
    per_shard = -(-count // config.shards)
    shards: list[dict[str, Tensor]] = []
    for s in range(config.shards):
        shard: dict[str, Tensor] = {}
        for t in range(s * per_shard, min(count, (s + 1) * per_shard)):
            shard[f"big.{t:03d}"] = ("F32", [tensor_bytes // 4], os.urandom(tensor_bytes))
        shards.append(shard)
    shards.append({f"small.{i:05d}": ("F32", [16], os.urandom(64)) for i in range(config.small_tensors)})
    write_sharded(directory, shards)
    import tensorfs

    with tensorfs.open_model(directory) as model:
        return {
            name: (Path(model.info(name).shard), model.info(name).offset, model.info(name).nbytes) for name in model
        }


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    with np.errstate(all="ignore"):  # the tensors are random bytes: their sums overflow and meet NaNs
        return _run(config, out)


def _run(config: Config, out: Callable[[str], None]) -> Report:
    report = Report()
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-", dir=config.workdir) as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        out(f"building a {config.gib:g} GiB model of {config.tensor_mib} MiB tensors in {config.shards} shards ...")
        tensors = build_big_model(model_dir, config)
        big = sorted(name for name in tensors if name.startswith("big."))
        small = sorted(name for name in tensors if name.startswith("small."))
        shards = sorted({shard for shard, _, _ in tensors.values()})
        model_bytes = sum(tensors[name][2] for name in big)
        touch_fresh_memory(2 * model_bytes)
        warm(shards)
        mounter = Mounter(work, config)

        # Direct, page cache warm: each tensor's byte range of its shard, 1 MiB reads.
        direct = [tensors[n][2] / read_range(*tensors[n]) for n in big for _ in range(config.repeat)]
        direct_rate = median(direct)
        report.add(
            "direct", "direct read, warm (baseline)", f"{direct_rate / 1e9:.2f} GB/s", None, "", gbps=direct_rate / 1e9
        )

        first, again = [], []
        for _ in range(config.repeat):
            with mounter.mounted(model_dir, warm_first=shards) as (mnt, _):
                for name in big:
                    first.append(tensors[name][2] / read_file(mnt / name))
                for name in big:
                    again.append(tensors[name][2] / read_file(mnt / name))
        report.add(
            "first_read",
            "first read through the mount",
            f"{median(first) / 1e9:.2f} GB/s",
            median(first) / direct_rate,
            ">= 0.5x direct",
            gbps=median(first) / 1e9,
        )
        report.add(
            "reread",
            "re-read through the mount",
            f"{median(again) / 1e9:.2f} GB/s",
            median(again) / direct_rate,
            ">= 0.65x direct",
            gbps=median(again) / 1e9,
        )

        # np.memmap(...).sum() of a mounted tensor against the same bytes mapped from the shard: on a
        # fresh mount (every page a request to the daemon) and again (pages in the kernel's cache).
        direct_sum, mount_sum, cached_sum = [], [], []
        for _ in range(config.repeat):
            with mounter.mounted(model_dir, warm_first=shards) as (mnt, _):
                for name in big[: max(1, len(big) // 2)]:
                    shard, offset, nbytes = tensors[name]
                    start = time.perf_counter()
                    np.memmap(shard, dtype="<f4", mode="r", offset=offset, shape=(nbytes // 4,)).sum()
                    direct_sum.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    np.memmap(mnt / name, dtype="<f4", mode="r").sum()
                    mount_sum.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    np.memmap(mnt / name, dtype="<f4", mode="r").sum()
                    cached_sum.append(time.perf_counter() - start)
        report.add(
            "memmap_sum",
            "np.memmap(...).sum() through the mount, first",
            f"{median(mount_sum) * 1e3:.0f} ms",
            median(direct_sum) / median(mount_sum),
            ">= 0.9x direct",
            seconds=median(mount_sum),
            direct_seconds=median(direct_sum),
        )
        report.add(
            "memmap_sum_cached",
            "np.memmap(...).sum() through the mount, again",
            f"{median(cached_sum) * 1e3:.0f} ms",
            median(direct_sum) / median(cached_sum),
            ">= 0.9x direct",
            seconds=median(cached_sum),
            direct_seconds=median(direct_sum),
        )

        # Four readers at once, each on its own tensor, against four direct readers.
        four = big[:4] if len(big) >= 4 else (big * 4)[:4]
        four_bytes = sum(tensors[n][2] for n in four)
        direct_four, mount_four = [], []
        for _ in range(config.repeat):
            warm(shards)
            direct_four.append(four_bytes / concurrently([functools.partial(read_range, *tensors[n]) for n in four]))
            with mounter.mounted(model_dir, warm_first=shards) as (mnt, _):
                mount_four.append(four_bytes / concurrently([functools.partial(read_file, mnt / n) for n in four]))
        report.add(
            "four_readers",
            "4 readers through the mount (aggregate)",
            f"{median(mount_four) / 1e9:.2f} GB/s",
            median(mount_four) / median(first),
            ">= 1.0x one first read",
            gbps=median(mount_four) / 1e9,
            direct_gbps=median(direct_four) / 1e9,
        )
        report.add(
            "four_readers_direct",
            "  ... 4 direct readers, warm (ratio: the mount's 4 to them)",
            f"{median(direct_four) / 1e9:.2f} GB/s",
            median(mount_four) / median(direct_four),
            "(reported)",
            gbps=median(direct_four) / 1e9,
        )

        peers_section(config, report, mounter, model_dir, tensors, big)
        views_section(config, report, mounter, model_dir, tensors, big)
        metrics_section(config, report, mounter, model_dir, tensors, big)
        cold_section(config, report, mounter, model_dir, tensors, big, small, shards, out)
        page_cache_section(report, mounter, model_dir, tensors, big, model_bytes, shards)
        memory_section(report, mounter, model_dir, tensors, big, model_bytes)
        tiny_section(config, report, mounter, work)
    return report


def peers_section(
    config: Config,
    report: Report,
    mounter: Mounter,
    model_dir: Path,
    tensors: dict[str, tuple[Path, int, int]],
    big: list[str],
) -> None:
    """First reads (1 MiB reads, page cache warm) and np.memmap sums of one shard's big tensors through
    tensorfs and through each peer, each try on a fresh mount, the sides taken in turns."""
    shard = tensors[big[0]][0]
    names = [name for name in big if tensors[name][0] == shard]
    knobs = Knobs(config.readahead_kb, MountOptions().max_background)
    peers = [floor_peer(shard, tensors, mounter.workdir / "floor.log")]
    why_not = bindfs_missing()
    if why_not is None:
        peers.insert(0, bindfs_peer(shard, tensors, mounter.workdir / "bindfs.log"))
    else:
        report.notes.append(f"bindfs peer skipped: {why_not}")

    @contextlib.contextmanager
    def tensorfs_mounted(mountpoint: Path, _: Knobs) -> Iterator[tuple[Locate, dict[str, int | None]]]:
        with mounter.mounted(model_dir, at=mountpoint) as (mnt, _pid):  # the knobs: its defaults
            record = read_record(mnt) or {}
            yield (lambda name: (mnt / name, 0, tensors[name][2])), dict(record.get("in_force", {}))

    sides = [Peer("tensorfs", "tensorfs", tensorfs_mounted), *peers]
    rates: dict[str, list[float]] = {side.key: [] for side in sides}
    sums: dict[str, list[float]] = {side.key: [] for side in sides}
    in_force: dict[str, dict[str, int | None]] = {}
    for attempt in range(config.repeat):
        for side in sides[attempt % len(sides) :] + sides[: attempt % len(sides)]:  # each first in turn
            warm([shard])  # tensorfs lets the shard's pages go as it serves them: each side starts warm
            with side.mounted(mounter.fresh_mountpoint(), knobs) as (locate, knobs_in_force):
                rates[side.key] += [tensors[name][2] / read_range(*locate(name)) for name in names]
            in_force[side.key] = knobs_in_force
            warm([shard])
            with side.mounted(mounter.fresh_mountpoint(), knobs) as (locate, _):
                for name in names:
                    path, offset, nbytes = locate(name)
                    start = time.perf_counter()
                    np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=(nbytes // 4,)).sum()
                    sums[side.key].append(time.perf_counter() - start)
    if any(knobs_in_force != in_force["tensorfs"] for knobs_in_force in in_force.values()):
        report.notes.append(f"the peers' connection knobs differ from tensorfs's: {in_force}")
    rate = {key: median(values) for key, values in rates.items()}
    seconds = {key: median(values) for key, values in sums.items()}
    best_rate = max(peers, key=lambda peer: rate[peer.key])
    best_sum = min(peers, key=lambda peer: seconds[peer.key])
    report.add(
        "peer_first_read",
        "first read of a shard's tensors, with peers: tensorfs",
        f"{rate['tensorfs'] / 1e9:.2f} GB/s",
        rate["tensorfs"] / rate[best_rate.key],
        f">= 1.0x the best peer ({best_rate.key})",
        gbps=rate["tensorfs"] / 1e9,
        tensors=len(names),
        tensor_bytes=tensors[names[0]][2],
        best_peer=best_rate.key,
        in_force=in_force,
    )
    for peer in peers:
        report.add(
            f"peer_first_read_{peer.key}",
            f"  ... through {peer.label}",
            f"{rate[peer.key] / 1e9:.2f} GB/s",
            rate["tensorfs"] / rate[peer.key],
            f"(tensorfs / {peer.key})",
            gbps=rate[peer.key] / 1e9,
        )
    report.add(
        "peer_memmap_sum",
        "np.memmap(...).sum() of them, first: tensorfs",
        f"{seconds['tensorfs'] * 1e3:.0f} ms",
        seconds[best_sum.key] / seconds["tensorfs"],
        f">= 1.0x the best peer ({best_sum.key})",
        seconds=seconds["tensorfs"],
        best_peer=best_sum.key,
    )
    for peer in peers:
        report.add(
            f"peer_memmap_sum_{peer.key}",
            f"  ... through {peer.label}",
            f"{seconds[peer.key] * 1e3:.0f} ms",
            seconds[peer.key] / seconds["tensorfs"],
            f"(tensorfs / {peer.key})",
            seconds=seconds[peer.key],
        )


def cold_section(config: Config, report: Report, mounter: Mounter, model_dir: Path,
                 tensors: dict[str, tuple[Path, int, int]], big: list[str], small: list[str],
                 shards: list[Path], out: Callable[[str], None]) -> None:  # fmt: skip
    if not can_drop_caches():
        report.notes.append(
            "cold reads and latency under cold streaming skipped: cannot drop the page cache (needs root)"
        )
        return
    dd, cold = [], []
    for _ in range(config.repeat):
        drop_caches()
        start = time.perf_counter()
        subprocess.run(["dd", f"if={shards[0]}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
        dd.append(shards[0].stat().st_size / (time.perf_counter() - start))
        with mounter.mounted(model_dir) as (mnt, _):
            drop_caches()
            names = [n for n in big if tensors[n][0] == shards[0]]
            nbytes = sum(tensors[n][2] for n in names)
            cold.append(nbytes / sum(read_file(mnt / n) for n in names))
    report.add(
        "cold_dd", "dd of a shard from disk (baseline)", f"{median(dd) / 1e9:.2f} GB/s", None, "", gbps=median(dd) / 1e9
    )
    report.add(
        "cold_first_read",
        "cold first read through the mount",
        f"{median(cold) / 1e9:.2f} GB/s",
        median(cold) / median(dd),
        ">= 0.9x dd",
        gbps=median(cold) / 1e9,
    )

    # While four readers stream cold tensors, how long do a stat and an open of another tensor take?
    with mounter.mounted(model_dir) as (mnt, _):
        drop_caches()
        # The streams are dd processes, so that nothing in this process competes with the probes.
        streams = [
            subprocess.Popen(["dd", f"if={mnt / n}", "of=/dev/null", "bs=1M"], stderr=subprocess.DEVNULL)
            for n in (big * 4)[:4]
        ]
        stats, opens = probe_while(streams, mnt, small)
    if stats and opens:
        p99 = float(np.percentile(stats, 99))
        report.add(
            "stat_latency",
            "stat while 4 stream cold: median / p99",
            f"{median(stats) * 1e3:.2f} / {p99 * 1e3:.2f} ms",
            None,
            "p99 < 10 ms",
            median_ms=median(stats) * 1e3,
            p99_ms=p99 * 1e3,
            samples=len(stats),
        )
        p99 = float(np.percentile(opens, 99))
        report.add(
            "open_latency",
            "open+read of a small tensor meanwhile",
            f"{median(opens) * 1e3:.2f} / {p99 * 1e3:.2f} ms",
            None,
            "",
            median_ms=median(opens) * 1e3,
            p99_ms=p99 * 1e3,
            samples=len(opens),
        )


def read_files(mnt: Path, names: list[str]) -> float:
    """Seconds to read each of the files `names` under `mnt`, one after another."""
    return sum(read_file(mnt / name) for name in names)


def views_section(
    config: Config,
    report: Report,
    mounter: Mounter,
    model_dir: Path,
    tensors: dict[str, tuple[Path, int, int]],
    big: list[str],
) -> None:
    """The synthesized file of .tensorfs/model/, read whole, against reading the per-tensor files of
    the same selection (its file is selected.safetensors): each on a fresh mount, taken in turns."""
    nbytes = sum(tensors[name][2] for name in big)
    shards = sorted({tensors[name][0] for name in big})
    per_tensor, synthesized = [], []
    for _ in range(config.repeat):
        with mounter.mounted(model_dir, "--include", "big.*", warm_first=shards) as (mnt, _):
            per_tensor.append(nbytes / read_files(mnt, big))
        with mounter.mounted(model_dir, "--include", "big.*", warm_first=shards) as (mnt, _):
            synthesized.append(nbytes / read_file(mnt / ".tensorfs" / "model" / "selected.safetensors"))
    report.add(
        "view_read",
        "first read of .tensorfs/model/selected.safetensors",
        f"{median(synthesized) / 1e9:.2f} GB/s",
        median(synthesized) / median(per_tensor),
        ">= 0.9x per-tensor files",
        gbps=median(synthesized) / 1e9,
        per_tensor_gbps=median(per_tensor) / 1e9,
    )


def metrics_section(
    config: Config,
    report: Report,
    mounter: Mounter,
    model_dir: Path,
    tensors: dict[str, tuple[Path, int, int]],
    big: list[str],
) -> None:
    """First reads with the Prometheus endpoint on and scraped ten times a second, against without
    it; each on a fresh mount, in turns. (The counting itself is always on.)"""
    nbytes = sum(tensors[name][2] for name in big)
    shards = sorted({tensors[name][0] for name in big})
    plain, scraped = [], []
    for _ in range(config.repeat):
        with mounter.mounted(model_dir, warm_first=shards) as (mnt, _):
            plain.append(nbytes / read_files(mnt, big))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with mounter.mounted(model_dir, "--metrics", f"127.0.0.1:{port}", warm_first=shards) as (mnt, _):
            done = threading.Event()
            scraper = threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{port}/metrics", done), daemon=True)
            scraper.start()
            try:
                scraped.append(nbytes / read_files(mnt, big))
            finally:
                done.set()
                scraper.join()
    report.add(
        "metrics_read",
        "first read, metrics scraped every 0.1 s",
        f"{median(scraped) / 1e9:.2f} GB/s",
        median(scraped) / median(plain),
        ">= 0.97x no endpoint",
        gbps=median(scraped) / 1e9,
        plain_gbps=median(plain) / 1e9,
    )


def _scrape(url: str, done: threading.Event) -> None:
    while not done.wait(0.1):
        urllib.request.urlopen(url, timeout=10).read()


def page_cache_section(report: Report, mounter: Mounter, model_dir: Path, tensors: dict[str, tuple[Path, int, int]],
                       big: list[str], model_bytes: int, shards: list[Path]) -> None:  # fmt: skip
    """How much of the page cache a model read through a mount takes (the shards' pages and the mounted
    files' own), by default and with --keep-source-pages, and re-reads through the same mount after."""
    if not can_drop_caches():
        report.notes.append("the page cache's copies skipped: cannot drop the page cache (needs root)")
        return
    held, rereads = {}, {}
    for keep in (False, True):
        drop_caches()
        with mounter.mounted(model_dir, *(["--keep-source-pages"] if keep else [])) as (mnt, _):
            files = [mnt / name for name in big]
            for path in files:
                read_file(path)
            time.sleep(1.5)  # the ranges of the last replies are let go of within a second
            held[keep] = resident_bytes(shards), resident_bytes(files)
            rereads[keep] = model_bytes / sum(read_file(path) for path in files)
    for keep, key, what, bar in (
        (False, "page_cache", "page cache held for a model read through a mount", "<= 1.1x the model's bytes"),
        (True, "page_cache_kept", "  ... with --keep-source-pages", "(reported)"),
    ):
        source, mounted = held[keep]
        report.add(key, f"{what}: shards + mounted files", f"{source / 2**20:.0f} + {mounted / 2**20:.0f} MiB",
                   (source + mounted) / model_bytes, bar, source_bytes=source, mounted_bytes=mounted,
                   model_bytes=model_bytes)  # fmt: skip
    report.add("page_cache_reread", "re-read through that mount, one copy held", f"{rereads[False] / 1e9:.2f} GB/s",
               rereads[False] / rereads[True], ">= 0.9x with both copies held", gbps=rereads[False] / 1e9,
               both_gbps=rereads[True] / 1e9)  # fmt: skip


def memory_section(report: Report, mounter: Mounter, model_dir: Path,
                   tensors: dict[str, tuple[Path, int, int]], big: list[str], model_bytes: int) -> None:  # fmt: skip
    with mounter.mounted(model_dir) as (mnt, pid):
        before = rss_anon_kib(pid)
        for name in big:
            read_file(mnt / name)
        after = rss_anon_kib(pid)
    report.add(
        "rss_growth",
        f"daemon RssAnon before/after reading {human_size(model_bytes)}",
        f"{before / 1024:.1f} / {after / 1024:.1f} MiB",
        None,
        "flat within 5 MiB",
        before_kib=before,
        after_kib=after,
    )


def tiny_section(config: Config, report: Report, mounter: Mounter, work: Path) -> None:
    tiny = work / "tiny"
    many_tiny_tensors(tiny, config.tiny_tensors, config.tiny_shards)
    shards = sorted(tiny.glob("*.safetensors"))
    warm(shards)
    wait_until_settled([*shards, tiny / INDEX_NAME])  # else the header cache keeps nothing of them
    reference = (
        "import sys, safetensors\n"
        "n = 0\n"
        "for p in sys.argv[1:]:\n"
        "    with safetensors.safe_open(p, framework='np') as f: n += len(f.keys())\n"
    )
    listing_dir = work / "plain"
    listing_dir.mkdir()
    entries = 3 * config.tiny_tensors + 1
    for i in range(entries):
        (listing_dir / f"f{i:07d}").touch()
    ref_times, mount_times, list_times, plain_times, rss, selected_times = [], [], [], [], [], []
    first_times, again_times, ours, kernels = [], [], [], []
    layers = max(1, config.tiny_tensors // 8 // 100)  # 8 tensors a layer: 1% of the tensors
    for attempt in range(config.repeat):
        start_mount = time.perf_counter()
        with mounter.mounted(tiny, "--layers", f"0-{layers - 1}"):
            selected_times.append(time.perf_counter() - start_mount)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", reference, *map(str, shards)], check=True)
        ref_times.append(time.perf_counter() - start)
        cache = work / f"header-cache-{attempt}"  # a fresh one: the first mount fills it, the next uses it
        start_mount = time.perf_counter()
        with mounter.mounted(tiny, cache=cache):
            first_times.append(time.perf_counter() - start_mount)
        start_mount = time.perf_counter()
        with mounter.mounted(tiny, cache=cache):
            again_times.append(time.perf_counter() - start_mount)
        start_mount = time.perf_counter()
        with mounter.mounted(tiny) as (mnt, pid):
            mount_times.append(time.perf_counter() - start_mount)
            daemon_before, own_before = cpu_seconds(pid), resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            listed = len(os.listdir(mnt))
            list_times.append(time.perf_counter() - start)
            own_after = resource.getrusage(resource.RUSAGE_SELF)
            # The daemon's time (pyfuse3 and tensorfs answering) and the lister's in the kernel
            # (readdirplus makes an inode and a dentry for every entry, in the lister's context).
            ours.append(cpu_seconds(pid) - daemon_before)
            kernels.append(own_after.ru_stime - own_before.ru_stime)
            assert listed == entries, listed
            rss.append(rss_anon_kib(pid))
        start = time.perf_counter()
        os.listdir(listing_dir)
        plain_times.append(time.perf_counter() - start)
    n = config.tiny_tensors
    report.add(
        "tiny_remount",
        f"mount of {n} tensors in {config.tiny_shards} shards, again",
        f"{median(again_times):.2f} s",
        median(again_times) / median(ref_times),
        "<= 1.0x safe_open().keys()",
        seconds=median(again_times),
        reference_seconds=median(ref_times),
    )
    report.add(
        "tiny_first_mount",
        "  ... the first mount (a fresh header cache)",
        f"{median(first_times):.2f} s",
        median(first_times) / median(ref_times),
        "<= 2x safe_open().keys()",
        seconds=median(first_times),
    )
    report.add(
        "tiny_mount",
        "  ... --no-cache",
        f"{median(mount_times):.2f} s",
        median(mount_times) / median(ref_times),
        "(reported)",
        seconds=median(mount_times),
        reference_seconds=median(ref_times),
    )
    report.add(
        "tiny_mount_selected",
        f"mount of 1% of them (--layers 0-{layers - 1})",
        f"{median(selected_times):.2f} s",
        median(selected_times) / median(mount_times),
        "<= 1.0x the whole mount",
        seconds=median(selected_times),
    )
    report.add(
        "tiny_listing",
        f"listing its root ({entries} entries)",
        f"{median(list_times):.2f} s",
        median(list_times) / median(plain_times),
        "<= 12x a real directory",
        seconds=median(list_times),
        plain_seconds=median(plain_times),
    )
    report.add(
        "tiny_listing_split",
        "  ... CPU: the daemon / the kernel for the lister",
        f"{median(ours):.2f} / {median(kernels):.2f} s",
        None,
        "(reported)",
        daemon_seconds=median(ours),
        kernel_seconds=median(kernels),
    )
    report.add(
        "tiny_rss",
        f"daemon RssAnon at {n} tensors",
        f"{median(rss) / 1024:.1f} MiB",
        None,
        "<= 64 MiB",
        kib=median(rss),
    )
