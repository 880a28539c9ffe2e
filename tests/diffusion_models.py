"""diffusers' models made for the tests (a tiny latent diffusion pipeline and a tiny Stable Diffusion one
from configs, random weights), and what diffusers itself loads from a folder: run in a Python of its own
that stays (helpers.CONSUMERS: diffusers takes seconds to import, and the tests' process stays free of it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import CONSUMERS

# Writes a tiny latent diffusion pipeline (save_pretrained; its float16 variant beside it, of other
# weights), or a tiny AutoencoderKL ("vae"), or a LoRA of a Stable Diffusion pipeline's unet ("lora BASE
# DIR": DIR/pytorch_lora_weights.safetensors), or says what diffusers loads from each folder given:
# "unet:PATH" (UNet2DModel, with "unet@VARIANT:PATH" a variant; "cunet": UNet2DConditionModel) each
# weight's SHA-256;
# "single:CONFIG=FILE" (AutoencoderKL.from_single_file, its config from the folder CONFIG) the same;
# "pipe:PATH" (DiffusionPipeline, "pipe@VARIANT:PATH" a variant) each weight's, by component, and the
# SHA-256 of an image it makes in two steps from a fixed seed; "sd:PATH" (StableDiffusionPipeline) the
# same, of the unet, vae and text_encoder, and the token ids its tokenizer makes of the prompt it draws;
# "sdw@VARIANT:PATH" its weights only, or the kind of error it raises; "lora:BASE|DIR|NAME" the weights of
# the unet of the pipeline at BASE with the LoRA of DIR (load_lora_weights, weight_name=NAME if given),
# and the image it makes.
DIFFUSERS = """
import hashlib, json, os, sys
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
def digests(module, prefix=""):
    return {prefix + name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
            for name, t in module.state_dict().items()}
if command == "write":
    torch.manual_seed(0)
    pipeline().save_pretrained(sys.argv[2])
    torch.manual_seed(1)
    pipeline().to(torch.float16).save_pretrained(sys.argv[2], variant="fp16")
elif command == "lora":
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    pipe = StableDiffusionPipeline.from_pretrained(sys.argv[2])
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch.manual_seed(6)
    for name, parameter in pipe.unet.named_parameters():
        if "lora_" in name:  # (lora_B starts at zeros: a LoRA that changes nothing would prove nothing)
            parameter.data.normal_(0, 0.5)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet))
    StableDiffusionPipeline.save_lora_weights(sys.argv[3], unet_lora_layers=layers, safe_serialization=True)
elif command == "vae":
    torch.manual_seed(2)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), latent_channels=4,
                  up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1, norm_num_groups=4,
                  sample_size=8).save_pretrained(sys.argv[2])
else:
    for argument in sys.argv[2:]:
        kind, _, path = argument.partition(":")
        kind, _, variant = kind.partition("@")
        if kind in ("unet", "cunet"):
            from diffusers import UNet2DConditionModel
            kind_of = UNet2DModel if kind == "unet" else UNet2DConditionModel
            print(json.dumps({"path": path, "weights": digests(kind_of.from_pretrained(path, variant=variant or None))}))
            continue
        if kind == "single":
            config, _, path = path.partition("=")
            model = AutoencoderKL.from_single_file(path, config=config, local_files_only=True)
            print(json.dumps({"path": path, "weights": digests(model)}))
            continue
        if kind == "sdw":
            from diffusers import StableDiffusionPipeline
            try:
                pipe = StableDiffusionPipeline.from_pretrained(path, variant=variant or None)
            except Exception as exc:
                print(json.dumps({"path": path, "error": type(exc).__name__}))
                continue
            weights = {**digests(pipe.unet, "unet/"), **digests(pipe.vae, "vae/"), **digests(pipe.text_encoder, "text_encoder/")}
            print(json.dumps({"path": path, "weights": weights}))
            continue
        if kind == "lora":
            from diffusers import StableDiffusionPipeline
            base, lora, weight_name = path.split("|")
            pipe = StableDiffusionPipeline.from_pretrained(base)
            pipe.load_lora_weights(lora, weight_name=weight_name or None)
            pipe.set_progress_bar_config(disable=True)
            image = pipe(PROMPT, num_inference_steps=2, height=16, width=16, generator=torch.Generator().manual_seed(0),
                         output_type="np").images
            print(json.dumps({"path": path, "weights": digests(pipe.unet, "unet/"),
                              "image": hashlib.sha256(image.tobytes()).hexdigest()}))
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
        pipe = DiffusionPipeline.from_pretrained(path, variant=variant or None)
        pipe.set_progress_bar_config(disable=True)
        if variant:  # float16 on the CPU: its weights only
            print(json.dumps({"path": path, "weights": {**digests(pipe.unet, "unet/"), **digests(pipe.vqvae, "vqvae/")}}))
            continue
        image = pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
        weights = {**digests(pipe.unet, "unet/"), **digests(pipe.vqvae, "vqvae/")}
        print(json.dumps({"path": path, "weights": weights, "image": hashlib.sha256(image.tobytes()).hexdigest()}))
"""


def offline() -> dict[str, str]:
    """The environment diffusers runs in: the test's, offline (nothing is downloaded)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "DIFFUSERS_VERBOSITY": "error"}


def diffusers(command: str, *args: str) -> list[dict[str, object]]:
    done = CONSUMERS.run(DIFFUSERS, command, *args, env=offline())
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


def write_stable_diffusion(directory: Path, *, variant: bool = False) -> Path:
    """A tiny Stable Diffusion pipeline as save_pretrained writes it (scripts/tiny_pipeline.py, the docs'
    own): model_index.json, scheduler/, unet/ and vae/ (diffusers' weights), text_encoder/ (a
    CLIPTextModel: transformers' model.safetensors) and tokenizer/ (a CLIPTokenizer of a tiny byte-level
    vocabulary: tokenizer.json, and the vocab.json and merges.txt it was made from beside it), all in
    float32, no safety checker; with `variant`, a float16 variant of other weights beside each
    component's (diffusion_pytorch_model.fp16.safetensors, model.fp16.safetensors)."""
    script = Path(__file__).parent.parent / "scripts" / "tiny_pipeline.py"
    done = CONSUMERS.run(script.read_text(), directory, *([] if variant else ["--no-variant"]), env=offline())
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def stable_diffusions(*folders: Path) -> list[tuple[object, object, object]]:
    """What StableDiffusionPipeline.from_pretrained loads from each folder: (its weights' SHA-256s, by
    component: unet/, vae/, text_encoder/; the token ids of its prompt; the SHA-256 of its image of it)."""
    loads = diffusers("load", *(f"sd:{folder}" for folder in folders))
    return [(found["weights"], found["tokens"], found["image"]) for found in loads]


def write_lora(base: Path, directory: Path) -> Path:
    """A LoRA of the unet of the Stable Diffusion pipeline at `base`, as diffusers saves one:
    `directory`/pytorch_lora_weights.safetensors."""
    diffusers("lora", str(base), str(directory))
    return directory / "pytorch_lora_weights.safetensors"


def variant_weights(*folders: str, variant: str = "fp16") -> list[dict[str, object]]:
    """What StableDiffusionPipeline.from_pretrained(folder, variant=) loads from each folder: each weight's
    SHA-256, by component ("weights"), or the kind of error it raises ("error")."""
    found = diffusers("load", *(f"sdw@{variant}:{folder}" for folder in folders))
    return [{key: value for key, value in one.items() if key != "path"} for one in found]


def with_lora(base: Path, *loras: tuple[Path, str]) -> list[tuple[object, object]]:
    """What the Stable Diffusion pipeline at `base` holds with each LoRA (its folder, the weight_name given,
    '' for none) loaded onto it: (its unet's weights' SHA-256s, the SHA-256 of the image it makes)."""
    found = diffusers("load", *(f"lora:{base}|{lora}|{name}" for lora, name in loras))
    return [(one["weights"], one["image"]) for one in found]
