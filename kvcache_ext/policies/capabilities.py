"""Capabilities: what a scorer needs of the engine and what it offers it, as one frozen value.

The engine reads a scorer's needs only here (``Scorer.capabilities``), never from the scorer's
type or its methods' identity; a wrapper (``policies.wrapper``) forwards its base's value as a
whole and changes only what it changes. A new need is a new field here and its reader in the
engine: no scorer, wrapper or other reader changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcache_ext.checks import Bool, Choice, Int, Optional, Spec, check_fields
from kvcache_ext.kernels.attention import STAT_NAMES

SLOT_RULES = ("mass", "position")


@dataclass(frozen=True)
class Names(Spec):
    """A tuple of attention statistic names."""

    def describe(self) -> str:
        return "a tuple of statistic names among " + ", ".join(repr(n) for n in STAT_NAMES)

    def __call__(self, value, label):
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise self._type_error(value, label)
        if not all(isinstance(v, str) and v in STAT_NAMES for v in value):
            raise self._value_error(value, label)
        return tuple(value)


@dataclass(frozen=True)
class Capabilities:
    """What a scorer needs and offers.

    State it keeps:
    - ``channels``: float32 per-token channels kept by the storage beside each token
      (``view.channels``), cleared with the cache.
    - ``accumulates``: the attention statistics that every attention over the cache adds to
      channels 0, 1, ... in order (H2O: the mass; RoCo: mass, sum of squares, count), in place
      in the storage (no Python runs for them), while the schedule will evict again.
    - ``updates_from_view``: ``update_view`` gives the new channels from a padded view after
      every attention over the cache (state the statistics alone cannot give), reading
      ``update_stats`` of that call.

    What its scores read:
    - ``evict_stats``: the statistics ``cache_scores`` reads (of the latest call), over its last
      ``stats_window`` queries only when set (SnapKV's window).
    - ``needs_kv`` / ``needs_queries`` / ``needs_token_ids``: views carry the cached K and V /
      the latest call's queries / the rows' token ids (``patch`` then needs the tokenizer).
    - ``reads_every_head``: a head's score reads every KV head of the layer (TOVA's mean over
      heads); under tensor parallelism the ranks then evict at the same steps.
    - ``slot_rule``: its cache scores are one of the rules the store scores a token by from its
      own record, so that it evicts without a padded view (and inside a CUDA graph):
      ``"mass"``, channel 0 (H2O); ``"position"``, the position (StreamingLLM).

    What it changes in the engine:
    - ``output_after_eviction``: a block's output is recomputed over the tokens kept (CAOTE).
    - ``reconstructs``: its prompt scores come from reconstruction passes of the whole model
      (a ``ReconstructionScorer``: KVzip), not from one layer's attention.
    """

    channels: int = 0
    accumulates: tuple[str, ...] = ()
    updates_from_view: bool = False
    update_stats: tuple[str, ...] = ()
    evict_stats: tuple[str, ...] = ()
    stats_window: int | None = None
    needs_kv: bool = False
    needs_queries: bool = False
    needs_token_ids: bool = False
    reads_every_head: bool = False
    slot_rule: str | None = None
    output_after_eviction: bool = False
    reconstructs: bool = False

    def __post_init__(self):
        # float32 channels per token: the store holds at most 65536.
        check_fields(self, "Capabilities", channels=Int(0, 65536), accumulates=Names(),
                     updates_from_view=Bool(), update_stats=Names(), evict_stats=Names(),
                     stats_window=Optional(Int(1)), needs_kv=Bool(), needs_queries=Bool(),
                     needs_token_ids=Bool(), reads_every_head=Bool(),
                     slot_rule=Optional(Choice(SLOT_RULES)), output_after_eviction=Bool(), reconstructs=Bool())
        if len(self.accumulates) > self.channels:
            raise ValueError(f"Capabilities accumulates {self.accumulates} into channels "
                             f"0..{len(self.accumulates) - 1}, but the scorer keeps {self.channels} channels")
        if self.slot_rule == "mass" and self.channels < 1:
            raise ValueError("Capabilities slot_rule 'mass' scores a token by its channel 0: it needs channels >= 1")

    @property
    def tracked_stats(self) -> tuple[str, ...]:
        """The statistics every attention over the cache must give while the schedule evicts again."""
        return tuple(dict.fromkeys(self.accumulates + (self.update_stats if self.updates_from_view else ())))
