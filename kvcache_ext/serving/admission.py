"""Admission by the pages requests hold: a KV memory budget in bytes, and what each request
holds at most over its life, reserved when it is admitted and given back when it ends.

Why a reservation for the whole life, not pages on demand as transformers' paged cache does:
that cache, once full, moves a request's pages to the CPU (offloading) and back; a request in
our store is compressed as it would be alone, which a restart over its prompt and generated
tokens would not reproduce. Reserving the peak means an admitted request never waits for
memory, and eviction turns directly into more requests admitted: a request reserves what its
policy keeps (plus what decoding adds), not its prompt.

The bytes are the store's own (``RaggedKVStore.nbytes``): a page record as the extension lays
it out (``kvcache_ext._C.page_layout``: parts aligned, so a small page costs more than its
tokens), the address of every page, the page table (width: the most pages a head has held) and
a length per head. What the engine allocates is modelled, not changed: after a prompt a layer
holds each head's kept tokens in whole pages plus room for what comes next (every token to come
for a cache that grows while decoding, the tokens between two evictions for one that evicts
while decoding: ``release_prefill_slack``), and decoding adds a page to a head whose pages are
full. A layer's pages, once allocated, stay allocated until it is repacked, so its peak is the
most pages it ever needed at once. When every head of a layer keeps the same count (an
allocation with ``equal_heads``) this is exact; when heads keep different counts (Ada-KV) only
their sum is known, and the bytes are an upper bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvcache_ext import _C
from kvcache_ext.policies.allocation import layer_total
from kvcache_ext.policies.policy import ModelShape, Policy

TOO_LARGE = "exceeds the KV budget"    # in the error of a request that could never be admitted
NEEDS_SHARED_PREFIX = "does not continue a shared prefix"   # in the error of a KVzip request that cannot run


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _longest(kept: int, target: int, every: int, steps: int, step: int = 1) -> int:
    """The most tokens held right after an append, over ``steps`` decode steps that each add
    ``step`` tokens to ``kept``, evicting down to ``target`` after the append of every
    ``every``-th step (only what is over the target goes)."""
    if steps <= 0:
        return kept
    most = kept + min(every, steps) * step             # before the first eviction
    last = (steps - 1) // every                       # evictions before the last step
    if last >= 1:                                     # after the i-th eviction: min(kept + i * every, target)
        most = max(most, min(kept + last * every * step, target) + (steps - last * every) * step)
    if last >= 2:
        most = max(most, min(kept + (last - 1) * every * step, target) + every * step)
    return most


def _layer_total(budget, heads: int) -> int:
    """Tokens a layer's ``heads`` hold with ``budget`` per head (an int, or a float of
    ``AcrossLayers``), as the engine counts them (``layer_total``)."""
    dtype = torch.float64 if isinstance(budget, float) else torch.int64
    return int(layer_total(torch.tensor([budget], dtype=dtype), heads)[0])


@dataclass(frozen=True)
class Footprint:
    """What one request's cache holds, from the model's shape and the store's layout."""

    shape: ModelShape
    dtype_bytes: int     # bytes of one K or V element as the pages hold it (1: int8 pages)
    page_size: int       # tokens per page of the store
    channels: int        # float32 score channels per token (the policy's scorer)
    quantized: bool = False   # int8 pages: a float16 scale per token's K and V besides
    # cache_bytes by (policy, prompt, new tokens, first chunk): the scheduler asks again for
    # every waiting request at every step
    _known: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @cached_property
    def layout(self) -> dict:
        """The store's byte layout (``kvcache_ext._C.page_layout``)."""
        return _C.page_layout(self.page_size, self.shape.head_dim, self.dtype_bytes, self.channels, self.quantized)

    @property
    def page_bytes(self) -> int:
        """One page of one layer's store: its record and its address."""
        return self.layout["page_bytes"] + self.layout["page_address_bytes"]

    def layer_bytes(self, pages: int, width: int) -> int:
        """Bytes of one layer's store (batch 1) holding ``pages`` pages, with a page table
        ``width`` pages wide: ``RaggedKVStore.nbytes``."""
        heads = self.shape.kv_heads
        return pages * self.page_bytes + heads * (width * self.layout["table_entry_bytes"]
                                                  + self.layout["length_bytes"])

    def layer_budgets(self, policy: Policy, prompt: int) -> list[tuple]:
        """Per layer, the per-head budget of the prompt and of decode-time eviction, as the
        engine fixes them from the prompt's length (``LayerState.ensure_budget``)."""
        p, L = policy, self.shape.num_layers
        length = torch.tensor([prompt])
        base = p.budget_for(length)
        target = torch.full_like(length, p.schedule.decode_target) if p.schedule.decode_target else base
        decode_length = torch.maximum(length, 2 * target)
        reserved = p.protection.size
        budgets = []
        for layer in range(L):
            budget = p.allocation.layer_budget(base, layer, L, length, reserved)
            decode = p.allocation.layer_budget(target, layer, L, decode_length, reserved)
            budgets.append((budget[0].item(), decode[0].item()))
        return budgets

    def cache_bytes(self, policy: Policy, prompt: int, new_tokens: int, first_chunk: int | None = None) -> int:
        """Bytes of the request's ragged cache at its peak, for a prompt of ``prompt`` tokens
        that generates up to ``new_tokens`` (the last of them never fed back), made told its
        longest sequence as the serving cache makes it. ``first_chunk``: for a block-wise
        prefill whose prompt comes in chunks, the most tokens its first chunk may hold (the
        layer makes room for what comes next after that chunk): a bound over every split."""
        key = (repr(policy), prompt, new_tokens, first_chunk)
        if key not in self._known:
            if len(self._known) >= 4096:
                self._known.clear()
            self._known[key] = sum(self._layer_peak(policy, prompt, new_tokens, budget, decode, first_chunk)
                                   for budget, decode in self.layer_budgets(policy, prompt))
        return self._known[key]

    def _layer_peak(self, policy: Policy, prompt: int, new_tokens: int, budget, decode,
                    first_chunk: int | None) -> int:
        """One layer's bytes at its peak, with per-head budgets ``budget`` (the prompt's) and
        ``decode`` (decode-time eviction's)."""
        H, L = self.shape.kv_heads, self.shape.num_layers
        allocation, schedule = policy.allocation, policy.schedule
        if allocation.whole_model:
            # The layers' budgets come from every layer's scores at once: one layer may take
            # the whole model's, and its heads may keep different counts.
            kept = H * min(prompt, math.ceil(L * budget))
            return self._unequal_heads(schedule, prompt, new_tokens, kept, H * math.ceil(L * decode), first_chunk)
        if allocation.equal_heads:
            return self._equal_heads(schedule, prompt, new_tokens, int(budget), int(decode), first_chunk)
        kept = min(_layer_total(budget, H), H * prompt)
        return self._unequal_heads(schedule, prompt, new_tokens, kept, _layer_total(decode, H), first_chunk)

    def _equal_heads(self, schedule, prompt: int, new_tokens: int, budget: int, decode: int,
                     first_chunk: int | None) -> int:
        """One layer whose heads each keep ``budget`` of the prompt and evict to ``decode``
        while decoding: every head holds the same pages, so the layer's peak is exact."""
        size, every, H = self.page_size, schedule.decode_every, self.shape.kv_heads
        kept = min(prompt, budget)
        steps = max(0, new_tokens - 1)
        if first_chunk is None:     # the prompt whole: kept tokens, and room for what comes next
            pages = _pages(kept + (every if every is not None else new_tokens), size)
        elif every is None:         # room for all the rest after a first chunk that may be one token
            pages = _pages(prompt + new_tokens, size)
        else:                       # then the blocks of the later chunks, evicting after each
            first = min(prompt, budget, first_chunk)
            block = min(schedule.prefill_block, first_chunk)
            pages = max(_pages(first + every, size), _pages(min(budget + block, prompt) + size // 2, size))
        if every is not None:       # a full head takes one more page when it grows past them
            pages = max(pages, _pages(_longest(kept, decode, every, steps), size))
        return self.layer_bytes(H * pages, pages)

    def _unequal_heads(self, schedule, prompt: int, new_tokens: int, kept: int, decode: int,
                       first_chunk: int | None) -> int:
        """An upper bound of one layer whose heads keep different counts, ``kept`` of the
        prompt and ``decode`` while decoding in all (Ada-KV): a head holding x tokens with
        room for r more takes ceil((x + r) / P) pages, at most (x + r + P - 1) / P, so the
        layer's pages are bounded by the sum of its tokens; one head may hold most of them."""
        size, every, H = self.page_size, schedule.decode_every, self.shape.kv_heads
        steps = max(0, new_tokens - 1)

        def bound(tokens: int, room: int, most: int) -> tuple[int, int]:
            """(pages, widest) of the heads holding ``tokens`` in all, ``most`` at most each,
            each with room for ``room`` more."""
            widest = _pages(min(tokens, most) + room, size)
            return min((tokens + H * (room + size - 1)) // size, H * widest), widest

        if first_chunk is not None and every is None:     # room for all the rest after a first chunk
            widest = _pages(prompt + new_tokens, size)
            return self.layer_bytes(H * widest, widest)
        pages, widest = bound(kept, every if every is not None else new_tokens, prompt)
        if first_chunk is not None:     # the blocks of the later chunks, evicting after each
            block = min(schedule.prefill_block, first_chunk)
            more = bound(min(kept + H * block, H * prompt), size // 2, prompt)
            pages, widest = max(pages, more[0]), max(widest, more[1])
        if every is not None and steps > every:
            # A head outgrows the room it was given only after an eviction; a page it adds then
            # comes with room for half a page more (the store's lookahead).
            more = bound(_longest(kept, decode, every, steps, H), size // 2, min(kept, prompt) + steps)
            pages, widest = max(pages, more[0]), max(widest, more[1])
        return self.layer_bytes(pages, min(widest, pages))

    def fork_bytes(self, prefix_pages: int, own_tokens: int, longest: int) -> int:
        """Bytes of a request's fork of a shared prefix (``RaggedCache.fork``) at its peak: the
        ``own_tokens`` it appends per head (the rest of its prompt, then what it generates; the
        policy compresses only the prefix) in pages of its own, one more page per head for the
        copy of a partly filled last page, the addresses of the ``prefix_pages`` pages it reads,
        and page tables for its ``longest`` tokens."""
        L, H, size = self.shape.num_layers, self.shape.kv_heads, self.page_size
        own_pages = L * H * (_pages(own_tokens, size) + 1)
        return (own_pages * self.page_bytes + prefix_pages * self.layout["page_address_bytes"]
                + L * self.layer_bytes(0, _pages(longest, size)))

    def chunk_bytes(self, prompt: int) -> int:
        """Bytes of a prompt held dense until its last chunk (a one-shot policy whose prompt is
        longer than a step): every layer's queries, keys and values."""
        s = self.shape
        return s.num_layers * prompt * (s.heads + 2 * s.kv_heads) * s.head_dim * self.dtype_bytes

    def request_bytes(self, policy: Policy, prompt: int, new_tokens: int, step_tokens: int) -> int:
        """What a request reserves: its cache at its peak, and its prompt held dense when the
        engine must split it over steps of ``step_tokens`` tokens and the policy compresses it
        once. A block-wise prefill split over steps makes room for what comes next after its
        first chunk, whose size the engine chooses: the bound over every split."""
        split = prompt > step_tokens
        if split and policy.schedule.prefill_block is not None:
            return self.cache_bytes(policy, prompt, new_tokens, first_chunk=step_tokens)
        held = self.cache_bytes(policy, prompt, new_tokens)
        if split:
            held += self.chunk_bytes(prompt)
        return held


class Admission:
    """The reservations against a budget of ``budget_bytes``: request id -> bytes."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"the KV memory budget must be positive, got {budget_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        self.reserved: dict[str, int] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.reserved_bytes

    def try_reserve(self, request_id: str, nbytes: int) -> bool:
        """Reserves ``nbytes`` for the request if they fit beside the others (True), or nothing."""
        if request_id in self.reserved:
            return True
        if nbytes > self.free_bytes:
            return False
        self.reserved[request_id] = int(nbytes)
        return True

    def release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)

    def clear(self) -> None:
        self.reserved.clear()
