"""RaggedKVStore against kvcache_ext.reference.ReferenceStore on random operation sequences."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext import reference
from kvcache_ext.kernels.ops import ops
from conftest import DEVICES, DTYPES, filled_store
from test_attention import check_against_reference


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN == NaN and -0.0 != +0.0 in comparisons."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.int8}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def assert_same(store: kvcache_ext.RaggedKVStore, ref: reference.ReferenceStore):
    """Contents bit for bit (rows are moved, never recomputed) and consistent metadata."""
    dense = store.to_dense()
    assert torch.equal(store.lens, ref.lens)
    assert torch.equal(dense.lens.cpu(), ref.lens)
    assert torch.equal(dense.mask.cpu(), ref.mask)
    for name in ("k", "v", "pos", "scores"):
        got, want = getattr(dense, name).cpu(), getattr(ref, name)
        assert got.shape == want.shape, name
        assert torch.equal(bits(got), bits(want)), name
    lens, size = store.len.cpu(), store.page_size
    assert torch.equal(lens.long().view(ref.lens.shape), ref.lens)
    assert (store.lens <= store.caps).all()
    # Pages: every page is owned by one segment or free, and the bytes are the pages held.
    table, pages = store.page_table.cpu(), store.caps.view(-1) // size
    owned = torch.cat([table[s, :int(pages[s])] for s in range(table.shape[0])]).long()
    assert bool((table[torch.arange(table.shape[1]) >= pages[:, None]] == -1).all())
    assert owned.numel() + store.free_pages == store.num_pages
    assert owned.unique().numel() == owned.numel() and bool(((owned >= 0) & (owned < store.num_pages)).all())
    assert store.capacity == store.num_pages * size
    assert store.num_tokens == int(ref.lens.sum())


def random_tokens(gen, B, H, n, D, dtype, device):
    k = torch.randn(B, H, n, D, generator=gen).to(dtype)
    v = torch.randn(B, H, n, D, generator=gen).to(dtype)
    return k, v, k.to(device), v.to(device)


def random_scores(gen, shape):
    """Scores with many ties, some NaN, signed zeros and infinities."""
    base = torch.randint(-3, 4, shape, generator=gen).float()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    pick = torch.randint(0, 12, shape, generator=gen)
    return torch.where(pick < special.numel(), special[pick.clamp(max=special.numel() - 1)], base)


OPS = ["append", "append_masked", "replace", "set_scores", "compact", "compact_unordered", "topk", "grouped",
       "reserve", "shrink"]


@pytest.mark.parametrize("device", DEVICES)
@given(B=st.integers(1, 3), H=st.integers(1, 4), D=st.sampled_from([1, 4, 8, 64]),
       dtype=st.sampled_from(DTYPES), C=st.integers(0, 3), page_size=st.sampled_from([1, 2, 4, 16]),
       ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=14), seed=st.integers(0, 2**31 - 1),
       int8=st.booleans())
def test_random_operation_sequences(device, B, H, D, dtype, C, page_size, ops, seed, int8):
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = torch.int8 if int8 else None
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, score_channels=C,
                                      page_size=page_size, kv_dtype=kv_dtype)
    ref = reference.ReferenceStore(B, H, D, dtype=dtype, score_channels=C, kv_dtype=kv_dtype)
    next_pos = 0
    for op in ["append"] + ops:
        if op in ("append", "append_masked"):
            n = int(torch.randint(0, 7, (), generator=gen))
            k, v, kd, vd = random_tokens(gen, B, H, n, D, dtype, device)
            pos = torch.arange(next_pos, next_pos + n).expand(B, n)
            next_pos += n
            valid = None
            if op == "append_masked":
                shape = (B, n) if int(torch.randint(0, 2, (), generator=gen)) else (B, H, n)
                valid = torch.rand(shape, generator=gen) < 0.6
            store.append(kd, vd, pos.to(device), None if valid is None else valid.to(device))
            ref.append(k, v, pos, valid)
        elif op == "replace":
            if int(ref.lens.min()) == 0:
                continue
            slot = (torch.rand(B, H, generator=gen) * ref.lens).long()
            k, v, kd, vd = random_tokens(gen, B, H, 1, D, dtype, device)
            pos = torch.full((B,), next_pos)
            next_pos += 1
            store.replace(slot.to(device), kd, vd, pos.to(device))
            ref.replace(slot, k, v, pos)
        elif op == "set_scores":
            padded = random_scores(gen, ref.scores.shape)
            store.set_scores(store.from_padded(padded.to(device)))
            ref.scores = padded.masked_fill(~ref.mask[..., None], 0)
        elif op in ("compact", "compact_unordered"):
            keep = torch.rand(ref.mask.shape, generator=gen) < 0.5
            stable = op == "compact"
            store.compact(store.from_padded(keep.to(device), False), stable=stable)
            (ref.compact if stable else ref.compact_unordered)(keep)
        elif op in ("topk", "grouped"):
            scores = random_scores(gen, ref.mask.shape)
            flat = store.from_padded(scores.to(device), 0.0)
            S = B * H
            if op == "topk":
                k = torch.randint(0, int(ref.lens.max()) + 2, (B, H), generator=gen)
                keep = store.select(k.to(device), flat)
                assert torch.equal(store.select(k.to(device), scores.to(device)), keep)  # padded
                want = reference.segmented_topk(scores.view(S, -1), ref.pos.view(S, -1),
                                                ref.lens.view(S), k.view(S)).view(ref.mask.shape)
            else:
                k = torch.randint(0, int(ref.lens.sum(1).max()) + 2, (B,), generator=gen)
                keep, counts = store.select(k.to(device), flat, grouped=True)
                padded_keep, padded_counts = store.select(k.to(device), scores.to(device), grouped=True)
                assert torch.equal(padded_keep, keep) and torch.equal(padded_counts, counts)
                want, want_counts = reference.grouped_topk(scores.view(S, -1), ref.pos.view(S, -1),
                                                           ref.lens.view(S), H, k)
                want = want.view(ref.mask.shape)
                assert torch.equal(counts.cpu(), want_counts.view(B, H))
            assert torch.equal(store.to_padded(keep, False).cpu(), want)
            assert not (keep.cpu() & ~store.from_padded(ref.mask.to(device), False).cpu()).any()
            store.compact(keep)
            ref.compact(want)
        elif op == "reserve":
            extra = int(torch.randint(0, 20, (), generator=gen))
            store.reserve(extra)
            assert (store.caps >= ref.lens + extra).all()
        elif op == "shrink":
            store.shrink_to_fit()
            assert torch.equal(store.caps, (ref.lens + page_size - 1) // page_size * page_size)
            assert store.free_pages == 0 and store.capacity == int(store.caps.sum())
        assert_same(store, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_operations_match_the_reference(device, dtype):
    """Appends and compactions of over 1 MiB run on every thread (smaller ones on the calling
    thread, csrc/store/store_cpu.cpp): the same contents as the reference either way."""
    B, H, D, n = 2, 4, 128, 600       # 2 x 4 x 600 tokens of K and V: 2.3 MiB in fp16
    gen = torch.Generator().manual_seed(7)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, score_channels=1)
    ref = reference.ReferenceStore(B, H, D, dtype=dtype, score_channels=1)
    k, v, kd, vd = random_tokens(gen, B, H, n, D, dtype, device)
    store.append(kd, vd, torch.arange(n).to(device))
    ref.append(k, v, torch.arange(n).expand(B, n), None)
    valid = torch.rand(B, H, n, generator=gen) < 0.7
    k, v, kd, vd = random_tokens(gen, B, H, n, D, dtype, device)
    store.append(kd, vd, torch.arange(n, 2 * n).to(device), valid.to(device))
    ref.append(k, v, torch.arange(n, 2 * n).expand(B, n), valid)
    assert_same(store, ref)
    for fraction in (0.5, 0.9):
        keep = torch.rand(ref.mask.shape, generator=gen) < fraction
        store.compact(store.from_padded(keep.to(device), False))
        ref.compact(keep)
        assert_same(store, ref)


def test_decoding_grows_by_whole_pages_and_moves_no_token(device):
    """Single-token appends into very unequal segments: every growth allocates whole pages,
    never more than one per segment, each segment holds the pages its tokens need and at most
    the next one (a slab a segment needs also holds the next page of the segments that fill
    theirs within page_size / 2 tokens), no stored token moves, and the bytes held are the
    pages' records."""
    size, H, D = 16, 8, 16
    store = kvcache_ext.RaggedKVStore(1, H, D, dtype=torch.float32, device=device, page_size=size)
    lens = torch.tensor([1000, 1, 1, 1, 5, 50, 1, 16])
    n = int(lens.max())
    k = torch.randn(1, H, n, D, device=device)
    valid = (torch.arange(n) < lens[:, None])[None].to(device)
    store.append(k, k, torch.arange(n, device=device), valid)
    record = (2 * size * D * 4) + size * 4 + size * 4   # K, V, pos, one score channel
    assert store.free_pages == 0 and store.slab_allocations == 1
    tok = torch.randn(1, H, 1, D, device=device)
    pages, allocations = store.num_pages, store.slab_allocations
    steps_adding = 0
    for t in range(1000):
        store.append(tok, tok, torch.tensor([n + t], device=device))
        grown = store.num_pages - pages
        assert 0 <= grown <= H
        steps_adding += grown > 0
        pages = store.num_pages
        held = store.caps.view(-1)
        assert (held >= (lens + t + 1 + size - 1) // size * size).all(), t
        assert (held <= (lens + t + 1 + size // 2 + size - 1) // size * size).all(), t
        assert pages * size == int(held.sum())
    # Without the lookahead, these lengths (7 distinct remainders mod 16) would allocate on
    # 7 of every 16 steps; with it, every head has 8 free slots after an allocation.
    assert store.slab_allocations - allocations == steps_adding <= 1000 // (size // 2) + 1
    assert store.repacks == 0 and store.free_pages == 0
    assert torch.equal(store.lens, (lens + 1000).view(1, H))
    dense = store.to_dense()
    assert torch.equal(dense.k[0, 0, :n], k[0, 0])           # the first tokens never moved
    tables = store.page_table.numel() * 4 + store.num_pages * 8 + H * 4
    assert store.nbytes == store.num_pages * record + tables


def test_equal_segments_take_exactly_the_pages_they_fill_and_reserve_adds_no_lookahead(device):
    """Segments of equal lengths fill their pages on the same step: each growth is one page per
    segment and nothing ahead (one-shot SnapKV decodes so). reserve(n) gives exactly the pages
    for n more tokens."""
    size, B, H, D = 8, 2, 3, 4
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.float32, device=device, page_size=size)
    k = torch.randn(B, H, 20, D, device=device)
    store.append(k, k, torch.arange(20, device=device))
    assert store.num_pages == B * H * 3                      # 20 tokens + 4 ahead: 3 pages each
    tok = torch.randn(B, H, 1, D, device=device)
    for t in range(20, 60):
        store.append(tok, tok, torch.tensor([t], device=device))
        assert store.num_pages == B * H * ((t + 1 + size - 1) // size), t
    assert store.slab_allocations == 1 + 5                   # at 25, 33, 41, 49, 57 tokens
    store.reserve(5)                                         # 60 + 5 tokens: 9 pages each
    assert store.num_pages == B * H * 9
    store.reserve(12)                                        # 72 tokens: 9 pages, nothing new
    assert store.num_pages == B * H * 9 and store.slab_allocations == 1 + 5 + 1


def test_compaction_frees_whole_pages_and_appends_reuse_them(device):
    store = kvcache_ext.RaggedKVStore(2, 3, 8, dtype=torch.float16, device=device, page_size=4)
    k = torch.randn(2, 3, 30, 8, dtype=torch.float16, device=device)
    store.append(k, k, torch.arange(30, device=device))
    held, allocations = store.nbytes, store.slab_allocations
    assert store.num_pages == 6 * 8
    store.compact(store.select(5, torch.rand(store.capacity, device=device)))
    assert store.free_pages == 6 * 6 and store.nbytes == held      # 2 pages kept per head
    # 13 more tokens per head need 3 more pages each: 18 of the 36 free pages, no allocation.
    more = torch.randn(2, 3, 13, 8, dtype=torch.float16, device=device)
    store.append(more, more, torch.arange(30, 43, device=device))
    assert store.free_pages == 18 and store.slab_allocations == allocations and store.nbytes == held
    dense = store.to_dense()
    assert torch.equal(dense.k[:, :, 5:], more)
    store.shrink_to_fit()
    assert store.free_pages == 0 and store.num_pages == 6 * 5 and store.repacks == 1
    assert torch.equal(store.to_dense().k, dense.k)


def test_shrink_to_fit_releases_memory(device):
    store = kvcache_ext.RaggedKVStore(2, 4, 64, dtype=torch.float16, device=device)
    k = torch.randn(2, 4, 512, 64, dtype=torch.float16, device=device)
    store.append(k, k, torch.arange(512, device=device))
    full = store.nbytes
    keep = store.select(32, torch.rand(store.capacity, device=device))
    store.compact(keep)
    assert store.nbytes == full  # compaction is in place; its pages are free, still held
    store.shrink_to_fit()
    assert store.capacity == 2 * 4 * 32
    assert store.nbytes < full / 16 + 4096
    dense = store.to_dense()
    assert dense.k.shape == (2, 4, 32, 64)


def test_accessors_are_copies(device):
    store = kvcache_ext.RaggedKVStore(1, 2, 4, dtype=torch.float32, device=device)
    k = torch.randn(1, 2, 3, 4, device=device)
    store.append(k, k, torch.arange(3, device=device))
    for name in ("k", "v", "pos", "scores", "len", "page_table"):
        getattr(store, name).fill_(7)
    assert torch.equal(store.to_dense().k, k) and torch.equal(store.lens, torch.full((1, 2), 3))
    scores = torch.randn(store.capacity, 1, device=device)
    store.set_scores(scores)
    index, mask = store.slot_index()
    assert torch.equal(store.scores[index[mask]], scores[index[mask]])


def test_left_padding_is_never_stored(device):
    B, H, n, D = 3, 2, 6, 8
    pad = torch.tensor([0, 2, 5])
    attention_mask = torch.arange(n)[None, :] >= pad[:, None]
    k = torch.randn(B, H, n, D, device=device)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.float32, device=device)
    store.append(k, k, torch.arange(n).expand(B, n).to(device), attention_mask.to(device))
    assert torch.equal(store.lens, (n - pad)[:, None].expand(B, H))
    dense = store.to_dense()
    for b in range(B):
        assert torch.equal(dense.k[b, :, : n - pad[b]].cpu(), k[b, :, pad[b]:].cpu())
        assert torch.equal(dense.pos[b, 0, : n - pad[b]].cpu(), torch.arange(pad[b], n, dtype=torch.int32))


def snapshot(store):
    dense = store.to_dense()
    return [bits(t).clone() for t in (dense.k, dense.v, dense.pos, dense.scores)] + [
        store.len.clone(), store.page_table.clone()]


def test_bad_input_raises_and_corrupts_nothing():
    B, H, D = 2, 3, 8
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.float16)
    k = torch.randn(B, H, 4, D, dtype=torch.float16)
    store.append(k, k, torch.arange(4))
    before = snapshot(store)
    one = torch.randn(B, H, 1, D, dtype=torch.float16)
    strided = k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, not contiguous
    bad_calls = [
        (TypeError, "dtype", lambda: store.append(k.float(), k.float(), torch.arange(4))),
        (ValueError, "shape", lambda: store.append(k[:, :2].contiguous(), k[:, :2].contiguous(), torch.arange(4))),
        (ValueError, "shape", lambda: store.append(k, k[..., :4].contiguous(), torch.arange(4))),
        (ValueError, "contiguous", lambda: store.append(strided, strided, torch.arange(4))),
        (ValueError, "pos", lambda: store.append(k, k, torch.arange(3))),
        (TypeError, "pos", lambda: store.append(k, k, torch.arange(4.0))),
        (ValueError, "must be on cpu", lambda: store.append(k.to("meta"), k.to("meta"), torch.arange(4))),
        (TypeError, "valid", lambda: store.append(k, k, torch.arange(4), torch.ones(B, 4))),
        (ValueError, "valid", lambda: store.append(k, k, torch.arange(4), torch.ones(B, 5, dtype=torch.bool))),
        (IndexError, "slot", lambda: store.replace(torch.full((B, H), 4), one, one, torch.zeros(B, dtype=torch.long))),
        (IndexError, "slot", lambda: store.replace(torch.full((B, H), -1), one, one, torch.zeros(B, dtype=torch.long))),
        (ValueError, "slot", lambda: store.replace(torch.zeros(B, dtype=torch.long), one, one,
                                                   torch.zeros(B, dtype=torch.long))),
        (ValueError, "keep", lambda: store.compact(torch.ones(store.capacity + 1, dtype=torch.bool))),
        (TypeError, "keep", lambda: store.compact(torch.ones(store.capacity, dtype=torch.int32))),
        (ValueError, "budget", lambda: store.select(-1)),
        (ValueError, "reserve", lambda: store.reserve(-1)),
    ]
    for error, words, call in bad_calls:
        with pytest.raises(error, match=words):
            call()
        after = snapshot(store)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), words


def test_constructor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        kvcache_ext.RaggedKVStore(1, 1, 8, dtype=torch.int32)
    for size in (0, 3, 2048):
        with pytest.raises(ValueError, match="page_size"):
            kvcache_ext.RaggedKVStore(1, 1, 8, page_size=size)
    with pytest.raises(ValueError, match="heads"):
        kvcache_ext.RaggedKVStore(1, 0, 8)
    if not kvcache_ext.build_info()["cuda"]:
        with pytest.raises(ValueError, match="without CUDA"):
            kvcache_ext.RaggedKVStore(1, 1, 8, device="cuda")


def test_per_step_eviction_gives_each_head_back_its_own_page(device):
    """Append one token, evict one: a head that crosses into a new page takes the page it
    freed the step before, so the page table (and its copy on the device) never changes."""
    store = kvcache_ext.RaggedKVStore(2, 3, 8, dtype=torch.float32, device=device, page_size=4)
    k = torch.randn(2, 3, 8, 8, device=device)
    store.append(k, k, torch.arange(8, device=device))
    # The prompt's slab also holds every head's third page (8 tokens fill two pages exactly,
    # within the page_size / 2 lookahead): decoding never allocates.
    assert store.num_pages == 6 * 3
    tok = torch.randn(2, 3, 1, 8, device=device)
    table, allocations = None, store.slab_allocations
    for t in range(8, 20):
        store.append(tok, tok, torch.tensor([t], device=device))
        grown = store.page_table
        assert table is None or torch.equal(grown, table), t
        table = grown
        store.compact(store.select(8, torch.rand(store.capacity, device=device)))
        assert store.free_pages == 6
    assert store.slab_allocations == allocations


@pytest.mark.parametrize("device", DEVICES)
@given(B=st.integers(1, 3), H=st.integers(1, 4), page_size=st.sampled_from([1, 4, 16]),
       lens=st.lists(st.integers(0, 40), min_size=12, max_size=12), keep=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_slot_rows_give_each_live_slot_its_row(device, B, H, page_size, lens, keep, seed):
    """``slot_rows`` against ``slot_index`` on random ragged stores (empty and one-token
    segments among them), after a compaction has freed pages and appends reused them (so
    that pages are owned out of order and the device's table holds stale entries)."""
    store = filled_store(B, H, 4, torch.float32, device, lens[:B * H], page_size=page_size, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    store.compact(store.select(keep, torch.rand(store.capacity, generator=gen).to(device)))
    tok = torch.randn(B, H, 3, 4, generator=gen).to(device)
    store.append(tok, tok, torch.arange(100, 103))
    index, mask = store.slot_index()
    rows = store.slot_rows()
    assert rows.shape == (store.capacity,) and rows.dtype == torch.long and rows.device == store.device
    want = torch.arange(B, device=store.device).view(B, 1, 1).expand_as(index)
    assert torch.equal(rows[index][mask], want[mask])


@pytest.mark.parametrize("device", DEVICES)
def test_compaction_takes_the_lengths_its_caller_knows(device):
    """``compact(keep, lens=...)``: the lengths a top-k of k per head leaves (min(len, k)) are
    taken without reading them back; bad ones are refused before anything moves, and on a CPU
    store a wrong one is caught after the op with the store left consistent."""
    lens = [5, 0, 1, 7, 3, 16]
    store = filled_store(2, 3, 8, torch.float32, device, lens, page_size=4)
    ref = filled_store(2, 3, 8, torch.float32, device, lens, page_size=4)
    scores = torch.rand(store.capacity).to(device)
    for s in (store, ref):
        s.set_scores(scores[:, None])
    known = torch.minimum(store.lens, torch.tensor(2))
    for bad, match in ((known.float(), "integer"), (known[:1], r"\[B, H\] = \[2, 3\]"),
                       (known + 20, "between 0 and"), (known - 3, "between 0 and")):
        with pytest.raises(ValueError, match=match):
            store.compact(store.select(2), lens=bad)
        assert store.lens.tolist() == [lens[:3], lens[3:]]          # nothing moved
    store.compact(store.select(2), lens=known)
    ref.compact(ref.select(2))
    assert store.lens.tolist() == ref.lens.tolist() == [[2, 0, 1], [2, 2, 2]]
    assert torch.equal(store.len.cpu(), ref.len.cpu()) and store.free_pages == ref.free_pages
    assert torch.equal(store.to_dense().pos, ref.to_dense().pos)
    if store.device.type == "cpu":    # a wrong length that is in bounds: the op's own is read
        wrong = torch.minimum(store.lens, torch.tensor(1))
        wrong[1, 2] = 0
        with pytest.raises(ValueError, match="segment 5 is 0, but the compaction kept 1 tokens"):
            store.compact(store.select(1), lens=wrong)
        assert store.lens.tolist() == [[1, 0, 1], [1, 1, 1]]
        store.validate()


@pytest.mark.parametrize("device", DEVICES)
@given(B=st.integers(1, 3), H=st.integers(1, 4), C=st.integers(1, 3), page_size=st.sampled_from([1, 4, 16]),
       max_len=st.sampled_from([1, 5, 40]), seed=st.integers(0, 2**31 - 1))
def test_select_through_pages_matches_reference(device, B, H, C, page_size, max_len, seed):
    """select reads scores (channel 0 of the store, slot layout or padded with extra columns)
    and positions through the pages: ragged and empty segments, pages out of order after an
    eviction, k = 0, k >= len, ties and NaN (random_scores), per segment and grouped."""
    gen = torch.Generator().manual_seed(seed)
    store = kvcache_ext.RaggedKVStore(B, H, 4, dtype=torch.float32, device=device, score_channels=C,
                                      page_size=page_size)
    n = max_len
    k0 = torch.randn(B, H, n, 4, generator=gen)
    valid = torch.rand(B, H, n, generator=gen) < 0.7
    valid[0, 0] = False  # one empty segment
    store.append(k0.to(device), k0.to(device), torch.arange(n).to(device), valid.to(device))
    store.compact(store.from_padded((torch.rand(store.to_dense().mask.shape, generator=gen) < 0.8)
                                    .to(device), False))
    store.append(k0.to(device), k0.to(device), torch.arange(n, 2 * n).to(device))  # reuses freed pages
    dense = store.to_dense()
    lens, S, L = dense.lens.cpu(), B * H, dense.mask.shape[-1]
    scores = random_scores(gen, (B, H, L, C))
    store.set_scores(store.from_padded(scores.to(device)))
    sc0, pos = scores[..., 0].reshape(S, L), dense.pos.cpu().reshape(S, L)
    wide = torch.cat([scores[..., 0], torch.randn(B, H, 3, generator=gen)], 2)  # padded, L + 3 columns
    flat = store.from_padded(scores[..., 0].to(device), 0.0)

    k = torch.randint(0, L + 2, (B, H), generator=gen)
    k[0, -1] = 0
    want = reference.segmented_topk(sc0, pos, lens.view(S), k.view(S)).view(B, H, L)
    for given_scores in (None, flat, wide.to(device)):
        keep = store.select(k.to(device), given_scores)
        assert keep.shape == (store.capacity,) and keep.dtype == torch.bool
        assert torch.equal(store.to_padded(keep, False).cpu(), want)
        assert int(keep.sum()) == int(want.sum())  # nothing outside the live slots
    for kg in (torch.randint(0, int(lens.sum(1).max()) + 2, (B,), generator=gen), 0, 2**40):
        want, want_counts = reference.grouped_topk(sc0, pos, lens.view(S), H, kg)
        for given_scores in (None, flat, wide.to(device)):
            keep, counts = store.select(kg, given_scores, grouped=True)
            assert torch.equal(store.to_padded(keep, False).cpu(), want.view(B, H, L))
            assert int(keep.sum()) == int(want.sum())
            assert torch.equal(counts.cpu(), want_counts.view(B, H))


def test_store_select_rejects_bad_input():
    B, H = 2, 3
    store = kvcache_ext.RaggedKVStore(B, H, 8, dtype=torch.float16, page_size=4)
    k = torch.randn(B, H, 5, 8, dtype=torch.float16)
    store.append(k, k, torch.arange(5))
    cap, S = store.capacity, B * H
    # The store_topk op itself (what select calls on either device), past select's Python checks.
    raw = lambda scores, k, grouped: ops.store_topk(*store.state(), scores, k, H if grouped else 1,
                                                   store.page_size, 8, 1, torch.float16)
    bad_calls = [
        (ValueError, r"k \(the budget\) must be >= 0, got k\[4\] = -2",
         lambda: raw(None, torch.tensor([1, 1, 1, 1, -2, 1]), False)),
        (ValueError, r"k \(the budget\) must have shape \[6\] \(one per segment\), got \[2\]",
         lambda: raw(None, torch.ones(B, dtype=torch.long), False)),
        (ValueError, r"k \(the budget\) must have shape \[2\] \(one per group of 3 segments\)",
         lambda: raw(None, torch.ones(S, dtype=torch.long), True)),
        (TypeError, "k .*integer", lambda: raw(None, torch.ones(S), False)),
        (ValueError, r"scores must be \[capacity\] = \[\d+\] in slot layout or \[batch, heads, L >= 5\] padded",
         lambda: raw(torch.zeros(cap + 1), torch.ones(S, dtype=torch.long), False)),
        (ValueError, r"L >= 5\] padded, got shape \[2, 3, 4\]",
         lambda: raw(torch.zeros(B, H, 4), torch.ones(S, dtype=torch.long), False)),
        (TypeError, "scores", lambda: raw(torch.zeros(cap, dtype=torch.float64), torch.ones(S, dtype=torch.long),
                                          False)),
        (ValueError, "contiguous", lambda: raw(torch.zeros(B, H, 10)[..., ::2], torch.ones(S, dtype=torch.long),
                                               False)),
        (ValueError, "budget", lambda: store.select(-1)),
    ]
    for error, words, call in bad_calls:
        with pytest.raises(error, match=words):
            call()
    none = kvcache_ext.RaggedKVStore(1, 1, 8, score_channels=0)
    with pytest.raises(ValueError, match="no score channels"):
        none.select(1)


def _huge_pages_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _huge_pages_offered(), reason="the kernel offers no transparent huge pages")
def test_large_cpu_slabs_ask_for_huge_pages():
    """A CPU slab covering whole 2 MiB pages is madvised MADV_HUGEPAGE (the 'hg' flag of its
    mapping in /proc/self/smaps): compaction and attention then miss the TLB less."""
    store = kvcache_ext.RaggedKVStore(1, 4, 128, dtype=torch.float16, device="cpu")
    store.reserve(4096)                                  # one slab of about 8 MiB
    slab = store.state()[0][0]
    huge = 2 << 20
    inside = (slab.data_ptr() + huge - 1) // huge * huge  # the first whole 2 MiB page in it
    assert inside + huge <= slab.data_ptr() + slab.numel()
    flags = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                covers = lo <= inside < hi
            elif covers and line.startswith("VmFlags"):
                flags = line.split()[1:]
                break
    assert flags is not None and "hg" in flags


# A segment longer than 65,535 tokens (past any CUDA grid y/z limit, past 16-bit counts).
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
    """On CUDA, fewer groups than SMs make the top-k run a team of CTAs per group; 320 segments
    (more than any GPU's SMs) one CTA per group. Compaction's tiles (128 to 1024 tokens) spread
    every segment over the GPU either way. Both against the reference, with ragged, empty and
    one-token segments and tiles that straddle pages."""
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
    # Compaction of a random keep mask (tiles straddle the 16-token pages).
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


# No host sync per decoded token in the store's growth (new pages), reserve and shrink, and in
# its selection; one per eviction (the compaction's new lengths).
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
    torch.cuda.set_sync_debug_mode("error")
    try:                                           # the new lengths given: no sync at all
        store.compact(store.select(torch.full((B, H), 20, device="cuda")), lens=torch.full((B, H), 20))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert store.lens.tolist() == [[20] * H] * B and store.len.tolist() == [20] * (B * H)


@pytest.mark.parametrize("device", DEVICES)
@given(B=st.integers(1, 3), H=st.integers(1, 4), G=st.integers(1, 3), rule=st.sampled_from(["mass", "position"]),
       sinks=st.integers(0, 3), recent=st.integers(0, 6), page_size=st.sampled_from([1, 4, 16]),
       max_len=st.sampled_from([1, 5, 40]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_eviction_by_rule_matches_the_scores_it_stands_for(device, B, H, G, rule, sinks, recent, page_size,
                                                           max_len, dtype, seed):
    """``evict_by_rule`` (a slot-rule scorer's eviction, each token scored from its record)
    against the eviction by the scores the rule stands for, made on the host (their selection
    against ``reference.segmented_topk``): a decode step's append, the attention with the mass,
    channel 0 += mass (``add_to_scores``), then the scores (channel 0 or the position) with the
    protected tokens at +inf, select k[b] per head and compact (unordered: one token moved per
    token evicted). Ragged segments (empty ones before the append, single-slot ones), ties, NaN
    and infinite channel values, budgets below, at and above the lengths, k = 0; every step
    kept bit for bit (on CUDA the mass may sum in another order: close, and the same tokens
    kept)."""
    from kvcache_ext.kernels.attention import ragged_attention
    from kvcache_ext.policies.protection import Protection
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (B * H,), generator=gen).tolist()
    lens[0] = 0
    D, C = 16, 2
    stores = []
    for _ in range(2):
        s = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, score_channels=C, page_size=page_size)
        stores.append(s)
    k0 = (torch.randn(B, H, max_len, D, generator=gen) * 0.5).to(dtype)
    valid = torch.arange(max_len) < torch.tensor(lens).view(B, H, 1)
    channels = random_scores(gen, (B, H, max_len, C))
    for s in stores:
        s.append(k0.to(device), k0.flip(-1).to(device), torch.arange(max_len).to(device), valid.to(device))
        s.set_scores(s.from_padded(channels[:, :, :int(s.lens.max())].to(device)))
    by_rule, ops_store = stores
    protection = Protection(sinks=sinks, recent=recent)
    expected = torch.tensor(lens).view(B, H)
    for step in range(3):
        q = (torch.randn(B, H * G, 1, D, generator=gen) * 0.5).to(dtype).to(device)
        k, v = ((torch.randn(B, H, 1, D, generator=gen) * 0.5).to(dtype).to(device) for _ in range(2))
        pos = (max_len + step + torch.arange(B)).view(B, 1).to(device)      # rows at their own positions
        last_pos = pos[:, 0]
        budget = torch.randint(0, max_len + 3, (B,), generator=gen)
        budget[-1] = 0 if step == 1 else budget[-1]
        per_head = budget[:, None].expand(B, H)
        device_budget = per_head.to(device) if step else per_head.to(torch.int32).to(device)   # both dtypes
        by_rule.append(k, v, pos)
        got, mass = ragged_attention(q, by_rule, 0.25, stats=("mass",))
        if rule == "mass":
            by_rule.add_to_scores(0, mass.mass)
        by_rule.evict_by_rule(device_budget.reshape(-1), rule=rule, sinks=sinks, recent=recent,
                              last_pos=last_pos, kept=torch.minimum(by_rule.lens, per_head))
        # The same step with the scores made on the host.
        ops_store.append(k, v, pos)
        want, stats = ragged_attention(q, ops_store, 0.25, stats=("mass",) if rule == "mass" else False)
        if rule == "mass":
            updated = ops_store.scores
            updated[:, 0] += stats.mass
            ops_store.set_scores(updated)
        if bool((ops_store.lens > budget[:, None]).any()):
            slot_pos = ops_store.pos
            scores = ops_store.scores[:, 0].clone() if rule == "mass" else slot_pos.float()
            scores = scores.masked_fill(protection.mask(slot_pos, last_pos[ops_store.slot_rows()]), float("inf"))
            keep = ops_store.select(budget.to(device)[:, None].expand(B, H), scores)
            # The selection against the plain-PyTorch reference on the padded scores.
            dense = ops_store.to_dense()
            S, L = B * H, dense.mask.shape[-1]
            by_reference = reference.segmented_topk(ops_store.to_padded(scores).cpu().reshape(S, L),
                                                    dense.pos.cpu().reshape(S, L), dense.lens.cpu().reshape(S),
                                                    budget[:, None].expand(B, H).reshape(S))
            assert torch.equal(ops_store.to_padded(keep, False).cpu().reshape(S, L), by_reference)
            ops_store.compact(keep, lens=torch.minimum(ops_store.lens, budget[:, None]), stable=False)
        expected = torch.minimum(expected + 1, budget[:, None])   # every segment: min(len, k[b])
        assert by_rule.lens.tolist() == ops_store.lens.tolist() == expected.tolist()
        a, b = by_rule.to_dense(), ops_store.to_dense()
        assert torch.equal(a.pos.masked_fill(~a.mask, -1).cpu(), b.pos.masked_fill(~b.mask, -1).cpu())
        if device == "cpu":
            assert torch.equal(bits(got), bits(want))
            for name in ("k", "v", "scores"):
                assert torch.equal(bits(getattr(a, name)), bits(getattr(b, name))), name
        else:
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(a.scores, b.scores, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_decode_step_changes_nothing(device):
    """``decode_step`` (one op: append, attend, accumulate, evict) names the argument it refuses,
    and a refused step leaves the store as it was: the op checks everything before it writes,
    and the page allocator's host lengths go back (``cancel_append``)."""
    B, H, D = 2, 2, 16 if device == "cpu" else min(kvcache_ext.kernels.attention.CUDA_HEAD_DIMS)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.float32, device=device, score_channels=1, page_size=4)
    gen = torch.Generator().manual_seed(0)
    k0 = torch.randn(B, H, 5, D, generator=gen).to(device)
    store.append(k0, k0, torch.arange(5).to(device))
    k, q = torch.randn(B, H, 1, D, generator=gen).to(device), torch.randn(B, 2 * H, 1, D, generator=gen).to(device)
    pos = torch.full((B, 1), 5).to(device)
    budget = (torch.full((B * H,), 3, dtype=torch.int32, device=device), torch.full((B * H,), 3))
    bad = [
        (dict(q=torch.randn(B, 2 * H, 1, D + 1).to(device)), "q has head_dim"),
        (dict(q=torch.randn(B, 2 * H, 2, D).to(device)), "one query per head"),
        (dict(scale=float("inf")), "scale must be finite"),
        (dict(stats=("mass", "entropy")), "unknown statistics"),
        (dict(accumulate=("last",)), "one value per slot"),
        (dict(rule="tova", budget=budget), "rule must be 'mass'"),
        (dict(rule="mass"), "needs budget"),
        (dict(rule="mass", budget=budget, recent=2), "recent > 0 needs last_pos"),
        (dict(rule="mass", budget=(budget[0][:2], budget[1]), last_pos=None), "budget must have shape"),
    ]
    before, host = store.to_dense(), store.lens.clone()
    for kwargs, message in bad:
        args = dict(q=q, scale=0.25)
        args.update(kwargs)
        with pytest.raises((ValueError, TypeError), match=message):
            store.decode_step(args.pop("q"), k, k, pos, args.pop("scale"), **args)
        after = store.to_dense()
        assert torch.equal(store.lens, host) and torch.equal(store.len.cpu(), host.view(-1).int()), kwargs
        assert torch.equal(after.pos, before.pos) and torch.equal(after.k, before.k), kwargs
    out, stats = store.decode_step(q, k, k, pos, 0.25, stats=("mass",), accumulate=("mass",), rule="mass",
                                   budget=budget)
    assert store.lens.tolist() == [[3, 3], [3, 3]] and stats["mass"].shape == (store.capacity,)
