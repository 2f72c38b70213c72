"""segmented_topk / grouped_topk against kvcache_ext.reference on random ragged layouts."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES
from test_store import random_scores


def random_layout(gen, S, max_len):
    """Segments in order with random slack between them: (start [S], len [S], capacity)."""
    lens = torch.randint(0, max_len + 1, (S,), generator=gen)
    lens[torch.rand(S, generator=gen) < 0.2] = 0
    lens[torch.rand(S, generator=gen) < 0.2] = 1
    slack = torch.randint(0, 4, (S,), generator=gen)
    caps = lens + slack
    start = torch.cumsum(caps, 0) - caps
    return start, lens.int(), int(caps.sum())


def padded(flat, start, lens):
    L = int(lens.max()) if lens.numel() else 0
    idx = (start[:, None] + torch.arange(L)).clamp(max=max(flat.numel() - 1, 0))
    mask = torch.arange(L) < lens[:, None]
    return flat[idx] if flat.numel() else flat.new_zeros(idx.shape), mask


@pytest.mark.parametrize("device", DEVICES)
@given(S=st.integers(1, 12), max_len=st.sampled_from([1, 3, 17, 200]), group=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_topk_matches_reference(device, S, max_len, group, seed):
    gen = torch.Generator().manual_seed(seed)
    S = S * group  # whole groups
    start, lens, capacity = random_layout(gen, S, max_len)
    scores = random_scores(gen, (capacity,))
    pos = torch.randint(0, 50, (capacity,), generator=gen, dtype=torch.int32)  # repeated positions too
    sc, ps = padded(scores, start, lens)[0], padded(pos, start, lens)[0]
    args = [t.to(device) for t in (scores, pos, start, lens)]

    k = torch.randint(0, max_len + 2, (S,), generator=gen)
    keep = kvcache_ext.segmented_topk(*args, k.to(device)).cpu()
    want = reference.segmented_topk(sc, ps, lens, k)
    got, mask = padded(keep, start, lens)
    assert torch.equal(got & mask, want)
    assert int(keep.sum()) == int(want.sum())  # nothing outside the live slots

    kg = torch.randint(0, group * max_len + 2, (S // group,), generator=gen)
    keep, counts = kvcache_ext.grouped_topk(*args, group, kg.to(device))
    want, want_counts = reference.grouped_topk(sc, ps, lens, group, kg)
    got, mask = padded(keep.cpu(), start, lens)
    assert torch.equal(got & mask, want)
    assert int(keep.sum()) == int(want.sum())
    assert torch.equal(counts.cpu(), want_counts)


def test_topk_hand_checked_cases(device):
    nan, inf = float("nan"), float("inf")
    # One segment: ties go to the lower position, NaN is evicted before -inf.
    scores = torch.tensor([1.0, nan, 2.0, 1.0, -inf, 1.0], device=device)
    pos = torch.tensor([5, 0, 9, 3, 1, 4], dtype=torch.int32, device=device)
    start = torch.tensor([0], device=device)
    lens = torch.tensor([6], dtype=torch.int32, device=device)
    expect = {0: [], 1: [2], 2: [2, 3], 3: [2, 3, 5], 4: [0, 2, 3, 5], 5: [0, 2, 3, 4, 5],
              6: [0, 1, 2, 3, 4, 5], 100: [0, 1, 2, 3, 4, 5]}
    for k, slots in expect.items():
        keep = kvcache_ext.segmented_topk(scores, pos, start, lens, k)
        assert keep.nonzero().flatten().tolist() == slots, k
    # Grouped: two segments of one group share a budget of 3; counts per segment.
    scores = torch.tensor([9.0, 1.0, 0.0, 8.0, 7.0, 0.5], device=device)
    pos = torch.tensor([0, 1, 0, 0, 1, 2], dtype=torch.int32, device=device)
    start = torch.tensor([0, 3], device=device)
    lens = torch.tensor([2, 3], dtype=torch.int32, device=device)  # slot 2 is slack
    keep, counts = kvcache_ext.grouped_topk(scores, pos, start, lens, 2, 3)
    assert keep.nonzero().flatten().tolist() == [0, 3, 4]
    assert counts.tolist() == [1, 2]


def test_topk_rejects_bad_input():
    scores = torch.rand(6)
    pos = torch.arange(6, dtype=torch.int32)
    start = torch.tensor([0, 3])
    lens = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="budget"):
        kvcache_ext.segmented_topk(scores, pos, start, lens, -1)
    with pytest.raises(ValueError, match="k"):
        kvcache_ext.segmented_topk(scores, pos, start, lens, torch.tensor([1, -2]))
    with pytest.raises(TypeError, match="scores"):
        kvcache_ext.segmented_topk(scores.double(), pos, start, lens, 1)
    with pytest.raises(TypeError, match="pos"):
        kvcache_ext.segmented_topk(scores, pos.long(), start, lens, 1)
    with pytest.raises(ValueError, match="pos"):
        kvcache_ext.segmented_topk(scores, pos[:5], start, lens, 1)
    with pytest.raises(ValueError, match="k"):
        kvcache_ext.segmented_topk(scores, pos, start, lens, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="in order"):
        kvcache_ext.segmented_topk(scores, pos, torch.tensor([0, 2]), lens, 1)
    with pytest.raises(ValueError, match="in order"):
        kvcache_ext.segmented_topk(scores, pos, torch.tensor([0, 4]), lens, 1)
    with pytest.raises(ValueError, match="contiguous"):
        kvcache_ext.segmented_topk(torch.rand(6, 2)[:, 0], pos, start, lens, 1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        kvcache_ext.grouped_topk(scores, pos, start, lens, 3, 1)
    with pytest.raises(ValueError, match="group_size"):
        kvcache_ext.grouped_topk(scores, pos, start, lens, 0, 1)


def test_topk_empty_inputs(device):
    empty_f = torch.empty(0, device=device)
    empty_i = torch.empty(0, dtype=torch.int32, device=device)
    start = torch.zeros(3, dtype=torch.int64, device=device)
    lens = torch.zeros(3, dtype=torch.int32, device=device)
    assert kvcache_ext.segmented_topk(empty_f, empty_i, start, lens, 4).numel() == 0
    keep, counts = kvcache_ext.grouped_topk(empty_f, empty_i, start, lens, 3, 4)
    assert keep.numel() == 0 and counts.tolist() == [0, 0, 0]


def test_budget_beyond_int32_keeps_everything(device):
    scores = torch.rand(6, device=device)
    pos = torch.arange(6, dtype=torch.int32, device=device)
    start = torch.tensor([0, 3], device=device)
    lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    for k in (2**31, 2**40, torch.tensor([2**32, 2**32 + 1], device=device)):
        keep = kvcache_ext.segmented_topk(scores, pos, start, lens, k)
        assert keep.tolist() == [True] * 5 + [False]


def test_narrow_integer_budgets_work(device):
    """int8 / uint8 / int16 budgets select like int64 ones (the clamp to int32 widens first)."""
    scores = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.8], device=device)
    pos = torch.arange(5, dtype=torch.int32, device=device)
    start = torch.tensor([0, 3], device=device)
    lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    want = kvcache_ext.segmented_topk(scores, pos, start, lens, torch.tensor([2, 1], device=device))
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        k = torch.tensor([2, 1], dtype=dtype, device=device)
        assert torch.equal(kvcache_ext.segmented_topk(scores, pos, start, lens, k), want), dtype
        k = torch.tensor([3], dtype=dtype, device=device)
        keep, counts = kvcache_ext.grouped_topk(scores, pos, start, lens, 2, k)
        assert counts.tolist() == [2, 1] and keep.tolist() == [False, True, True, False, True]


@pytest.mark.parametrize("scores_kind", ["continuous", "tied", "one_value", "tiny_spread"])
def test_long_segments_select_like_the_reference(device, scores_kind):
    """Segments of thousands of slots: the CPU radix selection goes through several digits
    (continuous scores), ends on equal keys (one value, repeated positions), or must tell
    apart scores that differ only in their last bits (tiny spread)."""
    gen = torch.Generator().manual_seed(7)
    S, group = 6, 3
    lens = torch.tensor([5000, 1, 0, 3000, 4097, 65], dtype=torch.int32)
    caps = lens + 2
    start = torch.cumsum(caps, 0) - caps
    capacity = int(caps.sum())
    if scores_kind == "continuous":
        scores = torch.rand(capacity, generator=gen) ** 4  # many exponents
    elif scores_kind == "tied":
        scores = torch.randint(0, 5, (capacity,), generator=gen).float()
    elif scores_kind == "one_value":
        scores = torch.full((capacity,), 0.25)
    else:
        scores = 1.0 + torch.randint(0, 8, (capacity,), generator=gen).float() * 2**-23
    pos = torch.randint(0, 700, (capacity,), generator=gen, dtype=torch.int32)
    sc, ps = padded(scores, start, lens)[0], padded(pos, start, lens)[0]
    args = [t.to(device) for t in (scores, pos, start, lens)]
    for k in ([0, 1, 0, 1, 2048, 64], [4999, 1, 3, 1500, 4096, 65], [100, 0, 0, 2999, 1, 30]):
        k = torch.tensor(k)
        keep = kvcache_ext.segmented_topk(*args, k.to(device)).cpu()
        got, mask = padded(keep, start, lens)
        assert torch.equal(got & mask, reference.segmented_topk(sc, ps, lens, k)), k
        kg = k.view(-1, group).sum(1) + 7
        keep, counts = kvcache_ext.grouped_topk(*args, group, kg.to(device))
        want, want_counts = reference.grouped_topk(sc, ps, lens, group, kg)
        got, mask = padded(keep.cpu(), start, lens)
        assert torch.equal(got & mask, want) and torch.equal(counts.cpu(), want_counts), kg
