"""What a store's listings are taken for: folder markers are never files."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import write_reference
from servers import HostileServer, Lie
from tensorfs.opening.view_files import ViewRule
from tensorfs.sources.store import RemoteOptions
from tensorfs.views.companions import MAX_DEPTH
from tensorfs.views.remote_files import find_remote_companions

S3_KEYS = {"AWS_ACCESS_KEY_ID": "AKIDTENSORFS", "AWS_SECRET_ACCESS_KEY": "secret"}


@pytest.fixture
def s3_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in S3_KEYS.items():
        monkeypatch.setenv(key, value)


def test_folder_markers_are_never_files_at_any_depth(hostile: HostileServer, s3_keys: None, tmp_path: Path) -> None:
    """A store that lists the prefix's own folder marker (`m/`, as the S3 console's "Create folder"
    makes) beside `m/1_Pooling/` and an empty folder's marker (`m/2_Dense/`): the client drops a
    key's trailing '/', so they come as `m` and `m/2_Dense`; neither is a file of the model's view."""
    model = hostile.root / "bkt" / "m"
    (model / "1_Pooling").mkdir(parents=True)
    write_reference(model / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    (model / "config.json").write_text('{"model_type": "bert"}')
    (model / "1_Pooling" / "config.json").write_text("{}")
    hostile.lies += [Lie("name", "bkt/m", marker) for marker in ("", "1_Pooling/", "2_Dense/")]
    remote = RemoteOptions(endpoint_url=hostile.url, cache_dir=tmp_path / "cache")
    spec = find_remote_companions("s3://bkt/m", remote, ViewRule(folder=False))
    assert sorted(c.path for c in spec.companions) == ["1_Pooling/config.json", "config.json"]
    hostile.lies.append(Lie("size", "bkt/m/", 6))  # the prefix's own marker holding bytes (as some tools write)
    spec = find_remote_companions("s3://bkt/m", remote, ViewRule(folder=False))
    assert sorted(c.path for c in spec.companions) == ["1_Pooling/config.json", "config.json"]


def test_empty_objects_the_listing_leaves_out_are_never_asked_after(
    hostile: HostileServer, s3_keys: None, tmp_path: Path
) -> None:
    """An empty object may be a folder marker, which a HEAD tells: asked only of the entries the
    model's view keeps (not of those deeper than its bound, nor in a git repository's own folder),
    so that a prefix of many empty files there costs no request apiece."""
    model = hostile.root / "bkt" / "m"
    (model / "1_Pooling").mkdir(parents=True)
    write_reference(model / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    (model / "1_Pooling" / "config.json").write_text("{}")
    (model / "1_Pooling" / "empty.txt").write_bytes(b"")  # kept: a HEAD says it is a file
    for folder in ("/".join("d" * MAX_DEPTH), ".git/objects"):
        (model / folder).mkdir(parents=True)
        for n in range(20):
            (model / folder / f"{n}.txt").write_bytes(b"")
    remote = RemoteOptions(endpoint_url=hostile.url, cache_dir=tmp_path / "cache")
    spec = find_remote_companions("s3://bkt/m", remote, ViewRule(folder=False))
    assert sorted(c.path for c in spec.companions) == ["1_Pooling/config.json", "1_Pooling/empty.txt"]
    heads = [name for method, name, *_ in hostile.requests if method == "HEAD" and name.endswith(".txt")]
    assert heads == ["bkt/m/1_Pooling/empty.txt"]


@pytest.mark.parametrize("store", ["s3", "hub"])
def test_a_listing_takes_every_file_to_the_views_depth(
    hostile: HostileServer, s3_keys: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """S3's listing and the Hub's API (a listing a folder) give the view every file of the model's
    folder as deep as a local one's (MAX_DEPTH levels), hidden ones too: they stopped one level
    down, and S3's left hidden folders out. A git repository's own folder is never taken."""
    model = hostile.root / ("bkt/m" if store == "s3" else "org/m")
    model.mkdir(parents=True)
    write_reference(model / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    deepest = "/".join(f"l{level}" for level in range(1, MAX_DEPTH)) + "/deepest.txt"
    files = ["config.json", ".gitattributes", ".hidden/x.json", "extra/deeper/notes.txt", deepest]
    for path in [*files, "/".join("d" * MAX_DEPTH) + "/too-deep.txt", ".git/HEAD"]:
        (model / path).parent.mkdir(parents=True, exist_ok=True)
        (model / path).write_text(path)
    monkeypatch.setenv("HF_ENDPOINT", hostile.url)
    remote = RemoteOptions(endpoint_url=hostile.url, cache_dir=tmp_path / "cache")
    spec = find_remote_companions("s3://bkt/m" if store == "s3" else "hf://org/m", remote, ViewRule(folder=False))
    assert sorted(c.path for c in spec.companions) == sorted(files)
    assert spec.warnings == []
