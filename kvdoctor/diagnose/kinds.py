"""Where a crash happened, said by what its traceback shows, and what kvdoctor can check there.

kvdoctor's recipes drive vLLM's scheduler and the offloading connector's scheduler role; a crash
elsewhere is named for what it is, not called an "engine traceback": a transfer worker's failed
copy (vLLM's `Exception in (...) transfer N:` and frames under `kv_offload/worker/`), a start-up
failure (the offloading spec's handlers, the shared CPU region, config checks, a worker's
initialisation), or a native crash (a signal in C++ code: `swap_blocks`, a CUDA copy). Each kind
says what kvdoctor can check on this machine and what it cannot. The crash site named to the
user skips the generic frames every traceback passes through (`worker_busy_loop`, `run_busy_loop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.diagnose.traceback import LogFrame, LogTraceback

# Frames every engine or worker traceback passes through: never "the crash site".
GENERIC_FRAMES = frozenset({
    "worker_busy_loop", "worker_main", "run_engine_core", "run_busy_loop", "_process_engine_step",
    "_process_input_queue", "step", "step_with_batch_queue", "collective_rpc", "run_method", "execute_method",
    "sync_wrapper", "async_wrapper", "wrapper", "_wrapper", "inner", "wrapped", "decorate_context", "__call__",
    "_call_impl", "_wrapped_call_impl", "main", "<module>", "run", "_run", "run_forever", "_run_once",
})
# Native frames of the runtime below vLLM's own op: the CUDA driver and runtime, libc, the interpreter.
_RUNTIME_PREFIXES = ("cu", "cuda", "nccl", "__", "_start", "0x", "Py", "_Py", "c10::", "torch::", "at::",
                     "pybind11::", "std::", "start_thread", "clone", "libc", "??")
_STARTUP_FUNCTIONS = frozenset({
    "create_handlers", "get_handlers", "_wait_for_file_size", "register_kv_caches", "initialize_from_config",
    "initialize_kv_cache", "_initialize_kv_caches", "init_device", "determine_available_memory",
    "_check_available_space", "check_shm_free_space", "verify_and_update_config", "__post_init__",
})


@dataclass(frozen=True)
class CrashKind:
    name: str  # "engine" | "transfer worker" | "start-up" | "native" | "other"
    label: str  # how the report names the traceback
    can: str  # what kvdoctor can check about it here
    cannot: str  # what it cannot


ENGINE = CrashKind(
    "engine", "engine traceback",
    "kvdoctor drives vLLM's real scheduler and the offloading connector's scheduler role on this CPU: a known bug "
    "is run as its recipe; an unknown one can be written as a recipe (--write-recipe) or hunted with explore",
    "")
TRANSFER = CrashKind(
    "transfer worker", "transfer worker traceback",
    "`--worker vllm` runs vLLM's own worker-role connector and its copy plan on this CPU, with KV content checks on "
    "every store and load (store-copies-computed-kv, load-returns-stored-bytes): `kvdoctor audit --worker vllm` "
    "checks what the scheduler asks the worker to copy and what lands where",
    "the copy itself is kvdoctor's memmove on a CPU, not vLLM's CUDA kernel: a failure inside the CUDA copy "
    "(driver, pinned memory, stream errors) shows only with `--device cuda` on a GPU machine")
STARTUP = CrashKind(
    "start-up", "start-up failure",
    "it is vLLM's own start-up code refusing this configuration: the serve flags in the log (or given to "
    "kvdoctor) say which offloading spec, tiers and sizes it was building",
    "kvdoctor's recipes start after start-up: no recipe replays it; the host's memory, /dev/shm and other "
    "nodes are the deployment's, not this machine's")
NATIVE = CrashKind(
    "native", "native crash",
    "`--worker vllm` checks the copy plan vLLM's worker hands to its kernel (block ids, offsets, sizes) against "
    "the KV tensors on this CPU: `kvdoctor audit --worker vllm`",
    "kvdoctor does not run vLLM's CUDA kernels or the CUDA driver on a CPU: a bad address inside the kernel "
    "shows only on a GPU (`--device cuda`)")
OTHER = CrashKind(
    "other", "traceback",
    "",
    "its frames are in neither the scheduler, the offloading connector nor its worker: kvdoctor's recipes do not "
    "drive that code")


def _path(frame: LogFrame) -> str:
    return frame.file.replace("\\", "/")


def crash_site(tb: LogTraceback) -> LogFrame | None:
    """The frame to name as where it crashed: the innermost vLLM frame that is not one every traceback passes
    through; else the innermost such frame of any file; else the innermost vLLM frame."""
    if tb.native:
        named = [f for f in tb.frames if not f.function.startswith(_RUNTIME_PREFIXES)]
        return named[-1] if named else (tb.frames[-1] if tb.frames else None)
    vllm = tb.vllm_frames
    specific = [f for f in vllm if f.function not in GENERIC_FRAMES]
    if specific:
        return specific[-1]
    others = [f for f in tb.frames if f.function not in GENERIC_FRAMES]
    if others:
        return others[-1]
    return vllm[-1] if vllm else None


def native_below(tb: LogTraceback) -> LogFrame | None:
    """The runtime frame the native crash happened in, under the named site (`cudaMemcpyAsync`)."""
    site = crash_site(tb)
    if not tb.native or site is None or site not in tb.frames:
        return None
    below = tb.frames[tb.frames.index(site) + 1:]
    return below[-1] if below else None


def classify(tb: LogTraceback) -> CrashKind:
    if tb.native:
        return NATIVE
    paths = [_path(f) for f in tb.frames]
    functions = {f.function for f in tb.frames}
    message = tb.message or ""
    if (functions & _STARTUP_FUNCTIONS or "Timed out waiting for mmap" in message
            or any("/kv_offload/" in p and f.function == "__init__" for p, f in zip(paths, tb.frames, strict=True))
            or any(p.endswith("offloading/config.py") for p in paths)):
        return STARTUP
    if tb.header.startswith("Exception in") or any("/kv_offload/worker/" in p or p.endswith("gpu_worker.py")
                                                  for p in paths):
        return TRANSFER
    engine_process = tb.process is not None and tb.process.startswith("EngineCore")
    if engine_process or any("/v1/core/" in p or "offloading/scheduler.py" in p or "/v1/engine/" in p
                             for p in paths):
        return ENGINE
    if not tb.frames:
        return ENGINE if tb.after_fatal_marker else OTHER
    return OTHER


def describe_native(tb: LogTraceback) -> str:
    """`SIGSEGV in swap_blocks (inside cudaMemcpyAsync: a CUDA copy)`."""
    site = crash_site(tb)
    text = tb.exception or "a signal"
    if site is None:
        return f"{text}, no frames in the log"
    text += f" in {site.function}"
    below = native_below(tb)
    if below is not None:
        text += f" (inside {below.function}" + (": a CUDA copy" if "Memcpy" in below.function else "") + ")"
    return text


# What vLLM's own start-up refusals mean, by the message and the frame they come with (from upstream threads:
# vllm-project/vllm#54415, #46949, #44888).
_STARTUP_CAUSES = (
    ("Timed out waiting for mmap file", "",
     ("the shared CPU region's file never reached its size: the rank that creates it failed, or it is on another "
      "node (the shared region assumes every rank of the engine on one host)")),
    ("Bad address", "madvise",
     ("the CPU region is larger than /dev/shm or the host's memory can back: faulting its pages in "
      "(madvise MADV_POPULATE_WRITE) failed; a smaller --kv-offloading-size (cpu_bytes_to_use) or a larger "
      "/dev/shm avoids it")),
    ("Invalid argument", "madvise",
     "the kernel does not know MADV_POPULATE_WRITE (Linux older than 5.14)"),
)


def startup_cause(tb: LogTraceback) -> str:
    """What a start-up failure's message and frames say about its cause ("" when nothing known fits)."""
    codes = " ".join(f.code for f in tb.frames)
    for message, code, cause in _STARTUP_CAUSES:
        if message in (tb.message or "") and code in codes:
            return cause
    return ""


def from_loose(loose: object) -> LogTraceback | None:
    """The loose lines of a fragment as one traceback-like body, for `classify` (None when they hold no exception
    or frame)."""
    frames = list(getattr(loose, "frames", []))
    exceptions = list(getattr(loose, "exceptions", []))
    if not frames and not exceptions:
        return None
    name, message = (exceptions[-1][0], exceptions[-1][1]) if exceptions else (None, "")
    return LogTraceback(None, 0, frames=frames, exception=name, qualified_exception=name, message=message)
