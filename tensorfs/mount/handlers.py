"""What every FUSE request of a mount goes through on its way in and out: counted, traced with
--debug, and whatever it raised made the errno FUSE answers (the only place errors become errnos):
a domain error its errno, anything else (a bug) logged with its traceback and answered EIO. Nothing
a handler raises ends the daemon."""

from __future__ import annotations

import collections
import errno
import functools
import inspect
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from ..errors import IntegrityError, TensorfsError, printable
from ..gate import Refused
from .stats import Stats
from .tree import NoSuchEntry

__all__ = ["handler", "not_implemented", "read_only"]

log = logging.getLogger("tensorfs.mount.operations")  # the handlers' log lines

# Domain errors -> errno. Anything not listed (a bug) is logged with its traceback and answered EIO.
_ERRNO_OF: dict[type[TensorfsError], int] = {NoSuchEntry: errno.ENOENT, IntegrityError: errno.EIO, Refused: errno.EIO}

P = ParamSpec("P")
R = TypeVar("R")


def handler(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn what a handler raises into the errno FUSE answers; never let it end the daemon."""
    describe = _describer(method)

    op = method.__name__

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if args[0].trace:  # type: ignore[attr-defined]  # (off, one test of a flag per request)
            log.debug("%s", describe(args))
        stats: Stats = args[0].stats  # type: ignore[attr-defined]
        stats.request(op)
        try:
            return await method(*args, **kwargs)
        except pyfuse3.FUSEError as exc:
            stats.error(op, exc.errno)
            raise
        except TensorfsError as exc:
            code = _ERRNO_OF.get(type(exc))
            if code is None:
                code = errno.EIO
                said = _SAID.say((op, args[1] if len(args) > 1 else None))
                if said is not None:
                    fields = {"op": op, "errno": "EIO", **getattr(exc, "fields", {})}
                    log.error("%s: %s (EIO)%s", describe(args), exc, said, extra={"fields": fields})
            stats.error(op, code)
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            said = _SAID.say((op, args[1] if len(args) > 1 else None, "bug"))
            if said is not None:
                fields = {"op": op, "errno": "EIO"}
                log.exception("bug in %s; answered EIO%s", describe(args), said, extra={"fields": fields})
            stats.error(op, errno.EIO)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class ErrorLines:
    """Which error lines are said: of each file (a request's inode or handle) and kind of request, the
    first at once, then at most one a minute while they go on, saying how many were not (the stats
    and metrics count every one): a user reading a refused file in a loop cannot grow the log."""

    EVERY = 60.0
    KEPT = 4096
    """Files remembered at once (the oldest forgotten first: its next line is said at once)."""

    def __init__(self) -> None:
        self._files: collections.OrderedDict[object, tuple[float, int]] = collections.OrderedDict()

    def say(self, key: object) -> str | None:
        """None: not said (counted); else what the line adds (the lines not said before it)."""
        now = time.monotonic()
        said, since = self._files.get(key, (None, 0))
        if said is not None and now - said < self.EVERY:
            self._files[key] = (said, since + 1)
            return None
        self._files[key] = (now, 0)
        self._files.move_to_end(key)
        while len(self._files) > self.KEPT:
            self._files.popitem(last=False)
        return f"; {since} more like it since the last line said" if since else ""


_SAID = ErrorLines()


def _describer(method: Callable[..., Any]) -> Callable[[tuple[Any, ...]], str]:
    """A function that shows a request as `read(fh=12 'w', off=0, size=131072)`: its fields, not reprs."""
    names = list(inspect.signature(method).parameters)[1:]  # after self

    def describe(args: tuple[Any, ...]) -> str:
        operations, fields = args[0], []
        for name, value in zip(names, args[1:], strict=False):
            if isinstance(value, pyfuse3.RequestContext):
                fields.append(f"uid={value.uid}, gid={value.gid}, pid={value.pid}")
            elif isinstance(value, bytes):
                fields.append(f"{name}={printable(value.decode('utf-8', 'backslashreplace'))!r}")
            elif name in ("inode", "fh", "parent_inode") and hasattr(operations, "inode_label"):
                fields.append(f"{name}={value}{operations.inode_label(value)}")
            elif not isinstance(value, pyfuse3.ReaddirToken):
                fields.append(f"{name}={value!r}")
        return f"{method.__name__}({', '.join(fields)})"

    return describe


def not_implemented(op: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A request tensorfs has nothing to do for: ENOSYS, once, and the kernel stops sending it for
    good (fc->no_flush, no_getxattr, ...), one round trip less per file. Counted as a request, not
    as an error: it is no failure."""

    async def decline(self: Any, *_: Any, **__: Any) -> Any:
        self.stats.request(op)
        raise pyfuse3.FUSEError(errno.ENOSYS)

    decline.__name__ = op
    return decline


def read_only(op: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A request that would change the tree: refused with EROFS, and counted."""

    async def refuse(self: Any, *_: Any, **__: Any) -> Any:
        self.stats.request(op)
        self.stats.error(op, errno.EROFS)
        raise pyfuse3.FUSEError(errno.EROFS)

    refuse.__name__ = op
    return refuse
