"""TokenIds: the token ids of a cache's rows, by position, for the whole life of the rows.

A scorer that reads which token sits at a position (``Spans``, to find the word or number a
cached token belongs to) needs the ids of every position the row has seen, evicted or not:
the span of a kept token reaches back over tokens that may be gone. The patched model notes
each call's ids here as it is called (``RaggedCache.note_token_ids``, from the forward
pre-hook that ``patch`` registers when its policy needs them), at the positions the engine
gives the same tokens; the evaluation's shared prefill notes the recorded prompt's. The cache
owns one (``engine.state.SharedByLayers``, shared by its layers) and empties it with the rest.
"""
from __future__ import annotations

import torch

UNKNOWN = -1   # the id of a position never noted (padding, or a call that gave no ids)


class TokenIds:
    """``ids`` [B, S] int64: the token id at position p of row b, ``UNKNOWN`` where none was
    noted; S grows with the positions noted."""

    __slots__ = ("_ids",)

    def __init__(self, ids: torch.Tensor | None = None):
        self._ids = ids   # [B, S + 1]: the last column takes padding's writes; None before any id

    def clear(self) -> None:
        self._ids = None

    def copy(self) -> "TokenIds":
        return TokenIds(None if self._ids is None else self._ids.clone())

    @property
    def ids(self) -> torch.Tensor | None:
        """[B, S] the ids by position (None before any was noted)."""
        return None if self._ids is None else self._ids[:, :-1]

    def note(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, last: int) -> None:
        """Notes ``ids`` [B, n] at positions ``pos`` [B, n] where ``valid`` [B, n]; ``last``: an
        upper bound on the positions (known on the host). A position noted again takes the new id."""
        B = ids.shape[0]
        if self._ids is None:
            self._ids = torch.full((B, 1), UNKNOWN, dtype=torch.long, device=ids.device)
        elif self._ids.shape[0] != B:
            raise ValueError(f"token ids: this cache's rows hold a batch of {self._ids.shape[0]}; the "
                             f"input has a batch of {B} (a cache serves one batch; use a fresh one)")
        S = self._ids.shape[1] - 1
        if last >= S:
            grown = torch.full((B, max(last + 1, 2 * S) + 1), UNKNOWN, dtype=torch.long, device=self._ids.device)
            grown[:, :S] = self._ids[:, :S]
            self._ids = grown
        scratch = self._ids.shape[1] - 1
        ids, pos, valid = (t.to(self._ids.device) for t in (ids, pos, valid))
        valid = valid & (pos >= 0) & (pos < scratch)
        where = torch.where(valid, pos.long(), torch.full_like(pos, scratch, dtype=torch.long))
        self._ids.scatter_(1, where, ids.long())
        self._ids[:, scratch] = UNKNOWN
