"""Layer budgets that follow the best scores over all layers (KVzip's non-uniform layer ratios)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.policies.allocation import Allocation


@dataclass
class AcrossLayers(Allocation):
    """Each layer's budget is its share of the best scores of all layers together: the
    L * H * B best scores of a row over every layer and KV head (B the per-head budget),
    protected tokens first, and layer l gets those that are its own, as a fractional budget
    per head (its count / H, float64) so that the layer holds its count exactly under
    ``AdaKV``; alone, each head gets the nearest whole token. KVzip selects this way
    ("layerwise=False" in its code); its scores are attention probabilities, comparable
    across layers. (Rounding each layer to whole tokens per head instead would move up to
    H / 2 tokens per layer away from that top-k.) A layer counts towards the total only the
    tokens it can hold: a sliding-window layer of a longer prompt holds its window at most, so
    the part of its budget past the window is not handed to the other layers, and the cache
    holds what a uniform allocation of the same budget holds.

    It needs every layer's scores at once, which only a scorer that scores a prompt after the
    whole model ran has (``reconstructs``, KVzip); ``Policy`` refuses it otherwise. Use it as
    ``AdaKV(alpha=1.0, layers=AcrossLayers())`` for KVzip's own selection (one top-k over all
    heads and layers), or alone for equal heads within a layer.
    """

    whole_model = True   # layer budgets from every layer's scores (reconstruction.finish)

    @property
    def layers_across_ranks(self) -> bool:
        # Its top-k is over every head of the model: under tensor parallelism every rank's
        # scores (``engine.across_ranks``), so that each layer's count is one process's.
        return True

    def layer_budgets(self, budget: torch.Tensor, scores: list[torch.Tensor]) -> list[torch.Tensor]:
        """budget [B] tokens per head; scores per layer [B, H, n] (-inf: not held, +inf:
        protected) -> per layer [B] float64 tokens per head (the layer's count / H)."""
        flat = torch.cat([s.flatten(1) for s in scores], dim=1)                # [B, L*H*n]
        # Per layer, what one of its heads can hold (its held tokens: a window, the prompt).
        holds = [(s > float("-inf")).sum(dim=2).amax(dim=1) for s in scores]   # [B] each
        total = sum(torch.minimum(budget.to(h.device).long(), h) * s.shape[1]
                    for h, s in zip(holds, scores))                           # [B]
        order = torch.argsort(flat, dim=1, descending=True, stable=True)
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen.scatter_(1, order, torch.arange(flat.shape[1], device=flat.device) < total[:, None])
        chosen &= flat > float("-inf")
        out, at = [], 0
        for s in scores:
            size = s[0].numel()
            count = chosen[:, at:at + size].sum(dim=1)
            out.append(count.double() / s.shape[1])
            at += size
        return out
