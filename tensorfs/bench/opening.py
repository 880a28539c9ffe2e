"""How long tensorfs.open_model takes on a model of many tensors, against the reference reader.

The bars: opening a 100k-tensor model of 20 shards from scratch (cache=False) takes at most 2x the
time that `safetensors.safe_open(shard).keys()` takes over the same shards; with every header in
the header cache, at most 1x. Both run in this process, page
cache warm, alternating, and each figure is the median of --repeat tries.

And the same through a mount (needs FUSE): `tensorfs mount` until it answers, a first time (its
header cache empty) at most 2x, and again (every header cached) at most 1x the reference reader's
keys in a process of its own (both start an interpreter and import what they need).

    tensorfs bench --suite open [--tensors 100000] [--shards 20] [--repeat 9] [--json FILE]
"""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors

from ..opener import open_model
from ..sample_models import many_tiny_tensors
from .common import Config, Mounter, Report, wait_until_settled

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


REFERENCE_PROCESS = """
import sys, safetensors
count = 0
for shard in sys.argv[1:]:
    with safetensors.safe_open(shard, framework="np") as f:
        count += len(f.keys())
print(count)
"""


def reference_process(shards: list[Path]) -> int:
    """The reference reader's keys of every shard, in a Python process of its own: its tensors."""
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE_PROCESS, *map(str, shards)], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    tensors, shard_count, repeat = config.open_tensors, config.open_shards, config.open_repeat
    report = Report()
    out(f"building {tensors} tensors in {shard_count} shards; median of {repeat} tries, page cache warm ...")
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-open-", dir=config.workdir) as tmp:
        directory = Path(tmp) / "model"
        shards = many_tiny_tensors(directory, tensors, shard_count)
        wait_until_settled(list(directory.iterdir()))  # else the header cache keeps nothing of them
        cache = Path(tmp) / "header-cache"
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
        mounts = _mounts(config, directory, shards, Path(tmp))

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
    report.add("mount_reference", "safe_open().keys() in a process of its own (baseline)", f"{mounts[0]:.3f} s",
               None, "", seconds=mounts[0])  # fmt: skip
    report.add("mount_first", "tensorfs mount until it answers, headers not cached", f"{mounts[1]:.3f} s",
               mounts[1] / mounts[0], f"<= {BAR}x the process's", seconds=mounts[1], at_most=BAR)  # fmt: skip
    report.add("mount_again", "tensorfs mount again, every header cached", f"{mounts[2]:.3f} s",
               mounts[2] / mounts[0], f"<= {CACHED_BAR}x the process's", seconds=mounts[2],
               at_most=CACHED_BAR)  # fmt: skip
    return report


def _mounts(config: Config, directory: Path, shards: list[Path], work: Path) -> tuple[float, float, float]:
    """`tensorfs mount` of the model until it answers, a first time and again, against the reference's
    keys in a process of its own; alternating, the median of --repeat tries: (the reference's
    seconds, the first mount's, the mount again's)."""
    mounter = Mounter(work, config)
    with safetensors.safe_open(str(shards[-1]), framework="np") as f:
        last = sorted(f.keys())[-1]  # a tensor the mount must show, once it answers
    reference_process(shards)  # the interpreter's and the libraries' files in the page cache
    references: list[float] = []
    firsts: list[float] = []
    agains: list[float] = []
    for attempt in range(config.open_repeat):
        seconds, count = timed(lambda: reference_process(shards))
        assert count == config.open_tensors, count
        references.append(seconds)
        cache = work / f"mount-cache{attempt}"
        for times in (firsts, agains):  # the first fills the header cache the second reads
            start = time.perf_counter()
            with mounter.mounted(directory, cache=cache) as (mountpoint, _):
                times.append(time.perf_counter() - start)
                assert (mountpoint / last).stat().st_size == 64, last  # an F32 [4, 4]
    reference, first, again = (statistics.median(times) for times in (references, firsts, agains))
    return reference, first, again
