"""Host syncs on the per-step path of a patched model.

The goal on a GPU: no host sync in a decoded token that evicts nothing, at most one per eviction.
A sync is the host waiting for the device: reading a device tensor's value (``item``, ``tolist``,
``bool``, ``int``, ``cpu``, ``nonzero``, a boolean-mask index, ...). On this CPU-only machine no
call syncs, so ``WouldBeSyncs`` counts the calls that *would*, on a CUDA store: a
``TorchFunctionMode`` that follows which tensors live on the host (made by a factory without a
``device``, or computed from host tensors only, or copied there) and which on the device
(everything else: the model's, the store's, anything computed from them), and counts each
value-reading call on a device tensor made from kvcache_ext's own code (HF's code is not ours to
count). A ``.to(torch.device)`` is taken as a move to the store's device (here ``cpu`` as well);
a move to the host is ``.cpu()``, ``.numpy()`` or ``.to("cpu")`` with the string.

What it cannot see: syncs inside C++ ops. There is one on an eviction's path on CUDA:
``RaggedKVStore.compact`` reads the new lengths back (``PageAllocator.finish_compact``), unless
its caller gives them (the eviction by a slot rule under equal head budgets, ``evict_by_rule``: a
top-k of k per head keeps min(len, k));
``select`` reads nothing back. It is added by hand below
(``CPP_SYNCS_PER_EVICTION``). The CUDA twin (``test_cuda_*``) counts every sync of the same steps
with the profiler (the CUDA runtime's synchronizing calls).
"""
from __future__ import annotations

import os
import traceback
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.policies import H2O, AdaKV, EveryNSteps, EveryStep, Policy, SnapKV, Uniform
from tiny_models import tiny_model

KVCACHE_DIR = os.path.dirname(os.path.abspath(kvcache_ext.__file__))
THIS_FILE = os.path.abspath(__file__)

# Syncs inside C++ on an eviction's path on CUDA, invisible to WouldBeSyncs: compaction's
# read-back of the new lengths, on the padded-view path only (``RaggedLayerKV.evict``).
CPP_SYNCS_PER_EVICTION = {"compact (finish_compact), padded-view path": 1, "select (store_topk)": 0}

_T = torch.Tensor
# Calls that read a tensor's value on the host: a sync when the tensor is on a CUDA device.
READS = {_T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.numpy,
         _T.cpu, _T.nonzero, torch.nonzero, _T.nonzero_static, torch.masked_select, _T.masked_select,
         torch.unique, _T.unique, torch.unique_consecutive, torch.repeat_interleave,
         _T.repeat_interleave, torch.argwhere, torch.where}
TO_HOST = {_T.cpu, _T.numpy, _T.tolist}
INDEXING = {_T.__getitem__, _T.__setitem__, _T.index_put_, _T.index_put, torch.index_put}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def ours():
    """Where in kvcache_ext's own code the current call comes from (through torch's frames), or
    None when it is not ours (HF's, this file's, pytest's)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == THIS_FILE:
            continue
        if path.startswith(KVCACHE_DIR):
            return f"{os.path.relpath(path, KVCACHE_DIR)}:{frame.lineno} {frame.line}"
        if "/torch/" not in path:
            return None
    return None


class WouldBeSyncs(TorchFunctionMode):
    """Counts (while ``counting``) the calls from kvcache_ext that would sync on a CUDA store."""

    def __init__(self):
        super().__init__()
        # Tensors that would live on the host, by id (a tensor's == is elementwise, so no set of
        # tensors); the weak reference tells a reused id from the tensor that had it.
        self.host: dict[int, weakref.ref] = {}
        self.counting = False
        self.calls: list[tuple[str, str]] = []   # (function, where in kvcache_ext)

    def on_device(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is None or ref() is not t

    def _caller(self):
        return ours()

    def _reads_device_value(self, func, args, kwargs) -> bool:
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if func in READS:
            if func is torch.where and len(args) + len(kwargs) != 1:
                return False   # where(cond, a, b) reads nothing; where(cond) is nonzero
            if func in (torch.repeat_interleave, _T.repeat_interleave) and "output_size" in kwargs:
                return False
            return bool(inputs) and self.on_device(inputs[0])
        if func is _T.to and args and isinstance(args[0], torch.Tensor):
            target = args[1] if len(args) > 1 else kwargs.get("device")
            return isinstance(target, str) and target.startswith("cpu") and self.on_device(args[0])
        if func in INDEXING:
            # Indexing by a boolean mask finds the True places first (nonzero): a sync.
            index = args[1] if len(args) > 1 else None
            masks = [t for t in _tensors(index) if t.dtype == torch.bool]
            return any(self.on_device(m) for m in masks)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting and self._reads_device_value(func, args, kwargs):
            where = self._caller()
            if where is not None:
                self.calls.append((getattr(func, "__name__", str(func)), where))
        out = func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if func in TO_HOST:
            host = True
        elif func is _T.to and args:
            target = args[1] if len(args) > 1 else kwargs.get("device")
            if isinstance(target, str):
                host = target.startswith("cpu")
            elif isinstance(target, (torch.device, torch.Tensor)):
                host = False   # the store's device
            else:              # a dtype: stays where it is
                host = not self.on_device(args[0])
        elif not inputs:       # a factory: on the host unless given a device
            host = kwargs.get("device") is None
        else:
            host = not any(self.on_device(t) for t in inputs)
        if host:
            for t in _tensors(out):
                self.host[id(t)] = weakref.ref(t)
        return out


def _prompt(batch, length, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (batch, length), generator=gen)


def _run(policy, steps=3, batch=2, length=40, counter=None):
    """Prefill and `steps` decode steps, no padding (HF passes no mask); returns the sync calls
    counted per decode step and the layers' eviction counts."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2, head_dim=16)
    ids = _prompt(batch, length)
    per_step = []
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        cache = handle.new_cache()
        mode = counter or WouldBeSyncs()
        with mode:
            out = model(ids, **with_cache(model, cache), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                mode.counting = True
                before = len(mode.calls)
                out = model(token, **with_cache(model, cache), use_cache=True)
                mode.counting = False
                per_step.append(mode.calls[before:])
                token = out.logits[:, -1:].argmax(-1)
    return per_step, model.config.num_hidden_layers


def _explain(per_step):
    return "\n".join(f"step {i}: {name} at {where}" for i, calls in enumerate(per_step)
                     for name, where in calls)


def test_the_counter_sees_a_sync_and_ignores_host_tensors():
    """The counter itself: a read of a device tensor from kvcache_ext's code counts, one of a host
    tensor (made without a device) does not, and neither do HF's or this file's."""
    mode = WouldBeSyncs()
    store = kvcache_ext.RaggedKVStore(1, 2, 8, dtype=torch.float32, device="cpu")
    with mode:
        kv = torch.randn(1, 2, 5, 8, device="cpu")
        store.append(kv, kv, torch.arange(5, device="cpu"))
        mode.counting = True
        store.lens.tolist()                                # host: the allocator's lengths
        keep = store.from_padded(torch.ones(1, 2, 5, dtype=torch.bool, device="cpu"), False)
        store.compact(keep)
        store.validate()                                   # reads the check's codes: one sync
        mode.counting = False
    names = [name for name, where in mode.calls]
    assert names == ["cpu"], mode.calls
    assert "kernels/store.py" in mode.calls[0][1]


def test_a_decoded_token_without_eviction_makes_no_host_sync():
    """One-shot SnapKV (a decode step that only appends) and H2O between its evictions."""
    for policy in (Policy(SnapKV(window=4), budget=16),
                   Policy(H2O(), budget=16, schedule=EveryNSteps(100))):
        per_step, _ = _run(policy, steps=3)
        assert all(not calls for calls in per_step), f"{policy}:\n{_explain(per_step)}"


def _count_evictions(monkeypatch):
    """The evictions of the ragged store, by path: "view" (``RaggedLayerKV.evict``, after a padded
    view) and "rule" (a slot rule's, in the decode step's one op, no view, the new lengths known;
    counted when it evicts)."""
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    from kvcache_ext.kernels.store import RaggedKVStore
    evictions = []
    evict = RaggedLayerKV.evict
    monkeypatch.setattr(RaggedLayerKV, "evict", lambda self, *a: evictions.append("view") or evict(self, *a))
    decode = RaggedKVStore._decode   # every decode step's, whichever door it came through

    def counted(store, *a, **kw):   # a decode step that left a head shorter than it was plus its token
        before = store.lens.clone()
        out = decode(store, *a, **kw)
        if bool((store.lens < before + 1).any()):
            evictions.append("rule")
        return out
    monkeypatch.setattr(RaggedKVStore, "_decode", counted)
    return evictions


def test_an_eviction_step_makes_at_most_one_host_sync_per_eviction(monkeypatch):
    """H2O evicting every step: every layer evicts at every decode step. Python makes none.
    With equal head budgets the eviction is the slot rule's, in the storage, and gives
    compaction the new lengths: no C++ read-back either; with Ada-KV's budgets it takes the
    padded view, and compaction reads the lengths back: one sync (CPP_SYNCS_PER_EVICTION)."""
    for allocation, path in ((Uniform(), "rule"), (AdaKV(), "view")):
        with monkeypatch.context() as patched:
            evictions = _count_evictions(patched)
            per_step, layers = _run(Policy(H2O(recent=2), budget=16, schedule=EveryStep(),
                                           allocation=allocation), steps=3)
        # the prompt's compression is not an eviction step
        assert evictions == [path] * (3 * layers), (allocation, evictions)
        assert all(not calls for calls in per_step), _explain(per_step)
    assert sum(CPP_SYNCS_PER_EVICTION.values()) <= 1


def test_the_counter_catches_a_sync_in_the_engine(monkeypatch):
    """The same steps with one value read added to every eviction: counted, once per layer and
    step, where the engine calls it."""
    evictions = _count_evictions(monkeypatch)
    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    evict = RaggedLayerKV.evict
    monkeypatch.setattr(RaggedLayerKV, "evict", lambda self, scores, k: (scores.sum().item(), evict(self, scores, k)))
    per_step, layers = _run(Policy(H2O(), budget=16, schedule=EveryStep(), allocation=AdaKV()), steps=2)
    assert len(evictions) == 2 * layers
    assert [len(calls) for calls in per_step] == [layers, layers], _explain(per_step)
    assert all(name == "item" and "engine/eviction.py" in where for calls in per_step for name, where in calls)


CUDA = torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _profiled_syncs(fn) -> int:
    """The CUDA runtime's synchronizing calls made while fn() runs (torch.profiler records every
    runtime call, from Python, torch and our C++ alike), less those of an empty region."""
    from torch.profiler import ProfilerActivity, profile

    def count(f):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            f()
        return sum(e.name in SYNC_CALLS for e in prof.events())
    return count(fn) - count(lambda: None)


def _cuda_syncs(policy, steps=3):
    """The CUDA twin: every sync of each decode step, counted by the profiler (after checking that
    it counts one ``.item()`` as one)."""
    probe = torch.ones(3, device="cuda")
    assert _profiled_syncs(lambda: probe.sum().item()) == 1
    assert _profiled_syncs(lambda: probe.sum()) == 0
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2, head_dim=64).cuda()
    ids = _prompt(2, 40).cuda()
    counts = []
    with kvcache_ext.patch(model, policy) as handle, torch.no_grad():
        cache = handle.new_cache()
        token = model(ids, **with_cache(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = []
            counts.append(_profiled_syncs(lambda: out.append(model(token, **with_cache(model, cache), use_cache=True))))
            token = out[0].logits[:, -1:].argmax(-1)
    return counts, model.config.num_hidden_layers


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the CUDA kernels")
def test_cuda_host_syncs_per_decoded_token_and_per_eviction():
    """On a GPU, all syncs counted: none per plain token; per H2O step (every layer evicts) at
    most the C++ read-backs of each eviction (the goal: 1 each)."""
    plain, _ = _cuda_syncs(Policy(SnapKV(window=4), budget=16))
    assert plain == [0, 0, 0]
    # Equal head budgets: the slot rule's eviction in the decode step's storage call gives
    # compaction the new lengths: no sync.
    by_rule, _ = _cuda_syncs(Policy(H2O(recent=2), budget=16, schedule=EveryStep()))
    assert by_rule == [0, 0, 0], by_rule
    # Ada-KV's budgets: the padded view, and compaction's read-back, once per eviction.
    evicting, layers = _cuda_syncs(Policy(H2O(), budget=16, schedule=EveryStep(), allocation=AdaKV()))
    assert all(c <= layers for c in evicting), evicting
