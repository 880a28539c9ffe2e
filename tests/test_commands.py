"""The command line as a new user first meets it: its help, its options' names, and what a
mistyped model is told."""

from __future__ import annotations

import click
import pytest

from tensorfs.cli import cli, main


def every_command(group: click.Group = cli, prefix: str = "") -> list[tuple[str, click.Command]]:
    """Every command of the group and of its subgroups, by the name it is run with."""
    found: list[tuple[str, click.Command]] = []
    for name, command in sorted(group.commands.items()):
        found.append((prefix + name, command))
        if isinstance(command, click.Group):
            found += every_command(command, f"{prefix}{name} ")
    return found


def test_the_help_names_the_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    summary = capsys.readouterr().out.split("MODEL is")[0]
    for name in ("safetensors", "GGUF", "PyTorch checkpoints"):
        assert name in summary


@pytest.mark.parametrize("group", ["", "cache"])
def test_no_command_summary_is_cut(
    group: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command's summary in its group's --help, whole on its line on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*group.split(), "--help"]) == 0
    listed = capsys.readouterr().out.split("Commands:\n")[1].splitlines()
    commands = {name: command for name, command in every_command() if name.startswith(group)}
    shown = {line.split()[0]: line.split(None, 1)[1] for line in listed if line.strip()}
    expected = {
        name.split()[-1]: command for name, command in commands.items() if len(name.split()) == len(group.split()) + 1
    }
    assert set(shown) == set(expected)
    for name, command in expected.items():
        assert command.short_help is not None, f"{name}: no summary of its own"
        assert shown[name] == command.short_help, f"{name}: its summary is cut: {shown[name]!r}"
        assert not shown[name].endswith("...")
