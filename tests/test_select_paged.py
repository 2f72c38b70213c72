"""RaggedKVStore.select as one store_topk op on either device: long segments (several radix
digits; on CUDA a team of CTAs per segment or group when there are few of them), ties broken
by position and then by candidate order, and CUDA's budget rule (k clamped on the device, no
host sync). The CUDA cases skip without a GPU."""
from __future__ import annotations

import pytest
import torch

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES

CUDA = "cuda" in DEVICES


def long_store(device, B, H, n, seed):
    """A store of B x H segments of about n tokens (ragged: each keeps 90 % of its tokens), with
    positions 0, 1, ... shared by the heads of a row, and pages interleaved between heads."""
    gen = torch.Generator().manual_seed(seed)
    store = kvcache_ext.RaggedKVStore(B, H, 4, dtype=torch.bfloat16, device=device, page_size=16)
    for block in range(2):  # two appends: each segment's pages are not contiguous
        kv = torch.randn(B, H, n // 2, 4, generator=gen).bfloat16()
        valid = torch.rand(B, H, n // 2, generator=gen) < 0.9
        store.append(kv.to(device), kv.to(device),
                     torch.arange(block * n // 2, (block + 1) * n // 2).to(device), valid.to(device))
    return store, gen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,n", [(1, 2, 5000), (2, 1, 3000), (1, 8, 600)])
@pytest.mark.parametrize("kind", ["bf16", "few_values", "one_value", "nan_and_inf"])
def test_long_segments_through_pages_match_the_reference(device, B, H, n, kind):
    store, gen = long_store(device, B, H, n, seed=B * 100 + H)
    dense = store.to_dense()
    S, L = B * H, dense.mask.shape[-1]
    lens, pos = dense.lens.cpu(), dense.pos.cpu().reshape(S, L)
    if kind == "bf16":
        scores = torch.randn(B, H, L, generator=gen).bfloat16().float()
    elif kind == "few_values":
        scores = torch.randint(0, 4, (B, H, L), generator=gen).float()
    elif kind == "one_value":
        scores = torch.full((B, H, L), -0.0)
    else:
        scores = torch.randn(B, H, L, generator=gen)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")])
        pick = torch.randint(0, 8, (B, H, L), generator=gen)
        scores = torch.where(pick < 4, special[pick.clamp(max=3)], scores)
    flat = store.from_padded(scores.to(device), 0.0)
    for frac in (0.0, 0.125, 0.5, 0.99, 1.0):
        k = (lens.view(B, H).float() * frac).long()
        keep = store.select(k.to(device), flat)
        want = reference.segmented_topk(scores.view(S, L), pos, lens.view(S), k.view(S))
        assert torch.equal(store.to_padded(keep, False).cpu(), want.view(B, H, L)), frac
        assert int(keep.sum()) == int(want.sum())
        kg = (lens.view(B, H).sum(1).float() * frac).long()
        keep, counts = store.select(kg.to(device), scores.to(device), grouped=True)
        want, want_counts = reference.grouped_topk(scores.view(S, L), pos, lens.view(S), H, kg)
        assert torch.equal(store.to_padded(keep, False).cpu(), want.view(B, H, L)), frac
        assert torch.equal(counts.cpu(), want_counts.view(B, H)), frac


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the CUDA kernels")
def test_cuda_budget_is_clamped_on_the_device():
    """On CUDA nothing is read back: a negative budget keeps nothing, one past the live tokens
    keeps them all (on CPU a negative budget is refused: test_store.py)."""
    store, gen = long_store("cuda", 1, 3, 40, seed=1)
    scores = torch.rand(store.capacity, device="cuda")
    live = store.from_padded(store.to_dense().mask, False)
    keep = store.select(torch.tensor([[-5, 2**31 - 1, 0]], device="cuda"), scores)
    kept = store.to_padded(keep, False)
    assert not kept[0, 0].any() and not kept[0, 2].any()
    assert torch.equal(kept[0, 1], store.to_padded(live, False)[0, 1])
    keep, counts = store.select(torch.tensor([-1], device="cuda"), scores, grouped=True)
    assert not keep.any() and not counts.any()


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("grouped", [False, True])
def test_cuda_select_is_one_op_without_host_sync(grouped):
    """torch.cuda.set_sync_debug_mode('error') raises on any synchronizing call: select with
    scores from the pages, in slot layout and padded, per segment and grouped."""
    store, _ = long_store("cuda", 2, 2, 300, seed=2)
    store_c = kvcache_ext.RaggedKVStore(2, 2, 4, dtype=torch.bfloat16, device="cuda", score_channels=1)
    kv = torch.randn(2, 2, 50, 4, device="cuda").bfloat16()
    store_c.append(kv, kv, torch.arange(50, device="cuda"))
    per = (2,) if grouped else (2, 2)
    k = torch.full(per, 30, device="cuda")
    flat = torch.rand(store.capacity, device="cuda")
    padded = torch.rand(2, 2, 300, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s, given in ((store, flat), (store, padded), (store_c, None)):
            s.select(k, given, grouped=grouped)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("B,H,n,frac", [(1, 32, 4096, 1 / 8), (1, 32, 32768, 1 / 8), (4, 8, 4096, 1 / 8),
                                        (1, 2, 32768, 1 / 8), (1, 4, 32768, 1 / 2)])
@pytest.mark.parametrize("scores_kind", ["randn", "bf16"])
def test_cuda_select_at_benchmark_scale_equals_cpu(B, H, n, frac, scores_kind):
    """The benchmark's shapes (32 x 4096 k 512, 32 x 32768 k 4096), Ada-KV groups and batch 1
    with few KV heads (a team of CTAs per segment or group): the CUDA op keeps exactly what the
    CPU op keeps (itself checked against the reference above), per segment and grouped."""
    gen = torch.Generator().manual_seed(n + H)
    stores = {}
    for device in ("cpu", "cuda"):
        s = kvcache_ext.RaggedKVStore(B, H, 4, dtype=torch.bfloat16, device=device, page_size=16)
        s.reserve(n)
        kv = torch.zeros(B, H, n, 4, dtype=torch.bfloat16, device=device)
        s.append(kv, kv, torch.arange(n, device=device))
        stores[device] = s
    L = n
    scores = torch.randn(B, H, L, generator=gen)
    if scores_kind == "bf16":
        scores = scores.bfloat16().float()
    k = int(n * frac)
    for grouped, budget in ((False, k), (True, k * H)):
        got = {}
        for device, s in stores.items():
            out = s.select(budget, scores.to(device), grouped=grouped)
            keep, counts = out if grouped else (out, None)
            got[device] = (s.to_padded(keep, False).cpu(), None if counts is None else counts.cpu())
        assert torch.equal(got["cuda"][0], got["cpu"][0]), grouped
        if grouped:
            assert torch.equal(got["cuda"][1], got["cpu"][1])
