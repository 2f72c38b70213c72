"""CAOTE and FastCAOTE (kvcache_ext.policies.caote) against the paper's equations.

- the scorer against a literal float64 implementation of Eq. 8 / 21-23 (normalize, reference
  vector, alpha / (1 - alpha) * distance) and of the GQA aggregations, written from the
  equations with loops, for every base-score source (H2O per-head accumulators, TOVA's
  newest row, SnapKV's pooled window, a base's shared score), on ragged heads and prompts;
- Theorem 3.2: the score is the true change of the attention output when one token is
  evicted and the rest renormalized (brute force), per head and for a GQA group;
- a dominant attention sink (alpha -> 1, fp16 / bf16 inputs) gives finite, non-zero scores;
- on tiny HF models: the ragged path gives the reference path's logits with CAOTE on H2O, TOVA
  and SnapKV, one-shot / block-wise / per-step schedules, Uniform / AdaKV / Pyramid, GQA,
  batch 2 with left padding; Eq. 7 (output after eviction) changes the block outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.engine.blocks import attend_in_blocks
from kvcache_ext.engine.decode import decode
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, CacheView, EveryStep, OneShot, Policy,
                                  PromptView, Protection, Pyramid, Random, Scorer, SnapKV, StreamingLLM,
                                  Uniform)
from kvcache_ext.policies.caote import CAOTE, FastCAOTE, caote_policy, caote_scores
from kvcache_ext.reference.masked_cache import MaskedLayerKV
from test_patch import assert_paths_agree, inputs, teacher_forced
from literal import held_layout, literal_pool, outside_window
from tiny_models import tiny_model

TOL = dict(rtol=1e-5, atol=1e-6)      # library float32 against literal float64


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- literal formulas

def literal_caote(h, V, fast):
    """Eq. 22 then Eq. 21 (or Eq. 23), float64, term by term: h [N] >= 0, V [N, D]."""
    h, V = h.double(), V.double()
    a = h / h.sum()                                                        # Eq. 22
    N = len(a)
    ref = V.sum(dim=0) / N if fast else sum(a[i] * V[i] for i in range(N))   # mean of V / V A^T
    return torch.stack([a[j] / (1 - a[j]) * torch.linalg.vector_norm(ref - V[j]) for j in range(N)])


def literal_group(cs, how):
    """cs: the G per-query-head score vectors of one KV head -> one vector (seed-000 §4.9)."""
    c = torch.stack(cs)
    if how == "group_l2":
        return torch.sqrt(sum(x * x for x in cs))
    return {"mean": c.mean(dim=0), "sum": c.sum(dim=0), "max": c.amax(dim=0)}[how]


def literal_softmax_rows(q, k, scale, visible):
    """q [n, D], k [L, D], visible [n, L] -> float64 softmax rows [n, L] over the visible keys
    (a row that sees nothing is all zeros)."""
    logits = (q.double() @ k.double().T) * scale
    out = torch.zeros_like(logits)
    for i in range(logits.shape[0]):
        if visible[i].any():
            row = logits[i].masked_fill(~visible[i], float("-inf"))
            e = torch.exp(row - row.max())
            out[i] = e / e.sum()
    return out


# --------------------------------------------------------------------------- random inputs

def ragged_layout(gen, B, H, span, fill=0.7):
    """pos, mask [B, H, L]: every head holds its own random subset of positions (padded at the end)."""
    hold = torch.rand(B, H, span, generator=gen) < fill
    hold[..., -1] = True
    hold[..., 0] = True
    return held_layout(hold)


def random_view(seed, B=2, H=2, G=3, span=14, D=8, channels=0, queries=0, pad_queries=0):
    gen = torch.Generator().manual_seed(seed)
    pos, mask = ragged_layout(gen, B, H, span)
    L = pos.shape[-1]
    z = lambda *shape: torch.randn(*shape, generator=gen)
    v = z(B, H, L, D).masked_fill(~mask[..., None], 0)
    k = z(B, H, L, D).masked_fill(~mask[..., None], 0)
    view = CacheView(pos=pos, mask=mask, channels=torch.rand(B, H, L, channels, generator=gen) * 5,
                     last_pos=pos.masked_fill(~mask, -1).amax(dim=(1, 2)), layer_idx=0, num_layers=1,
                     groups=G, k=k, v=v)
    last = torch.rand(B, H, L, G, generator=gen).masked_fill(~mask[..., None], 0)
    view.stats = {"last": last, "mass": last.sum(dim=-1)}
    view.stat_queries = 1
    if queries:   # a block of queries at the newest positions, the first `pad_queries` padding
        view.q = z(B, H * G, queries, D) * 1.5
        q_pos = torch.arange(span - queries, span).expand(B, queries).clone()
        q_pos[:, :pad_queries] = -1
        view.q_pos, view.scale, view.stat_queries = q_pos, 1 / math.sqrt(D), queries
    return view


# --------------------------------------------------------------------------- 1. the equations

@dataclass
class Doubled(Scorer):
    """A base with no per-query-head scores (CAOTE scores it as 'shared')."""

    def cache_scores(self, view):
        return 2.0 * view.stats["mass"] + 0.5


SOURCES = ["h2o", "tova", "snapkv_decode", "snapkv_block", "h2o_shared", "custom"]


def literal_view_case(source, view, b, h, s=None):
    """The literal per-query-head (or shared) base scores of head (b, h)'s tokens: [G' x m]."""
    m = int(view.mask[b, h].sum())
    G = view.groups
    if source == "h2o":
        return [view.channels[b, h, :m, 1 + g] for g in range(G)]
    if source == "tova":
        return [view.stats["last"][b, h, :m, g] for g in range(G)]
    if source == "h2o_shared":
        return [view.channels[b, h, :m, 0]]
    if source == "custom":
        return [2.0 * view.stats["mass"][b, h, :m].double() + 0.5]
    if source == "snapkv_decode":
        raw = [view.stats["last"][b, h, :m, g].double() for g in range(G)]
    else:                                  # the window's own per-head softmax over the head's tokens
        w = min(s.window, view.q.shape[2])
        q_pos = view.q_pos[b, -w:]
        pos = view.pos[b, h, :m]
        visible = pos[None, :] <= q_pos[:, None]
        raw = [literal_softmax_rows(view.q[b, h * G + g, -w:], view.k[b, h, :m], view.scale, visible).sum(dim=0)
               for g in range(G)]
    live = outside_window(view.pos[b, h, :m].tolist() + [int(view.last_pos[b])], s.window)[:m]
    return [literal_pool(x, s.kernel, s.pooling, live) for x in raw]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("fast", [False, True], ids=["CAOTE", "FastCAOTE"])
@pytest.mark.parametrize("gqa", ["group_l2", "mean", "sum", "max"])
def test_cache_scores_follow_the_equations(source, fast, gqa):
    """CAOTE.cache_scores on a ragged cache (every head its own tokens) against Eq. 21 / 23 on
    the literal base scores of each query head, combined over the group literally."""
    s = None
    if source in ("h2o", "h2o_shared"):
        scorer = CAOTE(H2O(), fast=fast, gqa="shared" if source == "h2o_shared" else gqa, max_groups=4)
    elif source == "tova":
        scorer = CAOTE(TOVA(), fast=fast, gqa=gqa)
    elif source == "custom":   # no per-head scores: only its own (shared) reading
        with pytest.raises(ValueError, match="per-query-head scores"):
            CAOTE(Doubled(), fast=fast, gqa=gqa)
        scorer = CAOTE(Doubled(), fast=fast, gqa="shared")
    else:
        s = SnapKV(window=3, kernel=3, pooling="avg" if source == "snapkv_block" else "max")
        scorer = CAOTE(s, fast=fast, gqa=gqa)
    for seed in range(3):
        view = random_view(seed, channels=scorer.capabilities.channels,
                           queries=5 if source == "snapkv_block" else 0, pad_queries=1)
        got = scorer.cache_scores(view)
        assert got.dtype == torch.float32 and got.shape == view.pos.shape
        for b in range(view.pos.shape[0]):
            for h in range(view.pos.shape[1]):
                m = int(view.mask[b, h].sum())
                V = view.v[b, h, :m]
                cs = [literal_caote(x, V, fast) for x in literal_view_case(source, view, b, h, s)]
                want = cs[0] if len(cs) == 1 else literal_group(cs, gqa)
                torch.testing.assert_close(got[b, h, :m].double(), want, **TOL)
                assert bool((got[b, h, m:] == 0).all())


def literal_prompt_rows(p: PromptView):
    """Per row: (idx, P [Hq, m, m] float64) the causal softmax over the row's real tokens."""
    rows = []
    G = p.groups
    for b in range(p.q.shape[0]):
        idx = torch.nonzero(p.valid[b]).flatten()
        m = len(idx)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        P = torch.stack([literal_softmax_rows(p.q[b, hq, idx], p.k[b, hq // G, idx], p.scale, causal)
                         for hq in range(p.q.shape[1])])
        rows.append((idx, P))
    return rows


def make_prompt(seed, B=2, H=2, G=2, n=12, D=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, n, D, generator=gen) * 1.5
    k = torch.randn(B, H, n, D, generator=gen)
    v = torch.randn(B, H, n, D, generator=gen)
    lens = torch.tensor([n, n - 5])[:B]
    valid = torch.arange(n) >= (n - lens)[:, None]
    pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
    return PromptView(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), pos=pos, valid=valid,
                      scale=1 / math.sqrt(D), layer_idx=0, num_layers=1, chunk=5)


@pytest.mark.parametrize("base", [H2O(), TOVA(), SnapKV(window=4, kernel=3),
                                  SnapKV(window=20, kernel=5, pooling="avg", order="pool_then_mean")],
                         ids=lambda s: repr(s).replace(" ", ""))
@pytest.mark.parametrize("fast", [False, True], ids=["CAOTE", "FastCAOTE"])
@pytest.mark.parametrize("G", [1, 3])
def test_one_shot_prompt_scores_follow_the_equations(base, fast, G):
    """One-shot prefill: the dense prompt's candidates (each row's real tokens, left-padded
    batch) scored with the same formula, from literal per-head attention."""
    scorer = CAOTE(base, fast=fast, gqa="group_l2")
    p = make_prompt(7 + G, G=G)
    scores, channels = scorer.prompt_scores(p)
    H = p.k.shape[1]
    for b, (idx, P) in enumerate(literal_prompt_rows(p)):
        m = len(idx)
        for h in range(H):
            heads = [P[h * G + g] for g in range(G)]                       # [m, m] each
            if isinstance(base, H2O):
                hs = [A.sum(dim=0) for A in heads]                          # column sums
            elif isinstance(base, TOVA):
                hs = [A[-1] for A in heads]                                 # the newest query's row
            else:
                w = min(base.window, m)
                live = outside_window(p.pos[b, idx].tolist(), base.window)
                if base.order == "pool_then_mean":
                    hs = [sum(literal_pool(row, base.kernel, base.pooling, live) for row in A[-w:]) for A in heads]
                else:
                    hs = [literal_pool(A[-w:].sum(dim=0), base.kernel, base.pooling, live) for A in heads]
            want = literal_group([literal_caote(x, p.v[b, h, idx], fast) for x in hs], "group_l2")
            torch.testing.assert_close(scores[b, h, idx].double(), want, **TOL)
            if isinstance(base, H2O):   # the base's group sum, then the per-query-head accumulators
                torch.testing.assert_close(channels[b, h, idx, 0].double(), sum(hs), **TOL)
                for g in range(G):
                    torch.testing.assert_close(channels[b, h, idx, 1 + g].double(), hs[g], **TOL)
                assert bool((channels[b, h, :, 1 + G:] == 0).all())
    if not isinstance(base, H2O):
        assert channels is None


@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
def test_h2o_query_head_accumulators_over_blocks_and_decode(storage):
    """Block-wise prefill (staggered left-padded blocks) then decode steps: CAOTE(H2O)'s
    per-query-head channels are the literal column sums of every query so far, per query
    head, and the scores are Eq. 21 on them, combined by group_l2."""
    B, H, G, D, n, steps = 2, 2, 3, 8, 13, 3
    total = n + steps
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, H * G, total, D, generator=gen) * 1.5
    k = torch.randn(B, H, total, D, generator=gen)
    v = torch.randn(B, H, total, D, generator=gen)
    pad = torch.tensor([0, 4])
    valid = torch.arange(total) >= pad[:, None]
    pos = (torch.arange(total) - pad[:, None]).masked_fill(~valid, 1)
    scale = 1 / math.sqrt(D)
    scorer = CAOTE(H2O(), max_groups=4, gqa="group_l2")
    state = LayerState(0, 1, Policy(scorer, budget=100, schedule=EveryStep(prefill_block=5)), storage)
    state.ensure_storage(q, k)
    state.advance(n)
    state.ensure_budget(valid[:, :n].sum(dim=1))
    sl = lambda x, a, z: x[:, :, a:z]
    attend_in_blocks(state, sl(q, 0, n), sl(k, 0, n), sl(v, 0, n), pos[:, :n], valid[:, :n], scale, 5)
    for t in range(n, total):
        real = valid[:, t]
        decode(state, sl(q, t, t + 1), sl(k, t, t + 1), sl(v, t, t + 1), pos[:, t:t + 1],
               None if bool(real.all()) else real, scale)
        state.finish_decode_step()
    parts = state.kv.view(None, True)
    channels = parts["channels"]
    view = CacheView(pos=parts["pos"], mask=parts["mask"], channels=channels, last_pos=state.last_pos,
                     layer_idx=0, num_layers=1, groups=G, k=parts["k"], v=parts["v"])
    scores = scorer.cache_scores(view)
    full = PromptView(q=q, k=k, v=v, pos=pos, valid=valid, scale=scale, layer_idx=0, num_layers=1)
    for b, (idx, P) in enumerate(literal_prompt_rows(full)):
        m = len(idx)
        assert bool(parts["mask"][b, :, :m].all())
        for h in range(H):
            hs = [P[h * G + g].sum(dim=0) for g in range(G)]
            torch.testing.assert_close(channels[b, h, :m, 0].double(), sum(hs), **TOL)
            for g in range(G):
                torch.testing.assert_close(channels[b, h, :m, 1 + g].double(), hs[g], **TOL)
            want = literal_group([literal_caote(x, v[b, h, idx], False) for x in hs], "group_l2")
            torch.testing.assert_close(scores[b, h, :m].double(), want, **TOL)


# --------------------------------------------------------------------------- 2. Theorem 3.2

def brute_force_errors(q, K, V, scale):
    """||X - X'_j|| for every j: X the attention output over all tokens, X'_j the output of the
    same softmax with token j removed (the rest renormalized). q [D], K, V [N, D]."""
    logits = (K @ q) * scale
    X = torch.softmax(logits, dim=0) @ V
    out = []
    for j in range(K.shape[0]):
        keep = torch.arange(K.shape[0]) != j
        Xj = torch.softmax(logits[keep], dim=0) @ V[keep]
        out.append(torch.linalg.vector_norm(X - Xj))
    return torch.stack(out)


@pytest.mark.parametrize("seed", range(4))
def test_theorem_3_2_score_is_the_attention_output_change(seed):
    gen = torch.Generator().manual_seed(seed)
    N, D = 40, 16
    q, K, V = (torch.randn(*s, generator=gen) for s in ((D,), (N, D), (N, D)))
    q = q * 2
    scale = 1 / math.sqrt(D)
    alpha = torch.softmax((K @ q) * scale, dim=0)
    want = brute_force_errors(q, K, V, scale)                     # float32, by brute force
    torch.testing.assert_close(caote_scores(alpha, V), want, rtol=0, atol=1e-5)
    # Through the scorer: TOVA's newest-query row is the attention row, so TOVA+CAOTE = CAOTE.
    view = CacheView(pos=torch.arange(N).view(1, 1, N), mask=torch.ones(1, 1, N, dtype=torch.bool),
                     channels=torch.zeros(1, 1, N, 0), last_pos=torch.tensor([N - 1]), layer_idx=0,
                     num_layers=1, groups=1, stats={"last": alpha.view(1, 1, N, 1)}, stat_queries=1,
                     v=V.view(1, 1, N, D))
    torch.testing.assert_close(CAOTE(TOVA()).cache_scores(view)[0, 0], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(caote_scores(alpha.double(), V.double()).double(),
                               brute_force_errors(q.double(), K.double(), V.double(), scale), rtol=1e-5, atol=1e-7)


def test_group_l2_is_the_norm_of_the_groups_concatenated_output_error():
    """gqa='group_l2': the KV head's score of token j is ||concat_g (X_g - X'_g,j)||, the error
    of the group's concatenated outputs when j leaves the KV head (App. B.2, case 2)."""
    gen = torch.Generator().manual_seed(5)
    G, N, D = 4, 30, 8
    Q, K, V = torch.randn(G, D, generator=gen) * 2, torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen)
    scale = 1 / math.sqrt(D)
    last = torch.stack([torch.softmax((K @ Q[g]) * scale, dim=0) for g in range(G)], dim=-1)   # [N, G]
    errors = torch.stack([brute_force_errors(Q[g], K, V, scale) for g in range(G)])             # [G, N]
    view = CacheView(pos=torch.arange(N).view(1, 1, N), mask=torch.ones(1, 1, N, dtype=torch.bool),
                     channels=torch.zeros(1, 1, N, 0), last_pos=torch.tensor([N - 1]), layer_idx=0,
                     num_layers=1, groups=G, stats={"last": last.view(1, 1, N, G)}, stat_queries=1,
                     v=V.view(1, 1, N, D))
    got = CAOTE(TOVA(), gqa="group_l2").cache_scores(view)[0, 0]
    torch.testing.assert_close(got, errors.square().sum(dim=0).sqrt(), rtol=0, atol=1e-5)
    got = CAOTE(TOVA(), gqa="max").cache_scores(view)[0, 0]
    torch.testing.assert_close(got, errors.amax(dim=0), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- 3. stability

def stable_truth(alpha, V):
    """Eq. 8 in float64 on the given (rounded) inputs, j* through Eq. 17-19 (exact arithmetic
    identity, no cancellation): the value a correct float32 computation must approach."""
    a, V = alpha.double(), V.double()
    top = int(a.argmax())
    X = a @ V
    c = a / (1 - a) * torch.linalg.vector_norm(X - V, dim=-1)
    others = torch.arange(len(a)) != top
    Xp = (a[others] @ V[others]) / a[others].sum()
    c[top] = a[top] * torch.linalg.vector_norm(Xp - V[top])
    return c


@pytest.mark.parametrize("gap", [10.0, 17.0 + math.log(33), 40.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dominant_sink_gives_finite_non_zero_scores(gap, dtype):
    """One logit `gap` above the rest: alpha_0 = 1 - ~1e-4, 1 - 1e-7 (alpha rounds to 1 in
    bf16/fp16) or 1 - 1e-16 (rounds to 1 in float32). Values (and alpha) in `dtype`."""
    gen = torch.Generator().manual_seed(3)
    N, D = 33, 16
    logits = torch.randn(N, generator=gen)
    logits[0] += gap
    alpha = torch.softmax(logits, dim=0)          # float32 (the kernel's statistics are float32)
    V = torch.randn(N, D, generator=gen).to(dtype)
    # alpha itself in half precision too: bf16 keeps float32's range; in fp16 the others
    # underflow to 0 beyond a gap of ~10 (then no weighted mean is left to compare with).
    half = dtype == torch.bfloat16 or (dtype == torch.float16 and gap == 10.0)
    for a in (alpha, alpha.to(dtype)) if half else (alpha,):
        c = caote_scores(a, V)
        assert bool(torch.isfinite(c).all()) and c.dtype == torch.float32
        assert float(c[0]) > 0 and int(c.argmin()) != 0
        torch.testing.assert_close(c.double(), stable_truth(a.float(), V.float()), rtol=1e-4, atol=1e-30)
        f = caote_scores(a, V, fast=True)
        assert bool(torch.isfinite(f).all()) and int(f.argmax()) == 0 and float(f.min()) >= 0
    if gap == 40.0:   # the paper's formula, naively, in float32: NaN or a spurious 0 for the sink
        naive = alpha / (1 - alpha) * torch.linalg.vector_norm(alpha @ V.float() - V.float(), dim=-1)
        assert not (math.isfinite(float(naive[0])) and float(naive[0]) > 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("base", [H2O(), TOVA(), SnapKV(window=4, kernel=3)], ids=lambda s: type(s).__name__)
def test_sink_in_half_precision_prompts_and_caches(dtype, base):
    """A key every query attends to almost only (a sink) in a half-precision prompt and cache:
    scores are computed in float32, finite, the sink is not the first evicted; no NaN."""
    p = make_prompt(2, G=2, n=16, dtype=dtype)
    first = p.valid.float().argmax(dim=1)         # each row's first real token: the sink
    k, q = p.k.clone(), p.q.clone()
    for b in range(2):
        k[b, :, first[b]] = 0
        k[b, :, first[b], 0] = 30.0
    q[..., 0] = 8.0                               # the sink's logit ~ 8 * 30 / sqrt(8) = 85
    p = PromptView(q=q, k=k, v=p.v, pos=p.pos, valid=p.valid, scale=p.scale, layer_idx=0, num_layers=1)
    for fast in (False, True):
        scores, _ = CAOTE(base, fast=fast).prompt_scores(p)
        assert scores.dtype == torch.float32 and bool(torch.isfinite(scores).all())
        for b in range(2):
            real = scores[b][:, p.valid[b]]                              # [H, m], the sink first
            assert bool((real[:, 0] > 0).all()) and bool((real[:, 0] > real[:, 1:].min(dim=-1).values).all())


# --------------------------------------------------------------------------- 4. model level

def model_cases():
    for base in (H2O(), TOVA(), SnapKV(window=4, kernel=3)):
        for fast in (False, True):
            for schedule in (EveryStep(prefill_block=16), OneShot(), BlockwisePrefill(16)):
                for allocation in (Uniform(), AdaKV()):
                    yield CAOTE(base, fast=fast), allocation, schedule
    yield CAOTE(TOVA(), gqa="shared"), Pyramid(beta=4), EveryStep(prefill_block=8)
    yield CAOTE(H2O(recent=2), gqa="max", output_after_eviction=False), AdaKV(layers=Pyramid(beta=4)), EveryStep()
    yield FastCAOTE(Random(seed=1)), Uniform(), EveryStep(prefill_block=16)


@pytest.mark.parametrize("scorer,allocation,schedule", list(model_cases()),
                         ids=lambda x: repr(x).replace(" ", ""))
def test_ragged_path_equals_reference_path(scorer, allocation, schedule):
    _, got = assert_paths_agree(Policy(scorer, budget=20, allocation=allocation, schedule=schedule))
    assert bool(torch.isfinite(got).all())


def test_caote_evicts_other_tokens_than_its_base():
    """Values matter: on the same model and prompt, H2O+CAOTE keeps other tokens than H2O."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    kept = []
    for scorer in (H2O(), CAOTE(H2O()), CAOTE(H2O(), fast=True)):
        with kvcache_ext.patch(model, Policy(scorer, budget=20, schedule=EveryStep(prefill_block=16))) as handle:
            cache = handle.new_cache()
            teacher_forced(model, cache, ids, mask, steps=4)
        kept.append(cache.layer_kv(1).view(None, False)["pos"])
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], kept[2])


def test_output_after_eviction_changes_block_outputs():
    """Eq. 7 read literally: after a block's eviction its output is recomputed over the kept
    tokens, so the logits differ from computing the block's output before eviction."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    out = []
    for after in (True, False):
        policy = Policy(CAOTE(TOVA(), output_after_eviction=after), budget=20, schedule=BlockwisePrefill(16))
        with kvcache_ext.patch(model, policy) as handle:
            with torch.no_grad():
                out.append(model(ids, attention_mask=mask, **with_cache(model, handle.new_cache())).logits)
    real = mask.bool()
    first_block = real.cumsum(dim=1) <= 16               # no eviction yet: identical
    torch.testing.assert_close(out[0][first_block & real], out[1][first_block & real])
    assert float((out[0] - out[1])[~first_block & real].abs().max()) > 1e-3


# --------------------------------------------------------------------------- interface

def test_composition_delegates_to_the_base_and_validates():
    with pytest.raises(ValueError, match="score-based"):
        CAOTE(StreamingLLM())
    with pytest.raises(ValueError, match="once"):
        CAOTE(CAOTE())
    with pytest.raises(ValueError, match="gqa"):
        CAOTE(TOVA(), gqa="l1")
    with pytest.raises(ValueError, match="max_groups"):
        CAOTE(H2O(), max_groups=0)
    with pytest.raises(TypeError):
        CAOTE(base="h2o")
    with pytest.raises(ValueError, match="pool_then_mean"):    # the base's own schedule check
        Policy(CAOTE(SnapKV(order="pool_then_mean")), budget=64, schedule=EveryStep())
    s = CAOTE(H2O(recent=3), gqa="group_l2")   # per-head: H2O keeps per-query-head accumulators
    caps = s.capabilities
    assert s.default_protection() == Protection(recent=3) and caps.output_after_eviction
    assert caps.channels == 1 + 8 and caps.accumulates == ("mass",) and caps.update_stats == ("last",)
    assert caps.updates_from_view and caps.slot_rule is None   # its scores are CAOTE's, not the rule's
    assert caps.needs_kv and caps.needs_queries and s.base == H2O(recent=3)
    s = CAOTE(SnapKV(window=5), gqa="group_l2")
    caps = s.capabilities
    assert s.default_protection() == Protection(recent=5) and caps.stats_window == 5
    assert caps.channels == 0 and caps.evict_stats == ("mass", "last") and not caps.updates_from_view
    caps = CAOTE(H2O(), gqa="shared").capabilities
    assert caps.channels == 1 and caps.accumulates == ("mass",) and not caps.updates_from_view
    assert CAOTE().gqa == "shared" and CAOTE(Random()).capabilities.channels == Random().capabilities.channels
    assert CAOTE(TOVA()).capabilities.evict_stats == ("last",) and not CAOTE(TOVA()).capabilities.needs_queries
    f = FastCAOTE(TOVA())
    assert f.fast and isinstance(f.base, TOVA) and isinstance(FastCAOTE().base, H2O)
    p = caote_policy(SnapKV(), budget=2048, fast=True, allocation=AdaKV())
    assert p.schedule == EveryStep(prefill_block=128) and p.scorer.fast and isinstance(p.allocation, AdaKV)
    assert p.budget == 2048 and p.protection == Protection(recent=32)


def test_runtime_errors_name_the_fix():
    model = tiny_model("llama", heads=6, kv_heads=2)           # G = 3
    ids, mask = inputs(batch=1, length=20)
    # Refused when the model is patched (it knows G), not when it runs.
    with pytest.raises(ValueError, match="max_groups=3"):
        kvcache_ext.patch(model, Policy(CAOTE(H2O(), max_groups=2, gqa="group_l2"), budget=8))
    assert not kvcache_ext.is_patched(model)

    @dataclass
    class Signed(Scorer):
        def prompt_scores(self, p):
            return p.pos.float()[:, None].expand(-1, p.k.shape[1], -1) - 3.0, None

    with kvcache_ext.patch(model, Policy(CAOTE(Signed()), budget=8)) as handle:
        with pytest.raises(ValueError, match="non-negative"):
            teacher_forced(model, handle.new_cache(), ids, mask, steps=1)
