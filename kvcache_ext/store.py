"""RaggedKVStore: the KV cache of one attention layer as one ragged segment per (batch item, KV head).

The compiled store (kvcache_ext._C.RaggedKVStore) does the work; this class adds defaults,
the padded views used by policies and tests, and selection on the store's own layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext import _C, checks
from kvcache_ext.select import budget_tensor, grouped_topk, segmented_topk


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

    Tokens live in pages of ``page_size`` tokens (K, V, the int32 absolute position and
    ``score_channels`` float32 scores that a policy owns, per token). A segment owns a list
    of pages (``page_table``), takes a free page or a newly allocated one when it fills up,
    and gives pages back when compaction empties them: the pages a segment has never move,
    and memory held is the kept tokens rounded up to whole pages. A token's *slot* is
    ``page * page_size + row``; tensors indexed by slot (``[capacity, ...]``, like
    ``compact``'s keep mask and the attention statistics) use the "slot layout".
    """

    def __init__(self, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", score_channels: int = 1, page_size: int = 16):
        batch, heads, head_dim, score_channels, page_size, dtype, device = checks.store_arguments(
            batch, heads, head_dim, score_channels, page_size, dtype, device)
        if device.type == "cuda" and not _C.build_info()["cuda"]:
            raise ValueError("kvcache_ext was built without CUDA kernels; reinstall it with a CUDA "
                             "build of torch and nvcc available (see README.md)")
        like = torch.empty(0, dtype=dtype, device=device)
        self._store = _C.RaggedKVStore(batch, heads, head_dim, score_channels, like, page_size)

    # --- operations -----------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Appends n tokens to every segment: k, v [B, H, n, D]; pos [B, n] or [n] integers.

        With ``valid`` ([B, n] or [B, H, n] bool) only the valid tokens are stored, in order
        (left padding is never stored). A full segment takes a free page, or one allocated
        with the other segments' missing pages in one slab; no stored token moves.
        """
        self._store.append(checks.tensor(k, "k"), checks.tensor(v, "v"), checks.as_tensor(pos, "pos"),
                           None if valid is None else checks.tensor(valid, "valid"))

    def replace(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                check_bounds: bool = True) -> None:
        """Overwrites slot[b, h] (0 <= slot < len) of every segment with the token k, v [B, H, 1, D]
        at position pos [B]; its scores restart at zero. A slot given on the host (always, on a CPU
        store) is bounds-checked for free; ``check_bounds`` checks one on a CUDA device (a host sync)."""
        self._store.replace(checks.as_tensor(slot, "slot"), checks.tensor(k, "k"), checks.tensor(v, "v"),
                            checks.as_tensor(pos, "pos"), checks.boolean(check_bounds, "check_bounds"))

    def compact(self, keep: torch.Tensor) -> None:
        """Keeps, in order, the live slots whose flag in ``keep`` ([capacity] bool) is set."""
        self._store.compact(checks.tensor(keep, "keep"))

    def reserve(self, extra: int) -> None:
        """Gives every segment pages for ``extra`` more tokens (new pages only where missing)."""
        self._store.reserve(checks.integer(extra, "reserve extra", 0))

    def repack(self, extra: int = 0) -> None:
        """Moves the live tokens into one new allocation with pages for ``extra`` more tokens
        per segment, and releases every other page (the only operation that moves them all)."""
        self._store.repack(checks.integer(extra, "repack extra", 0))

    def shrink_to_fit(self) -> None:
        """Releases every page that holds no live token (``repack(0)``)."""
        self._store.shrink_to_fit()

    def set_scores(self, scores: torch.Tensor) -> None:
        """Writes the score channels of every slot from a [capacity, C] float32 tensor."""
        self._store.set_scores(checks.tensor(scores, "scores"))

    def select(self, k, scores: torch.Tensor | None = None, *, grouped: bool = False):
        """Keep mask ([capacity] bool) of the k best live slots by ``scores`` (default: channel 0).

        ``scores``: [capacity] in slot layout, or [B, H, max_len] padded as ``to_dense`` gives
        (what the eviction engine has). ``grouped=False``: k per segment (an int, or [B, H]).
        ``grouped=True``: Ada-KV's allocation, k per batch item (an int, or [B]) shared by its
        heads; returns ``(keep, counts [B, H])``. Ties go to the lower position, NaN is evicted
        first.
        """
        if scores is not None and not isinstance(scores, torch.Tensor):
            raise TypeError(f"scores must be None or a float tensor, got {type(scores).__name__}")
        per = (self.batch,) if grouped else (self.batch, self.heads)
        if self.device.type == "cpu":
            # The store selects through its own pages: no packing, no copy of the scores.
            if scores is not None:
                scores = scores.float().contiguous()  # no copy when it is already so
            keep, counts = self._store.select(scores, budget_tensor(k, per, self.device), grouped)
            return (keep, counts.view(self.batch, self.heads)) if grouped else keep
        # CUDA: the top-k kernels (CUB radix sort) take contiguous segments, so the live tokens
        # are packed in segment order, selected, and the keep flags put back in slot layout.
        if scores is None:
            if self.score_channels == 0:
                raise ValueError("this store has no score channels: pass scores=")
            scores = self.scores[:, 0]
        index, mask = self.slot_index()
        live = mask.view(-1).nonzero().squeeze(1)      # padded positions of the live tokens
        slots = index.view(-1)[live]
        packed = scores.reshape(-1)[live] if scores.dim() == 3 else scores[slots]
        lens = mask.sum(-1).view(-1)
        start, lens = torch.cumsum(lens, 0) - lens, lens.to(torch.int32)
        pos = self.pos[slots]
        keep = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        k = budget_tensor(k, per, self.device)
        if not grouped:
            keep[slots] = segmented_topk(packed.float().contiguous(), pos, start, lens, k)
            return keep
        kept, counts = grouped_topk(packed.float().contiguous(), pos, start, lens, self.heads, k)
        keep[slots] = kept
        return keep, counts.view(self.batch, self.heads)

    # --- layout helpers ---------------------------------------------------------------------
    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B, H, L], mask [B, H, L])``: the slot of each live token, L = max len."""
        lens = self.len.long()
        max_len = max(self._store.len_host, default=0)
        offsets = torch.arange(max_len, device=self.device)
        mask = offsets < lens[:, None]
        size = self.page_size
        table = self._store.page_table.long()               # [S, width], -1: no page
        page = table.gather(1, (offsets // size).expand(table.shape[0], -1)) if max_len else \
            table[:, :0]
        index = (page * size + offsets % size).masked_fill(~mask, 0)
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
    # k, v, pos and scores are copies in slot layout: writing to them does not change the store.
    @property
    def k(self) -> torch.Tensor:
        """[capacity, D] K of every slot (a copy; slots without a live token are undefined)."""
        return self._store.k

    @property
    def v(self) -> torch.Tensor:
        """[capacity, D] V of every slot (a copy)."""
        return self._store.v

    @property
    def pos(self) -> torch.Tensor:
        """[capacity] int32 position of every slot (a copy)."""
        return self._store.pos

    @property
    def scores(self) -> torch.Tensor:
        """[capacity, C] float32 score channels of every slot (a copy; see ``set_scores``)."""
        return self._store.scores

    @property
    def len(self) -> torch.Tensor:
        """[S] int32 live tokens of each segment, on the store's device (a copy)."""
        return self._store.len

    @property
    def page_table(self) -> torch.Tensor:
        """[S, width] int32 pages of each segment in token order, -1 past its last (a copy)."""
        return self._store.page_table

    @property
    def page_size(self) -> int:
        """Tokens per page: the unit by which a segment grows."""
        return self._store.page_size

    @property
    def num_pages(self) -> int:
        """Pages held, owned by a segment or free."""
        return self._store.num_pages

    @property
    def free_pages(self) -> int:
        """Pages held that no segment owns (reused before any new allocation)."""
        return self._store.free_pages

    @property
    def slab_allocations(self) -> int:
        """Allocations of pages since the store was made (one per growth, whatever its size)."""
        return self._store.slab_allocations

    @property
    def repacks(self) -> int:
        """How many times every live token was moved (``repack``/``shrink_to_fit`` only)."""
        return self._store.repacks

    @property
    def lens(self) -> torch.Tensor:
        """[B, H] int64 live tokens per segment, from the host copy (no device sync)."""
        return torch.tensor(self._store.len_host, dtype=torch.int64).view(self.batch, self.heads)

    @property
    def caps(self) -> torch.Tensor:
        """[B, H] int64 tokens each segment's pages hold, from the host copy (no device sync)."""
        pages = torch.tensor(self._store.pages_host, dtype=torch.int64)
        return (pages * self.page_size).view(self.batch, self.heads)

    @property
    def capacity(self) -> int:
        """Slots of the slot layout: every page held, times ``page_size``."""
        return self._store.capacity

    @property
    def num_tokens(self) -> int:
        """Live slots over all segments."""
        return self._store.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes held by the store: its pages (K, V, pos, scores) and its page tables."""
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
        return self._store.like.dtype

    @property
    def device(self) -> torch.device:
        return self._store.like.device

    def __repr__(self) -> str:
        return (f"RaggedKVStore(batch={self.batch}, heads={self.heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, tokens={self.num_tokens}, "
                f"pages={self.num_pages} of {self.page_size}, nbytes={self.nbytes})")
