"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the most accumulated attention."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcache_ext.checks import Int, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class H2O(Scorer):
    """Score of a token = attention it has received since it entered the cache, summed over
    every query (prompt and generated) and over the G query heads that share its KV head
    (the accumulated reading of CAOTE, Goel et al., 2025, §3.2 and App. B.1: "the sum of
    attention score to token 1 by all future tokens"; kept in float32).

    ``recent``: the newest tokens always kept (H2O's local window; 0 = pure accumulation,
    as the CAOTE paper evaluates it).
    ``query_heads``: also accumulate per query head, in this many more channels (at least the
    model's G): what CAOTE's per-head readings wrap (``with_query_head_state``); 0 = off.
    """

    recent: int = 0
    query_heads: int = 0

    def __post_init__(self):
        # 1 + query_heads float32 channels per token: the store holds at most 65536.
        check_fields(self, "H2O", recent=Int(0), query_heads=Int(0, 65535))

    def check_model(self, model) -> None:
        if self.query_heads:
            self._check_groups(model.groups)

    @property
    def capabilities(self) -> Capabilities:
        # Per-query-head accumulators (query_heads): a block's per-head sums need each head's
        # rows, from a padded view with the queries.
        per_head = self.query_heads > 0
        return Capabilities(channels=1 + self.query_heads, accumulates=("mass",), updates_from_view=per_head,
                            update_stats=("last",) if per_head else (), needs_queries=per_head,
                            needs_kv=per_head, slot_rule="mass")

    def default_protection(self) -> Protection:
        return Protection(recent=self.recent)

    def prompt_scores(self, p: PromptView):
        _, channels = self._prompt_mass(p)
        return channels[..., 0], channels

    def _prompt_mass(self, p: PromptView):
        """(column sums of the prompt's attention per query head [B, H, G, n], channels)."""
        B, H, n, _ = p.k.shape
        mass = p.q.new_zeros(B, p.q.shape[1], n, dtype=torch.float32)
        for _, probs in p.probs():
            mass[..., :probs.shape[-1]] += probs.sum(dim=2)
        per_head = mass.unflatten(1, (H, p.groups))                  # [B, H, G, n]
        total = per_head.sum(dim=2)                                  # the group's heads, as the kernel does
        channels = [total.unsqueeze(-1)]
        if self.query_heads:
            G = self._check_groups(p.groups)
            channels += [per_head.permute(0, 1, 3, 2), total.new_zeros(B, H, n, self.query_heads - G)]
        return per_head, torch.cat(channels, dim=-1)

    def update_view(self, view: CacheView) -> torch.Tensor:
        """The per-query-head accumulators (``query_heads``): one query's row per head is the
        kernel's ``last``; a block's are the column sums of each head's rows."""
        G = self._check_groups(view.groups)
        if view.q is None or view.q.shape[2] == 1:
            mass = view.stats["last"]                                           # [B, H, L, G]
        else:
            mass = sum(p.sum(dim=2) for _, p in view.probs()).unflatten(1, (-1, G)).permute(0, 1, 3, 2)
        new = view.channels.clone()
        new[..., 1:1 + G] += mass.masked_fill(~view.mask[..., None], 0.0)
        return new

    def cache_scores(self, view: CacheView):
        return view.channels[..., 0]

    def with_query_head_state(self, max_groups: int) -> "H2O":
        return replace(self, query_heads=max_groups)

    def prompt_head_scores(self, p: PromptView):
        if not self.query_heads:
            return None
        return self._prompt_mass(p)

    def cache_head_scores(self, view: CacheView):
        if not self.query_heads:
            return None
        return view.channels[..., 1:1 + self._check_groups(view.groups)].permute(0, 1, 3, 2)

    def _check_groups(self, groups: int) -> int:
        if groups > self.query_heads:
            raise ValueError(f"H2O(query_heads={self.query_heads}) keeps per-query-head scores in "
                             f"{self.query_heads} channels, but this model has {groups} query heads per "
                             f"KV head; CAOTE(..., max_groups={groups}) (or gqa='shared') fixes it")
        return groups
