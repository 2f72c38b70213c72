"""What a patched model's cache holds: the kept tokens in whole pages, over long decodes.

The lean-store bounds (issue 17): after a prompt, bytes held <= 1.05 x the kept tokens' bytes
(K, V, position, score channels) + one page per head; 1,000 decode steps hold the bytes flat
with per-step eviction, and grow by whole pages only without eviction; no step moves the
tokens already stored (``repacks``) or allocates more than the pages that filled up.
"""
import pytest
import torch

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import H2O, AdaKV, BlockwisePrefill, EveryStep, Policy, SnapKV
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

B, LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 2, 16


def stores(cache):
    return [cache.layer_kv(layer).store for layer in range(LAYERS)]


def token_bytes(store) -> int:
    """Bytes of one kept token: K, V, its position and its score channels."""
    return 2 * store.head_dim * store.dtype.itemsize + 4 + 4 * store.score_channels


def table_bytes(store) -> int:
    return store.page_table.numel() * 4 + store.num_pages * 8 + store.batch * store.heads * 4


def prefill(model, cache, length=200, pad=(0, 9)):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, length), generator=g)
    mask = torch.ones(B, length, dtype=torch.long)
    for row, p in enumerate(pad):
        mask[row, :p] = 0
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos, **with_cache(model, cache), use_cache=True)
    return mask, pos[:, -1:]


def decode(model, cache, mask, last_pos, steps, after_step):
    fed = torch.randint(0, VOCAB, (B, steps), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            model(fed[:, t:t + 1], attention_mask=mask, position_ids=last_pos + t + 1,
                  **with_cache(model, cache), use_cache=True)
            after_step(t)


POLICIES = {
    "snapkv": Policy(SnapKV(window=8), budget=40),
    "ada-snapkv": Policy(SnapKV(window=8), budget=40, allocation=AdaKV()),
    "h2o-step": Policy(H2O(), budget=40, schedule=EveryStep()),
    "h2o-blockwise": Policy(H2O(), budget=40, schedule=BlockwisePrefill(32)),
}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", list(POLICIES))
def test_after_a_prompt_the_cache_holds_the_kept_tokens_and_one_page_per_head(name, page_size):
    model = tiny_model("llama", heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    with kvcache_ext.patch(model, POLICIES[name], page_size=page_size) as handle:
        cache = handle.new_cache()
        prefill(model, cache)
        for store in stores(cache):
            kept = store.num_tokens * token_bytes(store)
            reserve = store.batch * store.heads * page_size * token_bytes(store)
            assert store.free_pages == 0
            assert store.nbytes <= 1.05 * kept + reserve          # page tables included
            assert bool((store.caps - store.lens < page_size + (name == "h2o-step")).all())


def test_a_thousand_steps_of_per_step_eviction_hold_the_bytes_flat():
    model = tiny_model("llama", heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    with kvcache_ext.patch(model, Policy(H2O(), budget=40, schedule=EveryStep())) as handle:
        cache = handle.new_cache()
        mask, last_pos = prefill(model, cache)
        held = [s.nbytes for s in stores(cache)]
        before = [(s.slab_allocations, s.repacks) for s in stores(cache)]

        def check(step):
            assert [s.nbytes for s in stores(cache)] == held, step
            assert all(int(s.lens.max()) == 40 for s in stores(cache)), step

        decode(model, cache, mask, last_pos, 1000, check)
        assert [(s.slab_allocations, s.repacks) for s in stores(cache)] == before


def test_a_thousand_steps_without_eviction_grow_by_whole_pages_and_move_nothing():
    model = tiny_model("llama", heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    policy = Policy(SnapKV(window=8), budget=37, allocation=AdaKV())   # unequal heads
    with kvcache_ext.patch(model, policy, page_size=16) as handle:
        cache = handle.new_cache()
        mask, last_pos = prefill(model, cache)
        first = [s.to_dense().k.clone() for s in stores(cache)]
        lens0 = [s.lens.clone() for s in stores(cache)]
        repacks = [s.repacks for s in stores(cache)]
        allocations = [s.slab_allocations for s in stores(cache)]
        page_bytes = [(s.nbytes - table_bytes(s)) // s.num_pages for s in stores(cache)]
        history = [[s.num_pages for s in stores(cache)]]

        def check(step):
            for i, s in enumerate(stores(cache)):
                assert torch.equal(s.lens, lens0[i] + step + 1)
                # The pages the tokens need, and at most the next one: a slab that a head
                # needs also holds the next page of the heads that fill theirs within 8 tokens.
                assert (s.caps >= (s.lens + 15) // 16 * 16).all(), step
                assert (s.caps <= (s.lens + 8 + 15) // 16 * 16).all(), step
                assert s.num_pages * 16 == int(s.caps.sum()) and s.free_pages == 0
                assert (s.nbytes - table_bytes(s)) == s.num_pages * page_bytes[i]
            history.append([s.num_pages for s in stores(cache)])

        decode(model, cache, mask, last_pos, 1000, check)
        for i, s in enumerate(stores(cache)):
            grown = [b[i] - a[i] for a, b in zip(history, history[1:])]
            assert max(grown) <= B * KV_HEADS and min(grown) >= 0     # at most a page per head
            assert s.repacks == repacks[i]                            # no token ever moved
            # One allocation per step that added pages; after one, every head has 8 free
            # slots or more, so at most one allocation per 8 steps (without the lookahead,
            # heads of unequal lengths would allocate on most steps).
            steps_adding = sum(g > 0 for g in grown)
            assert s.slab_allocations - allocations[i] == steps_adding
            assert 1000 // 16 <= steps_adding <= 1000 // 8 + 1
            dense = s.to_dense()
            for b in range(B):
                for h in range(KV_HEADS):
                    n = int(lens0[i][b, h])
                    assert torch.equal(dense.k[b, h, :n], first[i][b, h, :n])


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "h2o-blockwise"])
def test_a_cache_that_knows_its_length_decodes_without_allocating(name, page_size):
    """``max_cache_len``: a growing cache holds pages for every token to come after its prompt
    (no more than the pages they need), decoding them allocates and moves nothing, and a token
    beyond the length still fits (the store grows as without it)."""
    model = tiny_model("llama", heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    steps, length = 50, 200
    with kvcache_ext.patch(model, POLICIES[name], page_size=page_size) as handle:
        cache = handle.new_cache(max_cache_len=length + steps)
        mask, last_pos = prefill(model, cache, length=length)
        need = [(s.lens + steps + page_size - 1) // page_size * page_size for s in stores(cache)]
        for s, caps in zip(stores(cache), need):
            assert torch.equal(s.caps, caps) and s.free_pages == 0
        before = [(s.slab_allocations, s.repacks, s.num_pages) for s in stores(cache)]
        decode(model, cache, mask, last_pos, steps, lambda step: None)
        assert [(s.slab_allocations, s.repacks, s.num_pages) for s in stores(cache)] == before
        lens = [s.lens.clone() for s in stores(cache)]
        mask = torch.cat([mask, torch.ones(B, steps, dtype=mask.dtype)], dim=1)
        decode(model, cache, mask, last_pos + steps, page_size, lambda step: None)   # past the length
        for s, n in zip(stores(cache), lens):
            assert torch.equal(s.lens, n + page_size) and bool((s.caps >= s.lens).all())
            assert s.slab_allocations > 0


class StoreCounts:
    """A logits processor that records, at every step of ``generate``, the slab allocations of
    the cache's stores (the processor runs after each forward)."""

    def __init__(self, handle):
        self.handle, self.seen = handle, []

    def __call__(self, input_ids, scores):
        self.seen.append([s.slab_allocations for s in stores(self.handle.last_cache)])
        return scores


@pytest.mark.parametrize("reserve", [True, False])
def test_generate_reserves_the_tokens_max_new_tokens_allows(reserve):
    """``patch(reserve_new_tokens=True)`` (the default): after ``generate``'s prompt, its cache
    holds pages for the max_new_tokens - 1 tokens it will feed back, and no decode step of an
    Ada-KV cache (heads of unequal lengths) allocates; False: pages come as they fill up."""
    from transformers import LogitsProcessorList
    model = tiny_model("llama", heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    new = 40
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (B, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                                     # left padding
    with kvcache_ext.patch(model, POLICIES["ada-snapkv"], reserve_new_tokens=reserve) as handle:
        counts = StoreCounts(handle)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, logits_processor=LogitsProcessorList([counts]),
                                 pad_token_id=0, return_dict_in_generate=True)
        cache = out.past_key_values
        assert out.sequences.shape[1] == 120 + new and len(counts.seen) == new
        for s in stores(cache):   # the pages the tokens need (and the lookahead's, without reserving)
            ahead = 0 if reserve else 8
            assert bool((s.caps >= s.lens).all()) and bool((s.caps <= (s.lens + ahead + 15) // 16 * 16).all())
        if reserve:
            assert all(seen == counts.seen[0] for seen in counts.seen)
        else:
            assert counts.seen[-1] != counts.seen[0]
    # The same tokens either way: reserving changes where tokens live, not what is computed.
    with kvcache_ext.patch(model, POLICIES["ada-snapkv"], reserve_new_tokens=not reserve):
        with torch.no_grad():
            other = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)
    assert torch.equal(other, out.sequences)
