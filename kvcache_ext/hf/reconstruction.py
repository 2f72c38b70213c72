"""KVzip's reconstruction passes run by the model (the driver of every ``ReconstructionScorer``):
where the whole model is known, so it lives beside the patch.

A patched model whose scorer reconstructs the prompt holds each layer's dense prompt after a
one-shot prefill (``kvcache_ext.engine.reconstruction``: what each layer's attention does in a
pass); here the passes' inputs run through the model's forward, and every layer then keeps its
budget by the scores (``engine.reconstruction.finish``). The patched model runs the passes when
the forward that prefilled the prompt returns (``score_after_forward``); ``score_prompt`` runs
them on a cache by hand, and ``PromptTokens`` tokenizes the scorer's instructions.
"""
from __future__ import annotations

import functools

import torch

from kvcache_ext.cache_argument import cache_argument
from kvcache_ext.engine.reconstruction import finish
from kvcache_ext.engine.state import LayerState


def engine_states(cache) -> list[LayerState]:
    """The layer states of an engine cache (a ``RaggedCache``); [] for any other object."""
    states = [getattr(layer, "state", None) for layer in getattr(cache, "layers", None) or ()]
    return states if all(isinstance(state, LayerState) for state in states) else []


def awaiting(cache) -> bool:
    """Whether ``cache`` is an engine cache that holds prompts reconstruction passes must score."""
    return any(state.context is not None for state in engine_states(cache))


def check_tokenizer(scorer, tokenizer) -> None:
    """Raises ValueError when ``scorer`` needs the model's tokenizer and ``patch`` was not given one."""
    if scorer.capabilities.reconstructs and scorer.needs_tokenizer and tokenizer is None:
        raise ValueError(f"{type(scorer).__name__} prompts the model with text instructions: pass the "
                         "model's tokenizer (patch(model, policy, tokenizer=...)), or give them as token ids "
                         "(and skip_prefix as token ids or None)")


def chat_template_tokens(tokenizer, part: str) -> list[int]:
    """Token ids of the tokenizer's chat template around one user message: ``"prefix"``, what
    comes before the user's text (nothing without a template); ``"suffix"``, what follows it up
    to the assistant's answer (a newline without a template)."""
    text = "\n" if part == "suffix" else ""
    if getattr(tokenizer, "chat_template", None):
        mark = "\x00kvcache_ext\x00"
        turn = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                             tokenize=False)
        text = turn.split(mark, 1)[0 if part == "prefix" else 1]
    return tokenizer.encode(text, add_special_tokens=False) if text else []


class PromptTokens:
    """``tokens(text) -> list[int]``, what a ReconstructionScorer's ``passes`` and ``rebuilt``
    tokenize their text with: ``text``'s token ids by the model's tokenizer (no special tokens);
    ``"chat"`` and ``"chat_prefix"``: the parts of its chat template after and before a user's
    text (``chat_template_tokens``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"tokenizing {text!r} needs the model's tokenizer: patch(model, policy, tokenizer=...)")
        if text in ("chat", "chat_prefix"):
            return chat_template_tokens(self.tokenizer, "prefix" if text == "chat_prefix" else "suffix")
        return self.tokenizer.encode(text, add_special_tokens=False)


def score_after_forward(forward, cache_key: str, tokens):
    """``forward`` (a model's) wrapped so that a prompt held for reconstruction passes is scored
    and compressed as soon as the forward that prefilled it returns (inside ``generate`` too);
    ``cache_key``: the keyword the model takes its cache under. It keeps ``forward``'s
    signature, which generate reads: without it generate passes no position_ids (a left-padded
    row's positions then count its padding) and no attention mask."""
    @functools.wraps(forward)
    def forward_then_score(*args, **kwargs):
        out = forward(*args, **kwargs)
        cache = kwargs.get(cache_key, kwargs.get("past_key_values"))   # the older name still works
        if awaiting(cache):
            ids = kwargs.get("input_ids", args[0] if args else None)
            reconstruct(forward, cache, ids, kwargs.get("attention_mask"), tokens)
        return out
    return forward_then_score


def score_prompt(forward, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, tokens,
                 scores: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
    """Scores and compresses the prompt ``input_ids`` that ``cache`` holds for reconstruction
    passes (``reconstruct``), or None when it holds none. ``scores``: the scores the passes gave
    this prompt and scorer before (a harness that compresses one prompt at several budgets runs
    them once): the passes are skipped and every layer keeps its budget by them (``finish``)."""
    if not awaiting(cache):
        return None
    if scores is not None:
        finish(engine_states(cache), scores)
        return scores
    return reconstruct(forward, cache, input_ids, attention_mask, tokens)


@torch.no_grad()
def reconstruct(forward, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                tokens) -> list[torch.Tensor]:
    """Runs the scorer's reconstruction passes over ``cache`` (which holds the dense prompt
    ``input_ids`` [B, n] of every layer) through ``forward`` (the model's unwrapped forward),
    then compresses every layer by the scores. Returns the scores [B, H, n] per layer (a
    harness that compresses the same prompt at several budgets reuses them: ``finish``)."""
    states = engine_states(cache)
    scorer = states[0].policy.scorer
    if input_ids is None:
        raise ValueError("KVzip's reconstruction needs the prompt's input_ids (not inputs_embeds)")
    valid = (attention_mask.bool() if attention_mask is not None
             else torch.ones_like(input_ids, dtype=torch.bool))
    key = cache_argument(forward)
    newest = states[0].context.pos.masked_fill(~states[0].context.valid, -1).max(dim=1).values   # [B]
    # A skipped prefix (KVzip's skip_prefix) is neither rebuilt nor rated, its sinks apart.
    rebuilt = scorer.rebuilt(input_ids, valid, tokens)
    scorable, start = None, 0
    if not torch.equal(rebuilt, valid):
        scorable = rebuilt | (valid & (states[0].context.pos < scorer.sinks))
        start = int(rebuilt.any(dim=0).nonzero()[0]) if bool(rebuilt.any()) else 0
        for state in states:
            state.context.rate_only(scorable)
    for inputs, real, lo, hi in scorer.passes(input_ids, rebuilt, tokens, start):
        for state in states:
            state.context.start_pass((lo, hi), real)
        pos = newest[:, None] + real.long().cumsum(dim=1)       # after the context, padding skipped
        mask = torch.cat([valid, real], dim=1).long()
        try:
            forward(input_ids=inputs, attention_mask=mask, position_ids=pos.masked_fill(~real, 0),
                    use_cache=True, logits_to_keep=1, **{key: cache})
        finally:
            for state in states:
                state.context.end_pass()
    scores = [state.context.scores for state in states]
    if scorable is not None:   # softmax="context" rates every key it sees: not a skipped one
        for layer_scores in scores:
            layer_scores.masked_fill_(~scorable[:, None, :], 0.0)
    finish(states, scores)
    return scores
