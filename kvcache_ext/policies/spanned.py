"""Spanned(base): any score-based scorer whose eviction scores are shared by whole spans (words,
numbers, sentences: ``kvcache_ext.policies.spans``), so that its selection keeps or drops a
span as a whole.

It reads the token ids of the rows (``view.token_ids``) and the tokenizer's token kinds
(``view.model.token_kinds``): ``patch`` refuses a policy with spans without a tokenizer, and
the patched model notes the ids of every call. See docs/policies.md, "Spans".
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvcache_ext.checks import Choice, Instance, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import newest
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.spans import Spans
from kvcache_ext.policies.views import CacheView, PromptView
from kvcache_ext.policies.wrapper import Wrapper

BUDGETS = ("spans", "tokens")   # what the allocation splits by: the shared scores, or the tokens' own


@dataclass
class Spanned(Wrapper):
    """The scores of ``base`` shared by whole spans (``spans``, default ``Spans("word", "max")``)
    before the top-k.

    Blind to padding, to the base's protected recent window (``base.default_protection()``)
    and to infinite scores, like ``Pooled``; a base that pools (SnapKV) pools first. The base's
    state (channels, statistics, updates) is untouched: only the score the selection reads
    changes. Everything else is the base's. A base that reconstructs the prompt (KVzip) runs
    its passes as it would alone (``Spanned`` is then a reconstructing scorer too, with the
    base's passes, softmax and sinks); the raw scores of every layer are shared by span once
    the passes are done, before the allocation splits the budget (``held_scores``).

    ``budgets``: what the allocation splits the budget over layers and heads by, for a
    reconstructing base: ``"spans"`` (default), the shared scores; ``"tokens"``, the base's own
    scores, so that spans choose which tokens each head keeps but not how many. Why: a span
    takes its best token's score, so one high score claims the whole span, and a top-k over
    every layer that counts whole sentences can spend a small budget on a few layers and leave
    others their protected tokens alone (docs/policies.md, "KVzip with spans, and its allocation")."""

    base: Scorer
    spans: Spans = field(default_factory=Spans)
    budgets: str = "spans"

    def __post_init__(self):
        check_fields(self, "Spanned", base=Instance(Scorer, "a kvcache_ext.policies scorer"),
                     spans=Instance(Spans, "a kvcache_ext.policies.Spans"), budgets=Choice(BUDGETS))
        if self.budgets == "tokens" and not self.base.capabilities.reconstructs:
            raise ValueError(f"Spanned budgets='tokens' splits the budget by a reconstructing base's own scores "
                             f"(KVzip); the base {type(self.base).__name__} scores as the prompt is read: use "
                             f"budgets='spans'")

    @property
    def inner(self) -> Scorer:
        return self.base

    @property
    def capabilities(self) -> Capabilities:
        # A reconstructing base's passes run as its own (the wrapper reads only their result).
        inner = self.base.capabilities
        return replace(super().capabilities, reconstructs=inner.reconstructs)

    def wraps(self, inner: Capabilities) -> Capabilities:
        return replace(inner, needs_token_ids=True)   # the spans come from the rows' token ids

    def observing(self, extra: int) -> "Spanned | None":
        base = self.base.observing(extra)
        return None if base is None else replace(self, base=base)

    # --- a reconstructing base (ReconstructionScorer): its passes, scores shared after ----
    @property
    def reconstruction(self):
        return self.base.reconstruction

    @property
    def softmax(self) -> str:
        return self.base.softmax

    @property
    def sinks(self) -> int:
        return self.base.sinks

    @property
    def needs_tokenizer(self) -> bool:
        return self.base.needs_tokenizer

    def rebuilt(self, ids, valid, tokens):
        return self.base.rebuilt(ids, valid, tokens)

    def passes(self, ids, rebuilt, tokens, start: int = 0):
        return self.base.passes(ids, rebuilt, tokens, start)

    def pass_scores(self, probs, groups):
        return self.base.pass_scores(probs, groups)

    def budget_scores(self, scores, pos, valid, last_pos, model, token_ids):
        if self.budgets == "tokens":
            return self.base.held_scores(scores, pos, valid, last_pos, model, token_ids)
        return None   # the shared scores, as held

    def held_scores(self, scores, pos, valid, last_pos, model, token_ids):
        scores = self.base.held_scores(scores, pos, valid, last_pos, model, token_ids)
        B, H, n = scores.shape
        return self._share(scores.float(), pos[:, None, :].expand(B, H, n), valid[:, None, :].expand(B, H, n),
                           last_pos, model.token_kinds, token_ids)

    # --- shared scores --------------------------------------------------------------------
    def _share(self, scores, pos, real, last_pos, kinds, token_ids) -> torch.Tensor:
        if kinds is None:
            raise RuntimeError("Spanned needs the tokenizer's token kinds (ModelParts.token_kinds): patch the "
                               "model with its tokenizer (kvcache_ext.patch(model, policy, tokenizer=...)) and "
                               "use the handle's caches (handle.new_cache(), generate)")
        if token_ids is None or token_ids.ids is None:
            raise RuntimeError("Spanned needs the token ids of the cached tokens, and none were noted: the "
                               "patched model notes them when it is called with input_ids (generate, "
                               "model(input_ids, past_key_values=cache)); a call with inputs_embeds only, or "
                               "continuous batching, gives none")
        recent = newest(pos, last_pos, self.base.default_protection().recent)
        live = real & ~recent & torch.isfinite(scores)
        span, known = self.spans.span_of(token_ids, kinds, pos)
        if not bool((known | ~live).all()):
            raise RuntimeError("Spanned: some cached tokens have no noted token id (a call gave "
                               "inputs_embeds without input_ids?); spans need every token's id")
        return self.spans(scores, span, live)

    def prompt_scores(self, p: PromptView):
        scores, channels = self.base.prompt_scores(p)
        B, H, n = scores.shape
        pos = p.pos[:, None, :].expand(B, H, n)
        return self._share(scores.float(), pos, p.valid[:, None, :].expand(B, H, n), p.last_pos,
                           p.model.token_kinds, p.token_ids), channels

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        return self._share(self.base.cache_scores(view).float(), view.pos, view.mask, view.last_pos,
                           view.model.token_kinds, view.token_ids)
