"""K-VEC (coverage-driven KV cache eviction): SnapKV's windowed score, re-scored with a longer
window on the least focused heads, plus a cross-layer coverage bonus, with each head's own best
tokens protected (*Coverage-Driven KV Cache Eviction for Efficient and Improved Inference of LLM*,
an anonymous submission: its Eq. 8-16 and Algorithm 1)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.checks import Choice, Int, Real, check_fields
from kvcache_ext.policies.pooling import KERNEL, POOLING_MODES, Pooling
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import GQA_MODES, Scorer, group_reduce
from kvcache_ext.policies.views import PromptView

IMPORTANCE_HEADS = ("query", "kv")
SHARED_KEY = "kvec"   # PromptView.cache_state[SHARED_KEY]: the CoverageState of the current prefill


@dataclass
class CoverageState:
    """The cross-layer state of one prefill (Eq. 12), kept in ``PromptView.cache_state`` (the
    dict every layer of a cache shares; ``RaggedCache.scorer_state`` shows it).

    ``counts[b, t]`` = n_t: how many of the layers processed so far kept token t (by index in
    the prompt) in at least one of their KV heads. ``h_top[l]``: the KV heads [B, δ] that layer
    l re-scored with the extended window (Eq. 11), for inspection.
    """

    counts: torch.Tensor            # [B, n] int32
    valid: torch.Tensor             # [B, n] bool
    layers: int = 0                 # layers processed so far
    h_top: list = field(default_factory=list)

    def coverage(self) -> torch.Tensor:
        """[B] fraction of each row's real tokens kept by at least one head of one layer
        (the paper's coverage C / T, Tables 6-7)."""
        covered = ((self.counts > 0) & self.valid).sum(dim=1).float()
        return covered / self.valid.sum(dim=1).clamp_min(1).float()

    def add_layer(self, kept: torch.Tensor, h_top: torch.Tensor) -> None:
        """One more layer done: ``kept`` [B, n] bool, the tokens it kept in some KV head."""
        self.counts += kept.to(self.counts.dtype)
        self.layers += 1
        self.h_top.append(h_top)

    def move_to(self, device: torch.device) -> None:
        """Follows the layers to their device (a model split over several)."""
        if self.counts.device != device:
            self.counts, self.valid = self.counts.to(device), self.valid.to(device)


@dataclass
class KVECLayer:
    """Algorithm 1's intermediate values for one layer (what ``KVEC.adjust`` returns)."""

    base: torch.Tensor          # [B, H, n] P after Eq. 11 (the "original priority")
    sigma: torch.Tensor         # [B, H] Eq. 10, from the Eq. 8 scores
    h_top: torch.Tensor         # [B, δ] KV heads re-scored with the extended window
    importance: torch.Tensor    # [B, n] I, Eq. 13
    coverage: torch.Tensor      # [B, n] n_t / (l + 1), Eq. 12
    focus: torch.Tensor         # [B, n] Eq. 14
    preserved: torch.Tensor     # [B, H, n] bool: each head's own top-(β·B) by P (Eq. 16)
    scores: torch.Tensor        # [B, H, n] P' after Eq. 15 and Eq. 16


@dataclass
class KVEC(Scorer):
    """K-VEC, one-shot at prefill, layer by layer (the paper's §4 and §5.1, Algorithm 1).

    Per layer l, on the last ``window`` (O) prompt queries' causal softmax rows:

    1. Eq. 8: P[h, t] = mean over the O window queries of the attention to t, per query head,
       then over the G query heads of KV head h (``gqa``), then pooled along positions
       (``kernel``, ``pooling``: max-pool of kernel 7 by default, SnapKV's, as §5.1's "details
       and parameters are adapted from the SnapKV" reads; ``kernel=1`` is the equations read
       literally). The pooling is blind to padding and to the ``keep_recent`` tokens.
    2. Eq. 10-11: the ``delta`` KV heads with the lowest standard deviation of P over the
       candidate tokens (the least focused) get P recomputed over the last ``extended_window``
       (O') queries instead.
    3. Eq. 12-15: P' = P + ``lam`` * I * (1 - n_t / (l + 1)), where I[t] = mean over the O window
       queries of the max over the heads (``importance_heads``) of the attention to t, and n_t
       counts the earlier layers that kept t in at least one KV head.
    4. Eq. 16: each head's own top floor(``beta`` * B) tokens by P get P' = ``protect_value``
       (the paper's 1.0). B = the layer's per-head budget minus ``keep_recent``.

    The engine then keeps the top-B of P' per KV head (Eq. 9) and this scorer adds the kept
    tokens to n_t for the next layer. ``keep_recent`` > 0 always keeps the newest tokens
    (SnapKV's convention, not the paper's Eq. 9) and removes them from the candidates.
    """

    window: int = 16              # O: "e.g., 16" (§4.1)
    extended_window: int = 32     # O' (§5.1, Table 10b)
    delta: int = 3                # δ (§5.1, Table 10e)
    lam: float = 1.0              # λ (§5.1, Table 10c)
    beta: float = 0.25            # β (Table 10d)
    protect_value: float = 1.0    # Eq. 16's override; float("inf") makes the protection absolute
    keep_recent: int = 0          # 0 = Eq. 9 literally (top-B of all T tokens)
    kernel: int = 7               # pooling of P along positions (SnapKV's); 1 = none (the equations)
    pooling: str = "max"
    gqa: str = "mean"             # query heads -> KV head for P (not in the paper; docs/policies.md)
    importance_heads: str = "query"   # Eq. 13's max_h over the query heads, or over the KV heads

    def __post_init__(self):
        check_fields(self, "K-VEC", window=Int(1), extended_window=Int(1), delta=Int(0), lam=Real(0.0),
                     beta=Real(0.0, 1.0), protect_value=Real(allow_inf=True), keep_recent=Int(0),
                     kernel=KERNEL, pooling=Choice(POOLING_MODES), gqa=Choice(GQA_MODES),
                     importance_heads=Choice(IMPORTANCE_HEADS))
        if self.extended_window <= self.window:
            raise ValueError(f"K-VEC extended_window (O') must exceed window (O), the paper's O' > O; "
                             f"got O={self.window}, O'={self.extended_window}")

    # ------------------------------------------------------------------ policy composition
    def default_protection(self) -> Protection:
        return Protection(recent=self.keep_recent)

    def check_model(self, model) -> None:
        if model.ranks > 1:
            # Its importance is a max over every head of the layer and its coverage counts run
            # over the layers' kept tokens of every head: each rank would see only its own.
            raise ValueError(f"K-VEC reads every head of a layer (Eq. 13's max over heads, the coverage "
                             f"counts), but this model's heads are split over {model.ranks} tensor-parallel "
                             "ranks, each holding its own: not supported under tensor parallelism; use another "
                             "scorer (SnapKV, AhaKV, ...)")

    def check(self, schedule) -> None:
        if schedule.evicts_over_cache:
            raise ValueError(
                "K-VEC is a one-shot prefill policy (the paper's §5.1: \"applied during the pre-fill "
                "phase of each layer\"): its scores need "
                "every layer's dense prompt attention and the coverage counts of the layers before "
                "it, and the paper evicts nothing while decoding; use schedule=OneShot(), not "
                f"{schedule}")

    def check_policy(self, policy) -> None:
        """Raises ValueError for a policy K-VEC cannot serve (allocation, protection, schedule)."""
        alloc = policy.allocation
        if not alloc.equal_heads:
            raise ValueError(
                f"K-VEC cannot use {alloc}: it needs every KV head of a layer to keep the same "
                "budget B, known before scoring. Eq. 16 protects beta*B tokens per head, and the "
                "coverage counts of the next layers (Eq. 12) need the tokens this layer keeps, "
                "which an allocation that splits the budget over the heads from the scores "
                "(Ada-KV) decides only afterwards. The paper compares K-VEC with Ada-SnapKV; it "
                "does not combine them. Use allocation=Uniform() (the paper) or Pyramid()")
        if policy.protection != self.default_protection():
            raise ValueError(
                f"K-VEC protects the newest tokens itself (keep_recent={self.keep_recent}, i.e. "
                f"{self.default_protection()}); got protection={policy.protection}. Its coverage "
                "counts follow the tokens it keeps, so set KVEC(keep_recent=...) and leave "
                "Policy(protection=None)")
        self.check(policy.schedule)

    # ------------------------------------------------------------------ scoring
    def prompt_scores(self, p: PromptView):
        B, _, n, _ = p.q.shape
        H = p.k.shape[1]
        if p.budget is None:
            raise ValueError("K-VEC needs the layer's per-head budget (PromptView.budget): Eq. 16 "
                             "protects beta*B tokens per head and the coverage counts follow "
                             "the top-B kept per head")
        budget = p.budget.to(p.q.device).long().view(B)
        state = self._state(p)
        pos_h = p.pos[:, None, :].expand(B, H, n)
        recent = Protection(recent=self.keep_recent).mask(pos_h, p.last_pos)[:, 0] & p.valid  # [B, n]
        probs, slots = self.window_probs(p)
        layer = self.adjust(probs, slots, p.valid & ~recent, p.pos, p.groups, p.layer_idx,
                            state.counts, budget - self.keep_recent)
        scores = layer.scores.masked_fill(recent[:, None, :], float("inf"))
        scores = scores.masked_fill(~p.valid[:, None, :], 0.0)
        # The engine keeps the top-B of these scores per KV head (Uniform / Pyramid: B is the
        # layer's budget for every head); the same selection here feeds n_t (Eq. 12).
        keep = top_k_mask(scores, p.pos, p.valid, budget[:, None].expand(B, H))
        state.add_layer(keep.any(dim=1), layer.h_top)
        return scores, None

    def _state(self, p: PromptView) -> CoverageState:
        B, _, n, _ = p.q.shape
        if p.layer_idx == 0:      # a new prefill: fresh counts, whatever the dict held
            state = CoverageState(torch.zeros(B, n, dtype=torch.int32, device=p.q.device), p.valid.clone())
            p.cache_state[SHARED_KEY] = state
            return state
        state = p.cache_state.get(SHARED_KEY)
        if state is None or state.layers != p.layer_idx or tuple(state.counts.shape) != (B, n):
            done = ("no layer" if state is None else
                    f"{state.layers} layer(s) of a {list(state.counts.shape)} prompt")
            raise RuntimeError(
                f"K-VEC's coverage counts (Eq. 12) carry over the layers of one prefill, in order "
                f"0 .. L-1, through PromptView.cache_state; layer {p.layer_idx} of a {[B, n]} prompt "
                f"came after {done}. Give every layer's PromptView the same cache_state dict, in order")
        state.move_to(p.q.device)   # layers on several devices
        return state

    def window_probs(self, p: PromptView) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax rows ``[B, Hq, W, n]`` (float32) of each row's last W = min(max(O, O'), n)
        real queries over the prompt (causal by position, blind to padding; slot W-1 is the
        newest), and ``[B, W]`` whether the slot holds a real query (a row shorter than W has
        fewer). One pass serves Eq. 8, 11 and 13."""
        n = p.q.shape[2]
        W = min(max(self.window, self.extended_window) if self.delta else self.window, n)
        probs, q_pos = p.newest_probs(W)
        return probs, q_pos >= 0

    def _window_mean(self, probs, slots, size: int) -> torch.Tensor:
        """[B, Hq, n]: the mean over the last ``size`` real window queries of each row."""
        w = min(size, probs.shape[2])
        seen = slots[:, -w:].sum(dim=1).clamp_min(1).view(-1, 1, 1)
        return probs[:, :, -w:].sum(dim=2) / seen

    def _pool(self, x: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """P [B, H, n] pooled along positions over the candidates [B, n] only."""
        return Pooling(self.kernel, self.pooling)(x, candidates[:, None, :])

    def adjust(self, probs: torch.Tensor, slots: torch.Tensor, candidates: torch.Tensor,
               pos: torch.Tensor, groups: int, layer_idx: int, counts: torch.Tensor,
               budget: torch.Tensor) -> KVECLayer:
        """Algorithm 1 for one layer.

        probs [B, Hq, W, n]: the window rows (``window_probs``); slots [B, W]: real window
        queries; candidates [B, n]: tokens competing for the budget (real, not kept anyway);
        pos [B, n]; counts [B, n]: n_t over layers 0 .. l-1; budget [B]: per-head B of the
        candidates. Ties (σ, top-K) go to the lower head and the lower position.
        """
        B, Hq, W, n = probs.shape
        H = Hq // groups
        cand = candidates[:, None, :]
        # Eq. 8: mean over the O window queries, per KV head.
        base = self._pool(group_reduce(self._window_mean(probs, slots, self.window), groups, self.gqa),
                          candidates)
        base = base.masked_fill(~cand, 0.0)
        # Eq. 10: standard deviation over the candidate tokens (biased: same ranking, no NaN).
        m = candidates.sum(dim=1).clamp_min(1).view(B, 1)
        mean = base.sum(dim=-1) / m
        sigma = ((base - mean[..., None]).masked_fill(~cand, 0.0).square().sum(dim=-1) / m).sqrt()
        # Eq. 11: the δ least focused heads (lowest σ) take the O' window instead.
        d = min(self.delta, H)
        h_top = torch.argsort(sigma, dim=1, stable=True)[:, :d]
        if d:
            wide = self._pool(group_reduce(self._window_mean(probs, slots, self.extended_window),
                                           groups, self.gqa), candidates).masked_fill(~cand, 0.0)
            chosen = torch.zeros(B, H, dtype=torch.bool, device=probs.device).scatter_(1, h_top, True)
            base = torch.where(chosen[..., None], wide, base)
        # Eq. 13: max over the heads per window query, then the mean over the O queries.
        w = min(self.window, W)
        rows = probs[:, :, -w:]
        if self.importance_heads == "kv":
            rows = group_reduce(rows, groups, self.gqa)
        importance = rows.amax(dim=1).sum(dim=1) / slots[:, -w:].sum(dim=1).clamp_min(1).view(B, 1)
        # Eq. 12, 14, 15: novelty-weighted importance, the same bonus for every head.
        coverage = counts.float() / (layer_idx + 1)
        focus = importance * (1.0 - coverage)
        scores = base + self.lam * focus[:, None, :]
        # Eq. 16: each head's own top-K by P (after Eq. 11, before the bonus), K = floor(β·B).
        k = torch.floor(budget.clamp_min(0).double() * self.beta + 1e-9).long()
        preserved = top_k_mask(base, pos, candidates, k[:, None].expand(B, H))
        scores = scores.masked_fill(preserved, self.protect_value)
        return KVECLayer(base=base, sigma=sigma, h_top=h_top, importance=importance, coverage=coverage,
                         focus=focus, preserved=preserved, scores=scores)


def top_k_mask(scores: torch.Tensor, pos: torch.Tensor, candidates: torch.Tensor,
               k: torch.Tensor) -> torch.Tensor:
    """keep [B, H, n]: the k[b, h] best candidates of each (row, head) by score, ties to the
    lower position (the engine's segmented top-k rule). scores [B, H, n] (no NaN), pos [B, n],
    candidates [B, n] bool, k [B, H]."""
    B, H, n = scores.shape
    by_pos = torch.argsort(pos.masked_fill(~candidates, torch.iinfo(pos.dtype).max), dim=1, stable=True)
    s = scores.float().gather(2, by_pos[:, None, :].expand(B, H, n))
    s = s.masked_fill(~candidates.gather(1, by_pos)[:, None, :], float("-inf"))
    order = torch.argsort(s, dim=2, descending=True, stable=True)     # best first, ties by position
    token = by_pos[:, None, :].expand(B, H, n).gather(2, order)
    steps = torch.arange(n, device=scores.device).expand(B, H, n).contiguous()
    rank = torch.empty_like(token).scatter_(2, token, steps)
    return (rank < k[..., None]) & candidates[:, None, :]
