"""`vllm serve` flags <-> kvdoctor `Setup` fields: the one table, `SERVE_FLAGS`.

Every reader of a serve flag goes through this table, so a flag means one thing
everywhere: the CLI's options (`cli/options.py` builds each Typer option from its
row, `cli/serve_flags.py` lists them), the setup's messages (`flag_name`), the
`vllm serve` command the serve level starts (`serve_command_flags`), the exported
script's setup (`exported_setup`), and `kvdoctor diagnose`, which reads serve
arguments from a log (`diagnose/serveline.py` keeps `SERVE_ARGS_OF_INTEREST`;
`setup_overrides_from_serve_args` maps them). No vLLM import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import UsageError

GEOMETRY = "Serving geometry (overrides the recipe's [setup])"  # --help panels (plain help: no markup)
WORKER = "Worker side"
GIB = 1 << 30


@dataclass(frozen=True)
class ServeFlag:
    """One flag: the `Setup` field it sets, how the CLI spells it, the `vllm serve` argument it is."""

    name: str  # the CLI parameter (`ServeFlags` field); the Setup field unless `field` says otherwise
    field: str | None  # the Setup field it sets (None: parsed into several, e.g. --kv-transfer-config)
    flag: str  # the flag as `vllm serve` / kvdoctor spells it ("--block-size"); a switch: its "on" form
    serve_arg: str | None  # vLLM's EngineArgs name; None: kvdoctor's own flag
    type: type  # the value's type (a switch: bool)
    help: str = ""
    aliases: tuple[str, ...] = ()  # more names of the CLI option
    metavar: str | None = None
    panel: str = GEOMETRY
    show_default: bool = True
    cli: bool = True  # a kvdoctor option (False: only spelled in messages, the serve command or a log)
    in_command: bool = False  # written into the `vllm serve` command the serve level starts
    exported: bool = False  # written into the exported script's setup
    from_log: str = ""  # "mapped": a log's value becomes the Setup field; "reported": shown only
    check: str = "geometry"  # which check in `cli/options.py` turns the CLI flag into overrides

    def option_names(self) -> tuple[str, ...]:
        """The Typer declaration: `--x/--no-x` for a switch, else the flag and its aliases."""
        if self.type is bool:
            return (f"{self.flag}/--no-{self.flag[2:]}",)
        return (self.flag, *self.aliases)


_ROWS = (
    ServeFlag("block_size", "block_size", "--block-size", "block_size", int, "GPU KV block size in tokens.",
              in_command=True, exported=True, from_log="mapped"),
    ServeFlag("blocks_per_chunk", "blocks_per_chunk", "--blocks-per-chunk", None, int,
              "GPU blocks per offloaded chunk (offloaded block size / block size)."),
    ServeFlag("gpu_blocks", "gpu_blocks", "--num-gpu-blocks-override", "num_gpu_blocks_override", int,
              "Number of GPU KV blocks (the pool size).", aliases=("--gpu-blocks",), in_command=True,
              exported=True, from_log="mapped"),
    ServeFlag("async_scheduling", "async_scheduling", "--async-scheduling", "async_scheduling", bool,
              "Use AsyncScheduler (outputs applied one step late).", show_default=False, in_command=True,
              exported=True, from_log="mapped"),
    ServeFlag("max_num_batched_tokens", "max_num_batched_tokens", "--max-num-batched-tokens",
              "max_num_batched_tokens", int, "Token budget per step.", in_command=True, exported=True,
              from_log="mapped"),
    ServeFlag("max_num_seqs", "max_num_seqs", "--max-num-seqs", "max_num_seqs", int, "Max running requests.",
              in_command=True, exported=True, from_log="mapped"),
    ServeFlag("max_model_len", "max_model_len", "--max-model-len", "max_model_len", int,
              "Model context length in tokens (prompt + output); longer prompts are refused.", in_command=True,
              exported=True, from_log="mapped"),
    ServeFlag("enable_chunked_prefill", "enable_chunked_prefill", "--enable-chunked-prefill",
              "enable_chunked_prefill", bool, "Chunked prefill.", show_default=False, in_command=True,
              exported=True, from_log="mapped"),
    ServeFlag("enable_prefix_caching", "enable_prefix_caching", "--enable-prefix-caching", "enable_prefix_caching",
              bool, "Prefix caching (CacheConfig.enable_prefix_caching; on by default, as the recipes assume).",
              show_default=False, in_command=True, exported=True, from_log="reported"),
    ServeFlag("kv_transfer_config", None, "--kv-transfer-config", "kv_transfer_config", str,
              "JSON exactly as `vllm serve --kv-transfer-config` takes it.", from_log="mapped"),
    ServeFlag("kv_offloading_size", None, "--kv-offloading-size", "kv_offloading_size", float,
              "vllm serve's short form for the offloading connector: the CPU tier's size in GiB. Builds the "
              "KVTransferConfig vLLM builds for the native backend (OffloadingConnector, kv_role kv_both, "
              "cpu_bytes_to_use = GIB * 2**30); merged into --kv-transfer-config when both are given. "
              "vLLM releases without the flag take the --kv-transfer-config form instead.", metavar="GIB",
              from_log="mapped"),
    ServeFlag("kv_offloading_backend", None, "--kv-offloading-backend", "kv_offloading_backend", str,
              "With --kv-offloading-size: native (OffloadingConnector, the only backend kvdoctor drives).",
              metavar="native", from_log="mapped"),
    ServeFlag("model", "model", "--model", "model", Path,
              "A local model directory (config.json only is read; nothing is downloaded).", from_log="reported"),
    ServeFlag("worker", "worker", "--worker", None, str,
              "vllm (default): vLLM's worker-role connector on real KV tensors with KV content checks | "
              "simulated: bookkeeping only, fastest. A recipe vLLM's worker cannot drive (MultiConnector, a "
              "Mamba layout) runs simulated unless --worker vllm is given, and says so.", panel=WORKER,
              show_default=False, check="worker"),
    ServeFlag("model_runner", "model_runner", "--model-runner", None, str,
              "v1 | v2: the model runner whose connector calls --worker vllm follows and whose "
              "output the scheduler shapes (default: what a GPU deployment of this vLLM runs).", panel=WORKER,
              show_default=False, check="worker"),
    ServeFlag("device", "device", "--device", None, str,
              "cpu | cuda: where --worker vllm keeps the KV tensors (cuda: vLLM's own CPUOffloadingSpec "
              "worker does the copies; default cuda when torch sees a GPU).", panel=WORKER, show_default=False,
              check="worker"),
    ServeFlag("engine", "engine", "--engine", None, str,
              "scheduler (default): kvdoctor calls vLLM's scheduler itself, fastest | core: vLLM's "
              "EngineCore in-process calls it (requests, aborts and steps through the engine) | serve: a "
              "real `vllm serve` child on 127.0.0.1, kvdoctor as its HTTP client (what a client can send; a "
              "silent bug judged by the clients' answers against an offloading-off server). A step a level "
              "cannot play makes the recipe not_applicable there, naming it.",
              panel=WORKER, show_default=False, check="engine"),
    # Not kvdoctor options: spelled in messages, the serve command and logs only. The CPU tier's size is
    # set through --kv-offloading-size or --kv-transfer-config, as with vllm serve.
    ServeFlag("cpu_bytes_to_use", "cpu_bytes_to_use", "kv_connector_extra_config.cpu_bytes_to_use", None, int,
              cli=False),
    ServeFlag("scheduling_policy", "scheduling_policy", "--scheduling-policy", "scheduling_policy", str,
              cli=False, in_command=True, exported=True),
    ServeFlag("prefix_cache_retention_interval", "prefix_cache_retention_interval",
              "--prefix-cache-retention-interval", "prefix_cache_retention_interval", int, cli=False,
              in_command=True),
    ServeFlag("model_tag", None, "--model-tag", "model_tag", str, cli=False, from_log="reported"),
    ServeFlag("speculative_config", None, "--speculative-config", "speculative_config", str, cli=False,
              from_log="reported"),
)
SERVE_FLAGS: dict[str, ServeFlag] = {row.name: row for row in _ROWS}
CLI_FLAGS: tuple[ServeFlag, ...] = tuple(row for row in _ROWS if row.cli)  # `--help`'s order
# The serve arguments `kvdoctor diagnose` keeps from a log (nothing else from its args line is held).
SERVE_ARGS_OF_INTEREST: tuple[str, ...] = tuple(row.serve_arg for row in _ROWS if row.serve_arg and row.from_log)
SWITCH_ARGS: frozenset[str] = frozenset(row.serve_arg for row in _ROWS if row.serve_arg and row.type is bool)
_BY_FIELD: dict[str, ServeFlag] = {row.field: row for row in _ROWS if row.field}


def flag_name(name: str, value: bool | None = None) -> str:
    """The flag that sets Setup field `name` (a switch: the form that sets it to `value`)."""
    row = _BY_FIELD.get(name)
    flag = row.flag if row is not None else "--" + name.replace("_", "-")
    if value is False:
        return "--no-" + flag[2:]
    return flag


def normalise_arg_name(name: str) -> str:
    """`--max-num-seqs`, `max_num_seqs` and `--max_num_seqs` are one argument."""
    return name.lstrip("-").replace("-", "_").strip().lower()


def serve_command_flags(setup: Any) -> list[str]:
    """The geometry part of the `vllm serve` command line for `setup` (a `Setup`): a switch as its
    on/off form, a value where it is set."""
    words: list[str] = []
    for row in _ROWS:
        if not row.in_command or row.field is None:
            continue
        value = getattr(setup, row.field)
        if row.type is bool:
            words.append(row.flag if value else "--no-" + row.flag[2:])
        elif value:
            words += [row.flag, str(value)]
    return words


def exported_setup(setup: Any) -> dict[str, Any]:
    """The serve geometry an exported script builds vLLM's config from (unset optional fields left out)."""
    return {row.field: getattr(setup, row.field) for row in _ROWS
            if row.exported and row.field is not None and (row.type is not str or getattr(setup, row.field))}


# -- serve arguments read from a log ------------------------------------------------------------------

@dataclass
class MappedGeometry:
    """Setup overrides taken from serve arguments, and what could not be taken (said, not hidden)."""

    overrides: Overrides = field(default_factory=Overrides)
    notes: list[str] = field(default_factory=list)


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    return None


def setup_overrides_from_serve_args(args: dict[str, Any]) -> MappedGeometry:
    """Map serve arguments (names normalised) onto `Setup` overrides.

    Values that are not what vLLM would accept are reported in `notes` and
    left out; `kv_transfer_config` goes through the same parser as
    `--kv-transfer-config`.
    """
    notes: list[str] = []
    given: dict[str, Any] = {}
    for row in _ROWS:
        arg = row.serve_arg
        if (row.from_log != "mapped" or row.field is None or arg is None or row.type not in (int, bool)
                or args.get(arg) is None):
            continue
        value = args[arg]
        converted = _as_bool(value) if row.type is bool else _as_int(value)
        if converted is None or (not isinstance(converted, bool) and converted < 1):
            notes.append(f"{arg}={value!r} is not usable as kvdoctor's {row.field}; ignored")
            continue
        given[row.field] = converted
    mapped = MappedGeometry(Overrides(**given), notes)
    backend = args.get("kv_offloading_backend")
    if backend is not None and str(backend).lower() not in ("native",):
        notes.append(f"kv_offloading_backend={backend!r}: kvdoctor drives vLLM's native OffloadingConnector only")
    size = args.get("kv_offloading_size")
    if size is not None:
        try:
            gib = float(size)
        except (TypeError, ValueError):
            gib = -1.0
        if gib > 0:
            mapped.overrides = mapped.overrides.replaced(cpu_bytes_to_use=int(gib * GIB))
        else:
            notes.append(f"kv_offloading_size={size!r} is not a size in GiB; ignored")
    ktc = args.get("kv_transfer_config")
    if ktc is not None:
        _map_kv_transfer_config(ktc, mapped)
    return mapped


def _map_kv_transfer_config(value: Any, mapped: MappedGeometry) -> None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            mapped.notes.append("kv_transfer_config is not valid JSON; ignored")
            return
    if isinstance(value, dict):
        data = {k: v for k, v in value.items() if not str(k).startswith("__")}
        connector = data.get("kv_connector")
        if connector is not None and connector != "OffloadingConnector":
            mapped.notes.append(f"kv_connector={connector!r}: kvdoctor drives OffloadingConnector only; "
                                f"its offloading geometry is used where the config names one")
        extra = data.get("kv_connector_extra_config") or {}
        data = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": extra if isinstance(extra, dict) else {}}
        try:
            text = json.dumps(data, default=str)
        except (TypeError, ValueError):
            mapped.notes.append("kv_transfer_config could not be read; ignored")
            return
    else:
        mapped.notes.append("kv_transfer_config could not be read; ignored")
        return
    try:
        parsed = parse_kv_transfer_config(text)
    except UsageError as exc:
        mapped.notes.append(f"kv_transfer_config not used: {exc}")
        return
    extra = parsed.extra_connector_config or {}
    # Only the keys kvdoctor's CPU tier understands travel on; the rest (hosts, paths of
    # secondary tiers, credentials) stays in the user's deployment.
    kept = {k: v for k, v in extra.items() if k in ("eviction_policy",)}
    if set(extra) - set(kept):
        mapped.notes.append("kv_connector_extra_config keys not reproduced here: "
                            + ", ".join(sorted(str(k) for k in set(extra) - set(kept))))
    parsed = parsed.replaced(extra_connector_config=kept or None)
    mapped.overrides = mapped.overrides.merged(parsed)


# -- --kv-transfer-config ----------------------------------------------------------------------------

# KVTransferConfig fields kvdoctor passes through as given (vLLM validates them; a release
# without the field refuses it, see `harness.build_scheduler`).
PASSED_THROUGH_KV_TRANSFER_KEYS = ("kv_role", "kv_load_failure_policy", "kv_buffer_device", "kv_buffer_size",
                                   "engine_id")
# Keys that cannot take effect in kvdoctor's run: refused with the reason.
_REFUSED_KV_TRANSFER_KEYS = {
    "kv_connector_module_path": "kvdoctor drives vLLM's own OffloadingConnector; it loads no connector module",
}


def parse_kv_transfer_config(text: str) -> Overrides:
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
    given: dict[str, Any] = {}
    if "cpu_bytes_to_use" in extra:
        given["cpu_bytes_to_use"] = _config_int("cpu_bytes_to_use", extra.pop("cpu_bytes_to_use"))
    if "offload_prompt_only" in extra:
        value = extra.pop("offload_prompt_only")
        if not isinstance(value, bool):
            raise UsageError("--kv-transfer-config: offload_prompt_only must be true or false")
        given["offload_prompt_only"] = value
    if "spec_name" in extra:
        given["spec_name"] = str(extra.pop("spec_name"))
    if "block_size" in extra:
        given["offloaded_block_size"] = _config_int("block_size", extra.pop("block_size"))
    given["extra_connector_config"] = extra
    fields = {key: data[key] for key in PASSED_THROUGH_KV_TRANSFER_KEYS if key in data}
    if fields:
        given["kv_transfer_fields"] = fields
    return Overrides(**given)


def _config_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"--kv-transfer-config: {key} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():  # int() would cut it silently
        raise UsageError(f"--kv-transfer-config: {key} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"--kv-transfer-config: {key} must be an integer, got {value!r}") from None
    return number


def offloading_transfer_config(size_gib: float | None, backend: str | None, kv_transfer_config: str | None,
                               simple_offload: str = "0") -> tuple[str | None, list[str]]:
    """`--kv-offloading-size/--kv-offloading-backend` as the `--kv-transfer-config` JSON vLLM builds, and
    the notes to show (`simple_offload`: the VLLM_USE_SIMPLE_KV_OFFLOAD the command runs under).

    vLLM (`VllmConfig._post_init_kv_transfer_config`): nothing unless the size is
    set; backend `native` sets kv_connector = OffloadingConnector (or
    SimpleCPUOffloadConnector under VLLM_USE_SIMPLE_KV_OFFLOAD=1) and updates
    kv_connector_extra_config with cpu_bytes_to_use = size * 2**30; `lmcache`
    selects LMCacheMPConnector; kv_role becomes kv_both. An explicit
    `--kv-transfer-config` is the starting point, as in vLLM.
    """
    from kvdoctor.errors import UsageError

    if size_gib is None:
        notes = (["--kv-offloading-backend does nothing without --kv-offloading-size (as in vLLM); ignored"]
                 if backend is not None else [])
        return kv_transfer_config, notes
    backend = backend or "native"
    if backend == "lmcache":
        raise UsageError("--kv-offloading-backend lmcache makes vLLM use LMCacheMPConnector; kvdoctor drives "
                         "OffloadingConnector (--kv-offloading-backend native)")
    if backend != "native":
        raise UsageError(f"--kv-offloading-backend must be native or lmcache (as vLLM takes it), got {backend!r}")
    if simple_offload not in ("", "0"):
        raise UsageError("VLLM_USE_SIMPLE_KV_OFFLOAD is set: vLLM would build SimpleCPUOffloadConnector from "
                         "--kv-offloading-size; kvdoctor drives OffloadingConnector")
    if not size_gib > 0:
        raise UsageError(f"--kv-offloading-size must be a positive number of GiB, got {size_gib}")
    base: dict[str, Any] = {}
    if kv_transfer_config is not None:
        try:
            base = json.loads(kv_transfer_config)
        except json.JSONDecodeError:
            return kv_transfer_config, []  # parse_kv_transfer_config names the JSON error
        if not isinstance(base, dict):
            return kv_transfer_config, []
    extra = dict(base.get("kv_connector_extra_config") or {})
    extra["cpu_bytes_to_use"] = int(size_gib * (1 << 30))
    base.update(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    return json.dumps(base), []
