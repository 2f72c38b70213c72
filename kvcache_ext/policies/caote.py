"""CAOTE (Goel et al., 2025): evict the tokens whose removal changes the attention output least.

CAOTE wraps a score-based scorer (H2O, TOVA, SnapKV, ...). The base scorer's retention scores
``h`` of the current candidates of a head are normalized to sum to one (Eq. 22) and read as an
attention row; the score of token j is then the change of the attention output when j alone
is evicted and the rest renormalized (Theorem 3.2):

    c_j = h_j / (1 - h_j) * || V h^T - v_j ||_2              (CAOTE, Eq. 8 / 21)
    c_j = h_j / (1 - h_j) * || mean_i v_i - v_j ||_2          (FastCAOTE, Eq. 23)

The tokens with the smallest ``c`` are evicted. See docs/sections/caote.md and
research/seed-000-caote.md (§3-5, §9.3, §12) for every choice the paper leaves open.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvcache_ext.policies.h2o import H2O
from kvcache_ext.policies.policy import Policy
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.schedule import EveryStep
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.snapkv import SnapKV
from kvcache_ext.policies.streaming_llm import StreamingLLM
from kvcache_ext.policies.tova import TOVA
from kvcache_ext.policies.views import CacheView, PromptView

GQA_AGGREGATIONS = ("group_l2", "mean", "sum", "max", "shared")

_TINY = torch.finfo(torch.float32).tiny
_BIG = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------ the formulas

def normalize_scores(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 22: h [..., N] >= 0 divided by its sum over the candidates (``mask`` [..., N]).
    Float32; zero off the candidates, and everywhere when no candidate has a positive score."""
    h = h.float().masked_fill(~mask, 0.0)
    return h / h.sum(dim=-1, keepdim=True).clamp_min(_TINY)


def caote_scores(alpha: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                 fast: bool = False) -> torch.Tensor:
    """CAOTE scores of N candidates: ``alpha [..., N]`` their attention (or normalized base
    scores, summing to one over the candidates), ``values [..., N, D]``, ``mask [..., N]`` the
    candidates (default: all). Returns ``c [..., N]`` float32, zero off the candidates.

    ``fast=False``: Eq. 8 / 21, the reference vector is ``X = V alpha^T``.
    ``fast=True``: Eq. 23, the reference vector is the plain mean of the candidates' values.

    Computed in float32 whatever the inputs' dtype, in the numerically stable form of
    research/seed-000-caote.md §9.3: only the largest weight j* can exceed 1/2, so for every
    other token ``1 - alpha_j >= 1/2`` and the paper's formula is well conditioned. For j*,
    ``1 - alpha_j*`` is the sum of the other weights (no cancellation), and CAOTE uses the
    identity of Eq. 17-19, ``c_j* = alpha_j* * ||X'_j* - v_j*||`` with ``X'_j*`` the weighted
    mean of the other values (the output after evicting j*), so a dominant sink neither gets
    NaN (0 * inf) nor the spurious 0 of ``X - v_j*`` cancelling. FastCAOTE's singularity is
    real (c -> inf as alpha -> 1): its scores are capped at float32's largest finite value.
    """
    if mask is None:
        mask = torch.ones(alpha.shape, dtype=torch.bool, device=alpha.device)
    alpha = alpha.float().masked_fill(~mask, 0.0)
    V = values.float().masked_fill(~mask[..., None], 0.0)
    top = alpha.argmax(dim=-1, keepdim=True)                                  # j*
    is_top = torch.zeros_like(mask).scatter_(-1, top, True)
    others = alpha.masked_fill(is_top, 0.0)
    rest = others.sum(dim=-1, keepdim=True)                                   # 1 - alpha_j*
    one_minus = torch.where(is_top, rest, 1.0 - alpha).clamp_min(_TINY)
    if fast:
        count = mask.sum(dim=-1, keepdim=True).clamp_min(1)
        ref = V.sum(dim=-2, keepdim=True) / count[..., None]                  # Eq. 23: mean of V
        c = (alpha / one_minus) * (ref - V).norm(dim=-1)
        return c.clamp_max(_BIG).masked_fill(~mask, 0.0)
    ref = alpha.unsqueeze(-2) @ V                                             # X = V alpha^T (Eq. 10)
    c = alpha / one_minus * (ref - V).norm(dim=-1)                            # Eq. 8 / 21 (j != j*)
    # j*: X'_j* = sum_{i != j*} alpha_i v_i / sum_{i != j*} alpha_i (Eq. 17-18). If every other
    # weight is exactly 0 (underflow), the limit of equal small weights: the others' plain mean.
    w = torch.where(rest > 0, others, (mask & ~is_top).float())
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(_TINY)
    x_rest = w.unsqueeze(-2) @ V                                              # [..., 1, D]
    v_top = V.gather(-2, top.unsqueeze(-1).expand(top.shape + V.shape[-1:]))  # [..., 1, D]
    c_top = alpha.gather(-1, top) * (x_rest - v_top).norm(dim=-1)             # Eq. 19
    return c.scatter(-1, top, c_top).masked_fill(~mask, 0.0)


def aggregate_groups(c: torch.Tensor, how: str) -> torch.Tensor:
    """c [B, H, G, L] per query head -> [B, H, L] per KV head (research/seed-000-caote.md §4.9)."""
    if c.shape[2] == 1:
        return c[:, :, 0]
    if how == "group_l2":      # the L2 norm of the G heads' concatenated output errors
        top = c.amax(dim=2, keepdim=True).clamp_min(_TINY)            # scaled: no overflow
        return (top[:, :, 0] * (c / top).square().sum(dim=2).sqrt()).clamp_max(_BIG)
    if how == "mean":
        return (c / c.shape[2]).sum(dim=2).clamp_max(_BIG)
    if how == "sum":
        return c.sum(dim=2).clamp_max(_BIG)
    if how == "max":
        return c.amax(dim=2)
    raise ValueError(f"unknown CAOTE GQA aggregation {how!r}; choose from {GQA_AGGREGATIONS}")


# ------------------------------------------------------------------------------ the scorer

@dataclass
class CAOTE(Scorer):
    """CAOTE on top of ``base``: the base's scores of a head's candidates, normalized (Eq. 22),
    weighted by how far each token's value is from the attention output (Eq. 21), or from the
    plain mean of the values with ``fast=True`` (FastCAOTE, Eq. 23). Lower = evicted first.

    - ``base``: a score-based scorer with non-negative scores (H2O, TOVA, SnapKV, Random or
      your own). StreamingLLM is refused: its score is a position, not a retention score.
    - ``gqa``: how the G query heads of a KV head combine (research/seed-000-caote.md §4.9):
      ``"group_l2"`` (default, option 1) sqrt(sum_g c_g^2), the L2 norm of the group's
      concatenated output errors; ``"mean"``, ``"sum"``, ``"max"`` (option 2) of the per-head
      scores; ``"shared"`` (option 3) one CAOTE score per KV head from the base's own
      group-aggregated score. Per-query-head base scores exist for H2O (accumulators kept per
      query head), TOVA (the newest query's row per head) and SnapKV (the window's attention
      per head, pooled); any other base is scored as ``"shared"``.
    - ``output_after_eviction``: a block's (or decode step's) output is computed over the
      tokens kept, Eq. 7 read literally (research/seed-000-caote.md §2.2, §12 item 2).
    - ``max_groups``: per-query-head H2O accumulators are float32 channels of the store,
      whose count must be fixed before the model's G is known: this many (G <= max_groups).

    Everything else (channels, statistics, updates, protection, schedule checks) is the base's.
    """

    base: Scorer = field(default_factory=H2O)
    fast: bool = False
    gqa: str = "group_l2"
    output_after_eviction: bool = True
    max_groups: int = 8

    def __post_init__(self):
        if not isinstance(self.base, Scorer):
            raise TypeError(f"CAOTE base must be a kvcache_ext.policies scorer, got {self.base!r}")
        if isinstance(self.base, StreamingLLM):
            raise ValueError("CAOTE needs a score-based base scorer: StreamingLLM's score is the token "
                             "position (keep the newest), not a retention score that Eq. 22 can turn "
                             "into an attention distribution; the paper has no Sink+CAOTE "
                             "(research/seed-000-caote.md §4.4)")
        if isinstance(self.base, CAOTE):
            raise ValueError("CAOTE(CAOTE(...)): CAOTE scores are not attention weights; wrap the base "
                             "scorer once")
        if self.gqa not in GQA_AGGREGATIONS:
            raise ValueError(f"CAOTE gqa must be one of {GQA_AGGREGATIONS}, got {self.gqa!r}")
        if isinstance(self.max_groups, bool) or not isinstance(self.max_groups, int) or self.max_groups < 1:
            raise ValueError(f"CAOTE max_groups must be a positive integer, got {self.max_groups!r}")

    # --- where per-query-head base scores come from ----------------------------------------
    @property
    def source(self) -> str:
        """'h2o', 'tova', 'snapkv' (per-query-head base scores) or 'shared' (the base's own)."""
        if self.gqa != "shared":
            for kind, cls in (("h2o", H2O), ("tova", TOVA), ("snapkv", SnapKV)):
                if type(self.base) is cls:   # subclasses may score differently: 'shared'
                    return kind
        return "shared"

    # --- the base's interface, plus what CAOTE reads ----------------------------------------
    @property
    def channels(self) -> int:
        return self.base.channels + (self.max_groups if self.source == "h2o" else 0)

    @property
    def update_stats(self) -> tuple[str, ...]:
        extra = ("last",) if self.source == "h2o" else ()
        return tuple(dict.fromkeys(tuple(self.base.update_stats) + extra))

    @property
    def evict_stats(self) -> tuple[str, ...]:
        extra = ("last",) if self.source in ("tova", "snapkv") else ()
        return tuple(dict.fromkeys(tuple(self.base.evict_stats) + extra))

    @property
    def stats_window(self) -> int | None:
        return self.base.stats_window

    @property
    def needs_kv(self) -> bool:
        return True

    @property
    def needs_queries(self) -> bool:
        return self.base.needs_queries or self.source in ("h2o", "snapkv")

    @property
    def updates_from_view(self) -> bool:
        return self.base.updates_from_view or self.source == "h2o"

    def default_protection(self) -> Protection:
        return self.base.default_protection()

    def check(self, schedule) -> None:
        self.base.check(schedule)

    def update(self, channels: torch.Tensor, stats: dict) -> None:
        self.base.update(channels[..., :self.base.channels], stats)

    def update_view(self, view: CacheView) -> torch.Tensor:
        new = view.channels.clone()
        cb = self.base.channels
        if self.base.updates_from_view:
            new[..., :cb] = self.base.update_view(self._base_view(view))
        if self.source == "h2o":
            G = self._check_groups(view.groups)
            if view.q is None or view.q.shape[2] == 1:       # one query: the kernel's per-head row
                mass = view.stats["last"]                    # [B, H, L, G]
            else:                                            # a block: each head's column sums
                mass = _query_probs(view).sum(dim=3).permute(0, 1, 3, 2)
            new[..., cb:cb + G] += mass.masked_fill(~view.mask[..., None], 0.0)
        return new

    # --- scores -----------------------------------------------------------------------------
    def prompt_scores(self, p: PromptView):
        base_scores, base_channels = self.base.prompt_scores(p)
        B, H, n, _ = p.k.shape
        source = self.source
        own = None
        if source == "shared":
            h = base_scores[:, :, None]
        elif source == "h2o":
            G = self._check_groups(p.groups)
            h = p.q.new_zeros(B, p.q.shape[1], n, dtype=torch.float32)
            for _, probs in p.probs():
                h[..., :probs.shape[-1]] += probs.sum(dim=2)
            h = h.unflatten(1, (H, G))                                   # [B, H, G, n]
            own = torch.cat([h.permute(0, 1, 3, 2), h.new_zeros(B, H, n, self.max_groups - G)], dim=-1)
        elif source == "tova":
            (_, last), = p.probs(slice(n - 1, n))
            h = last[:, :, 0].unflatten(1, (H, p.groups))
        else:                                                            # snapkv
            s: SnapKV = self.base
            w = min(s.window, n)
            (_, probs), = p.probs(slice(n - w, n), chunk=w)              # [B, Hq, w, n]
            if s.order == "pool_then_mean":
                h = s._pool(probs).sum(dim=2)
            else:
                h = s._pool(probs.sum(dim=2))
            h = h.unflatten(1, (H, p.groups))
        scores = self._scores(h, p.v, p.valid[:, None, :].expand(B, H, n))
        channels = base_channels
        if own is not None:
            if channels is None:
                channels = own.new_zeros(B, H, n, self.base.channels)
            channels = torch.cat([channels.float(), own], dim=-1)
        return scores, channels

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        return self._scores(self._head_scores(view), view.v, view.mask)

    def _head_scores(self, view: CacheView) -> torch.Tensor:
        """Base scores of the cached tokens [B, H, G, L] per query head ([B, H, 1, L]: shared)."""
        source = self.source
        if source == "shared":
            return self.base.cache_scores(self._base_view(view))[:, :, None]
        if source == "h2o":
            G = self._check_groups(view.groups)
            cb = self.base.channels
            return view.channels[..., cb:cb + G].permute(0, 1, 3, 2)
        if source == "tova":
            return view.stats["last"].permute(0, 1, 3, 2)
        s: SnapKV = self.base                                            # snapkv
        if view.q is None or min(s.window, view.q.shape[2]) == 1:
            h = view.stats["last"].permute(0, 1, 3, 2)
        else:
            h = _query_probs(view, s.window).sum(dim=3)
        return s._pool(h.masked_fill(~view.mask[:, :, None], 0.0))

    def _scores(self, h: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, H, G, L] base scores, v [B, H, L, D], mask [B, H, L] -> CAOTE scores [B, H, L]."""
        h = h.float().masked_fill(~mask[:, :, None], 0.0)
        if bool((~torch.isfinite(h) | (h < 0)).any()):
            raise ValueError(f"CAOTE needs finite, non-negative base scores (Eq. 22); "
                             f"{self.base!r} gave negative or non-finite ones")
        alpha = normalize_scores(h, mask[:, :, None])
        c = torch.stack([caote_scores(alpha[:, :, g], v, mask, self.fast) for g in range(h.shape[2])], dim=2)
        return aggregate_groups(c, self.gqa)

    def _base_view(self, view: CacheView) -> CacheView:
        return replace(view, channels=view.channels[..., :self.base.channels])

    def _check_groups(self, groups: int) -> int:
        if groups > self.max_groups:
            raise ValueError(f"CAOTE({type(self.base).__name__}) keeps per-query-head scores in "
                             f"max_groups={self.max_groups} channels, but this model has {groups} query "
                             f"heads per KV head; pass max_groups={groups} (or gqa='shared')")
        return groups


def _query_probs(view: CacheView, window: int | None = None) -> torch.Tensor:
    """Softmax of the latest call's queries (the last ``window`` of them) over the cached tokens,
    per query head, as the model computed it: [B, H, G, n, L] float32, causal by position,
    zero for padding queries (q_pos -1) and beyond each head's tokens."""
    q, q_pos = view.q, view.q_pos
    if window is not None and window < q.shape[2]:
        q = q[:, :, -window:]
        q_pos = q_pos[:, -window:] if q_pos is not None else None
    B, Hq, n, D = q.shape
    H = view.k.shape[1]
    q = q.float().view(B, H, Hq // H, n, D)
    logits = torch.einsum("bhgid,bhjd->bhgij", q, view.k.float()) * view.scale
    visible = view.mask[:, :, None, None, :]
    if q_pos is not None:
        visible = visible & (view.pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


# ------------------------------------------------------------------------------ shorthands

def FastCAOTE(base: Scorer | None = None, **kwargs) -> CAOTE:
    """FastCAOTE (Eq. 23): ``CAOTE(base, fast=True, ...)``."""
    return CAOTE(base=H2O() if base is None else base, fast=True, **kwargs)


def caote_policy(base: Scorer | None = None, *, budget: int | None = None, ratio: float | None = None,
                 fast: bool = False, prefill_block: int = 128, gqa: str = "group_l2",
                 **policy_kwargs) -> Policy:
    """The paper's setting: X+CAOTE (or X+FastCAOTE) with block-wise prefill of m = 128 tokens
    and one eviction per generated token, i.e.
    ``Policy(CAOTE(base, fast=fast), budget=..., schedule=EveryStep(prefill_block=128))``.
    ``policy_kwargs`` go to ``Policy`` (allocation=..., protection=...)."""
    scorer = CAOTE(base=H2O() if base is None else base, fast=fast, gqa=gqa)
    return Policy(scorer, budget=budget, ratio=ratio, schedule=EveryStep(prefill_block=prefill_block),
                  **policy_kwargs)
