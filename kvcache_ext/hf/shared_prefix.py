"""Shared prefixes: a prompt's first tokens (a document, a system prompt) compressed once by a
patched model's policy, then read by many sequences in place, as if each had its own copy.

``handle.share_prefix(token_ids)`` runs the patched model over the prefix once and keeps the
compressed cache; a sequence that starts with those tokens continues a fork of it
(``RaggedCache.fork``): the prefix's pages are read where they lie, never copied or written (a
head's partly filled last page is the one page each fork copies), and the sequence's own
tokens go into pages of its own. The serving engine (``kvcache_ext.serving``) matches every
request's prompt against ``handle.prefixes``; ``generate`` takes a fork as its cache
(``kvcache_ext.with_cache(model, prefix.fork())``).

The prefix is compressed before any question about it exists: what it keeps cannot depend on
what follows it, which is the natural use of query-agnostic scorers (ExpectedAttention, KVzip,
StreamingLLM). The policy must compress once and then only append (a one-shot schedule): one
that evicts over the cache would write the shared tokens.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import torch

from kvcache_ext.hf.cache import RaggedCache
from kvcache_ext.cache_argument import with_cache


@dataclass(eq=False)
class SharedPrefix:
    """One compressed prefix: its token ids and the cache that holds what the policy kept."""

    token_ids: list[int]
    cache: RaggedCache      # read-only: every reader continues a fork of it

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes its cache holds (once, however many sequences read it)."""
        return self.cache.nbytes

    @property
    def pages(self) -> int:
        """Pages its cache holds, over every layer."""
        return sum(layer.state.kv.num_pages for layer in self.cache.layers if layer.state.kv is not None)

    def fork(self, max_cache_len: int | None = None) -> RaggedCache:
        """A cache for one sequence that starts with this prefix (``RaggedCache.fork``)."""
        return self.cache.fork(max_cache_len)

    def __repr__(self) -> str:
        return f"SharedPrefix(tokens={len(self)}, nbytes={self.nbytes})"


class SharedPrefixes:
    """The prefixes shared under one patch (``handle.prefixes``). Read by the serving engine's
    thread while the user's thread may add or remove one: a lock guards the list."""

    def __init__(self):
        self._prefixes: list[SharedPrefix] = []
        self._lock = threading.Lock()

    def add(self, prefix: SharedPrefix) -> None:
        with self._lock:
            self.check_new(prefix.token_ids)
            self._prefixes.append(prefix)

    def check_new(self, token_ids: list[int]) -> None:
        if any(p.token_ids == token_ids for p in self._prefixes):
            raise ValueError(f"a prefix of these {len(token_ids)} tokens is already shared")

    def remove(self, prefix: SharedPrefix) -> None:
        """No later sequence matches it; sequences reading it go on (they hold its pages)."""
        with self._lock:
            if prefix not in self._prefixes:
                raise ValueError(f"{prefix!r} is not shared here")
            self._prefixes.remove(prefix)

    def match(self, prompt_ids) -> SharedPrefix | None:
        """The longest shared prefix that ``prompt_ids`` starts with and goes on past (a prompt
        equal to a prefix has no token left to run: it is served without it), or None."""
        prompt = list(prompt_ids)
        with self._lock:
            found = [p for p in self._prefixes if len(p) < len(prompt) and prompt[:len(p)] == p.token_ids]
        return max(found, key=len, default=None)

    def __iter__(self):
        with self._lock:
            return iter(list(self._prefixes))

    def __len__(self) -> int:
        return len(self._prefixes)


def prefix_ids(token_ids) -> list[int]:
    """``token_ids`` (a list or 1-D tensor of token ids) as a list; a ValueError or TypeError
    naming what is wrong otherwise."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.dtype == torch.bool:
            raise ValueError(f"share_prefix token_ids must be a 1-D integer tensor or a list of token ids, got a "
                             f"{token_ids.dtype} tensor of shape {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in token_ids):
        raise TypeError(f"share_prefix token_ids must be a list of token ids (ints) or a 1-D integer tensor, "
                        f"got {type(token_ids).__name__}")
    if not token_ids:
        raise ValueError("share_prefix token_ids is empty: a shared prefix needs at least one token")
    if min(token_ids) < 0:
        raise ValueError(f"share_prefix token_ids must be >= 0, got {min(token_ids)}")
    return list(token_ids)


@torch.no_grad()
def compress_prefix(handle, token_ids) -> SharedPrefix:
    """Runs the patched model (``handle.model``) over ``token_ids`` once, as the prompt of a
    fresh cache, and returns the compressed prefix (its pages packed into one allocation)."""
    ids = prefix_ids(token_ids)
    policy = handle.policy
    if policy.schedule.evicts_over_cache:
        raise ValueError(f"share_prefix: the policy {policy} evicts over the cache (schedule {policy.schedule}), "
                         "which would write the tokens its readers share; share a prefix under a one-shot "
                         "schedule (the prompt compressed once, then appended to)")
    if policy.schedule.lookahead:
        raise ValueError(f"share_prefix: the policy {policy} compresses after {policy.schedule.lookahead} decode "
                         "steps (schedule lookahead), which a shared prefix has not; share a prefix under a one-shot "
                         "schedule with lookahead=0")
    vocab = handle.model.config.get_text_config().vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"share_prefix token_ids must be < the model's vocabulary size {vocab}, got {max(ids)}")
    model = handle.model
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    cache = handle.new_cache()
    forward = getattr(model, "_kvcache_ext_forward", model.forward)    # KVzip's passes wrap the forward
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
    model(input_ids, attention_mask=torch.ones_like(input_ids), **with_cache(model, cache), use_cache=True, **extra)
    cache.shrink_to_fit()     # its readers never add to its pages: none held ahead
    return SharedPrefix(ids, cache)
