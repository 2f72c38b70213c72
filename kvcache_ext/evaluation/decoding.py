"""Greedy decoding by hand over any cache, and the caches the harness compares."""
from __future__ import annotations

import time

import torch

from kvcache_ext.cache_argument import with_cache


@torch.no_grad()
def greedy_continue(model, cache, logits: torch.Tensor, max_new_tokens: int, eos_id: int | None):
    """Greedy tokens after a prefill whose last logits are ``logits`` [1, V]; the model feeds
    each token back over ``cache``. Returns (token ids, decode seconds per token)."""
    token = logits.argmax(dim=-1, keepdim=True)
    new = [int(token)]
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if eos_id is not None and new[-1] == eos_id:
            break
        out = model(token, **with_cache(model, cache), use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        new.append(int(token))
    return new, (time.perf_counter() - start) / max(len(new) - 1, 1)


def full_cache_from(model, recorded):
    """HF's full DynamicCache holding a recorded prefill (what the unpatched model would hold)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    for i, view in enumerate(recorded.views):
        cache.update(view.k, view.v, i)
    return cache


def cache_bytes(cache) -> int:
    """Bytes of K/V (and, for a RaggedCache, everything its stores hold)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
