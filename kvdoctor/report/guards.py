"""The wording of a run's guards (`results.Guard`: what kept a finished request's final store in
bounds, measured by `scenario.explain_guards`), with the upstream PR each cap came from."""

from __future__ import annotations

from kvdoctor.results import Guard, GuardCap, RunResult

CAP_WORDS: dict[GuardCap, str] = {
    "fixed_logic": "kvdoctor's fixed logic (the allocated-chunk cap of PR #49146)",
    "allocated_chunks": "this release's allocated-chunk cap (PR #49146)",
    "offload_keys": "this release's offload-key cap (PR #52923)",
}
ABORTED_COUNTS_COMPUTED = "aborted requests count only computed tokens (PR #49285)"


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def guard_line(guard: Guard) -> str:
    who = f"{guard.request} (group {guard.group})" if guard.group else guard.request
    if guard.kind == "held":
        held = (f"held storable chunks to {guard.returned}; its {guard.offloadable_tokens} offloadable "
                f"tokens make {_chunks(guard.token_chunks)} but it holds {_chunks(guard.allocated_chunks)} "
                f"and has {guard.next_stored_chunk} stored")
        term = CAP_WORDS[guard.cap] if guard.cap else "something kvdoctor cannot name"
        return f"{who}: {term} {held}"
    counted = (f"the final store counted {guard.offloadable_tokens} tokens ({_chunks(guard.token_chunks)}), "
               f"not the {guard.full_tokens} its offloadable tokens come to")
    within = f"within its {guard.allocated_chunks} allocated / {guard.next_stored_chunk} stored; no cap was needed"
    if guard.aborted_counts_computed:
        return f"{who}: {counted}: {ABORTED_COUNTS_COMPUTED}, {within}"
    return f"{who}: {counted}, for a reason kvdoctor cannot name, {within}"


def guard_lines(result: RunResult) -> list[str]:
    return [guard_line(guard) for guard in result.guards]
