"""The rules of what a view of a model's folder holds (issue 55, item 5), each made to matter: two
variants of the same tensor names each served with their own bytes; a shard lent by a fallback
under its own name; the refusals of a folder view of what cannot be one; a multi-file GGUF beside a
model opened once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf_files import write_gguf

import tensorfs.opening.view_files
from conftest import Mounts
from helpers import MIB, cli, files_of, random_bytes, sharded_model, write_reference
from tensorfs.opening.source import Source
from tensorfs.opening.view_files import view_of


def test_variants_of_the_same_names_are_each_served_with_their_own_bytes(mounts: Mounts, tmp_path: Path) -> None:
    """model.safetensors, its fp16 variant and an EMA copy hold the same tensor names with other bytes:
    each is a model of its own (opening/view_files.py _grouped), never one lent another's bytes."""
    folder = tmp_path / "variants"
    folder.mkdir()
    for seed, name in enumerate(("model.safetensors", "model.fp16.safetensors", "model-ema.safetensors")):
        # A tensor over a request: the mount reads within it as it reads the tensor's own file.
        tensors = {"w": ("U8", [3 * MIB], random_bytes(3 * MIB, seed)), "b": ("U8", [64], random_bytes(64, 9 + seed))}
        write_reference(folder / name, tensors)
    (folder / "config.json").write_text("{}")
    original = files_of(folder)
    done = cli("export", "-q", str(folder), str(tmp_path / "copy"))
    assert done.returncode == 0, done.stderr
    assert files_of(tmp_path / "copy") == original
    view = mounts.mount(folder) / ".tensorfs" / "model"
    assert files_of(view) == original


def test_a_shard_lent_by_a_fallback_stands_under_its_own_name(mounts: Mounts, tmp_path: Path) -> None:
    """A shard missing when the model is opened is lent by the fallback that has it: in the view it is
    the folder's file of that name, never ../copy/..."""
    model, copy = tmp_path / "model", tmp_path / "copy"
    model.mkdir()
    sharded_model(
        model, {"model-00001-of-00002.safetensors": {"a": 4096}, "model-00002-of-00002.safetensors": {"b": 4096}}
    )
    shutil.copytree(model, copy)
    (model / "model-00002-of-00002.safetensors").unlink()
    expected = files_of(copy)
    view = mounts.mount(model, "--fallback", str(copy)) / ".tensorfs" / "model"
    assert files_of(view) == expected


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            ["--view", "folder", "--include", "a*"],
            "--view folder serves a whole model: the view of a selection is synthesized",
        ),
        (["--view", "folder", "--view-shards", "2"], "--view-shards cuts a synthesized file: not with --view folder"),
    ],
    ids=["selection", "view-shards"],
)
def test_a_folder_view_of_what_cannot_be_one_is_refused(
    mounts: Mounts, tmp_path: Path, options: list[str], said: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    sharded_model(model, {"model-00001-of-00002.safetensors": {"a": 64}, "model-00002-of-00002.safetensors": {"b": 64}})
    done = cli("export", *options, str(model), str(tmp_path / "out"))
    assert done.returncode == 1 and done.stderr == f"error: {said}\n", done.stderr
    assert not (tmp_path / "out").exists()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    refused = mounts.attempt(model, *options, mountpoint=mountpoint)
    assert refused.returncode == 1 and refused.stderr == f"error: {said}\n", refused.stderr
    assert not any(mountpoint.iterdir())


def test_a_multi_file_gguf_beside_a_model_is_opened_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part of a multi-file GGUF opens the model of all its parts: the view opens it once, not
    once a part, and serves each part as its own file."""
    folder = tmp_path / "folder"
    folder.mkdir()
    write_reference(folder / "model.safetensors", {"w": ("U8", [64], random_bytes(64, 1))})
    write_gguf(
        folder / "other.gguf", {name: ("F32", [16]) for name in ("blk.0.w", "blk.1.w", "blk.2.w")}, split_max_tensors=1
    )
    parts = sorted(path.name for path in folder.glob("other-*.gguf"))
    assert len(parts) == 3, parts
    opened: list[object] = []
    open_location = tensorfs.opening.view_files.open_location

    def counted(*args: object) -> tensorfs.Model:
        opened.append(args[0])
        return open_location(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tensorfs.opening.view_files, "open_location", counted)
    source = Source.named(folder, caches=False)
    with source.open() as model:
        _, others = view_of(source, model)
        try:
            assert len(others.models) == 1 and len(opened) == 3, opened  # each part tried, one model kept
            assert sorted(others.places) == parts
            assert sorted(shard.name for shard in others.models[0].shards) == parts  # type: ignore[union-attr]
        finally:
            others.close()
