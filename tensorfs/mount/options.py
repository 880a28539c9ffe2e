"""A mount's options, as the command parses them and the daemon serves them."""

from __future__ import annotations

import grp
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import MountError
from ..sources.store import check_url
from ..utils.names import Layout
from .tree import Ownership

if TYPE_CHECKING:
    from .metrics import Address  # a type only: the metrics' server (http.server) is imported where it serves

READY = "ready"
"""What the daemon tells the command once the mount answers (anything else is why it does not)."""

# Options that break tensorfs, and why.
REFUSED_OPTIONS = {
    "rw": "the tree is read-only",
    "direct_io": "it breaks np.memmap of the mounted files",
    "max_read": "it breaks pyfuse3 3.5 with libfuse 3.14 (requests are already up to 1 MiB)",
}
# Options tensorfs applies itself, as bindfs and sshfs users know them: libfuse's low-level API has none.
OWNERSHIP_OPTIONS = ("uid", "gid", "umask")
_NO_ID = (1 << 32) - 1  # (uid_t)-1 means "no owner" to the kernel: ids are below it


@dataclass(frozen=True)
class MountOptions:
    layout: Layout = "slash"
    fuse_options: tuple[str, ...] = ()
    """Options passed to FUSE as given with -o (allow_other, ...)."""
    ownership: Ownership = field(default_factory=Ownership)
    """-o uid=,gid=,umask=: applied by tensorfs, not passed to FUSE."""
    foreground: bool = False
    debug: bool = False
    log_file: Path | None = None
    readahead_kb: int = 1024
    prefetch_mb: int = 32
    max_background: int = 4
    keep_source_pages: bool = False
    """Leave the shards' (or cache files') pages in memory once the kernel holds the mounted files' own."""
    quiet: bool = False
    remote: dict[str, object] | None = None
    """A remote model's settings (cache, chunks, GETs, timeout, offline), for the daemon's record."""
    log_format: str = "text"
    """text, or json: one JSON object a line."""
    metrics: Address | None = None
    """Where the Prometheus endpoint listens ((host, port), or a Unix socket's path); None: no endpoint."""


def split_fuse_options(
    values: tuple[str, ...], own: Mapping[str, str] | None = None
) -> tuple[tuple[str, ...], Ownership]:
    """`-o a,b -o c` -> ((a, b, c), the uid/gid/umask overrides), refusing options that break tensorfs,
    a URL with credentials (as its flag would: they would show in /proc/mounts, logs and records),
    and tensorfs's own options (`own`: each flag by its key, fallback: --fallback), which are flags
    of `tensorfs mount` (mount.tensorfs and /etc/fstab take them as -o: helper.py), not FUSE's."""
    options = tuple(opt.strip() for value in values for opt in value.split(",") if opt.strip())
    passed, owner = [], {}
    for option in options:
        key, _, value = option.partition("=")
        if "://" in value:
            check_url(value, f"option '{key}'")
        if own and key in own:
            raise MountError(f"option '{key}': not FUSE's: give it as {own[key]}")
        if key in REFUSED_OPTIONS:
            raise MountError(f"option '{option}' is not supported: {REFUSED_OPTIONS[key]}")
        if key in OWNERSHIP_OPTIONS:
            owner[key] = _ownership_value(key, value)
        else:
            passed.append(option)
    return tuple(passed), Ownership(**owner)


def _ownership_value(key: str, value: str) -> int:
    """uid= and gid= take a number or a name; umask= an octal mask."""
    try:
        if key == "umask":
            mask = int(value, 8)
            if not 0 <= mask <= 0o777:
                raise ValueError
            return mask
        number = int(value) if value.isascii() and value.isdigit() else None
        if number is None:
            number = pwd.getpwnam(value).pw_uid if key == "uid" else grp.getgrnam(value).gr_gid
        if not 0 <= number < _NO_ID:
            raise ValueError
        return number
    except (ValueError, KeyError):
        what = (
            "an octal mask such as 022" if key == "umask" else f"a {'user' if key == 'uid' else 'group'} name or number"
        )
        raise MountError(f"option '{key}={value}': {key} takes {what}") from None
