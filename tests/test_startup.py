"""Start-up: `import tensorfs` and `tensorfs --version` import nothing behind the public names, a command
imports its own module and what it uses, and a local mount none of the stores' machinery. Each is held
to the modules a fresh interpreter has imported (what costs the time), never to a time."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfs
from helpers import write_reference
from tensorfs.catalogue.tables import file_gaps, file_runs
from tensorfs.formats import ShardHeader
from tensorfs.formats.dtypes import DTYPE_NAMED

HEAVY = {"numpy", "trio", "pyfuse3", "obstore", "sqlite3", "crc32c", "torch", "http.server"}
"""What no start-up needs: arrays, the mount's loop and FUSE, the stores' client, the caches' SQLite."""
COMMAND_MODULES = {"tensorfs.cli.bench", "tensorfs.cli.model", "tensorfs.cli.mount", "tensorfs.cli.remote"}

MODULES_AFTER = """
import sys
{code}
print(" ".join(sorted(sys.modules)), file=sys.stderr)
"""


def modules_after(code: str, *args: str) -> tuple[str, set[str]]:
    """What `code` prints, and the modules imported once it has run, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", MODULES_AFTER.format(code=code), *args], capture_output=True, text=True, check=True
    )
    return done.stdout, set(done.stderr.split())


def test_import_tensorfs_imports_nothing_behind_its_names() -> None:
    _, modules = modules_after("import tensorfs")
    assert {name for name in modules if name.startswith("tensorfs")} == {"tensorfs"}
    assert not modules & {*HEAVY, "click"}


def test_version_is_answered_before_click_or_any_command() -> None:
    printed, modules = modules_after("import tensorfs.cli\nassert tensorfs.cli.main(['--version']) == 0")
    assert printed == f"tensorfs, version {tensorfs.__version__}\n"
    assert not modules & {*HEAVY, "click", "tensorfs.cli.group", *COMMAND_MODULES}


def test_a_command_imports_its_own_module_and_what_it_uses(tmp_path: Path) -> None:
    write_reference(tmp_path / "m.safetensors", {"w": ("U8", [4], b"abcd")})
    printed, modules = modules_after(
        "import tensorfs.cli\nassert tensorfs.cli.main(['ls', '--no-cache', sys.argv[1]]) == 0",
        str(tmp_path / "m.safetensors"),
    )
    assert printed.splitlines()[1].split()[:2] == ["w", "U8"]
    assert {"click", "tensorfs.cli.model"} <= modules
    assert not modules & (COMMAND_MODULES - {"tensorfs.cli.model"})
    assert not modules & (HEAVY - {"sqlite3"})  # (the header and hash caches are SQLite's, --no-cache or not)


def test_a_local_mount_imports_none_of_the_stores_machinery() -> None:
    """The command and its daemon (mount.serve): no chunk cache, no fetchers, no CRC-32C, no metrics'
    HTTP server, no numpy; a remote model's mount imports them where it opens one."""
    _, modules = modules_after("import tensorfs.cli.mount, tensorfs.mount.daemon, tensorfs.mount.serve")
    assert {"trio", "pyfuse3"} <= modules
    assert not modules & {"numpy", "obstore", "crc32c", "http.server", "tensorfs.mount.metrics"}
    assert not {name for name in modules if name.startswith(("tensorfs.sources.chunks", "tensorfs.sources.remote"))}


def test_each_public_name_is_its_modules() -> None:
    for name in tensorfs.__all__:
        value = getattr(tensorfs, name)
        if name != "__version__":
            module = importlib.import_module(f"tensorfs.{tensorfs._MODULE_OF[name]}")
            assert value is getattr(module, name), name
    assert set(tensorfs.__all__) == {*tensorfs._MODULE_OF, "__version__"}
    assert set(tensorfs.__all__) <= set(dir(tensorfs))
    with pytest.raises(AttributeError, match="has no attribute 'open'"):
        tensorfs.open  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError):
        from tensorfs import open  # type: ignore[attr-defined]  # noqa: F401


def test_the_group_names_each_command_and_its_module() -> None:
    from tensorfs.cli import cli
    from tensorfs.cli.group import COMMANDS

    for module in set(COMMANDS.values()):
        importlib.import_module(f"tensorfs.cli.{module}")
    assert set(cli.commands) == set(COMMANDS)
    for name, command in cli.commands.items():
        assert command.callback is not None and command.callback.__module__ == f"tensorfs.cli.{COMMANDS[name]}", name


U8 = DTYPE_NAMED["U8"]


@pytest.mark.parametrize(
    ("offsets", "after"),
    [
        ([(0, 4), (4, 10), (10, 16)], 0),  # end to end (a safetensors shard)
        ([(0, 4), (4, 10), (10, 16)], 5),  # and bytes past the last tensor
        ([(0, 0), (0, 4), (4, 4), (4, 8)], 0),  # empty tensors among them
        ([(0, 0), (0, 0)], 0),  # every tensor empty
        ([(0, 0)], 3),
        ([], 0),
        ([], 3),
        ([(0, 4), (8, 12)], 0),  # padding between (a GGUF)
        ([(0, 8), (0, 8), (8, 10)], 0),  # bytes shared (a checkpoint's views of one storage)
        ([(0, 8), (4, 6), (8, 10)], 0),  # one within another
        ([(2, 4), (4, 6)], 0),  # the first not at the data's start
    ],
)
def test_file_gaps_are_file_runs_gaps(offsets: list[tuple[int, int]], after: int) -> None:
    """What the mount keeps of each file before it is ready (the bytes no tensor holds), quickly when
    the tensors lie end to end, and file_runs's answer always."""
    entries = [(begin, end, f"t{i}", U8, [end - begin]) for i, (begin, end) in enumerate(offsets)]
    for data_start in (0, 24):
        size = data_start + max((end for _, end in offsets), default=0) + after
        header = ShardHeader(Path("m.safetensors"), size, data_start, entries, None)
        assert file_gaps(header) == file_runs(header)[1], data_start
