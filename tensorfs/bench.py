"""The benchmark: tensorfs's read path, mount and listing against direct baselines, in one run.

Every figure is the median of several tries and is reported as a ratio to its baseline measured
in the same run, since these machines are noisy. `tensorfs bench` and `scripts/bench.py` run it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .mount.mounttable import daemon_pid, pid_alive
from .synth import Tensor, many_tiny_tensors, write_sharded
from .units import human_size

READ_SIZE = 1 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@dataclass
class Config:
    gib: float = 2.0
    shards: int = 4
    tensor_mib: int = 256
    small_tensors: int = 2000
    """Tiny tensors in an extra shard: names that no test has looked up yet, for the latency probes."""
    tiny_tensors: int = 100_000
    tiny_shards: int = 20
    repeat: int = 3
    readahead_kb: int = 1024
    mount_options: tuple[str, ...] = ()
    workdir: Path | None = None

    @classmethod
    def quick(cls) -> Config:
        return cls(gib=1 / 16, shards=2, tensor_mib=16, small_tensors=200, tiny_tensors=3000, tiny_shards=3, repeat=1)


@dataclass
class Report:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, key: str, what: str, value: str, ratio: float | None, bar: str, **data: Any) -> None:
        shown = "" if ratio is None else f"{ratio:.2f}x"
        self.rows.append((what, value, shown, bar))
        self.data[key] = {**data, "ratio": None if ratio is None else round(ratio, 3)}

    def table(self) -> str:
        widths = [max(len(r[i]) for r in [("measure", "value", "ratio", "bar"), *self.rows]) for i in range(4)]
        lines = []
        for row in [("measure", "value", "ratio", "bar"), *self.rows]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


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


def touch_fresh_memory(nbytes: int) -> None:
    """These VMs hand freed memory back to the host; fresh page-cache pages are slow until touched once."""
    block = np.ones(nbytes, dtype=np.uint8)
    del block


def warm(paths: list[Path]) -> None:
    buffer = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


# -- reading ----------------------------------------------------------------------------------


def read_range(path: Path, offset: int, nbytes: int) -> float:
    """Seconds to read [offset, offset + nbytes) of `path` in 1 MiB reads."""
    buffer = bytearray(READ_SIZE)
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = nbytes
        while left > 0:
            got = f.readinto(view[: min(READ_SIZE, left)])
            if not got:
                raise OSError(f"short read of {path}")
            left -= got
    return time.perf_counter() - start


def read_file(path: Path) -> float:
    return read_range(path, 0, path.stat().st_size)


def concurrently(jobs: list[Callable[[], object]]) -> float:
    """Seconds for all jobs, each on its own thread."""
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


# -- mounting ---------------------------------------------------------------------------------


class Mounter:
    def __init__(self, workdir: Path, config: Config) -> None:
        self.workdir = workdir
        self.config = config
        self.count = 0

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tensorfs.cli", *args]

    @contextlib.contextmanager
    def mounted(self, source: Path, *extra: str) -> Iterator[tuple[Path, int]]:
        """A fresh mount (so nothing of it is in the kernel's cache); yields (mountpoint, daemon pid)."""
        self.count += 1
        mountpoint = self.workdir / f"mnt{self.count}"
        mountpoint.mkdir()
        options = [f"--readahead-kb={self.config.readahead_kb}", "--no-cache", *self.config.mount_options, *extra]
        log = str(self.workdir / "daemon.log")
        subprocess.run(
            self.command("mount", "-q", "--log-file", log, *options, str(source), str(mountpoint)), check=True
        )
        pid = daemon_pid(mountpoint)
        assert pid is not None, f"no daemon record for {mountpoint}"
        try:
            yield mountpoint, pid
        finally:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)
            deadline = time.monotonic() + 30
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if pid_alive(pid):
                os.kill(pid, 9)
            mountpoint.rmdir()


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon")


# -- the measurements ---------------------------------------------------------------------------


def median(values: list[float] | list[int]) -> float:
    return statistics.median(values)


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
            with mounter.mounted(model_dir) as (mnt, _):
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
            with mounter.mounted(model_dir) as (mnt, _):
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
            direct_four.append(four_bytes / concurrently([functools.partial(read_range, *tensors[n]) for n in four]))
            with mounter.mounted(model_dir) as (mnt, _):
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

        cold_section(config, report, mounter, model_dir, tensors, big, small, shards, out)
        memory_section(report, mounter, model_dir, tensors, big, model_bytes)
        tiny_section(config, report, mounter, work)
    return report


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
    stats: list[float] = []
    opens: list[float] = []
    with mounter.mounted(model_dir) as (mnt, _):
        drop_caches()
        # The streams are dd processes, so that nothing in this process competes with the probes.
        streams = [
            subprocess.Popen(["dd", f"if={mnt / n}", "of=/dev/null", "bs=1M"], stderr=subprocess.DEVNULL)
            for n in (big * 4)[:4]
        ]
        probes = iter(small)
        while any(stream.poll() is None for stream in streams):
            name = next(probes, None)
            if name is None:
                break
            start = time.perf_counter()
            os.stat(mnt / f"{name}.meta.json")
            stats.append(time.perf_counter() - start)
            name = next(probes, None)
            if name is None:
                break
            start = time.perf_counter()
            with open(mnt / name, "rb") as f:
                f.read()
            opens.append(time.perf_counter() - start)
            time.sleep(0.002)
        for stream in streams:
            stream.wait()
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
    ref_times, mount_times, list_times, plain_times, rss = [], [], [], [], []
    for _ in range(config.repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", reference, *map(str, shards)], check=True)
        ref_times.append(time.perf_counter() - start)
        start_mount = time.perf_counter()
        with mounter.mounted(tiny) as (mnt, pid):
            mount_times.append(time.perf_counter() - start_mount)
            start = time.perf_counter()
            listed = len(os.listdir(mnt))
            list_times.append(time.perf_counter() - start)
            assert listed == entries, listed
            rss.append(rss_anon_kib(pid))
        start = time.perf_counter()
        os.listdir(listing_dir)
        plain_times.append(time.perf_counter() - start)
    n = config.tiny_tensors
    report.add(
        "tiny_mount",
        f"mount of {n} tensors in {config.tiny_shards} shards",
        f"{median(mount_times):.2f} s",
        median(mount_times) / median(ref_times),
        "<= 2x safe_open().keys()",
        seconds=median(mount_times),
        reference_seconds=median(ref_times),
    )
    report.add(
        "tiny_listing",
        f"listing its root ({entries} entries)",
        f"{median(list_times):.2f} s",
        median(list_times) / median(plain_times),
        "<= 8x a real directory",
        seconds=median(list_times),
        plain_seconds=median(plain_times),
    )
    report.add(
        "tiny_rss",
        f"daemon RssAnon at {n} tensors",
        f"{median(rss) / 1024:.1f} MiB",
        None,
        "<= 64 MiB",
        kib=median(rss),
    )


def main(config: Config, json_path: Path | None = None) -> int:
    report = run(config)
    print(report.table())
    if json_path is not None:
        json_path.write_text(json.dumps({"config": {k: str(v) for k, v in vars(config).items()}, **report.data,
                                         "notes": report.notes}, indent=2) + "\n")  # fmt: skip
    return 0
