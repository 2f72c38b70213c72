"""When a policy evicts: after the prefill, after every prefill block, during decoding."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """``prefill_block``: None compresses a fresh prompt once, right after each layer's own
    dense attention over it (one-shot, as SnapKV and Ada-KV do). An integer m processes the
    prompt in blocks of m tokens over the ragged cache and evicts down to the budget after
    each block (CAOTE's block-wise prefill; peak cache = budget + m). Blocks run inside each
    layer, which gives the same result as feeding the model m tokens at a time.

    ``decode_every``: None never evicts while decoding (the cache grows by one token per
    step); N evicts every N decode steps down to ``decode_target`` tokens per head
    (default: the budget), so 1 holds the cache at its budget.
    """

    prefill_block: int | None = None
    decode_every: int | None = None
    decode_target: int | None = None

    def __post_init__(self):
        if self.prefill_block is not None and not 1 <= self.prefill_block <= 256:
            raise ValueError(f"prefill_block must be in [1, 256] (the attention kernel's block "
                             f"limit), got {self.prefill_block}")
        if self.decode_every is not None and self.decode_every < 1:
            raise ValueError(f"decode_every must be >= 1, got {self.decode_every}")
        if self.decode_target is not None:
            if self.decode_every is None:
                raise ValueError("decode_target needs decode_every")
            if self.decode_target < 1:
                raise ValueError(f"decode_target must be >= 1, got {self.decode_target}")

    @property
    def evicts_over_cache(self) -> bool:
        """Whether any eviction reads attention over the cache (not only the dense prompt)."""
        return self.prefill_block is not None or self.decode_every is not None


def OneShot() -> Schedule:
    """Compress each prompt once after prefill; decoding appends without eviction."""
    return Schedule()


def BlockwisePrefill(block: int = 128, decode_every: int | None = None) -> Schedule:
    """Prefill in blocks of ``block`` tokens, evicting to the budget after each block."""
    return Schedule(prefill_block=block, decode_every=decode_every)


def EveryStep(prefill_block: int | None = None) -> Schedule:
    """Evict at every decode step, so the cache stays at its budget."""
    return Schedule(prefill_block=prefill_block, decode_every=1)


def EveryNSteps(n: int, target: int | None = None, prefill_block: int | None = None) -> Schedule:
    """Evict every ``n`` decode steps down to ``target`` tokens per head (default: the budget)."""
    return Schedule(prefill_block=prefill_block, decode_every=n, decode_target=target)
