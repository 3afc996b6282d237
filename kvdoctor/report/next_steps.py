"""What to do after a verdict: the upstream fix, a workaround, where to report, the fixing release.

Built from the recipe's own data (its `refs` and `workaround`) and, where the
app carries it, the measured first release that no longer reproduces the bug
(`fixed_in`, from `kvdoctor matrix`). Formatting only: nothing here decides
an outcome, and no value is made up when the data has none.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types only
    from kvdoctor.recipes.model import Recipe

FIXED_LOGIC = ("kvdoctor's 'fixed logic' = the installed vLLM with the PR #49146 cap "
               "(storable chunks <= allocated chunks); 'unpatched' = that cap removed")

_REF = re.compile(r"\bvllm#(\d+)")


def github_refs(text: str) -> str:
    """`vllm#N` as GitHub links it across repositories: `vllm-project/vllm#N`."""
    return _REF.sub(r"vllm-project/vllm#\1", text)


def _ref_number(ref: str) -> str:
    match = _REF.search(ref)
    return f"vllm#{match.group(1)}" if match else ref.split()[0]


def upstream_text(recipe: Recipe) -> str:
    """`issue vllm#1; fix vllm#2 (what it does); see also vllm#3 (...)` from the recipe's refs."""
    issues = [r for r in recipe.refs if "(issue" in r]
    fixes = [r for r in recipe.refs if "(fix" in r]
    others = [r for r in recipe.refs if r not in issues and r not in fixes]
    parts = []
    if issues:
        parts.append("issue " + ", ".join(_ref_number(r) for r in issues))
    if fixes:
        parts.append("fix " + ", ".join(r.replace("(fix: ", "(").replace("(fix)", "").strip() for r in fixes))
    if others:
        parts.append("see also " + ", ".join(others))
    return "; ".join(parts)


def fixed_in_line(value: Any) -> str:
    """The measured first release that stops reproducing it, as the app data carries it."""
    if value is None:
        return ""
    if isinstance(value, str):
        return f"vLLM {value} and later (measured by kvdoctor matrix)" if value[:1].isdigit() else value
    release = getattr(value, "release", None) or getattr(value, "version", None)
    when = getattr(value, "measured_on", None)
    last = getattr(value, "last_reproducing", None)
    if release:
        return (f"vLLM {release} and later (last reproducing: {last}; measured by kvdoctor matrix"
                f"{f' on {when}' if when else ''}: a hint, not this run's verdict)")
    return str(value)


def _recipe_ref(recipe: Recipe) -> str:
    return recipe.name if recipe.builtin else (recipe.source or recipe.name)


def report_command(recipe: Recipe, command: str = "repro") -> str:
    return f"kvdoctor {command} {_recipe_ref(recipe)} --report issue.md"


def next_steps(recipe: Recipe, outcome: str, fixed_in: Any = None, cap_prevents: bool | None = None,
               detail: str = "") -> list[tuple[str, str]]:
    """(label, text) lines for one verdict of one recipe; empty labels are never produced."""
    steps: list[tuple[str, str]] = []
    upstream = upstream_text(recipe)
    fixed_text = fixed_in_line(fixed_in)
    if outcome == "reproduced":
        if cap_prevents is True:
            steps.append(("fixed logic", "the PR #49146 cap prevents it"))
        elif cap_prevents is False:
            fixes = [_ref_number(r) for r in recipe.refs if "(fix" in r]
            steps.append(("fixed logic", "the PR #49146 cap does not prevent it: a different bug, fixed by "
                                         + ", ".join(fixes) if fixes else
                          "the PR #49146 cap does not prevent it: a different bug (no upstream fix named yet)"))
        if upstream:
            steps.append(("upstream", upstream))
        if fixed_text:
            steps.append(("fixed in", fixed_text))
        if recipe.workaround:
            steps.append(("workaround", recipe.workaround))
        steps.append(("report it", f"{report_command(recipe)} (Markdown for the upstream issue: "
                                   "verdicts, state, recipe, environment)"))
    elif outcome == "other_failure":
        steps.append(("report it", f"something other than the recipe's signature broke: "
                                   f"{report_command(recipe)} and attach it to a new upstream issue"))
    elif outcome == "setup_error":
        steps.append(("check", "the recipe's precondition did not hold under this geometry: rerun without "
                               "geometry flags, or with `kvdoctor inspect` to see each step"))
    elif outcome == "not_applicable" and detail:
        steps.append(("note", detail))
    return steps
