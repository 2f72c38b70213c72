"""RaggedPagedCache: transformers' paged cache of the continuous batching engine, whose requests
keep their tokens in kvcache_ext's ragged caches instead.

The engine (transformers ``generation/continuous_batching``) packs the tokens of every request
of a step into one varlen batch and asks its ``PagedAttentionCache`` where each request's
tokens go (``extend_read_and_write_indices``, in batch order), then the model's attention calls
``cache.update`` with the packed K and V. This subclass records each step's requests in that
order (``step``), keeps one ``RaggedCache`` of batch 1 per request (made at its first tokens,
dropped when the engine frees the request), and hands the packed batch to the patched attention
function, which splits it by request (``kvcache_ext.serving.attention``). The engine's own
scheduling and page bookkeeping run unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.continuous_batching.cache import PagedAttentionCache

from kvcache_ext.hf import cache as hf_cache


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
    """What ``update`` hands the attention function for one layer of one step."""

    cache: "RaggedPagedCache"
    layer_idx: int


class RaggedPagedCache(PagedAttentionCache):
    """Made by ``adopt`` from the engine's own cache (the manager builds that one as usual)."""

    handle = None                   # the PatchHandle whose policy serves the requests
    requests: dict                  # request id -> RaggedCache (batch 1)
    chunks: dict                    # (request id, layer) -> PromptChunks of a prompt split over steps
    step: list                      # [StepRequest] of the step being run, in batch order
    step_closed = False             # the step's forward has begun: the next request starts a new step

    @classmethod
    def adopt(cls, cache: PagedAttentionCache, handle, scheduler) -> "RaggedPagedCache":
        """Turns the engine's ``PagedAttentionCache`` into this class in place: the engine's
        scheduler, batch processor and inputs all hold that object, and building it again here
        would copy the manager's construction code."""
        cache.__class__ = cls
        cache.start(handle, scheduler)
        return cache

    def start(self, handle, scheduler) -> None:
        """This class's own state, from ``adopt``: no request yet. ``scheduler``: the engine's,
        whose request states say whether a prompt has tokens left."""
        self.handle, self.scheduler = handle, scheduler
        self.requests, self.chunks, self.step, self.step_closed = {}, {}, [], False

    # --- what the engine calls ----------------------------------------------------------------
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        if self.step_closed:
            self.step, self.step_closed = [], False
        first = self.step[-1].first + self.step[-1].count if self.step else 0
        state = self.scheduler.active_requests.get(request_id)
        done = state is None or not state.remaining_prefill_tokens
        self.step.append(StepRequest(request_id, past_length, first, query_length, done))
        if request_id not in self.requests:
            self.requests[request_id] = self.handle.new_cache()
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def update(self, key_states, value_states, layer_idx, kwargs):
        """Stores nothing in the engine's pages: the attention function appends each request's
        tokens to its own cache. (The engine's pages stay allocated and unused.)"""
        if not getattr(hf_cache._forward, "depth", 0):
            raise RuntimeError(hf_cache.NOT_PATCHED)
        self.step_closed = True     # the next extend_* call starts the next step
        hf_cache.set_pending(PackedLayer(self, layer_idx), key_states)
        return key_states, value_states

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        self.requests.pop(request_id, None)
        for key in [key for key in self.chunks if key[0] == request_id]:   # a request cancelled mid-prompt
            del self.chunks[key]
        super().free_blocks(request_id, no_cache)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        self.requests.clear()
        self.chunks.clear()
        super().free_all_requests(clear_ledgers)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the requests' ragged caches hold."""
        return sum(cache.nbytes for cache in self.requests.values())
