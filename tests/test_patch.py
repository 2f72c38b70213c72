"""kvcache_ext.patch on tiny random-weight HF models of every supported architecture.

- budget >= sequence length: the patched model gives the unpatched model's logits;
- with eviction: the ragged path (RaggedCache: compiled store, kernels) gives the logits of
  the reference path (MaskedCache: dense full-size cache, evicted entries masked per head,
  plain PyTorch), for every scorer, allocation and schedule;
- batches with left padding, positions after eviction, generate modes, unpatch, errors.
"""
import gc
import itertools
import weakref

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, OneShot,
                                  Policy, Pyramid, Random, SnapKV, StreamingLLM, Uniform)
from kvcache_ext.hf.cache import MaskedCache
from tiny_models import ARCHS, VOCAB, tiny_model



pytestmark = pytest.mark.usefixtures("one_thread")


HEAD_LAYOUTS = {"gqa": (6, 2), "mqa": (4, 1), "mha": (4, 4)}


def inputs(batch=1, length=48, pad=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, p in enumerate(pad):
        mask[row, :p] = 0
    return ids, mask


def fed_tokens(batch, steps, seed=2):
    return torch.randint(0, VOCAB, (batch, steps), generator=torch.Generator().manual_seed(seed))


def teacher_forced(model, cache, ids, mask, steps=6, fed=None):
    """Logits of the prompt's last token and of `steps` fed tokens, one at a time: [B, steps+1, V]."""
    fed = fed_tokens(ids.shape[0], steps) if fed is None else fed
    out = []
    # Positions as generate computes them: left padding does not shift a row's positions.
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    with torch.no_grad():
        kwargs = {} if cache is None else with_cache(model, cache)
        o = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        cache = o.past_key_values
        out.append(o.logits[:, -1])
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            o = model(fed[:, t:t + 1], attention_mask=mask, position_ids=pos[:, -1:] + t + 1,
                      **with_cache(model, cache), use_cache=True)
            out.append(o.logits[:, -1])
    return torch.stack(out, dim=1)


def scorers():
    return [StreamingLLM(sinks=2), H2O(), H2O(recent=4), TOVA(), TOVA(per_head=True),
            SnapKV(window=4, kernel=3), SnapKV(window=4, kernel=5, pooling="avg"), Random(seed=3)]


SCHEDULES = [OneShot(), BlockwisePrefill(16), EveryStep(), EveryNSteps(3, target=14),
             EveryStep(prefill_block=8)]
ALLOCATIONS = [Uniform(), Pyramid(beta=4), AdaKV(), AdaKV(alpha=1.0, layers=Pyramid(beta=4))]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
def test_budget_at_least_length_gives_unpatched_logits(arch, layout):
    heads, kv_heads = HEAD_LAYOUTS[layout]
    model = tiny_model(arch, heads=heads, kv_heads=kv_heads)
    ids, mask = inputs(batch=2, pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask)
    for policy in [Policy(H2O(), budget=64), Policy(SnapKV(window=4), budget=64, schedule=EveryStep()),
                   Policy(TOVA(), budget=64, allocation=AdaKV(), schedule=BlockwisePrefill(16)),
                   Policy(StreamingLLM(), budget=64, schedule=EveryNSteps(2)),
                   Policy(Random(), ratio=1.0, allocation=Pyramid())]:
        with kvcache_ext.patch(model, policy) as handle:
            got = teacher_forced(model, handle.new_cache(), ids, mask)
        # Rows of padding are not compared: HF's output there is arbitrary.
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=str(policy))


def assert_paths_agree(policy, steps=8, kv_dtype=None, tokenizer=None):
    """Runs a 3-layer GQA model on a left-padded batch of 2 (60 tokens, then `steps` fed tokens)
    through the ragged path and the reference path; asserts the same logits, the same tokens
    kept per head, a store holding only those, and real eviction. Returns (ragged, logits).
    ``kv_dtype``: what the ragged caches' pages hold (the reference holds the same values);
    ``tokenizer``: patched with it (policies that read token texts)."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    with kvcache_ext.patch(model, policy, kv_dtype=kv_dtype, tokenizer=tokenizer) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=steps)
        expected = teacher_forced(model, reference, ids, mask, steps=steps)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for layer in range(3):
        a, b = ragged.layer_kv(layer).view(None, False), reference.layer_kv(layer).view(None, False)
        assert torch.equal(a["pos"].masked_fill(~a["mask"], -1), b["pos"].masked_fill(~b["mask"], -1))
        assert ragged.layer_kv(layer).store.num_tokens == int(a["mask"].sum())
    assert int(ragged.kept_tokens()[0].sum()) < 2 * 2 * (60 + steps)   # eviction happened
    return ragged, got


@pytest.mark.parametrize("scorer,allocation,schedule",
                         list(itertools.product(scorers(), ALLOCATIONS, SCHEDULES)),
                         ids=lambda x: repr(x).replace(" ", ""))
def test_ragged_path_equals_reference_path(scorer, allocation, schedule):
    assert_paths_agree(Policy(scorer, budget=20, allocation=allocation, schedule=schedule))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
def test_every_architecture_evicts_like_the_reference(arch, layout):
    heads, kv_heads = HEAD_LAYOUTS[layout]
    model = tiny_model(arch, heads=heads, kv_heads=kv_heads)
    ids, mask = inputs(batch=2, length=50, pad=(3, 0))
    for policy in [Policy(SnapKV(window=4, kernel=3), budget=16, allocation=AdaKV()),
                   Policy(H2O(recent=2), budget=16, schedule=EveryStep(prefill_block=16))]:
        with kvcache_ext.patch(model, policy) as handle:
            got = teacher_forced(model, handle.new_cache(), ids, mask)
            expected = teacher_forced(model, handle.new_cache(reference=True), ids, mask)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", [
    Policy(SnapKV(window=4, kernel=3), budget=12, allocation=AdaKV()),
    Policy(H2O(), budget=12, schedule=EveryStep()),
    Policy(TOVA(), ratio=0.4, schedule=BlockwisePrefill(8)),
    Policy(StreamingLLM(sinks=2), budget=10, allocation=Pyramid(beta=3), schedule=EveryNSteps(2)),
], ids=lambda p: type(p.scorer).__name__)
def test_left_padded_batch_gives_each_row_its_own_result(policy):
    model = tiny_model("qwen2", heads=4, kv_heads=2)
    lengths = [40, 33, 26]
    ids, mask = inputs(batch=3, length=40, pad=[40 - n for n in lengths])
    fed = fed_tokens(3, 6)
    with kvcache_ext.patch(model, policy) as handle:
        batched = teacher_forced(model, handle.new_cache(), ids, mask, fed=fed)
        for row, n in enumerate(lengths):
            alone = teacher_forced(model, handle.new_cache(), ids[row:row + 1, 40 - n:],
                                   mask[row:row + 1, 40 - n:], fed=fed[row:row + 1])
            torch.testing.assert_close(batched[row:row + 1], alone, atol=1e-4, rtol=1e-4)


RULE_POLICIES = [
    Policy(H2O(), budget=12, schedule=EveryStep()),
    Policy(H2O(recent=4), budget=12, schedule=EveryStep(prefill_block=8)),
    Policy(H2O(recent=3), budget=14, allocation=Pyramid(beta=3), schedule=EveryNSteps(2)),
    Policy(StreamingLLM(sinks=2), budget=10, schedule=EveryNSteps(3)),
    Policy(StreamingLLM(sinks=3), budget=9, schedule=EveryStep(prefill_block=8)),
    Policy(H2O(recent=2), budget=12, allocation=AdaKV(), schedule=EveryNSteps(2)),   # eviction: a view
    Policy(H2O(recent=2), ratio=0.3, schedule=EveryStep()),
]


def _decode_unpadded(model, cache, ids, steps):
    """Logits of the prompt's last token and of `steps` fed tokens with no attention mask (HF
    then gives none: the compiled decode step's case): [B, steps + 1, V]."""
    fed = fed_tokens(ids.shape[0], steps)
    with torch.no_grad():
        out = [model(ids, **with_cache(model, cache), use_cache=True).logits[:, -1]]
        for t in range(steps):
            out.append(model(fed[:, t:t + 1], **with_cache(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("policy", RULE_POLICIES, ids=lambda p: repr(p).replace(" ", ""))
def test_slot_rule_eviction_equals_the_view_eviction(policy, monkeypatch):
    """A scorer with a ``slot_rule`` under equal head budgets evicts in its decode step's one
    storage call, the store scoring each token from its record (``DecodeStep.evict``). It must
    keep what the scorer's ``cache_scores`` on a padded view keeps (the same positions in every
    store; values and logits up to the order of the sums, since the rule's compaction leaves a
    layer's tokens out of position order, and the next layer's keys follow), and give the
    reference path's logits; an eviction whose budgets need the padded view (Ada-KV's) takes
    the view."""
    from kvcache_ext.engine import blocks, decode
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, _ = inputs(batch=2, length=40)
    steps = 9
    served = []
    decode_step = RaggedLayerKV.decode_step
    monkeypatch.setattr(RaggedLayerKV, "decode_step",
                        lambda self, *a: served.append(a[5].evict is not None) or decode_step(self, *a))
    with kvcache_ext.patch(model, policy) as handle:
        rule_cache = handle.new_cache()
        by_rule = _decode_unpadded(model, rule_cache, ids, steps)
        rule_calls = list(served)
        with monkeypatch.context() as view_only:
            for module in (decode, blocks):
                view_only.setattr(module, "rule_eviction", lambda *args: None)
            view_cache = handle.new_cache()
            by_view = _decode_unpadded(model, view_cache, ids, steps)
        reference = _decode_unpadded(model, handle.new_cache(reference=True), ids, steps)
    every = policy.schedule.decode_every
    evicting_steps = [(t + 1) % every == 0 for t in range(steps)]
    if isinstance(policy.allocation, AdaKV):
        assert rule_calls == [False] * (3 * steps), rule_calls
    else:
        assert rule_calls == [e for e in evicting_steps for _ in range(3)], rule_calls
    torch.testing.assert_close(by_rule, by_view, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_rule, reference, atol=1e-4, rtol=1e-4)
    for layer in range(3):
        a, b = rule_cache.layer_kv(layer), view_cache.layer_kv(layer)
        assert torch.equal(a.lens, b.lens)
        va, vb = a.view(None, True), b.view(None, True)   # in position order (a rule's store is not)
        for name in ("pos", "mask"):
            assert torch.equal(va[name], vb[name]), (layer, name)
        for name in ("k", "v", "channels"):
            torch.testing.assert_close(va[name], vb[name], atol=1e-5, rtol=1e-5)
    assert int(rule_cache.kept_tokens()[0].sum()) < 2 * 2 * (40 + steps)   # eviction happened


def test_eviction_by_rule_refuses_bad_input_before_changing_anything():
    """Errors name the argument; nothing is evicted when one is refused."""
    from kvcache_ext.kernels.store import RaggedKVStore
    store = RaggedKVStore(2, 2, 16, dtype=torch.float32, score_channels=1)
    store.append(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), torch.arange(5))
    k = torch.full((4,), 3)
    bad = [
        (dict(rule="tova"), "rule must be 'mass'"),
        (dict(rule="mass", recent=2), "recent > 0 needs last_pos"),
        (dict(rule="mass", recent=2, last_pos=torch.tensor([5.0, 5.0])), "last_pos must be an integer tensor"),
        (dict(rule="mass", sinks=-1), "sinks and recent must be >= 0"),
    ]
    for kwargs, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            store.evict_by_rule(k, **kwargs)
        assert store.lens.tolist() == [[5, 5], [5, 5]]
    no_channels = RaggedKVStore(2, 2, 16, dtype=torch.float32, score_channels=0)
    no_channels.append(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), torch.arange(5))
    with pytest.raises(ValueError, match="rule 'mass' accumulates in score channel 0"):
        no_channels.evict_by_rule(k, rule="mass")
    assert no_channels.lens.tolist() == [[5, 5], [5, 5]]


def test_positions_after_eviction():
    """StreamingLLM at its budget every step: decode token p attends to the sinks and the
    newest budget - sinks tokens. The unpatched model with that attention pattern as an explicit
    mask over the whole sequence (true positions everywhere) gives the same logits."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    sinks, budget, prompt, steps = 2, 12, 30, 10
    ids, mask = inputs(length=prompt)
    with kvcache_ext.patch(model, Policy(StreamingLLM(sinks=sinks), budget=budget,
                                         schedule=EveryStep())) as handle:
        cache = handle.new_cache()
        got = teacher_forced(model, cache, ids, mask, steps=steps)
        assert cache.get_seq_length() == prompt + steps
        view = cache.layer_kv(0).view(None, False)      # in position order (the store's is not)
        kept = view["pos"][0, 0][view["mask"][0, 0]]
        assert kept.tolist() == [0, 1] + list(range(prompt + steps - budget + sinks, prompt + steps))
    fed = fed_tokens(1, steps)
    full = torch.cat([ids, fed], dim=1)
    T = full.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    # One-shot compression after the prompt: query p >= prompt sees the sinks, the newest
    # budget - sinks cached tokens before it, and itself.
    decode = i >= prompt
    allowed &= ~decode | (j < sinks) | (j >= i - (budget - sinks))
    with torch.no_grad():
        logits = model(full, attention_mask=allowed[None, None]).logits
    torch.testing.assert_close(got[0], logits[0, prompt - 1:], atol=2e-5, rtol=1e-5)


def test_generate_greedy_sampling_and_streaming():
    model = tiny_model("qwen3", heads=4, kv_heads=2)
    ids, mask = inputs(batch=2, length=40, pad=(0, 6))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=100)):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), plain)
    policy = Policy(H2O(), budget=16, schedule=EveryStep())
    with kvcache_ext.patch(model, policy) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True)
        assert out.sequences.shape == (2, 48)
        cache = out.past_key_values
        assert handle.last_cache is cache
        assert isinstance(cache, kvcache_ext.RaggedCache)
        assert cache.get_seq_length() == 47       # the last token is sampled, not fed
        for lens in cache.kept_tokens():
            assert lens.max() <= 16
        torch.manual_seed(0)
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20)
        assert sampled.shape == (2, 48)

        class Collect:
            def __init__(self):
                self.chunks = []

            def put(self, value):
                self.chunks.append(value)

            def end(self):
                self.chunks.append(None)

        streamer = Collect()
        streamed = model.generate(ids[:1], max_new_tokens=5, do_sample=False, streamer=streamer)
        assert streamer.chunks[-1] is None and len(streamer.chunks) == 1 + 5 + 1
        assert torch.equal(streamed, model.generate(ids[:1], max_new_tokens=5, do_sample=False))


def test_second_generate_gets_a_fresh_cache_and_the_first_is_freed():
    model = tiny_model("llama")
    ids, _ = inputs(length=30)
    with kvcache_ext.patch(model, Policy(H2O(), budget=10, schedule=EveryStep())) as handle:
        first = model.generate(ids, max_new_tokens=4, do_sample=False)
        gc.collect()
        assert handle.last_cache is None           # nothing keeps the finished cache alive
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, first)
        assert out.past_key_values.get_seq_length() == 33
        ref = weakref.ref(out.past_key_values)
        del out
        gc.collect()
        assert ref() is None


def test_unpatch_restores_the_model_exactly():
    model = tiny_model("mistral", attn="eager")
    ids, mask = inputs(batch=2, pad=(0, 4))
    before = teacher_forced(model, None, ids, mask)
    prepare = model._prepare_cache_for_generation
    handle = kvcache_ext.patch(model, Policy(TOVA(), budget=8, schedule=EveryStep()))
    assert kvcache_ext.is_patched(model) and model.config._attn_implementation == "kvcache_ext_eager"
    kvcache_ext.patch(model, Policy(H2O(), budget=8))          # re-patching replaces the policy
    kvcache_ext.unpatch(model)
    assert not kvcache_ext.is_patched(model)
    assert model.config._attn_implementation == "eager"
    assert "_prepare_cache_for_generation" not in vars(model)
    assert model._prepare_cache_for_generation == prepare
    torch.testing.assert_close(teacher_forced(model, None, ids, mask), before, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not patched"):
        kvcache_ext.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        handle.unpatch()


def test_eager_models_use_their_own_prefill_and_match():
    model = tiny_model("llama", attn="eager")
    ids, mask = inputs(batch=2, pad=(0, 4))
    expected = teacher_forced(model, None, ids, mask)
    with kvcache_ext.patch(model, Policy(H2O(), budget=100, schedule=EveryStep())) as handle:
        torch.testing.assert_close(teacher_forced(model, handle.new_cache(), ids, mask), expected,
                                   atol=2e-5, rtol=1e-5)


def test_patched_model_without_our_cache_runs_its_own_attention():
    model = tiny_model("llama")
    ids, mask = inputs()
    expected = model(ids, attention_mask=mask).logits
    with kvcache_ext.patch(model, Policy(H2O(), budget=4)):
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected)
        torch.testing.assert_close(model(ids, attention_mask=mask, use_cache=False).logits, expected)


def test_generate_with_another_cache_warns_that_it_keeps_every_token():
    """A patched model given a cache of its own kind (or asked for one by name) cannot evict:
    it says so, and the generation equals the unpatched model's."""
    import warnings

    from transformers import DynamicCache

    from kvcache_ext.cache_argument import cache_argument
    model = tiny_model("llama")
    ids, mask = inputs(length=30)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    key = cache_argument(type(model).forward)
    with kvcache_ext.patch(model, Policy(H2O(), budget=8, schedule=EveryStep())) as handle:
        for kwargs, named in (({"cache_implementation": "static"}, "cache_implementation='static'"),
                              ({key: DynamicCache(config=model.config)}, "a DynamicCache")):
            with pytest.warns(UserWarning, match=f"given {named}, so it keeps every token") as caught:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **kwargs)
            assert torch.equal(out, plain)
            assert any(w.filename == __file__ for w in caught)   # pointed at the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # our own caches, or none at all: no warning
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            model.generate(ids, attention_mask=mask, max_new_tokens=4, **{key: handle.new_cache()})
            model.generate(ids, attention_mask=mask, max_new_tokens=4, use_cache=False)


def test_stores_hold_only_the_kept_tokens():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=200)
    budget = 24
    policy = Policy(SnapKV(window=8), budget=budget, allocation=AdaKV())
    with kvcache_ext.patch(model, policy) as handle:
        ragged, masked = handle.new_cache(), handle.new_cache(reference=True)
        with torch.no_grad():
            model(ids, attention_mask=mask, **with_cache(model, ragged), use_cache=True)
            model(ids, attention_mask=mask, **with_cache(model, masked), use_cache=True)
    H, D, B = 2, 16, 2
    for layer in range(3):
        kv = ragged.layer_kv(layer)
        assert kv.lens.sum(dim=1).tolist() == [H * budget] * B     # Ada-KV: sum of B_i = H * budget
        assert kv.lens.tolist() == masked.layer_kv(layer).lens.tolist()
        store = kv.store
        assert store.num_tokens == B * H * budget
        # whole pages only: less than one page per segment beyond the live tokens, none free
        assert store.free_pages == 0 and bool((store.caps - store.lens < store.page_size).all())
    kv_bytes = lambda cache: sum(c.layer_kv(i).store.k.nbytes + c.layer_kv(i).store.v.nbytes
                                 for i in range(3) for c in [cache])
    full_kv = 3 * 2 * B * H * 200 * D * 4
    assert sum(masked.layer_kv(i).k.nbytes + masked.layer_kv(i).v.nbytes for i in range(3)) == full_kv
    assert kv_bytes(ragged) <= full_kv * 2 * budget / 200
    assert ragged.nbytes < masked.nbytes / 3


@pytest.mark.parametrize("schedule", [EveryStep(), EveryStep(prefill_block=16), EveryNSteps(3)],
                         ids=repr)
def test_a_cache_held_at_its_budget_keeps_no_prefill_slack(schedule):
    """After the prompt, a per-step (or every-N) cache has room for the tokens between two
    evictions only, and decoding never regrows it; a growing cache keeps its headroom."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=120, pad=(0, 7))
    budget, B, H = 20, 2, 2
    every = schedule.decode_every
    with kvcache_ext.patch(model, Policy(H2O(), budget=budget, schedule=schedule)) as handle:
        cache = handle.new_cache()
        teacher_forced(model, cache, ids, mask, steps=0)
        stores = [cache.layer_kv(layer).store for layer in range(3)]
        pages = -(-(budget + every) // stores[0].page_size)   # per head: the budget and `every` more
        for store in stores:
            assert store.num_tokens == B * H * budget
            assert store.capacity == B * H * pages * store.page_size and store.free_pages == 0
        after_prefill = cache.nbytes
        fed = fed_tokens(B, 7)
        pos = (mask.cumsum(dim=1) - 1).clamp_min(0)[:, -1:]
        with torch.no_grad():
            for t in range(7):
                step_mask = torch.cat([mask, torch.ones(B, t + 1, dtype=mask.dtype)], dim=1)
                model(fed[:, t:t + 1], attention_mask=step_mask, position_ids=pos + t + 1,
                      **with_cache(model, cache), use_cache=True)
        assert cache.nbytes == after_prefill                      # no regrowth while decoding
        assert all(store.capacity == B * H * pages * store.page_size for store in stores)
    with kvcache_ext.patch(model, Policy(H2O(), budget=budget, schedule=BlockwisePrefill(16))) as handle:
        growing = handle.new_cache()
        teacher_forced(model, growing, ids, mask, steps=0)
        store = growing.layer_kv(0).store
        # A growing cache holds its kept tokens in whole pages, and no free page.
        assert store.capacity == int((store.caps).sum()) and store.free_pages == 0
        assert bool(((store.caps - store.lens) < store.page_size).all())


def test_bfloat16_model_runs_and_matches_unpatched_at_full_budget():
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids, mask = inputs(batch=2, pad=(0, 3))
    expected = teacher_forced(model, None, ids, mask)
    with kvcache_ext.patch(model, Policy(H2O(), budget=100, schedule=EveryStep())) as handle:
        got = teacher_forced(model, handle.new_cache(), ids, mask)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=12, allocation=AdaKV())):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 52)


def test_errors_are_clear():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        kvcache_ext.patch(gpt2, Policy(H2O(), budget=8))
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="Policy"):
        kvcache_ext.patch(model, H2O())
    with pytest.raises(TypeError, match="Policy"):
        MaskedCache("budget", 2)
    with kvcache_ext.patch(model, Policy(H2O(), budget=8)):
        ids, _ = inputs(length=20)
        with pytest.raises(NotImplementedError, match="beam search"):
            model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)


def test_attention_takes_dropout_by_position_as_sdpa_does():
    """Libraries that wrap every registered attention function (kvpress) pass dropout by
    position, in SDPA's order (module, q, k, v, mask, dropout, scaling=...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    model = tiny_model("llama", heads=4, kv_heads=2, layers=1)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=8)):
        attention = ALL_ATTENTION_FUNCTIONS["kvcache_ext_sdpa"]
        q, k, v = (torch.randn(1, h, 5, 16) for h in (4, 2, 2))
        module = model.model.layers[0].self_attn
        want = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, 0.0, scaling=0.3)[0]
        got = attention(module, q, k, v, None, 0.0, scaling=0.3)[0]
        torch.testing.assert_close(got, want)



def decode_logits(model, cache, fed):
    """Tokens fed one at a time without a mask (no padding: HF then gives the attention no
    mask, the decode's usual case): logits [B, steps, V]."""
    with torch.no_grad():
        return torch.stack([model(fed[:, t:t + 1], **with_cache(model, cache), use_cache=True).logits[:, -1]
                            for t in range(fed.shape[1])], dim=1)


@pytest.mark.parametrize("allocation", [Uniform(), AdaKV()], ids=["snapkv", "ada-snapkv"])
def test_decode_after_a_one_shot_prompt_only_appends(allocation, monkeypatch):
    """After a one-shot prompt, a decode step is one storage call per layer that asks the
    kernel for no statistics, and nothing scores, views, allocates budgets or evicts (Ada-KV's
    per-head budgets cost nothing once the prompt is compressed); its logits are the reference
    path's."""
    from kvcache_ext.engine import decode, eviction
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    model = tiny_model("llama", heads=6, kv_heads=2)
    ids, _ = inputs(batch=2, length=40)
    fed = fed_tokens(2, 6)
    policy = Policy(SnapKV(window=4), budget=12, allocation=allocation)
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        with torch.no_grad():
            for cache in (ragged, reference):
                model(ids, **with_cache(model, cache), use_cache=True)
        want = decode_logits(model, reference, fed)
        steps = []
        decode_step = RaggedLayerKV.decode_step
        monkeypatch.setattr(RaggedLayerKV, "decode_step", lambda self, *a: steps.append(a[5:]) or decode_step(self, *a))
        for module, name in ((decode, "cache_view"), (decode, "evict"), (eviction, "cache_view"), (eviction, "evict")):
            monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"decode called {_name}"))
        monkeypatch.setattr(type(policy.allocation), "head_budgets",
                            lambda *a: pytest.fail("decode allocated budgets"))
        got = decode_logits(model, ragged, fed)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(steps) == 6 * 2                          # steps x layers: append and attend, nothing else
    assert all((s.stats, s.accumulate, s.evict, valid, plan) == ((), (), None, None, None) for s, valid, plan in steps)
    for layer in ragged.layers:
        assert (layer.state.seen, layer.state.decode_steps) == (40 + 6, 6)


def test_a_padded_decode_step_reads_the_mask_once_for_every_layer(monkeypatch):
    """With padding HF gives every layer the same mask: which new tokens are real is read from
    it (a host sync) once per step, not once per layer."""
    from kvcache_ext.engine import forward
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=30, pad=[0, 7])
    policy = Policy(H2O(), budget=10, schedule=EveryStep())
    with kvcache_ext.patch(model, policy) as handle:
        want = teacher_forced(model, handle.new_cache(), ids, mask, steps=4)
        reads = []
        read = forward.new_token_validity
        monkeypatch.setattr(forward, "new_token_validity", lambda *a: reads.append(a[2]) or read(*a))
        got = teacher_forced(model, handle.new_cache(), ids, mask, steps=4)
    assert torch.equal(got, want)
    assert reads.count(1) == 4 and len(reads) == 4 + 3     # per decode step; per layer at the prompt


# The CUDA attention kernel's head_dim sizes, refused when the model is patched, not at its
# first decode step.
def test_cuda_head_dims_are_checked_at_patch_time():
    from kvcache_ext.kernels.attention import CUDA_HEAD_DIMS, check_head_dim
    assert CUDA_HEAD_DIMS == (64, 80, 96, 112, 128, 192, 256)
    for D in CUDA_HEAD_DIMS:
        check_head_dim(D, torch.device("cuda"))
    check_head_dim(48, torch.device("cpu"))   # the CPU kernels take any head_dim
    with pytest.raises(ValueError, match=r"head_dim 64, 80, 96, 112, 128, 192 and 256, got 48;"):
        check_head_dim(48, torch.device("cuda"))


@pytest.mark.skipif(not (torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]),
                    reason="needs a GPU and the CUDA kernels")
def test_patch_refuses_a_cuda_model_of_unsupported_head_dim():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=16).cuda()
    with pytest.raises(ValueError, match="head_dim .*, got 16;"):
        kvcache_ext.patch(model, Policy(H2O(), budget=8))
