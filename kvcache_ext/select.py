"""Segmented top-k over the store's slot layout (CUB radix sort on GPU, radix selection on CPU)."""
from __future__ import annotations

import torch

from kvcache_ext import _C


def segmented_topk(scores: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, len: torch.Tensor,
                   k) -> torch.Tensor:
    """Keep mask [capacity] of the k[s] highest-scoring live slots of every segment s.

    scores [capacity] float32, pos [capacity] int32, start [S] int64, len [S] int32, k an int
    or [S] integers >= 0. Ties go to the lower position; NaN scores are evicted first;
    k >= len keeps the whole segment.
    """
    return _C.segmented_topk(scores, pos, start, len, _per(k, start.shape[0], start.device))


def grouped_topk(scores: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, len: torch.Tensor,
                 group_size: int, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Ada-KV's allocation: the k[g] best live slots over the group_size segments of group g.

    Returns (keep [capacity] bool, counts [S] int32 kept per segment).
    """
    groups = start.shape[0] // group_size if group_size > 0 else 0
    return _C.grouped_topk(scores, pos, start, len, group_size, _per(k, groups, start.device))


def _per(k, n: int, device) -> torch.Tensor:
    """An int budget broadcast to n entries; a tensor is passed through for the C++ checks."""
    if isinstance(k, torch.Tensor):
        return k
    if int(k) < 0:
        raise ValueError(f"k (the budget) must be >= 0, got {k}")
    # A budget beyond any segment keeps everything; int32 is what the kernels read.
    return torch.full((n,), min(int(k), 2**31 - 1), dtype=torch.int32, device=device)
