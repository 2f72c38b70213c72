"""RoCo and its ScissorHands baseline (research/seed-003-roco.md §2-3, labels R1-R10 there).

- The engine driven on one layer (block-wise evict-and-encode, one-shot prefill, per-step decode
  eviction) keeps exactly the tokens of a literal, loop-by-loop implementation of the paper's
  formulas: explicit softmax rows in float64, GQA rows averaged over the group, Acc / Acc^2 /
  Count per token, MAS, population Std, the scope without the top-r Std, evict the lowest MAS.
- Hand-checked values: population std, constant attention, fresh tokens, the scope, ties.
- ScissorHands' AQAS: prompts against a literal count, and the engine (block-wise, one-shot,
  per-step decode) against a literal evict-and-encode, as for RoCo.
- Patched tiny models: the ragged path gives the reference path's logits and token counts.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvcache_ext.engine.blocks import attend_in_blocks
from kvcache_ext.engine.decode import decode
from kvcache_ext.engine.prompt import compress_prompt
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.policies import (AdaKV, BlockwisePrefill, CacheView, EveryNSteps, EveryStep, OneShot,
                                  Policy, PromptView, Pyramid, RoCo, Schedule, ScissorHands, Uniform)
from kvcache_ext.reference.masked_cache import MaskedLayerKV
from test_patch import assert_paths_agree, inputs, teacher_forced
from tiny_models import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- literal RoCo

class Ambiguous(Exception):
    """A decision of the literal run is too close to a tie for float32 to be sure of it."""


def literal_softmax_row(q, keys, scale):
    """float64 softmax of one query over explicit keys."""
    logits = [float(q @ kj) * scale for kj in keys]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def run_literal_schedule(cache, attend, evict, budget, prompt_len, block, steps, decode_evict):
    """The engine's order, token by token: append (a block, or the whole prompt at once),
    attend, evict to the budget; then decode steps. Returns the kept positions."""
    if block is None:
        cache.extend(range(prompt_len))
        attend(range(prompt_len))
        evict(budget)
    else:
        for i in range(0, prompt_len, block):
            new = list(range(i, min(i + block, prompt_len)))
            cache.extend(new)
            attend(new)
            evict(budget)
    for t in range(prompt_len, prompt_len + steps):
        cache.append(t)
        attend([t])
        if decode_evict:
            evict(budget)
    return sorted(cache)


def literal_roco_head(qs, ks, scale, budget, robust, prompt_len, block, steps, decode_evict):
    """One KV head of one row, the paper's RoCo with the engine's order (append, attend, evict).

    qs: [G, T, D] float64, the group's query heads; ks: [T, D]; tokens 0 .. T-1 are the row's
    real tokens (prompt then decode). ``block`` None: one dense pass over the prompt, then one
    eviction. Returns the positions kept at the end."""
    G = qs.shape[0]
    cache, acc, acc_sq, count = [], {}, {}, {}

    def attend(queries):
        for t in queries:
            keys = [j for j in cache if j <= t]
            rows = [literal_softmax_row(qs[g, t], [ks[j] for j in keys], scale) for g in range(G)]
            for i, j in enumerate(keys):
                a = sum(row[i] for row in rows) / G           # GQA: the group's average
                acc[j] = acc.get(j, 0.0) + a                   # R1
                acc_sq[j] = acc_sq.get(j, 0.0) + a * a         # R2
                count[j] = count.get(j, 0) + 1                 # R3 (its own query included)

    def evict(B):
        n = len(cache)
        if n <= B:
            return
        mas = {j: acc[j] / count[j] for j in cache}                              # R4
        var = {j: acc_sq[j] / count[j] - mas[j] ** 2 for j in cache}
        std = {j: math.sqrt(max(var[j], 0.0)) for j in cache}                    # R5
        second = {j: acc_sq[j] / count[j] for j in cache}
        r = math.floor(robust * B)
        by_std = sorted(cache, key=lambda j: (-std[j], j))                       # ties: lower position
        if 0 < r < n:
            a, b = by_std[r - 1], by_std[r]
            exact_tie = count[a] == 1 and count[b] == 1                          # both exactly 0
            if not exact_tie and abs(var[a] - var[b]) <= 1e-4 * max(second[a], second[b]) + 1e-12:
                raise Ambiguous
        scope = [j for j in cache if j not in set(by_std[:r])]                   # R6
        by_mas = sorted(scope, key=lambda j: (mas[j], -j))                       # R7, ties: keep lower
        k = n - B
        if k < len(by_mas) and abs(mas[by_mas[k]] - mas[by_mas[k - 1]]) <= 1e-5 * mas[by_mas[k]] + 1e-9:
            raise Ambiguous
        for j in by_mas[:k]:
            cache.remove(j)
            del acc[j], acc_sq[j], count[j]

    return run_literal_schedule(cache, attend, evict, budget, prompt_len, block, steps, decode_evict)


def random_layer(seed, B, H, G, n, steps, D=8):
    """Random q/k/v of a left-padded prompt of n columns plus `steps` decode tokens per row."""
    gen = torch.Generator().manual_seed(seed)
    T = n + steps
    q = torch.randn(B, H * G, T, D, generator=gen) * 1.5
    k = torch.randn(B, H, T, D, generator=gen)
    v = torch.randn(B, H, T, D, generator=gen)
    lens = torch.randint(max(2, n // 2), n + 1, (B,), generator=gen)
    lens[0] = n
    valid = torch.arange(n) >= (n - lens)[:, None]
    pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
    return q, k, v, lens, valid, pos


def library_kept(policy, storage, q, k, v, lens, valid, pos, n, steps, scale):
    """The engine on one layer: prefill (one-shot or block-wise), then decode tokens one by one."""
    B = q.shape[0]
    state = LayerState(0, 1, policy, storage)
    state.ensure_storage(q, k)
    qp, kp, vp = q[:, :, :n], k[:, :, :n], v[:, :, :n]
    if policy.schedule.prefill_block is None:
        compress_prompt(state, qp, kp, vp, pos, valid, scale)
    else:
        state.ensure_budget(lens)
        attend_in_blocks(state, qp, kp, vp, pos, valid, scale, policy.schedule.prefill_block)
    for t in range(steps):
        i = n + t
        decode(state, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], (lens + t)[:, None], None, scale)
        state.finish_decode_step()
    parts = state.kv.view(None, False)
    H = k.shape[1]
    return [[sorted(parts["pos"][b, h][parts["mask"][b, h]].tolist()) for h in range(H)] for b in range(B)]


CASES = [  # (block, decode eviction, budget or ratio, robust, H, G)
    (1, False, 10, 0.5, 2, 2),       # the paper's token-wise evict-and-encode
    (3, True, 9, 0.5, 1, 4),
    (8, True, 12, 0.5, 2, 1),
    (5, False, 0.4, 0.5, 2, 2),      # budget per row from a ratio: r differs per row
    (4, True, 11, 0.25, 3, 2),
    (2, True, 8, 1.0, 1, 1),
    (6, True, 10, 0.0, 2, 2),        # r = 0: pure MAS
    (None, True, 10, 0.5, 2, 2),     # one-shot prefill (seeded from the dense prompt), then per step
    (None, False, 0.5, 0.5, 2, 4),
    (None, True, 7, 0.75, 1, 3),
]


@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
@pytest.mark.parametrize("block,decode,size,robust,H,G", CASES)
def test_engine_keeps_the_literal_roco_tokens(storage, block, decode, size, robust, H, G):
    check_literal_kept(RoCo(robust=robust), storage, block, decode, size, H, G, seeds=8,
                       literal=lambda qs, ks, scale, budget, P, steps: literal_roco_head(
                           qs, ks, scale, budget, robust, P, block, steps, decode))


def check_literal_kept(scorer, storage, block, decode, size, H, G, seeds, literal):
    """Runs ``scorer`` under the schedule (prefill blocks of ``block``, eviction every decode
    step if ``decode``) at ``size`` (a budget, or a ratio of each row's prompt) on random layers
    of 2 rows, and checks each (seed, row, head)'s kept tokens against
    ``literal(qs, ks, scale, budget, prompt_len, steps)``; enough of them must be clear-cut."""
    n, steps, D = 30, 6, 8
    scale = 1 / math.sqrt(D)
    schedule = Schedule(prefill_block=block, decode_every=1 if decode else None)
    sizing = {"budget": size} if isinstance(size, int) else {"ratio": size}
    policy = Policy(scorer, schedule=schedule, **sizing)
    checked = 0
    for seed in range(seeds):
        q, k, v, lens, valid, pos = random_layer(seed, 2, H, G, n, steps, D)
        got = library_kept(policy, storage, q, k, v, lens, valid, pos, n, steps, scale)
        for b in range(2):
            real = torch.nonzero(valid[b]).flatten().tolist() + list(range(n, n + steps))
            P = int(lens[b])
            budget = size if isinstance(size, int) else math.ceil(P * size)
            for h in range(H):
                try:
                    want = literal(q[b, h * G:(h + 1) * G][:, real].double(), k[b, h][real].double(),
                                   scale, budget, P, steps)
                except Ambiguous:
                    continue
                assert got[b][h] == want, (seed, b, h)
                checked += 1
    assert checked >= 0.75 * seeds * 2 * H    # nearly every (seed, row, head) is clear-cut


def literal_roco_paper_order(qs, ks, scale, budget, robust, prompt_len, block, steps):
    """The paper's Fig. 1 order: when a block (or decode token) does not fit, evict first, then
    append and attend, so the cache never exceeds B. Ends with the eviction the next block of
    ``block`` tokens would make. Same statistics and R4-R7 as ``literal_roco_head``."""
    G = qs.shape[0]
    cache, acc, acc_sq, count = [], {}, {}, {}
    r = math.floor(robust * budget)

    def evict(k):
        if k <= 0:
            return
        mas = {j: acc[j] / count[j] for j in cache}
        std = {j: math.sqrt(max(acc_sq[j] / count[j] - mas[j] ** 2, 0.0)) for j in cache}
        out = set(sorted(cache, key=lambda j: (-std[j], j))[:r])
        for j in sorted([j for j in cache if j not in out], key=lambda j: (mas[j], -j))[:k]:
            cache.remove(j)

    def step(new):
        evict(len(cache) + len(new) - budget)
        cache.extend(new)
        for t in new:
            keys = [j for j in cache if j <= t]
            rows = [literal_softmax_row(qs[g, t], [ks[j] for j in keys], scale) for g in range(G)]
            for i, j in enumerate(keys):
                a = sum(row[i] for row in rows) / G
                acc[j], acc_sq[j], count[j] = acc.get(j, 0.0) + a, acc_sq.get(j, 0.0) + a * a, count.get(j, 0) + 1

    for i in range(0, prompt_len, block):
        step(list(range(i, i + block)))
    for t in range(prompt_len, prompt_len + steps):
        step([t])
    evict(len(cache) + block - budget)
    return sorted(cache)


@pytest.mark.parametrize("block,budget,robust,steps,H,G,short", [
    (1, 9, 0.5, 5, 2, 2, 8),      # token-wise, then per-step decode eviction
    (4, 12, 0.5, 0, 2, 2, 8), (4, 12, 0.25, 0, 1, 4, 8)])
def test_paper_order_is_the_engine_at_budget_minus_block(block, budget, robust, steps, H, G, short):
    """Evict-then-append at budget B (paper Fig. 1) = append-then-evict at B - b with the same r."""
    n, D = 28, 8
    scale = 1 / math.sqrt(D)
    r = math.floor(robust * budget)
    engine_robust = r / (budget - block)
    assert math.floor(engine_robust * (budget - block)) == r
    policy = Policy(RoCo(robust=engine_robust), budget=budget - block,
                    schedule=Schedule(prefill_block=block, decode_every=1 if steps else None))
    checked = 0
    for seed in range(4):
        q, k, v, lens, valid, pos = random_layer(seed, 2, H, G, n, steps, D)
        lens = torch.tensor([n, n - short])              # whole blocks only
        valid = torch.arange(n) >= (n - lens)[:, None]
        pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
        got = library_kept(policy, RaggedLayerKV, q, k, v, lens, valid, pos, n, steps, scale)
        for b in range(2):
            real = torch.nonzero(valid[b]).flatten().tolist() + list(range(n, n + steps))
            for h in range(H):
                args = (q[b, h * G:(h + 1) * G][:, real].double(), k[b, h][real].double(), scale)
                try:   # the append-then-evict literal at B - b flags near-ties
                    literal_roco_head(*args, budget - block, engine_robust, int(lens[b]), block, steps,
                                      steps > 0)
                except Ambiguous:
                    continue
                assert got[b][h] == literal_roco_paper_order(*args, budget, robust, int(lens[b]), block,
                                                             steps), (seed, b, h)
                checked += 1
    assert checked >= 0.75 * 4 * 2 * H


def test_one_token_blocks_do_not_count_a_resting_rows_padding_query():
    """BlockwisePrefill(1), left padding: while the shorter row sits a block out, its (padding)
    query must see nothing, so that it adds nothing to the statistics (RoCo's Count here)."""
    n, D, G = 12, 8, 2
    q, k, v, _, _, _ = random_layer(0, 2, 1, G, n, 0, D)
    lens = torch.tensor([n, n - 4])
    valid = torch.arange(n) >= (n - lens)[:, None]
    pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
    policy = Policy(RoCo(), budget=64, schedule=BlockwisePrefill(1))
    state = LayerState(0, 1, policy, RaggedLayerKV)
    state.ensure_storage(q, k)
    state.ensure_budget(lens)
    attend_in_blocks(state, q, k, v, pos, valid, 1 / math.sqrt(D), 1)
    parts = state.kv.view(None, False)
    for b in range(2):   # Count = the row's queries at or after the token
        want = [float(int(lens[b]) - j) for j in range(int(lens[b]))]
        assert parts["channels"][b, 0, :int(lens[b]), 2].tolist() == want


# --------------------------------------------------------------------------- hand-checked RoCo

def view_of(channels, budget, groups=1, pos=None, mask=None):
    """A CacheView of channels [B, H, L, 3] in position order 0 .. L-1."""
    B, H, L, _ = channels.shape
    pos = torch.arange(L).expand(B, H, L) if pos is None else pos
    mask = torch.ones(B, H, L, dtype=torch.bool) if mask is None else mask
    last = pos.masked_fill(~mask, -1).amax(dim=(1, 2))
    return CacheView(pos=pos, mask=mask, channels=channels.float(), last_pos=last, layer_idx=0,
                     num_layers=1, groups=groups, budget=torch.as_tensor(budget).view(-1))


def channels_from(attn_lists, groups=1):
    """Per token, the group-averaged probabilities it received -> [1, 1, L, 3] as the kernel fills
    them (channel 0 sums the G heads, so G times the average)."""
    rows = [[groups * sum(a), sum(x * x for x in a), len(a)] for a in attn_lists]
    return torch.tensor(rows, dtype=torch.float64)[None, None]


def test_mas_and_population_std_hand_checked():
    ch = channels_from([[0.2, 0.4], [0.25] * 4, [0.7], [0.1, 0.3, 0.5], [0.0, 0.0]])
    mas, std = RoCo.mas_std(ch, 1)
    torch.testing.assert_close(mas[0, 0], torch.tensor([0.3, 0.25, 0.7, 0.3, 0.0], dtype=torch.float64))
    # Population std: sqrt(E[a^2] - E[a]^2), not the sample std (0.1414 for [0.2, 0.4]).
    torch.testing.assert_close(std[0, 0], torch.tensor([0.1, 0.0, 0.0, math.sqrt(0.08 / 3), 0.0],
                                                       dtype=torch.float64))
    # GQA: channel 0 holds G times the group average; the result is the same.
    mas2, std2 = RoCo.mas_std(channels_from([[0.2, 0.4]], groups=4), 4)
    assert mas2.item() == pytest.approx(0.3) and std2.item() == pytest.approx(0.1)
    # A fresh token (Count = 1) has Std exactly 0, even when float32 sums of the group's heads
    # and of the squared average disagree in the last bit.
    noisy = torch.tensor([[[[2 * 0.3000001, 0.09, 1.0], [0.0, 0.0, 0.0]]]])
    _, std3 = RoCo.mas_std(noisy, 2)
    assert std3[0, 0].tolist() == [0.0, 0.0]


def test_scope_leaves_out_the_top_r_std():
    # Six tokens; budget 4, robust 0.5 -> r = 2: the two highest-Std tokens are out of scope.
    attn = [[0.9, 0.1], [0.3, 0.3, 0.3], [0.5, 0.1, 0.3], [0.05, 0.05], [0.6, 0.2], [0.4]]
    view = view_of(channels_from(attn), budget=4)
    scores = RoCo().cache_scores(view)[0, 0]
    mas = [sum(a) / len(a) for a in attn]
    # Std: 0.4, 0, 0.163, 0, 0.2, 0 -> tokens 0 and 4 are kept whatever their MAS.
    assert scores[0] == math.inf and scores[4] == math.inf
    for j in (1, 2, 3, 5):
        assert scores[j].item() == pytest.approx(mas[j])
    # Through the selection: keep the 2 out of scope and the 2 best MAS of the scope (5, 1).
    keep = torch.topk(scores, 4).indices.sort().values.tolist()
    assert keep == [0, 1, 4, 5]
    # r = 3 (robust 0.75): token 2 joins; r = 0: pure MAS.
    s = RoCo(robust=0.75).cache_scores(view)[0, 0]
    assert torch.isinf(s).nonzero().flatten().tolist() == [0, 2, 4]
    s = RoCo(robust=0.0).cache_scores(view)[0, 0]
    assert not torch.isinf(s).any()
    # robust 1.0 -> r = B = 4: the four highest Std (ties at 0 to the lower position: token 1).
    s = RoCo(robust=1.0).cache_scores(view)[0, 0]
    assert torch.isinf(s).nonzero().flatten().tolist() == [0, 1, 2, 4]


def test_std_ties_and_padding():
    # Every token fresh (Std 0): the r left out are the lowest positions; padding never counts.
    ch = channels_from([[0.1], [0.2], [0.3], [0.4]]).expand(1, 2, 4, 3).clone()
    pos = torch.tensor([[[3, 5, 6, 9], [5, 9, 0, 0]]])
    mask = torch.tensor([[[True] * 4, [True, True, False, False]]])
    s = RoCo().cache_scores(view_of(ch, budget=6, pos=pos, mask=mask))[0]   # r = 3
    assert torch.isinf(s[0]).tolist() == [True, True, True, False]
    assert torch.isinf(s[1]).tolist() == [True, True, False, False]


def test_per_row_budget_and_code_guards():
    attn = [[0.9, 0.1], [0.3, 0.2, 0.3], [0.5, 0.1, 0.3], [0.05, 0.25], [0.6, 0.2], [0.4], [0.7]]
    ch = channels_from(attn).expand(2, 1, 7, 3).clone()
    s = RoCo().cache_scores(view_of(ch, budget=[4, 6]))
    assert torch.isinf(s).sum(dim=-1).flatten().tolist() == [2, 3]   # r = floor(B / 2) per row
    assert RoCo(robust=0.3).robust_count(torch.tensor([10, 7, 1])).tolist() == [3, 2, 0]
    # The EasyKV guards: the `fresh` newest and the first `sinks` positions get Std = +inf and
    # take their places among the r. Here r = 3: positions 0 and 6, then the top Std, token 4
    # (Std 0.2; token 0's 0.4 is already in).
    s = RoCo(fresh=1, sinks=1).cache_scores(view_of(ch[:1], budget=6))[0, 0]
    assert torch.isinf(s).nonzero().flatten().tolist() == [0, 4, 6]


def test_update_folds_the_kernel_statistics():
    """RoCo's channels are the statistics its capabilities declare (mass, sum of squares,
    count), added in place by the storage after every attention over the cache."""
    from kvcache_ext.reference.masked_cache import MaskedLayerKV
    kv = MaskedLayerKV(1, 1, 4, torch.float32, torch.device("cpu"), 3)
    kv.append(torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), torch.arange(5)[None], None)
    stats = {"mass": torch.tensor([0.4, 0.2, 0.0, 1.0, 0.6]),
             "sum_sq": torch.tensor([0.04, 0.01, 0.0, 0.25, 0.09]),
             "count": torch.tensor([1, 1, 0, 2, 1], dtype=torch.int32)}
    for _ in range(2):
        kv.accumulate({name: value.view(1, 1, 5) for name, value in stats.items()}, RoCo().capabilities.accumulates)
    torch.testing.assert_close(kv.channels[0, 0], 2 * torch.stack([stats["mass"], stats["sum_sq"],
                                                                   stats["count"].float()], dim=-1))
    assert RoCo().capabilities.accumulates == ("mass", "sum_sq", "count") and RoCo().capabilities.channels == 3


def test_roco_prompt_channels_are_the_dense_statistics():
    """One-shot channels: G * Acc, Acc^2 (of group averages), Count per token (left-padded rows)."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, n, D = 2, 2, 3, 9, 4
    q, k = torch.randn(B, H * G, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, :3] = False
    pos = (torch.arange(n) - valid.logical_not().sum(1, keepdim=True)).masked_fill(~valid, 1)
    p = PromptView(q=q, k=k, v=k, pos=pos, valid=valid, scale=0.5, layer_idx=0, num_layers=1,
                   budget=torch.tensor([4, 4]), chunk=4)
    scores, ch = RoCo().prompt_scores(p)
    for b in range(B):
        real = torch.nonzero(valid[b]).flatten().tolist()
        for h in range(H):
            for jj, j in enumerate(real):
                a = []
                for tt, t in enumerate(real[jj:], start=jj):
                    rows = [literal_softmax_row(q[b, h * G + g, t].double(), k[b, h, real[:tt + 1]].double(), 0.5)
                            for g in range(G)]
                    a.append(sum(r_[jj] for r_ in rows) / G)
                want = [G * sum(a), sum(x * x for x in a), len(a)]
                torch.testing.assert_close(ch[b, h, j].double(), torch.tensor(want, dtype=torch.float64),
                                           rtol=1e-5, atol=1e-6)
        assert (ch[b, :, ~valid[b]] == 0).all()
        assert torch.isinf(scores[b][:, valid[b]]).sum(dim=-1).tolist() == [2, 2]


def test_roco_validation():
    for bad in [{"robust": -0.1}, {"robust": 1.5}, {"fresh": -1}, {"sinks": -2}]:
        with pytest.raises(ValueError):
            RoCo(**bad)
    view = view_of(channels_from([[0.1]]), budget=4)
    view.budget = None
    with pytest.raises(ValueError, match="budget"):
        RoCo().cache_scores(view)
    for schedule in [OneShot(), BlockwisePrefill(16), EveryStep(), EveryNSteps(3), BlockwisePrefill(1, 2)]:
        Policy(RoCo(), budget=8, schedule=schedule)        # every schedule is served


# --------------------------------------------------------------------------- ScissorHands

def literal_aqas(q, k, valid, pos, G, scale, inclusive):
    """AQAS(j) = sum over queries t of 1[group-averaged a_{t,j} > 1/n_t] per row and KV head (R10)."""
    B, H = k.shape[:2]
    out = []
    for b in range(B):
        real = torch.nonzero(valid[b]).flatten().tolist()
        per_head, margin = [], math.inf
        for h in range(H):
            counts = [0] * len(real)
            for tt, t in enumerate(real):
                rows = [literal_softmax_row(q[b, h * G + g, t].double(), k[b, h, real[:tt + 1]].double(), scale)
                        for g in range(G)]
                for jj in range(tt + 1):
                    a = sum(r_[jj] for r_ in rows) / G
                    mean = 1.0 / (tt + 1)
                    if tt > 0:   # the first query's only probability is exactly 1 = its mean
                        margin = min(margin, abs(a - mean))
                    counts[jj] += (a >= mean) if inclusive else (a > mean)
            per_head.append(counts)
        out.append((real, per_head, margin))
    return out


@pytest.mark.parametrize("inclusive", [False, True])
@pytest.mark.parametrize("H,G", [(1, 1), (2, 2), (2, 4), (1, 3)])
def test_scissorhands_prompt_scores_are_literal_aqas(H, G, inclusive):
    checked = 0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        B, n, D = 2, 14, 6
        q, k = torch.randn(B, H * G, n, D, generator=gen) * 1.5, torch.randn(B, H, n, D, generator=gen)
        lens = torch.tensor([n, n - 4])
        valid = torch.arange(n) >= (n - lens)[:, None]
        pos = (torch.arange(n) - (n - lens)[:, None]).masked_fill(~valid, 1)
        budget = torch.tensor([6, 7])
        p = PromptView(q=q, k=k, v=k, pos=pos, valid=valid, scale=1 / math.sqrt(D), layer_idx=0,
                       num_layers=1, budget=budget, chunk=5)
        scores, channels = ScissorHands(inclusive=inclusive).prompt_scores(p)
        for b, (real, counts, margin) in enumerate(literal_aqas(q, k, valid, pos, G, p.scale, inclusive)):
            if margin < 1e-6:
                continue
            r = int(budget[b]) // 2                        # r = floor(B / 2) newest: +inf
            m = len(real)
            for h in range(H):
                got = scores[b, h, real]
                assert torch.isinf(got[m - r:]).all() and not torch.isinf(got[:m - r]).any()
                assert got[:m - r].tolist() == counts[h][:m - r]
                assert channels[b, h, real, 0].tolist() == counts[h]
            checked += 1
    assert checked >= 6


def test_scissorhands_hand_checked():
    # Zero queries: every row is uniform, a_{t,j} = 1/n_t exactly, so nothing is strictly above
    # average (AQAS 0) and, counting ties, every query counts every key it sees (AQAS = n - j).
    n = 8
    p = PromptView(q=torch.zeros(1, 2, n, 4), k=torch.randn(1, 1, n, 4), v=torch.zeros(1, 1, n, 4),
                   pos=torch.arange(n)[None], valid=torch.ones(1, n, dtype=torch.bool), scale=1.0,
                   layer_idx=0, num_layers=1, budget=torch.tensor([5]))
    strict, _ = ScissorHands().prompt_scores(p)
    assert strict[0, 0].tolist() == [0.0] * 6 + [math.inf] * 2          # r = floor(5 / 2) = 2
    ties, _ = ScissorHands(inclusive=True).prompt_scores(p)
    assert ties[0, 0].tolist() == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, math.inf, math.inf]
    wide, _ = ScissorHands(window=1.0, inclusive=True).prompt_scores(p)
    assert wide[0, 0].tolist() == [8.0, 7.0, 6.0] + [math.inf] * 5


def test_scissorhands_validation_and_schedules():
    for schedule in [OneShot(), BlockwisePrefill(16), EveryStep(), EveryNSteps(2), BlockwisePrefill(1)]:
        Policy(ScissorHands(), budget=8, schedule=schedule)       # every schedule is served
    for bad in [-0.5, 1.2]:
        with pytest.raises(ValueError):
            ScissorHands(window=bad)
    s = ScissorHands()
    caps = s.capabilities
    assert caps.channels == 1 and caps.needs_kv and caps.needs_queries and caps.updates_from_view


def literal_scissorhands_head(qs, ks, scale, budget, window, inclusive, prompt_len, block, steps,
                              decode_evict):
    """One KV head of one row: AQAS (R10) over every query since a token was cached, the engine's
    order (append, attend, evict), the scope without the r newest positions, evict the lowest AQAS."""
    G = qs.shape[0]
    cache, aqas, newest = [], {}, [-1]

    def attend(queries):
        for t in queries:
            newest[0] = t
            keys = [j for j in cache if j <= t]
            rows = [literal_softmax_row(qs[g, t], [ks[j] for j in keys], scale) for g in range(G)]
            mean = 1.0 / len(keys)
            for i, j in enumerate(keys):
                a = sum(row[i] for row in rows) / G
                if len(keys) > 1 and abs(a - mean) < 1e-6:
                    raise Ambiguous
                aqas[j] = aqas.get(j, 0) + ((a >= mean) if inclusive else (a > mean))

    def evict(B):
        n = len(cache)
        if n <= B:
            return
        r = math.floor(window * B)
        scope = [j for j in cache if j <= newest[0] - r]                 # outside the local window
        for j in sorted(scope, key=lambda j: (aqas[j], -j))[:n - B]:     # ties: keep the lower
            cache.remove(j)

    return run_literal_schedule(cache, attend, evict, budget, prompt_len, block, steps, decode_evict)


SH_CASES = [  # (block, decode eviction, budget or ratio, window, inclusive, H, G)
    (1, False, 10, 0.5, False, 2, 2),
    (4, True, 11, 0.5, False, 2, 2),
    (8, True, 12, 0.25, True, 1, 4),
    (3, True, 0.4, 0.5, False, 2, 1),
    (5, True, 9, 0.0, False, 1, 3),
    (None, True, 10, 0.5, False, 2, 2),    # one-shot prefill, then per step
    (None, False, 0.5, 1.0, True, 2, 2),
]


@pytest.mark.parametrize("storage", [RaggedLayerKV, MaskedLayerKV], ids=["ragged", "masked"])
@pytest.mark.parametrize("block,decode,size,window,inclusive,H,G", SH_CASES)
def test_engine_keeps_the_literal_scissorhands_tokens(storage, block, decode, size, window, inclusive, H, G):
    check_literal_kept(ScissorHands(window=window, inclusive=inclusive), storage, block, decode, size, H, G,
                       seeds=6, literal=lambda qs, ks, scale, budget, P, steps: literal_scissorhands_head(
                           qs, ks, scale, budget, window, inclusive, P, block, steps, decode))


# --------------------------------------------------------------------------- patched models

MODEL_CASES = (
    [(RoCo(), a, s) for a, s in itertools.product([Uniform(), AdaKV()],
                                                   [OneShot(), BlockwisePrefill(16), EveryStep()])]
    + [(RoCo(), Pyramid(beta=4), EveryStep(prefill_block=8)),
       (RoCo(robust=0.25, fresh=2, sinks=1), AdaKV(layers=Pyramid(beta=4)), BlockwisePrefill(4, 1))]
    + [(ScissorHands(), a, s) for a, s in itertools.product([Uniform(), AdaKV()],
                                                           [OneShot(), BlockwisePrefill(16), EveryStep()])]
    + [(ScissorHands(), Pyramid(beta=4), EveryStep(prefill_block=8)),
       (ScissorHands(inclusive=True, window=0.25), AdaKV(alpha=1.0, layers=Pyramid(beta=4)),
        BlockwisePrefill(4, 1))]
)


@pytest.mark.parametrize("scorer,allocation,schedule", MODEL_CASES, ids=lambda x: repr(x).replace(" ", ""))
def test_ragged_path_equals_reference_path(scorer, allocation, schedule):
    policy = Policy(scorer, budget=20, allocation=allocation, schedule=schedule)
    ragged, got = assert_paths_agree(policy)
    if schedule.decode_every is not None and isinstance(allocation, Uniform):
        assert all(int(lens.max()) <= 20 for lens in ragged.kept_tokens())
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    full = teacher_forced(model, None, *inputs(batch=2, length=60, pad=(0, 7)), steps=8)
    assert not torch.allclose(got, full, atol=1e-3)                  # eviction changed the logits
