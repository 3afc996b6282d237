"""Names shared by the parent (no vLLM import) and the engine's processes."""

EXECUTOR_QUALNAME = "kvdoctor.engine.core.executor.KvdoctorExecutor"  # vLLM resolves it by this name
STEP_SECONDS_ENV = "KVDOCTOR_ENGINE_STEP_SECONDS"  # serve: pace the steps so client events land between them
PACE_STEPS_ENV = "KVDOCTOR_ENGINE_PACE_STEPS"  # serve: engine steps paced (past the client's last event: full speed)
ADMISSION_ENV = "KVDOCTOR_ENGINE_ADMISSION_LEN"  # serve: the max_model_len of the start-up admission check
WORKER_ENV = "KVDOCTOR_ENGINE_WORKER"  # serve: "vllm" runs vLLM's worker-role connector on fingerprint KV
EOS_AFTER_ARG = "kvdoctor_eos_after"  # serve: a request's vllm_xargs: its (N+1)-th sampled token is EOS
PLAN_ENV = "KVDOCTOR_ENGINE_PLAN"  # serve: the executor's own steps (JSON: holds, completions, failures, EOS)
UNANSWERED_LOG_PREFIX = "kvdoctor-engine unanswered"  # serve: the stand-in model gave no answer (kvdoctor's bug)
