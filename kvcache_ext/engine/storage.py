"""LayerStorage: what the eviction engine asks of one layer's stored tokens.

Two implementations: ``kvcache_ext.engine.ragged_storage.RaggedLayerKV`` (the compiled ragged store: only the
kept tokens are held) and ``kvcache_ext.reference.masked_cache.MaskedLayerKV`` (plain PyTorch, a
dense full-size cache with evicted entries masked: the reference the tests compare against).
The engine (``kvcache_ext.engine.eviction`` and ``prompt``) talks to a storage through these methods only, so that a
new layout (a paged store, say) is a new class of this shape and nothing else.

Layouts: "padded" tensors are [B, H, L, ...] with each head's tokens first, in position order
(the layout of ``CacheView``); ``channels`` is the scorer's per-token float32 state in the
storage's own layout.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LayerStorage(Protocol):
    """Constructed as ``Storage(batch, heads, head_dim, dtype, device, channels)``."""

    channels: torch.Tensor

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Stores new tokens: k, v [B, H, n, D]; pos [B, n]; keep [B, H, n] bool (None: all)."""

    def set_prompt_channels(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """The channels [B, H, n, C] of a fresh prompt's tokens, of which ``keep`` were stored."""

    def write_channels(self, channels: torch.Tensor) -> None:
        """Stores ``channels`` in the storage's own layout, as ``channels`` gave them (which may
        be a copy)."""

    def set_channels(self, padded: torch.Tensor) -> None:
        """The channels of the stored tokens from a padded [B, H, L, C] tensor."""

    def attend(self, q: torch.Tensor, scale: float, q_pos: torch.Tensor | None, stats) -> tuple:
        """Attention of q [B, Hq, n, D] over the stored tokens: (out, {stat name: slot-layout
        tensor} or None) for the statistics named in ``stats`` (see ``AttentionStats``)."""

    def append_and_attend(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, q: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """``append(k, v, pos, None)``, then ``attend(q, scale, None, ())``'s output (a decode
        step that only appends; one call, so that a storage can do both at once)."""

    def append_attend_evict(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, q: torch.Tensor,
                            scale: float, rule: str, protection, last_pos: torch.Tensor,
                            budget: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """A decode step of a slot-layout eviction (``Scorer.slot_rule``) in one call:
        ``append_and_attend`` with the statistics the rule reads, the rule's channel update,
        and, with ``budget`` ((k [B] on the device, the same on the host)), an eviction to k
        per head, ``protection`` first (``last_pos`` [B]: each row's newest position, this
        token included). Returns the output [B, Hq, 1, D], or None where the storage has no
        such step (nothing was done: the engine then takes its general path)."""

    def view(self, stats: dict | None, need_kv: bool) -> dict:
        """The stored tokens padded: pos, mask, channels, the statistics padded, and k, v."""

    def evict(self, scores: torch.Tensor, k: torch.Tensor) -> None:
        """Keeps the k [B, H] best of each head by scores [B, H, L] (padded), drops the rest."""

    def evict_in_slots(self, scorer, protection, stats: dict, last_pos: torch.Tensor, k: torch.Tensor,
                       k_host: torch.Tensor) -> bool:
        """``evict`` with equal budgets k [B] per head (``k_host`` on the host) and the scores of
        ``scorer.slot_scores``, in the storage's own layout; False where the storage evicts only
        through a padded view (the engine then does)."""

    def grouped_counts(self, scores: torch.Tensor, mask: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Ada-KV: how many of each head's tokens are among the k [B] best of its row."""

    @staticmethod
    def prompt_keep(scores, pos, valid, k) -> torch.Tensor:
        """Top-k of a dense prompt per head: keep [B, H, n]."""

    @staticmethod
    def prompt_grouped_counts(scores, pos, valid, k) -> torch.Tensor:
        """``grouped_counts`` on a dense prompt."""

    def drop_before(self, first: torch.Tensor) -> None:
        """Drops the tokens of row b at positions before ``first[b]`` ([B]): a sliding window's
        tokens that no query will see again."""

    def trim(self, extra: int) -> None:
        """Releases the free room but ``extra`` tokens per head."""

    def fork(self) -> "LayerStorage":
        """A storage holding the same tokens, to which later tokens are appended apart (a shared
        prefix): the tokens held now are never written again, in either (see ``RaggedKVStore.fork``)."""

    @property
    def lens(self) -> torch.Tensor:
        """[B, H] int64 stored tokens per head (host side: no device sync)."""

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""
