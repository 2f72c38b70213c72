"""The correctness risks of issue 42 that live between the host and the device:

- a stale attention plan (made for other lengths): the same result on a CUDA store (the kernel
  reads each segment's last split up to its current length: attention/attention_plan.h; no
  host sync could check it) as on a CPU store (tests/test_ops.py,
  test_a_stale_attention_plan_gives_the_same_result_on_cpu), a plan of another store
  (another number of segments) refused there as NaN rows; the plan rules themselves are tested
  on the host by the gtest AttentionPlan.*;
- an inconsistent page_table / len: the ops refuse it on CPU; on CUDA they trust it, and the
  ``store_check`` op (``RaggedKVStore.validate``) is the opt-in check, on both devices;
- the page-address cache of the ops (csrc/ops.cpp), keyed by stream: ops on two streams.
"""
import pytest
import torch
from torch.library import opcheck

import kvcache_ext
from kvcache_ext.kernels.ops import ops
from conftest import DEVICES

CUDA = "cuda" in DEVICES
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU and the CUDA kernels")


def filled(device, batch=2, heads=2, length=300, D=64, dtype=torch.float16, seed=0, page_size=16):
    gen = torch.Generator().manual_seed(seed)
    store = kvcache_ext.RaggedKVStore(batch, heads, D, dtype=dtype, device=device, page_size=page_size)
    kv = torch.randn(batch, heads, length, D, generator=gen).to(dtype)
    store.append(kv.to(device), (kv * 0.5).to(device), torch.arange(length).to(device))
    return store, gen


def _changes(store, gen, device):
    """What may happen to a store between a plan and its use: a segment grows (decode steps,
    a block), shrinks (compaction), empties, and is refilled."""
    kv = torch.randn(store.batch, store.heads, 200, store.head_dim, generator=gen).to(store.dtype).to(device)
    yield "grown by 200", lambda: store.append(kv, kv, torch.arange(1000, 1200).to(device))
    keep = (torch.rand(store.capacity, generator=gen) < 0.3).to(device)
    yield "compacted to 30 %", lambda: store.compact(keep)
    empty = store.from_padded(torch.zeros(store.batch, store.heads, 1, dtype=torch.bool,
                                          device=device).expand(-1, -1, max(store.lens.max().item(), 1)), False)
    yield "emptied", lambda: store.compact(empty)
    yield "refilled by 200", lambda: store.append(kv, kv, torch.arange(2000, 2200).to(device))


@needs_cuda
def test_a_stale_plan_gives_the_same_result_on_cuda():
    store, gen = filled("cuda", length=3000)
    q = torch.randn(2, 4, 3, 64, generator=gen).half().cuda()
    for what, change in _changes(store, gen, "cuda"):
        stale = store.attention_plan(4 * 3)
        change()
        fresh, fresh_stats = kvcache_ext.ragged_attention(q, store, stats=True)
        old, old_stats = kvcache_ext.ragged_attention(q, store, stats=True, plan=stale)
        # Other splits sum in another order: equal up to rounding, never a token dropped.
        torch.testing.assert_close(old, fresh, atol=2e-3, rtol=2e-3, msg=what)
        for name in ("mass", "sum_sq", "count"):
            torch.testing.assert_close(getattr(old_stats, name), getattr(fresh_stats, name),
                                       atol=1e-4, rtol=1e-3, msg=f"{what}: {name}")


@needs_cuda
def test_a_plan_of_another_store_gives_nan_rows_on_cuda():
    """A plan of S + 3 segments fits the host's size check of S segments (3 more words per
    segment's split): the device sees its last word is not S and refuses it loudly."""
    store, gen = filled("cuda", batch=1, heads=2)
    other, _ = filled("cuda", batch=1, heads=5)
    q = torch.randn(1, 4, 1, 64, generator=gen).half().cuda()
    out, stats = kvcache_ext.ragged_attention(q, store, stats=["mass"], plan=other.attention_plan(2))
    assert torch.isnan(out).all()
    assert not stats.mass.any()        # no statistics from a refused plan
    bad = other.attention_plan(2)[:-1]  # a size that cannot be a plan of 2 segments
    with pytest.raises(ValueError, match="does not fit 2 segments"):
        kvcache_ext.ragged_attention(q, store, plan=bad)


def _corrupt(device):
    """A consistent store, and its (table, len) with each kind of fault: (codes wanted, table, len)."""
    store, _ = filled(device, batch=2, heads=2, length=40)
    pool, table, lens = store.state()
    cases = []
    t = table.clone(); t[1, 0] = -1
    cases.append(([0, 3, 0, 0], t, lens.clone()))                 # page -1 under live tokens
    t = table.clone(); t[2, 1] = store.num_pages
    cases.append(([0, 0, 3, 0], t, lens.clone()))                 # a page past the pool
    n = lens.clone(); n[3] = -5
    cases.append(([0, 0, 0, 1], table.clone(), n))                 # a negative length
    n = lens.clone(); n[0] = table.shape[1] * store.page_size + 1
    cases.append(([2, 0, 0, 0], table.clone(), n))                 # more pages than columns
    return store, pool, cases


@pytest.mark.parametrize("device", DEVICES)
def test_store_check_names_each_fault_without_a_sync(device):
    store, pool, cases = _corrupt(device)
    meta = (store.page_size, store.head_dim, store.score_channels, store.dtype)
    _, table, lens = store.state()
    assert ops.store_check(pool, table, lens, *meta).tolist() == [0, 0, 0, 0]
    store.validate()
    for want, bad_table, bad_len in cases:
        codes = ops.store_check(pool, bad_table, bad_len, *meta)
        assert codes.device == lens.device and codes.dtype == torch.int32
        assert codes.tolist() == want
        if device == "cpu":   # the ops themselves refuse it on CPU
            with pytest.raises(ValueError):
                ops.store_compact(pool, bad_table, bad_len, torch.ones(store.capacity, dtype=torch.bool),
                                  *meta)
    # validate() raises, naming the segment and the fault.
    want, bad_table, bad_len = cases[0]
    store._current = lambda: (pool, bad_table, bad_len)
    with pytest.raises(ValueError, match=r"segment 1 \(batch 0, head 1\): a page its live tokens lie in"):
        store.validate()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_check(device):
    store, pool, cases = _corrupt(device)
    _, table, lens = store.state()
    opcheck(ops.store_check, (pool, table, lens, store.page_size, store.head_dim, store.score_channels,
                              store.dtype), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_cuda
def test_cuda_ops_on_two_streams_read_their_own_page_addresses():
    """A pool seen first on a side stream: its page addresses are copied up on that stream, so
    the kernels there read them after the copy; the default stream gets its own copy."""
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 64, generator=gen).half().cuda()
    for trial in range(3):
        store, _ = filled("cuda", length=500 + 17 * trial, seed=trial)   # a new pool each time
        torch.cuda.current_stream().synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side, _ = kvcache_ext.ragged_attention(q, store)
            keep = torch.ones(store.capacity, dtype=torch.bool, device="cuda")
            store.compact(keep)                                  # every token kept: nothing changes
        torch.cuda.current_stream().wait_stream(side)
        on_default, _ = kvcache_ext.ragged_attention(q, store)
        torch.testing.assert_close(on_side, on_default, atol=0, rtol=0)
