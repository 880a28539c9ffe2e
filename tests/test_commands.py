"""The command line as a new user first meets it: its help, its options' names, and what a
mistyped model is told."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

import tensorfs
from helpers import write_reference
from tensorfs.cli import cli, main


def every_command(group: click.Group = cli, prefix: str = "") -> list[tuple[str, click.Command]]:
    """Every command of the group and of its subgroups, by the name it is run with (looked up as click
    does: the top group imports a command's module when the command is asked for)."""
    found: list[tuple[str, click.Command]] = []
    context = click.Context(group)
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        assert command is not None, name
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


def test_an_option_name_is_one_option() -> None:
    """An option's name that several commands take is the same kind of option in each: a flag in all,
    or a value of one type in all (mount's -o, mount(8)'s options, is the one other -o)."""
    kinds: dict[str, set[tuple[bool, str]]] = {}
    for name, command in every_command():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for flag in param.opts:
                    if (name, flag) != ("mount", "-o"):
                        kinds.setdefault(flag, set()).add((param.is_flag, type(param.type).__name__))
    assert {flag: kind for flag, kind in kinds.items() if len(kind) > 1} == {}


RENAMED = [
    ("export", "--shards", "--view-shards"),
    ("cache prune", "--max-size", "--cache-size"),
    ("bench", "--json", "--output"),
]
"""(command, the option's old name, its name now)."""


@pytest.mark.parametrize(("command", "old", "new"), RENAMED)
def test_an_old_name_is_hidden(command: str, old: str, new: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command.split(), "--help"]) == 0
    shown = capsys.readouterr().out
    assert new in shown and old not in shown.replace(new, "")


def test_the_old_names_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.safetensors"
    write_reference(model, {f"t{n}": ("F32", (2,), bytes(range(8))) for n in range(3)})
    for option, out in (("--shards", "old"), ("--view-shards", "new")):
        assert main(["export", option, "2", str(model), str(tmp_path / out)]) == 0
        assert len(list((tmp_path / out).glob("model-0000?-of-00002.safetensors"))) == 2
    assert main(["export", "--shards", "2", "--view-shards", "2", str(model), str(tmp_path / "both")]) == 2
    assert "--shards is the old name of --view-shards: give it once" in capsys.readouterr().err
    import tensorfs.bench

    written: list[Path | None] = []
    monkeypatch.setattr(tensorfs.bench, "main", lambda config, output, suite: written.append(output) or 0)
    assert main(["bench", "--json", str(tmp_path / "r.json")]) == 0
    assert written == [tmp_path / "r.json"]
    from tensorfs.sources.chunks import ChunkCache

    ChunkCache(tmp_path / "cache").db()
    assert main(["cache", "prune", "--cache-dir", str(tmp_path / "cache"), "--max-size", "10M"]) == 0
    assert "freed 0 B" in capsys.readouterr().out


MISTYPED = {
    "s3:/bucket/models/x": "s3://bucket/models/x",
    "hf:/org/name": "hf://org/name",
    "hf:org/name": "hf://org/name",
    "http:/host/model.safetensors": "http://host/model.safetensors",
    "https:host/model.safetensors": "https://host/model.safetensors",
    "https//host/model.safetensors": "https://host/model.safetensors",
    "S3://bucket/x": "s3://bucket/x",
    "htps://host/model.safetensors": "https://host/model.safetensors",
}
"""A URL mistyped, and the URL it is taken to mean."""


def model_commands(model: str, tmp_path: Path) -> list[list[str]]:
    """Every command that takes a model, with `model`; what else each takes, not there."""
    elsewhere = str(tmp_path / "not-there")
    return [
        ["validate", model],
        ["ls", model],
        ["manifest", model],
        ["verify", model],
        ["export", model, elsewhere],
        ["mount", model, elsewhere],
        ["prefetch", model],
    ]


@pytest.mark.parametrize("typed", [*MISTYPED, "s4://bucket/x", "not-there/model.safetensors"])
def test_a_mistyped_model_is_told_first(typed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command that takes a model says what is wrong with the model's name (a URL mistyped: the
    URL it may mean), before anything else: not the mountpoint or DEST, which are not there either."""
    for words in model_commands(typed, tmp_path):
        code = main(words)
        err = capsys.readouterr().err
        assert code == (1 if typed.startswith("not-there") else 2), (words, err)
        assert typed in err and str(tmp_path / "not-there") not in err, (words, err)
        assert ("no such file or directory" in err) != ("://" in typed), (words, err)
        if typed in MISTYPED:
            assert f"did you mean {MISTYPED[typed]}?" in err, (words, err)
    for option in ("--fallback", "--manifest"):
        assert main(["mount", str(tmp_path), str(tmp_path / "not-there"), option, typed]) in (1, 2)
        err = capsys.readouterr().err
        if typed in MISTYPED:
            assert f"did you mean {MISTYPED[typed]}?" in err and "mountpoint" not in err


@pytest.mark.parametrize("typed", MISTYPED)
def test_a_mistyped_url_in_python(typed: str) -> None:
    with pytest.raises(tensorfs.InvalidModelError, match=re.escape(f"{typed}: ")) as raised:
        tensorfs.open_model(typed)
    assert str(raised.value).endswith(f"did you mean {MISTYPED[typed]}?")


def test_a_path_that_is_there_is_no_mistyped_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory named s3: (as a URL mistyped would be) is a path, as any other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "bucket").mkdir(parents=True)
    write_reference(tmp_path / "s3:" / "bucket" / "model.safetensors", {"t": ("F32", (1,), bytes(4))})
    assert main(["validate", "s3:/bucket"]) == 0
