"""The files beside a remote model's weights, found for its view: every one a listing shows (S3, and
the Hub's API), else (plain HTTP) the names loaders look for and those the model's own files name,
each look bounded; served through the chunk cache (companions.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor

import orjson

from ..errors import RemoteError, TooLarge, printable
from ..proof.manifest import DEFAULT_MANIFEST
from ..proof.signature import DEFAULT_SIGNATURE
from ..sources.choosing import ADAPTER_NAMES
from ..sources.client import get_whole, head
from ..sources.finding import beside, hub_listing, listing_beside
from ..sources.store import ObjectVersion, RemoteOptions
from ..utils.identity import ShardKey
from ..utils.names import path_problem
from .companions import (
    MAX_DEPTH,
    MAX_FILES,
    MAX_NAMING_FILE,
    Companion,
    FileRule,
    FolderFiles,
    RemoteOrigin,
    Skipped,
)

__all__ = ["WELL_KNOWN", "find_remote_companions"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
WELL_KNOWN = (
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "adapter_config.json",
    *ADAPTER_NAMES,
    "README.md",
)
"""What loaders look for beside the weights: asked for where a store cannot list a directory
(plain HTTP). sentence-transformers' modules.json and their own configs are among them, and PEFT's
adapter beside its base model."""
FOLDER_FILES = ("model.safetensors.index.json", DEFAULT_MANIFEST, DEFAULT_SIGNATURE)
"""Asked for too where a view is the model's folder: its index, its manifest, its signature."""
MODULE_FILES = ("config.json", "sentence_bert_config.json", "model.safetensors", "pytorch_model.bin", *TOKENIZER_FILES)
"""What a module of modules.json may hold in its folder (a Pooling's config, a Transformer's tokenizer,
a Dense layer's weights)."""

COMPANION_TIMEOUT = 10.0
"""Seconds a companion file may take to be found, retries included: they are optional, and some are guessed."""
MAX_SUBDIRECTORY_DEPTH = 2
"""A module's file modules.json names, asked for over plain HTTP: in a subdirectory, one level down."""
MAX_WANTED_DEPTH = 32
"""A wanted file's (a signature names it) path: as deep as a signed local model's directory is walked."""


def find_remote_companions(
    source: str,
    options: RemoteOptions,
    rule: FileRule,
    *,
    own: Collection[ShardKey] = (),
    wanted: Collection[str] = (),
) -> FolderFiles:
    """The files beside a remote model's weights: every one a listing shows (S3, and the Hub's API;
    MAX_DEPTH levels down), else (plain HTTP) the well-known ones that are there and the
    files the model's own files name; the same limits as for a local model, each look bounded by
    COMPANION_TIMEOUT, those the `rule` takes; the weights files it says are models of their own
    (not the model's, `own`) are named, not read (FolderFiles.weights). `wanted`: files looked for
    too where a listing does not show them (a signature's: at any depth; over plain HTTP, asked for
    by name).
    Nothing with --offline (the cache keeps only the weights).

    Which were found, and which looked for and not there, is logged.
    """
    if options.offline:
        return FolderFiles(warnings=[f"{printable(source)}: companion files are not fetched with --offline"])
    quick = dataclasses.replace(options, timeout=min(options.timeout, COMPANION_TIMEOUT))
    try:
        listed = listing_beside(
            source, quick, MAX_DEPTH, keep=lambda path: path in wanted or rule.left_out(path) is None
        )
    except RemoteError as exc:
        return FolderFiles(warnings=[f"companion files skipped: {exc}"])
    cut = None
    if listed is None:
        try:
            hub = hub_listing(source, quick, MAX_DEPTH)
            if hub is not None:
                listed, cut = hub
        except RemoteError as exc:  # a mirror that serves files but not the API: as over plain HTTP
            log.info("%s; looking for the files loaders look for instead", exc)
    mine = {str(weight) for weight in own}
    if listed is not None:
        shown = {path for path, *_ in listed}
        deeper = [path for path in wanted if path not in shown and (cut is not None or path.count("/") >= MAX_DEPTH)]
        found = _listed(source, options, listed, mine, rule, set(wanted))
        if cut is not None:
            found.warnings.append(cut)
        if deeper:  # beyond what the listing reaches: asked for by name
            extra = _guessed(source, options, quick, mine, rule, deeper, guess=False)
            found.companions += extra.companions
            found.weights += extra.weights
            found.warnings += extra.warnings
        log.info("companion files of %s: %s", printable(source), ", ".join(c.path for c in found.companions) or "none")
    else:
        found = _guessed(source, options, quick, mine, rule, wanted)
    return found


def _listed(
    source: str,
    options: RemoteOptions,
    listed: list[tuple[str, int, float, str | None]],
    own: set[str],
    rule: FileRule,
    wanted: Collection[str] = (),
) -> FolderFiles:
    found = FolderFiles()
    skipped = Skipped()
    for path, size, mtime, etag in sorted(listed, key=lambda row: (row[0].count("/"), row[0])):  # the top's first
        why = path_problem(path, MAX_DEPTH)  # the one gate of names from outside
        if why is not None:
            name = printable(path[:200])
            skipped.add("names that are not plain relative paths", f"{printable(source)}: '{name}': skipped: {why}")
            continue
        if not (path in wanted or rule.takes(path)):
            continue
        ref = beside(source, path, options)
        if ref.url in own:
            continue
        shown = printable(ref.url)
        if len(found.companions) + len(found.weights) == MAX_FILES:
            skipped.add("too many", f"{shown}: skipped: over {MAX_FILES:,} files in the folder")
        elif rule.weights(path):
            found.weights.append(path)  # opened, validated and served as a model of its own
        elif size < 0:  # a lying listing's (-1: none at all)
            skipped.add("no size", f"{shown}: skipped: the listing gives it no size, or a negative one")
        else:  # any size: read through the chunk cache, as a shard is
            version = ObjectVersion(ref, etag, size, mtime) if etag is not None else None
            mtime_ns = int((mtime or time.time()) * 1e9)
            found.companions.append(Companion(path, size, mtime_ns, None, RemoteOrigin(ref, options, version)))
    found.warnings.extend(skipped.said())
    return found


def _guessed(
    source: str,
    options: RemoteOptions,
    quick: RemoteOptions,
    own: set[str],
    rule: FileRule,
    wanted: Collection[str] = (),
    *,
    guess: bool = True,
) -> FolderFiles:
    """Plain HTTP: the well-known names that are there (`guess`), then what modules.json and the
    configs name, and the `wanted` (a signature's files: hidden or deep ones too, their names passed
    through the one gate of names from outside first)."""
    looked: dict[str, ObjectVersion | None] = {}
    found = FolderFiles()
    named = {path for path in wanted if path_problem(path, MAX_WANTED_DEPTH) is None and "\\" not in path}

    def look(paths: Iterable[str]) -> None:
        asked = [path for path in dict.fromkeys(paths) if path not in looked and (path in named or rule.takes(path))]
        asked = [path for path in asked if beside(source, path, quick).url not in own]

        def one(path: str) -> tuple[str, ObjectVersion | str | None]:
            try:
                return path, head(beside(source, path, quick))
            except RemoteError as exc:
                return path, f"{printable(str(exc))}: skipped"

        with ThreadPoolExecutor(max_workers=8) as pool:
            for path, answer in pool.map(one, asked[: MAX_FILES - len(looked)]):
                if isinstance(answer, str):
                    found.warnings.append(answer)
                    looked[path] = None
                else:
                    looked[path] = answer

    if guess:
        look((*WELL_KNOWN, *(FOLDER_FILES if rule.folder else ())))
        look(_named(source, quick, looked, found.warnings))
    look(sorted(named))
    for path, version in sorted(looked.items()):
        if version is None:
            continue
        if rule.weights(path):
            found.weights.append(path)
        else:  # any size: read through the chunk cache, as a shard is
            mtime_ns = int((version.mtime or time.time()) * 1e9)
            ref = version.ref
            found.companions.append(Companion(path, version.size, mtime_ns, None, RemoteOrigin(ref, options, version)))
    absent = sorted(path for path, version in looked.items() if version is None)
    log.info(
        "companion files of %s: found %s; looked for and not there: %s",
        printable(source),
        ", ".join([*(c.path for c in found.companions), *found.weights]) or "none",
        ", ".join(absent) or "none",
    )
    return found


def _named(
    source: str, options: RemoteOptions, looked: dict[str, ObjectVersion | None], warnings: list[str]
) -> list[str]:
    """The files that the model's own files found so far name: each module of modules.json (its
    config.json, and any well-known file in its folder), and the Python files of auto_map."""
    named: list[str] = []
    for document_name in ("modules.json", "config.json", "tokenizer_config.json"):
        version = looked.get(document_name)
        if version is None or version.size > MAX_NAMING_FILE:
            continue
        try:
            document = orjson.loads(get_whole(version.ref, MAX_NAMING_FILE))
        except (RemoteError, TooLarge, FileNotFoundError, orjson.JSONDecodeError) as exc:
            warnings.append(f"{printable(version.url)}: not followed: {exc}")
            continue
        if document_name == "modules.json" and isinstance(document, list):
            for module in document:
                folder = module.get("path") if isinstance(module, dict) else None
                if isinstance(folder, str) and _plain_name(folder):  # its files: one level down
                    named += [f"{folder}/{name}" for name in MODULE_FILES]
        elif isinstance(document, dict) and isinstance(document.get("auto_map"), dict):
            for value in document["auto_map"].values():
                for reference in value if isinstance(value, list) else [value]:
                    if isinstance(reference, str) and "." in reference:
                        module_name = reference.rpartition("--")[2].rpartition(".")[0]
                        if _plain_name(f"{module_name}.py", MAX_SUBDIRECTORY_DEPTH):
                            named.append(f"{module_name}.py")
    return named


def _plain_name(path: str, depth: int = 1) -> bool:
    """Whether a name a model's file gives is one to look for: a plain relative path of at most
    `depth` parts (names.path_problem, the one gate of names from outside), and no backslash (a
    separator to some servers)."""
    return path_problem(path, depth) is None and "\\" not in path
