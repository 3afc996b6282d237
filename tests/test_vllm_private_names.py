"""Only the adapter (`kvdoctor/engine/compat/`) reads or calls vLLM's private names.

What counts as a vLLM private name: a single-underscore name (`_x`, not `__x__`) that the vLLM
source kvdoctor drives defines (a function, method or class, or a name or attribute it assigns,
`self._x = ...` included), minus the `_names` kvdoctor defines itself (its defs, classes, names, and
attributes it assigns on `self`/`cls`: its own helpers share the convention and cannot be told apart
by name alone, so a vLLM name kvdoctor also defines is not checked). The vLLM source read is the installed release's
packages that the adapter imports from (`VLLM_ROOTS`; a test checks every module the adapter names
lies inside them). It is parsed, never imported, so this test costs about a second.

A use is any attribute access `obj._x` (read, call, write, delete), a `getattr`/`hasattr`/`setattr`/
`delattr` with the name as a string constant, or a `from vllm... import _x`, in any module of
`kvdoctor/` outside the adapter.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

import pytest

from .conftest import ROOT

KVDOCTOR = ROOT / "kvdoctor"
ADAPTER = KVDOCTOR / "engine" / "compat"
# The vLLM packages and modules the adapter imports from (relative to the vllm package).
VLLM_ROOTS = ("v1", "distributed/kv_transfer", "config", "forward_context.py", "sampling_params.py",
              "utils/hashing.py")
ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _defined_names(tree: ast.AST, any_object: bool) -> set[str]:
    """The `_names` a module defines: defs, classes, assigned names, and attributes it assigns on
    `self`/`cls` (on any object with `any_object`: vLLM's side; kvdoctor writing `obj._x` onto a
    vLLM object must not make `_x` its own)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and (
                any_object or isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


@lru_cache(maxsize=1)
def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _files(root: Path) -> list[Path]:
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


@lru_cache(maxsize=1)
def vllm_private_names() -> frozenset[str]:
    names: set[str] = set()
    for rel in VLLM_ROOTS:
        for path in _files(_vllm_dir() / rel):
            names |= _defined_names(ast.parse(path.read_text(encoding="utf-8")), any_object=True)
    return frozenset(names)


@lru_cache(maxsize=1)
def kvdoctor_own_names() -> frozenset[str]:
    names: set[str] = set()
    for path in KVDOCTOR.rglob("*.py"):
        names |= _defined_names(ast.parse(path.read_text(encoding="utf-8")), any_object=False)
    return frozenset(names)


def private_uses(source: str, private: frozenset[str] | set[str]) -> list[tuple[int, str]]:
    """(line, name) of every use of a name in `private` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in private):
            found.append((node.lineno, str(node.args[1].value)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found += [(node.lineno, alias.name) for alias in node.names if _is_private(alias.name)]
    return sorted(found)


def test_no_vllm_private_name_outside_the_adapter():
    private = vllm_private_names() - kvdoctor_own_names()
    leaks = []
    for path in sorted(KVDOCTOR.rglob("*.py")):
        if ADAPTER in path.parents:
            continue
        for line, name in private_uses(path.read_text(encoding="utf-8"), private):
            leaks.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not leaks, "vLLM private names outside kvdoctor/engine/compat/:\n" + "\n".join(leaks)


def test_the_scan_finds_what_it_must():
    """The scan is not vacuous: vLLM's names are read, and each form of use is caught."""
    private = vllm_private_names() - kvdoctor_own_names()
    assert {"_req_status", "_build_store_jobs", "_jobs"} <= private, sorted(private)[:20]
    snippet = ("from vllm.x import _hidden\n"
               "state = connector._req_status\n"
               "connector._jobs = {}\n"
               "ok = hasattr(scheduler, '_build_store_jobs')\n"
               "mine = self._own_helper\n")
    assert private_uses(snippet, private | {"_hidden"}) == [
        (1, "_hidden"), (2, "_req_status"), (3, "_jobs"), (4, "_build_store_jobs")]


def test_the_scanned_vllm_source_covers_every_module_the_adapter_imports():
    """VLLM_ROOTS stays honest: each vLLM module the adapter names lies inside it."""
    from kvdoctor.engine import compat
    from kvdoctor.engine.compat import worker

    modules = {*compat._MODULES.values(), *worker._WORKER_MODULES.values(),
               *worker._OPTIONAL_WORKER_MODULES.values()} - {"vllm"}
    for source in ADAPTER.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("vllm.") and " " not in node.value:
                modules.add(node.value)
    outside = []
    for module in sorted(modules):
        rel = module.removeprefix("vllm.").replace(".", "/")
        if not any(rel == root.removesuffix(".py") or rel.startswith(root + "/") for root in VLLM_ROOTS):
            outside.append(module)
    assert not outside, f"add these to VLLM_ROOTS: {outside}"
