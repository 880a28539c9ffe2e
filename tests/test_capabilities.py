"""What a test needs of the machine (conftest.require): missing, a run with CI set fails the test, any
other run skips it saying what it needs and why it is missing. Made missing for real, in a pytest of
its own: /proc/sys read-only in a mount namespace of its own (no dropping caches), and no fusermount3
on its PATH (no FUSE)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import missing_root, require
from helpers import patience

INNER = """
from conftest import drop_caches

def test_drops_caches():
    drop_caches(1)

def test_mounts(fuse):
    pass
"""

# In a mount namespace of its own, /proc/sys read-only; the pytest run there finds on its PATH
# nothing but the venv's commands.
HIDDEN = 'mount --bind -o ro /proc/sys /proc/sys && PATH="$0" exec "$@"'


@pytest.mark.parametrize("ci", [True, False], ids=["CI", "not CI"])
def test_a_missing_capability_fails_on_ci_and_is_skipped_elsewhere_saying_why(tmp_path: Path, ci: bool) -> None:
    require("root (it makes a mount namespace of its own)", missing_root())
    (tmp_path / "test_inner.py").write_text(INNER)
    tests = str(Path(__file__).parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    environment.pop("CI", None)
    if ci:
        environment["CI"] = "true"
    inner = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA"]
    inner += ["--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"), str(tmp_path / "test_inner.py")]
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            HIDDEN,
            str(Path(sys.executable).parent),
            *inner,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=patience(120),
        check=False,
    )
    caches = "/proc/sys/vm/drop_caches: Read-only file system"
    fuse = "fusermount3 is not installed"
    if ci:
        assert done.returncode == 1, done.stdout + done.stderr
        assert (
            f"test_drops_caches - Failed: writing /proc/sys/vm/drop_caches is required on CI, and missing: {caches}"
            in done.stdout
        ), done.stdout
        assert f"test_mounts - Failed: FUSE is required on CI, and missing: {fuse}" in done.stdout, done.stdout
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"needs writing /proc/sys/vm/drop_caches, missing here: {caches}" in done.stdout, done.stdout
        assert f"needs FUSE, missing here: {fuse}" in done.stdout, done.stdout
        assert "2 skipped" in done.stdout, done.stdout
