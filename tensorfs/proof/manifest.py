"""Manifests: a tensor's SHA-256 by name, as `sha256sum` writes it (GNU's escaping of names) or as
JSON; read from a file, a pipe or a URL (bounded, and never through a link out of a model's
directory), and what one says of a model (coverage, mismatches). Where a model's own is found is
the opener's business."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Problem, RemoteError, TensorfsError, TooLarge, printable
from ..formats import is_weights_name
from ..fs.guarded import ModelDirectory, NotRegular, read_bounded
from ..sources.client import read_url
from ..sources.store import RemoteOptions, is_remote, redact

if TYPE_CHECKING:
    from ..catalogue.tables import Tables

DEFAULT_MANIFEST = "tensors.sha256"
"""The manifest looked for beside a model's shards."""


def _escape(name: str) -> tuple[str, str]:
    """GNU sha256sum's escaping of a file name: (prefix for the line, escaped name)."""
    if "\\" in name or "\n" in name or "\r" in name:
        return "\\", name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "", name


def sha256sum_line(hex_digest: str, name: str) -> str:
    """One line in the format `sha256sum` writes and `sha256sum -c` reads."""
    prefix, escaped = _escape(name)
    return f"{prefix}{hex_digest}  {escaped}\n"


def format_manifest(digests: Mapping[str, str], *, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(dict(sorted(digests.items())), indent=2, ensure_ascii=False) + "\n"
    return "".join(sha256sum_line(digests[name], name) for name in sorted(digests))


class ManifestError(TensorfsError):
    """A manifest file that cannot be read."""


def parse_manifest(text: str, source: str) -> dict[str, str]:
    """Tensor name -> hex digest from a manifest in sha256sum format or JSON ({name: hex})."""
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(document, dict) or not all(
            isinstance(v, str) and _is_hex_digest(v) for v in document.values()
        ):
            raise ManifestError(f"{source}: a JSON manifest maps tensor names to 64-digit hex SHA-256 strings")
        return {name: digest.lower() for name, digest in document.items()}
    digests: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        escaped = line.startswith("\\")
        body = line[1:] if escaped else line
        digest, separator, name = body[:64], body[64:66], body[66:]
        if not _is_hex_digest(digest) or separator not in ("  ", " *") or not name:
            raise ManifestError(f"{source}:{number}: not a sha256sum line: {printable(line[:80])}")
        if escaped:
            name = _unescape(name)
        if name in digests:
            raise ManifestError(f"{source}:{number}: tensor '{printable(name)}' is listed twice")
        digests[name] = digest.lower()
    return digests


def _unescape(name: str) -> str:
    out, chars = [], iter(name)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(nxt, "\\" + nxt))
        else:
            out.append(ch)
    return "".join(out)


def _is_hex_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


MAX_MANIFEST_BYTES = 256 << 20
"""A manifest of a million tensors is about 100 MB: one past this is not a manifest (or never ends)."""


def beside_name(file: str, tensor: str) -> str:
    """How a manifest names a tensor of a weights file beside the model (a variant, an adapter,
    another checkpoint of its folder): the file's path in the folder, then the tensor's name."""
    return f"{file}/{tensor}"


def _file_and_tensor(name: str) -> tuple[str, str] | None:
    """(file, tensor) of a name beside_name made; None for any other (no part a weights file's name)."""
    parts = name.split("/")
    for end in range(1, len(parts)):
        if is_weights_name(parts[end - 1]):
            return "/".join(parts[:end]), "/".join(parts[end:])
    return None


@dataclass(frozen=True)
class Manifest:
    """The SHA-256 a model's tensors must hash to, by name."""

    label: str
    """Where it was read from, as given."""
    digests: Mapping[str, str]
    lists_more: bool = False
    """It may list tensors the model does not hold (the model is one shard, or a selection)."""
    beside: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """What it says of the weights files beside the model: by file (its path in the model's folder),
    each tensor's SHA-256 by name (see beside_name)."""

    def of_model(self, model: Tables) -> Manifest:
        """This manifest with its lines for the files beside `model` set apart (`beside`): those named
        as beside_name names them, which name no tensor of the model."""
        digests: dict[str, str] = {}
        beside: dict[str, dict[str, str]] = {}
        for name, digest in self.digests.items():
            split = None if name in model else _file_and_tensor(name)
            if split is None:
                digests[name] = digest
            else:
                beside.setdefault(split[0], {})[split[1]] = digest
        return Manifest(self.label, digests, self.lists_more, beside)

    def beside_problems(self, actual: Mapping[str, Mapping[str, str]], where: Callable[[str], str]) -> list[Problem]:
        """What keeps the weights files beside the model (`actual`: each tensor's SHA-256, by file,
        then tensor; `where(file)` how a message names one) from being those it lists: a file it
        lists that is not there, a tensor of a listed file it does not list, or lists with another
        value. A file it lists nothing of is none of its business (a manifest made before tensorfs
        listed them)."""
        problems: list[Problem] = []
        for file, listed in sorted(self.beside.items()):
            found = actual.get(file)
            if found is None:
                problems.append(
                    Problem(self.label, f"lists {printable(file)}, which is no weights file beside the model")
                )
                continue
            for name in sorted(listed.keys() | found.keys()):
                if name not in found:
                    problems.append(Problem(where(file), f"is in {self.label} but not in the file", name))
                elif name not in listed:
                    problems.append(Problem(where(file), f"is in the file but not in {self.label}", name))
                elif listed[name] != found[name]:
                    problems.append(Problem(where(file), f"does not match {self.label} (sha256 {found[name]})", name))
        return problems

    def coverage(self, model: Tables) -> list[Problem]:
        """What keeps it from being the model's: tensors it lists that the model does not hold (unless it
        may list more), and tensors the model holds that it does not list."""
        problems = [
            Problem(self.label, "is in the manifest but not in the model", name)
            for name in ([] if self.lists_more else self.digests)
            if name not in model
        ]
        problems += [
            Problem(self.label, "is in the model but not in the manifest", name)
            for name in model.names()
            if name not in self.digests
        ]
        return problems

    def mismatches(self, model: Tables, actual: Mapping[str, str], reason: Callable[[str], str]) -> list[Problem]:
        """The tensors whose hash (`actual`) differs from the manifest's, each said with `reason(tensor)`."""
        return [
            Problem(str(model.info(name).shard), reason(name), name)
            for name in sorted(actual)
            if name in self.digests and self.digests[name] != actual[name]
        ]


def read_manifest(path: Path | str, remote: RemoteOptions | None = None, *, in_model: bool = False) -> dict[str, str]:
    """The manifest in `path` (a file, a pipe such as <(...), or a URL), at most MAX_MANIFEST_BYTES.

    `in_model`: the manifest found in a model's directory, which someone else may control: a
    regular file beneath it, opened once, never blocking.
    """
    data = read_document(path, remote, in_model=in_model, limit=MAX_MANIFEST_BYTES, what="a manifest")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    return parse_manifest(text, str(path))


def read_document(
    path: Path | str,
    remote: RemoteOptions | None,
    *,
    in_model: bool,
    limit: int,
    what: str,
    error: type[TensorfsError] = ManifestError,
) -> bytes:
    """The bytes of a small document a model is held to (`what`: a manifest, a signature) in `path`:
    a file, a pipe or a URL, at most `limit` bytes; `error` (one line naming it) when it cannot be read.
    One read from a URL is kept in the cache, and with --offline taken from there (no store asked).

    `in_model`: found in a model's directory, which someone else may control: a regular file
    beneath it, opened once, never blocking.
    """
    too_large = f"over {limit >> 20} MiB, too large to be {what}"
    if is_remote(path):
        assert isinstance(path, str)
        options = remote or RemoteOptions()
        from ..sources.chunks import default_cache_dir
        from ..sources.remote import remember_document, remembered_document

        shown = redact(path)
        try:
            if options.offline:  # asked of no store: as it was read last, from the cache
                found = remembered_document(path, options)
                if found is None:
                    cache = options.cache_dir or default_cache_dir()
                    raise error(f"{shown}: --offline: the cache {printable(str(cache))} never had it")
                data = found
            else:
                data = read_url(path, options, limit)
                remember_document(path, options, data)
        except TooLarge:
            raise error(f"{shown}: {too_large}") from None
        except (RemoteError, FileNotFoundError) as exc:
            raise error(str(exc) if str(exc).startswith(shown) else f"{shown}: {exc}") from None
    else:
        path = Path(path)
        try:
            if in_model:
                with ModelDirectory(path.parent) as directory:
                    fd, _ = directory.open_regular(path.name)
            else:  # named by whoever runs the command: a pipe is fine, and waited for
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
                kind = os.fstat(fd).st_mode
                if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
                    os.close(fd)
                    raise error(f"{path}: not a regular file or a pipe")
            try:
                if os.fstat(fd).st_size > limit:  # said before a byte of it is read (a pipe says 0: read, bounded)
                    raise error(f"{printable(str(path))}: {too_large}")
                data = read_bounded(fd, limit)
            finally:
                os.close(fd)
        except NotRegular:
            raise error(f"{path}: not a regular file") from None
        except OSError as exc:
            why = "a symlink out of the model's directory" if exc.errno == errno.EXDEV else exc.strerror
            raise error(f"{path}: cannot read: {why}") from None
    if len(data) > limit:
        raise error(f"{printable(str(path))}: {too_large}")
    return data
