"""Continuous batching as the patch sees it: a patched model's ``init_continuous_batching``
builds the manager that ``kvcache_ext.serving`` provides. Serving is a layer above this one
(it runs the engine's requests on transformers' continuous batching, and imports the patch), so
the patch does not import it: the package registers serving's builder here when it is imported
(``kvcache_ext/__init__.py``), and serving's packed attention reaches the patched attention
function through the cache's pending layer (``hf.cache.set_pending``: an object with
``attend``). Nothing here imports transformers."""
from __future__ import annotations

_builder = None   # () -> init_continuous_batching(model, handle, *args, **kwargs), or None


def provide(builder) -> None:
    """Registers ``builder``: called when a patched model first builds a manager, it returns
    the function that builds it (so that transformers' serving code is imported then, not before)."""
    global _builder
    _builder = builder


def manager(model, handle, *args, **kwargs):
    """The continuous-batching manager of a patched model (``init_continuous_batching``'s)."""
    if _builder is None:
        raise RuntimeError("kvcache_ext: no continuous-batching engine is registered (kvcache_ext.serving "
                           "registers itself when the kvcache_ext package is imported)")
    return _builder()(model, handle, *args, **kwargs)
