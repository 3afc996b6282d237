"""Where a recipe is played: `scheduler` (kvdoctor calls vLLM's scheduler in-process), `core` (vLLM's
`EngineCore` hosting kvdoctor's executor) and `serve` (a `vllm serve` child driven over HTTP).

`runners` is the one table that chooses a level for the application functions; `table` says which
step needs each level meets (pure data, the CLI reads it). Nothing here imports vLLM at package
import."""
