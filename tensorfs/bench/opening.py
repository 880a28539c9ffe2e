"""How long tensorfs.open_model takes on a model of many tensors, against the reference reader.

The bars: opening a 100k-tensor model of 20 shards from scratch (cache=False) takes at most 2x the
time that `safetensors.safe_open(shard).keys()` takes over the same shards; with every header in
the header cache, at most 1x. Both run in this process, page
cache warm, alternating, and each figure is the median of --repeat tries.

    tensorfs bench --suite open [--tensors 100000] [--shards 20] [--repeat 9] [-o FILE]
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors

from ..opening.source import open_model
from ..testing.sample_models import many_tiny_tensors
from .common import Config, Report, wait_until_settled

BAR = 2.0
CACHED_BAR = 1.0


def reference_keys(shards: list[Path]) -> int:
    count = 0
    for shard in shards:
        with safetensors.safe_open(str(shard), framework="np") as f:
            count += len(f.keys())
    return count


def tensorfs_open(directory: Path, cache: Path | bool) -> int:
    with open_model(directory, cache=cache) as model:
        return len(model)


def reference_table(shards: list[Path]) -> str:
    """What the reference reads of the shards' headers: every tensor's name, dtype and shape (a SHA-256)."""
    rows = []
    for shard in shards:
        with safetensors.safe_open(str(shard), framework="np") as f:
            names = f.keys()
            rows += [f"{name} {f.get_slice(name).get_dtype()} {f.get_slice(name).get_shape()}" for name in names]
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def tensorfs_table(directory: Path, cache: Path | bool) -> str:
    """The same of what tensorfs.open_model reads."""
    with open_model(directory, cache=cache) as model:
        rows = [f"{name} {model.info(name).dtype} {list(model.info(name).shape)}" for name in model]
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    tensors, shard_count, repeat = config.open_tensors, config.open_shards, config.open_repeat
    report = Report()
    out(f"building {tensors} tensors in {shard_count} shards; median of {repeat} tries, page cache warm ...")
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-open-", dir=config.workdir) as tmp:
        directory = Path(tmp)
        shards = many_tiny_tensors(directory, tensors, shard_count)
        wait_until_settled(list(directory.iterdir()))  # else the header cache keeps nothing of them
        cache = directory / "header-cache"
        reference_keys(shards)  # warm the page cache and the code paths once; fill the header cache
        tensorfs_open(directory, False)
        tensorfs_open(directory, cache)
        ref_times, our_times, cached_times = [], [], []
        for _ in range(repeat):
            seconds, count = timed(lambda: reference_keys(shards))
            assert count == tensors, count
            ref_times.append(seconds)
            seconds, count = timed(lambda: tensorfs_open(directory, False))
            assert count == tensors, count
            our_times.append(seconds)
            seconds, count = timed(lambda: tensorfs_open(directory, cache))
            assert count == tensors, count
            cached_times.append(seconds)
        tables = {  # untimed: each side read the same table
            "reference": reference_table(shards),
            "scratch": tensorfs_table(directory, False),
            "cached": tensorfs_table(directory, cache),
        }

    ref, ours, cached = (statistics.median(times) for times in (ref_times, our_times, cached_times))
    report.add(
        "safe_open_keys",
        f"safetensors.safe_open().keys(), {tensors} tensors in {shard_count} shards (baseline)",
        f"{ref:.3f} s",
        None,
        "",
        seconds=ref,
        tensors=tensors,
        shards=shard_count,
        repeat=repeat,
        table=tables["reference"],
    )
    report.add(
        "open_model",
        "tensorfs.open_model(cache=False)",
        f"{ours:.3f} s",
        ours / ref,
        f"<= {BAR}x safe_open().keys()",
        seconds=ours,
        at_most=BAR,
        table=tables["scratch"],
    )
    report.add(
        "open_model_cached",
        "tensorfs.open_model(), headers cached",
        f"{cached:.3f} s",
        cached / ref,
        f"<= {CACHED_BAR}x safe_open().keys()",
        seconds=cached,
        at_most=CACHED_BAR,
        table=tables["cached"],
    )
    return report
