"""Segmented top-k over the store's slot layout: the radix selection of csrc/select/radix_select.h,
on CPU and CUDA alike (one CTA or a team of CTAs per segment or group on CUDA)."""
from __future__ import annotations

import math

import torch

from kvcache_ext.kernels.ops import ops   # torch ops, not the pybind functions: torch.compile traces them
from kvcache_ext.checks import INT32_MAX, integer, tensor


def segmented_topk(scores: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, len: torch.Tensor,
                   k) -> torch.Tensor:
    """Keep mask [capacity] of the k[s] highest-scoring live slots of every segment s.

    scores [capacity] float32, pos [capacity] int32, start [S] int64, len [S] int32, k an int
    or [S] integers >= 0. Ties go to the lower position; NaN scores are evicted first;
    k >= len keeps the whole segment.
    """
    _check_slots(scores, pos, start, len)
    return ops.segmented_topk(scores, pos, start, len, _per(k, start.shape[0], start.device))


def grouped_topk(scores: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, len: torch.Tensor,
                 group_size: int, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Ada-KV's allocation: the k[g] best live slots over the group_size segments of group g.

    Returns (keep [capacity] bool, counts [S] int32 kept per segment).
    """
    _check_slots(scores, pos, start, len)
    group_size = integer(group_size, "group_size", 1)
    groups = start.shape[0] // group_size
    return ops.grouped_topk(scores, pos, start, len, group_size, _per(k, groups, start.device))


def _check_slots(scores, pos, start, len) -> None:
    """Tensors all; scores and pos both per slot: a length that differs is either's."""
    for name, value in (("scores", scores), ("pos", pos), ("start", start), ("len", len)):
        tensor(value, name)
    if scores.dim() == 1 and pos.dim() == 1 and scores.shape[0] != pos.shape[0]:
        raise ValueError(f"scores and pos must both be [capacity], one entry per slot; got scores of "
                         f"length {scores.shape[0]} and pos of length {pos.shape[0]}")


def _per(k, n: int, device) -> torch.Tensor:
    """An int budget broadcast to n entries; a tensor is passed through for the C++ checks."""
    if isinstance(k, torch.Tensor):
        return k
    # A budget beyond any segment keeps everything; int32 is what the kernels read.
    k = min(integer(k, "k (the budget)", 0, None), INT32_MAX)
    return torch.full((n,), k, dtype=torch.int32, device=device)


def budget_tensor(k, shape: tuple, device) -> torch.Tensor:
    """``RaggedKVStore.select``'s k: an int for every entry, or an integer tensor of ``shape``
    (or one that broadcasts to it), flattened."""
    if not isinstance(k, torch.Tensor):
        return _per(k, math.prod(shape), device)
    if k.dtype == torch.bool or k.is_floating_point() or k.is_complex():
        raise TypeError(f"k (the budget) must be an int or an integer tensor, got a {k.dtype} tensor")
    try:
        return k.expand(shape).reshape(-1)
    except RuntimeError:
        raise ValueError(f"k (the budget) must be an int or an integer tensor of shape {list(shape)}, "
                         f"got shape {list(k.shape)}") from None
