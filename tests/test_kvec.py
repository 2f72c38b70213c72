"""K-VEC (research/seed-004-kvec.md) against the paper's Eq. 8-16 and Algorithm 1.

- a literal per-row, per-head implementation (float64, explicit softmax, loops), run layer after
  layer with the coverage counts carried over, against the engine's one-shot prefill
  (``compress_prompt`` on ``LayerState`` objects sharing one ``SharedByLayers``): the same tokens kept in
  every head of every layer, GQA, left padding, ratio budgets and a pyramid included;
- hand-checked cases: which heads are re-scored, the coverage bonus, the β protection;
- validation (schedules, Ada-KV, protections) and the reductions to the plain windowed scorer;
- model level: the ragged path gives the reference path's logits and kept tokens, and every
  new prefill starts with fresh coverage counts.
"""
from __future__ import annotations

import math

import pytest
import torch

import kvcache_ext
from kvcache_ext.engine.prompt import compress_prompt
from kvcache_ext.engine.state import LayerState, SharedByLayers
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.policies import (AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, OneShot, Policy,
                                  PromptView, Protection, Pyramid, SnapKV, Uniform)
from kvcache_ext.policies.kvec import KVEC, SHARED_KEY, CoverageState, top_k_mask
from kvcache_ext.reference.masked_cache import MaskedLayerKV
from test_patch import inputs, teacher_forced
from literal import literal_pool
from tiny_models import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- random prompts

def make_layers(seed: int, lens: list[int], n: int, heads: int, groups: int, layers: int,
                head_dim: int = 8) -> list[PromptView]:
    """One random prompt per layer (same rows, lengths and positions; left padding, HF's
    convention: padding first with position id 1)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    lens_t = torch.tensor(lens)
    valid = torch.arange(n) >= (n - lens_t)[:, None]
    pos = (torch.arange(n) - (n - lens_t)[:, None]).masked_fill(~valid, 1)
    views = []
    for layer in range(layers):
        q = torch.randn(B, heads * groups, n, head_dim, generator=gen) * 1.5
        k = torch.randn(B, heads, n, head_dim, generator=gen)
        v = torch.randn(B, heads, n, head_dim, generator=gen)
        views.append(PromptView(q=q, k=k, v=v, pos=pos, valid=valid, scale=1 / math.sqrt(head_dim),
                                layer_idx=layer, num_layers=layers))
    return views


# --------------------------------------------------------------------------- literal K-VEC

def literal_attention(p: PromptView, b: int) -> torch.Tensor:
    """A [Hq, m, m] float64: softmax of real query i over real keys j <= i of row b; query head
    h*G + g reads KV head h."""
    idx = torch.nonzero(p.valid[b]).flatten()
    G = p.q.shape[1] // p.k.shape[1]
    q = p.q[b][:, idx].double()
    k = torch.stack([p.k[b, hq // G][idx].double() for hq in range(p.q.shape[1])])
    logits = torch.einsum("hid,hjd->hij", q, k) * p.scale
    m = len(idx)
    logits = logits.masked_fill(~torch.ones(m, m, dtype=torch.bool).tril(), float("-inf"))
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def literal_group(x: torch.Tensor, G: int, how: str) -> torch.Tensor:
    """[Hq, ...] -> [H, ...] over each KV head's G query heads."""
    parts = [x[h * G:(h + 1) * G] for h in range(x.shape[0] // G)]
    return torch.stack([t.mean(0) if how == "mean" else t.amax(0) for t in parts])


def ranked(values, positions, among):
    """Indices of ``among`` best first: higher value, then lower position."""
    return sorted(among, key=lambda j: (-values[j], positions[j]))


def boundary_gap(values, order, k, exact=frozenset()):
    """The gap between the k-th and the (k+1)-th of ``order``. Exact ties are not near ties:
    two overridden values (the same constant in both implementations), or two pooled values
    taken from the same element, tie in float32 too and go to the lower position in both."""
    if k <= 0 or k >= len(order):
        return math.inf
    a, b = order[k - 1], order[k]
    gap = abs(values[a] - values[b])
    return math.inf if (a in exact and b in exact) or gap == 0 else gap


def literal_kvec_row(A, G, s: KVEC, layer: int, counts: list[int], budget: int, positions: list[int]):
    """Algorithm 1 and Eq. 9 for one row of one layer, from the equations.
    Returns (kept token indices per KV head, re-scored heads, the smallest decision gap)."""
    Hq, m, _ = A.shape
    H = Hq // G
    O, Ox = min(s.window, m), min(s.extended_window, m)
    recent = [positions[j] > positions[-1] - s.keep_recent for j in range(m)]
    cands = [j for j in range(m) if not recent[j]]
    gaps = [math.inf]

    def eq8(rows):        # (1/O) sum over the last `rows` queries, per KV head, pooled if asked
        P = literal_group(A[:, m - rows:, :].sum(dim=1) / rows, G, s.gqa)
        return literal_pool(P, s.kernel, s.pooling, [j in cands for j in range(m)]) if s.kernel > 1 else P

    P, P_ext = eq8(O), eq8(Ox)
    # Eq. 10: std of P over the candidate tokens; the δ lowest take Eq. 11.
    sigma = [float(P[h, cands].std(unbiased=False)) if cands else 0.0 for h in range(H)]
    d = min(s.delta, H)
    by_sigma = sorted(range(H), key=lambda h: (sigma[h], h))
    gaps.append(boundary_gap(sigma, by_sigma, d))
    h_top = sorted(by_sigma[:d])
    for h in h_top:
        P[h] = P_ext[h]
    # Eq. 13: for each of the last O queries the max over the heads, then the mean.
    rows = A[:, m - O:, :] if s.importance_heads == "query" else literal_group(A[:, m - O:, :], G, s.gqa)
    I = [sum(float(rows[:, q, t].max()) for q in range(O)) / O for t in range(m)]
    # Eq. 12, 14, 15.
    focus = [I[t] * (1 - counts[t] / (layer + 1)) for t in range(m)]
    kept = []
    K = math.floor(s.beta * (budget - s.keep_recent) + 1e-9)
    for h in range(H):
        base = P[h].tolist()
        adjusted = [base[t] + s.lam * focus[t] for t in range(m)]
        # Eq. 16: the head's own top-K by P (after Eq. 11) are set to protect_value.
        order = ranked(base, positions, cands)
        gaps.append(boundary_gap(base, order, K))
        preserved = set(order[:K])
        for t in preserved:
            adjusted[t] = s.protect_value
        # Eq. 9 on P': the recent tokens, then the best of the candidates.
        take = max(budget - sum(recent), 0)
        order = ranked(adjusted, positions, cands)
        gaps.append(boundary_gap(adjusted, order, take, exact=preserved))
        kept.append({t for t in range(m) if recent[t]} | set(order[:take]))
    return kept, h_top, min(gaps)


def literal_kvec(views: list[PromptView], s: KVEC, policy: Policy):
    """Every layer in order, coverage counts carried over. Returns per layer, per row, per KV
    head the kept positions; per layer the re-scored heads; the final counts per row."""
    B = views[0].q.shape[0]
    L = len(views)
    counts = [[0] * int(views[0].valid[b].sum()) for b in range(B)]
    kept_all, h_tops, gap = [], [], math.inf
    for layer, p in enumerate(views):
        G = p.q.shape[1] // p.k.shape[1]
        kept_layer, h_layer = [], []
        for b in range(B):
            idx = torch.nonzero(p.valid[b]).flatten()
            m = len(idx)
            positions = p.pos[b, idx].tolist()
            reserved = policy.protection.size
            base = (policy.budget if policy.budget is not None
                    else max(math.ceil(m * policy.ratio), reserved + 1))
            budget = base
            if isinstance(policy.allocation, Pyramid):   # the layer schedule, literally (docs/policies.md)
                bb, nn = max(base - reserved, 0), max(m - reserved, 0)
                lo = bb // policy.allocation.beta
                hi = 2 * bb - lo
                if hi >= nn:
                    hi, lo = nn, 2 * bb - nn
                budget = max(hi - layer * ((hi - lo) // (L - 1)), 0) + reserved
            kept, h_top, g = literal_kvec_row(literal_attention(p, b), G, s, layer, counts[b], budget,
                                              positions)
            gap = min(gap, g)
            for t in set().union(*kept):
                counts[b][t] += 1
            kept_layer.append([{positions[t] for t in heads} for heads in kept])
            h_layer.append(h_top)
        kept_all.append(kept_layer)
        h_tops.append(h_layer)
    return kept_all, h_tops, counts, gap


def engine_kvec(views: list[PromptView], policy: Policy, storage):
    """The engine's one-shot prefill, layer after layer, sharing what a cache's layers share."""
    shared = SharedByLayers()
    L = len(views)
    states = [LayerState(layer, L, policy, storage, shared=shared) for layer in range(L)]
    kept = []
    for state, p in zip(states, views):
        state.ensure_storage(p.q, p.k)
        compress_prompt(state, p.q, p.k, p.v, p.pos, p.valid, p.scale)
        parts = state.kv.view(None, False)
        B, H = parts["mask"].shape[:2]
        kept.append([[set(parts["pos"][b, h][parts["mask"][b, h]].tolist()) for h in range(H)]
                     for b in range(B)])
    return kept, shared.scorer_state.get(SHARED_KEY)


CASES = [
    # (scorer, budget or ratio, allocation, rows' lengths, n, KV heads, G, layers)
    (KVEC(kernel=1, window=4, extended_window=8, delta=1), 10, Uniform(), [40, 33, 3], 40, 2, 2, 4),
    (KVEC(kernel=1), 12, Uniform(), [60, 47], 60, 4, 2, 3),       # the paper's equations, unpooled
    (KVEC(window=3, extended_window=7, delta=2, beta=0.5, lam=2.0, keep_recent=3, kernel=3),
     11, Uniform(), [36, 20, 9], 36, 3, 2, 3),
    (KVEC(window=4, extended_window=6, delta=5, gqa="max", importance_heads="kv",
          protect_value=float("inf"), kernel=3, pooling="avg"), 9, Uniform(), [30, 25], 30, 2, 4, 3),
    (KVEC(kernel=1, window=5, extended_window=9, delta=1), 0.3, Uniform(), [44, 31], 44, 4, 1, 3),   # ratio, MHA
    (KVEC(kernel=1, window=4, extended_window=8, delta=1, keep_recent=2), 14, Pyramid(beta=3), [50, 38], 50, 2, 2, 4),
    (KVEC(kernel=1, window=4, extended_window=8, beta=0.0), 8, Uniform(), [28, 28], 28, 1, 4, 3),       # MQA
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
def test_engine_keeps_the_literal_tokens_layer_after_layer(case, storage):
    scorer, size, allocation, lens, n, H, G, L = CASES[case]
    kwargs = dict(budget=size) if isinstance(size, int) else dict(ratio=size)
    policy = Policy(scorer, allocation=allocation, **kwargs)
    views = make_layers(100 + case, lens, n, H, G, L)
    want, h_tops, counts, gap = literal_kvec(views, scorer, policy)
    assert gap > 1e-5, "a near tie: float32 and float64 could differ; pick another seed"
    got, state = engine_kvec(views, policy, storage)
    for layer in range(L):
        for b in range(len(lens)):
            assert got[layer][b] == want[layer][b], (layer, b)
            assert sorted(state.h_top[layer][b].tolist()) == h_tops[layer][b], (layer, b)
    # The scorer's counts are the engine's kept tokens: n_t = layers keeping t in some head.
    assert state.layers == L
    for b, row in enumerate(counts):
        pad = n - lens[b]
        assert state.counts[b, pad:].tolist() == row
        assert state.counts[b, :pad].tolist() == [0] * pad
        from_engine = [sum(any(t in heads for heads in got[layer][b]) for layer in range(L))
                       for t in range(lens[b])]
        assert from_engine == row
    covered = [sum(c > 0 for c in row) / len(row) for row in counts]
    torch.testing.assert_close(state.coverage(), torch.tensor(covered, dtype=torch.float32))


def test_prompt_scores_directly_layer_by_layer():
    """The PromptView interface alone (one cache_state dict, layers in order): the scores' top-B per
    head is the literal selection; layers out of order are refused."""
    scorer = KVEC(kernel=1, window=4, extended_window=8, delta=1)
    policy = Policy(scorer, budget=10)
    views = make_layers(7, [30, 22], 30, 2, 2, 3)
    want, _, counts, gap = literal_kvec(views, scorer, policy)
    assert gap > 1e-5
    shared = {}
    for layer, p in enumerate(views):
        p.cache_state, p.budget = shared, torch.tensor([10, 10])
        scores, channels = scorer.prompt_scores(p)
        assert channels is None and scores.dtype == torch.float32
        keep = top_k_mask(scores, p.pos, p.valid, torch.full((2, 2), 10))
        for b in range(2):
            for h in range(2):
                assert set(p.pos[b][keep[b, h]].tolist()) == want[layer][b][h]
    assert shared[SHARED_KEY].counts[1, 8:].tolist() == counts[1]
    with pytest.raises(RuntimeError, match="in order"):
        scorer.prompt_scores(views[2])          # layer 2 again, after 3 layers
    fresh = make_layers(7, [30, 22], 30, 2, 2, 3)[1]
    fresh.budget = torch.tensor([10, 10])
    with pytest.raises(RuntimeError, match="same cache_state dict"):
        scorer.prompt_scores(fresh)             # layer 1 with a dict no layer 0 has seen
    with pytest.raises(ValueError, match="budget"):
        scorer.prompt_scores(make_layers(7, [30, 22], 30, 2, 2, 1)[0])


# --------------------------------------------------------------------------- hand-checked

def one_row(rows_by_head: list[list[list[float]]]):
    """probs [1, H, W, n] from explicit window rows (oldest first), all slots real."""
    probs = torch.tensor([rows_by_head], dtype=torch.float32)
    W, n = probs.shape[2], probs.shape[3]
    slots, cand = torch.ones(1, W, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool)
    return probs, slots, cand, torch.arange(n)[None]


def test_hand_checked_least_focused_heads_are_rescored():
    """O = 1, O' = 2, four heads (seed-004 §3). Newest rows: head 0 uniform (σ = 0), head 1
    peaked (σ ≈ 0.35), head 2 a ramp (σ ≈ 0.11), head 3 (σ ≈ 0.17). The lowest σ first:
    0, 2, 3, 1. A re-scored head's P is the mean of its two rows; the others keep the newest."""
    older = [0.1, 0.2, 0.3, 0.4]
    newest = [[0.25, 0.25, 0.25, 0.25], [0.85, 0.05, 0.05, 0.05],
              [0.4, 0.3, 0.2, 0.1], [0.55, 0.15, 0.15, 0.15]]
    probs, slots, cand, pos = one_row([[older, row] for row in newest])
    for delta, heads in [(0, []), (1, [0]), (2, [0, 2]), (3, [0, 2, 3]), (9, [0, 2, 3, 1])]:
        s = KVEC(kernel=1, window=1, extended_window=2, delta=delta, lam=0.0, beta=0.0)
        out = s.adjust(probs, slots, cand, pos, 1, 0, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([2]))
        torch.testing.assert_close(out.sigma[0], torch.tensor([0.0, 0.3464102, 0.1118034, 0.1732051]))
        assert out.h_top[0].tolist() == heads          # lowest σ first
        for h in range(4):
            want = [(a + b) / 2 for a, b in zip(older, newest[h])] if h in heads else newest[h]
            torch.testing.assert_close(out.base[0, h], torch.tensor(want))
            torch.testing.assert_close(out.scores[0, h], torch.tensor(want))   # λ = β = 0


def test_hand_checked_coverage_bonus():
    """Layer ℓ = 2 (ℓ + 1 = 3), n_t = [0, 1, 2, 2], O = 1, two heads with newest rows
    [.5 .2 .2 .1] and [.1 .6 .1 .2]: I = [.5 .6 .2 .2] (max over heads), coverage =
    [0 1/3 2/3 2/3], focus = [.5 .4 .2/3 .2/3], P' = P + focus."""
    rows = [[[0.5, 0.2, 0.2, 0.1]], [[0.1, 0.6, 0.1, 0.2]]]
    probs, slots, cand, pos = one_row(rows)
    counts = torch.tensor([[0, 1, 2, 2]], dtype=torch.int32)
    s = KVEC(kernel=1, window=1, extended_window=2, delta=0, lam=1.0, beta=0.0)
    out = s.adjust(probs, slots, cand, pos, 1, 2, counts, torch.tensor([2]))
    torch.testing.assert_close(out.importance[0], torch.tensor([0.5, 0.6, 0.2, 0.2]))
    torch.testing.assert_close(out.coverage[0], torch.tensor([0.0, 1 / 3, 2 / 3, 2 / 3]))
    focus = torch.tensor([0.5, 0.4, 0.2 / 3, 0.2 / 3])
    torch.testing.assert_close(out.focus[0], focus)
    torch.testing.assert_close(out.scores[0], torch.tensor(rows)[:, 0] + focus)
    # Top-2 per head: head 0 [1.0 .6 .267 .167] keeps t0, t1; head 1 [.6 1.0 .167 .267] keeps t1, t0.
    keep = top_k_mask(out.scores, pos, cand, torch.tensor([[2, 2]]))
    assert keep[0].tolist() == [[True, True, False, False]] * 2
    # Without the bonus, head 1 would keep t1 and t3 (.6, .2): the bonus brings in uncovered t0.
    plain = top_k_mask(out.base, pos, cand, torch.tensor([[2, 2]]))
    assert plain[0, 1].tolist() == [False, True, False, True]
    # λ scales the bonus; ℓ = 0 has no coverage (focus = I).
    out = KVEC(kernel=1, window=1, extended_window=2, delta=0, lam=0.5, beta=0.0).adjust(
        probs, slots, cand, pos, 1, 0, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([2]))
    importance = torch.tensor([0.5, 0.6, 0.2, 0.2])
    torch.testing.assert_close(out.scores[0], torch.tensor(rows)[:, 0] + 0.5 * importance)


def test_hand_checked_beta_protection():
    """β = 0.5. Head 0's own best tokens by P are t1 (.45), t2 (.35); heads 1 and 2 put .97 on
    t4 and t5, so head 0's P' there is .06 + .97 = 1.03, above the override value 1.0 (Eq. 16)."""
    rows = [[[0.02, 0.45, 0.35, 0.06, 0.06, 0.06]],
            [[0.01, 0.01, 0.005, 0.005, 0.97, 0.0]],
            [[0.01, 0.01, 0.005, 0.005, 0.0, 0.97]]]
    probs, slots, cand, pos = one_row(rows)
    zeros = torch.zeros(1, 6, dtype=torch.int32)

    def kept(budget, **kw):
        s = KVEC(kernel=1, window=1, extended_window=2, delta=0, beta=0.5, **kw)
        out = s.adjust(probs, slots, cand, pos, 1, 0, zeros, torch.tensor([budget]))
        keep = top_k_mask(out.scores, pos, cand, torch.tensor([[budget] * 3]))
        return out, [set(torch.nonzero(keep[0, h]).flatten().tolist()) for h in range(3)]

    out, keep = kept(4)                    # K = 2: t1, t2 at 1.0, kept with t4, t5
    assert out.preserved[0, 0].tolist() == [False, True, True, False, False, False]
    torch.testing.assert_close(out.scores[0, 0], torch.tensor([0.04, 1.0, 1.0, 0.12, 1.03, 1.03]))
    assert keep[0] == {1, 2, 4, 5}
    # B = 2, K = 1: the literal 1.0 loses to the two 1.03 tokens; protect_value=inf keeps t1.
    out, keep = kept(2)
    assert out.preserved[0, 0].tolist() == [False, True, False, False, False, False]
    assert keep[0] == {4, 5}
    _, keep = kept(2, protect_value=float("inf"))
    assert keep[0] == {1, 4}               # t4 and t5 tie at 1.03: the lower position
    # K = floor(β·B): B = 3 gives K = 1; β = 0 protects nothing.
    assert kept(3)[0].preserved[0].sum(dim=1).tolist() == [1, 1, 1]
    s = KVEC(kernel=1, window=1, extended_window=2, delta=0, beta=0.0)
    assert not s.adjust(probs, slots, cand, pos, 1, 0, zeros, torch.tensor([4])).preserved.any()


def test_short_rows_and_prompts_within_budget():
    """A row shorter than the window averages over its real queries only; a prompt within
    the budget is kept whole and counts every token once per layer."""
    scorer = KVEC(kernel=1, window=4, extended_window=8, delta=1)
    views = make_layers(3, [3, 2], 5, 2, 2, 2)
    got, state = engine_kvec(views, Policy(scorer, budget=6), RaggedLayerKV)
    assert got[0][0] == [{0, 1, 2}] * 2 and got[1][1] == [{0, 1}] * 2
    assert state.counts.tolist() == [[0, 0, 2, 2, 2], [0, 0, 0, 2, 2]]
    torch.testing.assert_close(state.coverage(), torch.ones(2))


# --------------------------------------------------------------------------- reductions, validation

@pytest.mark.parametrize("recent", [0, 4])
def test_without_coverage_modules_it_is_the_windowed_scorer(recent):
    """δ = 0 and λ = 0 (seed-004 §13 item 14): SnapKV's window mean without pooling, top-B per
    head (β only re-marks tokens that are in the top-B anyway)."""
    views = make_layers(11, [40, 29], 40, 2, 2, 3)
    kvec = Policy(KVEC(kernel=1, window=8, extended_window=16, delta=0, lam=0.0, keep_recent=recent), budget=12)
    snap = Policy(SnapKV(window=8, kernel=1), budget=12, protection=Protection(recent=recent))
    got, _ = engine_kvec(views, kvec, RaggedLayerKV)
    want, _ = engine_kvec(views, snap, RaggedLayerKV)
    assert got == want
    # And the bonus does change the selection of later layers.
    other, _ = engine_kvec(views, Policy(KVEC(kernel=1, window=8, extended_window=16, delta=0, keep_recent=recent),
                                         budget=12), RaggedLayerKV)
    assert other != want


def test_validation():
    for kwargs in [dict(window=0), dict(extended_window=16), dict(extended_window=8), dict(delta=-1),
                   dict(lam=-1.0), dict(beta=1.5), dict(beta=-0.1), dict(protect_value=float("nan")),
                   dict(keep_recent=-1), dict(kernel=2), dict(pooling="min"), dict(gqa="sum"),
                   dict(importance_heads="all")]:
        with pytest.raises(ValueError):
            KVEC(**kwargs)
    for schedule in [BlockwisePrefill(16), EveryStep(), EveryNSteps(4)]:
        with pytest.raises(ValueError, match="one-shot prefill"):
            Policy(KVEC(), budget=64, schedule=schedule)
    for allocation in [AdaKV(), AdaKV(alpha=1.0, layers=Pyramid())]:
        with pytest.raises(ValueError, match="Ada-KV"):
            Policy(KVEC(), budget=64, allocation=allocation)
    with pytest.raises(ValueError, match="keep_recent"):
        Policy(KVEC(), budget=64, protection=Protection(sinks=4))
    with pytest.raises(ValueError, match="keep_recent"):
        Policy(KVEC(keep_recent=8), budget=64, protection=Protection())
    with pytest.raises(ValueError, match="protected"):
        Policy(KVEC(keep_recent=8), budget=8)
    policy = Policy(KVEC(keep_recent=8), budget=64, allocation=Pyramid(), schedule=OneShot())
    assert policy.protection == Protection(recent=8)
    policy.scorer.check_policy(policy)
    assert KVEC().capabilities.channels == 0 and not OneShot().evicts_over_cache


# --------------------------------------------------------------------------- model level

MODEL_SCORERS = [KVEC(kernel=1, window=4, extended_window=8, delta=1),
                 KVEC(window=4, extended_window=8, keep_recent=4, kernel=3, gqa="max"),
                 KVEC()]


def kept_prompt_positions(cache, layers, prompt_len):
    """Per layer, per row, per KV head: kept positions of the prompt (decode tokens dropped)."""
    out = []
    for layer in range(layers):
        parts = cache.layer_kv(layer).view(None, False)
        B, H = parts["mask"].shape[:2]
        out.append([[{q for q in parts["pos"][b, h][parts["mask"][b, h]].tolist() if q < prompt_len}
                     for h in range(H)] for b in range(B)])
    return out


@pytest.mark.parametrize("allocation", [Uniform(), Pyramid(beta=4)], ids=["uniform", "pyramid"])
@pytest.mark.parametrize("scorer", MODEL_SCORERS, ids=lambda s: f"O{s.window}r{s.keep_recent}k{s.kernel}")
def test_ragged_path_equals_reference_path(scorer, allocation):
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    policy = Policy(scorer, budget=20, allocation=allocation, schedule=OneShot())
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=6)
        expected = teacher_forced(model, reference, ids, mask, steps=6)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    kept = kept_prompt_positions(ragged, 3, 60)
    assert kept == kept_prompt_positions(reference, 3, 60)
    for layer in range(3):
        assert ragged.layer_kv(layer).store.num_tokens == int(ragged.layer_kv(layer).lens.sum())
    assert int(ragged.kept_tokens()[0].sum()) < 2 * 2 * (60 + 6)      # eviction happened
    # The coverage counts follow what the layers really kept (indices = position + padding).
    states = [ragged.scorer_state[SHARED_KEY], reference.scorer_state[SHARED_KEY]]
    for state in states:
        assert state.layers == 3
        for b, pad in enumerate((0, 7)):
            want = [sum(any(q in heads for heads in kept[layer][b]) for layer in range(3))
                    for q in range(60 - pad)]
            assert state.counts[b, pad:].tolist() == want
    assert torch.equal(states[0].counts, states[1].counts)


def test_every_prefill_starts_with_fresh_coverage():
    """A second forward with a fresh cache, or the same cache after reset(), starts with n_t = 0:
    same prompt, same kept tokens, same counts (at most the number of layers)."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=50, pad=(5, 0))
    other, other_mask = inputs(batch=2, length=50, pad=(0, 3), seed=4)
    policy = Policy(KVEC(kernel=1, window=4, extended_window=8, delta=1), budget=12)
    with kvcache_ext.patch(model, policy) as handle:
        first = handle.new_cache()
        logits = teacher_forced(model, first, ids, mask, steps=2)
        counts = first.scorer_state[SHARED_KEY].counts.clone()
        assert int(counts.max()) <= 3 and int(counts.max()) > 0
        teacher_forced(model, handle.new_cache(), other, other_mask, steps=2)   # something else
        second = handle.new_cache()
        assert second.scorer_state == {}
        torch.testing.assert_close(teacher_forced(model, second, ids, mask, steps=2), logits, atol=0, rtol=0)
        assert torch.equal(second.scorer_state[SHARED_KEY].counts, counts)
        first.reset()                                   # empties the scorer's cross-layer state
        assert first.scorer_state == {}
        torch.testing.assert_close(teacher_forced(model, first, ids, mask, steps=2), logits, atol=0, rtol=0)
        state = first.scorer_state[SHARED_KEY]
        assert isinstance(state, CoverageState) and state.layers == 3
        assert torch.equal(state.counts, counts)
        assert kept_prompt_positions(first, 3, 50) == kept_prompt_positions(second, 3, 50)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
        assert out.sequences.shape == (2, 53)
        assert torch.equal(out.past_key_values.scorer_state[SHARED_KEY].counts, counts)
