"""Measured metrics for performance bugs, on the real scheduler.

K10 (vLLM issue #44294): while one request loads a prefix from the offload
tier, every request overlapping that prefix gets `(None, False)` from
`get_num_new_matched_tokens` and waits, even when it has more of its own
prompt offloaded and could start its own load. Measured as engine steps until
every one of N concurrent requests has its first token, against a baseline of
N requests with disjoint prefixes and the same offloaded lengths.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdoctor.engine.harness import Harness
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError

MAX_STEPS = 200


class MeasurementIncomplete(Exception):
    """The scheduler did not reach the state a measurement needs (reported as other_failure, never hidden)."""


@dataclass
class PrefixSharingMetric:
    requests: int
    load_latency_steps: int
    shared_steps: int  # steps until every request sharing the prefix has its first token
    baseline_steps: int  # the same with disjoint prefixes

    @property
    def extra_steps(self) -> int:
        return self.shared_steps - self.baseline_steps

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "extra_steps": self.extra_steps}


def _tokens(seed: int, length: int) -> list[int]:
    return [10 + (seed * 131 + i * 7) % 1000 for i in range(length)]


def _run_until(harness: Harness, done: Any, what: str) -> int:
    for steps in range(1, MAX_STEPS + 1):
        harness.step()
        if done():
            return steps
    raise MeasurementIncomplete(f"K10 measurement: {what} did not happen within {MAX_STEPS} steps")


def _steps_to_first_tokens(api: Any, setup: Setup, prompts: list[list[int]], seeds: list[list[int]],
                           latency: int) -> int:
    harness = Harness(api, setup)
    try:
        harness.worker.load_latency_steps = latency
        # Put every seed prompt in the CPU tier only: run them, let their stores land, empty the GPU cache.
        for i, prompt in enumerate(seeds):
            harness.add(f"seed{i}", prompt, max_tokens=1)
        def seeds_done() -> bool:
            return all(harness.requests[f"seed{i}"].is_finished() for i in range(len(seeds)))

        _run_until(harness, seeds_done, "seeding the CPU tier")
        _run_until(harness, lambda: not harness.worker.in_flight, "draining the seed stores")
        if not harness.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
            raise MeasurementIncomplete("K10 measurement: the GPU prefix cache could not be reset")
        for i, prompt in enumerate(prompts):
            harness.add(f"R{i}", prompt, max_tokens=4)
        def started() -> bool:
            return all(harness.requests[f"R{i}"].num_output_tokens >= 1 for i in range(len(prompts)))

        return _run_until(harness, started, "first tokens for every request")
    finally:
        harness.shutdown()


def measure_prefix_sharing(api: Any, requests: int = 4, latency: int = 2) -> PrefixSharingMetric:
    """Shared: R_i = P + T_i + tail, with P + T_i offloaded. Baseline: P_i + T_i + tail."""
    setup = Setup(block_size=4, blocks_per_chunk=1, gpu_blocks=256, max_num_batched_tokens=512,
                  max_model_len=512)
    prefix, own, tail = 32, 16, 8
    shared_seeds = [_tokens(0, prefix) + _tokens(100 + i, own) for i in range(requests)]
    disjoint_seeds = [_tokens(200 + i, prefix) + _tokens(100 + i, own) for i in range(requests)]

    def with_tails(seeds: list[list[int]]) -> list[list[int]]:
        return [seed + _tokens(300 + i, tail) for i, seed in enumerate(seeds)]

    shared = _steps_to_first_tokens(api, setup, with_tails(shared_seeds), shared_seeds, latency)
    baseline = _steps_to_first_tokens(api, setup, with_tails(disjoint_seeds), disjoint_seeds, latency)
    return PrefixSharingMetric(requests, latency, shared, baseline)


_MEASURED_BUGS = Path(__file__).resolve().parents[1] / "data" / "measured_bugs.toml"


@dataclass(frozen=True)
class MeasuredBug:
    """A known bug measured as a number (kvdoctor/data/measured_bugs.toml), as the recipes are data."""

    bug: str
    title: str
    refs: tuple[str, ...]
    measure: str  # this module's `measure_<measure>` takes it
    doing: str  # what the progress line says while it runs


def measured_bugs(path: Path = _MEASURED_BUGS) -> list[MeasuredBug]:
    with path.open("rb") as handle:
        entries = tomllib.load(handle)["bug"]
    bugs = [MeasuredBug(bug=e["bug"], title=e["title"], refs=tuple(e["refs"]), measure=e["measure"], doing=e["doing"])
            for e in entries]
    unknown = [bug.bug for bug in bugs if not callable(globals().get(f"measure_{bug.measure}"))]
    if unknown:
        raise InternalError(f"{path.name}: no measure_<measure> function in kvdoctor.observe.metrics for {unknown}")
    return bugs


def take_measurement(bug: MeasuredBug, api: Any) -> PrefixSharingMetric:
    """Take one measured bug's measurement (looked up by name when taken: this module's `measure_<name>`)."""
    measure: Callable[[Any], PrefixSharingMetric] = globals()[f"measure_{bug.measure}"]
    return measure(api)
