"""PyramidKV's layer schedule: more budget to the shallow layers, less to the deep ones."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.checks import Int, check_fields
from kvcache_ext.policies.allocation import Allocation


@dataclass
class Pyramid(Allocation):
    """Per-head budget of layer l falls linearly from ``max`` (layer 0) to ``min`` (last layer),
    averaging the policy's budget over the layers.

    The Ada-KV paper gives no formula (Feng et al., 2024, §3.6: "pre-set hyper-parameters");
    this is the schedule of the public Ada-KV code that implements Ada-Pyramid (its
    ``pyram_mode``, ``pyram_beta``), applied to the budget that is
    left after the protected tokens (its "prefix" budget): min = b // beta, max = 2b - min;
    if max >= the prompt's unprotected length n, then max = n and min = 2b - max;
    step = (max - min) // (layers - 1); layer l keeps max - l * step. ``beta`` = 20 as there.
    A model of one layer keeps the budget.
    """

    beta: int = 20

    def __post_init__(self):
        check_fields(self, "Pyramid", beta=Int(1))

    def layer_budget(self, budget, layer_idx, num_layers, prompt_len, reserved):
        if num_layers <= 1:
            return budget      # a single layer: the average over the layers is the budget itself
        b = (budget - reserved).clamp_min(0)
        n = (prompt_len - reserved).clamp_min(0)
        lo = b // self.beta
        hi = 2 * b - lo
        capped = hi >= n
        hi = torch.where(capped, n, hi)
        lo = torch.where(capped, 2 * b - hi, lo)
        step = (hi - lo) // (num_layers - 1)
        return (hi - layer_idx * step).clamp_min(0) + reserved
