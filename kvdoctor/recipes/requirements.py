"""What a recipe's trigger may need from the installed vLLM, checked by running code.

A requirement is data (`"spec:TieringOffloadingSpec"`); `missing()` asks the
installed vLLM through the compatibility adapter. A recipe whose requirement is
missing is `not_applicable`, with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdoctor.recipes.geometry import is_known_setup_requirement

if TYPE_CHECKING:
    from kvdoctor.engine.compat import VllmApi

REQUIREMENT_FORMS = ("spec:<OffloadingSpec name>", "kv_cache_group_field:<field>", "cache_config_field:<field>",
                     "secondary_tier:<type>",
                     "setup:<sync_scheduling|one_chunk_cpu_tier|own_geometry|two_running_requests"
                     "|last_token_in_prompt_block|prefill_in_one_step>")


def is_known_requirement(text: str) -> bool:
    kind, _, value = text.partition(":")
    if kind == "setup":  # judged on the geometry, before vLLM is imported (recipes/geometry.py)
        return is_known_setup_requirement(value)
    return kind in ("spec", "kv_cache_group_field", "cache_config_field", "secondary_tier") and bool(value)


def missing(api: VllmApi, requirements: tuple[str, ...]) -> list[str]:
    """Reasons the installed vLLM cannot run this recipe (empty when it can)."""
    reasons = []
    for requirement in requirements:
        kind, _, value = requirement.partition(":")
        if kind == "spec" and not api.has_offloading_spec(value):
            reasons.append(f"this vLLM has no offloading spec {value!r}")
        elif kind == "kv_cache_group_field" and not api.kv_cache_group_has_field(value):
            reasons.append(f"this vLLM's KVCacheGroupSpec has no field {value!r}")
        elif kind == "cache_config_field" and not api.cache_config_has_field(value):
            reasons.append(f"this vLLM's CacheConfig has no field {value!r}")
        elif kind == "secondary_tier" and value == "scripted":
            if not api.has_scripted_tier():
                reasons.append("this vLLM's tiering spec loads no scripted (out-of-tree, deferred-release) tier")
        elif kind == "secondary_tier" and value == "example":
            if not api.has_example_tier():
                reasons.append("this vLLM's tiering spec cannot load its example tier through module_path")
        elif kind == "secondary_tier" and not api.has_secondary_tier(value):
            reasons.append(f"this vLLM's tiering spec has no secondary tier {value!r}")
    return reasons
