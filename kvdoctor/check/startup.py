"""vLLM's start-up path, stage by stage, on this CPU: as far as it goes without a GPU.

1. config: vLLM's `VllmConfig` (its `KVTransferConfig`, `CacheConfig`, `SchedulerConfig`,
   `ParallelConfig`) from the flags, the kv-transfer config passed as given;
2. planning: vLLM's KV cache planner over the model's layer layout (`kv_layout.plan`, as recipes run);
3. offloading: `build_offloading_config` and the spec factory, as `OffloadingConnector.__init__` calls
   them; the spec sizes its CPU tier;
4. host: that tier (one per data-parallel engine) against the host's memory, and a /dev/shm region
   against /dev/shm: vLLM maps and populates it at start-up, and a region the host cannot hold fails there;
5. scheduler: vLLM's scheduler with the connector, its scheduler side started (a spec whose scheduler side
   maps a shared region larger than `MAX_MAPPED_REGION` is not started here: said in the notes).
kvdoctor's tiny model config stands in for the weights; the KV layout is read from `--model`'s config.json.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdoctor.check.flags import DEFAULT_GPU_BLOCKS, CheckFlags
from kvdoctor.check.result import Refusal, Stage
from kvdoctor.engine.compat import startup as vllm_startup
from kvdoctor.engine.memory import physical_memory_bytes, shm_bytes
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

MAX_MAPPED_REGION = 256 << 20  # a shared region kvdoctor maps here to start the scheduler side for real


@dataclass
class Startup:
    """What one pass over the stages gave."""

    stages: list[Stage]
    refusal: Refusal | None
    notes: list[str]
    region_bytes: int | None = None
    host_bytes: int | None = None
    host_source: str = ""


class _Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def vllm_site(exc: BaseException) -> tuple[str | None, str]:
    """(file:line of the traceback's last frame inside vLLM, that frame's statement)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}vllm{os.sep}" in f.filename]
    if not frames:
        return None, ""
    last = frames[-1]
    path = last.filename
    relative = path[path.rindex(f"{os.sep}vllm{os.sep}") + 1:]
    return f"{relative}:{last.lineno}", (last.line or "").strip()


def refusal_of(stage: str, exc: BaseException) -> Refusal:
    site, statement = vllm_site(exc)
    message = " ".join(str(exc).split()) or statement or type(exc).__name__
    statement = statement.removesuffix("(").rstrip().removesuffix(",")  # a multi-line assert's first line
    if isinstance(exc, AssertionError) and statement and statement not in message:
        message = f"{statement}" + (f" ({message})" if str(exc) else "")
    return Refusal(stage, type(exc).__name__, message[:600], site)


def _stage(stages: list[Stage], name: str, run: Callable[[], Any], detail: Callable[[Any], str]) -> Any:
    try:
        value = run()
    except UsageError as exc:
        if name == "planning" and str(exc).startswith("vLLM's KV cache planner rejected"):
            raise _Refused(Refusal(name, "ValueError", str(exc), None)) from None
        raise
    except Exception as exc:
        stages.append(Stage(name, False, type(exc).__name__))
        raise _Refused(refusal_of(name, exc)) from None
    stages.append(Stage(name, True, detail(value)))
    return value


def layout_setup(flags: CheckFlags, mamba: bool) -> Setup:
    """The flags as the `Setup` kvdoctor's layout planner reads (model, sizes; nothing of the connector)."""
    prefix = True if flags.enable_prefix_caching is None else flags.enable_prefix_caching
    max_len = flags.planned_max_model_len()
    return Setup(model=flags.model, block_size=flags.planned_block_size(),
                 gpu_blocks=flags.gpu_blocks or DEFAULT_GPU_BLOCKS, max_model_len=max_len,
                 max_num_seqs=flags.max_num_seqs or 256,
                 max_num_batched_tokens=flags.max_num_batched_tokens or max(2048, max_len),
                 enable_prefix_caching=prefix,
                 enable_chunked_prefill=True if flags.enable_chunked_prefill is None else flags.enable_chunked_prefill,
                 async_scheduling=bool(flags.async_scheduling),
                 # vLLM's MambaModelConfig picks `align` for a hybrid model with prefix caching
                 mamba_cache_mode="align" if mamba and prefix else None,
                 num_workers=flags.tensor_parallel_size, worker="simulated")


def _vllm_config(api: Any, flags: CheckFlags, setup: Setup) -> Any:
    from kvdoctor.engine.tiny_model import tiny_draft_dir, tiny_model_dir

    model_config = api.config_class("ModelConfig")(model=tiny_model_dir(), skip_tokenizer_init=True,
                                                   max_model_len=setup.max_model_len, dtype="float16", seed=0)
    cache_kwargs: dict[str, Any] = {"block_size": setup.block_size,
                                    "enable_prefix_caching": setup.enable_prefix_caching}
    if setup.mamba_cache_mode is not None:
        cache_kwargs["mamba_cache_mode"] = setup.mamba_cache_mode
    scheduler = api.config_class("SchedulerConfig")(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, is_encoder_decoder=False,
        enable_chunked_prefill=setup.enable_chunked_prefill, async_scheduling=setup.async_scheduling)
    transfer = None
    if flags.kv_transfer_config is not None:
        transfer = api.config_class("KVTransferConfig")(**flags.kv_transfer_config)
    extra: dict[str, Any] = {}
    spec = flags.speculative_config
    if spec:
        method = str(spec.get("method", ""))
        if method not in ("ngram", "eagle"):
            raise UsageError(f"--speculative-config method {method!r}: kvdoctor checks ngram and eagle (an eagle "
                             f"drafter stands in for yours); others need the model's weights")
        extra["speculative_config"] = api.speculative_config(
            model_config, method, int(spec.get("num_speculative_tokens", 2)),
            tiny_draft_dir() if method == "eagle" else None, None)
    if flags.tensor_parallel_size > 1:
        extra["parallel_config"] = api.parallel_config(flags.tensor_parallel_size)
    cache = api.config_class("CacheConfig")(**cache_kwargs)
    return api.config_class("VllmConfig")(model_config=model_config, cache_config=cache, scheduler_config=scheduler,
                                          kv_transfer_config=transfer,
                                          device_config=api.config_class("DeviceConfig")("cpu"), **extra)


def _scheduler(api: Any, vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int,
               async_scheduling: bool) -> Any:
    cls = (api.cls("async_scheduler", "AsyncScheduler") if async_scheduling else api.cls("scheduler", "Scheduler"))
    structured = api.cls("structured_output", "StructuredOutputManager")(vllm_config)
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
               structured_output_manager=structured, block_size=block_size, hash_block_size=hash_block_size)


def _host_refusal(flags: CheckFlags, region: int, shared: bool) -> tuple[Refusal | None, int | None, str]:
    """The CPU tier against the host: vLLM reserves it at start-up, per data-parallel engine on this node."""
    host, source = (flags.host_memory, "--host-memory") if flags.host_memory else (physical_memory_bytes(), "MemTotal")
    need = region * flags.data_parallel_size
    engines = f" x {flags.data_parallel_size} data-parallel engines" if flags.data_parallel_size > 1 else ""
    site = vllm_startup.shared_region_site() if shared else vllm_startup.worker_tensor_site()
    where = (f"/dev/shm ({os.path.basename(site[0])})" if shared and site
             else f"each worker's pinned CPU tensors ({os.path.basename(site[0])})" if site else "the workers' memory")
    if host is not None and need > host:
        return (Refusal("host", "OSError" if shared else "RuntimeError",
                        f"a CPU tier of {need / 2**30:.1f} GiB ({region:,} bytes{engines}) does not fit this host's "
                        f"{host / 2**30:.1f} GiB ({source}): vLLM reserves it at start-up in {where}"
                        + (" and fails with OSError: [Errno 14] Bad address" if shared
                           else " and fails to allocate (or the kernel kills the worker)"),
                        _site_text(site), predicted=True), host, source)
    shm = shm_bytes() if shared and not flags.host_memory else None
    if shm is not None and need > shm[0]:
        return (Refusal("host", "OSError", f"the shared CPU region of {need / 2**30:.1f} GiB{engines} does not fit "
                        f"/dev/shm ({shm[0] / 2**30:.1f} GiB) where vLLM maps it",
                        _site_text(site), predicted=True), host, source)
    return None, host, source


def _site_text(site: tuple[str, int] | None) -> str | None:
    if site is None:
        return None
    path, line = site
    return f"{path[path.rindex(f'{os.sep}vllm{os.sep}') + 1:] if f'{os.sep}vllm{os.sep}' in path else path}:{line}"


def run_startup(api: Any, flags: CheckFlags) -> Startup:
    """One pass over the stages; stops at the first refusal. kvdoctor's own usage errors propagate."""
    from kvdoctor.engine.kv_layout import MAMBA, resolve_layout

    layout = resolve_layout(flags.model, None, None)
    setup = layout_setup(flags, any(layer.kind == MAMBA for layer in layout.layers))
    stages: list[Stage] = []
    notes: list[str] = []
    result = Startup(stages, None, notes)
    try:
        vllm_config = _stage(stages, "config", lambda: _vllm_config(api, flags, setup),
                             lambda _: "VllmConfig and KVTransferConfig built")
        plan, kv_cache_config, block_size, hash_block_size = _stage(
            stages, "planning", lambda: _plan(api, vllm_config, setup),
            lambda p: f"{len(p[0].groups)} KV cache group(s), block {p[2]} tokens, hash block {p[3]} tokens")
        notes.extend(plan.notes)
        if flags.kv_transfer_config is None:
            notes.append("no --kv-transfer-config / --kv-offloading-size: no offloading connector to check")
        else:
            spec = _stage(stages, "offloading", lambda: vllm_startup.build_offloading_spec(vllm_config,
                                                                                         kv_cache_config),
                          lambda s: f"{type(s).__name__} built" if s is not None else "not probed on this vLLM")
            region = vllm_startup.spec_region_bytes(spec) if spec is not None else None
            shared = spec is not None and vllm_startup.spec_maps_shared_region(spec)
            result.region_bytes = region
            if region is not None:
                refusal, result.host_bytes, result.host_source = _host_refusal(flags, region, shared)
                stages.append(Stage("host", refusal is None, f"CPU tier {region / 2**30:.2f} GiB"
                                    + (" in /dev/shm" if shared else "")))
                if refusal is not None:
                    raise _Refused(refusal)
            if spec is not None and vllm_startup.manager_maps_region(spec) and (region or 0) > MAX_MAPPED_REGION:
                notes.append(f"the scheduler side was not started here: it would map and populate the "
                             f"{(region or 0) / 2**30:.1f} GiB shared region on this machine")
                return result
        scheduler = _stage(stages, "scheduler", lambda: _scheduler(api, vllm_config, kv_cache_config, block_size,
                                                                   hash_block_size, setup.async_scheduling),
                           lambda _: "vLLM's scheduler and its connector started")
        _shutdown(scheduler)
    except _Refused as refused:
        result.refusal = refused.refusal
    return result


def _plan(api: Any, vllm_config: Any, setup: Setup) -> Any:
    from kvdoctor.engine.kv_layout import plan

    return plan(api, vllm_config, setup)


def _shutdown(scheduler: Any) -> None:
    with contextlib.suppress(Exception):  # best effort: the check's answer is already known
        scheduler.shutdown()
