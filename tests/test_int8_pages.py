"""int8 pages (``kv_dtype=torch.int8``): K and V quantized per token and KV head as they are stored.

The number format against its plain-PyTorch twin (``kvcache_ext.reference.quantize``) bit for bit,
edge rows included; the bytes a store holds; a patched model's ragged path against the reference
path holding the same values, for every scorer family, allocation and schedule; bad input. The
store's operations and the attention on int8 pages run in test_store.py and test_attention.py's
random tests, beside the other dtypes."""
import pytest
import torch

import kvcache_ext
from kvcache_ext import reference
from kvcache_ext.policies import (H2O, TOVA, AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, ExpectedAttention,
                                  KVzip, OneShot, Policy, Pyramid, SnapKV, StreamingLLM)
from conftest import DTYPES
from test_patch import assert_paths_agree, inputs, teacher_forced
from tiny_models import tiny_model


def edge_rows(D: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows a quantizer gets wrong first: zeros, one value, ties at half a step, tiny values (a
    float16 scale below its normal range, or 0), huge ones (past 127 * 65504), infinities, NaN."""
    gen = torch.Generator().manual_seed(D)
    rows = torch.randn(12, D, generator=gen) * torch.logspace(-6, 6, 12)[:, None]
    rows[0] = 0
    rows[1, 1:] = 0
    rows[2] = torch.arange(D) - D / 2 + 0.5            # steps of exactly 0.5 after scaling below
    rows[2] *= 127 / rows[2].abs().max()
    rows[3] *= 1e-9
    rows[4, 0] = 1e9
    rows[5, 0], rows[5, -1] = float("inf"), -float("inf")
    rows[6, D // 2] = float("nan")
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 64, 128])
def test_the_store_quantizes_as_its_reference_twin(device, dtype, D):
    rows = edge_rows(D, dtype)
    rows = torch.cat([rows, torch.randn(20, D).to(dtype)])              # and plain ones
    n = rows.shape[0]
    store = kvcache_ext.RaggedKVStore(1, 1, D, dtype=dtype, kv_dtype="int8", page_size=4, device=device)
    store.append(rows.view(1, 1, n, D).to(device), rows.flip(0).view(1, 1, n, D).to(device), torch.arange(n))
    dense = store.to_dense()
    q, scale = reference.quantize(rows)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert int(q.abs().max()) <= 127 and bool(torch.isfinite(scale).all())
    for got, want in ((dense.k[0, 0].cpu(), rows), (dense.v[0, 0].cpu(), rows.flip(0))):
        expected = reference.round_trip(want)
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
    # Close to the input where the input is finite and its scale a normal float16: half a step.
    amax = rows.float().abs().amax(1)
    fine = torch.isfinite(rows.float()).all(1) & (amax < 1e6) & (amax > 1e-2)
    err = (reference.round_trip(rows).float() - rows.float()).abs()[fine]
    step = scale.float()[fine][:, None]
    slack = 1e-2 if dtype == torch.bfloat16 else 1e-3             # the output's own rounding
    assert bool((err <= step / 2 * (1 + 1e-6) + slack * rows.float().abs()[fine]).all())
    assert bool((reference.round_trip(rows)[scale == 0] == 0).all())   # below float16's range: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_pages_hold_a_fraction_of_the_bytes(dtype):
    """SmolLM2's layer shape (3 KV heads of 64) with one score channel, 1,000 tokens a head."""
    def nbytes(kv_dtype):
        store = kvcache_ext.RaggedKVStore(1, 3, 64, dtype=dtype, kv_dtype=kv_dtype, page_size=16)
        k = torch.randn(1, 3, 1000, 64).to(dtype)
        store.append(k, k, torch.arange(1000))
        return store.nbytes
    ratio = nbytes("int8") / nbytes(None)
    assert ratio <= (0.30 if dtype == torch.float32 else 0.55), ratio


POLICIES = [
    Policy(SnapKV(window=4, kernel=3), budget=20, allocation=AdaKV()),
    Policy(H2O(recent=4), budget=20, schedule=EveryStep()),
    Policy(TOVA(), budget=20, allocation=Pyramid(beta=4), schedule=BlockwisePrefill(16)),
    Policy(StreamingLLM(sinks=2), budget=20, schedule=EveryNSteps(3, target=14)),
    Policy(ExpectedAttention(), budget=20, schedule=OneShot()),
    Policy(H2O(), budget=20, allocation=AdaKV(alpha=1.0, layers=Pyramid(beta=4)), schedule=EveryStep(prefill_block=8)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_the_ragged_path_on_int8_pages_equals_the_reference_path(policy):
    assert_paths_agree(policy, kv_dtype=torch.int8)


def test_kvzip_reconstruction_on_int8_pages_equals_the_reference_path():
    ids = dict(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None)   # no tokenizer
    assert_paths_agree(Policy(KVzip(**ids), budget=20), kv_dtype=torch.int8)


def test_a_budget_past_the_sequence_on_int8_pages_stays_close_to_the_model():
    """Nothing evicted: only quantization differs from the model's own attention."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=40, pad=(0, 5))
    expected = teacher_forced(model, None, ids, mask)
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=1000), kv_dtype="int8") as handle:
        got = teacher_forced(model, handle.new_cache(), ids, mask)
        assert handle.new_cache().kv_dtype == torch.int8
    live = mask[:, -1].bool()
    torch.testing.assert_close(got[live], expected[live], atol=5e-2, rtol=5e-2)
    assert torch.equal(got[live].argmax(-1), expected[live].argmax(-1))


def test_bad_kv_dtype_is_refused_naming_what_is_accepted():
    with pytest.raises(ValueError, match=r"kv_dtype must be None .* or 'int8'.*'fp8'"):
        kvcache_ext.RaggedKVStore(1, 1, 8, kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype must be"):
        kvcache_ext.RaggedKVStore(1, 1, 8, dtype=torch.float32, kv_dtype=torch.float16)
    with pytest.raises(TypeError, match="kv_dtype must be"):
        kvcache_ext.RaggedKVStore(1, 1, 8, kv_dtype=8)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="patch kv_dtype must be"):
        kvcache_ext.patch(model, Policy(SnapKV(), budget=64), kv_dtype="int4")
    # The ops refuse int8 pages with rows of an integer dtype, naming them.
    store = kvcache_ext.RaggedKVStore(1, 1, 8, dtype=torch.float32, kv_dtype="int8")
    with pytest.raises(TypeError, match="must have the store's dtype"):
        store.append(torch.ones(1, 1, 1, 8, dtype=torch.int8), torch.ones(1, 1, 1, 8, dtype=torch.int8), [0])
    assert store.num_tokens == 0


def test_fork_and_repack_move_the_scales_with_their_tokens(device):
    store = kvcache_ext.RaggedKVStore(2, 2, 16, dtype=torch.float32, kv_dtype="int8", page_size=4, device=device)
    k = (torch.randn(2, 2, 11, 16) * torch.logspace(-2, 2, 11)[:, None]).to(device)
    store.append(k, -k, torch.arange(11))
    store.compact((torch.rand(store.capacity) < 0.6).to(device), stable=False)
    before = store.to_dense()
    fork = store.fork()
    fork.append(k[:, :, :1].contiguous(), k[:, :, :1].contiguous(), torch.tensor([11]))
    store.repack(3)
    for other in (store, fork):
        dense = other.to_dense()
        L = before.k.shape[2]
        assert torch.equal(dense.k[:, :, :L][before.mask], before.k[before.mask])
        assert torch.equal(dense.v[:, :, :L][before.mask], before.v[before.mask])


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_of_the_ops_on_int8_pages(device, dtype):
    """Schema, fake and AOT dispatch of every op that reads or writes a store, on int8 pages."""
    from torch.library import opcheck

    from kvcache_ext.kernels.ops import ops
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    gen = torch.Generator().manual_seed(0)
    B, H, G, D, P, C = 2, 2, 3, 64, 4, 2
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, kv_dtype="int8", score_channels=C, page_size=P,
                                      device=device)
    k, v = (torch.randn(B, H, 9, D, generator=gen).to(dtype).to(device) for _ in range(2))
    store.append(k, v, torch.arange(9))
    store.compact((torch.rand(store.capacity, generator=gen) < 0.7).to(device))
    new_k, new_v = (torch.randn(B, H, 1, D, generator=gen).to(dtype).to(device) for _ in range(2))
    pos32, rank, counts = store._allocator.prepare_append(new_k, new_v, torch.full((B, 1), 20), None)
    store._refresh()
    pool, table, lens = store.state()
    opcheck(ops.store_append, (pool, table, lens, new_k, new_v, pos32, rank, counts, P, C, torch.int8),
            test_utils=utils)
    meta = (P, D, C, torch.int8)
    q = torch.randn(B, H * G, 1, D, generator=gen).to(dtype).to(device)
    plan = store.attention_plan(G)
    opcheck(ops.attention_run, (q, pool, table, lens, plan, None, 0.25, H, *meta, True, True, True, True),
            test_utils=utils)
    slot = torch.zeros(B, H, dtype=torch.long, device=device)
    opcheck(ops.store_replace, (pool, table, lens, slot, new_k, new_v, torch.full((B,), 21, device=device), *meta,
                                True), test_utils=utils)
    keep = (torch.rand(store.capacity, generator=gen) < 0.5).to(device)
    opcheck(ops.store_compact, (pool, table, lens, keep, *meta, False), test_utils=utils)
    opcheck(ops.store_topk, (pool, table, lens, None, torch.full((B * H,), 2, device=device), 1, *meta),
            test_utils=utils)
    pos32, rank, counts = store._allocator.prepare_append(new_k, new_v, torch.full((B, 1), 22), None)
    store._refresh()
    pool, table, lens = store.state()
    plan = store.attention_plan(G)
    opcheck(ops.store_decode_step, (pool, table, lens, q, new_k, new_v, pos32, rank, counts, plan, None, 0.25, P, C,
                                    True, True, False, False, [0], "mass", 1, 0, None,
                                    torch.full((B * H,), 3, dtype=torch.int32, device=device), torch.int8),
            test_utils=utils)


def test_eval_runs_on_int8_pages_under_their_own_name():
    """The evaluation's runs (here the fidelity task's) patch with the kv_dtype asked for and
    record those runs as policy+int8, beside the full cache's."""
    from kvcache_ext.evaluation import fidelity
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids = torch.randint(3, 60, (1, 108), generator=torch.Generator().manual_seed(0))
    records = fidelity.run_text(model, ids[:, :100], ids[:, 100:], 0, ["full", "snapkv"], [40], kv_dtype="int8")
    assert [r.policy for r in records] == ["full", "snapkv+int8"]
    full, int8 = records
    assert int8.kv_bytes < full.kv_bytes and 0.5 <= int8.top1 <= 1.0


def test_the_command_line_refuses_int8_where_nothing_would_hold_it():
    from kvcache_ext import cli
    assert cli.main(["serve", "--policy", "full", "--kv-dtype", "int8"]) == 2
    assert cli.main(["eval", "--task", "passkey", "--kv-dtype", "int4", "--no-progress"]) == 2



from test_attention import check_work_split, cpu_isa  # noqa: E402,F401  (cpu_isa: a fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("G, n", [(1, 1), (3, 5), (4, 70)])
def test_int8_work_split_on_every_cpu_isa(cpu_isa, dtype, page_size, G, n):
    """test_attention's work split on int8 pages, with each vector ISA's int8 loads, against the
    reference over the dequantized rows."""
    check_work_split(dtype, page_size, G, n, kv_dtype="int8")

def test_graph_steps_on_int8_pages_give_the_eager_steps(monkeypatch):
    """A decode step captured once and replayed (here by the CPU graph emulator) over int8 pages:
    the appends into held pages, the decode step op with a plan of the pages, and an eviction by
    a slot rule give the eager steps' tokens, logits and kept positions."""
    from test_decode_graph import EVICTING, ONE_SHOT, assert_same_generation, generate
    from graph_emulator import EmulatedGraphs
    from kvcache_ext.hf import decode_graph
    monkeypatch.setitem(decode_graph.BACKENDS, "cpu", EmulatedGraphs)
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    for policy, counts in [(ONE_SHOT[0], (1, 1, 5, 1)), EVICTING[0], EVICTING[3]]:
        eager = generate(model, policy, cuda_graph=False, kv_dtype="int8")
        graphed = generate(model, policy, cuda_graph=True, kv_dtype="int8")
        assert_same_generation(eager, graphed)
        graph = graphed[3]
        assert (graph.warmups, graph.captures, graph.replays, graph.eager_steps) == counts, policy
        assert graph.failed is None

