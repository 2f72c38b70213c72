"""RaggedKVStore.fork: a store that continues another's sequences on its pages (a shared prefix),
against kvcache_ext.reference.ReferenceStore."""
import copy

import pytest
import torch

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES, DTYPES
from test_attention import check_against_reference
from test_store import bits, random_scores, random_tokens


def assert_holds(store: kvcache_ext.RaggedKVStore, ref: reference.ReferenceStore):
    """The store's tokens, bit for bit, are the reference's."""
    dense = store.to_dense()
    assert torch.equal(store.lens, ref.lens)
    assert torch.equal(store.len.cpu().long().view(ref.lens.shape), ref.lens)
    for name in ("k", "v", "pos", "scores"):
        got, want = getattr(dense, name).cpu(), getattr(ref, name)
        assert got.shape == want.shape, name
        assert torch.equal(bits(got), bits(want)), name
    store.validate()


def append_random(gen, stores, B, H, D, dtype, device, n, masked):
    """The same random tokens appended to a RaggedKVStore and its reference."""
    k, v, kd, vd = random_tokens(gen, B, H, n, D, dtype, device)
    start = int(stores[1].pos.max()) + 1 if stores[1].pos.numel() else 0
    pos = torch.arange(start, start + n)
    valid = torch.rand(B, H, n, generator=gen) < 0.7 if masked else None
    stores[0].append(kd, vd, pos, None if valid is None else valid.to(device))
    stores[1].append(k, v, pos, valid)


def prefix_store(gen, B, H, D, dtype, device, page_size, C=2):
    """A store of ragged segments (empty, single-token, page-aligned and partly filled pages
    among them), with free pages and pages reserved ahead, and its reference."""
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, score_channels=C, page_size=page_size)
    ref = reference.ReferenceStore(B, H, D, dtype=dtype, score_channels=C)
    lens = torch.randint(0, 3 * page_size, (B, H), generator=gen)
    lens.view(-1)[0] = 0
    if lens.numel() > 1:
        lens.view(-1)[1] = 1
    if lens.numel() > 2:
        lens.view(-1)[2] = 2 * page_size
    L = int(lens.max()) + 1
    k, v, kd, vd = random_tokens(gen, B, H, L, D, dtype, device)
    valid = torch.arange(L) < lens[..., None]
    store.append(kd, vd, torch.arange(L), valid.to(device))
    ref.append(k, v, torch.arange(L), valid)
    scores = random_scores(gen, (B, H, ref.k.shape[2], C))
    ref.scores = scores.masked_fill(~ref.mask[..., None], 0)
    store.set_scores(store.from_padded(scores.to(device)))
    keep = torch.rand(B, H, ref.k.shape[2], generator=gen) < 0.8
    ref.compact(keep)
    store.compact(store.from_padded(keep.to(device), fill=False))
    store.reserve(page_size)   # pages held for tokens to come: the prefix's own
    return store, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,page_size", [(1, 1, 1), (2, 3, 4), (3, 2, 16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_fork_continues_the_store_on_its_pages(device, dtype, B, H, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    D = 16
    parent, ref = prefix_store(gen, B, H, D, dtype, device, page_size)
    parent_ref = copy.deepcopy(ref)
    forks = [parent.fork(), parent.fork()]
    refs = [copy.deepcopy(ref), copy.deepcopy(ref)]
    # The fork reads the prefix's slabs themselves; it owns only the copies of partly filled
    # last pages (at most one per segment) and its tables.
    parent_pool = parent.state()[0]
    for fork in forks:
        pool = fork.state()[0]
        assert [t.data_ptr() for t in pool[:len(parent_pool)]] == [t.data_ptr() for t in parent_pool]
        assert fork.shares_pages and parent.shares_pages
        assert_holds(fork, parent_ref)
        own = pool[len(parent_pool):]
        assert sum(t.shape[0] for t in own) <= B * H
        assert fork.nbytes - sum(t.nbytes for t in own) < parent.nbytes - sum(t.nbytes for t in parent_pool) + 1024
    # Each fork appends its own tokens; neither the prefix nor the other fork sees them.
    for step in range(4):
        for fork, fork_ref in zip(forks, refs):
            append_random(gen, (fork, fork_ref), B, H, D, dtype, device, 1 + 3 * (step % 2), masked=step == 3)
    append_random(gen, (parent, parent_ref), B, H, D, dtype, device, 2, masked=False)   # appends stay allowed
    for fork, fork_ref in zip(forks, refs):
        assert_holds(fork, fork_ref)
    assert_holds(parent, parent_ref)
    # Attention over a fork: its shared and its own tokens, as over one store.
    G, n = 2, 3
    q = (torch.randn(B, H * G, n, D, generator=gen) * 0.5).to(dtype).to(device)
    top = int(refs[0].pos.max())
    q_pos = torch.randint(top - 6, top + 1, (B, n), generator=gen).to(device)
    check_against_reference(forks[0], q, 0.25, q_pos, True)
    check_against_reference(forks[1], q, D ** -0.5, None, ("mass", "count"))


@pytest.mark.parametrize("device", DEVICES)
def test_shared_tokens_are_read_only_until_a_repack(device):
    gen = torch.Generator().manual_seed(3)
    B, H, D, size = 2, 2, 8, 4
    parent, ref = prefix_store(gen, B, H, D, torch.float32, device, size)
    fork = parent.fork()
    for store in (parent, fork):
        capacity = store.capacity
        with pytest.raises(ValueError, match="compact would write tokens that this store shares"):
            store.compact(torch.ones(capacity, dtype=torch.bool, device=device))
        with pytest.raises(ValueError, match="set_scores would write tokens that this store shares"):
            store.set_scores(torch.zeros(capacity, 2, device=device))
        with pytest.raises(ValueError, match="replace would write"):
            store.replace(torch.zeros(B, H, dtype=torch.long), torch.zeros(B, H, 1, D, device=device),
                          torch.zeros(B, H, 1, D, device=device), torch.zeros(B, dtype=torch.long))
        with pytest.raises(ValueError, match="evict_by_rule would write"):
            store.evict_by_rule(torch.zeros(B * H, dtype=torch.long, device=device), rule="position")
        with pytest.raises(ValueError, match="add_to_scores would write"):
            store.add_to_scores(0, torch.zeros(capacity, device=device))
    assert_holds(fork, ref)      # the refusals changed nothing
    assert_holds(parent, ref)
    # A repack moves the fork's tokens into pages of its own: it may write them again.
    fork.repack()
    assert not fork.shares_pages and fork.nbytes > 0
    assert_holds(fork, ref)
    keep = torch.rand(B, H, ref.k.shape[2], generator=gen) < 0.5
    fork_ref = copy.deepcopy(ref)
    fork_ref.compact(keep)
    fork.compact(fork.from_padded(keep.to(device), fill=False))
    assert_holds(fork, fork_ref)
    assert_holds(parent, ref)


def test_a_fork_of_an_empty_store_owns_everything_it_holds():
    store = kvcache_ext.RaggedKVStore(2, 3, 8, dtype=torch.float32)
    fork = store.fork()
    assert fork.num_tokens == 0 and fork.state()[0] == []
    gen = torch.Generator().manual_seed(0)
    ref = reference.ReferenceStore(2, 3, 8, dtype=torch.float32)
    append_random(gen, (fork, ref), 2, 3, 8, torch.float32, "cpu", 5, masked=True)
    assert_holds(fork, ref)
    assert store.num_tokens == 0
