"""`StandInExecutor`: a vLLM `Executor` that stands where the GPU workers run (vLLM only).

The one definition of the executor's answers to `EngineCore` (KV specs, memory,
`initialize_from_config`, the RPCs of each release, `execute_model` / `sample_tokens`), used two
ways, so the two can never drift apart:

- kvdoctor's own `KvdoctorExecutor` (kvdoctor/engine/core/executor.py) subclasses it and hands each
  step to kvdoctor's worker side (the in-process harness, or its simulated worker in a serve child);
- a script exported with `--export-script FILE --engine serve` embeds this file verbatim (with the
  adapter's `portable` reads copied in) as the stand-in package beside itself, and `vllm serve` loads
  it by its qualified name (`--distributed-executor-backend kvrepro_standin.executor.StandInExecutor`).
  This file therefore imports only vLLM and the standard library (`tests/test_engine_export.py`).

Standing alone it runs no model: one decode token is sampled per request that finished its prefill
(EOS only where the client's `vllm_xargs` asked for it, else requests end at max_tokens), and every
KV transfer the OffloadingConnector issues completes on the step it is issued, except those the recipe's
executor plan (`PLAN_ENV`, `levels/serve.executor_plan`) holds: the watched (first) connector's jobs stay in
flight, uncopied, until the plan completes them or the scheduler flushes them (a MultiConnector's
sub-connectors each report their own jobs, `transfers`). With `KV_ANSWERS_ENV=1`
(an exported script's silent recipe) it keeps KV as the toy model does, one 64-bit key a slot
(`StandInKv`): each step writes its scheduled tokens' keys, the connector's loads and stores copy slots
between the blocks and the CPU tier's chunks their jobs name, and each sampled token is the stand-in
model's answer read from the request's slots (`answer_key.answer_of`): a never-written, stale or
foreign slot gives another token, as it does at `--engine core`. Everything on the
scheduler side (the Scheduler, the connector's scheduler side, the CPU manager) is vLLM's own. Each
step up to `PACE_STEPS_ENV` (the engine step after the client's last event; unset: every step) sleeps
`STEP_SECONDS_ENV` seconds, so that client traffic lands between engine steps, and every step logs
one line (`kvdoctor-engine step N: {...}`) saying what was scheduled and finished: the client reads
it to tell whether an aborted request was still queued.
As vLLM's GPU model runner, `execute_model` returns None when tokens were scheduled and the output
comes from `sample_tokens`: `EngineCore.step` and `step_with_batch_queue` rely on that.
"""

import json
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.logger import init_logger
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

# The stand-in model's keys and answer (standard library only); an export copies their one definition in here.
from kvdoctor.engine.answer_key import POISON_WORD, answer_of, next_key, words_bytes

# The adapter's vLLM-only reads and feature probes; an export copies their one definition in here.
from kvdoctor.engine.compat.portable import (
    default_kv_cache_layouts,
    multi_worker_metadata,
    resumed_req_ids,
    runner_output_takes_req_id_to_index,
    spec_block_ids,
    sub_connector_metadatas,
)

logger = init_logger("vllm.kvrepro.executor")  # under "vllm": the server's own log handler
STEP_LOG_PREFIX = "kvdoctor-engine step"  # the serve client reads it (serve_client.py; tests check both agree)
DECODE_TOKEN = 7
EOS_TOKEN = 2  # kvdoctor's stop token (step_loop.EOS_TOKEN): its clients send it as their stop_token_ids
EOS_AFTER_ARG = "kvdoctor_eos_after"  # a request's vllm_xargs: its (N+1)-th sampled token is EOS (names.py)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class StandInExecutor(Executor):
    uses_ray = False
    supports_pp = False
    STEP_SECONDS_ENV = "KVREPRO_STEP_SECONDS"  # pace the steps so client events land between them
    # how many engine steps are paced (unset: all): past the client's last event nothing lands between steps
    PACE_STEPS_ENV = "KVREPRO_PACE_STEPS"
    ADMISSION_ENV = "KVREPRO_ADMISSION_LEN"  # the max_model_len of the start-up admission check
    KV_ANSWERS_ENV = "KVREPRO_KV_ANSWERS"  # "1": keep KV keys and answer from them (`StandInKv`)
    # the recipe's executor plan (JSON, `levels/serve.executor_plan`): holds and completions of the watched
    # connector's transfers and late EOS, by engine step, each naming its request by the tag in its request id
    PLAN_ENV = "KVREPRO_PLAN"
    NO_MEMORY_REASON = "the stand-in executor measures no device memory"

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.step_seconds = float(os.environ.get(self.STEP_SECONDS_ENV, "0") or 0)
        paced = os.environ.get(self.PACE_STEPS_ENV)
        self.pace_steps = int(paced) if paced else None
        admission = os.environ.get(self.ADMISSION_ENV)
        self.admission_len = int(admission) if admission else None
        self.original_len: int | None = None
        self.to_sample: deque[Any] = deque()
        self.num_tokens: dict[str, int] = {}
        self.eos_after: dict[str, int] = {}  # request -> sampled tokens before its EOS (its client's vllm_xargs)
        self.num_sampled: dict[str, int] = {}
        self.steps = 0
        self.asleep: set[str] = set()  # sleep mode: what a GPU worker would have released ("weights", "kv_cache")
        self.plan: list[dict[str, Any]] = json.loads(os.environ.get(self.PLAN_ENV) or "[]")
        self.eos_at = {entry["tag"]: int(entry["step"]) for entry in self.plan if entry["action"] == "eos"}
        # the stand-in's own transfer steps (kvdoctor's executor plays them on its worker instead)
        self.due = sorted((e for e in self.plan if e["action"] in ("hold", "complete")), key=lambda e: int(e["step"]))
        self.holds: list[tuple[str | None, str | None]] = []  # (request tag, kind): None matches any
        self.held: dict[int, tuple[str, Any]] = {}  # the watched connector's held jobs: id -> (kind, job)
        self.released: list[int] = []  # held jobs completing in this step (a completion or a flush)
        self.kv: StandInKv | None = None
        transfer = self.vllm_config.kv_transfer_config
        if os.environ.get(self.KV_ANSWERS_ENV) == "1":
            block_size = int(self.vllm_config.cache_config.block_size)
            extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer else {}
            configs = [dict(c.get("kv_connector_extra_config") or {}) for c in extra.get("connectors") or ()]
            if getattr(transfer, "kv_connector", None) != "MultiConnector" or not configs:
                configs = [extra]  # one connector (or none: the reference)
            self.kv = StandInKv(block_size, [max(1, int(c.get("block_size", block_size)) // block_size)
                                             for c in configs])

    # -- start-up ---------------------------------------------------------------------------
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        """The pool is deliberately tiny (--num-gpu-blocks-override): vLLM's start-up check that one
        max_model_len request fits runs with `admission_len`, restored before the scheduler is built."""
        if self.admission_len is not None:
            model_config = self.vllm_config.model_config
            self.original_len = model_config.max_model_len
            model_config.max_model_len = min(self.original_len, self.admission_len)
        return [self.layer_specs()]

    def layer_specs(self) -> dict[str, Any]:
        """One full-attention spec per decoder layer of the model config (the tiny Llama)."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        spec = FullAttentionSpec(block_size=self.vllm_config.cache_config.block_size,
                                 num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=mc.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}

    def determine_available_memory(self) -> list[int]:
        return [1 << 40]  # --num-gpu-blocks-override decides the pool

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        if self.original_len is not None:
            self.vllm_config.model_config.max_model_len = self.original_len
            self.original_len = None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False, **_: Any) -> Any:
        """Everything else EngineCore asks of 'all workers': one answer per worker (one here). A method
        `rpc_<name>` gives the answers that matter; any other call is answered None."""
        kwargs = kwargs or {}
        if callable(method):
            results = [method(self, *args, **kwargs)]
        else:
            handler = getattr(self, f"rpc_{method}", None)
            results = handler(*args, **kwargs) if handler is not None else [None]
        return _done(results) if non_block else results

    def rpc_get_supported_tasks(self) -> list[tuple[str, ...]]:
        return [("generate",)]

    def rpc_get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []  # the OffloadingConnector has no handshake

    def rpc_compile_or_warm_up_model(self) -> list[Any]:
        return []  # 0.27+: no CompilationTimes (the list is read only when non-empty)

    def rpc_get_supported_kv_cache_layouts(self) -> list[list[str]]:
        """0.33+: each worker's KV layouts, most preferred first: what the connector requires, then vLLM's."""
        return [default_kv_cache_layouts()]

    def rpc_extensible_kv_cache_unsupported_reason(self) -> list[str]:
        return [self.NO_MEMORY_REASON]  # 0.34: the extensible KV cache stays off

    def rpc_sleep(self, level: int = 1) -> list[None]:
        """vLLM's sleep mode (`Executor.sleep` asks every worker): a GPU worker offloads (level 1) or drops (2) its
        weights and discards its KV cache. The stand-in holds no weights and no KV (it stands in for the model):
        it records what a worker would have released; vLLM's Executor keeps its own sleeping tags."""
        self.asleep = {"weights", "kv_cache"}
        return [None]

    def rpc_wake_up(self, tags: list[str] | None = None) -> list[None]:
        """The worker's memory back (all of it, or the `tags` named)."""
        self.asleep = set() if tags is None else self.asleep - set(tags)
        return [None]

    # -- one step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if self.asleep and scheduler_output.total_num_scheduled_tokens > 0:
            released = ", ".join(sorted(self.asleep))
            exc = RuntimeError(f"the engine scheduled a step while its executor sleeps ({released} released): a GPU "
                               f"worker has no weights or KV cache to run it with")
            if non_block:
                return _failed(exc)
            raise exc
        try:
            output = self.run_step(scheduler_output)
        except Exception as exc:  # the engine sees it where a GPU worker's error surfaces
            if non_block:
                return _failed(exc)
            raise
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.to_sample.append(output)
            output = None
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self.to_sample.popleft()
        return _done(output) if non_block else output

    def take_draft_token_ids(self) -> None:
        return None

    def run_step(self, so: Any) -> Any:
        self.steps += 1
        if self.step_seconds and (self.pace_steps is None or self.steps <= self.pace_steps):
            time.sleep(self.step_seconds)
        return self.step_output(so)

    def step_output(self, so: Any) -> Any:
        """One decode token for each request that has computed all its known tokens; the step's log line;
        the transfers' report (`transfers`)."""
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ()
            self.num_tokens[new.req_id] = len(tokens)
            computed[new.req_id] = new.num_computed_tokens
            extra = getattr(getattr(new, "sampling_params", None), "extra_args", None) or {}
            if EOS_AFTER_ARG in extra:
                self.eos_after[new.req_id] = int(extra[EOS_AFTER_ARG])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {}
        for req_id in req_ids:
            after = computed.get(req_id, 0) + so.num_scheduled_tokens[req_id]
            known = self.num_tokens.get(req_id, after)
            if after >= known:  # prefill done: one token sampled
                self.num_tokens[req_id] = known + 1
                sampled[req_id] = [self.choose_token(req_id)]
            else:
                sampled[req_id] = []
        for req_id in so.finished_req_ids or ():
            for table in (self.num_tokens, self.eos_after, self.num_sampled):
                table.pop(req_id, None)
        kv_output = self.transfers(so, sampled)
        logger.info("%s %d: %s", STEP_LOG_PREFIX, self.steps, json.dumps({
            "scheduled": dict(so.num_scheduled_tokens), "finished": sorted(so.finished_req_ids or ())}))
        kwargs = {"req_ids": req_ids, "sampled_token_ids": [sampled[r] for r in req_ids],
                  "kv_connector_output": kv_output}
        if runner_output_takes_req_id_to_index(ModelRunnerOutput):
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return ModelRunnerOutput(**kwargs)

    def choose_token(self, req_id: str) -> int:
        """The token a request samples once its prefill is done: EOS where its client asked for it
        (`EOS_AFTER_ARG`) or where the plan finishes it at this engine step or before (a `finish` after the
        request ran: the client cannot send it with the request), else DECODE_TOKEN (kvdoctor's executor
        replaces it by the stand-in model's answer in `transfers`)."""
        count = self.num_sampled.get(req_id, 0)
        self.num_sampled[req_id] = count + 1
        for tag, step in list(self.eos_at.items()):  # the plan's late finish: EOS from its engine step on
            if tag in req_id and self.steps >= step:
                del self.eos_at[tag]
                return EOS_TOKEN
        return EOS_TOKEN if self.eos_after.get(req_id) == count else DECODE_TOKEN

    def transfers(self, so: Any, sampled: dict[str, list[int]]) -> Any:
        """What the worker-role connector reports (a MultiConnector's: one report per sub-connector): every
        transfer completes on the step it is issued, except the watched (first) connector's jobs the plan
        holds, which complete, and are copied, only when the plan completes them or the scheduler flushes
        them (`jobs_to_flush`). With `StandInKv` the step's copies and forward run here, in that order."""
        meta = getattr(so, "kv_connector_metadata", None)
        if meta is None:
            if self.kv is not None:
                self.kv.step(so, sampled, [], [])
            return None
        self.play_plan()
        subs = sub_connector_metadatas(meta)
        completed: list[list[int]] = [[] for _ in subs]
        before: list[tuple[int, str, Any]] = []  # copies before the forward: released jobs, then new loads
        after: list[tuple[int, str, Any]] = []  # the step's new stores, after the forward
        finished_recving: set[str] = set()
        self.released.extend(jid for jid in getattr(subs[0], "jobs_to_flush", None) or () if jid in self.held)
        for jid in dict.fromkeys(self.released):
            kind, job = self.held.pop(jid)
            completed[0].append(jid)
            before.append((0, kind, job))
            if kind == "load":
                finished_recving.add(job.req_id)
        self.released = []
        for index, sub in enumerate(subs):
            for kind in ("load", "store"):
                for jid, job in dict(getattr(sub, f"{kind}_jobs", None) or {}).items():
                    if index == 0 and self.is_held(kind, job.req_id):
                        self.held[jid] = (kind, job)
                        continue
                    completed[index].append(jid)
                    (before if kind == "load" else after).append((index, kind, job))
                    if kind == "load":
                        finished_recving.add(job.req_id)
        if self.kv is not None:
            self.kv.step(so, sampled, before, after)
        parts = []
        for jobs in completed:
            part = OffloadingWorkerMetadata()
            for jid in jobs:
                part.mark_completed(jid)
            parts.append(part)
        worker_meta = parts[0] if len(subs) == 1 and subs[0] is meta else multi_worker_metadata(parts)
        return KVConnectorOutput(finished_recving=finished_recving or None, kv_connector_worker_meta=worker_meta)

    def play_plan(self) -> None:
        """The plan's transfer steps due by this engine step, in order, as kvdoctor's worker plays them
        (`worker.SimulatedWorker`: a hold applies to jobs issued after it; a completion releases the matching
        held jobs and ends the hold)."""
        while self.due and int(self.due[0]["step"]) <= self.steps:
            entry = self.due.pop(0)
            rule = (entry.get("tag"), entry.get("kind"))
            if entry["action"] == "hold":
                self.holds.append(rule)
                continue
            self.holds = [h for h in self.holds if not self.covers(rule, *h)]
            self.released.extend(jid for jid, (kind, job) in self.held.items() if self.covers(rule, job.req_id, kind))

    @staticmethod
    def covers(rule: tuple[str | None, str | None], req_id: str | None, kind: str | None) -> bool:
        """Whether a (request tag, kind) rule names this request id and kind (None: any)."""
        tag, wanted = rule
        return (tag is None or (req_id is not None and tag in req_id)) and (wanted is None or wanted == kind)

    def is_held(self, kind: str, req_id: str) -> bool:
        return any(self.covers(rule, req_id, kind) for rule in self.holds)


class StandInKv:
    """KV as the toy model keeps it, without tensors: one 64-bit key a slot (the key of its token prefix,
    `answer_key.next_key`), in `block_size`-slot blocks and each connector's CPU tier (a MultiConnector's
    sub-connectors each their own) of chunks of `blocks_per_chunk[tier]` blocks. A slot never written holds
    POISON_WORD. The copies the executor gives `step` run before the step's forward (loads, and held jobs
    released late: a held store reads its blocks when it completes), the forward writes its scheduled tokens'
    keys, a sampled token is the stand-in's answer from the slots the request's last position reads, the
    step's new stores copy blocks into chunks after it."""

    def __init__(self, block_size: int, blocks_per_chunk: list[int]) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.blocks: dict[int, list[int]] = {}  # GPU block -> its slots' keys
        self.chunks: dict[tuple[int, int, int], list[int]] = {}  # (tier, CPU chunk, block in it) -> slots' keys
        self.tokens: dict[str, list[int]] = {}
        self.keys: dict[str, list[int]] = {}  # each request's prefix keys, from its tokens (what right KV holds)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, so: Any, sampled: dict[str, list[int]], before: list[tuple[int, str, Any]],
             after: list[tuple[int, str, Any]]) -> None:
        """One engine step: `before` copies, the forward, `after` copies (each (tier, "load" | "store", job))."""
        self.admit(so)
        for tier, kind, job in before:
            self.copy(tier, kind, job)
        for req_id, count in so.num_scheduled_tokens.items():
            self.forward(req_id, int(count), sampled.get(req_id))
        for tier, kind, job in after:
            self.copy(tier, kind, job)
        for req_id in so.finished_req_ids or ():
            for table in (self.tokens, self.keys, self.tables, self.computed):
                table.pop(req_id, None)

    def admit(self, so: Any) -> None:
        """The step's requests: tokens and block tables, as a model runner keeps them."""
        for new in so.scheduled_new_reqs:
            prompt = list(getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ())
            known = self.tokens.get(new.req_id, [])
            if not (len(known) > len(prompt) and known[:len(prompt)] == prompt):  # a resumed request keeps its own
                self.tokens[new.req_id], self.keys[new.req_id] = prompt, []
            self.tables[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
            self.computed[new.req_id] = int(new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                self.tables[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self.tables.setdefault(req_id, []).extend(new_ids[0])
            self.computed[req_id] = int(cached.num_computed_tokens[i])

    def copy(self, tier: int, kind: str, job: Any) -> None:
        """One job's copy: a load from `tier`'s chunks into GPU blocks, a store from GPU blocks into them."""
        empty = [POISON_WORD] * self.block_size
        if kind == "load":
            for block, chunk in self.pairs(tier, spec_block_ids(job.dst_spec), spec_block_ids(job.src_spec)):
                self.blocks[block] = list(self.chunks.get(chunk) or empty)
        else:
            for block, chunk in self.pairs(tier, spec_block_ids(job.src_spec), spec_block_ids(job.dst_spec)):
                self.chunks[chunk] = list(self.blocks.get(block) or empty)

    def pairs(self, tier: int, blocks: list[int], chunks: list[int]) -> list[tuple[int, tuple[int, int, int]]]:
        """(GPU block, (tier, CPU chunk, block in it)) of one job; a job of fewer blocks than its chunks hold
        covers the last ones (the first chunk's leading blocks are already on the GPU)."""
        per_chunk = self.blocks_per_chunk[min(tier, len(self.blocks_per_chunk) - 1)]
        subs = [(tier, chunk, j) for chunk in chunks for j in range(per_chunk)]
        return list(zip(blocks, subs[len(subs) - len(blocks):] if len(blocks) <= len(subs) else subs, strict=False))

    def forward(self, req_id: str, count: int, out: list[int] | None) -> None:
        tokens, table = self.tokens.get(req_id), self.tables.get(req_id, [])
        if tokens is None:
            return
        start = self.computed.get(req_id, 0)
        end = min(start + count, len(tokens))
        keys = self.keys.setdefault(req_id, [])
        while len(keys) < end:
            keys.append(next_key(keys[-1] if keys else 0, tokens[len(keys)]))
        size = self.block_size
        for position in range(start, end):
            if position // size < len(table):
                self.blocks.setdefault(table[position // size], [POISON_WORD] * size)[position % size] = keys[position]
        if out and out[-1] != EOS_TOKEN and end == start + count:
            words = [self.blocks.get(table[p // size], [POISON_WORD] * size)[p % size] if p // size < len(table)
                     else POISON_WORD for p in range(end)]
            out[-1] = answer_of(words_bytes(words))[0]
        tokens.extend(out or ())
        self.computed[req_id] = start + count
