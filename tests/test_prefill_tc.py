"""The tensor-core prefill kernel (csrc/attention/prefill_cuda.cu), which attention_run sends the
CUDA calls it takes by default: fp16 / bf16, head_dim 64 or 128, G * n >= 16 query rows per KV
head, statistics for G <= 64 (its statistics pass recomputes P from the merged log-sum-exp).
KVCACHE_EXT_TC_PREFILL=0 sends them to the scalar CUDA kernel. Both paths are compared with the
float64 reference and with each other on random ragged paged stores. The CUDA cases skip without
a GPU; the host model of its tiles and of the statistics pass is tested in
csrc/tests/test_prefill_tiles.cpp."""
import math
import re

import pytest
import torch

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES
from test_attention import OUT_TOL, STAT_TOL, build_store, check_against_reference

SWITCH = "KVCACHE_EXT_TC_PREFILL"
DEFAULT, OFF = None, "0"   # the switch unset (the tensor-core prefill where it applies), or 0
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="the tensor-core prefill kernel needs a GPU")


def set_switch(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)


def attend(monkeypatch, switch, q, store, scale, q_pos, stats=False):
    set_switch(monkeypatch, switch)
    return kvcache_ext.ragged_attention(q, store, scale, q_pos=q_pos, stats=stats)


def check_both_kernels(monkeypatch, switch, on, off, store, q, scale, q_pos):
    """The kernels `switch` picks at `on` and `off`: each against the float64 reference (outputs and
    every statistic, check_against_reference), and against each other (outputs within twice the
    tolerance, counts equal, the other statistics within twice theirs). Returns both outputs."""
    outs = []
    for value in (on, off):
        if value is None:
            monkeypatch.delenv(switch, raising=False)
        else:
            monkeypatch.setenv(switch, value)
        check_against_reference(store, q, scale, q_pos, True)
        outs.append(kvcache_ext.ragged_attention(q, store, scale, q_pos=q_pos, stats=True))
    (new, new_stats), (old, old_stats) = outs
    tol = OUT_TOL[q.dtype]
    torch.testing.assert_close(new.float(), old.float(), atol=2 * tol, rtol=2 * tol)
    assert torch.equal(new_stats.count, old_stats.count)
    for name in ("mass", "last", "sum_sq"):
        torch.testing.assert_close(getattr(new_stats, name), getattr(old_stats, name), atol=2 * STAT_TOL,
                                   rtol=2 * STAT_TOL, msg=name)
    return new, old


def dense_reference(store, q, scale, q_pos):
    dense = store.to_dense()
    out, _ = reference.ragged_attention(q.cpu(), dense.k.cpu(), dense.v.cpu(), dense.pos.cpu(),
                                        dense.mask.cpu(), scale, None if q_pos is None else q_pos.cpu())
    return out.float()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 4), (1, 3, 1, 16), (2, 2, 4, 37), (1, 2, 8, 64),
                                     (2, 1, 4, 256), (1, 1, 3, 100)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (1000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_default_and_switched_off_prefill_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt,
                                                          evict, causal):
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    scale = 1 / math.sqrt(D)
    new, _ = attend(monkeypatch, DEFAULT, q, store, scale, q_pos)
    old, _ = attend(monkeypatch, OFF, q, store, scale, q_pos)
    want = dense_reference(store, q, scale, q_pos)
    tol = OUT_TOL[dtype]
    for out in (new, old):
        assert out.shape == q.shape and out.dtype == dtype
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)
    # Both kernels round P differently (fp32 against T before P V): within twice the tolerance.
    torch.testing.assert_close(new.float(), old.float(), atol=2 * tol, rtol=2 * tol)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 4, 64, 256])
def test_tensor_core_prefill_page_sizes(monkeypatch, page_size):
    """Pages smaller and larger than a KV tile of 64 tokens (one lookup per row vs per page)."""
    gen = torch.Generator().manual_seed(page_size)
    B, H, G, n, D = 2, 2, 4, 32, 128
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.bfloat16, device="cuda", page_size=page_size)
    k, v = (torch.randn(B, H, 500, D, generator=gen).bfloat16() for _ in range(2))
    store.append(k.cuda(), v.cuda(), torch.arange(500))
    store.compact((torch.rand(store.capacity, generator=gen) >= 0.3).cuda())
    k, v = (torch.randn(B, H, n, D, generator=gen).bfloat16() for _ in range(2))
    store.append(k.cuda(), v.cuda(), torch.arange(500, 500 + n))
    q = torch.randn(B, H * G, n, D, generator=gen).bfloat16().cuda()
    q_pos = torch.arange(500, 500 + n).expand(B, n)
    new, _ = attend(monkeypatch, DEFAULT, q, store, D ** -0.5, q_pos)
    torch.testing.assert_close(new.cpu().float(), dense_reference(store, q, D ** -0.5, q_pos),
                               atol=OUT_TOL[torch.bfloat16], rtol=OUT_TOL[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 4), (1, 3, 1, 16), (2, 2, 4, 37), (1, 2, 8, 8), (2, 1, 3, 100),
                                     (1, 1, 12, 20), (2, 2, 2, 256), (1, 1, 64, 3)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (1000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_default_and_switched_off_statistics_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt,
                                                              evict, causal):
    """The statistics pass (P recomputed per KV tile from the merged log-sum-exp, no logits
    buffer) and the scalar kernel's: every statistic against the float64 reference
    (check_against_reference: values, zeros on slack slots), and against each other."""
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt + 7)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    check_both_kernels(monkeypatch, SWITCH, DEFAULT, OFF, store, q, 1 / math.sqrt(D), q_pos)


@needs_cuda
@pytest.mark.parametrize("stats", [("mass",), ("last", "count"), ("sum_sq",), ("count",)])
def test_tensor_core_statistics_subsets(monkeypatch, stats):
    """Each statistic asked for alone or in pairs (the pass skips the stores of the others)."""
    gen = torch.Generator().manual_seed(len(stats) * 11 + len(stats[0]))
    store, q_pos = build_store(gen, 2, 2, 128, torch.bfloat16, "cuda", 700, 0.6, 64)
    q = torch.randn(2, 8, 64, 128, generator=gen).bfloat16().cuda()
    set_switch(monkeypatch, DEFAULT)
    check_against_reference(store, q, 128 ** -0.5, q_pos, stats)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,G,n", [(2, 2, 4, 16), (1, 3, 1, 16), (2, 1, 3, 100), (1, 2, 8, 64), (2, 2, 2, 256)])
@pytest.mark.parametrize("prompt,evict", [(0, 0.0), (300, 0.5), (1000, 0.9), (200, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_int8_pages_on_tensor_cores_match_reference(monkeypatch, dtype, D, B, H, G, n, prompt, evict, causal):
    """Int8 pages through the tensor-core prefill (raw rows widened to T in shared memory, the K
    scale on each logit, the V scale on each weight) and through the scalar kernel: outputs and
    every statistic against the float64 reference over the rows as stored (check_against_reference),
    and against each other."""
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + n + prompt + 29)
    store, q_pos = build_store(gen, B, H, D, dtype, "cuda", prompt, evict, n, kv_dtype=torch.int8)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).cuda()
    q_pos = q_pos if causal else None
    check_both_kernels(monkeypatch, SWITCH, DEFAULT, OFF, store, q, 1 / math.sqrt(D), q_pos)


@needs_cuda
def test_int8_pages_take_the_tensor_core_kernel(monkeypatch):
    """On int8 pages too the default is the tensor-core kernel (it rounds each weight times its V
    scale to bf16, the scalar kernel keeps it in fp32: some bytes differ), and it matches the
    reference on pages smaller and larger than a KV tile."""
    gen = torch.Generator().manual_seed(31)
    store, q_pos = build_store(gen, 2, 2, 128, torch.bfloat16, "cuda", 1000, 0.5, 64, kv_dtype=torch.int8)
    q = torch.randn(2, 8, 64, 128, generator=gen).bfloat16().cuda()
    default, _ = attend(monkeypatch, DEFAULT, q, store, 128 ** -0.5, q_pos)
    off, _ = attend(monkeypatch, OFF, q, store, 128 ** -0.5, q_pos)
    assert not torch.equal(default, off)
    for page_size in (1, 4, 256):
        store = kvcache_ext.RaggedKVStore(2, 2, 64, dtype=torch.float16, device="cuda", page_size=page_size,
                                          kv_dtype=torch.int8)
        k, v = (torch.randn(2, 2, 300, 64, generator=gen).half() for _ in range(2))
        store.append(k.cuda(), v.cuda(), torch.arange(300))
        store.compact((torch.rand(store.capacity, generator=gen) >= 0.3).cuda())
        store.attended = tuple(reference.as_attended(x) for x in (k, v))
        q = torch.randn(2, 8, 32, 64, generator=gen).half().cuda()
        set_switch(monkeypatch, DEFAULT)
        check_against_reference(store, q, 0.125, torch.arange(268, 300).expand(2, 32), True)


@needs_cuda
def test_other_shapes_keep_the_scalar_kernel(monkeypatch):
    """Calls the tensor-core kernel does not take (fp32, head_dim 96, fewer than 16 rows,
    statistics with G > 64) give the scalar kernel's bytes by default."""
    gen = torch.Generator().manual_seed(3)
    for dtype, D, G, n, stats in [(torch.bfloat16, 64, 72, 2, True), (torch.float32, 128, 4, 32, False),
                                  (torch.float16, 96, 4, 32, False), (torch.bfloat16, 128, 2, 4, False)]:
        store, q_pos = build_store(gen, 2, 2, D, dtype, "cuda", 200, 0.5, n)
        q = torch.randn(2, 2 * G, n, D, generator=gen).to(dtype).cuda()
        new, new_stats = attend(monkeypatch, DEFAULT, q, store, 0.1, q_pos, stats)
        old, old_stats = attend(monkeypatch, OFF, q, store, 0.1, q_pos, stats)
        assert torch.equal(new, old), (dtype, D, G, n, stats)
        if stats:
            for name in kvcache_ext.STAT_NAMES:
                assert torch.equal(getattr(new_stats, name), getattr(old_stats, name)), name


@needs_cuda
def test_the_default_is_the_tensor_core_kernel(monkeypatch):
    """Unset and 1 are the same path, and it is not the scalar kernel's: the tensor-core kernel
    rounds P to bf16 before P V where the scalar one keeps it in fp32, so over 2 x 8 x 64 x 128
    outputs some bytes differ (were the default the scalar kernel, the comparisons of the tests
    above would compare it with itself)."""
    gen = torch.Generator().manual_seed(9)
    store, q_pos = build_store(gen, 2, 2, 128, torch.bfloat16, "cuda", 1000, 0.5, 64)
    q = torch.randn(2, 8, 64, 128, generator=gen).bfloat16().cuda()
    default, _ = attend(monkeypatch, DEFAULT, q, store, 128 ** -0.5, q_pos)
    one, _ = attend(monkeypatch, "1", q, store, 128 ** -0.5, q_pos)
    off, _ = attend(monkeypatch, OFF, q, store, 128 ** -0.5, q_pos)
    assert torch.equal(default, one)
    assert not torch.equal(default, off)


@needs_cuda
@pytest.mark.parametrize("value", ["", "2", "on", "true", " 1"])
def test_a_bad_switch_value_is_refused(monkeypatch, value):
    """Only unset, 1 and 0 are accepted; the error names the variable, the value and those."""
    gen = torch.Generator().manual_seed(4)
    store, q_pos = build_store(gen, 1, 2, 64, torch.bfloat16, "cuda", 100, 0.0, 16)
    q = torch.randn(1, 8, 16, 64, generator=gen).bfloat16().cuda()
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(ValueError, match=f"{SWITCH} must be 0 .* or 1 or unset .* got '{re.escape(value)}'"):
        kvcache_ext.ragged_attention(q, store, q_pos=q_pos)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_switch_leaves_the_cpu_kernel_alone(monkeypatch, dtype):
    """The switch routes CUDA calls only and is not read on CPU: the output is the same bytes
    unset, 1, 0 or a value CUDA calls refuse."""
    gen = torch.Generator().manual_seed(5)
    store, q_pos = build_store(gen, 2, 2, 64, dtype, "cpu", 150, 0.5, 16)
    q = torch.randn(2, 8, 16, 64, generator=gen).to(dtype)
    default, _ = attend(monkeypatch, DEFAULT, q, store, 0.125, q_pos)
    for switch in ("1", OFF, "2"):
        out, _ = attend(monkeypatch, switch, q, store, 0.125, q_pos)
        assert torch.equal(out, default), switch


@needs_cuda
@pytest.mark.parametrize("switch", [DEFAULT, OFF])
def test_stale_and_foreign_plans(monkeypatch, switch):
    """A plan made before a change of lengths gives the same output as a fresh one (the rules of
    attention_plan.h), and a plan of another store NaN rows, on both paths."""
    from test_cuda_metadata import _changes, filled
    set_switch(monkeypatch, switch)
    store, gen = filled("cuda", length=3000, dtype=torch.bfloat16)
    G, n = 4, 16
    q = torch.randn(2, 2 * G, n, 64, generator=gen).bfloat16().cuda()
    for what, change in _changes(store, gen, "cuda"):
        stale = store.attention_plan(G * n)
        change()
        fresh, _ = kvcache_ext.ragged_attention(q, store)
        old, _ = kvcache_ext.ragged_attention(q, store, plan=stale)
        torch.testing.assert_close(old.float(), fresh.float(), atol=1.6e-2, rtol=1.6e-2, msg=what)
    other, _ = filled("cuda", batch=2, heads=5, dtype=torch.bfloat16)
    out, _ = kvcache_ext.ragged_attention(q, store, plan=other.attention_plan(G * n))
    assert torch.isnan(out.float()).all()
