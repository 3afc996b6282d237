"""Rank the built-in recipes against a crash read from a log, with the reasons.

A recipe is a candidate when its signature's exception and function are the
crash's exception and innermost vLLM frame. It ranks higher for the same
assertion text (`contains` in the failing source line or the message) and
for the same caller chain (`callers`, outermost first, in the vLLM frames
above). A `contains` the log's source line contradicts rules the recipe out:
that is another assertion in the same function. A traceback shows one line of
a statement that spans several (`assert (` ... `)`): such a fragment confirms a
`contains` it overlaps and contradicts none. Silent bugs (invariants) never
match a crash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvdoctor.diagnose.traceback import LogTraceback
from kvdoctor.recipes.model import Recipe, bug_order


@dataclass
class Candidate:
    recipe: Recipe
    score: int
    reasons: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # what the log could not confirm


@dataclass
class MatchResult:
    candidates: list[Candidate] = field(default_factory=list)
    why_none: str = ""

    @property
    def best(self) -> list[Candidate]:
        """The candidates of the best score, in the catalogue's bug order, simplest recipe first."""
        if not self.candidates:
            return []
        top = self.candidates[0].score
        return [c for c in self.candidates if c.score == top]

    @property
    def best_bugs(self) -> list[str]:
        return list(dict.fromkeys(c.recipe.bug or c.recipe.name for c in self.best))


def _in_order(wanted: tuple[str, ...], functions: list[str]) -> bool:
    position = 0
    for name in wanted:
        try:
            position = functions.index(name, position) + 1
        except ValueError:
            return False
    return True


def _squash(text: str) -> str:
    return " ".join(text.replace("(", " ( ").replace(")", " ) ").split())


def is_fragment(code: str, exception: str | None) -> bool:
    """One line of a multi-line statement: brackets left open or closed from an earlier line, or an
    AssertionError's line that is not the `assert` itself."""
    text = code.strip()
    if exception == "AssertionError" and not text.startswith("assert"):
        return True
    return any(text.count(o) != text.count(c) for o, c in ("()", "[]", "{}"))


def innermost_vllm(crash: LogTraceback):
    frames = crash.vllm_frames
    return frames[-1] if frames else None


def match_crash(crash: LogTraceback | None, recipes: list[Recipe]) -> MatchResult:
    if crash is None:
        return MatchResult(why_none="no engine crash found in this log")
    if crash.cut_short:
        deepest = crash.frames[-1] if crash.frames else None
        where = f" (the last frame in the log is {deepest.function})" if deepest else ""
        return MatchResult(why_none="the traceback is cut short before its exception line" + where
                                    + ": nothing to match a signature against")
    inner = innermost_vllm(crash)
    if inner is None:
        return MatchResult(why_none=f"{crash.exception} was not raised inside vLLM (no vLLM frame in its "
                                    f"traceback)")
    above = [f.function for f in crash.vllm_frames[:-1]]
    candidates: list[Candidate] = []
    for recipe in recipes:
        sig = recipe.signature
        if sig.invariant or sig.exception != crash.exception or sig.function != inner.function:
            continue
        candidate = Candidate(recipe, 1, [f"same exception and function ({sig.exception} in {sig.function})"])
        if sig.contains:
            haystack = " ".join(filter(None, (inner.code, crash.message)))
            partial = bool(inner.code) and is_fragment(inner.code, crash.exception)
            if sig.contains in haystack:
                candidate.score += 1
                candidate.reasons.append(f"same assertion text ({sig.contains})")
            elif partial:  # the log shows one line of the statement: it can confirm, never contradict
                shown, wanted = _squash(inner.code.strip().rstrip("(").strip()), _squash(sig.contains)
                names = set(re.findall(r"[A-Za-z_]\w{2,}", shown)) - {"assert", "and", "not"}
                if re.search(r"\w{3,}", shown) and (shown in wanted or wanted in shown):
                    candidate.score += 1
                    candidate.reasons.append(f"same assertion text, partly shown ({inner.code.strip()} "
                                             f"in {sig.contains})")
                elif names and not any(name in wanted for name in names):
                    # The shown line names only what the recipe's assertion does not: the traceback
                    # line of a multi-line assert is its first operand, so this is another assertion.
                    continue
                else:
                    candidate.gaps.append(f"the log shows one line of the failing statement ({inner.code.strip()})")
            elif inner.code or crash.message:
                continue  # another assertion in the same function
            else:
                candidate.gaps.append("the log does not show the failing source line")
        if sig.callers:
            if _in_order(sig.callers, above):
                candidate.score += 1
                candidate.reasons.append("same caller chain (" + " → ".join((*sig.callers, sig.function)) + ")")
            elif crash.elided or not above:
                candidate.gaps.append("the frames above it are not in the log")
            else:
                candidate.gaps.append("called through another path (" + " → ".join(above[-3:]) + ")")
        candidates.append(candidate)
    # Equal evidence: the catalogue's order first (one signature can be several bugs, e.g. K1 and K6
    # share `_build_store_jobs`' assert; the log cannot tell them apart), then the simplest recipe.
    candidates.sort(key=lambda c: (-c.score, bug_order(c.recipe.bug), len(c.recipe.steps), c.recipe.name))
    if not candidates:
        return MatchResult(why_none=f"no known bug matches {crash.exception} in {inner.function}")
    return MatchResult(candidates)
