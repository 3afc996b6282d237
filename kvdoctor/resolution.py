"""A recipe's `Setup` resolved on this machine: the user's overrides, this host's memory, a model
directory's config.json, the device torch sees.

`Setup` (engine/setup.py) is the recipe's pure geometry and checks only itself; what
depends on where kvdoctor runs is judged here, once, before vLLM is imported (exit 2
in one line), and recorded on the setup where kvdoctor falls back (`worker_fallback`,
`device_fallback`). Application packages (app, diagnose, explore, check) call
`resolve_setup`; nothing below them does.
"""

from __future__ import annotations

import dataclasses

from kvdoctor.engine.memory import available_memory_bytes
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import BYTES_PER_GPU_BLOCK, Setup, resolve_blocks_per_chunk
from kvdoctor.errors import UsageError
from kvdoctor.recipes.model import Recipe


def vllm_worker_unsupported(setup: Setup) -> str | None:
    """`Setup.vllm_worker_unsupported`, and a Mamba layer in the layout (its config.json read here)."""
    kind = setup.vllm_worker_unsupported()
    if kind or not (setup.layout or setup.model):
        return kind
    from kvdoctor.engine.kv_layout import MAMBA, resolve_layout

    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    if any(layer.kind == MAMBA for layer in layout.layers):
        named = f"layout {setup.layout}" if setup.layout else f"--model {setup.model}"
        return f"{named} has a Mamba layer, and kvdoctor's toy model writes attention KV only"
    return None


def worker_memory_refusal(setup: Setup) -> str | None:
    """Why this machine cannot hold what vLLM's worker allocates here (None: it can). The worker holds a
    fingerprint page per GPU block and CPU slot (`engine/workers/fingerprint.py`), never the model's real
    pages; the simulated worker holds neither. Judged before vLLM is imported (else the kernel kills the
    run), and again, exactly, once vLLM has planned the groups. None under --device cuda (the GPU's memory)."""
    if setup.device == "cuda":
        return None
    from kvdoctor.engine.kv_layout import resolve_layout
    from kvdoctor.engine.workers.fingerprint import estimate

    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    return estimate(layout, setup.block_size, setup.blocks_per_chunk, setup.gpu_blocks,
                    setup.cpu_bytes_to_use).refusal()


def vllm_worker_refusal(setup: Setup) -> str | None:
    """Why vLLM's worker-role connector cannot run this setup here; None where it can."""
    return vllm_worker_unsupported(setup) or worker_memory_refusal(setup)


def check_on_this_machine(setup: Setup) -> Setup:
    """What `Setup.validate` cannot judge: vLLM's worker here, the memory the simulation needs, a
    model directory kvdoctor can map. A usage error (exit 2) before vLLM is imported."""
    refusal = vllm_worker_refusal(setup) if setup.worker == "vllm" else None
    if refusal:
        raise UsageError(f"--worker vllm: {refusal}; run it with --worker simulated "
                         f"(kvdoctor audit --worker vllm falls back to it for such a recipe)")
    needed = setup.gpu_blocks * BYTES_PER_GPU_BLOCK + (
        setup.cpu_bytes_to_use if setup.spec_name == "TieringOffloadingSpec" else 0)  # tiering maps its tier
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise UsageError(f"this geometry needs ~{needed / 2**30:.1f} GiB of memory to simulate "
                         f"(pool of {setup.gpu_blocks:,} blocks, CPU tier {setup.cpu_bytes_to_use:,} bytes); "
                         f"{available / 2**30:.1f} GiB are available")
    if setup.model is not None:  # an architecture kvdoctor cannot map: exit 2 before vLLM is imported
        from kvdoctor.engine.kv_layout import resolve_layout

        resolve_layout(setup.model, setup.layout, setup.sliding_window)
    return setup


NOTHING_GIVEN = Overrides()


def resolve_setup(recipe: Recipe, overrides: Overrides = NOTHING_GIVEN, worker_fallback: bool = False,
                  default_worker: str | None = None) -> Setup:
    """The one resolution of a run's setup, validated before vLLM is imported, in this order:

    1. the recipe's [setup] over `Setup`'s defaults;
    2. the user's flags over it (`overrides`), and where neither a flag nor the recipe names a worker, the
       command's `default_worker` (repro, inspect and audit: vLLM's);
    3. the fallbacks, each recorded with its reason: `Setup.worker_fallback` where vLLM's worker was asked
       for but cannot run this setup (a MultiConnector, a Mamba layout) and the simulated worker runs
       instead, and `Setup.device_fallback` (`resolve_device`);
    4. this machine's checks (`check_on_this_machine`).

    The worker falls back where it was only the command's default, or where `worker_fallback` allows it
    (audit, per recipe); otherwise asking vLLM's worker for such a setup is a usage error (exit 2), as for
    `repro --worker vllm`."""
    base = dict(recipe.setup)
    extra = dict(base.pop("extra_connector_config", {}))
    try:
        setup = Setup(**base, extra_connector_config=extra)
    except TypeError as exc:
        raise UsageError(f"{recipe.source}: bad [setup]: {exc}") from None
    worker_defaulted = default_worker is not None and overrides.worker is None and "worker" not in recipe.setup
    if worker_defaulted:
        overrides = overrides.replaced(worker=default_worker)
    if (worker_fallback or worker_defaulted) and (overrides.worker or setup.worker) == "vllm":
        asked = dataclasses.replace(setup, **overrides.given())
        unsupported = vllm_worker_unsupported(asked)
        memory = None if unsupported else worker_memory_refusal(asked)
        # the user's own sizes (not the setup's kind) past this machine: refused; audit makes that recipe untested
        if memory and not worker_fallback:
            raise UsageError(f"vLLM's worker (the default) cannot run this geometry here: {memory} "
                             f"(--worker simulated runs it without KV bytes)")
        refusal = unsupported or memory
        if refusal:
            overrides = overrides.replaced(worker=None, device=None)
            setup = dataclasses.replace(setup, worker="simulated", device=None, worker_fallback=refusal)
    given = overrides.given()
    if overrides.extra_connector_config is not None:
        given["extra_connector_config"] = {**setup.extra_connector_config, **overrides.extra_connector_config}
    setup = setup.with_overrides(**given)
    if setup.model is not None and setup.layout is not None:  # the model's own layout: played where its groups
        setup = dataclasses.replace(setup, layout=None, layout_replaced=setup.layout)  # hold the trigger's kinds
    offloaded = overrides.offloaded_block_size
    if offloaded is not None:
        if overrides.blocks_per_chunk is not None:
            bpc = resolve_blocks_per_chunk(setup.block_size, offloaded)
            if bpc != setup.blocks_per_chunk:
                raise UsageError("--blocks-per-chunk and kv_connector_extra_config.block_size disagree")
        setup = setup.with_overrides(blocks_per_chunk=resolve_blocks_per_chunk(setup.block_size, offloaded))
    from kvdoctor.recipes.geometry import plan_setup

    setup = check_on_this_machine(plan_setup(recipe, setup))  # sizes the user did not give, derived for the trigger
    return resolve_device(setup, recipe, fallback=worker_fallback)  # audit: --device cuda falls back too


def resolve_device(setup: Setup, recipe: Recipe, fallback: bool = False) -> Setup:
    """Where vLLM's worker keeps the KV tensors: the GPU when torch sees one, unless told, or unless the
    recipe controls transfers (its steps need `Need.TRANSFER_CONTROL`: only kvdoctor's copy engine on CPU
    tensors can hold or fail a transfer at a chosen step; vLLM's own CUDA worker completes each transfer
    when the GPU does): then the CPU, and `Setup.device_fallback` says why.
    An explicit --device cuda on such a recipe is a usage error, except where `fallback` (audit)."""
    if setup.worker != "vllm":
        return setup
    import torch

    has_cuda = bool(torch.cuda.is_available())
    if setup.device == "cuda" and not has_cuda:
        raise UsageError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    from kvdoctor.steps import Need, kinds_needing

    copy_engine_steps = kinds_needing(Need.TRANSFER_CONTROL)
    controls = sorted({step.action for step in recipe.steps if step.action in copy_engine_steps})
    if controls and setup.device != "cpu" and (has_cuda or setup.device == "cuda"):
        why = (f"{' and '.join(controls)} need kvdoctor's copy engine on CPU tensors; vLLM's own CUDA worker "
               f"completes transfers when the GPU does")
        if setup.device == "cuda" and not fallback:
            raise UsageError(f"--device cuda: recipe {recipe.name}'s {why} (use --device cpu)")
        return dataclasses.replace(setup, device="cpu", device_fallback=why)
    if setup.device is None:
        return setup.with_overrides(device="cuda" if has_cuda else "cpu")
    return setup
