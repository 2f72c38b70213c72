"""Storage of one layer's cache for the eviction engine: the ragged store (``RaggedLayerKV``).

It implements ``kvcache_ext.engine.storage.LayerStorage``, the interface the engine
(``kvcache_ext.engine.eviction``) uses; the reference path
(``kvcache_ext.reference.masked_cache.MaskedLayerKV``) implements the same interface with a
dense, masked cache, so both run the same policy code.
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.storage import DecodeStep, EvictByRule
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
                 device: torch.device, channels: int, page_size: int = 16, kv_dtype: torch.dtype | None = None):
        self._hold(RaggedKVStore(batch, heads, head_dim, dtype=dtype, device=device, score_channels=channels,
                                 page_size=page_size, kv_dtype=kv_dtype))

    def _hold(self, store: RaggedKVStore, in_position_order: bool = True) -> None:
        self.store = store
        # The per-head budgets of an eviction by a slot rule, made from the row budgets they came from.
        self._budget_source, self._per_head_budget = None, None
        # The store's call of the engine's decode step, prepared for the DecodeStep it was made for.
        self._step, self._call = None, None
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

    def set_channels(self, padded: torch.Tensor) -> None:
        """Channels of the cached tokens from a padded [B, H, L, C] tensor (as ``view`` gives)."""
        self.store.set_scores(self._to_slots(padded.float()))

    def accumulate(self, stats: dict, names: tuple[str, ...]) -> None:
        """Adds the statistics ``names`` (slot layout, of ``attend``) to channels 0, 1, ... in place."""
        for channel, name in enumerate(names):
            self.store.add_to_scores(channel, stats[name].float())

    # --- a decode step ---------------------------------------------------------------------
    def decode_step(self, k, v, pos, q, scale, step: DecodeStep, valid=None, plan=None):
        """One decode step (``LayerStorage.decode_step``) in one op (``RaggedKVStore.decode_step``):
        the append, the attention with the statistics the step reads, the channel updates and
        the eviction by a slot rule. Eager (``plan`` None): with the page allocator's host steps
        around it (pages for the new token, the plan, the lengths after an eviction), in one
        host call. Captured (a plan): into pages the segments already hold and with that plan,
        no host step; the graph's owner checks the room before every run and notes the host side
        after it (``note_graph_step``). The store's call is prepared once per ``step`` (the
        engine hands the same one at every step of a kind)."""
        if step is not self._step:
            self._step, self._call = step, self._decode_call(step)
        if step.evict is not None:
            self._in_position_order = False   # its compaction is unordered
        k, v = k.contiguous(), v.contiguous()   # (HF's k and v are views of a projection's output)
        if valid is None:
            return self._call(q, k, v, pos, scale, None, None, plan)
        B, H = k.shape[:2]
        return self._call(q, k, v, pos, scale, valid[:, None, None].expand(B, H, 1),
                          pos.masked_fill(~valid[:, None], -1), plan)

    def _decode_call(self, step: DecodeStep):
        """The store's call for ``step``'s work (``RaggedKVStore.decode_call``)."""
        evict = step.evict
        if evict is None:
            return self.store.decode_call(stats=step.stats, accumulate=step.accumulate)
        per_head, per_head_host = self._per_head(evict.budget, evict.budget_host)
        return self.store.decode_call(stats=step.stats, accumulate=step.accumulate, rule=evict.rule,
                                      sinks=evict.sinks, recent=evict.recent, last_pos=step.last_pos,
                                      budget=(per_head.view(-1), per_head_host.view(-1)))

    def evict_by_rule(self, evict: EvictByRule, last_pos: torch.Tensor) -> None:
        """Every head of row b keeps its ``evict.budget[b]`` best tokens by the rule, the
        protected first, in the store's slot layout: no padded view, and the new lengths,
        min(len, budget), known on the host (no sync)."""
        self._evict_by_rule(evict, last_pos, captured=False)

    def _evict_by_rule(self, evict: EvictByRule, last_pos, captured: bool) -> None:
        """``evict_by_rule``; ``captured``: inside a CUDA graph's step, every head selects and
        compacts whatever its length (a top-k of k keeps a head within its budget whole, so the
        step is the same at every length) and keeps its pages; eagerly only when a head is over
        its budget, the pages it empties given back. The compaction is unordered: a slot score
        does not depend on the order, and one token moves per place evicted."""
        store = self.store
        per_head, per_head_host = self._per_head(evict.budget, evict.budget_host)
        kept = None
        if not captured:
            lens = store.lens   # the host lengths: no sync
            kept = torch.minimum(lens, per_head_host)
            if torch.equal(kept, lens):   # every head within its budget: nothing to evict
                return
        store.evict_by_rule(per_head.view(-1), rule=evict.rule, sinks=evict.sinks, recent=evict.recent,
                            last_pos=last_pos if evict.recent else None, kept=kept)
        self._in_position_order = False

    def _per_head(self, k, k_host):
        """Row budgets (k [B] on the device, k_host on the host) as the store's eviction takes
        them: [B, H] per head, int32 on the device, int64 on the host. Made once per budget
        tensor (the engine's layer keeps one for every decode step), so that an eviction step
        converts nothing."""
        if self._budget_source is not k:
            heads = self.store.heads
            self._per_head_budget = (k.clamp(0, 2**31 - 1).to(torch.int32)[:, None].expand(-1, heads).contiguous(),
                                     k_host.long()[:, None].expand(-1, heads).contiguous())
            self._budget_source = k
        return self._per_head_budget

    # --- decode steps in a CUDA graph (kvcache_ext.hf.decode_graph) ------------------------
    graph_ready = True

    def graph_key(self) -> tuple:
        """The store and its state's version: the tensors a captured step's ops read."""
        return (self.store, self.store.state_version)

    def has_room(self, n: int) -> bool:
        return self.store.has_room(n)

    def reserve(self, extra: int) -> None:
        self.store.reserve(extra)

    def graph_plan(self, rows: int) -> torch.Tensor:
        return self.store.attention_plan_of_pages(rows)

    def hold_for_graph(self):
        return self.store.page_addresses()

    def note_graph_step(self, n: int, evict: EvictByRule | None) -> None:
        """After a captured step's run: ``n`` tokens appended, then (``evict``) every head at
        min(len, budget), every page kept."""
        self.store.note_appended(n)
        if evict is not None:
            self.store.note_kept_in_pages(self._per_head(evict.budget, evict.budget_host)[1].view(-1))

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

    def shrink_to_fit(self) -> None:
        self.store.shrink_to_fit()

    # --- accounting ------------------------------------------------------------------------
    @property
    def lens(self) -> torch.Tensor:
        return self.store.lens

    @property
    def num_pages(self) -> int:
        return self.store.num_pages

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
