"""The package's shape: no import cycles, the layers as pyproject.toml's import-linter contracts say
them (docs/design.md's package map), and no module grows past what one reader takes in.

Every import counts, in a function too (a lazy import hides a cycle, it does not remove it), and
those under `if TYPE_CHECKING:` too (a type one module needs of another is a dependency all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tensorfs

PACKAGE = Path(tensorfs.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def import_graph(*, types: bool = True) -> dict[str, set[str]]:
    """Which of the package's modules each module imports (`types`: for type checking only too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text())
        skipped = set() if types else _type_checking_only(tree)
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                prefix = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` imports the module x when there is one, else a name of the package
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            graph[name].update(target for target in targets if target in modules and target != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert cycles(import_graph(types=True)) == []


LONG_LINES = 600
"""Past this, a module is said to be long at the end of the run (conftest): split it along its jobs."""
MAX_LINES = 750
"""Past this, one fails the suite: a size is a symptom of a module doing several jobs, not a goal."""


def long_modules(limit: int) -> dict[str, int]:
    """The package's modules over `limit` lines, and how many lines each has."""
    return {name: n for name, (path, _) in _modules().items() if (n := len(path.read_text().splitlines())) > limit}


def test_no_module_is_over_750_lines() -> None:
    assert long_modules(MAX_LINES) == {}


def test_the_layers_are_as_the_contracts_say() -> None:
    """pyproject.toml's import-linter contracts (docs/design.md's package map): each layer imports only
    those below it, the sources know nothing of the model, a format's parser is pure, the mount's
    tree imports nothing heavy. Run here too, so that a bare pytest holds them as make lint does."""
    import subprocess
    import sys

    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(linter), "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
