"""What `kvdoctor check` found: the stages vLLM's start-up ran, the refusal (if any), the known bugs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STARTS = "starts"
REFUSED = "refused"


@dataclass(frozen=True)
class Refusal:
    """vLLM refusing the configuration at start-up, in its own words."""

    stage: str  # which start-up stage refused (config, planning, offloading, host, scheduler)
    exception: str  # the exception type vLLM raises ("AssertionError", "ValueError", "OSError")
    message: str  # vLLM's message (a bare assert: its statement)
    site: str | None  # file:line of the last vLLM frame (vllm/... relative), None where unknown
    predicted: bool = False  # judged from vLLM's sizes against this host, not raised here
    fix: str | None = None  # the flag change that avoids it
    fix_checked: bool = False  # the fix was run through the same start-up path and starts


@dataclass(frozen=True)
class Stage:
    name: str
    passed: bool
    detail: str


@dataclass
class CheckResult:
    vllm_version: str
    command: str
    stages: list[Stage] = field(default_factory=list)
    refusal: Refusal | None = None
    notes: list[str] = field(default_factory=list)  # planning defaults, what was not run and why
    region_bytes: int | None = None  # the CPU tier vLLM sized (per engine)
    host_bytes: int | None = None  # the memory it was judged against
    host_source: str = ""  # "--host-memory" or "MemTotal"
    audit: Any = None  # app.AuditReport at these flags, or None (--no-audit, or a refusal)

    @property
    def verdict(self) -> str:
        return REFUSED if self.refusal is not None else STARTS

    def reproduced_bugs(self) -> list[Any]:
        """The audit rows that reproduce under the installed logic at these flags."""
        if self.audit is None:
            return []
        return [row for row in self.audit.rows if row.installed.outcome.value == "reproduced"]
