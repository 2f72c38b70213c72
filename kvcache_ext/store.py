"""RaggedKVStore: the KV cache of one attention layer as one ragged segment per (batch item, KV head).

The compiled store (kvcache_ext._C.RaggedKVStore) does the work; this class adds defaults,
the padded views used by policies and tests, and selection on the store's own layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext import _C
from kvcache_ext.select import grouped_topk, segmented_topk


@dataclass
class DenseView:
    """The store padded to [B, H, max_len, ...]; entries where `mask` is False are zero."""

    k: torch.Tensor       # [B, H, L, D]
    v: torch.Tensor       # [B, H, L, D]
    pos: torch.Tensor     # [B, H, L] int32
    scores: torch.Tensor  # [B, H, L, C] float32
    mask: torch.Tensor    # [B, H, L] bool, True on live slots
    lens: torch.Tensor    # [B, H] int64


class RaggedKVStore:
    """One layer's KV cache: segment s = b * heads + h holds the tokens kept for (b, h).

    K and V live in flat buffers ``[capacity, head_dim]`` (``store.k``, ``store.v``) in the
    model dtype; segment s owns slots ``[start[s], start[s] + cap[s])`` and its first
    ``len[s]`` are live. Per slot there is also ``pos`` (int32 absolute position) and
    ``score_channels`` float32 scores (``store.scores [capacity, C]``) that a policy owns.
    Tensors indexed by slot, like ``compact``'s keep mask, use this layout ("slot layout").
    """

    def __init__(self, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", score_channels: int = 1, growth: float = 1.5):
        device = torch.device(device)
        if device.type == "cuda" and not _C.build_info()["cuda"]:
            raise ValueError("kvcache_ext was built without CUDA kernels; reinstall it with a CUDA "
                             "build of torch and nvcc available (see README.md)")
        like = torch.empty(0, dtype=dtype, device=device)
        self._store = _C.RaggedKVStore(batch, heads, head_dim, score_channels, like, growth)

    # --- operations -----------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Appends n tokens to every segment: k, v [B, H, n, D]; pos [B, n] or [n] integers.

        With ``valid`` ([B, n] or [B, H, n] bool) only the valid tokens are stored, in order
        (left padding is never stored). Capacity grows geometrically when a segment is full.
        """
        self._store.append(k, v, torch.as_tensor(pos), valid)

    def replace(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                check_bounds: bool = True) -> None:
        """Overwrites slot[b, h] (0 <= slot < len) of every segment with the token k, v [B, H, 1, D]
        at position pos [B]; its scores restart at zero. ``check_bounds`` costs a host sync on CUDA."""
        self._store.replace(slot, k, v, torch.as_tensor(pos), check_bounds)

    def compact(self, keep: torch.Tensor) -> None:
        """Keeps, in order, the live slots whose flag in ``keep`` ([capacity] bool) is set."""
        self._store.compact(keep)

    def reserve(self, extra: int) -> None:
        """Makes room for ``extra`` more tokens in every segment (no regrowth until then)."""
        self._store.reserve(extra)

    def shrink_to_fit(self) -> None:
        """Releases every slot beyond the live ones (capacity = number of live tokens)."""
        self._store.shrink_to_fit()

    def select(self, k, scores: torch.Tensor | None = None, *, grouped: bool = False):
        """Keep mask ([capacity] bool) of the k best live slots by ``scores`` (default: channel 0).

        ``grouped=False``: k per segment (an int, or [B, H]). ``grouped=True``: Ada-KV's
        allocation, k per batch item (an int, or [B]) shared by its heads; returns
        ``(keep, counts [B, H])``. Ties go to the lower position, NaN is evicted first.
        """
        if scores is None:
            if self.score_channels == 0:
                raise ValueError("this store has no score channels: pass scores=")
            scores = self.scores[:, 0]
        scores = scores.contiguous()
        if not grouped:
            k = torch.as_tensor(k).expand(self.batch, self.heads).reshape(-1)
            return segmented_topk(scores, self.pos, self.start, self.len, k)
        k = torch.as_tensor(k).expand(self.batch).reshape(-1)
        keep, counts = grouped_topk(scores, self.pos, self.start, self.len, self.heads, k)
        return keep, counts.view(self.batch, self.heads)

    # --- layout helpers ---------------------------------------------------------------------
    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B, H, L], mask [B, H, L])``: the slot of each live token, L = max len."""
        lens = self.len.long()
        max_len = max(self._store.len_host, default=0)
        offsets = torch.arange(max_len, device=self.device)
        mask = offsets < lens[:, None]
        index = (self.start[:, None] + offsets).masked_fill(~mask, 0)
        shape = (self.batch, self.heads, max_len)
        return index.view(shape), mask.view(shape)

    def to_padded(self, slots: torch.Tensor, fill=0) -> torch.Tensor:
        """A [capacity, ...] slot-layout tensor as [B, H, L, ...] (``fill`` beyond each len)."""
        index, mask = self.slot_index()
        out = slots[index]
        return out.masked_fill(~mask.view(mask.shape + (1,) * (out.dim() - 3)), fill)

    def from_padded(self, padded: torch.Tensor, fill=0) -> torch.Tensor:
        """A [B, H, L, ...] tensor (L = max len) in slot layout [capacity, ...]."""
        index, mask = self.slot_index()
        out = padded.new_full((self.capacity,) + tuple(padded.shape[3:]), fill)
        out[index[mask]] = padded[mask]
        return out

    def to_dense(self) -> DenseView:
        """The live contents padded to the longest segment, for debugging and tests."""
        _, mask = self.slot_index()
        return DenseView(k=self.to_padded(self.k), v=self.to_padded(self.v),
                         pos=self.to_padded(self.pos), scores=self.to_padded(self.scores),
                         mask=mask, lens=self.lens.to(self.device))

    # --- state ------------------------------------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        return self._store.k

    @property
    def v(self) -> torch.Tensor:
        return self._store.v

    @property
    def pos(self) -> torch.Tensor:
        return self._store.pos

    @property
    def scores(self) -> torch.Tensor:
        return self._store.scores

    @property
    def start(self) -> torch.Tensor:
        """[S] int64 first slot of each segment, on the store's device."""
        return self._store.start

    @property
    def len(self) -> torch.Tensor:
        """[S] int32 live tokens of each segment, on the store's device."""
        return self._store.len

    @property
    def cap(self) -> torch.Tensor:
        """[S] int32 slots owned by each segment, on the store's device."""
        return self._store.cap

    @property
    def lens(self) -> torch.Tensor:
        """[B, H] int64 live tokens per segment, from the host copy (no device sync)."""
        return torch.tensor(self._store.len_host, dtype=torch.int64).view(self.batch, self.heads)

    @property
    def caps(self) -> torch.Tensor:
        """[B, H] int64 slots per segment, from the host copy (no device sync)."""
        return torch.tensor(self._store.cap_host, dtype=torch.int64).view(self.batch, self.heads)

    @property
    def capacity(self) -> int:
        """Slots in the flat buffers, live or not."""
        return self._store.capacity

    @property
    def num_tokens(self) -> int:
        """Live slots over all segments."""
        return self._store.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes held by the store's buffers (K, V, pos, scores and the segment tables)."""
        return self._store.nbytes

    @property
    def batch(self) -> int:
        return self._store.batch

    @property
    def heads(self) -> int:
        return self._store.heads

    @property
    def head_dim(self) -> int:
        return self._store.head_dim

    @property
    def score_channels(self) -> int:
        return self._store.score_channels

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def __repr__(self) -> str:
        return (f"RaggedKVStore(batch={self.batch}, heads={self.heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, tokens={self.num_tokens}, "
                f"capacity={self.capacity}, nbytes={self.nbytes})")
