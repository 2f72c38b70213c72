"""Expected Attention: the ragged path equals the reference path under one-shot, block-wise and
decode-time schedules; the scores equal an independent implementation that builds the rotation
matrices of the model's RoPE explicitly; errors."""
import dataclasses
import itertools

import pytest
import torch

from kvcache_ext.evaluation.shared_prefill import record_prefill
from kvcache_ext.policies import (AdaKV, BlockwisePrefill, EveryNSteps, ExpectedAttention, ModelParts, OneShot,
                                  Policy, Uniform)
from test_patch import assert_paths_agree, inputs
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SCORERS = [ExpectedAttention(), ExpectedAttention(window=8, future=16, covariance=False, vnorm=False),
           ExpectedAttention(epsilon=0.01, sinks=0)]


@pytest.mark.parametrize("scorer,allocation,schedule",
                         list(itertools.product(SCORERS, [Uniform(), AdaKV()],
                                                [OneShot(), BlockwisePrefill(16), EveryNSteps(3, target=14)])),
                         ids=repr)
def test_ragged_path_equals_reference_path(scorer, allocation, schedule):
    assert_paths_agree(Policy(scorer, budget=20, allocation=allocation, schedule=schedule))


def rotation(cos, sin):
    """[D, D] matrix of RoPE at one position: x -> x * cos + rotate_half(x) * sin."""
    D = cos.shape[0]
    half = torch.zeros(D, D, dtype=torch.float64)
    half[:D // 2, D // 2:] = -torch.eye(D // 2)
    half[D // 2:, :D // 2] = torch.eye(D // 2)
    return torch.diag(cos) + torch.diag(sin) @ half


def independent(scorer, view, rope):
    """Scores [H, n] of row 0, one query head at a time, with explicit matrices in float64."""
    q, k, v, pos = view.q[0].double(), view.k[0].double(), view.v[0].double(), view.pos[0]
    Hq, n, D = q.shape
    H = k.shape[0]
    cos, sin = (t[0].double() for t in rope(view.q, pos[None]))
    used = [i for i in range(n) if pos[i] >= scorer.sinks][-(scorer.window or n):]
    ahead = torch.arange(int(pos.max()) + 1, int(pos.max()) + 1 + scorer.future)[None]
    cf, sf = (t[0].double() for t in rope(view.q, ahead))
    mean_rot = sum(rotation(cf[t], sf[t]) for t in range(scorer.future)) / scorer.future
    out = torch.zeros(H, n, dtype=torch.float64)
    for h in range(Hq):
        pre = torch.stack([torch.linalg.solve(rotation(cos[i], sin[i]), q[h, i]) for i in used])
        mu = pre.mean(dim=0)
        cov = (pre - mu).T @ (pre - mu) / len(used)
        mu_f, cov_f = mean_rot @ mu, mean_rot @ cov @ mean_rot.T
        kh = k[h // (Hq // H)]
        logits = view.scale * kh @ mu_f
        if scorer.covariance:
            logits = logits + 0.5 * view.scale ** 2 * torch.einsum("ld,de,le->l", kh, cov_f, kh)
        p = torch.softmax(logits, dim=0)
        if scorer.vnorm:
            p = (p + scorer.epsilon) * v[h // (Hq // H)].norm(dim=-1)
        out[h // (Hq // H)] += p / (Hq // H)
    return out


@pytest.mark.parametrize("scorer", SCORERS, ids=repr)
def test_scores_equal_an_independent_implementation(scorer):
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, _ = inputs(batch=1, length=40, seed=5)
    recorded = record_prefill(model, ids)
    for view in recorded.views:
        view = dataclasses.replace(view, model=recorded.model)
        got, _ = scorer.prompt_scores(view)
        torch.testing.assert_close(got[0].double(), independent(scorer, view, recorded.model.rotary),
                                   atol=1e-6, rtol=1e-4)


def test_errors_name_what_is_wrong():
    for kwargs, name in [({"window": 1}, "window"), ({"future": 0}, "future"), ({"covariance": 1}, "covariance"),
                         ({"epsilon": -1.0}, "epsilon"), ({"sinks": -1}, "sinks")]:
        with pytest.raises(ValueError, match=name):
            ExpectedAttention(**kwargs)
    model = tiny_model("llama")
    view = dataclasses.replace(record_prefill(model, inputs(length=20)[0]).views[0], model=ModelParts())
    with pytest.raises(RuntimeError, match="rotary"):
        ExpectedAttention().prompt_scores(view)   # not run through patch: no rotary embedding
