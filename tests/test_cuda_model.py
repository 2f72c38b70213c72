"""Patched tiny models on a CUDA GPU: the integration checks of test_patch.py, on the CUDA kernels.

The CUDA attention kernel serves head_dim 64/128/256, so these models use head_dim 64
(test_patch.py's tiny models use 16). Every test needs a GPU and a CUDA build; on a machine
without one the module is skipped (bench/tools/gpu_verify.sh --stages test runs it on a lent GPU).
"""
import pytest
import torch

import kvcache_ext
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, Policy,
                                  Pyramid, SnapKV, StreamingLLM)
from test_patch import fed_tokens, inputs, teacher_forced
from tiny_models import tiny_model

if not (torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]):
    pytest.skip("needs a CUDA GPU and a CUDA build of kvcache_ext", allow_module_level=True)

POLICIES = [
    Policy(SnapKV(window=4, kernel=3), budget=16, allocation=AdaKV()),
    Policy(SnapKV(window=4, kernel=5, pooling="avg"), budget=20),
    Policy(H2O(recent=2), budget=16, schedule=EveryStep(prefill_block=16)),
    Policy(TOVA(), ratio=0.4, schedule=BlockwisePrefill(8)),
    Policy(StreamingLLM(sinks=2), budget=10, allocation=Pyramid(beta=3), schedule=EveryNSteps(2)),
    Policy(H2O(), budget=12, allocation=AdaKV(alpha=1.0, layers=Pyramid(beta=4)), schedule=EveryStep()),
]


def on_cuda(batch=2, length=50, pad=(3, 0), steps=6):
    ids, mask = inputs(batch=batch, length=length, pad=pad)
    return ids.cuda(), mask.cuda(), fed_tokens(batch, steps).cuda()


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["pages-in-dtype", "int8-pages"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: repr(p)[:60].replace(" ", ""))
def test_ragged_cuda_path_equals_reference_path(policy, kv_dtype):
    """int8 pages: the reference holds what they give back (kvcache_ext.reference.quantize)."""
    model = tiny_model("llama", heads=8, kv_heads=2, head_dim=64, layers=3).cuda()
    ids, mask, fed = on_cuda()
    with kvcache_ext.patch(model, policy, kv_dtype=kv_dtype) as handle:
        ragged = handle.new_cache()
        got = teacher_forced(model, ragged, ids, mask, fed=fed)
        expected = teacher_forced(model, handle.new_cache(reference=True), ids, mask, fed=fed)
    assert ragged.layer_kv(0).store.device.type == "cuda"
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert int(ragged.kept_tokens()[0].sum()) < 2 * 2 * (50 + 6)  # eviction happened


@pytest.mark.parametrize("policy", POLICIES[:3], ids=lambda p: repr(p)[:60].replace(" ", ""))
def test_cuda_and_cpu_keep_the_same_tokens_and_logits(policy):
    results = []
    for device in ("cpu", "cuda"):
        model = tiny_model("qwen2", heads=8, kv_heads=2, head_dim=64, layers=2).to(device)
        ids, mask = inputs(batch=2, length=40, pad=(0, 5))
        fed = fed_tokens(2, 6)
        with kvcache_ext.patch(model, policy) as handle:
            cache = handle.new_cache()
            logits = teacher_forced(model, cache, ids.to(device), mask.to(device), fed=fed.to(device))
        kept = [cache.layer_kv(i).view(None, False) for i in range(2)]
        results.append((logits.cpu(), [(k["pos"].masked_fill(~k["mask"], -1)).cpu() for k in kept]))
    (cpu_logits, cpu_kept), (gpu_logits, gpu_kept) = results
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=2e-4, rtol=2e-4)
    for a, b in zip(cpu_kept, gpu_kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_budget_at_least_length_gives_unpatched_logits_on_cuda(dtype, atol):
    model = tiny_model("llama", heads=8, kv_heads=2, head_dim=64, dtype=dtype).cuda()
    ids, mask, fed = on_cuda(pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask, fed=fed)
    policy = Policy(SnapKV(window=4), budget=128, schedule=EveryStep())
    with kvcache_ext.patch(model, policy) as handle:
        got = teacher_forced(model, handle.new_cache(), ids, mask, fed=fed)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("policy", [Policy(H2O(recent=3), budget=14, schedule=EveryStep()),
                                    Policy(StreamingLLM(sinks=2), budget=10, schedule=EveryNSteps(2))],
                         ids=lambda p: type(p.scorer).__name__)
def test_slot_rule_decode_step_on_cuda_equals_reference_and_cpu(policy):
    """The decode step of a slot-rule scorer, its eviction in the storage call (test_patch.py's
    test_slot_rule_eviction_equals_the_view_eviction) on CUDA: one storage call serves every
    decode step, and it gives the reference path's logits and the CPU store's kept tokens."""
    from test_patch import _decode_unpadded
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    served = []
    decode_step = RaggedLayerKV.decode_step
    results = []
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RaggedLayerKV, "decode_step",
                        lambda self, *a: served.append(self.store.device.type) or decode_step(self, *a))
        for device in ("cpu", "cuda"):
            model = tiny_model("llama", heads=8, kv_heads=2, head_dim=64, layers=3).to(device)
            ids, _ = inputs(batch=2, length=40)
            with kvcache_ext.patch(model, policy) as handle:
                cache = handle.new_cache()
                logits = _decode_unpadded(model, cache, ids.to(device), steps=8)
                if device == "cuda":
                    expected = _decode_unpadded(model, handle.new_cache(reference=True), ids.cuda(), steps=8)
                    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
            kept = [cache.layer_kv(i).view(None, False) for i in range(3)]
            results.append((logits.cpu(), [k["pos"].masked_fill(~k["mask"], -1).cpu() for k in kept]))
    assert served.count("cuda") == served.count("cpu") == 3 * 8
    (cpu_logits, cpu_kept), (gpu_logits, gpu_kept) = results
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=2e-4, rtol=2e-4)
    for a, b in zip(cpu_kept, gpu_kept):
        assert torch.equal(a, b)
