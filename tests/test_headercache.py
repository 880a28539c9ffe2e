"""The cache of validated headers: what it skips when nothing changed, and that any change, damage or
trouble with it means a validation from scratch, never a stale or foreign answer."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

import tensorfs
import tensorfs.opening.locations
import tensorfs.sources.local
import tensorfs.utils.identity
from conftest import Mounts, wait_until
from helpers import (
    cli,
    header_table,
    model_bytes,
    random_bytes,
    reference_table,
    sharded_every_dtype,
    write_index,
    write_reference,
)
from tensorfs.caches import headers as headercache
from tensorfs.caches.headers import HeaderCache
from tensorfs.errors import InvalidModelError
from tensorfs.utils.identity import SETTLED_NS, Identity  # SETTLED_NS: the real window (shut below, in this process)


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files just written may be cached here (in this process): the racy window has a test of its own."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)


@pytest.fixture(autouse=True)
def small_headers_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small test files are cached here (in this process): leaving them out has a test of its own."""
    monkeypatch.setattr(tensorfs.sources.local, "WORTH_CACHING", 0)
    monkeypatch.setattr(tensorfs.opening.locations, "WORTH_CACHING", 0)


def long_headers(directory: Path) -> None:
    """Two shards whose headers are WORTH_CACHING long, and an index: what commands in processes of
    their own (the real threshold) cache."""
    directory.mkdir(parents=True)
    weight_map = {}
    for number in (1, 2):
        shard = f"model-0000{number}-of-00002.safetensors"
        count = headercache.WORTH_CACHING // 64  # over 64 bytes of JSON each
        tensors = {f"layers.{number}.{i}.weight": ("F32", [1], random_bytes(4, i)) for i in range(count)}
        write_reference(directory / shard, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    write_index(directory, weight_map)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    sharded_every_dtype(tmp_path / "model")
    return tmp_path / "model"


class Calls:
    """Counts the calls of a function of a module, still calling it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.count = 0
        real: Callable[..., Any] = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def parsed(monkeypatch: pytest.MonkeyPatch) -> tuple[Calls, Calls, Calls]:
    """Counters of the three things the cache saves: header parses, index parses, the model's checks."""
    return (
        Calls(monkeypatch, tensorfs.sources.local, "read_header_fd"),
        Calls(monkeypatch, tensorfs.sources.local, "parse_weight_map"),
        Calls(monkeypatch, tensorfs.opening.locations, "check_model"),
    )


def tables_of(model: tensorfs.Model) -> dict[str, Any]:
    """Each shard's table as tensorfs holds it (bytes where it says they are)."""
    return {
        shard.name: header_table(model.shard_header(shard), shard.read_bytes())
        for shard in model.shards
        if isinstance(shard, Path)
    }


def test_unchanged_files_are_neither_read_nor_checked_again(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers, index, checks = parsed(monkeypatch)
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, cache=cache) as first:
        expected = tables_of(first)
    assert (headers.count, index.count, checks.count) == (2, 1, 1)
    with tensorfs.open_model(model, cache=cache) as again:
        assert tables_of(again) == expected
        assert {name: bytes(again.raw(name)) for name in again} == model_bytes(model)
    assert (headers.count, index.count, checks.count) == (2, 1, 1)  # nothing parsed or checked
    for shard in sorted(model.glob("*.safetensors")):  # and what the cache gave is the reference's reading
        assert expected[shard.name] == reference_table(shard)


def test_any_change_of_identity_validates_afresh(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    tensorfs.open_model(model, cache=cache).close()
    headers, index, checks = parsed(monkeypatch)
    shard = model / "model-00001-of-00002.safetensors"
    os.utime(shard)  # a new mtime (and ctime) only: validated again
    tensorfs.open_model(model, cache=cache).close()
    assert (headers.count, index.count, checks.count) == (1, 1, 1)  # the index is known, the model is not

    # Rewritten in place to the same size with its old mtime put back: only the ctime tells, and it does.
    content = shard.read_bytes()
    stat = shard.stat()
    renamed = content.replace(b'"scalar"', b'"scalaR"', 1)
    assert len(renamed) == len(content) and renamed != content
    shard.write_bytes(renamed)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(InvalidModelError) as caught:  # the index still names "scalar"
        tensorfs.open_model(model, cache=cache)
    assert "scalaR" in str(caught.value) and "weight_map" in str(caught.value)
    assert headers.count == 2

    # The index rewritten to match: read again (its own identity changed), and the model is valid.
    text = (model / "model.safetensors.index.json").read_text()
    (model / "model.safetensors.index.json").write_text(text.replace('"scalar"', '"scalaR"'))
    with tensorfs.open_model(model, cache=cache) as changed:
        assert "scalaR" in changed and "scalar" not in changed
    assert index.count == 3


def test_nothing_is_kept_of_files_changed_too_lately_to_tell(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Racily clean files: with timestamps of a second (or a jiffy), a rewrite within the same tick
    keeps the identity, so what was read within SETTLED_NS of a change is never remembered."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 3600 * 10**9)  # every file here is "just written"
    headers, index, checks = parsed(monkeypatch)
    cache = tmp_path / "cache"
    for _ in range(2):
        tensorfs.open_model(model, cache=cache).close()
    assert (headers.count, index.count, checks.count) == (4, 2, 2)  # validated afresh each time
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:
        assert db.execute("SELECT COUNT(*) FROM rows").fetchone() == (0,)


def test_rows_unused_for_30_days_are_dropped(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows last used 31 days ago (their time set so in the database) are gone once another model
    is validated with the cache, and the model they were of is validated afresh; a row of 29 days stays."""
    cache = tmp_path / "cache"
    tensorfs.open_model(model, cache=cache).close()
    database = cache / HeaderCache.FILE_NAME
    day = 24 * 3600
    with sqlite3.connect(database) as db:
        rows = sorted(db.execute("SELECT kind, key FROM rows").fetchall())
        assert len(rows) == 4  # two shards, the index, the model's checks
        kept, *aged = rows  # the index's ('index/N' sorts first) stays: the shards' and the checks' go
        assert kept[0].startswith("index/")
        db.execute("UPDATE rows SET used=?", (time.time() - 31 * day,))
        db.execute("UPDATE rows SET used=? WHERE kind=? AND key=?", (time.time() - 29 * day, *kept))
    db.close()
    other = tmp_path / "other"
    other.mkdir()
    write_reference(other / "o.safetensors", {"x": ("U8", [4], b"abcd")})
    tensorfs.open_model(other, cache=cache).close()  # a write: the rows unused too long go
    with sqlite3.connect(database) as db:
        left = set(db.execute("SELECT kind, key FROM rows").fetchall())
    db.close()
    assert kept in left and not left & set(aged), left
    assert len(left) == 1 + 2  # the row of 29 days, and the other model's shard and checks
    headers, index, checks = parsed(monkeypatch)
    with tensorfs.open_model(model, cache=cache) as again:
        assert {name: bytes(again.raw(name)) for name in again} == model_bytes(model)
    # The shards and the checks afresh (the index too: the checks need its weight map, which its row does not hold).
    assert (headers.count, index.count, checks.count) == (2, 1, 1)


def test_a_row_that_does_not_check_out_is_a_warning_and_a_full_validation(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, cache=cache) as first:
        expected = tables_of(first)
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:  # one byte of every row's value changed
        rows = db.execute("SELECT kind, key, value FROM rows").fetchall()
        assert {kind.split("/")[0] for kind, _, _ in rows} == {"shard", "index", "model"}
        for kind, key, value in rows:
            damaged = value.replace(b"scalar", b"scalaR") if b"scalar" in value else value[:-1] + b" "
            db.execute("UPDATE rows SET value=? WHERE kind=? AND key=?", (damaged, kind, key))
    headers, index, checks = parsed(monkeypatch)
    with caplog.at_level(logging.WARNING), tensorfs.open_model(model, cache=cache) as again:
        assert tables_of(again) == expected
    assert (headers.count, index.count, checks.count) == (2, 1, 1)
    warned = [r.getMessage() for r in caplog.records if "does not match its checksum" in r.getMessage()]
    assert len(warned) == len(rows)


def test_rows_that_cannot_be_the_files_are_not_taken(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A row rewritten with its checksum made again (a forger; or a bug) whose layout cannot be the
    file's, or whose last use is not a time: a warning and a validation, never a traceback."""
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, cache=cache) as first:
        expected = tables_of(first)
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:
        for kind, key, value in db.execute("SELECT kind, key, value FROM rows WHERE kind LIKE 'shard/%'").fetchall():
            forged = orjson.loads(value)
            forged[4][0] += 10**6  # the first tensor's end, far past the file's
            data = orjson.dumps(forged)
            db.execute(
                "UPDATE rows SET value=?, sha256=?, used='yesterday' WHERE kind=? AND key=?",
                (data, headercache._digest(kind, key, data), kind, key),
            )
    headers, _, _ = parsed(monkeypatch)
    with caplog.at_level(logging.WARNING), tensorfs.open_model(model, cache=cache) as again:
        assert tables_of(again) == expected
    assert headers.count == 2
    assert sum("cannot be where a safetensors file has them" in r.getMessage() for r in caplog.records) == 2


def test_rows_of_an_older_form_are_never_read(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows made by a tensorfs before the shape rule (their kind says the form: shard/2) are not
    read: every shard is validated afresh. The same rows under this form's kind are read: the test
    tells one from the other."""
    cache = tmp_path / "cache"
    with tensorfs.open_model(model, cache=cache) as first:
        expected = tables_of(first)
    older = f"shard/{headercache.SCHEMA - 1}"
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:
        for kind, key, value in db.execute("SELECT kind, key, value FROM rows WHERE kind LIKE 'shard/%'").fetchall():
            db.execute(
                "UPDATE rows SET kind=?, sha256=? WHERE kind=? AND key=?",
                (older, headercache._digest(older, key, value), kind, key),
            )
    headers, _, _ = parsed(monkeypatch)
    with tensorfs.open_model(model, cache=cache) as again:
        assert tables_of(again) == expected
    assert headers.count == 2  # both shards read afresh
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:  # (the fresh rows out of the way)
        db.execute("DELETE FROM rows WHERE kind=?", (f"shard/{headercache.SCHEMA}",))
    monkeypatch.setattr(headercache, "SCHEMA", headercache.SCHEMA - 1)  # as the tensorfs that made them
    headers.count = 0
    with tensorfs.open_model(model, cache=cache) as read:
        assert tables_of(read) == expected
    assert headers.count == 0


def test_every_problem_is_told_with_the_index_known_to_the_cache(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    tensorfs.open_model(model, cache=cache).close()
    first, second = sorted(model.glob("*.safetensors"))
    content = first.read_bytes()  # a tensor renamed (the index does not know it) and a shape broken
    first.write_bytes(content.replace(b'"scalar"', b'"scalaR"', 1))
    content = second.read_bytes()
    second.write_bytes(content.replace(b'"shape":[3145728]', b'"shape":[3145729]', 1))

    def problems(cache: Path | bool) -> list[str]:
        with pytest.raises(InvalidModelError) as caught:
            tensorfs.open_model(model, cache=cache)
        return sorted(str(problem) for problem in caught.value.problems)

    assert problems(cache) == problems(False)
    assert len(problems(False)) == 3


@pytest.mark.parametrize("trouble", ["corrupt", "unwritable"])
def test_a_cache_that_cannot_be_used_is_one_warning(
    trouble: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    if trouble == "corrupt":
        cache.mkdir()
        (cache / HeaderCache.FILE_NAME).write_bytes(random_bytes(64 << 10, 7))
    else:
        cache.write_bytes(b"a file where the cache's directory should be")  # root ignores permissions
    headers, _, _ = parsed(monkeypatch)
    for _ in range(2):
        with caplog.at_level(logging.WARNING), tensorfs.open_model(model, cache=cache) as opened:
            assert {name: bytes(opened.raw(name)) for name in opened} == model_bytes(model)
    assert headers.count == 4
    warned = [r.getMessage() for r in caplog.records if "header cache" in r.getMessage()]
    assert len(warned) == 2 and all("unusable" in message for message in warned), warned


def test_small_headers_are_validated_afresh_without_the_database(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in (tensorfs.sources.local, tensorfs.opening.locations):
        monkeypatch.setattr(module, "WORTH_CACHING", headercache.WORTH_CACHING)
    headers, index, checks = parsed(monkeypatch)
    cache = tmp_path / "cache"
    for _ in range(2):
        with tensorfs.open_model(model, cache=cache) as opened:
            assert {name: bytes(opened.raw(name)) for name in opened} == model_bytes(model)
    assert (headers.count, index.count, checks.count) == (4, 2, 2)  # every time: cheaper than the cache
    assert not cache.exists()  # not even opened
    long_headers(tmp_path / "long")
    for _ in range(2):
        tensorfs.open_model(tmp_path / "long", cache=cache).close()
    assert (headers.count, index.count, checks.count) == (6, 3, 3)  # the second time from the cache


def test_no_cache_and_the_commands(tmp_path: Path) -> None:
    model = tmp_path / "model"
    long_headers(model)
    cache = tmp_path / "cache"

    # The commands run in processes of their own, with the real window: wait until the files are out of it.
    newest = max(os.stat(path).st_ctime_ns for path in model.iterdir())
    wait_until(lambda: time.time_ns() - newest > SETTLED_NS, what="the files to settle")
    for command in ("validate", "ls"):
        done = cli(command, "--no-cache", "--cache-dir", str(cache), str(model))
        assert done.returncode == 0, done.stderr
        assert not cache.exists()  # neither read nor written
    done = cli("validate", "--cache-dir", str(cache), str(model))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:
        assert db.execute("SELECT COUNT(*) FROM rows WHERE kind LIKE 'shard/%'").fetchone() == (2,)
    # A shard made invalid in place: the cached verdict does not hide it from `validate`.
    shard = model / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    done = cli("validate", "--cache-dir", str(cache), str(model))
    assert done.returncode == 1 and "model-00002-of-00002.safetensors" in done.stderr, done.stderr


def test_a_remount_sees_a_shard_rewritten_under_its_cached_header(mounts: Mounts, tmp_path: Path) -> None:
    """The mount's processes have the real settle window and size threshold: the first mount, of a
    settled shard with a long header, fills the cache (and its daemon is handed the header by
    reference). The shard is then rewritten in place at the same size, its old mtime put back, so
    that only its ctime tells; the remount must serve the new tensors, never the row of the old."""
    model = tmp_path / "model.safetensors"
    cache = tmp_path / "cache"
    count = headercache.WORTH_CACHING // 32  # a header of over 50 bytes a tensor: worth caching

    def tensors(prefix: str, seed: int) -> dict[str, tuple[str, list[int], bytes]]:
        return {f"{prefix}.{i:04d}": ("U8", [4], random_bytes(4, seed + i)) for i in range(count)}

    old, new = tensors("old", 0), tensors("new", count)
    write_reference(model, old)
    replacement = tmp_path / "replacement.safetensors"
    write_reference(replacement, new)
    rewritten = replacement.read_bytes()
    replacement.unlink()
    assert len(rewritten) == model.stat().st_size  # names of the same length: the same layout
    assert int.from_bytes(rewritten[:8], "little") >= headercache.WORTH_CACHING

    newest = max(model.stat().st_mtime_ns, model.stat().st_ctime_ns)
    wait_until(lambda: time.time_ns() - newest > SETTLED_NS, what="the shard to settle", timeout=SETTLED_NS / 1e9 + 30)
    mountpoint = mounts.mount(model, "--cache-dir", str(cache))
    assert (mountpoint / "old.0007").read_bytes() == old["old.0007"][2]
    assert not (mountpoint / "new.0007").exists()
    done = mounts.run("umount", str(mountpoint))
    assert done.returncode == 0, done.stderr
    first = model.stat()
    kind = f"shard/{headercache.SCHEMA}"
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:
        rows = [key for (key,) in db.execute("SELECT key FROM rows WHERE kind=?", (kind,))]
    assert rows == [Identity.of(first).key()]  # the old table, kept by the old identity

    with open(model, "r+b") as f:  # in place: the same inode, the same size
        f.write(rewritten)
    os.utime(model, ns=(first.st_atime_ns, first.st_mtime_ns))
    second = model.stat()
    assert (second.st_dev, second.st_ino, second.st_size, second.st_mtime_ns) == (
        first.st_dev,
        first.st_ino,
        first.st_size,
        first.st_mtime_ns,
    )
    assert second.st_ctime_ns != first.st_ctime_ns  # the one number that tells

    mountpoint = mounts.mount(model, "--cache-dir", str(cache))
    served = sorted(p.name for p in mountpoint.iterdir() if not p.name.endswith((".json", ".sha256")))
    assert served == [".tensorfs", *sorted(new)]
    for name in ("new.0000", "new.0007", f"new.{count - 1:04d}"):
        assert (mountpoint / name).read_bytes() == new[name][2]
    assert {json.loads((mountpoint / "new.0007.meta.json").read_text())["name"]} == {"new.0007"}
    with sqlite3.connect(cache / HeaderCache.FILE_NAME) as db:  # the old row was there to be (wrongly) taken
        assert db.execute("SELECT COUNT(*) FROM rows WHERE kind=? AND key=?", (kind, rows[0])).fetchone() == (1,)
