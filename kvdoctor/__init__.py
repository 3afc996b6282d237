"""kvdoctor: reproduce and diagnose scheduler-side bugs of vLLM's KV offloading connector."""

__version__ = "0.1.0"

# The version of every `--json` document's layout (repro, inspect, audit, matrix, diagnose, explore,
# errors): defined here only; a reader checks it before trusting the keys.
SCHEMA_VERSION = 3
# 3 (2026-12-04): the measured fixing release is `fixed_in` everywhere (was `release_hint` in repro and
# audit rows); audit's `engine`.
# 2 (2026-12-04): audit's `summary`; diagnose matches carry strength, why and the fixing release
# (runs: fixed_in / last_reproducing); `not_reached` / `untested` outcomes.
