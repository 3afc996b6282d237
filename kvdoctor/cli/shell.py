"""How the command line looks from outside: one error style, help text (progress lives in cli/progress.py).

- Every usage error (an unknown option, a missing argument, a bad integer, and
  kvdoctor's own `UsageError`) is one line `kvdoctor: error: ...` and exit 2:
  `KvGroup.main` runs click with `standalone_mode=False` and formats what it
  raises, so Typer's boxed errors never show.
- Flags that take no value show no `<bool>` in `--help`.
- Serve flags that do not reach the scheduler are accepted with a one-line note.

Cheap to import: Typer only (rich is imported when something is shown).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from kvdoctor.errors import ExitStatus

F = TypeVar("F", bound=Callable[..., Any])

# Public names only: typer >= 0.22 vendors click under a private module whose layout
# changes between releases (its `Abort` moved to `typer.Abort`), older typer re-exports
# click's. Every error click shows the user derives from `typer.TyperException` (newer
# typer) or `click.ClickException` (older); a usage error is one whose exit code is 2.
if hasattr(typer, "TyperException"):
    ClickException: type[Exception] = typer.TyperException
else:  # pragma: no cover - typer < 0.22 depends on click
    import click

    ClickException = click.ClickException


def exit_codes_text(meanings: dict[ExitStatus, str] | None = None) -> str:
    """The exit-code paragraph of `--help`, from `ExitStatus`'s own descriptions
    (`meanings` words 0 and 1 for commands where they mean something else)."""
    words = meanings or {}
    shown = [s for s in ExitStatus if s is not ExitStatus.INTERRUPTED]
    return "Exit codes: " + "; ".join(f"{int(s)} {words.get(s, s.meaning)}" for s in shown) + "."


def with_exit_codes(meanings: dict[ExitStatus, str] | None = None) -> Callable[[F], F]:
    """Append the exit-code paragraph (`exit_codes_text(meanings)`) to a command's help (its docstring)."""
    text = exit_codes_text(meanings)

    def decorate(function: F) -> F:
        function.__doc__ = (function.__doc__ or "").rstrip() + "\n\n    " + text
        return function
    return decorate


def examples(*lines: str) -> str:
    """An epilog of examples, kept line by line (click's \\b: no reflow)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def _without_bool_metavar(option: Any) -> Any:
    if option is not None and getattr(option, "is_flag", False) and option.metavar is None:
        option.metavar = ""  # Typer shows `<bool>` after flags that take no value otherwise
    return option


class KvCommand(TyperCommand):
    """Plain (click) help, reflowed to the terminal, options grouped under their panel names."""

    def get_help_option(self, ctx: Any) -> Any:
        return _without_bool_metavar(super().get_help_option(ctx))

    def get_params(self, ctx: Any) -> list[Any]:
        return [_without_bool_metavar(p) if p.param_type_name == "option" else p for p in super().get_params(ctx)]

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """The usage line names arguments as their help does (`LOG`, `[RECIPE]...`), without Typer's
        braces around a required one."""
        return [piece.replace("{", "").replace("}", "") for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                section = "Arguments"
                record = (_argument_name(param), record[1])  # `RECIPE`, not Typer's `RECIPE <str>`
            else:
                section = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(section, []).append(record)
        for name, records in sections.items():
            with formatter.section(name):
                formatter.write_dl(records)


def _argument_name(param: Any) -> str:
    name = param.metavar or param.name.upper()
    return name.replace("{", "").replace("}", "")


def usage_error_line(exc: Any) -> str:
    """One line for a click usage error: its message and where to look for help."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"kvdoctor: error: {message}{where}"


class KvGroup(TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _without_bool_metavar(super().get_help_option(ctx))

    def get_params(self, ctx: Any) -> list[Any]:
        return [_without_bool_metavar(p) if p.param_type_name == "option" else p for p in super().get_params(ctx)]

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        from kvdoctor.cli.streams import current, note

        argv = list(current().arguments if args is None else args)
        argv = accept_serve_flags(argv)
        try:
            code = super().main(argv, prog_name=prog_name or "kvdoctor", complete_var=complete_var,
                                standalone_mode=False, windows_expand_args=windows_expand_args, **extra)
        except ClickException as exc:
            code = _click_error(exc, argv)
        except (typer.Abort, KeyboardInterrupt, EOFError):
            note("kvdoctor: interrupted")
            code = ExitStatus.INTERRUPTED
        except OSError as exc:  # click writing --help into a full disk (a closed pipe is below)
            if isinstance(exc, BrokenPipeError):
                raise
            from kvdoctor.cli.streams import current, silence_stdout

            silence_stdout()
            current().stdout_failure = f"stdout: {exc.strerror or exc}"
            code = ExitStatus.NOT_REPRODUCED
        except SystemExit as exc:
            # typer turns a BrokenPipeError that reaches it (click writing --help or --version
            # into a closed pipe) into exit 1; those print and exit 0, so 0 is what they earned.
            # kvdoctor's own output never gets here (`streams.write_stdout` keeps the code).
            if not isinstance(exc.__context__, BrokenPipeError):
                raise
            from kvdoctor.cli.streams import silence_stdout

            silence_stdout()
            code = ExitStatus.NOT_REPRODUCED
        code = int(code or 0) if isinstance(code, int) else 0
        from kvdoctor.cli.streams import settle_stdout

        code = settle_stdout(code)
        if standalone_mode:
            sys.exit(code)
        return code


def _click_error(exc: Any, argv: list[str]) -> int:
    """One line on stderr for an error click found while parsing, exit 2 (click's own code for a file it
    cannot open is 1, "reproduced": never that); a JSON document too under --json."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # bare `kvdoctor`: the help, as before
        ctx = getattr(exc, "ctx", None)
        from kvdoctor.cli.streams import note

        note(ctx.get_help() if ctx is not None else "")
        return ExitStatus.USAGE
    if getattr(exc, "exit_code", None) == ExitStatus.USAGE:  # an unknown option, a missing argument, a bad value
        line = usage_error_line(exc)
    else:  # e.g. a file option that cannot be opened
        line = f"kvdoctor: error: {' '.join(exc.format_message().split())}"
    from kvdoctor.cli.streams import note

    note(line)
    if json_requested(argv):
        from kvdoctor.cli.failures import error_document
        from kvdoctor.cli.streams import write_document
        from kvdoctor.report.json_doc import dumps

        write_document(dumps(error_document("usage_error", line.removeprefix("kvdoctor: error: "),
                                            ExitStatus.USAGE)))
    return ExitStatus.USAGE


def json_requested(argv: list[str]) -> bool:
    """Whether the command line asks for JSON (`--json`, `--format json`), read before click parsed it:
    an error in parsing still owes the caller the document it asked for."""
    args = argv[:argv.index("--")] if "--" in argv else argv
    if "--json" in args or "--format=json" in args:
        return True
    return any(a == "--format" and b == "json" for a, b in itertools.pairwise(args))


# -- serve flags that do not reach the scheduler ----------------------------------------------

# flag -> takes a value. These shape the GPU side of `vllm serve` (memory, parallelism, the
# HTTP server, the weights); kvdoctor's run is the scheduler with a given block pool, so
# they are accepted (an operator pastes a whole command line) and named as having no effect.
NO_EFFECT_SERVE_FLAGS: dict[str, bool] = {
    "--gpu-memory-utilization": True, "--tensor-parallel-size": True, "-tp": True,
    "--pipeline-parallel-size": True, "-pp": True, "--data-parallel-size": True, "-dp": True,
    "--kv-cache-memory-bytes": True, "--swap-space": True, "--cpu-offload-gb": True,
    "--dtype": True, "--kv-cache-dtype": True, "--quantization": True, "-q": True, "--seed": True,
    "--served-model-name": True, "--host": True, "--port": True, "--uvicorn-log-level": True,
    "--download-dir": True, "--load-format": True, "--tokenizer": True, "--max-logprobs": True,
    "--distributed-executor-backend": True, "--compilation-config": True, "-O": True,
    "--enforce-eager": False, "--trust-remote-code": False, "--disable-log-requests": False,
    "--enable-log-requests": False, "--disable-log-stats": False, "--disable-custom-all-reduce": False,
}
_RUN_COMMANDS = ("repro", "inspect", "audit")


def accept_serve_flags(argv: list[str]) -> list[str]:
    """Drop the no-effect serve flags from a `repro`/`inspect`/`audit` command line, one note each."""
    from kvdoctor.cli.streams import note

    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in _RUN_COMMANDS:
        return argv
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in NO_EFFECT_SERVE_FLAGS and arg != "--":
            takes_value = NO_EFFECT_SERVE_FLAGS[name]
            skip = 2 if takes_value and "=" not in arg and i + 1 < len(argv) else 1
            note(f"kvdoctor: note: {name} does not change the run (it does not reach the scheduler "
                 f"and its connector); ignored")
            i += skip
            continue
        if arg == "--":
            kept.extend(argv[i:])
            break
        kept.append(arg)
        i += 1
    return kept
