"""The policy math against literal implementations of the papers' formulas.

Every expected value here is computed from the formulas of research/seed-000-caote.md §2, §4.1-4.4
and research/seed-001-adakv.md (Alg. 1-3, §7, §9, §10), written out with explicit softmax, loops
and exact fractions, never through the library's scorer or allocation code. Inputs are random:
batch > 1, MHA / GQA / MQA, left padding (HF's convention: padding first, its position_ids 1),
prompts of one token and prompts shorter than the SnapKV window.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcache_ext.engine.prompt import compress_prompt
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, CacheView, EveryNSteps, EveryStep,
                                  OneShot, Policy, PromptView, Protection, Pyramid, Random, Schedule,
                                  SnapKV, StreamingLLM, Uniform)
from kvcache_ext.policies.adakv import largest_remainder
from kvcache_ext.policies.random_eviction import position_hash
from kvcache_ext.reference.masked_cache import MaskedLayerKV
from literal import held_layout, literal_pool, outside_window

EXAMPLES = settings.default.max_examples        # the profile's (conftest.py): 200 on CI
heavy = settings(max_examples=max(EXAMPLES // 5, 10))   # the tests with Python loops per token
TOL = dict(rtol=1e-5, atol=1e-6)                # library float32 against literal float64

seeds = st.integers(0, 2**31 - 1)
# KV heads and query heads per KV head: MHA (G = 1), GQA (G = 2, 4), MQA (H = 1).
head_layouts = st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 4]))
prompt_lens = st.one_of(st.just(1), st.integers(1, 6), st.integers(7, 40))


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- literal helpers

def make_prompt(seed: int, batch: int, heads: int, groups: int, n: int, pad: bool = True,
                layer_idx: int = 0, num_layers: int = 4, head_dim: int = 8) -> PromptView:
    """A random float32 prompt; with ``pad``, each row has its own length, left-padded."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads * groups, n, head_dim, generator=gen) * 1.5
    k = torch.randn(batch, heads, n, head_dim, generator=gen)
    v = torch.randn(batch, heads, n, head_dim, generator=gen)
    lens = torch.randint(1, n + 1, (batch,), generator=gen) if pad else torch.full((batch,), n)
    valid = torch.arange(n) >= (n - lens)[:, None]
    pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
    # Small probability blocks, so that the scorers' sums run over several of them.
    return PromptView(q=q, k=k, v=v, pos=pos, valid=valid, scale=1 / math.sqrt(head_dim),
                      layer_idx=layer_idx, num_layers=num_layers, chunk=1 + seed % 8)


def literal_attention(p: PromptView):
    """Per batch row: (idx, P) with idx the row's real tokens (in order) and P [Hq, m, m] float64
    the softmax of query i over keys j <= i of the row's real tokens; query head h*G + g reads
    KV head h (HF's repeat_kv)."""
    Hq, H = p.q.shape[1], p.k.shape[1]
    G = Hq // H
    rows = []
    for b in range(p.q.shape[0]):
        idx = torch.nonzero(p.valid[b]).flatten()
        m = len(idx)
        q = p.q[b][:, idx].double()
        k = torch.stack([p.k[b, hq // G][idx].double() for hq in range(Hq)])
        logits = torch.einsum("hid,hjd->hij", q, k) * p.scale
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        rows.append((idx, e / e.sum(dim=-1, keepdim=True)))
    return rows


def per_kv_head(x: torch.Tensor, groups: int, how: str) -> torch.Tensor:
    """[Hq, ...] -> [H, ...]: the G query heads h*G .. h*G+G-1 of KV head h, summed / averaged / maxed."""
    parts = [x[h * groups:(h + 1) * groups] for h in range(x.shape[0] // groups)]
    reduce = {"sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0)}[how]
    return torch.stack([reduce(t) for t in parts])


def literal_h2o(P, groups):
    """Accumulated attention: column sums over every (causal) query and the group's G heads."""
    return per_kv_head(P.sum(dim=1), groups, "sum")


def literal_tova(P, groups, per_head):
    last = P[:, -1, :]                                    # the newest query's row, [Hq, m]
    if per_head:
        return per_kv_head(last, groups, "mean")
    return last.mean(dim=0).expand(last.shape[0] // groups, -1)


def literal_snapkv(P, groups, s: SnapKV, positions):
    """Pooled over the tokens outside the window (SnapKV's code cuts the window off first)."""
    m = P.shape[-1]
    window = P[:, m - min(s.window, m):, :]               # the last `window` real queries
    live = outside_window(positions, s.window)
    if s.order == "mean_then_pool":
        return literal_pool(per_kv_head(window.mean(dim=1), groups, s.gqa), s.kernel, s.pooling, live)
    return per_kv_head(literal_pool(window, s.kernel, s.pooling, live).mean(dim=1), groups, s.gqa)


def literal_scores(scorer, p: PromptView):
    """[(idx, scores [H, m] float64)] per row, from the papers' formulas."""
    H = p.k.shape[1]
    G = p.q.shape[1] // H
    out = []
    for b, (idx, P) in enumerate(literal_attention(p)):
        if isinstance(scorer, H2O):
            s = literal_h2o(P, G)
        elif isinstance(scorer, TOVA):
            s = literal_tova(P, G, scorer.per_head)
        elif isinstance(scorer, SnapKV):
            s = literal_snapkv(P, G, scorer, p.pos[b, idx].tolist())
        elif isinstance(scorer, StreamingLLM):            # newest first: the score is the position
            s = p.pos[b, idx].double().expand(H, -1)
        else:
            raise AssertionError(scorer)
        out.append((idx, s))
    return out


def best_first(cands):
    """Candidates (score, pos, head, index) sorted best first: higher score, then lower
    position, then lower head."""
    return sorted(cands, key=lambda c: (-c[0], c[1], c[2]))


def literal_topk_keep(scores, pos, valid, k):
    """Alg. 1 per (row, head): the k best real tokens (ties to the lower position) -> keep [B, H, n]."""
    B, H, n = scores.shape
    keep = torch.zeros(B, H, n, dtype=torch.bool)
    scores, pos, valid, k = scores.tolist(), pos.tolist(), valid.tolist(), k.tolist()
    for b in range(B):
        for h in range(H):
            cands = [(scores[b][h][j], pos[b][j], h, j) for j in range(n) if valid[b][j]]
            for c in best_first(cands)[:k[b][h]]:
                keep[b, h, c[3]] = True
    return keep


def literal_grouped_counts(pos):
    """A ``grouped_counts`` callback: of the k[b] best tokens of row b over all its heads
    (Alg. 2 lines 1-5), how many each head holds. pos [B, H, L] are the tokens' positions."""
    def counts(scores, mask, k):
        B, H, L = scores.shape
        out = [[0] * H for _ in range(B)]
        s, p, m = scores.tolist(), pos.tolist(), mask.tolist()
        for b in range(B):
            cands = [(s[b][h][l], p[b][h][l], h, l) for h in range(H) for l in range(L) if m[b][h][l]]
            for c in best_first(cands)[:int(k[b])]:
                out[b][c[2]] += 1
        return torch.tensor(out, dtype=torch.long)
    return counts


def literal_adakv_row(budget, scores, mask, protected, pos, alpha):
    """Ada-KV for one row (research/seed-001-adakv.md Alg. 2, Alg. 3 line 7) in exact fractions.

    Protected tokens stay out of the ranking and are added to their head; the selectable
    budget S = H * budget - protected is split by the Alg. 2 counts over the unprotected
    tokens, blended with the uniform share S / H, floored, and the missing tokens go to the
    largest remainders (ties to the lower head); no head gets more than it holds.
    Returns (per-head budgets, Alg. 2 counts, blended shares, whether the blend sums to S).
    """
    H, L = scores.shape
    held = [int(mask[h].sum()) for h in range(H)]
    prot = [int((mask[h] & protected[h]).sum()) for h in range(H)]
    S = max(H * budget - sum(prot), 0)
    s, p, m, pr = scores.tolist(), pos.tolist(), mask.tolist(), protected.tolist()
    cands = [(s[h][l], p[h][l], h, l) for h in range(H) for l in range(L) if m[h][l] and not pr[h][l]]
    star = [0] * H
    for c in best_first(cands)[:S]:
        star[c[2]] += 1
    a = Fraction(alpha)
    x = [a * star[h] + (1 - a) * Fraction(S, H) for h in range(H)]
    base = [math.floor(v) for v in x]
    missing = S - sum(base)
    by_remainder = sorted(range(H), key=lambda h: (-(x[h] - base[h]), h))
    extra = [1 if by_remainder.index(h) < missing else 0 for h in range(H)]
    budgets = [min(prot[h] + base[h] + extra[h], held[h]) for h in range(H)]
    return budgets, star, x, sum(x) == S


def literal_pyramid(budget, layer, layers, prompt_len, reserved, beta):
    """research/seed-001-adakv.md §10 on the budget left after the protected tokens."""
    if layers == 1:
        return budget                  # one layer: the pyramid's average is the budget itself
    b, n = max(budget - reserved, 0), max(prompt_len - reserved, 0)
    lo = b // beta
    hi = 2 * b - lo
    if hi >= n:
        hi = n
        lo = 2 * b - hi
    step = (hi - lo) // (layers - 1)
    return hi - layer * step + reserved


def random_cache(gen, batch, heads, span, fill=0.6):
    """A CacheView layout where every head holds its own random subset of positions 0..span-1
    (in order, padded at the end): pos [B, H, L], mask [B, H, L]."""
    hold = torch.rand(batch, heads, span, generator=gen) < fill
    hold[..., -1] = True                                    # the newest token is everywhere
    return held_layout(hold)


def cache_view(pos, mask, groups, stats=None, stat_queries=1, channels=None, layer_idx=0):
    B, H, L = pos.shape
    if channels is None:
        channels = torch.zeros(B, H, L, 0)
    last_pos = pos.masked_fill(~mask, -1).amax(dim=(1, 2))
    return CacheView(pos=pos, mask=mask, channels=channels, last_pos=last_pos, layer_idx=layer_idx,
                     num_layers=4, groups=groups, stats=stats or {}, stat_queries=stat_queries)


def assert_on_real_tokens(got, rows):
    """got [B, H, n] (library) against the literal [(idx, [H, m])] per row, on real tokens only."""
    for b, (idx, want) in enumerate(rows):
        torch.testing.assert_close(got[b][:, idx].double(), want, **TOL)


# --------------------------------------------------------------------------- scorers on prompts

@given(shape=st.tuples(st.integers(1, 3), head_layouts, prompt_lens), pad=st.booleans(), seed=seeds,
       shuffle=st.booleans(), chunk=st.integers(1, 9), first=st.integers(0, 40))
def test_prompt_probs_are_the_causal_softmax_by_position(shape, pad, seed, shuffle, chunk, first):
    """PromptView.probs against a float64 softmax written from positions, not token order: query
    i sees the real keys j with pos[j] <= pos[i]. Shuffled tokens (positions out of order) take
    the full-width path; ordered ones may leave out the keys after the chunk, which must be
    invisible."""
    B, (H, G), n = shape
    p = make_prompt(seed, B, H, G, n, pad)
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        p = PromptView(q=p.q[:, :, order], k=p.k[:, :, order], v=p.v[:, :, order], pos=p.pos[:, order],
                       valid=p.valid[:, order], scale=p.scale, layer_idx=0, num_layers=1)
    lo = min(first, n - 1)
    blocks = list(p.probs(slice(lo, n), chunk=chunk))
    assert [i0 for i0, _ in blocks] == list(range(lo, n, chunk))
    q, k = p.q.double(), p.k.double().repeat_interleave(G, dim=1)
    for i0, got in blocks:
        c, m = got.shape[2:]
        assert got.shape[:2] == (B, H * G) and got.dtype == torch.float32
        assert c == min(chunk, n - i0) and m in (i0 + c, n)
        for b in range(B):
            for i in range(i0, i0 + c):
                seen = p.valid[b] & (p.pos[b] <= p.pos[b, i]) & p.valid[b, i]
                want = torch.zeros(H * G, n, dtype=torch.float64)
                if seen.any():
                    logits = torch.einsum("hd,hjd->hj", q[b, :, i], k[b]) * p.scale
                    want = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
                torch.testing.assert_close(got[b, :, i - i0].double(), want[:, :m], **TOL)
                assert torch.all(want[:, m:] == 0)             # what was left out is invisible



@given(shape=st.tuples(st.integers(1, 3), head_layouts, prompt_lens), pad=st.booleans(), seed=seeds)
def test_h2o_prompt_scores_are_accumulated_column_sums(shape, pad, seed):
    B, (H, G), n = shape
    p = make_prompt(seed, B, H, G, n, pad)
    scores, channels = H2O().prompt_scores(p)
    assert scores.shape == (B, H, n) and scores.dtype == torch.float32
    assert_on_real_tokens(scores, literal_scores(H2O(), p))
    assert channels.shape == (B, H, n, 1)
    assert torch.equal(channels[..., 0], scores)           # the accumulator starts at the prompt's sums


@given(shape=st.tuples(st.integers(1, 3), head_layouts, prompt_lens), pad=st.booleans(), seed=seeds,
       per_head=st.booleans())
def test_tova_prompt_scores_are_the_last_querys_attention(shape, pad, seed, per_head):
    B, (H, G), n = shape
    p = make_prompt(seed, B, H, G, n, pad)
    scorer = TOVA(per_head=per_head)
    scores, channels = scorer.prompt_scores(p)
    assert channels is None and scores.shape == (B, H, n)
    rows = literal_scores(scorer, p)
    assert_on_real_tokens(scores, rows)
    for idx, s in rows:                                    # a distribution per head (or for the layer)
        torch.testing.assert_close(s.sum(dim=-1), torch.ones(H, dtype=torch.float64))


@heavy
@given(shape=st.tuples(st.integers(1, 3), head_layouts, prompt_lens), pad=st.booleans(), seed=seeds,
       window=st.sampled_from([1, 3, 8, 32]), kernel=st.sampled_from([1, 3, 5, 7]),
       pooling=st.sampled_from(["max", "avg"]), gqa=st.sampled_from(["mean", "max"]),
       order=st.sampled_from(["mean_then_pool", "pool_then_mean"]))
def test_snapkv_prompt_scores(shape, pad, seed, window, kernel, pooling, gqa, order):
    B, (H, G), n = shape
    p = make_prompt(seed, B, H, G, n, pad)
    scorer = SnapKV(window=window, kernel=kernel, pooling=pooling, gqa=gqa, order=order)
    scores, channels = scorer.prompt_scores(p)
    assert channels is None and scores.shape == (B, H, n)
    assert_on_real_tokens(scores, literal_scores(scorer, p))


def test_snapkv_orders_differ_for_max_pooling():
    """Alg. 3 line 4 (pool, then mean) >= SnapKV's order (mean, then pool), strictly somewhere."""
    p = make_prompt(3, 2, 2, 2, 30, pad=False)
    a, _ = SnapKV(window=8, order="pool_then_mean").prompt_scores(p)
    b, _ = SnapKV(window=8, order="mean_then_pool").prompt_scores(p)
    assert bool((a >= b - 1e-6).all()) and bool((a > b + 1e-4).any())


@given(shape=st.tuples(st.integers(1, 3), head_layouts, prompt_lens), pad=st.booleans(), seed=seeds)
def test_streaming_llm_scores_are_positions(shape, pad, seed):
    B, (H, G), n = shape
    p = make_prompt(seed, B, H, G, n, pad)
    scores, channels = StreamingLLM().prompt_scores(p)
    assert channels is None
    assert_on_real_tokens(scores, literal_scores(StreamingLLM(), p))
    gen = torch.Generator().manual_seed(seed)
    pos, mask = random_cache(gen, B, H, 20)
    assert torch.equal(StreamingLLM().cache_scores(cache_view(pos, mask, G))[mask], pos[mask].float())
    assert StreamingLLM(sinks=3).default_protection() == Protection(sinks=3)


# --------------------------------------------------------------------------- scorers over the cache

@given(B=st.integers(1, 3), layout=head_layouts, span=st.integers(1, 30), seed=seeds)
def test_tova_cache_scores_average_by_position(B, layout, span, seed):
    """Layer-averaged TOVA over heads that hold different tokens: a token's score is the last
    query's attention to it summed over every (KV head, query head) that holds it, over H * G
    (a head that evicted it gives it nothing); per_head: the mean over the G heads."""
    H, G = layout
    gen = torch.Generator().manual_seed(seed)
    pos, mask = random_cache(gen, B, H, span)
    last = torch.rand(*pos.shape, G, generator=gen) * mask[..., None]
    view = cache_view(pos, mask, G, stats={"last": last})
    got = TOVA().cache_scores(view)
    got_head = TOVA(per_head=True).cache_scores(view)
    for b in range(B):
        for h in range(H):
            for l in range(int(mask[b, h].sum())):
                holders = (pos[b] == pos[b, h, l]) & mask[b]            # [H, L]
                want = float((last[b].double().sum(dim=-1) * holders).sum()) / (H * G)
                assert math.isclose(float(got[b, h, l]), want, rel_tol=1e-5, abs_tol=1e-6)
                want_head = float(last[b, h, l].double().mean())
                assert math.isclose(float(got_head[b, h, l]), want_head, rel_tol=1e-5, abs_tol=1e-6)
    assert TOVA().capabilities.evict_stats == ("last",)


@heavy
@given(B=st.integers(1, 3), layout=head_layouts, span=st.integers(1, 30), seed=seeds,
       kernel=st.sampled_from([1, 3, 7]), pooling=st.sampled_from(["max", "avg"]),
       gqa=st.sampled_from(["mean", "max"]), queries=st.sampled_from([1, 1, 4, 32]))
def test_snapkv_cache_scores_from_window_stats(B, layout, span, seed, kernel, pooling, gqa, queries):
    """Over the cache the window is the last queries of the call: mass = their attention summed
    over the queries and the G heads, so gqa='mean' is mass / (queries * G); gqa='max' needs
    one query (the per-head row `last`). Pooled along each head's own tokens in position order."""
    H, G = layout
    gen = torch.Generator().manual_seed(seed)
    pos, mask = random_cache(gen, B, H, span)
    last = torch.rand(*pos.shape, G, generator=gen) * mask[..., None]
    mass = torch.rand(*pos.shape, generator=gen) * queries * G * mask
    view = cache_view(pos, mask, G, stats={"mass": mass, "last": last}, stat_queries=queries)
    scorer = SnapKV(window=queries, kernel=kernel, pooling=pooling, gqa=gqa)
    if gqa == "max" and queries > 1:
        with pytest.raises(ValueError, match="gqa='max'"):
            scorer.cache_scores(view)
        return
    got = scorer.cache_scores(view)
    for b in range(B):
        for h in range(H):
            m = int(mask[b, h].sum())
            if gqa == "mean":
                raw = mass[b, h, :m].double() / (queries * G)
            else:
                raw = last[b, h, :m].double().amax(dim=-1)
            live = outside_window(pos[b, h, :m].tolist() + [int(view.last_pos[b])], queries)[:m]
            torch.testing.assert_close(got[b, h, :m].double(), literal_pool(raw, kernel, pooling, live), **TOL)


@given(B=st.integers(1, 3), layout=head_layouts, n=prompt_lens, steps=st.integers(1, 4), seed=seeds)
def test_h2o_accumulates_over_prompt_and_decode(B, layout, n, steps, seed):
    """Prompt scores + update() with each later call's mass = column sums over every query so far."""
    H, G = layout
    full = make_prompt(seed, B, H, G, n + steps, pad=False)
    crop = lambda t, m: t[:, :, :m] if t.dim() == 4 else t[:, :m]
    prompt = PromptView(q=crop(full.q, n), k=crop(full.k, n), v=crop(full.v, n), pos=crop(full.pos, n),
                        valid=crop(full.valid, n), scale=full.scale, layer_idx=0, num_layers=1)
    _, channels = H2O().prompt_scores(prompt)
    rows = literal_attention(full)
    channels = torch.cat([channels, channels.new_zeros(B, H, steps, 1)], dim=2)
    for t in range(n, n + steps):                          # decode query t over the whole cache
        mass = torch.stack([per_kv_head(P[:, t, :], G, "sum") for _, P in rows]).float()
        for c, name in enumerate(H2O().capabilities.accumulates):   # what the storage adds in place
            channels[..., c] += {"mass": mass}[name]
    want = torch.stack([literal_h2o(P, G) for _, P in rows])
    view = cache_view(full.pos[:, None].expand(B, H, -1), torch.ones(B, H, n + steps, dtype=torch.bool),
                      G, channels=channels)
    torch.testing.assert_close(H2O().cache_scores(view).double(), want, **TOL)
    assert H2O().capabilities.accumulates == ("mass",) and H2O(recent=5).default_protection() == Protection(recent=5)


# --------------------------------------------------------------------------- Random

@given(B=st.integers(1, 3), layout=head_layouts, n=prompt_lens, pad=st.booleans(), seed=seeds,
       rseed=st.integers(0, 2**40), layer=st.integers(0, 40))
def test_random_scores_are_a_function_of_seed_layer_head_position(B, layout, n, pad, seed, rseed, layer):
    H, G = layout
    p = make_prompt(seed, B, H, G, n, pad, layer_idx=layer, num_layers=48)
    scorer = Random(seed=rseed)
    scores, channels = scorer.prompt_scores(p)
    assert channels is None and scores.shape == (B, H, n) and scores.dtype == torch.float32
    assert bool(((scores >= 0) & (scores < 1)).all())
    assert torch.equal(scores, scorer.prompt_scores(p)[0])             # deterministic
    # Any layout: the same (seed, layer, head, position) gets the same score.
    gen = torch.Generator().manual_seed(seed)
    pos, mask = random_cache(gen, B, H, n)
    cached = scorer.cache_scores(cache_view(pos, mask, G, layer_idx=layer))
    by_pos = [{int(p.pos[b, j]): scores[b, :, j] for j in range(n) if p.valid[b, j]} for b in range(B)]
    for b in range(B):
        for h in range(H):
            for l in range(int(mask[b, h].sum())):
                q = int(pos[b, h, l])
                if q in by_pos[b]:
                    assert float(cached[b, h, l]) == float(by_pos[b][q][h])
        for q, row in by_pos[b].items():                   # rows do not matter, only positions
            assert all(torch.equal(row, other[q]) for other in by_pos if q in other)


def test_random_scores_are_roughly_uniform_and_independent():
    pos = torch.arange(1 << 16).view(1, 1, -1)
    zero = torch.zeros_like(pos)
    x = position_hash(pos, zero, 0, 0).flatten().double()
    assert bool(((x >= 0) & (x < 1)).all())
    counts = torch.histc(x, bins=16, min=0, max=1)
    expected = x.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50                                       # df = 15; p < 1e-5 beyond 50
    assert abs(float(x.mean()) - 0.5) < 0.01
    others = [position_hash(pos, zero, 1, 0), position_hash(pos, zero + 1, 0, 0),
              position_hash(pos, zero, 0, 1), position_hash(pos + 1, zero, 0, 0)]
    for y in others:                                       # another layer, head, seed or position
        y = y.flatten().double()
        assert float((x == y).double().mean()) < 1e-3
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 0.02


def test_random_scores_stay_below_one():
    """Hashes within 2^-25 of 2^32 must not round up to 1.0 in float32."""
    pos = torch.tensor([75671405, 107661283, 166232423, 205256144, 212730670])
    x = position_hash(pos, torch.zeros_like(pos), 0, 0)
    assert bool((x < 1).all()) and bool((x > 0.9999).all())


# --------------------------------------------------------------------------- protection

@given(B=st.integers(1, 3), H=st.integers(1, 4), span=st.integers(1, 40), sinks=st.integers(0, 6),
       recent=st.integers(0, 12), seed=seeds)
def test_protection_masks(B, H, span, sinks, recent, seed):
    gen = torch.Generator().manual_seed(seed)
    pos, mask = random_cache(gen, B, H, span)
    # the newest position of a row is at least every cached one
    last_pos = pos.masked_fill(~mask, 0).amax(dim=(1, 2)) + torch.randint(0, 3, (B,), generator=gen)
    prot = Protection(sinks=sinks, recent=recent)
    got = prot.mask(pos, last_pos)
    for b in range(B):
        newest = set(range(int(last_pos[b]) - recent + 1, int(last_pos[b]) + 1))
        for h in range(H):
            want = [q < sinks or q in newest for q in pos[b, h].tolist()]
            assert got[b, h].tolist() == want
    scores = torch.rand(pos.shape, generator=gen)
    applied, protected = prot.apply(scores.half(), pos, last_pos, mask)
    assert torch.equal(protected, got & mask)
    assert applied.dtype == torch.float32
    assert torch.equal(applied, torch.where(got & mask, torch.full_like(scores, float("inf")),
                                            scores.half().float()))
    assert prot.size == sinks + recent


# --------------------------------------------------------------------------- policy validation

def test_policy_validation_errors():
    with pytest.raises(ValueError, match="exactly one"):
        Policy(H2O())
    with pytest.raises(ValueError, match="exactly one"):
        Policy(H2O(), budget=8, ratio=0.5)
    for bad in [0, -3, 2.5, float("nan")]:
        with pytest.raises(ValueError, match="budget must be None or a positive integer"):
            Policy(H2O(), budget=bad)
    for bad in [True, False, "8"]:     # the wrong type
        with pytest.raises(TypeError, match="budget must be None or a positive integer"):
            Policy(H2O(), budget=bad)
    for bad in [0.0, -0.1, 1.5]:
        with pytest.raises(ValueError, match="ratio"):
            Policy(H2O(), ratio=bad)
    with pytest.raises(ValueError, match="protected"):
        Policy(SnapKV(window=32), budget=32)               # only the window would fit
    with pytest.raises(ValueError, match="protected"):
        Policy(StreamingLLM(sinks=4), budget=4)
    with pytest.raises(ValueError, match="protected"):
        Policy(H2O(), budget=6, protection=Protection(sinks=2, recent=4))
    with pytest.raises(ValueError, match="decode_target"):
        Policy(StreamingLLM(sinks=4), budget=16, schedule=EveryNSteps(2, target=4))
    with pytest.raises(TypeError, match="scorer"):
        Policy("snapkv", budget=8)
    with pytest.raises(TypeError, match="allocation"):
        Policy(H2O(), budget=8, allocation="adakv")
    with pytest.raises(TypeError, match="schedule"):
        Policy(H2O(), budget=8, schedule=None)
    for schedule in [EveryStep(), BlockwisePrefill(16), EveryNSteps(3)]:
        with pytest.raises(ValueError, match="pool_then_mean"):
            Policy(SnapKV(order="pool_then_mean"), budget=64, schedule=schedule)
    Policy(SnapKV(order="pool_then_mean"), budget=64, schedule=OneShot())   # one-shot is fine
    Policy(SnapKV(window=32), budget=33)
    assert Policy(H2O(), budget=8.0).budget == 8 and type(Policy(H2O(), budget=8.0).budget) is int


def test_scorer_allocation_and_schedule_validation():
    for kwargs in [dict(window=0), dict(kernel=4), dict(kernel=0), dict(pooling="min"),
                   dict(gqa="sum"), dict(order="mean")]:
        with pytest.raises(ValueError):
            SnapKV(**kwargs)
    with pytest.raises(ValueError):
        Pyramid(beta=0)
    for alpha in [-0.1, 1.1]:
        with pytest.raises(ValueError, match="alpha"):
            AdaKV(alpha=alpha)
    with pytest.raises(ValueError, match="layer schedule"):
        AdaKV(layers=AdaKV())
    with pytest.raises(ValueError):
        Protection(sinks=-1)
    with pytest.raises(ValueError):
        Protection(recent=-1)
    for kwargs in [dict(prefill_block=0), dict(prefill_block=257), dict(decode_every=0),
                   dict(decode_target=8), dict(decode_every=2, decode_target=0)]:
        with pytest.raises(ValueError):
            Schedule(**kwargs)
    assert not OneShot().evicts_over_cache
    assert BlockwisePrefill(8).evicts_over_cache and EveryStep().evicts_over_cache
    assert EveryNSteps(4, target=10) == Schedule(decode_every=4, decode_target=10)
    assert Schedule(prefill_block=256, decode_every=1, decode_target=1).prefill_block == 256


def test_policy_defaults_and_budget_for():
    assert Policy(SnapKV(window=4), budget=8).protection == Protection(recent=4)
    assert Policy(StreamingLLM(), budget=8).protection == Protection(sinks=4)
    assert Policy(TOVA(), budget=8).protection == Protection()
    lens = torch.tensor([1, 10, 33, 1000])
    assert Policy(H2O(), budget=7).budget_for(lens).tolist() == [7] * 4
    # ratio: ceil(len * ratio), at least one token beyond the protected ones
    assert Policy(SnapKV(window=4), ratio=0.25).budget_for(lens).tolist() == [5, 5, 9, 250]
    assert Policy(H2O(), ratio=1.0).budget_for(lens).tolist() == [1, 10, 33, 1000]


# --------------------------------------------------------------------------- Pyramid

@given(budget=st.integers(1, 300), reserved=st.integers(0, 40), prompt=st.integers(1, 2000),
       layers=st.integers(1, 40), beta=st.sampled_from([1, 2, 3, 4, 20, 100]))
def test_pyramid_layer_budgets_follow_the_schedule(budget, reserved, prompt, layers, beta):
    budget = max(budget, reserved + 1)
    pyramid = Pyramid(beta=beta)
    got = [pyramid.layer_budget(torch.tensor([budget]), layer, layers, torch.tensor([prompt]), reserved)
           for layer in range(layers)]
    want = [literal_pyramid(budget, layer, layers, prompt, reserved, beta) for layer in range(layers)]
    assert [int(g) for g in got] == want
    assert all(w >= reserved for w in want)
    # The pyramid keeps the budget on average (up to the floor of the step); shallow layers
    # get more. Budgets beyond the prompt mean no eviction, so only check where it evicts.
    b, n = budget - reserved, prompt - reserved
    if n >= b:
        mean = sum(w - reserved for w in want) / layers
        assert b <= mean <= b + (layers - 1) / 2
        assert want == sorted(want, reverse=True)
        if layers > 1:
            assert want[0] - reserved <= max(n, 0)


def test_pyramid_hand_checked():
    # b = 100, beta 20: min 5, max 195, step 190 // 3 = 63 -> 195, 132, 69, 6 (+ 4 reserved)
    got = [int(Pyramid().layer_budget(torch.tensor([104]), l, 4, torch.tensor([1004]), 4)) for l in range(4)]
    assert got == [199, 136, 73, 10]
    # capped: max = n = 150, min = 200 - 150 = 50, step 50 -> 150, 100, 50
    got = [int(Pyramid().layer_budget(torch.tensor([100]), l, 3, torch.tensor([150]), 0)) for l in range(3)]
    assert got == [150, 100, 50]
    # one layer: the average over one layer is the budget
    assert int(Pyramid().layer_budget(torch.tensor([64]), 0, 1, torch.tensor([1000]), 4)) == 64


def test_pyramid_rows_are_independent():
    budget, lens = torch.tensor([40, 40, 60]), torch.tensor([30, 500, 1000])
    for layer in range(5):
        got = Pyramid(beta=4).layer_budget(budget, layer, 5, lens, 2)
        assert got.tolist() == [literal_pyramid(int(b), layer, 5, int(n), 2, 4) for b, n in zip(budget, lens)]
        assert AdaKV(layers=Pyramid(beta=4)).layer_budget(budget, layer, 5, lens, 2).tolist() == got.tolist()
        assert AdaKV().layer_budget(budget, layer, 5, lens, 2).tolist() == budget.tolist()
        assert Uniform().layer_budget(budget, layer, 5, lens, 2).tolist() == budget.tolist()


# --------------------------------------------------------------------------- Ada-KV

def random_allocation_case(gen, B, H, span, sinks, recent, full=False):
    """Heads holding random token subsets (or all of them), continuous scores, protected tokens
    (sinks and the newest positions) at +inf as the engine passes them."""
    if full:
        pos = torch.arange(span).expand(B, H, span).contiguous()
        mask = torch.ones(B, H, span, dtype=torch.bool)
    else:
        pos, mask = random_cache(gen, B, H, span)
    last_pos = pos.masked_fill(~mask, -1).amax(dim=(1, 2))
    protected = Protection(sinks=sinks, recent=recent).mask(pos, last_pos) & mask
    scores = torch.rand(pos.shape, generator=gen, dtype=torch.float64).float()
    scores = scores.masked_fill(protected, float("inf")).masked_fill(~mask, 0.0)
    return pos, mask, protected, scores


@given(B=st.integers(1, 3), H=st.integers(1, 6), span=st.integers(1, 30), sinks=st.integers(0, 3),
       recent=st.integers(0, 4), alpha=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 0.375]),
       seed=seeds, data=st.data())
def test_adakv_head_budgets_literal(B, H, span, sinks, recent, alpha, seed, data):
    gen = torch.Generator().manual_seed(seed)
    pos, mask, protected, scores = random_allocation_case(gen, B, H, span, sinks, recent)
    budget = torch.tensor([data.draw(st.integers(1, span + 3)) for _ in range(B)])
    got = AdaKV(alpha=alpha).head_budgets(budget, scores, mask, protected, literal_grouped_counts(pos))
    assert got.shape == (B, H) and got.dtype == torch.int64
    held = mask.sum(dim=-1)
    for b in range(B):
        want, star, x, exact = literal_adakv_row(int(budget[b]), scores[b], mask[b], protected[b], pos[b], alpha)
        prot = (protected[b] & mask[b]).sum(dim=-1)
        row = got[b].tolist()
        assert all(p <= r <= n for p, r, n in zip(prot.tolist(), row, held[b].tolist()))
        if exact:
            assert row == want
        else:   # the budget exceeds what the row holds: never below the blend, nor above a head's tokens
            assert all(r >= min(int(p) + math.floor(v), n) for r, p, v, n in zip(row, prot, x, held[b]))


@given(B=st.integers(1, 3), H=st.integers(1, 8), span=st.integers(2, 40), recent=st.integers(0, 4),
       alpha=st.floats(0.0, 1.0), seed=seeds, data=st.data())
def test_adakv_invariants_when_heads_hold_the_whole_prompt(B, H, span, recent, alpha, seed, data):
    """Every head holds all the prompt's tokens (one-shot prefill): the rows sum exactly to
    H * B, every head keeps at least its protected tokens plus floor((1 - alpha) * its share),
    alpha = 0 is uniform and alpha = 1 is Algorithm 2's counts."""
    recent = min(recent, span - 1)
    gen = torch.Generator().manual_seed(seed)
    pos, mask, protected, scores = random_allocation_case(gen, B, H, span, 0, recent, full=True)
    budget = torch.tensor([data.draw(st.integers(recent + 1, span)) for _ in range(B)])
    counts = literal_grouped_counts(pos)
    got = AdaKV(alpha=alpha).head_budgets(budget, scores, mask, protected, counts)
    assert got.sum(dim=-1).tolist() == (H * budget).tolist()
    share = budget - recent                                # selectable per head
    low = torch.floor((1 - alpha) * share[:, None].double() - 1e-9).long()
    high = torch.floor(alpha * (span - recent) + (1 - alpha) * share[:, None].double() + 1e-9).long() + 1
    assert bool((got >= recent + low).all()) and bool((got <= recent + high).all())
    uniform = AdaKV(alpha=0.0).head_budgets(budget, scores, mask, protected, counts)
    assert torch.equal(uniform, budget[:, None].expand(B, H))
    pure = AdaKV(alpha=1.0).head_budgets(budget, scores, mask, protected, counts)
    for b in range(B):
        _, star, _, _ = literal_adakv_row(int(budget[b]), scores[b], mask[b], protected[b], pos[b], 1.0)
        assert pure[b].tolist() == [recent + s for s in star]
    # alpha = 1: head i's own top-B_i is exactly the global top-(H * B) (Alg. 1 = Alg. 2's set)
    keep = literal_topk_keep(scores, pos[:, 0], mask[:, 0], pure)
    for b in range(B):
        s, p = scores[b].tolist(), pos[b].tolist()
        cands = [(s[h][l], p[h][l], h, l) for h in range(H) for l in range(span)]
        top = {(c[2], c[3]) for c in best_first(cands)[:H * int(budget[b])]}
        assert top == {tuple(hl) for hl in torch.nonzero(keep[b]).tolist()}


def test_adakv_hand_checked():
    # One row, 3 heads, no protection, B = 2 per head (6 in all): the 6 best scores are
    # head 0: 4, head 1: 2, head 2: 0 -> alpha 0.5: 0.5 * [4, 2, 0] + 0.5 * 2 = [3, 2, 1].
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.6], [0.95, 0.65, 0.1, 0.0], [0.3, 0.2, 0.15, 0.05]]])
    pos = torch.arange(4).expand(1, 3, 4)
    mask = torch.ones(1, 3, 4, dtype=torch.bool)
    none = torch.zeros_like(mask)
    counts = literal_grouped_counts(pos)
    assert AdaKV().head_budgets(torch.tensor([2]), scores, mask, none, counts).tolist() == [[3, 2, 1]]
    # alpha 0.25: 0.25 * [4, 2, 0] + 0.75 * 2 = [2.5, 2, 1.5] -> floor [2, 2, 1], one missing:
    # tied remainders 0.5 -> the lower head.
    assert AdaKV(alpha=0.25).head_budgets(torch.tensor([2]), scores, mask, none, counts).tolist() == [[3, 2, 1]]
    # protected (the newest position, +inf) on top of the split of the rest: S = 6 - 3 = 3
    # over positions 0..2: best 3 are head 1 pos 0, head 0 pos 0, 1 -> [2, 1, 0];
    # 0.5 * [2, 1, 0] + 0.5 * 1 = [1.5, 1, 0.5] -> [1, 1, 0] + 1 missing to head 0 (0.5 ties head 2).
    prot = torch.zeros_like(mask)
    prot[..., 3] = True
    got = AdaKV().head_budgets(torch.tensor([2]), scores.masked_fill(prot, float("inf")), mask, prot, counts)
    assert got.tolist() == [[3, 2, 1]]
    # Uniform
    assert Uniform().head_budgets(torch.tensor([2]), scores, mask, none, counts).tolist() == [[2, 2, 2]]


@given(rows=st.integers(1, 4), H=st.integers(1, 9), denom=st.sampled_from([1, 2, 3, 4, 7, 10, 64]),
       seed=seeds)
def test_largest_remainder(rows, H, denom, seed):
    """Floor, then one more to the largest remainders (ties to the lower head) until the row sums
    to its total, with x = numerators / denom (as floats; the literal runs on their exact values)."""
    gen = torch.Generator().manual_seed(seed)
    num = torch.randint(0, 5 * denom, (rows, H), generator=gen)
    num[:, -1] += (-num.sum(dim=-1)) % denom                # rows of x sum to integers
    x = num.double() / denom
    total = (num.sum(dim=-1) // denom)
    got = largest_remainder(x, total)
    assert got.dtype == torch.int64
    assert got.sum(dim=-1).tolist() == total.tolist()
    for r in range(rows):
        exact = [Fraction(float(v)) for v in x[r]]
        base = [math.floor(v) for v in exact]
        missing = int(total[r]) - sum(base)
        order = sorted(range(H), key=lambda h: (-(exact[h] - base[h]), h))
        want = [base[h] + (1 if order.index(h) < missing else 0) for h in range(H)]
        assert got[r].tolist() == want
    assert bool(((got - x).abs() < 1).all())


@given(rows=st.integers(1, 4), H=st.integers(1, 9), denom=st.integers(1, 12), seed=seeds)
def test_largest_remainder_of_fractions(rows, H, denom, seed):
    """With the numerators and their denominator, equal remainders tie exactly (lower head first)."""
    gen = torch.Generator().manual_seed(seed)
    num = torch.randint(0, 4 * denom, (rows, H), generator=gen)
    num[:, -1] += (-num.sum(dim=-1)) % denom
    total = num.sum(dim=-1) // denom
    got = largest_remainder(num.double(), total, denom=denom)
    assert got.sum(dim=-1).tolist() == total.tolist()
    for r in range(rows):
        exact = [Fraction(int(v), denom) for v in num[r]]
        base = [math.floor(v) for v in exact]
        order = sorted(range(H), key=lambda h: (-(exact[h] - base[h]), h))
        missing = int(total[r]) - sum(base)
        assert got[r].tolist() == [base[h] + (1 if order.index(h) < missing else 0) for h in range(H)]


def test_largest_remainder_hand_checked():
    x = torch.tensor([[0.5, 0.5, 1.0, 2.0], [1.25, 0.25, 0.75, 0.75], [0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    got = largest_remainder(x, torch.tensor([4, 3, 3]))
    assert got.tolist() == [[1, 0, 1, 2], [1, 0, 1, 1], [0, 0, 0, 3]]
    # thirds: 8/3, 5/3, 8/3 (sum 7) -> floor 2, 1, 2 and two more to the tied remainders 2/3:
    # heads 0 and 1, although 8/3 and 5/3 have different remainders as floats
    assert largest_remainder(torch.tensor([[8.0, 5.0, 8.0]], dtype=torch.float64), torch.tensor([7]),
                             denom=3).tolist() == [[3, 2, 2]]


# --------------------------------------------------------------------------- selection of a prompt

@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
@given(B=st.integers(1, 3), H=st.integers(1, 4), n=prompt_lens, seed=seeds, ties=st.booleans())
def test_prompt_keep_is_a_per_head_topk(storage, B, H, n, seed, ties):
    """keep = each head's k best real tokens, ties to the lower position; padding never kept."""
    gen = torch.Generator().manual_seed(seed)
    p = make_prompt(seed, B, H, 1, n)
    if ties:
        scores = torch.randint(0, 4, (B, H, n), generator=gen).float()
        scores[torch.rand(B, H, n, generator=gen) < 0.1] = float("inf")
    else:
        scores = torch.rand(B, H, n, generator=gen)
    k = torch.randint(0, n + 2, (B, H), generator=gen)
    got = storage.prompt_keep(scores, p.pos, p.valid, k)
    want = literal_topk_keep(scores, p.pos, p.valid, k)
    assert torch.equal(got.cpu(), want)
    # ... and the grouped counts of the engine's Algorithm 2 are the literal ones
    total = torch.randint(0, H * n + 2, (B,), generator=gen)
    pos = p.pos[:, None].expand(B, H, n)
    counts = storage.prompt_grouped_counts(scores, p.pos, p.valid, total)
    assert torch.equal(counts.cpu(), literal_grouped_counts(pos)(scores, p.valid[:, None].expand(B, H, n), total))


def policies():
    return st.one_of(
        st.builds(lambda w, k, pool, gqa, order, alloc: (SnapKV(window=w, kernel=k, pooling=pool, gqa=gqa,
                                                               order=order), alloc),
                  st.sampled_from([1, 4, 32]), st.sampled_from([1, 3, 7]), st.sampled_from(["max", "avg"]),
                  st.sampled_from(["mean", "max"]), st.sampled_from(["mean_then_pool", "pool_then_mean"]),
                  st.sampled_from([Uniform(), AdaKV(), AdaKV(alpha=1.0), Pyramid(beta=2),
                                   AdaKV(alpha=0.25, layers=Pyramid(beta=3))])),
        st.tuples(st.builds(H2O, recent=st.integers(0, 3)), st.sampled_from([Uniform(), AdaKV()])),
        st.tuples(st.builds(TOVA, per_head=st.booleans()), st.sampled_from([Uniform(), AdaKV(alpha=0.75)])),
        st.tuples(st.builds(StreamingLLM, sinks=st.integers(0, 4)), st.sampled_from([Uniform(), Pyramid(beta=2)])),
    )


def clear_cut(values, k):
    """Whether picking the k best of `values` (float64) is decided by more than float32 noise:
    the value at the cut is either exactly tied with its neighbours or clearly apart."""
    values = sorted(values, reverse=True)
    if k <= 0 or k >= len(values):
        return True
    t = values[k - 1]
    return all(v == t or abs(v - t) > 1e-5 * max(1.0, abs(t)) for v in values if math.isfinite(v))


@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
@heavy
@given(B=st.integers(1, 3), layout=head_layouts, n=prompt_lens, seed=seeds, scorer_alloc=policies(),
       layer=st.integers(0, 3), data=st.data())
def test_one_shot_compression_keeps_the_literal_tokens(storage, B, layout, n, seed, scorer_alloc, layer, data):
    """The engine's one-shot prefill (score, protect, allocate, select, store) against the
    papers' pipeline computed literally: each head keeps its protected tokens and the best of
    the rest by the literal scores, with the literal layer and head budgets."""
    scorer, allocation = scorer_alloc
    H, G = layout
    protection = scorer.default_protection()
    if data.draw(st.booleans()):
        policy = Policy(scorer, budget=data.draw(st.integers(protection.size + 1, protection.size + n + 2)),
                        allocation=allocation)
    else:
        policy = Policy(scorer, ratio=data.draw(st.sampled_from([0.1, 0.3, 0.5, 1.0])), allocation=allocation)
    p = make_prompt(seed, B, H, G, n, layer_idx=layer, num_layers=4)
    state = LayerState(layer, 4, policy, storage)
    state.ensure_storage(p.q, p.k)
    compress_prompt(state, p.q, p.k, p.v, p.pos, p.valid, p.scale)
    parts = state.kv.view(None, False)
    kept = [[set(parts["pos"][b, h][parts["mask"][b, h]].tolist()) for h in range(H)] for b in range(B)]

    for b, (idx, s) in enumerate(literal_scores(scorer, p)):
        m = len(idx)
        positions = p.pos[b, idx].tolist()                 # 0 .. m-1
        prot = [q < protection.sinks or q > positions[-1] - protection.recent for q in positions]
        reserved = protection.size
        base = policy.budget if policy.budget is not None else max(math.ceil(m * policy.ratio), reserved + 1)
        layers = allocation.layers if isinstance(allocation, AdaKV) else allocation
        layer_budget = (literal_pyramid(base, layer, 4, m, reserved, layers.beta)
                        if isinstance(layers, Pyramid) else base)
        free = [j for j in range(m) if not prot[j]]
        sl = s.tolist()
        if isinstance(allocation, AdaKV):
            pos_h = torch.tensor(positions).expand(H, m)
            prot_h = torch.tensor(prot).expand(H, m)
            budgets, _, _, _ = literal_adakv_row(layer_budget, s, torch.ones(H, m, dtype=torch.bool),
                                                 prot_h, pos_h, allocation.alpha)
            S = max(H * layer_budget - H * sum(prot), 0)
            assume(clear_cut([sl[h][j] for h in range(H) for j in free], S))
        else:
            budgets = [min(layer_budget, m)] * H
        for h in range(H):
            take = max(budgets[h] - sum(prot), 0)
            assume(clear_cut([sl[h][j] for j in free], take))
            best = best_first([(sl[h][j], positions[j], h, j) for j in free])[:take]
            want = {positions[j] for j in range(m) if prot[j]} | {c[1] for c in best}
            assert kept[b][h] == want, (b, h)
