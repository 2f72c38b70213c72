"""Issue 20's review of the CUDA kernels: the paths no test reached, each run on every device
(on CPU here, as the CUDA twin where a GPU is present), and the CUDA-only checks (host syncs,
head_dim refused at patch time).

- head_dim 80, 96, 112, 192 (the CUDA attention's padded row layout) and 256;
- a segment longer than 65,535 tokens (past any grid y/z limit, past 16-bit counts);
- the CUDA attention's chunked statistics path, taken when G x capacity x queries > 2^26
  (its logits buffer would pass 256 MiB): queries run in passes that add into the statistics;
- no host sync per decoded token in the store's growth (new pages), reserve and shrink, and in
  the store's selection; one per eviction (the compaction's new lengths).
"""
import math

import pytest
import torch

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES
from test_attention import check_against_reference


def filled_store(B, H, D, dtype, device, lens, page_size=16, seed=0):
    """A store whose segment s holds lens[s] tokens at positions 0 .. lens[s] - 1."""
    gen = torch.Generator().manual_seed(seed)
    L = max(lens)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, page_size=page_size)
    k, v = ((torch.randn(B, H, L, D, generator=gen) * 0.5).to(dtype) for _ in range(2))
    valid = (torch.arange(L) < torch.tensor(lens).view(B, H, 1))
    store.append(k.to(device), v.to(device), torch.arange(L), valid.to(device))
    return store


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [80, 96, 112, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_of_current_models(device, D, dtype):
    gen = torch.Generator().manual_seed(D)
    store = filled_store(2, 2, D, dtype, device, [37, 0, 1, 300])
    for n in (1, 3):
        q = (torch.randn(2, 4, n, D, generator=gen)).to(dtype).to(device)
        q_pos = torch.arange(300 - n + 1, 301).expand(2, n) if n > 1 else None
        check_against_reference(store, q, 1 / math.sqrt(D), q_pos, True)


@pytest.mark.parametrize("device", DEVICES)
def test_segment_longer_than_65535_tokens(device):
    long = 70_001
    store = filled_store(1, 2, 64, torch.float32, device, [long, 5], page_size=64)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(device)
    check_against_reference(store, q, 0.125, None, True)
    # Compaction and selection of the long segment: keep every third token.
    keep = torch.zeros(store.capacity, dtype=torch.bool, device=device)
    index, mask = store.slot_index()
    keep[index[0, 0, ::3]] = True
    keep[index[0, 1, :5]] = True
    pos_before = store.to_padded(store.pos)[0, 0, ::3].clone()
    store.compact(keep)
    assert store.lens.tolist() == [[len(range(0, long, 3)), 5]]
    assert torch.equal(store.to_padded(store.pos)[0, 0, :store.lens[0, 0]], pos_before)
    budget = torch.tensor([[20_000, 3]])
    kept = store.select(budget, store.to_padded(store.pos).float())   # highest positions win
    assert store.to_padded(kept)[0, 0].sum() == 20_000 and store.to_padded(kept)[0, 1].sum() == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B, H", [(1, 1), (1, 4), (2, 3), (40, 8), (320, 1)])
def test_compaction_and_selection_with_few_and_many_segments(device, B, H):
    """On CUDA, fewer segments (or groups) than SMs take several blocks per segment in
    compaction and device-wide sorts in selection; 320 segments (more than any GPU's SMs)
    take one block per segment and CUB's segmented sort. Both against the reference, with
    ragged, empty and one-token segments and tiles that straddle pages."""
    gen = torch.Generator().manual_seed(B * 100 + H)
    lens = torch.randint(0, 700, (B * H,), generator=gen)
    lens[0], lens[-1] = 0, 1 if B * H > 1 else 0
    store = filled_store(B, H, 8, torch.float32, device, lens.tolist(), page_size=16, seed=B + H)
    dense = store.to_dense()
    # Selection: ties among the scores (a few values), a random budget per segment and per item.
    scores = torch.randint(0, 5, dense.mask.shape, generator=gen).float()
    S = B * H
    k = torch.randint(0, 720, (B, H), generator=gen)
    keep = store.select(k.to(device), scores.to(device))
    want = reference.segmented_topk(scores.view(S, -1), dense.pos.cpu().view(S, -1).long(),
                                    store.lens.view(S), k.view(S)).view(dense.mask.shape)
    assert torch.equal(store.to_padded(keep, False).cpu(), want)
    kg = torch.randint(0, 720 * H, (B,), generator=gen)
    keep_g, counts = store.select(kg.to(device), scores.to(device), grouped=True)
    want_g, want_counts = reference.grouped_topk(scores.view(S, -1), dense.pos.cpu().view(S, -1).long(),
                                                 store.lens.view(S), H, kg)
    assert torch.equal(store.to_padded(keep_g, False).cpu(), want_g.view(dense.mask.shape))
    assert torch.equal(counts.cpu(), want_counts.view(B, H))
    # Compaction of a random keep mask (tiles of 256 tokens straddle the 16-token pages).
    mask = torch.rand(dense.mask.shape, generator=gen) < 0.4
    mask[..., :300] |= torch.rand(B, H, 1, generator=gen) < 0.5   # some long kept prefixes
    mask &= dense.mask.cpu()
    want_k = [dense.k.cpu()[b, h][mask[b, h]] for b in range(B) for h in range(H)]
    store.compact(store.from_padded(mask.to(device), False))
    after = store.to_dense()
    assert torch.equal(store.lens.view(S), mask.view(S, -1).sum(1))
    for s in range(S):
        n = int(store.lens.view(S)[s])
        assert torch.equal(after.k.cpu().view(S, -1, 8)[s, :n], want_k[s])


def chunked_reference(store, q, scale, q_pos, chunk=128):
    """The statistics in float32, a chunk of queries at a time (memory stays small)."""
    dense = store.to_dense()
    k, v, pos, mask = (t.cpu() for t in (dense.k.float(), dense.v.float(), dense.pos, dense.mask))
    B, Hq, n, D = q.shape
    H = k.shape[1]
    G = Hq // H
    qf = q.cpu().float().view(B, H, G, n, D)
    mass = torch.zeros(mask.shape)
    sum_sq = torch.zeros(mask.shape)
    count = torch.zeros(mask.shape, dtype=torch.int32)
    last = torch.zeros(mask.shape + (G,))
    out = torch.zeros(B, H, G, n, D)
    for i0 in range(0, n, chunk):
        qc = qf[:, :, :, i0:i0 + chunk]                                   # [B, H, G, c, D]
        logits = torch.einsum("bhgcd,bhld->bhgcl", qc, k) * scale
        chunk_pos = q_pos.cpu()[:, None, None, i0:i0 + chunk, None]
        visible = mask[:, :, None, None, :] & (pos[:, :, None, None, :] <= chunk_pos)
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
        out[:, :, :, i0:i0 + chunk] = probs @ v[:, :, None]
        group = probs.sum(2)                                              # [B, H, c, L]
        mass += group.sum(2)
        sum_sq += (group / G).square().sum(2)
        count += visible[:, :, 0].sum(2).int()
        if i0 + chunk >= n:
            last = probs[:, :, :, -1].permute(0, 1, 3, 2)
    return out.view(B, Hq, n, D), dict(mass=mass, sum_sq=sum_sq, count=count, last=last)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_statistics_path(device):
    """G x capacity x queries just over 2^26: the CUDA kernel runs the queries in two passes
    whose statistics add up; the CPU kernel computes the same numbers in one."""
    L, n, G = 32_800, 1040, 2
    store = filled_store(1, 1, 64, torch.float32, device, [L], page_size=16)
    assert G * store.capacity * n > 2 ** 26
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(1, G, n, 64, generator=gen) * 0.5).to(device)
    q_pos = torch.arange(L - n, L).view(1, n)   # causal over the last n tokens
    out, got = kvcache_ext.ragged_attention(q, store, 0.125, q_pos=q_pos, stats=True)
    want_out, want = chunked_reference(store, q, 0.125, q_pos)
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-4)
    for name in kvcache_ext.STAT_NAMES:
        torch.testing.assert_close(store.to_padded(getattr(got, name)).cpu(), want[name],
                                   atol=2e-5, rtol=1e-4, msg=name)


def test_cuda_head_dims_are_checked_at_patch_time():
    from kvcache_ext.kernels.attention import CUDA_HEAD_DIMS, check_head_dim
    assert CUDA_HEAD_DIMS == (64, 80, 96, 112, 128, 192, 256)
    for D in CUDA_HEAD_DIMS:
        check_head_dim(D, torch.device("cuda"))
    check_head_dim(48, torch.device("cpu"))   # the CPU kernels take any head_dim
    with pytest.raises(ValueError, match=r"head_dim 64, 80, 96, 112, 128, 192 and 256, got 48;"):
        check_head_dim(48, torch.device("cuda"))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels")
def test_patch_refuses_a_cuda_model_of_unsupported_head_dim():
    from tiny_models import tiny_model
    from kvcache_ext.policies import H2O, Policy
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=16).cuda()
    with pytest.raises(ValueError, match="head_dim .*, got 16;"):
        kvcache_ext.patch(model, Policy(H2O(), budget=8))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels")
def test_cuda_no_host_sync_in_decoding_growth_reserve_shrink_and_selection():
    """torch.cuda.set_sync_debug_mode('error') raises on any synchronizing call."""
    B, H, D = 2, 4, 128
    store = filled_store(B, H, D, torch.float16, "cuda", [40] * (B * H), page_size=16)
    q = torch.randn(B, 8, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(40):                     # crosses pages: new slabs, page table uploads
            store.append(k, k, torch.full((B, 1), 40 + step, device="cuda"))
            kvcache_ext.ragged_attention(q, store)
        store.reserve(64)
        store.shrink_to_fit()
        store.repack(16)
        keep = store.select(torch.full((B, H), 30, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    store.compact(keep)                            # the one sync of an eviction
    assert store.lens.tolist() == [[30] * H] * B
