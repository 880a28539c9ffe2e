"""Mounting as any other file system does: `mount -t fuse.tensorfs SRC MNT -o OPTS` and /etc/fstab.

mount(8) runs a helper as `HELPER SRC MNT -o OPT[,OPT...]`: `/sbin/mount.fuse.tensorfs` when
there is one (the `mount.tensorfs` script, linked there), else mount.fuse3 runs `tensorfs` itself
(found in mount's own PATH), adding `dev,suid`. Each `tensorfs mount` option is an `-o key=value`
(a flag: `-o key`); FUSE's own options pass through; mount(8)'s generic ones are taken as said
or ignored; anything else is a one-line error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import click

from ..errors import TensorfsError
from .options import REFUSED_OPTIONS

# Options of mount(8) and fstab that mean nothing more to a read-only FUSE mount (it is always
# nodev, nosuid), or that systemd and mount(8) use themselves.
IGNORED = {
    "defaults", "ro", "rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto",
    "user", "nouser", "users", "owner", "group", "_netdev", "nofail", "async", "sync", "atime",
    "noatime", "relatime", "strictatime", "nodiratime", "diratime", "loud", "silent",
}  # fmt: skip
IGNORED_PREFIXES = ("x-", "comment=")
FUSE_OPTIONS = {"allow_other", "allow_root", "default_permissions", "auto_unmount", "uid", "gid", "umask", "fsname"}
"""Passed on to `tensorfs mount -o` (uid, gid and umask are applied by tensorfs itself)."""
NOT_IN_FSTAB = {"foreground", "help"}


def mount_arguments(argv: Sequence[str], command: click.Command) -> list[str]:
    """`SRC MNT [-o OPTS]...` (as mount(8) gives them) as the arguments of `tensorfs mount`."""
    positional: list[str] = []
    options: list[str] = []
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "-o":
            if not words:
                raise TensorfsError("-o needs a list of options")
            options += [part for part in words.pop(0).split(",") if part]
        elif word.startswith("-o"):
            options += [part for part in word[2:].split(",") if part]
        elif word in ("-n", "-s", "-f", "-v"):  # mount(8)'s own: no mtab, sloppy, fake, verbose
            continue
        else:
            positional.append(word)
    if len(positional) != 2:
        # (The words besides the options: an option's value, a URL with a password maybe, is not quoted.)
        raise TensorfsError(f"usage: mount.tensorfs SOURCE MOUNTPOINT [-o OPT[,OPT...]] (got {' '.join(positional)})")
    flags = tensorfs_options(command)
    arguments = ["-q"]
    for option in options:
        key, has_value, value = option.partition("=")
        if key in IGNORED or key.startswith(IGNORED_PREFIXES):
            continue
        if key in FUSE_OPTIONS:
            arguments += ["-o", option]
            continue
        if key in REFUSED_OPTIONS:
            raise TensorfsError(f"option '{key}': refused: {REFUSED_OPTIONS[key]}")
        found = flags.get(key)
        if found is None or key in NOT_IN_FSTAB:
            raise TensorfsError(f"option '{_shown(key)}': not a tensorfs mount option (see tensorfs mount --help)")
        name, is_flag = found
        if is_flag != (not has_value):
            wanted = "takes no value" if is_flag else "needs a value: key=value"
            raise TensorfsError(f"option '{key}': {wanted}")
        arguments += [name] if is_flag else [f"{name}={value}"]
    return [*arguments, *positional]


def _shown(key: str) -> str:
    """An option's key as an error may quote it: only what could be one (a piece of a value cut at a
    comma, a URL's password perhaps, is not shown)."""
    return key if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", key) else "..."


def tensorfs_options(command: click.Command) -> dict[str, tuple[str, bool]]:
    """Each long option of `command` by its fstab key (--readahead-kb: readahead_kb): (flag, is it one)."""
    found: dict[str, tuple[str, bool]] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in param.opts:
                if name.startswith("--"):
                    found[name[2:].replace("-", "_")] = (name, bool(param.is_flag))
    return found
