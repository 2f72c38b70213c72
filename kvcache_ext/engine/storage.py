"""LayerStorage: what the eviction engine asks of one layer's stored tokens, and the data of one
decode step (``DecodeStep``) that it hands a storage.

Two implementations: ``kvcache_ext.engine.ragged_storage.RaggedLayerKV`` (the compiled ragged
store: only the kept tokens are held) and ``kvcache_ext.reference.masked_cache.MaskedLayerKV``
(plain PyTorch, a dense full-size cache with evicted entries masked: the reference the tests
compare against). The engine (``kvcache_ext.engine.eviction`` and ``prompt``) and the decode
graph (``kvcache_ext.hf.decode_graph``) talk to a storage through these methods only, so that
a new layout is a new class of this shape and nothing else.

Layouts: "padded" tensors are [B, H, L, ...] with each head's tokens first, in position order
(the layout of ``CacheView``); "stats" are the attention statistics in the storage's own
layout (opaque to the engine: it hands them back to the storage or to ``view``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class EvictByRule:
    """An eviction a storage runs by itself, each head on its own: every head of row b keeps
    its ``budget[b]`` best tokens scored by the scorer's ``rule`` (``Capabilities.slot_rule``),
    the protected ones first (position < ``sinks``, or among the ``recent`` newest of its row).
    A head within its budget keeps all of it. ``budget`` [B] integers on the storage's device,
    ``budget_host`` the same on the host."""

    rule: str
    sinks: int
    recent: int
    budget: torch.Tensor
    budget_host: torch.Tensor


@dataclass(frozen=True)
class DecodeStep:
    """What a storage's decode step does besides appending one token per row and attending
    with it (``LayerStorage.decode_step``): the policy's per-step work as data, made once per
    layer and kind of step (a storage may prepare its call once per ``DecodeStep``).

    - ``stats``: the attention statistics to return.
    - ``accumulate``: the statistics added to channels 0, 1, ... of every token, in place
      (``Capabilities.accumulates``).
    - ``evict``: the step's eviction by a slot rule (``EvictByRule``), after the rest; None:
      no eviction in this call.
    - ``last_pos`` [B]: the layer's tensor of each row's newest position, updated in place
      before every step (this token included): what protection of the recent tokens reads.
    """

    stats: tuple[str, ...] = ()
    accumulate: tuple[str, ...] = ()
    evict: EvictByRule | None = None
    last_pos: torch.Tensor | None = None


@runtime_checkable
class LayerStorage(Protocol):
    """Constructed as ``Storage(batch, heads, head_dim, dtype, device, channels)``."""

    # --- tokens ------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Stores new tokens: k, v [B, H, n, D]; pos [B, n]; keep [B, H, n] bool (None: all)."""

    def attend(self, q: torch.Tensor, scale: float, q_pos: torch.Tensor | None, stats) -> tuple:
        """Attention of q [B, Hq, n, D] over the stored tokens: (out, {stat name: stats} or
        None) for the statistics named in ``stats`` (see ``AttentionStats``)."""

    def decode_step(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, q: torch.Tensor, scale: float,
                    step: DecodeStep, valid: torch.Tensor | None = None,
                    plan: torch.Tensor | None = None) -> tuple[torch.Tensor, dict | None]:
        """One decode step of one layer, the one door of every decode step, eager or captured:
        appends k, v [B, H, 1, D] at ``pos`` [B, 1], attends with q [B, Hq, 1, D], then does
        ``step``'s work (``DecodeStep``). ``valid`` [B] bool: the rows whose token is real
        (None: every row's); a padding token is not stored and its query sees nothing.
        ``plan``: the attention plan of a step captured in a CUDA graph (the pages it holds):
        the step then runs with no host work, and its owner notes the host side after every
        run (``note_graph_step``); None: an eager step, host work included. Returns (out [B, Hq,
        1, D], {name: stats} of ``step.stats`` or None)."""

    # --- the scorer's channels ---------------------------------------------------------------
    def set_prompt_channels(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """The channels [B, H, n, C] of a fresh prompt's tokens, of which ``keep`` were stored."""

    def accumulate(self, stats: dict, names: tuple[str, ...]) -> None:
        """Adds the statistics ``names`` (of ``attend``) to channels 0, 1, ... in place."""

    def set_channels(self, padded: torch.Tensor) -> None:
        """The channels of the stored tokens from a padded [B, H, L, C] tensor."""

    # --- views and eviction ------------------------------------------------------------------
    def view(self, stats: dict | None, need_kv: bool) -> dict:
        """The stored tokens padded: pos, mask, channels, the statistics padded, and k, v."""

    def evict(self, scores: torch.Tensor, k: torch.Tensor) -> None:
        """Keeps the k [B, H] best of each head by scores [B, H, L] (padded), drops the rest."""

    def evict_by_rule(self, evict: EvictByRule, last_pos: torch.Tensor) -> None:
        """``EvictByRule`` outside a decode step (``last_pos`` [B]: each row's newest position)."""

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

    # --- memory ------------------------------------------------------------------------------
    def trim(self, extra: int) -> None:
        """Releases the free room but ``extra`` tokens per head."""

    def shrink_to_fit(self) -> None:
        """Releases every page that holds no token."""

    def fork(self) -> "LayerStorage":
        """A storage holding the same tokens, to which later tokens are appended apart (a shared
        prefix): the tokens held now are never written again, in either (see ``RaggedKVStore.fork``)."""

    # --- accounting ----------------------------------------------------------------------------
    @property
    def lens(self) -> torch.Tensor:
        """[B, H] int64 stored tokens per head (host side: no device sync)."""

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""

    @property
    def num_pages(self) -> int:
        """Pages the storage holds (0 for a storage without pages)."""

    # Whether its decode steps can be captured in a CUDA graph: a ``GraphStorage`` (False: a
    # decode graph leaves its steps eager).
    graph_ready: bool


@runtime_checkable
class GraphStorage(LayerStorage, Protocol):
    """A storage whose decode steps a CUDA graph can capture (``kvcache_ext.hf.decode_graph``;
    ``graph_ready`` True): a captured step replays the same device work on the same memory, so
    the storage keeps its tensors while ``graph_key`` stays, and appends into pages it already
    holds."""

    def graph_key(self) -> tuple:
        """What a captured step's ops read by address: a new value means a new capture."""

    def has_room(self, n: int) -> bool:
        """Whether every head's pages hold ``n`` more tokens (host bookkeeping, no sync)."""

    def reserve(self, extra: int) -> None:
        """Pages for ``extra`` more tokens per head."""

    def graph_plan(self, rows: int) -> torch.Tensor:
        """The attention plan a captured step attends with (of the lengths its pages hold)."""

    def hold_for_graph(self):
        """What a captured graph must keep alive (the addresses its ops read)."""

    def note_graph_step(self, n: int, evict: EvictByRule | None) -> None:
        """The host side of a captured step's run: ``n`` tokens appended, then ``evict``'s
        eviction (every head kept min(len, budget), every page kept)."""
