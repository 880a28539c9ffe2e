"""The gate's vocabulary: a plan (a sequence of the gate's that yields its blocking steps for a driver
to make), the place a tensor's bytes are had from, the grant of a range of them, and the errors that
send a tensor to its fallback."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import IntegrityError, RemoteError, ShardChangedError
from ..fallback import Copy
from ..identity import ShardKey
from ..sources.shard import ShardData

__all__ = ["UNREADABLE", "Grant", "Place", "Plan", "Present", "Refused", "Step", "run"]

UNREADABLE = (ShardChangedError, RemoteError, IntegrityError, OSError)
"""What a fallback stands in for: bytes gone or changed, a store that cannot give them, bytes that
fail the manifest, a read error of the disk."""


class Refused(ShardChangedError):
    """Bytes refused (EIO), the reason already reported: a shard changed in place, a tensor that could
    not be verified."""

    def __init__(self, message: str = "refused") -> None:
        super().__init__(message)


Step = tuple[str, Callable[[], Any]]
"""A blocking call a plan needs made, and what kind it is ("verify", "present", "read", "switch",
"ahead"): a mount runs each kind on its own bounded threads."""
T = TypeVar("T")
Plan = Generator[Step, Any, T]
"""A sequence of the gate: it yields the blocking steps, is sent what each returned (or thrown what
it raised), and returns its answer."""


def run(plan: Plan[T]) -> T:
    """Drive a plan in this thread: each step is made as it is asked for."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            _, call = plan.throw(thrown) if thrown is not None else plan.send(sent)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            sent, thrown = call(), None
        except BaseException as exc:  # handed to the plan, which decides (it raises it again, mostly)
            sent, thrown = None, exc


@dataclass(eq=False)
class Place:
    """Where a tensor's bytes are had: [start, end) of `data`, its own shard's or a fallback's copy."""

    name: str
    shard: ShardKey
    """The tensor's own shard (the model's)."""
    data: ShardData
    start: int
    end: int
    copy: Copy | None = None
    """The fallback's copy it is served from (None: its own shard)."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class Grant:
    """Bytes [low, high) of `place.data` that may go out: present and pinned where the source pins
    (the holder unpins them when done), or, where `copied` is given, a copy of them made as they came."""

    place: Place
    low: int
    high: int
    copied: bytes | None = None


Present = Callable[[Place, int, int], Generator[Step, Any, "bytes | None"]]
"""How a caller has bytes [low, high) of a place made present (and pinned): a plan of its own, whose
answer is a copy of the bytes or None (answer from the mapping)."""
