"""`kvdoctor check`: will these `vllm serve` flags start? vLLM's own start-up path, run on this CPU.

`flags.CheckFlags` is the input, `app.check` the application function, `result.CheckResult` what it
returns (rendered by `kvdoctor.report.check`). The stages (`startup`) construct vLLM's configs, plan the
KV cache, build the offloading spec and size its CPU tier against this host; a refusal carries vLLM's own
message and file:line, and `fixes` finds the flag change that avoids it (re-checked, not guessed).
"""
