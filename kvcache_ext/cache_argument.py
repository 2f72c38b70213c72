"""The keyword under which a transformers model takes its cache.

transformers 5.24 renamed a model's (and ``generate``'s) ``past_key_values`` to ``cache``; the old
name still works there with a FutureWarning and goes in 5.40. Every model call of the library, the
harnesses and the benchmarks passes the cache under the name the model's forward takes, so that
they warn on no version and keep working after the old name is gone.
"""
from __future__ import annotations

import functools
import inspect

# For messages raised where the keyword the cache came under is not known.
EITHER_NAME = "the cache (past_key_values=, or cache= from transformers 5.24)"


def cache_argument(forward) -> str:
    """``"cache"`` when ``forward`` (a model's forward) takes it, else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@functools.lru_cache(maxsize=None)
def _cache_argument_of(model_class) -> str:   # keyed by the class: no model is kept alive
    return cache_argument(model_class.forward)


def with_cache(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)`` or ``model.generate(...)``: ``model(ids, **with_cache(model, c))``."""
    return {_cache_argument_of(type(model)): cache}
