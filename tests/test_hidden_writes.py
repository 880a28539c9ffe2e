"""A shard's owner writes into it through a shared mapping (no inotify event) and sets its mtime back:
only its ctime moved. That is a change of its bytes like any other: hashed again before another byte
is served under a manifest, refused (EIO) without one, in-process and through a mount. (The same of a
fallback's copy: tests/test_gate.py, the fallbacks rewritten in place, "hidden".)"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest

import tensorfs
from conftest import Mounts, drop_caches
from helpers import damage_in_place, errno_of_reading, invalidated, mib_sharded_model, model_bytes
from tensorfs.errors import IntegrityError, ShardChangedError
from tensorfs.proof.manifest import format_manifest


def model_and_manifest(tmp_path: Path) -> tuple[Path, dict[str, bytes], Path]:
    model_dir = mib_sharded_model(tmp_path / "model", 2)
    expected = model_bytes(model_dir)
    manifest = tmp_path / "tensors.sha256"
    manifest.write_text(format_manifest({name: hashlib.sha256(blob).hexdigest() for name, blob in expected.items()}))
    return model_dir, expected, manifest


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_hidden_write_to_a_shard_is_caught_by_the_loader(tmp_path: Path, manifest: bool) -> None:
    model_dir, expected, manifest_path = model_and_manifest(tmp_path)
    verify = manifest_path if manifest else None
    with tensorfs.safe_open(model_dir, "np", verify=verify, cache=False) as opened:
        assert opened.get_tensor("t1.1").tobytes() == expected["t1.1"]  # verified (with a manifest), served
        damage_in_place(model_dir, "t1.1", hidden=True)
        if manifest:  # hashed again: not the manifest's bytes
            with pytest.raises(IntegrityError, match=r"t1\.1"):
                opened.get_tensor("t1.1")
            damage_in_place(model_dir, "t1.1", hidden=True)  # the byte put back, as hidden: verified again
            assert opened.get_tensor("t1.1").tobytes() == expected["t1.1"]
        else:  # nothing can tell its bytes: the shard is refused until opened again
            for name in ("t1.1", "t1.0"):
                with pytest.raises(ShardChangedError, match="changed in place"):
                    opened.get_tensor(name)
        assert opened.get_tensor("t0.1").tobytes() == expected["t0.1"]  # the other shard served on


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_hidden_write_to_a_shard_is_caught_through_a_mount(mounts: Mounts, tmp_path: Path, manifest: bool) -> None:
    model_dir, expected, manifest_path = model_and_manifest(tmp_path)
    options = ["--no-cache", *(["--manifest", str(manifest_path)] if manifest else ["--verify", "off"])]
    mountpoint = mounts.mount(model_dir, *options)
    assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"]
    damage_in_place(model_dir, "t1.1", hidden=True)
    drop_caches()  # the kernel's pages of it too: the daemon is asked
    invalidated(mountpoint)  # the change seen (reading stats.json takes in what was reported), its pages dropped
    assert errno_of_reading(mountpoint / "t1.1") == errno.EIO
    if manifest:
        damage_in_place(model_dir, "t1.1", hidden=True)  # put back: verified again, served
        invalidated(mountpoint, 2)
        assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"]
        assert "verified again" in mounts.log()
    else:
        assert errno_of_reading(mountpoint / "t1.0") == errno.EIO
        assert "was changed in place under the mount" in mounts.log()
    assert (mountpoint / "t0.1").read_bytes() == expected["t0.1"]
