"""`kvdoctor version`: versions and adapter probes for a bug report (the logic: `kvdoctor.version_report`)."""

from __future__ import annotations

import typer

from kvdoctor.cli import options as opt


def version(json_out: opt.Json = False) -> None:
    """Show kvdoctor's, vLLM's, torch's and Python's versions and which of kvdoctor's vLLM probes hold.

    Paste it into a bug report, as `vllm collect-env`'s output. `--version` stays instant (kvdoctor's
    version only); this command imports vLLM."""

    def action() -> int:
        from kvdoctor.cli.progress import Progress
        from kvdoctor.cli.streams import current, write_document, write_stdout
        from kvdoctor.version_report import version_report

        with Progress("version", label="importing vLLM and running kvdoctor's probes"):  # ~19 s, on a terminal
            report = version_report()
        if json_out:
            from kvdoctor.report.json_doc import SCHEMA_VERSION, dumps

            write_document(dumps({"schema_version": SCHEMA_VERSION, **report.as_dict()}))
        else:
            from kvdoctor.report.version import version_text

            write_stdout(version_text(report, current().width() or 80) + "\n")
        return report.exit_code

    from kvdoctor.cli.failures import run_guarded

    raise typer.Exit(run_guarded(action, json_out))
