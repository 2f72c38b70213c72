"""Spans: keeping whole words, numbers or sentences together, a part that any score-based
scorer's per-token scores go through (``Spanned``), as they go through ``Pooling``.

Every token of a span gets the span's score: the max (or the mean) of the scores of its tokens
that take part, so that the top-k keeps or drops a span as a whole (a span that straddles the
budget's threshold apart, whose tokens tie). Only the tokens that take part count: padding,
the tokens the scorer keeps anyway (its recent window) and infinite scores neither contribute
nor receive (they keep their own score), as in ``Pooling``. A span is found from the token ids
of its row (``TokenIds``, every position the row has seen, so a kept token's span reaches over
evicted neighbours) and the vocabulary's kinds (``TokenKinds``, from the tokenizer):

- ``"number"``: a maximal run of digit tokens with no whitespace inside; every other token is
  a span of its own (the least change to the scores that keeps a number from being cut to
  its first digits);
- ``"word"``: a run of tokens with no whitespace or punctuation between them, split where
  digits meet letters (so a number is a word of its own, and so is a punctuation token);
- ``"sentence"``: the tokens up to and including one that ends in ".", "!" or "?" or holds a
  newline.

Why: a tokenizer that writes one token per digit (Llama 3, SmolLM2, Qwen) spreads a number's
weight over its digits, and a scorer that attends to a number's start keeps "33" of 3336625.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.checks import Choice, Real, check_fields
from kvcache_ext.policies.token_ids import UNKNOWN, TokenIds
from kvcache_ext.policies.token_kinds import BREAK_AFTER, BREAK_BEFORE, DIGITS, ENDS_SENTENCE, TokenKinds

UNITS = ("number", "word", "sentence")
REDUCES = ("max", "mean")


def _has(flags: torch.Tensor, bit: int) -> torch.Tensor:
    return (flags & bit) != 0


@dataclass(frozen=True)
class Spans:
    """``unit``: "number", "word" (default) or "sentence" (above). ``reduce``: "max" (default),
    each token takes its span's best score, or "mean", the span's average. ``share``: the part
    of a token's score that is its span's, the rest its own: 1 (default), the span's alone;
    0.5, halfway, so that within a span the best tokens still come first and a span's other
    tokens rank by the span and by themselves; 0, the token's own score."""

    unit: str = "word"
    reduce: str = "max"
    share: float = 1.0

    def __post_init__(self):
        check_fields(self, "Spans", unit=Choice(UNITS), reduce=Choice(REDUCES),
                     share=Real(0.0, 1.0, what="a number in [0, 1] (the part of a score that is its span's)"))

    # --- where spans begin ----------------------------------------------------------------
    def continues(self, flags: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """Whether a token of ``flags`` goes on the span of the token ``before`` it (their
        ``TokenKinds`` flags, any shape)."""
        if self.unit == "number":
            return _has(flags, DIGITS) & _has(before, DIGITS) & ~_has(flags, BREAK_BEFORE)
        if self.unit == "word":
            return (~_has(flags, BREAK_BEFORE) & ~_has(before, BREAK_AFTER)
                    & (_has(flags, DIGITS) == _has(before, DIGITS)))
        return ~_has(before, ENDS_SENTENCE)

    def starts(self, ids: torch.Tensor, kinds: TokenKinds) -> torch.Tensor:
        """ids [B, S] by position (``UNKNOWN``: never seen) -> [B, S] int64: the position where
        each position's span begins. An unknown token is a span of its own and ends the one
        before it."""
        known = ids != UNKNOWN
        flags = kinds.lookup(ids).long()
        go_on = self.continues(flags[:, 1:], flags[:, :-1]) & known[:, 1:] & known[:, :-1]
        go_on = torch.cat([torch.zeros(ids.shape[0], min(1, ids.shape[1]), dtype=torch.bool, device=ids.device),
                           go_on], dim=1)
        index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return torch.where(go_on, torch.full_like(index, -1), index).cummax(dim=1).values

    def span_of(self, token_ids: TokenIds, kinds: TokenKinds, pos: torch.Tensor):
        """``(span, known)`` of the tokens at positions ``pos`` [B, ...]: ``span``, the position
        where each one's span begins (a position without an id: its own), ``known``, whether
        its id was noted."""
        shape, flat = pos.shape, pos.reshape(pos.shape[0], -1).long()
        ids = token_ids.ids.to(pos.device)
        S = ids.shape[1]
        inside = (flat >= 0) & (flat < S)
        at = flat.clamp(0, max(S - 1, 0))
        if S == 0:
            return flat.view(shape), torch.zeros_like(flat, dtype=torch.bool).view(shape)
        span = torch.where(inside, self.starts(ids, kinds).gather(1, at), flat)
        known = inside & (ids.gather(1, at) != UNKNOWN)
        return span.view(shape), known.view(shape)

    # --- the scores -----------------------------------------------------------------------
    def __call__(self, scores: torch.Tensor, span: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """scores [..., L]; span [..., L] int (broadcastable): tokens of one row (all leading
        indices equal) with the same value form one span; live [..., L] bool (broadcastable):
        the tokens that take part. Returns float32 scores of the same shape, each live token's
        replaced by its span's reduction over the span's live tokens."""
        x = scores.float()
        if x.numel() == 0:
            return x
        span, live = span.expand(x.shape).long(), live.expand(x.shape)
        rows = torch.arange(x.numel() // x.shape[-1], device=x.device).view(x.shape[:-1] + (1,))
        key = rows * 2**33 + (span + 2**32)            # one key per (row, span)
        _, group = torch.unique(key.reshape(-1), return_inverse=True)
        n = x.numel()
        if self.reduce == "max":
            best = x.new_full((n,), float("-inf")).scatter_reduce(
                0, group, x.masked_fill(~live, float("-inf")).reshape(-1), "amax")
            spread = best[group]
        else:
            total = x.new_zeros(n).scatter_add(0, group, x.masked_fill(~live, 0.0).reshape(-1))
            count = x.new_zeros(n).scatter_add(0, group, live.reshape(-1).float())
            spread = (total / count.clamp_min(1.0))[group]
        spread = spread.view(x.shape)
        if self.share < 1.0:
            spread = self.share * spread + (1.0 - self.share) * x
        return torch.where(live, spread, x)
