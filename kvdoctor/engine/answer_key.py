"""The stand-in model's KV keys and answer: the one definition, standard library only.

kvdoctor's toy model (`workers/toy_model.py`), its token-only reference (`tiny_model.ContextKeys`) and the
stand-in executor an exported serve script embeds (`core/standin_executor.py`, which imports only vLLM and
the standard library) all compute a slot's key and a request's answer with these functions; an export copies
this module in verbatim (`compat.inline_portable`). Hence no kvdoctor import, no vLLM import and no
`from __future__` here.
"""

import hashlib
import sys
from array import array

VOCAB_SIZE = 1024  # kvdoctor's tiny model's vocabulary (tiny_model.TINY_LLAMA_CONFIG)
POISON_BYTE = 0x5A  # every KV byte starts as this: a slot never written reads back as poison
POISON_WORD = int.from_bytes(bytes([POISON_BYTE]) * 8, "little", signed=True)
# The stand-in's answer tokens: past EOS (2), so the model never stops a request by itself (a recipe's
# `finish` does), and below the tiny model's vocabulary.
FIRST_ANSWER_TOKEN = 3


def next_key(previous: int, token: int) -> int:
    """The toy model's KV key of a prefix: the previous position's key chained with this token."""
    chained = previous.to_bytes(8, "little", signed=True) + int(token).to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(chained, digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return key if key not in (0, POISON_WORD) else key + 1


def answer_of(context_words: bytes) -> tuple[int, float]:
    """(token, logprob) for a request whose last position reads `context_words`: the little-endian
    int64 word 0 of every KV slot of its context, position 0 first (`workers/toy_model.py` reads them
    from the KV bytes; `ContextKeys` computes what right KV holds)."""
    value = int.from_bytes(hashlib.blake2b(context_words, digest_size=8).digest(), "little")
    span = VOCAB_SIZE - FIRST_ANSWER_TOKEN
    return FIRST_ANSWER_TOKEN + value % span, -((value >> 40) % 10_000) / 1_000


def words_bytes(words: list[int]) -> bytes:
    """Signed 64-bit words as the KV tensors hold them (little-endian)."""
    data = array("q", words)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()
