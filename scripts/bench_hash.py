#!/usr/bin/env python3
"""Hashing throughput of `tensorfs manifest` against `sha256sum`, and what the hash cache saves.

The bars, as ratios measured in one run on a model of >= 1 GiB (page cache warm):
- manifest throughput >= 0.9x sha256sum's over the same bytes;
- a second manifest of the unchanged model, answered by the cache: < 5% of the first one's time;
- writing the cache costs < 10% of hashing: a manifest of 60k small tensors with a fresh cache
  against the same with no cache (--small-tensors, 0 to skip).

The manifest is timed in-process (open_model + hash + format, exactly what the command does after
Python starts) and, for the record, end to end as a command, interpreter start included.

    .venv/bin/python scripts/bench_hash.py [--gib 1] [--shards 4] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tensorfs
from tensorfs.integrity import HashCache, Hasher, format_manifest
from tensorfs.synth import many_tiny_tensors, write_sharded


def build(directory: Path, gib: float, shards: int) -> list[Path]:
    per_tensor = 64 << 20
    tensors = max(1, int(gib * (1 << 30)) // per_tensor)
    per_shard = -(-tensors // shards)
    layout = []
    for s in range(shards):
        count = min(per_shard, tensors - s * per_shard)
        layout.append(
            {f"layers.{s}.{t}.weight": ("F32", [per_tensor // 4], os.urandom(per_tensor)) for t in range(count)}
        )
    return write_sharded(directory, layout)


def manifest_in_process(model_dir: Path, cache_dir: Path) -> float:
    start = time.perf_counter()
    with tensorfs.open_model(model_dir) as model:
        format_manifest(Hasher(model, HashCache(cache_dir)).hash_all())
    return time.perf_counter() - start


def hash_in_process(model_dir: Path, cache_dir: Path | None) -> float:
    start = time.perf_counter()
    with tensorfs.open_model(model_dir) as model:
        Hasher(model, HashCache(cache_dir)).hash_all()
    return time.perf_counter() - start


def timed_command(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small-tensors", type=int, default=60_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-hash-") as tmp:
        root = Path(tmp)
        shards = build(root / "model", args.gib, args.shards)
        nbytes = sum(p.stat().st_size for p in shards)
        for shard in shards:  # warm the page cache: both sides then read from memory
            with open(shard, "rb") as f:
                while f.read(16 << 20):
                    pass
        tensorfs_cli = [sys.executable, "-m", "tensorfs.cli", "manifest"]
        sha, first, cached, cli_first, cli_cached = [], [], [], [], []
        for i in range(args.repeat):
            sha.append(timed_command(["sha256sum", *map(str, shards)]))
            cache = root / f"cache{i}"
            first.append(manifest_in_process(root / "model", cache))
            cached.append(manifest_in_process(root / "model", cache))
            cli_cache = root / f"cli-cache{i}"
            cli_first.append(timed_command([*tensorfs_cli, "--cache-dir", str(cli_cache), str(root / "model")]))
            cli_cached.append(timed_command([*tensorfs_cli, "--cache-dir", str(cli_cache), str(root / "model")]))
        small_none, small_fresh = [], []
        if args.small_tensors:
            many_tiny_tensors(root / "small", args.small_tensors, 4)
            for i in range(args.repeat):
                small_none.append(hash_in_process(root / "small", None))
                small_fresh.append(hash_in_process(root / "small", root / f"small-cache{i}"))

    runs = dict(sha=sha, first=first, cached=cached, cli_first=cli_first, cli_cached=cli_cached)
    if args.small_tensors:
        runs.update(small_none=small_none, small_fresh=small_fresh)
    m = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "bytes": nbytes,
        "repeat": args.repeat,
        "sha256sum_s": round(m["sha"], 3),
        "manifest_s": round(m["first"], 3),
        "manifest_cached_s": round(m["cached"], 4),
        "throughput_ratio": round(m["sha"] / m["first"], 2),
        "cached_fraction": round(m["cached"] / m["first"], 4),
        "cli_manifest_s": round(m["cli_first"], 3),
        "cli_manifest_cached_s": round(m["cli_cached"], 3),
        "cli_throughput_ratio": round(m["sha"] / m["cli_first"], 2),
        "cli_cached_fraction": round(m["cli_cached"] / m["cli_first"], 3),
    }
    gb = nbytes / 1e9
    print(f"{nbytes / (1 << 30):.2f} GiB in {args.shards} shards, median of {args.repeat}:")
    print(f"  sha256sum                      {m['sha']:7.3f} s  {gb / m['sha']:6.2f} GB/s")
    print(
        f"  manifest (in-process)          {m['first']:7.3f} s  {gb / m['first']:6.2f} GB/s  "
        f"{result['throughput_ratio']:.2f}x sha256sum (bar >= 0.9x)"
    )
    share = 100 * result["cached_fraction"]
    print(f"  manifest again, cached         {m['cached']:7.4f} s  {share:.2f}% of the first (bar < 5%)")
    print(f"  tensorfs manifest (command)    {m['cli_first']:7.3f} s  {result['cli_throughput_ratio']:.2f}x sha256sum")
    share = 100 * result["cli_cached_fraction"]
    print(
        f"  ... again, cached (command)    {m['cli_cached']:7.3f} s  {share:.1f}% of the first (mostly Python's start)"
    )
    if args.small_tensors:
        result.update(
            small_tensors=args.small_tensors,
            small_no_cache_s=round(m["small_none"], 3),
            small_fresh_cache_s=round(m["small_fresh"], 3),
            small_cache_ratio=round(m["small_fresh"] / m["small_none"], 3),
        )
        print(
            f"  {args.small_tensors} small tensors, no cache    {m['small_none']:7.3f} s\n"
            f"  ... with a fresh cache         {m['small_fresh']:7.3f} s  "
            f"{result['small_cache_ratio']:.2f}x (bar: writing the cache < 10% of hashing)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
