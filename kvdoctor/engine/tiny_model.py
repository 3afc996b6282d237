"""kvdoctor's tiny model: the one `config.json` every level and every exported script runs with.

vLLM's ModelConfig needs a model directory; kvdoctor needs no weights (no forward pass runs), so
a throw-away directory holding only this config.json stands in. The exported scripts import no
kvdoctor: they embed `config_json()`'s text, generated here on export, and write it themselves."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    # Long enough for production context lengths (--max-model-len 131072 and beyond);
    # vLLM refuses a max_model_len above the model's own.
    "max_position_embeddings": 1 << 20,
    "torch_dtype": "float16",
}


def config_json() -> str:
    """The config.json text (what kvdoctor writes, and what an exported script embeds)."""
    return json.dumps(TINY_LLAMA_CONFIG, indent=2)


def _config_dir(prefix: str, config: dict) -> str:
    """A throw-away directory holding only `config` as its config.json, removed when the process exits
    (spawned explore workers exit through `sys.exit`, so theirs goes too)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return str(directory)


@lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """The model directory of kvdoctor's tiny config.json (one per process)."""
    return _config_dir("kvdoctor-model-", TINY_LLAMA_CONFIG)


# The EAGLE drafter's config.json (speculative method "eagle"): vLLM's SpeculativeConfig inspects the
# drafter's architecture and never loads it on the scheduler side; one decoder layer, as an EAGLE-Llama
# head has.
TINY_EAGLE_DRAFT_CONFIG = {**TINY_LLAMA_CONFIG, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}


@lru_cache(maxsize=1)
def tiny_draft_dir() -> str:
    """The directory of the stand-in EAGLE drafter's config.json (one per process)."""
    return _config_dir("kvdoctor-draft-", TINY_EAGLE_DRAFT_CONFIG)
