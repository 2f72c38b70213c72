"""Several new tokens over a layer's cache, a block at a time: a block-wise prefill, or a later
prompt over a filled cache. Each block is appended, attended over the cache, fed to the scorer
and, under a block-wise schedule, evicted to the layer's budget.
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.eviction import cache_view, evict, rule_eviction
from kvcache_ext.engine.state import LayerState


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
                             pos[:, i:i + block], valid[:, i:i + block], scale, all_valid=all_valid)
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
                           valid.gather(1, idx) & inside, scale, active=count > 0)
        rows, cols = inside.nonzero(as_tuple=True)
        out[rows, :, idx[rows, cols]] = blk[rows, :, cols]
    return out


def attend_block(state: LayerState, q, k, v, pos, valid, scale, active=None, all_valid: bool = False):
    """Appends a block, attends over the cache, feeds the scorer, evicts (under a block-wise
    schedule). ``active`` [B]: rows that have tokens in this block (the others keep their
    cache as is). ``all_valid``: no padding in the block, known on the host (saves the syncs
    that a validity mask costs the store's append and this function)."""
    p, kv = state.policy, state.kv
    caps = p.scorer.capabilities
    B, H, m, _ = k.shape
    kv.append(k, v, pos, None if all_valid else valid[:, None, :].expand(B, H, m))
    state.note_newest(pos.masked_fill(~valid, -1).max(dim=1).values)
    # Padding queries see nothing (q_pos -1); a lone real query needs no positions.
    q_pos = pos.masked_fill(~valid, -1) if m > 1 or not all_valid else None
    evict_now = p.schedule.prefill_block is not None
    target, target_host = state.budget, state.budget_host
    over_cache = p.schedule.evicts_over_cache
    track = caps.tracked_stats if over_cache else ()
    accumulate = caps.accumulates if over_cache else ()
    rule = rule_eviction(p, target, target_host) if evict_now and active is None else None
    wanted = caps.evict_stats if evict_now and rule is None else ()
    window = caps.stats_window if wanted else None
    if window is not None and m > window:
        # The eviction statistics come from the last `window` queries only (SnapKV's window).
        head, head_stats = kv.attend(q[:, :, :m - window], scale, q_pos[:, :m - window], track)
        if accumulate:
            kv.accumulate(head_stats, accumulate)
        tail, stats = kv.attend(q[:, :, m - window:], scale, q_pos[:, m - window:], _union(track, wanted))
        out, n_stat = torch.cat([head, tail], dim=2), window
    else:
        out, stats = kv.attend(q, scale, q_pos, _union(track, wanted))
        n_stat = m
    if accumulate:
        kv.accumulate(stats, accumulate)
    queries = (q, q_pos, scale)
    if caps.updates_from_view and over_cache:
        # Scorers whose per-token state needs more than the kernel's statistics (their own
        # softmax of the new queries over the cached keys, say) update from a padded view.
        view = cache_view(state, {name: stats[name] for name in track}, n_stat, target, queries)
        kv.set_channels(p.scorer.update_view(view))
    if evict_now:
        evicted = evict(state, target, target_host, {name: stats[name] for name in wanted}, n_stat,
                        active, queries, rule=rule)
        if evicted and caps.output_after_eviction:
            out, _ = kv.attend(q, scale, q_pos, ())   # the block's output over what was kept
    return out


def _union(a, b):
    return tuple(dict.fromkeys(a + b))
