#!/usr/bin/env python3
"""How long tensorfs.open_model takes on a model of many tensors, against the reference reader.

The bars: opening a 100k-tensor model of 20 shards from scratch (cache=False) takes at most 2x the
time that `safetensors.safe_open(shard).keys()` takes over the same shards; with every header in
the header cache, at most 1x. Both run in this process, page
cache warm, alternating, and each figure is the median of --repeat tries.

    .venv/bin/python scripts/bench_open.py [--tensors 100000] [--shards 20] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors

import tensorfs
from tensorfs.bench.common import wait_until_settled
from tensorfs.sample_models import many_tiny_tensors


def reference_keys(shards: list[Path]) -> int:
    count = 0
    for shard in shards:
        with safetensors.safe_open(str(shard), framework="np") as f:
            count += len(f.keys())
    return count


def tensorfs_open(directory: Path, cache: Path | bool) -> int:
    with tensorfs.open_model(directory, cache=cache) as model:
        return len(model)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-open-") as tmp:
        directory = Path(tmp)
        shards = many_tiny_tensors(directory, args.tensors, args.shards)
        wait_until_settled(list(directory.iterdir()))  # else the header cache keeps nothing of them
        cache = directory / "header-cache"
        reference_keys(shards)  # warm the page cache and the code paths once; fill the header cache
        tensorfs_open(directory, False)
        tensorfs_open(directory, cache)
        ref_times, our_times, cached_times = [], [], []
        for _ in range(args.repeat):
            seconds, count = timed(lambda: reference_keys(shards))
            assert count == args.tensors, count
            ref_times.append(seconds)
            seconds, count = timed(lambda: tensorfs_open(directory, False))
            assert count == args.tensors, count
            our_times.append(seconds)
            seconds, count = timed(lambda: tensorfs_open(directory, cache))
            assert count == args.tensors, count
            cached_times.append(seconds)

    ref, ours, cached = (statistics.median(times) for times in (ref_times, our_times, cached_times))
    result = {
        "tensors": args.tensors,
        "shards": args.shards,
        "repeat": args.repeat,
        "reference_keys_s": round(ref, 4),
        "open_model_s": round(ours, 4),
        "ratio": round(ours / ref, 2),
        "bar": 2.0,
        "open_model_cached_s": round(cached, 4),
        "cached_ratio": round(cached / ref, 2),
        "cached_bar": 1.0,
    }
    print(f"{args.tensors} tensors in {args.shards} shards, median of {args.repeat}:")
    print(f"  safetensors.safe_open().keys()          {ref:8.3f} s")
    print(f"  tensorfs.open_model(cache=False)        {ours:8.3f} s   {ours / ref:.2f}x (bar: <= 2.0x)")
    print(f"  tensorfs.open_model(), headers cached   {cached:8.3f} s   {cached / ref:.2f}x (bar: <= 1.0x)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
