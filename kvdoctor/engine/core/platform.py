"""kvdoctor's vLLM platform plugin (entry point group `vllm.platform_plugins`), for `--engine serve`.

kvdoctor is installed into users' serving environments, and vLLM calls every registered platform
plugin in every process it starts. This one therefore declines (returns None, imports nothing)
unless kvdoctor itself asked for it by setting `KVDOCTOR_ENGINE_PLATFORM=1` in the environment
of a `vllm serve` child it starts. Then it names `KvdoctorCpuPlatform`: the device is a CPU and
nothing else in the config changes, so vLLM's CUDA wheel can build its config on a machine
without a GPU (its own probes decline there and `vllm serve` has no `--device`).
"""

from __future__ import annotations

import os

ENV = "KVDOCTOR_ENGINE_PLATFORM"


def register() -> str | None:
    if os.environ.get(ENV) != "1":
        return None
    return "kvdoctor.engine.core.cpu_platform.KvdoctorCpuPlatform"
