"""The kernels as torch custom ops (kvcache_ext.kernels.ops): torch.library.opcheck of every op (schema,
fake implementation, dynamic-shape tracing) over several store shapes, the ops against the
store's own methods, and torch.compile of the ops and of a patched tiny model's decoding."""
import pytest
import torch
from torch.library import opcheck

import kvcache_ext
from kvcache_ext import reference
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.kernels.ops import OPS, ops
from conftest import DEVICES

# (batch, kv heads, query heads, head_dim, page_size, prompt, keep probability): empty and
# one-token segments (keep 0.05 of 6), GQA and MHA, batch > 1, pages of one token.
SHAPES = [
    (1, 1, 1, 8, 4, 5, 1.0),
    (2, 2, 4, 16, 4, 6, 0.05),    # GQA, several segments empty or of one slot
    (3, 2, 2, 8, 1, 7, 0.5),      # pages of one token
    (2, 1, 3, 16, 16, 40, 0.7),   # MQA-like, G = 3
    (1, 2, 8, 64, 16, 0, 1.0),    # an empty store (no page at all)
]
# opcheck's tests; test_autograd_registration is moot (no op takes a tensor that needs grad).
UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def make_store(shape, device, dtype=torch.float32, channels=2, seed=0):
    B, H, Hq, D, P, prompt, keep_p = shape
    gen = torch.Generator().manual_seed(seed)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, score_channels=channels,
                                      page_size=P)
    if prompt:
        k, v = (torch.randn(B, H, prompt, D, generator=gen).to(dtype).to(device) for _ in range(2))
        store.append(k, v, torch.arange(prompt))
        store.set_scores(torch.randn(store.capacity, channels, generator=gen).to(device))
        store.compact((torch.rand(store.capacity, generator=gen) < keep_p).to(device))
    return store


def tokens(store, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (store.batch, store.heads, n, store.head_dim)
    return [torch.randn(shape, generator=gen).to(store.dtype).to(store.device) for _ in range(2)]


def meta(store):
    return store._page_size, store._head_dim, store._channels, store._dtype


def test_every_op_is_registered_with_a_fake():
    for name in OPS:
        op = getattr(ops, name).default
        assert op._schema.name == f"kvcache_ext::{name}"
        assert torch._library.simple_registry.singleton.find(
            f"kvcache_ext::{name}").fake_impl.kernel is not None, name


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("some", [False, True], ids=["all_tokens", "some_tokens"])
def test_opcheck_store_append(device, shape, some):
    store = make_store(shape, device)
    n = 4 if some else 3
    k, v = tokens(store, n)
    valid = None
    if some:   # only the valid tokens are stored: the op gets their ranks and counts
        valid = (torch.rand(store.batch, store.heads, n, generator=torch.Generator().manual_seed(3)) < 0.5).to(device)
    pos32, rank, counts = store._allocator.prepare_append(k, v, torch.arange(100, 100 + n), valid)
    store._refresh()
    assert (rank is not None and counts is not None) == some
    pool, table, lens = store.state()
    P, D, C, dtype = meta(store)
    opcheck(ops.store_append, (pool, table, lens, k, v, pos32, rank, counts, P, C),
            test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_replace(device, shape):
    store = make_store(shape, device)
    k, v = tokens(store, 1)
    store.append(k, v, torch.full((store.batch, 1), 50))  # every segment holds a token
    slot = (store.lens - 1).clamp(min=0)
    pool, table, lens = store.state()
    P, D, C, dtype = meta(store)
    k, v = tokens(store, 1, seed=2)
    opcheck(ops.store_replace, (pool, table, lens, slot, k, v, torch.full((store.batch,), 51),
                                P, D, C, dtype, True), test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_compact(device, shape):
    store = make_store(shape, device)
    keep = (torch.rand(store.capacity, generator=torch.Generator().manual_seed(4)) < 0.5).to(device)
    pool, table, lens = store.state()
    opcheck(ops.store_compact, (pool, table, lens, keep, *meta(store)), test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_topk(device, shape, grouped):
    store = make_store(shape, device)
    pool, table, lens = store.state()
    groups = store.batch if grouped else store.batch * store.heads
    k = (torch.arange(groups) % 3).to(device)
    P, D, C, dtype = meta(store)
    opcheck(ops.store_topk, (pool, table, lens, None, k, store.heads if grouped else 1, P, D, C, dtype),
            test_utils=UTILS)
    scores = torch.randn(store.capacity, generator=torch.Generator().manual_seed(5)).to(device)
    opcheck(ops.store_topk, (pool, table, lens, scores, k, store.heads if grouped else 1, P, D, C, dtype),
            test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule", ["mass", "position"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_topk_by_a_slot_rule(device, shape, rule):
    store = make_store(shape, device)
    pool, table, lens = store.state()
    k = (torch.arange(store.batch * store.heads, dtype=torch.int32) % 3).to(device)
    last_pos = torch.full((store.batch,), 40, device=device)
    opcheck(ops.store_topk, (pool, table, lens, None, k, 1, *meta(store), rule, 1, 2, last_pos),
            test_utils=UTILS)
    opcheck(ops.store_topk, (pool, table, lens, None, k, 1, *meta(store), rule), test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_store_add_scores(device, shape):
    store = make_store(shape, device)
    values = torch.randn(store.capacity, generator=torch.Generator().manual_seed(7)).to(device)
    pool, table, lens = store.state()
    opcheck(ops.store_add_scores, (pool, table, lens, values, 1, *meta(store)), test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evict", [False, True], ids=["append_attend", "accumulate_evict"])
def test_opcheck_store_decode_step(device, shape, evict):
    store = make_store(shape, device)
    k, v = tokens(store, 1)
    B, H, Hq, D = shape[:4]
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(5)).to(device)
    pos32, rank, counts = store._allocator.prepare_append(k, v, torch.full((B, 1), 100), None)
    store._refresh()
    plan = store.attention_plan(Hq // H)
    pool, table, lens = store.state()
    P, _, C, _ = meta(store)
    rest = ([0, 3], "mass", 1, 2, torch.full((B,), 100, device=device),
            torch.full((B * H,), 3, dtype=torch.int32, device=device)) if evict else ([],)
    opcheck(ops.store_decode_step, (pool, table, lens, q, k, v, pos32, rank, counts, plan, None, 0.25, P, C,
                                    True, evict, False, False, *rest), test_utils=UTILS)


def packed_segments(lens, seed=6):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    start = torch.cumsum(lens.long(), 0) - lens.long()
    capacity = int(lens.sum()) + 2   # slack slots at the end
    return (torch.randn(capacity, generator=gen), torch.randperm(capacity, generator=gen).int(),
            start, lens)


@pytest.mark.parametrize("lens", [[0], [1], [5, 0, 1, 7], [3, 3, 3, 3, 3, 3]])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_segmented_and_grouped_topk(device, lens):
    scores, pos, start, len_ = (t.to(device) for t in packed_segments(lens))
    k = torch.tensor([2] * len(lens), device=device)
    opcheck(ops.segmented_topk, (scores, pos, start, len_, k), test_utils=UTILS)
    opcheck(ops.segmented_topk, (scores, pos, start, len_, k.to(torch.int8), False), test_utils=UTILS)
    group = 2 if len(lens) % 2 == 0 else 1
    kg = torch.tensor([3] * (len(lens) // group), device=device)
    opcheck(ops.grouped_topk, (scores, pos, start, len_, group, kg), test_utils=UTILS)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n,stats", [(1, ()), (1, ("mass", "last", "sum_sq", "count")),
                                     (5, ("mass", "count"))])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_attention_run(device, shape, n, stats):
    store = make_store(shape, device)
    B, H, Hq, D = shape[:4]
    if device == "cuda" and D not in kvcache_ext.kernels.attention.CUDA_HEAD_DIMS:
        D = 64
        store = make_store(shape[:3] + (64,) + shape[4:], device)
    q = torch.randn(B, Hq, n, D, generator=torch.Generator().manual_seed(7)).to(device)
    plan = store.attention_plan(Hq // H * n)
    pool, table, lens = store.state()
    P, _, C, dtype = meta(store)
    flags = [name in stats for name in kvcache_ext.STAT_NAMES]
    q_pos = torch.arange(shape[5] - n + 2, shape[5] + 2).expand(B, n) if n > 1 else None
    opcheck(ops.attention_run, (q, pool, table, lens, plan, q_pos, 0.3, H, P, D, C, dtype, *flags),
            test_utils=UTILS)


def test_accessors_and_state():
    """Accessors are copies; ``state`` hands the store's own tensors, for the ops."""
    store = make_store(SHAPES[1], "cpu")
    before = store.to_dense()
    for name in ("len", "page_table", "lens", "caps", "k", "v", "pos", "scores"):
        value = getattr(store, name)
        value.fill_(3)
    after = store.to_dense()
    assert torch.equal(before.lens, after.lens) and torch.equal(before.k, after.k)
    pool, table, lens = store.state()
    assert lens.data_ptr() == store._len.data_ptr()   # the ops mutate the store through these


def test_a_stale_attention_plan_gives_the_same_result_on_cpu():
    """As on CUDA (tests/test_cuda_metadata.py): a plan made before an append, or for the
    lengths the pages hold (what a captured decode step attends with), serves the store's
    current lengths; a plan of another number of segments is refused."""
    store = make_store(SHAPES[1], "cpu")
    q = torch.randn(2, 4, 1, 16)
    plan = store.attention_plan(2)
    k, v = tokens(store, 1)
    store.append(k, v, torch.full((2, 1), 99))
    want, want_stats = kvcache_ext.ragged_attention(q, store, stats=True)
    for stale in (plan, store.attention_plan_of_pages(2)):
        out, stats = kvcache_ext.ragged_attention(q, store, stats=True, plan=stale)
        assert torch.equal(out, want) and torch.equal(stats.mass, want_stats.mass)
    with pytest.raises(ValueError, match="plan must be a CPU plan of this store's"):
        kvcache_ext.ragged_attention(q, store, plan=plan[:-1])


def test_ops_refuse_a_state_that_does_not_cover_the_tokens():
    store = make_store(SHAPES[0], "cpu")
    pool, table, lens = store.state()
    k, v = tokens(store, 64)   # more than the pages hold: prepare_append was not called
    with pytest.raises(ValueError, match="pages"):
        ops.store_append(pool, table, lens, k, v, torch.arange(64), None, None, store._page_size,
                         store._channels)
    with pytest.raises(ValueError, match="pool"):
        ops.store_compact(pool, table, lens, torch.ones(store.capacity, dtype=torch.bool), 4, 16, 2,
                          torch.float32)


# --- torch.compile --------------------------------------------------------------------------

def test_ops_compile_fullgraph():
    """The ops themselves trace into one graph (fake implementations, mutation of the state)."""
    store = make_store(SHAPES[1], "cpu")
    k, v = tokens(store, 1)
    pos32, rank, counts = store._allocator.prepare_append(k, v, torch.full((2, 1), 60), None)
    store._refresh()
    pool, table, lens = store.state()
    P, D, C, dtype = meta(store)
    plan = store.attention_plan(2)   # the lengths after the append (host copy advanced)
    q = torch.randn(2, 4, 1, 16)

    def step(pool, table, lens, q, k, v, pos, plan):
        ops.store_append(pool, table, lens, k, v, pos, None, None, P, C)
        out, mass, *_ = ops.attention_run(q, pool, table, lens, plan, None, 0.25, 2, P, D, C, dtype,
                                          True, False, False, False)
        return out * 2, mass

    eager_store = make_store(SHAPES[1], "cpu")
    eager_store.append(k, v, torch.full((2, 1), 60))
    want, want_stats = kvcache_ext.ragged_attention(q, eager_store, 0.25, stats=("mass",))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, mass = compiled(pool, table, lens, q, k, v, pos32, plan)
    assert torch.equal(lens, eager_store._len)
    torch.testing.assert_close(out, want * 2)
    torch.testing.assert_close(mass, want_stats.mass)
    assert torch.equal(store.to_dense().k, eager_store.to_dense().k)


def test_compiled_attention_after_eager_appends_reads_the_new_pages():
    """Eager appends that add pages give the store new state tensors; a compiled function
    that reads the store next sees them (its guards on the store's state fail: it recompiles)."""
    store, twin = make_store(SHAPES[1], "cpu"), make_store(SHAPES[1], "cpu")
    compiled = torch.compile(lambda q, s: kvcache_ext.ragged_attention(q, s, 0.25)[0], backend="aot_eager")
    q = torch.randn(2, 4, 1, 16)
    torch.testing.assert_close(compiled(q, store), kvcache_ext.ragged_attention(q, twin, 0.25)[0])
    allocations = store.slab_allocations
    for step in range(2 * store.page_size):
        k, v = tokens(store, 1, seed=step)
        store.append(k, v, torch.full((2, 1), 60 + step))
        twin.append(k, v, torch.full((2, 1), 60 + step))
        torch.testing.assert_close(compiled(q, store), kvcache_ext.ragged_attention(q, twin, 0.25)[0])
    assert store.slab_allocations > allocations      # the steps did add pages


def _graph_ops(gm):
    return {str(node.target).removesuffix(".default") for node in gm.graph.nodes
            if node.op == "call_function" and "kvcache_ext" in str(node.target)}


@pytest.mark.parametrize("policy_name", ["snapkv", "h2o-every-step"])
def test_patched_tiny_model_under_torch_compile(policy_name):
    """A patched tiny model's forward under torch.compile gives the eager logits, and the
    kernels run as ops inside the compiled graphs (the store's host steps break the graph:
    see docs/kernels.md "Custom ops")."""
    from tiny_models import tiny_model
    from kvcache_ext.policies import H2O, EveryStep, Policy, SnapKV

    torch._dynamo.reset()
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=16)
    policy = (Policy(SnapKV(window=4), budget=12) if policy_name == "snapkv"
              else Policy(H2O(), budget=12, schedule=EveryStep()))
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    seen = set()

    def backend(gm, example_inputs):
        seen.update(_graph_ops(gm))
        return gm.forward

    def run(compile_it):
        handle = kvcache_ext.patch(model, policy)
        try:
            cache = handle.new_cache()
            forward = torch.compile(model, backend=backend) if compile_it else model
            logits = [forward(input_ids=ids, **with_cache(model, cache)).logits[:, -1]]
            token = logits[-1].argmax(-1, keepdim=True)
            for _ in range(4):
                logits.append(forward(input_ids=token, **with_cache(model, cache)).logits[:, -1])
                token = logits[-1].argmax(-1, keepdim=True)
            return torch.stack(logits)
        finally:
            handle.unpatch()

    # The cache's Python counters (tokens seen, decode steps) are guarded on: every step
    # recompiles the frames that read them, past dynamo's default limit of 8.
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64,
                                                     accumulated_recompile_limit=4096):
        want = run(False)
        got = run(True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The prompt's top-k too (it ran through pybind, a graph break, before 2026-11-26).
    # The prompt's append and top-k, and every decode step as its one op.
    assert {"kvcache_ext.store_decode_step", "kvcache_ext.store_append", "kvcache_ext.segmented_topk"} <= seen, seen
