"""The model's KV layout: which layers keep which kind of KV cache, and the groups vLLM makes of them.

A layout is read from a `config.json` (a local `--model DIR`, or one of the
small configs kvdoctor ships under `kvdoctor/models/`, named by a recipe's
`[setup] layout`). kvdoctor stands in for the model runner's
`get_kv_cache_spec()`: it builds one KV spec per layer (full attention,
sliding window, Mamba state, EAGLE drafter layers); vLLM's own planner then
groups them and places them in the pool (`compat.plan_kv_cache`), as the
engine core does at start-up. Nothing here imports vLLM: the specs are built
through the adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvdoctor.errors import UsageError

FULL = "full_attention"
SLIDING = "sliding_attention"
MAMBA = "mamba"
MLA = "mla_attention"  # multi-head latent attention (DeepSeek): one latent KV "head" of kv_lora_rank + rope dims
KINDS = (FULL, SLIDING, MAMBA, MLA)
# config.json `layer_types` spellings (Hugging Face) -> kvdoctor's kinds
_LAYER_TYPE_ALIASES = {
    "full_attention": FULL, "attention": FULL, "global_attention": FULL,
    "sliding_attention": SLIDING, "sliding_window": SLIDING, "local_attention": SLIDING,
    "mamba": MAMBA, "linear_attention": MAMBA, "mamba2": MAMBA,
}
# Nemotron-H `hybrid_override_pattern`: M = Mamba, * = attention, - = MLP (no KV), E = MoE (no KV)
_PATTERN_KINDS = {"M": MAMBA, "*": FULL}


@dataclass(frozen=True)
class LayerKind:
    kind: str
    sliding_window: int | None = None
    draft: bool = False  # an EAGLE/MTP drafter layer
    # A full-attention layer's own KV geometry where it differs from the model's (Gemma 4's
    # `global_head_dim` / `num_global_key_value_heads`); None: the layout's.
    num_kv_heads: int | None = None
    head_size: int | None = None


@dataclass(frozen=True)
class KvLayout:
    """The layers that keep KV, in model order, and where they were read from."""

    source: str  # "kvdoctor default", "shipped layout 'swa-full'", or a directory
    layers: tuple[LayerKind, ...]
    num_kv_heads: int = 1
    head_size: int = 8
    dtype: str = "float16"
    notes: tuple[str, ...] = ()  # what the config has that this layout leaves out, and why (MTP draft layers)

    @property
    def is_hybrid(self) -> bool:
        return len({(layer.kind, layer.sliding_window, layer.draft, layer.num_kv_heads, layer.head_size)
                    for layer in self.layers}) > 1

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block's KV over every layer, as the model runner's tensors hold it (K and V of each
        attention layer; a Mamba layer's state is padded to the attention page, so it counts as one)."""
        dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}.get(self.dtype, 2)
        return sum((1 if layer.kind == MLA else 2) * (layer.num_kv_heads or self.num_kv_heads)
                   * (layer.head_size or self.head_size) * dtype_bytes * block_size for layer in self.layers)

    def layer_names(self) -> list[str]:
        names = []
        target = 0
        draft = 0
        for layer in self.layers:
            if layer.draft:
                names.append(f"drafter.layers.{draft}.self_attn.attn")
                draft += 1
            else:
                part = "mixer" if layer.kind == MAMBA else "self_attn.attn"
                names.append(f"model.layers.{target}.{part}")
                target += 1
        return names


DEFAULT_LAYOUT = KvLayout("kvdoctor default (one full-attention layer)", (LayerKind(FULL),), dtype="float32")


def shipped_layouts() -> dict[str, Path]:
    """The layouts kvdoctor ships: name -> model directory holding its config.json."""
    root = resources.files("kvdoctor") / "models"
    found = {}
    for entry in root.iterdir():
        if entry.is_dir() and (entry / "config.json").is_file():
            found[entry.name] = Path(str(entry))
    return dict(sorted(found.items()))


def shipped_layout_dir(name: str) -> Path:
    layouts = shipped_layouts()
    if name not in layouts:
        raise UsageError(f"unknown layout {name!r}; kvdoctor ships: {', '.join(layouts) or 'none'}")
    return layouts[name]


def read_layout(model_dir: str | Path, source: str | None = None,
                sliding_window: int | None = None) -> KvLayout:
    """The KV layout a `config.json` describes (read once per process: planning validates often)."""
    return _read_layout(str(model_dir), source, sliding_window)


@functools.lru_cache(maxsize=32)
def _read_layout(model_dir: str, source: str | None, sliding_window: int | None) -> KvLayout:
    """The KV layout a `config.json` describes (and, beside it, an EAGLE drafter's `draft/config.json`)."""
    directory = Path(model_dir)
    config = _read_json(directory / "config.json")
    _check_sizes(config, directory / "config.json")
    if "model_type" in config and not _is_kvdoctor_layout(config):
        return _read_with_transformers(directory, config, source, sliding_window)
    layers = list(_layers_of(config, directory, sliding_window))
    draft_dir = directory / "draft"
    if (draft_dir / "config.json").is_file():
        draft = _read_json(draft_dir / "config.json")
        layers.extend(LayerKind(k.kind, k.sliding_window, draft=True)
                      for k in _layers_of(draft, draft_dir, sliding_window))
    if not layers:
        raise UsageError(f"{directory / 'config.json'}: no layer keeps a KV cache")
    text = _text_config(config)
    heads = _positive(text, "num_key_value_heads", text.get("num_attention_heads", 1), directory)
    head_size = text.get("head_dim")
    if head_size is None:
        hidden = _positive(text, "hidden_size", 64, directory)
        head_size = hidden // max(1, int(text.get("num_attention_heads", 1)))
    layers = _with_global_geometry(layers, text, directory)
    return KvLayout(source or str(directory), tuple(layers), int(heads), int(head_size))


def _is_kvdoctor_layout(config: dict[str, Any]) -> bool:
    """kvdoctor's shipped toy layouts (`_kvdoctor` key): a few layers, read by kvdoctor's own reader."""
    return "_kvdoctor" in config


def _read_with_transformers(directory: Path, config: dict[str, Any], source: str | None,
                            sliding_window: int | None) -> KvLayout:
    """A model's KV layout through transformers' own config class, as vLLM reads it (`AutoConfig`).

    The config class fills what a config.json leaves to defaults: Gemma 3's `sliding_window_pattern`
    becomes `layer_types` (52 sliding + 10 full for 62 layers), Qwen3-Next's `full_attention_interval` its
    linear-attention layers. DeepSeek's `kv_lora_rank` is multi-head latent attention (one latent of
    kv_lora_rank + qk_rope_head_dim per token). An architecture neither transformers nor kvdoctor can map
    is a usage error, never a silent fallback.
    """
    where = directory / "config.json"
    model_type = config.get("model_type")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError(f"{where}: reading model_type {model_type!r} needs transformers (installed with "
                         f"vLLM); it is not importable here") from None
    try:
        cfg = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError for unknown types
        raise UsageError(f"{where}: transformers cannot read model_type {model_type!r} "
                         f"({type(exc).__name__}: {_first_line(exc)}); kvdoctor cannot map its KV layout") from None
    text = cfg.get_text_config()
    count = getattr(text, "num_hidden_layers", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"{where}: num_hidden_layers must be a positive integer, got {count!r} "
                         f"({type(text).__name__}); kvdoctor cannot map its KV layout")
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None) or 1
    head_size = getattr(text, "head_dim", None)
    if not head_size:
        head_size = int(getattr(text, "hidden_size", 64)) // max(1, int(getattr(text, "num_attention_heads", 1) or 1))
    window = sliding_window or getattr(text, "sliding_window", None)
    how = f"{type(text).__name__}"
    if getattr(text, "kv_lora_rank", None):
        latent = int(text.kv_lora_rank) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
        layers = [LayerKind(MLA, num_kv_heads=1, head_size=latent)] * count
        how += f" (kv_lora_rank: MLA, {latent} latent dims a token)"
    elif getattr(text, "layer_types", None):
        layers = []
        for value in text.layer_types:
            kind = _LAYER_TYPE_ALIASES.get(str(value))
            if kind is None:
                raise UsageError(f"{where}: layer_types has a kind kvdoctor cannot map: {value!r} (kvdoctor "
                                 f"knows {', '.join(sorted(_LAYER_TYPE_ALIASES))})")
            layers.append(LayerKind(kind, window if kind == SLIDING else None))
        how += " layer_types"
    elif getattr(text, "layers_block_type", None):  # Jamba-style: "mamba" / "attention" per layer
        layers = [LayerKind(MAMBA if str(t) == "mamba" else FULL) for t in text.layers_block_type]
        how += " layers_block_type"
    elif getattr(text, "hybrid_override_pattern", None):
        layers = [LayerKind(_PATTERN_KINDS[c]) for c in str(text.hybrid_override_pattern) if c in _PATTERN_KINDS]
        how += " hybrid_override_pattern"
    elif window and getattr(text, "use_sliding_window", True) is not False:
        layers = [LayerKind(SLIDING, window)] * count  # every layer windowed (Mistral-style)
    else:
        layers = [LayerKind(FULL)] * count
    for layer in layers:
        if layer.kind == SLIDING and (not isinstance(layer.sliding_window, int) or layer.sliding_window < 1):
            raise UsageError(f"{where}: sliding-window layers need a positive sliding_window, got {window!r}")
    if not layers:
        raise UsageError(f"{where}: no layer keeps a KV cache")
    layers = _with_global_geometry(layers, text.to_dict(), directory)
    return KvLayout(source or f"{directory} (read by transformers' {how})", tuple(layers), int(heads), int(head_size),
                    notes=_draft_layers_left_out(text))


# Sizes a model config gives that vLLM divides or multiplies by: 0 or a negative one is refused here, naming the
# file and field (vLLM would take num_key_value_heads = 0 for "no KV" and -8 for a negative KV size).
_POSITIVE_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                   "sliding_window", "kv_lora_rank", "num_global_key_value_heads", "global_head_dim")


def _check_sizes(config: dict[str, Any], where: Path) -> None:
    """Every size `config` (and its `text_config`) gives is a positive integer (null: left to the default)."""
    for part, prefix in ((config, ""), (config.get("text_config"), "text_config.")):
        if not isinstance(part, dict):
            continue
        for key in _POSITIVE_SIZES:
            value = part.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{where}: {prefix}{key} must be a positive integer, got {json.dumps(value)}")


def _draft_layers_left_out(text: Any) -> tuple[str, ...]:
    """DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`) keep KV only where vLLM is given a
    speculative config (method `deepseek_mtp` / `mtp`), which loads them as a draft model: a server without
    one builds the target model's layers alone, and so does kvdoctor (it takes no speculative config)."""
    count = getattr(text, "num_nextn_predict_layers", None)
    if not isinstance(count, int) or count < 1:
        return ()
    return (f"the config's {count} MTP draft layer(s) (num_nextn_predict_layers) are not planned: vLLM builds "
            f"their KV cache only under a speculative config (method deepseek_mtp), which kvdoctor does not take; "
            f"these are the groups of a server without one",)


def _with_global_geometry(layers: list[LayerKind], text: dict[str, Any], directory: Path) -> list[LayerKind]:
    """Full-attention layers with their own head size / KV heads (Gemma 4: `global_head_dim`,
    `num_global_key_value_heads`). Their page per token then differs from the sliding-window
    layers', and vLLM's planner unifies page sizes by growing the smaller page's block size: the
    groups get different block sizes (mixed granularities), as DeepSeek V4 deployments have."""
    heads = text.get("num_global_key_value_heads")
    size = text.get("global_head_dim")
    if heads is None and size is None:
        return layers
    if heads is not None:
        heads = _positive(text, "num_global_key_value_heads", None, directory)
    if size is not None:
        size = _positive(text, "global_head_dim", None, directory)
    return [dataclasses.replace(layer, num_kv_heads=heads, head_size=size)
            if layer.kind == FULL and not layer.draft else layer for layer in layers]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file (kvdoctor reads a local config.json, never downloads)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON file ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a model config must be a JSON object")
    return data


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json (`text_config` in a multimodal model's), else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _positive(config: dict[str, Any], key: str, default: Any, where: Path) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where / 'config.json'}: {key} must be a positive integer, got {value!r}")
    return value


def _layers_of(config: dict[str, Any], directory: Path, window_override: int | None) -> list[LayerKind]:
    text = _text_config(config)
    window = window_override or text.get("sliding_window")
    where = directory / "config.json"
    if "layer_types" in text:
        kinds = []
        for value in text["layer_types"]:
            kind = _LAYER_TYPE_ALIASES.get(str(value))
            if kind is None:
                raise UsageError(f"{where}: layer_types has an unknown kind {value!r} "
                                 f"(kvdoctor knows {', '.join(sorted(_LAYER_TYPE_ALIASES))})")
            kinds.append(kind)
    elif "hybrid_override_pattern" in text:
        kinds = [_PATTERN_KINDS[c] for c in str(text["hybrid_override_pattern"]) if c in _PATTERN_KINDS]
    else:
        count = _positive(text, "num_hidden_layers", 1, directory)
        kinds = [SLIDING if window else FULL] * count
    layers = []
    for kind in kinds:
        if kind == SLIDING:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise UsageError(f"{where}: sliding-window layers need a positive sliding_window, got {window!r}")
            layers.append(LayerKind(SLIDING, window))
        else:
            layers.append(LayerKind(kind))
    return layers


@dataclass
class KvCacheGroup:
    """One KV cache group as vLLM's planner made it (a compact, release-neutral description)."""

    index: int
    kind: str  # full_attention | sliding_window | mamba | ...: the spec class, in words
    block_size: int
    layers: list[str]
    sliding_window: int | None = None
    mamba_cache_mode: str | None = None
    eagle: bool = False

    def describe(self) -> str:
        extra = f" window={self.sliding_window}" if self.sliding_window else ""
        extra += f" mamba_cache_mode={self.mamba_cache_mode}" if self.mamba_cache_mode else ""
        extra += " eagle" if self.eagle else ""
        return f"group {self.index}: {self.kind} block_size={self.block_size}{extra} layers={len(self.layers)}"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "block_size": self.block_size,
                "layers": list(self.layers), "sliding_window": self.sliding_window,
                "mamba_cache_mode": self.mamba_cache_mode, "eagle": self.eagle}


@dataclass
class KvPlan:
    """What the planner built, and what kvdoctor had to say about it."""

    layout: KvLayout
    groups: list[KvCacheGroup]
    num_blocks: int
    scheduler_block_size: int
    hash_block_size: int
    planner: str  # which vLLM functions grouped the layers
    notes: list[str] = field(default_factory=list)
    # The max_model_len vLLM's start-up admission check was run with while planning, where the pool is
    # too small for one request of the setup's max_model_len (None: the check passed as configured).
    # The engine level runs its own planning with the same length.
    admission_len: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.layout.source, "planner": self.planner, "num_blocks": self.num_blocks,
                "scheduler_block_size": self.scheduler_block_size, "hash_block_size": self.hash_block_size,
                "groups": [g.as_dict() for g in self.groups], "notes": list(self.notes),
                "admission_len": self.admission_len}

    def describe(self) -> str:
        return "; ".join(g.describe() for g in self.groups)


def resolve_layout(model: str | None, layout: str | None, sliding_window: int | None = None) -> KvLayout:
    """The layout a setup names: `--model DIR` (over a recipe's own layout: the run then measures that the
    model's groups hold the kinds the trigger needs, `missing_trigger_groups`), a shipped `layout`, or the
    single-group default."""
    if model is not None:
        return read_layout(model, None, sliding_window)
    if layout is not None:
        return read_layout(shipped_layout_dir(layout), f"shipped layout {layout!r}", sliding_window)
    return DEFAULT_LAYOUT


def speculative_blocks(setup: Any) -> int:
    """The speculative blocks vLLM gives each Mamba layer's spec under a speculative config
    (`MambaBase.get_kv_cache_spec`: `num_speculative_blocks = num_speculative_tokens`, 0 without one;
    0.34's ReplaySSM, which kvdoctor does not set, gives 0)."""
    return int(setup.num_speculative_tokens) if getattr(setup, "speculative_method", None) else 0


def layer_specs(api: Any, layout: KvLayout, block_size: int, max_model_len: int,
                mamba_cache_mode: str | None, num_speculative_blocks: int = 0) -> dict[str, Any]:
    """Per-layer KV specs, as a model runner's `get_kv_cache_spec()` returns them.

    Attention layers: float16 K/V of the config's KV heads and head size.
    Mamba layers: a conv + SSM state padded to the attention page (vLLM pads
    the smaller page to the larger one when it unifies page sizes); in `align`
    mode one state per block of `block_size` tokens, otherwise one state per
    request (block size = max model length), as vLLM's runner sizes them; under a speculative config
    `num_speculative_blocks` more state blocks a request (`speculative_blocks`), as vLLM sets them.
    """
    import torch

    spec_class = api.kv_cache_spec_class
    dtype = getattr(torch, layout.dtype)
    full = spec_class("FullAttentionSpec")(block_size=block_size, num_kv_heads=layout.num_kv_heads,
                                           head_size=layout.head_size, dtype=dtype)
    specs: dict[str, Any] = {}
    for name, layer in zip(layout.layer_names(), layout.layers, strict=True):
        if layer.kind == MLA:
            spec = spec_class("MLAAttentionSpec")(block_size=block_size, num_kv_heads=1, head_size=layer.head_size,
                                                  dtype=dtype)
        elif layer.kind == FULL and (layer.num_kv_heads or layer.head_size):
            spec = spec_class("FullAttentionSpec")(block_size=block_size,
                                                   num_kv_heads=layer.num_kv_heads or layout.num_kv_heads,
                                                   head_size=layer.head_size or layout.head_size, dtype=dtype)
        elif layer.kind == FULL:
            spec = full
        elif layer.kind == SLIDING:
            spec = spec_class("SlidingWindowSpec")(block_size=block_size, num_kv_heads=layout.num_kv_heads,
                                                   head_size=layout.head_size, dtype=dtype,
                                                   sliding_window=layer.sliding_window)
        else:
            mode = mamba_cache_mode or "none"
            state = full.page_size_bytes // 2 // 2  # fp16 elements in half the attention page
            conv = max(1, state // 4)
            spec = spec_class("MambaSpec")(shapes=((1, conv), (1, state - conv)), dtypes=(dtype, dtype),
                                           block_size=block_size if mode == "align" else max_model_len,
                                           page_size_padded=full.page_size_bytes, mamba_cache_mode=mode,
                                           **({"num_speculative_blocks": num_speculative_blocks}
                                              if num_speculative_blocks else {}))
        specs[name] = spec
    return specs


def plan(api: Any, vllm_config: Any, setup: Any) -> tuple[KvPlan, Any, int, int]:
    """Build the setup's layout and let vLLM group and place it; returns (plan, scheduler KVCacheConfig,
    scheduler block size, hash block size)."""
    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    notes = list(layout.notes)
    note = api.enable_hybrid_kv_cache_manager(vllm_config)
    if note:
        notes.append(note)
    specs = layer_specs(api, layout, setup.block_size, setup.max_model_len, setup.mamba_cache_mode,
                        speculative_blocks(setup))
    names = layout.layer_names()
    drafts = {name for name, layer in zip(names, layout.layers, strict=True) if layer.draft}
    pool = setup.gpu_blocks
    try:
        if setup.layout_replaced is not None:
            missing = missing_trigger_groups(api, vllm_config, setup, specs, drafts)
            if missing is not None:
                raise TriggerGroupsMissing(missing)
            notes.append(f"--model {setup.model} replaces the recipe's own layout {setup.layout_replaced!r}: vLLM "
                         f"plans the model's groups with every kind the trigger needs")
        if setup.model and "gpu_blocks" not in setup.fixed:
            pool, note = _pool_for_groups(api, vllm_config, specs, setup.gpu_blocks, drafts,
                                          getattr(setup, "mamba_fill_requests", None), speculative_blocks(setup))
            if note:
                notes.append(note)
        _, scheduler_config, block_size, hash_block_size, planner, checked_len = api.plan_kv_cache(
            vllm_config, specs, pool, drafts)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        raise UsageError(f"vLLM's KV cache planner rejected the layout ({layout.source}): "
                         f"{type(exc).__name__}: {_first_line(exc)}") from None
    if checked_len < setup.max_model_len:
        notes.append(f"the pool of {pool} blocks is below what vLLM's start-up check asks for "
                     f"max_model_len={setup.max_model_len} (a server would refuse to start); planned with "
                     f"the check at max_model_len={checked_len}")
    groups = [KvCacheGroup(**api.describe_group(i, g)) for i, g in enumerate(scheduler_config.kv_cache_groups)]
    kinds = {(layer.kind, layer.sliding_window) for layer in layout.layers}
    if len(kinds) > 1 and len(groups) < len({k for k, _ in kinds}):
        notes.append(f"vLLM's planner merged {len(kinds)} layer kinds into {len(groups)} group(s): "
                     "this is not what a GPU deployment builds")
    if drafts:
        notes.append("EAGLE: kvdoctor flags the groups holding drafter layers (is_eagle_group), as vLLM's "
                     "planner does for an EAGLE speculative config; no draft model is built")
    if any(layer.kind == MAMBA for layer in layout.layers):
        notes.append("Mamba state pages are padded to the attention page (a GPU deployment may instead grow "
                     "the attention block size to match the state)")
    admission_len = checked_len if checked_len < setup.max_model_len else None
    return (KvPlan(layout, groups, int(scheduler_config.num_blocks), block_size, hash_block_size, planner, notes,
                   admission_len),
            scheduler_config, block_size, hash_block_size)


class TriggerGroupsMissing(Exception):
    """The `--model` given for a recipe with its own layout plans no KV cache group of a kind the trigger needs
    (measured through vLLM's planner): the run is untested, and the message says both groupings."""


_GROUP_WORDS = {"full_attention": "full-attention", "sliding_window": "sliding-window",
                "mamba": "Mamba/linear-attention", "MLAAttentionSpec": "MLA attention"}


def _group_kind(group: dict[str, Any]) -> str:
    """A planned group's kind, in words: an EAGLE drafter group is its own kind (vLLM flags it is_eagle_group)."""
    return "EAGLE drafter" if group["eagle"] else _GROUP_WORDS.get(group["kind"], group["kind"])


def _planned_groups(api: Any, vllm_config: Any, specs: dict[str, Any], drafts: set[str]) -> list[dict[str, Any]]:
    """The KV cache groups vLLM's planner makes of `specs` (its grouping alone: a recipe's hash unit that suits
    its own layout's groups is judged by the real plan, not here)."""
    return [api.describe_group(i, g) for i, g in enumerate(api.kv_cache_groups(vllm_config, specs, drafts))]


def describe_groups(groups: list[dict[str, Any]]) -> str:
    """"7 groups: sliding-window x52 layers (6 groups), full-attention x10 layers": groups of a kind together."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        kinds.setdefault(_group_kind(group), []).append(group)
    parts = []
    for kind, same in kinds.items():
        layers = sum(len(g["layers"]) for g in same)
        parts.append(f"{kind} x{layers} layer{'s' if layers != 1 else ''}"
                     + (f" ({len(same)} groups)" if len(same) > 1 else ""))
    return f"{len(groups)} group{'s' if len(groups) != 1 else ''}: {', '.join(parts)}"


def missing_trigger_groups(api: Any, vllm_config: Any, setup: Any, model_specs: dict[str, Any],
                           model_drafts: set[str]) -> str | None:
    """Why the `--model`'s layout cannot hold the trigger of a recipe scripted at its own layout
    (`Setup.layout_replaced`), or None where it can: both layouts are grouped by vLLM's planner at the run's
    config, and every kind of group the recipe's layout gets (sliding window, Mamba, an EAGLE drafter group,
    full attention) must be among the model's. Measured at run time, never read from the config's words."""
    own = resolve_layout(None, setup.layout_replaced, setup.sliding_window)
    own_specs = layer_specs(api, own, setup.block_size, setup.max_model_len, setup.mamba_cache_mode)
    own_drafts = {name for name, layer in zip(own.layer_names(), own.layers, strict=True) if layer.draft}
    needed = _planned_groups(api, vllm_config, own_specs, own_drafts)
    planned = _planned_groups(api, vllm_config, model_specs, model_drafts)
    have = {_group_kind(g) for g in planned}
    lacking = list(dict.fromkeys(_group_kind(g) for g in needed if _group_kind(g) not in have))
    if not lacking:
        return None
    model = Path(setup.model).name or str(setup.model)
    needs = " and ".join(f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind} KV group" for kind in lacking)
    return (f"the trigger needs {needs} (it is scripted at layout "
            f"{setup.layout_replaced!r}, which vLLM plans as {describe_groups(needed)}); {model} plans "
            f"{describe_groups(planned)}")


# Blocks a request holds in a Mamba group of vLLM's `align` cache mode: the running state and the state of the
# previous step (MambaManager frees the one before, and allocates at most one a step).
MAMBA_ALIGN_BLOCKS_PER_REQUEST = 2


def _pool_for_groups(api: Any, vllm_config: Any, specs: dict[str, Any], blocks: int,
                     drafts: set[str], mamba_requests: int | None = None,
                     spec_blocks: int = 0) -> tuple[int, str | None]:
    """The pool of a `--model` whose layers vLLM splits into several KV cache groups, sized as the recipe
    planned it: every group takes a block of the one shared pool for each block of a request's tokens, so a
    recipe planned for `blocks` (block 0: the null block) gets `(blocks - 1) x groups + 1`. The groups are
    vLLM's own: its planner groups the layers first, in a pool large enough for its start-up check.

    Where the recipe runs the pool out (`Setup.mamba_fill_requests`: the requests that hold it then), a Mamba
    group does not take a block for each block of tokens: in `align` mode a request holds at most two of its
    blocks, in `none` mode one (its block is max_model_len). Those groups get that many blocks for each of
    those requests, so the fill leaves no block over (measured on 0.26.0: a block a token block in every group
    left Qwen3-Next's queued request admitted). Under a speculative config each such request also holds the
    `spec_blocks` speculative blocks vLLM gives a Mamba spec (`speculative_blocks`; MambaManager allocates them
    with the running state in either mode)."""
    _, grouped, _, _, _, _ = api.plan_kv_cache(vllm_config, specs, max(blocks, 2) * 64, drafts)
    groups = [api.describe_group(i, g) for i, g in enumerate(grouped.kv_cache_groups)]
    if len(groups) <= 1:
        return blocks, None
    if mamba_requests is None:
        pool = (blocks - 1) * len(groups) + 1
        return pool, (f"the pool holds the recipe's {blocks - 1} usable blocks for each of vLLM's {len(groups)} KV "
                      f"cache groups: {pool} blocks (with --num-gpu-blocks-override, the pool is as given)")
    per_request = {"align": MAMBA_ALIGN_BLOCKS_PER_REQUEST + spec_blocks, "none": 1 + spec_blocks}
    state = [g for g in groups if g["kind"] == "mamba" and g["mamba_cache_mode"] in per_request]
    held = sum(per_request[g["mamba_cache_mode"]] for g in state) * mamba_requests
    token_groups = len(groups) - len(state)
    pool = (blocks - 1) * token_groups + held + 1
    return pool, (f"the pool holds the recipe's {blocks - 1} usable blocks for each of vLLM's {token_groups} KV cache "
                  f"group(s) that take a block a block of tokens, and the {held} blocks its {len(state)} Mamba "
                  f"group(s) hold for the {mamba_requests} request(s) that fill it"
                  f"{f' ({spec_blocks} speculative block(s) each)' if spec_blocks else ''}: {pool} blocks (with "
                  f"--num-gpu-blocks-override, the pool is as given)")


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__
