"""Reference KV store: padded tensors [B, H, L, ...] plus a length per segment."""
from __future__ import annotations

import torch

from kvcache_ext.reference.quantize import round_trip


class ReferenceStore:
    """What RaggedKVStore must hold, kept as padded tensors; padding entries are zero. With
    ``kv_dtype=torch.int8`` it holds K and V as int8 pages give them back (``round_trip``)."""

    def __init__(self, batch: int, heads: int, head_dim: int, *, dtype=torch.float16,
                 score_channels: int = 1, kv_dtype=None):
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.stored = round_trip if kv_dtype == torch.int8 else (lambda x: x)
        self.k = torch.zeros(batch, heads, 0, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, heads, 0, head_dim, dtype=dtype)
        self.pos = torch.zeros(batch, heads, 0, dtype=torch.int32)
        self.scores = torch.zeros(batch, heads, 0, score_channels, dtype=torch.float32)
        self.lens = torch.zeros(batch, heads, dtype=torch.int64)

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.k.shape[2]) < self.lens[..., None]

    def _rebuild(self, rows: dict) -> None:
        """Sets the contents from rows[(b, h)] = (k, v, pos, scores) per segment, re-padded."""
        longest = max((r[0].shape[0] for r in rows.values()), default=0)

        def pad(i, t):
            out = t.new_zeros((self.batch, self.heads, longest) + tuple(t.shape[3:]))
            for (b, h), r in rows.items():
                out[b, h, : r[i].shape[0]] = r[i]
            return out

        self.k, self.v, self.pos, self.scores = (pad(i, t) for i, t in
                                                 enumerate((self.k, self.v, self.pos, self.scores)))
        for (b, h), r in rows.items():
            self.lens[b, h] = r[0].shape[0]

    def _rows(self) -> dict:
        return {(b, h): tuple(t[b, h, : self.lens[b, h]] for t in (self.k, self.v, self.pos, self.scores))
                for b in range(self.batch) for h in range(self.heads)}

    def append(self, k, v, pos, valid=None) -> None:
        k, v = self.stored(k), self.stored(v)
        n = k.shape[2]
        pos = torch.as_tensor(pos).to(torch.int32).expand(self.batch, n)
        if valid is None:
            valid = torch.ones(self.batch, n, dtype=torch.bool)
        valid = valid if valid.dim() == 3 else valid[:, None, :].expand(self.batch, self.heads, n)
        rows = self._rows()
        for (b, h), (rk, rv, rp, rs) in rows.items():
            sel = valid[b, h]
            new_scores = rs.new_zeros((int(sel.sum()), rs.shape[1]))
            rows[b, h] = (torch.cat([rk, k[b, h][sel]]), torch.cat([rv, v[b, h][sel]]),
                          torch.cat([rp, pos[b][sel]]), torch.cat([rs, new_scores]))
        self._rebuild(rows)

    def replace(self, slot, k, v, pos) -> None:
        k, v = self.stored(k), self.stored(v)
        pos = torch.as_tensor(pos).reshape(self.batch).to(torch.int32)
        for b in range(self.batch):
            for h in range(self.heads):
                j = int(slot[b, h])
                assert 0 <= j < self.lens[b, h]
                self.k[b, h, j], self.v[b, h, j] = k[b, h, 0], v[b, h, 0]
                self.pos[b, h, j] = pos[b]
                self.scores[b, h, j] = 0

    def compact(self, keep_padded: torch.Tensor) -> None:
        """keep_padded [B, H, L] bool; entries beyond each length are ignored."""
        rows = self._rows()
        for (b, h), r in rows.items():
            sel = keep_padded[b, h, : r[0].shape[0]]
            rows[b, h] = tuple(t[sel] for t in r)
        self._rebuild(rows)

    def compact_unordered(self, keep_padded: torch.Tensor) -> None:
        """``compact`` as ``RaggedKVStore.compact(stable=False)`` does it: a segment keeping
        ``kept`` tokens keeps those among its first ``kept`` in place, and the r-th kept token
        past them fills the r-th evicted place among them."""
        rows = self._rows()
        for (b, h), r in rows.items():
            sel = keep_padded[b, h, : r[0].shape[0]].tolist()
            kept = sum(sel)
            order = list(range(kept))
            holes = [i for i in range(kept) if not sel[i]]
            movers = [i for i in range(kept, len(sel)) if sel[i]]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
            rows[b, h] = tuple(t[order] for t in r)
        self._rebuild(rows)
