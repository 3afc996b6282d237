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
from kvdoctor.explore.aim import LAYOUT_PREFIX, forced_layouts, parse_aim

# A feature the log names (diagnose.features) -> the explore draw that expresses it (`--force` name), or None
# with how explore stands in for it, or why it cannot.
FEATURE_DRAWS: dict[str, tuple[str | None, str]] = {
    "async scheduling": (None, "every example runs under sync and async scheduling"),
    "speculative decoding": ("speculative", "speculative decoding forced (eagle or ngram drafts, kvdoctor's "
                                            "stand-in drafter)"),
    "KV tiers (TieringOffloadingSpec)": ("fs-tier", "TieringOffloadingSpec with an fs secondary tier forced"),
    "P/D disaggregation": ("pd-decode", "a P/D decode node forced: vLLM's MultiConnector with kvdoctor's NIXL "
                                        "stand-in first, every other request a remote prefill, every fourth's load "
                                        "failing"),
    "MultiConnector": ("pd-decode", "MultiConnector forced as a P/D decode node's (kvdoctor's NIXL stand-in + "
                                    "vLLM's OffloadingConnector)"),
    "sleep mode": ("sleep-wake", "sleep/wake forced: vLLM's EngineCore.sleep (level 1 or 2, keep or abort, the "
                                 "connector's cache kept where the release takes it) and wake_up drawn, those "
                                 "examples played at --engine core"),
}
SLEEP = "sleep-wake"
# The tiers feature forces the fs tier only where the log names a secondary tier, not the tiering spec alone
# (explore draws TieringOffloadingSpec itself where the release has it).
_SECONDARY = ("fs", "secondary", "disk", "file")
# Features explore cannot force (drawn at random, or not in its vocabulary): said with the hunt's result.
UNEXPRESSED = {
    "hybrid KV layout": "no layout named or implied that kvdoctor ships (drawn at random: swa-full, mamba-hybrid, "
                        "eagle-pair)",
}
MTP_NOTE = "MTP: no MTP drafter of its own; speculative decoding is drawn as eagle or ngram"
MTP_LAYOUT = "mamba-mtp-hybrid"  # Mamba + attention + an MTP drafter group (its Mamba spec's speculative blocks)

# The KV layouts a log names or implies (`--force layout=NAME`, kvdoctor/models/): words of the log (a model's
# name, its config, vLLM's spec classes) and of the crash statement -> the kinds of KV group it shows.
_MAMBA_WORDS = ("mamba", "nemotron_h", "nemotron-h", "nemotronh", "qwen3-next", "qwen3_next", "qwen3next", "jamba",
                "granitemoehybrid", "granite-4", "falcon-h1", "falconh1", "sambay", "phi-4-mini-flash", "phi4flash",
                "bamba", "mamba_cache_mode", "linear_attention")
_SLIDING_WORDS = ("sliding_window", "slidingwindow", "sliding window", "sliding-window", "gpt-oss", "gpt_oss",
                  "gemma", "sambay", "phi-4-mini-flash", "phi4flash", "local_attention", "swa_", "_swa", " swa ")
# mixed block sizes (the sliding-window group's block grown to the full one's page): Gemma 4, DeepSeek V4; the
# sliding-window alignment branch of _build_store_jobs (alignment_chunk_count, read in the statement) runs only there
_MIXED_WORDS = ("gemma4", "gemma-4", "gemma_4", "deepseek-v4", "deepseek_v4", "deepseekv4", "global_head_dim",
                "alignment_chunk")
# the full-attention chunk longer than the sliding-window one (DeepSeek V4; the alignment branch of
# _build_store_jobs runs only there: vLLM sets alignment_chunk_count where the full chunk spans several)
_ALIGNED_WORDS = ("deepseek-v4", "deepseek_v4", "deepseekv4", "alignment_chunk")
_HYBRID_WORDS = ("hybridkvcache", "hybrid")
WITHHELD = "withheld-hashes"  # `--force withheld-hashes`: every request's block hashes arrive late
WITHHELD_BUGS = ("K6",)  # the known bug whose trigger withheld hashes are (its route is excluded unless known)
MAX_SCAN_BYTES = 32 << 20  # the log text scanned for layout words (a log larger than this: its start)


def implied_layouts(text: str, statement: str = "") -> tuple[tuple[str, ...], str]:
    """The shipped layouts that can reach a crash whose log (`text`) and statement name these KV groups, and why
    (() and "": nothing named; the layout is drawn at random). Mamba and a sliding window: mamba-swa-hybrid;
    Mamba alone: mamba-hybrid, mamba-swa-hybrid; a sliding window: swa-full, swa-full-mixed, mamba-swa-hybrid
    (swa-full-mixed alone where mixed block sizes or the alignment branch are named); "hybrid" alone: all four."""
    lowered, where = text.lower(), statement.lower()
    mamba = any(word in lowered or word in where for word in _MAMBA_WORDS)
    sliding = any(word in lowered or word in where for word in _SLIDING_WORDS)
    mixed = any(word in lowered or word in where for word in _MIXED_WORDS) or "alignment" in where
    aligned = any(word in lowered or word in where for word in _ALIGNED_WORDS) or "alignment" in where
    if mamba and sliding:
        return ("mamba-swa-hybrid",), "Mamba and sliding-window groups named"
    if mamba:
        return ("mamba-hybrid", "mamba-swa-hybrid"), "a Mamba group named"
    if aligned:
        return ("full-swa-mixed",), ("full-attention chunks spanning several sliding-window chunks named (vLLM's "
                                     "alignment segments)")
    if mixed:
        return ("swa-full-mixed",), "sliding-window and full-attention groups of mixed block sizes named"
    if sliding:
        return ("swa-full", "swa-full-mixed", "mamba-swa-hybrid"), "a sliding-window group named"
    if any(word in lowered for word in _HYBRID_WORDS):
        return ("swa-full", "swa-full-mixed", "mamba-hybrid", "mamba-swa-hybrid"), "a hybrid KV cache named"
    return (), ""


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
                 include_known: bool = False, text: str = "") -> HuntAim:
    """The hunt's aim: `--target EXC:FUNCTION` over the log's own site; the features the log names and `force`
    forced; the layouts the log's `text` (and the crash statement) name or imply forced (`implied_layouts`) unless
    `force` names a layout; the known bugs that fail at the same site excluded unless `include_known`. A log
    with no crash site and no `--target` is a usage error (nothing to aim at)."""
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
    model = str(summary.serve_args.get("model") or "")
    hints = " ".join((text, model, *(f"{n.evidence}" for n in summary.features.values())))
    layouts, why = implied_layouts(hints, aim.statement)
    if "mamba-hybrid" in layouts and any(f == "MTP" for f, _ in aim.unexpressed):
        # a Mamba hybrid served with MTP plans the drafter's group beside its own (Qwen3-Next + MTP)
        layouts = (MTP_LAYOUT, *(layout for layout in layouts if layout != "mamba-hybrid"))
        why += " with MTP"
    if layouts and not forced_layouts(forced):
        forced |= {LAYOUT_PREFIX + layout for layout in layouts}
        aim.expressed.append(f"KV layout ({why}): forced to {', '.join(layouts)}")
        aim.unexpressed = [(f, why_not) for f, why_not in aim.unexpressed if not f.startswith("hybrid KV layout")]
    if not include_known:
        from kvdoctor.recipes.builtins import all_builtins

        aim.exclude = frozenset(r.bug for r in all_builtins() if r.bug and r.signature.exception == aim.exception
                                and aim.function in r.signature.functions())
    if keys_lag_tokens(aim.statement):
        if SLEEP in forced:
            aim.unexpressed.append(("offload keys lagging tokens", "withheld block hashes not forced: sleep/wake "
                                    "examples play at --engine core, where vLLM's engine hashes blocks itself"))
        elif any(bug in aim.exclude for bug in WITHHELD_BUGS):
            aim.unexpressed.append(("offload keys lagging tokens", "withheld block hashes not forced: their route "
                                    "is a known bug's trigger here (excluded; --include-known counts it)"))
        else:
            forced.add(WITHHELD)
            aim.expressed.append("offload keys lagging tokens (the crash statement compares offload keys with the "
                                 "request's tokens): withheld block hashes forced on every request")
    aim.force = frozenset(forced)
    return aim


def keys_lag_tokens(statement: str) -> bool:
    """Whether a crash statement compares a request's offload keys with its tokens (not with its blocks): keys
    that lag the tokens (block hashes that arrive late) are what can break it."""
    return "offload_keys" in statement and ("num_tokens" in statement or "num_keyed_tokens" in statement)

