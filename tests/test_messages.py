"""Messages that say what to do (issue 33): a mount without a FUSE device, a server that does not
answer Range requests, a refusal (401, 403) with the hint its kind of source calls for."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorfs
from conftest import missing_root, require
from helpers import patience, random_bytes, write_reference
from servers import TOKEN, Nginx
from tensorfs.mount.mounttable import mount_at


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", *args], capture_output=True, text=True, timeout=patience(120), env=env
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a command that failed (exit 1), no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr.strip()


# -- no FUSE device ---------------------------------------------------------------------------------

# Run in a mount namespace of its own (unshare -m, mounts private to it), so /dev changes there alone.
DEV_WITHOUT_FUSE = 'mount -t tmpfs -o mode=755 tensorfs-test-dev /dev && mknod -m 666 /dev/null c 1 3 && exec "$@"'
"""/dev a tmpfs that holds /dev/null alone: no /dev/fuse at all."""
NULL_FOR_FUSE = 'mount --bind /dev/null /dev/fuse && exec "$@"'
"""/dev/fuse there, but another device (a container's bind of the wrong node)."""


def _namespaces_unusable() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    done = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"unshare -m: {done.stderr.strip()}"


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
@pytest.mark.parametrize(
    ("hidden", "said"),
    [(DEV_WITHOUT_FUSE, "no FUSE device: /dev/fuse is missing"), (NULL_FOR_FUSE, "/dev/fuse is not FUSE's")],
    ids=["missing", "another device"],
)
def test_a_mount_without_a_fuse_device_says_what_is_missing(
    tmp_path: Path, hidden: str, said: str, foreground: bool
) -> None:
    """libfuse's own reason reaches only a foreground mount's terminal; a background one said only
    "fuse_session_mount failed". Either way, one line: what is missing, and what works without it."""
    require("root", missing_root())
    require("mount namespaces", _namespaces_unusable())
    model = tmp_path / "m.safetensors"
    write_reference(model, {"w": ("F32", [4], random_bytes(16, 1))})
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    command = [sys.executable, "-m", "tensorfs.cli", "mount", *(["-f"] if foreground else [])]
    command += ["--log-file", str(tmp_path / "log"), str(model), str(mountpoint)]
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", hidden, "sh", *command], capture_output=True, text=True, timeout=patience(120)
    )
    line = one_line(result)
    assert said in line and "in-process" in line and "load_file" in line, line
    assert "fuse_session_mount" not in line
    assert mount_at(mountpoint) is None  # (nothing could be: not here, not in the namespace)


# -- a server without Range support, and refusals by kind of source -----------------------------------


@pytest.fixture
def plain_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """What `python -m http.server` runs (SimpleHTTPRequestHandler: no Range support) on a free port of
    127.0.0.1, serving a directory of the test's; yields its URL and that directory."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(QuietFiles, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def send_head(self):  # type: ignore[no-untyped-def]
        if "forbidden" in self.path:  # a server's refusal, as of a file it may not show
            self.send_error(403)
            return None
        return super().send_head()


def test_a_server_that_ignores_range_requests_is_refused_saying_range_is_needed(
    plain_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, root = plain_server
    write_reference(root / "m.safetensors", {"w": ("F32", [4], random_bytes(16, 2))})
    line = one_line(cli("validate", "--cache-dir", str(tmp_path / "cache"), f"{url}/m.safetensors"))
    assert line.startswith(f"error: {url}/m.safetensors: the server does not answer Range requests"), line
    assert "serve them from a server that does" in line
    with pytest.raises(tensorfs.InvalidModelError, match="does not answer Range requests"):
        tensorfs.load_file(f"{url}/m.safetensors", cache=str(tmp_path / "cache"))


def test_a_refusal_says_what_to_check_for_its_kind_of_source(
    plain_server: tuple[str, Path], nginx: Nginx, tmp_path: Path
) -> None:
    """A plain HTTP server's 403 is no question of AWS credentials; the Hub's 401 is one of its token."""
    url, _ = plain_server
    cache = ["--cache-dir", str(tmp_path / "cache")]
    line = one_line(cli("validate", *cache, f"{url}/forbidden/m.safetensors"))
    assert "access denied (403): tensorfs sends no credentials to an HTTP(S) server: check the URL" in line, line
    assert "AWS" not in line and "bucket" not in line and "HF_TOKEN" not in line

    repository = nginx.root / "private" / "messages"  # nginx asks for the token under /private/
    (repository / "resolve" / "v1").mkdir(parents=True)
    write_reference(repository / "resolve" / "v1" / "model.safetensors", {"w": ("F32", [4], random_bytes(16, 3))})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env |= {"HF_ENDPOINT": nginx.url, "HF_HOME": str(tmp_path / "hf")}
    try:
        line = one_line(cli("validate", *cache, "hf://private/messages@v1", env=env))
        assert "authentication required (401): a private or gated repository needs a token" in line, line
        assert "HF_TOKEN" in line and "AWS" not in line and "bucket" not in line
        wrong = env | {"HF_TOKEN": "not-" + TOKEN}
        line = one_line(cli("validate", *cache, "hf://private/messages@v1", env=wrong))
        assert "the Hub's token given (HF_TOKEN, or $HF_HOME/token) may not read this repository" in line, line
        assert cli("validate", *cache, "hf://private/messages@v1", env=env | {"HF_TOKEN": TOKEN}).returncode == 0
    finally:
        shutil.rmtree(repository)


# -- a file that is no model, named as MODEL ----------------------------------------------------------

NOT_WEIGHTS = {
    "config.json": b'{"model_type": "llama", "hidden_size": 4096}\n',
    "model_index.json": b'{"_class_name": "StableDiffusionPipeline"}\n',
    "notes.txt": b"hello world: notes on the model\n",
    "README": b"",
}


@pytest.mark.parametrize("name", list(NOT_WEIGHTS))
def test_a_file_that_is_no_model_named_as_model_says_so(name: str, tmp_path: Path, nginx: Nginx) -> None:
    """Issue 55, item 7: a companion named as MODEL was read as a safetensors file whose header length
    is its first 8 bytes ("header length 7810190778963069563 is over the limit"). Every command, the
    library say "not a weights file" and how it begins; a URL so named, what to name instead."""
    (tmp_path / name).write_bytes(NOT_WEIGHTS[name])
    begins = "it is empty" if not NOT_WEIGHTS[name] else f"it begins {NOT_WEIGHTS[name][:8].decode()!r}"
    said = f"{name}: not a weights file ({begins}; tensorfs reads .safetensors, .gguf, .bin, .pt or .pth)"
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    for command in (["validate", name], ["ls", name], ["mount", name, "mnt"]):
        result = subprocess.run(
            [sys.executable, "-m", "tensorfs.cli", *command],
            capture_output=True,
            text=True,
            timeout=patience(120),
            cwd=tmp_path,
        )
        assert one_line(result) == f"error: {said}", command
    assert mount_at(mountpoint) is None
    with pytest.raises(tensorfs.InvalidModelError) as refused:
        tensorfs.safe_open(str(tmp_path / name), "numpy")
    assert f"not a weights file ({begins};" in str(refused.value)
    served = nginx.root / "no-model" / name
    served.parent.mkdir()
    served.write_bytes(NOT_WEIGHTS[name])
    try:
        url = f"{nginx.url}/no-model/{name}"
        line = one_line(cli("validate", "--cache-dir", str(tmp_path / "cache"), url))
        # A URL not named as a weights file is a folder's (HTTP lists none): what to name instead.
        assert line.startswith(f"error: {url}: name the model's index (…/model.safetensors.index.json) or a "), line
        assert line.endswith(".safetensors, .gguf, .bin, .pt or .pth file: HTTP has no listing"), line
    finally:
        shutil.rmtree(served.parent)


def test_a_weights_file_of_any_name_is_still_read(tmp_path: Path) -> None:
    """A safetensors file is told by its content: one named without a weights suffix is read as before."""
    write_reference(tmp_path / "model", {"w": ("F32", [4], random_bytes(16, 4))})
    assert cli("validate", str(tmp_path / "model")).returncode == 0
    with tensorfs.safe_open(str(tmp_path / "model"), "numpy") as opened:
        assert list(opened.keys()) == ["w"]
