"""The in-process loader against safetensors and the Run:ai Model Streamer, in one run.

A model of --gib of F32 tensors (64 MiB each) in one file; every figure is the median of --repeat
tries (five times as many for the local and verified ones, which take milliseconds), the sides
taken in turns, after an untimed try of each. Each try reads every tensor as a torch tensor and touches every
byte (the largest of its bytes), as a consumer does. The bars:

- local, page cache warm: tensorfs.safe_open >= 1.0x safetensors.safe_open; load_file reported;
  the Run:ai Model Streamer (it copies into its own buffers) reported as a peer;
- verified, the hash cache warm: <= 1.15x unverified; verified from scratch: <= 1.1x unverified
  plus hashing the same bytes on HASH_WORKERS threads;
- tensors(ahead=4) over a cold page cache (root: the caches are dropped before each try) with a
  consumer that computes about as long as each tensor takes to read: <= 1.15x the longer of
  reading alone and computing alone (one torch thread computes, so that reading has a core);
- remote, a fresh cache each try: load_file of the model served by nginx >= 1.0x safetensors
  reading it through a tensorfs mount; load_file of the model in SeaweedFS (S3) >= 1.0x AWS's
  s3torchconnector (the CRT client of mountpoint-s3, as its docs load a checkpoint: S3Checkpoint's
  reader read whole, then safetensors.torch.load; skipped with a note when it cannot be imported)
  and >= 1.2x the Run:ai streamer reading the same object; safetensors reading it through a mount
  of it >= 1.0x the Run:ai streamer.

    tensorfs bench --suite load [--gib 1] [--repeat 3] [-o FILE]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..caches.hashes import HashCache
from ..loader import load_file, open_model, safe_open
from ..proof.integrity import HASH_WORKERS, Hasher
from ..proof.manifest import DEFAULT_MANIFEST, format_manifest
from ..sources.store import RemoteOptions
from ..testing.servers import Nginx, SeaweedFS
from .common import (
    Config,
    Look,
    Mounter,
    Report,
    can_drop_caches,
    drop_caches,
    environment,
    medians,
    touch_fresh_memory,
    wait_until_settled,
)

BUCKET = "tensorfs-bench"
LOCAL_BAR, VERIFIED_WARM_BAR, VERIFIED_SCRATCH_BAR, OVERLAP_BAR, REMOTE_BAR = 1.0, 1.15, 1.1, 1.15, 1.0
S3TORCH_BAR, RUNAI_BAR = 1.0, 1.2
"""load_file from S3 against s3torchconnector and against the Run:ai streamer."""
WARM_TRIES = 5
"""The local and verified measures take this many times --repeat tries."""


def touch(tensor: Any) -> int:
    """Read every byte of a tensor (the largest of its bytes: cheap, so that reading them is measured)."""
    import torch

    return int(tensor.reshape(-1).view(torch.uint8).max()) if tensor.numel() else 0


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def write_model(directory: Path, gib: float, tensor_mib: int) -> Path:
    """One file of F32 tensors, and its manifest beside it."""
    from safetensors.numpy import save_file

    count = max(1, round(gib * 1024 / tensor_mib))
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.weight": rng.random(tensor_mib << 18, dtype=np.float32) for i in range(count)}
    path = directory / "model.safetensors"
    save_file(tensors, str(path))
    digests = {name: hashlib.sha256(array.tobytes()).hexdigest() for name, array in tensors.items()}
    (directory / DEFAULT_MANIFEST).write_text(format_manifest(digests))
    return path


def reference_read(path: Path, look: Look) -> None:
    from safetensors import safe_open as reference

    with reference(str(path), "pt") as opened:
        for name in opened.offset_keys():
            look(opened.get_tensor(name))


def tensorfs_read(path: Path, look: Look) -> None:
    with safe_open(path, "pt") as opened:
        for name in opened.offset_keys():
            look(opened.get_tensor(name))


def loaded(source: Path | str, look: Look, **options: Any) -> None:
    for tensor in load_file(source, **options).values():
        look(tensor)


def runai_read(path: str, look: Look, env: dict[str, str] | None = None) -> None:
    from runai_model_streamer import SafetensorsStreamer  # type: ignore[import-untyped]

    with environment(env or {}), SafetensorsStreamer() as streamer:
        streamer.stream_file(path)
        for _, tensor in streamer.get_tensors():
            look(tensor)


def s3torch_missing() -> str | None:
    """Why s3torchconnector cannot be measured here, or None when it can."""
    try:
        import s3torchconnector  # noqa: F401
    except ImportError as error:
        return f"s3torchconnector not measured: it cannot be imported ({error})"
    return None


def s3torch_read(uri: str, endpoint: str, look: Look) -> None:
    """AWS's s3torchconnector as its docs load a checkpoint: S3Checkpoint's reader (the sequential
    reader, its default: the whole object buffered), read whole, then safetensors.torch.load."""
    from s3torchconnector import S3Checkpoint, S3ClientConfig
    from safetensors.torch import load

    config = S3ClientConfig(force_path_style=True)
    checkpoint = S3Checkpoint(region="us-east-1", endpoint=endpoint, s3client_config=config)
    with checkpoint.reader(uri) as reader:
        tensors = load(reader.read())
    for tensor in tensors.values():
        look(tensor)


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    import torch

    report = Report()
    repeat = config.load_repeat
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-load-", dir=config.workdir) as tmp:
        work = Path(tmp)
        directory = work / "model"
        directory.mkdir()
        mib = config.load_tensor_mib
        out(f"building a {config.load_gib:g} GiB model of {mib} MiB tensors; median of {repeat} tries ...")
        path = write_model(directory, config.load_gib, config.load_tensor_mib)
        nbytes = path.stat().st_size
        touch_fresh_memory(2 * nbytes)
        wait_until_settled([path, directory / DEFAULT_MANIFEST])  # else the hash cache keeps nothing
        hashes = work / "hash-cache"
        loaded(path, touch, verify=True, cache=hashes)  # the hash cache filled, the page cache warm

        # Tens of milliseconds each, where these machines wander by several: five times the tries.
        warm_tries = WARM_TRIES * repeat
        out("local, page cache warm ...")
        local, seen = medians(
            {
                "safetensors": lambda look: reference_read(path, look),
                "tensorfs": lambda look: tensorfs_read(path, look),
                "load_file": lambda look: loaded(path, look),
                "runai": lambda look: runai_read(str(path), look),
            },
            warm_tries,
            touch,
        )
        report.add(
            "load_safetensors",
            f"safetensors.safe_open, every tensor of {nbytes / 2**30:.2f} GiB touched (baseline)",
            f"{local['safetensors']:.3f} s",
            None,
            "",
            seconds=local["safetensors"],
            nbytes=nbytes,
            read=seen["safetensors"],
        )
        report.add(
            "load_safe_open",
            "tensorfs.safe_open, the same",
            f"{local['tensorfs']:.3f} s",
            local["safetensors"] / local["tensorfs"],
            f">= {LOCAL_BAR}x safetensors",
            seconds=local["tensorfs"],
            at_least=LOCAL_BAR,
            read=seen["tensorfs"],
        )
        report.add(
            "load_load_file",
            "  ... tensorfs.load_file",
            f"{local['load_file']:.3f} s",
            local["safetensors"] / local["load_file"],
            "(reported)",
            seconds=local["load_file"],
            read=seen["load_file"],
        )
        report.add(
            "load_runai_local",
            "  ... the Run:ai Model Streamer (a peer)",
            f"{local['runai']:.3f} s",
            local["safetensors"] / local["runai"],
            "(safetensors / Run:ai)",
            seconds=local["runai"],
            read=seen["runai"],
        )

        out("verified ...")

        def hashed_alone(look: Look) -> None:
            with open_model(path, cache=False) as model:
                Hasher(model, HashCache(None)).hash_all()

        verified, seen = medians(
            {
                "unverified": lambda look: loaded(path, look),
                "warm": lambda look: loaded(path, look, verify=True, cache=hashes),
                "scratch": lambda look: loaded(path, look, verify=True, cache=False),
                "hashing": hashed_alone,
            },
            warm_tries,
            touch,
        )
        report.add(
            "load_verified_warm",
            "load_file(verify=True), the hash cache warm",
            f"{verified['warm']:.3f} s",
            verified["warm"] / verified["unverified"],
            f"<= {VERIFIED_WARM_BAR}x unverified",
            seconds=verified["warm"],
            unverified_seconds=verified["unverified"],
            at_most=VERIFIED_WARM_BAR,
            read=seen["warm"],
            unverified_read=seen["unverified"],
        )
        floor = verified["unverified"] + verified["hashing"]
        report.add(
            "load_verified_scratch",
            "load_file(verify=True), hashed from scratch",
            f"{verified['scratch']:.3f} s",
            verified["scratch"] / floor,
            f"<= {VERIFIED_SCRATCH_BAR}x unverified + hashing ({HASH_WORKERS} threads)",
            seconds=verified["scratch"],
            hashing_seconds=verified["hashing"],
            at_most=VERIFIED_SCRATCH_BAR,
            read=seen["scratch"],
        )

        if can_drop_caches():
            out("tensors(ahead=4), page cache cold ...")
            overlap(path, repeat, report, torch)
        else:
            report.notes.append("tensors(ahead) over a cold page cache not measured: dropping caches needs root")

        out("remote: nginx and SeaweedFS on loopback, a fresh cache each try ...")
        remote(config, work, directory, repeat, report)
    return report


def overlap(path: Path, repeat: int, report: Report, torch: Any) -> None:
    with open_model(path) as model:
        count = len(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matrix = torch.rand(256, 256)

        def compute_once() -> None:
            torch.mm(matrix, matrix)

        one = statistics.median(timed(compute_once) for _ in range(50))

        def cold(work: Callable[[], object]) -> float:
            drop_caches()
            return timed(work)

        def read_only() -> None:
            with open_model(path) as model:
                for _, tensor in model.tensors(framework="pt", ahead=4):
                    touch(tensor)

        reading = statistics.median(cold(read_only) for _ in range(repeat))
        touching = statistics.median(timed(read_only) for _ in range(repeat))  # the same, the page cache warm
        rounds = max(1, round(max(0.0, reading - touching) / count / one))  # computing one as long as reading it

        def compute(tensor: Any) -> None:
            touch(tensor)
            for _ in range(rounds):
                compute_once()

        def computing_alone() -> None:
            with open_model(path) as model:
                tensors = [model.tensor(name, "pt") for name in model.names()]
                for tensor in tensors:
                    compute(tensor)

        computing_alone()  # the page cache warm: compute alone, no reading
        alone = statistics.median(timed(computing_alone) for _ in range(repeat))

        def both() -> None:
            with open_model(path) as model:
                for _, tensor in model.tensors(framework="pt", ahead=4):
                    compute(tensor)

        together = statistics.median(cold(both) for _ in range(repeat))
    finally:
        torch.set_num_threads(threads)
    longer = max(reading, alone)
    report.add(
        "load_overlap",
        "tensors(ahead=4), cold, computing on each",
        f"{together:.3f} s",
        together / longer,
        f"<= {OVERLAP_BAR}x max(reading {reading:.2f} s, computing {alone:.2f} s)",
        seconds=together,
        reading_seconds=reading,
        computing_seconds=alone,
        at_most=OVERLAP_BAR,
    )


def remote(config: Config, work: Path, directory: Path, repeat: int, report: Report) -> None:
    from safetensors import safe_open as reference

    nginx = Nginx(work / "nginx")
    seaweed = SeaweedFS(work / "seaweedfs")
    nginx.start()
    try:
        seaweed.start()
        served = nginx.root / "model"
        served.mkdir()
        for file in directory.iterdir():
            os.link(file, served / file.name)
        import obstore

        store = seaweed.store(BUCKET)
        for file in directory.iterdir():
            obstore.put(store, f"model/{file.name}", file.read_bytes())
        url = f"{nginx.url}/model/model.safetensors"
        s3 = f"s3://{BUCKET}/model/model.safetensors"
        env = {
            **seaweed.env(),
            "AWS_ENDPOINT_URL": seaweed.endpoint,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        mounter = Mounter(work, config)
        tries = iter(range(1_000_000))

        def fresh() -> Path:
            return work / f"cache-{next(tries)}"

        def forget_caches() -> None:
            """Between tries, untimed: each cache holds a copy of the model."""
            for cache in work.glob("cache-*"):
                shutil.rmtree(cache, ignore_errors=True)

        def through_mount(look: Look, source: str = url, *extra: str) -> None:
            with (
                mounter.mounted(source, *extra, cache=fresh()) as (mountpoint, _),
                reference(str(mountpoint / ".tensorfs" / "model" / "model.safetensors"), "pt") as opened,
            ):
                for name in opened.offset_keys():
                    look(opened.get_tensor(name))

        def s3_through_mount(look: Look) -> None:
            with environment(seaweed.env()):
                through_mount(look, s3, "--endpoint-url", seaweed.endpoint)

        def from_nginx(look: Look) -> None:
            loaded(url, look, remote=RemoteOptions(cache_dir=fresh()))

        def from_s3(look: Look) -> None:
            with environment(seaweed.env()):
                loaded(s3, look, remote=RemoteOptions(cache_dir=fresh(), endpoint_url=seaweed.endpoint))

        def s3torch(look: Look) -> None:
            with environment(seaweed.env()):
                s3torch_read(s3, seaweed.endpoint, look)

        sides: dict[str, Callable[[Look], object]] = {
            "mount": through_mount,
            "nginx": from_nginx,
            "s3": from_s3,
            "runai": lambda look: runai_read(s3, look, env),
            "s3_mount": s3_through_mount,
        }
        missing = s3torch_missing()
        if missing is None:
            sides["s3torch"] = s3torch
        else:
            report.notes.append(missing)
        times, seen = medians(
            sides,
            repeat,
            touch,
            forget_caches,
        )
    finally:
        seaweed.stop()
        nginx.stop()
    nbytes = (directory / "model.safetensors").stat().st_size
    report.add(
        "load_remote_mount",
        "safetensors through a tensorfs mount of it, nginx, fresh cache (baseline)",
        f"{nbytes / times['mount'] / 1e9:.2f} GB/s",
        None,
        "",
        seconds=times["mount"],
        read=seen["mount"],
    )
    report.add(
        "load_remote_nginx",
        "load_file of the model served by nginx, fresh cache",
        f"{nbytes / times['nginx'] / 1e9:.2f} GB/s",
        times["mount"] / times["nginx"],
        f">= {REMOTE_BAR}x through a mount",
        seconds=times["nginx"],
        at_least=REMOTE_BAR,
        read=seen["nginx"],
    )
    report.add(
        "load_remote_runai",
        "the Run:ai Model Streamer from SeaweedFS (S3) (baseline)",
        f"{nbytes / times['runai'] / 1e9:.2f} GB/s",
        None,
        "",
        seconds=times["runai"],
        read=seen["runai"],
    )
    report.add(
        "load_remote_s3",
        "load_file of the same object, fresh cache",
        f"{nbytes / times['s3'] / 1e9:.2f} GB/s",
        times["runai"] / times["s3"],
        f">= {RUNAI_BAR}x Run:ai",
        seconds=times["s3"],
        at_least=RUNAI_BAR,
        read=seen["s3"],
    )
    if "s3torch" in times:
        report.add(
            "load_remote_s3torch",
            "  ... s3torchconnector (AWS's CRT client), read whole + safetensors.torch.load",
            f"{nbytes / times['s3torch'] / 1e9:.2f} GB/s",
            times["s3torch"] / times["s3"],
            f"load_file >= {S3TORCH_BAR}x it",
            seconds=times["s3torch"],
            at_least=S3TORCH_BAR,
            read=seen["s3torch"],
        )
    report.add(
        "load_remote_s3_mount",
        "safetensors through a mount of the same object, fresh cache",
        f"{nbytes / times['s3_mount'] / 1e9:.2f} GB/s",
        times["runai"] / times["s3_mount"],
        f">= {REMOTE_BAR}x Run:ai",
        seconds=times["s3_mount"],
        at_least=REMOTE_BAR,
        read=seen["s3_mount"],
    )
