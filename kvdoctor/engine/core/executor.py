"""`KvdoctorExecutor`: the stand-in executor (`standin_executor.StandInExecutor`) with kvdoctor's worker side.

vLLM's `EngineCore` talks to its model only through an `Executor`; vLLM resolves this class
itself from `distributed_executor_backend` ("kvdoctor.engine.core.executor.KvdoctorExecutor").
Its answers to `EngineCore` are `StandInExecutor`'s (the one definition an exported serve script
embeds too); each scheduler output goes to a *worker side*:

- in-process (`--engine core`): the `CoreHarness` that built the engine attaches its step
  function (`attach`), which runs kvdoctor's worker (simulated or `VllmWorker`), samples the
  recipe's tokens and records the step's events, exactly as the scheduler-level harness does
  between `schedule()` and `update_from_output()`;
- in a `vllm serve` child (`--engine serve`): no harness exists, so the stand-in's own stepping
  runs (a token per request past its prefill, one log line per step) and `served_side.ServedSide`
  chooses the tokens (the stand-in model's answers, EOS where the client asked) and runs the worker
  (vLLM's worker on fingerprint KV, or the simulated one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdoctor.engine.core.names import ADMISSION_ENV, PACE_STEPS_ENV, PLAN_ENV, STEP_SECONDS_ENV
from kvdoctor.engine.core.names import EXECUTOR_QUALNAME as QUALNAME
from kvdoctor.engine.core.served_side import ServedSide
from kvdoctor.engine.core.standin_executor import StandInExecutor

__all__ = ["ADMISSION_ENV", "HANDOFFS", "QUALNAME", "STEP_SECONDS_ENV", "Handoff", "KvdoctorExecutor"]


@dataclass
class Handoff:
    """What the in-process harness gives the executor vLLM builds (keyed by the VllmConfig's id).

    specs: kvdoctor's per-layer KV specs (the same `kv_layout.layer_specs` the scheduler level plans).
    admission_len: the max_model_len vLLM's start-up admission check is run with while the engine
    plans its KV cache (kvdoctor's pools are deliberately tiny; `compat._within_admission_check` does
    the same at the scheduler level), restored before the scheduler is built."""

    specs: dict[str, Any]
    admission_len: int | None = None
    step: Callable[[Any], Any] | None = None  # scheduler output -> ModelRunnerOutput


HANDOFFS: dict[int, Handoff] = {}


class KvdoctorExecutor(StandInExecutor):
    STEP_SECONDS_ENV = STEP_SECONDS_ENV
    PACE_STEPS_ENV = PACE_STEPS_ENV
    ADMISSION_ENV = ADMISSION_ENV
    PLAN_ENV = PLAN_ENV  # serve: the recipe's steps this executor plays itself (levels/serve.executor_plan)
    NO_MEMORY_REASON = "kvdoctor's executor measures no device memory"

    def _init_executor(self) -> None:
        super()._init_executor()
        self.handoff = HANDOFFS.get(id(self.vllm_config))
        if self.handoff is not None:
            self.admission_len = self.handoff.admission_len
        self.kv_cache_config: Any = None
        self.served: ServedSide | None = None  # serve: the executor's own worker side
        if self.handoff is not None:  # in-process: the harness plays the recipe's steps, not a plan
            self.plan, self.eos_at = [], {}

    def attach(self, step: Callable[[Any], Any]) -> None:
        if self.handoff is None:
            self.handoff = Handoff(specs={})
        self.handoff.step = step

    def layer_specs(self) -> dict[str, Any]:
        if self.handoff is not None and self.handoff.specs:
            return dict(self.handoff.specs)
        return super().layer_specs()

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        super().initialize_from_config(kv_cache_configs)
        self.kv_cache_config = kv_cache_configs[0]
        if self.handoff is None:  # a `vllm serve` child: the worker side lives here
            self.served = ServedSide(self.vllm_config, self.kv_cache_config, self.plan)

    def shutdown(self) -> None:
        if self.served is not None:
            self.served.shutdown()

    def step_output(self, scheduler_output: Any) -> Any:
        if self.handoff is not None and self.handoff.step is not None:
            return self.handoff.step(scheduler_output)
        if self.served is None:
            raise RuntimeError("kvdoctor's executor ran a step before a worker side was attached")
        self.served.admit(scheduler_output)
        return super().step_output(scheduler_output)

    def transfers(self, scheduler_output: Any, sampled: dict[str, list[int]]) -> Any:
        assert self.served is not None
        return self.served.transfers(scheduler_output, sampled, self.steps)
