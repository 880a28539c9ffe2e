#!/usr/bin/env python3
"""Write a tiny Stable Diffusion pipeline as diffusers' save_pretrained writes one (random weights,
nothing downloaded): model_index.json, scheduler/, unet/ and vae/ (diffusers' models), text_encoder/
(transformers' CLIPTextModel) and tokenizer/ (a CLIPTokenizer of a tiny byte-level vocabulary), in
float32, and beside each component's weights their float16 variant (diffusion_pytorch_model.fp16.safetensors,
model.fp16.safetensors: other weights, as the Hub's Stable Diffusion repositories hold them).

.venv/bin/python scripts/tiny_pipeline.py DIR [--no-variant]      (needs diffusers and torch: the test extra)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

PROMPT = "a photo of a cat"
"""What the tokenizer's vocabulary is made for: its words are in it whole."""


def byte_characters() -> list[str]:
    """CLIP's byte-level alphabet: each of the 256 bytes as the character its BPE sees."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    code = dict(zip(printable + others, printable + [256 + k for k in range(len(others))], strict=True))
    return [chr(code[byte]) for byte in range(256)]


def vocabulary() -> dict[str, str]:
    """The tokenizer's files: vocab.json and merges.txt ("cat" one token)."""
    characters = byte_characters()
    merges = ["c a", "ca t</w>"]
    tokens = [
        "<|startoftext|>", "<|endoftext|>", *characters, *(c + "</w>" for c in characters),
        *(merge.replace(" ", "") for merge in merges),
    ]  # fmt: skip
    return {
        "vocab.json": json.dumps({token: k for k, token in enumerate(tokens)}),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
    }


def pipeline(seed: int) -> Any:
    """The pipeline, its weights drawn from `seed`."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    files = vocabulary()
    with tempfile.TemporaryDirectory() as words:
        for name, text in files.items():
            Path(words, name).write_text(text, encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(words, model_max_length=16)
    size = len(json.loads(files["vocab.json"]))
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))  # fmt: skip
    unet = UNet2DConditionModel(  # type: ignore[no-untyped-call]
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4,
    )  # fmt: skip
    vae = AutoencoderKL(  # type: ignore[no-untyped-call]
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=4, sample_size=16,
    )  # fmt: skip
    scheduler = DDIMScheduler(num_train_timesteps=10, steps_offset=1, clip_sample=False)  # type: ignore[no-untyped-call]
    return StableDiffusionPipeline(  # type: ignore[no-untyped-call]
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def write(directory: Path, *, variant: bool = True) -> None:
    """The pipeline at `directory` (seed 3), and its float16 variant of other weights (seed 5) beside it."""
    import torch

    pipeline(3).save_pretrained(directory)
    for name, text in vocabulary().items():  # beside tokenizer.json, as a Hub repository's tokenizer/ holds them
        (directory / "tokenizer" / name).write_text(text, encoding="utf-8")
    if not variant:
        return
    half = pipeline(5).to(torch.float16)
    with tempfile.TemporaryDirectory() as saved:  # its weights files only: the configs stay the float32 ones
        half.save_pretrained(saved, variant="fp16")
        for path in glob.glob(os.path.join(saved, "*", "*.fp16.safetensors")):
            shutil.copy(path, directory / os.path.relpath(path, saved))


def main(argv: list[str]) -> int:
    for quiet in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):  # their progress and advice: not ours to show
        os.environ.setdefault(quiet, "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where the pipeline goes (a new directory)")
    parser.add_argument("--no-variant", action="store_true", help="no float16 variant beside the weights")
    arguments = parser.parse_args(argv[1:])
    if arguments.directory.exists():
        parser.error(f"{arguments.directory}: already exists; name a new directory")
    write(arguments.directory, variant=not arguments.no_variant)
    print(f"wrote a tiny Stable Diffusion pipeline in {arguments.directory}/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
