"""Speculative decoding at the scheduler level: vLLM's SpeculativeConfig, its block hasher, draft tokens.

kvdoctor builds vLLM's own `SpeculativeConfig` (method `ngram`: no draft model at all; `eagle`: a
drafter "model" that is a local directory holding only a tiny config.json, which vLLM inspects and
never loads on the scheduler side), so the scheduler, its KV cache manager and the offloading
connector take every speculative decision themselves (lookahead slots, 0.34's lookahead block
hashes and EAGLE block drop). What kvdoctor stands in for is the engine core's and the model
runner's side: the request block hasher the engine core builds with `num_hash_lookahead_tokens`,
the drafts the drafter proposes (`Scheduler.update_draft_token_ids`) and the tokens the rejection
sampler accepts (`ModelRunnerOutput.sampled_token_ids`: accepted drafts + one bonus token).
Per-release differences are read by probes (a parameter or attribute present), never versions.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvdoctor.engine.compat.imports import AdapterBase
from kvdoctor.errors import UsageError

# What the installed release adds to speculative decoding (explore weights its draws toward these):
LOOKAHEAD_BLOCK_HASHES = "lookahead_block_hashes"  # VllmConfig.num_hash_lookahead_tokens (0.34)
EAGLE_BLOCK_DROP = "eagle_block_drop"  # SpeculativeConfig.use_eagle_block_drop() (0.34)
SPECULATIVE = "speculative"  # SpeculativeConfig builds here with no download (ngram / a local eagle config)


class SpeculativeGlue(AdapterBase):
    """Mixed into `VllmApi`: the speculative-decoding reads, in one calling style."""

    def speculative_config(self, model_config: Any, method: str, num_tokens: int, draft_dir: str | None,
                           options: dict[str, Any] | None = None) -> Any:
        """vLLM's SpeculativeConfig for the target ModelConfig; vLLM's own validation refuses (exit 2), and so
        does kvdoctor an option (`disable_lookahead_block_hashes`) this release's class has no field for."""
        config_mod = self.mods["config"]
        kwargs: dict[str, Any] = {"method": method, "num_speculative_tokens": num_tokens}
        fields = getattr(config_mod.SpeculativeConfig, "__dataclass_fields__", {}) or {}
        for key, value in (options or {}).items():
            if key not in fields:
                raise UsageError(f"{key}: this vLLM's SpeculativeConfig has no such field")
            kwargs[key] = value
        if method == "ngram":
            kwargs.update(prompt_lookup_max=3, prompt_lookup_min=1)
        else:
            kwargs["model"] = draft_dir
        try:
            return config_mod.SpeculativeConfig(target_model_config=model_config,
                                                target_parallel_config=config_mod.ParallelConfig(), **kwargs)
        except (ValueError, TypeError) as exc:
            lines = [line.strip() for line in str(exc).splitlines()
                     if line.strip() and not line.strip().startswith("For further information")]
            raise UsageError(f"vLLM rejected the speculative config ({method}): {' · '.join(lines)[:400]}") from None

    @staticmethod
    def num_hash_lookahead_tokens(vllm_config: Any) -> int:
        """Tokens past a block its hash covers (0.34's lookahead block hashes; 0 where the release has none)."""
        return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)

    def request_block_hasher(self, hash_block_size: int, hash_fn: Any, vllm_config: Any) -> Any:
        """The request block hasher as vLLM's engine core builds it (with the lookahead where the release has it)."""
        kcu = self.mods["kv_cache_utils"]
        lookahead = self.num_hash_lookahead_tokens(vllm_config)
        if "num_hash_lookahead_tokens" in inspect.signature(kcu.get_request_block_hasher).parameters:
            return kcu.get_request_block_hasher(hash_block_size, hash_fn, lookahead)
        return kcu.get_request_block_hasher(hash_block_size, hash_fn)

    def draft_token_ids(self, req_ids: list[str], drafts: list[list[int]]) -> Any:
        """vLLM's DraftTokenIds, what the drafter hands `Scheduler.update_draft_token_ids`."""
        return self.mods["outputs"].DraftTokenIds(req_ids=list(req_ids), draft_token_ids=[list(d) for d in drafts])

    @staticmethod
    def scheduled_spec_tokens(scheduler_output: Any) -> dict[str, list[int]]:
        """The drafts each request is verified with in this step."""
        return dict(getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {})

    @staticmethod
    def drafts_skipped(scheduler_output: Any) -> bool:
        """0.34's `skip_drafts`: no scheduled request can use drafts, so the model runner proposes none."""
        return bool(getattr(scheduler_output, "skip_drafts", False))

    def speculative_features(self) -> frozenset[str]:
        """What this release's speculative decoding has (probed on its classes)."""
        config_mod = self.mods["config"]
        features = {SPECULATIVE} if hasattr(config_mod, "SpeculativeConfig") else set()
        vllm_config = getattr(config_mod, "VllmConfig", None)
        fields = getattr(vllm_config, "__dataclass_fields__", {}) or {}
        if "num_hash_lookahead_tokens" in fields:
            features.add(LOOKAHEAD_BLOCK_HASHES)
        if hasattr(getattr(config_mod, "SpeculativeConfig", None), "use_eagle_block_drop"):
            features.add(EAGLE_BLOCK_DROP)
        return frozenset(features)
