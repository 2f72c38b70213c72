"""A compressed prefix shared by many sequences (handle.share_prefix, RaggedCache.fork): each
gets the tokens it gets with its own copy of the compressed prefix, and nobody copies its pages."""
import pytest
import torch
from transformers import GenerationConfig

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import H2O, AdaKV, BlockwisePrefill, EveryStep, ExpectedAttention, Policy, SnapKV, StreamingLLM
from test_serving import ContinuousBatchingConfig, SMALL_ENGINE, needs_engine
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 6
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
POLICIES = [Policy(SnapKV(window=4), budget=16),
            Policy(ExpectedAttention(), ratio=0.3, allocation=AdaKV()),
            Policy(StreamingLLM(sinks=2), budget=40)]


def tokens(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def with_own_copy(model, handle, prefix, question, reference=False):
    """Greedy tokens and logits of prefix + question over a cache that compressed the prefix
    itself: the prefix as a prompt, then the question continuing it."""
    cache = handle.new_cache(reference=reference)
    with torch.no_grad():
        model(torch.tensor([prefix]), **with_cache(model, cache), use_cache=True)
    return continue_over(model, cache, prefix, question)


def continue_over(model, cache, prefix, question):
    ids = torch.tensor([prefix + question])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GREEDY,
                         output_logits=True, return_dict_in_generate=True, **with_cache(model, cache))
    return out.sequences[0, len(prefix) + len(question):].tolist(), torch.stack(out.logits), cache


def store_bits(cache):
    """Every layer's tokens (K, V, positions) as its store holds them."""
    dense = [layer.state.kv.store.to_dense() for layer in cache.layers]
    return [(d.k.clone(), d.v.clone(), d.pos.clone(), d.lens.clone()) for d in dense]


@pytest.mark.parametrize("policy,kv_dtype", [(p, None) for p in POLICIES] + [(POLICIES[0], "int8")],
                         ids=["snapkv", "expected-attention-adakv", "streamingllm", "snapkv-int8-pages"])
def test_sequences_on_forks_of_a_prefix_get_the_tokens_of_their_own_copy(policy, kv_dtype):
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    prefix, *questions = tokens(70, 5, 9, 1)
    with kvcache_ext.patch(model, policy, kv_dtype=kv_dtype) as handle:
        shared = handle.share_prefix(prefix)
        before = store_bits(shared.cache)
        for question in questions:
            want, want_logits, own = with_own_copy(model, handle, prefix, question)
            got, got_logits, fork = continue_over(model, shared.fork(), prefix, question)
            assert got == want
            torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
            # The fork reads the prefix's pages: it holds the question, the answer and at most
            # one copied page per head; the own copy holds all of it.
            assert fork.nbytes < own.nbytes
            assert fork.get_seq_length() == own.get_seq_length()
            for mine, theirs in zip(fork.layers, shared.cache.layers):
                pool, prefix_pool = mine.state.kv.store.state()[0], theirs.state.kv.store.state()[0]
                assert [t.data_ptr() for t in pool[:len(prefix_pool)]] == [t.data_ptr() for t in prefix_pool]
        # Nothing was written into the prefix's pages.
        for (k, v, pos, lens), (k2, v2, pos2, lens2) in zip(before, store_bits(shared.cache)):
            assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(pos, pos2) and torch.equal(lens, lens2)
        # The reference path (dense masked cache; its fork is a copy) gives the same logits.
        _, ref_logits, _ = with_own_copy(model, handle, prefix, questions[0], reference=True)
        _, got_logits, _ = continue_over(model, shared.fork(), prefix, questions[0])
        torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_share_prefix_refuses_what_it_cannot_share():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    (prefix,) = tokens(30)
    with kvcache_ext.patch(model, Policy(H2O(recent=2), budget=16, schedule=EveryStep())) as handle:
        with pytest.raises(ValueError, match="evicts over the cache"):
            handle.share_prefix(prefix)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16, schedule=BlockwisePrefill(16))) as handle:
        with pytest.raises(ValueError, match="one-shot schedule"):
            handle.share_prefix(prefix)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)) as handle:
        with pytest.raises(ValueError, match="is empty"):
            handle.share_prefix([])
        with pytest.raises(TypeError, match="list of token ids"):
            handle.share_prefix("some text")
        with pytest.raises(ValueError, match="1-D integer tensor"):
            handle.share_prefix(torch.ones(2, 3))
        with pytest.raises(ValueError, match=f"vocabulary size {VOCAB}, got {VOCAB}"):
            handle.share_prefix([1, VOCAB])
        shared = handle.share_prefix(torch.tensor(prefix))
        with pytest.raises(ValueError, match="already shared"):
            handle.share_prefix(prefix)
        assert handle.prefixes.match(prefix + [1]) is shared and handle.prefixes.match(prefix) is None
        handle.unshare_prefix(shared)
        assert handle.prefixes.match(prefix + [1]) is None and len(handle.prefixes) == 0


# --- served by the continuous batching engine ----------------------------------------------------
def reservation_probe(monkeypatch):
    """The most requests (not prefixes) holding a reservation at once, and the caches made."""
    from kvcache_ext.serving import RaggedPagedCache
    seen = {"most": 0, "forks": 0, "fresh": 0}
    original = RaggedPagedCache.extend_read_and_write_indices

    def probe(self, request_id, *args):
        known = request_id in self.requests
        original(self, request_id, *args)
        if not known:
            seen["forks" if request_id in self.on_prefix else "fresh"] += 1
        requests = [key for key in self.admission.reserved if not key.startswith("shared prefix")]
        seen["most"] = max(seen["most"], len(requests))
        assert self.admission.reserved_bytes <= self.admission.budget_bytes
    monkeypatch.setattr(RaggedPagedCache, "extend_read_and_write_indices", probe)
    return seen


@needs_engine
@pytest.mark.parametrize("policy", POLICIES[:2], ids=["snapkv", "expected-attention-adakv"])
@pytest.mark.parametrize("max_batch_tokens", [256, 8])
def test_served_requests_sharing_a_prefix_get_the_tokens_of_their_own_copy(policy, max_batch_tokens, monkeypatch):
    """Requests whose prompts start with a shared prefix run on forks of it (their rest split
    over steps when a step is short), a request that does not is compressed as alone, and every
    request's pages are freed at the end while the prefix stays."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    prefix, *questions, other = tokens(70, 5, 9, 1, 12, 40)
    inputs = [prefix + q for q in questions] + [other]
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        expected = [with_own_copy(model, handle, prefix, q)[0] for q in questions]
        out = model.generate(torch.tensor([other]), attention_mask=torch.ones(1, len(other), dtype=torch.long),
                             generation_config=GREEDY)
        expected.append(out[0, len(other):].tolist())
        shared = handle.share_prefix(prefix)
        seen = reservation_probe(monkeypatch)
        out = model.generate_batch(inputs, generation_config=GREEDY, persistent_manager=True,
                                   continuous_batching_config=ContinuousBatchingConfig(
                                       **{**SMALL_ENGINE, "max_batch_tokens": max_batch_tokens}))
        assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
        assert [r.generated_tokens for r in out.values()] == expected
        assert seen["forks"] == len(questions) and seen["fresh"] == 1
        cache = model._cached_continuous_batching_manager.batch_processor.cache
        assert cache.requests == {} and cache.nbytes == 0 and cache.on_prefix == {}
        assert list(cache.admission.reserved) == [cache.prefix_key(shared)]      # the prefix, reserved once
        assert cache.prefix_bytes == shared.nbytes > 0
        model.destroy_cached_continuous_batching_manager()


@needs_engine
def test_a_shared_prefix_admits_more_requests_than_copies_of_it_in_the_same_budget(monkeypatch):
    """At one KV budget, requests each holding their own compressed copy of a long prompt run
    one at a time; over the shared prefix, most of them run at once."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    policy = Policy(ExpectedAttention(), ratio=0.5)
    prefix, *questions = tokens(400, 6, 7, 8, 9, 10, 11)
    inputs = [prefix + q for q in questions]
    engine = {**SMALL_ENGINE, "num_blocks": 24, "max_batch_tokens": 512}
    most = {}
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        for shared in (False, True):
            if shared:
                handle.share_prefix(prefix)
            seen = reservation_probe(monkeypatch)
            out = model.generate_batch(inputs, generation_config=GREEDY,
                                       continuous_batching_config=ContinuousBatchingConfig(**engine))
            assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
            most[shared] = seen["most"]
            monkeypatch.undo()
    assert most[False] == 1 and most[True] >= 4, most


@needs_engine
def test_a_request_over_a_prefix_that_could_never_fit_fails_alone():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    prefix, question, long_question = tokens(100, 6, 3000)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)) as handle, torch.no_grad():
        handle.share_prefix(prefix)
        out = model.generate_batch([prefix + question, prefix + long_question], generation_config=GREEDY,
                                   continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
    first, second = out.values()
    assert first.error is None and len(first.generated_tokens) == NEW_TOKENS
    assert second.error is not None and "exceeds the KV budget" in second.error


@needs_engine
def test_kvzip_serves_requests_over_a_context_it_compressed_once():
    """KVzip's reconstruction passes run once, when the context is shared (outside the engine);
    the requests that continue it get the tokens of their own copy."""
    from kvcache_ext.policies import KVzip
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    policy = Policy(KVzip(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None), budget=16)
    prefix, *questions = tokens(60, 5, 9)
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        expected = [with_own_copy(model, handle, prefix, q)[0] for q in questions]
        handle.share_prefix(prefix)
        out = model.generate_batch([prefix + q for q in questions], generation_config=GREEDY,
                                   continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    assert [r.generated_tokens for r in out.values()] == expected


@needs_engine
@pytest.mark.parametrize("policy", POLICIES, ids=["snapkv", "expected-attention-adakv", "streamingllm"])
@pytest.mark.parametrize("question,new_tokens", [(5, 6), (40, 30), (1, 1)])
def test_a_fork_holds_at_most_what_its_request_reserves(policy, question, new_tokens):
    """Footprint.fork_bytes bounds the bytes a request's fork holds at every step, made as the
    serving cache makes it (told its longest sequence: its pages taken at once)."""
    from kvcache_ext.serving.admission import Footprint
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    prefix, rest = tokens(90, question, seed=question)
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        shared = handle.share_prefix(prefix)
        footprint = Footprint(handle.shape, model.dtype.itemsize, handle.page_size, policy.scorer.capabilities.channels)
        longest = len(prefix) + question + new_tokens
        reserved = footprint.fork_bytes(shared.pages, question + new_tokens, longest)
        cache = shared.fork(max_cache_len=longest)
        grows = cache.nbytes
        out = model(torch.tensor([rest]), **with_cache(model, cache), use_cache=True)
        peak = cache.nbytes
        for _ in range(new_tokens - 1):
            out = model(out.logits[:, -1:].argmax(-1), **with_cache(model, cache), use_cache=True)
            peak = max(peak, cache.nbytes)
    assert 0 < grows == peak <= reserved          # every page taken when forked: decoding allocates nothing


@needs_engine
def test_an_unshared_prefix_gives_its_room_back_once_nobody_reads_it():
    """Reserved once from its first reader, a prefix stays reserved while shared; unshared, its
    room is given back when the next request arrives (nobody reads it any more)."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    prefix, question, other = tokens(70, 5, 30)
    config = ContinuousBatchingConfig(**SMALL_ENGINE)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)) as handle, torch.no_grad():
        shared = handle.share_prefix(prefix)
        manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=config)
        manager.start()
        try:
            def serve(ids):
                (request_id,) = manager.add_requests(inputs=[ids], max_new_tokens=NEW_TOKENS)
                result = manager.get_result(request_id=request_id, timeout=120)
                while result is not None and not result.is_finished():
                    result = manager.get_result(request_id=request_id, timeout=120)
                assert result is not None and result.error is None
            serve(prefix + question)
            cache = manager.batch_processor.cache
            assert list(cache.admission.reserved) == [cache.prefix_key(shared)]
            handle.unshare_prefix(shared)
            serve(other)
            assert cache.admission.reserved == {} and cache.reserved_prefixes == {}
        finally:
            manager.stop(block=True)
