"""The compressed caches of one prompt decoded together, as the rows of one batch.

On a CPU a decode step of a small model reads every weight once whatever the batch, so the
harness's runs of one prompt (every policy at every budget) cost far less decoded together
than one after another. Their caches come from one recorded prefill, so each holds a subset of
the same prompt tokens per layer and KV head: ``stacked_cache`` stores those subsets as the
rows of one cache, whose decoding then attends over exactly what each run kept. Decoding
appends and never evicts under a one-shot schedule, so a row decodes as its run's cache
would alone; a policy whose schedule evicts or compresses while decoding (block-wise,
every N steps, a lookahead) decodes alone (``decodes_together``).
"""
from __future__ import annotations

import time

import torch

from kvcache_ext.cache_argument import with_cache
from kvcache_ext.engine.prompt import note_prompt, release_prefill_slack
from kvcache_ext.hf.cache import RaggedCache
from kvcache_ext.policies import Policy, Scorer


class _KeepsAll(Scorer):
    """The stacked cache's scorer: its rows were chosen by the runs' own policies."""

    def prompt_scores(self, p):
        return torch.zeros(p.k.shape[:3], device=p.k.device), None

    def cache_scores(self, view):
        raise RuntimeError("a stacked cache never evicts")


def decodes_together(policy: Policy) -> bool:
    """Whether a run of ``policy`` can decode as a row of a stacked cache: its schedule
    compresses the prompt once and evicts nothing after."""
    schedule = policy.schedule
    return schedule.prefill_block is None and schedule.decode_every is None and not schedule.lookahead


def stacking_policy(recorded) -> Policy:
    """The policy a model is patched with while it decodes a stacked cache of ``recorded``."""
    return Policy(_KeepsAll(), budget=max(1, recorded.views[0].k.shape[2]))


def kept_mask(cache: RaggedCache, layer_idx: int, n: int) -> torch.Tensor:
    """[B, H, n] bool: which of the prompt's n positions (0 to n - 1) each head of a layer holds."""
    storage = cache.layer_kv(layer_idx)
    view = storage.view(None, need_kv=False)
    B, H = storage.lens.shape
    mask = torch.zeros(B, H, n + 1, dtype=torch.bool, device=view["mask"].device)
    outside = ~view["mask"] | (view["pos"] >= n)
    mask.scatter_(2, view["pos"].masked_fill(outside, n), True)   # padding and later tokens land in column n
    return mask[..., :n]


@torch.no_grad()
def stacked_cache(policy: Policy, caches: list[RaggedCache], recorded, model=None,
                  kv_dtype: str | None = None) -> RaggedCache:
    """One cache whose row i holds what ``caches[i]`` (one row each, all compressed from
    ``recorded``) holds, for a model patched with ``policy`` (``stacking_policy``); the tokens
    are the recording's, stored as each run stored them (in ``kv_dtype``)."""
    if not caches:
        raise ValueError("stacked_cache: no caches to stack")
    rows = len(caches)
    stacked = RaggedCache(policy, len(recorded.views), model=recorded.model if model is None else model,
                          kv_dtype=kv_dtype)
    windows = recorded.windows or [None] * len(recorded.views)
    for layer_idx, (layer, view, window) in enumerate(zip(stacked.layers, recorded.views, windows)):
        n = view.k.shape[2]
        if view.k.shape[0] != 1:
            raise ValueError(f"stacked_cache: the recording has {view.k.shape[0]} rows; it stacks one-row runs")
        q, k, v = (t.expand(rows, *t.shape[1:]) for t in (view.q, view.k, view.v))
        pos, valid = view.pos.expand(rows, n), view.valid.expand(rows, n)
        keep = torch.cat([kept_mask(cache, layer_idx, n) for cache in caches]).to(k.device)
        layer.lazy_initialization(k, v)
        state = layer.state
        state.note_window(window)
        state.check_positions(n)
        state.ensure_storage(q, k)
        state.advance(n)
        note_prompt(state, pos, valid)
        state.kv.append(k, v, pos, keep & valid[:, None, :])
        release_prefill_slack(state)
    return stacked


@torch.no_grad()
def greedy_rows(model, cache, logits: torch.Tensor, max_new_tokens: int, eos_id: int | None):
    """Greedy tokens of every row after a prefill whose last logits are ``logits`` [B, V]; the
    model feeds each row's token back over ``cache`` until every row has ended (its EOS, or
    ``max_new_tokens``). A row that has ended is fed padding: its cache holds what its run's
    cache would hold alone. Returns (per row its token ids, the seconds of one batched step)."""
    token = logits.argmax(dim=-1, keepdim=True)
    new = [[t] for t in token[:, 0].tolist()]
    ended = [eos_id is not None and row[-1] == eos_id for row in new]
    seen = cache.get_seq_length()
    mask = None   # [B, seen + 1]: 0 for the padding fed to the rows that have ended
    steps, start = 0, time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if all(ended):
            break
        if any(ended):
            if mask is None:
                mask = torch.ones(len(new), seen, dtype=torch.long, device=token.device)
            mask = torch.cat([mask, torch.tensor([[0 if e else 1] for e in ended], device=token.device)], dim=1)
        out = model(token, attention_mask=mask, **with_cache(model, cache), use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        steps, seen = steps + 1, seen + 1
        for row, t in enumerate(token[:, 0].tolist()):
            if not ended[row]:
                new[row].append(t)
                ended[row] = (eos_id is not None and t == eos_id) or len(new[row]) >= max_new_tokens
    return new, (time.perf_counter() - start) / max(steps, 1)


@torch.no_grad()
def bytes_after_decoding(cache: RaggedCache, question: int, fed: int, question_in_steps: bool = False) -> int:
    """The bytes a run's compressed ``cache`` would hold had it decoded alone: ``question``
    tokens appended in one call (0: none; ``question_in_steps``: one at a time, as a model with
    sliding-window layers is asked), then ``fed`` tokens one at a time (a sliding layer dropping
    what each no longer sees). Only their count and positions decide the pages, so zeros are
    appended in their place; the cache is spent after."""
    if question_in_steps:
        question, fed = 0, question + fed
    for layer in cache.layers:
        state, kv = layer.state, layer.state.kv
        (H, D, _), (_, dtype, device) = state.layout, state.tokens
        seen = state.seen
        zeros = torch.zeros(1, H, max(question, 1), D, dtype=dtype, device=device)
        positions = torch.arange(seen, seen + question + fed, device=device)[None]   # [1, every token to come]
        if question:
            kv.append(zeros, zeros, positions[:, :question], None)
        one = zeros[:, :, :1]
        for i in range(question, question + fed):
            at = positions[:, i:i + 1]
            if state.window is not None and seen + i + 1 > state.window:
                kv.drop_before(state.window_start(at[0]))
            kv.append(one, one, at, None)
    return cache.nbytes
