"""Names shared by the parent (no vLLM import) and the engine's processes."""

EXECUTOR_QUALNAME = "kvdoctor.engine.core.executor.KvdoctorExecutor"  # vLLM resolves it by this name
STEP_SECONDS_ENV = "KVDOCTOR_ENGINE_STEP_SECONDS"  # serve: pace the steps so client events land between them
ADMISSION_ENV = "KVDOCTOR_ENGINE_ADMISSION_LEN"  # serve: the max_model_len of the start-up admission check
