"""Shrunk failures as recipe files that `kvdoctor repro FILE` replays.

A finding's recipe is the shrunk example's recipe, cut at the step that failed
(a `schedule` with `count` keeps only the repeats up to the failure), with the
failure's signature filled in:

- a vLLM exception: `exception` + `function` (+ `contains`: the exception's
  message, which for a bare `assert` is its condition), so `repro` says
  `reproduced` (exit 1);
- an invariant: `invariant = <name>`, also `reproduced`;
- the end-of-run release check: the whole recipe (with its settle tail) plus
  one `[[check]]` per leaked request (`connector_state = "released"`). The
  check has no registered invariant, so until one is added `repro` reports it
  as `other_failure` ("check failed", exit 4): the signature then names the
  check in words and can never match an exception;
- an exception raised inside kvdoctor (a harness bug): its exception and
  function; `repro` shows it as `other_failure` too.

A finding whose signature is a built-in recipe's is labelled with that bug
(`known_bug`: "K1", ...), so a rediscovery does not read as new.

Findings are kept apart by signature and by path: a run through a known bug's
trigger (`path_of`: K1's, K6's) is that bug's route and never hides another route
to the same crash site. Files are named after the signature and path, one per
pair (a rerun into the same folder replaces that pair's file).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvdoctor.errors import KvdoctorError, UsageError
from kvdoctor.explore.impact import impact_of, impact_of_finding
from kvdoctor.explore.runner import RELEASE_CHECK, Observation, engine_of, expanded_actions, setup_of
from kvdoctor.explore.triage import STARTUP
from kvdoctor.recipes.compile import compile_recipe
from kvdoctor.recipes.model import Recipe, Signature, Step, bug_order
from kvdoctor.recipes.writer import recipe_to_toml


@dataclass
class Finding:
    signature: str
    kind: str
    detail: str
    recipe: Recipe  # the shrunk, cut recipe with its signature: what gets written
    seed: int  # the run's --seed
    example_seed: int  # hypothesis' seed for the round that found it
    worker: int
    round: int
    logic: str
    vllm_version: str
    examples_before: int  # examples this worker ran before finding it
    elapsed_s: float  # seconds after the worker started exploring
    file: str | None = None
    # hypothesis could not replay the shrunk example deterministically (`Flaky`): the recipe is
    # the smallest failing run seen, and replaying it may not fail every time.
    flaky: bool = False
    triage: Any = None  # triage.Triage, once the finding was triaged
    # the known bug whose trigger the run went through ("K1"), "" for another path: findings of one signature
    # are kept apart by it (a route through K1's trigger is K1, and must not hide another route to that assert)
    path: str = ""
    engine: str = "scheduler"  # the level it was found at (core: a sleep/wake example, `runner.engine_of`)

    @property
    def key(self) -> str:
        return finding_key(self.signature, self.path, self.engine)


    @property
    def steps(self) -> int:
        return len(self.recipe.steps)

    @property
    def known(self) -> tuple[str, tuple[str, ...]] | None:
        """(bug, built-in recipe names) when a built-in recipe has this finding's signature."""
        return known_bug(self.recipe.signature, actions=step_actions(self.recipe.steps), setup=self.recipe.setup,
                         detail=self.detail)

    @property
    def impact(self) -> Any:
        """What it does to a server and its clients (`kvdoctor.explore.impact`)."""
        return impact_of_finding(self, startup=self.triage is not None and self.triage.verdict == STARTUP)

    @property
    def label(self) -> str:
        """The signature, with the known bug it is when there is one."""
        known = self.known
        return f"{self.signature} (known bug {known[0]}: {', '.join(known[1])})" if known else self.signature

    def as_dict(self) -> dict[str, Any]:
        return {
            "signature": self.signature, "kind": self.kind, "file": self.file, "steps": self.steps,
            "seed": self.seed, "example_seed": self.example_seed, "worker": self.worker, "round": self.round,
            "logic": self.logic, "detail": self.detail, "examples_before": self.examples_before,
            "found_after_s": round(self.elapsed_s, 3), "flaky": self.flaky,
            "path": self.path or None,  # the known bug whose trigger the run went through
            "engine": self.engine,  # the level it was found at and replays at (`repro --engine`)
            "known_bug": self.known[0] if self.known else None,
            "known_recipes": list(self.known[1]) if self.known else [],
            "impact": self.impact.as_dict(),
            "triage": self.triage.as_dict() if self.triage is not None else None,
        }


# Exceptions whose message is only the key or index that failed (a request id, ...): the failing
# source line says more and does not change with the request's name.
_KEY_MESSAGES = ("KeyError", "IndexError")


def contains_text(obs: Observation) -> str | None:
    """What a finding's signature says the failing line contains: the message (a bare assert's is its
    condition), or the source line where the message is only a key."""
    if obs.kind != "exception":
        return None
    text = obs.code if obs.exception in _KEY_MESSAGES and obs.code else (obs.message or obs.code)
    return text.removeprefix("assert ").strip() if text else None


def _signature_matches(known: Signature, found: Signature, haystack: str = "") -> bool:
    if known.invariant or found.invariant:
        return bool(known.invariant) and known.invariant == found.invariant
    if known.exception != found.exception or found.function not in known.functions():
        return False
    return not known.contains or known.contains in " ".join((found.contains or "", haystack))


# Step actions that shape which bug a shared signature is: K1 and K6 fire the same assert, and
# only K6's recipe withholds block hashes (its offload keys lag its blocks).
TRIGGER_ACTIONS = frozenset({"delay_block_hashes"})


def step_actions(steps: tuple[Step, ...]) -> frozenset[str]:
    return frozenset(step.action for step in steps)


# A known bug's mechanism, beyond its signature: a finding is labelled with the bug only when its
# run took the bug's path. An invariant names a symptom that other paths can show too (a store cursor
# past the computed tokens, a reused block left unfenced), so its name alone labels nothing; an assert
# on offload keys (K6's at the store and at the lookup) is K6 only where the keys lag because the
# request's block hashes were late.
# bug -> (the path in words, does the finding's setup, violation and step actions take it?)
MECHANISMS: dict[str, tuple[str, Any]] = {
    "K4": ("a finished request's final store", lambda setup, detail, actions: "status FINISHED" in detail),
    # an EAGLE speculative config takes it too: where no group is annotated as a drafter's, 0.26.0's
    # connector treats every group as one (offloading/scheduler.py: `eagle_groups = set(range(...))`)
    "K5": ("an EAGLE/MTP drafter group", lambda setup, detail, actions: "eagle" in str(setup.get("layout") or "")
           or setup.get("speculative_method") == "eagle"),
    "K6": ("block hashes that arrive after the tokens",
           lambda setup, detail, actions: "delay_block_hashes" in actions),
    "K9": ("a MultiConnector", lambda setup, detail, actions: bool(setup.get("multi_connector"))),
    "K11": ("re-admission after a preemption", lambda setup, detail, actions: "after a preemption" in detail),
    "K13": ("a prefix-cache reset", lambda setup, detail, actions: "reset_prefix_cache" in actions),
}


def takes_path(bug: str | None, setup: dict[str, Any] | None, detail: str | None,
               actions: frozenset[str] = frozenset()) -> bool:
    """Whether a finding took `bug`'s path (True where the bug names no path beyond its signature,
    or the caller knows nothing of the finding's run: `setup` and `detail` both None)."""
    if bug not in MECHANISMS or (setup is None and detail is None):
        return True
    return bool(MECHANISMS[bug][1](setup or {}, detail or "", actions))


def known_bug(signature: Signature, haystack: str = "", actions: frozenset[str] = frozenset(),
              setup: dict[str, Any] | None = None, detail: str | None = None
              ) -> tuple[str, tuple[str, ...]] | None:
    """The known bug (and its built-in recipes) whose failure signature this one is (`haystack`: more
    text of the failure, its source line and message, for a built-in's `contains`) and whose path the
    finding took (`setup`: its recipe's [setup], `detail`: its failure's message; see MECHANISMS).
    Where several bugs share the signature, the one whose recipes use the finding's trigger-shaping
    actions (`actions`: the finding's step actions) comes first, then the catalogue's order."""
    from kvdoctor.recipes.builtins import all_builtins

    try:
        recipes = all_builtins()
    except KvdoctorError:  # an installation without its recipes labels nothing
        return None

    # K1 and K6 share `_build_store_jobs`' assert: a finding that withholds hashes is K6's.
    shaping = actions & TRIGGER_ACTIONS
    matches = sorted((r for r in recipes if r.bug and _signature_matches(r.signature, signature, haystack)
                      and takes_path(r.bug, setup, detail, actions)),
                     key=lambda r: (shaping != step_actions(r.steps) & TRIGGER_ACTIONS, bug_order(r.bug)))
    bug = matches[0].bug if matches else None
    if bug is None:
        return None
    return bug, tuple(r.name for r in matches if r.bug == bug)


def finding_key(signature: str, path: str, engine: str = "scheduler") -> str:
    """One finding per signature, path and level: `AssertionError in _build_store_jobs` (another path) and
    `AssertionError in _build_store_jobs via K1` are two; a run at --engine core (a sleep/wake example) is kept
    apart from the scheduler level's (`... at core`): a sleep's route to a site never hides another's."""
    key = f"{signature} via {path}" if path else signature
    return f"{key} at core" if engine == "core" else key


def observed_signature(obs: Observation) -> Signature:
    """A run's failure as a recipe signature (what `finding_recipe` writes)."""
    if obs.kind == "invariant":
        return Signature(invariant=obs.invariant)
    return Signature(exception=obs.exception, function=obs.function, contains=contains_text(obs))


def path_of(obs: Observation, recipe: Recipe) -> str:
    """The known bug whose trigger this run went through ("" when none): its signature and its mechanism."""
    if obs.kind not in ("exception", "invariant"):
        return ""
    if (obs.function if obs.kind == "exception" else f"invariant {obs.invariant}") not in _known_sites():
        return ""  # the common case while searching: no known bug fails there (skips the catalogue)
    known = known_bug(observed_signature(obs), " ".join(filter(None, (obs.code, obs.message))),
                      step_actions(recipe.steps), recipe.setup, obs.detail)
    return known[0] if known else ""


@lru_cache(maxsize=1)
def _known_sites() -> frozenset[str]:
    """The functions (and `invariant NAME`s) a built-in recipe's signature names."""
    from kvdoctor.errors import KvdoctorError
    from kvdoctor.recipes.builtins import all_builtins

    try:
        recipes = all_builtins()
    except KvdoctorError:
        return frozenset()
    sites: set[str] = set()
    for recipe in recipes:
        sites.update(recipe.signature.functions())
        if recipe.signature.invariant:
            sites.add(f"invariant {recipe.signature.invariant}")
    return frozenset(sites)


def slug(signature: str) -> str:
    text = re.sub(r"[^A-Za-z0-9]+", "-", signature.replace(" in ", "-")).strip("-").lower()
    return text[:80] or "finding"


def cut_at_failure(steps: tuple[Step, ...], failure_index: int, setup: Any = None) -> tuple[Step, ...]:
    """The steps up to and including the run-time step `failure_index` (1-based). `setup`: the geometry
    that expands a `schedule until` (a hand-written base recipe); explore's own steps repeat by count."""
    if setup is not None:
        actions = [(play.index, play.step.action) for play in compile_recipe(steps, setup).steps]
    else:
        actions = expanded_actions(steps)
    last_index, _ = actions[failure_index - 1]
    repeats = sum(1 for idx, _ in actions[:failure_index] if idx == last_index)
    kept = list(steps[: last_index + 1])
    last = kept[-1]
    if last.action == "schedule":
        kept[-1] = Step("schedule", {"count": repeats} if repeats > 1 else {}, last.line)
    return tuple(kept)


def finding_recipe(recipe: Recipe, obs: Observation, summary: str) -> Recipe:
    name = "explore-" + slug(obs.signature or "finding")
    if obs.kind in ("exception", "harness", "invariant") and obs.failure_index:
        expands = any(step.args.get("until") is not None for step in recipe.steps)
        steps = cut_at_failure(recipe.steps, obs.failure_index, setup_of(recipe) if expands else None)
    else:
        steps = recipe.steps
    checks: tuple[Step, ...] = ()
    if obs.kind == "invariant":
        signature = Signature(invariant=obs.invariant)
    elif obs.kind == "check":
        signature = Signature(exception=f"(none: end-of-run check {RELEASE_CHECK}, see [[check]])",
                              function="(end of run)")
        checks = tuple(Step("expect", {"request": rid, "connector_state": "released",
                                       "description": f"{rid}'s connector state was released once every "
                                                      f"transfer drained"}, 0) for rid in obs.leaked)
    else:
        signature = observed_signature(obs)

    failing = steps[-1].action if obs.kind in ("exception", "harness") and steps else None
    summary = f"{summary}\nImpact: {impact_of(obs.kind, obs.invariant, failing).line}"
    return dataclasses.replace(recipe, name=name, summary=summary, signature=signature, steps=steps,
                               checks=checks, title=obs.signature)


def summary_text(obs: Observation, seed: int, example_seed: int, worker: int, round_: int, logic: str,
                 vllm_version: str, actions: frozenset[str] = frozenset(),
                 setup: dict[str, Any] | None = None) -> str:
    lines = [
        f"Found by `kvdoctor explore --seed {seed} --logic {logic}` on vLLM {vllm_version} "
        f"(worker {worker}, round {round_}, hypothesis seed {example_seed}) and shrunk by hypothesis.",
        f"Failure: {obs.signature}",
        f"Where: {obs.detail}",
    ]
    if obs.kind == "exception" and obs.exception and obs.function:
        known = known_bug(Signature(exception=obs.exception, function=obs.function, contains=contains_text(obs)),
                          " ".join(filter(None, (obs.code, obs.message))), actions, setup, obs.detail)
    elif obs.kind == "invariant":
        known = known_bug(Signature(invariant=obs.invariant), setup=setup, detail=obs.detail)
    else:
        known = None
    if known:
        path = f", on its path ({MECHANISMS[known[0]][0]})" if known[0] in MECHANISMS else ""
        lines.append(f"Known bug {known[0]}: the failure signature of the built-in recipe(s) "
                     f"{', '.join(known[1])}{path} (`kvdoctor repro {known[1][0]}`).")
    if obs.kind == "check":
        lines.append("After the settle tail (every transfer released, then more engine steps) the requests above "
                     "still hold connector state: `kvdoctor repro` reports the failed [[check]] as "
                     "other_failure (exit 4).")
    if obs.kind == "harness":
        lines.append("The exception was raised in kvdoctor, not in vLLM: a harness bug; `kvdoctor repro` "
                     "reports it as other_failure (exit 4).")
    if logic != "installed":
        lines.append(f"Found under the `{logic}` logic variant: replay with `kvdoctor repro FILE --logic {logic}`.")
    return "\n".join(lines)


def header_text(finding: Finding) -> str:
    return (f"Found by kvdoctor explore: seed {finding.seed} (worker {finding.worker}, round {finding.round}, "
            f"hypothesis seed {finding.example_seed}), logic {finding.logic}, vLLM {finding.vllm_version}.\n"
            f"Signature: {finding.label}\n"
            f"Replay: kvdoctor repro <this file>" + (f" --logic {finding.logic}" if finding.logic != "installed"
                                                     else "")
            + (" --engine core (its sleep / wake_up steps are the engine's)"
               if engine_of(finding.recipe) == "core" else ""))


def write_findings(findings: list[Finding], out_dir: Path) -> None:
    """Write one recipe per finding (sets `finding.file`), replacing this signature's (and path's) earlier file."""
    if not findings:
        return  # nothing to write: no folder either
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: {exc.strerror}") from None
    for finding in findings:
        path = out_dir / f"{slug(finding.key)}.toml"
        text = recipe_to_toml(finding.recipe, header=header_text(finding))
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--out {out_dir}: cannot write {path.name}: {exc.strerror}") from None
        finding.file = str(path)


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per signature and path: the one with fewest steps (then the earliest worker)."""
    best: dict[str, Finding] = {}
    for finding in findings:
        current = best.get(finding.key)
        if current is None or (finding.steps, finding.worker) < (current.steps, current.worker):
            best[finding.key] = finding
    return sorted(best.values(), key=lambda f: (f.elapsed_s, f.signature))
