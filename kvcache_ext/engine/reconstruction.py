"""Scoring a prefilled context by reconstruction passes of the model (KVzip's protocol): each
layer's side of every ``ReconstructionScorer`` (``policies.scorer``; ``policies.KVzip``).

Such a scorer cannot score a prompt inside one layer's attention call: its scores come from
running the whole model again. So a one-shot prefill with such a scorer keeps each layer's
dense prompt aside (``hold_prompt``: a ``Context``, the full cache's K and V for the time of
the passes) and stores nothing; the model then runs each reconstruction input over it
(``kvcache_ext.hf.reconstruction``, where the model is known), and every layer's attention in
that mode (``attend_context``) computes its output exactly (softmax over the whole context and
the pass's own tokens, causal) and folds the probabilities into the context's scores. The
pass's tokens are never cached. Finally each layer keeps its budget by those scores
(``finish``), exactly as a one-shot prefill keeps its scorer's.

Extra memory: one pass's activations (``chunk`` tokens plus the instruction) and, per layer
call, one block of queries' logits over the scored keys (about 2 MiB, ``block_rows``) and,
when a pass rebuilds part of a longer context, a copy of one layer's other context keys and
values; nothing grows with the number of passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.engine.across_ranks import layer_budgets
from kvcache_ext.engine.prompt import keep_prompt, note_prompt, release_prefill_slack
from kvcache_ext.engine.state import LayerState


@dataclass
class Context:
    """One layer's dense prompt, kept while the reconstruction passes score it."""

    k: torch.Tensor          # [B, H, n, D]
    v: torch.Tensor
    pos: torch.Tensor        # [B, n] int64
    valid: torch.Tensor      # [B, n] bool
    scale: float
    scores: torch.Tensor     # [B, H, n] float32, the largest probability seen so far
    window: tuple[int, int] = (0, 0)   # context indices the current pass rebuilds
    pass_real: torch.Tensor | None = None   # [B, r] the current pass's real tokens (None: no pass)
    scorable: torch.Tensor | None = None    # [B, n] the tokens the scores rate (None: every valid one)

    def rate_only(self, scorable: torch.Tensor) -> None:
        """The passes rate these tokens [B, n] only (a skipped prefix is not rated)."""
        self.scorable = scorable

    def start_pass(self, window: tuple[int, int], real: torch.Tensor) -> None:
        """A pass that rebuilds context indices ``window`` with its real tokens ``real`` [B, r]."""
        self.window, self.pass_real = window, real

    def end_pass(self) -> None:
        self.pass_real = None


def attend_context(state, q, k, v, pos):
    """One layer's attention for a reconstruction pass: q, k, v [B, *, r, D] of the pass's
    tokens at positions ``pos`` [B, r] over the context and themselves. Updates the context's
    scores; returns [B, r, Hq, D]."""
    ctx, scorer = state.context, state.policy.scorer
    if ctx.pass_real is None:
        raise RuntimeError(
            f"layer {state.layer_idx} holds a prompt that {type(scorer).__name__} has not scored yet: "
            "its reconstruction passes run when the patched model's forward returns (call the "
            "patched model, or kvcache_ext.engine.reconstruction.reconstruct, on the prompt first)")
    real = ctx.pass_real
    # Every context token is older than every pass token: a pass token sees the real context
    # and, causally, the real pass tokens before it (padding sees the context only). In a
    # sliding-window layer it sees only the keys of its window, context and pass tokens alike.
    padded_pass = not bool(real.all())   # a host check, once
    sliding = None if state.window is None else (state.window, pos)
    own = padded_pass or sliding is not None   # the pass's own tokens need a mask, not causal=True
    sees_new = None
    if own:
        sees_new = pos[:, None, :] <= pos[:, :, None]                                   # [B, r, r]
        if padded_pass:
            sees_new = sees_new & real[:, None, :]
        if sliding is not None:
            sees_new = sees_new & (pos[:, None, :] > pos[:, :, None] - state.window)
    # The output in parts merged by their log-sum-exps, as flash-decoding merges splits: the
    # keys the scores' softmax runs over, the rest of the context (no causal structure, a mask
    # only for padding) and the pass's own tokens (causal). One masked call over everything
    # would compute every (query, key) pair of the pass with an explicit mask, which is slower.
    # The scored part's log-sum-exp is the scores' normaliser.
    scored, rest = scored_keys(ctx, scorer, sliding)
    parts = [attention_with_lse(q, scored.k, scored.v, ctx.scale, sees=scored.sees)]
    if rest is not None:
        rest_k, rest_v, rest_sees = rest
        parts.append(attention_with_lse(q, rest_k, rest_v, ctx.scale, sees=rest_sees))
    new_out, new_lse = attention_with_lse(q, k, v, ctx.scale, causal=not own,
                                          sees=sees_new[:, None] if own else None)
    parts.append((new_out, new_lse))
    lse = torch.stack([part_lse for _, part_lse in parts]).logsumexp(dim=0)
    out = sum(part_out * (part_lse - lse).exp()[..., None] for part_out, part_lse in parts)
    # The scores' softmax: over everything the query sees (softmax="context", the model's own),
    # or over the scored keys and the pass's own tokens ("chunk", KVzip's code).
    norm = lse if rest is None else torch.logaddexp(parts[0][1], new_lse)
    score_pass(ctx, scorer, q, norm, scored, real if padded_pass else None)
    return out.to(q.dtype).transpose(1, 2)


@dataclass
class ScoredKeys:
    """The context keys a pass scores: the sinks before its window, then the window."""

    k: torch.Tensor                  # [B, H, w, D]
    v: torch.Tensor
    sees: torch.Tensor | None        # [B, 1, 1, w] bool ([B, 1, r, w] per query in a sliding layer); None: all
    first: int                       # the window's first column (the sinks come before it)
    window: tuple[int, int]          # the context indices the window's columns hold


def scored_keys(ctx, scorer, sliding: tuple[int, torch.Tensor] | None = None):
    """The context split for a pass: (the keys the scores' softmax runs over, as ScoredKeys;
    the other keys as (k, v, sees) or None). With ``softmax="chunk"`` and a pass that rebuilds
    part of the context (indices ``ctx.window``), the scored keys are the sinks before the
    chunk (the shortest prefix that holds every row's: left padding moves them, the other
    columns of it masked) and the chunk; otherwise the whole context. A part's ``sees`` is None
    when every row sees all of it. ``sliding``: (window, the pass's query positions [B, r]) of a
    sliding-window layer, whose queries see only the keys inside their window: the parts'
    ``sees`` are then per query, [B, 1, r, columns]."""
    n = ctx.k.shape[2]
    lo, hi = ctx.window
    seen = lambda mask: None if bool(mask.all()) else mask[:, None, None, :]   # noqa: E731

    def windowed(sees, key_pos):
        if sliding is None:
            return sees
        window, q_pos = sliding
        inside = (key_pos[:, None, :] > q_pos[:, :, None] - window)[:, None]    # [B, 1, r, columns]
        return inside if sees is None else sees & inside

    if scorer.softmax != "chunk" or (lo == 0 and hi == n and ctx.scorable is None):
        return ScoredKeys(ctx.k, ctx.v, windowed(seen(ctx.valid), ctx.pos), 0, (0, n)), None
    scorable = ctx.valid if ctx.scorable is None else ctx.scorable
    sink = scorable[:, :lo] & (ctx.pos[:, :lo] < scorer.sinks)                    # [B, lo]
    e = int((sink * torch.arange(1, lo + 1, device=sink.device)).max()) if lo else 0

    def sinks_then_chunk(x):
        return torch.cat([x[:, :, :e], x[:, :, lo:hi]], dim=2) if e else x[:, :, lo:hi]

    scored = ScoredKeys(sinks_then_chunk(ctx.k), sinks_then_chunk(ctx.v),
                        windowed(seen(torch.cat([sink[:, :e], scorable[:, lo:hi]], dim=1)),
                                 sinks_then_chunk(ctx.pos[:, None])[:, 0]), e, (lo, hi))
    # The rest: every other key a row sees (before the chunk less the sinks, a skipped prefix
    # inside it, after it); columns no row sees are dropped.
    rest_sees = ctx.valid.clone()
    rest_sees[:, :lo] &= ~sink
    rest_sees[:, lo:hi] &= ~scorable[:, lo:hi]
    columns = rest_sees.any(dim=0).nonzero().flatten()
    if columns.numel() == 0:
        return scored, None
    rest = (ctx.k.index_select(2, columns), ctx.v.index_select(2, columns),
            windowed(seen(rest_sees[:, columns]), ctx.pos.index_select(1, columns)))
    return scored, rest


BLOCK_BYTES = 2 << 20   # the logits of one block of queries in score_pass (see block_rows)


def block_rows(columns_per_row: int) -> int:
    """Queries per block so that a block's logits (float32) stay near ``BLOCK_BYTES``: a block
    is written by the product and read back by the max over its queries, and at about 1 MiB
    per thread it stays in a core's L2 cache between the two; larger blocks are slower
    (docs/policies.md, KVzip)."""
    return max(16, BLOCK_BYTES // (4 * max(1, columns_per_row)))


FUSED_LSE_DEVICES = ("cpu",)   # where PyTorch's fused attention op returns the log-sum-exp


def attention_with_lse(q, k, v, scale, sees=None, causal=False):
    """Attention of q [B, Hq, c, D] over k, v [B, H, S, D] (Hq a multiple of H), each query
    seeing the keys where ``sees`` (bool, broadcast to [B, 1, c, S]; None: all of them, or
    causally with ``causal``, the queries being the last c of the keys' positions), and each
    query's log-sum-exp of its scaled logits: (out [B, Hq, c, D] float32, lse [B, Hq, c]
    float32). A query that sees no key gets out 0 and lse -inf. On CPU, PyTorch's fused
    attention op returns both; elsewhere the log-sum-exp comes from the logits."""
    B, Hq, c, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = Hq // H
    bias = None
    if sees is not None:
        bias = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(~sees, float("-inf"))
    if q.device.type in FUSED_LSE_DEVICES:
        if causal or G == 1:
            # Causal rows need their own head: the K/V heads repeated (a pass's keys only).
            k, v = (x.repeat_interleave(G, dim=1) if G > 1 else x for x in (k, v))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        else:
            # The fused op takes as many K/V heads as query heads: a KV head's G query heads go
            # in as G * c rows of one head instead (no copy of K/V; the mask repeats per row).
            if bias is not None:
                bias = bias.expand(B, 1, c, S)[:, :, None].expand(B, 1, G, c, S).flatten(2, 3)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.reshape(B, H, G * c, D), k, v, 0.0, False, attn_mask=bias, scale=scale)
        lse = lse.reshape(B, Hq, c).float()
        if sees is not None:   # the op gives a query that sees nothing lse 0, not -inf
            lse = lse.masked_fill(~sees.any(dim=-1).expand(B, 1, c), float("-inf"))
        return out.reshape(B, Hq, c, D).float().nan_to_num(0.0), lse
    if causal:
        sees = torch.ones(c, S, dtype=torch.bool, device=q.device).tril(S - c)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=sees, scale=scale, enable_gqa=G > 1).float().nan_to_num(0.0)
    logits = (q.float().unflatten(1, (H, G)) * scale) @ k.float().transpose(2, 3)[:, :, None]
    if sees is not None:
        logits = logits.masked_fill_(~sees.expand(B, 1, c, S)[:, :, None], float("-inf"))
    return out, logits.logsumexp(dim=-1).flatten(1, 2)


def score_pass(ctx, scorer, q, norm, scored: ScoredKeys, real):
    """Folds a pass's probabilities of the context's keys into the context's scores. A query's
    probability of key j is exp(logit_j - its log-sum-exp ``norm`` [B, Hq, r]), so the largest
    over the queries is exp of the largest difference: one product of the queries, with
    ``norm`` as one more column, against the scored keys with a row of -1s, a block of queries
    at a time; no softmax is materialised and no pass over the logits. ``real`` [B, r] (None:
    no padding) marks the queries that count."""
    B, Hq, r, D = q.shape
    H = ctx.k.shape[1]
    G = Hq // H
    lo, hi = scored.window
    keys = scored.k.float().transpose(2, 3)                                        # [B, H, D, w]
    keys = torch.cat([keys, keys.new_full((B, H, 1, keys.shape[-1]), -1.0)], dim=2)
    w = keys.shape[-1]
    if real is not None:   # a padding query's probabilities do not count: log probability -inf
        norm = norm.masked_fill(~real[:, None, :], float("inf"))
    rows = block_rows(B * Hq * w)
    best = None
    for i0 in range(0, r, rows):
        i1, c = min(i0 + rows, r), min(rows, r - i0)
        block = torch.cat([q[:, :, i0:i1].float() * ctx.scale, norm[:, :, i0:i1, None]], dim=-1)   # [B, Hq, c, D + 1]
        log_probs = (block.unflatten(1, (H, G)).flatten(2, 3) @ keys).view(B, Hq, c, w)
        if scored.sees is not None:   # one row of masks for every query, or one per query
            sees = scored.sees if scored.sees.shape[2] == 1 else scored.sees[:, :, i0:i1]
            log_probs.masked_fill_(~sees, float("-inf"))
        top = log_probs[..., scored.first:].amax(dim=2)                              # [B, Hq, hi - lo]
        best = top if best is None else torch.maximum(best, top)
    probs = best.exp_()[:, :, None]                                                 # [B, Hq, 1, hi - lo]
    ctx.scores[..., lo:hi] = torch.maximum(ctx.scores[..., lo:hi], scorer.pass_scores(probs, G))


def hold_prompt(state: LayerState, k, v, pos, valid, scale) -> None:
    """Instead of compressing a fresh prompt now: note it and keep it for the reconstruction passes."""
    B, H, n, _ = k.shape
    note_prompt(state, pos, valid)
    state.hold(Context(k=k, v=v, pos=pos, valid=valid, scale=scale,
                       scores=torch.zeros(B, H, n, dtype=torch.float32, device=k.device)))


def finish(states: list[LayerState], scores: list[torch.Tensor]) -> None:
    """Every layer (``states``, a cache's in layer order) keeps its budget of its held prompt
    by ``scores`` (the passes' raw scores, as the scorer reads them: ``held_scores``) and drops
    the rest. The layers' budgets are first split by all the scores when the allocation asks
    (AcrossLayers); that split, and each layer's over its heads, go by ``budget_scores`` where
    the scorer gives them."""
    policy = states[0].policy
    args = [(state.context.pos, state.context.valid, state.last_pos, state.model, state.shared.token_ids)
            for state in states]
    split = [policy.scorer.budget_scores(layer_scores, *a) for layer_scores, a in zip(scores, args)]   # None: held
    scores = [policy.scorer.held_scores(layer_scores, *a) for layer_scores, a in zip(scores, args)]
    if policy.allocation.whole_model:
        ranked = []
        for state, layer_scores in zip(states, [h if s is None else s for h, s in zip(scores, split)]):
            ctx = state.context
            B, H, n = layer_scores.shape
            held = ctx.valid[:, None, :].expand(B, H, n)
            if state.window is not None:   # a sliding layer holds only what the next token sees
                held = held & (ctx.pos >= state.window_start(state.last_pos + 1)[:, None])[:, None, :]
            protected_first, _ = policy.protection.apply(layer_scores, ctx.pos[:, None, :].expand(B, H, n),
                                                         state.last_pos, held)
            ranked.append(protected_first.masked_fill(~held, float("-inf")))
        base = policy.budget_for(states[0].context.valid.sum(dim=1))
        for state, budget in zip(states, layer_budgets(states[0], base, ranked)):
            state.set_budget(budget)
    for state, layer_scores, layer_split in zip(states, scores, split):
        ctx = state.release_context()
        keep_prompt(state, ctx.k, ctx.v, ctx.pos, ctx.valid, layer_scores, None, split_scores=layer_split)
        release_prefill_slack(state)
