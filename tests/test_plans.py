"""The gate's plans have one driver rule, whoever drives them (the library's run(), in the calling
thread; a mount's, on worker threads): a step's Exception is handed to the plan, which decides;
anything else (Ctrl-C, SystemExit, a cancellation) goes on up, never into the plan, and the plan is
closed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import tensorfs
from helpers import write_reference
from tensorfs.gate import Plan, run
from tensorfs.mount.operations import TensorOperations
from tensorfs.mount.tree import Tree

Driver = Callable[[Plan[str]], str]


@pytest.fixture(params=["library", "mount"])
def drive(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Driver]:
    """Each driver of plans: the library's run(), and a mount's (TensorOperations._drive, in trio)."""
    if request.param == "library":
        yield run
        return
    write_reference(tmp_path / "m.safetensors", {"t": ("U8", [1], b"x")})
    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        ops = TensorOperations(Tree(model, "slash", {}))
        drive: Callable[[Plan[str]], Awaitable[str]] = ops._drive

        def driven(plan: Plan[str]) -> str:
            result: str = trio.run(drive, plan)
            return result

        yield driven


def plan_of(fails_with: BaseException, seen: list[str]) -> Plan[str]:
    """A plan of one step that raises `fails_with`: what reaches the plan is written in `seen`."""

    def step() -> Any:
        raise fails_with

    try:
        yield "read", step
        return "no failure"
    except ValueError:
        seen.append("handed to the plan")
        return "decided by the plan"
    except BaseException as exc:
        seen.append(f"{type(exc).__name__} in the plan")
        raise
    finally:
        seen.append("closed")


def test_a_steps_exception_is_handed_to_the_plan(drive: Driver) -> None:
    seen: list[str] = []
    assert drive(plan_of(ValueError("no"), seen)) == "decided by the plan"
    assert seen == ["handed to the plan", "closed"]


def test_anything_else_goes_on_up_and_the_plan_is_closed(drive: Driver) -> None:
    seen: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        drive(plan_of(KeyboardInterrupt(), seen))
    assert seen == ["GeneratorExit in the plan", "closed"]  # closed, never handed the interrupt
