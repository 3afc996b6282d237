"""`KvdoctorExecutor`: a real vLLM `Executor` that stands where the GPU workers run.

vLLM's `EngineCore` talks to its model only through an `Executor`; vLLM resolves this class
itself from `distributed_executor_backend` ("kvdoctor.engine.core.executor.KvdoctorExecutor").
It answers the calls `EngineCore` makes (KV specs, memory, `initialize_from_config`, the RPCs
of each release, `execute_model` / `sample_tokens`) and hands each scheduler output to a
*worker side*:

- in-process (`--engine core`): the `CoreHarness` that built the engine attaches its step
  function (`attach`), which runs kvdoctor's worker (simulated or `VllmWorker`), samples the
  recipe's tokens and records the step's events, exactly as the scheduler-level harness does
  between `schedule()` and `update_from_output()`;
- in a `vllm serve` child (`--engine serve`): no harness exists, so the executor runs kvdoctor's
  simulated worker itself (every transfer completes when issued) and samples a decode token.

As vLLM's GPU model runner, `execute_model` returns None when tokens were scheduled and the
output comes from `sample_tokens`: `EngineCore.step` and `step_with_batch_queue` rely on that.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from kvdoctor.engine import compat

from kvdoctor.engine.core.names import ADMISSION_ENV, EXECUTOR_QUALNAME as QUALNAME, STEP_SECONDS_ENV

__all__ = ["ADMISSION_ENV", "HANDOFFS", "Handoff", "KvdoctorExecutor", "QUALNAME", "STEP_SECONDS_ENV"]


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


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def _executor_base() -> type:
    return compat.executor_base_class()


class KvdoctorExecutor(_executor_base()):  # type: ignore[misc]
    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.handoff = HANDOFFS.get(id(self.vllm_config))
        admission = os.environ.get(ADMISSION_ENV)
        self.admission_len = (self.handoff.admission_len if self.handoff is not None
                              else int(admission) if admission else None)
        self._original_len: int | None = None
        self._to_sample: deque[Any] = deque()
        self.steps = 0
        self.kv_cache_config: Any = None
        self.standalone: Any = None  # serve: the executor's own worker side
        self.step_seconds = float(os.environ.get(STEP_SECONDS_ENV, "0") or 0)

    def attach(self, step: Callable[[Any], Any]) -> None:
        if self.handoff is None:
            self.handoff = Handoff(specs={})
        self.handoff.step = step

    # -- start-up -------------------------------------------------------------------------
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        if self.admission_len is not None:
            model_config = self.vllm_config.model_config
            self._original_len = model_config.max_model_len
            model_config.max_model_len = min(self._original_len, self.admission_len)
        if self.handoff is not None and self.handoff.specs:
            return [dict(self.handoff.specs)]
        return [self._specs_from_model_config()]

    def _specs_from_model_config(self) -> dict[str, Any]:
        """One full-attention spec per decoder layer of the model config (kvdoctor's tiny Llama)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        spec = FullAttentionSpec(block_size=self.vllm_config.cache_config.block_size,
                                 num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=mc.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}

    def determine_available_memory(self) -> list[int]:
        return [1 << 40]  # --num-gpu-blocks-override decides the pool, as at the scheduler level

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        if self._original_len is not None:
            self.vllm_config.model_config.max_model_len = self._original_len
            self._original_len = None
        self.kv_cache_config = kv_cache_configs[0]
        if self.handoff is None:  # a `vllm serve` child: the worker side lives here
            from kvdoctor.engine.core.standalone import StandaloneSide

            self.standalone = StandaloneSide(self.vllm_config)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.standalone is not None:
            self.standalone.shutdown()

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False, **_: Any) -> Any:
        """Everything else EngineCore asks of 'all workers': one answer per worker (one here). A method
        `_rpc_<name>` gives the answers that matter; any other call is answered None."""
        kwargs = kwargs or {}
        if callable(method):
            results = [method(self, *args, **kwargs)]
        else:
            handler = getattr(self, f"_rpc_{method}", None)
            results = handler(*args, **kwargs) if handler is not None else [None]
        return _done(results) if non_block else results

    def _rpc_get_supported_tasks(self) -> list[tuple[str, ...]]:
        return [("generate",)]

    def _rpc_get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []  # the OffloadingConnector has no handshake

    def _rpc_compile_or_warm_up_model(self) -> list[Any]:
        return []  # 0.27+: no CompilationTimes (the list is read only when non-empty)

    def _rpc_get_supported_kv_cache_layouts(self) -> list[list[str]]:
        """0.33+: each worker's KV layouts, most preferred first: what the connector requires, then vLLM's."""
        return [compat.default_kv_cache_layouts()]

    def _rpc_extensible_kv_cache_unsupported_reason(self) -> list[str]:
        return ["kvdoctor's executor measures no device memory"]  # 0.34: the extensible KV cache stays off

    # -- one step -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        try:
            output = self._run(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the engine sees it where a GPU worker's error surfaces
            if non_block:
                return _failed(exc)
            raise
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._to_sample.append(output)
            output = None
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self._to_sample.popleft()
        return _done(output) if non_block else output

    def take_draft_token_ids(self) -> Any:
        return None

    def _run(self, scheduler_output: Any) -> Any:
        self.steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if self.handoff is not None and self.handoff.step is not None:
            return self.handoff.step(scheduler_output)
        if self.standalone is None:
            raise RuntimeError("kvdoctor's executor ran a step before a worker side was attached")
        return self.standalone.step(scheduler_output)
