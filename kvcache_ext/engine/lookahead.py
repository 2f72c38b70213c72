"""A one-shot compression deferred by ``Schedule(lookahead=L)``: the prompt is stored whole with
its newest queries held aside (``hold_prompt_queries``); every later call's queries join them
(``note_queries``), and after L decode steps the layer scores its tokens once, as a one-shot
prefill of everything seen so far whose observation window is the held queries
(``compress_held``), keeping its budget of the prompt plus every token since.

The scorer's window and the protected recent window are both widened by the tokens seen since
the prompt (``Scorer.observing``), so the tokens since are kept and the window's queries are
exactly the held ones; the budget grows by as many tokens, which decoding would have appended
after a compression right after the prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcache_ext.engine.prompt import keep_prompt, note_prompt, prompt_view, release_prefill_slack
from kvcache_ext.engine.state import LayerState
from kvcache_ext.policies.views import newest_queries


@dataclass
class Held:
    """The queries of a deferred compression: ``q`` [B, Hq, r, D] after RoPE, at positions
    ``q_pos`` [B, r] (-1: padding), oldest first; ``since``: tokens (columns, padding included)
    after the prompt; ``steps``: decode steps after the prompt."""

    q: torch.Tensor
    q_pos: torch.Tensor
    scale: float
    prompt_last: torch.Tensor   # [B] the prompt's newest position in each row
    since: int = 0
    steps: int = 0

    def add(self, q: torch.Tensor, q_pos: torch.Tensor, decode_step: bool) -> None:
        """A later call's queries (q [B, Hq, n, D] at ``q_pos`` [B, n]) after the held ones."""
        self.q = torch.cat([self.q, q.to(self.q.dtype)], dim=2)
        self.q_pos = torch.cat([self.q_pos, q_pos], dim=1)
        self.since += q.shape[2]
        self.steps += int(decode_step)


def hold_prompt_queries(state: LayerState, q, k, v, pos, valid, scale) -> None:
    """A fresh prompt (q [B, Hq, n, D], k, v [B, H, n, D]) under a lookahead schedule: every real
    token stored, and each row's newest queries (the scorer's observation window) held."""
    note_prompt(state, pos, valid)
    B, H, n, _ = k.shape
    held = valid[:, None, :].expand(B, H, n)
    if state.window is not None:   # a sliding-window layer stores what the next token sees
        held = held & (pos >= state.window_start(state.last_pos + 1)[:, None])[:, None, :]
    state.kv.append(k, v, pos, held)
    window = state.policy.scorer.capabilities.stats_window or 1
    index, real = newest_queries(valid, pos, window)
    rows = q.gather(2, index[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
    state.hold_queries(Held(rows, pos.gather(1, index).masked_fill(~real, -1), scale, state.last_pos.clone()))
    release_prefill_slack(state)


def note_queries(state: LayerState, q, pos, valid, decode_step: bool) -> None:
    """A call after the prompt (q [B, Hq, n, D] at ``pos`` [B, n], ``valid`` [B, n] or None): its
    queries join the held ones; the compression runs after the schedule's decode steps."""
    held = state.lookahead
    held.add(q, pos if valid is None else pos.masked_fill(~valid, -1), decode_step)
    if held.steps >= state.policy.schedule.lookahead:
        compress_held(state)


def compress_held(state: LayerState) -> None:
    """Scores every stored token with the held queries as the observation window and keeps each
    head's budget of the prompt plus the tokens since (those always kept)."""
    held = state.release_queries()
    parts = state.kv.view(None, True)
    # On int8 pages k and v are the values the pages give back; the tokens kept are stored again
    # from them (the same rows and scales in float32).
    k, v = parts["k"], parts["v"]
    # Nothing was evicted: every head holds the same tokens. Each row in position order, its
    # empty columns first (the left padding of a prompt).
    pos, real = parts["pos"][:, 0], parts["mask"][:, 0]
    key = torch.where(real, pos, torch.full_like(pos, -1))
    order = torch.argsort(key, dim=1, stable=True)
    pos, real, key = pos.gather(1, order), real.gather(1, order), key.gather(1, order)
    take = lambda x: x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))   # noqa: E731
    k, v = take(k), take(v)
    B, Hq, r, D = held.q.shape
    L = pos.shape[1]
    # The held queries in their tokens' columns; padding queries, and those of tokens no longer
    # held (outside a sliding window), into one extra column, dropped.
    column = torch.searchsorted(key.contiguous(), held.q_pos.clamp_min(0).contiguous()).clamp_max(L - 1)
    found = (held.q_pos >= 0) & (key.gather(1, column) == held.q_pos)
    column = torch.where(found, column, torch.full_like(column, L))
    q = held.q.new_zeros(B, Hq, L + 1, D)
    q.scatter_(2, column[:, None, :, None].expand(B, Hq, r, D), held.q)
    q = q[:, :, :L]
    policy = state.policy
    protection = replace(policy.protection, recent=policy.protection.recent + held.since)
    budget = state.budget + held.since
    scored = real
    if not policy.schedule.lookahead_queries:
        # The ablation: the tokens since are out of the scoring (their queries see nothing, their
        # keys are not seen), so the window's real queries are the prompt's; they are kept by
        # the protection all the same.
        scored = real & (pos <= held.prompt_last[:, None])
    scorer = policy.scorer.observing(held.since)
    scores, channels = scorer.prompt_scores(prompt_view(state, q, k, v, pos, scored, held.scale, budget))
    state.new_storage()
    keep_prompt(state, k, v, pos, real, scores, channels, protection=protection, budget=budget)
    release_prefill_slack(state)
