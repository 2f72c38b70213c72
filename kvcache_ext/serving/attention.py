"""The patched attention over a continuous-batching step: the packed batch split by request,
each request's share run through the eviction engine on its own cache, as it would run alone.

The engine may split a prompt over several steps (its token budget per step). A policy that
compresses a prompt once (no ``prefill_block``) needs all of it: its chunks are held dense
(``PromptChunks``), each chunk's output is the dense causal attention over the chunks so far,
and the last chunk hands the whole prompt to the engine's one-shot prefill (``prefill_dense``),
as a prompt that came whole. A block-wise prefill runs each chunk as it comes, its blocks counted
from the chunk's start.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcache_ext.engine.forward import layer_forward, prefill_dense


@dataclass
class PromptChunks:
    """One layer's share of a prompt that arrives in chunks: q, k, v [1, heads, n, D] each."""

    q: list = field(default_factory=list)
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    def add(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.q.append(q)
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.q, dim=2), torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def chunk_attention(q, k, v, past: int, scale: float) -> torch.Tensor:
    """q [1, Hq, n, D] at positions past .. past + n - 1 over k, v [1, H, past + n, D], causal:
    [1, n, Hq, D]."""
    n, total = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    visible = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                         attn_mask=visible, scale=scale)
    return out.transpose(1, 2)


def attend_packed(packed, dense, module, query, key, value, scaling, window=None):
    """query [1, Hq, T, D], key/value [1, H, T, D]: the step's T tokens, request after request
    (``packed.cache.step``). Returns [1, T, Hq, D] like HF's attention functions. ``window``:
    the layer's sliding window (None: none), which the engine's steps here do not apply: a
    request whose sequence passes it is refused."""
    cache, layer_idx = packed.cache, packed.layer_idx
    outs = []
    for request in cache.step:
        if window is not None and request.past_length + request.count > window:
            raise NotImplementedError(
                f"layer {layer_idx} uses sliding-window attention (window {window}) and request "
                f"{request.request_id} is {request.past_length + request.count} tokens long: continuous "
                "batching does not apply sliding windows yet (generate does)")
        part = slice(request.first, request.first + request.count)
        q, k, v = query[:, :, part], key[:, :, part], value[:, :, part]
        state = cache.requests[request.request_id].layers[layer_idx].state
        chunked = (request.request_id, layer_idx) in cache.chunks
        if (chunked or not request.prompt_done) and state.seen == 0 and state.policy.schedule.prefill_block is None:
            chunks = cache.chunks.setdefault((request.request_id, layer_idx), PromptChunks())
            q_all, k_all, v_all = chunks.add(q, k, v)
            outs.append(chunk_attention(q, k_all, v_all, request.past_length, scaling))
            if request.prompt_done:   # the whole prompt: the one-shot prefill, as if it came whole
                del cache.chunks[(request.request_id, layer_idx)]
                total = k_all.shape[2]
                prefill_dense(state, q_all, k_all, v_all, torch.arange(total, device=q.device)[None],
                              torch.ones(1, total, dtype=torch.bool, device=q.device), scaling)
            continue
        positions = torch.arange(request.past_length, request.past_length + request.count,
                                 device=query.device)[None]
        # No mask: a request alone has no padding, and its prompt's dense attention is causal.
        outs.append(layer_forward(state, dense, module, q, k, v, None, scaling, positions))
    return torch.cat(outs, dim=1)
