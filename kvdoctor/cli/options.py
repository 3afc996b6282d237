"""Options shared by the commands that run recipes, named like `vllm serve` flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import SERVE_FLAGS
from kvdoctor.errors import UsageError

OUTPUT = "Output"


def serve_option(name: str) -> Any:
    """The Typer option of serve flag `name`, built from its row of the one table (`SERVE_FLAGS`)."""
    row = SERVE_FLAGS[name]
    return typer.Option(*row.option_names(), help=row.help, metavar=row.metavar, rich_help_panel=row.panel,
                        show_default=row.show_default)


# The value types are written here for the type checker; `cli/serve_flags.py` checks them against the table.
BlockSize = Annotated[int | None, serve_option("block_size")]
BlocksPerChunk = Annotated[int | None, serve_option("blocks_per_chunk")]
GpuBlocks = Annotated[int | None, serve_option("gpu_blocks")]
AsyncScheduling = Annotated[bool | None, serve_option("async_scheduling")]
MaxBatchedTokens = Annotated[int | None, serve_option("max_num_batched_tokens")]
MaxModelLen = Annotated[int | None, serve_option("max_model_len")]
MaxNumSeqs = Annotated[int | None, serve_option("max_num_seqs")]
ChunkedPrefill = Annotated[bool | None, serve_option("enable_chunked_prefill")]
PrefixCaching = Annotated[bool | None, serve_option("enable_prefix_caching")]
KvOffloadingSize = Annotated[float | None, serve_option("kv_offloading_size")]
KvOffloadingBackend = Annotated[str | None, serve_option("kv_offloading_backend")]
KvTransferConfig = Annotated[str | None, serve_option("kv_transfer_config")]
Model = Annotated[Path | None, serve_option("model")]
Worker = Annotated[str | None, serve_option("worker")]
ModelRunner = Annotated[str | None, serve_option("model_runner")]
Device = Annotated[str | None, serve_option("device")]
Engine = Annotated[str | None, serve_option("engine")]
RAY = "Ray"
Ray = Annotated[bool, typer.Option(
    "--ray", help="Run the work as Ray tasks across a cluster (pip install 'kvdoctor[ray]'): a local Ray "
                  "instance started and stopped for this run, or the cluster --ray-address names.",
    rich_help_panel=RAY)]
RayAddress = Annotated[str | None, typer.Option(
    "--ray-address", metavar="ADDRESS", show_default=False,
    help="With --ray: auto (the cluster this machine joined: ray start, KubeRay), HOST:PORT or ray://HOST:PORT. "
         "Default: a local instance.", rich_help_panel=RAY)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (--format json).",
                                    rich_help_panel=OUTPUT)]
Format = Annotated[str | None, typer.Option(
    "--format", metavar="FORMAT", help="text (default) | json | markdown | svg: how the result is printed on "
                                       "stdout (markdown: the --report attachment; svg: the tables as an image).",
    rich_help_panel=OUTPUT, show_default=False)]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show each row's detail (refs, signature, "
                                                                "what to do next).", rich_help_panel=OUTPUT)]
ReportFile = Annotated[Path | None, typer.Option(
    "--report", help="Write a Markdown bug-report attachment to FILE.", rich_help_panel=OUTPUT)]
SvgFile = Annotated[Path | None, typer.Option(
    "--svg", help="Save the rendered tables as SVG to FILE.", rich_help_panel=OUTPUT)]


def kv_offloading_transfer_config(size_gib: float | None, backend: str | None,
                                  kv_transfer_config: str | None) -> str | None:
    """`--kv-offloading-size/--kv-offloading-backend` as the `--kv-transfer-config` JSON vLLM builds
    (`engine.serve_args.offloading_transfer_config`), with the environment this command runs in."""
    from kvdoctor.cli.streams import current, note
    from kvdoctor.engine.serve_args import offloading_transfer_config

    config, notes = offloading_transfer_config(size_gib, backend, kv_transfer_config,
                                               current().getenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "0") or "0")
    for line in notes:
        note(f"kvdoctor: note: {line}")
    return config


def geometry_overrides(block_size: int | None, blocks_per_chunk: int | None, gpu_blocks: int | None,
                       async_scheduling: bool | None, max_num_batched_tokens: int | None,
                       max_num_seqs: int | None, enable_chunked_prefill: bool | None,
                       kv_transfer_config: str | None, model: Path | None,
                       enable_prefix_caching: bool | None = None, kv_offloading_size: float | None = None,
                       kv_offloading_backend: str | None = None, max_model_len: int | None = None
                       ) -> Overrides:
    """Flags given on the command line, as `Setup` overrides (None = keep the recipe's)."""
    from kvdoctor.engine.serve_args import parse_kv_transfer_config

    kv_transfer_config = kv_offloading_transfer_config(kv_offloading_size, kv_offloading_backend,
                                                       kv_transfer_config)
    sizes = {"block_size": block_size, "blocks_per_chunk": blocks_per_chunk, "gpu_blocks": gpu_blocks,
             "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
             "max_model_len": max_model_len}
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if model is not None and not model.is_dir():
        raise UsageError(f"--model {model}: not a directory (kvdoctor reads a local config.json, never downloads)")
    given = Overrides(block_size=block_size, blocks_per_chunk=blocks_per_chunk, gpu_blocks=gpu_blocks,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, async_scheduling=async_scheduling,
                      enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
                      model=None if model is None else str(model))
    if kv_transfer_config is not None:
        given = given.merged(parse_kv_transfer_config(kv_transfer_config))
    return given


def output_format(fmt: str | None, json_out: bool, svg: Path | None = None) -> str:
    """`--format` (with `--json` as its alias) checked: the one format the result is printed in."""
    from kvdoctor.report.formats import FORMATS

    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"--format must be one of {'|'.join(FORMATS)}, got {fmt!r}")
    if json_out and fmt not in (None, "json"):
        raise UsageError(f"--json is --format json; it cannot be combined with --format {fmt}")
    chosen = "json" if json_out else (fmt or "text")
    if svg is not None and chosen in ("json", "markdown"):
        flag = "--json" if json_out else f"--format {chosen}"
        raise UsageError(f"--svg renders the tables; it cannot be combined with {flag}")
    return chosen


def wants_json(fmt: str | None, json_out: bool) -> bool:
    """Whether an error should also be a JSON document on stdout (before the flags are checked)."""
    return json_out or fmt == "json"


def check_output_paths(**paths: Path | None) -> None:
    """Refuse an output path that cannot be written, before any work (and before vLLM is imported)."""
    for flag, path in paths.items():
        if path is None:
            continue
        name = "--" + flag.replace("_", "-")
        if path.is_dir():
            raise UsageError(f"{name} {path}: is a directory; give a file path")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise UsageError(f"{name} {path}: directory {parent} does not exist")
        if not _writable(path if path.exists() else parent):
            raise UsageError(f"{name} {path}: not writable")


def check_output_dir(flag: str, path: Path) -> None:
    """Refuse an output folder that cannot be created or written, before any work."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"{flag} {path}: {probe} is not a directory")
    if not _writable(probe):
        raise UsageError(f"{flag} {path}: {probe} is not writable")


def _writable(target: Path) -> bool:
    """Try it: permission bits say nothing for root or on a read-only mount."""
    try:
        if target.is_dir():
            import tempfile

            with tempfile.NamedTemporaryFile(dir=target, prefix=".kvdoctor-probe-"):
                pass
        else:
            with open(target, "a"):
                pass
    except OSError:
        return False
    return True


# repro, inspect and audit run vLLM's worker side unless told otherwise (explore keeps its own default).
DEFAULT_WORKER = "vllm"


def worker_overrides(worker: str | None, model_runner: str | None, device: str | None) -> Overrides:
    """--worker / --model-runner / --device as `Setup` overrides, checked before vLLM is imported.

    Without --worker, `worker` stays None: the command passes `DEFAULT_WORKER` to the setup resolution
    (`resolution.resolve_setup`), where a recipe's own `worker` key wins over it and a recipe vLLM's worker
    cannot drive falls back to the simulated one, visibly."""
    from kvdoctor.engine.setup import WORKERS

    for flag, value, allowed in (("--worker", worker, WORKERS), ("--model-runner", model_runner,
                                 ("v1", "v2")), ("--device", device, ("cpu", "cuda"))):
        if value is not None and value not in allowed:
            raise UsageError(f"{flag} must be one of {'|'.join(allowed)}, got {value!r}")
    if device is not None and (worker or DEFAULT_WORKER) != "vllm":
        raise UsageError("--device places the KV tensors of --worker vllm; drop --worker simulated")
    return Overrides(worker=worker, model_runner=model_runner, device=device)


def ray_address(ray: bool, address: str | None) -> str | None:
    """Where `--ray` runs ("local": an instance of its own; None: no Ray), refused in one line (exit 2) before
    anything starts where the flags disagree or Ray is not installed."""
    if address is not None and not ray:
        raise UsageError("--ray-address needs --ray")
    if not ray:
        return None
    if address is not None and not address.strip():
        raise UsageError("--ray-address needs an address: auto, HOST:PORT or ray://HOST:PORT")
    from kvdoctor.explore.ray_pool import import_ray

    import_ray()  # without the extra: one line naming it
    return address or "local"


def engine_override(engine: str | None) -> Overrides:
    """--engine as a `Setup` override, checked before vLLM is imported."""
    from kvdoctor.levels.table import LEVELS

    if engine is not None and engine not in LEVELS:
        raise UsageError(f"--engine must be one of {'|'.join(LEVELS)}, got {engine!r}")
    return Overrides(engine=engine)
