"""The `tensorfs` command line: one subcommand per thing a user does with a model.

group.py holds the click group; the commands are in the module named for what they act on:
model.py (validate, ls, manifest, verify, export), mount.py (mount, umount, status, stats),
remote.py (prefetch, cache), bench.py; options.py and output.py are what they share. A command
imports what it uses and no other command's modules (group.py's LazyGroup); `tensorfs --version` is
answered before click is imported.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from .. import __version__
from ..errors import TensorfsError
from .output import GuardedOutput, OutputError, drop_output, error_lines

if TYPE_CHECKING:
    from .group import cli

__all__ = ["cli", "main", "mount_helper"]


if not TYPE_CHECKING:  # type checkers see the import above: a name mistyped is an error there, not Any

    def __getattr__(name: str) -> Any:
        """`cli`, the click group, imported when first asked for (click is not, for `--version`)."""
        if name != "cli":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from .group import cli

        globals()["cli"] = cli
        return cli


def _run_by_mount(words: list[str]) -> bool:
    """Whether the words are a mount helper's (a model and a mountpoint), not a command's."""
    from .group import COMMANDS

    if len(words) < 2 or words[0] in COMMANDS or words[0].startswith("-"):
        return False
    from ..sources.store import is_remote

    return is_remote(words[0]) or os.path.exists(words[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 done, 1 bad input or failure, 2 usage error.

    An output that cannot be written (`> /dev/full`) is a one-line error and exit 1; a reader
    that went away (`| head`) ends the command quietly with 141, as coreutils' commands end.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    if words == ["--version"]:  # alone: with more words click answers it (an eager option), as ever
        return _version()
    if _run_by_mount(words):  # mount.fuse3 runs `tensorfs SRC MNT -o OPTS` for -t fuse.tensorfs
        return mount_helper(words)
    import click

    from ..sources.store import redact
    from .group import cli

    stdout = sys.stdout
    sys.stdout = GuardedOutput(stdout)
    try:
        result = cli.main(args=words, prog_name="tensorfs", standalone_mode=False)
        sys.stdout.flush()
    except OutputError as exc:
        return _output_failed(exc, stdout)
    except TensorfsError as exc:
        error_lines(exc.lines())
        return exc.exit_code
    except click.ClickException as exc:
        shown = io.StringIO()
        exc.show(file=shown)
        with contextlib.suppress(OSError):  # a usage error may quote an option's value: a URL's too
            sys.stderr.write(redact(shown.getvalue()))
            sys.stderr.flush()
        return exc.exit_code
    except click.exceptions.Abort:
        error_lines(["Aborted."], prefix="")
        return 130
    finally:
        sys.stdout = stdout
    return result if isinstance(result, int) else 0


def _version() -> int:
    """`tensorfs --version`, as click's version option words it, without importing click or any
    command: the CLI's quickest answer. An output that cannot be written fails it as it fails them."""
    stdout = sys.stdout
    try:
        guarded = GuardedOutput(stdout)
        guarded.write(f"tensorfs, version {__version__}\n")
        guarded.flush()
    except OutputError as exc:
        return _output_failed(exc, stdout)
    return 0


def _output_failed(exc: OutputError, stdout: TextIO | None) -> int:
    """The exit code of a command whose standard output could not be written: a one-line error and 1,
    or quietly 141 for a reader gone (the buffered rest is dropped, not written again at exit)."""
    drop_output(stdout)
    if exc.broken_pipe:
        return 141
    error_lines(exc.lines())
    return exc.exit_code


def mount_helper(argv: Sequence[str] | None = None) -> int:
    """mount.tensorfs SOURCE MOUNTPOINT [-o OPTS]: what mount(8) runs for `-t fuse.tensorfs` (see
    mount/helper.py): `tensorfs mount` with the options mount(8) gives, translated."""
    from ..mount.helper import mount_arguments
    from .mount import mount

    words = list(sys.argv[1:] if argv is None else argv)
    try:
        arguments = mount_arguments(words, mount)
    except TensorfsError as exc:
        error_lines(exc.lines())
        return 1
    return main(["mount", *arguments])


def run_mount_helper() -> None:
    """The entry point of the mount.tensorfs script."""
    sys.exit(mount_helper())
