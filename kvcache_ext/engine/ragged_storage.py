"""Storage of one layer's cache for the eviction engine: the ragged store (``RaggedLayerKV``).

It implements ``kvcache_ext.engine.storage.LayerStorage``, the interface the engine
(``kvcache_ext.engine.eviction``) uses; the reference path
(``kvcache_ext.reference.masked_cache.MaskedLayerKV``) implements the same interface with a
dense, masked cache, so both run the same policy code.
"""
from __future__ import annotations

import torch

from kvcache_ext.kernels.attention import ragged_attention
from kvcache_ext.kernels.select import grouped_topk, segmented_topk
from kvcache_ext.kernels.store import RaggedKVStore


def pack_valid(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """valid [..., n] bool -> (order [..., n]: the valid indices first, in order; counts [...])."""
    order = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)
    return order, valid.sum(dim=-1)


class RaggedLayerKV:
    """One layer's tokens in a ``RaggedKVStore``: only the kept tokens are stored."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, channels: int, page_size: int = 16):
        self._hold(RaggedKVStore(batch, heads, head_dim, dtype=dtype, device=device, score_channels=channels,
                                 page_size=page_size))

    def _hold(self, store: RaggedKVStore, in_position_order: bool = True) -> None:
        self.store = store
        # The compiled decode step's per-head budgets, made from the row budgets they came from.
        self._budget_source, self._per_head_budget = None, None
        # Whether each segment's tokens lie in the store in position order: false once an
        # eviction compacted without keeping the order (``compact(stable=False)``: per-step
        # eviction by a slot rule, whose scores do not depend on it). The padded views the
        # policies read are in position order either way (``padded_index``).
        self._in_position_order = in_position_order

    def fork(self) -> "RaggedLayerKV":
        """The same tokens on the same pages, later tokens in pages of its own (``RaggedKVStore.fork``)."""
        other = object.__new__(type(self))
        other._hold(self.store.fork(), self._in_position_order)
        return other

    def padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B, H, L], mask [B, H, L])``: the slot of each head's token l in position
        order (``RaggedKVStore.slot_index`` sorted by position when the store's order is not)."""
        index, mask = self.store.slot_index()
        if not self._in_position_order and index.shape[-1]:
            pos = self.store.pos[index].masked_fill(~mask, torch.iinfo(torch.int32).max)
            index = index.gather(-1, pos.argsort(dim=-1, stable=True))   # the live tokens stay first
        return index, mask

    def _to_slots(self, padded: torch.Tensor, fill=0) -> torch.Tensor:
        """A [B, H, L, ...] tensor in the order of ``padded_index`` as [capacity, ...]."""
        return self.store.from_padded(padded, fill, index=None if self._in_position_order else self.padded_index())

    # --- storage -------------------------------------------------------------------------
    def append(self, k, v, pos, keep) -> None:
        """k, v [B, H, n, D]; pos [B, n]; keep [B, H, n] bool: the tokens to store (None: all,
        with no device sync)."""
        self.store.append(k.contiguous(), v.contiguous(), pos, valid=keep)   # the store takes any integer pos

    def set_prompt_channels(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """values [B, H, n, C] of a fresh prompt's tokens, keep [B, H, n]: the first append."""
        order, counts = pack_valid(keep)
        width = int(counts.max().item()) if counts.numel() else 0
        packed = values.gather(2, order[..., :width, None].expand(-1, -1, -1, values.shape[-1]))
        self.store.set_scores(self.store.from_padded(packed.float()))

    @property
    def channels(self) -> torch.Tensor:
        """The channels of every slot, [capacity, C] (a copy: see ``write_channels``)."""
        return self.store.scores

    def write_channels(self, channels: torch.Tensor) -> None:
        self.store.set_scores(channels)

    def set_channels(self, padded: torch.Tensor) -> None:
        """Channels of the cached tokens from a padded [B, H, L, C] tensor (as ``view`` gives)."""
        self.store.set_scores(self._to_slots(padded.float()))

    def append_and_attend(self, k, v, pos, q, scale):
        """``append(k, v, pos, None)`` then ``attend(q, scale, None, ())``'s output: in one host
        call in eager mode, through the two ops under ``torch.compile``."""
        if torch.compiler.is_compiling():
            self.append(k, v, pos, None)
            return self.attend(q, scale, None, ())[0]
        return self.store.append_and_attend(q, k.contiguous(), v.contiguous(), pos, scale)

    def append_attend_in_pages(self, k, v, pos, q, scale, plan):
        """A decode step as a CUDA graph captures it (``kvcache_ext.hf.decode_graph``): the
        append and the attention through their ops alone, into pages already held and with the
        ``plan`` of those pages, so that the step runs no host work; the graph's owner checks
        the room and advances the host lengths around every run."""
        self.store.append_in_pages(k.contiguous(), v.contiguous(), pos)
        return ragged_attention(q, self.store, scale, plan=plan)[0]

    def append_attend_evict_in_pages(self, k, v, pos, q, scale, plan, rule, protection, last_pos, budget):
        """``append_attend_evict`` as a CUDA graph captures it: through the ops alone (append
        into pages already held; attention with the ``plan`` of those pages and, for the rule
        "mass", the mass added to channel 0; with ``budget`` = (k [B] on the device, k_host),
        the top-k of k per head by the rule and the compaction, every segment's, whoever is
        over). A top-k keeps everything of a head within its budget, so the step is the same
        whatever the lengths: one graph serves every step. The graph's owner checks the room
        before every run and notes the host lengths after (the store's ``note_appended``,
        then, after an eviction, ``note_kept_in_pages(budget)``)."""
        store = self.store
        store.append_in_pages(k.contiguous(), v.contiguous(), pos)
        by_mass = rule == "mass"
        out, stats = ragged_attention(q, store, scale, plan=plan, stats=("mass",) if by_mass else False)
        if by_mass:
            store.add_to_scores(0, stats.mass)
        if budget is not None:
            per_head = self._per_head(*budget)[0].view(-1)
            store.evict_in_pages(per_head, rule=rule, sinks=protection.sinks, recent=protection.recent,
                                 last_pos=last_pos if protection.recent else None)
            self._in_position_order = False
        return out

    def note_kept_in_pages(self, budget) -> None:
        """The host lengths after ``append_attend_evict_in_pages`` evicted to ``budget`` (k, k_host)."""
        self.store.note_kept_in_pages(self._per_head(*budget)[1].view(-1))

    def append_attend_evict(self, k, v, pos, q, scale, rule, protection, last_pos, budget):
        """One C++ call (``RaggedKVStore.append_attend_evict``) in eager mode; None under
        ``torch.compile``, which traces the general path's ops."""
        if torch.compiler.is_compiling():
            return None
        if budget is not None:   # its compaction, if any, is unordered
            self._in_position_order = False
        return self.store.append_attend_evict(q, k.contiguous(), v.contiguous(), pos, scale, rule=rule,
                                              sinks=protection.sinks, recent=protection.recent,
                                              last_pos=last_pos,
                                              budget=None if budget is None else self._per_head(*budget))

    def _per_head(self, k, k_host):
        """Row budgets (k [B] on the device, k_host on the host) as the compiled step takes them:
        [B, H] per head, int32 on the device. Made once per budget tensor (the engine's layer
        keeps one for every decode step), so that an eviction step converts nothing."""
        if self._budget_source is not k:
            heads = self.store.heads
            self._per_head_budget = (k.clamp(0, 2**31 - 1).to(torch.int32)[:, None].expand(-1, heads).contiguous(),
                                     k_host.long()[:, None].expand(-1, heads).contiguous())
            self._budget_source = k
        return self._per_head_budget

    def attend(self, q, scale, q_pos, stats):
        out, st = ragged_attention(q, self.store, scale, q_pos=q_pos, stats=tuple(stats) or False)
        if st is None:
            return out, None
        return out, {name: getattr(st, name) for name in stats}

    # --- views and selection -------------------------------------------------------------
    def view(self, stats: dict | None, need_kv: bool) -> dict:
        index, mask = self.padded_index()
        parts = dict(pos=self.store.pos[index].long().masked_fill(~mask, 0), mask=mask,
                     channels=self.store.scores[index].masked_fill(~mask[..., None], 0))
        padded = {}
        for name, value in (stats or {}).items():
            padded[name] = value[index].masked_fill(~mask.view(mask.shape + (1,) * (value.dim() - 1)), 0)
        parts["stats"] = padded
        if need_kv:
            parts["k"], parts["v"] = self.store.k[index], self.store.v[index]
        return parts

    def evict(self, scores: torch.Tensor, k: torch.Tensor) -> None:
        """scores [B, H, L] of the cached tokens (padded view), k [B, H]: keep k per head."""
        self.store.compact(self.store.select(k.to(self.store.device), self._scores_for_select(scores)))

    def _scores_for_select(self, scores: torch.Tensor) -> torch.Tensor:
        """Padded view scores as the store's select takes them: padded by token order (the
        view's, while the store is in position order), else in slot layout."""
        return scores if self._in_position_order else self._to_slots(scores.float())

    def evict_in_slots(self, scorer, protection, stats: dict, last_pos, k, k_host) -> bool:
        """Keeps the k [B] (on the device; ``k_host`` its host copy) best tokens of each head of
        row b by ``scorer.slot_scores``, protected tokens first, all in the store's slot layout:
        no padded view, and the new lengths, min(len, k), known on the host (no sync)."""
        store = self.store
        pos = store.pos
        scores = scorer.slot_scores(store.scores, stats, pos).float()
        if protection.size:
            scores = scores.masked_fill(protection.mask(pos, last_pos[store.slot_rows()]), float("inf"))
        per_head = k[:, None].expand(store.batch, store.heads)
        kept = torch.minimum(store.lens, k_host.long()[:, None])
        # Unordered: one token moves per evicted one (a slot score does not depend on the order).
        store.compact(store.select(per_head, scores), lens=kept, stable=False)
        self._in_position_order = False
        return True

    def grouped_counts(self, scores, mask, k):
        _, counts = self.store.select(k.to(self.store.device), self._scores_for_select(scores), grouped=True)
        return counts.long()

    @staticmethod
    def prompt_keep(scores, pos, valid, k):
        """Top-k of a dense prompt: scores [B, H, n], pos [B, n], valid [B, n], k [B, H]
        -> keep [B, H, n] (the compiled segmented top-k on the packed prompt)."""
        flat, pos32, start, lens = _packed_prompt(scores, pos, valid)
        keep = segmented_topk(flat, pos32, start, lens, k.reshape(-1).to(torch.int64))
        return _unpack(keep, scores, valid)

    @staticmethod
    def prompt_grouped_counts(scores, pos, valid, k):
        flat, pos32, start, lens = _packed_prompt(scores, pos, valid)
        _, counts = grouped_topk(flat, pos32, start, lens, scores.shape[1], k.to(torch.int64))
        return counts.view(scores.shape[:2]).long()

    def drop_before(self, first: torch.Tensor) -> None:
        """first [B]: keeps the tokens at positions >= first[b] of every head of row b. An
        unordered compaction (a decode step drops a head's oldest token, at the front: the
        newest takes its place instead of every token moving up); emptied pages are freed
        (reused by the next appends), so a sliding-window layer holds its window in whole pages."""
        store = self.store
        if store.shares_pages:   # a fork of a shared prefix: the window leaves the prefix, whose
            store.repack(1)      # pages are read-only; its window moves to pages of its own once
        keep = store.pos >= first.to(store.device)[store.slot_rows()]
        store.compact(keep, stable=False)
        self._in_position_order = False

    def trim(self, extra: int) -> None:
        """Holds pages for ``extra`` more tokens per segment and no more: a repack (every
        token moves once) when pages would be released, else new pages where missing. A store
        that shares pages (``RaggedKVStore.fork``) is never repacked (that would copy what it
        shares): it only adds pages."""
        size = self.store.page_size
        needed = (self.store.lens + extra + size - 1) // size
        if not self.store.shares_pages and (self.store.free_pages or bool((self.store.caps // size > needed).any())):
            self.store.repack(extra)
        else:
            self.store.reserve(extra)

    # --- accounting ------------------------------------------------------------------------
    @property
    def lens(self) -> torch.Tensor:
        return self.store.lens

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


def _packed_prompt(scores, pos, valid):
    """A dense prompt as segments of the flat layout: every (b, h) row with its valid tokens
    first, so segment s = b * H + h starts at s * n and holds the row's valid count."""
    B, H, n = scores.shape
    order, counts = pack_valid(valid)                                  # [B, n], [B]
    flat = scores.float().gather(2, order[:, None, :].expand(B, H, n)).reshape(-1).contiguous()
    pos32 = pos.gather(1, order).to(torch.int32)[:, None, :].expand(B, H, n).reshape(-1).contiguous()
    start = torch.arange(B * H, device=scores.device, dtype=torch.int64) * n
    lens = counts.to(torch.int32)[:, None].expand(B, H).reshape(-1).contiguous()
    return flat, pos32, start, lens


def _unpack(keep_flat, scores, valid):
    B, H, n = scores.shape
    order, _ = pack_valid(valid)
    keep = torch.zeros(B, H, n, dtype=torch.bool, device=scores.device)
    return keep.scatter_(2, order[:, None, :].expand(B, H, n), keep_flat.view(B, H, n))
