"""Continuous batching with eviction (kvcache_ext.serving): a patched model's ``generate_batch``
serves every request from its own ragged cache, with the tokens it gets alone."""
import pytest
import torch
import transformers
from transformers import GenerationConfig

import kvcache_ext
from kvcache_ext.policies import H2O, AdaKV, EveryStep, Policy, SnapKV, StreamingLLM
from tiny_models import VOCAB, tiny_model

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:    # transformers 5.2 (CI's oldest): its engine has no such config
    ContinuousBatchingConfig = None
needs_engine = pytest.mark.skipif(ContinuousBatchingConfig is None, reason=(
    f"transformers {transformers.__version__} has no ContinuousBatchingConfig: these tests need its "
    "continuous batching engine as 5.24 has it"))

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 6
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
SMALL_ENGINE = dict(num_blocks=64, max_batch_tokens=256, page_size=16)


def prompts(lengths=(40, 33, 52, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.skipif(ContinuousBatchingConfig is not None, reason="this transformers has the engine")
def test_continuous_batching_says_what_it_needs_on_an_older_transformers():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)):
        with pytest.raises(ImportError, match=f"transformers {transformers.__version__} lacks it"):
            model.init_continuous_batching()


def served(model, inputs, **engine):
    out = model.generate_batch(inputs, generation_config=GREEDY,
                               continuous_batching_config=ContinuousBatchingConfig(**{**SMALL_ENGINE, **engine}))
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    return [r.generated_tokens for r in out.values()]


def alone(model, inputs):
    """Each prompt by itself through ``generate`` (its mask given: token 0 is not padding)."""
    tokens = []
    for p in inputs:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GREEDY)
        tokens.append(out[0, len(p):].tolist())
    return tokens


@needs_engine
@pytest.mark.parametrize("policy", [
    Policy(SnapKV(window=4), budget=16),
    Policy(SnapKV(window=4), budget=16, allocation=AdaKV()),
    Policy(H2O(recent=2), budget=16, schedule=EveryStep()),
    Policy(StreamingLLM(sinks=2), budget=12, schedule=EveryStep()),
], ids=lambda p: repr(p)[:60].replace(" ", ""))
def test_each_request_gets_the_tokens_it_gets_alone(policy):
    """All prompts prefilled in one step, then (64 tokens a step) each prompt joining while the
    earlier ones decode, and finished requests leaving while others go on."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    inputs = prompts()
    with kvcache_ext.patch(model, policy):
        expected = alone(model, inputs)
        assert served(model, inputs) == expected
        assert served(model, inputs, max_batch_tokens=64) == expected


@needs_engine
def test_a_budget_at_least_the_prompt_gives_the_unpatched_engine_tokens():
    model = tiny_model("qwen2", heads=6, kv_heads=2, layers=2)
    inputs = prompts()
    stock = served(model, inputs)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=1000)):
        assert served(model, inputs) == stock
    assert "init_continuous_batching" not in vars(model)          # unpatched: the stock engine again


@needs_engine
def test_requests_hold_ragged_caches_while_served_and_none_after():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    inputs = prompts()
    made, freed = [], []
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)) as handle, torch.no_grad():
        new_cache = handle.new_cache
        handle.new_cache = lambda *a, **k: made.append(new_cache(*a, **k)) or made[-1]
        out = model.generate_batch(inputs, generation_config=GREEDY, persistent_manager=True,
                                   continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
        from kvcache_ext.serving import RaggedBatchingManager, RaggedPagedCache
        manager = model._cached_continuous_batching_manager
        assert isinstance(manager, RaggedBatchingManager)
        cache = manager.batch_processor.cache
        assert isinstance(cache, RaggedPagedCache)
        assert len(made) == len(inputs) and all(r.error is None for r in out.values())
        assert cache.requests == {} and cache.nbytes == 0                # every request's pages freed
        # Each request's cache held its kept tokens only: budget 16 + the decoded ones, per KV head.
        for c in made:
            kept = c.kept_tokens()
            assert all(int(k.max()) <= 16 + NEW_TOKENS for k in kept)
        model.destroy_cached_continuous_batching_manager()


@needs_engine
@pytest.mark.parametrize("policy", [Policy(SnapKV(window=4), budget=16),
                                    Policy(SnapKV(window=4), budget=16, allocation=AdaKV())],
                         ids=["snapkv", "ada-snapkv"])
def test_a_prompt_split_over_steps_is_compressed_whole(policy):
    """The engine splits prompts longer than its per-step token budget over several steps; a
    one-shot policy compresses each prompt once, whole, as when it comes in one piece."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    inputs = prompts((90, 41, 70))
    with kvcache_ext.patch(model, policy) as handle:
        expected = alone(model, inputs)
        assert served(model, inputs, max_batch_tokens=32) == expected


@needs_engine
def test_a_scorer_that_reruns_the_model_refuses_a_prompt_without_a_shared_prefix():
    """KVzip's passes do not run in the engine: a request that does not continue a shared prefix
    (tests/test_shared_prefix.py serves those) fails alone, with what to do instead."""
    from kvcache_ext.policies import KVzip
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    with kvcache_ext.patch(model, Policy(KVzip(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None), budget=16)):
        out = model.generate_batch(prompts((20,)), generation_config=GREEDY,
                                   continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
    (result,) = out.values()
    assert result.error is not None and "reconstruction passes" in result.error
    assert "handle.share_prefix" in result.error


# --- admission by our pages (what a request reserves: tests/test_admission.py) -------------------
def admission_probe(monkeypatch):
    """Records the most requests holding a reservation at once, and every reservation made."""
    from kvcache_ext.serving import RaggedPagedCache
    seen = {"most": 0, "made": []}
    original = RaggedPagedCache.can_store_request_tokens

    def probe(self, state, request_len, dry_run=False):
        fits = original(self, state, request_len, dry_run)
        seen["most"] = max(seen["most"], len(self.admission.reserved))
        seen["budget"] = self.admission.budget_bytes
        if fits and state.request_id not in {r for r, _ in seen["made"]}:
            seen["made"].append((state.request_id, self.admission.reserved[state.request_id]))
        assert self.admission.reserved_bytes <= self.admission.budget_bytes
        return fits
    monkeypatch.setattr(RaggedPagedCache, "can_store_request_tokens", probe)
    return seen


@needs_engine
def test_admission_counts_the_pages_requests_reserve(monkeypatch):
    """With a KV budget of num_blocks blocks, as many requests run at once as their reservations
    fit in it, the others wait (and then get their alone tokens), and every reservation is given
    back at the end; the engine's own pages stay as small as it allows."""
    from kvcache_ext.serving.admission import Footprint
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    policy = Policy(SnapKV(window=4), budget=16)
    inputs = prompts((60, 61, 62, 63, 64, 65))
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        expected = alone(model, inputs)
        footprint = Footprint(handle.shape, model.dtype.itemsize, handle.page_size,
                              policy.scorer.capabilities.channels)
        each = footprint.request_bytes(policy, 65, NEW_TOKENS, 256)
        block = 2 * 2 * 2 * 16 * 4 * 16                 # layers x (K, V) x KV heads x D x float32 x page
        num_blocks = -(-3 * each // block)                 # room for three of them, not four
        assert 4 * footprint.request_bytes(policy, 60, NEW_TOKENS, 256) > num_blocks * block
        seen = admission_probe(monkeypatch)
        out = model.generate_batch(inputs, generation_config=GREEDY, persistent_manager=True,
                                   continuous_batching_config=ContinuousBatchingConfig(
                                       **{**SMALL_ENGINE, "num_blocks": num_blocks}))
        assert [r.generated_tokens for r in out.values()] == expected
        assert seen["most"] == 3 and seen["budget"] == num_blocks * block
        assert sorted(r for r, _ in seen["made"]) == sorted(out)
        cache = model._cached_continuous_batching_manager.batch_processor.cache
        assert cache.admission.reserved == {} and cache.requests == {}
        # The engine's pages: one block's worth and its two trash sectors, not num_blocks blocks.
        assert cache.cache_tensor.nbytes < 4 * block
        model.destroy_cached_continuous_batching_manager()


@needs_engine
def test_eviction_admits_more_requests_than_the_whole_prompt_in_the_same_budget(monkeypatch):
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    inputs = prompts((120,) * 8)
    most = {}
    for name, policy in [("full", Policy(SnapKV(window=4), budget=10_000)),
                         ("snapkv", Policy(SnapKV(window=4), ratio=0.125))]:
        with kvcache_ext.patch(model, policy), torch.no_grad():
            seen = admission_probe(monkeypatch)
            served(model, inputs, num_blocks=16, max_batch_tokens=512)
            most[name] = seen["most"]
            monkeypatch.undo()
    assert most["full"] == 1 and most["snapkv"] >= 4, most    # 120 tokens reserve 126 per head, or 32


@needs_engine
def test_a_request_that_could_never_fit_fails_alone_with_a_clear_error():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    inputs = prompts((40, 600, 33))
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=2000)):
        expected = alone(model, [inputs[0], inputs[2]])
        out = model.generate_batch(inputs, generation_config=GREEDY,
                                   continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
    results = list(out.values())
    assert results[1].error is not None and "whole KV budget is" in results[1].error
    assert "prompt 600 tokens" in results[1].error and "raise the budget (num_blocks)" in results[1].error
    assert [results[0].generated_tokens, results[2].generated_tokens] == expected
    assert results[0].error is None and results[2].error is None


@needs_engine
def test_several_sequences_per_request_are_refused_before_anything_runs():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, num_return_sequences=2, eos_token_id=-1,
                              pad_token_id=0)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)):
        with pytest.raises(ValueError, match="num_return_sequences = 2: several sequences per request"):
            model.generate_batch(prompts((20,)), generation_config=config,
                                 continuous_batching_config=ContinuousBatchingConfig(**SMALL_ENGINE))
