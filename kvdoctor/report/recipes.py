"""`kvdoctor repro --list` in every format: one line per built-in recipe, or one recipe in full."""

from __future__ import annotations

from typing import Any

from kvdoctor.report.formats import Shown


def recipes_markdown(recipes: list[Any]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| name | bug | what it reproduces | signature | upstream refs |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.bug or ''} | {cell(r.title or r.summary.splitlines()[0])} | "
              f"{cell(r.signature.describe())} | {cell(chr(10).join(r.refs))} |" for r in recipes]
    return "\n".join(lines) + "\n"


def recipes_shown(recipes: list[Any], verbose: bool, detail: bool) -> Shown:
    """The built-in recipes (`detail`: the one recipe in `recipes`, in full)."""
    def document() -> dict[str, Any]:
        from kvdoctor import __version__
        from kvdoctor.report.json_doc import SCHEMA_VERSION, recipe_dict

        return {"schema_version": SCHEMA_VERSION, "kvdoctor_version": __version__,
                "recipes": [recipe_dict(r) for r in recipes]}

    def renderables() -> list[Any]:
        from kvdoctor.report.tables import recipe_detail_renderables, recipe_list_renderables

        return recipe_detail_renderables(recipes[0]) if detail else recipe_list_renderables(recipes, verbose)

    return Shown(renderables=renderables, document=document, markdown=lambda: recipes_markdown(recipes))
