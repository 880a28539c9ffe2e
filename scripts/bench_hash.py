#!/usr/bin/env python3
"""Hashing throughput of `tensorfs manifest` against `sha256sum`, and what the hash cache costs and saves.

Every figure is the median of --repeat tries (--small-repeat for the small tensors), the sides
taken in turns, page cache warm. The bars:
- fair: the `tensorfs manifest` command (interpreter start included) >= 0.9x the throughput of
  N `sha256sum` processes in parallel, N = tensorfs.integrity.HASH_WORKERS (tensorfs's hashing
  threads), over the tensors' bytes: each tensor's bytes copied into a file of its own, hashed by
  `xargs -0 -P N -n 1 sha256sum` (one process a tensor, handed out as processes finish, as
  tensorfs's threads take tensors);
- for the record, the old comparison: manifest in-process (open_model + hash + format, what the
  command does after Python starts) against one `sha256sum` of the shard files;
- a second manifest of the unchanged model, answered by the cache: < 5% of the first one's time;
- `tensorfs manifest` of --small-tensors (60k) tiny tensors with a fresh hash cache <= 1.1x
  `tensorfs manifest --no-cache` of the same, both as commands, --small-repeat tries (0 to skip).

    .venv/bin/python scripts/bench_hash.py [--gib 1] [--shards 4] [--repeat 3] [--small-tensors 60000]
        [--small-repeat 7] [--json FILE]
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
from tensorfs.bench.common import wait_until_settled
from tensorfs.hashcache import HashCache
from tensorfs.integrity import HASH_WORKERS, Hasher
from tensorfs.manifest import format_manifest
from tensorfs.sample_models import many_tiny_tensors, write_sharded

FAIR_BAR = 0.9
CACHED_BAR = 0.05
SMALL_BAR = 1.1


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


def tensor_files(model_dir: Path, directory: Path) -> list[Path]:
    """Each tensor's bytes in a file of its own, for sha256sum to hash the same bytes as tensorfs."""
    directory.mkdir()
    files = []
    with tensorfs.open_model(model_dir) as model:
        for name in model:
            info = model.info(name)
            path = directory / name
            with open(info.shard, "rb") as source, open(path, "wb") as target:
                copied = 0
                while copied < info.nbytes:
                    step = os.copy_file_range(
                        source.fileno(), target.fileno(), info.nbytes - copied, info.offset + copied
                    )
                    if step == 0:
                        raise OSError(f"{info.shard} ends inside tensor {name}")
                    copied += step
            files.append(path)
    return files


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def manifest_in_process(model_dir: Path, cache_dir: Path) -> float:
    start = time.perf_counter()
    with tensorfs.open_model(model_dir) as model:
        format_manifest(Hasher(model, HashCache(cache_dir)).hash_all())
    return time.perf_counter() - start


def timed_command(command: list[str], stdin: bytes | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, input=stdin, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small-tensors", type=int, default=60_000)
    parser.add_argument(
        "--small-repeat", type=int, default=7, help="Tries of the small-tensor pair (a second each; the bar is tight)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    manifest = [sys.executable, "-m", "tensorfs.cli", "manifest"]
    parallel_sha = ["xargs", "-0", "-P", str(HASH_WORKERS), "-n", "1", "sha256sum"]
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-hash-") as tmp:
        root = Path(tmp)
        model = root / "model"
        shards = build(model, args.gib, args.shards)
        nbytes = sum(p.stat().st_size for p in shards)
        pieces = tensor_files(model, root / "tensors")
        warm(shards + pieces)  # both sides then read from memory
        wait_until_settled(shards)  # else the hash cache keeps nothing of them
        names = b"".join(bytes(path) + b"\0" for path in pieces)
        runs: dict[str, list[float]] = {
            k: [] for k in ("sha", "sha_parallel", "first", "cached", "cli_first", "cli_cached")
        }
        for i in range(args.repeat):
            runs["sha"].append(timed_command(["sha256sum", *map(str, shards)]))
            runs["sha_parallel"].append(timed_command(parallel_sha, stdin=names))
            cache = root / f"cache{i}"
            runs["first"].append(manifest_in_process(model, cache))
            runs["cached"].append(manifest_in_process(model, cache))
            cli_cache = root / f"cli-cache{i}"
            runs["cli_first"].append(timed_command([*manifest, "--cache-dir", str(cli_cache), str(model)]))
            runs["cli_cached"].append(timed_command([*manifest, "--cache-dir", str(cli_cache), str(model)]))
        if args.small_tensors:
            small = root / "small"
            warm(many_tiny_tensors(small, args.small_tensors, 4))
            wait_until_settled(list(small.iterdir()))  # a fresh cache is then filled, as a user's is
            runs["small_none"], runs["small_fresh"] = [], []
            for i in range(args.small_repeat):
                runs["small_none"].append(timed_command([*manifest, "--no-cache", str(small)]))
                fresh = root / f"small-cache{i}"
                runs["small_fresh"].append(timed_command([*manifest, "--cache-dir", str(fresh), str(small)]))

    m = {k: statistics.median(v) for k, v in runs.items()}
    result: dict[str, object] = {
        "bytes": nbytes,
        "tensors": len(pieces),
        "repeat": args.repeat,
        "hash_workers": HASH_WORKERS,
        "sha256sum_s": round(m["sha"], 3),
        "sha256sum_parallel_s": round(m["sha_parallel"], 3),
        "manifest_s": round(m["first"], 3),
        "manifest_cached_s": round(m["cached"], 4),
        "throughput_ratio": round(m["sha"] / m["first"], 3),
        "cached_fraction": round(m["cached"] / m["first"], 4),
        "cli_manifest_s": round(m["cli_first"], 3),
        "cli_manifest_cached_s": round(m["cli_cached"], 3),
        "cli_throughput_ratio": round(m["sha"] / m["cli_first"], 3),
        "fair_throughput_ratio": round(m["sha_parallel"] / m["cli_first"], 3),
        "cli_cached_fraction": round(m["cli_cached"] / m["cli_first"], 3),
    }
    gb = nbytes / 1e9
    n = HASH_WORKERS

    def line(what: str, seconds: float, *said: str) -> None:
        print(f"  {what:<48} {seconds:8.4f} s  {'  '.join(said)}".rstrip())

    print(f"{nbytes / (1 << 30):.2f} GiB, {len(pieces)} tensors in {args.shards} shards, median of {args.repeat}:")
    line("sha256sum of the shards (one process)", m["sha"], f"{gb / m['sha']:5.2f} GB/s")
    line(f"{n} sha256sum in parallel, one a tensor", m["sha_parallel"], f"{gb / m['sha_parallel']:5.2f} GB/s")
    line(
        "tensorfs manifest (command)",
        m["cli_first"],
        f"{gb / m['cli_first']:5.2f} GB/s",
        f"{result['fair_throughput_ratio']:.2f}x {n} parallel sha256sum (bar >= {FAIR_BAR}x), "
        f"{result['cli_throughput_ratio']:.2f}x one",
    )
    line(
        "manifest in-process (no Python start)",
        m["first"],
        f"{gb / m['first']:5.2f} GB/s",
        f"{result['throughput_ratio']:.2f}x one sha256sum (the old comparison)",
    )
    share = 100 * m["cached"] / m["first"]
    line(
        "manifest again, cached (in-process)", m["cached"], f"{share:.2f}% of the first (bar < {100 * CACHED_BAR:.0f}%)"
    )
    share = 100 * m["cli_cached"] / m["cli_first"]
    line("... again, cached (command)", m["cli_cached"], f"{share:.1f}% of the first (mostly Python's start)")
    if args.small_tensors:
        result.update(
            small_tensors=args.small_tensors,
            small_repeat=args.small_repeat,
            small_no_cache_s=round(m["small_none"], 3),
            small_fresh_cache_s=round(m["small_fresh"], 3),
            small_cache_ratio=round(m["small_fresh"] / m["small_none"], 3),
        )
        line(
            f"tensorfs manifest --no-cache, {args.small_tensors} tiny tensors",
            m["small_none"],
            f"(median of {args.small_repeat})",
        )
        line(
            "... with a fresh hash cache (--cache-dir)",
            m["small_fresh"],
            f"{result['small_cache_ratio']:.2f}x --no-cache (bar <= {SMALL_BAR}x)",
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
