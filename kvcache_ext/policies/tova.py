"""TOVA (Oren et al., 2024): keep the tokens the newest query attends to most."""
from __future__ import annotations

from dataclasses import dataclass


from kvcache_ext.checks import Bool, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class TOVA(Scorer):
    """Score of a token = attention from the last query (TOVA, Oren et al., 2024; as CAOTE,
    Goel et al., 2025, §2, writes it: ``f_j = A_{-1,j}``).

    ``per_head=False`` (the default, as the TOVA authors do it): the last query's attention
    averaged over all heads of the layer, so every head ranks tokens the same way.
    ``per_head=True``: averaged over the G query heads of each KV head only.
    """

    per_head: bool = False

    def __post_init__(self):
        check_fields(self, "TOVA", per_head=Bool())

    @property
    def capabilities(self) -> Capabilities:
        # The default mean over every head of the layer reads every KV head.
        return Capabilities(evict_stats=("last",), reads_every_head=not self.per_head)

    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        (_, last), = p.probs(slice(n - 1, n))          # [B, Hq, 1, n]
        last = last[:, :, 0]
        if self.per_head:
            return last.unflatten(1, (H, p.groups)).mean(dim=2), None
        ranks = p.model.ranks
        if ranks is None:
            return last.mean(dim=1, keepdim=True).expand(B, H, n).contiguous(), None
        # Under tensor parallelism the layer's heads are on every rank: the mean over all of them.
        mean = ranks.sum(last.sum(dim=1, keepdim=True)) / (last.shape[1] * ranks.size)
        return mean.expand(B, H, n).contiguous(), None

    def prompt_head_scores(self, p: PromptView):
        n = p.q.shape[2]
        (_, last), = p.probs(slice(n - 1, n))          # [B, Hq, 1, n]
        return last[:, :, 0].unflatten(1, (p.k.shape[1], p.groups)), None

    def cache_head_scores(self, view: CacheView):
        return view.stats["last"].permute(0, 1, 3, 2)

    def cache_scores(self, view: CacheView):
        last = view.stats["last"]                      # [B, H, L, G]
        if self.per_head:
            return last.mean(dim=-1)
        # Heads may hold different tokens (head-wise budgets): average by position.
        B, H, L = view.pos.shape
        ranks = view.model.ranks
        width = int(view.pos.max().item()) + 2 if view.pos.numel() else 1
        if ranks is not None:   # every rank's heads: one width, the sums added over ranks
            width = ranks.max(width, view.pos.device)
        per_pos = last.new_zeros(B, width)
        idx = view.pos.masked_fill(~view.mask, per_pos.shape[1] - 1).view(B, H * L)
        per_pos.scatter_add_(1, idx, last.sum(dim=-1).masked_fill(~view.mask, 0).view(B, H * L))
        if ranks is not None:
            per_pos = ranks.sum(per_pos) / (H * ranks.size * view.groups)
        else:
            per_pos /= H * view.groups
        return per_pos.gather(1, idx).view(B, H, L)
