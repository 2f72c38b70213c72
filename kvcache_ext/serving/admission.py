"""Admission by the pages requests hold: a KV memory budget in bytes, and what each request
holds at most over its life, reserved when it is admitted and given back when it ends.

Why a reservation for the whole life, not pages on demand as transformers' paged cache does:
that cache, once full, moves a request's pages to the CPU (offloading) and back; a request in
our store is compressed as it would be alone, which a restart over its prompt and generated
tokens would not reproduce. Reserving the peak means an admitted request never waits for
memory, and eviction turns directly into more requests admitted: a request reserves what its
policy keeps (plus what decoding adds), not its prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.policies.policy import ModelShape, Policy

POSITION_BYTES = 4        # the int32 absolute position kept with every token
CHANNEL_BYTES = 4         # one float32 score channel
TABLE_ENTRY_BYTES = 4     # one int32 page-table entry
PAGE_BASE_BYTES = 8       # the int64 address the store keeps per page
TOO_LARGE = "exceeds the KV budget"    # in the error of a request that could never be admitted
NEEDS_SHARED_PREFIX = "does not continue a shared prefix"   # in the error of a KVzip request that cannot run


@dataclass(frozen=True)
class Footprint:
    """What one request's cache holds, from the model's shape and the store's layout."""

    shape: ModelShape
    dtype_bytes: int     # bytes of one K or V element
    page_size: int       # tokens per page of the store
    channels: int        # float32 score channels per token (the policy's scorer)

    @property
    def token_bytes(self) -> int:
        """One token of one (layer, KV head): K, V, its position and its score channels."""
        return 2 * self.shape.head_dim * self.dtype_bytes + POSITION_BYTES + self.channels * CHANNEL_BYTES

    def tokens_per_head(self, policy: Policy, prompt: int, new_tokens: int) -> int:
        """The most tokens a KV head holds, on average over heads and layers, at any step of a
        request of ``prompt`` tokens that generates up to ``new_tokens``."""
        budget = int(policy.budget_for(torch.tensor([prompt]))[0])
        schedule = policy.schedule
        kept = min(prompt, budget)
        during_prefill = kept if schedule.prefill_block is None else min(prompt, budget + schedule.prefill_block)
        if schedule.decode_every is None:    # decoding appends every token
            decoding = kept + new_tokens
        else:                                # grows by decode_every tokens at most, then evicts to its target
            target = schedule.decode_target if schedule.decode_target is not None else budget
            decoding = max(kept, target) + min(new_tokens, schedule.decode_every)
        return min(prompt + new_tokens, max(during_prefill, decoding))

    def cache_bytes(self, policy: Policy, prompt: int, new_tokens: int) -> int:
        """Bytes of the request's ragged cache at its peak: the kept tokens rounded up to whole
        pages (a head's pages hold its own tokens only, so each head may round up), plus the
        page tables."""
        L, H = self.shape.num_layers, self.shape.kv_heads
        tokens = L * H * self.tokens_per_head(policy, prompt, new_tokens)
        pages = -(-tokens // self.page_size) + L * H - 1      # sum of ceilings <= ceiling of sum + count - 1
        widest = -(-(prompt + new_tokens) // self.page_size)  # the most pages one head can hold
        tables = L * H * (widest + 1) * TABLE_ENTRY_BYTES      # page table and length of every segment
        return pages * (self.page_size * self.token_bytes + PAGE_BASE_BYTES) + tables

    def fork_bytes(self, prefix_pages: int, own_tokens: int, longest: int) -> int:
        """Bytes of a request's fork of a shared prefix (``RaggedCache.fork``) at its peak: the
        ``own_tokens`` it appends per head (the rest of its prompt, then what it generates; the
        policy compresses only the prefix) in pages of its own, one more page per head for the
        copy of a partly filled last page, the addresses of the ``prefix_pages`` pages it reads,
        and page tables for its ``longest`` tokens."""
        L, H, size = self.shape.num_layers, self.shape.kv_heads, self.page_size
        own_pages = L * H * (-(-own_tokens // size) + 1)
        tables = L * H * (-(-longest // size) + 1) * TABLE_ENTRY_BYTES
        return own_pages * (size * self.token_bytes + PAGE_BASE_BYTES) + prefix_pages * PAGE_BASE_BYTES + tables

    def chunk_bytes(self, prompt: int) -> int:
        """Bytes of a prompt held dense until its last chunk (a one-shot policy whose prompt is
        longer than a step): every layer's queries, keys and values."""
        s = self.shape
        return s.num_layers * prompt * (s.heads + 2 * s.kv_heads) * s.head_dim * self.dtype_bytes

    def request_bytes(self, policy: Policy, prompt: int, new_tokens: int, step_tokens: int) -> int:
        """What a request reserves: its cache at its peak, and its prompt held dense when the
        engine must split it over steps of ``step_tokens`` tokens and the policy compresses it
        once."""
        held = self.cache_bytes(policy, prompt, new_tokens)
        if prompt > step_tokens and policy.schedule.prefill_block is None:
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
