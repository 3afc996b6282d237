"""What a hunt aims at, read from a log (diagnose's reader) and the flags: the crash site, the features to force,
the known bugs whose triggers are excluded, and the features the search cannot express.

No vLLM here: a log with nothing to aim at is refused before vLLM is imported (one line, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdoctor.diagnose.kinds import ENGINE, classify
from kvdoctor.diagnose.match import MatchResult, innermost_vllm
from kvdoctor.diagnose.reader import LogSummary
from kvdoctor.diagnose.traceback import display_path
from kvdoctor.errors import UsageError
from kvdoctor.explore.aim import parse_aim

# A feature the log names (diagnose.features) -> the explore draw that expresses it (`--force` name), or None
# with how explore stands in for it, or why it cannot.
FEATURE_DRAWS: dict[str, tuple[str | None, str]] = {
    "async scheduling": (None, "every example runs under sync and async scheduling"),
    "speculative decoding": ("speculative", "speculative decoding forced (eagle or ngram drafts, kvdoctor's "
                                            "stand-in drafter)"),
    "KV tiers (TieringOffloadingSpec)": ("fs-tier", "TieringOffloadingSpec with an fs secondary tier forced"),
}
# The tiers feature forces the fs tier only where the log names a secondary tier, not the tiering spec alone
# (explore draws TieringOffloadingSpec itself where the release has it).
_SECONDARY = ("fs", "secondary", "disk", "file")
# Features explore cannot force (drawn at random, or not in its vocabulary): said with the hunt's result.
UNEXPRESSED = {
    "MultiConnector": "not forceable: explore draws MultiConnector only where the release's offloading config "
                      "reads sync_load_budget_bytes (the extension byte)",
    "P/D disaggregation": "no P/D decode stand-in (remote-prefill loads and their failures); withheld block "
                          "hashes are the nearest explore has",
    "hybrid KV layout": "not forceable: drawn at random (swa-full, mamba-hybrid, eagle-pair); no layout has a Mamba "
                        "group + attention + an MTP drafter group",
    "sleep mode": "no sleep/wake step in explore's vocabulary",
}
MTP_NOTE = "MTP: no MTP drafter of its own; speculative decoding is drawn as eagle or ngram"


@dataclass
class HuntAim:
    exception: str
    function: str
    statement: str = ""  # the crash statement when the log shows it ("": exception + function only)
    file: str = ""  # the crash frame's file as the log gives it (display form)
    line: int | None = None
    source: str = "traceback"  # traceback | fragment | --target
    force: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()  # known bugs whose triggers a route must not go through
    known: list[str] = field(default_factory=list)  # the known bugs diagnose matched the log to
    named: list[str] = field(default_factory=list)  # the features the log names, as shown
    expressed: list[str] = field(default_factory=list)  # how each named feature is expressed
    unexpressed: list[tuple[str, str]] = field(default_factory=list)  # (feature, why not)
    version: str | None = None  # the log's vLLM version

    @property
    def target(self) -> str:
        return f"{self.exception}:{self.function}"

    @property
    def site(self) -> str:
        where = f" ({self.file}:{self.line})" if self.file and self.line else ""
        return f"{self.exception} in {self.function}{where}" + (f": {self.statement}" if self.statement else "")

    def as_dict(self) -> dict[str, object]:
        return {"exception": self.exception, "function": self.function, "statement": self.statement or None,
                "file": self.file or None, "line": self.line, "source": self.source, "force": sorted(self.force),
                "exclude_triggers": sorted(self.exclude), "known_bugs": self.known, "features": self.named,
                "expressed": self.expressed,
                "unexpressed": [{"feature": f, "why": why} for f, why in self.unexpressed],
                "log_version": self.version}


def _statement(code: str) -> str:
    """The crash statement's most telling line (a multi-line `assert (` names nothing by itself)."""
    lines = [line.strip() for line in code.split("\n") if line.strip()]
    named = [line for line in lines if any(ch.isalpha() for ch in line.replace("assert", ""))]
    return (max(named, key=len) if len(lines) > 1 and named else lines[0] if lines else "")[:200]


def _site_from_log(summary: LogSummary) -> tuple[str, str, str, str, int | None, str] | None:
    """(exception, function, statement, file, line, source) of the log's crash, else None."""
    crash = summary.crash
    if crash is not None and not crash.native and classify(crash) is ENGINE:
        site = innermost_vllm(crash)
        if site is not None:
            statement = _statement(site.code) if site.code else ""
            exception = crash.exception or ("AssertionError" if statement.startswith("assert") else None)
            if exception:
                return (exception, site.function, statement, display_path(site.file), site.line,
                        "traceback" if not crash.cut_short else "fragment")
    loose = summary.loose
    if loose is not None and loose.frames:
        frame = loose.frames[-1]
        statement = _statement(frame.code or (loose.statements[-1].text if loose.statements else ""))
        exceptions = [e for e in loose.exceptions if not e[0].endswith(("DeadError", "GenerateError"))]
        exception = exceptions[-1][0] if exceptions else ("AssertionError" if statement.startswith("assert") else None)
        if exception:
            return exception, frame.function, statement, display_path(frame.file), frame.line, "fragment"
    return None


def aim_from_log(summary: LogSummary, match: MatchResult, target: str | None = None, force: list[str] | None = None,
                 include_known: bool = False) -> HuntAim:
    """The hunt's aim: `--target EXC:FUNCTION` over the log's own site; the features the log names and `force`
    forced; the known bugs that fail at the same site excluded unless `include_known`. A log with no crash
    site and no `--target` is a usage error (nothing to aim at)."""
    flags = parse_aim(target, force or [], None)
    found = _site_from_log(summary)
    if "target" in flags:
        exception, function = flags["target"]
        if not function:
            raise UsageError("--target must name the function too for a hunt (EXCEPTION:FUNCTION)")
        same = found is not None and found[1] == function
        aim = HuntAim(exception, function, found[2] if same and found else "", found[3] if same and found else "",
                      found[4] if same and found else None, "--target")
    elif found is not None:
        aim = HuntAim(*found)
    else:
        raise UsageError(f"{summary.source}: no crash site to hunt for (no exception with a vLLM function in the "
                         f"log): name one with --target EXCEPTION:FUNCTION")
    aim.version = summary.version
    aim.known = list(match.best_bugs) if match.candidates else []
    forced = set(flags.get("force", frozenset()))
    for name, named in summary.features.items():
        shown = name + (f" ({named.detail})" if named.detail else "")
        aim.named.append(shown)
        draw = FEATURE_DRAWS.get(name)
        if name.startswith("KV tiers") and not any(w in named.evidence.lower() for w in _SECONDARY):
            draw = (None, "TieringOffloadingSpec drawn at random (no secondary tier named: the fs tier not forced)")
        if draw is not None:
            if draw[0]:
                forced.add(draw[0])
            aim.expressed.append(f"{shown}: {draw[1]}")
        elif name in UNEXPRESSED:
            aim.unexpressed.append((shown, UNEXPRESSED[name]))
        if name == "speculative decoding" and "mtp" in named.detail.lower():
            aim.unexpressed.append(("MTP", MTP_NOTE))
    aim.force = frozenset(forced)
    if not include_known:
        from kvdoctor.recipes.builtins import all_builtins

        aim.exclude = frozenset(r.bug for r in all_builtins() if r.bug and r.signature.exception == aim.exception
                                and aim.function in r.signature.functions())
    return aim
