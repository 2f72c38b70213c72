"""One layer's attention call on a patched model, with its policy (``layer_forward``), and the
one door of a dense prefill (``prefill_dense``).

Called by the attention function that ``kvcache_ext.patch`` registers, for a layer whose cache
is a ``RaggedCache``, and by the evaluation harness to build a cache from a recorded dense
prefill. A call is one of four kinds: a reconstruction pass over a held prompt
(``engine.reconstruction``), the dense prefill of a fresh prompt, a decode step
(``engine.decode``: one token per row), or several tokens over the cache (``engine.blocks``).
Storage-agnostic: ``LayerState.kv`` is any ``LayerStorage``.
"""
from __future__ import annotations

import torch

from kvcache_ext.engine.blocks import attend_in_blocks
from kvcache_ext.engine.decode import decode
from kvcache_ext.engine.lookahead import hold_prompt_queries, note_queries
from kvcache_ext.engine.prompt import compress_prompt, release_prefill_slack
from kvcache_ext.engine.reconstruction import attend_context, hold_prompt
from kvcache_ext.engine.state import LayerState
from kvcache_ext.policies.schedule import MAX_BLOCK


def layer_forward(state: LayerState, dense_attention, module, q, k, v, attention_mask, scale,
                  position_ids, **kwargs):
    """Attention of one layer over its evicting cache. Returns [B, n, Hq, D] like HF's functions."""
    B, _, n, _ = q.shape
    if state.context is not None:   # a reconstruction pass over a held prompt
        return attend_context(state, q, k, v, new_positions(position_ids, state.seen, n, B, q.device))
    graph = state.shared.graph_step
    window = kwargs.get("sliding_window")
    if window is not None and graph is None:   # a decode graph serves no sliding-window layer
        state.note_window(window)
        if state.seen + n > window:
            check_window_call(state, n)
            if state.kv is not None:   # a decode step: what its query no longer sees goes first
                drop_outside_window(state, new_positions(position_ids, state.seen, 1, B, q.device)[:, 0])
    state.check_positions(n)
    pos = new_positions(position_ids, state.seen, n, B, q.device)
    if n == 1 and state.kv is not None:   # a decode step
        state.ensure_storage(q, k)   # checks the tokens against those held
        if graph is not None:
            # A graph serves no step with padding (it read the mask on the host before the
            # step) and reads nothing of the device inside it; its counts are noted around
            # every run of the graph.
            return decode(state, q, k, v, pos, None, scale, plan=graph.plan(state.layer_idx)).transpose(1, 2)
        valid = None if attention_mask is None else decode_validity(state, attention_mask, B, q.device)
        out = decode(state, q, k, v, pos, valid, scale)
        state.finish_decode_step()
        if state.lookahead is not None:   # a deferred compression: this step's query joins its window
            note_queries(state, q, pos, None if valid is None else valid[:, None], decode_step=True)
        return out.transpose(1, 2)
    valid, all_valid = step_validity(state, attention_mask, n, B, q.device)
    if state.seen == 0 and n > 1 and state.policy.schedule.prefill_block is None:
        out = dense_attention(module, q, k, v, attention_mask, scaling=scale, dropout=0.0, **kwargs)[0]
        prefill_dense(state, q, k, v, pos, valid, scale)
        return out
    state.ensure_storage(q, k)
    fresh = state.seen == 0
    if fresh:
        state.ensure_budget(valid.sum(dim=1))
    if n == 1:   # a one-token prompt: the cache's first decode step
        out = decode(state, q, k, v, pos, None if all_valid else valid[:, 0], scale)
        state.finish_decode_step()
        return out.transpose(1, 2)
    state.advance(n)
    block = min(state.policy.schedule.prefill_block or MAX_BLOCK, MAX_BLOCK)
    out = attend_in_blocks(state, q, k, v, pos, valid, scale, block, all_valid)
    if fresh:
        release_prefill_slack(state)
    if state.lookahead is not None:   # tokens after a prompt whose compression waits: their queries join
        note_queries(state, q, pos, valid, decode_step=False)
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
    if state.policy.scorer.capabilities.reconstructs:
        hold_prompt(state, k, v, pos, valid, scale)   # scored and compressed after the passes
        return
    if state.policy.schedule.lookahead:
        hold_prompt_queries(state, q, k, v, pos, valid, scale)   # compressed after the lookahead steps
        return
    compress_prompt(state, q, k, v, pos, valid, scale)
    release_prefill_slack(state)


def check_window_call(state: LayerState, n: int) -> None:
    """A sliding-window layer whose sequence passes its window: the calls whose attention the
    engine windows exactly are a decode step (one token: the tokens it no longer sees are
    dropped first), the one-shot dense prefill of a fresh prompt (the model's own attention
    with HF's sliding mask; the prompt's tokens outside the next token's window are not kept)
    and the reconstruction passes over a held prompt (``engine.reconstruction``, a mask per
    query). Several tokens over a cache (a block-wise prefill, a second prompt) would need a
    window per query, which the store's attention does not take: refused."""
    if n > 1 and (state.seen or state.policy.schedule.prefill_block is not None):
        raise NotImplementedError(
            f"layer {state.layer_idx} uses sliding-window attention (window {state.window}); kvcache_ext "
            "windows a one-shot prefill of a fresh prompt and one-token decode steps, not a call of "
            f"{n} tokens over a cache that has seen {state.seen} (a block-wise prefill or a later "
            "prompt past the window)")


def drop_outside_window(state: LayerState, newest: torch.Tensor) -> None:
    """Drops from a sliding-window layer the tokens that a query at ``newest`` [B] does not see:
    every later query is newer, so none will see them again."""
    state.kv.drop_before(state.window_start(newest))


def decode_validity(state: LayerState, mask, batch: int, device) -> torch.Tensor | None:
    """A decode step's [B] validity (None: no padding), from HF's mask."""
    valid, all_valid = step_validity(state, mask, 1, batch, device)
    return None if all_valid else valid[:, 0]


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
