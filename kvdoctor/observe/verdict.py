"""Outcomes of one run, and whether a failure matches a recipe's signature."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvdoctor.observe.failure import Failure
from kvdoctor.recipes.model import Signature


class Outcome(str, Enum):
    REPRODUCED = "reproduced"          # the recipe's failure signature fired
    NOT_REPRODUCED = "not_reproduced"  # the scenario ran through
    OTHER_FAILURE = "other_failure"    # something else broke: reported, never hidden
    NOT_APPLICABLE = "not_applicable"  # the installed vLLM lacks what the trigger needs
    SETUP_ERROR = "setup_error"        # a precondition (`expect`) of the recipe did not hold
    # The run did not test the bug; never exit 0 (ExitStatus.INCONCLUSIVE):
    NOT_REACHED = "not_reached"        # the run never executed the recipe's crash site
    UNTESTED = "untested"              # the user's own flags make the trigger impossible at this geometry


def matches_exception(signature: Signature, failure: Failure) -> bool:
    if signature.invariant or not failure.in_vllm:
        return False
    if failure.exception != signature.exception or failure.function not in signature.functions():
        return False
    if signature.contains:
        haystack = " ".join(filter(None, (failure.code, failure.message)))
        return signature.contains in haystack
    return True


def failure_verdict(signature: Signature, failure: Failure, names_request: bool = True) -> tuple[Outcome, str]:
    """The outcome a vLLM exception gives a recipe, and why when it is not the bug (the one rule for
    every level): the signature's exception at its function reproduces it, and where the run can tell
    which request was involved (`names_request`), only for the signature's request; anything else is
    another failure. The detail is empty for `reproduced` (the level says how it saw it)."""
    if not matches_exception(signature, failure):
        return Outcome.OTHER_FAILURE, (f"{failure.exception} in vLLM's {failure.function}"
                                       + (f": {failure.message}" if failure.message else ""))
    if names_request and signature.request is not None and failure.involved_request != signature.request:
        whom = (f"request {failure.involved_request}" if failure.involved_request
                else "a request kvdoctor could not identify")
        return Outcome.OTHER_FAILURE, (f"{failure.exception} in {failure.function} fired for {whom}, but this "
                                       f"recipe's bug must involve request {signature.request}: the same "
                                       f"assertion reached by another path, not the bug the recipe is about")
    return Outcome.REPRODUCED, ""


def apply_coverage(result: Any, signature: Signature) -> Any:
    """Let the crash site's coverage qualify a run's outcome (`result`: a results.RunResult).

    `not_reproduced` stays only where the run executed the site and it held, or where the site is
    gone from the installed vLLM (said in the detail); a run that never executed it did not test
    the bug: `not_reached`.
    """
    coverage = result.coverage
    if coverage is None:
        return result
    if result.outcome is Outcome.REPRODUCED:
        coverage.fired = True
    elif result.outcome is Outcome.NOT_REPRODUCED:
        if coverage.gone:
            result.detail = f"site gone: {coverage.gone}"
        elif coverage.measured and not coverage.reached:
            result.outcome = Outcome.NOT_REACHED
            result.detail = coverage.line() + " on this release"
    return result


# -- a silent bug as its clients see it ---------------------------------------------------------------

@dataclass(frozen=True)
class AnswerDiff:
    """One request's completion against the reference's: the first token where they differ (None: equal
    over the tokens both runs produced; a recipe's finish or abort may cut one run's completion shorter)."""

    request: str
    position: int | None
    got: int | None = None
    expected: int | None = None
    got_tokens: int = 0
    expected_tokens: int = 0
    # the stand-in's logprob of the differing token in each run (None: not known)
    got_logprob: float | None = None
    expected_logprob: float | None = None

    @property
    def differs(self) -> bool:
        return self.position is not None


@dataclass
class ClientAnswers:
    """Every request's completion with offloading on against the run's own reference (`reference` says
    which); `missing`: requests one run served and the other did not (a crash, a stopped run)."""

    reference: str
    diffs: list[AnswerDiff] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    not_compared: str = ""  # why the completions were not compared (the run cannot tell right KV from wrong)

    @property
    def differing(self) -> list[AnswerDiff]:
        return [d for d in self.diffs if d.differs]

    @property
    def reproduced(self) -> bool:
        return bool(self.differing)

    @property
    def line(self) -> str:
        """The impact in a client's words."""
        if self.not_compared:
            return f"clients' completions not compared: {self.not_compared}"
        wrong = self.differing
        if wrong:
            return "; ".join(f"request {d.request}'s completion differs from the reference ({self.reference}) at "
                             f"token {d.position}: {d.got} where the reference has {d.expected}" for d in wrong)
        served = ", ".join(d.request for d in self.diffs) or "none"
        return f"every completion equals the reference ({self.reference}): requests {served}"

    def as_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "reproduced": self.reproduced, "line": self.line,
                "requests": [d.__dict__ for d in self.diffs], "missing": list(self.missing),
                "not_compared": self.not_compared or None}


def compare_completions(got: dict[str, list[int]], reference: dict[str, list[int]], reference_name: str,
                        got_logprobs: dict[str, list[float]] | None = None,
                        reference_logprobs: dict[str, list[float]] | None = None) -> ClientAnswers:
    """Each request's completion against the reference's, token by token over the tokens both have; the
    logprobs (where given) say how sure the stand-in was of each differing token."""
    answers = ClientAnswers(reference_name)
    for request in sorted(set(got) | set(reference)):
        if request not in got or request not in reference:
            answers.missing.append(request)
            continue
        mine, theirs = got[request], reference[request]
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        answers.diffs.append(AnswerDiff(
            request, first, mine[first] if first is not None else None, theirs[first] if first is not None else None,
            len(mine), len(theirs), _at((got_logprobs or {}).get(request), first),
            _at((reference_logprobs or {}).get(request), first)))
    return answers


def _at(values: list[float] | None, index: int | None) -> float | None:
    return values[index] if values is not None and index is not None and index < len(values) else None
