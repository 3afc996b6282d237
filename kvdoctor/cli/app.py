"""The `kvdoctor` command line: the Typer app, its callback and its commands, in order.

Each command lives in its own module (`*_cmd.py`) over an application function; this module
only registers them (with their examples and exit-code help, generated from `ExitStatus`)
and has `main()`. No command module imports this one. Importing it must stay cheap: vLLM
(and everything heavy) is imported only inside a command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvdoctor import __version__
from kvdoctor.cli.audit_cmd import audit
from kvdoctor.cli.cache_cmd import cache
from kvdoctor.cli.check_cmd import check
from kvdoctor.cli.diagnose_cmd import diagnose
from kvdoctor.cli.explore_cmd import explore
from kvdoctor.cli.hunt_cmd import hunt
from kvdoctor.cli.inspect_cmd import inspect
from kvdoctor.cli.matrix_cmd import matrix
from kvdoctor.cli.repro_cmd import repro
from kvdoctor.cli.shell import KvCommand, KvGroup, examples, exit_codes_text, with_exit_codes
from kvdoctor.cli.version_cmd import version
from kvdoctor.errors import ExitStatus

EXIT_CODES_HELP = exit_codes_text()

app = typer.Typer(
    name="kvdoctor",
    cls=KvGroup,
    help="Reproduce and diagnose scheduler-side bugs of vLLM's KV offloading connector, on a CPU, "
         "with the vLLM installed here.\n\n"
         "Start with `kvdoctor audit` (every known bug against this vLLM) or `kvdoctor repro --list`.\n\n"
         + EXIT_CODES_HELP,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: reflowed to the terminal, nothing cut, no markup eaten
)

# command -> (examples, what 0/1/... mean for it where ExitStatus's own words do not fit), in
# `kvdoctor --help`'s order. Every code's line is generated from ExitStatus.
COMMANDS: list[tuple[Callable[..., Any], list[str], dict[ExitStatus, str]]] = [
    (repro, ["kvdoctor repro queued-abort",
             "kvdoctor repro my-recipe.toml --logic installed --report issue.md",
             "kvdoctor repro queued-abort --kv-offloading-size 8 --tensor-parallel-size 2"], {}),
    (inspect, ["kvdoctor inspect queued-abort",
               "kvdoctor inspect queued-abort --step 6 --logic fixed"], {}),
    (audit, ["kvdoctor audit",
             "kvdoctor audit --report audit.md    # attach to an upstream issue",
             "kvdoctor audit --block-size 16 --async-scheduling    # your serve flags"], {
        ExitStatus.NOT_REPRODUCED: "no known bug reproduces under the installed logic",
        ExitStatus.REPRODUCED: "a known bug reproduces under the installed logic",
        ExitStatus.SETUP_OR_OTHER_FAILURE: "none reproduces, but a row ended other_failure or setup_error"}),
    (explore, ["kvdoctor explore --time-budget 60",
               "kvdoctor explore --logic fixed --workers 2 --out findings/"], {
        ExitStatus.NOT_REPRODUCED: "nothing found", ExitStatus.REPRODUCED: "a failure found (written under --out)",
        ExitStatus.SETUP_OR_OTHER_FAILURE: "nothing found, but a search worker failed: the search is incomplete",
        ExitStatus.INCONCLUSIVE: "no example ran within the time budget: nothing was tested"}),
    (matrix, ["kvdoctor matrix queued-abort --vllm 0.26.0..0.34.0 --bisect",
              "kvdoctor matrix --audit --vllm 0.30.0,0.34.0"], {
        ExitStatus.NOT_REPRODUCED: "nothing reproduced on any release",
        ExitStatus.REPRODUCED: "a recipe reproduced on some release",
        ExitStatus.USAGE: "usage error: bad flag or release name, release out of range, unwritable output path",
        ExitStatus.VLLM_UNAVAILABLE: "a release's environment cannot be built (no uv, the package registry "
                                     "unreachable, a failed install): the run stops there, nothing is tabulated",
        ExitStatus.SETUP_OR_OTHER_FAILURE: "nothing reproduced, but a cell ended setup_error or other_failure, "
                                           "or a release's vLLM would not import there, or its kvdoctor run "
                                           "failed"}),
    (diagnose, ["kvdoctor diagnose vllm-serve.log",
                "kubectl logs my-vllm-pod | kvdoctor diagnose - --report issue.md"], {
        ExitStatus.NOT_REPRODUCED: "not reproduced, nothing to run (--no-run) or no crash in the log",
        ExitStatus.REPRODUCED: "the best match reproduces under the installed logic"}),
    (hunt, ["kvdoctor hunt vllm-serve.log --time-budget 600",
            "kvdoctor hunt crash.txt --target AssertionError:_build_store_jobs --force speculative --force fs-tier"], {
        ExitStatus.NOT_REPRODUCED: "not found, and the search's examples reached the crash's function",
        ExitStatus.REPRODUCED: "a route to the log's crash site found (shrunk, triaged, written under --out)",
        ExitStatus.USAGE: "usage error: bad flag, unreadable log, or no crash site to aim at without --target",
        ExitStatus.INCONCLUSIVE: "not found, and no example reached the crash's function (or none ran)"}),
    (check, ["kvdoctor check --model ./Llama-3.1-8B --kv-offloading-size 64 --block-size 16",
             "kvdoctor check --kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\","
             "\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":8589934592,\"block_size\":48}}' --no-audit"], {
        ExitStatus.NOT_REPRODUCED: "vLLM starts at these flags and no known bug reproduces at them",
        ExitStatus.REPRODUCED: "vLLM starts, and a known bug reproduces at these flags"}),
    (version, ["kvdoctor version", "kvdoctor version --json"], {
        ExitStatus.NOT_REPRODUCED: "vLLM imports and every probe holds",
        ExitStatus.VLLM_UNAVAILABLE: "vLLM missing, broken on import or too old, or a probe fails (named, with "
                                     "what changed)"}),
    (cache, ["kvdoctor cache", "kvdoctor cache --clear"], {
        ExitStatus.NOT_REPRODUCED: "shown (or cleared)"}),
]


def _version_callback(value: bool) -> None:
    if value:
        from kvdoctor.cli.streams import write_stdout

        write_stdout(f"kvdoctor {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool | None, typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Show kvdoctor's version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="On kvdoctor's own failure, print the traceback "
                                                        "(also KVDOCTOR_DEBUG=1).")] = False,
) -> None:
    """kvdoctor."""
    if debug:
        from kvdoctor.cli.failures import enable_debug

        enable_debug()


for _command, _examples, _meanings in COMMANDS:
    app.command(cls=KvCommand, epilog=examples(*_examples))(with_exit_codes(_meanings)(_command))


def main() -> None:
    """The console script: caches in a scratch folder kvdoctor removes, SIGTERM answered as Ctrl-C is,
    and the prompt back as soon as the output is flushed (see `kvdoctor.cli.teardown`); in-process
    callers use `app`."""
    from kvdoctor.clean_exit import TERMINATED_EXIT, Terminated, exit_now, sigterm_arrived
    from kvdoctor.cli.streams import guard_process_streams
    from kvdoctor.cli.teardown import prepare, remove_scratch, terminated

    guard_process_streams()  # a closed stderr never changes the exit code
    try:
        prepare()
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except Terminated:  # every `finally` on the way here ran: a server stopped, temp folders removed
        code = terminated()
    except BaseException:  # not one of kvdoctor's outcomes: Python's own report, but no scratch left
        remove_scratch()
        raise
    if sigterm_arrived() and code != TERMINATED_EXIT:  # its Terminated swallowed on the way: still stopped
        code = terminated()
    exit_now(code)


if __name__ == "__main__":  # pragma: no cover
    main()
