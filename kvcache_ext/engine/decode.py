"""A decode step of one layer: one new token per row over the cache, the engine's only decode
path, whatever the policy, eager or captured in a CUDA graph.

The policy's per-step work is data (``DecodeWork``), made once per layer and kind of step (an
eviction step or not) from the scorer's capabilities, the allocation and the layer's budgets.
The step is one storage call (``LayerStorage.decode_step``: append, attend, accumulate the
scorer's statistics, evict by its slot rule); what a scorer needs of a padded view afterwards
(``update_view``, an eviction scored by ``cache_scores``) follows it on the host. A step that
needs nothing on the host after its storage call (``DecodeWork.in_storage``) is what a CUDA
graph can capture (``kvcache_ext.hf.decode_graph``); the graph then hands the step its plan.

The host counts of a step (tokens seen, decode steps) are advanced by the caller after it:
``layer_forward`` for an eager step, the graph around every run for a captured one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcache_ext.engine.eviction import cache_view, evict, rule_eviction
from kvcache_ext.engine.state import LayerState
from kvcache_ext.engine.storage import DecodeStep, EvictByRule


@dataclass(frozen=True)
class DecodeWork:
    """What a layer's decode steps of one kind do (``decode_work``).

    ``step``: the storage call's work, the same object at every step of the kind. ``view_stats``: the statistics ``update_view`` reads, and ``evict_stats`` those of
    an eviction after the storage call (``evicts``): by the slot rule (``rule``) when the step
    could not run it inside the storage call, else scored on a padded view."""

    step: DecodeStep
    update_view: bool = False
    view_stats: tuple[str, ...] = ()
    evicts: bool = False
    rule: EvictByRule | None = None
    evict_stats: tuple[str, ...] = ()
    output_after_eviction: bool = False

    @property
    def in_storage(self) -> bool:
        """Whether the step is its storage call alone (no host work after it)."""
        return not (self.update_view or self.evicts)


def decode_work(state: LayerState, evict_now: bool) -> DecodeWork:
    """The work of this layer's decode steps (eviction steps when ``evict_now``), from its
    policy's capabilities and its decode budgets."""
    policy = state.policy
    caps = policy.scorer.capabilities
    over_cache = policy.schedule.evicts_over_cache
    accumulate = caps.accumulates if over_cache else ()
    update_view = caps.updates_from_view and over_cache
    view_stats = caps.tracked_stats if update_view else ()
    rule = rule_eviction(policy, state.decode_budget, state.decode_budget_host) if evict_now else None
    evict_stats = caps.evict_stats if evict_now and rule is None else ()
    # The rule's eviction runs inside the storage call unless something must come between:
    # the scorer's update from a view, or the block's output over the tokens kept.
    in_call = rule is not None and not update_view and not caps.output_after_eviction
    # last_pos: the layer's tensor of its rows' newest positions, updated in place every step.
    step = DecodeStep(stats=tuple(dict.fromkeys(view_stats + evict_stats)), accumulate=accumulate,
                      evict=rule if in_call else None, last_pos=state.last_pos)
    return DecodeWork(step=step, update_view=update_view, view_stats=view_stats,
                      evicts=evict_now and not in_call, rule=None if in_call else rule,
                      evict_stats=evict_stats, output_after_eviction=caps.output_after_eviction)


def work_of(state: LayerState, evict_now: bool) -> DecodeWork:
    """``decode_work``, made once per layer and kind of step (the layer keeps it until its
    budgets change)."""
    return state.decode_works.get(evict_now) or state.keep_decode_work(evict_now, decode_work(state, evict_now))


def evicts_now(state: LayerState) -> bool:
    """Whether the layer's next decode step is one of its policy's eviction steps."""
    every = state.policy.schedule.decode_every
    return every is not None and (state.decode_steps + 1) % every == 0


def decode(state: LayerState, q, k, v, pos, valid, scale, plan=None):
    """One decode step of one layer: q [B, Hq, 1, D], k, v [B, H, 1, D] at positions ``pos``
    [B, 1]; ``valid`` [B] bool (None: no padding); ``plan``: the attention plan of a step
    captured in a CUDA graph (None: eager). Returns [B, Hq, 1, D]."""
    work = work_of(state, evicts_now(state))
    newest = pos[:, 0] if valid is None else pos[:, 0].masked_fill(~valid, -1)
    state.note_newest(newest)   # in place: protection of the recent tokens reads it, this token included
    out, stats = state.kv.decode_step(k, v, pos, q, scale, work.step, valid, plan)
    if work.in_storage:
        return out
    q_pos = None if valid is None else pos.masked_fill(~valid[:, None], -1)
    queries = (q, q_pos, scale)
    if work.update_view:
        # Scorers whose per-token state needs more than the kernel's statistics (their own
        # softmax of the new queries over the cached keys, say) update from a padded view.
        view = cache_view(state, {name: stats[name] for name in work.view_stats}, 1, state.decode_budget,
                          queries)
        state.kv.set_channels(state.policy.scorer.update_view(view))
    if work.evicts:
        evicted = evict(state, state.decode_budget, state.decode_budget_host,
                        {name: stats[name] for name in work.evict_stats}, 1, rule=work.rule, queries=queries)
        if evicted and work.output_after_eviction:
            out, _ = state.kv.attend(q, scale, q_pos, ())   # the step's output over what was kept
    return out

