"""SnapKV (Li et al., 2024): attention from an observation window of the newest queries, pooled."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import GQA_MODES, Scorer, group_reduce
from kvcache_ext.policies.views import CacheView, PromptView

ORDERS = ("mean_then_pool", "pool_then_mean")


@dataclass
class SnapKV(Scorer):
    """Score of a token = attention from the last ``window`` queries, averaged over those
    queries and aggregated over the G query heads of its KV head (``gqa``: mean or max),
    then smoothed along the positions by a pooling of ``kernel`` (stride 1, same length).
    The window itself is always kept and counts toward the budget.

    Defaults are the Ada-KV paper's SnapKV settings (research/seed-001-adakv.md §2.4, §5):
    window 32, max pooling, kernel 7. ``order``: SnapKV's and the Ada-KV code's convention
    (average the window, then pool) by default; ``"pool_then_mean"`` is Ada-KV's Alg. 3 line 4
    read literally, which needs each window query's row and so is one-shot prefill only.

    Over the cache (block-wise prefill, decode eviction) the window is the last ``window``
    queries of the latest call: a block's last queries, or the single decode query.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    order: str = "mean_then_pool"

    evict_stats = ("mass", "last")

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKV needs window >= 1 and an odd kernel >= 1, got "
                             f"window={self.window}, kernel={self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"SnapKV pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.gqa not in GQA_MODES:
            raise ValueError(f"SnapKV gqa must be one of {GQA_MODES}, got {self.gqa!r}")
        if self.order not in ORDERS:
            raise ValueError(f"SnapKV order must be one of {ORDERS}, got {self.order!r}")

    @property
    def stats_window(self) -> int:
        return self.window

    def default_protection(self) -> Protection:
        return Protection(recent=self.window)

    def check(self, schedule) -> None:
        if self.order == "pool_then_mean" and schedule.evicts_over_cache:
            raise ValueError("SnapKV(order='pool_then_mean') needs every window query's attention "
                             "row, which only one-shot prefill has; use order='mean_then_pool' "
                             "with block-wise prefill or decode-time eviction")

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, 1, shape[-1])
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        return pool(x, self.kernel, stride=1, padding=self.kernel // 2).view(shape)

    def prompt_scores(self, p: PromptView):
        n = p.q.shape[2]
        w = min(self.window, n)
        (_, probs), = p.probs(slice(n - w, n), chunk=w)         # [B, Hq, w, n]
        seen = p.valid[:, n - w:].sum(dim=1).clamp_min(1).view(-1, 1, 1)  # window queries that are real
        if self.order == "pool_then_mean":
            probs = self._pool(probs)
        scores = group_reduce(probs.sum(dim=2) / seen, p.groups, self.gqa)
        if self.order == "mean_then_pool":
            scores = self._pool(scores)
        return scores, None

    def cache_scores(self, view: CacheView):
        if self.gqa == "mean":
            scores = view.stats["mass"] / (view.stat_queries * view.groups)
        elif view.stat_queries == 1:
            scores = view.stats["last"].amax(dim=-1)
        else:
            raise ValueError("SnapKV(gqa='max') over a window of several queries needs each "
                             "head's window attention, which the kernel sums; use gqa='mean' "
                             "with block-wise prefill")
        return self._pool(scores.masked_fill(~view.mask, 0.0))
