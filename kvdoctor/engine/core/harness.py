"""vLLM's real `EngineCore`, in-process, behind the scheduler-level harness's interface.

The scenario drives it with the same calls (`add`, `step`, `abort`, `finish_by_eos`, transfer
holds, `reset_prefix_cache`), but here the engine does the work: requests enter through
`EngineCore.preprocess_add_request` / `add_request`, aborts go through `abort_requests`, resets
through `EngineCore.reset_prefix_cache`, and each `step` is the engine's own `step_fn` (`step`,
or `step_with_batch_queue` under async scheduling) followed by `post_step`. The engine's
`Scheduler` and `OffloadingConnector` are the ones vLLM builds; kvdoctor's executor
(`executor.KvdoctorExecutor`, resolved by vLLM from its qualified name) calls back into
`_execute` for each scheduler output: the worker side, sampling and the step's events are the
scheduler-level harness's own code, so the two levels differ only in who calls the scheduler.

The VllmConfig is the one the scheduler level builds for the setup (same geometry, same tiny model
config, same connector config); vLLM's engine plans the KV cache itself from the executor's specs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvdoctor.clean_exit import raise_if_terminated
from kvdoctor.engine import kv_layout
from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.harness import Harness, StepEvents, build_pieces, sampling_params
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

PAUSE_DRAIN_STEPS = 200  # engine steps a sleep's drain may take (kvdoctor's pools drain in a few dozen)


def sleep_arguments(api: VllmApi, reset_connector: bool | None) -> dict[str, Any]:
    """EngineCore.sleep's keyword arguments past level and mode, as this release takes them (a probe); a release
    without sleep mode, or a reset_connector its sleep does not take, is a usage error in one line."""
    if api.engine_sleep_mode() is None:
        raise UsageError("sleep: this vLLM's EngineCore has no sleep mode (sleep / wake_up / is_sleeping)")
    if reset_connector is None:
        return {}
    if not api.engine_sleep_takes_reset_connector():
        raise UsageError("sleep reset_connector: this vLLM's EngineCore.sleep always resets the connector at level "
                         ">= 1 (it takes no reset_connector); leave the field out")
    return {"reset_connector": reset_connector}


class CoreHarness(Harness):
    """One EngineCore per run; `Harness`'s step bookkeeping, the engine's control flow."""

    def __init__(self, api: VllmApi, setup: Setup, build_cache: Any = None) -> None:
        from kvdoctor.engine.core.executor import HANDOFFS, QUALNAME, Handoff

        self.api = api
        self.setup = setup
        vllm_config, self.kv_plan, _, _, _ = build_pieces(api, setup)
        layout = kv_layout.resolve_layout(setup.model, setup.layout, setup.sliding_window)
        specs = kv_layout.layer_specs(api, layout, setup.block_size, setup.max_model_len, setup.mamba_cache_mode,
                                      kv_layout.speculative_blocks(setup))
        vllm_config.parallel_config.distributed_executor_backend = QUALNAME
        handoff = Handoff(specs=specs, admission_len=self.kv_plan.admission_len)
        HANDOFFS[id(vllm_config)] = handoff
        try:
            executor_class = self.api.resolve_executor_class(vllm_config)
            with self.api.lean_engine_core_lifecycle():
                self.core = self.api.engine_core_class()(vllm_config, executor_class, log_stats=True)
        finally:
            HANDOFFS.pop(id(vllm_config), None)
        self.executor = self.core.model_executor
        self._note_plan_differences()
        self.scheduler = self.core.scheduler
        self._attach_worker_side()
        self._events: StepEvents | None = None
        self.step_fn_name = self.api.engine_step_fn_name(self.core)
        self.executor.attach(self._execute)

    def _note_plan_differences(self) -> None:
        """The engine planned its KV cache itself: say so where it differs from kvdoctor's plan."""
        config = self.api.kv_cache_config_of(self.core.scheduler)
        planned = (int(config.num_blocks), len(config.kv_cache_groups))
        expected = (self.kv_plan.num_blocks, len(self.kv_plan.groups))
        if planned != expected:
            self.kv_plan.notes.append(f"vLLM's EngineCore planned {planned[0]} blocks in {planned[1]} group(s); "
                                      f"kvdoctor's scheduler level plans {expected[0]} in {expected[1]}")

    # -- requests: the engine's input path ------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
            priority: int = 0) -> None:
        params = sampling_params(self.api, max_tokens, kv_transfer_params)
        request, wave = self.core.preprocess_add_request(self.api.engine_core_request(req_id, prompt, params, priority))
        self.requests[req_id] = request
        self.core.add_request(request, wave)

    def abort(self, req_id: str) -> None:
        self.core.abort_requests([req_id])

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> bool:
        kwargs: dict[str, Any] = {}
        if reset_running_requests:
            kwargs["reset_running_requests"] = True
        if reset_connector:
            kwargs["reset_connector"] = True
        ok = self.core.reset_prefix_cache(**kwargs)
        if reset_connector:
            self.worker.forget()
            if self.companion is not None:
                self.companion.forget()
        return bool(ok) if ok is not None else True

    def pause(self, mode: str, clear_cache: bool) -> None:
        """EngineCore.pause_scheduler as an in-process client calls it (its other arguments vLLM's defaults:
        clearing the caches resets the connector's too, so the worker's jobs are gone with them)."""
        self.core.pause_scheduler(mode=mode, clear_cache=clear_cache)
        if clear_cache:
            self.worker.forget()
            if self.companion is not None:
                self.companion.forget()

    def resume(self) -> None:
        self.core.resume_scheduler()

    def sleep(self, level: int, mode: str, reset_connector: bool | None) -> None:
        """EngineCore.sleep as an in-process client (`LLM.sleep`) calls it: the engine pauses its scheduler
        (`mode`), at level >= 1 resets its caches (the connector's too unless `reset_connector` is false, where
        the release takes it: a probe) and puts kvdoctor's executor to sleep. A reset connector forgets its jobs:
        the worker's go with it, as with `reset_prefix_cache`."""
        with self._bounded_pause_drain():
            self.core.sleep(level=level, mode=mode, **sleep_arguments(self.api, reset_connector))
        if level >= 1 and reset_connector is not False:
            self.worker.forget()
            if self.companion is not None:
                self.companion.forget()

    @contextmanager
    def _bounded_pause_drain(self) -> Iterator[None]:
        """A sleep that keeps the connector's cache (0.34's reset_connector = false) steps the engine until nothing
        is pending (its stores read the KV the sleep discards). A transfer kvdoctor holds never finishes there:
        past `PAUSE_DRAIN_STEPS` steps the sleep is stopped as a usage error (the recipe's hold, not vLLM's bug).
        The engine's own step function is wrapped, never changed, and put back on exit, also when it raised."""
        core = self.core
        original = core.step_fn
        steps = 0

        def counted() -> Any:
            nonlocal steps
            steps += 1
            if steps > PAUSE_DRAIN_STEPS:
                raise UsageError(f"sleep: vLLM's engine still had pending work after {PAUSE_DRAIN_STEPS} steps of its "
                                 f"pause (it waits for the connector's stores when reset_connector is false); "
                                 f"complete the held transfers before the sleep")
            return original()

        core.step_fn = counted
        try:
            yield
        finally:
            core.step_fn = original

    def wake_up(self, tags: list[str] | None) -> None:
        """EngineCore.wake_up: the executor's tags wake; the scheduler resumes once none sleeps."""
        self.core.wake_up(tags=list(tags) if tags is not None else None)

    def delay_block_hashes(self, req_id: str) -> None:
        """vLLM's engine hashes blocks with its own request_block_hasher: the core level refuses late hashes by
        their need before anything is played; reaching here is a usage error, never a step that does nothing."""
        raise UsageError(f"delay_block_hashes {req_id}: vLLM's EngineCore computes block hashes with its own "
                         f"hasher and offers no way to withhold them; play it at --engine scheduler")

    def release_block_hashes(self, req_id: str) -> None:
        raise UsageError(f"release_block_hashes {req_id}: vLLM's EngineCore computes block hashes with its own "
                         f"hasher and offers no way to withhold them; play it at --engine scheduler")

    def drain(self) -> bool:
        """Sync scheduling: nothing is in flight between engine steps (the runner refuses async drains)."""
        return False

    def shutdown(self) -> None:
        self.worker.shutdown()
        try:
            with self.api.lean_engine_core_lifecycle():
                self.core.shutdown()
        except Exception:
            pass

    # -- one engine step ---------------------------------------------------------------------------
    def step(self) -> StepEvents:
        """The engine's own step function; the executor reports what the scheduled step did."""
        raise_if_terminated()  # a SIGTERM whose Terminated a library swallowed still stops the run
        self.step_index += 1
        self._events = StepEvents()
        events = self._events
        _, executed = self.core.step_fn()
        self.core.post_step(executed)
        self.take_kv_events(events)
        return events

    def _execute(self, output: Any) -> Any:
        """The executor's step: kvdoctor's worker side on this scheduler output (as `Harness.step` runs it
        between `schedule()` and `update_from_output()`); returns the ModelRunnerOutput."""
        events = self._events if self._events is not None else StepEvents()
        return self.worker_step(output, events)

