"""RaggedPagedCache: transformers' paged cache of the continuous batching engine, whose requests
keep their tokens in kvcache_ext's ragged caches instead.

The engine (transformers ``generation/continuous_batching``) packs the tokens of every request
of a step into one varlen batch and asks its ``PagedAttentionCache`` where each request's
tokens go (``extend_read_and_write_indices``, in batch order), then the model's attention calls
``cache.update`` with the packed K and V. This subclass records each step's requests in that
order (``step``), keeps one ``RaggedCache`` of batch 1 per request (made at its first tokens,
dropped when the engine frees the request), and hands the packed batch to the patched attention
function, which splits it by request (``kvcache_ext.serving.attention``).

Admission is by our pages (``kvcache_ext.serving.admission``): the engine's scheduler asks
``can_store_request_tokens`` before it schedules a request's tokens; a request is admitted when
what it holds at its peak fits in the KV budget beside the other requests' reservations, and
its reservation is given back when the engine frees it. The engine's own pages are not used
(the manager builds them as small as the engine allows).

Shared prefixes (``handle.share_prefix``, ``kvcache_ext.hf.shared_prefix``) come through the
engine's own prefix-sharing hook: its scheduler asks ``search_prefix_match`` for a waiting
request's prompt, and skips the tokens matched. Here a request whose prompt starts with a
shared prefix reserves only what it appends (the rest of its prompt and its new tokens) and
runs on a fork of the prefix's cache; the prefix is reserved once in the budget, from the first
request that reads it while the engine runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.continuous_batching.cache import PagedAttentionCache

from kvcache_ext.hf import cache as hf_cache
from kvcache_ext.serving.admission import NEEDS_SHARED_PREFIX, TOO_LARGE, Admission, Footprint
from kvcache_ext.serving.attention import attend_packed


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a step's packed batch: tokens [first, first + count) of the batch,
    at positions past_length .. past_length + count - 1 of the request."""

    request_id: str
    past_length: int
    first: int
    count: int
    prompt_done: bool    # no prompt token left after these (the engine splits long prompts)


@dataclass(frozen=True)
class PackedLayer:
    """What ``update`` hands the patched attention function for one layer of one step
    (``hf.cache.set_pending``): ``attend`` runs each request's share of the packed batch."""

    cache: "RaggedPagedCache"
    layer_idx: int

    def attend(self, dense, module, query, key, value, scaling, window=None):
        return attend_packed(self, dense, module, query, key, value, scaling, window)


class RaggedPagedCache(PagedAttentionCache):
    """Made by ``adopt`` from the engine's own cache (the manager builds that one as usual)."""

    handle = None                   # the PatchHandle whose policy serves the requests
    requests: dict                  # request id -> RaggedCache (batch 1)
    chunks: dict                    # (request id, layer) -> PromptChunks of a prompt split over steps
    step: list                      # [StepRequest] of the step being run, in batch order
    step_closed = False             # the step's forward has begun: the next request starts a new step
    admission: Admission            # the KV budget and each admitted request's reservation
    footprint: Footprint            # what a request holds, from the model's shape
    prefixes = None                 # the handle's SharedPrefixes
    arrived_on: dict                # request id -> the SharedPrefix its prompt matched when it arrived
    on_prefix: dict                 # request id -> the SharedPrefix it reads (reserved, forked)
    waiting_for_room: set           # requests matching a shared prefix, waiting for the room they need
    served_over: dict               # prefix_key -> requests served over that prefix so far
    reserved_prefixes: dict         # prefix_key -> the SharedPrefix reserved under it

    @classmethod
    def adopt(cls, cache: PagedAttentionCache, handle, scheduler, budget_bytes: int) -> "RaggedPagedCache":
        """Turns the engine's ``PagedAttentionCache`` into this class in place: the engine's
        scheduler, batch processor and inputs all hold that object, and building it again here
        would copy the manager's construction code."""
        cache.__class__ = cls
        cache.start(handle, scheduler, budget_bytes)
        return cache

    def start(self, handle, scheduler, budget_bytes: int) -> None:
        """This class's own state, from ``adopt``: no request yet. ``scheduler``: the engine's,
        whose request states say whether a prompt has tokens left. ``budget_bytes``: what the
        requests' ragged caches may hold together."""
        self.handle, self.scheduler = handle, scheduler
        self.requests, self.chunks, self.step, self.step_closed = {}, {}, [], False
        self.admission = Admission(budget_bytes)
        quantized = handle.kv_dtype is not None
        self.footprint = Footprint(handle.shape, 1 if quantized else self.dtype.itemsize, handle.page_size,
                                   handle.policy.scorer.capabilities.channels, quantized)
        # The engine reads no past token through its own indices (each request attends over its
        # ragged cache): its scheduler then charges no read budget, and builds no read index.
        self.read_cache_limit = 0
        self.prefixes, self.arrived_on, self.on_prefix, self.waiting_for_room = handle.prefixes, {}, {}, set()
        self.served_over, self.reserved_prefixes = {}, {}
        # The scheduler asks search_prefix_match of waiting requests only when this is set.
        self.use_prefix_sharing = True

    # --- admission ----------------------------------------------------------------------------
    def request_bytes(self, state, prefix=None) -> int:
        """What the request reserves (``Footprint.request_bytes``), or over the shared ``prefix``
        its prompt starts with, what its fork appends (``Footprint.fork_bytes``)."""
        new_tokens = state.max_new_tokens if state.max_new_tokens is not None else 2**31 - 1
        prompt = len(state.initial_tokens)
        if prefix is not None:
            return self.footprint.fork_bytes(prefix.pages, prompt - len(prefix) + new_tokens, prompt + new_tokens)
        return self.footprint.request_bytes(self.handle.policy, prompt, new_tokens, self.max_batch_tokens)

    def bytes_to_admit(self, state, prefix=None) -> int:
        """What admitting the request takes from the budget: its reservation, and over a shared
        prefix that no request holds reserved yet, the prefix too."""
        need = self.request_bytes(state, prefix)
        if prefix is not None and self.prefix_key(prefix) not in self.admission.reserved:
            need += prefix.nbytes
        return need

    @staticmethod
    def prefix_key(prefix) -> str:
        """A shared prefix's reservation, beside the requests'."""
        return f"shared prefix {id(prefix)}"

    def check_admissible(self, state) -> None:
        """Raises ValueError for a request that could never be admitted, when it arrives; else
        notes the shared prefix its prompt starts with, if any (what it is served over, even
        if the prefix is unshared while it waits)."""
        if state.num_children > 0:
            raise ValueError(f"request {state.request_id}: num_return_sequences > 1 copies a request's cache "
                             "at its fork, which kvcache_ext's serving does not do; send the request once "
                             "per sequence")
        self.release_unread()      # a prefix unshared since: its room is free again
        prefix = self.prefixes.match(state.initial_tokens)
        if prefix is None and self.handle.policy.scorer.capabilities.reconstructs:
            raise ValueError(f"request {state.request_id} {NEEDS_SHARED_PREFIX}: "
                             f"{type(self.handle.policy.scorer).__name__} scores a prompt by re-running the model "
                             "over it (reconstruction passes), which the continuous batching engine does not run: "
                             "share the context first (handle.share_prefix(ids), or kvcache-ext serve "
                             "--shared-system), compressed once with its passes, and send prompts that start with "
                             "it and go on past it; or serve this prompt with generate")
        need = self.bytes_to_admit(state, prefix)
        if need > self.admission.budget_bytes:
            limit = ("max_new_tokens is not set and the policy's cache grows while decoding"
                     if state.max_new_tokens is None else f"max_new_tokens {state.max_new_tokens}")
            raise ValueError(f"request {state.request_id} {TOO_LARGE}: its KV cache needs {need} bytes at its "
                             f"peak (prompt {len(state.initial_tokens)} tokens, {limit}, {self.handle.policy}) "
                             f"but the whole KV budget is {self.admission.budget_bytes} bytes; shorten the "
                             "prompt, lower max_new_tokens, or raise the budget (num_blocks)")
        if prefix is not None:
            self.arrived_on[state.request_id] = prefix

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """True when the request holds a reservation, or gets one now. A prompt that fits in a
        step waits for a step with room for all of it: split, a one-shot policy's would be held
        dense until its last chunk, and a block-wise prefill's would count its blocks from each
        chunk's start and make room for the rest of its sequence after the first chunk, so
        neither would hold what it holds alone (``Footprint.request_bytes``)."""
        if state.request_id in self.admission.reserved:
            return True
        if state.request_id in self.waiting_for_room:    # its shared prefix matched: it waits for room
            return False
        prompt = len(state.remaining_prefill_tokens)
        if request_len < prompt <= self.max_batch_tokens:
            return False
        need = self.request_bytes(state)
        if dry_run:
            return need <= self.admission.free_bytes
        return self.admission.try_reserve(state.request_id, need)

    def search_prefix_match(self, request_id: str, prompt_ids: list) -> int:
        """The engine's prefix-sharing hook, asked of each waiting request as it is scheduled:
        the length of the shared prefix its prompt starts with (the engine then runs only the
        rest), once the request's own part, and the prefix itself if no request reads it yet,
        are reserved; 0 when no prefix matches. A request that matches but finds no room waits
        (``can_store_request_tokens`` says no until it does)."""
        self.waiting_for_room.discard(request_id)
        prefix = self.arrived_on.get(request_id)
        state = self.scheduler.waiting_requests.get(request_id)
        if prefix is None or state is None:
            return 0
        if self.bytes_to_admit(state, prefix) > self.admission.free_bytes:
            self.waiting_for_room.add(request_id)
            return 0
        key = self.prefix_key(prefix)
        self.admission.try_reserve(key, prefix.nbytes)     # held already by another reader: nothing changes
        self.reserved_prefixes[key] = prefix
        self.admission.try_reserve(request_id, self.request_bytes(state, prefix))
        self.on_prefix[request_id] = prefix
        self.served_over[key] = self.served_over.get(key, 0) + 1
        return len(prefix)

    def count_new_complete_blocks(self, state, request_len: int) -> dict:
        """No block of the engine's is ever completed: nothing is stored in its pages."""
        return {}

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        free = self.admission.free_bytes
        return free / self.admission.budget_bytes if relative else free

    def count_storable_requests(self, list_blocks_needed: list) -> int:
        """The engine asks this only to bring back requests it moved to the CPU, which it never
        does here (an admitted request never waits for memory)."""
        return 0

    # --- what the engine calls ----------------------------------------------------------------
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        if self.step_closed:
            self.step, self.step_closed = [], False
        first = self.step[-1].first + self.step[-1].count if self.step else 0
        state = self.scheduler.active_requests.get(request_id)
        done = state is None or not state.remaining_prefill_tokens
        self.step.append(StepRequest(request_id, past_length, first, query_length, done))
        if request_id not in self.requests:
            # Told its longest sequence, a cache that grows while decoding takes its pages at once.
            longest = None if state is None or state.max_new_tokens is None else \
                len(state.initial_tokens) + state.max_new_tokens
            prefix = self.on_prefix.get(request_id)
            self.requests[request_id] = (self.handle.new_cache(max_cache_len=longest) if prefix is None
                                         else prefix.fork(max_cache_len=longest))
        # The engine's write (and read) indices stay empty: nothing goes to its pages.

    def update(self, key_states, value_states, layer_idx, kwargs):
        """Stores nothing in the engine's pages: the attention function appends each request's
        tokens to its own cache."""
        if not getattr(hf_cache._forward, "depth", 0):
            raise RuntimeError(hf_cache.NOT_PATCHED)
        self.step_closed = True     # the next extend_* call starts the next step
        hf_cache.set_pending(PackedLayer(self, layer_idx), key_states)
        return key_states, value_states

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        self.requests.pop(request_id, None)
        self.admission.release(request_id)
        self.waiting_for_room.discard(request_id)
        self.arrived_on.pop(request_id, None)
        self.on_prefix.pop(request_id, None)
        self.release_unread()
        for key in [key for key in self.chunks if key[0] == request_id]:   # a request cancelled mid-prompt
            del self.chunks[key]
        super().free_blocks(request_id, no_cache)

    def release_unread(self) -> None:
        """Gives back the reservation of every prefix no longer shared that no request reads or
        waits to read (a request that ended or was cancelled before it ran is gone)."""
        shared = list(self.prefixes)
        for key, prefix in list(self.reserved_prefixes.items()):
            if prefix not in shared and prefix not in self.on_prefix.values() \
                    and prefix not in self.arrived_on.values():
                self.admission.release(key)
                del self.reserved_prefixes[key]

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        self.requests.clear()
        self.chunks.clear()
        self.admission.clear()
        self.arrived_on.clear()
        self.on_prefix.clear()
        self.waiting_for_room.clear()
        self.reserved_prefixes.clear()
        super().free_all_requests(clear_ledgers)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the requests' ragged caches hold (at most ``admission.reserved_bytes``; a fork
        of a shared prefix counts its own pages), and the prompts held dense while they arrive
        in chunks. The shared prefixes are apart: ``prefix_bytes``."""
        chunks = sum(t.nbytes for held in self.chunks.values() for t in (*held.q, *held.k, *held.v))
        return sum(cache.nbytes for cache in self.requests.values()) + chunks

    @property
    def prefix_bytes(self) -> int:
        """Bytes of the shared prefixes (held once, however many requests read them)."""
        return sum(prefix.nbytes for prefix in self.prefixes)
