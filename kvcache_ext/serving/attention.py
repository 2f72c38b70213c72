"""The patched attention over a continuous-batching step: the packed batch split by request,
each request's share run through the eviction engine on its own cache, as it would run alone."""
from __future__ import annotations

import torch

from kvcache_ext.engine.eviction import layer_forward


def attend_packed(packed, dense, module, query, key, value, scaling):
    """query [1, Hq, T, D], key/value [1, H, T, D]: the step's T tokens, request after request
    (``packed.cache.step``). Returns [1, T, Hq, D] like HF's attention functions."""
    cache, layer_idx = packed.cache, packed.layer_idx
    outs = []
    for request in cache.step:
        part = slice(request.first, request.first + request.count)
        state = cache.requests[request.request_id].layers[layer_idx].state
        if request.count > 1 and state.seen and state.policy.schedule.prefill_block is None:
            raise ValueError(
                f"continuous batching split request {request.request_id}'s prompt into chunks (this one "
                f"starts at token {request.past_length}), but its policy compresses a prompt once, whole: "
                "give ContinuousBatchingConfig a max_batch_tokens of at least the longest prompt")
        positions = torch.arange(request.past_length, request.past_length + request.count,
                                 device=query.device)[None]
        # No mask: a request alone has no padding, and its prompt's dense attention is causal.
        outs.append(layer_forward(state, dense, module, query[:, :, part], key[:, :, part],
                                  value[:, :, part], None, scaling, positions))
    return torch.cat(outs, dim=1)
