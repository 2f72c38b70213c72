"""The int8 pages' number format in plain PyTorch, the twin of csrc/store/quantize.h bit for bit.

Each row (one token's K, or its V, for one KV head) is quantized symmetrically with one float16
scale: ``scale = float16(min(max |x| / 127, 65504))``, ``q = clamp(round(x / scale), -127, 127)``
(round half to even, 0 where the scale is 0; a NaN counts as 0), ``x ~ q * scale``.
"""
from __future__ import annotations

import torch

QUANT_MAX = 127.0
MAX_SCALE = 65504.0   # the largest finite float16


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [..., D] (float32, float16 or bfloat16) as ``(q [..., D] int8, scale [...] float16)``."""
    xf = x.float()
    amax = xf.abs().nan_to_num(nan=0.0).amax(dim=-1)
    scale = torch.clamp(amax / QUANT_MAX, max=MAX_SCALE).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    q = torch.round(xf / torch.where(s > 0, s, torch.ones_like(s)))
    q = q.clamp(-QUANT_MAX, QUANT_MAX).nan_to_num(nan=0.0)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in float32, then as ``dtype``: the K and V that int8 pages give back."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as a store of int8 pages gives it back (``RaggedKVStore.k``, ``to_dense``), in x's dtype."""
    q, scale = quantize(x)
    return dequantize(q, scale, x.dtype)


def as_attended(x: torch.Tensor) -> torch.Tensor:
    """x as the attention over int8 pages sees it: step times scale in float32, which is exact
    (8 bits times 11 bits), not rounded to x's dtype."""
    q, scale = quantize(x)
    return dequantize(q, scale, torch.float32)
