"""vLLM's real Scheduler (or AsyncScheduler) with the real OffloadingConnector, in-process.

The worker side sits behind a seam (`kvdoctor.engine.workers.base.Worker`): the simulated
bookkeeping worker, or vLLM's own worker-role connector on real KV tensors
(`--worker vllm`). vLLM's ModelConfig comes from a tiny `config.json` written at
run time (`tiny_model`); the KV cache groups come from the model's layer layout (`kv_layout`: a
local model directory or a shipped config), so nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.clean_exit import raise_if_terminated
from kvdoctor.engine import kv_layout
from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.pd_decode import PdLoads
from kvdoctor.engine.secondary_tier import empty_tier_directory
from kvdoctor.engine.setup import Setup
from kvdoctor.engine.step_loop import DECODE_TOKEN, EOS_TOKEN, StepLoop, sample
from kvdoctor.engine.tiny_model import ContextKeys, tiny_draft_dir, tiny_model_dir
from kvdoctor.engine.worker import Job
from kvdoctor.engine.workers.multi import SeveralWorkers
from kvdoctor.engine.workers.simulated import SimulatedTransfers
from kvdoctor.errors import InternalError, UsageError

_MODEL_CONFIGS: dict[tuple[str, int], Any] = {}


def _model_config(api: VllmApi, max_model_len: int) -> Any:
    """ModelConfig is the slow part of a build (architecture inspection): build once per process."""
    path = tiny_model_dir()
    key = (path, max_model_len)
    if key not in _MODEL_CONFIGS:
        ModelConfig = api.cls("config", "ModelConfig")
        try:
            _MODEL_CONFIGS[key] = ModelConfig(model=path, skip_tokenizer_init=True,
                                              max_model_len=max_model_len, dtype="float16", seed=0)
        except (ValueError, TypeError) as exc:  # vLLM's own validation message
            raise UsageError(f"vLLM rejected the model config: {validation_message(exc)}") from None
    return _MODEL_CONFIGS[key]


def validation_message(exc: BaseException) -> str:
    """vLLM's whole validation message on one line ("1 validation error for X" alone hides the reason)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information visit")]
    return " · ".join(lines) if lines else type(exc).__name__


class BuildCache:
    """The per-setup pieces of a build (VllmConfig, vLLM's KV cache plan), kept across the builds of
    one process that runs many short scenarios on few setups (`kvdoctor explore`). Each build still
    gets a fresh Scheduler, connector and worker; they share these objects, which no scheduler
    mutates (measured on 0.26.0: the VllmConfig's and KVCacheConfig's repr is unchanged after 150
    explored runs). Only the simulated worker's setups are cached; oldest entries are dropped."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._entries: dict[str, tuple[Any, ...]] = {}
        self.hits = self.misses = 0

    def pieces(self, api: VllmApi, setup: Setup) -> tuple[Any, kv_layout.KvPlan, Any, int, int]:
        if setup.worker != "simulated":
            return build_pieces(api, setup)
        key = repr(setup)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            entry = build_pieces(api, setup)
            if len(self._entries) >= self.size:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = entry
        else:
            self.hits += 1
        vllm_config, kv_plan, *rest = entry
        return (vllm_config, dataclasses.replace(kv_plan, notes=list(kv_plan.notes)), *rest)


def build_scheduler(api: VllmApi, setup: Setup, cache: BuildCache | None = None) -> tuple[Any, kv_layout.KvPlan]:
    """The real scheduler with the real connector, its KV cache groups planned by vLLM, and a CPU tier
    of real capacity. The ModelConfig is kvdoctor's tiny Llama: the scheduler reads no weights or
    architecture; the model's layer layout comes from its config.json (`kv_layout`)."""
    vllm_config, kv_plan, kv_cache_config, block_size, hash_block_size = (
        cache.pieces(api, setup) if cache is not None else build_pieces(api, setup))
    scheduler_cls = (api.cls("async_scheduler", "AsyncScheduler") if setup.async_scheduling
                     else api.cls("scheduler", "Scheduler"))
    structured = api.cls("structured_output", "StructuredOutputManager")(vllm_config)
    # An exception here is vLLM's (its connector failed to initialise): the scenario reports it as
    # other_failure, never as the user's fault.
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                              structured_output_manager=structured, block_size=block_size,
                              hash_block_size=hash_block_size)
    return scheduler, kv_plan


def build_pieces(api: VllmApi, setup: Setup) -> tuple[Any, kv_layout.KvPlan, Any, int, int]:
    """(VllmConfig, plan, scheduler KVCacheConfig, block size, hash block size) for a setup."""
    model_config = _model_config(api, setup.max_model_len)
    scheduler_kwargs: dict[str, Any] = dict(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        async_scheduling=setup.async_scheduling,
        **({"policy": setup.scheduling_policy} if setup.scheduling_policy else {}),
    )
    kv_transfer_config = (api.kv_transfer_config(setup.kv_connector_extra_config(), setup.kv_transfer_fields,
                                                 setup.second_connector_extra_config(), setup.pd_decode)
                          if setup.offloading else None)
    cache_kwargs: dict[str, Any] = dict(block_size=setup.block_size, enable_prefix_caching=setup.enable_prefix_caching)
    if setup.mamba_cache_mode is not None:
        cache_kwargs["mamba_cache_mode"] = setup.mamba_cache_mode
    cache_kwargs.update(api.cache_config_kwargs({"prefix_match_unit": setup.prefix_match_unit,
                                                 "prefix_cache_retention_interval":
                                                     setup.prefix_cache_retention_interval}))
    speculative: dict[str, Any] = {}
    if setup.speculative_method is not None:
        speculative["speculative_config"] = api.speculative_config(
            model_config, setup.speculative_method, setup.num_speculative_tokens,
            tiny_draft_dir() if setup.speculative_method == "eagle" else None,
            {"disable_lookahead_block_hashes": True} if setup.disable_lookahead_block_hashes else None)
    try:
        vllm_config = api.config_class("VllmConfig")(
            model_config=model_config,
            cache_config=api.config_class("CacheConfig")(**cache_kwargs),
            scheduler_config=api.config_class("SchedulerConfig")(**scheduler_kwargs),
            kv_transfer_config=kv_transfer_config,
            device_config=api.config_class("DeviceConfig")("cpu"),
            **speculative,
            **({"parallel_config": api.parallel_config(setup.num_workers)} if setup.num_workers > 1 else {}),
            **({"kv_events_config": api.kv_events_config()} if setup.kv_events else {}),
        )
    except (ValueError, TypeError) as exc:  # vLLM's validation (pydantic's errors are ValueErrors)
        raise UsageError(f"vLLM rejected the configuration: {validation_message(exc)}") from None

    kv_plan, kv_cache_config, block_size, hash_block_size = kv_layout.plan(api, vllm_config, setup)
    _chunk_in_blocks_for_mixed_groups(vllm_config, kv_plan, setup)
    return vllm_config, kv_plan, kv_cache_config, block_size, hash_block_size


def _chunk_in_blocks_for_mixed_groups(vllm_config: Any, kv_plan: kv_layout.KvPlan, setup: Setup) -> None:
    """Groups of different block sizes (the planner grew one group's block to unify page sizes): the
    connector refuses a chunk given in tokens (`block_size`), so it gets the chunk in GPU blocks
    (`blocks_per_chunk`), as such a deployment must configure it; each group's chunk is then
    `blocks_per_chunk` of its own blocks."""
    sizes = {group.block_size for group in kv_plan.groups}
    if len(sizes) < 2:
        return
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.pop("block_size", None)
    extra["blocks_per_chunk"] = setup.blocks_per_chunk
    kv_plan.notes.append(f"the groups' block sizes differ ({', '.join(str(s) for s in sorted(sizes))} tokens): the "
                         f"connector gets blocks_per_chunk={setup.blocks_per_chunk}, so each group's chunk is "
                         f"{setup.blocks_per_chunk} of its own blocks")


def sampling_params(api: VllmApi, max_tokens: int, kv_transfer_params: dict[str, Any] | None = None) -> Any:
    """A request's SamplingParams: stop at kvdoctor's EOS; `kv_transfer_params` in extra_args, where vLLM's
    Request (and the engine's input path) reads a client's."""
    SamplingParams = api.cls("sampling_params", "SamplingParams")
    extra = {"extra_args": {"kv_transfer_params": dict(kv_transfer_params)}} if kv_transfer_params else {}
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=[EOS_TOKEN], **extra)


@dataclass
class StepEvents:
    """What one engine step did, as the simulated worker and the scheduler saw it."""

    scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_store_jobs: dict[int, str] = field(default_factory=dict)
    new_load_jobs: dict[int, str] = field(default_factory=dict)
    jobs_to_flush: list[int] = field(default_factory=list)
    completed_jobs: list[int] = field(default_factory=list)
    failed_jobs: list[int] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # store job -> GPU blocks it still reads that this step handed to a request again
    reused_while_storing: dict[int, list[int]] = field(default_factory=dict)
    # KV slots whose bytes are not what their tokens say (vLLM worker only): ContentFinding
    content_findings: list[Any] = field(default_factory=list)
    # request -> draft tokens verified in this step (speculative decoding): their slots' KV is written by
    # the forward but holds a rejected draft's KV unless the draft is accepted
    spec_tokens: dict[str, int] = field(default_factory=dict)
    # The KV cache events vLLM's Scheduler published in this step (Setup.kv_events), in order: KvEvent
    kv_events: list[Any] = field(default_factory=list)

    def is_quiet(self) -> bool:
        return not any((self.scheduled_tokens, self.new_store_jobs, self.new_load_jobs, self.jobs_to_flush,
                        self.completed_jobs, self.failed_jobs, self.preempted, self.finished,
                        self.reused_while_storing, self.content_findings))


# The GPU default runner per setup, asked once per process: vLLM's probe scans every installed
# package's entry points (~12 ms a call here), and the answer depends only on the VllmConfig that
# the setup builds and on VLLM_USE_V2_MODEL_RUNNER (`repro --logic all` builds three per recipe).
_GPU_DEFAULT_RUNNERS: dict[tuple[str, str | None], str] = {}


def _gpu_default_model_runner(api: VllmApi, setup: Setup, scheduler: Any) -> str:
    import os

    key = (repr(setup), os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
    if key not in _GPU_DEFAULT_RUNNERS:
        _GPU_DEFAULT_RUNNERS[key] = api.gpu_default_model_runner(api.vllm_config_of(scheduler))
    return _GPU_DEFAULT_RUNNERS[key]


class Harness:
    """Drives one scheduler through add / step / abort / finish, like an engine core would."""

    def __init__(self, api: VllmApi, setup: Setup, build_cache: BuildCache | None = None) -> None:
        self.api = api
        self.setup = setup
        if setup.secondary_tier:  # a previous run's chunk files would be hits in this one
            empty_tier_directory()
        self.scheduler, self.kv_plan = build_scheduler(api, setup, build_cache)
        self._attach_worker_side()
        self._block_hasher = self._make_block_hasher()

    def _attach_worker_side(self) -> None:
        """What stands beside `self.scheduler` (either level's): the connector's scheduler side, the worker
        and the per-run bookkeeping."""
        api, setup = self.api, self.setup
        # None when the setup runs no connector (`offloading = false`): nothing to observe there.
        self.connector_scheduler = (api.connector_scheduler(self.scheduler, setup.watched_connector)
                                    if setup.offloading else None)
        # Setup.secondary_tier / object_store: the tiering manager whose tiers settle in each step's forward window
        self._tiering = (api.tiering_manager_of(self.connector_scheduler)
                         if (setup.secondary_tier or setup.object_store is not None)
                         and self.connector_scheduler is not None else None)
        self.model_runner = self._choose_model_runner()
        # Setup.kv_events: what vLLM's Scheduler publishes, recorded where its publisher stands
        self.kv_event_recorder = api.record_kv_events(self.scheduler) if setup.kv_events else None
        self.worker = self._make_worker()
        # multi_connector on the simulated worker: the second OffloadingConnector's jobs, completed as soon as they
        # are issued (it stands for another asynchronous connector; holds and failures apply to the watched one).
        # vLLM's worker drives both sub-connectors itself (its MultiConnector worker, `VllmWorker`).
        self.companion = None
        if setup.multi_connector and setup.worker != "vllm":
            self.companion = SimulatedTransfers(api)
        # pd_decode: the remote-prefill loads kvdoctor's NIXL stand-in issues, finished or failed on schedule
        self.pd_loads = PdLoads(api) if setup.pd_decode else None
        self.requests: dict[str, Any] = {}
        self.step_index = 0
        self._finish_next: set[str] = set()
        self.loop = StepLoop(self.scheduler, setup.async_scheduling)  # async: keeps the output in flight
        self.store_jobs_by_request: dict[str, list[int]] = {}
        # Requests whose new block hashes are withheld (delay_block_hashes): vLLM's hasher is
        # incremental, so the withheld hashes are computed when the request is released.
        self.hashes_withheld: set[str] = set()
        # The stand-in drafter (speculative_method): how many drafts each verification accepts, cycled.
        self._acceptance = self.setup.draft_acceptance_pattern()
        self.verifications = 0
        self.drafts_rejected = 0
        # The stand-in model's answers (tiny_model.answer_of): the keys right KV holds, and each request's
        # sampled (token, logprob), in order (EOS a recipe forces is not the model's and not listed).
        self.context_keys = ContextKeys()
        self.answers: dict[str, list[tuple[int, float]]] = {}
        # (step, request) where vLLM's worker's toy model gave no answer: its token is right KV's, not read from
        # the KV bytes, so a client comparison over it proves nothing (kvdoctor's failure, `levels.core`)
        self.unanswered: list[tuple[int, str]] = []

    def _choose_model_runner(self) -> str:
        """The model runner the scheduler shapes its output for. Asked for: that one. Otherwise the
        vLLM worker follows what a GPU deployment of this release would run; the simulated worker
        keeps the scheduler's own pick on this machine."""
        runner = self.setup.model_runner
        if runner is None and self.setup.worker == "vllm":
            runner = _gpu_default_model_runner(self.api, self.setup, self.scheduler)
        if runner is None:
            return self.api.scheduler_model_runner(self.scheduler)
        self.api.set_scheduler_model_runner(self.scheduler, runner)
        return runner

    def _make_worker(self) -> Any:
        if self.setup.worker == "vllm":
            from kvdoctor.engine.workers.vllm_worker import VllmWorker

            return VllmWorker(self.api, self.scheduler, self.setup.device or "cpu", self.model_runner)
        if self.setup.num_workers > 1:
            return SeveralWorkers(self.api, self.setup.num_workers, self.setup.late_worker_steps)

        return SimulatedTransfers(self.api)

    def _make_block_hasher(self) -> Any:
        sha256 = self.api.block_hash_fn()
        # As vLLM's engine core builds it: with 0.34's lookahead (a hash covers tokens past its block).
        hasher = self.api.request_block_hasher(self.kv_plan.hash_block_size, sha256,
                                               self.api.vllm_config_of(self.scheduler))
        withheld = self.hashes_withheld

        def request_block_hasher(request: Any) -> Any:
            # Block hashes that arrive later than blocks (P/D, hybrid, 0.34 lookahead hashes):
            # nothing new while withheld; vLLM's own hasher catches up from len(block_hashes).
            if request.request_id in withheld:
                return []
            return hasher(request)
        return request_block_hasher

    # -- requests --------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
            priority: int = 0) -> None:
        """`kv_transfer_params` travel as a client's do (the sampling params' extra_args, which vLLM's Request
        reads); `priority` is the Request's own (read by the scheduler under the priority policy)."""
        Request = self.api.cls("request", "Request")
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sampling_params(self.api, max_tokens, kv_transfer_params),
            pooling_params=None,
            block_hasher=self._block_hasher,
            **({"priority": priority} if priority else {}),
        )
        self.requests[req_id] = request
        self.scheduler.add_request(request)

    def delay_block_hashes(self, req_id: str) -> None:
        """From now on the request's new full blocks get no block hash (so no offload key) until released."""
        self.hashes_withheld.add(req_id)

    def release_block_hashes(self, req_id: str) -> None:
        """The withheld block hashes arrive now (vLLM's hasher computes every one still missing)."""
        self.hashes_withheld.discard(req_id)
        self.api.update_block_hashes(self.requests[req_id])

    def abort(self, req_id: str) -> None:
        status = self.api.cls("request", "RequestStatus")
        self.scheduler.finish_requests(req_id, status.FINISHED_ABORTED)

    def finish_by_eos(self, req_id: str) -> None:
        """The request's next sampled token is EOS (finishes through the normal stop path)."""
        self._finish_next.add(req_id)

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> bool:
        ok = self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests,
                                               reset_connector=reset_connector)
        if reset_connector:
            self.worker.forget()
            if self.companion is not None:
                self.companion.forget()
        return bool(ok)

    def drain(self) -> bool:
        """Apply the output still in flight (async scheduling), as an engine that goes idle does."""
        return self.loop.drain()

    def pause(self, mode: str, clear_cache: bool) -> None:
        """Pausing is the engine's (EngineCore.pause_scheduler gates its own step loop): this level refuses
        `pause`/`resume` by their need before anything is played; reaching here is a usage error."""
        raise UsageError("pause: kvdoctor's scheduler harness cannot pause an engine (the engine's own step loop "
                         "does); play it with --engine core")

    def resume(self) -> None:
        raise UsageError("resume: kvdoctor's scheduler harness cannot resume an engine (the engine's own step "
                         "loop does); play it with --engine core")

    def sleep(self, level: int, mode: str, reset_connector: bool | None) -> None:
        """Sleep mode is the engine's (EngineCore.sleep pauses its step loop and puts its executor to sleep): refused
        by its need, as `pause` is; reaching here is a usage error."""
        raise UsageError("sleep: kvdoctor's scheduler harness has no engine to put to sleep (EngineCore.sleep "
                         "does); play it with --engine core")

    def wake_up(self, tags: list[str] | None) -> None:
        raise UsageError("wake_up: kvdoctor's scheduler harness has no engine to wake (EngineCore.wake_up does); "
                         "play it with --engine core")

    def pd_fail(self, req_id: str, blocks: int | None) -> None:
        """`pd_fail`: the remote-prefill load of `req_id` fails when it ends (Setup.pd_decode)."""
        if self.pd_loads is None:  # the loader refuses the step without it
            raise InternalError("pd_fail played without [setup] pd_decode = true (the loader refuses it)")
        self.pd_loads.fail(req_id, blocks)

    def p2p(self, action: str, args: dict[str, Any]) -> None:
        """A `p2p_*` step: only the P2P pair's harness (engine/p2p.py, [setup] p2p = true) plays it; the levels
        refuse such a step without the pair before anything is played, so reaching here is kvdoctor's bug."""
        raise InternalError(f"p2p_{action} played on a harness without the P2P pair ([setup] p2p = true)")

    def shutdown(self) -> None:
        """Release what the connector holds (the tiering spec maps a file in /dev/shm)."""
        self.worker.shutdown()
        with contextlib.suppress(Exception):  # a crashed scheduler may not shut down cleanly
            self.scheduler.shutdown()
        if self.setup.worker != "simulated":  # the simulated worker holds no KV bytes: nothing to free early
            import gc

            gc.collect()  # the worker's KV tensors sit in reference cycles with vLLM's connector objects

    # -- one engine step ------------------------------------------------
    def step(self) -> StepEvents:
        """schedule(), the worker's output, update_from_output(); async applies it one step late."""
        raise_if_terminated()  # a SIGTERM whose Terminated a library swallowed still stops the run
        self.step_index += 1
        events = StepEvents()

        def worker_side(output: Any) -> Any:
            runner_output = self.worker_step(output, events)
            if self._tiering is not None:
                self.api.settle_secondary_tiers(self._tiering)
            return runner_output

        output = self.loop.step(worker_side)
        if not self.setup.async_scheduling:
            self._propose_drafts(output)
        self.take_kv_events(events)
        return events

    def take_kv_events(self, events: StepEvents) -> None:
        """The KV events vLLM published during this step, into `events` (Setup.kv_events)."""
        if self.kv_event_recorder is not None:
            events.kv_events = self.kv_event_recorder.take()

    def _propose_drafts(self, output: Any) -> None:
        """The stand-in drafter, after the step's output is applied (sync scheduling), as vLLM's engine
        core hands the model runner's drafts to `Scheduler.update_draft_token_ids`: `num_speculative_tokens`
        drafts for each request of the step (the scheduler ignores them for a prefill chunk). Under async
        scheduling vLLM's AsyncScheduler schedules placeholder drafts itself (the worker fills in their
        ids), so there is nothing to hand over."""
        if self.setup.speculative_method is None or self.api.drafts_skipped(output):
            return
        req_ids = [rid for rid in output.num_scheduled_tokens if rid in self.scheduler.requests]
        if req_ids:
            drafts = [[DECODE_TOKEN] * self.setup.num_speculative_tokens for _ in req_ids]
            self.scheduler.update_draft_token_ids(self.api.draft_token_ids(req_ids, drafts))

    def worker_step(self, output: Any, events: StepEvents) -> Any:
        """The worker side of one step on a scheduler output: the jobs it carries, the blocks reused under
        in-flight stores, the worker's copies and sampled tokens, into `events`; returns the
        ModelRunnerOutput. Both levels run it: `step` here, vLLM's engine through the executor
        (`engine/core`)."""
        events.scheduled_tokens = dict(output.num_scheduled_tokens)
        if self.setup.speculative_method:  # nothing to read otherwise (the step's hot path)
            events.spec_tokens = {rid: len(ids) for rid, ids in self.api.scheduled_spec_tokens(output).items() if ids}
        events.preempted = sorted(self.api.preempted_req_ids(output))
        events.finished = sorted(output.finished_req_ids or ())
        watched = self.setup.watched_connector
        store_jobs, load_jobs = self.api.store_and_load_jobs(output, watched)
        metas = self.api.connector_metadatas(output)
        flush = self.api.jobs_to_flush(metas[watched]) if len(metas) > watched else set()
        events.jobs_to_flush = sorted(flush)
        # Groups share one block pool: a block any group was handed again is reused.
        allocated = set().union(*self.api.allocated_block_ids(
            output, tuple(g.block_size for g in self.kv_plan.groups)))
        # A request that waits for an asynchronous load is not in the scheduler output: the blocks
        # allocated for it are the loads' destinations (of every connector: under a MultiConnector
        # another one may be loading them).
        companion_jobs, companion_flush = self._second_connector_jobs(output, metas)
        for job in list(load_jobs.values()) + [j for j in companion_jobs if j.kind == "load"]:
            dst = job.dst_block_ids if isinstance(job, Job) else self.api.block_ids_of(getattr(job, "dst_spec", None))
            allocated.update(b for b in dst if b != 0)
        for jid, job in self.worker.in_flight.items():
            reused = sorted(set(job.src_block_ids) & allocated)
            if reused:
                events.reused_while_storing[jid] = reused
        new_jobs = []
        for jid, job in store_jobs.items():
            events.new_store_jobs[jid] = job.req_id
            self.store_jobs_by_request.setdefault(job.req_id, []).append(jid)
            src = self.api.block_ids_of(getattr(job, "src_spec", None))
            new_jobs.append(Job(jid, job.req_id, "store", self.step_index, src_block_ids=src))
        for jid, job in load_jobs.items():
            events.new_load_jobs[jid] = job.req_id
            dst_spec = getattr(job, "dst_spec", None)
            new_jobs.append(Job(jid, job.req_id, "load", self.step_index, self.api.block_ids_of(dst_spec),
                                dst_groups=self.api.block_ids_by_group(dst_spec), sync=self.api.load_is_sync(job)))
        sampled = self._sample(output, events.spec_tokens)
        answered = self._answer(sampled)
        # vLLM's worker: the toy model reads each answer from the KV bytes its forward attends to
        done = self.worker.run_step(output, new_jobs, flush, self.step_index, sampled)
        model = getattr(self.worker, "model", None)
        read = getattr(model, "logprobs", {})
        for req_id in answered:
            if model is not None and req_id not in read:  # kept the right KV's token: the toy model read nothing
                self.unanswered.append((self.step_index, req_id))
            self.answers.setdefault(req_id, []).append((sampled[req_id][-1], read.pop(req_id, answered[req_id])))
        if self.companion is not None:
            other = self.companion.run_step(output, companion_jobs, companion_flush, self.step_index, sampled)
            done.kv_connector_output = self.api.multi_connector_output([done.kv_connector_output,
                                                                        other.kv_connector_output])
        if self.pd_loads is not None:  # the stand-in is the MultiConnector's first sub-connector
            remote = self.pd_loads.run_step(metas[0] if metas else None, set(events.finished))
            done.kv_connector_output = self.api.multi_connector_output([remote, done.kv_connector_output])
        events.completed_jobs = done.completed_jobs
        events.failed_jobs = done.failed_jobs
        events.content_findings = done.content_findings
        kv_output = done.kv_connector_output if self.connector_scheduler is not None else None
        return self._model_runner_output(output, sampled, kv_output)

    def _second_connector_jobs(self, output: Any, metas: tuple[Any, ...]) -> tuple[list[Job], set[int]]:
        """The second sub-connector's new jobs and flushes (multi_connector): its loads' destinations are blocks
        allocated in this step whichever worker runs them; the companion worker takes them all."""
        if not self.setup.multi_connector:
            return [], set()
        stores, loads = self.api.store_and_load_jobs(output, 1)
        jobs = [Job(jid, job.req_id, "store", self.step_index,
                    src_block_ids=self.api.block_ids_of(getattr(job, "src_spec", None)))
                for jid, job in stores.items()]
        for jid, job in loads.items():
            dst_spec = getattr(job, "dst_spec", None)
            jobs.append(Job(jid, job.req_id, "load", self.step_index, self.api.block_ids_of(dst_spec),
                            dst_groups=self.api.block_ids_by_group(dst_spec), sync=self.api.load_is_sync(job)))
        flush = self.api.jobs_to_flush(metas[1]) if len(metas) > 1 else set()
        return jobs, flush

    def _sample(self, output: Any, spec_tokens: dict[str, int]) -> dict[str, list[int]]:
        """The token each scheduled request samples (EOS where a recipe finishes it); `spec_tokens`: the
        drafts each request verifies in this step (`StepEvents.spec_tokens`)."""
        return sample(self.requests, output.num_scheduled_tokens, self._finish_next,
                      lambda req_id: self._accepted(spec_tokens.get(req_id, 0)))

    def _answer(self, sampled: dict[str, list[int]]) -> dict[str, float]:
        """The stand-in model's token for each request that samples one (not a recipe's EOS): what right KV
        gives (`tiny_model.ContextKeys`); vLLM's worker then reads it from the KV bytes instead. Returns
        request -> logprob of the tokens replaced."""
        logprobs: dict[str, float] = {}
        for req_id, tokens in sampled.items():
            request = self.requests.get(req_id)
            if not tokens or tokens[-1] == EOS_TOKEN or request is None:
                continue
            tokens[-1], logprobs[req_id] = self.context_keys.answer(
                req_id, request.all_token_ids, int(request.num_computed_tokens))
        return logprobs

    def _accepted(self, num_drafts: int) -> int:
        """The stand-in rejection sampler: how many of a request's `num_drafts` drafts it accepts (the
        next count of `draft_acceptance`, cycled; all where none is given). vLLM's scheduler then rolls
        the request back by the rejected ones (`num_computed_tokens -= num_rejected`)."""
        if not num_drafts:
            return 0
        pattern = self._acceptance
        accepted = num_drafts if pattern is None else min(num_drafts, pattern[self.verifications % len(pattern)])
        self.verifications += 1
        self.drafts_rejected += num_drafts - accepted
        return accepted

    def _model_runner_output(self, output: Any, sampled: dict[str, list[int]], kv_output: Any) -> Any:
        req_ids = list(output.num_scheduled_tokens)
        return self.api.model_runner_output(req_ids, [sampled[rid] for rid in req_ids], kv_output)
