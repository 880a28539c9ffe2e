#!/usr/bin/env python3
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
Also printed: the FUSE requests tensorfs answered for each command (from .tensorfs/stats.json).

    .venv/bin/python scripts/bench_small.py [--tensors 60000] [--repeat 1] [--json FILE]

(One try takes about six minutes at 60k tensors: `cp -r` of 180k files is most of it.)
"""

from __future__ import annotations

import argparse
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

from tensorfs.sample_models import many_tiny_tensors

BARS = {"sha256sum -c": 2.0, "cp -r": 2.0, "find -type f | wc -l": 3.0, "ls -lR": 3.0}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=60_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-small-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "TENSORFS_RUNTIME_DIR": str(work / "run")}
        env["XDG_STATE_HOME"] = str(work / "state")
        (shard,) = many_tiny_tensors(work / "model", args.tensors, 1)
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
        for _ in range(args.repeat):
            for name in BARS:
                sides = ("tensorfs", "tensorfs again", "local", "floor", "floor again", "floor local")
                times = results.setdefault(name, {side: [] for side in sides})
                with tensorfs_mount(work / "model", mountpoint, env) as tree:
                    run = commands(tree, work, ".tensorfs/SHA256SUMS")[name]
                    times["tensorfs"].append(timed(run))
                    requests[name] = requests_of(tree)
                    times["tensorfs again"].append(timed(run))  # names, attributes and pages now cached
                times["local"].append(timed(commands(local, work, ".tensorfs/SHA256SUMS")[name]))
                with floor_mount(shard, mountpoint) as tree:
                    run = commands(tree, work, str(work / "floor.sums"))[name]
                    times["floor"].append(timed(run))
                    times["floor again"].append(timed(run))
                times["floor local"].append(timed(commands(floor_local, work, str(work / "floor.sums"))[name]))
    print(f"{args.tensors} tiny tensors ({3 * args.tensors} files), medians of {args.repeat}; each command on a")
    print("fresh mount, then again on it (kernel caches warm), and on a local copy of the tree:")
    columns = ("tensorfs", "again", "local", "ratio", "again", "bar", "  floor", "again", "local", "ratio", "again")
    widths = (9, 8, 8, 7, 7, 6, 10, 8, 8, 7, 7)
    print(f"{'command':<22} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    report: dict[str, object] = {}
    for name, times in results.items():
        m = {side: statistics.median(values) for side, values in times.items()}
        ratio, again = m["tensorfs"] / m["local"], m["tensorfs again"] / m["local"]
        floor_ratio, floor_again = m["floor"] / m["floor local"], m["floor again"] / m["floor local"]
        met = "met" if ratio <= BARS[name] else ("met again" if again <= BARS[name] else "NOT met")
        print(
            f"{name:<22} {m['tensorfs']:8.2f}s {m['tensorfs again']:7.2f}s {m['local']:7.2f}s {ratio:6.1f}x"
            f" {again:6.1f}x {BARS[name]:5.1f}x   {m['floor']:7.2f}s {m['floor again']:7.2f}s"
            f" {m['floor local']:7.2f}s {floor_ratio:6.1f}x {floor_again:6.1f}x  {met}"
        )
        report[name] = {
            "seconds": m,
            "ratio": ratio,
            "again_ratio": again,
            "floor_ratio": floor_ratio,
            "floor_again_ratio": floor_again,
            "bar": BARS[name],
        }
    print("FUSE requests tensorfs answered, by command (one fresh mount each; flush and xattrs once at most):")
    for name, counted in requests.items():
        print(f"  {name:<22} " + ", ".join(f"{op} {n}" for op, n in sorted(counted.items())))
    if args.json:
        args.json.write_text(json.dumps({"results": report, "requests": requests}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
