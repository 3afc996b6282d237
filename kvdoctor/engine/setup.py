"""The serving geometry a scenario runs under: the recipe's pure geometry, checked without the machine.

Field names follow `vllm serve` flags so an operator can paste theirs; the
offloaded chunk size is `block_size * blocks_per_chunk` (the connector's
`kv_connector_extra_config["block_size"]`). `Setup.validate` reads nothing from this
machine (no /proc/meminfo, no config.json, no torch): what depends on the machine
(memory, a model directory's layout, the device) is judged in `kvdoctor.resolution`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.secondary_tier import SECONDARY_TIERS, tier_configs
from kvdoctor.engine.serve_args import flag_name
from kvdoctor.engine.workers.cpu_copy_spec import spec_name_for
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
    # Set by kvdoctor, never by a recipe: the recipe's own [setup] layout where --model replaced it. Its KV cache
    # groups (as vLLM plans them) are the kinds the trigger needs; the model's groups must hold them
    # (`kv_layout.missing_trigger_groups`), else the run is untested, naming both.
    layout_replaced: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
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
    # `resolution.vllm_worker_refusal`).
    worker_fallback: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    # Set by kvdoctor, never by a recipe: why this vLLM-worker run keeps its KV on the CPU although a GPU
    # was there or asked for (`kvdoctor.resolution.resolve_device`).
    device_fallback: str | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
    # Who calls vLLM's scheduler: "scheduler" (kvdoctor, in-process), "core" (vLLM's EngineCore
    # in-process), "serve" (a `vllm serve` child driven over HTTP); see kvdoctor/levels/table.py.
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
    # Set by plan_setup for a `--model` with Mamba layers and a recipe that queues a request by running the
    # pool out (`fill_pool`): how many requests hold Mamba state when the pool must be full (its fillers).
    # A Mamba group in `align` mode holds at most two blocks a request (the running state and the previous
    # step's), not a block for each block of tokens: kv_layout sizes the pool by it (None: a block a token block).
    mamba_fill_requests: int | None = field(default=None, metadata=_NOT_A_RECIPE_KEY)
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
    # None: the CPU tier only. "scripted": kvdoctor's scripted tier (engine/compat/scripted_tier.py) whose job
    # outcomes follow `tier_script` ("ok,late/defer,partial": store outcomes / promotion outcomes, cycled);
    # "fs+scripted": both. "example" / "fs+example": vLLM's own in-memory example tier (compat/example_tier.py).
    # Needs spec_name = "TieringOffloadingSpec".
    secondary_tier: str | None = None
    # vLLM's KV cache events (`--kv-events-config '{"enable_kv_cache_events": true}'`): the Scheduler publishes
    # its KV cache manager's and its connector's BlockStored / BlockRemoved / AllBlocksCleared each step; kvdoctor
    # records them where the publisher would send them and checks them against the tier (observe/kv_events.py).
    kv_events: bool = False
    # The connector's self-describing payloads (`kv_connector_extra_config.self_describing_kv_events`): a CPU
    # BlockStored carries the chunk's block hashes, tokens and parent. Needs kv_events.
    self_describing_kv_events: bool = False
    tier_script: str | None = None
    # The scripted tier's backpressure (vLLM's `backpressure_cls`): its store decisions, "1,1,0" cycled
    # (0: drop the cascade), or "vllm[:...]": vLLM's own EMA detector and policy on kvdoctor's step clock
    # (engine/tier_script.py parse_vllm_backpressure, compat/step_clock.py). None: no backpressure.
    backpressure_pattern: str | None = None
    # vLLM's object-store secondary tier (`type = "obj"`, loaded as kvdoctor's RecordedObjTier through
    # `module_path`: vLLM's ObjectStoreSecondaryTierManager on a fake NIXL agent with an in-memory bucket,
    # engine/compat/objstore_tier.py), placed first among the secondary tiers; its value is the agent's fault
    # script, "<stores>/<loads>" cycled ("ok,fail/late": compat/objstore_agent.OUTCOMES; "" all succeed).
    # None: no object-store tier. Needs spec_name = "TieringOffloadingSpec".
    object_store: str | None = None

    def _objstore_tiers(self) -> list[dict[str, Any]]:
        """The object-store tier's `secondary_tiers` entry (none without `object_store`)."""
        if self.object_store is None:
            return []
        return [{"type": "RecordedObjTier", "module_path": "kvdoctor.engine.compat.objstore_tier",
                 "script": self.object_store}]

    def _validate_object_store(self) -> None:
        if self.object_store is None:
            return
        from kvdoctor.engine.compat.objstore_agent import check_objstore_script

        if self.spec_name != "TieringOffloadingSpec":
            raise UsageError(f"object_store needs spec_name = \"TieringOffloadingSpec\" (vLLM's tiering spec owns "
                             f"secondary tiers), got spec_name {self.spec_name!r}")
        problem = check_objstore_script(self.object_store)
        if problem:
            raise UsageError(f"object_store: {problem}")

    # vLLM's P2P tier between two engines (issue 36, engine/p2p.py): the recipe's engine is the consumer (decode)
    # of a producer (prefill) engine beside it, both on TieringOffloadingSpec with vLLM's P2P tier as their only
    # secondary tier, over kvdoctor's in-memory transports; `p2p_*` steps drive the pair, `schedule` steps both.
    p2p: bool = False
    # A P/D decode node (issue 35, vllm#52170): vLLM's MultiConnector with kvdoctor's stand-in for NIXL first
    # (engine/compat/pd_connector.py: it reports a `do_remote_prefill` request's prompt as external tokens and
    # loads them asynchronously, failing loads on the recipe's `pd_fail` schedule) and vLLM's OffloadingConnector
    # second, the one kvdoctor watches. kvdoctor stands in for the remote prefill transport only.
    pd_decode: bool = False

    @property
    def watched_connector(self) -> int:
        """Which sub-connector is the OffloadingConnector kvdoctor watches (0 unless under a stand-in)."""
        return 1 if self.pd_decode else 0

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
        if self.secondary_tier or self.object_store is not None:
            cfg["secondary_tiers"] = self._objstore_tiers() + (
                tier_configs(self.secondary_tier, self.tier_script, self.backpressure_pattern)
                if self.secondary_tier else [])
        if self.self_describing_kv_events:
            cfg["self_describing_kv_events"] = True
        if self.worker == "vllm" and self.device != "cuda":
            # vLLM loads kvdoctor's spec itself: the named spec's manager, kvdoctor's copy engine
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

    def vllm_worker_unsupported(self) -> str | None:
        """Why vLLM's worker cannot drive this kind of setup at all, whatever its sizes and layout."""
        if self.num_workers > 1:
            return ("num_workers > 1: kvdoctor runs one vLLM worker-role connector (one rank's KV); several "
                    "workers are stood in for by the simulated worker only")
        if self.pd_decode:
            return ("pd_decode: kvdoctor's NIXL stand-in has no worker-role side (the simulated worker plays its "
                    "remote-prefill loads)")
        if not self.offloading:
            return "offloading = false runs no KV connector: vLLM's worker has nothing to drive"
        if self.p2p and self.device != "cuda":
            return ("p2p: vLLM's P2P tier writes the producer's bytes into the consumer's shared /dev/shm CPU region, "
                    "which kvdoctor's CPU copy engine does not read (its CPU tier lives in tensors of its own)")
        if (self.secondary_tier is not None or self.object_store is not None) and self.device != "cuda":
            return ("secondary_tier / object_store: vLLM's tiering spec moves a secondary tier's bytes through its "
                    "shared /dev/shm CPU region, and kvdoctor's CPU copy engine keeps the CPU tier in tensors of its "
                    "own, so promoted chunks would read as stale KV (measured: a false reads-see-their-tokens "
                    "violation)")
        if self.speculative_method is not None:
            return ("speculative decoding: kvdoctor's stand-in drafter runs beside the simulated worker only "
                    "(vLLM's model runner would need a real drafter)")
        return None  # a Mamba layout (read from its config.json): `resolution.vllm_worker_unsupported`

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

    def validate(self) -> Setup:
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
        if self.self_describing_kv_events and not self.kv_events:
            raise UsageError("self_describing_kv_events needs kv_events = true (vLLM publishes no KV events otherwise)")
        if self.kv_events and not self.offloading:
            raise UsageError("kv_events and offloading = false: kvdoctor checks the connector's KV events, and "
                             "there is no connector")
        if self.secondary_tier is not None:
            if self.secondary_tier not in SECONDARY_TIERS:
                raise UsageError(f"secondary_tier must be one of {'|'.join(SECONDARY_TIERS)}, "
                                 f"got {self.secondary_tier!r}")
            if self.spec_name != "TieringOffloadingSpec":
                raise UsageError(f"secondary_tier needs spec_name = \"TieringOffloadingSpec\" (vLLM's tiering spec "
                                 f"owns secondary tiers), got spec_name {self.spec_name!r}")
        self._validate_scripted_tier()
        self._validate_object_store()
        if self.p2p and (self.secondary_tier is not None or self.multi_connector or not self.offloading):
            raise UsageError("p2p = true: the pair's tier is vLLM's P2P tier alone (TieringOffloadingSpec); it takes "
                             "no secondary_tier, multi_connector or offloading = false")
        if self.pd_decode and (self.p2p or self.multi_connector or not self.offloading or self.num_workers > 1):
            raise UsageError("pd_decode = true: the MultiConnector is kvdoctor's NIXL stand-in + vLLM's "
                             "OffloadingConnector; it takes no p2p, multi_connector, num_workers > 1 or "
                             "offloading = false")
        refusal = self.vllm_worker_unsupported() if self.worker == "vllm" else None
        if refusal:
            raise UsageError(f"--worker vllm: {refusal}; run it with --worker simulated "
                             f"(kvdoctor audit --worker vllm falls back to it for such a recipe)")
        if self.gpu_blocks > MAX_GPU_BLOCKS:
            raise UsageError(
                f"--num-gpu-blocks-override {self.gpu_blocks}: kvdoctor simulates pools up to {MAX_GPU_BLOCKS:,} "
                f"blocks (vLLM's scheduler builds one Python object per block; this pool would take "
                f"~{self.gpu_blocks * 22e-6 / 60:.0f} min and "
                f"~{self.gpu_blocks * BYTES_PER_GPU_BLOCK / 2**30:.0f} GiB)")
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

    def _validate_scripted_tier(self) -> None:
        from kvdoctor.engine.tier_script import check_pattern, check_script

        scripted = "scripted" in (self.secondary_tier or "").split("+")
        for name in ("tier_script", "backpressure_pattern"):
            value = getattr(self, name)
            if value is None:
                continue
            if not scripted:
                raise UsageError(f"{name} needs secondary_tier = \"scripted\" or \"fs+scripted\", "
                                 f"got secondary_tier {self.secondary_tier!r}")
            problem = (check_script if name == "tier_script" else check_pattern)(value)
            if problem:
                raise UsageError(f"{name}: {problem}")

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

    def with_overrides(self, **overrides: Any) -> Setup:
        """Apply CLI overrides (None means 'not given') and re-validate; the given geometry fields are
        recorded in `fixed` (planning keeps them)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise UsageError(f"unknown setup field(s): {', '.join(sorted(unknown))}")
        fixed = tuple(sorted(set(self.fixed) | (set(given) & set(PLANNED_FIELDS))))
        return dataclasses.replace(self, **given, fixed=fixed).with_rules_kept().validate()

    def with_rules_kept(self) -> Setup:
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
