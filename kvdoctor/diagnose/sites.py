"""Each known bug's crash site, as every release's own installed source writes it.

A bug's statement differs by release (renamed variables, re-wrapped lines, moved
files), so what `diagnose` matches a log against is measured, not typed: this
module reads the vLLM source of each installed release (`ast`, never importing
it), finds the function of each built-in recipe's crash signature and the
statements in it that hold the signature's text, and writes them to
`kvdoctor/data/crash_statements.toml`:

    python -m kvdoctor.diagnose.sites --write kvdoctor/data/crash_statements.toml \\
        /work/main/.venv /work/main/.venv-vllm-0.27 ...

The file the crash was measured in comes from the release-outcomes data (the
failure site `kvdoctor matrix` recorded); a release where that file moved is
searched for the function. Reading the data back (`load`) is cheap and free of vLLM.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdoctor.diagnose.statement import message_pattern
from kvdoctor.matrix import data
from kvdoctor.recipes.model import bug_order
from kvdoctor.recipes.writer import toml_multiline, toml_string
from kvdoctor.releases import KNOWN_RELEASES

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "crash_statements.toml"
DATA_FORMAT_VERSION = 1  # the layout of crash_statements.toml (not a --json document)
HEADER = """\
# Every built-in recipe's crash site (exception, function, statement), as each vLLM release's own
# installed source writes it. Written by `python -m kvdoctor.diagnose.sites --write FILE ENV...`
# from the installed sources; never edit by hand: re-measure. `kvdoctor diagnose` matches pasted
# statements against these, structurally (tests/test_diagnose_sites.py re-reads the installed vLLM).
"""
_SITE = re.compile(r"^(?P<exc>\w+) at (?P<file>\S+\.py):(?P<line>\d+) in (?P<func>\w+)$")


@dataclass(frozen=True)
class Site:
    bug: str
    recipes: tuple[str, ...]
    release: str
    exception: str
    function: str
    file: str | None = None  # vllm/...; None when the release has no such statement
    line: int | None = None
    statement: str | None = None  # the whole statement, as the source writes it (dedented)
    message: str | None = None  # a regex for the assert's message, when it has one
    absent: str | None = None  # why this release has no site
    reached: bool = False  # a kvdoctor run on this release failed at this statement (release-outcomes data)

    def as_toml(self) -> list[str]:
        lines = ["[[site]]", f"bug = {toml_string(self.bug)}",
                 "recipes = [" + ", ".join(toml_string(r) for r in self.recipes) + "]",
                 f"release = {toml_string(self.release)}", f"exception = {toml_string(self.exception)}",
                 f"function = {toml_string(self.function)}"]
        for key in ("file", "line", "statement", "message", "absent", "reached"):
            value = getattr(self, key)
            if value is None or (key == "reached" and self.absent):
                continue
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int):
                lines.append(f"{key} = {value}")
            elif "\n" in value:
                lines.append(f"{key} = {toml_multiline(value)}")
            else:
                lines.append(f"{key} = {toml_string(value)}")
        return [*lines, ""]


def load(path: Path = DATA_FILE) -> list[Site]:
    """The measured sites; [] when the file is missing or unreadable (matching then uses the signatures)."""
    try:
        data = tomllib.loads(path.read_text())
        return [Site(bug=r["bug"], recipes=tuple(r["recipes"]), release=r["release"], exception=r["exception"],
                     function=r["function"], file=r.get("file"), line=r.get("line"),
                     statement=_unwrap(r.get("statement")), message=r.get("message"), absent=r.get("absent"),
                     reached=bool(r.get("reached", False)))
                for r in data.get("site", [])]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return []


def _unwrap(text: str | None) -> str | None:
    """A multi-line TOML string keeps the newline before its closing quotes; the statement has none."""
    return text[:-1] if text and text.endswith("\n") else text


def render(sites: Iterable[Site]) -> str:
    def order(site: Site) -> tuple[Any, ...]:
        index = KNOWN_RELEASES.index(site.release) if site.release in KNOWN_RELEASES else len(KNOWN_RELEASES)
        return bug_order(site.bug), site.recipes, index, site.line or 0

    lines = [HEADER, f"schema_version = {DATA_FORMAT_VERSION}", ""]
    for site in sorted(sites, key=order):
        lines += site.as_toml()
    return "\n".join(lines)


# -- reading one release's source -----------------------------------------------------------------------

def installed_release(site_packages: Path) -> str | None:
    dists = sorted(site_packages.glob("vllm-*.dist-info"))
    if not dists:
        return None
    return dists[0].name[len("vllm-"):-len(".dist-info")].split("+")[0]


def site_packages_of(env: Path) -> Path:
    """A virtual environment, its site-packages, or a folder holding `vllm/`."""
    if (env / "vllm" / "__init__.py").is_file():
        return env
    found = sorted(env.glob("lib/python3*/site-packages"))
    for candidate in found:
        if (candidate / "vllm" / "__init__.py").is_file():
            return candidate
    raise SystemExit(f"{env}: no installed vllm found")


def _squash(text: str) -> str:
    return " ".join(text.replace("(", " ( ").replace(")", " ) ").split())


def _functions(tree: ast.AST, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


def _message(node: ast.Assert) -> str | None:
    msg = node.msg
    if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
        return message_pattern([msg.value])
    if isinstance(msg, ast.JoinedStr):
        parts: list[str | None] = []
        for value in msg.values:
            parts.append(value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None)
        return message_pattern(parts)
    return None


def _statements(source: str, function: str, exception: str,
                contains: str) -> list[tuple[int, int, str, str | None]]:
    """(line, end line, statement, message regex) of the statements of `function` that hold `contains`: asserts for an
    AssertionError, else the innermost statement whose text holds it."""
    tree = ast.parse(source)
    wanted = _squash(contains)
    out: list[tuple[int, int, str, str | None]] = []
    for func in _functions(tree, function):
        for node in ast.walk(func):
            if not isinstance(node, ast.stmt) or node is func:
                continue
            if exception == "AssertionError" and not isinstance(node, ast.Assert):
                continue
            if exception != "AssertionError" and isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try,
                                                                   ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # a block: its own inner statement is the site
            text = ast.get_source_segment(source, node) or ""
            if wanted not in _squash(text):
                continue
            message = _message(node) if isinstance(node, ast.Assert) else None
            out.append((node.lineno, node.end_lineno or node.lineno, text, message))
    return sorted(set(out))


def _candidate_files(vllm_root: Path, hint: str | None, function: str) -> list[Path]:
    if hint:
        path = vllm_root.parent / hint
        if path.is_file():
            return [path]
    needle = f"def {function}("
    found = []
    for path in sorted(vllm_root.rglob("*.py")):
        try:
            if needle in path.read_text(errors="replace"):
                found.append(path)
        except OSError:
            continue
    return found


def measure_release(site_packages: Path, recipes: list[Any], outcome_rows: list[Any]) -> list[Site]:
    """The crash sites of every built-in recipe with a crash signature, in this release's source."""
    release = installed_release(site_packages) or "unknown"
    vllm_root = site_packages / "vllm"
    groups: dict[tuple[Any, ...], list[str]] = {}
    aliases: dict[str, tuple[str, ...]] = {}  # function -> the names vLLM moved its statement to
    for recipe in recipes:
        sig = recipe.signature
        if sig.invariant or not sig.exception or not sig.function:
            continue
        groups.setdefault((recipe.bug or recipe.name, sig.exception, sig.function, sig.contains or ""), []).append(
            recipe.name)
        # its other spellings: the recipe's own aliases and the adapter's names table (`Signature.functions`)
        aliases[sig.function] = tuple(dict.fromkeys((*aliases.get(sig.function, ()), *sig.functions()[1:])))
    sites: list[Site] = []
    for (bug, exception, function, contains), names in groups.items():
        matched = [(r, _SITE.match(r.failure_site or "")) for r in outcome_rows if r.recipe in names]
        measured = [(r, m) for r, m in matched if m is not None and m.group("func") in (function, *aliases[function])]
        hint = measured[0][1].group("file") if measured else None
        here = [int(m.group("line")) for r, m in measured if r.release == release]
        base = dict(bug=bug, recipes=tuple(sorted(names)), release=release, exception=exception, function=function)
        found: list[tuple[Site, int]] = []
        # the function itself, else its private twin (`_prepare_load` under `prepare_load` on a later release)
        for name in (function, "_" + function.lstrip("_"), *aliases[function]):
            for path in _candidate_files(vllm_root, hint, name):
                try:
                    statements = _statements(path.read_text(), name, exception, contains)
                except (SyntaxError, ValueError, OSError):
                    continue
                rel = path.relative_to(site_packages).as_posix()
                for line, end, text, message in statements:
                    found.append((Site(**{**base, "function": name}, file=rel, line=line, statement=_dedent(text),
                                       message=message), end))
            if found:
                break
        if len(found) > 1 and here:  # the run measured which one fails on this release
            found = [(s, end) for s, end in found if s.line is not None and s.line <= here[0] <= end] or found
        found = [(Site(**{**s.__dict__, "reached": any(s.line is not None and s.line <= line <= end
                                                       for line in here)}), end)
                 for s, end in found]
        if not found:
            why = (f"no statement holding {contains!r} in {function}" if contains else f"no function {function}")
            sites.append(Site(**base, absent=why))
        sites += [s for s, _ in found]
    return sites


def _dedent(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= 1:
        return text.strip()
    import textwrap

    return lines[0].strip() + "\n" + textwrap.dedent("\n".join(lines[1:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvdoctor.diagnose.sites", description=__doc__.split("\n\n")[0])
    parser.add_argument("envs", nargs="+", type=Path, help="virtual environments (or site-packages) with vLLM")
    parser.add_argument("--write", type=Path, help="write the data file (releases measured replace theirs)")
    args = parser.parse_args(argv)
    from kvdoctor.recipes.builtins import all_builtins

    recipes, rows = all_builtins(), data.load()
    new: list[Site] = []
    for env in args.envs:
        site_packages = site_packages_of(env)
        sites = measure_release(site_packages, recipes, rows)
        print(f"{env}: vLLM {installed_release(site_packages)}: {sum(s.absent is None for s in sites)} sites, "
              f"{sum(s.absent is not None for s in sites)} absent", file=sys.stderr)
        new += sites
    if args.write is None:
        print(render(new))
        return 0
    releases = {s.release for s in new}
    kept = [s for s in load(args.write) if s.release not in releases]
    args.write.write_text(render(kept + new))
    print(f"written {args.write}: releases {', '.join(sorted(releases | {s.release for s in kept}))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
