"""kvdoctor's tiny model: the one `config.json` every level runs with, and the stand-in's answer.

vLLM's ModelConfig needs a model directory; kvdoctor needs no weights (no forward pass runs), so
a throw-away directory holding only this config.json stands in. The exported scripts import no
kvdoctor: they embed `config_json()`'s text, generated here on export, and write it themselves.

The answer (`answer_of`): kvdoctor stands in for the model, so the token a request samples is the
stand-in's, but it is a deterministic function of the KV its attention reads, as a real model's is.
Each KV slot of kvdoctor's toy model holds a 64-bit key of its token prefix (`workers/toy_model.py`);
the stand-in's next token and its logprob are a digest of the keys the request's last position reads
(every position of its context, as full attention reads them). Right KV gives the answer the tokens
alone determine (`ContextKeys`: what an engine without offloading computes); a stale, foreign or
never-written slot gives another token. Not a language model: the same prompt always gives the same
completion, and a wrong KV byte a different one."""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import sys
import tempfile
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any

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


POISON_BYTE = 0x5A  # every KV byte starts as this: a slot never written reads back as poison
POISON_WORD = int.from_bytes(bytes([POISON_BYTE]) * 8, "little", signed=True)


def next_key(previous: int, token: int) -> int:
    """The toy model's KV key of a prefix: the previous position's key chained with this token."""
    chained = previous.to_bytes(8, "little", signed=True) + int(token).to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(chained, digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return key if key not in (0, POISON_WORD) else key + 1


# The stand-in's answer tokens: past EOS (2), so the model never stops a request by itself (a recipe's
# `finish` does), and below the tiny model's vocabulary.
FIRST_ANSWER_TOKEN = 3


def answer_of(context_words: bytes) -> tuple[int, float]:
    """(token, logprob) for a request whose last position reads `context_words`: the little-endian
    int64 word 0 of every KV slot of its context, position 0 first (`workers/toy_model.py` reads them
    from the KV bytes; `ContextKeys` computes what right KV holds)."""
    value = int.from_bytes(hashlib.blake2b(context_words, digest_size=8).digest(), "little")
    span = int(TINY_LLAMA_CONFIG["vocab_size"]) - FIRST_ANSWER_TOKEN  # type: ignore[call-overload]
    return FIRST_ANSWER_TOKEN + value % span, -((value >> 40) % 10_000) / 1_000


def words_bytes(words: list[int]) -> bytes:
    """Signed 64-bit words as the KV tensors hold them (little-endian)."""
    data = array("q", words)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


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
