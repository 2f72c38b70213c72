"""A one-shot compression deferred by L decode steps (``Schedule(lookahead=L)``): the decoded
tokens' queries join the observation window (kvcache_ext/engine/lookahead.py).

- with a budget over the whole sequence the patched model is the unpatched one;
- with eviction the ragged path gives the reference path's logits and kept positions;
- the kept positions are a plain-PyTorch SnapKV over the prompt's newest queries and the L
  decoded tokens' queries, each head keeping its budget plus the L tokens;
- before its L-th step the cache holds the whole prompt (the full cache's logits);
- L = 0 is the one-shot schedule, and a deferred compression with nothing since is the one-shot one;
- greedy and sampled generation; the refusals.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvcache_ext
from kvcache_ext.engine.forward import prefill_dense
from kvcache_ext.engine.lookahead import compress_held
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.engine.state import LayerState
from kvcache_ext.evaluation.named_policies import make_policy
from kvcache_ext.policies import (H2O, AdaKV, KVzip, Lookahead, OneShot, Policy, Schedule, SnapKV, Spanned,
                                  Uniform)
from test_patch import assert_paths_agree, fed_tokens, inputs, teacher_forced
from tiny_models import tiny_model


def kept_positions(cache, layer):
    parts = cache.layer_kv(layer).view(None, False)
    return parts["pos"].masked_fill(~parts["mask"], -1)


def test_a_budget_over_the_sequence_gives_the_unpatched_model():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=40, pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask, steps=8)
    ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    policy = Policy(SnapKV(window=4, kernel=3), budget=100, schedule=Lookahead(3))
    with kvcache_ext.patch(model, policy) as handle:
        got = teacher_forced(model, handle.new_cache(), ids, mask, steps=8)
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, ref_tokens)


def test_b_int8_pages_ragged_path_equals_reference_path():
    """On int8 pages the deferred compression stores the tokens it keeps again from the values the
    pages give back: the ragged path stays the reference path's."""
    policy = Policy(SnapKV(window=4, kernel=3), budget=16, allocation=AdaKV(), schedule=Lookahead(4))
    ragged, _ = assert_paths_agree(policy, steps=8, kv_dtype="int8")
    for layer in range(3):
        assert ragged.layer_kv(layer).store.kv_dtype == torch.int8
        assert ragged.layers[layer].state.lookahead is None   # the compression ran


@pytest.mark.parametrize("allocation", [Uniform(), AdaKV()], ids=repr)
@pytest.mark.parametrize("steps", [1, 4])
def test_b_ragged_path_equals_reference_path(allocation, steps):
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    policy = Policy(SnapKV(window=4, kernel=3), budget=16, allocation=allocation, schedule=Lookahead(steps))
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=8)
        expected = teacher_forced(model, reference, ids, mask, steps=8)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    full = teacher_forced(model, None, ids, mask, steps=8)
    # Up to the L-th decode step's output nothing is evicted; after it the logits change.
    torch.testing.assert_close(got[:, :steps + 1], full[:, :steps + 1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[:, steps + 1:], full[:, steps + 1:], atol=1e-3)
    for layer in range(3):
        assert torch.equal(kept_positions(ragged, layer), kept_positions(reference, layer))
        assert ragged.layer_kv(layer).store.num_tokens == int(ragged.layer_kv(layer).lens.sum())
        assert ragged.layers[layer].state.lookahead is None
    if isinstance(allocation, Uniform):   # budget + the L tokens, then one per later step
        assert all(int(lens.max()) == 16 + 8 for lens in ragged.kept_tokens())


def _record_attention(model):
    """The unpatched model's queries and keys after RoPE, per layer."""
    seen = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query.detach().clone(), key.detach().clone())
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("lookahead_test_record", record)
    model.set_attn_implementation("lookahead_test_record")
    return seen


def test_c_kept_positions_are_snapkv_over_the_prompt_tail_and_the_decoded_queries():
    window, budget, steps, n = 4, 12, 3, 40
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=1, length=n)
    fed = fed_tokens(1, steps)
    policy = Policy(SnapKV(window=window, kernel=1), budget=budget, schedule=Lookahead(steps))
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        teacher_forced(model, cache, ids, mask, steps=steps, fed=fed)
    seen = _record_attention(model)
    with torch.no_grad():
        model(torch.cat([ids, fed], dim=1))
    model.set_attn_implementation("sdpa")
    total, rows = n + steps, window + steps
    for layer, (q, k) in seen.items():
        H, G = k.shape[1], q.shape[1] // k.shape[1]
        k = k.repeat_interleave(G, dim=1)
        logits = (q[:, :, -rows:] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5   # [1, Hq, rows, total]
        causal = torch.arange(total)[None, :] <= torch.arange(total - rows, total)[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        scores = probs.mean(dim=2).unflatten(1, (H, G)).mean(dim=2)[0]            # [H, total]
        scores[:, total - rows:] = float("inf")    # the prompt's window and the decoded tokens
        expected = scores.topk(budget + steps, dim=-1).indices.sort(dim=-1).values
        got = kept_positions(cache, layer)[0]
        assert torch.equal(got, expected), (layer, got, expected)


def test_e_lookahead_zero_is_one_shot_and_nothing_since_is_the_one_shot_compression():
    assert Schedule(lookahead=0) == OneShot()
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=50, pad=(0, 6))
    for allocation in (Uniform(), AdaKV()):
        zero = Policy(SnapKV(window=4, kernel=3), budget=14, allocation=allocation, schedule=Schedule(lookahead=0))
        one_shot = Policy(SnapKV(window=4, kernel=3), budget=14, allocation=allocation)
        with kvcache_ext.patch(model, zero) as handle:
            a = teacher_forced(model, handle.new_cache(), ids, mask, steps=4)
        with kvcache_ext.patch(model, one_shot) as handle:
            b = teacher_forced(model, handle.new_cache(), ids, mask, steps=4)
        assert torch.equal(a, b)
    # The deferred compression run with no query since the prompt keeps the one-shot tokens.
    torch.manual_seed(0)
    B, Hq, H, n, D = 2, 4, 2, 30, 8
    q, k, v = torch.randn(B, Hq, n, D) * 3, torch.randn(B, H, n, D) * 3, torch.randn(B, H, n, D)
    pos = torch.arange(n).expand(B, n)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, :5] = False
    kept = []
    for schedule in (OneShot(), Lookahead(2)):
        state = LayerState(0, 1, Policy(SnapKV(window=4, kernel=3), budget=10, allocation=AdaKV(),
                                        schedule=schedule), RaggedLayerKV)
        prefill_dense(state, q, k, v, pos, valid, 0.3)
        if state.lookahead is not None:
            assert int(state.kv.lens.min()) == n - 5   # the whole prompt held
            compress_held(state)
        parts = state.kv.view(None, False)
        kept.append(parts["pos"].masked_fill(~parts["mask"], -1))
    assert torch.equal(kept[0], kept[1])


def test_generate_greedy_and_sampling():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=40, pad=(0, 5))
    policy = Policy(SnapKV(window=4, kernel=3), budget=12, schedule=Lookahead(3))
    with kvcache_ext.patch(model, policy):
        outs = []
        for sample in (False, True):
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=sample, top_k=0,
                                 return_dict_in_generate=True)
            # budget + the 3 lookahead tokens + the 6 steps after the compression
            assert all(int(lens.max()) == 12 + 9 for lens in out.past_key_values.kept_tokens())
            outs.append(out.sequences)
    assert outs[0].shape == outs[1].shape == (2, 50)


def test_named_policies_carry_their_lookahead():
    policy = make_policy("ada-snapkv-lookahead", 64)
    assert policy.schedule.lookahead == 8 and isinstance(policy.allocation, AdaKV)
    spans = make_policy("ada-snapkv-spans-lookahead", 64)
    assert isinstance(spans.scorer, Spanned) and spans.schedule.lookahead == 8
    assert make_policy("ada-snapkv-deferred", 64).schedule == Schedule(lookahead=8, lookahead_queries=False)
    sentences = make_policy("ada-snapkv-sentences-lookahead", 64)
    assert sentences.scorer.spans.unit == "sentence" and sentences.schedule.lookahead == 8
    assert make_policy("ada-snapkv-sentences", 64).schedule == Schedule()
    with pytest.raises(ValueError, match="lookahead"):
        make_policy("snapkv-lookahead", 64, Schedule(decode_every=1))


def test_d_bad_arguments_are_refused():
    for bad in (-1, 4097, 1.5):
        with pytest.raises(ValueError, match=r"Schedule lookahead must be an integer in \[0, 4096\].*got"):
            Schedule(lookahead=bad)
    for bad in ("3", True, None):
        with pytest.raises(TypeError, match="Schedule lookahead"):
            Schedule(lookahead=bad)
    with pytest.raises(ValueError, match="Lookahead steps"):
        Lookahead(0)
    with pytest.raises(ValueError, match=r"lookahead \(= 4\).*prefill_block \(= 16\)"):
        Schedule(prefill_block=16, lookahead=4)
    with pytest.raises(ValueError, match=r"lookahead \(= 4\).*decode_every \(= 1\)"):
        Schedule(decode_every=1, lookahead=4)
    with pytest.raises(ValueError, match="lookahead=4 .*H2O scores from no such window"):
        Policy(H2O(), budget=32, schedule=Lookahead(4))
    with pytest.raises(ValueError):
        Policy(KVzip(), budget=32, schedule=Lookahead(4))
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16, schedule=Lookahead(2))) as handle:
        with pytest.raises(ValueError, match="share_prefix.*lookahead"):
            handle.share_prefix(list(range(20)))
        with pytest.raises(NotImplementedError, match="Schedule lookahead"):
            model.init_continuous_batching()
        cache = handle.new_cache()
        teacher_forced(model, cache, *inputs(batch=1, length=30), steps=1)
        with pytest.raises(RuntimeError, match="deferred compression"):
            cache.fork()


def test_without_the_queries_since_the_prompt_is_scored_by_its_own_window():
    """lookahead_queries=False (the ablation): the same kept positions as the prompt alone scored
    by SnapKV's window, plus the tokens since."""
    window, budget, steps, n = 4, 12, 3, 40
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=1, length=n)
    fed = fed_tokens(1, steps)
    policy = Policy(SnapKV(window=window, kernel=1), budget=budget,
                    schedule=Schedule(lookahead=steps, lookahead_queries=False))
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        teacher_forced(model, cache, ids, mask, steps=steps, fed=fed)
    seen = _record_attention(model)
    with torch.no_grad():
        model(ids)
    model.set_attn_implementation("sdpa")
    for layer, (q, k) in seen.items():
        H, G = k.shape[1], q.shape[1] // k.shape[1]
        k = k.repeat_interleave(G, dim=1)
        logits = (q[:, :, -window:] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        causal = torch.arange(n)[None, :] <= torch.arange(n - window, n)[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        scores = probs.mean(dim=2).unflatten(1, (H, G)).mean(dim=2)[0]
        scores[:, n - window:] = float("inf")
        prompt = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        expected = torch.cat([prompt, torch.arange(n, n + steps).expand(H, steps)], dim=1)
        assert torch.equal(kept_positions(cache, layer)[0], expected), layer
    with pytest.raises(TypeError, match="Schedule lookahead_queries"):
        Schedule(lookahead=2, lookahead_queries="no")


def test_a_sliding_window_layer_keeps_its_window_through_the_lookahead():
    """Gemma 3's sliding layer (window 12) under a lookahead: the ragged path gives the reference
    path's logits and kept positions, a budget over the sequence gives the unpatched logits, and
    the sliding layer holds only positions its next query sees."""
    model = tiny_model("gemma3_text", heads=4, kv_heads=2, layers=2, sliding_window=12)
    ids, mask = inputs(batch=1, length=40)
    full = teacher_forced(model, None, ids, mask, steps=6)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4, kernel=3), budget=100, schedule=Lookahead(3))) as handle:
        torch.testing.assert_close(teacher_forced(model, handle.new_cache(), ids, mask, steps=6), full,
                                   atol=1e-4, rtol=1e-4)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4, kernel=3), budget=10, schedule=Lookahead(3))) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=6)
        expected = teacher_forced(model, reference, ids, mask, steps=6)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for layer in range(2):
        assert torch.equal(kept_positions(ragged, layer), kept_positions(reference, layer))
    newest = 40 + 6 - 1
    kept = kept_positions(ragged, 0)
    assert int(kept[kept >= 0].min()) > newest - 12
