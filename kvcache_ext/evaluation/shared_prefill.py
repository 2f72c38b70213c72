"""One dense prefill, compressed by many policies.

With a one-shot schedule a patched model attends to a fresh prompt with the model's own dense
attention and compresses each layer's keys and values right after: the prefill itself (every
layer's queries, keys, values and the prompt's last logits) does not depend on the policy. The
harness therefore runs it once per prompt, recording each layer's dense prompt, and builds
each policy's cache from the recording exactly as the patched prefill would
(``eviction.prefill_dense``, the patched model's own path, on the same tensors).
``tests/test_evaluation.py`` checks that this gives the same tokens and logits as running the
patched model on the prompt.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from kvcache_ext.hf.patching import is_patched, patch
from kvcache_ext.engine.forward import prefill_dense
from kvcache_ext.hf.reconstruction import awaiting
from kvcache_ext.hf.cache import RaggedCache
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import Policy, Scorer
from kvcache_ext.policies.views import ModelParts, PromptView


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
    logits: torch.Tensor   # [B, 1, V] logits of the prompt's last position (all a run reads)
    seconds: float = 0.0   # the prefill's wall time
    model: ModelParts = field(default_factory=ModelParts)   # what the model hands its scorers
    # Scores of reconstruction passes (KVzip), per scorer: computed once per prompt and reused
    # at every budget, with the passes' wall time.
    reconstructed: dict = field(default_factory=dict)
    windows: list = field(default_factory=list)   # per layer, its sliding window (None: none)
    input_ids: torch.Tensor | None = None   # [B, n] the prompt's token ids (for a policy that reads them)


@torch.no_grad()
def record_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> RecordedPrefill:
    """Runs the dense prefill of ``input_ids`` [B, n] once and records every layer."""
    if is_patched(model):
        raise ValueError("record_prefill patches the model itself: unpatch it first")
    recorder = _Recorder()
    # Only the last position's logits are read: a prompt's whole [n, V] logits would cost more
    # memory and time than the layers themselves for a model with a large vocabulary.
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with patch(model, Policy(recorder, budget=input_ids.shape[1])) as handle:
        cache = handle.new_cache()
        start = time.perf_counter()
        out = model(input_ids, attention_mask=attention_mask, **with_cache(model, cache), use_cache=True,
                    **last_only)
        seconds = time.perf_counter() - start
    return RecordedPrefill(views=recorder.views, logits=out.logits[:, -1:].clone(), seconds=seconds,
                           model=handle.model_parts,
                           windows=[layer.state.window for layer in cache.layers], input_ids=input_ids)


def compressed_cache(policy: Policy, recorded: RecordedPrefill, model: ModelParts | None = None,
                     kv_dtype: str | None = None) -> RaggedCache:
    """The RaggedCache that a model patched with ``policy`` holds after the recorded prefill.
    ``model``: the parts of the model that the patched model hands its scorers
    (``handle.model_parts``; by default the recording's, which lack the tokenizer's token
    kinds that a policy with spans reads). A policy that reads token ids gets the recorded
    prompt's, noted as the patched model notes them. ``kv_dtype``: what its pages hold."""
    if policy.schedule.prefill_block is not None:
        raise ValueError("a block-wise prefill depends on the policy: it cannot share a recording")
    cache = RaggedCache(policy, len(recorded.views), model=recorded.model if model is None else model,
                        kv_dtype=kv_dtype)
    if policy.scorer.capabilities.needs_token_ids and recorded.views:
        if recorded.input_ids is None:
            raise ValueError(f"compressed_cache: the policy's scorer {type(policy.scorer).__name__} reads the "
                             "prompt's token ids, and this recording has none (record it with record_prefill)")
        view = recorded.views[0]
        cache.token_ids.note(recorded.input_ids, view.pos, view.valid, int(view.pos.max()))
    windows = recorded.windows or [None] * len(recorded.views)
    for layer, view, window in zip(cache.layers, recorded.views, windows):
        layer.lazy_initialization(view.k, view.v)
        layer.state.note_window(window)   # a sliding layer keeps its window of the prompt
        prefill_dense(layer.state, view.q, view.k, view.v, view.pos, view.valid, view.scale)
    return cache


def score_by_reconstruction(handle, cache: RaggedCache, recorded: RecordedPrefill, input_ids,
                            attention_mask=None) -> float:
    """Finishes a ``compressed_cache`` whose scorer reconstructs the prompt (KVzip): runs the
    passes through the patched model (``handle``) the first time this scorer meets this
    recording, reuses their scores after. Returns the passes' wall time (0 when none ran)."""
    if not awaiting(cache):
        return 0.0
    key = repr(cache.policy.scorer.reconstruction)   # the raw scores: a wrapper's base gives the same
    if key in recorded.reconstructed:
        handle.score_prompt(cache, input_ids, attention_mask, scores=recorded.reconstructed[key][0])
    else:
        start = time.perf_counter()
        scores = handle.score_prompt(cache, input_ids, attention_mask)
        recorded.reconstructed[key] = (scores, time.perf_counter() - start)
    return recorded.reconstructed[key][1]
