"""Offloading specs vLLM loads by name (`spec_name` + `spec_module_path` of
`kv_connector_extra_config`) when kvdoctor runs vLLM's worker-role connector on a CPU.

`Kvdoctor<Name>` is vLLM's registered spec `<Name>` (e.g. `CPUOffloadingSpec`,
`TieringOffloadingSpec`) unchanged on the scheduler side (its real manager, its real
capacity) whose `get_worker()` returns kvdoctor's copy engine instead of the CUDA one.
The engine's `TransferControl` is found through `kvdoctor_control` in the extra config.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.engine import compat

PREFIX = "Kvdoctor"
CONTROL_KEY = "kvdoctor_control"
CONTROLS: dict[str, Any] = {}  # control id -> TransferControl, registered by the harness
_CLASSES: dict[str, type] = {}


def spec_name_for(base_name: str) -> str:
    return PREFIX + base_name


def _make(base_name: str) -> type:
    base = compat.load().offloading_spec_class(base_name)

    def get_worker(self: Any, kv_caches: Any) -> Any:
        if getattr(self, "_kvdoctor_worker", None) is None:
            from kvdoctor.engine.workers.copy_engine import CopyEngineWorker

            api = compat.load()
            extra = api.spec_extra_config(self)
            control = CONTROLS[str(extra[CONTROL_KEY])]
            # The scheduler's CPU slot count (this spec computed its own from the fingerprint pages)
            slots = control.cpu_slots if control.cpu_slots is not None else api.spec_cpu_blocks(self)
            self._kvdoctor_worker = CopyEngineWorker(kv_caches, api.spec_blocks_per_chunk(self), slots, control)
            control.engine = self._kvdoctor_worker
        return self._kvdoctor_worker

    return type(spec_name_for(base_name), (base,), {
        "get_worker": get_worker,
        "__doc__": f"vLLM's {base_name} with kvdoctor's CPU copy engine as its worker.",
        "__module__": __name__,
    })


def __getattr__(name: str) -> type:
    """vLLM resolves `spec_name` with getattr(module, name): build the subclass on demand."""
    if name.startswith(PREFIX) and len(name) > len(PREFIX):
        if name not in _CLASSES:
            _CLASSES[name] = _make(name[len(PREFIX):])
        return _CLASSES[name]
    raise AttributeError(name)
