"""The offloading connector's metrics, read each step the way vLLM's stats logger and Prometheus read them.

After a step, the connector's stats (`OffloadingConnectorScheduler.get_stats`, what vLLM's scheduler
collects in `update_from_output`) go through vLLM's own `reduce()` (the logged summary) and its own
`OffloadPromMetrics.observe` (the Prometheus side), into stand-in metric classes that record what they
are given instead of registering series in the process' Prometheus registry (`RecordedMetric`: the
`metric_types` vLLM's `build_prom_metrics` takes for exactly this). `check_step` says what is wrong:

- a gauge out of range: a usage fraction (`*_perc`) outside [0, 1], any other gauge negative or not finite;
  a counter increased by a negative amount (prometheus_client refuses it); a negative histogram sample;
  `reduce()` or `observe` raising;
- an idle gauge not at zero: once the engine is idle (no request left in the scheduler, no transfer in
  flight), the gauges that count work in flight (`IDLE_GAUGE_MARKS`: usage, active jobs, deferred
  releases) read zero; a chunk still pinned with nothing running shows here.

The stats are read after vLLM read them in the step (its gauges are snapshots of the state then; counters
and histograms are what accumulated since, usually nothing). Reading drains only metric batches, no
scheduling state.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

# A gauge named with one of these counts work in flight: zero once the engine is idle.
IDLE_GAUGE_MARKS = ("usage_perc", "_active_", "deferred_release")
PERCENT_SUFFIX = "_perc"  # a fraction in [0, 1] (vLLM's usage gauges)


@dataclass
class RecordedMetric:
    """A stand-in for prometheus_client's Gauge / Counter / Histogram (one class, its `kind` set by the
    subclass): `labels(...)` gives a series that records `set` / `inc` / `observe` into `values`."""

    name: str
    documentation: str = ""
    labelnames: Any = ()
    kind: str = "gauge"
    values: dict[tuple[str, ...], Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __init__(self, name: str, documentation: str = "", labelnames: Any = (), **_: Any) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames or ())
        self.values, self.errors = {}, []

    def labels(self, *labelvalues: Any) -> _Series:
        if len(labelvalues) != len(self.labelnames):  # prometheus_client raises ValueError
            raise ValueError(f"{self.name}: {len(labelvalues)} label values for labels {self.labelnames}")
        return _Series(self, tuple(str(v) for v in labelvalues))


class RecordedGauge(RecordedMetric):
    kind = "gauge"


class RecordedCounter(RecordedMetric):
    kind = "counter"


class RecordedHistogram(RecordedMetric):
    kind = "histogram"


class _Series:
    def __init__(self, metric: RecordedMetric, labels: tuple[str, ...]) -> None:
        self.metric, self.labels = metric, labels

    def set(self, value: float) -> None:
        self.metric.values[self.labels] = value

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # prometheus_client: "Counters can only be incremented by non-negative amounts."
            self.metric.errors.append(f"counter {self.metric.name} increased by {amount}")
        self.metric.values[self.labels] = self.metric.values.get(self.labels, 0) + amount

    def observe(self, value: float) -> None:
        self.metric.values.setdefault(self.labels, []).append(value)


@dataclass
class _Reader:
    prom: Any  # vLLM's OffloadPromMetrics over the recorded stand-ins (None: not built for this setup)
    metrics: list[RecordedMetric] = field(default_factory=list)  # the stand-ins vLLM made
    why_not: str = ""


_READERS: weakref.WeakKeyDictionary[Any, _Reader] = weakref.WeakKeyDictionary()


def _reader(harness: Any) -> _Reader:
    """vLLM's Prometheus side for this harness' connector, built once per harness."""
    reader = _READERS.get(harness)
    if reader is not None:
        return reader
    made: list[RecordedMetric] = []

    def maker(cls: type[RecordedMetric]) -> Any:
        def make(*args: Any, **kwargs: Any) -> RecordedMetric:
            metric = cls(*args, **kwargs)
            made.append(metric)
            return metric
        return make

    try:
        prom = harness.api.offloading_prom_metrics(
            harness.scheduler, maker(RecordedGauge), maker(RecordedCounter), maker(RecordedHistogram))
        reader = _Reader(prom, made, "" if prom is not None else "no Prometheus side for this connector")
    except Exception as exc:  # vLLM could not build it for this setup: reported with the step's checks
        reader = _Reader(None, made, f"building the connector's Prometheus metrics raised {type(exc).__name__}: {exc}")
    _READERS[harness] = reader
    return reader


def _gauge_messages(name: str, value: Any, idle: bool) -> list[str]:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return [f"gauge {name} = {value!r}: not a finite number"]
    if name.endswith(PERCENT_SUFFIX) and not 0.0 <= value <= 1.0:
        return [f"gauge {name} = {value:g}: a usage fraction outside [0, 1]"]
    if value < 0:
        return [f"gauge {name} = {value:g}: negative"]
    if idle and value != 0 and any(mark in name for mark in IDLE_GAUGE_MARKS):
        return [f"gauge {name} = {value:g} with the engine idle (no request, no transfer in flight): expected 0"]
    return []


def engine_idle(harness: Any) -> bool:
    """No request left in vLLM's scheduler and no transfer job in flight: the worker's, the connector's, and
    a tiering manager's secondary-tier promotions and cascades (a cascade pins its CPU chunk while it writes);
    and the connector itself says the engine may stop stepping (a tier's deferred release still pending keeps
    vLLM's engine stepping, so its pinned chunk is work in flight, not a leak)."""
    if harness.scheduler.requests or harness.worker.in_flight:
        return False
    cs, api = harness.connector_scheduler, harness.api
    if cs is None:
        return True
    if api.jobs(cs) or api.connector_keeps_stepping(cs):
        return False
    tiering = api.tiering_manager_of(cs)
    return tiering is None or not api.tier_jobs(tiering)


def check_step(harness: Any, idle_only: bool = False) -> list[str]:
    """What is wrong with the connector's metrics after this step (see the module docstring); `idle_only`:
    only the idle-gauge check (its own invariant)."""
    cs = getattr(harness, "connector_scheduler", None) if harness is not None else None
    if cs is None:
        return []
    idle = idle_only and engine_idle(harness)  # the idle gauges are the other invariant's
    if idle_only and not idle:
        return []
    stats = harness.api.offloading_stats(cs)
    if stats is None:
        return []
    messages: list[str] = []
    try:
        reduced = stats.reduce()
    except Exception as exc:
        return [f"the connector's stats reduce() raised {type(exc).__name__}: {exc}"]
    types, values = harness.api.offloading_stats_sections(stats)
    for name, series in values.items():
        kind = types.get(name)
        for labels, value in series.items():
            shown = f"{name}{'{' + ','.join(map(str, labels)) + '}' if labels else ''}"
            if kind == "gauge":
                messages += _gauge_messages(shown, value, idle)
            elif not idle_only and kind == "counter" and isinstance(value, int | float) and value < 0:
                messages.append(f"counter {shown} increased by {value:g}")
            elif not idle_only and kind == "histogram" and any(v < 0 for v in value):
                messages.append(f"histogram {shown} observed a negative sample ({min(value):g})")
    if idle_only:
        return messages
    for key, value in reduced.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            messages.append(f"reduce() gave {key} = {value!r}: not a finite number")
    reader = _reader(harness)
    if reader.prom is None:
        return messages + ([reader.why_not] if reader.why_not.startswith("building") else [])
    try:
        reader.prom.observe(stats.data)
    except Exception as exc:
        messages.append(f"the connector's Prometheus observe raised {type(exc).__name__}: {exc}")
    for metric in reader.metrics:
        messages.extend(metric.errors)
        metric.errors.clear()
    return messages
