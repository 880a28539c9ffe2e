"""The model directory view (.tensorfs/model/): the model's own folder (its weights files as they are,
its companion files), and synthesized safetensors files (a selection, --view merged), read by the
reference reader; and the same files written to disk (export, Model.write_safetensors)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
from safetensors import safe_open

import tensorfs
from conftest import Mounts, drop_caches, wait_until
from helpers import (
    MIB,
    cli,
    every_dtype_tensors,
    fingerprints_pending,
    patience,
    random_bytes,
    read_line,
    reference_tensors,
    sharded_every_dtype,
    write_index,
    write_reference,
)
from tensorfs.views import Piece, SynthesizedFile, shared_metadata, split


def header_of(data: bytes) -> tuple[int, dict[str, object]]:
    length = struct.unpack("<Q", data[:8])[0]
    return length, json.loads(data[8 : 8 + length])


def assemble(model: tensorfs.Model, synthesized: SynthesizedFile, start: int, end: int) -> bytes:
    parts = []
    for piece in synthesized.pieces(start, end):
        if isinstance(piece, Piece):
            parts.append(
                bytes(
                    model.shard_data(piece.shard).view[
                        piece.shard_offset : piece.shard_offset + piece.end - piece.start
                    ]
                )
            )
        else:
            parts.append(piece)
    return b"".join(parts)


def test_a_synthesized_file_is_what_the_reference_writer_lays_out(tmp_path: Path) -> None:
    tensors = every_dtype_tensors(seed=5)
    tensors["b.u8"] = ("U8", [3], b"xyz")  # an odd size before other one-byte tensors
    write_reference(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    with tensorfs.open_model(tmp_path / "a.safetensors") as model:
        synthesized = SynthesizedFile(model, model.gate, model.sorted_names, {"format": "pt"})
        data = assemble(model, synthesized, 0, synthesized.size)
        assert len(data) == synthesized.size
        for start in range(0, synthesized.size, 41):  # any range is covered by its pieces, in order
            assert assemble(model, synthesized, start, start + 97) == data[start : start + 97]
    (tmp_path / "out.safetensors").write_bytes(data)
    assert reference_tensors(tmp_path / "out.safetensors") == reference_tensors(tmp_path / "a.safetensors")
    length, header = header_of(data)
    reference_length, reference_header = header_of((tmp_path / "a.safetensors").read_bytes())
    assert length % 8 == 0 and (length, header) == (reference_length, reference_header)  # same offsets
    assert list(header) == ["__metadata__", *sorted(tensors)]  # keys by name
    assert data[8 + length :] == (tmp_path / "a.safetensors").read_bytes()[8 + length :]


def test_metadata_is_carried_over_only_when_the_shards_agree(tmp_path: Path) -> None:
    for name, first, second, expected in [
        ("same", {"format": "pt"}, {"format": "pt"}, {"format": "pt"}),
        ("differ", {"format": "pt"}, {"format": "np"}, None),
        ("one", {"format": "pt"}, None, None),
        ("none", None, None, None),
    ]:
        directory = tmp_path / name
        directory.mkdir()
        write_reference(directory / "a.safetensors", {"x": ("U8", [1], b"x")}, first)
        write_reference(directory / "b.safetensors", {"y": ("U8", [1], b"y")}, second)
        with tensorfs.open_model(directory) as model:
            assert shared_metadata(model) == expected, name


def test_split_into_runs_of_about_equal_bytes() -> None:
    names = [f"t{i}" for i in range(10)]
    assert split(names, [10] * 10, 1) == [names]
    assert split(names, [10] * 10, 3) == [names[:3], names[3:7], names[7:]]
    assert split(names, [100] + [1] * 9, 2) == [names[:1], names[1:]]
    assert split(names[:2], [1, 1], 5) == [["t0"], ["t1"]]  # never an empty file
    assert len(split(names, [1] * 10, 10)) == 10 and len(split(names, [1] * 9 + [100], 3)) == 3  # as many as asked


@pytest.mark.parametrize("selected", [False, True])
def test_write_safetensors_and_export(mounts: Mounts, tmp_path: Path, selected: bool) -> None:
    expected = sharded_every_dtype(tmp_path / "m")
    include = ["t.*", "layers/2/*", "scalar", "empty"] if selected else []
    with tensorfs.open_model(tmp_path / "m", include=include) as model:
        model.write_safetensors(tmp_path / "one.safetensors")
        names = model.names()
    got = reference_tensors(tmp_path / "one.safetensors")
    assert sorted(got) == names and all(got[name][2] == expected[name] for name in names)
    assert not list(tmp_path.glob(".*partial*"))
    options = [f"--include={glob}" for glob in include]
    (tmp_path / "m" / "config.json").write_text('{"model_type": "test"}')
    result = mounts.run("export", *options, "--view-shards", "3", str(tmp_path / "m"), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    base = "selected" if selected else "model"  # a selection is not named as a whole model is
    index_name = "selected.safetensors.index.partial.json" if selected else "model.safetensors.index.json"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        f"{base}-00001-of-00003.safetensors",
        f"{base}-00002-of-00003.safetensors",
        f"{base}-00003-of-00003.safetensors",
        index_name,
        "tensorfs-view.json",  # the note: synthesized, and why
    ]
    note = json.loads((tmp_path / "out" / "tensorfs-view.json").read_text())
    why = (
        f"a selection of the model's tensors ({' '.join(f'--include {g!r}' for g in include)})"
        if selected
        else ("the model's tensors in 3 files (--view-shards 3)")
    )
    assert note == {
        "synthesized": why,
        "source": str(tmp_path / "m"),
        "selection": why[len("a selection of the model's tensors (") : -1] if selected else None,
        "signature": None,
    }
    assert mounts.run("validate", str(tmp_path / "out")).returncode == 0
    index = json.loads((tmp_path / "out" / index_name).read_text())
    assert sorted(index["weight_map"]) == names
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        for name, (_, _, data) in reference_tensors(shard).items():
            assert index["weight_map"][name] == shard.name and data == expected[name]
    again = mounts.run("export", str(tmp_path / "m"), str(tmp_path / "out"))
    assert (
        again.returncode == 1 and again.stderr == f"error: {tmp_path / 'out'}: already exists; name a new directory\n"
    )


def test_writing_never_goes_over_what_is_not_a_model_file(mounts: Mounts, tmp_path: Path) -> None:
    write_reference(tmp_path / "a.safetensors", {"x": ("U8", [2], b"xy"), "y": ("U8", [1], b"z")})
    os.mkfifo(tmp_path / "fifo.safetensors")
    with tensorfs.open_model(tmp_path / "a.safetensors", include="x") as model:
        with pytest.raises(tensorfs.TensorfsError, match=r"fifo\.safetensors: not a regular file"):
            model.write_safetensors(tmp_path / "fifo.safetensors")
        with pytest.raises(tensorfs.TensorfsError, match="it is a shard of the model being written"):
            model.write_safetensors(tmp_path / "a.safetensors")
        (tmp_path / "link.safetensors").symlink_to(tmp_path / "old.safetensors")
        (tmp_path / "old.safetensors").write_bytes(b"old")
        with pytest.raises(tensorfs.TensorfsError, match=r"link\.safetensors: a symlink \(tensorfs never writes"):
            model.write_safetensors(tmp_path / "link.safetensors")  # never through a link
        model.write_safetensors(tmp_path / "old.safetensors")  # a regular file: replaced whole
        with pytest.raises(tensorfs.TensorfsError, match=r"old\.safetensors: already exists; name a new file"):
            model.write_safetensors(tmp_path / "old.safetensors", replace=False)
    assert (tmp_path / "link.safetensors").is_symlink()
    assert reference_tensors(tmp_path / "old.safetensors") == {"x": ("U8", [2], b"xy")}
    assert reference_tensors(tmp_path / "a.safetensors")["y"] == ("U8", [1], b"z")  # the source is whole
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "fifo.safetensors", "link.safetensors", "old.safetensors"]
    model_file = str(tmp_path / "a.safetensors")
    for dest in (model_file, str(tmp_path / "old.safetensors")):
        result = mounts.run("export", "--include", "x", model_file, dest)
        assert result.returncode == 1 and "already exists; name a new file" in result.stderr
    result = mounts.run("export", "--view-shards", "2", model_file, str(tmp_path / "new.safetensors"))
    assert result.returncode == 1 and "--view-shards needs a directory DEST" in result.stderr
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "tensorfs.cli", "export", model_file, str(tmp_path / "new.safetensors")],
            stdout=full, stderr=subprocess.PIPE, text=True, check=False,
        )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        1,
        f"error: wrote {tmp_path / 'new.safetensors'}, but cannot write to standard output: No space left on device\n",
    )


def test_a_signal_leaves_no_half_written_export(tmp_path: Path) -> None:
    from tensorfs.cli.output import ended_by_signals as _ended_by_signals
    from tensorfs.views import ViewSpec, build_view
    from tensorfs.views.export import write_view

    write_reference(tmp_path / "a.safetensors", {f"t{i}": ("U8", [MIB], random_bytes(MIB, i)) for i in range(4)})

    def terminated(_: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` or systemd stop it, mid-write

    with (
        tensorfs.open_model(tmp_path / "a.safetensors") as model,
        pytest.raises(SystemExit) as caught,
        _ended_by_signals(),
    ):
        write_view(build_view(model, model.gate, ViewSpec()), tmp_path / "out", terminated)
    assert caught.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


# `tensorfs export` held in the middle of writing: once its first bytes are written it says so on
# the pipe argv[1] and waits on its standard input, which only a signal ends.
EXPORT_HELD_MID_WRITE = """
import os, sys
import tensorfs.cli, tensorfs.utils.progress
advance = tensorfs.utils.progress.Progress.advance
def held(self, nbytes):
    advance(self, nbytes)
    if self.label == "writing" and not getattr(held, "said", False):  # not the validation's line
        held.said = True
        os.write(int(sys.argv[1]), b"writing\\n")
        sys.stdin.readline()
tensorfs.utils.progress.Progress.advance = held
sys.exit(tensorfs.cli.main(["export", *sys.argv[2:]]))
"""


@pytest.mark.parametrize(
    ("signum", "dest", "code", "said"),
    [(signal.SIGINT, "out.safetensors", 130, "\nAborted.\n"), (signal.SIGHUP, "out", 128 + signal.SIGHUP, "")],
    ids=["sigint-one-file", "sighup-directory"],
)
def test_export_interrupted_by_a_signal_leaves_nothing(
    tmp_path: Path, signum: int, dest: str, code: int, said: str
) -> None:
    """A real `tensorfs export` process, stopped mid-write by Ctrl-C (SIGINT) or a closed terminal
    (SIGHUP): nothing of DEST is left, half-written or whole, and the exit says it was interrupted."""
    source = tmp_path / "source"
    source.mkdir()
    write_reference(source / "a.safetensors", {f"t{i}": ("U8", [MIB], random_bytes(MIB, i)) for i in range(4)})
    work = tmp_path / "work"
    work.mkdir()
    read_end, write_end = os.pipe()
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORT_HELD_MID_WRITE, str(write_end), str(source), str(work / dest)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(write_end,),
    )  # fmt: skip
    os.close(write_end)
    try:
        assert read_line(read_end, 60, bytearray()) == "writing"
        assert os.listdir(work) != []  # mid-write: something of DEST is there
        exporter.send_signal(signum)
        stdout, stderr = exporter.communicate(timeout=patience(60))
        assert (exporter.returncode, stdout, stderr) == (code, "", said)  # click ends the ^C line first
        assert os.listdir(work) == []
    finally:
        os.close(read_end)
        if exporter.poll() is None:
            exporter.kill()
            exporter.communicate()


def companion_model(directory: Path) -> dict[str, bytes]:
    expected = sharded_every_dtype(directory)
    (directory / "config.json").write_text('{"architectures": ["Test"]}\n')
    (directory / "tokenizer.json").write_bytes(random_bytes(300_000, 7))
    (directory / "README.md").write_text("# a model\n")
    (directory / "private.json").write_text('{"token": "only for the owner"}')
    (directory / "private.json").chmod(0o600)
    (directory / "closed").mkdir()
    (directory / "closed" / "open.json").write_text("{}")  # 0644, but in a directory only its owner enters
    (directory / "closed").chmod(0o700)
    (directory / ".hidden").write_text("shown too")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text("{}")
    (directory / "1_Pooling" / "deeper").mkdir()
    (directory / "1_Pooling" / "deeper" / "x.json").write_text("{}")  # two levels down: shown too
    outside = directory.parent / "outside.txt"
    outside.write_text("secret")
    (directory / "leak.txt").symlink_to(outside)
    (directory / "inside.txt").symlink_to(directory / "README.md")
    with open(directory / "huge.bin", "wb") as huge:
        huge.truncate(65 * MIB)  # sparse: costs nothing
    return expected


def test_a_mount_serves_a_model_directory(mounts: Mounts, tmp_path: Path) -> None:
    """The view of a whole model is its folder: each shard and the index under its own name with its
    own bytes (reads within a tensor, across tensors and across the header alike), the manifest and
    the companion files beside them (no more readable than their sources; a symlink out of the
    folder left out; a file over 64 MiB, a hidden one and one two levels down in: issue 55). --view
    merged serves the model's tensors as one synthesized file instead, as write_safetensors writes it."""
    expected = companion_model(tmp_path / "m")
    manifest = mounts.run("manifest", "-o", str(tmp_path / "m" / "tensors.sha256"), str(tmp_path / "m"))
    assert manifest.returncode == 0
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(tmp_path / "m", "--log-file", str(mounts.log_file), mountpoint=mountpoint)
    assert result.returncode == 0, result.stderr
    assert f"warning: {tmp_path / 'm' / 'leak.txt'}: skipped: a symlink out of the model's directory" in result.stderr
    assert result.stderr.count("warning:") == 1, result.stderr
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == [
        ".hidden",
        "1_Pooling",
        "README.md",
        "closed",
        "config.json",
        "huge.bin",
        "inside.txt",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "private.json",
        "tensors.sha256",
        "tokenizer.json",
    ]
    assert stat.S_IMODE((view / "private.json").stat().st_mode) == 0o400  # no more readable than its source
    assert stat.S_IMODE((view / "config.json").stat().st_mode) == 0o444
    assert stat.S_IMODE((view / "closed").stat().st_mode) == 0o500  # as the source's directory
    assert stat.S_IMODE((view / "closed" / "open.json").stat().st_mode) == 0o400  # nobody else could reach it
    assert sorted(os.listdir(view / "1_Pooling")) == ["config.json", "deeper"]
    for name in (*("README.md", "config.json", "tokenizer.json", "1_Pooling/config.json", "tensors.sha256"),
                 *(".hidden", "1_Pooling/deeper/x.json", "huge.bin")):  # fmt: skip
        assert (view / name).read_bytes() == (tmp_path / "m" / name).read_bytes()
    assert (view / "inside.txt").read_bytes() == b"# a model\n"
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        source = (tmp_path / "m" / name).read_bytes()
        mode = stat.S_IMODE((tmp_path / "m" / name).stat().st_mode) & 0o444  # its read bits: the mount is read-only
        assert stat.S_IMODE((view / name).stat().st_mode) == mode
        with open(view / name, "rb") as file:  # reads within and across tensors, and across the header
            for start in [0, 5, 1000, 4096 - 3, len(source) - 7, *range(0, len(source), 3 * MIB + 17)]:
                file.seek(start)
                assert file.read(MIB + 13) == source[start : start + MIB + 13], (name, start)
        assert (view / name).read_bytes() == source
    with safe_open(str(view / "model-00002-of-00002.safetensors"), framework="np") as loaded:  # it maps the file
        assert {name: loaded.get_tensor(name).tobytes() for name in loaded.keys()}.items() <= expected.items()  # noqa: SIM118
    assert mounts.run("validate", str(view)).returncode == 0

    merged = mounts.mount(tmp_path / "m", "--view", "merged") / ".tensorfs" / "model"
    assert sorted(os.listdir(merged)) == [
        ".hidden", "1_Pooling", "README.md", "closed", "config.json", "huge.bin", "inside.txt", "model.safetensors",
        "private.json", "tensorfs-view.json", "tokenizer.json",
    ]  # fmt: skip
    with safe_open(str(merged / "model.safetensors"), framework="np") as loaded:  # it maps the file
        assert sorted(loaded.keys()) == sorted(expected)
        assert loaded.metadata() is None  # the shards' metadata differ
    served = (merged / "model.safetensors").read_bytes()
    assert {name: bytes(t["data"]) for name, t in safetensors.deserialize(served)} == expected
    with tensorfs.open_model(tmp_path / "m") as model:
        model.write_safetensors(tmp_path / "same.safetensors")
    assert served == (tmp_path / "same.safetensors").read_bytes()
    with open(merged / "model.safetensors", "rb") as file:  # reads that cross tensors and the header
        for start in [0, 5, 1000, 4096 - 3, len(served) - 7, *range(0, len(served), 3 * MIB + 17)]:
            file.seek(start)
            assert file.read(MIB + 13) == served[start : start + MIB + 13]


def test_a_hub_cache_snapshot_keeps_its_linked_files(tmp_path: Path) -> None:
    from tensorfs.opening.view_files import ViewRule
    from tensorfs.views.companions import CompanionFiles
    from tensorfs.views.local_files import find_companions

    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, data in {"config.json": b'{"a": 1}', "model.safetensors": b"weights"}.items():
        (repo / "blobs" / f"hash-{name}").write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / f"hash-{name}")
    (tmp_path / "elsewhere.txt").write_text("not the model's")
    (snapshot / "elsewhere.txt").symlink_to(tmp_path / "elsewhere.txt")
    found = find_companions(snapshot, ViewRule(folder=False))
    files = CompanionFiles(found.companions)
    assert [(c.path, files.read(c.path, 0, c.size)) for c in found.companions] == [("config.json", b'{"a": 1}')]
    files.close()
    assert found.warnings == [f"{snapshot / 'elsewhere.txt'}: skipped: a symlink out of the model's directory"]
    folder = find_companions(
        snapshot, ViewRule(folder=True)
    )  # of the folder: its weights named, to be opened as models
    assert ([c.path for c in folder.companions], folder.weights) == (["config.json"], ["model.safetensors"])


def test_a_directory_full_of_unreadable_files_is_one_warning_a_reason(tmp_path: Path) -> None:
    """Another user fills the model's directory with thousands of files none may read (symlinks out
    of it, FIFOs): one warning a reason, the first as it is and a count of the others, never a line
    each (a million files made a million lines)."""
    from tensorfs.opening.view_files import ViewRule
    from tensorfs.views.local_files import find_companions

    model = tmp_path / "m"
    model.mkdir()
    write_reference(model / "model.safetensors", {"w": ("U8", [4], bytes(4))})
    (model / "config.json").write_text("{}")
    for k in range(3000):
        (model / f"out{k:04d}.json").symlink_to(tmp_path / "elsewhere")
    for k in range(2):
        os.mkfifo(model / f"pipe{k}.json")
    found = find_companions(model, ViewRule(folder=False))
    assert [c.path for c in found.companions] == ["config.json"]
    assert found.warnings == [
        f"{model / 'out0000.json'}: skipped: a symlink out of the model's directory (and 2999 more files skipped: "
        "a symlink out of the model's directory)",
        f"{model / 'pipe0.json'}: skipped: a FIFO, not a file (and 1 more files skipped: a FIFO)",
    ]


def test_view_shards_and_a_selection(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    expected = {}
    weight_map = {}
    for s in range(2):
        tensors = {f"model.layers.{2 * s + k}.w": ("F32", [256], random_bytes(1024, 10 * s + k)) for k in range(2)}
        write_reference(directory / f"s{s}.safetensors", tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"s{s}.safetensors"))
        expected.update({name: data for name, (_, _, data) in tensors.items()})
    write_index(directory, weight_map)
    mountpoint = mounts.mount(directory, "--view-shards", "2", "--layers", "1-3")
    view = mountpoint / ".tensorfs" / "model"
    # A selection is not named as a whole model is: a loader looking for one finds none (and fails).
    assert sorted(os.listdir(view)) == [
        "selected-00001-of-00002.safetensors",
        "selected-00002-of-00002.safetensors",
        "selected.safetensors.index.partial.json",  # not *.index.json: accelerate takes any for the model's
        "tensorfs-view.json",
    ]
    note = json.loads((view / "tensorfs-view.json").read_text())
    assert (note["synthesized"], note["selection"]) == (
        "a selection of the model's tensors (--layers 1-3)",
        "--layers 1-3",
    )
    index = json.loads((view / "selected.safetensors.index.partial.json").read_text())
    assert index["weight_map"] == {
        "model.layers.1.w": "selected-00001-of-00002.safetensors",
        "model.layers.2.w": "selected-00001-of-00002.safetensors",
        "model.layers.3.w": "selected-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 3 * 1024
    for file_name in set(index["weight_map"].values()):
        with safe_open(str(view / file_name), framework="np") as loaded:
            assert loaded.metadata() == {"format": "pt"}
            for name in loaded.keys():  # noqa: SIM118  (safe_open has keys(), no iteration)
                assert loaded.get_tensor(name).tobytes() == expected[name]


def test_the_view_serves_no_byte_a_manifest_refuses(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    tensors = {name: ("U8", [2 * MIB], random_bytes(2 * MIB, i)) for i, name in enumerate(["a", "b", "c"])}
    write_reference(directory / "model.safetensors", tensors)
    manifest = mounts.run("manifest", str(directory)).stdout
    lines = [line if not line.endswith("  b") else "0" * 64 + "  b" for line in manifest.splitlines()]
    (directory / "tensors.sha256").write_text("\n".join(lines) + "\n")
    mountpoint = mounts.mount(directory)
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    with open(view, "rb") as file:
        header = file.read(8)
        start = 8 + struct.unpack("<Q", header)[0]
        file.seek(start)
        assert file.read(MIB) == tensors["a"][2][:MIB]  # within a: as a's own file serves it
        for where in (start + 2 * MIB + 5, start + 2 * MIB - 5):  # within b, and across a and b
            file.seek(where)
            with pytest.raises(OSError) as caught:
                file.read(4096)
            assert caught.value.errno == errno.EIO
        after = -(-(start + 4 * MIB) // 4096) * 4096  # the kernel reads whole pages: the one shared with b fails too
        file.seek(after)
        assert file.read() == tensors["c"][2][after - start - 4 * MIB :]
    wait_until(lambda: "tensor 'b' in shard" in mounts.log(), what="the refusal in the log")


def test_the_weights_files_beside_a_model_are_validated_and_gated(mounts: Mounts, tmp_path: Path) -> None:
    """The weights files of the model's folder that are not the model (a variant, an adapter) are
    served under their own names, each opened and validated as a model of its own; one that is not a
    valid file is left out, with a warning naming it and why; under a manifest that lists only the
    model's tensors (as `tensorfs manifest` made before issue 55) they are said to be covered by
    none. A change of the files (a chmod): the model's tensors are verified again and served with
    the bytes no tensor holds as they were validated, the others' (no manifest) read again and found
    as they were served (their fingerprints): served on (at d4c56fe: refused)."""
    directory = tmp_path / "m"
    directory.mkdir()
    write_reference(directory / "model.safetensors", {"w": ("F32", [4], random_bytes(16, 1))})
    write_reference(directory / "model.fp16.safetensors", {"w": ("F16", [4], random_bytes(8, 2))})
    write_reference(directory / "adapter_model.safetensors", {"lora_A": ("F32", [2], random_bytes(8, 3))})
    (directory / "broken.safetensors").write_bytes(b"\x10" + bytes(7) + b"{}")
    manifest = mounts.run("manifest", "--include", "*", str(directory / "model.safetensors"))
    assert manifest.returncode == 0, manifest.stderr
    (directory / "tensors.sha256").write_text(manifest.stdout)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    done = mounts.attempt(directory, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
    assert done.returncode == 0, done.stderr
    assert f"warning: {directory / 'broken.safetensors'}: left out of the view: " in done.stderr
    assert (
        "warning: adapter_model.safetensors, model.fp16.safetensors: weights files beside the model, not covered by "
        f"{directory / 'tensors.sha256'}: served as validated, their tensors unchecked\n"
    ) in done.stderr
    view = mountpoint / ".tensorfs" / "model"
    served = ["adapter_model.safetensors", "model.fp16.safetensors", "model.safetensors", "tensors.sha256"]
    assert sorted(os.listdir(view)) == served
    for name in served:
        assert (view / name).read_bytes() == (directory / name).read_bytes(), name
    wait_until(lambda: fingerprints_pending(mountpoint) == 0, what="what was served to be fingerprinted")
    subprocess.run(["chmod", "-R", "a+rX", str(directory)], check=True)
    drop_caches()
    assert (view / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    assert (view / "model.fp16.safetensors").read_bytes() == (directory / "model.fp16.safetensors").read_bytes()


def test_a_manifest_of_a_folder_covers_the_weights_files_beside_the_model(tmp_path: Path) -> None:
    """Issue 55, item 4: `tensorfs manifest` of a folder lists the tensors of the weights files beside
    the model too (a variant, an adapter), each named after its file, and a mount or an export is
    held to them: no file "not covered", and a variant whose bytes changed is refused. A file the
    manifest lists some tensors of and not all is left out of the view, never served unchecked."""
    directory = tmp_path / "m"
    directory.mkdir()
    write_reference(directory / "model.safetensors", {"w": ("F32", [4], random_bytes(16, 1))})
    write_reference(directory / "model.fp16.safetensors", {"w": ("F16", [4], random_bytes(8, 2))})
    adapter = {"lora_A": ("F32", [2], random_bytes(8, 3)), "lora_B": ("F32", [2], random_bytes(8, 4))}
    write_reference(directory / "adapter_model.safetensors", adapter)
    made = cli("manifest", "-q", "-o", "m/tensors.sha256", "m", cwd=tmp_path)
    assert (made.returncode, made.stderr) == (0, "")
    listed = sorted(line.split("  ", 1)[1] for line in (directory / "tensors.sha256").read_text().splitlines())
    assert listed == [
        "adapter_model.safetensors/lora_A", "adapter_model.safetensors/lora_B", "model.fp16.safetensors/w", "w"
    ]  # fmt: skip
    checked = cli("verify", "-q", "m", cwd=tmp_path)
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "m: all 4 tensors match m/tensors.sha256\n", "")
    one = cli("verify", "-q", "m/model.safetensors", cwd=tmp_path)  # one shard: the manifest may list more
    assert (one.returncode, one.stdout) == (0, "m/model.safetensors: all 1 tensors match m/tensors.sha256\n"), (
        one.stderr
    )
    done = cli("export", "-q", "m", "out", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    for name in ("model.safetensors", "model.fp16.safetensors", "adapter_model.safetensors", "tensors.sha256"):
        assert (tmp_path / "out" / name).read_bytes() == (directory / name).read_bytes(), name
    # The variant's bytes changed in place (its header as it was): refused, not served unchecked.
    variant = directory / "model.fp16.safetensors"
    variant.write_bytes(variant.read_bytes()[:-8] + random_bytes(8, 5))
    checked = cli("verify", "-q", "m", cwd=tmp_path)
    assert checked.returncode == 1 and checked.stderr.startswith(f"error: {variant}: tensor 'w': does not match "), (
        checked.stderr
    )
    done = cli("export", "-q", "m", "out2", cwd=tmp_path)
    assert done.returncode != 0 and "model.fp16.safetensors" in done.stderr and "tensors.sha256" in done.stderr, (
        done.stderr
    )
    assert not (tmp_path / "out2").exists()
    gone = tmp_path / "gone"  # a file it lists, not there: said once, naming the file
    shutil.copytree(directory, gone)
    (gone / "adapter_model.safetensors").unlink()
    checked = cli("verify", "-q", "gone", cwd=tmp_path)
    assert (
        checked.returncode == 1
        and ("error: gone/tensors.sha256: lists adapter_model.safetensors, which is no weights file beside the model\n")
        in checked.stderr
    ), checked.stderr
    # A manifest that lists one of the adapter's tensors and not the other: the adapter is left out.
    kept = [line for line in (directory / "tensors.sha256").read_text().splitlines(True) if "lora_B" not in line]
    (directory / "tensors.sha256").write_text("".join(kept))
    variant.unlink()
    done = cli("export", "-q", "m", "out3", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        0,
        f"warning: {directory / 'adapter_model.safetensors'}: left out of the view: tensor 'lora_B' is not in "
        "m/tensors.sha256, which lists the file's other tensors\n",
    )
    assert sorted(os.listdir(tmp_path / "out3")) == ["model.safetensors", "tensors.sha256"]


def test_export_keeps_a_sparse_source_sparse(tmp_path: Path) -> None:
    """Issue 55, item 6: export wrote a sparse source's holes out (a 22.5 GiB model taking 32 KiB on
    disk: 23 GiB written). Blocks of zeros stay holes, in the folder, in one file, and in a companion;
    the bytes are the source's, and the command says how much it wrote."""
    zeros = 256 * MIB
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [4096], "data_offsets": [0, 4096]},
         "zeros": {"dtype": "U8", "shape": [zeros], "data_offsets": [4096, 4096 + zeros]}}
    ).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    model = tmp_path / "sparse"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header + random_bytes(4096, 1))
        out.truncate(8 + len(header) + 4096 + zeros)
    with open(model / "model.onnx", "wb") as out:  # a companion: 32 MiB, its last 4 KiB data
        out.truncate(32 * MIB - 4096)
        out.write(random_bytes(4096, 2))
    assert os.stat(model / "model.safetensors").st_blocks * 512 < MIB  # the source is sparse
    for dest in ("copy", "copy.safetensors"):
        done = subprocess.run(
            [sys.executable, "-m", "tensorfs.cli", "export", "-q", "sparse", dest],
            capture_output=True, text=True, timeout=patience(120), cwd=tmp_path, check=True,
        )  # fmt: skip
        assert "of zeros left as holes" in done.stdout, done.stdout
        written = tmp_path / dest
        files = [written] if written.is_file() else sorted(written.iterdir())
        for file in files:
            assert os.stat(file).st_blocks * 512 < 2 * MIB, (file, os.stat(file).st_blocks)
        if written.is_dir():
            assert [file.name for file in files] == ["model.onnx", "model.safetensors"]
            for file in files:
                assert file.read_bytes() == (model / file.name).read_bytes(), file
        else:  # laid out as the reference writer lays it out: the same tensors
            with safe_open(str(written), "numpy") as copied:
                assert copied.get_tensor("w").tobytes() == random_bytes(4096, 1)
                assert not copied.get_tensor("zeros").any()


def test_every_file_of_the_folder_is_in_the_view_and_the_export(mounts: Mounts, tmp_path: Path) -> None:
    """Issue 55, item 2: a file three levels down, a hidden one, the files of a symlinked folder, a
    70 MiB file, and tokenizer.json among 1,500 other files were left out of the view and the export,
    most without a word. Every one is there under its own name with its own bytes; what cannot be
    (a FIFO named as a companion, a link out of the folder, a link to a folder it is in) is said in
    one warning line a kind."""
    folder = tmp_path / "m"
    folder.mkdir()
    write_reference(folder / "model.safetensors", {"w": ("U8", [64], random_bytes(64, 1))})
    (folder / "extra" / "deeper" / "more").mkdir(parents=True)
    (folder / "extra" / "deeper" / "more" / "notes.txt").write_text("three levels down\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / "real").mkdir()
    (folder / "real" / "r.json").write_text("{}")
    (folder / "linked").symlink_to("real")  # a symlinked folder within: its files are the folder's too
    (folder / "extra" / "loop").symlink_to("..")
    with open(folder / "model.onnx", "wb") as onnx:  # sparse: costs nothing but its last bytes
        onnx.seek(70 * MIB)
        onnx.write(b"the end")
    for k in range(1500):
        (folder / f"a{k:04d}.txt").write_text(str(k))
    (folder / "tokenizer.json").write_text('{"model": {}}')
    os.mkfifo(folder / "config.json")
    (folder / "leak.txt").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "outside.txt").write_text("secret")
    expected = sorted(
        [".gitattributes", "extra/deeper/more/notes.txt", "linked/r.json", "model.onnx", "model.safetensors",
         "real/r.json", "tokenizer.json", *(f"a{k:04d}.txt" for k in range(1500))]
    )  # fmt: skip
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = mounts.attempt(folder, "--log-file", str(mounts.log_file), mountpoint=mountpoint)
    assert mounted.returncode == 0, mounted.stderr
    exported = mounts.run("export", "-q", str(folder), str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    for said in (mounted.stderr, exported.stderr):
        assert sorted(said.splitlines()) == [
            f"warning: {folder / 'config.json'}: skipped: a FIFO, not a file",
            f"warning: {folder / 'extra' / 'loop'}: skipped: a link to a folder it is in",
            f"warning: {folder / 'leak.txt'}: skipped: a symlink out of the model's directory",
        ], said
    for written in (mountpoint / ".tensorfs" / "model", tmp_path / "out"):
        found = sorted(path.relative_to(written).as_posix() for path in written.rglob("*") if path.is_file())
        assert found == expected
        for name in expected:
            assert (written / name).read_bytes() == (folder / name).read_bytes(), name
