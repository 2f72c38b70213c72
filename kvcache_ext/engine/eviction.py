"""Eviction over the cache: the scorer rates the cached tokens and each head keeps its budget.

Two ways, chosen from the policy's capabilities alone: by the scorer's slot rule, which the
storage runs by itself (``rule_eviction``: no padded view, each head on its own), or on a
padded view of the layer (``cache_view``), scored by ``cache_scores`` and split over the heads
by the allocation. Called by a decode step (``engine.decode``) and by a block of several new
tokens (``engine.blocks``).
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.across_ranks import any_over_budget, head_budgets
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.storage import EvictByRule
from kvcache_ext.policies.views import CacheView


def rule_eviction(policy, budget: torch.Tensor, budget_host: torch.Tensor) -> EvictByRule | None:
    """The eviction to ``budget`` [B] (``budget_host`` on the host) by the scorer's slot rule,
    or None where it needs a padded view: a scorer without a slot rule, an allocation that
    splits a row's budget by the scores (Ada-KV), or a fractional budget (AcrossLayers)."""
    rule = policy.scorer.capabilities.slot_rule
    if rule is None or not policy.allocation.equal_heads or budget_host.is_floating_point():
        return None
    return EvictByRule(rule, policy.protection.sinks, policy.protection.recent, budget, budget_host)


def cache_view(state: LayerState, stats: dict, stat_queries: int, target: torch.Tensor,
               queries=None) -> CacheView:
    """The cached tokens of one layer, padded, with what the scorer asked for."""
    caps = state.policy.scorer.capabilities
    parts = state.kv.view(stats, caps.needs_kv)
    q, q_pos, scale = queries if queries is not None and caps.needs_queries else (None, None, None)
    return CacheView(pos=parts["pos"], mask=parts["mask"], channels=parts["channels"],
                     last_pos=state.last_pos, layer_idx=state.layer_idx, num_layers=state.num_layers,
                     groups=state.groups, stats=parts["stats"], stat_queries=stat_queries,
                     k=parts.get("k"), v=parts.get("v"), budget=target, q=q, q_pos=q_pos, scale=scale,
                     model=state.model, layer_state=state.scorer_state,
                     cache_state=state.shared.scorer_state, token_ids=state.shared.token_ids)


def evict(state: LayerState, target: torch.Tensor, target_host: torch.Tensor, stats: dict, stat_queries: int,
          active: torch.Tensor | None = None, queries=None, rule: EvictByRule | None = None) -> bool:
    """Keeps the allocation's budget ``target`` [B] of each head (of the ``active`` rows only,
    when given): by ``rule`` in the storage, else scored on a padded view. Returns whether
    anything was scored."""
    p, kv = state.policy, state.kv
    if not any_over_budget(state, not bool((kv.lens <= target_host.view(-1, 1)).all())):   # host lengths
        return False   # every head is within its budget (on every rank, when they split together)
    if rule is not None:
        kv.evict_by_rule(rule, state.last_pos)
        return True
    view = cache_view(state, stats, stat_queries, target, queries)
    mask = view.mask
    lens = mask.sum(dim=-1)
    scores, protected = p.protection.apply(p.scorer.cache_scores(view), view.pos, state.last_pos, mask)
    per_head = head_budgets(state, target.to(scores.device), scores, mask, protected, kv.grouped_counts, view.pos)
    if active is not None:
        per_head = torch.where(active.to(per_head.device)[:, None], per_head, lens)
    kv.evict(scores, per_head)
    return True
