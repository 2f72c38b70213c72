"""Spans for KVzip (``Spanned(KVzip())``): the reconstruction passes' scores shared by whole spans.

On a tiny random-weight Llama with a tokenizer of made-up token texts (words, digit runs,
sentence ends), so that spans of several tokens occur:

- the ragged path gives the reference path's logits and kept positions, for uniform, Ada-KV
  and KVzip's global allocation, every span unit, a left-padded batch of 2;
- the kept positions equal a plain-PyTorch computation: the passes' raw scores, each token
  given its span's max found by a walk over the token texts, the sinks kept, the top budget
  of each head (and spans changed the selection: the test can fail);
- with ``budgets="tokens"`` each head holds what KVzip alone gives it under the same
  allocation (the split by the raw scores), its tokens chosen by the span-shared scores; with
  the default the split differs (the test can fail);
- the evaluation's shared prefill runs the passes once for KVzip and its spanned twin and
  keeps what the patched model keeps;
- a budget of the whole sequence gives the unpatched logits;
- the refusals: no tokenizer, a schedule other than one-shot, bad spans, budgets or KVzip
  arguments.
"""
import pytest
import torch

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill, score_by_reconstruction
from kvcache_ext.policies import (AcrossLayers, AdaKV, EveryStep, KVzip, Policy, SnapKV, Spanned, Spans, Uniform)
from test_patch import assert_paths_agree, inputs, teacher_forced
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = dict(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None)


def kvzip(**kw):
    return KVzip(**{**IDS, **kw})


def _text(i: int) -> str:
    """Token i's text: a word's start, a letter continuation, a digit (glued), a spaced digit or
    a sentence end, so that random ids make words, numbers and sentences of several tokens."""
    return [f" w{i}", "ab", str(i % 10), str((i + 3) % 10), f" {i % 10}", "."][i % 6]


class TextTokenizer:
    """What ``patch`` reads of a tokenizer for spans: its length and each token decoded alone."""

    def __len__(self):
        return VOCAB

    def batch_decode(self, ids):
        return [_text(row[0]) for row in ids]

    def encode(self, text, add_special_tokens=False):
        raise AssertionError("the instructions are token ids: nothing is tokenized")


TOKENIZER = TextTokenizer()


def _walk_spans(ids: list[int], unit: str) -> list[int]:
    """The start of each token's span, by a walk over the token texts."""
    digits = lambda t: t.strip().isdecimal()   # noqa: E731

    def continues(before, text):
        if unit == "number":
            return digits(text) and digits(before) and not text[0].isspace()
        if unit == "word":
            return text[0].isalnum() and before[-1].isalnum() and digits(text) == digits(before)
        return not (before.endswith(".") or "\n" in before)

    starts = []
    for p, i in enumerate(ids):
        starts.append(starts[-1] if p and continues(_text(ids[p - 1]), _text(i)) else p)
    return starts


@pytest.mark.parametrize("allocation", [Uniform(), AdaKV(), AdaKV(alpha=1.0, layers=AcrossLayers())], ids=repr)
@pytest.mark.parametrize("spans", [Spans("word"), Spans("number"), Spans("sentence", "mean"),
                                   Spans("sentence", share=0.5)], ids=repr)
def test_ragged_path_equals_reference_path(allocation, spans):
    assert_paths_agree(Policy(Spanned(kvzip(chunk=16), spans), budget=20, allocation=allocation), steps=6,
                       tokenizer=TOKENIZER)


@pytest.mark.parametrize("allocation", [AdaKV(), AdaKV(alpha=1.0, layers=AcrossLayers())], ids=repr)
def test_token_budgets_ragged_path_equals_reference_path(allocation):
    assert_paths_agree(Policy(Spanned(kvzip(chunk=16), Spans("sentence"), budgets="tokens"), budget=20,
                              allocation=allocation), steps=6, tokenizer=TOKENIZER)


def _kept(cache, layer):
    view = cache.layer_kv(layer).view(None, False)
    return [[sorted(view["pos"][b, h][view["mask"][b, h]].tolist()) for h in range(view["pos"].shape[1])]
            for b in range(view["pos"].shape[0])]


@pytest.mark.parametrize("unit", ["word", "number", "sentence"])
def test_kept_positions_equal_a_plain_computation(unit):
    """Uniform heads, budget 14 of 48 tokens: each head keeps its 4 sinks and the 10 best
    tokens by the span-shared scores (a plain loop over the passes' raw scores); a tie at the
    threshold (one span cut) may go either way, so the check is: every token above the
    threshold kept, none below, the count exact."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, _ = inputs(batch=1, length=48, seed=7)
    budget, sinks = 14, 4
    policy = Policy(Spanned(kvzip(chunk=20), Spans(unit)), budget=budget)
    recorded = record_prefill(model, ids)
    with kvcache_ext.patch(model, policy, tokenizer=TOKENIZER) as handle:
        cache = compressed_cache(policy, recorded, handle.model_parts)
        raw = handle.score_prompt(cache, ids)
        plain = compressed_cache(Policy(kvzip(chunk=20), budget=budget), recorded, handle.model_parts)
    with kvcache_ext.patch(model, Policy(kvzip(chunk=20), budget=budget)) as handle:
        assert all(torch.equal(a, b) for a, b in zip(handle.score_prompt(plain, ids), raw))   # raw: KVzip's own
    starts = _walk_spans(ids[0].tolist(), unit)
    assert len(set(starts)) < len(starts) - 5                       # spans of several tokens occur
    differs = False
    for layer, scores in enumerate(raw):
        kept, kept_plain = _kept(cache, layer)[0], _kept(plain, layer)[0]
        for h in range(scores.shape[1]):
            s = scores[0, h].double().tolist()
            shared = [max(s[q] for q in range(48) if starts[q] == starts[p] and q >= sinks) if p >= sinks
                      else float("inf") for p in range(48)]
            threshold = sorted(shared, reverse=True)[budget - 1]
            assert len(kept[h]) == budget
            assert {p for p in range(48) if shared[p] > threshold} <= set(kept[h])
            assert all(shared[p] >= threshold for p in kept[h]), (layer, h)
            differs |= kept[h] != kept_plain[h]
    assert differs                                                   # spans changed the selection


def test_token_budgets_hold_kvzips_counts_chosen_by_the_spans():
    """KVzip's global allocation, budget 12 of 48 tokens: under ``budgets="tokens"`` every
    (layer, head) holds as many tokens as KVzip alone holds there, and those are the head's
    best by the span-shared scores (every token above its threshold kept, none below); under
    the default split by the shared scores, some head's count differs."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, _ = inputs(batch=1, length=48, seed=7)
    spans, sinks = Spans("sentence"), 4
    allocation = lambda: AdaKV(alpha=1.0, layers=AcrossLayers())   # noqa: E731
    recorded = record_prefill(model, ids)
    kept = {}
    for name, scorer in [("plain", kvzip(chunk=20)), ("tokens", Spanned(kvzip(chunk=20), spans, budgets="tokens")),
                         ("spans", Spanned(kvzip(chunk=20), spans))]:
        policy = Policy(scorer, budget=12, allocation=allocation())
        with kvcache_ext.patch(model, policy, tokenizer=TOKENIZER) as handle:
            cache = compressed_cache(policy, recorded, handle.model_parts)
            raw = handle.score_prompt(cache, ids)
        kept[name] = [_kept(cache, layer)[0] for layer in range(3)]
    counts = {name: [[len(h) for h in layer] for layer in value] for name, value in kept.items()}
    assert counts["tokens"] == counts["plain"]
    assert counts["spans"] != counts["plain"]                        # the default splits otherwise
    starts = _walk_spans(ids[0].tolist(), "sentence")
    for layer, scores in enumerate(raw):
        for h, positions in enumerate(kept["tokens"][layer]):
            s = scores[0, h].double().tolist()   # a sink's score counts for its span, as any rated token's
            shared = [max(s[q] for q in range(48) if starts[q] == starts[p]) if p >= sinks else float("inf")
                      for p in range(48)]
            threshold = sorted(shared, reverse=True)[len(positions) - 1]
            assert {p for p in range(48) if shared[p] > threshold} <= set(positions), (layer, h)
            assert all(shared[p] >= threshold for p in positions), (layer, h)


def test_the_shared_prefill_runs_the_passes_once_and_keeps_what_the_patched_model_keeps():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, _ = inputs(batch=1, length=40, seed=9)
    spanned = Policy(Spanned(kvzip(chunk=16)), budget=12, allocation=AdaKV(alpha=1.0, layers=AcrossLayers()))
    recorded = record_prefill(model, ids)
    with kvcache_ext.patch(model, Policy(kvzip(chunk=16), budget=12), tokenizer=TOKENIZER) as handle:
        assert score_by_reconstruction(handle, compressed_cache(handle.policy, recorded, handle.model_parts),
                                       recorded, ids) > 0
    with kvcache_ext.patch(model, spanned, tokenizer=TOKENIZER) as handle:
        shared = compressed_cache(spanned, recorded, handle.model_parts)
        score_by_reconstruction(handle, shared, recorded, ids)
        direct = handle.new_cache()
        with torch.no_grad():
            model(ids, **with_cache(model, direct), use_cache=True)   # the forward's end runs the passes
    assert len(recorded.reconstructed) == 1                            # one set of passes for both
    for layer in range(2):
        assert _kept(shared, layer) == _kept(direct, layer)


def test_a_budget_of_the_whole_sequence_gives_the_unpatched_logits():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=40, pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask)
    with kvcache_ext.patch(model, Policy(Spanned(kvzip(chunk=16)), budget=64,
                                         allocation=AdaKV(alpha=1.0, layers=AcrossLayers())),
                           tokenizer=TOKENIZER) as handle:
        cache = handle.new_cache()
        got = teacher_forced(model, cache, ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert int(cache.kept_tokens()[0][0].sum()) == 2 * (40 + 6)        # nothing evicted in row 0


def test_refusals_name_the_argument_the_value_and_what_is_accepted():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    with pytest.raises(ValueError, match="patch tokenizer: None.*Spanned.*tokenizer="):
        kvcache_ext.patch(model, Policy(Spanned(kvzip()), budget=16))
    assert not kvcache_ext.is_patched(model)
    with pytest.raises(ValueError, match=r"KVzip .*one-shot schedule \(OneShot\(\)\), got Schedule\(.*decode_every=1"):
        Policy(Spanned(kvzip()), budget=16, schedule=EveryStep())
    with pytest.raises(TypeError, match="Spanned spans.*Spans.*'word'"):
        Spanned(kvzip(), spans="word")
    with pytest.raises(ValueError, match="Spans unit.*'number', 'word', 'sentence'.*'token'"):
        Spanned(kvzip(), Spans("token"))
    with pytest.raises(ValueError, match="KVzip gqa must be 'max' or 'mean', got 'sum'"):
        Spanned(kvzip(gqa="sum"))
    with pytest.raises(ValueError, match="Spanned budgets.*'spans', 'tokens'.*'layers'"):
        Spanned(kvzip(), budgets="layers")
    with pytest.raises(ValueError, match="Spanned budgets='tokens'.*reconstructing.*SnapKV.*budgets='spans'"):
        Spanned(SnapKV(), budgets="tokens")
