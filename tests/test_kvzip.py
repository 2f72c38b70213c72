"""KVzip: query-agnostic scores from context reconstruction passes (kvcache_ext.engine.reconstruction).

- the ragged path equals the reference path (logits and tokens kept) for every allocation,
  one and several passes, both scoring softmaxes, a left-padded batch of 2, GQA;
- the scores equal an independent implementation: the unpatched model run on the context
  followed by the pass's tokens, its eager attention probabilities (renormalised over the
  keys of KVzip's code for ``softmax="chunk"``), the largest over queries and heads;
- across-layer budgets are one top-k over every head of every layer;
- generate, unpatch and the errors a user can meet.
"""
import json

import pytest
import torch

import kvcache_ext
from kvcache_ext import cli
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import (H2O, AcrossLayers, AdaKV, BlockwisePrefill, EveryStep, KVzip, OneShot,
                                  Policy, Pyramid, Uniform)
from test_patch import assert_paths_agree, inputs
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Token ids for the instructions: the tiny models have no tokenizer (so no chat prefix either).
IDS = dict(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None)


def kvzip(**kw):
    return KVzip(**{**IDS, **kw})


@pytest.mark.parametrize("allocation", [Uniform(), AdaKV(), Pyramid(beta=4),
                                        AdaKV(alpha=1.0, layers=AcrossLayers()), AcrossLayers()],
                         ids=repr)
@pytest.mark.parametrize("chunk,softmax,skip", [(64, "chunk", False), (16, "chunk", False), (16, "context", False),
                                                (7, "chunk", False), (16, "chunk", True), (64, "context", True)])
def test_ragged_path_equals_reference_path(allocation, chunk, softmax, skip):
    # skip: the first row of assert_paths_agree's batch opens with the skipped prefix.
    prefix = tuple(inputs(batch=2, length=60, pad=(0, 7))[0][0, :5].tolist()) if skip else None
    ragged, _ = assert_paths_agree(Policy(kvzip(chunk=chunk, softmax=softmax, skip_prefix=prefix), budget=20,
                                          allocation=allocation))
    # What is held is the budget, spread over the layers when they share it.
    kept = sum(int(t.sum()) for t in ragged.kept_tokens())
    assert abs(kept - 3 * 2 * 2 * (20 + 8)) <= 3 * 2 * 2


def _independent_scores(model, ids, passes, softmax, sinks, rated=None):
    """Per layer [H, n]: the unpatched model's eager attention of each pass over the context
    (``rated`` [n] bool: the columns that may score, None: all)."""
    n = ids.shape[1]
    cfg = model.config
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    scores = None
    model.set_attn_implementation("eager")
    try:
        for inputs_, _, lo, hi in passes:
            with torch.no_grad():
                att = model(torch.cat([ids, inputs_], dim=1), output_attentions=True).attentions
            per_layer = []
            for a in att:
                a = a[0, :, n:, :].double()                             # [Hq, r, n + r]
                if softmax == "chunk":
                    keep = torch.zeros(a.shape[-1], dtype=torch.bool)
                    keep[:sinks], keep[lo:hi], keep[n:] = True, True, True
                    a = a * keep / (a * keep).sum(dim=-1, keepdim=True)
                    cols = torch.zeros(n, dtype=torch.bool)
                    cols[lo:hi] = True
                else:
                    cols = torch.ones(n, dtype=torch.bool) if rated is None else rated
                s = a[..., :n].amax(dim=1).view(-1, G, n).amax(dim=1) * cols
                per_layer.append(s)
            scores = per_layer if scores is None else [torch.maximum(x, y) for x, y in zip(scores, per_layer)]
    finally:
        model.set_attn_implementation("sdpa")
    return scores


@pytest.mark.parametrize("skip", [0, 6], ids=["whole", "skip6"])
@pytest.mark.parametrize("chunk,softmax", [(100, "context"), (100, "chunk"), (13, "chunk"), (13, "context")])
def test_scores_equal_an_independent_implementation(chunk, softmax, skip):
    """``skip``: the context opens with ``skip_prefix`` (6 tokens): the passes rebuild what
    follows, in chunks from there, and the prefix scores 0 past the sinks (kvpress's reading)."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, _ = inputs(batch=1, length=40, seed=4)
    scorer = kvzip(chunk=chunk, softmax=softmax, skip_prefix=tuple(ids[0, :skip].tolist()) if skip else None)
    policy = Policy(scorer, budget=10)
    rebuilt = torch.ones_like(ids, dtype=torch.bool)
    rebuilt[:, :skip] = False
    rated = rebuilt[0] | (torch.arange(40) < scorer.sinks)
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        model(ids, **with_cache(model, cache), use_cache=True)   # the forward's end runs the passes
        assert torch.equal(scorer.rebuilt(ids, torch.ones_like(rebuilt), handle.tokens), rebuilt)
        passes = scorer.passes(ids, rebuilt, handle.tokens, skip)
        assert len(passes) == -(-(40 - skip) // chunk)
        assert passes[0][2] == skip and passes[0][0][0, -min(chunk, 40 - skip):].tolist() == \
            ids[0, skip:skip + chunk].tolist()
    # The scores of a cache are not kept; compute them again through the same entry point.
    from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill
    recorded = record_prefill(model, ids)
    with kvcache_ext.patch(model, policy) as handle:
        got = handle.score_prompt(compressed_cache(policy, recorded), ids)
    expected = _independent_scores(model, ids, passes, softmax, scorer.sinks, rated)
    for layer, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g[0].double(), e, atol=1e-5, rtol=1e-4, msg=f"layer {layer}")
        assert bool((g[0][:, ~rated] == 0).all()) and bool((g[0][:, rebuilt[0]] > 0).all())


@pytest.mark.parametrize("chunk,softmax", [(100, "context"), (100, "chunk"), (13, "chunk"), (13, "context")])
def test_scores_on_sliding_layers_equal_an_independent_implementation(chunk, softmax):
    """Gemma 3 with a sliding layer of 16 tokens under a context of 40: each pass query sees the
    keys of its window only, as the model's eager attention does; then the ragged path keeps
    what the reference path keeps, and generate runs past the window."""
    model = tiny_model("gemma3_text", heads=4, kv_heads=2, layers=2, sliding_window=16)
    ids, _ = inputs(batch=1, length=40, seed=4)
    scorer = kvzip(chunk=chunk, softmax=softmax)
    policy = Policy(scorer, budget=10)
    from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill
    recorded = record_prefill(model, ids)
    assert recorded.windows == [16, None]
    with kvcache_ext.patch(model, policy) as handle:
        passes = scorer.passes(ids, torch.ones_like(ids, dtype=torch.bool), handle.tokens, 0)
        got = handle.score_prompt(compressed_cache(policy, recorded), ids)
    expected = _independent_scores(model, ids, passes, softmax, scorer.sinks)
    for layer, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g[0].double(), e, atol=1e-5, rtol=1e-4, msg=f"layer {layer}")
    # The window bit: the sliding layer's earliest context tokens are seen by no pass query.
    assert bool((got[0][0][:, :8] == 0).all()) and bool((got[1][0][:, :8] > 0).any())
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        out = model.generate(ids, **with_cache(model, ragged), max_new_tokens=5, do_sample=False)
        ref = model.generate(ids, **with_cache(model, reference), max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    for a, b in zip(ragged.kept_tokens(), reference.kept_tokens()):
        assert torch.equal(a, b)


def test_global_allocation_hands_no_sliding_layer_budget_to_other_layers():
    """KVzip's global top-k on a model whose sliding layer (16 tokens) cannot hold the budget
    (24 of a 40-token prompt): the cache holds what the uniform allocation holds, the sliding
    layer's surplus is not spent on the full layer."""
    model = tiny_model("gemma3_text", heads=4, kv_heads=2, layers=2, sliding_window=16)
    ids, _ = inputs(batch=1, length=40, seed=4)
    kept = {}
    for name, allocation in (("uniform", Uniform()), ("global", AdaKV(alpha=1.0, layers=AcrossLayers()))):
        with kvcache_ext.patch(model, Policy(kvzip(chunk=16), budget=24, allocation=allocation)) as handle:
            cache = handle.new_cache()
            with torch.no_grad():
                model(ids, **with_cache(model, cache), use_cache=True)
        kept[name] = [t[0] for t in cache.kept_tokens()]
    assert kept["uniform"][0].tolist() == [15, 15] and kept["uniform"][1].tolist() == [24, 24]
    assert sum(int(t.sum()) for t in kept["global"]) == sum(int(t.sum()) for t in kept["uniform"])
    assert int(kept["global"][0].max()) <= 15


@pytest.mark.parametrize("skip", [None, 0, 1], ids=["whole", "skip-row0", "skip-row1"])
@pytest.mark.parametrize("chunk,softmax", [(100, "context"), (100, "chunk"), (13, "chunk"), (13, "context")])
def test_a_left_padded_batch_scores_each_row_as_alone(chunk, softmax, skip):
    """Batch 2, the second row left-padded by 9: each row's scores (its real tokens) are those
    of the row scored alone, so padding neither scores nor is scored (its pass is left-padded
    too); the independent test above covers batch 1. Chunks split the padded columns, so with
    several passes only the unpadded row is rebuilt in the same chunks as alone. ``skip``: the
    row whose 5 first real tokens are ``skip_prefix`` (the other row does not open with them;
    for row 1 the prefix lies inside the batch's first chunk, where its keys are seen but not rated;
    with no sinks, as sinks go by position and the padded row's positions start at 9 here)."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=31, pad=(0, 9), seed=5)
    assert ids[1, 9:14].tolist() != ids[0, :5].tolist()
    prefix = None if skip is None else tuple(ids[skip, 9 * skip:9 * skip + 5].tolist())
    policy = Policy(kvzip(chunk=chunk, softmax=softmax, skip_prefix=prefix, sinks=0 if skip == 1 else 4),
                    budget=10)
    from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill

    def scores(ids_, mask_):
        recorded = record_prefill(model, ids_, mask_)
        with kvcache_ext.patch(model, policy) as handle:
            return handle.score_prompt(compressed_cache(policy, recorded), ids_, mask_)

    both = scores(ids, mask)
    for row in range(2) if chunk >= ids.shape[1] else (0,):
        real = mask[row].bool()
        alone = scores(ids[row:row + 1, real], mask[row:row + 1, real])
        for layer, (b, a) in enumerate(zip(both, alone)):
            torch.testing.assert_close(b[row][:, real], a[0], atol=1e-5, rtol=1e-4,
                                       msg=f"row {row}, layer {layer}")
            assert (b[row][:, ~real] == 0).all()


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("how", ["all", "mask", "causal"])
def test_attention_with_lse_equals_softmax_of_the_logits(monkeypatch, G, how):
    """A reconstruction pass's attention and log-sum-exp, from the fused op (CPU) and from the
    logits (elsewhere), equal a plain softmax of the masked logits: all keys, a padding mask
    (one query sees nothing: output 0, lse -inf) and causal; GQA and one head per group."""
    from kvcache_ext.engine import reconstruction
    gen = torch.Generator().manual_seed(3)
    B, H, c, D = 2, 2, 5, 8
    S = c if how == "causal" else 11
    q, k, v = (torch.randn(B, h, s, D, generator=gen) for h, s in ((H * G, c), (H, S), (H, S)))
    sees = {"all": torch.ones(B, 1, c, S, dtype=torch.bool),
            "mask": torch.rand(B, 1, c, S, generator=gen) < 0.6,
            "causal": torch.ones(c, S, dtype=torch.bool).tril().expand(B, 1, c, S)}[how].clone()
    if how == "mask":
        sees[..., 0] = True
        sees[1, 0, 2] = False            # a query that sees nothing
    given = dict(sees=sees if how == "mask" else None, causal=how == "causal")
    fused = reconstruction.attention_with_lse(q, k, v, 0.3, **given)
    monkeypatch.setattr(reconstruction, "FUSED_LSE_DEVICES", ())
    plain = reconstruction.attention_with_lse(q, k, v, 0.3, **given)
    logits = (q.view(B, H, G, c, D) * 0.3) @ k[:, :, None].transpose(-1, -2)
    logits = logits.masked_fill(~sees[:, :, None], float("-inf")).flatten(1, 2)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    expected = (probs @ v.repeat_interleave(G, dim=1), logits.logsumexp(dim=-1))
    if how == "mask":
        assert expected[1][1, :, 2].isneginf().all()
    for got in (fused, plain):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(0, 12), (0, 5), (5, 9), (9, 12)])
@pytest.mark.parametrize("softmax", ["chunk", "context"])
def test_scored_keys_and_the_rest_split_each_rows_context_once(window, softmax):
    """The keys a pass's attention runs over, in parts: every valid context key of every row
    lies in exactly one part, with its own K and V; the scored part holds each row's sinks
    (first ``sinks`` positions, moved by left padding) then the window (``softmax="chunk"``), or
    the whole context (``"context"``, or a window that covers it)."""
    from kvcache_ext.engine.reconstruction import Context, scored_keys
    gen = torch.Generator().manual_seed(5)
    B, H, n, D = 2, 2, 12, 4
    pad = torch.tensor([0, 3])                                   # row 1: left-padded by 3
    valid = torch.arange(n)[None] >= pad[:, None]
    pos = (torch.arange(n)[None] - pad[:, None]).clamp(min=0)
    k, v = (torch.randn(B, H, n, D, generator=gen) for _ in range(2))
    k[..., 0] = torch.arange(n, dtype=torch.float32)             # each key names its column
    ctx = Context(k=k, v=v, pos=pos, valid=valid, scale=1.0, scores=torch.zeros(B, H, n), window=window)
    scorer = kvzip(softmax=softmax, sinks=2)
    scored, rest = scored_keys(ctx, scorer)
    lo, hi = window
    whole = softmax == "context" or window == (0, n)
    assert scored.window == ((0, n) if whole else window)
    parts = [(scored.k, scored.v, scored.sees)] + ([rest] if rest is not None else [])
    for b in range(B):
        columns = []
        for part_k, part_v, sees in parts:
            seen = torch.ones(part_k.shape[2], dtype=torch.bool) if sees is None else sees[b, 0, 0]
            cols = part_k[b, 0, seen, 0].long()
            torch.testing.assert_close(part_v[b][:, seen], v[b][:, cols])
            columns.append(cols.tolist())
        expected = [j for j in range(n) if valid[b, j]]
        assert sorted(sum(columns, [])) == expected
        assert scored.k[b, 0, scored.first:, 0].long().tolist() == list(range(n) if whole else range(lo, hi))
        if not whole:
            sinks = [j for j in range(lo) if valid[b, j] and pos[b, j] < 2]
            assert columns[0] == sinks + [j for j in range(lo, hi) if valid[b, j]]


def test_passes_chunk_the_context_with_the_instructions():
    scorer = kvzip(chunk=4, overlap=2)
    ids = torch.tensor([[0, 0, 21, 22, 23, 24, 25, 26]])
    valid = ids != 0
    passes = scorer.passes(ids, valid, lambda text: pytest.fail("no text to tokenize"))
    assert [(lo, hi) for _, _, lo, hi in passes] == [(0, 4), (4, 8)]
    first, second = passes[0][0][0].tolist(), passes[1][0][0].tolist()
    assert first == [5, 6, 7, 10, 21, 22]                          # padding is not repeated
    assert second == [8, 9, 21, 22, 10, 23, 24, 25, 26]            # the last 2 tokens before it
    assert passes[0][1].all() and passes[1][1].all()


def test_across_layers_is_one_topk_over_every_head_and_layer():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(2, 3, 50, generator=g) for _ in range(4)]
    scores[1][:, :, :5] = float("inf")                  # protected: ranked first
    scores[2][1, :, 40:] = float("-inf")                # not held
    budget = torch.tensor([10, 7])
    got = AcrossLayers().layer_budgets(budget, scores)
    flat = torch.cat([s.flatten(1) for s in scores], dim=1)
    for b in range(2):
        top = torch.topk(flat[b], int(budget[b]) * 12).indices
        counts = torch.bincount(top // 150, minlength=4)
        # Each layer's count of the top-k exactly, as a budget per head (count / H).
        assert [float(x[b]) * 3 for x in got] == pytest.approx([float(c) for c in counts], abs=1e-9)
    # Alone, AcrossLayers gives each head of a layer the nearest whole token of that budget.
    per_head = AcrossLayers().head_budgets(got[0], scores[0], torch.ones(2, 3, 50, dtype=torch.bool),
                                           torch.zeros(2, 3, 50, dtype=torch.bool), None)
    assert per_head.dtype == torch.int64
    assert per_head.tolist() == [[int(float(b) + 0.5)] * 3 for b in got[0]]


def test_kvzip_global_keeps_exactly_the_topk_over_every_head_and_layer():
    """AdaKV(alpha=1.0, layers=AcrossLayers()): every (layer, head) holds exactly its tokens
    among the L * H * B best scores of the model, sinks first, with no rounding per layer."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, _ = inputs(batch=1, length=40, seed=4)
    budget = 7
    policy = Policy(kvzip(chunk=16), budget=budget, allocation=AdaKV(alpha=1.0, layers=AcrossLayers()))
    from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill
    recorded = record_prefill(model, ids)
    with kvcache_ext.patch(model, policy) as handle:
        cache = compressed_cache(policy, recorded)
        scores = handle.score_prompt(cache, ids)
    ranked = torch.stack([s[0] for s in scores])                          # [L, H, n]
    ranked[..., :policy.scorer.sinks] = float("inf")
    top = torch.topk(ranked.flatten(), budget * ranked.shape[0] * ranked.shape[1]).indices
    expected = torch.bincount(top // ranked.shape[2], minlength=ranked.shape[0] * ranked.shape[1])
    held = torch.stack([k[0] for k in cache.kept_tokens()]).flatten()
    assert held.tolist() == expected.tolist()
    # Some layer's count is not a multiple of its 2 heads: whole tokens per head could not hold it.
    assert any(count % 2 for count in expected.view(3, 2).sum(dim=1).tolist())


def test_generate_compresses_once_and_unpatch_restores_forward():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=50, pad=(0, 6))
    forward = model.forward
    with kvcache_ext.patch(model, Policy(kvzip(chunk=20), budget=12)) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True)
        cache = out.past_key_values
        assert out.sequences.shape == (2, 55)
        # Every head holds its 12 tokens and the 4 decoded since (the 5th was not fed back).
        assert all(bool((t == 16).all()) for t in cache.kept_tokens())
    assert model.forward == forward and "forward" not in vars(model)


def test_generate_reserves_the_decode_tokens_after_the_passes():
    """The passes do not count as tokens of the sequence: after them every head holds pages for
    its budget and the max_new_tokens - 1 tokens generate feeds back, and decoding allocates nothing."""
    from transformers import LogitsProcessorList
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=50, pad=(0, 6))
    allocations = []

    def record(input_ids, scores):
        allocations.append([handle.last_cache.layer_kv(i).store.slab_allocations for i in range(3)])
        return scores

    with kvcache_ext.patch(model, Policy(kvzip(chunk=20), budget=12), page_size=8) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, logits_processor=LogitsProcessorList([record]),
                             pad_token_id=0, return_dict_in_generate=True)
        cache = out.past_key_values
        assert len(allocations) == 20 and all(a == allocations[0] for a in allocations)
        for i in range(3):
            store = cache.layer_kv(i).store
            assert bool((store.lens == 12 + 19).all()) and bool((store.caps == 32).all())


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="one-shot"):
        Policy(kvzip(), budget=16, schedule=BlockwisePrefill(16))
    with pytest.raises(ValueError, match="one-shot"):
        Policy(kvzip(), budget=16, schedule=EveryStep())
    with pytest.raises(ValueError, match="AcrossLayers"):
        Policy(H2O(), budget=16, allocation=AdaKV(layers=AcrossLayers()))
    with pytest.raises(ValueError, match="chunk"):
        KVzip(chunk=0)
    with pytest.raises(ValueError, match="softmax"):
        KVzip(softmax="window")
    with pytest.raises(ValueError, match="prompt"):
        KVzip(prompt=[1, 2])
    with pytest.raises(ValueError, match="skip_prefix must be a string or a tuple of token ids"):
        KVzip(skip_prefix=5)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="tokenizer"):
        kvcache_ext.patch(model, Policy(KVzip(), budget=16, schedule=OneShot()))
    assert not kvcache_ext.is_patched(model)


def test_eval_keep_fractions_agnostic_on_the_default_model(default_model, monkeypatch, tmp_path, capsys):
    """CI's agnostic smoke test: --keep, KVzip's passes through the harness, on a short prompt."""
    monkeypatch.setattr("kvcache_ext.hf.models.load_model", lambda *a, **k: default_model)
    out = tmp_path / "keep.json"
    code = cli.main(["eval", "--task", "passkey", "--policy", "full,kvzip-global,snapkv", "--keep", "0.25,0.5",
                     "--lengths", "400", "--depths", "0.5", "--mode", "agnostic", "--json", str(out),
                     "--no-progress"])
    assert code == 0
    assert "keep 0.25" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = {(r["policy"], r["budget"]): r for r in doc["rows"]}
    assert set(rows) == {("full", None)} | {(p, k) for p in ("kvzip-global", "snapkv") for k in (0.25, 0.5)}
    for (policy, keep), row in rows.items():
        if policy != "full":
            assert abs(row["kv_fraction"] - keep) < 0.1, row
    records = [r for r in doc["records"] if r["policy"] == "kvzip-global"]
    assert all(r["prefill_s"] > 0 and r["budget_tokens"] >= 0.25 * 300 for r in records)
