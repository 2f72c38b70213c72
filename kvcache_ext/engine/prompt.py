"""Compressing a fresh prompt: the steps that a one-shot prefill (``eviction``) and the end of
reconstruction passes (``reconstruction``) both take. A prompt's budgets and newest positions
are noted (``note_prompt``), each head keeps its budget of the tokens by their scores
(``keep_prompt``), and the pages the prefill no longer needs go back (``release_prefill_slack``).
"""
from __future__ import annotations

from kvcache_ext.engine.across_ranks import head_budgets
from kvcache_ext.engine.state import LayerState
from kvcache_ext.policies.views import PromptView


def prompt_view(state: LayerState, q, k, v, pos, valid, scale, budget=None) -> PromptView:
    """A fresh prompt of one layer as its scorer sees it (``budget`` [B]: instead of the layer's)."""
    return PromptView(q=q, k=k, v=v, pos=pos, valid=valid, scale=scale, layer_idx=state.layer_idx,
                      num_layers=state.num_layers, budget=state.budget if budget is None else budget,
                      model=state.model, layer_state=state.scorer_state,
                      cache_state=state.shared.scorer_state, token_ids=state.shared.token_ids)


def compress_prompt(state: LayerState, q, k, v, pos, valid, scale) -> None:
    """One-shot prefill: score the dense prompt, keep each head's budget, store only that."""
    note_prompt(state, pos, valid)
    scores, channels = state.policy.scorer.prompt_scores(prompt_view(state, q, k, v, pos, valid, scale))
    keep_prompt(state, k, v, pos, valid, scores, channels)


def note_prompt(state: LayerState, pos, valid) -> None:
    """A fresh prompt's budgets and newest positions."""
    state.ensure_budget(valid.sum(dim=1))
    state.note_newest(pos.masked_fill(~valid, -1).max(dim=1).values)


def keep_prompt(state: LayerState, k, v, pos, valid, scores, channels, protection=None, budget=None,
                split_scores=None) -> None:
    """Stores each head's budget of a prompt by ``scores`` [B, H, n] (protection and the
    allocation applied), with the scorer's ``channels`` when the schedule evicts again.
    ``protection`` / ``budget`` [B]: instead of the policy's / the layer's (a deferred
    compression's, ``engine.lookahead``). ``split_scores`` [B, H, n]: what the allocation
    splits the layer's budget over its heads by, instead of ``scores`` (``budget_scores``)."""
    p, kv = state.policy, state.kv
    protection = p.protection if protection is None else protection
    budget = state.budget if budget is None else budget
    B, H, n, _ = k.shape
    if state.window is not None:
        # A sliding-window layer: the tokens the next token will not see are gone first; the
        # budget applies among the rest.
        valid = valid & (pos >= state.window_start(state.last_pos + 1)[:, None])
    held = valid[:, None, :].expand(B, H, n)
    scores, protected = protection.apply(scores, pos[:, None, :].expand(B, H, n), state.last_pos, held)
    counts = lambda s, m, total: kv.prompt_grouped_counts(s, pos, valid, total)
    if split_scores is not None:
        split_scores, _ = protection.apply(split_scores, pos[:, None, :].expand(B, H, n), state.last_pos, held)
    per_head = head_budgets(state, budget, scores if split_scores is None else split_scores, held, protected,
                            counts)
    keep = kv.prompt_keep(scores, pos, valid, per_head)
    kv.append(k, v, pos, keep)
    if channels is not None and p.schedule.evicts_over_cache:
        kv.set_prompt_channels(channels, keep)


def release_prefill_slack(state: LayerState) -> None:
    """After a prompt, a layer holds its kept tokens in whole pages and no free page: a
    block-wise prefill needs budget + block tokens per head while it runs, and the pages its
    evictions emptied are given back here (one repack). A cache that decoding holds at its
    budget also keeps pages for the tokens that arrive between two evictions, so that
    decoding allocates nothing. A cache that grows while decoding takes a page when one fills
    up, unless its length to come is known (``max_cache_len``, which generate gives): then it
    keeps pages for every token still to come, and decoding allocates nothing either. A
    sliding-window layer keeps pages for its window, no more."""
    every = state.policy.schedule.decode_every
    if every is not None:
        extra = every
    else:
        extra = max(0, state.max_cache_len - state.seen) if state.max_cache_len else 0
    if state.window is not None:   # a sliding-window layer never holds more than its window
        extra = min(extra, max(0, state.window - int(state.kv.lens.min())))
    state.kv.trim(extra)

