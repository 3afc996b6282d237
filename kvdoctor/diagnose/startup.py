"""`diagnose` on a start-up failure: run `kvdoctor check` at the log's serve arguments (and the flags the
user adds after `--`), and say whether vLLM's own start-up refuses them here the way the log says it did.

A start-up refusal is vLLM's own code refusing a configuration, code kvdoctor runs on this CPU
(`kvdoctor.check`); what it cannot reproduce here is the deployment's host (its memory, /dev/shm, other
nodes), which the result names rather than guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.check.flags import flags_from_serve_args
from kvdoctor.check.result import CheckResult
from kvdoctor.diagnose.match import innermost_vllm
from kvdoctor.diagnose.traceback import LogTraceback, display_path
from kvdoctor.engine.overrides import Overrides

CONFIRMED = "confirmed"  # vLLM refuses here as the log says (same exception, or the same vLLM file:line)
DIFFERENT = "different"  # vLLM refuses here, but not with the log's exception or at its site
STARTS = "starts"  # vLLM starts here at these flags: the log's failure is its host's, or needs a flag not given


@dataclass
class StartupCheck:
    """What `kvdoctor check` said at the log's flags, against the log's crash."""

    flags_from: str  # where the flags came from, in words
    result: CheckResult
    verdict: str  # CONFIRMED | DIFFERENT | STARTS
    notes: list[str] = field(default_factory=list)  # what of the flags could not be used


def _same_site(refusal_site: str | None, crash: LogTraceback | None) -> bool:
    if refusal_site is None or crash is None:
        return False
    frame = innermost_vllm(crash)
    if frame is None:
        return False
    file, _, line = refusal_site.rpartition(":")
    logged = display_path(frame.file).replace("\\", "/")
    return logged.endswith(file.split("vllm/", 1)[-1]) and str(frame.line) == line


def startup_check(serve_args: dict[str, Any], user_args: dict[str, Any], crash: LogTraceback | None,
                  command: str = "") -> StartupCheck:
    """Run vLLM's start-up stages at the log's serve arguments overridden by the user's (no audit: the
    question is the start-up), and compare the outcome with the log's crash."""
    from kvdoctor.check.app import check

    merged = {**serve_args, **user_args}
    flags, notes = flags_from_serve_args(merged)
    sources = [what for what, given in (("the log's serve arguments", serve_args),
                                        ("the flags given after --", user_args)) if given]
    result = check(flags, Overrides, command=command, audit=False)  # no audit: its overrides are never asked for
    refusal = result.refusal
    if refusal is None:
        verdict = STARTS
    elif crash is not None and (refusal.exception == crash.exception or _same_site(refusal.site, crash)):
        verdict = CONFIRMED
    else:
        verdict = DIFFERENT
    return StartupCheck(flags_from=" and ".join(sources) or "vLLM's defaults (the log names no serve arguments)",
                        result=result, verdict=verdict, notes=notes)
