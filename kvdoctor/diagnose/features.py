"""What a log says about the deployment beyond its serve arguments: a header's vLLM version and the features
its text names.

A pasted log often starts with the reporter's own header (`# vLLM 0.26.0 ... version: 0.26.0`) or vLLM's
`collect_env` output (`vLLM Version: 0.26.0`) instead of the server's banner. The features a crash may
depend on (async scheduling, speculative decoding and its method, KV tiers, MultiConnector, a P/D role,
a hybrid layout, sleep mode) are named in the engine's config dump, the args line, the command line or
the reporter's prose; each is kept once, with the line that named it, so `diagnose` can show them and a
hunt can aim at them. Matching is a plain substring test first, a regex only on lines that pass it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = r"v?(\d+\.\d+\.\d+(?:[.+\-][\w.+\-]*)?)"
_HEADER_VERSIONS = (
    re.compile(r"^\s*#.*?\bversion\b\s*[:=]?\s*" + _VERSION, re.IGNORECASE),  # `# ... version: 0.26.0`
    re.compile(r"\bvLLM [Vv]ersion\s*[:=]\s*" + _VERSION),  # collect_env's `vLLM Version: 0.26.0`
)


def header_version(body: str) -> str | None:
    """The vLLM version a header or environment line states, else None."""
    for pattern in _HEADER_VERSIONS:
        match = pattern.search(body)
        if match:
            return match.group(1).rstrip(".")
    return None


@dataclass(frozen=True)
class Feature:
    name: str  # "async scheduling"
    needles: tuple[str, ...]  # plain substrings a line must hold before the pattern is tried
    pattern: re.Pattern[str]
    detail_group: str | None = None  # a group whose text is shown with the name (the speculative method)


FEATURES = (
    Feature("async scheduling", ("async_scheduling", "async-scheduling", "synchronous scheduling"),
            re.compile(r"async[_-]scheduling['\"]?\s*(?:[:=]\s*True\b|(?=\s|$))|--async-scheduling\b|"
                       r"Asynchronous scheduling is enabled")),
    Feature("speculative decoding", ("peculative", "mtp", "MTP", "eagle", "EAGLE"),
            re.compile(r"method['\"]?\s*[:=]\s*['\"]?(?P<method>[\w.\-]*(?:mtp|eagle3?|ngram|medusa|suffix)"
                       r"[\w.\-]*)|speculative[_-]config['\"]?\s*[:=]\s*(?!None)|--speculative[-_]config|"
                       r"num_speculative_tokens|\b(?P<mtp>MTP)\b|\b(?P<kernel>eagle\w*_kernel)\b|EagleProposer",
                       re.IGNORECASE), "method"),
    Feature("KV tiers (TieringOffloadingSpec)", ("Tiering", "secondary_tiers", "fs_python", "tier"),
            re.compile(r"TieringOffloadingSpec|secondary_tiers|fs_python|\b(?:fs|disk|file|secondary)[ _-]tier",
                       re.IGNORECASE)),
    Feature("MultiConnector", ("MultiConnector",), re.compile(r"MultiConnector")),
    Feature("P/D disaggregation", ("kv_producer", "kv_consumer", "NixlConnector", "P2pNccl", "Mooncake",
                                   "decode node", "prefill node"),
            re.compile(r"kv_role['\"]?\s*[:=]\s*['\"]?(?P<role>kv_producer|kv_consumer)|NixlConnector|"
                       r"P2pNcclConnector|MooncakeConnector|\b(?P<node>decode|prefill) node\b"), "role"),
    Feature("hybrid KV layout", ("amba", "sliding_window", "SlidingWindow", "HybridKVCache", "hybrid"),
            re.compile(r"\bMamba\w*|mamba_\w+|sliding_window['\"]?\s*[:=]\s*\d|SlidingWindowSpec|"
                       r"HybridKVCacheCoordinator|\bhybrid\b", re.IGNORECASE)),
    Feature("sleep mode", ("sleep", "wake_up"),
            re.compile(r"enable[_-]sleep[_-]mode['\"]?\s*(?:[:=]\s*True\b|(?=\s|$))|/sleep\b|wake_up\(")),
)
MAX_EVIDENCE = 100


@dataclass(frozen=True)
class Named:
    feature: str
    detail: str  # e.g. the speculative method "mtp"; "" when the text names none
    evidence: str  # the matched text with a little context
    line: int


def features_in(body: str, number: int, found: dict[str, Named]) -> None:
    """Add to `found` each feature this line names that is not there yet."""
    for feature in FEATURES:
        if feature.name in found or not any(needle in body for needle in feature.needles):
            continue
        match = feature.pattern.search(body)
        if match is None:
            continue
        detail = ""
        if feature.detail_group:  # the named group's text, else any other named group's (prose `MTP`)
            groups = match.groupdict()
            detail = groups.get(feature.detail_group) or next((v for v in groups.values() if v), "") or ""
        start = max(0, match.start() - 20)
        evidence = " ".join(body[start:match.end() + 20].split())[:MAX_EVIDENCE]
        found[feature.name] = Named(feature.name, detail, evidence, number)
