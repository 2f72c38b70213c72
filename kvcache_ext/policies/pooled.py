"""Pooled(base): any score-based scorer with its eviction scores pooled along positions.

SnapKV, AhaKV and K-VEC pool as their papers (and the seed specs' errata) say; ``Pooled`` gives
the same smoothing to any other scorer (H2O, TOVA, RoCo, ScissorHands, your own), for the
pooling ablation of docs/results.md or because a method keeps whole spans better that way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.policies.pooling import Pooling, newest
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class Pooled(Scorer):
    """The scores of ``base`` pooled by ``pooling`` (default max, kernel 7) before the top-k.

    Blind to padding, to the base's protected recent window (``base.default_protection()``)
    and to infinite scores (the tokens a base keeps anyway, RoCo's robust set say). The base's
    state (channels, statistics, updates) is untouched: only the score the selection reads is
    pooled. Everything else is the base's."""

    base: Scorer
    pooling: Pooling = field(default_factory=Pooling)

    def __post_init__(self):
        if not isinstance(self.base, Scorer):
            raise TypeError(f"Pooled base must be a kvcache_ext.policies scorer, got {self.base!r}")
        if not isinstance(self.pooling, Pooling):
            raise TypeError(f"Pooled pooling must be a kvcache_ext.policies.Pooling, got {self.pooling!r}")

    # --- the base's interface ----------------------------------------------------------------
    @property
    def channels(self) -> int:
        return self.base.channels

    @property
    def update_stats(self):
        return self.base.update_stats

    @property
    def evict_stats(self):
        return self.base.evict_stats

    @property
    def stats_window(self):
        return self.base.stats_window

    @property
    def needs_kv(self) -> bool:
        return self.base.needs_kv

    @property
    def needs_queries(self) -> bool:
        return self.base.needs_queries

    @property
    def output_after_eviction(self) -> bool:
        return self.base.output_after_eviction

    @property
    def updates_from_view(self) -> bool:
        return self.base.updates_from_view

    def default_protection(self) -> Protection:
        return self.base.default_protection()

    def check_policy(self, policy) -> None:
        self.base.check_policy(policy)

    def update(self, channels, stats) -> None:
        self.base.update(channels, stats)

    def update_view(self, view: CacheView) -> torch.Tensor:
        return self.base.update_view(view)

    # --- pooled scores -----------------------------------------------------------------------
    def _pool(self, scores, pos, real, last_pos) -> torch.Tensor:
        recent = newest(pos, last_pos, self.base.default_protection().recent)
        return self.pooling(scores, real & ~recent & torch.isfinite(scores))

    def prompt_scores(self, p: PromptView):
        scores, channels = self.base.prompt_scores(p)
        B, H, n = scores.shape
        pos = p.pos[:, None, :].expand(B, H, n)
        return self._pool(scores.float(), pos, p.valid[:, None, :].expand(B, H, n), p.last_pos), channels

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        return self._pool(self.base.cache_scores(view).float(), view.pos, view.mask, view.last_pos)
