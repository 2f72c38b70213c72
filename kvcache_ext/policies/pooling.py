"""Pooling of per-token scores along positions: the smoothing SnapKV applies to its window
attention, shared by every score-based scorer that pools (SnapKV, AhaKV, K-VEC, and any scorer
of your own).

A score at one token is replaced by the max (or the mean) of the scores of the tokens within
``kernel // 2`` places of it, in position order, within its own segment (one row of a [B, H, L]
view). Only the tokens that take part count: padding and the tokens the scorer keeps anyway
(its recent window, which SnapKV's code cuts off before pooling) neither contribute to their
neighbours nor receive a pooled value (they keep their own score). So the mean is over the
taking-part neighbours that exist, and a short segment or a segment's ends simply have fewer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache_ext.checks import Choice, Int, check_fields

POOLING_MODES = ("max", "avg")
KERNEL = Int(1, odd=True, what="an odd integer >= 1 (same-length pooling; 1 = none)")


@dataclass(frozen=True)
class Pooling:
    """``kernel``: odd window size, 1 = no pooling. ``mode``: "max" or "avg"."""

    kernel: int = 7
    mode: str = "max"

    def __post_init__(self):
        check_fields(self, "Pooling", kernel=KERNEL, mode=Choice(POOLING_MODES))

    def __call__(self, scores: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """scores [..., L] in position order; live [..., L] bool (broadcastable): the tokens that
        take part. Returns float32 scores of the same shape."""
        x = scores.float()
        if self.kernel == 1 or x.numel() == 0:
            return x
        live = live.expand(x.shape)
        shape, L, r = x.shape, x.shape[-1], self.kernel // 2
        flat = lambda t: t.reshape(-1, 1, L)
        if self.mode == "max":
            pooled = F.max_pool1d(flat(x.masked_fill(~live, float("-inf"))), self.kernel, stride=1, padding=r)
        else:
            window_sum = lambda t: F.avg_pool1d(flat(t), self.kernel, stride=1, padding=r,
                                                count_include_pad=True) * self.kernel
            pooled = window_sum(x.masked_fill(~live, 0.0)) / window_sum(live.float()).clamp_min(1.0)
        return torch.where(live, pooled.view(shape), x)

