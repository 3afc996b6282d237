"""What a recipe is: metadata, a setup, ordered steps, checks, and a failure signature.

Recipes are data. Nothing in them is executed, imported or evaluated; the
runner interprets the fixed step vocabulary below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat.names import function_spellings

ACTIONS = (
    "add", "schedule", "drain", "abort", "finish", "complete_transfers", "hold_transfers",
    "fail_transfers", "reset_prefix_cache", "expect", "delay_block_hashes", "release_block_hashes",
    "pause", "resume",
)

# The fields each action accepts: name -> (python type(s), required)
STEP_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "add": {
        "request": ((str,), True),
        "prompt_tokens": ((int,), False),
        "prompt": ((list,), False),
        "prompt_chunks": ((int,), False),
        "fill_pool": ((bool, str), False),  # true | "preempt_next"
        "prompt_rest_of_pool": ((bool,), False),  # the blocks a fill_pool = "preempt_next" before it leaves
        "max_tokens": ((int,), False),
        "shared_prefix_with": ((str,), False),
        "shared_prefix_tokens": ((int,), False),
        # geometry-relative sizes: a prompt_chunks prompt N tokens short; a prefix of N chunks
        "trim_tokens": ((int,), False),
        "shared_prefix_chunks": ((int,), False),
        # what a client sends with the request: vLLM's `kv_transfer_params` (0.34's offloading connector
        # reads max_load_tokens / max_offload_tokens from it) and its priority (lower is served first,
        # under [setup] scheduling_policy = "priority")
        "kv_transfer_params": ((dict,), False),
        "priority": ((int,), False),
    },
    # until = "filled": as many steps as the fill_pool before it needs at this geometry
    # until = "prefilled" (with request): ceil(its prompt / max_num_batched_tokens) steps
    "schedule": {"count": ((int,), False), "until": ((str,), False), "request": ((str,), False)},
    "drain": {},  # async: apply the output still in flight, without scheduling (the engine goes idle)
    "abort": {"request": ((str,), True)},
    "finish": {"request": ((str,), True)},
    "complete_transfers": {"request": ((str,), False), "kind": ((str,), False)},
    "hold_transfers": {"request": ((str,), False), "kind": ((str,), False)},
    # worker = i (num_workers > 1): only worker i fails the jobs, the others complete them
    "fail_transfers": {"request": ((str,), False), "kind": ((str,), False), "worker": ((int,), False)},
    "reset_prefix_cache": {"reset_running_requests": ((bool,), False), "reset_connector": ((bool,), False)},
    "expect": {},  # filled from EXPECT_FIELDS
    # block hashes (and so offload keys) that arrive later than blocks, as in P/D and hybrid deployments
    "delay_block_hashes": {"request": ((str,), True)},
    "release_block_hashes": {"request": ((str,), True)},
    # the engine pauses its scheduler (EngineCore.pause_scheduler): "keep" its requests or "abort" them;
    # clear_cache resets the prefix cache (and the connector's) as vLLM's pause does
    "pause": {"mode": ((str,), False), "clear_cache": ((bool,), False)},
    "resume": {},
}

# State a step of kind `expect` (a precondition) or a `[[check]]` (a post-condition) can assert.
EXPECT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "request": ((str,), True),
    "status": ((str, list), False),
    "allocated_blocks": ((int,), False),
    "min_allocated_blocks": ((int,), False),
    "connector_state": ((str,), False),  # "present" | "released"
    "in_flight_jobs": ((int,), False),
    "min_in_flight_jobs": ((int,), False),
    "store_jobs_built": ((int,), False),
    "min_store_jobs_built": ((int,), False),
    "description": ((str,), False),
}
STEP_FIELDS["expect"] = EXPECT_FIELDS

TRANSFER_KINDS = ("store", "load")
# pause modes an in-process EngineCore takes ("wait" is refused there: it needs the engine's own loop)
PAUSE_MODES = ("keep", "abort")
CONNECTOR_STATES = ("present", "released")


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
    """The catalogue's order (K1, K2, ..., K12), then recipes that name no known bug."""
    bug = bug or ""
    digits = "".join(ch for ch in bug if ch.isdigit())
    return (int(digits) if digits else 10_000, bug)
