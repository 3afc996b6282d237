"""The engine levels: a recipe played through vLLM's real `EngineCore` (`--engine core`) or a real
`vllm serve` child (`--engine serve`) instead of kvdoctor calling the scheduler itself.

Nothing here imports vLLM at package import: `levels` is pure data (the CLI reads it)."""
