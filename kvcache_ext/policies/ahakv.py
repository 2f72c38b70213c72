"""AhaKV (Gu et al., 2025): recent accumulation of a length-adaptive softmax, times a value prior.

Equation, algorithm and section numbers are the paper's; docs/policies.md ("AhaKV") gives every
choice the paper leaves open.

- RA, Recent Accumulation (Eq. 5): the score of token j sums the attention it gets from the
  last ``r`` query rows only, so every token outside the window has the same number of terms.
- SG-softmax (Eq. 9, 12): that attention is a softmax with its own scale,
  ``softmax(lam * w)``, ``lam = sqrt(2 ln(i / k) / d)``: i tokens, k the budget, d the head dim.
- VPE, Value-Prior Enhance (Eq. 13-15): the score is multiplied by ``gamma / max(gamma)``, with
  ``gamma`` the squared L2 norms of the value vectors, average-pooled along the sequence.
- Algorithm 1: keep the ``B_r`` newest tokens (a protection here) and the top ``B_s`` by score;
  while decoding, ``F_t = SGsoftmax(A_t) + F_{t-1}`` at every step and evict again.
- Score pooling (not in the paper's equations; its Fig. 3 caption: "pooling is applied to
  smooth scores and prevent excessive text sparsification"): the score the top-k reads is
  ``F^`` max-pooled with kernel 7 along the positions (``score_pool``), blind to padding and to
  the ``B_r`` recent tokens; the running score F itself is not pooled.

The scoring softmax is not the model's, so the attention kernel's statistics do not serve: the
scorer computes it itself, in float32, from the queries and keys (``update_view``). The model's
attention output is not changed (the paper's Appendix E).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcache_ext.checks import Bool, Choice, Instance, Int, Optional, check_fields
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.pooling import KERNEL, Pooling
from kvcache_ext.policies.protection import Protection, newest
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.views import CacheView, PromptView, newest_queries

READINGS = ("consistent", "literal")
PREFILL_I = ("row", "prompt")
DECODE_I = ("prefill", "position", "cache")
BUDGET_K = ("total", "selected")
AHAKV_GQA = ("mean", "sum", "max")


def sg_lambda(i, k, d: int) -> torch.Tensor:
    """Eq. 12, ``lam = sqrt(2 ln(i / k) / d)`` (float64, natural log), elementwise over i and k.

    Where ``i <= k`` the logarithm is not positive and Eq. 12 has no real value (the paper does
    not say what to do); ``ln(i / k)`` is clamped at 0 there, so
    ``lam = 0``: Eq. 12's own limit at i = k, a uniform scoring softmax, never a NaN.
    """
    i = torch.as_tensor(i, dtype=torch.float64)
    k = torch.as_tensor(k, dtype=torch.float64, device=i.device)
    return torch.sqrt(2.0 * torch.log(i.clamp_min(1.0) / k.clamp_min(1.0)).clamp_min(0.0) / d)


@dataclass
class AhaKV(Scorer):
    """Score of a cached token (the paper's §4, Algorithm 1):

    - prompt (one-shot prefill, Alg. 1 lines 6-11): ``F^_s = gamma_bar * F_s``, where ``F_s[j]``
      is the SG-softmax attention of token j summed over the last ``rows`` real queries of the
      prompt (causal, blind to padding), and ``gamma_bar`` the pooled value norms over their max;
    - every decode step (lines 26-27): ``F_t = F_{t-1} + SG-softmax attention of the new query``
      over the cached keys and its own (``B + 1`` keys), the new token starting at 0; no value
      prior on these increments (Algorithm 1 read literally; ``decode_prior=True``
      multiplies each increment by the current cache's ``gamma_bar`` instead);
    - a prefill block over the cache (``BlockwisePrefill``, not in the paper): like the prompt,
      with the cache plus the block as the sequence and the block's last ``rows`` real queries
      as the window: the block re-scores every cached token (RA: a constant number of terms).
      Per batch row: a row with a single real query in the call takes the decode step's
      update (a block of one token and a decode step are the same computation, and the engine
      does not tell them apart), a row with none keeps its scores.

    The ``recent`` newest tokens (B_r) are always kept and count toward the budget (Alg. 1
    lines 7, 12, 28, 30): ``Protection(recent=recent)``, plus ``sinks`` first positions (not in
    the paper, 0 = faithful). The budget B is the policy's; B_s = B - B_r is what the score picks.

    Parameters (defaults: the paper's where it gives one, §5.2.1; where it is ambiguous, an
    option, its default explained in docs/policies.md, "AhaKV"):

    - ``recent``: B_r = 32 (§5.2.1, "a fixed recent budget of 32").
    - ``rows``: r, the accumulated query rows (Eq. 5). ``None`` = ``recent`` (Alg. 1 and App. E
      use the B_r recent rows; Eq. 5 as printed spans r + 1 rows).
    - ``kernel``: the AvgPool window of Eq. 13 (stride 1, same length). The paper gives no size;
      7 is our choice. Padding and the sequence ends do not count (``count_include_pad=False``,
      so that the first and last tokens are not deflated).
    - ``reading``: what lam multiplies (Eq. 7-10 and Alg. 1 line 6 disagree). ``"consistent"``
      (default): the raw ``Q K^T`` (lam replaces 1/sqrt(d), as Eq. 7-10 derive it). ``"literal"``:
      Alg. 1 line 6's ``Q K^T / sqrt(d)`` (d the head dim, not the model's scale), i.e.
      ``lam / sqrt(d)``.
    - ``budget_k``: k of Eq. 12, "the token number of the budget": ``"total"`` = B (default,
      the paper does not say which) or ``"selected"`` = B - recent. B is this layer's per-head
      budget of the eviction (``view.budget``: the layer's average over heads under Ada-KV, the
      layer's own under a pyramid, ``decode_target`` at ``EveryNSteps(target=...)``).
    - ``prefill_i``: i of Eq. 12 for a prompt's (or block's) window row at position p:
      ``"row"`` = p + 1, the tokens that row sees (Eq. 9's per-row lam_i, default),
      or ``"prompt"`` = n, the prompt length so far (one lam per row of the batch).
    - ``decode_i``: i of Eq. 12 at a decode step (the paper does not say): ``"prefill"`` (default,
      §5.2.1's "use Eq. 12 to initialize the parameter lam": lam stays at its prefill value,
      i = n, the tokens seen at the row's latest scoring from a window: the prompt, or the
      latest block with several real queries; with none, a prompt of one token say,
      ``"position"`` is used),
      ``"position"`` (i = tokens seen, the new token's position + 1) or ``"cache"`` (i =
      the keys in the softmax, that head's cached tokens with the new one, B + 1).
    - ``gqa``: how the G query heads of a KV head combine (the paper is per head and silent on
      GQA): ``"mean"`` (default; the same top-k as ``"sum"``), ``"sum"`` or ``"max"``, of each
      head's sum over the window rows (of each head's decode increment). ``gamma_bar`` is per
      KV head (V is).
    - ``decode_prior``: see above, default False (the literal Algorithm 1).
    - ``sinks``: attention sinks kept besides the window, default 0 (the paper keeps none).
    - ``score_pool``: the pooling of the eviction score (``kvcache_ext.policies.pooling``),
      default ``Pooling(7, "max")`` (the Fig. 3 caption's pooling of the scores; unpooled,
      AhaKV misses nearly every passkey prompt of docs/results.md); ``None`` = only the value
      norms of Eq. 13 are pooled.

    Every softmax, norm and running score is float32 (``||v||^2`` can overflow fp16, and the
    decode sums run over hundreds of steps).
    """

    recent: int = 32
    rows: int | None = None
    kernel: int = 7
    reading: str = "consistent"
    budget_k: str = "total"
    prefill_i: str = "row"
    decode_i: str = "prefill"
    gqa: str = "mean"
    decode_prior: bool = False
    sinks: int = 0
    score_pool: Pooling | None = field(default_factory=Pooling)

    # One channel: the running eviction score F of Algorithm 1; the keys for the scoring
    # softmax over the cache, the values for the value prior.
    capabilities = Capabilities(channels=1, updates_from_view=True, needs_kv=True, needs_queries=True)

    def __post_init__(self):
        check_fields(self, "AhaKV", recent=Int(0), rows=Optional(Int(1)), kernel=KERNEL,
                     reading=Choice(READINGS), budget_k=Choice(BUDGET_K), prefill_i=Choice(PREFILL_I),
                     decode_i=Choice(DECODE_I), gqa=Choice(AHAKV_GQA), decode_prior=Bool(), sinks=Int(0),
                     score_pool=Optional(Instance(Pooling, "a kvcache_ext.policies.Pooling")))
        if self.window < 1:
            raise ValueError(f"AhaKV accumulates over rows >= 1 query rows, got rows={self.rows} "
                             f"with recent={self.recent}; give rows= when recent is 0")

    @property
    def window(self) -> int:
        """r: how many query rows are accumulated (Eq. 5)."""
        return self.recent if self.rows is None else self.rows

    def default_protection(self) -> Protection:
        return Protection(sinks=self.sinks, recent=self.recent)

    # --- the pieces of the score --------------------------------------------------------------
    def logit_scale(self, i, k, d: int) -> torch.Tensor:
        """The factor on the raw dot products ``q . k`` of the scoring softmax (float64)."""
        lam = sg_lambda(i, k, d)
        return lam if self.reading == "consistent" else lam / math.sqrt(d)

    def budget_tokens(self, budget: torch.Tensor | None) -> torch.Tensor:
        """k of Eq. 12 per batch row, from the eviction's per-head budget [B]."""
        if budget is None:
            raise ValueError("AhaKV needs the eviction's budget (k of Eq. 12): view.budget is None")
        k = budget.double()
        return k - self.recent if self.budget_k == "selected" else k

    def value_prior(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eq. 13-14: v [B, H, L, D], mask [B, H, L] -> gamma_bar [B, H, L] (0 off the mask).

        nu = ||v||^2, averaged over the real tokens among the ``kernel`` nearest of the sequence
        (padding and the ends do not count), divided by its maximum over the real tokens."""
        B, H, L, _ = v.shape
        real = mask.float()
        nu = v.float().square().sum(dim=-1) * real
        pool = lambda x: F.avg_pool1d(x.reshape(B * H, 1, L), self.kernel, stride=1,
                                      padding=self.kernel // 2).view(B, H, L)
        gamma = (pool(nu) / pool(real).clamp_min(1e-30)) * real
        top = gamma.amax(dim=-1, keepdim=True)
        # All values zero: no prior information, a neutral prior (not in the paper).
        return torch.where(top > 0, gamma / top.clamp_min(1e-30), real)

    def window_attention(self, view, q, q_pos, scale) -> torch.Tensor:
        """Sum over queries of the SG-softmax attention over ``view``'s keys (a PromptView or a
        CacheView), per KV head: q [B, Hq, r, D], q_pos [B, r] (-1: a padding query, which adds
        nothing); scale: the factor on the raw logits, broadcastable to [B, H, r] -> [B, H, L]."""
        probs = view.query_probs(q, q_pos, scale)                               # [B, Hq, r, L]
        per_head = probs.sum(dim=2).unflatten(1, (-1, view.groups))            # [B, H, G, L]
        if self.gqa == "mean":
            return per_head.mean(dim=2)
        if self.gqa == "sum":
            return per_head.sum(dim=2)
        return per_head.amax(dim=2)

    def pooled(self, scores: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
               last_pos: torch.Tensor) -> torch.Tensor:
        """The eviction score: ``scores`` [B, H, L] pooled by ``score_pool`` along positions,
        blind to padding and to the ``recent`` newest tokens (kept anyway)."""
        if self.score_pool is None:
            return scores
        return self.score_pool(scores, mask & ~newest(pos, last_pos, self.recent))

    # This layer's state between calls, in ``view.layer_state``: the prompt length (``decode_i=
    # "prefill"``'s i) and the newest positions at the previous call.
    PROMPT_LEN, LAST_POS = "ahakv.prompt_len", "ahakv.last_pos"

    def _window_scores(self, view, q, q_pos, q_valid, v, k_real, last_pos, budget):
        """Alg. 1 lines 6-10 on a sequence: gamma_bar * (SG attention summed over the window).
        q [B, Hq, m, D] with q_pos / q_valid [B, m], over ``view``'s keys; returns [B, H, L]."""
        D = q.shape[-1]
        index, real = newest_queries(q_valid, q_pos, self.window)
        q = q.gather(2, index[:, None, :, None].expand(-1, q.shape[1], -1, D))
        q_pos = q_pos.gather(1, index).masked_fill(~real, -1)
        if self.prefill_i == "row":
            i = q_pos + 1
        else:
            i = (last_pos + 1)[:, None].expand_as(q_pos)
        scale = self.logit_scale(i, self.budget_tokens(budget)[:, None].to(i.device), D)[:, None]
        mass = self.window_attention(view, q, q_pos, scale)
        return mass * self.value_prior(v, k_real)

    # --- the Scorer interface -----------------------------------------------------------------
    def prompt_scores(self, p: PromptView):
        B, H, n, _ = p.k.shape
        k_real = p.valid[:, None, :].expand(B, H, n)
        scores = self._window_scores(p, p.q, p.pos, p.valid, p.v, k_real, p.last_pos, p.budget)
        p.layer_state[self.PROMPT_LEN] = p.last_pos + 1                     # decode_i="prefill"
        p.layer_state[self.LAST_POS] = p.last_pos.clone()
        pooled = self.pooled(scores, p.pos[:, None, :].expand(B, H, n), k_real, p.last_pos)
        return pooled, scores.unsqueeze(-1)                                 # F_0 = F^_s (line 19)

    def update_view(self, view: CacheView) -> torch.Tensor:
        """Per batch row, by its real queries in the call: several (a prompt block) re-score
        like a prompt (lines 6-10); one (a decode step, or a block of one token: the two are
        the same computation) adds its SG-softmax row (line 27); none keeps the scores."""
        q, mask, state = view.q, view.mask, view.layer_state
        B, _, m, D = q.shape
        F_prev = view.channels[..., 0]
        if view.q_pos is not None:
            q_pos = view.q_pos
        else:
            # One query per row, which the engine marks real in every row. A row whose newest
            # position has not moved since this layer's previous call appended nothing: its
            # query is a padding slot (a block of one token that the row sits out).
            q_pos = view.last_pos[:, None].expand(B, m)
            before = state.get(self.LAST_POS)
            if before is not None:
                q_pos = q_pos.masked_fill((view.last_pos <= before)[:, None], -1)
        state[self.LAST_POS] = view.last_pos.clone()
        q_real = q_pos >= 0
        count = q_real.sum(dim=1)                                               # [B]
        prompt_len = state.get(self.PROMPT_LEN, torch.full_like(view.last_pos, -1))
        F_new = F_prev
        several = count > 1
        if bool(several.any()):
            fresh = self._window_scores(view, q, q_pos, q_real, view.v, mask, view.last_pos, view.budget)
            F_new = torch.where(several[:, None, None], fresh, F_new)
            prompt_len = torch.where(several, view.last_pos + 1, prompt_len)
            state[self.PROMPT_LEN] = prompt_len
        one = count == 1
        if bool(one.any()):
            index, real = newest_queries(q_real, q_pos, 1)
            q1 = q.gather(2, index[:, None, :, None].expand(-1, q.shape[1], -1, D))   # [B, Hq, 1, D]
            p1 = q_pos.gather(1, index)                                             # [B, 1]
            step = self._step(q1, p1, real & one[:, None], view, prompt_len)
            F_new = torch.where(one[:, None, None], F_prev + step, F_new)
        return F_new.masked_fill(~mask, 0.0).unsqueeze(-1)

    def _step(self, q, q_pos, q_real, view: CacheView, prompt_len: torch.Tensor) -> torch.Tensor:
        """Line 27's increment: the SG-softmax row of one query per batch row (q [B, Hq, 1, D],
        q_pos / q_real [B, 1]) over the cached keys, the new one included -> [B, H, L]."""
        D, mask = q.shape[-1], view.mask
        k = self.budget_tokens(view.budget).to(q_pos.device)
        if self.decode_i == "cache":
            scale = self.logit_scale(mask.sum(dim=-1), k[:, None], D)[..., None]      # [B, H, 1]
        else:
            seen = q_pos[:, 0] + 1                                                    # tokens seen
            i = seen if self.decode_i == "position" else torch.where(prompt_len > 0, prompt_len, seen)
            scale = self.logit_scale(i, k, D)[:, None, None]                          # [B, 1, 1]
        step = self.window_attention(view, q, q_pos.masked_fill(~q_real, -1), scale)
        if self.decode_prior:
            step = step * self.value_prior(view.v, mask)
        return step

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        return self.pooled(view.channels[..., 0], view.pos, view.mask, view.last_pos)
