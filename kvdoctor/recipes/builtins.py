"""Built-in recipes: the TOML files of the top-level `repros/` folder.

In a source checkout they are read from `repros/`; an installed wheel carries
them as `kvdoctor/_builtin_repros` (see pyproject).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from kvdoctor.errors import UsageError
from kvdoctor.recipes.loader import load_recipe_file
from kvdoctor.recipes.model import Recipe

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def builtin_dir() -> Path:
    for candidate in (_PACKAGE_DIR.parent / "repros", _PACKAGE_DIR / "_builtin_repros"):
        if candidate.is_dir():
            return candidate
    raise UsageError("kvdoctor's built-in recipes are missing from this installation")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.toml"))


@cache
def load_builtin(name: str) -> Recipe:
    return load_recipe_file(builtin_dir() / f"{name}.toml", builtin=True)


def all_builtins() -> list[Recipe]:
    return [load_builtin(name) for name in builtin_names()]


def shown_name(name: str, limit: int = 60) -> str:
    """A name the user typed, as a message shows it: its repr (one line), cut to `limit` characters
    with its length said (a 100 KB argument is not echoed whole)."""
    text = repr(name)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(name):,} characters)"


def resolve(ref: str) -> Recipe:
    """A built-in name or a path to a recipe file."""
    path = Path(ref)
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long to be a file (ENAMETOOLONG), a NUL byte
        exists = False
    looks_like_path = ref.endswith(".toml") or "/" in ref or exists
    if looks_like_path:
        return load_recipe_file(path)
    names = builtin_names()
    if ref not in names:
        raise UsageError(f"unknown recipe {shown_name(ref)}; built-in recipes: {', '.join(names)} "
                         f"(or give a .toml file)")
    return load_builtin(ref)
