"""Other local users gain nothing from tensorfs running as root on paths and servers they control.

Each attack is made for real by another user (nobody): files swapped under a scan, a cache
directory they can write, a daemon record they forge, credentials in a URL, reading what root
mounts with -o allow_other, and links, FIFOs and swapped directories where root writes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Mounts, OtherUser, drop_caches
from helpers import MIB, WRITING, HeldCommand, cli, patience, random_bytes, write_reference
from servers import Nginx, SeaweedFS
from tensorfs import open_model
from tensorfs.caches.headers import WORTH_CACHING
from tensorfs.errors import InvalidModelError
from tensorfs.mount.mounttable import last_error
from tensorfs.mount.runtime import escape_path, process_start

SECRET = b'{"secret": "only root may read this"}'


def root_only(tmp_path: Path) -> Path:
    """A file that only root may read (tmp_path is root's alone)."""
    secret = tmp_path / "secret.json"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def users_model(directory: Path, user: OtherUser) -> dict[str, bytes]:
    """A model in a directory that `user` owns, with a config.json beside it."""
    directory.mkdir()
    data = {"w": random_bytes(4096, 1)}
    write_reference(directory / "model.safetensors", {"w": ("U8", [4096], data["w"])})
    (directory / "config.json").write_text('{"model_type": "test"}')
    user.owns(directory, directory / "model.safetensors", directory / "config.json")
    return data


# Run as the other user: config.json swapped, as fast as it goes, between a regular file, a symlink
# to root's secret and a FIFO (each put in place by a rename: the name always exists).
FLIPPER = """
import os, sys
os.chdir(sys.argv[1])
secret = sys.argv[2]
while True:
    os.symlink(secret, "link.tmp"); os.rename("link.tmp", "config.json")
    with open("file.tmp", "w") as f: f.write('{"model_type": "test"}')
    os.rename("file.tmp", "config.json")
    os.mkfifo("fifo.tmp"); os.rename("fifo.tmp", "config.json")
    with open("file.tmp", "w") as f: f.write('{"model_type": "test"}')
    os.rename("file.tmp", "config.json")
"""

# Run as root: the companion files found and read, many times over, while the flipper runs.
SCANNER = """
import sys
import time
from pathlib import Path
from tensorfs.views.companions import CompanionError, CompanionFiles
from tensorfs.views.local_files import find_companions
from tensorfs.opening.view_files import ViewRule
for _ in range(int(sys.argv[2])):
    found = find_companions(Path(sys.argv[1]), ViewRule(folder=False)).companions
    files = CompanionFiles(found)
    for companion in found:
        try:
            data = files.read(companion.path, 0, companion.size)
        except CompanionError:
            continue
        if b"only root" in data:
            sys.exit("LEAK: " + companion.path)
    files.close()
print("done")
"""


def test_companions_swapped_while_scanned_never_leak_nor_hang(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path
) -> None:
    """The other user swaps config.json for a symlink to root's secret and for a FIFO while root
    scans and reads the companion files: each is opened once, never followed out, never waited on."""
    secret = root_only(tmp_path)
    model = shared_dir / "model"
    users_model(model, other_user)
    flipper = subprocess.Popen(
        [other_user.python, "-c", FLIPPER, str(model), str(secret)], preexec_fn=other_user.become
    )
    try:
        scanned = subprocess.run(
            [sys.executable, "-c", SCANNER, str(model), "2000"], capture_output=True, text=True, timeout=patience(90)
        )
    finally:
        flipper.kill()
        flipper.wait()
    assert scanned.returncode == 0, scanned.stderr[-2000:]
    assert scanned.stdout == "done\n"


def test_a_companion_changed_after_the_mount_is_refused_not_followed(
    mounts: Mounts, other_user: OtherUser, shared_dir: Path, tmp_path: Path
) -> None:
    """Served from the file at its path when read, and only while that file holds what it held: swapped
    for a symlink to root's secret, or for a FIFO, it reads EIO through the mount (-o allow_other), at once."""
    secret = root_only(tmp_path)
    model = shared_dir / "model"
    users_model(model, other_user)
    mountpoint = shared_dir / "mnt"
    mountpoint.mkdir()
    mounts.mount(model, "-o", "allow_other", mountpoint=mountpoint)
    config = mountpoint / ".tensorfs" / "model" / "config.json"
    read = other_user.run("cat", str(config), timeout=30)
    assert read.returncode == 0 and read.stdout == '{"model_type": "test"}'
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(secret)
    other_user.owns(model / "config.json")
    drop_caches()
    read = other_user.run("cat", str(config), timeout=30)
    assert read.returncode != 0 and "Input/output error" in read.stderr and "only root" not in read.stdout
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    drop_caches()
    read = other_user.run("cat", str(config), timeout=30)  # no hang
    assert read.returncode != 0 and "Input/output error" in read.stderr


def test_a_shard_is_never_a_symlink_out_of_the_model_directory(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path
) -> None:
    """A shard found by an index (or a glob) that is a symlink out of the directory would be served,
    under -o umask=, to everyone: it is refused by name."""
    private = tmp_path / "private.safetensors"
    write_reference(private, {"secret": ("U8", [8], b"rootonly")})
    private.chmod(0o600)
    model = shared_dir / "model"
    users_model(model, other_user)
    (model / "model.safetensors").rename(model / "own.safetensors")  # no model.safetensors: every *.safetensors
    (model / "private.safetensors").symlink_to(private)
    result = cli("ls", "--no-cache", str(model))
    assert result.returncode == 1
    assert (
        result.stderr
        == f"error: {model / 'private.safetensors'}: cannot open: a symlink out of the model's directory\n"
    )


def test_a_cache_directory_another_user_can_write_is_refused(
    other_user: OtherUser, shared_dir: Path, nginx: Nginx, tmp_path: Path
) -> None:
    """A cache directory that another user can write (or owns) is refused, with a symlink planted in
    it as the object's cache file: root's file it leads to is neither extended nor overwritten."""
    directory = nginx.root / "planted"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"w": ("U8", [MIB], random_bytes(MIB, 2))})
    url = f"{nginx.url}/planted/m.safetensors"
    assert cli("ls", "--cache-dir", str(tmp_path / "mine"), url).returncode == 0
    (name,) = os.listdir(tmp_path / "mine" / "objects")  # what the object's cache file is called
    victim = tmp_path / "victim"  # root's, and not to be touched
    victim.write_bytes(b"root's own file\n")
    victim.chmod(0o600)
    everyone = shared_dir / "everyone"
    (everyone / "objects").mkdir(parents=True)
    everyone.chmod(0o777)
    (everyone / "objects").chmod(0o777)
    theirs = shared_dir / "theirs"
    (theirs / "objects").mkdir(parents=True)
    for planted in (everyone, theirs):
        (planted / "objects" / name).symlink_to(victim)
    other_user.owns(theirs, theirs / "objects", theirs / "objects" / name, everyone / "objects" / name)
    for cache, why in ((everyone, "is writable by every user"), (theirs, f"belongs to user {other_user.uid}")):
        for command in ("ls", "manifest"):
            result = cli(command, "--cache-dir", str(cache), url)
            assert result.returncode == 1, result.stderr
            assert result.stderr.startswith(f"error: the cache {cache} {why}") and result.stderr.count("\n") == 1
    assert victim.read_bytes() == b"root's own file\n"  # neither extended nor overwritten
    local = tmp_path / "local"
    local.mkdir()
    tensors = {f"b{i}": ("U8", [1], bytes(1)) for i in range(WORTH_CACHING // 32)}  # a header worth caching
    write_reference(local / "m.safetensors", {"w": ("U8", [MIB], random_bytes(MIB, 3)), **tensors})
    hashed = cli("manifest", "--cache-dir", str(everyone), str(local))  # the header and hash caches: not used
    assert hashed.returncode == 0, hashed.stderr
    assert f"the header cache's directory {everyone} is writable by every user" in hashed.stderr
    assert f"the hash cache's directory {everyone} is writable by every user" in hashed.stderr
    assert sorted(os.listdir(everyone)) == ["objects"]  # nothing written there


@pytest.mark.usefixtures("machine_held")  # it makes a name in /tmp for a while (see test_leftovers)
def test_a_record_forged_by_another_user_never_gets_a_process_signalled(
    mounts: Mounts, other_user: OtherUser, tmp_path: Path
) -> None:
    """Root's umount of a hung mount whose record it cannot find in its own directory looks in every
    user's: a record that another user planted there, naming a process of root's, is not believed."""
    model = tmp_path / "model"
    model.mkdir()
    write_reference(model / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    mountpoint = mounts.mount(model)
    daemon = mounts.daemon_pid(mountpoint)
    victim = subprocess.Popen(["sleep", "600"])  # root's, and nothing to do with the mount
    forged = Path(f"/tmp/tensorfs-{other_user.uid}")  # where that user's runtime directory is by default
    made = not forged.exists()  # (if it has one there already, it is left as it was)
    planted = forged / f"{escape_path(mountpoint)}.json"
    try:
        forged.mkdir(mode=0o700, exist_ok=True)
        if made:
            other_user.owns(forged)
        record = {"pid": victim.pid, "process_start": process_start(victim.pid), "mountpoint": str(mountpoint)}
        planted.write_text(json.dumps(record))
        other_user.owns(planted)
        os.kill(daemon, signal.SIGSTOP)  # hung: umount will want to stop its daemon
        elsewhere = {**os.environ, "TENSORFS_RUNTIME_DIR": str(tmp_path / "elsewhere")}
        result = cli("umount", str(mountpoint), env=elsewhere)
        assert result.returncode == 1 and "has no record here to find it by" in result.stderr, result.stderr
        assert victim.poll() is None  # alive: the forged record named it
    finally:
        os.kill(daemon, signal.SIGCONT)
        victim.kill()
        victim.wait()
        planted.unlink(missing_ok=True)
        if made:
            forged.rmdir()


def test_credentials_in_a_url_are_refused_and_never_shown(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    hidden = "hunter2-secret"
    url = f"http://reader:{hidden}@127.0.0.1:{nginx.port}/m.safetensors"
    model = tmp_path / "m.safetensors"
    write_reference(model, {"w": ("U8", [4], b"abcd")})
    for args in (
        ["validate", url],
        ["validate", "--endpoint-url", f"http://reader:{hidden}@127.0.0.1:{nginx.port}", "s3://bucket/m"],
        ["verify", "--manifest", f"http://reader:{hidden}@127.0.0.1:{nginx.port}/tensors.sha256", str(model)],
    ):
        result = cli(*args)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert hidden not in result.stderr and "***@" in result.stderr and "AWS_ACCESS_KEY_ID" in result.stderr
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(url, mountpoint=mountpoint)
    assert result.returncode == 1 and hidden not in result.stderr
    assert not os.path.ismount(mountpoint) and hidden not in Path("/proc/self/mountinfo").read_text()
    # A fallback passes the same check as the model, before any daemon (whose command line every user
    # may read) is started: refused in one line, nothing mounted.
    result = mounts.attempt(model, "--fallback", url, mountpoint=mountpoint)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert hidden not in result.stderr and "***@" in result.stderr and "AWS_ACCESS_KEY_ID" in result.stderr
    assert not os.path.ismount(mountpoint)
    with pytest.raises(InvalidModelError) as refused:  # and in-process, for the loader alike
        open_model(model, fallback=[url])
    assert hidden not in str(refused.value) and "***@" in str(refused.value)


def test_a_urls_password_is_never_shown_in_an_error(tmp_path: Path) -> None:
    """A URL with a password given where tensorfs does not refuse it first (mount(8)'s `-o fallback=`,
    an option's bad value): whatever the error, the password is not in it."""
    hidden = "hunter2-secret"
    url = f"http://reader:{hidden}@127.0.0.1:1/m.safetensors"
    model = tmp_path / "m.safetensors"
    write_reference(model, {"w": ("U8", [4], b"abcd")})
    missing = str(tmp_path / "not-a-mountpoint")  # nothing can be mounted
    for args in (
        [str(model), missing, "extra", "-o", f"fallback={url}"],  # mount(8)'s helper: a usage error
        [str(model), missing, "-o", f"fallback=http://reader:{hidden[:4]},{hidden[4:]}@127.0.0.1:1/m.safetensors"],
        [str(model), missing, "-o", f"fallback={url},cache_size={url}"],  # a bad value, quoted by the error
        ["mount", "--layers", url, str(model), missing],
        ["mount", "--metrics", url, str(model), missing],
    ):
        result = cli(*args, timeout=60)
        assert result.returncode in (1, 2) and result.stderr, (args, result.stderr)
        assert hidden[:4] not in result.stderr and hidden[4:] not in result.stderr, (args, result.stderr)


# The daemon's log (text and JSON) and its record, of an error whose text holds a URL's password.
LOGGED_AND_RECORDED = """
import logging, sys
from pathlib import Path
from tensorfs.mount.logs import setup_logging
from tensorfs.mount.runtime import write_record
url, directory = sys.argv[1], Path(sys.argv[2])
for form in ("text", "json"):
    setup_logging(directory / f"{form}.log", debug=False, log_format=form)
    logging.getLogger("tensorfs").error("fallback %s: unreachable", url)
    logging.getLogger().handlers[0].flush()
write_record(directory / "mnt", {"mountpoint": str(directory / "mnt"), "error": f"the daemon failed: {url!r}"})
"""


def test_a_urls_password_is_never_in_a_log_line_nor_a_record(tmp_path: Path) -> None:
    hidden = "hunter2-secret"
    env = {**os.environ, "TENSORFS_RUNTIME_DIR": str(tmp_path / "run")}
    url = f"https://reader:{hidden}@models.example/m.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", LOGGED_AND_RECORDED, url, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    written = [tmp_path / "text.log", tmp_path / "json.log", *(tmp_path / "run").glob("*.json")]
    assert len(written) == 3
    for path in written:
        text = path.read_text()
        assert hidden not in text and "https://***@models.example/m.safetensors" in text, (path, text)


def test_what_tensorfs_writes_is_its_owners_alone(mounts: Mounts, nginx: Nginx, tmp_path: Path) -> None:
    directory = nginx.root / "modes"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"w": ("U8", [MIB], random_bytes(MIB, 4))})
    cache = tmp_path / "cache"
    metrics = tmp_path / "metrics.sock"
    mountpoint = mounts.mount(
        f"{nginx.url}/modes/m.safetensors",
        "--cache-dir",
        str(cache),
        "--metrics",
        f"unix:{metrics}",  # type: ignore[arg-type]
    )
    assert (mountpoint / "w").read_bytes()
    assert cli("manifest", "--cache-dir", str(cache), f"{nginx.url}/modes/m.safetensors").returncode == 0
    runtime = Path(os.environ["TENSORFS_RUNTIME_DIR"])
    written = [mounts.log_file, runtime / f"{escape_path(mountpoint)}.json", *cache.glob("*.sqlite*"), metrics]
    assert len(written) >= 5
    for path in written:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
    with socket.socket(socket.AF_UNIX) as client:  # the metrics, over the socket only its owner can use
        client.connect(str(metrics))
        client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    assert b"200 OK" in answer.split(b"\r\n")[0] and b"tensorfs_requests_total" in answer
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    assert not metrics.exists()


def test_a_remote_model_is_its_mounting_users_unless_said_otherwise(
    mounts: Mounts, other_user: OtherUser, shared_dir: Path, nginx: Nginx, tmp_path: Path
) -> None:
    directory = nginx.root / "private-bucket"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"w": ("U8", [4096], random_bytes(4096, 5))})
    url = f"{nginx.url}/private-bucket/m.safetensors"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    closed = shared_dir / "closed"
    closed.mkdir()
    mounts.mount(url, "-o", "allow_other", *cache, mountpoint=closed)  # type: ignore[arg-type]
    assert stat.S_IMODE((closed / "w").stat().st_mode) == 0o400
    denied = other_user.run("cat", str(closed / "w"), text=False, timeout=30)
    assert denied.returncode != 0 and b"Permission denied" in denied.stderr
    shared = shared_dir / "shared"
    shared.mkdir()
    mounts.mount(url, "-o", "allow_other,umask=0222", *cache, mountpoint=shared)  # type: ignore[arg-type]
    assert stat.S_IMODE((shared / "w").stat().st_mode) == 0o444
    assert other_user.run("cat", str(shared / "w"), text=False, timeout=30).returncode == 0


def test_s3_without_credentials_or_with_wrong_ones_gets_the_same_hint(seaweedfs: SeaweedFS, bucket: str) -> None:
    endpoint = seaweedfs.endpoint
    kept = ("AWS_METADATA_ENDPOINT", "AWS_EC2_METADATA_DISABLED")  # (no request for instance metadata)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in kept}
    wrong = {**plain, "AWS_ACCESS_KEY_ID": "tensorfs-test", "AWS_SECRET_ACCESS_KEY": "wrong", "AWS_REGION": "us-east-1"}
    hints = []
    for env in (plain, wrong):
        result = cli("validate", "--remote-timeout", "3", "--endpoint-url", endpoint, f"s3://{bucket}/m", env=env)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        hints.append(result.stderr.partition("): ")[2] or result.stderr.partition("found: ")[2])
    s3_hint = (
        "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the bucket's policy"
    )
    assert all(s3_hint in h for h in hints), hints


def test_an_index_or_manifest_planted_in_a_model_directory_is_not_followed_nor_waited_on(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path
) -> None:
    """The other user makes the model's index or its tensors.sha256 a FIFO (which would block an
    open until a writer comes: forever), or a symlink to root's secret: each is refused at once."""
    secret = root_only(tmp_path)
    model = shared_dir / "model"
    users_model(model, other_user)
    manifest = model / "tensors.sha256"
    os.mkfifo(manifest)
    result = cli("verify", str(model), timeout=30)
    assert result.returncode == 1 and result.stderr == f"error: {manifest}: not a regular file\n"
    manifest.unlink()
    manifest.symlink_to(secret)
    result = cli("verify", str(model), timeout=30)
    assert result.returncode == 1 and "only root" not in result.stderr
    assert result.stderr == f"error: {manifest}: cannot read: a symlink out of the model's directory\n"
    manifest.unlink()
    (model / "model.safetensors").rename(model / "own.safetensors")  # the index is the model's, then
    index = model / "model.safetensors.index.json"
    os.mkfifo(index)
    result = cli("validate", "--no-cache", str(model), timeout=30)
    assert result.returncode == 1 and result.stderr == f"error: {index}: cannot read: not a regular file\n"
    index.unlink()
    index.symlink_to(secret)
    result = cli("validate", "--no-cache", str(model), timeout=30)
    assert result.returncode == 1 and "only root" not in result.stderr
    assert result.stderr == f"error: {index}: cannot read: a symlink out of the model's directory\n"


# -- writing where the user said: the one writer -------------------------------------------------


def their_directory(shared_dir: Path, user: OtherUser) -> Path:
    """A directory of the other user's, where root is asked to write (/tmp/theirs/...)."""
    directory = shared_dir / "theirs"
    directory.mkdir()
    user.owns(directory)
    return directory


def root_only_file(tmp_path: Path) -> Path:
    """Root's own file, 0600, in a 0700 directory: not to be touched."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = private / "victim"
    victim.write_bytes(b"root's own file\n")
    victim.chmod(0o600)
    return victim


def as_user(user: OtherUser, code: str, *args: str) -> None:
    """Python `code` run as the other user (with `args` as sys.argv[1:]); it must succeed."""
    done = user.run(user.python, "-c", code, *args, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "point",
    ["tensorfs.model:Model.write_safetensors", "tensorfs.utils.progress:Progress.advance"],
    ids=["after-the-check", "mid-write"],
)
def test_an_export_never_writes_through_a_symlink_planted_after_its_check(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path, point: str
) -> None:
    """Root exports a model to a new file in the other user's directory; they plant a symlink to
    root's 0600 file there once the command has checked that the name is free: after the check, or
    in the middle of the write. Root's file is untouched, the link stays theirs, one line says why."""
    victim = root_only_file(tmp_path)
    write_reference(tmp_path / "m.safetensors", {"w": ("U8", [2 * MIB], random_bytes(2 * MIB, 6))})
    dest = their_directory(shared_dir, other_user) / "out.safetensors"
    when = WRITING if point.endswith("Progress.advance") else "True"
    export = HeldCommand(point, "export", str(tmp_path / "m.safetensors"), str(dest), when=when)
    try:
        assert export.said() == "held"
        as_user(other_user, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), str(dest))
        export.go()
        code, stderr = export.ended()
    finally:
        export.stop()
    assert (code, stderr) == (1, f"error: {dest}: already exists; name a new file\n")
    assert victim.read_bytes() == b"root's own file\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert os.readlink(dest) == str(victim) and os.listdir(dest.parent) == [dest.name]  # no partial left


def test_an_export_directory_swapped_for_a_symlink_mid_write_writes_nothing_through_it(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path
) -> None:
    """Root exports the other user's model (its tokenizer.json a cron line) to a new directory in
    the other user's directory; mid-write they move the partial directory away and put a symlink to
    a root-only directory in its place. Nothing is written there: the export is refused in one line,
    and what it had written is removed."""
    cron = tmp_path / "cron.d"
    cron.mkdir(mode=0o700)
    model = shared_dir / "model"
    users_model(model, other_user)
    (model / "tokenizer.json").write_text("* * * * * root sh /tmp/theirs/payload\n")  # after model.safetensors
    other_user.owns(model / "tokenizer.json")
    drop = their_directory(shared_dir, other_user)
    dest = drop / "out"
    export = HeldCommand("tensorfs.utils.progress:Progress.advance", "export", str(model), str(dest), when=WRITING)
    try:
        assert export.said() == "held"  # config.json and the model's first bytes written
        swap = """
import os, sys
drop, target = sys.argv[1], sys.argv[2]
(partial,) = [name for name in os.listdir(drop) if name.startswith(".out.") and name.endswith(".partial")]
os.rename(os.path.join(drop, partial), os.path.join(drop, "moved"))
os.symlink(target, os.path.join(drop, partial))
print(partial)
"""
        done = other_user.run(other_user.python, "-c", swap, str(drop), str(cron), timeout=30)
        assert done.returncode == 0, done.stderr
        partial = done.stdout.strip()
        export.go()
        code, stderr = export.ended()
    finally:
        export.stop()
    assert os.listdir(cron) == []  # nothing written through the link
    expected = f"error: cannot write {dest}: its partial directory {partial} was moved or replaced while it was written"
    assert code == 1 and stderr.startswith(expected) and stderr.count("\n") == 1, stderr
    assert not dest.exists() and not dest.is_symlink()
    assert os.listdir(drop / "moved") == []  # what it wrote, emptied through its own descriptor
    assert os.readlink(drop / partial) == str(cron)  # theirs, left as it is


# The other user's reader of a FIFO: opened without waiting for a writer, it says "ready", and once
# told to go prints whatever a writer put in the FIFO meanwhile.
FIFO_READER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
print("ready", flush=True)
sys.stdin.readline()
try:
    print(os.read(fd, 1 << 20).decode(), end="", flush=True)
except BlockingIOError:
    pass
"""


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_manifest_output_never_goes_into_a_fifo(
    other_user: OtherUser, shared_dir: Path, tmp_path: Path, planted: str
) -> None:
    """`manifest -o OUT` where the other user made OUT a FIFO they read, or a symlink to one: root
    writes nothing into it (one line says why), and the FIFO gets nothing."""
    model = tmp_path / "m.safetensors"
    write_reference(model, {"w": ("U8", [16], bytes(16))})
    drop = their_directory(shared_dir, other_user)
    fifo, out = drop / "pipe", drop / "m.sha256"
    if planted == "symlink":
        as_user(other_user, "import os, sys; os.mkfifo(sys.argv[1]); os.symlink(*sys.argv[1:])", str(fifo), str(out))
    else:
        as_user(other_user, "import os, sys; os.mkfifo(sys.argv[1])", str(out))
    reader = subprocess.Popen(
        [other_user.python, "-c", FIFO_READER, str(out if planted == "fifo" else fifo)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=other_user.become,
    )  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "ready\n"
        result = cli("manifest", "--no-cache", "-o", str(out), str(model), timeout=60)
        got, _ = reader.communicate("go\n", timeout=30)
    finally:
        reader.kill()
        reader.wait()
    why = "a symlink (tensorfs never writes through one" if planted == "symlink" else "not a regular file"
    assert result.returncode == 1 and result.stderr.startswith(f"error: cannot write {out}: {why}"), result.stderr
    assert result.stderr.count("\n") == 1 and got == ""
    assert sorted(os.listdir(drop)) == sorted({fifo.name if planted == "symlink" else out.name, out.name})


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_log_file_is_never_written_through_a_symlink_nor_into_a_fifo(
    mounts: Mounts, other_user: OtherUser, shared_dir: Path, tmp_path: Path, planted: str
) -> None:
    """`mount --log-file LOG` in the other user's directory, where they made LOG a symlink to root's
    0600 file, or a FIFO: refused in one line before anything is mounted, root's file not extended."""
    victim = root_only_file(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    write_reference(model / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    log = their_directory(shared_dir, other_user) / "daemon.log"
    make = "os.symlink(sys.argv[1], sys.argv[2])" if planted == "symlink" else "os.mkfifo(sys.argv[2])"
    as_user(other_user, f"import os, sys; {make}", str(victim), str(log))
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(model, "--log-file", str(log), mountpoint=mountpoint)
    why = "a symlink" if planted == "symlink" else "not a regular file"
    assert (result.returncode, result.stderr) == (1, f"error: cannot write the log file {log}: {why}\n")
    assert not os.path.ismount(mountpoint) and victim.read_bytes() == b"root's own file\n"


# -- identities and secrets ---------------------------------------------------------------------


def test_a_dead_mounts_log_is_read_only_if_it_is_a_regular_file_of_the_records_user(
    other_user: OtherUser, tmp_path: Path
) -> None:
    """Why a dead daemon died is the last ERROR of its record's log_file: read only when that is a
    regular file of the record's user's, opened without following a link or waiting on a FIFO. A
    link to it, a FIFO (nobody ever writes it: a wait would be forever), and the same file for a
    record of another user's say nothing; the file itself, for its own user's record, says the line."""
    log = tmp_path / "daemon.log"
    log.write_text("2026-12-02 tensorfs[4242] INFO serving\n2026-12-02 tensorfs[4242] ERROR the shard went away\n")
    other_user.owns(log)
    (tmp_path / "link").symlink_to(log)
    os.mkfifo(tmp_path / "fifo")
    other_user.owns(tmp_path / "fifo")
    assert last_error(str(log), 4242, other_user.uid) == "the shard went away"
    assert last_error(str(log), 4242, os.geteuid()) is None  # a record of root's, naming their file
    assert last_error(str(tmp_path / "link"), 4242, other_user.uid) is None
    assert last_error(str(tmp_path / "fifo"), 4242, other_user.uid) is None
    assert last_error(str(log), 4243, other_user.uid) is None  # another daemon's lines


@pytest.mark.usefixtures("machine_held")  # it makes a name in /tmp for a while (see test_leftovers)
def test_status_never_shows_a_record_another_user_forged(mounts: Mounts, other_user: OtherUser, tmp_path: Path) -> None:
    """Root's record of its mount is elsewhere (another TENSORFS_RUNTIME_DIR); the other user plants a
    record of it in their own runtime directory, naming root's very daemon (its pid and start time,
    which anyone may read) with another source and size. `tensorfs status` shows none of it."""
    model = tmp_path / "model"
    model.mkdir()
    write_reference(model / "m.safetensors", {"w": ("U8", [16], bytes(16))})
    mountpoint = mounts.mount(model)
    daemon = mounts.daemon_pid(mountpoint)
    forged = Path(f"/tmp/tensorfs-{other_user.uid}")  # where that user's runtime directory is by default
    made = not forged.exists()
    planted = forged / f"{escape_path(mountpoint)}.json"
    record = {
        "pid": daemon, "process_start": process_start(daemon), "mountpoint": str(mountpoint),
        "source": "/etc/shadow", "tensors": 999, "bytes": 999, "log_file": "/etc/shadow",
    }  # fmt: skip
    try:
        forged.mkdir(mode=0o700, exist_ok=True)
        if made:
            other_user.owns(forged)
        planted.write_text(json.dumps(record))
        other_user.owns(planted)
        elsewhere = {**os.environ, "TENSORFS_RUNTIME_DIR": str(tmp_path / "elsewhere")}
        shown = cli("status", str(mountpoint), env=elsewhere)
        as_json = cli("status", "--json", str(mountpoint), env=elsewhere)
    finally:
        planted.unlink(missing_ok=True)
        if made:
            forged.rmdir()
    assert shown.returncode == 0 and as_json.returncode == 0, shown.stderr + as_json.stderr
    assert "/etc/shadow" not in shown.stdout + as_json.stdout and "999" not in shown.stdout, shown.stdout
    document = json.loads(as_json.stdout)
    assert document["source"] == str(model) and document["state"] == "ok" and "tensors" not in document
    mine = cli("status", "--json", str(mountpoint))  # root's own record, where root keeps it, is believed
    assert json.loads(mine.stdout)["tensors"] == 1 and json.loads(mine.stdout)["pid"] == daemon


def test_a_companion_chmod_after_the_mount_is_followed(mounts: Mounts, other_user: OtherUser, shared_dir: Path) -> None:
    """Issue 55, item 3: a companion's mode was taken once at mount, so a config.json chmod-ed to 600
    after it stayed readable by every user of an -o allow_other mount (a shard's chmod is followed).
    Now it is followed as a shard's is: the other user is refused once the kernel asks again (within a
    second), and served again once it is 0644 again."""
    model = shared_dir / "model"
    model.mkdir()
    write_reference(model / "model.safetensors", {"w": ("U8", [64], random_bytes(64, 1))})
    (model / "config.json").write_text('{"model_type": "test"}')
    mountpoint = shared_dir / "mnt"
    mountpoint.mkdir()
    mounts.mount(model, "-o", "allow_other", mountpoint=mountpoint)
    config = mountpoint / ".tensorfs" / "model" / "config.json"
    assert other_user.run("cat", str(config), timeout=30).stdout == '{"model_type": "test"}'
    (model / "config.json").chmod(0o600)
    deadline = time.monotonic() + patience(30)
    while (read := other_user.run("cat", str(config), timeout=30)).returncode == 0:
        assert time.monotonic() < deadline, "a chmod of a companion was never followed"
        time.sleep(0.1)
    assert "Permission denied" in read.stderr and read.stdout == ""
    assert stat.S_IMODE(config.stat().st_mode) == 0o400  # (root sees it as it is)
    (model / "config.json").chmod(0o644)
    while (read := other_user.run("cat", str(config), timeout=30)).returncode != 0:
        assert time.monotonic() < deadline + patience(30), "a chmod back was never followed"
        time.sleep(0.1)
    assert read.stdout == '{"model_type": "test"}'
