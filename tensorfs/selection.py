"""Which tensors of a model to serve: --include/--exclude globs and --layers A-B.

Pure: names in, a yes or no out. Includes first (none = all), then the layer range, then
excludes. Globs are fnmatch's, on whole names, case-sensitive ('*' crosses '.' and '/').
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import translate

_LAYER = re.compile(r"(?:^|[./])(?:layers|layer|blocks|block|blk|h)[./](\d+)(?:[./]|$)")
"""A numbered layer as models name them: model.layers.12.mlp... (Llama and most), transformer.h.3
(GPT-2), encoder.layer.3 (BERT), blocks.3 / block.3, blk.3 (GGUF); '/' works as well as '.'."""


@dataclass(frozen=True)
class Selection:
    """A subset of a model's tensors (the default, empty one selects every tensor)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None
    """An inclusive range of layer numbers: tensors of other numbered layers are left out,
    tensors of no numbered layer (embeddings, norms, the head) are kept."""

    def __post_init__(self) -> None:
        # What a caller may mean: one glob as a string (not its characters), None for none,
        # layers as "A-B", N, or (A, B).
        for name in ("include", "exclude"):
            value = getattr(self, name)
            globs = () if value is None else (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(glob, str) for glob in globs):
                raise TypeError(f"{name}: globs are strings, not {globs!r}")
            object.__setattr__(self, name, globs)
        object.__setattr__(self, "layers", _layer_range(self.layers))

    @property
    def everything(self) -> bool:
        return not (self.include or self.exclude or self.layers is not None)

    def select(self, names: Iterable[str]) -> list[str]:
        """The names selected, in the order given."""
        include, exclude = _matcher(self.include), _matcher(self.exclude)
        chosen = []
        for name in names:
            if include is not None and include.match(name) is None:
                continue
            if self.layers is not None and not self._in_layers(name):
                continue
            if exclude is not None and exclude.match(name) is not None:
                continue
            chosen.append(name)
        return chosen

    def _in_layers(self, name: str) -> bool:
        assert self.layers is not None
        layer = layer_of(name)
        return layer is None or self.layers[0] <= layer <= self.layers[1]

    def describe(self) -> str:
        """The selection as the options that make it, for messages: --include 'a.*' --layers 0-3."""
        words = [f"--include '{glob}'" for glob in self.include]
        if self.layers is not None:
            words.append(f"--layers {self.layers[0]}-{self.layers[1]}")
        words += [f"--exclude '{glob}'" for glob in self.exclude]
        return " ".join(words) or "every tensor"

    def as_json(self) -> dict[str, object]:
        return {"include": list(self.include), "exclude": list(self.exclude), "layers": self.layers}


def _layer_range(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_layers(value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in value)
    ):
        raise TypeError(f"layers: a range is (first, last), 'A-B' or N, not {value!r}")
    first, last = value
    if not 0 <= first <= last:
        raise ValueError(f"layers {first}-{last}: not a range of layer numbers")
    return first, last


def layer_of(name: str) -> int | None:
    """The number of the layer the tensor belongs to, if its name says (model.layers.N...)."""
    found = _LAYER.search(name)
    return None if found is None else int(found.group(1))


def parse_layers(text: str) -> tuple[int, int]:
    """'A-B' (or 'N') as an inclusive range; ValueError saying why not."""
    found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if found is None:
        raise ValueError(f"{text!r} is not a range of layers like 0-15 (or one layer, 7)")
    first = int(found.group(1))
    last = int(found.group(2)) if found.group(2) is not None else first
    if last < first:
        raise ValueError(f"{text!r}: the range ends before it begins")
    return first, last


def _matcher(globs: tuple[str, ...]) -> re.Pattern[str] | None:
    """One compiled pattern for every glob (100k names are matched once, not once per glob)."""
    if not globs:
        return None
    return re.compile("|".join(f"(?:{translate(glob)})" for glob in globs))
