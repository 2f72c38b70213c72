"""AhaKV (research/seed-002-ahakv.md) against a literal transcription of the paper.

The literal code below is written from the paper's Eq. 5, 9-15 and Algorithm 1 with Python
loops over batch rows, heads and query rows, in float64, and never calls the scorer: per row
the real tokens only (positions 0 .. m-1), per (KV head, query head) the SG-softmax of each
window row over the keys it sees, the value prior by an explicit mean over neighbours, and
Algorithm 1's keep-recent-plus-top-B_s loop with one eviction per decode step.
"""
from __future__ import annotations

import math

import pytest
import torch

import kvcache_ext
from kvcache_ext.engine.decode import decode
from kvcache_ext.engine.prompt import compress_prompt
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.policies import (AdaKV, BlockwisePrefill, CacheView, EveryStep, H2O, OneShot, Policy,
                                  PromptView, Protection, Pyramid, Uniform)
from kvcache_ext.policies.ahakv import AhaKV, sg_lambda
from kvcache_ext.policies.pooling import Pooling
from kvcache_ext.reference.masked_cache import MaskedLayerKV
from test_patch import inputs, teacher_forced
from literal import held_layout, literal_pool, outside_window
from tiny_models import tiny_model

TOL = dict(rtol=1e-5, atol=1e-6)        # the scorer's float32 against the literal float64


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- literal AhaKV

def lit_scale(i: int, k: float, d: int, reading: str) -> float:
    """Eq. 12 and what it multiplies: the raw Q K^T ("consistent") or Q K^T / sqrt(d) ("literal")."""
    lam = math.sqrt(2.0 * math.log(i / k) / d) if i > k else 0.0
    return lam if reading == "consistent" else lam / math.sqrt(d)


def lit_softmax(q, K, scale):
    """Eq. 9: e^{lam x_j} / sum_j e^{lam x_j} with x_j = q . K_j, as a list."""
    x = [scale * float(torch.dot(q, K[j])) for j in range(K.shape[0])]
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = sum(e)
    return [v / total for v in e]


def lit_prior(V, kernel):
    """Eq. 13-14 for one head's sequence V [m, D]: nu_j = ||V_j||^2, gamma_j = mean of nu over
    the tokens within kernel // 2 of j that exist, gamma_bar = gamma / max(gamma)."""
    m, half = V.shape[0], kernel // 2
    nu = [float((V[j] ** 2).sum()) for j in range(m)]
    gamma = []
    for j in range(m):
        near = nu[max(0, j - half):min(m, j + half + 1)]
        gamma.append(sum(near) / len(near))
    top = max(gamma)
    return [g / top for g in gamma] if top > 0 else [1.0] * m


def lit_combine(per_head, how):
    """The G query heads' lists of one KV head -> one list."""
    cols = list(zip(*per_head))
    if how == "mean":
        return [sum(c) / len(c) for c in cols]
    if how == "sum":
        return [sum(c) for c in cols]
    return [max(c) for c in cols]


def lit_budget_k(s: AhaKV, budget):
    return budget - s.recent if s.budget_k == "selected" else budget


def lit_window_scores(s: AhaKV, q, k, v, qpos, kpos, budget, n_now):
    """Alg. 1 lines 6-10 for one batch row: q [Hq, nq, D] queries at positions qpos (real, in
    order); k, v: per KV head h, [L_h, D] keys / values at positions kpos[h] (in order).
    F_s[j] = sum over the last r queries p of SGsoftmax(row p)[j] (Eq. 5), over the keys at
    positions <= p; Eq. 15: F^_s = gamma_bar * F_s. -> per KV head a list over its keys."""
    H, G, D = len(k), q.shape[0] // len(k), q.shape[-1]
    rows = range(max(0, len(qpos) - s.window), len(qpos))
    out = []
    for h in range(H):
        per_head = []
        for g in range(G):
            F = [0.0] * len(kpos[h])
            for p in rows:
                i = qpos[p] + 1 if s.prefill_i == "row" else n_now
                seen = [j for j, kp in enumerate(kpos[h]) if kp <= qpos[p]]
                probs = lit_softmax(q[h * G + g, p], k[h][seen], lit_scale(i, lit_budget_k(s, budget), D, s.reading))
                for j, pr in zip(seen, probs):
                    F[j] += pr
            per_head.append(F)
        prior = lit_prior(v[h], s.kernel)
        out.append([a * b for a, b in zip(prior, lit_combine(per_head, s.gqa))])
    return out


def lit_prompt_scores(s: AhaKV, q, k, v, budget):
    """One batch row's real tokens (positions 0 .. m-1): q [Hq, m, D], k, v [H, m, D]."""
    m = q.shape[1]
    return lit_window_scores(s, q, list(k), list(v), list(range(m)), [list(range(m))] * k.shape[0],
                             budget, m)


def lit_pooled(s: AhaKV, F, positions):
    """The eviction score: F (a list in position order) pooled by ``score_pool`` over the
    tokens outside the B_r newest (the errata of seed-002); F itself when score_pool is None."""
    if s.score_pool is None:
        return list(F)
    live = outside_window(positions, s.recent)
    x = torch.tensor(F, dtype=torch.float64)
    return literal_pool(x, s.score_pool.kernel, s.score_pool.mode, live).tolist()


def lit_keep(s: AhaKV, entries, budget):
    """Alg. 1 lines 12 / 30: the recent B_r tokens (and the sinks) plus the TopK of the rest
    by (pooled) score (ties to the lower position). entries: dicts with pos and F, in position
    order."""
    last = max(e["pos"] for e in entries)
    pooled = lit_pooled(s, [e["F"] for e in entries], [e["pos"] for e in entries])
    for e, x in zip(entries, pooled):
        e["S"] = x
    prot = [e for e in entries if e["pos"] > last - s.recent or e["pos"] < s.sinks]
    rest = sorted((e for e in entries if not any(e is p for p in prot)), key=lambda e: (-e["S"], e["pos"]))
    keep = prot + rest[:max(budget - len(prot), 0)]
    return sorted(keep, key=lambda e: e["pos"])


class LiteralAhaKV:
    """Algorithm 1 for one batch row, every KV head its own token list."""

    def __init__(self, s: AhaKV, q, k, v, budget):
        self.s, self.budget, self.n = s, budget, q.shape[1]
        self.last = self.n - 1
        self.G, self.D = q.shape[0] // k.shape[0], q.shape[-1]
        scores = lit_prompt_scores(s, q, k, v, budget)
        self.heads = []
        for h in range(k.shape[0]):
            entries = [dict(pos=j, k=k[h, j], v=v[h, j], F=scores[h][j]) for j in range(self.n)]
            self.heads.append(lit_keep(s, entries, budget))             # F_0 = F^_s (line 19)

    def step(self, q, k, v):
        """One generated token: q [Hq, D], k, v [H, D] (lines 23-30)."""
        s = self.s
        self.last += 1
        pos = self.last                                                  # the new token's position
        for h, kept in enumerate(self.heads):
            cache = kept + [dict(pos=pos, k=k[h], v=v[h], F=0.0)]      # K^t = (K^{t-1}, W^K Z)
            i = {"prefill": self.n, "position": pos + 1, "cache": len(cache)}[s.decode_i]
            scale = lit_scale(i, lit_budget_k(s, self.budget), self.D, s.reading)
            K = torch.stack([e["k"] for e in cache])
            inc = lit_combine([lit_softmax(q[h * self.G + g], K, scale) for g in range(self.G)], s.gqa)
            if s.decode_prior:
                prior = lit_prior(torch.stack([e["v"] for e in cache]), s.kernel)
                inc = [a * b for a, b in zip(inc, prior)]
            for e, x in zip(cache, inc):
                e["F"] = e["F"] + x                                      # F_t = SGsoftmax(A) + F_{t-1}
            self.heads[h] = lit_keep(s, cache, self.budget)


# --------------------------------------------------------------------------- helpers

def random_prompt(seed, B, H, G, n, lens=None, D=8, budget=10):
    """A random left-padded prompt (HF's convention: padding first, position 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, n, D, generator=gen) * 1.5
    k = torch.randn(B, H, n, D, generator=gen)
    v = torch.randn(B, H, n, D, generator=gen) * (1 + torch.rand(B, H, n, 1, generator=gen))
    lens = torch.tensor(lens if lens is not None else [n] * B)
    valid = torch.arange(n) >= (n - lens)[:, None]
    pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
    return PromptView(q=q, k=k, v=v, pos=pos, valid=valid, scale=1 / math.sqrt(D), layer_idx=0,
                      num_layers=1, budget=torch.full((B,), budget))


def real(p: PromptView, b):
    idx = torch.nonzero(p.valid[b]).flatten()
    return p.q[b][:, idx].double(), p.k[b][:, idx].double(), p.v[b][:, idx].double()


def kept_state(state):
    """Per (row, head): {position: F} of the cached tokens."""
    parts = state.kv.view(None, False)
    B, H, _ = parts["pos"].shape
    return [[{int(p): float(c) for p, c, m in zip(parts["pos"][b, h], parts["channels"][b, h, :, 0],
                                                  parts["mask"][b, h]) if m}
             for h in range(H)] for b in range(B)]


def assert_same(got, lit, where):
    """got {pos: F} against the literal head's entries."""
    assert sorted(got) == [e["pos"] for e in lit], where
    want = torch.tensor([e["F"] for e in lit], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor([got[e["pos"]] for e in lit], dtype=torch.float64), want,
                               **TOL, msg=where)


VARIANTS = [
    AhaKV(recent=4, kernel=3),
    AhaKV(recent=3, kernel=3, score_pool=None),                   # before the errata: F^ unpooled
    AhaKV(recent=3, kernel=3, score_pool=Pooling(5, "avg")),
    AhaKV(recent=3, rows=6, kernel=5, gqa="sum"),
    AhaKV(recent=4, kernel=1, reading="literal", gqa="max"),
    AhaKV(recent=2, kernel=7, prefill_i="prompt", budget_k="selected"),
    AhaKV(recent=4, kernel=3, sinks=1),
]
LAYOUTS = [(2, 3), (1, 4), (3, 1)]     # (KV heads, query heads per KV head): GQA, MQA, MHA


# --------------------------------------------------------------------------- 1. literal agreement

@pytest.mark.parametrize("scorer", VARIANTS, ids=repr)
@pytest.mark.parametrize("seed", [0, 1])
def test_prompt_scores_follow_the_equations(scorer, seed):
    for H, G in LAYOUTS:
        p = random_prompt(seed, 3, H, G, 24, lens=[24, 17, 9], budget=8)
        scores, channels = scorer.prompt_scores(p)
        if scorer.score_pool is None:
            assert torch.equal(channels[..., 0], scores)
        for b in range(3):
            F_hat = lit_prompt_scores(scorer, *real(p, b), 8)          # per head, the channel F_0
            positions = p.pos[b, p.valid[b]].tolist()
            torch.testing.assert_close(channels[b][:, p.valid[b], 0].double(),
                                       torch.tensor(F_hat, dtype=torch.float64), **TOL)
            want = torch.tensor([lit_pooled(scorer, F, positions) for F in F_hat], dtype=torch.float64)
            torch.testing.assert_close(scores[b][:, p.valid[b]].double(), want, **TOL)
        assert torch.isfinite(scores).all()


DECODE_VARIANTS = [
    AhaKV(recent=3, kernel=3),                                            # the spec's defaults
    AhaKV(recent=3, kernel=3, score_pool=None),
    AhaKV(recent=3, kernel=5, decode_i="position", gqa="sum"),
    AhaKV(recent=2, rows=4, kernel=3, decode_i="cache", reading="literal", sinks=1),
    AhaKV(recent=3, kernel=3, decode_prior=True, gqa="max", budget_k="selected", prefill_i="prompt"),
]


@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
@pytest.mark.parametrize("scorer", DECODE_VARIANTS, ids=repr)
def test_algorithm_1_prefill_and_decode_steps(storage, scorer):
    """The engine (one-shot compression, then a decode step with an eviction every step)
    keeps, head by head and step by step, Algorithm 1's tokens with Algorithm 1's F."""
    B, budget, steps, n = 2, 9, 6, 20
    for seed, (H, G) in enumerate(LAYOUTS[:2]):
        p = random_prompt(seed + 10, B, H, G, n, lens=[20, 14], D=8, budget=budget)
        state = LayerState(0, 1, Policy(scorer, budget=budget, schedule=EveryStep()), storage)
        state.ensure_storage(p.q, p.k)
        compress_prompt(state, p.q, p.k, p.v, p.pos, p.valid, p.scale)
        lit = [LiteralAhaKV(scorer, *real(p, b), budget) for b in range(B)]
        gen = torch.Generator().manual_seed(seed)
        for t in range(steps + 1):
            got = kept_state(state)
            for b in range(B):
                for h in range(H):
                    assert_same(got[b][h], lit[b].heads[h], f"step {t}, row {b}, head {h}")
            if t == steps:
                break
            q = torch.randn(B, H * G, 1, 8, generator=gen) * 1.5
            k = torch.randn(B, H, 1, 8, generator=gen)
            v = torch.randn(B, H, 1, 8, generator=gen)
            decode(state, q, k, v, state.last_pos[:, None] + 1, None, p.scale)
            state.finish_decode_step()
            for b in range(B):
                lit[b].step(q[b, :, 0].double(), k[b, :, 0].double(), v[b, :, 0].double())
        assert (state.kv.lens <= budget).all()


def test_a_block_over_the_cache_rescores_from_its_last_queries():
    """update_view with several queries (block-wise prefill): lines 6-10 with the cache as the
    sequence (each head's own tokens) and the block's last r real queries. Per row: with one
    real query, line 27's decode update; with none, the scores stay."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, D, span = 4, 2, 3, 8, 30
    hold = torch.rand(B, H, span, generator=gen) < 0.6
    hold[..., -6:] = True                                     # the block's tokens are cached
    pos, mask = held_layout(hold)
    lens, L = mask.sum(dim=-1), pos.shape[-1]
    k = torch.randn(B, H, L, D, generator=gen) * mask[..., None]
    v = torch.randn(B, H, L, D, generator=gen) * mask[..., None]
    old = torch.rand(B, H, L, 1, generator=gen) * mask[..., None]
    q = torch.randn(B, H * G, 6, D, generator=gen)
    q_pos = torch.arange(span - 6, span).expand(B, 6).clone()
    q_pos[1, :2] = -1                                         # row 1: 4 real queries
    q_pos[2, :] = -1                                          # row 2 sits this block out
    q_pos[3, :5] = -1                                         # row 3: one real query
    budget = torch.full((B,), 7)
    for scorer in [AhaKV(recent=4, kernel=3), AhaKV(recent=2, rows=5, kernel=5, gqa="max", reading="literal")]:
        view = CacheView(pos=pos, mask=mask, channels=old, last_pos=torch.full((B,), span - 1), layer_idx=0,
                         num_layers=1, groups=G, k=k, v=v, budget=budget, q=q, q_pos=q_pos, scale=0.3)
        new = scorer.update_view(view)[..., 0]
        for b in range(B):
            real_q = [j for j in range(6) if q_pos[b, j] >= 0]
            for h in range(H):
                m = int(lens[b, h])
                if not real_q:
                    want = old[b, h, :m, 0].double()
                elif len(real_q) == 1:                       # F_t = SGsoftmax(A) + F_{t-1}, i = span
                    scale = lit_scale(span, 7, D, scorer.reading)
                    inc = lit_combine([lit_softmax(q[b, h * G + g, real_q[0]].double(), k[b, h, :m].double(),
                                                   scale) for g in range(G)], scorer.gqa)
                    want = old[b, h, :m, 0].double() + torch.tensor(inc, dtype=torch.float64)
                else:
                    kpos = [pos[b, h, :m].tolist()]
                    scores = lit_window_scores(scorer, q[b][h * G:(h + 1) * G][:, real_q].double(),
                                               [k[b, h, :m].double()], [v[b, h, :m].double()],
                                               q_pos[b, real_q].tolist(), kpos, 7, span)
                    want = torch.tensor(scores[0], dtype=torch.float64)
                torch.testing.assert_close(new[b, h, :m].double(), want, **TOL)
                assert (new[b, h, m:] == 0).all()


# --------------------------------------------------------------------------- 2. hand-checked cases

def test_lambda_by_hand():
    # seed-002 §3.2 table: i/k = 2, 4, 8, 16 at d = 128; i/k = 8 at d = 256.
    for ratio, d, lam in [(2, 128, 0.1041), (4, 128, 0.1472), (8, 128, 0.1803), (16, 128, 0.2081),
                          (8, 256, 0.1275)]:
        assert float(sg_lambda(1000 * ratio, 1000, d)) == pytest.approx(lam, abs=1e-4)
    assert float(sg_lambda(2000, 1000, 128)) == pytest.approx(math.sqrt(2 * math.log(2) / 128), rel=1e-12)
    # i/k = e^(1/2): lam = 1/sqrt(d), the standard softmax scale.
    assert float(sg_lambda(1000 * math.exp(0.5), 1000, 64)) == pytest.approx(1 / 8, rel=1e-12)
    # i <= k: no real lam; 0 (uniform scores), never NaN.
    assert float(sg_lambda(1000, 1000, 128)) == 0.0 and float(sg_lambda(10, 1000, 128)) == 0.0
    # The two readings: the factor on the raw q . k.
    i, k, d = 4000, 1000, 128
    lam = math.sqrt(2 * math.log(4) / 128)
    assert float(AhaKV().logit_scale(i, k, d)) == pytest.approx(lam, rel=1e-12)
    assert float(AhaKV(reading="literal").logit_scale(i, k, d)) == pytest.approx(lam / math.sqrt(128), rel=1e-12)
    # k = B or B_s = B - B_r.
    assert AhaKV(recent=32).budget_tokens(torch.tensor([1000])).item() == 1000
    assert AhaKV(recent=32, budget_k="selected").budget_tokens(torch.tensor([1000])).item() == 968


def test_value_prior_by_hand():
    """||V||^2 = 1, 4, 9, 16, 0 with kernel 3: gamma = 5/2, 14/3, 29/3, 25/3, 16/2 (the ends
    average over the two tokens that exist), max 29/3."""
    v = torch.tensor([[1.0, 0], [0, 2], [3, 0], [0, 4], [0, 0]])
    want = torch.tensor([7.5 / 29, 14 / 29, 1.0, 25 / 29, 24 / 29])
    got = AhaKV(kernel=3).value_prior(v[None, None], torch.ones(1, 1, 5, dtype=torch.bool))
    torch.testing.assert_close(got[0, 0], want)
    # Left padding (large values) counts neither in the mean nor in the max.
    padded = torch.cat([torch.full((2, 2), 100.0), v])
    mask = torch.arange(7) >= 2
    got = AhaKV(kernel=3).value_prior(padded[None, None], mask[None, None])
    torch.testing.assert_close(got[0, 0, 2:], want)
    assert (got[0, 0, :2] == 0).all()
    # kernel 1: the raw norms over their max.
    got = AhaKV(kernel=1).value_prior(v[None, None], torch.ones(1, 1, 5, dtype=torch.bool))
    torch.testing.assert_close(got[0, 0], torch.tensor([1, 4, 9, 16, 0]) / 16)


def test_recent_accumulation_counts_only_the_last_rows():
    """Zero queries: every SG-softmax row is uniform, row p gives 1/(p+1) to each token it sees.
    With r = 2 of n = 6 and equal value norms: F = 1/5 + 1/6 for tokens 0..4, 1/6 for token 5
    (H2O's sum over all rows would be 1 + 1/2 + ... for token 0)."""
    n = 6
    p = random_prompt(0, 1, 1, 2, n, budget=3)
    p.q.zero_()
    p.v.copy_(torch.ones_like(p.v))
    s = AhaKV(recent=2, kernel=3)
    scores, _ = s.prompt_scores(p)
    torch.testing.assert_close(scores[0, 0], torch.tensor([11 / 30] * 5 + [1 / 6]))
    # Queries outside the window change nothing; a window query does.
    p.q[:, :, :n - 2] = torch.randn(1, 2, n - 2, 8) * 5
    torch.testing.assert_close(s.prompt_scores(p)[0], scores)
    p.q[:, :, n - 1] = torch.randn(1, 2, 8) * 5
    assert not torch.allclose(s.prompt_scores(p)[0], scores)
    # rows=3: one more row, 1/4 more for tokens 0..3.
    p.q.zero_()
    torch.testing.assert_close(AhaKV(recent=2, rows=3, kernel=3).prompt_scores(p)[0][0, 0],
                               torch.tensor([1 / 4 + 11 / 30] * 4 + [11 / 30, 1 / 6]))


def test_parameters_are_checked_and_the_window_is_protected():
    assert AhaKV().default_protection() == Protection(recent=32)
    assert AhaKV(recent=8, sinks=2).default_protection() == Protection(sinks=2, recent=8)
    assert AhaKV().window == 32 and AhaKV(recent=8, rows=4).window == 4
    for bad in [dict(kernel=4), dict(kernel=0), dict(reading="x"), dict(budget_k="x"), dict(prefill_i="x"),
                dict(decode_i="x"), dict(gqa="x"), dict(recent=0), dict(recent=-1)]:
        with pytest.raises(ValueError):
            AhaKV(**bad)
    AhaKV(recent=0, rows=4)
    with pytest.raises(ValueError, match="protected"):
        Policy(AhaKV(), budget=32)


# --------------------------------------------------------------------------- 3. on a model

def kept_positions(cache, layer):
    parts = cache.layer_kv(layer).view(None, False)
    return parts["pos"].masked_fill(~parts["mask"], -1)


@pytest.mark.parametrize("schedule", [OneShot(), EveryStep(), BlockwisePrefill(16)], ids=repr)
@pytest.mark.parametrize("allocation", [Uniform(), AdaKV(), AdaKV(layers=Pyramid(beta=4))], ids=repr)
def test_ragged_path_equals_reference_path(schedule, allocation):
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, mask = inputs(batch=2, length=60, pad=(0, 7))
    policy = Policy(AhaKV(recent=4, kernel=3), budget=20, allocation=allocation, schedule=schedule)
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=8)
        expected = teacher_forced(model, reference, ids, mask, steps=8)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for layer in range(3):   # the same tokens per head, and the ragged store holds only them
        assert torch.equal(kept_positions(ragged, layer), kept_positions(reference, layer))
        assert ragged.layer_kv(layer).store.num_tokens == int(ragged.layer_kv(layer).lens.sum())
    if schedule.decode_every == 1 and isinstance(allocation, Uniform):
        assert all(int(lens.max()) == 20 for lens in ragged.kept_tokens())   # held at the budget


@pytest.mark.parametrize("scorer", [AhaKV(recent=4, kernel=3, reading="literal", decode_i="cache"),
                                    AhaKV(recent=3, kernel=5, decode_i="position", decode_prior=True,
                                          gqa="max", sinks=1)], ids=repr)
def test_options_on_a_model_match_the_reference(scorer):
    model = tiny_model("qwen2", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=50, pad=(5, 0))
    policy = Policy(scorer, budget=16, schedule=EveryStep(prefill_block=8))
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced(model, ragged, ids, mask, steps=6)
        expected = teacher_forced(model, reference, ids, mask, steps=6)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for layer in range(2):
        assert torch.equal(kept_positions(ragged, layer), kept_positions(reference, layer))


@pytest.mark.parametrize("schedule", [EveryStep(), BlockwisePrefill(1, decode_every=1),
                                      BlockwisePrefill(4, decode_every=1)], ids=repr)
def test_left_padded_batch_gives_each_row_its_own_result(schedule):
    """Logits and every layer's kept tokens and scores of a left-padded row are those of the
    row alone. The shorter row's last block has one real token (21 = 4 * 5 + 1), and with
    blocks of one token it sits the last blocks out."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    lengths = [30, 21]
    ids, mask = inputs(batch=2, length=30, pad=[30 - n for n in lengths])
    fed = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(2))
    policy = Policy(AhaKV(recent=2, kernel=3), budget=10, schedule=schedule)
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        batched = teacher_forced(model, cache, ids, mask, fed=fed)
        for row, n in enumerate(lengths):
            alone_cache = handle.new_cache()
            alone = teacher_forced(model, alone_cache, ids[row:row + 1, 30 - n:], mask[row:row + 1, 30 - n:],
                                   fed=fed[row:row + 1])
            torch.testing.assert_close(batched[row:row + 1], alone, atol=1e-4, rtol=1e-4)
            for layer in range(2):
                got, want = cache.layer_kv(layer).view(None, False), alone_cache.layer_kv(layer).view(None, False)
                for h in range(2):
                    g, w = got["mask"][row, h], want["mask"][0, h]
                    assert got["pos"][row, h][g].tolist() == want["pos"][0, h][w].tolist()
                    torch.testing.assert_close(got["channels"][row, h][g], want["channels"][0, h][w],
                                               atol=1e-5, rtol=1e-4)


def test_ahakv_and_h2o_keep_different_tokens():
    """Recent accumulation removes H2O's pull toward early positions (seed-002 §2.2)."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = inputs(length=80)
    kept = {}
    for name, scorer in [("aha", AhaKV(recent=4, kernel=3)), ("h2o", H2O(recent=4))]:
        with kvcache_ext.patch(model, Policy(scorer, budget=20)) as handle:
            cache = handle.new_cache()
            teacher_forced(model, cache, ids, mask, steps=0)
            kept[name] = kept_positions(cache, 1)
    assert not torch.equal(kept["aha"], kept["h2o"])
    assert kept["aha"].float().mean() > kept["h2o"].float().mean()
