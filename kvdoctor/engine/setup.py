"""The serving geometry a scenario runs under, validated before vLLM is imported.

Field names follow `vllm serve` flags so an operator can paste theirs; the
offloaded chunk size is `block_size * blocks_per_chunk` (the connector's
`kv_connector_extra_config["block_size"]`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.errors import UsageError

DEFAULT_CPU_BYTES = 64 << 20  # plenty for toy geometries; recipes shrink it on purpose
MAMBA_CACHE_MODES = ("none", "align", "all")  # vLLM's CacheConfig.mamba_cache_mode values
ENGINE_LEVELS = ("scheduler", "core", "serve")  # who calls vLLM's scheduler (`Setup.engine`; kvdoctor/engine/core)
WORKERS = ("simulated", "vllm")  # who stands where vLLM's GPU worker runs (`Setup.worker`)
SCHEDULING_POLICIES = (None, "fcfs", "priority")  # vLLM's SchedulerConfig.policy values
# vLLM SpeculativeConfig methods kvdoctor can build with no download (`Setup.speculative_method`): ngram
# needs no draft model; eagle reads only a tiny local drafter config.json that kvdoctor writes.
SPECULATIVE_METHODS = ("ngram", "eagle")
# `Setup` field metadata: False where a recipe's [setup] cannot name the field (a flag's only, spelled
# otherwise in a recipe, or set by kvdoctor's setup resolution); the recipe loader reads it.
RECIPE_KEY = "recipe_key"
_NOT_A_RECIPE_KEY = {RECIPE_KEY: False}

# vLLM's block pool is one Python object per GPU block: measured here ~22 us and ~130 bytes a block
# to build (100,000 blocks: 2.3 s). Above this the build alone takes minutes: refuse, in one line.
MAX_GPU_BLOCKS = 4_000_000
BYTES_PER_GPU_BLOCK = 400  # a generous estimate of that object's cost, for the memory check


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def total_memory_bytes() -> int | None:
    """MemTotal + SwapTotal from /proc/meminfo: the most one mapping may reserve (None where unreadable)."""
    total = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return total or None


@dataclass(frozen=True)
class Setup:
    block_size: int = 4
    blocks_per_chunk: int = 1
    gpu_blocks: int = 8
    async_scheduling: bool = False
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    offload_prompt_only: bool = True
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES
    spec_name: str | None = None
    # --model: a local model directory whose config.json gives the KV layout (recipes name a `layout`)
    model: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    layout: str | None = None  # a layout kvdoctor ships (kvdoctor/models/<name>); recipes name these
    sliding_window: int | None = None  # overrides the config's sliding_window (tokens)
    mamba_cache_mode: str | None = None  # CacheConfig.mamba_cache_mode for Mamba layouts (None: vLLM's default)
    # CacheConfig.prefix_match_unit: the block-hash granularity (tokens) of a hybrid layout's groups,
    # finer than their block size (None: vLLM's default, the GCD of the groups' block sizes)
    prefix_match_unit: int | None = None
    # CacheConfig.prefix_cache_retention_interval (0.34+): tokens between the sliding-window / Mamba
    # prefix-cache checkpoints kept, a multiple of the scheduler block size (None: vLLM's default, 0)
    prefix_cache_retention_interval: int | None = None
    # SchedulerConfig.policy (`vllm serve --scheduling-policy`): "fcfs" or "priority" (None: vLLM's, fcfs)
    scheduling_policy: str | None = None
    # a recipe spells it [setup] kv_connector_extra_config, as `vllm serve` does
    extra_connector_config: dict[str, Any] = field(default_factory=dict, metadata=_NOT_A_RECIPE_KEY)
    # Other `KVTransferConfig` fields given with --kv-transfer-config (kv_role, engine_id, ...),
    # passed to vLLM's KVTransferConfig as given.
    kv_transfer_fields: dict[str, Any] = field(default_factory=dict)
    # Who stands where vLLM's GPU worker runs: "simulated" (bookkeeping) or "vllm" (vLLM's
    # worker-role connector on real KV tensors). device/model_runner: None = resolved at run time.
    worker: str = "simulated"
    # How many workers vLLM's executor would run (ParallelConfig.tensor_parallel_size, so world_size):
    # the connector's scheduler waits for every worker's report of a job. The simulated worker stands
    # in for all of them; their outputs are combined by vLLM's own KVOutputAggregator.
    num_workers: int = 1
    # The last worker reports everything (completions, failures) this many steps after the others.
    late_worker_steps: int = 0
    # vLLM's MultiConnector with two OffloadingConnectors: the first is the one kvdoctor watches,
    # the second (its own CPU tier of `second_cpu_bytes_to_use`) stands for another asynchronous
    # connector: it loads what it holds, and the first is told num_external_tokens = 0.
    multi_connector: bool = False
    second_cpu_bytes_to_use: int = DEFAULT_CPU_BYTES
    # False: no KV connector at all (a server without --kv-transfer-config). Explore's triage reruns a
    # finding this way to tell an offloading bug from one of vLLM's core scheduler.
    offloading: bool = True
    device: str | None = None  # "cpu" | "cuda" (vllm worker only)
    model_runner: str | None = None  # "v1" | "v2"
    # Set by kvdoctor, never by a recipe: why vLLM's worker was asked for (the command line's default, or
    # `kvdoctor audit --worker vllm`) but this recipe's setup ran with the simulated worker instead (see
    # `vllm_worker_refusal`).
    worker_fallback: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    # Set by kvdoctor, never by a recipe: why this vLLM-worker run keeps its KV on the CPU although a GPU
    # was there or asked for (`kvdoctor.app.resolve_device`).
    device_fallback: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    # Who calls vLLM's scheduler: "scheduler" (kvdoctor, in-process), "core" (vLLM's EngineCore
    # in-process), "serve" (a `vllm serve` child driven over HTTP); see kvdoctor/engine/core/levels.py.
    engine: str = "scheduler"
    # Set by kvdoctor, never by a recipe: the fields the user gave (flags, or a user recipe's own [setup]);
    # `recipes.geometry.plan_setup` keeps these and derives the others to meet the recipe's trigger.
    fixed: tuple[str, ...] = field(default=(), metadata=_NOT_A_RECIPE_KEY)
    # Set by plan_setup: the fields it derived ("gpu_blocks: 8 -> 10"), and where the user's own values make
    # the trigger impossible, why and the smallest change that allows it (the run is then `untested`).
    derived: tuple[str, ...] = field(default=(), metadata=_NOT_A_RECIPE_KEY)
    untested: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    # Set by plan_setup: the recipe's measured reasons (`recipes.geometry.MEASURED_REASONS`) the user's own
    # values break, as (requirement, why): the run is played at those values and judged by what happens;
    # the reason is shown only where kvdoctor's measurement on this release supports it (matrix/reasons.py).
    waived: tuple[tuple[str, str], ...] = field(default=(), metadata=_NOT_A_RECIPE_KEY)
    # Speculative decoding through vLLM's own SpeculativeConfig (None: none). kvdoctor stands in for the
    # drafter and the rejection sampler (scheduler level only): each decode step proposes
    # `num_speculative_tokens` drafts, and the verification accepts the next number of
    # `draft_acceptance` ("2,0,1": cycled over verifications; None: every draft accepted).
    speculative_method: str | None = None
    num_speculative_tokens: int = 2
    draft_acceptance: str | None = None
    # SpeculativeConfig.disable_lookahead_block_hashes (0.34): an EAGLE drafter's blocks hashed without the
    # lookahead, so vLLM falls back to dropping the trailing block (the connector's apply_eagle_drop and
    # eagle proof margins). A release without the field refuses it.
    disable_lookahead_block_hashes: bool = False
    # The tiering spec's secondary tier (vLLM TieringOffloadingSpec's `secondary_tiers`): "fs", a local
    # file system tier in a throw-away directory kvdoctor removes (kvdoctor/engine/secondary_tier.py);
    # None: the CPU tier only. Needs spec_name = "TieringOffloadingSpec".
    secondary_tier: str | None = None

    @property
    def offloaded_block_size(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def kv_connector_extra_config(self) -> dict[str, Any]:
        """The `kv_connector_extra_config` vLLM's connector receives."""
        cfg: dict[str, Any] = dict(self.extra_connector_config)
        cfg["cpu_bytes_to_use"] = self.cpu_bytes_to_use
        cfg["block_size"] = self.offloaded_block_size
        cfg["offload_prompt_only"] = self.offload_prompt_only
        if self.spec_name:
            cfg["spec_name"] = self.spec_name
        if self.secondary_tier:
            from kvdoctor.engine.secondary_tier import tier_config

            cfg["secondary_tiers"] = [tier_config(self.secondary_tier)]
        if self.worker == "vllm" and self.device != "cuda":
            # vLLM loads kvdoctor's spec itself: the named spec's manager, kvdoctor's copy engine
            from kvdoctor.engine.workers.cpu_copy_spec import spec_name_for

            cfg["spec_name"] = spec_name_for(self.spec_name or "CPUOffloadingSpec")
            cfg["spec_module_path"] = "kvdoctor.engine.workers.cpu_copy_spec"
        return cfg

    def second_connector_extra_config(self) -> dict[str, Any] | None:
        """The second sub-connector's `kv_connector_extra_config` under `multi_connector`, else None."""
        if not self.multi_connector:
            return None
        cfg = dict(self.kv_connector_extra_config())
        cfg["cpu_bytes_to_use"] = self.second_cpu_bytes_to_use
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def vllm_worker_refusal(self) -> str | None:
        """Why vLLM's worker-role connector cannot run this setup; None where it can."""
        return self.vllm_worker_unsupported() or self.vllm_worker_memory_refusal()

    def vllm_worker_memory_refusal(self) -> str | None:
        """Memory past this machine for kvdoctor's copy engine on CPU tensors (on a GPU the memory is the
        GPU's): None under --device cuda."""
        return None if self.device == "cuda" else self.worker_memory_refusal()

    def vllm_worker_unsupported(self) -> str | None:
        """Why vLLM's worker cannot drive this kind of setup at all, whatever its sizes."""
        if self.num_workers > 1:
            return ("num_workers > 1: kvdoctor runs one vLLM worker-role connector (one rank's KV); several "
                    "workers are stood in for by the simulated worker only")
        if self.multi_connector:
            return ("vLLM's worker does not drive MultiConnector here: kvdoctor's second sub-connector is a "
                    "companion whose jobs complete as they are issued, with no worker-role connector of its own")
        if not self.offloading:
            return "offloading = false runs no KV connector: vLLM's worker has nothing to drive"
        if self.secondary_tier is not None and self.device != "cuda":
            return ("secondary_tier: vLLM's tiering spec moves the fs tier's bytes through its shared /dev/shm CPU "
                    "region, and kvdoctor's CPU copy engine keeps the CPU tier in tensors of its own, so promoted "
                    "chunks would read as stale KV (measured: a false reads-see-their-tokens violation)")
        if self.speculative_method is not None:
            return ("speculative decoding: kvdoctor's stand-in drafter runs beside the simulated worker only "
                    "(vLLM's model runner would need a real drafter)")
        if self.layout or self.model:  # the config.json is read here, before vLLM is imported
            from kvdoctor.engine.kv_layout import MAMBA, resolve_layout

            layout = resolve_layout(self.model, self.layout, self.sliding_window)
            if any(layer.kind == MAMBA for layer in layout.layers):
                named = f"layout {self.layout}" if self.layout else f"--model {self.model}"
                return f"{named} has a Mamba layer, and kvdoctor's toy model writes attention KV only"
        return None

    def device_described(self) -> str | None:
        """`device` as reports show it: the fallback and its reason where there was one."""
        if self.device and self.device_fallback:
            return f"{self.device} ({self.device_fallback})"
        return self.device

    def worker_described(self) -> str:
        """`worker` as reports show it: the fallback and its reason where there was one."""
        if self.worker_fallback:
            return f"{self.worker} ({self.worker_fallback})"
        return self.worker

    def validate(self) -> "Setup":
        for name in ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "cpu_bytes_to_use", "second_cpu_bytes_to_use"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{flag_name(name)} must be a positive integer, got {value!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise UsageError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.prefix_match_unit is not None and (not isinstance(self.prefix_match_unit, int)
                                                   or isinstance(self.prefix_match_unit, bool)
                                                   or self.prefix_match_unit < 1):
            raise UsageError(f"prefix_match_unit must be a positive integer, got {self.prefix_match_unit!r}")
        if self.prefix_cache_retention_interval is not None and (
                not isinstance(self.prefix_cache_retention_interval, int)
                or isinstance(self.prefix_cache_retention_interval, bool) or self.prefix_cache_retention_interval < 1):
            raise UsageError(f"prefix_cache_retention_interval must be a positive integer, "
                             f"got {self.prefix_cache_retention_interval!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise UsageError(f"scheduling_policy must be one of {'|'.join(p for p in SCHEDULING_POLICIES if p)}, "
                             f"got {self.scheduling_policy!r}")
        if self.engine not in ENGINE_LEVELS:
            raise UsageError(f"engine must be one of {'|'.join(ENGINE_LEVELS)}, got {self.engine!r}")
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise UsageError(f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
                             f"got {self.mamba_cache_mode!r}")
        for name, allowed in (("worker", WORKERS), ("device", (None, "cpu", "cuda")),
                              ("model_runner", (None, "v1", "v2"))):
            if getattr(self, name) not in allowed:
                choices = "|".join(a for a in allowed if a)
                raise UsageError(f"{flag_name(name)} must be one of {choices}, got {getattr(self, name)!r}")
        if not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1:
            raise UsageError(f"num_workers must be a positive integer, got {self.num_workers!r}")
        if (not isinstance(self.late_worker_steps, int) or isinstance(self.late_worker_steps, bool)
                or self.late_worker_steps < 0):
            raise UsageError(f"late_worker_steps must be a non-negative integer, got {self.late_worker_steps!r}")
        if self.late_worker_steps and self.num_workers < 2:
            raise UsageError("late_worker_steps needs num_workers >= 2 (one worker late behind the others)")
        if self.num_workers > 1 and self.engine != "scheduler":
            raise UsageError(f"num_workers > 1 runs at the scheduler level only: --engine {self.engine} would have "
                             f"vLLM start an executor with {self.num_workers} workers, which this machine cannot run")
        if self.num_workers > 1 and self.multi_connector:
            raise UsageError("num_workers > 1 with multi_connector: kvdoctor's second sub-connector is a companion "
                             "that reports once, not per worker (its jobs would never complete)")
        if self.multi_connector and not self.offloading:
            raise UsageError("multi_connector and offloading = false contradict: a MultiConnector is a KV connector")
        self._validate_speculative()
        if self.secondary_tier is not None:
            from kvdoctor.engine.secondary_tier import SECONDARY_TIERS

            if self.secondary_tier not in SECONDARY_TIERS:
                raise UsageError(f"secondary_tier must be one of {'|'.join(SECONDARY_TIERS)}, "
                                 f"got {self.secondary_tier!r}")
            if self.spec_name != "TieringOffloadingSpec":
                raise UsageError(f"secondary_tier needs spec_name = \"TieringOffloadingSpec\" (vLLM's tiering spec "
                                 f"owns secondary tiers), got spec_name {self.spec_name!r}")
        refusal = self.vllm_worker_refusal() if self.worker == "vllm" else None
        if refusal:
            raise UsageError(f"--worker vllm: {refusal}; run it with --worker simulated "
                             f"(kvdoctor audit --worker vllm falls back to it for such a recipe)")
        if self.gpu_blocks > MAX_GPU_BLOCKS:
            raise UsageError(
                f"--num-gpu-blocks-override {self.gpu_blocks}: kvdoctor simulates pools up to {MAX_GPU_BLOCKS:,} "
                f"blocks (vLLM's scheduler builds one Python object per block; this pool would take "
                f"~{self.gpu_blocks * 22e-6 / 60:.0f} min and ~{self.gpu_blocks * BYTES_PER_GPU_BLOCK / 2**30:.0f} GiB)")
        needed = self.gpu_blocks * BYTES_PER_GPU_BLOCK + (
            self.cpu_bytes_to_use if self.spec_name == "TieringOffloadingSpec" else 0)  # tiering maps its tier
        available = available_memory_bytes()
        if available is not None and needed > available:
            raise UsageError(f"this geometry needs ~{needed / 2**30:.1f} GiB of memory to simulate "
                             f"(pool of {self.gpu_blocks:,} blocks, CPU tier {self.cpu_bytes_to_use:,} bytes); "
                             f"{available / 2**30:.1f} GiB are available")
        if self.model is not None:  # an architecture kvdoctor cannot map: exit 2 before vLLM is imported
            from kvdoctor.engine.kv_layout import resolve_layout

            resolve_layout(self.model, self.layout, self.sliding_window)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise UsageError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"--max-num-seqs ({self.max_num_seqs}), as vLLM requires"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise UsageError(
                f"without chunked prefill --max-num-batched-tokens ({self.max_num_batched_tokens}) "
                f"must be >= max model length ({self.max_model_len}), as vLLM requires"
            )
        return self

    def _validate_speculative(self) -> None:
        if self.speculative_method is None:
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise UsageError(f"speculative_method must be one of {'|'.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool) \
                or self.num_speculative_tokens < 1:
            raise UsageError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        self.draft_acceptance_pattern()
        if self.engine != "scheduler":
            raise UsageError(f"speculative_method: kvdoctor stands in for the drafter at the scheduler level only "
                             f"(--engine {self.engine} would need vLLM's own drafter and a model)")

    def draft_acceptance_pattern(self) -> tuple[int, ...] | None:
        """`draft_acceptance` as numbers ("2,0,1" -> (2, 0, 1)); None: every draft is accepted."""
        if self.draft_acceptance is None:
            return None
        try:
            pattern = tuple(int(part) for part in str(self.draft_acceptance).split(","))
        except ValueError:
            pattern = ()
        if not pattern or any(n < 0 for n in pattern):
            raise UsageError(f"draft_acceptance must be comma-separated counts of accepted drafts (e.g. \"2,0,1\"), "
                             f"got {self.draft_acceptance!r}")
        return pattern

    def worker_memory_refusal(self) -> str | None:
        """Why this machine cannot hold what vLLM's worker allocates here (None: it can). The worker holds a
        fingerprint page per GPU block and CPU slot (`engine/workers/fingerprint.py`), never the model's real
        pages; the simulated worker holds neither. Judged before vLLM is imported (else the kernel kills the
        run), and again, exactly, once vLLM has planned the groups."""
        from kvdoctor.engine.kv_layout import resolve_layout
        from kvdoctor.engine.workers.fingerprint import estimate

        layout = resolve_layout(self.model, self.layout, self.sliding_window)
        return estimate(layout, self.block_size, self.blocks_per_chunk, self.gpu_blocks,
                        self.cpu_bytes_to_use).refusal()

    def with_overrides(self, **overrides: Any) -> "Setup":
        """Apply CLI overrides (None means 'not given') and re-validate; the given geometry fields are
        recorded in `fixed` (planning keeps them)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise UsageError(f"unknown setup field(s): {', '.join(sorted(unknown))}")
        fixed = tuple(sorted(set(self.fixed) | (set(given) & set(PLANNED_FIELDS))))
        return dataclasses.replace(self, **given, fixed=fixed).with_rules_kept().validate()

    def with_rules_kept(self) -> "Setup":
        """A step budget the user did not give, raised to what vLLM requires of it (it covers max_num_seqs,
        and max_model_len without chunked prefill)."""
        if "max_num_batched_tokens" in self.fixed:
            return self
        budget = max(self.max_num_batched_tokens, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        return dataclasses.replace(self, max_num_batched_tokens=budget)


# The sizes and switches a recipe's plan may derive where the user did not give them.
PLANNED_FIELDS = ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                  "max_model_len", "async_scheduling", "enable_chunked_prefill", "cpu_bytes_to_use")
_FLAGS = {"gpu_blocks": "--num-gpu-blocks-override",
          # set through --kv-offloading-size or --kv-transfer-config, as with vllm serve
          "cpu_bytes_to_use": "kv_connector_extra_config.cpu_bytes_to_use"}


def flag_name(name: str, value: bool | None = None) -> str:
    """The flag that sets Setup field `name` (a switch: the form that sets it to `value`)."""
    flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
    if value is False:
        return "--no-" + flag[2:]
    return flag


# KVTransferConfig fields kvdoctor passes through as given (vLLM validates them; a release
# without the field refuses it, see `harness.build_scheduler`).
PASSED_THROUGH_KV_TRANSFER_KEYS = ("kv_role", "kv_load_failure_policy", "kv_buffer_device", "kv_buffer_size",
                                   "engine_id")
# Keys that cannot take effect in kvdoctor's run: refused with the reason.
_REFUSED_KV_TRANSFER_KEYS = {
    "kv_connector_module_path": "kvdoctor drives vLLM's own OffloadingConnector; it loads no connector module",
}


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """Turn `--kv-transfer-config '<json>'` (as `vllm serve` takes it) into setup overrides.

    Geometry-bearing keys of `kv_connector_extra_config` map onto `Setup`
    fields; the rest of it is passed through to the connector untouched, and so
    are the KVTransferConfig fields in `PASSED_THROUGH_KV_TRANSFER_KEYS`, so
    vLLM's own validation judges them. Every key either takes effect or is
    refused (exit 2).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--kv-transfer-config is not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise UsageError("--kv-transfer-config must be a JSON object")
    for key, reason in _REFUSED_KV_TRANSFER_KEYS.items():
        if key in data:
            raise UsageError(f"--kv-transfer-config: {key} is not supported: {reason}")
    known = {"kv_connector", "kv_connector_extra_config", *PASSED_THROUGH_KV_TRANSFER_KEYS}
    unknown = set(data) - known
    if unknown:
        raise UsageError(f"--kv-transfer-config: unknown key(s) {', '.join(sorted(unknown))} "
                         f"(kvdoctor takes {', '.join(sorted(known))})")
    connector = data.get("kv_connector", "OffloadingConnector")
    if connector != "OffloadingConnector":
        raise UsageError(f"--kv-transfer-config: kvdoctor drives OffloadingConnector, not {connector!r}")
    extra = data.get("kv_connector_extra_config", {}) or {}
    if not isinstance(extra, dict):
        raise UsageError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    extra = dict(extra)
    overrides: dict[str, Any] = {}
    if "cpu_bytes_to_use" in extra:
        overrides["cpu_bytes_to_use"] = _as_int("cpu_bytes_to_use", extra.pop("cpu_bytes_to_use"))
    if "offload_prompt_only" in extra:
        value = extra.pop("offload_prompt_only")
        if not isinstance(value, bool):
            raise UsageError("--kv-transfer-config: offload_prompt_only must be true or false")
        overrides["offload_prompt_only"] = value
    if "spec_name" in extra:
        overrides["spec_name"] = str(extra.pop("spec_name"))
    if "block_size" in extra:
        overrides["_offloaded_block_size"] = _as_int("block_size", extra.pop("block_size"))
    overrides["extra_connector_config"] = extra
    fields = {key: data[key] for key in PASSED_THROUGH_KV_TRANSFER_KEYS if key in data}
    if fields:
        overrides["kv_transfer_fields"] = fields
    return overrides


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"--kv-transfer-config: {key} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():  # int() would cut it silently
        raise UsageError(f"--kv-transfer-config: {key} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"--kv-transfer-config: {key} must be an integer, got {value!r}") from None
    return number


def resolve_blocks_per_chunk(block_size: int, offloaded_block_size: int) -> int:
    """The connector requires the offloaded block to be whole GPU blocks."""
    if block_size < 1:
        raise UsageError(f"--block-size must be a positive integer, got {block_size}")
    if offloaded_block_size < 1 or offloaded_block_size % block_size:
        raise UsageError(
            f"offloaded block size {offloaded_block_size} is not a whole number of "
            f"GPU blocks of {block_size} tokens"
        )
    return offloaded_block_size // block_size
