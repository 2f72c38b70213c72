"""ragged_attention against kvcache_ext.reference.ragged_attention (dense, masked, float64)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext import reference
from conftest import DEVICES, DTYPES, filled_store

# Output tolerances (atol = rtol) by dtype: the kernels accumulate in float32, the reference
# in float64 from the same inputs; for half types add one rounding of the output. Logits of
# magnitude ~10 (scale 0.3 at D = 128) stay inside the float32 bound.
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
STAT_TOL = 1e-5  # statistics are float32 on both sides


def build_store(gen, B, H, D, dtype, device, prompt, evict, n_new, kv_dtype=None):
    """A ragged store: `prompt` tokens, a random eviction (keep prob 1 - evict, so some
    segments end up empty or with one slot), then `n_new` block tokens at the next positions.
    Returns the store and the positions of the block's tokens [B, n_new]. With int8 pages the
    store also gets ``attended``: the K and V of every position [B, H, T, D] as the attention
    sees them (``reference.as_attended``), for ``check_against_reference``."""
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, kv_dtype=kv_dtype)
    ks, vs = [], []
    if prompt:
        k, v = (torch.randn(B, H, prompt, D, generator=gen).to(dtype) for _ in range(2))
        store.append(k.to(device), v.to(device), torch.arange(prompt))
        keep = torch.rand(store.capacity, generator=gen) >= evict
        store.compact(keep.to(device))
        ks.append(k), vs.append(v)
    if n_new:
        k, v = (torch.randn(B, H, n_new, D, generator=gen).to(dtype) for _ in range(2))
        store.append(k.to(device), v.to(device), torch.arange(prompt, prompt + n_new))
        ks.append(k), vs.append(v)
    if kv_dtype is not None:
        store.attended = tuple(reference.as_attended(torch.cat(x, 2) if x else torch.zeros(B, H, 0, D))
                               for x in (ks, vs))
    q_pos = torch.arange(prompt, prompt + n_new).expand(B, n_new)
    return store, q_pos


def check_against_reference(store, q, scale, q_pos, stats):
    out, got = kvcache_ext.ragged_attention(q, store, scale, q_pos=q_pos, stats=stats)
    dense = store.to_dense()
    k, v = dense.k.cpu(), dense.v.cpu()
    if store.kv_dtype == torch.int8:   # int8 pages: the exact K and V the kernel attends over, by position
        pos = dense.pos.cpu().long()[..., None].expand(-1, -1, -1, store.head_dim)
        k, v = (x.gather(2, pos) * dense.mask.cpu()[..., None] for x in store.attended)
    want_out, want = reference.ragged_attention(q.cpu(), k, v, dense.pos.cpu(), dense.mask.cpu(), scale,
                                                None if q_pos is None else q_pos.cpu())
    tol = OUT_TOL[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=tol, rtol=tol)
    names = kvcache_ext.STAT_NAMES if stats is True else (stats or ())
    if not names:
        assert got is None
        return
    for name in kvcache_ext.STAT_NAMES:
        field = getattr(got, name)
        if name not in names:
            assert field is None, name
            continue
        assert field.device == q.device and field.shape[0] == store.capacity, name
        padded = store.to_padded(field).cpu()
        if name == "count":
            assert field.dtype == torch.int32
            assert torch.equal(padded, want[name]), name
        else:
            assert field.dtype == torch.float32
            torch.testing.assert_close(padded, want[name], atol=STAT_TOL, rtol=STAT_TOL, msg=name)
        # Slack slots (beyond each segment's length) hold zeros.
        live = torch.zeros(store.capacity, dtype=torch.bool)
        live[store.slot_index()[0][store.slot_index()[1]].cpu()] = True
        assert not field.cpu()[~live].any(), name


@pytest.mark.parametrize("device", DEVICES)
@given(B=st.integers(1, 3), H=st.integers(1, 3), G=st.sampled_from([1, 3, 4, 8]),
       D=st.sampled_from([64, 128]), dtype=st.sampled_from(DTYPES),
       prompt=st.integers(0, 300), evict=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       n=st.sampled_from([1, 1, 2, 5, 16]), causal=st.booleans(),
       stats=st.sampled_from([False, True, ("mass",), ("last", "count"), ("sum_sq",)]),
       scale=st.sampled_from([None, 0.05, 0.3]), seed=st.integers(0, 2**31 - 1), int8=st.booleans())
def test_random_stores(device, B, H, G, D, dtype, prompt, evict, n, causal, stats, scale, seed, int8):
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = torch.int8 if int8 else None
    store, q_pos = build_store(gen, B, H, D, dtype, device, prompt, evict, n, kv_dtype)
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype).to(device)
    scale = 1 / math.sqrt(D) if scale is None else scale
    check_against_reference(store, q, scale, q_pos if causal else None, stats)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [8, 20, 64])
def test_small_head_dims_on_cpu(device, D):
    """The CPU kernel takes any head_dim; CUDA takes CUDA_HEAD_DIMS and says so otherwise."""
    gen = torch.Generator().manual_seed(D)
    store, q_pos = build_store(gen, 2, 2, D, torch.float32, device, 40, 0.5, 3)
    q = torch.randn(2, 4, 3, D, generator=gen).to(device)
    if device == "cuda" and D not in kvcache_ext.kernels.attention.CUDA_HEAD_DIMS:
        with pytest.raises(ValueError, match=f"supports head_dim 64, .* and 256, got {D};"):
            kvcache_ext.ragged_attention(q, store, q_pos=q_pos)
        return
    check_against_reference(store, q, D ** -0.5, q_pos, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_segments(device, dtype):
    """Segments beyond 8K slots, of different lengths, in one batch; decode and a block."""
    gen = torch.Generator().manual_seed(7)
    store = kvcache_ext.RaggedKVStore(2, 2, 64, dtype=dtype, device=device)
    L = 9000
    k, v = (torch.randn(2, 2, L, 64, generator=gen).to(dtype) for _ in range(2))
    store.append(k.to(device), v.to(device), torch.arange(L))
    keep = torch.ones(store.capacity, dtype=torch.bool)
    index, mask = store.slot_index()
    keep[index[0, 1, 8300:][mask[0, 1, 8300:]].cpu()] = False  # segment (0, 1): 8300 slots
    keep[index[1, 0, 100:][mask[1, 0, 100:]].cpu()] = False    # segment (1, 0): 100 slots
    store.compact(keep.to(device))
    assert store.lens.tolist() == [[L, 8300], [100, L]]
    for n in (1, 4):
        new_k, new_v = (torch.randn(2, 2, n, 64, generator=gen).to(dtype) for _ in range(2))
        first = int(store.pos.max()) + 1
        store.append(new_k.to(device), new_v.to(device), torch.arange(first, first + n))
        q = torch.randn(2, 8, n, 64, generator=gen).to(dtype).to(device)
        check_against_reference(store, q, 0.125, torch.arange(first, first + n), True)


def supported_cpu_isas():
    """The vector ISAs of the CPU attention that this CPU runs (baseline always)."""
    current, isas = kvcache_ext._C.cpu_isa(), []
    for isa in ("baseline", "avx2", "avx512"):
        try:
            kvcache_ext._C.set_cpu_isa(isa)
            isas.append(isa)
        except ValueError:
            pass
    kvcache_ext._C.set_cpu_isa(current)
    return isas


@pytest.fixture(params=supported_cpu_isas())
def cpu_isa(request):
    """Runs the CPU attention with each vector ISA the CPU has, then restores the default."""
    current = kvcache_ext._C.cpu_isa()
    kvcache_ext._C.set_cpu_isa(request.param)
    yield request.param
    kvcache_ext._C.set_cpu_isa(current)


def check_work_split(dtype, page_size, G, n, kv_dtype=None):
    """The CPU kernel's splits: segments longer than a key chunk (512 tokens) merged across
    chunks, query blocks (G * n > 256 rows: two blocks), tile loops (G * n < 16 rows) and matrix
    products, ragged lengths with empty and single-slot segments, causal positions, statistics,
    page runs of 1 to 64 tokens, on the pages of ``kv_dtype``; with the ISA set by the caller."""
    gen = torch.Generator().manual_seed(page_size * 100 + G * 10 + n)
    B, H, D, prompt = 2, 3, 80, 1300   # D = 80: not a multiple of the vector width either
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, page_size=page_size, kv_dtype=kv_dtype)
    k, v = (torch.randn(B, H, prompt, D, generator=gen).to(dtype) for _ in range(2))
    store.append(k, v, torch.arange(prompt))
    lens = torch.tensor([[1300, 1, 0], [700, 513, 512]])
    store.compact(store.from_padded(torch.arange(prompt) < lens[..., None], False))
    new_k, new_v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for _ in range(2))
    store.append(new_k, new_v, torch.arange(prompt, prompt + n))
    if kv_dtype is not None:   # the K and V of every position as the attention sees them
        store.attended = tuple(reference.as_attended(torch.cat(x, 2)) for x in ((k, new_k), (v, new_v)))
    q = torch.randn(B, H * G, n, D, generator=gen).to(dtype)
    q_pos = torch.arange(prompt, prompt + n).expand(B, n)
    check_against_reference(store, q, D ** -0.5, q_pos, True)
    check_against_reference(store, q, 0.3, None, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("G, n", [(1, 1), (4, 1), (3, 5), (8, 3), (4, 70)])
def test_work_split_on_cpu(cpu_isa, dtype, page_size, G, n):
    """check_work_split on every vector ISA of this CPU."""
    check_work_split(dtype, page_size, G, n)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_store_and_unseen_queries(device):
    """No slot to attend: zero output, no NaN, zero statistics."""
    store = kvcache_ext.RaggedKVStore(2, 2, 64, dtype=torch.float16, device=device)
    q = torch.randn(2, 4, 3, 64, dtype=torch.float16, device=device)
    out, stats = kvcache_ext.ragged_attention(q, store, stats=True)
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
    assert store.capacity == 0 and stats.mass.shape == (0,) and stats.last.shape == (0, 2)

    gen = torch.Generator().manual_seed(1)
    store, _ = build_store(gen, 2, 2, 64, torch.float16, device, 30, 0.0, 0)
    # Query 0 is before every stored position, query 1 sees the first 10 slots.
    q_pos = torch.tensor([[-1, 9], [-5, 9]])
    q = torch.randn(2, 4, 2, 64, generator=gen).half().to(device)
    out, stats = kvcache_ext.ragged_attention(q, store, q_pos=q_pos, stats=True)
    assert torch.equal(out[:, :, 0].cpu(), torch.zeros(2, 4, 64, dtype=torch.float16))
    assert torch.isfinite(out.float()).all()
    check_against_reference(store, q, 64 ** -0.5, q_pos, True)
    # Every row that sees something spends all of its probability: G heads, 1 query.
    assert torch.allclose(store.to_padded(stats.mass).sum(-1).cpu(), torch.full((2, 2), 2.0))


@pytest.mark.parametrize("device", DEVICES)
def test_matches_sdpa_on_a_full_cache(device):
    """With nothing evicted, decode and a causal block equal torch's SDPA on the dense cache."""
    gen = torch.Generator().manual_seed(3)
    B, H, G, D, L = 2, 2, 3, 64, 50
    k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(2))
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=torch.float32, device=device)
    store.append(k.to(device), v.to(device), torch.arange(L))
    k_rep, v_rep = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    n = 6  # the last 6 stored tokens as a causal block
    q = torch.randn(B, H * G, n, D, generator=gen)
    out, _ = kvcache_ext.ragged_attention(q.to(device), store, q_pos=torch.arange(L - n, L))
    causal = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    want = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=causal)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    q1 = torch.randn(B, H * G, 1, D, generator=gen)
    out1, _ = kvcache_ext.ragged_attention(q1.to(device), store, scale=0.3)
    want1 = F.scaled_dot_product_attention(q1, k_rep, v_rep, scale=0.3)
    torch.testing.assert_close(out1.cpu(), want1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_queries(device):
    """HF hands q over as a [B, n, Hq, D] tensor viewed as [B, Hq, n, D]: accepted as is."""
    gen = torch.Generator().manual_seed(4)
    store, q_pos = build_store(gen, 1, 2, 64, torch.float32, device, 20, 0.3, 4)
    q = torch.randn(1, 4, 8, 64, generator=gen).to(device).transpose(1, 2)
    assert not q.is_contiguous()
    out, _ = kvcache_ext.ragged_attention(q, store, q_pos=q_pos)
    want, _ = kvcache_ext.ragged_attention(q.contiguous(), store, q_pos=q_pos)
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    gen = torch.Generator().manual_seed(5)
    store, q_pos = build_store(gen, 2, 2, 64, torch.float16, device, 10, 0.0, 2)
    q = torch.randn(2, 4, 2, 64, generator=gen).half().to(device)
    before = store.to_dense()
    attend = kvcache_ext.ragged_attention
    with pytest.raises(TypeError, match="dtype"):
        attend(q.float(), store)
    with pytest.raises(ValueError, match="batch"):
        attend(q[:1], store)
    with pytest.raises(ValueError, match="multiple"):
        attend(torch.cat([q, q[:, :1]], 1), store)
    with pytest.raises(ValueError, match="head_dim"):
        attend(q[..., :32], store)
    with pytest.raises(ValueError, match=r"\[batch, query heads, n, head_dim\]"):
        attend(q[0], store)
    with pytest.raises(ValueError, match="q_pos"):
        attend(q, store, q_pos=torch.arange(3))
    with pytest.raises(TypeError, match="q_pos"):
        attend(q, store, q_pos=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="scale"):
        attend(q, store, scale=float("nan"))
    with pytest.raises(ValueError, match="unknown statistics"):
        attend(q, store, stats=("mass", "entropy"))
    with pytest.raises(TypeError, match="RaggedKVStore"):
        attend(q, before)
    if device == "cuda":
        with pytest.raises(ValueError, match="must be on"):
            attend(q.cpu(), store)
    after = store.to_dense()
    for name in ("k", "v", "pos", "scores", "lens"):
        assert torch.equal(getattr(after, name), getattr(before, name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, G", [(1, 1, 1), (2, 3, 3), (3, 2, 4)])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["pages-in-dtype", "int8-pages"])
def test_decode_step_is_the_reference_step(device, dtype, B, H, G, kv_dtype):
    """A layer storage's decode step (append, attend, accumulate, evict by a slot rule: the
    engine's one decode door) on the ragged store against the reference's masked dense cache,
    over ragged segments (one empty before the steps, one of a single token), across page
    boundaries, with padded rows on some steps: the same outputs, statistics, channels and
    kept positions. int8 pages against the reference holding what they give back."""
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    from kvcache_ext.engine.storage import DecodeStep, EvictByRule
    from kvcache_ext.reference.masked_cache import MaskedLayerKV
    gen = torch.Generator().manual_seed(B * 10 + H)
    D = 16 if device == "cpu" else min(kvcache_ext.kernels.attention.CUDA_HEAD_DIMS)  # CUDA: 16 is refused
    L = 20
    lens = torch.randint(0, L + 1, (B, H), generator=gen)
    lens.view(-1)[0] = 0
    lens.view(-1)[-1] = 1 if B * H > 1 else 0
    ragged = RaggedLayerKV(B, H, D, dtype, torch.device(device), 1, page_size=4, kv_dtype=kv_dtype)
    masked = MaskedLayerKV(B, H, D, dtype, torch.device(device), 1, kv_dtype=kv_dtype)
    k = torch.randn(B, H, L, D, generator=gen).to(dtype).to(device)
    keep = (torch.arange(L) < lens[..., None]).to(device)
    for storage in (ragged, masked):
        storage.append(k, k, torch.arange(L, device=device).expand(B, L), keep)
    # The mass's float rounding differs between the kernel and the float64 reference: in 16-bit
    # types the rule is the position (the mass still accumulates), so that no near tie decides.
    rule = "mass" if dtype == torch.float32 else "position"
    budget = torch.tensor([3, 5, 4][:B], device=device)
    last_pos = torch.full((B,), -1, dtype=torch.long, device=device)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for step in range(6):
        kv, v = (torch.randn(B, H, 1, D, generator=gen).to(dtype).to(device) for _ in range(2))
        q = torch.randn(B, H * G, 1, D, generator=gen).to(dtype).to(device)
        pos = torch.full((B, 1), L + step, dtype=torch.long, device=device)
        valid = (torch.arange(B) != step % 3).to(device) if step % 2 else None   # a padded row
        newest = pos[:, 0] if valid is None else pos[:, 0].masked_fill(~valid, -1)
        last_pos = torch.maximum(last_pos, newest)
        evict = EvictByRule(rule, 1, 2, budget, budget.cpu()) if step >= 3 else None
        decode = DecodeStep(stats=("mass", "last"), accumulate=("mass",), evict=evict, last_pos=last_pos)
        got, got_stats = ragged.decode_step(kv, v, pos, q, 0.25, decode, valid)
        want, want_stats = masked.decode_step(kv, v, pos, q, 0.25, decode, valid)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        if evict is None:   # the statistics are of the tokens before the eviction
            for name in ("mass", "last"):
                torch.testing.assert_close(ragged.view({name: got_stats[name]}, False)["stats"][name],
                                           masked.view({name: want_stats[name]}, False)["stats"][name],
                                           atol=1e-4, rtol=1e-4)
        a, b = ragged.view(None, True), masked.view(None, True)
        assert torch.equal(a["pos"], b["pos"]) and torch.equal(a["mask"], b["mask"]), step
        assert torch.equal(ragged.lens, masked.lens)
        torch.testing.assert_close(a["channels"], b["channels"], atol=1e-4, rtol=1e-4)
        for name in ("k", "v"):   # the live tokens (a padded view's other entries are the storage's own)
            assert torch.equal(a[name][a["mask"]], b[name][b["mask"]]), (step, name)
    assert bool((ragged.lens <= budget.cpu()[:, None]).all())   # the rule evicted


# head_dim 80, 96, 112, 192 (the CUDA attention's padded row layout) and 256.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [80, 96, 112, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_of_current_models(device, D, dtype):
    gen = torch.Generator().manual_seed(D)
    store = filled_store(2, 2, D, dtype, device, [37, 0, 1, 300])
    for n in (1, 3):
        q = (torch.randn(2, 4, n, D, generator=gen)).to(dtype).to(device)
        q_pos = torch.arange(300 - n + 1, 301).expand(2, n) if n > 1 else None
        check_against_reference(store, q, 1 / math.sqrt(D), q_pos, True)


# The CUDA attention's chunked statistics path, taken when G x capacity x queries > 2^26 (its
# logits buffer would pass 256 MiB): queries run in passes that add into the statistics.
def chunked_reference(store, q, scale, q_pos, chunk=128):
    """The statistics in float32, a chunk of queries at a time (memory stays small)."""
    dense = store.to_dense()
    k, v, pos, mask = (t.cpu() for t in (dense.k.float(), dense.v.float(), dense.pos, dense.mask))
    B, Hq, n, D = q.shape
    H = k.shape[1]
    G = Hq // H
    qf = q.cpu().float().view(B, H, G, n, D)
    mass = torch.zeros(mask.shape)
    sum_sq = torch.zeros(mask.shape)
    count = torch.zeros(mask.shape, dtype=torch.int32)
    last = torch.zeros(mask.shape + (G,))
    out = torch.zeros(B, H, G, n, D)
    for i0 in range(0, n, chunk):
        qc = qf[:, :, :, i0:i0 + chunk]                                   # [B, H, G, c, D]
        logits = torch.einsum("bhgcd,bhld->bhgcl", qc, k) * scale
        chunk_pos = q_pos.cpu()[:, None, None, i0:i0 + chunk, None]
        visible = mask[:, :, None, None, :] & (pos[:, :, None, None, :] <= chunk_pos)
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
        out[:, :, :, i0:i0 + chunk] = probs @ v[:, :, None]
        group = probs.sum(2)                                              # [B, H, c, L]
        mass += group.sum(2)
        sum_sq += (group / G).square().sum(2)
        count += visible[:, :, 0].sum(2).int()
        if i0 + chunk >= n:
            last = probs[:, :, :, -1].permute(0, 1, 3, 2)
    return out.view(B, Hq, n, D), dict(mass=mass, sum_sq=sum_sq, count=count, last=last)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_statistics_path(device):
    """G x capacity x queries just over 2^26: the CUDA kernel runs the queries in two passes
    whose statistics add up; the CPU kernel computes the same numbers in one."""
    L, n, G = 32_800, 1040, 2
    store = filled_store(1, 1, 64, torch.float32, device, [L], page_size=16)
    assert G * store.capacity * n > 2 ** 26
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(1, G, n, 64, generator=gen) * 0.5).to(device)
    q_pos = torch.arange(L - n, L).view(1, n)   # causal over the last n tokens
    out, got = kvcache_ext.ragged_attention(q, store, 0.125, q_pos=q_pos, stats=True)
    want_out, want = chunked_reference(store, q, 0.125, q_pos)
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-4)
    for name in kvcache_ext.STAT_NAMES:
        torch.testing.assert_close(store.to_padded(getattr(got, name)).cpu(), want[name],
                                   atol=2e-5, rtol=1e-4, msg=name)
