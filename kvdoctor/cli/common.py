"""What every command module shares: run a command's action with the exit code it earned, and the
command line it was given (for reports).

The command modules (`*_cmd.py`) take these from here, never from `kvdoctor.cli.app`,
which imports them: the CLI has no import circle. Cheap to import (Typer only).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

import typer


def command_line() -> str:
    """The command as the user typed it, quoted for a shell (reports quote it back)."""
    from kvdoctor.cli.streams import current

    return "kvdoctor " + " ".join(shlex.quote(a) for a in current().arguments)


def run(action: Callable[[], int], json_out: bool = False) -> None:
    """Run a command's action and exit with the status it earned (see `kvdoctor.cli.failures`)."""
    from kvdoctor.cli.failures import run_guarded

    raise typer.Exit(run_guarded(action, json_out))
