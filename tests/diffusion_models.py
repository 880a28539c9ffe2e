"""diffusers' models made for the tests (a tiny latent diffusion pipeline and a tiny Stable Diffusion one
from configs, random weights), and what diffusers itself loads from a folder: run in a Python of its own
(diffusers takes seconds to import, and the tests' process stays free of it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import patience

# Writes a tiny latent diffusion pipeline (save_pretrained; its float16 variant beside it, of other
# weights), or a tiny Stable Diffusion pipeline ("sd"), or a tiny AutoencoderKL ("vae"), or says what
# diffusers loads from each folder given: "unet:PATH" (UNet2DModel, with "unet@VARIANT:PATH" a variant)
# each weight's SHA-256; "single:CONFIG=FILE" (AutoencoderKL.from_single_file, its config from the folder
# CONFIG) the same; "pipe:PATH" (DiffusionPipeline) each weight's, by component, and the SHA-256 of an
# image it makes in two steps from a fixed seed; "sd:PATH" (StableDiffusionPipeline) the same, of the
# unet, vae and text_encoder, and the token ids its tokenizer makes of the prompt it draws.
DIFFUSERS = """
import hashlib, json, sys
import torch
from diffusers import AutoencoderKL, DDIMScheduler, DiffusionPipeline, LDMPipeline, UNet2DModel, VQModel
command = sys.argv[1]
def pipeline():
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)
    vqvae = VQModel(in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8,), layers_per_block=1,
                    down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",), norm_num_groups=4,
                    num_vq_embeddings=16, vq_embed_dim=3, sample_size=8)
    return LDMPipeline(vqvae=vqvae, unet=unet, scheduler=DDIMScheduler(num_train_timesteps=10))
PROMPT = "a photo of a cat"
def byte_characters():  # CLIP's byte-level alphabet: each of the 256 bytes as the character its BPE sees
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    code = dict(zip(printable + others, printable + [256 + k for k in range(len(others))]))
    return [chr(code[byte]) for byte in range(256)]
def stable_diffusion(folder):
    import os, tempfile
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
    characters = byte_characters()
    merges = ["c a", "ca t</w>"]
    tokens = ["<|startoftext|>", "<|endoftext|>", *characters, *(c + "</w>" for c in characters),
              *(merge.replace(" ", "") for merge in merges)]
    files = {"vocab.json": json.dumps({token: k for k, token in enumerate(tokens)}),
             "merges.txt": "#version: 0.2\\n" + "\\n".join(merges) + "\\n"}
    with tempfile.TemporaryDirectory() as vocabulary:
        for name, text in files.items():
            with open(os.path.join(vocabulary, name), "w", encoding="utf-8") as file:
                file.write(text)
        tokenizer = CLIPTokenizer.from_pretrained(vocabulary, model_max_length=16)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokens), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=4, sample_size=16)
    StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDIMScheduler(num_train_timesteps=10),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False).save_pretrained(folder)
    for name, text in files.items():  # beside tokenizer.json, as a Hub repository's tokenizer/ holds them
        with open(os.path.join(folder, "tokenizer", name), "w", encoding="utf-8") as file:
            file.write(text)
def digests(module, prefix=""):
    return {prefix + name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
            for name, t in module.state_dict().items()}
if command == "write":
    torch.manual_seed(0)
    pipeline().save_pretrained(sys.argv[2])
    torch.manual_seed(1)
    pipeline().to(torch.float16).save_pretrained(sys.argv[2], variant="fp16")
elif command == "sd":
    torch.manual_seed(3)
    stable_diffusion(sys.argv[2])
elif command == "vae":
    torch.manual_seed(2)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), latent_channels=4,
                  up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1, norm_num_groups=4,
                  sample_size=8).save_pretrained(sys.argv[2])
else:
    for argument in sys.argv[2:]:
        kind, _, path = argument.partition(":")
        kind, _, variant = kind.partition("@")
        if kind == "unet":
            print(json.dumps({"path": path, "weights": digests(UNet2DModel.from_pretrained(path, variant=variant or None))}))
            continue
        if kind == "single":
            config, _, path = path.partition("=")
            model = AutoencoderKL.from_single_file(path, config=config, local_files_only=True)
            print(json.dumps({"path": path, "weights": digests(model)}))
            continue
        if kind == "sd":
            from diffusers import StableDiffusionPipeline
            pipe = StableDiffusionPipeline.from_pretrained(path)
            pipe.set_progress_bar_config(disable=True)
            image = pipe(PROMPT, num_inference_steps=2, height=16, width=16, generator=torch.Generator().manual_seed(0),
                         output_type="np").images
            weights = {**digests(pipe.unet, "unet/"), **digests(pipe.vae, "vae/"), **digests(pipe.text_encoder, "text_encoder/")}
            print(json.dumps({"path": path, "weights": weights, "tokens": pipe.tokenizer(PROMPT).input_ids,
                              "image": hashlib.sha256(image.tobytes()).hexdigest()}))
            continue
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        image = pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
        weights = {**digests(pipe.unet, "unet/"), **digests(pipe.vqvae, "vqvae/")}
        print(json.dumps({"path": path, "weights": weights, "image": hashlib.sha256(image.tobytes()).hexdigest()}))
"""


def diffusers(command: str, *args: str) -> list[dict[str, object]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DIFFUSERS_VERBOSITY": "error"}
    done = subprocess.run(
        [sys.executable, "-c", DIFFUSERS, command, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=patience(300),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def weights(*folders: str) -> list[object]:
    """What UNet2DModel.from_pretrained loads from each folder ("PATH", or "@VARIANT:PATH"): each weight's SHA-256."""
    arguments = [f"unet{folder}" if folder.startswith("@") else f"unet:{folder}" for folder in folders]
    return [found["weights"] for found in diffusers("load", *arguments)]


def pipelines(*folders: Path) -> list[tuple[object, object]]:
    """What DiffusionPipeline.from_pretrained loads from each folder: (its weights' SHA-256s, its image's)."""
    return [
        (found["weights"], found["image"]) for found in diffusers("load", *(f"pipe:{folder}" for folder in folders))
    ]


def write_pipeline(directory: Path) -> Path:
    """A tiny latent diffusion pipeline as save_pretrained writes it: model_index.json, scheduler/,
    unet/ and vqvae/ (each's weights in float32, and an fp16 variant of other weights beside them)."""
    diffusers("write", str(directory))
    return directory


def write_stable_diffusion(directory: Path) -> Path:
    """A tiny Stable Diffusion pipeline as save_pretrained writes it: model_index.json, scheduler/, unet/
    and vae/ (diffusers' weights), text_encoder/ (a CLIPTextModel: transformers' model.safetensors) and
    tokenizer/ (a CLIPTokenizer of a tiny byte-level vocabulary: tokenizer.json, and the vocab.json and
    merges.txt it was made from beside it), all in float32; no safety checker."""
    diffusers("sd", str(directory))
    return directory


def stable_diffusions(*folders: Path) -> list[tuple[object, object, object]]:
    """What StableDiffusionPipeline.from_pretrained loads from each folder: (its weights' SHA-256s, by
    component: unet/, vae/, text_encoder/; the token ids of its prompt; the SHA-256 of its image of it)."""
    loads = diffusers("load", *(f"sd:{folder}" for folder in folders))
    return [(found["weights"], found["tokens"], found["image"]) for found in loads]
