"""kvcache_ext: training-free KV-cache eviction with a ragged per-head KV store."""
import torch  # noqa: F401  (loads libtorch before the extension)

from kvcache_ext import _C
from kvcache_ext.kernels.attention import STAT_NAMES, AttentionStats, ragged_attention
from kvcache_ext.kernels.select import grouped_topk, segmented_topk
from kvcache_ext.kernels.store import DenseView, RaggedKVStore
from kvcache_ext.hf import batching as _batching

__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled module was built with: torch version, CUDA (yes/no, version, archs, PTX)."""
    return dict(_C.build_info())


# The model integration needs transformers; it is imported on first use so that the kernels
# alone do not pay for it.
_LAZY = {"patch": "kvcache_ext.hf.patching", "unpatch": "kvcache_ext.hf.patching", "is_patched": "kvcache_ext.hf.patching",
         "PatchHandle": "kvcache_ext.hf.patching", "RaggedCache": "kvcache_ext.hf.cache",
         "with_cache": "kvcache_ext.cache_argument"}


def _serving_manager():
    """What a patched model's ``init_continuous_batching`` runs: kvcache_ext.serving's manager,
    imported at its first use (older transformers lack the engine's extension points, and the
    serving module says so when it is imported)."""
    from kvcache_ext.serving.manager import init_continuous_batching
    return init_continuous_batching


# The package is where the layers meet: the patch (hf) builds continuous batching through
# serving, a layer above it, without importing it.
_batching.provide(_serving_manager)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcache_ext' has no attribute {name!r}")


__all__ = ["RaggedKVStore", "DenseView", "ragged_attention", "AttentionStats", "STAT_NAMES",
           "segmented_topk", "grouped_topk", "build_info", "patch", "unpatch", "is_patched",
           "PatchHandle", "RaggedCache", "with_cache", "policies"]
