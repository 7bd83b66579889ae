"""The package's layers point one way, as ARCHITECTURE.md's "Packages" table states them: each row's
"may import" column is the rule this file reads, so the map and the check cannot disagree.

Every import counts, at module level or inside a function, under TYPE_CHECKING or not: a type-only
cycle is still two modules that cannot be read apart. A module may always import its own package
and `nmt_cli` itself (the version); `torch` only where its row lists it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nmt_cli"
MAP = PACKAGE.parent / "ARCHITECTURE.md"


def table_rows(markdown: str, heading: str = "## Packages") -> dict[str, tuple[set[str], set[str]]]:
    """The first table under `heading`: area -> (the names the "owns" column puts in backticks, the
    names the "may import" column does). An area is a package (`config/`) or a top-level module."""
    section = markdown.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue  # the header, its rule, or not a row
        name = cells[0].strip("`").rstrip("/")
        rows[name] = (set(re.findall(r"`([^`]+)`", cells[1])), set(re.findall(r"`([^`]+)`", cells[2])))
    return rows


def allowed_imports() -> dict[str, set[str]]:
    return {area: allowed for area, (_, allowed) in table_rows(MAP.read_text(encoding="utf-8")).items()}


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


def all_imports() -> dict[str, set[str]]:
    """Every module -> everything it imports (inside nmt_cli or not)."""
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def graph() -> dict[str, set[str]]:
    """The imports between nmt_cli's own modules."""
    known = modules()
    return {name: {m for m in targets if m in known} for name, targets in all_imports().items()}


def area(module: str) -> str:
    """nmt_cli.config.core -> config; nmt_cli.cli -> cli; nmt_cli -> "" (the root: the version)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(imports: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Each import the table does not allow: of another area not in the importer's row, of torch
    where its row does not list `torch`, or by a module of an area the table has no row for."""
    wrong = []
    for module, targets in sorted(imports.items()):
        here = area(module)
        if here and here not in allowed:
            wrong.append(f"{module}: ARCHITECTURE.md's Packages table has no row for {here!r}")
            continue
        rule = allowed.get(here, set()) | {here, ""}
        for target in sorted(targets):
            if target == "torch" or target.startswith("torch."):
                if "torch" not in rule:
                    wrong.append(f"{module} imports {target}, and {here}'s row does not list torch")
            elif target.startswith("nmt_cli") and area(target) not in rule:
                wrong.append(f"{module} imports {target}, which {here}'s row does not allow")
    return wrong


def test_the_scan_sees_the_package_and_the_map() -> None:
    edges = graph()
    assert ("nmt_cli.training.train" in edges
            and "nmt_cli.model.transformer" in edges["nmt_cli.training.train"])
    allowed = allowed_imports()
    assert allowed["errors"] == set() and "torch" in allowed["model"] and "torch" not in allowed["data"]


def test_every_import_is_one_the_map_allows() -> None:
    wrong = violations(all_imports(), allowed_imports())
    assert not wrong, "\n".join(wrong)


def test_a_planted_import_the_map_does_not_allow_fails() -> None:
    """The check itself: `config` importing `hooks`, or `data` importing torch, is refused; an import
    that the row lists, of the own package, or of the root passes."""
    allowed = allowed_imports()
    fine = {"nmt_cli.config.core": {"nmt_cli.errors", "nmt_cli.config.model", "nmt_cli", "yaml"},
            "nmt_cli.model.file": {"torch", "torch.nn", "nmt_cli.data.dataset"}}
    assert violations(fine, allowed) == []
    planted = {"nmt_cli.config.core": {"nmt_cli.hooks"}, "nmt_cli.data.bpe": {"torch.nn"},
               "nmt_cli.model.file": {"nmt_cli.inference.search"}, "nmt_cli.nowhere": set()}
    assert violations(planted, allowed) == [
        "nmt_cli.config.core imports nmt_cli.hooks, which config's row does not allow",
        "nmt_cli.data.bpe imports torch.nn, and data's row does not list torch",
        "nmt_cli.model.file imports nmt_cli.inference.search, which model's row does not allow",
        "nmt_cli.nowhere: ARCHITECTURE.md's Packages table has no row for 'nowhere'"]


def test_the_table_reads_a_row_as_written() -> None:
    rows = table_rows("# x\n\n## Packages\n\n| package | owns | may import |\n|---|---|---|\n"
                      "| `a/` | `one`, `two` (x) | `b`, `torch` |\n| `b` | it | nothing |\n\n## Next\n"
                      "| `c` | `z` | `a` |\n")
    assert rows == {"a": ({"one", "two"}, {"b", "torch"}), "b": (set(), set())}


def test_the_map_has_a_row_for_each_area_and_no_other() -> None:
    areas = {area(m) for m in modules()} - {""}
    assert set(allowed_imports()) == areas


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_the_map_and_the_package_docstring_name_every_module(package: str) -> None:
    """A newcomer reads the table or the package's `__init__.py` to find where a thing lives: each
    names every module of the package (in backticks)."""
    owned = table_rows(MAP.read_text(encoding="utf-8"))[package][0]
    init = PACKAGE / package / "__init__.py"
    docstring = set(re.findall(r"`([^`]+)`", ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
                               or ""))
    names = {p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"}
    assert not names - owned, f"ARCHITECTURE.md's {package}/ row does not name {sorted(names - owned)}"
    assert not names - docstring, f"{init} does not name {sorted(names - docstring)}"


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


def named_in_walk(markdown: str) -> tuple[set[str], set[str]]:
    """The walk's file paths (`training/train.py`) and the names of its references to code (the last
    part: `plan_train` of `corpus.plan_train`, `run` of `Step.run`, `resolve_train` itself)."""
    walk = markdown.split("\n## Following one option", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r"`([^`]+)`", walk)
    files = {q.split()[0] for q in quoted if q.split()[0].endswith(".py")}
    code = r"(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*)(\(.*\))?"  # name, module.name, name(args)
    names = {m.group(1) for q in quoted if not q.endswith(".py")
             for m in [re.fullmatch(code, q.split(" = ")[0])] if m}
    return files, names


def not_in_the_code(markdown: str) -> list[str]:
    """The files and code names of the walk that nmt_cli (or tests/) does not have."""
    files, names = named_in_walk(markdown)
    source = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))
    defined = {p.stem for p in PACKAGE.rglob("*.py")} | {
        a or b for a, b in re.findall(r"(?:def|class) (\w+)|^\s*(?:self\.)?(\w+)(?:: [^=\n]+)?(?: = |$)",
                                      source, flags=re.M)}
    return sorted(f for f in files if not (PACKAGE / f).is_file() and not (PACKAGE.parent / f).is_file()) + \
        sorted(n for n in names if n not in defined)


def test_the_walk_names_only_files_and_functions_that_exist() -> None:
    """ARCHITECTURE.md follows one option through the code: each file it names is there, and each
    function, class, attribute or module it names is defined in nmt_cli; a stale name fails."""
    markdown = MAP.read_text(encoding="utf-8")
    files, names = named_in_walk(markdown)
    assert {"training/train.py", "config/train.py"} <= files and {"plan_train", "resolve_train"} <= names
    assert not_in_the_code(markdown) == [], "ARCHITECTURE.md's walk names what nmt_cli does not define"
    stale = markdown.replace("calls `corpus.plan_train`",
                             "calls `corpus.micro_batches_per_rank` in `training/plan.py`")
    assert not_in_the_code(stale) == ["training/plan.py", "micro_batches_per_rank"]
