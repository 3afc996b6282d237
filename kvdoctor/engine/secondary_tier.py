"""The tiering spec's secondary tier (`Setup.secondary_tier`), kept in a throw-away directory.

vLLM's TieringOffloadingSpec (0.26.0 onwards) cascades every chunk stored in its CPU tier to its secondary tiers and
promotes a chunk back (secondary -> CPU) when a lookup misses the CPU tier but hits one of them. Its
manager does this in the scheduler's own process (the tier's I/O threads; polled by the manager in
lookup / prepare_store / on_schedule_end), so kvdoctor runs it unchanged. Only the `fs` tier needs no
network: it writes one file per chunk under `root_dir`. kvdoctor gives it a directory of its own
per process, removed at exit, and empties it before each build: the files are named by block hash, so a
previous run's files would be hits in the next one. The tier's threads finish at their own pace; the
harness waits for them in each step's forward window (compat `settle_secondary_tiers`), so a recipe
replays the same on every run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from typing import Any

from kvdoctor.engine.tier_script import POLICIES, parse_vllm_backpressure

# Setup.secondary_tier values: vLLM's fs tier, kvdoctor's scripted tier (compat/scripted_tier.py, loaded by vLLM
# through the tier spec's `module_path`), or both at once (fs first, then scripted: vLLM cascades to every tier
# and promotes from the first that hits); vLLM's own in-memory example tier (`tiering/example/manager.py`, loaded
# through `module_path` as kvdoctor's recording subclass, compat/example_tier.py), alone or after fs. All run
# in-process on a CPU (no network).
SECONDARY_TIERS = ("fs", "scripted", "fs+scripted", "example", "fs+example")
SCRIPTED_MODULE = "kvdoctor.engine.compat.scripted_tier"
VLLM_BACKPRESSURE_MODULE = "kvdoctor.engine.compat.vllm_backpressure"
EXAMPLE_TIER = {"type": "RecordedExampleTier", "module_path": "kvdoctor.engine.compat.example_tier"}
SCRIPTED_CLASS = "ScriptedSecondaryTier"  # vLLM's factory reads the class named by `type` from `module_path`

_directory: str | None = None


def tier_directory() -> str:
    """This process's fs-tier root (created on first use, removed at exit)."""
    global _directory
    if _directory is None or not os.path.isdir(_directory):
        _directory = tempfile.mkdtemp(prefix="kvdoctor-fs-tier-")
        atexit.register(shutil.rmtree, _directory, ignore_errors=True)
    return _directory


def tier_config(tier_type: str) -> dict[str, Any]:
    """The `secondary_tiers` entry vLLM's tiering spec reads for `tier_type`. One read and one write
    thread: the machine is small and the files are a few KiB."""
    return {"type": tier_type, "root_dir": tier_directory(), "n_read_threads": 1, "n_write_threads": 1}


def tier_configs(secondary_tier: str, tier_script: str | None = None,
                 backpressure_pattern: str | None = None) -> list[dict[str, Any]]:
    """The `secondary_tiers` list for a `Setup.secondary_tier` value. The scripted tier gets its job
    script and, with a backpressure pattern, vLLM's `backpressure` dict naming kvdoctor's scripted
    detector and policy, or (pattern "vllm[:...]") vLLM's own EMA detector and policy with their parameters and
    the tier's step clock (`step_s`) (vLLM's factory imports them by their dotted names)."""
    configs: list[dict[str, Any]] = []
    for kind in secondary_tier.split("+"):
        if kind == "example":
            configs.append(dict(EXAMPLE_TIER))
            continue
        if kind != "scripted":
            configs.append(tier_config(kind))
            continue
        scripted: dict[str, Any] = {"type": SCRIPTED_CLASS, "module_path": SCRIPTED_MODULE,
                                    "script": tier_script or ""}
        vllm = parse_vllm_backpressure(backpressure_pattern) if backpressure_pattern else None
        if vllm is not None:  # vLLM's own detector and policy, recorded, on the tier's step clock
            scripted["step_s"] = vllm.step_s
            scripted["backpressure"] = {"backpressure_cls": f"{VLLM_BACKPRESSURE_MODULE}.RecordedEMADetector",
                                        "policy_cls": f"{VLLM_BACKPRESSURE_MODULE}.{POLICIES[vllm.policy]}",
                                        **vllm.detector_kwargs()}
        elif backpressure_pattern:
            scripted["backpressure"] = {"backpressure_cls": f"{SCRIPTED_MODULE}.ScriptedDetector",
                                        "policy_cls": f"{SCRIPTED_MODULE}.ScriptedPolicy",
                                        "pattern": backpressure_pattern}
        configs.append(scripted)
    return configs


def empty_tier_directory() -> None:
    """Remove every chunk file a previous build of this process left (before a new scheduler is built)."""
    if _directory is None or not os.path.isdir(_directory):
        return
    for entry in os.scandir(_directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
