"""The platform `platform.register` names: "the device is a CPU", and the config is left alone.

It does not subclass vLLM's `CpuPlatform`, whose `check_and_update_config` rewrites the config
for vLLM's own CPU worker (async scheduling off, its worker class, LD_PRELOAD); kvdoctor's
executor runs no model and needs none of that."""

from __future__ import annotations

from typing import Any

from vllm.platforms.interface import Platform, PlatformEnum


class KvdoctorCpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "kvdoctor-cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 1 << 30

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """Nothing to adapt: kvdoctor's executor runs no model."""

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True
