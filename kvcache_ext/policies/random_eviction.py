"""Random eviction: the floor every scorer must beat."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.checks import INT64_MAX, Int, check_fields
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView

_MASK32 = 0xFFFFFFFF


def position_hash(pos: torch.Tensor, head: torch.Tensor, layer: int, seed: int) -> torch.Tensor:
    """A uniform [0, 1) number per (seed, layer, head, position): the same token gets the same
    score wherever it is stored, so the ragged and the reference paths evict alike."""
    x = (pos.long() * 0x9E3779B1 + head.long() * 0x85EBCA77 + layer * 0xC2B2AE3D + seed) & _MASK32
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        x = ((x ^ (x >> shift)) * mult) & _MASK32
    # Hashes within 2^-25 of 2^32 would round up to 1.0 in float32: keep them below 1.
    return x.double().div(2.0**32).float().clamp_max(1.0 - 2.0**-24)


@dataclass
class Random(Scorer):
    """Every token gets a pseudo-random score from (seed, layer, KV head, position)."""

    seed: int = 0

    def __post_init__(self):
        check_fields(self, "Random", seed=Int(0, INT64_MAX))

    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        head = _heads(H, p.model.ranks, p.pos.device)
        return position_hash(p.pos[:, None, :], head, p.layer_idx, self.seed).expand(B, H, n), None

    def cache_scores(self, view: CacheView):
        head = _heads(view.pos.shape[1], view.model.ranks, view.pos.device)
        return position_hash(view.pos, head, view.layer_idx, self.seed)


def _heads(H: int, ranks, device) -> torch.Tensor:
    """[1, H, 1] the model's index of each KV head held: under tensor parallelism a rank holds
    the heads from rank * H on, so that a token's score is one process's."""
    first = 0 if ranks is None else ranks.rank * H
    return torch.arange(first, first + H, device=device).view(1, H, 1)
