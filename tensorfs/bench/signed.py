"""Signed models: tensorfs held to an OpenSSF Model Signing signature against model_signing's verify
of the folder followed by safetensors reading it, in one run.

A model of --gib of F32 tensors (64 MiB each) in --shards files, its index and config.json, signed
with a P-256 key by model_signing's signing API two ways: `files` (its default: a SHA-256 a file)
and `ranges` (its sharded hashing, 16 MiB ranges). Every side is a process of its own, started
fresh for each try (signedside.py: its imports are counted, as a user's first run pays them), with
a fresh tensorfs cache unless said; each reads every tensor whole (its CRC-32C), or its first one;
seconds from the process's start. The page cache is warm (the files are read once before), as
the peer's verify leaves it. Medians of --repeat tries, the sides in turns, after an untimed try of
each. The bars (issue 50):

- the whole model in-process (load_file, signature=) <= 1.0x verify-then-load, local and from
  SeaweedFS (S3: the peer downloads into files first), files and ranges;
- through a mount (safetensors reading the mount's model folder) <= 1.2x verify-then-load;
- the first tensor of a model signed by ranges <= 0.3x verify-then-load's first tensor (files:
  reported: a file signed whole is hashed whole before any tensor of it, by both sides);
- a second open with a warm hash cache (load_file, signature=) <= 1.0x an unsigned load_file.

    tensorfs bench --suite signed [--gib 4] [--shards 4] [--repeat 3] [-o FILE]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..loader import open_model
from ..testing.servers import SeaweedFS
from .common import Config, Mounter, Report, build, environment, warm

BUCKET = "tensorfs-bench-signed"
TENSOR = 64 << 20
RANGE = 16 << 20
"""The ranges of the model signed by ranges (model_signing's default is 1e9 bytes: a file a range here)."""
WHOLE_BAR, MOUNT_BAR, FIRST_BAR, WARM_BAR = 1.0, 1.2, 0.3, 1.0
SIDE = Path(__file__).with_name("signedside.py")

Times = dict[str, float]
"""A try of a side: seconds from its start to its first tensor ("first") and to its end ("whole")."""


def run_side(side: str, args: dict[str, Any], env: dict[str, str] | None = None) -> tuple[Times, str]:
    """One try of a side in a process of its own: its times, and what it read."""
    start = time.time()
    done = subprocess.run(
        [sys.executable, str(SIDE), side, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"side {side} failed: {done.stderr.strip()[-2000:]}")
    said = json.loads(done.stdout.strip().splitlines()[-1])
    return {"first": said["first"] - start, "whole": said["end"] - start}, said["read"]


Side = Callable[[], tuple[Times, str]]


def measure(
    sides: dict[str, Side], repeat: int, between: Callable[[], object]
) -> tuple[dict[str, Times], dict[str, str]]:
    """Each side's median times over `repeat` tries, the sides in turns, after one untimed try of
    each; what each read (the same in every try, or the run fails)."""
    seen: dict[str, str] = {}
    for name, side in sides.items():
        seen[name] = side()[1]
        between()
    tries: dict[str, list[Times]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, side in sides.items():
            times, read = side()
            if read != seen[name]:
                raise RuntimeError(f"side {name} read {read} in one try and {seen[name]} in another")
            tries[name].append(times)
            between()
    medians = {
        name: {kind: statistics.median(t[kind] for t in found) for kind in ("first", "whole")}
        for name, found in tries.items()
    }
    return medians, seen


def make_keys(where: Path) -> tuple[Path, Path]:
    """A P-256 key pair in PEM files (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where / "signer.key", where / "signer.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def signed_copy(model: Path, folder: Path, private: Path, shard_size: int | None) -> Path:
    """The model's files linked into `folder`, signed there (model.sig) by model_signing's API."""
    from model_signing import hashing, signing

    folder.mkdir()
    for file in model.iterdir():
        os.link(file, folder / file.name)
    config = hashing.Config().set_ignored_paths(paths=["model.sig"])  # type: ignore[no-untyped-call]
    if shard_size is not None:
        config = config.use_shard_serialization(shard_size=shard_size)
    signer = signing.Config().use_elliptic_key_signer(private_key=private)  # type: ignore[no-untyped-call]
    signer.set_hashing_config(config).sign(folder, folder / "model.sig")
    return folder


class Caches:
    """Fresh tensorfs caches, one a try, removed between tries (each holds a copy of a remote model)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.count = 0

    def fresh(self) -> str:
        self.count += 1
        return str(self.work / f"cache-{self.count}")

    def forget(self) -> None:
        for cache in self.work.glob("cache-*"):
            shutil.rmtree(cache, ignore_errors=True)


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    report = Report()
    repeat = config.signed_repeat
    range_size = config.signed_range_mib << 20
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-signed-", dir=config.workdir) as tmp:
        work = Path(tmp)
        model = work / "model"
        model.mkdir()
        gib, shards, tensor = config.signed_gib, config.signed_shards, config.signed_tensor_mib << 20
        out(
            f"building a {gib:g} GiB model in {shards} shards, signed by files and by {range_size >> 20} MiB ranges ..."
        )
        build(model, gib, shards, tensor)
        (model / "config.json").write_text('{"model_type": "bench"}\n')
        with open_model(model, cache=False) as opened:  # the tensors' bytes, what each side reads
            nbytes = sum(opened.info(name).nbytes for name in opened.names())
        private, public = make_keys(work)
        flavors = {
            "files": (signed_copy(model, work / "files", private, None), None),
            "ranges": (signed_copy(model, work / "ranges", private, range_size), range_size),
        }
        caches = Caches(work)
        mounter = Mounter(work, config)
        for flavor, (folder, shard_size) in flavors.items():
            out(f"{flavor}, local, page cache warm ...")
            local(report, flavor, folder, shard_size, public, nbytes, repeat, caches, mounter)
        out("from SeaweedFS (S3) on loopback, a fresh cache each try ...")
        seaweed = SeaweedFS(work / "seaweedfs")
        seaweed.start()
        try:
            store = seaweed.store(BUCKET)
            import obstore

            for flavor, (folder, _) in flavors.items():
                for file in folder.iterdir():
                    obstore.put(store, f"{flavor}/{file.name}", file.read_bytes())
            for flavor, (_, shard_size) in flavors.items():
                out(f"{flavor}, from S3 ...")
                remote(report, flavor, shard_size, public, nbytes, repeat, caches, mounter, seaweed)
        finally:
            seaweed.stop()
    return report


def local(
    report: Report,
    flavor: str,
    folder: Path,
    shard_size: int | None,
    public: Path,
    nbytes: int,
    repeat: int,
    caches: Caches,
    mounter: Mounter,
) -> None:
    warm(sorted(folder.iterdir()))
    warmed = caches.fresh()
    run_side("tensorfs", {"source": str(folder), "public": str(public), "cache": warmed, "first_only": False})
    keep = Path(warmed)

    def peer(first_only: bool) -> Side:
        args = {"folder": str(folder), "public": str(public), "shard_size": shard_size, "first_only": first_only}
        return lambda: run_side("verify_then_load", args)

    def ours(first_only: bool, *, signed: bool = True, cache: str | None = None) -> Side:
        def side() -> tuple[Times, str]:
            args = {"source": str(folder), "cache": cache or caches.fresh(), "first_only": first_only}
            return run_side("tensorfs", {**args, "public": str(public) if signed else None})

        return side

    sides: dict[str, Side] = {
        "peer": peer(False),
        "ours": ours(False),
        "mount": lambda: _mount_side(mounter, folder, public, caches, ()),
        "mount_unsigned": lambda: _mount_side(mounter, folder, None, caches, ()),
        "peer_first": peer(True),
        "ours_first": ours(True),
        "warm": ours(False, cache=str(keep)),
        "unsigned": ours(False, signed=False, cache=str(keep)),
    }

    def between() -> None:
        for cache in caches.work.glob("cache-*"):
            if cache != keep:
                shutil.rmtree(cache, ignore_errors=True)

    times, seen = measure(sides, repeat, between)
    shutil.rmtree(keep, ignore_errors=True)
    add_rows(report, f"signed_{flavor}_local", f"{flavor}, local", times, seen, nbytes, flavor)
    report.add(
        f"signed_{flavor}_local_mount_unsigned",
        "  ... the same mount unsigned (what reading through a mount costs: the mount's floor)",
        f"{times['mount_unsigned']['whole']:.2f} s",
        times["mount_unsigned"]["whole"] / times["peer"]["whole"],
        "(reported)",
        seconds=times["mount_unsigned"]["whole"],
        read=seen["mount_unsigned"],
    )
    report.add(
        f"signed_{flavor}_local_warm",
        "  ... load_file(signature=), the hash cache of an earlier open, against unsigned",
        f"{times['warm']['whole']:.2f} s",
        times["warm"]["whole"] / times["unsigned"]["whole"],
        f"<= {WARM_BAR}x unsigned ({times['unsigned']['whole']:.2f} s)",
        seconds=times["warm"]["whole"],
        unsigned_seconds=times["unsigned"]["whole"],
        at_most=WARM_BAR,
        read=seen["warm"],
        unsigned_read=seen["unsigned"],
    )


def remote(
    report: Report,
    flavor: str,
    shard_size: int | None,
    public: Path,
    nbytes: int,
    repeat: int,
    caches: Caches,
    mounter: Mounter,
    seaweed: SeaweedFS,
) -> None:
    url = f"s3://{BUCKET}/{flavor}"
    env = seaweed.env()

    def peer(first_only: bool) -> Side:
        def side() -> tuple[Times, str]:
            args = {
                "folder": str(Path(caches.fresh()) / "download"),
                "url": url,
                "endpoint": seaweed.endpoint,
                "public": str(public),
                "shard_size": shard_size,
                "first_only": first_only,
            }
            return run_side("verify_then_load", args, env)

        return side

    def ours(first_only: bool) -> Side:
        def side() -> tuple[Times, str]:
            args = {"source": url, "public": str(public), "cache": caches.fresh(), "endpoint": seaweed.endpoint}
            return run_side("tensorfs", {**args, "first_only": first_only}, env)

        return side

    extra = ("--endpoint-url", seaweed.endpoint)
    sides: dict[str, Side] = {
        "peer": peer(False),
        "ours": ours(False),
        "mount": lambda: _mount_side(mounter, url, public, caches, extra, env),
        "peer_first": peer(True),
        "ours_first": ours(True),
    }
    times, seen = measure(sides, repeat, caches.forget)
    add_rows(report, f"signed_{flavor}_s3", f"{flavor}, S3", times, seen, nbytes, flavor)


def _mount_side(
    mounter: Mounter,
    source: Path | str,
    public: Path | None,
    caches: Caches,
    extra: tuple[str, ...],
    env: dict[str, str] | None = None,
) -> tuple[Times, str]:
    """`tensorfs mount` of the signed model (a fresh cache; no key: unsigned), then safetensors reading
    the mount's model folder in a process of its own: seconds from the mount command's start."""
    start = time.time()
    key = () if public is None else ("--public-key", str(public))
    with (
        environment(env or {}),
        mounter.mounted(source, *key, *extra, cache=Path(caches.fresh())) as (mountpoint, _),
    ):
        folder = mountpoint / ".tensorfs" / "model"
        times, read = run_side("folder", {"folder": str(folder), "first_only": False})
        ended = time.time()
    whole = ended - start
    return {"first": whole - times["whole"] + times["first"], "whole": whole}, read


def add_rows(
    report: Report, key: str, what: str, times: dict[str, Times], seen: dict[str, str], nbytes: int, flavor: str
) -> None:
    peer, ours, mount = times["peer"]["whole"], times["ours"]["whole"], times["mount"]["whole"]
    report.add(
        f"{key}_peer",
        f"{what}: model_signing verify, then safetensors, every tensor of {nbytes / 2**30:.2f} GiB (baseline)",
        f"{peer:.2f} s",
        None,
        "",
        seconds=peer,
        nbytes=nbytes,
        read=seen["peer"],
    )
    report.add(
        f"{key}_whole",
        "  ... tensorfs.load_file(signature=), a fresh cache",
        f"{ours:.2f} s",
        ours / peer,
        f"<= {WHOLE_BAR}x verify-then-load",
        seconds=ours,
        at_most=WHOLE_BAR,
        read=seen["ours"],
    )
    report.add(
        f"{key}_mount",
        "  ... tensorfs mount, safetensors reading its model folder",
        f"{mount:.2f} s",
        mount / peer,
        f"<= {MOUNT_BAR}x verify-then-load",
        seconds=mount,
        at_most=MOUNT_BAR,
        read=seen["mount"],
    )
    peer_first, ours_first = times["peer_first"]["first"], times["ours_first"]["first"]
    ranges = flavor == "ranges"
    report.add(
        f"{key}_first",
        "  ... the first tensor: tensorfs.safe_open(signature=) against verify then safetensors",
        f"{ours_first:.2f} s (peer {peer_first:.2f} s)",
        ours_first / peer_first,
        f"<= {FIRST_BAR}x verify-then-load" if ranges else "(reported: a file signed whole is hashed whole first)",
        seconds=ours_first,
        peer_seconds=peer_first,
        at_most=FIRST_BAR if ranges else None,
        read=seen["ours_first"],
        peer_read=seen["peer_first"],
    )
