"""Hypothesis strategies for event sequences, and their translation into valid recipes.

A generated example is a `Geometry` plus a list of abstract events. Events
name requests by index (`k`), resolved modulo the requests added so far when
the sequence is turned into recipe steps, so any list hypothesis draws (or
shrinks to) is a valid recipe: an abort, finish or transfer rule only ever
names a request that was added before it, a shared prefix only an earlier
request; events that cannot apply yet (an abort before any add) are dropped.
Prompt lengths are kept to what a real server would admit: prompt +
max_tokens <= max_model_len, and the whole model length fits the GPU pool
(`max_model_len = (gpu_blocks - 1) * block_size`, block 0 being vLLM's null
block), so no request can starve forever for lack of blocks.

Every recipe ends with a fixed *drain tail* (`schedule`, `complete_transfers`,
`schedule count = DRAIN_STEPS`): after it every transfer has been reported
and every finished request's connector state must have been released, which
the runner checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hypothesis import strategies as st

from kvdoctor.recipes.model import Recipe, Signature, Step

# Never matches a failure: the explorer classifies failures itself (see runner.py).
PLACEHOLDER_SIGNATURE = Signature(exception="(explore: any failure)", function="(explore)")
DRAIN_STEPS = 4  # engine steps after releasing every transfer (covers the async one-step lag twice)
MAX_REQUEST_REF = 15  # request indices drawn in 0..15, taken modulo the requests added so far
MAX_SCHEDULE_COUNT = 8


@dataclass(frozen=True)
class Geometry:
    block_size: int
    blocks_per_chunk: int
    gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool

    @property
    def max_model_len(self) -> int:
        return (self.gpu_blocks - 1) * self.block_size

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def setup_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size, "blocks_per_chunk": self.blocks_per_chunk,
            "gpu_blocks": self.gpu_blocks, "async_scheduling": self.async_scheduling,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }


# Each event is drawn as two integers (a row of EVENT_TABLE and a 24-bit parameter word),
# each geometry as one integer: a handful of draws per example keeps hypothesis' share of the
# time small next to the scheduler's (see benchmarks/bench_explore.py), and both shrink
# towards 0, which decodes to the simplest choice (a `schedule`, small sizes, no prefix).
EVENT_TABLE = ("schedule", "add", "abort", "schedule", "add", "abort", "schedule", "finish",
               "hold", "complete", "fail", "reset", "schedule", "add", "abort", "finish")
BLOCK_SIZES = (4, 2, 8, 16, 1)
MAX_NUM_SEQS = (16, 4, 2)
BATCHED_TOKENS = (256, 8, 16, 32, 64)
SIZE_KINDS = ("tokens", "chunks", "pool", "fill")
TRANSFER_KINDS = (None, "store", "load")
WORD = (1 << 24) - 1


def decode_geometry(word: int) -> Geometry:
    """Mixed-radix fields of one integer; 0 is block size 4, one block per chunk, 4 GPU blocks."""
    word, block_size = divmod(word, len(BLOCK_SIZES))
    word, blocks_per_chunk = divmod(word, 4)
    word, gpu_blocks = divmod(word, 21)
    word, seqs = divmod(word, len(MAX_NUM_SEQS))
    word, batched = divmod(word, len(BATCHED_TOKENS))
    max_num_seqs = MAX_NUM_SEQS[seqs]
    return Geometry(block_size=BLOCK_SIZES[block_size], blocks_per_chunk=1 + blocks_per_chunk,
                    gpu_blocks=4 + gpu_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max(BATCHED_TOKENS[batched], max_num_seqs),
                    async_scheduling=bool(word % 2))


def decode_event(row: int, word: int) -> tuple[Any, ...]:
    """One abstract event (as `event_steps` reads it) from a table row and a parameter word.

    - schedule: count = 1 + word % MAX_SCHEDULE_COUNT
    - add: bits 22-23 size kind (tokens: 1-64 tokens; chunks: 1-8 offloaded chunks; pool:
      1-8 eighths of the longest admissible prompt; fill: fill_pool), bits 16-21 its value,
      bits 12-15 max_tokens - 1, bits 8-11 the request to share a prefix with, bits 0-7 the
      prefix (< 160: none; 160-223: 1-8 chunks; 224-255: 1-63 tokens)
    - abort, finish: the request (word % 16)
    - hold / complete / fail transfers: kind (any, store, load) = word % 3; request = (word // 3) % 6
      (0: every request)
    - reset_prefix_cache: bit 0 reset_running_requests, bit 1 reset_connector
    """
    action = EVENT_TABLE[row]
    if action == "schedule":
        return ("schedule", 1 + word % MAX_SCHEDULE_COUNT)
    if action == "add":
        kind = SIZE_KINDS[(word >> 22) & 3]
        value = (word >> 16) & 63
        size = ("fill",) if kind == "fill" else (kind, 1 + (value if kind == "tokens" else value % 8))
        code = word & 255
        prefix = None
        if code >= 224:
            prefix = ((word >> 8) & 15, ("tokens", 1 + (code - 224) * 2))
        elif code >= 160:
            prefix = ((word >> 8) & 15, ("chunks", 1 + (code - 160) % 8))
        return ("add", size, 1 + ((word >> 12) & 15), prefix)
    if action in ("abort", "finish"):
        return (action, word % (MAX_REQUEST_REF + 1))
    if action in ("hold", "complete", "fail"):
        target = (word // 3) % 6
        return (action, None if target == 0 else target - 1, TRANSFER_KINDS[word % 3])
    return ("reset", bool(word & 1), bool(word & 2))


@lru_cache(maxsize=None)
def geometries() -> st.SearchStrategy[Geometry]:
    """Small pools (preemption and queueing happen), every chunking, sync and async."""
    return st.integers(0, WORD).map(decode_geometry)


@lru_cache(maxsize=None)
def event_strategy() -> st.SearchStrategy[tuple[Any, ...]]:
    return st.builds(decode_event, st.integers(0, len(EVENT_TABLE) - 1), st.integers(0, WORD))


@dataclass(frozen=True)
class Example:
    geometry: Geometry
    events: tuple[tuple[Any, ...], ...]


@lru_cache(maxsize=None)
def examples(max_events: int) -> st.SearchStrategy[Example]:
    return st.builds(Example, geometries(), st.lists(event_strategy(), min_size=1, max_size=max_events).map(tuple))


def request_name(index: int) -> str:
    return chr(ord("A") + index) if index < 26 else f"R{index}"


def event_steps(example: Example) -> list[Step]:
    """The recipe steps of an example's events (without the drain tail)."""
    g = example.geometry
    mml = g.max_model_len
    names: list[str] = []
    lengths: dict[str, int] = {}
    steps: list[Step] = []

    def pick(k: int) -> str:
        return names[k % len(names)]

    def schedule(count: int) -> None:
        if steps and steps[-1].action == "schedule":
            count += steps[-1].args.get("count", 1)
            steps.pop()
        steps.append(Step("schedule", {"count": count} if count > 1 else {}, 0))

    for event in example.events:
        action = event[0]
        if action == "schedule":
            schedule(event[1])
        elif action == "add":
            _, size, max_tokens, prefix = event
            rid = request_name(len(names))
            args: dict[str, Any] = {"request": rid}
            if size[0] == "fill" and g.gpu_blocks >= 3:
                args["fill_pool"] = True
                length = (g.gpu_blocks - 2) * g.block_size
            elif size[0] == "chunks" and size[1] * g.chunk_tokens <= mml - 1:
                args["prompt_chunks"] = size[1]
                length = size[1] * g.chunk_tokens
            else:
                wanted = {"tokens": size[1], "chunks": size[1] * g.chunk_tokens,
                          "pool": -(-size[1] * (mml - 1) // 8), "fill": mml - 1}[size[0]]
                length = max(1, min(wanted, mml - 1))
                args["prompt_tokens"] = length
            args["max_tokens"] = max(1, min(max_tokens, mml - length))
            if prefix is not None and names:
                other = pick(prefix[0])
                unit, amount = prefix[1]
                shared = amount * g.chunk_tokens if unit == "chunks" else amount
                shared = min(shared, length, lengths[other])
                if shared >= 1:
                    args["shared_prefix_with"] = other
                    args["shared_prefix_tokens"] = shared
            names.append(rid)
            lengths[rid] = length
            steps.append(Step("add", args, 0))
        elif action in ("abort", "finish"):
            if names:
                steps.append(Step(action, {"request": pick(event[1])}, 0))
        elif action in ("hold", "complete", "fail"):
            _, target, kind = event
            args = {}
            if target is not None:
                if not names:
                    continue
                args["request"] = pick(target)
            if kind is not None:
                args["kind"] = kind
            steps.append(Step(f"{action}_transfers", args, 0))
        elif action == "reset":
            _, running, connector = event
            args = {}
            if running:
                args["reset_running_requests"] = True
            if connector:
                args["reset_connector"] = True
            steps.append(Step("reset_prefix_cache", args, 0))
        else:  # pragma: no cover - the strategy draws only the events above
            raise ValueError(f"unknown event {event!r}")
    return steps


def drain_tail(steps: list[Step]) -> list[Step]:
    """`schedule`, release every transfer, then DRAIN_STEPS more steps."""
    steps = list(steps)
    if steps and steps[-1].action == "schedule":
        last = steps.pop()
        count = last.args.get("count", 1) + 1
    else:
        count = 1
    steps.append(Step("schedule", {"count": count} if count > 1 else {}, 0))
    steps.append(Step("complete_transfers", {}, 0))
    steps.append(Step("schedule", {"count": DRAIN_STEPS}, 0))
    return steps


def to_recipe(example: Example, name: str = "explore", summary: str = "generated by kvdoctor explore") -> Recipe:
    return Recipe(name=name, summary=summary, signature=PLACEHOLDER_SIGNATURE,
                  steps=tuple(drain_tail(event_steps(example))), setup=example.geometry.setup_dict())
