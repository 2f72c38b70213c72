"""The model types that kvcache_ext.patch serves through their attention alone, as it serves
the architectures of tests/test_patch.py (tests/tiny_models.py MORE_ARCHS: MoE variants,
other norms and scalings; those with a sliding window run past it): the unpatched model's
logits with a budget at least the sequence, the reference path's with eviction, on a
left-padded GQA batch of 2."""
import pytest
import torch

import kvcache_ext
from kvcache_ext.policies import H2O, AdaKV, EveryStep, Policy, SnapKV
from test_patch import inputs, teacher_forced
from tiny_models import MORE_ARCHS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOWS = {"ministral": dict(sliding_window=12), "mixtral": dict(sliding_window=12),
           "starcoder2": dict(sliding_window=12), "qwen3_moe": dict(use_sliding_window=True, sliding_window=12)}


@pytest.mark.parametrize("arch", list(MORE_ARCHS))
def test_more_models_match_unpatched_and_reference(arch):
    model = tiny_model(arch, heads=6, kv_heads=2, **WINDOWS.get(arch, {}))
    ids, mask = inputs(batch=2, length=30, pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask, steps=8)
    for policy in [Policy(H2O(), budget=100, schedule=EveryStep()),
                   Policy(SnapKV(window=4), budget=100, allocation=AdaKV())]:
        with kvcache_ext.patch(model, policy) as handle:
            got = teacher_forced(model, handle.new_cache(), ids, mask, steps=8)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=str(policy))
    for policy in [Policy(SnapKV(window=4, kernel=3), budget=8, allocation=AdaKV()),
                   Policy(H2O(recent=2), budget=8, schedule=EveryStep())]:
        with kvcache_ext.patch(model, policy) as handle:
            ragged = handle.new_cache()
            got = teacher_forced(model, ragged, ids, mask, steps=8)
            expected_evicting = teacher_forced(model, handle.new_cache(reference=True), ids, mask, steps=8)
        torch.testing.assert_close(got, expected_evicting, atol=1e-4, rtol=1e-4, msg=str(policy))
        assert int(ragged.kept_tokens()[0].max()) < 25           # eviction happened
        assert not torch.allclose(got, expected, atol=1e-3)      # and changed the logits


def test_qwen2_moe_with_sliding_layers_is_refused():
    """Qwen2-MoE's sliding layers do not pass their window to the attention function."""
    model = tiny_model("qwen2_moe", use_sliding_window=True, sliding_window=12, max_window_layers=2)
    with pytest.raises(ValueError, match=r"qwen2_moe model has sliding-window layers \(use_sliding_window=True\)"):
        kvcache_ext.patch(model, Policy(H2O(), budget=8))
    assert not kvcache_ext.is_patched(model)
