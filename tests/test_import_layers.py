"""safestage's modules import one another in layers: no import circle but the error classes'.

Every import counts: one inside a function (a call-time import is a dependency all the same)
and one under ``if TYPE_CHECKING:`` (the types a module names are its dependencies too). An
import of the package itself for one of its names (``from .. import __version__``) counts as an
import of ``safestage/__init__.py``, which imports the front door (_api) and so all below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import safestage

PACKAGE = Path(safestage.__file__).parent
# _errors makes its classes also SafetensorError / RuntimeError through these two, which
# subclass its own: a circle by design, and one of plain classes.
ERROR_CLASSES = {"safestage._errors", "safestage._safetensors_errors", "safestage._torch_errors"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the safestage modules it imports, anywhere in it}."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                # ``from . import _save`` imports the module _save; ``from .. import x`` of a
                # name that is no module imports the package for it.
                targets = [each for each in submodules if each in modules]
                if len(targets) < len(submodules):
                    targets.append(base)
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """One import circle through ``start`` inside the component ``within`` (for the message)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for other in sorted(graph[node] & within):
            if other == start:
                return [*paths[node], start]
            if other not in paths:
                paths[other] = [*paths[node], other]
                queue.append(other)
    return [start]


def test_no_import_circle_but_the_error_classes() -> None:
    graph = import_graph()
    assert "safestage._patch" in graph and "safestage.dcp" in graph, "the graph misses the package"
    found = [component for component in circles(graph) if not set(component) <= ERROR_CLASSES]
    assert found == [], "import circles: " + "; ".join(
        f"{len(component)} modules, e.g. " + " -> ".join(_path(graph, component[0], set(component)))
        for component in found
    )


@pytest.mark.parametrize("integration", ["safestage.dcp", "safestage.lightning", "safestage.transformers"])
def test_the_activation_mechanism_imports_no_integration(integration: str) -> None:
    """_patch holds the hook points and the activation stack; what a hook does is registered
    by the modules above it (_writers, _hooks), so _patch imports only the leaves it stands on
    (settings, the job registry, its post-import hook), and the save pipeline (_save,
    _snapshot, _work) reaches no integration."""
    graph = import_graph()
    assert graph["safestage._patch"] <= {"safestage._config", "safestage._work", "safestage._post_import"}

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for other in graph[todo.pop()] - seen:
                seen.add(other)
                todo.append(other)
        return seen

    for low in ("safestage._patch", "safestage._save", "safestage._snapshot", "safestage._work"):
        assert integration not in reached(low), f"{low} reaches {integration}"
