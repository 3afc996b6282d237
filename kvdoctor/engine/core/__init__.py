"""The stand-ins kvdoctor owns for the engine levels: the executor vLLM's `EngineCore` hosts, the CPU
platform (`platform` is a registered vLLM plugin entry point: its module path is fixed), the
simulated worker side and the EngineCore harness. Where a recipe is played is `kvdoctor.levels`.

Nothing here imports vLLM at package import."""
