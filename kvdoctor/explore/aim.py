"""The hunt's aim, from explore's public flags: `--target EXC:FUNCTION`, `--force FEATURE`, `--exclude-trigger`.

`--force layout=NAME` (repeatable) draws only the named KV layouts (a shipped one, `kvdoctor/models/`, or
`default`: one full-attention group), whatever explore's random draw favours; the search keeps those the
installed vLLM plans (`explore.search.available_layouts`, a probe).

Checked before vLLM is imported (a bad value is a usage error, one line); the result is the
`ExploreConfig` fields `target`, `force` and `exclude_triggers` (see `explore.search`).
"""

from __future__ import annotations

import re
from typing import Any

from kvdoctor.errors import UsageError

# kept in step with explore.search.FORCEABLE (which names the draws; importing it here would import hypothesis)
FORCE_NAMES = ("speculative", "fs-tier", "workers", "withheld-hashes", "pd-decode", "sleep-wake")
# Forced features that cannot be drawn together, and why (one line, exit 2)
EXCLUSIVE = {
    ("sleep-wake", "withheld-hashes"): "sleep/wake examples play at --engine core, where vLLM's engine computes "
                                       "block hashes itself (none can be withheld)",
}
LAYOUT_PREFIX = "layout="  # `--force layout=NAME`: kept in the force set as "layout=NAME"
DEFAULT_LAYOUT_NAME = "default"  # one full-attention group (no shipped layout)
_NAME = re.compile(r"^[A-Za-z_][\w.]*$")


def layout_names() -> tuple[str, ...]:
    """The layouts `--force layout=NAME` takes: `default` and the shipped ones (no vLLM import)."""
    from kvdoctor.engine.kv_layout import shipped_layouts

    return (DEFAULT_LAYOUT_NAME, *shipped_layouts())


def forced_layouts(force: frozenset[str] | set[str]) -> tuple[str | None, ...]:
    """The layouts a force set names, in a stable order (None: `default`, one full-attention group)."""
    names = sorted(n.removeprefix(LAYOUT_PREFIX) for n in force if n.startswith(LAYOUT_PREFIX))
    return tuple(None if n == DEFAULT_LAYOUT_NAME else n for n in names)


def parse_aim(target: str | None, force: list[str], exclude: str | None) -> dict[str, Any]:
    aim: dict[str, Any] = {}
    if target is not None:
        exception, sep, function = target.partition(":")
        if not sep or not _NAME.match(exception) or (function and not _NAME.match(function)):
            raise UsageError(f"--target must be EXCEPTION:FUNCTION (e.g. AssertionError:_build_store_jobs), got "
                             f"{target[:80]!r}")
        aim["target"] = (exception.rsplit(".", 1)[-1], function)
    names = [n.strip() for item in force for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORCE_NAMES and not n.startswith(LAYOUT_PREFIX)]
    if unknown:
        raise UsageError(f"--force: unknown feature {unknown[0][:40]!r}; one of {', '.join(FORCE_NAMES)}, "
                         f"{LAYOUT_PREFIX}NAME")
    layouts = layout_names()
    bad = [n for n in names if n.startswith(LAYOUT_PREFIX) and n.removeprefix(LAYOUT_PREFIX) not in layouts]
    if bad:
        raise UsageError(f"--force: unknown layout {bad[0].removeprefix(LAYOUT_PREFIX)[:40]!r}; one of "
                         f"{', '.join(layouts)}")
    for (first, second), why in EXCLUSIVE.items():
        if first in names and second in names:
            raise UsageError(f"--force {first} and {second} cannot be forced together: {why}")
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
