#!/usr/bin/env python3
"""A bounded soak of a real mount: a mix of every kind of request, for --seconds, counting errors.

Random-range reads (checked byte for byte), whole-file reads, stats, listings, sidecar reads,
opens and closes, and readers killed in the middle of their reading (once each has been served),
from several threads at once.
Prints the operations done and the errors; exits 1 if there was any error. Needs FUSE.

    .venv/bin/python scripts/soak.py [--seconds 60] [--threads 6]      (what `make soak` runs)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import tensorfs
import tensorfs.mount.mounttable
from tensorfs.mount.mounttable import daemon_pid
from tensorfs.testing.sample_models import write_sharded

MIB = 1 << 20


def build(directory: Path) -> dict[str, bytes]:
    shards = []
    for s in range(4):
        shard = {f"layers/{s}/w{k}": ("U8", [(k + 1) * 4 * MIB], os.urandom((k + 1) * 4 * MIB)) for k in range(4)}
        shard.update({f"small/{s}.{k}": ("F32", [8], os.urandom(32)) for k in range(200)})
        shards.append(shard)
    write_sharded(directory, shards)
    with tensorfs.open_model(directory) as model:
        return {name: bytes(model.raw(name)) for name in model}


VICTIM = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.pread(fd, 4096, 0)
os.write(1, b"r")  # open, and served once
size = os.fstat(fd).st_size
while True:  # reading from the daemon (not the kernel's cache) until killed
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    for offset in range(0, size, 1 << 20):
        os.pread(fd, 1 << 20, offset)
"""


def killed_mid_read(path: Path, delay: float) -> bool:
    """Start a reader, wait until it has the file open and has been served (it says so), let it read on
    for `delay` seconds, then kill it: whether all of that happened (a reader that failed or ended by
    itself was not killed mid-read)."""
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(path)], stdout=subprocess.PIPE)
    assert victim.stdout is not None
    try:
        ready, _, _ = select.select([victim.stdout], [], [], 30.0)
        served = bool(ready) and victim.stdout.read(1) == b"r"
        if served:
            time.sleep(delay)  # a random moment of its reading
        victim.kill()
        return served and victim.wait() == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait()
        victim.stdout.close()


def worker(seed: int, mountpoint: Path, expected: dict[str, bytes], deadline: float, counts: Counter[str]) -> None:
    rng = random.Random(seed)
    names = sorted(expected)
    big = [n for n in names if n.startswith("layers/")]
    while time.monotonic() < deadline:
        kind = rng.choice(["range", "range", "range", "whole", "stat", "list", "sidecar", "meta", "killed"])
        try:
            if kind == "range":
                name = rng.choice(big)
                offset = rng.randrange(len(expected[name]))
                length = rng.randrange(1, 4 * MIB)
                with open(mountpoint / name, "rb") as f:
                    got = os.pread(f.fileno(), length, offset)
                ok = got == expected[name][offset : offset + length]
            elif kind == "whole":
                name = rng.choice(names)
                ok = (mountpoint / name).read_bytes() == expected[name]
            elif kind == "stat":
                name = rng.choice(names)
                ok = (mountpoint / name).stat().st_size == len(expected[name])
            elif kind == "list":
                ok = len(os.listdir(mountpoint / "small")) == 3 * 800
            elif kind == "sidecar":
                name = rng.choice(names)
                line = (mountpoint / f"{name}.sha256").read_text()
                ok = line.split()[0] == hashlib.sha256(expected[name]).hexdigest()
            elif kind == "meta":
                name = rng.choice(names)
                ok = json.loads((mountpoint / f"{name}.meta.json").read_bytes())["nbytes"] == len(expected[name])
            else:  # a reader that disappears in the middle of its reading
                ok = killed_mid_read(mountpoint / rng.choice(big), rng.random() * 0.05)
        except OSError as exc:
            counts[f"error: {kind}: {exc}"] += 1
            continue
        counts[kind if ok else f"error: {kind}: wrong result"] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tensorfs-soak-") as tmp:
        root = Path(tmp)
        expected = build(root / "model")
        mountpoint = root / "mnt"
        mountpoint.mkdir()
        command = [sys.executable, "-m", "tensorfs.cli", "mount", "-q", "--no-cache", "--log-file", str(root / "log")]
        subprocess.run([*command, str(root / "model"), str(mountpoint)], check=True)
        pid = daemon_pid(mountpoint)
        assert pid is not None, f"no daemon record for {mountpoint}"
        counts: Counter[str] = Counter()
        try:
            deadline = time.monotonic() + args.seconds
            threads = [
                threading.Thread(target=worker, args=(seed, mountpoint, expected, deadline, counts))
                for seed in range(args.threads)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            alive = tensorfs.mount.mounttable.pid_alive(pid)
        finally:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
            stop = time.monotonic() + 30
            while tensorfs.mount.mounttable.pid_alive(pid) and time.monotonic() < stop:
                time.sleep(0.05)
    errors = {k: v for k, v in counts.items() if k.startswith("error")}
    done = sum(v for k, v in counts.items() if not k.startswith("error"))
    print(f"soak: {args.seconds:g} s, {args.threads} threads: {done} operations, {sum(errors.values())} errors")
    for kind, count in sorted(counts.items()):
        print(f"  {kind}: {count}")
    if not alive:
        print("  the daemon died")
    return 1 if errors or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
