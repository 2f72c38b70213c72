"""A policy = scorer + allocation + schedule + protection, with a budget."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.policies.allocation import Allocation
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.schedule import Schedule
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.uniform import Uniform


@dataclass
class Policy:
    """How a patched model evicts.

    ``budget``: tokens kept per KV head (the average over heads and layers when the allocation
    is adaptive or pyramidal), or ``ratio``: that budget as a fraction of each prompt's length
    (rounded up). Exactly one of the two. ``protection`` defaults to the scorer's own
    (StreamingLLM's sinks, SnapKV's window, H2O's recent window).
    """

    scorer: Scorer
    budget: int | None = None
    ratio: float | None = None
    allocation: Allocation = field(default_factory=Uniform)
    schedule: Schedule = field(default_factory=Schedule)
    protection: Protection | None = None

    def __post_init__(self):
        if not isinstance(self.scorer, Scorer):
            raise TypeError(f"scorer must be a kvcache_ext.policies scorer, got {self.scorer!r}")
        if not isinstance(self.allocation, Allocation):
            raise TypeError(f"allocation must be a kvcache_ext.policies allocation, got {self.allocation!r}")
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be a kvcache_ext.policies.Schedule, got {self.schedule!r}")
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("give exactly one of budget= (tokens per KV head) or ratio= (of the prompt)")
        if self.budget is not None and (isinstance(self.budget, bool) or int(self.budget) != self.budget
                                        or self.budget < 1):
            raise ValueError(f"budget must be a positive integer (tokens per KV head), got {self.budget!r}")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.protection is None:
            self.protection = self.scorer.default_protection()
        if self.budget is not None and self.budget <= self.protection.size:
            raise ValueError(f"budget {self.budget} leaves no room beyond the {self.protection.size} "
                             f"protected tokens ({self.protection}); raise the budget")
        target = self.schedule.decode_target
        if target is not None and target <= self.protection.size:
            raise ValueError(f"decode_target {target} must exceed the {self.protection.size} protected tokens")
        self.scorer.check_policy(self)
        layers = getattr(self.allocation, "layers", self.allocation)
        if getattr(layers, "whole_model", False) and not self.scorer.reconstructs:
            raise ValueError(f"{type(layers).__name__} splits the budget by every layer's scores at once, which "
                             f"only a scorer that reconstructs the prompt (KVzip) has; {type(self.scorer).__name__} "
                             "scores one layer at a time")

    def budget_for(self, prompt_len: torch.Tensor) -> torch.Tensor:
        """[B] tokens per KV head for prompts of prompt_len [B] tokens."""
        if self.budget is not None:
            return torch.full_like(prompt_len, int(self.budget))
        return torch.ceil(prompt_len.double() * self.ratio).long().clamp_min(self.protection.size + 1)

    def __repr__(self) -> str:
        size = f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio}"
        return (f"Policy({self.scorer}, {size}, allocation={self.allocation}, "
                f"schedule={self.schedule}, protection={self.protection})")
