"""Which files of a model's directory are the model: the loaders' rules, written once for every
source that has a directory (a local one, an S3 prefix, a Hub repository), over the names its
listing gives, or, where nothing lists, the names loaders look for, asked after one by one.

transformers' precedence first (modeling_utils' checkpoint choice, which accelerate's
load_checkpoint_in_model agrees with on these names): model.safetensors; else
model.safetensors.index.json (its shards); else pytorch_model.bin; else pytorch_model.bin.index.json.
Then diffusers' for a component folder of a pipeline (ModelMixin.from_pretrained): its index
diffusion_pytorch_model.safetensors.index.json first (diffusers looks for the index before the
file), else diffusion_pytorch_model.safetensors, else diffusion_pytorch_model.bin, else its index.
What lies beside the file chosen is not the model: a stale index, a variant (model.fp16.safetensors,
diffusion_pytorch_model.fp16.safetensors, loaded only with variant="fp16"), a GGUF (loaded only with
gguf_file=). An adapter (PEFT's adapter_model.safetensors or .bin) is never part of the model: it is
a file that comes with it (in a directory of its own, with no model beside it, it is the model).

A directory holding none of those names is tensorfs's to read: its safetensors files are the shards
of one model (with or without an index); else its GGUF (one, or the parts of one multi-file GGUF);
else its PyTorch checkpoint (formats/pytorch.py says which). Where that would be a guess (the files
of several models: variants with no default, safetensors and GGUF files together, several GGUFs,
several checkpoints), the directory holds several models (Choice.parts: each model's files, by
name): a command opens them all, each in a folder of the mount of its own (opening/repository.py);
the Python API, which answers for one model, is refused in one line naming the files: the user
names the one to open (its file, or its index), as they would tell a loader.

The view of a model (views/) is named as the loader of its folder expects (view_name): model.*
for transformers' names, diffusion_pytorch_model.* for diffusers', adapter_model.* for an adapter.

A diffusers pipeline's root (model_index.json, and no weights of its own) is several models: each
folder of it that holds weights is a component, chosen by these same rules (component); the
others (scheduler/, tokenizer/) hold only files that come with them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import printable
from ..formats import WEIGHT_FILES, gguf, is_weights_name, pytorch
from .index import INDEX_NAME, is_index_name

log = logging.getLogger(__name__)

__all__ = [
    "ADAPTER_NAMES", "DIFFUSERS_NAME", "LOOKED_FOR", "MAX_COMPONENTS", "NO_COMPONENT", "NUMBERED", "PIPELINE_INDEX",
    "Choice", "choose", "component", "is_adapter", "is_model_file", "is_pipeline", "view_name", "weights_beside",
]  # fmt: skip

SAFETENSORS_NAME = "model.safetensors"
TRANSFORMERS_NAMES = (SAFETENSORS_NAME, INDEX_NAME, pytorch.DEFAULT_NAME, pytorch.INDEX_NAME)
"""The names transformers looks for, in its order: the first that is there is the model."""
DIFFUSERS_NAME = "diffusion_pytorch_model"
DIFFUSERS_NAMES = (
    f"{DIFFUSERS_NAME}.safetensors.index.json",
    f"{DIFFUSERS_NAME}.safetensors",
    f"{DIFFUSERS_NAME}.bin",
    f"{DIFFUSERS_NAME}.bin.index.json",
)
"""The names diffusers looks for in a component folder, in its order (the index before the file)."""
LOOKED_FOR = (*TRANSFORMERS_NAMES, *DIFFUSERS_NAMES)
"""What loaders look for, transformers' names first: the first that is there is the model."""
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
"""PEFT's adapter weights: kept beside a base model, loaded onto it, never part of it."""
_VARIANT = re.compile(
    r"(?:diffusion_pytorch_)?model\.(?P<a>[^./]+?)(?:-\d{5}-of-\d{5})?\.safetensors"
    r"|(?:diffusion_pytorch_)?model\.safetensors\.index\.(?P<b>[^./]+)\.json"
    r"|(?:diffusion_)?pytorch_model\.(?P<c>[^./]+?)(?:-\d{5}-of-\d{5})?\.bin"
    r"|(?:diffusion_)?pytorch_model\.bin\.index\.(?P<d>[^./]+)\.json"
)
"""transformers' and diffusers' names of a variant's files (save_pretrained(variant=V)):
model.V.safetensors, its numbered parts model.V-00001-of-00002.safetensors,
model.safetensors.index.V.json, and the same of pytorch_model.bin and of diffusion_pytorch_model."""
MAX_COMPONENTS = 50
"""The most folders of a pipeline's root that are looked into for its components (a walk bounded)."""
PIPELINE_INDEX = "model_index.json"
"""What marks a diffusers pipeline's root (DiffusionPipeline.from_pretrained reads it first)."""
NO_COMPONENT = (
    f"a diffusers pipeline's root ({PIPELINE_INDEX}) none of whose folders holds {WEIGHT_FILES} files: "
    "name a component's folder"
)
"""Why a pipeline's root is no model: no folder of it is a component (or its folders cannot be listed)."""
_DIFFUSERS_FILE = re.compile(r"diffusion_pytorch_model(?:\.[^./]+?)?(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)")
"""diffusers' weight files: diffusion_pytorch_model[.V][-0000k-of-0000n].safetensors (or .bin)."""
_SHOWN = 4  # names a message lists before "..."
NUMBERED = re.compile(r"(?P<prefix>.+)-\d{5}-of-\d{5}(?P<suffix>\.[^./]+)")
"""A numbered file of one model's: NAME-00001-of-00003.EXT."""


@dataclass(frozen=True)
class Choice:
    """What a directory's model is: its files, or the index that names them, or why there is no telling."""

    files: tuple[str, ...] = ()
    """The model's weight files (names in the directory), when no index says which."""
    index: str | None = None
    """The index whose shards are the model."""
    problem: str | None = None
    """Why the directory is not one model (what a Problem of the directory says): the files, how to choose."""
    parts: tuple[tuple[str, ...], ...] = ()
    """Where the directory holds several models and no loader's name says which: each one's files
    (`problem` says so too, for whoever takes one model only)."""


def is_adapter(name: str) -> bool:
    """Whether a file of this name is an adapter's weights (PEFT's), never the model's."""
    return name.rpartition("/")[2] in ADAPTER_NAMES


def is_model_file(name: str) -> bool:
    """Whether a file of a model's directory may be its weights or their index by its name (the
    view makes its own of those: the source's are never served beside them). A `.bin` is by the
    names that make one a model's checkpoint (pytorch_model.bin, its numbered parts); other `.bin`
    files (ONNX external data, a training run's arguments) are not; nor are adapters."""
    if is_adapter(name):
        return False
    if name.endswith(pytorch.SUFFIXES):
        return pytorch.is_model_name(name) or any(rule.fullmatch(name) for rule in (_VARIANT, _DIFFUSERS_FILE))
    weights_index = is_index_name(name) and (".safetensors.index" in name or ".bin.index" in name)
    return is_weights_name(name) or weights_index


def choose(names: Collection[str] | None, where: str, exists: Callable[[str], bool] | None = None) -> Choice:
    """The model of the directory shown as `where` (a path, or a URL ending in '/': for the warning
    that a stale index is passed over), from the names of its files (`names`), or, with no listing
    (None), from `exists(name)` asked of the names loaders look for, in their order."""
    if names is None:
        assert exists is not None
        for name in LOOKED_FOR:
            if exists(name):
                return _chosen(name)
        looked = ", ".join(LOOKED_FOR)
        return Choice(problem=f"none of {looked} is there: name the model's file or index")
    present = set(names)
    for name in LOOKED_FOR:
        if name in present:
            beside = sorted(other for other in present if other != name and is_index_name(other))
            if beside and name == SAFETENSORS_NAME:
                log.warning(
                    "%s: %s is the model, as transformers and accelerate load it; %s beside it %s not "
                    "(name it to open its shards instead)",
                    printable(where), name, ", ".join(map(printable, beside)), "is" if len(beside) == 1 else "are",
                )  # fmt: skip
            return _chosen(name)
    return _by_tensorfs(sorted(present))


def view_name(weights: Collection[str]) -> str:
    """What the synthesized files of a model whose weight files are `weights` (their names) are
    called, as the loader of its folder looks for them: "adapter_model" for an adapter (PEFT's),
    "diffusion_pytorch_model" for diffusers' files (a pipeline's component), else "model"."""
    names = [name.rpartition("/")[2] for name in weights]
    if names and all(map(is_adapter, names)):
        return "adapter_model"
    if names and all(name.startswith((f"{DIFFUSERS_NAME}.", f"{DIFFUSERS_NAME}-")) for name in names):
        return DIFFUSERS_NAME
    return "model"


def is_pipeline(names: Collection[str], *, beside: bool = False) -> bool:
    """Whether a directory holding these names is a diffusers pipeline's root: model_index.json, and
    no weights of its own (its models are in its folders); `beside`: or with weights of its own too
    (a repository's single-file checkpoints beside the pipeline: weights_beside)."""
    return PIPELINE_INDEX in names and (beside or not weights_beside(names))


def weights_beside(names: Collection[str]) -> bool:
    """Whether a directory holding these names holds weights (or their index) of its own."""
    return any(is_weights_name(name) or is_index_name(name) for name in names)


def component(names: Collection[str], where: str) -> Choice | None:
    """The model of a pipeline's folder (as choose() says), or None for a folder without weights (a
    scheduler's, a tokenizer's: its files come with the pipeline)."""
    if not any(is_weights_name(name) or is_index_name(name) for name in names):
        return None
    return choose(names, where)


def _chosen(name: str) -> Choice:
    return Choice(index=name) if is_index_name(name) else Choice(files=(name,))


def _by_tensorfs(names: list[str]) -> Choice:
    """A directory without the names transformers looks for: its own files say what its model is."""
    weights = [name for name in names if is_weights_name(name) and not is_adapter(name)]
    if not weights and set(ADAPTER_NAMES) & set(names):  # an adapter's own directory: it is the model there
        return Choice(files=(next(name for name in ADAPTER_NAMES if name in names),))
    variants: dict[str, list[str]] = {}
    for name in [*weights, *filter(is_index_name, names)]:
        found = _VARIANT.fullmatch(name)
        if found is not None:
            variants.setdefault(next(v for v in found.groups() if v is not None), []).append(name)
    if variants:
        others = [name for name in weights if _VARIANT.fullmatch(name) is None and not name.endswith(pytorch.SUFFIXES)]
        if len(variants) == 1 and not others:
            (variant,) = variants
            for name in LOOKED_FOR:
                stem, _, suffix = name.rpartition(".")
                if f"{stem}.{variant}.{suffix}" in names:
                    return _chosen(f"{stem}.{variant}.{suffix}")
            return Choice(files=tuple(name for name in variants[variant] if not is_index_name(name)))
        held = [min(files) for files in variants.values()] + others
        kept = [[name for name in files if not is_index_name(name)] for files in variants.values()]
        groups = [files for files in kept if files] + _numbered([name for name in weights if name in others])
        return _several("the files of several models (variants)", held, groups)
    safetensors = [name for name in weights if name.endswith(".safetensors")]
    ggufs = [name for name in weights if name.endswith(gguf.SUFFIXES)]
    checkpoints = [name for name in weights if name.endswith(pytorch.SUFFIXES)]
    if safetensors and ggufs:
        groups = [safetensors, *_ggufs(ggufs)]
        return _several("safetensors and GGUF files", [*safetensors, *ggufs], groups)
    if safetensors:
        return Choice(files=tuple(safetensors))
    if ggufs:
        groups = _ggufs(ggufs)
        if len(groups) > 1:
            return _several("several GGUF files", ggufs, groups)
        return Choice(files=tuple(ggufs))
    chosen, ambiguous = pytorch.choose(checkpoints)
    if ambiguous is not None:
        return Choice(problem=ambiguous, parts=tuple(map(tuple, _checkpoints(checkpoints))))
    if not chosen and PIPELINE_INDEX in names:
        return Choice(problem=NO_COMPONENT)
    if not chosen:
        return Choice(problem=f"no {WEIGHT_FILES} files in this directory{_holding(names)}")
    return Choice(files=tuple(chosen))


def _several(what: str, names: list[str], groups: list[list[str]]) -> Choice:
    """A directory of several models: `groups` their files; `names` those a message names."""
    problem = f"holds {what} ({_some(names)}): name the one to open (its file, or its index)"
    return Choice(problem=problem, parts=tuple(tuple(group) for group in groups))


def _ggufs(names: list[str]) -> list[list[str]]:
    """GGUF files as models: the parts of a multi-file GGUF together (all there), each other alone."""
    groups: list[list[str]] = []
    taken: set[str] = set()
    for name in names:
        if name in taken:
            continue
        parts = gguf.split_files(name)
        group = parts if parts is not None and set(parts) <= set(names) else [name]
        taken.update(group)
        groups.append(group)
    return groups


def _checkpoints(names: list[str]) -> list[list[str]]:
    """PyTorch checkpoints as models: the numbered parts of one together, each other alone (but a
    training run's state: not a model's, where there is a model beside it)."""
    kept = [name for name in names if not pytorch.TRAINING_STATE.fullmatch(name)] or names
    return _numbered(kept)


def _numbered(names: list[str]) -> list[list[str]]:
    """Files as models: those numbered as the parts of one (NAME-0000k-of-0000n.EXT) together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        found = NUMBERED.fullmatch(name)
        groups.setdefault(f"{found['prefix']}\0{found['suffix']}" if found else name, []).append(name)
    return list(groups.values())


def _holding(names: list[str]) -> str:
    """What a directory without weights holds, as a message ends (its first names)."""
    shown = [name for name in names if not name.startswith(".")]
    return f" (it holds {_some(shown)})" if shown else " (it is empty)"


def _some(names: list[str]) -> str:
    return ", ".join(printable(name) for name in names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
