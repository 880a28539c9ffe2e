"""A folder of several models (issue 55): every command serves each model in a folder of the tree of
its own, the view and the export are the folder byte for byte, and the library, which answers for one
model, names the files to choose from. (A Stable Diffusion repository and a folder of LoRAs, loaded
by diffusers: tests/test_diffusers.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gguf_files import gguf_reading, write_gguf

import tensorfs
from conftest import Mounts
from helpers import cli, files_of, hub_api, random_bytes, write_reference
from servers import Nginx

QUANTIZATIONS = ("Q4_K_M", "Q8_0", "F16")


def gguf_repository(folder: Path) -> dict[str, dict[str, bytes]]:
    """A GGUF repository as the Hub holds them: one file per quantization (of the same tensor names),
    a README; each file's tensors' bytes by name, by file."""
    folder.mkdir(parents=True)
    written = {}
    for seed, quantization in enumerate(QUANTIZATIONS):
        tensors = {"token_embd.weight": ("Q8_0", [8, 32]), "blk.0.attn_q.weight": ("F32", [4, 32])}
        written[f"model.{quantization}.gguf"] = write_gguf(
            folder / f"model.{quantization}.gguf", tensors, seed=10 * seed
        )
    (folder / "README.md").write_text("# three quantizations\n")
    return written


def test_a_gguf_repository_of_three_quantizations_is_served_whole(mounts: Mounts, tmp_path: Path) -> None:
    """Was refused ("holds several GGUF files: name the one to open"). Each quantization is a folder of
    the tree holding its tensors' files (the bytes the reference reader reads); .tensorfs/model/ and the
    export are the repository byte for byte; metadata.json says where each model is."""
    written = gguf_repository(tmp_path / "repo")
    validated = cli("validate", "repo", cwd=tmp_path)
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout.startswith("repo: valid: 3 models (model.F16/, model.Q4_K_M/, model.Q8_0/), 3 shards, ")
    mountpoint = mounts.mount("repo", cwd=tmp_path)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "model.F16", "model.Q4_K_M", "model.Q8_0"]
    for file, tensors in written.items():
        folder = mountpoint / file.removesuffix(".gguf")
        reference, _ = gguf_reading(tmp_path / "repo" / file)
        for name, data in tensors.items():
            assert (folder / name).read_bytes() == data == reference[name][4], (file, name)
        meta = json.loads((folder / "token_embd.weight.meta.json").read_text())
        assert meta["name"] == f"{folder.name}/token_embd.weight" and meta["shard"] == file
    assert files_of(mountpoint / ".tensorfs" / "model") == files_of(tmp_path / "repo")
    described = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_text())
    assert described["models"] == {f"model.{q}": [f"model.{q}.gguf"] for q in sorted(QUANTIZATIONS)}
    exported = cli("export", "-q", "repo", "copy", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert files_of(tmp_path / "copy") == files_of(tmp_path / "repo")
    with pytest.raises(tensorfs.InvalidModelError, match=r"holds several GGUF files .*: name the one to open"):
        tensorfs.open_model(tmp_path / "repo")


def test_a_selection_of_a_repository_is_each_models_own_file(tmp_path: Path) -> None:
    """--include picks among every model of the folder; a selection's view gives each model it holds a
    folder of its own, in its own format: a GGUF's tensors in a GGUF (named as in their file), a
    safetensors file's in a safetensors file, beside a GGUF (a folder of both was refused)."""
    written = gguf_repository(tmp_path / "repo")
    write_reference(tmp_path / "repo" / "other.safetensors", {"w": ("U8", [64], random_bytes(64, 3))})
    exported = cli("export", "-q", "--include", "model.Q8_0/*", "--include", "other/*", "repo", "sel", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert sorted(files_of(tmp_path / "sel")) == [
        "README.md", "model.Q8_0/selected.gguf", "other/selected.safetensors", "tensorfs-view.json"
    ]  # fmt: skip
    reference, _ = gguf_reading(tmp_path / "sel" / "model.Q8_0" / "selected.gguf")
    assert {name: found[4] for name, found in reference.items()} == written["model.Q8_0.gguf"]
    with tensorfs.safe_open(tmp_path / "sel" / "other" / "selected.safetensors", "numpy") as other:
        assert other.get_tensor("w").tobytes() == random_bytes(64, 3)


def test_checkpoints_of_the_same_names_are_each_a_model(mounts: Mounts, tmp_path: Path) -> None:
    """Two checkpoints side by side (an EMA copy, a second LoRA) share their tensors' names: each is a
    model of its own ("tensor 'x' is also in shard y" before); shards of one model without an index,
    whose names are their own, stay one model beside them."""
    folder = tmp_path / "folder"
    folder.mkdir()
    for seed, name in enumerate(("pruned.safetensors", "pruned-emaonly.safetensors")):
        write_reference(
            folder / name, {"w": ("U8", [64], random_bytes(64, seed)), "b": ("U8", [8], random_bytes(8, 9))}
        )
    mountpoint = mounts.mount(folder)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "pruned", "pruned-emaonly"]
    assert (mountpoint / "pruned" / "w").read_bytes() == random_bytes(64, 0)
    assert (mountpoint / "pruned-emaonly" / "w").read_bytes() == random_bytes(64, 1)
    assert files_of(mountpoint / ".tensorfs" / "model") == files_of(folder)
    one = tmp_path / "one"
    one.mkdir()
    write_reference(one / "part-1.safetensors", {"a": ("U8", [4], random_bytes(4, 1))})
    write_reference(one / "part-2.safetensors", {"b": ("U8", [4], random_bytes(4, 2))})
    listed = cli("ls", "--json", str(one))
    assert [json.loads(line)["name"] for line in listed.stdout.splitlines()] == ["a", "b"]


@pytest.mark.parametrize(
    ("names", "parts"),
    [
        (["model.fp16.safetensors", "model.v2.safetensors"], [["model.fp16.safetensors"], ["model.v2.safetensors"]]),
        (
            ["model.fp16-00001-of-00002.safetensors", "model.fp16-00002-of-00002.safetensors",
             "model.safetensors.index.fp16.json", "model.v2.safetensors"],
            [["model.fp16-00001-of-00002.safetensors", "model.fp16-00002-of-00002.safetensors"],
             ["model.v2.safetensors"]],
        ),
        (
            ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "other.gguf"],
            [["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"], ["other.gguf"]],
        ),
        (["a.safetensors", "b.gguf", "c.safetensors"], [["a.safetensors", "c.safetensors"], ["b.gguf"]]),
        (["a.pt", "b.pt", "optimizer.pt"], [["a.pt"], ["b.pt"]]),
    ],
)  # fmt: skip
def test_the_models_of_a_folder_by_their_names(names: list[str], parts: list[list[str]]) -> None:
    """What the folder's names say its models are (each one's files): what no loader's name chooses
    among. Files of one model's safetensors stay together, to be told apart by their tensors' names."""
    from tensorfs.sources.choosing import choose

    chosen = choose(names, "d")
    assert [list(part) for part in chosen.parts] == parts
    assert chosen.problem is not None and "name the one to open" in chosen.problem


def test_a_gguf_repository_on_the_hub_is_served_whole(nginx: Nginx, tmp_path: Path) -> None:
    """The same repository as a Hub repository (its API lists it): the commands serve every model of
    it, each under its folder, through the cache; the export is the repository byte for byte."""
    files = nginx.root / "quantized" / "tiny" / "resolve" / "main"
    written = gguf_repository(files)
    hub_api(nginx.root, "quantized/tiny", files)
    env = {**os.environ, "HF_ENDPOINT": nginx.url, "HF_HOME": str(tmp_path / "hf")}
    cache = ["--cache-dir", str(tmp_path / "cache")]
    listed = cli("ls", "--json", *cache, "hf://quantized/tiny", env=env)
    assert listed.returncode == 0, listed.stderr
    names = sorted(json.loads(line)["name"] for line in listed.stdout.splitlines())
    assert names == sorted(
        f"{file.removesuffix('.gguf')}/{name}" for file, tensors in written.items() for name in tensors
    )
    exported = cli("export", "-q", *cache, "hf://quantized/tiny", str(tmp_path / "copy"), env=env)
    assert exported.returncode == 0, exported.stderr
    assert files_of(tmp_path / "copy") == files_of(files)


def test_a_model_named_as_the_mounts_own_folder_is_named_by_its_file(mounts: Mounts, tmp_path: Path) -> None:
    """A model's folder is named after its file: `.tensorfs.safetensors` beside another model of the
    same names would have been `.tensorfs/`, the mount's own folder (validate said so, valid). It is
    named by its whole file name instead, and .tensorfs/ stays the mount's."""
    folder = tmp_path / "folder"
    folder.mkdir()
    for seed, name in enumerate(("a.safetensors", ".tensorfs.safetensors")):
        write_reference(folder / name, {"w": ("U8", [4], random_bytes(4, seed))})
    validated = cli("validate", str(folder))
    assert validated.stdout.startswith(f"{folder}: valid: 2 models (.tensorfs.safetensors/, a/), "), validated
    mountpoint = mounts.mount(folder)
    assert (mountpoint / ".tensorfs.safetensors" / "w").read_bytes() == random_bytes(4, 1)
    assert (mountpoint / "a" / "w").read_bytes() == random_bytes(4, 0)
    assert (mountpoint / ".tensorfs" / "daemon.json").is_file()


def test_a_selections_view_serves_no_weights_of_a_component_of_several(tmp_path: Path) -> None:
    """A pipeline whose unet/ holds two variants and no default: a selection of its vae alone is
    synthesized, and serves none of unet's variants beside it (a loader would take them for the
    selection's), as it serves no weights of a component of one model."""
    pipeline = tmp_path / "pipeline"
    (pipeline / "unet").mkdir(parents=True)
    (pipeline / "vae").mkdir()
    (pipeline / "model_index.json").write_text("{}")
    (pipeline / "unet" / "config.json").write_text("{}")
    for seed, variant in enumerate(("fp16", "v2")):
        write_reference(
            pipeline / "unet" / f"diffusion_pytorch_model.{variant}.safetensors",
            {"w": ("U8", [4], random_bytes(4, seed))},
        )
    write_reference(pipeline / "vae" / "diffusion_pytorch_model.safetensors", {"d": ("U8", [4], random_bytes(4, 3))})
    exported = cli("export", "-q", "--include", "vae/*", "pipeline", "selected", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert sorted(files_of(tmp_path / "selected")) == [
        "model_index.json", "tensorfs-view.json", "unet/config.json", "vae/selected.safetensors"
    ]  # fmt: skip


def test_a_folder_of_two_formats_says_each_files_format(mounts: Mounts, tmp_path: Path) -> None:
    """A safetensors checkpoint beside a GGUF quantization of it (neither named as loaders name a
    model's): two models, each in its folder;
    metadata.json's "format" was the first file's ("gguf") for both, and is now "mixed", with each
    file's format beside it."""
    folder = tmp_path / "repo"
    folder.mkdir()
    write_reference(folder / "checkpoint.safetensors", {"w": ("U8", [16], random_bytes(16, 1))})
    write_gguf(folder / "model.Q8_0.gguf", {"token_embd.weight": ("Q8_0", [8, 32])}, seed=3)
    mountpoint = mounts.mount("repo", cwd=tmp_path)
    assert sorted(os.listdir(mountpoint)) == [".tensorfs", "checkpoint", "model.Q8_0"]
    assert (mountpoint / "checkpoint" / "w").read_bytes() == random_bytes(16, 1)
    described = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_text())
    assert (described["format"], described["formats"]) == (
        "mixed", {"model.Q8_0.gguf": "gguf", "checkpoint.safetensors": "safetensors"}
    )  # fmt: skip
    assert described["models"] == {"checkpoint": ["checkpoint.safetensors"], "model.Q8_0": ["model.Q8_0.gguf"]}
