#!/usr/bin/env python3
"""Build a small sharded demo model (generated, nothing downloaded), mount it, and take a short tour.

.venv/bin/python scripts/demo.py [DEMO_DIR]      (what `make demo` runs)
"""

from __future__ import annotations

import argparse
import decimal
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from tensorfs.mount.mounttable import mount_at, unmount
from tensorfs.testing.sample_models import Tensor, write_sharded

HIDDEN, VOCAB, LAYERS, FFN = 512, 8000, 4, 1536


def as_tensor(array: np.ndarray, dtype: str) -> Tensor:
    return dtype, array.shape, np.ascontiguousarray(array).tobytes()


def spread(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Integers in [-255, 255], bell-shaped (each the sum of four bytes), drawn from SHAKE-128 of the
    tensor's name: the same on every machine and with every release (no float math, no generator of
    numpy's). Scaled by a power of two they are exact in BF16 and F16 (8 significant bits at most)."""
    count = math.prod(shape)
    drawn = hashlib.shake_128(f"tensorfs demo {name}".encode()).digest(4 * count)
    four = np.frombuffer(drawn, dtype=np.uint8).reshape(count, 4)
    values: np.ndarray = ((four.sum(axis=1, dtype=np.int16) - 510) // 2).reshape(shape)
    return values


def demo_shards() -> list[dict[str, Tensor]]:
    """A small decoder-only transformer's weights: BF16 matrices, F32 norms, an F16 head, 3 shards.

    Their bytes depend on no machine and no release: every value is an integer times 2**-12 (exact in
    each dtype, whatever rounds it), and inv_freq is computed in decimal (libmpdec, not the CPU's float
    math: numpy's float64 power differs between CPUs), then rounded once to float64."""

    def weights(name: str, shape: tuple[int, ...], dtype: str) -> Tensor:
        values = spread(name, shape).astype(np.float32) * np.float32(2**-12)
        return as_tensor(values.astype(ml_dtypes.bfloat16 if dtype == "BF16" else np.float16), dtype)

    def ones(*shape: int) -> Tensor:
        return as_tensor(np.ones(shape, dtype=np.float32), "F32")

    shards: list[dict[str, Tensor]] = [{}, {}, {}]
    embed = "model.embed_tokens.weight"
    shards[0][embed] = weights(embed, (VOCAB, HIDDEN), "BF16")
    for layer in range(LAYERS):
        shard = shards[1 + layer * 2 // LAYERS]
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"{prefix}.self_attn.{proj}.weight"
            shard[name] = weights(name, (HIDDEN, HIDDEN), "BF16")
        for proj, shape in (("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)), ("down_proj", (HIDDEN, FFN))):
            name = f"{prefix}.mlp.{proj}.weight"
            shard[name] = weights(name, shape, "BF16")
        shard[f"{prefix}.input_layernorm.weight"] = ones(HIDDEN)
        shard[f"{prefix}.post_attention_layernorm.weight"] = ones(HIDDEN)
    shards[2]["model.norm.weight"] = ones(HIDDEN)
    shards[2]["lm_head.weight"] = weights("lm_head.weight", (VOCAB, HIDDEN), "F16")
    with decimal.localcontext() as context:
        context.prec = 40
        inv_freq = [float(decimal.Decimal(10000) ** (decimal.Decimal(-i) / 64)) for i in range(0, 64, 2)]
    shards[2]["model.rotary_emb.inv_freq"] = as_tensor(np.array(inv_freq, dtype="<f8"), "F64")
    return shards


def build(model: Path) -> None:
    """The demo model at `model`: its shards, index and config.json."""
    write_sharded(model, demo_shards())
    config = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}
    (model / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def run(command: str, cwd: Path) -> None:
    """Show a command, then run it as shown (by sh, in `cwd`, `tensorfs` and `python` this interpreter's)."""
    print(f"\n$ {command}", flush=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    subprocess.run(["sh", "-c", command], check=True, cwd=cwd, env={**os.environ, "PATH": path})


def prepare(demo_dir: Path) -> None:
    """The demo's model in `demo_dir`/model (built if it is not there), validated, and its manifest
    beside it: from then on no tensor's bytes go out before they hash to it (a mount, and the
    library's verify=True)."""
    model = demo_dir / "model"
    if not (model / "model.safetensors.index.json").exists():
        print(f"building a demo model in {model}/ ...")
        build(model)
    here, demo = demo_dir.parent, shlex.quote(demo_dir.name)
    run(f"tensorfs validate {demo}/model", here)
    run(f"tensorfs manifest {demo}/model -o {demo}/model/tensors.sha256", here)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir", nargs="?", default="demo", type=Path, help="where the model and its mount go")
    demo_dir = parser.parse_args(argv[1:]).demo_dir.absolute()
    prepare(demo_dir)
    mountpoint = demo_dir / "mnt"
    # The tour runs beside the demo directory, so that what it shows is what anyone types there.
    here, demo = demo_dir.parent, shlex.quote(demo_dir.name)
    mountpoint.mkdir(parents=True, exist_ok=True)
    if mount_at(mountpoint) is not None:  # a previous demo's mount: start afresh
        unmount(mountpoint, lazy=True)
    # The dotted layout nests names on '.', which makes a transformer's weights a browsable tree.
    run(f"tensorfs mount --layout dotted {demo}/model {demo}/mnt", here)
    run(f"ls {demo}/mnt", here)
    embed = f"{demo}/mnt/model/embed_tokens"
    run(f"ls -l {embed}", here)
    run(f"cat {embed}/weight.meta.json", here)
    run(f"cd {embed} && sha256sum -c weight.sha256", here)
    code = (
        f"import tensorfs; a = tensorfs.memmap('{embed}/weight'); print(type(a).__name__, a.dtype, a.shape, a[0, :4])"
    )
    run(f'python -c "{code}"', here)
    # The same model as its own folder, byte for byte, for loaders that open one (safetensors, transformers, ...).
    view = f"{demo}/mnt/.tensorfs/model"
    run(f"ls -l {view}", here)
    last = "model-00003-of-00003.safetensors"
    run(f"cd {demo} && sha256sum model/{last} mnt/.tensorfs/model/{last}", here)
    code = (
        f"from safetensors import safe_open; f = safe_open('{view}/{last}', framework='np'); "
        "print(len(f.keys()), 'tensors;', f.get_tensor('model.norm.weight')[:4])"
    )
    run(f'python -c "{code}"', here)
    print(f"\nThe model stays mounted at {mountpoint}. Unmount it with:\n  .venv/bin/tensorfs umount {mountpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
