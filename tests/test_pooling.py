"""Pooling of scores along positions (kvcache_ext.policies.pooling), the Pooled wrapper, the one
softmax that scorers read, and each pooling scorer's ragged path against the reference path.

- ``Pooling`` against an independent, literal pooling (tests/literal.py) on ragged inputs:
  padding, a protected recent window, segments shorter than the kernel, empty segments;
- ``Pooled(base)`` pools the base's scores and leaves its state alone;
- the source: one softmax over keys for every scorer (views.py), no scorer calling another
  scorer's private method;
- SnapKV, AhaKV, K-VEC, CAOTE (shared and per-head) and Pooled scorers: the ragged path
  (compiled store) gives the reference path's logits and kept tokens, one-shot and block-wise,
  batch 2 with left padding, GQA.
"""
import pathlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache_ext.policies import (CAOTE, H2O, KVEC, TOVA, AhaKV, BlockwisePrefill, OneShot, Policy,
                                  Pooled, Pooling, RoCo, ScissorHands, SnapKV)
from kvcache_ext.policies.protection import newest
from literal import held_layout, literal_pool, outside_window
from test_patch import assert_paths_agree
from test_policies import cache_view, make_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
POLICIES_DIR = pathlib.Path(__file__).resolve().parent.parent / "kvcache_ext" / "policies"


# --------------------------------------------------------------------------- Pooling itself

@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), H=st.integers(1, 3),
       span=st.integers(1, 20), kernel=st.sampled_from([1, 3, 5, 7, 9]),
       mode=st.sampled_from(["max", "avg"]), recent=st.integers(0, 6))
def test_pooling_equals_a_literal_pooling_on_ragged_segments(seed, B, H, span, kernel, mode, recent):
    """Each (row, head) holds its own tokens (some none, some fewer than the kernel), padded to
    the longest; the recent window and the padding take no part."""
    gen = torch.Generator().manual_seed(seed)
    hold = torch.rand(B, H, span, generator=gen) < 0.6
    pos, mask = held_layout(hold)
    scores = torch.randn(pos.shape, generator=gen).masked_fill(~mask, 123.0)   # padding: junk
    last_pos = torch.full((B,), span - 1)
    live = mask & ~newest(pos, last_pos, recent)
    got = Pooling(kernel, mode)(scores, live)
    for b in range(B):
        for h in range(H):
            m = int(mask[b, h].sum())
            want = literal_pool(scores[b, h, :m].double(), kernel, mode,
                                outside_window(pos[b, h, :m].tolist() + [span - 1], recent)[:m])
            torch.testing.assert_close(got[b, h, :m].double(), want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got[b, h, m:], scores[b, h, m:])       # padding keeps its value


def test_pooling_by_hand():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0, 9.0]])
    live = torch.tensor([[True, True, True, True, True, False]])       # the last is the window
    assert Pooling(3, "max")(x, live).tolist() == [[5.0, 5.0, 5.0, 3.0, 3.0, 9.0]]
    assert Pooling(3, "avg")(x, live)[0].tolist() == pytest.approx([3.0, 8 / 3, 7 / 3, 5 / 3, 1.5, 9.0])
    assert Pooling(1, "max")(x, live).tolist() == x.tolist()
    assert Pooling(7, "max")(x[:, :1], live[:, :1]).tolist() == [[1.0]]   # shorter than the kernel


@pytest.mark.parametrize("kwargs", [dict(kernel=4), dict(kernel=0), dict(kernel=2.0), dict(kernel=3.5),
                                    dict(mode="min")])
def test_pooling_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError, match="kernel|mode"):
        Pooling(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(kernel=True), dict(kernel="7"), dict(mode=None)])
def test_pooling_rejects_parameters_of_the_wrong_type(kwargs):
    with pytest.raises(TypeError, match="kernel|mode"):
        Pooling(**kwargs)


def test_scorers_reject_bad_pooling():
    with pytest.raises(ValueError, match="kernel"):
        SnapKV(kernel=4)
    with pytest.raises(ValueError, match="kernel"):
        KVEC(kernel=2)
    with pytest.raises(TypeError, match="Pooling"):
        AhaKV(score_pool=7)
    with pytest.raises(TypeError, match="Pooling"):
        Pooled(H2O(), pooling="max")
    with pytest.raises(TypeError, match="scorer"):
        Pooled("h2o")


def test_defaults_follow_the_errata():
    assert AhaKV().score_pool == Pooling(7, "max") and AhaKV(score_pool=None).score_pool is None
    assert (KVEC().kernel, KVEC().pooling) == (7, "max")
    assert (SnapKV().kernel, SnapKV().pooling) == (7, "max")
    assert CAOTE().gqa == "shared" and CAOTE(TOVA()).gqa == "shared"


# --------------------------------------------------------------------------- Pooled(base)

@pytest.mark.parametrize("base", [H2O(recent=3), TOVA(), RoCo(), ScissorHands()], ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("pad", [False, True])
def test_pooled_pools_the_bases_prompt_scores(base, pad):
    p = make_prompt(5, 2, 2, 2, 24, pad=pad)
    p.budget = torch.full((2,), 8)
    raw, raw_channels = base.prompt_scores(p)
    pooled, channels = Pooled(base, Pooling(5, "max")).prompt_scores(p)
    assert (channels is None) == (raw_channels is None)
    if channels is not None:
        assert torch.equal(channels, raw_channels)                    # the state is the base's
    recent = base.default_protection().recent
    for b in range(2):
        idx = torch.nonzero(p.valid[b]).flatten()
        positions = p.pos[b, idx].tolist()
        for h in range(2):
            x = raw[b, h, idx].double()
            live = [a and bool(torch.isfinite(v)) for a, v in zip(outside_window(positions, recent), x)]
            torch.testing.assert_close(pooled[b, h, idx].double(), literal_pool(x, 5, "max", live))


def test_pooled_pools_the_bases_cache_scores():
    gen = torch.Generator().manual_seed(3)
    hold = torch.rand(2, 3, 30, generator=gen) < 0.5
    pos, mask = held_layout(hold)
    channels = torch.rand(*pos.shape, 1, generator=gen) * mask[..., None]
    view = cache_view(pos, mask, 2, channels=channels)
    got = Pooled(H2O(recent=4), Pooling(3, "avg")).cache_scores(view)
    for b in range(2):
        for h in range(3):
            m = int(mask[b, h].sum())
            live = outside_window(pos[b, h, :m].tolist() + [int(view.last_pos[b])], 4)[:m]
            want = literal_pool(channels[b, h, :m, 0].double(), 3, "avg", live)
            torch.testing.assert_close(got[b, h, :m].double(), want, rtol=1e-6, atol=1e-6)


def test_pooled_delegates_to_the_base():
    s = Pooled(RoCo())
    assert s.capabilities == RoCo().capabilities   # the base's, as a whole
    assert s.default_protection() == RoCo().default_protection()
    s = Pooled(SnapKV(window=5, kernel=1))
    assert s.capabilities.stats_window == 5 and s.capabilities.evict_stats == ("mass", "last")
    with pytest.raises(ValueError, match="pool_then_mean"):
        Policy(Pooled(SnapKV(order="pool_then_mean")), budget=64, schedule=BlockwisePrefill(16))


# --------------------------------------------------------------------------- the source

def test_one_softmax_over_keys_for_every_scorer():
    """Every scorer reads probabilities from the views; only views.py computes a softmax."""
    found = {f.name for f in POLICIES_DIR.glob("*.py") if re.search(r"\.(log_)?softmax\s*\(", f.read_text())}
    assert found == {"views.py"}, found


def test_no_scorer_calls_another_objects_private_method():
    calls = []
    for f in POLICIES_DIR.glob("*.py"):
        for line in f.read_text().splitlines():
            for m in re.finditer(r"([A-Za-z_][\w.]*)\._[a-z]\w*\(", line):
                if m.group(1) not in ("self", "super()"):
                    calls.append((f.name, line.strip()))
    assert not calls, calls


# --------------------------------------------------------------------------- ragged == reference

CHANGED = [
    SnapKV(window=4),
    SnapKV(window=4, kernel=5, pooling="avg"),
    AhaKV(recent=4),
    AhaKV(recent=4, score_pool=Pooling(5, "avg")),
    CAOTE(H2O(recent=2), output_after_eviction=False),
    CAOTE(TOVA(), output_after_eviction=False),
    CAOTE(SnapKV(window=4), gqa="group_l2", output_after_eviction=False),
    CAOTE(H2O(), gqa="group_l2", max_groups=4),
    CAOTE(AhaKV(recent=4), output_after_eviction=False),
    Pooled(H2O(recent=2)),
    Pooled(RoCo()),
    ScissorHands(),
]


@pytest.mark.parametrize("schedule", [OneShot(), BlockwisePrefill(16)], ids=["one-shot", "blocks"])
@pytest.mark.parametrize("scorer", CHANGED, ids=lambda s: repr(s).replace(" ", "")[:70])
def test_changed_scorers_ragged_path_equals_reference_path(scorer, schedule):
    assert_paths_agree(Policy(scorer, budget=20, schedule=schedule))


def test_kvec_default_ragged_path_equals_reference_path():
    assert_paths_agree(Policy(KVEC(window=4, extended_window=8), budget=20))     # one-shot only
