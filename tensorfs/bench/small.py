"""Small files and metadata: what users run first over a mount, against a local copy of the same tree.

A model of --tensors tiny tensors (F32 [4, 4], 64 bytes each) in one shard is mounted; its tree
(every tensor, its .meta.json and .sha256, and .tensorfs/SHA256SUMS, hashes already computed) is
copied to a local directory once. Then each command runs on a fresh mount (nothing of it in the
kernel's caches: what a user sees first), then again on the same mount (names, attributes and
pages cached by the kernel), and on the local copy (page cache warm), in turns, --repeat times;
the figures are medians and the ratios mount / local, with the issue's bars:
`sha256sum -c .tensorfs/SHA256SUMS` <= 2x, `cp -r` <= 2x, `find -type f | wc -l` and
`ls -lR > /dev/null` <= 3x. The same commands run through the floor of the stack
(tensorfs/bench/floor.py: pyfuse3 serving the shard's tensors with nothing else) on the tensor
files only, against a local copy of that tree: what any pyfuse3 daemon pays, for comparison.
Also reported: the FUSE requests tensorfs answered for each command (from .tensorfs/stats.json).

    tensorfs bench --suite small [--tensors 60000] [--repeat 1] [-o FILE]

(One try takes about six minutes at 60k tensors: `cp -r` of 180k files is most of it.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..testing.sample_models import many_tiny_tensors
from .common import Config, Report

BARS = {"sha256sum -c": 2.0, "cp -r": 2.0, "find -type f | wc -l": 3.0, "ls -lR": 3.0}
KEYS = {"sha256sum -c": "sha256sum_c", "cp -r": "cp_r", "find -type f | wc -l": "find_wc", "ls -lR": "ls_lR"}
"""Each command's key in the report (the JSON): its rows are KEY, KEY_again, KEY_local, KEY_floor, ..."""
TENSORFS = [sys.executable, "-m", "tensorfs.cli"]


def commands(tree: Path, scratch: Path, sums: str) -> dict[str, Callable[[], None]]:
    """Each command over `tree`, as a shell would run it (output thrown away)."""

    def run(*args: str, shell: bool = False) -> None:
        subprocess.run(args[0] if shell else list(args), cwd=tree, shell=shell, check=True, stdout=subprocess.DEVNULL)

    def copy() -> None:
        target = scratch / "copied"
        shutil.rmtree(target, ignore_errors=True)
        run("cp", "-r", str(tree), str(target))
        shutil.rmtree(target)

    return {
        "sha256sum -c": lambda: run("sha256sum", "--quiet", "-c", sums),
        "cp -r": copy,
        "find -type f | wc -l": lambda: run(f"find {tree} -type f | wc -l", shell=True),
        "ls -lR": lambda: run("ls", "-lR", str(tree)),
    }


def timed(job: Callable[[], None]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


@contextlib.contextmanager
def tensorfs_mount(model: Path, mountpoint: Path, env: dict[str, str]) -> Iterator[Path]:
    subprocess.run([*TENSORFS, "mount", "-q", str(model), str(mountpoint)], check=True, env=env)
    try:
        yield mountpoint
    finally:
        subprocess.run([*TENSORFS, "umount", str(mountpoint)], check=True, env=env)


@contextlib.contextmanager
def floor_mount(shard: Path, mountpoint: Path) -> Iterator[Path]:
    daemon = subprocess.Popen([sys.executable, "-m", "tensorfs.bench.floor", str(shard), str(mountpoint)])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the floor daemon did not mount")
            time.sleep(0.01)
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        daemon.wait(timeout=30)


def requests_of(mountpoint: Path) -> dict[str, int]:
    counted: dict[str, int] = json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())["requests"]
    return counted


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    tensors, repeat = config.small_files_tensors, config.small_files_repeat
    out(f"{tensors} tiny tensors ({3 * tensors} files), medians of {repeat}; each command on a")
    out("fresh mount, then again on it (kernel caches warm), and on a local copy of the tree ...")
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-small-", dir=config.workdir) as tmp:
        work = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "TENSORFS_RUNTIME_DIR": str(work / "run")}
        env["XDG_STATE_HOME"] = str(work / "state")
        (shard,) = many_tiny_tensors(work / "model", tensors, 1)
        mountpoint = work / "mnt"
        mountpoint.mkdir()
        local, floor_local = work / "local", work / "floor-local"
        with tensorfs_mount(work / "model", mountpoint, env):  # hashes computed, the tree copied once
            (mountpoint / ".tensorfs" / "SHA256SUMS").read_bytes()
            subprocess.run(["cp", "-r", str(mountpoint), str(local)], check=True)
        with floor_mount(shard, mountpoint):
            subprocess.run(["cp", "-r", str(mountpoint), str(floor_local)], check=True)
        shutil.copyfile(local / ".tensorfs" / "SHA256SUMS", work / "floor.sums")  # the same names, flat
        results: dict[str, dict[str, list[float]]] = {}
        requests: dict[str, dict[str, int]] = {}
        for _ in range(repeat):
            for name in BARS:
                sides = ("tensorfs", "tensorfs again", "local", "floor", "floor again", "floor local")
                times = results.setdefault(name, {side: [] for side in sides})
                with tensorfs_mount(work / "model", mountpoint, env) as tree:
                    command = commands(tree, work, ".tensorfs/SHA256SUMS")[name]
                    times["tensorfs"].append(timed(command))
                    requests[name] = requests_of(tree)
                    times["tensorfs again"].append(timed(command))  # names, attributes and pages now cached
                times["local"].append(timed(commands(local, work, ".tensorfs/SHA256SUMS")[name]))
                with floor_mount(shard, mountpoint) as tree:
                    command = commands(tree, work, str(work / "floor.sums"))[name]
                    times["floor"].append(timed(command))
                    times["floor again"].append(timed(command))
                times["floor local"].append(timed(commands(floor_local, work, str(work / "floor.sums"))[name]))
    report = Report()
    for name, times in results.items():
        m = {side: statistics.median(values) for side, values in times.items()}
        ratio, again = m["tensorfs"] / m["local"], m["tensorfs again"] / m["local"]
        floor_ratio, floor_again = m["floor"] / m["floor local"], m["floor again"] / m["floor local"]
        met = "met" if ratio <= BARS[name] else ("met again" if again <= BARS[name] else "NOT met")
        key = KEYS[name]
        report.add(
            f"{key}_local",
            f"{name}: the local copy of the tree (baseline)",
            f"{m['local']:.3f} s",
            None,
            "",
            seconds=m["local"],
        )
        report.add(
            key,
            "  ... on a fresh mount",
            f"{m['tensorfs']:.3f} s",
            ratio,
            f"<= {BARS[name]}x the local copy",
            command=name,
            seconds=m,
            again_ratio=again,
            floor_ratio=floor_ratio,
            floor_again_ratio=floor_again,
            at_most=BARS[name],
            met=met,
            requests=requests[name],
            tensors=tensors,
            repeat=repeat,
        )
        report.add(
            f"{key}_again",
            "  ... again on that mount (kernel caches warm)",
            f"{m['tensorfs again']:.3f} s",
            again,
            f"(bar: {met})",
            seconds=m["tensorfs again"],
        )
        report.add(
            f"{key}_floor_local",
            "  ... the local copy of the floor's tree (its baseline)",
            f"{m['floor local']:.3f} s",
            None,
            "",
            seconds=m["floor local"],
        )
        report.add(
            f"{key}_floor",
            "  ... through the pyfuse3 floor (bench/floor.py)",
            f"{m['floor']:.3f} s",
            floor_ratio,
            "(reported)",
            seconds=m["floor"],
        )
        report.add(
            f"{key}_floor_again",
            "  ... the floor again (kernel caches warm)",
            f"{m['floor again']:.3f} s",
            floor_again,
            "(reported)",
            seconds=m["floor again"],
        )
    for name, counted in requests.items():  # flush and xattrs once at most
        report.notes.append(
            f"FUSE requests tensorfs answered for `{name}` on a fresh mount: "
            + ", ".join(f"{op} {n}" for op, n in sorted(counted.items()))
        )
    return report
