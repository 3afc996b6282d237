"""The K10 measurement's controls: it must measure waiting, not noise."""

from __future__ import annotations

from kvdoctor.observe.metrics import measure_prefix_sharing


def test_a_single_request_waits_no_extra_step(api):
    metric = measure_prefix_sharing(api, requests=1, latency=2)
    assert metric.extra_steps == 0
    assert metric.baseline_steps >= 2 + 1  # at least the load latency, then the prefill


def test_waiting_grows_with_load_latency(api):
    short = measure_prefix_sharing(api, requests=3, latency=1)
    long = measure_prefix_sharing(api, requests=3, latency=3)
    assert long.baseline_steps > short.baseline_steps
    assert long.extra_steps > short.extra_steps > 0
