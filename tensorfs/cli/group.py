"""The `tensorfs` command group: the commands are in the modules named for what they act on
(model.py, mount.py, remote.py, bench.py), each imported when one of its commands is looked up."""

from __future__ import annotations

import importlib

import click

from .. import __version__

COMMANDS = {
    "bench": "bench",
    "export": "model",
    "ls": "model",
    "manifest": "model",
    "validate": "model",
    "verify": "model",
    "mount": "mount",
    "stats": "mount",
    "status": "mount",
    "umount": "mount",
    "cache": "remote",
    "prefetch": "remote",
}
"""Each command and the module of this package that defines it (tests/test_startup.py holds them to it)."""


class LazyGroup(click.Group):
    """A group whose commands' modules are imported when a command is looked up, not before: a command
    imports what it uses, and no other command's."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command's name, none of them imported."""
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command, its module imported first; for a name of no command, every module, so that
        click's "No such command" can say which command was meant."""
        modules = [COMMANDS[cmd_name]] if cmd_name in COMMANDS else sorted(set(COMMANDS.values()))
        if cmd_name not in self.commands:
            for module in modules:
                importlib.import_module(f"{__package__}.{module}")
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tensorfs")
def cli() -> None:
    """Serve the tensors of a model as files, one per tensor: safetensors, GGUF,
    and PyTorch checkpoints (read without running their pickle).

    MODEL is a weights file (.safetensors, .gguf, a PyTorch checkpoint), an
    index file, or a directory (its model as loaders find it: model.safetensors,
    else its index, else pytorch_model.bin, ...); or such a model in a store,
    read through a local cache: s3://BUCKET/PREFIX (or .../KEY.safetensors),
    https://.../model.safetensors.index.json (or .../NAME.safetensors),
    hf://ORG/NAME[@REVISION].
    """
