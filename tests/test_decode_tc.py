"""The tensor-core decode kernel (csrc/attention/decode_tc_cuda.cu), opt-in through
KVCACHE_EXT_TC_DECODE=1: the attend step of CUDA calls of 1 to 16 query rows per KV head
(G * n) a pass, fp16 / bf16, head_dim 64 or 128 (calls of 16 rows or more go to the tensor-core
prefill first while that is on); with statistics it writes the logits the scalar kernel's
statistics pass reads. Compared with the float64 reference and with the
scalar kernel (the switch unset or 0) on random ragged paged stores. The CUDA cases skip without a
GPU; the host model of its tiles is tested in csrc/tests/test_prefill_tiles.cpp (DecodeTiles.*)."""
import math
import re

import pytest
import torch

import kvcache_ext
from conftest import DEVICES
from test_attention import OUT_TOL, STAT_TOL, build_store, check_against_reference
from test_prefill_tc import check_both_kernels, dense_reference

SWITCH = "KVCACHE_EXT_TC_DECODE"
ON, DEFAULT, OFF = "1", None, "0"
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="the tensor-core decode kernel needs a GPU")


def set_switch(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)


def attend(monkeypatch, switch, q, store, scale, q_pos, stats=False, plan=None):
    set_switch(monkeypatch, switch)
    return kvcache_ext.ragged_attention(q, store, scale, q_pos=q_pos, stats=stats, plan=plan)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 1), (1, 1, 4, 1), (3, 2, 1, 1), (2, 2, 8, 2), (1, 2, 16, 1),
                                     (2, 1, 3, 5)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (3000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_switched_on_and_off_decode_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt, evict, causal):
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt + 13)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    scale = 1 / math.sqrt(D)
    new, _ = attend(monkeypatch, ON, q, store, scale, q_pos)
    old, _ = attend(monkeypatch, OFF, q, store, scale, q_pos)
    want = dense_reference(store, q, scale, q_pos)
    tol = OUT_TOL[dtype]
    for out in (new, old):
        assert out.shape == q.shape and out.dtype == dtype
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)
    # P is rounded to T before P V on tensor cores, kept in fp32 by the scalar kernel.
    torch.testing.assert_close(new.float(), old.float(), atol=2 * tol, rtol=2 * tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 1), (3, 2, 1, 1), (2, 2, 8, 2), (2, 1, 3, 5), (1, 1, 16, 1)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (3000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_switched_on_statistics_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt, evict, causal):
    """The logits it writes for the statistics pass: every statistic against the float64
    reference (check_against_reference: values, zeros on slack slots) and against the switch off."""
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt + 17)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    scale = 1 / math.sqrt(D)
    set_switch(monkeypatch, ON)
    check_against_reference(store, q, scale, q_pos, True)
    _, new = attend(monkeypatch, ON, q, store, scale, q_pos, stats=True)
    _, old = attend(monkeypatch, OFF, q, store, scale, q_pos, stats=True)
    assert torch.equal(new.count, old.count)
    for name in ("mass", "last", "sum_sq"):
        torch.testing.assert_close(getattr(new, name), getattr(old, name), atol=2 * STAT_TOL, rtol=2 * STAT_TOL,
                                   msg=name)


@needs_cuda
def test_statistics_in_passes_over_query_chunks(monkeypatch):
    """A logits buffer too large for every query at once (capacity x G x n over 256 MiB) makes
    passes over chunks of queries, each of at most 16 rows: the kernel reads its chunk's queries
    and positions (i0 of n_total) and the passes' statistics add up."""
    gen = torch.Generator().manual_seed(26)
    B, H, G, n, D = 1, 1, 4, 4, 64
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.bfloat16, device="cuda", page_size=256)
    store.reserve(9 * 2**20)  # capacity: 9 Mi slots, 4 rows of fp32 logits each = 144 MiB a query
    k, v = (torch.randn(B, H, 2000, D, generator=gen).bfloat16().cuda() for _ in range(2))
    store.append(k, v, torch.arange(2000))
    q = torch.randn(B, H * G, n, D, generator=gen).bfloat16().cuda()
    q_pos = torch.arange(1996, 2000).expand(B, n)
    set_switch(monkeypatch, ON)
    check_against_reference(store, q, D ** -0.5, q_pos, True)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 4, 64, 256])
def test_tensor_core_decode_page_sizes(monkeypatch, page_size):
    """Pages smaller and larger than a KV tile of 64 tokens, after a compaction."""
    gen = torch.Generator().manual_seed(page_size + 1)
    B, H, G, D = 2, 2, 4, 128
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.bfloat16, device="cuda", page_size=page_size)
    k, v = (torch.randn(B, H, 700, D, generator=gen).bfloat16() for _ in range(2))
    store.append(k.cuda(), v.cuda(), torch.arange(700))
    store.compact((torch.rand(store.capacity, generator=gen) >= 0.3).cuda())
    k, v = (torch.randn(B, H, 1, D, generator=gen).bfloat16() for _ in range(2))
    store.append(k.cuda(), v.cuda(), torch.tensor([700]))
    q = torch.randn(B, H * G, 1, D, generator=gen).bfloat16().cuda()
    q_pos = torch.tensor([[700]] * B)
    new, _ = attend(monkeypatch, ON, q, store, D ** -0.5, q_pos)
    torch.testing.assert_close(new.cpu().float(), dense_reference(store, q, D ** -0.5, q_pos),
                               atol=OUT_TOL[torch.bfloat16], rtol=OUT_TOL[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 1), (3, 2, 1, 1), (2, 2, 8, 2), (2, 1, 3, 5)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (3000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_int8_pages_on_tensor_cores_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt, evict, causal):
    """Int8 pages through the tensor-core decode, switched on and off: outputs and statistics
    against the float64 reference over the rows as stored, and the two kernels against each other."""
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt + 37)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n, kv_dtype=torch.int8)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    new, old = check_both_kernels(monkeypatch, SWITCH, ON, OFF, store, q, 1 / math.sqrt(D), q_pos)
    if prompt == 3000:   # long segments: the tensor-core kernel's rounding shows in some bytes
        assert not torch.equal(new, old)


@needs_cuda
def test_calls_it_does_not_take_keep_the_scalar_kernel(monkeypatch):
    """With the switch on, calls outside the kernel (fp32, head_dim 96, more than 16 rows with
    the tensor-core prefill off, with and without statistics) give the scalar kernel's bytes."""
    gen = torch.Generator().manual_seed(21)
    monkeypatch.setenv("KVCACHE_EXT_TC_PREFILL", "0")
    for dtype, D, G, n, stats in [(torch.float32, 128, 4, 1, True), (torch.float32, 128, 4, 1, False),
                                  (torch.float16, 96, 4, 1, False), (torch.bfloat16, 64, 4, 5, False),
                                  (torch.bfloat16, 64, 4, 5, True)]:
        store, q_pos = build_store(gen, 2, 2, D, dtype, "cuda", 400, 0.5, n)
        q = torch.randn(2, 2 * G, n, D, generator=gen).to(dtype).cuda()
        new, new_stats = attend(monkeypatch, ON, q, store, 0.1, q_pos, stats)
        old, old_stats = attend(monkeypatch, OFF, q, store, 0.1, q_pos, stats)
        assert torch.equal(new, old), (dtype, D, G, n, stats)
        if stats:
            for name in kvcache_ext.STAT_NAMES:
                assert torch.equal(getattr(new_stats, name), getattr(old_stats, name)), name


@needs_cuda
def test_the_default_is_the_scalar_kernel(monkeypatch):
    """Unset and 0 are the same path, and 1 is another: the tensor-core kernel rounds P to bf16
    before P V where the scalar one keeps it in fp32, so over 4 x 16 x 128 outputs of long
    segments some bytes differ (were 1 the scalar kernel, the comparisons above would compare
    it with itself)."""
    gen = torch.Generator().manual_seed(22)
    store, q_pos = build_store(gen, 4, 4, 128, torch.bfloat16, "cuda", 3000, 0.2, 1)
    q = torch.randn(4, 16, 1, 128, generator=gen).bfloat16().cuda()
    default, _ = attend(monkeypatch, DEFAULT, q, store, 128 ** -0.5, q_pos)
    off, _ = attend(monkeypatch, OFF, q, store, 128 ** -0.5, q_pos)
    on, _ = attend(monkeypatch, ON, q, store, 128 ** -0.5, q_pos)
    assert torch.equal(default, off)
    assert not torch.equal(default, on)


@needs_cuda
@pytest.mark.parametrize("value", ["", "2", "on", "true", " 1"])
def test_a_bad_switch_value_is_refused(monkeypatch, value):
    """Only unset, 0 and 1 are accepted; the error names the variable, the value and those."""
    gen = torch.Generator().manual_seed(23)
    store, q_pos = build_store(gen, 1, 2, 64, torch.bfloat16, "cuda", 100, 0.0, 1)
    q = torch.randn(1, 8, 1, 64, generator=gen).bfloat16().cuda()
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(ValueError, match=f"{SWITCH} must be 1 .* or 0 or unset .* got '{re.escape(value)}'"):
        kvcache_ext.ragged_attention(q, store, q_pos=q_pos)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_switch_leaves_the_cpu_kernel_alone(monkeypatch, dtype):
    """The switch routes CUDA calls only and is not read on CPU: the same bytes unset, 1, 0 or a
    value CUDA calls refuse."""
    gen = torch.Generator().manual_seed(24)
    store, q_pos = build_store(gen, 2, 2, 64, dtype, "cpu", 150, 0.5, 1)
    q = torch.randn(2, 8, 1, 64, generator=gen).to(dtype)
    default, _ = attend(monkeypatch, DEFAULT, q, store, 0.125, q_pos)
    for switch in (ON, OFF, "2"):
        out, _ = attend(monkeypatch, switch, q, store, 0.125, q_pos)
        assert torch.equal(out, default), switch
    plan = store.attention_plan(4)  # a CPU plan reads no switch either
    set_switch(monkeypatch, "2")
    assert torch.equal(kvcache_ext.ragged_attention(q, store, 0.125, q_pos=q_pos, plan=plan)[0], default)


@needs_cuda
@pytest.mark.parametrize("plan_switch,run_switch", [(ON, ON), (ON, OFF), (OFF, ON)])
def test_stale_foreign_and_other_kernels_plans(monkeypatch, plan_switch, run_switch):
    """A plan sized for one kernel runs on the other, a plan made before a change of lengths gives
    the same output as a fresh one (attention_plan.h's rules), and a plan of another store NaN
    rows."""
    from test_cuda_metadata import _changes, filled
    store, gen = filled("cuda", length=3000, dtype=torch.bfloat16)
    G = 4
    q = torch.randn(2, 2 * G, 1, 64, generator=gen).bfloat16().cuda()
    for what, change in _changes(store, gen, "cuda"):
        set_switch(monkeypatch, plan_switch)
        stale = store.attention_plan(G)
        change()
        set_switch(monkeypatch, run_switch)
        fresh, _ = kvcache_ext.ragged_attention(q, store)
        old, _ = kvcache_ext.ragged_attention(q, store, plan=stale)
        torch.testing.assert_close(old.float(), fresh.float(), atol=1.6e-2, rtol=1.6e-2, msg=what)
    set_switch(monkeypatch, plan_switch)
    other, _ = filled("cuda", batch=2, heads=5, dtype=torch.bfloat16)
    foreign = other.attention_plan(G)
    set_switch(monkeypatch, run_switch)
    out, _ = kvcache_ext.ragged_attention(q, store, plan=foreign)
    assert torch.isnan(out.float()).all()


@needs_cuda
def test_tensor_core_decode_in_a_cuda_graph(monkeypatch):
    """Captured with its plan (as the decode graph captures it, kvcache_ext/hf/decode_graph.py)
    and replayed: the eager call's bytes (the kernel's shared-memory opt-in is no stream work)."""
    set_switch(monkeypatch, ON)
    gen = torch.Generator().manual_seed(25)
    B, H, G, D = 2, 2, 4, 128
    store, _ = build_store(gen, B, H, D, torch.bfloat16, "cuda", 900, 0.4, 1)
    q = torch.randn(B, H * G, 1, D, generator=gen).bfloat16().cuda()
    plan = store.attention_plan(G)
    want, _ = kvcache_ext.ragged_attention(q, store, plan=plan)  # also the warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = kvcache_ext.ragged_attention(q, store, plan=plan)
    q.copy_(torch.randn(B, H * G, 1, D, generator=gen).bfloat16())
    graph.replay()
    want, _ = kvcache_ext.ragged_attention(q, store, plan=plan)
    assert torch.equal(out, want)
