"""What a recipe is: metadata, a setup, ordered steps, checks, and a failure signature.

Recipes are data. Nothing in them is executed, imported or evaluated; the
runner interprets the fixed step vocabulary declared in `kvdoctor.steps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat.names import function_spellings


@dataclass(frozen=True)
class Step:
    action: str
    args: dict[str, Any]
    line: int  # 1-based line of the step's table in its file (0 if unknown)

    def describe(self) -> str:
        if self.action == "expect":
            return "expect " + ", ".join(f"{k}={v}" for k, v in self.args.items() if k != "description")
        parts = [f"{k}={v}" for k, v in self.args.items() if k not in ("prompt",)]
        return self.action + (" " + " ".join(parts) if parts else "")


@dataclass(frozen=True)
class Signature:
    """What 'reproduced' means: an exception in a vLLM function, or a named invariant."""

    exception: str | None = None
    function: str | None = None
    contains: str | None = None  # text the failing source line must contain
    invariant: str | None = None
    request: str | None = None  # the request the failure must involve (else it is the bug by another path)
    # vLLM functions expected above `function` in the traceback, outermost first (not necessarily
    # adjacent). Optional; `kvdoctor diagnose` ranks a log's crash higher when its chain has them.
    callers: tuple[str, ...] = ()
    # Other names of `function` in other releases, where vLLM moved the same statement into another
    # function (`_lookup`'s keys assert lives in `_lookup_complete_chunks` from 0.28): the failure and
    # the crash site match under any of them.
    function_aliases: tuple[str, ...] = ()
    # The crash site whose execution the run's coverage counts (observe/coverage.py): a vLLM function
    # and text its statement contains. They default to `function` and `contains`; an invariant's
    # recipe names its check point (the vLLM statement whose outcome the invariant judges).
    site_function: str | None = None
    site: str | None = None
    # A condition on the site frame's values that is the bug's case there (e.g. a local hit ending
    # inside a block); a run reaches the site only where it holds. Parsed, never executed as code.
    site_when: str | None = None

    def functions(self) -> tuple[str, ...]:
        """`function` and its aliases (the recipe's, and its other spellings in the adapter's names table):
        the names under which the failure matches."""
        if not self.function:
            return ()
        return tuple(dict.fromkeys((*function_spellings(self.function), *self.function_aliases)))

    def crash_site(self) -> tuple[str, str] | None:
        """(function, statement) of the crash site, or None when the signature names none."""
        function = self.site_function or self.function
        statement = self.site or self.contains
        return (function, statement) if function and statement else None

    def describe(self) -> str:
        if self.invariant:
            return f"invariant {self.invariant}"
        text = f"{self.exception} in {self.function}"
        text += f" ({self.contains})" if self.contains else ""
        return text + (f" for request {self.request}" if self.request else "")


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    signature: Signature
    steps: tuple[Step, ...]
    setup: dict[str, Any] = field(default_factory=dict)
    checks: tuple[Step, ...] = ()
    bug: str | None = None
    title: str | None = None
    refs: tuple[str, ...] = ()
    source: str = ""
    builtin: bool = False
    requires: tuple[str, ...] = ()  # e.g. "spec:TieringOffloadingSpec" (see recipes/requirements.py)
    invariants: tuple[str, ...] = ()  # extra invariants to check every step (see observe/invariants.py)
    workaround: str | None = None  # a flag or setting that keeps a deployment off the bug's path

    def fix_refs(self) -> tuple[str, ...]:
        """The refs that name a fix (`vllm#N (fix: ...)`), in the recipe's order."""
        return tuple(ref for ref in self.refs if "(fix" in ref)

    def issue_refs(self) -> tuple[str, ...]:
        return tuple(ref for ref in self.refs if "(issue" in ref)


def bug_order(bug: str | None) -> tuple[int, str]:
    """The catalogue's order (K1, K2, ..., K13), then recipes that name no known bug."""
    bug = bug or ""
    digits = "".join(ch for ch in bug if ch.isdigit())
    return (int(digits) if digits else 10_000, bug)
