"""ScissorHands (Liu et al., 2023) as the RoCo paper defines it: accumulated quantized
attention (AQAS) outside a local window."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcache_ext.checks import Bool, Real, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class ScissorHands(Scorer):
    """The RoCo paper's ScissorHands baseline (Ren and Zhu, 2024, §4.1, Table 1, §5.1.4):
    the score of a token is the number of queries that gave it more than their average
    attention, AQAS(j) = sum_t 1[a_{t,j} > 1 / n_t] (R10, our label; n_t = the keys query t
    sees, so its row's mean is 1 / n_t), and the lowest AQAS outside the local window of the r newest
    tokens is evicted. This is the paper's definition, not the original ScissorHands
    algorithm (no history window; the paper describes none).

    - GQA: a_{t,j} is the group-averaged probability (paper App. A, the rule RoCo uses); the
      G query heads of a group see the same keys, so n_t is the group's.
    - ``window``: r as a fraction of the budget B of the eviction (``view.budget``), r =
      floor(window * B); default 0.5, "r = B/2 following H2O" (paper §5.1.5). The r newest
      positions of each row score +inf.
    - ``inclusive``: whether a_{t,j} = 1 / n_t counts as above average. The paper does not say
      (§4.1: "1 indicating above average"); default False, "above average" read strictly (the
      first EasyKV commit counted >=).
    - Ties of AQAS (integers, frequent) keep the lower position (the engine's rule).

    One float32 channel, AQAS. The indicator needs each query's row, which the kernel's
    statistics (sums over the queries) cannot give, so over the cache (block-wise prefill,
    decode-time eviction) the scorer recomputes the softmax of the call's queries over the
    cached keys in ``update_view`` (float32, causal by position, blind to padding): one more
    attention per call. One-shot prefill counts over the dense prompt.
    """

    window: float = 0.5
    inclusive: bool = False

    capabilities = Capabilities(channels=1, updates_from_view=True, needs_kv=True, needs_queries=True)

    def __post_init__(self):
        check_fields(self, "ScissorHands", inclusive=Bool(),
                     window=Real(0.0, 1.0, what="a share of the budget in [0, 1] (the local window)"))

    def _above(self, a: torch.Tensor, n_t: torch.Tensor) -> torch.Tensor:
        """a [..., c, L] group-averaged rows, n_t [..., c] keys seen -> a > 1 / n_t (or >=)."""
        mean = (1.0 / n_t.clamp_min(1).to(a.dtype))[..., None]
        return a >= mean if self.inclusive else a > mean

    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        G = p.groups
        aqas = torch.zeros(B, H, n, dtype=torch.float32, device=p.q.device)
        for i0, probs in p.probs():
            c, m = probs.shape[2:]
            a = probs.unflatten(1, (H, G)).mean(dim=2)                  # [B, H, c, m]
            seen = (p.pos[:, None, :m] <= p.pos[:, i0:i0 + c, None]) & p.valid[:, None, :m]
            seen &= p.valid[:, i0:i0 + c, None]                        # [B, c, m]
            above = self._above(a, seen.sum(dim=-1)[:, None]) & seen[:, None]
            aqas[..., :m] += above.sum(dim=2)
        pos = p.pos[:, None, :].expand(B, H, n)
        return self._scores(aqas, pos, p.last_pos, p.budget), aqas.unsqueeze(-1)

    def update_view(self, view: CacheView) -> torch.Tensor:
        H, G = view.pos.shape[1], view.groups
        channels = view.channels.clone()
        for i0, probs in view.probs():
            a = probs.unflatten(1, (H, G)).mean(dim=2)                   # [B, H, c, L]
            visible = view.mask[:, :, None, :]                           # [B, H, 1 or c, L]
            if view.q_pos is not None:
                q_pos = view.q_pos[:, i0:i0 + a.shape[2]]
                # A padding query (q_pos -1) sees no token: positions are >= 0.
                visible = visible & (view.pos[:, :, None, :] <= q_pos[:, None, :, None])
            visible = visible.expand_as(a)
            channels[..., 0] += (self._above(a, visible.sum(dim=-1)) & visible).sum(dim=2)
        return channels

    def cache_scores(self, view: CacheView):
        return self._scores(view.channels[..., 0], view.pos, view.last_pos, view.budget)

    def _scores(self, aqas, pos, last_pos, budget):
        if budget is None:
            raise ValueError("ScissorHands needs the eviction's budget (view.budget) to size its window")
        r = torch.floor(budget.double() * self.window).long().to(aqas.device).view(-1, 1, 1)
        recent = pos > (last_pos.view(-1, 1, 1) - r)                   # the local window
        return aqas.float().masked_fill(recent, math.inf)
