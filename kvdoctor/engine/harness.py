"""vLLM's real Scheduler (or AsyncScheduler) with the real OffloadingConnector, in-process.

Only the worker is simulated (`SimulatedWorker`). The model config comes from a
tiny `config.json` written at run time (or a local model directory), so
nothing is downloaded.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.setup import Setup
from kvdoctor.engine.worker import Job, SimulatedWorker
from kvdoctor.errors import UsageError

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    # Long enough for production context lengths (--max-model-len 131072 and beyond);
    # vLLM refuses a max_model_len above the model's own.
    "max_position_embeddings": 1 << 20,
    "torch_dtype": "float16",
}
EOS_TOKEN = 2
DECODE_TOKEN = 7
LAYER_NAME = "model.layers.0.self_attn.attn"


@lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """A throw-away model directory holding only kvdoctor's tiny config.json."""
    directory = Path(tempfile.mkdtemp(prefix="kvdoctor-model-"))
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=2))
    return str(directory)


_MODEL_CONFIGS: dict[tuple[str, int], Any] = {}


def _model_config(api: VllmApi, model: str | None, max_model_len: int) -> Any:
    """ModelConfig is the slow part of a build (architecture inspection): build once per process."""
    path = model or tiny_model_dir()
    if model is not None and not (Path(model) / "config.json").is_file():
        raise UsageError(f"--model {model}: no config.json in that directory (kvdoctor never downloads)")
    key = (path, max_model_len)
    if key not in _MODEL_CONFIGS:
        ModelConfig = api.cls("config", "ModelConfig")
        try:
            _MODEL_CONFIGS[key] = ModelConfig(model=path, skip_tokenizer_init=True,
                                              max_model_len=max_model_len, dtype="float16", seed=0)
        except Exception as exc:  # vLLM's own validation message, one line
            raise UsageError(f"vLLM rejected the model config: {_vllm_message(exc)}") from None
    return _MODEL_CONFIGS[key]


def _vllm_message(exc: BaseException) -> str:
    """vLLM's whole validation message on one line.

    pydantic puts the reason on the lines after "1 validation error for
    ModelConfig"; only its documentation link is dropped.
    """
    lines = [" ".join(line.split()) for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not line.startswith("For further information visit")]
    return " — ".join(lines) if lines else type(exc).__name__


def build_scheduler(api: VllmApi, setup: Setup) -> Any:
    """The real scheduler with the real connector and a CPU tier of real capacity."""
    import torch

    config_mod = api.mods["config"]
    model_config = _model_config(api, setup.model, setup.max_model_len)
    scheduler_kwargs: dict[str, Any] = dict(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        async_scheduling=setup.async_scheduling,
    )
    try:
        vllm_config = config_mod.VllmConfig(
            model_config=model_config,
            cache_config=config_mod.CacheConfig(block_size=setup.block_size, enable_prefix_caching=True),
            scheduler_config=config_mod.SchedulerConfig(**scheduler_kwargs),
            kv_transfer_config=config_mod.KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=setup.kv_connector_extra_config(),
            ),
            device_config=config_mod.DeviceConfig("cpu"),
        )
    except Exception as exc:
        raise UsageError(f"vLLM rejected the configuration: {_vllm_message(exc)}") from None

    kvi = api.mods["kv_cache_interface"]
    spec = kvi.FullAttentionSpec(block_size=setup.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    page_bytes = spec.page_size_bytes
    kv_cache_config = kvi.KVCacheConfig(
        num_blocks=setup.gpu_blocks,
        # 0.26-0.29 size the CPU tier from these tensors: an empty list means 0 CPU blocks.
        kv_cache_tensors=[api.kv_cache_tensor(page_bytes * setup.gpu_blocks, LAYER_NAME, page_bytes,
                                              setup.gpu_blocks)],
        kv_cache_groups=[kvi.KVCacheGroupSpec([LAYER_NAME], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = setup.gpu_blocks

    scheduler_cls = (api.cls("async_scheduler", "AsyncScheduler") if setup.async_scheduling
                     else api.cls("scheduler", "Scheduler"))
    structured = api.cls("structured_output", "StructuredOutputManager")(vllm_config)
    try:
        return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                             structured_output_manager=structured, block_size=setup.block_size)
    except Exception as exc:
        raise UsageError(f"vLLM rejected the connector configuration: {_vllm_message(exc)}") from None


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

    def is_quiet(self) -> bool:
        return not any((self.scheduled_tokens, self.new_store_jobs, self.new_load_jobs, self.jobs_to_flush,
                        self.completed_jobs, self.failed_jobs, self.preempted, self.finished,
                        self.reused_while_storing))


class Harness:
    """Drives one scheduler through add / step / abort / finish, like an engine core would."""

    def __init__(self, api: VllmApi, setup: Setup) -> None:
        self.api = api
        self.setup = setup
        self.scheduler = build_scheduler(api, setup)
        self.connector_scheduler = api.connector_scheduler(self.scheduler)
        self.worker = SimulatedWorker()
        self.requests: dict[str, Any] = {}
        self.step_index = 0
        self._finish_next: set[str] = set()
        self._pending_output: tuple[Any, Any] | None = None  # async: last step's output, not yet applied
        self.store_jobs_by_request: dict[str, list[int]] = {}
        self._block_hasher = self._make_block_hasher()

    def _make_block_hasher(self) -> Any:
        kcu = self.api.mods["kv_cache_utils"]
        sha256 = self.api.mods["hashing"].sha256
        kcu.init_none_hash(sha256)
        return kcu.get_request_block_hasher(self.setup.block_size, sha256)

    # -- requests --------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        Request = self.api.cls("request", "Request")
        SamplingParams = self.api.cls("sampling_params", "SamplingParams")
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, stop_token_ids=[EOS_TOKEN]),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.requests[req_id] = request
        self.scheduler.add_request(request)

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
        return bool(ok)

    def drain(self) -> bool:
        """Apply the output still in flight (async scheduling), as an engine that goes idle does."""
        if self._pending_output is None:
            return False
        pending, self._pending_output = self._pending_output, None
        self.scheduler.update_from_output(*pending)
        return True

    def shutdown(self) -> None:
        """Release what the connector holds (the tiering spec maps a file in /dev/shm)."""
        try:
            self.scheduler.shutdown()
        except Exception:  # noqa: BLE001 - a crashed scheduler may not shut down cleanly
            pass

    # -- one engine step ------------------------------------------------
    def step(self) -> StepEvents:
        """schedule(), the worker's output, update_from_output(); async applies it one step late."""
        self.step_index += 1
        events = StepEvents()
        output = self.scheduler.schedule()
        events.scheduled_tokens = dict(output.num_scheduled_tokens)
        events.preempted = sorted(getattr(output, "preempted_req_ids", None) or ())
        events.finished = sorted(output.finished_req_ids or ())
        store_jobs, load_jobs = self.api.store_and_load_jobs(output)
        meta = getattr(output, "kv_connector_metadata", None)
        flush = set(getattr(meta, "jobs_to_flush", None) or ())
        events.jobs_to_flush = sorted(flush)
        allocated = self.api.allocated_block_ids(output, self.setup.block_size)
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
            dst = self.api.block_ids_of(getattr(job, "dst_spec", None))
            new_jobs.append(Job(jid, job.req_id, "load", self.step_index, dst))
        report = self.worker.take_step(new_jobs, flush, self.step_index)
        events.completed_jobs = [job.job_id for job in report.completed]
        events.failed_jobs = [job.job_id for job in report.failed]
        runner_output = self._model_runner_output(output, report)
        if self.setup.async_scheduling:
            previous, self._pending_output = self._pending_output, (output, runner_output)
            if previous is not None:
                self.scheduler.update_from_output(*previous)
        else:
            self.scheduler.update_from_output(output, runner_output)
        return events

    def _model_runner_output(self, output: Any, report: Any) -> Any:
        outputs = self.api.mods["outputs"]
        WorkerMeta = self.api.cls("offload_common", "OffloadingWorkerMetadata")
        meta = WorkerMeta()
        for job in report.completed + report.failed:
            meta.mark_completed(job.job_id)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            # A token is sampled only once every known token is computed (not mid-prefill).
            if request is not None and request.num_computed_tokens >= request.num_tokens:
                token = EOS_TOKEN if req_id in self._finish_next else DECODE_TOKEN
                self._finish_next.discard(req_id)
                sampled.append([token])
            else:
                sampled.append([])
        kv_output = outputs.KVConnectorOutput(
            kv_connector_worker_meta=meta,
            finished_recving=report.finished_recving or None,
            invalid_block_ids=report.invalid_block_ids,
        )
        return outputs.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
