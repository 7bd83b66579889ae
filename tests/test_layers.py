"""The package's layers point one way (ARCHITECTURE.md): what each package may import, and no cycles.

Every import counts, at module level or inside a function, under TYPE_CHECKING or not: a type-only
cycle is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nmt_cli"

# package -> packages it must never import (top-level modules: cli, config, artifacts, errors, progress)
FORBIDDEN = {
    "config": {"data", "model", "training", "inference", "evaluation", "cli"},
    "data": {"model", "training", "inference", "evaluation", "cli"},
    "model": {"training", "inference", "evaluation", "cli"},
    "inference": {"training", "evaluation", "cli"},
    "training": {"evaluation", "cli"},  # validation BLEU runs the search of inference
    "evaluation": {"cli"},
}
NO_TORCH = ("config", "data", "cli", "errors", "artifacts")  # `nmt --help` and the data stages stay light


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules `path` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imports_of(path, known) if m in known and m != name}
            for name, path in known.items()}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_scan_sees_the_package() -> None:
    edges = graph()
    assert ("nmt_cli.training.train" in edges
            and "nmt_cli.model.transformer" in edges["nmt_cli.training.train"])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = [f"{module} imports {target}" for module, targets in graph().items() if area(module) == package
             for target in sorted(targets) if area(target) in FORBIDDEN[package]]
    assert not wrong, wrong


@pytest.mark.parametrize("package", NO_TORCH)
def test_light_layers_import_no_torch(package: str) -> None:
    for name, path in modules().items():
        if area(name) == package:
            heavy = {m for m in imports_of(path, {}) if m == "torch" or m.startswith("torch.")}
            assert not heavy, f"{name} imports {sorted(heavy)}"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A list of modules forming an import cycle (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    edges = graph()
    # a package's __init__ is imported before its modules; it imports none of them here
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])
