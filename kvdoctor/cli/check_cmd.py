"""`kvdoctor check`: will these `vllm serve` flags start, and which known bugs apply at them.

Registered in `kvdoctor.cli.app`; cheap to import (Typer only). The work is in `kvdoctor.check.app`,
the formatting in `kvdoctor.report.check`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli.common import command_line, run
from kvdoctor.cli.serve_flags import ServeFlags, overrides, with_serve_flags
from kvdoctor.engine.serve_args import GEOMETRY

TensorParallel = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", help="Workers per engine (ParallelConfig.tensor_parallel_size).",
    rich_help_panel=GEOMETRY)]
DataParallel = Annotated[int, typer.Option(
    "--data-parallel-size", "-dp", help="Engines on the host, each with its own CPU tier.",
    rich_help_panel=GEOMETRY)]
SpeculativeConfig = Annotated[str | None, typer.Option(
    "--speculative-config", help="JSON as vllm serve takes it (ngram or eagle: a tiny drafter stands in).",
    rich_help_panel=GEOMETRY)]
HostMemory = Annotated[str | None, typer.Option(
    "--host-memory", metavar="SIZE", help="The serving host's memory (e.g. 512GiB); default: this host's MemTotal.",
    rich_help_panel=GEOMETRY)]
NoAudit = Annotated[bool, typer.Option("--no-audit", help="Skip the known bugs at these flags (start-up only).",
                                       rich_help_panel=opt.OUTPUT)]


@with_serve_flags
def check(
    serve: ServeFlags = ServeFlags(),
    tensor_parallel_size: TensorParallel = 1,
    data_parallel_size: DataParallel = 1,
    speculative_config: SpeculativeConfig = None,
    host_memory: HostMemory = None,
    no_audit: NoAudit = False,
    json_out: opt.Json = False,
    output_format: opt.Format = None,
) -> None:
    """Preflight: run vLLM's own start-up path at your serve flags on this CPU, before you deploy.

    vLLM's config validation, the KV cache planner, the offloading spec and its CPU tier sized against
    this host's memory and /dev/shm (or --host-memory): "starts", or vLLM's own message and file:line and
    the flag change that avoids it (run through the same path). Then the known bugs that reproduce at
    these flags (the audit's rows; --no-audit skips them)."""

    def action() -> int:
        from kvdoctor.check.flags import CheckFlags, parse_json_flag, parse_size
        from kvdoctor.errors import UsageError

        fmt = opt.output_format(output_format, json_out)
        for flag, value in (("--tensor-parallel-size", tensor_parallel_size),
                            ("--data-parallel-size", data_parallel_size)):
            if value < 1:
                raise UsageError(f"{flag} must be a positive integer, got {value}")
        from kvdoctor.engine.setup import MAX_GPU_BLOCKS

        if serve.gpu_blocks is not None and not 0 < serve.gpu_blocks <= MAX_GPU_BLOCKS:
            raise UsageError(f"--num-gpu-blocks-override {serve.gpu_blocks}: kvdoctor plans pools of 1 to "
                             f"{MAX_GPU_BLOCKS:,} blocks (vLLM's scheduler builds one Python object per block)")
        if serve.model is not None and not serve.model.is_dir():
            raise UsageError(f"--model {serve.model}: not a directory (kvdoctor reads a local config.json, "
                             f"never downloads)")
        transfer = opt.kv_offloading_transfer_config(serve.kv_offloading_size, serve.kv_offloading_backend,
                                                     serve.kv_transfer_config)
        flags = CheckFlags(
            model=None if serve.model is None else str(serve.model), block_size=serve.block_size,
            gpu_blocks=serve.gpu_blocks, max_model_len=serve.max_model_len, max_num_seqs=serve.max_num_seqs,
            max_num_batched_tokens=serve.max_num_batched_tokens, enable_prefix_caching=serve.enable_prefix_caching,
            enable_chunked_prefill=serve.enable_chunked_prefill, async_scheduling=serve.async_scheduling,
            kv_transfer_config=parse_json_flag("--kv-transfer-config", transfer),
            tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
            speculative_config=parse_json_flag("--speculative-config", speculative_config),
            host_memory=None if host_memory is None else parse_size("--host-memory", host_memory))
        from kvdoctor.check.app import check as run_check
        from kvdoctor.check.app import exit_status
        from kvdoctor.cli.progress import Progress

        with Progress("check") as progress:
            result = run_check(flags, lambda: overrides(serve), command=command_line(), audit=not no_audit,
                               on_progress=progress.callback)
        from kvdoctor.cli import output
        from kvdoctor.cli.failures import raise_unwritten
        from kvdoctor.report import check as render
        from kvdoctor.report.formats import Shown

        shown = Shown(renderables=lambda: render.check_renderables(result),
                      document=lambda: render.check_document(result),
                      markdown=lambda: render.check_markdown(result))
        raise_unwritten(output.show(shown, fmt))
        return int(exit_status(result))

    run(action, opt.wants_json(output_format, json_out))
