"""Fidelity: how far the next-token distributions drift from the full cache's, teacher-forced.

A context of corpus prose is prefilled (and compressed by the policy), then the true
continuation is fed token by token. At each continuation token we compare the policy's
next-token distribution q with the full cache's p: KL(p || q) in nats and whether the argmax
agrees. With a one-shot schedule and no decode eviction, the continuation goes in one call
(the same as token by token, since nothing is evicted meanwhile) over the shared prefill.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvcache_ext.hf.patching import patch
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation.decoding import cache_bytes, full_cache_from
from kvcache_ext.evaluation.named_policies import policy_runs, run_label
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill


@dataclass
class FidelityRecord:
    task: str
    mode: str
    policy: str
    budget: int | None
    length: int         # context tokens
    seed: int
    kl: float           # mean KL(full || policy) per continuation token, nats
    top1: float         # share of continuation tokens where the argmax agrees
    tokens: int         # continuation tokens compared
    kv_bytes: int
    full_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _feed(model, cache, tokens: torch.Tensor, one_call: bool) -> torch.Tensor:
    """Logits [C, V] after each of ``tokens`` [1, C] fed over ``cache``."""
    if one_call:
        return model(tokens, **with_cache(model, cache), use_cache=True).logits[0]
    return torch.cat([model(tokens[:, i:i + 1], **with_cache(model, cache), use_cache=True).logits[0]
                      for i in range(tokens.shape[1])])


@torch.no_grad()
def run_text(model, context: torch.Tensor, continuation: torch.Tensor, seed: int, policies, budgets,
             schedule=None, on_run=None, tokenizer=None, kv_dtype: str | None = None):
    """Every (policy, budget) on one context [1, n] and its continuation [1, C].
    ``on_run(record)`` is called as each run ends. ``tokenizer``: the model's (what ``patch``
    needs for a policy with spans). ``kv_dtype``: what the policies' pages hold (``patch``'s; their
    runs are recorded as ``run_label`` names them)."""
    recorded = record_prefill(model, context)
    full = full_cache_from(model, recorded)
    full_bytes = cache_bytes(full)
    p_log = torch.log_softmax(_feed(model, full, continuation, True).float(), dim=-1)
    del full
    out = []
    n, c = context.shape[1], continuation.shape[1]
    if "full" in policies:
        out.append(FidelityRecord("fidelity", "teacher-forced", "full", None, n, seed, 0.0, 1.0, c,
                                  full_bytes, full_bytes))
        on_run and on_run(out[-1])
    for name, budget, policy in policy_runs(policies, budgets, schedule):
        sched = policy.schedule
        with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
            if sched.prefill_block is None:
                cache = compressed_cache(policy, recorded, handle.model_parts, kv_dtype)
            else:
                cache = handle.new_cache()
                model(context, **with_cache(model, cache), use_cache=True)
            one_call = sched.prefill_block is None and sched.decode_every is None
            q_log = torch.log_softmax(_feed(model, cache, continuation, one_call).float(), dim=-1)
        kl = (p_log.exp() * (p_log - q_log)).sum(dim=-1)
        top1 = (p_log.argmax(-1) == q_log.argmax(-1)).float()
        out.append(FidelityRecord("fidelity", "teacher-forced", run_label(name, kv_dtype), budget, n, seed,
                                  float(kl.mean()), float(top1.mean()), c, cache_bytes(cache),
                                  full_bytes))
        on_run and on_run(out[-1])
    return out
