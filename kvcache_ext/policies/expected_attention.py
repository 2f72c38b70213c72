"""Expected Attention (Devoto et al., 2025): the attention future queries are expected to pay.

Queries are modelled as Gaussian: the mean and covariance of the observed queries with their
rotary position removed. A query ``t`` positions ahead is that distribution rotated by RoPE at
``t``; averaging the rotation over the next ``future`` positions gives a mean ``mu`` and a
covariance ``S`` of the queries to come, and the expected unnormalised attention to a key ``k`` is
``E[exp(s q.k)] = exp(s mu.k + s^2 k'Sk / 2)`` (the Gaussian's moment-generating function, s the
softmax scale). A token's score is that, normalised over the keys like a softmax, averaged over
the G query heads of its KV head, times ``||v||`` (a value of small norm changes the output little).
No question is needed, so the scores are query-agnostic.

Parameters (defaults: kvpress 0.5.5's ExpectedAttentionPress, which states the method in code):
``window``: the newest queries the statistics come from (None: every query of the prompt or
block after the sinks, kvpress's reading); ``future``: positions averaged over (512);
``covariance``: the ``k'Sk`` term (True); ``vnorm`` and ``epsilon``: scores ``(p + epsilon) *
||v||`` (True, 0); ``sinks``: the first tokens, kept and left out of the statistics (4).

RoPE comes from the model (``kvcache_ext.patch`` hands its rotary embedding to the cache, which
hands it to every view: ``view.model.rotary``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView, softmax_over_keys


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing of dimension i with i + D/2 (HF's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotary(rope, like: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) [B, m, D] of the model's RoPE (``rope``, its rotary embedding) at ``positions`` [B, m]."""
    if rope is None:
        raise RuntimeError("ExpectedAttention needs the model's rotary embedding: run it through "
                           "kvcache_ext.patch (its caches carry it)")
    cos, sin = rope(like, positions.clamp_min(0))
    return cos.float(), sin.float()


@dataclass
class ExpectedAttention(Scorer):
    window: int | None = None
    future: int = 512
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0
    sinks: int = 4

    capabilities = Capabilities(needs_kv=True, needs_queries=True)

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 2):
            raise ValueError(f"ExpectedAttention window must be None or an integer >= 2, got {self.window!r}")
        for name in ("future", "sinks"):
            value = getattr(self, name)
            low = 1 if name == "future" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ExpectedAttention {name} must be an integer >= {low}, got {value!r}")
        for name in ("covariance", "vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExpectedAttention {name} must be True or False, got {getattr(self, name)!r}")
        if not (isinstance(self.epsilon, (int, float)) and 0.0 <= self.epsilon < float("inf")):
            raise ValueError(f"ExpectedAttention epsilon must be a finite number >= 0, got {self.epsilon!r}")

    def default_protection(self) -> Protection:
        return Protection(sinks=self.sinks)

    def check_model(self, model) -> None:
        # It rotates whole heads with the model's one rotary embedding (rotary(x, positions)).
        if not model.one_rope:
            raise ValueError("ExpectedAttention needs one RoPE over the whole head for every layer; this "
                             "model has a RoPE per layer type (Gemma 3) or a partial rotary factor: "
                             "use another scorer")

    def prompt_scores(self, p: PromptView):
        return self.expected(p.q, p.pos, p.valid, p.k, p.v, p.valid, p.last_pos, p.scale, p.model.rotary), None

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        q_pos = view.q_pos if view.q_pos is not None else view.last_pos[:, None].expand(-1, view.q.shape[2])
        return self.expected(view.q, q_pos, q_pos >= 0, view.k, view.v, view.mask, view.last_pos,
                             view.scale, view.model.rotary)

    def expected(self, q, q_pos, q_real, k, v, k_real, last_pos, scale, rope) -> torch.Tensor:
        """[B, H, L] scores of keys k, v [B, H, L, D] (k_real [B, L] or [B, H, L]) from queries
        q [B, Hq, m, D] at q_pos [B, m] (q_real False on padding), newest position last_pos [B]."""
        B, Hq, m, D = q.shape
        H = k.shape[1]
        used = q_real & (q_pos >= self.sinks)
        if self.window is not None:   # the newest `window` real queries
            newest = used.flip(1).cumsum(dim=1).flip(1)
            used &= newest <= self.window
        cos, sin = rotary(rope, q, q_pos)
        qf = q.float()
        # Undo each query's rotation (cos^2 + sin^2 holds RoPE's attention scaling, if any).
        unrotated = (qf * cos[:, None] - rotate_half(qf) * sin[:, None]) / (cos * cos + sin * sin)[:, None]
        w = used.float()[:, None, :, None] / used.sum(dim=1).clamp_min(1).float()[:, None, None, None]
        mu = (unrotated * w).sum(dim=2)                                               # [B, Hq, D]
        # The rotation averaged over the next `future` positions of each row.
        ahead = last_pos[:, None] + 1 + torch.arange(self.future, device=q.device)
        cos_f, sin_f = rotary(rope, q, ahead)
        c, s = cos_f.mean(dim=1)[:, None], sin_f.mean(dim=1)[:, None]                 # [B, 1, D]
        mu_f = c * mu + s * rotate_half(mu)
        kf = k.float().repeat_interleave(Hq // H, dim=1)                               # [B, Hq, L, D]
        logits = scale * torch.einsum("bhd,bhld->bhl", mu_f, kf)
        if self.covariance:
            centred = (unrotated - mu[:, :, None]) * w.sqrt()
            cov = centred.transpose(2, 3) @ centred                                    # [B, Hq, D, D]
            # k' R S R' k with R' k computed on the keys (R's halves share cos and sin).
            back = c[:, :, None] * kf - s[:, :, None] * rotate_half(kf)               # R' k
            quad = ((back @ cov) * back).sum(dim=-1)                                   # [B, Hq, L]
            logits = logits + 0.5 * scale * scale * quad
        real = k_real if k_real.dim() == 3 else k_real[:, None].expand(B, H, -1)
        probs = softmax_over_keys(logits, real.repeat_interleave(Hq // H, dim=1))
        scores = probs.view(B, H, Hq // H, -1).mean(dim=2)
        if self.vnorm:
            scores = (scores + self.epsilon) * v.float().norm(dim=-1)
        return scores
