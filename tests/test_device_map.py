"""Layers placed by accelerate (``from_pretrained(..., device_map=...)``, ``dispatch_model``):
each layer's store lives where that layer's attention runs, made from the keys it receives.

On CPU, a layer offloaded to disk runs through accelerate's hooks (its weights loaded for each
call): the patched model gives the unpatched logits with a budget at least the sequence, and the
reference path's with eviction, on a left-padded GQA batch of 2. With a GPU, one layer runs on
the GPU and one on the CPU (``dispatch_model(..., main_device="cpu")``): the same, with each
layer's store on its own device."""
import pytest
import torch

import kvcache_ext
from kvcache_ext.policies import H2O, AdaKV, EveryStep, Policy, SnapKV
from test_patch import inputs, teacher_forced
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("accelerate")

KEEP_ALL = [Policy(H2O(), budget=100, schedule=EveryStep()), Policy(SnapKV(window=4), budget=100, allocation=AdaKV())]
EVICT = [Policy(SnapKV(window=4, kernel=3), budget=8, allocation=AdaKV()), Policy(H2O(recent=2), budget=8, schedule=EveryStep())]


def check_patched(model, expected, ids, mask):
    """Unpatched logits (``expected``) with budgets at least the sequence; the reference path's
    with eviction. Returns the last evicting cache."""
    for policy in KEEP_ALL:
        with kvcache_ext.patch(model, policy) as handle:
            got = teacher_forced(model, handle.new_cache(), ids, mask, steps=8)
        torch.testing.assert_close(got.cpu(), expected.cpu(), atol=2e-5, rtol=1e-5, msg=str(policy))
    for policy in EVICT:
        with kvcache_ext.patch(model, policy) as handle:
            ragged = handle.new_cache()
            got = teacher_forced(model, ragged, ids, mask, steps=8)
            reference = teacher_forced(model, handle.new_cache(reference=True), ids, mask, steps=8)
        torch.testing.assert_close(got.cpu(), reference.cpu(), atol=1e-4, rtol=1e-4, msg=str(policy))
        assert int(ragged.kept_tokens()[0].max()) < 25                # eviction happened
        assert not torch.allclose(got.cpu(), expected.cpu(), atol=1e-3)  # and changed the logits
    return ragged


def test_a_layer_offloaded_to_disk(tmp_path):
    from transformers import AutoModelForCausalLM
    plain = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    plain.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert hasattr(model.model.layers[1], "_hf_hook")   # accelerate's hook runs it
    ids, mask = inputs(batch=2, length=30, pad=(0, 5))
    expected = teacher_forced(plain, None, ids, mask, steps=8)
    torch.testing.assert_close(teacher_forced(model, None, ids, mask, steps=8), expected)
    check_patched(model, expected, ids, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: one layer on it, one on the CPU")
def test_layers_on_the_gpu_and_the_cpu():
    from accelerate import dispatch_model
    plain = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=30, pad=(0, 5))
    expected = teacher_forced(plain, None, ids, mask, steps=8)
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    model.load_state_dict(plain.state_dict())
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": 0,
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map, main_device="cpu")
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "cuda"
    ragged = check_patched(model, expected, ids, mask)
    assert [ragged.layer_kv(i).lens.device.type for i in range(2)] == ["cuda", "cpu"]
