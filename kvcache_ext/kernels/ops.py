"""The kernels as torch custom ops (``torch.ops.kvcache_ext.*``), and their fake implementations.

The ops are defined in C++ (``csrc/ops.cpp``, ``TORCH_LIBRARY(kvcache_ext, ...)``) with CPU and
CUDA implementations; importing this module (``kvcache_ext`` does) registers the fake (meta)
implementations that ``torch.compile`` and ``torch.library.opcheck`` trace with. Every op takes
tensors and numbers only. A layer's store is the state

- ``pool``: its slabs of pages, a list of uint8 ``[pages_i, record bytes]`` tensors (mutated by
  the store ops),
- ``page_table``: ``[S, width]`` int32, the pages of each segment in token order,
- ``len``: ``[S]`` int32 live tokens per segment (mutated by append and compact),

which the Python ``RaggedKVStore`` holds and passes to the ops (``RaggedKVStore.state``). An op's
``dtype`` (``kv_dtype``) is what the pages hold: float32, float16 or bfloat16 (the dtype of the K, V
and q handed in), or int8 (quantized pages: K, V and q of any of those dtypes).

====================  ==========================================================================
op                    what it does
====================  ==========================================================================
``store_append``      writes k, v [B, H, n, D] (and pos) after each segment's tokens; len += n
``store_check``       per segment, whether len and page_table are consistent with the pool (no sync)
``store_replace``     overwrites token slot[b, h] of each segment with one new token
``store_compact``     in-place removal of the slots whose keep flag is False (stable, or one move
                      per evicted token); new len
``store_add_scores``  adds [capacity] values to one score channel of every slot, in the pages
``store_topk``        keep mask and counts of the k best tokens per segment or group, through the
                      pages (scores given, channel 0, or a slot rule with protected tokens)
``segmented_topk``    keep mask of the k best slots per contiguous segment
``grouped_topk``      Ada-KV: the k best over each group of segments, and the counts per segment
``attention_run``     attention of q over the store with the plan of ``attention_plan``
``store_decode_step`` a decode step: append one token per segment, attend, add statistics to
                      score channels, evict by a slot rule (the ops above, in one call)
====================  ==========================================================================

``RaggedKVStore.attention_plan`` (the page allocator's host step) makes the plan of the attention:
it reads the lengths on the host and returns the work partition (CPU: the lengths; CUDA: the
splits, on the device), once per step and layer. It is not an op (its output size depends on
the lengths), so a compiled region breaks there.

Devices. The C++ ops check the device of every tensor they are handed. The fake implementations
below run instead when one of the inputs is on the ``meta`` device (the dispatcher picks the Meta
kernel then), so they refuse a real meta tensor mixed with tensors on a real device, naming it;
under ``FakeTensorMode`` (``torch.compile``, ``opcheck``) the inputs report their real devices,
and an op called on meta tensors only (shape inference) runs its fake as usual.
"""
from __future__ import annotations

import torch

from kvcache_ext import _C  # noqa: F401  (loads the library that defines the ops)

OPS = ("store_append", "store_check", "store_replace", "store_compact", "store_add_scores", "store_topk",
       "segmented_topk", "grouped_topk", "attention_run", "store_decode_step")

ops = torch.ops.kvcache_ext

# The attention's statistics, in the order attention_run and store_decode_step return them.
STAT_NAMES = ("mass", "last", "sum_sq", "count")


def _refuse_meta_mix(copied: tuple = (), **named) -> None:
    """A ValueError naming the first real meta tensor among ``named`` (name -> tensor, None or a
    list of tensors, the state first) when others are on a real device: the dispatcher runs
    this fake then, and the op would silently do nothing. ``copied``: the names the op copies
    to the state's device itself (positions, slots, budgets), which may also be on the CPU. An
    op called on meta tensors only (shape inference) passes."""
    tensors = [(name, t) for name, value in named.items()
               for t in (value if isinstance(value, (list, tuple)) else (value,))
               if isinstance(t, torch.Tensor)]
    real = [t.device for _, t in tensors if t.device.type != "meta"]
    if not real or len(real) == len(tensors):
        return
    name = next(name for name, t in tensors if t.device.type == "meta")
    where = str(real[0]) + (" or the CPU" if name in copied and real[0].type != "cpu" else "")
    raise ValueError(f"{name} must be on {where} (the device of the op's other tensors), got a "
                     f"tensor on meta (which holds no data: the op would change nothing)")


def _capacity(pool, page_size: int):
    return sum(slab.shape[0] for slab in pool) * page_size


@torch.library.register_fake("kvcache_ext::store_append")
def _store_append_fake(pool, page_table, len, k, v, pos, rank, counts, page_size, score_channels, kv_dtype=None):
    _refuse_meta_mix(("pos",), page_table=page_table, pool=pool, len=len, k=k, v=v, pos=pos,
                     rank=rank, counts=counts)
    return None


@torch.library.register_fake("kvcache_ext::store_check")
def _store_check_fake(pool, page_table, len, page_size, head_dim, score_channels, dtype):
    _refuse_meta_mix(page_table=page_table, pool=pool, len=len)
    return torch.empty_like(len)


@torch.library.register_fake("kvcache_ext::store_replace")
def _store_replace_fake(pool, page_table, len, slot, k, v, pos, page_size, head_dim,
                        score_channels, dtype, check_bounds):
    _refuse_meta_mix(("slot", "pos"), page_table=page_table, pool=pool, len=len, slot=slot, k=k,
                     v=v, pos=pos)
    return None


@torch.library.register_fake("kvcache_ext::store_compact")
def _store_compact_fake(pool, page_table, len, keep, page_size, head_dim, score_channels, dtype, stable=True):
    _refuse_meta_mix(page_table=page_table, pool=pool, len=len, keep=keep)
    return None


@torch.library.register_fake("kvcache_ext::store_add_scores")
def _store_add_scores_fake(pool, page_table, len, values, channel, page_size, head_dim, score_channels, dtype):
    _refuse_meta_mix(page_table=page_table, pool=pool, len=len, values=values)
    return None


@torch.library.register_fake("kvcache_ext::store_topk")
def _store_topk_fake(pool, page_table, len, scores, k, group_size, page_size, head_dim,
                     score_channels, dtype, rule=None, sinks=0, recent=0, last_pos=None):
    _refuse_meta_mix(("k",), page_table=page_table, pool=pool, len=len, scores=scores, k=k,
                     last_pos=last_pos)
    capacity = _capacity(pool, page_size)
    return (page_table.new_empty((capacity,), dtype=torch.bool),
            page_table.new_empty((page_table.shape[0],), dtype=torch.int32))


@torch.library.register_fake("kvcache_ext::segmented_topk")
def _segmented_topk_fake(scores, pos, start, len, k, check_values=True):
    _refuse_meta_mix(("k",), scores=scores, pos=pos, start=start, len=len, k=k)
    return torch.empty_like(scores, dtype=torch.bool)


@torch.library.register_fake("kvcache_ext::grouped_topk")
def _grouped_topk_fake(scores, pos, start, len, group_size, k, check_values=True):
    _refuse_meta_mix(("k",), scores=scores, pos=pos, start=start, len=len, k=k)
    return torch.empty_like(scores, dtype=torch.bool), torch.empty_like(len)


@torch.library.register_fake("kvcache_ext::attention_run")
def _attention_run_fake(q, pool, page_table, len, plan, q_pos, scale, kv_heads, page_size, head_dim,
                        score_channels, dtype, mass, last, sum_sq, count):
    _refuse_meta_mix(("q_pos",), page_table=page_table, pool=pool, len=len, plan=plan, q=q,
                     q_pos=q_pos)
    capacity = _capacity(pool, page_size)
    groups = q.shape[1] // kv_heads

    def stat(wanted, shape, dtype=torch.float32):
        return torch.empty(shape if wanted else (0,), dtype=dtype, device=q.device)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (out, stat(mass, (capacity,)), stat(last, (capacity, groups)),
            stat(sum_sq, (capacity,)), stat(count, (capacity,), torch.int32))


@torch.library.register_fake("kvcache_ext::store_decode_step")
def _store_decode_step_fake(pool, page_table, len, q, k, v, pos, rank, counts, plan, q_pos, scale, page_size,
                            score_channels, mass, last, sum_sq, count, accumulate, rule=None, sinks=0, recent=0,
                            last_pos=None, budget=None, kv_dtype=None):
    _refuse_meta_mix(("pos", "q_pos", "budget"), page_table=page_table, pool=pool, len=len, q=q, k=k, v=v,
                     pos=pos, rank=rank, counts=counts, plan=plan, q_pos=q_pos, last_pos=last_pos, budget=budget)
    return _attention_run_fake(q, pool, page_table, len, plan, q_pos, scale, k.shape[1], page_size, k.shape[3],
                               score_channels, k.dtype, mass, last, sum_sq, count)
