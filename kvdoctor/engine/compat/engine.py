"""The engine level (`--engine core`): vLLM's EngineCore and Executor, as each release spells them.

Methods of `VllmApi` (mixed in), so every adapter call reads `api.<name>(...)`. The modules are
imported only for engine-level runs; the scheduler level never touches them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kvdoctor.engine.compat.names as names
from kvdoctor.engine.compat.imports import AdapterBase, _import, _require


class EngineGlue(AdapterBase):
    """vLLM's EngineCore, Executor and EngineCoreRequest, per release."""

    @staticmethod
    def engine_core_class() -> Any:
        return _require(_import(names.ENGINE_CORE_MODULE), "EngineCore", names.ENGINE_CORE_MODULE)

    @staticmethod
    def executor_base_class() -> Any:
        return _require(_import("vllm.v1.executor.abstract"), "Executor", "vllm.v1.executor.abstract")

    def resolve_executor_class(self, vllm_config: Any) -> Any:
        """The executor class vLLM itself resolves from `distributed_executor_backend` (a qualified name)."""
        return self.executor_base_class().get_class(vllm_config)

    @staticmethod
    def engine_core_request(request_id: str, prompt: list[int], sampling_params: Any, priority: int = 0) -> Any:
        """An `EngineCoreRequest` as an in-process client sends it (token ids, no multimodal input).

        Only the fields this release's struct declares are passed (feature probe: 0.26-0.34 share the
        required ones; later optional fields keep their defaults)."""
        import time

        cls = _require(_import("vllm.v1.engine"), "EngineCoreRequest", "vllm.v1.engine")
        wanted: dict[str, Any] = dict(request_id=request_id, prompt_token_ids=list(prompt), mm_features=None,
                                      sampling_params=sampling_params, pooling_params=None,
                                      arrival_time=time.time(), lora_request=None, cache_salt=None,
                                      data_parallel_rank=None, priority=priority)
        fields = set(getattr(cls, "__struct_fields__", ()) or wanted)
        return cls(**{k: v for k, v in wanted.items() if k in fields})

    def engine_sleep_mode(self) -> str | None:
        """vLLM's sleep mode on the engine, as this release has it (a feature probe): EngineCore.sleep's
        parameters ("level, mode" on 0.26, "level, mode, reset_connector" on 0.34), or None where EngineCore
        has no sleep / wake_up / is_sleeping."""
        import inspect

        core = self.engine_core_class()
        if not all(callable(getattr(core, name, None)) for name in ("sleep", "wake_up", "is_sleeping")):
            return None
        return ", ".join(p for p in inspect.signature(core.sleep).parameters if p != "self")

    def engine_sleep_takes_reset_connector(self) -> bool:
        """Whether EngineCore.sleep takes `reset_connector` (0.34 does; 0.26's level >= 1 always resets it)."""
        return "reset_connector" in (self.engine_sleep_mode() or "").split(", ")

    @staticmethod
    def engine_step_fn_name(core: Any) -> str:
        """`step` or `step_with_batch_queue` (async scheduling / pipeline parallelism): the one the engine uses."""
        return str(getattr(getattr(core, "step_fn", None), "__name__", "step"))

    @staticmethod
    @contextmanager
    def lean_engine_core_lifecycle() -> Iterator[None]:
        """EngineCore's start-up `freeze_gc_heap` and its shutdown's `cleanup_dist_env_and_memory` run full
        garbage collections (measured on 0.26.0: four, ~1 s each on a heap holding vLLM, 4 of the 4.2 s an
        in-process queued-abort takes). An engine that runs no model and joins no process group has nothing
        for them to freeze or clean, so inside this scope only they are no-ops; the originals come back on
        exit, also when the engine raised. Names probed: a release without them runs unchanged."""
        module = _import(names.ENGINE_CORE_MODULE)
        saved = {name: getattr(module, name) for name in ("freeze_gc_heap", "cleanup_dist_env_and_memory")
                 if hasattr(module, name)}
        for name in saved:
            setattr(module, name, lambda *args, **kwargs: None)
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(module, name, original)
