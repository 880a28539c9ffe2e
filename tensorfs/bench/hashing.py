"""Hashing throughput of `tensorfs manifest` against `sha256sum`, and what the hash cache costs and saves.

Every figure is the median of --repeat tries (Config.hash_small_repeat, 7, for the small tensors),
the sides taken in turns, page cache warm. The bars:
- fair: the `tensorfs manifest` command (interpreter start included) >= 0.9x the throughput of
  N `sha256sum` processes in parallel, N = tensorfs.proof.integrity.HASH_WORKERS (tensorfs's hashing
  threads), over the tensors' bytes: each tensor's bytes copied into a file of its own, hashed by
  `xargs -0 -P N -n 1 sha256sum` (one process a tensor, handed out as processes finish, as
  tensorfs's threads take tensors);
- for the record, the old comparison: manifest in-process (open_model + hash + format, what the
  command does after Python starts) against one `sha256sum` of the shard files;
- a second manifest of the unchanged model, answered by the cache: < 5% of the first one's time;
- `tensorfs manifest` of --tensors (60k) tiny tensors with a fresh hash cache <= 1.1x
  `tensorfs manifest --no-cache` of the same, both as commands, hash_small_repeat tries
  (--tensors 0 skips them).

    tensorfs bench --suite hash [--gib 1] [--shards 4] [--repeat 3] [--tensors 60000] [-o FILE]
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..caches.hashes import HashCache
from ..opening.source import open_model
from ..proof.integrity import HASH_WORKERS, Hasher
from ..proof.manifest import format_manifest
from ..testing.sample_models import many_tiny_tensors, write_sharded
from .common import Config, Report, gbps, wait_until_settled, warm

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
    with open_model(model_dir) as model:
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


def manifest_in_process(model_dir: Path, cache_dir: Path) -> float:
    start = time.perf_counter()
    with open_model(model_dir) as model:
        format_manifest(Hasher(model, HashCache(cache_dir)).hash_all())
    return time.perf_counter() - start


def sums(output: str) -> str:
    """What a list of "<sha256>  <name>" lines (sha256sum's, a manifest's) says of the bytes hashed,
    whatever the names: the SHA-256 of its sorted hashes. Two sides that hashed the same bytes say the same."""
    hashes = sorted(line.split()[0] for line in output.splitlines() if line.strip())
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def said(command: list[str], stdin: bytes | None = None) -> str:
    """What `command` writes on its standard output (run untimed: what a side hashed)."""
    return subprocess.run(command, check=True, input=stdin, capture_output=True).stdout.decode()


def timed_command(command: list[str], stdin: bytes | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, input=stdin, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    gib, shard_count, repeat = config.hash_gib, config.hash_shards, config.hash_repeat
    small_tensors, small_repeat = config.hash_small_tensors, config.hash_small_repeat
    manifest = [sys.executable, "-m", "tensorfs.cli", "manifest"]
    parallel_sha = ["xargs", "-0", "-P", str(HASH_WORKERS), "-n", "1", "sha256sum"]
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-hash-", dir=config.workdir) as tmp:
        root = Path(tmp)
        model = root / "model"
        out(f"building a {gib:g} GiB model of 64 MiB tensors in {shard_count} shards; median of {repeat} tries ...")
        shards = build(model, gib, shard_count)
        nbytes = sum(p.stat().st_size for p in shards)
        pieces = tensor_files(model, root / "tensors")
        warm(shards + pieces)  # both sides then read from memory
        wait_until_settled(shards)  # else the hash cache keeps nothing of them
        names = b"".join(bytes(path) + b"\0" for path in pieces)
        runs: dict[str, list[float]] = {
            k: [] for k in ("sha", "sha_parallel", "first", "cached", "cli_first", "cli_cached")
        }
        for i in range(repeat):
            runs["sha"].append(timed_command(["sha256sum", *map(str, shards)]))
            runs["sha_parallel"].append(timed_command(parallel_sha, stdin=names))
            cache = root / f"cache{i}"
            runs["first"].append(manifest_in_process(model, cache))
            runs["cached"].append(manifest_in_process(model, cache))
            cli_cache = root / f"cli-cache{i}"
            runs["cli_first"].append(timed_command([*manifest, "--cache-dir", str(cli_cache), str(model)]))
            runs["cli_cached"].append(timed_command([*manifest, "--cache-dir", str(cli_cache), str(model)]))
        # What each side hashed, untimed: the same bytes, the same hashes.
        with open_model(model) as opened:
            in_process = format_manifest(Hasher(opened, HashCache(root / "cache0")).hash_all())
        hashed = {
            "sha_parallel": sums(said(parallel_sha, stdin=names)),
            "cli": sums(said([*manifest, "--cache-dir", str(root / "cli-cache0"), str(model)])),
            "in_process": sums(in_process),
        }
        if small_tensors:
            out(f"building {small_tensors} tiny tensors in 4 shards; median of {small_repeat} tries ...")
            small = root / "small"
            warm(many_tiny_tensors(small, small_tensors, 4))
            wait_until_settled(list(small.iterdir()))  # a fresh cache is then filled, as a user's is
            runs["small_none"], runs["small_fresh"] = [], []
            for i in range(small_repeat):
                runs["small_none"].append(timed_command([*manifest, "--no-cache", str(small)]))
                fresh = root / f"small-cache{i}"
                runs["small_fresh"].append(timed_command([*manifest, "--cache-dir", str(fresh), str(small)]))
            manifests = {
                "none": said([*manifest, "--no-cache", str(small)]),
                "fresh": said([*manifest, "--cache-dir", str(root / "small-cache0"), str(small)]),
            }

    m = {k: statistics.median(v) for k, v in runs.items()}
    n = HASH_WORKERS
    report = Report()
    report.add(
        "sha256sum",
        f"sha256sum of {nbytes / (1 << 30):.2f} GiB in {shard_count} shards, one process (baseline)",
        speed(nbytes, m["sha"]),
        None,
        "",
        seconds=m["sha"],
        bytes=nbytes,
        shards=shard_count,
        repeat=repeat,
    )
    report.add(
        "sha256sum_parallel",
        f"{n} sha256sum in parallel, one a tensor of {len(pieces)} (baseline)",
        speed(nbytes, m["sha_parallel"]),
        None,
        "",
        seconds=m["sha_parallel"],
        hash_workers=n,
        tensors=len(pieces),
        sums=hashed["sha_parallel"],
    )
    report.add(
        "manifest_command",
        "tensorfs manifest (command)",
        speed(nbytes, m["cli_first"]),
        m["sha_parallel"] / m["cli_first"],
        f">= {FAIR_BAR}x {n} parallel sha256sum",
        seconds=m["cli_first"],
        sums=hashed["cli"],
    )
    report.add(
        "manifest_command_one",
        "  ... against one sha256sum of the shards",
        "",
        m["sha"] / m["cli_first"],
        "(reported)",
        seconds=m["cli_first"],
    )
    report.add(
        "manifest_in_process",
        "manifest in-process (no Python start)",
        speed(nbytes, m["first"]),
        m["sha"] / m["first"],
        "(the old comparison: one sha256sum)",
        seconds=m["first"],
        sums=hashed["in_process"],
    )
    report.add(
        "manifest_cached",
        "manifest again, cached (in-process)",
        f"{m['cached']:.4f} s, {100 * m['cached'] / m['first']:.2f}% of the first",
        m["cached"] / m["first"],
        f"< {CACHED_BAR}x the first",
        seconds=m["cached"],
    )
    report.add(
        "manifest_command_cached",
        "  ... again, cached (command)",
        f"{m['cli_cached']:.4f} s, {100 * m['cli_cached'] / m['cli_first']:.1f}% of the first",
        m["cli_cached"] / m["cli_first"],
        "(mostly Python's start)",
        seconds=m["cli_cached"],
    )
    if small_tensors:
        report.add(
            "small_no_cache",
            f"tensorfs manifest --no-cache, {small_tensors} tiny tensors (baseline)",
            f"{m['small_none']:.4f} s",
            None,
            "",
            seconds=m["small_none"],
            tensors=small_tensors,
            repeat=small_repeat,
            manifest=hashlib.sha256(manifests["none"].encode()).hexdigest(),
        )
        report.add(
            "small_fresh_cache",
            "  ... with a fresh hash cache (--cache-dir)",
            f"{m['small_fresh']:.4f} s",
            m["small_fresh"] / m["small_none"],
            f"<= {SMALL_BAR}x --no-cache",
            seconds=m["small_fresh"],
            manifest=hashlib.sha256(manifests["fresh"].encode()).hexdigest(),
        )
    return report


def speed(nbytes: int, seconds: float) -> str:
    return f"{seconds:.4f} s, {gbps(nbytes, seconds)}"
