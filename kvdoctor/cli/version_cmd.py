"""`kvdoctor version`: versions and adapter probes for a bug report (the logic: `kvdoctor.version_report`)."""

from __future__ import annotations

import typer

from kvdoctor.cli import options as opt


def version(json_out: opt.Json = False, output_format: opt.Format = None) -> None:
    """Show kvdoctor's, vLLM's, torch's and Python's versions and which of kvdoctor's vLLM probes hold.

    Paste it into a bug report, as `vllm collect-env`'s output (`--format markdown`: a table). `--version`
    stays instant (kvdoctor's version only); this command imports vLLM."""

    def action() -> int:
        from kvdoctor.cli import output
        from kvdoctor.cli.progress import Progress
        from kvdoctor.cli.streams import current
        from kvdoctor.report.version import version_shown
        from kvdoctor.version_report import version_report

        fmt = opt.output_format(output_format, json_out)  # checked before vLLM is imported
        with Progress("version", label="importing vLLM and running kvdoctor's probes"):  # ~19 s, on a terminal
            report = version_report()
        output.show(version_shown(report, current().width() or 80), fmt)
        return report.exit_code

    from kvdoctor.cli.failures import run_guarded

    raise typer.Exit(run_guarded(action, opt.wants_json(output_format, json_out)))
