"""One dense prefill, compressed by many policies.

With a one-shot schedule a patched model attends to a fresh prompt with the model's own dense
attention and compresses each layer's keys and values right after: the prefill itself (every
layer's queries, keys, values and the prompt's logits) does not depend on the policy. The
harness therefore runs it once per prompt, recording each layer's dense prompt, and builds
each policy's cache from the recording exactly as the patched prefill would
(``eviction.store_dense_prompt``, the patched model's own path, on the same tensors). ``tests/test_evaluation.py`` checks that
this gives the same tokens and logits as running the patched model on the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kvcache_ext
from kvcache_ext.cache import RaggedCache
from kvcache_ext.eviction import store_dense_prompt
from kvcache_ext.policies import Policy, Scorer
from kvcache_ext.policies.views import PromptView


class _Recorder(Scorer):
    """Keeps the whole prompt and remembers each layer's dense view of it."""

    def __init__(self):
        self.views: list[PromptView] = []

    def prompt_scores(self, p: PromptView):
        self.views.append(p)
        return torch.zeros(p.k.shape[:3], device=p.k.device), None

    def cache_scores(self, view):
        raise RuntimeError("the recorder never evicts")


@dataclass
class RecordedPrefill:
    views: list            # per layer, the dense PromptView (q, k, v after RoPE, positions)
    logits: torch.Tensor   # [B, n, V] logits of the prompt


@torch.no_grad()
def record_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> RecordedPrefill:
    """Runs the dense prefill of ``input_ids`` [B, n] once and records every layer."""
    if kvcache_ext.is_patched(model):
        raise ValueError("record_prefill patches the model itself: unpatch it first")
    recorder = _Recorder()
    with kvcache_ext.patch(model, Policy(recorder, budget=input_ids.shape[1])) as handle:
        out = model(input_ids, attention_mask=attention_mask, past_key_values=handle.new_cache(),
                    use_cache=True)
    return RecordedPrefill(views=recorder.views, logits=out.logits)


def compressed_cache(policy: Policy, recorded: RecordedPrefill) -> RaggedCache:
    """The RaggedCache that a model patched with ``policy`` holds after the recorded prefill."""
    if policy.schedule.prefill_block is not None:
        raise ValueError("a block-wise prefill depends on the policy: it cannot share a recording")
    cache = RaggedCache(policy, len(recorded.views))
    for layer, view in zip(cache.layers, recorded.views):
        state = layer.state
        layer.lazy_initialization(view.k, view.v)
        state.ensure_storage(view.q, view.k)
        state.seen += view.k.shape[2]
        store_dense_prompt(state, view.q, view.k, view.v, view.pos, view.valid, view.scale)
    return cache
