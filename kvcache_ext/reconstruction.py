"""Scoring a prefilled context by reconstruction passes of the model (KVzip's protocol).

A scorer with ``reconstructs = True`` (``policies.KVzip``) cannot score a prompt inside one
layer's attention call: its scores come from running the whole model again. So a one-shot
prefill with such a scorer keeps each layer's dense prompt aside (``Context``, the full
cache's K and V for the time of the passes) and stores nothing; ``reconstruct`` then feeds
each reconstruction input over it, and every layer's attention in that mode
(``attend_context``) computes its output exactly (softmax over the whole context and the
pass's own tokens, causal) and folds the probabilities into the context's scores. The pass's
tokens are never cached. Finally each layer keeps its budget by those scores (``finish``),
exactly as a one-shot prefill keeps its scorer's.

Extra memory: one pass's activations (``chunk`` tokens plus the instruction) and, per layer
call, one block of ``ROWS`` queries' probabilities over the context; nothing grows with the
number of passes.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

ROWS = 256   # reconstruction queries per block of probabilities


@dataclass
class Context:
    """One layer's dense prompt, kept while the reconstruction passes score it."""

    k: torch.Tensor          # [B, H, n, D]
    v: torch.Tensor
    pos: torch.Tensor        # [B, n] int64
    valid: torch.Tensor      # [B, n] bool
    scale: float
    scores: torch.Tensor     # [B, H, n] float32, the largest probability seen so far
    window: tuple[int, int] = (0, 0)   # context indices the current pass rebuilds
    pass_real: torch.Tensor | None = None   # [B, r] the current pass's real tokens (None: no pass)


def attend_context(state, q, k, v, pos):
    """One layer's attention for a reconstruction pass: q, k, v [B, *, r, D] of the pass's
    tokens at positions ``pos`` [B, r] over the context and themselves. Updates the context's
    scores; returns [B, r, Hq, D]."""
    ctx, scorer = state.context, state.policy.scorer
    if ctx.pass_real is None:
        raise RuntimeError(
            f"layer {state.layer_idx} holds a prompt that {type(scorer).__name__} has not scored yet: "
            "its reconstruction passes run when the patched model's forward returns (call the "
            "patched model, or kvcache_ext.reconstruction.reconstruct, on the prompt first)")
    real = ctx.pass_real
    B, Hq, r, D = q.shape
    H, n = ctx.k.shape[1], ctx.k.shape[2]
    G = Hq // H
    # Every context token is older than every pass token: a pass token sees the real context
    # and, causally, the real pass tokens before it (padding sees the context only).
    sees_new = (pos[:, None, :] <= pos[:, :, None]) & real[:, None, :]             # [B, r, r]
    keys = torch.cat([ctx.k, k], dim=2).float().transpose(2, 3)[:, :, None]       # [B, H, 1, D, n + r]
    values = torch.cat([ctx.v, v], dim=2).float()[:, :, None]                     # [B, H, 1, n + r, D]
    lo, hi = ctx.window
    # KVzip's code normalises the scores over the sinks, the chunk being rebuilt and the pass's
    # own tokens only (``softmax="chunk"``); when the chunk is the whole context that is the
    # model's own softmax (``"context"``).
    narrow = scorer.softmax == "chunk" and (lo > 0 or hi < n)
    padded_context, padded_pass = not bool(ctx.valid.all()), not bool(real.all())   # host checks, once
    if narrow:
        return attend_chunk(ctx, scorer, q, k, v, real, sees_new, padded_pass)
    out = q.new_empty(B, Hq, r, D)
    for i0 in range(0, r, ROWS):
        i1 = min(i0 + ROWS, r)
        c = i1 - i0
        logits = (q[:, :, i0:i1].float().unflatten(1, (H, G)) * ctx.scale) @ keys   # [B, H, G, c, n + r]
        if padded_context:
            logits[..., :n].masked_fill_(~ctx.valid[:, None, None, None, :], float("-inf"))
        logits[..., n:].masked_fill_(~sees_new[:, None, None, i0:i1], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[:, :, i0:i1] = (probs @ values).reshape(B, Hq, c, D).to(q.dtype)
        on_context = probs[..., :n]
        if padded_pass:   # a padding query's probabilities do not count
            on_context = on_context * real[:, None, None, i0:i1, None]
        ctx.scores = torch.maximum(ctx.scores, scorer.pass_scores(on_context.flatten(1, 2), G))
    return out.transpose(1, 2)


def attend_chunk(ctx, scorer, q, k, v, real, sees_new, padded_pass):
    """``attend_context`` for a pass that rebuilds part of the context with KVzip's code's
    softmax: the output from the model's attention over everything (fused, SDPA), the scores
    from logits over the sinks, the chunk and the pass's tokens only (a third less work than
    logits over the whole context at two chunks, and no second product with the values)."""
    B, Hq, r, D = q.shape
    H, n = ctx.k.shape[1], ctx.k.shape[2]
    G = Hq // H
    lo, hi = ctx.window
    sees = torch.cat([ctx.valid[:, None, :].expand(B, r, n), sees_new], dim=2)    # [B, r, n + r]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([ctx.k, k], dim=2), torch.cat([ctx.v, v], dim=2), attn_mask=sees[:, None],
        scale=ctx.scale, enable_gqa=G > 1).nan_to_num(0.0)
    # The sinks before the chunk: the shortest prefix that holds every row's (left padding
    # moves them), the other columns of it masked.
    sink = ctx.valid[:, :lo] & (ctx.pos[:, :lo] < scorer.sinks)                     # [B, lo]
    e = int((sink * torch.arange(1, lo + 1, device=q.device)).max()) if lo else 0
    keys = torch.cat([ctx.k[:, :, :e], ctx.k[:, :, lo:hi], k], dim=2).float().transpose(2, 3)[:, :, None]
    visible = torch.cat([sink[:, :e], ctx.valid[:, lo:hi]], dim=1)                  # [B, e + hi - lo]
    for i0 in range(0, r, ROWS):
        i1 = min(i0 + ROWS, r)
        logits = (q[:, :, i0:i1].float().unflatten(1, (H, G)) * ctx.scale) @ keys   # [B, H, G, c, e + w + r]
        logits[..., :e + hi - lo].masked_fill_(~visible[:, None, None, None, :], float("-inf"))
        logits[..., e + hi - lo:].masked_fill_(~sees_new[:, None, None, i0:i1], float("-inf"))
        on_chunk = torch.softmax(logits, dim=-1)[..., e:e + hi - lo]
        if padded_pass:   # a padding query's probabilities do not count
            on_chunk = on_chunk * real[:, None, None, i0:i1, None]
        ctx.scores[..., lo:hi] = torch.maximum(ctx.scores[..., lo:hi], scorer.pass_scores(on_chunk.flatten(1, 2), G))
    return out.transpose(1, 2)


def hold_context(state, k, v, pos, valid, scale) -> None:
    """Instead of compressing a fresh prompt now: keep it for the reconstruction passes."""
    B, H, n, _ = k.shape
    state.context = Context(k=k, v=v, pos=pos, valid=valid, scale=scale,
                            scores=torch.zeros(B, H, n, dtype=torch.float32, device=k.device))


def awaiting(cache) -> bool:
    """Whether a cache holds prompts that reconstruction passes must score."""
    return any(getattr(layer.state, "context", None) is not None for layer in cache.layers)


@torch.no_grad()
def reconstruct(forward, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                tokens) -> list[torch.Tensor]:
    """Runs the scorer's reconstruction passes over ``cache`` (which holds the dense prompt
    ``input_ids`` [B, n] of every layer) through ``forward`` (the model's unwrapped forward),
    then compresses every layer by the scores. Returns the scores [B, H, n] per layer (a
    harness that compresses the same prompt at several budgets reuses them: ``finish``)."""
    states = [layer.state for layer in cache.layers]
    scorer = states[0].policy.scorer
    if input_ids is None:
        raise ValueError("KVzip's reconstruction needs the prompt's input_ids (not inputs_embeds)")
    valid = (attention_mask.bool() if attention_mask is not None
             else torch.ones_like(input_ids, dtype=torch.bool))
    # transformers >= 5.24 calls the cache argument `cache` (`past_key_values` before).
    key = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    newest = states[0].context.pos.masked_fill(~states[0].context.valid, -1).max(dim=1).values   # [B]
    for inputs, real, lo, hi in scorer.passes(input_ids, valid, tokens):
        for state in states:
            state.context.window, state.context.pass_real = (lo, hi), real
        pos = newest[:, None] + real.long().cumsum(dim=1)       # after the context, padding skipped
        mask = torch.cat([valid, real], dim=1).long()
        try:
            forward(input_ids=inputs, attention_mask=mask, position_ids=pos.masked_fill(~real, 0),
                    use_cache=True, logits_to_keep=1, **{key: cache})
        finally:
            for state in states:
                state.context.pass_real = None
    scores = [state.context.scores for state in states]
    finish(cache, scores)
    return scores


def finish(cache, scores: list[torch.Tensor]) -> None:
    """Every layer keeps its budget of its held prompt by ``scores`` and drops the rest (the
    layers' budgets first split by all the scores when the allocation asks: AcrossLayers)."""
    from kvcache_ext.eviction import keep_prompt, release_prefill_slack
    states = [layer.state for layer in cache.layers]
    policy = states[0].policy
    if policy.allocation.whole_model:
        ranked = []
        for state, layer_scores in zip(states, scores):
            ctx = state.context
            B, H, n = layer_scores.shape
            held = ctx.valid[:, None, :].expand(B, H, n)
            protected = policy.protection.mask(ctx.pos[:, None, :].expand(B, H, n), state.last_pos) & held
            ranked.append(layer_scores.masked_fill(~held, float("-inf")).masked_fill(protected, float("inf")))
        base = policy.budget_for(states[0].context.valid.sum(dim=1))
        for state, budget in zip(states, policy.allocation.layer_budgets(base, ranked)):
            state.budget, state.budget_host = budget, budget.cpu()
    for layer, layer_scores in zip(cache.layers, scores):
        state = layer.state
        ctx, state.context = state.context, None
        keep_prompt(state, ctx.k, ctx.v, ctx.pos, ctx.valid, layer_scores, None)
        release_prefill_slack(state)
