"""The import graph of `kvdoctor/` (pure AST, no vLLM): every import counted, no circle, layers that
point one way, and formatting at the edge.

- Every import of a kvdoctor module counts, inside functions too: a function-level import defers
  loading (the CLI stays instant: `kvdoctor --help` imports no vLLM/torch, tests/test_cli_basics.py),
  it does not make a dependency go away. Only `if TYPE_CHECKING:` blocks are left out (they never run;
  they are the type checker's). Third-party imports (vLLM, torch, hypothesis, rich, ...) are not in
  the graph: deferring them is allowed anywhere.
- No cycle in that graph: a circle makes the import order matter and hides which layer depends on
  which.
- Every edge points down the layers of /work/shared/design.md (or stays inside one layer): `LAYERS`
  places every module, a new module must be placed. The one edge allowed to be lazy by design is the
  CLI's import of the application functions (`kvdoctor.cli.* -> kvdoctor.app`, `explore.app`, ...), which
  points down anyway.
- Application code (everything outside `kvdoctor/cli` and `kvdoctor/report`) never imports
  `kvdoctor.report` (the formatters), at any depth: data flows cli -> app -> ... and `report`
  only formats what the CLI hands it (the layers say the same: `report` sits above the application).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .conftest import ROOT

PACKAGE = ROOT / "kvdoctor"
EDGE = ("kvdoctor.cli", "kvdoctor.report")  # may import the formatters

# The layers, top to bottom (design.md; "pkg.*" is the package and everything in it; the longest match
# places a module). A module may import its own layer or any layer below, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("kvdoctor.cli.*", "kvdoctor.__main__")),
    # the formatters: the CLI hands them what an application function returned (some result types live
    # in their application package: diagnose's, matrix's, explore's); nothing under them imports them
    ("report", ("kvdoctor.report.*",)),
    ("application", ("kvdoctor.app", "kvdoctor.diagnose.*", "kvdoctor.explore.*", "kvdoctor.hunt.*",
                     "kvdoctor.matrix.*",
                     "kvdoctor.check.*", "kvdoctor.export.*", "kvdoctor.version_report")),
    ("levels", ("kvdoctor.levels.*",)),
    ("scenario", ("kvdoctor.scenario",)),
    # a recipe's setup resolved on this machine (its memory, a model's config.json, the fallbacks)
    ("resolution", ("kvdoctor.resolution", "kvdoctor.matrix.reasons")),
    # what the application functions return, with the exit-code mapping and the release measurements
    # (kvdoctor/data) that a result carries as a hint
    ("results", ("kvdoctor.results", "kvdoctor.outcome_codes", "kvdoctor.matrix", "kvdoctor.matrix.known",
                 "kvdoctor.matrix.data")),
    ("steps", ("kvdoctor.steps", "kvdoctor.recipes.*")),
    # the engine and what observes it; reading a server's log (diagnose's reader, used by the serve
    # level) is observing it
    ("engine", ("kvdoctor.engine.*", "kvdoctor.logic.*", "kvdoctor.observe.*", "kvdoctor.diagnose",
                "kvdoctor.diagnose.reader", "kvdoctor.diagnose.traceback", "kvdoctor.diagnose.logline",
                "kvdoctor.diagnose.evidence", "kvdoctor.diagnose.serveline", "kvdoctor.diagnose.pyrepr",
                "kvdoctor.diagnose.features")),
    # plain data and facts every layer reads: the recipe's data model, errors, releases, what is installed,
    # and the adapter's table of vLLM's private names (a recipe's signature spells functions by it)
    ("base", ("kvdoctor", "kvdoctor.errors", "kvdoctor.releases", "kvdoctor.installed", "kvdoctor.models.*",
              "kvdoctor.recipes.model", "kvdoctor.engine.compat.names",
              # process hygiene every layer (and the exported scripts) shares: kvdoctor's cache directory,
              # nothing left behind on exit
              "kvdoctor.user_cache", "kvdoctor.clean_exit",
              # what an `expect` step asks, compared with what was observed (exported scripts copy it in)
              "kvdoctor.expectation")),
)


@dataclass(frozen=True)
class Import:
    module: str  # the kvdoctor module imported
    file: str  # where, relative to the repository
    line: int
    in_function: bool  # deferred to a call (counted all the same)


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


def _statements(body: list[ast.stmt], in_function: bool) -> list[tuple[ast.stmt, bool]]:
    """Every statement that can run, each with whether it runs only when a function is called."""
    out: list[tuple[ast.stmt, bool]] = []
    for node in body:
        out.append((node, in_function))
        if isinstance(node, ast.If) and _is_type_checking(node):
            out += _statements(node.orelse, in_function)
            continue
        deeper = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, []) or []:
                if isinstance(child, ast.stmt):
                    out += _statements([child], deeper)
                else:  # except handlers, match cases: their bodies
                    out += _statements(getattr(child, "body", []), deeper)
    return out


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    where = str(path.relative_to(ROOT))
    found: list[Import] = []
    for node, in_function in _statements(tree.body, False):
        if isinstance(node, ast.Import):
            found += [Import(a.name, where, node.lineno, in_function) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from kvdoctor.levels import serve`: the submodule itself; the package only for names it defines
            submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
            found += [Import(sub, where, node.lineno, in_function) for sub in submodules]
            if source in MODULES and len(submodules) < len(node.names):
                found.append(Import(source, where, node.lineno, in_function))
    return [i for i in found if i.module != module]


IMPORTS = {module: _imports(module) for module in MODULES}


def _graph() -> dict[str, set[str]]:
    return {module: {i.module for i in imports} for module, imports in IMPORTS.items()}


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest pattern that places `module` (None: not placed)."""
    best: tuple[int, int] | None = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            stem = pattern.removesuffix(".*")
            placed = module == stem or (pattern.endswith(".*") and module.startswith(stem + "."))
            if placed and (best is None or len(stem) > best[1]):
                best = (index, len(stem))
    return best[0] if best else None


def test_the_scan_sees_the_package_and_imports_inside_functions():
    """The graph is not vacuous: the CLI's app imports its command modules at the top, and a command
    module imports the application functions inside its command (deferred, counted)."""
    graph = _graph()
    assert len(graph) > 50
    assert {"kvdoctor.cli.repro_cmd", "kvdoctor.cli.shell"} <= graph["kvdoctor.cli.app"]
    deferred = [i for i in IMPORTS["kvdoctor.cli.repro_cmd"] if i.module == "kvdoctor.app"]
    assert deferred and all(i.in_function for i in deferred)
    assert "kvdoctor.levels.serve" in graph["kvdoctor.export.script"]  # `from kvdoctor.levels import serve`


def test_no_import_cycle_counting_every_import():
    graph = _graph()
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycles.append(" -> ".join([*path[path.index(module):], module]))
            return
        state[module] = "open"
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def test_every_module_has_a_layer():
    assert [module for module in MODULES if layer_of(module) is None] == []


def test_imports_point_down_the_layers():
    upward = []
    for module, imports in IMPORTS.items():
        here = layer_of(module)
        for i in imports:
            there = layer_of(i.module)
            if here is not None and there is not None and there < here:
                upward.append(f"{i.file}:{i.line} ({LAYERS[here][0]}) imports {i.module} ({LAYERS[there][0]})")
    assert upward == []


def test_the_layer_check_can_fail():
    """An application module placed under the engine would be caught importing upward."""
    assert layer_of("kvdoctor.app") < layer_of("kvdoctor.levels.runners") < layer_of("kvdoctor.scenario")
    assert layer_of("kvdoctor.scenario") < layer_of("kvdoctor.results") < layer_of("kvdoctor.engine.harness")
    assert layer_of("kvdoctor.diagnose.app") == layer_of("kvdoctor.app")
    assert layer_of("kvdoctor.diagnose.reader") == layer_of("kvdoctor.engine.harness")


def _formatter_imports() -> list[Import]:
    """Imports of `kvdoctor.report` (at any depth of the code) from outside the CLI and `report`."""
    return [i for module in MODULES if not module.startswith(EDGE) for i in IMPORTS[module]
            if i.module == "kvdoctor.report" or i.module.startswith("kvdoctor.report.")]


def test_application_code_never_imports_the_formatters():
    assert [f"{i.file}:{i.line} imports {i.module}" for i in _formatter_imports()] == []
