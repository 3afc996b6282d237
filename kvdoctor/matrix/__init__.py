"""`kvdoctor matrix`: the same recipes asked of many vLLM releases, one uv-managed environment each.

Modules: `releases` (which releases a `--vllm` spec names), `envs` (one cached environment per
release, built with uv's binary), `runner` (kvdoctor run inside an environment, read back as
JSON), `bisect` (first release where a recipe stops reproducing, testing few releases),
`app` (the command's application function), `known` (the measured release outcomes kept as
data, for hints in `repro`/`audit`), `data` (reading and writing that file).
"""
