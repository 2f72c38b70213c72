"""What a scorer sees: the dense prompt of one layer, or the cached tokens of one layer.

Both are padded per (batch item, KV head) and in position order, whatever the storage is
(the ragged store or the reference's masked dense cache), so one scorer serves both paths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptView:
    """A fresh prompt of one layer, before anything is cached (one-shot prefill scoring)."""

    q: torch.Tensor          # [B, Hq, n, D] queries after RoPE
    k: torch.Tensor          # [B, H, n, D] keys after RoPE
    v: torch.Tensor          # [B, H, n, D]
    pos: torch.Tensor        # [B, n] int64 positions (HF position_ids)
    valid: torch.Tensor      # [B, n] bool, False on padding
    scale: float             # softmax scale
    layer_idx: int
    num_layers: int
    budget: torch.Tensor | None = None   # [B] this layer's per-head budget (average over heads)
    shared: dict = field(default_factory=dict)   # state shared by the layers of one cache
    chunk: int = 256         # query rows per block of ``probs``: bounds its [c, n] memory

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def last_pos(self) -> torch.Tensor:
        """[B] position of the newest token of every row."""
        return self.pos.masked_fill(~self.valid, -1).max(dim=1).values

    def probs(self, queries: slice | None = None, chunk: int | None = None):
        """Yields ``(i0, p)``: softmax probabilities ``p [B, Hq, c, m]`` (float32) of prompt
        queries ``i0 .. i0 + c`` over the first ``m`` prompt keys, causal by position and blind
        to padding. The keys after ``m`` are invisible to these queries (probability 0).

        ``m = i0 + c`` when positions grow along the prompt, as HF's position ids always do:
        later keys are in the causal future of the chunk, and skipping them halves the work on a
        long prompt. Otherwise ``m = n``. Chunked over queries (``chunk``, default ``self.chunk``)
        so that the blocks stay small.
        """
        n = self.q.shape[2]
        chunk = chunk or self.chunk
        lo, hi, _ = (queries or slice(0, n)).indices(n)
        ordered = self._positions_increase()
        k = self.k.float().repeat_interleave(self.groups, dim=1)
        for i0 in range(lo, hi, chunk):
            i1 = min(i0 + chunk, hi)
            m = i1 if ordered else n
            logits = torch.einsum("bhid,bhjd->bhij", self.q[:, :, i0:i1].float(), k[:, :, :m]) * self.scale
            visible = (self.pos[:, None, :m] <= self.pos[:, i0:i1, None]) & self.valid[:, None, :m]
            visible = visible & self.valid[:, i0:i1, None]
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
            p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a padded query sees nothing
            yield i0, p

    def _positions_increase(self) -> bool:
        """Whether the real tokens' positions strictly increase along the prompt in every row."""
        pos = self.pos.masked_fill(~self.valid, -1)
        before = pos.cummax(dim=1).values[:, :-1]          # the largest real position so far
        return bool(((pos[:, 1:] > before) | ~self.valid[:, 1:]).all())


@dataclass
class CacheView:
    """The cached tokens of one layer, padded to [B, H, L] in position order.

    ``stats`` holds the statistics of the latest attention over the cache (padded like the
    rest, see ``kvcache_ext.AttentionStats``) when the scorer asked for them, and
    ``stat_queries`` how many queries that call had (the observation window).
    """

    pos: torch.Tensor        # [B, H, L] int64
    mask: torch.Tensor       # [B, H, L] bool, True on cached tokens
    channels: torch.Tensor   # [B, H, L, C] float32, the scorer's own per-token state
    last_pos: torch.Tensor   # [B] position of the newest token of every row
    layer_idx: int
    num_layers: int
    groups: int              # query heads per KV head (G)
    stats: dict = field(default_factory=dict)
    stat_queries: int = 0
    k: torch.Tensor | None = None   # [B, H, L, D] when the scorer needs keys or values
    v: torch.Tensor | None = None
    budget: torch.Tensor | None = None   # [B] per-head budget this eviction keeps (average over heads)
    shared: dict = field(default_factory=dict)   # state shared by the layers of one cache
    q: torch.Tensor | None = None        # [B, Hq, n, D] the latest call's queries (needs_queries)
    q_pos: torch.Tensor | None = None    # [B, n] their positions (-1: padding), None for one decode query
    scale: float | None = None           # the model's softmax scale
