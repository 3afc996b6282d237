"""The CLI has no import circle: command modules never import `kvdoctor.cli.app`, which imports them."""

from __future__ import annotations

import ast

from .conftest import ROOT

CLI = ROOT / "kvdoctor" / "cli"


def _cli_imports() -> dict[str, set[str]]:
    """module -> the kvdoctor.cli modules it imports (at any depth of its code)."""
    graph: dict[str, set[str]] = {}
    for path in CLI.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvdoctor.cli":
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvdoctor.cli."):
                found.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("kvdoctor.cli."))
        graph[path.stem] = found
    return graph


def test_no_cli_module_imports_the_app_back():
    graph = _cli_imports()
    assert [m for m, deps in graph.items() if "app" in deps and m != "app"] == []


def test_cli_import_graph_has_no_cycle():
    graph = _cli_imports()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", " -> ".join([*path, module])
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_app_registers_commands_without_late_imports():
    """Imports at the top of `cli/app.py`, none after the first command (the old `noqa: E402` circle)."""
    tree = ast.parse((CLI / "app.py").read_text())
    first_def = next(i for i, node in enumerate(tree.body) if isinstance(node, ast.FunctionDef))
    late = [node.lineno for node in tree.body[first_def:] if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert late == []


def test_commands_are_registered_in_order_one_module_each():
    from typer.main import get_command

    from kvdoctor.cli.app import app

    assert list(get_command(app).commands) == ["repro", "inspect", "audit", "explore", "matrix", "diagnose",
                                               "hunt", "check", "version", "cache"]
    for command in ("repro", "inspect", "audit", "diagnose", "hunt", "check", "version", "explore", "matrix",
                    "cache"):
        assert (CLI / f"{command}_cmd.py").is_file(), command
    defined = [node.name for node in ast.parse((CLI / "app.py").read_text()).body
               if isinstance(node, ast.FunctionDef)]
    assert defined == ["_version_callback", "_main", "main"]  # the commands live in their modules


def test_serve_flags_are_declared_once_and_taken_by_every_run_command():
    """`ServeFlags` is the one declaration: repro, inspect and audit show the same flags in its order
    (`--engine` included), and no command module spells one of them out again."""
    from dataclasses import fields

    from typer.main import get_command

    from kvdoctor.cli.app import app
    from kvdoctor.cli.serve_flags import ServeFlags

    names = [f.name for f in fields(ServeFlags)]
    assert "engine" in names and len(names) >= 16
    commands = get_command(app).commands
    for command in ("repro", "inspect", "audit"):
        taken = [p.name for p in commands[command].params if p.name in names]
        assert taken == names, command
    for path in CLI.glob("*_cmd.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                spelled = {a.arg for a in node.args.args + node.args.kwonlyargs} & {"block_size", "gpu_blocks",
                                                                                    "kv_transfer_config"}
                assert not spelled, (path.name, node.name, spelled)


def test_serve_flags_become_the_setup_overrides():
    from kvdoctor.cli.serve_flags import ServeFlags, overrides

    given = overrides(ServeFlags(block_size=16, gpu_blocks=64, async_scheduling=True, engine="core",
                                 worker="simulated"))
    assert given.block_size == 16 and given.gpu_blocks == 64 and given.async_scheduling is True
    assert given.engine == "core" and given.worker == "simulated"
    assert overrides(ServeFlags()).engine is None
