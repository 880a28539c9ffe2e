"""The one writer (tensorfs/fs/writer.py) at the moments another user acts: the test's own write
callback is the handshake, so what it plants is planted while the file is being written, every run."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from tensorfs.fs import writer as files
from tensorfs.fs.writer import WriteError, write_whole


def victim_file(directory: Path) -> Path:
    victim = directory / "victim"
    victim.write_bytes(b"someone's own file\n")
    victim.chmod(0o600)
    return victim


def partials(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".partial")]


def test_a_symlink_planted_where_a_file_is_replaced_is_replaced_never_followed(tmp_path: Path) -> None:
    """A regular file is to be replaced (`manifest -o`, `bench --json`, a record): while the new one
    is written, the old one is swapped for a symlink to another file. The link's name gets the new
    file; the file it pointed to is untouched."""
    victim = victim_file(tmp_path)
    out = tmp_path / "out.json"
    out.write_text("the old one\n")

    def write(f: BinaryIO) -> None:
        f.write(b"the new one\n")
        out.unlink()
        out.symlink_to(victim)  # planted mid-write

    write_whole(out, write)
    assert not out.is_symlink() and out.read_bytes() == b"the new one\n"
    assert victim.read_bytes() == b"someone's own file\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert partials(tmp_path) == []


def test_a_file_partial_swapped_mid_write_is_refused_and_what_was_written_taken_back(tmp_path: Path) -> None:
    """Mid-write, the partial file is moved away and a symlink to another file put in its place: the
    write is refused in one line naming the partial, nothing is renamed into place (neither the link
    nor the moved file), and what was written is emptied through the writer's own descriptor, in
    the moved file too."""
    victim = victim_file(tmp_path)
    out = tmp_path / "out.safetensors"
    moved = tmp_path / "moved"
    swapped: list[str] = []

    def write(f: BinaryIO) -> None:
        f.write(b"a private line\n")
        f.flush()
        (partial,) = partials(tmp_path)
        os.rename(tmp_path / partial, moved)
        os.symlink(victim, tmp_path / partial)
        swapped.append(partial)

    with pytest.raises(WriteError) as refused:
        write_whole(out, write, replace=False)
    assert str(refused.value) == (
        f"cannot write {out}: its partial file {swapped[0]} was moved or replaced while it was written "
        "(by someone else who can write its directory)"
    )
    assert not os.path.lexists(out)
    assert moved.read_bytes() == b""  # taken back, wherever its name went
    assert victim.read_bytes() == b"someone's own file\n"
    assert os.readlink(tmp_path / swapped[0]) == str(victim)  # theirs, left as they made it


@pytest.fixture
def without_rename_noreplace(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A file system without RENAME_NOREPLACE (NFS, some FUSE): renameat2 with it fails EINVAL. The
    flags of every renameat2 asked are kept."""
    asked: list[int] = []
    real = files.renameat2

    def renameat2(olddirfd: int, oldpath: str, newdirfd: int, newpath: str, flags: int) -> None:
        asked.append(flags)
        if flags & files.RENAME_NOREPLACE:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real(olddirfd, oldpath, newdirfd, newpath, flags)

    monkeypatch.setattr(files, "renameat2", renameat2)
    return asked


def test_without_rename_noreplace_a_new_file_is_linked_into_place(
    tmp_path: Path, without_rename_noreplace: list[int]
) -> None:
    out = tmp_path / "out.safetensors"
    write_whole(out, lambda f: f.write(b"the model\n"), replace=False)
    assert out.read_bytes() == b"the model\n" and out.stat().st_nlink == 1  # the partial's name unlinked
    assert partials(tmp_path) == [] and without_rename_noreplace == [files.RENAME_NOREPLACE]


def test_without_rename_noreplace_what_was_planted_meanwhile_is_never_replaced(
    tmp_path: Path, without_rename_noreplace: list[int]
) -> None:
    """The name is free when checked; another user plants a symlink there while the file is written.
    Without RENAME_NOREPLACE the writer links its file into place, and a link never replaces: "already
    exists", the planted link and what it points to untouched, nothing left of the partial."""
    victim = victim_file(tmp_path)
    out = tmp_path / "out.safetensors"

    def write(f: BinaryIO) -> None:
        f.write(b"the model\n")
        out.symlink_to(victim)

    with pytest.raises(WriteError, match=r"^.*out\.safetensors: already exists; name a new file$"):
        write_whole(out, write, replace=False)
    assert os.readlink(out) == str(victim) and victim.read_bytes() == b"someone's own file\n"
    assert partials(tmp_path) == [] and without_rename_noreplace == [files.RENAME_NOREPLACE]


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_partial_name_taken_beforehand_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """Another user guessed the partial's name and planted a symlink to another file there (or a file
    of her own, that she can read): the writer never opens what is there (O_EXCL|O_NOFOLLOW), it takes
    another name; the file planted or pointed to is untouched, and the output is whole."""
    victim = victim_file(tmp_path)
    out = tmp_path / "out.json"
    names = iter([".out.json.guessed.partial", ".out.json.fresh.partial"])
    monkeypatch.setattr(files._Destination, "_partial_name", lambda self: next(names))
    guessed = tmp_path / ".out.json.guessed.partial"
    if planted == "symlink":
        guessed.symlink_to(victim)
    else:
        guessed.write_bytes(b"hers\n")
    write_whole(out, lambda f: f.write(b"the model\n"))
    assert out.read_bytes() == b"the model\n"
    assert victim.read_bytes() == b"someone's own file\n"
    if planted == "file":
        assert guessed.read_bytes() == b"hers\n"
    else:
        assert guessed.is_symlink()
