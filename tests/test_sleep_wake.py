"""vLLM's sleep mode through its EngineCore (`sleep` / `wake_up` steps, `--engine core`): what the engine does to the
scheduler, the connector and kvdoctor's stand-in executor, on the installed release; the scheduler level refuses the
steps by their need (exit 6). One EngineCore per test, the shipped recipe played once a level."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import UsageError
from kvdoctor.observe.verdict import Outcome

RECIPE = Path(__file__).parent / "data" / "sleep-wake-mamba-offload.toml"


def _harness(api):
    from kvdoctor.engine.core.harness import CoreHarness
    from kvdoctor.engine.setup import Setup

    return CoreHarness(api, Setup(block_size=4, gpu_blocks=16, max_model_len=60, worker="simulated"))


def test_sleep_pauses_resets_and_puts_the_executor_to_sleep_until_wake_up(api):
    """Level 1, mode keep: the engine sleeps (EngineCore.is_sleeping), kvdoctor's executor records what a worker
    releases, a request added while asleep gets nothing; a partial wake (weights only) keeps the scheduler paused;
    the full wake resumes it: the kept request A is recomputed (its blocks were reset with the prefix cache) and B,
    A's prompt + 2 tokens, hits nothing from the CPU tier (the connector's cache was reset)."""
    harness = _harness(api)
    try:
        harness.add("A", list(range(10, 34)), 8)
        assert harness.step().scheduled_tokens == {"A": 24}
        harness.step()
        harness.sleep(1, "keep", None)
        assert harness.core.is_sleeping() and harness.executor.asleep == {"weights", "kv_cache"}
        harness.add("B", [*range(10, 34), 99, 98], 4)
        assert harness.step().scheduled_tokens == {}
        harness.wake_up(["weights"])
        assert harness.core.is_sleeping() and harness.executor.asleep == {"kv_cache"}
        assert harness.step().scheduled_tokens == {}
        harness.wake_up(None)
        assert not harness.core.is_sleeping() and not harness.executor.asleep
        woken = harness.step().scheduled_tokens
        assert woken.get("A") == 26 and woken.get("B", 0) <= 2, woken  # B shares A's recomputed blocks (GPU)
    finally:
        harness.shutdown()


def test_reset_connector_false_keeps_the_cpu_tier_where_the_release_takes_it(api):
    """0.34's EngineCore.sleep takes reset_connector (a signature probe): false keeps the connector's cache, so a
    request repeating A's prompt after the wake loads it from the CPU tier (2 tokens computed, not 26). A release
    whose sleep always resets it refuses the field in one line."""
    from kvdoctor.engine.core.harness import sleep_arguments

    if not api.engine_sleep_takes_reset_connector():
        with pytest.raises(UsageError, match="takes no reset_connector"):
            sleep_arguments(api, False)
        pytest.skip("this vLLM's EngineCore.sleep takes no reset_connector (measured: 0.26.0)")
    harness = _harness(api)
    try:
        harness.add("A", list(range(10, 34)), 2)
        for _ in range(3):
            harness.step()
        harness.sleep(1, "abort", False)
        harness.wake_up(None)
        harness.add("B", [*range(10, 34), 99, 98], 4)
        scheduled = [harness.step().scheduled_tokens.get("B", 0) for _ in range(3)]
        assert 2 in scheduled and 26 not in scheduled, scheduled
    finally:
        harness.shutdown()


def test_the_recipe_plays_at_the_engine_level_and_is_refused_at_the_scheduler_level():
    """Measured on 0.26.0 and 0.34.0: the recipe runs through at --engine core (no finding: held); the scheduler
    level cannot play `sleep` / `wake_up` and says to play it with --engine core (not_applicable, exit 6)."""
    core = application.repro(str(RECIPE), Overrides(engine="core"), "installed").results[0]
    assert core.outcome is Outcome.NOT_REPRODUCED and core.failure is None, core.detail
    scheduler = application.repro(str(RECIPE), Overrides(), "installed").results[0]
    assert scheduler.outcome is Outcome.NOT_APPLICABLE and "play it with --engine core" in scheduler.detail
    assert "`sleep`" in scheduler.detail and "`wake_up`" in scheduler.detail, scheduler.detail
