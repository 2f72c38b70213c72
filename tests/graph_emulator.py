"""A CPU stand-in for CUDA graphs, for the tests of kvcache_ext.hf.decode_graph: a backend (as
``decode_graph.BACKENDS`` holds) whose replays do what a CUDA graph's would.

A CUDA graph records the kernels its capture launches and replays them: on the same memory
(every tensor made outside the capture is read and written in place), with every host value
frozen (shapes, scalars, the contents of host data copied in), and nothing of the Python that
ran during capture runs again. A capture runs no kernel. So here:

- ``capture`` runs the step under a dispatch mode that records every op (aten ops, and
  kvcache_ext's custom ops as single ops) with its arguments; a tensor made outside the step
  is kept by identity, one made inside by the op that made it. Whatever the step wrote in
  tensors made outside it is put back afterwards (a capture changes nothing). An op that reads
  a device value on the host (``item``, ``nonzero``, ...) fails the capture, as it would fail
  a CUDA capture.
- a replay runs the recorded ops again in order, each on the replay's own results of the ops
  before it and on the same outside tensors, with the recorded host values.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# Ops that read a device value on the host: a CUDA capture fails on them.
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
              torch.ops.aten.masked_select.default, torch.ops.aten._assert_async.default}


def _storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs):
    """The tensors an op writes, by its schema."""
    out = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []            # (func, args, kwargs, out)
        self.made = set()        # storages of tensors the step made
        self.saved = {}          # storage key -> (storage, its contents before the step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a device value on the host: a CUDA graph cannot capture it")
        for t in _written(func, args, kwargs):
            key = _storage_key(t)
            if key not in self.made and key not in self.saved:
                storage = t.untyped_storage()
                self.saved[key] = (storage, storage.clone())
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:
                self.made.add(_storage_key(t))
        self.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        for storage, before in self.saved.values():
            storage.copy_(before)


class EmulatedGraphs:
    """The backend: ``warmup`` runs the step, ``capture`` records it (``replay()`` runs it)."""

    def __init__(self, device=None):
        self.device = device

    def warmup(self, step):
        return step()

    def capture(self, step, hold):
        recorder = _Recorder()
        with recorder:
            out = step()
        recorder.restore()
        held = hold()
        ops = recorder.ops

        def replay():
            assert held is not None   # held as long as the replay, as by a CUDA graph
            results = {}   # id of a recorded result -> the replay's

            def mapped(x):
                return results.get(id(x), x) if isinstance(x, torch.Tensor) else x
            for func, args, kwargs, recorded in ops:
                got = func(*tree_map(mapped, args), **tree_map(mapped, kwargs))
                for r, g in zip(tree_flatten(recorded)[0], tree_flatten(got)[0]):
                    if isinstance(r, torch.Tensor):
                        results[id(r)] = g
            return mapped(out)
        return replay
