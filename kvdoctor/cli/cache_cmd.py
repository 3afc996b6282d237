"""`kvdoctor cache`: where kvdoctor's cache directory is and how big, or `--clear` it (the logic:
`kvdoctor.user_cache`)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli.common import run


def cache(
    clear: Annotated[bool, typer.Option("--clear", help="Remove kvdoctor's cache (the next run rebuilds it: "
                                                        "one more vLLM import).")] = False,
    json_out: opt.Json = False,
) -> None:
    """Show where kvdoctor keeps vLLM's model-info cache (and compiled bytecode) between runs, and how big it is.

    The directory is $KVDOCTOR_CACHE_DIR, else $XDG_CACHE_HOME/kvdoctor, else ~/.cache/kvdoctor; never the
    user's ~/.cache/vllm. Nothing else kvdoctor writes outlives a run."""

    def action() -> int:
        from kvdoctor.cli.streams import write_document, write_stdout
        from kvdoctor.user_cache import cache_usage

        usage = cache_usage(clear=clear)
        if json_out:
            from kvdoctor.report.json_doc import SCHEMA_VERSION, dumps

            write_document(dumps({"schema_version": SCHEMA_VERSION, "cache": usage.as_dict()}))
        else:
            from kvdoctor.report.cache import cache_text

            write_stdout(cache_text(usage) + "\n")
        return 0

    run(action, json_out)
