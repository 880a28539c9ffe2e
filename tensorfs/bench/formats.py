"""Formats other than safetensors against safetensors and against their own validators, in one run.

- validating a GGUF with a 262k-token vocabulary (its table as long as a real model's, 8 MB):
  `tensorfs.open_model` in-process, from scratch, <= 1.0x modelvet (a C validator) on the same
  file; with its header cached, reported (near zero); the `gguf` package's GGUFReader reported;
- the same tensors (--gib of them, 64 MiB each, half F16, half Q8_0 in the GGUF, as raw bytes in
  the safetensors file and the PyTorch checkpoint) as a GGUF, as a checkpoint (torch.save) and as
  safetensors: mounting (the command, header cache cold) <= 1.2x, and reading every tensor's file
  through the mount, page cache warm (the files read in after the caches are dropped, as root),
  >= 1.0x safetensors;
- a checkpoint of 3,000 small tensors (a large model's count) against the same as safetensors:
  `tensorfs.open_model` from scratch, reported (a checkpoint's table is a pickle, walked in Python).

    tensorfs bench --suite formats [--gib 1] [--repeat 3] [-o FILE]
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..loader import open_model
from ..utils.names import SIDECAR_SUFFIXES as SIDECARS
from .common import (
    Config,
    Look,
    Mounter,
    Report,
    can_drop_caches,
    drop_caches,
    files_seen,
    medians,
    read_file,
    touch_fresh_memory,
    wait_until_settled,
)

VALIDATE_BAR, MOUNT_BAR, READ_BAR = 1.0, 1.2, 1.0
TENSOR_MIB = 64
COMPARED = {"gguf": ("the GGUF", "GGUF"), "pytorch": ("the PyTorch checkpoint", "PyTorch")}
"""The formats set against safetensors over a mount: (the file, in the report's words; the format)."""
MANY_TENSORS = 3000


def _ignored(_: Any) -> None:
    """The look of sides that read no tensor (validating, mounting)."""


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def vocabulary_gguf(path: Path, tokens: int) -> None:
    """A GGUF whose table is a real model's size: a vocabulary, its scores and types."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}-{rng.integers(1 << 30):x}" for i in range(tokens)])
    writer.add_token_scores(rng.random(tokens, dtype=np.float32).tolist())
    writer.add_token_types([1] * tokens)
    writer.add_tensor("token_embd.weight", rng.random((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def same_tensors(directory: Path, gib: float) -> dict[str, Path]:
    """One model as a GGUF (F16 and Q8_0 tensors), as safetensors and as a PyTorch checkpoint (the
    same bytes, U8), by format."""
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.numpy import save_file

    count = max(2, round(gib * 1024 / TENSOR_MIB))
    rows = TENSOR_MIB << 20 >> 12  # 4 KiB rows
    writer = GGUFWriter(str(directory / "model.gguf"), "llama")
    tensors = {}
    for i in range(count):
        data = np.random.default_rng(i).integers(0, 256, (rows, 4096), dtype=np.uint8)
        kind = GGMLQuantizationType.F16 if i % 2 == 0 else GGMLQuantizationType.Q8_0
        row_bytes = 4096 if kind == GGMLQuantizationType.F16 else 4096 // 34 * 34
        writer.add_tensor(f"blk.{i}.weight", data[:, :row_bytes], raw_dtype=kind)
        tensors[f"blk.{i}.weight"] = np.ascontiguousarray(data[:, :row_bytes]).reshape(-1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(tensors, str(directory / "model.safetensors"))
    torch.save({name: torch.from_numpy(data) for name, data in tensors.items()}, directory / "pytorch_model.bin")
    return {
        "gguf": directory / "model.gguf",
        "safetensors": directory / "model.safetensors",
        "pytorch": directory / "pytorch_model.bin",
    }


def many_tensors(directory: Path, count: int) -> tuple[Path, Path]:
    """`count` small tensors (a layer's worth of names each) as a checkpoint and as safetensors."""
    import torch
    from safetensors.torch import save_file

    tensors = {f"model.layers.{i // 10}.block.{i % 10}.weight": torch.full((16, 16), float(i)) for i in range(count)}
    torch.save(tensors, directory / "many.bin")
    save_file(tensors, str(directory / "many.safetensors"))
    return directory / "many.bin", directory / "many.safetensors"


def run(config: Config, out: Callable[[str], None] = print) -> Report:
    import modelvet  # type: ignore[import-untyped]
    from gguf import GGUFReader

    report = Report()
    repeat = config.formats_repeat
    with tempfile.TemporaryDirectory(prefix="tensorfs-bench-formats-", dir=config.workdir) as tmp:
        work = Path(tmp)
        out(f"a GGUF with a {config.formats_tokens:,}-token vocabulary; median of {5 * repeat} tries ...")
        vocabulary = work / "vocabulary.gguf"
        vocabulary_gguf(vocabulary, config.formats_tokens)
        wait_until_settled([vocabulary])  # else the header cache keeps nothing
        cache = work / "cache"
        open_model(vocabulary, cache=cache).close()
        times, _ = medians(
            {
                "modelvet": lambda _: modelvet.verify_path(str(vocabulary)),
                "tensorfs": lambda _: open_model(vocabulary, cache=False).close(),
                "cached": lambda _: open_model(vocabulary, cache=cache).close(),
            },
            5 * repeat,
            _ignored,
        )
        reference = timed(lambda: GGUFReader(str(vocabulary)))
        size = vocabulary.stat().st_size
        report.add(
            "formats_modelvet",
            f"modelvet.verify_path of a GGUF of {size / 1e6:.1f} MB (baseline)",
            f"{times['modelvet'] * 1000:.1f} ms",
            None,
            "",
            seconds=times["modelvet"],
            nbytes=size,
        )
        report.add(
            "formats_validate",
            "tensorfs.open_model of it, from scratch",
            f"{times['tensorfs'] * 1000:.1f} ms",
            times["tensorfs"] / times["modelvet"],
            f"<= {VALIDATE_BAR}x modelvet",
            seconds=times["tensorfs"],
            at_most=VALIDATE_BAR,
        )
        report.add(
            "formats_validate_cached",
            "  ... its header cached",
            f"{times['cached'] * 1000:.1f} ms",
            times["cached"] / times["modelvet"],
            "(reported)",
            seconds=times["cached"],
        )
        report.add(
            "formats_gguf_reader",
            "  ... the gguf package's GGUFReader (one try)",
            f"{reference * 1000:.0f} ms",
            reference / times["modelvet"],
            "(reported)",
            seconds=reference,
        )

        out(f"{MANY_TENSORS:,} small tensors as a PyTorch checkpoint and as safetensors ...")
        checkpoint, flat = many_tensors(work, MANY_TENSORS)
        many, _ = medians(
            {
                "pytorch": lambda _: open_model(checkpoint, cache=False).close(),
                "safetensors": lambda _: open_model(flat, cache=False).close(),
            },
            5 * repeat,
            _ignored,
        )
        report.add(
            "formats_open_many_safetensors",
            f"tensorfs.open_model of {MANY_TENSORS:,} tensors as safetensors, from scratch (baseline)",
            f"{many['safetensors'] * 1000:.1f} ms",
            None,
            "",
            seconds=many["safetensors"],
        )
        report.add(
            "formats_open_many_pytorch",
            "  ... as a PyTorch checkpoint",
            f"{many['pytorch'] * 1000:.1f} ms",
            many["pytorch"] / many["safetensors"],
            "(reported)",
            seconds=many["pytorch"],
        )

        out(f"the same {config.formats_gib:g} GiB of tensors as GGUF, PyTorch and safetensors, mounted ...")
        models = work / "models"
        models.mkdir()
        files = same_tensors(models, config.formats_gib)
        touch_fresh_memory(2 * files["gguf"].stat().st_size)
        mounter = Mounter(work, config)

        def mount_once(source: Path) -> Callable[[Look], None]:
            def mount(_: Look) -> None:
                with mounter.mounted(source):
                    pass

            return mount

        def tensor_files(mountpoint: Path) -> list[Path]:
            return sorted(p for p in mountpoint.iterdir() if p.is_file() and not p.name.endswith(SIDECARS))

        def read_once(source: Path) -> Callable[[], float]:
            def read() -> float:
                with mounter.mounted(source) as (mountpoint, _):
                    return sum(read_file(path) for path in tensor_files(mountpoint))

            return read

        def seen_through_a_mount(source: Path) -> str:
            """What reading every tensor's file of the mount reads (untimed)."""
            with mounter.mounted(source) as (mountpoint, _):
                return files_seen(tensor_files(mountpoint))

        # Every file's pages brought in the same way: as their writers left them, the safetensors
        # file's read through a mount 30% faster than the GGUF's, and the same after this.
        if can_drop_caches():
            drop_caches()
        for path in files.values():
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
        mounting, _ = medians({name: mount_once(path) for name, path in files.items()}, repeat, _ignored)
        reads: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(repeat):
            for name, path in files.items():
                reads[name].append(read_once(path)())
        reading = {name: statistics.median(found) for name, found in reads.items()}
        seen = {name: seen_through_a_mount(path) for name, path in files.items()}
    report.add(
        "formats_mount_safetensors",
        "mounting the safetensors file (baseline)",
        f"{mounting['safetensors']:.3f} s",
        None,
        "",
        seconds=mounting["safetensors"],
    )
    for name, (file, _) in COMPARED.items():
        report.add(
            f"formats_mount_{name}",
            f"mounting {file} of the same tensors",
            f"{mounting[name]:.3f} s",
            mounting[name] / mounting["safetensors"],
            f"<= {MOUNT_BAR}x safetensors",
            seconds=mounting[name],
            at_most=MOUNT_BAR,
        )
    report.add(
        "formats_read_safetensors",
        "reading every tensor's file through the mount, safetensors (baseline)",
        f"{reading['safetensors']:.3f} s",
        None,
        "",
        seconds=reading["safetensors"],
        read=seen["safetensors"],
    )
    for name, (_, format_name) in COMPARED.items():
        report.add(
            f"formats_read_{name}",
            f"  ... {format_name}",
            f"{reading[name]:.3f} s",
            reading["safetensors"] / reading[name],
            f">= {READ_BAR}x safetensors",
            seconds=reading[name],
            at_least=READ_BAR,
            read=seen[name],
        )
    return report
