"""The package's layers import downwards only: no two subpackages (or top-level modules) import each
other, directly or through others, counting imports inside functions too (docs/architecture.md)."""

from __future__ import annotations

import ast
import collections
import pathlib

import rlharvest

PACKAGE = pathlib.Path(rlharvest.__file__).parent


def _imports() -> dict[str, set[str]]:
    """``{module: {modules of rlharvest it imports anywhere in its body}}``."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = list(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                graph[module].update([target] + [f"{target}.{alias.name}" for alias in node.names])
            elif isinstance(node, ast.Import):
                graph[module].update(alias.name for alias in node.names)
        graph[module] = {t for t in graph[module] if t.startswith("rlharvest.") and not module.startswith(t + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_subpackages_import_each_other_in_no_cycle():
    layers: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in _imports().items():
        layers[_layer(module)].update(_layer(t) for t in targets if _layer(t) != _layer(module))
    assert _cycle(layers) is None


def test_transport_modules_import_each_other_in_no_cycle():
    graph = {m: {t for t in ts if t.startswith("rlharvest.transport.")} for m, ts in _imports().items()
             if m.startswith("rlharvest.transport.")}
    assert _cycle(graph) is None


def _module_graph() -> dict[str, set[str]]:
    """``{module: {modules of rlharvest it imports}}`` for every module (packages as their ``__init__``),
    imports inside functions and under ``TYPE_CHECKING`` included. ``from pkg import a, b`` names the
    submodules ``pkg.a`` and ``pkg.b`` when both are modules, else ``pkg`` itself as well."""
    modules: dict[str, pathlib.Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                subs = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
                targets.update(subs if len(subs) == len(node.names) else subs | {base})
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def test_no_module_imports_itself_through_others():
    """Every module of rlharvest, those inside ``collectors/`` too: each imports only what is below it
    (docs/architecture.md), lazy imports included."""
    assert _cycle(_module_graph()) is None


def test_the_module_graph_sees_every_module():
    graph = _module_graph()
    assert "rlharvest.collectors.engine.engine" in graph and "rlharvest.collectors.base" in graph
    assert "rlharvest.collectors.engine.engine" in graph["rlharvest.collectors._workers"]
    assert "rlharvest.collectors._workers" in graph["rlharvest.collectors.multi"]
