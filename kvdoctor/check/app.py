"""`kvdoctor check`: run vLLM's start-up path at the flags, then the known bugs at the same flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvdoctor.check.fixes import find_fix
from kvdoctor.check.flags import DEFAULT_GPU_BLOCKS, DEFAULT_MAX_MODEL_LEN, CheckFlags
from kvdoctor.check.result import CheckResult
from kvdoctor.check.startup import run_startup
from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import ExitStatus


def check(flags: CheckFlags, overrides: Callable[[], Overrides], command: str = "", audit: bool = True,
          on_progress: Callable[[int, int, str], None] | None = None) -> CheckResult:
    """Will it start? (vLLM's own start-up stages on this CPU), and which known bugs reproduce at these flags
    (`app.audit` with the same flags as `overrides()`, asked for only then: kvdoctor's own reading of the
    flags must not stand in front of vLLM's start-up; skipped with `audit=False` or after a refusal)."""
    from kvdoctor.app import audit as run_audit
    from kvdoctor.app import load_vllm

    api = load_vllm()
    startup = run_startup(api, flags)
    result = CheckResult(vllm_version=api.version_text, command=command, stages=startup.stages,
                         refusal=startup.refusal, notes=_defaults(flags) + startup.notes,
                         region_bytes=startup.region_bytes, host_bytes=startup.host_bytes,
                         host_source=startup.host_source)
    if startup.refusal is not None:
        fix, checked = find_fix(flags, startup.refusal, lambda changed: run_startup(api, changed).refusal is None)
        result.refusal = dataclasses.replace(startup.refusal, fix=fix, fix_checked=checked)
        return result
    if audit:
        result.audit = run_audit(command=command, overrides=overrides(), on_progress=on_progress)
    return result


def _defaults(flags: CheckFlags) -> list[str]:
    """The sizes kvdoctor planned with where a GPU deployment would choose its own."""
    notes = []
    if flags.gpu_blocks is None:
        notes.append(f"planned with a pool of {DEFAULT_GPU_BLOCKS} GPU blocks (a GPU sizes its own pool; "
                     f"--num-gpu-blocks-override N to check yours)")
    if flags.max_model_len is None:
        notes.append(f"planned with max_model_len {DEFAULT_MAX_MODEL_LEN} (--max-model-len to check yours)")
    return notes


def exit_status(result: CheckResult) -> ExitStatus:
    """A predicted start-up failure has its own code; else the known bugs at these flags decide: 1 when one
    reproduces, 4 when a row failed otherwise, 0 when none applies."""
    if result.refusal is not None:
        return ExitStatus.STARTUP_REFUSED
    outcomes = [row.installed.outcome.value for row in (result.audit.rows if result.audit is not None else [])]
    if "reproduced" in outcomes:
        return ExitStatus.REPRODUCED
    if any(o in ("other_failure", "setup_error") for o in outcomes):
        return ExitStatus.SETUP_OR_OTHER_FAILURE
    return ExitStatus.NOT_REPRODUCED


def as_dict(result: CheckResult) -> dict[str, Any]:
    """The result's data (the report layer adds the schema and renders)."""
    refusal = dataclasses.asdict(result.refusal) if result.refusal is not None else None
    return {"verdict": result.verdict, "vllm_version": result.vllm_version, "command_line": result.command,
            "stages": [dataclasses.asdict(s) for s in result.stages], "refusal": refusal, "notes": result.notes,
            "cpu_tier_bytes": result.region_bytes, "host_memory_bytes": result.host_bytes,
            "host_memory_source": result.host_source or None,
            "known_bugs": None if result.audit is None else [
                {"bug": row.bug, "recipe": row.recipe.name, "installed": row.installed.outcome.value}
                for row in result.audit.rows]}
