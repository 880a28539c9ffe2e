"""A fleet's nodes on one machine, for the tests and the benchmark of fleets (cluster.py has the store
and the tier they read from).

- Relay: nginx passing requests through to a server unchanged, on addresses the server does not
  listen on itself: a node's way to the store's S3 gateway, which binds one address (127.0.0.1).
  The Host header is passed as the client sent it, so S3 signatures made by the node hold.

- Node, make_nodes, remove_nodes, nodes: network namespaces with a veth pair each to the host, in
  a /30 of 10.201.0.0/16 of their own; a node reaches the host only at its host end's address, so
  what serves nodes listens there (and on 127.0.0.1), never on every address. A command runs in a
  node under `nsenter --net`, which changes the network namespace only: `ip netns exec` also makes
  a mount namespace of its own, where a FUSE mount is invisible to the host (and to its tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .servers import free_ports, nginx_temp_paths, start_nginx, stop, wait_http


class Relay:
    """nginx passing every request to `target` (host:port) as it came, on `addresses` at one port."""

    def __init__(self, directory: Path, target: str, addresses: Sequence[str], port: int | None = None) -> None:
        self.directory = directory.resolve()
        self.target = target
        self.addresses = list(addresses)
        self.port = port or free_ports(1)[0]
        self.process: subprocess.Popen[bytes] | None = None

    def url_at(self, address: str) -> str:
        return f"http://{address}:{self.port}"

    def start(self) -> None:
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};"
        listen = " ".join(f"listen {address}:{self.port};" for address in self.addresses)
        # Nothing buffered either way (uploads, answers), and the Host as the client sent it: that is
        # what an S3 signature covers.
        config = (
            f"{user} worker_processes 1; pid {d}/nginx.pid; error_log {d}/error.log info;\n"
            "events { worker_connections 1024; }\n"
            # Whether a request was signed (S3's X-Amz-Date: never the signature itself).
            "http { log_format relay '$remote_addr \"$request\" $status amz_date=$http_x_amz_date';\n"
            f"  access_log {d}/access.log relay; {nginx_temp_paths(d)}\n"
            f"  upstream target {{ server {self.target}; keepalive 16; }}\n"
            f"  server {{ {listen}\n"
            "    client_max_body_size 0; proxy_request_buffering off; proxy_buffering off;\n"
            '    proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header Host $http_host;\n'
            "    location / { proxy_pass http://target; }\n"
            "  }\n}\n"
        )
        self.process = start_nginx(d, config)
        # The host ends of the nodes are this host's addresses too: it can ask there.
        wait_http(self.port, self.process, "the relay (nginx)", seconds=30, host=self.addresses[0])

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process, signal.SIGTERM)
            self.process = None

    def log(self) -> list[tuple[str, str, int, bool]]:
        """(client, request line, status, signed) of every request so far, from the access log."""
        path = self.directory / "access.log"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            m = re.fullmatch(r'(\S+) "([^"]*)" (\d+) amz_date=(\S+)', line)
            if m is None:
                raise ValueError(f"the relay's log has a line it should not: {line}")
            found.append((m[1], m[2], int(m[3]), m[4] != "-"))
        return found


# -- nodes -----------------------------------------------------------------------------------------

NETNS_DIR = Path("/run/netns")
_NODE = re.compile(r"tfs-(\d+)-node-(\d+)")
_LOCK = Path("/run/lock/tensorfs-fleet.lock")


@dataclass(frozen=True)
class Node:
    """A network namespace with a veth pair to the host: `address` its end, `host_address` the host's."""

    name: str
    """The namespace: tfs-PID-node-K (the pid of the process that made it)."""
    index: int
    link: str
    """The host's end of the veth pair (the node's end is eth0)."""
    host_address: str
    address: str

    @property
    def netns(self) -> Path:
        return NETNS_DIR / self.name

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run in the node: its network namespace, nothing else of it (its mounts are the host's)."""
        return ["nsenter", f"--net={self.netns}", "--", *argv]

    def pids(self) -> list[int]:
        """The processes in the node's network namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(pid) for pid in listed.stdout.split()]


def run_in(node: Node, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """subprocess.run of `argv` in the node (text, output captured unless told otherwise)."""
    options: dict[str, object] = {"capture_output": True, "text": True, "check": False, **kwargs}
    return subprocess.run(node.command(argv), **options)  # type: ignore[call-overload, no-any-return]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _link_name(pid: int, index: int) -> str:
    return f"tfs{pid}h{index}"  # at most 15 characters: pids are below 2**22


def _subnets_in_use() -> set[int]:
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    return {int(m[1]) for m in re.finditer(r"inet 10\.201\.(\d+)\.", listed.stdout)}


def _sweep_dead_runs() -> None:
    """Remove the nodes of runs whose process is gone (killed before it could remove them)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    for name in names:
        m = _NODE.fullmatch(name)
        if m is None or _alive(int(m[1])):
            continue
        subprocess.run(["ip", "link", "del", _link_name(int(m[1]), int(m[2]))], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def nodes_unusable() -> str | None:
    """Why nodes cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def make_nodes(count: int) -> list[Node]:
    """`count` nodes, each in a /30 of 10.201.0.0/16 that no interface of this host has: the host's
    end is .1, the node's .2 (no route beyond: a node reaches its host end and nothing else)."""
    reason = nodes_unusable()
    if reason is not None:
        raise RuntimeError(reason)
    pid = os.getpid()
    made: list[Node] = []
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once choose their subnets one after the other
        _sweep_dead_runs()
        used = _subnets_in_use()
        free = iter(octet for octet in range(1, 255) if octet not in used)
        try:
            for index in range(count):
                octet = next(free, None)
                if octet is None:
                    raise RuntimeError("no free /30 left in 10.201.0.0/16 for a node")
                node = Node(f"tfs-{pid}-node-{index}", index, _link_name(pid, index), f"10.201.{octet}.1",
                            f"10.201.{octet}.2")  # fmt: skip
                made.append(node)
                _ip("netns", "add", node.name)
                _ip("link", "add", node.link, "type", "veth", "peer", "name", "eth0", "netns", node.name)
                _ip("addr", "add", f"{node.host_address}/30", "dev", node.link)
                _ip("link", "set", node.link, "up")
                _ip("-n", node.name, "addr", "add", f"{node.address}/30", "dev", "eth0")
                _ip("-n", node.name, "link", "set", "eth0", "up")
                _ip("-n", node.name, "link", "set", "lo", "up")
        except BaseException:
            remove_nodes(made)
            raise
    return made


def remove_nodes(nodes: Sequence[Node]) -> None:
    """Take the nodes away: what still runs in them killed, their veth pairs and namespaces removed.
    RuntimeError, after it has removed all it could, if any is left."""
    left = []
    for node in nodes:
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # The veth pair goes with either end; its namespace stays while a process is in it, so the
        # host's end is removed by name, not left to the namespace's end.
        subprocess.run(["ip", "link", "del", node.link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", node.name], capture_output=True, check=False)
        if node.netns.exists() or Path(f"/sys/class/net/{node.link}").exists():
            left.append(node.name)
    if left:
        raise RuntimeError(f"nodes left behind: {', '.join(left)}")


@contextlib.contextmanager
def nodes(count: int) -> Iterator[list[Node]]:
    """`count` nodes for the time of a `with`, removed however it ends."""
    made = make_nodes(count)
    try:
        yield made
    finally:
        remove_nodes(made)
