"""Serving many requests at once with eviction, on transformers' continuous batching engine.

A patched model's ``generate_batch`` (and ``continuous_batching_context_manager``) serves each
request from its own ragged cache with the patch's policy: ``manager.RaggedBatchingManager``,
transformers' ``ContinuousBatchingManager`` with our cache (``cache.RaggedPagedCache``) and our
attention (``attention.attend_packed``), admitting requests by the memory their caches hold
(``admission``). ``kvcache-ext serve`` runs transformers' OpenAI-compatible server on a patched
model (``server``), each request checked before it runs (``validation``), sampled with its own
settings (``sampling``) and cancelled when its client leaves (``disconnect``); ``load`` is a
load and fault client for such a server.
"""
from kvcache_ext.serving.cache import RaggedPagedCache
from kvcache_ext.serving.manager import RaggedBatchingManager, init_continuous_batching

__all__ = ["RaggedBatchingManager", "RaggedPagedCache", "init_continuous_batching"]
