"""Which known bugs a log's evidence fits, how strongly, and why the others do not.

Evidence, not a format: each body of evidence in the log (a traceback, a worker's
WARNING traceback, the loose lines of a fragment) is weighed against each known
bug's crash site on its own: the exception, the statement (as any release in
range writes it, compared structurally so renamed variables still match: see
`statement`), the assert's message, the function and file of any frame, the
callers above it. Strength says what agreed:

- exact: the exception, the statement and the function;
- strong: the statement (alone, or with one of the others), or one line of it with
  the exception and the function;
- moderate: two of the exception, the function and one line of the statement;
- weak: the function alone, or one line of the statement alone.

A statement matched only in a release's renamed wording, or only in a release's
wording no kvdoctor run ever reached, counts one level lower. What a whole
traceback shows can rule a bug out: another statement in the same function, another
exception raised there, the function only as a caller of where the crash was
raised, or a function of that name in another file. Silent bugs (invariants)
never match a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.diagnose.evidence import MENTIONED, Unit, balanced, traceback_unit, units
from kvdoctor.diagnose.sites import load
from kvdoctor.diagnose.statement import Likeness, compare, is_fragment, message_matches, tokenize
from kvdoctor.diagnose.traceback import ELIDED, LogFrame, LogTraceback, display_path
from kvdoctor.engine.compat.names import function_spellings
from kvdoctor.recipes.model import Recipe, bug_order
from kvdoctor.releases import KNOWN_RELEASES

STRENGTHS = ("exact", "strong", "moderate", "weak")
_KIND_ORDER = {"exact": 0, "renamed": 1, "partial": 2, "partial-renamed": 3}


@dataclass
class Candidate:
    recipe: Recipe
    score: int  # evidence items that agreed (ranks within a strength)
    reasons: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # what the log could not confirm
    strength: str = "weak"
    why: str = ""  # "exact: AssertionError, the statement and `_build_store_jobs`"
    wording: str = ""  # the releases whose wording the statement is, e.g. "0.26.0–0.34.0"
    unit: str = ""  # which part of the log it was found in

    @property
    def rank(self) -> tuple[Any, ...]:
        return (STRENGTHS.index(self.strength), -self.score, bug_order(self.recipe.bug), len(self.recipe.steps),
                self.recipe.name)


@dataclass
class RuledOut:
    bug: str
    reason: str
    closeness: int  # how much of it did agree (ranks the nearest first)


@dataclass
class MatchResult:
    candidates: list[Candidate] = field(default_factory=list)
    why_none: str = ""
    ruled_out: list[RuledOut] = field(default_factory=list)  # nearest first

    @property
    def best(self) -> list[Candidate]:
        """The candidates of the best strength and score, in the catalogue's bug order, simplest recipe first."""
        if not self.candidates:
            return []
        top = self.candidates[0].rank[:2]
        return [c for c in self.candidates if c.rank[:2] == top]

    @property
    def best_bugs(self) -> list[str]:
        return list(dict.fromkeys(c.recipe.bug or c.recipe.name for c in self.best))

    @property
    def nearest(self) -> list[RuledOut]:
        return self.ruled_out[:3]


def innermost_vllm(crash: LogTraceback) -> LogFrame | None:
    """The frame named as the crash site: the innermost vLLM frame that is not a generic one (`kinds`)."""
    from kvdoctor.diagnose.kinds import crash_site

    return crash_site(crash)


def _tail(path: str) -> str:
    parts = [p for p in display_path(path).replace("\\", "/").split("/") if p and p not in ("...", "..", ".")]
    return "/".join(parts[-2:])


def _releases_text(releases: list[str]) -> str:
    """Contiguous runs of KNOWN_RELEASES: `0.26.0–0.29.0, 0.34.0`."""
    index = sorted({KNOWN_RELEASES.index(r) for r in releases if r in KNOWN_RELEASES})
    others = sorted(r for r in releases if r not in KNOWN_RELEASES)
    spans: list[list[int]] = []  # [first, last] of each run of consecutive releases
    for i in index:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    runs = [KNOWN_RELEASES[a] if a == b else f"{KNOWN_RELEASES[a]}–{KNOWN_RELEASES[b]}" for a, b in spans]
    return ", ".join(runs + others)


@dataclass
class Wording:
    """One way a release writes a bug's crash statement."""

    statement: str
    releases: list[str]
    reached: bool  # a kvdoctor run failed there on one of these releases
    message: str | None = None


@dataclass
class Known:
    """A known bug's crash site over every release: what the recipes of one signature are matched against."""

    bug: str
    recipes: list[Recipe]
    exception: str
    functions: set[str]
    files: set[str]  # file tails: `offloading/scheduler.py`
    wordings: list[Wording]
    contains: str | None
    callers: tuple[str, ...]

    @property
    def function(self) -> str:
        return self.recipes[0].signature.function or ""


def known_bugs(recipes: list[Recipe], sites: list[Any] | None = None) -> list[Known]:
    """Group recipes by signature and attach each release's measured statements (`sites.load()`)."""
    if sites is None:
        sites = load()
    groups: dict[tuple[Any, ...], list[Recipe]] = {}
    for recipe in recipes:
        sig = recipe.signature
        if sig.invariant or not sig.exception or not sig.function:
            continue
        groups.setdefault((recipe.bug or recipe.name, sig.exception, sig.function, sig.contains or ""), []).append(
            recipe)
    out = []
    for (bug, exception, _function, contains), members in groups.items():
        names = {r.name for r in members}
        mine = [s for s in sites if s.bug == bug and set(s.recipes) & names and s.exception == exception
                and s.absent is None and s.statement]
        wordings: dict[str, Wording] = {}
        for site in mine:
            statement: str = site.statement or ""  # never empty: `mine` keeps the sites with a statement
            wording = wordings.setdefault(tokenize(statement).text, Wording(statement, [], False, site.message))
            wording.releases.append(site.release)
            wording.reached = wording.reached or site.reached
        callers = max((r.signature.callers for r in members), key=len)
        # every spelling of the function (the recipes' aliases and the adapter's names table) and what was measured
        spelled = {name for r in members for name in r.signature.functions()}
        out.append(Known(bug, members, exception, spelled | {s.function for s in mine},
                         {_tail(s.file) for s in mine if s.file}, list(wordings.values()), contains or None, callers))
    return out


@dataclass
class _Found:
    likeness: Likeness
    wording: Wording | None
    shown: str


def _best_statement(shown: str, known: Known) -> _Found | None:
    best: _Found | None = None
    order = _KIND_ORDER
    for wording in known.wordings:
        likeness = compare(shown, wording.statement)
        if likeness is None:
            continue
        found = _Found(likeness, wording, shown)
        if best is not None and (likeness.kind, likeness.similarity) == (best.likeness.kind,
                                                                          best.likeness.similarity):
            assert best.wording is not None  # as alike to several releases' wordings: all of them
            best = _Found(likeness, Wording(best.wording.statement, best.wording.releases + wording.releases,
                                            best.wording.reached or wording.reached, best.wording.message), shown)
        elif best is None or (order[likeness.kind], -likeness.similarity) < (order[best.likeness.kind],
                                                                             -best.likeness.similarity):
            best = found
    if best is None and known.contains and not known.wordings:
        # no measured wording (a recipe of the user's): the signature's text itself
        squashed = " ".join(shown.split())
        if known.contains in squashed:
            best = _Found(Likeness("exact", 1.0), None, shown)
        else:
            likeness = compare(shown, known.contains)
            if likeness is not None and likeness.kind.startswith("partial"):
                best = _Found(likeness, None, shown)
    return best


def _names_foreign(shown: str, known: Known) -> bool:
    """A line of a statement that names only what none of the bug's wordings does: another statement."""
    names = set(tokenize(shown).names)
    if not names:
        return False
    texts = [w.statement for w in known.wordings] + ([known.contains] if known.contains else [])
    return not any(name in text for name in names for text in texts)


def _in_order(wanted: tuple[str, ...], functions: list[str]) -> bool:
    """`wanted` (callers, outermost first) appear in `functions` in that order, each under any of its spellings
    (the adapter's names table: a caller vLLM renamed is the same caller)."""
    position = 0
    for name in wanted:
        spellings = function_spellings(name)
        found = next((i for i in range(position, len(functions)) if functions[i] in spellings), None)
        if found is None:
            return False
        position = found + 1
    return True


def _short(text: str, limit: int = 90) -> str:
    one = " ".join(text.split()).replace("( ", "(").replace(" )", ")")
    return one if len(one) <= limit else one[: limit - 1] + "…"


def _weigh(unit: Unit, known: Known) -> tuple[Candidate | None, RuledOut | None]:
    """One body of evidence against one known bug: a candidate, a reason it is ruled out, or neither."""
    frames = unit.frames
    at_function = [f for f in frames if f.function in known.functions]
    # A function of that name in another file is another function (prepare_load: cpu/ or tiering/).
    elsewhere = [f for f in at_function if known.files and "/" in _tail(f.file) and _tail(f.file) not in known.files]
    at_function = [f for f in at_function if f not in elsewhere]
    inner = unit.innermost if unit.complete else None
    if elsewhere and not at_function:
        f = elsewhere[-1]
        return None, RuledOut(known.bug, f"{f.function} here is in {_tail(f.file)}; {known.bug}'s is in "
                                         f"{', '.join(sorted(known.files))}", 1)
    raising = inner is not None and inner.function in known.functions and inner in at_function
    if unit.complete and at_function and not raising and inner is not None:
        return None, RuledOut(known.bug, f"{known.function} is only a caller here; the crash is raised in "
                                         f"{inner.function} ({_tail(inner.file)})", 1)
    same_exception = unit.exception == known.exception
    if raising and unit.exception and not same_exception:
        assert inner is not None
        return None, RuledOut(known.bug, f"{inner.function} raises {unit.exception} here, {known.bug} is "
                                         f"{known.exception}", 2)
    # statements: the code of the bug's frames first, then every other line of code the unit shows
    shown: list[tuple[str, bool]] = [(f.code, True) for f in at_function if f.code]
    shown += [(f.code, False) for f in frames if f.code and f not in at_function]
    shown += [(s.text, False) for s in unit.statements]
    if unit.message and known.exception == "AssertionError":  # a condensed paste: `AssertionError: x <= y`
        shown.append((unit.message, False))
    found: _Found | None = None
    for original, at_site in shown:
        lines = original.split("\n")
        elided = ELIDED in lines  # the traceback left lines of it out: its lines are pieces, never a whole
        text = "\n".join(line for line in lines if line != ELIDED)
        match = None if elided else _best_statement(text, known)
        if match is None:
            for piece in text.split("\n") if "\n" in text and (elided or not balanced(text)) else ():
                match = _best_statement(piece, known)
                if match is not None:
                    break
        if match is not None and (found is None or _KIND_ORDER[match.likeness.kind]
                                  < _KIND_ORDER[found.likeness.kind]):
            found = match
        if match is None and at_site:
            whole = not elided and ((not is_fragment(text) and text.lstrip().startswith("assert")) or (
                known.exception != "AssertionError" and not is_fragment(text)))
            if whole or _names_foreign(text, known):
                closeness = 3 if same_exception else 2
                what = "another statement" if whole else "a line of another statement"
                theirs = known.wordings[0].statement if known.wordings else known.contains or ""
                return None, RuledOut(known.bug, f"its frame {at_function[0].function} shows {what}: "
                                                 f"`{_short(original)}`, not {known.bug}'s `{_short(theirs)}`",
                                      closeness)
    message_found = bool(unit.message) and any(message_matches(w.message or "", unit.message) for w in known.wordings)
    kind = found.likeness.kind if found else ""
    whole_statement = kind in ("exact", "renamed") or message_found
    partial = kind.startswith("partial")
    has_function = bool(at_function)
    has_exception = same_exception
    if has_function and all(f.file == MENTIONED for f in at_function) and not (
            whole_statement or partial or has_exception):
        return None, None  # a function named in prose, and nothing of a crash with it
    if not (whole_statement or partial or has_function):
        if same_exception and unit.exception and known.files & {_tail(f.file) for f in frames}:
            return None, RuledOut(known.bug, f"the same exception in the same file, but not in {known.function}",
                                  1)
        return None, None
    if whole_statement and has_function and has_exception:
        level = 0
    elif whole_statement or (partial and has_function and has_exception):
        level = 1
    elif int(has_function) + int(has_exception) + int(partial) >= 2:
        level = 2
    else:
        level = 3
    lower = []
    if found is not None and found.wording is not None and kind in ("renamed", "partial-renamed"):
        lower.append("renamed")
    if (found is not None and found.wording is not None and not found.wording.reached and not message_found
            and not any(w.reached for w in known.wordings
                        if tokenize(w.statement).text == tokenize(found.shown).text)):
        lower.append("unreached")
    if has_function and all(f.file == MENTIONED for f in at_function) and not whole_statement:
        lower.append("function named, no frame")
    if lower and level < 3:
        level += 1
    parts = []
    if has_exception:
        parts.append(known.exception)
    if whole_statement:
        parts.append("the statement" if not message_found or found else "the assert's message")
    elif partial:
        parts.append("one line of the statement")
    if has_function:
        parts.append(f"`{at_function[-1].function}`")
    what = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    alone = " alone" if len(parts) == 1 and level >= 1 else ""
    reasons = []
    wording_text = ""
    if found is not None:
        if found.wording is not None:
            wording_text = _releases_text(found.wording.releases)
            label = {"exact": "as vLLM {r} writes it", "renamed": "renamed: vLLM {r} writes it `{s}`",
                     "partial": "one line of it as vLLM {r} writes it",
                     "partial-renamed": "one line of it, renamed from vLLM {r}'s `{s}`"}[kind]
            reasons.append(f"statement `{_short(found.shown)}`: "
                           + label.format(r=wording_text, s=_short(found.wording.statement))
                           + (f" (likeness {found.likeness.similarity})" if "renamed" in kind else "")
                           + ("" if found.wording.reached else "; no kvdoctor run reached that release's statement"))
        elif partial:
            reasons.append(f"statement `{_short(found.shown)}`: one line of it (the signature's `{known.contains}`)")
        else:
            reasons.append(f"statement `{_short(found.shown)}` holds the signature's text ({known.contains})")
    if message_found:
        reasons.append(f"the exception's message `{_short(unit.message)}` is the assert's message")
    if has_function:
        f = at_function[-1]
        if f.file == MENTIONED:
            reasons.append(f"`{f.function}` named in the text (no frame of it)")
        else:
            reasons.append(f"frame {f.function}" + (f" in {_tail(f.file)}" if "/" in _tail(f.file) else "")
                           + (" (where the crash is raised)" if raising else ""))
    if has_exception:
        reasons.append(f"exception {known.exception}")
    gaps = []
    score = int(whole_statement) * 2 + int(partial) + int(has_function) + int(has_exception) + int(message_found)
    vllm_above = [f.function for f in frames if f.in_vllm]
    if known.callers and has_function:
        above = vllm_above[:vllm_above.index(at_function[-1].function)] if at_function[-1].function in vllm_above \
            else []
        if _in_order(known.callers, above):
            score += 1
            reasons.append("same caller chain (" + " → ".join((*known.callers, known.function)) + ")")
        elif not above:
            gaps.append("the frames above it are not in the log")
        else:
            gaps.append("called through another path (" + " → ".join(above[-3:]) + ")")
    if not has_exception:
        gaps.append(f"no {known.exception} line" if unit.exception is None else
                    f"the exception line says {unit.exception}")
    if not whole_statement and not partial:
        gaps.append("the log does not show the failing statement")
    strength = STRENGTHS[level]
    notes = [f"{n} wording" if n in ("renamed", "unreached") else n for n in lower]
    why = f"{strength}: {what}{alone}" + (f" ({', '.join(notes)})" if notes else "")
    candidate = Candidate(known.recipes[0], score, reasons, gaps, strength, why, wording_text, unit.label)
    return candidate, None


def match_units(units: list[Unit], recipes: list[Recipe], sites: list[Any] | None = None) -> MatchResult:
    """Every known bug the evidence fits (best first, one candidate per recipe), and the nearest ruled out."""
    knowns = known_bugs(recipes, sites)
    candidates: list[Candidate] = []
    ruled: dict[str, RuledOut] = {}
    for known in knowns:
        best: Candidate | None = None
        for unit in units:
            candidate, out = _weigh(unit, known)
            if candidate is not None and (best is None or candidate.rank[:2] < best.rank[:2]):
                best = candidate
            if out is not None and (known.bug not in ruled or out.closeness > ruled[known.bug].closeness):
                ruled[known.bug] = out
        if best is None:
            continue
        ruled.pop(known.bug, None)
        for recipe in known.recipes:
            candidates.append(Candidate(recipe, best.score, list(best.reasons), list(best.gaps), best.strength,
                                        best.why, best.wording, best.unit))
    candidates.sort(key=lambda c: c.rank)
    nearest = sorted(ruled.values(), key=lambda r: (-r.closeness, bug_order(r.bug)))
    if candidates:
        return MatchResult(candidates, ruled_out=nearest)
    return MatchResult(why_none=_why_none(units), ruled_out=nearest)


def _why_none(units: list[Unit]) -> str:
    if not units:
        return "no engine crash found in this log"
    first = units[0]
    inner = innermost_vllm(first.traceback) if first.traceback is not None else first.innermost
    if first.complete and inner is not None:
        return f"no known bug matches {first.exception} in {inner.function}"
    if first.traceback is not None and first.traceback.cut_short:
        deepest = first.frames[-1] if first.frames else None
        where = f" (the last frame in the log is {deepest.function})" if deepest else ""
        return "no known bug matches: the traceback is cut short before its exception line" + where
    return "no known bug matches what the log shows"


def match_crash(crash: LogTraceback | None, recipes: list[Recipe], sites: list[Any] | None = None) -> MatchResult:
    """One traceback alone (the reader's crash) against the known bugs."""
    if crash is None:
        return MatchResult(why_none="no engine crash found in this log")
    return match_units([traceback_unit(crash)], recipes, sites)


def summary_units(summary: Any) -> list[Unit]:
    return units(summary)


def match_log(summary: Any, recipes: list[Recipe], sites: list[Any] | None = None) -> MatchResult:
    """Everything the log holds against the known bugs."""
    found = summary_units(summary)
    if not found:
        return MatchResult(why_none="no engine crash found in this log")
    return match_units(found, recipes, sites)

