"""Which files of a directory are the model: the one transformers loads from it, for a local directory,
an S3 prefix and a Hub repository alike, or a refusal in one line that names the files where a loader
would have to be told which (sources/choosing.py).

The models are written by transformers itself (a tiny Llama, random weights) and what it loads is
compared, tensor by tensor, with what tensorfs serves; nothing is downloaded from a hub: nginx serves
the Hub's files and its listing API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_files import write_gguf

import tensorfs
from conftest import Mounts
from helpers import CONSUMERS, hub_api, patience, upload
from servers import Nginx, SeaweedFS
from tensorfs.sources.choosing import Choice, choose
from tensorfs.sources.store import RemoteOptions

# Writes a tiny Llama (save_pretrained, with the keyword arguments given as JSON), or says what
# from_pretrained loads from a directory (with a variant): each tensor's SHA-256 as float32 (which
# holds float16 exactly: a loader casts to the dtype config.json says).
TRANSFORMERS = """
import hashlib, json, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
command, directory = sys.argv[1], sys.argv[2]
if command == "write":
    torch.manual_seed(int(sys.argv[3]))
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config)
    how = json.loads(sys.argv[4])
    if how.pop("half", False):
        model = model.half()
    model.save_pretrained(directory, **how)
else:
    model = AutoModelForCausalLM.from_pretrained(directory, variant=sys.argv[3] or None)
    digests = {name: hashlib.sha256(tensor.float().numpy().tobytes()).hexdigest()
               for name, tensor in model.state_dict().items()}
    print(json.dumps(digests))
"""


def transformers(command: str, directory: Path, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = CONSUMERS.run(TRANSFORMERS, command, directory, *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def write(directory: Path, seed: int, **how: Any) -> None:
    """A tiny Llama saved by transformers (`how`: save_pretrained's keywords; half=True: in float16)."""
    transformers("write", directory, str(seed), json.dumps(how))


def loaded(directory: Path, variant: str = "") -> dict[str, str]:
    """What transformers loads from `directory`: each tensor's SHA-256 (as float32)."""
    found: dict[str, str] = json.loads(transformers("load", directory, variant))
    return found


def served(source: str | Path, remote: RemoteOptions | None = None) -> dict[str, str]:
    """What tensorfs serves as the model at `source`: each tensor's SHA-256 (as float32)."""
    with tensorfs.open_model(source, remote=remote) as model:
        return {name: hashlib.sha256(model.tensor(name, "pt").float().numpy().tobytes()).hexdigest() for name in model}


def raw(source: str, remote: RemoteOptions) -> dict[str, bytes]:
    with tensorfs.open_model(source, remote=remote) as model:
        return {name: bytes(model.raw(name)) for name in model}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as a stale conversion leaves one: model.safetensors (seed 0), the shards and
    index of another model beside it (seed 1), and a float16 variant of the first."""
    made = tmp_path_factory.mktemp("folder")
    model, stale, half = made / "model", made / "stale", made / "half"
    write(model, 0)
    write(stale, 1, max_shard_size="20KB")
    for path in stale.glob("model*"):
        shutil.copy(path, model)
    write(half, 0, variant="fp16", half=True)
    shutil.copy(half / "model.fp16.safetensors", model)
    return model


def test_a_directory_is_the_model_transformers_loads_from_it(
    folder: Path, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    """model.safetensors, not the index beside it (nor its variant): in-process, by `validate`, and in
    the mount's view, the model's folder as it is, which transformers loads the same weights from
    (and the same variant, with variant="fp16")."""
    expected = loaded(folder)
    assert expected != loaded(folder.parent / "stale")
    with caplog.at_level(logging.WARNING):
        assert served(folder) == expected
    assert "model.safetensors is the model, as transformers and accelerate load it" in caplog.text
    assert "model.safetensors.index.json beside it is not" in caplog.text
    validated = subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", "validate", str(folder)],
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert validated.returncode == 0 and "1 shard" in validated.stdout, validated.stdout + validated.stderr
    mountpoint = mounts.mount(folder)
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == sorted(os.listdir(folder))  # every file, the stale ones too
    assert all((view / name).read_bytes() == (folder / name).read_bytes() for name in os.listdir(folder))
    assert loaded(view) == expected
    assert loaded(view, "fp16") == loaded(folder, "fp16")
    # Naming a file chooses it, as variant= or naming the index tells a loader.
    assert served(folder / "model.fp16.safetensors") == loaded(folder, "fp16")
    assert served(folder / "model.safetensors.index.json") == loaded(folder.parent / "stale")


def test_a_variant_alone_is_the_model_and_several_are_refused_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write(model, 0, variant="fp16", half=True)
    assert served(model) == loaded(model, "fp16")
    write(model, 1, variant="v2")
    with pytest.raises(tensorfs.InvalidModelError) as raised:
        tensorfs.open_model(model)
    message = str(raised.value)
    assert message == (
        f"{model}: holds the files of several models (variants) (model.fp16.safetensors, model.v2.safetensors): "
        "name the one to open (its file, or its index)"
    )


def test_a_remote_directory_is_the_model_transformers_loads_from_it(
    folder: Path,
    seaweedfs: SeaweedFS,
    bucket: str,
    nginx: Nginx,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3 prefix and a Hub repository holding the stale folder: their listings say what is there,
    and the same rules choose model.safetensors."""
    expected = loaded(folder)
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    upload(seaweedfs.store(bucket), "stale", folder)
    remote = RemoteOptions(cache_dir=tmp_path / "cache", endpoint_url=seaweedfs.endpoint)
    assert served(f"s3://{bucket}/stale", remote) == expected
    hub = nginx.root / "choosing" / "stale" / "resolve" / "main"
    shutil.copytree(folder, hub)
    hub_api(nginx.root, "choosing/stale", hub)
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    remote = RemoteOptions(cache_dir=tmp_path / "cache")
    assert served("hf://choosing/stale", remote) == expected
    shutil.rmtree(nginx.root / "api" / "models" / "choosing")  # a mirror without the API: the names loaders ask for
    assert served("hf://choosing/stale", remote) == expected


def test_the_hub_says_what_a_repository_holds(nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repository of a PyTorch checkpoint or a GGUF is opened; one of several GGUFs, one without
    weights, a wrong repository and a wrong revision are refused in one line that says which."""
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    remote = RemoteOptions(cache_dir=tmp_path / "cache")
    repositories = {name: nginx.root / "holds" / name / "resolve" / "main" for name in ("bin", "gguf", "ggufs", "none")}
    for files in repositories.values():
        files.mkdir(parents=True)
        (files / "config.json").write_text("{}")
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    torch.save(weights, repositories["bin"] / "pytorch_model.bin")
    write_gguf(repositories["gguf"] / "tiny-Q8_0.gguf", {"w": ("Q8_0", [32])})
    write_gguf(repositories["ggufs"] / "tiny-Q4_0.gguf", {"w": ("Q4_0", [32])})
    write_gguf(repositories["ggufs"] / "tiny-Q8_0.gguf", {"w": ("Q8_0", [32])})
    for name, files in repositories.items():
        hub_api(nginx.root, f"holds/{name}", files)
    assert raw("hf://holds/bin", remote) == {"w": weights["w"].numpy().tobytes()}
    assert list(raw("hf://holds/gguf", remote)) == ["w"]
    refusals = {
        "hf://holds/ggufs": "hf://holds/ggufs@main: holds several GGUF files (tiny-Q4_0.gguf, tiny-Q8_0.gguf): "
        "name the one to open (its file, or its index)",
        "hf://holds/none": "hf://holds/none@main: no .safetensors, .gguf, .bin, .pt or .pth files in this directory "
        "(it holds config.json)",
        "hf://holds/nothing": f"hf://holds/nothing@main: no repository holds/nothing on {nginx.url} "
        "(a private or gated one needs a token: HF_TOKEN)",
        "hf://holds/bin@v2": "hf://holds/bin@v2: holds/bin has no revision v2 (a branch, a tag or a commit)",
    }
    for source, said in refusals.items():
        with pytest.raises(tensorfs.InvalidModelError) as raised:
            tensorfs.open_model(source, remote=remote)
        assert str(raised.value) == said


@pytest.mark.parametrize(
    ("names", "files", "index"),
    [
        (
            ["model.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors"],
            ["model.safetensors"],
            None,
        ),
        (
            ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin"],
            [],
            "model.safetensors.index.json",
        ),
        (
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "pytorch_model.bin"],
            ["pytorch_model.bin"],
            None,
        ),
        (["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"], [], "pytorch_model.bin.index.json"),
        (["adapter_model.safetensors", "config.json", "model.safetensors"], ["model.safetensors"], None),
        (
            ["adapter_config.json", "adapter_model.bin", "adapter_model.safetensors"],
            ["adapter_model.safetensors"],
            None,
        ),
        (["adapter_model.safetensors", "pytorch_model.bin"], ["pytorch_model.bin"], None),
        (["model.fp16.safetensors", "model.safetensors"], ["model.safetensors"], None),
        (["model.fp16.safetensors", "optimizer.pt"], ["model.fp16.safetensors"], None),
        (
            [
                "model.fp16-00001-of-00002.safetensors",
                "model.fp16-00002-of-00002.safetensors",
                "model.safetensors.index.fp16.json",
            ],
            [],
            "model.safetensors.index.fp16.json",
        ),
        (
            ["model.fp16-00001-of-00002.safetensors", "model.fp16-00002-of-00002.safetensors"],
            ["model.fp16-00001-of-00002.safetensors", "model.fp16-00002-of-00002.safetensors"],
            None,
        ),
        (["a.safetensors", "b.safetensors", "b.safetensors.index.json"], ["a.safetensors", "b.safetensors"], None),
        (
            [
                "selected-00001-of-00002.safetensors",
                "selected-00002-of-00002.safetensors",
                "selected.safetensors.index.partial.json",
            ],
            ["selected-00001-of-00002.safetensors", "selected-00002-of-00002.safetensors"],
            None,
        ),
        (["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"], ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"], None),
        (["a.gguf", "optimizer.pt"], ["a.gguf"], None),
        (["model.pt", "optimizer.pt", "training_args.bin"], ["model.pt"], None),
    ],
)
def test_the_rules_over_names(names: list[str], files: list[str], index: str | None) -> None:
    assert choose(names, "d") == Choice(tuple(files), index)


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        (
            ["model.bf16.safetensors", "model.fp16.safetensors"],
            "holds the files of several models (variants) (model.bf16.safetensors, model.fp16.safetensors): ",
        ),
        (
            ["model.fp16.safetensors", "weights.safetensors"],
            "holds the files of several models (variants) (model.fp16.safetensors, weights.safetensors): ",
        ),
        (["a.safetensors", "b.gguf"], "holds safetensors and GGUF files (a.safetensors, b.gguf): "),
        (
            ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "other.gguf"],
            "holds several GGUF files (m-00001-of-00002.gguf, m-00002-of-00002.gguf, other.gguf): ",
        ),
        (["a.pt", "b.pt"], "holds several PyTorch checkpoints (a.pt, b.pt): name the one to open, or give it an index"),
        (
            ["README.md", "config.json"],
            "no .safetensors, .gguf, .bin, .pt or .pth files in this directory (it holds README.md, config.json)",
        ),
        ([], "no .safetensors, .gguf, .bin, .pt or .pth files in this directory (it is empty)"),
    ],
)
def test_what_a_loader_must_be_told_is_refused(names: list[str], problem: str) -> None:
    chosen = choose(names, "d")
    assert chosen.problem is not None and chosen.problem.startswith(problem) and not (chosen.files or chosen.index)


def test_without_a_listing_the_names_loaders_look_for_are_asked_after_in_their_order() -> None:
    asked: list[str] = []

    def there(*present: str) -> Callable[[str], bool]:
        def exists(name: str) -> bool:
            asked.append(name)
            return name in present

        return exists

    assert choose(None, "d", there("pytorch_model.bin", "model.safetensors.index.json")) == Choice(
        index="model.safetensors.index.json"
    )
    assert asked == ["model.safetensors", "model.safetensors.index.json"]
    assert choose(None, "d", there("pytorch_model.bin")) == Choice(("pytorch_model.bin",))
    # diffusers' names after transformers', in diffusers' order: a component folder's index before its file.
    diffusers = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")
    assert choose(None, "d", there(*diffusers)) == Choice(index="diffusion_pytorch_model.safetensors.index.json")
    assert choose(None, "d", there(diffusers[0])) == Choice((diffusers[0],))
    nothing = choose(None, "d", there())
    assert nothing.problem == (
        "none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json, "
        "diffusion_pytorch_model.safetensors.index.json, diffusion_pytorch_model.safetensors, "
        "diffusion_pytorch_model.bin, diffusion_pytorch_model.bin.index.json is there: name the model's file or index"
    )


def test_a_bucket_one_may_read_and_not_list_is_asked_for_the_names_loaders_look_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3 answers 403 to a listing, and to a GET of a missing key, for whoever may read a bucket's
    objects and not list it: the names loaders look for are asked after, a 403 taken for none."""
    from tensorfs.errors import AccessDenied
    from tensorfs.sources import finding

    present = {"models/m/model.safetensors.index.json"}
    asked: list[str] = []

    def listing(spec: object, prefix: str) -> tuple[list[object], bool]:
        raise AccessDenied(f"s3://b/{prefix}: access denied (403)")

    def exists(ref: Any) -> bool:
        asked.append(ref.key)
        if ref.key not in present:
            raise AccessDenied(f"{ref.url}: access denied (403)")
        return True

    monkeypatch.setattr(finding, "list_objects", listing)
    monkeypatch.setattr(finding, "exists", exists)
    monkeypatch.setattr(finding, "_from_index", lambda index, problems: finding.Located([], None, index.url))
    problems: list[tensorfs.Problem] = []
    located = finding.locate("s3://b/models/m", RemoteOptions(), problems)
    assert (located.index_label, problems) == ("s3://b/models/m/model.safetensors.index.json", [])
    assert asked == ["models/m/model.safetensors", "models/m/model.safetensors.index.json"]
    present.clear()
    assert finding.locate("s3://b/models/m", RemoteOptions(), problems).shards == []
    assert [str(problem) for problem in problems] == ["s3://b/models/m/: access denied (403)"]
