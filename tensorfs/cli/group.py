"""The `tensorfs` command group: the commands are in the modules named for what they act on
(model.py, mount.py, remote.py, bench.py)."""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
