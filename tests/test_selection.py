"""Subsets of a model: --include/--exclude globs and --layers A-B, in the library, the commands and a mount."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tensorfs
from conftest import Mounts
from helpers import random_bytes, write_index, write_reference
from tensorfs.errors import InvalidModelError
from tensorfs.selection import Selection, parse_layers


def hf_model(directory: Path, layers: int = 4) -> dict[str, bytes]:
    """A transformers-style model in two shards with an index: embeddings, `layers` layers, norm and head."""
    directory.mkdir(parents=True)
    first = {"model.embed_tokens.weight": ("F32", [4, 2], random_bytes(32, 1))}
    second = {
        "model.norm.weight": ("F32", [2], random_bytes(8, 2)),
        "lm_head.weight": ("F16", [4, 2], random_bytes(16, 3)),
    }
    for n in range(layers):
        shard = first if n < layers // 2 else second
        shard[f"model.layers.{n}.self_attn.q_proj.weight"] = ("BF16", [2, 2], random_bytes(8, 10 + n))
        shard[f"model.layers.{n}.mlp.up_proj.weight"] = ("BF16", [2, 3], random_bytes(12, 20 + n))
    weight_map = {}
    for i, tensors in enumerate((first, second), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        write_reference(directory / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    write_index(directory, weight_map)
    return {name: data for tensors in (first, second) for name, (_, _, data) in tensors.items()}


NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.12.self_attn.q_proj.weight",
    "model.layers.16.self_attn.q_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
    "transformer/h/layers/3/w",
]


def test_globs_and_layers_in_order_includes_layers_excludes() -> None:
    assert Selection().select(NAMES) == NAMES and Selection().everything
    assert Selection(include=("model.layers.1?.*", "lm_head.*")).select(NAMES) == [
        "model.layers.12.self_attn.q_proj.weight",
        "model.layers.16.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    assert Selection(layers=(0, 12)).select(NAMES) == [n for n in NAMES if "16" not in n]
    assert Selection(layers=(1, 3)).select(NAMES) == [
        "model.embed_tokens.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "transformer/h/layers/3/w",
    ]
    assert Selection(exclude=("*.mlp.*", "lm_head.*"), layers=(0, 1)).select(NAMES) == [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    assert Selection(include=("Model.*",)).select(NAMES) == []  # case counts
    assert Selection(include=("model.*",), exclude=("*",)).select(NAMES) == []


def test_layers_as_models_name_them() -> None:
    names = ["transformer.h.3.attn.w", "encoder.layer.3.output.w", "blocks.3.w", "model.layers.4.w", "wte.w"]
    assert Selection(layers=(3, 3)).select(names) == [*names[:3], "wte.w"]  # GPT-2, BERT, blocks


def test_a_selection_takes_what_a_caller_means() -> None:
    assert Selection(include="model.norm.*").select(NAMES) == ["model.norm.weight"]  # one glob, not its letters
    assert Selection(exclude="lm_head.weight").select(NAMES) == NAMES[:-2] + NAMES[-1:]
    assert Selection(include=None, layers="1-2") == Selection(layers=(1, 2)) == Selection(layers=[1, 2])
    assert Selection(layers=3).layers == (3, 3)
    for bad in [(1, 2, 3), (1.5, 2), "x", (True, 2)]:
        with pytest.raises((TypeError, ValueError)):
            Selection(layers=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Selection(include=[1])  # type: ignore[list-item]


@pytest.mark.parametrize(("text", "expected"), [("0-15", (0, 15)), ("7", (7, 7)), (" 2 - 3 ", (2, 3))])
def test_layer_ranges(text: str, expected: tuple[int, int]) -> None:
    assert parse_layers(text) == expected


@pytest.mark.parametrize("text", ["5-2", "a-b", "-1", "1-", "", "1-2-3"])
def test_layer_ranges_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_layers(text)


def test_open_model_with_a_selection(tmp_path: Path) -> None:
    expected = hf_model(tmp_path / "m")
    with tensorfs.open_model(tmp_path / "m", layers=(0, 0), exclude=["lm_head.*"]) as model:
        names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
        names += ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
        assert model.names() == sorted(names)
        assert model.nbytes == sum(len(expected[name]) for name in names)
        assert all(model.raw(name).tobytes() == expected[name] for name in names)
        assert model.selection == Selection(exclude=("lm_head.*",), layers=(0, 0))
    with tensorfs.open_model(tmp_path / "m", include=["model.layers.0.*"]) as model:
        assert [p.name for p in model.shards] == ["model-00001-of-00002.safetensors"]  # the other is not kept


def test_select_from_an_open_model(tmp_path: Path) -> None:
    expected = hf_model(tmp_path / "m")
    with tensorfs.open_model(tmp_path / "m") as model:
        stage = model.select(Selection(layers=(2, 3), exclude=("model.embed_tokens.*",)))
        assert "model.layers.1.mlp.up_proj.weight" not in stage and "lm_head.weight" in stage
        assert stage.array("lm_head.weight").tobytes() == expected["lm_head.weight"]
        stage.close()  # the parent's mappings stay
        assert model.raw("lm_head.weight").tobytes() == expected["lm_head.weight"]
        again = model.select(Selection(include=("lm_head.*",)))
    with pytest.raises(tensorfs.ModelClosedError):
        again.raw("lm_head.weight")  # closed with its parent


def test_a_selection_never_hides_a_broken_shard(tmp_path: Path) -> None:
    hf_model(tmp_path / "m")
    shard = tmp_path / "m" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path / "m", include=["model.layers.0.*"])
    assert "model-00002-of-00002.safetensors" in str(caught.value)


def test_a_selection_of_nothing_is_refused(mounts: Mounts, tmp_path: Path) -> None:
    hf_model(tmp_path / "m")
    with pytest.raises(InvalidModelError, match=r"no tensor matches the selection \(--include 'x\.\*'\)"):
        tensorfs.open_model(tmp_path / "m", include=["x.*"])
    for command in ("validate", "ls", "manifest", "verify"):
        result = mounts.run(command, "--include", "x.*", str(tmp_path / "m"))
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "no tensor matches the selection (--include 'x.*')" in result.stderr
    spare = tmp_path / "spare"
    spare.mkdir()
    result = mounts.attempt(tmp_path / "m", "--layers", "7-9", "--exclude", "*", mountpoint=spare)
    assert result.returncode == 1 and "no tensor matches the selection" in result.stderr
    assert not os.path.ismount(spare)
    for layers, why in [("40-47", "its layers are 0-3"), ("99999999999999999999", "its layers are 0-3")]:
        result = mounts.run("ls", "--layers", layers, str(tmp_path / "m"))  # only embeddings, norm and head: refused
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert (
            f"--layers {int(layers.split('-')[0])}-{int(layers.split('-')[-1])} selects no layer ({why})"
            in result.stderr
        )
    result = mounts.run("ls", "--layers", "9-7", str(tmp_path / "m"))
    assert (
        result.returncode == 2
        and "Invalid value for '--layers': '9-7': the range ends before it begins" in result.stderr
    )


def test_commands_take_a_selection(mounts: Mounts, tmp_path: Path) -> None:
    hf_model(tmp_path / "m")
    model = str(tmp_path / "m")
    listed = mounts.run("ls", "--json", "--include", "lm_head.*", "--include", "model.norm.*", model)
    assert [json.loads(line)["name"] for line in listed.stdout.splitlines()] == ["lm_head.weight", "model.norm.weight"]
    result = mounts.run("validate", "--layers", "0-1", model)
    assert result.returncode == 0 and result.stdout.endswith(
        ": valid: 2 shards, 7 tensors, 96 B (96 bytes), selected by --layers 0-1\n"
    )
    whole = mounts.run("manifest", "-o", str(tmp_path / "m" / "tensors.sha256"), model)
    assert whole.returncode == 0, whole.stderr
    result = mounts.run("verify", "--layers", "2-3", model)  # the manifest lists the other layers too: fine
    assert result.returncode == 0 and "all 7 tensors match" in result.stdout, result.stderr
    part = mounts.run("manifest", "--exclude", "lm_head.*", model)
    assert part.returncode == 0 and len(part.stdout.splitlines()) == 10 and "lm_head" not in part.stdout


def test_a_mount_shows_only_the_selection(mounts: Mounts, tmp_path: Path) -> None:
    expected = hf_model(tmp_path / "m")
    assert mounts.run("manifest", "-o", str(tmp_path / "m" / "tensors.sha256"), str(tmp_path / "m")).returncode == 0
    mountpoint = mounts.mount(tmp_path / "m", "--layout", "dotted", "--layers", "3-3", "--exclude", "model.embed_*")
    names = ["lm_head.weight", "model.layers.3.mlp.up_proj.weight", "model.layers.3.self_attn.q_proj.weight"]
    names.append("model.norm.weight")
    assert sorted(os.listdir(mountpoint / "model")) == ["layers", "norm"]
    assert os.listdir(mountpoint / "model" / "layers") == ["3"]
    for name in names:
        assert (mountpoint / name.replace(".", "/")).read_bytes() == expected[name]  # verified against the manifest
    index = json.loads((mountpoint / ".tensorfs" / "index.json").read_text())
    assert sorted(index["weight_map"]) == names
    assert index["metadata"]["total_size"] == sum(len(expected[name]) for name in names)
    sums = (mountpoint / ".tensorfs" / "SHA256SUMS").read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in sums) == sorted(name.replace(".", "/") for name in names)
    record = json.loads((mountpoint / ".tensorfs" / "daemon.json").read_text())
    assert record["tensors"] == 4
    assert record["options"]["selection"] == {"include": [], "exclude": ["model.embed_*"], "layers": [3, 3]}
