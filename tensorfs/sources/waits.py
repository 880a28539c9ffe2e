"""One wait rule for every reader of remote bytes: a request waits on work shared with others (a
chunk's fetch, a check of signed bytes, a hash another reader began, room in the cache) at most one
--remote-timeout from its own start, however many wait on that work and whenever it began.

A request is what a driver of the gate's plans runs (a mount's FUSE request, a library call:
gate.plans.run): it is stamped when it begins (request()), and the stamp goes with it to the
threads its steps run on (contextvars: trio's threads take the caller's; pools are handed a copy).
Work begun for it goes on past its deadline, for whoever else waits (it ends within its own
timeout: the store client's); a request past its deadline begins no more of it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from ..errors import RemoteError

__all__ = ["deadline", "expired", "request", "wait_for"]

T = TypeVar("T")

_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("tensorfs_request_started", default=None)


@contextlib.contextmanager
def request() -> Iterator[None]:
    """A request begins (a driver of plans says so); nested ones keep the first's stamp."""
    if _STARTED.get() is not None:
        yield
        return
    token = _STARTED.set(time.monotonic())
    try:
        yield
    finally:
        _STARTED.reset(token)


def deadline(limit: float) -> float:
    """When a wait of the request under way must end, for work whose own wait is `limit` seconds:
    one `limit` from the request's start (from now, outside a request)."""
    started = _STARTED.get()
    return (started if started is not None else time.monotonic()) + limit


def expired(limit: float | None) -> bool:
    """Whether the request under way has waited `limit` seconds already (None: no limit)."""
    return limit is not None and _STARTED.get() is not None and time.monotonic() >= deadline(limit)


GRACE = 1.0
"""Seconds a wait at its deadline gives the work it waits on to say why it failed: the work began a
moment after the request, and its own timeout (the store client's retries, the last of which may
end past it) a moment after the request's; its failure (a 500 retried until then, say) is the better
answer."""


def wait_for(future: Future[T], limit: float | None, what: Callable[[], str]) -> T:
    """The future's result, waited for until the request's deadline for `limit` (None: as long as it
    takes: local work). RemoteError naming `what` when the deadline comes first."""
    if limit is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, deadline(limit) - time.monotonic()))
    except concurrent.futures.TimeoutError:
        pass
    try:
        return future.result(timeout=GRACE)  # (its own failure, if it comes now, said as it is)
    except concurrent.futures.TimeoutError:
        raise RemoteError(
            f"{what()}: no answer within --remote-timeout ({limit:g} s): the store, or the connection to it, stalled"
        ) from None


def in_copy(call: Callable[..., T]) -> Callable[..., T]:
    """`call`, to be run in a thread of a pool with the request's stamp (a copy of this context)."""
    context = contextvars.copy_context()
    return lambda *args: context.run(call, *args)
