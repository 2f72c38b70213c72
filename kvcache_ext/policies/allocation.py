"""The allocation interface: how a policy splits its budget over layers and KV heads."""
from __future__ import annotations

import torch


class Allocation:
    """``layer_budget``: tokens per KV head for one layer (fixed when the layer's prompt is
    compressed; int64, or float64 from ``layer_budgets``: see ``layer_total``).
    ``head_budgets``: the split of a layer's budget over its KV heads at an eviction step.
    Budgets include the protected tokens (sinks, recent window).
    ``whole_model``: the layers' budgets come from every layer's scores at once
    (``layer_budgets``, AcrossLayers), which only a reconstructing scorer gives.
    ``equal_heads``: ``head_budgets`` gives every KV head of a row the layer's budget, whatever
    the scores (then a head keeps its budget without looking at the others: the store can
    evict each head by itself, by a scorer's slot rule). An allocation that overrides
    ``head_budgets`` to split by the scores sets it False.

    Under tensor parallelism (a model's heads split over ranks, ``policies.ranks``) the engine
    hands these methods one rank's heads, unless the allocation says it splits over every
    rank's: ``heads_across_ranks`` (``head_budgets`` then gets every rank's heads of a row,
    gathered, and each rank keeps its own share: Ada-KV exact) and ``layers_across_ranks``
    (``layer_budgets`` gets every rank's heads of every layer: KVzip's global top-k)."""

    whole_model = False
    equal_heads = True

    @property
    def heads_across_ranks(self) -> bool:
        """``head_budgets`` splits a row's budget over every tensor-parallel rank's heads."""
        return False

    @property
    def layers_across_ranks(self) -> bool:
        """``layer_budgets`` ranks every tensor-parallel rank's heads."""
        return False

    def check_model(self, model) -> None:
        """Raises ValueError for a model (its ``ModelShape``) this allocation cannot serve;
        ``patch`` calls it. Every layer count and head layout is served by default."""

    def layer_budget(self, budget: torch.Tensor, layer_idx: int, num_layers: int,
                     prompt_len: torch.Tensor, reserved: int) -> torch.Tensor:
        """budget, prompt_len [B] int64 (per row); reserved: protected tokens per head."""
        return budget

    def head_budgets(self, layer_budget: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                     protected: torch.Tensor, grouped_counts) -> torch.Tensor:
        """layer_budget [B]; scores, mask, protected [B, H, L] -> [B, H] int64 tokens kept.
        Equal heads: a fractional budget (``layer_budgets``) is rounded to the nearest token.

        ``grouped_counts(scores, mask, k [B]) -> [B, H]``: how many of each head's tokens are
        among the k best of its row (Ada-KV's Algorithm 2), computed by the storage's kernels.
        """
        if layer_budget.is_floating_point():
            layer_budget = torch.floor(layer_budget + 0.5).long()
        return layer_budget[:, None].expand(scores.shape[:2])


def layer_total(layer_budget: torch.Tensor, heads: int) -> torch.Tensor:
    """[B] int64 tokens that a layer of ``heads`` KV heads holds with ``layer_budget`` [B]
    tokens per head. ``AcrossLayers`` gives the per-head budget as a fraction (the layer's count
    of the best scores over its heads), so that this is that count exactly."""
    total = layer_budget * heads
    return total.round().long() if total.is_floating_point() else total
