"""Sliding-window layers (Mistral, Qwen2 and Qwen3 with use_sliding_window, Phi-3, Gemma 3's
sliding layers) past their window, on tiny random-weight models built from their configs.

- budget >= sequence: the patched model gives the unpatched model's logits, prompt and decode
  steps past the window, padded or not, GQA or not;
- with eviction: the ragged path gives the reference path's logits and keeps the same tokens;
  a sliding layer keeps only what its next token sees, the budget applying among those;
- a left-padded row gives what it gives alone;
- a sliding layer's store stays within its window (in whole pages) however long the sequence;
- what the engine does not window (several tokens over a cache past the window) is refused.
"""
import pytest
import torch

import kvcache_ext
from kvcache_ext.engine.state import LayerState
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, ExpectedAttention,
                                  Policy, Random, SnapKV, StreamingLLM)
from test_patch import fed_tokens, inputs, teacher_forced
from test_serving import needs_engine
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 12
# How each architecture turns its window on; layers that slide, of a 2-layer model.
WINDOWED = {
    "mistral": (dict(sliding_window=WINDOW), [0, 1]),
    "qwen2": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), [1]),
    "qwen3": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), [1]),
    "phi3": (dict(sliding_window=WINDOW), [0, 1]),
    "gemma3_text": (dict(sliding_window=WINDOW), [0]),   # layer_types: sliding, full
}
LAYOUTS = {"gqa": (6, 2), "mha": (4, 4)}


def windowed(arch, heads=6, kv_heads=2, layers=2, **extra):
    config, _ = WINDOWED[arch]
    return tiny_model(arch, heads=heads, kv_heads=kv_heads, layers=layers, **config, **extra)


def decode_unpadded(model, cache, ids, steps):
    """The prompt, then `steps` fed tokens, with no attention mask: [B, steps + 1, V]."""
    fed = fed_tokens(ids.shape[0], steps)
    with torch.no_grad():
        kwargs = {} if cache is None else with_cache(model, cache)
        out = model(ids, use_cache=True, **kwargs)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(steps):
            logits.append(model(fed[:, t:t + 1], **with_cache(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1)


def test_the_configs_make_the_layers_slide():
    """The tiny models' layers slide where the test expects them to (else the tests below would
    test global layers only)."""
    for arch, (_, sliding) in WINDOWED.items():
        model = windowed(arch)
        ids, mask = inputs(length=30)
        with kvcache_ext.patch(model, Policy(H2O(), budget=100)) as handle:
            cache = handle.new_cache()
            teacher_forced(model, cache, ids, mask, steps=1)
        assert [layer.state.window for layer in cache.layers] == \
            [WINDOW if i in sliding else None for i in range(2)], arch


FULL_BUDGET = [Policy(SnapKV(window=4), budget=100),
               Policy(SnapKV(window=4), budget=100, allocation=AdaKV()),
               Policy(H2O(), budget=100, schedule=EveryStep()),
               Policy(StreamingLLM(sinks=2), budget=100, schedule=EveryNSteps(2)),
               Policy(Random(), ratio=1.0)]


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_budget_at_least_length_gives_unpatched_logits_past_the_window(arch, layout):
    heads, kv_heads = LAYOUTS[layout]
    model = windowed(arch, heads=heads, kv_heads=kv_heads)
    ids, mask = inputs(batch=2, length=30, pad=(0, 5))       # 30 and 25 tokens, window 12
    expected = teacher_forced(model, None, ids, mask, steps=8)
    for policy in FULL_BUDGET:
        with kvcache_ext.patch(model, policy) as handle:
            got = teacher_forced(model, handle.new_cache(), ids, mask, steps=8)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=str(policy))


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_decode_past_the_window_without_padding_gives_unpatched_logits(arch):
    """No padding: HF's decode steps (and their fast paths in the engine, where HF gives no
    mask); a prompt shorter than the window, then steps past it; and a block-wise prefill
    within the window."""
    model = windowed(arch)
    for length in (8, 20):
        ids, _ = inputs(batch=2, length=length)
        expected = decode_unpadded(model, None, ids, steps=16)
        for policy in FULL_BUDGET + [Policy(TOVA(), budget=100, schedule=BlockwisePrefill(4))]:
            if policy.schedule.prefill_block is not None and length > WINDOW:
                continue   # refused: test_several_tokens_over_a_cache_past_the_window_are_refused
            with kvcache_ext.patch(model, policy) as handle:
                got = decode_unpadded(model, handle.new_cache(), ids, steps=16)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=f"{length} {policy}")


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_generate_past_the_window_gives_unpatched_tokens(arch):
    model = windowed(arch)
    ids, mask = inputs(batch=2, length=20, pad=(0, 3))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=100)):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False), plain)


EVICTING = [Policy(SnapKV(window=4, kernel=3), budget=8, allocation=AdaKV()),
            Policy(H2O(recent=2), budget=8, schedule=EveryStep()),
            Policy(TOVA(), budget=16, schedule=EveryNSteps(3, target=14)),
            Policy(StreamingLLM(sinks=2), budget=8, schedule=EveryStep())]


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("policy", EVICTING, ids=lambda p: type(p.scorer).__name__)
def test_ragged_path_equals_reference_path_past_the_window(arch, policy):
    model = windowed(arch, layers=2)
    _, sliding = WINDOWED[arch]
    ids, mask = inputs(batch=2, length=40, pad=(0, 7))
    steps = 10
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=steps)
        expected = teacher_forced(model, reference, ids, mask, steps=steps)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    newest = torch.tensor([40 + steps - 1, 40 - 7 + steps - 1])
    for layer in range(2):
        a, b = ragged.layer_kv(layer).view(None, False), reference.layer_kv(layer).view(None, False)
        assert torch.equal(a["pos"].masked_fill(~a["mask"], -1), b["pos"].masked_fill(~b["mask"], -1))
        assert ragged.layer_kv(layer).store.num_tokens == int(a["mask"].sum())
        if layer in sliding:   # only what the newest token saw: positions > newest - window
            oldest = a["pos"].masked_fill(~a["mask"], 2**31).amin(dim=(1, 2))
            assert bool((oldest >= newest + 1 - WINDOW).all()), (layer, oldest)
            assert int(ragged.layer_kv(layer).lens.max()) <= WINDOW


def test_a_sliding_layer_keeps_its_window_first_then_its_budget():
    """StreamingLLM(sinks=2): a global layer keeps the sinks and the newest tokens; a sliding
    layer's sinks are out of its window, and its budget applies among the tokens its next query
    sees (the newest `budget`); with a budget past the window it keeps the window's tokens
    (those the newest token saw)."""
    model = windowed("gemma3_text", layers=2)             # layer 0 slides, layer 1 does not
    ids, mask = inputs(length=30)
    for budget, sliding_keeps in ((8, 8), (20, WINDOW)):
        with kvcache_ext.patch(model, Policy(StreamingLLM(sinks=2), budget=budget,
                                             schedule=EveryStep())) as handle:
            cache = handle.new_cache()
            teacher_forced(model, cache, ids, mask, steps=5)
        newest = 30 + 5 - 1
        def kept(layer):   # in position order (the layer's view; the store's own order is not)
            view = cache.layer_kv(layer).view(None, False)
            return view["pos"][0, 0][view["mask"][0, 0]].tolist()
        assert kept(0) == list(range(newest + 1 - sliding_keeps, newest + 1)), budget
        assert kept(1) == [0, 1] + list(range(newest + 3 - budget, newest + 1)), budget


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_left_padded_batch_gives_each_row_its_own_result_past_the_window(arch):
    model = windowed(arch, heads=4, kv_heads=2)
    lengths = [30, 21]
    ids, mask = inputs(batch=2, length=30, pad=[30 - n for n in lengths])
    fed = fed_tokens(2, 8)
    for policy in [Policy(SnapKV(window=4, kernel=3), budget=8), Policy(H2O(recent=2), budget=8, schedule=EveryStep())]:
        with kvcache_ext.patch(model, policy) as handle:
            batched = teacher_forced(model, handle.new_cache(), ids, mask, fed=fed)
            for row, n in enumerate(lengths):
                alone = teacher_forced(model, handle.new_cache(), ids[row:row + 1, 30 - n:],
                                       mask[row:row + 1, 30 - n:], fed=fed[row:row + 1])
                torch.testing.assert_close(batched[row:row + 1], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy,steps", [(Policy(SnapKV(window=4), budget=2000), 1000),
                                          (Policy(H2O(), budget=1000, schedule=EveryStep()), 50),
                                          (Policy(SnapKV(window=4), budget=1000, allocation=AdaKV()), 50)],
                         ids=["one-shot", "every-step", "ada"])
def test_a_sliding_layer_holds_its_window_however_long_the_sequence(policy, steps):
    """Gemma 3's layer 0 slides (window 12), layer 1 does not: as decoding goes ``steps`` tokens
    past the window (1,000 for the one-shot policy), the sliding layer's store holds at most its
    window in whole pages (the pages of its window, no more, reserved however long generate
    says the sequence will be), while the global layer grows."""
    model = windowed("gemma3_text", heads=4, kv_heads=2)
    B, H = 2, 2
    ids, _ = inputs(batch=B, length=20)
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache(max_cache_len=20 + steps)
        with torch.no_grad():
            model(ids, **with_cache(model, cache), use_cache=True)
            sliding, full = cache.layer_kv(0).store, cache.layer_kv(1).store
            pages = -(-WINDOW // sliding.page_size)
            sliding_bytes, full_bytes = [], []
            for t, token in enumerate(fed_tokens(B, steps)[0]):
                model(token.expand(B, 1), **with_cache(model, cache), use_cache=True)
                assert sliding.lens.tolist() == [[WINDOW] * H] * B
                assert sliding.num_pages <= B * H * pages, t
                sliding_bytes.append(sliding.nbytes)
                full_bytes.append(full.nbytes)
    assert len(set(sliding_bytes)) == 1
    assert full.lens.tolist() == [[20 + steps] * H] * B and full_bytes[-1] > 2 * sliding_bytes[-1]


def test_a_fork_of_a_shared_prefix_slides_past_the_window():
    """A sequence on a fork of a shared prefix (whose pages are read-only) decodes past the
    window as over its own copy of the compressed prefix; the prefix is not written."""
    model = windowed("mistral", heads=4, kv_heads=2)
    prefix, question = inputs(length=10)[0][0].tolist(), [7]
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=100)) as handle:
        shared = handle.share_prefix(prefix)
        kept = [layer.state.kv.store.to_dense().pos.clone() for layer in shared.cache.layers]
        own = handle.new_cache()
        with torch.no_grad():
            model(torch.tensor([prefix]), **with_cache(model, own), use_cache=True)
        ids = torch.tensor([prefix + question])
        outs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               **with_cache(model, cache)) for cache in (own, shared.fork())]
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == 19
    assert all(torch.equal(layer.state.kv.store.to_dense().pos, before)
               for layer, before in zip(shared.cache.layers, kept))


def test_the_evaluations_shared_prefill_keeps_what_the_patched_prefill_keeps():
    """The evaluation harness builds a policy's cache from one recorded dense prefill: a sliding
    layer keeps its window of the prompt there too."""
    from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill
    model = windowed("gemma3_text", heads=4, kv_heads=2)
    ids, mask = inputs(batch=2, length=30, pad=(0, 4))
    recorded = record_prefill(model, ids, mask)
    for policy in [Policy(SnapKV(window=4), budget=100), Policy(SnapKV(window=4), budget=8, allocation=AdaKV())]:
        with kvcache_ext.patch(model, policy) as handle:
            patched = handle.new_cache()
            with torch.no_grad():   # as record_prefill calls it
                model(ids, attention_mask=mask, **with_cache(model, patched), use_cache=True)
        shared = compressed_cache(policy, recorded)
        for a, b in zip(patched.layers, shared.layers):
            da, db = a.state.kv.store.to_dense(), b.state.kv.store.to_dense()
            assert torch.equal(da.pos.masked_fill(~da.mask, -1), db.pos.masked_fill(~db.mask, -1))
        assert int(shared.layer_kv(0).lens.max()) < WINDOW    # the sliding layer: its window only


def test_several_tokens_over_a_cache_past_the_window_are_refused():
    """A block-wise prefill past the window, or a later prompt that passes it, would need a
    window per query: refused by name before anything is stored."""
    model = windowed("mistral")
    ids, mask = inputs(length=20)
    with kvcache_ext.patch(model, Policy(H2O(), budget=8, schedule=BlockwisePrefill(8))) as handle:
        with pytest.raises(NotImplementedError, match=r"window 12\); .*a call of 20 tokens over a cache"):
            teacher_forced(model, handle.new_cache(), ids, mask, steps=0)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=8)) as handle:
        cache = handle.new_cache()
        first, _ = inputs(length=8)
        with torch.no_grad():
            model(first, **with_cache(model, cache), use_cache=True)
            with pytest.raises(NotImplementedError, match="a call of 6 tokens over a cache that has seen 8"):
                model(first[:, :6], **with_cache(model, cache), use_cache=True)
        assert cache.get_seq_length() == 8


@needs_engine
def test_continuous_batching_refuses_a_request_past_the_window():
    """The serving engine's steps do not window: a request longer than a layer's window is
    refused by name (one within it runs as before)."""
    from types import SimpleNamespace

    from kvcache_ext.serving.attention import attend_packed
    request = SimpleNamespace(request_id="r7", past_length=10, count=3, first=0)
    packed = SimpleNamespace(cache=SimpleNamespace(step=[request]), layer_idx=1)
    with pytest.raises(NotImplementedError, match="layer 1 uses sliding-window attention \\(window 12\\) and "
                                                  "request r7 is 13 tokens long"):
        attend_packed(packed, None, None, None, None, None, 0.25, window=WINDOW)


def test_bad_windows_and_models_are_refused_by_name():
    state = LayerState(0, 1, Policy(H2O(), budget=8), storage=None)
    for bad in (0, -3, 2.5, True, "12"):
        with pytest.raises(ValueError, match=f"sliding_window must be a positive integer or None, got {bad!r}"):
            state.note_window(bad)
    state.note_window(12)
    with pytest.raises(ValueError, match="sliding_window is 16, but this cache's layer has a window of 12"):
        state.note_window(16)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        kvcache_ext.patch(windowed("gemma3_text", use_bidirectional_attention=True), Policy(H2O(), budget=8))
    with pytest.raises(ValueError, match="ExpectedAttention needs one RoPE over the whole head"):
        kvcache_ext.patch(windowed("gemma3_text"), Policy(ExpectedAttention(), budget=8))
    assert not kvcache_ext.is_patched(windowed("gemma3_text"))
