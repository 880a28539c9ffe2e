"""The command line: exit codes, messages, output; no traceback for bad input."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import Tensor, cli, entry, random_bytes, raw_shard, reference_table, write_index, write_reference
from tensorfs.cli import main
from tensorfs.utils.units import human_size

# The model the CLI tests read: shard -> tensors (dtype, shape, the bytes written).
MODEL: dict[str, dict[str, Tensor]] = {
    "model-00001-of-00002.safetensors": {"embed": ("BF16", [8, 4], random_bytes(64, 1))},
    "model-00002-of-00002.safetensors": {
        "layers/0/w": ("F32", [2, 3], random_bytes(24, 2)),
        "scalar": ("I64", [], random_bytes(8, 3)),
    },
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    for shard, tensors in MODEL.items():
        write_reference(directory / shard, tensors)
    write_index(directory, {name: shard for shard, tensors in MODEL.items() for name in tensors})
    return directory


def test_validate_valid(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(model_dir)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{model_dir}: valid: 2 shards, 3 tensors, 96 B (96 bytes)\n"
    assert err == ""


def test_validate_invalid_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.safetensors").write_bytes(
        raw_shard({"x": entry("F32", [2], 0, 4), "y": entry("Q", [1], 4, 5)}, bytes(5))
    )
    (tmp_path / "b.safetensors").write_bytes(b"\x01")
    assert main(["validate", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"error: {tmp_path / 'a.safetensors'}: tensor 'x': data_offsets [0, 4] hold 4 bytes but F32 [2] needs 8",
        f"error: {tmp_path / 'a.safetensors'}: tensor 'y': unknown dtype \"Q\" (dtype names are case-sensitive, e.g. F32, BF16)",
        f"error: {tmp_path / 'b.safetensors'}: file is 1 bytes, too short to hold the 8-byte header length",
    ]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 2
    assert "Missing argument 'MODEL'" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main(["validate", "--layout", "weird", "x"]) == 2


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "validate" in out and "ls" in out
    assert main(["--version"]) == 0
    assert "tensorfs, version" in capsys.readouterr().out


def test_ls_table(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(model_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DTYPE", "SHAPE", "SIZE", "SHARD"]
    assert lines[1].split() == ["embed", "BF16", "[8,", "4]", "64", "B", "model-00001-of-00002.safetensors"]
    assert lines[2].split() == ["layers/0/w", "F32", "[2,", "3]", "24", "B", "model-00002-of-00002.safetensors"]
    assert lines[3].split() == ["scalar", "I64", "[]", "8", "B", "model-00002-of-00002.safetensors"]


def test_ls_json(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--json", str(model_dir)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in records] == ["embed", "layers/0/w", "scalar"]
    numpy_dtypes = {"embed": "bfloat16", "layers/0/w": "<f4", "scalar": "<i8"}
    for record in records:
        # Where the tensor is, by the reference reader: data offsets, plus the 8-byte length and the header.
        shard = model_dir / record["shard"]
        content = shard.read_bytes()
        data_start = 8 + struct.unpack("<Q", content[:8])[0]
        dtype, shape, (begin, end), data = reference_table(shard)[0][record["name"]]
        assert record == {
            "name": record["name"],
            "dtype": dtype,
            "shape": shape,
            "nbytes": end - begin,
            "shard": shard.name,
            "offset": data_start + begin,
            "data_offsets": [begin, end],
            "numpy_dtype": numpy_dtypes[record["name"]],
        }
        written = MODEL[shard.name][record["name"]][2]
        assert data == written and content[record["offset"] : record["offset"] + record["nbytes"]] == written
    assert records[2]["data_offsets"] == [0, 8]  # the reference writer puts 8-byte types first


def test_bad_input_never_shows_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 20)
    result = cli("validate", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]


def output_commands(model_dir: Path, tmp_path: Path) -> list[list[str]]:
    """Every command that writes to standard output, and click's own help and version."""
    manifest = tmp_path / "m.sha256"
    assert main(["manifest", "--no-cache", "-o", str(manifest), str(model_dir)]) == 0
    return [
        ["validate", str(model_dir)],
        ["ls", str(model_dir)],
        ["ls", "--json", str(model_dir)],
        ["manifest", "--no-cache", str(model_dir)],
        ["manifest", "--no-cache", "--json", str(model_dir)],
        ["verify", "--no-cache", "--manifest", str(manifest), str(model_dir)],
        ["status"],
        ["--help"],
        ["mount", "--help"],
        ["--version"],
    ]


def run_cli(args: list[str], stdout: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, check=False
    )


def test_a_full_output_is_a_one_line_error(model_dir: Path, tmp_path: Path) -> None:
    for args in output_commands(model_dir, tmp_path):
        with open("/dev/full", "w") as full:
            result = run_cli(args, full)
        assert (result.returncode, result.stderr) == (
            1,
            "error: cannot write to standard output: No space left on device\n",
        ), args


def test_a_reader_gone_ends_every_command_quietly(model_dir: Path, tmp_path: Path) -> None:
    for args in output_commands(model_dir, tmp_path):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader went away before a byte was written (as `| head` does, late)
        try:
            result = run_cli(args, write_end)
        finally:
            os.close(write_end)
        assert (result.returncode, result.stderr) == (141, ""), args  # as a coreutils command killed by SIGPIPE


def test_ls_piped_into_head(tmp_path: Path) -> None:
    write_reference(tmp_path / "m.safetensors", {f"tensor.{i:05d}": ("U8", [1], b"x") for i in range(5000)})
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m tensorfs.cli ls {tmp_path / 'm.safetensors'} | head -2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.stdout.splitlines()[1].startswith("tensor.00000") and result.stderr == ""
    assert result.returncode == 141


def test_a_long_manifest_piped_into_head(tmp_path: Path) -> None:
    write_reference(tmp_path / "m.safetensors", {f"tensor.{i:05d}": ("U8", [1], b"x") for i in range(5000)})
    command = f"{sys.executable} -m tensorfs.cli manifest --no-cache {tmp_path / 'm.safetensors'} | head -1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, check=False)
    assert result.stdout.endswith("  tensor.00000\n") and result.stderr == ""
    assert result.returncode == 141  # one long text: its writes too must see the pipe close


def test_manifest_is_written_to_a_file_never_a_device(model_dir: Path, tmp_path: Path) -> None:
    """-o writes a regular file (the one writer writes no special file: standard output is there for
    the rest); a device is refused with nothing written, and so is a directory that is not there."""
    for device in ("/dev/full", "/dev/null"):
        result = run_cli(["manifest", "--no-cache", "-o", device, str(model_dir)], subprocess.PIPE)
        assert (result.returncode, result.stderr) == (1, f"error: cannot write {device}: not a regular file\n")
    assert not [name for name in os.listdir("/dev") if name.endswith(".partial")]
    result = run_cli(["manifest", "--no-cache", "-o", str(tmp_path / "missing" / "m"), str(model_dir)], subprocess.PIPE)
    assert (result.returncode, result.stderr) == (
        1,
        f"error: cannot write {tmp_path / 'missing' / 'm'}: No such file or directory\n",
    )
    assert main(["manifest", "--no-cache", "-o", str(tmp_path / "m"), str(model_dir)]) == 0
    printed = run_cli(["manifest", "--no-cache", str(model_dir)], subprocess.PIPE)
    assert printed.returncode == 0 and (tmp_path / "m").read_text() == printed.stdout


# `tensorfs manifest` whose files may grow to 4 KiB at most (RLIMIT_FSIZE): the write of a longer
# manifest crosses it half-way. Python ignores SIGXFSZ (the write fails with EFBIG); "kill" restores the
# default, which kills the process right there, in the middle of writing its output.
MANIFEST_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
import tensorfs.cli
if sys.argv[1] == "kill":
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
sys.exit(tensorfs.cli.main(["manifest", "--no-cache", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("before", [None, "an older manifest\n"])
@pytest.mark.parametrize("cut", ["kill", "error"])
def test_manifest_output_is_written_whole_or_not_at_all(tmp_path: Path, cut: str, before: str | None) -> None:
    model = tmp_path / "m.safetensors"
    write_reference(model, {f"tensor.{i:05d}": ("U8", [1], b"x") for i in range(300)})  # 23 KiB of manifest
    output = tmp_path / "out" / "m.sha256"
    output.parent.mkdir()
    if before is not None:
        output.write_text(before)
    result = subprocess.run(
        [sys.executable, "-c", MANIFEST_UNDER_A_FILE_SIZE_LIMIT, cut, "-o", str(output), str(model)],
        capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=False,
    )  # fmt: skip
    if cut == "kill":
        assert result.returncode == -signal.SIGXFSZ, result.stderr  # killed in the middle of the write
    else:
        assert (result.returncode, result.stderr) == (1, f"error: cannot write {output}: File too large\n")
        assert os.listdir(output.parent) == ([] if before is None else ["m.sha256"])  # nothing half-written left
    if before is None:
        assert not output.exists()
    else:
        assert output.read_text() == before
    complete = subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", "manifest", "--no-cache", "-o", str(output), str(model)], check=False
    )
    assert complete.returncode == 0 and output.read_text().count("\n") == 300  # whole, once it can be


def test_a_closed_output_is_a_one_line_error(model_dir: Path) -> None:
    for args in (f"ls {model_dir}", "--help", f"validate {model_dir}"):
        result = subprocess.run(
            ["bash", "-c", f"{sys.executable} -m tensorfs.cli {args} >&-"], capture_output=True, text=True, check=False
        )
        assert (result.returncode, result.stderr) == (
            1,
            "error: cannot write to standard output: Bad file descriptor\n",
        )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["status", "--timeout", "nan"], "Invalid value for '--timeout': 'nan' is not a number."),
        (["bench", "--shards", "0"], "Invalid value for '--shards': 0 is not in the range 1<=x<=1000."),
        (["bench", "--gib", "nan"], "Invalid value for '--gib': 'nan' is not a number."),
        (["bench", "--gib", "-1"], "Invalid value for '--gib': -1.0 is not in the range 0.01<=x<=1024."),
        (["bench", "--repeat", "0"], "Invalid value for '--repeat': 0 is not in the range 1<=x<=100."),
        (
            ["bench", "--readahead-kb", "-5"],
            "Invalid value for '--readahead-kb': -5 is not in the range 0<=x<=1048576.",
        ),
    ],
)
def test_numbers_out_of_range_are_usage_errors(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert words in capsys.readouterr().err


def test_a_manifest_that_is_no_file(model_dir: Path, tmp_path: Path) -> None:
    result = run_cli(["verify", "--manifest", "/dev/zero", str(model_dir)], subprocess.PIPE)
    assert (result.returncode, result.stderr) == (1, "error: /dev/zero: not a regular file or a pipe\n")
