"""SnapKV (Li et al., 2024): attention from an observation window of the newest queries, pooled."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcache_ext.checks import Choice, Int, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.pooling import KERNEL, POOLING_MODES, Pooling
from kvcache_ext.policies.protection import Protection, newest
from kvcache_ext.policies.scorer import GQA_MODES, Scorer, group_reduce
from kvcache_ext.policies.views import CacheView, PromptView

ORDERS = ("mean_then_pool", "pool_then_mean")


@dataclass
class SnapKV(Scorer):
    """Score of a token = attention from the last ``window`` queries, averaged over those
    queries and aggregated over the G query heads of its KV head (``gqa``: mean or max),
    then smoothed along the positions by a pooling of ``kernel`` (stride 1, same length; see
    ``kvcache_ext.policies.pooling``: blind to padding and to the window, which SnapKV's code
    cuts off before pooling). The window itself is always kept and counts toward the budget.

    Defaults are the Ada-KV paper's SnapKV settings (Feng et al., 2024, §3.6 and §4.1):
    window 32, max pooling, kernel 7 (``kernel=1``: no pooling). ``order``: SnapKV's and the
    Ada-KV code's convention (average the window, then pool) by default; ``"pool_then_mean"``
    is Ada-KV's Alg. 3 line 4 read literally, which needs each window query's row and so is
    one-shot prefill only.

    Over the cache (block-wise prefill, decode eviction) the window is the last ``window``
    queries of the latest call: a block's last queries, or the single decode query.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    order: str = "mean_then_pool"

    def __post_init__(self):
        check_fields(self, "SnapKV", window=Int(1), kernel=KERNEL, pooling=Choice(POOLING_MODES),
                     gqa=Choice(GQA_MODES), order=Choice(ORDERS))

    @property
    def pool(self) -> Pooling:
        return Pooling(self.kernel, self.pooling)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(evict_stats=("mass", "last"), stats_window=self.window)

    def default_protection(self) -> Protection:
        return Protection(recent=self.window)

    def observing(self, extra: int) -> "SnapKV":
        return replace(self, window=self.window + extra)

    def check(self, schedule) -> None:
        if self.order == "pool_then_mean" and schedule.evicts_over_cache:
            raise ValueError("SnapKV(order='pool_then_mean') needs every window query's attention "
                             "row, which only one-shot prefill has; use order='mean_then_pool' "
                             "with block-wise prefill or decode-time eviction")
        block = schedule.prefill_block
        if self.gqa == "max" and block is not None and block > 1 and self.window > 1:
            raise ValueError(f"SnapKV(gqa='max', window={self.window}) cannot evict after prefill "
                             f"blocks of {block} tokens: over the cache the kernel sums a window's "
                             "attention over the G query heads, and the max over them needs each "
                             "head's window (only one query's per-head row is kept). Use "
                             "gqa='mean', one-shot prefill, or prefill_block=1")

    # --- pooled attention of the window, per query head or per KV head ----------------------
    def _prompt_window(self, p: PromptView):
        """(window rows [B, Hq, w, n], live [B, 1, n]: the tokens that take part in pooling,
        real queries in the window [B, 1, 1])."""
        n = p.q.shape[2]
        w = min(self.window, n)
        (_, probs), = p.probs(slice(n - w, n), chunk=w)
        live = (p.valid & ~newest(p.pos, p.last_pos, self.window))[:, None, :]
        seen = p.valid[:, n - w:].sum(dim=1).clamp_min(1).view(-1, 1, 1)
        return probs, live, seen

    def _cache_live(self, view: CacheView) -> torch.Tensor:
        return view.mask & ~newest(view.pos, view.last_pos, self.window)

    def prompt_scores(self, p: PromptView):
        probs, live, seen = self._prompt_window(p)
        if self.order == "pool_then_mean":
            probs = self.pool(probs, live[:, :, None])
        scores = group_reduce(probs.sum(dim=2) / seen, p.groups, self.gqa)
        if self.order == "mean_then_pool":
            scores = self.pool(scores, live)
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
        return self.pool(scores.masked_fill(~view.mask, 0.0), self._cache_live(view))

    # --- per query head (CAOTE's per-head readings) -------------------------------------------
    def prompt_head_scores(self, p: PromptView):
        probs, live, _ = self._prompt_window(p)
        if self.order == "pool_then_mean":
            h = self.pool(probs, live[:, :, None]).sum(dim=2)
        else:
            h = self.pool(probs.sum(dim=2), live)
        return h.unflatten(1, (p.k.shape[1], p.groups)), None

    def cache_head_scores(self, view: CacheView):
        if view.q is None or min(self.window, view.q.shape[2]) == 1:
            h = view.stats["last"].permute(0, 1, 3, 2)                      # [B, H, G, L]
        else:
            h = sum(p.sum(dim=2) for _, p in view.probs(self.window)).unflatten(1, (-1, view.groups))
        live = self._cache_live(view)[:, :, None]
        return self.pool(h.masked_fill(~view.mask[:, :, None], 0.0), live)
