"""The hunt's aim, from explore's public flags: `--target EXC:FUNCTION`, `--force FEATURE`, `--exclude-trigger`.

Checked before vLLM is imported (a bad value is a usage error, one line); the result is the
`ExploreConfig` fields `target`, `force` and `exclude_triggers` (see `explore.search`).
"""

from __future__ import annotations

import re
from typing import Any

from kvdoctor.errors import UsageError

# kept in step with explore.search.FORCEABLE (which names the draws; importing it here would import hypothesis)
FORCE_NAMES = ("speculative", "fs-tier", "workers")
_NAME = re.compile(r"^[A-Za-z_][\w.]*$")


def parse_aim(target: str | None, force: list[str], exclude: str | None) -> dict[str, Any]:
    aim: dict[str, Any] = {}
    if target is not None:
        exception, sep, function = target.partition(":")
        if not sep or not _NAME.match(exception) or (function and not _NAME.match(function)):
            raise UsageError(f"--target must be EXCEPTION:FUNCTION (e.g. AssertionError:_build_store_jobs), got "
                             f"{target[:80]!r}")
        aim["target"] = (exception.rsplit(".", 1)[-1], function)
    names = [n.strip() for item in force for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORCE_NAMES]
    if unknown:
        raise UsageError(f"--force: unknown feature {unknown[0][:40]!r}; one of {', '.join(FORCE_NAMES)}")
    if names:
        aim["force"] = frozenset(names)
    if exclude is not None:
        from kvdoctor.recipes.builtins import all_builtins

        bugs = {r.bug for r in all_builtins() if r.bug}
        wanted = [b.strip().upper() for b in exclude.split(",") if b.strip()]
        bad = [b for b in wanted if b not in bugs]
        if bad or not wanted:
            raise UsageError(f"--exclude-trigger: {bad[0][:20]!r} is no known bug" if bad else
                             "--exclude-trigger: name known bugs, e.g. K1,K6")
        aim["exclude_triggers"] = frozenset(wanted)
    return aim
