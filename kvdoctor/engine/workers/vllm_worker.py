"""vLLM's worker side for real: the WORKER-role OffloadingConnector on KV tensors of fingerprints.

Each step goes through the connector calls of the model runner a deployment would use:
V1 `GPUModelRunner` (`handle_preemptions`, then `KVConnectorModelRunnerMixin`'s
`_get_kv_connector_output` around the forward, or `kv_connector_no_forward`), or Model
Runner V2's `ActiveKVConnector` (`pre_forward` / `post_forward` / `no_forward`). The
forward is kvdoctor's toy model (`toy_model.py`); transfers are kvdoctor's copy engine
on a CPU (`copy_engine.py`, loaded by vLLM itself as `Kvdoctor<spec>`) or, with
`--device cuda`, vLLM's own `CPUOffloadingSpec` worker doing CUDA copies, unchanged.
On a CPU the KV bytes are fingerprints sized by what the content checks need (`fingerprint.py`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from kvdoctor.engine.answer_key import POISON_BYTE
from kvdoctor.engine.compat.canonical_mapping import check_run as check_canonical_pages
from kvdoctor.engine.worker import Job, Rule
from kvdoctor.engine.workers.base import WorkerStep
from kvdoctor.engine.workers.copy_engine import TransferControl
from kvdoctor.engine.workers.cpu_copy_spec import CONTROL_KEY, CONTROLS
from kvdoctor.engine.workers.fingerprint import fingerprint_plan
from kvdoctor.engine.workers.toy_model import ContentFinding, ToyModel, check_attention_only
from kvdoctor.errors import UsageError

_IDS = itertools.count(1)


class VllmWorker:
    name = "vllm"

    def __init__(self, api: Any, scheduler: Any, device: str, model_runner: str) -> None:
        assert api.worker_side_checked  # the worker-side probes, asked once: exit 3 naming one that fails
        self.api = api
        self.device = device
        self.model_runner = model_runner
        self.vllm_config = api.vllm_config_of(scheduler)
        self.kv_cache_config = api.kv_cache_config_of(scheduler)
        self.in_flight: dict[int, Job] = {}
        self._holds: list[Rule] = []
        # Under vLLM's MultiConnector (Setup.multi_connector) its worker builds every sub-connector's worker from
        # the `connectors` list: each OffloadingConnector gets a copy engine of its own, found by its own control
        # id in its own extra config. The first (index 0) is the one kvdoctor watches: recipe holds, completions,
        # failures and the toy model's store checks are its; the others' jobs complete as soon as vLLM's worker
        # asks (they stand for other asynchronous connectors) and move their bytes all the same.
        subs = api.sub_connector_configs(self.vllm_config)
        configs = subs if subs is not None else [self.vllm_config]
        self.controls = [TransferControl() for _ in configs]
        self.control = self.controls[0]
        self.control_ids = [f"kvdoctor-{next(_IDS)}" for _ in configs]
        for control_id, control, config in zip(self.control_ids, self.controls, configs, strict=True):
            CONTROLS[control_id] = control
            # The worker's spec reads its extra config when the worker connector is created.
            config.kv_transfer_config.kv_connector_extra_config[CONTROL_KEY] = control_id
        check_attention_only(api, self.kv_cache_config)  # before vLLM's connector sees the caches
        # The worker's KV tensors hold fingerprints (16 bytes a token slot, one layer a group) where a GPU holds
        # the model's pages; the scheduler plans with the real config and the CPU tier keeps its slot count
        # (fingerprint.py), each connector its own. With --device cuda, vLLM's own CUDA worker runs over the real
        # pages (GPU memory).
        self.fingerprint = None if device == "cuda" else fingerprint_plan(api, configs[0], self.kv_cache_config)
        self.worker_kv_cache_config = self.kv_cache_config
        if self.fingerprint is not None:
            self.fingerprint.refuse_beyond_memory()  # one line, exit 2, before anything is allocated
            self.worker_kv_cache_config = self.fingerprint.config
            self.control.cpu_slots = self.fingerprint.cpu_slots
            for control, config in zip(self.controls[1:], configs[1:], strict=True):
                control.cpu_slots = api.offloading_cpu_blocks(config, self.kv_cache_config)
        self.kv_caches = api.allocate_kv_caches(self.worker_kv_cache_config, device, POISON_BYTE,
                                                api.required_kv_cache_layout(scheduler))
        self.connector = api.create_worker_connector(self.vllm_config, self.worker_kv_cache_config)
        self._v2: Any = None  # Model Runner V2's ActiveKVConnector (vLLM's), under --model-runner v2
        with api.active_worker_connector(self.connector):
            if model_runner == "v2":
                if not api.has_v2_kv_connector():
                    raise UsageError("--model-runner v2: this vLLM has no Model Runner V2 connector glue")
                self._v2 = api.v2_connector(self.vllm_config, self.kv_caches)
            else:  # V1 GPUModelRunner.initialize_kv_cache -> register_kv_caches
                self.connector.register_kv_caches(self.kv_caches)
        self.model = ToyModel.over(api, self.worker_kv_cache_config, self.kv_caches, model_runner)
        # vLLM derived this worker's canonical page mapping above at the run's TP size; its promise holds at every
        # TP size (a chunk stored under one is loadable under another): judged once, reported at the first step.
        self.model.findings += [ContentFinding("canonical-page-is-tp1-page", "(no request)", "(canonical page)", 0, 0,
                                               problem)
                                for problem in check_canonical_pages(self.vllm_config, self.kv_cache_config)]
        self.control.on_store_copy = lambda job, blocks: self.model.store_copied(job, blocks)
        self.control.on_load_mismatch = self._load_mismatch
        self.engine = self.control.engine  # None with vLLM's own (CUDA) worker

    # -- transfer control (recipe steps) ----------------------------------------
    def _controllable(self, what: str) -> None:
        if self.engine is None:
            raise UsageError(f"{what} needs kvdoctor's copy engine (--device cpu): vLLM's own CUDA worker "
                             f"completes transfers when the GPU does")

    def hold(self, request: str | None = None, kind: str | None = None) -> None:
        self._controllable("hold_transfers")
        self._holds.append(Rule(request, kind))

    def _release(self, request: str | None, kind: str | None, into: set[int]) -> list[int]:
        rule = Rule(request, kind)
        chosen = [jid for jid, job in self.in_flight.items() if rule.matches(job)]
        for jid in chosen:
            self.control.held.discard(jid)
            into.add(jid)
        self._holds = [r for r in self._holds
                       if not ((request is None or r.request == request) and (kind is None or r.kind == kind))]
        return chosen

    def complete(self, request: str | None = None, kind: str | None = None) -> list[int]:
        if self.engine is None:
            return []
        return self._release(request, kind, self.control.release_now)

    def fail(self, request: str | None = None, kind: str | None = None) -> list[int]:
        """Report matching jobs with success=False: what this release's connector does with a
        failed transfer is vLLM's behaviour (0.26-0.33 assert every transfer succeeded)."""
        self._controllable("fail_transfers")
        return self._release(request, kind, self.control.failed)

    def forget(self) -> None:
        """A connector reset drops the scheduler's jobs; the worker's copies still run and report."""

    # -- one step -----------------------------------------------------------------
    def run_step(self, output: Any, new_jobs: list[Job], jobs_to_flush: set[int], step: int,
                 sampled: dict[str, list[int]]) -> WorkerStep:
        store_jobs, _ = self.api.store_and_load_jobs(output)  # copy: handle_preemptions pops flushed jobs
        # (the watched connector's: the first sub-connector's under a MultiConnector)
        for job in new_jobs:
            self.in_flight[job.job_id] = job
            if any(rule.matches(job) for rule in self._holds):
                self.control.held.add(job.job_id)
        with self.api.active_worker_connector(self.connector):
            kv_output = self._step_v2(output, sampled) if self._v2 is not None else self._step_v1(output, sampled)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        for jid, job in store_jobs.items():
            spec = getattr(job, "src_spec", None)
            sizes, _ = self.api.gpu_spec_groups(spec, num_groups)
            self.model.expect_store(int(jid), job.req_id, self.api.block_ids_of(spec), sizes)
        completed = self.api.completed_job_ids(kv_output, 0)  # the watched connector's (job ids overlap)
        failed = self.api.failed_job_ids(kv_output, 0)
        for jid in completed + failed:
            self.in_flight.pop(jid, None)
        findings, self.model.findings = self.model.findings, []
        return WorkerStep(kv_output, completed, failed, findings)

    def _step_v1(self, output: Any, sampled: dict[str, list[int]]) -> Any:
        """vllm/v1/worker/gpu_model_runner.py: the connector calls of execute_model."""
        mixin = self.api.runner_mixin()
        self.connector.handle_preemptions(output.kv_connector_metadata)
        self.model.update_states(output)
        if not output.total_num_scheduled_tokens:
            return self.api.v1_no_forward_output(mixin, output, self.vllm_config)
        with self.api.forward_context(self.vllm_config), self.api.v1_forward_output(mixin, output) as kvo:
            self.model.forward(output, sampled)
        return kvo

    def _step_v2(self, output: Any, sampled: dict[str, list[int]]) -> Any:
        """vllm/v1/worker/gpu/model_runner.py (Model Runner V2) through its ActiveKVConnector."""
        self.model.update_states(output)
        if not output.total_num_scheduled_tokens:
            return self._v2.no_forward(output).kv_connector_output
        self._v2.pre_forward(output)
        with self.api.forward_context(self.vllm_config):
            self.model.forward(output, sampled)
        self.api.v2_finish_forward(self._v2)
        return self._v2.post_forward(output.finished_req_ids)

    def _load_mismatch(self, job: int, gpu_block: int, cpu_slot: int, found: str) -> None:
        owner = self.in_flight.get(job)
        request = owner.req_id if owner else "?"
        self.model.findings.append(ContentFinding(
            "load-returns-stored-bytes", request, "(page)", self.model.positions_of(request, gpu_block), gpu_block,
            f"CPU slot {cpu_slot} returned {found}", job))

    def describe(self) -> str:
        copies = ("kvdoctor's CPU copy engine (vLLM's copy plan, memmove)" if self.engine is not None
                  else "vLLM's CPUOffloadingWorker (CUDA copies)")
        glue = "ActiveKVConnector" if self._v2 is not None else "KVConnectorModelRunnerMixin"
        role = ("vLLM worker-role MultiConnector (two OffloadingConnectors, the first watched)"
                if len(self.controls) > 1 else "vLLM worker-role OffloadingConnector")
        return (f"{role} via model runner {self.model_runner} ({glue}), "
                f"KV tensors on {self.device}, transfers by {copies}"
                + (f"; {self.fingerprint.describe()}" if self.fingerprint is not None else ""))

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # a crashed run may not shut down cleanly
            self.connector.shutdown()
        for control_id, control in zip(self.control_ids, self.controls, strict=True):
            CONTROLS.pop(control_id, None)
            # This run's KV tensors (a fingerprint page per block, and the copy engine's CPU tier) go with it: the
            # next variant allocates its own (kept, three variants of a pool tripled the peak).
            if control.engine is not None:  # vLLM's spec keeps its worker: drop the copy engine's tensors themselves
                control.engine.gpu_tensors, control.engine.cpu_tensors, control.engine.stored = [], [], {}
            control.engine = None
        self.model.release()
        self.engine = self.kv_caches = self.connector = self._v2 = None
