"""Attention of new queries over a RaggedKVStore, with the per-slot statistics eviction reads."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from kvcache_ext import _C
from kvcache_ext.checks import real
from kvcache_ext.kernels.ops import STAT_NAMES, ops
from kvcache_ext.kernels.store import RaggedKVStore

# head_dim of the CUDA attention kernel (one instantiation each; the CPU kernels take any),
# from the list the kernel is compiled from (csrc/attention/cuda_head_dims.h).
CUDA_HEAD_DIMS = tuple(_C.CUDA_HEAD_DIMS)


def check_head_dim(head_dim: int, device) -> None:
    """Refuses, with the sizes there are, a head_dim the attention kernel of ``device`` lacks."""
    if torch.device(device).type == "cuda" and head_dim not in CUDA_HEAD_DIMS:
        sizes = ", ".join(map(str, CUDA_HEAD_DIMS[:-1])) + f" and {CUDA_HEAD_DIMS[-1]}"
        # the words of the kernel's own check (attention_cuda.cu), which refuses it at attention time
        raise ValueError(f"the CUDA attention kernel supports head_dim {sizes}, got {head_dim}; "
                         f"run this model's attention on the CPU or ask for the size")


@dataclass
class AttentionStats:
    """Softmax statistics in the store's slot layout; a field not asked for is None.

    For segment (b, h), query heads h*G .. h*G+G-1 and the n queries of the call:

    - ``mass`` [capacity] f32: probability each slot received, summed over the n queries and
      the G heads (H2O's accumulated attention).
    - ``last`` [capacity, G] f32: the last query's probability per head (TOVA, CAOTE).
    - ``sum_sq`` [capacity] f32: sum over the queries of the square of the G heads' *mean*
      probability (RoCo averages a group before squaring; equals p^2 summed for G = 1).
    - ``count`` [capacity] int32: how many of the n queries saw the slot (causal mask).

    Slots beyond each segment's length hold zeros.
    """

    mass: torch.Tensor | None = None
    last: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None
    count: torch.Tensor | None = None


def ragged_attention(q: torch.Tensor, store: RaggedKVStore, scale: float | None = None, *,
                     q_pos: torch.Tensor | None = None,
                     stats: bool | Iterable[str] = False, plan: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, AttentionStats | None]:
    """softmax(q k^T * scale) v over every live slot of the store, per (batch item, KV head).

    q [B, Hq, n, D] in the store's dtype, Hq a multiple of the store's heads (query head
    h*G + g reads KV head h, as HF's ``repeat_kv``). ``q_pos`` ([n] or [B, n] integers), when
    given, makes the attention causal by position: slot l is visible to query i iff
    ``pos[l] <= q_pos[b, i]``; without it every live slot is visible to every query. This is
    what block-wise prefill needs once the block's own tokens are appended to the store.
    ``scale`` defaults to 1/sqrt(D). A query that sees no slot gets a zero output.

    ``stats``: False (none, no extra work), True (all) or names from ``STAT_NAMES``.
    Returns ``(out [B, Hq, n, D], AttentionStats or None)``.

    Two steps, as FlashInfer splits them: ``store.attention_plan`` (host: the work partition
    from the store's host lengths, no device sync) and the ``attention_run`` op (device: the
    kernels, which ``torch.compile`` traces and a CUDA graph can capture). ``plan``, when
    given, is a plan of this store's current lengths made for q's rows (reuse one across
    calls that do not change the store, e.g. the layers of a step with equal lengths).
    """
    if not isinstance(store, RaggedKVStore):
        raise TypeError(f"store must be a kvcache_ext.RaggedKVStore, got {type(store).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor [batch, query heads, n, head_dim], got {type(q).__name__}")
    # Every decode step of every layer comes here, mostly without statistics: that case
    # builds nothing.
    flags = _NO_STATS if stats is False or stats is None else _stat_flags(stats)
    if scale is None:
        scale = 1.0 / math.sqrt(store.head_dim)
    elif type(scale) is not float:   # the common case costs one type test
        scale = real(scale, "scale", what="a finite number (the factor on q . k)")
    if q_pos is not None and not isinstance(q_pos, torch.Tensor):
        q_pos = torch.as_tensor(q_pos)
    if plan is None:
        plan = store.attention_plan(q.shape[1] // store.heads * q.shape[2] if q.dim() == 4 else 1)
    pool, table, lens = store._current()
    out, *fields = ops.attention_run(q, pool, table, lens, plan, q_pos, float(scale), store.heads,
                                     store._page_size, store._head_dim, store._channels,
                                     store._page_dtype, *flags)
    if flags is _NO_STATS:
        return out, None
    return out, AttentionStats(*(f if want else None for f, want in zip(fields, flags)))


_NO_STATS = (False,) * len(STAT_NAMES)


def _stat_flags(stats) -> tuple[bool, ...]:
    """The kernel's want_* flags for ``stats`` (``_NO_STATS`` itself when none is asked for)."""
    wanted = _stat_names(stats)
    return tuple(name in wanted for name in STAT_NAMES) if wanted else _NO_STATS


def _stat_names(stats) -> frozenset:
    if stats is True:
        return frozenset(STAT_NAMES)
    if stats is False or stats is None:
        return frozenset()
    try:
        names = frozenset([stats] if isinstance(stats, str) else stats)
    except TypeError:
        names = None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(f"stats must be True, False or names from {STAT_NAMES}, got {stats!r}")
    unknown = names - set(STAT_NAMES)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}; choose from {STAT_NAMES}")
    return names
