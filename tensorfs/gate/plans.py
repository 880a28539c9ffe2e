"""The gate's vocabulary: a plan (a sequence of the gate's that yields its blocking steps for a driver
to make), the place a tensor's bytes are had from, the grant of a range of them, and the errors that
send a tensor to its fallback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ..catalogue.fallbacks import Copy
from ..errors import IntegrityError, RemoteError, ShardChangedError
from ..sources import waits
from ..sources.shard import ShardData
from ..utils.identity import ShardKey

__all__ = [
    "UNREADABLE",
    "Answer",
    "Grant",
    "Outcome",
    "Place",
    "Plan",
    "Present",
    "Refused",
    "Step",
    "StepKind",
    "next_step",
    "run",
]

UNREADABLE = (ShardChangedError, RemoteError, IntegrityError, OSError)
"""What a fallback stands in for: bytes gone or changed, a store that cannot give them, bytes that
fail the manifest, a read error of the disk."""


class Refused(ShardChangedError):
    """Bytes refused (EIO), the reason already reported: a shard changed in place, a tensor that could
    not be verified."""

    def __init__(self, message: str = "refused") -> None:
        super().__init__(message)


StepKind = Literal["present", "read", "ahead", "verify", "switch"]
"""The kinds of blocking step, a closed set (mypy holds every yield to it, and a driver's choice by
kind to all of it): bytes made present for a reader, a file read, a window ahead of a reader,
hashing, a fallback opened and checked. A mount runs each kind on its own bounded threads."""
Step = tuple[StepKind, Callable[[], Any]]
"""A blocking call a plan needs made, and its kind."""
T = TypeVar("T")
Plan = Generator[Step, Any, T]
"""A sequence of the gate: it yields the blocking steps, is sent what each returned (or thrown what
it raised), and returns its answer. Driven by next_step() alone (run(), and a mount's driver)."""


@dataclass(frozen=True)
class Outcome:
    """What a step gave: its value, or the Exception it raised, for the plan to decide on (a fallback,
    or raised again). Anything else (Ctrl-C, SystemExit, a cancellation) is no outcome: it goes on
    up through the driver, and the plan is closed."""

    value: Any = None
    error: Exception | None = None

    @classmethod
    def of(cls, call: Callable[[], Any]) -> Outcome:
        """Make the call (in whatever thread the driver chose)."""
        try:
            return cls(call())
        except Exception as exc:
            return cls(error=exc)


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What a plan returned: it asks for no more steps."""

    value: T


def next_step(plan: Plan[T], outcome: Outcome) -> Step | Answer[T]:
    """Hand the plan what its last step gave (Outcome() to start it): the step it asks for next, or
    its answer."""
    try:
        return plan.throw(outcome.error) if outcome.error is not None else plan.send(outcome.value)
    except StopIteration as done:
        return Answer(done.value)


def run(plan: Plan[T]) -> T:
    """Drive a plan in this thread: each step is made as it is asked for (one request: sources/waits.py)."""
    with contextlib.closing(plan), waits.request():
        outcome = Outcome()
        while True:
            step = next_step(plan, outcome)
            if isinstance(step, Answer):
                return step.value
            outcome = Outcome.of(step[1])


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
