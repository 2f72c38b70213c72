"""Bad input at every public entry point (issue 21; docs/errors.md lists what each refuses).

Property-based: for every generated input, either the call gives the correct result (checked
against ``kvcache_ext.reference``, or against what the input means) or it raises a typed error
(TypeError for the wrong type, ValueError for a value out of range, IndexError for a slot out
of a segment) whose message names the argument; after an error the store, cache or model is as
it was. The input is valid exactly when the test's own predicate says so: an input that is
refused must be invalid, and an invalid one must be refused.
"""
import math
import numbers

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvcache_ext
from kvcache_ext import RaggedKVStore, ragged_attention, reference
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.checks import INT32_MAX, INT64_MAX
from kvcache_ext.policies import (CAOTE, H2O, KVEC, TOVA, AdaKV, AhaKV, BlockwisePrefill, EveryNSteps,
                                  EveryStep, OneShot, Policy, Pooled, Pooling, Protection, Pyramid, Random,
                                  RoCo, Schedule, ScissorHands, SnapKV, Spanned, Spans, StreamingLLM, Uniform)
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
ERRORS = (TypeError, ValueError, IndexError, RuntimeError)


def refused(call, *names):
    """The error ``call`` raises (one of ERRORS, naming one of ``names``), or None if it returns."""
    try:
        call()
    except ERRORS as err:
        assert any(n in str(err) for n in names), f"{type(err).__name__} does not name {names}: {err}"
        return err
    return None


# ------------------------------------------------------------------ what users pass
INTS = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70),
                 st.sampled_from([0, 1, 65535, 65536, 2**31 - 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2.0, 2.0),
                   st.integers(-3, 300).map(float), st.sampled_from([0.5, 1.0, 0.0, 1e39, -0.0]))
ANY = st.one_of(INTS, FLOATS, st.booleans(), st.none(), st.text(max_size=3),
                st.sampled_from(["max", "mean", "avg", "sum", "group_l2", "shared", "0.5", "8",
                                 [1, 2], (3,), np.int64(5), np.float32(0.5), np.bool_(True)]))


def is_bool(v):
    return isinstance(v, (bool, np.bool_))


def as_int(v):
    """The integer a value stands for (an int, or a float of integral value), or None."""
    if is_bool(v):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v) == int(v):
        return int(v)
    return None


def int_in(low, high=INT32_MAX, odd=False):
    def ok(v):
        n = as_int(v)
        return n is not None and low <= n <= high and (not odd or n % 2 == 1)
    return ok


def real_in(low=None, high=None, low_open=False, allow_inf=False):
    def ok(v):
        if is_bool(v) or not isinstance(v, numbers.Real):
            return False
        f = float(v)
        if math.isnan(f) or (math.isinf(f) and not allow_inf):
            return False
        return (low is None or f > low or (f == low and not low_open)) and (high is None or f <= high)
    return ok


def one_of(*choices):
    return lambda v: isinstance(v, str) and v in choices


def boolean(v):
    return is_bool(v)


# (what is built, the argument, the predicate of the values it accepts); other arguments default.
PARAMS = [
    (SnapKV, "window", int_in(1)), (SnapKV, "kernel", int_in(1, odd=True)),
    (SnapKV, "pooling", one_of("max", "avg")), (SnapKV, "gqa", one_of("mean", "max")),
    (SnapKV, "order", one_of("mean_then_pool", "pool_then_mean")),
    (H2O, "recent", int_in(0)), (H2O, "query_heads", int_in(0, 65535)),
    (TOVA, "per_head", boolean), (StreamingLLM, "sinks", int_in(0)), (Random, "seed", int_in(0, INT64_MAX)),
    (RoCo, "robust", real_in(0.0, 1.0)), (RoCo, "fresh", int_in(0)), (RoCo, "sinks", int_in(0)),
    (ScissorHands, "window", real_in(0.0, 1.0)), (ScissorHands, "inclusive", boolean),
    (AhaKV, "recent", int_in(1)), (AhaKV, "rows", lambda v: v is None or int_in(1)(v)),
    (AhaKV, "kernel", int_in(1, odd=True)), (AhaKV, "sinks", int_in(0)), (AhaKV, "decode_prior", boolean),
    (AhaKV, "reading", one_of("consistent", "literal")), (AhaKV, "gqa", one_of("mean", "sum", "max")),
    (KVEC, "window", int_in(1, 31)), (KVEC, "extended_window", int_in(17)), (KVEC, "delta", int_in(0)),
    (KVEC, "lam", real_in(0.0)), (KVEC, "beta", real_in(0.0, 1.0)),
    (KVEC, "protect_value", real_in(allow_inf=True)), (KVEC, "keep_recent", int_in(0)),
    (KVEC, "kernel", int_in(1, odd=True)), (KVEC, "importance_heads", one_of("query", "kv")),
    (CAOTE, "fast", boolean), (CAOTE, "output_after_eviction", boolean), (CAOTE, "max_groups", int_in(1, 65535)),
    (CAOTE, "gqa", one_of("group_l2", "mean", "sum", "max", "shared")),
    (Pooling, "kernel", int_in(1, odd=True)), (Pooling, "mode", one_of("max", "avg")),
    (AdaKV, "alpha", real_in(0.0, 1.0)), (AdaKV, "layers", lambda v: False),
    (AdaKV, "across_ranks", one_of("exact", "per_rank")),
    (Pyramid, "beta", int_in(1)),
    (Protection, "sinks", int_in(0, INT32_MAX - 1)), (Protection, "recent", int_in(0, INT32_MAX - 1)),
    (Schedule, "prefill_block", lambda v: v is None or int_in(1, 256)(v)),
    (Schedule, "decode_every", lambda v: v is None or int_in(1)(v)),
    (BlockwisePrefill, "block", int_in(1, 256)), (EveryNSteps, "n", int_in(1)),
    (EveryStep, "prefill_block", lambda v: v is None or int_in(1, 256)(v)),
    (lambda **kw: Policy(H2O(), **kw), "budget", int_in(1)),
    (lambda **kw: Policy(H2O(), **kw), "ratio", real_in(0.0, 1.0, low_open=True)),
    (lambda **kw: Policy(H2O(), budget=8, **kw), "allocation", lambda v: False),
    (lambda **kw: Policy(H2O(), budget=8, **kw), "schedule", lambda v: False),
    (lambda **kw: Policy(H2O(), budget=8, **kw), "protection", lambda v: v is None),
    (lambda **kw: Pooled(H2O(), **kw), "pooling", lambda v: False),
    (Spans, "unit", one_of("number", "word", "sentence")), (Spans, "reduce", one_of("max", "mean")),
    (lambda **kw: Spanned(H2O(), **kw), "spans", lambda v: False),
    (lambda **kw: Spanned(**kw), "base", lambda v: False),
    (lambda **kw: CAOTE(**kw), "base", lambda v: False),
]


@pytest.mark.parametrize("make, name, valid", PARAMS, ids=[f"{i}-{n}" for i, (_, n, _) in enumerate(PARAMS)])
@FAST
@given(value=ANY)
def test_policy_parts_check_every_argument(make, name, valid, value):
    """A part takes exactly the values its argument accepts (normalized: 8.0 is the int 8),
    and refuses the others with the argument's name in the message."""
    err = refused(lambda: make(**{name: value}), name, "n" if name == "block" else name)
    if valid(value):
        assert err is None, f"{name}={value!r} is valid but was refused: {err}"
        built = make(**{name: value})
        field = {"block": "prefill_block", "n": "decode_every"}.get(name, name)
        got = getattr(built, field)
        if name == "protection":     # None: the scorer's own
            assert got == (value if value is not None else H2O().default_protection())
        elif value is None or isinstance(value, str):
            assert got == value
        elif is_bool(value):
            assert got is bool(value)
        elif type(got) is int:       # an integer argument: the integer the value stands for
            assert got == as_int(value)
        else:                        # a real argument: a float of the same value
            assert type(got) is float and got == float(value)
    else:
        assert err is not None, f"{name}={value!r} is invalid but was accepted"
        assert isinstance(err, (TypeError, ValueError)) and not isinstance(err, IndexError)


def test_parts_changed_after_they_were_built_are_checked_again():
    policy = Policy(SnapKV(), budget=64)
    policy.budget = 0
    with pytest.raises(ValueError, match="budget"):
        policy.check()
    policy = Policy(SnapKV(), budget=64)
    policy.scorer.window = 1.5
    with pytest.raises(ValueError, match="window"):
        kvcache_ext.patch(tiny_model(), policy)


# ------------------------------------------------------------------ Policy and patch combinations
SCORERS = st.sampled_from([
    lambda: SnapKV(window=4), lambda: SnapKV(window=4, gqa="max"), lambda: SnapKV(window=1, gqa="max"),
    lambda: SnapKV(window=4, order="pool_then_mean"), lambda: H2O(), lambda: TOVA(), lambda: StreamingLLM(),
    lambda: KVEC(window=4, extended_window=8), lambda: RoCo(), lambda: AhaKV(recent=4), lambda: Random(),
    lambda: CAOTE(H2O(), gqa="group_l2", max_groups=2), lambda: CAOTE(SnapKV(window=4, gqa="max")),
    lambda: CAOTE(TOVA(), gqa="max", fast=True), lambda: ScissorHands(), lambda: Pooled(RoCo()),
    lambda: AhaKV(recent=2, rows=3), lambda: KVEC(window=2, extended_window=4, keep_recent=3),
])
SCHEDULES = st.sampled_from([OneShot, lambda: BlockwisePrefill(8), lambda: BlockwisePrefill(1), EveryStep,
                             lambda: EveryNSteps(2, target=6), lambda: EveryStep(prefill_block=4)])
ALLOCATIONS = st.sampled_from([Uniform, Pyramid, AdaKV, lambda: AdaKV(layers=Pyramid())])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(scorer=SCORERS, schedule=SCHEDULES, allocation=ALLOCATIONS,
       size=st.one_of(st.integers(1, 24).map(lambda b: dict(budget=b)),
                      st.sampled_from([0.1, 0.5, 1.0]).map(lambda r: dict(ratio=r))),
       kv_heads=st.sampled_from([1, 2, 4]), length=st.integers(6, 30))
def test_a_policy_is_refused_when_built_or_patched_or_it_runs(scorer, schedule, allocation, size,
                                                             kv_heads, length):
    """Nothing a user can build fails inside generate: Policy() or patch() refuses it (naming
    what is wrong, the model untouched), or generate runs it."""
    try:
        policy = Policy(scorer(), schedule=schedule(), allocation=allocation(), **size)
    except ValueError as err:
        assert any(w in str(err) for w in ("budget", "decode_target", "gqa", "order", "K-VEC", "protect")), err
        return
    model = tiny_model(kv_heads=kv_heads)      # 4 query heads: G = 4, 2 or 1
    attn = model.config._attn_implementation
    try:
        handle = kvcache_ext.patch(model, policy)
    except ValueError as err:
        assert "max_groups" in str(err), err
        assert not kvcache_ext.is_patched(model) and model.config._attn_implementation == attn
        return
    with handle:
        ids = torch.randint(0, 100, (1, length), generator=torch.Generator().manual_seed(length))
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape[0] == 1 and length < out.sequences.shape[1] <= length + 3


def test_patch_refuses_what_the_model_cannot_run_and_leaves_it_unpatched():
    model = tiny_model(heads=4, kv_heads=1)   # G = 4
    for policy, name in [(Policy(CAOTE(H2O(), gqa="group_l2", max_groups=2), budget=8), "max_groups"),
                         (Policy(H2O(query_heads=3), budget=8, schedule=EveryStep()), "query_heads")]:
        with pytest.raises(ValueError, match=name):
            kvcache_ext.patch(model, policy)
        assert not kvcache_ext.is_patched(model) and model.config._attn_implementation == "sdpa"
    for bad, name in [("policy", "policy"), (Policy(H2O(), budget=8), "page_size")]:
        with pytest.raises((TypeError, ValueError), match=name):
            kvcache_ext.patch(model, bad, page_size=True) if name == "page_size" else kvcache_ext.patch(model, bad)
        assert not kvcache_ext.is_patched(model)
    with pytest.raises(TypeError, match="reserve_new_tokens"):
        kvcache_ext.patch(model, Policy(H2O(), budget=8), reserve_new_tokens="yes")
    assert not kvcache_ext.is_patched(model)
    with pytest.raises(TypeError, match="patch tokenizer .* got int"):   # not deep inside generate
        kvcache_ext.patch(model, Policy(H2O(), budget=8), tokenizer=5)
    assert not kvcache_ext.is_patched(model)
    with pytest.raises(TypeError, match="causal LM .* got LlamaModel"):
        kvcache_ext.patch(model.model, Policy(H2O(), budget=8))


@pytest.mark.parametrize("bad", [0, -5, 2**31, 1.5, "100", True])
def test_a_cache_refuses_a_length_that_is_not_a_positive_integer(bad):
    from kvcache_ext import RaggedCache
    with pytest.raises((TypeError, ValueError), match="max_cache_len"):
        RaggedCache(Policy(H2O(), budget=8), 2, max_cache_len=bad)


# ------------------------------------------------------------------ a cache knows its model
def cache_state(cache):
    out = [cache.get_seq_length()]
    for layer in cache.layers:
        kv = layer.state.kv
        out.append(None if kv is None else (kv.store.to_dense().k.clone(), kv.store.lens.clone()))
    return out


def same_state(a, b):
    if len(a) != len(b) or a[0] != b[0]:
        return False
    for x, y in zip(a[1:], b[1:]):
        if (x is None) != (y is None) or (x is not None and not (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]))):
            return False
    return True


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(layers=st.sampled_from([(2, 2), (2, 3), (3, 2)]), heads=st.sampled_from([(2, 2), (2, 1), (1, 2)]),
       dims=st.sampled_from([(16, 16), (16, 8)]), filled=st.booleans(), unpatch=st.booleans())
def test_a_cache_refuses_another_model_or_an_unpatched_one_before_it_changes(layers, heads, dims, filled,
                                                                          unpatch):
    a = tiny_model(layers=layers[0], kv_heads=heads[0], head_dim=dims[0])
    b = tiny_model(layers=layers[1], kv_heads=heads[1], head_dim=dims[1], seed=1)
    policy = Policy(H2O(), budget=8)
    cache = kvcache_ext.patch(a, policy).new_cache()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    if filled:
        a(ids, **with_cache(a, cache), use_cache=True)
    if unpatch:
        kvcache_ext.unpatch(a)
        user = a
    else:
        kvcache_ext.patch(b, policy)
        user = b
    before = cache_state(cache)
    differs = layers[0] != layers[1] or (filled and (heads[0] != heads[1] or dims[0] != dims[1]))
    (keyword,) = with_cache(user, cache)   # past_key_values, or cache from transformers 5.24
    err = refused(lambda: user(ids[:, -1:] if filled else ids, **with_cache(user, cache), use_cache=True),
                  keyword)
    if unpatch:
        assert isinstance(err, RuntimeError) if err is not None else False, "an unpatched model used the cache"
    elif differs:
        assert isinstance(err, ValueError), "a cache of another model's shape was taken"
        assert str(err).startswith(f"{keyword}: "), f"not named as the caller named it ({keyword}=): {err}"
    else:
        assert err is None
        return
    assert same_state(before, cache_state(cache)), "the cache changed before the error"
    for m in (a, b):
        if kvcache_ext.is_patched(m):
            kvcache_ext.unpatch(m)


# ------------------------------------------------------------------ the store
def store_state(s):
    d = s.to_dense()
    return [d.k.clone(), d.v.clone(), d.pos.clone(), d.scores.clone(), d.mask.clone(), s.lens.clone(),
            s.capacity, s.num_pages]


def same_store(a, b):
    return all((torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y) for x, y in zip(a, b))


def filled_store(B, H, D, n, seed):
    gen = torch.Generator().manual_seed(seed)
    s = RaggedKVStore(B, H, D, dtype=torch.float32, page_size=4)
    ref = reference.ReferenceStore(B, H, D, dtype=torch.float32)
    k, v = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
    s.append(k, v, torch.arange(n))
    ref.append(k, v, torch.arange(n))
    return s, ref, gen


POSITIONS = st.one_of(st.integers(0, 2**31 - 1), st.integers(-2**40, -1), st.integers(2**31, 2**62),
                      st.sampled_from([0, 2**31 - 1, 2**31, -1]))


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), n=st.integers(0, 9), seed=st.integers(0, 99),
       pos=POSITIONS, dtype=st.sampled_from([torch.int64, torch.int32]), shape=st.sampled_from(["n", "Bn", "bad"]),
       kv_dtype=st.sampled_from([torch.float32, torch.float32, torch.float16]))
def test_append(B, H, n, seed, pos, dtype, shape, kv_dtype):
    s, ref, gen = filled_store(B, H, 4, 5, seed)
    m = 3
    values = pos + torch.arange(m)
    assume(dtype == torch.int64 or (-2**31 <= int(values.min()) and int(values.max()) < 2**31))
    p = values.to(dtype)
    p = {"n": p, "Bn": p.expand(B, m), "bad": p[None, None]}[shape]
    k = torch.randn(B, H, m, 4, generator=gen).to(kv_dtype)
    v = torch.randn(B, H, m, 4, generator=gen).to(kv_dtype)
    before = store_state(s)
    err = refused(lambda: s.append(k, v, p), "pos", "k")
    valid = 0 <= pos and pos + m - 1 <= INT32_MAX and shape != "bad" and kv_dtype == torch.float32
    if not valid:
        assert err is not None and same_store(before, store_state(s))
        return
    assert err is None
    ref.append(k, v, values.to(torch.int32))
    d = s.to_dense()
    assert torch.equal(d.pos, ref.pos) and torch.equal(d.k, ref.k) and torch.equal(s.lens, ref.lens)


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), n=st.integers(0, 6), seed=st.integers(0, 99),
       slot=st.one_of(st.integers(-3, 8), st.integers(-2**62, 2**62)), pos=POSITIONS,
       check_bounds=st.one_of(st.booleans(), st.just(1)))
def test_replace(B, H, n, seed, slot, pos, check_bounds):
    """On a CPU store every slot is bounds-checked, whatever check_bounds says."""
    s, ref, gen = filled_store(B, H, 4, n, seed)
    slots = torch.full((B, H), slot, dtype=torch.int64)
    k = torch.randn(B, H, 1, 4, generator=gen)
    v = torch.randn(B, H, 1, 4, generator=gen)
    before = store_state(s)
    err = refused(lambda: s.replace(slots, k, v, torch.full((B,), pos), check_bounds=check_bounds),
                  "slot", "pos", "check_bounds")
    valid = 0 <= slot < n and 0 <= pos <= INT32_MAX and is_bool(check_bounds)
    if not valid:
        assert err is not None and same_store(before, store_state(s))
        if not (0 <= slot < n) and 0 <= pos <= INT32_MAX and is_bool(check_bounds):
            assert isinstance(err, IndexError)
        return
    assert err is None
    ref.replace(slots, k, v, torch.full((B,), pos))
    d = s.to_dense()
    assert torch.equal(d.pos, ref.pos) and torch.equal(d.k, ref.k) and torch.equal(d.v, ref.v)


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), n=st.integers(0, 9), seed=st.integers(0, 99),
       delta=st.sampled_from([0, 0, 0, -1, 1, 5]), dtype=st.sampled_from([torch.bool, torch.bool, torch.uint8]))
def test_compact(B, H, n, seed, delta, dtype):
    s, ref, gen = filled_store(B, H, 4, n, seed)
    size = s.capacity + delta
    assume(size >= 0)
    keep = torch.rand(size, generator=gen) < 0.5
    keep_padded = s.to_padded(keep) if delta == 0 else None
    before = store_state(s)
    err = refused(lambda: s.compact(keep.to(dtype)), "keep")
    if delta != 0 or dtype != torch.bool:
        assert err is not None and same_store(before, store_state(s))
        return
    assert err is None
    ref.compact(keep_padded)
    d = s.to_dense()
    assert torch.equal(s.lens, ref.lens) and torch.equal(d.pos, ref.pos) and torch.equal(d.k, ref.k)


@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), n=st.integers(0, 9), seed=st.integers(0, 99),
       k=st.one_of(INTS, FLOATS, st.booleans(), st.sampled_from(["2", None])),
       as_tensor=st.sampled_from([None, torch.int8, torch.int64, torch.float32, torch.bool]),
       grouped=st.booleans())
def test_select(B, H, n, seed, k, as_tensor, grouped):
    s, ref, gen = filled_store(B, H, 4, n, seed)
    scores = torch.randn(s.capacity, generator=gen)
    if as_tensor is not None:
        assume(isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k)
               and -128 <= k <= 127)
        k = torch.tensor(k).to(as_tensor)
    err = refused(lambda: s.select(k, scores, grouped=grouped), "k", "budget")
    if isinstance(k, torch.Tensor):
        valid = not (k.dtype.is_floating_point or k.dtype == torch.bool) and int(k) >= 0
        value = int(k) if valid else None
    else:
        value = as_int(k)
        valid = value is not None and value >= 0
    if not valid:
        assert err is not None
        return
    assert err is None
    padded = s.to_padded(scores)
    S = B * H
    keep = s.select(k, scores, grouped=grouped)
    L = padded.shape[-1]
    pos = s.to_dense().pos.reshape(S, L)
    if grouped:
        want, _ = reference.grouped_topk(padded.reshape(S, L), pos, s.lens.view(-1), H, min(value, INT32_MAX))
        keep = keep[0]
    else:
        want = reference.segmented_topk(padded.reshape(S, L), pos, s.lens.view(-1), min(value, INT32_MAX))
    assert torch.equal(s.to_padded(keep).reshape(S, L), want)


@FAST
@given(extra=st.one_of(st.integers(-2**40, -1), st.integers(0, 100), st.integers(2**31, 2**62), FLOATS,
                       st.booleans(), st.just("3")))
def test_reserve_and_repack(extra):
    s, ref, gen = filled_store(1, 2, 4, 5, 0)
    before = store_state(s)
    value = as_int(extra)
    valid = value is not None and 0 <= value <= INT32_MAX
    assume(not valid or value <= 10**4)      # more would allocate gigabytes
    for op in (s.reserve, s.repack):
        err = refused(lambda: op(extra), "extra")
        if not valid:
            assert err is not None and same_store(before, store_state(s))
        else:
            assert err is None and torch.equal(s.lens, ref.lens) and bool((s.caps >= s.lens + value).all())


@FAST
@given(args=st.tuples(INTS, INTS, INTS, INTS, INTS))
def test_store_sizes(args):
    batch, heads, head_dim, channels, page_size = args
    sizes = dict(batch=batch, heads=heads, head_dim=head_dim, score_channels=channels, page_size=page_size)
    valid = (1 <= batch and 1 <= heads and batch * heads <= 4096 and 1 <= head_dim <= 65536
             and 0 <= channels <= 65536 and 1 <= page_size <= 1024 and page_size & (page_size - 1) == 0)
    if not valid and 1 <= batch <= INT32_MAX and 1 <= heads <= INT32_MAX and batch * heads <= INT32_MAX:
        assume(batch * heads <= 4096)    # a valid store this large would allocate gigabytes
    err = refused(lambda: RaggedKVStore(batch, heads, head_dim, score_channels=channels, page_size=page_size),
                  *sizes)
    if valid:
        assert err is None
    else:
        assert err is not None


@FAST
@given(arg=st.sampled_from(["batch", "heads", "head_dim", "score_channels", "page_size"]),
       value=st.one_of(st.booleans(), FLOATS, st.text(max_size=2), st.none()))
def test_store_size_types(arg, value):
    sizes = dict(batch=1, heads=2, head_dim=4, score_channels=1, page_size=4)
    sizes[arg] = value
    batch, heads, head_dim = sizes.pop("batch"), sizes.pop("heads"), sizes.pop("head_dim")
    n = as_int(value)
    if arg in ("batch", "heads") and n is not None and 4096 < n <= INT32_MAX:
        assume(False)       # a valid store this large would allocate gigabytes
    err = refused(lambda: RaggedKVStore(batch, heads, head_dim, **sizes), arg)
    ok = n is not None and {"batch": 1 <= n <= INT32_MAX // 2, "heads": 1 <= n <= INT32_MAX,
                            "head_dim": 1 <= n <= 65536, "score_channels": 0 <= n <= 65536,
                            "page_size": 1 <= n <= 1024 and n & (n - 1) == 0}[arg]
    assert (err is None) == ok


@FAST
@given(lens=st.lists(st.integers(0, 5), min_size=1, max_size=4), seed=st.integers(0, 99),
       pos_extra=st.sampled_from([0, 0, 0, 1, -1]), k=st.one_of(INTS, FLOATS, st.booleans(), st.just("1")),
       group_size=st.one_of(st.sampled_from([1, 2, 3, 4]), st.integers(-2, 0), st.just(1.5)))
def test_segmented_and_grouped_topk(lens, seed, pos_extra, k, group_size):
    gen = torch.Generator().manual_seed(seed)
    S, cap = len(lens), sum(lens)
    scores = torch.randint(-2, 3, (cap,), generator=gen).float()
    pos = torch.randperm(cap + max(pos_extra, 0), generator=gen)[:cap + pos_extra].to(torch.int32)
    length = torch.tensor(lens, dtype=torch.int32)
    start = (torch.cumsum(length, 0) - length).long()
    value = as_int(k)
    k_ok = value is not None and value >= 0
    mismatch = pos.shape[0] != cap
    err = refused(lambda: kvcache_ext.segmented_topk(scores, pos, start, length, k), "k", "budget", "pos", "scores")
    if mismatch or not k_ok:
        assert err is not None
    else:
        assert err is None
        padded = lambda t: torch.stack([torch.nn.functional.pad(t[s:s + n], (0, 5 - n)) for s, n in
                                        zip(start.tolist(), lens)])
        want = reference.segmented_topk(padded(scores), padded(pos), length, min(value, INT32_MAX))
        assert torch.equal(padded(kvcache_ext.segmented_topk(scores, pos, start, length, k)), want)
    g = as_int(group_size)
    err = refused(lambda: kvcache_ext.grouped_topk(scores, pos, start, length, group_size, k),
                  "k", "budget", "pos", "scores", "group_size")
    assert (err is None) == (not mismatch and k_ok and g is not None and g >= 1 and S % g == 0)


# ------------------------------------------------------------------ attention
@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 2), G=st.integers(1, 2), n=st.integers(0, 7), m=st.integers(1, 3),
       seed=st.integers(0, 99),
       scale=st.one_of(st.none(), FLOATS, st.booleans(), st.just("0.1"), st.integers(-3, 3)),
       q_pos=st.one_of(st.none(), st.integers(-2**40, 2**40), st.integers(-3, 12),
                       st.sampled_from([2**31 - 1, 2**31, -2**31, -2**31 - 1])),
       stats=st.sampled_from([False, True, ("mass", "last"), "count", ("bogus",), 1]))
def test_ragged_attention(B, H, G, n, m, seed, scale, q_pos, stats):
    s, ref, gen = filled_store(B, H, 4, n, seed)
    q = torch.randn(B, H * G, m, 4, generator=gen)
    qp = None if q_pos is None else q_pos + torch.arange(m)
    before = store_state(s)
    err = refused(lambda: ragged_attention(q, s, scale, q_pos=qp, stats=stats), "scale", "q_pos", "stat")
    scale_ok = scale is None or (real_in()(scale) and abs(float(scale)) <= float(np.finfo(np.float32).max))
    pos_ok = qp is None or (-2**31 <= int(qp.min()) and int(qp.max()) <= INT32_MAX)
    stats_ok = stats is False or stats is True or stats in (("mass", "last"), "count")
    assert same_store(before, store_state(s))
    if not (scale_ok and pos_ok and stats_ok):
        assert err is not None
        return
    assert err is None
    sc = 1 / math.sqrt(4) if scale is None else float(scale)
    out, st_ = ragged_attention(q, s, scale, q_pos=qp, stats=stats)
    want, want_stats = reference.ragged_attention(q, ref.k, ref.v, ref.pos, ref.mask, sc, qp)
    if abs(sc) <= 10:     # beyond that, float32 logits round differently from float64
        assert torch.allclose(out, want, atol=2e-5, rtol=1e-4)
    else:
        assert torch.isfinite(out).all()


# ------------------------------------------------------------------ tensors on the meta device
# A meta tensor holds no data. The dispatcher runs an op's fake implementation when one of its
# inputs is on meta, so without a check there an op handed one among real tensors did nothing
# and returned (store.compact(keep), store.replace(slot, ...)), or failed deep inside
# (store.append with pos on meta: "Cannot copy out of meta tensor"). Every op and every store
# method refuses such a tensor with a ValueError naming it, its device and the accepted ones,
# and the store is as it was.
def to_meta(value):
    return [to_meta(t) for t in value] if isinstance(value, list) else torch.empty_like(value, device="meta")


def op_arguments(s):
    """Valid arguments of every op on ``s`` (a filled_store: 5 tokens per segment in pages of 4,
    room for 3 more), as {op name: (op, {argument: value})} in the op's schema order."""
    from kvcache_ext.kernels.ops import ops
    pool, table, lens = s.state()
    B, H, D, P, C, dt = s.batch, s.heads, s.head_dim, s.page_size, s.score_channels, s.dtype
    S = B * H
    tokens = lambda n: torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(n))
    state = dict(pool=pool, page_table=table, len=lens)
    layout = dict(page_size=P, head_dim=D, score_channels=C, dtype=dt)
    flat = dict(scores=torch.randn(8), pos=torch.arange(8, dtype=torch.int32),
                start=torch.tensor([0, 4]), len=torch.tensor([3, 4], dtype=torch.int32))
    return {
        "store_append": (ops.store_append, dict(
            **state, k=tokens(2), v=tokens(2), pos=torch.arange(5, 7, dtype=torch.int32).expand(B, 2).contiguous(),
            rank=torch.arange(2, dtype=torch.int32).expand(S, 2).contiguous(),
            counts=torch.full((S,), 2, dtype=torch.int32), page_size=P, score_channels=C)),
        "store_replace": (ops.store_replace, dict(
            **state, slot=torch.zeros(B, H, dtype=torch.long), k=tokens(1), v=tokens(1), pos=torch.full((B,), 9),
            **layout, check_bounds=True)),
        "store_compact": (ops.store_compact, dict(**state, keep=torch.ones(s.capacity, dtype=torch.bool), **layout)),
        "store_topk": (ops.store_topk, dict(**state, scores=torch.randn(s.capacity), k=torch.full((S,), 2),
                                            group_size=1, **layout)),
        "segmented_topk": (ops.segmented_topk, dict(**flat, k=torch.tensor([1, 2]), check_values=True)),
        "grouped_topk": (ops.grouped_topk, dict(**flat, group_size=2, k=torch.tensor([3]), check_values=True)),
        "attention_run": (ops.attention_run, dict(
            q=torch.randn(B, 2 * H, 1, D), **state, plan=s.attention_plan(2), q_pos=torch.full((B, 1), 9),
            scale=0.5, kv_heads=H, **layout, mass=True, last=True, sum_sq=True, count=True)),
    }


@pytest.mark.parametrize("name", ["store_append", "store_replace", "store_compact", "store_topk",
                                  "segmented_topk", "grouped_topk", "attention_run"])
def test_every_op_refuses_a_meta_tensor_among_real_ones(name):
    op, args = op_arguments(filled_store(2, 2, 4, 5, 0)[0])[name]
    op(*args.values())                                   # the arguments themselves are fine
    tensors = [arg for arg, value in args.items() if isinstance(value, (torch.Tensor, list))]
    assert len(tensors) >= 4
    for arg in tensors:
        op, args = op_arguments(filled_store(2, 2, 4, 5, 0)[0])[name]
        args[arg] = to_meta(args[arg])
        with pytest.raises(ValueError, match=rf"^{arg} must be on cpu .*got a tensor on meta"):
            op(*args.values())
    # An op called on meta tensors only (shape inference) runs its fake.
    op, args = op_arguments(filled_store(2, 2, 4, 5, 0)[0])[name]
    op(*(to_meta(v) if isinstance(v, (torch.Tensor, list)) else v for v in args.values()))


def test_every_store_method_refuses_a_meta_tensor():
    B, H, D = 2, 2, 4
    s, _, gen = filled_store(B, H, D, 5, 0)
    k, k1 = torch.randn(B, H, 2, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
    q = torch.randn(B, 2 * H, 1, D, generator=gen)
    meta = lambda t: t.to("meta")
    slot, pos1 = torch.zeros(B, H, dtype=torch.long), torch.full((B,), 9)
    calls = {
        "append k": ("k", lambda: s.append(meta(k), k, torch.arange(5, 7))),
        "append v": ("v", lambda: s.append(k, meta(k), torch.arange(5, 7))),
        "append pos": ("pos", lambda: s.append(k, k, meta(torch.arange(5, 7)))),
        "append valid": ("valid", lambda: s.append(k, k, torch.arange(5, 7), meta(torch.ones(B, 2, dtype=torch.bool)))),
        "replace slot": ("slot", lambda: s.replace(meta(slot), k1, k1, pos1)),
        "replace k": ("k", lambda: s.replace(slot, meta(k1), k1, pos1)),
        "replace v": ("v", lambda: s.replace(slot, k1, meta(k1), pos1)),
        "replace pos": ("pos", lambda: s.replace(slot, k1, k1, meta(pos1))),
        "compact keep": ("keep", lambda: s.compact(meta(torch.ones(s.capacity, dtype=torch.bool)))),
        "select k": ("k", lambda: s.select(meta(torch.full((B, H), 2)))),
        "select scores": ("scores", lambda: s.select(2, meta(torch.randn(s.capacity)))),
        "select grouped k": ("k", lambda: s.select(meta(torch.full((B,), 4)), grouped=True)),
        "set_scores": ("scores", lambda: s.set_scores(meta(torch.zeros(s.capacity, 1)))),
        "evict_by_rule k": ("k", lambda: s.evict_by_rule(meta(torch.full((B * H,), 2)), rule="position")),
        "evict_by_rule last_pos": ("last_pos", lambda: s.evict_by_rule(torch.full((B * H,), 2), rule="position",
                                                                       recent=1, last_pos=meta(pos1))),
        "ragged_attention q": ("q", lambda: ragged_attention(meta(q), s)),
        "ragged_attention q_pos": ("q_pos", lambda: ragged_attention(q, s, q_pos=meta(torch.full((B, 1), 9)))),
    }
    before = store_state(s)
    for what, (arg, call) in calls.items():
        with pytest.raises(ValueError, match=rf"^{arg} must be on cpu.*got .*meta") as err:
            call()
        assert same_store(before, store_state(s)), what
    # The same calls with every tensor on the CPU run (they are refused for the meta one only).
    s.append(k, k, torch.arange(5, 7))
    s.replace(slot, k1, k1, pos1)
    s.select(2, torch.randn(s.capacity))
    s.compact(torch.ones(s.capacity, dtype=torch.bool))
    s.evict_by_rule(torch.full((B * H,), 9), rule="position", recent=1, last_pos=pos1)
    ragged_attention(q, s, q_pos=torch.full((B, 1), 9))


# ------------------------------------------------------------------ the command line
def run_cli(args):
    from kvcache_ext import cli
    return cli.main(args)


ARGS = [
    (["eval", "--task", "passkey", "--seeds", "0"], "--seeds"),
    (["eval", "--task", "ruler", "--first-seed", "-1"], "--first-seed"),
    (["eval", "--task", "passkey", "--depths", "abc"], "--depths"),
    (["eval", "--task", "passkey", "--depths", "1.5"], "--depths"),
    (["eval", "--task", "passkey", "--depths", "nan"], "--depths"),
    (["eval", "--task", "passkey", "--budget", "0"], "--budget"),
    (["eval", "--task", "passkey", "--budget", "12,abc"], "--budget"),
    (["eval", "--task", "passkey", "--lengths", ""], "--lengths"),
    (["eval", "--task", "passkey", "--prefill-block", "0"], "--prefill-block"),
    (["eval", "--task", "passkey", "--prefill-block", "257"], "--prefill-block"),
    (["eval", "--task", "passkey", "--decode-every", "-2"], "--decode-every"),
    (["eval", "--task", "passkey", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["eval", "--task", "fidelity", "--continuation", "x"], "--continuation"),
    (["eval", "--task", "passkey", "--mode", "sideways"], "--mode"),
    (["eval", "--task", "passkey", "--policy", "snapkv2"], "--policy"),
    (["eval", "--task", "passkey", "--device", "gpu7"], "--device"),
    (["eval", "--task", "passkey", "--dtype", "float8"], "--dtype"),
    (["eval", "--task", "passkey", "--model", "/does/not/exist"], "--model"),
    (["eval", "--task", "passkey", "--json", "/proc/no/such/dir/x.json"], "--json"),
    (["eval", "--task", "passkey", "--plot", "/proc/no/such/dir/x.png"], "--plot"),
    (["eval", "--task", "passkey", "--json", "/tmp"], "--json"),
    (["eval", "--task", "passkey", "--policy", "snapkv", "--budget", "16"], "--budget"),
    (["eval", "--task", "passkey", "--budget", "64", "--keep", "0.1"], "--keep"),
    (["eval", "--task", "ppl", "--policy", "kvec"], "--policy"),
    (["eval", "--task", "sudoku"], "--task"),
    (["demo", "--budget", "0"], "--budget"),
    (["demo", "--budget", "16"], "--budget"),
    (["demo", "--lengths", "abc"], "--lengths"),
    (["demo", "--json", "/proc/no/such/dir/x.json"], "--json"),
    (["demo", "--max-new-tokens", "-1"], "--max-new-tokens"),
]


@pytest.mark.parametrize("args, name", ARGS, ids=[" ".join(a[1:]) for a, _ in ARGS])
def test_the_command_line_refuses_bad_options_before_loading_a_model(args, name, monkeypatch, capsys):
    """Exit status 2 and a message naming the option, and no model is loaded (it would take
    20 s): everything here is refused from the options alone."""
    import kvcache_ext.hf.models as models

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(models, "load_model", no_model)
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(option=st.sampled_from(["--budget", "--lengths", "--depths", "--seeds", "--prefill-block",
                               "--decode-every", "--max-new-tokens", "--continuation", "--mode", "--policy"]),
       text=st.text(alphabet="0123456789,.-eainf x", max_size=8))
def test_the_command_line_parser_takes_or_refuses_any_text(option, text, monkeypatch):
    """Any text for a numeric or list option: parsed to what it says, or refused (exit 2)
    naming the option; never a traceback."""
    import contextlib
    import io

    from kvcache_ext.cli import build_parser
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = build_parser().parse_args(["eval", "--task", "passkey", option, text])
        except SystemExit as done:
            assert done.code == 2 and option in stderr.getvalue()
            return
    value = getattr(args, option[2:].replace("-", "_"))
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if option in ("--budget", "--lengths"):
        assert value == [int(p) for p in parts] and all(v >= 1 for v in value)
    elif option == "--depths":
        assert value == [float(p) for p in parts] and all(0 <= v <= 1 for v in value)
    elif option == "--prefill-block":
        assert 1 <= value <= 256 and value == int(text)
    elif option in ("--mode", "--policy"):
        assert value and all(isinstance(v, str) for v in value)
    else:
        assert value >= 1 and value == int(text)


def test_eval_writes_results_as_they_come(default_model, monkeypatch, tmp_path, capsys):
    """A run that fails after some results keeps them in --json (and says so)."""
    import json

    import kvcache_ext.hf.models as models
    from kvcache_ext.evaluation import retrieval
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: default_model)
    real_run_prompt, calls = retrieval.run_prompt, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return real_run_prompt(*args, **kwargs)
    monkeypatch.setattr(retrieval, "run_prompt", failing)
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError, match="went away"):
        run_cli(["eval", "--task", "passkey", "--policy", "full,snapkv", "--budget", "64", "--lengths", "300",
                 "--depths", "0.5", "--mode", "aware,agnostic", "--max-new-tokens", "2", "--json", str(out),
                 "--no-progress"])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and len(doc["records"]) == 2
    assert {r["mode"] for r in doc["records"]} == {"aware"} and doc["rows"]
    assert "the 2 runs measured so far are in" in capsys.readouterr().err


def test_eval_refuses_lengths_beyond_the_model_before_running(default_model, monkeypatch, capsys):
    import kvcache_ext.hf.models as models
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: default_model)
    assert run_cli(["eval", "--task", "passkey", "--lengths", "100000", "--no-progress"]) == 2
    assert "--lengths 100000" in capsys.readouterr().err
    assert run_cli(["eval", "--task", "passkey", "--lengths", "20", "--no-progress"]) == 2
    assert "--lengths 20" in capsys.readouterr().err
