"""Wrapper: a scorer that scores on top of another one (CAOTE, Pooled, Spanned) and otherwise is it."""
from __future__ import annotations

from dataclasses import replace

from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView


class Wrapper(Scorer):
    """Forwards the state a scorer keeps (its capabilities, updates) and its checks to
    ``inner``, the scorer that runs underneath; a subclass changes only how scores are read,
    and says what that changes of the capabilities in ``wraps``."""

    @property
    def inner(self) -> Scorer:
        """The scorer underneath; every subclass defines it (CAOTE: its base, or the base's
        per-head copy; Pooled: its base)."""
        raise NotImplementedError(f"{type(self).__name__} must define Wrapper.inner")

    @property
    def capabilities(self) -> Capabilities:
        """The inner scorer's capabilities as a whole, less what reads its own scores (the
        store's slot rule, reconstruction passes: a wrapper's scores are its own), with what
        the subclass changes (``wraps``)."""
        return self.wraps(replace(self.inner.capabilities, slot_rule=None, reconstructs=False))

    def wraps(self, inner: Capabilities) -> Capabilities:
        """The wrapper's capabilities from its inner scorer's (scores aside): by default those."""
        return inner

    def default_protection(self) -> Protection:
        return self.inner.default_protection()

    def check(self, schedule) -> None:
        self.inner.check(schedule)

    def check_policy(self, policy) -> None:
        self.inner.check_policy(policy)

    def check_model(self, model) -> None:
        self.inner.check_model(model)

    def update_view(self, view: CacheView):
        return self.inner.update_view(view)
