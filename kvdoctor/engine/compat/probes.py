"""Feature probes: whether the vLLM installed still has the shapes kvdoctor's adapter relies on.

Support is decided here, not by a version number: a release kvdoctor was never measured on runs
when every probe holds, and a probe that fails stops the run with exit 3, naming the probe and what
changed. Each probe answers the form it found (which calling convention, which fields) or raises
`IncompatibleVllmError`. Scheduler-side probes run on every `compat.load()` (they only inspect
classes already imported, a few milliseconds); worker-side ones (`--worker vllm`'s glue) import
more modules and run in `kvdoctor version` and before vLLM's worker is built.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdoctor.engine.compat import names, portable
from kvdoctor.engine.compat.imports import _import, _require
from kvdoctor.errors import IncompatibleVllmError

if TYPE_CHECKING:
    from kvdoctor.engine.compat import VllmApi


@dataclass(frozen=True)
class Probe:
    name: str
    relies_on: str  # what kvdoctor needs, in vLLM's names
    check: Callable[[VllmApi], str]  # the form found, or IncompatibleVllmError saying what changed
    worker_side: bool = False


@dataclass(frozen=True)
class ProbeResult:
    name: str
    relies_on: str
    holds: bool
    answer: str  # the form found, or what changed

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_names(cls: Any) -> set[str]:
    if not dataclasses.is_dataclass(cls):
        raise IncompatibleVllmError(f"{cls.__name__} is no longer a dataclass")
    return {f.name for f in dataclasses.fields(cls)}


def _needs_fields(cls: Any, wanted: set[str]) -> set[str]:
    names = _field_names(cls)
    missing = wanted - names
    if missing:
        raise IncompatibleVllmError(f"{cls.__name__} has no field {', '.join(sorted(missing))}")
    return names


def _storable_chunks(api: VllmApi) -> str:
    return "storable_chunks(" + ", ".join(api.storable_chunks_params) + ")"


def _store_pass(api: VllmApi) -> str:
    method = names.get(api.OffloadingConnectorScheduler, names.BUILD_STORE_JOBS)
    if getattr(method, "__code__", None) is None:
        raise IncompatibleVllmError(f"{names.BUILD_STORE_JOBS.where} is not a plain function")
    return ("an aborted request's store counts its computed tokens" if api.aborted_store_counts_computed_tokens
            else "no FINISHED_ABORTED case in the store pass")


def _connector_state(api: VllmApi) -> str:
    """The request states and jobs are set up in `__init__` (read later on live connectors)."""
    cls = api.OffloadingConnectorScheduler
    code = getattr(cls.__init__, "__code__", None)
    init_names = set(code.co_names) if code is not None else set()
    missing = [entry.name for entry in _CONNECTOR_STATE if not init_names & set(entry.spellings)]
    if missing:
        raise IncompatibleVllmError(f"OffloadingConnectorScheduler.__init__ no longer sets {', '.join(missing)}")
    names.get(cls, names.CALC_OFFLOADABLE_TOKENS)
    return ", ".join(entry.name for entry in (*_CONNECTOR_STATE, names.CALC_OFFLOADABLE_TOKENS))


_CONNECTOR_STATE = (names.REQ_STATUS, names.JOBS)  # instance attributes: set in __init__


def _worker_metadata(api: VllmApi) -> str:
    cls = api.cls("offload_common", "OffloadingWorkerMetadata")
    _require(cls, "mark_completed", "OffloadingWorkerMetadata")
    if portable.worker_reports_failed_jobs(cls):
        return "mark_completed(job_id, success): a failed transfer is reported"
    return "mark_completed(job_id): no failure path (transfers assert success)"


def _runner_output(api: VllmApi) -> str:
    cls = api.cls("outputs", "ModelRunnerOutput")
    _needs_fields(cls, {"req_ids", "sampled_token_ids", "kv_connector_output"})
    return ("with req_id_to_index" if portable.runner_output_takes_req_id_to_index(cls)
            else "without req_id_to_index")


def _connector_output(api: VllmApi) -> str:
    cls = api.cls("outputs", "KVConnectorOutput")
    failure_field = "failed_recving" if api.worker_reports_failed_jobs else "invalid_block_ids"
    _needs_fields(cls, {"finished_recving", "kv_connector_worker_meta", failure_field})
    return f"failed loads as {failure_field}"


def _kv_cache_tensor(api: VllmApi) -> str:
    names = _field_names(api.cls("kv_cache_interface", "KVCacheTensor"))
    if "shared_by" in names:
        return "shared_by"
    if {"layers", "layer_stride", "block_stride"} <= names:
        return "layers, layer_stride, block_stride"
    raise IncompatibleVllmError(f"KVCacheTensor has unknown fields {sorted(names)}")


def _spec_registry(api: VllmApi) -> str:
    module = names.SPEC_REGISTRY.module
    factory = _require(_import(module), "OffloadingSpecFactory", module)
    registry = names.get(factory, names.SPEC_REGISTRY)
    if not isinstance(registry, dict) or "CPUOffloadingSpec" not in registry:
        raise IncompatibleVllmError(f"{names.SPEC_REGISTRY.where} holds no CPUOffloadingSpec")
    return f"{len(registry)} offloading specs registered"


def _runner_glue(api: VllmApi) -> str:
    mods = api.worker_mods()
    forms = []
    mixin_mod = mods.get("runner_mixin")
    if mixin_mod is not None:
        mixin = _require(mixin_mod, "KVConnectorModelRunnerMixin", "kv_connector_model_runner_mixin")
        names.get(mixin, names.GET_KV_CONNECTOR_OUTPUT)
        _require(mixin, "kv_connector_no_forward", "KVConnectorModelRunnerMixin")
        forms.append("V1 KVConnectorModelRunnerMixin")
    if api.has_v2_kv_connector():
        forms.append("V2 ActiveKVConnector")
    if not forms:
        raise IncompatibleVllmError("neither V1's KVConnectorModelRunnerMixin nor Model Runner V2's "
                                    "get_kv_connector is importable")
    return ", ".join(forms)


def _worker_connector(api: VllmApi) -> str:
    mods = api.worker_mods()
    names.get(mods["kv_transfer_state"], names.KV_CONNECTOR_AGENT)
    _require(mods["connector_factory"], "KVConnectorFactory", "kv_connector.factory")
    _require(mods["forward_context"], "set_forward_context", "vllm.forward_context")
    return f"{names.KV_CONNECTOR_AGENT.name}, KVConnectorFactory, set_forward_context"


def _copy_plan(api: VllmApi) -> str:
    api.offloading_worker_base()
    api.compute_sub_block_ptrs()
    result = _require(_import("vllm.v1.kv_offload.base"), "TransferResult", "vllm.v1.kv_offload.base")
    params = set(inspect.signature(result).parameters)
    missing = {"job_id", "success", "transfer_size", "transfer_time"} - params
    if missing:
        raise IncompatibleVllmError(f"TransferResult takes no {', '.join(sorted(missing))}")
    return "OffloadingWorker, compute_sub_block_ptrs, TransferResult"


PROBES: tuple[Probe, ...] = (
    Probe("storable_chunks-signature", "RequestOffloadState.storable_chunks's parameters", _storable_chunks),
    Probe("store-pass", names.BUILD_STORE_JOBS.where, _store_pass),
    Probe("connector-state", "OffloadingConnectorScheduler's " + ", ".join(
        entry.name for entry in (*_CONNECTOR_STATE, names.CALC_OFFLOADABLE_TOKENS)), _connector_state),
    Probe("worker-metadata", "OffloadingWorkerMetadata.mark_completed", _worker_metadata),
    Probe("model-runner-output", "ModelRunnerOutput's fields", _runner_output),
    Probe("kv-connector-output", "KVConnectorOutput's fields", _connector_output),
    Probe("kv-cache-tensor", "KVCacheTensor's fields", _kv_cache_tensor),
    Probe("offloading-spec-registry", names.SPEC_REGISTRY.where, _spec_registry),
    Probe("runner-glue", "the model runners' connector calls (V1 mixin or V2 ActiveKVConnector)", _runner_glue,
          worker_side=True),
    Probe("worker-connector", "vLLM's worker-role connector set-up", _worker_connector, worker_side=True),
    Probe("copy-plan", "vLLM's OffloadingWorker, compute_sub_block_ptrs and TransferResult", _copy_plan,
          worker_side=True),
)


def run(api: VllmApi, worker_side: bool) -> list[ProbeResult]:
    """Every scheduler-side probe (and the worker-side ones with `worker_side`), each answered."""
    results = []
    for probe in PROBES:
        if probe.worker_side and not worker_side:
            continue
        try:
            results.append(ProbeResult(probe.name, probe.relies_on, True, probe.check(api)))
        except IncompatibleVllmError as exc:
            results.append(ProbeResult(probe.name, probe.relies_on, False, str(exc)))
        except Exception as exc:  # a probe that cannot answer does not hold
            results.append(ProbeResult(probe.name, probe.relies_on, False, f"{type(exc).__name__}: {exc}"))
    return results


def require(api: VllmApi, worker_side: bool) -> None:
    """Raise exit 3 naming the first probe that fails, and what changed."""
    for result in run(api, worker_side):
        if not result.holds:
            raise IncompatibleVllmError(f"vLLM {api.version_text}: probe {result.name} failed: {result.answer} "
                                        f"(kvdoctor relies on {result.relies_on}; its adapter needs an update)")
