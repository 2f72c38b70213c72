"""What a scorer sees: the dense prompt of one layer, or the cached tokens of one layer.

Both are padded per (batch item, KV head) and in position order, whatever the storage is
(the ragged store or the reference's masked dense cache), so one scorer serves both paths.

``attention_probs`` is the one softmax of queries over keys that scorers read: every scorer
takes its probabilities from ``PromptView.probs`` / ``query_probs`` / ``newest_probs`` or
``CacheView.probs`` / ``query_probs``, which all call it (causal by position, blind to
padding, float32). ``softmax_over_keys`` is the softmax itself, for scorers whose logits are not
a query's (Expected Attention's expected logits).

Besides the tokens, both views carry what the model hands its scorers (``model``, a
``ModelParts``) and the two places where a scorer keeps state between calls, both owned by the
cache and emptied when it is reset: ``layer_state`` (this layer's) and ``cache_state`` (one
dict that every layer of the cache shares). The engine keeps nothing of its own in them.
``token_ids``, the rows' token ids by position (``TokenIds``), is the cache's too, read-only
to a scorer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.policies.token_ids import TokenIds


def attention_probs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor | None, k_pos: torch.Tensor,
                    k_real: torch.Tensor, scale) -> torch.Tensor:
    """Softmax of queries over keys, per query head: ``[B, Hq, c, L]`` float32.

    q [B, Hq, c, D]; k [B, H, L, D] (query head h*G + g reads KV head h, HF's repeat_kv, without
    repeating K); q_pos [B, c] (-1: a padding query, which sees nothing and gets zeros) or None
    (every query sees every real key); k_pos / k_real [B, L] or [B, H, L]. A query sees the real
    keys at positions <= its own. ``scale``: the factor on ``q . k``, a float or a tensor that
    broadcasts to [B, H, c] (a factor per row, KV head or query)."""
    B, Hq, c, D = q.shape
    H, L = k.shape[1], k.shape[2]
    G = Hq // H
    logits = torch.einsum("bhgcd,bhld->bhgcl", q.float().reshape(B, H, G, c, D), k.float())
    if isinstance(scale, torch.Tensor):
        logits = logits * scale.float().to(logits.device).expand(B, H, c)[:, :, None, :, None]
    else:
        logits = logits * scale
    k_pos = k_pos if k_pos.dim() == 3 else k_pos[:, None, :]
    k_real = k_real if k_real.dim() == 3 else k_real[:, None, :]
    visible = k_real[:, :, None, :].expand(B, H, c, L)                            # [B, H, c, L]
    if q_pos is not None:
        visible = visible & (k_pos[:, :, None, :] <= q_pos[:, None, :, None]) & (q_pos >= 0)[:, None, :, None]
    return softmax_over_keys(logits, visible[:, :, None]).reshape(B, Hq, c, L)


def softmax_over_keys(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits`` [..., L] over the keys where ``visible`` (broadcast) holds; zeros
    where it does not, and for a row that sees no key. The one softmax scorers' scores go through."""
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)


def newest_queries(valid: torch.Tensor, pos: torch.Tensor, r: int):
    """valid, pos [B, m] -> (index [B, r'], real [B, r']): the r' = min(r, m) newest real
    entries of each row by position, oldest first (a row with fewer real entries gets padding,
    real=False, at the front)."""
    r = min(r, valid.shape[1])
    key = torch.where(valid, pos, torch.full_like(pos, -1))
    index = torch.argsort(key, dim=1, stable=True)[:, valid.shape[1] - r:]
    return index, valid.gather(1, index)


@dataclass(frozen=True, eq=False)
class ModelParts:
    """What a patched model hands its scorers besides each layer's tokens: parts of the model
    itself. ``patch`` reads them from the model once (``hf.patching.model_parts``) and one
    object travels from there through the cache and each layer's state to every view, so that
    a scorer that needs one more part of the model costs one field here and one line there."""

    rotary: object = None   # the model's rotary embedding (HF's ``rotary_emb``): ExpectedAttention
    token_kinds: object = None   # the tokenizer's TokenKinds (policies.token_kinds): Spanned
    # the tensor-parallel ranks its heads are split over (policies.ranks.Ranks; None: one
    # process): the engine's allocations that cross ranks (engine.across_ranks)
    ranks: object = None


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
    chunk: int = 256         # query rows per block of ``probs``: bounds its [c, n] memory
    model: ModelParts = field(default_factory=ModelParts)   # parts of the model, when patched
    layer_state: dict = field(default_factory=dict)   # the scorer's own state of this layer
    cache_state: dict = field(default_factory=dict)   # the scorer's state shared by every layer
    token_ids: TokenIds | None = None   # the rows' token ids by position (the cache's; needs_token_ids)

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
        q_pos = self.pos.masked_fill(~self.valid, -1)
        for i0 in range(lo, hi, chunk):
            i1 = min(i0 + chunk, hi)
            m = i1 if ordered else n
            yield i0, attention_probs(self.q[:, :, i0:i1], self.k[:, :, :m], q_pos[:, i0:i1],
                                      self.pos[:, :m], self.valid[:, :m], self.scale)

    def query_probs(self, q: torch.Tensor, q_pos: torch.Tensor, scale=None) -> torch.Tensor:
        """Softmax ``[B, Hq, r, n]`` of any queries ``q [B, Hq, r, D]`` at positions ``q_pos
        [B, r]`` (-1: a padding query, all zeros) over the prompt's keys."""
        return attention_probs(q, self.k, q_pos, self.pos, self.valid,
                               self.scale if scale is None else scale)

    def newest_probs(self, r: int):
        """``(probs [B, Hq, r', n], q_pos [B, r'])`` of each row's r' = min(r, n) newest real
        queries by position, oldest first (q_pos -1 where a row has fewer real queries)."""
        index, real = newest_queries(self.valid, self.pos, r)
        q = self.q.gather(2, index[:, None, :, None].expand(-1, self.q.shape[1], -1, self.q.shape[3]))
        q_pos = self.pos.gather(1, index).masked_fill(~real, -1)
        return self.query_probs(q, q_pos), q_pos

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
    q: torch.Tensor | None = None        # [B, Hq, n, D] the latest call's queries (needs_queries)
    q_pos: torch.Tensor | None = None    # [B, n] their positions (-1: padding), None for one decode query
    scale: float | None = None           # the model's softmax scale
    model: ModelParts = field(default_factory=ModelParts)   # parts of the model, when patched
    layer_state: dict = field(default_factory=dict)   # the scorer's own state of this layer
    cache_state: dict = field(default_factory=dict)   # the scorer's state shared by every layer
    token_ids: TokenIds | None = None   # the rows' token ids by position (the cache's; needs_token_ids)

    def query_probs(self, q: torch.Tensor, q_pos: torch.Tensor | None, scale=None) -> torch.Tensor:
        """Softmax ``[B, Hq, r, L]`` of any queries ``q [B, Hq, r, D]`` at positions ``q_pos
        [B, r]`` (-1: padding; None: they see every cached token) over the cached keys (needs
        ``k``: a scorer with ``needs_kv``)."""
        return attention_probs(q, self.k, q_pos, self.pos, self.mask,
                               self.scale if scale is None else scale)

    def probs(self, window: int | None = None, chunk: int = 256):
        """Yields ``(i0, p)``: the softmax ``p [B, Hq, c, L]`` of the latest call's queries
        ``i0 .. i0 + c`` (of its last ``window``), as the model computed it, over the cached
        tokens; chunked over queries (``chunk``) like ``PromptView.probs``. Needs
        ``needs_queries`` and ``needs_kv``."""
        q, q_pos = self.q, self.q_pos
        if window is not None and window < q.shape[2]:
            q = q[:, :, -window:]
            q_pos = q_pos[:, -window:] if q_pos is not None else None
        for i0 in range(0, q.shape[2], chunk):
            i1 = min(i0 + chunk, q.shape[2])
            yield i0, self.query_probs(q[:, :, i0:i1], q_pos[:, i0:i1] if q_pos is not None else None)
