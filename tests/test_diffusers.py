"""diffusers' models as diffusers lays them out: a component folder (diffusion_pytorch_model.safetensors,
its variants beside it), a Hugging Face cache snapshot's folder, and the refusals, read by diffusers
itself from tensorfs's views and exports.

The pipeline is made in the test (a tiny DDPM: a UNet2DModel from its config with random weights, and
a scheduler) and what diffusers loads from the original folder is compared with what it loads from
tensorfs's: every weight, bit for bit. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfs
from conftest import Mounts
from helpers import patience

# Writes a tiny DDPM pipeline (save_pretrained; its float16 variant beside it, of other weights), or
# says what diffusers loads from each folder given ("unet:PATH": UNet2DModel.from_pretrained, with
# "unet@VARIANT:PATH" a variant): each weight's SHA-256.
DIFFUSERS = """
import hashlib, json, sys
import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
command = sys.argv[1]
def unet():
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)
def digests(module):
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for name, t in module.state_dict().items()}
if command == "write":
    torch.manual_seed(0)
    DDPMPipeline(unet=unet(), scheduler=DDPMScheduler(num_train_timesteps=10)).save_pretrained(sys.argv[2])
    torch.manual_seed(1)
    half = DDPMPipeline(unet=unet(), scheduler=DDPMScheduler(num_train_timesteps=10)).to(torch.float16)
    half.save_pretrained(sys.argv[2], variant="fp16")
else:
    for argument in sys.argv[2:]:
        kind, _, path = argument.partition(":")
        kind, _, variant = kind.partition("@")
        model = UNet2DModel.from_pretrained(path, variant=variant or None)
        print(json.dumps({"path": path, "weights": digests(model)}))
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
    return [
        found["weights"]
        for found in diffusers(
            "load", *(f"unet{folder}" if folder.startswith("@") else f"unet:{folder}" for folder in folders)
        )
    ]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DDPM pipeline as save_pretrained writes it: model_index.json, scheduler/, unet/ (its
    weights in float32, and an fp16 variant of other weights beside them)."""
    made = tmp_path_factory.mktemp("diffusers") / "ddpm"
    diffusers("write", str(made))
    return made


def test_a_component_folder_with_its_variant_beside_it_is_one_model(
    pipeline: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """unet/ holds diffusion_pytorch_model.safetensors and its .fp16 variant: the model is the first,
    as diffusers loads it without variant=, its view and its export named as diffusers looks for
    them; naming the variant's file opens the variant."""
    unet = pipeline / "unet"
    assert sorted(os.listdir(unet)) == [
        "config.json", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors",
    ]  # fmt: skip
    with tensorfs.open_model(unet) as model:
        assert model.shards == [unet / "diffusion_pytorch_model.safetensors"]
        assert {model.info(name).dtype for name in model} == {"F32"}
    with tensorfs.open_model(unet / "diffusion_pytorch_model.fp16.safetensors") as model:
        assert {model.info(name).dtype for name in model} == {"F16"}
    validated = mounts.run("validate", str(unet))
    assert validated.returncode == 0, validated.stderr
    view = mounts.mount(unet) / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    exported = mounts.run("export", str(unet), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert sorted(os.listdir(tmp_path / "exported")) == ["config.json", "diffusion_pytorch_model.safetensors"]
    original, mounted, written, variant = weights(str(unet), str(view), str(tmp_path / "exported"), f"@fp16:{unet}")
    assert mounted == original and written == original and variant != original


def test_a_snapshot_folder_mounts_with_its_config(pipeline: Path, mounts: Mounts, tmp_path: Path) -> None:
    """A Hugging Face cache snapshot's component folder (snapshots/REV/unet, its files symlinks into
    the repository's ../../../blobs) is a model with its config.json; a link out of the repository
    is still left out."""
    repository = tmp_path / "hub" / "models--org--ddpm"
    (repository / "blobs").mkdir(parents=True)
    snapshot = repository / "snapshots" / "0123abcd"
    for path in sorted(pipeline.rglob("*")):
        if path.is_file():
            relative = path.relative_to(pipeline)
            blob = repository / "blobs" / relative.as_posix().replace("/", "-")
            shutil.copy(path, blob)
            (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / relative).symlink_to(Path(*[".."] * len(relative.parts), "..", "blobs", blob.name))
    (tmp_path / "elsewhere.json").write_text("{}")
    (snapshot / "unet" / "elsewhere.json").symlink_to(tmp_path / "elsewhere.json")
    view = mounts.mount(snapshot / "unet") / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert "elsewhere.json: skipped: a symlink out of the model's directory" in mounts.log()
    named = mounts.mount(snapshot / "unet" / "diffusion_pytorch_model.safetensors") / ".tensorfs" / "model"
    assert sorted(os.listdir(named)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    original, mounted, by_file = weights(str(pipeline / "unet"), str(view), str(named))
    assert mounted == original and by_file == original


def test_variants_without_their_default_are_refused_in_one_line(pipeline: Path, tmp_path: Path) -> None:
    """A folder of two variants and no plain file: diffusers needs variant= to load either, and
    tensorfs needs to be told which too, in one line naming the files (not a line per tensor)."""
    folder = tmp_path / "unet"
    folder.mkdir()
    shutil.copy(pipeline / "unet" / "config.json", folder)
    shutil.copy(pipeline / "unet" / "diffusion_pytorch_model.fp16.safetensors", folder)
    with tensorfs.open_model(folder) as model:  # a variant alone is the model
        assert {model.info(name).dtype for name in model} == {"F16"}
    shutil.copy(
        pipeline / "unet" / "diffusion_pytorch_model.safetensors", folder / "diffusion_pytorch_model.v2.safetensors"
    )
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(folder)
    assert str(raised.value) == (
        f"{folder}: holds the files of several models (variants) (diffusion_pytorch_model.fp16.safetensors, "
        "diffusion_pytorch_model.v2.safetensors): name the one to open (its file, or its index)"
    )
