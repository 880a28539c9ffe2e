"""diffusers' models as diffusers lays them out: a component folder (diffusion_pytorch_model.safetensors,
its variants beside it), a Hugging Face cache snapshot's folder, a pipeline's root (model_index.json
and its folders), a LoRA, and the refusals, read by diffusers itself from tensorfs's views and exports
(the model's own folder, every file under its own name with its own bytes), with and without variant=.

The pipelines are made in the test (a tiny latent diffusion pipeline: a UNet2DModel and a VQModel from
their configs with random weights, and a scheduler; a tiny Stable Diffusion pipeline: a
UNet2DConditionModel, an AutoencoderKL, transformers' CLIPTextModel and a CLIPTokenizer of a tiny
vocabulary) and what diffusers loads from the original folder is compared with what it loads from
tensorfs's: every weight, and the image it makes, bit for bit. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import obstore
import pytest
import safetensors.numpy
from diffusion_models import (
    diffusers,
    pipelines,
    stable_diffusions,
    variant_weights,
    weights,
    with_lora,
    write_lora,
    write_pipeline,
    write_stable_diffusion,
)
from gguf_files import write_gguf
from safetensors import safe_open

import tensorfs
from conftest import Mounts
from helpers import cli, hub_api, write_reference
from servers import Nginx, SeaweedFS
from tensorfs.opening.pipelines import GGUF_COMPONENT


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny latent diffusion pipeline as save_pretrained writes it: model_index.json, scheduler/,
    unet/ and vqvae/ (each's weights in float32, and an fp16 variant of other weights beside them)."""
    return write_pipeline(tmp_path_factory.mktemp("diffusers") / "ldm")


@pytest.fixture(scope="module")
def sd_variants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Stable Diffusion pipeline with a float16 variant of other weights beside each
    component's (the layout of the Hub's Stable Diffusion repositories)."""
    return write_stable_diffusion(tmp_path_factory.mktemp("diffusers") / "sd", variant=True)


@pytest.fixture(scope="module")
def stable_diffusion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Stable Diffusion pipeline as save_pretrained writes it: model_index.json, scheduler/,
    unet/ and vae/ (diffusers' weights), text_encoder/ (transformers' model.safetensors of a
    CLIPTextModel) and tokenizer/ (a CLIPTokenizer's files, no weights)."""
    return write_stable_diffusion(tmp_path_factory.mktemp("diffusers") / "sd")


def view_files(view: Path) -> list[str]:
    return sorted(path.relative_to(view).as_posix() for path in view.rglob("*") if path.is_file())


PIPELINE_VIEW = [
    "model_index.json",
    "scheduler/scheduler_config.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_pytorch_model.safetensors",
    "vqvae/config.json",
    "vqvae/diffusion_pytorch_model.fp16.safetensors",
    "vqvae/diffusion_pytorch_model.safetensors",
]
"""A pipeline's view: its folder, every file under its own name with its own bytes (the variants too:
diffusers loads them with variant="fp16")."""


def same_files(folder: Path, source: Path) -> None:
    """Every file of `folder` is the file of `source` at the same path, byte for byte (its SHA-256)."""
    for name in view_files(folder):
        served, original = (folder / name).read_bytes(), (source / name).read_bytes()
        assert hashlib.sha256(served).digest() == hashlib.sha256(original).digest(), name


STABLE_DIFFUSION_VIEW = [
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
]
"""A Stable Diffusion pipeline's view: every file of its folder, each component's weights named as its
own loader looks for them (transformers' model.safetensors in text_encoder/), the tokenizer's files as
they are."""


def test_a_component_folder_with_its_variant_beside_it_is_one_model(
    pipeline: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """unet/ holds diffusion_pytorch_model.safetensors and its .fp16 variant: the model is the first,
    as diffusers loads it without variant=; its view and its export are the folder as it is, from which
    diffusers loads the same weights as from the original, with variant="fp16" and without; naming the
    variant's file opens the variant, its view holding that file under its own name."""
    unet = pipeline / "unet"
    files = ["config.json", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors"]
    assert sorted(os.listdir(unet)) == files
    with tensorfs.open_model(unet) as model:
        assert model.shards == [unet / "diffusion_pytorch_model.safetensors"]
        assert {model.info(name).dtype for name in model} == {"F32"}
    with tensorfs.open_model(unet / "diffusion_pytorch_model.fp16.safetensors") as model:
        assert {model.info(name).dtype for name in model} == {"F16"}
    validated = mounts.run("validate", str(unet))
    assert validated.returncode == 0, validated.stderr
    view = mounts.mount(unet) / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == files
    exported = mounts.run("export", str(unet), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert sorted(os.listdir(tmp_path / "exported")) == files
    for folder in (view, tmp_path / "exported"):
        same_files(folder, unet)
    named = mounts.mount(unet / "diffusion_pytorch_model.fp16.safetensors") / ".tensorfs" / "model"
    assert sorted(os.listdir(named)) == ["config.json", "diffusion_pytorch_model.fp16.safetensors"]
    folders = (str(unet), str(view), str(tmp_path / "exported"))
    original, mounted, written, variant, mounted_variant, written_variant, named_variant = weights(
        *folders, *(f"@fp16:{folder}" for folder in (*folders, str(named)))
    )
    assert mounted == original and written == original and variant != original
    assert mounted_variant == variant and written_variant == variant and named_variant == variant


def test_a_snapshot_folder_mounts_with_its_config(pipeline: Path, mounts: Mounts, tmp_path: Path) -> None:
    """A Hugging Face cache snapshot's component folder (snapshots/REV/unet, its files symlinks into
    the repository's ../../../blobs) is a model with its config.json and its variant, as they are; a
    link out of the repository is still left out. The snapshot itself mounts as the pipeline, from
    whose view diffusers loads the variant as from the snapshot."""
    repository = tmp_path / "hub" / "models--org--ldm"
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
    files = ["config.json", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors"]
    assert sorted(os.listdir(view)) == files
    assert "elsewhere.json: skipped: a symlink out of the model's directory" in mounts.log()
    named = mounts.mount(snapshot / "unet" / "diffusion_pytorch_model.safetensors") / ".tensorfs" / "model"
    assert sorted(os.listdir(named)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    whole = mounts.mount(snapshot) / ".tensorfs" / "model"
    assert view_files(whole) == PIPELINE_VIEW
    same_files(whole, pipeline)
    folders = [str(pipeline / "unet"), str(view), str(named)]
    found = diffusers(
        "load", *(f"unet:{folder}" for folder in folders), f"pipe:{pipeline}", f"pipe:{whole}",
        f"pipe@fp16:{snapshot}", f"pipe@fp16:{whole}",
    )  # fmt: skip
    original, mounted, by_file, pipeline_original, pipeline_mounted, variant, variant_mounted = found
    assert mounted["weights"] == original["weights"] and by_file["weights"] == original["weights"]
    assert (pipeline_mounted["weights"], pipeline_mounted["image"]) == (
        pipeline_original["weights"], pipeline_original["image"],
    )  # fmt: skip
    assert variant_mounted["weights"] == variant["weights"] != pipeline_original["weights"]


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


def test_a_pipeline_mounts_as_its_components_and_diffusers_loads_it(
    pipeline: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """A pipeline's root (model_index.json, unet/, vqvae/, scheduler/): each component folder a model
    of its own, its tensors under its folder; its view and its export are the pipeline's folder, every
    file as it is (the variants too). DiffusionPipeline loads the same weights, and makes the same image,
    from the view and from the export as from the original folder, and the same variant with
    variant="fp16"; UNet2DModel loads the view's unet/ as it loads the original's."""
    mountpoint = mounts.mount(pipeline)
    view = mountpoint / ".tensorfs" / "model"
    assert view_files(view) == PIPELINE_VIEW
    same_files(view, pipeline)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "unet", "vqvae"]
    with tensorfs.open_model(pipeline) as model:
        assert {name.partition("/")[0] for name in model} == {"unet", "vqvae"}
        assert {model.info(name).dtype for name in model} == {"F32"}
        assert (mountpoint / "unet" / "conv_in.weight").read_bytes() == bytes(model.raw("unet/conv_in.weight"))
    exported = mounts.run("export", str(pipeline), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert view_files(tmp_path / "exported") == PIPELINE_VIEW
    same_files(tmp_path / "exported", pipeline)
    one_file = mounts.run("export", str(pipeline), str(tmp_path / "all.safetensors"))  # every tensor, by folder
    assert one_file.returncode == 0, one_file.stderr
    with tensorfs.open_model(tmp_path / "all.safetensors") as whole, tensorfs.open_model(pipeline) as model:
        assert {name: bytes(whole.raw(name)) for name in whole} == {name: bytes(model.raw(name)) for name in model}
    folders = (pipeline, view, tmp_path / "exported")
    loads = [f"pipe:{folder}" for folder in folders] + [f"pipe@fp16:{folder}" for folder in folders]
    original, mounted, written, variant, mounted_variant, written_variant, unet, unet_in_view = diffusers(
        "load", *loads, f"unet:{pipeline / 'unet'}", f"unet:{view / 'unet'}"
    )
    assert [(found["weights"], found["image"]) for found in (mounted, written)] == [
        (original["weights"], original["image"]),
    ] * 2
    assert mounted_variant["weights"] == variant["weights"] and written_variant["weights"] == variant["weights"]
    assert variant["weights"] != original["weights"]
    assert unet_in_view["weights"] == unet["weights"]  # a component of the view is a model on its own


def test_a_pipelines_selection_is_of_its_components_tensors(pipeline: Path, mounts: Mounts) -> None:
    """--include matches the tensors' names under their folders: 'unet/*' is one component, served
    as a selection is (named so that no loader takes it for the whole), the others left out."""
    mountpoint = mounts.mount(pipeline, "--include", "unet/*")
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "unet"]
    view = mountpoint / ".tensorfs" / "model"
    assert view_files(view) == [
        "model_index.json", "scheduler/scheduler_config.json", "tensorfs-view.json", "unet/config.json",
        "unet/selected.safetensors", "vqvae/config.json",
    ]  # fmt: skip


def test_a_pipelines_exclusion_and_its_refusals_through_the_commands(
    pipeline: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """--exclude 'vqvae/*' leaves that component's weights out (its config stays, as a selection's
    does); --layers of a pipeline none of whose names is of a numbered layer (a UNet's down_blocks.0
    is not one) is refused saying so. A component of two variants and no default, which the library
    refuses, the commands serve, each variant in its folder within the component's (issue 55); a
    pipeline they refuse (a GGUF component) is refused in one line: exit 1, no traceback."""
    mountpoint = mounts.mount(pipeline, "--exclude", "vqvae/*")
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "unet"]
    assert view_files(mountpoint / ".tensorfs" / "model") == [
        "model_index.json", "scheduler/scheduler_config.json", "tensorfs-view.json", "unet/config.json",
        "unet/selected.safetensors", "vqvae/config.json",
    ]  # fmt: skip
    listed = cli("ls", str(pipeline), "--layers", "0-0")
    assert (listed.returncode, listed.stderr) == (
        1,
        f"error: {pipeline}: --layers 0-0 selects no layer (it has no numbered layers)\n",
    )
    copy = tmp_path / "ldm"
    shutil.copytree(pipeline, copy)
    unet = copy / "unet"
    (unet / "diffusion_pytorch_model.safetensors").rename(unet / "diffusion_pytorch_model.v2.safetensors")
    listed = cli("ls", "--json", str(copy))
    assert listed.returncode == 0, listed.stderr
    folders = {"/".join(json.loads(line)["name"].split("/")[:2]) for line in listed.stdout.splitlines()}
    assert {"unet/diffusion_pytorch_model.fp16", "unet/diffusion_pytorch_model.v2"} <= folders, folders
    for variant in unet.glob("*.safetensors"):
        variant.unlink()
    write_gguf(unet / "unet.gguf", {"w": ("F32", [4])})  # diffusers loads no component from a GGUF
    for command in (["validate", str(copy)], ["mount", str(copy), str(tmp_path / "mnt")]):
        (tmp_path / "mnt").mkdir(exist_ok=True)
        refused = cli(*command)
        assert refused.returncode == 1 and refused.stdout == "", refused
        assert refused.stderr == f"error: {unet / 'unet.gguf'}: {GGUF_COMPONENT}\n"


def test_a_pipeline_with_a_component_of_several_models_is_refused_naming_its_folder(
    pipeline: Path, tmp_path: Path
) -> None:
    """A component folder holding two variants and no plain file: the pipeline is refused in one line
    naming that folder and its files; one holding a GGUF (no loader of a component reads one), naming
    the file. A root none of whose folders holds weights says it is a
    pipeline's, and what to name instead."""
    copy = tmp_path / "ldm"
    shutil.copytree(pipeline, copy)
    unet = copy / "unet"
    (unet / "diffusion_pytorch_model.safetensors").rename(unet / "diffusion_pytorch_model.v2.safetensors")
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(copy)
    assert str(raised.value) == (
        f"{unet}: holds the files of several models (variants) (diffusion_pytorch_model.fp16.safetensors, "
        "diffusion_pytorch_model.v2.safetensors): name the one to open (its file, or its index)"
    )
    for variant in unet.glob("*.safetensors"):
        variant.unlink()
    write_gguf(unet / "unet.gguf", {"w": ("F32", [4])})  # diffusers loads no component from a GGUF
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(copy)
    assert str(raised.value) == f"{unet / 'unet.gguf'}: {GGUF_COMPONENT}"
    for folder in ("unet", "vqvae"):  # no component left: the root says it is a pipeline's, and what to name
        shutil.rmtree(copy / folder)
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(copy)
    assert str(raised.value) == (
        f"{copy}: a diffusers pipeline's root (model_index.json) none of whose folders holds .safetensors, .gguf, "
        ".bin, .pt or .pth files: name a component's folder"
    )


def test_a_pipeline_on_the_hub_and_in_s3_mounts_as_its_components(
    pipeline: Path,
    mounts: Mounts,
    nginx: Nginx,
    seaweedfs: SeaweedFS,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same pipeline as a Hub repository (its API lists the root and its folders) and under an S3
    prefix (its listing): each mounts as the local one does, its view the pipeline's folder as it is,
    and DiffusionPipeline loads the same weights and image from the views, and the same variant with
    variant="fp16"; a component's folder (hf://.../unet) mounts alone."""
    hub = nginx.root / "diffusers" / "ldm" / "resolve" / "main"
    shutil.copytree(pipeline, hub)
    hub_api(nginx.root, "diffusers/ldm", hub)
    store = seaweedfs.store(bucket)
    for path in sorted(pipeline.rglob("*")):
        if path.is_file():
            obstore.put(store, f"ldm/{path.relative_to(pipeline).as_posix()}", path.read_bytes())
    cache = ["--cache-dir", str(tmp_path / "cache")]
    with monkeypatch.context() as env:
        env.setenv("HF_ENDPOINT", nginx.url)
        for key, value in seaweedfs.env().items():
            env.setenv(key, value)
        from_hub = mounts.mount("hf://diffusers/ldm", *cache)  # type: ignore[arg-type]
        from_s3 = mounts.mount(f"s3://{bucket}/ldm", *cache, "--endpoint-url", seaweedfs.endpoint)  # type: ignore[arg-type]
        unet = mounts.mount("hf://diffusers/ldm/unet", *cache) / ".tensorfs" / "model"  # type: ignore[arg-type]
    views = [from_hub / ".tensorfs" / "model", from_s3 / ".tensorfs" / "model"]
    for view in views:
        assert view_files(view) == PIPELINE_VIEW
        same_files(view, pipeline)
    assert sorted(os.listdir(unet)) == [
        "config.json", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors",
    ]  # fmt: skip
    original, *served = pipelines(pipeline, *views)
    assert served == [original, original]
    variants = diffusers("load", *(f"pipe@fp16:{folder}" for folder in (pipeline, *views)))
    assert [found["weights"] for found in variants[1:]] == [variants[0]["weights"]] * 2
    original_unet, served_unet, original_variant, served_variant = weights(
        str(pipeline / "unet"), str(unet), f"@fp16:{pipeline / 'unet'}", f"@fp16:{unet}"
    )
    assert served_unet == original_unet and served_variant == original_variant


def test_a_single_file_checkpoint_mounts_and_from_single_file_loads_it(mounts: Mounts, tmp_path: Path) -> None:
    """A single .safetensors file (a checkpoint as from_single_file takes one, its config elsewhere) is
    a model like any other: AutoencoderKL.from_single_file loads the same weights from the mount's
    view of it, and from its export, as from the file itself."""
    vae = tmp_path / "vae"
    diffusers("vae", str(vae))
    single = tmp_path / "checkpoints" / "tiny-vae.safetensors"
    single.parent.mkdir()
    shutil.copy(vae / "diffusion_pytorch_model.safetensors", single)
    view = mounts.mount(single) / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["tiny-vae.safetensors"]  # its own name, its own bytes
    assert (view / "tiny-vae.safetensors").read_bytes() == single.read_bytes()
    exported = mounts.run("export", str(single), str(tmp_path / "exported.safetensors"))
    assert exported.returncode == 0, exported.stderr
    files = [single, view / "tiny-vae.safetensors", tmp_path / "exported.safetensors"]
    original, mounted, written = (
        found["weights"] for found in diffusers("load", *(f"single:{vae}={f}" for f in files))
    )
    assert mounted == original and written == original


def test_a_pipelines_folders_are_looked_into_up_to_a_bound(tmp_path: Path) -> None:
    """A root with model_index.json and thousands of folders (another user's, say) is a walk bounded:
    the first MAX_COMPONENTS folders are looked into, no more."""
    from tensorfs.sources.choosing import MAX_COMPONENTS
    from tensorfs.sources.local import find_pipeline

    root = tmp_path / "root"
    root.mkdir()
    (root / "model_index.json").write_text("{}")
    for k in range(MAX_COMPONENTS):
        (root / f"a{k:04d}").mkdir()
    (root / "unet").mkdir()
    write_reference(root / "unet" / "diffusion_pytorch_model.safetensors", {"w": ("U8", [4], bytes(4))})
    assert find_pipeline(root) == ([], False)
    shutil.rmtree(root / "a0000")
    assert find_pipeline(root) == (["unet"], False)


def test_a_pipelines_components_are_named_as_their_own_loaders_look_for_them(tmp_path: Path) -> None:
    """A transformers component (text_encoder/model.safetensors) beside a diffusers one: each is found
    by its loader's rules and its view's files named as its loader looks for them; a pipeline takes no
    fallback (said in one line)."""
    from tensorfs.opening.source import Source
    from tensorfs.opening.view_files import ViewRequest, view_of
    from tensorfs.views import build_view

    root = tmp_path / "root"
    for folder, name in {"text_encoder": "model", "unet": "diffusion_pytorch_model"}.items():
        (root / folder).mkdir(parents=True)
        (root / folder / "config.json").write_text("{}")
        write_reference(root / folder / f"{name}.safetensors", {"w": ("U8", [4], folder.encode()[:4])})
    (root / "model_index.json").write_text("{}")
    source = Source.named(root)
    with source.open() as model:
        assert model.names() == ["text_encoder/w", "unet/w"]
        for request in (ViewRequest(), ViewRequest("merged")):  # the folder as it is, and synthesized
            spec, others = view_of(source, model, request)
            view = build_view(model, model.gate, spec)
            assert (sorted(view.files), others.models) == (
                sorted([
                    "model_index.json", "text_encoder/config.json", "text_encoder/model.safetensors",
                    "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
                    *(["tensorfs-view.json"] if request.choice else []),
                ]),
                [],
            )  # fmt: skip
            view.close()
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(root, fallback=[tmp_path / "elsewhere"])
    assert str(raised.value) == f"{root}: a pipeline takes no fallback: name a component's folder"


def test_a_stable_diffusion_pipeline_with_its_text_encoder_and_tokenizer_loads_from_a_mount(
    stable_diffusion: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """A Stable Diffusion pipeline's root (unet/ and vae/ diffusers' models, text_encoder/ a transformers
    model, tokenizer/ and scheduler/ files only): its view and its export hold every file of the folder
    (text_encoder/model.safetensors, tokenizer/'s files byte for byte), and StableDiffusionPipeline loads
    from each the same weights of the unet, the vae and the text encoder, the same token ids of the
    prompt, and makes the same image of it, bit for bit, as from the original folder."""
    assert view_files(stable_diffusion) == STABLE_DIFFUSION_VIEW
    mountpoint = mounts.mount(stable_diffusion)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "text_encoder", "unet", "vae"]
    view = mountpoint / ".tensorfs" / "model"
    exported = mounts.run("export", str(stable_diffusion), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    for folder in (view, tmp_path / "exported"):
        assert view_files(folder) == STABLE_DIFFUSION_VIEW
        for name in STABLE_DIFFUSION_VIEW:
            if not name.endswith(".safetensors"):
                assert (folder / name).read_bytes() == (stable_diffusion / name).read_bytes(), name
    original, mounted, written = stable_diffusions(stable_diffusion, view, tmp_path / "exported")
    assert mounted == original and written == original
    found = original[0]
    assert isinstance(found, dict) and {name.partition("/")[0] for name in found} == {"text_encoder", "unet", "vae"}


def test_a_stable_diffusion_pipelines_variant_loads_from_its_view_and_export(
    sd_variants: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """Most diffusion models are loaded as their fp16 variant: StableDiffusionPipeline.from_pretrained
    (view, variant="fp16") loads from the mount's view and from the export the weights it loads from
    the original folder (and without variant=, the plain ones), and so does
    UNet2DConditionModel.from_pretrained(view/unet, variant="fp16"); every file of both is the source's."""
    view = mounts.mount(sd_variants) / ".tensorfs" / "model"
    exported = mounts.run("export", str(sd_variants), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    for folder in (view, tmp_path / "exported"):
        assert view_files(folder) == view_files(sd_variants)
        same_files(folder, sd_variants)
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in view_files(view)
    folders = [str(sd_variants), str(view), str(tmp_path / "exported")]
    variant, mounted, written = variant_weights(*folders, variant="fp16")
    plain, mounted_plain, written_plain = variant_weights(*folders, variant="")
    assert mounted == variant and written == variant and "weights" in variant
    assert mounted_plain == plain and written_plain == plain and plain != variant
    unets = diffusers("load", *(f"cunet@fp16:{folder}/unet" for folder in folders))
    assert [found["weights"] for found in unets[1:]] == [unets[0]["weights"]] * 2


def test_a_pipeline_of_variants_alone_behaves_as_the_original(
    sd_variants: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """A pipeline whose components hold only their fp16 variant: from_pretrained(variant="fp16") loads
    the same weights from the view as from the original, and from_pretrained without variant= fails
    on both alike (the files keep their names: the view never passes one for the other)."""
    only = tmp_path / "sd-fp16"
    shutil.copytree(sd_variants, only)
    for plain in [path for path in only.rglob("*.safetensors") if ".fp16." not in path.name]:
        plain.unlink()
    view = mounts.mount(only) / ".tensorfs" / "model"
    assert view_files(view) == view_files(only)
    same_files(view, only)
    original, mounted = variant_weights(str(only), str(view), variant="fp16")
    assert mounted == original and "weights" in original
    original_plain, mounted_plain = variant_weights(str(only), str(view), variant="")
    assert "error" in original_plain and mounted_plain["error"] == original_plain["error"]


def test_a_lora_is_served_under_its_own_name(sd_variants: Path, mounts: Mounts, tmp_path: Path) -> None:
    """A LoRA in a folder of its own is served as pytorch_lora_weights.safetensors, as diffusers saved
    it: load_lora_weights(view, weight_name=that name) (and without weight_name) puts the same weights
    on the pipeline, and makes the same image, as from the original folder; the export too."""
    lora = write_lora(sd_variants, tmp_path / "lora")
    view = mounts.mount(lora.parent) / ".tensorfs" / "model"
    assert os.listdir(view) == [lora.name] and (view / lora.name).read_bytes() == lora.read_bytes()
    exported = mounts.run("export", str(lora.parent), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert os.listdir(tmp_path / "exported") == [lora.name]
    loads = [(folder, name) for folder in (lora.parent, view, tmp_path / "exported") for name in (lora.name, "")]
    original, *served = with_lora(sd_variants, *loads)
    assert served == [original] * 5
    base = stable_diffusions(sd_variants)[0]
    assert base[2] != original[1]  # the LoRA changes the image: it was put on


def test_a_stable_diffusion_repository_with_single_file_checkpoints_is_served_whole(
    sd_variants: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """Issue 55: a Stable Diffusion 1.5-style repository, a pipeline (with fp16 variants) and two
    single-file checkpoints of the same tensor names at its root, was refused by every command ("the
    files of two models?"). Now each model has a folder of the tree (the components', and one per
    checkpoint), the view and the export are the folder byte for byte, and StableDiffusionPipeline
    loads from each, with and without variant="fp16", what it loads from the original."""
    repository = tmp_path / "sd15"
    shutil.copytree(sd_variants, repository)
    shutil.copy(repository / "unet" / "diffusion_pytorch_model.safetensors", repository / "v1-5-pruned.safetensors")
    emaonly = repository / "v1-5-pruned-emaonly.safetensors"
    shutil.copy(repository / "unet" / "diffusion_pytorch_model.fp16.safetensors", emaonly)
    validated = cli("validate", str(repository))
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout.startswith(
        f"{repository}: valid: 5 models (text_encoder/, unet/, vae/, v1-5-pruned-emaonly/, v1-5-pruned/), "
    ), validated.stdout
    mountpoint = mounts.mount(repository)
    assert sorted(os.listdir(mountpoint)) == [
        ".tensorfs", "text_encoder", "unet", "v1-5-pruned", "v1-5-pruned-emaonly", "vae"
    ]  # fmt: skip
    unet = {path.name for path in (mountpoint / "unet").iterdir()}
    assert {path.name for path in (mountpoint / "v1-5-pruned").iterdir()} == unet  # the same names, apart
    with safe_open(emaonly, "numpy") as reference:
        name = next(iter(reference.keys()))
        assert (mountpoint / "v1-5-pruned-emaonly" / name).read_bytes() == reference.get_tensor(name).tobytes()
    view = mountpoint / ".tensorfs" / "model"
    exported = mounts.run("export", str(repository), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    for folder in (view, tmp_path / "exported"):
        assert view_files(folder) == view_files(repository)
        same_files(folder, repository)
    folders = [str(repository), str(view), str(tmp_path / "exported")]
    variant, mounted, written = variant_weights(*folders, variant="fp16")
    plain, mounted_plain, written_plain = variant_weights(*folders, variant="")
    assert mounted == variant and written == variant and "weights" in variant
    assert mounted_plain == plain and written_plain == plain and plain != variant
    with pytest.raises(tensorfs.InvalidModelError, match="name the one to open"):  # the library: one model
        tensorfs.open_model(repository)


def test_a_stable_diffusion_repository_in_s3_is_served_whole(
    sd_variants: Path,
    mounts: Mounts,
    seaweedfs: SeaweedFS,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Stable Diffusion 1.5-style repository under an S3 prefix: its root's two checkpoints were
    all a mount served (the root was several models, so never asked whether it was a pipeline too);
    it is served as the local one is, each component and each checkpoint a folder of the tree, its
    view the repository byte for byte."""
    repository = tmp_path / "sd15"
    shutil.copytree(sd_variants, repository)
    shutil.copy(repository / "unet" / "diffusion_pytorch_model.safetensors", repository / "v1-5-pruned.safetensors")
    shutil.copy(
        repository / "unet" / "diffusion_pytorch_model.fp16.safetensors", repository / "v1-5-pruned-emaonly.safetensors"
    )
    store = seaweedfs.store(bucket)
    for path in sorted(repository.rglob("*")):
        if path.is_file():
            obstore.put(store, f"sd15/{path.relative_to(repository).as_posix()}", path.read_bytes())
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    source = f"s3://{bucket}/sd15"
    mountpoint = mounts.mount(source, "--cache-dir", str(tmp_path / "cache"), "--endpoint-url", seaweedfs.endpoint)
    assert sorted(os.listdir(mountpoint)) == [
        ".tensorfs", "text_encoder", "unet", "v1-5-pruned", "v1-5-pruned-emaonly", "vae"
    ]  # fmt: skip
    view = mountpoint / ".tensorfs" / "model"
    assert view_files(view) == view_files(repository)
    same_files(view, repository)


def test_loras_of_the_same_names_are_each_loaded_by_their_weight_name(
    sd_variants: Path, mounts: Mounts, tmp_path: Path
) -> None:
    """Issue 55: a folder of two LoRAs of the same tensor names was refused ("tensor 'x' is also in
    shard y"). Each is a model of its own in the tree, and load_lora_weights(view or export,
    weight_name=each) puts on the pipeline the weights it puts from the original folder."""
    lora = write_lora(sd_variants, tmp_path / "lora")
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(lora, loras / "style-a.safetensors")
    with safe_open(lora, "numpy") as reference:
        names = reference.keys()  # (a safe_open is no mapping: not iterable)
        doubled = {name: reference.get_tensor(name) * 2 for name in names}
    safetensors.numpy.save_file(doubled, str(loras / "style-b.safetensors"))
    mountpoint = mounts.mount(loras)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "style-a", "style-b"]
    view = mountpoint / ".tensorfs" / "model"
    exported = mounts.run("export", str(loras), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    for folder in (view, tmp_path / "exported"):
        assert view_files(folder) == ["style-a.safetensors", "style-b.safetensors"]
        same_files(folder, loras)
    sides = (loras, view, tmp_path / "exported")
    loads = with_lora(
        sd_variants, *((folder, name) for name in ("style-a.safetensors", "style-b.safetensors") for folder in sides)
    )
    a, b = loads[:3], loads[3:]
    assert a == [a[0]] * 3 and b == [b[0]] * 3 and a[0] != b[0]
