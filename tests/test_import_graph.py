"""The import graph of `kvdoctor/` (pure AST, no vLLM): no circle, and formatting stays at the edge.

- No cycle among the modules' top-level imports (those that run when a module is imported;
  imports inside functions and under `if TYPE_CHECKING:` are left out): a circle makes the import
  order matter and hides which layer depends on which.
- Application code (everything outside `kvdoctor/cli` and `kvdoctor/report`) never imports
  `kvdoctor.report` (the formatters), at any depth: data flows cli -> app -> ... and `report`
  only formats what the CLI hands it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGE = ROOT / "kvdoctor"
EDGE = ("kvdoctor.cli", "kvdoctor.report")  # may import the formatters


@dataclass(frozen=True)
class Import:
    module: str  # the kvdoctor module imported
    file: str  # where, relative to the repository
    line: int


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run on import: the module's body and the blocks of its if/try/with."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            if not _is_type_checking(node):
                out += _top_level(node.body)
            out += _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
        elif isinstance(node, ast.With):
            out += _top_level(node.body)
    return out


def _imports(module: str, top_level_only: bool) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    nodes = _top_level(tree.body) if top_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    where = str(path.relative_to(ROOT))
    found: list[Import] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [Import(a.name, where, node.lineno) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source in MODULES:
                found.append(Import(source, where, node.lineno))
            # `from kvdoctor.cli import options`: the submodule itself
            found += [Import(f"{source}.{a.name}", where, node.lineno) for a in node.names
                      if f"{source}.{a.name}" in MODULES]
    return found


def _graph() -> dict[str, set[str]]:
    return {module: {i.module for i in _imports(module, top_level_only=True)} - {module} for module in MODULES}


def test_the_scan_sees_the_package():
    """The graph is not vacuous: the CLI's app imports its command modules at the top."""
    graph = _graph()
    assert len(graph) > 50
    assert {"kvdoctor.cli.repro_cmd", "kvdoctor.cli.shell"} <= graph["kvdoctor.cli.app"]


def test_no_import_cycle_among_top_level_imports():
    graph = _graph()
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        state[module] = "open"
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def _formatter_imports() -> list[Import]:
    """Imports of `kvdoctor.report` (at any depth of the code) from outside the CLI and `report`."""
    return [i for module in MODULES if not module.startswith(EDGE)
            for i in _imports(module, top_level_only=False)
            if i.module == "kvdoctor.report" or i.module.startswith("kvdoctor.report.")]


def test_application_code_never_imports_the_formatters():
    assert [f"{i.file}:{i.line} imports {i.module}" for i in _formatter_imports()] == []
