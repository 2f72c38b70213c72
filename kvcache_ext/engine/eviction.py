"""The eviction engine: one layer's attention call on a patched model, with its policy.

Called by the attention function that ``kvcache_ext.patch`` registers, for a layer whose cache
is a ``RaggedCache`` (``layer_forward``), and by the evaluation harness to build a cache from a
recorded dense prefill (``prefill_dense``). Storage-agnostic: ``LayerState.kv`` is the ragged
store (``ragged_storage.RaggedLayerKV``) or the reference's masked dense cache.
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.across_ranks import any_over_budget, head_budgets
from kvcache_ext.engine.prompt import compress_prompt, release_prefill_slack
from kvcache_ext.engine.reconstruction import attend_context, hold_prompt
from kvcache_ext.engine.state import LayerState
from kvcache_ext.policies.allocation import Allocation
from kvcache_ext.policies.schedule import MAX_BLOCK
from kvcache_ext.policies.views import CacheView


def layer_forward(state: LayerState, dense_attention, module, q, k, v, attention_mask, scale,
                  position_ids, **kwargs):
    """Attention of one layer over its evicting cache. Returns [B, n, Hq, D] like HF's functions."""
    B, _, n, _ = q.shape
    if state.context is not None:   # a reconstruction pass over a held prompt
        return attend_context(state, q, k, v, new_positions(position_ids, state.seen, n, B, q.device))
    if state.shared.graph_step is not None:
        return decode_in_graph(state, q, k, v, position_ids, scale)
    window = kwargs.get("sliding_window")
    if window is not None:
        state.note_window(window)
        if state.seen + n > window:
            check_window_call(state, n)
            if state.kv is not None:   # a decode step: what its query no longer sees goes first
                drop_outside_window(state, new_positions(position_ids, state.seen, 1, B, q.device)[:, 0])
    if appends_only(state, n, attention_mask):
        return decode_append_only(state, q, k, v, position_ids, scale)
    if fuses_decode_step(state, n, attention_mask):
        out = decode_fused(state, q, k, v, position_ids, scale)
        if out is not None:
            return out
    state.check_positions(n)
    valid, all_valid = step_validity(state, attention_mask, n, B, q.device)
    pos = new_positions(position_ids, state.seen, n, B, q.device)
    schedule = state.policy.schedule
    if state.seen == 0 and n > 1 and schedule.prefill_block is None:
        out = dense_attention(module, q, k, v, attention_mask, scaling=scale, dropout=0.0, **kwargs)[0]
        prefill_dense(state, q, k, v, pos, valid, scale)
        return out
    state.ensure_storage(q, k)
    fresh = state.seen == 0
    state.advance(n)
    if fresh:
        state.ensure_budget(valid.sum(dim=1))
    if n == 1:
        return attend_block(state, q, k, v, pos, valid, scale, decode=True,
                            all_valid=all_valid).transpose(1, 2)
    block = min(schedule.prefill_block or MAX_BLOCK, MAX_BLOCK)
    out = attend_in_blocks(state, q, k, v, pos, valid, scale, block, all_valid)
    if fresh:
        release_prefill_slack(state)
    return out.transpose(1, 2)


def check_window_call(state: LayerState, n: int) -> None:
    """A sliding-window layer whose sequence passes its window: the calls whose attention the
    engine windows exactly are a decode step (one token: the tokens it no longer sees are
    dropped first) and the one-shot dense prefill of a fresh prompt (the model's own attention
    with HF's sliding mask; the prompt's tokens outside the next token's window are not kept).
    Several tokens over a cache (a block-wise prefill, a second prompt) would need a window per
    query, which the store's attention does not take: refused."""
    if n == 1:
        return
    what = None
    if state.seen or state.policy.schedule.prefill_block is not None:
        what = (f"a call of {n} tokens over a cache that has seen {state.seen} (a block-wise prefill "
                "or a later prompt past the window)")
    elif state.policy.scorer.reconstructs:
        what = f"{type(state.policy.scorer).__name__}'s reconstruction passes over a prompt of {n} tokens"
    if what is not None:
        raise NotImplementedError(
            f"layer {state.layer_idx} uses sliding-window attention (window {state.window}); kvcache_ext "
            f"windows a one-shot prefill of a fresh prompt and one-token decode steps, not {what}")


def drop_outside_window(state: LayerState, newest: torch.Tensor) -> None:
    """Drops from a sliding-window layer the tokens that a query at ``newest`` [B] does not see:
    every later query is newer, so none will see them again."""
    state.kv.drop_before(state.window_start(newest))


def appends_only(state: LayerState, n: int, attention_mask) -> bool:
    """Whether this call is a decode step that only appends: one token, no padding (HF gives
    no mask), a cache already filled, and a schedule that never evicts over the cache, so that
    nothing will ever read statistics, channels or views of it."""
    return (n == 1 and attention_mask is None and state.kv is not None
            and not state.policy.schedule.evicts_over_cache)


def decode_append_only(state: LayerState, q, k, v, position_ids, scale):
    """The decode step of a schedule that never evicts over the cache (one-shot SnapKV,
    Ada-SnapKV, ...), for one token and no padding: append, attend, nothing else. No
    statistics are asked of the kernel, no channels are updated (nothing will read them), no
    validity mask is built and nothing waits on the device: this runs for every layer at every
    step, so it is what such a policy's decoding costs beyond the attention itself.
    ``attend_block`` would do the same work through its general path."""
    B = q.shape[0]
    if (B, k.dtype, k.device) != state.tokens or k.shape[1] != state.layout[0]:
        state.check_tokens(q, k)
    state.check_positions(1)
    pos = new_positions(position_ids, state.seen, 1, B, q.device)        # [B, 1]
    out = state.kv.append_and_attend(k, v, pos, q, scale)   # first: nothing has changed if it refuses
    state.advance(1)
    state.count_decode_step()
    state.note_newest(pos[:, 0])
    return out.transpose(1, 2)


def decode_in_graph(state: LayerState, q, k, v, position_ids, scale):
    """The decode step of ``decode_append_only`` or ``decode_fused`` as a CUDA graph captures
    it (``kvcache_ext.hf.decode_graph``, which runs only steps that one of them would serve):
    append and attend through the ops, into the pages the layer holds, with the plan the
    graph made of them, the rows' newest positions updated in place; for a ``slot_rule``
    scorer also its channel update and, on the graph's eviction steps, its eviction in slot
    layout. Nothing on the host: a replay runs none of this Python, so the graph checks the
    room and advances the layer's counts (host lengths, tokens seen, decode steps) around
    every run, captured or replayed. ``position_ids`` [B, 1]: the graph's own buffer."""
    graph = state.shared.graph_step
    pos = position_ids.expand(q.shape[0], 1)
    state.note_newest_in_place(pos[:, 0])
    plan = graph.plan(state.layer_idx)
    if not state.policy.schedule.evicts_over_cache:
        return state.kv.append_attend_in_pages(k, v, pos, q, scale, plan).transpose(1, 2)
    # decode_fused's step (a slot_rule scorer): the channel update and, on an eviction step,
    # the top-k of every head by the rule and the compaction, whoever is over its budget.
    p = state.policy
    budget = (state.decode_budget, state.decode_budget_host) if graph.evicts_now else None
    out = state.kv.append_attend_evict_in_pages(k, v, pos, q, scale, plan, p.scorer.slot_rule, p.protection,
                                                state.last_pos, budget)
    return out.transpose(1, 2)


def fuses_decode_step(state: LayerState, n: int, attention_mask) -> bool:
    """Whether this call is a decode step that the storage may serve in one compiled call
    (``decode_fused``): one token, no padding, a cache already filled, and a scorer whose
    decode-time update and scores have a ``slot_rule`` under a schedule that evicts over the
    cache (H2O or StreamingLLM evicting every step or every few)."""
    return (n == 1 and attention_mask is None and state.kv is not None
            and state.policy.scorer.slot_rule is not None and state.policy.schedule.evicts_over_cache)


def decode_fused(state: LayerState, q, k, v, position_ids, scale):
    """The decode step of a ``slot_rule`` scorer in one storage call: append, attend with the
    rule's statistics, update the channels and, on an eviction step, evict in slot layout
    (``evicts_in_slots``) with the new lengths known on the host. Exactly ``attend_block``'s
    work for such a step (tests/test_patch.py compares the two), at about the host cost of
    ``decode_append_only``: H2O evicting every step spent half its decode step in Python's
    host work (bench/e2e.py h2o-step). Returns None where the step needs the general path, having
    changed nothing but the rows' newest positions (which that path notes again, to the same
    values): an eviction whose budgets need the padded view (Ada-KV's, a fractional budget),
    or a storage without the compiled step (the reference's)."""
    B = q.shape[0]
    if (B, k.dtype, k.device) != state.tokens or k.shape[1] != state.layout[0]:
        state.check_tokens(q, k)
    state.check_positions(1)
    p = state.policy
    every = p.schedule.decode_every
    evict_now = every is not None and (state.decode_steps + 1) % every == 0
    if evict_now and not evicts_in_slots(p, state.decode_budget_host):
        return None
    pos = new_positions(position_ids, state.seen, 1, B, q.device)        # [B, 1]
    # The rows' newest positions with this token, what protection of the recent tokens reads
    # (noted first: the general path, when the storage declines, notes the same again).
    state.note_newest(pos[:, 0])
    budget = (state.decode_budget, state.decode_budget_host) if evict_now else None
    out = state.kv.append_attend_evict(k, v, pos, q, scale, p.scorer.slot_rule, p.protection,
                                       state.last_pos, budget)
    if out is None:
        return None
    state.advance(1)
    state.count_decode_step()
    return out.transpose(1, 2)


def prefill_dense(state: LayerState, q, k, v, pos, valid, scale) -> None:
    """What a one-shot prefill leaves in a fresh layer once the model's dense attention has run
    on the prompt q [B, Hq, n, D], k, v [B, H, n, D] (positions ``pos``, ``valid`` [B, n]): the
    storage made, the tokens counted and the compressed prompt stored, without the prefill's
    slack (or, for a scorer that reconstructs the prompt, the prompt held for its passes). The
    one door for a dense prefill: the patched model's attention and the evaluation's shared
    prefill (which replays a recorded one) both take it."""
    n = k.shape[2]
    if state.seen:
        raise RuntimeError(f"layer {state.layer_idx} has seen {state.seen} tokens: a dense prefill "
                           "fills a fresh cache")
    state.check_positions(n)
    state.ensure_storage(q, k)
    state.advance(n)
    if state.policy.scorer.reconstructs:
        hold_prompt(state, k, v, pos, valid, scale)   # scored and compressed after the passes
        return
    compress_prompt(state, q, k, v, pos, valid, scale)
    release_prefill_slack(state)


def update_channels(kv, scorer, stats: dict) -> None:
    """Folds attention statistics into the scorer's per-token channels, in the storage's layout."""
    channels = kv.channels
    scorer.update(channels, stats)
    kv.write_channels(channels)


def attend_in_blocks(state: LayerState, q, k, v, pos, valid, scale, block: int,
                     all_valid: bool = False):
    """Several new tokens over the cache, ``block`` at a time.

    Blocks are counted from each row's first real token, so a left-padded row is cut (and
    evicts) exactly where it would be cut alone; the rows' blocks are gathered side by side."""
    B, _, n, _ = q.shape
    first = n - valid.sum(dim=1)                                          # [B] leading padding
    if not all_valid and not bool((valid == (torch.arange(n, device=valid.device) >= first[:, None])).all()):
        first = torch.zeros_like(first)   # padding elsewhere (unusual): blocks by index
    if all_valid or bool((first == 0).all()):   # no stagger: plain slices
        outs = [attend_block(state, q[:, :, i:i + block], k[:, :, i:i + block], v[:, :, i:i + block],
                             pos[:, i:i + block], valid[:, i:i + block], scale, decode=False,
                             all_valid=all_valid)
                for i in range(0, n, block)]
        return torch.cat(outs, dim=2)
    out = q.new_zeros(q.shape)
    real = valid.sum(dim=1)                                               # [B]
    steps = torch.arange(block, device=q.device)
    for j in range(0, int(real.max()), block):
        # The row's tokens j .. j+c-1 fill the block's last c places, so that the block's last
        # query is the row's newest token (TOVA's query); a row with none sits this block out.
        count = (real - j).clamp(0, block)
        inside = steps >= (block - count)[:, None]                        # [B, block]
        idx = (first + j - (block - count))[:, None] + steps
        idx = idx.clamp(0, n - 1)
        take = lambda x: x.gather(2, idx[:, None, :, None].expand(x.shape[0], x.shape[1], block, x.shape[3]))
        blk = attend_block(state, take(q), take(k), take(v), pos.gather(1, idx),
                           valid.gather(1, idx) & inside, scale, decode=False, active=count > 0)
        rows, cols = inside.nonzero(as_tuple=True)
        out[rows, :, idx[rows, cols]] = blk[rows, :, cols]
    return out


def attend_block(state: LayerState, q, k, v, pos, valid, scale, decode: bool, active=None,
                 all_valid: bool = False):
    """Appends a block (or one decode token), attends over the cache, feeds the scorer, evicts.
    ``active`` [B]: rows that have tokens in this block (the others keep their cache as is).
    ``all_valid``: no padding in the block, known on the host (saves the syncs that a validity
    mask costs the store's append and this function)."""
    p, kv = state.policy, state.kv
    B, H, m, _ = k.shape
    kv.append(k, v, pos, None if all_valid else valid[:, None, :].expand(B, H, m))
    state.note_newest(pos.masked_fill(~valid, -1).max(dim=1).values)
    # Padding queries see nothing (q_pos -1); a lone real decode query needs no positions.
    q_pos = pos.masked_fill(~valid, -1) if m > 1 or not all_valid else None
    if decode:
        steps = state.count_decode_step()
        every = p.schedule.decode_every
        evict_now = every is not None and steps % every == 0
        target, target_host = state.decode_budget, state.decode_budget_host
    else:
        evict_now = p.schedule.prefill_block is not None
        target, target_host = state.budget, state.budget_host
    scorer = p.scorer
    track = scorer.update_stats if p.schedule.evicts_over_cache else ()
    wanted = scorer.evict_stats if evict_now else ()
    window = scorer.stats_window if wanted else None
    if window is not None and m > window:
        # The eviction statistics come from the last `window` queries only (SnapKV's window).
        head, head_stats = kv.attend(q[:, :, :m - window], scale, q_pos[:, :m - window], track)
        if track:
            update_channels(kv, scorer, head_stats)
        tail, stats = kv.attend(q[:, :, m - window:], scale, q_pos[:, m - window:], _union(track, wanted))
        out, n_stat = torch.cat([head, tail], dim=2), window
    else:
        out, stats = kv.attend(q, scale, q_pos, _union(track, wanted))
        n_stat = m
    if track:
        update_channels(kv, scorer, stats)
    queries = (q, q_pos, scale)
    if scorer.updates_from_view and p.schedule.evicts_over_cache:
        # Scorers whose per-token state needs more than the kernel's statistics (their own
        # softmax of the new queries over the cached keys, say) update from a padded view.
        view = cache_view(state, {name: stats[name] for name in track}, n_stat, target, queries)
        kv.set_channels(scorer.update_view(view))
    if evict_now:
        evicted = evict(state, target, target_host, {name: stats[name] for name in wanted}, n_stat,
                        active, queries)
        if evicted and scorer.output_after_eviction:
            out, _ = kv.attend(q, scale, q_pos, ())   # the block's output over what was kept
    return out


def cache_view(state: LayerState, stats: dict, stat_queries: int, target: torch.Tensor,
               queries=None) -> CacheView:
    """The cached tokens of one layer, padded, with what the scorer asked for."""
    scorer = state.policy.scorer
    parts = state.kv.view(stats, scorer.needs_kv)
    q, q_pos, scale = queries if queries is not None and scorer.needs_queries else (None, None, None)
    return CacheView(pos=parts["pos"], mask=parts["mask"], channels=parts["channels"],
                     last_pos=state.last_pos, layer_idx=state.layer_idx, num_layers=state.num_layers,
                     groups=state.groups, stats=parts["stats"], stat_queries=stat_queries,
                     k=parts.get("k"), v=parts.get("v"), budget=target, q=q, q_pos=q_pos, scale=scale,
                     model=state.model, layer_state=state.scorer_state,
                     cache_state=state.shared.scorer_state, token_ids=state.shared.token_ids)


def evict(state: LayerState, target: torch.Tensor, target_host: torch.Tensor, stats: dict, stat_queries: int,
          active: torch.Tensor | None = None, queries=None) -> bool:
    """Scores the cached tokens and keeps the allocation's budget of each head (of the
    ``active`` rows only, when given). Returns whether anything was scored."""
    p, kv = state.policy, state.kv
    if not any_over_budget(state, not bool((kv.lens <= target_host.view(-1, 1)).all())):   # host lengths
        return False   # every head is within its budget (on every rank, when they split together)
    if active is None and evicts_in_slots(p, target_host):
        if kv.evict_in_slots(p.scorer, p.protection, stats, state.last_pos, target, target_host):
            return True
    view = cache_view(state, stats, stat_queries, target, queries)
    mask = view.mask
    lens = mask.sum(dim=-1)
    scores, protected = p.protection.apply(p.scorer.cache_scores(view), view.pos, state.last_pos, mask)
    per_head = head_budgets(state, target.to(scores.device), scores, mask, protected, kv.grouped_counts, view.pos)
    if active is not None:
        per_head = torch.where(active.to(per_head.device)[:, None], per_head, lens)
    kv.evict(scores, per_head)
    return True


def evicts_in_slots(policy, target_host: torch.Tensor) -> bool:
    """Whether an eviction can skip the padded view: the scorer scores in slot layout
    (``Scorer.scores_in_slots``) and every head of a row keeps the same whole budget (the
    allocation's default split of an integer budget). That is H2O evicting at every decode
    step, where the view and the read-back of the new lengths were most of the step's
    eviction (bench/e2e.py, h2o-step)."""
    return (policy.scorer.scores_in_slots and not target_host.is_floating_point()
            and type(policy.allocation).head_budgets is Allocation.head_budgets)


def _union(a, b):
    return tuple(dict.fromkeys(a + b))


def step_validity(state: LayerState, mask, n: int, batch: int, device) -> tuple[torch.Tensor, bool]:
    """(valid [B, n], all_valid: no padding among them, on the host). HF hands every layer of a
    step the same mask, so a decode step's answer is kept in what the cache's layers share
    (``StepValidity``) and the other layers reuse it: one host sync per step, not one per layer.
    (Only a decode step's: a prompt's mask is large, and holding it would keep it alive after
    the prefill.)"""
    if mask is None:   # no padding anywhere: known without looking at the device
        return torch.ones(batch, n, dtype=torch.bool, device=device), True
    memo = state.shared.step_validity
    known = memo.get(mask, state.seen, device) if n == 1 else None
    if known is not None:
        return known
    valid = new_token_validity(mask, state.seen, n, batch, device)
    all_valid = bool(valid.all())
    if n == 1:
        memo.put(mask, state.seen, device, valid, all_valid)
    return valid, all_valid


def new_token_validity(mask, seen: int, n: int, batch: int, device) -> torch.Tensor:
    """[B, n] bool: False for the padding tokens among the n new ones.

    HF's 4-D masks ([B, 1, n, seen + n], bool for SDPA, additive float for eager) mask padding
    keys for every query, so a new token is real iff it may attend to itself."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    i = torch.arange(n, device=mask.device)
    diag = mask[:, 0, i, seen + i] if mask.shape[-1] >= seen + n else mask[:, 0, i, mask.shape[-1] - n + i]
    valid = diag if diag.dtype == torch.bool else diag == 0
    return valid.expand(batch, n).to(device)


def new_positions(position_ids, seen: int, n: int, batch: int, device) -> torch.Tensor:
    """[B, n] int64 positions of the new tokens: HF's position_ids (left padding aware)."""
    if position_ids is None:
        return (torch.arange(n, device=device) + seen).expand(batch, n)
    if position_ids.dtype == torch.long and position_ids.device == device and position_ids.shape == (batch, n):
        return position_ids   # HF's usual case: nothing to convert (this runs per layer and step)
    return position_ids.to(device).long().expand(batch, n)
