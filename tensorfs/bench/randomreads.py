"""random: random readers of one big tensor, page cache dropped before each try: 4 KiB and 1 MiB
reads at random offsets (the same offsets for every side) of the original file, through bindfs,
through the least pyfuse3 daemon (floor.py: this stack's floor), and through tensorfs's mount; and
what tensorfs read ahead of them against what it served (a window ahead is a stream's only:
docs/performance.md)."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

from .common import Config, Mounter, Report, can_drop_caches, daemon_stats, drop_caches
from .peers import Knobs, apt_installed, bindfs_peer, floor_peer

__all__ = ["run"]

SIZES = {"4k": 4096, "1m": 1 << 20}
"""The read sizes measured, by key."""
SPAN = 1 << 30
"""Bytes each random reader reads in all (a quarter of the tensor, at most)."""


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    report = Report()
    if not can_drop_caches():
        report.notes.append("random reads skipped: cannot drop the page cache (needs root)")
        return report
    missing = apt_installed("bindfs")
    workdir = Path(config.workdir or os.environ.get("TMPDIR", "/tmp"))
    work = workdir / f"tensorfs-bench-random-{os.getpid()}"
    work.mkdir()
    try:
        nbytes = int(config.random_gib * (1 << 30)) // 4096 * 4096
        out(f"writing a tensor of {nbytes / 2**30:g} GiB of random bytes ...")
        shard = work / "model" / "model.safetensors"
        shard.parent.mkdir()
        _write_big_tensor(shard, nbytes)
        offset = shard.stat().st_size - nbytes
        mounter = Mounter(work, config)
        tensors = {"big": (shard, offset, nbytes)}
        for key, size in SIZES.items():
            reads = max(16, min(config.random_reads, nbytes // size // 4, (SPAN // size)))
            where = [offset + random.Random(7 + k).randrange(0, (nbytes - size) // 4096) * 4096 for k in range(reads)]
            direct, bindfs, floor, mounted, ahead, served = [], [], [], [], [], []
            for _ in range(config.repeat):
                drop_caches()
                direct.append(_rate(shard, where, size))
                if missing is None:
                    peer = bindfs_peer(shard, tensors, work / "bindfs.log")
                    with peer.mounted(mounter.fresh_mountpoint(), Knobs(config.readahead_kb, 64)) as (locate, _):
                        path, _, _ = locate("big")
                        drop_caches()
                        bindfs.append(_rate(path, where, size))
                with floor_peer(shard, tensors, work / "floor.log").mounted(
                    mounter.fresh_mountpoint(), Knobs(config.readahead_kb, 64)
                ) as (locate, _):
                    path, _, _ = locate("big")
                    drop_caches()
                    floor.append(_rate(path, [w - offset for w in where], size))
                with mounter.mounted(shard.parent) as (mnt, _):
                    drop_caches()
                    before = daemon_stats(mnt)
                    mounted.append(_rate(mnt / "big", [w - offset for w in where], size))
                    after = daemon_stats(mnt)
                    ahead.append(after["prefetch_bytes"] - before["prefetch_bytes"])
                    served.append(after["read_bytes"]["tensor"] - before["read_bytes"]["tensor"])
            base = median(bindfs) if bindfs else median(direct)
            against = "bindfs" if bindfs else "the file"
            report.add(
                f"random_{key}_direct", f"{key} random reads of the file, cold (baseline)",
                f"{median(direct):,.0f} reads/s", None, "", reads_per_second=median(direct), reads=reads,
            )  # fmt: skip
            if bindfs:
                report.add(
                    f"random_{key}_bindfs", f"{key} random reads through bindfs, cold",
                    f"{median(bindfs):,.0f} reads/s", median(bindfs) / median(direct), "(reported)",
                    reads_per_second=median(bindfs),
                )  # fmt: skip
            report.add(
                f"random_{key}_floor", f"{key} random reads through the pyfuse3 floor, cold",
                f"{median(floor):,.0f} reads/s", median(floor) / base, "(reported)", reads_per_second=median(floor),
            )  # fmt: skip
            report.add(
                f"random_{key}", f"{key} random reads through the mount, cold",
                f"{median(mounted):,.0f} reads/s", median(mounted) / base,
                f">= 1.0x {against}" if key == "4k" else "(reported)", reads_per_second=median(mounted),
            )  # fmt: skip
            report.add(
                f"random_{key}_ahead", "  ... read ahead of them, against bytes served",
                f"{median(ahead) / 2**20:,.1f} / {median(served) / 2**20:,.1f} MiB",
                median(ahead) / max(1, median(served)),
                "<= 1.5x", ahead_bytes=median(ahead), served_bytes=median(served),
            )  # fmt: skip
        if missing is not None:
            report.notes.append(f"bindfs not measured: {missing}")
    finally:
        _remove(work)
    return report


def _write_big_tensor(shard: Path, nbytes: int) -> None:
    """One U8 tensor `big` of `nbytes` random bytes (not a sparse file: read from disk, as a model is)."""
    header = json.dumps({"big": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(shard, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = nbytes
        while left:
            piece = os.urandom(min(left, 16 << 20))
            f.write(piece)
            left -= len(piece)


def _rate(path: Path, offsets: list[int], size: int) -> float:
    """Reads a second: `size` bytes at each offset, one after another."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        for offset in offsets:
            os.pread(fd, size, offset)
        return len(offsets) / (time.perf_counter() - start)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
