"""Allocations over heads that live on several tensor-parallel ranks.

Each rank's cache holds its own heads (``policies.ranks``) and a uniform policy runs on each
unchanged. An allocation that splits a row's budget over all of its heads (Ada-KV exact:
``Allocation.heads_across_ranks``) or over every head of every layer (KVzip's global top-k:
``layers_across_ranks``) gets every rank's scores instead: each rank gathers them (one
all-gather of the scores, the held and protected masks, and for a cache the positions),
computes the allocation over all heads exactly as one process would, and keeps its own
heads' share. Every rank computes the same numbers from the same gathered tensors, so the
ranks agree without another round, and the tokens kept are one process's. The scores are
what crosses ranks, never the keys or values: a float per held token against the 2 * head_dim
values of its K and V.

Every rank must make the same calls in the same order (collectives); the engine's steps are
the same on every rank, since each rank runs the same model call on the same tokens. The one
decision a rank would otherwise make alone, whether a layer has a head over its budget at all,
is taken together (``any_over_budget``), for these allocations and for a scorer whose score of
a head reads every head (``Capabilities.reads_every_head``: TOVA's mean over heads, which sums over
the ranks itself).
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.state import LayerState
from kvcache_ext.kernels.select import grouped_topk


def crossing_heads(state: LayerState):
    """The ranks to split this layer's head budgets over, or None (one rank's heads)."""
    ranks = state.model.ranks
    return ranks if ranks is not None and state.policy.allocation.heads_across_ranks else None


def any_over_budget(state: LayerState, over: bool) -> bool:
    """Whether some head of the layer, on any rank, holds more than its budget (``over``: this
    rank's answer), when the ranks must evict together: an exact split re-allocates every head
    of a row as soon as one is over, and a scorer that reads every head (TOVA's mean) runs a
    collective of its own. Otherwise each rank answers for its own heads."""
    ranks = state.model.ranks
    together = state.policy.allocation.heads_across_ranks or state.policy.scorer.capabilities.reads_every_head
    return ranks.any(over, state.tokens[2]) if ranks is not None and together else over


def head_budgets(state: LayerState, budget: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                 protected: torch.Tensor, counts, pos: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H] tokens kept per head of this rank: ``allocation.head_budgets`` over this rank's
    heads, or, when it splits over every rank's (``heads_across_ranks``), over all of them
    gathered, this rank's share taken. ``counts``: the grouped counts over this rank's heads
    (the storage's); ``pos`` [B, H, L]: a cache view's positions, by which the counts over the
    gathered heads rank ties (None: a prompt, whose ``counts`` serves any heads)."""
    allocation = state.policy.allocation
    ranks = crossing_heads(state)
    if ranks is None:
        return allocation.head_budgets(budget, scores, mask, protected, counts)
    # bool travels as uint8: not every backend gathers bool
    every_mask = ranks.gather_heads(mask.to(torch.uint8), 0).bool()
    every_protected = ranks.gather_heads(protected.to(torch.uint8), 0).bool()
    every_scores = ranks.gather_heads(scores, float("-inf"))
    if pos is not None:
        every_pos = ranks.gather_heads(pos, -1)
        counts = lambda s, m, k: padded_grouped_counts(s, m, every_pos, k)   # noqa: E731
    per_head = allocation.head_budgets(budget, every_scores, every_mask, every_protected, counts)
    return ranks.own_heads(per_head)


def layer_budgets(state: LayerState, budget: torch.Tensor, scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """``allocation.layer_budgets`` (every layer's scores at once, [B, H, n] each), over every
    rank's heads when the allocation ranks them all (``layers_across_ranks``): each layer's
    per-head budget is then its count over all heads / all heads, the same on every rank."""
    allocation = state.policy.allocation
    ranks = state.model.ranks
    if ranks is not None and allocation.layers_across_ranks:
        scores = [ranks.gather_heads(s, float("-inf")) for s in scores]
    return allocation.layer_budgets(budget, scores)


def padded_grouped_counts(scores: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Ada-KV's grouped counts over padded tensors scores, mask, pos [B, H, L]: how many of each
    head's held tokens are among the k [B] best of its row (ties to the lower position, then
    the earlier head: the storage's rule), by the grouped top-k kernel."""
    B, H, L = scores.shape
    order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)   # held tokens first
    flat = scores.float().gather(2, order).reshape(-1).contiguous()
    pos32 = pos.gather(2, order).to(torch.int32).reshape(-1).contiguous()
    start = torch.arange(B * H, device=scores.device, dtype=torch.int64) * L
    lens = mask.sum(dim=-1).to(torch.int32).reshape(-1).contiguous()
    _, counts = grouped_topk(flat, pos32, start, lens, H, k.to(torch.int64))
    return counts.view(B, H).long()
