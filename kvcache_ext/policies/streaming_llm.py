"""StreamingLLM (Xiao et al., 2024): attention sinks plus a window of the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache_ext.checks import Int, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView


@dataclass
class StreamingLLM(Scorer):
    """Keeps the first ``sinks`` tokens (4 in the paper) and then the newest ones: the score
    of a token is its position, so the budget minus the sinks goes to the most recent."""

    sinks: int = 4

    def __post_init__(self):
        check_fields(self, "StreamingLLM", sinks=Int(0))

    def default_protection(self) -> Protection:
        return Protection(sinks=self.sinks)

    def prompt_scores(self, p: PromptView):
        H = p.k.shape[1]
        return p.pos.float()[:, None, :].expand(-1, H, -1).contiguous(), None

    capabilities = Capabilities(slot_rule="position")

    def cache_scores(self, view: CacheView):
        return view.pos.float()
