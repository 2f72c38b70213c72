"""The reference path of a patched model: a dense, full-size cache where eviction only masks
(``MaskedLayerKV``; ``kvcache_ext.hf.cache.MaskedCache`` is the cache of them).

The engine's ``LayerStorage`` (``kvcache_ext.engine.storage``) written in plain PyTorch and
independent of the compiled kernels: attention is ``reference.ragged_attention`` (float64),
selection is ``reference.segmented_topk`` / ``grouped_topk`` (a full sort). Evicted tokens
stay in memory, masked per head, which is how masking-based tools implement head-wise
eviction; the tests compare the ragged path's logits with this one's.
"""
from __future__ import annotations

import torch

from kvcache_ext.reference.attention import ragged_attention
from kvcache_ext.reference.quantize import as_attended
from kvcache_ext.reference.select import grouped_topk, segmented_topk


class MaskedLayerKV:
    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, channels: int, kv_dtype: torch.dtype | None = None):
        B, H, D = batch, heads, head_dim
        # int8: K and V held as the attention over int8 pages sees them (float32, exact), and
        # handed to the policies in the model's dtype, as the ragged store gives them back.
        self.stored = as_attended if kv_dtype == torch.int8 else None
        self.dtype = dtype
        held = torch.float32 if kv_dtype == torch.int8 else dtype
        self.k = torch.zeros(B, H, 0, D, dtype=held, device=device)
        self.v = torch.zeros(B, H, 0, D, dtype=held, device=device)
        self.pos = torch.zeros(B, H, 0, dtype=torch.long, device=device)
        self.alive = torch.zeros(B, H, 0, dtype=torch.bool, device=device)
        self.channels = torch.zeros(B, H, 0, channels, dtype=torch.float32, device=device)

    def fork(self) -> "MaskedLayerKV":
        """A copy: the reference holds every token itself."""
        other = object.__new__(type(self))
        other._copy(self)
        return other

    def _copy(self, source: "MaskedLayerKV") -> None:
        self.__dict__.update({name: value.clone() if isinstance(value, torch.Tensor) else value
                              for name, value in source.__dict__.items()})

    def append(self, k, v, pos, keep) -> None:
        """keep [B, H, n] bool, or None: every token."""
        B, H, n, _ = k.shape
        if keep is None:
            keep = torch.ones(B, H, n, dtype=torch.bool, device=k.device)
        if self.stored is not None:
            k, v = self.stored(k), self.stored(v)
        self.k = torch.cat([self.k, k], dim=2)
        self.v = torch.cat([self.v, v], dim=2)
        self.pos = torch.cat([self.pos, pos.long()[:, None, :].expand(B, H, n)], dim=2)
        self.alive = torch.cat([self.alive, keep], dim=2)
        self.channels = torch.cat([self.channels, self.channels.new_zeros(B, H, n, self.channels.shape[-1])], dim=2)

    def set_prompt_channels(self, values, keep) -> None:
        n = values.shape[2]
        self.channels[:, :, -n:] = values.float() * keep[..., None]

    def accumulate(self, stats, names) -> None:
        for channel, name in enumerate(names):
            self.channels[..., channel] += stats[name].float()

    def set_channels(self, padded) -> None:
        order, _ = self._order()
        idx = order[..., None].expand(order.shape + padded.shape[-1:])
        fresh = self.channels.clone()
        fresh.scatter_(2, idx, padded.float())
        self.channels = torch.where(self.alive[..., None], fresh, self.channels)

    def attend(self, q, scale, q_pos, stats):
        out, st = ragged_attention(q, self.k, self.v, self.pos, self.alive, scale, q_pos)
        return out, ({name: st[name] for name in stats} if stats else None)

    def decode_step(self, k, v, pos, q, scale, step, valid=None, plan=None):
        """The step as its parts: append, attend, accumulate, evict by the rule."""
        B, H = k.shape[:2]
        self.append(k, v, pos, None if valid is None else valid[:, None, None].expand(B, H, 1))
        q_pos = None if valid is None else pos.masked_fill(~valid[:, None], -1)
        out, stats = self.attend(q, scale, q_pos, tuple(dict.fromkeys(step.stats + step.accumulate)))
        if step.accumulate:
            self.accumulate(stats, step.accumulate)
        if step.evict is not None:
            self.evict_by_rule(step.evict, step.last_pos)
        return out, ({name: stats[name] for name in step.stats} if step.stats else None)

    def _order(self):
        """The alive tokens of every head first, in position order, as the ragged store keeps them."""
        order = torch.argsort((~self.alive).to(torch.uint8), dim=-1, stable=True)
        lens = self.alive.sum(dim=-1)
        width = int(lens.max().item()) if lens.numel() else 0
        return order[..., :width], lens

    def view(self, stats, need_kv):
        order, lens = self._order()
        mask = torch.arange(order.shape[-1], device=order.device) < lens[..., None]

        def take(x):
            idx = order.view(order.shape + (1,) * (x.dim() - 3)).expand(order.shape + x.shape[3:])
            out = x.gather(2, idx)
            return out.masked_fill(~mask.view(mask.shape + (1,) * (x.dim() - 3)), 0)

        parts = dict(pos=take(self.pos), mask=mask, channels=take(self.channels),
                     stats={name: take(value) for name, value in (stats or {}).items()})
        if need_kv:
            parts["k"], parts["v"] = take(self.k).to(self.dtype), take(self.v).to(self.dtype)
        return parts

    def _flat(self, scores):
        order, lens = self._order()
        B, H, L = order.shape
        return (scores.reshape(B * H, L).float().cpu(), self.pos.gather(2, order).reshape(B * H, L).cpu(),
                lens.reshape(-1).cpu(), order)

    def evict(self, scores, k) -> None:
        flat, pos, lens, order = self._flat(scores)
        keep = segmented_topk(flat, pos, lens, k.reshape(-1).cpu()).to(order.device).view(order.shape)
        kept = torch.zeros_like(self.alive).scatter_(2, order, keep)
        self.alive &= kept

    def evict_by_rule(self, evict, last_pos) -> None:
        """Every head of row b keeps its ``evict.budget[b]`` best tokens by the slot rule (channel
        0, or the position), protected tokens (position < sinks, or among the ``recent`` newest
        of the row) first."""
        budget = evict.budget_host.long().to(self.pos.device)
        if bool((self.lens.to(budget.device) <= budget[:, None]).all()):
            return
        scores = (self.channels[..., 0] if evict.rule == "mass" else self.pos.float()).float()
        protected = self.pos < evict.sinks
        if evict.recent:
            protected |= self.pos > last_pos.to(self.pos.device)[:, None, None] - evict.recent
        scores = scores.masked_fill(protected, float("inf"))
        order, _ = self._order()
        self.evict(scores.gather(2, order), budget[:, None].expand(self.pos.shape[:2]))

    def grouped_counts(self, scores, mask, k):
        flat, pos, lens, order = self._flat(scores)
        _, counts = grouped_topk(flat, pos, lens, order.shape[1], k.cpu())
        return counts.view(order.shape[:2]).long().to(scores.device)

    @staticmethod
    def prompt_keep(scores, pos, valid, k):
        B, H, n = scores.shape
        order = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)      # [B, n]
        lens = valid.sum(dim=-1)[:, None].expand(B, H).reshape(-1)
        flat = scores.gather(2, order[:, None].expand(B, H, n)).reshape(B * H, n).float().cpu()
        fpos = pos.gather(1, order)[:, None].expand(B, H, n).reshape(B * H, n).cpu()
        keep = segmented_topk(flat, fpos, lens.cpu(), k.reshape(-1).cpu()).to(scores.device).view(B, H, n)
        return torch.zeros_like(keep).scatter_(2, order[:, None].expand(B, H, n), keep)

    @staticmethod
    def prompt_grouped_counts(scores, pos, valid, k):
        B, H, n = scores.shape
        order = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)
        lens = valid.sum(dim=-1)[:, None].expand(B, H).reshape(-1)
        flat = scores.gather(2, order[:, None].expand(B, H, n)).reshape(B * H, n).float().cpu()
        fpos = pos.gather(1, order)[:, None].expand(B, H, n).reshape(B * H, n).cpu()
        _, counts = grouped_topk(flat, fpos, lens.cpu(), H, k.cpu())
        return counts.view(B, H).long().to(scores.device)

    def drop_before(self, first) -> None:
        """Masks the tokens of row b at positions before first[b] [B]."""
        self.alive &= self.pos >= first.to(self.pos.device)[:, None, None]

    def trim(self, extra: int) -> None:
        """Nothing to release: a masked cache keeps every token."""

    def shrink_to_fit(self) -> None:
        """Nothing to release: a masked cache keeps every token."""

    graph_ready = False   # no pages for a captured step to append into: its steps stay eager

    @property
    def lens(self) -> torch.Tensor:
        return self.alive.sum(dim=-1).cpu()

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes held: the full-size K and V (evicted tokens included) plus the masks."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.alive, self.channels))
