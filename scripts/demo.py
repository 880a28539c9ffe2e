#!/usr/bin/env python3
"""Build a small sharded demo model (generated, nothing downloaded) and show what tensorfs makes of it.

.venv/bin/python scripts/demo.py [DEMO_DIR]      (what `make demo` runs)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from tensorfs.synth import Tensor, write_sharded

HIDDEN, VOCAB, LAYERS, FFN = 512, 8000, 4, 1536


def as_tensor(array: np.ndarray, dtype: str) -> Tensor:
    return dtype, array.shape, np.ascontiguousarray(array).tobytes()


def demo_shards(seed: int = 0) -> list[dict[str, Tensor]]:
    """A small decoder-only transformer's weights: BF16 matrices, F32 norms, an F16 head, 3 shards."""
    rng = np.random.default_rng(seed)

    def bf16(*shape: int) -> Tensor:
        return as_tensor((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16), "BF16")

    def ones(*shape: int) -> Tensor:
        return as_tensor(np.ones(shape, dtype=np.float32), "F32")

    shards: list[dict[str, Tensor]] = [{"model.embed_tokens.weight": bf16(VOCAB, HIDDEN)}, {}, {}]
    for layer in range(LAYERS):
        shard = shards[1 + layer * 2 // LAYERS]
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shard[f"{prefix}.self_attn.{proj}.weight"] = bf16(HIDDEN, HIDDEN)
        for proj, shape in (("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)), ("down_proj", (HIDDEN, FFN))):
            shard[f"{prefix}.mlp.{proj}.weight"] = bf16(*shape)
        shard[f"{prefix}.input_layernorm.weight"] = ones(HIDDEN)
        shard[f"{prefix}.post_attention_layernorm.weight"] = ones(HIDDEN)
    shards[2]["model.norm.weight"] = ones(HIDDEN)
    shards[2]["lm_head.weight"] = as_tensor((rng.standard_normal((VOCAB, HIDDEN)) * 0.02).astype("<f2"), "F16")
    shards[2]["model.rotary_emb.inv_freq"] = as_tensor(1.0 / 10000 ** (np.arange(0, 64, 2) / 64), "F64")
    return shards


def main(argv: list[str]) -> int:
    demo_dir = Path(argv[1] if len(argv) > 1 else "demo")
    model = demo_dir / "model"
    if not (model / "model.safetensors.index.json").exists():
        print(f"building a demo model in {model}/ ...")
        write_sharded(model, demo_shards())
    tensorfs = [sys.executable, "-m", "tensorfs.cli"]
    for command in (["validate", str(model)], ["ls", str(model)]):
        print(f"\n$ tensorfs {' '.join(command)}", flush=True)
        subprocess.run([*tensorfs, *command], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
