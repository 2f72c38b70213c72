"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the most accumulated attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class H2O(Scorer):
    """Score of a token = attention it has received since it entered the cache, summed over
    every query (prompt and generated) and over the G query heads that share its KV head
    (research/seed-000-caote.md §4.1: the accumulated reading, kept in float32).

    ``recent``: the newest tokens always kept (H2O's local window; 0 = pure accumulation,
    as the CAOTE paper evaluates it).
    """

    recent: int = 0

    channels = 1
    update_stats = ("mass",)

    def default_protection(self) -> Protection:
        return Protection(recent=self.recent)

    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        mass = p.q.new_zeros(B, p.q.shape[1], n, dtype=torch.float32)
        for _, probs in p.probs():
            mass[..., :probs.shape[-1]] += probs.sum(dim=2)
        mass = mass.unflatten(1, (H, p.groups)).sum(dim=2)  # the group's heads, as the kernel does
        return mass, mass.unsqueeze(-1)

    def update(self, channels, stats):
        channels[..., 0] += stats["mass"]

    def cache_scores(self, view: CacheView):
        return view.channels[..., 0]
