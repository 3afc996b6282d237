"""Options shared by the commands that run recipes, named like `vllm serve` flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kvdoctor.errors import UsageError

GEOMETRY = "Serving geometry (overrides the recipe's [setup])"
OUTPUT = "Output"

BlockSize = Annotated[Optional[int], typer.Option("--block-size", help="GPU KV block size in tokens.",
                                                  rich_help_panel=GEOMETRY)]
BlocksPerChunk = Annotated[Optional[int], typer.Option(
    "--blocks-per-chunk", help="GPU blocks per offloaded chunk (offloaded block size / block size).",
    rich_help_panel=GEOMETRY)]
GpuBlocks = Annotated[Optional[int], typer.Option(
    "--num-gpu-blocks-override", "--gpu-blocks", help="Number of GPU KV blocks (the pool size).",
    rich_help_panel=GEOMETRY)]
AsyncScheduling = Annotated[Optional[bool], typer.Option(
    "--async-scheduling/--no-async-scheduling", help="Use AsyncScheduler (outputs applied one step late).",
    rich_help_panel=GEOMETRY, show_default=False)]
MaxBatchedTokens = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", help="Token budget per step.", rich_help_panel=GEOMETRY)]
MaxModelLen = Annotated[Optional[int], typer.Option(
    "--max-model-len", help="Model context length in tokens (prompt + output); longer prompts are refused.",
    rich_help_panel=GEOMETRY)]
MaxNumSeqs = Annotated[Optional[int], typer.Option("--max-num-seqs", help="Max running requests.",
                                                   rich_help_panel=GEOMETRY)]
ChunkedPrefill = Annotated[Optional[bool], typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", help="Chunked prefill.",
    rich_help_panel=GEOMETRY, show_default=False)]
KvTransferConfig = Annotated[Optional[str], typer.Option(
    "--kv-transfer-config", help="JSON exactly as `vllm serve --kv-transfer-config` takes it.",
    rich_help_panel=GEOMETRY)]
Model = Annotated[Optional[Path], typer.Option(
    "--model", help="A local model directory (config.json only is read; nothing is downloaded).",
    rich_help_panel=GEOMETRY)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.", rich_help_panel=OUTPUT)]
ReportFile = Annotated[Optional[Path], typer.Option(
    "--report", help="Write a Markdown bug-report attachment to FILE.", rich_help_panel=OUTPUT)]
SvgFile = Annotated[Optional[Path], typer.Option(
    "--svg", help="Save the rendered tables as SVG to FILE.", rich_help_panel=OUTPUT)]


def geometry_overrides(block_size: int | None, blocks_per_chunk: int | None, gpu_blocks: int | None,
                       async_scheduling: bool | None, max_num_batched_tokens: int | None,
                       max_num_seqs: int | None, enable_chunked_prefill: bool | None,
                       kv_transfer_config: str | None, model: Path | None,
                       max_model_len: int | None = None) -> dict[str, Any]:
    """Flags given on the command line, as `Setup` overrides (None = keep the recipe's)."""
    from kvdoctor.engine.setup import parse_kv_transfer_config

    overrides: dict[str, Any] = {
        "block_size": block_size, "blocks_per_chunk": blocks_per_chunk, "gpu_blocks": gpu_blocks,
        "async_scheduling": async_scheduling, "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs, "enable_chunked_prefill": enable_chunked_prefill,
        "max_model_len": max_model_len,
    }
    for name in ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                 "max_model_len"):
        value = overrides[name]
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if model is not None:
        if not model.is_dir():
            raise UsageError(f"--model {model}: not a directory (kvdoctor reads a local config.json, never downloads)")
        overrides["model"] = str(model)
    if kv_transfer_config is not None:
        overrides.update(parse_kv_transfer_config(kv_transfer_config))
    return overrides
