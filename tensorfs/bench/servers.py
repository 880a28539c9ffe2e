"""Local servers the benchmark (and the tests) read remote models from: nginx on 127.0.0.1 only,
all its state in one directory."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
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


def wait_http(port: int, process: subprocess.Popen[bytes], what: str, seconds: float = 60.0) -> None:
    """Poll until the server on `port` answers HTTP (any status), or fail at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it answered")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # answered (403 for an anonymous S3 request: it is up)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer on port {port} within {seconds:.0f} s") from None
            time.sleep(0.05)


def stop(process: subprocess.Popen[bytes], signum: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


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
        (d / "tmp").mkdir(exist_ok=True)
        temp = " ".join(
            f"{kind}_temp_path {d}/tmp/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = "user root;" if os.geteuid() == 0 else ""  # workers would be nobody, and tmp dirs are 0700
        (d / "nginx.conf").write_text(
            f"daemon off; master_process on; worker_processes 1; {user}\n"
            f"pid {d}/nginx.pid; error_log {d}/error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{ access_log {d}/access.log; {temp} default_type application/octet-stream; sendfile on;\n"
            f"  server {{ listen 127.0.0.1:{self.port}; root {self.root};\n"
            f"    {self.locations}\n"
            "  }\n}\n"
        )
        self.process = subprocess.Popen(
            ["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
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
