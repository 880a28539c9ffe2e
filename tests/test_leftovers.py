"""Nothing of a run is left behind: the temporary directory of the tests' processes is the session's
own, hypothesis keeps nothing in the working tree, and a run that leaves a file of its own in /tmp
fails saying which (conftest.pytest_sessionfinish). Each made to happen in a pytest of its own, whose
/tmp (conftest.TMP: TENSORFS_TEST_TMP) is a directory of the test's tmp_path."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from conftest import RUN_USERS, missing_root, require
from helpers import patience

INNER = """
import os, subprocess, sys, tempfile
from pathlib import Path
from hypothesis import given, strategies as st
TMP = Path(os.environ["TENSORFS_TEST_TMP"])

def test_a_file_left_in_tmp():
    if os.environ.get("ANOTHER_USER"):  # another user's tensorfs makes its runtime directory meanwhile
        uid = int(os.environ["ANOTHER_USER"])
        os.mkdir(TMP / f"tensorfs-{uid}", 0o700)
        os.chown(TMP / f"tensorfs-{uid}", uid, uid)
    if os.environ.get("OTHERS"):  # other processes of this user on the machine, not of this run
        for name in os.environ["OTHERS"].split(","):
            subprocess.run(["touch", str(TMP / name)], check=True)
    if os.environ.get("LEAVE"):
        (TMP / f"tensorfs-left-{os.environ['TENSORFS_TEST_SESSION']}-behind").write_text("left")

def test_the_temporary_directory_is_the_sessions(tmp_path_factory):
    here = Path(tempfile.mkdtemp(prefix="torchinductor_"))
    here.joinpath("cache").write_text("in-process")
    assert here.is_relative_to(tmp_path_factory.getbasetemp())
    code = "import tempfile; print(tempfile.mkdtemp(prefix='torchinductor_'))"
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert Path(made.strip()).is_relative_to(tmp_path_factory.getbasetemp())

@given(st.text())
def test_hypothesis(text):
    pass

def test_a_shared_directory_that_cannot_be_removed(shared_dir):
    if os.environ.get("STUCK"):  # immutable: not even root removes it
        (shared_dir / "stuck").write_text("stuck")
        subprocess.run(["chattr", "+i", str(shared_dir / "stuck")], check=True)
"""


def inner_pytest(tmp_path: Path, **environment: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """A pytest of INNER, a session of its own (not this run's tag, nor a pytest-xdist worker's
    settings), its /tmp being tmp_path/tmp: how it went, and its tag (in the names it makes there)."""
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "tmp").mkdir(mode=0o1777)
    tag = f"{os.getpid()}{secrets.randbelow(10**6):06d}"
    outer = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    path = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    env = {**outer, "PYTHONPATH": path, "TENSORFS_TEST_SESSION": tag, "TENSORFS_TEST_TMP": str(tmp_path / "tmp")}
    env.update(environment)
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q"]
    command += ["--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"), str(tmp_path / "test_inner.py")]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=patience(120), check=False
    )
    return done, f"{tag}-"


def test_a_clean_run_passes_and_keeps_its_files_in_its_own_directories(tmp_path: Path) -> None:
    before = set(os.listdir("/tmp"))
    done, tag = inner_pytest(tmp_path)
    after = set(os.listdir("/tmp"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout and "left in /tmp" not in done.stdout, done.stdout
    assert not (tmp_path / ".hypothesis").exists()  # the working directory: nothing of hypothesis
    # What it made in its /tmp, or in the machine's (others' runs on the machine make theirs
    # meanwhile): its tagged names (torch's temporary directories are in its own:
    # test_the_temporary_directory_is_the_sessions).
    made_here = {name for name in (after - before) | set(os.listdir(tmp_path / "tmp")) if tag in name}
    assert not made_here, made_here


def test_a_run_that_leaves_a_file_of_its_own_in_tmp_fails_naming_it(tmp_path: Path) -> None:
    done, tag = inner_pytest(tmp_path, LEAVE="1")
    left = sorted((tmp_path / "tmp").glob(f"tensorfs-left-{tag}behind"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout  # every test passed: the run fails all the same
    assert len(left) == 1 and f"left in {tmp_path / 'tmp'} by this run: {left[0].name}" in done.stdout, done.stdout


def test_what_other_processes_make_in_tmp_meanwhile_is_not_the_runs(tmp_path: Path) -> None:
    """Names in /tmp that other processes of the same user make while the run goes on (another
    session's SeaweedFS sockets, torch's compile cache of another job: as on a busy CI machine) are
    not the run's: it passes. Counted as the run's, they failed a fresh clone's CI (issue 41)."""
    unique = f"{os.getpid()}-{secrets.randbelow(10**6):06d}"
    others = [f"seaweedfs-s3-grpc-{unique}.sock", f"torchinductor_{unique}", f"tensorfs-{os.getpid()}"]
    done, _ = inner_pytest(tmp_path, OTHERS=",".join(others))
    assert all((tmp_path / "tmp" / name).exists() for name in others)  # (made, and left, by "them")
    assert done.returncode == 0 and "left in" not in done.stdout, done.stdout + done.stderr


def test_a_shared_directory_left_behind_fails_its_test_and_the_run(tmp_path: Path) -> None:
    """The shared_dir fixture removes its directory under /tmp or fails the test saying what is left
    (it once ignored every error: /tmp/tensorfs-shared-* stayed behind), and the run fails too."""
    require("root (it makes a file immutable)", missing_root())
    done, tag = inner_pytest(tmp_path, STUCK="1")
    stuck = sorted((tmp_path / "tmp").glob(f"tensorfs-test-{tag}*/stuck"))
    try:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "1 error" in done.stdout and "is left: [" in done.stdout, done.stdout
        said = f"left in {tmp_path / 'tmp'} by this run: {stuck[0].parent.name}" if stuck else None
        assert len(stuck) == 1 and said in done.stdout, done.stdout
    finally:
        for path in stuck:
            subprocess.run(["chattr", "-i", str(path)], check=True)
            path.unlink()
            path.parent.rmdir()


def test_another_users_runtime_directory_is_not_the_runs(tmp_path: Path) -> None:
    """/tmp/tensorfs-UID of a user the run does not act as, made while it runs (by that user's own
    tensorfs), is not the run's: it passes. Counted as the run's, it failed a run (issue 35)."""
    require("root (it makes a directory another user owns)", missing_root())
    uid = next(uid for uid in range(4242, 65534) if uid not in RUN_USERS)
    done, _ = inner_pytest(tmp_path, ANOTHER_USER=str(uid))
    assert (tmp_path / "tmp" / f"tensorfs-{uid}").stat().st_uid == uid
    assert done.returncode == 0 and "left in" not in done.stdout, done.stdout + done.stderr
