"""Errors kvdoctor reports to the user, and the exit statuses they map to.

`ExitStatus` is the one definition of what an exit code means (README and
`--help` are generated from its descriptions). Anything raised as a
`KvdoctorError` is printed as one line (never a traceback) by the CLI, which
exits with the error's `exit_code`; any other exception escaping a command is
kvdoctor's own failure (`INTERNAL_ERROR`), never a vLLM finding.
"""

from __future__ import annotations

from enum import IntEnum

from kvdoctor.releases import SUPPORTED_RANGE_TEXT


class ExitStatus(IntEnum):
    """What kvdoctor's exit code says (the httpie idea: one enum, used everywhere)."""

    NOT_REPRODUCED = 0
    REPRODUCED = 1
    USAGE = 2
    VLLM_UNAVAILABLE = 3
    SETUP_OR_OTHER_FAILURE = 4
    INTERNAL_ERROR = 5
    INCONCLUSIVE = 6
    UNNAMED_CRASH = 7
    STARTUP_REFUSED = 8
    INTERRUPTED = 130

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitStatus.NOT_REPRODUCED: "not reproduced (or not applicable to this vLLM)",
    ExitStatus.REPRODUCED: "reproduced: the recipe's failure signature fired under the installed logic",
    ExitStatus.USAGE: "usage error: bad flag, impossible geometry, unknown recipe, malformed recipe file, "
                      "unwritable output path",
    ExitStatus.VLLM_UNAVAILABLE:
        f"vLLM missing, broken on import, or outside the supported range {SUPPORTED_RANGE_TEXT}",
    ExitStatus.SETUP_OR_OTHER_FAILURE: "a recipe precondition did not hold (setup_error) or something else "
                                       "failed in vLLM (other_failure)",
    ExitStatus.INTERNAL_ERROR: "kvdoctor itself failed (a bug in kvdoctor, not a vLLM finding: please report it)",
    ExitStatus.INCONCLUSIVE: "inconclusive: the run did not test the bug (its crash site was not reached, "
                             "or the flags given make its trigger impossible: untested at this geometry)",
    ExitStatus.UNNAMED_CRASH: "diagnose: the log holds a crash that matches no known bug",
    ExitStatus.STARTUP_REFUSED: "check: vLLM's start-up would refuse these flags (predicted here: its message, "
                                "file:line and the flag change that avoids it); diagnose: the log's start-up "
                                "failure, refused here the same way at the log's flags",
    ExitStatus.INTERRUPTED: "interrupted (Ctrl-C)",
}

# Older names, kept so call sites read naturally.
EXIT_NOT_REPRODUCED = ExitStatus.NOT_REPRODUCED
EXIT_REPRODUCED = ExitStatus.REPRODUCED
EXIT_USAGE = ExitStatus.USAGE
EXIT_VLLM_UNAVAILABLE = ExitStatus.VLLM_UNAVAILABLE
EXIT_SETUP_OR_OTHER_FAILURE = ExitStatus.SETUP_OR_OTHER_FAILURE
EXIT_INTERNAL_ERROR = ExitStatus.INTERNAL_ERROR


class KvdoctorError(Exception):
    """A problem the user can act on; its message is one line."""

    exit_code = ExitStatus.USAGE
    kind = "usage_error"


class UsageError(KvdoctorError):
    """Bad flags, impossible geometry, unknown recipe name, unwritable output path."""

    exit_code = ExitStatus.USAGE
    kind = "usage_error"


class RecipeError(KvdoctorError):
    """A recipe file that cannot be loaded; the message names file:line."""

    exit_code = ExitStatus.USAGE
    kind = "recipe_error"


class VllmUnavailableError(KvdoctorError):
    """vLLM is missing, broken on import, or outside the supported range."""

    exit_code = ExitStatus.VLLM_UNAVAILABLE
    kind = "vllm_unavailable"


class IncompatibleVllmError(VllmUnavailableError):
    """The installed vLLM moved a private piece kvdoctor reads."""

    kind = "incompatible_vllm"


class UntestedError(KvdoctorError):
    """What was asked cannot test the bug, as vLLM measured it (a `--model` whose KV groups lack the kind the
    recipe's trigger needs, for an exported script): inconclusive, exit 6, nothing written."""

    exit_code = ExitStatus.INCONCLUSIVE
    kind = "untested"


class InternalError(KvdoctorError):
    """kvdoctor's own code failed; never reported as a vLLM finding."""

    exit_code = ExitStatus.INTERNAL_ERROR
    kind = "internal_error"
