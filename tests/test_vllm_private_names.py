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

Inside the adapter, the names live in one table (`kvdoctor/engine/compat/names.py`): no other adapter
module spells a vLLM private name (`portable.py`, copied into exported scripts, spells table rows only),
and every row is checked against the source of every installed release (the checkout's environments,
or KVDOCTOR_MATRIX_ENV_DIR's, as `kvdoctor matrix` finds them): each name resolves under one of its
spellings, or its row declares what the adapter's probe does where it is absent. Which releases lack
a name is read from their source here, never written down by version.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest

from kvdoctor.engine.compat import names as vllm_names

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
                any_object or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
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


# -- the adapter's names table ----------------------------------------------------------------------

TABLE_MODULE = ADAPTER / "names.py"
PORTABLE = ADAPTER / "portable.py"


def _spelled_names(source: str, private: frozenset[str] | set[str]) -> list[tuple[int, str]]:
    """(line, name) of every vLLM private name in `source`: a use (`private_uses`) or a string constant
    that is exactly the name (what `getattr(obj, NAME)` with a variable would be handed)."""
    found = set(private_uses(source, private))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.add((node.lineno, node.value))
    return sorted(found)


def test_the_adapter_spells_vllm_private_names_only_in_its_table():
    private = vllm_private_names() - kvdoctor_own_names()
    table = {name for entry in vllm_names.TABLE for name in entry.spellings}
    outside, portable_unlisted = [], []
    for path in sorted(ADAPTER.glob("*.py")):
        if path == TABLE_MODULE:
            continue
        for line, name in _spelled_names(path.read_text(encoding="utf-8"), private):
            if path == PORTABLE:  # an exported script's copy: it cannot import the table, but spells its rows
                if name not in table:
                    portable_unlisted.append(f"{path.name}:{line}: {name}")
            else:
                outside.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not outside, "vLLM private names spelled outside compat/names.py:\n" + "\n".join(outside)
    assert not portable_unlisted, "portable.py spells names the table lacks:\n" + "\n".join(portable_unlisted)


def test_the_table_scan_catches_a_spelled_name():
    private = frozenset({"_req_status", "_registry"})
    snippet = "state = getattr(connector, '_req_status')\nNAME = '_registry'\nok = cfg.public\n"
    assert _spelled_names(snippet, private) == [(1, "_req_status"), (2, "_registry")]


def _installed_vllm_dirs() -> list[tuple[str, Path]]:
    """(release, vllm package dir) of each environment `kvdoctor matrix` would use: `.venv` and `.venv-vllm-*`
    under KVDOCTOR_MATRIX_ENV_DIR (default: this checkout)."""
    base = Path(os.environ.get("KVDOCTOR_MATRIX_ENV_DIR", str(ROOT)))
    found = []
    for env in sorted([base / ".venv", *base.glob(".venv-vllm-*")]):
        for site in sorted(env.glob("lib/python3*/site-packages")):
            infos = sorted(site.glob("vllm-*.dist-info"))
            if (site / "vllm").is_dir() and infos:
                found.append((infos[0].name.removeprefix("vllm-").removesuffix(".dist-info"), site / "vllm"))
    return sorted(found, key=lambda item: tuple(int(p) for p in re.findall(r"\d+", item[0])[:3]))


INSTALLED = _installed_vllm_dirs()


def _module_file(vllm_dir: Path, module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for candidate in (vllm_dir / rel.with_suffix(".py"), vllm_dir / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _names_defined(tree: ast.Module, owner: str | None) -> set[str]:
    """What a module defines at its top level (owner None), or what class `owner` in it defines: its
    methods, class attributes, and the attributes its methods assign on `self`/`cls`."""
    if owner is None:
        body: list[ast.stmt] = tree.body
    else:
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
        if not classes:
            return set()
        body = classes[0].body
    found: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if owner is not None:
        for node in ast.walk(classes[0]):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            targets = node.targets if isinstance(node, ast.Assign) else [target] if target is not None else []
            found |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id in ("self", "cls")}
    return found


def resolve_in_source(vllm_dir: Path, entry: vllm_names.VllmName) -> str | None:
    """The spelling of `entry` the release's source defines where the row says (parsed, never imported)."""
    path = _module_file(vllm_dir, entry.module)
    if path is None:
        return None
    defined = _names_defined(ast.parse(path.read_text(encoding="utf-8")), entry.owner)
    return next((name for name in entry.spellings if name in defined), None)


@pytest.mark.skipif(not INSTALLED, reason="no vLLM environment found (.venv, .venv-vllm-*)")
@pytest.mark.parametrize("release,vllm_dir", INSTALLED, ids=[release for release, _ in INSTALLED])
def test_every_table_name_resolves_or_is_declared_absent(release: str, vllm_dir: Path) -> None:
    unresolved = [f"{entry.where} ({entry.module}; spellings {', '.join(entry.spellings)})"
                  for entry in vllm_names.TABLE
                  if entry.absent is None and resolve_in_source(vllm_dir, entry) is None]
    assert not unresolved, (f"vLLM {release} lacks names the adapter requires (add the new spelling to "
                            f"compat/names.py, or declare what the adapter does without it):\n" + "\n".join(unresolved))


def test_the_table_check_reads_every_release_it_was_given():
    """Not vacuous: across the installed releases every required row resolves somewhere, every row whose
    absence is declared resolves in at least one (a row no release has is dead), and a renamed function
    row resolves under different spellings in different releases where both kinds are installed."""
    if not INSTALLED:
        pytest.skip("no vLLM environment found (.venv, .venv-vllm-*)")
    seen = {entry.where: {resolve_in_source(d, entry) for _, d in INSTALLED} - {None}
            for entry in vllm_names.TABLE}
    dead = [where for where, spellings in seen.items() if not spellings]
    assert not dead, f"rows no installed release defines: {dead}"
    ghost = vllm_names.VllmName(vllm_names.OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler",
                                ("_no_such_name_in_vllm",))
    assert all(resolve_in_source(d, ghost) is None for _, d in INSTALLED)


def test_a_function_row_gives_a_crash_site_every_spelling():
    assert vllm_names.function_spellings("_lookup") == ("_lookup", "_lookup_complete_chunks")
    assert vllm_names.function_spellings("_lookup_complete_chunks") == ("_lookup_complete_chunks", "_lookup")
    assert vllm_names.function_spellings("schedule") == ("schedule",)


def test_every_row_is_read_by_the_adapter_and_every_absence_names_its_probe():
    """Each row is read somewhere in the adapter as `names.<ROW>` (no dead rows; a function row with several
    spellings is read by crash sites, through `function_spellings`), and a row that may be absent
    names the adapter function that answers for a release without it (a VllmApi method or `portable.<name>`)."""
    from kvdoctor.engine import compat
    from kvdoctor.engine.compat import portable

    adapter_source = "\n".join(path.read_text(encoding="utf-8") for path in ADAPTER.glob("*.py")
                               if path != TABLE_MODULE)
    symbols = {id(value): key for key, value in vars(vllm_names).items() if isinstance(value, vllm_names.VllmName)}
    unread, no_probe = [], []
    for entry in vllm_names.TABLE:
        symbol = symbols[id(entry)]
        crash_site_spellings = entry.function and len(entry.spellings) > 1  # read through function_spellings
        if f"names.{symbol}" not in adapter_source and not (entry.absent or "").startswith("portable.") \
                and not crash_site_spellings:
            unread.append(symbol)
        if entry.absent is not None:
            probe, _, what = entry.absent.partition(": ")
            owner, name = (portable, probe.removeprefix("portable.")) if probe.startswith("portable.") \
                else (compat.VllmApi, probe)
            found = getattr(owner, name, None)
            if not what or not (callable(found) or isinstance(found, property)):
                no_probe.append(f"{symbol}: {entry.absent!r}")
    assert not unread, f"rows the adapter never reads: {unread}"
    assert not no_probe, f"absences that name no adapter function: {no_probe}"


def test_no_layer_above_the_adapter_reads_its_modules():
    """`api.mods` (vLLM's imported modules, by the adapter's keys) is the adapter's own: the layers above ask it
    through methods (`api.config_class`, `api.kv_cache_spec_class`, ...)."""
    reads = []
    for path in sorted(KVDOCTOR.rglob("*.py")):
        if ADAPTER in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "mods":
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not reads, "api.mods read outside kvdoctor/engine/compat/:\n" + "\n".join(reads)
