"""When a policy evicts: after the prefill, after every prefill block, during decoding, or once
after a few decode steps (lookahead)."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache_ext.checks import Bool, Int, Optional, check_fields

MAX_BLOCK = 256   # the attention kernel's largest query block
BLOCK = Int(1, MAX_BLOCK, what=f"an integer in [1, {MAX_BLOCK}] (the attention kernel's largest block)")
MAX_LOOKAHEAD = 4096
LOOKAHEAD = Int(0, MAX_LOOKAHEAD, what=f"an integer in [0, {MAX_LOOKAHEAD}] (decode steps before the compression)")


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

    ``lookahead``: 0 compresses a one-shot prompt right after the prefill. L > 0 defers that
    one compression: the model decodes L tokens over the whole prompt, then each layer scores
    the prompt once with an observation window of the prompt's newest queries followed by
    every query since (the L decoded tokens', and those of any call in between), keeps its
    budget of the prompt plus every token since, and decoding goes on over what it kept. Only
    a scorer with an observation window (SnapKV, and wrappers of it) can widen it
    (``Scorer.observing``); one-shot prefill only (no ``prefill_block``, no ``decode_every``).
    The cache holds the whole prompt and L tokens until then, as the prefill did.
    ``lookahead_queries``: False leaves the queries since the prompt out of the window (the
    prompt's own window scores the prompt, as one-shot; the tokens since are kept all the
    same): the ablation that keeps only the deferral.
    """

    prefill_block: int | None = None
    decode_every: int | None = None
    decode_target: int | None = None
    lookahead: int = 0
    lookahead_queries: bool = True

    def __post_init__(self):
        check_fields(self, "Schedule", prefill_block=Optional(BLOCK), decode_every=Optional(Int(1)),
                     decode_target=Optional(Int(1)), lookahead=LOOKAHEAD, lookahead_queries=Bool())
        if self.decode_target is not None and self.decode_every is None:
            raise ValueError(f"Schedule decode_target (= {self.decode_target}) needs decode_every: "
                             "it is the size decode-time eviction evicts down to")
        if self.lookahead and (self.prefill_block is not None or self.decode_every is not None):
            raise ValueError(f"Schedule lookahead (= {self.lookahead}) defers a one-shot compression; it takes "
                             f"neither prefill_block (= {self.prefill_block}) nor decode_every "
                             f"(= {self.decode_every}): give lookahead=0 or leave both None")

    @property
    def evicts_over_cache(self) -> bool:
        """Whether any eviction reads attention over the cache (not only the dense prompt)."""
        return self.prefill_block is not None or self.decode_every is not None


def OneShot() -> Schedule:
    """Compress each prompt once after prefill; decoding appends without eviction."""
    return Schedule()


def BlockwisePrefill(block: int = 128, decode_every: int | None = None) -> Schedule:
    """Prefill in blocks of ``block`` tokens, evicting to the budget after each block."""
    return Schedule(prefill_block=BLOCK(block, "BlockwisePrefill block"),
                    decode_every=Optional(Int(1))(decode_every, "BlockwisePrefill decode_every"))


def EveryStep(prefill_block: int | None = None) -> Schedule:
    """Evict at every decode step, so the cache stays at its budget."""
    return Schedule(prefill_block=Optional(BLOCK)(prefill_block, "EveryStep prefill_block"), decode_every=1)


def EveryNSteps(n: int, target: int | None = None, prefill_block: int | None = None) -> Schedule:
    """Evict every ``n`` decode steps down to ``target`` tokens per head (default: the budget)."""
    return Schedule(prefill_block=Optional(BLOCK)(prefill_block, "EveryNSteps prefill_block"),
                    decode_every=Int(1)(n, "EveryNSteps n"),
                    decode_target=Optional(Int(1))(target, "EveryNSteps target"))


def Lookahead(steps: int = 8) -> Schedule:
    """Compress each prompt once, after ``steps`` decode steps over the whole prompt, with their
    queries in the observation window; decoding then appends without eviction."""
    return Schedule(lookahead=Int(1, MAX_LOOKAHEAD, what=f"an integer in [1, {MAX_LOOKAHEAD}] (decode steps "
                                  "before the compression)")(steps, "Lookahead steps"))
