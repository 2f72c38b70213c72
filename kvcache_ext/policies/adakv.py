"""Ada-KV (Feng et al.): adaptive head-wise budget allocation with the safeguard alpha."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.checks import Choice, Instance, Real, check_fields
from kvcache_ext.policies.allocation import Allocation, layer_total
from kvcache_ext.policies.uniform import Uniform

ACROSS_RANKS = ("exact", "per_rank")   # how a row's budget is split when its heads are on several ranks


@dataclass
class AdaKV(Allocation):
    """Splits a layer's budget over its KV heads by where the best scores are
    (Ada-KV, Feng et al., 2024, §3.3-3.6, Algorithms 1-3):

    1. Algorithm 2: take the H * B best scores over all heads of a row (B = the layer's
       per-head budget, H heads); head i's count B*_i = how many of them are its own.
    2. Algorithm 3 line 7: B_i = alpha * B*_i + (1 - alpha) * B (``alpha`` = 0.5 as in every
       experiment of the paper; alpha = 0 is uniform, alpha = 1 pure Algorithm 2).
    3. Algorithm 1: head i keeps the B_i best of its own scores.

    The budget is real: a layer's heads hold sum_i B_i = H * B tokens in total. Protected
    tokens (SnapKV's window) stay out of steps 1-2 and are added to every head, as in the
    authors' code. Rounding (not in the paper): floor, then one more token to the heads with
    the largest remainders until the sum is exact; a head never gets more than it holds.
    ``layers``: the layer schedule, ``Uniform()`` (Ada-SnapKV), ``Pyramid()`` (Ada-Pyramid) or
    ``AcrossLayers()`` (by every layer's scores; KVzip).

    ``across_ranks``: under tensor parallelism (a row's heads on several ranks), ``"exact"``
    (the default) splits the row's budget over all of its heads as one process would, so the
    tokens kept are one process's: each rank gathers the scores of every rank's heads
    (``engine.across_ranks``; a score per held token, 1 / (2 * head_dim) of the keys' and
    values' bytes, per eviction) and takes its own share; with ``layers=AcrossLayers()`` the
    layers' budgets too. ``"per_rank"``: each rank shares its own part of the budget (its
    heads' count times the per-head budget) among its own heads, with no communication. One
    process: the two are the same.
    """

    alpha: float = 0.5
    layers: Allocation = field(default_factory=Uniform)
    across_ranks: str = "exact"

    equal_heads = False   # head_budgets splits a row's budget by its heads' scores

    def __post_init__(self):
        layers = "a layer schedule, Uniform(), Pyramid() or AcrossLayers()"
        check_fields(self, "AdaKV", alpha=Real(0.0, 1.0), layers=Instance(Allocation, layers),
                     across_ranks=Choice(ACROSS_RANKS))
        if isinstance(self.layers, AdaKV):
            raise ValueError(f"AdaKV layers must be {layers}, got {self.layers!r}")

    def check_model(self, model) -> None:
        self.layers.check_model(model)

    @property
    def whole_model(self) -> bool:
        return self.layers.whole_model

    @property
    def heads_across_ranks(self) -> bool:
        return self.across_ranks == "exact"

    @property
    def layers_across_ranks(self) -> bool:
        # one choice for both steps: an exact head split needs the same layer total on every rank
        return self.across_ranks == "exact" and self.layers.layers_across_ranks

    def layer_budgets(self, budget, scores):
        return self.layers.layer_budgets(budget, scores)

    def layer_budget(self, budget, layer_idx, num_layers, prompt_len, reserved):
        return self.layers.layer_budget(budget, layer_idx, num_layers, prompt_len, reserved)

    def head_budgets(self, layer_budget, scores, mask, protected, grouped_counts):
        H = scores.shape[1]
        held = mask.sum(dim=-1)                                    # [B, H]
        prot = (protected & mask).sum(dim=-1)                      # [B, H]
        total = layer_total(layer_budget, H)                       # [B]
        counts = grouped_counts(scores, mask, total)               # protected ones rank first
        chosen = (counts - prot).clamp_min(0)                      # B*_i (Algorithm 2)
        selectable = (total - prot.sum(dim=-1)).clamp_min(0)       # [B]
        # H times the blend, so that equal shares stay equal (x / H in floating point is not exact).
        mixed = self.alpha * H * chosen.double() + (1 - self.alpha) * selectable[:, None].double()
        return (prot + largest_remainder(mixed, selectable, denom=H)).clamp(max=held)


def largest_remainder(x: torch.Tensor, total: torch.Tensor, denom: int = 1) -> torch.Tensor:
    """Integers [B, H] near x / denom (x [B, H] >= 0) whose rows sum to total [B]: floor, then
    +1 for the largest remainders (ties to the lower head). Remainders are taken on the
    numerators x, so fractions with the same remainder tie exactly."""
    rem = torch.remainder(x, denom)                                 # exact (fmod)
    base = ((x - rem) / denom).round()
    missing = (total - base.sum(dim=-1).long()).clamp_min(0)      # [B]
    order = torch.argsort(-rem, dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1], device=x.device)
                                            .expand_as(order).contiguous())
    return base.long() + (rank < missing[:, None]).long()
