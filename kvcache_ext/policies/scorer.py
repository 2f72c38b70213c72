"""The scorer interface: how a policy rates cached tokens (higher = keep)."""
from __future__ import annotations

import torch

from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.views import CacheView, PromptView

GQA_MODES = ("mean", "max")


class Scorer:
    """Base class of the scorers. A scorer is a small dataclass of its paper's parameters.

    - ``prompt_scores``: scores of a fresh prompt's tokens from the dense prompt (one-shot
      prefill), and the initial values of the scorer's per-token channels.
    - ``update``: folds the statistics of an attention over the cache into the channels
      (elementwise, so it works on any layout); called after every attention over the cache
      when the schedule will evict again.
    - ``cache_scores``: scores of the cached tokens at an eviction step.
    """

    channels: int = 0                        # float32 per-token channels the scorer owns
    update_stats: tuple[str, ...] = ()       # statistics ``update`` reads
    evict_stats: tuple[str, ...] = ()        # statistics ``cache_scores`` reads (latest call)
    stats_window: int | None = None          # evict_stats over the last queries of a call only
    needs_kv: bool = False                   # ``cache_scores`` reads view.k / view.v
    needs_queries: bool = False              # views carry the latest call's queries (view.q)
    output_after_eviction: bool = False      # a block's output over the kept tokens only (CAOTE Eq. 7)
    updates_from_view: bool = False          # ``update_view`` runs after every attention over the cache
    reconstructs: bool = False               # prompt scores from reconstruction passes (reconstruction.py)

    def default_protection(self) -> Protection:
        return Protection()

    def check(self, schedule) -> None:
        """Raises ValueError for a schedule this scorer cannot serve."""

    def check_policy(self, policy) -> None:
        """Raises ValueError for a policy (allocation, protection, schedule) this scorer cannot
        serve; ``Policy`` calls it. By default only the schedule is checked."""
        self.check(policy.schedule)

    def check_model(self, model) -> None:
        """Raises ValueError for a model this scorer cannot serve; ``patch`` calls it with the
        model's ``ModelShape`` (layers, query and KV heads, head dim, ``groups`` = G)."""

    def prompt_scores(self, p: PromptView) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def update(self, channels: torch.Tensor, stats: dict) -> None:
        """channels [..., C] and stats in the same (any) slot layout."""

    def update_view(self, view: CacheView) -> torch.Tensor:
        """With ``updates_from_view``: the new channels [B, H, L, C] of the cached tokens, from a
        padded view (for state the kernel's statistics cannot give)."""
        raise NotImplementedError

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        raise NotImplementedError

    # --- per-query-head scores: what CAOTE's per-head readings (gqa="group_l2", ...) wrap ------
    # A scorer that rates tokens per query head before it combines the G heads of a KV head
    # exposes those scores here; CAOTE wraps any scorer through these methods alone.
    def with_query_head_state(self, max_groups: int) -> "Scorer":
        """The scorer to run when per-query-head scores will be asked for (a scorer whose
        per-head scores need state of their own returns a copy that keeps it, in at most
        ``max_groups`` more channels); by default itself."""
        return self

    def prompt_head_scores(self, p: PromptView) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(scores [B, H, G, n] per query head, channels)`` of a fresh prompt, the channels
        being what ``prompt_scores`` would return (it is not called as well), or None when the
        scorer has no per-head reading."""
        return None

    def cache_head_scores(self, view: CacheView) -> torch.Tensor | None:
        """[B, H, G, L] scores of the cached tokens per query head, or None."""
        return None


def group_reduce(x: torch.Tensor, groups: int, mode: str = "mean") -> torch.Tensor:
    """[B, Hq, ...] per query head -> [B, H, ...] per KV head (query head h*G + g reads h)."""
    x = x.unflatten(1, (x.shape[1] // groups, groups))
    if mode == "mean":
        return x.mean(dim=2)
    if mode == "max":
        return x.amax(dim=2)
    if mode == "sum":
        return x.sum(dim=2)
    raise ValueError(f"unknown GQA aggregation {mode!r}; choose from {GQA_MODES}")
