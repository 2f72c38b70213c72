"""Wrapper: a scorer that scores on top of another one (CAOTE, Pooled) and otherwise is it."""
from __future__ import annotations

import torch

from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView


class Wrapper(Scorer):
    """Forwards the state a scorer keeps (channels, statistics, updates) and its checks to
    ``inner``, the scorer that runs underneath; a subclass changes only how scores are read."""

    @property
    def inner(self) -> Scorer:
        """The scorer underneath; every subclass defines it (CAOTE: its base, or the base's
        per-head copy; Pooled: its base)."""
        raise NotImplementedError(f"{type(self).__name__} must define Wrapper.inner")

    @property
    def channels(self) -> int:
        return self.inner.channels

    @property
    def update_stats(self) -> tuple[str, ...]:
        return tuple(self.inner.update_stats)

    @property
    def evict_stats(self) -> tuple[str, ...]:
        return tuple(self.inner.evict_stats)

    @property
    def stats_window(self) -> int | None:
        return self.inner.stats_window

    @property
    def needs_kv(self) -> bool:
        return self.inner.needs_kv

    @property
    def needs_queries(self) -> bool:
        return self.inner.needs_queries

    @property
    def updates_from_view(self) -> bool:
        return self.inner.updates_from_view

    @property
    def needs_token_ids(self) -> bool:
        return self.inner.needs_token_ids

    @property
    def reads_every_head(self) -> bool:
        return self.inner.reads_every_head

    def default_protection(self) -> Protection:
        return self.inner.default_protection()

    def check(self, schedule) -> None:
        self.inner.check(schedule)

    def check_policy(self, policy) -> None:
        self.inner.check_policy(policy)

    def check_model(self, model) -> None:
        self.inner.check_model(model)

    def update(self, channels: torch.Tensor, stats: dict) -> None:
        self.inner.update(channels, stats)

    def update_view(self, view: CacheView) -> torch.Tensor:
        return self.inner.update_view(view)
