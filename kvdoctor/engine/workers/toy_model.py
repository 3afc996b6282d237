"""The toy model: KV bytes that say which tokens they belong to, and checks that they do.

kvdoctor has no model weights. Instead every KV slot it "computes" holds a pattern that
is a function of (layer, the token prefix up to that position): word 0 is a 64-bit hash
of the prefix, word 1 names the layer, the rest repeat word 0. Any slot can then be
judged: it holds what its tokens say, it was never written (the poison the KV tensors
start with), or it holds another position's bytes ("stale: bytes of request X position
P"). This is a stand-in for the model's attention, and says so; the bytes move only
through vLLM's worker connector and the copy engine.

The token a request samples is read from those bytes too (`answer_key.answer_of` over word 0 of every
slot its last position attends to, in its full-attention layers): wrong KV gives a different answer.

A token's slot is the toy model's layout of a page: page bytes [off*slot, (off+1)*slot)
for the token at offset `off` of its block. vLLM moves whole pages, so any layout that
partitions a page works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.answer_key import POISON_WORD, answer_of, next_key, words_bytes
from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.errors import UsageError

MAX_FINDINGS_PER_CHECK = 3  # first few slots per (request, layer): enough to name the bug
_WRONG_SLOT = 0x5BD1E9955BD1E995  # mixed into a slot's word 0 where the slot is not its tokens' KV


@dataclass
class ContentFinding:
    """One KV slot whose bytes are not what its tokens say."""

    invariant: str
    request: str
    layer: str
    position: int
    block: int
    found: str
    job: int | None = None

    @property
    def message(self) -> str:
        stored_by_job = self.job is not None and self.invariant != "load-returns-stored-bytes"
        job = f"store job #{self.job}: " if stored_by_job else (
            f"load job #{self.job}: " if self.job is not None else "")
        return (f"{job}{self.request} layer {self.layer} position {self.position} (block {self.block}): "
                f"{self.found}")


@dataclass
class RequestKv:
    tokens: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_computed: int = 0
    keys: list[int] = field(default_factory=list)


@dataclass
class _Layer:
    name: str
    tag: int
    group: int
    block_size: int
    slots: Any  # int64 view (num_blocks, block_size, words)
    window: int | None = None  # sliding window: a forward reads only its last `window` positions


@dataclass
class _StoreExpectation:
    request: str
    # gpu block -> [(position, key or None when past the request's tokens)]
    slots: dict[int, list[tuple[int, int | None]]]
    # gpu block -> its KV cache group: only that group's layers hold this block's KV (block ids
    # come from one pool, and another group's layers may have written the same id's pages)
    groups: dict[int, int]


class ToyModel:
    def __init__(self, api: Any, layers: list[_Layer], model_runner: str = "v2") -> None:
        import torch

        self.api = api  # vLLM's fields that some releases lack are read through the adapter
        # V2 forgets a preempted request (`preempted_req_ids`) and gets it back among the new ones; V1's
        # GPUModelRunner ignores that field and keeps the request's state until it resumes as a cached request
        # (`resumed_req_ids`): forgetting it there would leave the resumed request without KV state or answer.
        self.forgets_preempted = model_runner == "v2"
        self.torch = torch
        self.layers = layers
        self.reqs: dict[str, RequestKv] = {}
        self.retired: dict[str, RequestKv] = {}  # finished: their final store may still come
        self.origin: dict[int, tuple[str, int]] = {}  # prefix key -> first (request, position) written
        self.findings: list[ContentFinding] = []
        self.expectations: dict[int, _StoreExpectation] = {}
        # store job -> layer name -> that layer's KV as the job's copy read it, for a copy made before
        # the job's expectation was recorded (a flush in handle_preemptions / pre_forward)
        self._copied: dict[int, dict[str, Any]] = {}
        self.checked_slots = 0
        self._reported: set[tuple[int, str, int]] = set()
        self.logprobs: dict[str, float] = {}  # request -> the logprob of the token it sampled last

    def release(self) -> None:
        """Drop the KV tensors and copies this model reads (a finished run's pages go with it)."""
        self.layers = []
        self._copied.clear()

    @classmethod
    def over(cls, api: Any, kv_cache_config: Any, kv_caches: dict[str, Any], model_runner: str = "v2") -> ToyModel:
        layers = []
        n = kv_cache_config.num_blocks
        check_attention_only(api, kv_cache_config)
        for idx, (name, (group, spec)) in enumerate(sorted(api.kv_layer_specs(kv_cache_config).items())):
            page = int(spec.page_size_bytes)
            bs = int(spec.block_size)
            if page % (bs * 16):
                raise UsageError(f"--worker vllm: a {page}-byte page of {bs} tokens leaves under 16 bytes per "
                                 f"token slot, too few for the toy model's content pattern")
            pages = api.kv_pages(kv_caches[name], n, page)
            slots = pages.view(cls_int64()).view(n, bs, page // bs // 8)
            layers.append(_Layer(name, idx + 1, group, bs, slots, api.attention_window(spec)))
        return cls(api, layers, model_runner)

    # -- request state, from the scheduler's output (as GPUModelRunner._update_states) ----------
    def update_states(self, output: Any) -> None:
        api = self.api
        for rid in output.finished_req_ids or ():
            if rid in self.reqs:
                self.retired[rid] = self.reqs.pop(rid)
        for rid in api.preempted_req_ids(output) if self.forgets_preempted else ():
            self.reqs.pop(rid, None)
        for new in output.scheduled_new_reqs:
            old = self.reqs.get(new.req_id) or self.retired.get(new.req_id)
            tokens = api.scheduled_new_tokens(new)
            if old is not None and len(old.tokens) > len(tokens) and old.tokens[:len(tokens)] == tokens:
                tokens = old.tokens  # a resumed request keeps the tokens it sampled
            self.reqs[new.req_id] = RequestKv(list(tokens), [list(g) for g in new.block_ids],
                                              int(new.num_computed_tokens))
        cached = output.scheduled_cached_reqs
        resumed = api.resumed_req_ids(cached)
        all_tokens = api.all_token_ids(cached)
        for i, rid in enumerate(cached.req_ids):
            state = self.reqs.get(rid) or self.retired.get(rid)
            if state is None:
                continue
            self.reqs[rid] = state
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                state.block_ids = [list(g) for g in new_ids or ()]
                if rid in all_tokens:
                    state.tokens = list(all_tokens[rid])
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    state.block_ids[g].extend(ids)
            state.num_computed = int(cached.num_computed_tokens[i])
        for block in api.block_ids_to_zero(output):
            for layer in self.layers:
                layer.slots[block].zero_()
        for src, dst in api.block_copies(output):
            for layer in self.layers:
                layer.slots[dst].copy_(layer.slots[src])

    def _keys(self, state: RequestKv, upto: int) -> list[int]:
        keys = state.keys
        while len(keys) < min(upto, len(state.tokens)):
            keys.append(next_key(keys[-1] if keys else 0, state.tokens[len(keys)]))
        return keys

    # -- one forward ----------------------------------------------------------
    def forward(self, output: Any, sampled: dict[str, list[int]]) -> None:
        """Check every slot the step's attention reads, write the KV of the scheduled tokens,
        and take the sampled tokens (the harness decides them)."""
        for rid, count in output.num_scheduled_tokens.items():
            state = self.reqs.get(rid)
            if state is None:
                continue
            start = state.num_computed
            end = min(start + int(count), len(state.tokens))
            keys = self._keys(state, end)
            for layer in self.layers:
                table = state.block_ids[layer.group]
                first = max(0, start - layer.window + 1) if layer.window else 0
                if start > first:
                    self._check(layer, rid, table, range(first, start), keys[first:start], "reads-see-their-tokens",
                                None)
                self._write(layer, rid, table, range(start, end), keys[start:end])
            state.num_computed = start + int(count)
            tokens = sampled.get(rid)
            if tokens and tokens[-1] != EOS_TOKEN and end == start + int(count):
                tokens[-1], self.logprobs[rid] = self.answer(state, end)
            state.tokens.extend(tokens or ())

    def answer(self, state: RequestKv, end: int) -> tuple[int, float]:
        """The stand-in's next token for a request whose last computed position is `end - 1`: a digest of
        word 0 of every slot it attends to, read from the KV bytes (`answer_key.answer_of`). A slot that does
        not hold its tokens' KV in some full-attention layer (poison, another prefix, another layer's tag)
        reads as a word that differs from its key; where every layer is sliding-window, the answer is the
        tokens' own (nothing reads the whole context)."""
        torch = self.torch
        full = [layer for layer in self.layers if not layer.window]
        if not full:
            return answer_of(words_bytes(self._keys(state, end)[:end]))
        words = None
        for layer in full:
            blocks, offs, _ = self._locate(layer, state.block_ids[layer.group], range(0, end))
            rows = layer.slots[blocks, offs]
            ok = (rows[:, 1] == layer.tag) & (rows[:, 2:] == rows[:, :1]).all(1) & (blocks != 0)
            layer_words = torch.where(ok, rows[:, 0], rows[:, 0] ^ rows[:, 1] ^ _WRONG_SLOT)
            words = layer_words if words is None else torch.where(layer_words == words, words,
                                                                  words ^ (layer_words << 1) ^ 1)
        assert words is not None
        return answer_of(words.cpu().contiguous().numpy().astype("<i8").tobytes())

    def _locate(self, layer: _Layer, table: list[int], positions: range) -> tuple[Any, Any, list[int]]:
        torch = self.torch
        device = layer.slots.device
        pos = torch.arange(positions.start, positions.stop, dtype=torch.int64, device=device)
        blocks = [table[p // layer.block_size] if p // layer.block_size < len(table) else 0 for p in positions]
        return torch.tensor(blocks, dtype=torch.int64, device=device), pos % layer.block_size, blocks

    def _write(self, layer: _Layer, rid: str, table: list[int], positions: range, keys: list[int]) -> None:
        if not len(positions):
            return
        torch = self.torch
        blocks, offs, _ = self._locate(layer, table, positions)
        key_t = torch.tensor(keys, dtype=torch.int64, device=layer.slots.device)
        rows = key_t[:, None].repeat(1, layer.slots.shape[-1])
        rows[:, 1] = layer.tag
        layer.slots[blocks, offs] = rows
        for p, key in zip(positions, keys, strict=True):
            self.origin.setdefault(key, (rid, p))

    def _check(self, layer: _Layer, rid: str, table: list[int], positions: range, keys: Sequence[int | None],
               invariant: str, job: int | None, source: Any = None) -> None:
        if not len(positions):
            return
        torch = self.torch
        blocks, offs, block_list = self._locate(layer, table, positions)
        got = layer.slots[blocks, offs]
        if source is not None and all(b in source[0] for b in block_list):  # the rows a copy read earlier
            remap, rows = source
            got = rows[torch.tensor([remap[b] for b in block_list], dtype=torch.int64, device=rows.device), offs]
        self.checked_slots += len(positions)
        device = layer.slots.device
        key_t = torch.tensor([k if k is not None else 0 for k in keys], dtype=torch.int64, device=device)
        ok = (got[:, 0] == key_t) & (got[:, 1] == layer.tag) & (got[:, 2:] == key_t[:, None]).all(1)
        past = torch.tensor([k is None for k in keys], dtype=torch.bool, device=device)
        ok &= ~past
        ok &= blocks != 0
        if bool(ok.all()):
            return
        bad = (~ok).nonzero().flatten().tolist()[:MAX_FINDINGS_PER_CHECK]
        for i in bad:
            p = positions[i]
            mark = (job if job is not None else -1, layer.name, p)
            if job is not None and mark in self._reported:
                continue
            self._reported.add(mark)
            block = block_list[i]
            if block == 0:
                found = "the null block"
            elif keys[i] is None:
                found = "a slot past the request's tokens"
            else:
                found = self.classify(got[i].tolist(), layer.tag)
            self.findings.append(ContentFinding(invariant, rid, layer.name, p, block, found, job))

    def classify(self, row: list[int], tag: int) -> str:
        if all(w == POISON_WORD for w in row):
            return "never written"
        if not any(row):
            return "zeros"
        origin = self.origin.get(row[0])
        if origin is not None and row[1] == tag:
            return f"stale: bytes of request {origin[0]} position {origin[1]}"
        return "unknown bytes"

    # -- stores and loads -----------------------------------------------------
    def expect_store(self, job: int, rid: str, gpu_blocks: tuple[int, ...], group_sizes: tuple[int, ...]) -> None:
        """A store job was built: record what each slot it will copy must hold, and check it now
        (the step's forward has run: a slot that is still wrong now was never computed), or, where
        vLLM's worker already copied it this step, check the bytes its copy read."""
        state = self.reqs.get(rid) or self.retired.get(rid)
        if state is None:
            self._copied.pop(job, None)
            return
        slots: dict[int, list[tuple[int, int | None]]] = {}
        groups: dict[int, int] = {}
        start = 0
        for group, size in enumerate(group_sizes):
            table = state.block_ids[group] if group < len(state.block_ids) else []
            bs = next((layer.block_size for layer in self.layers if layer.group == group), None)
            for block in gpu_blocks[start:start + size]:
                if bs is None or block not in table:
                    continue
                first = _live_index(table, block) * bs
                keys = self._keys(state, first + bs)
                slots[block] = [(p, keys[p] if p < len(state.tokens) and p < len(keys) else None)
                                for p in range(first, first + bs)]
                groups[block] = group
            start += size
        self.expectations[job] = _StoreExpectation(rid, slots, groups)
        self.check_store(job)

    def store_copied(self, job: int, blocks: Any = None) -> None:
        """vLLM's worker copies store `job` now. vLLM flushes a finished or preempted request's store
        of this very step before the forward (V1 `handle_preemptions`, Model Runner V2 `pre_forward`),
        before kvdoctor records what the store must hold (after the step): its bytes are kept as the
        copy read them, and judged when the expectation is recorded. Judging the blocks after the
        forward instead would see whatever a new owner of the freed blocks wrote there since."""
        if job in self.expectations:
            self.check_store(job)
            return
        # only the job's blocks (a whole layer's clone per early copy grew with the pool)
        ids = sorted({int(b) for b in blocks}) if blocks is not None else list(range(len(self.layers[0].slots)))
        index = self.torch.tensor(ids, dtype=self.torch.int64)
        remap = {b: i for i, b in enumerate(ids)}
        self._copied[job] = {layer.name: (remap, layer.slots[index.to(layer.slots.device)].clone())
                             for layer in self.layers}

    def check_store(self, job: int) -> None:
        """The store's copy reads its GPU blocks now (or read them, for a copy made before its
        expectation: those bytes): every slot must hold its tokens' KV."""
        expectation = self.expectations.get(job)
        if expectation is None:
            return
        copied = self._copied.pop(job, None)
        for block, slots in expectation.slots.items():
            if sum(f.job == job for f in self.findings) >= MAX_FINDINGS_PER_CHECK:
                return
            for layer in self.layers:
                if layer.group != expectation.groups[block]:
                    continue
                positions = range(slots[0][0], slots[-1][0] + 1)
                self._check(layer, expectation.request, [block] * (positions.stop // layer.block_size + 1),
                            positions, [k for _, k in slots], "store-copies-computed-kv", job,
                            None if copied is None else copied[layer.name])

    def positions_of(self, rid: str, block: int) -> int:
        state = self.reqs.get(rid) or self.retired.get(rid)
        for layer in self.layers:
            table = state.block_ids[layer.group] if state else []
            if block in table:
                return _live_index(table, block) * layer.block_size
        return -1


def _live_index(table: list[int], block: int) -> int:
    """Where a block sits in a request's table now: its last occurrence. A sliding-window group
    frees the blocks that leave the window while the worker's table keeps their ids, so a freed
    block the request gets back for a later position appears twice; only the last is live."""
    return len(table) - 1 - table[::-1].index(block)


def cls_int64() -> Any:
    import torch

    return torch.int64


def check_attention_only(api: Any, kv_cache_config: Any) -> None:
    """Refuse a layout with a layer the toy model cannot write (Mamba state), before vLLM's worker
    connector registers the KV caches (0.26.0's register_kv_caches asserts on such a layer first)."""
    for name, (_group, spec) in sorted(api.kv_layer_specs(kv_cache_config).items()):
        if not api.is_attention_spec(spec):
            raise UsageError(f"--worker vllm: layer {name} is {type(spec).__name__}; the toy model writes "
                             f"attention KV only")
