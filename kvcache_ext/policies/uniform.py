"""Uniform allocation: every layer and every KV head gets the same budget."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache_ext.policies.allocation import Allocation


@dataclass
class Uniform(Allocation):
    """B tokens per KV head in every layer (SnapKV, H2O, TOVA, StreamingLLM as published)."""
