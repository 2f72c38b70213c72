"""Plain-PyTorch, dense-and-padded implementations of every op: the oracle of the tests.

Written for clarity, not speed, and independent of the compiled kernels.
"""
from kvcache_ext.reference.attention import ragged_attention
from kvcache_ext.reference.quantize import as_attended, dequantize, quantize, round_trip
from kvcache_ext.reference.select import grouped_topk, keep_order, segmented_topk
from kvcache_ext.reference.store import ReferenceStore

__all__ = ["ReferenceStore", "ragged_attention", "segmented_topk", "grouped_topk", "keep_order", "quantize",
           "dequantize", "round_trip", "as_attended"]
