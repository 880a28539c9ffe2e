"""Tensor names become paths: what is refused, and what clashes."""

from __future__ import annotations

import pytest

from tensorfs.utils.names import collisions, name_problem, name_problems, tensor_path

BAD_NAMES = [
    ("", "name is empty"),
    ("a\0b", "NUL"),
    ("/abs", "absolute path"),
    ("a//b", "an empty path component"),
    ("a/", "an empty path component"),
    (".", "a '.' path component"),
    ("a/../b", "a '..' path component"),
    ("..", "a '..' path component"),
    (".tensorfs", "reserved"),
    (".tensorfs/x", "reserved"),
    ("a\ud800", "not valid Unicode"),
    ("d" * 256 + "/w", "over 255 bytes"),
    ("w" * 246, "with its '.meta.json' sidecar it would pass the 255-byte limit"),
    ("é" * 123, "with its '.meta.json' sidecar"),  # 246 bytes in UTF-8
]

GOOD_NAMES = ["a", "model.layers.0.weight", "a/b/c", ".hidden", "x/.tensorfs", "a..b", "w" * 245, "é" * 122, "名前"]


@pytest.mark.parametrize(("name", "words"), BAD_NAMES)
def test_unsafe_names_are_refused(name: str, words: str) -> None:
    reason = name_problem(name)
    assert reason is not None and words in reason
    assert name_problems([name]) == [(name, reason)]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_safe_names_pass(name: str) -> None:
    assert name_problem(name) is None
    assert name_problems([name, "other"]) == []


def test_bulk_check_agrees_with_the_one_by_one_check() -> None:
    names = [n for n, _ in BAD_NAMES] + GOOD_NAMES
    assert name_problems(names) == [(n, r) for n in names if (r := name_problem(n)) is not None]


DOTTED_BAD_NAMES = [
    (".dotfile", "name begins with '.', which --layout dotted makes an empty path component"),
    ("..hidden", "name begins with '.', which --layout dotted makes an empty path component"),
    ("a..b", "name holds '..', which --layout dotted makes an empty path component"),
    ("trailing.", "name ends with '.', which --layout dotted makes an empty path component"),
    ("x/.y", "component '.y' begins with '.', which --layout dotted makes an empty path component"),
    ("x./y", "component 'x.' ends with '.', which --layout dotted makes an empty path component"),
    ("/abs.x", "name is an absolute path"),
    ("a//b.c", "name has an empty path component"),
    ("a/../b", "name has a '..' path component"),
]


def test_dotted_layout_nests_on_dots_and_refuses_what_that_breaks() -> None:
    assert tensor_path("model.layers.0.weight", "dotted") == "model/layers/0/weight"
    for name, reason in DOTTED_BAD_NAMES:  # each rule names itself, never another one
        assert name_problem(name, "dotted") == reason, name
        assert name_problems([name, "ok.name"], "dotted") == [(name, reason)]
    assert name_problem("a.b/c.d", "dotted") is None


def test_collisions() -> None:
    assert collisions(["a", "b", "a/c"]) == [("a", "is a file, but tensor 'a/c' needs 'a' as a directory")]
    assert collisions(["w", "w.sha256"]) == [("w.sha256", "has the same path as a sidecar of tensor 'w'")]
    assert collisions(["w", "w.meta.json"]) == [("w.meta.json", "has the same path as a sidecar of tensor 'w'")]
    assert collisions(["w", "w.sha256/x"]) == [
        ("w.sha256/x", "needs 'w.sha256' as a directory, but it is a sidecar of tensor 'w'")
    ]
    assert collisions(["x/y/z", "x/y"]) == [("x/y", "is a file, but tensor 'x/y/z' needs 'x/y' as a directory")]
    assert collisions(["a/b", "a/c", "d.sha256", "e/f.meta.json"]) == []


def test_dotted_collisions() -> None:
    assert collisions(["a.b", "a/b"], "dotted") == [("a/b", "maps to the same path 'a/b' as tensor 'a.b'")]
    assert collisions(["model.w", "model.w.bias"], "dotted") == [
        ("model.w", "is a file, but tensor 'model.w.bias' needs 'model/w' as a directory")
    ]
    assert collisions(["model.w", "model.b"], "dotted") == []
