"""Errors kvdoctor reports to the user, each tied to its documented exit code.

Anything raised as a `KvdoctorError` is printed as one line (never a traceback)
by the CLI, which exits with the error's `exit_code`.
"""

from __future__ import annotations

EXIT_NOT_REPRODUCED = 0
EXIT_REPRODUCED = 1
EXIT_USAGE = 2
EXIT_VLLM_UNAVAILABLE = 3
EXIT_SETUP_OR_OTHER_FAILURE = 4


class KvdoctorError(Exception):
    """A problem the user can act on; its message is one line."""

    exit_code = EXIT_USAGE


class UsageError(KvdoctorError):
    """Bad flags, impossible geometry, unknown recipe name."""

    exit_code = EXIT_USAGE


class RecipeError(KvdoctorError):
    """A recipe file that cannot be loaded; the message names file:line."""

    exit_code = EXIT_USAGE


class VllmUnavailableError(KvdoctorError):
    """vLLM is missing, broken on import, or outside the supported range."""

    exit_code = EXIT_VLLM_UNAVAILABLE


class IncompatibleVllmError(VllmUnavailableError):
    """The installed vLLM moved a private piece kvdoctor reads."""
