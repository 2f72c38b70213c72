"""RoCo (the "Robust Cache omission" policy of *On the Efficacy of Eviction Policy for
Key-Value Constrained Generative Language Model Inference*, Ren and Zhu, 2024): evict the token
of lowest mean attention, but only among the tokens whose attention has settled (lowest standard
deviation)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcache_ext.checks import Int, Real, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class RoCo(Scorer):
    """RoCo, per (layer, KV head), as the paper's §4.3 defines it. The paper numbers none of
    these formulas; R1-R7 are our labels (as in docs/policies.md and the tests).

    Three float32 channels per cached token, summed over every query that has attended to it
    since it entered the cache (no window, no decay; §4.3), GQA rows averaged over the G query
    heads of the group before anything is accumulated (paper App. A; the EasyKV code squares
    after averaging):

    - channel 0: G * Acc, the probability summed over the queries and the G heads (the
      kernel's ``mass``; divided by G when scored, since the accumulation does not know G), R1;
    - channel 1: Acc^2, the squares of the group-averaged probabilities (``sum_sq``), R2;
    - channel 2: Count, the queries that saw the token, its own query included (``count``;
      the paper's "attended by future tokens" leaves it open, the EasyKV code counts it), R3.

    At an eviction, MAS = Acc / Count (R4) and Std = sqrt(Acc^2 / Count - MAS^2), the
    population standard deviation (R5). The scope leaves out the r tokens of largest Std
    (R6) and the lowest-MAS tokens of the scope are evicted (R7). As a score: the r tokens
    get +inf, the others their MAS (in [0, 1]), and the engine keeps the top budget.

    Parameters:

    - ``robust``: r as a fraction of the budget B of the eviction (``view.budget``, the layer's
      average per-head budget), r = floor(robust * B). Default 0.5: "r = B/2" (paper §5.1.5,
      stated for the local window and read for the Std scope as well).
    - ``fresh``, ``sinks``: the EasyKV code's guards (not in the paper), off by default
      (paper-exact). The ``fresh`` newest positions and the positions below ``sinks`` get Std = +inf, so
      they are among the r excluded tokens (they use up part of r, as in the code).
      ``Protection(...)`` on the policy instead keeps tokens on top of r.

    Choices where the paper is silent (each documented in docs/policies.md):

    - Ties. Std ties at the r-th place go to the lower position (it is left out of the scope);
      MAS ties are kept by the lower position (the engine's selection rule). Padding is never
      among the r.
    - A token with Count = 1 has Std = 0 exactly (one sample), so a fresh token is always in
      scope and only its MAS (its own query's attention) can save it.
    - E[a^2] - E[a]^2 is clamped at 0 and Count = 0 reads as MAS = Std = 0.
    - The scope is built once per eviction, however many tokens it removes (a block; as the
      EasyKV code does).
    - One-shot prefill (``prompt_scores``): the channels are seeded from the dense causal
      attention of the prompt (EasyKV's ``keep_attention=True`` reading) and the
      prompt is evicted to the budget in one step with that scope.
    - Order of evict and append: the engine appends a block (or decode token), attends over
      cache + block, folds the block's statistics in, then evicts down to B (the EasyKV code's
      order; the new tokens are candidates). The paper's Fig. 1 evicts b tokens before
      appending (n <= B always); that makes the decisions of this engine at budget B - b with
      the same r (``robust`` scaled by B / (B - b)), except that it skips the eviction after
      the prompt's last block.
    """

    robust: float = 0.5
    fresh: int = 0
    sinks: int = 0

    capabilities = Capabilities(channels=3, accumulates=("mass", "sum_sq", "count"))

    def __post_init__(self):
        check_fields(self, "RoCo", fresh=Int(0), sinks=Int(0),
                     robust=Real(0.0, 1.0, what="a share of the budget in [0, 1] (left out of the "
                                 "eviction scope)"))

    # --- the channels ------------------------------------------------------------------------
    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        G = p.groups
        mass = torch.zeros(B, H, n, dtype=torch.float32, device=p.q.device)
        sum_sq = torch.zeros_like(mass)
        count = torch.zeros(B, n, dtype=torch.float32, device=p.q.device)
        for i0, probs in p.probs():
            c, m = probs.shape[2:]
            grouped = probs.unflatten(1, (H, G))                   # [B, H, G, c, m]
            mass[..., :m] += grouped.sum(dim=(2, 3))
            sum_sq[..., :m] += grouped.mean(dim=2).square().sum(dim=2)
            seen = (p.pos[:, None, :m] <= p.pos[:, i0:i0 + c, None]) & p.valid[:, None, :m]
            count[:, :m] += (seen & p.valid[:, i0:i0 + c, None]).sum(dim=1)
        channels = torch.stack([mass, sum_sq, count[:, None, :].expand(B, H, n)], dim=-1)
        pos = p.pos[:, None, :].expand(B, H, n)
        mask = p.valid[:, None, :].expand(B, H, n)
        return self._scores(channels, G, pos, mask, p.last_pos, p.budget), channels

    def cache_scores(self, view: CacheView):
        return self._scores(view.channels, view.groups, view.pos, view.mask, view.last_pos, view.budget)

    # --- R4-R7 as a score ----------------------------------------------------------------------
    @staticmethod
    def mas_std(channels: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """channels [..., 3] -> (MAS, Std), float64: R4 and R5 (population std)."""
        c = channels.double()
        count = c[..., 2]
        n = count.clamp_min(1)
        mas = c[..., 0] / groups / n
        var = (c[..., 1] / n - mas.square()).clamp_min(0)
        var = torch.where(count > 1, var, torch.zeros_like(var))   # one sample: exactly 0
        return mas, var.sqrt()

    def robust_count(self, budget: torch.Tensor) -> torch.Tensor:
        """r = floor(robust * B) per row ([B] int64)."""
        return torch.floor(budget.double() * self.robust).long()

    def _scores(self, channels, groups, pos, mask, last_pos, budget):
        if budget is None:
            raise ValueError("RoCo needs the eviction's budget (view.budget) to size its scope")
        mas, std = self.mas_std(channels, groups)
        if self.sinks or self.fresh:
            forced = pos < self.sinks
            if self.fresh:
                forced |= pos > (last_pos.view(-1, 1, 1) - self.fresh)
            std = std.masked_fill(forced, math.inf)
        std = std.masked_fill(~mask, -1.0)                         # padding: never among the r
        # Rank by Std, largest first; a stable sort keeps ties in position order (views are).
        order = torch.sort(std, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous())
        r = self.robust_count(budget).to(rank.device).view(-1, 1, 1)
        outside = (rank < r) & mask                                # R6: out of the eviction scope
        return mas.float().masked_fill(outside, math.inf)
