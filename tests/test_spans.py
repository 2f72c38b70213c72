"""Spans (kvcache_ext.policies.spans): whole words, numbers and sentences kept together.

- the span boundaries of the default model's tokenizer on text with words, numbers and
  punctuation, written out by hand;
- ``Spans.span_of`` against a walk over the token texts, and the scores' transform against
  loops, on random ragged inputs (empty and single-token rows, padding, batch > 1);
- through ``patch`` and ``generate`` (left-padded batch of 2): the ids noted by position; a
  policy with spans cuts at most one number per head (the one at the budget's threshold),
  where plain SnapKV cuts many; with a budget of the whole sequence the logits are the
  unpatched model's; block-wise prefill and decode eviction agree with the reference path;
  the evaluation's shared prefill keeps what the patched prefill keeps;
- the refusals: no tokenizer, a bad unit or reduction (a base that reconstructs the prompt is
  served: tests/test_kvzip_spans.py).
"""
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext.evaluation import compressed_cache, make_policy, record_prefill
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import (AdaKV, BlockwisePrefill, EveryStep, Policy, SnapKV, Spanned, Spans)
from kvcache_ext.policies.token_ids import UNKNOWN, TokenIds
from kvcache_ext.policies.token_kinds import TokenKinds
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("The pass key is 3336625. Remember it!\nWhat is it? (e.g. 12,345 or 3.14) don't")


def _groups(tokenizer, ids, unit):
    """The texts of the spans of ``ids`` under ``unit``."""
    starts = Spans(unit).starts(torch.tensor([ids]), TokenKinds.of(tokenizer))[0].tolist()
    spans = {}
    for i, s in enumerate(starts):
        spans.setdefault(s, []).append(ids[i])
    return [tokenizer.decode(group) for group in spans.values()]


# --------------------------------------------------------------------------- boundaries

def test_span_boundaries_of_the_default_tokenizer(default_model):
    _, tokenizer = default_model
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert _groups(tokenizer, ids, "word") == [
        "The", " pass", " key", " is", " ", "3336625", ".", " Remember", " it", "!", "\n", "What", " is",
        " it", "?", " (", "e", ".", "g", ".", " ", "12", ",", "345", " or", " ", "3", ".", "14", ")", " don", "'t"]
    numbers = _groups(tokenizer, ids, "number")
    assert "3336625" in numbers and "12" in numbers and "345" in numbers and "14" in numbers
    assert all(len(tokenizer.encode(g, add_special_tokens=False)) == 1 or g.strip().isdecimal() for g in numbers)
    assert _groups(tokenizer, ids, "sentence") == [
        "The pass key is 3336625.", " Remember it!", "\n", "What is it?", " (e.", "g.", " 12,345 or 3.",
        "14) don't"]
    # Two numbers with a space between are two spans; a word glued to digits splits at the digits.
    ids = tokenizer.encode("call 555 1234 or x25", add_special_tokens=False)
    assert _groups(tokenizer, ids, "number")[-1] == "25"
    assert "555" in _groups(tokenizer, ids, "number") and "1234" in _groups(tokenizer, ids, "number")
    assert _groups(tokenizer, ids, "word")[-2:] == [" x", "25"]


def test_token_kinds_by_hand():
    kinds = TokenKinds.from_texts([" the", "cat", "3", " 4", ".", "!\n", "", "\ufffd", "x."])
    flags = kinds.lookup(torch.arange(-1, 10)).tolist()
    from kvcache_ext.policies.token_kinds import BREAK_AFTER as A, BREAK_BEFORE as B, DIGITS as D, ENDS_SENTENCE as E
    assert flags == [A | B, B, 0, D, B | D, A | B | E, A | B | E, A | B, 0, A | E, A | B]


# --------------------------------------------------------------------------- literal twins

TEXTS = [" the", "cat", "3", " 4", "7", ".", "!\n", ",", "ab", "", "\ufffd", " (", "?"]


def _wordy(c):
    return c.isalnum() or c == "\ufffd"


def _literal_continues(unit, before, text):
    digits = lambda t: bool(t.strip()) and t.strip().isdecimal()   # noqa: E731
    if unit == "number":
        return digits(text) and digits(before) and not text[0].isspace()
    if unit == "word":
        return bool(text) and bool(before) and _wordy(text[0]) and _wordy(before[-1]) and digits(text) == digits(before)
    return not (before.rstrip().endswith((".", "!", "?")) or "\n" in before)


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), H=st.integers(1, 3), S=st.integers(0, 24),
       L=st.integers(0, 12), unit=st.sampled_from(["number", "word", "sentence"]))
def test_span_of_equals_a_walk_over_the_texts(seed, B, H, S, L, unit):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, len(TEXTS) + 2, (B, S), generator=g)   # -1: never noted; past the table too
    record = TokenIds()
    if S:
        record.note(ids, torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool), S - 1)
    else:
        record.note(torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, 1, dtype=torch.long),
                    torch.zeros(B, 1, dtype=torch.bool), 0)
        S = record.ids.shape[1]
        ids = torch.full((B, S), UNKNOWN)
    pos = torch.randint(-1, S + 3, (B, H, L), generator=g)
    span, known = Spans(unit).span_of(record, TokenKinds.from_texts(TEXTS), pos)
    text = lambda i: TEXTS[i] if 0 <= i < len(TEXTS) else "<unk>"   # noqa: E731  (every break)
    for b in range(B):
        for h in range(H):
            for j in range(L):
                p = int(pos[b, h, j])
                if p < 0 or p >= S:
                    assert (int(span[b, h, j]), bool(known[b, h, j])) == (p, False)
                    continue
                row = ids[b].tolist()
                q = p
                while (q > 0 and row[q] != UNKNOWN and row[q - 1] != UNKNOWN
                       and _literal_continues(unit, text(row[q - 1]), text(row[q]))):
                    q -= 1
                assert int(span[b, h, j]) == q, (row, p)
                assert bool(known[b, h, j]) == (row[p] != UNKNOWN)


def _literal_share(scores, span, live, reduce, share=1.0):
    out = scores.clone()
    rows = scores.reshape(scores.shape[0] * scores.shape[1], scores.shape[-1])
    spans, lives, outs = span.reshape(rows.shape), live.reshape(rows.shape), out.view(rows.shape)
    for r in range(rows.shape[0]):
        members = {}
        for i in range(rows.shape[1]):
            if lives[r, i]:
                members.setdefault(int(spans[r, i]), []).append(float(rows[r, i]))
        for i in range(rows.shape[1]):
            if lives[r, i]:
                vals = members[int(spans[r, i])]
                of_span = max(vals) if reduce == "max" else sum(vals) / len(vals)
                outs[r, i] = share * of_span + (1 - share) * float(rows[r, i])
    return out


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), H=st.integers(1, 3), L=st.integers(0, 16),
       reduce=st.sampled_from(["max", "mean"]), share=st.sampled_from([1.0, 0.75, 0.5, 0.25, 0.0]))
def test_span_scores_equal_loops_on_ragged_rows(seed, B, H, L, reduce, share):
    """Rows of a [B, H, L] view: each head holds its own tokens (some none, some one), padded
    at the end; padding and a recent window take no part; spans are runs of equal ids, and a
    span id may repeat in other rows (spans never cross rows)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, L + 1, (B, H), generator=g)
    mask = torch.arange(L) < lens[..., None]
    span = torch.randint(0, 3, (B, H, L), generator=g).cumsum(dim=-1)     # runs of equal ids
    scores = torch.randn(B, H, L, generator=g).masked_fill(~mask, 77.0)
    recent = torch.rand(B, H, L, generator=g) < 0.15
    live = mask & ~recent
    got = Spans("word", reduce, share)(scores, span, live)
    want = _literal_share(scores.double(), span, live, reduce, share)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[~live], scores[~live])                           # padding keeps its value


def test_span_scores_by_hand():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0, float("inf")]])
    span = torch.tensor([[0, 0, 0, 3, 3, 3]])
    live = torch.isfinite(x)
    assert Spans(reduce="max")(x, span, live).tolist() == [[5.0, 5.0, 5.0, 3.0, 3.0, float("inf")]]
    assert Spans(reduce="mean")(x, span, live)[0].tolist() == pytest.approx([8 / 3] * 3 + [1.5, 1.5, float("inf")])
    # Half the span's max, half the token's own: a span's best token still ranks first in it.
    assert Spans(share=0.5)(x, span, live).tolist() == [[3.0, 5.0, 3.5, 1.5, 3.0, float("inf")]]
    assert Spans(share=0.0)(x, span, live).tolist() == x.tolist()
    # Broadcast span and live over heads; an empty view.
    y = torch.arange(12.0).view(1, 2, 6)
    assert Spans()(y, span[:, None], torch.ones(1, 1, 6, dtype=torch.bool))[0, 1].tolist() == [8.0] * 3 + [11.0] * 3
    assert Spans()(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.long),
                   torch.zeros(2, 3, 0, dtype=torch.bool)).shape == (2, 3, 0)


def test_token_ids_by_position_with_padding_and_growth():
    record = TokenIds()
    # Left padding at position 0 (generate's position ids): the pad must not overwrite the real token.
    record.note(torch.tensor([[9, 9, 5, 6], [7, 8, 1, 2]]), torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]),
                torch.tensor([[False, False, True, True], [True] * 4]), 3)
    assert record.ids.tolist() == [[5, 6, -1, -1], [7, 8, 1, 2]]
    record.note(torch.tensor([[4], [3]]), torch.tensor([[2], [40]]), torch.ones(2, 1, dtype=torch.bool), 40)
    assert record.ids.shape[1] >= 41 and record.ids[0, :3].tolist() == [5, 6, 4] and int(record.ids[1, 40]) == 3
    copy = record.copy()
    record.clear()
    assert record.ids is None and int(copy.ids[1, 40]) == 3
    with pytest.raises(ValueError, match="batch of 2"):
        copy.note(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long),
                  torch.ones(3, 1, dtype=torch.bool), 0)


# --------------------------------------------------------------------------- refusals

def test_spans_refuse_bad_parameters():
    with pytest.raises(ValueError, match="Spans unit.*'number', 'word', 'sentence'.*'letter'"):
        Spans(unit="letter")
    with pytest.raises(ValueError, match="Spans reduce.*'max', 'mean'.*'sum'"):
        Spans(reduce="sum")
    with pytest.raises(TypeError, match="Spans unit"):
        Spans(unit=1)
    for share in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"Spans share must be a number in \[0, 1\].*got"):
            Spans(share=share)
    with pytest.raises(TypeError, match="Spans share"):
        Spans(share="half")
    with pytest.raises(TypeError, match="Spanned base"):
        Spanned("snapkv")
    with pytest.raises(TypeError, match="Spanned spans"):
        Spanned(SnapKV(), spans="word")


def test_patch_refuses_spans_without_a_tokenizer():
    model = tiny_model()
    with pytest.raises(ValueError, match="patch tokenizer: None.*Spanned.*tokenizer="):
        kvcache_ext.patch(model, Policy(Spanned(SnapKV(window=4)), budget=16))
    assert not kvcache_ext.is_patched(model)
    # Wrapped once more (CAOTE over Spanned): still refused.
    from kvcache_ext.policies import CAOTE
    with pytest.raises(ValueError, match="tokenizer"):
        kvcache_ext.patch(model, Policy(CAOTE(Spanned(SnapKV(window=4))), budget=16))
    # A plain policy patches without a tokenizer, and notes no ids.
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=16)) as handle:
        cache = handle.new_cache()
        model(torch.randint(0, 100, (1, 20)), **with_cache(model, cache), use_cache=True)
        assert cache.token_ids.ids is None


# --------------------------------------------------------------------------- through the model

def _numbers_text(seed: int, count: int = 40) -> str:
    rnd = random.Random(seed)
    words = ["the", "value", "of", "box", "is", "code", "and", "then", "we", "saw", "a", "red", "door"]
    parts = []
    for _ in range(count):
        parts += [rnd.choice(words) for _ in range(rnd.randint(2, 6))]
        parts.append(str(rnd.randint(10**4, 10**8)) + rnd.choice([".", ",", ""]))
    return " ".join(parts)


def _batch(tokenizer, texts):
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def _cut_numbers(tokenizer, cache, ids, mask, window):
    """Per (layer, row, KV head): how many numbers outside the protected window are kept in part."""
    digit = torch.tensor([tokenizer.decode([i]).strip().isdecimal() for i in range(len(tokenizer))])
    counts = []
    for layer in range(len(cache.layers)):
        view = cache.layer_kv(layer).view({}, False)
        for b in range(ids.shape[0]):
            real = ids[b][mask[b].bool()]
            n = real.shape[0]
            runs, start = [], None
            for p in range(n + 1):
                d = p < n and bool(digit[real[p]])
                if d and start is None:
                    start = p
                elif not d and start is not None:
                    if p - 1 <= n - 1 - window:   # wholly outside the window
                        runs.append((start, p))
                    start = None
            for h in range(view["pos"].shape[1]):
                kept = set(view["pos"][b, h][view["mask"][b, h]].tolist())
                counts.append(sum(0 < len(kept & set(range(s, e))) < e - s for s, e in runs))
    return counts


@pytest.mark.parametrize("unit,reduce", [("number", "max"), ("word", "max"), ("word", "mean"), ("sentence", "max")])
def test_spans_keep_numbers_whole_through_generate(default_model, unit, reduce):
    """Left-padded batch of 2 through generate: with spans a head cuts at most one number (the
    one at its threshold); plain SnapKV on the same prompts cuts many (so this can fail)."""
    model, tokenizer = default_model
    ids, mask = _batch(tokenizer, [_numbers_text(0), _numbers_text(1, count=30)])
    window = 8
    cuts = {}
    for name, scorer in [("spans", Spanned(SnapKV(window=window, kernel=1), Spans(unit, reduce))),
                         ("plain", SnapKV(window=window, kernel=1))]:
        with kvcache_ext.patch(model, Policy(scorer, ratio=0.3), tokenizer=tokenizer) as handle:
            cache = handle.new_cache()
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, **with_cache(model, cache))
            cuts[name] = _cut_numbers(tokenizer, cache, ids, mask, window)
    assert max(cuts["spans"]) <= 1, cuts["spans"]
    assert max(cuts["plain"]) >= 2 and sum(cuts["plain"]) > 2 * sum(cuts["spans"])


def test_generate_notes_the_ids_by_position(default_model):
    model, tokenizer = default_model
    ids, mask = _batch(tokenizer, [_numbers_text(2, 6), _numbers_text(3, 3)])
    with kvcache_ext.patch(model, Policy(Spanned(SnapKV(window=4)), budget=24), tokenizer=tokenizer) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
        assert out.past_key_values is handle.last_cache        # the cache generate made
        noted, out = out.past_key_values.token_ids.ids, out.sequences
    for b in range(2):
        fed = torch.cat([ids[b][mask[b].bool()], out[b, ids.shape[1]:-1]])   # the last token is never fed
        assert noted[b, :fed.shape[0]].tolist() == fed.tolist()
        assert (noted[b, fed.shape[0]:] == UNKNOWN).all()


def test_a_budget_of_the_whole_sequence_gives_the_unpatched_logits(default_model):
    model, tokenizer = default_model
    ids, mask = _batch(tokenizer, [_numbers_text(4, 8), _numbers_text(5, 5)])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(ids, **kwargs)
    with kvcache_ext.patch(model, Policy(Spanned(SnapKV(window=8)), budget=4096), tokenizer=tokenizer):
        got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", [BlockwisePrefill(32), EveryStep(), EveryStep(prefill_block=16)],
                         ids=["blockwise", "every-step", "both"])
def test_spans_over_the_cache_agree_with_the_reference_path(default_model, schedule):
    """Block-wise prefill and decode eviction, batch 2 left-padded, teacher-forced: the ragged
    store and the reference's masked cache keep the same tokens and give the same logits."""
    model, tokenizer = default_model
    ids, mask = _batch(tokenizer, [_numbers_text(6, 8), _numbers_text(7, 5)])
    fed = torch.tensor(tokenizer([" 1234567 and 89"] * 2, add_special_tokens=False).input_ids)
    policy = Policy(Spanned(SnapKV(window=4), Spans("word")), budget=40, schedule=schedule,
                    allocation=AdaKV())
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    logits = {}
    with torch.no_grad(), kvcache_ext.patch(model, policy, tokenizer=tokenizer) as handle:
        caches = {"ragged": handle.new_cache(), "reference": handle.new_cache(reference=True)}
        for name, cache in caches.items():
            m = mask
            out = [model(ids, attention_mask=m, position_ids=pos, **with_cache(model, cache)).logits[:, -1]]
            for t in range(fed.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out.append(model(fed[:, t:t + 1], attention_mask=m, position_ids=pos[:, -1:] + t + 1,
                                 **with_cache(model, cache)).logits[:, -1])
            logits[name] = torch.stack(out, dim=1)
    torch.testing.assert_close(logits["ragged"], logits["reference"], rtol=1e-4, atol=1e-4)
    ragged, reference = caches["ragged"], caches["reference"]
    for layer in range(len(ragged.layers)):
        a, b = ragged.layer_kv(layer).view(None, False), reference.layer_kv(layer).view(None, False)
        assert torch.equal(a["pos"].masked_fill(~a["mask"], -1), b["pos"].masked_fill(~b["mask"], -1))
    assert int(ragged.kept_tokens()[0].max()) <= 60          # evicted (budget 40 over ~60+ tokens a row)
    assert torch.equal(ragged.token_ids.ids, reference.token_ids.ids)


def test_shared_prefill_keeps_what_the_patched_prefill_keeps(default_model):
    """The evaluation's path (record once, compress per policy) hands the policy the prompt's
    ids and the tokenizer's kinds: the same tokens kept as the patched model's own prefill."""
    model, tokenizer = default_model
    ids = tokenizer(_numbers_text(8, 12), return_tensors="pt", add_special_tokens=False).input_ids
    policy = make_policy("snapkv-spans", 48)
    with torch.no_grad():
        recorded = record_prefill(model, ids)
        with kvcache_ext.patch(model, policy, tokenizer=tokenizer) as handle:
            direct = handle.new_cache()
            model(ids, **with_cache(model, direct), use_cache=True)
            shared = compressed_cache(policy, recorded, handle.model_parts)
            with pytest.raises(RuntimeError, match="token kinds"):
                compressed_cache(policy, recorded)          # the recording's parts lack the tokenizer's
    for layer in range(len(direct.layers)):
        d, s = direct.layer_kv(layer).view({}, False), shared.layer_kv(layer).view({}, False)
        assert torch.equal(d["pos"], s["pos"]) and torch.equal(d["mask"], s["mask"])
    assert torch.equal(direct.token_ids.ids[:, :ids.shape[1]], shared.token_ids.ids[:, :ids.shape[1]])
    # and spans changed the selection (the test is not trivially about SnapKV)
    with kvcache_ext.patch(model, make_policy("snapkv", 48), tokenizer=tokenizer) as handle:
        plain = compressed_cache(handle.policy, recorded, handle.model_parts)
    assert any(not torch.equal(plain.layer_kv(i).view({}, False)["pos"], shared.layer_kv(i).view({}, False)["pos"])
               for i in range(len(plain.layers)))
