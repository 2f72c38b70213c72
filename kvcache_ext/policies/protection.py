"""Tokens a policy never evicts: attention sinks (the first tokens) and a recent window."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.checks import Int, check_fields


@dataclass(frozen=True)
class Protection:
    """``sinks``: positions 0 .. sinks-1 (StreamingLLM's attention sinks).
    ``recent``: the ``recent`` newest positions of each row (SnapKV's observation window).

    Protected tokens get an infinite score, so they are kept and count toward the budget.
    """

    sinks: int = 0
    recent: int = 0

    def __post_init__(self):
        check_fields(self, "Protection", sinks=Int(0), recent=Int(0))
        if self.size >= 2**31 - 1:
            raise ValueError(f"Protection sinks + recent must be below 2^31 - 1 (a budget must exceed "
                             f"them), got {self.sinks} + {self.recent}")

    @property
    def size(self) -> int:
        return self.sinks + self.recent

    def mask(self, pos: torch.Tensor, last_pos: torch.Tensor) -> torch.Tensor:
        """pos [B, H, L] positions, last_pos [B] newest position per row -> protected [B, H, L].
        Also elementwise: pos [capacity] in slot layout with last_pos [capacity], each slot's
        row's newest position (what a slot rule's eviction computes in the store:
        csrc/select/slot_rule.h)."""
        return (pos < self.sinks) | newest(pos, last_pos, self.recent)

    def apply(self, scores: torch.Tensor, pos: torch.Tensor, last_pos: torch.Tensor,
              held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every selection of the engine starts from: ``(scores, protected)``, the scores
        [B, H, L] as float32 with the protected tokens' at +inf, and ``protected`` [B, H, L],
        the tokens among ``held`` (bool, the real ones) that this protection keeps. ``pos``
        [B, H, L] positions; ``last_pos`` [B] the newest position of each row."""
        protected = self.mask(pos, last_pos) & held
        return scores.float().masked_fill(protected, float("inf")), protected


def newest(pos: torch.Tensor, last_pos: torch.Tensor, count: int) -> torch.Tensor:
    """pos [B, ...] -> bool: the ``count`` newest positions of each row (last_pos [B])."""
    if count <= 0:
        return torch.zeros_like(pos, dtype=torch.bool)
    return pos > (last_pos.view((-1,) + (1,) * (pos.dim() - 1)) - count)
