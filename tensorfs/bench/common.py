"""What every part of the benchmark shares: its configuration, its report, reading, mounting."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from ..mount.mounttable import daemon_pid, pid_alive
from ..sources.pages import Pages
from ..testing.sample_models import Tensor, write_sharded
from ..utils import identity

DROP_CACHES = Path("/proc/sys/vm/drop_caches")

READ_SIZE = 1 << 20


OWN_FIELDS = {
    "open": "open_",
    "hash": "hash_",
    "small": "small_files_",
    "load": "load_",
    "formats": "formats_",
    "fleet": "fleet_",
    "signed": "signed_",
    "random": "random_",
}
"""The prefix of the Config fields of each suite whose defaults differ from the read suite's."""


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
    # The suites whose defaults differ from the read suite's have fields of their own:
    open_tensors: int = 100_000
    """The open suite (opening.py): open_model of this many tiny tensors ..."""
    open_shards: int = 20
    """... in this many shards ..."""
    open_repeat: int = 9
    """... median of this many tries."""
    hash_gib: float = 1.0
    """The hash suite (hashing.py): a model of 64 MiB tensors this big ..."""
    hash_shards: int = 4
    """... in this many shards ..."""
    hash_repeat: int = 3
    """... median of this many tries ..."""
    hash_small_tensors: int = 60_000
    """... and a model of this many tiny tensors (0: not measured) ..."""
    hash_small_repeat: int = 7
    """... its median of this many tries (a second each; the bar is tight)."""
    small_files_tensors: int = 60_000
    """The small suite (small.py): a mount of this many tiny tensors (three files each) ..."""
    small_files_repeat: int = 1
    """... median of this many tries (one takes about six minutes at 60k tensors)."""
    load_gib: float = 1.0
    """The load suite (loading.py): a model this big, in one file ..."""
    load_tensor_mib: int = 64
    """... of F32 tensors this big ..."""
    load_repeat: int = 3
    """... median of this many tries."""
    formats_gib: float = 1.0
    """The formats suite (formats.py): the same tensors this big as GGUF and as safetensors ..."""
    formats_repeat: int = 3
    """... median of this many tries (five times as many for validating) ..."""
    formats_tokens: int = 262_144
    """... and a GGUF of a vocabulary this long to validate (gemma's)."""
    fleet_gib: float = 1.0
    """The fleet suite (fleet.py): a model this big ..."""
    fleet_shards: int = 4
    """... in this many shards ..."""
    fleet_repeat: int = 3
    """... median of this many tries ..."""
    fleet_nodes: tuple[int, ...] = (1, 2, 4)
    """... of each count of nodes reading it at once."""
    signed_gib: float = 4.0
    """The signed suite (signed.py): a model this big ..."""
    signed_shards: int = 4
    """... in this many shards ..."""
    signed_tensor_mib: int = 64
    """... of F32 tensors this big, signed by files and by ranges ..."""
    signed_range_mib: int = 16
    """... this big ..."""
    signed_repeat: int = 3
    """... median of this many tries."""
    random_gib: float = 1.0
    """The random suite (randomreads.py): a tensor this big, read at random offsets ..."""
    random_reads: int = 2000
    """... this many reads of each size (a quarter of the tensor at most) ..."""
    random_repeat: int = 3
    """... median of this many tries."""

    def settings(self, suite: str) -> dict[str, str]:
        """The fields `suite` reads, as text (the JSON report's "config"): the open, hash and small
        suites have fields of their own (OWN_FIELDS) and the workdir; read and remote all the others."""
        own = OWN_FIELDS.get(suite)
        return {
            name: str(value)
            for name, value in vars(self).items()
            if name == "workdir"
            or (name.startswith(own) if own is not None else not name.startswith(tuple(OWN_FIELDS.values())))
        }

    @classmethod
    def quick(cls) -> Config:
        return cls(
            gib=1 / 16,
            shards=2,
            tensor_mib=16,
            small_tensors=200,
            tiny_tensors=3000,
            tiny_shards=3,
            repeat=1,
            open_tensors=2000,
            open_shards=3,
            open_repeat=1,
            hash_gib=0.13,  # two tensors of 64 MiB: the parallel sha256sum has two to share
            hash_shards=2,
            hash_repeat=1,
            hash_small_tensors=2000,
            hash_small_repeat=1,
            small_files_tensors=300,
            small_files_repeat=1,
            load_gib=1 / 16,
            load_tensor_mib=8,
            load_repeat=1,
            formats_gib=1 / 16,
            formats_repeat=1,
            formats_tokens=16_384,
            fleet_gib=1 / 16,
            fleet_shards=2,
            fleet_repeat=1,
            fleet_nodes=(1, 2),
            signed_gib=1 / 16,
            signed_shards=2,
            signed_tensor_mib=8,
            signed_range_mib=1,
            signed_repeat=1,
            random_gib=1 / 16,
            random_reads=200,
            random_repeat=1,
        )


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


def compile_package() -> str | None:
    """tensorfs's modules compiled to bytecode before anything is timed, as an installed package's
    are (pip compiles them as it installs): a checkout installed in place is not, and with
    PYTHONDONTWRITEBYTECODE set (as on these machines) every `tensorfs` process the benchmark starts
    would compile every module it imports again (docs/performance.md). A note when they cannot be."""
    import compileall

    package = Path(__file__).resolve().parent.parent
    if compileall.compile_dir(package, quiet=2):
        return None
    return f"tensorfs's modules could not all be compiled under {package}: each command timed compiled them first"


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


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


def daemon_stats(mountpoint: Path) -> dict[str, Any]:
    """What a mount's daemon counts: its .tensorfs/stats.json."""
    stats: dict[str, Any] = json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())
    return stats


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


MACHINE_LOCK = "TENSORFS_TEST_MACHINE_LOCK"
"""The variable naming the lock that the tests take while they drop or measure the page cache
(tests/conftest.py): a benchmark run by a test takes it too to drop the cache."""


def drop_caches() -> None:
    """Sync, then have the kernel drop its page cache, dentries and inodes: under the tests' lock
    when MACHINE_LOCK names one, so that what a test measures of the page cache is not dropped."""
    os.sync()
    with _tests_lock():
        DROP_CACHES.write_text("3\n")


@contextlib.contextmanager
def _tests_lock() -> Iterator[None]:
    path = os.environ.get(MACHINE_LOCK)
    if not path:
        yield
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # let go with its descriptor
        yield
    finally:
        os.close(fd)


# -- what each side read ------------------------------------------------------------------------

Look = Callable[[Any], object]
"""How a side of a comparison looks at each tensor (or buffer) it reads: touched in the timed tries,
seen (BytesRead) in an untimed one."""


class BytesRead:
    """What one side of a comparison read, by its bytes: a CRC-32C of every tensor, array, buffer or
    file it looked at, in whatever order it read them (a streamer hands tensors out as they come),
    and their count of bytes. Two sides that read the same bytes say the same."""

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self.nbytes = 0

    def __call__(self, piece: Any) -> None:
        data = _bytes_of(piece)
        self.crcs.append(crc32c.crc32c(data))
        self.nbytes += len(data)

    def said(self) -> str:
        """ "<the pieces' CRC-32Cs, sorted, hashed>/<bytes>": what the report keeps of it."""
        crcs = b"".join(crc.to_bytes(4, "little") for crc in sorted(self.crcs))
        return f"{hashlib.sha256(crcs).hexdigest()[:16]}/{self.nbytes}"


def _bytes_of(piece: Any) -> memoryview:
    if type(piece).__module__.startswith("torch"):
        import torch

        piece = piece.contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(piece, np.ndarray):
        return np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data
    return memoryview(piece).cast("B")


def files_seen(paths: Sequence[Path]) -> str:
    """BytesRead.said() of the files, each read whole (a piece each)."""
    seen = BytesRead()
    for path in paths:
        crc, nbytes = 0, 0
        with open(path, "rb", buffering=0) as f:
            while block := f.read(READ_SIZE):
                crc, nbytes = crc32c.crc32c(block, crc), nbytes + len(block)
        seen.crcs.append(crc)
        seen.nbytes += nbytes
    return seen.said()


def medians(
    sides: dict[str, Callable[[Look], object]], repeat: int, look: Look, between: Callable[[], object] = lambda: None
) -> tuple[dict[str, float], dict[str, str]]:
    """Each side's median time over `repeat` tries, the sides taken in turns, after one untimed try
    of each (the first try of a side pays for what the others then find ready), in which what it
    reads is seen (BytesRead); the timed tries `look` at it. `between` runs after every try, untimed.
    (medians, what each side read)."""
    seen: dict[str, str] = {}
    for name, work in sides.items():
        reading = BytesRead()
        work(reading)
        seen[name] = reading.said()
        between()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, work in sides.items():
            start = time.perf_counter()
            work(look)
            times[name].append(time.perf_counter() - start)
            between()
    return {name: statistics.median(found) for name, found in times.items()}, seen


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

    def fresh_mountpoint(self) -> Path:
        """A path for a mountpoint, never used before in this run (not made yet)."""
        self.count += 1
        return self.workdir / f"mnt{self.count}"

    @contextlib.contextmanager
    def mounted(
        self,
        source: Path | str,
        *extra: str,
        at: Path | None = None,
        cache: Path | None = None,
        warm_first: list[Path] | None = None,
        prefix: Sequence[str] = (),
    ) -> Iterator[tuple[Path, int]]:
        """A fresh mount (so nothing of it is in the kernel's cache); yields (mountpoint, daemon pid).
        Without the caches of headers and hashes unless `cache` says where they are. `warm_first`:
        files read into the page cache before mounting, for a measure of reads of a warm source (a
        mount lets its source's pages go as it serves them: each try then starts as the first did).
        `prefix`: what `tensorfs mount` is run by (a node's nsenter: cluster.Node.command)."""
        warm(warm_first or [])
        mountpoint = self.fresh_mountpoint() if at is None else at
        mountpoint.mkdir()
        caching = ["--no-cache"] if cache is None else ["--cache-dir", str(cache)]
        options = [f"--readahead-kb={self.config.readahead_kb}", *caching, *self.config.mount_options, *extra]
        log = str(self.workdir / "daemon.log")
        subprocess.run(
            [*prefix, *self.command("mount", "-q", "--log-file", log, *options, str(source), str(mountpoint))],
            check=True,
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


def probe_while(streams: list[subprocess.Popen[bytes]], mnt: Path, small: list[str]) -> tuple[list[float], list[float]]:
    """While `streams` run: a stat of a .meta.json, then an open+read of a small tensor, names not
    looked up before, every 2 ms. The seconds of each (stats, opens); the streams waited for."""
    stats: list[float] = []
    opens: list[float] = []
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
    return stats, opens


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of `paths` in the page cache (mincore over a mapping of each: nothing is read)."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapping:
                view = memoryview(mapping)
                try:
                    total += Pages(view, advise=False).resident_bytes()
                finally:
                    view.release()
    return total


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon")


def wait_until_settled(paths: list[Path]) -> None:
    """Wait until files just written are old enough for the caches to keep what is read of them
    (tensorfs.utils.identity.SETTLED_NS): a benchmark of the caches must not measure files they refuse."""
    newest = max((path.stat().st_ctime_ns for path in paths), default=0)
    while (left := newest + identity.SETTLED_NS - time.time_ns()) > 0:
        time.sleep(left / 1e9)


def cpu_seconds(pid: int) -> float:
    """User and system time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(values: list[float] | list[int]) -> float:
    return statistics.median(values)


CHUNK = 8 << 20
CONCURRENCY = 8
TENSOR = 64 << 20
"""The big model's tensors (the throughput, the memory, four cold readers)."""
SMALL_TENSOR = 4 << 20
"""A second model's (1 GiB, 4 shards): what reading one of them fetches."""


def build(directory: Path, gib: float, shards: int, tensor: int, small: int = 0) -> list[str]:
    """Shards of F32 tensors of random bytes (and a shard of `small` tiny ones); the big tensors' names."""
    count = max(shards, int(gib * (1 << 30)) // tensor)
    per_shard = -(-count // shards)
    layout: list[dict[str, Tensor]] = [
        {
            f"big.{t:04d}": ("F32", [tensor // 4], os.urandom(tensor))
            for t in range(s * per_shard, min(count, (s + 1) * per_shard))
        }
        for s in range(shards)
    ]
    if small:
        layout.append({f"small.{i:05d}": ("F32", [16], os.urandom(64)) for i in range(small)})
    write_sharded(directory, layout)
    return sorted(name for shard in layout for name in shard if name.startswith("big."))


PIECE = 256 << 10
"""The pieces a download into files writes at a time (as the daemon's fetches do)."""


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """The process's environment with `values` set (a peer's client reads its store from there), as it was after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
