"""The serve flags (`vllm serve`'s geometry, the worker side, `--engine`), declared once.

`repro`, `inspect` and `audit` take the same 17 flags. Writing them out in each
signature let them drift (audit lacked `--engine`); here `ServeFlags` is the one
declaration (each field's annotation is its Typer option, from `options`), and
`with_serve_flags` puts them into a command's signature where its `serve: ServeFlags`
parameter stands, so Typer sees ordinary options and the command gets one value.
`overrides` turns that value into the `Setup` overrides (`engine.overrides.Overrides`),
checked before vLLM is imported. The flags themselves (names, help, types) are rows of
the one serve-flag table, `engine/serve_args.SERVE_FLAGS`. Cheap to import (Typer only).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from kvdoctor.cli import options as opt
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import CLI_FLAGS

PARAMETER = "serve"  # the parameter a command names to receive the flags


@dataclass(frozen=True)
class ServeFlags:
    """What the user gave (None: keep the recipe's); the order is `--help`'s."""

    block_size: opt.BlockSize = None
    blocks_per_chunk: opt.BlocksPerChunk = None
    gpu_blocks: opt.GpuBlocks = None
    async_scheduling: opt.AsyncScheduling = None
    max_num_batched_tokens: opt.MaxBatchedTokens = None
    max_num_seqs: opt.MaxNumSeqs = None
    max_model_len: opt.MaxModelLen = None
    enable_chunked_prefill: opt.ChunkedPrefill = None
    enable_prefix_caching: opt.PrefixCaching = None
    kv_transfer_config: opt.KvTransferConfig = None
    kv_offloading_size: opt.KvOffloadingSize = None
    kv_offloading_backend: opt.KvOffloadingBackend = None
    model: opt.Model = None
    worker: opt.Worker = None
    model_runner: opt.ModelRunner = None
    device: opt.Device = None
    engine: opt.Engine = None


# Each flag, by name, -> the check in `options` that turns it into `Setup` overrides (the geometry and
# connector flags, the worker side, the engine level): the table's `check` column. Flags are passed by
# keyword, so adding one cannot shift the others.
FLAG_CHECKS: dict[str, str] = {row.name: row.check for row in CLI_FLAGS}
_CHECKS: dict[str, Callable[..., Overrides]] = {
    "geometry": opt.geometry_overrides, "worker": opt.worker_overrides, "engine": opt.engine_override}


def _check_against_the_table() -> None:
    """`ServeFlags` lists the table's CLI flags, in its order, each with the table's value type."""
    names = [f.name for f in fields(ServeFlags)]
    if names != [row.name for row in CLI_FLAGS] or set(FLAG_CHECKS) != set(names):  # pragma: no cover
        raise TypeError(f"ServeFlags {names} against the serve-flag table {[row.name for row in CLI_FLAGS]}")
    hints = get_type_hints(ServeFlags)
    for row in CLI_FLAGS:
        if hints[row.name] != (row.type | None):  # pragma: no cover - guards the annotations
            raise TypeError(f"ServeFlags.{row.name} is {hints[row.name]}; the serve-flag table says {row.type}")


_check_against_the_table()


def overrides(flags: ServeFlags) -> Overrides:
    """The flags as `Setup` overrides (geometry, worker side, engine level), refused with a
    `UsageError` when one is out of range."""
    result = Overrides()
    for name, check in _CHECKS.items():
        result = result.merged(
            check(**{flag: getattr(flags, flag) for flag, which in FLAG_CHECKS.items() if which == name}))
    return result


def _flag_parameters() -> list[inspect.Parameter]:
    hints = get_type_hints(ServeFlags, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                              annotation=hints[f.name]) for f in fields(ServeFlags)]


def with_serve_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Replace `command`'s `serve: ServeFlags` parameter by the flags themselves (Typer reads the
    signature), and hand `command` one `ServeFlags` built from what Typer parsed."""
    signature = inspect.signature(command, eval_str=True)
    if PARAMETER not in signature.parameters:
        raise TypeError(f"{command.__name__} has no `{PARAMETER}: ServeFlags` parameter")
    shared = _flag_parameters()
    names = [p.name for p in shared]
    clash = set(names) & set(signature.parameters)
    if clash:
        raise TypeError(f"{command.__name__} declares serve flags itself: {sorted(clash)}")
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        parameters.extend(shared if parameter.name == PARAMETER else [parameter])

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = ServeFlags(**{name: kwargs.pop(name, None) for name in names})
        return command(*args, **{PARAMETER: flags}, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]  # inspect reads it; Callable has none
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__  # Typer and inspect read the new signature, not the command's
    return wrapper
