"""kvdoctor's tiny model: the one `config.json` every level runs with, and the stand-in's answer.

vLLM's ModelConfig needs a model directory; kvdoctor needs no weights (no forward pass runs), so
a throw-away directory holding only this config.json stands in. The exported scripts import no
kvdoctor: they embed `config_json()`'s text, generated here on export, and write it themselves.

The answer (`answer_key.answer_of`: standard library only, so an exported serve script embeds it):
kvdoctor stands in for the model, so the token a request samples is the stand-in's, but it is a
deterministic function of the KV its attention reads, as a real model's is.
Each KV slot of kvdoctor's toy model holds a 64-bit key of its token prefix (`workers/toy_model.py`);
the stand-in's next token and its logprob are a digest of the keys the request's last position reads
(every position of its context, as full attention reads them). Right KV gives the answer the tokens
alone determine (`ContextKeys`: what an engine without offloading computes); a stale, foreign or
never-written slot gives another token. Not a language model: the same prompt always gives the same
completion, and a wrong KV byte a different one."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvdoctor.engine.answer_key import VOCAB_SIZE, answer_of, next_key, words_bytes

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB_SIZE,
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


class ContextKeys:
    """Each request's prefix keys from its tokens alone: what right KV holds (the answer an engine gives
    without offloading, and the one kvdoctor's worker without KV bytes gives). Grown incrementally; a
    request whose tokens changed below what was keyed starts over."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[list[int], list[int]]] = {}  # request -> (tokens keyed, keys)

    def answer(self, req_id: str, tokens: Any, upto: int) -> tuple[int, float]:
        keyed, keys = self._keys.get(req_id, ([], []))
        upto = min(upto, len(tokens))
        if keyed != list(tokens[:len(keyed)]):
            keyed, keys = [], []
        while len(keys) < upto:
            token = int(tokens[len(keys)])
            keys.append(next_key(keys[-1] if keys else 0, token))
            keyed.append(token)
        self._keys[req_id] = (keyed, keys)
        return answer_of(words_bytes(keys[:upto]))
