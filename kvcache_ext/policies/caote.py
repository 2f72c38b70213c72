"""CAOTE (Goel et al., 2025): evict the tokens whose removal changes the attention output least.

CAOTE wraps a score-based scorer (H2O, TOVA, SnapKV, ...). The base scorer's retention scores
``h`` of the current candidates of a head are normalized to sum to one (Eq. 22) and read as an
attention row; the score of token j is then the change of the attention output when j alone
is evicted and the rest renormalized (Theorem 3.2):

    c_j = h_j / (1 - h_j) * || V h^T - v_j ||_2              (CAOTE, Eq. 8 / 21)
    c_j = h_j / (1 - h_j) * || mean_i v_i - v_j ||_2          (FastCAOTE, Eq. 23)

The tokens with the smallest ``c`` are evicted. docs/policies.md ("CAOTE and FastCAOTE") gives
every choice the paper leaves open.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvcache_ext.checks import Bool, Choice, Instance, Int, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.h2o import H2O
from kvcache_ext.policies.policy import Policy
from kvcache_ext.policies.schedule import EveryStep
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.streaming_llm import StreamingLLM
from kvcache_ext.policies.views import CacheView, PromptView
from kvcache_ext.policies.wrapper import Wrapper

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

    Computed in float32 whatever the inputs' dtype, in a numerically stable form (not in the
    paper; docs/policies.md, "What it computes"): only the largest weight j* can exceed 1/2, so
    for every other token ``1 - alpha_j >= 1/2`` and the paper's formula is well conditioned. For j*,
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
    """c [B, H, G, L] per query head -> [B, H, L] per KV head (the paper never mentions GQA;
    docs/policies.md, "GQA")."""
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
class CAOTE(Wrapper):
    """CAOTE on top of ``base``: the base's scores of a head's candidates, normalized (Eq. 22),
    weighted by how far each token's value is from the attention output (Eq. 21), or from the
    plain mean of the values with ``fast=True`` (FastCAOTE, Eq. 23). Lower = evicted first.

    - ``base``: any score-based scorer with non-negative scores (H2O, TOVA, SnapKV, AhaKV,
      Random or your own). StreamingLLM is refused: its score is a position, not a retention
      score.
    - ``gqa``: how the G query heads of a KV head combine (the paper never mentions GQA;
      docs/policies.md, "GQA"). ``"shared"`` (default): one CAOTE score per KV head from the
      base's own score (``cache_scores`` / ``prompt_scores``), so that base and base+CAOTE differ only by
      CAOTE (TOVA's layer average stays TOVA's). Per query head, from the base's per-head
      scores (``Scorer.prompt_head_scores`` / ``cache_head_scores``; H2O, TOVA and SnapKV have
      them), then combined: ``"group_l2"`` sqrt(sum_g c_g^2), the L2 norm of the group's
      concatenated output errors (App. B.2 concatenates the heads' errors); ``"mean"``,
      ``"sum"``, ``"max"``. A base with no per-head scores is refused with those when CAOTE is
      built.
    - ``output_after_eviction``: a block's (or decode step's) output is computed over the
      tokens kept, Eq. 7 read literally (§2: "computing attention output using the top-b
      tokens").
    - ``max_groups``: a base whose per-head scores need state of their own (H2O's per-head
      accumulators) keeps it in this many float32 channels, fixed before the model's G is
      known (G <= max_groups).

    Everything else (channels, statistics, updates, protection, schedule checks) is the base's.
    """

    base: Scorer = field(default_factory=H2O)
    fast: bool = False
    gqa: str = "shared"
    output_after_eviction: bool = True
    max_groups: int = 8

    def __post_init__(self):
        # max_groups: H2O's per-head accumulators, 1 + max_groups channels of at most 65536.
        check_fields(self, "CAOTE", base=Instance(Scorer, "a kvcache_ext.policies scorer"), fast=Bool(),
                     gqa=Choice(GQA_AGGREGATIONS), output_after_eviction=Bool(), max_groups=Int(1, 65535))
        if isinstance(self.base, StreamingLLM):
            raise ValueError("CAOTE needs a score-based base scorer: StreamingLLM's score is the token "
                             "position (keep the newest), not a retention score that Eq. 22 can turn "
                             "into an attention distribution; the paper has no Sink+CAOTE "
                             "(Goel et al., 2025, App. C.1)")
        if isinstance(self.base, CAOTE):
            raise ValueError("CAOTE(CAOTE(...)): CAOTE scores are not attention weights; wrap the base "
                             "scorer once")
        if self.per_head and type(self.base).cache_head_scores is Scorer.cache_head_scores:
            raise ValueError(f"CAOTE(gqa={self.gqa!r}) reads the base's per-query-head scores, which "
                             f"{type(self.base).__name__} does not give (Scorer.prompt_head_scores / "
                             f"cache_head_scores); use gqa='shared', the base's own score")
        # The scorer that runs: the base, or (per-head readings) its copy that keeps per-head state.
        self._scoring = self.base if self.per_head is False else self.base.with_query_head_state(self.max_groups)

    @property
    def per_head(self) -> bool:
        return self.gqa != "shared"

    # --- the base's interface (``Wrapper``), plus what CAOTE reads ----------------------------
    @property
    def inner(self) -> Scorer:
        return self._scoring

    def wraps(self, inner: Capabilities) -> Capabilities:
        # A per-head reading reads one query's per-head row (``last``) and, for a block, its
        # queries' rows; every reading weighs by the values (Eq. 21).
        extra = ("last",) if self.per_head else ()
        return replace(inner, evict_stats=tuple(dict.fromkeys(inner.evict_stats + extra)), needs_kv=True,
                       needs_queries=inner.needs_queries or self.per_head,
                       output_after_eviction=self.output_after_eviction)

    # --- scores -----------------------------------------------------------------------------
    def prompt_scores(self, p: PromptView):
        if self.per_head:
            h, channels = self._require(self._scoring.prompt_head_scores(p))
        else:
            base_scores, channels = self._scoring.prompt_scores(p)
            h = base_scores[:, :, None]
        B, H, n, _ = p.k.shape
        return self._scores(h, p.v, p.valid[:, None, :].expand(B, H, n)), channels

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        if self.per_head:
            h = self._require(self._scoring.cache_head_scores(view))
        else:
            h = self._scoring.cache_scores(view)[:, :, None]
        return self._scores(h, view.v, view.mask)

    def _require(self, h):
        if h is None:
            raise ValueError(f"CAOTE(gqa={self.gqa!r}) needs per-query-head scores, which "
                             f"{type(self.base).__name__} does not give; use gqa='shared'")
        return h

    def _scores(self, h: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, H, G, L] base scores, v [B, H, L, D], mask [B, H, L] -> CAOTE scores [B, H, L]."""
        h = h.float().masked_fill(~mask[:, :, None], 0.0)
        if bool((~torch.isfinite(h) | (h < 0)).any()):
            raise ValueError(f"CAOTE needs finite, non-negative base scores (Eq. 22); "
                             f"{self.base!r} gave negative or non-finite ones")
        alpha = normalize_scores(h, mask[:, :, None])
        c = torch.stack([caote_scores(alpha[:, :, g], v, mask, self.fast) for g in range(h.shape[2])], dim=2)
        return aggregate_groups(c, self.gqa)


# ------------------------------------------------------------------------------ shorthands

def FastCAOTE(base: Scorer | None = None, **kwargs) -> CAOTE:
    """FastCAOTE (Eq. 23): ``CAOTE(base, fast=True, ...)``."""
    return CAOTE(base=H2O() if base is None else base, fast=True, **kwargs)


def caote_policy(base: Scorer | None = None, *, budget: int | None = None, ratio: float | None = None,
                 fast: bool = False, prefill_block: int = 128, gqa: str = "shared",
                 **policy_kwargs) -> Policy:
    """The paper's setting: X+CAOTE (or X+FastCAOTE) with block-wise prefill of m = 128 tokens
    and one eviction per generated token, i.e.
    ``Policy(CAOTE(base, fast=fast), budget=..., schedule=EveryStep(prefill_block=128))``.
    ``policy_kwargs`` go to ``Policy`` (allocation=..., protection=...)."""
    scorer = CAOTE(base=H2O() if base is None else base, fast=fast, gqa=gqa)
    return Policy(scorer, budget=budget, ratio=ratio, schedule=EveryStep(prefill_block=prefill_block),
                  **policy_kwargs)
