"""Pooled(base): any score-based scorer with its eviction scores pooled along positions.

SnapKV, AhaKV and K-VEC pool by default (docs/policies.md, "Pooling", says why); ``Pooled`` gives
the same smoothing to any other scorer (H2O, TOVA, RoCo, ScissorHands, your own), for the
pooling ablation of docs/results.md or because a method keeps whole spans better that way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.checks import Instance, check_fields
from kvcache_ext.policies.pooling import Pooling
from kvcache_ext.policies.protection import newest
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView
from kvcache_ext.policies.wrapper import Wrapper


@dataclass
class Pooled(Wrapper):
    """The scores of ``base`` pooled by ``pooling`` (default max, kernel 7) before the top-k.

    Blind to padding, to the base's protected recent window (``base.default_protection()``)
    and to infinite scores (the tokens a base keeps anyway, RoCo's robust set say). The base's
    state (channels, statistics, updates) is untouched: only the score the selection reads is
    pooled. Everything else is the base's."""

    base: Scorer
    pooling: Pooling = field(default_factory=Pooling)

    def __post_init__(self):
        check_fields(self, "Pooled", base=Instance(Scorer, "a kvcache_ext.policies scorer"),
                     pooling=Instance(Pooling, "a kvcache_ext.policies.Pooling"))

    @property
    def inner(self) -> Scorer:
        return self.base

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
